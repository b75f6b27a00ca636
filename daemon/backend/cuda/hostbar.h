/* SPDX-License-Identifier: MIT */
/*
 * The host barrier: a daemon thread that runs every barrier of a
 * single-node GPU group from host words in the group's control page
 * (EPP_CTL_HB). A rank's stream writes its doorbell there and waits for its
 * done word there (stream memory operations on host memory); the thread
 * needs no GPU work of the daemon at all, so without MPS no context switch
 * to the daemon's context sits in a barrier's path.
 *
 * The thread sleeps on a futex while no rank has a barrier enqueued (the
 * rank's CPU posts EPP_HB_REQ before enqueueing, and wakes it), spins while
 * one is pending, and backs off to short sleeps after a millisecond without
 * progress. Its state is a struct ek_bar_state, as the resident barrier
 * kernel's: the daemon's loop reads timeouts, mismatches and counts there.
 * No CUDA here: the unit test drives it with CPU threads.
 */
#ifndef EPD_HOSTBAR_H
#define EPD_HOSTBAR_H

#include <stddef.h>
#include <stdint.h>

#include "ek.h"

struct epd_hostbar;

/* Start serving the rpn local ranks of the control page at map (at least
 * EPP_BUF_HEADER bytes, shared with the ranks). budget_ns: from a barrier's
 * first doorbell to its last; last: the op number the group is at. */
int epd_hostbar_start(struct epd_hostbar **out, uint8_t *map, uint32_t rpn,
		      uint64_t budget_ns, uint64_t last, char *err,
		      size_t errlen);
/* Its state (the thread writes it; read with atomic loads). */
struct ek_bar_state *epd_hostbar_state(struct epd_hostbar *h);
/* Ask the thread to end (returns at once). */
void epd_hostbar_stop(struct epd_hostbar *h);
/* Stop, wait for the thread, free. NULL is fine. */
void epd_hostbar_free(struct epd_hostbar *h);
/* Release every rank's stream of a failed group: done words to far (only
 * ever raised, so the thread cannot lower them after). */
void epd_hostbar_release(uint8_t *map, uint32_t rpn, uint32_t far);

#endif
