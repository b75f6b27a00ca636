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
#include "ekc_dev.cuh"

// Wait until *p reached k, or the budget ran out: never trap (a trap leaves
// a sticky error that kills the daemon's context). Returns false on timeout.
// Relaxed polls, one fence once the value is seen. A released group
// (*rel, host memory) ends the wait at once.
__device__ static bool wait_geq(const uint32_t *p, uint32_t k, uint64_t end,
				const volatile uint32_t *rel)
{
	uint32_t spins = 0;
	while ((int32_t)(ld_relaxed(p) - k) < 0) {
		if ((++spins & 1023) == 0 &&
		    (now_ns() > end || (rel && *rel)))
			return false;
	}
	fence_acquire();
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

	// release 2: after data kernels that waited for every rank
	if (a.release != 2) {
		// Phase 1: this rail. The doorbell was waited for by the
		// stream; the check stays so the kernel is correct on its own.
		const uint64_t end = now_ns() + a.budget_ns;
		if (!wait_geq(doorbell, k, end, a.released)) {
			if (!(a.released && *a.released))
				*(volatile int32_t *)a.error = (int32_t)(1 + l);
			return;
		}
		// Monotonic: never below what a release already wrote.
		__threadfence_system();
		atomicMax_system(rail, k);

		// Phase 2: the node, on phase-1 counters only.
		for (uint32_t j = 0; j < a.rpn; j++) {
			const uint32_t *rj = (const uint32_t *)((uint8_t *)a.ctrl[j] +
								EKC_RAIL_DONE);
			if (!wait_geq(rj, k, end, a.released)) {
				if (!(a.released && *a.released))
					*(volatile int32_t *)a.error =
						(int32_t)(1 + j);
				return;
			}
		}
		if (!a.release)
			return; // an entry wait before data kernels
	}
	// the data kernels of this op are done: their counters for the next
	if (l == 0)
		for (uint32_t i = 0; i < a.nwork; i++)
			a.work[i] = ~0u;
	// Completion for the daemon and the rank's flow control (host
	// memory), before the release: once the rank's stream sees done, the
	// resident barrier kernel may write completed = k + 1, which must not
	// be overtaken by this store.
	volatile uint64_t *c = a.completed + (uint64_t)l * a.completed_stride;
	__threadfence_system();
	*c = k;
	__threadfence_system();
	atomicMax_system(done, k);
}

// A rank's stream under MPS: doorbell := k, then wait until done >= k.
__device__ static inline void ring_wait(const struct ekc_ring_args &a)
{
	asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(a.bell),
		     "r"(a.k)
		     : "memory");
	const uint64_t end = now_ns() + a.budget_ns;
	uint32_t spins = 0;
	while ((int32_t)(ld_relaxed(a.done) - a.k) < 0) {
		if ((++spins & 255) == 0 && now_ns() > end)
			return;
		// a long wait (a dispatch) polls gently: the SM's issue slots
		// and L2 are the daemon's kernels' meanwhile
		if (spins > 64)
			__nanosleep(200);
	}
	fence_acquire(); // the op's outputs, for what follows on the stream
}

extern "C" __global__ void __launch_bounds__(32) ekc_ring_wait(struct ekc_ring_args a)
{
	if (!threadIdx.x)
		ring_wait(a);
}

// The same for a rank's stream barrier, under a name a profiler shows as
// one (a barrier's time on the rank's stream is this kernel's, up to the
// spin's budget; a longer wait goes on in the stream's front end).
extern "C" __global__ void __launch_bounds__(32) ekc_barrier_wait(struct ekc_ring_args a)
{
	if (!threadIdx.x)
		ring_wait(a);
}

// A captured op (struct ekc_post_args): the number from the host node,
// then as ekc_ring_wait; the gate opens only once done >= k was seen.
extern "C" __global__ void __launch_bounds__(32) ekc_post_wait(struct ekc_post_args a)
{
	if (threadIdx.x)
		return;
	const volatile struct ekc_gslot *s = a.slot;
	if (s->skip) {
		*(volatile uint32_t *)a.gate = 1;
		__threadfence_system();
		return;
	}
	const uint32_t k = s->k;
	asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(a.bell),
		     "r"(k)
		     : "memory");
	if (!a.budget_ns)
		return;
	const uint64_t end = now_ns() + a.budget_ns;
	uint32_t spins = 0;
	while ((int32_t)(ld_relaxed(a.done) - k) < 0) {
		if ((++spins & 255) == 0 && now_ns() > end)
			return; // libep's watcher opens the gate
		if (spins > 64)
			__nanosleep(200);
	}
	fence_acquire();
	*(volatile uint32_t *)a.gate = 1;
	__threadfence_system();
}

__device__ static inline uint32_t ld_host(const volatile uint32_t *p)
{
	return *p;
}

// The resident barrier: one warp, lane j serves local ranks j and j + 32.
// It waits for any rank to ring a barrier beyond the last one, then runs
// that barrier's two phases (as ekc_barrier) with a budget counted from
// the first arrival, releases every rank, and goes on. It ends when the
// daemon sets host->stop, or on a timeout or a mismatch (reported in
// host->state; the daemon fails the group). Polling backs off with
// __nanosleep while the group is idle.
extern "C" __global__ void __launch_bounds__(32) ekc_fastbar(struct ekc_fastbar_args a)
{
	const uint32_t lane = threadIdx.x;
	volatile struct ek_bar_state *h = a.host;
	const uint32_t *bell[2] = {nullptr, nullptr};
	uint32_t *done[2] = {nullptr, nullptr};
	for (int i = 0; i < 2; i++) {
		uint32_t l = lane + 32 * i;
		if (l < a.rpn) {
			uint8_t *base = (uint8_t *)a.ctrl[l];
			bell[i] = (const uint32_t *)(base + EKC_BAR_DOORBELL);
			done[i] = (uint32_t *)(base + EKC_DONE);
		}
	}
	uint64_t last = a.last, count = 0, busy = 0;
	uint32_t state = EK_BAR_STOPPED, fseq = 0;
	uint64_t missing = 0;
	if (lane == 0)
		h->state = EK_BAR_RUNNING;
	for (;;) {
		// Idle: wait for a first arrival, or the end.
		uint32_t k = 0, idle = 0;
		for (;;) {
			uint64_t rung = 0;
			for (int i = 0; i < 2; i++) {
				uint32_t v = bell[i] ? ld_relaxed(bell[i])
						     : (uint32_t)last;
				uint32_t b = __ballot_sync(
					0xffffffffu,
					(int32_t)(v - (uint32_t)last) > 0);
				rung |= (uint64_t)b << (32 * i);
				// warp-uniform: b is a ballot, k a shuffle's
				if (b && !k)
					k = __shfl_sync(0xffffffffu, v,
							__ffs(b) - 1);
			}
			if (rung)
				break;
			// warp-uniform: every lane counts idle alike
			if ((++idle & 255) == 0 &&
			    __shfl_sync(0xffffffffu, ld_host(&h->stop), 0))
				goto out;
			// idle: poll gently (the daemon's data kernels may be
			// running); ~0.2 us added to a barrier's start
			if (idle > 64)
				__nanosleep(idle > 65536 ? 2000 : 200);
		}
		const uint64_t end = now_ns() + a.budget_ns;
		// Phase 1, the rail: this rank (no remote rail peers: a group
		// with a resident barrier lives on one node).
		uint64_t notyet = 0;
		for (uint32_t spins = 0;; spins++) {
			notyet = 0;
			for (int i = 0; i < 2; i++) {
				bool wait = bell[i] &&
					    (int32_t)(ld_relaxed(bell[i]) - k) < 0;
				notyet |= (uint64_t)__ballot_sync(0xffffffffu,
								  wait)
					  << (32 * i);
			}
			if (!notyet)
				break;
			if ((spins & 1023) == 1023) {
				if (__shfl_sync(0xffffffffu, ld_host(&h->stop),
						0))
					goto out;
				if (now_ns() > end) {
					state = EK_BAR_TIMEOUT;
					missing = notyet;
					fseq = k;
					goto out;
				}
			}
		}
		const uint64_t arrived = now_ns();
		fence_acquire();
		// Every rank rang exactly k: a later value means its stream
		// skipped barrier k (ops in another order than the others').
		uint64_t bad = 0;
		for (int i = 0; i < 2; i++)
			bad |= (uint64_t)__ballot_sync(
				       0xffffffffu,
				       bell[i] && ld_relaxed(bell[i]) != k)
			       << (32 * i);
		if (bad) {
			state = EK_BAR_MISMATCH;
			missing = bad;
			fseq = k;
			goto out;
		}
		// Phase 2, the node: a resident barrier's group lives on one
		// node, so phase 1 (each rank, no remote rail peers) is what
		// this warp just saw for every rank; no counters to exchange.
		last += (uint32_t)(k - (uint32_t)last);
		count++;
		// Completion first, then the release: one release reduction
		// orders the completed word (host memory) before done.
		for (int i = 0; i < 2; i++) {
			uint32_t l = lane + 32 * i;
			if (!done[i])
				continue;
			volatile uint64_t *c =
				a.completed + (uint64_t)l * a.completed_stride;
			*c = k;
			asm volatile("red.release.sys.global.max.u32 [%0], %1;"
				     ::"l"(done[i]), "r"(k)
				     : "memory");
		}
		if (lane == 0) {
			busy += now_ns() - arrived;
			h->last = last;
			h->busy_ns = busy;
			h->count = count;
		}
	}
out:
	if (lane == 0) {
		h->missing = missing;
		h->seq = fseq;
		h->last = last;
		h->busy_ns = busy;
		h->count = count;
		__threadfence_system();
		h->state = state;
	}
}
