/* SPDX-License-Identifier: MIT */
/*
 * Many daemons on one machine, as a cluster of that many nodes
 * (loopback, connections on demand; peer_handshakes_per_host is the
 * cluster's size, since all of them dial from one address here). For
 * each cluster size C
 * (EPD_BENCH_CLUSTERS, default "8 32 128") and each job size N <= C
 * (EPD_BENCH_NODES, default "2 8 32 64 128"), a job of N nodes x 1 host
 * rank on nodes picked at random, in random order:
 *  - formation: first join call to the last join's return;
 *  - barrier: mean of EPD_BENCH_ITERS (200) in a loop, rank 0's clock;
 *  - dispatch+combine: mean of 50 pairs (64 tokens, hidden 1024, top-4,
 *    4 experts a rank), rank 0's clock.
 * Then, with no job left (after the connections' linger), per daemon:
 * descriptors, resident memory and CPU over 2 s of idling, against C.
 * The ceiling of a message's round trip is measured in the same run: a
 * 2-node barrier, which is one message each way.
 *
 * Not a test: it prints a table and fails only if something breaks.
 */
#include "harness.h"

#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAXN 256
#define H 1024
#define K 4
#define T 64

struct shared {
	int n, node[MAXN];
	int iters;
	uint64_t join0[MAXN], join1[MAXN];
	double barrier_us, dc_us;
	uint64_t seed;
};

static struct th_daemon *D;
static struct shared *S;

static int rank_main(int r, void *arg)
{
	(void)arg;
	const uint32_t W = (uint32_t)S->n;
	char names[MAXN][16];
	const char *list[MAXN];
	for (int i = 0; i < S->n; i++) {
		snprintf(names[i], sizeof(names[i]), "n%d", S->node[i]);
		list[i] = names[i];
	}
	struct ep_group_config cfg = {
		.name = "bench", .world_size = W, .ranks_per_node = 1,
		.rank = (uint32_t)r, .num_experts = W * 4, .hidden = H,
		.max_tokens_per_rank = T, .topk = K, .dtype = EP_DTYPE_BF16,
		.timeout_ms = 60000};
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(D[S->node[r]].sock, &c));
	S->join0[r] = th_now_ns();
	TH_OK(ep_join_nodes(c, &cfg, list, 0, &g));
	S->join1[r] = th_now_ns();
	TH_OK(ep_barrier(g));
	uint64_t t0 = th_now_ns();
	for (int i = 0; i < S->iters; i++)
		TH_OK(ep_barrier(g));
	if (r == 0)
		S->barrier_us = (double)(th_now_ns() - t0) / 1e3 / S->iters;
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	uint64_t gen = S->seed ^ (uint64_t)r;
	uint16_t *x = b.x;
	for (uint32_t i = 0; i < T * H; i++)
		x[i] = (uint16_t)(0x3c00 + th_rnd(&gen) % 0x400);
	for (uint32_t i = 0; i < T * K; i++)
		b.topk_idx[i] = (int64_t)(th_rnd(&gen) % (W * 4));
	TH_OK(ep_barrier(g));
	const int pairs = 50;
	t0 = th_now_ns();
	for (int i = 0; i < pairs; i++) {
		ep_handle_t h;
		TH_OK(ep_dispatch_inplace(g, T, 0, NULL, &h));
		TH_OK(ep_combine_inplace(g, &h, 0));
		TH_OK(ep_handle_release(g, &h));
	}
	if (r == 0)
		S->dc_us = (double)(th_now_ns() - t0) / 1e3 / pairs;
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

/* /proc/pid: resident kB, CPU ticks */
static long rss_kb(pid_t pid)
{
	char p[64], line[256];
	snprintf(p, sizeof(p), "/proc/%d/status", (int)pid);
	FILE *f = fopen(p, "r");
	long kb = -1;
	while (f && fgets(line, sizeof(line), f))
		if (!strncmp(line, "VmRSS:", 6))
			kb = atol(line + 6);
	if (f)
		fclose(f);
	return kb;
}

static long cpu_ticks(pid_t pid)
{
	char p[64], buf[1024];
	snprintf(p, sizeof(p), "/proc/%d/stat", (int)pid);
	FILE *f = fopen(p, "r");
	if (!f)
		return -1;
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	const char *q = strrchr(buf, ')');
	long ut = 0, st = 0;
	/* fields after the name: state(3) ... utime(14) stime(15) */
	if (q && sscanf(q + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u "
			       "%ld %ld",
			&ut, &st) == 2)
		return ut + st;
	return -1;
}

static void parse_list(const char *env, const char *dflt, int *out, int *n)
{
	char buf[256];
	snprintf(buf, sizeof(buf), "%s", getenv(env) ? getenv(env) : dflt);
	*n = 0;
	for (char *sv, *t = strtok_r(buf, " ,", &sv); t && *n < 16;
	     t = strtok_r(NULL, " ,", &sv))
		out[(*n)++] = atoi(t);
}

int main(void)
{
	th_init("bench_cluster", 3000);
	int clusters[16], nodes[16], nc, nn;
	parse_list("EPD_BENCH_CLUSTERS", "8 32 128", clusters, &nc);
	parse_list("EPD_BENCH_NODES", "2 8 32 64 128", nodes, &nn);
	S = th_shared(sizeof(*S));
	S->iters = getenv("EPD_BENCH_ITERS") ? atoi(getenv("EPD_BENCH_ITERS"))
					     : 200;
	S->seed = (uint64_t)time(NULL);
	printf("# %ld cores\n", sysconf(_SC_NPROCESSORS_ONLN));
	printf("perf: cluster nodes form_ms barrier_us dispatch+combine_us\n");
	for (int ci = 0; ci < nc; ci++) {
		const int C = clusters[ci];
		if (C < 2 || C > TH_MAX_NODES)
			continue;
		D = calloc((size_t)C, sizeof(*D));
		TH_CHECK(D, "out of memory");
		/* every node dials from 127.0.0.1 here, while each node of a
		 * cluster dials from its own address: the per-host limit of
		 * handshakes in progress would count the whole cluster as
		 * one host (and displace handshakes past 8), so it is the
		 * cluster's size; peer_handshakes_max stays as shipped */
		char per_host[64];
		snprintf(per_host, sizeof(per_host),
			 "peer_handshakes_per_host=%d", C);
		const char *extra[] = {"-o", "heartbeat_ms=500", "-o",
				       "peer_linger_ms=200", "-o",
				       "log_level=warning", "-o", per_host,
				       NULL};
		th_cluster_start(D, C, "epdbench", extra);
		uint64_t s = S->seed + (uint64_t)C;
		for (int ni = 0; ni < nn; ni++) {
			const int N = nodes[ni];
			if (N < 2 || N > C || N > MAXN)
				continue;
			S->n = N;
			for (int i = 0; i < N; i++) {
				bool again;
				do {
					S->node[i] = (int)(th_rnd(&s) % (uint32_t)C);
					again = false;
					for (int o = 0; o < i; o++)
						again |= S->node[o] == S->node[i];
				} while (again);
			}
			pid_t *pids = calloc((size_t)N, sizeof(*pids));
			th_spawn(pids, N, rank_main, NULL);
			TH_CHECK(th_wait_all(pids, N, 600) == 0,
				 "the job of %d nodes on %d failed", N, C);
			free(pids);
			uint64_t j0 = UINT64_MAX, j1 = 0;
			for (int i = 0; i < N; i++) {
				j0 = S->join0[i] < j0 ? S->join0[i] : j0;
				j1 = S->join1[i] > j1 ? S->join1[i] : j1;
			}
			printf("perf: %d %d %.1f %.1f %.1f\n", C, N,
			       (double)(j1 - j0) / 1e6, S->barrier_us,
			       S->dc_us);
		}
		/* idle: after the linger every connection is closed */
		th_sleep_ms(1500);
		const long hz = sysconf(_SC_CLK_TCK);
		long fds = 0, rss = 0, t0 = 0, t1 = 0;
		for (int i = 0; i < C; i++)
			t0 += cpu_ticks(D[i].pid);
		th_sleep_ms(2000);
		for (int i = 0; i < C; i++) {
			t1 += cpu_ticks(D[i].pid);
			fds += th_fds(D[i].pid);
			rss += rss_kb(D[i].pid);
		}
		printf("perf: idle cluster %d: %.1f descriptors, %.0f kB "
		       "resident, %.3f%% of a core per daemon\n",
		       C, (double)fds / C, (double)rss / C,
		       100.0 * (double)(t1 - t0) / hz / 2.0 / C);
		for (int i = 0; i < C; i++)
			th_daemon_stop(&D[i]);
		free(D);
	}
	return 0;
}
