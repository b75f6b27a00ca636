/* SPDX-License-Identifier: MIT */
/*
 * A GPU rank that writes its topk_idx while the daemon's kernels read it:
 * rank 0 flips topk_idx[0] between a valid expert and values out of range
 * from a second stream (memsets, in its own context, racing the daemon's
 * dispatch kernels), while both ranks run stream-ordered dispatches,
 * cached dispatches and combines.
 *
 * Asserts: every dispatch either completes or fails with EP_EEXPERT (the
 * kernels route from the copy they checked: no out-of-bounds write; run
 * the daemon under compute-sanitizer to see none), the daemon stays up,
 * and a new group works afterwards. Exit 77 without a usable GPU.
 */
#include "gpu_util.h"

#include <pthread.h>
#include <string.h>

#define W 2
#define T 64
#define SECONDS 3

struct shared {
	const struct th_daemon *d;
	volatile int done;
	volatile uint64_t ok, bad;
};

struct flip {
	CUdeviceptr topk0;
	int stop; /* atomic */
	CUcontext ctx;
};

static void *flipper(void *arg)
{
	struct flip *f = arg;
	CU(tg_drv.cuCtxSetCurrent(f->ctx));
	CUstream st;
	CU(tg_drv.cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
	/* low and high words of an int64: 1, 2^30, -5 (0xfffffffb, ~0), 16 */
	const uint32_t lo[] = {1, 1u << 30, 0xfffffffbu, 16, 0};
	const uint32_t hi[] = {0, 0, 0xffffffffu, 0, 0};
	for (unsigned i = 0; !__atomic_load_n(&f->stop, __ATOMIC_RELAXED);
	     i++) {
		CU(tg_drv.cuMemsetD32Async(f->topk0, lo[i % 5], 1, st));
		CU(tg_drv.cuMemsetD32Async(f->topk0 + 4, hi[i % 5], 1, st));
		/* a pause now and then: some dispatches see a good index */
		if (i % 16 == 0) {
			CU(tg_drv.cuStreamSynchronize(st));
			th_sleep_ms(1);
		}
	}
	CU(tg_drv.cuStreamSynchronize(st));
	CU(tg_drv.cuStreamDestroy(st));
	return NULL;
}

/* A GPU rank r of group `name` with valid routing inputs (experts
 * (i * mul + r) % E): its stream, connection and buffers. */
static ep_group_t *gpu_rank(struct shared *s, const char *name, int r,
			    int mul, CUstream *st, ep_conn_t **c,
			    struct ep_buffers *b)
{
	int gpu;
	CUdeviceptr sdev;
	*st = tg_rank_init(r, &gpu, (void *)s, sizeof(*s), &sdev);
	struct ep_group_config cfg = th_group(name, W, (uint32_t)r, 20000);
	cfg.cuda_device = gpu;
	ep_group_t *g;
	TH_OK(ep_connect(s->d->sock, c));
	TH_OK(ep_join(*c, &cfg, EP_JOIN_CUDA, &g));
	TH_OK(ep_get_buffers(g, b));
	int64_t topk[T * 4];
	for (int i = 0; i < T * 4; i++)
		topk[i] = (i * mul + r) % (int)cfg.num_experts;
	tg_upload(tg_dptr(b->topk_idx), topk, sizeof(topk));
	return g;
}

static int rank_main(int r, void *arg)
{
	struct shared *s = arg;
	CUstream st;
	ep_conn_t *c;
	struct ep_buffers b;
	ep_group_t *g = gpu_rank(s, "gpurace", r, 5, &st, &c, &b);
	struct flip f = {.topk0 = tg_dptr(b.topk_idx)};
	pthread_t th;
	if (r == 0) {
		CU(tg_drv.cuCtxGetCurrent(&f.ctx));
		TH_CHECK(pthread_create(&th, NULL, flipper, &f) == 0, "thread");
	}
	uint64_t end = th_now_ns() + SECONDS * 1000000000ull;
	for (int i = 0;; i++) {
		int stop = r == 0 ? th_now_ns() > end : s->done;
		if (r == 0 && stop)
			s->done = 1;
		TH_OK(ep_barrier(g));
		if (stop || s->done)
			break;
		ep_handle_t h, hc;
		TH_OK(ep_dispatch_stream(g, T, 0, NULL, st, &h));
		CU(tg_drv.cuStreamSynchronize(st));
		int rc = ep_group_sync(g);
		TH_CHECK(rc == 0 || rc == EP_EEXPERT, "rank %d dispatch %d: %s",
			 r, i, ep_errmsg());
		if (rc) {
			/* a bad index fails the group: rejoin a fresh one */
			if (r == 0)
				s->bad++;
			break;
		}
		TH_OK(ep_dispatch_stream(g, T, 0, &h, st, &hc));
		TH_OK(ep_combine_stream(g, &h, 0, st));
		TH_OK(ep_handle_release(g, &h));
		CU(tg_drv.cuStreamSynchronize(st));
		TH_OK(ep_group_sync(g));
		if (r == 0)
			s->ok++;
	}
	if (r == 0) {
		__atomic_store_n(&f.stop, 1, __ATOMIC_RELAXED);
		pthread_join(th, NULL);
	}
	ep_leave(g);
	ep_close(c);
	return 0;
}

static int fresh_rank(int r, void *arg)
{
	struct shared *s = arg;
	CUstream st;
	ep_conn_t *c;
	struct ep_buffers b;
	ep_group_t *g = gpu_rank(s, "gpucalm", r, 3, &st, &c, &b);
	ep_handle_t h;
	for (int i = 0; i < 20; i++) {
		TH_OK(ep_dispatch_stream(g, T, 0, NULL, st, &h));
		TH_OK(ep_combine_stream(g, &h, 0, st));
		TH_OK(ep_handle_release(g, &h));
	}
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_group_sync(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

int main(void)
{
	th_init("gpu: a rank writing topk_idx during dispatch", 300);
	if (tg_probe())
		return TH_SKIP;
	struct th_daemon d;
	th_daemon_start(&d, "-b", "cuda", NULL);
	struct shared *s = th_shared(sizeof(*s));
	s->d = &d;
	pid_t pids[W];
	/* rounds until both outcomes were seen (a refused dispatch fails
	 * the group: a new one each time) */
	for (int round = 0; round < 30 && !(s->ok >= 5 && s->bad >= 2);
	     round++) {
		s->done = 0;
		th_spawn(pids, W, rank_main, s);
		TH_CHECK(th_wait_all(pids, W, 120) == 0, "a racing rank failed");
		TH_CHECK(th_daemon_alive(&d), "daemon died");
	}
	printf("ok: %lu dispatches ran, %lu refused with EP_EEXPERT while a "
	       "rank flipped its topk_idx\n",
	       (unsigned long)s->ok, (unsigned long)s->bad);
	TH_CHECK(s->ok > 0, "no dispatch completed");
	th_spawn(pids, W, fresh_rank, s);
	TH_CHECK(th_wait_all(pids, W, 120) == 0, "a fresh group failed");
	th_daemon_stop(&d);
	printf("ok\n");
	return 0;
}
