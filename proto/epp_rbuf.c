/* SPDX-License-Identifier: MIT */
/* Growable stream buffers and the framing loop (epp_rbuf.h). */
#include "epp_rbuf.h"

#include <stdlib.h>
#include <string.h>

int epp_rbuf_room(struct epp_rbuf *b, size_t need, size_t min)
{
	const size_t live = epp_rbuf_live(b);
	if (b->off && b->cap - b->len < need) {
		memmove(b->p, b->p + b->off, live);
		b->off = 0;
		b->len = live;
	}
	if (b->cap - b->len >= need)
		return 0;
	size_t cap = b->cap ? b->cap : (min ? min : 4096);
	while (cap - b->len < need) {
		if (cap > SIZE_MAX / 2)
			return -1;
		cap *= 2;
	}
	uint8_t *p = realloc(b->p, cap);
	if (!p)
		return -1;
	b->p = p;
	b->cap = cap;
	return 0;
}

int epp_rbuf_put(struct epp_rbuf *b, const void *p, size_t n)
{
	if (!n)
		return 0;
	if (epp_rbuf_room(b, n, 0))
		return -1;
	memcpy(b->p + b->len, p, n);
	b->len += n;
	return 0;
}

void epp_rbuf_take(struct epp_rbuf *b, size_t n)
{
	b->off += n;
	if (b->off == b->len)
		b->off = b->len = 0;
}

void epp_rbuf_shrink(struct epp_rbuf *b, size_t keep, size_t small)
{
	const size_t live = epp_rbuf_live(b);
	if (b->cap <= keep || live > small)
		return;
	memmove(b->p, b->p + b->off, live);
	b->off = 0;
	b->len = live;
	uint8_t *p = realloc(b->p, small);
	if (p) {
		b->p = p;
		b->cap = small;
	}
}

void epp_rbuf_free(struct epp_rbuf *b)
{
	free(b->p);
	*b = (struct epp_rbuf){0};
}

int epp_frames(struct epp_rbuf *b, size_t trailer, epp_frame_fn fn,
	       void *arg, struct epp_hdr *h, char *err, size_t errlen,
	       size_t *want)
{
	if (want)
		*want = 0;
	while (epp_rbuf_live(b) >= EPP_HDR_SIZE) {
		const uint8_t *f = b->p + b->off;
		int rc = epp_hdr_decode(f, h, err, errlen);
		if (rc)
			return rc;
		const size_t need = EPP_HDR_SIZE + (size_t)h->length + trailer;
		if (epp_rbuf_live(b) < need) {
			if (want)
				*want = need;
			return 0;
		}
		/* fn must not touch b (it may close the connection: its
		 * buffer is freed later, from the loop) */
		rc = fn(arg, h, f);
		epp_rbuf_take(b, need);
		if (rc)
			return rc;
	}
	return 0;
}
