/* SPDX-License-Identifier: MIT */
/*
 * An independent reference for dispatch and combine, written from the
 * definition (doc/design.md, section 3) as a plain all-to-all, sharing no code
 * with kernels/. Inputs are generated from a seed, so every rank can build
 * every other rank's inputs and the whole expected result.
 */
#ifndef TH_REF_H
#define TH_REF_H

#include <stdbool.h>
#include <stdint.h>

enum ref_mode {
	REF_RANDOM,     /* experts at random, some -1 */
	REF_ONE_EXPERT, /* every token to one expert */
	REF_SKIP_RANK,  /* no token to one rank */
	REF_ALL_NONE,   /* every entry -1 */
	REF_DUPS,       /* at random, a third of the entries after the first
			   repeating one before them (a router may) */
};

struct ref_case {
	uint64_t seed;
	uint32_t world, experts, hidden, topk, max_tokens;
	uint32_t tokens[8]; /* per rank */
	int dtype;          /* EP_DTYPE_BF16 or EP_DTYPE_FP8 */
	enum ref_mode mode;
	uint32_t special;   /* the expert of ONE_EXPERT, the rank of SKIP_RANK */
	bool weights, bias;
};

/* Inputs of rank r (arrays sized by the case; caller frees with ref_free). */
struct ref_inputs {
	uint32_t T;
	uint8_t *x;       /* [T, H * elt] */
	float *scales;    /* [T, H/128] or NULL */
	int64_t *topk;    /* [T, K] */
	float *weights;   /* [T, K] */
	uint16_t *bias;   /* [T, H] */
};

/* Expected dispatch result on rank d. */
struct ref_recv {
	uint32_t R;
	int32_t *src;     /* [R, 2] */
	uint8_t *x;       /* [R, H * elt] */
	float *scales;    /* [R, H/128] */
	int64_t *topk;    /* [R, K] */
	float *weights;   /* [R, K] */
	int32_t *per_expert; /* [E/W] */
};

uint32_t ref_elt(const struct ref_case *c);
/* Case i of a random series: world 1..8, experts a power-of-two multiple of
 * the world, hidden 128..1024, top-1..8, T_max 1..max_tokens with uneven T
 * (a quarter of them 0), a third fp8, weights and bias at random, mostly
 * random routing, else all-to-one-expert or a skipped rank. *rs is the
 * series' state, seeded by the caller. */
void ref_random_case(struct ref_case *c, uint64_t *rs, uint64_t seed, int i,
		     uint32_t max_tokens);
/* Corner cases every backend's property test runs (seed left 0): uneven T
 * with a 0, all tokens to one expert, no token to one rank, every entry
 * -1 (combine gives the bias), fp8 with scales. */
#define REF_CORNERS 5
extern const struct ref_case ref_corners[REF_CORNERS];
void ref_gen_inputs(const struct ref_case *c, uint32_t rank, uint64_t salt,
		    struct ref_inputs *in);
void ref_free_inputs(struct ref_inputs *in);
/* The rows rank d receives, from every rank's inputs in[W]. */
void ref_dispatch(const struct ref_case *c, const struct ref_inputs *in,
		  uint32_t d, struct ref_recv *out);
void ref_free_recv(struct ref_recv *r);
/* DeepEP's rank_prefix_matrix [W, W] from every rank's expected receive
 * lists exp[W]: entry [s][d] counts the rows of exp[d] from ranks <= s. */
void ref_rank_prefix(const struct ref_case *c, const struct ref_recv *exp,
		     int32_t *rp);
/* Every rank's inputs in[W] (salt 0) and in2[W] (salt 1: new data, the
 * same routing), and what every rank receives from each: exp[W], exp2[W]. */
void ref_gen_world(const struct ref_case *c, struct ref_inputs *in,
		   struct ref_inputs *in2, struct ref_recv *exp,
		   struct ref_recv *exp2);
/* Combine output of home rank h, given each rank's combine input y[d]
 * ([R_d, H] bf16) and the expected receive lists recv[d]. */
void ref_combine(const struct ref_case *c, const struct ref_inputs *in,
		 const struct ref_recv *recv, uint16_t *const *y, uint32_t h,
		 uint16_t *out);
/* The same with a second bias [T, H] added after the first (DeepEP's
 * pair; NULL: none). */
void ref_combine2(const struct ref_case *c, const struct ref_inputs *in,
		  const struct ref_recv *recv, uint16_t *const *y, uint32_t h,
		  const uint16_t *bias2, uint16_t *out);
/* ref_combine2 summing each token's rows in DeepEP V2's order: ranks
 * sorted by the position of their last slot in the token's row of topk
 * ([T, K], the order's top-k), ranks that row does not name after them in
 * ascending rank (EP_COMBINE_TOPK_ORDER). */
void ref_combine_topk(const struct ref_case *c, const struct ref_inputs *in,
		      const struct ref_recv *recv, uint16_t *const *y,
		      uint32_t h, const uint16_t *bias2, const int64_t *topk,
		      uint16_t *out);
/* Combine weights for rank d's R rows ([R, K] f32, malloc'd): mixed signs
 * and scales, so that the order of the sums shows. */
float *ref_gen_cw(const struct ref_case *c, uint32_t d, uint32_t R);
/* combined_topk_weights of home rank h (its T tokens), given each rank's
 * combine weights w[d] ([R_d, K] f32): per token and slot, the fp32 sum
 * from +0.0 over the ranks its rows are on, in ascending rank order. */
void ref_combine_weights(const struct ref_case *c, uint32_t T,
			 const struct ref_recv *recv, float *const *w,
			 uint32_t h, float *out);
/* Layout of rank r's inputs. */
void ref_layout(const struct ref_case *c, const struct ref_inputs *in,
		int32_t *per_rank, int32_t *per_expert, uint8_t *in_rank);
/* Random bf16 combine input for rank d, R rows, with rare NaNs (any
 * payload), infinities, the largest finite values and -0.0. */
uint16_t *ref_gen_y(const struct ref_case *c, uint32_t d, uint32_t R,
		    uint64_t salt);
/* float -> e4m3 (bias 7, 0x7f the NaN): the nearest value by search,
 * ties to the even code, saturated at +-448; the sign kept (-0.0 ->
 * 0x80). */
uint8_t ref_e4m3(float f);
/* splitmix64's step: the next value of the stream *s (the generator
 * behind every ref_gen_*; tests draw their own inputs with it too). */
uint64_t ref_mix(uint64_t *s);
/* A float's bits, and the float of bits. */
uint32_t ref_bits(float f);
float ref_float(uint32_t u);
/* float -> bf16, round to nearest even; bf16 -> float. */
uint16_t ref_bf16(float f);
float ref_f32(uint16_t b);

#endif
