/* SPDX-License-Identifier: MIT */
/*
 * A hostile peer in the low-latency mode of GPU ranks across nodes
 * (libep_llx.c): 4 ranks, 2 nodes of 2 over tcp. Ranks 0-2 run ep_ll_*;
 * rank 3 joins the group and then, in place of libep's kernels, joins
 * the mode's pseudo group by its name itself and dispatches pseudo tokens
 * it forged: what a rank running a modified libep can send. Each received
 * row's place among its source's rows rides in the pseudo token's weight
 * word, which the daemons carry untouched, so only the receiving kernels
 * stand between a forged word and a write.
 *
 * Each phase is an op pair. Before it, every honest rank fills the
 * buffer its dispatch will use with a sentinel. Its outputs are checked
 * against a host group of the same ranks on another daemon (the host path,
 * which test_gpu_ll_host shows bitwise equal to this one), where rank 3
 * sends no tokens. Honest tokens avoid rank 3's experts. Rank 3 is the last
 * source, so the honest sources' rows keep their places (begin b3 of
 * rank 3's rows):
 *
 *   normal  rank 3 sends nothing: everything equal to the host group's
 *   range   2 rows to every honest expert, places >= 2 (2, 0x7fffffff,
 *           0xfffffffe): ETOOBIG on every honest rank, none of them
 *           written anywhere (the sentinel stays past b3), layout counts
 *           them as rank 3's
 *   dup     3 rows to every honest expert, all at place 1: no error, slot
 *           b3 + 1 holds rank 3's rows (each 16 bytes one of the three),
 *           b3 and b3 + 2 keep the sentinel
 *   mark    the too-many-tokens mark on one row to each honest rank:
 *           ETOOBIG on each, nothing counted or written
 *   flood   64 rows (the pseudo group's maximum) to rank 0's expert 0 at
 *           places 0..63: rows b3 + p < W*N in place, recv_count clamped
 *           to W*N, ETOOBIG where b3 > 0
 *   expert  an expert index out of range in the pseudo group's top-k: the
 *           daemons fail that op alone on every rank, and its combine
 *           (EP_ESTALE); the honest ranks' mode ends with the cause
 *           (EP_EEXPERT: ep_ll_error, every later call), recv_count 0,
 *           the combine's output NaN, no wait past the timeout
 *
 * In every phase before the last, every honest rank's rows from honest
 * sources, their src_info, and its combined tokens are bitwise equal to the
 * host group's, and its later ops run normally: a peer can misplace only
 * its own rows. Then all four ranks leave and run a new group on the same
 * daemons, rank 3 honest, bitwise equal to the host group.
 *
 * Exit 77 without a GPU, or where ranks share a GPU without MPS.
 */
#include "gpu_util.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define W 4
#define RPN 2
#define N 16
#define H 512
#define K 4
#define El 4
#define E (W * El)
#define WN (W * N)
#define BAD (W - 1)     /* the hostile rank */
#define PN (N * K)      /* the pseudo group's max_tokens */
#define SENT 0xffc1u    /* a NaN no input row holds */

enum { P_NORMAL, P_RANGE, P_DUP, P_MARK, P_FLOOD, P_EXPERT };
static const int phases[] = {P_NORMAL, P_NORMAL, P_RANGE, P_DUP,   P_MARK,
			     P_FLOOD,  P_NORMAL, P_DUP,   P_EXPERT};
#define NPH ((int)(sizeof(phases) / sizeof(phases[0])))
static const char *const pname[] = {"normal", "range", "dup",
				    "mark",   "flood", "expert"};

struct shared {
	const struct th_daemon *host, *node[2];
	uint64_t seed;
};

struct in {
	uint32_t T;
	uint16_t x[N * H];
	int64_t topk[N * K];
	float w[N * K];
};

/* An honest rank's inputs: T tokens, K distinct experts each (or -1),
 * rank 3's experts among them only when `all`. */
static void gen(uint64_t seed, int ph, int r, bool all, struct in *in)
{
	uint64_t s = seed * 1009 + (uint64_t)ph * 37 + (uint64_t)r;
	const uint32_t ne = all ? E : E - El;
	in->T = (uint32_t)(ref_mix(&s) % (N + 1));
	for (uint32_t t = 0; t < in->T; t++) {
		int sc = (int)(ref_mix(&s) % 20) - 10;
		for (int c = 0; c < H; c++)
			in->x[t * H + c] = tg_bf16_rand(&s, sc);
		for (int k = 0; k < K; k++) {
			int64_t e;
			bool dup;
			do {
				e = (int64_t)(ref_mix(&s) % ne);
				dup = false;
				for (int j = 0; j < k; j++)
					dup |= in->topk[t * K + j] == e;
			} while (dup);
			const uint64_t v = ref_mix(&s);
			in->topk[t * K + k] = v % 7 == 0 ? -1 : e;
			in->w[t * K + k] =
				(float)((int)(v >> 20 & 2047) - 1024) / 1021.0f;
		}
	}
}

static void gen_y(uint64_t seed, int ph, int r, uint16_t *y)
{
	uint64_t s = seed * 53 + (uint64_t)ph * 11 + (uint64_t)r + 7;
	for (uint64_t i = 0; i < (uint64_t)El * WN * H; i++)
		y[i] = tg_bf16_rand(&s, -1);
}

/* Rank 3's forged pseudo tokens of a phase: n of them, each row (random,
 * the phase's own), global expert and weight word. */
struct forged {
	uint32_t n;
	uint16_t x[PN * H];
	int64_t e[PN];
	uint32_t word[PN];
};

static void forge(uint64_t seed, int ph, int kind, struct forged *f)
{
	static const uint32_t far[] = {2, 0x7fffffffu, 0xfffffffeu};
	uint64_t s = seed * 7 + (uint64_t)ph * 1000003;
	f->n = 0;
	for (uint32_t q = 0; q < BAD && kind != P_NORMAL; q++) {
		for (uint32_t l = 0; l < El; l++) {
			const int64_t e = (int64_t)(q * El + l);
			switch (kind) {
			case P_RANGE:
				for (uint32_t j = 0; j < 2; j++) {
					f->e[f->n] = e;
					f->word[f->n++] =
						far[(q + l + j) % 3] + (j == 0);
				}
				break;
			case P_DUP:
				for (uint32_t j = 0; j < 3; j++) {
					f->e[f->n] = e;
					f->word[f->n++] = 1;
				}
				break;
			case P_MARK:
				if (l == 0) {
					f->e[f->n] = e;
					f->word[f->n++] = EKC_LLX_MARK;
				}
				break;
			case P_FLOOD:
				if (q == 0 && l == 0)
					for (uint32_t p = 0; p < PN; p++) {
						f->e[f->n] = e;
						f->word[f->n++] = p;
					}
				break;
			case P_EXPERT:
				if (q == 0 && l == 0) {
					f->e[f->n] = E + 5;
					f->word[f->n++] = 0;
				}
				break;
			}
		}
	}
	for (uint64_t i = 0; i < (uint64_t)f->n * H; i++)
		f->x[i] = tg_bf16_rand(&s, 0);
}

/* The pseudo group's name, as libep makes it from the group's (FNV-1a of
 * the name): what a peer needs to join it. */
static void pseudo_name(const char *name, char *out, size_t len)
{
	uint64_t h = 0xcbf29ce484222325ull;
	for (const char *p = name; *p; p++)
		h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
	snprintf(out, len, "%s:ll-%016llx", name, (unsigned long long)h);
}

struct out {
	int32_t count[El];
	int64_t layout[El * W];
	int32_t src[El * WN];
	uint16_t rx[El * WN * H];
	uint16_t comb[N * H];
	int rc_err;
};

static void take_dev(const struct ep_ll_recv *rv, struct out *o)
{
	CU(tg_drv.cuMemcpyDtoH(o->count, tg_dptr(rv->recv_count),
			       sizeof(o->count)));
	CU(tg_drv.cuMemcpyDtoH(o->layout, tg_dptr(rv->layout_range),
			       sizeof(o->layout)));
	CU(tg_drv.cuMemcpyDtoH(o->src, tg_dptr(rv->src_info), sizeof(o->src)));
	CU(tg_drv.cuMemcpyDtoH(o->rx, tg_dptr(rv->recv_x), sizeof(o->rx)));
}

static void take_host(const struct ep_ll_recv *rv, struct out *o)
{
	memcpy(o->count, rv->recv_count, sizeof(o->count));
	memcpy(o->layout, rv->layout_range, sizeof(o->layout));
	memcpy(o->src, rv->src_info, sizeof(o->src));
	memcpy(o->rx, rv->recv_x, sizeof(o->rx));
}

#define SAME(a, b, n, ...)                                                     \
	do {                                                                   \
		size_t d_ = th_first_diff((a), (b), (n));                      \
		char w_[96];                                                   \
		snprintf(w_, sizeof(w_), __VA_ARGS__);                         \
		TH_CHECK(d_ == (size_t)(n),                                    \
			 "phase %d (%s) rank %d: %s differs at byte %zu", ph,  \
			 pname[kind], r, w_, d_);                              \
	} while (0)

static bool sentinel_row(const uint16_t *row)
{
	for (int c = 0; c < H; c++)
		if (row[c] != SENT)
			return false;
	return true;
}

/* An honest rank's outputs of a phase (g: the GPU way, hb: the host
 * group's, rank 3 silent there) with what rank 3 forged (f). */
static void check(int ph, int kind, int r, const struct out *g,
		  const struct out *hb, const struct forged *f, uint32_t T,
		  bool sent)
{
	int want_err = 0;
	for (uint32_t el = 0; el < El; el++) {
		const uint32_t ge = (uint32_t)r * El + el;
		const uint64_t b3 = (uint64_t)hb->count[el];
		uint64_t c3 = 0;
		for (uint32_t i = 0; i < f->n; i++)
			c3 += f->e[i] == ge && f->word[i] != EKC_LLX_MARK;
		for (uint32_t i = 0; i < f->n; i++)
			if (f->e[i] == ge && (f->word[i] == EKC_LLX_MARK ||
					      f->word[i] >= c3))
				want_err = EP_ETOOBIG;
		if (b3 + c3 > WN)
			want_err = EP_ETOOBIG;
		SAME(g->layout + el * W, hb->layout + el * W, BAD * 8,
		     "expert %u: the honest sources' layout", el);
		TH_CHECK((uint64_t)g->layout[el * W + BAD] == (b3 << 32 | c3),
			 "phase %d (%s) rank %d expert %u: rank 3's layout "
			 "%llx, want %llx",
			 ph, pname[kind], r, el,
			 (unsigned long long)g->layout[el * W + BAD],
			 (unsigned long long)(b3 << 32 | c3));
		const uint64_t cnt = b3 + c3 > WN ? WN : b3 + c3;
		TH_CHECK((uint64_t)g->count[el] == cnt,
			 "phase %d (%s) rank %d expert %u: recv_count %d, want "
			 "%llu",
			 ph, pname[kind], r, el, g->count[el],
			 (unsigned long long)cnt);
		const size_t row0 = (size_t)el * WN;
		SAME(g->rx + row0 * H, hb->rx + row0 * H, b3 * H * 2,
		     "expert %u: the honest sources' rows", el);
		SAME(g->src + row0, hb->src + row0, b3 * 4,
		     "expert %u: the honest sources' src_info", el);
		/* rank 3's slots and past them */
		for (uint64_t j = b3; j < WN; j++) {
			const uint16_t *row = g->rx + (row0 + j) * H;
			const int32_t src = g->src[row0 + j];
			const uint64_t p = j - b3;
			/* which forged rows may sit at place p */
			bool any = false, in_row = true;
			for (int c = 0; c < H; c += 8) {
				bool chunk = false;
				for (uint32_t i = 0; i < f->n; i++)
					if (f->e[i] == ge && f->word[i] == p &&
					    p < c3 &&
					    !memcmp(row + c, f->x + (size_t)i * H + c,
						    16)) {
						chunk = true;
						any = true;
					}
				in_row &= chunk;
			}
			if (any) {
				TH_CHECK(in_row, "phase %d (%s) rank %d expert "
						 "%u slot %llu: part of a "
						 "forged row, part not",
					 ph, pname[kind], r, el,
					 (unsigned long long)j);
				TH_CHECK(src >= 0 && src < N,
					 "phase %d (%s) rank %d: a forged "
					 "row's src_info %d",
					 ph, pname[kind], r, src);
				continue;
			}
			/* no forged row belongs here: untouched */
			bool placed = false;
			for (uint32_t i = 0; i < f->n; i++)
				placed |= f->e[i] == ge && f->word[i] == p &&
					  p < c3;
			TH_CHECK(!placed, "phase %d (%s) rank %d expert %u slot "
					  "%llu: rank 3's row at place %llu "
					  "missing",
				 ph, pname[kind], r, el, (unsigned long long)j,
				 (unsigned long long)p);
			TH_CHECK(src == -1, "phase %d (%s) rank %d expert %u slot "
					    "%llu: src_info %d, no row there",
				 ph, pname[kind], r, el, (unsigned long long)j,
				 src);
			TH_CHECK(!sent || sentinel_row(row),
				 "phase %d (%s) rank %d expert %u slot %llu "
				 "written, no row belongs there",
				 ph, pname[kind], r, el, (unsigned long long)j);
		}
	}
	SAME(g->comb, hb->comb, (size_t)T * H * 2, "combined tokens");
	TH_CHECK(hb->rc_err == 0, "phase %d rank %d: the host group's error %d",
		 ph, r, hb->rc_err);
	TH_CHECK(g->rc_err == want_err,
		 "phase %d (%s) rank %d: ep_ll_error %s, want %s", ph,
		 pname[kind], r, ep_strerror(g->rc_err),
		 ep_strerror(want_err));
}

struct dev {
	CUdeviceptr x, tk, w, y, out;
};

static void dev_alloc(struct dev *d)
{
	CU(tg_drv.cuMemAlloc(&d->x, N * H * 2));
	CU(tg_drv.cuMemAlloc(&d->tk, N * K * 8));
	CU(tg_drv.cuMemAlloc(&d->w, N * K * 4));
	CU(tg_drv.cuMemAlloc(&d->y, (size_t)El * WN * H * 2));
	CU(tg_drv.cuMemAlloc(&d->out, N * H * 2));
}

static void dev_free(const struct dev *d)
{
	CU(tg_drv.cuMemFree(d->x));
	CU(tg_drv.cuMemFree(d->tk));
	CU(tg_drv.cuMemFree(d->w));
	CU(tg_drv.cuMemFree(d->y));
	CU(tg_drv.cuMemFree(d->out));
}

/* One op pair of the GPU way (xg) on in and y; outputs into o (combined
 * tokens after the combine); the buffer the dispatch used in *b. */
static void gpu_pair(ep_group_t *xg, CUstream st, const struct dev *d,
		     const struct in *in, const uint16_t *y, int *drc,
		     int *crc, struct ep_ll_recv *rv)
{
	if (in->T) {
		tg_upload(d->x, in->x, (size_t)in->T * H * 2);
		tg_upload(d->tk, in->topk, (size_t)in->T * K * 8);
		tg_upload(d->w, in->w, (size_t)in->T * K * 4);
	}
	tg_upload(d->y, y, (size_t)El * WN * H * 2);
	*drc = ep_ll_dispatch(xg, (void *)(uintptr_t)d->x,
			      (const int64_t *)(uintptr_t)d->tk, in->T, 0, st,
			      rv);
	*crc = *drc ? *drc
		    : ep_ll_combine(xg, rv->buffer, (const void *)(uintptr_t)d->y,
				    (const float *)(uintptr_t)d->w,
				    (void *)(uintptr_t)d->out, 0, st);
	CU(tg_drv.cuStreamSynchronize(st));
}

static void host_pair(ep_group_t *h, const struct in *in, const uint16_t *y,
		      struct out *o)
{
	struct ep_ll_recv rv;
	TH_OK(ep_ll_dispatch(h, in->x, in->topk, in->T, 0, NULL, &rv));
	take_host(&rv, o);
	TH_OK(ep_ll_combine(h, rv.buffer, y, in->w, o->comb, 0, NULL));
	o->rc_err = ep_ll_error(h);
}

static void honest(int r, struct shared *s, CUstream st, ep_group_t *xg,
		   ep_group_t *h)
{
	struct dev d;
	dev_alloc(&d);
	struct in *in = malloc(sizeof(*in));
	uint16_t *y = malloc((size_t)El * WN * H * 2);
	struct out *og = malloc(sizeof(*og)), *oh = malloc(sizeof(*oh));
	struct forged *f = malloc(sizeof(*f));
	TH_CHECK(in && y && og && oh && f, "out of memory");
	CUdeviceptr bufx[2] = {0, 0};
	for (int ph = 0; ph < NPH; ph++) {
		const int kind = phases[ph];
		gen(s->seed, ph, r, false, in);
		gen_y(s->seed, ph, r, y);
		forge(s->seed, ph, kind, f);
		const int b = ph % 2;
		if (bufx[b])
			CU(tg_drv.cuMemsetD32Async(bufx[b],
						   SENT << 16 | SENT,
						   (size_t)El * WN * H / 2, st));
		struct ep_ll_recv rv;
		int drc, crc;
		const uint64_t t0 = th_now_ns();
		gpu_pair(xg, st, &d, in, y, &drc, &crc, &rv);
		const double ms = (double)(th_now_ns() - t0) / 1e6;
		if (kind == P_EXPERT) {
			/* the pseudo dispatch failed alone on every rank, and
			 * its combine with it: the mode ends with the
			 * daemons' error; nothing was counted (no rows of an
			 * earlier op taken for this one's); the output is
			 * NaN */
			if (!drc) {
				take_dev(&rv, og);
				for (uint32_t el = 0; el < El; el++)
					TH_CHECK(og->count[el] == 0,
						 "rank %d: the failed pseudo "
						 "dispatch counted %d rows at "
						 "expert %u",
						 r, og->count[el], el);
			}
			CU(tg_drv.cuMemcpyDtoH(og->comb, d.out, sizeof(og->comb)));
			const int e = ep_ll_error(xg);
			TH_CHECK(e == EP_EEXPERT,
				 "rank %d: a peer's bad pseudo expert: "
				 "ep_ll_error %s (%s), want EP_EEXPERT",
				 r, ep_strerror(e), ep_errmsg());
			printf("rank %d: a peer's bad pseudo expert: %s (%s), "
			       "%.0f ms\n",
			       r, ep_strerror(e), ep_errmsg(), ms);
			for (uint32_t i = 0; !drc && i < in->T * H; i++)
				TH_CHECK((og->comb[i] & 0x7f80) == 0x7f80 &&
						 (og->comb[i] & 0x7f),
					 "rank %d: the failed combine's out[%u] "
					 "%04x, not NaN",
					 r, i, og->comb[i]);
			TH_CHECK(ms < 10000, "rank %d: the failed op took %.0f "
					     "ms",
				 r, ms);
			const int again = ep_ll_dispatch(
				xg, (void *)(uintptr_t)d.x,
				(const int64_t *)(uintptr_t)d.tk, in->T, 0, st,
				&rv);
			TH_CHECK(again == EP_EEXPERT,
				 "rank %d: the dispatch after the mode ended: "
				 "%s, want EP_EEXPERT",
				 r, ep_strerror(again));
			CU(tg_drv.cuStreamSynchronize(st));
			host_pair(h, in, y, oh); /* rank 3 in step there */
			break;
		}
		TH_CHECK(!drc && !crc, "phase %d (%s) rank %d: %s / %s: %s", ph,
			 pname[kind], r, ep_strerror(drc), ep_strerror(crc),
			 ep_errmsg());
		TH_CHECK(rv.buffer == (uint32_t)b, "rank %d: buffer %u, want %d",
			 r, rv.buffer, b);
		bufx[b] = tg_dptr(rv.recv_x);
		take_dev(&rv, og);
		CU(tg_drv.cuMemcpyDtoH(og->comb, d.out, sizeof(og->comb)));
		og->rc_err = ep_ll_error(xg);
		host_pair(h, in, y, oh);
		check(ph, kind, r, og, oh, f, in->T, ph >= 2);
	}
	dev_free(&d);
	free(in);
	free(y);
	free(og);
	free(oh);
	free(f);
}

/* Rank 3: the pseudo group joined by its name, its ops with forged
 * tokens; in the host group, no tokens. */
static void hostile(struct shared *s, ep_conn_t *xc, CUstream st, int gpu,
		    ep_group_t *h)
{
	char name[EP_GROUP_NAME_MAX + 1];
	pseudo_name("llxp", name, sizeof(name));
	const struct ep_group_config pc = {
		.name = name, .world_size = W, .ranks_per_node = RPN,
		.rank = BAD, .num_experts = E, .hidden = H,
		.max_tokens_per_rank = PN, .topk = 1, .dtype = EP_DTYPE_BF16,
		.timeout_ms = 20000, .cuda_device = gpu};
	ep_group_t *aux;
	TH_OK(ep_join(xc, &pc, EP_JOIN_CUDA, &aux));
	struct ep_buffers ab;
	TH_OK(ep_get_buffers(aux, &ab));
	struct forged *f = malloc(sizeof(*f));
	struct in *none = calloc(1, sizeof(*none));
	uint16_t *y = calloc((size_t)El * WN * H, 2);
	struct out *o = malloc(sizeof(*o));
	TH_CHECK(f && none && y && o, "out of memory");
	for (int ph = 0; ph < NPH; ph++) {
		const int kind = phases[ph];
		forge(s->seed, ph, kind, f);
		if (f->n) {
			tg_upload(tg_dptr(ab.x), f->x, (size_t)f->n * H * 2);
			tg_upload(tg_dptr(ab.topk_idx), f->e, (size_t)f->n * 8);
			tg_upload(tg_dptr(ab.topk_weights), f->word,
				  (size_t)f->n * 4);
		}
		ep_handle_t hd;
		int rc = ep_dispatch_stream(aux, f->n, EP_DISPATCH_WEIGHTS,
					    NULL, st, &hd);
		if (kind == P_EXPERT) {
			/* refused here or failed on the stream (then its
			 * combine follows, as libep's would): either way the
			 * op is over, on every rank */
			if (!rc)
				(void)ep_combine_stream(aux, &hd, 0, st);
			CU(tg_drv.cuStreamSynchronize(st));
			if (!rc)
				rc = ep_group_error(aux);
			/* the op's own error, or the group's after the
			 * combine of a dispatch that failed */
			TH_CHECK(rc == EP_EEXPERT || rc == EP_ESTALE,
				 "rank 3: its bad pseudo expert: %s (%s)",
				 ep_strerror(rc), ep_errmsg());
		} else {
			TH_CHECK(!rc, "phase %d: rank 3's forged dispatch: %s "
				      "(%s)",
				 ph, ep_strerror(rc), ep_errmsg());
			TH_OK(ep_combine_stream(aux, &hd, 0, st));
			CU(tg_drv.cuStreamSynchronize(st));
			TH_OK(ep_group_error(aux));
			TH_OK(ep_handle_release(aux, &hd));
		}
		host_pair(h, none, y, o); /* in step with the host group */
		if (kind == P_EXPERT)
			break; /* as the honest ranks: the mode is over */
	}
	TH_OK(ep_leave(aux));
	free(f);
	free(none);
	free(y);
	free(o);
}

static int rank_main(int r, void *arg)
{
	struct shared *s = arg;
	int gpu;
	CUstream st = tg_rank_init(r, &gpu, NULL, 0, NULL);
	struct ep_group_config cfg = {
		.name = "llxp", .world_size = W, .ranks_per_node = RPN,
		.rank = (uint32_t)r, .num_experts = E, .hidden = H,
		.max_tokens_per_rank = N, .topk = K, .dtype = EP_DTYPE_BF16,
		.timeout_ms = 20000, .cuda_device = gpu};
	ep_conn_t *xc, *hc;
	ep_group_t *xg, *h;
	TH_OK(ep_connect(s->node[r / RPN]->sock, &xc));
	TH_OK(ep_join(xc, &cfg, EP_JOIN_CUDA, &xg));
	struct ep_group_config hcfg = cfg;
	hcfg.ranks_per_node = W;
	h = th_join(s->host, &hcfg, &hc);
	if (r == BAD)
		hostile(s, xc, st, gpu, h);
	else
		honest(r, s, st, xg, h);
	TH_OK(ep_leave(xg));
	/* the daemons serve on: a new group, rank 3 honest now */
	cfg.name = "llxq";
	TH_OK(ep_join(xc, &cfg, EP_JOIN_CUDA, &xg));
	struct dev d;
	dev_alloc(&d);
	struct in *in = malloc(sizeof(*in));
	uint16_t *y = malloc((size_t)El * WN * H * 2);
	struct out *og = malloc(sizeof(*og)), *oh = malloc(sizeof(*oh));
	TH_CHECK(in && y && og && oh, "out of memory");
	const int ph = NPH, kind = P_NORMAL;
	gen(s->seed, ph, r, true, in);
	gen_y(s->seed, ph, r, y);
	struct ep_ll_recv rv;
	int drc, crc;
	gpu_pair(xg, st, &d, in, y, &drc, &crc, &rv);
	TH_CHECK(!drc && !crc, "rank %d: the new group: %s / %s: %s", r,
		 ep_strerror(drc), ep_strerror(crc), ep_errmsg());
	take_dev(&rv, og);
	CU(tg_drv.cuMemcpyDtoH(og->comb, d.out, sizeof(og->comb)));
	TH_OK(ep_ll_error(xg));
	host_pair(h, in, y, oh);
	SAME(og->count, oh->count, sizeof(og->count), "recv_count (new group)");
	SAME(og->layout, oh->layout, sizeof(og->layout), "layout (new group)");
	SAME(og->src, oh->src, sizeof(og->src), "src_info (new group)");
	for (uint32_t el = 0; el < El; el++)
		SAME(og->rx + (size_t)el * WN * H, oh->rx + (size_t)el * WN * H,
		     (size_t)oh->count[el] * H * 2, "rows (new group)");
	SAME(og->comb, oh->comb, (size_t)in->T * H * 2,
	     "combined tokens (new group)");
	dev_free(&d);
	free(in);
	free(y);
	free(og);
	free(oh);
	TH_OK(ep_leave(xg));
	TH_OK(ep_leave(h));
	ep_close(xc);
	ep_close(hc);
	return 0;
}

int main(void)
{
	th_init("gpu: a hostile peer in the low-latency mode across nodes", 240);
	if (tg_probe())
		return TH_SKIP;
	struct th_daemon dh, dn[2];
	th_daemon_start(&dh, NULL);
	tg_cluster2(dn, "epdllpeer", 20);
	struct shared *s = th_shared(sizeof(*s));
	s->host = &dh;
	s->node[0] = &dn[0];
	s->node[1] = &dn[1];
	s->seed = th_seed();
	pid_t p[W];
	th_spawn(p, W, rank_main, s);
	TH_CHECK(th_wait_all(p, W, 200) == 0, "a rank failed");
	TH_CHECK(th_daemon_alive(&dn[0]) && th_daemon_alive(&dn[1]) &&
			 th_daemon_alive(&dh),
		 "a daemon died");
	th_daemon_stop(&dh);
	th_daemon_stop(&dn[0]);
	th_daemon_stop(&dn[1]);
	printf("ok: a peer's forged pseudo tokens across two nodes (places "
	       "past its rows, duplicate places, a false too-many mark, a "
	       "flood past W*N, a bad expert): the honest ranks' rows, "
	       "src_info and combined tokens bitwise equal to the host path, "
	       "nothing written where no row belongs, ETOOBIG where the "
	       "peer's rows could not be placed, the bad expert's op failed "
	       "with EP_EEXPERT and the mode ended; a new group on the same "
	       "daemons bitwise\n");
	return 0;
}
