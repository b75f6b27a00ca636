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
//   ekc_gate        under MPS, the one block that waits for the doorbells
//                   before an op's wide kernels (a combine's too)
// The combine's kernels are in ekc_combine.cu; what both share, in
// ekc_op.cuh.
#include "ekc_op.cuh"

#define TPB 256 // tokens per block in count and slot

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
