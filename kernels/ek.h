/* SPDX-License-Identifier: MIT */
/*
 * ek: the data-path kernels' interface, one per backend (host/, cuda/).
 *
 * Routing (doc/design.md, section 3): expert e lives on rank e / (E/W). Token t of
 * source rank s goes once to every rank that hosts one of its experts. On a
 * destination, rows are ordered by source rank, then source token; the row
 * of (s, t) on d is slot[s][t*W + d] = offset[s][d] + the number of tokens
 * of s before t that also go to d, with offset[s][d] the sum over s' < s of
 * count[s'][d]. Prefix sums only: the result does not depend on scheduling.
 */
#ifndef EK_H
#define EK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct ek_shape {
	uint32_t world;       /* ranks of the group */
	uint32_t num_experts; /* E, a multiple of world */
	uint32_t hidden;      /* H */
	uint32_t topk;        /* K */
	uint32_t elt;         /* bytes per element of x: 2 (bf16) or 1 (fp8) */
	uint32_t nscales;     /* H/128 for fp8, else 0 */
};

/* One rank's view of its buffers (NULL where unused). */
struct ek_rank_io {
	const void *x;
	const float *x_scales;
	const int64_t *topk_idx;
	const float *topk_weights; /* NULL: recv_topk_weights are zeros */
	void *recv_x;
	float *recv_scales;
	int64_t *recv_topk_idx;
	float *recv_topk_weights;
	int32_t *recv_src;        /* [R, 2]: source rank, source token */
	int32_t *recv_per_expert; /* [E/W] */
	const uint16_t *combine_y;
	const uint16_t *combine_bias; /* NULL: no bias */
	const uint16_t *combine_bias2; /* NULL: no second bias */
	/* combine: this home's tokens' top-k rows [T, K], whose slot order
	 * its sums follow (ek_combine_order); NULL: ascending rank */
	const int64_t *combine_topk;
	uint16_t *combined;
	/* combine with top-k weights: each received row's [K] f32 (every
	 * destination's), and the home rank's sums [T, K]; NULL: none */
	const float *combine_w;
	float *combined_w;
	int32_t *rank_prefix; /* [W, W]: rows of d from sources 0..s */
	uint32_t num_tokens;
};

/* The routing of one dispatch, for every rank of the group. */
struct ek_route {
	uint32_t world;
	uint32_t *num_tokens; /* [W] */
	int32_t **slot;       /* [W] arrays of [num_tokens[s] * W], -1: not sent */
	uint32_t *count;      /* [W * W]: count[s*W + d] */
	uint32_t *num_recv;   /* [W] */
};

struct ek_route *ek_route_new(uint32_t world, const uint32_t *num_tokens);
void ek_route_free(struct ek_route *r);

/* 0, or EP_EEXPERT with the first offending position in err. */
int ek_validate_topk(const struct ek_shape *s, const int64_t *topk_idx,
		     uint32_t num_tokens, char *err, size_t errlen);
/* Per-source pass: fills slot[src] with per-destination ordinals and
 * count[src*W + d]. Independent across sources. */
void ek_route_source(const struct ek_shape *s, struct ek_route *r,
		     uint32_t src, const int64_t *topk_idx);
/* After every source: ordinals become rows, num_recv is filled. */
void ek_route_finish(struct ek_route *r);

/* Copy tokens [t0, t1) of source `src` to every destination. cached: x and
 * scales only. io is indexed by rank. A destination with recv_x NULL is
 * skipped (another node's); a source with x NULL gets only its metadata
 * written (its rows come from another node). */
void ek_dispatch_tokens(const struct ek_shape *s, const struct ek_route *r,
			struct ek_rank_io *io, uint32_t src, uint32_t t0,
			uint32_t t1, bool cached);
/* recv_per_expert of destination d from its received rows. */
void ek_recv_per_expert(const struct ek_shape *s, const struct ek_route *r,
			struct ek_rank_io *io, uint32_t d);
/* rank_prefix of destination d (every rank's copy is the same matrix):
 * entry [s][d'] = the sum of count[s'][d'] over s' <= s. */
void ek_rank_prefix(const struct ek_route *r, struct ek_rank_io *io,
		    uint32_t d);
/* Combine tokens [t0, t1) of home rank h: fp32 accumulation starting from
 * the bias (if any), then rows in ek_combine_order's order, one rounding
 * to bf16 (nearest even); a second bias is added to the first before the
 * rows (DeepEP's pair: from +0.0 when there is no first). With io[h].combined_w, also the rows' top-k
 * weights: fp32 sums from +0.0 in the same order (no rounding). */
/* The ranks whose rows a home token's sum adds, in order, into ord [W];
 * returns how many. slot: the token's [W] rows (-1: not sent). With topk
 * (the token's [K] experts, read once): each rank at the position of its
 * last slot in topk (DeepEP V2's order; out-of-range experts name no rank), then
 * the ranks with a row that topk does not name, ascending; without:
 * ascending rank. */
uint32_t ek_combine_order(const struct ek_shape *s, const int32_t *slot,
			  const int64_t *topk, uint32_t *ord);
#define EK_MAX_WORLD 1024u /* ranks of a group (the protocol's limit) */
#define EK_MAX_TOPK 32u    /* a token's experts (the protocol's limit) */
void ek_combine_tokens(const struct ek_shape *s, const struct ek_route *r,
		       struct ek_rank_io *io, uint32_t h, uint32_t t0,
		       uint32_t t1);

/* get_dispatch_layout, a local computation: per_rank [W], per_expert [E],
 * in_rank [T, W] (0/1). */
void ek_layout(const struct ek_shape *s, const int64_t *topk_idx,
	       uint32_t num_tokens, int32_t *per_rank, int32_t *per_expert,
	       uint8_t *in_rank);

/* The low-latency mode's row arithmetic on the host (doc/design.md,
 * section 9), bit for bit what kernels/cuda/ekc_ll.cu computes. */
enum { EK_LL_FP8 = 1, EK_LL_FP8_ROUND = 2, EK_LL_FP8_UE8M0 = 3 };
/* One bf16 row x [H] (H % 128 == 0) to e4m3 q [H] and, per 128-channel
 * group g, the scale's fp32 bits sb[g]: amax (its largest magnitude, at
 * least 1e-4) times fl(1/448); values times fl(448/amax), or, with
 * EK_LL_FP8_ROUND / _UE8M0, the scale rounded up to a power of two and
 * values times its inverse; each product rounded to fp32, then to the
 * nearest e4m3 (ties to even, saturated at 448). */
void ek_ll_cast(const uint16_t *x, uint32_t H, int mode, uint8_t *q,
		uint32_t *sb);
/* acc[i] += fl(w * row[i]) (fp32, the product rounded: no fused
 * multiply-add). */
void ek_ll_acc(float *acc, const uint16_t *row, float w, uint32_t H);
/* out[i] = acc[i] rounded to the nearest bf16 (ties to even; every NaN
 * the canonical 0x7fff, as the GPU's conversion gives). */
void ek_ll_round(const float *acc, uint16_t *out, uint32_t H);

/* A barrier engine that serves a group's barriers from the ranks'
 * doorbells alone, for the group's life: the resident barrier kernel
 * (ekc_fastbar, under MPS) or the daemon's host barrier thread. The daemon
 * reads its state; the engine writes it. */
enum {
	EK_BAR_RUNNING = 1,
	EK_BAR_STOPPED,  /* the daemon asked it to end */
	EK_BAR_TIMEOUT,  /* barrier `seq`: `missing` never rang */
	EK_BAR_MISMATCH, /* barrier `seq`: `missing` rang another one */
};
struct ek_bar_state {
	uint32_t stop;    /* daemon -> engine: end now */
	uint32_t state;   /* engine -> daemon: EK_BAR_* */
	uint64_t last;    /* last barrier released (64-bit sequence) */
	uint64_t count;   /* barriers released */
	uint64_t missing; /* EK_BAR_TIMEOUT/MISMATCH: local ranks */
	uint32_t seq;     /* the barrier that failed */
	uint32_t pad;
	uint64_t busy_ns; /* sum over barriers: last arrival seen to release
			     written (the engine's own time) */
};

#endif
