/* SPDX-License-Identifier: MIT */
/*
 * The low-latency mode's row arithmetic for host ranks (libep's host
 * path, client/libep/libep_llhost.c): the fp8 cast of a dispatch and the
 * weighted sum of a combine, with every step the IEEE fp32 operation the
 * GPU's kernels (kernels/cuda/ekc_ll.cu) perform, so that both give the
 * same bits.
 */
#include "ek.h"

#include <math.h>
#include <string.h>

/* The products of ek_ll_acc must be rounded before the add: no
 * contraction into a fused multiply-add, whatever the target has. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

static inline float f32_of(uint32_t u)
{
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static inline uint32_t bits_of(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	return u;
}

static inline float bf16_f32(uint16_t v)
{
	return f32_of((uint32_t)v << 16);
}

/* fp32 to e4m3 (bias 7, no infinities, 0x7f the NaN), nearest even,
 * saturated at +-448 (the GPU's cvt.rn.satfinite). */
static uint8_t e4m3_of(float f)
{
	const uint32_t u = bits_of(f);
	const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
	const uint32_t a = u & 0x7fffffffu;
	if (a > 0x7f800000u)
		return 0x7f;
	if (a >= 0x43e00000u) /* 448 and up, infinity included */
		return sign | 0x7eu;
	const float m = f32_of(a);
	const int e = (int)(a >> 23) - 127;
	if (e < -6) /* subnormal range: steps of 2^-9; 8 steps is 2^-6 */
		return sign | (uint8_t)nearbyintf(ldexpf(m, 9));
	/* [2^e, 2^(e+1)): eight steps of 2^(e-3); a carry to 16 steps is
	 * the next binade's first value, which the code's sum gives */
	const uint32_t q = (uint32_t)nearbyintf(ldexpf(m, 3 - e));
	return sign | (uint8_t)(((uint32_t)(e + 7) << 3) + q - 8);
}

void ek_ll_cast(const uint16_t *x, uint32_t H, int mode, uint8_t *q,
		uint32_t *sb)
{
	const float inv448 = (float)(1.0 / 448.0);
	for (uint32_t g = 0; g < H / 128; g++) {
		const uint16_t *v = x + g * 128;
		/* NaNs are passed over, signaling ones too: the GPU's max
		 * does that, while C's fmaxf turns a signaling NaN into a
		 * quiet one, which would make amax NaN */
		float amax = 0.0f;
		for (int c = 0; c < 128; c++) {
			const float a = fabsf(bf16_f32(v[c]));
			if (a > amax)
				amax = a;
		}
		if (!(amax >= 1e-4f))
			amax = 1e-4f;
		float scale = amax * inv448, mul;
		if (mode == EK_LL_FP8) {
			mul = 448.0f / amax;
		} else { /* up to a power of two: its inverse is exact */
			uint32_t s = bits_of(scale);
			if (s & 0x7fffffu)
				s = ((s >> 23) + 1) << 23;
			scale = f32_of(s);
			mul = 1.0f / scale;
		}
		for (int c = 0; c < 128; c++)
			q[g * 128 + c] = e4m3_of(bf16_f32(v[c]) * mul);
		sb[g] = bits_of(scale);
	}
}

void ek_ll_acc(float *acc, const uint16_t *row, float w, uint32_t H)
{
	for (uint32_t i = 0; i < H; i++) {
		const float p = bf16_f32(row[i]) * w;
		acc[i] = acc[i] + p;
	}
}

void ek_ll_round(const float *acc, uint16_t *out, uint32_t H)
{
	for (uint32_t i = 0; i < H; i++) {
		const uint32_t u = bits_of(acc[i]);
		out[i] = (u & 0x7fffffffu) > 0x7f800000u
				 ? 0x7fffu
				 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
	}
}
