/* SPDX-License-Identifier: MIT */
/*
 * Shrink mode of the low-latency kernels (ep.h, ep_ll_shrink): a rank that
 * fails is masked and the others go on. 4 GPU ranks (sharing a GPU under
 * MPS, or one per GPU); each phase is a fresh set of rank processes and a
 * fresh group:
 *
 *  leave    (timeout 20 s) rank 3 leaves while the others' op waits for
 *           its counts. Their op succeeds well before the timeout (the
 *           daemon names the rank that left, protocol 1.17), their mask
 *           is {3}, and every op after it (plain, hooks, zero copy) has
 *           rank 3's rows and experts left out. Then rank 2 leaves
 *           instead of coming to ep_ll_barrier: the others' barrier
 *           masks it ({2, 3}). ep_ll_mask_clean unmasks both; the next
 *           op masks them again at once, not at the timeout.
 *  hang     (timeout 2 s) rank 3 sleeps through an op: the others' op
 *           ends after the timeout with rank 3 masked, and the next one
 *           at once. Rank 3's late op finds that every other rank gave it
 *           up (the mark its counts flag carries there), masks them all at
 *           once, and runs alone: its combine sums its own experts' rows
 *           only, and nothing of it reaches the others (their next op is
 *           bitwise right).
 *  hole     (timeout 2 s) rank 2's dispatch holds its done flags back
 *           3.5 s after its counts and rows (EP_LL_TEST_STALL: a source
 *           that fails in between). The others mask it at their timeout:
 *           its rows stay a hole (layout_range none, src_info -1,
 *           recv_count spanning them, every other source's rows bitwise
 *           at their places), and their combine leaves its experts out.
 *           Rank 2, late, gets its rows whole, then finds no combine
 *           flags from the ranks that gave it up and sums alone.
 *  graph    (timeout 20 s) a dispatch and its combine captured into a
 *           CUDA graph, replayed (every rank present); rank 3 leaves, and
 *           the same graph, replayed by the others, masks it and goes on
 *           without it: the mask lives on the device, nothing is baked
 *           into the capture.
 *  disagree (timeout 2 s) rank 0 masks rank 1 by hand, the others do
 *           not: rank 1 masks rank 0 at its timeout, and the ranks'
 *           present sets differ. Every rank's dispatch ends with
 *           EP_EMISMATCH (the sets travel with the rows and are
 *           compared), never with rows placed from another rank's
 *           counts; the combine writes NaN.
 *
 * Every op that succeeds is checked bitwise against a reference here:
 * each receiver's rows, layout_range, src_info and recv_count from the
 * sources it counted present, and each token's sum: tokens of small
 * integers, four experts each on four distinct ranks with weight 1, the
 * experts' rows sent back as they came, so a token comes home times the
 * number of its experts' ranks present, exactly. Exit 77 without a GPU,
 * or where ranks share a GPU without MPS.
 */
#include "gpu_util.h"

#include <string.h>
#include <unistd.h>

#define W 4
#define T 16
#define H 256
#define K 4
#define El 4
#define E (W * El)

struct shared {
	const struct th_daemon *d;
	uint32_t arrive, gen; /* tg_line_up of all W */
	uint32_t arrive3, gen3; /* of the ranks that stay */
	volatile int unsupported;
	volatile uint64_t took_ms[W];
	volatile int rc[W];
};

enum { PUSH, HOOK, ZCOPY };

struct rank {
	ep_group_t *g;
	ep_conn_t *c;
	CUstream st;
	int mode;
	CUdeviceptr x, topk, w, out, mask;
	int r;
};

static float f_of(uint16_t b)
{
	uint32_t u = (uint32_t)b << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

/* Source s's inputs: token t's k-th expert, and its row. The experts of
 * a token are E / K apart: one on each rank. */
static int64_t expert_of(int s, int t, int k)
{
	return (t * 3 + s + k * (E / K)) % E;
}

static uint16_t x_of(int s, int t, int h)
{
	return tg_bf16((float)((s * 7 + t * 3 + h) % 17 - 8));
}

static void inputs(struct rank *R)
{
	int64_t tk[T * K];
	float w[T * K];
	uint16_t hx[T * H];
	for (int t = 0; t < T; t++) {
		for (int k = 0; k < K; k++) {
			tk[t * K + k] = expert_of(R->r, t, k);
			w[t * K + k] = 1.0f;
		}
		for (int h = 0; h < H; h++)
			hx[t * H + h] = x_of(R->r, t, h);
	}
	tg_upload(R->x, hx, sizeof(hx));
	tg_upload(R->topk, tk, sizeof(tk));
	tg_upload(R->w, w, sizeof(w));
}

static void join(struct rank *R, struct shared *s, const char *name,
		 uint32_t timeout_ms)
{
	R->g = tg_ll_join(s->d->sock, name, W, 0, (uint32_t)R->r, E, H, K,
			  timeout_ms, &R->st, &R->c);
	CU(tg_drv.cuMemAlloc(&R->x, T * H * 2));
	CU(tg_drv.cuMemAlloc(&R->topk, T * K * 8));
	CU(tg_drv.cuMemAlloc(&R->w, T * K * 4));
	CU(tg_drv.cuMemAlloc(&R->out, T * H * 2));
	CU(tg_drv.cuMemAlloc(&R->mask, W * 4));
	inputs(R);
}

/* This rank's mask words, as a bit set. */
static uint32_t mask_of(struct rank *R)
{
	int32_t m[W];
	TH_OK(ep_ll_mask_query(R->g, (int32_t *)(uintptr_t)R->mask, R->st));
	CU(tg_drv.cuStreamSynchronize(R->st));
	CU(tg_drv.cuMemcpyDtoH(m, R->mask, sizeof(m)));
	uint32_t v = 0;
	for (int i = 0; i < W; i++) {
		TH_CHECK(m[i] == 0 || m[i] == 1, "rank %d: mask word %d is %d",
			 R->r, i, m[i]);
		v |= (uint32_t)m[i] << i;
	}
	return v;
}

/* The dispatch's outputs against the reference: the rows of the sources
 * in `present`, in source then (t, k) order, per local expert; those of
 * the sources in `hole` keep their places with no rows in the layout and
 * src_info -1. */
static void check_recv(struct rank *R, const struct ep_ll_recv *rv,
		       uint32_t present, uint32_t hole)
{
	const uint32_t WN = rv->max_recv;
	int32_t cnt[El];
	int64_t lay[El * W];
	int32_t *src = malloc((size_t)El * WN * 4);
	uint16_t *rx = malloc((size_t)El * WN * H * 2);
	TH_CHECK(src && rx, "out of memory");
	CU(tg_drv.cuMemcpyDtoH(cnt, tg_dptr(rv->recv_count), sizeof(cnt)));
	CU(tg_drv.cuMemcpyDtoH(lay, tg_dptr(rv->layout_range), sizeof(lay)));
	CU(tg_drv.cuMemcpyDtoH(src, tg_dptr(rv->src_info), (size_t)El * WN * 4));
	CU(tg_drv.cuMemcpyDtoH(rx, tg_dptr(rv->recv_x),
			       (size_t)El * WN * H * 2));
	for (int el = 0; el < El; el++) {
		const int64_t e = (int64_t)R->r * El + el;
		uint32_t p = 0;
		for (int s = 0; s < W; s++) {
			const uint32_t begin = p;
			if (present >> s & 1)
				for (int t = 0; t < T; t++)
					for (int k = 0; k < K; k++) {
						if (expert_of(s, t, k) != e)
							continue;
						const uint64_t row =
							(uint64_t)el * WN + p++;
						if (hole >> s & 1) {
							TH_CHECK(src[row] == -1,
								 "rank %d: a hole "
								 "row's src_info "
								 "%d",
								 R->r, src[row]);
							continue;
						}
						TH_CHECK(src[row] == t,
							 "rank %d: expert %d "
							 "row %u: src_info %d, "
							 "want %d",
							 R->r, el, p - 1,
							 src[row], t);
						for (int h = 0; h < H; h++)
							TH_CHECK(rx[row * H + h] ==
									 x_of(s, t, h),
								 "rank %d: "
								 "expert %d row "
								 "%u channel %d",
								 R->r, el, p - 1,
								 h);
					}
			const int64_t want =
				(int64_t)begin << 32 |
				(hole >> s & 1 ? 0 : p - begin);
			TH_CHECK(lay[el * W + s] == want,
				 "rank %d: layout of expert %d from %d: "
				 "0x%llx, want 0x%llx",
				 R->r, el, s,
				 (unsigned long long)lay[el * W + s],
				 (unsigned long long)want);
		}
		TH_CHECK(cnt[el] == (int32_t)p, "rank %d: expert %d received "
			 "%d rows, want %u", R->r, el, cnt[el], p);
		for (uint32_t q = p; q < WN; q++)
			TH_CHECK(src[(uint64_t)el * WN + q] == -1,
				 "rank %d: src_info past the count", R->r);
	}
	free(src);
	free(rx);
}

/* Each token times the number of its experts' ranks in `present` (one
 * expert on each rank), bitwise. */
static void check_out(struct rank *R, uint32_t present)
{
	uint16_t got[T * H];
	CU(tg_drv.cuMemcpyDtoH(got, R->out, sizeof(got)));
	const float n = (float)__builtin_popcount(present);
	for (int i = 0; i < T * H; i++) {
		const uint16_t want = tg_bf16(n * f_of(x_of(R->r, i / H, i % H)));
		TH_CHECK(got[i] == want,
			 "rank %d: token %d channel %d: 0x%04x, want 0x%04x "
			 "(%d ranks present)",
			 R->r, i / H, i % H, got[i], want, (int)n);
	}
}

#define STEP(call) TG_FIRST(rc, call)

/* One dispatch and combine; 0, or the first error. With check: the
 * dispatch's outputs from the sources in dpresent and the sums from the
 * experts' ranks in cpresent, bitwise. */
static int op_pair_hole(struct rank *R, bool check, uint32_t dpresent,
			uint32_t hole, uint32_t cpresent)
{
	struct ep_ll_recv rv;
	const unsigned hk = R->mode == HOOK ? EP_LL_HOOK : 0;
	int rc = ep_ll_dispatch(R->g, (void *)(uintptr_t)R->x,
				(const int64_t *)(uintptr_t)R->topk, T, hk,
				R->st, &rv);
	if (rc)
		return rc;
	if (hk)
		STEP(ep_ll_dispatch_hook(R->g, rv.buffer, R->st));
	if (R->mode == ZCOPY) {
		void *cx;
		CU(tg_drv.cuStreamSynchronize(R->st));
		TH_OK(ep_ll_combine_buffer(R->g, rv.buffer, &cx));
		CU(tg_drv.cuMemcpyDtoD(tg_dptr(cx), tg_dptr(rv.recv_x),
				       (size_t)rv.local_experts * rv.max_recv *
					       H * 2));
		CU(tg_drv.cuStreamSynchronize(NULL));
	}
	CU(tg_drv.cuStreamSynchronize(R->st));
	const int drc = ep_ll_error(R->g);
	STEP(drc);
	if (!drc && check)
		check_recv(R, &rv, dpresent, hole);
	STEP(ep_ll_combine(R->g, rv.buffer, R->mode == ZCOPY ? NULL : rv.recv_x,
			   (const float *)(uintptr_t)R->w,
			   (void *)(uintptr_t)R->out,
			   R->mode == ZCOPY ? EP_LL_ZERO_COPY : hk, R->st));
	if (hk)
		STEP(ep_ll_combine_hook(R->g, rv.buffer, R->st));
	CU(tg_drv.cuStreamSynchronize(R->st));
	STEP(ep_ll_error(R->g));
	if (!rc && check)
		check_out(R, cpresent);
	return rc;
}

static int op_pair(struct rank *R, bool check, uint32_t dpresent,
		   uint32_t cpresent)
{
	return op_pair_hole(R, check, dpresent, 0, cpresent);
}

/* A phase's start: join, shrink mode on, n op pairs checked with every
 * rank present, all lined up. False: the mode is refused (a skip). */
static bool phase(struct rank *R, struct shared *s, const char *name,
		  uint32_t timeout_ms, int n)
{
	join(R, s, name, timeout_ms);
	int rc = ep_ll_shrink(R->g);
	if (rc == EP_EUNSUPPORTED) {
		s->unsupported = 1;
		tg_line_up(&s->arrive, &s->gen, W);
		return false;
	}
	TH_CHECK(rc == 0, "rank %d: ep_ll_shrink: %s (%s)", R->r,
		 ep_strerror(rc), ep_errmsg());
	TH_CHECK(mask_of(R) == 0, "rank %d: a fresh mask", R->r);
	for (int i = 0; i < n; i++) {
		R->mode = i % 3;
		TH_OK(op_pair(R, true, 0xf, 0xf));
	}
	tg_line_up(&s->arrive, &s->gen, W);
	return !s->unsupported;
}

static void leave(struct rank *R)
{
	CU(tg_drv.cuStreamSynchronize(R->st));
	(void)ep_leave(R->g);
	ep_close(R->c);
}

static int leave_rank(int rank, void *arg)
{
	struct shared *s = arg;
	struct rank R = {.r = rank};
	if (!phase(&R, s, "llshrink", 20000, 3))
		return 0;
	if (rank == 3) { /* gone while the others' kernels wait for it */
		th_sleep_ms(300);
		leave(&R);
		return 0;
	}
	R.mode = PUSH;
	uint64_t t0 = th_now_ns();
	int rc = op_pair(&R, true, 0x7, 0x7);
	s->took_ms[rank] = (th_now_ns() - t0) / 1000000;
	TH_CHECK(rc == 0, "rank %d: the op rank 3 left: %s (%s)", rank,
		 ep_strerror(rc), ep_errmsg());
	uint32_t m = mask_of(&R);
	TH_CHECK(m == 0x8, "rank %d: mask 0x%x after rank 3 left, want 0x8",
		 rank, m);
	for (int i = 0; i < 6; i++) { /* every way, rank 3 left out */
		R.mode = i % 3;
		TH_OK(op_pair(&R, true, 0x7, 0x7));
	}
	tg_line_up(&s->arrive3, &s->gen3, W - 1);
	if (rank == 2) { /* gone instead of coming to the barrier */
		th_sleep_ms(300);
		leave(&R);
		return 0;
	}
	TH_OK(ep_ll_barrier(R.g, R.st));
	CU(tg_drv.cuStreamSynchronize(R.st));
	TH_OK(ep_ll_error(R.g));
	m = mask_of(&R);
	TH_CHECK(m == 0xc, "rank %d: mask 0x%x after the barrier rank 2 "
		 "left, want 0xc", rank, m);
	for (int i = 0; i < 3; i++) {
		R.mode = i % 3;
		TH_OK(op_pair(&R, true, 0x3, 0x3));
	}
	/* unmasked, the ranks that left are masked again by the next op, at
	 * once (the daemon's gone bits), not at the timeout */
	TH_OK(ep_ll_mask_clean(R.g, R.st));
	TH_CHECK(mask_of(&R) == 0, "rank %d: the mask after clean", rank);
	R.mode = PUSH;
	t0 = th_now_ns();
	TH_OK(op_pair(&R, true, 0x3, 0x3));
	s->took_ms[rank] += (th_now_ns() - t0) / 1000000;
	m = mask_of(&R);
	TH_CHECK(m == 0xc, "rank %d: mask 0x%x after clean and an op, want "
		 "0xc", rank, m);
	/* argument errors */
	TH_CHECK(ep_ll_mask(R.g, (uint32_t)rank, 1, R.st) == EP_EINVAL,
		 "masking this rank itself");
	TH_CHECK(ep_ll_mask(R.g, W, 1, R.st) == EP_EINVAL,
		 "masking a rank past the group");
	leave(&R);
	return 0;
}

static int hang_rank(int rank, void *arg)
{
	struct shared *s = arg;
	struct rank R = {.r = rank};
	if (!phase(&R, s, "llshrinkhang", 2000, 1))
		return 0;
	R.mode = HOOK;
	if (rank != 3) {
		uint64_t t0 = th_now_ns();
		int rc = op_pair(&R, true, 0x7, 0x7);
		s->took_ms[rank] = (th_now_ns() - t0) / 1000000;
		TH_CHECK(rc == 0, "rank %d: the op rank 3 slept through: %s "
			 "(%s)", rank, ep_strerror(rc), ep_errmsg());
		TH_CHECK(mask_of(&R) == 0x8, "rank %d: mask after the hang",
			 rank);
		t0 = th_now_ns();
		R.mode = ZCOPY;
		TH_OK(op_pair(&R, true, 0x7, 0x7));
		s->rc[rank] = (int)((th_now_ns() - t0) / 1000000);
	}
	tg_line_up(&s->arrive, &s->gen, W); /* the others are done */
	if (rank == 3) {
		/* late: every other rank gave it up; it learns so from its
		 * counts flags, masks them all at once, and runs alone */
		uint64_t t0 = th_now_ns();
		int rc = op_pair(&R, true, 1u << 3, 1u << 3);
		s->took_ms[3] = (th_now_ns() - t0) / 1000000;
		TH_CHECK(rc == 0, "the late rank's op: %s (%s)",
			 ep_strerror(rc), ep_errmsg());
		TH_CHECK(mask_of(&R) == 0x7, "the late rank's mask");
	}
	tg_line_up(&s->arrive, &s->gen, W);
	if (rank != 3) { /* nothing of the late op reached the others */
		R.mode = PUSH;
		TH_OK(op_pair(&R, true, 0x7, 0x7));
	}
	tg_line_up(&s->arrive, &s->gen, W);
	leave(&R);
	return 0;
}

static int hole_rank(int rank, void *arg)
{
	struct shared *s = arg;
	struct rank R = {.r = rank};
	if (rank == 2) /* its second dispatch: done flags 3.5 s late */
		setenv("EP_LL_TEST_STALL", "2:3500", 1);
	if (!phase(&R, s, "llshrinkhole", 2000, 1))
		return 0;
	R.mode = PUSH;
	uint64_t t0 = th_now_ns();
	int rc;
	if (rank != 2) {
		rc = op_pair_hole(&R, true, 0xf, 1u << 2, 0xb);
		TH_CHECK(mask_of(&R) == 1u << 2, "rank %d: mask after the "
			 "hole", rank);
	} else { /* whole rows; then nobody's combine flags */
		rc = op_pair(&R, true, 0xf, 1u << 2);
		TH_CHECK(mask_of(&R) == 0xb, "the late rank's mask after "
			 "its combine");
	}
	s->took_ms[rank] = (th_now_ns() - t0) / 1000000;
	TH_CHECK(rc == 0, "rank %d: the op of the hole: %s (%s)", rank,
		 ep_strerror(rc), ep_errmsg());
	tg_line_up(&s->arrive, &s->gen, W);
	if (rank != 2) { /* and on without it */
		R.mode = ZCOPY;
		TH_OK(op_pair(&R, true, 0xb, 0xb));
	}
	tg_line_up(&s->arrive, &s->gen, W);
	leave(&R);
	return 0;
}

/* The graph of one op pair (push combine) replayed n times, each checked
 * bitwise with the present set given. */
static void replay(struct rank *R, CUgraphExec ge, const struct ep_ll_recv *rv,
		   int n, uint32_t present)
{
	for (int i = 0; i < n; i++) {
		CU(tg_drv.cuGraphLaunch(ge, R->st));
		CU(tg_drv.cuStreamSynchronize(R->st));
		TH_OK(ep_ll_error(R->g));
		check_recv(R, rv, present, 0);
		check_out(R, present);
	}
}

static int graph_rank(int rank, void *arg)
{
	struct shared *s = arg;
	struct rank R = {.r = rank};
	if (!phase(&R, s, "llshrinkgraph", 20000, 1))
		return 0;
	struct ep_ll_recv rv;
	CUgraph gr;
	CUgraphExec ge;
	CU(tg_drv.cuStreamBeginCapture(R.st,
				       CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
	TH_OK(ep_ll_dispatch(R.g, (void *)(uintptr_t)R.x,
			     (const int64_t *)(uintptr_t)R.topk, T, 0, R.st,
			     &rv));
	TH_OK(ep_ll_combine(R.g, rv.buffer, rv.recv_x,
			    (const float *)(uintptr_t)R.w,
			    (void *)(uintptr_t)R.out, 0, R.st));
	CU(tg_drv.cuStreamEndCapture(R.st, &gr));
	CU(tg_drv.cuGraphInstantiateWithFlags(&ge, gr, 0));
	replay(&R, ge, &rv, 3, 0xf);
	tg_line_up(&s->arrive, &s->gen, W);
	if (rank == 3) { /* gone while the others replay */
		th_sleep_ms(300);
		CU(tg_drv.cuGraphExecDestroy(ge));
		CU(tg_drv.cuGraphDestroy(gr));
		leave(&R);
		return 0;
	}
	uint64_t t0 = th_now_ns();
	replay(&R, ge, &rv, 1, 0x7);
	s->took_ms[rank] = (th_now_ns() - t0) / 1000000;
	TH_CHECK(mask_of(&R) == 0x8, "rank %d: mask after the replay rank 3 "
		 "left", rank);
	replay(&R, ge, &rv, 3, 0x7);
	CU(tg_drv.cuGraphExecDestroy(ge));
	CU(tg_drv.cuGraphDestroy(gr));
	leave(&R);
	return 0;
}

static int disagree_rank(int rank, void *arg)
{
	struct shared *s = arg;
	struct rank R = {.r = rank};
	if (!phase(&R, s, "llshrinkdis", 2000, 1))
		return 0;
	if (rank == 0)
		TH_OK(ep_ll_mask(R.g, 1, 1, R.st));
	R.mode = PUSH;
	s->rc[rank] = op_pair(&R, false, 0, 0);
	/* the combine of a failed mode: NaN, not the last op's rows */
	uint16_t got[T * H];
	CU(tg_drv.cuMemcpyDtoH(got, R.out, sizeof(got)));
	for (int i = 0; i < T * H; i++)
		TH_CHECK(got[i] == 0x7fc0, "rank %d: 0x%04x at token %d "
			 "channel %d after the failed op, not NaN",
			 rank, got[i], i / H, i % H);
	tg_line_up(&s->arrive, &s->gen, W);
	leave(&R);
	return 0;
}

int main(void)
{
	th_init("gpu: low-latency shrink mode", 300);
	if (tg_probe())
		return TH_SKIP;
	struct th_daemon d;
	th_daemon_start(&d, "-b", "cuda", NULL);
	struct shared *s = th_shared(sizeof(*s));
	s->d = &d;
	pid_t p[W];

	th_spawn(p, W, leave_rank, s);
	TH_CHECK(th_wait_all(p, W, 90) == 0, "a rank of the leave phase");
	if (s->unsupported) {
		printf("skip: the low-latency mode needs MPS where ranks "
		       "share a GPU\n");
		th_daemon_stop(&d);
		return TH_SKIP;
	}
	uint64_t leave_ms = 0;
	for (int i = 0; i < 2; i++)
		leave_ms = s->took_ms[i] > leave_ms ? s->took_ms[i] : leave_ms;
	TH_CHECK(leave_ms < 5000, "the ops after ranks left took %llu ms: "
		 "they waited for the timeout (20 s), not the daemon's gone "
		 "bits", (unsigned long long)leave_ms);

	memset((void *)s->took_ms, 0, sizeof(s->took_ms));
	memset((void *)s->rc, 0, sizeof(s->rc));
	th_spawn(p, W, hang_rank, s);
	TH_CHECK(th_wait_all(p, W, 90) == 0, "a rank of the hang phase");
	uint64_t hang_ms = 0, next_ms = 0;
	for (int i = 0; i < 3; i++) {
		hang_ms = s->took_ms[i] > hang_ms ? s->took_ms[i] : hang_ms;
		next_ms = (uint64_t)s->rc[i] > next_ms ? (uint64_t)s->rc[i]
						       : next_ms;
	}
	TH_CHECK(hang_ms >= 1500 && hang_ms < 10000, "the op rank 3 slept "
		 "through took %llu ms (timeout 2 s)",
		 (unsigned long long)hang_ms);
	TH_CHECK(next_ms < 1000, "the op after it took %llu ms: it waited "
		 "for the masked rank", (unsigned long long)next_ms);
	const uint64_t late_ms = s->took_ms[3];
	TH_CHECK(late_ms < 1000, "the late rank's op took %llu ms: it waited "
		 "for a timeout, not for the marks of the ranks that gave it "
		 "up", (unsigned long long)late_ms);

	memset((void *)s->took_ms, 0, sizeof(s->took_ms));
	th_spawn(p, W, hole_rank, s);
	TH_CHECK(th_wait_all(p, W, 90) == 0, "a rank of the hole phase");
	uint64_t hole_ms = 0;
	for (int i = 0; i < W; i++)
		if (i != 2)
			hole_ms = s->took_ms[i] > hole_ms ? s->took_ms[i] : hole_ms;
	TH_CHECK(hole_ms >= 1500 && hole_ms < 3400, "the others' op of the "
		 "hole took %llu ms (timeout 2 s, the late rank 3.5 s)",
		 (unsigned long long)hole_ms);

	memset((void *)s->took_ms, 0, sizeof(s->took_ms));
	th_spawn(p, W, graph_rank, s);
	TH_CHECK(th_wait_all(p, W, 90) == 0, "a rank of the graph phase");
	uint64_t graph_ms = 0;
	for (int i = 0; i < W - 1; i++)
		graph_ms = s->took_ms[i] > graph_ms ? s->took_ms[i] : graph_ms;
	TH_CHECK(graph_ms < 5000, "the replay after rank 3 left took %llu ms "
		 "(timeout 20 s)", (unsigned long long)graph_ms);

	memset((void *)s->rc, 0, sizeof(s->rc));
	th_spawn(p, W, disagree_rank, s);
	TH_CHECK(th_wait_all(p, W, 90) == 0, "a rank of the disagree phase");
	int mism = 0;
	for (int i = 0; i < W; i++) {
		TH_CHECK(s->rc[i] == EP_EMISMATCH || s->rc[i] == EP_EFAILED,
			 "rank %d: the op of differing masks returned %s", i,
			 ep_strerror(s->rc[i]));
		mism += s->rc[i] == EP_EMISMATCH;
	}
	TH_CHECK(mism > 0, "no rank reported EP_EMISMATCH");
	TH_CHECK(th_daemon_alive(&d), "the daemon died");
	th_daemon_stop(&d);
	printf("ok: leave: the survivors' op ended in %llu ms (timeout 20 s) "
	       "with rank 3 masked, 13 op pairs after it bitwise (plain, "
	       "hooks, zero copy) with 3 and then 2 ranks, the barrier "
	       "masked the rank that left; hang: the op ended at the timeout "
	       "(%llu ms) with the sleeper masked, the next in %llu ms, the "
	       "late rank's op ran alone (%llu ms); hole: the others' op "
	       "ended at the timeout (%llu ms) with the late source's rows a "
	       "hole and its experts left out; graph: a captured op pair "
	       "replayed bitwise, then without the rank that left (%llu ms); "
	       "disagree: %d of %d ranks EP_EMISMATCH, the rest EP_EFAILED, "
	       "NaN outputs\n",
	       (unsigned long long)leave_ms, (unsigned long long)hang_ms,
	       (unsigned long long)next_ms, (unsigned long long)late_ms,
	       (unsigned long long)hole_ms, (unsigned long long)graph_ms, mism,
	       W);
	return 0;
}
