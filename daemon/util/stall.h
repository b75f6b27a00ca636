/* SPDX-License-Identifier: MIT */
/*
 * The event loop's stall watch. Everything epd serves goes through one
 * loop thread; a callback that blocks (a driver call waiting for the GPU,
 * a lock) stops every client and peer. A thread of its own notices when
 * the loop has not turned for a while and says so in the log, naming what
 * the loop was last doing (epd_stall_mark), and again when it turns again.
 * Marks are cheap (a store and, with an object name, a short copy).
 */
#ifndef EPD_STALL_H
#define EPD_STALL_H

#include <stdint.h>
#include <uv.h>

/* Start watching loop: a stall of warn_ms or more is logged. 0, or -1
 * (the thread could not start; epd runs without the watch). */
int epd_stall_start(uv_loop_t *loop, unsigned warn_ms);
void epd_stall_stop(void);

/* What the loop thread does now: what (a static string) and obj (copied,
 * may be NULL: a group's name, a client's). Cleared at every loop turn. */
void epd_stall_mark(const char *what, const char *obj);

/* Loop stalls seen so far and the longest, in ms (for status). */
void epd_stall_stats(uint64_t *count, uint64_t *longest_ms);

#endif
