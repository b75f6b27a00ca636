/* SPDX-License-Identifier: MIT */
/*
 * The barrier's defining property, with real rank processes: no rank leaves
 * a barrier before every rank entered it. One rank enters late, for every
 * choice of late rank; CLOCK_MONOTONIC stamps on one machine decide. Then
 * 1000 back-to-back barriers over 8 ranks, each checked the same way.
 */
#include "harness.h"

#include <string.h>

#define DELAY_MS 40
#define MAXW TH_MAXW
#define LOOPS 1000

struct late_shared {
	const struct th_daemon *d;
	int world;
	char name[32];
	uint64_t enter[MAXW][MAXW], leave[MAXW][MAXW];
};

static int late_rank(int rank, void *arg)
{
	struct late_shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = th_group(s->name, (uint32_t)s->world,
					      (uint32_t)rank, 20000);
	ep_group_t *g = th_join(s->d, &cfg, &c);
	th_late_rounds(g, rank, s->world, DELAY_MS, s->enter, s->leave);
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

static void check_late(const struct th_daemon *d, int world)
{
	struct late_shared *s = th_shared(sizeof(*s));
	s->d = d;
	s->world = world;
	snprintf(s->name, sizeof(s->name), "late%d", world);
	pid_t pids[MAXW];
	th_spawn(pids, world, late_rank, s);
	TH_CHECK(th_wait_all(pids, world, 60) == 0, "a rank failed");
	for (int late = 0; late < world; late++) {
		uint64_t late_enter = s->enter[late][late], max_enter = 0;
		for (int r = 0; r < world; r++)
			if (s->enter[late][r] > max_enter)
				max_enter = s->enter[late][r];
		TH_CHECK(max_enter == late_enter,
			 "world %d: rank %d was meant to enter last", world,
			 late);
		for (int r = 0; r < world; r++) {
			TH_CHECK(s->leave[late][r] >= late_enter,
				 "world %d, late rank %d: rank %d left %.3f ms "
				 "before the late rank entered",
				 world, late, r,
				 (double)(late_enter - s->leave[late][r]) /
					 1e6);
		}
		/* The others really waited for it (not a vacuous pass). */
		int early = (late + 1) % world;
		double waited = (double)(s->leave[late][early] -
					 s->enter[late][early]) /
				1e6;
		TH_CHECK(waited >= DELAY_MS * 0.5,
			 "rank %d waited only %.3f ms for late rank %d", early,
			 waited, late);
	}
	printf("ok: world %d, every choice of late rank: nobody left early\n",
	       world);
}

struct loop_shared {
	const struct th_daemon *d;
	volatile uint64_t arrived[MAXW];
	uint64_t elapsed_ns;
	int violations;
};

static int loop_rank(int rank, void *arg)
{
	struct loop_shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = th_group("loop", MAXW, (uint32_t)rank,
					      20000);
	ep_group_t *g = th_join(s->d, &cfg, &c);
	TH_OK(ep_barrier(g));
	uint64_t t0 = th_now_ns();
	for (uint64_t i = 1; i <= LOOPS; i++) {
		__atomic_store_n(&s->arrived[rank], i, __ATOMIC_SEQ_CST);
		TH_OK(ep_barrier(g));
		/* Everyone must have arrived at barrier i by now. */
		for (int r = 0; r < MAXW; r++)
			if (__atomic_load_n(&s->arrived[r], __ATOMIC_SEQ_CST) <
			    i)
				__atomic_fetch_add(&s->violations, 1,
						   __ATOMIC_SEQ_CST);
	}
	if (rank == 0)
		s->elapsed_ns = th_now_ns() - t0;
	TH_OK(ep_barrier(g));
	if (rank == 0) {
		/* The daemon counted every barrier of the group. */
		char *js;
		TH_OK(ep_daemon_status(c, &js));
		TH_CHECK(strstr(js, "\"barrier\":1002") != NULL,
			 "status does not count 1002 barriers: %s", js);
		free(js);
	}
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

int main(void)
{
	th_init("barrier: late rank, back-to-back", 240);
	struct th_daemon d;
	th_daemon_start(&d, NULL);
	check_late(&d, 4);
	check_late(&d, 8);

	struct loop_shared *s = th_shared(sizeof(*s));
	s->d = &d;
	pid_t pids[MAXW];
	th_spawn(pids, MAXW, loop_rank, s);
	TH_CHECK(th_wait_all(pids, MAXW, 120) == 0, "a rank failed");
	TH_CHECK(s->violations == 0,
		 "%d times a rank left a barrier before all arrived",
		 s->violations);
	printf("ok: %d back-to-back barriers over %d ranks, %.1f us each "
	       "(host backend, socket round trips)\n",
	       LOOPS, MAXW, (double)s->elapsed_ns / LOOPS / 1e3);
	th_daemon_stop(&d);
	return 0;
}
