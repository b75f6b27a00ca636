/* SPDX-License-Identifier: MIT */
/*
 * Kill storm on the CUDA backend: jobs of 2 to 4 GPU ranks enqueue
 * stream-ordered barriers, dispatches and combines while the test SIGKILLs
 * (or SIGSTOPs, then SIGKILLs) a random subset of their ranks at a random
 * moment. A bystander GPU group runs barriers and dispatches throughout.
 *
 * Asserts: the daemon never dies and exits cleanly; the bystander sees no
 * error; surviving ranks get an error (never a hang: their streams are
 * released); after the storm the daemon's descriptors are back to what
 * they were. EPD_KILLSTORM_SECONDS sets the length (default 20 s). Exit 77
 * without a usable GPU.
 */
#include "gpu_util.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

#define MAXW 4
#define T 32

struct shared {
	const struct th_daemon *d;
	volatile int stop;
	volatile uint64_t by_rounds;
	volatile int ready[MAXW];
	char name[32];
	uint32_t world;
	unsigned seed;
};

static ep_group_t *gjoin(struct shared *s, const char *name, uint32_t world,
			 int rank, CUstream *st, ep_conn_t **c)
{
	int gpu;
	CUdeviceptr sdev;
	*st = tg_rank_init(rank, &gpu, (void *)s, sizeof(*s), &sdev);
	struct ep_group_config cfg = th_group(name, world, (uint32_t)rank,
					      20000);
	cfg.cuda_device = gpu;
	ep_group_t *g;
	TH_OK(ep_connect(s->d->sock, c));
	TH_OK(ep_join(*c, &cfg, EP_JOIN_CUDA, &g));
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	int64_t topk[T * 4];
	for (int i = 0; i < T * 4; i++)
		topk[i] = (i * 7 + rank) % (int)cfg.num_experts;
	tg_upload(tg_dptr(b.topk_idx), topk, sizeof(topk));
	return g;
}

static int bystander(int rank, void *arg)
{
	struct shared *s = arg;
	CUstream st;
	ep_conn_t *c;
	ep_group_t *g = gjoin(s, "gbystander", 2, rank, &st, &c);
	for (;;) {
		ep_handle_t h;
		TH_OK(ep_dispatch_stream(g, T, 0, NULL, st, &h));
		TH_OK(ep_combine_stream(g, &h, 0, st));
		TH_OK(ep_handle_release(g, &h));
		TH_OK(ep_barrier_stream(g, st));
		CU(tg_drv.cuStreamSynchronize(st));
		TH_OK(ep_group_sync(g));
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

static int job_rank(int rank, void *arg)
{
	struct shared *s = arg;
	CUstream st;
	ep_conn_t *c;
	ep_group_t *g = gjoin(s, s->name, s->world, rank, &st, &c);
	unsigned seed = s->seed;
	s->ready[rank] = 1;
	int rc = 0;
	ep_handle_t h;
	bool have = false;
	for (int i = 0; !rc; i++) {
		int op = rand_r(&seed) % 3;
		if (op == 0)
			rc = ep_barrier_stream(g, st);
		else if (op == 1 || !have) {
			rc = have ? ep_handle_release(g, &h) : 0;
			if (!rc)
				rc = ep_dispatch_stream(g, T, 0, NULL, st, &h);
			have = true;
		}
		else
			rc = ep_combine_stream(g, &h, 0, st);
		if (!rc && i % 8 == 7) {
			CU(tg_drv.cuStreamSynchronize(st));
			rc = ep_group_sync(g);
		}
	}
	/* the group failed (a rank was killed): the stream was released */
	TH_CHECK(rc == EP_EPEERLOST || rc == EP_EFAILED, "rank %d: %s: %s",
		 rank, ep_strerror(rc), ep_errmsg());
	CU(tg_drv.cuStreamSynchronize(st));
	ep_leave(g);
	ep_close(c);
	return 0;
}

int main(void)
{
	th_init("gpu: kill storm", 400);
	if (tg_probe())
		return TH_SKIP;
	struct th_daemon d;
	th_daemon_start(&d, "-b", "cuda", NULL);
	struct shared *s = th_shared(sizeof(*s));
	s->d = &d;
	unsigned seconds = 20;
	const char *e = getenv("EPD_KILLSTORM_SECONDS");
	if (e && atoi(e) > 0)
		seconds = (unsigned)atoi(e);
	pid_t by[2];
	th_spawn(by, 2, bystander, s);
	while (s->by_rounds < 5)
		th_sleep_ms(5);
	int fd0 = th_fds(d.pid);
	unsigned seed = (unsigned)getpid();
	uint64_t end = th_now_ns() + (uint64_t)seconds * 1000000000ull;
	int jobs = 0, killed = 0;
	uint64_t slowest = 0;
	int slowest_job = -1;
	while (th_now_ns() < end) {
		uint64_t j0 = th_now_ns();
		s->world = 2 + (uint32_t)(rand_r(&seed) % (MAXW - 1));
		s->seed = (unsigned)rand_r(&seed);
		snprintf(s->name, sizeof(s->name), "gjob%d", jobs);
		memset((void *)s->ready, 0, sizeof(s->ready));
		pid_t pids[MAXW];
		th_spawn(pids, (int)s->world, job_rank, s);
		for (uint32_t r = 0; r < s->world; r++)
			while (!s->ready[r])
				th_sleep_ms(1);
		th_sleep_ms((unsigned)(rand_r(&seed) % 50));
		uint32_t mask = 0;
		while (!mask)
			mask = (uint32_t)rand_r(&seed) & ((1u << s->world) - 1);
		bool freeze = rand_r(&seed) % 3 == 0;
		for (uint32_t r = 0; r < s->world; r++)
			if (mask >> r & 1) {
				kill(pids[r], freeze ? SIGSTOP : SIGKILL);
				killed++;
			}
		if (freeze) {
			th_sleep_ms((unsigned)(rand_r(&seed) % 40));
			for (uint32_t r = 0; r < s->world; r++)
				if (mask >> r & 1)
					kill(pids[r], SIGKILL);
		}
		for (uint32_t r = 0; r < s->world; r++) {
			if (mask >> r & 1)
				th_reap(pids[r], 60);
			else
				TH_CHECK(th_wait_all(&pids[r], 1, 60) == 0,
					 "surviving rank %u of %s failed", r,
					 s->name);
		}
		TH_CHECK(th_daemon_alive(&d), "daemon died at job %d", jobs);
		/* the survivors were told at once, not after the group's
		 * timeout: a kill must not stop the GPU for others */
		uint64_t took = (th_now_ns() - j0) / 1000000ull;
		if (took > slowest) {
			slowest = took;
			slowest_job = jobs;
		}
		jobs++;
	}
	int fd1 = -1;
	for (int i = 0; i < 100 && (fd1 = th_fds(d.pid)) != fd0; i++)
		th_sleep_ms(50);
	printf("ok: %d GPU jobs, %d ranks killed; bystander %lu rounds; "
	       "daemon descriptors %d before, %d after; slowest job %llu ms "
	       "(gjob%d)\n",
	       jobs, killed, (unsigned long)s->by_rounds, fd0, fd1,
	       (unsigned long long)slowest, slowest_job);
	TH_CHECK(slowest < 10000,
		 "gjob%d took %llu ms: its survivors waited for the group's "
		 "timeout (20 s) instead of being released at the kill",
		 slowest_job, (unsigned long long)slowest);
	TH_CHECK(fd1 == fd0, "descriptors %d, %d before the storm", fd1, fd0);
	s->stop = 1;
	TH_CHECK(th_wait_all(by, 2, 60) == 0, "the bystander failed");
	th_daemon_stop(&d);
	printf("ok\n");
	return 0;
}
