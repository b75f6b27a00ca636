/* SPDX-License-Identifier: MIT */
/*
 * The low-latency mode's three ways give the same bits: 4 ranks, each in
 * a GPU group (the kernels on its stream; ranks sharing a GPU under MPS),
 * in a host group of another daemon (libep's host path over the daemon's
 * dispatch and combine), and in a GPU group across two more daemons (2
 * nodes of 2 ranks over tcp: the daemons' stream-ordered ops between
 * libep's kernels, libep_llx.c), run the same random inputs through all
 * three: recv_count, layout_range, src_info, every received row and scale
 * (bf16, and the three fp8 casts) and every combined token (plain, with
 * hooks, zero copy) bitwise equal. Rows with zeros, -0.0, tiny and large
 * values; experts repeated in a token, -1 slots. A rank with too many
 * tokens and an expert index out of range give the same error codes on
 * both (ep_ll_error, every rank). Then the two-node group's dispatch and
 * combine captured into CUDA graphs (bf16 and a plain combine; fp8 with
 * UE8M0 scales and a zero-copy combine), each replayed with fresh inputs
 * and compared with the host path on the same inputs every time; once
 * the graph is gone, a direct combine of its captured dispatch is refused
 * and a direct op pair runs bitwise. Before the graphs, ranks run ahead
 * (ahead_phase) on one node and on two.
 *
 * Exit 77 without a GPU, or where ranks share a GPU without MPS.
 */
#include "gpu_util.h"

#include <string.h>
#include <unistd.h>

#define W 4
#define N 16
#define H 1024
#define K 4
#define E (W * 4)
#define El (E / W)
#define WN (W * N)
#define ROUNDS 10
#define GRAPH_REPLAYS 500 /* per graph, two graphs */

struct shared {
	const struct th_daemon *gpu, *host, *node[2];
	volatile int unsupported;
};

struct in {
	uint32_t T;
	uint16_t x[(N + 1) * H];
	int64_t topk[(N + 1) * K];
	float w[(N + 1) * K];
};

/* Inputs of a round: T tokens (fixT, or random when fixT < 0) */
static void gen(uint64_t seed, int round, int r, bool too_many, bool bad,
		int fixT, struct in *in)
{
	uint64_t s = seed * 977 + (uint64_t)round * 131 + (uint64_t)r;
	in->T = too_many ? N + 1 : (uint32_t)(ref_mix(&s) % (N + 1));
	if (fixT >= 0)
		in->T = (uint32_t)fixT;
	if (bad && !in->T)
		in->T = 1; /* a token to carry the bad index */
	for (uint32_t t = 0; t < in->T; t++) {
		int sc = (int)(ref_mix(&s) % 30) - 15;
		for (int c = 0; c < H; c++)
			in->x[t * H + c] = tg_bf16_rand(&s, sc);
		for (int k = 0; k < K; k++) {
			uint64_t v = ref_mix(&s);
			in->topk[t * K + k] = v % 9 == 0 ? -1 : (int64_t)(v % E);
			in->w[t * K + k] =
				(float)((int)(v >> 20 & 2047) - 1024) / 1021.0f;
		}
		if (ref_mix(&s) % 8 == 0)
			in->topk[t * K + K - 1] = in->topk[t * K];
	}
	if (bad && in->T)
		in->topk[1] = E + 3;
}

/* An expert's output row for its place p (the same on both ways once the
 * layouts are equal) */
static void gen_y(uint64_t seed, int round, int r, uint16_t *y)
{
	uint64_t s = seed * 31 + (uint64_t)round * 7 + (uint64_t)r + 99;
	for (uint64_t i = 0; i < (uint64_t)El * WN * H; i++)
		y[i] = tg_bf16_rand(&s, -1);
}

struct out {
	int32_t count[El];
	int64_t layout[El * W];
	int32_t src[El * WN];
	uint8_t *rx;  /* [El, WN, H * 2] */
	uint32_t *sc; /* [El, H/128, WN] */
	uint16_t comb[N * H];
	int rc_d, rc_err;
};

#define SAME(a, b, n, what)                                                    \
	do {                                                                   \
		size_t d_ = th_first_diff((a), (b), (n));                      \
		TH_CHECK(d_ == (size_t)(n),                                    \
			 "round %d rank %d: %s differs at byte %zu", round, r,  \
			 what, d_);                                            \
	} while (0)

/* A dispatch's outputs (rv: device addresses when dev) into ou. */
static void take(const struct ep_ll_recv *rv, bool dev, bool fp8, size_t G,
		 struct out *ou)
{
	const size_t rowb = fp8 ? H : H * 2;
	const size_t nrx = (size_t)El * WN * rowb, nsc = (size_t)El * G * WN * 4;
	if (!dev) {
		memcpy(ou->count, rv->recv_count, sizeof(ou->count));
		memcpy(ou->layout, rv->layout_range, sizeof(ou->layout));
		memcpy(ou->src, rv->src_info, sizeof(ou->src));
		memcpy(ou->rx, rv->recv_x, nrx);
		if (fp8)
			memcpy(ou->sc, rv->recv_scales, nsc);
		return;
	}
	CU(tg_drv.cuMemcpyDtoH(ou->count, tg_dptr(rv->recv_count),
			       sizeof(ou->count)));
	CU(tg_drv.cuMemcpyDtoH(ou->layout, tg_dptr(rv->layout_range),
			       sizeof(ou->layout)));
	CU(tg_drv.cuMemcpyDtoH(ou->src, tg_dptr(rv->src_info),
			       sizeof(ou->src)));
	CU(tg_drv.cuMemcpyDtoH(ou->rx, tg_dptr(rv->recv_x), nrx));
	if (fp8)
		CU(tg_drv.cuMemcpyDtoH(ou->sc, tg_dptr(rv->recv_scales), nsc));
}

/* way's outputs against the host ranks' (hb), bit for bit: the layout,
 * every received row and scale, the first T combined tokens. */
static void same(int round, int r, const char *way, const struct out *a,
		 const struct out *hb, bool fp8, size_t G, uint32_t T)
{
	char what[96];
	const size_t rowb = fp8 ? H : H * 2;
#define AS(x) (snprintf(what, sizeof(what), "%s (%s)", x, way), what)
	SAME(a->count, hb->count, sizeof(a->count), AS("recv_count"));
	SAME(a->layout, hb->layout, sizeof(a->layout), AS("layout_range"));
	SAME(a->src, hb->src, sizeof(a->src), AS("src_info"));
	for (int el = 0; el < El; el++) {
		const size_t n = (size_t)a->count[el];
		SAME(a->rx + (size_t)el * WN * rowb,
		     hb->rx + (size_t)el * WN * rowb, n * rowb, AS("recv_x"));
		for (size_t gi = 0; fp8 && gi < G; gi++)
			SAME(a->sc + ((size_t)el * G + gi) * WN,
			     hb->sc + ((size_t)el * G + gi) * WN, n * 4,
			     AS("recv_scales"));
	}
	SAME(a->comb, hb->comb, (size_t)T * H * 2, AS("combined"));
#undef AS
}

/* in's T tokens (x, topk_idx, weights) to the device. */
static void upload_in(const struct in *in, CUdeviceptr dx, CUdeviceptr dtk,
		      CUdeviceptr dw)
{
	if (!in->T)
		return;
	tg_upload(dx, in->x, (size_t)in->T * H * 2);
	tg_upload(dtk, in->topk, (size_t)in->T * K * 8);
	tg_upload(dw, in->w, (size_t)in->T * K * 4);
}

/* A graph phase's fresh inputs of T tokens and expert rows (y), the
 * tokens on the device. */
static void fresh_in(uint64_t seed, int round, int r, uint32_t T,
		     struct in *in, uint16_t *y, CUdeviceptr dx,
		     CUdeviceptr dtk, CUdeviceptr dw)
{
	gen(seed, round, r, false, false, (int)T, in);
	gen_y(seed, round, r, y);
	upload_in(in, dx, dtk, dw);
}

/* The host ranks' way on in and y: the reference of a graph's replay. */
static void host_way(ep_group_t *h, const struct in *in, const uint16_t *y,
		     unsigned dfl, bool fp8, size_t G, int round, int r,
		     struct out *ou)
{
	struct ep_ll_recv rv;
	ou->rc_d = ep_ll_dispatch(h, in->x, in->topk, in->T, dfl, NULL, &rv);
	TH_CHECK(!ou->rc_d, "round %d rank %d host: %s: %s", round, r,
		 ep_strerror(ou->rc_d), ep_errmsg());
	take(&rv, false, fp8, G, ou);
	TH_OK(ep_ll_combine(h, rv.buffer, y, in->w, ou->comb, 0, NULL));
}

/* Ops of the two-node group captured into a CUDA graph: dispatch (dfl)
 * and combine (cfl) of T tokens, replayed `replays` times, each with fresh
 * inputs (uploaded between replays), bitwise against the host ranks' way
 * on the same inputs. */
static void graph_phase(ep_group_t *xg, ep_group_t *h, CUstream st,
			uint64_t seed, int r, uint32_t T, unsigned dfl,
			unsigned cfl, int replays, CUdeviceptr dx,
			CUdeviceptr dtk, CUdeviceptr dw, CUdeviceptr dy,
			CUdeviceptr dout, struct in *in, uint16_t *y,
			struct out *ox, struct out *oh)
{
	const bool fp8 = dfl & EP_LL_FP8;
	const size_t G = (dfl & EP_LL_UE8M0) ? H / 512 : H / 128;
	void *cx = NULL;
	int round = 1000 + (int)dfl;
	CUgraph graph;
	CUgraphExec exec;
	struct ep_ll_recv rv;
	/* the combine buffers exist before the capture (made at their first
	 * use: an allocation may not be captured) */
	void *cxb[2];
	TH_OK(ep_ll_combine_buffer(xg, 0, &cxb[0]));
	TH_OK(ep_ll_combine_buffer(xg, 1, &cxb[1]));
	CU(tg_drv.cuStreamBeginCapture(st, CU_STREAM_CAPTURE_MODE_GLOBAL));
	int rc = ep_ll_dispatch(xg, (void *)(uintptr_t)dx,
				(const int64_t *)(uintptr_t)dtk, T, dfl, st, &rv);
	TH_CHECK(!rc, "rank %d: capturing the dispatch: %s: %s", r,
		 ep_strerror(rc), ep_errmsg());
	if (cfl & EP_LL_ZERO_COPY)
		cx = cxb[rv.buffer];
	rc = ep_ll_combine(xg, rv.buffer,
			   cx ? NULL : (const void *)(uintptr_t)dy,
			   (const float *)(uintptr_t)dw, (void *)(uintptr_t)dout,
			   cfl, st);
	TH_CHECK(!rc, "rank %d: capturing the combine: %s: %s", r,
		 ep_strerror(rc), ep_errmsg());
	CU(tg_drv.cuStreamEndCapture(st, &graph));
	CU(tg_drv.cuGraphInstantiateWithFlags(&exec, graph, 0));
	/* while the graph holds the ops, a direct call is refused and
	 * changes nothing (the replays below still match) */
	struct ep_ll_recv rv2;
	rc = ep_ll_dispatch(xg, (void *)(uintptr_t)dx,
			    (const int64_t *)(uintptr_t)dtk, T, dfl, st, &rv2);
	TH_CHECK(rc == EP_EBUSY, "rank %d: a direct dispatch beside a graph: "
				 "%s, not EP_EBUSY",
		 r, ep_strerror(rc));
	double *tg = malloc(sizeof(double) * (size_t)replays),
	       *th = malloc(sizeof(double) * (size_t)replays);
	TH_CHECK(tg && th, "out of memory");
	for (int it = 0; it < replays; it++) {
		round = 1000 * (int)(dfl + 2) + it;
		fresh_in(seed, round, r, T, in, y, dx, dtk, dw);
		tg_upload(cx ? tg_dptr(cx) : dy, y, (size_t)El * WN * H * 2);
		uint64_t t0 = th_now_ns();
		CU(tg_drv.cuGraphLaunch(exec, st));
		CU(tg_drv.cuStreamSynchronize(st));
		tg[it] = (double)(th_now_ns() - t0) / 1e3;
		take(&rv, true, fp8, G, ox);
		CU(tg_drv.cuMemcpyDtoH(ox->comb, dout, (size_t)T * H * 2));
		TH_OK(ep_ll_error(xg));
		t0 = th_now_ns();
		host_way(h, in, y, dfl, fp8, G, round, r, oh);
		th[it] = (double)(th_now_ns() - t0) / 1e3;
		same(round, r, "two nodes, graph replay", ox, oh, fp8, G, T);
	}
	if (r == 0) /* a figure, not a check: the CPU's clock, rank 0 */
		printf("perf: two nodes x 2 GPU ranks over tcp, %u tokens of "
		       "hidden %d, top-%d (%s dispatch, %s combine): a graph "
		       "replay of both ops %.0f us (median of %d); the host "
		       "ranks' same ops on one daemon %.0f us\n",
		       T, H, K, fp8 ? "fp8" : "bf16",
		       cx ? "zero-copy" : "plain", tg_median(tg, replays),
		       replays, tg_median(th, replays));
	free(tg);
	free(th);
	CU(tg_drv.cuGraphExecDestroy(exec));
	CU(tg_drv.cuGraphDestroy(graph));
	/* The graph gone (CUDA lets its records go shortly after): a direct
	 * combine of the buffer whose dispatch was captured is refused
	 * (EP_EINVAL) and ends nothing; a direct op pair then runs bitwise. */
	rc = EP_EBUSY;
	for (int tries = 0; rc == EP_EBUSY && tries < 1000; tries++) {
		rc = ep_ll_combine(xg, rv.buffer,
				   cx ? NULL : (const void *)(uintptr_t)dy,
				   (const float *)(uintptr_t)dw,
				   (void *)(uintptr_t)dout, cfl, st);
		if (rc == EP_EBUSY)
			th_sleep_ms(2);
	}
	TH_CHECK(rc == EP_EINVAL, "rank %d: a direct combine of a captured "
				  "dispatch: %s (%s), not EP_EINVAL",
		 r, ep_strerror(rc), ep_errmsg());
	round = 1000 * (int)(dfl + 2) + replays;
	fresh_in(seed, round, r, T, in, y, dx, dtk, dw);
	rc = ep_ll_dispatch(xg, (void *)(uintptr_t)dx,
			    (const int64_t *)(uintptr_t)dtk, T, dfl, st, &rv);
	TH_CHECK(!rc, "rank %d: a direct dispatch after the graph: %s (%s)", r,
		 ep_strerror(rc), ep_errmsg());
	if (cx)
		TH_OK(ep_ll_combine_buffer(xg, rv.buffer, &cx));
	tg_upload(cx ? tg_dptr(cx) : dy, y, (size_t)El * WN * H * 2);
	TH_OK(ep_ll_combine(xg, rv.buffer,
			    cx ? NULL : (const void *)(uintptr_t)dy,
			    (const float *)(uintptr_t)dw,
			    (void *)(uintptr_t)dout, cfl, st));
	CU(tg_drv.cuStreamSynchronize(st));
	take(&rv, true, fp8, G, ox);
	CU(tg_drv.cuMemcpyDtoH(ox->comb, dout, (size_t)T * H * 2));
	TH_OK(ep_ll_error(xg));
	host_way(h, in, y, dfl, fp8, G, round, r, oh);
	same(round, r, "two nodes, direct after a graph", ox, oh, fp8, G, T);
}

/* Ranks running ahead: every rank enqueues AHEAD op pairs on its stream,
 * the CPU never waiting (fresh inputs and expert rows each, each pair its
 * own output; bf16 and fp8 dispatches in turn): ranks 0-2 back to back,
 * rank 3 after a 200 ms sleep and then 200 us apart, so the others' later
 * dispatches, and libep's release of each buffer's routing two dispatches
 * back, reach the daemons before their ops run, and rank 3's releases
 * keep arriving while the daemons work through the backlog. Then each
 * pair's combined tokens bitwise against the host path's on the same
 * inputs. */
#define AHEAD 24
static void ahead_phase(ep_group_t *gg, ep_group_t *h, CUstream st,
			uint64_t seed, int r, int salt, const char *way,
			struct out *ox, struct out *oh)
{
	struct in *in = malloc(sizeof(*in) * AHEAD);
	uint16_t *y = malloc((size_t)El * WN * H * 2 * AHEAD);
	TH_CHECK(in && y, "out of memory");
	CUdeviceptr dx[AHEAD], dtk[AHEAD], dw[AHEAD], dy[AHEAD], dout[AHEAD];
	const size_t ysz = (size_t)El * WN * H * 2;
	for (int i = 0; i < AHEAD; i++) {
		CU(tg_drv.cuMemAlloc(&dx[i], sizeof(in->x)));
		CU(tg_drv.cuMemAlloc(&dtk[i], sizeof(in->topk)));
		CU(tg_drv.cuMemAlloc(&dw[i], sizeof(in->w)));
		CU(tg_drv.cuMemAlloc(&dy[i], ysz));
		CU(tg_drv.cuMemAlloc(&dout[i], N * H * 2));
		gen(seed, salt + i, r, false, false, -1, &in[i]);
		gen_y(seed, salt + i, r, y + (size_t)i * El * WN * H);
		upload_in(&in[i], dx[i], dtk[i], dw[i]);
		tg_upload(dy[i], y + (size_t)i * El * WN * H, ysz);
	}
	if (r == W - 1)
		th_sleep_ms(200);
	for (int i = 0; i < AHEAD; i++) {
		struct ep_ll_recv rv;
		const unsigned dfl = i % 2 ? EP_LL_FP8 : 0;
		if (r == W - 1 && i)
			usleep(200);
		int rc = ep_ll_dispatch(gg, (void *)(uintptr_t)dx[i],
					(const int64_t *)(uintptr_t)dtk[i],
					in[i].T, dfl, st, &rv);
		TH_CHECK(!rc, "rank %d (%s): dispatch %d ahead: %s (%s)", r, way,
			 i, ep_strerror(rc), ep_errmsg());
		rc = ep_ll_combine(gg, rv.buffer, (const void *)(uintptr_t)dy[i],
				   (const float *)(uintptr_t)dw[i],
				   (void *)(uintptr_t)dout[i], 0, st);
		TH_CHECK(!rc, "rank %d (%s): combine %d ahead: %s (%s)", r, way,
			 i, ep_strerror(rc), ep_errmsg());
	}
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_ll_error(gg));
	for (int i = 0; i < AHEAD; i++) {
		const int round = salt + i;
		const bool fp8 = i % 2;
		CU(tg_drv.cuMemcpyDtoH(ox->comb, dout[i], (size_t)in[i].T * H * 2));
		host_way(h, &in[i], y + (size_t)i * El * WN * H,
			 fp8 ? EP_LL_FP8 : 0, fp8, H / 128, round, r, oh);
		SAME(ox->comb, oh->comb, (size_t)in[i].T * H * 2, way);
		CU(tg_drv.cuMemFree(dx[i]));
		CU(tg_drv.cuMemFree(dtk[i]));
		CU(tg_drv.cuMemFree(dw[i]));
		CU(tg_drv.cuMemFree(dy[i]));
		CU(tg_drv.cuMemFree(dout[i]));
	}
	free(in);
	free(y);
}

static int rank_main(int r, void *arg)
{
	struct shared *s = arg;
	int gpu;
	CUstream st = tg_rank_init(r, &gpu, NULL, 0, NULL);
	struct ep_group_config cfg = {
		.name = "llx", .world_size = W, .ranks_per_node = W,
		.rank = (uint32_t)r, .num_experts = E, .hidden = H,
		.max_tokens_per_rank = N, .topk = K, .dtype = EP_DTYPE_BF16,
		.timeout_ms = 20000, .cuda_device = gpu};
	ep_conn_t *gc, *hc, *xc;
	ep_group_t *g, *h, *xg;
	TH_OK(ep_connect(s->gpu->sock, &gc));
	TH_OK(ep_join(gc, &cfg, EP_JOIN_CUDA, &g));
	h = th_join(s->host, &cfg, &hc);
	struct ep_group_config xcfg = cfg;
	xcfg.name = "llx2n";
	xcfg.ranks_per_node = 2;
	TH_OK(ep_connect(s->node[r / 2]->sock, &xc));
	TH_OK(ep_join(xc, &xcfg, EP_JOIN_CUDA, &xg));
	CUdeviceptr dx, dtk, dw, dy, dout;
	CU(tg_drv.cuMemAlloc(&dx, sizeof(((struct in *)0)->x)));
	CU(tg_drv.cuMemAlloc(&dtk, sizeof(((struct in *)0)->topk)));
	CU(tg_drv.cuMemAlloc(&dw, sizeof(((struct in *)0)->w)));
	CU(tg_drv.cuMemAlloc(&dy, (size_t)El * WN * H * 2));
	CU(tg_drv.cuMemAlloc(&dout, N * H * 2));
	struct in *in = malloc(sizeof(*in));
	uint16_t *y = malloc((size_t)El * WN * H * 2);
	struct out *o[3];
	for (int i = 0; i < 3; i++) {
		o[i] = calloc(1, sizeof(*o[i]));
		o[i]->rx = malloc((size_t)El * WN * H * 2);
		o[i]->sc = malloc((size_t)El * (H / 128) * WN * 4);
	}
	static const unsigned df[] = {
		0, EP_LL_FP8, EP_LL_FP8 | EP_LL_ROUND_SCALE,
		EP_LL_FP8 | EP_LL_UE8M0, EP_LL_HOOK,
		EP_LL_HOOK | EP_LL_FP8 | EP_LL_UE8M0};
	static const unsigned cf[] = {0, EP_LL_HOOK, EP_LL_ZERO_COPY};
	const uint64_t seed = th_seed();
	for (int round = 0; round < ROUNDS + 2; round++) {
		const bool too_many = round == ROUNDS && r == 1;
		const bool bad = round == ROUNDS + 1 && r == 2;
		const unsigned dfl = df[round % 6], cfl = cf[round % 3];
		gen(seed, round, r, too_many, bad, -1, in);
		gen_y(seed, round, r, y);
		const bool fp8 = dfl & EP_LL_FP8;
		const size_t G = (dfl & EP_LL_UE8M0) ? H / 512 : H / 128;
		/* 0: the kernels, 1: host ranks, 2: GPU ranks on two nodes
		 * (the daemons' stream-ordered ops between kernels). Way 2
		 * runs dispatch, hook, combine and hook back to back on the
		 * stream, the CPU never waiting in between. */
		for (int way = 0; way < 3; way++) {
			struct out *ou = o[way];
			ep_group_t *gg = way == 1 ? h : way == 2 ? xg : g;
			const bool dev = way != 1;
			void *stw = dev ? st : NULL;
			struct ep_ll_recv rv;
			const void *px = in->x;
			const int64_t *pt = in->topk;
			if (dev) {
				upload_in(in, dx, dtk, dw);
				px = (void *)(uintptr_t)dx;
				pt = (const int64_t *)(uintptr_t)dtk;
			}
			ou->rc_d = ep_ll_dispatch(gg, px, pt, in->T, dfl, stw,
						  &rv);
			if (ou->rc_d == EP_EUNSUPPORTED && !way && !round) {
				s->unsupported = 1;
				return 0;
			}
			TH_CHECK(!ou->rc_d || ou->rc_d == EP_ETOOBIG,
				 "round %d rank %d way %d: %s: %s", round, r,
				 way, ep_strerror(ou->rc_d), ep_errmsg());
			if (dfl & EP_LL_HOOK)
				TH_OK(ep_ll_dispatch_hook(gg, rv.buffer, stw));
			if (way == 0) {
				CU(tg_drv.cuStreamSynchronize(st));
				take(&rv, true, fp8, G, ou);
			} else if (way == 1) {
				take(&rv, false, fp8, G, ou);
			}
			/* the combine: y at the places the dispatch gave */
			const void *ex = dev ? (const void *)(uintptr_t)dy
					     : (const void *)y;
			if (cfl & EP_LL_ZERO_COPY) {
				void *cx;
				TH_OK(ep_ll_combine_buffer(gg, rv.buffer, &cx));
				if (!dev)
					memcpy(cx, y, (size_t)El * WN * H * 2);
				else
					CU(tg_drv.cuMemcpyHtoDAsync(
						tg_dptr(cx), y,
						(size_t)El * WN * H * 2, st));
				ex = NULL;
			} else if (dev) {
				CU(tg_drv.cuMemcpyHtoDAsync(
					dy, y, (size_t)El * WN * H * 2, st));
			}
			const float *pw = dev ? (const float *)(uintptr_t)dw
					      : in->w;
			void *pout = dev ? (void *)(uintptr_t)dout
					 : (void *)ou->comb;
			TH_OK(ep_ll_combine(gg, rv.buffer, ex, pw, pout, cfl,
					    stw));
			if (cfl & EP_LL_HOOK)
				TH_OK(ep_ll_combine_hook(gg, rv.buffer, stw));
			if (dev) {
				CU(tg_drv.cuStreamSynchronize(st));
				if (way == 2)
					take(&rv, true, fp8, G, ou);
				CU(tg_drv.cuMemcpyDtoH(ou->comb, dout,
						       sizeof(ou->comb)));
			}
			ou->rc_err = ep_ll_error(gg);
		}
		for (int wv = 0; wv < 3; wv += 2) {
			const struct out *a = o[wv], *hb = o[1];
			TH_CHECK(a->rc_d == hb->rc_d && a->rc_err == hb->rc_err,
				 "round %d rank %d: way %d's %d/%d, the host's "
				 "%d/%d",
				 round, r, wv, a->rc_d, a->rc_err, hb->rc_d,
				 hb->rc_err);
			TH_CHECK(round < ROUNDS || a->rc_err ==
						   (round == ROUNDS ? EP_ETOOBIG
						    : r == 2	 ? EP_EEXPERT
								 : 0),
				 "round %d rank %d way %d: ep_ll_error %d", round,
				 r, wv, a->rc_err);
			same(round, r, wv ? "two nodes" : "kernels", a, hb, fp8,
			     G, in->T > N ? 0 : in->T);
		}
	}
	/* ranks running ahead: the kernels of one node, and two nodes */
	ahead_phase(g, h, st, seed, r, 3000, "one node, ranks ahead", o[0], o[1]);
	ahead_phase(xg, h, st, seed, r, 4000, "two nodes, ranks ahead", o[2],
		    o[1]);
	/* CUDA graphs of the two-node group: bf16 with a plain combine, fp8
	 * (UE8M0) with a zero-copy one */
	graph_phase(xg, h, st, seed, r, N - 3, 0, 0, GRAPH_REPLAYS, dx, dtk,
		    dw, dy, dout, in, y, o[2], o[1]);
	graph_phase(xg, h, st, seed, r, 5, EP_LL_FP8 | EP_LL_UE8M0,
		    EP_LL_ZERO_COPY, GRAPH_REPLAYS, dx, dtk, dw, dy, dout, in,
		    y, o[2], o[1]);
	TH_OK(ep_leave(g));
	TH_OK(ep_leave(h));
	TH_OK(ep_leave(xg));
	ep_close(gc);
	ep_close(hc);
	ep_close(xc);
	return 0;
}

int main(void)
{
	th_init("gpu: the low-latency mode, GPU and host ways bitwise", 300);
	if (tg_probe())
		return TH_SKIP;
	struct th_daemon dg, dh, dn[2];
	th_daemon_start(&dg, "-b", "cuda", NULL);
	th_daemon_start(&dh, NULL);
	/* two more, a cluster over tcp: the GPU ranks' group across nodes */
	tg_cluster2(dn, "epdllx", 20);
	struct shared *s = th_shared(sizeof(*s));
	s->gpu = &dg;
	s->host = &dh;
	s->node[0] = &dn[0];
	s->node[1] = &dn[1];
	pid_t p[W];
	th_spawn(p, W, rank_main, s);
	TH_CHECK(th_wait_all(p, W, 240) == 0, "a rank failed");
	th_daemon_stop(&dg);
	th_daemon_stop(&dh);
	th_daemon_stop(&dn[0]);
	th_daemon_stop(&dn[1]);
	if (s->unsupported) {
		printf("skip: the low-latency mode needs MPS where ranks share "
		       "a GPU\n");
		return TH_SKIP;
	}
	printf("ok: %d rounds and two error rounds, 4 ranks: the kernels, "
	       "the host path and GPU ranks on two nodes (stream-ordered) "
	       "bitwise equal (counts, layout, src_info, rows and scales of "
	       "bf16 and three fp8 casts, combined tokens plain, hooked and "
	       "zero copy; the same error codes); two nodes' ops captured "
	       "into CUDA graphs, %d replays with fresh inputs bitwise equal "
	       "to the host path; ranks %d op pairs ahead on one node and on "
	       "two, bitwise\n",
	       ROUNDS, 2 * GRAPH_REPLAYS, AHEAD);
	return 0;
}
