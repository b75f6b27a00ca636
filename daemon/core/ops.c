/* SPDX-License-Identifier: MIT */
/*
 * Dispatch and combine on the host backend. The loop thread checks each
 * rank's request, waits until every local rank entered, then hands one job
 * to a libuv work thread, which spreads it over the daemon's data-path pool.
 * The loop never touches the data; replies go out from the after-work
 * callback.
 *
 * Errors: a request that is wrong for one rank (too many tokens, wrong
 * shape, stale handle) fails that rank alone, which has not entered. Ranks
 * that disagree (different handles) fail the group. Bad contents found by
 * the workers (an expert index out of range) fail the op for every rank and
 * change nothing: validation runs before the first write.
 */
#include "core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ek_combine_order's list holds every rank of a group */
_Static_assert(EK_MAX_WORLD >= EPP_MAX_WORLD, "EK_MAX_WORLD");
_Static_assert(EK_MAX_TOPK >= EPP_MAX_TOPK, "EK_MAX_TOPK");

#define TOKEN_CHUNK 64 /* tokens per work item */

struct item {
	uint32_t rank, t0, t1;
};

struct job {
	uv_work_t req;
	struct epd_group *g;
	uint16_t type;
	bool cached;
	uint64_t seq;
	struct ek_shape shape;
	struct ek_rank_io *io; /* [rpn] */
	uint32_t *num_tokens;  /* [rpn] */
	struct ek_route *route;
	bool own_route; /* a fresh dispatch's new routing */
	struct item *items;
	uint32_t nitems;
	int64_t **topk; /* [rpn] private copies of the ranks' topk_idx */
	int *rank_rc; /* [rpn] validation results */
	char (*rank_err)[256];
	int rc;
	char err[EPP_ERRMSG_MAX];
	uint64_t bytes;
	uint64_t recv_pos; /* rows past the receive capacity: its word */
};

/* Is the handle usable with this group? Replies the error itself. */
static bool handle_ok(struct epd_session *c, uint64_t req_id,
		      struct epd_member *m, const struct epp_handle *h)
{
	struct epd_group *g = m->group;
	if (h->group_id != g->id) {
		epd_session_error(c, req_id, EP_ESTALE,
				 "handle belongs to group id %llu, not to "
				 "group %s (id %llu)",
				 (unsigned long long)h->group_id, g->shape.name,
				 (unsigned long long)g->id);
		return false;
	}
	if (h->epoch != g->epoch) {
		epd_session_error(c, req_id, EP_ESTALE,
				 "handle from epoch %u; the group's epoch is %u",
				 h->epoch, g->epoch);
		return false;
	}
	if (!epd_handle_held(g, h->seq, m->local)) {
		epd_session_error(c, req_id, EP_ESTALE,
				 "handle %llu is not held by rank %u of group "
				 "%s: %s",
				 (unsigned long long)h->seq, m->rank,
				 g->shape.name,
				 h->seq && h->seq <= g->next_seq
					 ? "released"
					 : "no such dispatch");
		return false;
	}
	return true;
}

uint8_t *epd_region(struct epd_group *g, uint32_t l, int field)
{
	return g->map + epp_buf_field(&g->layout, l, field);
}

static void job_free(struct job *j)
{
	if (j->own_route)
		ek_route_free(j->route);
	free(j->io);
	free(j->num_tokens);
	free(j->items);
	if (j->topk)
		for (uint32_t l = 0; l < j->shape.world; l++)
			free(j->topk[l]);
	free(j->topk);
	free(j->rank_rc);
	free(j->rank_err);
	free(j);
}

/* Work items: chunks of TOKEN_CHUNK tokens of every local rank. */
static int make_items(struct job *j, uint32_t rpn)
{
	uint32_t n = 0;
	for (uint32_t l = 0; l < rpn; l++)
		n += (j->num_tokens[l] + TOKEN_CHUNK - 1) / TOKEN_CHUNK;
	j->items = calloc(n ? n : 1, sizeof(*j->items));
	if (!j->items)
		return EP_ENOMEM;
	n = 0;
	for (uint32_t l = 0; l < rpn; l++)
		for (uint32_t t = 0; t < j->num_tokens[l]; t += TOKEN_CHUNK) {
			uint32_t e = t + TOKEN_CHUNK;
			j->items[n++] = (struct item){
				l, t, e < j->num_tokens[l] ? e : j->num_tokens[l]};
		}
	j->nitems = n;
	return 0;
}

/* The rank may write topk_idx while we work (DESIGN: rank-writable memory
 * is hostile): it is read once, into memory of ours, and that copy is
 * validated, routed from and turned into recv_topk_idx. */
static void do_validate(void *arg, uint32_t l)
{
	struct job *j = arg;
	size_t n = (size_t)j->num_tokens[l] * j->shape.topk;
	j->topk[l] = malloc(n * sizeof(int64_t) + 8);
	if (!j->topk[l]) {
		j->rank_rc[l] = EP_ENOMEM;
		snprintf(j->rank_err[l], sizeof(j->rank_err[l]),
			 "out of memory");
		return;
	}
	memcpy(j->topk[l], j->io[l].topk_idx, n * sizeof(int64_t));
	j->io[l].topk_idx = j->topk[l];
	j->rank_rc[l] = ek_validate_topk(&j->shape, j->topk[l],
					 j->num_tokens[l], j->rank_err[l],
					 sizeof(j->rank_err[l]));
}

static void do_route(void *arg, uint32_t l)
{
	struct job *j = arg;
	ek_route_source(&j->shape, j->route, l, j->io[l].topk_idx);
}

static void do_dispatch(void *arg, uint32_t i)
{
	struct job *j = arg;
	const struct item *it = &j->items[i];
	ek_dispatch_tokens(&j->shape, j->route, j->io, it->rank, it->t0,
			   it->t1, j->cached);
}

static void do_per_expert(void *arg, uint32_t l)
{
	struct job *j = arg;
	ek_recv_per_expert(&j->shape, j->route, j->io, l);
}

static void do_combine(void *arg, uint32_t i)
{
	struct job *j = arg;
	const struct item *it = &j->items[i];
	ek_combine_tokens(&j->shape, j->route, j->io, it->rank, it->t0,
			  it->t1);
}

/* On a libuv work thread. */
static void job_run(uv_work_t *req)
{
	struct job *j = req->data;
	struct epd_pool *pool = j->g->srv->pool;
	const uint32_t W = j->shape.world;
	const uint64_t row = (uint64_t)j->shape.hidden * j->shape.elt +
			     (uint64_t)j->shape.nscales * 4;
	if (j->type == EPP_DISPATCH && !j->cached) {
		epd_pool_run(pool, W, do_validate, j);
		for (uint32_t l = 0; l < W; l++)
			if (j->rank_rc[l]) {
				j->rc = j->rank_rc[l];
				snprintf(j->err, sizeof(j->err), "rank %u: %s",
					 l, j->rank_err[l]);
				return;
			}
		j->route = ek_route_new(W, j->num_tokens);
		if (!j->route) {
			j->rc = EP_ENOMEM;
			snprintf(j->err, sizeof(j->err), "out of memory");
			return;
		}
		j->own_route = true;
		epd_pool_run(pool, W, do_route, j);
		ek_route_finish(j->route);
		if (epd_recv_over(j->g, j->route, j->err, sizeof(j->err),
				  &j->recv_pos)) {
			j->rc = EP_ETOOBIG;
			return;
		}
	}
	if (make_items(j, W)) {
		j->rc = EP_ENOMEM;
		snprintf(j->err, sizeof(j->err), "out of memory");
		return;
	}
	uint64_t rows = 0;
	for (uint32_t d = 0; d < W; d++)
		rows += j->route->num_recv[d];
	if (j->type == EPP_DISPATCH) {
		epd_pool_run(pool, j->nitems, do_dispatch, j);
		if (!j->cached)
			epd_pool_run(pool, W, do_per_expert, j);
		for (uint32_t l = 0; l < W; l++)
			ek_rank_prefix(j->route, j->io, l);
		/* each token read once, each received row written once */
		uint64_t tokens = 0;
		for (uint32_t l = 0; l < W; l++)
			tokens += j->num_tokens[l];
		j->bytes = (rows + tokens) * row;
	} else {
		epd_pool_run(pool, j->nitems, do_combine, j);
		uint64_t tokens = 0;
		for (uint32_t l = 0; l < W; l++)
			tokens += j->num_tokens[l];
		j->bytes = (rows + tokens) * j->shape.hidden * 2;
	}
}

/* The end of a dispatch or combine on this node: replies to the local
 * ranks, and for a fresh dispatch the routing goes into the handle ring
 * (*route is taken then). Shared by the one-node and cross-node paths. */
void epd_ops_finish(struct epd_group *g, uint16_t type, bool cached,
		    uint64_t seq, struct ek_route **route, int rc,
		    const char *err, uint64_t bytes)
{
	g->coll_type = 0;
	g->coll_arrived = 0;
	/* this op's deadline is over; the next one arms its own */
	if (!g->timer_closing)
		uv_timer_stop(&g->timer);
	uint32_t rpn = g->shape.ranks_per_node;
	if (rc) {
		g->n_errors++;
		for (uint32_t l = 0; l < rpn; l++)
			if (g->local[l] && g->local[l]->pending_req)
				epd_member_reply_err(g->local[l], rc, err);
		return;
	}
	g->bytes_moved += bytes;
	g->op_ns[type == EPP_DISPATCH ? 1 : 2] += epd_now_ns() - g->coll_start_ns;
	struct epp_handle h = {.group_id = g->id, .epoch = g->epoch,
			       .seq = seq};
	if (type == EPP_DISPATCH) {
		g->n_dispatch++;
		struct ek_route *r = *route;
		if (!cached) {
			char why[EPP_ERRMSG_MAX];
			int hrc = epd_handle_add(g, g->next_seq + 1, r, 0, why,
						 sizeof(why));
			if (hrc) {
				/* every node fails alike: a node without the
				 * handle could not follow the others' ops */
				epd_group_fail(g, hrc, "%s", why);
				return;
			}
			h.seq = ++g->next_seq;
			*route = NULL;
		}
		for (uint32_t l = 0; l < rpn; l++) {
			/* routings are indexed by global rank */
			struct epp_dispatch_ok ok = {
				.handle = h,
				.num_recv = r->num_recv[g->node_index * rpn + l]};
			uint8_t buf[64];
			size_t n = epp_dispatch_ok_encode(&ok, buf, sizeof(buf));
			epd_member_reply_ok(g->local[l], buf, (uint32_t)n);
		}
	} else {
		g->n_combine++;
		for (uint32_t l = 0; l < rpn; l++)
			epd_member_reply_ok(g->local[l], NULL, 0);
	}
}

/* Back on the loop thread. */
static void job_drop(void *j)
{
	job_free(j);
}

static void job_done(uv_work_t *req, int status)
{
	struct job *j = req->data;
	struct epd_group *g = j->g;
	if (!epd_group_job_ended(g, job_drop, j))
		return;
	if (status < 0 && !j->rc) {
		j->rc = EP_EBACKEND;
		snprintf(j->err, sizeof(j->err), "work cancelled: %s",
			 uv_strerror(status));
	}
	struct ek_route *r = j->route;
	if (j->recv_pos)
		g->toobig_pos = j->recv_pos; /* a staged op's word */
	epd_ops_finish(g, j->type, j->cached, j->seq, &r, j->rc, j->err,
		       j->bytes);
	if (j->own_route && !r)
		j->own_route = false; /* the ring has it now */
	job_free(j);
}

bool epd_recv_over(const struct epd_group *g, const struct ek_route *r,
		   char *err, size_t errlen, uint64_t *pos)
{
	const uint64_t cap = g->layout.max_recv;
	for (uint32_t d = 0; d < r->world; d++) {
		if (r->num_recv[d] <= cap)
			continue;
		snprintf(err, errlen,
			 "rank %u would receive %u rows, above the group's "
			 "receive capacity of %llu rows a rank (recv_rows at "
			 "join); the dispatch changed nothing",
			 d, r->num_recv[d], (unsigned long long)cap);
		*pos = EPP_OP_ERR_RECV | (uint64_t)d << 32 | r->num_recv[d];
		return true;
	}
	return false;
}

/* A dispatch one of whose ranks asked for too many tokens: every rank gets
 * EP_ETOOBIG, nothing ran. Across nodes the other nodes' ranks may have
 * asked too (flags[s], by global rank): the lowest such rank is named. */
bool epd_ops_toobig(struct epd_group *g, const uint32_t *flags, uint32_t W,
		    char *err, size_t errlen)
{
	for (uint32_t s = 0; s < W; s++) {
		if (!(flags[s] & EPP_DISPATCH_TOOBIG))
			continue;
		const bool here = s == g->toobig_rank && g->toobig_tokens;
		g->toobig_pos = (uint64_t)s << 32 |
				(here ? g->toobig_tokens : UINT32_MAX);
		if (here)
			snprintf(err, errlen,
				 "rank %u dispatched %u tokens, above the "
				 "group's maximum of %u per rank",
				 s, g->toobig_tokens, g->shape.max_tokens);
		else
			snprintf(err, errlen,
				 "rank %u dispatched more tokens than the "
				 "group's maximum of %u per rank",
				 s, g->shape.max_tokens);
		return true;
	}
	return false;
}

static void job_submit(struct epd_group *g)
{
	uint32_t rpn = g->shape.ranks_per_node;
	uv_timer_stop(&g->timer);
	if (g->coll_type == EPP_DISPATCH) {
		uint32_t fl[rpn];
		for (uint32_t l = 0; l < rpn; l++)
			fl[l] = g->local[l]->op_flags;
		char why[256];
		if (epd_ops_toobig(g, fl, rpn, why, sizeof(why))) {
			g->toobig_tokens = 0;
			epd_ops_finish(g, EPP_DISPATCH, g->coll_cached,
				       g->coll_seq, NULL, EP_ETOOBIG, why, 0);
			return;
		}
	}
	struct job *j = calloc(1, sizeof(*j));
	if (!j)
		goto err;
	j->g = g;
	j->type = g->coll_type;
	j->cached = g->coll_cached;
	j->seq = g->coll_seq;
	j->shape = (struct ek_shape){.world = g->shape.world_size,
				     .num_experts = g->shape.num_experts,
				     .hidden = g->shape.hidden,
				     .topk = g->shape.topk,
				     .elt = g->layout.elt,
				     .nscales = g->layout.nscales};
	j->io = calloc(rpn, sizeof(*j->io));
	j->num_tokens = calloc(rpn, sizeof(*j->num_tokens));
	j->topk = calloc(rpn, sizeof(*j->topk));
	j->rank_rc = calloc(rpn, sizeof(*j->rank_rc));
	j->rank_err = calloc(rpn, sizeof(*j->rank_err));
	if (!j->io || !j->num_tokens || !j->topk || !j->rank_rc ||
	    !j->rank_err)
		goto err;
	for (uint32_t l = 0; l < rpn; l++) {
		struct epd_member *m = g->local[l];
		struct ek_rank_io *io = &j->io[l];
		io->x = epd_region(g, l, EPP_BUF_X);
		io->x_scales = (float *)epd_region(g, l, EPP_BUF_X_SCALES);
		io->topk_idx = (int64_t *)epd_region(g, l, EPP_BUF_TOPK_IDX);
		io->topk_weights = m->op_flags & EPP_DISPATCH_WEIGHTS
					   ? (float *)epd_region(g, l,
							     EPP_BUF_TOPK_WEIGHTS)
					   : NULL;
		io->recv_x = epd_region(g, l, EPP_BUF_RECV_X) +
			     (j->type == EPP_DISPATCH
				      ? EPP_DISPATCH_AREA_OF(m->op_flags)
				      : 0) * g->layout.recv_area_bytes;
		io->recv_scales = (float *)epd_region(g, l, EPP_BUF_RECV_SCALES);
		io->recv_topk_idx = (int64_t *)epd_region(g, l,
						      EPP_BUF_RECV_TOPK_IDX);
		io->recv_topk_weights =
			(float *)epd_region(g, l, EPP_BUF_RECV_TOPK_WEIGHTS);
		io->recv_src = (int32_t *)epd_region(g, l, EPP_BUF_RECV_SRC);
		io->recv_per_expert =
			(int32_t *)epd_region(g, l, EPP_BUF_RECV_PER_EXPERT);
		io->combine_y = (uint16_t *)epd_region(g, l, EPP_BUF_COMBINE_Y);
		bool bias = j->type == EPP_COMBINE &&
			    (m->op_flags & EPP_COMBINE_BIAS);
		io->combine_bias = bias ? (uint16_t *)epd_region(
						  g, l, EPP_BUF_COMBINE_BIAS)
					: NULL;
		io->combine_bias2 =
			j->type == EPP_COMBINE &&
					(m->op_flags & EPP_COMBINE_BIAS2)
				? (uint16_t *)epd_region(g, l,
							 EPP_BUF_COMBINE_BIAS2)
				: NULL;
		io->combine_topk = j->type == EPP_COMBINE &&
					   (m->op_flags & EPP_COMBINE_TOPK_ORDER)
				   ? io->topk_idx
				   : NULL;
		io->combined = (uint16_t *)epd_region(g, l, EPP_BUF_COMBINED);
		if (j->type == EPP_COMBINE && g->coll_cw) {
			io->combine_w =
				(float *)epd_region(g, l, EPP_BUF_COMBINE_W);
			io->combined_w =
				(float *)epd_region(g, l, EPP_BUF_COMBINED_W);
		}
		io->rank_prefix =
			(int32_t *)epd_region(g, l, EPP_BUF_RANK_PREFIX);
		io->num_tokens = m->op_tokens;
		j->num_tokens[l] = m->op_tokens;
	}
	if (j->type == EPP_COMBINE || j->cached) {
		j->route = epd_route_find(g, j->seq);
		/* the routing fixes the token counts */
		for (uint32_t l = 0; l < rpn; l++)
			j->num_tokens[l] = j->route->num_tokens[l];
	}
	j->req.data = j;
	g->busy = true;
	int rc = uv_queue_work(g->srv->loop, &j->req, job_run, job_done);
	if (rc) {
		g->busy = false;
		goto err;
	}
	return;
err:
	if (j)
		job_free(j);
	epd_group_fail(g, EP_ENOMEM, "cannot start the %s job",
		       epp_type_name(g->coll_type));
}

/* Common arrival: record, arm the timer, start when everyone is in. */
static void arrive(struct epd_member *m, uint64_t req_id, uint16_t type)
{
	struct epd_group *g = m->group;
	m->refused_type = 0;
	m->pending_req = req_id;
	m->pending_type = type;
	g->coll_type = type;
	if (g->coll_arrived++ == 0)
		g->coll_start_ns = epd_now_ns();
	if (g->nnodes > 1 &&
	    (epd_group_remote_check(g) || !epd_coll_order(g)))
		return; /* failed on another node before this op, or the
			   nodes' programs differ */
	if (g->coll_arrived < g->shape.ranks_per_node) {
		epd_group_arm_timer(g);
	} else if (g->nnodes > 1) {
		/* the other nodes take part: they must answer in time too
		 * (with one local rank, nothing armed the timer yet) */
		epd_group_arm_timer(g);
		g->srv->span->op_start(g);
	} else {
		job_submit(g);
	}
}

void epd_ops_staged_enter(struct epd_group *g, uint16_t type, bool cached,
			  uint64_t host_seq, const uint32_t *tokens,
			  const uint32_t *flags, uint64_t seq,
			  epd_member_complete_fn done)
{
	uint32_t rpn = g->shape.ranks_per_node;
	g->coll_type = type;
	g->coll_cached = cached;
	g->coll_cw = type == EPP_COMBINE && (flags[0] & EPP_COMBINE_WEIGHTS);
	g->coll_seq = host_seq;
	g->coll_arrived = rpn;
	g->coll_start_ns = epd_now_ns();
	for (uint32_t l = 0; l < rpn; l++) {
		struct epd_member *m = g->local[l];
		m->pending_req = seq;
		m->pending_type = type;
		m->complete = done;
		m->op_tokens = tokens[l];
		m->op_flags = flags[l];
	}
	epd_group_arm_timer(g);
	if (epd_group_remote_check(g) || !epd_coll_order(g))
		return; /* failed, and replied */
	g->srv->span->op_start(g);
}

/* Rank m's dispatch or combine was refused (its error replied): kept
 * for the others' timeout, which names it. */
static int refused(struct epd_member *m, uint16_t type, int code)
{
	m->refused_type = type;
	m->refused_code = code;
	return code;
}

int epd_op_dispatch(struct epd_session *c, uint64_t req_id,
		    const struct epp_dispatch *d)
{
	struct epd_member *m = epd_coll_enter(c, req_id, d->group_id);
	if (!m)
		return EP_EINVAL;
	struct epd_group *g = m->group;
	const struct epp_join *s = &g->shape;
	bool cached = d->flags & EPP_DISPATCH_CACHED;
	if (d->flags & ~(EPP_DISPATCH_WEIGHTS | EPP_DISPATCH_CACHED |
			 EPP_DISPATCH_AREA_MASK)) {
		epd_session_error(c, req_id, EP_EINVAL,
				 "unknown dispatch flags 0x%x", d->flags);
		return EP_EINVAL;
	}
	if (EPP_DISPATCH_AREA_OF(d->flags) >= g->layout.recv_areas) {
		epd_session_error(c, req_id, EP_EINVAL,
				 "dispatch into receive area %u of group %s, "
				 "which has %u",
				 EPP_DISPATCH_AREA_OF(d->flags), s->name,
				 g->layout.recv_areas);
		return EP_EINVAL;
	}
	if (d->hidden != s->hidden || d->dtype != s->dtype ||
	    d->topk != s->topk) {
		epd_session_error(c, req_id, EP_ESHAPE,
				 "dispatch of hidden %u, dtype %u, top-%u on "
				 "group %s of hidden %u, dtype %u, top-%u",
				 d->hidden, d->dtype, d->topk, s->name,
				 s->hidden, s->dtype, s->topk);
		return EP_ESHAPE;
	}
	/* Too many tokens: the rank takes part with none and the op fails
	 * for every rank of the group once all entered (the others would
	 * otherwise wait for it until the timeout). */
	bool toobig = d->num_tokens > s->max_tokens;
	if (cached) {
		if (!handle_ok(c, req_id, m, &d->handle))
			return refused(m, EPP_DISPATCH, EP_ESTALE);
		const struct ek_route *r = epd_route_find(g, d->handle.seq);
		if (!toobig && r->num_tokens[m->rank] != d->num_tokens) {
			epd_session_error(c, req_id, EP_ESHAPE,
					 "cached dispatch of %u tokens with a "
					 "handle of %u",
					 d->num_tokens, r->num_tokens[m->rank]);
			return refused(m, EPP_DISPATCH, EP_ESHAPE);
		}
	}
	if (!epd_coll_agree(m, req_id, EPP_DISPATCH))
		return EP_EMISMATCH;
	/* Every rank must run the same kind of dispatch on one handle. */
	uint64_t seq = cached ? d->handle.seq : 0;
	if (g->coll_arrived && (g->coll_cached != cached || g->coll_seq != seq)) {
		epd_session_error(c, req_id, EP_EMISMATCH,
				 "rank %u's dispatch names another handle than "
				 "the other ranks'",
				 m->rank);
		epd_group_fail(g, EP_EMISMATCH,
			       "rank %u's dispatch names another handle",
			       m->rank);
		return EP_EMISMATCH;
	}
	g->coll_cached = cached;
	g->coll_seq = seq;
	m->op_tokens = toobig ? 0 : d->num_tokens;
	m->op_flags = d->flags | (toobig ? EPP_DISPATCH_TOOBIG : 0);
	if (toobig) {
		g->toobig_rank = m->rank;
		g->toobig_tokens = d->num_tokens;
	}
	arrive(m, req_id, EPP_DISPATCH);
	return 0;
}

int epd_op_combine(struct epd_session *c, uint64_t req_id,
		   const struct epp_combine *cb)
{
	struct epd_member *m = epd_coll_enter(c, req_id, cb->group_id);
	if (!m)
		return EP_EINVAL;
	struct epd_group *g = m->group;
	if (cb->flags &
	    ~(EPP_COMBINE_BIAS | EPP_COMBINE_BIAS2 | EPP_COMBINE_WEIGHTS |
	      EPP_COMBINE_TOPK_ORDER)) {
		epd_session_error(c, req_id, EP_EINVAL,
				 "unknown combine flags 0x%x", cb->flags);
		return EP_EINVAL;
	}
	if (cb->hidden != g->shape.hidden) {
		epd_session_error(c, req_id, EP_ESHAPE,
				 "combine of hidden %u on group %s of hidden %u",
				 cb->hidden, g->shape.name, g->shape.hidden);
		return EP_ESHAPE;
	}
	if (!handle_ok(c, req_id, m, &cb->handle))
		return refused(m, EPP_COMBINE, EP_ESTALE);
	const struct ek_route *r = epd_route_find(g, cb->handle.seq);
	if (cb->num_rows != r->num_recv[m->rank]) {
		epd_session_error(c, req_id, EP_ESHAPE,
				 "combine of %u rows; rank %u received %u in "
				 "that dispatch",
				 cb->num_rows, m->rank, r->num_recv[m->rank]);
		return refused(m, EPP_COMBINE, EP_ESHAPE);
	}
	if (!epd_coll_agree(m, req_id, EPP_COMBINE))
		return EP_EMISMATCH;
	if (g->coll_arrived && g->coll_seq != cb->handle.seq) {
		epd_session_error(c, req_id, EP_EMISMATCH,
				 "rank %u combines handle %llu, the other "
				 "ranks %llu",
				 m->rank, (unsigned long long)cb->handle.seq,
				 (unsigned long long)g->coll_seq);
		epd_group_fail(g, EP_EMISMATCH,
			       "rank %u combines another handle", m->rank);
		return EP_EMISMATCH;
	}
	bool cw = cb->flags & EPP_COMBINE_WEIGHTS;
	if (g->coll_arrived && g->coll_cw != cw) {
		epd_session_error(c, req_id, EP_EMISMATCH,
				 "rank %u combines %s top-k weights, the other "
				 "ranks %s",
				 m->rank, cw ? "with" : "without",
				 cw ? "without" : "with");
		epd_group_fail(g, EP_EMISMATCH,
			       "rank %u's combine disagrees on top-k weights",
			       m->rank);
		return EP_EMISMATCH;
	}
	g->coll_seq = cb->handle.seq;
	g->coll_cached = false;
	g->coll_cw = cw;
	m->op_tokens = r->num_tokens[m->rank];
	m->op_flags = cb->flags;
	m->op_rows = cb->num_rows;
	arrive(m, req_id, EPP_COMBINE);
	return 0;
}
