/* SPDX-License-Identifier: MIT */
/*
 * Dispatch and combine for groups that span nodes (host backend, through
 * the cluster's transport).
 *
 * Every node computes the same global routing (prefix sums over every
 * rank's counts), so slots agree without any agreement protocol:
 *  - dispatch: once the local ranks arrived, each node sends its ranks'
 *    topk_idx (and weights) to the group's other nodes (XMETA). With all of
 *    them, a job validates every rank's experts (a bad index fails the op on
 *    every node alike), routes, copies local rows, writes the metadata of
 *    rows that come from other nodes, and packs its rows for other nodes as
 *    (destination, slot, row) records (XROWS). The op ends when the job is
 *    done and every expected row arrived.
 *  - combine: the routing is the handle's. A job packs the rows whose home
 *    is on another node; a home stages the rows it receives at their slots
 *    in a per-destination buffer, so the one-node accumulation runs
 *    unchanged, in ascending rank order: the same bits as on one node.
 * Collectives are numbered per group on every node alike (op ids); a
 * node that is ahead may send combine rows early, which are staged.
 *
 * The tcp transport copies received rows on the loop thread. With the rdma
 * transport a dispatch's rows are written in place instead: each node
 * registers its local ranks' inputs and receive buffers when the group
 * forms and sends the receive buffers' addresses and keys to the group's
 * other nodes (XWIN, with a window id of its own); a job then queues one
 * RDMA WRITE per (row, destination) on the proxy, from the source rank's
 * input straight to the destination rank's slot on the other node, and a
 * last zero-byte write with immediate (window id, op) per node it wrote
 * to. The queue pair places that one after the rows, so its arrival
 * counts every row from that node (the receiver knows how many from its
 * own routing); its local completion says the inputs are read. Combine
 * rows, and rows to a node whose windows are not known, go as frames.
 */
#include "core/epd.h"
#include "transport/rdma/proxy.h"
#include "transport/rdma/rdma.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define FRAME_MAX (512u << 10) /* row records per XROWS frame */

/* Large buffers (packed rows, staged rows) kept between ops, on the loop
 * thread only. Fresh ones cost a page fault per 4 KiB and an munmap each
 * op, which measured (ep-bench, 2 nodes x 4 ranks, hidden 7168) as half
 * of a cross-node dispatch's time. Best fit; the smallest is evicted. */
#define XBUF_SLOTS 8
#define XBUF_KEEP (1ull << 30) /* bytes kept at most */

struct epd_xbufs {
	struct {
		uint8_t *p;
		size_t cap;
	} s[XBUF_SLOTS];
	int n;
	size_t bytes;
};

/* A buffer of at least want bytes (its size in *cap), or NULL. */
static uint8_t *xbuf_get(struct epd_server *srv, size_t want, size_t *cap)
{
	struct epd_xbufs *b = srv->xbufs;
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

static void xbuf_put(struct epd_server *srv, uint8_t *p, size_t cap)
{
	if (!p)
		return;
	if (!any_xgroup(srv)) {
		free(p); /* the last one is gone: nothing to keep for */
		return;
	}
	if (!srv->xbufs)
		srv->xbufs = calloc(1, sizeof(*srv->xbufs));
	struct epd_xbufs *b = srv->xbufs;
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
	if (srv->xbufs && !any_xgroup(srv)) {
		epd_xbufs_free(srv);
		epd_info("no group spans nodes any more: row buffers freed");
	}
}

void epd_xbufs_free(struct epd_server *srv)
{
	struct epd_xbufs *b = srv->xbufs;
	for (int i = 0; b && i < b->n; i++)
		free(b->s[i].p);
	free(b);
	srv->xbufs = NULL;
}

size_t epd_xbufs_bytes(const struct epd_server *srv)
{
	return srv->xbufs ? srv->xbufs->bytes : 0;
}

void epd_sref_put(struct epd_sref *r)
{
	if (--r->refs)
		return;
	xbuf_put(r->srv, r->p, r->cap);
	free(r);
}

struct outbuf {
	uint8_t *p;
	size_t len, cap;
	uint32_t count;
};

/* A frame that came before its op could use it. */
struct xdefer {
	struct xdefer *next;
	uint32_t from, len;
	uint8_t data[];
};

struct epd_xop {
	struct epd_group *g;
	struct xdefer *deferred; /* combine rows before the routing */
	uint64_t id;
	uint16_t type;
	bool cached, started, job_running, job_done, stage2;
	uint64_t handle;
	uint32_t W;
	uint32_t *tokens, *flags;
	uint8_t *have; /* [W]: the routing (or arrival) of that rank came */
	int64_t **topk;  /* [W]; remote ones malloc'd */
	float **weights; /* [W]; remote ones malloc'd or NULL */
	uint32_t meta_have, meta_need;
	uint64_t rows_expected, rows_got;
	struct ek_route *route; /* fresh dispatch: owned until finish */
	bool own_route;
	uint16_t **staging; /* combine: [W], remote destinations */
	size_t *staging_cap;
	struct outbuf *out; /* [nnodes] */
	/* rdma writes: the connection of each node written to (held), and
	 * per node: an immediate sent (job), its completion (loop), its
	 * rows placed here (loop), and how many rows come from it */
	struct epd_rconn **wrc;
	uint8_t *wimm, *wsent, *wdone;
	uint64_t *rows_from;
	uv_work_t req;
	int rc;
	char err[EPP_ERRMSG_MAX];
	uint64_t bytes;
};

static void xop_free(struct epd_xop *x)
{
	if (!x)
		return;
	while (x->deferred) {
		struct xdefer *d = x->deferred;
		x->deferred = d->next;
		free(d);
	}
	/* topk: private copies, local sources' included */
	struct epd_server *srv = x->g->srv;
	for (uint32_t s = 0; s < x->W; s++) {
		if (x->topk)
			free(x->topk[s]);
		if (x->weights)
			free(x->weights[s]);
		if (x->staging && x->staging_cap)
			xbuf_put(srv, (uint8_t *)x->staging[s],
				 x->staging_cap[s]);
	}
	if (x->out)
		for (uint32_t n = 0; n < x->g->nnodes; n++)
			xbuf_put(srv, x->out[n].p, x->out[n].cap);
	for (uint32_t n = 0; x->wrc && n < x->g->nnodes; n++)
		if (x->wrc[n])
			epd_rdma_release(x->wrc[n]);
	free(x->wrc);
	free(x->wimm);
	free(x->wsent);
	free(x->wdone);
	free(x->rows_from);
	if (x->own_route)
		ek_route_free(x->route);
	free(x->tokens);
	free(x->flags);
	free(x->topk);
	free(x->weights);
	free(x->staging);
	free(x->staging_cap);
	free(x->have);
	free(x->out);
	free(x);
}

void epd_xop_drop(struct epd_group *g)
{
	for (uint32_t i = 0; i < g->xcap; i++)
		if (g->xop[i] && !g->xop[i]->job_running) {
			xop_free(g->xop[i]);
			g->xop[i] = NULL;
		}
}

static struct epd_xop *xop_cur(struct epd_group *g)
{
	if (!g->xcap)
		return NULL;
	struct epd_xop *x = g->xop[g->xop_next % g->xcap];
	return x && x->id == g->xop_next ? x : NULL;
}

static bool is_local(const struct epd_group *g, uint32_t rank);

void epd_xop_missing(struct epd_group *g, char *out, size_t cap)
{
	struct epd_xop *x = xop_cur(g);
	size_t off = 0;
	out[0] = 0;
	for (uint32_t s = 0; s < g->shape.world_size; s++) {
		if (is_local(g, s))
			continue;
		bool miss = x ? (x->type == EPP_DISPATCH ? !x->have[s]
							 : x->rows_got <
								   x->rows_expected)
			      : true;
		if (!miss)
			continue;
		int n = snprintf(out + off, cap - off, "%s%u", off ? "," : "",
				 s);
		if (n < 0 || (size_t)n >= cap - off)
			break;
		off += (size_t)n;
	}
	if (!off)
		snprintf(out, cap, "-");
}

/* Room in the ring of open ops for op id: it grows (a power of two) as
 * far as another node runs ahead, up to EPD_XOPS_MAX ops. Open ops have
 * numbers in [xop_next, xop_next + xcap), so they stay distinct modulo a
 * larger capacity. */
static int xring_fit(struct epd_group *g, uint64_t id)
{
	uint64_t need = id - g->xop_next + 1;
	if (need <= g->xcap)
		return 0;
	if (need > EPD_XOPS_MAX)
		return -1;
	uint32_t ncap = g->xcap ? g->xcap : 4;
	while (ncap < need)
		ncap *= 2;
	struct epd_xop **n = calloc(ncap, sizeof(*n));
	if (!n)
		return -1;
	for (uint32_t i = 0; i < g->xcap; i++)
		if (g->xop[i])
			n[g->xop[i]->id % ncap] = g->xop[i];
	free(g->xop);
	g->xop = n;
	g->xcap = ncap;
	return 0;
}

/* The op numbered id: this node's next, or one of the few after it that a
 * node ahead of this one already works on. */
static struct epd_xop *xop_get(struct epd_group *g, uint64_t id,
			       uint16_t type)
{
	if (id < g->xop_next || xring_fit(g, id))
		return NULL;
	struct epd_xop **slot = &g->xop[id % g->xcap];
	if (*slot)
		return (*slot)->id == id ? *slot : NULL;
	struct epd_xop *x = calloc(1, sizeof(*x));
	uint32_t W = g->shape.world_size;
	if (!x)
		return NULL;
	x->g = g;
	x->id = id;
	x->type = type;
	x->W = W;
	x->tokens = calloc(W, sizeof(*x->tokens));
	x->flags = calloc(W, sizeof(*x->flags));
	x->topk = calloc(W, sizeof(*x->topk));
	x->weights = calloc(W, sizeof(*x->weights));
	x->staging = calloc(W, sizeof(*x->staging));
	x->staging_cap = calloc(W, sizeof(*x->staging_cap));
	x->have = calloc(W, 1);
	x->out = calloc(g->nnodes, sizeof(*x->out));
	x->wrc = calloc(g->nnodes, sizeof(*x->wrc));
	x->wimm = calloc(g->nnodes, 1);
	x->wsent = calloc(g->nnodes, 1);
	x->wdone = calloc(g->nnodes, 1);
	x->rows_from = calloc(g->nnodes, sizeof(*x->rows_from));
	if (!x->tokens || !x->flags || !x->topk || !x->weights ||
	    !x->staging || !x->staging_cap || !x->have || !x->out ||
	    !x->wrc || !x->wimm || !x->wsent || !x->wdone || !x->rows_from) {
		xop_free(x);
		return NULL;
	}
	x->meta_need = (g->nnodes - 1) * g->shape.ranks_per_node;
	*slot = x;
	return x;
}

/* The current op is over: the next one becomes current. */
static void xop_retire(struct epd_group *g, struct epd_xop *x)
{
	g->xop[x->id % g->xcap] = NULL;
	g->xop_next++;
}

static bool is_local(const struct epd_group *g, uint32_t rank)
{
	return rank / g->shape.ranks_per_node == g->node_index;
}

static uint32_t lidx(const struct epd_group *g, uint32_t rank)
{
	return rank % g->shape.ranks_per_node;
}

static void out_put(struct outbuf *o, const void *p, size_t n)
{
	if (o->cap - o->len < n) {
		size_t ncap = o->cap ? o->cap * 2 : 1 << 16;
		while (ncap - o->len < n)
			ncap *= 2;
		uint8_t *np = realloc(o->p, ncap);
		if (!np)
			abort(); /* a packing buffer: no way to go on */
		o->p = np;
		o->cap = ncap;
	}
	memcpy(o->p + o->len, p, n);
	o->len += n;
}

static void out_record(struct outbuf *o, uint32_t d, uint32_t slot,
		       const void *a, size_t na, const void *b, size_t nb)
{
	uint32_t hdr[2] = {d, slot};
	out_put(o, hdr, 8);
	out_put(o, a, na);
	if (nb)
		out_put(o, b, nb);
	o->count++;
}

static size_t row_bytes(const struct epd_group *g, uint16_t type)
{
	return type == EPP_DISPATCH
		       ? (size_t)g->shape.hidden * g->layout.elt +
				 (size_t)g->layout.nscales * 4
		       : (size_t)g->shape.hidden * 2;
}

static struct ek_shape shape_of(const struct epd_group *g)
{
	return (struct ek_shape){.world = g->shape.world_size,
				 .num_experts = g->shape.num_experts,
				 .hidden = g->shape.hidden,
				 .topk = g->shape.topk,
				 .elt = g->layout.elt,
				 .nscales = g->layout.nscales};
}

/* io by global rank: local ranks' buffers; other nodes' sources carry
 * their META (topk, weights) and no x; other nodes' destinations nothing,
 * or for combine the staged rows. */
static struct ek_rank_io *make_io(struct epd_xop *x)
{
	struct epd_group *g = x->g;
	struct ek_rank_io *io = calloc(x->W, sizeof(*io));
	if (!io)
		return NULL;
	for (uint32_t s = 0; s < x->W; s++) {
		struct ek_rank_io *o = &io[s];
		if (!is_local(g, s)) {
			o->topk_idx = x->topk[s];
			o->topk_weights = x->weights[s];
			/* staged rows are complete only in stage 2; before,
			 * the loop thread may still be filling staging[] */
			o->combine_y = x->stage2 ? x->staging[s] : NULL;
			continue;
		}
		uint32_t l = lidx(g, s);
		o->x = epd_region(g, l, EPP_BUF_X);
		o->x_scales = (float *)epd_region(g, l, EPP_BUF_X_SCALES);
		/* the private copy made when the op started (none for a
		 * cached dispatch or a combine, which do not read it) */
		o->topk_idx = x->topk[s];
		o->topk_weights =
			x->flags[s] & EPP_DISPATCH_WEIGHTS &&
					x->type == EPP_DISPATCH
				? (float *)epd_region(g, l,
						      EPP_BUF_TOPK_WEIGHTS)
				: NULL;
		o->recv_x = epd_region(g, l, EPP_BUF_RECV_X);
		o->recv_scales = (float *)epd_region(g, l, EPP_BUF_RECV_SCALES);
		o->recv_topk_idx = (int64_t *)epd_region(g, l,
							 EPP_BUF_RECV_TOPK_IDX);
		o->recv_topk_weights = (float *)epd_region(
			g, l, EPP_BUF_RECV_TOPK_WEIGHTS);
		o->recv_src = (int32_t *)epd_region(g, l, EPP_BUF_RECV_SRC);
		o->recv_per_expert =
			(int32_t *)epd_region(g, l, EPP_BUF_RECV_PER_EXPERT);
		o->combine_y = (uint16_t *)epd_region(g, l, EPP_BUF_COMBINE_Y);
		o->combine_bias = x->flags[s] & EPP_COMBINE_BIAS &&
						  x->type == EPP_COMBINE
					  ? (uint16_t *)epd_region(
						    g, l, EPP_BUF_COMBINE_BIAS)
					  : NULL;
		o->combined = (uint16_t *)epd_region(g, l, EPP_BUF_COMBINED);
		o->num_tokens = x->tokens[s];
	}
	return io;
}

/* The rdma windows of a group. Set up on the loop thread when the group
 * forms; a peer's entry once, from its XWIN; read by jobs only for nodes
 * they were given a connection for (set before the job was queued). */
struct xpeer {
	bool have;
	uint16_t wid;
	uint64_t *addr, *len; /* [rpn]: receive buffers (RECV_X on) */
	uint32_t *rkey;
};

struct epd_xwin {
	uint16_t wid; /* this node's id of the group, in immediates */
	uint32_t rpn, nnodes;
	struct epd_rmr **src, **dst; /* [rpn]: inputs, receive buffers */
	struct xpeer *peer;          /* [nnodes] */
};

/* Freed groups' windows, registered until peers' writes are surely over. */
#define XWIN_GRACE_MS 2000
struct xzombie {
	struct list_node node;
	struct epd_server *srv;
	struct epd_xwin *xw;
	uint8_t *map;
	uint64_t size;
	int fd;
	uv_timer_t timer;
};

static void xwin_release(struct epd_xwin *xw)
{
	if (!xw)
		return;
	for (uint32_t l = 0; l < xw->rpn; l++) {
		if (xw->src)
			epd_rdma_dereg(xw->src[l]);
		if (xw->dst)
			epd_rdma_dereg(xw->dst[l]);
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
	LIST_FOREACH(it, tmp, &srv->xzombies)
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
static void xwin_setup(struct epd_group *g)
{
	struct epd_server *srv = g->srv;
	struct epd_rdma *rd = epd_cluster_rdma(srv);
	const uint32_t rpn = g->shape.ranks_per_node;
	char why[160] = "";
	if (!rd || g->xw)
		return;
	struct epd_xwin *xw = calloc(1, sizeof(*xw));
	if (!xw)
		return;
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
		xw->src[l] = epd_rdma_reg(rd, p, len, false, why, sizeof(why));
		xwin_range(g, l, true, &p, &len);
		if (xw->src[l])
			xw->dst[l] = epd_rdma_reg(rd, p, len, true, why,
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
		xw->wid = ++srv->next_wid;
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
					    .rkey = epd_rmr_rkey(xw->dst[l]),
					    .len = (uint64_t)len};
		epp_peer_put_window(&w, &e);
	}
	for (uint32_t n = 0; n < g->nnodes; n++)
		if (n != g->node_index && epd_cluster_rconn(srv, n))
			epd_cluster_send(g, n, EPP_PEER_XWIN, buf, w.off, NULL,
					 0, NULL);
	free(buf);
	epd_info("group %s: %u local ranks' buffers registered for RDMA "
		 "writes (window %u)",
		 g->shape.name, rpn, xw->wid);
}

/* Node from's windows for group g. */
static void xwin_frame(struct epd_group *g, uint32_t from,
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
	list_add_tail(&srv->xzombies, &z->node);
	uv_timer_start(&z->timer, zombie_due, XWIN_GRACE_MS, 0);
}

void epd_xwin_flush(struct epd_server *srv)
{
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->xzombies)
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

static void xop_check(struct epd_group *g);

void epd_xop_imm(struct epd_server *srv, uint32_t from, uint32_t imm)
{
	struct epd_group *g = group_by_wid(srv, (uint16_t)(imm >> 16));
	if (!g || g->state != EPD_G_READY || from >= g->nnodes)
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

void epd_xop_written(struct epd_server *srv, uint32_t to, uint64_t cookie)
{
	struct epd_group *g = group_by_wid(srv, (uint16_t)(cookie >> 16));
	if (!g || g->state != EPD_G_READY || to >= g->nnodes)
		return; /* failed here: its ops are dropped */
	struct epd_xop *x = xop_by_low(g, (uint16_t)cookie);
	if (!x || !x->wrc[to])
		return;
	x->wsent[to] = 1;
	xop_check(g);
}

/* On the job's thread: row t of local source s to slot `slot` of rank d
 * on another node, by RDMA WRITE (and its scales). */
static int write_row(struct epd_xop *x, struct epd_rdma *rd, uint32_t s,
		     uint32_t t, uint32_t d, uint32_t slot)
{
	struct epd_group *g = x->g;
	const uint32_t rpn = g->shape.ranks_per_node, n = d / rpn;
	const uint32_t ls = lidx(g, s), ld = lidx(g, d);
	const size_t xb = (size_t)g->shape.hidden * g->layout.elt;
	const size_t sb = (size_t)g->layout.nscales * 4;
	const struct xpeer *pe = &g->xw->peer[n];
	struct epd_cmd c = {
		.conn = x->wrc[n],
		.laddr = (uintptr_t)(epd_region(g, ls, EPP_BUF_X) + t * xb),
		.lkey = epd_rmr_lkey(g->xw->src[ls]),
		.raddr = pe->addr[ld] + (uint64_t)slot * xb,
		.rkey = pe->rkey[ld],
		.len = (uint32_t)xb};
	if (!epd_rdma_write(rd, &c))
		return -1;
	if (!sb)
		return 0;
	c.laddr = (uintptr_t)(epd_region(g, ls, EPP_BUF_X_SCALES) + t * sb);
	c.raddr = pe->addr[ld] + g->layout.off[EPP_BUF_RECV_SCALES] -
		  g->layout.off[EPP_BUF_RECV_X] + (uint64_t)slot * sb;
	c.len = (uint32_t)sb;
	return epd_rdma_write(rd, &c) ? 0 : -1;
}

/* After the rows: per node written to, a zero-byte write with immediate
 * (its window id, the op) that arrives after them. */
static int write_imm(struct epd_xop *x, struct epd_rdma *rd, uint32_t n)
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
	return epd_rdma_write(rd, &c) ? 0 : -1;
}

/* On the job's thread: a dispatch's rows from local sources to other
 * nodes' destinations, written where the node's windows are known (then
 * an immediate to each node written to: x->wimm), else packed for frames.
 * -1 if the proxy refused (the daemon is stopping). */
static int rows_out(struct epd_xop *x, const struct ek_rank_io *io,
		    const struct ek_route *r)
{
	struct epd_group *g = x->g;
	const uint32_t W = x->W, rpn = g->shape.ranks_per_node;
	const size_t xb = (size_t)g->shape.hidden * g->layout.elt;
	const size_t rb = row_bytes(g, x->type);
	struct epd_rdma *rd = epd_cluster_rdma(g->srv);
	for (uint32_t s = g->node_index * rpn; s < (g->node_index + 1) * rpn;
	     s++)
		for (uint32_t t = 0; t < x->tokens[s]; t++)
			for (uint32_t d = 0; d < W; d++) {
				int32_t slot = r->slot[s][(size_t)t * W + d];
				const uint32_t n = d / rpn;
				if (slot < 0 || is_local(g, d))
					continue;
				x->bytes += 2 * rb;
				if (!x->wrc[n]) {
					out_record(&x->out[n], d, (uint32_t)slot,
						   (uint8_t *)io[s].x + t * xb,
						   xb,
						   io[s].x_scales +
							   (size_t)t *
								   g->layout.nscales,
						   (size_t)g->layout.nscales * 4);
					continue;
				}
				if (write_row(x, rd, s, t, d, (uint32_t)slot))
					return -1;
				x->wimm[n] = 1;
			}
	for (uint32_t n = 0; n < g->nnodes; n++)
		if (x->wimm[n] && write_imm(x, rd, n))
			return -1;
	return 0;
}

/* On a work thread. */
static void xjob_run(uv_work_t *req)
{
	struct epd_xop *x = req->data;
	struct epd_group *g = x->g;
	struct ek_shape sh = shape_of(g);
	const uint32_t W = x->W, rpn = g->shape.ranks_per_node;
	struct ek_rank_io *io = make_io(x);
	if (!io) {
		x->rc = EP_ENOMEM;
		snprintf(x->err, sizeof(x->err), "out of memory");
		return;
	}
	const size_t rb = row_bytes(g, x->type);
	if (x->type == EPP_COMBINE && x->stage2) {
		/* every remote row is staged: accumulate as on one node */
		for (uint32_t l = 0; l < rpn; l++) {
			uint32_t h = g->node_index * rpn + l;
			ek_combine_tokens(&sh, x->route, io, h, 0,
					  x->route->num_tokens[h]);
			x->bytes += (uint64_t)x->route->num_tokens[h] * rb;
		}
		free(io);
		return;
	}
	if (x->type == EPP_DISPATCH && !x->cached) {
		for (uint32_t s = 0; s < W; s++) {
			char err[256];
			int rc = ek_validate_topk(&sh, io[s].topk_idx,
						  x->tokens[s], err,
						  sizeof(err));
			if (rc) {
				x->rc = rc;
				snprintf(x->err, sizeof(x->err), "rank %u: %s",
					 s, err);
				free(io);
				return;
			}
		}
		x->route = ek_route_new(W, x->tokens);
		if (!x->route) {
			x->rc = EP_ENOMEM;
			snprintf(x->err, sizeof(x->err), "out of memory");
			free(io);
			return;
		}
		x->own_route = true;
		for (uint32_t s = 0; s < W; s++)
			ek_route_source(&sh, x->route, s, io[s].topk_idx);
		ek_route_finish(x->route);
	}
	const struct ek_route *r = x->route;
	if (x->type == EPP_DISPATCH) {
		for (uint32_t s = 0; s < W; s++)
			ek_dispatch_tokens(&sh, r, io, s, 0, x->tokens[s],
					   x->cached);
		if (!x->cached)
			for (uint32_t l = 0; l < rpn; l++)
				ek_recv_per_expert(&sh, r, io,
						   g->node_index * rpn + l);
		if (rows_out(x, io, r)) {
			x->rc = EP_ESHUTDOWN;
			snprintf(x->err, sizeof(x->err),
				 "the RDMA proxy stopped");
		}
		/* rows from other nodes' sources for this node's ranks */
		for (uint32_t s = 0; s < W; s++)
			for (uint32_t l = 0; !is_local(g, s) && l < rpn; l++) {
				uint64_t k = r->count[(size_t)s * W +
						      g->node_index * rpn + l];
				x->rows_expected += k;
				x->rows_from[s / rpn] += k;
			}
	} else {
		/* rows of this node's destinations whose home is elsewhere,
		 * and the rows this node's homes expect from elsewhere */
		for (uint32_t s = 0; s < W; s++) {
			for (uint32_t t = 0; t < r->num_tokens[s]; t++)
				for (uint32_t d = 0; d < W; d++) {
					int32_t slot = r->slot[s][(size_t)t * W +
								  d];
					if (slot < 0 ||
					    is_local(g, s) == is_local(g, d))
						continue;
					if (is_local(g, s)) {
						x->rows_expected++;
						continue;
					}
					out_record(&x->out[s / rpn], d,
						   (uint32_t)slot,
						   io[d].combine_y +
							   (size_t)slot *
								   g->shape.hidden,
						   rb, NULL, 0);
					x->bytes += rb;
				}
		}
	}
	free(io);
}

static void xop_submit(struct epd_xop *x);

/* Send the packed rows, chunked into frames. */
static void send_rows(struct epd_xop *x)
{
	struct epd_group *g = x->g;
	const size_t rec = 8 + row_bytes(g, x->type);
	for (uint32_t n = 0; n < g->nnodes; n++) {
		struct outbuf *o = &x->out[n];
		if (o->len > g->xout_hint)
			g->xout_hint = o->len;
		uint32_t per = (uint32_t)(FRAME_MAX / rec);
		if (per == 0)
			per = 1;
		/* the frames send the pack in place; it goes back to the
		 * pool when the last of them is written */
		struct epd_sref *ref = o->count ? malloc(sizeof(*ref)) : NULL;
		if (ref) {
			*ref = (struct epd_sref){.srv = g->srv, .p = o->p,
						 .cap = o->cap, .refs = 1};
			o->p = NULL;
			o->cap = 0;
		}
		for (uint32_t i = 0; i < o->count; i += per) {
			uint32_t k = o->count - i < per ? o->count - i : per;
			uint8_t head[128];
			struct epp_wr w;
			epp_wr_init(&w, head, sizeof(head));
			epp_peer_put_op(&w, g->key, x->id);
			epp_peer_put_xrows(&w, x->type, x->handle, k);
			/* without a ref (out of memory) the frame copies */
			epd_cluster_send(g, n, EPP_PEER_XROWS, head, w.off,
					 (ref ? ref->p : o->p) + i * rec,
					 k * rec, ref);
		}
		if (ref)
			epd_sref_put(ref);
	}
}

static void xop_check(struct epd_group *g)
{
	struct epd_xop *x = xop_cur(g);
	if (!x || !x->job_done)
		return;
	/* rows by frames, and every row of the nodes whose writes are
	 * placed */
	uint64_t got = x->rows_got;
	for (uint32_t n = 0; n < g->nnodes; n++)
		if (x->wdone[n])
			got += x->rows_from[n];
	if (got > x->rows_expected) {
		/* rows that came while the job counted what to expect */
		epd_group_fail(g, EP_EPROTO,
			       "op %llu received %llu rows from other nodes, "
			       "%llu expected",
			       (unsigned long long)x->id,
			       (unsigned long long)got,
			       (unsigned long long)x->rows_expected);
		return;
	}
	if (got < x->rows_expected)
		return;
	/* our writes still read the local ranks' inputs */
	for (uint32_t n = 0; n < g->nnodes; n++)
		if (x->wimm[n] && !x->wsent[n])
			return;
	if (x->type == EPP_COMBINE && !x->stage2) {
		x->stage2 = true;
		x->job_done = false;
		xop_submit(x);
		return;
	}
	struct ek_route *r = x->route;
	xop_retire(g, x);
	epd_ops_finish(g, x->type, x->cached, x->handle, &r, x->rc, x->err,
		       x->bytes);
	if (x->own_route && !r)
		x->own_route = false;
	xop_free(x);
}

static void xjob_done(uv_work_t *req, int status)
{
	struct epd_xop *x = req->data;
	struct epd_group *g = x->g;
	x->job_running = false;
	g->busy = false;
	if (g->free_pending) {
		g->xop[x->id % g->xcap] = NULL;
		xop_free(x);
		epd_group_free(g);
		return;
	}
	if (g->state != EPD_G_READY) {
		epd_xop_drop(g);
		return;
	}
	if (status < 0 && !x->rc) {
		x->rc = EP_EBACKEND;
		snprintf(x->err, sizeof(x->err), "work cancelled");
	}
	if (x->rc) {
		/* every node reaches the same verdict: nothing was sent */
		xop_retire(g, x);
		epd_ops_finish(g, x->type, x->cached, x->handle, NULL, x->rc,
			       x->err, 0);
		xop_free(x);
		xop_check(g); /* the next op may be complete already */
		return;
	}
	if (!x->stage2)
		send_rows(x);
	x->job_done = true;
	xop_check(g);
}

static void xop_submit(struct epd_xop *x)
{
	struct epd_group *g = x->g;
	/* the nodes this dispatch's rows are written to (held until the op
	 * is freed: the proxy may take the writes after the job is over) */
	for (uint32_t n = 0; g->xw && x->type == EPP_DISPATCH && !x->stage2 &&
			     n < g->nnodes;
	     n++) {
		struct epd_rconn *rc = epd_cluster_rconn(g->srv, n);
		if (n == g->node_index || x->wrc[n] || !rc ||
		    !g->xw->peer[n].have)
			continue;
		epd_rdma_hold(rc);
		x->wrc[n] = rc;
	}
	/* the packs for other nodes, from the pool, as large as last time
	 * (the job grows them if needed) */
	for (uint32_t n = 0; !x->stage2 && n < g->nnodes; n++) {
		struct outbuf *o = &x->out[n];
		if (n == g->node_index || o->p)
			continue;
		o->p = xbuf_get(g->srv,
				g->xout_hint > 65536 ? g->xout_hint : 65536,
				&o->cap);
		if (!o->p)
			o->cap = 0;
		o->len = 0;
		o->count = 0;
	}
	x->req.data = x;
	x->job_running = true;
	g->busy = true;
	if (uv_queue_work(g->srv->loop, &x->req, xjob_run, xjob_done)) {
		x->job_running = false;
		g->busy = false;
		epd_group_fail(g, EP_ENOMEM, "cannot start the %s job",
			       epp_type_name(x->type));
	}
}

/* Every local rank of g entered a dispatch or combine. */
void epd_xop_start(struct epd_group *g)
{
	/* the group's timer keeps running: the other nodes must answer */
	struct epd_xop *x = xop_get(g, g->xop_next, g->coll_type);
	if (!x || x->type != g->coll_type) {
		epd_group_fail(g, EP_EMISMATCH,
			       "%s %llu: the other nodes run another "
			       "operation",
			       epp_type_name(g->coll_type),
			       (unsigned long long)g->xop_next);
		return;
	}
	const uint32_t rpn = g->shape.ranks_per_node;
	x->started = true;
	x->cached = g->coll_cached;
	x->handle = g->coll_seq;
	if (x->type == EPP_COMBINE || x->cached) {
		struct ek_route *r = epd_route_find(g, x->handle);
		x->route = r; /* the ring's: not owned */
		memcpy(x->tokens, r->num_tokens, x->W * sizeof(uint32_t));
	}
	for (uint32_t l = 0; l < rpn; l++) {
		uint32_t s = g->node_index * rpn + l;
		struct epd_member *m = g->local[l];
		if (x->type == EPP_DISPATCH && !x->cached)
			x->tokens[s] = m->op_tokens;
		x->flags[s] = m->op_flags;
	}
	if (x->type == EPP_COMBINE) {
		/* rows that came before the routing was known, now */
		struct xdefer *d = x->deferred;
		x->deferred = NULL;
		uint64_t id = x->id;
		while (d) {
			struct xdefer *n = d->next;
			if (g->state == EPD_G_READY && xop_cur(g) == x)
				epd_xop_frame(g->srv, EPP_PEER_XROWS, d->from,
					      d->data, d->len);
			free(d);
			d = n;
		}
		if (g->state != EPD_G_READY || xop_cur(g) != x ||
		    x->id != id)
			return; /* failed on a bad row, or done */
		/* rows that arrive early are staged: no need to wait */
		xop_submit(x);
		return;
	}
	/* A dispatch writes into the other nodes' receive buffers: it may
	 * start only once every rank arrived (done reading the last results).
	 * So every node sends its ranks' routing inputs (for a cached
	 * dispatch just the arrival: the routing is the handle's). */
	const uint32_t K = g->shape.topk;
	if ((size_t)g->shape.max_tokens * K * 12 + 256 > EPP_MAX_PAYLOAD) {
		epd_group_fail(g, EP_ETOOBIG,
			       "routing of %u tokens x top-%u does not fit one "
			       "frame between nodes",
			       g->shape.max_tokens, K);
		return;
	}
	for (uint32_t l = 0; l < rpn; l++) {
		uint32_t s = g->node_index * rpn + l;
		uint8_t head[128];
		struct epp_wr w;
		epp_wr_init(&w, head, sizeof(head));
		epp_peer_put_op(&w, g->key, x->id);
		epp_put_u32(&w, s);
		epp_put_u32(&w, x->tokens[s]);
		epp_put_u32(&w, x->flags[s]);
		size_t nt = x->cached ? 0 : (size_t)x->tokens[s] * K;
		const void *tk = epd_region(g, l, EPP_BUF_TOPK_IDX);
		const void *wt = epd_region(g, l, EPP_BUF_TOPK_WEIGHTS);
		bool wts = !x->cached && (x->flags[s] & EPP_DISPATCH_WEIGHTS);
		/* topk then weights: contiguous in one frame. The rank can
		 * write its buffer while we read it: this one copy is what
		 * the other nodes get and what this node validates and
		 * routes from (x->topk[s], as for a remote source), so every
		 * node works on the same bytes and none reads them twice. */
		uint8_t *body = malloc(nt * 12 + 8);
		if (!body) {
			epd_group_fail(g, EP_ENOMEM, "out of memory");
			return;
		}
		memcpy(body, tk, nt * 8);
		if (wts)
			memcpy(body + nt * 8, wt, nt * 4);
		for (uint32_t n = 0; n < g->nnodes; n++)
			if (n != g->node_index)
				epd_cluster_send(g, n, EPP_PEER_XMETA, head,
						 w.off, body,
						 nt * (wts ? 12 : 8), NULL);
		free(x->topk[s]);
		x->topk[s] = (int64_t *)body; /* weights stay in the region:
						 data, not indices */
	}
	if (x->meta_have == x->meta_need)
		xop_submit(x);
}

/* Frames for a group that is not ready on this node yet (its ranks are
 * still joining here): kept, within a bound, and replayed once it is. */
#define STASH_MAX (256ull << 20)

struct stashed {
	struct list_node node;
	char name[EPP_GKEY_MAX + 1];
	uint16_t type;
	uint32_t from, len;
	uint8_t data[];
};

static void stash_frame(struct epd_server *srv, const char *name,
			uint16_t type, uint32_t from, const uint8_t *p,
			uint32_t len)
{
	struct stashed *e = malloc(sizeof(*e) + len);
	if (!e || srv->xstash_bytes + len > STASH_MAX) {
		free(e);
		epd_warn("cross-node %s for group %s dropped: %llu bytes are "
			 "already kept for groups not ready here",
			 epp_type_name(type), name,
			 (unsigned long long)srv->xstash_bytes);
		return;
	}
	snprintf(e->name, sizeof(e->name), "%s", name);
	e->type = type;
	e->from = from;
	e->len = len;
	memcpy(e->data, p, len);
	srv->xstash_bytes += len;
	list_add_tail(&srv->xstash, &e->node);
}

void epd_xop_stash_free(struct epd_server *srv)
{
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->xstash)
	{
		list_del(it);
		free(LIST_ENTRY(it, struct stashed, node));
	}
	srv->xstash_bytes = 0;
}

void epd_xop_replay(struct epd_group *g)
{
	struct list_node *it, *tmp;
	struct epd_server *srv = g->srv;
	LIST_FOREACH(it, tmp, &srv->xstash)
	{
		struct stashed *e = LIST_ENTRY(it, struct stashed, node);
		if (strcmp(e->name, g->key))
			continue;
		list_del(&e->node);
		srv->xstash_bytes -= e->len;
		if (g->state == EPD_G_READY)
			epd_xop_frame(g->srv, e->type, e->from, e->data,
				      e->len);
		free(e);
	}
}

static void put_shape(struct epp_wr *w, const struct epd_group *g)
{
	const struct epp_join *j = &g->shape;
	uint32_t v[] = {j->world_size, j->ranks_per_node, j->num_experts,
			j->hidden, j->max_tokens, j->topk, j->dtype,
			g->timeout_ms};
	for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++)
		epp_put_u32(w, v[i]);
}

/* The group became ready here: its shape to the group's other nodes, which
 * compare it with theirs. */
void epd_xop_announce(struct epd_group *g)
{
	uint8_t buf[192];
	struct epp_wr w;
	epp_wr_init(&w, buf, sizeof(buf));
	epp_peer_put_op(&w, g->key, 0);
	put_shape(&w, g);
	for (uint32_t n = 0; n < g->nnodes; n++)
		if (n != g->node_index)
			epd_cluster_send(g, n, EPP_PEER_GSHAPE, buf, w.off,
					 NULL, 0, NULL);
	xwin_setup(g);
}

static void check_shape(struct epd_group *g, uint32_t from,
			const struct epp_peer_op *op)
{
	uint8_t mine[64];
	struct epp_wr w;
	epp_wr_init(&w, mine, sizeof(mine));
	put_shape(&w, g);
	static const char *const names[EPP_PEER_SHAPE_N] = {
		"world_size", "ranks_per_node", "num_experts", "hidden",
		"max_tokens", "topk", "dtype", "timeout_ms"};
	uint32_t theirs[EPP_PEER_SHAPE_N];
	if (epp_peer_shape_decode(op, theirs)) {
		epd_group_fail(g, EP_EPROTO, "node %u sent a malformed shape",
			       from);
		return;
	}
	uint32_t ours[EPP_PEER_SHAPE_N];
	struct epp_peer_op mo = {.body = mine, .body_len = w.off};
	epp_peer_shape_decode(&mo, ours);
	for (int i = 0; i < EPP_PEER_SHAPE_N; i++) {
		uint32_t a = ours[i], b = theirs[i];
		if (a != b) {
			epd_group_fail(g, EP_EMISMATCH,
				       "node %s joined group %s with %s %u; "
				       "this node has %u",
				       epd_cluster_node_name(g->srv, from),
				       g->shape.name, names[i], b, a);
			return;
		}
	}
}

/* A frame of a cross-node op from node `from`. */
void epd_xop_frame(struct epd_server *srv, uint16_t type, uint32_t from,
		   const uint8_t *p, uint32_t len)
{
	struct epp_peer_op op;
	int bad = epp_peer_op_decode(p, len, &op);
	const char *name = bad ? "?" : op.group;
	uint64_t id = bad ? 0 : op.op;
	struct epd_group *g = bad ? NULL : epd_group_find(srv, name);
	if (!bad && (!g || g->state == EPD_G_FORMING)) {
		stash_frame(srv, name, type, from, p, len);
		return;
	}
	if (bad || g->state != EPD_G_READY || from >= g->nnodes) {
		epd_warn("cross-node %s for group %s (op %llu) from node %u "
			 "dropped: the group failed or the frame is malformed",
			 epp_type_name(type), name, (unsigned long long)id,
			 from);
		return;
	}
	const uint32_t rpn = g->shape.ranks_per_node, K = g->shape.topk;
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
		check_shape(g, from, &op);
		return;
	}
	if (type == EPP_PEER_XWIN) {
		xwin_frame(g, from, &op);
		return;
	}
	if (type == EPP_PEER_XMETA) {
		struct epp_peer_xmeta m;
		int mbad = epp_peer_xmeta_decode(&op, &m);
		uint32_t s = m.rank, T = m.tokens, fl = m.flags;
		struct epd_xop *x = mbad ? NULL : xop_get(g, id, EPP_DISPATCH);
		bool cached = fl & EPP_DISPATCH_CACHED;
		size_t nt = cached ? 0 : (size_t)T * K;
		bool wts = !cached && (fl & EPP_DISPATCH_WEIGHTS);
		if (!x || s >= g->shape.world_size || s / rpn != from ||
		    T > g->shape.max_tokens || x->have[s] ||
		    m.data_len != nt * (wts ? 12 : 8)) {
			epd_group_fail(g, EP_EPROTO,
				       "node %u sent a malformed or unexpected "
				       "routing for op %llu",
				       from, (unsigned long long)id);
			return;
		}
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
		return;
	}
	/* XROWS: the record size depends on the op's type, the first field */
	struct epp_peer_xrows xr;
	uint16_t otype = 0;
	epp_peer_xrows_type(&op, &otype); /* 0 on error: decode fails */
	const size_t rb = row_bytes(g, otype), rec = 8 + rb;
	int rbad = epp_peer_xrows_decode(&op, rec, &xr);
	uint64_t handle = xr.handle;
	uint32_t k = xr.count;
	struct epd_xop *x = rbad ? NULL : xop_get(g, id, otype);
	if (!x || x->type != otype ||
	    (otype == EPP_DISPATCH && !x->started)) {
		epd_group_fail(g, EP_EPROTO,
			       "node %u sent unexpected rows for op %llu", from,
			       (unsigned long long)id);
		return;
	}
	/* Every expected row has come (stage 2 of a combine runs on them),
	 * or, once the job counted them, more rows than expected. */
	if (x->stage2 ||
	    (x->job_done && x->rows_got + k > x->rows_expected)) {
		epd_group_fail(g, EP_EPROTO,
			       "node %u sent more rows than op %llu expects",
			       from, (unsigned long long)id);
		return;
	}
	const uint8_t *q = xr.recs;
	/* Only a combine's rows need the routing. A fresh dispatch's job may
	 * be building x->route on a work thread right now: not read here. */
	struct ek_route *route = NULL;
	if (otype == EPP_COMBINE)
		route = x->route ? x->route : epd_route_find(g, handle);
	if (otype == EPP_COMBINE && !route && !x->started) {
		/* A node ahead of this one combines along a dispatch this
		 * node has not finished yet (its job still runs): the rows
		 * wait in the op until it starts here, with the routing. */
		struct xdefer *df = malloc(sizeof(*df) + len);
		if (!df) {
			epd_group_fail(g, EP_ENOMEM, "out of memory");
			return;
		}
		df->next = NULL;
		df->from = from;
		df->len = len;
		memcpy(df->data, p, len);
		struct xdefer **tail = &x->deferred;
		while (*tail)
			tail = &(*tail)->next;
		*tail = df;
		return;
	}
	for (uint32_t i = 0; i < k; i++, q += rec) {
		uint32_t d, slot;
		memcpy(&d, q, 4);
		memcpy(&slot, q + 4, 4);
		if (otype == EPP_DISPATCH) {
			if (!is_local(g, d) || slot >= g->layout.max_recv)
				goto bad;
			uint32_t l = lidx(g, d);
			size_t xb = (size_t)g->shape.hidden * g->layout.elt;
			memcpy(epd_region(g, l, EPP_BUF_RECV_X) +
				       (size_t)slot * xb,
			       q + 8, xb);
			if (g->layout.nscales)
				memcpy(epd_region(g, l, EPP_BUF_RECV_SCALES) +
					       (size_t)slot * g->layout.nscales *
						       4,
				       q + 8 + xb,
				       (size_t)g->layout.nscales * 4);
		} else {
			/* staged at its slot on destination d (elsewhere) */
			if (is_local(g, d) || !route ||
			    slot >= route->num_recv[d])
				goto bad;
			if (!x->staging[d]) {
				x->staging[d] = (uint16_t *)xbuf_get(
					g->srv,
					(size_t)route->num_recv[d] * rb + 2,
					&x->staging_cap[d]);
				if (!x->staging[d]) {
					epd_group_fail(g, EP_ENOMEM,
						       "out of memory");
					return;
				}
			}
			memcpy((uint8_t *)x->staging[d] + (size_t)slot * rb,
			       q + 8, rb);
		}
		x->rows_got++;
	}
	xop_check(g);
	return;
bad:
	epd_group_fail(g, EP_EPROTO, "node %u sent a row out of range", from);
}
