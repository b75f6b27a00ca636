/* SPDX-License-Identifier: MIT */
/*
 * The collectives' entry (the checks every barrier, dispatch and combine
 * request shares, and stream-ordered ops handed to the device backend)
 * and the two-phase barrier: the scale-out rail phase, then the scale-up
 * node phase, with arrivals from other nodes (doc/design.md, section 3).
 */
#include "core.h"
#include "backend.h"
#include "group_int.h"

#include <stdio.h>
#include <string.h>

/* The rail phase across many nodes is a dissemination barrier per rail:
 * at step s node p tells node p + 2^s (mod N) that round k reached it,
 * once its own rank entered k and steps 0..s-1 came from p - 2^j. After
 * the last step every node of the rail is known to have entered k:
 * ceil(log2 N) messages a node and rail, N log N in all (every node to
 * every node: N^2). Returns 0, or the error of a send (the group failed).
 */
static int dissem_send(struct epd_group *g, uint32_t l, uint64_t k)
{
	const uint32_t S = g->dis_steps, N = g->nnodes, p = g->node_index;
	if (!g->local[l] || g->local[l]->barrier_seq < k)
		return 0;
	for (uint32_t s = 0; s < S; s++) {
		uint64_t *sent = &g->dis_sent[l * S + s];
		if (*sent < k) {
			const uint32_t to = (p + (1u << s)) % N;
			int rc = g->srv->span->arrival_to(g, l, k, to,
							  (uint8_t)s);
			if (rc)
				return rc;
			*sent = k;
		}
		if (g->dis_recv[l * S + s] < k)
			return 0;
	}
	return 0;
}

/* Local index l entered barrier seq: its rail hears of it. */
static int rail_enter(struct epd_group *g, uint32_t l, uint64_t seq)
{
	return g->dis_steps ? dissem_send(g, l, seq)
			    : g->srv->span->arrival(g, l, seq);
}

/* Phase 1 of round k for local index l: the rail (the ranks with local index
 * l on every node) has arrived. */
static bool rail_arrived(struct epd_group *g, uint32_t l, uint64_t k)
{
	if (!g->local[l] || g->local[l]->barrier_seq < k)
		return false;
	const uint32_t S = g->dis_steps;
	for (uint32_t s = 0; s < S; s++)
		if (g->dis_recv[l * S + s] < k)
			return false;
	for (uint32_t n = 0; !S && n < g->nnodes; n++)
		if (n != g->node_index && g->rail_remote[l * g->nnodes + n] < k)
			return false;
	return true;
}

static void barrier_progress(struct epd_group *g)
{
	uint64_t k = g->round + 1;
	uint32_t rpn = g->shape.ranks_per_node;
	/* Phase 1: scale-out (rail). */
	for (uint32_t l = 0; l < rpn; l++)
		if (g->rail_done[l] < k && rail_arrived(g, l, k))
			g->rail_done[l] = k;
	/* Phase 2: scale-up (node), only on completed phase-1 counters. */
	for (uint32_t l = 0; l < rpn; l++)
		if (g->rail_done[l] < k)
			return;
	g->round = k;
	g->n_barrier++;
	g->op_ns[0] += epd_now_ns() - g->coll_start_ns;
	g->coll_type = 0;
	g->coll_arrived = 0;
	uv_timer_stop(&g->timer);
	for (uint32_t l = 0; l < rpn; l++) {
		struct epd_member *m = g->local[l];
		if (m && m->pending_type == EPP_BARRIER)
			epd_member_reply_ok(m, NULL, 0);
	}
}

void epd_group_staged_barrier(struct epd_group *g, uint64_t seq,
			      epd_member_complete_fn done)
{
	uint32_t rpn = g->shape.ranks_per_node;
	g->coll_type = EPP_BARRIER;
	g->coll_arrived = rpn;
	g->coll_start_ns = epd_now_ns();
	for (uint32_t l = 0; l < rpn; l++) {
		struct epd_member *m = g->local[l];
		m->barrier_seq++;
		m->pending_req = seq;
		m->pending_type = EPP_BARRIER;
		m->complete = done;
	}
	if (epd_group_remote_check(g) || !epd_coll_order(g))
		return; /* failed, and replied */
	for (uint32_t l = 0; l < rpn; l++)
		if (rail_enter(g, l, g->local[l]->barrier_seq))
			return;
	epd_group_arm_timer(g);
	barrier_progress(g);
}

void epd_group_arm_timer(struct epd_group *g)
{
	if (!uv_is_active((uv_handle_t *)&g->timer)) {
		g->round_started_ns = epd_now_ns();
		uv_timer_start(&g->timer, epd_group_timeout, g->timeout_ms, 0);
	}
}

struct epd_member *epd_coll_enter(struct epd_session *c, uint64_t req_id,
				  uint64_t gid)
{
	struct epd_member *m = epd_member_lookup(c, req_id, gid);
	if (!m)
		return NULL;
	struct epd_group *g = m->group;
	if (g->state == EPD_G_FAILED) {
		g->n_errors++;
		epd_session_error(c, req_id, g->fail_code, "group %s failed: %s",
				 g->shape.name, g->last_error);
		return NULL;
	}
	if (g->state == EPD_G_FORMING) {
		char miss[512];
		if (g->await_nodes)
			g->srv->span->nodes_missing(g, miss, sizeof(miss));
		else
			epd_list_ranks(miss, sizeof(miss), g, epd_not_joined,
				       NULL);
		epd_session_error(c, req_id, EP_ENOTREADY,
				 "group %s is not ready; %s: %s", g->shape.name,
				 g->await_nodes ? "waiting for its nodes"
						: "ranks not joined",
				 miss);
		return NULL;
	}
	if (m->pending_req) {
		epd_session_error(c, req_id, EP_EBUSY,
				 "an operation of rank %u is in flight",
				 m->rank);
		return NULL;
	}
	return m;
}

/* After the rank's own request passed its checks (a request refused for
 * this rank alone -- stale handle, wrong shape -- never enters and so
 * never judges the others): do the ranks' programs agree? */
bool epd_coll_agree(struct epd_member *m, uint64_t req_id, uint16_t type)
{
	struct epd_group *g = m->group;
	struct epd_session *c = m->client;
	if (g->coll_type && g->coll_type != type) {
		/* The ranks' programs disagree: nothing can complete. */
		epd_session_error(c, req_id, EP_EMISMATCH,
				 "rank %u called %s while other ranks of group "
				 "%s are in %s",
				 m->rank, epp_type_name(type), g->shape.name,
				 epp_type_name(g->coll_type));
		epd_group_fail(g, EP_EMISMATCH,
			       "rank %u called %s while other ranks were in %s",
			       m->rank, epp_type_name(type),
			       epp_type_name(g->coll_type));
		return false;
	}
	return true;
}

int epd_group_async(struct epd_session *c, uint64_t req_id, uint64_t gid,
		    const struct epd_aop *op)
{
	struct epd_member *m = epd_member_lookup(c, req_id, gid);
	if (!m)
		return EP_ENOGROUP;
	struct epd_group *g = m->group;
	if (!g->dev) {
		epd_session_error(c, req_id, EP_EUNSUPPORTED,
				 "group %s has host ranks: no stream-ordered "
				 "operations",
				 g->shape.name);
		return EP_EUNSUPPORTED;
	}
	/* A failed group already released the streams and wrote the error
	 * to the control page; the rank reads it there. */
	if (g->state == EPD_G_FAILED)
		return g->fail_code;
	if (g->state != EPD_G_READY) {
		epd_session_error(c, req_id, EP_ENOTREADY,
				 "group %s is not ready", g->shape.name);
		return EP_ENOTREADY;
	}
	const struct epp_join *s = &g->shape;
	uint32_t known = op->type == EPP_DISPATCH
				 ? EPP_DISPATCH_WEIGHTS | EPP_DISPATCH_CACHED |
					   EPP_DISPATCH_AREA_MASK |
					   EPP_DISPATCH_XREG
			 : op->type == EPP_COMBINE
				 ? EPP_COMBINE_BIAS | EPP_COMBINE_BIAS2 |
					   EPP_COMBINE_WEIGHTS | EPP_COMBINE_YREG |
					   EPP_COMBINE_OUTREG |
					   EPP_COMBINE_TOPK_ORDER
				 : 0;
	if (op->flags & ~known) {
		/* its doorbell is on the stream already: the op cannot be
		 * skipped, so the group fails at once (not at the timeout) */
		epd_group_fail(g, EP_EINVAL,
			       "rank %u sent a stream-ordered %s with unknown "
			       "flags 0x%x",
			       m->rank, epp_type_name(op->type),
			       op->flags & ~known);
		return EP_EINVAL;
	}
	if (op->type == EPP_DISPATCH &&
	    EPP_DISPATCH_AREA_OF(op->flags) >= g->layout.recv_areas) {
		epd_group_fail(g, EP_EINVAL,
			       "rank %u sent a stream-ordered dispatch into "
			       "receive area %u of %u",
			       m->rank, EPP_DISPATCH_AREA_OF(op->flags),
			       g->layout.recv_areas);
		return EP_EINVAL;
	}
	/* Too many tokens: as for a host rank, the rank takes part with none
	 * and that op fails for every rank (EP_ETOOBIG), changing nothing;
	 * the group goes on. The others would otherwise learn only from the
	 * timeout. */
	if (op->type == EPP_DISPATCH && op->tokens > s->max_tokens) {
		struct epd_aop o = *op;
		o.asked = op->tokens;
		o.tokens = 0;
		o.rows = 0; /* no rows read: no registration either */
		o.flags = (o.flags & ~EPP_DISPATCH_XREG) | EPP_DISPATCH_TOOBIG;
		g->toobig_rank = m->rank; /* for the staged path's message */
		g->toobig_tokens = op->tokens;
		g->dev->op(m, &o);
		return 0;
	}
	g->dev->op(m, op);
	return 0;
}

int epd_group_barrier(struct epd_session *c, uint64_t req_id, uint64_t gid)
{
	struct epd_member *m = epd_coll_enter(c, req_id, gid);
	if (!m || !epd_coll_agree(m, req_id, EPP_BARRIER))
		return EP_EINVAL;
	struct epd_group *g = m->group;
	g->coll_type = EPP_BARRIER;
	if (g->coll_arrived++ == 0)
		g->coll_start_ns = epd_now_ns();
	m->refused_type = 0;
	m->barrier_seq++;
	m->pending_req = req_id;
	m->pending_type = EPP_BARRIER;
	/* Phase 1 needs the rail: tell the other nodes of the group. */
	if (g->nnodes > 1 &&
	    (epd_group_remote_check(g) || !epd_coll_order(g) ||
	     rail_enter(g, m->local, m->barrier_seq)))
		return EP_EPEERLOST; /* the group failed and replied */
	epd_group_arm_timer(g);
	barrier_progress(g);
	return 0;
}

bool epd_group_remote_check(struct epd_group *g)
{
	if (!g->rfail_code || g->state == EPD_G_FAILED)
		return false;
	bool past = false;
	/* a barrier beyond the rounds the failed node entered */
	for (uint32_t l = 0; l < g->shape.ranks_per_node; l++)
		if (g->local[l] && g->local[l]->pending_type == EPP_BARRIER &&
		    g->local[l]->barrier_seq > g->rfail_round)
			past = true;
	/* a data op past the ones it completed */
	if (g->coll_type && g->coll_type != EPP_BARRIER &&
	    g->xop_next >= g->rfail_xop)
		past = true;
	if (!past)
		return false;
	epd_group_fail(g, g->rfail_code, "%s", g->rfail_msg);
	return true;
}

void epd_group_remote_failure(struct epd_group *g, const char *node,
			      int code, const char *msg, uint64_t round,
			      uint64_t xops)
{
	if (g->state == EPD_G_FAILED)
		return;
	if (g->rfail_code) {
		/* another node's failure too: what may still finish here is
		 * what every failed node completed */
		if (round < g->rfail_round)
			g->rfail_round = round;
		if (xops < g->rfail_xop)
			g->rfail_xop = xops;
		epd_group_remote_check(g);
		return;
	}
	g->rfail_code = code;
	g->rfail_round = round;
	g->rfail_xop = xops;
	snprintf(g->rfail_msg, sizeof(g->rfail_msg), "on node %s: %s", node,
		 msg);
	epd_group_remote_check(g);
}

/* Node n's latest barrier arrival against what this node's ranks run now
 * (epd_coll_order); false if the group failed on a disagreement. */
static bool order_ok(struct epd_group *g, uint32_t n)
{
	const uint64_t k = g->round + 1, mine = g->xop_next,
		       theirs = g->arr_xops[n];
	const bool barrier = g->coll_type == EPP_BARRIER,
		   data = g->coll_type && !barrier;
	if (n == g->node_index || g->arr_seq[n] != k || theirs == UINT64_MAX)
		return true;
	/* node n's ranks entered barrier k after `theirs` data ops; this
	 * node's are in it after `mine`, or in data op `mine` (node n
	 * skipped it if theirs <= mine), or between ops */
	if (barrier ? theirs == mine : !data || theirs > mine)
		return true;
	/* the others learn what may still finish: no data op past the
	 * fewer, no barrier past this node's */
	g->xop_disagree = theirs < mine ? theirs : mine;
	const char *nn = g->srv->span->node_name(g, n);
	if (barrier)
		epd_group_fail(g, EP_EMISMATCH,
			       "barrier %llu: node %s's ranks entered it after "
			       "%llu data ops, this node's after %llu (every "
			       "node's ranks must run the same operations in "
			       "the same order)",
			       (unsigned long long)k, nn,
			       (unsigned long long)theirs,
			       (unsigned long long)mine);
	else
		epd_group_fail(g, EP_EMISMATCH,
			       "node %s's ranks ran barrier %llu after %llu "
			       "data ops, where this node's ran %s %llu (every "
			       "node's ranks must run the same operations in "
			       "the same order)",
			       nn, (unsigned long long)k,
			       (unsigned long long)theirs,
			       epp_type_name(g->coll_type),
			       (unsigned long long)theirs);
	return false;
}

bool epd_coll_order(struct epd_group *g)
{
	if (g->state != EPD_G_READY || g->nnodes < 2)
		return true;
	for (uint32_t n = 0; n < g->nnodes; n++)
		if (!order_ok(g, n))
			return false;
	return true;
}

void epd_group_remote_arrival(struct epd_group *g, uint32_t node, uint32_t l,
			      uint64_t seq, uint64_t xops, uint8_t step)
{
	if (node >= g->nnodes || l >= g->shape.ranks_per_node)
		return;
	const uint32_t S = g->dis_steps, N = g->nnodes;
	if (step == EPP_STEP_ALL ? S != 0
				 : step >= S ||
					   node != (g->node_index + N -
						    (1u << step) % N) % N) {
		/* another pattern than this group's: the nodes differ on
		 * the group (a peer's bug, or an older group's frame) */
		epd_group_fail(g, EP_EPROTO,
			       "node %s sent barrier %llu of rail %u as %s; "
			       "this group's rail takes %s",
			       g->srv->span->node_name(g, node),
			       (unsigned long long)seq, l,
			       step == EPP_STEP_ALL ? "an arrival to all"
						    : "a dissemination step",
			       S ? "dissemination steps" : "arrivals to all");
		return;
	}
	uint64_t *c = S ? &g->dis_recv[l * S + step]
			: &g->rail_remote[l * g->nnodes + node];
	if (seq > *c)
		*c = seq;
	if (seq >= g->arr_seq[node]) {
		g->arr_seq[node] = seq;
		g->arr_xops[node] = xops;
	}
	/* only this arrival is new: the others were checked when they came
	 * and when this node's ranks last entered a collective */
	if (g->state != EPD_G_READY || !order_ok(g, node))
		return;
	/* a step that came lets this node take its next ones */
	if (S && dissem_send(g, l, g->round + 1))
		return;
	barrier_progress(g);
}
