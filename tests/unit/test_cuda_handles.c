/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's handle bookkeeping (daemon/backend/cuda/handles.c) for
 * a staged group, one across nodes, whose ops the daemon runs one at a
 * time through host memory with no device tables: no GPU is needed, so
 * this runs wherever the backend is compiled.
 *
 * A rank running ahead sends a dispatch, the combine that names it and the
 * dispatch's release before the daemon made the routing. The routing is
 * made released already, and must stay until the ops the rank had sent by
 * its release are on the stream and out of the staged path, whatever the
 * daemon reclaims meanwhile (another handle's release); then it is freed.
 * Before the fix, the routing was made with only its own op as last use
 * and a reclaim during the combine's stage freed it: the combine found no
 * routing (test_gpu_cluster's ahead_rank shows it on a GPU).
 *
 * Also: a routing not released is held; a released one may not be named
 * again; an unknown one is EP_ESTALE; one whose dispatch failed alone
 * (protocol 1.19) passes the ranks' agreement, for the queue to refuse the
 * op naming it alone.
 */
#include "backend/cuda/cuda_int.h"
#include "harness.h"

#include <stdlib.h>
#include <string.h>

static struct epd_aop *op(struct epd_member *m, uint64_t k, uint16_t type,
			  uint64_t handle)
{
	struct epd_aop *a = &m->aq[k % MAX_INFLIGHT];
	memset(a, 0, sizeof(*a));
	a->seq = k;
	a->type = type;
	a->handle = handle;
	m->async_seq = k;
	return a;
}

int main(void)
{
	th_init("unit: a staged GPU group's handles (no GPU)", 30);
	struct epd_server *srv = calloc(1, sizeof(*srv));
	struct epd_group *g = calloc(1, sizeof(*g));
	struct epd_cuda_group *c = calloc(1, sizeof(*c));
	struct epd_member *m = calloc(1, sizeof(*m));
	struct epd_member *loc[1] = {m};
	TH_CHECK(srv && g && c && m, "out of memory");
	m->aq = calloc(MAX_INFLIGHT, sizeof(*m->aq));
	TH_CHECK(m->aq, "out of memory");
	g->srv = srv;
	g->dev_group = c;
	g->local = loc;
	g->state = EPD_G_READY;
	g->shape.ranks_per_node = 1;
	snprintf(g->shape.name, sizeof(g->shape.name), "staged");
	c->g = g;
	c->staged = true;
	m->group = g;
	char err[256];

	/* op 1: a dispatch, made at once (held); op 2: its combine */
	op(m, 1, EPP_DISPATCH, 0);
	TH_CHECK(cu_route_make(g, 1, NULL, 0), "making routing 1");
	c->enqueued = 1;
	struct route *r1 = cu_route_find(c, 1);
	TH_CHECK(r1 && r1->held == 1 && !r1->dead, "routing 1 held");
	op(m, 2, EPP_COMBINE, 1);
	c->enqueued = 2;

	/* the rank runs ahead: dispatch 3, its combine 4, then releases 3
	 * before the daemon made it (it is still on op 2) */
	op(m, 3, EPP_DISPATCH, 0);
	op(m, 4, EPP_COMBINE, 3);
	TH_CHECK(cu_route_usable(g, m, 3), "combine 4 names dispatch 3");
	TH_CHECK(epd_cuda_release(g, m, 3, err, sizeof(err)) == 0,
		 "releasing 3 before it was made: %s", err);
	TH_CHECK(!cu_route_usable(g, m, 3),
		 "an op sent after the release may not name it");

	/* the daemon makes it, released: dead, kept for op 4 */
	c->enqueued = 3;
	c->stage_phase = 1;
	c->stage_k = 3;
	TH_CHECK(cu_route_make(g, 3, NULL, 0), "making routing 3");
	c->stage_phase = 0;
	struct route *r3 = cu_route_find(c, 3);
	TH_CHECK(r3 && r3->dead && !r3->held, "routing 3 made released");
	TH_CHECK(r3->last_use == 4,
		 "routing 3's last use %llu: the combine the rank sent before "
		 "releasing it (4) is not covered",
		 (unsigned long long)r3->last_use);

	/* combine 4 is being staged; the rank releases routing 1, which
	 * reclaims what no op still needs: not routing 3 */
	c->enqueued = 4;
	c->stage_phase = 1;
	c->stage_k = 4;
	TH_CHECK(epd_cuda_release(g, m, 1, err, sizeof(err)) == 0,
		 "releasing 1: %s", err);
	TH_CHECK(cu_route_find(c, 3) != NULL,
		 "routing 3 reclaimed while the combine naming it was staged");

	/* the combine done, the next dispatch's routing takes a free entry:
	 * 1 and 3 are freed now */
	c->stage_phase = 0;
	op(m, 5, EPP_DISPATCH, 0);
	TH_CHECK(cu_route_make(g, 5, NULL, 0), "making routing 5");
	TH_CHECK(!cu_route_find(c, 1) && !cu_route_find(c, 3),
		 "routings 1 and 3 kept past their last use");
	TH_CHECK(c->nroutes == 2,
		 "%u entries: routing 5 took a new one, not a freed one",
		 c->nroutes);

	/* dispatch 5 fails alone on the host path (a bad expert index found
	 * on another node: stage_finish keeps the word with the routing); a
	 * combine naming it is then an op the queue takes out alone
	 * (cu_stage_refuse), not a handle unknown to the group */
	struct route *r5 = cu_route_find(c, 5);
	TH_CHECK(r5 && r5->fail == UINT64_MAX && !r5->host,
		 "a new routing: no outcome yet");
	r5->fail = EPP_OP_ERR_NOPOS;
	struct epd_aop *c6 = op(m, 6, EPP_COMBINE, 5);
	TH_CHECK(cu_ops_agree(g, 6, &c6) && g->state == EPD_G_READY,
		 "a combine of a dispatch that failed alone failed the group");

	/* a handle never made: EP_ESTALE, saying so */
	err[0] = 0;
	TH_CHECK(epd_cuda_release(g, m, 77, err, sizeof(err)) == EP_ESTALE &&
			 strstr(err, "not held"),
		 "releasing an unknown handle: %s", err);

	cu_routes_free(c);
	free(m->aq);
	free(m);
	free(c);
	free(g);
	free(srv);
	printf("ok: a staged group's routing released before it was made is "
	       "kept for the ops sent before the release, through a reclaim, "
	       "then freed; a released or unknown handle is refused; a "
	       "combine of a dispatch that failed alone is served (to fail "
	       "alone)\n");
	return 0;
}
