/* SPDX-License-Identifier: MIT */
/*
 * The low-latency mode's host arithmetic (kernels/host/ek_ll.c) against
 * tests/lib/ref.c, every input where that is possible:
 *  - the e4m3 rounding of every bf16 value (65,536, NaN and infinities
 *    included), through ek_ll_cast with rounded scales and a row whose
 *    amax is 448, where the multiplier is exactly 1; NaNs in a row,
 *    signaling ones too, do not take part in its amax (as on the GPU:
 *    C's fmaxf would make a signaling NaN the amax);
 *  - the scales of every mode for rows scaled over the whole exponent
 *    range (amax from 2^-30 to 2^30, and the 1e-4 floor);
 *  - the bf16 rounding of ek_ll_round for every bf16 value plus each of
 *    the 2^16 low halves at a few high halves, and NaNs of any payload;
 *  - ek_ll_acc's products rounded before the add (a sum where a fused
 *    multiply-add would differ).
 */
#include "harness.h"
#include "ref.h"

#include <math.h>
#include <string.h>

#include "ek.h"

int main(void)
{
	th_init("test_ek_ll", 120);
	/* e4m3 of every bf16: element 0 is 448 (amax), the multiplier 1 */
	uint16_t row[128];
	uint8_t q[128];
	uint32_t sb[1];
	long checked = 0;
	uint32_t v = 0;
	while (v < 65536) {
		/* the next 127 bf16 values within +-448 (or NaN) */
		int n = 1;
		row[0] = 0x43e0; /* 448 */
		for (; n < 128 && v < 65536; v++) {
			float x = ref_f32((uint16_t)v);
			if (isnan(x) || fabsf(x) <= 448.0f)
				row[n++] = (uint16_t)v;
		}
		for (int c = n; c < 128; c++)
			row[c] = 0;
		ek_ll_cast(row, 128, EK_LL_FP8_ROUND, q, sb);
		TH_CHECK(sb[0] == ref_bits(1.0f),
			 "scale %08x for amax 448 (values up to bf16 %04x, "
			 "row %04x %04x %04x)",
			 sb[0], v, row[0], row[1], row[2]);
		TH_CHECK(q[0] == 0x7e, "448 -> %02x", q[0]);
		for (int c = 1; c < n; c++) {
			float x = ref_f32(row[c]);
			TH_CHECK(q[c] == ref_e4m3(x),
				 "bf16 %04x (%g): e4m3 %02x, want %02x", row[c],
				 (double)x, q[c], ref_e4m3(x));
			checked++;
		}
	}
	/* every finite bf16 above 448 is its row's amax and goes to +-448 */
	for (uint32_t b = 0x43e1; b <= 0x7f7f; b++) {
		row[0] = (uint16_t)b;
		row[1] = (uint16_t)(b | 0x8000);
		for (int c = 2; c < 128; c++)
			row[c] = 0;
		/* amax = v: the multiplier is 448/v, so v goes to 448 */
		ek_ll_cast(row, 128, EK_LL_FP8, q, sb);
		TH_CHECK(q[0] == 0x7e && q[1] == 0xfe,
			 "bf16 %04x: %02x %02x, want 7e fe", b, q[0], q[1]);
	}
	/* an infinite amax: the scale is infinite, the multiplier 0, so the
	 * infinities become NaN and the rest 0 (the GPU's same steps) */
	row[0] = 0x7f80;
	row[1] = 0xff80;
	row[2] = 0x3f80;
	ek_ll_cast(row, 128, EK_LL_FP8, q, sb);
	TH_CHECK(sb[0] == 0x7f800000u && q[0] == 0x7f && q[1] == 0x7f &&
			 q[2] == 0x00,
		 "an infinite row: scale %08x, %02x %02x %02x", sb[0], q[0],
		 q[1], q[2]);
	printf("ok: e4m3 of %ld bf16 values (NaNs quiet and signaling, "
	       "subnormals, ties) equal to the reference; larger ones are "
	       "their row's amax and go to 448; an infinite amax gives NaN\n",
	       checked);

	/* the scales of each mode over the exponent range */
	uint64_t s = 99;
	for (int e = -30; e <= 30; e++)
		for (int mode = EK_LL_FP8; mode <= EK_LL_FP8_UE8M0; mode++) {
			for (int c = 0; c < 128; c++) {
				s = s * 6364136223846793005ull + 1442695040888963407ull;
				row[c] = ref_bf16(ldexpf((float)(s >> 40) /
							 (float)(1 << 24),
						 e));
			}
			ek_ll_cast(row, 128, mode, q, sb);
			float amax = 1e-4f;
			for (int c = 0; c < 128; c++)
				if (fabsf(ref_f32(row[c])) > amax)
					amax = fabsf(ref_f32(row[c]));
			volatile float scale = amax * (float)(1.0 / 448.0);
			float want = scale;
			if (mode != EK_LL_FP8) {
				int ex;
				float m = frexpf(scale, &ex); /* [0.5, 1) */
				want = m == 0.5f ? scale : ldexpf(1.0f, ex);
			}
			TH_CHECK(sb[0] == ref_bits(want),
				 "2^%d, mode %d: scale %08x, want %08x", e,
				 mode, sb[0], ref_bits(want));
			volatile float mul = mode == EK_LL_FP8 ? 448.0f / amax
							       : 1.0f / want;
			for (int c = 0; c < 128; c++) {
				volatile float x = ref_f32(row[c]) * mul;
				TH_CHECK(q[c] == ref_e4m3(x),
					 "2^%d, mode %d, channel %d: %02x, want "
					 "%02x",
					 e, mode, c, q[c], ref_e4m3(x));
			}
		}
	printf("ok: fp32, rounded and UE8M0-mode scales and values from 2^-30 "
	       "to 2^30 (and the 1e-4 floor) equal to the reference\n");

	/* bf16 rounding: every low half under a few high halves, NaNs */
	static const uint32_t hi[] = {0x0000, 0x3f80, 0x3f81, 0x7f7f, 0x8000,
				      0xc2fe, 0x7f80, 0xff80, 0x7fc0, 0x0001};
	float acc[1024];
	uint16_t out[1024];
	for (size_t h = 0; h < sizeof(hi) / sizeof(hi[0]); h++)
		for (uint32_t lo = 0; lo < 65536; lo += 1024) {
			for (int i = 0; i < 1024; i++)
				acc[i] = ref_float(hi[h] << 16 | (lo + (uint32_t)i));
			ek_ll_round(acc, out, 1024);
			for (int i = 0; i < 1024; i++)
				TH_CHECK(out[i] == ref_bf16(acc[i]),
					 "%08x -> %04x, want %04x",
					 ref_bits(acc[i]), out[i], ref_bf16(acc[i]));
		}
	printf("ok: bf16 rounding of 655,360 floats (ties, carries into the "
	       "exponent, infinities, NaNs of any payload) equal to the "
	       "reference\n");

	/* products rounded before the add: x = 1 + 2^-7, w = 1 + 2^-23,
	 * x * w = 1 + 2^-7 + 2^-23 + 2^-30, which fp32 rounds to drop the
	 * 2^-30; acc = -(1 + 2^-7 + 2^-23): the rounded product cancels it
	 * to 0, a fused multiply-add leaves 2^-30 */
	uint16_t x17 = 0x3f81; /* 1 + 2^-7 */
	const float w = 1.0f + ldexpf(1.0f, -23);
	acc[0] = -(1.0f + ldexpf(1.0f, -7) + ldexpf(1.0f, -23));
	const float fused = fmaf(ref_f32(x17), w, acc[0]);
	ek_ll_acc(acc, &x17, w, 1);
	TH_CHECK(acc[0] == 0.0f && fused == ldexpf(1.0f, -30),
		 "acc %a (want 0), fused %a (want 2^-30)", (double)acc[0],
		 (double)fused);
	printf("ok: each product rounded before its add (not fused)\n");
	return 0;
}
