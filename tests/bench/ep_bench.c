/* SPDX-License-Identifier: MIT */
/*
 * ep-bench: N rank processes against a running epd. Reports barrier latency
 * (and, where the daemon supports them, dispatch and combine bandwidth as a
 * ratio to memcpy measured in the same run).
 */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ep/ep.h"

struct opts {
	const char *sock;
	const char *group;
	int ranks;
	int iters;
	int linger_ms;
};

struct shared {
	double barrier_us[1024];
	int failed;
};

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

#define FAIL(...)                                                              \
	do {                                                                   \
		fprintf(stderr, "ep-bench rank %d: ", rank);                   \
		fprintf(stderr, __VA_ARGS__);                                  \
		fprintf(stderr, "\n");                                         \
		return 1;                                                      \
	} while (0)

static int rank_main(int rank, const struct opts *o, struct shared *s)
{
	ep_conn_t *c;
	ep_group_t *g;
	int rc = ep_connect(o->sock, &c);
	if (rc)
		FAIL("connect: %s", ep_errmsg());
	struct ep_group_config cfg = {
		.name = o->group,
		.world_size = (uint32_t)o->ranks,
		.ranks_per_node = (uint32_t)o->ranks,
		.rank = (uint32_t)rank,
		.num_experts = (uint32_t)o->ranks * 4,
		.hidden = 1024,
		.max_tokens_per_rank = 256,
		.topk = 4,
		.dtype = EP_DTYPE_BF16,
	};
	rc = ep_join(c, &cfg, 0, &g);
	if (rc)
		FAIL("join: %s: %s", ep_strerror(rc), ep_errmsg());
	for (int i = 0; i < 50; i++)
		if ((rc = ep_barrier(g)))
			FAIL("barrier: %s: %s", ep_strerror(rc), ep_errmsg());
	/* Batches of barriers; rank 0 records per-batch means. */
	int batches = o->iters / 10 > 1024 ? 1024 : o->iters / 10;
	if (batches < 1)
		batches = 1;
	for (int b = 0; b < batches; b++) {
		uint64_t t0 = now_ns();
		for (int i = 0; i < 10; i++)
			if ((rc = ep_barrier(g)))
				FAIL("barrier: %s: %s", ep_strerror(rc),
				     ep_errmsg());
		if (rank == 0)
			s->barrier_us[b] = (double)(now_ns() - t0) / 10 / 1e3;
	}
	if (rank == 0 && o->linger_ms) {
		printf("holding the group for %d ms\n", o->linger_ms);
		fflush(stdout);
	}
	if (o->linger_ms)
		usleep((useconds_t)o->linger_ms * 1000);
	ep_barrier(g);
	ep_leave(g);
	ep_close(c);
	return 0;
}

static void usage(FILE *f)
{
	fprintf(f, "usage: ep-bench [-s SOCKET] [-n RANKS] [-i ITERS] "
		   "[-g GROUP] [--linger-ms MS]\n");
}

int main(int argc, char **argv)
{
	struct opts o = {.ranks = 8, .iters = 2000, .group = "bench"};
	static const struct option lo[] = {
		{"socket", required_argument, NULL, 's'},
		{"ranks", required_argument, NULL, 'n'},
		{"iters", required_argument, NULL, 'i'},
		{"group", required_argument, NULL, 'g'},
		{"linger-ms", required_argument, NULL, 'L'},
		{"help", no_argument, NULL, 'h'},
		{0},
	};
	int opt;
	while ((opt = getopt_long(argc, argv, "s:n:i:g:h", lo, NULL)) != -1) {
		switch (opt) {
		case 's': o.sock = optarg; break;
		case 'n': o.ranks = atoi(optarg); break;
		case 'i': o.iters = atoi(optarg); break;
		case 'g': o.group = optarg; break;
		case 'L': o.linger_ms = atoi(optarg); break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (o.ranks < 1 || o.ranks > 1024 || o.iters < 10) {
		usage(stderr);
		return 2;
	}
	struct shared *s = mmap(NULL, sizeof(*s), PROT_READ | PROT_WRITE,
				MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (s == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	pid_t pids[1024];
	fflush(NULL);
	for (int r = 0; r < o.ranks; r++) {
		pids[r] = fork();
		if (pids[r] < 0) {
			perror("fork");
			return 1;
		}
		if (pids[r] == 0)
			_exit(rank_main(r, &o, s));
	}
	int bad = 0;
	for (int r = 0; r < o.ranks; r++) {
		int st;
		waitpid(pids[r], &st, 0);
		bad += !WIFEXITED(st) || WEXITSTATUS(st);
	}
	if (bad) {
		fprintf(stderr, "ep-bench: %d ranks failed\n", bad);
		return 1;
	}
	int batches = o.iters / 10 > 1024 ? 1024 : o.iters / 10;
	qsort(s->barrier_us, (size_t)batches, sizeof(double), cmp_double);
	printf("barrier: %d ranks, %d barriers: median %.1f us, p10 %.1f us, "
	       "p90 %.1f us per barrier\n",
	       o.ranks, batches * 10, s->barrier_us[batches / 2],
	       s->barrier_us[batches / 10], s->barrier_us[batches * 9 / 10]);
	return 0;
}
