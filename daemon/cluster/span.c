/* SPDX-License-Identifier: MIT */
/*
 * The span operations (struct epd_span_ops, cl_span_ops) the core calls
 * for a group across nodes: this node's place, a barrier's arrivals to
 * the other nodes, a group's forming (its nodes wanted and dialled), its
 * failure told to the other nodes, its nodes released, and the sends of
 * its data ops' frames.
 */
#include "cluster_int.h"

static int span_self(const struct epd_server *srv)
{
	return srv->cluster ? srv->cluster->self : 0;
}

static int span_size(const struct epd_server *srv)
{
	return srv->cluster ? srv->cluster->n : 1;
}

/* Local index l entered barrier seq: to group node `to` (a
 * dissemination step), or with step EPP_STEP_ALL to every other node. */
static int span_arrival_to(struct epd_group *g, uint32_t l, uint64_t seq,
			   uint32_t to, uint8_t step)
{
	struct epd_cluster *cl = g->srv->cluster;
	uint8_t buf[160];
	/* the data ops this node's ranks completed before the barrier:
	 * every node's must be the same (epd_coll_order) */
	struct epp_peer_barrier m = {.local = l, .seq = seq,
				     .xops = g->xop_next, .step = step};
	snprintf(m.group, sizeof(m.group), "%s", g->key);
	size_t bn = epp_peer_barrier_encode(&m, buf, sizeof(buf));
	for (uint32_t n = 0; n < g->nnodes; n++) {
		if (n == g->node_index || (step != EPP_STEP_ALL && n != to))
			continue;
		struct cnode *nd = &cl->node[g->node_map[n]];
		if (nd->state != NODE_UP) {
			epd_group_fail(g, EP_EPEERLOST,
				       "node %s (the group's node %u) is "
				       "down%s%s",
				       nd->name, n, nd->why[0] ? ": " : "",
				       nd->why);
			return EP_EPEERLOST;
		}
		cl_conn_send(nd->conn, EPP_PEER_BARRIER, buf, (uint32_t)bn);
	}
	return 0;
}

static int span_arrival(struct epd_group *g, uint32_t l, uint64_t seq)
{
	return span_arrival_to(g, l, seq, 0, EPP_STEP_ALL);
}

/* Tell the other nodes of group `key` (nnodes of them, at the cluster's
 * indices node_map, the names' hash nodes_hash) that it failed
 * here, having completed `round` barriers and `xops` data ops. A group
 * that never sent its shape (it failed forming, or never formed here: j
 * its join's, with timeout_ms) sends it first: the other nodes take a
 * failure only from a group whose shape they had (an earlier or later
 * group of the key is not theirs). */
static void gfail_send(struct epd_cluster *cl, const char *key,
		       uint32_t nnodes, const uint32_t *node_map,
		       uint64_t nodes_hash, int code, const char *msg,
		       uint64_t round, uint64_t xops, const struct epp_join *j,
		       uint32_t timeout_ms)
{
	uint8_t buf[EPP_ERRMSG_MAX + 128], shape[192];
	if (!cl)
		return;
	size_t sl = j ? epd_xop_shape_encode(key, j, timeout_ms, nodes_hash,
					     shape, sizeof(shape))
		      : 0;
	struct epp_peer_gfail m = {.code = code, .round = round, .xops = xops};
	snprintf(m.group, sizeof(m.group), "%s", key);
	snprintf(m.msg, sizeof(m.msg), "%s", msg);
	size_t gn = epp_peer_gfail_encode(&m, buf, sizeof(buf));
	for (uint32_t n = 0; n < nnodes; n++) {
		const int cn = (int)node_map[n];
		if (node_map[n] < (uint32_t)cl->n && cn != cl->self &&
		    cl->node[cn].state == NODE_UP) {
			if (sl)
				cl_conn_send(cl->node[cn].conn,
					     EPP_PEER_GSHAPE, shape,
					     (uint32_t)sl);
			cl_conn_send(cl->node[cn].conn, EPP_PEER_GFAIL, buf,
				     (uint32_t)gn);
		}
	}
}

/* The data ops the other nodes may still finish after this node's
 * failure: those it completed, up to one the nodes disagreed on. */
/* The table's entry of group g's node n, or NULL: no cluster, no such
 * node, or one the group released (cl_failed_release). */
static struct cnode *group_node(const struct epd_group *g, uint32_t n)
{
	struct epd_cluster *cl = g->srv->cluster;
	return cl && n < g->nnodes && g->node_map[n] < (uint32_t)cl->n
		       ? &cl->node[g->node_map[n]]
		       : NULL;
}

static uint64_t xops_done(const struct epd_group *g)
{
	return g->xop_next < g->xop_disagree ? g->xop_next : g->xop_disagree;
}

void epd_cluster_tell_failed(struct epd_group *g, uint32_t n)
{
	const struct cnode *nd = group_node(g, n);
	uint8_t buf[EPP_ERRMSG_MAX + 128];
	if (!nd || n == g->node_index || nd->state != NODE_UP)
		return;
	struct epp_peer_gfail m = {.code = g->fail_code, .round = g->round,
				   .xops = xops_done(g)};
	snprintf(m.group, sizeof(m.group), "%s", g->key);
	snprintf(m.msg, sizeof(m.msg), "%s", g->last_error);
	size_t gn = epp_peer_gfail_encode(&m, buf, sizeof(buf));
	cl_conn_send(nd->conn, EPP_PEER_GFAIL, buf, (uint32_t)gn);
}

/* Tell the group's other nodes it failed here. How far this node got:
 * the barriers it completed (every local rank entered them, so their
 * arrivals went out) and the data ops it completed (their rows went
 * out). The others may finish up to there; a rank that died never
 * entered the next round. */
static void group_failed(struct epd_group *g, int code, const char *msg)
{
	gfail_send(g->srv->cluster, g->key, g->nnodes, g->node_map,
		   g->nodes_hash, code, msg, g->round, xops_done(g),
		   g->announced ? NULL : &g->shape, g->timeout_ms);
}

/* A group this node refused to form (it is linked to a group that
 * failed): the nodes where it formed fail it at its first op. */
static void span_failed_key(struct epd_server *srv, const char *key,
			    const struct epp_join *j, uint32_t nnodes,
			    const uint32_t *node_map, uint64_t nodes_hash,
			    int code, const char *msg)
{
	gfail_send(srv->cluster, key, nnodes, node_map, nodes_hash, code, msg,
		   0, 0, j,
		   j->timeout_ms ? j->timeout_ms : srv->cfg.timeout_ms);
}

void epd_cluster_send(struct epd_group *g, uint32_t n, uint16_t type,
		      const void *a, size_t na, const void *b, size_t nb,
		      struct epd_sref *ref)
{
	const struct cnode *nd = group_node(g, n);
	if (!nd || nd->state != NODE_UP)
		return;
	cl_conn_write(nd->conn, type, a, na, b, nb, ref);
}

const char *epd_cluster_name_at(const struct epd_server *srv, uint32_t cn)
{
	const struct epd_cluster *cl = srv->cluster;
	return cl && (int)cn < cl->n ? cl->node[cn].name : "?";
}

const char *epd_cluster_node_name(const struct epd_group *g, uint32_t n)
{
	const struct cnode *nd = group_node(g, n);
	if (nd)
		return nd->name;
	return g->srv->cluster && n < g->nnodes ? "released" : "local";
}

static void span_failed(struct epd_group *g, int code, const char *msg,
			bool tell)
{
	if (tell)
		group_failed(g, code, msg);
	epd_xop_drop(g); /* a running job is dropped when it ends */
}

static void span_formed(struct epd_group *g)
{
	struct epd_cluster *cl = g->srv->cluster;
	for (uint32_t n = 0; n < g->nnodes; n++) {
		const int cn = (int)g->node_map[n];
		struct cnode *nd = &cl->node[cn];
		if (n == g->node_index || nd->groups++)
			continue;
		if (nd->state == NODE_IDLE)
			nd->state = NODE_DOWN; /* wanted now */
		/* dial at once, not at the next tick */
		if (nd->state != NODE_UP && !nd->conn && cl_dials(cl, cn)) {
			nd->backoff_ns = 0;
			nd->next_dial_ns = 0;
			cl_dial(cl, cn);
		}
	}
}

/* The group no longer spans its nodes here: each that no other group
 * spans lingers (peer_linger_ms), then its connection closes. */
static void nodes_release(struct epd_group *g)
{
	struct epd_cluster *cl = g->srv->cluster;
	if (g->nodes_released)
		return;
	for (uint32_t n = 0; cl && n < g->nnodes; n++) {
		struct cnode *nd = &cl->node[g->node_map[n]];
		if (n == g->node_index || !nd->groups || --nd->groups)
			continue;
		nd->unused_ns = epd_now_ns();
		if (nd->state == NODE_DOWN && !cl->srv->cfg.peer_connect_all)
			nd->state = NODE_IDLE; /* no longer wanted */
	}
}

/* Failed groups whose ranks are still connected let go of their nodes
 * once their timeout has passed since the failure: a node that forms
 * the group later is told the failure until then (epd_xop_frame), and
 * after that its own join has timed out. Else every failed group a rank
 * keeps open would hold its nodes in the table (connected, watched, not
 * forgotten) for as long as the rank likes. */
void cl_failed_release(struct epd_cluster *cl, uint64_t now)
{
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &cl->srv->groups)
	{
		struct epd_group *g = LIST_ENTRY(it, struct epd_group, node);
		const uint64_t wait = (uint64_t)g->timeout_ms * 1000000ull;
		if (g->nnodes < 2 || g->state != EPD_G_FAILED ||
		    g->nodes_released || now - g->failed_ns < wait)
			continue;
		nodes_release(g);
		g->nodes_released = true;
		for (uint32_t n = 0; n < g->nnodes; n++)
			if (n != g->node_index)
				g->node_map[n] = EPD_NODE_RELEASED;
		epd_info("group %s: failed %.1f s ago, its %u other nodes "
			 "released",
			 g->shape.name, (double)(now - g->failed_ns) / 1e9,
			 g->nnodes - 1);
	}
}

static bool span_nodes_up(struct epd_group *g)
{
	struct epd_cluster *cl = g->srv->cluster;
	for (uint32_t n = 0; n < g->nnodes; n++)
		if (n != g->node_index &&
		    !cl_node_usable(&cl->node[g->node_map[n]]))
			return false;
	return true;
}

static void span_nodes_missing(struct epd_group *g, char *out, size_t cap)
{
	struct epd_cluster *cl = g->srv->cluster;
	size_t off = 0;
	out[0] = 0;
	for (uint32_t n = 0; n < g->nnodes && off + 1 < cap; n++) {
		const struct cnode *nd = &cl->node[g->node_map[n]];
		if (n == g->node_index || cl_node_usable(nd))
			continue;
		int w = snprintf(out + off, cap - off, "%s%s%s%s%s",
				 off ? ", " : "", nd->name,
				 nd->why[0] ? " (" : "", nd->why,
				 nd->why[0] ? ")" : "");
		off += w > 0 ? (size_t)w : 0;
	}
	if (off >= cap && cap > 4)
		snprintf(out + cap - 4, 4, "...");
}

static void span_ready(struct epd_group *g)
{
	epd_xop_announce(g); /* its shape to the others, who compare */
	epd_xop_replay(g);   /* what came before it was ready here */
}

static void span_freed(struct epd_group *g)
{
	nodes_release(g);
	epd_xop_drop(g);
	epd_xbufs_trim(g->srv);
	epd_xwin_free(g);
}

const struct epd_span_ops cl_span_ops = {
	.self = span_self,
	.size = span_size,
	.resolve = cl_span_resolve,
	.resolve_pin = cl_span_resolve_pin,
	.formed = span_formed,
	.nodes_up = span_nodes_up,
	.nodes_missing = span_nodes_missing,
	.arrival = span_arrival,
	.arrival_to = span_arrival_to,
	.op_start = epd_xop_start,
	.missing = epd_xop_missing,
	.ready = span_ready,
	.failed = span_failed,
	.failed_key = span_failed_key,
	.freed = span_freed,
	.node_name = epd_cluster_node_name,
};
