/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend: the ranks' stream-ordered ops, taken in order once every
 * local rank asked, and the poll that completes them or diagnoses a
 * timeout.
 */
#include "cuda_int.h"

/* Enqueue every op that all local ranks asked for. */
void cu_enqueue_ready(struct epd_group *g)
{
	epd_stall_mark("enqueueing GPU ops", g->shape.name);
	struct epd_cuda_group *c = g->dev_group;
	struct epd_cuda *cu = g->srv->dev_state;
	uint32_t rpn = g->shape.ranks_per_node;
	uint64_t upto = UINT64_MAX;
	for (uint32_t l = 0; l < rpn; l++)
		if (g->local[l]->async_seq < upto)
			upto = g->local[l]->async_seq;
	if (upto <= c->enqueued)
		return;
	char err[256];
	if (cu_use_dev(cu, c->dev0, err, sizeof(err))) {
		epd_group_fail(g, EP_EBACKEND, "%s", err);
		return;
	}
	if (c->staged) {
		/* one op at a time through the host path; an op that names
		 * a failed dispatch's handle is taken out here, and the next
		 * one looked at */
		for (uint64_t k = c->enqueued + 1;
		     k <= upto && !c->stage_phase && g->state == EPD_G_READY;
		     k++) {
			struct epd_aop *ops[EKC_MAX_LOCAL];
			for (uint32_t l = 0; l < rpn; l++)
				ops[l] = &g->local[l]->aq[k % MAX_INFLIGHT];
			if (!cu_ops_agree(g, k, ops))
				break;
			const bool named = cu_op_named(ops[0]);
			const struct route *rt =
				named ? cu_route_find(c, ops[0]->handle)
				      : NULL;
			if (rt && rt->fail != UINT64_MAX) {
				if (!cu_stage_refuse(g, k, ops, rt->fail))
					break;
				continue;
			}
			if (ops[0]->type != EPP_DISPATCH || named ||
			    cu_route_make(g, k, ops, 0))
				cu_stage_begin(g, k, ops);
			break;
		}
		cu_request_wait(g);
		return;
	}
	struct ekc_barrier_args a = cu_barrier_args(g, 0, 1);
	struct epd_aop *ops[EKC_MAX_LOCAL];
	for (uint64_t k = c->enqueued + 1; k <= upto; k++) {
		/* a number a rank skipped: a barrier it rang on the device */
		struct epd_aop gap = {.seq = k, .type = EPP_BARRIER,
				      .fast = true};
		for (uint32_t l = 0; l < rpn; l++) {
			ops[l] = &g->local[l]->aq[k % MAX_INFLIGHT];
			if (ops[l]->seq != k)
				ops[l] = &gap;
		}
		if (!cu_ops_agree(g, k, ops))
			return;
		if (ops[0]->fast) {
			/* the resident kernel runs it (and counts it) */
			cu_enqueued(c, k, true);
			continue;
		}
		CUresult r = 0;
		const char *what = "barrier";
		bool data = ops[0]->type != EPP_BARRIER;
		unsigned bthreads = (rpn + 31) / 32 * 32;
		uint64_t t0 = epd_now_ns();
		a.seq = (uint32_t)k;
		if (!cu->dev[c->dev0].mps) {
			/* Without MPS a spinning kernel would hold the GPU's
			 * time slice from the ranks: wait in the front end
			 * (a dispatch's error word set first, which needs no
			 * rank) */
			if (ops[0]->type == EPP_DISPATCH)
				r = cu_dispatch_reset(g, ops);
			for (uint32_t l = 0; l < rpn && !r; l++)
				r = cu_drv->cuStreamWaitValue32(
					c->stream, c->ptr[l] + EKC_DOORBELL,
					(cuuint32_t)k, CU_STREAM_WAIT_VALUE_GEQ);
		}
		/* Under MPS the kernels poll the doorbells themselves: the
		 * barrier kernel for a barrier, count/scan/combine for data
		 * (no launch and no driver call per rank just to wait). */
		if (!r && ops[0]->type == EPP_DISPATCH &&
		    !(ops[0]->flags & EPP_DISPATCH_CACHED) &&
		    !cu_route_make(g, k, ops, 0))
			return; /* the group failed, saying why */
		if (!r && data)
			r = cu_enqueue_data(g, k, ops, &what);
		/* Every op ends with the barrier kernel: it releases the ranks
		 * and publishes completion, after the data in stream order.
		 * After data kernels only the release is left: they (or the
		 * stream, without MPS) waited for every rank's doorbell. */
		a.release = data ? 2 : 1;
		if (!r)
			r = cu_launch(c, cu->dev[c->dev0].barrier, 1, 1, bthreads,
				   &a);
		if (r) {
			ekc_fail(cu_drv, r, what, err, sizeof(err));
			epd_group_fail(g, EP_EBACKEND, "enqueueing op %llu: %s",
				       (unsigned long long)k, err);
			return;
		}
		cu_enqueued(c, k, false);
		if (data && c->msg_seq[k % MAX_INFLIGHT] == k) {
			double *cpu = c->cpu_us[ops[0]->type == EPP_COMBINE];
			uint64_t f = c->msg_first_ns[k % MAX_INFLIGHT],
				 l = c->msg_last_ns[k % MAX_INFLIGHT];
			cpu[0] = (double)(l - f) / 1e3;
			cpu[1] = t0 > l ? (double)(t0 - l) / 1e3 : 0;
			cpu[2] = (double)(c->enq_ns[k % MAX_INFLIGHT] - t0) / 1e3;
		}
		switch (ops[0]->type) {
		case EPP_BARRIER: g->n_barrier++; break;
		case EPP_DISPATCH: g->n_dispatch++; break;
		case EPP_COMBINE: g->n_combine++; break;
		}
	}
	c->wait_ns = 0;
	cu_poll_arm(c);
}

/* Why rows rows of rowb bytes at byte off of registration r (or none)
 * cannot be read or written there, or NULL: the kernels use them there,
 * a row past rows the region's field, so the rows must lie inside the
 * mapping. */
static const char *reg_rows_bad(const struct cu_mreg *r, uint64_t off,
				uint32_t rows, uint64_t max_rows,
				uint64_t rowb)
{
	if (!r || r->dead)
		return "names no registration of its";
	if (rows > max_rows)
		return "has more rows than the group holds";
	if (off % 16 || off > r->bytes || (uint64_t)rows * rowb > r->bytes - off)
		return "has rows outside its registration";
	return NULL;
}

/* One place of op's in rank m's registered memory (side: "" for the
 * rows in, "output " for the rows out), checked at its arrival and
 * marked in use until op completed: false with the group failed. */
static bool place_ok(struct epd_group *g, struct epd_member *m,
		     const struct epd_aop *op, const char *side, uint32_t id,
		     uint64_t off, uint32_t rows, uint64_t max_rows,
		     uint64_t rowb)
{
	struct cu_mreg *r = cu_mreg_find(g->dev_group, m->local, id);
	const char *why = reg_rows_bad(r, off, rows, max_rows, rowb);
	if (why) {
		epd_group_fail(g, EP_EINVAL,
			       "rank %u's stream-ordered %s %llu %s%s "
			       "(registration %u, byte %llu, %u rows)",
			       m->rank, epp_type_name(op->type),
			       (unsigned long long)op->seq, side, why, id,
			       (unsigned long long)off, rows);
		return false;
	}
	if (r->last_k < op->seq)
		r->last_k = op->seq;
	return true;
}

/* op's registered memory: a dispatch's x or a combine's rows in, a
 * combine's rows out. */
static bool op_regs_ok(struct epd_group *g, struct epd_member *m,
		       const struct epd_aop *op)
{
	const bool x = op->type == EPP_DISPATCH;
	const uint64_t H = g->shape.hidden;
	return (!epd_aop_reg(op) ||
		place_ok(g, m, op, "", op->reg, op->reg_off, op->rows,
			 x ? g->shape.max_tokens : g->layout.max_recv,
			 H * (x ? g->layout.elt : 2))) &&
	       (!epd_aop_outreg(op) ||
		place_ok(g, m, op, "output ", op->out_reg, op->out_off,
			 op->out_rows, g->shape.max_tokens, H * 2));
}

void epd_cuda_op(struct epd_member *m, const struct epd_aop *op)
{
	struct epd_group *g = m->group;
	struct epd_cuda_group *c = g->dev_group;
	uint64_t seq = op->seq;
	/* With the resident barrier, the numbers a rank skips are barriers
	 * it rang on the device. */
	if (seq != m->async_seq + 1 && !(c->fb && seq > m->async_seq)) {
		epd_group_fail(g, EP_EPROTO,
			       "rank %u sent stream-ordered op %llu after "
			       "%llu",
			       m->rank, (unsigned long long)seq,
			       (unsigned long long)m->async_seq);
		return;
	}
	cu_refresh_completed(g);
	const struct epd_aop *old = &m->aq[seq % MAX_INFLIGHT];
	if (seq > c->completed + MAX_INFLIGHT - 1 ||
	    (old->seq > c->enqueued && old->seq != seq)) {
		epd_group_fail(g, EP_EBUSY,
			       "rank %u has more than %d stream-ordered ops "
			       "in flight",
			       m->rank, MAX_INFLIGHT);
		return;
	}
	if (cu_op_named(op) && !cu_route_usable(g, m, op->handle)) {
		epd_group_fail(g, EP_ESTALE,
			       "rank %u's stream-ordered %s %llu names handle "
			       "%llu, which it does not hold (never made, or "
			       "released)",
			       m->rank, epp_type_name(op->type),
			       (unsigned long long)seq,
			       (unsigned long long)op->handle);
		return;
	}
	if (!op_regs_ok(g, m, op))
		return;
	m->aq[seq % MAX_INFLIGHT] = *op;
	m->aq[seq % MAX_INFLIGHT].fast = false;
	/* a rank that asked for too many tokens got no handle: it holds none
	 * of the op's routing (the others release theirs) */
	m->aq[seq % MAX_INFLIGHT].released =
		op->type == EPP_DISPATCH && (op->flags & EPP_DISPATCH_TOOBIG);
	m->async_seq = seq;
	uint64_t now = epd_now_ns();
	if (c->msg_seq[seq % MAX_INFLIGHT] != seq) {
		c->msg_seq[seq % MAX_INFLIGHT] = seq;
		c->msg_first_ns[seq % MAX_INFLIGHT] = now;
	}
	c->msg_last_ns[seq % MAX_INFLIGHT] = now;
	cu_enqueue_ready(g);
	cu_request_wait(g);
	cu_poll_arm(c);
}

static bool in_mask(struct epd_group *g, uint32_t l, void *arg)
{
	(void)g;
	return (*(uint64_t *)arg >> l) & 1;
}

static bool no_request(struct epd_group *g, uint32_t l, void *arg)
{
	return g->local[l]->async_seq < *(uint64_t *)arg;
}

/* the doorbell read from the device on the aux stream (the main stream
 * may be blocked on it) */
static bool no_doorbell(struct epd_group *g, uint32_t l, void *arg)
{
	uint32_t v = 0;
	if (cu_drv->cuMemcpyDtoH(&v, cu_group(g)->ptr[l] + EKC_DOORBELL, 4))
		return false;
	return (int32_t)(v - (uint32_t)*(uint64_t *)arg) < 0;
}

void cu_poll_cb(uv_timer_t *t)
{
	epd_stall_mark("polling GPU ops", NULL);
	struct epd_cuda_group *c = t->data;
	struct epd_group *g = c->g;
	if (g->state != EPD_G_READY) {
		uv_timer_stop(t);
		return;
	}
	cu_refresh_completed(g);
	cu_mreg_sweep(c);
	if (c->staged && c->stage_phase == 1) {
		CUresult q = cu_drv->cuEventQuery(c->stage_ev);
		if (q == CUDA_SUCCESS) {
			cu_stage_host(g);
			if (g->state != EPD_G_READY)
				return;
		} else if (q != CUDA_ERROR_NOT_READY) {
			char err[200];
			ekc_fail(cu_drv, q, "staging op inputs", err, sizeof(err));
			epd_group_fail(g, EP_EBACKEND, "%s", err);
			return;
		}
	}
	if (c->fb) {
		uint32_t st = __atomic_load_n(&c->fb->state, __ATOMIC_ACQUIRE);
		uint64_t n = __atomic_load_n(&c->fb->count, __ATOMIC_RELAXED);
		g->n_barrier += n - c->fb_counted;
		c->fb_counted = n;
		if (st == EK_BAR_TIMEOUT || st == EK_BAR_MISMATCH) {
			char miss[512];
			uint64_t mask = c->fb->missing;
			uint64_t k = cu_widen(c->fb->seq, cu_known_top(c));
			epd_list_ranks(miss, sizeof(miss), g, in_mask, &mask);
			if (st == EK_BAR_TIMEOUT)
				epd_group_timed_out(
					g, "barrier", k,
					c->hb ? " (host barrier)"
					      : " on the device",
					"ranks whose stream never arrived",
					in_mask, &mask, NULL, "-");
			else
				epd_group_fail(g, EP_EMISMATCH,
					       "barrier %llu: ranks %s rang "
					       "another op number (their "
					       "streams ordered ops "
					       "differently)",
					       (unsigned long long)k, miss);
			return;
		}
	}
	/* device time of the last completed dispatch and combine */
	for (int i = 0; i < 2; i++) {
		float ms;
		if (c->ev_seq[i] && c->ev_seq[i] <= c->completed &&
		    cu_drv->cuEventElapsedTime(&ms, c->ev[i][0], c->ev[i][1]) ==
			    CUDA_SUCCESS) {
			c->last_us[i] = ms * 1000.0;
			c->ev_seq[i] = 0;
			if (c->trace)
				cu_trace_read(c, i);
		}
	}
	int32_t kerr = *cu_group_error_word(g);
	if (kerr) {
		epd_group_fail(g, EP_ETIMEDOUT,
			       "barrier %llu: the device wait for local rank "
			       "%d timed out after %u ms",
			       (unsigned long long)c->completed + 1, kerr - 1,
			       g->timeout_ms);
		return;
	}
	uint64_t now = epd_now_ns(), budget = (uint64_t)g->timeout_ms * 1000000ull;
	if (c->wait_ns && now - c->wait_ns > budget) {
		uint64_t k = c->enqueued + 1;
		epd_group_timed_out(g, "barrier", k, "", "ranks never arrived",
				    no_request, &k, NULL, "-");
		return;
	}
	if (c->completed >= c->enqueued) {
		if (c->wait_ns)
			return;
		if (!c->fb) {
			uv_timer_stop(t);
		} else if (!c->poll_slow) {
			/* the resident barrier's errors and counts */
			uv_timer_start(t, cu_poll_cb, 20, 20);
			c->poll_slow = true;
		}
		return;
	}
	/* the resident kernel times its own barriers out */
	if (c->enq_fast[(c->completed + 1) % MAX_INFLIGHT])
		return;
	if (now - c->oldest_ns > budget) {
		uint64_t k = c->completed + 1;
		epd_group_timed_out(g, "barrier", k, " on the device",
				    "ranks whose stream never arrived",
				    no_doorbell, &k, NULL,
				    "none (the daemon's stream)");
	}
}
