/* SPDX-License-Identifier: MIT */
/*
 * Dispatch, cached dispatch and combine on the CUDA backend, compared
 * bitwise with the host backend (a second daemon, the same fresh inputs)
 * and with the independent reference, over corner cases and random shapes.
 *
 * Stream order: each rank's upload of its inputs is held on its stream
 * behind a gate (a wait on host memory) that its CPU opens only after the
 * dispatch is enqueued; outputs are poisoned first and every byte is
 * checked, the rows past the received count still poisoned.
 *
 * EPD_TEST_SEED repeats a run; EPD_TEST_CASES sets the random cases.
 * Exit 77 without a GPU.
 */
#include "gpu_util.h"
#include "ref.h"

#include <signal.h>
#include <string.h>
#include <time.h>

#define POISON 0xa5
#define POISONED(n) th_poisoned((n), POISON)
#define ALL_POISON(p, n) th_all_is((p), (n), POISON)

struct ctx {
	const struct th_daemon *gpu, *host;
	struct ref_case c;
	int index;
	int bad_rank; /* >= 0: that rank sends a bad expert index first */
	int big_rank; /* >= 0: that rank asks for too many tokens first */
	volatile uint32_t gate[8];
};

#define SAME(got, want, n, what)                                               \
	do {                                                                   \
		size_t d_ = th_first_diff(got, want, n);                       \
		TH_CHECK(d_ == (size_t)(n),                                    \
			 "case %d rank %d: %s differs at byte %zu", x->index,  \
			 r, what, d_);                                         \
	} while (0)

/* Async copies need pinned host memory: from pageable memory they block
 * the CPU until the stream reaches them, and the stream waits on a gate
 * that this CPU opens afterwards. */
static void pin(void *p, size_t n)
{
	if (n)
		CU(tg_drv.cuMemHostRegister(p, n, 0));
}

/* Do the n bytes at device address p all hold the poison? */
static bool dev_poisoned(const void *p, size_t n)
{
	uint8_t *chk = malloc(n);
	CU(tg_drv.cuMemcpyDtoH(chk, tg_dptr(p), n));
	bool ok = ALL_POISON(chk, n);
	free(chk);
	return ok;
}

/* A failed dispatch changed nothing: the device count still holds the
 * 0x5a5a5a5a put there before it, recv_x (n bytes) still the poison. */
static void unchanged(ep_group_t *g, const struct ep_buffers *b, size_t n)
{
	uint32_t cnt = 0;
	CU(tg_drv.cuMemcpyDtoH(&cnt, ep_dispatch_recv_count_device(g), 4));
	TH_CHECK(cnt == 0x5a5a5a5au, "a failed dispatch wrote the device "
				     "count: %u", cnt);
	TH_CHECK(dev_poisoned(b->recv_x, n), "a failed dispatch wrote recv_x");
}

/* n expert indices into the group's topk_idx, entry at (if there is one:
 * < n) replaced by v. */
static void upload_topk(const struct ep_buffers *b, const int64_t *topk,
			uint64_t n, uint64_t at, int64_t v)
{
	int64_t *t = malloc(n * 8 + 8);
	TH_CHECK(t, "out of memory");
	memcpy(t, topk, n * 8);
	if (at < n)
		t[at] = v;
	tg_upload(tg_dptr(b->topk_idx), t, n * 8);
	free(t);
}

/* The op just enqueued on st named the handle of a dispatch refused for
 * a bad expert index: it failed alone (EP_ESTALE), naming that index
 * (want). */
static void refused_for(ep_group_t *g, CUstream st, const char *want,
			const char *what)
{
	CU(tg_drv.cuStreamSynchronize(st));
	TH_EXPECT_RC(ep_group_sync(g), EP_ESTALE);
	TH_CHECK(strstr(ep_errmsg(), want) &&
			 strstr(ep_errmsg(), "made its handle failed"),
		 "rank %u: %s of a refused dispatch's handle: %s",
		 ep_group_rank(g), what, ep_errmsg());
}

/* The first n bytes of device memory src (recv_x or another receive area)
 * once what is queued on st has run, into pinned dst; the group's ops
 * succeeded. */
static void rows_after(ep_group_t *g, CUstream st, const void *src,
		       void *dst, size_t n)
{
	CU(tg_drv.cuMemcpyDtoHAsync(dst, tg_dptr(src), n, st));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_group_sync(g));
}

static void recv_x_after(ep_group_t *g, CUstream st,
			 const struct ep_buffers *b, void *dst, size_t n)
{
	rows_after(g, st, b->recv_x, dst, n);
}

/* ep_stream_copies: pieces of every element size, strided on either
 * side, an empty one, at odd offsets, against the same moves on the host
 * (fresh random bytes, a poisoned destination); then its refusals. */
static void check_copies(CUstream st, uint64_t seed)
{
	const size_t n = 1 << 20;
	uint8_t *h = malloc(n), *got = malloc(n), *want = malloc(n);
	for (size_t i = 0; i < n; i++) {
		seed = seed * 6364136223846793005ull + 1442695040888963407ull;
		h[i] = (uint8_t)(seed >> 56);
	}
	CUdeviceptr src, dst;
	CU(tg_drv.cuMemAlloc(&src, n));
	CU(tg_drv.cuMemAlloc(&dst, n));
	tg_upload(src, h, n);
	CU(tg_drv.cuMemsetD8(dst, POISON, n));
	const struct {
		size_t doff, soff, count;
		uint32_t elt, ds, ss;
	} pc[] = {{0, 16, 4096, 16, 1, 1},     {65536, 65544, 1000, 8, 1, 1},
		  {131072, 4, 777, 4, 1, 3},    {262144, 262146, 500, 2, 2, 1},
		  {300001, 7, 999, 1, 1, 1},    {400000, 0, 0, 16, 1, 1},
		  {500000, 600000, 20000, 4, 0, 2}};
	const unsigned np = sizeof(pc) / sizeof(pc[0]);
	struct ep_copy c[sizeof(pc) / sizeof(pc[0])];
	memset(want, POISON, n);
	for (unsigned j = 0; j < np; j++) {
		c[j] = (struct ep_copy){
			.dst = (void *)(uintptr_t)(dst + pc[j].doff),
			.src = (const void *)(uintptr_t)(src + pc[j].soff),
			.count = pc[j].count, .elt = pc[j].elt,
			.dst_stride = pc[j].ds, .src_stride = pc[j].ss};
		const size_t ds = pc[j].ds ? pc[j].ds : 1;
		for (size_t i = 0; i < pc[j].count; i++)
			memcpy(want + pc[j].doff + i * ds * pc[j].elt,
			       h + pc[j].soff + i * pc[j].ss * pc[j].elt,
			       pc[j].elt);
	}
	TH_OK(ep_stream_copies(c, np, st));
	CU(tg_drv.cuStreamSynchronize(st));
	CU(tg_drv.cuMemcpyDtoH(got, dst, n));
	size_t d = th_first_diff(got, want, n);
	TH_CHECK(d == n, "ep_stream_copies: differs at byte %zu", d);
	TH_EXPECT_RC(ep_stream_copies(c, 0, st), EP_EINVAL);
	TH_EXPECT_RC(ep_stream_copies(c, EP_COPIES_MAX + 1, st), EP_EINVAL);
	struct ep_copy bad = c[2];
	bad.elt = 3;
	TH_EXPECT_RC(ep_stream_copies(&bad, 1, st), EP_EINVAL);
	bad = c[2];
	bad.dst = (uint8_t *)bad.dst + 2; /* not aligned to 4 bytes */
	TH_EXPECT_RC(ep_stream_copies(&bad, 1, st), EP_EINVAL);
	CU(tg_drv.cuMemFree(src));
	CU(tg_drv.cuMemFree(dst));
	free(h);
	free(got);
	free(want);
	printf("ok: ep_stream_copies: %u copies in one launch (element sizes "
	       "1-16, strided either side, odd offsets, an empty one) equal "
	       "the host's; bad counts, sizes and alignment refused\n",
	       np);
}

static int case_rank(int r, void *arg)
{
	struct ctx *x = arg;
	const struct ref_case *c = &x->c;
	const uint32_t W = c->world, H = c->hidden, K = c->topk,
		       E = c->experts, elt = ref_elt(c);
	const uint32_t ns = c->dtype == EP_DTYPE_FP8 ? H / 128 : 0;
	const uint32_t per = E / W;
	CUdeviceptr gdev;
	int gpu;
	CUstream st = tg_rank_init(r, &gpu, (void *)x->gate, sizeof(x->gate),
				   &gdev);
	if (x->index == 0 && r == 0)
		check_copies(st, c->seed);
	struct ref_inputs in[8], in2[8];
	struct ref_recv exp[8], exp2[8];
	ref_gen_world(c, in, in2, exp, exp2);
	const struct ref_inputs *me = &in[r];
	const uint64_t R = exp[r].R, cap = (uint64_t)W * c->max_tokens;
	char name[32];
	snprintf(name, sizeof(name), "gd%d", x->index);
	struct ep_group_config cfg = {
		.name = name, .world_size = W, .ranks_per_node = W,
		.rank = (uint32_t)r, .num_experts = E, .hidden = H,
		.max_tokens_per_rank = c->max_tokens, .topk = K,
		.dtype = (ep_dtype_t)c->dtype, .timeout_ms = 30000,
		.cuda_device = gpu};
	ep_conn_t *hc, *gc;
	ep_group_t *hg, *g;
	/* The host backend: the same inputs through the copy path. */
	hg = th_join(x->host, &cfg, &hc);
	struct ep_dispatch_in din = {
		.num_tokens = me->T, .hidden = H, .dtype = (ep_dtype_t)c->dtype,
		.topk = K, .x = me->x, .x_scales = me->scales,
		.topk_idx = me->topk,
		.topk_weights = c->weights ? me->weights : NULL};
	struct ep_dispatch_out hout = {
		.capacity = cap, .recv_x = POISONED(cap * H * elt),
		.recv_x_scales = POISONED(cap * ns * 4 + 4),
		.recv_topk_idx = POISONED(cap * K * 8),
		.recv_topk_weights = POISONED(cap * K * 4),
		.num_recv_tokens_per_expert = POISONED(per * 4)};
	ep_handle_t hh;
	TH_OK(ep_dispatch(hg, &din, NULL, &hout, &hh));

	/* The CUDA backend. */
	TH_OK(ep_connect(x->gpu->sock, &gc));
	/* two receive areas: the rerun below goes to area 1 */
	TH_OK(ep_join(gc, &cfg, EP_JOIN_CUDA | EP_JOIN_RECV_AREAS(2), &g));
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	TH_CHECK(ep_recv_area(g, 0) == b.recv_x && ep_recv_area(g, 1) &&
			 !ep_recv_area(g, 2),
		 "receive areas of a GPU group");
	/* poison every output on the device */
	CU(tg_drv.cuMemsetD8(tg_dptr(b.recv_x), POISON, cap * H * elt));
	if (ns)
		CU(tg_drv.cuMemsetD8(tg_dptr(b.recv_x_scales), POISON,
				     cap * ns * 4));
	CU(tg_drv.cuMemsetD8(tg_dptr(b.recv_topk_idx), POISON, cap * K * 8));
	CU(tg_drv.cuMemsetD8(tg_dptr(b.recv_topk_weights), POISON, cap * K * 4));
	CU(tg_drv.cuMemsetD8(tg_dptr(b.recv_src), POISON, cap * 8));
	CU(tg_drv.cuMemsetD8(tg_dptr(b.num_recv_tokens_per_expert), POISON,
			     per * 4));
	CU(tg_drv.cuMemsetD8(tg_dptr(b.combined), POISON,
			     (size_t)c->max_tokens * H * 2));

	if (x->bad_rank >= 0) {
		/* one bad expert index anywhere: every rank's op fails and
		 * nothing changes */
		upload_topk(&b, me->topk, (uint64_t)me->T * K,
			    r == x->bad_rank ? K - 1 : UINT64_MAX, E);
		ep_handle_t hb;
		CU(tg_drv.cuMemsetD32(ep_dispatch_recv_count_device(g),
				      0x5a5a5a5au, 1));
		TH_OK(ep_dispatch_stream(g, me->T, 0, NULL, st, &hb));
		CU(tg_drv.cuStreamSynchronize(st));
		TH_EXPECT_RC(ep_group_sync(g), EP_EEXPERT);
		unchanged(g, &b, cap * H * elt);
	}
	if (x->big_rank >= 0) {
		/* one rank asks for more tokens than the group holds: it gets
		 * EP_ETOOBIG at once, every other rank from its count, all
		 * naming that rank; nothing changes and the group goes on */
		ep_handle_t hb;
		CU(tg_drv.cuMemsetD32(ep_dispatch_recv_count_device(g),
				      0x5a5a5a5au, 1));
		uint64_t t0 = th_now_ns();
		if (r == x->big_rank) {
			TH_EXPECT_RC(ep_dispatch_stream(g, c->max_tokens + 1, 0,
							NULL, st, &hb),
				     EP_ETOOBIG);
			TH_CHECK(strstr(ep_errmsg(), "exceed"), "message: %s",
				 ep_errmsg());
			TH_OK(ep_group_sync(g)); /* told once, not twice */
		} else {
			TH_OK(ep_dispatch_stream(g, me->T, 0, NULL, st, &hb));
			TH_EXPECT_RC(ep_dispatch_recv_count(g, &hb), EP_ETOOBIG);
			char want[32];
			snprintf(want, sizeof(want), "rank %d dispatched %u",
				 x->big_rank, c->max_tokens + 1);
			TH_CHECK(strstr(ep_errmsg(), want), "message: %s",
				 ep_errmsg());
			TH_OK(ep_group_sync(g)); /* reported once */
			ep_handle_release(g, &hb);
		}
		CU(tg_drv.cuStreamSynchronize(st));
		TH_CHECK(th_now_ns() - t0 < 2000000000ull,
			 "too many tokens took %llu ms to report",
			 (unsigned long long)((th_now_ns() - t0) / 1000000));
		unchanged(g, &b, cap * H * elt);
	}

	pin(me->x, (size_t)me->T * H * elt);
	if (ns)
		pin(me->scales, (size_t)me->T * ns * 4);
	pin(me->topk, (size_t)me->T * K * 8);
	pin(me->weights, (size_t)me->T * K * 4);
	pin(me->bias, (size_t)me->T * H * 2);
	pin(in2[r].x, (size_t)me->T * H * elt);
	if (ns)
		pin(in2[r].scales, (size_t)me->T * ns * 4);
	/* Upload behind a gate, dispatch, download: all on the stream. */
	CU(tg_drv.cuStreamWaitValue32(st, gdev + (uintptr_t)&x->gate[r] -
						  (uintptr_t)x->gate,
				      1, CU_STREAM_WAIT_VALUE_GEQ));
	CU(tg_drv.cuMemcpyHtoDAsync(tg_dptr(b.x), me->x, (size_t)me->T * H * elt,
				    st));
	if (ns)
		CU(tg_drv.cuMemcpyHtoDAsync(tg_dptr(b.x_scales), me->scales,
					    (size_t)me->T * ns * 4, st));
	CU(tg_drv.cuMemcpyHtoDAsync(tg_dptr(b.topk_idx), me->topk,
				    (size_t)me->T * K * 8, st));
	CU(tg_drv.cuMemcpyHtoDAsync(tg_dptr(b.topk_weights), me->weights,
				    (size_t)me->T * K * 4, st));
	/* the count the dispatch leaves in device memory, read on the
	 * stream right after it (no CPU wait in between) */
	uint32_t *dcount = POISONED(4096);
	pin(dcount, 4096);
	CU(tg_drv.cuMemsetD32Async(ep_dispatch_recv_count_device(g),
				   0xa5a5a5a5u, 1, st));
	ep_handle_t h;
	TH_OK(ep_dispatch_stream(g, me->T,
				 c->weights ? EP_DISPATCH_WEIGHTS : 0, NULL,
				 st, &h));
	CU(tg_drv.cuMemcpyDtoHAsync(dcount, ep_dispatch_recv_count_device(g),
				    4, st));
	uint8_t *gx = POISONED(cap * H * elt);
	float *gs = POISONED(cap * ns * 4);
	int64_t *gi = POISONED(cap * K * 8);
	float *gw = POISONED(cap * K * 4);
	int32_t *gsrc = POISONED(cap * 8), *gpe = POISONED(per * 4);
	pin(gx, cap * H * elt);
	if (ns)
		pin(gs, cap * ns * 4);
	pin(gi, cap * K * 8);
	pin(gw, cap * K * 4);
	pin(gsrc, cap * 8);
	pin(gpe, per * 4);
	CU(tg_drv.cuMemcpyDtoHAsync(gx, tg_dptr(b.recv_x), cap * H * elt, st));
	if (ns)
		CU(tg_drv.cuMemcpyDtoHAsync(gs, tg_dptr(b.recv_x_scales),
					    cap * ns * 4, st));
	CU(tg_drv.cuMemcpyDtoHAsync(gi, tg_dptr(b.recv_topk_idx), cap * K * 8,
				    st));
	CU(tg_drv.cuMemcpyDtoHAsync(gw, tg_dptr(b.recv_topk_weights),
				    cap * K * 4, st));
	CU(tg_drv.cuMemcpyDtoHAsync(gsrc, tg_dptr(b.recv_src), cap * 8, st));
	CU(tg_drv.cuMemcpyDtoHAsync(gpe, tg_dptr(b.num_recv_tokens_per_expert),
				    per * 4, st));
	th_sleep_ms(5);
	x->gate[r] = 1; /* only now may the upload start */
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_group_sync(g));
	TH_OK(ep_dispatch_recv_count(g, &h));
	TH_CHECK(h.num_recv == R && hh.num_recv == R && *dcount == R,
		 "case %d rank %d: received %u (host %u, on the device %u), "
		 "want %llu",
		 x->index, r, h.num_recv, hh.num_recv, *dcount,
		 (unsigned long long)R);
	SAME(gx, hout.recv_x, R * H * elt, "recv_x vs host backend");
	SAME(gx, exp[r].x, R * H * elt, "recv_x vs reference");
	TH_CHECK(ALL_POISON(gx + R * H * elt, (cap - R) * H * elt),
		 "case %d rank %d: recv_x written past row %llu", x->index, r,
		 (unsigned long long)R);
	if (ns)
		SAME(gs, hout.recv_x_scales, R * ns * 4, "recv_x_scales");
	SAME(gi, hout.recv_topk_idx, R * K * 8, "recv_topk_idx");
	TH_CHECK(ALL_POISON((uint8_t *)gi + R * K * 8, (cap - R) * K * 8),
		 "recv_topk_idx written past the rows");
	SAME(gw, hout.recv_topk_weights, R * K * 4, "recv_topk_weights");
	SAME(gsrc, exp[r].src, R * 8, "recv_src");
	SAME(gpe, hout.num_recv_tokens_per_expert, per * 4,
	     "num_recv_tokens_per_expert");
	/* the rank prefix matrix, against the reference and the host
	 * backend's */
	int32_t rp[64], grp[64];
	struct ep_buffers hb;
	TH_OK(ep_get_buffers(hg, &hb));
	ref_rank_prefix(c, exp, rp);
	CU(tg_drv.cuMemcpyDtoHAsync(grp, tg_dptr(b.rank_prefix_matrix),
				    W * W * 4, st));
	CU(tg_drv.cuStreamSynchronize(st));
	SAME(grp, rp, W * W * 4, "rank_prefix_matrix vs reference");
	SAME(hb.rank_prefix_matrix, rp, W * W * 4,
	     "host rank_prefix_matrix vs reference");

	/* Again: identical bytes. Then cached dispatch of new data equals a
	 * fresh dispatch of it (and the host backend's). */
	/* The rerun into receive area 1 (each rank names its own): area 0
	 * keeps the poison put there, area 1 gets the same bytes. */
	ep_handle_t h2, hc2, h3;
	CU(tg_drv.cuMemsetD32Async(tg_dptr(b.recv_x), 0x01010101u * POISON,
				   cap * H * elt / 4, st));
	TH_OK(ep_dispatch_stream(g, me->T,
				 (c->weights ? EP_DISPATCH_WEIGHTS : 0) |
					 EP_DISPATCH_AREA(1),
				 NULL, st, &h2));
	/* its count and rows per expert come once its routing is known:
	 * read before this CPU waited for the stream (protocol 1.15), they
	 * equal the host backend's */
	int32_t *pe2 = POISONED(per * 4 + 4);
	TH_OK(ep_dispatch_recv_count(g, &h2));
	TH_CHECK(h2.num_recv == R, "case %d rank %d: rerun received %u, want "
				   "%llu", x->index, r, h2.num_recv,
		 (unsigned long long)R);
	TH_OK(ep_dispatch_recv_expert_counts(g, &h2, pe2, per));
	SAME(pe2, hout.num_recv_tokens_per_expert, per * 4,
	     "rows per expert with the count");
	TH_EXPECT_RC(ep_dispatch_recv_expert_counts(g, &h2, pe2, per - 1),
		     EP_EINVAL);
	TH_EXPECT_RC(ep_dispatch_recv_expert_counts(g, &h, pe2, per),
		     EP_EINVAL); /* not the latest dispatch */
	uint8_t *gx2 = POISONED(cap * H * elt);
	pin(gx2, cap * H * elt);
	rows_after(g, st, ep_recv_area(g, 1), gx2, R * H * elt);
	SAME(gx2, gx, R * H * elt, "recv_x of a rerun into area 1");
	TH_CHECK(dev_poisoned(b.recv_x, cap * H * elt),
		 "case %d rank %d: a dispatch into area 1 wrote area 0",
		 x->index, r);
	CU(tg_drv.cuMemcpyHtoDAsync(tg_dptr(b.x), in2[r].x,
				    (size_t)me->T * H * elt, st));
	if (ns)
		CU(tg_drv.cuMemcpyHtoDAsync(tg_dptr(b.x_scales), in2[r].scales,
					    (size_t)me->T * ns * 4, st));
	/* Barriers between data ops (under MPS: rung on the device, op
	 * numbers the daemon never sees). */
	TH_OK(ep_barrier_stream(g, st));
	TH_OK(ep_barrier_stream(g, st));
	/* a cached dispatch writes the handle's matrix again */
	CU(tg_drv.cuMemsetD32Async(tg_dptr(b.rank_prefix_matrix),
				   0x01010101u * POISON, W * W, st));
	TH_OK(ep_dispatch_stream(g, me->T, 0, &h, st, &hc2));
	TH_EXPECT_RC(ep_dispatch_recv_expert_counts(g, &hc2, pe2, per),
		     EP_EINVAL); /* a cached dispatch counts nothing new */
	TH_CHECK(hc2.seq == h.seq, "cached handle");
	memset(gx2, POISON, cap * H * elt);
	CU(tg_drv.cuMemcpyDtoHAsync(grp, tg_dptr(b.rank_prefix_matrix),
				    W * W * 4, st));
	recv_x_after(g, st, &b, gx2, R * H * elt);
	SAME(gx2, exp2[r].x, R * H * elt, "cached recv_x vs reference");
	SAME(grp, rp, W * W * 4, "cached rank_prefix_matrix");
	TH_OK(ep_dispatch_stream(g, me->T, 0, NULL, st, &h3));
	uint8_t *gx3 = POISONED(cap * H * elt);
	pin(gx3, cap * H * elt);
	recv_x_after(g, st, &b, gx3, R * H * elt);
	SAME(gx3, gx2, R * H * elt, "fresh vs cached dispatch");

	/* Handles live until released: 36 more fresh dispatches (half of
	 * them released at once, before the daemon ran them), so that the
	 * first handle is older than the 32 the daemon once kept. */
	TH_OK(ep_handle_release(g, &h2));
	TH_OK(ep_handle_release(g, &h3));
	ep_handle_t kept[36];
	int nkept = 0;
	for (int i = 0; i < 36; i++) {
		ep_handle_t hn;
		TH_OK(ep_dispatch_stream(g, me->T, 0, NULL, st, &hn));
		if (i % 4 == 1)
			TH_OK(ep_handle_release(g, &hn));
		else if (i % 4 == 3) /* no answer awaited */
			TH_OK(ep_handle_release_async(g, &hn));
		else
			kept[nkept++] = hn;
	}
	TH_EXPECT_RC(ep_handle_release(g, &h2), EP_ESTALE);
	/* that request's answer came after any to the releases without one:
	 * none was a refusal */
	TH_OK(ep_group_error(g));

	/* Combine of random rows (and bias) along the first handle, against
	 * the host backend and the reference. */
	uint16_t *ys[8];
	for (uint32_t d = 0; d < W; d++)
		ys[d] = ref_gen_y(c, d, exp[d].R, 7);
	/* the cases with weights sum top-k weights in the combine too */
	const bool cw = c->weights;
	float *wy[8];
	for (uint32_t d = 0; d < W; d++)
		wy[d] = ref_gen_cw(c, d, exp[d].R);
	uint16_t *hcomb = POISONED((size_t)me->T * H * 2);
	float *hcw = POISONED((size_t)me->T * K * 4);
	struct ep_combine_in hin = {.y = ys[r], .num_rows = (uint32_t)R,
				    .hidden = H,
				    .bias = c->bias ? me->bias : NULL,
				    .topk_weights = cw ? wy[r] : NULL};
	struct ep_combine_out hout2 = {.out = hcomb,
				       .combined_topk_weights = cw ? hcw : NULL};
	TH_OK(ep_combine_ex(hg, &hh, &hin, &hout2));
	uint16_t *rcomb = malloc((size_t)me->T * H * 2 + 2);
	ref_combine(c, in, exp, ys, (uint32_t)r, rcomb);
	float *rcw = malloc((size_t)me->T * K * 4 + 4);
	ref_combine_weights(c, me->T, exp, wy, (uint32_t)r, rcw);
	if (cw && R) /* pageable: the copy is done when this returns */
		CU(tg_drv.cuMemcpyHtoDAsync(tg_dptr(b.combine_topk_weights),
					    wy[r], (size_t)R * K * 4, st));
	pin(ys[r], R * H * 2);
	CU(tg_drv.cuMemcpyHtoDAsync(tg_dptr(b.combine_y), ys[r], R * H * 2, st));
	CU(tg_drv.cuMemcpyHtoDAsync(tg_dptr(b.combine_bias), me->bias,
				    (size_t)me->T * H * 2, st));
	TH_OK(ep_barrier_stream(g, st));
	TH_OK(ep_combine_stream(g, &h,
				(c->bias ? EP_COMBINE_BIAS : 0) |
					(cw ? EP_COMBINE_WEIGHTS : 0),
				st));
	uint16_t *gcomb = POISONED((size_t)c->max_tokens * H * 2);
	pin(gcomb, (size_t)c->max_tokens * H * 2);
	CU(tg_drv.cuMemcpyDtoHAsync(gcomb, tg_dptr(b.combined),
				    (size_t)c->max_tokens * H * 2, st));
	/* DeepEP's pair of biases: the second added after the first */
	CU(tg_drv.cuMemcpyHtoDAsync(tg_dptr(b.combine_bias2), in2[r].bias,
				    (size_t)me->T * H * 2, st));
	TH_OK(ep_combine_stream(g, &h,
				(c->bias ? EP_COMBINE_BIAS : 0) |
					EP_COMBINE_BIAS2,
				st));
	uint16_t *gcomb2 = POISONED((size_t)c->max_tokens * H * 2);
	pin(gcomb2, (size_t)c->max_tokens * H * 2);
	CU(tg_drv.cuMemcpyDtoHAsync(gcomb2, tg_dptr(b.combined),
				    (size_t)c->max_tokens * H * 2, st));
	uint16_t *rcomb2 = malloc((size_t)me->T * H * 2 + 2);
	ref_combine2(c, in, exp, ys, (uint32_t)r, in2[r].bias, rcomb2);
	/* DeepEP V2's order on odd ranks (EP_COMBINE_TOPK_ORDER), from the
	 * topk_idx field as it is at the combine: every third token's row
	 * reversed, token 2's naming no rank (as test_dispatch) */
	const unsigned of = r % 2 ? EP_COMBINE_TOPK_ORDER : 0;
	int64_t *tko = malloc((size_t)me->T * K * 8 + 8);
	for (uint32_t t = 0; t < me->T; t++)
		for (uint32_t k = 0; k < K; k++)
			tko[(size_t)t * K + k] =
				t % 3 == 1 ? me->topk[(size_t)t * K + K - 1 - k]
				: t == 2   ? -1
					   : me->topk[(size_t)t * K + k];
	pin(tko, (size_t)me->T * K * 8);
	CU(tg_drv.cuMemcpyHtoDAsync(tg_dptr(b.topk_idx), tko,
				    (size_t)me->T * K * 8, st));
	TH_OK(ep_combine_stream(g, &h,
				(c->bias ? EP_COMBINE_BIAS : 0) |
					EP_COMBINE_BIAS2 | of,
				st));
	uint16_t *gcomb3 = POISONED((size_t)c->max_tokens * H * 2);
	pin(gcomb3, (size_t)c->max_tokens * H * 2);
	CU(tg_drv.cuMemcpyDtoHAsync(gcomb3, tg_dptr(b.combined),
				    (size_t)c->max_tokens * H * 2, st));
	/* the dispatch's rows back, for the dispatch below */
	CU(tg_drv.cuMemcpyHtoDAsync(tg_dptr(b.topk_idx), me->topk,
				    (size_t)me->T * K * 8, st));
	uint16_t *rcomb3 = malloc((size_t)me->T * H * 2 + 2);
	ref_combine_topk(c, in, exp, ys, (uint32_t)r, in2[r].bias,
			 of ? tko : NULL, rcomb3);

	/* Released right after the combine was enqueued: a later dispatch
	 * may take its tables, after the combine in stream order. */
	TH_OK(ep_handle_release(g, &h));
	for (int i = 0; i < nkept; i++)
		TH_OK(ep_handle_release(g, &kept[i]));
	ep_handle_t h4;
	TH_OK(ep_dispatch_stream(g, me->T, 0, NULL, st, &h4));
	TH_OK(ep_handle_release(g, &h4));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_group_sync(g));
	SAME(gcomb, hcomb, (size_t)me->T * H * 2, "combined vs host backend");
	SAME(gcomb, rcomb, (size_t)me->T * H * 2, "combined vs reference");
	SAME(gcomb2, rcomb2, (size_t)me->T * H * 2,
	     "combined with two biases vs reference");
	SAME(gcomb3, rcomb3, (size_t)me->T * H * 2,
	     of ? "combined in top-k order vs reference"
		: "combined beside one in top-k order vs reference");
	float *gcw = POISONED((size_t)me->T * K * 4);
	if (cw && me->T) /* no later op wrote them */
		CU(tg_drv.cuMemcpyDtoH(gcw, tg_dptr(b.combined_topk_weights),
				       (size_t)me->T * K * 4));
	if (cw) {
		SAME(hcw, rcw, (size_t)me->T * K * 4,
		     "combined_topk_weights, host backend vs reference");
		SAME(gcw, hcw, (size_t)me->T * K * 4,
		     "combined_topk_weights vs host backend");
	}
	TH_CHECK(ALL_POISON((uint8_t *)gcomb + (size_t)me->T * H * 2,
			    (size_t)(c->max_tokens - me->T) * H * 2),
		 "combined written past the tokens");

	TH_OK(ep_group_sync(g));
	if (x->bad_rank >= 0) {
		/* A pipeline that goes on past a bad expert index: a cached
		 * dispatch and a combine that name the refused dispatch's
		 * handle each fail alone (EP_ESTALE, saying why), and change
		 * nothing; its tables are not a routing. The group goes on. */
		upload_topk(&b, me->topk, (uint64_t)me->T * K,
			    r == x->bad_rank ? 0 : UINT64_MAX, -2);
		char want[64];
		snprintf(want, sizeof(want), "at rank %d, token 0, k 0",
			 x->bad_rank);
		ep_handle_t hx, hy;
		TH_OK(ep_dispatch_stream(g, me->T, 0, NULL, st, &hx));
		CU(tg_drv.cuMemsetD32Async(tg_dptr(b.recv_x),
					   0x01010101u * POISON,
					   cap * H * elt / 4, st));
		CU(tg_drv.cuMemsetD32Async(ep_dispatch_recv_count_device(g),
					   0x5a5a5a5au, 1, st));
		TH_OK(ep_dispatch_stream(g, me->T, 0, &hx, st, &hy));
		refused_for(g, st, want, "a cached dispatch");
		unchanged(g, &b, cap * H * elt);
		CU(tg_drv.cuMemsetD32Async(tg_dptr(b.combined),
					   0x01010101u * POISON,
					   (size_t)c->max_tokens * H / 2, st));
		TH_OK(ep_combine_stream(g, &hx, 0, st));
		refused_for(g, st, want, "a combine");
		TH_CHECK(dev_poisoned(b.combined,
				      (size_t)c->max_tokens * H * 2),
			 "rank %d: a combine of a failed dispatch wrote its "
			 "output", r);
		TH_OK(ep_group_error(g)); /* each told once; the group goes on */
		TH_OK(ep_handle_release(g, &hx));
		tg_upload(tg_dptr(b.topk_idx), me->topk, (size_t)me->T * K * 8);
		ep_handle_t hz;
		TH_OK(ep_dispatch_stream(g, me->T, 0, NULL, st, &hz));
		uint8_t *gx4 = POISONED(cap * H * elt);
		pin(gx4, cap * H * elt);
		recv_x_after(g, st, &b, gx4, R * H * elt);
		SAME(gx4, exp2[r].x, R * H * elt,
		     "recv_x of a dispatch after the refusals");
		TH_OK(ep_handle_release(g, &hz));
	}
	TH_OK(ep_barrier(g)); /* nobody leaves while others work */
	TH_OK(ep_leave(g));
	TH_OK(ep_leave(hg));
	ep_close(gc);
	ep_close(hc);
	return 0;
}

/* A rank killed, or stalled, while the others' dispatch waits for it. */
struct fail {
	const struct th_daemon *gpu;
	int victim, kill;
	volatile int entered, release;
	int code[4];
	char msg[4][256];
};

static int fail_rank(int r, void *arg)
{
	struct fail *f = arg;
	int gpu;
	CUstream st = tg_rank_init(r, &gpu, NULL, 0, NULL);
	struct ep_group_config cfg = {
		.name = f->kill ? "gkilled" : "gstalled", .world_size = 4,
		.ranks_per_node = 4, .rank = (uint32_t)r, .num_experts = 16,
		.hidden = 1024, .max_tokens_per_rank = 256, .topk = 4,
		.dtype = EP_DTYPE_BF16, .timeout_ms = 2000, .cuda_device = gpu};
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(f->gpu->sock, &c));
	TH_OK(ep_join(c, &cfg, EP_JOIN_CUDA, &g));
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	int64_t idx[256 * 4];
	for (int i = 0; i < 256 * 4; i++)
		idx[i] = (i * 5 + r) % 16;
	tg_upload(tg_dptr(b.topk_idx), idx, sizeof(idx));
	ep_handle_t h;
	TH_OK(ep_dispatch_stream(g, 256, 0, NULL, st, &h));
	TH_OK(ep_group_sync(g));
	if (r == f->victim) {
		/* killed here, or alive but never dispatching again */
		while (!f->release)
			th_sleep_ms(5);
		return 0;
	}
	__atomic_fetch_add(&f->entered, 1, __ATOMIC_SEQ_CST);
	uint64_t t0 = th_now_ns();
	TH_OK(ep_dispatch_stream(g, 256, 0, NULL, st, &h));
	f->code[r] = ep_group_sync(g);
	snprintf(f->msg[r], sizeof(f->msg[r]), "%s", ep_errmsg());
	CU(tg_drv.cuStreamSynchronize(st)); /* released */
	TH_CHECK(th_now_ns() - t0 < 10000000000ull, "took too long");
	TH_EXPECT_RC(ep_combine_stream(g, &h, 0, st), f->code[r]);
	ep_leave(g);
	ep_close(c);
	return 0;
}

static void check_fail(const struct th_daemon *gpu, bool kill_it)
{
	struct fail *f = th_shared(sizeof(*f));
	f->gpu = gpu;
	f->victim = 2;
	f->kill = kill_it;
	pid_t pids[4];
	th_spawn(pids, 4, fail_rank, f);
	while (f->entered < 3)
		th_sleep_ms(2);
	th_sleep_ms(200);
	if (kill_it)
		kill(pids[2], SIGKILL);
	int bad = 0;
	for (int i = 0; i < 4; i++)
		if (i != 2)
			bad += th_wait_all(&pids[i], 1, 30);
	f->release = 1;
	th_reap(pids[2], 30);
	TH_CHECK(bad == 0, "a rank failed");
	int want = kill_it ? EP_EPEERLOST : EP_ETIMEDOUT;
	for (int r = 0; r < 4; r++)
		if (r != 2) {
			TH_EXPECT_RC(f->code[r], want);
			TH_CHECK(strstr(f->msg[r], "2"), "message: %s",
				 f->msg[r]);
		}
	printf("ok: a rank %s mid-dispatch -> %s: %s\n",
	       kill_it ? "killed" : "stalled", ep_strerror(want), f->msg[0]);
}

/* recv_rows on the GPU: 4 ranks, at most 100 rows a rank. Every token
 * to rank 0 (4 x 64 rows) fails on every rank at once with EP_ETOOBIG
 * naming the rank and rows, writing neither rows nor the device count;
 * a dispatch within the capacity then gives the host backend's rows. */
struct rcap {
	const struct th_daemon *gpu, *host;
	int pass;
};

static int recvcap_rank(int r, void *arg)
{
	const struct rcap *rc = arg;
	enum { T = 64, KK = 4, EE = 16, HH = 1024, CAP = 100 };
	int gpu;
	CUstream st = tg_rank_init(r, &gpu, NULL, 0, NULL);
	char name[32];
	snprintf(name, sizeof(name), "grecv%d", rc->pass);
	struct ep_group_config cfg = {
		.name = name, .world_size = 4, .ranks_per_node = 4,
		.rank = (uint32_t)r, .num_experts = EE, .hidden = HH,
		.max_tokens_per_rank = T, .topk = KK, .dtype = EP_DTYPE_BF16,
		.timeout_ms = 10000, .cuda_device = gpu};
	const struct ep_join_opts o = {.size = sizeof(o), .recv_rows = CAP};
	ep_conn_t *c, *hc;
	ep_group_t *g, *hg;
	TH_OK(ep_connect(rc->gpu->sock, &c));
	TH_OK(ep_join_ex(c, &cfg, &o, EP_JOIN_CUDA, &g));
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	TH_CHECK(b.max_recv == CAP, "max_recv %llu",
		 (unsigned long long)b.max_recv);
	static uint16_t x[T * HH];
	static int64_t topk[T * KK];
	for (uint32_t i = 0; i < T * HH; i++)
		x[i] = (uint16_t)(0x3c00 + (i * 7 + (uint32_t)r) % 0x400);
	for (uint32_t i = 0; i < T * KK; i++)
		topk[i] = i % KK ? -1 : 1; /* expert 1: rank 0 */
	tg_upload(tg_dptr(b.x), x, sizeof(x));
	tg_upload(tg_dptr(b.topk_idx), topk, sizeof(topk));
	CU(tg_drv.cuMemsetD8(tg_dptr(b.recv_x), POISON, (size_t)CAP * HH * 2));
	CU(tg_drv.cuMemsetD32(ep_dispatch_recv_count_device(g), 0x5a5a5a5au,
			      1));
	ep_handle_t h;
	TH_OK(ep_dispatch_stream(g, T, 0, NULL, st, &h));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_EXPECT_RC(ep_group_sync(g), EP_ETOOBIG);
	TH_CHECK(strstr(ep_errmsg(), "rank 0 would receive 256 rows, above "
				     "the group's receive capacity of 100"),
		 "rank %d: %s", r, ep_errmsg());
	unchanged(g, &b, (size_t)CAP * HH * 2);
	/* within it: token t to expert t % 16 (16 rows a rank) */
	for (uint32_t i = 0; i < T * KK; i++)
		topk[i] = i % KK ? -1 : (int64_t)((i / KK) % EE);
	tg_upload(tg_dptr(b.topk_idx), topk, sizeof(topk));
	TH_OK(ep_dispatch_stream(g, T, 0, NULL, st, &h));
	static uint16_t got[CAP * HH];
	recv_x_after(g, st, &b, got, sizeof(got));
	TH_OK(ep_dispatch_recv_count(g, &h));
	const uint32_t n = h.num_recv;
	TH_CHECK(n == 64, "rank %d received %u rows", r, n);
	/* the host backend's rows for the same inputs */
	cfg.cuda_device = 0;
	TH_OK(ep_connect(rc->host->sock, &hc));
	TH_OK(ep_join_ex(hc, &cfg, &o, 0, &hg));
	static uint16_t want[CAP * HH];
	struct ep_dispatch_in din = {.num_tokens = T, .hidden = HH,
				     .dtype = EP_DTYPE_BF16, .topk = KK,
				     .x = x, .topk_idx = topk};
	struct ep_dispatch_out dout = {.capacity = CAP, .recv_x = want};
	ep_handle_t hh;
	TH_OK(ep_dispatch(hg, &din, NULL, &dout, &hh));
	TH_CHECK(dout.num_recv == n &&
			 !memcmp(got, want, (size_t)n * HH * 2),
		 "rank %d: rows differ from the host backend's", r);
	TH_OK(ep_combine_stream(g, &h, 0, st));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_group_sync(g));
	ep_leave(hg);
	ep_close(hc);
	ep_leave(g);
	ep_close(c);
	return 0;
}

static void check_recvcap(const struct th_daemon *gpu,
			  const struct th_daemon *host, int pass,
			  const char *how)
{
	struct rcap *rc = th_shared(sizeof(*rc));
	*rc = (struct rcap){.gpu = gpu, .host = host, .pass = pass};
	pid_t pids[4];
	th_spawn(pids, 4, recvcap_rank, rc);
	TH_CHECK(th_wait_all(pids, 4, 60) == 0, "the receive capacity case");
	printf("ok: recv_rows 100 (%s): 256 rows for rank 0 -> EP_ETOOBIG "
	       "on every rank, nothing written; 64 rows each -> the host "
	       "backend's rows\n",
	       how);
}

static uint64_t rs; /* the random series */

static void run_case(struct ctx *x)
{
	pid_t pids[8];
	memset((void *)x->gate, 0, sizeof(x->gate));
	th_spawn(pids, (int)x->c.world, case_rank, x);
	TH_CHECK(th_wait_all(pids, (int)x->c.world, 120) == 0,
		 "case %d failed (seed %llu)", x->index,
		 (unsigned long long)x->c.seed);
	printf("ok: case %d: world %u E %u H %u K %u T_max %u %s mode %d%s%s%s%s "
	       "-- GPU == host backend == reference\n",
	       x->index, x->c.world, x->c.experts, x->c.hidden, x->c.topk,
	       x->c.max_tokens, x->c.dtype == EP_DTYPE_FP8 ? "fp8" : "bf16",
	       x->c.mode, x->c.weights ? " weights" : "",
	       x->c.bias ? " bias" : "",
	       x->big_rank >= 0 ? " (after a rank asked for too many tokens: "
				  "EP_ETOOBIG on every rank)" : "",
	       x->bad_rank >= 0 ? " (a bad expert index: EP_EEXPERT; then a "
				  "cached dispatch and a combine of its "
				  "handle: EP_ESTALE each, nothing written)"
				: "");
}

int main(void)
{
	th_init("gpu: dispatch/combine, bitwise against the host backend", 500);
	if (tg_probe())
		return TH_SKIP;
	uint64_t seed = th_seed();
	int ncases = getenv("EPD_TEST_CASES") ? atoi(getenv("EPD_TEST_CASES"))
					      : 12;
	rs = seed;
	struct th_daemon gpu, host;
	th_daemon_start(&gpu, "--backend", "cuda", NULL);
	th_daemon_start(&host, "--backend", "host", NULL);
	struct ctx *x = th_shared(sizeof(*x));
	x->gpu = &gpu;
	x->host = &host;
	x->bad_rank = -1;
	x->big_rank = -1;
	/* the shared corners, then the DeepSeek-V3 shape with uneven T */
	struct ref_case fixed[REF_CORNERS + 1];
	memcpy(fixed, ref_corners, sizeof(ref_corners));
	fixed[REF_CORNERS] = (struct ref_case){
		.world = 8, .experts = 256, .hidden = 7168, .topk = 8,
		.max_tokens = 300, .tokens = {300, 299, 257, 256, 255, 1, 0, 300},
		.dtype = EP_DTYPE_BF16, .weights = true};
	int n = 0;
	for (size_t i = 0; i < sizeof(fixed) / sizeof(fixed[0]); i++, n++) {
		x->c = fixed[i];
		x->c.seed = seed + (uint64_t)i;
		x->index = n;
		x->bad_rank = i == 0 ? 2 : -1; /* and a bad expert first */
		/* too many tokens first; in case 0 after the bad index, which
		 * is still in rank 2's buffer: too many tokens wins */
		x->big_rank = i <= 1 ? 3 : -1;
		run_case(x);
	}
	check_recvcap(&gpu, &host, 0, "the fused prep");
	/* the same cases with the SIMT row copy (the bulk-copy kernel is the
	 * default where rows fit; the SIMT one runs below 32 SMs) */
	th_daemon_stop(&gpu);
	th_daemon_start(&gpu, "--backend", "cuda", "-o", "cuda_tma=no", "-o",
			"cuda_fused_prep=no", "-o", "cuda_combine_fetch=yes",
			NULL);
	for (size_t i = 0; i < sizeof(fixed) / sizeof(fixed[0]); i++, n++) {
		x->c = fixed[i];
		x->c.seed = seed + 100 + (uint64_t)i;
		x->index = n;
		x->bad_rank = -1;
		x->big_rank = i == 0 ? 1 : -1; /* the three launches' path */
		run_case(x);
	}
	check_recvcap(&gpu, &host, 1, "three prep launches");
	printf("ok: the fixed cases with the SIMT row copy, three prep "
	       "launches and the combine's L2 fetch (cuda_tma=no, "
	       "cuda_fused_prep=no, cuda_combine_fetch=yes)\n");
	th_daemon_stop(&gpu);
	/* and with the lean combine (rows by count, each lane's prefetch),
	 * the kernels launched one after the other (the other passes: with
	 * programmatic dependent launch) */
	th_daemon_start(&gpu, "--backend", "cuda", "-o",
			"cuda_combine_fetch=lean", "-o", "cuda_pdl=no", NULL);
	for (size_t i = 0; i < sizeof(fixed) / sizeof(fixed[0]); i++, n++) {
		x->c = fixed[i];
		x->c.seed = seed + 200 + (uint64_t)i;
		x->index = n;
		x->big_rank = i == 0 ? 2 : -1;
		run_case(x);
	}
	printf("ok: the fixed cases with the lean combine, no programmatic "
	       "dependent launch (cuda_combine_fetch=lean, cuda_pdl=no)\n");
	th_daemon_stop(&gpu);
	th_daemon_start(&gpu, "--backend", "cuda", NULL);
	x->bad_rank = -1;
	x->big_rank = -1;
	for (int i = 0; i < ncases; i++, n++) {
		struct ref_case *c = &x->c;
		ref_random_case(c, &rs, seed, i, 600);
		x->index = n;
		run_case(x);
	}
	check_fail(&gpu, true);
	check_fail(&gpu, false);
	/* the daemon still serves: one more case */
	x->c = fixed[1];
	x->index = n++;
	run_case(x);
	th_daemon_stop(&gpu);
	th_daemon_stop(&host);
	printf("ok: %d cases, CUDA backend bitwise equal to the host backend "
	       "and the reference\n",
	       n);
	return 0;
}
