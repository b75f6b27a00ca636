// SPDX-License-Identifier: MIT
// The low-latency kernels' device helpers (ekc_ll.cu, ekc_ll_combine.cu,
// ekc_llx.cu): flags and the fences around them at the scope the ranks
// share, the waits on peers' flags (each ending at its timeout, at the
// group's release or at a poison mark; ekc_ll.cu's header says how a
// failure spreads), the rows' vector loads and stores, the cast to fp8
// with its scales, and the sum at home of each token's top-k rows (fp32
// from +0.0 in top-k order, each row times its weight, rounded once).
#ifndef EKC_LL_CUH
#define EKC_LL_CUH

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

#endif
