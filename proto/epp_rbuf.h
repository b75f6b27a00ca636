/* SPDX-License-Identifier: MIT */
/*
 * A stream's bytes on their way in or out, and the framing loop over them:
 * what the daemon's client connections, its peer connections and the rdma
 * transport's send queue share (epp_rbuf.c).
 */
#ifndef EPP_RBUF_H
#define EPP_RBUF_H

#include <stddef.h>
#include <stdint.h>

#include "epp.h"

/* A growable byte buffer: bytes [off, len) of p are live; appends go at
 * len, reads take from off. Zeroed is empty. */
struct epp_rbuf {
	uint8_t *p;
	size_t off, len, cap;
};

static inline size_t epp_rbuf_live(const struct epp_rbuf *b)
{
	return b->len - b->off;
}

/* Room for `need` more bytes after len: the live bytes move to the front,
 * and the buffer doubles (from `min`) as far as needed. 0, or -1 when
 * out of memory (b unchanged). */
int epp_rbuf_room(struct epp_rbuf *b, size_t need, size_t min);
/* Append n bytes (copied). 0 or -1. */
int epp_rbuf_put(struct epp_rbuf *b, const void *p, size_t n);
/* Take n live bytes off the front. */
void epp_rbuf_take(struct epp_rbuf *b, size_t n);
/* Once at most `small` live bytes remain in a buffer grown past `keep`,
 * give it back down to `small` (a large frame's memory is not kept). */
void epp_rbuf_shrink(struct epp_rbuf *b, size_t keep, size_t small);
void epp_rbuf_free(struct epp_rbuf *b);

/* A frame: its header, and where it starts (header, payload, then the
 * trailer, if any). Nonzero stops the loop. */
typedef int (*epp_frame_fn)(void *arg, const struct epp_hdr *h,
			    const uint8_t *frame);

/* The framing loop: hands the whole frames at b's front, each followed by
 * `trailer` bytes (an authentication tag, or 0), to fn, and takes them off
 * b, until one is incomplete or fn returns nonzero (that frame is taken
 * too; the value is returned). A header that does not decode returns its
 * EP_ code, with h and err filled (h as far as it decoded: a reply can
 * echo its req_id) and nothing taken. *want (if given): the whole size of
 * an incomplete frame at the front, else 0. */
int epp_frames(struct epp_rbuf *b, size_t trailer, epp_frame_fn fn,
	       void *arg, struct epp_hdr *h, char *err, size_t errlen,
	       size_t *want);

#endif
