/* SPDX-License-Identifier: MIT */
/*
 * The ceiling of a stream-ordered barrier, without epd: N rank processes
 * (each its own CUDA context, or one shared under MPS) put "doorbell := k"
 * and "wait until done >= k" on their streams, with both words in host
 * memory; a CPU thread of this process (which never touches CUDA) sets
 * done to the smallest doorbell. How ranks wait: EPD_SO_WAIT=memop (stream
 * memory operations, the default) or kernel (a one-thread kernel polling
 * host memory, ekc_ring_wait).
 *
 * Prints, for EPD_SO_RANKS ranks (default 1): the time per barrier in a
 * loop of EPD_SO_ITERS (default 1000), and one barrier's round trip on an
 * idle stream (median of 101, ranks lined up on the CPU first).
 */
#include "gpu_util.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#define LINE 128
struct shared {
	_Alignas(4096) uint32_t done; /* one page the GPUs map */
	uint8_t pad0[LINE - 4];
	uint32_t bell[TH_MAXW][LINE / 4];
	_Alignas(4096) uint32_t arrive; /* CPU line-up, not mapped */
	uint32_t gen;
	_Atomic int stop;
	double loop_us[TH_MAXW], rt_us[TH_MAXW];
};

static int nranks, iters, use_kernel, nap_us, events;

static void *serve(void *arg)
{
	struct shared *s = arg;
	volatile uint32_t *done = &s->done;
	while (!atomic_load_explicit(&s->stop, memory_order_relaxed)) {
		uint32_t lo = UINT32_MAX;
		for (int r = 0; r < nranks; r++) {
			uint32_t b = __atomic_load_n(&s->bell[r][0],
						     __ATOMIC_ACQUIRE);
			lo = b < lo ? b : lo;
		}
		if (lo != *done) {
			__atomic_store_n(&s->done, lo, __ATOMIC_RELEASE);
			if (nap_us) /* as a thread that sleeps when idle */
				usleep((useconds_t)nap_us);
		}
	}
	return NULL;
}

static int rank_main(int r, void *arg)
{
	struct shared *s = arg;
	CUdeviceptr base;
	CUstream st = tg_rank_init(r, NULL, s, 4096, &base);
	CUdeviceptr done = base, bell = base + (CUdeviceptr)((uint8_t *)s->bell[r] - (uint8_t *)s);
	CUfunction fn = NULL;
	if (use_kernel) {
		CUmodule mod;
		CU(tg_drv.cuModuleLoadData(&mod, ekc_fatbin));
		CU(tg_drv.cuModuleGetFunction(&fn, mod, "ekc_ring_wait"));
	}
	uint32_t k = 0;
#define OP()                                                                   \
	do {                                                                   \
		k++;                                                           \
		if (fn) {                                                      \
			struct ekc_ring_args a = {                             \
				.bell = (uint32_t *)(uintptr_t)bell,           \
				.done = (const uint32_t *)(uintptr_t)done,     \
				.k = k,                                        \
				.budget_ns = 10000000000ull};                  \
			void *p[] = {&a};                                      \
			CU(tg_drv.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, st, \
						 p, NULL));                    \
		} else {                                                       \
			CU(tg_drv.cuStreamWriteValue32(st, bell, k, 0));       \
			CU(tg_drv.cuStreamWaitValue32(                         \
				st, done, k, CU_STREAM_WAIT_VALUE_GEQ));       \
		}                                                              \
	} while (0)
	for (int i = 0; i < 20; i++) /* warm up */
		OP();
	CU(tg_drv.cuStreamSynchronize(st));
	tg_line_up(&s->arrive, &s->gen, (uint32_t)nranks);
	uint64_t t0 = th_now_ns();
	for (int i = 0; i < iters; i++)
		OP();
	CU(tg_drv.cuStreamSynchronize(st));
	s->loop_us[r] = (double)(th_now_ns() - t0) / 1e3 / iters;
	double rt[101];
	CUevent e0, e1;
	CU(tg_drv.cuEventCreate(&e0, 0));
	CU(tg_drv.cuEventCreate(&e1, 0));
	for (int i = 0; i < 101; i++) {
		tg_line_up(&s->arrive, &s->gen, (uint32_t)nranks);
		t0 = th_now_ns();
		if (events)
			CU(tg_drv.cuEventRecord(e0, st));
		OP();
		if (events)
			CU(tg_drv.cuEventRecord(e1, st));
		CU(tg_drv.cuStreamSynchronize(st));
		rt[i] = (double)(th_now_ns() - t0) / 1e3;
		float ms;
		if (events && !tg_drv.cuEventElapsedTime(&ms, e0, e1))
			rt[i] = ms * 1e3;
	}
	s->rt_us[r] = tg_median(rt, 101);
	TH_CHECK(__atomic_load_n(&s->done, __ATOMIC_ACQUIRE) >= k,
		 "done %u behind this rank's %u", s->done, k);
	return 0;
}

int main(void)
{
	th_init("bench_streamop", 300);
	if (tg_probe())
		return TH_SKIP;
	const char *e = getenv("EPD_SO_RANKS");
	nranks = e ? atoi(e) : 1;
	e = getenv("EPD_SO_ITERS");
	iters = e ? atoi(e) : 1000;
	e = getenv("EPD_SO_WAIT");
	use_kernel = e && !strcmp(e, "kernel");
	e = getenv("EPD_SO_NAP_US"); /* the server naps after each barrier */
	nap_us = e ? atoi(e) : 0;
	e = getenv("EPD_SO_EVENTS"); /* round trips timed by events */
	events = e && *e == '1';
	TH_CHECK(nranks >= 1 && nranks <= TH_MAXW && iters > 0, "bad arguments");
	struct shared *s = th_shared(sizeof(*s));
	memset(s, 0, sizeof(*s));
	pthread_t t;
	TH_CHECK(pthread_create(&t, NULL, serve, s) == 0, "thread");
	pid_t pids[TH_MAXW];
	th_spawn(pids, nranks, rank_main, s);
	int bad = th_wait_all(pids, nranks, 280);
	atomic_store(&s->stop, 1);
	pthread_join(t, NULL);
	TH_CHECK(bad == 0, "%d rank(s) failed", bad);
	double loop = 0, rt = 0;
	for (int r = 0; r < nranks; r++) {
		loop = s->loop_us[r] > loop ? s->loop_us[r] : loop;
		rt = s->rt_us[r] > rt ? s->rt_us[r] : rt;
	}
	printf("perf: stream-op ceiling (no epd, CPU-served host words), %d "
	       "rank%s, wait by %s, server nap %d us, MPS %s: %.2f us per "
	       "barrier in a loop of %d; idle round trip %.1f us (median of "
	       "101, %s)\n",
	       nranks, nranks > 1 ? "s" : "", use_kernel ? "kernel" : "memop",
	       nap_us,
	       getenv("CUDA_MPS_PIPE_DIRECTORY") ? "yes" : "no", loop, iters,
	       rt, events ? "events" : "CPU clock");
	return 0;
}
