/* SPDX-License-Identifier: MIT */
/*
 * Soak across nodes: clusters of 3 and 4 daemons on loopback run one
 * random program of barriers, dispatches (routed anywhere, or only to the
 * experts of the rank's own node, so that the combines after them need no
 * other node and a node can run many ops ahead), cached dispatches and
 * combines, with random lateness per rank and one node late by hundreds
 * of milliseconds in the middle. The same program runs on one daemon with
 * the same world; every rank's outputs of every op must be bitwise equal
 * between the two runs (one node is checked against a reference by the
 * other tests).
 *
 * Handles live as in training: a "forward pass" of 36 dispatches first,
 * every handle kept (more than the 32 the daemon once kept), combines and
 * cached dispatches along any live one, releases at random points (each
 * rank at its own pace: a release is not a collective), and at the end a
 * "backward pass" that combines each live handle in reverse order and
 * releases it. Every third combine also sums top-k weights.
 *
 * EPD_XSOAK_OPS sets the random part's length (default 120 ops).
 */
#include "harness.h"

#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAXN 4
#define RPN 2
#define MAXW (MAXN * RPN)
#define MAXOPS 400
#define MAXLIVE 48
#define FORWARD 36
#define H 256
#define K 4
#define TMAX 24

static struct th_daemon D[MAXN], SOLO;

enum {
	OP_BARRIER,
	OP_DISPATCH,
	OP_DISPATCH_LOCAL,
	OP_CACHED,     /* along live handle pick */
	OP_COMBINE,    /* along the newest */
	OP_COMBINE_OLD, /* along live handle pick */
	OP_RELEASE,    /* of live handle pick */
};

struct soak {
	int nodes, nops;
	uint64_t seed;
	uint8_t prog[MAXOPS];
	uint8_t pick[MAXOPS]; /* which live handle (index) */
	int maxlive;
	char name[32];
	bool solo;
	uint64_t hash[2][MAXW][MAXOPS]; /* [solo, cluster] */
};

static int soak_rank(int r, void *arg)
{
	struct soak *s = arg;
	const uint32_t W = (uint32_t)(s->nodes * RPN), E = W * 4, per = 4;
	struct ep_group_config cfg = {
		.name = s->name, .world_size = W,
		.ranks_per_node = s->solo ? W : RPN, .rank = (uint32_t)r,
		.num_experts = E, .hidden = H, .max_tokens_per_rank = TMAX,
		.topk = K, .dtype = EP_DTYPE_BF16, .timeout_ms = 30000};
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(s->solo ? SOLO.sock : D[r / RPN].sock, &c));
	TH_OK(ep_join(c, &cfg, 0, &g));
	const uint64_t cap = (uint64_t)W * TMAX;
	uint16_t *x = malloc((size_t)TMAX * H * 2);
	int64_t *topk = malloc((size_t)TMAX * K * 8);
	float *wts = malloc((size_t)TMAX * K * 4);
	uint16_t *y = malloc(cap * H * 2), *out = malloc((size_t)TMAX * H * 2);
	float *cwin = malloc(cap * K * 4), *cwout = malloc((size_t)TMAX * K * 4);
	struct ep_dispatch_out dout = {
		.capacity = cap, .recv_x = malloc(cap * H * 2),
		.recv_topk_idx = malloc(cap * K * 8),
		.recv_topk_weights = malloc(cap * K * 4),
		.num_recv_tokens_per_expert = malloc(per * 4)};
	ep_handle_t h = {0}, hs[MAXLIVE];
	int nlive = 0;
	uint32_t T = 0;
	uint64_t lat = s->seed * 31 + (uint64_t)r; /* this rank's lateness */
	const int late_node = (int)(s->seed % (uint64_t)s->nodes);
	for (int i = 0; i < s->nops; i++) {
		/* lateness: often a little, and one node once a lot */
		if (!s->solo) {
			if (th_rnd(&lat) % 4 == 0)
				th_sleep_ms(th_rnd(&lat) % 15);
			if (i == s->nops / 2 && r / RPN == late_node)
				th_sleep_ms(400);
		}
		uint64_t gen = s->seed ^ ((uint64_t)i << 20) ^ (uint64_t)r;
		uint64_t hsh = TH_FNV0;
		int op = s->prog[i];
		if (op == OP_CACHED || op == OP_COMBINE_OLD)
			h = hs[s->pick[i]];
		else if (op == OP_COMBINE)
			h = hs[nlive - 1];
		if (op == OP_CACHED)
			T = h.num_tokens;
		if (op == OP_BARRIER) {
			TH_OK(ep_barrier(g));
		} else if (op == OP_RELEASE) {
			int j = s->pick[i];
			TH_OK(ep_handle_release(g, &hs[j]));
			memmove(&hs[j], &hs[j + 1],
				(size_t)(nlive - j - 1) * sizeof(hs[0]));
			nlive--;
		} else if (op == OP_DISPATCH || op == OP_DISPATCH_LOCAL ||
			   op == OP_CACHED) {
			bool cached = op == OP_CACHED;
			if (!cached)
				T = th_rnd(&gen) % (TMAX + 1);
			for (uint32_t t = 0; t < T * H; t++)
				x[t] = (uint16_t)(0x3c00 + th_rnd(&gen) % 0x800);
			uint32_t node = (uint32_t)r / RPN;
			for (uint32_t t = 0; t < T * K; t++) {
				int64_t e = (int64_t)(th_rnd(&gen) % (E + 1)) - 1;
				if (op == OP_DISPATCH_LOCAL && e >= 0)
					/* an expert of a rank on this node */
					e = (int64_t)(node * RPN * per +
						      (uint64_t)e % (RPN * per));
				topk[t] = e;
				wts[t] = (float)(th_rnd(&gen) % 1000) / 1000.0f;
			}
			struct ep_dispatch_in din = {
				.num_tokens = T, .hidden = H,
				.dtype = EP_DTYPE_BF16, .topk = K, .x = x,
				.topk_idx = topk, .topk_weights = wts};
			ep_handle_t nh;
			TH_OK(ep_dispatch(g, &din, cached ? &h : NULL, &dout,
					  &nh));
			if (!cached) {
				if (nlive == MAXLIVE) { /* the oldest goes */
					TH_OK(ep_handle_release(g, &hs[0]));
					memmove(&hs[0], &hs[1],
						(MAXLIVE - 1) * sizeof(hs[0]));
					nlive--;
				}
				hs[nlive++] = h = nh;
			}
			uint32_t R = dout.num_recv;
			hsh = th_fnv(hsh, &R, 4);
			hsh = th_fnv(hsh, dout.recv_x, (size_t)R * H * 2);
			if (!cached) {
				hsh = th_fnv(hsh, dout.recv_topk_idx,
					  (size_t)R * K * 8);
				hsh = th_fnv(hsh, dout.recv_topk_weights,
					  (size_t)R * K * 4);
				hsh = th_fnv(hsh, dout.num_recv_tokens_per_expert,
					  per * 4);
			}
		} else {
			for (uint64_t t = 0; t < (uint64_t)h.num_recv * H; t++)
				y[t] = (uint16_t)(0x3c00 + th_rnd(&gen) % 0x800);
			/* every third op also sums top-k weights (the same on
			 * every rank: the op number decides) */
			bool w = i % 3 == 0;
			for (uint64_t t = 0; w && t < (uint64_t)h.num_recv * K;
			     t++)
				cwin[t] = (float)((int)(th_rnd(&gen) % 2001) - 1000) /
					  (float)(1 + th_rnd(&gen) % 89);
			struct ep_combine_in cin = {
				.y = y, .num_rows = h.num_recv, .hidden = H,
				.topk_weights = w ? cwin : NULL};
			struct ep_combine_out co = {
				.out = out, .combined_topk_weights = w ? cwout : NULL};
			TH_OK(ep_combine_ex(g, &h, &cin, &co));
			hsh = th_fnv(hsh, out, (size_t)h.num_tokens * H * 2);
			if (w)
				hsh = th_fnv(hsh, cwout, (size_t)h.num_tokens * K * 4);
		}
		s->hash[s->solo ? 0 : 1][r][i] = hsh;
	}
	TH_CHECK(nlive == 0, "rank %d: %d handles left", r, nlive);
	TH_OK(ep_barrier(g));
	if (!s->solo && r % RPN == 0) {
		/* every node's daemon holds none of the group's routings */
		char *js;
		TH_OK(ep_daemon_status(c, &js));
		const char *p = strstr(js, s->name);
		const char *hp = p ? strstr(p, "\"handles\"") : NULL;
		const char *n = hp ? strstr(hp, "\"held\"") : NULL;
		TH_CHECK(n, "no handle count in the status");
		n += 6;
		while (*n == ':' || *n == ' ')
			n++;
		TH_CHECK(*n == '0', "node %d still holds handles: %.40s",
			 r / RPN, n);
		free(js);
	}
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

static void run(struct soak *s, bool solo)
{
	const int W = s->nodes * RPN;
	s->solo = solo;
	snprintf(s->name, sizeof(s->name), "soak%d%s", s->nodes,
		 solo ? "solo" : "");
	pid_t pids[MAXW];
	th_spawn(pids, W, soak_rank, s);
	TH_CHECK(th_wait_all(pids, W, 240) == 0, "%s failed (seed %llu)",
		 s->name, (unsigned long long)s->seed);
}

static void soak(int nodes, uint64_t seed, int nops)
{
	struct soak *s = th_shared(sizeof(*s));
	s->nodes = nodes;
	s->seed = seed;
	s->nops = nops;
	/* the program: a forward pass of dispatches; then combines of the
	 * newest handle, combines and cached dispatches of any live one,
	 * releases, runs of combines after local dispatches; then the
	 * backward pass. live mirrors the ranks' count of live handles. */
	uint64_t p = seed;
	int i = 0, ahead = 0, live = 0, maxlive = 0;
#define FRESH(kind)                                                            \
	do {                                                                   \
		s->prog[i++] = (kind);                                         \
		live += live < MAXLIVE;                                        \
		maxlive = live > maxlive ? live : maxlive;                     \
	} while (0)
	for (int f = 0; f < FORWARD; f++)
		FRESH(th_rnd(&p) % 3 ? OP_DISPATCH : OP_DISPATCH_LOCAL);
	const int body = FORWARD + nops;
	while (i < body) {
		uint32_t k = th_rnd(&p) % 20;
		if (k < 3) {
			s->prog[i++] = OP_BARRIER;
		} else if (k < 7) {
			FRESH(OP_DISPATCH);
		} else if (k < 10) {
			/* local routing, then a run of independent combines */
			FRESH(OP_DISPATCH_LOCAL);
			for (int n = 0; n < 6 && i < body; n++, ahead++)
				s->prog[i++] = OP_COMBINE;
		} else if (k < 13) {
			s->pick[i] = (uint8_t)(th_rnd(&p) % (uint32_t)live);
			s->prog[i++] = OP_CACHED;
		} else if (k < 16) {
			s->pick[i] = (uint8_t)(th_rnd(&p) % (uint32_t)live);
			s->prog[i++] = OP_COMBINE_OLD;
		} else if (k < 18 && live > 1) {
			s->pick[i] = (uint8_t)(th_rnd(&p) % (uint32_t)live);
			s->prog[i++] = OP_RELEASE;
			live--;
		} else {
			s->prog[i++] = OP_COMBINE;
		}
	}
	/* backward: newest first, each combined then released */
	for (; live > 0; live--) {
		s->pick[i] = (uint8_t)(live - 1);
		s->prog[i++] = OP_COMBINE_OLD;
		s->pick[i] = (uint8_t)(live - 1);
		s->prog[i++] = OP_RELEASE;
	}
	s->nops = i;
	s->maxlive = maxlive;
	TH_CHECK(maxlive > 32, "the program keeps only %d handles", maxlive);
	run(s, true);
	run(s, false);
	const int W = nodes * RPN;
	for (int r = 0; r < W; r++)
		for (int j = 0; j < s->nops; j++)
			TH_CHECK(s->hash[0][r][j] == s->hash[1][r][j],
				 "%d nodes, seed %llu: rank %d op %d (type %d) "
				 "differs from one node",
				 nodes, (unsigned long long)seed, r, j,
				 s->prog[j]);
	printf("ok: %d nodes x %d ranks, %d ops (%d combines after local "
	       "routings, up to %d handles alive, released at random and in "
	       "a backward pass), random lateness, one node 400 ms late: "
	       "bitwise equal to one node (seed %llu)\n",
	       nodes, RPN, s->nops, ahead, s->maxlive,
	       (unsigned long long)seed);
}

int main(void)
{
	th_init("test_xsoak", 600);
	int nops = 120;
	const char *e = getenv("EPD_XSOAK_OPS");
	if (e && atoi(e) > 0 && atoi(e) <= MAXOPS - FORWARD - 2 * MAXLIVE)
		nops = atoi(e);
	uint64_t seed = (uint64_t)time(NULL) ^ (uint64_t)getpid();
	th_daemon_start(&SOLO, NULL);
	for (int nodes = 3; nodes <= 4; nodes++) {
		th_cluster_start(D, nodes, "epdxsoak", NULL);
		soak(nodes, seed + (uint64_t)nodes, nops);
		for (int i = 0; i < nodes; i++)
			th_daemon_stop(&D[i]);
	}
	th_daemon_stop(&SOLO);
	printf("ok\n");
	return 0;
}
