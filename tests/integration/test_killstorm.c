/* SPDX-License-Identifier: MIT */
/*
 * Kill storm: jobs of 2 to 8 ranks run barriers, dispatches and combines in
 * a loop while the test SIGKILLs (or SIGSTOPs, then SIGKILLs) a random
 * subset of their ranks at a random moment, several at once, the way a job
 * scheduler cancels a job. A bystander group runs barriers throughout.
 *
 * Asserts: the daemon never dies (and exits cleanly at the end, so an ASan
 * report or a leak fails the test); the bystander never sees an error; the
 * surviving ranks of a killed job get EP_EPEERLOST (or EP_EFAILED on a
 * later call), never a hang; and after the storm the daemon's descriptors
 * and memory mappings are back to what they were before it.
 *
 * EPD_KILLSTORM_SECONDS sets the storm's length (default 12 s).
 */
#include "harness.h"

#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXW 8

struct shared {
	const struct th_daemon *d;
	volatile int stop;
	volatile uint64_t by_rounds;
	volatile int ready[MAXW];
	volatile uint64_t ops[MAXW];
};

/* The daemon's resident set, in KiB (VmRSS), or -1. */
static long rss_kib(pid_t pid)
{
	char path[64], line[256];
	long kib = -1;
	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	FILE *f = fopen(path, "r");
	while (f && fgets(line, sizeof(line), f))
		if (!strncmp(line, "VmRSS:", 6))
			kib = atol(line + 6);
	if (f)
		fclose(f);
	return kib;
}

static int bystander(int rank, void *arg)
{
	struct shared *s = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = th_group("bystander", 2, (uint32_t)rank,
					      60000);
	ep_group_t *g = th_join(s->d, &cfg, &c);
	for (;;) {
		TH_OK(ep_barrier(g));
		if (rank == 0) {
			s->by_rounds++;
			if (s->stop)
				s->stop = 2;
		}
		TH_OK(ep_barrier(g));
		if (s->stop == 2)
			break;
	}
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

struct job {
	struct shared *s;
	char name[32];
	uint32_t world;
	unsigned seed;
};

static struct job J;

/* A job's rank: ops in a random but common order until it is killed or
 * its group fails; a failure must be peer-lost (or failed, afterwards). */
static int job_rank(int rank, void *arg)
{
	struct job *j = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = th_group(j->name, j->world,
					      (uint32_t)rank, 20000);
	ep_group_t *g = th_join(j->s->d, &cfg, &c);
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	unsigned seed = j->seed; /* the same sequence on every rank */
	unsigned mine = j->seed ^ (unsigned)rank * 7919u;
	ep_handle_t h = {0};
	bool have = false;
	j->s->ready[rank] = 1;
	for (uint64_t i = 0;; i++) {
		int op = rand_r(&seed) % 3, rc;
		uint32_t T = (uint32_t)(rand_r(&mine) % cfg.max_tokens_per_rank);
		if (op == 0) {
			rc = ep_barrier(g);
		} else if (op == 1 || !have) {
			for (uint32_t t = 0; t < T * cfg.topk; t++)
				b.topk_idx[t] = (int64_t)(rand_r(&mine) %
						(int)(cfg.num_experts + 1)) - 1;
			memset(b.x, (int)i, (size_t)T * cfg.hidden * 2);
			rc = have ? ep_handle_release(g, &h) : 0;
			if (!rc)
				rc = ep_dispatch_inplace(g, T, 0, NULL, &h);
			have = rc == 0;
		} else {
			rc = ep_combine_inplace(g, &h, 0);
		}
		if (rc) {
			TH_CHECK(rc == EP_EPEERLOST || rc == EP_EFAILED,
				 "job %s rank %d op %lu: %s: %s", j->name, rank,
				 (unsigned long)i, ep_strerror(rc),
				 ep_errmsg());
			break;
		}
		j->s->ops[rank] = i + 1;
	}
	ep_leave(g);
	ep_close(c);
	return 0;
}

int main(void)
{
	th_init("test_killstorm", 300);
	struct th_daemon d;
	th_daemon_start(&d, "-o", "frame_timeout_ms=2000", NULL);
	struct shared *s = th_shared(sizeof(*s));
	s->d = &d;
	unsigned seconds = 12;
	const char *e = getenv("EPD_KILLSTORM_SECONDS");
	if (e && atoi(e) > 0)
		seconds = (unsigned)atoi(e);

	/* The daemon at rest, with one group (the bystander's) running. */
	pid_t by[2];
	th_spawn(by, 2, bystander, s);
	while (s->by_rounds < 10)
		th_sleep_ms(5);
	th_sleep_ms(200);
	int fd0 = th_fds(d.pid);
	int map0 = th_maps(d.pid, "memfd:");
	long rss0 = rss_kib(d.pid);
	TH_CHECK(fd0 > 0 && map0 >= 0, "cannot read the daemon's /proc");

	unsigned seed = (unsigned)getpid();
	uint64_t end = th_now_ns() + (uint64_t)seconds * 1000000000ull;
	int jobs = 0, killed = 0, stopped = 0;
	while (th_now_ns() < end) {
		J = (struct job){.s = s, .world = 2 + rand_r(&seed) % 7,
				 .seed = rand_r(&seed)};
		snprintf(J.name, sizeof(J.name), "job%d", jobs);
		memset((void *)s->ready, 0, sizeof(s->ready));
		memset((void *)s->ops, 0, sizeof(s->ops));
		pid_t pids[MAXW];
		th_spawn(pids, (int)J.world, job_rank, &J);
		/* until every rank is in its loop, then a random moment */
		for (uint32_t r = 0; r < J.world; r++)
			while (!s->ready[r])
				th_sleep_ms(1);
		th_sleep_ms(rand_r(&seed) % 40);
		/* a random non-empty subset, killed at once; some stopped
		 * first (a frozen rank, then the scheduler's kill) */
		uint32_t mask = 0;
		while (!mask)
			mask = (uint32_t)rand_r(&seed) & ((1u << J.world) - 1);
		bool freeze = rand_r(&seed) % 3 == 0;
		for (uint32_t r = 0; r < J.world; r++)
			if (mask >> r & 1) {
				kill(pids[r], freeze ? SIGSTOP : SIGKILL);
				killed++;
			}
		if (freeze) {
			stopped++;
			th_sleep_ms(rand_r(&seed) % 30);
			for (uint32_t r = 0; r < J.world; r++)
				if (mask >> r & 1)
					kill(pids[r], SIGKILL);
		}
		for (uint32_t r = 0; r < J.world; r++) {
			if (mask >> r & 1) {
				th_reap(pids[r], 30);
			} else {
				TH_CHECK(th_wait_all(&pids[r], 1, 30) == 0,
					 "surviving rank %u of %s failed", r,
					 J.name);
			}
		}
		TH_CHECK(th_daemon_alive(&d), "daemon died at job %d", jobs);
		jobs++;
	}
	printf("%d jobs, %d ranks killed (%d jobs frozen first), bystander "
	       "%lu rounds\n",
	       jobs, killed, stopped, (unsigned long)s->by_rounds);

	/* Back to rest: the killed jobs' connections, groups and regions
	 * are gone. */
	int fd1 = -1, map1 = -1;
	for (int i = 0; i < 100; i++) {
		fd1 = th_fds(d.pid);
		map1 = th_maps(d.pid, "memfd:");
		if (fd1 == fd0 && map1 == map0)
			break;
		th_sleep_ms(50);
	}
	TH_CHECK(fd1 == fd0, "daemon has %d descriptors, %d before the storm",
		 fd1, fd0);
	TH_CHECK(map1 == map0, "daemon maps %d memfd regions, %d before", map1,
		 map0);
	/* freed memory may stay with the allocator, but no job's buffers or
	 * state may: a bound far below what the jobs used */
	long rss1 = rss_kib(d.pid);
	printf("daemon RSS %ld KiB before the storm, %ld after\n", rss0, rss1);
	/* (a sanitizer keeps freed memory in quarantine: no bound then) */
	if (!getenv("EPD_TEST_PRELOAD") && !getenv("TSAN_OPTIONS"))
		TH_CHECK(rss1 - rss0 < 64 * 1024, "RSS grew from %ld to %ld KiB",
			 rss0, rss1);
	s->stop = 1;
	TH_CHECK(th_wait_all(by, 2, 60) == 0, "the bystander failed");
	th_daemon_stop(&d);
	printf("ok\n");
	return 0;
}
