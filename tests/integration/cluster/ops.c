/* SPDX-License-Identifier: MIT */
/* test_cluster: barriers with a late rank in every position, dispatch and combine across nodes bitwise against the reference, nodes whose ranks disagree, a job restarted under the same name, too many tokens, stalls and joins that cannot fit. */
#include "cluster.h"

void check_late(int nodes, int rpn)
{
	struct late *s = late_new(nodes, rpn, "x%dx%d", nodes, rpn);
	int world = nodes * rpn;
	pid_t pids[MAXW];
	th_spawn(pids, world, late_rank, s);
	TH_CHECK(th_wait_all(pids, world, 60) == 0, "%dx%d: a rank failed",
		 nodes, rpn);
	int diagonal = 0;
	for (int late = 0; late < world; late++) {
		uint64_t le = s->enter[late][late];
		for (int r = 0; r < world; r++) {
			TH_CHECK(s->leave[late][r] >= le,
				 "%dx%d, late rank %d: rank %d left %.3f ms "
				 "before it entered",
				 nodes, rpn, late, r,
				 (double)(le - s->leave[late][r]) / 1e6);
			bool other_node = r / rpn != late / rpn;
			bool other_rail = r % rpn != late % rpn;
			if (other_node && other_rail) {
				/* the diagonal: it really waited */
				double w = (double)(s->leave[late][r] -
						    s->enter[late][r]) /
					   1e6;
				/* (the test's own set-up: the late rank
				 * was late. Slow builds and the VM's
				 * emulated CPU may enter a diagonal rank
				 * late itself; leaving before the late rank
				 * entered is checked above either way.) */
				TH_CHECK(getenv("EPD_TEST_SLOW") ||
						 w >= DELAY_MS * 0.5,
					 "diagonal rank %d waited %.3f ms for "
					 "late rank %d",
					 r, w, late);
				diagonal++;
			}
		}
	}
	printf("ok: %d nodes x %d ranks, every late rank (%d diagonal "
	       "pairs): nobody left early\n",
	       nodes, rpn, diagonal);
}

/* Dispatch, cached dispatch and combine across nodes, bitwise against the
 * reference for the same global inputs (a one-node run of the same case
 * gives the same bytes: test_dispatch checks that side). */
struct xcase {
	struct ref_case c;
	int nodes, rpn, bad_rank;
	char name[32];
	long long kept; /* node 0's kept row buffers, seen by rank 0 */
};

#define XSAME(got, want, n, what)                                              \
	TH_CHECK((n) == 0 || !memcmp(got, want, n), "%s rank %d: %s differs", \
		 x->name, r, what)

int xrank(int r, void *arg)
{
	struct xcase *x = arg;
	const struct ref_case *c = &x->c;
	const uint32_t W = c->world, H = c->hidden, K = c->topk,
		       E = c->experts, elt = ref_elt(c);
	const uint32_t ns = c->dtype == EP_DTYPE_FP8 ? H / 128 : 0;
	struct ref_inputs in[8], in2[8];
	struct ref_recv exp[8], exp2[8];
	ref_gen_world(c, in, in2, exp, exp2);
	struct ep_group_config cfg = {
		.name = x->name, .world_size = W,
		.ranks_per_node = (uint32_t)x->rpn, .rank = (uint32_t)r,
		.num_experts = E, .hidden = H,
		.max_tokens_per_rank = c->max_tokens, .topk = K,
		.dtype = (ep_dtype_t)c->dtype, .timeout_ms = 20000};
	ep_conn_t *conn;
	ep_group_t *g;
	TH_OK(ep_connect(D[r / x->rpn].sock, &conn));
	TH_OK(ep_join(conn, &cfg, 0, &g));
	const struct ref_inputs *me = &in[r];
	const uint64_t cap = (uint64_t)W * c->max_tokens, R = exp[r].R;
	struct ep_dispatch_in din = {
		.num_tokens = me->T, .hidden = H, .dtype = (ep_dtype_t)c->dtype,
		.topk = K, .x = me->x, .x_scales = me->scales,
		.topk_idx = me->topk,
		.topk_weights = c->weights ? me->weights : NULL};
	struct ep_dispatch_out dout = {
		.capacity = cap, .recv_x = calloc(cap * H * elt + 1, 1),
		.recv_x_scales = calloc(cap * ns * 4 + 4, 1),
		.recv_topk_idx = calloc(cap * K * 8 + 8, 1),
		.recv_topk_weights = calloc(cap * K * 4 + 4, 1),
		.num_recv_tokens_per_expert = calloc(E / W * 4 + 4, 1)};
	ep_handle_t h, hc;
	if (x->bad_rank >= 0) {
		/* a bad expert on one node fails the op on every node */
		int64_t *bad = malloc((size_t)me->T * K * 8 + 8);
		memcpy(bad, me->topk, (size_t)me->T * K * 8);
		if (r == x->bad_rank)
			bad[0] = -7;
		struct ep_dispatch_in bin = din;
		bin.topk_idx = bad;
		TH_EXPECT_RC(ep_dispatch(g, &bin, NULL, &dout, &h), EP_EEXPERT);
		free(bad);
	}
	TH_OK(ep_dispatch(g, &din, NULL, &dout, &h));
	TH_CHECK(dout.num_recv == R, "%s rank %d: %u rows, want %llu",
		 x->name, r, dout.num_recv, (unsigned long long)R);
	XSAME(dout.recv_x, exp[r].x, R * H * elt, "recv_x");
	if (ns)
		XSAME(dout.recv_x_scales, exp[r].scales, R * ns * 4, "scales");
	XSAME(dout.recv_topk_idx, exp[r].topk, R * K * 8, "recv_topk_idx");
	XSAME(dout.recv_topk_weights, exp[r].weights, R * K * 4,
	      "recv_topk_weights");
	XSAME(dout.num_recv_tokens_per_expert, exp[r].per_expert, E / W * 4,
	      "num_recv_tokens_per_expert");
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	XSAME(b.recv_src, exp[r].src, R * 8, "recv_src");
	/* the whole matrix on every node, other nodes' pairs included */
	int32_t rp[64];
	ref_rank_prefix(c, exp, rp);
	XSAME(b.rank_prefix_matrix, rp, W * W * 4, "rank_prefix_matrix");
	/* cached dispatch of new data (it writes the matrix again) */
	struct ep_dispatch_in din2 = din;
	din2.x = in2[r].x;
	din2.x_scales = in2[r].scales;
	memset((void *)b.rank_prefix_matrix, 0xa5, W * W * 4);
	TH_OK(ep_dispatch(g, &din2, &h, &dout, &hc));
	XSAME(dout.recv_x, exp2[r].x, R * H * elt, "cached recv_x");
	XSAME(b.rank_prefix_matrix, rp, W * W * 4,
	      "cached rank_prefix_matrix");
	/* combine of random rows (and bias) along the first handle */
	uint16_t *ys[8];
	for (uint32_t d = 0; d < W; d++)
		ys[d] = ref_gen_y(c, d, exp[d].R, 7);
	uint16_t *out = calloc((size_t)me->T * H * 2 + 2, 1),
		 *want = calloc((size_t)me->T * H * 2 + 2, 1);
	TH_OK(ep_combine(g, &h, ys[r], (uint32_t)R, H,
			 c->bias ? me->bias : NULL, out));
	ref_combine(c, in, exp, ys, (uint32_t)r, want);
	XSAME(out, want, (size_t)me->T * H * 2, "combined");
	TH_OK(ep_barrier(g));
	if (r == 0) {
		/* while the group lives, its node keeps the row buffers */
		char *js;
		TH_OK(ep_daemon_status(conn, &js));
		/* tcp: rows come as frames (rdma: "rdma-write") */
		/* nodes on two devices: a connection off the protection
		 * domain of the first one carries frames only, so either
		 * may show (which device came up first decides) */
		const char *rows_in = rdma ? "\"rows_in\":\"rdma-write\""
					   : "\"rows_in\":\"frames\"";
		TH_CHECK(strstr(js, rows_in) ||
				 (two_devices &&
				  strstr(js, "\"rows_in\":\"frames\"")),
			 "the group's status does not say %s: %.300s", rows_in,
			 js);
		if (two_devices)
			printf("rows_in on node 0 with two devices: %s\n",
			       strstr(js, "rdma-write") ? "rdma-write"
							: "frames");
		json_t *root = json_loads(js, 0, NULL);
		free(js);
		json_int_t kept = json_integer_value(json_object_get(
			json_object_get(root, "cluster"), "pooled_bytes"));
		json_decref(root);
		TH_CHECK(kept > 0, "node 0 kept no row buffers between ops");
		x->kept = kept;
	}
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(conn);
	return 0;
}

void check_xdispatch(int nodes, int rpn, struct ref_case c, int bad)
{
	struct xcase *x = th_shared(sizeof(*x));
	x->c = c;
	x->c.world = (uint32_t)(nodes * rpn);
	x->nodes = nodes;
	x->rpn = rpn;
	x->bad_rank = bad;
	snprintf(x->name, sizeof(x->name), "xd%dx%d", nodes, rpn);
	pid_t pids[MAXW];
	th_spawn(pids, nodes * rpn, xrank, x);
	TH_CHECK(th_wait_all(pids, nodes * rpn, 60) == 0,
		 "%s failed (seed %llu)", x->name,
		 (unsigned long long)x->c.seed);
	printf("ok: dispatch, cached dispatch, combine over %d nodes x %d "
	       "ranks (%s%s): bitwise equal to the reference; node 0 kept "
	       "%lld bytes of row buffers between ops\n",
	       nodes, rpn, c.dtype == EP_DTYPE_FP8 ? "fp8" : "bf16",
	       bad >= 0 ? ", after a bad expert failed the op everywhere" : "",
	       x->kept);
}

int shape_rank(int rank, void *arg)
{
	struct late *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = th_group(s->name, 4, (uint32_t)rank,
					      5000);
	cfg.ranks_per_node = 2;
	if (rank >= 2)
		cfg.hidden = 512;
	ep_group_t *g;
	TH_OK(ep_connect(D[rank / 2].sock, &c));
	/* found at the join (when the other node's shape arrived first) or
	 * at the first collective */
	int rc = ep_join(c, &cfg, 0, &g);
	if (!rc) {
		rc = ep_barrier(g);
		snprintf(s->msgs[rank], sizeof(s->msgs[rank]), "%s",
			 ep_errmsg());
		ep_leave(g);
	} else {
		snprintf(s->msgs[rank], sizeof(s->msgs[rank]), "%s",
			 ep_errmsg());
	}
	s->codes[rank] = rc;
	ep_close(c);
	return 0;
}

/* Four ranks of a 2 x 2 group named name run fn (each records its code
 * and message in s); every one must end with code want and a message
 * containing frag, within wait_s. Returns the shared state. */
struct late *every_rank_gets(const char *name, th_child_fn fn,
				    unsigned wait_s, int want,
				    const char *frag)
{
	struct late *s = th_shared(sizeof(*s));
	snprintf(s->name, sizeof(s->name), "%s", name);
	pid_t pids[4];
	th_spawn(pids, 4, fn, s);
	TH_CHECK(th_wait_all(pids, 4, wait_s) == 0, "a rank failed");
	for (int r = 0; r < 4; r++) {
		TH_EXPECT_RC(s->codes[r], want);
		TH_CHECK(strstr(s->msgs[r], frag), "message: %s", s->msgs[r]);
	}
	return s;
}

void check_shape_mismatch(void)
{
	struct late *s = every_rank_gets("shapes", shape_rank, 30,
					 EP_EMISMATCH, "hidden");
	printf("ok: nodes that disagree on a group's shape: every rank gets "
	       "mismatch: %s\n",
	       s->msgs[0]);
}

/* Rank `rank` of the 2 x 2 group s->name (hidden 256) on its node's
 * daemon, its buffers in *b, 8 rows of x filled with 0x3c. */
ep_group_t *join_2x2(struct late *s, int rank, ep_conn_t **c,
			    struct ep_buffers *b)
{
	struct ep_group_config cfg = th_group(s->name, 4, (uint32_t)rank,
					      20000);
	cfg.ranks_per_node = 2;
	ep_group_t *g;
	TH_OK(ep_connect(D[rank / 2].sock, c));
	TH_OK(ep_join(*c, &cfg, 0, &g));
	TH_OK(ep_get_buffers(g, b));
	memset(b->x, 0x3c, (size_t)8 * 256 * 2);
	return g;
}

/* T tokens of top-K to every rank of the 2 x 2 group: token t's k-th
 * expert is 4k + 1, on rank k. */
void to_every_rank(struct ep_buffers *b, uint32_t T, uint32_t K)
{
	for (uint32_t t = 0; t < T; t++)
		for (uint32_t k = 0; k < K; k++)
			b->topk_idx[t * K + k] = (int64_t)(4 * k + 1);
}

/* A mismatch case's rank is done: its code and message into s, then it
 * leaves. */
int rank_done(struct late *s, int rank, int rc, ep_group_t *g,
		     ep_conn_t *c)
{
	s->codes[rank] = rc;
	snprintf(s->msgs[rank], sizeof(s->msgs[rank]), "%s", ep_errmsg());
	ep_leave(g);
	ep_close(c);
	return 0;
}

/* Node 0's ranks combine with top-k weights, node 1's without: rows cross
 * both ways, each node finds rows that disagree with its own ranks' ask,
 * and every rank gets EP_EMISMATCH; no one waits for a timeout. */
int wmis_rank(int rank, void *arg)
{
	struct late *s = arg;
	ep_conn_t *c;
	struct ep_buffers b;
	ep_group_t *g = join_2x2(s, rank, &c, &b);
	const uint32_t T = 8, K = 4;
	to_every_rank(&b, T, K);
	ep_handle_t h;
	TH_OK(ep_dispatch_inplace(g, T, 0, NULL, &h));
	memset(b.combine_y, 0x3c, (size_t)h.num_recv * 256 * 2);
	for (uint64_t i = 0; i < (uint64_t)h.num_recv * K; i++)
		b.combine_topk_weights[i] = 0.5f;
	int rc = ep_combine_inplace(g, &h, rank < 2 ? EP_COMBINE_WEIGHTS : 0);
	return rank_done(s, rank, rc, g, c);
}

/* Every rank of the 2 x 2 group `name` running fn gets EP_EMISMATCH
 * with frag in its message, within 15 s (no one waits out a timeout);
 * `what` names the case in the line printed. */
void check_mismatch(const char *name, th_child_fn fn, const char *frag,
			   const char *what)
{
	uint64_t t0 = th_now_ns();
	struct late *s = every_rank_gets(name, fn, 60, EP_EMISMATCH, frag);
	uint64_t ms = (th_now_ns() - t0) / 1000000;
	TH_CHECK(ms < 15000 * th_scale(), "%s took %llu ms", name,
		 (unsigned long long)ms);
	printf("ok: nodes whose ranks %s: every rank gets mismatch: %s\n",
	       what, s->msgs[0]);
}

void check_weights_mismatch(void)
{
	check_mismatch("wmis", wmis_rank, "top-k weights",
		       "disagree on the combine's top-k weights");
}

/* Two dispatches with different routings; then node 0's ranks combine
 * along the first handle, node 1's along the second. The daemons number
 * handles alike, so each node sees the other's rows name another handle:
 * every rank gets EP_EMISMATCH naming both, at once (before, the rows were
 * taken along this node's routing: a wrong count, or with equal counts
 * wrong sums). */
int hmis_rank(int rank, void *arg)
{
	struct late *s = arg;
	ep_conn_t *c;
	struct ep_buffers b;
	ep_group_t *g = join_2x2(s, rank, &c, &b);
	const uint32_t T = 8, K = 4;
	ep_handle_t h[2];
	/* to every rank, then token t to rank t % 4 only (its four
	 * experts there) */
	to_every_rank(&b, T, K);
	TH_OK(ep_dispatch_inplace(g, T, 0, NULL, &h[0]));
	for (uint32_t t = 0; t < T; t++)
		for (uint32_t k = 0; k < K; k++)
			b.topk_idx[t * K + k] = (int64_t)(4 * (t & 3) + k);
	TH_OK(ep_dispatch_inplace(g, T, 0, NULL, &h[1]));
	const ep_handle_t *mine = &h[rank < 2 ? 0 : 1];
	memset(b.combine_y, 0x3c, (size_t)mine->num_recv * 256 * 2);
	int rc = ep_combine_inplace(g, mine, 0);
	return rank_done(s, rank, rc, g, c);
}

void check_handle_mismatch(void)
{
	check_mismatch("hmis", hmis_rank, "named handle",
		       "combine along different handles");
}

/* A dispatch; then the nodes' ranks disagree on the second op. Every rank
 * gets EP_EMISMATCH saying so, at once.
 * - kmis: node 0's ranks dispatch afresh while node 1's run a cached
 *   dispatch of the first handle (before, the fresh side routed the cached
 *   side's ranks as sending nothing and failed on their rows, or waited).
 * - omis: node 0's ranks combine the first handle while node 1's dispatch
 *   afresh (before, node 0 took node 1's routing into its combine and
 *   queued the combine's job a second time: the daemon crashed).
 * - pmis: the first dispatch is routed within each node (no row crosses);
 *   node 1's ranks combine it, which needs nothing from node 0 and may end
 *   at once, while node 0's dispatch afresh. If node 1's combine ended
 *   before node 0's routing came, node 1 gets a routing for an op it
 *   finished: node 0's ranks get EP_EMISMATCH for that dispatch, node 1's
 *   for their next op. (Before, that was a protocol error and node 0's
 *   ranks waited out the timeout.) Else the combine meets the routing. */
int second_op_rank(int rank, void *arg)
{
	struct late *s = arg;
	ep_conn_t *c;
	struct ep_buffers b;
	ep_group_t *g = join_2x2(s, rank, &c, &b);
	const uint32_t T = 8, K = 4, node = (uint32_t)rank / 2;
	const bool past = !strcmp(s->name, "pmis");
	if (past) /* the experts of rank 2 * node */
		for (uint32_t i = 0; i < T * K; i++)
			b.topk_idx[i] = (int64_t)(8 * node + i % K);
	else
		to_every_rank(&b, T, K);
	ep_handle_t h, h2;
	TH_OK(ep_dispatch_inplace(g, T, 0, NULL, &h));
	int rc;
	if (!strcmp(s->name, "kmis")) {
		rc = ep_dispatch_inplace(g, T, 0, node ? &h : NULL, &h2);
	} else if ((node == 1) == past) {
		memset(b.combine_y, 0x3c, (size_t)h.num_recv * 256 * 2);
		rc = ep_combine_inplace(g, &h, 0);
		if (rc == 0 && past)
			rc = ep_barrier(g);
	} else {
		rc = ep_dispatch_inplace(g, T, 0, NULL, &h2);
	}
	return rank_done(s, rank, rc, g, c);
}

void check_kind_mismatch(void)
{
	check_mismatch("kmis", second_op_rank, "must run the same",
		       "run a fresh and a cached dispatch");
}

void check_op_mismatch(void)
{
	check_mismatch("omis", second_op_rank, "the same operations",
		       "run a combine and a dispatch");
	check_mismatch("pmis", second_op_rank, "in the same order",
		       "run a dispatch and a combine that needs no other node");
}

/* A job restarted at once under the same group name (world 2, a rank on
 * each of nodes 0 and 1). The test stops node 0's daemon for a moment;
 * meanwhile the old job's rank 0 dies, its rank 1 enters a barrier (node
 * 1 sends the arrival to node 0) and the new job's rank 0 joins. Node 0
 * then ends the old group, keeps the arrival (no group of that name) and
 * forms the new group: that arrival is the old group's and must not count
 * for the new one. Before, the new rank's first barrier returned at once
 * with no rank of the new job on node 1 (an early exit). Returns whether
 * node 0 saw the stale arrival this time (the order in which it reads its
 * sockets after the stop decides). */
struct restart {
	volatile int phase, through;
	int rc;
	char msg[256];
};

int restart_rank(int who, void *arg)
{
	struct restart *s = arg;
	/* who: 0 the old rank 0, 1 the old rank 1, 2 the new rank 0 */
	struct ep_group_config cfg = th_group("restart", 2,
					      who == 1 ? 1 : 0, 5000);
	cfg.ranks_per_node = 1;
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(D[who == 1].sock, &c));
	TH_OK(ep_join(c, &cfg, 0, &g));
	if (who == 2) {
		s->rc = ep_barrier(g);
		snprintf(s->msg, sizeof(s->msg), "%s", ep_errmsg());
		ep_leave(g);
		ep_close(c);
		return 0;
	}
	for (int i = 0; i < 3; i++)
		TH_OK(ep_barrier(g));
	__atomic_fetch_add(&s->through, 1, __ATOMIC_SEQ_CST);
	if (who == 0) {
		for (;;)
			pause(); /* killed */
	}
	while (s->phase < 1)
		th_sleep_ms(1);
	ep_barrier(g); /* fails: rank 0 is gone */
	ep_leave(g);
	ep_close(c);
	return 0;
}

int restart_new(int i, void *arg)
{
	(void)i;
	return restart_rank(2, arg);
}

bool restart_once(void)
{
	struct restart *s = th_shared(sizeof(*s));
	pid_t old[2], nw;
	th_spawn(old, 2, restart_rank, s);
	/* both old ranks through their barriers */
	for (int t = 0; s->through < 2; t++) {
		TH_CHECK(t < 6000, "the old job never completed 3 barriers");
		th_sleep_ms(5);
	}
	kill(D[0].pid, SIGSTOP);
	kill(old[0], SIGKILL);
	th_reap(old[0], 10);
	s->phase = 1; /* old rank 1 enters a barrier: node 1 sends it */
	th_sleep_ms(100);
	th_spawn(&nw, 1, restart_new, s);
	th_sleep_ms(100);
	kill(D[0].pid, SIGCONT);
	TH_CHECK(th_wait_all(&nw, 1, 60) == 0, "the new rank failed");
	TH_CHECK(th_wait_all(&old[1], 1, 60) == 0, "the old rank 1 failed");
	TH_CHECK(s->rc != 0, "the new job's rank 0 left its first barrier "
		 "with no rank of the new job on node 1 (the old group's "
		 "arrival counted)");
	FILE *f = fopen(D[0].log, "r");
	TH_CHECK(f, "%s", D[0].log);
	char line[1024];
	bool saw = false;
	while (fgets(line, sizeof(line), f))
		saw |= strstr(line, "restart") &&
		       strstr(line, "an earlier group's of that name");
	fclose(f);
	printf("  restart: the new rank's barrier: %s (%s)\n",
	       ep_strerror(s->rc), s->msg);
	return saw;
}

void check_restart(void)
{
	int tries = 0;
	while (!restart_once())
		TH_CHECK(++tries < 5, "node 0 never read the old group's "
			 "arrival after its end in 5 tries");
	printf("ok: a job restarted under the same name: the old group's "
	       "barrier arrival does not count for the new one\n");
}

/* Rank 3 (node 1) dispatches more tokens than the group's maximum while
 * rank 0 (node 0) gives a bad expert index: every rank on both nodes gets
 * EP_ETOOBIG naming rank 3 at once (too many tokens wins, as on one node
 * and on the GPU), and the group goes on. */
int xbig_rank(int rank, void *arg)
{
	struct late *s = arg;
	ep_conn_t *c;
	struct ep_buffers b;
	ep_group_t *g = join_2x2(s, rank, &c, &b);
	const uint32_t T = 8, K = 4;
	for (uint32_t t = 0; t < T * K; t++)
		b.topk_idx[t] = (int64_t)((t * 5 + (uint32_t)rank) % 16);
	if (rank == 0)
		b.topk_idx[K + 1] = 16; /* out of range */
	ep_handle_t h;
	uint64_t t0 = th_now_ns();
	s->codes[rank] = ep_dispatch_inplace(
		g, rank == 3 ? b.max_tokens + 1 : T, 0, NULL, &h);
	if (rank == 0)
		b.topk_idx[K + 1] = 3;
	snprintf(s->msgs[rank], sizeof(s->msgs[rank]), "%s", ep_errmsg());
	TH_CHECK(th_now_ns() - t0 < 5000000000ull * th_scale(),
		 "rank %d waited %llu ms", rank,
		 (unsigned long long)((th_now_ns() - t0) / 1000000));
	TH_OK(ep_dispatch_inplace(g, T, 0, NULL, &h));
	TH_OK(ep_combine_inplace(g, &h, 0));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

void check_xtoobig(void)
{
	struct late *s = every_rank_gets("xbig", xbig_rank, 60, EP_ETOOBIG,
					 "rank 3 dispatched");
	printf("ok: a rank on node 1 dispatches too many tokens: every rank "
	       "of both nodes gets it at once (%s), and the group goes on\n",
	       s->msgs[0]);
}

/* Joins that cannot fit the cluster: refused with the reason. */
void check_bad_joins(void)
{
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(D[0].sock, &c));
	struct ep_group_config cfg = th_group("toobig", 8, 0, 2000);
	cfg.ranks_per_node = 2; /* 4 nodes; the cluster has 3 */
	TH_EXPECT_RC(ep_join(c, &cfg, EP_JOIN_NOWAIT, &g), EP_EINVAL);
	TH_CHECK(strstr(ep_errmsg(), "spans 4 nodes; the cluster has 3"),
		 "message: %s", ep_errmsg());
	printf("ok: a group wider than the cluster -> %s\n", ep_errmsg());
	cfg = th_group("elsewhere", 4, 2, 2000);
	cfg.ranks_per_node = 2; /* rank 2 lives on node 1 */
	TH_EXPECT_RC(ep_join(c, &cfg, EP_JOIN_NOWAIT, &g), EP_EMISMATCH);
	TH_CHECK(strstr(ep_errmsg(), "rank 2 lives on node 1"), "message: %s",
		 ep_errmsg());
	printf("ok: a rank joining another node's daemon -> %s\n",
	       ep_errmsg());
	ep_close(c);
}

/* The stall cases' group timeout: 400 ms, times EPD_TEST_ALARM_SCALE on
 * an emulated CPU under a sanitizer, where ranks of a healthy setup
 * barrier may be 400 ms apart (the TSan pass in the VM, once). */
#define XSTALL_MS (400u * th_scale())
int xstall_rank(int rank, void *arg)
{
	struct late *s = arg;
	ep_conn_t *c;
	ep_group_t *g = join(s, rank, &c, XSTALL_MS);
	TH_OK(ep_barrier(g));
	ep_handle_t h;
	if (rank >= 2) {
		/* node 1's ranks stall: connected, never dispatching */
		while (s->entered < 2)
			th_sleep_ms(1);
		int rc = ep_dispatch_inplace(g, 0, 0, NULL, &h);
		s->codes[rank] = rc;
		snprintf(s->msgs[rank], sizeof(s->msgs[rank]), "%s",
			 ep_errmsg());
		TH_CHECK(rc < 0, "node 1's rank %d: dispatch on a group that "
			 "failed on node 0 succeeded", rank);
		ep_leave(g);
		ep_close(c);
		return 0;
	}
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	uint16_t *x = b.x;
	for (uint32_t i = 0; i < 4 * 256; i++)
		x[i] = (uint16_t)(0x3f80 + (i & 0x3f));
	for (uint32_t i = 0; i < 4 * 4; i++)
		b.topk_idx[i] = (int64_t)((i * 5 + (uint32_t)rank) % 16);
	uint64_t t0 = th_now_ns();
	int rc = ep_dispatch_inplace(g, 4, 0, NULL, &h);
	uint64_t dt = th_now_ns() - t0;
	TH_EXPECT_RC(rc, EP_ETIMEDOUT);
	TH_CHECK(strstr(ep_errmsg(), "waiting for the other nodes"),
		 "message: %s", ep_errmsg());
	TH_CHECK(dt >= (XSTALL_MS - 50) * 1000000ull &&
			 dt < 5000000000ull * th_scale(),
		 "timed out after %llu ms; the timeout is %u ms",
		 (unsigned long long)(dt / 1000000), XSTALL_MS);
	s->enter[0][rank] = dt;
	__atomic_fetch_add(&s->entered, 1, __ATOMIC_SEQ_CST);
	ep_leave(g);
	ep_close(c);
	return 0;
}

/* A node whose ranks never enter a dispatch: the other node's ranks get
 * EP_ETIMEDOUT after the group's timeout, not a hang, and the stalled
 * node's ranks learn that the group failed. */
void check_remote_stall(void)
{
	struct late *s = late_new(2, 2, "xstall");
	pid_t pids[4];
	th_spawn(pids, 4, xstall_rank, s);
	TH_CHECK(th_wait_all(pids, 4, 60) == 0, "remote stall case");
	printf("ok: node 1 stalls a dispatch -> node 0's ranks get "
	       "EP_ETIMEDOUT after %llu ms (timeout %u); node 1's ranks: %s\n",
	       (unsigned long long)(s->enter[0][0] / 1000000), XSTALL_MS,
	       s->msgs[2]);
}

/* One rank per node (world 2 on 2 nodes): rank 1 stalls 3 s before a
 * dispatch, then a combine. Rank 0 must time out after the group's
 * timeout (nothing armed it when a node's only rank started an op across
 * nodes), with rank 1 named. */
int xstall1_rank(int rank, void *arg)
{
	struct late *s = arg;
	ep_conn_t *c;
	ep_group_t *g = join(s, rank, &c, XSTALL_MS);
	TH_OK(ep_barrier(g));
	ep_handle_t h;
	if (rank == 1) {
		th_sleep_ms(3000 * th_scale());
		TH_CHECK(ep_dispatch_inplace(g, 0, 0, NULL, &h) < 0,
			 "the stalled rank's dispatch succeeded");
		ep_leave(g);
		ep_close(c);
		return 0;
	}
	uint64_t t0 = th_now_ns();
	int rc = ep_dispatch_inplace(g, 0, 0, NULL, &h);
	uint64_t dt = th_now_ns() - t0;
	TH_EXPECT_RC(rc, EP_ETIMEDOUT);
	TH_CHECK(strstr(ep_errmsg(), "ranks never arrived: 1"), "message: %s",
		 ep_errmsg());
	TH_CHECK(dt < 2000000000ull * th_scale(),
		 "timed out after %llu ms; the timeout "
		 "is %u ms", (unsigned long long)(dt / 1000000), XSTALL_MS);
	s->enter[0][0] = dt;
	snprintf(s->msgs[0], sizeof(s->msgs[0]), "%s", ep_errmsg());
	ep_leave(g);
	ep_close(c);
	return 0;
}

void check_remote_stall_one(void)
{
	struct late *s = late_new(2, 1, "xstall1");
	pid_t pids[2];
	th_spawn(pids, 2, xstall1_rank, s);
	TH_CHECK(th_wait_all(pids, 2, 60) == 0, "one-rank stall case");
	printf("ok: one rank per node, the remote one stalls -> EP_ETIMEDOUT "
	       "after %llu ms (timeout %u): %s\n",
	       (unsigned long long)(s->enter[0][0] / 1000000), XSTALL_MS,
	       s->msgs[0]);
}
