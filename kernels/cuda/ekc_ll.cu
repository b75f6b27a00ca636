// SPDX-License-Identifier: MIT
// Low-latency (decode) dispatch and combine: kernels on the rank's own
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
// sequence numbers that tag the flags are the device's own.
//   ekc_ll_combine         each received row back to its home's (t, k)
//                          slot, done flags; with_recv: the sum below
//   ekc_ll_combine_recv    wait for every source, sum top-k rows
//   ekc_ll_combine_pull    zero copy: the experts' rows stay in their
//                          ranks' cx; each home, once every rank said its
//                          rows are written, reads its (t, k) rows there
//                          and sums them (one read of each row, no copy)
//
// Every peer-written value that steers a write (counts, (t, k)) is bounds-
// checked where it is used; errors set bits in the private err word, never
// trap; every wait ends after timeout_ns, or at once when the daemon
// releases the group (a rank left it) or a peer's flag carries the poison
// mark. Such a failure poisons the rank for good (ekc.h, EKC_LL_EFATAL):
// its later ops only put the mark on their flags, so every rank of the
// group fails within one op and none reads rows placed out of step.
//
#include "ekc_dev.cuh"

#define LL_TPB EKC_LL_TPB
#define LL_U 4 // 16-byte vectors per lane per slice
#define LL_SLICE (32 * 16 * LL_U) // bytes of a row per work item

// Flags, and the fences around them, at the scope the ranks share: the
// GPU when every rank runs on this one (a.gpu_scope), else the system.
__device__ static inline uint64_t ll_ld64(const struct ekc_ll_args &a,
					  const uint64_t *p)
{
	uint64_t v;
	if (a.gpu_scope)
		asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];"
			     : "=l"(v) : "l"(p));
	else
		asm volatile("ld.relaxed.sys.global.u64 %0, [%1];"
			     : "=l"(v) : "l"(p));
	return v;
}

__device__ static inline void ll_st64(const struct ekc_ll_args &a,
				      uint64_t *p, uint64_t v)
{
	if (a.gpu_scope)
		asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p),
			     "l"(v) : "memory");
	else
		asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p),
			     "l"(v) : "memory");
}

__device__ static inline void ll_fence(const struct ekc_ll_args &a)
{
	if (a.gpu_scope)
		asm volatile("fence.acq_rel.gpu;" ::: "memory");
	else
		asm volatile("fence.acq_rel.sys;" ::: "memory");
}

__device__ static inline uint32_t *ll_priv(const struct ekc_ll_args &a)
{
	return (uint32_t *)a.priv;
}

// Buffer b's tables: this rank's (t, k) experts, their places, this
// rank's first row at each expert, each source's rows per local expert.
__device__ static inline int32_t *ll_key(const struct ekc_ll_args &a)
{
	return (int32_t *)(a.priv + a.L.tab[a.buf]);
}

__device__ static inline int32_t *ll_pos(const struct ekc_ll_args &a)
{
	return ll_key(a) + (uint64_t)a.N * a.K;
}

__device__ static inline uint32_t *ll_off(const struct ekc_ll_args &a)
{
	return (uint32_t *)ll_pos(a) + (uint64_t)a.N * a.K;
}

__device__ static inline uint32_t *ll_rows_tab(const struct ekc_ll_args &a)
{
	return ll_off(a) + (uint64_t)a.El * a.W;
}

// An error bit for the host; a fatal one (EKC_LL_EFATAL) poisons the
// rank's state for good. The host mirror (a.herr) gets the fatal and
// poisoned bits, so the host learns of the mode's end without a copy.
// Only those: every store to it then carries one, so whichever of two
// racing threads' stores lands last (plain stores: host memory has no
// atomics over PCIe), the host still sees the end; the other bits wait
// for ep_ll_error's read of the device word.
__device__ static inline void ll_fail(const struct ekc_ll_args &a, uint32_t bit)
{
	const uint32_t o = atomicOr(ll_priv(a) + EKC_LL_PRIV_ERR, bit);
	if (bit & EKC_LL_EFATAL)
		atomicExch(ll_priv(a) + EKC_LL_PRIV_POISON, 1u);
	if (a.herr && (bit & (EKC_LL_EFATAL | EKC_LL_EPOISONED)) && !(o & bit))
		asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(a.herr),
			     "r"(o | bit) : "memory");
}

// Is the rank poisoned? Called by every thread of the block (a barrier):
// the same answer in each, even while another block sets the word.
__device__ static inline bool ll_poisoned(const struct ekc_ll_args &a)
{
	return __syncthreads_or(
		*(volatile uint32_t *)(ll_priv(a) + EKC_LL_PRIV_POISON) != 0);
}


// Raised by the daemon (host memory) when the group failed: a rank left.
__device__ static inline bool ll_released(const struct ekc_ll_args &a)
{
	uint32_t v = 0;
	if (a.released)
		asm volatile("ld.relaxed.sys.global.u32 %0, [%1];"
			     : "=r"(v) : "l"(a.released));
	return v != 0;
}

// Launched with programmatic dependent launch (the caller's choice), a
// kernel's blocks may be resident before the work ahead of it on the
// stream is done: wait for it here, first of all. Without it a no-op.
__device__ static inline void ll_prior(void)
{
	asm volatile("griddepcontrol.wait;" ::: "memory");
}

// The trace (EKC_LL_TR_*): thread 0 of block 0 stamps a stage; every
// block raises the latest start and end.
__device__ static inline void ll_stamp(const struct ekc_ll_args &a, int i)
{
	if (a.trace && blockIdx.x == 0 && threadIdx.x == 0)
		((uint64_t *)a.trace)[i] = now_ns();
}

__device__ static inline void ll_stamp_max(const struct ekc_ll_args &a, int i)
{
	if (a.trace && threadIdx.x == 0)
		atomicMax((unsigned long long *)a.trace + i,
			  (unsigned long long)now_ns());
}

// Wait until the flag is tag or a later sequence number. False (and the
// rank poisoned) when the flag carries a poisoned peer's mark, the daemon
// released the group, or the timeout passed.
__device__ static bool ll_wait_tag(const struct ekc_ll_args &a,
				   const uint64_t *p, uint32_t tag, uint64_t t0)
{
	for (uint32_t spins = 0;; spins++) {
		const uint64_t v = ll_ld64(a, p);
		if ((uint32_t)(v >> 32) == EKC_LL_MARK) {
			ll_fail(a, EKC_LL_EPEERFAIL);
			return false;
		}
		if ((int32_t)((uint32_t)v - tag) >= 0) {
			ll_fence(a);
			return true;
		}
		if ((spins & 63) != 63)
			continue;
		// the released word is host memory: read over PCIe, so every
		// 1,024 polls (some 0.5 ms) per waiting thread, not every 64
		if ((spins & 1023) == 1023 && ll_released(a)) {
			ll_fail(a, EKC_LL_ERELEASED);
			return false;
		}
		if (now_ns() - t0 > a.timeout_ns) {
			ll_fail(a, EKC_LL_ETIMEDOUT);
			return false;
		}
	}
}

// Every rank's flag p[s] at seq, by the block's first W threads (the
// rest wait at the barrier): true in every thread once all came; false if
// one did not (the rank is poisoned now) or the rank was poisoned already
// (bad: nothing is waited for).
__device__ static bool ll_wait_all(const struct ekc_ll_args &a,
				   const uint64_t *p, uint32_t seq, uint64_t t0,
				   bool bad)
{
	int ok = !bad;
	for (uint32_t s = threadIdx.x; s < a.W && !bad; s += blockDim.x)
		ok &= ll_wait_tag(a, p + s, seq, t0);
	return __syncthreads_and(ok);
}

__device__ static inline uint8_t *ll_pub(const struct ekc_ll_args &a,
					 uint32_t d, uint64_t off)
{
	return (uint8_t *)a.peer[d] + off;
}

// ---- shrink mode (ekc.h): the present set of each wait ----

__device__ static inline uint64_t ll_all(const struct ekc_ll_args &a)
{
	return a.W >= 64 ? ~0ull : (1ull << a.W) - 1;
}

// Is rank d masked (its private mask word, written by other blocks and
// the host's stream ops)?
__device__ static inline bool ll_masked(const struct ekc_ll_args &a,
					uint32_t d)
{
	return *(volatile uint32_t *)(ll_priv(a) + EKC_LL_PRIV_MASK + d) != 0;
}

// The ranks this rank has masked now (all zero outside shrink mode).
__device__ static inline uint64_t ll_mask_now(const struct ekc_ll_args &a)
{
	uint64_t m = 0;
	if (!a.shrink)
		return 0;
	for (uint32_t d = 0; d < a.W; d++)
		m |= (uint64_t)ll_masked(a, d) << d;
	return m;
}

// Wait `kind`'s decision word of source s (ekc.h: seq << 1 | absent).
__device__ static inline unsigned long long *
ll_dec(const struct ekc_ll_args &a, uint32_t kind, uint32_t s)
{
	return (unsigned long long *)(ll_priv(a) + EKC_LL_PRIV_DEC) +
	       kind * EKC_LL_MAXW + s;
}

// Wait `kind` of op seq decides source s: absent or present, once for
// every block of the grid (the first decision wins); the answer is the
// decision made. An absent source is masked for the ops after.
__device__ static bool ll_decide(const struct ekc_ll_args &a, uint32_t kind,
				 uint32_t s, uint32_t seq, bool absent)
{
	unsigned long long *w = ll_dec(a, kind, s);
	const unsigned long long want = (unsigned long long)seq << 1 | absent;
	unsigned long long old = *(volatile unsigned long long *)w;
	for (;;) {
		if ((old >> 1) == seq) {
			absent = old & 1;
			break;
		}
		const unsigned long long prev = atomicCAS(w, old, want);
		if (prev == old)
			break;
		old = prev;
	}
	if (absent)
		atomicExch(ll_priv(a) + EKC_LL_PRIV_MASK + s, 1u);
	return absent;
}

// Has wait `kind` of op seq found s absent already (another block)?
__device__ static inline bool ll_decided_absent(const struct ekc_ll_args &a,
						uint32_t kind, uint32_t s,
						uint32_t seq)
{
	const unsigned long long v =
		*(volatile unsigned long long *)ll_dec(a, kind, s);
	return v == ((unsigned long long)seq << 1 | 1);
}

__device__ static inline uint64_t ll_cas64(const struct ekc_ll_args &a,
					   uint64_t *p, uint64_t cmp,
					   uint64_t val)
{
	uint64_t old;
	if (a.gpu_scope)
		asm volatile("atom.relaxed.gpu.global.cas.b64 %0, [%1], %2, %3;"
			     : "=l"(old) : "l"(p), "l"(cmp), "l"(val) : "memory");
	else
		asm volatile("atom.relaxed.sys.global.cas.b64 %0, [%1], %2, %3;"
			     : "=l"(old) : "l"(p), "l"(cmp), "l"(val) : "memory");
	return old;
}

// Shrink mode's wait for source s's flag p[s] at seq: true once it came,
// false once s is absent (masked already, decided absent by another
// block, gone from the group, its flags marked, or past the timeout).
// *fatal: the daemon released the group without naming a rank that left,
// or named this rank.
//
// The counts' wait (EKC_LL_W_CNT) gives s up only by swapping its flag
// here for the EKC_LL_OUT mark while its counts have not come: s posts
// that flag by a compare-and-swap that fails on the mark (ll_post_cnt),
// so either s learns that it was given up and sends this rank nothing,
// or its counts came first and this rank takes its rows. A rank late
// past the timeout never writes rows where this rank no longer expects
// them. Its counts landed, then it failed: its rows stay a hole (below).
__device__ static bool ll_wait_one(const struct ekc_ll_args &a,
				   const uint64_t *p, uint32_t s, uint32_t seq,
				   uint64_t t0, uint32_t kind, bool *fatal)
{
	bool give_up = ll_masked(a, s);
	for (uint32_t spins = 0;; spins++) {
		const uint64_t v = ll_ld64(a, p + s);
		const uint32_t hi = (uint32_t)(v >> 32);
		if (hi == EKC_LL_MARK || hi == EKC_LL_OUT) // poisoned; given up
			return !ll_decide(a, kind, s, seq, true);
		if ((int32_t)((uint32_t)v - seq) >= 0) {
			ll_fence(a);
			if (kind == EKC_LL_W_CNT) {
				// did s give this rank up (ll_post_cnt)?
				volatile uint32_t *pv = ll_priv(a);
				while (pv[EKC_LL_PRIV_ABNSEQ] != seq)
					;
				ll_fence(a);
				const uint64_t out = *(volatile unsigned long long *)(
					pv + EKC_LL_PRIV_ABN);
				if (out >> s & 1)
					return !ll_decide(a, kind, s, seq, true);
			}
			return !ll_decide(a, kind, s, seq, false);
		}
		if (give_up) {
			if (kind != EKC_LL_W_CNT)
				return !ll_decide(a, kind, s, seq, true);
			if (ll_cas64(a, (uint64_t *)(p + s), v,
				     (uint64_t)EKC_LL_OUT << 32 | seq) == v)
				return !ll_decide(a, kind, s, seq, true);
			continue; // s posted meanwhile: look again
		}
		if ((spins & 63) != 63)
			continue;
		if (ll_decided_absent(a, kind, s, seq))
			give_up = true;
		if ((spins & 1023) == 1023 && ll_released(a)) {
			uint64_t gone = 0;
			if (a.gone)
				asm volatile("ld.relaxed.sys.global.u64 %0, [%1];"
					     : "=l"(gone) : "l"(a.gone));
			// released for another reason, or this rank itself
			// left (its peers go on without it)
			if (!gone || (gone >> a.rank & 1)) {
				*fatal = true;
				return false;
			}
			if (gone >> s & 1)
				give_up = true;
		}
		if (now_ns() - t0 > a.timeout_ns)
			give_up = true;
	}
}

// Shrink mode's counts flag of dispatch seq (bad: with the poison mark)
// to every rank in `to`, each by a compare-and-swap that fails on the
// EKC_LL_OUT mark (ll_wait_one): then that rank gave this one up, and it
// is published, with seq, in the private words EKC_LL_PRIV_ABN{,SEQ} for
// every block's wait. By the block's threads, one rank each.
__device__ static void ll_post_cnt(const struct ekc_ll_args &a, uint32_t seq,
				   bool bad, uint64_t to)
{
	__shared__ unsigned long long out;
	if (threadIdx.x == 0)
		out = 0;
	__syncthreads();
	const uint64_t val = (bad ? (uint64_t)EKC_LL_MARK << 32 : 0) | seq;
	for (uint32_t d = threadIdx.x; d < a.W; d += blockDim.x) {
		if (!(to >> d & 1))
			continue;
		uint64_t *f = (uint64_t *)ll_pub(a, d, a.L.cflag) + a.rank;
		uint64_t v = ll_ld64(a, f);
		for (;;) {
			if ((uint32_t)(v >> 32) == EKC_LL_OUT) {
				atomicOr(&out, 1ull << d);
				break;
			}
			const uint64_t o = ll_cas64(a, f, v, val);
			if (o == v)
				break;
			v = o;
		}
	}
	__syncthreads();
	if (threadIdx.x == 0) {
		uint32_t *pv = ll_priv(a);
		*(volatile unsigned long long *)(pv + EKC_LL_PRIV_ABN) = out;
		__threadfence();
		*(volatile uint32_t *)(pv + EKC_LL_PRIV_ABNSEQ) = seq;
	}
}

// Every rank's flag p[s] at seq, of the ranks in `want`, by the block's
// first W threads: the set of those that came, the same in every block of
// the grid. Outside shrink mode every rank is waited for and a failed
// wait poisons the rank (the set is then empty); in it an absent rank is
// masked and left out. *ok: false if the rank was poisoned already (bad:
// nothing is waited for) or is now.
__device__ static uint64_t ll_wait_set(const struct ekc_ll_args &a,
				       const uint64_t *p, uint32_t seq,
				       uint64_t t0, bool bad, uint32_t kind,
				       uint64_t want, bool *ok)
{
	__shared__ unsigned long long got;
	if (!a.shrink) {
		*ok = ll_wait_all(a, p, seq, t0, bad);
		return *ok ? ll_all(a) : 0;
	}
	if (threadIdx.x == 0)
		got = 0;
	__syncthreads();
	int fatal = 0;
	for (uint32_t s = threadIdx.x; s < a.W && !bad; s += blockDim.x) {
		bool f = false;
		if ((want >> s & 1) && ll_wait_one(a, p, s, seq, t0, kind, &f))
			atomicOr(&got, 1ull << s);
		fatal |= f;
	}
	if (__syncthreads_or(fatal)) {
		if (threadIdx.x == 0)
			ll_fail(a, EKC_LL_ERELEASED);
		*ok = false;
		return 0;
	}
	const uint64_t r = got;
	*ok = !bad;
	__syncthreads();
	return bad ? 0 : r;
}

// This rank's flag at seq in every rank's array of flags at off (the
// block's threads, one rank each), with the mark if bad (poisoned).
__device__ static inline void ll_post(const struct ekc_ll_args &a,
				      uint64_t off, uint32_t seq, bool bad,
				      uint64_t to = ~0ull)
{
	const uint64_t v = (bad ? (uint64_t)EKC_LL_MARK << 32 : 0) | seq;
	for (uint32_t d = threadIdx.x; d < a.W; d += blockDim.x)
		if (to >> d & 1)
			ll_st64(a, (uint64_t *)ll_pub(a, d, off) + a.rank, v);
}

// The calling block's arrival at the grid's counter; true in the last
// block to arrive (the counter is reset there for the next op).
__device__ static bool ll_last_block(const struct ekc_ll_args &a, int ctr)
{
	__shared__ uint32_t last;
	__syncthreads();
	if (threadIdx.x == 0) {
		ll_fence(a);
		uint32_t old = atomicAdd(ll_priv(a) + ctr, 1);
		last = old == gridDim.x - 1;
		if (last)
			ll_priv(a)[ctr] = 0;
	}
	__syncthreads();
	if (last)
		ll_fence(a);
	return last;
}

// The copy of one work item's slice: LL_U vectors per lane of the row at
// src, to each of n destinations.
__device__ static inline void ll_load(const uint8_t *src, uint32_t bytes,
				      uint32_t lane, uint4 v[LL_U])
{
#pragma unroll
	for (int u = 0; u < LL_U; u++) {
		uint32_t o = (u * 32 + lane) * 16;
		if (o < bytes)
			v[u] = *(const uint4 *)(src + o);
	}
}

// The same from memory peers write (L2, never a stale L1 line).
__device__ static inline void ll_load_cg(const uint8_t *src, uint32_t bytes,
					 uint32_t lane, uint4 v[LL_U])
{
#pragma unroll
	for (int u = 0; u < LL_U; u++) {
		uint32_t o = (u * 32 + lane) * 16;
		if (o < bytes)
			v[u] = __ldcg((const uint4 *)(src + o));
	}
}

// A count word: seq << 32 | LL_OVER (the source had more tokens than N:
// every rank raises ETOOBIG) | rows.
#define LL_OVER 0x80000000u

// The stores of a slice (the bf16 bytes of its row, as ll_load read
// them): V = uint4 stores the 16-byte vectors as they are, V = uint2 the
// 8 bytes each cast to fp8, at half the offset.
template <typename V>
__device__ static inline void ll_store(uint8_t *dst, uint32_t bytes,
				       uint32_t lane, const V v[LL_U])
{
#pragma unroll
	for (int u = 0; u < LL_U; u++) {
		uint32_t o = (u * 32 + lane) * 16;
		if (o < bytes)
			*(V *)(dst + o / (16 / sizeof(V))) = v[u];
	}
}

// The cast of one work item's slice to fp8 (a.fp8, ekc.h): lanes 0-15 of
// vector u hold group 2u of the slice, lanes 16-31 group 2u + 1 (a group
// is 128 channels: 16 vectors of 8). q: each lane's 8 e4m3 per vector;
// word: lane j < groups holds group j's fp32 scale, or (UE8M0) lane
// i < groups / 4 the exponent bytes of groups 4i .. 4i + 3.
__device__ static inline uint32_t ll_e4m3x2(float lo, float hi)
{
	uint16_t r;
	asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;"
	    : "=h"(r) : "f"(hi), "f"(lo));
	return r;
}

__device__ static inline uint32_t ll_quant(const uint4 v[LL_U],
					   uint32_t bytes, uint32_t lane,
					   uint32_t mode, uint2 q[LL_U])
{
	uint32_t mine = 0;
#pragma unroll
	for (int u = 0; u < LL_U; u++) {
		const bool ok = (u * 32 + lane) * 16 < bytes;
		const uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
		float f[8], amax = 0.0f;
#pragma unroll
		for (int c = 0; c < 8; c++) {
			f[c] = ok ? bf16_f32((w[c / 2] >> (16 * (c & 1))) &
					     0xffffu)
				  : 0.0f;
			amax = fmaxf(amax, fabsf(f[c]));
		}
#pragma unroll
		for (int m = 8; m; m >>= 1)
			amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
		amax = fmaxf(amax, 1e-4f);
		float scale = __fmul_rn(amax, (float)(1.0 / 448.0)), mul;
		if (mode == EKC_LL_FP8) {
			mul = __fdiv_rn(448.0f, amax); // DeepEP's multiplier
		} else { // up to a power of two: its inverse is exact
			uint32_t sb = __float_as_uint(scale);
			if (sb & 0x7fffffu)
				sb = ((sb >> 23) + 1) << 23;
			scale = __uint_as_float(sb);
			mul = __frcp_rn(scale);
		}
		q[u].x = ll_e4m3x2(__fmul_rn(f[0], mul), __fmul_rn(f[1], mul)) |
			 ll_e4m3x2(__fmul_rn(f[2], mul), __fmul_rn(f[3], mul))
				 << 16;
		q[u].y = ll_e4m3x2(__fmul_rn(f[4], mul), __fmul_rn(f[5], mul)) |
			 ll_e4m3x2(__fmul_rn(f[6], mul), __fmul_rn(f[7], mul))
				 << 16;
		const uint32_t sb = __float_as_uint(scale);
		const uint32_t s0 = __shfl_sync(0xffffffffu, sb, 0);
		const uint32_t s1 = __shfl_sync(0xffffffffu, sb, 16);
		if (lane == 2 * u)
			mine = s0;
		else if (lane == 2 * u + 1)
			mine = s1;
	}
	if (mode != EKC_LL_FP8_UE8M0)
		return mine;
	const uint32_t e = (mine >> 23) & 0xffu;
	uint32_t word = 0;
#pragma unroll
	for (int j = 0; j < 4; j++)
		word |= __shfl_sync(0xffffffffu, e, (4 * lane + j) & 31) << (8 * j);
	return word;
}

// Slice o (bytes of its bf16 row) of a row, in place p of local expert el
// (row el * WN + p of rx): its bf16 vectors v, or (fp8) its e4m3 bytes q
// and the scale word sw of ll_quant, the scales column-major per local
// expert ([el][g][WN], what DeepGEMM's TMA reads).
__device__ static inline void ll_put_slice(uint8_t *rx, uint32_t *sc,
					   uint32_t el, uint32_t p,
					   uint32_t WN, uint32_t H, uint32_t o,
					   uint32_t bytes, uint32_t lane,
					   uint32_t fp8, const uint4 v[LL_U],
					   const uint2 q[LL_U], uint32_t sw)
{
	const uint64_t row = (uint64_t)el * WN + p;
	if (!fp8) {
		ll_store(rx + row * H * 2 + o, bytes, lane, v);
		return;
	}
	ll_store(rx + row * H + o / 2, bytes, lane, q);
	const uint32_t G = H / 128, g0 = o / 256, ng = bytes / 256;
	if (fp8 != EKC_LL_FP8_UE8M0) {
		if (lane < ng)
			sc[((uint64_t)el * G + g0 + lane) * WN + p] = sw;
	} else if (lane < ng / 4) {
		sc[((uint64_t)el * (G / 4) + g0 / 4 + lane) * WN + p] = sw;
	}
}

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

// acc += each bf16 of v times wk, in fp32, each product rounded (no fma).
__device__ static inline void ll_acc(float acc[LL_U][8], const uint4 v[LL_U],
				     float wk)
{
#pragma unroll
	for (int u = 0; u < LL_U; u++) {
		const uint32_t q[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
		for (int c = 0; c < 8; c++) {
			float f = bf16_f32((q[c / 2] >> (16 * (c & 1))) &
					   0xffffu);
			acc[u][c] = __fadd_rn(acc[u][c], __fmul_rn(f, wk));
		}
	}
}

// What a home's sum reads and writes: each (t, k)'s expert and place
// (key, pos [T*K] i32), weights [T, K] f32, out [T, H] bf16.
struct ll_sum_io {
	const int32_t *key, *pos;
	const float *w;
	uint8_t *out;
	uint32_t T, K, H;
};

__device__ static inline void ll_store_sum(const struct ll_sum_io &s,
					   uint32_t t, uint32_t o,
					   uint32_t bytes, uint32_t lane,
					   float acc[LL_U][8])
{
	uint4 r[LL_U];
#pragma unroll
	for (int u = 0; u < LL_U; u++)
		r[u] = pack_bf16x8(acc[u]);
	ll_store(s.out + (uint64_t)t * s.H * 2 + o, bytes, lane, r);
}

// The home's sum, by every warp of the grid: for each (token, slice)
// item, the token's rows row(i, e, p) (i = t * K + k, e its expert and p
// its place among this rank's rows there; NULL: skip it) in top-k order,
// each times its weight, in fp32 from +0.0, rounded once to bf16 into
// out. A (t, k) its dispatch skipped (e = -1) is left out.
//
// A warp loads LL_SUM_K rows of its item before it adds the first: their
// latencies overlap, and it keeps LL_SUM_K slices in flight. The adds stay
// in top-k order, so the sum is the same bit for bit. The two rows' 32
// registers and the sums' 32 take the combine kernels to 128 registers a
// thread, one block a SM (their __launch_bounds__): held to 64, the loop
// spilled, and at 2 KB slices a narrower one (1 KB, or 512 bytes with 8
// rows in flight) was as slow or slower (PERFORMANCE.md
// "Low-latency mode").
#define LL_SUM_K 2
template <typename Row>
__device__ static void ll_sum_rows(const struct ll_sum_io &s, Row row)
{
	const uint32_t T = s.T, K = s.K;
	const uint32_t rowb = s.H * 2, S = (rowb + LL_SLICE - 1) / LL_SLICE;
	const uint32_t lane = threadIdx.x & 31;
	const int32_t *key = s.key, *pos = s.pos;
	const float *w = s.w;
	const uint64_t nw = (uint64_t)gridDim.x * (blockDim.x / 32);
	for (uint64_t it = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
	     it < (uint64_t)T * S; it += nw) {
		const uint32_t t = (uint32_t)(it / S), sl = (uint32_t)(it % S);
		const uint32_t o = sl * LL_SLICE;
		const uint32_t bytes = rowb - o < LL_SLICE ? rowb - o : LL_SLICE;
		float acc[LL_U][8];
#pragma unroll
		for (int u = 0; u < LL_U; u++)
#pragma unroll
			for (int c = 0; c < 8; c++)
				acc[u][c] = 0.0f;
		for (uint32_t kb = 0; kb < K; kb += 32) {
			// one load of the (t, k)'s expert, place and weight for
			// the warp, then broadcast
			int32_t ek = -1, pk = 0;
			float wk = 0.0f;
			if (kb + lane < K) {
				const uint32_t i = t * K + kb + lane;
				ek = __ldcg(key + i);
				pk = __ldcg(pos + i);
				wk = w[i];
			}
			const uint32_t nk = min(32u, K - kb);
			for (uint32_t k0 = 0; k0 < nk; k0 += LL_SUM_K) {
				uint4 v[LL_SUM_K][LL_U];
				uint32_t got = 0; // the rows loaded, bit j
#pragma unroll
				for (int j = 0; j < LL_SUM_K; j++) {
					if (k0 + j >= nk)
						break; // (uniform)
					const int32_t e = __shfl_sync(
						0xffffffffu, ek, k0 + j);
					const int32_t p = __shfl_sync(
						0xffffffffu, pk, k0 + j);
					const uint8_t *r =
						e < 0 ? nullptr
						      : row(t * K + kb + k0 + j,
							    e, p);
					if (!r)
						continue;
					got |= 1u << j;
					ll_load_cg(r + o, bytes, lane, v[j]);
				}
#pragma unroll
				for (int j = 0; j < LL_SUM_K; j++) {
					if (!(got >> j & 1))
						continue;
					const float wt = __shfl_sync(
						0xffffffffu, wk, k0 + j);
					ll_acc(acc, v[j], wt);
				}
			}
		}
		ll_store_sum(s, t, o, bytes, lane, acc);
	}
}

// The sum of a low-latency combine (ll_sum_rows over its args).
template <typename Row>
__device__ static inline void ll_sum(const struct ekc_ll_args &a, Row row)
{
	const struct ll_sum_io s = {ll_key(a), ll_pos(a),
				    (const float *)a.weights, (uint8_t *)a.out,
				    a.T > a.N ? 0 : a.T, a.K, a.H};
	ll_sum_rows(s, row);
}

// A failed combine's output: NaN in every channel (each block writes all
// of it, so rows no block summed are NaN whatever the others did). A
// caller that never reads the error word (a graph replayed in a loop)
// must not take stale rows for a result.
__device__ static void ll_nan(void *out, uint32_t T, uint32_t H)
{
	const uint64_t n = (uint64_t)T * H / 2; // bf16 pairs (H % 8 == 0)
	uint32_t *o = (uint32_t *)out;
	for (uint64_t j = threadIdx.x; o && j < n; j += blockDim.x)
		o[j] = 0x7fc07fc0u;
}

__device__ static void ll_out_nan(const struct ekc_ll_args &a)
{
	ll_nan((void *)a.out, a.T > a.N ? 0 : a.T, a.H);
}

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
