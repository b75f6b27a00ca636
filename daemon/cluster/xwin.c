/* SPDX-License-Identifier: MIT */
/*
 * The cross-node engine (xnode_int.h): rows by one-sided writes. A group's
 * windows (registered inputs and receive buffers, their keys sent in
 * XWIN), the writes a job queues, and their completions (immediates).
 */
#include "xnode_int.h"

static void xwin_release(struct epd_xwin *xw)
{
	if (!xw)
		return;
	for (uint32_t l = 0; l < xw->rpn; l++) {
		if (xw->src && xw->src[l])
			xw->tops->dereg(xw->src[l]);
		if (xw->dst && xw->dst[l])
			xw->tops->dereg(xw->dst[l]);
	}
	for (uint32_t n = 0; xw->peer && n < xw->nnodes; n++) {
		free(xw->peer[n].addr);
		free(xw->peer[n].len);
		free(xw->peer[n].rkey);
	}
	free(xw->src);
	free(xw->dst);
	free(xw->peer);
	free(xw);
}

/* A local rank's inputs (x, scales: the writes' sources) and receive
 * buffers (rows, scales: the peers' writes' targets), as byte ranges. */
static void xwin_range(struct epd_group *g, uint32_t l, bool dst, uint8_t **p,
		       size_t *len)
{
	int a = dst ? EPP_BUF_RECV_X : EPP_BUF_X;
	int b = dst ? EPP_BUF_RECV_TOPK_IDX : EPP_BUF_TOPK_IDX;
	*p = epd_region(g, l, a);
	*len = (size_t)(g->layout.off[b] - g->layout.off[a]);
}

static bool wid_used(struct epd_server *srv, uint16_t wid)
{
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->groups)
	{
		struct epd_group *g = LIST_ENTRY(it, struct epd_group, node);
		if (g->xw && g->xw->wid == wid)
			return true;
	}
	LIST_FOREACH(it, tmp, &srv->xnode->xzombies)
	{
		if (LIST_ENTRY(it, struct xzombie, node)->xw->wid == wid)
			return true;
	}
	return false;
}

static struct epd_group *group_by_wid(struct epd_server *srv, uint16_t wid)
{
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->groups)
	{
		struct epd_group *g = LIST_ENTRY(it, struct epd_group, node);
		if (g->xw && g->xw->wid == wid)
			return g;
	}
	return NULL;
}

/* rdma transport: register the group's windows and tell the other nodes
 * where their rows go. Without them (no rdma, a refusal) rows go as
 * frames; nothing else changes. */
void xwin_setup(struct epd_group *g)
{
	struct epd_server *srv = g->srv;
	struct epd_transport *tr = epd_cluster_transport(srv);
	const uint32_t rpn = g->shape.ranks_per_node;
	char why[160] = "";
	if (!tr || g->xw)
		return;
	struct epd_xwin *xw = calloc(1, sizeof(*xw));
	if (!xw)
		return;
	xw->tops = tr->ops;
	xw->rpn = rpn;
	xw->nnodes = g->nnodes;
	xw->src = calloc(rpn, sizeof(*xw->src));
	xw->dst = calloc(rpn, sizeof(*xw->dst));
	xw->peer = calloc(g->nnodes, sizeof(*xw->peer));
	bool ok = xw->src && xw->dst && xw->peer;
	for (uint32_t n = 0; ok && n < g->nnodes; n++) {
		xw->peer[n].addr = calloc(rpn, 8);
		xw->peer[n].len = calloc(rpn, 8);
		xw->peer[n].rkey = calloc(rpn, 4);
		ok = xw->peer[n].addr && xw->peer[n].len && xw->peer[n].rkey;
	}
	if (!ok)
		snprintf(why, sizeof(why), "out of memory");
	for (uint32_t l = 0; ok && l < rpn; l++) {
		uint8_t *p;
		size_t len;
		xwin_range(g, l, false, &p, &len);
		xw->src[l] = tr->ops->reg(tr, p, len, false, why, sizeof(why));
		xwin_range(g, l, true, &p, &len);
		if (xw->src[l])
			xw->dst[l] = tr->ops->reg(tr, p, len, true, why,
						  sizeof(why));
		ok = xw->src[l] && xw->dst[l];
	}
	if (!ok) {
		epd_warn("group %s: rows go as frames, not RDMA writes: %s",
			 g->shape.name, why);
		xwin_release(xw);
		return;
	}
	do
		xw->wid = ++srv->xnode->next_wid;
	while (!xw->wid || wid_used(srv, xw->wid));
	g->xw = xw;
	size_t cap = 128 + (size_t)rpn * 20;
	uint8_t *buf = malloc(cap);
	if (!buf)
		return; /* the peers write nothing here: frames */
	struct epp_wr w;
	epp_wr_init(&w, buf, cap);
	epp_peer_put_op(&w, g->key, 0);
	epp_put_u16(&w, xw->wid);
	epp_put_u32(&w, rpn);
	for (uint32_t l = 0; l < rpn; l++) {
		uint8_t *p;
		size_t len;
		xwin_range(g, l, true, &p, &len);
		struct epp_peer_window e = {.addr = (uint64_t)(uintptr_t)p,
					    .rkey = xw->dst[l]->rkey,
					    .len = (uint64_t)len};
		epp_peer_put_window(&w, &e);
	}
	for (uint32_t n = 0; n < g->nnodes; n++)
		if (n != g->node_index && epd_cluster_wconn(g, n))
			epd_cluster_send(g, n, EPP_PEER_XWIN, buf, w.off, NULL,
					 0, NULL);
	free(buf);
	epd_info("group %s: %u local ranks' buffers registered for RDMA "
		 "writes (window %u)",
		 g->shape.name, rpn, xw->wid);
}

/* Node from's windows for group g. */
void xwin_frame(struct epd_group *g, uint32_t from,
		       const struct epp_peer_op *op)
{
	struct epd_xwin *xw = g->xw;
	const uint32_t rpn = g->shape.ranks_per_node;
	struct epp_peer_xwin m;
	if (epp_peer_xwin_decode(op, &m) || m.n != rpn ||
	    from == g->node_index) {
		epd_group_fail(g, EP_EPROTO, "node %u sent malformed windows",
			       from);
		return;
	}
	if (!xw)
		return; /* this node writes no rows: frames */
	struct xpeer *pe = &xw->peer[from];
	if (pe->have) {
		epd_group_fail(g, EP_EPROTO, "node %u sent its windows twice",
			       from);
		return;
	}
	/* what a row write may reach: every slot's row and scales */
	const uint64_t need = g->layout.off[EPP_BUF_RECV_SCALES] -
			      g->layout.off[EPP_BUF_RECV_X] +
			      g->layout.max_recv * g->layout.nscales * 4;
	for (uint32_t l = 0; l < rpn; l++) {
		struct epp_peer_window e;
		epp_peer_xwin_get(&m, l, &e);
		pe->addr[l] = e.addr;
		pe->rkey[l] = e.rkey;
		pe->len[l] = e.len;
		if (pe->len[l] < need) {
			epd_group_fail(g, EP_EPROTO,
				       "node %u offered a window of %llu "
				       "bytes for local rank %u; rows need "
				       "%llu",
				       from, (unsigned long long)pe->len[l], l,
				       (unsigned long long)need);
			return;
		}
	}
	pe->wid = m.wid;
	pe->have = true;
}

static void zombie_closed(uv_handle_t *h)
{
	struct xzombie *z = h->data;
	xwin_release(z->xw);
	if (z->map)
		munmap(z->map, z->size);
	if (z->fd >= 0)
		close(z->fd);
	free(z);
}

static void zombie_due(uv_timer_t *t)
{
	struct xzombie *z = t->data;
	list_del(&z->node);
	uv_close((uv_handle_t *)&z->timer, zombie_closed);
}

void epd_xwin_free(struct epd_group *g)
{
	struct epd_xwin *xw = g->xw;
	struct epd_server *srv = g->srv;
	g->xw = NULL;
	if (!xw)
		return;
	struct xzombie *z = srv->stopping ? NULL : calloc(1, sizeof(*z));
	if (!z) { /* at shutdown the connections are going too */
		xwin_release(xw);
		return;
	}
	/* the mapping goes with the regions: a peer's write in flight
	 * lands in memory that is still there and still registered */
	z->srv = srv;
	z->xw = xw;
	z->map = g->map;
	z->size = g->buf_size;
	z->fd = g->buf_fd;
	g->map = NULL;
	g->buf_fd = -1;
	uv_timer_init(srv->loop, &z->timer);
	z->timer.data = z;
	list_add_tail(&srv->xnode->xzombies, &z->node);
	uv_timer_start(&z->timer, zombie_due, XWIN_GRACE_MS, 0);
}

void epd_xwin_flush(struct epd_server *srv)
{
	if (!srv->xnode)
		return;
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->xnode->xzombies)
	{
		struct xzombie *z = LIST_ENTRY(it, struct xzombie, node);
		uv_timer_stop(&z->timer);
		zombie_due(&z->timer);
	}
}

/* The op of g whose number ends in low (at most EPD_XOPS_MAX < 2^16 are
 * open). */
static struct epd_xop *xop_by_low(struct epd_group *g, uint16_t low)
{
	for (uint32_t i = 0; i < g->xcap; i++)
		if (g->xop[i] && (uint16_t)g->xop[i]->id == low)
			return g->xop[i];
	return NULL;
}

void epd_xop_imm(struct epd_server *srv, uint32_t cfrom, uint32_t imm)
{
	struct epd_group *g = group_by_wid(srv, (uint16_t)(imm >> 16));
	const uint32_t from = g ? epd_group_node_of(g, cfrom) : UINT32_MAX;
	if (!g || g->state != EPD_G_READY || from == UINT32_MAX)
		return; /* failed or gone here: its ops are over */
	struct epd_xop *x = xop_by_low(g, (uint16_t)imm);
	if (!x || x->type != EPP_DISPATCH || !x->started || x->wdone[from]) {
		epd_group_fail(g, EP_EPROTO,
			       "node %u signalled written rows for op %u, "
			       "which this node does not expect",
			       from, imm & 0xffffu);
		return;
	}
	x->wdone[from] = 1;
	xop_check(g);
}

void epd_xop_written(struct epd_server *srv, uint32_t cto, uint64_t cookie)
{
	struct epd_group *g = group_by_wid(srv, (uint16_t)(cookie >> 16));
	const uint32_t to = g ? epd_group_node_of(g, cto) : UINT32_MAX;
	if (!g || g->state != EPD_G_READY || to == UINT32_MAX)
		return; /* failed here: its ops are dropped */
	struct epd_xop *x = xop_by_low(g, (uint16_t)cookie);
	if (!x || !x->wrc[to])
		return;
	x->wsent[to] = 1;
	xop_check(g);
}

/* On the job's thread: row t of local source s to slot `slot` of rank d
 * on another node, by RDMA WRITE (and its scales). */
static int write_row(struct epd_xop *x, struct epd_transport *tr, uint32_t s,
		     uint32_t t, uint32_t d, uint32_t slot)
{
	struct epd_group *g = x->g;
	const uint32_t rpn = g->shape.ranks_per_node, n = d / rpn;
	const uint32_t ls = xn_lidx(g, s), ld = xn_lidx(g, d);
	const size_t xb = (size_t)g->shape.hidden * g->layout.elt;
	const size_t sb = (size_t)g->layout.nscales * 4;
	const struct xpeer *pe = &g->xw->peer[n];
	struct epd_cmd c = {
		.conn = x->wrc[n],
		.laddr = (uintptr_t)(epd_region(g, ls, EPP_BUF_X) + t * xb),
		.lkey = g->xw->src[ls]->lkey,
		.raddr = pe->addr[ld] + (uint64_t)slot * xb,
		.rkey = pe->rkey[ld],
		.len = (uint32_t)xb};
	if (!tr->ops->write(tr, &c))
		return -1;
	if (!sb)
		return 0;
	c.laddr = (uintptr_t)(epd_region(g, ls, EPP_BUF_X_SCALES) + t * sb);
	c.raddr = pe->addr[ld] + g->layout.off[EPP_BUF_RECV_SCALES] -
		  g->layout.off[EPP_BUF_RECV_X] + (uint64_t)slot * sb;
	c.len = (uint32_t)sb;
	return tr->ops->write(tr, &c) ? 0 : -1;
}

/* After the rows: per node written to, a zero-byte write with immediate
 * (its window id, the op) that arrives after them. */
static int write_imm(struct epd_xop *x, struct epd_transport *tr, uint32_t n)
{
	struct epd_group *g = x->g;
	const struct xpeer *pe = &g->xw->peer[n];
	struct epd_cmd c = {.conn = x->wrc[n],
			    .raddr = pe->addr[0],
			    .rkey = pe->rkey[0],
			    .imm = (uint32_t)pe->wid << 16 | (uint16_t)x->id,
			    .cookie = (uint64_t)g->xw->wid << 16 |
				      (uint16_t)x->id,
			    .flags = EPD_CMD_IMM};
	return tr->ops->write(tr, &c) ? 0 : -1;
}

/* On the job's thread: a dispatch's rows from local sources to other
 * nodes' destinations, written where the node's windows are known (then
 * an immediate to each node written to: x->wimm), else packed for frames.
 * -1 if the proxy refused (the daemon is stopping). */
int xn_rows_out(struct epd_xop *x, const struct ek_rank_io *io,
		    const struct ek_route *r)
{
	struct epd_group *g = x->g;
	const uint32_t W = x->W, rpn = g->shape.ranks_per_node;
	const size_t xb = (size_t)g->shape.hidden * g->layout.elt;
	const size_t rb = xn_row_bytes(g, x->type);
	struct epd_transport *tr = epd_cluster_transport(g->srv);
	for (uint32_t s = g->node_index * rpn; s < (g->node_index + 1) * rpn;
	     s++)
		for (uint32_t t = 0; t < x->tokens[s]; t++)
			for (uint32_t d = 0; d < W; d++) {
				int32_t slot = r->slot[s][(size_t)t * W + d];
				const uint32_t n = d / rpn;
				if (slot < 0 || xn_is_local(g, d))
					continue;
				x->bytes += 2 * rb;
				if (!x->wrc[n]) {
					xn_out_record(&x->out[n], d, (uint32_t)slot,
						   (uint8_t *)io[s].x + t * xb,
						   xb,
						   io[s].x_scales +
							   (size_t)t *
								   g->layout.nscales,
						   (size_t)g->layout.nscales * 4);
					continue;
				}
				if (write_row(x, tr, s, t, d, (uint32_t)slot))
					return -1;
				x->wimm[n] = 1;
			}
	for (uint32_t n = 0; n < g->nnodes; n++)
		if (x->wimm[n] && write_imm(x, tr, n))
			return -1;
	return 0;
}
