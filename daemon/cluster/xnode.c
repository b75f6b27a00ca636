/* SPDX-License-Identifier: MIT */
/*
 * The cross-node engine (xnode_int.h): an op's life. Started once every
 * local rank entered, routed and packed by a job on a data-path thread,
 * completed when the job is done and every expected row arrived.
 */
#include "xnode_int.h"

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
		if (x->wstaging && x->wstaging_cap)
			xbuf_put(srv, (uint8_t *)x->wstaging[s],
				 x->wstaging_cap[s]);
	}
	if (x->out)
		for (uint32_t n = 0; n < x->g->nnodes; n++)
			xbuf_put(srv, x->out[n].p, x->out[n].cap);
	for (uint32_t n = 0; x->wrc && n < x->g->nnodes; n++)
		if (x->wrc[n])
			x->wrc[n]->t->ops->release(x->wrc[n]);
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
	free(x->wstaging);
	free(x->wstaging_cap);
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

void epd_xop_missing(struct epd_group *g, char *out, size_t cap)
{
	struct epd_xop *x = xop_cur(g);
	size_t off = 0;
	out[0] = 0;
	for (uint32_t s = 0; s < g->shape.world_size; s++) {
		if (xn_is_local(g, s))
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
struct epd_xop *xop_get(struct epd_group *g, uint64_t id,
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
	x->wstaging = calloc(W, sizeof(*x->wstaging));
	x->wstaging_cap = calloc(W, sizeof(*x->wstaging_cap));
	x->have = calloc(W, 1);
	x->out = calloc(g->nnodes, sizeof(*x->out));
	x->wrc = calloc(g->nnodes, sizeof(*x->wrc));
	x->wimm = calloc(g->nnodes, 1);
	x->wsent = calloc(g->nnodes, 1);
	x->wdone = calloc(g->nnodes, 1);
	x->rows_from = calloc(g->nnodes, sizeof(*x->rows_from));
	if (!x->tokens || !x->flags || !x->topk || !x->weights ||
	    !x->staging || !x->staging_cap || !x->wstaging ||
	    !x->wstaging_cap || !x->have || !x->out ||
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

bool xn_is_local(const struct epd_group *g, uint32_t rank)
{
	return rank / g->shape.ranks_per_node == g->node_index;
}

uint32_t xn_lidx(const struct epd_group *g, uint32_t rank)
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

void xn_out_record(struct outbuf *o, uint32_t d, uint32_t slot,
		       const void *a, size_t na, const void *b, size_t nb)
{
	uint32_t hdr[2] = {d, slot};
	out_put(o, hdr, 8);
	out_put(o, a, na);
	if (nb)
		out_put(o, b, nb);
	o->count++;
}

size_t xn_row_bytes(const struct epd_group *g, uint16_t type)
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
		if (!xn_is_local(g, s)) {
			o->topk_idx = x->topk[s];
			o->topk_weights = x->weights[s];
			/* staged rows are complete only in stage 2; before,
			 * the loop thread may still be filling staging[] */
			o->combine_y = x->stage2 ? x->staging[s] : NULL;
			o->combine_w = x->stage2 && x->cw ? x->wstaging[s]
							  : NULL;
			continue;
		}
		uint32_t l = xn_lidx(g, s);
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
		o->combine_bias2 = x->flags[s] & EPP_COMBINE_BIAS2 &&
						   x->type == EPP_COMBINE
					   ? (uint16_t *)epd_region(
						     g, l, EPP_BUF_COMBINE_BIAS2)
					   : NULL;
		o->combine_topk = x->flags[s] & EPP_COMBINE_TOPK_ORDER &&
						  x->type == EPP_COMBINE
					  ? (int64_t *)epd_region(
						    g, l, EPP_BUF_TOPK_IDX)
					  : NULL;
		o->combined = (uint16_t *)epd_region(g, l, EPP_BUF_COMBINED);
		if (x->type == EPP_COMBINE && x->cw) {
			o->combine_w =
				(float *)epd_region(g, l, EPP_BUF_COMBINE_W);
			o->combined_w =
				(float *)epd_region(g, l, EPP_BUF_COMBINED_W);
		}
		o->rank_prefix =
			(int32_t *)epd_region(g, l, EPP_BUF_RANK_PREFIX);
		o->num_tokens = x->tokens[s];
	}
	return io;
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
	const size_t rb = xn_row_bytes(g, x->type);
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
		/* every node routes alike: all refuse it, nothing is sent */
		if (epd_recv_over(g, x->route, x->err, sizeof(x->err),
				  &x->recv_pos)) {
			x->rc = EP_ETOOBIG;
			free(io);
			return;
		}
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
		for (uint32_t l = 0; l < rpn; l++)
			ek_rank_prefix(r, io, g->node_index * rpn + l);
		if (xn_rows_out(x, io, r)) {
			x->rc = EP_ESHUTDOWN;
			snprintf(x->err, sizeof(x->err),
				 "the RDMA proxy stopped");
		}
		/* rows from other nodes' sources for this node's ranks */
		for (uint32_t s = 0; s < W; s++)
			for (uint32_t l = 0; !xn_is_local(g, s) && l < rpn; l++) {
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
					    xn_is_local(g, s) == xn_is_local(g, d))
						continue;
					if (xn_is_local(g, s)) {
						x->rows_expected++;
						continue;
					}
					const size_t K = g->shape.topk;
					xn_out_record(&x->out[s / rpn], d,
						   (uint32_t)slot,
						   io[d].combine_y +
							   (size_t)slot *
								   g->shape.hidden,
						   rb,
						   x->cw ? io[d].combine_w +
								   (size_t)slot * K
							 : NULL,
						   x->cw ? K * 4 : 0);
					x->bytes += rb;
				}
		}
	}
	free(io);
}

/* A dispatch with a rank that asked for too many tokens fails with
 * EP_ETOOBIG, also over a bad expert index found meanwhile, as on one node
 * (the flags are every node's alike, and so is the result; no handle
 * anywhere). */
static void toobig_wins(struct epd_group *g, struct epd_xop *x)
{
	if (x->type == EPP_DISPATCH && (!x->rc || x->rc == EP_EEXPERT) &&
	    epd_ops_toobig(g, x->flags, x->W, x->err, sizeof(x->err)))
		x->rc = EP_ETOOBIG;
	g->toobig_tokens = 0;
}

/* Send the packed rows, chunked into frames. */
static void send_rows(struct epd_xop *x)
{
	struct epd_group *g = x->g;
	const size_t rec = 8 + xn_row_bytes(g, x->type) +
			   (x->cw ? (size_t)g->shape.topk * 4 : 0);
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
			epp_peer_put_xrows(&w,
					   x->type | (x->cw ? EPP_XROWS_WEIGHTS
							    : 0),
					   x->handle, k);
			/* without a ref (out of memory) the frame copies */
			epd_cluster_send(g, n, EPP_PEER_XROWS, head, w.off,
					 (ref ? ref->p : o->p) + i * rec,
					 k * rec, ref);
		}
		if (ref)
			epd_sref_put(ref);
	}
}

void xop_check(struct epd_group *g)
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
		if (x->cw ? x->rows_nw != 0 : x->rows_w != 0) {
			epd_group_fail(g, EP_EMISMATCH,
				       "combine %llu: this node's ranks combine "
				       "%s top-k weights, another node's %s",
				       (unsigned long long)x->id,
				       x->cw ? "with" : "without",
				       x->cw ? "without" : "with");
			return;
		}
		x->stage2 = true;
		x->job_done = false;
		xop_submit(x);
		return;
	}
	toobig_wins(g, x);
	struct ek_route *r = x->route;
	xop_retire(g, x);
	epd_ops_finish(g, x->type, x->cached, x->handle, &r, x->rc, x->err,
		       x->bytes);
	if (x->own_route && !r)
		x->own_route = false;
	xop_free(x);
}

static void xop_drop_all(void *g)
{
	epd_xop_drop(g);
}

static void xjob_done(uv_work_t *req, int status)
{
	struct epd_xop *x = req->data;
	struct epd_group *g = x->g;
	x->job_running = false; /* then epd_xop_drop frees it too */
	if (!epd_group_job_ended(g, xop_drop_all, g))
		return;
	if (status < 0 && !x->rc) {
		x->rc = EP_EBACKEND;
		snprintf(x->err, sizeof(x->err), "work cancelled");
	}
	if (x->rc == EP_EEXPERT)
		toobig_wins(g, x);
	if (x->rc == EP_ETOOBIG && x->recv_pos)
		g->toobig_pos = x->recv_pos; /* a staged op's word */
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

void xop_submit(struct epd_xop *x)
{
	struct epd_group *g = x->g;
	/* the nodes this dispatch's rows are written to (held until the op
	 * is freed: the proxy may take the writes after the job is over) */
	for (uint32_t n = 0; g->xw && x->type == EPP_DISPATCH && !x->stage2 &&
			     n < g->nnodes;
	     n++) {
		struct epd_tconn *tc = epd_cluster_wconn(g, n);
		if (n == g->node_index || x->wrc[n] || !tc ||
		    !g->xw->peer[n].have)
			continue;
		tc->t->ops->hold(tc);
		x->wrc[n] = tc;
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

/* "node NAME", or "another node" where from is UINT32_MAX. */
static const char *node_name(const struct epd_group *g, uint32_t from,
			     char who[80])
{
	if (from == UINT32_MAX)
		return "another node";
	snprintf(who, 80, "node %s", epd_cluster_node_name(g, from));
	return who;
}

void epd_xop_handle_mismatch(struct epd_group *g, const struct epd_xop *x,
			     uint32_t from, uint64_t theirs, uint64_t mine)
{
	char who[80];
	g->xop_disagree = x->id;
	epd_group_fail(g, EP_EMISMATCH,
		       "%s %llu: %s's ranks named handle %llu, this node's "
		       "%llu (every node's ranks must name the same handle)",
		       epp_type_name(x->type), (unsigned long long)x->id,
		       node_name(g, from, who), (unsigned long long)theirs,
		       (unsigned long long)mine);
}

void epd_xop_kind_mismatch(struct epd_group *g, const struct epd_xop *x,
			   uint32_t from, bool theirs_cached)
{
	char who[80];
	g->xop_disagree = x->id;
	/* before this node's ranks started it, the other side is a node
	 * whose routing came earlier */
	epd_group_fail(g, EP_EMISMATCH,
		       "dispatch %llu: %s's ranks ran a %s dispatch, %s a %s "
		       "one (every node's ranks must run the same)",
		       (unsigned long long)x->id, node_name(g, from, who),
		       theirs_cached ? "cached" : "fresh",
		       x->started ? "this node's" : "another node's",
		       theirs_cached ? "fresh" : "cached");
}

void epd_xop_type_mismatch(struct epd_group *g, const struct epd_xop *x,
			   uint32_t from, uint16_t theirs)
{
	char who[80];
	g->xop_disagree = x->id;
	if (from == UINT32_MAX) /* x is another node's, theirs this one's */
		epd_group_fail(g, EP_EMISMATCH,
			       "op %llu: this node's ranks ran a %s, another "
			       "node's a %s (every node's ranks must run the "
			       "same operations in the same order)",
			       (unsigned long long)x->id, epp_type_name(theirs),
			       epp_type_name(x->type));
	else
		epd_group_fail(g, EP_EMISMATCH,
			       "op %llu: %s's ranks ran a %s, %s a %s (every "
			       "node's ranks must run the same operations in "
			       "the same order)",
			       (unsigned long long)x->id, node_name(g, from, who),
			       epp_type_name(theirs),
			       x->started ? "this node's" : "another node's",
			       epp_type_name(x->type));
}

void epd_xop_past(struct epd_group *g, uint64_t id, uint32_t from,
		  uint16_t theirs)
{
	char who[80];
	g->xop_disagree = id; /* the others' op id cannot finish either */
	epd_group_fail(g, EP_EMISMATCH,
		       "op %llu: %s's ranks ran a %s, and this node's had "
		       "finished that op without it (every node's ranks must "
		       "run the same operations in the same order)",
		       (unsigned long long)id, node_name(g, from, who),
		       epp_type_name(theirs));
}

/* Every local rank of g entered a dispatch or combine. */
void epd_xop_start(struct epd_group *g)
{
	/* the group's timer keeps running: the other nodes must answer */
	struct epd_xop *x = xop_get(g, g->xop_next, g->coll_type);
	if (!x) {
		epd_group_fail(g, EP_ENOMEM, "out of memory");
		return;
	}
	if (x->type != g->coll_type) {
		epd_xop_type_mismatch(g, x, UINT32_MAX, g->coll_type);
		return;
	}
	const uint32_t rpn = g->shape.ranks_per_node;
	x->started = true;
	x->cached = g->coll_cached;
	x->cw = x->type == EPP_COMBINE && g->coll_cw;
	x->handle = g->coll_seq;
	if (x->claimed && x->claimed != x->handle) {
		epd_xop_handle_mismatch(g, x, UINT32_MAX, x->claimed,
					x->handle);
		return;
	}
	if (x->meta_kind && (x->meta_kind == 2) != x->cached) {
		epd_xop_kind_mismatch(g, x, UINT32_MAX, x->meta_kind == 2);
		return;
	}
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
		x->deferred_bytes = 0;
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
