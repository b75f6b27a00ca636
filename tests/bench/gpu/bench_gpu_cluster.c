/* SPDX-License-Identifier: MIT */
/*
 * GPU ranks across nodes against the ceilings that bound them, all
 * measured in one run on this machine: N daemons (nodes n0.., tcp on
 * loopback, all on GPU 0) with R GPU ranks each (EPD_BENCH_NODES, default
 * "2 4"; EPD_BENCH_RPN, default 2), two shapes: DeepSeek-V3's (4096 tokens
 * a rank, hidden 7168, top-8 of 256 experts) and a decode step's (128
 * tokens a rank, the same model). Inputs are random (bf16 rows of mixed
 * magnitude and sign, top-k of distinct random experts), never zeros.
 *
 * Reported, each op timed on every rank after a CPU line-up of all ranks
 * (the slowest rank's mean):
 *  - barrier: 200 stream barriers back to back, per barrier; against the
 *    host ranks' barrier across the same daemons plus the GPU ranks'
 *    barrier on one daemon (the target: at most 1.3 x that sum);
 *  - dispatch and combine: the rows that cross between nodes per second
 *    (a row to each destination rank on another node, hidden x 2 bytes),
 *    against the smaller of one loopback tcp stream between two sockets
 *    and the device<->host copy (the target: at least 0.7 of it), and
 *    the host ranks' figures for the same ops across the same daemons.
 * Also measured: the loopback round trip (a 1-byte ping-pong), the ceiling
 * of a barrier's hand-offs between nodes.
 *
 * Not a test: it prints perf lines and fails only if something breaks.
 * Exit 77 without a GPU, unless EPD_BENCH_HOST_ONLY=1 (the host ranks'
 * figures and the tcp ceiling alone; EPD_BENCH_TOKENS shrinks the
 * prefill's tokens a rank).
 */
#include "gpu_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAXN 4
#define MAXR 16
#define BAR_ITERS 200

struct shape {
	const char *name;
	uint32_t T, H, K, E;
	int iters;
};

struct ctx {
	struct th_daemon d[MAXN];
	int nodes, rpn, gpu, one_node; /* this run's layout */
	struct shape s;
	char name[32];
	uint64_t seed;
	uint32_t arrive, gen;
	double bar_us[MAXR], disp_us[MAXR], comb_us[MAXR];
	uint64_t cross[MAXR]; /* rows this rank sends to other nodes */
	double d2h_gbs, h2d_gbs;
};

static void line_up(struct ctx *x)
{
	tg_line_up(&x->arrive, &x->gen, (uint32_t)(x->nodes * x->rpn));
}

/* Rank r's routing: top-k distinct random experts per token. */
static void routing(const struct ctx *x, int r, int64_t *topk)
{
	uint64_t s = x->seed * 1000003u + (uint64_t)r;
	for (uint32_t t = 0; t < x->s.T; t++)
		for (uint32_t k = 0; k < x->s.K; k++) {
			int64_t e;
			bool again;
			do {
				e = (int64_t)(th_rnd(&s) % x->s.E);
				again = false;
				for (uint32_t j = 0; j < k; j++)
					again |= topk[t * x->s.K + j] == e;
			} while (again);
			topk[t * x->s.K + k] = e;
		}
}

/* Rows rank r sends across nodes: one per (token, destination rank on
 * another node that hosts one of its experts). */
static uint64_t crossing(const struct ctx *x, int r, const int64_t *topk)
{
	const uint32_t W = (uint32_t)(x->nodes * x->rpn), per = x->s.E / W;
	uint64_t n = 0;
	for (uint32_t t = 0; t < x->s.T; t++) {
		bool seen[MAXR] = {false};
		for (uint32_t k = 0; k < x->s.K; k++) {
			const uint32_t d = (uint32_t)topk[t * x->s.K + k] / per;
			if (!seen[d] && (int)d / x->rpn != r / x->rpn)
				n++;
			seen[d] = true;
		}
	}
	return x->one_node ? 0 : n;
}

static int bench_rank(int r, void *arg)
{
	struct ctx *x = arg;
	const uint32_t W = (uint32_t)(x->nodes * x->rpn), T = x->s.T,
		       H = x->s.H, K = x->s.K;
	CUstream st = NULL;
	int gpu = -1;
	if (x->gpu) {
		static uint32_t dummy;
		CUdeviceptr unused;
		st = tg_rank_init(r, &gpu, &dummy, sizeof(dummy), &unused);
	}
	struct ep_group_config cfg = {
		.name = x->name, .world_size = W,
		.ranks_per_node = x->one_node ? W : (uint32_t)x->rpn,
		.rank = (uint32_t)r, .num_experts = x->s.E, .hidden = H,
		.max_tokens_per_rank = T, .topk = K, .dtype = EP_DTYPE_BF16,
		.timeout_ms = 120000, .cuda_device = gpu};
	ep_conn_t *c;
	ep_group_t *g;
	const int node = x->one_node ? 0 : r / x->rpn;
	TH_OK(ep_connect(x->d[node].sock, &c));
	TH_OK(ep_join(c, &cfg, x->gpu ? EP_JOIN_CUDA : 0, &g));
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	int64_t *topk = malloc((size_t)T * K * 8);
	float *w = malloc((size_t)T * K * 4);
	uint16_t *rows = malloc((size_t)T * H * 2);
	TH_CHECK(topk && w && rows, "out of memory");
	routing(x, r, topk);
	x->cross[r] = crossing(x, r, topk);
	uint64_t s = x->seed ^ ((uint64_t)r << 32);
	for (size_t i = 0; i < (size_t)T * H; i++)
		rows[i] = tg_bf16_rand(&s, 0);
	for (size_t i = 0; i < (size_t)T * K; i++)
		w[i] = (float)(th_rnd(&s) % 1000) / 1000.0f;
	/* the expert outputs the combine sums: random rows as well, as many
	 * as a rank may receive (the tokens' rows, over and over) */
	const uint64_t cap = b.max_recv;
	if (x->gpu) {
		tg_upload(tg_dptr(b.x), rows, (size_t)T * H * 2);
		tg_upload(tg_dptr(b.topk_idx), topk, (size_t)T * K * 8);
		tg_upload(tg_dptr(b.topk_weights), w, (size_t)T * K * 4);
		for (uint64_t o = 0; o < cap; o += T)
			tg_upload(tg_dptr(b.combine_y) + o * H * 2, rows,
				  (size_t)((cap - o < T ? cap - o : T) * H * 2));
	} else {
		memcpy(b.x, rows, (size_t)T * H * 2);
		memcpy(b.topk_idx, topk, (size_t)T * K * 8);
		memcpy(b.topk_weights, w, (size_t)T * K * 4);
		for (uint64_t o = 0; o < cap; o += T)
			memcpy(b.combine_y + o * H, rows,
			       (size_t)((cap - o < T ? cap - o : T) * H * 2));
	}
	free(rows);
	free(w);
	free(topk);

	/* barrier */
	for (int i = 0; i < 10; i++)
		TH_OK(x->gpu ? ep_barrier_stream(g, st) : ep_barrier(g));
	if (x->gpu) {
		CU(tg_drv.cuStreamSynchronize(st));
		TH_OK(ep_group_sync(g));
	}
	line_up(x);
	uint64_t t0 = th_now_ns();
	for (int i = 0; i < BAR_ITERS; i++)
		TH_OK(x->gpu ? ep_barrier_stream(g, st) : ep_barrier(g));
	if (x->gpu) {
		CU(tg_drv.cuStreamSynchronize(st));
		TH_OK(ep_group_sync(g));
	}
	x->bar_us[r] = (double)(th_now_ns() - t0) / 1e3 / BAR_ITERS;

	/* dispatch and combine, each timed alone after a line-up (the first
	 * round untimed) */
	double dsum = 0, csum = 0;
	for (int it = 0; it <= x->s.iters; it++) {
		ep_handle_t h;
		line_up(x);
		t0 = th_now_ns();
		if (x->gpu) {
			TH_OK(ep_dispatch_stream(g, T, 0, NULL, st, &h));
			TH_OK(ep_dispatch_recv_count(g, &h));
			CU(tg_drv.cuStreamSynchronize(st));
			TH_OK(ep_group_sync(g));
		} else {
			TH_OK(ep_dispatch_inplace(g, T, 0, NULL, &h));
		}
		const uint64_t t1 = th_now_ns();
		line_up(x);
		const uint64_t t2 = th_now_ns();
		if (x->gpu) {
			TH_OK(ep_combine_stream(g, &h, 0, st));
			CU(tg_drv.cuStreamSynchronize(st));
			TH_OK(ep_group_sync(g));
		} else {
			TH_OK(ep_combine_inplace(g, &h, 0));
		}
		const uint64_t t3 = th_now_ns();
		TH_OK(ep_handle_release(g, &h));
		if (it) {
			dsum += (double)(t1 - t0) / 1e3;
			csum += (double)(t3 - t2) / 1e3;
		}
	}
	x->disp_us[r] = dsum / x->s.iters;
	x->comb_us[r] = csum / x->s.iters;
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

static double worst(const double *v, int n)
{
	double m = 0;
	for (int i = 0; i < n; i++)
		m = v[i] > m ? v[i] : m;
	return m;
}

struct run {
	double bar_us, disp_us, comb_us, cross_bytes;
};

/* GB/s of r's rows crossing nodes in an op of us microseconds. */
static double crossing_gbs(const struct run *r, double us)
{
	return r->cross_bytes / us / 1e3;
}

static double least(double a, double b)
{
	return a < b ? a : b;
}

static struct run one_run(struct ctx *x, int gpu, int one_node, int tag)
{
	const int W = x->nodes * x->rpn;
	x->gpu = gpu;
	x->one_node = one_node;
	x->arrive = x->gen = 0;
	snprintf(x->name, sizeof(x->name), "gxb%d-%d%d%d", tag, x->nodes,
		 gpu, one_node);
	pid_t pids[MAXR];
	th_spawn(pids, W, bench_rank, x);
	TH_CHECK(th_wait_all(pids, W, 600) == 0, "%s: a rank failed",
		 x->name);
	struct run o = {.bar_us = worst(x->bar_us, W),
			.disp_us = worst(x->disp_us, W),
			.comb_us = worst(x->comb_us, W)};
	for (int r = 0; r < W; r++)
		o.cross_bytes += (double)x->cross[r] * x->s.H * 2;
	return o;
}

/* One loopback tcp stream (GB/s, 1 GiB in 1 MiB writes) and a 1-byte
 * round trip (us, median of 2000), between two sockets of this machine. */
static void tcp_ceiling(double *gbs, double *rtt_us)
{
	int ls = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = {.sin_family = AF_INET};
	inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
	socklen_t sl = sizeof(sa);
	TH_CHECK(ls >= 0 && !bind(ls, (struct sockaddr *)&sa, sizeof(sa)) &&
			 !listen(ls, 1) &&
			 !getsockname(ls, (struct sockaddr *)&sa, &sl),
		 "a loopback listener");
	const size_t chunk = 1 << 20, total = (size_t)1 << 30;
	pid_t p = fork();
	if (p == 0) {
		int fd = socket(AF_INET, SOCK_STREAM, 0);
		int one = 1;
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)))
			_exit(1);
		char *buf = malloc(chunk);
		memset(buf, 0x5a, chunk);
		for (size_t sent = 0; sent < total;) {
			ssize_t n = write(fd, buf, chunk);
			if (n <= 0)
				_exit(1);
			sent += (size_t)n;
		}
		char b1;
		for (int i = 0; i < 2100; i++)
			if (read(fd, &b1, 1) != 1 || write(fd, &b1, 1) != 1)
				_exit(1);
		_exit(0);
	}
	int fd = accept(ls, NULL, NULL);
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	char *buf = malloc(chunk);
	size_t got = 0;
	uint64_t t0 = th_now_ns();
	while (got < total) {
		ssize_t n = read(fd, buf, chunk);
		TH_CHECK(n > 0, "the tcp stream ended early");
		got += (size_t)n;
	}
	*gbs = (double)total / (double)(th_now_ns() - t0);
	double rt[2000];
	char b1 = 1;
	for (int i = 0; i < 2100; i++) {
		t0 = th_now_ns();
		TH_CHECK(write(fd, &b1, 1) == 1 && read(fd, &b1, 1) == 1,
			 "ping-pong");
		if (i >= 100)
			rt[i - 100] = (double)(th_now_ns() - t0) / 1e3;
	}
	*rtt_us = tg_median(rt, 2000);
	free(buf);
	close(fd);
	close(ls);
	th_reap(p, 10);
}

/* Device <-> pinned host copies of 256 MiB (GB/s), in a child (the
 * parent never initializes CUDA). */
static int copy_child(int r, void *arg)
{
	struct ctx *x = arg;
	int gpu;
	static uint32_t dummy;
	CUdeviceptr unused, d;
	CUstream st = tg_rank_init(r, &gpu, &dummy, sizeof(dummy), &unused);
	const size_t n = (size_t)256 << 20;
	void *h;
	CU(tg_drv.cuMemHostAlloc(&h, n, 0));
	CU(tg_drv.cuMemAlloc(&d, n));
	memset(h, 0x3c, n);
	double best[2] = {0, 0};
	for (int dir = 0; dir < 2; dir++)
		for (int i = 0; i < 6; i++) {
			uint64_t t0 = th_now_ns();
			CU(dir ? tg_drv.cuMemcpyHtoDAsync(d, h, n, st)
			       : tg_drv.cuMemcpyDtoHAsync(h, d, n, st));
			CU(tg_drv.cuStreamSynchronize(st));
			double gbs = (double)n / (double)(th_now_ns() - t0);
			best[dir] = gbs > best[dir] ? gbs : best[dir];
		}
	x->d2h_gbs = best[0];
	x->h2d_gbs = best[1];
	return 0;
}

int main(void)
{
	th_init("bench: GPU ranks across nodes against their ceilings", 3000);
	/* EPD_BENCH_HOST_ONLY=1 where no GPU is: the host ranks' figures
	 * and the tcp ceiling alone */
	const bool gpu_ok = tg_probe() == 0;
	if (!gpu_ok && !getenv("EPD_BENCH_HOST_ONLY"))
		return TH_SKIP;
	struct ctx *x = th_shared(sizeof(*x));
	x->seed = th_seed();
	x->rpn = getenv("EPD_BENCH_RPN") ? atoi(getenv("EPD_BENCH_RPN")) : 2;
	const char *nl = getenv("EPD_BENCH_NODES") ? getenv("EPD_BENCH_NODES")
						   : "2 4";
	double tcp_gbs, rtt_us;
	tcp_ceiling(&tcp_gbs, &rtt_us);
	pid_t cp;
	if (gpu_ok) {
		th_spawn(&cp, 1, copy_child, x);
		TH_CHECK(th_wait_all(&cp, 1, 120) == 0, "the copy ceiling");
	} else {
		x->d2h_gbs = x->h2d_gbs = 1e9; /* none: the wire bounds */
	}
	printf("perf: ceilings: one loopback tcp stream %.2f GB/s, 1-byte "
	       "round trip %.1f us",
	       tcp_gbs, rtt_us);
	if (gpu_ok)
		printf("; device->host %.1f GB/s, host->device %.1f GB/s "
		       "(pinned, 256 MiB)",
		       x->d2h_gbs, x->h2d_gbs);
	printf("\n");
	const double wire = least(tcp_gbs, least(x->d2h_gbs, x->h2d_gbs));
	/* EPD_BENCH_TOKENS: the prefill's tokens a rank (4096) */
	const uint32_t pt = getenv("EPD_BENCH_TOKENS")
				    ? (uint32_t)atoi(getenv("EPD_BENCH_TOKENS"))
				    : 4096;
	TH_CHECK(pt >= 1 && pt <= 65536, "EPD_BENCH_TOKENS");
	const struct shape shapes[] = {
		{"DeepSeek-V3 prefill", pt, 7168, 8, 256, 5},
		{"decode", 128, 7168, 8, 256, 20}};
	int tag = 0;
	for (const char *p = nl; *p;) {
		char *end;
		long n = strtol(p, &end, 10);
		if (end == p)
			break;
		p = end;
		TH_CHECK(n >= 2 && n <= MAXN && n * x->rpn <= MAXR,
			 "EPD_BENCH_NODES %ld x EPD_BENCH_RPN %d", n, x->rpn);
		x->nodes = (int)n;
		const char *extra[] = {"-b", gpu_ok ? "cuda" : "host", "-o",
				       "heartbeat_miss=50", NULL};
		th_cluster_start(x->d, x->nodes, "epdbenchgx", extra);
		for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
			x->s = shapes[i];
			struct run hc = one_run(x, 0, 0, tag++);
			if (!gpu_ok) {
				printf("perf: %d nodes x %d host ranks, %s (%u "
				       "tokens a rank; %.0f MB of rows cross "
				       "nodes per op): barrier %.1f us; "
				       "dispatch %.0f us, %.2f GB/s crossing = "
				       "%.2f of one tcp stream; combine %.0f "
				       "us, %.2f GB/s = %.2f\n",
				       x->nodes, x->rpn, x->s.name, x->s.T,
				       hc.cross_bytes / 1e6, hc.bar_us,
				       hc.disp_us, crossing_gbs(&hc, hc.disp_us),
				       crossing_gbs(&hc, hc.disp_us) / wire,
				       hc.comb_us, crossing_gbs(&hc, hc.comb_us),
				       crossing_gbs(&hc, hc.comb_us) / wire);
				continue;
			}
			struct run gc = one_run(x, 1, 0, tag++);
			struct run g1 = one_run(x, 1, 1, tag++);
			const double gd = crossing_gbs(&gc, gc.disp_us),
				     gcb = crossing_gbs(&gc, gc.comb_us),
				     hd = crossing_gbs(&hc, hc.disp_us),
				     hcb = crossing_gbs(&hc, hc.comb_us);
			printf("perf: %d nodes x %d GPU ranks, %s (%u tokens a "
			       "rank; %.0f MB of rows cross nodes per op): "
			       "barrier %.1f us = %.2f x (host ranks across "
			       "the nodes %.1f + GPU ranks on one node %.1f us); "
			       "dispatch %.0f us, %.2f GB/s crossing = %.2f of "
			       "the ceiling %.2f GB/s (host ranks %.2f GB/s); "
			       "combine %.0f us, %.2f GB/s = %.2f (host ranks "
			       "%.2f GB/s); GPU ranks on one node: dispatch "
			       "%.0f us, combine %.0f us\n",
			       x->nodes, x->rpn, x->s.name, x->s.T,
			       gc.cross_bytes / 1e6, gc.bar_us,
			       gc.bar_us / (hc.bar_us + g1.bar_us), hc.bar_us,
			       g1.bar_us, gc.disp_us, gd, gd / wire, wire, hd,
			       gc.comb_us, gcb, gcb / wire, hcb, g1.disp_us,
			       g1.comb_us);
			fflush(stdout);
		}
		for (int d = 0; d < x->nodes; d++)
			th_daemon_stop(&x->d[d]);
	}
	return 0;
}
