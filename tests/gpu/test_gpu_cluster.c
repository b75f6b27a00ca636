/* SPDX-License-Identifier: MIT */
/*
 * GPU groups across nodes: two daemons (nodes n0 and n1, tcp on loopback,
 * both on this machine's GPU 0) and GPU ranks on each. Every op is
 * stream-ordered on the ranks' streams; each node stages its ranks' data
 * through host memory and runs the op with the other node.
 *
 * Checked, bitwise against the independent reference for the same global
 * inputs: dispatch (exact receive counts, every output, rows past the
 * count still poisoned), cached dispatch of new data, combine with a bias;
 * a bad expert index on one node fails that op on every rank of both nodes
 * and changes nothing, and the group goes on, also where a cached dispatch
 * and a combine already name its handle (each fails alone, EP_ESTALE, as
 * on one node); stream-ordered barriers
 * across the nodes; a node's daemon killed: the other node's ranks get
 * EP_EPEERLOST on their streams. A routing released before the daemon
 * made it (node 0's rank running ahead) is kept for the combine that
 * names it, whatever the daemon reclaims meanwhile (ahead_rank).
 *
 * EPD_TEST_SEED repeats a run. Exit 77 without a GPU.
 */
#include "gpu_util.h"
#include "ref.h"

#include <signal.h>
#include <string.h>
#include <time.h>

#define POISON 0x5a
#define POISONED(n) th_poisoned((n), POISON)
#define ALL_POISON(p, n) th_all_is((p), (n), POISON)
#define NODES 2

struct ctx {
	struct th_daemon d[NODES];
	struct ref_case c;
	int rpn;
	int index;
	volatile int entered, killed;
	volatile uint32_t gate; /* ahead_rank: node 0's stream waits on it */
	char name[32];
	double bar_us; /* rank 0: a stream barrier across the nodes */
};

#define SAME(got, want, n, what)                                               \
	TH_CHECK((n) == 0 || !memcmp(got, want, n),                            \
		 "%s rank %d: %s differs", x->name, r, what)

static void down(void *dst, const void *src, size_t n)
{
	if (n)
		CU(tg_drv.cuMemcpyDtoH(dst, tg_dptr(src), n));
}

static void up(void *dst, const void *src, size_t n)
{
	if (n)
		tg_upload(tg_dptr(dst), src, n);
}

static int xrank(int r, void *arg)
{
	struct ctx *x = arg;
	const struct ref_case *c = &x->c;
	const uint32_t W = c->world, H = c->hidden, K = c->topk,
		       E = c->experts, elt = ref_elt(c);
	const uint32_t ns = c->dtype == EP_DTYPE_FP8 ? H / 128 : 0;
	const uint32_t per = E / W;
	int gpu;
	CUdeviceptr unused;
	static uint32_t dummy;
	CUstream st = tg_rank_init(r, &gpu, &dummy, sizeof(dummy), &unused);
	struct ref_inputs in[8], in2[8];
	struct ref_recv exp[8], exp2[8];
	ref_gen_world(c, in, in2, exp, exp2);
	const struct ref_inputs *me = &in[r];
	const uint64_t R = exp[r].R, cap = (uint64_t)W * c->max_tokens;
	struct ep_group_config cfg = {
		.name = x->name, .world_size = W,
		.ranks_per_node = (uint32_t)x->rpn, .rank = (uint32_t)r,
		.num_experts = E, .hidden = H,
		.max_tokens_per_rank = c->max_tokens, .topk = K,
		.dtype = (ep_dtype_t)c->dtype, .timeout_ms = 20000,
		.cuda_device = gpu};
	ep_conn_t *conn;
	ep_group_t *g;
	TH_OK(ep_connect(x->d[r / x->rpn].sock, &conn));
	TH_OK(ep_join(conn, &cfg, EP_JOIN_CUDA, &g));
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	CU(tg_drv.cuMemsetD8(tg_dptr(b.recv_x), POISON, cap * H * elt));
	CU(tg_drv.cuMemsetD8(tg_dptr(b.recv_topk_idx), POISON, cap * K * 8));
	CU(tg_drv.cuMemsetD8(tg_dptr(b.combined), POISON,
			     (size_t)c->max_tokens * H * 2));

	/* Stream-ordered barriers across the nodes (timed: each is staged
	 * through both daemons). */
	TH_OK(ep_barrier(g));
	uint64_t t0 = th_now_ns();
	for (int i = 0; i < 20; i++)
		TH_OK(ep_barrier_stream(g, st));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_group_sync(g));
	if (r == 0)
		x->bar_us = (double)(th_now_ns() - t0) / 1e3 / 20;

	/* A bad expert on node 1's first rank: every rank's op fails,
	 * nothing is written, and the group goes on. */
	int64_t *bad = malloc((size_t)me->T * K * 8 + 8);
	memcpy(bad, me->topk, (size_t)me->T * K * 8);
	if (r == x->rpn && me->T)
		bad[0] = E + 3;
	up(b.topk_idx, bad, (size_t)me->T * K * 8);
	ep_handle_t hb;
	TH_OK(ep_dispatch_stream(g, me->T, 0, NULL, st, &hb));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_EXPECT_RC(ep_group_sync(g), EP_EEXPERT);
	free(bad);
	uint8_t *chk = malloc(cap * H * elt + 1);
	down(chk, b.recv_x, cap * H * elt);
	TH_CHECK(ALL_POISON(chk, cap * H * elt),
		 "%s rank %d: a failed dispatch wrote recv_x", x->name, r);

	/* A pipeline that goes on past the refusal, as a training step's
	 * does: a cached dispatch enqueued behind it, then a combine, name
	 * its handle. Each fails alone on every rank of both nodes
	 * (EP_ESTALE, naming the cause), at once, changing nothing, and the
	 * group goes on: as on one node (test_gpu_dispatch). The topk with
	 * the bad index is still uploaded. */
	t0 = th_now_ns();
	ep_handle_t hx, hy;
	TH_OK(ep_dispatch_stream(g, me->T, 0, NULL, st, &hx));
	CU(tg_drv.cuMemsetD32Async(ep_dispatch_recv_count_device(g),
				   0x5a5a5a5au, 1, st));
	TH_OK(ep_dispatch_stream(g, me->T, 0, &hx, st, &hy));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_EXPECT_RC(ep_group_sync(g), EP_ESTALE);
	TH_CHECK(strstr(ep_errmsg(), "made its handle failed") &&
			 strstr(ep_errmsg(), "expert index out of range"),
		 "%s rank %d: a cached dispatch of a refused dispatch's "
		 "handle: %s",
		 x->name, r, ep_errmsg());
	uint32_t cnt0 = 0;
	CU(tg_drv.cuMemcpyDtoH(&cnt0, ep_dispatch_recv_count_device(g), 4));
	TH_CHECK(cnt0 == 0x5a5a5a5au,
		 "%s rank %d: the refused cached dispatch set the count %u",
		 x->name, r, cnt0);
	down(chk, b.recv_x, cap * H * elt);
	TH_CHECK(ALL_POISON(chk, cap * H * elt),
		 "%s rank %d: a refused cached dispatch wrote recv_x", x->name,
		 r);
	TH_OK(ep_combine_stream(g, &hx, 0, st));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_EXPECT_RC(ep_group_sync(g), EP_ESTALE);
	TH_CHECK(strstr(ep_errmsg(), "made its handle failed"),
		 "%s rank %d: a combine of a refused dispatch's handle: %s",
		 x->name, r, ep_errmsg());
	down(chk, b.combined, (size_t)c->max_tokens * H * 2);
	TH_CHECK(ALL_POISON(chk, (size_t)c->max_tokens * H * 2),
		 "%s rank %d: a combine of a refused dispatch wrote its output",
		 x->name, r);
	TH_OK(ep_group_error(g)); /* each told once; the group goes on */
	TH_OK(ep_handle_release(g, &hx));
	TH_CHECK(th_now_ns() - t0 < 5000000000ull,
		 "%s rank %d: the refusals took %llu ms", x->name, r,
		 (unsigned long long)((th_now_ns() - t0) / 1000000));

	/* Node 0's last rank asks for too many tokens: it gets EP_ETOOBIG at
	 * once, every rank of both nodes from its count (not after the
	 * timeout), nothing is written, and the group goes on. */
	t0 = th_now_ns();
	if (r == x->rpn - 1) {
		TH_EXPECT_RC(ep_dispatch_stream(g, c->max_tokens + 1, 0, NULL,
						st, &hb),
			     EP_ETOOBIG);
		TH_OK(ep_group_sync(g));
	} else {
		TH_OK(ep_dispatch_stream(g, me->T, 0, NULL, st, &hb));
		TH_EXPECT_RC(ep_dispatch_recv_count(g, &hb), EP_ETOOBIG);
		/* named on every rank, also on the node where it was not
		 * asked (there with no count) */
		char who[32];
		snprintf(who, sizeof(who), "rank %d dispatched", x->rpn - 1);
		TH_CHECK(strstr(ep_errmsg(), "maximum") &&
				 strstr(ep_errmsg(), who),
			 "message: %s", ep_errmsg());
		TH_OK(ep_group_sync(g));
		ep_handle_release(g, &hb);
	}
	CU(tg_drv.cuStreamSynchronize(st));
	TH_CHECK(th_now_ns() - t0 < 5000000000ull,
		 "%s rank %d: too many tokens reported after %llu ms", x->name,
		 r, (unsigned long long)((th_now_ns() - t0) / 1000000));
	down(chk, b.recv_x, cap * H * elt);
	TH_CHECK(ALL_POISON(chk, cap * H * elt),
		 "%s rank %d: a dispatch of too many tokens wrote recv_x",
		 x->name, r);

	/* Dispatch. */
	up(b.x, me->x, (size_t)me->T * H * elt);
	if (ns)
		up(b.x_scales, me->scales, (size_t)me->T * ns * 4);
	up(b.topk_idx, me->topk, (size_t)me->T * K * 8);
	up(b.topk_weights, me->weights, (size_t)me->T * K * 4);
	ep_handle_t h;
	TH_OK(ep_dispatch_stream(g, me->T, c->weights ? EP_DISPATCH_WEIGHTS : 0,
				 NULL, st, &h));
	TH_OK(ep_dispatch_recv_count(g, &h));
	TH_CHECK(h.num_recv == R, "%s rank %d: received %u, want %llu",
		 x->name, r, h.num_recv, (unsigned long long)R);
	CU(tg_drv.cuStreamSynchronize(st));
	uint32_t dcount = 0;
	CU(tg_drv.cuMemcpyDtoH(&dcount, ep_dispatch_recv_count_device(g), 4));
	TH_CHECK(dcount == R, "%s rank %d: the device count %u, want %llu",
		 x->name, r, dcount, (unsigned long long)R);
	down(chk, b.recv_x, cap * H * elt);
	SAME(chk, exp[r].x, R * H * elt, "recv_x");
	TH_CHECK(ALL_POISON(chk + R * H * elt, (cap - R) * H * elt),
		 "%s rank %d: recv_x written past row %llu", x->name, r,
		 (unsigned long long)R);
	uint8_t *tmp = malloc(cap * (K * 8 + ns * 4 + 8) + per * 4 + 8);
	if (ns) {
		down(tmp, b.recv_x_scales, R * ns * 4);
		SAME(tmp, exp[r].scales, R * ns * 4, "recv_x_scales");
	}
	down(tmp, b.recv_topk_idx, cap * K * 8);
	SAME(tmp, exp[r].topk, R * K * 8, "recv_topk_idx");
	TH_CHECK(ALL_POISON(tmp + R * K * 8, (cap - R) * K * 8),
		 "%s rank %d: recv_topk_idx written past the rows", x->name, r);
	down(tmp, b.recv_topk_weights, R * K * 4);
	SAME(tmp, exp[r].weights, R * K * 4, "recv_topk_weights");
	down(tmp, b.recv_src, R * 8);
	SAME(tmp, exp[r].src, R * 8, "recv_src");
	down(tmp, b.num_recv_tokens_per_expert, per * 4);
	SAME(tmp, exp[r].per_expert, per * 4, "num_recv_tokens_per_expert");
	int32_t rp[64], grp[64];
	ref_rank_prefix(c, exp, rp);
	down(grp, b.rank_prefix_matrix, W * W * 4);
	SAME(grp, rp, W * W * 4, "rank_prefix_matrix");

	/* Cached dispatch of new data (a barrier between: the op numbers
	 * stay in step across the nodes). */
	TH_OK(ep_barrier_stream(g, st));
	CU(tg_drv.cuStreamSynchronize(st));
	up(b.x, in2[r].x, (size_t)me->T * H * elt);
	if (ns)
		up(b.x_scales, in2[r].scales, (size_t)me->T * ns * 4);
	ep_handle_t hc;
	TH_OK(ep_dispatch_stream(g, me->T, 0, &h, st, &hc));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_group_sync(g));
	down(chk, b.recv_x, R * H * elt);
	SAME(chk, exp2[r].x, R * H * elt, "cached recv_x");

	/* Combine of random rows and a bias along the first handle. */
	uint16_t *ys[8];
	for (uint32_t d = 0; d < W; d++)
		ys[d] = ref_gen_y(c, d, exp[d].R, 7);
	up(b.combine_y, ys[r], R * H * 2);
	up(b.combine_bias, me->bias, (size_t)me->T * H * 2);
	/* and the rows' top-k weights, summed across the nodes too */
	float *wy[8];
	for (uint32_t d = 0; d < W; d++)
		wy[d] = ref_gen_cw(c, d, exp[d].R);
	up(b.combine_topk_weights, wy[r], (size_t)R * K * 4);
	TH_OK(ep_combine_stream(g, &h,
				(c->bias ? EP_COMBINE_BIAS : 0) |
					EP_COMBINE_WEIGHTS,
				st));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_group_sync(g));
	uint16_t *out = POISONED((size_t)c->max_tokens * H * 2),
		 *want = calloc((size_t)me->T * H * 2 + 2, 1);
	down(out, b.combined, (size_t)c->max_tokens * H * 2);
	ref_combine(c, in, exp, ys, (uint32_t)r, want);
	SAME(out, want, (size_t)me->T * H * 2, "combined");
	float *gcw = malloc((size_t)me->T * K * 4 + 4),
	      *rcw = malloc((size_t)me->T * K * 4 + 4);
	down(gcw, b.combined_topk_weights, (size_t)me->T * K * 4);
	ref_combine_weights(c, me->T, exp, wy, (uint32_t)r, rcw);
	SAME(gcw, rcw, (size_t)me->T * K * 4, "combined_topk_weights");
	TH_CHECK(ALL_POISON((uint8_t *)out + (size_t)me->T * H * 2,
			    (size_t)(c->max_tokens - me->T) * H * 2),
		 "%s rank %d: combined written past the tokens", x->name, r);
	if (r == 0) {
		char *js;
		TH_OK(ep_daemon_status(conn, &js));
		TH_CHECK(strstr(js, "\"staged\":true"), "status: %s", js);
		free(js);
	}
	TH_OK(ep_barrier(g)); /* nobody leaves while others work */
	TH_OK(ep_leave(g));
	ep_close(conn);
	return 0;
}

/* A routing released before the daemon made it. One rank a node: node
 * 1's sleeps, so node 0's runs ahead and sends a barrier, a dispatch, its
 * combine and the dispatch's release while its daemon still waits for
 * node 1 on the barrier (a staged group runs one op at a time): the
 * routing is made released already. Node 0's stream is held (a wait on
 * host memory) before the combine's doorbell while the daemons stage that
 * combine; node 0's rank then releases an older handle, which lets its
 * daemon reclaim every routing no op still needs, and opens the gate. The
 * combine must still find its routing: the group goes on. */
static int ahead_rank(int r, void *arg)
{
	struct ctx *x = arg;
	int gpu;
	CUdeviceptr dgate;
	CUstream st = tg_rank_init(r, &gpu, (void *)&x->gate, sizeof(x->gate),
				   &dgate);
	struct ep_group_config cfg = th_group("xahead", 2, (uint32_t)r, 20000);
	cfg.ranks_per_node = 1;
	cfg.cuda_device = gpu;
	const uint32_t T = 8, H = cfg.hidden, K = cfg.topk,
		       E = cfg.num_experts;
	ep_conn_t *conn;
	ep_group_t *g;
	TH_OK(ep_connect(x->d[r].sock, &conn));
	TH_OK(ep_join(conn, &cfg, EP_JOIN_CUDA, &g));
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	uint16_t *xs = malloc((size_t)T * H * 2);
	int64_t tk[8 * 8];
	TH_CHECK(xs && K <= 8, "setup");
	for (uint32_t t = 0; t < T; t++) {
		for (uint32_t c = 0; c < H; c++)
			xs[t * H + c] = tg_bf16((float)((t + c + (uint32_t)r) % 7));
		for (uint32_t k = 0; k < K; k++)
			tk[t * K + k] = (int64_t)((t * K + k + (uint32_t)r) % E);
	}
	up(b.x, xs, (size_t)T * H * 2);
	up(b.topk_idx, tk, (size_t)T * K * 8);
	free(xs);
	ep_handle_t h0, h1;
	TH_OK(ep_dispatch_stream(g, T, 0, NULL, st, &h0));
	TH_OK(ep_combine_stream(g, &h0, 0, st));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_group_sync(g));
	if (r == 1)
		th_sleep_ms(300);
	TH_OK(ep_barrier_stream(g, st));
	TH_OK(ep_dispatch_stream(g, T, 0, NULL, st, &h1));
	if (r == 0)
		CU(tg_drv.cuStreamWaitValue32(st, dgate, 1,
					      CU_STREAM_WAIT_VALUE_GEQ));
	TH_OK(ep_combine_stream(g, &h1, 0, st));
	TH_OK(ep_handle_release_async(g, &h1));
	if (r == 0) {
		/* node 1 woke 600 ms ago: the dispatch ran, the combine is
		 * being staged, waiting for this stream */
		th_sleep_ms(900);
		TH_OK(ep_handle_release(g, &h0));
		__atomic_store_n(&x->gate, 1u, __ATOMIC_SEQ_CST);
	}
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_group_sync(g));
	if (r == 1)
		TH_OK(ep_handle_release(g, &h0));
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(conn);
	return 0;
}

/* Node 1's daemon dies while node 0's ranks wait on their streams. */
static int lost_rank(int r, void *arg)
{
	struct ctx *x = arg;
	int gpu;
	CUdeviceptr unused;
	static uint32_t dummy;
	CUstream st = tg_rank_init(r, &gpu, &dummy, sizeof(dummy), &unused);
	struct ep_group_config cfg = th_group("xlost", 4, (uint32_t)r, 20000);
	cfg.ranks_per_node = 2;
	cfg.cuda_device = gpu;
	ep_conn_t *conn;
	ep_group_t *g;
	TH_OK(ep_connect(x->d[r / 2].sock, &conn));
	TH_OK(ep_join(conn, &cfg, EP_JOIN_CUDA, &g));
	TH_OK(ep_barrier_stream(g, st));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_group_sync(g));
	if (r >= 2) { /* node 1: wait to be killed with its daemon */
		__atomic_fetch_add(&x->entered, 1, __ATOMIC_SEQ_CST);
		while (!x->killed)
			th_sleep_ms(5);
		return 0;
	}
	__atomic_fetch_add(&x->entered, 1, __ATOMIC_SEQ_CST);
	TH_OK(ep_barrier_stream(g, st));
	int rc = ep_group_sync(g);
	TH_CHECK(rc == EP_EPEERLOST, "rank %d: got %d (%s), want peer lost",
		 r, rc, ep_errmsg());
	CU(tg_drv.cuStreamSynchronize(st)); /* released */
	ep_leave(g);
	ep_close(conn);
	return 0;
}

int main(void)
{
	th_init("gpu: groups across nodes (staged through host memory)", 400);
	if (tg_probe())
		return TH_SKIP;
	uint64_t seed = th_seed();
	struct ctx *x = th_shared(sizeof(*x));
	/* EPD_TEST_TRANSPORT=rdma where a device exists; tcp by default */
	_Static_assert(NODES == 2, "tg_cluster2 starts two nodes");
	const char *tr = tg_cluster2(x->d, "epdgpucluster", 10);
	struct ref_case cases[] = {
		{.world = 4, .experts = 32, .hidden = 384, .topk = 6,
		 .max_tokens = 256, .tokens = {200, 0, 77, 256},
		 .dtype = EP_DTYPE_BF16, .weights = true, .bias = true},
		{.world = 4, .experts = 16, .hidden = 512, .topk = 4,
		 .max_tokens = 128, .tokens = {128, 5, 128, 64},
		 .dtype = EP_DTYPE_FP8, .weights = true, .bias = true},
		{.world = 8, .experts = 64, .hidden = 256, .topk = 8,
		 .max_tokens = 100, .tokens = {100, 1, 50, 0, 99, 100, 3, 64},
		 .dtype = EP_DTYPE_BF16, .mode = REF_SKIP_RANK, .special = 5,
		 .bias = true},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		x->c = cases[i];
		x->c.seed = seed + i;
		x->rpn = (int)x->c.world / NODES;
		x->index = (int)i;
		snprintf(x->name, sizeof(x->name), "gx%zu", i);
		pid_t pids[8];
		th_spawn(pids, (int)x->c.world, xrank, x);
		TH_CHECK(th_wait_all(pids, (int)x->c.world, 120) == 0,
			 "case %zu failed (seed %llu)", i,
			 (unsigned long long)x->c.seed);
		printf("ok: %d nodes x %d GPU ranks (%s), %s: a bad expert and a "
		       "rank with too many tokens each failed one op "
		       "everywhere and changed nothing (a cached dispatch "
		       "and a combine of the refused dispatch's handle "
		       "EP_ESTALE alone); dispatch, cached "
		       "dispatch, combine bitwise equal to the reference; "
		       "barriers across the nodes\n",
		       NODES, x->rpn, tr,
		       x->c.dtype == EP_DTYPE_FP8 ? "fp8" : "bf16");
		printf("perf: %d nodes x %d GPU ranks (%s): %.0f us per stream "
		       "barrier across the nodes (20 back-to-back, CPU clock)\n",
		       NODES, x->rpn, tr, x->bar_us);
	}
	/* A routing released before it was made, reclaims meanwhile. */
	pid_t pids[4];
	x->gate = 0;
	th_spawn(pids, 2, ahead_rank, x);
	TH_CHECK(th_wait_all(pids, 2, 60) == 0, "a routing released before "
						"the daemon made it");
	TH_CHECK(th_daemon_alive(&x->d[0]) && th_daemon_alive(&x->d[1]),
		 "a daemon died");
	printf("ok: node 0's rank ran ahead and released a dispatch's handle "
	       "before its daemon made the routing; with its combine staged "
	       "and the daemon reclaiming, the combine ran and the group went "
	       "on\n");
	/* A node's daemon dies: the other node's streams get peer lost. */
	x->entered = 0;
	x->killed = 0;
	th_spawn(pids, 4, lost_rank, x);
	while (x->entered < 4)
		th_sleep_ms(5);
	th_sleep_ms(100);
	kill(x->d[1].pid, SIGKILL);
	int bad = th_wait_all(pids, 2, 60);
	x->killed = 1;
	th_reap(pids[2], 30);
	th_reap(pids[3], 30);
	TH_CHECK(bad == 0, "node 0's ranks did not get peer lost");
	printf("ok: node 1's daemon killed: node 0's GPU ranks got "
	       "EP_EPEERLOST on their streams\n");
	th_daemon_stop(&x->d[0]);
	return 0;
}
