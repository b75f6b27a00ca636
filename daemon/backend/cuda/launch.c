/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend: one dispatch or combine enqueued on the group's
 * streams (the kernels, their grid, the bulk-copy engine, traces).
 */
#include "cuda_int.h"

_Static_assert((int)EKC_F_N == (int)EPP_BUF_NFIELDS,
	       "the kernels' fields follow enum epp_buf_field");
_Static_assert(EKC_EEXPERT == EP_EEXPERT && EKC_ETOOBIG == EP_ETOOBIG &&
		       EKC_ESTALE == EP_ESTALE &&
		       EKC_ETIMEDOUT == EP_ETIMEDOUT,
	       "the kernels' op error codes are libep's");
_Static_assert(EKC_ERR_RECV == EPP_OP_ERR_RECV &&
		       EKC_ERR_HANDLE == EPP_OP_ERR_HANDLE &&
		       EKC_ERR_TOOBIG == EPP_OP_ERR_TOOBIG &&
		       EKC_ERR_WAIT == EPP_OP_ERR_WAIT,
	       "the flags of the kernels' error words");

CUresult cu_launch(struct epd_cuda_group *c, CUfunction f, unsigned gx,
		       unsigned gy, unsigned bx, void *args)
{
	void *params[] = {args};
	return cu_drv->cuLaunchKernel(f, gx, gy ? gy : 1, 1, bx, 1, 1, 0, c->stream,
				 params, NULL);
}

_Static_assert(sizeof(struct ekc_disp_args) <= 4096,
	       "a kernel's parameters fit in 4 KB");

/* Programmatic dependent launch (cuda_pdl): the kernel f may become
 * resident while the kernel ahead of it on the stream is still running;
 * every data kernel first waits for that one (prior_done in
 * ekc_op.cuh), so this hides part of the launch gap between two of
 * the op's kernels (the copy starts ~3 us sooner after the prep under
 * MPS), not any ordering. Only where the work ahead on the stream is a
 * kernel of the same op: pdl false otherwise. coop: a cooperative grid.
 * Where the launch fails with the attribute and works without it, the
 * driver refused it: plain launches from then on. */
static CUresult launch_ex(const struct epd_group *g, struct cudev *d,
			  CUfunction f, unsigned gx, unsigned gy, unsigned bx,
			  unsigned smem, CUstream s, void *args, bool coop,
			  bool pdl)
{
	void *params[] = {args};
	CUlaunchAttribute at[2];
	unsigned n = 0;
	pdl = pdl && !g->srv->cfg.cuda_no_pdl && !d->no_pdl;
	if (coop)
		at[n++] = (CUlaunchAttribute){
			.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE,
			.value.cooperative = 1};
	if (pdl)
		at[n++] = (CUlaunchAttribute){
			.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
			.value.programmaticStreamSerializationAllowed = 1};
	CUlaunchConfig cfg = {.gridDimX = gx, .gridDimY = gy ? gy : 1,
			      .gridDimZ = 1, .blockDimX = bx, .blockDimY = 1,
			      .blockDimZ = 1, .sharedMemBytes = smem,
			      .hStream = s, .attrs = at, .numAttrs = n};
	CUresult r = cu_drv->cuLaunchKernelEx(&cfg, f, params, NULL);
	if (r && pdl && r != CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE) {
		cfg.numAttrs = n - 1; /* the attribute is the last */
		CUresult r2 = cu_drv->cuLaunchKernelEx(&cfg, f, params, NULL);
		if (!r2) {
			epd_warn("the driver refused programmatic dependent "
				 "launch (%d): the data kernels launch without "
				 "it",
				 (int)r);
			d->no_pdl = true;
		}
		r = r2;
	}
	return r;
}

/* SMs' worth of blocks for the data kernels: cuda_sms, or all. */
unsigned cu_sms_cap(const struct epd_group *g, const struct cudev *d)
{
	unsigned cap = g->srv->cfg.cuda_sms;
	return cap && (int)cap < d->sms ? cap : (unsigned)d->sms;
}

/* count + scan + slot as one cooperative launch (ekc_prep): configured,
 * and its grid (a block per 256 tokens of each rank) resident at once.
 * Under MPS other clients' kernels may hold SMs: the driver then waits
 * until the whole grid fits, as a cooperative launch must. */
bool cu_use_prep(const struct epd_group *g, const struct cudev *d)
{
	const struct epd_cuda_group *c = g->dev_group;
	return !g->srv->cfg.cuda_no_fused_prep && d->occ_prep > 0 &&
	       (uint64_t)c->nblk_max * g->shape.ranks_per_node <=
		       (uint64_t)d->occ_prep * (uint64_t)d->sms;
}

/* Below 32 SMs the SMs' bulk-copy units are the limit (measured: 0.48 of
 * D2D at 16 SMs against 0.66 for the SIMT copy). */
bool cu_use_tma(const struct epd_cuda_group *c, unsigned sms)
{
	return c->tma_smem && sms >= 32;
}

/* The SMs of the row copy. What it needs is about 64 blocks' worth of
 * 14 KB rows staged at once (7 MB), a block a SM: a SM's bulk copies are
 * a limit of their own, and more blocks contend for memory. H200,
 * DeepSeek-V3 shape, 8 ranks under MPS (PERFORMANCE.md, "One
 * GPU: dispatch and combine"), pipelined: bf16 0.80-0.81 of D2D with 64 blocks on 64 SMs
 * (0.77-0.79 with 132-192 blocks; on an H100 0.64-0.65 when the same 64
 * blocks sat two a SM on 32 SMs, against 0.84-0.85 spread); fp8 (7 KB
 * rows) 0.74-0.76 with 132 blocks one a SM, 0.70-0.71 with 192 spread
 * two or three a SM, 0.58 with 64. cuda_copy_sms
 * caps them (auto: 64 blocks of 14 KB rows, in SMs at
 * cuda_copy_blocks_per_sm), leaving the rest to the ranks. */
unsigned cu_copy_sms(const struct epd_cuda_group *c, unsigned sms)
{
	unsigned cap = c->g->srv->cfg.cuda_copy_sms;
	if (cap == EPD_COPY_SMS_AUTO) {
		uint64_t rowb = (uint64_t)c->g->shape.hidden * c->g->layout.elt;
		uint64_t per = rowb * (c->occ_tma_cap > 0
					       ? (unsigned)c->occ_tma_cap : 1);
		uint64_t n = per ? (64ull * 14336 + per - 1) / per : 32;
		cap = n < 32 ? 32 : n > 1024 ? 1024 : (unsigned)n;
	}
	if (cu_use_tma(c, sms) && cap && sms > cap && cu_use_tma(c, cap))
		return cap;
	return sms;
}

/* Capped below the SMs it may use, the bulk copy spreads its blocks
 * (cuda_copy_blocks_per_sm); held to fewer SMs than it would take, it
 * fills them with as many blocks as fit (measured at 16-66 SMs' worth:
 * PERFORMANCE.md). */
void cu_copy_form(const struct epd_cuda_group *c, const struct cudev *d,
		  unsigned sms, struct cu_copy_form *f)
{
	const unsigned n = cu_copy_sms(c, sms);
	f->sms = n;
	f->tma = cu_use_tma(c, n);
	if (!f->tma) {
		f->per_sm = (unsigned)d->occ_copy;
		f->smem = 0;
	} else if (n < sms) {
		f->per_sm = (unsigned)c->occ_tma_cap;
		f->smem = c->tma_smem_cap;
	} else {
		f->per_sm = (unsigned)c->occ_tma;
		f->smem = c->tma_smem;
	}
}

/* The dispatch row copy of one GPU in form f (cu_copy_form): bulk copies
 * or SIMT (pdl: right behind the op's prep on s). */
static CUresult launch_copy(struct epd_cuda_group *c, struct cudev *d,
			    const struct cu_copy_form *f, CUstream s,
			    void *args, bool pdl)
{
	if (f->tma)
		return launch_ex(c->g, d, d->copy_tma, f->sms * f->per_sm, 1,
				 EKC_TMA_WARPS * 32, f->smem, s, args, false,
				 pdl);
	return launch_ex(c->g, d, d->copy, f->sms * f->per_sm, 1, 256, 0, s,
			 args, false, pdl);
}

/* Byte off of local rank l's registration id as an offset from l's
 * region (mod 2^64, what the kernels add to region[l]); false: no such
 * registration. */
static bool reg_at(struct epd_cuda_group *c, uint32_t l, uint32_t id,
		   uint64_t off, uint64_t *o)
{
	const struct cu_mreg *mr = cu_mreg_find(c, l, id);
	if (!mr)
		return false;
	*o = mr->va + off - c->ptr[l];
	return true;
}

/* The combine's kernel for sms SMs' worth of blocks (*blocks: its grid).
 * With few of them, ekc_combine_lean: each token's sum specialised on its
 * number of rows (about half the instructions of ekc_combine's loop) and
 * each lane's own L2 prefetch a few column steps ahead, so that bytes are
 * in flight beyond what the registers hold. Held to 24 SMs of an H200,
 * DeepSeek-V3 shape: 0.54 of D2D, against 0.49 for ekc_combine_fetch (the
 * bulk-copy engine's L2 fetch, cuda_combine_fetch=yes) and 0.42 for
 * ekc_combine. With many, what the warps fetch ahead no longer fits in L2
 * and evicts itself: ekc_combine (0.99 at 132 SMs). auto takes the lean
 * kernel while that footprint (warps x rows a token x the steps ahead
 * and one fetch's x 512 bytes) is at most half of L2. */
static CUfunction combine_fn(const struct epd_group *g, const struct cudev *d,
			     unsigned sms, unsigned *blocks)
{
	const int how = g->srv->cfg.cuda_combine_fetch;
	if (how == 1) {
		*blocks = sms * (unsigned)d->occ_combine_fetch;
		return d->combine_fetch;
	}
	uint64_t rows = g->shape.topk < g->shape.world_size ? g->shape.topk
						       : g->shape.world_size;
	if (rows > 8)
		rows = 8; /* the kernels prefetch for up to 8 rows a token */
	const uint64_t warps = (uint64_t)sms * (unsigned)d->occ_combine_lean * 8;
	const uint64_t bytes = warps * rows * (EKC_COMBINE_LPF + 4) * 512;
	if (how == 2 || (how < 0 && bytes <= (uint64_t)d->l2 / 2)) {
		*blocks = sms * (unsigned)d->occ_combine_lean;
		return d->combine_lean;
	}
	*blocks = sms * (unsigned)d->occ_combine;
	return d->combine;
}

/* The other GPUs' part of a copy or combine: each waits for dev0's
 * stream so far, works on its own ranks (rank_mask), and is joined back
 * by join_devs. a->rank_mask is left for dev0's own part. */
static CUresult spread(struct epd_group *g, struct ekc_disp_args *a,
		       unsigned sms_cap, bool combine)
{
	struct epd_cuda_group *c = g->dev_group;
	struct epd_cuda *cu = g->srv->dev_state;
	if (c->ndevs == 1)
		return 0;
	CUresult r = cu_drv->cuEventRecord(c->ev_in, c->stream);
	for (int i = 1; !r && i < c->ndevs; i++) {
		struct cudev *d = &cu->dev[c->devs[i]];
		cu_drv->cuCtxSetCurrent(d->ctx);
		struct ekc_disp_args b = *a;
		b.rank_mask = c->dev_mask[i];
		b.copy_publishes = 0; /* dev0's copy does */
		b.work = (uint32_t *)(uintptr_t)c->work + i;
		unsigned sms = sms_cap < (unsigned)d->sms ? sms_cap
							  : (unsigned)d->sms;
		void *params[] = {&b};
		r = cu_drv->cuStreamWaitEvent(c->dstream[i], c->ev_in, 0);
		if (!r && combine) {
			unsigned blocks;
			CUfunction fn = combine_fn(g, d, sms, &blocks);
			r = cu_drv->cuLaunchKernel(fn, blocks, 1, 1, 256, 1, 1, 0,
					      c->dstream[i], params, NULL);
		} else if (!r) {
			struct cu_copy_form f;
			cu_copy_form(c, d, sms, &f);
			r = launch_copy(c, d, &f, c->dstream[i], &b, false);
		}
		if (!r)
			r = cu_drv->cuEventRecord(c->ev_out[i], c->dstream[i]);
	}
	cu_drv->cuCtxSetCurrent(cu->dev[c->dev0].ctx);
	return r;
}

/* dev0's stream waits for every other GPU's part. */
static CUresult join_devs(struct epd_cuda_group *c)
{
	CUresult r = 0;
	for (int i = 1; !r && i < c->ndevs; i++)
		r = cu_drv->cuStreamWaitEvent(c->stream, c->ev_out[i], 0);
	return r;
}

/* EPD_CUDA_TRACE: the stages' times of op `which` to pinned memory. */
static CUresult trace_fetch(struct epd_cuda_group *c, int which)
{
	if (!c->trace)
		return CUDA_SUCCESS;
	return cu_drv->cuMemcpyDtoHAsync(c->trace_host[which], c->trace,
				    EKC_TR_BYTES, c->stream);
}

/* Spans in us from the first stage start (after the op completed). */
void cu_trace_read(struct epd_cuda_group *c, int which)
{
	const unsigned long long *t = c->trace_host[which];
	unsigned long long t0 = ~0ull;
	for (int i = 0; i < EKC_TR_N; i++)
		if (t[2 * i] < t0)
			t0 = t[2 * i];
	for (int i = 0; i < EKC_TR_N; i++) {
		unsigned long long b = t[2 * i], e = ~t[2 * i + 1];
		c->trace_us[which][i][0] = b != ~0ull ? (double)(b - t0) / 1e3
						      : -1;
		c->trace_us[which][i][1] = e && t0 != ~0ull
						   ? ((double)e - (double)t0) / 1e3
						   : -1;
	}
	const uint32_t *sm = (const uint32_t *)((const char *)t + EKC_TR_SMMASK);
	c->sms_used[which] = 0;
	for (int i = 0; i < 8; i++)
		c->sms_used[which] += __builtin_popcount(sm[i]);
}

/* A dispatch's error word at its start: none (~0), or the first rank that
 * asked for too many tokens (it takes part with none): the kernels then
 * change nothing and every rank gets EP_ETOOBIG. */
static uint64_t dispatch_err0(const struct epd_group *g,
			      struct epd_aop *const *ops)
{
	for (uint32_t l = 0; l < g->shape.ranks_per_node; l++)
		if (ops[l]->flags & EPP_DISPATCH_TOOBIG)
			return EKC_ERR_TOOBIG |
			       (uint64_t)g->local[l]->rank << 32 |
			       ops[l]->asked;
	return ~0ull;
}

/* Without MPS, before the stream's waits for the doorbells (so that they
 * hide it): a dispatch's error word and the prep's grid barrier count, by
 * memsets. Under MPS the gate kernel sets them (a launch less). */
CUresult cu_dispatch_reset(struct epd_group *g, struct epd_aop *const *ops)
{
	struct epd_cuda_group *c = g->dev_group;
	const uint64_t e = dispatch_err0(g, ops);
	CUresult r = cu_drv->cuMemsetD32Async(c->err, 0xffffffffu, 3, c->stream);
	if (!r && e != ~0ull)
		r = cu_drv->cuMemsetD32Async(c->err, (uint32_t)e, 1, c->stream);
	if (!r && e != ~0ull)
		r = cu_drv->cuMemsetD32Async(c->err + 4, (uint32_t)(e >> 32), 1,
					     c->stream);
	return r;
}

/* Dispatch or combine k on the group's stream (the doorbells are waited
 * for already; without MPS a dispatch's error word is set:
 * cu_dispatch_reset). Returns a driver error, or 0. */
/* The kernels' arguments of op k (ops: each local rank's, alike but for
 * their places): the shape, each rank's region, flags, rows and receive
 * area, and the routing its dispatch made (*fresh: a dispatch that makes
 * it now). CUDA_ERROR_INVALID_VALUE where a place or the routing is
 * gone. */
static CUresult op_args(struct epd_group *g, uint64_t k,
			struct epd_aop *const *ops, struct ekc_disp_args *a,
			bool *fresh)
{
	struct epd_cuda_group *c = g->dev_group;
	const uint32_t W = g->shape.ranks_per_node;
	const struct epd_aop *op0 = ops[0];
	*a = (struct ekc_disp_args){
		.W = W, .H = g->shape.hidden, .K = g->shape.topk,
		.E = g->shape.num_experts, .elt = g->layout.elt,
		.nscales = g->layout.nscales, .Tmax = c->tmax,
		.nblk_max = c->nblk_max, .seq = (uint32_t)k,
		/* at most W x Tmax (2^22 for one node's 64 ranks) */
		.max_recv = (uint32_t)g->layout.max_recv,
		.mask = (uint64_t *)(uintptr_t)c->mask,
		.topk = (int64_t *)(uintptr_t)c->topk,
		.blk = (uint32_t *)(uintptr_t)c->blk,
		.base = (uint32_t *)(uintptr_t)c->base,
		.err = (unsigned long long *)(uintptr_t)c->err,
		.gsync = (uint32_t *)(uintptr_t)(c->err + 8),
		.pe = (uint32_t *)(uintptr_t)c->pe,
		.tma_sc = cu_tma_scale_bytes(g),
		.work = (uint32_t *)(uintptr_t)c->work,
		.host_ctl = (void *)(uintptr_t)c->ctl_dev,
		.budget_ns = (uint64_t)g->timeout_ms * 1000000ull,
		.group_err = (volatile int32_t *)(uintptr_t)(c->ctl_dev +
							     EPP_CTL_GROUP_SLOT),
		.released = (const volatile uint32_t *)(uintptr_t)(
			c->ctl_dev + EPP_CTL_GROUP_SLOT + EPP_CTL_RELEASED)};
	for (uint32_t l = 0; l < W; l++) {
		a->region[l] = c->ptr[l];
		if (ops[l]->flags & EPP_DISPATCH_WEIGHTS &&
		    ops[l]->type == EPP_DISPATCH)
			a->weights_mask |= 1ull << l;
		if (ops[l]->flags & EPP_COMBINE_BIAS &&
		    ops[l]->type == EPP_COMBINE)
			a->bias_mask |= 1ull << l;
		if (ops[l]->flags & EPP_COMBINE_BIAS2 &&
		    ops[l]->type == EPP_COMBINE)
			a->bias2_mask |= 1ull << l;
		if (ops[l]->flags & EPP_COMBINE_TOPK_ORDER &&
		    ops[l]->type == EPP_COMBINE)
			a->order_mask |= 1ull << l;
	}
	/* cu_ops_agree: every rank alike */
	a->cw = op0->type == EPP_COMBINE && (op0->flags & EPP_COMBINE_WEIGHTS);
	for (int f = 0; f < EKC_F_N; f++)
		a->off[f] = EKC_CTRL_BYTES + g->layout.off[f];
	/* each rank's combine_y (a dispatch: x) and combined rows: its
	 * region's fields, or its registered memory (epd_cuda_op checked the
	 * ranges; a row past them is the region's) */
	const int in = op0->type == EPP_COMBINE ? EKC_F_Y : EKC_F_X;
	for (uint32_t l = 0; l < W; l++) {
		const struct epd_aop *o = ops[l];
		a->yo[l] = a->off[in];
		a->oo[l] = a->off[EKC_F_OUT];
		if (epd_aop_reg(o) &&
		    !reg_at(c, l, o->reg, o->reg_off, &a->yo[l]))
			return CUDA_ERROR_INVALID_VALUE;
		if (epd_aop_outreg(o) &&
		    !reg_at(c, l, o->out_reg, o->out_off, &a->oo[l]))
			return CUDA_ERROR_INVALID_VALUE;
		a->yrows[l] = epd_aop_reg(o) ? o->rows : 0;
		a->orows[l] = epd_aop_outreg(o) ? o->out_rows : 0;
	}
	/* each rank's receive area (epd_group_async checked it) */
	for (uint32_t l = 0; l < W; l++)
		a->rx[l] = EKC_CTRL_BYTES +
			   epp_buf_recv_area(&g->layout,
					     op0->type == EPP_DISPATCH
						     ? EPP_DISPATCH_AREA_OF(
							       ops[l]->flags)
						     : 0);
	*fresh = op0->type == EPP_DISPATCH &&
		 !(op0->flags & EPP_DISPATCH_CACHED);
	/* a fresh dispatch's entry was made by cu_enqueue_ready; the others'
	 * handle was checked by cu_ops_agree */
	struct route *rt = cu_route_find(c, *fresh ? k : op0->handle);
	if (!rt)
		return CUDA_ERROR_INVALID_VALUE;
	memcpy(a->tokens, rt->tokens, sizeof(a->tokens));
	a->slot = (int32_t *)(uintptr_t)rt->slot;
	a->recv = (uint32_t *)(uintptr_t)rt->recv;
	a->rp = a->recv + W; /* the same allocation (cu_route_make) */
	/* then its dispatch's outcome (W + W * W is even: 8-byte aligned) */
	a->rerr = rt->recv ? (unsigned long long *)(a->rp + W * W) : NULL;
	a->cached = !*fresh;
	return CUDA_SUCCESS;
}

/* With EPD_CUDA_TRACE: the kernels' stage stamps, cleared on the
 * stream. */
static CUresult trace_start(struct epd_cuda_group *c, struct ekc_disp_args *a)
{
	if (!c->trace)
		return CUDA_SUCCESS;
	a->trace = (unsigned long long *)(uintptr_t)c->trace;
	a->smmask = (uint32_t *)(uintptr_t)(c->trace + EKC_TR_SMMASK);
	CUresult r = cu_drv->cuMemsetD32Async(c->trace, 0xffffffffu,
					      EKC_TR_N * 4, c->stream);
	if (!r)
		r = cu_drv->cuMemsetD32Async(c->trace + EKC_TR_SMMASK, 0, 8,
					     c->stream);
	return r;
}

/* A combine's kernels: under MPS one block waits for the doorbells
 * before the wide kernels behind it may become resident (ekc_gate);
 * then the rows spread to the group's other GPUs, and the combine. */
static CUresult launch_combine(struct epd_group *g, struct cudev *d,
			       struct ekc_disp_args *a, unsigned sms)
{
	struct epd_cuda_group *c = g->dev_group;
	CUresult r = a->wait ? cu_launch(c, d->gate, 1, 1, EKC_MAX_LOCAL, a)
			     : 0;
	if (!r)
		r = spread(g, a, sms, true);
	unsigned blocks;
	CUfunction fn = combine_fn(g, d, sms, &blocks);
	/* right behind the gate on the stream: one GPU, MPS */
	if (!r)
		r = launch_ex(g, d, fn, blocks, 1, 256, 0, c->stream, a, false,
			      a->wait && c->ndevs == 1);
	return r;
}

/* A dispatch's kernels: the gate (MPS), the routing (a fresh dispatch:
 * the fused prep, or count, scan and slot), the spread to the other GPUs
 * and the row copy. */
static CUresult launch_dispatch(struct epd_group *g, struct cudev *d,
				struct epd_aop *const *ops,
				struct ekc_disp_args *a, unsigned sms,
				bool fresh)
{
	struct epd_cuda_group *c = g->dev_group;
	const uint32_t W = g->shape.ranks_per_node;
	CUresult r = 0;
	/* under MPS the gate sets the error word and the grid barrier's
	 * count (else cu_dispatch_reset did, before the doorbell waits) */
	a->err0 = dispatch_err0(g, ops);
	a->gate_reset = a->wait;
	if (a->wait)
		r = cu_launch(c, d->gate, 1, 1, EKC_MAX_LOCAL, a);
	/* the bulk row copy at one block a SM may become resident while the
	 * prep runs (cuda_pdl): with more a SM, the scheduler would pack its
	 * blocks onto the SMs that the prep leaves room on (measured on an
	 * H100: 64 blocks two a SM on 32 SMs, 0.64 of D2D against 0.85
	 * spread) */
	struct cu_copy_form cf;
	cu_copy_form(c, d, sms, &cf);
	a->copy_early = c->ndevs == 1 && cf.tma && cf.per_sm == 1;
	/* the copy on this GPU publishes the counts (ekc_dispatch.cu,
	 * copy_publish) after the fused prep, and a cached dispatch is the
	 * copy alone; the three-launch prep's scan publishes them itself */
	bool fused = fresh && cu_use_prep(g, d);
	a->copy_publishes = 1;
	if (!r && fused) {
		r = launch_ex(g, d, d->prep, c->nblk_max, W, 256, 0, c->stream,
			      a, true, a->wait);
		if (r == CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE) {
			/* fewer SMs than the device has (an MPS limit):
			 * three launches from now on */
			epd_warn("dispatch prep: the cooperative grid does not "
				 "fit; using three launches");
			d->occ_prep = 0;
			fused = false;
			r = 0;
		}
	}
	/* each right behind a kernel of the op but the first, which is
	 * behind the gate only under MPS */
	if (!r && fresh && !fused) {
		a->copy_publishes = 0;
		r = launch_ex(g, d, d->count, c->nblk_max, W, 256, 0,
			      c->stream, a, false, a->wait);
		if (!r)
			r = launch_ex(g, d, d->scan, 1, 1, 1024, 0, c->stream,
				      a, false, true);
		if (!r)
			r = launch_ex(g, d, d->slot, c->nblk_max, W, 256, 0,
				      c->stream, a, false, true);
	}
	if (!r)
		r = spread(g, a, sms, false);
	/* spread put an event record between (several GPUs) */
	if (!r)
		r = launch_copy(c, d, &cf, c->stream, a, c->ndevs == 1);
	return r;
}

CUresult cu_enqueue_data(struct epd_group *g, uint64_t k,
			     struct epd_aop *const *ops, const char **what)
{
	struct epd_cuda_group *c = g->dev_group;
	struct cudev *d = &cu_state(g->srv)->dev[c->dev0];
	const uint32_t W = g->shape.ranks_per_node;
	const bool combine = ops[0]->type == EPP_COMBINE;
	struct ekc_disp_args a;
	bool fresh;
	CUresult r = op_args(g, k, ops, &a, &fresh);
	if (r)
		return r;
	a.wait = d->mps; /* the kernels wait for the doorbells themselves */
	unsigned sms = cu_sms_cap(g, d);
	int which = combine;
	CUevent *ev = c->ev[which];
	if ((r = trace_start(c, &a)) ||
	    (r = cu_drv->cuEventRecord(ev[0], c->stream)))
		return r;
	c->ev_seq[which] = k;
	a.rank_mask = c->dev_mask[0];
	if (c->ndevs == 1)
		a.rank_mask = W >= 64 ? ~0ull : (1ull << W) - 1;
	*what = combine ? "combine" : "dispatch";
	r = combine ? launch_combine(g, d, &a, sms)
		    : launch_dispatch(g, d, ops, &a, sms, fresh);
	if (!r)
		r = join_devs(c);
	if (!r)
		r = cu_drv->cuEventRecord(ev[1], c->stream);
	return r ? r : trace_fetch(c, which);
}

/* A staged group's handle: its dispatch made a host routing, or failed
 * alone (cu_stage_refuse then takes the op naming it out). */
static bool staged_route_ok(struct epd_cuda_group *c, uint64_t h)
{
	const struct route *rt = cu_route_find(c, h);
	return rt && (rt->host || rt->fail != UINT64_MAX);
}

/* Do the ranks' ops k agree? Fails the group if not. */
bool cu_ops_agree(struct epd_group *g, uint64_t k,
		      struct epd_aop *const *ops)
{
	const uint32_t W = g->shape.ranks_per_node;
	for (uint32_t l = 1; l < W; l++) {
		const char *why = NULL;
		if (ops[l]->type != ops[0]->type ||
		    ops[l]->fast != ops[0]->fast)
			why = "another operation";
		else if (ops[l]->type != EPP_BARRIER &&
			 ((ops[l]->flags ^ ops[0]->flags) &
			  EPP_DISPATCH_CACHED &&
			  ops[l]->type == EPP_DISPATCH))
			why = "a cached dispatch while others dispatch afresh";
		else if (ops[l]->handle != ops[0]->handle)
			why = "another handle";
		else if (ops[l]->type == EPP_COMBINE &&
			 ((ops[l]->flags ^ ops[0]->flags) &
			  EPP_COMBINE_WEIGHTS))
			why = "a combine that differs on top-k weights";
		if (why) {
			epd_group_fail(g, EP_EMISMATCH,
				       "op %llu: rank %u asked for %s than rank "
				       "%u (%s vs %s)",
				       (unsigned long long)k,
				       g->local[l]->rank, why,
				       g->local[0]->rank,
				       epp_type_name(ops[l]->type),
				       epp_type_name(ops[0]->type));
			return false;
		}
	}
	if (cu_op_named(ops[0]) &&
	    !(cu_group(g)->staged
		      ? staged_route_ok(g->dev_group, ops[0]->handle)
		      : cu_route_find(g->dev_group, ops[0]->handle) != NULL)) {
		epd_group_fail(g, EP_ESTALE,
			       "op %llu: handle %llu is unknown, released, or "
			       "its dispatch failed",
			       (unsigned long long)k,
			       (unsigned long long)ops[0]->handle);
		return false;
	}
	return true;
}
