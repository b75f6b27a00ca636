// SPDX-License-Identifier: MIT
// Device helpers every kernel file of the fatbin uses: the GPU's clock,
// relaxed loads and fences at system scope, bf16 <-> fp32. Each .cu file
// includes what it needs, so none depends on the order ekc_all.cu
// includes them in.
#ifndef EKC_DEV_CUH
#define EKC_DEV_CUH

#include <stdint.h>

#include "ekc.h"

__device__ static inline uint64_t now_ns(void)
{
	uint64_t t;
	asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
	return t;
}

__device__ static inline uint32_t ld_relaxed(const uint32_t *p)
{
	uint32_t v;
	asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
	return v;
}

__device__ static inline void fence_acquire(void)
{
	asm volatile("fence.acq_rel.sys;" ::: "memory");
}

__device__ static inline float bf16_f32(uint32_t bits16)
{
	return __uint_as_float(bits16 << 16);
}

// Two fp32 values rounded to bf16 (nearest even) and packed, lo in the
// low half: one cvt.rn.bf16x2.f32. Every NaN becomes the canonical NaN
// 0x7fff, which the host backend's rounding writes too (ek_host.c); a
// rounding by hand took some eight instructions a value, a third of the
// combine's issue slots.
__device__ static inline uint32_t bf16x2_rn(float lo, float hi)
{
	uint32_t r;
	asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
	return r;
}

// Eight fp32 sums, each rounded once to bf16, as one 16-byte vector.
__device__ static inline uint4 pack_bf16x8(const float acc[8])
{
	uint4 o;
	o.x = bf16x2_rn(acc[0], acc[1]);
	o.y = bf16x2_rn(acc[2], acc[3]);
	o.z = bf16x2_rn(acc[4], acc[5]);
	o.w = bf16x2_rn(acc[6], acc[7]);
	return o;
}

// acc += the eight bf16 of q, in fp32 (a bf16 pair to fp32: the low half
// shifted up, the high half masked; both exact).
__device__ static inline void add_bf16x8(float acc[8], uint4 q)
{
	const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
	for (int i = 0; i < 4; i++) {
		acc[2 * i] = __fadd_rn(acc[2 * i], __uint_as_float(w[i] << 16));
		acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1],
					   __uint_as_float(w[i] & 0xffff0000u));
	}
}

// acc = the eight bf16 of q: a sum's start (the bias), exact.
__device__ static inline void set_bf16x8(float acc[8], uint4 q)
{
	const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
	for (int i = 0; i < 4; i++) {
		acc[2 * i] = __uint_as_float(w[i] << 16);
		acc[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
	}
}

// Bulk copies (the copy engine, TMA): a shared-memory address, a load
// into shared memory completing on an mbarrier, the barrier's expected
// bytes and wait, a store from shared memory.
__device__ static inline uint32_t smem_addr(const void *p)
{
	return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ static inline void tma_load(uint32_t dst, const void *src,
				       uint32_t bytes, uint32_t bar)
{
	asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::"
		     "complete_tx::bytes [%0], [%1], %2, [%3];"
		     ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
		     : "memory");
}

// This thread's arrival on the mbarrier at bar, which then also waits for
// bytes more of bulk copies.
__device__ static inline void mb_expect(uint32_t bar, uint32_t bytes)
{
	asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
		     ::"r"(bar), "r"(bytes)
		     : "memory");
}

__device__ static inline void tma_wait(uint32_t bar, uint32_t parity)
{
	uint32_t ok;
	do {
		asm volatile("{ .reg .pred p;\n"
			     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], "
			     "%2;\n"
			     "selp.u32 %0, 1, 0, p; }"
			     : "=r"(ok)
			     : "r"(bar), "r"(parity)
			     : "memory");
	} while (!ok);
}

__device__ static inline void tma_store(void *dst, uint32_t src,
					uint32_t bytes)
{
	asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], "
		     "%2;" ::"l"(dst),
		     "r"(src), "r"(bytes)
		     : "memory");
}

#endif
