/* SPDX-License-Identifier: MIT */
/*
 * The low-latency mode (libep ep_ll_*) when a rank fails, 4 GPU ranks
 * (sharing a GPU under MPS, or one per GPU). Each phase is a fresh set of
 * rank processes:
 *
 *  killed  (zero-copy combines) rank 3 is SIGKILLed 300 ms after the
 *          others launched an op (their kernels wait for its counts).
 *          That op ends with EP_EPEERLOST (the daemon released the group
 *          and the waiting kernels saw it) well before the group's
 *          timeout (20 s), and their later calls return it at once.
 *  hung    (receive hooks) rank 3 stays alive but skips an op. The
 *          others' op ends with EP_ETIMEDOUT after the timeout (2 s) and
 *          their later calls fail at once. Rank 3's late op then fails
 *          too (its peers' flags carry the poison mark): it never reports
 *          success on rows placed out of step.
 *  leave   rank 0 launches a dispatch the others never join and leaves
 *          at once, its kernel still waiting for their counts. ep_leave
 *          returns promptly (the daemon releases the group, the kernel
 *          sees it, then libep unmaps the regions) and rank 0's CUDA
 *          context stays healthy (unmapping under the running kernel
 *          would fault it); the others' next op fails with EP_EPEERLOST.
 *  after   the daemon serves on: a new group of four runs op pairs, each
 *          way twice, with results bitwise equal to the reference.
 *
 * Then killed and after again with the group across two daemons (2 nodes
 * of 2 ranks over tcp: libep's way across nodes, the pseudo group's
 * stream-ordered ops between its kernels): the survivors' op ends when the
 * daemons fail the group, not at its timeout, with NaN outputs, later
 * calls fail at once, and both daemons serve a new group bitwise.
 *
 * Every failed op's combine output is NaN in every channel (not the last
 * op's rows).
 *
 * Every op pair before a failure, and after, is checked bitwise: tokens of
 * small integers, four distinct experts each with weight 1, the experts'
 * rows sent back as they came, so each token comes home times 4, exactly.
 * Exit 77 without a GPU, or where ranks share a GPU without MPS (libep
 * refuses the mode there).
 */
#include "gpu_util.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

#define W 4
#define T 16
#define H 256
#define K 4
#define E (W * 4)

struct shared {
	const struct th_daemon *d;
	const struct th_daemon *node[2];
	int two; /* the group across the two daemons of node[] */
	uint32_t arrive, gen; /* tg_line_up */
	volatile int unsupported;
	volatile uint64_t took_ms[W], again_us[W];
};

/* How an op pair runs: one kernel per op, with receive hooks, or the
 * combine zero-copy (the experts' rows copied where the homes read them). */
enum { PUSH, HOOK, ZCOPY };

struct rank {
	ep_group_t *g;
	CUstream st;
	int mode;
	CUdeviceptr x, topk, w, out;
	uint16_t hx[T * H];
	int r;
};

static void inputs(struct rank *R)
{
	int64_t tk[T * K];
	float w[T * K];
	for (int t = 0; t < T; t++) {
		for (int k = 0; k < K; k++) { /* distinct: E / K apart */
			tk[t * K + k] = (t * 3 + R->r + k * (E / K)) % E;
			w[t * K + k] = 1.0f;
		}
		for (int h = 0; h < H; h++)
			R->hx[t * H + h] = tg_bf16(
				(float)((R->r * 7 + t * 3 + h) % 17 - 8));
	}
	tg_upload(R->x, R->hx, sizeof(R->hx));
	tg_upload(R->topk, tk, sizeof(tk));
	tg_upload(R->w, w, sizeof(w));
}

static void join(struct rank *R, struct shared *s, const char *name,
		 uint32_t timeout_ms, ep_conn_t **c)
{
	/* two nodes: ranks 0-1 on node 0's daemon, 2-3 on node 1's */
	R->g = tg_ll_join(s->two ? s->node[R->r / 2]->sock : s->d->sock, name,
			  W, s->two ? 2 : 0, (uint32_t)R->r, E, H, K,
			  timeout_ms, &R->st, c);
	CU(tg_drv.cuMemAlloc(&R->x, T * H * 2));
	CU(tg_drv.cuMemAlloc(&R->topk, T * K * 8));
	CU(tg_drv.cuMemAlloc(&R->w, T * K * 4));
	CU(tg_drv.cuMemAlloc(&R->out, T * H * 2));
	inputs(R);
}

/* One dispatch and combine; 0, or the first error. Once the dispatch
 * was taken, every step is called whatever the one before returned, as a
 * graph replays it (the failed combine's NaN is what such a caller
 * sees). With check: out is each token times 4, bitwise. */
#define STEP(call) TG_FIRST(rc, call)

static int op_pair(struct rank *R, bool check)
{
	struct ep_ll_recv rv;
	const unsigned hk = R->mode == HOOK ? EP_LL_HOOK : 0;
	int rc = ep_ll_dispatch(R->g, (void *)(uintptr_t)R->x,
				(const int64_t *)(uintptr_t)R->topk, T, hk,
				R->st, &rv);
	if (rc) /* no buffer to go on with */
		return rc;
	if (hk)
		STEP(ep_ll_dispatch_hook(R->g, rv.buffer, R->st));
	if (R->mode == ZCOPY) { /* the rows where the homes read them */
		void *cx;
		CU(tg_drv.cuStreamSynchronize(R->st));
		TH_OK(ep_ll_combine_buffer(R->g, rv.buffer, &cx));
		/* (the null stream's copy, landed: as tg_upload) */
		CU(tg_drv.cuMemcpyDtoD(tg_dptr(cx), tg_dptr(rv.recv_x),
				       (size_t)rv.local_experts * rv.max_recv *
					       H * 2));
		CU(tg_drv.cuStreamSynchronize(NULL));
	}
	STEP(ep_ll_combine(R->g, rv.buffer, R->mode == ZCOPY ? NULL : rv.recv_x,
			   (const float *)(uintptr_t)R->w,
			   (void *)(uintptr_t)R->out,
			   R->mode == ZCOPY ? EP_LL_ZERO_COPY : hk, R->st));
	if (hk)
		STEP(ep_ll_combine_hook(R->g, rv.buffer, R->st));
	CU(tg_drv.cuStreamSynchronize(R->st));
	STEP(ep_ll_error(R->g));
	if (rc || !check)
		return rc;
	uint16_t got[T * H];
	CU(tg_drv.cuMemcpyDtoH(got, R->out, sizeof(got)));
	for (int i = 0; i < T * H; i++) {
		uint32_t u = (uint32_t)R->hx[i] << 16;
		float f;
		memcpy(&f, &u, 4);
		TH_CHECK(got[i] == tg_bf16(4.0f * f),
			 "rank %d: token %d channel %d: 0x%04x, want 0x%04x",
			 R->r, i / H, i % H, got[i], tg_bf16(4.0f * f));
	}
	return 0;
}

/* The first op: EP_EUNSUPPORTED on every rank alike (a shared GPU
 * without MPS) makes the test a skip. */
static bool first_ops(struct rank *R, struct shared *s, int n)
{
	int rc = op_pair(R, true);
	if (rc == EP_EUNSUPPORTED) {
		s->unsupported = 1;
		return false;
	}
	TH_CHECK(rc == 0, "rank %d: %s: %s", R->r, ep_strerror(rc),
		 ep_errmsg());
	for (int i = 1; i < n; i++)
		TH_OK(op_pair(R, true));
	return true;
}

/* The failed op's combine output: NaN in every channel, not the last
 * op's rows (a graph replayed in a loop never reads the error). */
static void nan_out(struct rank *R)
{
	uint16_t got[T * H];
	CU(tg_drv.cuMemcpyDtoH(got, R->out, sizeof(got)));
	for (int i = 0; i < T * H; i++)
		TH_CHECK(got[i] == 0x7fc0, "rank %d: the failed combine left "
			 "0x%04x at token %d channel %d, not NaN", R->r,
			 got[i], i / H, i % H);
}

/* How long (us) a call takes to fail once the mode is over, and that it
 * fails with want. */
static uint64_t fails_at_once(struct rank *R, int want)
{
	uint64_t t0 = th_now_ns();
	struct ep_ll_recv rv;
	int rc = ep_ll_dispatch(R->g, (void *)(uintptr_t)R->x,
				(const int64_t *)(uintptr_t)R->topk, T, 0,
				R->st, &rv);
	uint64_t us = (th_now_ns() - t0) / 1000;
	TH_CHECK(rc == want, "rank %d: a later call returned %s (%s), want "
		 "%s", R->r, ep_strerror(rc), ep_errmsg(), ep_strerror(want));
	TH_CHECK(ep_ll_error(R->g) == want, "rank %d: ep_ll_error forgot",
		 R->r);
	return us;
}

/* The op that fails: it returns want (its time in took_ms), its combine
 * output is NaN, and a later call fails at once (again_us). */
static void failed_op(struct rank *R, struct shared *s, int want,
		      const char *what)
{
	uint64_t t0 = th_now_ns();
	int rc = op_pair(R, false);
	s->took_ms[R->r] = (th_now_ns() - t0) / 1000000;
	TH_CHECK(rc == want, "rank %d: %s: %s (%s)", R->r, what,
		 ep_strerror(rc), ep_errmsg());
	nan_out(R);
	s->again_us[R->r] = fails_at_once(R, want);
}

/* A phase's start on every rank: join `name`, n op pairs checked, all
 * ranks lined up. False: the mode is refused here (the test skips). */
static bool phase(struct rank *R, struct shared *s, const char *name,
		  uint32_t timeout_ms, int n, ep_conn_t **c)
{
	join(R, s, name, timeout_ms, c);
	bool go = first_ops(R, s, n);
	tg_line_up(&s->arrive, &s->gen, W);
	return go;
}

static void leave(struct rank *R, ep_conn_t *c)
{
	CU(tg_drv.cuStreamSynchronize(R->st));
	(void)ep_leave(R->g); /* the group may have failed */
	ep_close(c);
}

static int killed_rank(int rank, void *arg)
{
	struct shared *s = arg;
	struct rank R = {.r = rank};
	ep_conn_t *c;
	R.mode = ZCOPY;
	if (!phase(&R, s, "llkill", 20000, 3, &c))
		return 0;
	if (rank == W - 1) { /* killed while the others' kernels wait */
		th_sleep_ms(300);
		raise(SIGKILL);
	}
	failed_op(&R, s, EP_EPEERLOST, "the op after the kill");
	leave(&R, c);
	return 0;
}

static int hung_rank(int rank, void *arg)
{
	struct shared *s = arg;
	struct rank R = {.r = rank};
	ep_conn_t *c;
	R.mode = HOOK;
	if (!phase(&R, s, "llhang", 2000, 2, &c))
		return 0;
	if (rank != W - 1)
		failed_op(&R, s, EP_ETIMEDOUT, "the op the last rank skipped");
	tg_line_up(&s->arrive, &s->gen, W); /* the others are done */
	if (rank == W - 1) /* late: the others' flags say they failed */
		failed_op(&R, s, EP_EFAILED, "the late rank's op");
	tg_line_up(&s->arrive, &s->gen, W);
	leave(&R, c);
	return 0;
}

static int leave_rank(int rank, void *arg)
{
	struct shared *s = arg;
	struct rank R = {.r = rank};
	ep_conn_t *c;
	if (!phase(&R, s, "llleave", 20000, 2, &c))
		return 0;
	if (rank == 0) {
		struct ep_ll_recv rv;
		TH_OK(ep_ll_dispatch(R.g, (void *)(uintptr_t)R.x,
				     (const int64_t *)(uintptr_t)R.topk, T, 0,
				     R.st, &rv));
		uint64_t t0 = th_now_ns();
		TH_OK(ep_leave(R.g));
		s->took_ms[0] = (th_now_ns() - t0) / 1000000;
		/* the kernel ended before its regions went: no fault */
		CU(tg_drv.cuStreamSynchronize(R.st));
		uint16_t back[T * H];
		CU(tg_drv.cuMemcpyDtoH(back, R.x, sizeof(back)));
		TH_CHECK(!memcmp(back, R.hx, sizeof(back)),
			 "rank 0's memory after the leave");
		ep_close(c);
	}
	tg_line_up(&s->arrive, &s->gen, W); /* rank 0 has left */
	if (rank != 0) {
		int rc = op_pair(&R, false);
		TH_CHECK(rc == EP_EPEERLOST, "rank %d: the op after rank 0 "
			 "left: %s (%s)", rank, ep_strerror(rc), ep_errmsg());
		leave(&R, c);
	}
	return 0;
}

static int after_rank(int rank, void *arg)
{
	struct shared *s = arg;
	struct rank R = {.r = rank};
	ep_conn_t *c;
	join(&R, s, "llafter", 20000, &c);
	if (first_ops(&R, s, 1))
		for (int i = 1; i <= 6; i++) { /* every way, bitwise */
			R.mode = i % 3;
			TH_OK(op_pair(&R, true));
		}
	leave(&R, c);
	return 0;
}

static uint64_t most(volatile uint64_t *v, int n)
{
	uint64_t m = 0;
	for (int i = 0; i < n; i++)
		m = v[i] > m ? v[i] : m;
	return m;
}

int main(void)
{
	th_init("gpu: low-latency mode when a rank fails", 300);
	if (tg_probe())
		return TH_SKIP;
	struct th_daemon d;
	th_daemon_start(&d, "-b", "cuda", NULL);
	struct shared *s = th_shared(sizeof(*s));
	s->d = &d;
	pid_t p[W];

	th_spawn(p, W, killed_rank, s);
	th_reap(p[W - 1], 60);
	TH_CHECK(th_wait_all(p, W - 1, 60) == 0, "a survivor failed");
	if (s->unsupported) {
		printf("skip: the low-latency mode needs MPS where ranks "
		       "share a GPU\n");
		th_daemon_stop(&d);
		return TH_SKIP;
	}
	uint64_t kill_ms = most(s->took_ms, W - 1);
	uint64_t kill_again = most(s->again_us, W - 1);
	TH_CHECK(kill_ms >= 250 && kill_ms < 5000,
		 "the survivors' op took %llu ms: they waited for the group's "
		 "timeout (20 s), not for the daemon's release",
		 (unsigned long long)kill_ms);
	TH_CHECK(th_daemon_alive(&d), "the daemon died");

	memset((void *)s->took_ms, 0, sizeof(s->took_ms));
	memset((void *)s->again_us, 0, sizeof(s->again_us));
	th_spawn(p, W, hung_rank, s);
	TH_CHECK(th_wait_all(p, W, 60) == 0, "a rank of the hung phase failed");
	uint64_t hang_ms = most(s->took_ms, W - 1);
	TH_CHECK(hang_ms >= 1500 && hang_ms < 10000,
		 "the op rank %d skipped ended after %llu ms (timeout 2 s)",
		 W - 1, (unsigned long long)hang_ms);
	uint64_t late_ms = s->took_ms[W - 1];
	TH_CHECK(late_ms < 1500, "the late rank's op took %llu ms: it waited "
		 "for a timeout, not for its peers' marks",
		 (unsigned long long)late_ms);

	memset((void *)s->took_ms, 0, sizeof(s->took_ms));
	th_spawn(p, W, leave_rank, s);
	TH_CHECK(th_wait_all(p, W, 60) == 0, "a rank of the leave phase failed");
	uint64_t leave_ms = s->took_ms[0];
	TH_CHECK(leave_ms < 5000, "ep_leave with a kernel in flight took %llu "
		 "ms (timeout 20 s)", (unsigned long long)leave_ms);

	th_spawn(p, W, after_rank, s);
	TH_CHECK(th_wait_all(p, W, 60) == 0, "the group after the failures");
	TH_CHECK(th_daemon_alive(&d), "the daemon died");
	th_daemon_stop(&d);

	/* the same across two nodes */
	struct th_daemon dn[2];
	tg_cluster2(dn, "epdllfail", 20);
	s->node[0] = &dn[0];
	s->node[1] = &dn[1];
	s->two = 1;
	memset((void *)s->took_ms, 0, sizeof(s->took_ms));
	memset((void *)s->again_us, 0, sizeof(s->again_us));
	th_spawn(p, W, killed_rank, s);
	th_reap(p[W - 1], 60);
	TH_CHECK(th_wait_all(p, W - 1, 60) == 0, "a survivor failed (two "
						  "nodes)");
	uint64_t kill2_ms = most(s->took_ms, W - 1);
	TH_CHECK(kill2_ms >= 250 && kill2_ms < 5000,
		 "two nodes: the survivors' op took %llu ms: they waited for "
		 "the group's timeout (20 s), not for the daemons' failure",
		 (unsigned long long)kill2_ms);
	uint64_t kill2_again = most(s->again_us, W - 1);
	th_spawn(p, W, after_rank, s);
	TH_CHECK(th_wait_all(p, W, 60) == 0, "the two-node group after the "
					     "kill");
	TH_CHECK(th_daemon_alive(&dn[0]) && th_daemon_alive(&dn[1]),
		 "a daemon died");
	th_daemon_stop(&dn[0]);
	th_daemon_stop(&dn[1]);
	printf("ok: killed rank: survivors' op ended in %llu ms with "
	       "EP_EPEERLOST (timeout 20 s), later calls in %llu us; hung "
	       "rank: the others' op ended in %llu ms with EP_ETIMEDOUT "
	       "(timeout 2 s), later calls in %llu us, the late rank's op in "
	       "%llu ms with EP_EFAILED; every failed combine's output NaN; "
	       "ep_leave with its kernel waiting took %llu ms, context "
	       "healthy; a new group ran 7 op pairs bitwise (plain, hooks, "
	       "zero copy); across two nodes: a killed rank's survivors' op "
	       "ended in %llu ms with EP_EPEERLOST, later calls in %llu us, "
	       "NaN outputs, a new group 7 op pairs bitwise\n",
	       (unsigned long long)kill_ms, (unsigned long long)kill_again,
	       (unsigned long long)hang_ms,
	       (unsigned long long)most(s->again_us, W),
	       (unsigned long long)late_ms, (unsigned long long)leave_ms,
	       (unsigned long long)kill2_ms, (unsigned long long)kill2_again);
	return 0;
}
