/* SPDX-License-Identifier: MIT */
/*
 * The low-latency mode (ep.h, ep_ll_*) for host ranks, on one node or
 * several: the same calls, outputs and bits as the GPU's kernels
 * (libep_ll.c), on the daemon's path. A GPU rank's ops write into its
 * peers' memory from its own stream; a host rank has no stream to hide
 * an op in, and the daemon's dispatch and combine already cross nodes,
 * check every index and end every wait.
 *
 * Each (token, k) of a low-latency dispatch is one pseudo token of a
 * second group of the same ranks (the "pseudo group": top-1, at most
 * max_tokens * topk tokens a rank, named after the group), joined by
 * every rank at its first low-latency call and left with the group. Its
 * dispatch brings every (token, k) row to the rank of its expert, in
 * source rank, then (token, k) order, which is the low-latency layout's
 * order within each local expert: the rows are copied (or cast to fp8)
 * into place. Its combine returns every (token, k)'s row to its home
 * unchanged (one row a pseudo token), where they are summed in top-k
 * order, each times its weight, as the kernels do.
 *
 * A rank with more than max_tokens takes part with no rows and sends one
 * marked pseudo token to every rank (its weight is a NaN no caller
 * writes), so every rank's ep_ll_error reports EP_ETOOBIG, as on a GPU.
 * A failed op (a rank that died or left, a timeout) ends the mode for
 * good, as on a GPU: every later call returns the error, a refused
 * dispatch reports no rows and a refused combine writes NaN.
 */
#include "libep_int.h"

#include "ek.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The pseudo token weight of the too-many-tokens mark (a quiet NaN with
 * a payload; the ordinary pseudo tokens carry 0.0). */
#define LLH_MARK 0x7fc0e7b1u
/* place[] of a received row that has no place (the mark, or a row past
 * its expert's W * max_tokens rows) */
#define LLH_NONE UINT64_MAX

enum { LLH_EEXPERT = 1, LLH_ETOOBIG = 2 };

struct llh_buf {
	uint8_t *rx;      /* [El, WN, H]: bf16 rows, or e4m3 (H bytes a row) */
	uint32_t *sc;     /* [El, H/128, WN] f32 (or [El, H/512, WN] UE8M0) */
	int32_t *count;   /* [El] */
	int64_t *layout;  /* [El, W] */
	int32_t *src;     /* [El, WN] */
	uint16_t *cx;     /* [El, WN, H]: a zero-copy combine's rows */
	int64_t *key;     /* [N * K]: each (t, k)'s expert, -1 skipped */
	uint64_t *place;  /* [received]: row el * WN + p, or LLH_NONE */
	ep_handle_t h;    /* the pseudo group's dispatch */
	bool held, used;
	uint32_t T;       /* the dispatch's tokens (0: it had too many) */
	uint16_t *hout;   /* a hooked combine's out */
};

struct ep_llh {
	uint32_t W, El, N, H, K, E;
	uint64_t WN;
	ep_group_t *aux; /* the pseudo group (not in the connection's list) */
	struct ep_buffers ab;
	float *acc;      /* [H] */
	uint32_t *sb;    /* [H/128]: one row's scales */
	struct llh_buf b[2];
	uint32_t next;   /* the buffer of the next dispatch */
	unsigned pend;   /* LLH_E*: reported once by ep_ll_error */
	struct ep__ll_end end; /* a failed op: every call returns it */
};

static void llh_free_bufs(struct ep_llh *l)
{
	for (int i = 0; i < 2; i++) {
		struct llh_buf *B = &l->b[i];
		free(B->rx);
		free(B->sc);
		free(B->count);
		free(B->layout);
		free(B->src);
		free(B->cx);
		free(B->key);
		free(B->place);
	}
	free(l->acc);
	free(l->sb);
}

void ep__llh_leave(ep_group_t *g)
{
	if (g->gpu)
		g->gpu->leave(g);
	if (g->llh && g->llh->aux) {
		(void)ep_leave(g->llh->aux);
		g->llh->aux = NULL;
	}
}

void ep__llh_fini(ep_group_t *g)
{
	struct ep_llh *l = g->llh;
	if (!l)
		return;
	if (l->aux) /* the connection is closed: no LEAVE to send */
		ep__group_free(l->aux);
	llh_free_bufs(l);
	free(l);
	g->llh = NULL;
}

void ep__llh_name(const char *name, char out[EP_GROUP_NAME_MAX + 1])
{
	uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
	for (const char *p = name; *p; p++)
		h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
	snprintf(out, EP_GROUP_NAME_MAX + 1, "%.*s:ll-%016llx",
		 EP_GROUP_NAME_MAX - 20, name, (unsigned long long)h);
}

static int llh_setup(ep_group_t *g)
{
	if (g->llh)
		return 0;
	const struct epp_join *c = &g->cfg;
	struct ep_llh *l = calloc(1, sizeof(*l));
	if (!l)
		return ep__fail(EP_ENOMEM, "out of memory");
	l->W = c->world_size;
	l->E = c->num_experts;
	l->El = l->E / l->W;
	l->N = c->max_tokens;
	l->H = c->hidden;
	l->K = c->topk;
	l->WN = (uint64_t)l->W * l->N;
	const uint64_t NK = (uint64_t)l->N * l->K;
	const uint64_t rows = (uint64_t)l->El * l->WN;
	bool ok = (l->acc = malloc((size_t)l->H * sizeof(float))) != NULL &&
		  (l->sb = malloc((size_t)(l->H / 128 + 1) * 4)) != NULL;
	for (int i = 0; i < 2 && ok; i++) {
		struct llh_buf *B = &l->b[i];
		/* calloc: a large shape's pages are touched only where rows
		 * land */
		B->rx = calloc(rows, (size_t)l->H * 2);
		B->sc = calloc(rows, (size_t)(l->H / 128) * 4);
		B->count = calloc(l->El, sizeof(*B->count));
		B->layout = calloc((size_t)l->El * l->W, sizeof(*B->layout));
		B->src = malloc(rows * sizeof(*B->src));
		B->key = malloc((NK ? NK : 1) * sizeof(*B->key));
		ok = B->rx && B->sc && B->count && B->layout && B->src &&
		     B->key;
		if (ok)
			memset(B->src, 0xff, rows * sizeof(*B->src));
	}
	if (!ok) {
		llh_free_bufs(l);
		free(l);
		return ep__fail(EP_ENOMEM, "out of memory for the low-latency "
					   "buffers (%llu rows of %u)",
				(unsigned long long)rows, c->hidden);
	}
	char name[EP_GROUP_NAME_MAX + 1];
	ep__llh_name(c->name, name);
	const uint64_t aux_max = NK > l->W ? NK : l->W;
	if (aux_max > UINT32_MAX) {
		llh_free_bufs(l);
		free(l);
		return ep__fail(EP_ELIMIT, "max_tokens x topk is too large for "
					   "the low-latency mode");
	}
	struct ep_group_config ac = {
		.name = name, .world_size = l->W,
		.ranks_per_node = c->ranks_per_node, .rank = c->rank,
		.num_experts = l->E, .hidden = l->H,
		.max_tokens_per_rank = (uint32_t)aux_max, .topk = 1,
		.dtype = EP_DTYPE_BF16, .timeout_ms = g->timeout_ms};
	/* linked: a rank the group lost fails this join at once, not at
	 * the pseudo group's timeout */
	/* the pseudo group spans the group's nodes, as it names them, and
	 * is the job's as the group is (its secret) */
	const struct epp_join nodes = {.num_nodes = g->cfg.num_nodes,
				       .nodes = g->cfg.nodes,
				       .secret = g->cfg.secret,
				       .secret_len = g->cfg.secret_len};
	int rc = ep__join(g->conn, &ac, 0, g->id, &nodes, NULL, &l->aux);
	if (!rc) {
		/* the group owns it: freed with it, never on its own by
		 * ep_close */
		pthread_mutex_lock(&g->conn->mu);
		list_del(&l->aux->node);
		pthread_mutex_unlock(&g->conn->mu);
		rc = ep_get_buffers(l->aux, &l->ab);
	}
	if (rc) {
		char msg[EPP_ERRMSG_MAX];
		snprintf(msg, sizeof(msg), "%s", ep_errmsg());
		if (l->aux)
			(void)ep_leave(l->aux);
		llh_free_bufs(l);
		free(l);
		return ep__fail(rc, "the low-latency mode's pseudo group %s: %s",
				name, msg);
	}
	g->llh = l;
	return 0;
}

/* A refused or failed dispatch reports no rows (as a GPU's poisoned
 * kernel does). */
static void llh_no_rows(struct ep_llh *l, struct llh_buf *B)
{
	memset(B->count, 0, (size_t)l->El * sizeof(*B->count));
	memset(B->layout, 0, (size_t)l->El * l->W * sizeof(*B->layout));
}

/* A refused or failed combine: NaN in every channel of out. */
static void llh_out_nan(struct ep_llh *l, uint16_t *out, uint32_t T)
{
	for (uint64_t i = 0; out && i < (uint64_t)T * l->H; i++)
		out[i] = 0x7fc0u;
}

int ep__ll_die(struct ep__ll_end *e, int rc)
{
	snprintf(e->msg, sizeof(e->msg),
		 "a low-latency op failed: %s; this group's low-latency mode "
		 "is over: join a new group",
		 ep_errmsg());
	e->rc = rc;
	return ep__fail(rc, "%s", e->msg);
}

int ep__ll_gate(struct ep__ll_end *e, ep_group_t *g)
{
	if (e->rc)
		return ep__fail(e->rc, "%s", e->msg);
	const int c = g ? ep__group_failed(g) : 0;
	return c ? ep__ll_die(e, c) : 0;
}

static int llh_die(struct ep_llh *l, int rc)
{
	return ep__ll_die(&l->end, rc);
}

/* Before an op: the mode's end (kept), or the group's failure (which
 * ends it). */
static int llh_gate(ep_group_t *g)
{
	return ep__ll_gate(&g->llh->end, g);
}

/* Rows received by the pseudo group's dispatch into buffer B: counted per
 * (local expert, source), laid out as the kernels lay them out, then
 * copied (or cast) into place. */
static void llh_place(struct ep_llh *l, struct llh_buf *B, int fp8)
{
	const struct ep_buffers *ab = &l->ab;
	const uint32_t R = B->h.num_recv, W = l->W, El = l->El, H = l->H;
	const uint64_t WN = l->WN;
	uint64_t *cnt = calloc((size_t)El * W, sizeof(*cnt));
	uint64_t *at = calloc((size_t)El * W, sizeof(*at));
	if (!cnt || !at) { /* no rows, and say why */
		free(cnt);
		free(at);
		llh_no_rows(l, B);
		l->pend |= LLH_ETOOBIG;
		return;
	}
	for (uint32_t i = 0; i < R; i++) {
		uint32_t wb;
		memcpy(&wb, &ab->recv_topk_weights[i], 4);
		const int64_t el = ab->recv_topk_idx[i];
		const int32_t s = ab->recv_src[2 * i];
		if (wb == LLH_MARK) {
			l->pend |= LLH_ETOOBIG;
			continue;
		}
		if (el >= 0 && el < El && s >= 0 && (uint32_t)s < W)
			cnt[el * W + (uint32_t)s]++;
	}
	for (uint32_t el = 0; el < El; el++) {
		uint64_t begin = 0;
		for (uint32_t s = 0; s < W; s++) {
			const uint64_t c = cnt[el * W + s];
			B->layout[el * W + s] = (int64_t)(begin << 32 | c);
			at[el * W + s] = begin;
			begin += c;
		}
		if (begin > WN) /* an expert repeated in a token's top-k */
			l->pend |= LLH_ETOOBIG, begin = WN;
		B->count[el] = (int32_t)begin;
		int32_t *src = B->src + el * WN; /* -1 past the count */
		memset(src + begin, 0xff, (WN - begin) * sizeof(*src));
	}
	const size_t rowb = fp8 ? H : (size_t)H * 2;
	const uint32_t G = H / 128;
	for (uint32_t i = 0; i < R; i++) {
		uint32_t wb;
		memcpy(&wb, &ab->recv_topk_weights[i], 4);
		const int64_t el = ab->recv_topk_idx[i];
		const int32_t s = ab->recv_src[2 * i];
		B->place[i] = LLH_NONE;
		if (wb == LLH_MARK || el < 0 || el >= El || s < 0 ||
		    (uint32_t)s >= W)
			continue;
		const uint64_t p = at[el * W + (uint32_t)s]++;
		if (p >= WN)
			continue;
		const uint64_t row = (uint64_t)el * WN + p;
		B->place[i] = row;
		B->src[row] = ab->recv_src[2 * i + 1] / (int32_t)l->K;
		const uint16_t *x =
			(const uint16_t *)ab->recv_x + (uint64_t)i * H;
		if (!fp8) {
			memcpy(B->rx + row * rowb, x, rowb);
			continue;
		}
		uint32_t *sb = l->sb;
		ek_ll_cast(x, H, fp8, B->rx + row * rowb, sb);
		/* column-major per local expert: [el][g][p] */
		if (fp8 != EK_LL_FP8_UE8M0) {
			for (uint32_t g = 0; g < G; g++)
				B->sc[((uint64_t)el * G + g) * WN + p] = sb[g];
			continue;
		}
		for (uint32_t g4 = 0; g4 < G / 4; g4++) {
			uint32_t word = 0;
			for (uint32_t j = 0; j < 4; j++)
				word |= ((sb[4 * g4 + j] >> 23) & 0xffu)
					<< (8 * j);
			B->sc[((uint64_t)el * (G / 4) + g4) * WN + p] = word;
		}
	}
	free(cnt);
	free(at);
}

static int llh_dispatch(ep_group_t *g, const void *x, const int64_t *topk_idx,
			uint32_t T, int fp8, struct ep_ll_recv *out)
{
	int rc = llh_setup(g);
	if (rc)
		return rc;
	struct ep_llh *l = g->llh;
	const uint32_t b = l->next;
	struct llh_buf *B = &l->b[b];
	if ((rc = llh_gate(g))) {
		llh_no_rows(l, B);
		return rc;
	}
	/* the routing two dispatches back on this buffer is done with */
	if (B->held) {
		B->held = false;
		if ((rc = ep_handle_release(l->aux, &B->h))) {
			llh_no_rows(l, B);
			return llh_die(l, rc);
		}
	}
	const struct ep_buffers *ab = &l->ab;
	const bool over = T > l->N;
	const uint32_t H = l->H, K = l->K;
	uint32_t n = 0;
	if (over) { /* a mark to every rank, no rows */
		for (uint32_t r = 0; r < l->W; r++, n++) {
			ab->topk_idx[n] = (int64_t)r * l->El;
			const uint32_t mark = LLH_MARK;
			memcpy(&ab->topk_weights[n], &mark, 4);
		}
	} else {
		for (uint32_t t = 0; t < T; t++)
			for (uint32_t k = 0; k < K; k++, n++) {
				int64_t e = topk_idx[(uint64_t)t * K + k];
				if (e < -1 || e >= (int64_t)l->E)
					l->pend |= LLH_EEXPERT, e = -1;
				B->key[n] = e;
				ab->topk_idx[n] = e;
				ab->topk_weights[n] = 0.0f;
				if (e >= 0)
					memcpy((uint16_t *)ab->x +
						       (uint64_t)n * H,
					       (const uint16_t *)x +
						       (uint64_t)t * H,
					       (size_t)H * 2);
			}
	}
	rc = ep_dispatch_inplace(l->aux, n, EP_DISPATCH_WEIGHTS, NULL, &B->h);
	if (rc) {
		llh_no_rows(l, B);
		return llh_die(l, rc);
	}
	B->held = true;
	free(B->place);
	B->place = malloc(((size_t)B->h.num_recv + 1) * sizeof(*B->place));
	if (!B->place) {
		llh_no_rows(l, B);
		return llh_die(l, ep__fail(EP_ENOMEM, "out of memory"));
	}
	llh_place(l, B, fp8);
	l->next = b ^ 1;
	B->T = over ? 0 : T;
	B->used = true;
	B->hout = NULL;
	out->buffer = b;
	out->recv_x = B->rx;
	out->recv_scales = fp8 ? B->sc : NULL;
	out->recv_count = B->count;
	out->layout_range = B->layout;
	out->src_info = B->src;
	out->local_experts = l->El;
	out->max_recv = (uint32_t)l->WN;
	return over ? ep__fail(EP_ETOOBIG,
			       "%u tokens exceed the group's maximum of %u "
			       "(this rank took part with none)",
			       T, l->N)
		    : 0;
}

static int llh_buffer(ep_group_t *g, uint32_t b)
{
	if (!g->llh || b > 1 || !g->llh->b[b].used)
		return ep__fail(EP_EINVAL, "buffer %u has no low-latency "
					   "dispatch",
				b);
	return 0;
}

static int llh_dispatch_hook(ep_group_t *g, uint32_t b)
{
	/* the rows were placed by the dispatch: a host rank's op has no
	 * stream to leave its second half on */
	int rc = llh_buffer(g, b);
	if (!rc && (rc = llh_gate(g)))
		llh_no_rows(g->llh, &g->llh->b[b]);
	return rc;
}

static int llh_combine(ep_group_t *g, uint32_t b, const void *expert_out,
		       const float *weights, void *out, unsigned flags)
{
	int rc = llh_buffer(g, b);
	if (rc)
		return rc;
	struct ep_llh *l = g->llh;
	struct llh_buf *B = &l->b[b];
	if (B->T && (!weights || !out))
		return ep__fail(EP_EINVAL, "weights and out are required");
	if (!(flags & EP_LL_ZERO_COPY) && !expert_out)
		return ep__fail(EP_EINVAL, "expert_out is required (or "
					   "EP_LL_ZERO_COPY)");
	B->hout = flags & EP_LL_HOOK ? out : NULL;
	if ((rc = llh_gate(g))) {
		llh_out_nan(l, out, B->T);
		return rc;
	}
	const uint32_t H = l->H, K = l->K;
	const uint64_t rows = (uint64_t)l->El * l->WN;
	if ((flags & EP_LL_ZERO_COPY) && !B->cx &&
	    !(B->cx = calloc(rows, (size_t)H * 2)))
		return ep__fail(EP_ENOMEM, "out of memory");
	const uint16_t *ex = flags & EP_LL_ZERO_COPY ? B->cx : expert_out;
	const struct ep_buffers *ab = &l->ab;
	for (uint32_t i = 0; i < B->h.num_recv; i++) {
		uint16_t *y = ab->combine_y + (uint64_t)i * H;
		if (B->place[i] == LLH_NONE)
			memset(y, 0, (size_t)H * 2);
		else
			memcpy(y, ex + B->place[i] * H, (size_t)H * 2);
	}
	if ((rc = ep_combine_inplace(l->aux, &B->h, 0))) {
		rc = llh_die(l, rc);
		llh_out_nan(l, out, B->T);
		return rc;
	}
	/* each (t, k)'s row came back alone: the sum at home, in top-k
	 * order from +0.0, each product rounded, rounded once to bf16 */
	for (uint32_t t = 0; t < B->T; t++) {
		memset(l->acc, 0, (size_t)H * sizeof(float));
		for (uint32_t k = 0; k < K; k++) {
			const uint64_t i = (uint64_t)t * K + k;
			if (B->key[i] >= 0)
				ek_ll_acc(l->acc, ab->combined + i * H,
					  weights[i], H);
		}
		ek_ll_round(l->acc, (uint16_t *)out + (uint64_t)t * H, H);
	}
	return 0;
}

static int llh_combine_hook(ep_group_t *g, uint32_t b)
{
	/* summed by the combine, as the dispatch's hook */
	int rc = llh_buffer(g, b);
	if (!rc && (rc = llh_gate(g)))
		llh_out_nan(g->llh, g->llh->b[b].hout, g->llh->b[b].T);
	return rc;
}

static int llh_combine_buffer(ep_group_t *g, uint32_t b, void **rows)
{
	int rc = llh_setup(g);
	if (rc)
		return rc;
	struct llh_buf *B = &g->llh->b[b];
	if (!B->cx && !(B->cx = calloc((uint64_t)g->llh->El * g->llh->WN,
				       (size_t)g->llh->H * 2)))
		return ep__fail(EP_ENOMEM, "out of memory");
	*rows = B->cx;
	return 0;
}

uint32_t ep__llh_next(const ep_group_t *g)
{
	return g->llh ? g->llh->next : 0;
}

static int llh_error(ep_group_t *g)
{
	struct ep_llh *l = g->llh;
	if (!l)
		return 0;
	int rc = ep__ll_gate(&l->end, NULL);
	if (rc)
		return rc;
	const unsigned p = l->pend;
	l->pend = 0;
	return ep__ll_soft_error(p & LLH_EEXPERT, p & LLH_ETOOBIG);
}

int ep__ll_soft_error(bool expert, bool toobig)
{
	if (expert)
		return ep__fail(EP_EEXPERT, "a low-latency dispatch had an "
					    "expert index outside [-1, experts)");
	if (toobig)
		return ep__fail(EP_ETOOBIG,
				"a low-latency dispatch had more tokens than "
				"the group's maximum, or more rows for an "
				"expert than its buffer holds");
	return 0;
}

/* ---- the host way's table (libep_llapi.c calls through it) ---- */

static int llh_dispatch_op(ep_group_t *g, const void *x,
			   const int64_t *topk_idx, uint32_t num_tokens,
			   unsigned flags, int fp8, void *stream,
			   struct ep_ll_recv *out)
{
	(void)flags, (void)stream;
	return llh_dispatch(g, x, topk_idx, num_tokens, fp8, out);
}

static int llh_dispatch_hook_op(ep_group_t *g, uint32_t b, void *stream)
{
	(void)stream;
	return llh_dispatch_hook(g, b);
}

static int llh_combine_op(ep_group_t *g, uint32_t b, const void *expert_out,
			  const float *weights, void *out, unsigned flags,
			  void *stream)
{
	(void)stream;
	return llh_combine(g, b, expert_out, weights, out, flags);
}

static int llh_combine_hook_op(ep_group_t *g, uint32_t b, void *stream)
{
	(void)stream;
	return llh_combine_hook(g, b);
}

/* Shrink mode is the kernels' (ep.h): a host rank's low-latency ops run
 * on the daemon's, where a rank that fails fails the group. */
static int llh_no_shrink(ep_group_t *g, const char *what, bool on)
{
	(void)g, (void)on;
	return ep__fail(EP_EUNSUPPORTED,
			"%s: shrink mode runs on the low-latency kernels "
			"(GPU ranks of one node); a host rank's ops run on "
			"the daemon's path",
			what);
}

const struct ep__ll_ops ep__ll_host_ops = {
	.dispatch = llh_dispatch_op,
	.dispatch_hook = llh_dispatch_hook_op,
	.combine = llh_combine_op,
	.combine_hook = llh_combine_hook_op,
	.combine_buffer = llh_combine_buffer,
	.error = llh_error,
	.no_shrink = llh_no_shrink,
};
