/* SPDX-License-Identifier: MIT */
/* The make-check driver of a fuzz target (without libFuzzer): iters
 * inputs, every k-th random bytes, the others a valid seed with a few bits
 * flipped and sometimes cut short. Deterministic (a fixed xorshift). */
#ifndef FUZZ_DRIVER_H
#define FUZZ_DRIVER_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint32_t fuzz_next(uint64_t *rng)
{
	*rng ^= *rng << 13;
	*rng ^= *rng >> 7;
	*rng ^= *rng << 17;
	return (uint32_t)*rng;
}

/* seeds: n pointers and lengths; buf of cap bytes (>= every seed). */
static void fuzz_drive(long iters, uint64_t rng, const uint8_t *const *seeds,
		       const size_t *len, int n, int random_every,
		       uint8_t *buf, size_t cap)
{
	for (long i = 0; i < iters; i++) {
		size_t sz;
		if (i % random_every == random_every - 1) {
			sz = fuzz_next(&rng) % cap;
			for (size_t k = 0; k < sz; k++)
				buf[k] = (uint8_t)fuzz_next(&rng);
		} else {
			int s = (int)(fuzz_next(&rng) % (uint32_t)n);
			sz = len[s];
			memcpy(buf, seeds[s], sz);
			int flips = 1 + (int)(fuzz_next(&rng) % 4);
			for (int f = 0; f < flips && sz; f++)
				buf[fuzz_next(&rng) % sz] ^=
					(uint8_t)(1u << (fuzz_next(&rng) % 8));
			if (fuzz_next(&rng) % 8 == 0)
				sz = fuzz_next(&rng) % (sz + 1);
		}
		LLVMFuzzerTestOneInput(buf, sz);
	}
}

#endif
