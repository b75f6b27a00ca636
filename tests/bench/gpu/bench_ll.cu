// SPDX-License-Identifier: MIT
// bench_ll: the low-latency (decode) kernels of kernels/cuda/ekc_ll.cu, W
// processes (ranks) on the GPU(s) as a serving job runs them: each rank
// launches dispatch and combine on its own stream and writes straight into
// its peers' public regions (cudaMalloc'd by each rank, mapped by the
// others with CUDA IPC; under MPS when ranks share a GPU). No daemon: this
// measures the kernels' design before libep serves it.
//
// Checks, bit for bit against a CPU reference on fresh random inputs every
// iteration: recv_x rows (bf16, or the dispatch's cast to fp8: e4m3 rows
// and fp32 or UE8M0 scales), recv_count, layout_range, src_info, and the
// combine (fp32 from +0.0 in top-k order, each row times its weight, -1
// skipped, rounded once to bf16); with the receive hook split off and not;
// 1,000 CUDA graph replays of dispatch + combine with fresh inputs (the
// sequence numbers are the device's own); a rank over its token budget
// (EKC_LL_ETOOBIG there, every rank finishes). Times (DeepSeek-V3 shape:
// hidden 7168, top-8 of 256, 1 / 32 / 128 tokens per rank): median per op
// over synchronised iterations and the mean of back-to-back pairs, with the
// ratio to a device-to-device copy measured in the same run.
//
// EPD_LL_RANKS (8), EPD_LL_BLOCKS (blocks per rank and kernel, 16),
// EPD_LL_REPLAYS (1000), EPD_LL_ITERS (200), EPD_LL_ONLY=timed (the
// timings alone). Exit 1 on a mismatch. The timed iterations start every
// rank's ops together at a deadline of the GPU's global timer (a gate
// kernel) and print where the time goes (the kernels' trace stamps).
#include <cuda_runtime.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ekc_all.cu"
#include "ep/ep.h"

// libep's test hook (libep_cuda_int.h): its kernels' trace stamps
extern "C" int ep__ll_trace(ep_group_t *g, uint64_t trace);

static int g_rank;
// EPD_LL_LIBEP=1: the same checks and timings through libep's ep_ll_* (a
// group per configuration on the daemon at $EPD_SOCKET, its regions the
// daemon's) instead of this file's own launches and CUDA IPC.
static int g_libep;

#define CK(x)                                                                  \
	do {                                                                   \
		cudaError_t e_ = (x);                                          \
		if (e_ != cudaSuccess) {                                       \
			fprintf(stderr, "rank %d: %s:%d: %s: %s\n", g_rank,    \
				__FILE__, __LINE__, #x,                        \
				cudaGetErrorString(e_));                       \
			exit(2);                                               \
		}                                                              \
	} while (0)

#define LL_IT_MAX 256 // iterations kept per rank for the skew line

struct shm {
	pthread_barrier_t bar;
	cudaIpcMemHandle_t h[EKC_LL_MAXW];
	double res[EKC_LL_MAXW][8];
	uint64_t bytes[EKC_LL_MAXW][2];
	double tr[EKC_LL_MAXW][EKC_LL_TR_N]; // median stamp - start, us
	uint64_t start;                      // the gates' common deadline
	uint32_t late[EKC_LL_MAXW];
	// every iteration's stamps (us after the start, -1: none), for the
	// per-iteration extremes over the ranks (the waits end with them)
	uint32_t nit;
	float it[EKC_LL_MAXW][LL_IT_MAX][EKC_LL_TR_N];
};
static struct shm *g_sh;
static void bar() { pthread_barrier_wait(&g_sh->bar); }

__host__ __device__ static inline uint64_t mix(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

// A finite bf16 of either sign, magnitude 2^-7 .. 2^7.
__host__ __device__ static inline uint16_t rbf(uint64_t h)
{
	return (uint16_t)((h & 1) << 15 | (120 + (h >> 1) % 15) << 7 |
			  ((h >> 8) & 0x7f));
}

static inline uint16_t val_x(uint64_t it, uint32_t s, uint32_t t, uint32_t c)
{
	return rbf(mix(mix(mix(it * 1000003 + s) + t) + c));
}

static inline uint16_t val_e(uint64_t it, uint32_t d, uint32_t el, uint32_t p,
			     uint32_t c)
{
	return rbf(mix(mix(mix(mix(~it + d) + el) + p) + c));
}

__global__ void fill_rand(uint16_t *p, uint64_t n, uint64_t seed)
{
	for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
	     i < n; i += (uint64_t)gridDim.x * blockDim.x)
		p[i] = rbf(mix(seed + i));
}

static float bf(uint16_t b)
{
	uint32_t u = (uint32_t)b << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static uint16_t f2bf(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	if ((u & 0x7fffffffu) > 0x7f800000u) // the canonical NaN
		return (uint16_t)0x7fffu;
	return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// float to e4m3 (fn: no infinities), to nearest even, saturating at 448.
static uint8_t f32_e4m3(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	const uint8_t s = (u >> 24) & 0x80;
	const float a = fabsf(f);
	if (a != a)
		return 0x7f;
	if (a >= 448.0f)
		return s | 0x7e;
	if (a < 0.015625f) // below 2^-6: m * 2^-9 (m = 8: the least normal)
		return s | (uint8_t)nearbyintf(a * 512.0f);
	int e;
	frexpf(a, &e); // a = f * 2^e, f in [0.5, 1)
	e -= 1;
	float m = nearbyintf(ldexpf(a, 3 - e)); // 8 .. 16
	if (m == 16.0f)
		m = 8.0f, e++;
	uint32_t r = (uint32_t)(e + 7) << 3 | ((uint32_t)m - 8);
	return s | (uint8_t)(r > 0x7e ? 0x7e : r);
}

// The dispatch's fp8 cast of one row (ekc.h, EKC_LL_FP8_*): q [H] e4m3
// and each 128-channel group's scale (fp32 bits; UE8M0: exponent bytes,
// four groups to a word).
static void ref_cast(const uint16_t *x, uint32_t H, uint32_t mode, uint8_t *q,
		     std::vector<uint32_t> &sc)
{
	const uint32_t G = H / 128;
	sc.assign(mode == EKC_LL_FP8_UE8M0 ? G / 4 : G, 0);
	for (uint32_t g = 0; g < G; g++) {
		float amax = 0.0f;
		for (uint32_t c = 0; c < 128; c++)
			amax = std::max(amax, fabsf(bf(x[g * 128 + c])));
		amax = std::max(amax, 1e-4f);
		volatile float scale = amax * (float)(1.0 / 448.0), mul;
		if (mode == EKC_LL_FP8) {
			mul = 448.0f / amax;
		} else {
			float sf = scale;
			uint32_t b;
			memcpy(&b, &sf, 4);
			if (b & 0x7fffffu)
				b = ((b >> 23) + 1) << 23;
			memcpy(&sf, &b, 4);
			scale = sf;
			mul = 1.0f / sf;
		}
		for (uint32_t c = 0; c < 128; c++) {
			volatile float v = bf(x[g * 128 + c]) * mul;
			q[g * 128 + c] = f32_e4m3(v);
		}
		float sf = scale;
		uint32_t b;
		memcpy(&b, &sf, 4);
		if (mode == EKC_LL_FP8_UE8M0)
			sc[g / 4] |= ((b >> 23) & 0xffu) << (8 * (g % 4));
		else
			sc[g] = b;
	}
}

struct cfg {
	const char *name;
	uint32_t H, N, K, E;
	int iters;   // checked iterations
	int fixed_t; // T = N on every rank (else random in [0, N])
	int hook;    // the receive halves as separate launches
	int timed;   // timing instead of checks
	int graph;   // CUDA graph replays
	int toobig;  // rank 1 asks for N + 1 tokens in iteration 1
	int pull;    // zero-copy combine: experts' rows in cx, read by homes
	int tbo;     // two micro-batches in flight (buffers 0 and 1)
	uint32_t fp8; // the dispatch casts to fp8: EKC_LL_FP8_* (0: bf16)
};

// One rank's routing of iteration it: T, top-k (distinct experts, about
// one in 16 entries -1) and weights.
static void gen_route(const cfg &c, uint32_t W, uint64_t it, uint32_t s,
		      uint32_t &T, std::vector<int64_t> &topk,
		      std::vector<float> &w)
{
	uint64_t h = mix(it * 7919 + s * 104729 + c.H);
	T = c.fixed_t ? c.N : (uint32_t)(h % (c.N + 1));
	topk.assign((size_t)T * c.K, -1);
	w.assign((size_t)T * c.K, 0.0f);
	for (uint32_t t = 0; t < T; t++) {
		for (uint32_t k = 0; k < c.K; k++) {
			h = mix(h);
			w[t * c.K + k] = (float)(h & 0xffffff) / 16777216.0f - 0.25f;
			if ((h >> 40) % 16 == 0)
				continue;
			for (;;) {
				h = mix(h);
				int64_t e = (int64_t)((h >> 20) % c.E);
				bool dup = false;
				for (uint32_t j = 0; j < k; j++)
					dup |= topk[t * c.K + j] == e;
				if (!dup) {
					topk[t * c.K + k] = e;
					break;
				}
			}
		}
	}
	(void)W;
}

// The routing a run uses: under graph replays T stays as captured (the
// routing of iteration 0), the rest is iteration it's.
static void route(const cfg &c, uint32_t W, uint64_t it, uint32_t s,
		  uint32_t &T, std::vector<int64_t> &topk, std::vector<float> &w)
{
	gen_route(c, W, it, s, T, topk, w);
	if (c.graph) {
		uint32_t T0;
		std::vector<int64_t> k0;
		std::vector<float> w0;
		gen_route(c, W, 0, s, T0, k0, w0);
		T = T0;
		topk.resize((size_t)T0 * c.K, -1);
		w.resize((size_t)T0 * c.K, 0.5f);
	}
}

struct rank_ctx {
	uint32_t r, W, G;
	uint8_t *pub, *priv;
	uint64_t pub_size, priv_size;
	uint64_t peer[EKC_LL_MAXW];
	cudaStream_t st;
	uint16_t *x, *ex, *out;
	int64_t *topk;
	float *w;
	int32_t *recv_count, *src_info;
	int64_t *layout;
	uint64_t timeout_ns;
	ep_conn_t *conn; // libep mode: the connection and this cfg's group
	ep_group_t *g;
	bool timed; // libep mode, timings: combines follow libep's buffer
	uint32_t one_gpu; // every rank on this GPU: flags at GPU scope
	uint32_t b; // the buffer in use, and its inputs and outputs above
	struct io {
		uint16_t *x, *ex, *out;
		int64_t *topk;
		float *w;
		int32_t *recv_count, *src_info;
		int64_t *layout;
		int32_t *own_count, *own_src; // the bench's (libep mode: libep's above)
		int64_t *own_layout;
	} io[2];
};

// Buffer b (the kernels' a.buf) and its own inputs and outputs.
static void use(rank_ctx &R, uint32_t b)
{
	R.b = b;
	R.x = R.io[b].x;
	R.ex = R.io[b].ex;
	R.out = R.io[b].out;
	R.topk = R.io[b].topk;
	R.w = R.io[b].w;
	R.recv_count = R.io[b].recv_count;
	R.src_info = R.io[b].src_info;
	R.layout = R.io[b].layout;
}

static ekc_ll_args make_args(rank_ctx &R, const cfg &c, uint32_t T)
{
	ekc_ll_args a;
	memset(&a, 0, sizeof(a));
	for (uint32_t d = 0; d < R.W; d++)
		a.peer[d] = R.peer[d];
	ekc_ll_layout_of(R.W, c.N, c.H, c.E / R.W, c.K, &a.L);
	a.priv = (uint64_t)R.priv;
	a.x = (uint64_t)R.x;
	a.topk = (uint64_t)R.topk;
	a.weights = (uint64_t)R.w;
	a.ex = (uint64_t)R.ex;
	a.out = (uint64_t)R.out;
	a.recv_count = (uint64_t)R.recv_count;
	a.layout = (uint64_t)R.layout;
	a.src_info = (uint64_t)R.src_info;
	a.timeout_ns = R.timeout_ns;
	a.rank = R.r;
	a.W = R.W;
	a.N = c.N;
	a.H = c.H;
	a.El = c.E / R.W;
	a.K = c.K;
	a.T = T;
	a.buf = R.b;
	a.gpu_scope = R.one_gpu;
	a.fp8 = c.fp8;
	return a;
}

// EPD_LL_PDL=1: the kernels launched with programmatic dependent launch
// (their blocks become resident while the work ahead of them finishes;
// each kernel waits for it first).
static int g_pdl;

static void ll_kernel(rank_ctx &R, const void *fn, void **args)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute at[1];
	cfg.gridDim = dim3(R.G);
	cfg.blockDim = dim3(LL_TPB);
	cfg.stream = R.st;
	if (g_pdl) {
		at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
		at[0].val.programmaticStreamSerializationAllowed = 1;
		cfg.attrs = at;
		cfg.numAttrs = 1;
	}
	CK(cudaLaunchKernelExC(&cfg, fn, args));
}

static void ep_ok(int rc, const char *what)
{
	if (rc) {
		fprintf(stderr, "rank %d: %s: %s\n", g_rank, what,
			ep_errmsg());
		exit(2);
	}
}

// libep mode: libep picks the buffer; the bench's sequence must be the
// same (its inputs and checks are per buffer), and the outputs are
// libep's.
static void ll_took(rank_ctx &R, const ep_ll_recv &o, bool timed)
{
	if (timed)
		R.b = o.buffer;
	if (o.buffer != R.b) {
		fprintf(stderr, "rank %d: libep dispatched on buffer %u, the "
				"bench expected %u\n", g_rank, o.buffer, R.b);
		exit(2);
	}
	R.io[o.buffer].recv_count = o.recv_count;
	R.io[o.buffer].layout = o.layout_range;
	R.io[o.buffer].src_info = o.src_info;
	if (o.buffer == R.b) {
		R.recv_count = o.recv_count;
		R.layout = o.layout_range;
		R.src_info = o.src_info;
	}
}

// The send half of a dispatch (with_recv: and the receive).
static void ll_dispatch_send(rank_ctx &R, const ekc_ll_args &a, int with_recv,
			     bool timed = false)
{
	if (g_libep) {
		ep_ll_recv o;
		// (UE8M0 without EP_LL_ROUND_SCALE: it implies the rounding)
		unsigned f = (with_recv ? 0 : EP_LL_HOOK) |
			     (a.fp8 ? EP_LL_FP8 : 0) |
			     (a.fp8 == EKC_LL_FP8_ROUND ? EP_LL_ROUND_SCALE : 0) |
			     (a.fp8 == EKC_LL_FP8_UE8M0 ? EP_LL_UE8M0 : 0);
		int rc = ep_ll_dispatch(R.g, (const void *)a.x,
					(const int64_t *)a.topk, a.T, f, R.st,
					&o);
		if (!a.fp8 != !o.recv_scales) {
			fprintf(stderr, "rank %d: recv_scales %p for fp8 mode "
					"%u\n", g_rank, o.recv_scales, a.fp8);
			exit(2);
		}
		if (rc != EP_ETOOBIG || a.T <= a.N)
			ep_ok(rc, "ep_ll_dispatch");
		ll_took(R, o, timed);
		return;
	}
	uint32_t wr = (uint32_t)with_recv;
	void *args[] = {(void *)&a, &wr};
	ll_kernel(R, (const void *)ekc_ll_dispatch, args);
}

static void ll_dispatch_hook(rank_ctx &R, const ekc_ll_args &a)
{
	if (g_libep) {
		ep_ok(ep_ll_dispatch_hook(R.g, a.buf, R.st), "ep_ll_dispatch_hook");
		return;
	}
	void *args[] = {(void *)&a};
	ll_kernel(R, (const void *)ekc_ll_dispatch_recv, args);
}

static void ll_combine_send(rank_ctx &R, const ekc_ll_args &a, int with_recv,
			    int pull)
{
	if (g_libep) {
		unsigned f = pull ? EP_LL_ZERO_COPY : with_recv ? 0 : EP_LL_HOOK;
		ep_ok(ep_ll_combine(R.g, R.timed ? R.b : a.buf, pull ? NULL : (const void *)a.ex,
				    (const float *)a.weights, (void *)a.out, f,
				    R.st),
		      "ep_ll_combine");
		return;
	}
	uint32_t wr = (uint32_t)with_recv;
	void *args[] = {(void *)&a, &wr};
	ll_kernel(R, pull ? (const void *)ekc_ll_combine_pull
			  : (const void *)ekc_ll_combine,
		  args);
}

static void ll_combine_hook(rank_ctx &R, const ekc_ll_args &a)
{
	if (g_libep) {
		ep_ok(ep_ll_combine_hook(R.g, a.buf, R.st), "ep_ll_combine_hook");
		return;
	}
	void *args[] = {(void *)&a};
	ll_kernel(R, (const void *)ekc_ll_combine_recv, args);
}

static void launch_dispatch(rank_ctx &R, const ekc_ll_args &a, int hook,
			    bool timed = false)
{
	ll_dispatch_send(R, a, !hook, timed);
	if (hook)
		ll_dispatch_hook(R, a);
}

static void launch_combine(rank_ctx &R, const ekc_ll_args &a, int hook,
			   int pull = 0)
{
	ll_combine_send(R, a, !hook, pull);
	if (hook && !pull)
		ll_combine_hook(R, a);
}

// The error bits (EKC_LL_*) the kernels raised, and in libep mode cleared.
static uint32_t err_word(rank_ctx &R)
{
	if (g_libep) {
		switch (ep_ll_error(R.g)) {
		case 0: return 0;
		case EP_ETIMEDOUT: return EKC_LL_ETIMEDOUT;
		case EP_EEXPERT: return EKC_LL_EEXPERT;
		case EP_ETOOBIG: return EKC_LL_ETOOBIG;
		default: return EKC_LL_EPEER;
		}
	}
	uint32_t v;
	CK(cudaMemcpy(&v, R.priv + 4 * EKC_LL_PRIV_ERR, 4,
		      cudaMemcpyDeviceToHost));
	return v;
}

static int bad(const char *cfgname, uint64_t it, const char *what)
{
	fprintf(stderr, "FAIL: rank %d, %s, iteration %llu: %s\n", g_rank,
		cfgname, (unsigned long long)it, what);
	return 1;
}

// Upload rank r's inputs of iteration it (and, with all_ex, every row of
// its expert input).
static void upload(rank_ctx &R, const cfg &c, uint64_t it, uint32_t T,
		   const std::vector<int64_t> &topk, const std::vector<float> &w)
{
	std::vector<uint16_t> x((size_t)T * c.H);
	for (uint32_t t = 0; t < T; t++)
		for (uint32_t col = 0; col < c.H; col++)
			x[(size_t)t * c.H + col] = val_x(it, R.r, t, col);
	if (T) {
		CK(cudaMemcpyAsync(R.x, x.data(), x.size() * 2,
				   cudaMemcpyHostToDevice, R.st));
		CK(cudaMemcpyAsync(R.topk, topk.data(), topk.size() * 8,
				   cudaMemcpyHostToDevice, R.st));
		CK(cudaMemcpyAsync(R.w, w.data(), w.size() * 4,
				   cudaMemcpyHostToDevice, R.st));
	}
	CK(cudaStreamSynchronize(R.st));
}

// The expert input rows (el, p) for p < rows[el] of iteration it.
static uint16_t *ex_dst(rank_ctx &R, const cfg &c)
{
	if (!c.pull)
		return R.ex;
	if (g_libep) {
		void *p;
		ep_ok(ep_ll_combine_buffer(R.g, R.b, &p), "ep_ll_combine_buffer");
		return (uint16_t *)p;
	}
	ekc_ll_layout L;
	ekc_ll_layout_of(R.W, c.N, c.H, c.E / R.W, c.K, &L);
	return (uint16_t *)(R.pub + L.cx[R.b]);
}

static void upload_ex(rank_ctx &R, const cfg &c, uint64_t it,
		      const std::vector<uint32_t> &rows)
{
	uint16_t *dst = ex_dst(R, c);
	const uint32_t El = c.E / R.W, WN = R.W * c.N;
	std::vector<uint16_t> e;
	for (uint32_t el = 0; el < El; el++) {
		e.resize((size_t)rows[el] * c.H);
		for (uint32_t p = 0; p < rows[el]; p++)
			for (uint32_t col = 0; col < c.H; col++)
				e[(size_t)p * c.H + col] =
					val_e(it, R.r, el, p, col);
		// on the ranks' stream, as upload: a cudaMemcpy from pageable
		// memory may return before its DMA lands, and the combine
		// on the non-blocking stream would not wait for it
		if (rows[el]) {
			CK(cudaMemcpyAsync(dst + (size_t)el * WN * c.H, e.data(),
					   e.size() * 2, cudaMemcpyHostToDevice,
					   R.st));
			CK(cudaStreamSynchronize(R.st));
		}
	}
}

// Check rank r's dispatch outputs and combine output of iteration it
// against the reference built from every rank's routing.
static int check(rank_ctx &R, const cfg &c, uint64_t it, int check_combine)
{
	const uint32_t W = R.W, El = c.E / W, WN = W * c.N, H = c.H;
	std::vector<uint32_t> Ts(W);
	std::vector<std::vector<int64_t>> tks(W);
	std::vector<std::vector<float>> ws(W);
	for (uint32_t s = 0; s < W; s++)
		route(c, W, it, s, Ts[s], tks[s], ws[s]);
	if (c.toobig && it == 1 && W > 1)
		Ts[1] = 0; // it took part with no rows
	// Receive side of this rank.
	std::vector<uint32_t> cur(El, 0);
	std::vector<int64_t> lay((size_t)El * W);
	std::vector<int32_t> src((size_t)El * WN, -1);
	std::vector<uint32_t> from_s((size_t)El * WN), from_t((size_t)El * WN);
	for (uint32_t s = 0; s < W; s++) {
		std::vector<uint32_t> before(cur);
		for (uint32_t i = 0; i < Ts[s] * c.K; i++) {
			int64_t e = tks[s][i];
			if (e < 0 || e / El != R.r)
				continue;
			uint32_t el = (uint32_t)(e % El), p = cur[el]++;
			src[(size_t)el * WN + p] = (int32_t)(i / c.K);
			from_s[(size_t)el * WN + p] = s;
			from_t[(size_t)el * WN + p] = i / c.K;
		}
		for (uint32_t el = 0; el < El; el++)
			lay[(size_t)el * W + s] =
				(int64_t)((uint64_t)before[el] << 32 |
					  (cur[el] - before[el]));
	}
	std::vector<int32_t> g_cnt(El), g_src((size_t)El * WN);
	std::vector<int64_t> g_lay((size_t)El * W);
	CK(cudaMemcpy(g_cnt.data(), R.recv_count, El * 4, cudaMemcpyDeviceToHost));
	CK(cudaMemcpy(g_lay.data(), R.layout, g_lay.size() * 8,
		      cudaMemcpyDeviceToHost));
	CK(cudaMemcpy(g_src.data(), R.src_info, g_src.size() * 4,
		      cudaMemcpyDeviceToHost));
	for (uint32_t el = 0; el < El; el++)
		if ((uint32_t)g_cnt[el] != cur[el])
			return bad(c.name, it, "recv_count");
	if (g_lay != lay)
		return bad(c.name, it, "layout_range");
	if (g_src != src)
		return bad(c.name, it, "src_info");
	ekc_ll_layout L;
	ekc_ll_layout_of(W, c.N, H, El, c.K, &L);
	const uint32_t par = R.b;
	std::vector<uint16_t> row(H), want(H);
	std::vector<uint8_t> q(H), wq(H);
	std::vector<uint32_t> wsc;
	// a fp8 dispatch's scales, [El][nsc][W*N] words: read once
	const uint32_t nsc = c.fp8 == EKC_LL_FP8_UE8M0 ? H / 512 : H / 128;
	std::vector<uint32_t> gsc(c.fp8 ? (size_t)El * nsc * WN : 0);
	if (c.fp8)
		CK(cudaMemcpy(gsc.data(), R.pub + L.sc[par], gsc.size() * 4,
			      cudaMemcpyDeviceToHost));
	for (uint32_t el = 0; el < El; el++)
		for (uint32_t p = 0; p < cur[el]; p++) {
			size_t j = (size_t)el * WN + p;
			for (uint32_t col = 0; col < H; col++)
				want[col] = val_x(it, from_s[j], from_t[j], col);
			if (!c.fp8) {
				CK(cudaMemcpy(row.data(),
					      R.pub + L.rx[par] + j * H * 2,
					      H * 2, cudaMemcpyDeviceToHost));
				if (row != want)
					return bad(c.name, it, "recv_x row");
				continue;
			}
			CK(cudaMemcpy(q.data(), R.pub + L.rx[par] + j * H, H,
				      cudaMemcpyDeviceToHost));
			ref_cast(want.data(), H, c.fp8, wq.data(), wsc);
			if (q != wq)
				return bad(c.name, it, "recv_x fp8 row");
			for (uint32_t g = 0; g < nsc; g++)
				if (gsc[((size_t)el * nsc + g) * WN + p] != wsc[g])
					return bad(c.name, it, "recv_x scale");
		}
	if (!check_combine)
		return 0;
	// Combine at home: where each of this rank's (t, k) landed on its
	// expert's rank, then the weighted sum of those rows.
	std::vector<uint32_t> base(c.E, 0), mine(c.E, 0);
	for (uint32_t s = 0; s < R.r; s++)
		for (uint32_t i = 0; i < Ts[s] * c.K; i++)
			if (tks[s][i] >= 0)
				base[tks[s][i]]++;
	const uint32_t T = Ts[R.r];
	std::vector<uint16_t> got((size_t)T * H);
	if (T)
		CK(cudaMemcpy(got.data(), R.out, got.size() * 2,
			      cudaMemcpyDeviceToHost));
	std::vector<float> acc(H);
	for (uint32_t t = 0; t < T; t++) {
		std::fill(acc.begin(), acc.end(), 0.0f);
		for (uint32_t k = 0; k < c.K; k++) {
			int64_t e = tks[R.r][t * c.K + k];
			if (e < 0)
				continue;
			uint32_t d = (uint32_t)(e / El), el = (uint32_t)(e % El);
			uint32_t p = base[e] + mine[e]++;
			float wk = ws[R.r][t * c.K + k];
			for (uint32_t col = 0; col < H; col++) {
				volatile float term = bf(val_e(it, d, el, p, col)) * wk;
				acc[col] = acc[col] + term;
			}
		}
		for (uint32_t col = 0; col < H; col++)
			if (got[(size_t)t * H + col] != f2bf(acc[col])) {
				// what differs: zeros or stale rows point at the
				// inputs, a shifted value at the places
				fprintf(stderr, "rank %d: token %u channel %u: "
						"0x%04x, want 0x%04x\n",
					g_rank, t, col, got[(size_t)t * H + col],
					f2bf(acc[col]));
				return bad(c.name, it, "combined row");
			}
	}
	return 0;
}

// The start of a timed iteration: every rank's stream waits in this
// kernel until the GPU's global timer reaches the common deadline, so that
// the ops after it start together and with their launches already queued
// (the times are the GPU's, not the host's launch latency or skew).
__global__ void ll_gate(uint64_t deadline, uint32_t *late)
{
	if (now_ns() > deadline)
		atomicAdd(late, 1);
	while (now_ns() < deadline)
		;
}

__global__ void ll_clock(uint64_t *t) { *t = now_ns(); }

static double ms_between(cudaEvent_t a, cudaEvent_t b)
{
	float ms;
	CK(cudaEventElapsedTime(&ms, a, b));
	return ms;
}

static double median(std::vector<double> v)
{
	std::sort(v.begin(), v.end());
	return v.empty() ? 0 : v[v.size() / 2];
}

// Each wait ends with the last rank of its iteration, which the medians
// of each rank's stamps hide: per iteration, the latest rank's stamp of
// one stage (the last post) and the earliest rank's of the next (the
// first to see it); the medians over the iterations of those.
static double it_ext(uint32_t W, uint32_t i, int j, bool latest)
{
	double v = latest ? -1e9 : 1e9;
	for (uint32_t s = 0; s < W; s++) {
		const double x = g_sh->it[s][i][j];
		if (x < 0)
			return -1; // a rank without the stamp
		v = latest ? std::max(v, x) : std::min(v, x);
	}
	return v;
}

static void skew_line(const cfg &c, uint32_t W)
{
	enum { ST, ST0, PL, CN, FL, RC, CS, CF, CR, NX };
	// each column's stage and whether its latest rank counts (a post)
	// or its earliest (a sight)
	static const struct { int stage; bool latest; } col[NX] = {
		{EKC_LL_TR_D_MAXSTART, true}, {EKC_LL_TR_D_START, false},
		{EKC_LL_TR_D_PLAN, true}, {EKC_LL_TR_D_CNT, false},
		{EKC_LL_TR_D_FLAGS, true}, {EKC_LL_TR_D_RECV, false},
		{EKC_LL_TR_C_MAXSTART, true}, {EKC_LL_TR_C_FLAGS, true},
		{EKC_LL_TR_C_RECV, false}};
	std::vector<double> v[NX];
	for (uint32_t i = 0; i < g_sh->nit; i++)
		for (int k = 0; k < NX; k++) {
			const double x = it_ext(W, i, col[k].stage, col[k].latest);
			if (x >= 0)
				v[k].push_back(x);
		}
	// zero copy: no flags stage in the combine; its ready flags go out
	// as its blocks start
	const int cf = v[CF].empty() ? CS : CF;
	printf("skew: ll %s%s%s, per iteration (median of %u): last block "
	       "started %.1f us (first rank's block 0 %.1f); counts: last "
	       "posted %.1f, first seen %.1f; done flags: last %.1f, first "
	       "seen %.1f; combine: last %s %.1f, first seen %.1f\n",
	       c.name, c.fp8 ? " (fp8 dispatch)" : "",
	       c.pull ? " (zero-copy combine)" : "", g_sh->nit, median(v[ST]),
	       median(v[ST0]), median(v[PL]), median(v[CN]), median(v[FL]),
	       median(v[RC]), cf == CF ? "flags" : "block started",
	       median(v[cf]), median(v[CR]));
}

// Read+write ceiling: a device-to-device copy of 1 GiB (GB/s counting both).
static double d2d(rank_ctx &R)
{
	size_t n = 1ull << 30;
	void *a, *b;
	CK(cudaMalloc(&a, n));
	CK(cudaMalloc(&b, n));
	fill_rand<<<264, 512, 0, R.st>>>((uint16_t *)a, n / 2, 7);
	cudaEvent_t e0, e1;
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	std::vector<double> t;
	for (int i = 0; i < 7; i++) {
		CK(cudaEventRecord(e0, R.st));
		CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, R.st));
		CK(cudaEventRecord(e1, R.st));
		CK(cudaEventSynchronize(e1));
		t.push_back(ms_between(e0, e1));
	}
	CK(cudaFree(a));
	CK(cudaFree(b));
	return 2.0 * n / (median(t) / 1e3) / 1e9;
}

static int run_cfg(rank_ctx &R, const cfg &c)
{
	const uint32_t W = R.W, El = c.E / W;
	ekc_ll_layout L;
	ekc_ll_layout_of(W, c.N, c.H, El, c.K, &L);
	// A fresh shape: no tag of an earlier one may be mistaken for this
	// one's (every rank clears its flags before any rank starts).
	bar();
	if (!g_libep)
		CK(cudaMemset(R.pub, 0, L.flags_end));
	CK(cudaDeviceSynchronize());
	bar();
	int fail = 0;
	R.timed = c.timed;
	if (c.timed) {
		uint32_t T = c.N;
		std::vector<int64_t> topk;
		std::vector<float> w;
		gen_route(c, W, 12345, R.r, T, topk, w);
		upload(R, c, 12345, T, topk, w);
		fill_rand<<<264, 512, 0, R.st>>>(R.ex, (uint64_t)El * W * c.N * c.H,
						 mix(R.r));
		CK(cudaGetLastError());
		for (int p = 0; p < 2; p++) {
			fill_rand<<<264, 512, 0, R.st>>>(
				(uint16_t *)(R.pub + L.cx[p]),
				(uint64_t)El * W * c.N * c.H, mix(R.r + 77 * p));
			CK(cudaGetLastError());
		}
		ekc_ll_args a = make_args(R, c, T);
		cudaEvent_t e[3];
		for (auto &x : e)
			CK(cudaEventCreate(&x));
		for (int i = 0; i < 10; i++) {
			launch_dispatch(R, a, 0, true);
			launch_combine(R, a, 0, c.pull);
		}
		CK(cudaStreamSynchronize(R.st));
		int iters = getenv("EPD_LL_ITERS") ? atoi(getenv("EPD_LL_ITERS")) : 200;
		std::vector<double> td, tc;
		std::vector<std::vector<double>> trs(EKC_LL_TR_N);
		uint64_t *dclk, *dtr;
		uint32_t *dlate, late = 0;
		CK(cudaMalloc(&dclk, 8));
		CK(cudaMalloc(&dtr, 8 * EKC_LL_TR_N));
		CK(cudaMalloc(&dlate, 4));
		CK(cudaMemset(dlate, 0, 4));
		ekc_ll_args at = a;
		at.trace = (uint64_t)dtr;
		if (g_libep) { // and libep's grid, for the report
			const int nb = ep__ll_trace(R.g, (uint64_t)dtr);
			ep_ok(nb < 0 ? nb : 0, "ep__ll_trace");
			R.G = (uint32_t)nb;
		}
		for (int i = 0; i < iters; i++) {
			bar();
			if (R.r == 0) {
				uint64_t now;
				ll_clock<<<1, 1, 0, R.st>>>(dclk);
				CK(cudaMemcpy(&now, dclk, 8, cudaMemcpyDeviceToHost));
				g_sh->start = now + 2000000; // 2 ms on
			}
			bar();
			const uint64_t start = g_sh->start;
			CK(cudaMemsetAsync(dtr, 0, 8 * EKC_LL_TR_N, R.st));
			ll_gate<<<1, 1, 0, R.st>>>(start, dlate);
			CK(cudaGetLastError());
			CK(cudaEventRecord(e[0], R.st));
			launch_dispatch(R, at, 0, true);
			CK(cudaEventRecord(e[1], R.st));
			launch_combine(R, at, 0, c.pull);
			CK(cudaEventRecord(e[2], R.st));
			CK(cudaEventSynchronize(e[2]));
			td.push_back(ms_between(e[0], e[1]) * 1e3);
			tc.push_back(ms_between(e[1], e[2]) * 1e3);
			uint64_t st[EKC_LL_TR_N];
			CK(cudaMemcpy(st, dtr, sizeof(st), cudaMemcpyDeviceToHost));
			for (int j = 0; j < EKC_LL_TR_N; j++)
				trs[j].push_back(st[j] ? ((double)st[j] - start) / 1e3
						       : -1.0);
		}
		if (g_libep)
			ep_ok(ep__ll_trace(R.g, 0) < 0 ? -1 : 0, "ep__ll_trace");
		CK(cudaMemcpy(&late, dlate, 4, cudaMemcpyDeviceToHost));
		for (int j = 0; j < EKC_LL_TR_N; j++) {
			g_sh->tr[R.r][j] = median(trs[j]);
			for (size_t i = 0; i < trs[j].size() && i < LL_IT_MAX; i++)
				g_sh->it[R.r][i][j] = (float)trs[j][i];
		}
		g_sh->nit = std::min(iters, LL_IT_MAX);
		g_sh->late[R.r] = late;
		CK(cudaFree(dclk));
		CK(cudaFree(dtr));
		CK(cudaFree(dlate));
		bar();
		const int pairs = 100;
		CK(cudaEventRecord(e[0], R.st));
		for (int i = 0; i < pairs; i++) {
			launch_dispatch(R, a, 0, true);
			launch_combine(R, a, 0, c.pull);
		}
		CK(cudaEventRecord(e[1], R.st));
		CK(cudaEventSynchronize(e[1]));
		double pair = ms_between(e[0], e[1]) * 1e3 / pairs;
		uint32_t err = err_word(R);
		if (err)
			fail |= bad(c.name, 0, "error word set");
		uint64_t rows = 0;
		for (auto v : topk)
			rows += v >= 0;
		g_sh->res[R.r][0] = median(td);
		g_sh->res[R.r][1] = median(tc);
		g_sh->res[R.r][2] = pair;
		g_sh->bytes[R.r][0] = (uint64_t)T * c.H * 2 +
				      rows * (c.fp8 ? c.H + c.H / 32 : c.H * 2);
		g_sh->bytes[R.r][1] = ((uint64_t)(c.pull ? 1 : 3) * rows + T) *
				      c.H * 2;
		bar();
		if (R.r == 0) {
			double ceil = d2d(R);
			double md = 0, mc = 0, mp = 0, bd = 0, bc = 0;
			for (uint32_t s = 0; s < W; s++) {
				md = std::max(md, g_sh->res[s][0]);
				mc = std::max(mc, g_sh->res[s][1]);
				mp = std::max(mp, g_sh->res[s][2]);
				bd += g_sh->bytes[s][0];
				bc += g_sh->bytes[s][1];
			}
			printf("perf: ll %s%s%s%s, %u ranks, %u blocks each: dispatch "
			       "%.1f us (rank 0 %.1f), combine %.1f us (rank 0 "
			       "%.1f), back-to-back pair %.1f us; per GPU "
			       "%.2f / %.2f of D2D (D2D %.0f GB/s; %.1f / %.1f MB)\n",
			       c.name, c.fp8 ? " (fp8 dispatch)" : "",
			       c.pull ? " (zero-copy combine)" : "",
			       g_libep ? " via libep" : "", W, R.G, md, g_sh->res[0][0], mc,
			       g_sh->res[0][1], mp,
			       bd / (md / 1e6) / 1e9 / ceil,
			       bc / (mc / 1e6) / 1e9 / ceil, ceil, bd / 1e6,
			       bc / 1e6);
			// Where the time goes: each stage's median stamp after the
			// common start, the latest rank's (and the earliest).
			static const char *nm[EKC_LL_TR_N] = {
				"d.start", "d.plan", "d.counts", "d.copy",
				"d.flags", "d.recv", "d.end", "d.maxstart",
				"d.maxend", "c.start", "c.copy", "c.flags",
				"c.recv", "c.end", "c.maxstart", "c.maxend"};
			uint32_t lt = 0;
			printf("trace: ll %s%s%s, us after the common start "
			       "(latest rank / earliest):",
			       c.name, c.fp8 ? " (fp8 dispatch)" : "",
			       c.pull ? " (zero-copy combine)" : "");
			for (int j = 0; j < EKC_LL_TR_N; j++) {
				double hi = -1e9, lo = 1e9;
				for (uint32_t s = 0; s < W; s++) {
					hi = std::max(hi, g_sh->tr[s][j]);
					lo = std::min(lo, g_sh->tr[s][j]);
				}
				if (hi >= 0)
					printf(" %s %.1f/%.1f", nm[j], hi, lo);
			}
			for (uint32_t s = 0; s < W; s++)
				lt += g_sh->late[s];
			printf("; late gates %u\n", lt);
			skew_line(c, W);
		}
		bar();
		return fail;
	}
	if (c.graph) {
		uint32_t T;
		std::vector<int64_t> topk;
		std::vector<float> w;
		// T fixed by the capture: the replays' routing and data change.
		route(c, W, 0, R.r, T, topk, w);
		ekc_ll_args a = make_args(R, c, T);
		cudaGraph_t g;
		cudaGraphExec_t ge;
		CK(cudaStreamBeginCapture(R.st, cudaStreamCaptureModeThreadLocal));
		launch_dispatch(R, a, 0);
		launch_combine(R, a, 0, c.pull);
		CK(cudaStreamEndCapture(R.st, &g));
		CK(cudaGraphInstantiate(&ge, g, 0));
		int n = getenv("EPD_LL_REPLAYS") ? atoi(getenv("EPD_LL_REPLAYS")) : 1000;
		const uint32_t WN = W * c.N;
		std::vector<uint32_t> all(El, WN);
		for (int it = 1; it <= n && !fail; it++) {
			// iteration it's routing, with every rank's T as captured
			std::vector<int64_t> tk2;
			std::vector<float> w2;
			uint32_t T2;
			route(c, W, it, R.r, T2, tk2, w2);
			upload(R, c, it, T2, tk2, w2);
			upload_ex(R, c, it, all);
			CK(cudaGraphLaunch(ge, R.st));
			CK(cudaStreamSynchronize(R.st));
			if (err_word(R))
				fail |= bad(c.name, it, "error word set");
			else
				fail |= check(R, c, it, 1);
		}
		CK(cudaGraphExecDestroy(ge));
		CK(cudaGraphDestroy(g));
		return fail;
	}
	if (c.tbo) {
		// Two micro-batches: dispatch A and B (receive hooks split off),
		// both hooks, then A's and B's combines; B's routing is that of
		// iteration it + 50000.
		for (int it = 1; it <= c.iters && !fail; it++) {
			const uint64_t id[2] = {(uint64_t)it, (uint64_t)it + 50000};
			ekc_ll_args a[2];
			for (uint32_t b = 0; b < 2; b++) {
				uint32_t T;
				std::vector<int64_t> topk;
				std::vector<float> w;
				use(R, b);
				gen_route(c, W, id[b], R.r, T, topk, w);
				upload(R, c, id[b], T, topk, w);
				a[b] = make_args(R, c, T);
			}
			for (uint32_t b = 0; b < 2; b++) {
				use(R, b);
				ll_dispatch_send(R, a[b], 0);
			}
			for (uint32_t b = 0; b < 2; b++)
				ll_dispatch_hook(R, a[b]);
			CK(cudaStreamSynchronize(R.st));
			if (err_word(R)) {
				fail |= bad(c.name, it, "error word set");
				break;
			}
			for (uint32_t b = 0; b < 2 && !fail; b++) {
				use(R, b);
				fail |= check(R, c, id[b], 0);
				std::vector<int32_t> cnt(El);
				CK(cudaMemcpy(cnt.data(), R.recv_count, El * 4,
					      cudaMemcpyDeviceToHost));
				std::vector<uint32_t> rows(cnt.begin(), cnt.end());
				upload_ex(R, c, id[b], rows);
			}
			for (uint32_t b = 0; b < 2; b++)
				ll_combine_send(R, a[b], 0, c.pull);
			if (!c.pull)
				for (uint32_t b = 0; b < 2; b++)
					ll_combine_hook(R, a[b]);
			CK(cudaStreamSynchronize(R.st));
			if (err_word(R))
				fail |= bad(c.name, it, "error word set (combine)");
			for (uint32_t b = 0; b < 2 && !fail; b++) {
				use(R, b);
				fail |= check(R, c, id[b], 1);
			}
		}
		use(R, 0);
		return fail;
	}
	for (int it = 1; it <= c.iters && !fail; it++) {
		use(R, (uint32_t)(it + 1) & 1); // 0, 1, 0, ...: as libep
		uint32_t T;
		std::vector<int64_t> topk;
		std::vector<float> w;
		gen_route(c, W, it, R.r, T, topk, w);
		uint32_t Tl = T;
		if (c.toobig && it == 1 && R.r == 1)
			Tl = c.N + 1;
		upload(R, c, it, T, topk, w);
		ekc_ll_args a = make_args(R, c, Tl);
		launch_dispatch(R, a, c.hook);
		CK(cudaStreamSynchronize(R.st));
		uint32_t err = err_word(R);
		if (c.toobig && it == 1) {
			// every rank learns of rank 1's excess at once
			if (err != EKC_LL_ETOOBIG)
				fail |= bad(c.name, it, "no ETOOBIG for too many "
							"tokens (on every rank)");
			if (!g_libep) // (libep cleared it)
				CK(cudaMemsetAsync(R.priv + 4 * EKC_LL_PRIV_ERR,
						   0, 4, R.st));
			err = 0;
		}
		if (err) {
			fail |= bad(c.name, it, "error word set");
			break;
		}
		fail |= check(R, c, it, 0);
		std::vector<int32_t> cnt(El);
		CK(cudaMemcpy(cnt.data(), R.recv_count, El * 4,
			      cudaMemcpyDeviceToHost));
		std::vector<uint32_t> rows(cnt.begin(), cnt.end());
		upload_ex(R, c, it, rows);
		if (c.toobig && it == 1 && R.r == 1)
			a.T = 0;
		launch_combine(R, a, c.hook, c.pull);
		CK(cudaStreamSynchronize(R.st));
		if (err_word(R))
			fail |= bad(c.name, it, "error word set (combine)");
		else if (!(c.toobig && it == 1 && R.r == 1))
			fail |= check(R, c, it, 1);
	}
	use(R, 0);
	return fail;
}

// libep mode: the configuration on a group of its own (joined here, left
// after), the region base from libep's combine buffer.
static int run_cfg_libep(rank_ctx &R, const cfg &c, int idx)
{
	char name[32];
	snprintf(name, sizeof(name), "bench_ll.%d", idx);
	ep_group_config gc;
	memset(&gc, 0, sizeof(gc));
	gc.name = name;
	gc.world_size = gc.ranks_per_node = R.W;
	gc.rank = R.r;
	gc.num_experts = c.E;
	gc.hidden = c.H;
	gc.max_tokens_per_rank = c.N;
	gc.topk = c.K;
	gc.dtype = EP_DTYPE_BF16;
	gc.timeout_ms = 10000;
	int dev;
	CK(cudaGetDevice(&dev));
	gc.cuda_device = dev;
	ep_ok(ep_join(R.conn, &gc, EP_JOIN_CUDA, &R.g), "ep_join");
	void *cx0;
	ep_ok(ep_ll_combine_buffer(R.g, 0, &cx0), "ep_ll_combine_buffer");
	ekc_ll_layout L;
	ekc_ll_layout_of(R.W, c.N, c.H, c.E / R.W, c.K, &L);
	uint8_t *own = R.pub;
	R.pub = (uint8_t *)cx0 - L.cx[0];
	use(R, 0);
	int f = run_cfg(R, c);
	CK(cudaStreamSynchronize(R.st));
	bar();
	ep_ok(ep_leave(R.g), "ep_leave");
	R.g = NULL;
	R.pub = own;
	for (auto &io : R.io) // the bench's own outputs again
		io.recv_count = io.own_count, io.layout = io.own_layout,
		io.src_info = io.own_src;
	use(R, 0);
	return f;
}

static const cfg cfgs[] = {
	{"small", 256, 32, 4, 32, 30, 0, 0, 0, 0, 0, 0},
	{"small hook", 512, 24, 6, 64, 20, 0, 1, 0, 0, 0, 0},
	{"small zero-copy", 512, 24, 6, 64, 20, 0, 0, 0, 0, 0, 1},
	{"odd", 136, 7, 3, 16, 20, 0, 0, 0, 0, 0, 0},
	{"too many tokens", 256, 16, 4, 32, 3, 0, 0, 0, 0, 1, 0},
	{"deepseek 128", 7168, 128, 8, 256, 3, 0, 0, 0, 0, 0, 0},
	{"deepseek 128 zero-copy", 7168, 128, 8, 256, 3, 0, 0, 0, 0, 0, 1},
	{"two micro-batches", 512, 24, 6, 64, 12, 0, 0, 0, 0, 0, 0, 1},
	{"two micro-batches zero-copy", 512, 24, 6, 64, 12, 0, 0, 0, 0, 0, 1, 1},
	{"two micro-batches deepseek", 7168, 64, 8, 256, 2, 0, 0, 0, 0, 0, 0, 1},
	{"graph", 256, 32, 4, 32, 0, 0, 0, 0, 1, 0, 0},
	{"graph zero-copy", 256, 32, 4, 32, 0, 0, 0, 0, 1, 0, 1},
	{"small fp8", 256, 32, 4, 32, 20, 0, 0, 0, 0, 0, 0, 0, EKC_LL_FP8},
	{"small fp8 rounded hook", 512, 24, 6, 64, 20, 0, 1, 0, 0, 0, 0, 0,
	 EKC_LL_FP8_ROUND},
	{"small ue8m0", 512, 24, 6, 64, 20, 0, 0, 0, 0, 0, 0, 0, EKC_LL_FP8_UE8M0},
	{"deepseek 128 fp8 zero-copy", 7168, 128, 8, 256, 3, 0, 0, 0, 0, 0, 1, 0,
	 EKC_LL_FP8},
	{"deepseek 128 ue8m0", 7168, 128, 8, 256, 2, 0, 0, 0, 0, 0, 0, 0,
	 EKC_LL_FP8_UE8M0},
	{"two micro-batches fp8", 512, 24, 6, 64, 12, 0, 0, 0, 0, 0, 0, 1,
	 EKC_LL_FP8},
	{"graph ue8m0", 512, 32, 4, 32, 0, 0, 0, 0, 1, 0, 0, 0, EKC_LL_FP8_UE8M0},
	{"1 token", 7168, 1, 8, 256, 0, 1, 0, 1, 0, 0, 0},
	{"32 tokens", 7168, 32, 8, 256, 0, 1, 0, 1, 0, 0, 0},
	{"128 tokens", 7168, 128, 8, 256, 0, 1, 0, 1, 0, 0, 0},
	{"1 token", 7168, 1, 8, 256, 0, 1, 0, 1, 0, 0, 1},
	{"32 tokens", 7168, 32, 8, 256, 0, 1, 0, 1, 0, 0, 1},
	{"128 tokens", 7168, 128, 8, 256, 0, 1, 0, 1, 0, 0, 1},
	{"1 token", 7168, 1, 8, 256, 0, 1, 0, 1, 0, 0, 1, 0, EKC_LL_FP8},
	{"32 tokens", 7168, 32, 8, 256, 0, 1, 0, 1, 0, 0, 1, 0, EKC_LL_FP8},
	{"128 tokens", 7168, 128, 8, 256, 0, 1, 0, 1, 0, 0, 1, 0, EKC_LL_FP8},
};

static int rank_main(uint32_t r, uint32_t W, uint32_t G)
{
	g_rank = (int)r;
	int ngpu;
	CK(cudaGetDeviceCount(&ngpu));
	CK(cudaSetDevice((int)(r % ngpu)));
	rank_ctx R;
	memset(&R, 0, sizeof(R));
	R.r = r;
	R.W = W;
	R.G = G;
	R.timeout_ns = 10ull * 1000000000ull;
	// EPD_LL_SYS_SCOPE=1: system-scope flags even on one GPU (to compare)
	R.one_gpu = ngpu == 1 && !(getenv("EPD_LL_SYS_SCOPE") &&
				   !strcmp(getenv("EPD_LL_SYS_SCOPE"), "1"));
	uint64_t pub = 0, priv = 0, xs = 0, exs = 0, ks = 0, el = 0, eln = 0;
	for (const cfg &c : cfgs) {
		if (c.E % W || c.E / W * W > EKC_LL_MAXE) {
			fprintf(stderr, "%s: %u experts over %u ranks\n", c.name, c.E, W);
			return 1;
		}
		ekc_ll_layout L;
		ekc_ll_layout_of(W, c.N, c.H, c.E / W, c.K, &L);
		pub = std::max(pub, L.total);
		priv = std::max(priv, L.priv_total);
		xs = std::max(xs, (uint64_t)(c.N + 1) * c.H);
		ks = std::max(ks, (uint64_t)(c.N + 1) * c.K);
		exs = std::max(exs, (uint64_t)c.E / W * W * c.N * c.H);
		el = std::max(el, (uint64_t)c.E / W * W);
		eln = std::max(eln, (uint64_t)c.E / W * W * c.N);
	}
	CK(cudaMalloc(&R.pub, pub));
	CK(cudaMalloc(&R.priv, priv));
	CK(cudaMemset(R.pub, 0, pub));
	CK(cudaMemset(R.priv, 0, priv));
	for (auto &io : R.io) {
		CK(cudaMalloc(&io.x, xs * 2));
		CK(cudaMalloc(&io.out, xs * 2));
		CK(cudaMalloc(&io.ex, exs * 2));
		CK(cudaMalloc(&io.topk, ks * 8));
		CK(cudaMalloc(&io.w, ks * 4));
		CK(cudaMalloc(&io.recv_count, el * 4));
		CK(cudaMalloc(&io.layout, el * 8));
		CK(cudaMalloc(&io.src_info, eln * 4));
		io.own_count = io.recv_count;
		io.own_layout = io.layout;
		io.own_src = io.src_info;
	}
	use(R, 0);
	CK(cudaStreamCreateWithFlags(&R.st, cudaStreamNonBlocking));
	// EPD_LL_CARVEOUT=p: the kernels' preferred shared memory carveout
	// (a change of the SMs' split between kernels costs time)
	if (getenv("EPD_LL_CARVEOUT")) {
		int pc = atoi(getenv("EPD_LL_CARVEOUT"));
		const void *fns[] = {(const void *)ekc_ll_dispatch,
				     (const void *)ekc_ll_dispatch_recv,
				     (const void *)ekc_ll_combine,
				     (const void *)ekc_ll_combine_recv,
				     (const void *)ekc_ll_combine_pull,
				     (const void *)ll_gate};
		for (const void *f : fns)
			CK(cudaFuncSetAttribute(
				f, cudaFuncAttributePreferredSharedMemoryCarveout,
				pc));
	}
	CK(cudaIpcGetMemHandle(&g_sh->h[r], R.pub));
	bar();
	for (uint32_t d = 0; d < W; d++) {
		void *p = R.pub;
		if (d != r)
			CK(cudaIpcOpenMemHandle(&p, g_sh->h[d],
						cudaIpcMemLazyEnablePeerAccess));
		R.peer[d] = (uint64_t)p;
	}
	bar();
	int fail = 0;
	const char *only = getenv("EPD_LL_ONLY"); // "timed": no checks
	if (g_libep)
		ep_ok(ep_connect(getenv("EPD_SOCKET"), &R.conn), "ep_connect");
	int idx = 0;
	for (const cfg &c : cfgs) {
		idx++;
		if (only && !strcmp(only, "timed") && !c.timed)
			continue;
		if (g_libep && c.H % 128) {
			if (r == 0)
				printf("skip: %s through libep (hidden %u: a "
				       "group's is a multiple of 128)\n",
				       c.name, c.H);
			continue;
		}
		int f = g_libep ? run_cfg_libep(R, c, idx) : run_cfg(R, c);
		if (!f && r == 0 && !c.timed)
			printf("ok: %s%s (hidden %u, %u tokens max, top-%u of %u, "
			       "%s%s%s%s): every rank bitwise equal to the reference\n",
			       c.name, g_libep ? " via libep" : "", c.H, c.N, c.K, c.E,
			       c.graph ? "graph replays"
			       : c.tbo ? "two micro-batches in flight, hooks"
			       : c.hook ? "receive hook" : "one launch each",
			       c.pull ? ", zero-copy combine" : "",
			       c.fp8 == EKC_LL_FP8 ? ", fp8 dispatch"
			       : c.fp8 == EKC_LL_FP8_ROUND ? ", fp8 dispatch, scales 2^n"
			       : c.fp8 ? ", fp8 dispatch, UE8M0 scales" : "",
			       c.toobig ? ", rank 1 over its budget once: "
					  "ETOOBIG on every rank, the others' rows served" : "");
		fflush(stdout);
		fail |= f;
		if (fail)
			break;
	}
	bar();
	return fail;
}

int main(void)
{
	uint32_t W = getenv("EPD_LL_RANKS") ? atoi(getenv("EPD_LL_RANKS")) : 8;
	uint32_t G = getenv("EPD_LL_BLOCKS") ? atoi(getenv("EPD_LL_BLOCKS")) : 16;
	g_libep = getenv("EPD_LL_LIBEP") && !strcmp(getenv("EPD_LL_LIBEP"), "1");
	g_pdl = getenv("EPD_LL_PDL") && !strcmp(getenv("EPD_LL_PDL"), "1");
	if (g_libep) { // libep launches the same grid (EPD_LL_BLOCKS; else
		       // its own choice), the same way
		char v[16];
		snprintf(v, sizeof(v), "%u", G);
		if (getenv("EPD_LL_BLOCKS"))
			setenv("EP_LL_BLOCKS", v, 1);
		setenv("EP_LL_PDL", g_pdl ? "1" : "0", 1);
	}
	if (W < 1 || W > EKC_LL_MAXW || G < 1) {
		fprintf(stderr, "bad EPD_LL_RANKS / EPD_LL_BLOCKS\n");
		return 2;
	}
	setenv("CUDA_MODULE_LOADING", "EAGER", 1);
	g_sh = (struct shm *)mmap(NULL, sizeof(struct shm),
				  PROT_READ | PROT_WRITE,
				  MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (g_sh == MAP_FAILED)
		return 2;
	pthread_barrierattr_t ba;
	pthread_barrierattr_init(&ba);
	pthread_barrierattr_setpshared(&ba, PTHREAD_PROCESS_SHARED);
	pthread_barrier_init(&g_sh->bar, &ba, W);
	std::vector<pid_t> kids;
	for (uint32_t r = 0; r < W; r++) {
		pid_t p = fork();
		if (p == 0)
			_exit(rank_main(r, W, G));
		kids.push_back(p);
	}
	int fail = 0;
	for (uint32_t n = 0; n < W; n++) {
		int st;
		pid_t p = wait(&st);
		if (p < 0)
			break;
		if (!WIFEXITED(st) || WEXITSTATUS(st)) {
			fail = 1; // a rank failed: the others would wait for it
			for (pid_t k : kids)
				kill(k, SIGKILL);
		}
	}
	printf(fail ? "FAIL: bench_ll\n" : "ok: bench_ll\n");
	return fail;
}
