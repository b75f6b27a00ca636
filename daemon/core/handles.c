/* SPDX-License-Identifier: MIT */
/*
 * The handles of a group: the routing of every fresh dispatch, kept until
 * each local rank released it (EPP_RELEASE) or the group ends. A training
 * step keeps one per MoE layer from the forward pass to the backward one
 * (58 for DeepSeek-V3), so nothing is evicted: the memory they hold is
 * bounded by the `max_handle_bytes` limit, and a dispatch past it fails
 * the group with EP_ELIMIT, naming what is held.
 *
 * The table is an array sorted by seq (handles are numbered in the order
 * of their dispatches, so an insert appends); lookups bisect it. Each entry
 * records which local ranks still hold it.
 */
#include "backend.h"
#include "core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct epd_handle_ent {
	uint64_t seq;
	struct ek_route *route;
	uint64_t bytes;
	uint32_t holders; /* local ranks that still hold it */
	uint64_t *held;   /* bitmap over local ranks */
};

#define EPD_HANDLES_MAX (1u << 20) /* entries a group's table may have */

static uint64_t route_bytes(const struct ek_route *r)
{
	uint64_t b = sizeof(*r) + (uint64_t)r->world * (4 + 8 + 4) +
		     (uint64_t)r->world * r->world * 4;
	for (uint32_t s = 0; s < r->world; s++)
		b += ((uint64_t)r->num_tokens[s] * r->world + 1) * 4;
	return b;
}

static long find(const struct epd_group *g, uint64_t seq)
{
	size_t lo = 0, hi = g->nhandles;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		if (g->handles[mid].seq < seq)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo < g->nhandles && g->handles[lo].seq == seq ? (long)lo : -1;
}

struct ek_route *epd_route_find(struct epd_group *g, uint64_t seq)
{
	long i = find(g, seq);
	return i < 0 ? NULL : g->handles[i].route;
}

bool epd_handle_held(const struct epd_group *g, uint64_t seq, uint32_t l)
{
	long i = find(g, seq);
	return i >= 0 && g->handles[i].held[l / 64] >> (l % 64) & 1;
}

int epd_handle_add(struct epd_group *g, uint64_t seq, struct ek_route *r,
		   uint64_t extra, char *err, size_t errlen)
{
	uint32_t rpn = g->shape.ranks_per_node;
	uint64_t bytes = route_bytes(r) + extra;
	uint64_t limit = g->srv->cfg.limits.handle_bytes;
	if ((limit && g->handle_bytes + bytes > limit) ||
	    g->nhandles >= EPD_HANDLES_MAX) {
		snprintf(err, errlen,
			 "group %s holds %zu handles not released (%llu "
			 "bytes of routing); one more (%llu bytes) exceeds "
			 "max_handle_bytes = %llu: release handles "
			 "(ep_handle_release) once their combine ran",
			 g->shape.name, g->nhandles,
			 (unsigned long long)g->handle_bytes,
			 (unsigned long long)bytes, (unsigned long long)limit);
		return EP_ELIMIT;
	}
	if (g->nhandles && g->handles[g->nhandles - 1].seq >= seq) {
		snprintf(err, errlen, "handle %llu out of order",
			 (unsigned long long)seq);
		return EP_EINVAL;
	}
	if (g->nhandles == g->hcap) {
		size_t cap = g->hcap ? g->hcap * 2 : 64;
		struct epd_handle_ent *n =
			realloc(g->handles, cap * sizeof(*n));
		if (!n)
			goto nomem;
		g->handles = n;
		g->hcap = cap;
	}
	struct epd_handle_ent *e = &g->handles[g->nhandles];
	size_t words = (rpn + 63) / 64;
	e->held = malloc(words * sizeof(uint64_t));
	if (!e->held)
		goto nomem;
	memset(e->held, 0, words * sizeof(uint64_t));
	for (uint32_t l = 0; l < rpn; l++)
		e->held[l / 64] |= 1ull << (l % 64);
	e->seq = seq;
	e->route = r;
	e->bytes = bytes;
	e->holders = rpn;
	g->nhandles++;
	g->handle_bytes += bytes;
	return 0;
nomem:
	snprintf(err, errlen, "out of memory for handle %llu",
		 (unsigned long long)seq);
	return EP_ENOMEM;
}

static void drop_at(struct epd_group *g, long i)
{
	struct epd_handle_ent *e = &g->handles[i];
	g->handle_bytes -= e->bytes;
	ek_route_free(e->route);
	free(e->held);
	memmove(e, e + 1, (g->nhandles - (size_t)i - 1) * sizeof(*e));
	g->nhandles--;
}

int epd_handle_release(struct epd_group *g, uint64_t seq, uint32_t l)
{
	long i = find(g, seq);
	if (i < 0 || !(g->handles[i].held[l / 64] >> (l % 64) & 1))
		return EP_ESTALE;
	struct epd_handle_ent *e = &g->handles[i];
	e->held[l / 64] &= ~(1ull << (l % 64));
	if (--e->holders == 0)
		drop_at(g, i);
	return 0;
}

void epd_handle_drop(struct epd_group *g, uint64_t seq)
{
	long i = find(g, seq);
	if (i >= 0)
		drop_at(g, i);
}

void epd_handles_free(struct epd_group *g)
{
	for (size_t i = 0; i < g->nhandles; i++) {
		ek_route_free(g->handles[i].route);
		free(g->handles[i].held);
	}
	free(g->handles);
	g->handles = NULL;
	g->nhandles = g->hcap = 0;
	g->handle_bytes = 0;
}

/* EPP_RELEASE from a client. */
int epd_op_release(struct epd_session *c, uint64_t req_id,
		   const struct epp_release *rl, bool quiet)
{
	struct epd_member *m = epd_member_find(c, rl->group_id);
	if (!m) {
		epd_session_error(c, req_id, EP_ENOGROUP,
				 "group id %llu is not joined on this "
				 "connection",
				 (unsigned long long)rl->group_id);
		return EP_ENOGROUP;
	}
	struct epd_group *g = m->group;
	const struct epp_handle *h = &rl->handle;
	if (h->group_id != g->id || h->epoch != g->epoch) {
		epd_session_error(c, req_id, EP_ESTALE,
				 "handle of group id %llu epoch %u released "
				 "on group %s (id %llu, epoch %u)",
				 (unsigned long long)h->group_id, h->epoch,
				 g->shape.name, (unsigned long long)g->id,
				 g->epoch);
		return EP_ESTALE;
	}
	if (g->state == EPD_G_FAILED) {
		/* its handles go with it: nothing to give back */
		if (!quiet)
			epd_session_send(c, EPP_OK, 0, req_id, NULL, 0, NULL,
					 0);
		return 0;
	}
	char err[EPP_ERRMSG_MAX];
	int rc;
	if (g->dev) {
		rc = g->dev->release(g, m, h->seq, err, sizeof(err));
	} else if (m->pending_req ||
		   ((g->coll_type == EPP_COMBINE ||
		     (g->coll_type == EPP_DISPATCH && g->coll_cached)) &&
		    g->coll_seq == h->seq)) {
		/* a client that follows the protocol releases after the ops
		 * that use the handle returned; the collective in progress
		 * (or one of this rank's) may be using its routing */
		rc = EP_EBUSY;
		snprintf(err, sizeof(err),
			 "handle %llu: the %s in progress on group %s uses "
			 "it; release it after the op returned",
			 (unsigned long long)h->seq,
			 epp_type_name(g->coll_type ? g->coll_type
						    : m->pending_type),
			 g->shape.name);
	} else {
		rc = epd_handle_release(g, h->seq, m->local);
		if (rc)
			snprintf(err, sizeof(err),
				 "handle %llu is not held by rank %u of group "
				 "%s (never made, or released already)",
				 (unsigned long long)h->seq, m->rank,
				 g->shape.name);
	}
	if (rc) {
		epd_session_error(c, req_id, rc, "%s", err);
		return rc;
	}
	if (!quiet)
		epd_session_send(c, EPP_OK, 0, req_id, NULL, 0, NULL, 0);
	return 0;
}
