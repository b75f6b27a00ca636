/* SPDX-License-Identifier: MIT */
/*
 * Ranks that die or never arrive: the others get a precise error within the
 * timeout, and the daemon goes on serving new groups.
 */
#include "harness.h"

#include <signal.h>
#include <string.h>

#define WORLD 4
#define TIMEOUT_MS 3000

struct shared {
	const struct th_daemon *d;
	volatile int entered; /* ranks that are in the barrier */
	int codes[WORLD];
	uint64_t waited_ns[WORLD];
	char msgs[WORLD][256];
	volatile int release;
};

/* A rank that joins and then waits to be killed or released. */
static int idle_rank(struct shared *s, ep_group_t *g, ep_conn_t *c)
{
	while (!s->release)
		th_sleep_ms(5);
	ep_leave(g);
	ep_close(c);
	return 0;
}

static int waiter(int rank, void *arg, const char *name, int idle)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = th_group(name, WORLD, (uint32_t)rank,
					      TIMEOUT_MS);
	ep_group_t *g = th_join(s->d, &cfg, &c);
	TH_OK(ep_barrier(g));
	if (rank == idle)
		return idle_rank(s, g, c);
	__atomic_fetch_add(&s->entered, 1, __ATOMIC_SEQ_CST);
	uint64_t t0 = th_now_ns();
	s->codes[rank] = ep_barrier(g);
	s->waited_ns[rank] = th_now_ns() - t0;
	snprintf(s->msgs[rank], sizeof(s->msgs[rank]), "%s", ep_errmsg());
	/* Later operations fail the same way; leaving works. */
	int again = ep_barrier(g);
	TH_CHECK(again == s->codes[rank], "later barrier gave %d (%s)", again,
		 ep_strerror(again));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

static int killed_case(int rank, void *arg)
{
	return waiter(rank, arg, "killed", 2);
}

static int absent_case(int rank, void *arg)
{
	return waiter(rank, arg, "absent", 3);
}

/* A fresh group works after the failures. */
static int fresh_rank(int rank, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = th_group("killed", WORLD, (uint32_t)rank,
					      TIMEOUT_MS);
	ep_group_t *g = th_join(s->d, &cfg, &c);
	for (int i = 0; i < 10; i++)
		TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

/* Join waits for readiness; a rank that never joins gives a timeout naming
 * it. */
static int join_timeout_rank(int rank, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	ep_group_t *g;
	struct ep_group_config cfg = th_group("halfjoined", WORLD,
					      (uint32_t)rank, 500);
	TH_OK(ep_connect(s->d->sock, &c));
	int rc = ep_join(c, &cfg, 0, &g);
	TH_EXPECT_RC(rc, EP_ETIMEDOUT);
	TH_CHECK(strstr(ep_errmsg(), "ranks never joined: 3") != NULL,
		 "message does not name rank 3: %s", ep_errmsg());
	ep_close(c);
	return 0;
}

static struct shared *run(const struct th_daemon *d, th_child_fn fn,
			  int victim, bool kill_it)
{
	struct shared *s = th_shared(sizeof(*s));
	s->d = d;
	pid_t pids[WORLD];
	th_spawn(pids, WORLD, fn, s);
	while (s->entered < WORLD - 1)
		th_sleep_ms(2);
	th_sleep_ms(100); /* they are inside the barrier now */
	if (kill_it)
		kill(pids[victim], SIGKILL);
	/* The victim's exit status is not ours to judge. */
	int bad = 0;
	for (int i = 0; i < WORLD; i++) {
		if (i == victim)
			continue;
		bad += th_wait_all(&pids[i], 1, 30);
	}
	s->release = 1;
	th_reap(pids[victim], 30);
	TH_CHECK(bad == 0, "a rank failed");
	return s;
}

int main(void)
{
	th_init("failure: killed rank, absent rank, join timeout", 120);
	struct th_daemon d;
	th_daemon_start(&d, NULL);

	/* 1. A rank killed while the others wait in a barrier. */
	struct shared *s = run(&d, killed_case, 2, true);
	for (int r = 0; r < WORLD; r++) {
		if (r == 2)
			continue;
		TH_EXPECT_RC(s->codes[r], EP_EPEERLOST);
		TH_CHECK(strstr(s->msgs[r], "rank 2") != NULL,
			 "message does not name rank 2: %s", s->msgs[r]);
		TH_CHECK(s->waited_ns[r] < (uint64_t)TIMEOUT_MS * 1000000ull,
			 "peer loss took %.0f ms, beyond the timeout",
			 (double)s->waited_ns[r] / 1e6);
	}
	printf("ok: killed rank -> peer lost: %s\n", s->msgs[0]);

	/* 2. The daemon serves a new group with the same name. */
	TH_CHECK(th_daemon_alive(&d), "epd died");
	pid_t pids[WORLD];
	th_spawn(pids, WORLD, fresh_rank, s);
	TH_CHECK(th_wait_all(pids, WORLD, 30) == 0, "fresh group failed");
	printf("ok: a new group works after the loss\n");

	/* 3. A rank that is alive but never arrives: timeout naming it. */
	s = run(&d, absent_case, 3, false);
	for (int r = 0; r < 3; r++) {
		TH_EXPECT_RC(s->codes[r], EP_ETIMEDOUT);
		TH_CHECK(strstr(s->msgs[r], "ranks never arrived: 3") != NULL,
			 "message does not name rank 3: %s", s->msgs[r]);
		double ms = (double)s->waited_ns[r] / 1e6;
		TH_CHECK(ms >= TIMEOUT_MS * 0.9 && ms < TIMEOUT_MS * 3,
			 "timeout after %.0f ms, configured %d", ms,
			 TIMEOUT_MS);
	}
	printf("ok: absent rank -> %s\n", s->msgs[0]);

	/* 4. A rank that never joins: the others' join times out. */
	th_spawn(pids, 3, join_timeout_rank, s);
	TH_CHECK(th_wait_all(pids, 3, 30) == 0, "join timeout case failed");
	printf("ok: join of an incomplete group times out naming rank 3\n");

	th_spawn(pids, WORLD, fresh_rank, s);
	TH_CHECK(th_wait_all(pids, WORLD, 30) == 0, "fresh group failed");
	th_daemon_stop(&d);
	return 0;
}
