// SPDX-License-Identifier: MIT
// The two-phase barrier, run by epd in its own context after its stream
// waited for every local rank's doorbell (cuStreamWaitValue32: a front-end
// wait, no SM spins while ranks are busy). One block, one thread per local
// rank.
//
// Phase 1 (scale-out, the rail of local index l): the rank itself has
// arrived (its doorbell) and so has every remote rail peer (their arrival
// counters, written by the proxy; none on one node). Thread l then writes
// rail_done[l] = k. Phase 2 (scale-up, the node): thread l waits until
// rail_done of every local index reached k, and only then releases its
// rank (done[l] = k) and reports completion to the host. Counters are
// monotonic and compared with >=: repeated barriers need no reset.
#include <stdint.h>

#include "ekc.h"

__device__ static inline uint32_t ld_acquire(const uint32_t *p)
{
	uint32_t v;
	asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
	return v;
}

__device__ static inline uint64_t now_ns(void)
{
	uint64_t t;
	asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
	return t;
}

// Wait until *p reached k, or the budget ran out: never trap (a trap leaves
// a sticky error that kills the daemon's context). Returns false on timeout.
__device__ static bool wait_geq(const uint32_t *p, uint32_t k, uint64_t end)
{
	uint32_t spins = 0;
	while ((int32_t)(ld_acquire(p) - k) < 0) {
		if ((++spins & 1023) == 0 && now_ns() > end)
			return false;
	}
	return true;
}

extern "C" __global__ void ekc_barrier(struct ekc_barrier_args a)
{
	const uint32_t l = threadIdx.x;
	if (l >= a.rpn)
		return;
	uint8_t *base = (uint8_t *)a.ctrl[l];
	uint32_t *doorbell = (uint32_t *)(base + EKC_DOORBELL);
	uint32_t *rail = (uint32_t *)(base + EKC_RAIL_DONE);
	uint32_t *done = (uint32_t *)(base + EKC_DONE);
	const uint32_t k = a.seq;

	// Phase 1: this rail. The doorbell was waited for by the stream; the
	// check stays so the kernel is correct on its own.
	const uint64_t end = now_ns() + a.budget_ns;
	if (!wait_geq(doorbell, k, end)) {
		*(volatile int32_t *)a.error = (int32_t)(1 + l); /* host */
		return;
	}
	// Monotonic: never below what a release already wrote.
	__threadfence_system();
	atomicMax_system(rail, k);

	// Phase 2: the node, on phase-1 counters only.
	for (uint32_t j = 0; j < a.rpn; j++) {
		const uint32_t *rj =
			(const uint32_t *)((uint8_t *)a.ctrl[j] + EKC_RAIL_DONE);
		if (!wait_geq(rj, k, end)) {
			*(volatile int32_t *)a.error = (int32_t)(1 + j);
			return;
		}
	}
	if (!a.release)
		return; // an entry wait before data kernels
	__threadfence_system();
	atomicMax_system(done, k);
	// Completion for the daemon and the rank's flow control (host memory).
	volatile uint64_t *c = a.completed + (uint64_t)l * a.completed_stride;
	__threadfence_system();
	*c = k;
}
