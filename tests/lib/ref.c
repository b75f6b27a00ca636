/* SPDX-License-Identifier: MIT */
#include "ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ep/ep.h"

/* splitmix64: a stream per (seed, rank, salt, purpose). */
struct rng {
	uint64_t s;
};

uint64_t ref_mix(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint64_t rnext(struct rng *r)
{
	return ref_mix(&r->s);
}

static struct rng rstream(uint64_t seed, uint64_t a, uint64_t b, uint64_t c)
{
	struct rng r = {seed ^ (a * 0x1000003ull) ^ (b << 20) ^ (c << 40)};
	rnext(&r);
	return r;
}

uint32_t ref_bits(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	return u;
}

float ref_float(uint32_t u)
{
	float f;
	memcpy(&f, &u, 4);
	return f;
}

float ref_f32(uint16_t b)
{
	return ref_float((uint32_t)b << 16);
}

/* e4m3 value of code c (0..0x7e) */
static double e4m3_val(int c)
{
	int ex = (c >> 3) & 15, m = c & 7;
	return ex ? ldexp(1.0 + m / 8.0, ex - 7) : ldexp(m, -9);
}

uint8_t ref_e4m3(float f)
{
	if (isnan(f))
		return 0x7f;
	double a = fabs((double)f);
	int best = 0;
	for (int c = 1; c <= 0x7e; c++) {
		double dc = fabs(e4m3_val(c) - a), db = fabs(e4m3_val(best) - a);
		if (dc < db || (dc == db && !(c & 1)))
			best = c;
	}
	return (uint8_t)((signbit(f) ? 0x80 : 0) | best);
}

/* Round to nearest, ties to even, by looking at the dropped bits; every
 * NaN to the canonical 0x7fff. */
uint16_t ref_bf16(float f)
{
	const uint32_t u = ref_bits(f);
	if (isnan(f)) /* every NaN: the canonical one */
		return 0x7fff;
	uint32_t hi = u >> 16, lo = u & 0xffff;
	if (lo > 0x8000 || (lo == 0x8000 && (hi & 1)))
		hi++;
	return (uint16_t)hi;
}

/* A finite bf16 of moderate magnitude (about 2^-7 .. 2^3). */
static uint16_t rand_bf16(struct rng *r)
{
	uint64_t v = rnext(r);
	uint16_t sign = (uint16_t)((v & 1) << 15);
	uint16_t exp = (uint16_t)(120 + (v >> 1) % 11);
	uint16_t man = (uint16_t)((v >> 8) & 0x7f);
	return (uint16_t)(sign | exp << 7 | man);
}

uint32_t ref_elt(const struct ref_case *c)
{
	return c->dtype == EP_DTYPE_FP8 ? 1 : 2;
}

void ref_gen_inputs(const struct ref_case *c, uint32_t rank, uint64_t salt,
		    struct ref_inputs *in)
{
	const uint32_t T = c->tokens[rank], H = c->hidden, K = c->topk;
	const uint32_t E = c->experts, per = E / c->world;
	struct rng r = rstream(c->seed, rank, salt, 1);
	struct rng rt = rstream(c->seed, rank, 0, 2); /* routing: no salt */
	in->T = T;
	in->x = malloc((size_t)T * H * ref_elt(c) + 1);
	in->scales = c->dtype == EP_DTYPE_FP8
			     ? malloc((size_t)T * (H / 128) * 4 + 1)
			     : NULL;
	in->topk = malloc((size_t)T * K * 8 + 1);
	in->weights = malloc((size_t)T * K * 4 + 1);
	in->bias = malloc((size_t)T * H * 2 + 1);
	for (size_t i = 0; i < (size_t)T * H; i++) {
		if (c->dtype == EP_DTYPE_FP8) {
			in->x[i] = (uint8_t)rnext(&r); /* any bits travel */
		} else {
			uint16_t v = rand_bf16(&r);
			memcpy(in->x + 2 * i, &v, 2);
		}
	}
	if (in->scales)
		for (size_t i = 0; i < (size_t)T * (H / 128); i++)
			in->scales[i] =
				(float)(rnext(&r) % 100000) / 1000.0f + 0.001f;
	for (size_t i = 0; i < (size_t)T * H; i++)
		in->bias[i] = rand_bf16(&r);
	for (size_t i = 0; i < (size_t)T * K; i++)
		in->weights[i] = (float)(rnext(&r) % 1000) / 999.0f;
	for (uint32_t t = 0; t < T; t++) {
		int64_t *row = in->topk + (size_t)t * K;
		for (uint32_t k = 0; k < K; k++) {
			int64_t e = -1;
			switch (c->mode) {
			case REF_RANDOM:
				if (rnext(&rt) % 7 == 0)
					break;
				/* distinct experts in a token, as a router
				 * gives them */
				for (int tries = 0; tries < 100; tries++) {
					int64_t cand = (int64_t)(rnext(&rt) % E);
					bool dup = false;
					for (uint32_t j = 0; j < k; j++)
						dup |= row[j] == cand;
					if (!dup) {
						e = cand;
						break;
					}
				}
				break;
			case REF_ONE_EXPERT:
				e = k == 0 ? (int64_t)c->special : -1;
				break;
			case REF_SKIP_RANK:
				if (E == per) /* one rank only: nothing */
					break;
				for (;;) {
					int64_t cand = (int64_t)(rnext(&rt) % E);
					if (cand / per != c->special) {
						e = cand;
						break;
					}
				}
				break;
			case REF_ALL_NONE:
				break;
			case REF_DUPS:
				e = k && rnext(&rt) % 3 == 0
					    ? row[rnext(&rt) % k]
					    : (int64_t)(rnext(&rt) % (E + 1)) - 1;
				break;
			}
			row[k] = e;
		}
	}
}

void ref_free_inputs(struct ref_inputs *in)
{
	free(in->x);
	free(in->scales);
	free(in->topk);
	free(in->weights);
	free(in->bias);
}

static bool goes_to(const struct ref_case *c, const int64_t *row, uint32_t d)
{
	uint32_t per = c->experts / c->world;
	for (uint32_t k = 0; k < c->topk; k++)
		if (row[k] >= 0 && (uint32_t)(row[k] / per) == d)
			return true;
	return false;
}

void ref_dispatch(const struct ref_case *c, const struct ref_inputs *in,
		  uint32_t d, struct ref_recv *out)
{
	const uint32_t H = c->hidden, K = c->topk, per = c->experts / c->world;
	const size_t rowb = (size_t)H * ref_elt(c), ns = H / 128;
	uint32_t R = 0;
	for (uint32_t s = 0; s < c->world; s++)
		for (uint32_t t = 0; t < in[s].T; t++)
			R += goes_to(c, in[s].topk + (size_t)t * K, d);
	out->R = R;
	out->src = malloc((size_t)R * 8 + 1);
	out->x = malloc(R * rowb + 1);
	out->scales = malloc((size_t)R * ns * 4 + 1);
	out->topk = malloc((size_t)R * K * 8 + 1);
	out->weights = malloc((size_t)R * K * 4 + 1);
	out->per_expert = calloc(per, 4);
	uint32_t i = 0;
	for (uint32_t s = 0; s < c->world; s++) {
		for (uint32_t t = 0; t < in[s].T; t++) {
			const int64_t *row = in[s].topk + (size_t)t * K;
			if (!goes_to(c, row, d))
				continue;
			out->src[2 * i] = (int32_t)s;
			out->src[2 * i + 1] = (int32_t)t;
			memcpy(out->x + i * rowb, in[s].x + t * rowb, rowb);
			if (c->dtype == EP_DTYPE_FP8)
				memcpy(out->scales + i * ns,
				       in[s].scales + t * ns, ns * 4);
			for (uint32_t k = 0; k < K; k++) {
				bool here = row[k] >= 0 &&
					    (uint32_t)(row[k] / per) == d;
				out->topk[(size_t)i * K + k] =
					here ? row[k] - (int64_t)(d * per) : -1;
				out->weights[(size_t)i * K + k] =
					here && c->weights
						? in[s].weights[(size_t)t * K +
								k]
						: 0.0f;
			}
			/* tokens per local expert, a token once per expert */
			for (uint32_t j = 0; j < per; j++)
				for (uint32_t k = 0; k < K; k++)
					if (out->topk[(size_t)i * K + k] ==
					    (int64_t)j) {
						out->per_expert[j]++;
						break;
					}
			i++;
		}
	}
}

void ref_free_recv(struct ref_recv *r)
{
	free(r->src);
	free(r->x);
	free(r->scales);
	free(r->topk);
	free(r->weights);
	free(r->per_expert);
}

void ref_combine(const struct ref_case *c, const struct ref_inputs *in,
		 const struct ref_recv *recv, uint16_t *const *y, uint32_t h,
		 uint16_t *out)
{
	ref_combine2(c, in, recv, y, h, NULL, out);
}

void ref_combine2(const struct ref_case *c, const struct ref_inputs *in,
		  const struct ref_recv *recv, uint16_t *const *y, uint32_t h,
		  const uint16_t *bias2, uint16_t *out)
{
	ref_combine_topk(c, in, recv, y, h, bias2, NULL, out);
}

void ref_combine_topk(const struct ref_case *c, const struct ref_inputs *in,
		      const struct ref_recv *recv, uint16_t *const *y,
		      uint32_t h, const uint16_t *bias2, const int64_t *topk,
		      uint16_t *out)
{
	const uint32_t H = c->hidden, W = c->world, K = c->topk;
	const uint32_t per = c->experts / W;
	for (uint32_t t = 0; t < in[h].T; t++) {
		/* the row of (h, t) on each rank, -1 where it did not go */
		int64_t at[8];
		for (uint32_t d = 0; d < c->world; d++) {
			at[d] = -1;
			for (uint32_t i = 0; i < recv[d].R; i++)
				if (recv[d].src[2 * i] == (int32_t)h &&
				    recv[d].src[2 * i + 1] == (int32_t)t) {
					at[d] = i;
					break;
				}
		}
		/* each rank's sort key: its last slot in the top-k row, or
		 * K + rank for a rank the row does not name; then a
		 * selection sort of the ranks with a row */
		uint32_t key[8], ord[8], n = 0;
		for (uint32_t d = 0; d < W; d++) {
			key[d] = K + d;
			for (uint32_t k = 0; topk && k < K; k++) {
				int64_t e = topk[(size_t)t * K + k];
				if (e >= 0 && e < c->experts && e / per == d)
					key[d] = k;
			}
			if (at[d] >= 0)
				ord[n++] = d;
		}
		for (uint32_t i = 0; i < n; i++)
			for (uint32_t j = i + 1; j < n; j++)
				if (key[ord[j]] < key[ord[i]]) {
					uint32_t tmp = ord[i];
					ord[i] = ord[j];
					ord[j] = tmp;
				}
		for (uint32_t j = 0; j < H; j++) {
			float acc = c->bias ? ref_f32(in[h].bias[(size_t)t * H +
								  j])
					    : 0.0f;
			if (bias2)
				acc += ref_f32(bias2[(size_t)t * H + j]);
			for (uint32_t i = 0; i < n; i++)
				acc += ref_f32(
					y[ord[i]][(size_t)at[ord[i]] * H + j]);
			out[(size_t)t * H + j] = ref_bf16(acc);
		}
	}
}

float *ref_gen_cw(const struct ref_case *c, uint32_t d, uint32_t R)
{
	uint64_t g = c->seed * 0x9e3779b97f4a7c15ull + d + 1;
	float *w = malloc((size_t)R * c->topk * 4 + 4);
	for (size_t i = 0; i < (size_t)R * c->topk; i++) {
		g = g * 6364136223846793005ull + 1442695040888963407ull;
		w[i] = (float)((int)(g >> 40) % 20001 - 10000) /
		       (float)(1 + (g >> 33) % 97);
	}
	return w;
}

void ref_combine_weights(const struct ref_case *c, uint32_t T,
			 const struct ref_recv *recv, float *const *w,
			 uint32_t h, float *out)
{
	const uint32_t K = c->topk;
	for (uint32_t t = 0; t < T; t++)
		for (uint32_t k = 0; k < K; k++) {
			float acc = 0.0f;
			for (uint32_t d = 0; d < c->world; d++)
				for (uint32_t i = 0; i < recv[d].R; i++)
					if (recv[d].src[2 * i] == (int32_t)h &&
					    recv[d].src[2 * i + 1] ==
						    (int32_t)t) {
						acc += w[d][(size_t)i * K + k];
						break;
					}
			if (isnan(acc)) { /* the canonical NaN */
				const uint32_t u = 0x7fffffffu;
				memcpy(&acc, &u, sizeof(acc));
			}
			out[(size_t)t * K + k] = acc;
		}
}

void ref_rank_prefix(const struct ref_case *c, const struct ref_recv *exp,
		     int32_t *rp)
{
	const uint32_t W = c->world;
	for (uint32_t s = 0; s < W; s++)
		for (uint32_t d = 0; d < W; d++) {
			int32_t n = 0;
			for (uint32_t i = 0; i < exp[d].R; i++)
				n += exp[d].src[(size_t)i * 2] <= (int32_t)s;
			rp[(size_t)s * W + d] = n;
		}
}

void ref_layout(const struct ref_case *c, const struct ref_inputs *in,
		int32_t *per_rank, int32_t *per_expert, uint8_t *in_rank)
{
	const uint32_t K = c->topk;
	memset(per_rank, 0, c->world * 4);
	memset(per_expert, 0, c->experts * 4);
	for (uint32_t t = 0; t < in->T; t++) {
		const int64_t *row = in->topk + (size_t)t * K;
		for (uint32_t d = 0; d < c->world; d++) {
			in_rank[(size_t)t * c->world + d] = goes_to(c, row, d);
			per_rank[d] += goes_to(c, row, d);
		}
		for (uint32_t e = 0; e < c->experts; e++)
			for (uint32_t k = 0; k < K; k++)
				if (row[k] == (int64_t)e) {
					per_expert[e]++;
					break;
				}
	}
}

uint16_t *ref_gen_y(const struct ref_case *c, uint32_t d, uint32_t R,
		    uint64_t salt)
{
	struct rng r = rstream(c->seed, d, salt, 3);
	uint16_t *y = malloc((size_t)R * c->hidden * 2 + 2);
	for (size_t i = 0; i < (size_t)R * c->hidden; i++) {
		y[i] = rand_bf16(&r);
		/* now and then a value whose sum is special: a NaN with
		 * any payload and sign (the sum is the canonical NaN on
		 * every backend), an infinity, the largest finite value
		 * (a few of them overflow), -0.0 */
		const uint64_t v = rnext(&r);
		switch (v % 509) {
		case 0:
			y[i] = (uint16_t)(0x7f81u | ((v >> 16) & 0x807eu));
			break;
		case 1:
			y[i] = (uint16_t)(0x7f80u | ((v >> 16) & 0x8000u));
			break;
		case 2:
			y[i] = (uint16_t)(0x7f7fu | ((v >> 16) & 0x8000u));
			break;
		case 3:
			y[i] = 0x8000u;
			break;
		}
	}
	return y;
}

static uint32_t lcg(uint64_t *rs, uint32_t n)
{
	*rs = *rs * 6364136223846793005ull + 1442695040888963407ull;
	return n ? (uint32_t)((*rs >> 33) % n) : 0;
}

void ref_random_case(struct ref_case *c, uint64_t *rs, uint64_t seed, int i,
		     uint32_t max_tokens)
{
	memset(c, 0, sizeof(*c));
	c->seed = seed * 1000003ull + (uint64_t)i;
	c->world = 1 + lcg(rs, 8);
	c->experts = c->world * (1u << lcg(rs, 6));
	c->hidden = 128 * (1 + lcg(rs, 8));
	c->topk = 1 + lcg(rs, 8);
	c->max_tokens = 1 + lcg(rs, max_tokens);
	for (uint32_t r = 0; r < c->world; r++)
		c->tokens[r] = lcg(rs, 4) == 0 ? 0 : lcg(rs, c->max_tokens + 1);
	c->dtype = lcg(rs, 3) == 0 ? EP_DTYPE_FP8 : EP_DTYPE_BF16;
	c->weights = lcg(rs, 2);
	c->bias = lcg(rs, 2);
	uint32_t m = lcg(rs, 10);
	c->mode = m < 6	   ? REF_RANDOM
		  : m < 7  ? REF_DUPS
		  : m < 8  ? REF_ONE_EXPERT
			   : REF_SKIP_RANK;
	c->special = c->mode == REF_ONE_EXPERT ? lcg(rs, c->experts)
					       : lcg(rs, c->world);
}

void ref_gen_world(const struct ref_case *c, struct ref_inputs *in,
		   struct ref_inputs *in2, struct ref_recv *exp,
		   struct ref_recv *exp2)
{
	for (uint32_t s = 0; s < c->world; s++) {
		ref_gen_inputs(c, s, 0, &in[s]);
		ref_gen_inputs(c, s, 1, &in2[s]);
	}
	for (uint32_t d = 0; d < c->world; d++) {
		ref_dispatch(c, in, d, &exp[d]);
		ref_dispatch(c, in2, d, &exp2[d]);
	}
}

const struct ref_case ref_corners[REF_CORNERS] = {
	{.world = 4, .experts = 32, .hidden = 384, .topk = 6,
	 .max_tokens = 512, .tokens = {0, 1, 300, 512},
	 .dtype = EP_DTYPE_BF16, .weights = true, .bias = true},
	{.world = 8, .experts = 64, .hidden = 256, .topk = 4,
	 .max_tokens = 128, .tokens = {128, 7, 99, 0, 128, 64, 1, 33},
	 .dtype = EP_DTYPE_BF16, .mode = REF_ONE_EXPERT, .special = 45,
	 .weights = true},
	{.world = 8, .experts = 64, .hidden = 128, .topk = 8,
	 .max_tokens = 200, .tokens = {200, 150, 100, 50, 0, 10, 20, 30},
	 .dtype = EP_DTYPE_BF16, .mode = REF_SKIP_RANK, .special = 3},
	{.world = 4, .experts = 8, .hidden = 128, .topk = 3,
	 .max_tokens = 64, .tokens = {64, 3, 0, 17},
	 .dtype = EP_DTYPE_BF16, .mode = REF_ALL_NONE, .bias = true},
	{.world = 8, .experts = 64, .hidden = 512, .topk = 8,
	 .max_tokens = 256, .tokens = {256, 100, 3, 0, 256, 77, 9, 200},
	 .dtype = EP_DTYPE_FP8, .weights = true, .bias = true},
};
