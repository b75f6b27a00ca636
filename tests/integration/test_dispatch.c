/* SPDX-License-Identifier: MIT */
/*
 * Property test of layout, dispatch, cached dispatch and combine on the
 * daemon, against the independent reference in tests/lib/ref.c, over fixed
 * corner cases and fresh random shapes and routings. Every comparison is
 * bitwise. Outputs are poisoned before each run, and what lies past the
 * received rows must still be poison afterwards.
 *
 * EPD_TEST_SEED=N repeats a run; EPD_TEST_CASES=N sets the random cases.
 */
#include "harness.h"
#include "ref.h"

#include <string.h>
#include <time.h>

#define POISON 0xa5
#define POISONED(n) th_poisoned((n), POISON)
#define ALL_POISON(p, n) th_all_is((p), (n), POISON)

struct ctx {
	const struct th_daemon *d;
	struct ref_case c;
	int index;
};

/* Find the first differing element for a useful message. */
#define SAME(got, want, n, what)                                               \
	do {                                                                   \
		size_t d_ = th_first_diff(got, want, n);                       \
		TH_CHECK(d_ == (size_t)(n),                                    \
			 "case %d rank %d: %s differs at byte %zu", x->index,  \
			 r, what, d_);                                         \
	} while (0)

static int case_rank(int r, void *arg)
{
	struct ctx *x = arg;
	const struct ref_case *c = &x->c;
	const uint32_t W = c->world, H = c->hidden, K = c->topk,
		       E = c->experts, elt = ref_elt(c), ns = H / 128;
	const uint32_t per = E / W;
	struct ref_inputs in[8], in2[8];
	struct ref_recv exp[8], exp2[8];
	ref_gen_world(c, in, in2, exp, exp2);
	char name[32];
	snprintf(name, sizeof(name), "prop%d", x->index);
	struct ep_group_config cfg = {
		.name = name, .world_size = W, .ranks_per_node = W,
		.rank = (uint32_t)r, .num_experts = E, .hidden = H,
		.max_tokens_per_rank = c->max_tokens, .topk = K,
		.dtype = (ep_dtype_t)c->dtype, .timeout_ms = 30000};
	ep_conn_t *conn;
	ep_group_t *g = th_join(x->d, &cfg, &conn);
	const struct ref_inputs *me = &in[r];
	const struct ref_recv *want = &exp[r];

	/* Layout. */
	int32_t *pr = malloc(W * 4), *pe = malloc(E * 4), *rpr = malloc(W * 4),
		*rpe = malloc(E * 4);
	uint8_t *ir = malloc((size_t)me->T * W + 1),
		*rir = malloc((size_t)me->T * W + 1);
	TH_OK(ep_get_dispatch_layout(g, me->topk, me->T, pr, pe, ir));
	ref_layout(c, me, rpr, rpe, rir);
	SAME(pr, rpr, W * 4, "num_tokens_per_rank");
	SAME(pe, rpe, E * 4, "num_tokens_per_expert");
	SAME(ir, rir, (size_t)me->T * W, "is_token_in_rank");

	/* Dispatch, copy path, poisoned outputs. */
	const uint64_t cap = (uint64_t)W * c->max_tokens;
	struct ep_dispatch_in din = {
		.num_tokens = me->T, .hidden = H, .dtype = (ep_dtype_t)c->dtype,
		.topk = K, .x = me->x, .x_scales = me->scales,
		.topk_idx = me->topk,
		.topk_weights = c->weights ? me->weights : NULL};
	struct ep_dispatch_out dout = {
		.capacity = cap,
		.recv_x = POISONED(cap * H * elt),
		.recv_x_scales = POISONED(cap * ns * 4),
		.recv_topk_idx = POISONED(cap * K * 8),
		.recv_topk_weights = POISONED(cap * K * 4),
		.num_recv_tokens_per_expert = POISONED(per * 4)};
	ep_handle_t h;
	TH_OK(ep_dispatch(g, &din, NULL, &dout, &h));
	const uint64_t R = want->R;
	TH_CHECK(dout.num_recv == R && h.num_recv == R,
		 "case %d rank %d: received %u rows, want %llu", x->index, r,
		 dout.num_recv, (unsigned long long)R);
	TH_CHECK(h.num_tokens == me->T, "handle num_tokens");
	SAME(dout.recv_x, want->x, R * H * elt, "recv_x");
	TH_CHECK(ALL_POISON((uint8_t *)dout.recv_x + R * H * elt,
			    (cap - R) * H * elt),
		 "case %d rank %d: recv_x written past row %llu", x->index, r,
		 (unsigned long long)R);
	if (c->dtype == EP_DTYPE_FP8)
		SAME(dout.recv_x_scales, want->scales, R * ns * 4,
		     "recv_x_scales");
	SAME(dout.recv_topk_idx, want->topk, R * K * 8, "recv_topk_idx");
	TH_CHECK(ALL_POISON((uint8_t *)dout.recv_topk_idx + R * K * 8,
			    (cap - R) * K * 8),
		 "recv_topk_idx written past the rows");
	SAME(dout.recv_topk_weights, want->weights, R * K * 4,
	     "recv_topk_weights");
	SAME(dout.num_recv_tokens_per_expert, want->per_expert, per * 4,
	     "num_recv_tokens_per_expert");
	/* the same counts from ep_dispatch_recv_expert_counts */
	int32_t *pex = POISONED(per * 4 + 4);
	TH_OK(ep_dispatch_recv_expert_counts(g, &h, pex, per));
	SAME(pex, want->per_expert, per * 4, "ep_dispatch_recv_expert_counts");
	TH_EXPECT_RC(ep_dispatch_recv_expert_counts(g, &h, pex, per - 1),
		     EP_EINVAL);
	TH_EXPECT_RC(ep_dispatch_recv_expert_counts(g, &h, NULL, per),
		     EP_EINVAL);
	ep_handle_t hx = h;
	hx.epoch++;
	TH_EXPECT_RC(ep_dispatch_recv_expert_counts(g, &hx, pex, per),
		     EP_ESTALE);
	free(pex);
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	SAME(b.recv_src, want->src, R * 8, "recv_src");
	int32_t rp[64];
	ref_rank_prefix(c, exp, rp);
	SAME(b.rank_prefix_matrix, rp, W * W * 4, "rank_prefix_matrix");

	/* Run it again: identical bytes. */
	struct ep_dispatch_out dout2 = dout;
	dout2.recv_x = POISONED(cap * H * elt);
	ep_handle_t h2;
	TH_OK(ep_dispatch(g, &din, NULL, &dout2, &h2));
	TH_CHECK(h2.seq == h.seq + 1 && h2.num_recv == h.num_recv,
		 "second dispatch handle");
	SAME(dout2.recv_x, dout.recv_x, R * H * elt, "recv_x of a rerun");

	/* Cached dispatch of new data equals a fresh dispatch of it. */
	struct ep_dispatch_in din2 = din;
	din2.x = in2[r].x;
	din2.x_scales = in2[r].scales;
	memset(dout2.recv_x, POISON, cap * H * elt);
	memset(dout2.recv_x_scales, POISON, cap * ns * 4);
	ep_handle_t hc;
	/* a cached dispatch writes the handle's rank_prefix_matrix too */
	memset((void *)b.rank_prefix_matrix, POISON, W * W * 4);
	TH_OK(ep_dispatch(g, &din2, &h, &dout2, &hc));
	SAME(b.rank_prefix_matrix, rp, W * W * 4, "cached rank_prefix_matrix");
	TH_CHECK(hc.seq == h.seq && hc.num_recv == R, "cached handle");
	SAME(dout2.recv_x, exp2[r].x, R * H * elt, "cached recv_x");
	if (c->dtype == EP_DTYPE_FP8)
		SAME(dout2.recv_x_scales, exp2[r].scales, R * ns * 4,
		     "cached recv_x_scales");
	struct ep_dispatch_out dout3 = dout;
	dout3.recv_x = POISONED(cap * H * elt);
	ep_handle_t h3;
	TH_OK(ep_dispatch(g, &din2, NULL, &dout3, &h3));
	SAME(dout3.recv_x, dout2.recv_x, R * H * elt,
	     "fresh vs cached dispatch");

	/* Combine of random rows (and bias) along the first handle. */
	uint16_t *ys[8];
	for (uint32_t d = 0; d < W; d++)
		ys[d] = ref_gen_y(c, d, exp[d].R, 7);
	uint16_t *out = POISONED((size_t)me->T * H * 2);
	uint16_t *rout = malloc((size_t)me->T * H * 2 + 2);
	TH_OK(ep_combine(g, &h, ys[r], (uint32_t)R, H,
			 c->bias ? me->bias : NULL, out));
	ref_combine(c, in, exp, ys, (uint32_t)r, rout);
	SAME(out, rout, (size_t)me->T * H * 2, "combined");
	/* with a second bias after the first (DeepEP's pair): new data's */
	struct ep_combine_in cin2 = {.y = ys[r], .num_rows = (uint32_t)R,
				     .hidden = H,
				     .bias = c->bias ? me->bias : NULL,
				     .bias2 = in2[r].bias};
	struct ep_combine_out cout2 = {.out = out};
	memset(out, POISON, (size_t)me->T * H * 2);
	TH_OK(ep_combine_ex(g, &h, &cin2, &cout2));
	uint16_t *rout2 = malloc((size_t)me->T * H * 2 + 2);
	ref_combine2(c, in, exp, ys, (uint32_t)r, in2[r].bias, rout2);
	SAME(out, rout2, (size_t)me->T * H * 2, "combined with two biases");

	/* DeepEP V2's order (EP_COMBINE_TOPK_ORDER, this rank's choice
	 * alone: odd ranks only): rows by each rank's last top-k slot, read
	 * from the topk_idx field at the combine. The field holds the
	 * dispatch's rows with every third token's reversed, so that rows
	 * the dispatch did not route by still decide the order, and one
	 * token's row names no rank at all (its ranks follow ascending). */
	{
		const unsigned of = r % 2 ? EP_COMBINE_TOPK_ORDER : 0;
		int64_t *tk = malloc((size_t)me->T * K * 8 + 8);
		for (uint32_t t = 0; t < me->T; t++)
			for (uint32_t k = 0; k < K; k++)
				tk[(size_t)t * K + k] =
					t % 3 == 1 ? me->topk[(size_t)t * K +
							      K - 1 - k]
					: t == 2 ? -1
						 : me->topk[(size_t)t * K + k];
		memcpy(b.topk_idx, tk, (size_t)me->T * K * 8);
		memcpy(b.combine_y, ys[r], (size_t)R * H * 2);
		if (c->bias)
			memcpy(b.combine_bias, me->bias, (size_t)me->T * H * 2);
		memcpy(b.combine_bias2, in2[r].bias, (size_t)me->T * H * 2);
		TH_OK(ep_combine_inplace(g, &h,
					 (c->bias ? EP_COMBINE_BIAS : 0) |
						 EP_COMBINE_BIAS2 | of));
		ref_combine_topk(c, in, exp, ys, (uint32_t)r, in2[r].bias,
				 of ? tk : NULL, rout2);
		SAME(b.combined, rout2, (size_t)me->T * H * 2,
		     of ? "combined in top-k order" : "combined beside one in "
						      "top-k order");
		free(tk);
	}
	free(rout2);

	/* The same combine summing top-k weights too (DeepEP's
	 * combined_topk_weights): each rank's rows get weights of mixed
	 * signs and scales, so that the order of the fp32 sums shows. */
	float *wy[8];
	for (uint32_t d = 0; d < W; d++)
		wy[d] = ref_gen_cw(c, d, exp[d].R);
	float *cw = POISONED((size_t)me->T * K * 4);
	float *rcw = malloc((size_t)me->T * K * 4 + 4);
	memset(out, POISON, (size_t)me->T * H * 2);
	struct ep_combine_in cin = {.y = ys[r], .num_rows = (uint32_t)R,
				    .hidden = H,
				    .bias = c->bias ? me->bias : NULL,
				    .topk_weights = wy[r]};
	struct ep_combine_out cout = {.out = out, .combined_topk_weights = cw};
	TH_OK(ep_combine_ex(g, &h, &cin, &cout));
	ref_combine_weights(c, me->T, exp, wy, (uint32_t)r, rcw);
	SAME(out, rout, (size_t)me->T * H * 2, "combined (with weights)");
	SAME(cw, rcw, (size_t)me->T * K * 4, "combined_topk_weights");
	/* weights out but none in (rows to give them for): refused before
	 * anything is sent */
	cin.topk_weights = NULL;
	if (R)
		TH_EXPECT_RC(ep_combine_ex(g, &h, &cin, &cout), EP_EINVAL);
	for (uint32_t d = 0; d < W; d++)
		free(wy[d]);
	free(cw);
	free(rcw);

	/* Combine of the dispatched rows themselves: n copies of the token,
	 * exact in fp32 for n <= 8, so one rounding gives bf16(n * x). */
	if (c->dtype == EP_DTYPE_BF16 && !c->bias) {
		uint16_t *back = POISONED((size_t)me->T * H * 2);
		TH_OK(ep_combine(g, &h, (const uint16_t *)dout.recv_x,
				 (uint32_t)R, H, NULL, back));
		for (uint32_t t = 0; t < me->T; t++) {
			int n = 0;
			for (uint32_t d = 0; d < W; d++)
				n += rir[(size_t)t * W + d];
			for (uint32_t j = 0; j < H; j++) {
				uint16_t xv;
				memcpy(&xv, me->x + ((size_t)t * H + j) * 2, 2);
				/* sent nowhere: +0, not n * x = -0 */
				uint16_t wantv =
					n ? ref_bf16((float)n * ref_f32(xv))
					  : 0;
				TH_CHECK(back[(size_t)t * H + j] == wantv,
					 "case %d rank %d token %u: combine "
					 "of %d copies gave 0x%04x, want "
					 "0x%04x",
					 x->index, r, t, n,
					 back[(size_t)t * H + j], wantv);
			}
		}
		free(back);
	}

	TH_OK(ep_leave(g));
	ep_close(conn);
	return 0;
}

static void run_case(const struct th_daemon *d, struct ctx *x)
{
	pid_t pids[8];
	th_spawn(pids, (int)x->c.world, case_rank, x);
	TH_CHECK(th_wait_all(pids, (int)x->c.world, 120) == 0,
		 "case %d failed (seed %llu)", x->index,
		 (unsigned long long)x->c.seed);
}

static uint64_t rs; /* the random series */

int main(void)
{
	th_init("dispatch/combine property test", 600);
	uint64_t seed = th_seed();
	int ncases = getenv("EPD_TEST_CASES") ? atoi(getenv("EPD_TEST_CASES"))
					      : 30;
	rs = seed;
	struct th_daemon d;
	th_daemon_start(&d, NULL);
	struct ctx *x = th_shared(sizeof(*x));
	x->d = &d;
	/* world 1 (nothing to send), every rank empty, the shared corners,
	 * the DeepSeek-V3 hidden with top-8 of 256 experts */
	struct ref_case fixed[3 + REF_CORNERS] = {
		{.world = 1, .experts = 4, .hidden = 128, .topk = 2,
		 .max_tokens = 16, .tokens = {0}, .dtype = EP_DTYPE_BF16},
		{.world = 8, .experts = 16, .hidden = 256, .topk = 4,
		 .max_tokens = 32, .dtype = EP_DTYPE_BF16},
	};
	memcpy(&fixed[2], ref_corners, sizeof(ref_corners));
	fixed[2 + REF_CORNERS] = (struct ref_case){
		.world = 8, .experts = 256, .hidden = 7168, .topk = 8,
		.max_tokens = 64, .tokens = {64, 64, 64, 64, 64, 64, 64, 64},
		.dtype = EP_DTYPE_BF16, .weights = true};
	int n = 0;
	for (size_t i = 0; i < sizeof(fixed) / sizeof(fixed[0]); i++, n++) {
		x->c = fixed[i];
		x->c.seed = seed + (uint64_t)i;
		x->index = n;
		run_case(&d, x);
		printf("ok: case %d (fixed): world %u E %u H %u K %u %s\n", n,
		       x->c.world, x->c.experts, x->c.hidden, x->c.topk,
		       x->c.dtype == EP_DTYPE_FP8 ? "fp8" : "bf16");
	}
	for (int i = 0; i < ncases; i++, n++) {
		struct ref_case *c = &x->c;
		ref_random_case(c, &rs, seed, i, 512);
		x->index = n;
		run_case(&d, x);
		printf("ok: case %d: world %u E %u H %u K %u T_max %u %s "
		       "mode %d%s%s\n",
		       n, c->world, c->experts, c->hidden, c->topk,
		       c->max_tokens, c->dtype == EP_DTYPE_FP8 ? "fp8" : "bf16",
		       c->mode, c->weights ? " weights" : "",
		       c->bias ? " bias" : "");
	}
	th_daemon_stop(&d);
	printf("ok: %d cases bitwise equal to the reference\n", n);
	return 0;
}
