/* SPDX-License-Identifier: MIT */
/*
 * Handles live until their owners release them (one node, host backend):
 *  - a "forward pass" of 40 dispatches with 40 different routings keeps
 *    every handle (more than the 32 the daemon once kept); the "backward
 *    pass" combines them in reverse order and runs a cached dispatch on the
 *    oldest, each bitwise equal to the reference (tests/lib/ref.c);
 *  - a released handle gives EP_ESTALE (combine, cached dispatch, a second
 *    release), saying it was released; a handle of another group too;
 *  - the ranks release in different orders and at different times, and
 *    the daemon's status counts what is held (0 at the end);
 *  - past max_handle_bytes a dispatch fails the group for every rank with
 *    EP_ELIMIT, naming the limit; another group on the same daemon that
 *    releases its handles runs 200 dispatches under the same limit;
 *  - a release on a failed group succeeds;
 *  - a raw client that releases a handle while its own combine on it
 *    waits for the other rank (it could free the routing under the op)
 *    gets EP_EBUSY and the combine completes; a malformed release frame
 *    gets EP_EPROTO and the connection stays.
 */
#include "harness.h"
#include "epp.h"
#include "ref.h"

#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define W 4
#define LAYERS 40

static struct th_daemon D, L;

static struct ref_case layer_case(int layer)
{
	struct ref_case c = {.seed = 0x5eed0000u + (uint64_t)layer,
			     .world = W, .experts = 16, .hidden = 256,
			     .topk = 4, .max_tokens = 24,
			     .tokens = {24, 7, 0, 19}, .dtype = EP_DTYPE_BF16,
			     .mode = REF_RANDOM, .weights = true};
	return c;
}

static ep_group_t *join(const struct th_daemon *d, const char *name, int r,
			ep_conn_t **conn)
{
	struct ref_case c = layer_case(0);
	struct ep_group_config cfg = {
		.name = name, .world_size = W, .ranks_per_node = W,
		.rank = (uint32_t)r, .num_experts = c.experts,
		.hidden = c.hidden, .max_tokens_per_rank = c.max_tokens,
		.topk = c.topk, .dtype = EP_DTYPE_BF16, .timeout_ms = 20000};
	return th_join(d, &cfg, conn);
}

/* How many handles the daemon's status says group `name` holds. */
static long held(ep_conn_t *conn, const char *name)
{
	char *js;
	TH_OK(ep_daemon_status(conn, &js));
	char pat[96];
	snprintf(pat, sizeof(pat), "\"name\":\"%s\"", name);
	const char *g = strstr(js, pat);
	if (!g) {
		snprintf(pat, sizeof(pat), "\"name\": \"%s\"", name);
		g = strstr(js, pat);
	}
	TH_CHECK(g, "group %s not in the status: %s", name, js);
	const char *h = strstr(g, "\"handles\"");
	TH_CHECK(h, "no handles in the status");
	const char *n = strstr(h, "\"held\"");
	TH_CHECK(n, "no held count in the status");
	n += 6;
	while (*n == ':' || *n == ' ')
		n++;
	long v = strtol(n, NULL, 10);
	free(js);
	return v;
}

static int forward_backward(int r, void *arg)
{
	(void)arg;
	ep_conn_t *conn;
	ep_group_t *g = join(&D, "layers", r, &conn);
	static struct ref_inputs in[LAYERS][W], in2[W];
	static struct ref_recv exp[LAYERS][W], exp2[W];
	ep_handle_t h[LAYERS];
	const uint32_t H = 256, K = 4, cap = W * 24;
	uint16_t *rx = malloc((size_t)cap * H * 2);
	int64_t *ri = malloc((size_t)cap * K * 8);
	float *rw = malloc((size_t)cap * K * 4);
	int32_t *pe = malloc(16);
	for (int l = 0; l < LAYERS; l++) {
		struct ref_case c = layer_case(l);
		ref_gen_world(&c, in[l], in2, exp[l], exp2);
		const struct ref_inputs *me = &in[l][r];
		struct ep_dispatch_in din = {
			.num_tokens = me->T, .hidden = H,
			.dtype = EP_DTYPE_BF16, .topk = K, .x = me->x,
			.topk_idx = me->topk, .topk_weights = me->weights};
		struct ep_dispatch_out dout = {
			.capacity = cap, .recv_x = rx, .recv_topk_idx = ri,
			.recv_topk_weights = rw,
			.num_recv_tokens_per_expert = pe};
		TH_OK(ep_dispatch(g, &din, NULL, &dout, &h[l]));
		const struct ref_recv *want = &exp[l][r];
		TH_CHECK(dout.num_recv == want->R, "layer %d rank %d: %u rows, "
			 "want %u", l, r, dout.num_recv, want->R);
		TH_CHECK(!memcmp(rx, want->x, (size_t)want->R * H * 2),
			 "layer %d rank %d: recv_x", l, r);
		TH_CHECK(!memcmp(ri, want->topk, (size_t)want->R * K * 8),
			 "layer %d rank %d: recv_topk_idx", l, r);
	}
	TH_OK(ep_barrier(g));
	if (r == 0) {
		long n = held(conn, "layers");
		TH_CHECK(n == LAYERS, "status: %ld handles held, want %d", n,
			 LAYERS);
		/* and the operator's metrics say so */
		char cmd[512], line[256], want[96];
		snprintf(cmd, sizeof(cmd), "%s -s %s metrics", th_epctl_bin(),
			 D.sock);
		snprintf(want, sizeof(want),
			 "epd_group_handles{group=\"layers\"} %d\n", LAYERS);
		/* and the rows moved, as the status counts them */
		char *js;
		TH_OK(ep_daemon_status(conn, &js));
		const char *bm = strstr(js, "\"bytes_moved\":");
		TH_CHECK(bm, "no bytes_moved in the status");
		const long long moved = atoll(bm + 14);
		free(js);
		TH_CHECK(moved > 0, "the status counts no bytes moved");
		char want2[128];
		snprintf(want2, sizeof(want2),
			 "epd_group_moved_bytes_total{group=\"layers\"} %lld\n",
			 moved);
		FILE *p = popen(cmd, "r");
		TH_CHECK(p, "popen %s", cmd);
		bool seen = false, seen2 = false;
		while (fgets(line, sizeof(line), p)) {
			seen |= !strcmp(line, want);
			seen2 |= !strcmp(line, want2);
		}
		TH_CHECK(pclose(p) == 0 && seen && seen2,
			 "epctl metrics lacks %s or %s", want, want2);
	}
	TH_OK(ep_barrier(g));
	/* Backward: combines in reverse order, every one on its own routing. */
	uint16_t *out = malloc((size_t)24 * H * 2), *want = malloc(24 * H * 2);
	for (int l = LAYERS - 1; l >= 0; l--) {
		struct ref_case c = layer_case(l);
		uint16_t *y[W];
		for (int d = 0; d < W; d++)
			y[d] = ref_gen_y(&c, (uint32_t)d, exp[l][d].R, 77);
		TH_OK(ep_combine(g, &h[l], y[r], h[l].num_recv, H, NULL, out));
		ref_combine(&c, in[l], exp[l], y, (uint32_t)r, want);
		TH_CHECK(!memcmp(out, want, (size_t)in[l][r].T * H * 2),
			 "layer %d rank %d: combine along a kept handle", l, r);
		for (int d = 0; d < W; d++)
			free(y[d]);
		if (l > 0) {
			/* the ranks release at different times: some at once,
			 * some at the end */
			if ((l + r) % 3 == 0)
				TH_OK(ep_handle_release(g, &h[l]));
		}
	}
	/* A cached dispatch along the oldest handle, with new data. */
	{
		struct ref_case c = layer_case(0);
		struct ref_inputs fresh[W];
		struct ref_recv fexp[W], fexp2[W];
		ref_gen_world(&c, fresh, in2, fexp, fexp2);
		struct ep_dispatch_in din = {
			.num_tokens = in2[r].T, .hidden = H,
			.dtype = EP_DTYPE_BF16, .topk = K, .x = in2[r].x};
		struct ep_dispatch_out dout = {.capacity = cap, .recv_x = rx};
		ep_handle_t nh;
		TH_OK(ep_dispatch(g, &din, &h[0], &dout, &nh));
		TH_CHECK(dout.num_recv == fexp2[r].R &&
				 !memcmp(rx, fexp2[r].x,
					 (size_t)fexp2[r].R * H * 2),
			 "rank %d: cached dispatch along the oldest handle", r);
	}
	for (int l = LAYERS - 1; l >= 0; l--)
		if (l == 0 || (l + r) % 3 != 0)
			TH_OK(ep_handle_release(g, &h[l]));
	/* Released: every use says so. */
	uint16_t *y0 = calloc((size_t)cap * H, 2);
	TH_EXPECT_RC(ep_combine(g, &h[5], y0, h[5].num_recv, H, NULL, out),
		     EP_ESTALE);
	TH_CHECK(strstr(ep_errmsg(), "released"), "message: %s", ep_errmsg());
	TH_EXPECT_RC(ep_handle_release(g, &h[5]), EP_ESTALE);
	/* a host rank's release is answered either way */
	TH_EXPECT_RC(ep_handle_release_async(g, &h[5]), EP_ESTALE);
	TH_EXPECT_RC(ep_handle_release_async(NULL, &h[5]), EP_EINVAL);
	ep_handle_t other = h[5];
	other.group_id += 1000;
	TH_EXPECT_RC(ep_handle_release(g, &other), EP_ESTALE);
	ep_handle_t never = h[LAYERS - 1];
	never.seq += 1000;
	TH_EXPECT_RC(ep_handle_release(g, &never), EP_ESTALE);
	TH_EXPECT_RC(ep_handle_release(NULL, &h[1]), EP_EINVAL);
	TH_OK(ep_barrier(g));
	if (r == 0) {
		long n = held(conn, "layers");
		TH_CHECK(n == 0, "status: %ld handles held after every rank "
			 "released them", n);
	}
	/* The group goes on after the refusals. */
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(conn);
	return 0;
}

/* Rank r's dispatch of layer's inputs (the copy path, recv_x only). */
static void layer_io(int layer, int r, struct ep_dispatch_in *din,
		     struct ep_dispatch_out *dout)
{
	struct ref_case c = layer_case(layer);
	struct ref_inputs in[W], in2[W];
	struct ref_recv exp[W], exp2[W];
	ref_gen_world(&c, in, in2, exp, exp2);
	const uint32_t cap = W * 24;
	*din = (struct ep_dispatch_in){
		.num_tokens = in[r].T, .hidden = 256, .dtype = EP_DTYPE_BF16,
		.topk = 4, .x = in[r].x, .topk_idx = in[r].topk};
	*dout = (struct ep_dispatch_out){.capacity = cap,
					 .recv_x = malloc((size_t)cap * 512)};
}

/* Dispatch without releasing until the limit fails the group. */
static int past_limit(int r, void *arg)
{
	int *failed_at = arg;
	ep_conn_t *conn;
	ep_group_t *g = join(&L, "hoard", r, &conn);
	struct ep_dispatch_in din;
	struct ep_dispatch_out dout;
	layer_io(1, r, &din, &dout);
	ep_handle_t h;
	int i, rc = 0;
	for (i = 0; i < 1000; i++) {
		rc = ep_dispatch(g, &din, NULL, &dout, &h);
		if (rc)
			break;
	}
	TH_EXPECT_RC(rc, EP_ELIMIT);
	TH_CHECK(strstr(ep_errmsg(), "max_handle_bytes") &&
			 strstr(ep_errmsg(), "release"),
		 "message: %s", ep_errmsg());
	failed_at[r] = i;
	/* the group failed: a release still succeeds, ops say why */
	TH_OK(ep_handle_release(g, &h));
	TH_EXPECT_RC(ep_barrier(g), EP_ELIMIT); /* the group's error */
	ep_leave(g);
	ep_close(conn);
	return 0;
}

/* The same limit, with a release after each combine: never reached. */
static int within_limit(int r, void *arg)
{
	(void)arg;
	ep_conn_t *conn;
	ep_group_t *g = join(&L, "tidy", r, &conn);
	const uint32_t cap = W * 24;
	struct ep_dispatch_in din;
	struct ep_dispatch_out dout;
	layer_io(2, r, &din, &dout);
	uint16_t *y = calloc((size_t)cap * 256, 2), *out = malloc(24 * 512);
	ep_handle_t h[3];
	for (int i = 0; i < 200; i++) {
		/* three alive at a time, released in a rank's own order */
		TH_OK(ep_dispatch(g, &din, NULL, &dout, &h[i % 3]));
		TH_OK(ep_combine(g, &h[i % 3], y, h[i % 3].num_recv, 256,
				 NULL, out));
		if (i >= 2) /* the one of dispatch i - 2 */
			TH_OK(ep_handle_release(g, &h[(i + 1) % 3]));
	}
	TH_OK(ep_leave(g));
	ep_close(conn);
	return 0;
}

struct busy {
	volatile int combine; /* set by the raw rank: rank 1 may combine */
};

static int busy_peer(int r, void *arg)
{
	struct busy *b = arg;
	(void)r;
	ep_conn_t *conn;
	struct ep_group_config cfg = {
		.name = "busy", .world_size = 2, .ranks_per_node = 2,
		.rank = 1, .num_experts = 4, .hidden = 128,
		.max_tokens_per_rank = 8, .topk = 2, .dtype = EP_DTYPE_BF16,
		.timeout_ms = 20000};
	ep_group_t *g = th_join(&D, &cfg, &conn);
	ep_handle_t h;
	TH_OK(ep_dispatch_inplace(g, 0, 0, NULL, &h));
	while (!__atomic_load_n(&b->combine, __ATOMIC_ACQUIRE))
		th_sleep_ms(5);
	TH_OK(ep_combine_inplace(g, &h, 0));
	TH_OK(ep_handle_release(g, &h));
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(conn);
	return 0;
}

/* One frame out, one reply in: its type (and error code, message). */
static uint16_t raw_call(int fd, uint16_t type, uint64_t req, const void *pl,
			 uint32_t len, int *code, char *msg, size_t cap,
			 uint8_t **reply)
{
	struct epp_hdr hd, rh;
	epp_hdr_init(&hd, type, req);
	hd.length = len;
	TH_OK(epp_send_frame(fd, &hd, pl, NULL));
	uint8_t *p;
	TH_OK(epp_recv_frame(fd, &rh, &p, NULL, 10000, NULL, 0));
	TH_CHECK(rh.req_id == req, "reply to %llu, want %llu",
		 (unsigned long long)rh.req_id, (unsigned long long)req);
	*code = 0;
	if (rh.type == EPP_ERROR)
		TH_OK(epp_error_decode(p, rh.length, code, msg, cap));
	if (reply)
		*reply = p;
	else
		free(p);
	return rh.type;
}

static void release_while_busy(void)
{
	struct busy *b = th_shared(sizeof(*b));
	pid_t peer;
	th_spawn(&peer, 1, busy_peer, b);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	memcpy(sa.sun_path, D.sock, strlen(D.sock) + 1);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	TH_CHECK(connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0,
		 "connect");
	struct epp_join j = {.world_size = 2, .ranks_per_node = 2, .rank = 0,
			     .num_experts = 4, .hidden = 128, .max_tokens = 8,
			     .topk = 2, .dtype = 1, .timeout_ms = 20000};
	strcpy(j.name, "busy");
	struct epp_join_ok jo;
	th_raw_join(fd, &j, 1, &jo);
	uint8_t buf[128], *p;
	int code;
	char msg[EPP_ERRMSG_MAX];
	struct epp_dispatch d = {.group_id = jo.group_id, .hidden = 128,
				 .dtype = 1, .topk = 2};
	uint32_t n = (uint32_t)epp_dispatch_encode(&d, buf, sizeof(buf));
	TH_CHECK(raw_call(fd, EPP_DISPATCH, 2, buf, n, &code, msg,
			  sizeof(msg), &p) == EPP_OK,
		 "dispatch: %d %s", code, msg);
	struct epp_dispatch_ok ok;
	TH_OK(epp_dispatch_ok_decode(p, 8 + 4 + 8 + 4, &ok));
	free(p);
	/* the combine waits for rank 1; the release behind it on the same
	 * connection must not free the routing it will run on */
	struct epp_combine cb = {.group_id = jo.group_id, .handle = ok.handle,
				 .hidden = 128};
	struct epp_hdr hd;
	epp_hdr_init(&hd, EPP_COMBINE, 3);
	hd.length = (uint32_t)epp_combine_encode(&cb, buf, sizeof(buf));
	TH_OK(epp_send_frame(fd, &hd, buf, NULL));
	struct epp_release rl = {.group_id = jo.group_id, .handle = ok.handle};
	n = (uint32_t)epp_release_encode(&rl, buf, sizeof(buf));
	TH_CHECK(raw_call(fd, EPP_RELEASE, 4, buf, n, &code, msg, sizeof(msg),
			  NULL) == EPP_ERROR &&
			 code == EP_EBUSY && strstr(msg, "in progress"),
		 "release under its own combine: %d %s", code, msg);
	printf("ok: a release behind the rank's own pending combine -> %s\n",
	       msg);
	__atomic_store_n(&b->combine, 1, __ATOMIC_RELEASE);
	struct epp_hdr rh;
	TH_OK(epp_recv_frame(fd, &rh, &p, NULL, 10000, NULL, 0));
	TH_CHECK(rh.type == EPP_OK && rh.req_id == 3,
		 "the combine completes: reply type %u req %llu", rh.type,
		 (unsigned long long)rh.req_id);
	free(p);
	TH_CHECK(raw_call(fd, EPP_RELEASE, 5, buf, n, &code, msg, sizeof(msg),
			  NULL) == EPP_OK,
		 "release after the combine: %d %s", code, msg);
	TH_CHECK(raw_call(fd, EPP_RELEASE, 6, buf, n, &code, msg, sizeof(msg),
			  NULL) == EPP_ERROR &&
			 code == EP_ESTALE,
		 "a second release: %d %s", code, msg);
	TH_CHECK(raw_call(fd, EPP_RELEASE, 7, buf, n - 1, &code, msg,
			  sizeof(msg), NULL) == EPP_ERROR &&
			 code == EP_EPROTO && strstr(msg, "malformed release"),
		 "a short release: %d %s", code, msg);
	/* the connection and the group go on */
	uint64_t gid = jo.group_id;
	TH_CHECK(raw_call(fd, EPP_BARRIER, 8, &gid, 8, &code, msg, sizeof(msg),
			  NULL) == EPP_OK,
		 "barrier after the refusals: %d %s", code, msg);
	close(fd);
	TH_CHECK(th_wait_all(&peer, 1, 60) == 0, "rank 1 failed");
	printf("ok: released after the combine; a second release EP_ESTALE; "
	       "a short frame EP_EPROTO; the group went on\n");
}

int main(void)
{
	th_init("test_handles", 300);
	pid_t pids[W];
	th_daemon_start(&D, NULL);
	th_spawn(pids, W, forward_backward, NULL);
	TH_CHECK(th_wait_all(pids, W, 240) == 0, "a rank failed");
	release_while_busy();
	printf("ok: %d handles alive at once, combined in reverse order and "
	       "a cached dispatch on the oldest, bitwise equal to the "
	       "reference; released handles refused (EP_ESTALE); status "
	       "counts them\n",
	       LAYERS);
	th_daemon_stop(&D);

	/* A limit that holds a few handles of this shape. */
	th_daemon_start(&L, "-o", "max_handle_bytes=16K", NULL);
	int *at = th_shared(sizeof(int) * W);
	th_spawn(pids, W, past_limit, at);
	TH_CHECK(th_wait_all(pids, W, 120) == 0, "a rank failed");
	for (int r = 1; r < W; r++)
		TH_CHECK(at[r] == at[0], "ranks failed at dispatches %d and %d",
			 at[0], at[r]);
	TH_CHECK(at[0] > 2 && at[0] < 1000, "failed at dispatch %d", at[0]);
	th_spawn(pids, W, within_limit, NULL);
	TH_CHECK(th_wait_all(pids, W, 120) == 0, "a rank failed");
	TH_CHECK(th_daemon_alive(&L), "the daemon died");
	printf("ok: past max_handle_bytes every rank got EP_ELIMIT at "
	       "dispatch %d, naming the limit; a group that releases ran 200 "
	       "dispatches under it\n",
	       at[0]);
	th_daemon_stop(&L);
	printf("ok\n");
	return 0;
}
