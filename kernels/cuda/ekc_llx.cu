// SPDX-License-Identifier: MIT
// The low-latency mode of GPU ranks across nodes (ekc.h, ekc_llx_args):
// kernels on the rank's stream around the daemons' stream-ordered dispatch
// and combine of a pseudo group, where each (token, k) is one pseudo token
// of top-1. The same outputs, bit for bit, as the kernels of one node
// (ekc_ll.cu) and the host path (libep_llhost.c):
//
//   ekc_llx_send        each (t, k)'s expert (-1: skipped, or out of range:
//                       EEXPERT) and its place among this rank's rows to
//                       that expert, in (t, k) order; the pseudo tokens'
//                       rows, top-1 index and weight word (the place); a
//                       rank with more than N tokens sends one mark to
//                       every rank instead
//   ekc_llx_recv_count  one block: what each source sent each local
//                       expert, the layout (source order), recv_count
//   ekc_llx_recv_rows   each received row into place, cast to fp8 on the
//                       way, and its src_info; the places kept
//   ekc_llx_gather      combine: each received row's expert output, from
//                       its place, into the pseudo group's combine_y
//   ekc_llx_sum         at home: each token's K rows (one pseudo token
//                       each, returned unchanged) in top-k order, each
//                       times its weight, fp32 from +0.0, rounded once
//
// Everything a peer sent (a row's local expert, source, place) is checked
// where it steers a write: a place outside its source's rows is dropped
// (ETOOBIG), as are rows past an expert's W*N. Once the pseudo group
// failed (the control page's words), a receive counts nothing and a sum
// writes NaN in every channel, so a graph replayed in a loop never takes
// stale rows for a result.
//
// The rows' loads, stores, fp8 cast and top-k sum are the kernels of one
// node's (ekc_ll.cuh), so both write the same bits.
#include "ekc_ll.cuh"

__device__ static inline void llx_err(const struct ekc_llx_args &a, int which)
{
	if (a.err)
		asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(
				     (uint32_t *)a.err + which),
			     "r"(1u) : "memory");
}

// Has the pseudo group failed, or an op of it failed alone (which libep's
// kernels never cause: a peer's forged pseudo tokens, the mode's end)?
// The same answer in every thread of the block (a barrier).
__device__ static inline bool llx_failed(const struct ekc_llx_args &a)
{
	uint32_t v = 0;
	if (threadIdx.x < 3 && a.failed[threadIdx.x])
		asm volatile("ld.relaxed.sys.global.u32 %0, [%1];"
			     : "=r"(v) : "l"(a.failed[threadIdx.x]));
	return __syncthreads_or(v != 0);
}

// Every warp of the grid: f(row, o, bytes, lane) for each (row, slice)
// item of n rows of rowb bytes (slice o of bytes bytes).
template <typename F>
__device__ static inline void llx_items(uint64_t n, uint32_t rowb, F f)
{
	const uint32_t S = (rowb + LL_SLICE - 1) / LL_SLICE;
	const uint32_t lane = threadIdx.x & 31;
	const uint64_t nw = (uint64_t)gridDim.x * (blockDim.x / 32);
	for (uint64_t it = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
	     it < n * S; it += nw) {
		const uint32_t o = (uint32_t)(it % S) * LL_SLICE;
		f((uint32_t)(it / S), o,
		  rowb - o < LL_SLICE ? rowb - o : LL_SLICE, lane);
	}
}

// A (t, k)'s expert as the dispatch takes it: -1 for a skipped one or one
// out of range (which raises EEXPERT once, in block 0).
__device__ static inline int32_t llx_expert(const struct ekc_llx_args &a,
					    uint64_t i)
{
	const int64_t e = ((const int64_t *)a.topk)[i];
	const int64_t E = (int64_t)a.El * a.W;
	return e >= 0 && e < E ? (int32_t)e : -1;
}

extern "C" __global__ void __launch_bounds__(EKC_LLX_TPB)
ekc_llx_send(const struct ekc_llx_args a)
{
	const uint32_t T = a.over ? 0 : a.T, K = a.K, E = a.El * a.W;
	if (blockIdx.x == 0) {
		// places in (t, k) order: one warp, 32 (t, k) a step, lanes of
		// one expert ranked among themselves (match groups) after the
		// experts' running counts
		__shared__ uint32_t cnt[EKC_LLX_MAXE];
		for (uint32_t j = threadIdx.x; j < E; j += blockDim.x)
			cnt[j] = 0;
		__syncthreads();
		int32_t *key = (int32_t *)a.key;
		int64_t *stk = (int64_t *)a.stk;
		uint32_t *sw = (uint32_t *)a.sw;
		const uint32_t lane = threadIdx.x & 31;
		if (threadIdx.x < 32) {
			for (uint64_t n0 = 0; n0 < (uint64_t)T * K; n0 += 32) {
				const uint64_t n = n0 + lane;
				int32_t e = -2; // past the end
				if (n < (uint64_t)T * K) {
					const int64_t raw =
						((const int64_t *)a.topk)[n];
					if (raw < -1 || raw >= (int64_t)E)
						llx_err(a, EKC_LLX_EEXPERT);
					e = llx_expert(a, n);
				}
				const uint32_t peers = __match_any_sync(
					0xffffffffu, e);
				uint32_t pos = 0;
				if (e >= 0)
					pos = cnt[e] + __popc(peers &
							      ((1u << lane) - 1));
				__syncwarp();
				if (e >= 0 && (uint32_t)(__ffs(peers) - 1) == lane)
					cnt[e] += __popc(peers);
				__syncwarp();
				if (n < (uint64_t)T * K) {
					key[n] = e;
					stk[n] = e;
					sw[n] = pos;
				}
			}
		} else if (a.over) { // a mark to every rank, no rows
			for (uint32_t r = threadIdx.x - 32; r < a.W;
			     r += blockDim.x - 32) {
				stk[r] = (int64_t)r * a.El;
				sw[r] = EKC_LLX_MARK;
			}
		}
	}
	// every warp of the grid: the rows, each (t, slice) loaded once and
	// stored for each of its K pseudo tokens that goes somewhere
	const uint32_t rowb = a.H * 2;
	llx_items(T, rowb, [&](uint32_t t, uint32_t o, uint32_t bytes,
			       uint32_t lane) {
		uint4 v[LL_U];
		ll_load((const uint8_t *)a.x + (uint64_t)t * rowb + o, bytes,
			lane, v);
		for (uint32_t k = 0; k < K; k++) {
			const uint64_t n = (uint64_t)t * K + k;
			if (llx_expert(a, n) >= 0)
				ll_store((uint8_t *)a.sx + n * rowb + o, bytes,
					 lane, v);
		}
	});
}

// One block: the received rows counted per (local expert, source), the
// layout in source order (begin << 32 | rows; begins past W*N are the
// host path's too), recv_count clamped to W*N (ETOOBIG beyond), and
// src_info -1 everywhere (ekc_llx_recv_rows writes the rows' own).
extern "C" __global__ void __launch_bounds__(EKC_LLX_TPB)
ekc_llx_recv_count(const struct ekc_llx_args a)
{
	__shared__ uint32_t cnt[EKC_LLX_MAXE];
	const uint32_t W = a.W, El = a.El, E = El * W;
	const uint64_t WN = (uint64_t)W * a.N;
	for (uint32_t j = threadIdx.x; j < E; j += blockDim.x)
		cnt[j] = 0;
	const bool failed = llx_failed(a); // (a barrier)
	uint32_t R = failed ? 0 : *(volatile const uint32_t *)a.nrecv;
	if (R > a.max_recv)
		R = a.max_recv;
	if (threadIdx.x == 0)
		*(uint32_t *)a.nrec = R;
	const int64_t *rtk = (const int64_t *)a.rtk;
	const uint32_t *rw = (const uint32_t *)a.rw;
	const int32_t *rsrc = (const int32_t *)a.rsrc;
	for (uint32_t i = threadIdx.x; i < R; i += blockDim.x) {
		const int64_t el = rtk[i];
		const int32_t s = rsrc[2 * i];
		if (rw[i] == EKC_LLX_MARK)
			llx_err(a, EKC_LLX_ETOOBIG);
		else if (el >= 0 && el < El && s >= 0 && (uint32_t)s < W)
			atomicAdd(&cnt[el * W + (uint32_t)s], 1u);
	}
	__syncthreads();
	int64_t *layout = (int64_t *)a.layout;
	for (uint32_t el = threadIdx.x; el < El; el += blockDim.x) {
		uint64_t begin = 0;
		for (uint32_t s = 0; s < W; s++) {
			const uint32_t c = cnt[el * W + s];
			layout[el * W + s] = (int64_t)(begin << 32 | c);
			begin += c;
		}
		if (begin > WN) { // an expert repeated in a token's top-k
			llx_err(a, EKC_LLX_ETOOBIG);
			begin = WN;
		}
		((int32_t *)a.recv_count)[el] = (int32_t)begin;
	}
	int32_t *src = (int32_t *)a.src_info;
	for (uint64_t j = threadIdx.x; j < El * WN; j += blockDim.x)
		src[j] = -1;
}

// Every warp of the grid: (received row, slice) items; each row into its
// place (begin of its source's rows at its expert, plus the place its
// source gave it), checked against what that source sent there.
extern "C" __global__ void __launch_bounds__(EKC_LLX_TPB)
ekc_llx_recv_rows(const struct ekc_llx_args a)
{
	const uint32_t R = *(const uint32_t *)a.nrec;
	const uint32_t W = a.W, El = a.El, WN = a.W * a.N;
	const uint32_t rowb = a.H * 2, fp8 = a.fp8;
	const int64_t *rtk = (const int64_t *)a.rtk;
	const uint32_t *rw = (const uint32_t *)a.rw;
	const int32_t *rsrc = (const int32_t *)a.rsrc;
	llx_items(R, rowb, [&](uint32_t i, uint32_t o, uint32_t bytes,
			       uint32_t lane) {
		const int64_t el = rtk[i];
		const int32_t s = rsrc[2 * i];
		const uint32_t p = rw[i];
		bool ok = p != EKC_LLX_MARK && el >= 0 && el < El && s >= 0 &&
			  (uint32_t)s < W;
		uint64_t gp = 0;
		if (ok) {
			const uint64_t lr = (uint64_t)((const int64_t *)
							       a.layout)[el * W + s];
			if (p >= (uint32_t)lr) { // outside its source's rows
				ok = false;
				if (o == 0 && lane == 0)
					llx_err(a, EKC_LLX_ETOOBIG);
			}
			gp = (lr >> 32) + p;
			ok = ok && gp < WN; // past W*N: counted as ETOOBIG
		}
		if (o == 0 && lane == 0) {
			((int64_t *)a.place)[i] =
				ok ? (int64_t)((uint64_t)el * WN + gp) : -1;
			if (ok)
				((int32_t *)a.src_info)[(uint64_t)el * WN + gp] =
					rsrc[2 * i + 1] / (int32_t)a.K;
		}
		if (!ok)
			return;
		uint4 v[LL_U];
		ll_load((const uint8_t *)a.rx + (uint64_t)i * rowb + o, bytes,
			lane, v);
		uint2 q[LL_U];
		uint32_t sw = 0;
		if (fp8)
			sw = ll_quant(v, bytes, lane, fp8, q);
		ll_put_slice((uint8_t *)a.out_rx, (uint32_t *)a.out_sc,
			     (uint32_t)el, (uint32_t)gp, WN, a.H, o, bytes, lane,
			     fp8, v, q, sw);
	});
}

// The combine's rows: received row i's expert output (at its place; zeros
// for a row without one) into the pseudo group's combine_y.
extern "C" __global__ void __launch_bounds__(EKC_LLX_TPB)
ekc_llx_gather(const struct ekc_llx_args a)
{
	const uint32_t R = *(const uint32_t *)a.nrec;
	const uint32_t rowb = a.H * 2;
	llx_items(R, rowb, [&](uint32_t i, uint32_t o, uint32_t bytes,
			       uint32_t lane) {
		const int64_t p = ((const int64_t *)a.place)[i];
		uint4 v[LL_U];
		if (p >= 0) {
			ll_load((const uint8_t *)a.ex + (uint64_t)p * rowb + o,
				bytes, lane, v);
		} else {
#pragma unroll
			for (int u = 0; u < LL_U; u++)
				v[u] = make_uint4(0, 0, 0, 0);
		}
		ll_store((uint8_t *)a.cy + (uint64_t)i * rowb + o, bytes, lane,
			 v);
	});
}

// At home: out[t] = the sum over k in top-k order of weight(t, k) times
// the row of pseudo token t * K + k (skipped ones left out), each product
// rounded, fp32 from +0.0, rounded once to bf16. NaN everywhere once the
// pseudo group failed.
extern "C" __global__ void __launch_bounds__(EKC_LLX_TPB)
ekc_llx_sum(const struct ekc_llx_args a)
{
	const uint32_t T = a.over ? 0 : a.T, K = a.K;
	if (llx_failed(a)) {
		ll_nan((void *)a.out, T, a.H);
		return;
	}
	// ll_sum_rows (ekc_ll.cu): pseudo token t * K + k's row came back
	// alone to row t * K + k of combined; a skipped one has key -1
	const struct ll_sum_io io = {(const int32_t *)a.key,
				     (const int32_t *)a.key,
				     (const float *)a.weights, (uint8_t *)a.out,
				     T, K, a.H};
	const uint8_t *comb = (const uint8_t *)a.comb;
	const uint64_t rowb = (uint64_t)a.H * 2;
	ll_sum_rows(io, [&](uint32_t i, int32_t, int32_t) -> const uint8_t * {
		return comb + i * rowb;
	});
}
