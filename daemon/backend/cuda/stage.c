/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend: groups across nodes. Each op's inputs are copied to the
 * group's host buffer, the op runs on the host path with the other nodes,
 * and the results are copied back (one op at a time).
 */
#include "cuda_int.h"

/* Across nodes. A field of local rank l: on the device, in host memory. */
static CUdeviceptr dfield(struct epd_group *g, uint32_t l, int f)
{
	return cu_group(g)->ptr[l] + EKC_CTRL_BYTES + g->layout.off[f];
}

/* Copies of field f of every local rank, rows[l] rows of `per` bytes,
 * device to host (out) or back. */
static CUresult stage_copy(struct epd_group *g, int f, const uint32_t *rows,
			   size_t per, bool out)
{
	struct epd_cuda_group *c = g->dev_group;
	CUresult r = 0;
	for (uint32_t l = 0; !r && l < g->shape.ranks_per_node; l++) {
		size_t n = (size_t)rows[l] * per;
		if (!n)
			continue;
		r = out ? cu_drv->cuMemcpyDtoHAsync(epd_region(g, l, f),
					       dfield(g, l, f), n, c->stream)
			: cu_drv->cuMemcpyHtoDAsync(dfield(g, l, f),
					       epd_region(g, l, f), n,
					       c->stream);
	}
	return r;
}

/* Op k of a group across nodes, step 1: once every local rank rang, its
 * inputs are copied to the host buffer; poll_cb sees the copies done. */
void cu_stage_begin(struct epd_group *g, uint64_t k,
			struct epd_aop *const *ops)
{
	struct epd_cuda_group *c = g->dev_group;
	const uint32_t rpn = g->shape.ranks_per_node, H = g->shape.hidden;
	const uint32_t K = g->shape.topk, ns = g->layout.nscales;
	const size_t rowb = (size_t)H * g->layout.elt;
	const struct epd_aop *op0 = ops[0];
	uint32_t T[EKC_MAX_LOCAL] = {0}, R[EKC_MAX_LOCAL] = {0},
		 Tw[EKC_MAX_LOCAL] = {0};
	c->stage_type = op0->type;
	c->stage_cached = op0->type == EPP_DISPATCH &&
			  (op0->flags & EPP_DISPATCH_CACHED);
	c->stage_handle = op0->handle;
	const struct ek_route *rt = NULL;
	if (op0->type == EPP_COMBINE || c->stage_cached)
		rt = epd_route_find(g, cu_route_host(c, op0->handle));
	CUresult r = 0;
	for (uint32_t l = 0; !r && l < rpn; l++) {
		r = cu_drv->cuStreamWaitValue32(c->stream, c->ptr[l] + EKC_DOORBELL,
					   (cuuint32_t)k,
					   CU_STREAM_WAIT_VALUE_GEQ);
		uint32_t rank = g->local[l]->rank;
		c->stage_flags[l] = ops[l]->flags;
		c->stage_tokens[l] = rt ? rt->num_tokens[rank] : ops[l]->tokens;
		T[l] = c->stage_tokens[l];
		R[l] = rt ? rt->num_recv[rank] : 0;
		Tw[l] = ops[l]->flags & EPP_DISPATCH_WEIGHTS ? T[l] : 0;
	}
	if (!r && op0->type == EPP_DISPATCH) {
		r = stage_copy(g, EKC_F_X, T, rowb, true);
		if (!r && ns)
			r = stage_copy(g, EKC_F_SCALES, T, (size_t)ns * 4, true);
		if (!r && !c->stage_cached)
			r = stage_copy(g, EKC_F_TOPK, T, (size_t)K * 8, true);
		if (!r && !c->stage_cached)
			r = stage_copy(g, EKC_F_WEIGHTS, Tw, (size_t)K * 4,
				       true);
	} else if (!r && op0->type == EPP_COMBINE) {
		for (uint32_t l = 0; l < rpn; l++)
			Tw[l] = ops[l]->flags & EPP_COMBINE_BIAS ? T[l] : 0;
		r = stage_copy(g, EKC_F_Y, R, (size_t)H * 2, true);
		if (!r)
			r = stage_copy(g, EKC_F_BIAS, Tw, (size_t)H * 2, true);
		for (uint32_t l = 0; l < rpn; l++)
			Tw[l] = ops[l]->flags & EPP_COMBINE_BIAS2 ? T[l] : 0;
		if (!r)
			r = stage_copy(g, EKC_F_BIAS2, Tw, (size_t)H * 2, true);
		if (!r && (op0->flags & EPP_COMBINE_WEIGHTS))
			r = stage_copy(g, EKC_F_CW, R, (size_t)K * 4, true);
		/* the homes' top-k rows their sums' order follows */
		for (uint32_t l = 0; l < rpn; l++)
			Tw[l] = ops[l]->flags & EPP_COMBINE_TOPK_ORDER ? T[l]
								       : 0;
		if (!r)
			r = stage_copy(g, EKC_F_TOPK, Tw, (size_t)K * 8, true);
	}
	if (!r)
		r = cu_drv->cuEventRecord(c->stage_ev, c->stream);
	if (!r)
		r = cu_drv->cuLaunchHostFunc(c->stream, cu_stage_wake,
					&cu_state(g->srv)->wake);
	if (r) {
		char err[200];
		ekc_fail(cu_drv, r, "staging op inputs", err, sizeof(err));
		epd_group_fail(g, EP_EBACKEND, "op %llu: %s",
			       (unsigned long long)k, err);
		return;
	}
	c->stage_phase = 1;
	c->stage_k = k;
	cu_enqueued(c, k, false);
	cu_poll_arm(c);
}

static void staged_reply(struct epd_member *m, int code, const char *msg,
			 const void *p, uint32_t len);

/* The end of staged op k on the stream: the barrier kernel publishes its
 * completion and releases the ranks' streams (the stream already waited
 * for every doorbell). */
static CUresult stage_release(struct epd_group *g, uint64_t k)
{
	struct epd_cuda_group *c = g->dev_group;
	struct ekc_barrier_args a = cu_barrier_args(g, k, 2);
	return cu_launch(c, cu_state(g->srv)->dev[c->dev0].barrier, 1, 1,
			 (g->shape.ranks_per_node + 31) / 32 * 32, &a);
}

/* Op k failed alone (code, pos: EPP_CTL_OP_ERR_*), for every local rank's
 * CPU; with its dispatch count (none) where count. */
static void op_failed(struct epd_group *g, uint64_t k, int code, uint64_t pos,
		      bool count)
{
	for (uint32_t l = 0; l < g->shape.ranks_per_node; l++) {
		uint8_t *s = cu_slot(g, l);
		__atomic_store_n((uint64_t *)(s + EPP_CTL_OP_ERR_POS), pos,
				 __ATOMIC_RELAXED);
		__atomic_store_n((int32_t *)(s + EPP_CTL_OP_ERR_CODE), code,
				 __ATOMIC_RELAXED);
		if (count) {
			__atomic_store_n((uint64_t *)(s + EPP_CTL_RECV), 0,
					 __ATOMIC_RELAXED);
			__atomic_store_n((uint64_t *)(s + EPP_CTL_RECV_SEQ), k,
					 __ATOMIC_RELEASE);
		}
		__atomic_store_n((uint64_t *)(s + EPP_CTL_OP_ERR_SEQ), k,
				 __ATOMIC_RELEASE);
	}
}

/* Op k, a combine or cached dispatch, names the handle of a dispatch that
 * failed alone (a bad expert index, too many tokens; fail: that
 * dispatch's error word). It fails alone too and changes nothing, as on
 * one node, without the host path: every node's daemon learnt the same
 * verdict of that dispatch (the host path's), so every node takes this
 * op out alike and the nodes' op numbers stay in step. The ranks' streams
 * are released once each reached it. False: the group failed. */
bool cu_stage_refuse(struct epd_group *g, uint64_t k,
		     struct epd_aop *const *ops, uint64_t fail)
{
	struct epd_cuda_group *c = g->dev_group;
	const uint32_t rpn = g->shape.ranks_per_node;
	const bool dispatch = ops[0]->type == EPP_DISPATCH;
	epd_warn("group %s: op %llu (%s) names handle %llu, whose dispatch "
		 "failed: it fails alone",
		 g->shape.name, (unsigned long long)k,
		 epp_type_name(ops[0]->type),
		 (unsigned long long)ops[0]->handle);
	/* a cached dispatch publishes its count (none), which libep may
	 * wait for */
	op_failed(g, k, EP_ESTALE, fail | EPP_OP_ERR_HANDLE, dispatch);
	g->n_errors++; /* as the host path counts the dispatch's */
	CUresult r = 0;
	for (uint32_t l = 0; !r && l < rpn; l++)
		r = cu_drv->cuStreamWaitValue32(c->stream,
						c->ptr[l] + EKC_DOORBELL,
						(cuuint32_t)k,
						CU_STREAM_WAIT_VALUE_GEQ);
	if (!r)
		r = stage_release(g, k);
	if (r) {
		char err[200];
		ekc_fail(cu_drv, r, "releasing a refused op", err, sizeof(err));
		epd_group_fail(g, EP_EBACKEND, "op %llu: %s",
			       (unsigned long long)k, err);
		return false;
	}
	cu_enqueued(c, k, false);
	cu_poll_arm(c);
	return true;
}

/* Step 2: the inputs are in host memory: the host path with the other
 * nodes; each rank's result comes back to staged_reply. */
void cu_stage_host(struct epd_group *g)
{
	struct epd_cuda_group *c = g->dev_group;
	c->stage_phase = 2;
	c->stage_replies = 0;
	c->stage_rc = 0;
	c->stage_err[0] = 0;
	switch (c->stage_type) {
	case EPP_BARRIER:
		epd_group_staged_barrier(g, c->stage_k, staged_reply);
		break;
	case EPP_DISPATCH:
		epd_ops_staged_enter(g, EPP_DISPATCH, c->stage_cached,
				     c->stage_cached
					     ? cu_route_host(c, c->stage_handle)
					     : 0,
				     c->stage_tokens, c->stage_flags,
				     c->stage_k, staged_reply);
		break;
	default:
		epd_ops_staged_enter(g, EPP_COMBINE, false,
				     cu_route_host(c, c->stage_handle),
				     c->stage_tokens, c->stage_flags,
				     c->stage_k, staged_reply);
	}
}

/* Step 3: the results back to the device, then the release. */
static void stage_finish(struct epd_group *g)
{
	struct epd_cuda_group *c = g->dev_group;
	const uint32_t rpn = g->shape.ranks_per_node, H = g->shape.hidden;
	const uint32_t K = g->shape.topk, ns = g->layout.nscales;
	const uint64_t k = c->stage_k;
	c->stage_phase = 0;
	if (g->state != EPD_G_READY)
		return; /* failed: the streams were released */
	char err[256];
	if (cu_use_dev(g->srv->dev_state, c->dev0, err, sizeof(err))) {
		epd_group_fail(g, EP_EBACKEND, "%s", err);
		return;
	}
	CUresult r = 0;
	if (c->stage_rc == EP_EEXPERT || c->stage_rc == EP_ETOOBIG) {
		/* that op alone fails, changing nothing (the position of a
		 * bad expert is in this daemon's log; the rank with too many
		 * tokens is named to every rank, as on one node) */
		epd_warn("group %s: op %llu: %s", g->shape.name,
			 (unsigned long long)k, c->stage_err);
		const uint64_t pos =
			c->stage_rc == EP_ETOOBIG ? g->toobig_pos : UINT64_MAX;
		g->toobig_pos = UINT64_MAX;
		/* kept with its handle for the ops that will name it: each
		 * node's daemon has the same verdict (cu_stage_refuse) */
		struct route *hr = c->stage_type == EPP_DISPATCH &&
						   !c->stage_cached
					   ? cu_route_find(c, k)
					   : NULL;
		if (hr)
			hr->fail = c->stage_rc == EP_ETOOBIG
					   ? EPP_OP_ERR_TOOBIG | pos
				   : pos == UINT64_MAX ? EPP_OP_ERR_NOPOS
						       : pos;
		for (uint32_t l = 0; l < rpn; l++)
			memset(cu_ctl_pe(g, l), 0, cu_ctl_pe_bytes(g));
		op_failed(g, k, c->stage_rc, pos, true);
	} else if (c->stage_rc) {
		epd_group_fail(g, c->stage_rc, "%s", c->stage_err);
		return;
	} else if (c->stage_type == EPP_DISPATCH) {
		if (!c->stage_cached) {
			struct route *hr = cu_route_find(c, k);
			if (hr)
				hr->host = c->stage_hseq;
			else /* released by every rank while it ran */
				epd_handle_drop(g, c->stage_hseq);
		}
		const uint32_t *R = c->stage_recv;
		r = stage_copy(g, EKC_F_RECV_X, R,
			       (size_t)H * g->layout.elt, false);
		if (!r && ns)
			r = stage_copy(g, EKC_F_RECV_SCALES, R, (size_t)ns * 4,
				       false);
		uint32_t one[EKC_MAX_LOCAL] = {0};
		for (uint32_t l = 0; l < rpn; l++)
			one[l] = 1;
		if (!r) /* fresh and cached alike */
			r = stage_copy(g, EKC_F_RANK_PREFIX, one,
				       (size_t)g->shape.world_size *
					       g->shape.world_size * 4,
				       false);
		if (!c->stage_cached) { /* a cached one: rows and scales */
			if (!r)
				r = stage_copy(g, EKC_F_RECV_TOPK, R,
					       (size_t)K * 8, false);
			if (!r)
				r = stage_copy(g, EKC_F_RECV_WEIGHTS, R,
					       (size_t)K * 4, false);
			if (!r)
				r = stage_copy(g, EKC_F_RECV_SRC, R, 8, false);
			if (!r)
				r = stage_copy(g, EKC_F_RECV_PE, one,
					       (size_t)g->shape.num_experts /
						       g->shape.world_size * 4,
					       false);
		}
		for (uint32_t l = 0; !r && l < rpn; l++)
			r = cu_drv->cuMemsetD32Async(c->ptr[l] + EKC_RECV_COUNT,
						R[l], 1, c->stream);
		if (!c->stage_cached) /* each rank's rows per expert */
			for (uint32_t l = 0; l < rpn; l++)
				memcpy(cu_ctl_pe(g, l),
				       epd_region(g, l, EKC_F_RECV_PE),
				       cu_ctl_pe_bytes(g));
		for (uint32_t l = 0; l < rpn; l++) {
			uint8_t *s = cu_slot(g, l);
			__atomic_store_n((uint64_t *)(s + EPP_CTL_RECV), R[l],
					 __ATOMIC_RELAXED);
			__atomic_store_n((uint64_t *)(s + EPP_CTL_RECV_SEQ), k,
					 __ATOMIC_RELEASE);
		}
	} else if (c->stage_type == EPP_COMBINE) {
		r = stage_copy(g, EKC_F_OUT, c->stage_tokens, (size_t)H * 2,
			       false);
		if (!r && (c->stage_flags[0] & EPP_COMBINE_WEIGHTS))
			r = stage_copy(g, EKC_F_CW_OUT, c->stage_tokens,
				       (size_t)K * 4, false);
	}
	if (!r)
		r = stage_release(g, k);
	if (r) {
		ekc_fail(cu_drv, r, "staging op results", err, sizeof(err));
		epd_group_fail(g, EP_EBACKEND, "op %llu: %s",
			       (unsigned long long)k, err);
		return;
	}
	cu_enqueue_ready(g); /* the next op */
	cu_poll_arm(c);
}

/* A staged op's result for one rank (its member's completion callback). */
static void staged_reply(struct epd_member *m, int code, const char *msg,
			 const void *p, uint32_t len)
{
	struct epd_group *g = m->group;
	struct epd_cuda_group *c = g ? g->dev_group : NULL;
	if (!c || c->stage_phase != 2)
		return;
	if (code && !c->stage_rc) {
		c->stage_rc = code;
		snprintf(c->stage_err, sizeof(c->stage_err), "%s",
			 msg ? msg : ep_strerror(code));
	}
	if (!code && c->stage_type == EPP_DISPATCH && p) {
		struct epp_dispatch_ok ok;
		if (epp_dispatch_ok_decode(p, len, &ok) == 0) {
			c->stage_recv[m->local] = ok.num_recv;
			c->stage_hseq = ok.handle.seq;
		}
	}
	if (++c->stage_replies == g->shape.ranks_per_node)
		stage_finish(g);
}

/* Is some rank's request for the next op missing while another rank's
 * is in? (wait_ns: since when; poll_cb times it out.) Ops that every rank
 * asked for and that wait behind a staged op are not missing. */
void cu_request_wait(struct epd_group *g)
{
	struct epd_cuda_group *c = g->dev_group;
	uint64_t lo = UINT64_MAX, hi = 0;
	for (uint32_t l = 0; l < g->shape.ranks_per_node; l++) {
		uint64_t a = g->local[l]->async_seq;
		lo = a < lo ? a : lo;
		hi = a > hi ? a : hi;
	}
	if (g->state == EPD_G_READY && hi > c->enqueued && lo <= c->enqueued) {
		if (!c->wait_ns)
			c->wait_ns = epd_now_ns();
	} else {
		c->wait_ns = 0;
	}
}
