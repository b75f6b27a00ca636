/* SPDX-License-Identifier: MIT */
/*
 * libep's low-latency mode (ep.h) of GPU ranks (host ranks':
 * libep_llhost.c): the kernels of kernels/cuda/ekc_ll.cu on the caller's
 * stream. At the first call the rank asks the daemon for
 * every local rank's low-latency region (LL_MAP, one descriptor each),
 * maps them, and makes its private words and its outputs; each op after
 * that is one or two kernel launches and no message. The two buffers
 * alternate per dispatch, chosen here (as DeepEP's low-latency mode
 * does); the sequence numbers are the device's own, so ops captured into
 * CUDA graphs replay correctly.
 */
#include "libep_cuda_int.h"

#include "ek.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct ep_ll {
	uint32_t W, El, N, H, K, blocks;
	bool pdl; /* programmatic dependent launch (EP_LL_PDL=0: off) */
	/* fault injection for tests (EP_LL_TEST_STALL="op:ms"): this rank's
	 * op-th dispatch holds its done flags back ms after its rows */
	uint32_t stall_op, stall_ms, ndisp;
	CUdeviceptr peer[EKC_LL_MAXW];
	CUmemGenericAllocationHandle ph[EKC_LL_MAXW];
	uint64_t psize;
	uint32_t gpu[EKC_LL_MAXW]; /* each region's GPU (the daemon's index) */
	CUdeviceptr priv, outs; /* outs: per buffer recv_count, layout, src_info */
	uint64_t out_stride;
	struct ekc_ll_layout L;
	struct ekc_ll_args base; /* what every op's arguments share */
	uint32_t next;  /* the buffer of the next dispatch */
	uint32_t T[2];  /* each buffer's dispatch: its tokens */
	uint32_t Kb[2]; /* and its top-k width (at most the group's) */
	bool used[2];   /* a dispatch ran on that buffer */
	uint64_t hw[2], hout[2]; /* a hooked combine's weights and out */
	CUfunction fn[EP__FN_N];
	/* the kernels' fatal and poisoned bits mirrored in host memory
	 * (ekc_ll_args.herr): read before each launch without a copy */
	volatile uint32_t *herr;
	/* after a fatal error (EKC_LL_EFATAL, or the group failed): every
	 * call returns it (a refused op still runs its poisoned kernel:
	 * ll_launch) */
	int dead_rc;
	bool poisoned; /* the device's poison word is set (the kernels', or
			  ll_gate's after the group failed) */
	char dead_msg[EPP_CTL_MSG_MAX + 96];
};

static int ll_gate(ep_group_t *g, void *stream);

static bool ll_gone_only(const ep_group_t *g);

/* ep_ll_dispatch's cast modes (ek.h) are the kernels' */
_Static_assert(EK_LL_FP8 == EKC_LL_FP8 && EK_LL_FP8_ROUND == EKC_LL_FP8_ROUND &&
		       EK_LL_FP8_UE8M0 == EKC_LL_FP8_UE8M0,
	       "the fp8 modes of ek.h and ekc.h");

static void ll_free(struct ep_ll *l)
{
	for (uint32_t d = 0; d < EKC_LL_MAXW; d++) {
		if (l->peer[d]) {
			ep__drv.cuMemUnmap(l->peer[d], l->psize);
			ep__drv.cuMemAddressFree(l->peer[d], l->psize);
		}
		if (l->ph[d])
			ep__drv.cuMemRelease(l->ph[d]);
	}
	if (l->herr)
		ep__drv.cuMemFreeHost((void *)l->herr);
	if (l->priv)
		ep__drv.cuMemFree(l->priv);
	if (l->outs)
		ep__drv.cuMemFree(l->outs);
	free(l);
}

void ep__ll_fini(ep_group_t *g)
{
	if (g->ll)
		ll_free(g->ll);
	g->ll = NULL;
	ep__llx_fini(g);
}

/* Local rank d's region, from the daemon, mapped for this rank's GPU. */
static int ll_map_one(ep_group_t *g, struct ep_ll *l, uint32_t d)
{
	struct epp_ll_map req = {.group_id = g->id, .local = d};
	uint8_t buf[32], *rep = NULL;
	uint32_t rlen = 0;
	int fd = -1;
	size_t n = epp_ll_map_encode(&req, buf, sizeof(buf));
	pthread_mutex_lock(&g->conn->mu);
	int rc = ep__rpc(g->conn, EPP_LL_MAP, 0, buf, (uint32_t)n, &rep,
			 &rlen, &fd, 1, EP__CTL_TIMEOUT_MS);
	pthread_mutex_unlock(&g->conn->mu);
	if (rc)
		return rc;
	struct epp_ll_map_ok ok;
	rc = epp_ll_map_ok_decode(rep, rlen, &ok);
	free(rep);
	if (rc || fd < 0 || ok.local != d || !ok.size ||
	    ok.size < l->L.total || (l->psize && ok.size != l->psize)) {
		if (fd >= 0)
			close(fd);
		return ep__fail(EP_EPROTO, "malformed ll-map reply");
	}
	l->psize = ok.size;
	l->gpu[d] = ok.gpu;
	return ep__cuda_import(fd, ok.size, g->cuda_device,
			       "cuMemSetAccess (a peer's low-latency region "
			       "on another GPU needs peer access)",
			       &l->peer[d], &l->ph[d]);
}

/* Blocks per kernel: EP_LL_BLOCKS, else the GPU's SMs shared among the
 * group's `here` ranks on it (every rank's blocks must be resident at once:
 * they wait for each other). 8 ranks on an H200's 132 SMs: 16 each; 2
 * ranks: 66, which took their 128-token ops from 37-75 us on 16 blocks
 * to 23-36 (PERFORMANCE.md, "Low-latency mode"); one rank a GPU: all
 * of them. The grid is each rank's own (its counters are private), so
 * ranks may differ. An EP_LL_BLOCKS whose grids could not all be resident
 * together (the combine kernels take one block a SM) is refused: the
 * ranks' blocks would wait for blocks that cannot start, until the
 * timeout ended the mode. */
static int ll_grid(ep_group_t *g, struct ep_ll *l, uint32_t here)
{
	int sms = 0;
	int rc = ep__sm_count(g->cuda_device, &sms);
	if (rc)
		return rc;
	CUresult r;
	int occ = 1 << 20; /* the fewest blocks of an op kernel a SM holds */
	for (int k = EP__FN_LL_DISPATCH; k <= EP__FN_LL_COMBINE_PULL; k++) {
		int n = 0;
		r = ep__drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(
			&n, l->fn[k], EKC_LL_TPB, 0);
		if (r)
			return ep__cufail(r, "a low-latency kernel's occupancy");
		if (n < occ)
			occ = n;
	}
	const uint32_t cap = (uint32_t)occ * (uint32_t)sms / here;
	const char *e = getenv("EP_LL_BLOCKS");
	const bool asked = e && atoi(e) > 0 && atoi(e) <= 1024;
	l->blocks = asked ? (uint32_t)atoi(e) : (uint32_t)sms / here;
	if (l->blocks < 1)
		l->blocks = 1;
	if (l->blocks > 1024)
		l->blocks = 1024;
	if (l->blocks <= cap)
		return 0;
	if (asked)
		return ep__fail(EP_EINVAL,
				"EP_LL_BLOCKS=%u: at most %u blocks a kernel "
				"fit for the %u ranks on this GPU (%d SMs, %d "
				"a SM), whose blocks must all run at once",
				l->blocks, cap, here, sms, occ);
	return ep__fail(EP_EUNSUPPORTED,
			"the %u ranks on this GPU cannot all run their "
			"low-latency kernels at once (%d SMs, %d blocks a SM)",
			here, sms, occ);
}

static int ll_setup(ep_group_t *g)
{
	if (g->ll)
		return 0;
	if (!g->dev_ptr)
		return ep__fail(EP_EUNSUPPORTED,
				"the low-latency mode runs on GPU ranks");
	const struct epp_join *c = &g->cfg;
	if (c->world_size != c->ranks_per_node)
		return ep__fail(EP_EUNSUPPORTED,
				"the low-latency mode serves groups of one "
				"node (this group spans %u nodes)",
				c->world_size / c->ranks_per_node);
	if (c->world_size > EKC_LL_MAXW || c->num_experts % c->world_size)
		return ep__fail(EP_EUNSUPPORTED,
				"the low-latency mode takes up to %u ranks "
				"and experts a multiple of the ranks",
				EKC_LL_MAXW);
	int rc = ep__use_ctx(g->cuda_device);
	if (rc)
		return rc;
	struct ep_ll *l = calloc(1, sizeof(*l));
	if (!l)
		return ep__fail(EP_ENOMEM, "out of memory");
	l->W = c->world_size;
	l->El = c->num_experts / l->W;
	l->N = c->max_tokens;
	l->H = c->hidden;
	l->K = c->topk;
	/* programmatic dependent launch unless EP_LL_PDL=0 */
	const char *pe = getenv("EP_LL_PDL");
	l->pdl = !pe || strcmp(pe, "0");
	const char *st = getenv("EP_LL_TEST_STALL");
	if (st && sscanf(st, "%u:%u", &l->stall_op, &l->stall_ms) != 2)
		l->stall_op = l->stall_ms = 0;
	ekc_ll_layout_of(l->W, l->N, l->H, l->El, l->K, &l->L);
	for (int k = EP__FN_LL_DISPATCH; k < EP__FN_N; k++)
		if (!(l->fn[k] = ep__fn(k))) {
			ll_free(l);
			return ep__fail(EP_EBACKEND,
					"the low-latency kernels are not in "
					"this GPU's module");
		}
	for (uint32_t d = 0; d < l->W && !rc; d++)
		rc = ll_map_one(g, l, d);
	uint32_t here = 0; /* the group's ranks on this rank's GPU */
	for (uint32_t d = 0; d < l->W && !rc; d++)
		here += l->gpu[d] == l->gpu[c->rank];
	const bool one_gpu = here == l->W; /* flags at GPU scope */
	/* Every rank's kernel waits in place for the others' counts and
	 * flags: ranks sharing a GPU must run at once, which MPS does and
	 * time slicing does not (each wait would last a slice, or reach the
	 * timeout). Every rank of the group sees the same answer, so all
	 * refuse together, before any of them wrote a peer. */
	if (!rc && one_gpu && l->W > 1 &&
	    !(c->rank_flags & EPP_RANK_MPS))
		rc = ep__fail(EP_EUNSUPPORTED,
			      "the low-latency mode needs MPS where ranks "
			      "share a GPU (this group's %u ranks are on one "
			      "GPU without it)",
			      l->W);
	if (!rc)
		rc = ll_grid(g, l, here);
	const uint64_t WN = (uint64_t)l->W * l->N;
	l->out_stride = (l->El * 4 + 7) / 8 * 8 + l->El * l->W * 8 +
			(l->El * WN * 4 + 255) / 256 * 256;
	CUresult r = CUDA_SUCCESS;
	if (!rc) {
		r = ep__drv.cuMemAlloc(&l->priv, l->L.priv_total);
		if (!r)
			r = ekc_write(&ep__drv, l->priv, NULL, l->L.priv_total);
		if (!r)
			r = ep__drv.cuMemAlloc(&l->outs, 2 * l->out_stride);
		if (r)
			rc = ep__cufail(r, "allocating the low-latency outputs");
	}
	CUdeviceptr herr = 0;
	if (!rc)
		rc = ep__host_words(1, &l->herr, &herr,
				    "the low-latency error word");
	if (rc) {
		ll_free(l);
		return rc;
	}
	/* the arguments every op shares, once */
	struct ekc_ll_args *a = &l->base;
	for (uint32_t d = 0; d < l->W; d++)
		a->peer[d] = l->peer[d];
	a->L = l->L;
	a->priv = l->priv;
	/* a wait that never ends past the group's timeout */
	a->timeout_ns = (uint64_t)(g->timeout_ms ? g->timeout_ms : 30000) *
			1000000ull;
	/* and at once when the daemon releases the group (a rank left) */
	a->released = g->ctl_dev ? g->ctl_dev + EPP_CTL_GROUP_SLOT +
					   EPP_CTL_RELEASED
				 : 0;
	/* shrink mode: which ranks left (ep_ll_shrink turns it on) */
	a->gone = g->ctl_dev ? g->ctl_dev + EPP_CTL_GROUP_SLOT + EPP_CTL_GONE
			     : 0;
	a->herr = herr;
	a->rank = g->cfg.rank;
	a->W = l->W;
	a->N = l->N;
	a->H = l->H;
	a->El = l->El;
	a->K = l->K;
	a->gpu_scope = one_gpu;
	g->ll = l;
	return 0;
}

static struct ekc_ll_args ll_args(const struct ep_ll *l, uint32_t b,
				  uint32_t T)
{
	struct ekc_ll_args a = l->base;
	const CUdeviceptr o = l->outs + b * l->out_stride;
	if (l->Kb[b]) /* the top-k width of the buffer's dispatch */
		a.K = l->Kb[b];
	a.recv_count = o;
	a.layout = o + (l->El * 4 + 7) / 8 * 8;
	a.src_info = a.layout + l->El * l->W * 8;
	a.T = T;
	a.buf = b;
	return a;
}

/* Kernel fn of one op, after ll_gate: where the mode is over, the error
 * it kept (the kernel, poisoned, then only marks its flags; not launched
 * where the poison could not be set). */
static int ll_launch(ep_group_t *g, int fn, struct ekc_ll_args *a,
		     uint32_t *with_recv, void *stream)
{
	const uint32_t blocks = fn == EP__FN_LL_BARRIER ? 1 : g->ll->blocks;
	const struct ep_ll *l = g->ll;
	const int dead = ll_gate(g, stream);
	if (dead && !l->poisoned)
		return dead;
	void *params[2] = {a, with_recv};
	CUresult r;
	if (l->pdl) {
		/* the kernel's blocks may become resident while the work
		 * ahead of it on the stream finishes; it waits for that work
		 * first (ekc_ll.cu, ll_prior) */
		CUlaunchAttribute at = {
			.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
			.value.programmaticStreamSerializationAllowed = 1};
		CUlaunchConfig cfg = {.gridDimX = blocks, .gridDimY = 1,
				      .gridDimZ = 1, .blockDimX = EKC_LL_TPB,
				      .blockDimY = 1, .blockDimZ = 1,
				      .hStream = (CUstream)stream,
				      .attrs = &at, .numAttrs = 1};
		r = ep__drv.cuLaunchKernelEx(&cfg, l->fn[fn], params, NULL);
	} else {
		r = ep__drv.cuLaunchKernel(l->fn[fn], blocks, 1, 1,
					   EKC_LL_TPB, 1, 1, 0,
					   (CUstream)stream, params, NULL);
	}
	if (dead)
		return ep__fail(dead, "%s", l->dead_msg);
	return r ? ep__cufail(r, "launching a low-latency kernel") : 0;
}

/* GPU ranks of a group across nodes: libep_llx.c. */

static int llk_dispatch(ep_group_t *g, const void *x, const int64_t *topk_idx,
			uint32_t num_tokens, unsigned flags, int fp8,
			void *stream, struct ep_ll_recv *out)
{
	int rc = ll_setup(g);
	if (rc)
		return rc;
	struct ep_ll *l = g->ll;
	const uint32_t b = l->next;
	const uint32_t K = EP_LL_TOPK_OF(flags) ? EP_LL_TOPK_OF(flags) : l->K;
	if (K > l->K)
		return ep__fail(EP_ESHAPE, "topk_idx of %u columns: the group's "
					   "top-k is %u",
				K, l->K);
	/* More tokens than the group's maximum: the kernel takes part with
	 * none (every rank finishes) and raises ETOOBIG here. */
	struct ekc_ll_args a = ll_args(l, b, num_tokens);
	a.K = K;
	if (l->stall_op && ++l->ndisp == l->stall_op)
		a.stall_ms = l->stall_ms;
	a.x = (uint64_t)(uintptr_t)x;
	a.topk = (uint64_t)(uintptr_t)topk_idx;
	a.fp8 = (uint32_t)fp8;
	uint32_t with_recv = !(flags & EP_LL_HOOK);
	rc = ll_launch(g, EP__FN_LL_DISPATCH, &a, &with_recv, stream);
	if (rc)
		return rc;
	l->next = b ^ 1;
	l->T[b] = num_tokens > l->N ? 0 : num_tokens;
	l->Kb[b] = K;
	l->used[b] = true;
	out->buffer = b;
	out->recv_x = (void *)(uintptr_t)(l->peer[g->cfg.rank] + l->L.rx[b]);
	out->recv_scales =
		fp8 ? (void *)(uintptr_t)(l->peer[g->cfg.rank] + l->L.sc[b])
		    : NULL;
	out->recv_count = (int32_t *)(uintptr_t)a.recv_count;
	out->layout_range = (int64_t *)(uintptr_t)a.layout;
	out->src_info = (int32_t *)(uintptr_t)a.src_info;
	out->local_experts = l->El;
	out->max_recv = l->W * l->N;
	return num_tokens > l->N
		       ? ep__fail(EP_ETOOBIG,
				  "%u tokens exceed the group's maximum of %u "
				  "(this rank took part with none)",
				  num_tokens, l->N)
		       : 0;
}

static int ll_buffer(ep_group_t *g, uint32_t b)
{
	if (!g->ll || b > 1 || !g->ll->used[b])
		return ep__fail(EP_EINVAL, "buffer %u has no low-latency "
					   "dispatch",
				b);
	return 0;
}

static int llk_dispatch_hook(ep_group_t *g, uint32_t b, void *stream)
{
	int rc = ll_buffer(g, b);
	if (rc)
		return rc;
	struct ekc_ll_args a = ll_args(g->ll, b, g->ll->T[b]);
	return ll_launch(g, EP__FN_LL_DISPATCH_RECV, &a, NULL, stream);
}

static int llk_combine(ep_group_t *g, uint32_t b, const void *expert_out,
		       const float *weights, void *out, unsigned flags,
		       void *stream)
{
	int rc = ll_buffer(g, b);
	if (rc)
		return rc;
	struct ep_ll *l = g->ll;
	if (l->T[b] && (!weights || !out))
		return ep__fail(EP_EINVAL, "weights and out are required");
	if (!(flags & EP_LL_ZERO_COPY) && !expert_out)
		return ep__fail(EP_EINVAL, "expert_out is required (or "
					   "EP_LL_ZERO_COPY)");
	struct ekc_ll_args a = ll_args(l, b, l->T[b]);
	a.weights = (uint64_t)(uintptr_t)weights;
	a.out = (uint64_t)(uintptr_t)out;
	a.ex = (uint64_t)(uintptr_t)expert_out;
	if (flags & EP_LL_ZERO_COPY)
		return ll_launch(g, EP__FN_LL_COMBINE_PULL, &a, NULL, stream);
	uint32_t with_recv = !(flags & EP_LL_HOOK);
	l->hw[b] = a.weights;
	l->hout[b] = a.out;
	return ll_launch(g, EP__FN_LL_COMBINE, &a, &with_recv, stream);
}

static int llk_combine_hook(ep_group_t *g, uint32_t b, void *stream)
{
	int rc = ll_buffer(g, b);
	if (rc)
		return rc;
	/* the weights and out of the combine it completes */
	struct ep_ll *l = g->ll;
	struct ekc_ll_args a = ll_args(l, b, l->T[b]);
	a.weights = l->hw[b];
	a.out = l->hout[b];
	return ll_launch(g, EP__FN_LL_COMBINE_RECV, &a, NULL, stream);
}

static int llk_combine_buffer(ep_group_t *g, uint32_t b, void **rows)
{
	int rc = ll_setup(g);
	if (rc)
		return rc;
	*rows = (void *)(uintptr_t)(g->ll->peer[g->cfg.rank] + g->ll->L.cx[b]);
	return 0;
}

int ep__ll_trace(ep_group_t *g, uint64_t trace)
{
	if (!g || !g->ll)
		return ep__fail(EP_EINVAL, "no low-latency state to trace");
	g->ll->base.trace = trace;
	return (int)g->ll->blocks;
}

/* The message of err's first bit by precedence; the group's own error
 * for EKC_LL_ERELEASED. */
static int ll_report(ep_group_t *g, uint32_t err)
{
	if (err & EKC_LL_ERELEASED) {
		int e = g->buf ? ep__ctl_error(g) : 0;
		return ep__fail(e ? e : EP_EPEERLOST,
				"a low-latency op ended: the group failed "
				"(%.*s)",
				(int)EPP_CTL_MSG_MAX,
				e ? (const char *)ep__ctl_slot(g) + EPP_CTL_ERR_MSG
				  : "the daemon released it");
	}
	if (err & EKC_LL_ETIMEDOUT)
		return ep__fail(EP_ETIMEDOUT,
				"a low-latency op waited past the group's "
				"timeout for a peer (a rank that did not make "
				"the same call, or died)");
	if (err & EKC_LL_EMASK)
		return ep__fail(EP_EMISMATCH,
				"a low-latency dispatch ended: in shrink mode "
				"a peer counted other ranks present than this "
				"rank did (a rank failed between two ranks' "
				"waits, or the ranks masked different ranks)");
	if (err & EKC_LL_EPEERFAIL)
		return ep__fail(EP_EFAILED,
				"a low-latency op ended: a peer's earlier op "
				"failed (its flags carry the mark)");
	if (err & EKC_LL_EPOISONED)
		return ep__fail(EP_EFAILED, "a low-latency op did nothing: an "
					    "earlier one failed");
	if (err & (EKC_LL_EEXPERT | EKC_LL_ETOOBIG))
		return ep__ll_soft_error(err & EKC_LL_EEXPERT,
					 err & EKC_LL_ETOOBIG);
	return ep__fail(EP_EPROTO, "a peer wrote counts or token indices out "
				   "of range into this rank's region");
}

/* A fatal error, kept: every later call returns it (the kernels' state is
 * out of step with the peers' for good). */
static int ll_die(struct ep_ll *l, int rc, bool poisoned)
{
	l->poisoned = poisoned;
	snprintf(l->dead_msg, sizeof(l->dead_msg),
		 "%s; this group's low-latency mode is over: join a new group",
		 ep_errmsg());
	l->dead_rc = rc;
	return ep__fail(rc, "%s", l->dead_msg);
}

static int llk_error(ep_group_t *g)
{
	struct ep_ll *l = g->ll;
	if (!l)
		return 0;
	if (l->dead_rc)
		return ep__fail(l->dead_rc, "%s", l->dead_msg);
	uint32_t w[EKC_LL_PRIV_POISON + 1];
	CUresult r = ep__drv.cuMemcpyDtoH(w, l->priv, sizeof(w));
	if (r)
		return ep__cufail(r, "reading the low-latency error word");
	const uint32_t err = w[EKC_LL_PRIV_ERR];
	if (!err && !w[EKC_LL_PRIV_POISON])
		return 0;
	int rc = ll_report(g, err ? err : EKC_LL_EPOISONED);
	if (w[EKC_LL_PRIV_POISON])
		return ll_die(l, rc, true);
	static const uint32_t zero;
	ekc_write(&ep__drv, l->priv + 4 * EKC_LL_PRIV_ERR, &zero, 4);
	*l->herr = 0;
	return rc;
}

/* Before a launch: a fatal error the kernels mirrored to the host, or the
 * group's failure, ends the mode here; the caller gets it. Other errors
 * wait for ep_ll_error. The refused op still runs its kernel (ll_launch,
 * where the error is fatal and l->poisoned), with the device's poison
 * word set first (on the stream, so a capture records
 * it): that kernel writes no counts and no rows, only its flags with the
 * mark (a peer still waiting for this rank ends at once, not at its
 * timeout), zero counts for a receive and NaN for a combine's output (a
 * graph replayed in a loop, which never reads the error, must not take
 * stale rows for a result). */
static int ll_gate(ep_group_t *g, void *stream)
{
	struct ep_ll *l = g->ll;
	int rc = 0;
	if (l->dead_rc)
		rc = ep__fail(l->dead_rc, "%s", l->dead_msg);
	else if (*l->herr & (EKC_LL_EFATAL | EKC_LL_EPOISONED))
		rc = llk_error(g);
	else if (g->buf && ep__ctl_error(g) && !ll_gone_only(g))
		rc = ll_die(l, ll_report(g, EKC_LL_ERELEASED), false);
	if (rc && l->dead_rc && !l->poisoned) {
		CUresult r = ep__drv.cuMemsetD32Async(
			l->priv + 4 * EKC_LL_PRIV_POISON, 1, 1,
			(CUstream)stream);
		if (r)
			return ep__cufail(r, "poisoning the low-latency state");
		l->poisoned = true;
	}
	return rc;
}

/* ---- shrink mode (ep.h; the kernels' side: ekc.h) ---- */

/* The ranks that left the group, as the daemon wrote them before it
 * released the group (EPP_CTL_GONE). */
static uint64_t ll_gone(const ep_group_t *g)
{
	if (!g->buf)
		return 0;
	return __atomic_load_n((const uint64_t *)((const uint8_t *)g->buf +
						  EPP_CTL_GROUP_SLOT +
						  EPP_CTL_GONE),
			       __ATOMIC_ACQUIRE);
}

/* In shrink mode, a group that failed because ranks left (and nothing
 * else) leaves the low-latency mode going: its kernels mask them. */
static bool ll_gone_only(const ep_group_t *g)
{
	return g->ll && g->ll->base.shrink && ep__ctl_error(g) == EP_EPEERLOST &&
	       ll_gone(g);
}

/* The kernels' state of a call that only they have, made now. */
static int ll_kernels_only(ep_group_t *g)
{
	int rc = ll_setup(g);
	return rc ? rc : ep__use_ctx(g->cuda_device);
}

static int llk_shrink(ep_group_t *g)
{
	int rc = ll_kernels_only(g);
	if (rc)
		return rc;
	g->ll->base.shrink = 1;
	return 0;
}

static int ll_shrinking(ep_group_t *g, const char *what)
{
	if (!g->ll || !g->ll->base.shrink)
		return ep__fail(EP_EINVAL, "%s: shrink mode is off "
					   "(ep_ll_shrink turns it on)",
				what);
	return ep__use_ctx(g->cuda_device);
}

/* Unmasked, rank d may be admitted again: the high word of its counts
 * flag here (the EKC_LL_OUT mark of a rank given up, ekc_ll.cu) cleared,
 * in the stream's order. A post of d's racing with it fails its
 * compare-and-swap and reads the flag again. */
static CUresult ll_unmark(ep_group_t *g, uint32_t d, void *stream)
{
	const struct ep_ll *l = g->ll;
	return ep__drv.cuMemsetD32Async(l->peer[g->cfg.rank] + l->L.cflag +
						8 * (uint64_t)d + 4,
					0, 1, (CUstream)stream);
}

static int llk_mask(ep_group_t *g, uint32_t rank, int masked, void *stream)
{
	int rc = ll_shrinking(g, "ep_ll_mask");
	if (rc)
		return rc;
	if (rank >= g->ll->W || rank == g->cfg.rank)
		return ep__fail(EP_EINVAL, "ep_ll_mask: rank %u is %s", rank,
				rank == g->cfg.rank ? "this rank" : "not in the "
								    "group");
	CUresult r = ep__drv.cuMemsetD32Async(
		g->ll->priv + 4 * (EKC_LL_PRIV_MASK + rank), masked ? 1 : 0, 1,
		(CUstream)stream);
	if (!r && !masked)
		r = ll_unmark(g, rank, stream);
	return r ? ep__cufail(r, "writing the mask") : 0;
}

static int llk_mask_query(ep_group_t *g, int32_t *mask, void *stream)
{
	int rc = ll_shrinking(g, "ep_ll_mask_query");
	if (rc)
		return rc;
	CUresult r = ep__drv.cuMemcpyDtoDAsync(
		(CUdeviceptr)(uintptr_t)mask,
		g->ll->priv + 4 * EKC_LL_PRIV_MASK, (size_t)g->ll->W * 4,
		(CUstream)stream);
	return r ? ep__cufail(r, "copying the mask") : 0;
}

static int llk_mask_clean(ep_group_t *g, void *stream)
{
	int rc = ll_shrinking(g, "ep_ll_mask_clean");
	if (rc)
		return rc;
	CUresult r = ep__drv.cuMemsetD32Async(
		g->ll->priv + 4 * EKC_LL_PRIV_MASK, 0, g->ll->W,
		(CUstream)stream);
	for (uint32_t d = 0; d < g->ll->W && !r; d++)
		if (d != g->cfg.rank)
			r = ll_unmark(g, d, stream);
	return r ? ep__cufail(r, "clearing the mask") : 0;
}

static int llk_barrier(ep_group_t *g, void *stream)
{
	int rc = ll_kernels_only(g);
	if (rc)
		return rc;
	struct ekc_ll_args a = ll_args(g->ll, 0, 0);
	return ll_launch(g, EP__FN_LL_BARRIER, &a, NULL, stream);
}

/* ---- the ways' tables (libep_llapi.c calls through them) ---- */

/* GPU ranks across nodes: the daemon's path (libep_llx.c), without
 * shrink mode (the kernels'). */
static int llx_dispatch_op(ep_group_t *g, const void *x,
			   const int64_t *topk_idx, uint32_t num_tokens,
			   unsigned flags, int fp8, void *stream,
			   struct ep_ll_recv *out)
{
	(void)flags;
	return ep__llx_dispatch(g, x, topk_idx, num_tokens, fp8, stream, out);
}

static int llx_no_shrink(ep_group_t *g, const char *what, bool on)
{
	(void)g;
	if (on)
		return ep__fail(EP_EINVAL, "%s: shrink mode is off "
					   "(ep_ll_shrink turns it on)",
				what);
	return ep__fail(EP_EUNSUPPORTED,
			"%s runs on the low-latency kernels: GPU ranks of one "
			"node (this group spans several)",
			what);
}

static const struct ep__ll_ops staged_ops = {
	.dispatch = llx_dispatch_op,
	.dispatch_hook = ep__llx_dispatch_hook,
	.combine = ep__llx_combine,
	.combine_hook = ep__llx_combine_hook,
	.combine_buffer = ep__llx_combine_buffer,
	.error = ep__llx_error,
	.no_shrink = llx_no_shrink,
};

/* GPU ranks of one node: the kernels. */
static const struct ep__ll_ops kernel_ops = {
	.dispatch = llk_dispatch,
	.dispatch_hook = llk_dispatch_hook,
	.combine = llk_combine,
	.combine_hook = llk_combine_hook,
	.combine_buffer = llk_combine_buffer,
	.error = llk_error,
	.topk_below = true,
	.shrink = llk_shrink,
	.mask = llk_mask,
	.mask_query = llk_mask_query,
	.mask_clean = llk_mask_clean,
	.barrier = llk_barrier,
};

const struct ep__ll_ops *ep__ll_gpu_ops(const ep_group_t *g)
{
	return g->cfg.world_size != g->cfg.ranks_per_node ? &staged_ops
							   : &kernel_ops;
}
