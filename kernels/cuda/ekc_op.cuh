// SPDX-License-Identifier: MIT
// What the normal ops' kernels (ekc_dispatch.cu, ekc_combine.cu) share:
// their argument block's fields and error words, programmatic dependent
// launch, the stage trace, the doorbell waits that end at the group's
// timeout or release, and the work counter that hands out tokens.
#ifndef EKC_OP_CUH
#define EKC_OP_CUH

#include "ekc_dev.cuh"

__device__ static inline uint8_t *field(const struct ekc_disp_args &a,
					uint32_t rank, int f)
{
	/* f is a constant at every call: the choice costs nothing */
	return (uint8_t *)a.region[rank] +
	       (f == EKC_F_RECV_X ? a.rx[rank] : a.off[f]);
}

/* Row t of source s's x, in the dispatch (its registered memory or its
 * region). */
__device__ static inline const uint8_t *x_row(const struct ekc_disp_args &a,
					     uint32_t s, uint64_t t)
{
	const uint64_t o = t < a.yrows[s] ? a.yo[s] : a.off[EKC_F_X];
	return (const uint8_t *)(a.region[s] + o + t * a.H * a.elt);
}

// A combine's or cached dispatch's: the error word of the dispatch that
// made its handle, flagged (the op fails alone and changes nothing, as
// that dispatch did), or ~0 where it succeeded.
__device__ static inline unsigned long long handle_error(const struct ekc_disp_args &a)
{
	if (!a.cached || !a.rerr)
		return ~0ull;
	const unsigned long long h = *(volatile unsigned long long *)a.rerr;
	return h == ~0ull ? h : h | EKC_ERR_HANDLE;
}

// The error of a dispatch, fresh or cached: its own word, else its
// handle's (not a combine's: a.err is then the last dispatch's). ~0: none.
__device__ static inline unsigned long long op_error(const struct ekc_disp_args &a)
{
	const unsigned long long e = *(volatile unsigned long long *)a.err;
	return e != ~0ull ? e : handle_error(a);
}

__device__ static inline bool has_error(const struct ekc_disp_args &a)
{
	return op_error(a) != ~0ull;
}

// Programmatic dependent launch (cuda_pdl): the daemon may launch a data
// kernel so that its blocks become resident while the kernel ahead of it
// on the stream is still running. Such a kernel waits here, before it
// reads anything, for that kernel to finish and its stores to be seen;
// launched without it, this is a no-op. (Hopper and later: the kernels
// are built for sm_90.)
__device__ static inline void prior_done(void)
{
	asm volatile("griddepcontrol.wait;" ::: "memory");
}

// The kernel behind this one on the stream may be launched now (each
// block's call, or its exit, counts): it still waits in prior_done for
// this one to finish.
__device__ static inline void let_next_launch(void)
{
	asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Tokens of the ranks in rank_mask (one GPU's ranks): how many, and the
// g-th of them as (rank, token).
__device__ static inline uint64_t masked_total(const struct ekc_disp_args &a)
{
	uint64_t total = 0;
	for (uint32_t s = 0; s < a.W; s++)
		if ((a.rank_mask >> s) & 1)
			total += a.tokens[s];
	return total;
}

__device__ static inline uint32_t masked_token(const struct ekc_disp_args &a,
					       uint64_t g, uint64_t *t)
{
	uint32_t s = 0;
	for (;; s++) {
		if (!((a.rank_mask >> s) & 1))
			continue;
		if (g < a.tokens[s])
			break;
		g -= a.tokens[s];
	}
	*t = g;
	return s;
}

// EPD_CUDA_TRACE: when each stage first started and last ended.
__device__ static inline unsigned long long tr_now()
{
	unsigned long long t;
	asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
	return t;
}

__device__ static inline void tr_begin(const struct ekc_disp_args &a, int st)
{
	if (a.trace)
		atomicMin(&a.trace[2 * st], tr_now());
}

// EPD_CUDA_TRACE: the SM this block runs on, as a bit of smmask.
__device__ static inline void mark_sm(const struct ekc_disp_args &a)
{
	if (a.smmask && threadIdx.x == 0) {
		uint32_t sm;
		asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
		atomicOr(&a.smmask[(sm / 32) & 7], 1u << (sm % 32));
	}
}

__device__ static inline void tr_end(const struct ekc_disp_args &a, int st)
{
	if (a.trace)
		atomicMin(&a.trace[2 * st + 1], ~tr_now());
}

// Under MPS no front-end wait precedes the data kernels: a kernel waits
// for the doorbells of the ranks it reads (inputs) or writes (outputs). A
// rank that never rings is found by the daemon's poll, which fails the
// group and rings every doorbell far ahead. The wait is bounded all the
// same (no kernel of the daemon's spins without end, whatever the host
// side does): past the group's timeout it marks the op failed, raises the
// group's error word for the poll and returns false; the op's later
// stages then change nothing.
__device__ static bool spin_expired(const struct ekc_disp_args &a,
				    uint32_t *spins, unsigned long long *end)
{
	if ((++*spins & 1023) != 0)
		return false;
	if (a.released && *a.released)
		return true; // the daemon gave the group up
	const unsigned long long now = tr_now();
	if (!*end) {
		*end = now + a.budget_ns;
		return false;
	}
	return now > *end;
}

__device__ static void wait_failed(const struct ekc_disp_args &a,
				   uint32_t rank)
{
	atomicMin(a.err, EKC_ERR_WAIT | rank);
	__threadfence();
	// a released group has its error; only a real timeout raises one
	if (a.group_err && !(a.released && *a.released)) {
		*a.group_err = (int32_t)(1 + rank);
		__threadfence_system();
	}
}

__device__ static inline bool wait_doorbell(const struct ekc_disp_args &a,
					    uint32_t rank)
{
	const volatile uint32_t *db =
		(const volatile uint32_t *)((uint8_t *)a.region[rank] +
					    EKC_DOORBELL);
	uint32_t spins = 0;
	unsigned long long end = 0;
	while ((int32_t)(*db - a.seq) < 0)
		if (spin_expired(a, &spins, &end)) {
			wait_failed(a, rank);
			return false;
		}
	__threadfence();
	return true;
}

// Work is handed out a token (a warp's item) at a time from a counter
// that starts at ~0 (reset by the op's finishing kernel): blocks that
// become resident late, behind other kernels sharing the GPU under MPS,
// just take fewer tokens instead of a second wave. Which warp copies a
// token does not change a byte of the output.
__device__ static inline uint64_t next_item(const struct ekc_disp_args &a,
					    uint32_t lane)
{
	uint32_t g = 0;
	if (lane == 0)
		g = atomicAdd(a.work, 1u) + 1u;
	return __shfl_sync(0xffffffffu, g, 0);
}


// Op error err for local rank d's CPU (its control page slot): the code
// from the word's flags, the word as the position, then the op's number.
__device__ static void publish_op_error(const struct ekc_disp_args &a,
					uint32_t d, unsigned long long err)
{
	uint8_t *h = (uint8_t *)a.host_ctl + (uint64_t)d * EKC_CTL_SLOT;
	*(volatile uint64_t *)(h + EKC_CTL_OP_ERR_POS) = err;
	*(volatile int32_t *)(h + EKC_CTL_OP_ERR_CODE) =
		err & EKC_ERR_HANDLE  ? EKC_ESTALE
		: err & EKC_ERR_TOOBIG ? EKC_ETOOBIG
		: err & EKC_ERR_WAIT   ? EKC_ETIMEDOUT
				       : EKC_EEXPERT;
	__threadfence_system();
	*(volatile uint64_t *)(h + EKC_CTL_OP_ERR_SEQ) = a.seq;
}

#endif
