// SPDX-License-Identifier: MIT
// Low-latency (decode) combine: the kernels of ekc_ll.cu's other half, on
// the rank's own stream, writing into the peers' public regions (ekc.h).
// Every kernel takes the op's buffer (a.buf); the flags carry the
// device's own sequence numbers, and fail as ekc_ll.cu's header says.
//
//   ekc_ll_combine         each received row back to its home's (t, k)
//                          slot, done flags; with_recv: the sum below
//   ekc_ll_combine_recv    wait for every source, sum top-k rows
//   ekc_ll_combine_pull    zero copy: the experts' rows stay in their
//                          ranks' cx; each home, once every rank said its
//                          rows are written, reads its (t, k) rows there
//                          and sums them (one read of each row, no copy)
//
#include "ekc_ll.cuh"

// The sum at home of combine seq (buffer a.buf): wait for every source,
// then sum the rows they pushed into this rank's comb slots.
__device__ static void ll_combine_recv(const struct ekc_ll_args &a,
				       uint32_t seq, uint64_t t0)
{
	const uint64_t *cdone = (const uint64_t *)ll_pub(a, a.rank, a.L.cdone);
	const bool bad = ll_poisoned(a);
	// shrink: the experts' ranks that came; a (t, k) of another is left
	// out of the sum
	bool ok;
	const uint64_t R = ll_wait_set(
		a, cdone, seq, t0, bad, EKC_LL_W_CDONE,
		ll_all(a) & ~(ll_mask_now(a) & ~(1ull << a.rank)), &ok);
	if (!ok) { // poisoned: no sum
		if (bad && blockIdx.x == 0 && threadIdx.x == 0)
			ll_fail(a, EKC_LL_EPOISONED);
		ll_out_nan(a);
		return;
	}
	ll_fence(a);
	ll_stamp(a, EKC_LL_TR_C_RECV);
	const uint8_t *comb = ll_pub(a, a.rank, a.L.comb[a.buf]);
	const uint64_t rowb = (uint64_t)a.H * 2;
	ll_sum(a, [&](uint32_t i, int32_t e, int32_t) -> const uint8_t * {
		return R >> (e / a.El) & 1 ? comb + i * rowb : nullptr;
	});
}

extern "C" __global__ void __launch_bounds__(LL_TPB, 1)
ekc_ll_combine(const struct ekc_ll_args a, uint32_t with_recv)
{
	ll_prior();
	__shared__ uint32_t begin[EKC_LL_MAXE]; // [el][s]: first row of s
	__shared__ uint32_t first[EKC_LL_MAXE + 1]; // [el]: item base
	const uint64_t t0 = now_ns();
	ll_stamp(a, EKC_LL_TR_C_START);
	ll_stamp_max(a, EKC_LL_TR_C_MAXSTART);
	uint32_t *pv = ll_priv(a);
	const uint32_t seq = *(volatile uint32_t *)(pv + EKC_LL_PRIV_CSEQ) + 1;
	const uint32_t WN = a.W * a.N, b = a.buf;
	const uint32_t *snap = ll_rows_tab(a);
	// poisoned: no rows, and the marked done flags below
	const bool bad0 = ll_poisoned(a);
	// shrink: the ranks masked now get no rows (and no flags)
	const uint64_t m0 = ll_mask_now(a) & ~(1ull << a.rank);
	const int32_t *tk = (const int32_t *)ll_pub(a, a.rank, a.L.tk[b]);
	if (blockIdx.x == 0 && threadIdx.x == 0)
		pv[EKC_LL_PRIV_CBSEQ + b] = seq;
	for (uint32_t j = threadIdx.x; j < a.El * a.W; j += blockDim.x)
		begin[j] = __ldcg(snap + j); // loaded once, all in flight
	__syncthreads();
	for (uint32_t el = threadIdx.x; el < a.El; el += blockDim.x) {
		uint32_t n = 0;
		for (uint32_t s = 0; s < a.W; s++) {
			const uint32_t c = begin[el * a.W + s];
			begin[el * a.W + s] = n;
			n += c;
		}
		first[el + 1] = n > WN ? WN : n; // ll_dispatch_recv raised it
	}
	__syncthreads();
	if (threadIdx.x == 0) {
		first[0] = 0;
		for (uint32_t el = 0; el < a.El; el++)
			first[el + 1] += first[el];
	}
	__syncthreads();
	const uint32_t rowb = a.H * 2, S = (rowb + LL_SLICE - 1) / LL_SLICE;
	const uint32_t lane = threadIdx.x & 31, NK = a.N * a.K;
	const uint64_t nw = (uint64_t)gridDim.x * (blockDim.x / 32);
	const uint64_t items = bad0 ? 0 : (uint64_t)first[a.El] * S;
	for (uint64_t it = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
	     it < items; it += nw) {
		const uint32_t j = (uint32_t)(it / S), sl = (uint32_t)(it % S);
		uint32_t lo = 0, hi = a.El; // the el with first[el] <= j
		while (hi - lo > 1) {
			uint32_t m = (lo + hi) / 2;
			if (first[m] <= j)
				lo = m;
			else
				hi = m;
		}
		const uint32_t el = lo, p = j - first[el];
		uint32_t s = 0;
		while (s + 1 < a.W && begin[el * a.W + s + 1] <= p)
			s++;
		if (m0 >> s & 1)
			continue; // masked home (shrink)
		const uint64_t row = (uint64_t)el * WN + p;
		const int32_t i = __ldcg(tk + row);
		if (i < 0 || (uint32_t)i >= NK) {
			if (lane == 0 && sl == 0)
				ll_fail(a, EKC_LL_EPEER);
			continue;
		}
		const uint32_t o = sl * LL_SLICE;
		const uint32_t bytes = rowb - o < LL_SLICE ? rowb - o : LL_SLICE;
		uint4 v[LL_U];
		ll_load((const uint8_t *)a.ex + row * rowb + o, bytes, lane, v);
		ll_store(ll_pub(a, s, a.L.comb[b]) + (uint64_t)i * rowb + o,
			 bytes, lane, v);
	}
	ll_stamp(a, EKC_LL_TR_C_COPY);
	if (ll_last_block(a, EKC_LL_PRIV_CCTR)) {
		ll_post(a, a.L.cdone, seq, ll_poisoned(a), ~m0);
		if (threadIdx.x == 0) {
			pv[EKC_LL_PRIV_CSEQ] = seq;
			if (a.trace)
				((uint64_t *)a.trace)[EKC_LL_TR_C_FLAGS] = now_ns();
		}
	}
	if (with_recv) {
		ll_combine_recv(a, seq, t0);
		ll_stamp(a, EKC_LL_TR_C_END);
	}
	ll_stamp_max(a, EKC_LL_TR_C_MAXEND);
}

extern "C" __global__ void __launch_bounds__(LL_TPB, 1)
ekc_ll_combine_recv(const struct ekc_ll_args a)
{
	ll_prior();
	const uint64_t t0 = now_ns();
	ll_combine_recv(a, __ldcg(ll_priv(a) + EKC_LL_PRIV_CBSEQ + a.buf), t0);
	ll_stamp(a, EKC_LL_TR_C_END);
}

extern "C" __global__ void __launch_bounds__(LL_TPB, 1)
ekc_ll_combine_pull(const struct ekc_ll_args a)
{
	ll_prior();
	__shared__ uint32_t off[EKC_LL_MAXE]; // [e]: first row of this rank
	const uint64_t t0 = now_ns();
	ll_stamp(a, EKC_LL_TR_C_START);
	ll_stamp_max(a, EKC_LL_TR_C_MAXSTART);
	uint32_t *pv = ll_priv(a);
	const uint32_t seq = *(volatile uint32_t *)(pv + EKC_LL_PRIV_CSEQ) + 1;
	const uint32_t E = a.El * a.W, WN = a.W * a.N, b = a.buf;
	// This rank's cx rows were written by the work before it on its
	// stream: say so to every home.
	// (poisoned: the mark on them, and no sum)
	const bool bad0 = ll_poisoned(a);
	const uint64_t m0 = ll_mask_now(a) & ~(1ull << a.rank); // shrink
	if (blockIdx.x == 0) {
		ll_fence(a);
		if (bad0 && threadIdx.x == 0)
			ll_fail(a, EKC_LL_EPOISONED);
		ll_post(a, a.L.cready, seq, bad0, ~m0);
	}
	for (uint32_t e = threadIdx.x; e < E; e += blockDim.x)
		off[e] = min(__ldcg(ll_off(a) + e), WN);
	const uint64_t *ready = (const uint64_t *)ll_pub(a, a.rank, a.L.cready);
	bool ok;
	const uint64_t R = ll_wait_set(a, ready, seq, t0, bad0,
				       EKC_LL_W_CREADY, ll_all(a) & ~m0, &ok);
	ll_fence(a);
	ll_stamp(a, EKC_LL_TR_C_RECV);
	const uint64_t rowb = (uint64_t)a.H * 2;
	auto row = [&](uint32_t, int32_t e, int32_t p) -> const uint8_t * {
		const uint32_t gp = off[e] + (uint32_t)p;
		if (gp >= WN)
			return nullptr; // the dispatch raised it
		const uint32_t d = e / a.El, el = e % a.El;
		if (!(R >> d & 1))
			return nullptr; // absent (shrink)
		return ll_pub(a, d, a.L.cx[b]) + ((uint64_t)el * WN + gp) * rowb;
	};
	if (ok)
		ll_sum(a, row);
	else
		ll_out_nan(a);
	ll_stamp(a, EKC_LL_TR_C_END);
	if (ll_last_block(a, EKC_LL_PRIV_CCTR) && threadIdx.x == 0)
		pv[EKC_LL_PRIV_CSEQ] = seq;
	ll_stamp_max(a, EKC_LL_TR_C_MAXEND);
}

// A barrier of the group's ranks (one block): DeepEP's
// clean_low_latency_buffer in shrink mode, where a rank that does not
// come is masked (ekc.h); outside it, a rank that does not come within the
// timeout ends the mode, as any op's wait.
extern "C" __global__ void __launch_bounds__(LL_TPB, 2)
ekc_ll_barrier(const struct ekc_ll_args a)
{
	ll_prior();
	const uint64_t t0 = now_ns();
	uint32_t *pv = ll_priv(a);
	const uint32_t seq =
		*(volatile uint32_t *)(pv + EKC_LL_PRIV_BARSEQ) + 1;
	const bool bad = ll_poisoned(a);
	const uint64_t m0 = ll_mask_now(a) & ~(1ull << a.rank);
	if (bad && threadIdx.x == 0)
		ll_fail(a, EKC_LL_EPOISONED);
	ll_fence(a);
	ll_post(a, a.L.bflag, seq, bad, ~m0);
	bool ok;
	(void)ll_wait_set(a, (const uint64_t *)ll_pub(a, a.rank, a.L.bflag),
			  seq, t0, bad, EKC_LL_W_BAR, ll_all(a) & ~m0, &ok);
	if (threadIdx.x == 0)
		pv[EKC_LL_PRIV_BARSEQ] = seq;
}
