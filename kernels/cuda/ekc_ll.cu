// SPDX-License-Identifier: MIT
// Low-latency (decode) dispatch (and combine): kernels on the rank's own
// stream that write straight into the peers' public regions (layout and
// arguments in ekc.h). Deterministic: a row's place comes from an
// all-gather of per-expert counts and a stable in-order scan, never from
// an atomic's order, and the combine sums in fp32 from +0.0 in top-k
// order, each row times its weight, rounded once to bf16.
//
//   ekc_ll_dispatch        counts (block 0: positions of this rank's (t, k)
//                          in top-k order, tagged counts to every rank),
//                          then rows to the experts' ranks (bf16, or cast
//                          to fp8 with per-128 scales), then done flags;
//                          with_recv: also the receive below
//   ekc_ll_dispatch_recv   wait for every source's done, then recv_count,
//                          layout and src_info (the hook's second half)
//
// Every kernel takes the op's buffer (a.buf, chosen by the caller); the
// sequence numbers that tag the flags are the device's own. The combine's
// kernels are in ekc_ll_combine.cu, what both use in ekc_ll.cuh.
//
// Every peer-written value that steers a write (counts, (t, k)) is bounds-
// checked where it is used; errors set bits in the private err word, never
// trap; every wait ends after timeout_ns, or at once when the daemon
// releases the group (a rank left it) or a peer's flag carries the poison
// mark. Such a failure poisons the rank for good (ekc.h, EKC_LL_EFATAL):
// its later ops only put the mark on their flags, so every rank of the
// group fails within one op and none reads rows placed out of step.
//
#include "ekc_ll.cuh"

// Block 0 of a dispatch: each (t, k)'s expert (key, -1 when skipped) and
// its position among this rank's rows to that expert, in (t, k) order.
// Each warp takes a contiguous chunk of the (t, k) and counts its experts
// (match groups, one add per expert and step); a scan over the warps per
// expert turns the counts into each warp's base, which the warp adds to
// its places. Then the counts, tagged with seq, to every rank's table.
#define LL_PW (LL_TPB / 32)
__device__ static void ll_plan(const struct ekc_ll_args &a, uint32_t T,
			       uint32_t over, uint32_t seq, uint32_t par,
			       uint32_t *cnt, uint64_t to)
{
	__shared__ uint16_t wc[LL_PW][EKC_LL_MAXE]; // N*K <= EKC_LL_MAXTK
	const uint32_t E = a.El * a.W, TK = T * a.K;
	const uint32_t w = threadIdx.x / 32, lane = threadIdx.x & 31;
	const int64_t *topk = (const int64_t *)a.topk;
	int32_t *key = ll_key(a), *pos = ll_pos(a);
	for (uint32_t j = threadIdx.x; j < LL_PW * E; j += blockDim.x)
		wc[j / E][j % E] = 0;
	__syncthreads();
	const uint32_t C = ((TK + LL_PW - 1) / LL_PW + 31) & ~31u;
	const uint32_t lo = min(TK, w * C), hi = min(TK, lo + C);
	for (uint32_t b = lo; b < hi; b += 32) {
		const uint32_t i = b + lane;
		int64_t e = i < hi ? topk[i] : -1;
		if (e < -1 || e >= (int64_t)E) {
			ll_fail(a, EKC_LL_EEXPERT);
			e = -1;
		}
		const uint32_t k = e < 0 ? 0xffffffffu : (uint32_t)e;
		const uint32_t m = __match_any_sync(0xffffffffu, k);
		const uint32_t c = e >= 0 ? wc[w][k] : 0;
		const uint32_t before = __popc(m & ((1u << lane) - 1));
		__syncwarp();
		if (e >= 0 && before == 0)
			wc[w][k] = (uint16_t)(c + __popc(m));
		__syncwarp();
		if (i < hi) {
			key[i] = (int32_t)e;
			pos[i] = e >= 0 ? (int32_t)(c + before) : -1;
		}
	}
	__syncthreads();
	for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
		uint32_t run = 0;
		for (uint32_t v = 0; v < LL_PW; v++) {
			const uint32_t n = wc[v][e];
			wc[v][e] = (uint16_t)run;
			run += n;
		}
		cnt[e] = run;
	}
	__syncthreads();
	for (uint32_t i = lo + lane; i < hi; i += 32) {
		const int32_t e = key[i]; // this lane's own stores above
		if (e >= 0)
			pos[i] += wc[w][e];
	}
	__syncthreads();
	__threadfence();
	for (uint32_t j = threadIdx.x; j < a.W * E; j += blockDim.x) {
		uint32_t d = j / E, e = j % E;
		if (to >> d & 1)
			ll_st64(a, (uint64_t *)ll_pub(a, d, a.L.cnt[par]) +
					(uint64_t)a.rank * E + e,
				(uint64_t)seq << 32 | over | cnt[e]);
	}
	// then one flag per destination: its W flags are all it waits on
	ll_fence(a);
	__syncthreads();
	if (a.shrink)
		ll_post_cnt(a, seq, false, to);
	else
		ll_post(a, a.L.cflag, seq, false, to);
}

// The receive side of dispatch seq (buffer a.buf), by every block of the
// grid: wait for every source's done flag, then recv_count and layout
// (block 0) and src_info (grid-strided), from the rows each source sent
// here as the send part snapshotted them.
__device__ static void ll_dispatch_recv(const struct ekc_ll_args &a,
					uint32_t seq, uint64_t t0, uint64_t P)
{
	__shared__ uint32_t rows[EKC_LL_MAXE];
	const uint32_t WN = a.W * a.N;
	const uint64_t *done = (const uint64_t *)ll_pub(a, a.rank, a.L.done);
	const uint32_t *snap = ll_rows_tab(a);
	const int32_t *tk = (const int32_t *)ll_pub(a, a.rank, a.L.tk[a.buf]);
	const bool bad = ll_poisoned(a);
	// P: the sources the send part counted present (shrink: the rest
	// sent nothing here); Q: of them, those whose rows all landed
	bool ok;
	const uint64_t Q =
		ll_wait_set(a, done, seq, t0, bad, EKC_LL_W_DONE, P, &ok);
	// Every source that came must have counted the same ranks present:
	// its rows' places were computed from the counts of those before it
	// (ekc.h, shrink mode). Else some rows may lie where another
	// source's are: the mode ends here, never silently.
	if (ok && a.shrink) {
		const uint64_t *ps =
			(const uint64_t *)ll_pub(a, a.rank, a.L.pset[a.buf]);
		int bad_set = 0;
		for (uint32_t s = threadIdx.x; s < a.W; s += blockDim.x)
			if ((Q >> s & 1) &&
			    __ldcg((const unsigned long long *)ps + s) != P)
				bad_set = 1;
		if (__syncthreads_or(bad_set)) {
			if (threadIdx.x == 0)
				ll_fail(a, EKC_LL_EMASK);
			ok = false;
		}
	}
	if (!ok) { // poisoned: no rows
		if (bad && blockIdx.x == 0 && threadIdx.x == 0)
			ll_fail(a, EKC_LL_EPOISONED);
		for (uint32_t j = threadIdx.x; j < a.El * a.W && blockIdx.x == 0;
		     j += blockDim.x) {
			((int64_t *)a.layout)[j] = 0;
			if (j < a.El)
				((int32_t *)a.recv_count)[j] = 0;
		}
		return;
	}
	ll_fence(a);
	ll_stamp(a, EKC_LL_TR_D_RECV);
	__shared__ uint32_t sn[EKC_LL_MAXE]; // [el][s]: the table, loaded once
	for (uint32_t j = threadIdx.x; j < a.El * a.W; j += blockDim.x)
		sn[j] = __ldcg(snap + j);
	__syncthreads();
	// a source counted present whose rows never all landed (it failed
	// between its counts and its done flag): its rows stay a hole, in
	// the layout with none and in src_info as -1
	const uint64_t hole = P & ~Q;
	for (uint32_t el = threadIdx.x; el < a.El; el += blockDim.x) {
		uint64_t begin = 0;
		for (uint32_t s = 0; s < a.W; s++) {
			uint32_t c = sn[el * a.W + s];
			if (blockIdx.x == 0)
				((int64_t *)a.layout)[el * a.W + s] =
					(int64_t)(begin << 32 |
						  (hole >> s & 1 ? 0 : c));
			begin += c;
		}
		if (begin > WN) {
			ll_fail(a, EKC_LL_ETOOBIG);
			begin = WN;
		}
		rows[el] = (uint32_t)begin;
		if (blockIdx.x == 0)
			((int32_t *)a.recv_count)[el] = (int32_t)begin;
	}
	__syncthreads();
	const uint64_t n = (uint64_t)a.El * WN;
	for (uint64_t j = blockIdx.x * blockDim.x + threadIdx.x; j < n;
	     j += (uint64_t)gridDim.x * blockDim.x) {
		uint32_t el = (uint32_t)(j / WN), p = (uint32_t)(j % WN);
		int32_t v = -1;
		bool in_hole = false;
		if (hole && p < rows[el]) {
			uint32_t s = 0, c = 0;
			while (s < a.W && p >= c + sn[el * a.W + s])
				c += sn[el * a.W + s++];
			in_hole = s < a.W && (hole >> s & 1);
		}
		if (p < rows[el] && !in_hole) {
			int32_t i = __ldcg(tk + j);
			if (i >= 0 && (uint32_t)i < a.N * a.K)
				v = i / (int32_t)a.K;
			else
				ll_fail(a, EKC_LL_EPEER);
		}
		((int32_t *)a.src_info)[j] = v;
	}
}

// The send part of dispatch seq once every source's counts are in: where
// this rank's rows start at each expert, then its rows (and their (t, k)
// and fp8 scales) into the experts' ranks' buffer a.buf.
__device__ static void ll_dispatch_rows(const struct ekc_ll_args &a,
					uint32_t seq, uint32_t par, uint32_t T,
					uint32_t *off, uint64_t P)
{
	uint32_t *pv = ll_priv(a);
	const uint32_t E = a.El * a.W, WN = a.W * a.N, b = a.buf;
	const uint64_t *cnt = (const uint64_t *)ll_pub(a, a.rank, a.L.cnt[par]);
	ll_fence(a);
	ll_stamp(a, EKC_LL_TR_D_CNT);
	// Where this rank's rows start in each expert: the rows of the sources
	// before it, each clamped to W*N (a sum of integers: the same in any
	// order). Every (source, expert) word read once, all in flight
	// together. Block 0 keeps the starts, and what each source sends
	// here, in buffer b's tables for the receive and the combine (cnt[par]
	// may be rewritten by a peer two dispatches on), and raises ETOOBIG
	// for a source that had too many tokens.
	for (uint32_t e = threadIdx.x; e < E; e += blockDim.x)
		off[e] = 0;
	__syncthreads();
	for (uint32_t j = threadIdx.x; j < a.W * E; j += blockDim.x) {
		const uint32_t s = j / E, e = j % E;
		// an absent source (shrink) sent nothing: its words are stale
		const uint32_t raw =
			P >> s & 1 ? (uint32_t)__ldcg(
					     (const unsigned long long *)cnt + j)
				   : 0;
		const uint32_t n = raw & ~LL_OVER;
		if (s < a.rank && n)
			atomicAdd(&off[e], n < WN ? n : WN);
		if (blockIdx.x == 0) {
			if (e == 0 && (raw & LL_OVER))
				ll_fail(a, EKC_LL_ETOOBIG);
			if (e / a.El == a.rank)
				ll_rows_tab(a)[(e % a.El) * a.W + s] = n;
		}
	}
	__syncthreads();
	for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
		off[e] = min(off[e], WN);
		if (blockIdx.x == 0)
			ll_off(a)[e] = off[e];
	}
	if (blockIdx.x == 0 && threadIdx.x == 0) {
		pv[EKC_LL_PRIV_BSEQ + b] = seq;
		((unsigned long long *)(pv + EKC_LL_PRIV_PSET))[b] = P;
	}
	__syncthreads();
	const int32_t *key = ll_key(a), *pos = ll_pos(a);
	const uint32_t rowb = a.H * 2, S = (rowb + LL_SLICE - 1) / LL_SLICE;
	const uint32_t lane = threadIdx.x & 31;
	// fp8 casts need whole groups (H % 128, UE8M0 H % 512: the caller's)
	const uint32_t fp8 = a.fp8;
	const uint64_t nw = (uint64_t)gridDim.x * (blockDim.x / 32);
	for (uint64_t it = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
	     it < (uint64_t)T * S; it += nw) {
		const uint32_t t = (uint32_t)(it / S), sl = (uint32_t)(it % S);
		const uint32_t o = sl * LL_SLICE;
		const uint32_t bytes = rowb - o < LL_SLICE ? rowb - o : LL_SLICE;
		uint4 v[LL_U];
		ll_load((const uint8_t *)a.x + (uint64_t)t * rowb + o, bytes,
			lane, v);
		uint2 q[LL_U];
		uint32_t sw = 0;
		if (fp8) // once per slice, for every k
			sw = ll_quant(v, bytes, lane, fp8, q);
		for (uint32_t kb = 0; kb < a.K; kb += 32) {
			// one load of the (t, k)'s places for the warp, then
			// broadcast: no round trip per k
			int32_t ek = -1, pk = 0;
			if (kb + lane < a.K) {
				ek = __ldcg(key + t * a.K + kb + lane);
				pk = __ldcg(pos + t * a.K + kb + lane);
			}
			const uint32_t nk = min(32u, a.K - kb);
			for (uint32_t k = 0; k < nk; k++) {
				const int32_t e = __shfl_sync(0xffffffffu, ek, k);
				const int32_t p = __shfl_sync(0xffffffffu, pk, k);
				if (e < 0)
					continue;
				const uint32_t gp = off[e] + (uint32_t)p;
				if (gp >= WN) {
					if (lane == 0 && sl == 0)
						ll_fail(a, EKC_LL_ETOOBIG);
					continue;
				}
				const uint32_t d = e / a.El, el = e % a.El;
				if (!(P >> d & 1))
					continue; // masked (shrink)
				const uint64_t row = (uint64_t)el * WN + gp;
				ll_put_slice(ll_pub(a, d, a.L.rx[b]),
					     (uint32_t *)ll_pub(a, d, a.L.sc[b]),
					     el, gp, WN, a.H, o, bytes, lane, fp8,
					     v, q, sw);
				if (sl == 0 && lane == 0)
					((int32_t *)ll_pub(a, d, a.L.tk[b]))[row] =
						(int32_t)(t * a.K + kb + k);
			}
		}
	}
}

extern "C" __global__ void __launch_bounds__(LL_TPB, 2)
ekc_ll_dispatch(const struct ekc_ll_args a, uint32_t with_recv)
{
	ll_prior();
	__shared__ uint32_t off[EKC_LL_MAXE];
	const uint64_t t0 = now_ns();
	ll_stamp(a, EKC_LL_TR_D_START);
	ll_stamp_max(a, EKC_LL_TR_D_MAXSTART);
	uint32_t *pv = ll_priv(a);
	const uint32_t seq = *(volatile uint32_t *)(pv + EKC_LL_PRIV_DSEQ) + 1;
	const uint32_t par = seq & 1;
	uint32_t T = a.T, over = 0;
	if (T > a.N) {
		T = 0; // take part with no rows: every rank still finishes,
		over = LL_OVER; // and every rank learns (below)
	}
	// A poisoned rank sends no counts: its marked flags fail every peer
	// at once (they wait for nothing from it).
	const bool bad0 = ll_poisoned(a);
	// shrink: the ranks masked now are neither sent to nor waited for
	const uint64_t m0 = ll_mask_now(a) & ~(1ull << a.rank);
	if (blockIdx.x == 0 && !bad0)
		ll_plan(a, T, over, seq, par, off, ~m0);
	if (blockIdx.x == 0 && bad0) {
		if (threadIdx.x == 0)
			ll_fail(a, EKC_LL_EPOISONED);
		if (a.shrink)
			ll_post_cnt(a, seq, true, ~m0);
		else
			ll_post(a, a.L.cflag, seq, true, ~m0);
	}
	ll_stamp(a, EKC_LL_TR_D_PLAN);
	// Every source's counts (this rank's own, from block 0, included):
	// W threads spin on the sources' flags, the rest wait at the barrier.
	const uint64_t *cflag = (const uint64_t *)ll_pub(a, a.rank, a.L.cflag);
	// a failed wait (this rank now poisoned): no rows; the done flags
	// below carry the mark. P: the sources present (shrink: all but the
	// absent ones; else all)
	bool ok;
	const uint64_t P = ll_wait_set(a, cflag, seq, t0, bad0, EKC_LL_W_CNT,
				       ll_all(a) & ~m0, &ok);
	if (ok)
		ll_dispatch_rows(a, seq, par, T, off, P);
	ll_stamp(a, EKC_LL_TR_D_COPY);
	if (a.stall_ms) // a test's fault: rows written, done flags late
		while (now_ns() - t0 < (uint64_t)a.stall_ms * 1000000u)
			;
	if (ll_last_block(a, EKC_LL_PRIV_DCTR)) {
		// shrink: the present set travels before the done flag, for
		// each receiver to compare with its own
		if (a.shrink && ok) {
			for (uint32_t d = threadIdx.x; d < a.W; d += blockDim.x)
				if (P >> d & 1)
					ll_st64(a, (uint64_t *)ll_pub(
							   a, d, a.L.pset[a.buf]) +
							   a.rank,
						P);
			ll_fence(a);
			__syncthreads();
		}
		ll_post(a, a.L.done, seq, ll_poisoned(a), ok ? P : ~m0);
		if (threadIdx.x == 0) {
			pv[EKC_LL_PRIV_DSEQ] = seq;
			if (a.trace)
				((uint64_t *)a.trace)[EKC_LL_TR_D_FLAGS] = now_ns();
		}
	}
	if (with_recv) {
		ll_dispatch_recv(a, seq, t0, P);
		ll_stamp(a, EKC_LL_TR_D_END);
	}
	ll_stamp_max(a, EKC_LL_TR_D_MAXEND);
}

extern "C" __global__ void __launch_bounds__(LL_TPB, 2)
ekc_ll_dispatch_recv(const struct ekc_ll_args a)
{
	ll_prior();
	const uint64_t t0 = now_ns();
	// the send part's present set (its kernel is done: stream order)
	const uint64_t P =
		a.shrink ? __ldcg((const unsigned long long *)(ll_priv(a) +
							       EKC_LL_PRIV_PSET) +
				  a.buf)
			 : ll_all(a);
	ll_dispatch_recv(a, __ldcg(ll_priv(a) + EKC_LL_PRIV_BSEQ + a.buf), t0,
			 P);
	ll_stamp(a, EKC_LL_TR_D_END);
}
