/* SPDX-License-Identifier: MIT */
/* Host backend kernels: routing, dispatch, combine and layout in plain C. */
#if defined(__GNUC__) && !defined(__clang__)
/* The copy and accumulate loops want the vectorizer whatever CFLAGS say. */
#pragma GCC optimize("O3")
#endif
#include "ek.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep/ep.h"

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define EK_STREAM 1
#endif

/* A received row to the destination's buffer: with streaming stores
 * where the destination allows (x86, 16-byte aligned, rows of whole
 * 64-byte lines and at least four of them; hidden is a multiple of 128),
 * so that writing a line does not read it first: the dispatch writes
 * about five rows for each it reads, and measured 1.7x faster so. The
 * caller ends its copies with stream_done, which orders them before what
 * it writes next (the reply that the rows are there). */
static inline void copy_row(void *restrict dst, const void *restrict src,
			    size_t n)
{
#ifdef EK_STREAM
	if (n >= 256 && !(n % 64) && !((uintptr_t)dst & 15)) {
		__m128i *d = dst;
		const __m128i *q = src;
		size_t v = n / 64;
		for (size_t i = 0; i < v; i++) {
			__m128i a = _mm_loadu_si128(q + 4 * i);
			__m128i b = _mm_loadu_si128(q + 4 * i + 1);
			__m128i c = _mm_loadu_si128(q + 4 * i + 2);
			__m128i e = _mm_loadu_si128(q + 4 * i + 3);
			_mm_stream_si128(d + 4 * i, a);
			_mm_stream_si128(d + 4 * i + 1, b);
			_mm_stream_si128(d + 4 * i + 2, c);
			_mm_stream_si128(d + 4 * i + 3, e);
		}
		return;
	}
#endif
	memcpy(dst, src, n);
}

static inline void stream_done(void)
{
#ifdef EK_STREAM
	_mm_sfence();
#endif
}

static inline float bf16_to_f32(uint16_t v)
{
	uint32_t u = (uint32_t)v << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

struct ek_route *ek_route_new(uint32_t world, const uint32_t *num_tokens)
{
	struct ek_route *r = calloc(1, sizeof(*r));
	if (!r)
		return NULL;
	r->world = world;
	r->num_tokens = calloc(world, sizeof(*r->num_tokens));
	r->slot = calloc(world, sizeof(*r->slot));
	r->count = calloc((size_t)world * world, sizeof(*r->count));
	r->num_recv = calloc(world, sizeof(*r->num_recv));
	if (!r->num_tokens || !r->slot || !r->count || !r->num_recv)
		goto err;
	for (uint32_t s = 0; s < world; s++) {
		r->num_tokens[s] = num_tokens[s];
		r->slot[s] = malloc(((size_t)num_tokens[s] * world + 1) *
				    sizeof(int32_t));
		if (!r->slot[s])
			goto err;
	}
	return r;
err:
	ek_route_free(r);
	return NULL;
}

void ek_route_free(struct ek_route *r)
{
	if (!r)
		return;
	if (r->slot)
		for (uint32_t s = 0; s < r->world; s++)
			free(r->slot[s]);
	free(r->slot);
	free(r->num_tokens);
	free(r->count);
	free(r->num_recv);
	free(r);
}

int ek_validate_topk(const struct ek_shape *s, const int64_t *topk_idx,
		     uint32_t num_tokens, char *err, size_t errlen)
{
	const int64_t E = s->num_experts;
	for (uint64_t i = 0; i < (uint64_t)num_tokens * s->topk; i++) {
		int64_t e = topk_idx[i];
		if (e < -1 || e >= E) {
			snprintf(err, errlen,
				 "expert index %lld at token %llu, k %llu is "
				 "outside [-1, %lld)",
				 (long long)e, (unsigned long long)(i / s->topk),
				 (unsigned long long)(i % s->topk),
				 (long long)E);
			return EP_EEXPERT;
		}
	}
	return 0;
}

void ek_route_source(const struct ek_shape *s, struct ek_route *r,
		     uint32_t src, const int64_t *topk_idx)
{
	const uint32_t W = s->world, K = s->topk;
	const uint32_t per = s->num_experts / W;
	uint32_t *cnt = r->count + (size_t)src * W;
	int32_t *slot = r->slot[src];
	memset(cnt, 0, W * sizeof(*cnt));
	for (uint32_t t = 0; t < r->num_tokens[src]; t++) {
		int32_t *row = slot + (size_t)t * W;
		for (uint32_t d = 0; d < W; d++)
			row[d] = -1;
		for (uint32_t k = 0; k < K; k++) {
			int64_t e = topk_idx[(size_t)t * K + k];
			if (e < 0)
				continue;
			uint32_t d = (uint32_t)(e / per);
			if (row[d] < 0)
				row[d] = (int32_t)cnt[d]++;
		}
	}
}

void ek_route_finish(struct ek_route *r)
{
	const uint32_t W = r->world;
	for (uint32_t d = 0; d < W; d++) {
		uint32_t off = 0;
		for (uint32_t s = 0; s < W; s++) {
			if (off) {
				int32_t *slot = r->slot[s];
				for (uint32_t t = 0; t < r->num_tokens[s]; t++)
					if (slot[(size_t)t * W + d] >= 0)
						slot[(size_t)t * W + d] +=
							(int32_t)off;
			}
			off += r->count[(size_t)s * W + d];
		}
		r->num_recv[d] = off;
	}
}

void ek_dispatch_tokens(const struct ek_shape *s, const struct ek_route *r,
			struct ek_rank_io *io, uint32_t src, uint32_t t0,
			uint32_t t1, bool cached)
{
	const uint32_t W = s->world, K = s->topk, per = s->num_experts / W;
	const size_t row_bytes = (size_t)s->hidden * s->elt;
	const struct ek_rank_io *in = &io[src];
	for (uint32_t t = t0; t < t1; t++) {
		const int32_t *slot = r->slot[src] + (size_t)t * W;
		for (uint32_t d = 0; d < W; d++) {
			int32_t row = slot[d];
			struct ek_rank_io *out = &io[d];
			/* a destination on another node: its daemon writes */
			if (row < 0 || !out->recv_x)
				continue;
			/* a source on another node: its rows arrive over the
			 * transport; the metadata is made here */
			if (in->x) {
				const uint8_t *x =
					(const uint8_t *)in->x + t * row_bytes;
				copy_row((uint8_t *)out->recv_x +
						 (size_t)row * row_bytes,
					 x, row_bytes);
				if (s->nscales)
					memcpy(out->recv_scales +
						       (size_t)row * s->nscales,
					       in->x_scales +
						       (size_t)t * s->nscales,
					       s->nscales * sizeof(float));
			}
			if (cached)
				continue;
			const int64_t *ti = in->topk_idx + (size_t)t * K;
			int64_t *ri = out->recv_topk_idx + (size_t)row * K;
			float *rw = out->recv_topk_weights + (size_t)row * K;
			for (uint32_t k = 0; k < K; k++) {
				int64_t e = ti[k];
				bool local = e >= 0 && (uint32_t)(e / per) == d;
				ri[k] = local ? e - (int64_t)d * per : -1;
				rw[k] = local && in->topk_weights
						? in->topk_weights[(size_t)t * K +
								   k]
						: 0.0f;
			}
			out->recv_src[(size_t)row * 2] = (int32_t)src;
			out->recv_src[(size_t)row * 2 + 1] = (int32_t)t;
		}
	}
	stream_done();
}

void ek_rank_prefix(const struct ek_route *r, struct ek_rank_io *io,
		    uint32_t d)
{
	const uint32_t W = r->world;
	int32_t *rp = io[d].rank_prefix;
	if (!rp)
		return;
	for (uint32_t c = 0; c < W; c++) {
		uint32_t run = 0;
		for (uint32_t s = 0; s < W; s++) {
			run += r->count[(size_t)s * W + c];
			rp[(size_t)s * W + c] = (int32_t)run;
		}
	}
}

void ek_recv_per_expert(const struct ek_shape *s, const struct ek_route *r,
			struct ek_rank_io *io, uint32_t d)
{
	const uint32_t K = s->topk, per = s->num_experts / s->world;
	int32_t *pe = io[d].recv_per_expert;
	memset(pe, 0, per * sizeof(*pe));
	for (uint32_t row = 0; row < r->num_recv[d]; row++) {
		/* recv_topk_idx lies in the destination rank's memory, which
		 * it can write at any time: the index that addresses pe[] is
		 * read once, into e, and bounded (what the rank scribbles
		 * can only miscount its own experts) */
		const int64_t *ri = io[d].recv_topk_idx + (size_t)row * K;
		/* count a row once per distinct local expert */
		for (uint32_t k = 0; k < K; k++) {
			/* (an atomic load: the compiler may not read it
			 * again where e is used) */
			int64_t e = __atomic_load_n(&ri[k], __ATOMIC_RELAXED);
			if (e < 0 || e >= (int64_t)per)
				continue;
			bool dup = false;
			for (uint32_t j = 0; j < k; j++)
				dup |= ri[j] == e;
			if (!dup)
				pe[e]++;
		}
	}
}

#define CHUNK 1024

/* acc[i] += each of the np sources' bf16 value i, in order (np <= 4; p[4],
 * the unused ones NULL): one pass over the accumulator for up to four
 * sources, each element's adds in the same order as one source at a
 * time. */
static inline void add_sources(float *restrict acc,
			       const uint16_t *const *restrict p, uint32_t np,
			       uint32_t n)
{
	const uint16_t *p0 = p[0], *p1 = p[1], *p2 = p[2], *p3 = p[3];
	switch (np) {
	case 4:
		for (uint32_t i = 0; i < n; i++) {
			float a = acc[i];
			a += bf16_to_f32(p0[i]);
			a += bf16_to_f32(p1[i]);
			a += bf16_to_f32(p2[i]);
			a += bf16_to_f32(p3[i]);
			acc[i] = a;
		}
		break;
	case 3:
		for (uint32_t i = 0; i < n; i++) {
			float a = acc[i];
			a += bf16_to_f32(p0[i]);
			a += bf16_to_f32(p1[i]);
			a += bf16_to_f32(p2[i]);
			acc[i] = a;
		}
		break;
	case 2:
		for (uint32_t i = 0; i < n; i++) {
			float a = acc[i];
			a += bf16_to_f32(p0[i]);
			a += bf16_to_f32(p1[i]);
			acc[i] = a;
		}
		break;
	case 1:
		for (uint32_t i = 0; i < n; i++)
			acc[i] += bf16_to_f32(p0[i]);
		break;
	}
}

/* The canonical fp32 NaN (0x7fffffff), the one the GPU's adds give. */
static inline float nan_f32(void)
{
	const uint32_t u = 0x7fffffffu;
	float f;
	memcpy(&f, &u, sizeof(f));
	return f;
}

/* The rank expert e lives on, or -1 for an expert outside the group. */
static inline int32_t expert_rank(const struct ek_shape *s, int64_t e)
{
	if (e < 0 || e >= (int64_t)s->num_experts)
		return -1;
	return (int32_t)(e / (s->num_experts / s->world));
}

uint32_t ek_combine_order(const struct ek_shape *s, const int32_t *slot,
			  const int64_t *topk, uint32_t *ord)
{
	const uint32_t W = s->world, K = s->topk;
	uint32_t n = 0, rows = 0;
	if (!topk) {
		for (uint32_t d = 0; d < W; d++)
			if (slot[d] >= 0)
				ord[n++] = d;
		return n;
	}
	for (uint32_t d = 0; d < W; d++)
		rows += slot[d] >= 0;
	/* the row read once: the rank may write it meanwhile, and a second
	 * read that differed could list a rank twice */
	int32_t dk[EK_MAX_TOPK];
	for (uint32_t k = 0; k < K; k++)
		dk[k] = expert_rank(s, topk[k]);
	for (uint32_t k = 0; k < K; k++) {
		const int32_t d = dk[k];
		if (d < 0 || slot[d] < 0)
			continue;
		bool last = true;
		for (uint32_t j = k + 1; j < K && last; j++)
			last = dk[j] != d;
		if (last)
			ord[n++] = (uint32_t)d;
	}
	if (n == rows)
		return n;
	/* ranks with a row that the top-k row does not name (it changed
	 * since the dispatch) */
	for (uint32_t d = 0; d < W; d++) {
		if (slot[d] < 0)
			continue;
		bool named = false;
		for (uint32_t j = 0; j < n && !named; j++)
			named = ord[j] == d;
		if (!named)
			ord[n++] = d;
	}
	return n;
}

/* Written so that the compiler vectorizes every inner loop (checked with
 * -fopt-info-vec): the accumulator is punned through a union, and the NaN
 * case of the rounding is a select, not a branch. */
/* Not under ThreadSanitizer: the ifunc resolver of the clones runs during
 * relocation, before the TSan runtime is up, and crashes the process. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
	!defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx2", "default")))
#endif
void ek_combine_tokens(const struct ek_shape *s, const struct ek_route *r,
		       struct ek_rank_io *io, uint32_t h, uint32_t t0,
		       uint32_t t1)
{
	const uint32_t W = s->world, H = s->hidden;
	const struct ek_rank_io *home = &io[h];
	union {
		float f[CHUNK];
		uint32_t u[CHUNK];
	} acc;
	uint32_t ord[EK_MAX_WORLD];
	for (uint32_t t = t0; t < t1; t++) {
		const int32_t *slot = r->slot[h] + (size_t)t * W;
		uint16_t *out = home->combined + (size_t)t * H;
		const uint32_t nord = ek_combine_order(
			s, slot,
			home->combine_topk
				? home->combine_topk + (size_t)t * s->topk
				: NULL,
			ord);
		for (uint32_t c0 = 0; c0 < H; c0 += CHUNK) {
			uint32_t n = H - c0 < CHUNK ? H - c0 : CHUNK;
			if (home->combine_bias) {
				const uint16_t *b = home->combine_bias +
						    (size_t)t * H + c0;
				for (uint32_t i = 0; i < n; i++)
					acc.u[i] = (uint32_t)b[i] << 16;
			} else {
				for (uint32_t i = 0; i < n; i++)
					acc.u[i] = 0;
			}
			/* then the second bias and the rows by ascending
			 * rank, four to a pass over the accumulator */
			const uint16_t *p[4] = {NULL};
			uint32_t np = 0;
			if (home->combine_bias2)
				p[np++] = home->combine_bias2 + (size_t)t * H + c0;
			for (uint32_t i = 0; i < nord; i++) {
				const uint32_t d = ord[i];
				p[np++] = io[d].combine_y + (size_t)slot[d] * H + c0;
				if (np == 4) {
					add_sources(acc.f, p, np, n);
					np = 0;
				}
			}
			if (np)
				add_sources(acc.f, p, np, n);
			uint16_t *o = out + c0;
			for (uint32_t i = 0; i < n; i++) {
				uint32_t u = acc.u[i];
				uint32_t rne = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
				/* every NaN is the canonical 0x7fff, as the
				 * GPU's cvt.rn.bf16x2.f32 writes it: the sums'
				 * NaN payloads differ between the CPU's adds
				 * and the GPU's */
				o[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u
							  ? 0x7fffu
							  : rne);
			}
		}
		if (home->combined_w) {
			const uint32_t K = s->topk;
			float *ow = home->combined_w + (size_t)t * K;
			for (uint32_t k = 0; k < K; k++) {
				float a = 0.0f;
				for (uint32_t d = 0; d < W; d++)
					if (slot[d] >= 0)
						a += io[d].combine_w
							     [(size_t)slot[d] * K +
							      k];
				ow[k] = a == a ? a : nan_f32();
			}
		}
	}
}

void ek_layout(const struct ek_shape *s, const int64_t *topk_idx,
	       uint32_t num_tokens, int32_t *per_rank, int32_t *per_expert,
	       uint8_t *in_rank)
{
	const uint32_t W = s->world, K = s->topk, E = s->num_experts;
	const uint32_t per = E / W;
	memset(per_rank, 0, W * sizeof(*per_rank));
	memset(per_expert, 0, E * sizeof(*per_expert));
	memset(in_rank, 0, (size_t)num_tokens * W);
	for (uint32_t t = 0; t < num_tokens; t++) {
		const int64_t *ti = topk_idx + (size_t)t * K;
		uint8_t *row = in_rank + (size_t)t * W;
		for (uint32_t k = 0; k < K; k++) {
			int64_t e = ti[k];
			if (e < 0 || e >= E)
				continue;
			bool dup = false;
			for (uint32_t j = 0; j < k; j++)
				dup |= ti[j] == e;
			if (!dup)
				per_expert[e]++;
			row[e / per] = 1;
		}
		for (uint32_t d = 0; d < W; d++)
			per_rank[d] += row[d];
	}
}
