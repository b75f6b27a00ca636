/* SPDX-License-Identifier: MIT */
/*
 * The data path's proxy: a bounded ring of fixed-size commands that any
 * thread pushes to, and one thread that takes them in order and hands them,
 * in batches, to a poster (the rdma transport's: one RDMA WRITE work
 * request per command).
 *
 * The ring is Vyukov's bounded queue: a producer reserves a position with
 * one fetch-and-add on the head, waits until the slot's stamp says the
 * slot is free (stamp == position), writes the command and publishes it
 * (stamp = position + 1, release). The proxy waits for stamp == tail + 1,
 * reads, and frees the slot (stamp = tail + size). No lock, no syscall on
 * the way; the proxy spins while work comes and sleeps on a futex when the
 * ring has been empty for a while (a producer wakes it).
 *
 * Tickets: epd_proxy_push returns the command's position; the loop asks
 * epd_proxy_passed(p, ticket) whether the proxy has handed it to the
 * poster, which is when the buffers named in it may be let go of as far as
 * the proxy is concerned. No verbs here: the unit test drives it with CPU
 * threads and a poster that copies.
 */
#ifndef EPD_PROXY_H
#define EPD_PROXY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "transport/transport.h"

/* The commands are writes (struct epd_cmd, transport.h). */
/* Called on the proxy thread with n (>= 1) commands in ring order. */
typedef void (*epd_proxy_post_fn)(void *arg, const struct epd_cmd *c,
				  size_t n);

struct epd_proxy;

/* A ring of `slots` commands (a power of two) and its thread. */
struct epd_proxy *epd_proxy_new(uint32_t slots, epd_proxy_post_fn post,
				void *arg, char *err, size_t errlen);
/* Queue c (copied); waits while the ring is full. Returns the ticket
 * (>= 1), or 0 once the proxy is stopping. Any thread. */
uint64_t epd_proxy_push(struct epd_proxy *p, const struct epd_cmd *c);
/* The ticket of the last command pushed so far (0: none). */
uint64_t epd_proxy_head(const struct epd_proxy *p);
/* Has the proxy handed command `ticket` (and every one before) to the
 * poster? */
bool epd_proxy_passed(const struct epd_proxy *p, uint64_t ticket);
/* Commands handed to the poster so far, and batches they came in. */
uint64_t epd_proxy_posted(const struct epd_proxy *p, uint64_t *batches);
/* Hand over what is queued, stop the thread, free. NULL is fine. */
void epd_proxy_free(struct epd_proxy *p);

#endif
