/* SPDX-License-Identifier: MIT */
/*
 * Jobs on any nodes of a cluster. EPD_TEST_NODES daemons (32 by default)
 * on loopback; a group names its nodes at join (ep_join_nodes), each rank
 * learning its daemon's name from its connection (ep_conn_node), as a
 * job's rendezvous would gather them.
 *
 * 1. Four jobs at once, each on a random subset of 2-4 nodes in random
 *    order (subsets may overlap), run barriers, dispatches, cached
 *    dispatches and combines: every output bitwise equal to the same job
 *    on one daemon.
 * 2. Two jobs on disjoint nodes: killing a node that is in neither leaves
 *    both untouched; killing a node of one fails that one alone, with
 *    EP_EPEERLOST naming the node, while the other runs on.
 * 3. Joins that name their nodes wrongly get a precise error: an unknown
 *    node, a node twice, this daemon at another node's place, ranks whose
 *    lists differ.
 *
 * With EPD_TEST_LOOKUP=job every daemon's peers name only itself
 * (peer_lookup = job): jobs name their nodes as name@host:port, the
 * daemons learn each other from the jobs' lists and from being dialled,
 * and every phase runs the same; the unknown node is one that never
 * answers (its join's timeout names it).
 */
#include "harness.h"

#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define RPN 2
#define MAXJN 9 /* nodes of a job */
#define JOBN 4  /* of the random jobs: 2..JOBN nodes */
#define MAXW (MAXJN * RPN)
#define NJOBS 4
#define H 256
#define K 4
#define TMAX 16
#define ROUNDS 6
#define NOPS (ROUNDS * 4)

static struct th_daemon *D, SOLO;
static int N;
/* node i as a job names it: "ni", or "ni@127.0.0.1:port" where the
 * daemons learn their nodes from the jobs (EPD_TEST_LOOKUP=job) */
static bool JOBMODE;
static char ENT[TH_MAX_NODES][48];
#define E_(i) ((const char *)ENT[i])

struct job {
	char name[32];
	int nnodes;
	int node[MAXJN]; /* the daemons of node index 0.., in order */
	uint64_t seed;
	bool solo;
	uint64_t hash[2][MAXW][NOPS];
};

struct shared {
	struct job job[NJOBS];
	/* the wide job's barrier stamps: [late][rank] */
	uint64_t enter[4][MAXW], leave[4][MAXW];
	/* phase 2 */
	volatile int joined, done, stage;
	int victim; /* the daemon killed at stage 2 */
};

static struct shared *S;

/* Connect rank r of job j to its daemon and join, naming the job's nodes
 * by the names their connections report. */
static ep_group_t *job_join(struct job *j, int r, ep_conn_t **c)
{
	const uint32_t W = (uint32_t)(j->nnodes * RPN);
	struct ep_group_config cfg = {
		.name = j->name, .world_size = W,
		.ranks_per_node = j->solo ? W : RPN, .rank = (uint32_t)r,
		.num_experts = W * 4, .hidden = H, .max_tokens_per_rank = TMAX,
		.topk = K, .dtype = EP_DTYPE_BF16, .timeout_ms = 20000};
	const struct th_daemon *d = j->solo ? &SOLO : &D[j->node[r / RPN]];
	TH_OK(ep_connect(d->sock, c));
	ep_group_t *g;
	if (j->solo) {
		TH_OK(ep_join(*c, &cfg, 0, &g));
		return g;
	}
	/* the rendezvous: rank r's daemon says its name; the job's list
	 * holds the names of node 0, 1, ... */
	char want[16];
	snprintf(want, sizeof(want), "n%d", j->node[r / RPN]);
	TH_CHECK(!strcmp(ep_conn_node(*c), want),
		 "the daemon of rank %d says it is '%s', not %s", r,
		 ep_conn_node(*c), want);
	const char *list[MAXJN];
	for (int n = 0; n < j->nnodes; n++)
		list[n] = E_(j->node[n]);
	TH_OK(ep_join_nodes(*c, &cfg, list, 0, &g));
	return g;
}

/* One round: barrier, dispatch, cached dispatch, combine (with weights
 * every other round); each output hashed into hash[op]. */
static void job_round(struct job *j, ep_group_t *g, int r, int round,
		      uint64_t *hash)
{
	const uint32_t W = (uint32_t)(j->nnodes * RPN), E = W * 4;
	const uint64_t cap = (uint64_t)W * TMAX;
	static uint16_t x[TMAX * H], out[TMAX * H];
	static int64_t topk[TMAX * K];
	static float wts[TMAX * K], cwout[TMAX * K];
	uint16_t *y = malloc(cap * H * 2);
	float *cwin = malloc(cap * K * 4);
	struct ep_dispatch_out dout = {
		.capacity = cap, .recv_x = malloc(cap * H * 2),
		.recv_topk_idx = malloc(cap * K * 8),
		.recv_topk_weights = malloc(cap * K * 4),
		.num_recv_tokens_per_expert = malloc(4 * 4)};
	TH_CHECK(y && cwin && dout.recv_x && dout.recv_topk_idx &&
			 dout.recv_topk_weights &&
			 dout.num_recv_tokens_per_expert,
		 "out of memory");
	uint64_t gen = j->seed ^ ((uint64_t)round << 24) ^ (uint64_t)r;
	TH_OK(ep_barrier(g));
	hash[0] = 1;
	const uint32_t T = th_rnd(&gen) % (TMAX + 1);
	ep_handle_t h;
	for (int pass = 0; pass < 2; pass++) {
		for (uint32_t t = 0; t < T * H; t++)
			x[t] = (uint16_t)(0x3c00 + th_rnd(&gen) % 0x800);
		for (uint32_t t = 0; pass == 0 && t < T * K; t++) {
			topk[t] = (int64_t)(th_rnd(&gen) % (E + 1)) - 1;
			wts[t] = (float)(th_rnd(&gen) % 1000) / 1000.0f;
		}
		struct ep_dispatch_in din = {
			.num_tokens = T, .hidden = H, .dtype = EP_DTYPE_BF16,
			.topk = K, .x = x, .topk_idx = topk,
			.topk_weights = wts};
		ep_handle_t nh;
		TH_OK(ep_dispatch(g, &din, pass ? &h : NULL, &dout, &nh));
		if (!pass)
			h = nh;
		uint64_t hs = TH_FNV0;
		const uint32_t R = dout.num_recv;
		hs = th_fnv(hs, &R, 4);
		hs = th_fnv(hs, dout.recv_x, (size_t)R * H * 2);
		if (!pass) {
			hs = th_fnv(hs, dout.recv_topk_idx, (size_t)R * K * 8);
			hs = th_fnv(hs, dout.recv_topk_weights,
				 (size_t)R * K * 4);
			hs = th_fnv(hs, dout.num_recv_tokens_per_expert, 16);
		}
		hash[1 + pass] = hs;
	}
	for (uint64_t t = 0; t < (uint64_t)h.num_recv * H; t++)
		y[t] = (uint16_t)(0x3c00 + th_rnd(&gen) % 0x800);
	const bool w = round % 2;
	for (uint64_t t = 0; w && t < (uint64_t)h.num_recv * K; t++)
		cwin[t] = (float)((int)(th_rnd(&gen) % 2001) - 1000) / 7.0f;
	struct ep_combine_in cin = {.y = y, .num_rows = h.num_recv,
				    .hidden = H,
				    .topk_weights = w ? cwin : NULL};
	struct ep_combine_out co = {.out = out,
				    .combined_topk_weights = w ? cwout : NULL};
	TH_OK(ep_combine_ex(g, &h, &cin, &co));
	uint64_t hs = th_fnv(TH_FNV0, out, (size_t)T * H * 2);
	if (w)
		hs = th_fnv(hs, cwout, (size_t)T * K * 4);
	hash[3] = hs;
	TH_OK(ep_handle_release(g, &h));
	free(y);
	free(cwin);
	free(dout.recv_x);
	free(dout.recv_topk_idx);
	free(dout.recv_topk_weights);
	free(dout.num_recv_tokens_per_expert);
}

/* Phase 1: rank i of all jobs' ranks together. */
static int place_rank(int i, void *arg)
{
	(void)arg;
	int jn = 0;
	while (i >= S->job[jn].nnodes * RPN)
		i -= S->job[jn++].nnodes * RPN;
	struct job *j = &S->job[jn];
	ep_conn_t *c;
	ep_group_t *g = job_join(j, i, &c);
	for (int k = 0; k < ROUNDS; k++)
		job_round(j, g, i, k, &j->hash[j->solo][i][k * 4]);
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

static int world_of(bool solo)
{
	int w = 0;
	for (int k = 0; k < NJOBS; k++) {
		S->job[k].solo = solo;
		w += S->job[k].nnodes * RPN;
	}
	return w;
}

static void phase_jobs(uint64_t seed)
{
	uint64_t s = seed;
	char where[512];
	size_t off = 0;
	for (int k = 0; k < NJOBS; k++) {
		struct job *j = &S->job[k];
		snprintf(j->name, sizeof(j->name), "place%d", k);
		j->seed = seed * 977 + (uint64_t)k;
		j->nnodes = 2 + (int)(th_rnd(&s) % (JOBN - 1));
		/* distinct nodes in random order; the last job takes the
		 * cluster's last nodes, backwards (never the first entries
		 * of peers in order) */
		for (int n = 0; n < j->nnodes; n++) {
			bool again;
			do {
				j->node[n] = k == NJOBS - 1
						     ? N - 1 - n
						     : (int)(th_rnd(&s) % (uint32_t)N);
				again = false;
				for (int o = 0; o < n; o++)
					again |= j->node[o] == j->node[n];
			} while (again);
		}
		off += (size_t)snprintf(where + off, sizeof(where) - off,
					"%s%s on", k ? "; " : "", j->name);
		for (int n = 0; n < j->nnodes; n++)
			off += (size_t)snprintf(where + off,
						sizeof(where) - off, " n%d",
						j->node[n]);
	}
	for (int solo = 1; solo >= 0; solo--) {
		const int w = world_of(solo);
		pid_t *pids = calloc((size_t)w, sizeof(*pids));
		TH_CHECK(pids, "out of memory");
		th_spawn(pids, w, place_rank, NULL);
		TH_CHECK(th_wait_all(pids, w, 300) == 0,
			 "%s run failed (seed %llu; %s)",
			 solo ? "one-node" : "cluster",
			 (unsigned long long)seed, where);
		free(pids);
	}
	for (int k = 0; k < NJOBS; k++) {
		struct job *j = &S->job[k];
		for (int r = 0; r < j->nnodes * RPN; r++)
			for (int op = 0; op < NOPS; op++)
				TH_CHECK(j->hash[0][r][op] == j->hash[1][r][op],
					 "%s rank %d op %d differs from one "
					 "node (seed %llu; %s)",
					 j->name, r, op,
					 (unsigned long long)seed, where);
	}
	printf("ok: %d jobs at once on %d daemons (%s): barrier, dispatch, "
	       "cached dispatch, combine bitwise equal to one node (seed "
	       "%llu)\n",
	       NJOBS, N, where, (unsigned long long)seed);
}

/* Phase 2: job 0 (A) and job 1 (B) on disjoint nodes. */
static int kill_rank(int i, void *arg)
{
	(void)arg;
	const int jn = i >= S->job[0].nnodes * RPN;
	if (jn)
		i -= S->job[0].nnodes * RPN;
	struct job *j = &S->job[jn];
	ep_conn_t *c;
	ep_group_t *g = job_join(j, i, &c);
	uint64_t hash[4];
	job_round(j, g, i, 0, hash);
	__sync_fetch_and_add(&S->joined, 1);
	while (S->stage < 1)
		th_sleep_ms(5);
	/* a node in no job was killed: nothing changes */
	job_round(j, g, i, 1, hash);
	__sync_fetch_and_add(&S->done, 1);
	while (S->stage < 2)
		th_sleep_ms(5);
	char victim[16];
	snprintf(victim, sizeof(victim), "n%d", S->victim);
	if (jn == 1) { /* B: untouched */
		for (int k = 2; k < 4; k++)
			job_round(j, g, i, k, hash);
		TH_OK(ep_leave(g));
		ep_close(c);
		return 0;
	}
	if (j->node[i / RPN] == S->victim)
		return 0; /* its daemon is gone */
	int rc = ep_barrier(g);
	TH_EXPECT_RC(rc, EP_EPEERLOST);
	TH_CHECK(strstr(ep_errmsg(), victim), "the error does not name %s: %s",
		 victim, ep_errmsg());
	ep_leave(g);
	ep_close(c);
	return 0;
}

static void kill_daemon(int n)
{
	kill(D[n].pid, SIGKILL);
	th_reap(D[n].pid, 10);
	D[n].pid = 0;
}

static void phase_kill(uint64_t seed)
{
	/* A on nodes 1,3,5..., B on 2,4,...; node 0 in neither */
	uint64_t s = seed ^ 0x5eed;
	memset(S, 0, sizeof(*S));
	for (int k = 0; k < 2; k++) {
		struct job *j = &S->job[k];
		snprintf(j->name, sizeof(j->name), "kill%c", 'A' + k);
		j->seed = seed + (uint64_t)k;
		j->nnodes = 2 + (int)(th_rnd(&s) % (JOBN - 1));
		for (int n = 0; n < j->nnodes; n++)
			j->node[n] = 1 + k + 2 * n;
		/* reversed order for one of them */
		for (int n = 0; k && n < j->nnodes / 2; n++) {
			int t = j->node[n];
			j->node[n] = j->node[j->nnodes - 1 - n];
			j->node[j->nnodes - 1 - n] = t;
		}
	}
	const int w = (S->job[0].nnodes + S->job[1].nnodes) * RPN;
	pid_t pids[2 * MAXW];
	th_spawn(pids, w, kill_rank, NULL);
	for (int t = 0; S->joined < w; t++) {
		TH_CHECK(t < 6000, "the ranks never joined");
		th_sleep_ms(5);
	}
	kill_daemon(0);
	S->stage = 1;
	for (int t = 0; S->done < w; t++) {
		TH_CHECK(t < 6000, "a job stopped when a node in no job died");
		th_sleep_ms(5);
	}
	S->victim = S->job[0].node[1];
	kill_daemon(S->victim);
	S->stage = 2;
	TH_CHECK(th_wait_all(pids, w, 120) == 0, "the kill phase failed");
	printf("ok: node n0 (in no job) killed: jobs %s and %s untouched; "
	       "node n%d of %s killed: %s failed with EP_EPEERLOST naming "
	       "it, %s ran on\n",
	       S->job[0].name, S->job[1].name, S->victim, S->job[0].name,
	       S->job[0].name, S->job[1].name);
}

/* A job across nodes n2, n1 (that order) receiving at most 24 rows a
 * rank: a dispatch of every token to rank 0 fails on every rank of both
 * nodes at once; one within the capacity then runs. */
static int recvcap_rank(int r, void *arg)
{
	(void)arg;
	const uint32_t W = 4, T = 8;
	struct ep_group_config cfg = {
		.name = "recvcap", .world_size = W, .ranks_per_node = RPN,
		.rank = (uint32_t)r, .num_experts = W * 4, .hidden = H,
		.max_tokens_per_rank = T, .topk = K, .dtype = EP_DTYPE_BF16,
		.timeout_ms = 20000};
	const char *nodes[] = {E_(2), E_(1)};
	const struct ep_join_opts o = {.size = sizeof(o), .nodes = nodes,
				       .recv_rows = 24};
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(D[r < RPN ? 2 : 1].sock, &c));
	TH_OK(ep_join_ex(c, &cfg, &o, 0, &g));
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	TH_CHECK(b.max_recv == 24, "max_recv %llu",
		 (unsigned long long)b.max_recv);
	uint16_t *x = b.x;
	for (uint32_t i = 0; i < T * H; i++)
		x[i] = (uint16_t)(0x3c00 + i % 512);
	for (uint32_t i = 0; i < T * K; i++)
		b.topk_idx[i] = i % K ? -1 : 1; /* expert 1: rank 0 */
	ep_handle_t h;
	const uint64_t t0 = th_now_ns();
	TH_EXPECT_RC(ep_dispatch_inplace(g, T, 0, NULL, &h), EP_ETOOBIG);
	TH_CHECK(strstr(ep_errmsg(), "rank 0 would receive 32 rows"), "%s",
		 ep_errmsg());
	TH_CHECK(th_now_ns() - t0 < 10000000000ull, "it took the timeout");
	for (uint32_t i = 0; i < T * K; i++)
		b.topk_idx[i] = i % K ? -1 : (int64_t)((i / K) % 16);
	TH_OK(ep_dispatch_inplace(g, T, 0, NULL, &h));
	TH_CHECK(h.num_recv <= 24, "%u rows", h.num_recv);
	TH_OK(ep_combine_inplace(g, &h, 0));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

/* Ranks of node n4 run barrier, dispatch; ranks of node n5 barrier,
 * barrier: every rank gets EP_EMISMATCH at once, naming the barrier and
 * the data op, not a timeout about ranks that "never arrived". */
struct order {
	int code[4];
	char msg[4][320];
	uint64_t ms[4];
};

static int order_rank(int r, void *arg)
{
	struct order *o = arg;
	struct ep_group_config cfg = {
		.name = "order", .world_size = 4, .ranks_per_node = RPN,
		.rank = (uint32_t)r, .num_experts = 16, .hidden = H,
		.max_tokens_per_rank = 4, .topk = K, .dtype = EP_DTYPE_BF16,
		.timeout_ms = 20000};
	const char *nodes[] = {E_(4), E_(5)};
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(D[r < RPN ? 4 : 5].sock, &c));
	TH_OK(ep_join_nodes(c, &cfg, nodes, 0, &g));
	TH_OK(ep_barrier(g));
	const uint64_t t0 = th_now_ns();
	if (r < RPN) {
		ep_handle_t h;
		o->code[r] = ep_dispatch_inplace(g, 0, 0, NULL, &h);
	} else {
		o->code[r] = ep_barrier(g);
	}
	o->ms[r] = (th_now_ns() - t0) / 1000000;
	snprintf(o->msg[r], sizeof(o->msg[r]), "%s", ep_errmsg());
	ep_close(c);
	return 0;
}

/* Peers up in daemon d's status. */
static int peers_up(int d)
{
	ep_conn_t *c;
	char *js;
	TH_OK(ep_connect(D[d].sock, &c));
	TH_OK(ep_daemon_status(c, &js));
	ep_close(c);
	int up = 0;
	for (const char *p = js; (p = strstr(p, "\"state\":\"up\"")); p++)
		up++;
	free(js);
	return up;
}

/* Connections on demand: a daemon holds connections to the nodes its
 * groups span, and none once they are gone (after the linger): its
 * descriptors do not grow with the cluster. */
static void phase_idle(const int *fds0)
{
	for (int t = 0;; t++) {
		int up = 0;
		for (int i = 0; i < N; i++)
			up += peers_up(i);
		if (!up)
			break;
		TH_CHECK(t < 500, "%d connections still up after the linger",
			 up);
		th_sleep_ms(20);
	}
	for (int i = 0; i < N; i++)
		for (int t = 0;; t++) {
			/* a closed connection's descriptor goes on the
			 * loop's next turn */
			int f = th_fds(D[i].pid);
			if (f == fds0[i])
				break;
			TH_CHECK(t < 200,
				 "daemon n%d holds %d descriptors idle, %d "
				 "before the jobs",
				 i, f, fds0[i]);
			th_sleep_ms(10);
		}
	printf("ok: connections on demand: no daemon of %d holds a peer "
	       "connection once its jobs are gone (linger 300 ms); each "
	       "holds %d descriptors idle, as before any job\n",
	       N, fds0[0]);
}

/* A job of 9 nodes (more than EPP_DISSEM_NODES: its barriers'
 * rail phase is a dissemination barrier) on random nodes: a rank late
 * into a barrier, one of each of four, holds every other rank in it (no
 * rank leaves early, the diagonal ones included), and its ops are
 * bitwise equal to one node. */
static const int late_of[4] = {0, 5, 12, 17};

static int wide_rank(int r, void *arg)
{
	(void)arg;
	struct job *j = &S->job[0];
	ep_conn_t *c;
	ep_group_t *g = job_join(j, r, &c);
	for (int k = 0; k < 4 && !j->solo; k++) {
		TH_OK(ep_barrier(g));
		if (r == late_of[k])
			th_sleep_ms(150);
		S->enter[k][r] = th_now_ns();
		TH_OK(ep_barrier(g));
		S->leave[k][r] = th_now_ns();
	}
	for (int k = 0; k < 2; k++)
		job_round(j, g, r, k, &j->hash[j->solo][r][k * 4]);
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

static void phase_wide(uint64_t seed)
{
	uint64_t s = seed ^ 0x91de;
	memset(S, 0, sizeof(*S));
	struct job *j = &S->job[0];
	snprintf(j->name, sizeof(j->name), "wide");
	j->seed = seed;
	j->nnodes = MAXJN;
	for (int n = 0; n < j->nnodes; n++) {
		bool again;
		do {
			j->node[n] = (int)(th_rnd(&s) % (uint32_t)N);
			again = false;
			for (int o = 0; o < n; o++)
				again |= j->node[o] == j->node[n];
		} while (again);
	}
	const int w = MAXJN * RPN;
	for (int solo = 1; solo >= 0; solo--) {
		j->solo = solo;
		pid_t pids[MAXW];
		th_spawn(pids, w, wide_rank, NULL);
		TH_CHECK(th_wait_all(pids, w, 120) == 0, "the wide job (%s)",
			 solo ? "one node" : "cluster");
	}
	for (int k = 0; k < 4; k++)
		for (int r = 0; r < w; r++)
			TH_CHECK(S->leave[k][r] >= S->enter[k][late_of[k]],
				 "rank %d left barrier %d before late rank %d "
				 "entered it",
				 r, k, late_of[k]);
	for (int r = 0; r < w; r++)
		for (int op = 0; op < 8; op++)
			TH_CHECK(j->hash[0][r][op] == j->hash[1][r][op],
				 "wide job rank %d op %d differs from one node",
				 r, op);
	printf("ok: a job of %d nodes x %d ranks (a dissemination barrier): "
	       "a late rank of 4 holds every rank in the barrier; ops "
	       "bitwise equal to one node\n",
	       MAXJN, RPN);
}

/* Jobs come and go on the same nodes, each rank joining at a random
 * moment around the connections' linger (300 ms): a dialler closing an
 * unused connection must never fail the next job's group that the other
 * end formed on it meanwhile (the close is agreed, PEER_BYE; found by
 * bench_cluster at 32 nodes on 16 cores). */
static int churn_rank(int r, void *arg)
{
	const int round = *(const int *)arg;
	struct job *j = &S->job[0];
	uint64_t gen = j->seed ^ ((uint64_t)round << 8) ^ (uint64_t)r;
	th_sleep_ms(200 + th_rnd(&gen) % 250);
	ep_conn_t *c;
	ep_group_t *g = job_join(j, r, &c);
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

static void phase_churn(uint64_t seed)
{
	memset(S, 0, sizeof(*S));
	struct job *j = &S->job[0];
	j->nnodes = 3;
	j->seed = seed;
	for (int round = 0; round < 12; round++) {
		snprintf(j->name, sizeof(j->name), "churn%d", round);
		uint64_t s = seed + (uint64_t)round;
		for (int n = 0; n < 3; n++) /* nodes 1..4, any order */
			do {
				j->node[n] = 1 + (int)(th_rnd(&s) % 4);
			} while ((n > 0 && j->node[n] == j->node[0]) ||
				 (n > 1 && j->node[n] == j->node[1]));
		pid_t pids[3 * RPN];
		th_spawn(pids, 3 * RPN, churn_rank, &round);
		TH_CHECK(th_wait_all(pids, 3 * RPN, 60) == 0,
			 "churn round %d failed (seed %llu)", round,
			 (unsigned long long)seed);
	}
	printf("ok: 12 jobs one after the other on nodes n1-n4, joining "
	       "around the connections' linger: no job lost a node\n");
}

/* Joins that name their nodes wrongly. */
static void expect_join(int daemon, const char *name, uint32_t world,
			uint32_t rank, const char *const *list, int want,
			const char *msg)
{
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(D[daemon].sock, &c));
	struct ep_group_config cfg = {
		.name = name, .world_size = world, .ranks_per_node = 1,
		.rank = rank, .num_experts = world * 4, .hidden = H,
		.max_tokens_per_rank = TMAX, .topk = K,
		.dtype = EP_DTYPE_BF16, .timeout_ms = 3000};
	TH_EXPECT_RC(ep_join_nodes(c, &cfg, list, EP_JOIN_NOWAIT, &g), want);
	TH_CHECK(strstr(ep_errmsg(), msg), "want '%s' in: %s", msg,
		 ep_errmsg());
	ep_close(c);
}

static void phase_bad(void)
{
	if (!JOBMODE) {
		const char *unknown[] = {"n1", "nowhere"};
		expect_join(1, "bad1", 2, 0, unknown, EP_EINVAL,
			    "names node nowhere: this daemon does not know "
			    "it (not in its peers");
		/* an address from a job, where peer_lookup is peers */
		const char *addr[] = {"n1", "nowhere@127.0.0.1:9"};
		expect_join(1, "bad1a", 2, 0, addr, EP_EINVAL,
			    "not in its peers");
	} else {
		/* a node the job names that never answers: the join's
		 * timeout names it */
		ep_conn_t *c;
		ep_group_t *g;
		TH_OK(ep_connect(D[1].sock, &c));
		struct ep_group_config cfg = {
			.name = "bad1", .world_size = 2, .ranks_per_node = 1,
			.rank = 0, .num_experts = 8, .hidden = H,
			.max_tokens_per_rank = TMAX, .topk = K,
			.dtype = EP_DTYPE_BF16, .timeout_ms = 2000};
		const char *gone[] = {E_(1), "nowhere@127.0.0.1:9"};
		TH_EXPECT_RC(ep_join_nodes(c, &cfg, gone, 0, &g),
			     EP_ETIMEDOUT);
		TH_CHECK(strstr(ep_errmsg(), "nowhere"), "%s", ep_errmsg());
		ep_close(c);
		/* an entry that is no name@host:port */
		const char *bad[] = {E_(1), "n2@127.0.0.1:99999"};
		expect_join(1, "bad1a", 2, 0, bad, EP_EINVAL,
			    "or name@host:port");
	}
	const char *twice[] = {E_(1), E_(1)};
	expect_join(1, "bad2", 2, 1, twice, EP_EMISMATCH,
		    "names this node (n1) as node 0, but rank 1 is on node 1");
	const char *twice2[] = {E_(1), E_(2), E_(1)};
	expect_join(1, "bad3", 3, 0, twice2, EP_EINVAL, "names node n1 twice");
	const char *other[] = {E_(2), E_(1)};
	expect_join(1, "bad4", 2, 0, other, EP_EMISMATCH,
		    "names n2 as node 0, where rank 0 lives; this daemon is "
		    "n1");
	/* two ranks of one node, lists that differ */
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(D[1].sock, &c));
	struct ep_group_config cfg = {
		.name = "bad6", .world_size = 4, .ranks_per_node = 2,
		.rank = 0, .num_experts = 16, .hidden = H,
		.max_tokens_per_rank = TMAX, .topk = K,
		.dtype = EP_DTYPE_BF16, .timeout_ms = 3000};
	const char *l1[] = {E_(1), E_(2)}, *l2[] = {E_(1), E_(3)};
	TH_OK(ep_join_nodes(c, &cfg, l1, EP_JOIN_NOWAIT, &g));
	cfg.rank = 1;
	ep_conn_t *c2;
	ep_group_t *g2;
	TH_OK(ep_connect(D[1].sock, &c2));
	TH_EXPECT_RC(ep_join_nodes(c2, &cfg, l2, EP_JOIN_NOWAIT, &g2),
		     EP_EMISMATCH);
	TH_CHECK(strstr(ep_errmsg(), "names other nodes"), "%s", ep_errmsg());
	ep_close(c2);
	ep_close(c);
	/* ranks of different nodes told different lists: each node accepts
	 * its own, and the nodes find out from each other's shape */
	const char *la[] = {E_(1), E_(2), E_(3)},
		   *lb[] = {E_(3), E_(2), E_(1)};
	const char *const *lists[] = {la, lb, la};
	ep_conn_t *cs[3];
	ep_group_t *gs[3];
	for (uint32_t r = 0; r < 3; r++) {
		struct ep_group_config c3 = {
			.name = "bad7", .world_size = 3, .ranks_per_node = 1,
			.rank = r, .num_experts = 12, .hidden = H,
			.max_tokens_per_rank = TMAX, .topk = K,
			.dtype = EP_DTYPE_BF16, .timeout_ms = 20000};
		TH_OK(ep_connect(D[1 + r].sock, &cs[r]));
		/* a join after the others found out fails at once */
		int rc = ep_join_nodes(cs[r], &c3, lists[r], EP_JOIN_NOWAIT,
				       &gs[r]);
		TH_CHECK(rc == 0 || rc == EP_EMISMATCH, "rank %u: %s", r,
			 ep_errmsg());
		if (rc)
			gs[r] = NULL;
	}
	const uint64_t t0 = th_now_ns();
	for (int r = 0; r < 3; r++) {
		if (!gs[r])
			continue;
		int rc;
		/* joined without waiting: ready once its nodes connected */
		while ((rc = ep_barrier(gs[r])) == EP_ENOTREADY &&
		       th_now_ns() - t0 < 10000000000ull)
			th_sleep_ms(10);
		TH_EXPECT_RC(rc, EP_EMISMATCH);
		TH_CHECK(strstr(ep_errmsg(), "named others") ||
				 strstr(ep_errmsg(), "naming its nodes"),
			 "rank %d: %s", r, ep_errmsg());
	}
	TH_CHECK(th_now_ns() - t0 < 10000000000ull,
		 "the mismatch took the timeout");
	for (int r = 0; r < 3; r++)
		ep_close(cs[r]);
	struct order *od = th_shared(sizeof(*od));
	pid_t op[4];
	th_spawn(op, 4, order_rank, od);
	TH_CHECK(th_wait_all(op, 4, 60) == 0, "the order case");
	for (int r = 0; r < 4; r++) {
		TH_EXPECT_RC(od->code[r], EP_EMISMATCH);
		TH_CHECK(strstr(od->msg[r], "barrier 2") &&
				 strstr(od->msg[r], "data op"),
			 "rank %d: %s", r, od->msg[r]);
		TH_CHECK(od->ms[r] < 5000, "rank %d waited %llu ms", r,
			 (unsigned long long)od->ms[r]);
	}
	printf("ok: barrier on one node against a dispatch on another: "
	       "EP_EMISMATCH on every rank at once: %s\n",
	       od->msg[0]);
	pid_t rp[4];
	th_spawn(rp, 4, recvcap_rank, NULL);
	TH_CHECK(th_wait_all(rp, 4, 60) == 0, "the receive capacity case");
	printf("ok: recv_rows across nodes: a dispatch past it fails on "
	       "every rank of both nodes at once, the next one runs\n");
	printf("ok: a join naming an unknown node, a node twice, another "
	       "node in this one's place, another list than its node's, or than another node's: "
	       "each refused with what is wrong\n");
}

int main(void)
{
	th_init("test_placement", 900);
	N = 32;
	const char *e = getenv("EPD_TEST_NODES");
	if (e && atoi(e) >= 10 && atoi(e) <= TH_MAX_NODES)
		N = atoi(e);
	D = calloc((size_t)N, sizeof(*D));
	S = th_shared(sizeof(*S));
	TH_CHECK(D && S, "out of memory");
	uint64_t seed = (uint64_t)time(NULL) ^ (uint64_t)getpid();
	const char *se = getenv("EPD_TEST_SEED");
	if (se)
		seed = strtoull(se, NULL, 10);
	const char *lk = getenv("EPD_TEST_LOOKUP");
	JOBMODE = lk && !strcmp(lk, "job");
	/* heartbeats every 250 ms: N*(N-1) beats a period on two cores */
	const char *extra[] = {"-o", "heartbeat_ms=250", "-o",
			       "peer_linger_ms=300", "-o",
			       JOBMODE ? "peer_lookup=job" : "peer_lookup=peers",
			       NULL};
	th_daemon_start(&SOLO, NULL);
	th_cluster_start(D, N, "epdplace", extra);
	for (int i = 0; i < N; i++) {
		if (JOBMODE)
			snprintf(ENT[i], sizeof(ENT[i]), "n%d@127.0.0.1:%d", i,
				 D[i].peer_port);
		else
			snprintf(ENT[i], sizeof(ENT[i]), "n%d", i);
	}
	if (JOBMODE)
		printf("ok: peer_lookup = job: each daemon's peers name only "
		       "itself; jobs name their nodes as name@host:port\n");
	int *fds0 = calloc((size_t)N, sizeof(int));
	TH_CHECK(fds0, "out of memory");
	for (int i = 0; i < N; i++) {
		fds0[i] = th_fds(D[i].pid);
		TH_CHECK(fds0[i] == fds0[0] && !peers_up(i),
			 "daemon n%d starts with %d descriptors and %d peers "
			 "up (n0: %d)",
			 i, fds0[i], peers_up(i), fds0[0]);
	}
	printf("ok: %d daemons on loopback, none connected before a job "
	       "(%d descriptors each)\n",
	       N, fds0[0]);
	phase_jobs(seed);
	phase_idle(fds0);
	phase_churn(seed);
	phase_bad();
	phase_wide(seed);
	phase_kill(seed);
	for (int i = 0; i < N; i++)
		if (D[i].pid)
			th_daemon_stop(&D[i]);
	th_daemon_stop(&SOLO);
	free(fds0);
	free(D);
	printf("ok\n");
	return 0;
}
