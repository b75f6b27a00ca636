/* SPDX-License-Identifier: MIT */
/*
 * The low-latency mode's calls (ep.h, ep_ll_*): their arguments checked
 * once, then the group's way, chosen at join (struct ep__ll_ops,
 * libep_int.h): a host rank's (libep_llhost.c), a GPU rank's of one node
 * (the kernels, cuda/libep_ll.c) or across nodes (cuda/libep_llx.c).
 */
#include "libep_int.h"

#include "ek.h"

/* g->llops is set at join and never NULL (a GPU rank's join in a build
 * without CUDA fails before it). */

int ep_ll_dispatch(ep_group_t *g, const void *x, const int64_t *topk_idx,
		   uint32_t num_tokens, unsigned flags, void *stream,
		   struct ep_ll_recv *out)
{
	if (!g || !out || (num_tokens && (!x || !topk_idx)))
		return ep__fail(EP_EINVAL, "NULL argument");
	const unsigned known = EP_LL_HOOK | EP_LL_FP8 | EP_LL_ROUND_SCALE |
			       EP_LL_UE8M0 | EP_LL_TOPK(0xff);
	if (flags & ~known)
		return ep__fail(EP_EINVAL, "unknown dispatch flags 0x%x",
				flags & ~known);
	if ((flags & (EP_LL_ROUND_SCALE | EP_LL_UE8M0)) && !(flags & EP_LL_FP8))
		return ep__fail(EP_EINVAL, "EP_LL_ROUND_SCALE and EP_LL_UE8M0 "
					   "need EP_LL_FP8");
	int fp8 = 0;
	if (flags & EP_LL_FP8) {
		const uint32_t m = flags & EP_LL_UE8M0 ? 512 : 128;
		if (g->cfg.hidden % m)
			return ep__fail(EP_ESHAPE, "a fp8 low-latency dispatch "
						   "%sneeds hidden a multiple "
						   "of %u (this group's is %u)",
					flags & EP_LL_UE8M0 ? "with UE8M0 "
							    "scales "
							  : "",
					m, g->cfg.hidden);
		fp8 = flags & EP_LL_UE8M0	   ? EK_LL_FP8_UE8M0
		      : flags & EP_LL_ROUND_SCALE ? EK_LL_FP8_ROUND
						  : EK_LL_FP8;
	}
	const struct ep__ll_ops *o = g->llops;
	const uint32_t K = EP_LL_TOPK_OF(flags);
	if (K && K != g->cfg.topk && !o->topk_below)
		return ep__fail(EP_EUNSUPPORTED,
				"a low-latency dispatch of top-%u in a group of "
				"top-%u runs on the kernels only (GPU ranks of "
				"one node)",
				K, g->cfg.topk);
	return o->dispatch(g, x, topk_idx, num_tokens, flags, fp8, stream,
			   out);
}

int ep_ll_dispatch_hook(ep_group_t *g, uint32_t b, void *stream)
{
	if (!g)
		return ep__fail(EP_EINVAL, "NULL argument");
	return g->llops->dispatch_hook(g, b, stream);
}

int ep_ll_combine(ep_group_t *g, uint32_t b, const void *expert_out,
		  const float *weights, void *out, unsigned flags,
		  void *stream)
{
	if (!g)
		return ep__fail(EP_EINVAL, "NULL argument");
	const unsigned known = EP_LL_HOOK | EP_LL_ZERO_COPY;
	if (flags & ~known)
		return ep__fail(EP_EINVAL, "unknown combine flags 0x%x",
				flags & ~known);
	if ((flags & EP_LL_ZERO_COPY) && (flags & EP_LL_HOOK))
		return ep__fail(EP_EINVAL, "a zero-copy combine reads in place: "
					   "it has no hook");
	return g->llops->combine(g, b, expert_out, weights, out, flags,
				 stream);
}

int ep_ll_combine_hook(ep_group_t *g, uint32_t b, void *stream)
{
	if (!g)
		return ep__fail(EP_EINVAL, "NULL argument");
	return g->llops->combine_hook(g, b, stream);
}

int ep_ll_combine_buffer(ep_group_t *g, uint32_t b, void **rows)
{
	if (!g || !rows || b > 1)
		return ep__fail(EP_EINVAL, "bad argument");
	return g->llops->combine_buffer(g, b, rows);
}

int ep_ll_error(ep_group_t *g)
{
	if (!g)
		return ep__fail(EP_EINVAL, "NULL argument");
	return g->llops->error(g);
}

/* The way of a call of shrink mode (what), in *o: 0, or why it has none
 * (on: the call needs shrink mode turned on). */
static int shrink_way(ep_group_t *g, const char *what, bool on,
		      const struct ep__ll_ops **o)
{
	if (!g)
		return ep__fail(EP_EINVAL, "NULL argument");
	*o = g->llops;
	return (*o)->shrink ? 0 : (*o)->no_shrink(g, what, on);
}

int ep_ll_shrink(ep_group_t *g)
{
	const struct ep__ll_ops *o = NULL;
	int rc = shrink_way(g, "ep_ll_shrink", false, &o);
	return rc ? rc : o->shrink(g);
}

int ep_ll_mask(ep_group_t *g, uint32_t rank, int masked, void *stream)
{
	const struct ep__ll_ops *o = NULL;
	int rc = shrink_way(g, "ep_ll_mask", true, &o);
	return rc ? rc : o->mask(g, rank, masked, stream);
}

int ep_ll_mask_query(ep_group_t *g, int32_t *mask, void *stream)
{
	if (g && !mask)
		return ep__fail(EP_EINVAL, "NULL argument");
	const struct ep__ll_ops *o = NULL;
	int rc = shrink_way(g, "ep_ll_mask_query", true, &o);
	return rc ? rc : o->mask_query(g, mask, stream);
}

int ep_ll_mask_clean(ep_group_t *g, void *stream)
{
	const struct ep__ll_ops *o = NULL;
	int rc = shrink_way(g, "ep_ll_mask_clean", true, &o);
	return rc ? rc : o->mask_clean(g, stream);
}

int ep_ll_barrier(ep_group_t *g, void *stream)
{
	const struct ep__ll_ops *o = NULL;
	int rc = shrink_way(g, "ep_ll_barrier", false, &o);
	return rc ? rc : o->barrier(g, stream);
}
