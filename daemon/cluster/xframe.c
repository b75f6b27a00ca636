/* SPDX-License-Identifier: MIT */
/*
 * The cross-node engine (xnode_int.h): frames from other nodes (routings,
 * rows, shapes, windows, barrier arrivals), and the one stash where those
 * for a group not ready here yet wait.
 */
#include "xnode_int.h"

static void stash_drop(struct epd_server *srv, struct stashed *e)
{
	list_del(&e->node);
	srv->xnode->xstash_bytes -= e->len;
	free(e);
}

/* A frame from node `from` for a group of this key that is not ready
 * here. Its shape (GSHAPE) opens a group there: whatever that node sent
 * for this key before it was an earlier group's, dropped now. Anything
 * else is kept only after that shape; without one it is an earlier
 * group's too (sent before that group learned it had failed), and would
 * count for the next group of this key here: a barrier arrival that lets
 * it leave early, a routing taken for its first dispatch. */
static void stash_frame(struct epd_server *srv, const char *name,
			uint16_t type, uint32_t from, const uint8_t *p,
			uint32_t len)
{
	struct list_node *it, *tmp;
	bool opened = false;
	LIST_FOREACH(it, tmp, &srv->xnode->xstash)
	{
		struct stashed *e = LIST_ENTRY(it, struct stashed, node);
		if (e->from != from || strcmp(e->name, name))
			continue;
		if (type == EPP_PEER_GSHAPE)
			stash_drop(srv, e);
		else if (e->type == EPP_PEER_GSHAPE)
			opened = true;
	}
	if (type != EPP_PEER_GSHAPE && !opened) {
		epd_info("cross-node %s for group %s from node %u dropped: it "
			 "is an earlier group's of that name (no group of it "
			 "there since)",
			 epp_type_name(type), name, from);
		return;
	}
	struct stashed *e = malloc(sizeof(*e) + len);
	if (!e || srv->xnode->xstash_bytes + len > STASH_MAX) {
		free(e);
		epd_warn("cross-node %s for group %s dropped: %llu bytes are "
			 "already kept for groups not ready here",
			 epp_type_name(type), name,
			 (unsigned long long)srv->xnode->xstash_bytes);
		return;
	}
	snprintf(e->name, sizeof(e->name), "%s", name);
	e->type = type;
	e->from = from;
	e->len = len;
	memcpy(e->data, p, len);
	srv->xnode->xstash_bytes += len;
	list_add_tail(&srv->xnode->xstash, &e->node);
}

/* Is a frame (of type, p and len) from the group's node `from` (the
 * cluster's node cfrom) for group g this group's? Not before that node's
 * shape came (an earlier group's there: dropped, said in the log), nor
 * after its group failed (a later group's: kept for the next group of
 * this key here). */
static bool admit(struct epd_group *g, uint32_t from, uint32_t cfrom,
		  uint16_t type, const uint8_t *p, uint32_t len)
{
	if (from >= g->nnodes)
		return false;
	if (g->peer[from] == EPD_PEER_OPEN)
		return true;
	if (g->peer[from] == EPD_PEER_OVER)
		stash_frame(g->srv, g->key, type, cfrom, p, len);
	else
		epd_info("cross-node %s for group %s from node %s dropped: "
			 "it is an earlier group's of that name (this "
			 "group's shape has not come from there)",
			 epp_type_name(type), g->key,
			 epd_cluster_node_name(g, from));
	return false;
}

static bool stash_forget(struct epd_server *srv, uint32_t from,
			 const char *key)
{
	bool shape = false;
	if (!srv->xnode)
		return false;
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->xnode->xstash)
	{
		struct stashed *e = LIST_ENTRY(it, struct stashed, node);
		if (e->from == from && (!key || !strcmp(e->name, key))) {
			shape |= e->type == EPP_PEER_GSHAPE;
			stash_drop(srv, e);
		}
	}
	return shape;
}

void epd_xop_node_down(struct epd_server *srv, uint32_t from)
{
	stash_forget(srv, from, NULL);
}

void epd_xop_failure(struct epd_server *srv, uint32_t cfrom,
		     const struct epp_peer_gfail *m, const char *node)
{
	/* what that node's group sent for a group not ready here: over */
	bool announced = stash_forget(srv, cfrom, m->group);
	struct epd_group *g = epd_group_find(srv, m->group);
	const uint32_t from = g ? epd_group_node_of(g, cfrom) : UINT32_MAX;
	if (from == UINT32_MAX)
		return;
	/* Only the failure of the group this one met: one whose shape came
	 * (kept, for a group still forming). Any other is an earlier
	 * group's there, sent before it learned of its partner's end, or a
	 * later one's. */
	if (g->state == EPD_G_FORMING ? !announced
				      : g->peer[from] != EPD_PEER_OPEN) {
		epd_info("group %s: node %s's failure (%s) is not of the group "
			 "this one met there: ignored",
			 g->key, node, m->msg);
		return;
	}
	g->peer[from] = EPD_PEER_OVER;
	epd_group_remote_failure(g, node, m->code, m->msg, m->round, m->xops);
}

void epd_xop_stash_free(struct epd_server *srv)
{
	if (!srv->xnode)
		return;
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->xnode->xstash)
	{
		list_del(it);
		free(LIST_ENTRY(it, struct stashed, node));
	}
	srv->xnode->xstash_bytes = 0;
}

void epd_xop_replay(struct epd_group *g)
{
	struct list_node *it, *tmp, mine;
	struct epd_server *srv = g->srv;
	/* taken out first: a frame handled here may stash again (one that
	 * came after its node's group failed), which drops what that node
	 * sent before */
	LIST_INIT(&mine);
	LIST_FOREACH(it, tmp, &srv->xnode->xstash)
	{
		struct stashed *e = LIST_ENTRY(it, struct stashed, node);
		if (strcmp(e->name, g->key))
			continue;
		list_del(&e->node);
		srv->xnode->xstash_bytes -= e->len;
		list_add_tail(&mine, &e->node);
	}
	LIST_FOREACH(it, tmp, &mine)
	{
		struct stashed *e = LIST_ENTRY(it, struct stashed, node);
		list_del(&e->node);
		struct epp_peer_barrier m;
		const uint32_t from = epd_group_node_of(g, e->from);
		if (e->type == EPP_PEER_BARRIER &&
		    !epp_peer_barrier_decode(e->data, e->len, &m)) {
			if (admit(g, from, e->from, e->type, e->data, e->len))
				epd_group_remote_arrival(g, from, m.local,
							 m.seq, m.xops, m.step);
		} else if (g->state == EPD_G_READY) {
			epd_xop_frame(g->srv, e->type, e->from, e->data,
				      e->len);
		}
		free(e);
	}
}

size_t epd_xop_shape_encode(const char *key, const struct epp_join *j,
			    uint32_t timeout_ms, uint64_t nodes_hash,
			    uint8_t *buf, size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, buf, cap);
	epp_peer_put_op(&w, key, 0);
	const uint32_t v[] = {j->world_size, j->ranks_per_node,
			      j->num_experts, j->hidden,
			      j->max_tokens, j->topk,
			      j->dtype, timeout_ms};
	for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++)
		epp_put_u32(&w, v[i]);
	if (nodes_hash) /* 1.21 */
		epp_put_u64(&w, nodes_hash);
	if (j->recv_rows)
		epp_put_u32(&w, j->recv_rows);
	return w.err ? 0 : w.off;
}

/* The group's shape to node n. */
static void shape_to(struct epd_group *g, uint32_t n)
{
	uint8_t buf[192];
	size_t len = epd_xop_shape_encode(g->key, &g->shape, g->timeout_ms,
					  g->nodes_hash, buf, sizeof(buf));
	epd_cluster_send(g, n, EPP_PEER_GSHAPE, buf, len, NULL, 0, NULL);
}

/* The group became ready here: its shape to the group's other nodes, which
 * compare it with theirs. */
void epd_xop_announce(struct epd_group *g)
{
	g->announced = true;
	for (uint32_t n = 0; n < g->nnodes; n++)
		if (n != g->node_index)
			shape_to(g, n);
	xwin_setup(g);
}

static void check_shape(struct epd_group *g, uint32_t from,
			const struct epp_peer_op *op)
{
	uint8_t mine[192];
	size_t mlen = epd_xop_shape_encode(g->key, &g->shape, g->timeout_ms,
					   g->nodes_hash, mine, sizeof(mine));
	static const char *const names[EPP_PEER_SHAPE_N] = {
		"world_size", "ranks_per_node", "num_experts", "hidden",
		"max_tokens", "topk", "dtype", "timeout_ms"};
	uint32_t theirs[EPP_PEER_SHAPE_N];
	uint64_t their_nodes, our_nodes;
	uint32_t their_recv, our_recv;
	if (epp_peer_shape_decode(op, theirs, &their_nodes, &their_recv)) {
		epd_group_fail(g, EP_EPROTO, "node %s sent a malformed shape",
			       epd_cluster_node_name(g, from));
		return;
	}
	uint32_t ours[EPP_PEER_SHAPE_N];
	struct epp_peer_op mo;
	if (epp_peer_op_decode(mine, mlen, &mo) ||
	    epp_peer_shape_decode(&mo, ours, &our_nodes, &our_recv)) {
		epd_group_fail(g, EP_ENOMEM, "cannot encode the group's shape");
		return;
	}
	for (int i = 0; i < EPP_PEER_SHAPE_N; i++) {
		uint32_t a = ours[i], b = theirs[i];
		if (a != b) {
			epd_group_fail(g, EP_EMISMATCH,
				       "node %s joined group %s with %s %u; "
				       "this node has %u",
				       epd_cluster_node_name(g, from),
				       g->shape.name, names[i], b, a);
			return;
		}
	}
	if (their_recv != our_recv) {
		epd_group_fail(g, EP_EMISMATCH,
			       "node %s joined group %s with recv_rows %u; "
			       "this node has %u (0: world_size x "
			       "max_tokens)",
			       epd_cluster_node_name(g, from), g->shape.name,
			       their_recv, our_recv);
		return;
	}
	if (their_nodes != our_nodes)
		epd_group_fail(g, EP_EMISMATCH,
			       "node %s joined group %s %s; this node's ranks "
			       "%s (every rank names the same nodes, in the "
			       "same order)",
			       epd_cluster_node_name(g, from), g->shape.name,
			       their_nodes ? "naming its nodes"
					   : "naming no nodes",
			       our_nodes ? (their_nodes ? "named others"
							: "named them")
					 : "named none");
}

/* A rail peer's barrier arrival (m decoded from p): to its group, or kept
 * until the group exists here. */
/* Node cfrom (the cluster's index) is none of group g's nodes: its
 * frames are an earlier group's of the key, on other nodes. */
static void foreign(struct epd_group *g, uint16_t type, uint32_t cfrom)
{
	epd_info("cross-node %s for group %s from node %s dropped: that node "
		 "is none of the group's",
		 epp_type_name(type), g->key, epd_cluster_name_at(g->srv, cfrom));
}

void epd_xop_arrival(struct epd_server *srv, uint32_t cfrom,
		     const struct epp_peer_barrier *m, const uint8_t *p,
		     uint32_t len)
{
	struct epd_group *g = epd_group_find(srv, m->group);
	const uint32_t from = g ? epd_group_node_of(g, cfrom) : UINT32_MAX;
	if (g && from == UINT32_MAX)
		foreign(g, EPP_PEER_BARRIER, cfrom);
	else if (!g || g->state == EPD_G_FORMING)
		stash_frame(srv, m->group, EPP_PEER_BARRIER, cfrom, p, len);
	else if (admit(g, from, cfrom, EPP_PEER_BARRIER, p, len))
		epd_group_remote_arrival(g, from, m->local, m->seq, m->xops,
					 m->step);
}

/* A group's shape from node `from` (GSHAPE): checked against ours, or a
 * second one (that node's group ended and a new one formed there). */
static void on_gshape(struct epd_group *g, uint32_t from, uint32_t cfrom,
		      const struct epp_peer_op *op, const uint8_t *p,
		      uint32_t len)
{
	if (g->peer[from] == EPD_PEER_OPEN) {
		/* a second shape: that node's group ended and a new one
		 * formed there, its failure lost on the way. This one
		 * cannot go on with that node (the new one there, not its
		 * partner, ignores this failure); the shape waits for the
		 * next group here. */
		g->peer[from] = EPD_PEER_OVER;
		stash_frame(g->srv, op->group, EPP_PEER_GSHAPE, cfrom, p, len);
		epd_group_fail(g, EP_EPEERLOST,
			       "node %s's group %s ended (a new one formed "
			       "there)",
			       epd_cluster_node_name(g, from), g->shape.name);
		return;
	}
	g->peer[from] = EPD_PEER_OPEN;
	check_shape(g, from, op);
}

/* A rank's routing of dispatch `id` (XMETA) from node `from`: kept in
 * the op, which is submitted once every rank's came and it started
 * here. */
static void on_xmeta(struct epd_group *g, uint32_t from, uint64_t id,
		     const struct epp_peer_op *op)
{
	const uint32_t rpn = g->shape.ranks_per_node, K = g->shape.topk;
	struct epp_peer_xmeta m;
	int mbad = epp_peer_xmeta_decode(op, &m);
	uint32_t s = m.rank, T = m.tokens, fl = m.flags;
	if (!mbad && id < g->xop_next) {
		/* every node's dispatch waits for every routing: this node
		 * ran something else there */
		epd_xop_past(g, id, from, EPP_DISPATCH);
		return;
	}
	struct epd_xop *x = mbad ? NULL : xop_get(g, id, EPP_DISPATCH);
	if (x && x->type != EPP_DISPATCH) {
		/* a routing names a dispatch: this op is a combine here
		 * (taken as a dispatch's, it would be run twice) */
		epd_xop_type_mismatch(g, x, from, EPP_DISPATCH);
		return;
	}
	bool cached = fl & EPP_DISPATCH_CACHED;
	size_t nt = cached ? 0 : (size_t)T * K;
	bool wts = !cached && (fl & EPP_DISPATCH_WEIGHTS);
	const char *why =
		mbad ? "malformed"
		: !x ? "this node cannot hold"
		: s >= g->shape.world_size || s / rpn != from
			? "of a rank not on that node"
		: T > g->shape.max_tokens ? "of too many tokens"
		: x->have[s] ? "of a rank whose routing came already"
		: m.data_len != nt * (wts ? 12 : 8) ? "of a wrong length"
						    : NULL;
	if (why) {
		epd_group_fail(g, EP_EPROTO,
			       "node %u sent a routing %s (op %llu, rank %u)",
			       from, why, (unsigned long long)id, s);
		return;
	}
	/* every node runs the same kind of dispatch: a fresh one routes
	 * from every rank's top-k, a cached one from its handle (whose rows
	 * name it: checked with them) */
	const uint8_t kind = cached ? 2 : 1;
	if (x->started ? x->cached != cached
		       : x->meta_kind && x->meta_kind != kind) {
		epd_xop_kind_mismatch(g, x, from, cached);
		return;
	}
	x->meta_kind = kind;
	x->have[s] = 1;
	if (cached) { /* the arrival of a cached dispatch */
		if (++x->meta_have == x->meta_need && x->started)
			xop_submit(x);
		return;
	}
	x->tokens[s] = T;
	x->flags[s] = fl;
	x->topk[s] = malloc(nt * 8 + 8);
	x->weights[s] = wts ? malloc(nt * 4 + 4) : NULL;
	if (!x->topk[s] || (wts && !x->weights[s])) {
		epd_group_fail(g, EP_ENOMEM, "out of memory");
		return;
	}
	memcpy(x->topk[s], m.data, nt * 8);
	if (wts)
		memcpy(x->weights[s], m.data + nt * 8, nt * 4);
	if (++x->meta_have == x->meta_need && x->started)
		xop_submit(x);
}

/* Rows of a combine that came before its dispatch finished here (a node
 * ahead of this one): kept in the op, handled again as they came once it
 * starts here with the routing. 0, or -1 (the group failed). */
static int xrows_defer(struct epd_group *g, struct epd_xop *x, uint32_t from,
		       uint32_t cfrom, uint64_t id, size_t rec,
		       const uint8_t *p, uint32_t len)
{
	/* no more than every other node could owe this one's ranks (a row
	 * per token and top-k slot, and room for the frames' heads): a peer
	 * that sends on is failed, not buffered */
	const size_t most = (size_t)(g->nnodes - 1) *
				    g->shape.ranks_per_node *
				    g->shape.max_tokens * g->shape.topk * rec +
			    (1u << 20);
	if (x->deferred_bytes + len > most) {
		epd_group_fail(g, EP_EPROTO,
			       "node %u sent more early combine rows for op "
			       "%llu than the group can owe (%zu bytes)",
			       from, (unsigned long long)id, most);
		return -1;
	}
	x->deferred_bytes += len;
	struct xdefer *df = malloc(sizeof(*df) + len);
	if (!df) {
		epd_group_fail(g, EP_ENOMEM, "out of memory");
		return -1;
	}
	df->next = NULL;
	df->from = cfrom;
	df->len = len;
	memcpy(df->data, p, len);
	struct xdefer **tail = &x->deferred;
	while (*tail)
		tail = &(*tail)->next;
	*tail = df;
	return 0;
}

/* One row record of op x (destination d, slot): a dispatch's row into
 * its local rank's receive area; a combine's, with its weights, into the
 * staging of destination d (on another node). 0, or -1: out of range
 * (EP_EPROTO) or, with *oom, out of memory. */
static int xrows_place(struct epd_group *g, struct epd_xop *x, uint16_t otype,
		       const struct ek_route *route, const uint8_t *q,
		       size_t rb, size_t wb, bool *oom)
{
	uint32_t d, slot;
	memcpy(&d, q, 4);
	memcpy(&slot, q + 4, 4);
	if (otype == EPP_DISPATCH) {
		if (!xn_is_local(g, d) || slot >= g->layout.max_recv)
			return -1;
		uint32_t l = xn_lidx(g, d);
		size_t xb = (size_t)g->shape.hidden * g->layout.elt;
		memcpy(epd_region(g, l, EPP_BUF_RECV_X) + (size_t)slot * xb,
		       q + 8, xb);
		if (g->layout.nscales)
			memcpy(epd_region(g, l, EPP_BUF_RECV_SCALES) +
				       (size_t)slot * g->layout.nscales * 4,
			       q + 8 + xb, (size_t)g->layout.nscales * 4);
		return 0;
	}
	/* staged at its slot on destination d (elsewhere) */
	if (xn_is_local(g, d) || !route || slot >= route->num_recv[d])
		return -1;
	if (!x->staging[d])
		x->staging[d] = (uint16_t *)xbuf_get(
			g->srv, (size_t)route->num_recv[d] * rb + 2,
			&x->staging_cap[d]);
	if (!x->staging[d]) {
		*oom = true;
		return -1;
	}
	memcpy((uint8_t *)x->staging[d] + (size_t)slot * rb, q + 8, rb);
	if (!wb) {
		x->rows_nw++;
		return 0;
	}
	if (!x->wstaging[d])
		x->wstaging[d] = (float *)xbuf_get(
			g->srv, (size_t)route->num_recv[d] * wb + 4,
			&x->wstaging_cap[d]);
	if (!x->wstaging[d]) {
		*oom = true;
		return -1;
	}
	memcpy((uint8_t *)x->wstaging[d] + (size_t)slot * wb, q + 8 + rb, wb);
	x->rows_w++;
	return 0;
}

/* Rows of op `id` (XROWS) from node `from`: a dispatch's into the
 * receive areas, a combine's into the staging of their destinations,
 * each op checked against the handle and the rows every node expects. */
static void on_xrows(struct epd_group *g, uint32_t from, uint32_t cfrom,
		     uint64_t id, const struct epp_peer_op *op,
		     const uint8_t *p, uint32_t len)
{
	/* the record size depends on the op's type, the first field */
	struct epp_peer_xrows xr;
	uint16_t otype = 0;
	epp_peer_xrows_type(op, &otype); /* 0 on error: decode fails */
	/* a combine's rows may carry their top-k weights after them */
	const bool wrows = otype == (EPP_COMBINE | EPP_XROWS_WEIGHTS);
	const size_t wb = wrows ? (size_t)g->shape.topk * 4 : 0;
	const size_t rb = xn_row_bytes(g, otype & ~EPP_XROWS_WEIGHTS),
		     rec = 8 + rb + wb;
	int rbad = epp_peer_xrows_decode(op, rec, &xr);
	otype &= ~EPP_XROWS_WEIGHTS;
	const uint64_t handle = xr.handle;
	const uint32_t k = xr.count;
	if (otype != EPP_DISPATCH && otype != EPP_COMBINE)
		rbad = 1; /* no other op has rows */
	if (!rbad && id < g->xop_next) {
		/* an op ends here only once every row it expects came */
		epd_xop_past(g, id, from, otype);
		return;
	}
	struct epd_xop *x = rbad ? NULL : xop_get(g, id, otype);
	if (x && x->type != otype) {
		epd_xop_type_mismatch(g, x, from, otype);
		return;
	}
	if (!x) {
		epd_group_fail(g, EP_EPROTO,
			       "node %u sent unexpected rows for op %llu", from,
			       (unsigned long long)id);
		return;
	}
	if (otype == EPP_DISPATCH && !x->started) {
		/* A dispatch's rows follow every node's routing, this one's
		 * too, which it sends as the op starts here: that node's
		 * group took an earlier group's of this key here as its
		 * partner (both made again within the time a failure takes
		 * to cross). Neither can go on together. */
		epd_group_fail(g, EP_EPEERLOST,
			       "node %s's group %s ran dispatch %llu with an "
			       "earlier group of that name here (both were "
			       "made again at once); join again",
			       epd_cluster_node_name(g, from), g->shape.name,
			       (unsigned long long)id);
		return;
	}
	/* Every node's op names the same handle: the nodes number their
	 * handles alike (a dispatch succeeds or fails on all of them), so
	 * rows along another mean the nodes' ranks named different handles
	 * or ran different ops (a fresh dispatch's is 0 everywhere; rows
	 * before the op started here are a combine's, never 0). */
	const uint64_t mine = x->started ? x->handle : x->claimed;
	if ((x->started || mine) && handle != mine) {
		epd_xop_handle_mismatch(g, x, from, handle, mine);
		return;
	}
	if (!x->started)
		x->claimed = handle;
	/* Every expected row has come (stage 2 of a combine runs on them),
	 * or, once the job counted them, more rows than expected. */
	if (x->stage2 ||
	    (x->job_done && x->rows_got + k > x->rows_expected)) {
		epd_group_fail(g, EP_EPROTO,
			       "node %u sent more rows than op %llu expects",
			       from, (unsigned long long)id);
		return;
	}
	/* Only a combine's rows need the routing. A fresh dispatch's job may
	 * be building x->route on a work thread right now: not read here. */
	struct ek_route *route = NULL;
	if (otype == EPP_COMBINE)
		route = x->route ? x->route : epd_route_find(g, handle);
	if (otype == EPP_COMBINE && !route && !x->started) {
		xrows_defer(g, x, from, cfrom, id, rec, p, len);
		return;
	}
	const uint8_t *q = xr.recs;
	for (uint32_t i = 0; i < k; i++, q += rec) {
		bool oom = false;
		if (xrows_place(g, x, otype, route, q, rb, wb, &oom)) {
			if (oom)
				epd_group_fail(g, EP_ENOMEM, "out of memory");
			else
				epd_group_fail(g, EP_EPROTO,
					       "node %u sent a row out of "
					       "range",
					       from);
			return;
		}
		x->rows_got++;
	}
	xop_check(g);
}

/* A cross-node frame of a group (GSHAPE, XWIN, XMETA, XROWS) from the
 * cluster's node cfrom: routed to its group (kept for one not ready
 * here yet, answered for one that failed) and to the handler of its
 * type. */
void epd_xop_frame(struct epd_server *srv, uint16_t type, uint32_t cfrom,
		   const uint8_t *p, uint32_t len)
{
	struct epp_peer_op op;
	int bad = epp_peer_op_decode(p, len, &op);
	const char *name = bad ? "?" : op.group;
	uint64_t id = bad ? 0 : op.op;
	struct epd_group *g = bad ? NULL : epd_group_find(srv, name);
	/* the sender's index among the group's nodes */
	const uint32_t from = g ? epd_group_node_of(g, cfrom) : UINT32_MAX;
	if (g && from == UINT32_MAX) {
		foreign(g, type, cfrom);
		return;
	}
	if (!bad && (!g || g->state == EPD_G_FORMING ||
		     g->peer[from] == EPD_PEER_OVER)) {
		/* for the next group of this key here */
		stash_frame(srv, name, type, cfrom, p, len);
		return;
	}
	/* A node that formed the group after it failed here (its GFAIL
	 * found no group there): told now, or its ops would wait out their
	 * timeout for ranks that are gone. */
	if (!bad && type == EPP_PEER_GSHAPE && g->state == EPD_G_FAILED) {
		/* this group's shape first: that node's group takes the
		 * failure as its partner's (see epd_xop_failure) */
		shape_to(g, from);
		epd_cluster_tell_failed(g, from);
		return;
	}
	if (bad || g->state != EPD_G_READY) {
		epd_warn("cross-node %s for group %s (op %llu) from node %u "
			 "dropped: the group failed or the frame is malformed",
			 epp_type_name(type), name, (unsigned long long)id,
			 cfrom);
		return;
	}
	if ((type == EPP_PEER_XMETA || type == EPP_PEER_XROWS) &&
	    id >= g->xop_next + EPD_XOPS_MAX) {
		epd_group_fail(g, EP_ETOOBIG,
			       "node %u is at operation %llu, this node at "
			       "%llu: at most %d operations ahead are buffered",
			       from, (unsigned long long)id,
			       (unsigned long long)g->xop_next, EPD_XOPS_MAX);
		return;
	}
	if (type == EPP_PEER_GSHAPE) {
		on_gshape(g, from, cfrom, &op, p, len);
		return;
	}
	if (!admit(g, from, cfrom, type, p, len))
		return;
	if (type == EPP_PEER_XWIN)
		xwin_frame(g, from, &op);
	else if (type == EPP_PEER_XMETA)
		on_xmeta(g, from, id, &op);
	else
		on_xrows(g, from, cfrom, id, &op, p, len);
}
