/* SPDX-License-Identifier: MIT */
/*
 * A rank that writes its shared buffers while the daemon reads them: a
 * thread of rank 0 flips topk_idx[0] between a valid expert and values out
 * of range (2^30, -5, E) and scribbles over its receive-side indices
 * (recv_topk_idx) during every dispatch and combine.
 *
 * Asserts: every operation either succeeds or fails with EP_EEXPERT (the
 * daemon validated a private copy and routed from the same copy), the
 * honest rank sees nothing else, the daemon stays up and exits cleanly
 * (under ASan a read or write out of bounds fails the test), and a
 * bystander group is not disturbed.
 */
#include "harness.h"

#include <pthread.h>
#include <string.h>

#define WORLD 2
#define SECONDS 4

struct shared {
	const struct th_daemon *d;
	volatile int done, by_stop;
	volatile uint64_t ok, bad;
};

struct flipper {
	int64_t *topk;
	int64_t *recv_topk;
	size_t recv_n;
	uint32_t E;
	int stop; /* atomic */
};

static void *flip(void *arg)
{
	struct flipper *f = arg;
	const int64_t vals[] = {1, 1ll << 30, -5, f->E, 0, -1,
				(int64_t)1 << 62};
	unsigned i = 0;
	while (!__atomic_load_n(&f->stop, __ATOMIC_RELAXED)) {
		__atomic_store_n(&f->topk[0], vals[i % 7], __ATOMIC_RELAXED);
		__atomic_store_n(&f->recv_topk[i % f->recv_n],
				 vals[(i / 3) % 7], __ATOMIC_RELAXED);
		i++;
	}
	return NULL;
}

static int rank_main(int rank, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = th_group("race", WORLD, (uint32_t)rank,
					      20000);
	ep_group_t *g = th_join(s->d, &cfg, &c);
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	const uint32_t T = cfg.max_tokens_per_rank, K = cfg.topk;
	unsigned seed = 17u + (unsigned)rank;
	for (uint32_t t = 0; t < T * K; t++)
		b.topk_idx[t] = rand_r(&seed) % (int)cfg.num_experts;
	struct flipper f = {.topk = b.topk_idx,
			    .recv_topk = (int64_t *)b.recv_topk_idx,
			    .recv_n = (size_t)b.max_recv * K,
			    .E = cfg.num_experts};
	pthread_t th;
	if (rank == 0)
		TH_CHECK(pthread_create(&th, NULL, flip, &f) == 0, "thread");
	uint64_t end = th_now_ns() + SECONDS * 1000000000ull;
	for (int i = 0;; i++) {
		/* both ranks stop at the same iteration: rank 0 decides */
		int stop = rank == 0 ? th_now_ns() > end : s->done;
		if (rank == 0 && stop)
			s->done = 1;
		TH_OK(ep_barrier(g));
		if (stop || s->done)
			break;
		ep_handle_t h;
		int rc = ep_dispatch_inplace(g, T, 0, NULL, &h);
		TH_CHECK(rc == 0 || rc == EP_EEXPERT,
			 "rank %d dispatch %d: %s: %s", rank, i,
			 ep_strerror(rc), ep_errmsg());
		if (rc == 0) {
			TH_OK(ep_dispatch_inplace(g, T, 0, &h, &h));
			TH_OK(ep_combine_inplace(g, &h, 0));
			TH_OK(ep_handle_release(g, &h));
			if (rank == 0)
				s->ok++;
		} else if (rank == 0) {
			s->bad++;
		}
	}
	if (rank == 0) {
		__atomic_store_n(&f.stop, 1, __ATOMIC_RELAXED);
		pthread_join(th, NULL);
	}
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

static int bystander(int rank, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = th_group("calm", WORLD, (uint32_t)rank,
					      20000);
	ep_group_t *g = th_join(s->d, &cfg, &c);
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	for (uint32_t t = 0; t < 8 * cfg.topk; t++)
		b.topk_idx[t] = (int64_t)(t % cfg.num_experts);
	for (;;) {
		ep_handle_t h;
		TH_OK(ep_dispatch_inplace(g, 8, 0, NULL, &h));
		TH_OK(ep_combine_inplace(g, &h, 0));
		TH_OK(ep_handle_release(g, &h));
		/* both stop at the same round: rank 0 decides */
		if (rank == 0 && s->by_stop)
			s->by_stop = 2;
		TH_OK(ep_barrier(g));
		if (s->by_stop == 2)
			break;
	}
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

int main(void)
{
	th_init("test_racewriter", 120);
	struct th_daemon d;
	th_daemon_start(&d, NULL);
	struct shared *s = th_shared(sizeof(*s));
	s->d = &d;
	pid_t by[WORLD], pids[WORLD];
	th_spawn(by, WORLD, bystander, s);
	th_spawn(pids, WORLD, rank_main, s);
	TH_CHECK(th_wait_all(pids, WORLD, 60) == 0, "a racing rank failed");
	printf("%lu dispatches ran, %lu refused (expert out of range)\n",
	       (unsigned long)s->ok, (unsigned long)s->bad);
	TH_CHECK(s->ok > 0 && s->bad > 0,
		 "the race should produce both outcomes");
	TH_CHECK(th_daemon_alive(&d), "daemon died");
	s->by_stop = 1;
	TH_CHECK(th_wait_all(by, WORLD, 60) == 0, "the bystander failed");
	th_daemon_stop(&d);
	printf("ok\n");
	return 0;
}
