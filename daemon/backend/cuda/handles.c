/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend: a GPU group's handles. A fresh dispatch (op k) makes
 * an entry with its routing tables in device memory; combine and cached
 * dispatch name it by k. Each local rank releases it (EPP_RELEASE) when it
 * is done with it, and may do so before the daemon ran the ops it sent
 * earlier: the entry is reused only once every rank released it and the
 * stream holds every op sent before the last release (all of them run in
 * stream order before any later dispatch overwrites the tables). Nothing
 * is evicted: the tables' memory counts against max_handle_bytes.
 */
#include "cuda_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct route *cu_route_find(struct epd_cuda_group *c, uint64_t seq)
{
	if (!seq)
		return NULL;
	for (uint32_t i = 0; i < c->nroutes; i++)
		if (c->routes[i].seq == seq)
			return &c->routes[i];
	return NULL;
}

uint64_t cu_route_host(struct epd_cuda_group *c, uint64_t seq)
{
	const struct route *rt = cu_route_find(c, seq);
	return rt ? rt->host : 0;
}

/* Dead entries whose last user is on the stream (and out of the staged
 * path) become free; a staged group's host routing goes with them. */
static void reclaim(struct epd_group *g)
{
	struct epd_cuda_group *c = g->dev_group;
	for (uint32_t i = 0; i < c->nroutes; i++) {
		struct route *rt = &c->routes[i];
		if (!rt->seq || !rt->dead || rt->last_use > c->enqueued)
			continue;
		if (c->staged && c->stage_phase && c->stage_k <= rt->last_use)
			continue;
		if (rt->host)
			epd_handle_drop(g, rt->host);
		rt->seq = 0;
		rt->host = 0;
	}
}

/* A routing's small tables: rows received [W] u32, the rank prefix
 * matrix [W][W] u32, then its dispatch's error word (u64; W + W * W is
 * even, so it is aligned): ekc_disp_args' recv, rp and rerr. */
#define ROUTE_RECV_BYTES(W) ((W) * 4 + (W) * (W) * 4 + 8)

static uint64_t table_bytes(const struct epd_group *g)
{
	const struct epd_cuda_group *c = g->dev_group;
	uint64_t W = g->shape.ranks_per_node;
	return W * c->tmax * W * 4 + ROUTE_RECV_BYTES(W);
}

/* A free entry (with device tables unless staged), or NULL with the group
 * failed. */
static struct route *route_take(struct epd_group *g, uint64_t k)
{
	struct epd_cuda_group *c = g->dev_group;
	reclaim(g);
	for (uint32_t i = 0; i < c->nroutes; i++)
		if (!c->routes[i].seq)
			return &c->routes[i];
	uint64_t bytes = c->staged ? 0 : table_bytes(g);
	uint64_t limit = g->srv->cfg.limits.handle_bytes;
	if (limit && bytes && c->route_bytes + bytes > limit) {
		epd_group_fail(g, EP_ELIMIT,
			       "dispatch %llu: group %s holds %u handles not "
			       "released (%llu bytes of device routing); one "
			       "more (%llu bytes) exceeds max_handle_bytes = "
			       "%llu: release handles (ep_handle_release) once "
			       "their combine is enqueued",
			       (unsigned long long)k, g->shape.name,
			       cu_routes_held(c),
			       (unsigned long long)c->route_bytes,
			       (unsigned long long)bytes,
			       (unsigned long long)limit);
		return NULL;
	}
	if (c->nroutes == c->rcap) {
		uint32_t cap = c->rcap ? c->rcap * 2 : 16;
		struct route *n = realloc(c->routes, cap * sizeof(*n));
		if (!n) {
			epd_group_fail(g, EP_ENOMEM,
				       "dispatch %llu: out of memory for its "
				       "handle",
				       (unsigned long long)k);
			return NULL;
		}
		c->routes = n;
		c->rcap = cap;
	}
	struct route *rt = &c->routes[c->nroutes];
	memset(rt, 0, sizeof(*rt));
	if (!c->staged) {
		uint64_t W = g->shape.ranks_per_node;
		CUresult r = cu_dev_alloc(c, &rt->slot, W * c->tmax * W * 4);
		if (!r)
			r = cu_dev_alloc(c, &rt->recv, ROUTE_RECV_BYTES(W));
		if (r) {
			if (rt->slot)
				cu_drv->cuMemFree(rt->slot);
			char err[256];
			ekc_fail(cu_drv, r, "allocating a handle's tables", err,
				 sizeof(err));
			epd_group_fail(g, EP_ENOMEM, "dispatch %llu: %s",
				       (unsigned long long)k, err);
			return NULL;
		}
		c->route_bytes += bytes;
	}
	c->nroutes++;
	return rt;
}

bool cu_route_make(struct epd_group *g, uint64_t k,
		   struct epd_aop *const *ops, uint64_t host)
{
	const uint32_t W = g->shape.ranks_per_node;
	struct route *rt = route_take(g, k);
	if (!rt)
		return false;
	rt->seq = k;
	rt->host = host;
	rt->fail = UINT64_MAX;
	rt->held = 0;
	rt->dead = false;
	rt->last_use = k;
	for (uint32_t l = 0; l < W; l++) {
		rt->tokens[l] = ops ? ops[l]->tokens : 0;
		/* a rank may have released it before it was made (ranks run
		 * ahead of a staged group's one op at a time): the ops it had
		 * sent by then may still name it, as below */
		struct epd_aop *a = &g->local[l]->aq[k % MAX_INFLIGHT];
		if (!(a->seq == k && a->released))
			rt->held |= 1ull << l;
		else if (a->released_last > rt->last_use)
			rt->last_use = a->released_last;
	}
	if (!rt->held)
		rt->dead = true;
	return true;
}

/* Is this op of m's, naming handle h, allowed? (At its arrival: a rank
 * that released h may not use it after.) */
bool cu_route_usable(struct epd_group *g, struct epd_member *m, uint64_t h)
{
	struct epd_cuda_group *c = g->dev_group;
	struct route *rt = cu_route_find(c, h);
	if (rt)
		return !rt->dead && rt->held >> m->local & 1;
	/* not made yet: an earlier fresh dispatch of this rank's, in its
	 * ring of ops not yet enqueued */
	if (!h || h <= c->enqueued || h > m->async_seq)
		return false;
	const struct epd_aop *a = &m->aq[h % MAX_INFLIGHT];
	return a->seq == h && a->type == EPP_DISPATCH &&
	       !(a->flags & EPP_DISPATCH_CACHED) && !a->released;
}

int epd_cuda_release(struct epd_group *g, struct epd_member *m, uint64_t h,
		     char *err, size_t errlen)
{
	struct epd_cuda_group *c = g->dev_group;
	struct route *rt = cu_route_find(c, h);
	if (rt && !rt->dead && rt->held >> m->local & 1) {
		rt->held &= ~(1ull << m->local);
		/* the ops m sent so far may use it */
		if (m->async_seq > rt->last_use)
			rt->last_use = m->async_seq;
		if (!rt->held)
			rt->dead = true;
		reclaim(g);
		return 0;
	}
	if (!rt && cu_route_usable(g, m, h)) {
		m->aq[h % MAX_INFLIGHT].released = true;
		m->aq[h % MAX_INFLIGHT].released_last = m->async_seq;
		return 0;
	}
	snprintf(err, errlen,
		 "handle %llu is not held by rank %u of group %s (never "
		 "made, or released already)",
		 (unsigned long long)h, m->rank, g->shape.name);
	return EP_ESTALE;
}

void cu_routes_free(struct epd_cuda_group *c)
{
	for (uint32_t i = 0; i < c->nroutes; i++) {
		if (c->routes[i].slot)
			cu_drv->cuMemFree(c->routes[i].slot);
		if (c->routes[i].recv)
			cu_drv->cuMemFree(c->routes[i].recv);
	}
	free(c->routes);
	c->routes = NULL;
	c->nroutes = c->rcap = 0;
	c->route_bytes = 0;
}

uint32_t cu_routes_held(const struct epd_cuda_group *c)
{
	uint32_t n = 0;
	for (uint32_t i = 0; i < c->nroutes; i++)
		n += c->routes[i].seq && !c->routes[i].dead;
	return n;
}
