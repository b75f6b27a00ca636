/* SPDX-License-Identifier: MIT */
/*
 * libep's low-latency mode (ep.h, ep_ll_*) of GPU ranks in a group across
 * nodes. The kernels of one node (libep_ll.c) write into the peers'
 * mapped regions, which another node's GPU cannot reach without the
 * daemons; the daemons' dispatch and combine already cross nodes, check
 * every index a rank wrote and end every wait. So, as the host path
 * (libep_llhost.c) does, each (token, k) is one pseudo token of a second
 * group of the same ranks (top-1, at most max_tokens x topk a rank, linked
 * to the group: it fails whenever the group does), here a GPU group whose
 * stream-ordered ops run on the caller's stream between small kernels
 * (kernels/cuda/ekc_llx.cu):
 *
 *   dispatch  ekc_llx_send (the pseudo tokens: rows, top-1 index, each
 *             one's place among its source's rows to its expert), the
 *             pseudo group's ep_dispatch_stream, ekc_llx_recv_count and
 *             ekc_llx_recv_rows (the rows laid out per local expert, cast
 *             to fp8 on the way)
 *   combine   ekc_llx_gather (each received row's expert output into the
 *             pseudo group's combine_y), its ep_combine_stream (each row
 *             back to its home alone, so unchanged), ekc_llx_sum (the
 *             weighted sum in top-k order)
 *
 * Nothing waits on the CPU, nothing on the host changes between ops but
 * what the pseudo group's stream ops already number at replay time, so
 * both ops capture into CUDA graphs (libep_graph.c). The outputs, bit for
 * bit, are the kernels' and the host path's. The two buffers alternate per
 * dispatch as on one node; each keeps its outputs, its (t, k) experts, its
 * received rows' places and its pseudo dispatch's routing (released at
 * the buffer's next dispatch) for its combine. The pseudo group's own
 * buffers are shared by both, so a group's low-latency ops must run in
 * one order on the device (one stream, or streams ordered by events), as
 * every stream-ordered op of a group must.
 */
#include "libep_cuda_int.h"

#include "ek.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct llx_buf {
	CUdeviceptr rx, sc;    /* [El, WN, H] bf16 or e4m3; scales */
	CUdeviceptr count;     /* [El] i32 */
	CUdeviceptr layout;    /* [El, W] i64 */
	CUdeviceptr src;       /* [El, WN] i32 */
	CUdeviceptr key;       /* [N * K] i32 */
	CUdeviceptr place;     /* [max_recv] i64 */
	CUdeviceptr nrec;      /* u32 */
	CUdeviceptr cx;        /* a zero-copy combine's rows [El, WN, H]
				  (made with the rest: a first use inside a
				  graph capture could not allocate) */
	ep_handle_t h;         /* the pseudo group's dispatch */
	bool held;             /* h is a direct op's, to release */
	bool used;
	uint32_t T;            /* its tokens (0: it had too many) */
	CUdeviceptr hout;      /* a hooked combine's out */
};

struct ep_llx {
	uint32_t W, El, N, H, K, blocks;
	uint64_t WN;
	ep_group_t *aux; /* the pseudo group (not in the connection's list) */
	CUdeviceptr mem;
	struct llx_buf b[2];
	uint32_t next; /* the buffer of the next dispatch */
	CUfunction fn[EP__FN_LLX_SUM - EP__FN_LLX_SEND + 1];
	volatile uint32_t *herr; /* [EKC_LLX_NERR], mapped for the GPU */
	struct ekc_llx_args base;
	struct ep__ll_end end; /* a failed op: every call returns it */
};

static void llx_free(struct ep_llx *x)
{
	if (x->aux) /* the connection is closed: no LEAVE to send */
		ep__group_free(x->aux);
	if (x->mem)
		ep__drv.cuMemFree(x->mem);
	if (x->herr)
		ep__drv.cuMemFreeHost((void *)x->herr);
	free(x);
}

void ep__llx_fini(ep_group_t *g)
{
	if (g->llx)
		llx_free(g->llx);
	g->llx = NULL;
}

void ep__llx_leave(ep_group_t *g)
{
	if (g->llx && g->llx->aux) {
		(void)ep_leave(g->llx->aux);
		g->llx->aux = NULL;
	}
}

static uint64_t up(uint64_t n)
{
	return (n + 255) / 256 * 256;
}

/* The device memory of both buffers, in one allocation, zeroed. */
static int llx_alloc(struct ep_llx *x, uint64_t max_recv)
{
	const uint64_t rows = (uint64_t)x->El * x->WN;
	const uint64_t sz[] = {rows * x->H * 2, rows * (x->H / 128) * 4 + 4,
			       (uint64_t)x->El * 4, (uint64_t)x->El * x->W * 8,
			       rows * 4, (uint64_t)x->N * x->K * 4 + 4,
			       max_recv * 8 + 8, 4, rows * x->H * 2};
	uint64_t per = 0;
	for (size_t i = 0; i < sizeof(sz) / sizeof(sz[0]); i++)
		per += up(sz[i]);
	CUresult r = ep__drv.cuMemAlloc(&x->mem, 2 * per);
	if (!r) /* landed before any stream's work (ekc_write waits) */
		r = ekc_write(&ep__drv, x->mem, NULL, 2 * per);
	if (r) {
		if (x->mem)
			ep__drv.cuMemFree(x->mem);
		x->mem = 0;
		return ep__cufail(r, "allocating the low-latency outputs");
	}
	for (int b = 0; b < 2; b++) {
		CUdeviceptr p = x->mem + b * per;
		CUdeviceptr *f[] = {&x->b[b].rx,     &x->b[b].sc,
				    &x->b[b].count,  &x->b[b].layout,
				    &x->b[b].src,    &x->b[b].key,
				    &x->b[b].place,  &x->b[b].nrec,
				    &x->b[b].cx};
		for (size_t i = 0; i < sizeof(sz) / sizeof(sz[0]); i++) {
			*f[i] = p;
			p += up(sz[i]);
		}
	}
	return 0;
}

/* The pseudo group (joined linked, so a rank the group lost fails this
 * join at once) and the kernels' state, at the first call. */
static int llx_setup(ep_group_t *g)
{
	int rc = ep__use_ctx(g->cuda_device);
	if (rc || g->llx)
		return rc;
	const struct epp_join *c = &g->cfg;
	const uint64_t NK = (uint64_t)c->max_tokens * c->topk;
	if (c->num_experts > EKC_LLX_MAXE || c->num_experts % c->world_size)
		return ep__fail(EP_EUNSUPPORTED,
				"the low-latency mode takes up to %u experts, "
				"a multiple of the ranks",
				EKC_LLX_MAXE);
	if (NK >= EKC_LLX_MARK / 2) /* a place must not read as the mark */
		return ep__fail(EP_ELIMIT, "max_tokens x topk is too large for "
					   "the low-latency mode");
	struct ep_llx *x = calloc(1, sizeof(*x));
	if (!x)
		return ep__fail(EP_ENOMEM, "out of memory");
	x->W = c->world_size;
	x->El = c->num_experts / x->W;
	x->N = c->max_tokens;
	x->H = c->hidden;
	x->K = c->topk;
	x->WN = (uint64_t)x->W * x->N;
	for (int k = EP__FN_LLX_SEND; k <= EP__FN_LLX_SUM; k++)
		if (!(x->fn[k - EP__FN_LLX_SEND] = ep__fn(k))) {
			free(x);
			return ep__fail(EP_EBACKEND,
					"the low-latency kernels are not in "
					"this GPU's module");
		}
	int sms = 0;
	if ((rc = ep__sm_count(g->cuda_device, &sms))) {
		free(x);
		return rc;
	}
	x->blocks = sms > 0 ? (uint32_t)sms : 1;
	char name[EP_GROUP_NAME_MAX + 1];
	ep__llh_name(c->name, name);
	struct ep_group_config ac = {
		.name = name, .world_size = x->W,
		.ranks_per_node = c->ranks_per_node, .rank = c->rank,
		.num_experts = c->num_experts, .hidden = x->H,
		.max_tokens_per_rank = (uint32_t)(NK > x->W ? NK : x->W),
		.topk = 1, .dtype = EP_DTYPE_BF16, .timeout_ms = g->timeout_ms,
		.cuda_device = g->cuda_device};
	struct ep_buffers ab;
	/* the pseudo group spans the group's nodes, as it names them, and
	 * is the job's as the group is (its secret) */
	const struct epp_join nodes = {.num_nodes = g->cfg.num_nodes,
				       .nodes = g->cfg.nodes,
				       .secret = g->cfg.secret,
				       .secret_len = g->cfg.secret_len};
	rc = ep__join(g->conn, &ac, EP_JOIN_CUDA, g->id, &nodes, &ep__gpu,
		      &x->aux);
	if (!rc) {
		/* the group owns it: freed with it, never on its own by
		 * ep_close */
		pthread_mutex_lock(&g->conn->mu);
		list_del(&x->aux->node);
		pthread_mutex_unlock(&g->conn->mu);
		rc = ep_get_buffers(x->aux, &ab);
	}
	if (!rc)
		rc = llx_alloc(x, ab.max_recv);
	CUdeviceptr herr = 0;
	if (!rc)
		rc = ep__host_words(EKC_LLX_NERR, &x->herr, &herr,
				    "the low-latency error words");
	if (rc) {
		char msg[EPP_ERRMSG_MAX];
		snprintf(msg, sizeof(msg), "%s", ep_errmsg());
		if (x->aux) {
			(void)ep_leave(x->aux);
			x->aux = NULL;
		}
		llx_free(x);
		return ep__fail(rc, "the low-latency mode's pseudo group %s: %s",
				name, msg);
	}
	struct ekc_llx_args *a = &x->base;
	a->sx = (uint64_t)(uintptr_t)ab.x;
	a->stk = (uint64_t)(uintptr_t)ab.topk_idx;
	a->sw = (uint64_t)(uintptr_t)ab.topk_weights;
	a->rx = (uint64_t)(uintptr_t)ab.recv_x;
	a->rtk = (uint64_t)(uintptr_t)ab.recv_topk_idx;
	a->rw = (uint64_t)(uintptr_t)ab.recv_topk_weights;
	a->rsrc = (uint64_t)(uintptr_t)ab.recv_src;
	a->cy = (uint64_t)(uintptr_t)ab.combine_y;
	a->comb = (uint64_t)(uintptr_t)ab.combined;
	a->nrecv = ep_dispatch_recv_count_device(x->aux);
	a->err = herr;
	/* the pseudo group's error word in this rank's slot, and the
	 * group's: raised by the daemon when either failed; and the pseudo
	 * group's op error, raised when an op of it failed alone (never set
	 * back: the mode is over, llx_gate) */
	const uint64_t slot =
		(uint64_t)(c->rank % c->ranks_per_node) * EPP_CTL_SLOT;
	const uint64_t aux = x->aux->ctl_dev ? x->aux->ctl_dev + slot : 0,
		       own = g->ctl_dev ? g->ctl_dev + slot : 0;
	a->failed[0] = aux ? aux + EPP_CTL_ERR_CODE : 0;
	a->failed[1] = own ? own + EPP_CTL_ERR_CODE : 0;
	a->failed[2] = aux ? aux + EPP_CTL_OP_ERR_CODE : 0;
	a->W = x->W;
	a->N = x->N;
	a->H = x->H;
	a->El = x->El;
	a->K = x->K;
	a->max_recv = (uint32_t)(ab.max_recv < UINT32_MAX ? ab.max_recv
							  : UINT32_MAX);
	g->llx = x;
	return 0;
}

static struct ekc_llx_args llx_args(const struct ep_llx *x, uint32_t b)
{
	struct ekc_llx_args a = x->base;
	const struct llx_buf *B = &x->b[b];
	a.key = B->key;
	a.nrec = B->nrec;
	a.place = B->place;
	a.out_rx = B->rx;
	a.out_sc = B->sc;
	a.recv_count = B->count;
	a.layout = B->layout;
	a.src_info = B->src;
	a.T = B->T;
	return a;
}

static int llx_launch(const struct ep_llx *x, int fn, uint32_t blocks,
		      struct ekc_llx_args *a, void *stream)
{
	void *params[1] = {a};
	CUresult r = ep__drv.cuLaunchKernel(x->fn[fn - EP__FN_LLX_SEND],
					    blocks, 1, 1, EKC_LLX_TPB, 1, 1, 0,
					    (CUstream)stream, params, NULL);
	return r ? ep__cufail(r, "launching a low-latency kernel") : 0;
}

static int llx_die(struct ep_llx *x, int rc)
{
	return ep__ll_die(&x->end, rc);
}

/* Before an op: the mode's end (kept), or the group's or the pseudo
 * group's failure, or an op of the pseudo group that failed alone (each
 * ends it). libep's kernels never send a pseudo op that fails alone (an
 * expert index out of range is skipped, too many tokens is a mark): where
 * one did, a peer wrote its pseudo tokens itself. Its combine then fails
 * alone too (EP_ESTALE, the daemons' word for a combine of a failed
 * dispatch): the mode ends with the dispatch's error, its cause. The
 * kernels saw the same (failed[2]): no rows counted, NaN sums. */
static int llx_gate(ep_group_t *g)
{
	struct ep_llx *x = g->llx;
	int rc = ep__ll_gate(&x->end, g);
	if (!rc && !x->aux)
		rc = llx_die(x, ep__fail(EP_ENOGROUP, "the pseudo group was "
						      "left"));
	if (!rc)
		rc = ep__ll_gate(&x->end, x->aux);
	if (!rc && (rc = ep__op_error_cause(x->aux)))
		rc = llx_die(x, rc);
	return rc;
}

/* Whether stream captures (*cap); a direct call while graphs hold the
 * pseudo group's ops is refused as the pseudo group's own stream op would
 * be (EP_EBUSY), before anything is enqueued or changed (the mode goes
 * on). */
static int llx_direct_ok(const struct ep_llx *x, void *stream, bool *cap)
{
	int rc = ep__stream_capturing(stream, cap);
	return rc || *cap ? rc : ep__graph_direct_ok(x->aux);
}

/* A refused dispatch reports no rows (as a poisoned kernel does). */
static void llx_no_rows(const struct ep_llx *x, uint32_t b, void *stream)
{
	(void)ep__drv.cuMemsetD32Async(x->b[b].count, 0, x->El,
				       (CUstream)stream);
	(void)ep__drv.cuMemsetD32Async(x->b[b].layout, 0,
				       (size_t)x->El * x->W * 2,
				       (CUstream)stream);
}

/* A refused combine's out: NaN, as the kernels write. */
static void llx_out_nan(const struct ep_llx *x, CUdeviceptr out, uint32_t T,
			void *stream)
{
	if (out && T)
		(void)ep__drv.cuMemsetD32Async(out, 0x7fc07fc0u,
					       (size_t)T * x->H / 2,
					       (CUstream)stream);
}

int ep__llx_dispatch(ep_group_t *g, const void *xp, const int64_t *topk,
		     uint32_t T, int fp8, void *stream, struct ep_ll_recv *out)
{
	int rc = llx_setup(g);
	if (rc)
		return rc;
	struct ep_llx *x = g->llx;
	const uint32_t b = x->next;
	struct llx_buf *B = &x->b[b];
	if ((rc = llx_gate(g))) {
		llx_no_rows(x, b, stream);
		return rc;
	}
	bool cap;
	if ((rc = llx_direct_ok(x, stream, &cap)))
		return rc;
	/* the routing two dispatches back on this buffer is done with (a
	 * captured one's is the graph's) */
	if (B->held) {
		B->held = false;
		if ((rc = ep_handle_release_async(x->aux, &B->h))) {
			llx_no_rows(x, b, stream);
			return llx_die(x, rc);
		}
	}
	const bool over = T > x->N;
	B->T = over ? 0 : T;
	struct ekc_llx_args a = llx_args(x, b);
	a.x = (uint64_t)(uintptr_t)xp;
	a.topk = (uint64_t)(uintptr_t)topk;
	a.T = T;
	a.over = over;
	a.fp8 = (uint32_t)fp8;
	if ((rc = llx_launch(x, EP__FN_LLX_SEND, x->blocks, &a, stream)))
		return rc;
	rc = ep_dispatch_stream(x->aux, over ? x->W : T * x->K,
				EP_DISPATCH_WEIGHTS, NULL, stream, &B->h);
	if (rc) {
		rc = llx_die(x, rc);
		llx_no_rows(x, b, stream);
		return rc;
	}
	B->held = !(B->h.seq & EP__GSEQ);
	if ((rc = llx_launch(x, EP__FN_LLX_RECV_COUNT, 1, &a, stream)) ||
	    (rc = llx_launch(x, EP__FN_LLX_RECV_ROWS, x->blocks, &a, stream)))
		return rc;
	x->next = b ^ 1;
	B->used = true;
	B->hout = 0;
	out->buffer = b;
	out->recv_x = (void *)(uintptr_t)B->rx;
	out->recv_scales = fp8 ? (void *)(uintptr_t)B->sc : NULL;
	out->recv_count = (int32_t *)(uintptr_t)B->count;
	out->layout_range = (int64_t *)(uintptr_t)B->layout;
	out->src_info = (int32_t *)(uintptr_t)B->src;
	out->local_experts = x->El;
	out->max_recv = (uint32_t)x->WN;
	return over ? ep__fail(EP_ETOOBIG,
			       "%u tokens exceed the group's maximum of %u "
			       "(this rank took part with none)",
			       T, x->N)
		    : 0;
}

static int llx_buffer(ep_group_t *g, uint32_t b)
{
	if (!g->llx || b > 1 || !g->llx->b[b].used)
		return ep__fail(EP_EINVAL, "buffer %u has no low-latency "
					   "dispatch",
				b);
	return ep__use_ctx(g->cuda_device);
}

int ep__llx_dispatch_hook(ep_group_t *g, uint32_t b, void *stream)
{
	/* the rows were placed by the dispatch: the pseudo group's op has
	 * no second half to leave for the hook */
	int rc = llx_buffer(g, b);
	if (!rc && (rc = llx_gate(g)))
		llx_no_rows(g->llx, b, stream);
	return rc;
}

int ep__llx_combine_buffer(ep_group_t *g, uint32_t b, void **rows)
{
	int rc = llx_setup(g);
	if (rc)
		return rc;
	*rows = (void *)(uintptr_t)g->llx->b[b].cx;
	return 0;
}

int ep__llx_combine(ep_group_t *g, uint32_t b, const void *expert_out,
		    const float *weights, void *out, unsigned flags,
		    void *stream)
{
	int rc = llx_buffer(g, b);
	if (rc)
		return rc;
	struct ep_llx *x = g->llx;
	struct llx_buf *B = &x->b[b];
	if (B->T && (!weights || !out))
		return ep__fail(EP_EINVAL, "weights and out are required");
	if (!(flags & EP_LL_ZERO_COPY) && !expert_out)
		return ep__fail(EP_EINVAL, "expert_out is required (or "
					   "EP_LL_ZERO_COPY)");
	void *cx = NULL;
	if ((flags & EP_LL_ZERO_COPY) &&
	    (rc = ep__llx_combine_buffer(g, b, &cx)))
		return rc;
	B->hout = flags & EP_LL_HOOK ? (CUdeviceptr)(uintptr_t)out : 0;
	if ((rc = llx_gate(g))) {
		llx_out_nan(x, (CUdeviceptr)(uintptr_t)out, B->T, stream);
		return rc;
	}
	bool cap;
	if ((rc = llx_direct_ok(x, stream, &cap)))
		return rc;
	if (!cap && (B->h.seq & EP__GSEQ))
		return ep__fail(EP_EINVAL,
				"buffer %u's dispatch was captured into a CUDA "
				"graph: its combine is captured too",
				b);
	struct ekc_llx_args a = llx_args(x, b);
	a.ex = (uint64_t)(uintptr_t)(cx ? cx : expert_out);
	a.weights = (uint64_t)(uintptr_t)weights;
	a.out = (uint64_t)(uintptr_t)out;
	if ((rc = llx_launch(x, EP__FN_LLX_GATHER, x->blocks, &a, stream)))
		return rc;
	if ((rc = ep_combine_stream(x->aux, &B->h, 0, stream))) {
		rc = llx_die(x, rc);
		llx_out_nan(x, (CUdeviceptr)(uintptr_t)out, B->T, stream);
		return rc;
	}
	return llx_launch(x, EP__FN_LLX_SUM, x->blocks, &a, stream);
}

int ep__llx_combine_hook(ep_group_t *g, uint32_t b, void *stream)
{
	/* summed by the combine, as the dispatch's hook */
	int rc = llx_buffer(g, b);
	if (!rc && (rc = llx_gate(g)))
		llx_out_nan(g->llx, g->llx->b[b].hout, g->llx->b[b].T, stream);
	return rc;
}

int ep__llx_error(ep_group_t *g)
{
	struct ep_llx *x = g->llx;
	if (!x)
		return 0;
	int rc = llx_gate(g);
	if (rc)
		return rc;
	/* the pseudo group's own asynchronous or graph errors */
	if ((rc = ep_group_error(x->aux)))
		return llx_die(x, rc);
	const bool expert = x->herr[EKC_LLX_EEXPERT],
		   toobig = x->herr[EKC_LLX_ETOOBIG];
	x->herr[EKC_LLX_EEXPERT] = x->herr[EKC_LLX_ETOOBIG] = 0;
	return ep__ll_soft_error(expert, toobig);
}
