/* SPDX-License-Identifier: MIT */
/*
 * The low-latency mode (ep_ll_*) on host ranks, against a reference
 * written here from ep.h's definition (sharing no code with libep or
 * kernels/): every output bit for bit, on one node (4 ranks) and across
 * two daemons (2 x 2 ranks, tcp).
 *
 *  - rounds of fresh random routings (some -1, some experts repeated in a
 *    token) and token counts (0 .. max), rows with zeros, -0.0, tiny and
 *    large values; bf16 and the three fp8 casts (fp32 scales, rounded
 *    scales, UE8M0), receive hooks, zero-copy combines, two micro-batches
 *    in flight (dispatch A, dispatch B, both hooks, both combines);
 *  - a rank with more tokens than the maximum: its call returns
 *    EP_ETOOBIG, every rank's ep_ll_error reports it, its rows are not
 *    sent, the next op is whole again; an expert index out of range: the
 *    sender's ep_ll_error reports EP_EEXPERT and that (token, k) is
 *    skipped;
 *  - a rank lost before the first low-latency call, or while the others
 *    wait for the pseudo group to form: their call fails with
 *    EP_EPEERLOST at once (the pseudo group is linked to the group);
 *  - a rank killed, a rank that leaves, a rank late past the timeout:
 *    the others' op fails (EP_EPEERLOST at once for the first two,
 *    EP_ETIMEDOUT for the third), and from then on every call returns
 *    that error, a refused dispatch reports no rows and a refused combine
 *    writes NaN; the late rank's own op fails too, never succeeds on rows
 *    out of step; a new group works;
 *  - argument errors, and the kernels' own calls (a narrower top-k,
 *    shrink mode) refused on host ranks.
 *
 * EPD_TEST_SEED=N repeats a run.
 */
#include "harness.h"
#include "ref.h"

#include <math.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXW 4
#define E 16
#define H 512
#define K 4
#define N 12
#define TIMEOUT_MS 20000

static struct th_daemon D1, DN[2];
static uint64_t seed;

/* ---- inputs: a splitmix64 stream per (round, rank, purpose) ---- */

static uint64_t stream(int round, int r, int what)
{
	return seed * 1000003u + (uint64_t)round * 7919u + (uint64_t)r * 131u +
	       (uint64_t)what;
}

/* A row value: mostly moderate, with zeros, -0.0, tiny and large ones,
 * each row with its own scale (so the fp8 scales differ). */
static uint16_t gen_val(uint64_t *s, float scale)
{
	uint64_t v = ref_mix(s);
	switch (v % 64) {
	case 0: return 0x0000;
	case 1: return 0x8000;
	case 2: return ref_bf16(scale * 1e-6f);
	case 3: return ref_bf16(-scale * 3.0f);
	default:
		return ref_bf16(scale * ((float)((v >> 8) % 20001) / 10000.0f -
				      1.0f));
	}
}

struct rin {
	uint32_t T;
	uint16_t x[N + 1][H];
	int64_t topk[N + 1][K];
	float w[N + 1][K];
};

/* Rank r's inputs of a round; too_many: N + 1 tokens, bad: one index E */
static void gen_in(int round, int r, bool too_many, bool bad,
		   struct rin *in)
{
	uint64_t s = stream(round, r, 1);
	in->T = too_many ? N + 1 : (uint32_t)(ref_mix(&s) % (N + 1));
	if (!too_many && ref_mix(&s) % 4 == 0)
		in->T = N;
	if (bad && !in->T)
		in->T = 1; /* a token to carry the bad index */
	for (uint32_t t = 0; t < in->T; t++) {
		float scale = ref_float(0x3f800000u +
				  (uint32_t)((int)(ref_mix(&s) % 40) - 20)
					  * 0x00800000u);
		for (int c = 0; c < H; c++)
			in->x[t][c] = gen_val(&s, scale);
		for (int k = 0; k < K; k++) {
			uint64_t v = ref_mix(&s);
			in->topk[t][k] = v % 9 == 0 ? -1
				       : (int64_t)((v >> 8) % E);
			in->w[t][k] = (float)((int)((v >> 20) % 2001) - 1000) /
				      997.0f;
		}
		if (ref_mix(&s) % 8 == 0) /* an expert repeated */
			in->topk[t][K - 1] = in->topk[t][0];
	}
	if (bad && in->T)
		in->topk[0][1] = E;
}

/* Expert d's output row for its place p of local expert el */
static uint16_t gen_y(int round, int d, uint32_t el, uint32_t p, int c)
{
	uint64_t s = stream(round, d, 2) ^ ((uint64_t)el << 40) ^
		     ((uint64_t)p << 20) ^ (uint64_t)c;
	return gen_val(&s, 0.5f);
}

/* ---- the reference ---- */

struct want {
	int32_t count[E];
	int64_t layout[E][MAXW];
	int32_t src[E][MAXW * N];
	/* each row's source (rank, token) */
	int32_t rs[E][MAXW * N], rt[E][MAXW * N];
};

/* What rank d receives; excluded[s]: rank s sent nothing */
static void ref_recv(const struct rin *in, int W, int d, struct want *w)
{
	const int El = E / W;
	memset(w, 0, sizeof(*w));
	memset(w->src, 0xff, sizeof(w->src));
	for (int el = 0; el < El; el++) {
		int64_t e = (int64_t)d * El + el, begin = 0;
		for (int s = 0; s < W; s++) {
			int64_t c = 0;
			uint32_t T = in[s].T > N ? 0 : in[s].T;
			for (uint32_t t = 0; t < T; t++)
				for (int k = 0; k < K; k++)
					if (in[s].topk[t][k] == e) {
						int p = (int)(begin + c++);
						w->src[el][p] = (int32_t)t;
						w->rs[el][p] = s;
						w->rt[el][p] = (int32_t)t;
					}
			w->layout[el][s] = begin << 32 | c;
			begin += c;
		}
		w->count[el] = (int32_t)begin;
	}
}

/* The place of (h, t, k) among rank d's rows of local expert el */
static int ref_place(const struct rin *in, int W, int h, uint32_t t, int k)
{
	const int El = E / W;
	const int64_t e = in[h].topk[t][k];
	int p = 0;
	for (int s = 0; s < W; s++) {
		uint32_t T = in[s].T > N ? 0 : in[s].T;
		for (uint32_t u = 0; u < T; u++)
			for (int j = 0; j < K; j++) {
				if (s == h && u == t && j == k)
					return p;
				if (in[s].topk[u][j] == e)
					p++;
			}
	}
	(void)El;
	return -1;
}

/* ---- one rank ---- */

struct run {
	const struct th_daemon *d[MAXW];
	int W, rpn;
	const char *name;
	int rounds;
};

#define SAME(got, want, n, fmt, ...)                                           \
	do {                                                                   \
		size_t d_ = th_first_diff((got), (want), (size_t)(n));        \
		TH_CHECK(d_ == (size_t)(n), "byte %zu differs: " fmt, d_,      \
			 __VA_ARGS__);                                         \
	} while (0)

static ep_group_t *join(const struct run *x, int r, const char *name,
			uint32_t timeout_ms, ep_conn_t **conn)
{
	struct ep_group_config cfg = {
		.name = name, .world_size = (uint32_t)x->W,
		.ranks_per_node = (uint32_t)x->rpn,
		.rank = (uint32_t)r, .num_experts = E, .hidden = H,
		.max_tokens_per_rank = N, .topk = K, .dtype = EP_DTYPE_BF16,
		.timeout_ms = timeout_ms};
	return th_join(x->d[r], &cfg, conn);
}

/* Check rank r's dispatch outputs (buffer in o) against the reference;
 * fp8: 0, or 1 / 2 / 3 (fp32 scales, rounded, UE8M0). */
static void check_recv(const struct rin *in, int W, int r, int round,
		       const struct ep_ll_recv *o, int fp8)
{
	const int El = E / W, WN = W * N, G = H / 128;
	struct want *w = malloc(sizeof(*w));
	ref_recv(in, W, r, w);
	TH_CHECK(o->local_experts == (uint32_t)El && o->max_recv == (uint32_t)WN,
		 "shape %u x %u", o->local_experts, o->max_recv);
	SAME(o->recv_count, w->count, El * 4, "round %d rank %d recv_count",
	     round, r);
	for (int el = 0; el < El; el++) {
		SAME(o->layout_range + el * W, w->layout[el], W * 8,
		     "round %d rank %d layout_range[%d]", round, r, el);
		SAME(o->src_info + el * WN, w->src[el], WN * 4,
		     "round %d rank %d src_info[%d]", round, r, el);
		for (int p = 0; p < w->count[el]; p++) {
			const uint16_t *x = in[w->rs[el][p]].x[w->rt[el][p]];
			const uint64_t row = (uint64_t)el * WN + p;
			if (!fp8) {
				SAME((const uint16_t *)o->recv_x + row * H, x,
				     H * 2, "round %d rank %d row %d/%d", round,
				     r, el, p);
				continue;
			}
			uint8_t q[H];
			uint32_t sb[H / 128];
			for (int g = 0; g < G; g++) {
				float amax = 0;
				for (int c = 0; c < 128; c++)
					amax = fmaxf(
					    amax,
					    fabsf(ref_f32(x[g * 128 + c])));
				amax = fmaxf(amax, 1e-4f);
				float scale = amax * (float)(1.0 / 448.0), mul;
				if (fp8 == 1) {
					mul = 448.0f / amax;
				} else {
					/* the next power of two up */
					float p2 = exp2f(ceilf(log2f(scale)));
					if (p2 < scale)
						p2 *= 2;
					if (p2 / 2 >= scale)
						p2 /= 2;
					scale = p2;
					mul = 1.0f / scale;
				}
				for (int c = 0; c < 128; c++) {
					volatile float v =
					    ref_f32(x[g * 128 + c]) * mul;
					q[g * 128 + c] = ref_e4m3(v);
				}
				sb[g] = ref_bits(scale);
			}
			SAME((const uint8_t *)o->recv_x + row * H, q, H,
			     "round %d rank %d fp8 row %d/%d", round, r, el, p);
			const uint32_t *sc = o->recv_scales;
			for (int g = 0; g < G; g++) {
				if (fp8 != 3) {
					TH_CHECK(sc[((uint64_t)el * G + g) * WN + p] ==
							 sb[g],
						 "round %d rank %d scale %d/%d/%d: "
						 "%08x want %08x",
						 round, r, el, p, g,
						 sc[((uint64_t)el * G + g) * WN + p],
						 sb[g]);
				} else if (g % 4 == 0) {
					uint32_t word = 0;
					for (int j = 0; j < 4; j++)
						word |= ((sb[g + j] >> 23) & 0xff)
							<< (8 * j);
					uint32_t got = sc[((uint64_t)el * (G / 4) +
							   g / 4) * WN + p];
					TH_CHECK(got == word,
						 "round %d rank %d ue8m0 %d/%d/%d: "
						 "%08x want %08x",
						 round, r, el, p, g, got, word);
				}
			}
		}
	}
	free(w);
}

/* Rank r's expert outputs (its received rows' places) into y [El, WN, H] */
static void fill_y(int W, int r, int round, uint16_t *y)
{
	const int El = E / W, WN = W * N;
	for (int el = 0; el < El; el++)
		for (int p = 0; p < WN; p++)
			for (int c = 0; c < H; c++)
				y[((uint64_t)el * WN + p) * H + c] =
					gen_y(round, r, (uint32_t)el,
					      (uint32_t)p, c);
}

static void check_out(const struct rin *in, int W, int r, int round,
		      const uint16_t *out)
{
	const int El = E / W;
	const uint32_t T = in[r].T > N ? 0 : in[r].T;
	for (uint32_t t = 0; t < T; t++) {
		float acc[H];
		for (int c = 0; c < H; c++)
			acc[c] = 0.0f;
		for (int k = 0; k < K; k++) {
			const int64_t e = in[r].topk[t][k];
			if (e < 0 || e >= E)
				continue;
			const int d = (int)(e / El);
			const int p = ref_place(in, W, r, t, k);
			for (int c = 0; c < H; c++) {
				volatile float prod =
				    ref_f32(gen_y(round, d, (uint32_t)(e % El),
						  (uint32_t)p, c)) *
				    in[r].w[t][k];
				acc[c] = acc[c] + prod;
			}
		}
		uint16_t want[H];
		for (int c = 0; c < H; c++)
			want[c] = ref_bf16(acc[c]);
		SAME(out + (uint64_t)t * H, want, H * 2,
		     "round %d rank %d combined token %u", round, r, t);
	}
}

static struct rin *world_in(int round, int W, int too_many, int bad)
{
	struct rin *in = calloc((size_t)W, sizeof(*in));
	for (int s = 0; s < W; s++)
		gen_in(round, s, s == too_many, s == bad, &in[s]);
	/* the reference skips what the senders skip */
	if (bad >= 0 && in[bad].T)
		in[bad].topk[0][1] = -1;
	return in;
}

static void ll_round(ep_group_t *g, const struct run *x, int r, int round,
		     unsigned dflags, unsigned cflags, int too_many, int bad)
{
	const int W = x->W, El = E / W, WN = W * N;
	struct rin *in = world_in(round, W, too_many, bad);
	struct rin mine;
	gen_in(round, r, r == too_many, r == bad, &mine);
	struct ep_ll_recv o;
	int rc = ep_ll_dispatch(g, mine.x, &mine.topk[0][0], mine.T, dflags,
				NULL, &o);
	if (r == too_many)
		TH_EXPECT_RC(rc, EP_ETOOBIG);
	else
		TH_OK(rc);
	if (dflags & EP_LL_HOOK)
		TH_OK(ep_ll_dispatch_hook(g, o.buffer, NULL));
	int fp8 = !(dflags & EP_LL_FP8)	      ? 0
		  : (dflags & EP_LL_UE8M0)       ? 3
		  : (dflags & EP_LL_ROUND_SCALE) ? 2
						 : 1;
	check_recv(in, W, r, round, &o, fp8);
	TH_EXPECT_RC(ep_ll_error(g), too_many >= 0 ? EP_ETOOBIG
				   : r == bad	 ? EP_EEXPERT
						 : 0);
	TH_OK(ep_ll_error(g)); /* read and cleared */
	uint16_t *y = malloc((size_t)El * WN * H * 2);
	if (cflags & EP_LL_ZERO_COPY) {
		void *rows;
		TH_OK(ep_ll_combine_buffer(g, o.buffer, &rows));
		fill_y(W, r, round, rows);
	} else {
		fill_y(W, r, round, y);
	}
	uint16_t *out = th_poisoned((size_t)(N + 1) * H * 2, 0xa5);
	TH_OK(ep_ll_combine(g, o.buffer,
			    cflags & EP_LL_ZERO_COPY ? NULL : y, &mine.w[0][0],
			    out, cflags, NULL));
	if (cflags & EP_LL_HOOK)
		TH_OK(ep_ll_combine_hook(g, o.buffer, NULL));
	check_out(in, W, r, round, out);
	free(out);
	free(y);
	free(in);
}

/* Two micro-batches: dispatch A and B (hooked), both hooks, both
 * combines (the second zero copy). */
static void ll_two(ep_group_t *g, const struct run *x, int r, int round)
{
	const int W = x->W, El = E / W, WN = W * N;
	struct rin *ia = world_in(round, W, -1, -1),
		   *ib = world_in(round + 1000, W, -1, -1);
	struct ep_ll_recv oa, ob;
	TH_OK(ep_ll_dispatch(g, ia[r].x, &ia[r].topk[0][0], ia[r].T,
			     EP_LL_HOOK, NULL, &oa));
	TH_OK(ep_ll_dispatch(g, ib[r].x, &ib[r].topk[0][0], ib[r].T,
			     EP_LL_HOOK | EP_LL_FP8, NULL, &ob));
	TH_CHECK(oa.buffer != ob.buffer, "both on buffer %u", oa.buffer);
	TH_OK(ep_ll_dispatch_hook(g, oa.buffer, NULL));
	TH_OK(ep_ll_dispatch_hook(g, ob.buffer, NULL));
	check_recv(ia, W, r, round, &oa, 0);
	check_recv(ib, W, r, round + 1000, &ob, 1);
	uint16_t *y = malloc((size_t)El * WN * H * 2);
	fill_y(W, r, round, y);
	void *rows;
	TH_OK(ep_ll_combine_buffer(g, ob.buffer, &rows));
	fill_y(W, r, round + 1000, rows);
	uint16_t *outa = malloc((size_t)N * H * 2),
		 *outb = malloc((size_t)N * H * 2);
	TH_OK(ep_ll_combine(g, oa.buffer, y, &ia[r].w[0][0], outa, EP_LL_HOOK,
			    NULL));
	TH_OK(ep_ll_combine(g, ob.buffer, NULL, &ib[r].w[0][0], outb,
			    EP_LL_ZERO_COPY, NULL));
	TH_OK(ep_ll_combine_hook(g, oa.buffer, NULL));
	check_out(ia, W, r, round, outa);
	check_out(ib, W, r, round + 1000, outb);
	free(outa);
	free(outb);
	free(y);
	free(ia);
	free(ib);
}

static int rounds_rank(int r, void *arg)
{
	const struct run *x = arg;
	ep_conn_t *conn;
	ep_group_t *g = join(x, r, x->name, TIMEOUT_MS, &conn);
	static const unsigned df[] = {
		0, EP_LL_HOOK, EP_LL_FP8, EP_LL_FP8 | EP_LL_ROUND_SCALE,
		EP_LL_FP8 | EP_LL_UE8M0 | EP_LL_HOOK, EP_LL_FP8 | EP_LL_UE8M0};
	static const unsigned cf[] = {0, EP_LL_HOOK, EP_LL_ZERO_COPY};
	for (int i = 0; i < x->rounds; i++)
		ll_round(g, x, r, i, df[i % 6], cf[i % 3], -1, -1);
	ll_two(g, x, r, 100);
	/* too many tokens on rank 1, then a bad index on rank 2, then whole
	 * again */
	ll_round(g, x, r, 200, 0, 0, 1, -1);
	ll_round(g, x, r, 201, EP_LL_FP8, 0, -1, 2);
	ll_round(g, x, r, 202, 0, EP_LL_ZERO_COPY, -1, -1);
	TH_OK(ep_leave(g));
	ep_close(conn);
	return 0;
}

/* ---- failures ---- */

enum fail { F_KILL, F_LEAVE, F_LATE, F_EARLY, F_JOINING, F_LATEJOIN };

struct fx {
	struct run run;
	enum fail how;
};

static int fail_rank(int r, void *arg)
{
	const struct fx *f = arg;
	const struct run *x = &f->run;
	const int W = x->W, El = E / W;
	const uint32_t tmo = f->how == F_LATE ? 1500 * th_scale() : TIMEOUT_MS;
	ep_conn_t *conn;
	ep_group_t *g = join(x, r, x->name, tmo, &conn);
	/* whole ops first: one checked, then pa and pb on the two buffers,
	 * every rank with N tokens */
	ll_round(g, x, r, 50, 0, 0, -1, -1);
	struct rin mine;
	gen_in(51, r, false, false, &mine);
	mine.T = N;
	struct ep_ll_recv o, pa, pb;
	uint16_t *y = calloc((size_t)El * W * N * H, 2);
	uint16_t *out = malloc((size_t)N * H * 2);
	TH_OK(ep_ll_dispatch(g, mine.x, &mine.topk[0][0], N, 0, NULL, &pa));
	TH_OK(ep_ll_combine(g, pa.buffer, y, &mine.w[0][0], out, 0, NULL));
	TH_OK(ep_ll_dispatch(g, mine.x, &mine.topk[0][0], N, 0, NULL, &pb));
	TH_OK(ep_ll_combine(g, pb.buffer, y, &mine.w[0][0], out, 0, NULL));
	TH_CHECK(pa.buffer != pb.buffer, "both on buffer %u", pa.buffer);
	const int victim = W - 1;
	if (r == victim) {
		if (f->how == F_KILL) {
			th_sleep_ms(300);
			raise(SIGKILL);
		}
		if (f->how == F_LEAVE) {
			th_sleep_ms(300);
			TH_OK(ep_leave(g));
			ep_close(conn);
			return 0;
		}
		/* late past the others' timeout: its own op fails too, it
		 * does not take rows out of step */
		th_sleep_ms(3000 * th_scale());
		int rc = ep_ll_dispatch(g, mine.x, &mine.topk[0][0], N, 0,
					NULL, &o);
		TH_CHECK(rc != 0, "the late rank's dispatch succeeded");
		TH_EXPECT_RC(ep_ll_error(g), rc);
		ep_close(conn);
		return 0;
	}
	/* the next dispatch goes to pa's buffer: its counts must become 0 */
	for (int el = 0; el < El; el++)
		pa.recv_count[el] = 77;
	uint64_t t0 = th_now_ns();
	int rc = ep_ll_dispatch(g, mine.x, &mine.topk[0][0], N, 0, NULL, &o);
	uint64_t ms = (th_now_ns() - t0) / 1000000;
	const int want = f->how == F_LATE ? EP_ETIMEDOUT : EP_EPEERLOST;
	TH_EXPECT_RC(rc, want);
	TH_CHECK(f->how == F_LATE || ms < TIMEOUT_MS / 4,
		 "the failure took %llu ms (the daemon knew at once)",
		 (unsigned long long)ms);
	for (int el = 0; el < El; el++)
		TH_CHECK(pa.recv_count[el] == 0,
			 "a failed dispatch reported %d rows", pa.recv_count[el]);
	/* from now on every call fails at once with the same error */
	for (int el = 0; el < El; el++)
		pa.recv_count[el] = 77;
	t0 = th_now_ns();
	TH_EXPECT_RC(ep_ll_dispatch(g, mine.x, &mine.topk[0][0], N,
				    EP_LL_FP8, NULL, &o),
		     want);
	for (int el = 0; el < El; el++)
		TH_CHECK(pa.recv_count[el] == 0,
			 "a refused dispatch reported %d rows",
			 pa.recv_count[el]);
	TH_EXPECT_RC(ep_ll_error(g), want);
	TH_EXPECT_RC(ep_ll_dispatch_hook(g, pb.buffer, NULL), want);
	memset(out, 0, (size_t)N * H * 2);
	TH_EXPECT_RC(ep_ll_combine(g, pb.buffer, y, &mine.w[0][0], out,
				   EP_LL_HOOK, NULL),
		     want);
	for (uint64_t i = 0; i < (uint64_t)N * H; i++)
		TH_CHECK((out[i] & 0x7fff) > 0x7f80,
			 "out[%llu] = %04x, not NaN", (unsigned long long)i,
			 out[i]);
	memset(out, 0, (size_t)N * H * 2);
	TH_EXPECT_RC(ep_ll_combine_hook(g, pb.buffer, NULL), want);
	TH_CHECK((out[0] & 0x7fff) > 0x7f80 &&
			 (out[(uint64_t)N * H - 1] & 0x7fff) > 0x7f80,
		 "a refused hook's out is not NaN");
	TH_CHECK(th_now_ns() - t0 < 2000000000ull * th_scale(),
		 "the refusals took %llu ms",
		 (unsigned long long)((th_now_ns() - t0) / 1000000));
	free(y);
	free(out);
	TH_OK(ep_leave(g));
	ep_close(conn);
	return 0;
}

/* A rank lost before the group's first low-latency call (which joins
 * the pseudo group, linked to the group): the others' first call fails
 * with EP_EPEERLOST at once, not at the timeout, whether the group had
 * failed already (early) or fails while they wait for the pseudo group
 * to form (joining), or while they wait in its first op for a rank that
 * comes after the loss (late join: across nodes, the pseudo group formed
 * on the others' node); later calls too. */
static int early_rank(int r, void *arg)
{
	const struct fx *f = arg;
	const struct run *x = &f->run;
	ep_conn_t *conn;
	ep_group_t *g = join(x, r, x->name, TIMEOUT_MS, &conn);
	if (r == x->W - 1) {
		if (f->how != F_EARLY)
			th_sleep_ms(300);
		raise(SIGKILL);
	}
	/* late join: the victim's node-mate comes after the loss (its join
	 * is refused; where the others formed the pseudo group, their op
	 * fails at once) */
	if (f->how == F_EARLY || (f->how == F_LATEJOIN && r == x->W - 2))
		th_sleep_ms(600);
	struct rin mine;
	gen_in(70, r, false, false, &mine);
	struct ep_ll_recv o;
	for (int i = 0; i < 2; i++) {
		uint64_t t0 = th_now_ns();
		TH_EXPECT_RC(ep_ll_dispatch(g, mine.x, &mine.topk[0][0],
					    mine.T, 0, NULL, &o),
			     EP_EPEERLOST);
		uint64_t ms = (th_now_ns() - t0) / 1000000;
		TH_CHECK(ms < TIMEOUT_MS / 4,
			 "call %d failed after %llu ms (the timeout is %d)", i,
			 (unsigned long long)ms, TIMEOUT_MS);
	}
	TH_OK(ep_leave(g));
	ep_close(conn);
	return 0;
}

/* A new group after the failure */
static int after_rank(int r, void *arg)
{
	const struct run *x = arg;
	ep_conn_t *conn;
	ep_group_t *g = join(x, r, x->name, TIMEOUT_MS, &conn);
	ll_round(g, x, r, 60, EP_LL_FP8, EP_LL_ZERO_COPY, -1, -1);
	TH_OK(ep_leave(g));
	ep_close(conn);
	return 0;
}

/* ---- argument errors (one rank alone, a group of one) ---- */

static void args_checks(void)
{
	ep_conn_t *conn;
	struct ep_group_config cfg = {
		.name = "ll-args", .world_size = 1, .ranks_per_node = 1,
		.rank = 0, .num_experts = E, .hidden = 128,
		.max_tokens_per_rank = N, .topk = K, .dtype = EP_DTYPE_BF16,
		.timeout_ms = TIMEOUT_MS};
	ep_group_t *g = th_join(&D1, &cfg, &conn);
	struct rin *mine = calloc(1, sizeof(*mine));
	struct ep_ll_recv o;
	TH_EXPECT_RC(ep_ll_dispatch(g, NULL, NULL, 1, 0, NULL, &o), EP_EINVAL);
	TH_EXPECT_RC(ep_ll_dispatch(g, mine->x, &mine->topk[0][0], 0, 0x10000,
				    NULL, &o),
		     EP_EINVAL);
	/* the kernels' own: a narrower top-k, shrink mode */
	TH_EXPECT_RC(ep_ll_dispatch(g, mine->x, &mine->topk[0][0], 0,
				    EP_LL_TOPK(K - 1), NULL, &o),
		     EP_EUNSUPPORTED);
	TH_EXPECT_RC(ep_ll_shrink(g), EP_EUNSUPPORTED);
	TH_EXPECT_RC(ep_ll_mask(g, 0, 1, NULL), EP_EUNSUPPORTED);
	TH_EXPECT_RC(ep_ll_mask_clean(g, NULL), EP_EUNSUPPORTED);
	TH_EXPECT_RC(ep_ll_barrier(g, NULL), EP_EUNSUPPORTED);
	TH_EXPECT_RC(ep_ll_mask_query(g, NULL, NULL), EP_EINVAL);
	TH_EXPECT_RC(ep_ll_shrink(NULL), EP_EINVAL);
	TH_EXPECT_RC(ep_ll_barrier(NULL, NULL), EP_EINVAL);
	TH_EXPECT_RC(ep_ll_dispatch(g, mine->x, &mine->topk[0][0], 0,
				    EP_LL_ROUND_SCALE, NULL, &o),
		     EP_EINVAL);
	TH_EXPECT_RC(ep_ll_dispatch(g, mine->x, &mine->topk[0][0], 0,
				    EP_LL_FP8 | EP_LL_UE8M0, NULL, &o),
		     EP_ESHAPE);
	TH_EXPECT_RC(ep_ll_combine(g, 0, mine->x, NULL, NULL, 0, NULL),
		     EP_EINVAL); /* no dispatch on buffer 0 yet */
	TH_EXPECT_RC(ep_ll_dispatch_hook(g, 2, NULL), EP_EINVAL);
	TH_EXPECT_RC(ep_ll_error(NULL), EP_EINVAL);
	TH_OK(ep_ll_error(g));
	TH_OK(ep_ll_dispatch(g, mine->x, &mine->topk[0][0], 0, EP_LL_TOPK(K),
			     NULL, &o)); /* the group's own width */
	/* a world of one: a dispatch and a combine to itself */
	uint64_t s = 5;
	mine->T = 3;
	for (uint32_t t = 0; t < 3; t++)
		for (int k = 0; k < K; k++) {
			mine->topk[t][k] = (int64_t)(ref_mix(&s) % E);
			mine->w[t][k] = 1.0f;
		}
	TH_OK(ep_ll_dispatch(g, mine->x, &mine->topk[0][0], 3, EP_LL_FP8, NULL,
			     &o));
	TH_EXPECT_RC(ep_ll_combine(g, o.buffer, NULL, NULL, NULL,
				   EP_LL_ZERO_COPY | EP_LL_HOOK, NULL),
		     EP_EINVAL);
	TH_EXPECT_RC(ep_ll_combine(g, o.buffer, NULL, &mine->w[0][0], NULL, 0,
				   NULL),
		     EP_EINVAL);
	int32_t total = 0;
	for (int el = 0; el < E; el++)
		total += o.recv_count[el];
	TH_CHECK(total == 3 * K, "a world of one received %d rows", total);
	TH_OK(ep_leave(g));
	ep_close(conn);
	free(mine);
}

static void run_all(struct run *x, const char *what)
{
	pid_t pids[MAXW];
	th_spawn(pids, x->W, rounds_rank, x);
	TH_CHECK(th_wait_all(pids, x->W, 300) == 0, "%s: a rank failed", what);
	printf("ok: %s: %d rounds (bf16, three fp8 casts, hooks, zero copy), "
	       "two micro-batches, too many tokens, a bad index: bitwise\n",
	       what, x->rounds);
	static const char *names[] = {"killed", "left", "late",
				      "lost before its first call",
				      "lost while the others joined",
				      "lost before its node-mate joined"};
	for (int how = F_EARLY; how <= F_LATEJOIN; how++) {
		char name[32];
		snprintf(name, sizeof(name), "lle-%d-%d", how, x->W);
		struct fx f = {.run = *x, .how = (enum fail)how};
		f.run.name = name;
		th_spawn(pids, x->W, early_rank, &f);
		th_reap(pids[x->W - 1], 60);
		TH_CHECK(th_wait_all(pids, x->W - 1, 120) == 0,
			 "%s, a rank %s: a rank failed", what, names[how]);
		printf("ok: %s: a rank %s: the others' first low-latency call "
		       "failed with EP_EPEERLOST at once\n",
		       what, names[how]);
	}
	for (int how = F_KILL; how <= F_LATE; how++) {
		char name[32];
		snprintf(name, sizeof(name), "llf-%s-%d", names[how], x->W);
		struct fx f = {.run = *x, .how = (enum fail)how};
		f.run.name = name;
		th_spawn(pids, x->W, fail_rank, &f);
		int bad = 0;
		for (int i = 0; i < x->W; i++) {
			if (how == F_KILL && i == x->W - 1) {
				th_reap(pids[i], 60);
				continue;
			}
			bad += th_wait_all(&pids[i], 1, 120);
		}
		TH_CHECK(bad == 0, "%s, a rank %s: %d ranks failed", what,
			 names[how], bad);
		snprintf(name, sizeof(name), "lla-%s-%d", names[how], x->W);
		struct run a = *x;
		a.name = name;
		th_spawn(pids, x->W, after_rank, &a);
		TH_CHECK(th_wait_all(pids, x->W, 120) == 0,
			 "%s: the group after a rank %s failed", what,
			 names[how]);
		printf("ok: %s: a rank %s: the others' op failed, every later "
		       "call too (no rows, NaN out); a new group is bitwise\n",
		       what, names[how]);
	}
}

int main(void)
{
	th_init("test_ll", 900);
	seed = th_seed();
	th_daemon_start(&D1, NULL);
	args_checks();
	printf("ok: argument errors\n");
	struct run one = {.W = 4, .rpn = 4, .name = "ll-one", .rounds = 12};
	for (int i = 0; i < 4; i++)
		one.d[i] = &D1;
	run_all(&one, "one node, 4 ranks");
	th_daemon_stop(&D1);

	/* two daemons, two ranks each */
	th_cluster_start(DN, 2, "epdll", NULL);
	struct run two = {.W = 4, .rpn = 2, .name = "ll-two", .rounds = 6,
			  .d = {&DN[0], &DN[0], &DN[1], &DN[1]}};
	run_all(&two, "two nodes, 2 ranks each");
	th_daemon_stop(&DN[0]);
	th_daemon_stop(&DN[1]);
	printf("ok\n");
	return 0;
}
