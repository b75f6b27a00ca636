/* SPDX-License-Identifier: MIT */
/*
 * The stream-ordered device barrier on a GPU, with real rank processes that
 * share one GPU (8 by default: EPD_GPU_RANKS).
 *
 * 1. Late rank: its stream is held at a gate (a wait on host memory) before
 *    the barrier. While the gate is shut, no other rank's stream may pass
 *    the barrier (each writes a "left" word to host memory right after it);
 *    once it opens, all do. For every choice of late rank.
 * 2. 10,000 back-to-back barriers per rank; a loop of 1000 timed with
 *    events (device time per barrier); the round trip of one barrier on an
 *    idle stream.
 * 3. A rank killed while the others' streams wait: they get EP_EPEERLOST
 *    and their streams are released. 4. A rank that never arrives: the
 *    others get EP_ETIMEDOUT naming it. 5. A new group works afterwards.
 *
 * Exit 77 (skip) without a usable GPU.
 */
#include "gpu_util.h"

#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXR 16
#define DELAY_MS 50

struct shared {
	const struct th_daemon *d;
	int ranks;
	volatile uint32_t gate[MAXR];         /* host memory the GPU waits on */
	volatile uint32_t left[MAXR][MAXR];   /* written by rank streams */
	volatile int enqueued[MAXR];
	volatile int entered;
	volatile int release;
	volatile uint32_t leave_gate; /* rank 0's stream waits on it */
	volatile int leave_enq;
	double us_per_barrier, roundtrip_us, b10k_us, rt_us[MAXR], engine_us;
	uint32_t arrive, gen; /* a CPU line-up of the ranks */
	int mps;
	char msg[MAXR][256];
	int code[MAXR];
};

/* Children: CUDA is initialized after fork, in each rank. */
static int my_gpu;
static CUstream rank_cuda(struct shared *s, int rank, CUdeviceptr *dev_shared)
{
	return tg_rank_init(rank, &my_gpu, s, sizeof(*s), dev_shared);
}

static ep_group_t *gpu_join(struct shared *s, const char *name, int rank,
			    int world, uint32_t timeout_ms, ep_conn_t **c)
{
	struct ep_group_config cfg = th_group(name, (uint32_t)world,
					      (uint32_t)rank, timeout_ms);
	cfg.cuda_device = my_gpu;
	ep_group_t *g;
	TH_OK(ep_connect(s->d->sock, c));
	TH_OK(ep_join(*c, &cfg, EP_JOIN_CUDA, &g));
	return g;
}

#define DEV(field) (sdev + ((uintptr_t)(field) - (uintptr_t)s))

static int late_rank(int rank, void *arg)
{
	struct shared *s = arg;
	CUdeviceptr sdev;
	CUstream st = rank_cuda(s, rank, &sdev);
	ep_conn_t *c;
	ep_group_t *g = gpu_join(s, "glate", rank, s->ranks, 20000, &c);
	for (int late = 0; late < s->ranks; late++) {
		if (rank == late)
			CU(tg_drv.cuStreamWaitValue32(st, DEV(&s->gate[late]), 1,
						   CU_STREAM_WAIT_VALUE_GEQ));
		TH_OK(ep_barrier_stream(g, st));
		CU(tg_drv.cuStreamWriteValue32(st, DEV(&s->left[late][rank]), 1,
					    0));
		__atomic_fetch_add(&s->enqueued[late], 1, __ATOMIC_SEQ_CST);
	}
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_group_sync(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

static void check_late(struct shared *s)
{
	pid_t pids[MAXR];
	th_spawn(pids, s->ranks, late_rank, s);
	for (int late = 0; late < s->ranks; late++) {
		while (s->enqueued[late] < s->ranks)
			th_sleep_ms(1);
		th_sleep_ms(DELAY_MS);
		for (int r = 0; r < s->ranks; r++)
			TH_CHECK(!s->left[late][r],
				 "late rank %d still gated, but rank %d's "
				 "stream left the barrier",
				 late, r);
		s->gate[late] = 1; /* the late rank enters */
		uint64_t end = th_now_ns() + 10000000000ull;
		for (int r = 0; r < s->ranks; r++)
			while (!s->left[late][r]) {
				TH_CHECK(th_now_ns() < end,
					 "rank %d never left barrier %d", r,
					 late);
				th_sleep_ms(1);
			}
	}
	TH_CHECK(th_wait_all(pids, s->ranks, 60) == 0, "a rank failed");
	printf("ok: device barrier, %d ranks (%s): with each late rank "
	       "gated for %d ms nobody left; all left once it entered\n",
	       s->ranks,
	       getenv("EPD_GPU_SPREAD") ? "spread over the GPUs" : "one GPU",
	       DELAY_MS);
}

/* Ranks that leave with stream barriers still queued: rank 0's stream is
 * held back, so no rank's barriers can complete until the parent opens
 * the gate, and every rank calls ep_leave at once. ep_leave waits for
 * the rank's own queued ops: each rank's stream then finishes cleanly
 * (none waits on memory unmapped under it, no group fails because a
 * rank left between its ops). */
#define LEAVE_OPS 20
static int leave_rank(int rank, void *arg)
{
	struct shared *s = arg;
	CUdeviceptr sdev;
	CUstream st = rank_cuda(s, rank, &sdev);
	ep_conn_t *c;
	ep_group_t *g = gpu_join(s, "gleave", rank, s->ranks, 20000, &c);
	if (rank == 0)
		CU(tg_drv.cuStreamWaitValue32(st, DEV(&s->leave_gate), 1,
					   CU_STREAM_WAIT_VALUE_GEQ));
	for (int i = 0; i < LEAVE_OPS; i++)
		TH_OK(ep_barrier_stream(g, st));
	CU(tg_drv.cuStreamWriteValue32(st, DEV(&s->left[0][rank]), 1, 0));
	__atomic_fetch_add(&s->leave_enq, 1, __ATOMIC_SEQ_CST);
	TH_OK(ep_leave(g)); /* with LEAVE_OPS barriers queued */
	CU(tg_drv.cuStreamSynchronize(st));
	TH_CHECK(s->left[0][rank] == 1, "rank %d's stream did not pass its "
		 "barriers", rank);
	ep_close(c);
	return 0;
}

static void check_leave(struct shared *s)
{
	pid_t pids[MAXR];
	memset((void *)s->left, 0, sizeof(s->left));
	th_spawn(pids, s->ranks, leave_rank, s);
	while (s->leave_enq < s->ranks)
		th_sleep_ms(1);
	th_sleep_ms(DELAY_MS); /* every rank is in ep_leave by now */
	for (int r = 0; r < s->ranks; r++)
		TH_CHECK(!s->left[0][r], "rank %d's stream passed %d barriers "
			 "while rank 0's was held", r, LEAVE_OPS);
	s->leave_gate = 1;
	TH_CHECK(th_wait_all(pids, s->ranks, 60) == 0, "a rank failed");
	printf("ok: %d ranks left with %d stream barriers queued each (rank "
	       "0's stream held %d ms): ep_leave waited for them, every "
	       "stream finished cleanly\n",
	       s->ranks, LEAVE_OPS, DELAY_MS);
}

/* A rank whose daemon dies while its stream op waits: ep_group_sync
 * says so within moments (EP_ECONNRESET), not after the group's timeout
 * of a minute. */
static int gone_rank(int rank, void *arg)
{
	struct shared *s = arg;
	CUdeviceptr sdev;
	CUstream st = rank_cuda(s, rank, &sdev);
	ep_conn_t *c;
	ep_group_t *g = gpu_join(s, "ggone", 0, 1, 60000, &c);
	CU(tg_drv.cuStreamWaitValue32(st, DEV(&s->leave_gate), 2,
				   CU_STREAM_WAIT_VALUE_GEQ));
	TH_OK(ep_barrier_stream(g, st));
	__atomic_store_n(&s->leave_enq, -1, __ATOMIC_SEQ_CST);
	const uint64_t t0 = th_now_ns();
	TH_EXPECT_RC(ep_group_sync(g), EP_ECONNRESET);
	TH_CHECK(th_now_ns() - t0 < 10000000000ull, "%.1f s to see the "
		 "daemon gone", (double)(th_now_ns() - t0) / 1e9);
	TH_CHECK(strstr(ep_errmsg(), "closed the connection"), "%s",
		 ep_errmsg());
	/* the stream stays held at the gate (its op never reached): it
	 * ends with the process */
	ep_close(c);
	return 0;
}

static void check_gone(struct shared *s)
{
	static struct th_daemon d2; /* (the harness keeps a pointer) */
	th_daemon_start(&d2, "--backend", "cuda", NULL);
	const struct th_daemon *d1 = s->d;
	s->d = &d2;
	s->leave_enq = 0;
	pid_t pid;
	th_spawn(&pid, 1, gone_rank, s);
	while (s->leave_enq != -1)
		th_sleep_ms(1);
	th_sleep_ms(DELAY_MS);
	kill(d2.pid, SIGKILL);
	th_reap(d2.pid, 10);
	d2.pid = 0;
	TH_CHECK(th_wait_all(&pid, 1, 60) == 0, "the rank failed");
	s->d = d1;
	printf("ok: a GPU rank whose daemon died while its stream op waited: "
	       "EP_ECONNRESET from ep_group_sync at once, not after the "
	       "group's timeout\n");
}

static int loop_rank(int rank, void *arg)
{
	struct shared *s = arg;
	CUdeviceptr sdev;
	CUstream st = rank_cuda(s, rank, &sdev);
	ep_conn_t *c;
	ep_group_t *g = gpu_join(s, "gloop", rank, s->ranks, 20000, &c);
	CUevent e0, e1;
	CU(tg_drv.cuEventCreate(&e0, 0));
	CU(tg_drv.cuEventCreate(&e1, 0));
	/* 10,000 back-to-back */
	CU(tg_drv.cuEventRecord(e0, st));
	for (int i = 0; i < 10000; i++)
		TH_OK(ep_barrier_stream(g, st));
	CU(tg_drv.cuEventRecord(e1, st));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_group_sync(g));
	float ms;
	CU(tg_drv.cuEventElapsedTime(&ms, e0, e1));
	if (rank == 0)
		s->b10k_us = ms * 1000.0 / 10000;
	/* a loop of 1000, device time */
	CU(tg_drv.cuEventRecord(e0, st));
	for (int i = 0; i < 1000; i++)
		TH_OK(ep_barrier_stream(g, st));
	CU(tg_drv.cuEventRecord(e1, st));
	CU(tg_drv.cuStreamSynchronize(st));
	CU(tg_drv.cuEventElapsedTime(&ms, e0, e1));
	if (rank == 0)
		s->us_per_barrier = ms * 1000.0 / 1000;
	/* one barrier on idle streams: median of 101 round trips */
	double rt[101];
	for (int i = 0; i < 101; i++) {
		TH_OK(ep_barrier(g)); /* idle streams, then the CPUs lined up */
		tg_line_up(&s->arrive, &s->gen, (uint32_t)s->ranks);
		/* On the CPU's clock, from the call to the stream's end: events
		 * would perturb it without MPS (each rank context's timed
		 * records wait for its time slice: 283 us instead of 15 us for
		 * 2 ranks in tests/bench/gpu/bench_streamop). */
		uint64_t t0 = th_now_ns();
		TH_OK(ep_barrier_stream(g, st));
		CU(tg_drv.cuStreamSynchronize(st));
		rt[i] = (double)(th_now_ns() - t0) / 1e3;
	}
	s->rt_us[rank] = tg_median(rt, 101);
	/* CUDA graphs: a captured barrier takes its op number at each
	 * replay (libep_graph.c), so one replay on every rank is a barrier
	 * of them all; with the graph gone, direct ops are served again
	 * (CUDA lets the graph's records go shortly after the destroys:
	 * EP_EBUSY until then). test_gpu_graph replays them 1,000 times. */
	CUstream cs;
	CU(tg_drv.cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING));
	CU(tg_drv.cuStreamBeginCapture(cs, CU_STREAM_CAPTURE_MODE_RELAXED));
	TH_OK(ep_barrier_stream(g, cs));
	CUgraph graph;
	CU(tg_drv.cuStreamEndCapture(cs, &graph));
	CUgraphExec exec;
	CU(tg_drv.cuGraphInstantiateWithFlags(&exec, graph, 0));
	CU(tg_drv.cuGraphLaunch(exec, cs));
	CU(tg_drv.cuStreamSynchronize(cs));
	CU(tg_drv.cuGraphExecDestroy(exec));
	CU(tg_drv.cuGraphDestroy(graph));
	CU(tg_drv.cuStreamDestroy(cs));
	TH_OK(tg_barrier_after_graphs(g, st));
	CU(tg_drv.cuStreamSynchronize(st));
	TH_OK(ep_barrier(g));
	if (rank == 0) {
		for (int r = 0; r < s->ranks; r++)
			if (s->rt_us[r] > s->roundtrip_us)
				s->roundtrip_us = s->rt_us[r];
		char *js;
		TH_OK(ep_daemon_status(c, &js));
		s->mps = strstr(js, "\"mps\":true") != NULL;
		const char *eu = strstr(js, "\"barrier_engine_us\":");
		s->engine_us = eu ? atof(eu + 20) : -1;
		TH_CHECK(strstr(js, "\"backend\":\"cuda\""), "status: %s", js);
		/* which image of the fatbin the driver loaded (sm_90 code on
		 * Hopper, the PTX on newer GPUs) */
		const char *kc = strstr(js, "\"kernels\":\"");
		TH_CHECK(kc && (!strncmp(kc + 11, "sm_90 cubin", 11) ||
				!strncmp(kc + 11, "compute_90 PTX", 14)),
			 "status names no loaded kernel image: %s", js);
		printf("ok: status says the kernels loaded: %.*s\n",
		       (int)strcspn(kc + 11, "\""), kc + 11);
		/* Barriers run on the host thread (EPD_GPU_BARRIER names
		 * another); no frame to the daemon for either the host thread
		 * or the resident kernel, and it counted them all. */
		const char *want = getenv("EPD_GPU_BARRIER");
		if (!want || (!strcmp(want, "kernel") && !s->mps))
			want = "host";
		char frag[64];
		snprintf(frag, sizeof(frag), "\"barrier\":\"%s\"", want);
		TH_CHECK(strstr(js, frag), "want %s: %s", frag, js);
		TH_CHECK(strstr(js, "\"resident_barrier\":true") ||
				 strcmp(want, "kernel"),
			 "resident_barrier disagrees: %s", js);
		free(js);
		/* and epctl shows it */
		char cmd[512];
		static char out[1 << 16];
		snprintf(cmd, sizeof(cmd), "%s -s %s status", th_epctl_bin(),
			 s->d->sock);
		FILE *p = popen(cmd, "r");
		TH_CHECK(p, "popen");
		size_t n = 0, got;
		while ((got = fread(out + n, 1, sizeof(out) - 1 - n, p)) > 0)
			n += got;
		out[n] = 0;
		TH_CHECK(pclose(p) == 0, "epctl status failed: %s", out);
		snprintf(frag, sizeof(frag), "barrier %s,",
			 !strcmp(want, "kernel") ? "resident kernel"
			 : !strcmp(want, "host") ? "host thread"
						 : "stream ops");
		TH_CHECK(strstr(out, frag), "epctl status lacks '%s': %s", frag,
			 out);
	}
	TH_OK(ep_group_sync(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

/* 3 and 4: victim 1 is killed, or victim 3 stays idle. */
struct fail_arg {
	struct shared *s;
	const char *name;
	int victim;
};
static struct fail_arg FA;

static int fail_rank(int rank, void *arg)
{
	(void)arg;
	struct shared *s = FA.s;
	CUdeviceptr sdev;
	CUstream st = rank_cuda(s, rank, &sdev);
	ep_conn_t *c;
	ep_group_t *g = gpu_join(s, FA.name, rank, 4, 2000, &c);
	TH_OK(ep_barrier_stream(g, st));
	TH_OK(ep_group_sync(g));
	if (rank == FA.victim) {
		while (!s->release)
			th_sleep_ms(5);
		return 0;
	}
	__atomic_fetch_add(&s->entered, 1, __ATOMIC_SEQ_CST);
	uint64_t t0 = th_now_ns();
	TH_OK(ep_barrier_stream(g, st));
	int rc = ep_group_sync(g);
	s->code[rank] = rc;
	snprintf(s->msg[rank], sizeof(s->msg[rank]), "%s", ep_errmsg());
	/* the stream was released: it drains */
	CU(tg_drv.cuStreamSynchronize(st));
	TH_CHECK(th_now_ns() - t0 < 10000000000ull, "took too long");
	/* later calls report the same error without enqueuing */
	TH_EXPECT_RC(ep_barrier_stream(g, st), rc);
	ep_leave(g);
	ep_close(c);
	return 0;
}

static void check_failure(struct shared *s, const char *name, int victim,
			  bool kill_it, int want)
{
	FA = (struct fail_arg){s, name, victim};
	s->entered = 0;
	s->release = 0;
	memset(s->code, 0, sizeof(s->code));
	pid_t pids[4];
	th_spawn(pids, 4, fail_rank, NULL);
	while (s->entered < 3)
		th_sleep_ms(2);
	th_sleep_ms(200);
	if (kill_it)
		kill(pids[victim], SIGKILL);
	int bad = 0;
	for (int i = 0; i < 4; i++)
		if (i != victim)
			bad += th_wait_all(&pids[i], 1, 30);
	s->release = 1;
	th_reap(pids[victim], 30);
	TH_CHECK(bad == 0, "%s: a rank failed", name);
	for (int r = 0; r < 4; r++) {
		if (r == victim)
			continue;
		TH_EXPECT_RC(s->code[r], want);
		char frag[16];
		snprintf(frag, sizeof(frag), "%d", victim);
		TH_CHECK(strstr(s->msg[r], frag), "message lacks rank %d: %s",
			 victim, s->msg[r]);
	}
	printf("ok: %s -> %s: %s\n", name, ep_strerror(want), s->msg[0]);
}

int main(void)
{
	th_init("gpu: stream-ordered device barrier", 300);
	if (tg_probe())
		return TH_SKIP;
	struct th_daemon d;
	/* EPD_GPU_BARRIER=kernel|stream: that engine instead of the host
	 * thread (kernel: the opt-in resident barrier, MPS only) */
	const char *eng = getenv("EPD_GPU_BARRIER");
	if (eng && !strcmp(eng, "kernel"))
		th_daemon_start(&d, "--backend", "cuda", "-o",
				"cuda_resident_barrier=yes", NULL);
	else if (eng && !strcmp(eng, "stream"))
		th_daemon_start(&d, "--backend", "cuda", "-o",
				"cuda_resident_barrier=no", "-o",
				"host_barrier=no", NULL);
	else if (eng && !strcmp(eng, "host"))
		th_daemon_start(&d, "--backend", "cuda", "-o",
				"cuda_resident_barrier=no", NULL);
	else
		th_daemon_start(&d, "--backend", "cuda", NULL);
	struct shared *s = th_shared(sizeof(*s));
	s->d = &d;
	s->ranks = getenv("EPD_GPU_RANKS") ? atoi(getenv("EPD_GPU_RANKS")) : 8;
	TH_CHECK(s->ranks >= 1 && s->ranks <= MAXR, "EPD_GPU_RANKS");

	check_late(s);
	check_leave(s);
	check_gone(s);

	pid_t pids[MAXR];
	th_spawn(pids, s->ranks, loop_rank, s);
	TH_CHECK(th_wait_all(pids, s->ranks, 120) == 0, "loop failed");
	printf("ok: 10000 back-to-back barriers, %d ranks: %.2f us each\n",
	       s->ranks, s->b10k_us);
	printf("perf: device barrier (%s), %d ranks, %s, %s: %.2f us per "
	       "barrier in a loop of 1000 (device time); one barrier on an "
	       "idle stream: %.1f us round trip (CPU clock, median of 101, "
	       "the slowest rank's); the engine's own time per barrier (last "
	       "arrival seen to release): %.2f us\n",
	       eng && (strcmp(eng, "kernel") || s->mps) ? eng : "host", s->ranks,
	       getenv("EPD_GPU_SPREAD") ? "spread over the GPUs" : "one GPU",
	       s->mps ? "MPS" : "no MPS", s->us_per_barrier, s->roundtrip_us,
	       s->engine_us);

	check_failure(s, "gkill", 1, true, EP_EPEERLOST);
	check_failure(s, "gabsent", 3, false, EP_ETIMEDOUT);

	/* the daemon serves a new group */
	memset((void *)s->left, 0, sizeof(s->left));
	memset((void *)s->gate, 0, sizeof(s->gate));
	memset((void *)s->enqueued, 0, sizeof(s->enqueued));
	check_late(s);
	th_daemon_stop(&d);
	return 0;
}
