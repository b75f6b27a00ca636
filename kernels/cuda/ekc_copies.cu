// SPDX-License-Identifier: MIT
// ep_stream_copies: several device copies in one launch on a rank's own
// stream (struct ekc_copies_args). A rank's small copies between two ops
// (a dispatch's routing input in, its outputs out) each cost a dependent
// step on the stream, where every rank of the group waits for the
// slowest: one launch instead of several.
#include <stdint.h>

#include "ekc.h"

template <typename V>
__device__ static inline void copy_piece(const struct ekc_copy_piece &p)
{
	V *d = (V *)p.dst;
	const V *s = (const V *)p.src;
	const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
	for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
	     i < p.count; i += step)
		d[i * p.dstride] = s[i * p.sstride];
}

extern "C" __global__ void __launch_bounds__(256)
	ekc_copies(struct ekc_copies_args a)
{
	const struct ekc_copy_piece &p = a.p[blockIdx.y];
	switch (p.elt) {
	case 1:
		copy_piece<uint8_t>(p);
		break;
	case 2:
		copy_piece<uint16_t>(p);
		break;
	case 4:
		copy_piece<uint32_t>(p);
		break;
	case 8:
		copy_piece<unsigned long long>(p);
		break;
	case 16:
		copy_piece<uint4>(p);
		break;
	}
}
