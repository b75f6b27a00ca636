// SPDX-License-Identifier: MIT
// Dispatch and combine on the GPU, run by epd on its stream after every
// local rank's doorbell. Same semantics, bit for bit, as kernels/host:
// placement from prefix sums (block counts, a scan, ballots inside a
// block), never from atomics; combine accumulates in fp32 from the bias in
// ascending rank order and rounds once to bf16 (nearest even).
//
//   ekc_count       masks, per-block destination counts, rows per expert;
//                   validation
//   ekc_scan        block bases per (source, block, destination), receive
//                   counts and rows per expert published (the rank's CPU
//                   waits for these alone, not for the rows); with
//                   ekc_prep, and for a cached dispatch, the copy's block
//                   0 publishes them
//   ekc_slot        slot[s][t][d]: the row of (s, t) on d, or -1
//   ekc_prep        count, scan and slot in one cooperative launch
//   ekc_copy        rows, scales, local top-k, weights, sources (warp/token);
//                   ekc_copy_tma: the same
//                   through the bulk-copy engine
//   ekc_combine     warp per home token, 16-byte vectors
//   ekc_combine_fetch, ekc_combine_lean: the same for few SMs
#include <stdint.h>

#include "ekc.h"

#define TPB 256 // tokens per block in count and slot

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

// Under MPS, the first kernel of a data op: one block that waits for every
// local rank's doorbell, so that the op's wide kernels, queued behind it,
// become resident only once every rank reached the op. A grid spinning on
// the doorbells would hold the SMs that the ranks' own work before the op
// needs (an expert GEMM before a combine, the copies in): measured, the
// ranks' 312 MB copies before a combine (8 ranks, DeepSeek-V3 shape) took
// 4 ms more than alone. The wide kernels' own waits then pass at once; a
// wait that fails here marks the op failed as theirs would.
//
// A dispatch's gate also starts its error word (a.err0: none, or a rank
// that asked for too many tokens) and the prep's grid barrier, which a
// memset did before it: one launch less on the stream (~4 us each under
// MPS). Its own failed waits come after, so they are kept.
extern "C" __global__ void __launch_bounds__(EKC_MAX_LOCAL)
	ekc_gate(struct ekc_disp_args a)
{
	prior_done();
	if (a.gate_reset) {
		if (threadIdx.x == 0) {
			*a.err = a.err0;
			*a.gsync = ~0u;
			__threadfence();
		}
		__syncthreads();
	}
	if (threadIdx.x < a.W)
		wait_doorbell(a, threadIdx.x);
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

// Entry k of token (s, t) as read (e): judged (the lowest bad (rank,
// token, k) wins: deterministic), then its destination into *mask and,
// unless dup (an earlier entry of the token has the same value), a row
// for its expert (a count: order-free).
__device__ static __forceinline__ void count_entry(
	const struct ekc_disp_args &a, uint32_t s, uint64_t t, uint32_t k,
	int64_t e, bool dup, bool toobig, uint32_t per, uint64_t *mask,
	uint32_t *pe)
{
	if (e < -1 || e >= (int64_t)a.E) {
		unsigned long long p = ((unsigned long long)s << 48) |
				       ((unsigned long long)t << 16) | k;
		if (!toobig)
			atomicMin(a.err, p);
		return;
	}
	if (e < 0)
		return;
	*mask |= 1ull << (uint32_t)(e / per);
	if (!dup)
		atomicAdd(pe + e, 1u);
}

// Block b of source s: its tokens' destination masks and how many go to
// each destination, and its rows per expert added to a.pe (through a
// histogram in shared memory up to PE_SMEM experts: global atomics of
// every (token, expert) on a few hundred words cost ~60 us of the
// prep). Called by the whole block.
#define PE_SMEM 1024
__device__ static __forceinline__ void count_block(const struct ekc_disp_args &a,
				   uint32_t s, uint32_t b)
{
	__shared__ uint32_t pe_s[PE_SMEM];
	const uint32_t t = b * TPB + threadIdx.x;
	const uint32_t T = a.tokens[s], W = a.W, K = a.K, per = a.E / a.W;
	const bool hist = a.E <= PE_SMEM;
	uint32_t *pe = hist ? pe_s : a.pe;
	if (hist) {
		for (uint32_t i = threadIdx.x; i < a.E; i += blockDim.x)
			pe_s[i] = 0;
		__syncthreads();
	}
	// a rank asked for too many tokens (set before this kernel): that
	// error is the op's, as on the host backend; no index is judged
	const unsigned long long e0 = *(volatile unsigned long long *)a.err;
	const bool toobig = e0 != ~0ull && (e0 & EKC_ERR_TOOBIG);
	uint64_t mask = 0;
	if (t < T) {
		const int64_t *ti = (const int64_t *)field(a, s, EKC_F_TOPK) +
				    (uint64_t)t * K;
		int64_t *mine = a.topk + ((uint64_t)s * a.Tmax + t) * K;
		/* read once: what is checked is what routes (the copy in
		 * daemon memory, mine, is what the later kernels read) */
		if (K <= 8) {
			// in registers: the loads in flight together, the
			// duplicates found without reading mine back (which
			// put each entry behind the stores before it)
			int64_t v[8];
#pragma unroll
			for (uint32_t k = 0; k < 8; k++)
				v[k] = k < K ? ti[k] : 0;
#pragma unroll
			for (uint32_t k = 0; k < 8; k++) {
				if (k >= K)
					break;
				mine[k] = v[k];
				bool dup = false;
#pragma unroll
				for (uint32_t j = 0; j < k; j++)
					dup |= v[j] == v[k];
				count_entry(a, s, t, k, v[k], dup, toobig, per,
					    &mask, pe);
			}
		} else {
			for (uint32_t k = 0; k < K; k++) {
				const int64_t e = ti[k];
				mine[k] = e;
				bool dup = false;
				for (uint32_t j = 0; j < k; j++)
					dup |= mine[j] == e;
				count_entry(a, s, t, k, e, dup, toobig, per,
					    &mask, pe);
			}
		}
		a.mask[(uint64_t)s * a.Tmax + t] = mask;
	}
	uint32_t *blk = a.blk + ((uint64_t)s * a.nblk_max + b) * W;
	for (uint32_t d = 0; d < W; d++) {
		int n = __syncthreads_count((int)((mask >> d) & 1));
		if (threadIdx.x == 0)
			blk[d] = (uint32_t)n;
	}
	// (the barriers above ordered every thread's histogram adds)
	if (hist)
		for (uint32_t i = threadIdx.x; i < a.E; i += blockDim.x)
			if (pe_s[i])
				atomicAdd(a.pe + i, pe_s[i]);
}

__device__ static inline bool wait_doorbell_traced(
	const struct ekc_disp_args &a, uint32_t rank)
{
	const bool ok = wait_doorbell(a, rank);
	tr_begin(a, EKC_TR_DOORBELL); // first seen
	tr_end(a, EKC_TR_DOORBELL);   // last seen
	return ok;
}

extern "C" __global__ void __launch_bounds__(TPB)
	ekc_count(struct ekc_disp_args a)
{
	prior_done();
	const uint32_t s = blockIdx.y, b = blockIdx.x;
	if (b >= (a.tokens[s] + TPB - 1) / TPB)
		return; // uniform for the block
	if (threadIdx.x == 0)
		tr_begin(a, EKC_TR_COUNT);
	if (a.wait) {
		bool bad = false;
		if (threadIdx.x == 0) // the block reads s's input
			bad = !wait_doorbell_traced(a, s);
		if (__syncthreads_or(bad))
			return; // the op failed (wait_failed): judge nothing
	}
	count_block(a, s, b);
	if (threadIdx.x == 0)
		tr_end(a, EKC_TR_COUNT);
}

// A fresh dispatch's rows per expert, once the count is final (every
// count block done): into each rank's field for its stream and into the
// control page for its CPU (zeros if the op failed), and cleared for the
// next dispatch. By the whole block, before publish_recv: each thread's
// stores are fenced and the block synchronised before the sequence words.
__device__ static void publish_pe(const struct ekc_disp_args &a)
{
	const uint32_t per = a.E / a.W;
	const bool ok = !has_error(a);
	int32_t *host = (int32_t *)((uint8_t *)a.host_ctl + EKC_CTL_PE);
	for (uint32_t i = threadIdx.x; i < a.E; i += blockDim.x) {
		const uint32_t v = atomicExch(a.pe + i, 0u);
		const int32_t c = ok ? (int32_t)v : 0;
		((int32_t *)field(a, i / per, EKC_F_RECV_PE))[i % per] = c;
		*(volatile int32_t *)(host + i) = c;
	}
	__threadfence_system();
	__syncthreads();
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

// Rank d's receive count (run) or the op's error, for its CPU (control
// page) and its stream (region); the finishing kernel publishes completion
// after these, in stream order.
__device__ static __forceinline__ void publish_recv(const struct ekc_disp_args &a,
				    uint32_t d, uint32_t run)
{
	uint8_t *h = (uint8_t *)a.host_ctl + (uint64_t)d * EKC_CTL_SLOT;
	const unsigned long long err = op_error(a);
	// a fresh dispatch's outcome, kept with its handle's tables for the
	// ops that will name it
	if (!a.cached && d == 0 && a.rerr)
		*(volatile unsigned long long *)a.rerr = err;
	*(volatile uint64_t *)(h + EKC_CTL_RECV) = err != ~0ull ? 0 : run;
	if (err == ~0ull)
		*(volatile uint32_t *)((uint8_t *)a.region[d] +
				       EKC_RECV_COUNT) = run;
	if (err != ~0ull)
		publish_op_error(a, d, err);
	__threadfence_system();
	*(volatile uint64_t *)(h + EKC_CTL_RECV_SEQ) = a.seq;
}

// The handle's rank prefix matrix: for a fresh dispatch, column c from the
// block counts (warp per column: [s][c] = rows of c from sources 0..s);
// then every local rank's copy, for a fresh and a cached dispatch alike.
// Called by a whole block once the block counts are final.
__device__ static void rank_prefix(const struct ekc_disp_args &a)
{
	const uint32_t W = a.W, nb = a.nblk_max;
	const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	if (has_error(a))
		return; // final here, so uniform: the op changes nothing
	if (!a.cached)
		for (uint32_t c = warp; c < W; c += blockDim.x >> 5) {
			uint32_t run = 0;
			for (uint32_t s = 0; s < W; s++) {
				const uint32_t nbs = (a.tokens[s] + TPB - 1) / TPB;
				uint32_t v = 0;
				for (uint32_t b = lane; b < nbs; b += 32)
					v += a.blk[((uint64_t)s * nb + b) * W + c];
				for (uint32_t o = 16; o; o >>= 1)
					v += __shfl_xor_sync(0xffffffffu, v, o);
				run += v;
				if (lane == 0)
					a.rp[s * W + c] = run;
			}
		}
	__syncthreads();
	for (uint32_t i = threadIdx.x; i < W * W * W; i += blockDim.x) {
		const uint32_t l = i / (W * W), j = i % (W * W);
		((int32_t *)field(a, l, EKC_F_RANK_PREFIX))[j] = (int32_t)a.rp[j];
	}
}

// Rank d would receive rows; past the group's receive capacity the op
// fails (its error word; the lowest word of all wins, as for every error).
__device__ static inline void recv_cap_check(const struct ekc_disp_args &a,
					     uint32_t d, uint32_t rows)
{
	if (rows > a.max_recv)
		atomicMin(a.err, EKC_ERR_TOOBIG | EKC_ERR_RECV |
					 (unsigned long long)d << 32 | rows);
}

// A fresh dispatch's three-launch prep (cuda_fused_prep=no, or a grid that
// does not fit), one block: warp w scans destination column w (and w + 32,
// ...) over the (source, block) rows, 32 rows per step with warp shuffles;
// blocks past a source's tokens count nothing. Then the rows per expert
// are published (and their counters cleared) by the whole block.
extern "C" __global__ void __launch_bounds__(1024) ekc_scan(struct ekc_disp_args a)
{
	prior_done();
	__shared__ uint32_t tot[EKC_MAX_LOCAL];
	const uint32_t d = threadIdx.x, W = a.W;
	const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	uint32_t run = 0;
	if (d == 0)
		tr_begin(a, EKC_TR_SCAN);
	if (a.wait) {
		// the first kernel that writes outputs: every rank must have
		// reached this op (done with the last op's outputs)
		// a failed wait marked the op failed: the bases below are
		// then never used (the copy changes nothing) but the error
		// is published as any other
		if (d < W)
			wait_doorbell(a, d);
		__syncthreads();
	}
	const uint32_t nb = a.nblk_max, rows = W * nb;
	for (uint32_t c = warp; c < W; c += blockDim.x >> 5) {
		uint32_t sum = 0;
		for (uint32_t r0 = 0; r0 < rows; r0 += 32) {
			const uint32_t r = r0 + lane;
			bool valid = false;
			uint32_t v = 0;
			if (r < rows) {
				const uint32_t s = r / nb, b = r % nb;
				valid = b < (a.tokens[s] + TPB - 1) / TPB;
				if (valid)
					v = a.blk[(uint64_t)r * W + c];
			}
			uint32_t x = v; // inclusive scan over the lanes
			for (uint32_t o = 1; o < 32; o <<= 1) {
				uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
				if (lane >= o)
					x += y;
			}
			if (valid)
				a.base[(uint64_t)r * W + c] = sum + x - v;
			sum += __shfl_sync(0xffffffffu, x, 31);
		}
		if (lane == 0)
			tot[c] = sum;
	}
	// a rank past its receive capacity: the op changes nothing
	if (d < W)
		recv_cap_check(a, d, tot[d]);
	__syncthreads();
	publish_pe(a);
	if (d < W) {
		run = tot[d];
		a.recv[d] = run;
	}
	rank_prefix(a);
	if (d >= W)
		return;
	// its count, or a bad expert index anywhere (the op changes nothing;
	// the group goes on)
	publish_recv(a, d, run);
	if (d == 0)
		tr_end(a, EKC_TR_SCAN);
}

// slot[s][t][d] of block b of source s, from the block's bases (one per
// destination). Called by the whole block.
__device__ static __forceinline__ void slot_block(const struct ekc_disp_args &a, uint32_t s,
				  uint32_t b, const uint32_t *base)
{
	__shared__ uint32_t warp_cnt[TPB / 32][EKC_MAX_LOCAL];
	const uint32_t t = b * TPB + threadIdx.x;
	const uint32_t T = a.tokens[s], W = a.W;
	const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const uint32_t below = (1u << lane) - 1;
	const uint64_t mask = t < T ? a.mask[(uint64_t)s * a.Tmax + t] : 0;
	for (uint32_t d = 0; d < W; d++) {
		uint32_t bal = __ballot_sync(0xffffffffu, (mask >> d) & 1);
		if (lane == 0)
			warp_cnt[warp][d] = __popc(bal);
	}
	__syncthreads();
	int32_t *slot = a.slot + ((uint64_t)s * a.Tmax + t) * W;
	for (uint32_t d = 0; d < W; d++) {
		uint32_t bit = (mask >> d) & 1;
		uint32_t bal = __ballot_sync(0xffffffffu, bit);
		if (t >= T)
			continue;
		if (!bit) {
			slot[d] = -1;
			continue;
		}
		uint32_t before = 0;
		for (uint32_t w = 0; w < warp; w++)
			before += warp_cnt[w][d];
		slot[d] = (int32_t)(base[d] + before + __popc(bal & below));
	}
}

extern "C" __global__ void __launch_bounds__(TPB)
	ekc_slot(struct ekc_disp_args a)
{
	prior_done();
	const uint32_t s = blockIdx.y, b = blockIdx.x;
	if (b >= (a.tokens[s] + TPB - 1) / TPB)
		return; // uniform for the block
	if (threadIdx.x == 0)
		tr_begin(a, EKC_TR_SLOT);
	slot_block(a, s, b, a.base + ((uint64_t)s * a.nblk_max + b) * a.W);
	if (threadIdx.x == 0)
		tr_end(a, EKC_TR_SLOT); // warp 0's stores; the rest are close
}

// count, scan and slot of a fresh dispatch in one cooperative launch
// (grid nblk_max x W, every block resident): one launch instead of three
// and a grid barrier instead of two kernel boundaries (measured ~5 us
// each under MPS). Each block adds up the counts of the blocks before it
// for its own bases, so the one grid barrier is all it needs; block (0, 0)
// makes the totals. Same bases, same slots as count + scan + slot.
__device__ static inline void grid_sync(const struct ekc_disp_args &a)
{
	__syncthreads();
	if (threadIdx.x == 0) {
		// from ~0: the op's memset; arrived = value + 1
		const uint32_t n = gridDim.x * gridDim.y;
		__threadfence();
		atomicAdd(a.gsync, 1u);
		uint32_t spins = 0;
		unsigned long long end = 0;
		while (*(volatile uint32_t *)a.gsync + 1u < n)
			if (spin_expired(a, &spins, &end)) {
				// a block never became resident: the op fails
				// (rank 0 named) rather than the GPU wedging
				wait_failed(a, 0);
				break;
			}
		__threadfence();
	}
	__syncthreads();
}

// Sum over the valid (source, block) rows before row `upto` of column c,
// by one warp.
__device__ static inline uint32_t col_sum(const struct ekc_disp_args &a,
					  uint32_t c, uint32_t upto,
					  uint32_t lane)
{
	const uint32_t nb = a.nblk_max;
	uint32_t sum = 0;
	for (uint32_t r = lane; r < upto; r += 32) {
		const uint32_t s = r / nb, b = r % nb;
		if (b < (a.tokens[s] + TPB - 1) / TPB)
			sum += a.blk[(uint64_t)r * a.W + c];
	}
	for (uint32_t o = 16; o; o >>= 1)
		sum += __shfl_xor_sync(0xffffffffu, sum, o);
	return sum;
}

// A fresh dispatch's receive totals, rows per expert, rank prefix matrix
// and receive counts, published once the block counts are final, by a
// whole block: the row copy's block 0 at its start, after ekc_prep. Done
// by the prep's block (0, 0), it held the whole prep (its host-memory
// stores and their fences: ~19 us where the other blocks were done in
// ~11), and the copy waits for the whole prep.
__device__ static void publish_fresh(const struct ekc_disp_args &a)
{
	__shared__ uint32_t tot[EKC_MAX_LOCAL];
	const uint32_t W = a.W, rows = W * a.nblk_max;
	const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	for (uint32_t c = warp; c < W; c += blockDim.x >> 5) {
		uint32_t v = col_sum(a, c, rows, lane);
		if (lane == 0)
			tot[c] = v;
	}
	publish_pe(a); // its barrier orders tot[] too
	rank_prefix(a);
	for (uint32_t d = threadIdx.x; d < W; d += blockDim.x) {
		a.recv[d] = tot[d];
		publish_recv(a, d, tot[d]);
	}
}

// The op's counts published by the row copy's block 0 (a.copy_publishes,
// a whole block): a fresh dispatch's, or a cached one's receive counts
// and its handle's rank prefix matrix again (no scan kernel then).
__device__ static void copy_publish(const struct ekc_disp_args &a)
{
	if (!a.cached) {
		publish_fresh(a);
		return;
	}
	rank_prefix(a);
	for (uint32_t d = threadIdx.x; d < a.W; d += blockDim.x)
		publish_recv(a, d, a.recv[d]);
}

extern "C" __global__ void __launch_bounds__(TPB) ekc_prep(struct ekc_disp_args a)
{
	prior_done();
	// the row copy may become resident meanwhile (cuda_pdl, a block a
	// SM): it waits for this grid in prior_done, and this grid is
	// resident already (a cooperative launch), so it takes no SM that
	// the prep needs
	if (a.copy_early)
		let_next_launch();
	__shared__ uint32_t base[EKC_MAX_LOCAL];
	const uint32_t s = blockIdx.y, b = blockIdx.x, W = a.W;
	const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const bool mine = b < (a.tokens[s] + TPB - 1) / TPB;
	__shared__ bool bad; // this block's wait failed: it counts nothing
	if (threadIdx.x == 0) {
		tr_begin(a, EKC_TR_COUNT);
		// block 0 of every source, even one without tokens: past the
		// grid barrier every rank has reached this op
		bad = a.wait && (mine || b == 0) &&
		      !wait_doorbell_traced(a, s);
	}
	__syncthreads();
	if (mine && !bad) // uniform for the block
		count_block(a, s, b);
	if (threadIdx.x == 0)
		tr_end(a, EKC_TR_COUNT);
	grid_sync(a);
	if (threadIdx.x == 0)
		tr_begin(a, EKC_TR_SCAN);
	// the receive totals against the capacity, once (block (0, 0)):
	// the row copy waits for this grid, so it sees the verdict
	if (s == 0 && b == 0)
		for (uint32_t c = warp; c < W; c += TPB / 32) {
			const uint32_t v = col_sum(a, c, W * a.nblk_max, lane);
			if (lane == 0)
				recv_cap_check(a, c, v);
		}
	const uint32_t row = s * a.nblk_max + b;
	if (mine)
		for (uint32_t c = warp; c < W; c += TPB / 32) {
			uint32_t v = col_sum(a, c, row, lane);
			if (lane == 0)
				base[c] = v;
		}
	__syncthreads();
	if (threadIdx.x == 0) {
		tr_end(a, EKC_TR_SCAN);
		tr_begin(a, EKC_TR_SLOT);
	}
	if (mine)
		slot_block(a, s, b, base);
	if (threadIdx.x == 0)
		tr_end(a, EKC_TR_SLOT);
}

// Scales, top-k, weights and source of token (s, t) at its destinations:
// (destination, item) pairs spread over the lanes.
__device__ static inline void copy_meta(const struct ekc_disp_args &a,
					uint32_t lane, uint32_t s, uint64_t t,
					const int32_t *slot, bool scales_done)
{
	const uint32_t W = a.W, K = a.K, per = a.E / a.W;
	const float *sc = (const float *)field(a, s, EKC_F_SCALES) +
			  t * a.nscales;
	const uint32_t ns = scales_done ? 0 : W * a.nscales;
	for (uint32_t i = lane; i < ns; i += 32) {
		uint32_t d = i / a.nscales, j = i % a.nscales;
		int32_t r = slot[d];
		if (r >= 0)
			((float *)field(a, d, EKC_F_RECV_SCALES))
				[(uint64_t)r * a.nscales + j] = sc[j];
	}
	if (a.cached)
		return;
	/* the copy the count checked, not the rank's buffer */
	const int64_t *ti = a.topk + ((uint64_t)s * a.Tmax + t) * K;
	const float *tw = (const float *)field(a, s, EKC_F_WEIGHTS) + t * K;
	const bool wts = (a.weights_mask >> s) & 1;
	for (uint32_t i = lane; i < W * K; i += 32) {
		uint32_t d = i / K, k = i % K;
		int32_t r = slot[d];
		if (r < 0)
			continue;
		int64_t e = ti[k];
		bool local = e >= 0 && (uint32_t)(e / per) == d;
		((int64_t *)field(a, d, EKC_F_RECV_TOPK))[(uint64_t)r * K + k] =
			local ? e - (int64_t)d * per : -1;
		((float *)field(a, d, EKC_F_RECV_WEIGHTS))[(uint64_t)r * K + k] =
			local && wts ? tw[k] : 0.0f;
	}
	for (uint32_t d = lane; d < W; d += 32) {
		int32_t r = slot[d];
		if (r < 0)
			continue;
		int32_t *rsrc = (int32_t *)field(a, d, EKC_F_RECV_SRC) +
				(uint64_t)r * 2;
		rsrc[0] = (int32_t)s;
		rsrc[1] = (int32_t)t;
	}
}

// A warp per source token: read its row once, write it to every
// destination. 16-byte vectors, four in flight per lane.
extern "C" __global__ void __launch_bounds__(256, 4)
	ekc_copy(struct ekc_disp_args a)
{
	prior_done();
	if (a.copy_publishes && blockIdx.x == 0)
		copy_publish(a);
	if (has_error(a))
		return; // a bad expert index: change nothing
	const uint32_t lane = threadIdx.x & 31;
	const uint32_t W = a.W;
	if (threadIdx.x == 0)
		tr_begin(a, EKC_TR_COPY);
	mark_sm(a);
	const uint64_t nvec = (uint64_t)a.H * a.elt / 16;
	const uint64_t total = masked_total(a);
	for (uint64_t g = next_item(a, lane), gn; g < total; g = gn) {
		gn = next_item(a, lane); // in flight while this token copies
		uint64_t t;
		const uint32_t s = masked_token(a, g, &t); // a source
		const int32_t *slot = a.slot + ((uint64_t)s * a.Tmax + t) * W;
		const uint4 *src = (const uint4 *)x_row(a, s, t);
		uint4 *dst[8];
		uint32_t nd = 0, d0 = 0;
		// destinations in groups of 8 (registers, no local memory)
		for (d0 = 0; d0 < W; d0 += 8) {
			nd = 0;
#pragma unroll
			for (uint32_t j = 0; j < 8; j++) {
				uint32_t d = d0 + j;
				int32_t r = d < W ? slot[d] : -1;
				dst[j] = r >= 0 ? (uint4 *)(field(a, d,
								  EKC_F_RECV_X) +
							    (uint64_t)r * nvec * 16)
						: nullptr;
				nd += r >= 0;
			}
			if (!nd)
				continue;
			for (uint64_t v = lane; v < nvec; v += 32 * 4) {
				uint4 x[4];
#pragma unroll
				for (int u = 0; u < 4; u++)
					if (v + 32 * u < nvec)
						x[u] = __ldg(src + v + 32 * u);
#pragma unroll
				for (uint32_t j = 0; j < 8; j++) {
					if (!dst[j])
						continue;
#pragma unroll
					for (int u = 0; u < 4; u++)
						if (v + 32 * u < nvec)
							dst[j][v + 32 * u] = x[u];
				}
			}
		}
		copy_meta(a, lane, s, t, slot, false);
	}
	if (lane == 0)
		tr_end(a, EKC_TR_COPY);
}

// The same copy through the bulk-copy engine (TMA), for rows of a multiple
// of 16 bytes that fit twice per warp in shared memory: lane 0 of a warp
// loads a token's row into shared memory (cp.async.bulk, completion on an
// mbarrier) while the row before it is still being stored; then lane d
// stores it to destination d (one bulk store each, issued together, no
// registers in between), and the lanes write the token's top-k, weights
// and source. fp8 scales of a multiple of 16 bytes a row (a.tma_sc: their
// bytes, H % 512 == 0) travel the same way, right after the row in shared
// memory: one 4-byte store per scale and destination was a third of the
// fp8 copy's issue; otherwise the lanes write them too.
#define TMA_WARPS EKC_TMA_WARPS
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

// Token (s, t)'s row, and its scales after it if a.tma_sc, into the
// shared-memory stage at dst; both complete on one barrier.
__device__ static inline void tma_load_token(const struct ekc_disp_args &a,
					     uint32_t dst, uint32_t s,
					     uint64_t t, uint32_t bytes,
					     uint32_t bar)
{
	mb_expect(bar, bytes + a.tma_sc);
	tma_load(dst, x_row(a, s, t), bytes, bar);
	if (a.tma_sc)
		tma_load(dst + bytes,
			 field(a, s, EKC_F_SCALES) + t * a.tma_sc, a.tma_sc,
			 bar);
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

// The token in the shared-memory stage at src to row r of destination d
// (none if r < 0): the row, and its scales if a.tma_sc.
__device__ static inline void tma_store_token(const struct ekc_disp_args &a,
					      uint32_t d, int32_t r,
					      uint32_t src, uint32_t bytes)
{
	if (r < 0)
		return;
	tma_store(field(a, d, EKC_F_RECV_X) + (uint64_t)r * bytes, src, bytes);
	if (a.tma_sc)
		tma_store(field(a, d, EKC_F_RECV_SCALES) +
				  (uint64_t)r * a.tma_sc,
			  src + bytes, a.tma_sc);
}

extern "C" __global__ void __launch_bounds__(TMA_WARPS * 32)
	ekc_copy_tma(struct ekc_disp_args a)
{
	extern __shared__ __align__(128) uint8_t rows[]; // [warp][2][row]
	__shared__ __align__(8) uint64_t bars[TMA_WARPS][2];
	prior_done();
	if (a.copy_publishes && blockIdx.x == 0)
		copy_publish(a);
	if (has_error(a))
		return; // a bad expert index: change nothing
	const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const uint32_t bytes = a.H * a.elt, W = a.W;
	const uint32_t stage = bytes + a.tma_sc; // a row and its scales
	if (threadIdx.x == 0)
		tr_begin(a, EKC_TR_COPY);
	mark_sm(a);
	const uint32_t buf0 = smem_addr(rows + (size_t)warp * 2 * stage);
	const uint32_t bar0 = smem_addr(&bars[warp][0]);
	if (lane == 0) {
		asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0)
			     : "memory");
		asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(
				     bar0 + 8)
			     : "memory");
		asm volatile("fence.mbarrier_init.release.cluster;" ::
				     : "memory");
	}
	__syncwarp();
	const uint64_t total = masked_total(a);
	uint32_t phase = 0; // parity bit of each stage's barrier
	uint32_t st = 0;
	// Tokens two ahead: the counter's atomic is in flight for a whole
	// token before its value is needed.
	uint64_t g = next_item(a, lane), gn = next_item(a, lane), t;
	uint32_t s;
	if (g < total && lane == 0) {
		s = masked_token(a, g, &t);
		tma_load_token(a, buf0, s, t, bytes, bar0);
	}
	while (g < total) {
		uint32_t raw = lane == 0 ? atomicAdd(a.work, 1u) + 1u : 0;
		s = masked_token(a, g, &t);
		const int32_t *slot = a.slot + ((uint64_t)s * a.Tmax + t) * W;
		// this token's destination rows, a lane per destination
		const int32_t r0 = lane < W ? slot[lane] : -1;
		const int32_t r1 = lane + 32 < W ? slot[lane + 32] : -1;
		const uint32_t nxt = st ^ 1;
		// the other stage: every lane's stores from it read it no more
		asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
		__syncwarp();
		if (lane == 0 && gn < total) {
			uint64_t tn;
			uint32_t sn = masked_token(a, gn, &tn);
			tma_load_token(a, buf0 + nxt * stage, sn, tn, bytes,
				       bar0 + nxt * 8);
		}
		tma_wait(bar0 + st * 8, (phase >> st) & 1);
		phase ^= 1u << st;
		// one bulk store per destination (and one of the scales),
		// issued by its lane
		const uint32_t src = buf0 + st * stage;
		tma_store_token(a, lane, r0, src, bytes);
		tma_store_token(a, lane + 32, r1, src, bytes);
		asm volatile("cp.async.bulk.commit_group;" ::: "memory");
		copy_meta(a, lane, s, t, slot, a.tma_sc != 0);
		st = nxt;
		g = gn;
		gn = __shfl_sync(0xffffffffu, raw, 0);
	}
	asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
	if (lane == 0)
		tr_end(a, EKC_TR_COPY);
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

// Did the dispatch that made the combine's handle succeed? If not, the
// combine changes nothing and fails alone (block 0 tells the homes this
// launch handles), as the dispatch did: its tables are not a routing.
__device__ static inline bool combine_handle_ok(const struct ekc_disp_args &a)
{
	const unsigned long long h = handle_error(a);
	if (h == ~0ull)
		return true;
	if (blockIdx.x == 0)
		for (uint32_t d = threadIdx.x; d < a.W; d += blockDim.x)
			if ((a.rank_mask >> d) & 1)
				publish_op_error(a, d, h);
	return false;
}

// A combine's start, by the whole block: trace marks, then (under MPS)
// every rank's doorbell. False: a rank never rang (wait_failed raised the
// group's error, or the group was released): its rows may be in use, so
// nothing is read or written.
__device__ static inline bool combine_begin(const struct ekc_disp_args &a)
{
	prior_done();
	if (threadIdx.x == 0)
		tr_begin(a, EKC_TR_COMBINE);
	mark_sm(a);
	if (!a.wait)
		return combine_handle_ok(a);
	bool bad = false;
	for (uint32_t d = threadIdx.x; d < a.W && !bad; d += blockDim.x)
		bad = !wait_doorbell(a, d);
	if (__syncthreads_or(bad))
		return false;
	if (threadIdx.x == 0)
		tr_end(a, EKC_TR_DOORBELL);
	return combine_handle_ok(a);
}

// The bulk-copy engine fetches [p, p + bytes) into L2 (no registers, no
// shared memory; one instruction for up to a few KB).
__device__ static inline void l2_fetch(const void *p, uint32_t bytes)
{
	asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p),
		     "r"(bytes)
		     : "memory");
}

// PF > 0: lane j < n asks the bulk-copy engine for row j's next CH
// column steps, PF steps ahead, every CH steps (and the first PF at the
// token's start), so that the loads wait for L2 rather than for the memory.
template <int C, int PF>
__device__ static __forceinline__ void combine_fetch(const uint4 *const *rp,
						     uint32_t n, uint32_t lane,
						     uint32_t nvec, uint32_t v,
						     uint32_t steps)
{
	if (!PF || lane >= n)
		return;
	const uint32_t hi = min(nvec, v + 32 * C * steps);
	if (v < hi)
		l2_fetch(rp[lane] + v, (hi - v) * 16);
}

// The sum of one home token's rows, by its warp: lane l takes columns
// (16-byte vectors) l, l + 32, ... C at a time, each started from the
// bias (then the second bias) or +0.0 and added in ascending rank order:
// the order of the sums is fixed. rp: the addresses of the token's n
// rows, in ascending rank order (the warp's shared memory). n <= 8
// (always when top-k <= 8: a token has a row on at most k ranks): they
// stay in registers for the whole token, and every row's loads of a
// column step are in flight together; more rows go 8 at a time.
template <int C, int PF = 0, int CH = 4>
__device__ static __forceinline__ void combine_token(const uint4 *const *rp,
						     uint32_t n, uint32_t lane,
						     uint32_t nvec,
						     const uint4 *bias,
						     const uint4 *bias2,
						     uint4 *out)
{
	const uint4 *p[8];
#pragma unroll
	for (uint32_t j = 0; j < 8; j++)
		p[j] = j < n ? rp[j] : nullptr;
	if (PF && n <= 8)
		combine_fetch<C, PF>(rp, n, lane, nvec, 0, PF);
	for (uint32_t v0 = lane, step = 0; v0 < nvec; v0 += 32 * C, step++) {
		if (PF && n <= 8 && step % CH == 0)
			combine_fetch<C, PF>(rp, n, lane, nvec,
					     (v0 - lane) + 32 * C * PF, CH);
		float acc[C][8];
#pragma unroll
		for (int c = 0; c < C; c++) {
			const uint32_t v = v0 + 32 * c;
#pragma unroll
			for (int i = 0; i < 8; i++)
				acc[c][i] = 0.0f;
			if (v < nvec && bias)
				set_bf16x8(acc[c], bias[v]);
			if (v < nvec && bias2) // DeepEP's second bias
				add_bf16x8(acc[c], bias2[v]);
		}
		for (uint32_t j0 = 0; j0 < n; j0 += 8) {
			if (j0) {
#pragma unroll
				for (uint32_t j = 0; j < 8; j++)
					p[j] = j0 + j < n ? rp[j0 + j] : nullptr;
			}
			uint4 y[8][C];
#pragma unroll
			for (uint32_t j = 0; j < 8; j++)
#pragma unroll
				for (int c = 0; c < C; c++)
					if (j0 + j < n && v0 + 32 * c < nvec)
						y[j][c] = __ldg(p[j] + v0 + 32 * c);
#pragma unroll
			for (uint32_t j = 0; j < 8; j++)
#pragma unroll
				for (int c = 0; c < C; c++)
					if (j0 + j < n && v0 + 32 * c < nvec)
						add_bf16x8(acc[c], y[j][c]);
		}
#pragma unroll
		for (int c = 0; c < C; c++)
			if (v0 + 32 * c < nvec)
				out[v0 + 32 * c] = pack_bf16x8(acc[c]);
		if (n > 8) { // the first 8 rows again, for the next step
#pragma unroll
			for (uint32_t j = 0; j < 8; j++)
				p[j] = rp[j];
		}
	}
}

// The combine: a warp per home token, C column steps at a time
// (combine_token).
// Rank d's row r of a combine's rows (its registered memory below
// yrows[d], its region's field after).
__device__ static inline const uint4 *combine_row(const struct ekc_disp_args &a,
						  uint32_t d, int32_t r,
						  uint64_t nvec)
{
	const uint64_t o = (uint32_t)r < a.yrows[d] ? a.yo[d] : a.off[EKC_F_Y];
	return (const uint4 *)(a.region[d] + o) + (uint64_t)r * nvec;
}

// The combine's loop over home tokens, a warp each: sum(rp, n, nvec, bias,
// bias2, out) adds up one token's rows for its output; the loop lists them
// and sums the top-k weights. rp: the warp's list in shared memory.
template <typename Sum>
__device__ static __forceinline__ void combine_tokens(const struct ekc_disp_args &a,
						      const uint4 **rp, Sum sum)
{
	const uint32_t lane = threadIdx.x & 31, W = a.W, H = a.H;
	const uint64_t nvec = H / 8;
	if (!combine_begin(a))
		return;
	const uint64_t total = masked_total(a);
	for (uint64_t g = next_item(a, lane), gn; g < total; g = gn) {
		gn = next_item(a, lane);
		uint64_t t;
		const uint32_t h = masked_token(a, g, &t); // a home rank
		const int32_t *slot = a.slot + ((uint64_t)h * a.Tmax + t) * W;
		__syncwarp(); // the previous token's addresses are read
		uint32_t n = 0;
		for (uint32_t d0 = 0; d0 < W; d0 += 32) {
			const uint32_t d = d0 + lane;
			const int32_t r = d < W ? slot[d] : -1;
			const uint32_t m = __ballot_sync(0xffffffffu, r >= 0);
			if (r >= 0)
				rp[n + __popc(m & ((1u << lane) - 1))] =
					combine_row(a, d, r, nvec);
			n += __popc(m);
		}
		__syncwarp();
		const uint4 *bias = (a.bias_mask >> h) & 1
					    ? (const uint4 *)field(a, h, EKC_F_BIAS) +
						      t * nvec
					    : nullptr;
		const uint4 *bias2 = (a.bias2_mask >> h) & 1
					     ? (const uint4 *)field(a, h, EKC_F_BIAS2) +
						       t * nvec
					     : nullptr;
		// rank h's own output tensor (registered) or its region's
		uint4 *out = (uint4 *)(a.region[h] + (t < a.orows[h]
							     ? a.oo[h]
							     : a.off[EKC_F_OUT])) +
			     t * nvec;
		sum(rp, n, (uint32_t)nvec, bias, bias2, out);
		if (a.cw && lane < a.K) {
			// the rows' top-k weights: fp32 sums from +0.0 in
			// ascending rank order, as the host backend
			const uint32_t K = a.K;
			float acc = 0.0f;
			for (uint32_t d = 0; d < W; d++) {
				int32_t r = slot[d];
				if (r >= 0)
					acc = __fadd_rn(
						acc,
						__ldg((const float *)field(a, d,
									   EKC_F_CW) +
						      (uint64_t)r * K + lane));
			}
			((float *)field(a, h, EKC_F_CW_OUT))[t * K + lane] = acc;
		}
	}
	if (lane == 0)
		tr_end(a, EKC_TR_COMBINE);
}

// The combine with tok(rp, n, lane, nvec, bias, bias2, out) summing each
// token for its warp. Each warp's token: its rows' addresses in ascending
// rank order, made once per token by the lanes (rank d's combine_y is its
// registered memory below yrows[d], its region's field after) and passed
// through shared memory: computed in the column loop from the kernel's
// parameters with a rank known only at run time, the choice cost a
// quarter of the combine's speed.
template <typename Tok>
__device__ static __forceinline__ void combine_with(const struct ekc_disp_args &a,
						   Tok tok)
{
	__shared__ const uint4 *rows_of[256 / 32][EKC_MAX_LOCAL];
	const uint32_t lane = threadIdx.x & 31;
	combine_tokens(a, rows_of[threadIdx.x >> 5],
		       [&](const uint4 *const *rp, uint32_t n, uint32_t nvec,
			   const uint4 *bias, const uint4 *bias2, uint4 *out) {
			       tok(rp, n, lane, nvec, bias, bias2, out);
		       });
}

template <int C, int PF = 0, int CH = 4>
__device__ static __forceinline__ void combine_warps(const struct ekc_disp_args &a)
{
	combine_with(a, [](const uint4 *const *rp, uint32_t n,
				   uint32_t lane, uint32_t nvec,
				   const uint4 *bias, const uint4 *bias2,
				   uint4 *out) {
		combine_token<C, PF, CH>(rp, n, lane, nvec, bias, bias2, out);
	});
}

// acc = a sum's start at column v: the bias (exact), plus the second bias,
// or +0.0 without them.
__device__ static __forceinline__ void sum_start(float acc[8],
						 const uint4 *bias,
						 const uint4 *bias2, uint32_t v)
{
	if (bias) {
		set_bf16x8(acc, bias[v]);
	} else {
#pragma unroll
		for (int i = 0; i < 8; i++)
			acc[i] = 0.0f;
	}
	if (bias2)
		add_bf16x8(acc, bias2[v]);
}

// The lean combine: a token's sum specialised on its number of rows N (1
// to 8; none or more take combine_token's loop), four column steps an
// iteration at fixed offsets from pointers advanced once an iteration (no
// test a row, no address arithmetic a load), and with PF > 0 each lane's
// own L2 prefetch (one instruction a row and step, no register or shared
// memory held) PF steps ahead. combine_token's loop, held to 24 SMs,
// waits on its loads (a loads-only copy of it is as fast) and issues ~40
// instructions a 16-byte row vector, where the conversions and adds take
// 16 (PERFORMANCE.md, "One GPU: dispatch and combine"). The order of the sums and the
// rounding are combine_token's.
template <int N, int PF>
__device__ static __forceinline__ void lean_step(const uint4 *const (&p)[N],
						 const uint4 *b1, const uint4 *b2,
						 uint4 *o, int u, bool pf)
{
	if (PF && pf)
#pragma unroll
		for (int j = 0; j < N; j++)
			asm volatile("prefetch.global.L2 [%0];" ::"l"(p[j] + 32 * (u + PF)));
	uint4 y[N];
#pragma unroll
	for (int j = 0; j < N; j++)
		y[j] = __ldg(p[j] + 32 * u);
	float acc[8];
	sum_start(acc, b1, b2, 32 * u);
#pragma unroll
	for (int j = 0; j < N; j++)
		add_bf16x8(acc, y[j]);
	o[32 * u] = pack_bf16x8(acc);
}

template <int N, int PF>
__device__ static __forceinline__ void lean_token(const uint4 *const *rp,
						  uint32_t lane, uint32_t nvec,
						  const uint4 *bias,
						  const uint4 *bias2, uint4 *out)
{
	const uint4 *p[N];
#pragma unroll
	for (int j = 0; j < N; j++)
		p[j] = rp[j] + lane;
	const uint4 *b1 = bias ? bias + lane : nullptr;
	const uint4 *b2 = bias2 ? bias2 + lane : nullptr;
	uint4 *o = out + lane;
	if constexpr (PF > 0)
		for (uint32_t k = 1; k < PF; k++)
			if (lane + 32 * k < nvec)
#pragma unroll
				for (int j = 0; j < N; j++)
					asm volatile("prefetch.global.L2 [%0];" ::"l"(
						p[j] + 32 * k));
	uint32_t v = lane;
#pragma unroll 1
	for (; v + 96 < nvec; v += 128) {
		const bool pf = v + 32 * (3 + PF) < nvec;
#pragma unroll
		for (int u = 0; u < 4; u++)
			lean_step<N, PF>(p, b1, b2, o, u, pf);
#pragma unroll
		for (int j = 0; j < N; j++)
			p[j] += 128;
		o += 128;
		if (b1)
			b1 += 128;
		if (b2)
			b2 += 128;
	}
#pragma unroll 1
	for (; v < nvec; v += 32) {
		lean_step<N, PF>(p, b1, b2, o, 0, false);
#pragma unroll
		for (int j = 0; j < N; j++)
			p[j] += 32;
		o += 32;
		if (b1)
			b1 += 32;
		if (b2)
			b2 += 32;
	}
}

template <int PF>
__device__ static __forceinline__ void lean_any(const uint4 *const *rp,
						uint32_t n, uint32_t lane,
						uint32_t nvec, const uint4 *bias,
						const uint4 *bias2, uint4 *out)
{
	switch (n) {
#define LEAN_CASE(k_)                                                          \
	case k_:                                                               \
		lean_token<k_, PF>(rp, lane, nvec, bias, bias2, out);          \
		break;
		LEAN_CASE(1) LEAN_CASE(2) LEAN_CASE(3) LEAN_CASE(4)
		LEAN_CASE(5) LEAN_CASE(6) LEAN_CASE(7) LEAN_CASE(8)
#undef LEAN_CASE
	default:
		combine_token<1>(rp, n, lane, nvec, bias, bias2, out);
	}
}

template <int PF>
__device__ static __forceinline__ void combine_lean(const struct ekc_disp_args &a)
{
	combine_with(a, [](const uint4 *const *rp, uint32_t n,
				   uint32_t lane, uint32_t nvec,
				   const uint4 *bias, const uint4 *bias2,
				   uint4 *out) {
		lean_any<PF>(rp, n, lane, nvec, bias, bias2, out);
	});
}

#ifndef EKC_COMBINE_COLS
#define EKC_COMBINE_COLS 1
#endif
extern "C" __global__ void __launch_bounds__(256)
	ekc_combine(struct ekc_disp_args a)
{
	combine_warps<EKC_COMBINE_COLS>(a);
}

// The same with the rows fetched into L2 EKC_COMBINE_FETCH column steps
// ahead, for grids of few SMs (the daemon's choice, cu_combine_fn).
extern "C" __global__ void __launch_bounds__(256)
	ekc_combine_fetch(struct ekc_disp_args a)
{
	combine_warps<EKC_COMBINE_COLS, EKC_COMBINE_FETCH>(a);
}

// The lean combine with each lane's L2 prefetch EKC_COMBINE_LPF steps
// ahead, two blocks a SM (no spill; at three, registers spill and it
// falls to ekc_combine_fetch's speed): the daemon's choice for few SMs.
extern "C" __global__ void __launch_bounds__(256, 2)
	ekc_combine_lean(struct ekc_disp_args a)
{
	combine_lean<EKC_COMBINE_LPF>(a);
}
