/* SPDX-License-Identifier: MIT */
/*
 * libep built without CUDA: the stream-ordered API answers
 * EP_EUNSUPPORTED (the host API works as always), and a join that names a
 * GPU is refused before anything is sent. libep_cuda.c replaces this file
 * in a build with CUDA.
 */
#include "libep_int.h"

/* A join that names a GPU is refused before anything is sent, so no
 * group has this table but to fail with it. */
static int no_prepare(int dev, uint8_t uuid[16], uint32_t *rank_flags)
{
	(void)dev, (void)uuid, (void)rank_flags;
	return ep__fail(EP_EUNSUPPORTED, "libep was built without CUDA");
}

const struct ep__gpu_ops ep__gpu = {.prepare = no_prepare};

int ep_barrier_stream(ep_group_t *g, void *stream)
{
	(void)g, (void)stream;
	return ep__fail(EP_EUNSUPPORTED, "libep was built without CUDA");
}

int ep_dispatch_stream(ep_group_t *g, uint32_t num_tokens, unsigned flags,
		       const ep_handle_t *cached, void *stream,
		       ep_handle_t *handle)
{
	(void)g, (void)num_tokens, (void)flags, (void)cached, (void)stream;
	(void)handle;
	return ep__fail(EP_EUNSUPPORTED, "libep was built without CUDA");
}

int ep_combine_stream(ep_group_t *g, const ep_handle_t *h, unsigned flags,
		      void *stream)
{
	(void)g, (void)h, (void)flags, (void)stream;
	return ep__fail(EP_EUNSUPPORTED, "libep was built without CUDA");
}

int ep_dispatch_recv_count(ep_group_t *g, ep_handle_t *h)
{
	(void)g, (void)h;
	return 0; /* host dispatches return their count */
}

int ep_mem_register(ep_group_t *g, const void *ptr, size_t len,
		    ep_mreg_t **mr)
{
	(void)g, (void)ptr, (void)len, (void)mr;
	return ep__fail(EP_EUNSUPPORTED, "libep was built without CUDA");
}

int ep_mem_covers(const ep_mreg_t *mr, const void *ptr, size_t len)
{
	(void)mr, (void)ptr, (void)len;
	return ep__fail(EP_EUNSUPPORTED, "libep was built without CUDA");
}

void ep_mem_range(const ep_mreg_t *mr, uint64_t *base, size_t *len)
{
	(void)mr;
	*base = 0;
	*len = 0;
}

int ep_mem_deregister(ep_mreg_t *mr)
{
	(void)mr;
	return ep__fail(EP_EUNSUPPORTED, "libep was built without CUDA");
}

int ep_combine_stream_reg(ep_group_t *g, const ep_handle_t *h,
			  unsigned flags, const ep_mreg_t *mr, const void *y,
			  uint32_t rows, void *stream)
{
	(void)g, (void)h, (void)flags, (void)mr, (void)y, (void)rows,
		(void)stream;
	return ep__fail(EP_EUNSUPPORTED, "libep was built without CUDA");
}

int ep_combine_stream_mem(ep_group_t *g, const ep_handle_t *h,
			  unsigned flags, const struct ep_combine_mem *mem,
			  void *stream)
{
	(void)g, (void)h, (void)flags, (void)mem, (void)stream;
	return ep__fail(EP_EUNSUPPORTED, "libep was built without CUDA");
}

int ep_dispatch_stream_reg(ep_group_t *g, uint32_t num_tokens,
			   unsigned flags, const ep_handle_t *cached,
			   const ep_mreg_t *mr, const void *x, void *stream,
			   ep_handle_t *handle)
{
	(void)g, (void)num_tokens, (void)flags, (void)cached, (void)mr,
		(void)x, (void)stream, (void)handle;
	return ep__fail(EP_EUNSUPPORTED, "libep was built without CUDA");
}

int ep_stream_copies(const struct ep_copy *c, unsigned n, void *stream)
{
	(void)stream;
	unsigned m;
	int rc = ep__copies_check(c, n, &m);
	if (rc || !m)
		return rc;
	return ep__fail(EP_EUNSUPPORTED, "libep was built without CUDA");
}
