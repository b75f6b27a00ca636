// SPDX-License-Identifier: MIT
// Combine on the GPU, run by epd on its stream after every local rank's
// doorbell: for each home token, the bias (or a pair) plus the rows of
// every rank it went to, summed in fp32 in ascending rank order (or, for
// a home that asked, in its top-k row's slot order: ek_combine_order) and
// rounded once to bf16 (nearest even); the rows' top-k weights summed in
// ascending rank order. The same bits as kernels/host.
//
//   ekc_combine       a warp per home token, 16-byte vectors
//   ekc_combine_fetch the same with the rows fetched into L2 ahead, for
//                     few SMs
//   ekc_combine_lean  each token's rows specialised by count, each lane's
//                     own L2 prefetch: the daemon's choice for few SMs
#include "ekc_op.cuh"

// Did the dispatch that made the combine's handle succeed? If not, the
// combine changes nothing and fails alone (block 0 tells the homes this
// launch handles), as the dispatch did: its tables are not a routing.
__device__ static inline bool combine_handle_ok(const struct ekc_disp_args &a)
{
	const unsigned long long h = handle_error(a);
	if (h == ~0ull)
		return true;
	if (blockIdx.x == 0)
		for (uint32_t d = threadIdx.x; d < a.W; d += blockDim.x)
			if ((a.rank_mask >> d) & 1)
				publish_op_error(a, d, h);
	return false;
}

// A combine's start, by the whole block: trace marks, then (under MPS)
// every rank's doorbell. False: a rank never rang (wait_failed raised the
// group's error, or the group was released): its rows may be in use, so
// nothing is read or written.
__device__ static inline bool combine_begin(const struct ekc_disp_args &a)
{
	prior_done();
	if (threadIdx.x == 0)
		tr_begin(a, EKC_TR_COMBINE);
	mark_sm(a);
	if (!a.wait)
		return combine_handle_ok(a);
	bool bad = false;
	for (uint32_t d = threadIdx.x; d < a.W && !bad; d += blockDim.x)
		bad = !wait_doorbell(a, d);
	if (__syncthreads_or(bad))
		return false;
	if (threadIdx.x == 0)
		tr_end(a, EKC_TR_DOORBELL);
	return combine_handle_ok(a);
}

// The bulk-copy engine fetches [p, p + bytes) into L2 (no registers, no
// shared memory; one instruction for up to a few KB).
__device__ static inline void l2_fetch(const void *p, uint32_t bytes)
{
	asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p),
		     "r"(bytes)
		     : "memory");
}

// PF > 0: lane j < n asks the bulk-copy engine for row j's next CH
// column steps, PF steps ahead, every CH steps (and the first PF at the
// token's start), so that the loads wait for L2 rather than for the memory.
template <int C, int PF>
__device__ static __forceinline__ void combine_fetch(const uint4 *const *rp,
						     uint32_t n, uint32_t lane,
						     uint32_t nvec, uint32_t v,
						     uint32_t steps)
{
	if (!PF || lane >= n)
		return;
	const uint32_t hi = min(nvec, v + 32 * C * steps);
	if (v < hi)
		l2_fetch(rp[lane] + v, (hi - v) * 16);
}

// The sum of one home token's rows, by its warp: lane l takes columns
// (16-byte vectors) l, l + 32, ... C at a time, each started from the
// bias (then the second bias) or +0.0 and added in ascending rank order:
// the order of the sums is fixed. rp: the addresses of the token's n
// rows, in ascending rank order (the warp's shared memory). n <= 8
// (always when top-k <= 8: a token has a row on at most k ranks): they
// stay in registers for the whole token, and every row's loads of a
// column step are in flight together; more rows go 8 at a time.
template <int C, int PF = 0, int CH = 4>
__device__ static __forceinline__ void combine_token(const uint4 *const *rp,
						     uint32_t n, uint32_t lane,
						     uint32_t nvec,
						     const uint4 *bias,
						     const uint4 *bias2,
						     uint4 *out)
{
	const uint4 *p[8];
#pragma unroll
	for (uint32_t j = 0; j < 8; j++)
		p[j] = j < n ? rp[j] : nullptr;
	if (PF && n <= 8)
		combine_fetch<C, PF>(rp, n, lane, nvec, 0, PF);
	for (uint32_t v0 = lane, step = 0; v0 < nvec; v0 += 32 * C, step++) {
		if (PF && n <= 8 && step % CH == 0)
			combine_fetch<C, PF>(rp, n, lane, nvec,
					     (v0 - lane) + 32 * C * PF, CH);
		float acc[C][8];
#pragma unroll
		for (int c = 0; c < C; c++) {
			const uint32_t v = v0 + 32 * c;
#pragma unroll
			for (int i = 0; i < 8; i++)
				acc[c][i] = 0.0f;
			if (v < nvec && bias)
				set_bf16x8(acc[c], bias[v]);
			if (v < nvec && bias2) // DeepEP's second bias
				add_bf16x8(acc[c], bias2[v]);
		}
		for (uint32_t j0 = 0; j0 < n; j0 += 8) {
			if (j0) {
#pragma unroll
				for (uint32_t j = 0; j < 8; j++)
					p[j] = j0 + j < n ? rp[j0 + j] : nullptr;
			}
			uint4 y[8][C];
#pragma unroll
			for (uint32_t j = 0; j < 8; j++)
#pragma unroll
				for (int c = 0; c < C; c++)
					if (j0 + j < n && v0 + 32 * c < nvec)
						y[j][c] = __ldg(p[j] + v0 + 32 * c);
#pragma unroll
			for (uint32_t j = 0; j < 8; j++)
#pragma unroll
				for (int c = 0; c < C; c++)
					if (j0 + j < n && v0 + 32 * c < nvec)
						add_bf16x8(acc[c], y[j][c]);
		}
#pragma unroll
		for (int c = 0; c < C; c++)
			if (v0 + 32 * c < nvec)
				out[v0 + 32 * c] = pack_bf16x8(acc[c]);
		if (n > 8) { // the first 8 rows again, for the next step
#pragma unroll
			for (uint32_t j = 0; j < 8; j++)
				p[j] = rp[j];
		}
	}
}

// The combine: a warp per home token, C column steps at a time
// (combine_token).
// Rank d's row r of a combine's rows (its registered memory below
// yrows[d], its region's field after).
__device__ static inline const uint4 *combine_row(const struct ekc_disp_args &a,
						  uint32_t d, int32_t r,
						  uint64_t nvec)
{
	const uint64_t o = (uint32_t)r < a.yrows[d] ? a.yo[d] : a.off[EKC_F_Y];
	return (const uint4 *)(a.region[d] + o) + (uint64_t)r * nvec;
}

// The rank expert e lives on, or -1 for an expert outside the group.
__device__ static inline int32_t expert_rank(const struct ekc_disp_args &a,
					     int64_t e)
{
	return e < 0 || e >= (int64_t)a.E ? -1 : (int32_t)(e / (a.E / a.W));
}

// A home token's rows into rp in kernels/host's ek_combine_order with its
// top-k row tk (the home's topk_idx field): each rank at its last slot,
// then the ranks with a row that tk does not name, ascending. Returns how
// many. By the whole warp: lane k reads slot k once (K <= 32, the
// protocol's limit), the others see it by shuffles (the rank may write
// the row meanwhile: a second read that differed could list a rank twice
// and overrun rp).
__device__ static inline uint32_t list_topk_order(const struct ekc_disp_args &a,
						  const int32_t *slot,
						  const int64_t *tk,
						  const uint4 **rp,
						  uint32_t lane, uint64_t nvec)
{
	const uint32_t K = a.K, W = a.W;
	const int32_t dl = lane < K ? expert_rank(a, tk[lane]) : -1;
	const int32_t r = dl >= 0 ? slot[dl] : -1;
	bool last = r >= 0;
	for (uint32_t j = 0; j < K; j++) {
		const int32_t dj = __shfl_sync(0xffffffffu, dl, j);
		last = last && !(j > lane && dj == dl);
	}
	uint32_t m = __ballot_sync(0xffffffffu, last);
	if (last)
		rp[__popc(m & ((1u << lane) - 1))] =
			combine_row(a, (uint32_t)dl, r, nvec);
	uint32_t n = __popc(m);
	for (uint32_t d0 = 0; d0 < W; d0 += 32) {
		const uint32_t d = d0 + lane;
		const int32_t rd = d < W ? slot[d] : -1;
		bool extra = rd >= 0;
		for (uint32_t j = 0; j < K; j++) {
			// every lane shuffles (not behind &&: a lane whose
			// extra is false would skip it, and a full-mask
			// shuffle that some lanes skip is undefined)
			const int32_t dj = __shfl_sync(0xffffffffu, dl, j);
			extra = extra && dj != (int32_t)d;
		}
		m = __ballot_sync(0xffffffffu, extra);
		if (extra)
			rp[n + __popc(m & ((1u << lane) - 1))] =
				combine_row(a, d, rd, nvec);
		n += __popc(m);
	}
	return n;
}

// The combine's loop over home tokens, a warp each: sum(rp, n, nvec, bias,
// bias2, out) adds up one token's rows for its output; the loop lists them
// and sums the top-k weights. rp: the warp's list in shared memory.
template <typename Sum>
__device__ static __forceinline__ void combine_tokens(const struct ekc_disp_args &a,
						      const uint4 **rp, Sum sum)
{
	const uint32_t lane = threadIdx.x & 31, W = a.W, H = a.H;
	const uint64_t nvec = H / 8;
	if (!combine_begin(a))
		return;
	const uint64_t total = masked_total(a);
	for (uint64_t g = next_item(a, lane), gn; g < total; g = gn) {
		gn = next_item(a, lane);
		uint64_t t;
		const uint32_t h = masked_token(a, g, &t); // a home rank
		const int32_t *slot = a.slot + ((uint64_t)h * a.Tmax + t) * W;
		__syncwarp(); // the previous token's addresses are read
		uint32_t n = 0;
		if ((a.order_mask >> h) & 1)
			n = list_topk_order(
				a, slot,
				(const int64_t *)field(a, h, EKC_F_TOPK) +
					t * a.K,
				rp, lane, nvec);
		else
			for (uint32_t d0 = 0; d0 < W; d0 += 32) {
				const uint32_t d = d0 + lane;
				const int32_t r = d < W ? slot[d] : -1;
				const uint32_t m =
					__ballot_sync(0xffffffffu, r >= 0);
				if (r >= 0)
					rp[n + __popc(m & ((1u << lane) - 1))] =
						combine_row(a, d, r, nvec);
				n += __popc(m);
			}
		__syncwarp();
		const uint4 *bias = (a.bias_mask >> h) & 1
					    ? (const uint4 *)field(a, h, EKC_F_BIAS) +
						      t * nvec
					    : nullptr;
		const uint4 *bias2 = (a.bias2_mask >> h) & 1
					     ? (const uint4 *)field(a, h, EKC_F_BIAS2) +
						       t * nvec
					     : nullptr;
		// rank h's own output tensor (registered) or its region's
		uint4 *out = (uint4 *)(a.region[h] + (t < a.orows[h]
							     ? a.oo[h]
							     : a.off[EKC_F_OUT])) +
			     t * nvec;
		sum(rp, n, (uint32_t)nvec, bias, bias2, out);
		if (a.cw && lane < a.K) {
			// the rows' top-k weights: fp32 sums from +0.0 in
			// ascending rank order, as the host backend
			const uint32_t K = a.K;
			float acc = 0.0f;
			for (uint32_t d = 0; d < W; d++) {
				int32_t r = slot[d];
				if (r >= 0)
					acc = __fadd_rn(
						acc,
						__ldg((const float *)field(a, d,
									   EKC_F_CW) +
						      (uint64_t)r * K + lane));
			}
			((float *)field(a, h, EKC_F_CW_OUT))[t * K + lane] = acc;
		}
	}
	if (lane == 0)
		tr_end(a, EKC_TR_COMBINE);
}

// The combine with tok(rp, n, lane, nvec, bias, bias2, out) summing each
// token for its warp. Each warp's token: its rows' addresses in ascending
// rank order, made once per token by the lanes (rank d's combine_y is its
// registered memory below yrows[d], its region's field after) and passed
// through shared memory: computed in the column loop from the kernel's
// parameters with a rank known only at run time, the choice cost a
// quarter of the combine's speed.
template <typename Tok>
__device__ static __forceinline__ void combine_with(const struct ekc_disp_args &a,
						   Tok tok)
{
	__shared__ const uint4 *rows_of[256 / 32][EKC_MAX_LOCAL];
	const uint32_t lane = threadIdx.x & 31;
	combine_tokens(a, rows_of[threadIdx.x >> 5],
		       [&](const uint4 *const *rp, uint32_t n, uint32_t nvec,
			   const uint4 *bias, const uint4 *bias2, uint4 *out) {
			       tok(rp, n, lane, nvec, bias, bias2, out);
		       });
}

template <int C, int PF = 0, int CH = 4>
__device__ static __forceinline__ void combine_warps(const struct ekc_disp_args &a)
{
	combine_with(a, [](const uint4 *const *rp, uint32_t n,
				   uint32_t lane, uint32_t nvec,
				   const uint4 *bias, const uint4 *bias2,
				   uint4 *out) {
		combine_token<C, PF, CH>(rp, n, lane, nvec, bias, bias2, out);
	});
}

// acc = a sum's start at column v: the bias (exact), plus the second bias,
// or +0.0 without them.
__device__ static __forceinline__ void sum_start(float acc[8],
						 const uint4 *bias,
						 const uint4 *bias2, uint32_t v)
{
	if (bias) {
		set_bf16x8(acc, bias[v]);
	} else {
#pragma unroll
		for (int i = 0; i < 8; i++)
			acc[i] = 0.0f;
	}
	if (bias2)
		add_bf16x8(acc, bias2[v]);
}

// The lean combine: a token's sum specialised on its number of rows N (1
// to 8; none or more take combine_token's loop), four column steps an
// iteration at fixed offsets from pointers advanced once an iteration (no
// test a row, no address arithmetic a load), and with PF > 0 each lane's
// own L2 prefetch (one instruction a row and step, no register or shared
// memory held) PF steps ahead. combine_token's loop, held to 24 SMs,
// waits on its loads (a loads-only copy of it is as fast) and issues ~40
// instructions a 16-byte row vector, where the conversions and adds take
// 16 (PERFORMANCE.md, "One GPU: dispatch and combine"). The order of the sums and the
// rounding are combine_token's.
template <int N, int PF>
__device__ static __forceinline__ void lean_step(const uint4 *const (&p)[N],
						 const uint4 *b1, const uint4 *b2,
						 uint4 *o, int u, bool pf)
{
	if (PF && pf)
#pragma unroll
		for (int j = 0; j < N; j++)
			asm volatile("prefetch.global.L2 [%0];" ::"l"(p[j] + 32 * (u + PF)));
	uint4 y[N];
#pragma unroll
	for (int j = 0; j < N; j++)
		y[j] = __ldg(p[j] + 32 * u);
	float acc[8];
	sum_start(acc, b1, b2, 32 * u);
#pragma unroll
	for (int j = 0; j < N; j++)
		add_bf16x8(acc, y[j]);
	o[32 * u] = pack_bf16x8(acc);
}

template <int N, int PF>
__device__ static __forceinline__ void lean_token(const uint4 *const *rp,
						  uint32_t lane, uint32_t nvec,
						  const uint4 *bias,
						  const uint4 *bias2, uint4 *out)
{
	const uint4 *p[N];
#pragma unroll
	for (int j = 0; j < N; j++)
		p[j] = rp[j] + lane;
	const uint4 *b1 = bias ? bias + lane : nullptr;
	const uint4 *b2 = bias2 ? bias2 + lane : nullptr;
	uint4 *o = out + lane;
	if constexpr (PF > 0)
		for (uint32_t k = 1; k < PF; k++)
			if (lane + 32 * k < nvec)
#pragma unroll
				for (int j = 0; j < N; j++)
					asm volatile("prefetch.global.L2 [%0];" ::"l"(
						p[j] + 32 * k));
	uint32_t v = lane;
#pragma unroll 1
	for (; v + 96 < nvec; v += 128) {
		const bool pf = v + 32 * (3 + PF) < nvec;
#pragma unroll
		for (int u = 0; u < 4; u++)
			lean_step<N, PF>(p, b1, b2, o, u, pf);
#pragma unroll
		for (int j = 0; j < N; j++)
			p[j] += 128;
		o += 128;
		if (b1)
			b1 += 128;
		if (b2)
			b2 += 128;
	}
#pragma unroll 1
	for (; v < nvec; v += 32) {
		lean_step<N, PF>(p, b1, b2, o, 0, false);
#pragma unroll
		for (int j = 0; j < N; j++)
			p[j] += 32;
		o += 32;
		if (b1)
			b1 += 32;
		if (b2)
			b2 += 32;
	}
}

template <int PF>
__device__ static __forceinline__ void lean_any(const uint4 *const *rp,
						uint32_t n, uint32_t lane,
						uint32_t nvec, const uint4 *bias,
						const uint4 *bias2, uint4 *out)
{
	switch (n) {
#define LEAN_CASE(k_)                                                          \
	case k_:                                                               \
		lean_token<k_, PF>(rp, lane, nvec, bias, bias2, out);          \
		break;
		LEAN_CASE(1) LEAN_CASE(2) LEAN_CASE(3) LEAN_CASE(4)
		LEAN_CASE(5) LEAN_CASE(6) LEAN_CASE(7) LEAN_CASE(8)
#undef LEAN_CASE
	default:
		combine_token<1>(rp, n, lane, nvec, bias, bias2, out);
	}
}

template <int PF>
__device__ static __forceinline__ void combine_lean(const struct ekc_disp_args &a)
{
	combine_with(a, [](const uint4 *const *rp, uint32_t n,
				   uint32_t lane, uint32_t nvec,
				   const uint4 *bias, const uint4 *bias2,
				   uint4 *out) {
		lean_any<PF>(rp, n, lane, nvec, bias, bias2, out);
	});
}

#ifndef EKC_COMBINE_COLS
#define EKC_COMBINE_COLS 1
#endif
extern "C" __global__ void __launch_bounds__(256)
	ekc_combine(struct ekc_disp_args a)
{
	combine_warps<EKC_COMBINE_COLS>(a);
}

// The same with the rows fetched into L2 EKC_COMBINE_FETCH column steps
// ahead, for grids of few SMs (the daemon's choice, cu_combine_fn).
extern "C" __global__ void __launch_bounds__(256)
	ekc_combine_fetch(struct ekc_disp_args a)
{
	combine_warps<EKC_COMBINE_COLS, EKC_COMBINE_FETCH>(a);
}

// The lean combine with each lane's L2 prefetch EKC_COMBINE_LPF steps
// ahead, two blocks a SM (no spill; at three, registers spill and it
// falls to ekc_combine_fetch's speed): the daemon's choice for few SMs.
extern "C" __global__ void __launch_bounds__(256, 2)
	ekc_combine_lean(struct ekc_disp_args a)
{
	combine_lean<EKC_COMBINE_LPF>(a);
}
