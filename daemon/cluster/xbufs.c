/* SPDX-License-Identifier: MIT */
/*
 * The cross-node engine (xnode_int.h): large buffers (packed rows, staged
 * rows) kept between ops, and the shared reference that returns one when
 * its last frame is written.
 */
#include "xnode_int.h"

/* A buffer of at least want bytes (its size in *cap), or NULL. */
uint8_t *xbuf_get(struct epd_server *srv, size_t want, size_t *cap)
{
	struct epd_xbufs *b = srv->xnode->xbufs;
	int best = -1, big = -1;
	for (int i = 0; b && i < b->n; i++) {
		if (b->s[i].cap >= want &&
		    (best < 0 || b->s[i].cap < b->s[best].cap))
			best = i;
		if (big < 0 || b->s[i].cap > b->s[big].cap)
			big = i;
	}
	int i = best >= 0 ? best : big;
	if (i < 0) {
		*cap = want;
		return malloc(want);
	}
	uint8_t *p = b->s[i].p;
	size_t c = b->s[i].cap;
	b->bytes -= c;
	b->s[i] = b->s[--b->n];
	if (c < want) {
		uint8_t *np = realloc(p, want);
		if (!np) {
			free(p);
			return NULL;
		}
		p = np;
		c = want;
	}
	*cap = c;
	return p;
}

/* Whether a group spanning nodes is still here (buffers worth keeping). */
static bool any_xgroup(struct epd_server *srv)
{
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->groups)
	{
		if (LIST_ENTRY(it, struct epd_group, node)->nnodes > 1)
			return true;
	}
	return false;
}

void xbuf_put(struct epd_server *srv, uint8_t *p, size_t cap)
{
	if (!p)
		return;
	if (!any_xgroup(srv)) {
		free(p); /* the last one is gone: nothing to keep for */
		return;
	}
	if (!srv->xnode->xbufs)
		srv->xnode->xbufs = calloc(1, sizeof(*srv->xnode->xbufs));
	struct epd_xbufs *b = srv->xnode->xbufs;
	if (!b || cap > XBUF_KEEP) {
		free(p);
		return;
	}
	while (b->n && (b->n == XBUF_SLOTS || b->bytes + cap > XBUF_KEEP)) {
		int small = 0;
		for (int i = 1; i < b->n; i++)
			if (b->s[i].cap < b->s[small].cap)
				small = i;
		if (b->s[small].cap >= cap) {
			free(p); /* the kept ones are all larger */
			return;
		}
		free(b->s[small].p);
		b->bytes -= b->s[small].cap;
		b->s[small] = b->s[--b->n];
	}
	b->s[b->n].p = p;
	b->s[b->n].cap = cap;
	b->n++;
	b->bytes += cap;
}

void epd_xbufs_trim(struct epd_server *srv)
{
	if (srv->xnode->xbufs && !any_xgroup(srv)) {
		epd_xbufs_free(srv);
		epd_info("no group spans nodes any more: row buffers freed");
	}
}

void epd_xbufs_free(struct epd_server *srv)
{
	if (!srv->xnode)
		return;
	struct epd_xbufs *b = srv->xnode->xbufs;
	for (int i = 0; b && i < b->n; i++)
		free(b->s[i].p);
	free(b);
	srv->xnode->xbufs = NULL;
}

size_t epd_xbufs_bytes(const struct epd_server *srv)
{
	return srv->xnode && srv->xnode->xbufs ? srv->xnode->xbufs->bytes : 0;
}

void epd_sref_put(struct epd_sref *r)
{
	if (--r->refs)
		return;
	xbuf_put(r->srv, r->p, r->cap);
	free(r);
}
