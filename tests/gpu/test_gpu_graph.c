/* SPDX-License-Identifier: MIT */
/*
 * Stream-ordered ops captured into a CUDA graph, replayed with fresh inputs
 * every time: a barrier, a fresh dispatch (with weights), a combine with a
 * bias along its handle and a cached dispatch of new data along it, all in
 * one graph per rank with the uploads and downloads around them. Every
 * replay's outputs are compared bitwise with the independent reference;
 * a number baked into the capture would replay stale outputs and fail.
 *
 * Also: what a captured dispatch's handle may not do (count on the CPU,
 * release, direct ops), direct ops refused while the graph lives and
 * served once it is gone, a handle whose graph is gone refused at capture,
 * and a rank killed between replays: the others' replays end (no hang) and
 * report the loss.
 *
 * The ops of one replay are posted by the first one's host node (they
 * follow it on one stream); the same replays run again with a host node
 * per op (EP_GRAPH_NO_CHAIN=1).
 *
 * EPD_GRAPH_REPLAYS sets the replays (default 1000); EPD_TEST_SEED repeats
 * a run. Exit 77 without a GPU.
 */
#include "gpu_util.h"
#include "ref.h"

#include <signal.h>
#include <string.h>
#include <time.h>

#define POISON 0xa5
#define W 4

struct ctx {
	const struct th_daemon *gpu;
	struct ref_case c;
	int replays;
	int victim; /* >= 0: that rank dies after the replays */
	int no_chain; /* EP_GRAPH_NO_CHAIN=1: a host node per op */
	double us[W], direct_us[W];
	volatile uint32_t ready[W];
	volatile uint32_t dummy[8];
};

#define SAME(got, want, n, what)                                               \
	do {                                                                   \
		size_t d_ = th_first_diff((got), (want), (n));                 \
		TH_CHECK(d_ == (size_t)(n),                                    \
			 "replay %d rank %d: %s differs at byte %zu of %zu",   \
			 i, r, (what), d_, (size_t)(n));                       \
	} while (0)

static void *pinned(size_t n)
{
	void *p;
	CU(tg_drv.cuMemHostAlloc(&p, n + 64, CU_MEMHOSTALLOC_PORTABLE));
	memset(p, POISON, n + 64);
	return p;
}

/* Copies of no bytes are not captured (a rank with no tokens). */
static void h2d(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
	if (n)
		CU(tg_drv.cuMemcpyHtoDAsync(dst, src, n, s));
}

static void d2h(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
	if (n)
		CU(tg_drv.cuMemcpyDtoHAsync(dst, src, n, s));
}

static int graph_rank(int r, void *arg)
{
	struct ctx *x = arg;
	struct ref_case c = x->c;
	const uint32_t H = c.hidden, K = c.topk, T = c.tokens[r];
	const uint64_t cap = (uint64_t)W * c.max_tokens;
	int gpu, i = -1;
	CUdeviceptr ddev;
	if (x->no_chain)
		setenv("EP_GRAPH_NO_CHAIN", "1", 1);
	CUstream st = tg_rank_init(r, &gpu, (void *)x->dummy, sizeof(x->dummy),
				   &ddev);
	struct ep_group_config cfg = {
		.name = "graph", .world_size = W, .ranks_per_node = W,
		.rank = (uint32_t)r, .num_experts = c.experts, .hidden = H,
		.max_tokens_per_rank = c.max_tokens, .topk = K,
		.dtype = EP_DTYPE_BF16, .timeout_ms = 20000,
		.cuda_device = gpu};
	ep_conn_t *gc;
	ep_group_t *g;
	TH_OK(ep_connect(x->gpu->sock, &gc));
	/* two receive areas: the captured cached dispatch writes area 1 */
	TH_OK(ep_join(gc, &cfg, EP_JOIN_CUDA | EP_JOIN_RECV_AREAS(2), &g));
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));

	/* the graph's host ends: inputs written before each replay, outputs
	 * read after it */
	uint8_t *x_h = pinned((size_t)T * H * 2), *x2_h = pinned((size_t)T * H * 2);
	int64_t *topk_h = pinned((size_t)T * K * 8);
	float *w_h = pinned((size_t)T * K * 4);
	uint16_t *y_h = pinned(cap * H * 2), *bias_h = pinned((size_t)T * H * 2);
	uint8_t *rx_h = pinned(cap * H * 2), *rx2_h = pinned(cap * H * 2);
	uint8_t *rx0_h = pinned(cap * H * 2);
	int32_t *src_h = pinned(cap * 8);
	uint32_t *cnt_h = pinned(4);
	uint16_t *comb_h = pinned((size_t)T * H * 2);

	CUstream cs;
	CU(tg_drv.cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING));
	CU(tg_drv.cuStreamBeginCapture(cs, CU_STREAM_CAPTURE_MODE_GLOBAL));
	ep_handle_t gh, gh2;
	TH_OK(ep_barrier_stream(g, cs));
	h2d(tg_dptr(b.x), x_h, (size_t)T * H * 2, cs);
	h2d(tg_dptr(b.topk_idx), topk_h,
				    (size_t)T * K * 8, cs);
	h2d(tg_dptr(b.topk_weights), w_h,
				    (size_t)T * K * 4, cs);
	TH_OK(ep_dispatch_stream(g, T, EP_DISPATCH_WEIGHTS, NULL, cs, &gh));
	/* too many tokens is refused at capture (a replay could not say) */
	ep_handle_t hb;
	TH_EXPECT_RC(ep_dispatch_stream(g, c.max_tokens + 1, 0, NULL, cs, &hb),
		     EP_ETOOBIG);
	d2h(rx_h, tg_dptr(b.recv_x), cap * H * 2, cs);
	d2h(src_h, tg_dptr(b.recv_src), cap * 8, cs);
	d2h(cnt_h, ep_dispatch_recv_count_device(g), 4,
				    cs);
	h2d(tg_dptr(b.combine_y), y_h, cap * H * 2, cs);
	h2d(tg_dptr(b.combine_bias), bias_h,
				    (size_t)T * H * 2, cs);
	TH_OK(ep_combine_stream(g, &gh, EP_COMBINE_BIAS, cs));
	d2h(comb_h, tg_dptr(b.combined),
				    (size_t)T * H * 2, cs);
	/* new data along the same routing, into receive area 1 (area 0
	 * keeps the fresh dispatch's rows: read again after it) */
	h2d(tg_dptr(b.x), x2_h, (size_t)T * H * 2, cs);
	TH_OK(ep_dispatch_stream(g, T, EP_DISPATCH_AREA(1), &gh, cs, &gh2));
	TH_CHECK(gh2.seq == gh.seq, "a cached dispatch keeps its handle");
	d2h(rx2_h, tg_dptr(ep_recv_area(g, 1)), cap * H * 2, cs);
	d2h(rx0_h, tg_dptr(b.recv_x), cap * H * 2, cs);
	CUgraph graph;
	CU(tg_drv.cuStreamEndCapture(cs, &graph));
	CUgraphExec exec;
	CU(tg_drv.cuGraphInstantiateWithFlags(&exec, graph, 0));

	/* what a captured dispatch's handle may not do, and direct ops while
	 * the graph lives */
	TH_EXPECT_RC(ep_dispatch_recv_count(g, &gh), EP_EINVAL);
	TH_CHECK(strstr(ep_errmsg(), "ep_dispatch_recv_count_device"),
		 "message: %s", ep_errmsg());
	TH_EXPECT_RC(ep_handle_release(g, &gh), EP_EINVAL);
	TH_EXPECT_RC(ep_dispatch_stream(g, T, 0, NULL, st, &hb), EP_EBUSY);
	TH_CHECK(strstr(ep_errmsg(), "captured in CUDA graphs"), "message: %s",
		 ep_errmsg());
	TH_EXPECT_RC(ep_barrier_stream(g, st), EP_EBUSY);

	double *us = malloc(sizeof(double) * (size_t)x->replays);
	for (i = 0; i < x->replays; i++) {
		c.seed = x->c.seed + (uint64_t)i * 7919u;
		struct ref_inputs in[W], in2[W];
		struct ref_recv exp[W], exp2[W];
		ref_gen_world(&c, in, in2, exp, exp2);
		const uint64_t R = exp[r].R;
		uint16_t *ys[W];
		for (uint32_t d = 0; d < W; d++)
			ys[d] = ref_gen_y(&c, d, exp[d].R, (uint64_t)i);
		memcpy(x_h, in[r].x, (size_t)T * H * 2);
		memcpy(x2_h, in2[r].x, (size_t)T * H * 2);
		memcpy(topk_h, in[r].topk, (size_t)T * K * 8);
		memcpy(w_h, in[r].weights, (size_t)T * K * 4);
		memcpy(y_h, ys[r], R * H * 2);
		memcpy(bias_h, in[r].bias, (size_t)T * H * 2);
		memset(rx_h, POISON, cap * H * 2);
		memset(rx2_h, POISON, cap * H * 2);
		memset(rx0_h, POISON, cap * H * 2);
		memset(src_h, POISON, cap * 8);
		memset(comb_h, POISON, (size_t)T * H * 2);
		*cnt_h = 0xa5a5a5a5u;
		uint64_t t0 = th_now_ns();
		CU(tg_drv.cuGraphLaunch(exec, st));
		CU(tg_drv.cuStreamSynchronize(st));
		us[i] = (double)(th_now_ns() - t0) / 1e3;
		TH_OK(ep_group_error(g));
		TH_CHECK(*cnt_h == R, "replay %d rank %d: count %u, want %llu",
			 i, r, *cnt_h, (unsigned long long)R);
		SAME(rx_h, exp[r].x, R * H * 2, "recv_x");
		SAME(src_h, exp[r].src, R * 8, "recv_src");
		SAME(rx2_h, exp2[r].x, R * H * 2, "cached recv_x in area 1");
		SAME(rx0_h, exp[r].x, R * H * 2, "area 0 after area 1's");
		uint16_t *want = malloc((size_t)T * H * 2 + 2);
		ref_combine(&c, in, exp, ys, (uint32_t)r, want);
		SAME(comb_h, want, (size_t)T * H * 2, "combined");
		free(want);
		for (uint32_t d = 0; d < W; d++) {
			free(ys[d]);
			ref_free_inputs(&in[d]);
			ref_free_inputs(&in2[d]);
			ref_free_recv(&exp[d]);
			ref_free_recv(&exp2[d]);
		}
	}
	x->us[r] = tg_median(us, x->replays);
	free(us);
	i = x->replays;

	if (x->victim >= 0) {
		/* the victim dies between replays; the others' next replay
		 * ends (its gates open when the daemon fails the group) and
		 * reports the loss */
		TH_OK(ep_barrier(g));
		if (r == x->victim)
			raise(SIGKILL);
		uint64_t t0 = th_now_ns();
		CU(tg_drv.cuGraphLaunch(exec, st));
		CU(tg_drv.cuStreamSynchronize(st));
		int rc = ep_group_error(g);
		for (int tries = 0; !rc && tries < 400; tries++) {
			th_sleep_ms(5);
			rc = ep_group_error(g);
		}
		TH_CHECK(rc == EP_EPEERLOST || rc == EP_EFAILED,
			 "rank %d: after a rank died, the replay gave %d (%s)",
			 r, rc, ep_errmsg());
		TH_CHECK(th_now_ns() - t0 < 15000000000ull,
			 "a replay waited %llu ms for a dead rank",
			 (unsigned long long)((th_now_ns() - t0) / 1000000));
		CU(tg_drv.cuGraphExecDestroy(exec));
		CU(tg_drv.cuGraphDestroy(graph));
		ep_leave(g);
		ep_close(gc);
		return 0;
	}

	/* the graph gone, direct ops are served again (CUDA lets the
	 * records go shortly after the destroys) */
	CU(tg_drv.cuGraphExecDestroy(exec));
	CU(tg_drv.cuGraphDestroy(graph));
	TH_OK(tg_barrier_after_graphs(g, st));
	/* the same work as direct ops, for the replay's time against it
	 * (printed, not judged) */
	{
		enum { N = 200 };
		double dus[N];
		for (int j = 0; j < N; j++) {
			uint64_t t0 = th_now_ns();
			TH_OK(ep_barrier_stream(g, st));
			h2d(tg_dptr(b.x), x_h, (size_t)T * H * 2, st);
			h2d(tg_dptr(b.topk_idx), topk_h, (size_t)T * K * 8, st);
			h2d(tg_dptr(b.topk_weights), w_h, (size_t)T * K * 4, st);
			ep_handle_t dh, dh2;
			TH_OK(ep_dispatch_stream(g, T, EP_DISPATCH_WEIGHTS, NULL,
						 st, &dh));
			d2h(rx_h, tg_dptr(b.recv_x), cap * H * 2, st);
			d2h(src_h, tg_dptr(b.recv_src), cap * 8, st);
			d2h(cnt_h, ep_dispatch_recv_count_device(g), 4, st);
			h2d(tg_dptr(b.combine_y), y_h, cap * H * 2, st);
			h2d(tg_dptr(b.combine_bias), bias_h, (size_t)T * H * 2, st);
			TH_OK(ep_combine_stream(g, &dh, EP_COMBINE_BIAS, st));
			d2h(comb_h, tg_dptr(b.combined), (size_t)T * H * 2, st);
			h2d(tg_dptr(b.x), x2_h, (size_t)T * H * 2, st);
			TH_OK(ep_dispatch_stream(g, T, 0, &dh, st, &dh2));
			d2h(rx2_h, tg_dptr(b.recv_x), cap * H * 2, st);
			CU(tg_drv.cuStreamSynchronize(st));
			dus[j] = (double)(th_now_ns() - t0) / 1e3;
			TH_OK(ep_handle_release(g, &dh));
		}
		x->direct_us[r] = tg_median(dus, N);
	}
	/* a captured handle whose graph is gone is refused at capture */
	CU(tg_drv.cuStreamBeginCapture(cs, CU_STREAM_CAPTURE_MODE_GLOBAL));
	TH_EXPECT_RC(ep_combine_stream(g, &gh, 0, cs), EP_ESTALE);
	CU(tg_drv.cuStreamEndCapture(cs, &graph));
	CU(tg_drv.cuGraphDestroy(graph));
	/* a direct dispatch of the first replay's inputs, checked */
	c.seed = x->c.seed;
	struct ref_inputs in[W], in2[W];
	struct ref_recv exp[W], exp2[W];
	ref_gen_world(&c, in, in2, exp, exp2);
	memcpy(x_h, in[r].x, (size_t)T * H * 2);
	memcpy(topk_h, in[r].topk, (size_t)T * K * 8);
	memset(rx_h, POISON, cap * H * 2);
	h2d(tg_dptr(b.x), x_h, (size_t)T * H * 2, st);
	h2d(tg_dptr(b.topk_idx), topk_h,
				    (size_t)T * K * 8, st);
	ep_handle_t h;
	TH_OK(ep_dispatch_stream(g, T, 0, NULL, st, &h));
	d2h(rx_h, tg_dptr(b.recv_x), cap * H * 2, st);
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_dispatch_recv_count(g, &h));
	TH_CHECK(h.num_recv == exp[r].R, "direct count %u, want %u", h.num_recv,
		 exp[r].R);
	SAME(rx_h, exp[r].x, (size_t)exp[r].R * H * 2, "direct recv_x after");
	TH_OK(ep_handle_release(g, &h));
	TH_OK(ep_group_sync(g));
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(gc);
	return 0;
}

static void run(struct ctx *x, const char *what)
{
	pid_t pids[W];
	th_spawn(pids, W, graph_rank, x);
	if (x->victim >= 0) {
		for (int r = 0; r < W; r++)
			if (r == x->victim)
				th_reap(pids[r], 60);
			else
				TH_CHECK(th_wait_all(&pids[r], 1, 120) == 0,
					 "%s: rank %d failed", what, r);
	} else {
		TH_CHECK(th_wait_all(pids, W, 300) == 0, "%s failed", what);
	}
}

int main(void)
{
	th_init("gpu: dispatch and combine captured into CUDA graphs", 900);
	if (tg_probe())
		return TH_SKIP;
	uint64_t seed = th_seed();
	const char *er = getenv("EPD_GRAPH_REPLAYS");
	int replays = er ? atoi(er) : 1000;
	if (replays < 1)
		replays = 1;
	struct th_daemon gpu;
	th_daemon_start(&gpu, "--backend", "cuda", NULL);
	struct ctx *x = th_shared(sizeof(*x));
	x->gpu = &gpu;
	x->c = (struct ref_case){.seed = seed, .world = W, .experts = 16,
				 .hidden = 512, .topk = 4, .max_tokens = 48,
				 .tokens = {48, 31, 0, 17},
				 .dtype = EP_DTYPE_BF16, .weights = true,
				 .bias = true};
	x->replays = replays;
	x->victim = -1;
	run(x, "replays");
	printf("ok: %d replays of barrier + dispatch + combine + cached "
	       "dispatch, fresh inputs each, bitwise equal to the reference; "
	       "median replay (with its copies) %.1f / %.1f / %.1f / %.1f us\n",
	       replays, x->us[0], x->us[1], x->us[2], x->us[3]);
	printf("ok: the same work as direct ops: median %.1f / %.1f / %.1f / "
	       "%.1f us (replay / direct on rank 0: %.2f)\n",
	       x->direct_us[0], x->direct_us[1], x->direct_us[2],
	       x->direct_us[3], x->us[0] / x->direct_us[0]);
	printf("ok: captured handles refused where they cannot work; direct "
	       "ops refused while the graph lives, served after\n");
	x->replays = replays < 200 ? replays : 200;
	x->no_chain = 1;
	run(x, "replays, a host node per op");
	printf("ok: %d replays with a host node per op (EP_GRAPH_NO_CHAIN=1), "
	       "bitwise equal to the reference; median replay %.1f us, direct "
	       "%.1f us\n",
	       x->replays, x->us[0], x->direct_us[0]);
	x->no_chain = 0;
	x->replays = 20;
	x->victim = 1;
	run(x, "a rank killed between replays");
	printf("ok: a rank killed between replays: the others' replay ended "
	       "and reported the loss\n");
	TH_CHECK(th_daemon_alive(&gpu), "the daemon died");
	th_daemon_stop(&gpu);
	return 0;
}
