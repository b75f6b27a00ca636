/* SPDX-License-Identifier: MIT */
/*
 * Bad input to dispatch and combine: each gets its precise error, changes
 * nothing, and the group (or at worst the daemon) goes on serving.
 */
#include "harness.h"
#include "epp.h"

#include <dlfcn.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define W 4
#define H 256
#define K 4
#define E 16
#define TMAX 32

struct shared {
	const struct th_daemon *d;
	volatile int phase[W];
	volatile int entered;
	int code[W];
	char msg[W][256];
};

static struct ep_group_config cfg_of(const char *name, int r)
{
	struct ep_group_config c = {
		.name = name, .world_size = W, .ranks_per_node = W,
		.rank = (uint32_t)r, .num_experts = E, .hidden = H,
		.max_tokens_per_rank = TMAX, .topk = K,
		.dtype = EP_DTYPE_BF16, .timeout_ms = 5000};
	return c;
}

static void fill(ep_group_t *g, int r, uint32_t T)
{
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	uint16_t *x = b.x;
	for (uint32_t i = 0; i < T * H; i++)
		x[i] = (uint16_t)(0x3f80 + ((i + (uint32_t)r) & 0x3f));
	for (uint32_t i = 0; i < T * K; i++)
		b.topk_idx[i] = (int64_t)((i * 7 + (uint32_t)r) % E);
}

/* Everyone dispatches; rank 1 asks for more tokens than the group's
 * maximum (copy path, then in place): every rank
 * gets EP_ETOOBIG naming it as soon as all entered, and the group goes
 * on. */
static int toobig_rank(int r, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = cfg_of("toobig", r);
	ep_group_t *g = th_join(s->d, &cfg, &c);
	fill(g, r, 4);
	ep_handle_t h, hh;
	TH_OK(ep_dispatch_inplace(g, 4, 0, NULL, &h));
	uint64_t t0 = th_now_ns();
	uint16_t x[4 * H];
	int64_t idx[4 * K] = {0};
	struct ep_dispatch_out out = {.capacity = 0};
	struct ep_dispatch_in in = {.num_tokens = r == 1 ? TMAX + 1 : 4,
				    .hidden = H, .dtype = EP_DTYPE_BF16,
				    .topk = K, .x = x, .topk_idx = idx};
	memset(x, 0, sizeof(x));
	TH_EXPECT_RC(ep_dispatch(g, &in, NULL, &out, &hh), EP_ETOOBIG);
	TH_CHECK(strstr(ep_errmsg(), "rank 1 dispatched") &&
			 strstr(ep_errmsg(), "maximum"),
		 "message: %s", ep_errmsg());
	snprintf(s->msg[r], sizeof(s->msg[r]), "%s", ep_errmsg());
	TH_EXPECT_RC(ep_dispatch_inplace(g, r == 1 ? TMAX + 1 : 4, 0, NULL,
					 &hh),
		     EP_ETOOBIG);
	/* long before the 5 s timeout */
	TH_CHECK(th_now_ns() - t0 < 2000000000ull * th_scale(),
		 "took %llu ms",
		 (unsigned long long)((th_now_ns() - t0) / 1000000));
	/* nothing changed: the handle still combines, a dispatch runs */
	TH_OK(ep_combine_inplace(g, &h, 0));
	fill(g, r, 4);
	TH_OK(ep_dispatch_inplace(g, 4, 0, NULL, &hh));
	TH_OK(ep_combine_inplace(g, &hh, 0));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

/* A group that receives at most RECV rows a rank (recv_rows): its
 * receive fields hold RECV rows; a dispatch that would give a rank more
 * fails on every rank at once with EP_ETOOBIG naming the rank and the
 * rows, changes nothing, and the group goes on; one within it gives what
 * the same dispatch gives in a group of the worst-case capacity. */
#define RECV 40
static int recvcap_rank(int r, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	ep_group_t *g, *gw;
	struct ep_group_config cfg = cfg_of("recvcap", r), cw = cfg;
	cw.name = "recvworst";
	TH_OK(ep_connect(s->d->sock, &c));
	const struct ep_join_opts o = {.size = sizeof(o), .recv_rows = RECV};
	TH_OK(ep_join_ex(c, &cfg, &o, 0, &g));
	TH_OK(ep_join(c, &cw, 0, &gw));
	struct ep_buffers b, bw;
	TH_OK(ep_get_buffers(g, &b));
	TH_OK(ep_get_buffers(gw, &bw));
	TH_CHECK(b.max_recv == RECV && bw.max_recv == (uint64_t)W * TMAX,
		 "max_recv %llu and %llu",
		 (unsigned long long)b.max_recv,
		 (unsigned long long)bw.max_recv);
	/* every token of every rank to expert 0 (rank 0): W x 16 rows */
	const uint32_t T = 16;
	fill(g, r, T);
	for (uint32_t i = 0; i < T * K; i++)
		b.topk_idx[i] = i % K ? -1 : 0;
	memset((void *)b.recv_x, 0x5a, (size_t)RECV * H * 2);
	ep_handle_t h;
	uint64_t t0 = th_now_ns();
	TH_EXPECT_RC(ep_dispatch_inplace(g, T, 0, NULL, &h), EP_ETOOBIG);
	char want[128];
	snprintf(want, sizeof(want),
		 "rank 0 would receive %u rows, above the group's receive "
		 "capacity of %u rows",
		 W * T, RECV);
	TH_CHECK(strstr(ep_errmsg(), want), "message: %s", ep_errmsg());
	TH_CHECK(th_now_ns() - t0 < 2000000000ull * th_scale(),
		 "it took the timeout");
	TH_CHECK(th_all_is(b.recv_x, (size_t)RECV * H * 2, 0x5a),
		 "the refused dispatch wrote rows");
	/* within the capacity (8 tokens a rank: at most W x 8 = 32 rows
	 * for any rank): as in the worst-case group, bitwise */
	const uint32_t T2 = 8;
	fill(g, r, T2);
	fill(gw, r, T2);
	TH_OK(ep_dispatch_inplace(g, T2, 0, NULL, &h));
	ep_handle_t hw;
	TH_OK(ep_dispatch_inplace(gw, T2, 0, NULL, &hw));
	TH_CHECK(h.num_recv == hw.num_recv && h.num_recv <= RECV,
		 "%u rows, %u in the worst-case group", h.num_recv,
		 hw.num_recv);
	TH_CHECK(!memcmp(b.recv_x, bw.recv_x, (size_t)h.num_recv * H * 2),
		 "rows differ from the worst-case group's");
	/* the experts return their rows, scaled by the rank */
	for (size_t i = 0; i < (size_t)h.num_recv * H; i++)
		b.combine_y[i] = bw.combine_y[i] =
			(uint16_t)(((const uint16_t *)b.recv_x)[i] + r);
	TH_OK(ep_combine_inplace(g, &h, 0));
	TH_OK(ep_combine_inplace(gw, &hw, 0));
	TH_CHECK(!th_all_is(b.combined, (size_t)T2 * H * 2, 0),
		 "nothing combined");
	TH_CHECK(!memcmp(b.combined, bw.combined, (size_t)T2 * H * 2),
		 "combined rows differ from the worst-case group's");
	if (r == 0)
		snprintf(s->msg[0], sizeof(s->msg[0]), "%s", want);
	TH_OK(ep_leave(g));
	TH_OK(ep_leave(gw));
	ep_close(c);
	return 0;
}

/* Rank 3's combine names a handle of no dispatch (refused, EP_ESTALE for
 * it alone) and it then stops; the others' combine times out naming rank
 * 3 and why it never came. */
static int refused_rank(int r, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = cfg_of("refused", r);
	cfg.timeout_ms = 800;
	ep_group_t *g = th_join(s->d, &cfg, &c);
	ep_handle_t h;
	fill(g, r, 4);
	TH_OK(ep_dispatch_inplace(g, 4, 0, NULL, &h));
	if (r == 3) {
		ep_handle_t bad = h;
		bad.seq += 100;
		TH_EXPECT_RC(ep_combine_inplace(g, &bad, 0), EP_ESTALE);
		while (!s->entered) /* the others' timeout */
			th_sleep_ms(10);
	} else {
		TH_EXPECT_RC(ep_combine_inplace(g, &h, 0), EP_ETIMEDOUT);
		TH_CHECK(strstr(ep_errmsg(), "3 (its last combine was refused"),
			 "rank %d: %s", r, ep_errmsg());
		snprintf(s->msg[r], sizeof(s->msg[r]), "%s", ep_errmsg());
		s->entered = 1;
	}
	ep_close(c);
	return 0;
}

/* Everyone dispatches; rank 2 names an expert out of range. */
static int bad_expert_rank(int r, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = cfg_of("bad", r);
	ep_group_t *g = th_join(s->d, &cfg, &c);
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	ep_handle_t h, h0;
	fill(g, r, 8);
	TH_OK(ep_dispatch_inplace(g, 8, 0, NULL, &h0));
	/* Poison what this rank received, then a bad dispatch. */
	memset((void *)b.recv_x, 0x5a, h0.num_recv * H * 2);
	if (r == 2)
		b.topk_idx[5 * K + 1] = E; /* token 5, k 1 */
	int rc = ep_dispatch_inplace(g, 8, 0, NULL, &h);
	TH_EXPECT_RC(rc, EP_EEXPERT);
	TH_CHECK(strstr(ep_errmsg(), "rank 2: expert index 16 at token 5, k 1"),
		 "message: %s", ep_errmsg());
	/* Nothing changed. */
	const uint8_t *rx = b.recv_x;
	for (size_t i = 0; i < (size_t)h0.num_recv * H * 2; i++)
		TH_CHECK(rx[i] == 0x5a, "a failed dispatch wrote its output");
	/* -2 is as wrong as E. */
	if (r == 2)
		b.topk_idx[5 * K + 1] = -2;
	TH_EXPECT_RC(ep_dispatch_inplace(g, 8, 0, NULL, &h), EP_EEXPERT);
	/* The group still works, and handle h0 still combines. */
	if (r == 2)
		b.topk_idx[5 * K + 1] = 3;
	TH_OK(ep_dispatch_inplace(g, 8, 0, NULL, &h));
	TH_CHECK(h.seq == h0.seq + 1, "failed dispatches took handles");
	TH_OK(ep_combine_inplace(g, &h0, 0));
	TH_OK(ep_barrier(g));
	if (r == 0)
		printf("ok: bad expert index -> every rank: %s\n",
		       ep_errmsg()[0] ? ep_errmsg() : "EP_EEXPERT");
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

/* Per-rank argument errors: that rank alone, before it enters. */
static int arg_rank(int r, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = cfg_of("args", r);
	ep_group_t *g = th_join(s->d, &cfg, &c);
	ep_handle_t h;
	fill(g, r, 4);
	TH_OK(ep_dispatch_inplace(g, 4, 0, NULL, &h));
	if (r == 1) {
		uint16_t x[H];
		int64_t idx[K] = {0, 1, 2, 3};
		struct ep_dispatch_out out = {.capacity = 0};
		struct ep_dispatch_in in = {.num_tokens = 1, .hidden = H,
					    .dtype = EP_DTYPE_BF16, .topk = K,
					    .x = x, .topk_idx = idx};
		ep_handle_t hh;
		in.num_tokens = 1;
		in.hidden = H + 128;
		TH_EXPECT_RC(ep_dispatch(g, &in, NULL, &out, &hh), EP_ESHAPE);
		in.hidden = H;
		in.dtype = EP_DTYPE_FP8;
		TH_EXPECT_RC(ep_dispatch(g, &in, NULL, &out, &hh), EP_ESHAPE);
		in.dtype = EP_DTYPE_BF16;
		in.topk = 33;
		TH_EXPECT_RC(ep_dispatch(g, &in, NULL, &out, &hh), EP_EINVAL);
		in.topk = 0;
		TH_EXPECT_RC(ep_dispatch(g, &in, NULL, &out, &hh), EP_EINVAL);
		in.topk = K - 1;
		TH_EXPECT_RC(ep_dispatch(g, &in, NULL, &out, &hh), EP_ESHAPE);
		/* a handle of another group or epoch */
		ep_handle_t bad = h;
		bad.group_id += 100;
		TH_EXPECT_RC(ep_combine_inplace(g, &bad, 0), EP_ESTALE);
		bad = h;
		bad.epoch ^= 1;
		TH_EXPECT_RC(ep_dispatch_inplace(g, 4, 0, &bad, &hh),
			     EP_ESTALE);
		/* combine with the wrong row count */
		uint16_t y[4], o[4 * H];
		TH_EXPECT_RC(ep_combine(g, &h, y, h.num_recv + 1, H, NULL, o),
			     EP_ESHAPE);
		/* stream-ordered calls on a host group: refused, and no
		 * device count */
		TH_EXPECT_RC(ep_dispatch_stream(g, 4, 0, NULL, NULL, &hh),
			     EP_EUNSUPPORTED);
		TH_CHECK(ep_dispatch_recv_count_device(g) == 0 &&
				 ep_dispatch_recv_count_device(NULL) == 0,
			 "a host group has a device count");
		/* the stream copies: bad arguments refused before any CUDA
		 * call; good ones need a CUDA context on this thread (none:
		 * no driver here, or none made) */
		uint32_t w4[4];
		struct ep_copy cp = {.dst = w4, .src = w4 + 2, .count = 1,
				     .elt = 3};
		TH_EXPECT_RC(ep_stream_copies(&cp, 1, NULL), EP_EINVAL);
		TH_EXPECT_RC(ep_stream_copies(&cp, 0, NULL), EP_EINVAL);
		TH_EXPECT_RC(ep_stream_copies(NULL, 1, NULL), EP_EINVAL);
		cp.elt = 4;
		cp.src = (const uint8_t *)w4 + 2;
		TH_EXPECT_RC(ep_stream_copies(&cp, 1, NULL), EP_EINVAL);
		cp.elt = 2;
		TH_EXPECT_RC(ep_stream_copies(&cp, 1, NULL), EP_EUNSUPPORTED);
		cp.count = 0; /* nothing to copy: nothing launched */
		TH_OK(ep_stream_copies(&cp, 1, NULL));
		printf("ok: wrong hidden/dtype/topk, foreign handle, stream "
		       "calls on a host group: errors for that rank alone\n");
	}
	/* Nobody entered a collective: the group goes on. */
	TH_OK(ep_barrier(g));
	/* 33 dispatches later the first handle still works (nothing is
	 * evicted); once this rank released it, it is refused. */
	ep_handle_t first = h;
	for (int i = 0; i < 33; i++)
		TH_OK(ep_dispatch_inplace(g, 4, 0, NULL, &h));
	TH_OK(ep_combine_inplace(g, &first, 0));
	TH_OK(ep_handle_release(g, &first));
	TH_EXPECT_RC(ep_combine_inplace(g, &first, 0), EP_ESTALE);
	TH_CHECK(strstr(ep_errmsg(), "released"), "message: %s", ep_errmsg());
	if (r == 0)
		printf("ok: a handle 33 dispatches old still combines; "
		       "released -> %s\n",
		       ep_errmsg());
	TH_OK(ep_combine_inplace(g, &h, 0));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

/* Receive areas (EP_JOIN_RECV_AREAS): each rank names the area its rows go
 * to, the others keep what earlier dispatches left there, the rows equal
 * area 0's of the same dispatch; a cached dispatch too; an area past the
 * group's is refused for that rank alone; a join with another number of
 * areas is refused. */
#define AREAS 3
static int areas_rank(int r, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = cfg_of("areas", r);
	ep_group_t *g;
	TH_OK(ep_connect(s->d->sock, &c));
	TH_OK(ep_join(c, &cfg, EP_JOIN_RECV_AREAS(AREAS), &g));
	TH_CHECK(ep_group_recv_areas(g) == AREAS, "areas: %u",
		 ep_group_recv_areas(g));
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	const size_t row = H * 2, area = b.max_recv * row;
	const uint8_t *a[AREAS];
	for (uint32_t i = 0; i < AREAS; i++) {
		a[i] = ep_recv_area(g, i);
		TH_CHECK(a[i] == (const uint8_t *)b.recv_x + i * area,
			 "area %u's address", i);
	}
	TH_CHECK(!ep_recv_area(g, AREAS), "an area past the group's");
	/* dispatch 1 into area 0 (the reference rows), then the same
	 * routing of other rows into this rank's area 1 + r % 2 */
	fill(g, r, 8);
	ep_handle_t h0, h1, hc;
	TH_OK(ep_dispatch_inplace(g, 8, 0, NULL, &h0));
	uint8_t *ref = malloc(h0.num_recv * row);
	memcpy(ref, a[0], h0.num_recv * row);
	uint32_t mine = 1 + (uint32_t)r % 2;
	memset((void *)a[mine], 0xee, area); /* the rank's own area */
	uint16_t *x = b.x;
	for (uint32_t i = 0; i < 8 * H; i++)
		x[i] ^= 0x0101; /* other rows, the same routing */
	TH_OK(ep_dispatch_inplace(g, 8, EP_DISPATCH_AREA(mine), NULL, &h1));
	TH_CHECK(h1.num_recv == h0.num_recv, "rows %u vs %u", h1.num_recv,
		 h0.num_recv);
	TH_CHECK(!memcmp(a[0], ref, h0.num_recv * row),
		 "area 0 changed by a dispatch into area %u", mine);
	for (size_t i = 0; i < h0.num_recv * row; i += 2) {
		uint16_t v, w;
		memcpy(&v, a[mine] + i, 2);
		memcpy(&w, ref + i, 2);
		TH_CHECK(v == (uint16_t)(w ^ 0x0101),
			 "area %u row %zu: %04x, expected %04x", mine,
			 i / row, v, w ^ 0x0101);
	}
	TH_CHECK(a[mine][h0.num_recv * row] == 0xee,
		 "area %u written past its rows", mine);
	/* a cached dispatch of the first rows into the other area */
	uint32_t other = 3 - mine;
	for (uint32_t i = 0; i < 8 * H; i++)
		x[i] ^= 0x0101;
	TH_OK(ep_dispatch_inplace(g, 8, EP_DISPATCH_AREA(other), &h0, &hc));
	TH_CHECK(!memcmp(a[other], ref, h0.num_recv * row),
		 "cached dispatch into area %u", other);
	/* area `mine` kept dispatch 2's rows */
	uint16_t v0, w0;
	memcpy(&v0, a[mine], 2);
	memcpy(&w0, ref, 2);
	TH_CHECK(!h0.num_recv || v0 == (uint16_t)(w0 ^ 0x0101),
		 "area %u overwritten", mine);
	/* combine reads combine_y, whatever the areas */
	TH_OK(ep_combine_inplace(g, &h1, 0));
	/* a bad area: refused by libep, and by the daemon (rank 1 alone,
	 * raw request in raw_checks) */
	ep_handle_t hh;
	TH_EXPECT_RC(ep_dispatch_inplace(g, 8, EP_DISPATCH_AREA(AREAS), NULL,
					 &hh),
		     EP_EINVAL);
	TH_CHECK(strstr(ep_errmsg(), "receive area 3"), "message: %s",
		 ep_errmsg());
	TH_OK(ep_barrier(g));
	free(ref);
	TH_OK(ep_handle_release(g, &h0));
	TH_OK(ep_handle_release(g, &h1));
	TH_CHECK(hc.seq == h0.seq, "a cached dispatch's handle"); /* released */
	if (r == 0) {
		char *js;
		TH_OK(ep_daemon_status(c, &js));
		TH_CHECK(strstr(js, "\"recv_areas\":3"), "status: %s", js);
		free(js);
		/* joining with another number of areas, or too many */
		ep_conn_t *c1;
		ep_group_t *g1;
		struct ep_group_config o = cfg_of("areas", 1);
		TH_OK(ep_connect(s->d->sock, &c1));
		TH_EXPECT_RC(ep_join(c1, &o, EP_JOIN_NOWAIT, &g1),
			     EP_EMISMATCH);
		TH_CHECK(strstr(ep_errmsg(), "recv_areas 3"), "message: %s",
			 ep_errmsg());
		printf("ok: receive areas: rows where each rank named, the "
		       "others kept; another count at join -> %s\n",
		       ep_errmsg());
		TH_EXPECT_RC(ep_join(c1, &o, EP_JOIN_RECV_AREAS(17), &g1),
			     EP_EINVAL);
		struct ep_group_config two = cfg_of("areas-2n", 1);
		two.world_size = 2 * W;
		TH_EXPECT_RC(ep_join(c1, &two,
				     EP_JOIN_NOWAIT | EP_JOIN_RECV_AREAS(2),
				     &g1),
			     EP_EUNSUPPORTED);
		printf("ok: 17 areas, areas across nodes -> %s\n",
		       ep_errmsg());
		ep_close(c1);
	}
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

/* Ranks that disagree on the handle: the group fails with EP_EMISMATCH. */
static int mismatch_rank(int r, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = cfg_of("mismatch", r);
	ep_group_t *g = th_join(s->d, &cfg, &c);
	ep_handle_t h1, h2;
	fill(g, r, 4);
	TH_OK(ep_dispatch_inplace(g, 4, 0, NULL, &h1));
	TH_OK(ep_dispatch_inplace(g, 4, 0, NULL, &h2));
	/* rank 3 arrives last, with the other handle */
	if (r == 3)
		while (s->entered < 3)
			th_sleep_ms(1);
	else
		__atomic_fetch_add(&s->entered, 1, __ATOMIC_SEQ_CST);
	if (r != 3)
		th_sleep_ms(10);
	int rc = ep_combine_inplace(g, r == 3 ? &h1 : &h2, 0);
	TH_EXPECT_RC(rc, EP_EMISMATCH);
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

/* A stale handle fails the rank that names it, never the group: every
 * rank combines a handle it released, rank 3 late (while the others already
 * wait in the next barrier), and the barrier completes. */
static int stale_rank(int r, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = cfg_of("stale", r);
	ep_group_t *g = th_join(s->d, &cfg, &c);
	ep_handle_t first, h;
	fill(g, r, 4);
	for (int i = 0; i < 34; i++)
		TH_OK(ep_dispatch_inplace(g, 4, 0, NULL, i ? &h : &first));
	if (r == 3)
		th_sleep_ms(300);
	TH_OK(ep_handle_release(g, &first));
	TH_EXPECT_RC(ep_combine_inplace(g, &first, 0), EP_ESTALE);
	TH_OK(ep_barrier(g));
	TH_OK(ep_combine_inplace(g, &h, 0));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

/* A rank killed in the middle: the others get peer-lost. */
static int killed_rank(int r, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = cfg_of("killed", r);
	ep_group_t *g = th_join(s->d, &cfg, &c);
	ep_handle_t h;
	fill(g, r, 16);
	TH_OK(ep_dispatch_inplace(g, 16, 0, NULL, &h));
	if (r == 1) {
		for (;;)
			pause(); /* the parent kills this one */
	}
	__atomic_fetch_add(&s->entered, 1, __ATOMIC_SEQ_CST);
	uint64_t t0 = th_now_ns();
	int rc = ep_dispatch_inplace(g, 16, 0, NULL, &h);
	TH_EXPECT_RC(rc, EP_EPEERLOST);
	TH_CHECK(th_now_ns() - t0 < 4000000000ull, "peer loss took too long");
	TH_EXPECT_RC(ep_combine_inplace(g, &h, 0), EP_EPEERLOST);
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

/* A rank that stays connected but never enters the dispatch: the others get
 * EP_ETIMEDOUT naming it after the group's timeout (not a hang); the group
 * is failed for everyone, a rejoin under its name is refused while a rank
 * is still in it, and once all left the name serves a new group. */
#define STALL_MS 300
static int stalled_rank(int r, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = cfg_of("stall", r);
	cfg.timeout_ms = STALL_MS;
	ep_group_t *g = th_join(s->d, &cfg, &c);
	ep_handle_t h;
	fill(g, r, 8);
	TH_OK(ep_dispatch_inplace(g, 8, 0, NULL, &h));
	if (r == 2) {
		/* stalls: alive, connected, never calling */
		while (s->entered < W - 1)
			th_sleep_ms(1);
		/* what it calls next fails with the group's error */
		TH_EXPECT_RC(ep_dispatch_inplace(g, 8, 0, NULL, &h),
			     EP_ETIMEDOUT);
		TH_CHECK(strstr(ep_errmsg(), "failed"), "message: %s",
			 ep_errmsg());
		s->phase[2] = 1;
		while (s->phase[0] != 1)
			th_sleep_ms(1);
		TH_OK(ep_leave(g));
		ep_close(c);
		s->phase[2] = 2;
		return 0;
	}
	uint64_t t0 = th_now_ns();
	int rc = ep_dispatch_inplace(g, 8, 0, NULL, &h);
	uint64_t dt = th_now_ns() - t0;
	TH_EXPECT_RC(rc, EP_ETIMEDOUT);
	TH_CHECK(strstr(ep_errmsg(), "ranks never arrived: 2"), "message: %s",
		 ep_errmsg());
	TH_CHECK(dt >= (STALL_MS - 50) * 1000000ull && dt < 3000000000ull,
		 "timed out after %llu ms, the timeout is %u ms",
		 (unsigned long long)(dt / 1000000), STALL_MS);
	/* the failed group refuses every later op */
	TH_EXPECT_RC(ep_combine_inplace(g, &h, 0), EP_ETIMEDOUT);
	TH_OK(ep_leave(g));
	ep_close(c);
	__atomic_fetch_add(&s->entered, 1, __ATOMIC_SEQ_CST);
	if (r != 0)
		return 0;
	printf("ok: a stalled rank -> the others get EP_ETIMEDOUT naming it "
	       "after %llu ms (timeout %u ms)\n",
	       (unsigned long long)(dt / 1000000), STALL_MS);
	/* rank 2 is still in the failed group: a new rank 0 is refused */
	while (s->phase[2] != 1)
		th_sleep_ms(1);
	ep_group_t *g2;
	TH_OK(ep_connect(s->d->sock, &c));
	TH_EXPECT_RC(ep_join(c, &cfg, 0, &g2), EP_EFAILED);
	TH_CHECK(strstr(ep_errmsg(), "last rank leaves"), "message: %s",
		 ep_errmsg());
	printf("ok: joining a failed group -> %s\n", ep_errmsg());
	ep_close(c);
	s->phase[0] = 1;
	while (s->phase[2] != 2)
		th_sleep_ms(1);
	/* everyone left: the name is free for a new group (world 4, so a
	 * join without waiting succeeds and leaves) */
	TH_OK(ep_connect(s->d->sock, &c));
	TH_OK(ep_join(c, &cfg, EP_JOIN_NOWAIT, &g2));
	/* a rank that joins it with another timeout is refused */
	ep_conn_t *c1;
	ep_group_t *g1;
	struct ep_group_config other = cfg_of("stall", 1);
	other.timeout_ms = STALL_MS + 1;
	TH_OK(ep_connect(s->d->sock, &c1));
	TH_EXPECT_RC(ep_join(c1, &other, EP_JOIN_NOWAIT, &g1), EP_EMISMATCH);
	TH_CHECK(strstr(ep_errmsg(), "timeout_ms 300"), "message: %s",
		 ep_errmsg());
	ep_close(c1);
	TH_OK(ep_leave(g2));
	ep_close(c);
	return 0;
}

/* A GPU rank's join where libep cannot serve one (built without CUDA,
 * or no driver here): refused before anything reaches the daemon, and the
 * connection then joins a host group as always. On a machine with a GPU
 * the join is the daemon's to answer (not what this checks). */
static int cuda_join_rank(int r, void *arg)
{
	struct shared *s = arg;
	(void)r;
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(s->d->sock, &c));
	struct ep_group_config cfg = cfg_of("gpujoin", 0);
	cfg.world_size = 1;
	cfg.ranks_per_node = 1;
	TH_EXPECT_RC(ep_join(c, &cfg, EP_JOIN_CUDA | EP_JOIN_NOWAIT, &g),
		     EP_EINVAL);
	TH_CHECK(strstr(ep_errmsg(), "waits for the group"), "message: %s",
		 ep_errmsg());
	int rc = ep_join(c, &cfg, EP_JOIN_CUDA, &g);
#ifdef HAVE_CUDA
	void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (drv) { /* a driver here: the join is the daemon's to answer */
		if (rc == 0)
			TH_OK(ep_leave(g));
		dlclose(drv);
	} else {
		TH_CHECK(rc == EP_EUNSUPPORTED, "GPU join without a driver: "
						"%d %s",
			 rc, ep_errmsg());
	}
#else
	TH_CHECK(rc == EP_EUNSUPPORTED &&
			 strstr(ep_errmsg(), "built without CUDA"),
		 "GPU join in a build without CUDA: %d %s", rc, ep_errmsg());
#endif
	TH_OK(ep_join(c, &cfg, 0, &g));
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

/* A raw client: the daemon checks what libep would have refused. */
static void raw_checks(const struct th_daemon *d)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	memcpy(sa.sun_path, d->sock, strlen(d->sock) + 1);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	TH_CHECK(connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0,
		 "connect");
	struct epp_join j = {.world_size = 1, .ranks_per_node = 1,
			     .num_experts = 4, .hidden = 128,
			     .max_tokens = 8, .topk = 2, .dtype = 1};
	strcpy(j.name, "raw");
	uint8_t buf[256], *p;
	struct epp_hdr hd, rh;
	struct epp_join_ok jo;
	th_raw_join(fd, &j, 1, &jo);
	struct {
		struct epp_dispatch d;
		int code;
		const char *frag;
	} cases[] = {
		{{.num_tokens = 9, .hidden = 128, .dtype = 1, .topk = 2},
		 EP_ETOOBIG, "dispatched 9 tokens"},
		{{.num_tokens = 1, .hidden = 256, .dtype = 1, .topk = 2},
		 EP_ESHAPE, "hidden 256"},
		{{.num_tokens = 1, .hidden = 128, .dtype = 2, .topk = 2},
		 EP_ESHAPE, "dtype 2"},
		{{.num_tokens = 1, .hidden = 128, .dtype = 1, .topk = 2,
		  .flags = 0x80},
		 EP_EINVAL, "unknown dispatch flags"},
		{{.num_tokens = 1, .hidden = 128, .dtype = 1, .topk = 2,
		  .flags = 1u << EPP_DISPATCH_AREA_SHIFT},
		 EP_EINVAL, "receive area 1 of group raw, which has 1"},
		{{.num_tokens = 1, .hidden = 128, .dtype = 1, .topk = 2,
		  .flags = EPP_DISPATCH_CACHED, .handle = {.seq = 1}},
		 EP_ESTALE, "handle belongs to group"},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		cases[i].d.group_id = jo.group_id;
		if (cases[i].d.flags & EPP_DISPATCH_CACHED)
			cases[i].d.handle.group_id = jo.group_id + 1;
		epp_hdr_init(&hd, EPP_DISPATCH, 10 + i);
		hd.length = (uint32_t)epp_dispatch_encode(&cases[i].d, buf,
							  sizeof(buf));
		TH_OK(epp_send_frame(fd, &hd, buf, NULL));
		TH_OK(epp_recv_frame(fd, &rh, &p, NULL, 5000, NULL, 0));
		int code;
		char msg[EPP_ERRMSG_MAX];
		TH_CHECK(rh.type == EPP_ERROR && rh.req_id == 10 + i,
			 "case %zu: reply type %u", i, rh.type);
		TH_OK(epp_error_decode(p, rh.length, &code, msg, sizeof(msg)));
		free(p);
		TH_CHECK(code == cases[i].code && strstr(msg, cases[i].frag),
			 "case %zu: %d %s", i, code, msg);
		printf("ok: raw dispatch -> %s\n", msg);
	}
	/* A combine on a handle that never existed. */
	struct epp_combine cb = {.group_id = jo.group_id,
				 .handle = {.group_id = jo.group_id,
					    .epoch = jo.epoch, .seq = 5},
				 .hidden = 128};
	epp_hdr_init(&hd, EPP_COMBINE, 30);
	hd.length = (uint32_t)epp_combine_encode(&cb, buf, sizeof(buf));
	TH_OK(epp_send_frame(fd, &hd, buf, NULL));
	TH_OK(epp_recv_frame(fd, &rh, &p, NULL, 5000, NULL, 0));
	TH_CHECK(rh.type == EPP_ERROR, "combine of an unknown handle");
	free(p);
	/* Combine flags a synchronous combine does not take: registered
	 * memory (1.13 rows in, 1.14 rows out, each with its tail) is for
	 * stream-ordered ops of GPU ranks only; and one past them all (with
	 * the top-k order, which a synchronous combine takes, beside it). */
	static const struct {
		uint32_t flags;
		const char *frag;
	} bad[] = {{EPP_COMBINE_YREG, "unknown combine flags 0x8"},
		   {EPP_COMBINE_OUTREG, "unknown combine flags 0x10"},
		   {EPP_COMBINE_YREG | EPP_COMBINE_OUTREG,
		    "unknown combine flags 0x18"},
		   {0x40, "unknown combine flags 0x40"},
		   {EPP_COMBINE_TOPK_ORDER | 0x40,
		    "unknown combine flags 0x60"}};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		cb.flags = bad[i].flags;
		cb.reg = cb.out_reg = 1;
		cb.out_rows = 1;
		epp_hdr_init(&hd, EPP_COMBINE, 32 + i);
		hd.length = (uint32_t)epp_combine_encode(&cb, buf, sizeof(buf));
		TH_CHECK(hd.length > 0, "combine frame %zu encodes", i);
		TH_OK(epp_send_frame(fd, &hd, buf, NULL));
		TH_OK(epp_recv_frame(fd, &rh, &p, NULL, 5000, NULL, 0));
		int code;
		char msg[EPP_ERRMSG_MAX];
		TH_CHECK(rh.type == EPP_ERROR && rh.req_id == 32 + i,
			 "combine of flags 0x%x: reply type %u", bad[i].flags,
			 rh.type);
		TH_OK(epp_error_decode(p, rh.length, &code, msg, sizeof(msg)));
		TH_CHECK(code == EP_EINVAL && strstr(msg, bad[i].frag),
			 "unknown combine flags: %d %s", code, msg);
		printf("ok: raw combine -> %s\n", msg);
		free(p);
	}
	/* The world-1 group still dispatches. */
	struct epp_dispatch ok = {.group_id = jo.group_id, .num_tokens = 0,
				  .hidden = 128, .dtype = 1, .topk = 2};
	epp_hdr_init(&hd, EPP_DISPATCH, 31);
	hd.length = (uint32_t)epp_dispatch_encode(&ok, buf, sizeof(buf));
	TH_OK(epp_send_frame(fd, &hd, buf, NULL));
	TH_OK(epp_recv_frame(fd, &rh, &p, NULL, 5000, NULL, 0));
	TH_CHECK(rh.type == EPP_OK, "a good dispatch after the bad ones");
	free(p);
	close(fd);
}

/* ep_get_buffers into callers' structs of other sizes (a program built
 * against another ep.h): one smaller than ABI 1's is refused and left as
 * it was; one of this header's size is filled and no byte past it
 * written; a larger one (a newer header's) gets what this library does
 * not know zeroed, and nothing past the size it gave. */
static int sizes_rank(int r, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = cfg_of("bufsizes", r);
	cfg.world_size = cfg.ranks_per_node = 1;
	ep_group_t *g = th_join(s->d, &cfg, &c);
	struct ep_buffers ref;
	TH_OK(ep_get_buffers(g, &ref));
	TH_CHECK(ref.x && ref.combine_bias2 && ref.max_tokens == TMAX,
		 "the buffers of a fresh group");
	enum { PAST = 64 };
	unsigned char mem[sizeof(struct ep_buffers) + PAST];
	size_t n = sizeof(struct ep_buffers);
	size_t small = offsetof(struct ep_buffers, combine_bias2);
	memset(mem, 0xa5, sizeof mem);
	int rc = ep_get_buffers_sized(g, (struct ep_buffers *)(void *)mem,
				      small);
	TH_CHECK(rc == EP_EINVAL && strstr(ep_errmsg(), "ABI"),
		 "a struct shorter than ABI 1's: %s (%s)", ep_strerror(rc),
		 ep_errmsg());
	for (size_t i = 0; i < sizeof mem; i++)
		TH_CHECK(mem[i] == 0xa5, "byte %zu written on a refusal", i);
	memset(mem, 0xa5, sizeof mem);
	TH_OK(ep_get_buffers_sized(g, (struct ep_buffers *)(void *)mem, n));
	TH_CHECK(memcmp(mem, &ref, n) == 0, "this header's size: filled");
	for (size_t i = n; i < sizeof mem; i++)
		TH_CHECK(mem[i] == 0xa5, "byte %zu past the struct written", i);
	memset(mem, 0xa5, sizeof mem);
	TH_OK(ep_get_buffers_sized(g, (struct ep_buffers *)(void *)mem,
				   n + PAST - 8));
	TH_CHECK(memcmp(mem, &ref, n) == 0, "a larger struct: filled");
	for (size_t i = n; i < n + PAST - 8; i++)
		TH_CHECK(mem[i] == 0, "byte %zu of a newer header's struct "
				      "not zeroed", i);
	for (size_t i = n + PAST - 8; i < sizeof mem; i++)
		TH_CHECK(mem[i] == 0xa5, "byte %zu past the size written", i);
	TH_CHECK(ep_abi_version() == EP_ABI_VERSION, "ep_abi_version %u",
		 ep_abi_version());
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

int main(void)
{
	th_init("dispatch/combine errors", 180);
	struct th_daemon d;
	th_daemon_start(&d, NULL);
	struct shared *s = th_shared(sizeof(*s));
	s->d = &d;
	pid_t pids[W];

	th_spawn(pids, 1, cuda_join_rank, s);
	TH_CHECK(th_wait_all(pids, 1, 60) == 0, "GPU join case");
	printf("ok: a GPU join that waits not -> EP_EINVAL; one libep cannot "
	       "serve is refused, and the connection joins a host group "
	       "after it\n");
	th_spawn(pids, 1, sizes_rank, s);
	TH_CHECK(th_wait_all(pids, 1, 60) == 0, "struct sizes case");
	printf("ok: ep_get_buffers into a struct shorter than ABI %u's -> "
	       "EP_EINVAL, untouched; this header's and a newer one's "
	       "filled, nothing written past the size given\n",
	       (unsigned)EP_ABI_VERSION);
	th_spawn(pids, W, bad_expert_rank, s);
	TH_CHECK(th_wait_all(pids, W, 60) == 0, "bad expert case");
	th_spawn(pids, W, arg_rank, s);
	TH_CHECK(th_wait_all(pids, W, 60) == 0, "argument case");
	th_spawn(pids, W, areas_rank, s);
	TH_CHECK(th_wait_all(pids, W, 60) == 0, "receive areas case");
	th_spawn(pids, W, recvcap_rank, s);
	TH_CHECK(th_wait_all(pids, W, 60) == 0, "receive capacity case");
	printf("ok: recv_rows %d: a dispatch past it -> every rank at once, "
	       "nothing written: %s; one within it equals the worst-case "
	       "group's\n",
	       RECV, s->msg[0]);
	th_spawn(pids, W, toobig_rank, s);
	TH_CHECK(th_wait_all(pids, W, 60) == 0, "too many tokens case");
	printf("ok: one rank's dispatch of too many tokens -> every rank at "
	       "once: %s\n",
	       s->msg[0]);
	th_spawn(pids, W, mismatch_rank, s);
	TH_CHECK(th_wait_all(pids, W, 60) == 0, "mismatch case");
	printf("ok: ranks combining different handles -> EP_EMISMATCH\n");
	th_spawn(pids, W, stale_rank, s);
	TH_CHECK(th_wait_all(pids, W, 60) == 0, "stale handle case");
	s->entered = 0;
	th_spawn(pids, W, refused_rank, s);
	TH_CHECK(th_wait_all(pids, W, 60) == 0, "refused rank case");
	printf("ok: a rank's refused combine, then nothing: the others' "
	       "timeout names it and why: %s\n",
	       s->msg[0]);
	printf("ok: a late rank's stale combine fails that rank, not the "
	       "group\n");

	s->entered = 0;
	th_spawn(pids, W, killed_rank, s);
	while (s->entered < W - 1)
		th_sleep_ms(1);
	th_sleep_ms(100);
	kill(pids[1], SIGKILL);
	int bad = 0;
	for (int i = 0; i < W; i++)
		if (i != 1)
			bad += th_wait_all(&pids[i], 1, 30);
	th_reap(pids[1], 5);
	TH_CHECK(bad == 0, "killed case");
	printf("ok: a rank killed mid-dispatch -> peer lost for the others\n");

	memset((void *)s->phase, 0, sizeof(s->phase));
	s->entered = 0;
	th_spawn(pids, W, stalled_rank, s);
	TH_CHECK(th_wait_all(pids, W, 60) == 0, "stalled rank case");

	raw_checks(&d);

	/* The daemon serves a new group after all that. */
	th_spawn(pids, W, bad_expert_rank, s);
	TH_CHECK(th_wait_all(pids, W, 60) == 0, "a new group after errors");
	th_daemon_stop(&d);
	return 0;
}
