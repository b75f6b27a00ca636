/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend's low-latency regions (core/ll.c says what they are
 * for): one per local rank, on that rank's GPU, sized by the group's
 * shape (ekc_ll_layout_of), made at the first LL_MAP and exported as a
 * file descriptor to every rank that asks. The daemon maps a region only
 * to zero its flags (a fresh allocation's data is the driver's zeroed
 * memory) and never reads it.
 */
#include "cuda_int.h"

#include <unistd.h>

#include "ekc.h"

void cu_ll_free(struct epd_cuda_group *c, uint32_t rpn)
{
	if (!c->ll_h)
		return;
	for (uint32_t l = 0; l < rpn; l++)
		if (c->ll_h[l])
			cu_drv->cuMemRelease(c->ll_h[l]);
	free(c->ll_h);
	c->ll_h = NULL;
	c->ll_size = 0;
}

/* Is the group's shape one the low-latency kernels take? */
static int ll_shape(const struct epp_join *s, char *err, size_t errlen)
{
	const uint32_t W = s->world_size;
	if (s->dtype != EP_DTYPE_BF16) {
		snprintf(err, errlen, "the low-latency mode moves bf16 rows "
				      "(this group's dtype is %u)", s->dtype);
		return EP_EUNSUPPORTED;
	}
	if (W > EKC_LL_MAXW || s->num_experts % W ||
	    s->num_experts > EKC_LL_MAXE) {
		snprintf(err, errlen, "the low-latency mode takes up to %u "
				      "ranks and %u experts, a multiple of the "
				      "ranks (this group: %u ranks, %u experts)",
			 EKC_LL_MAXW, EKC_LL_MAXE, W, s->num_experts);
		return EP_EUNSUPPORTED;
	}
	if ((uint64_t)s->max_tokens * s->topk > EKC_LL_MAXTK ||
	    s->hidden % 8) {
		snprintf(err, errlen, "the low-latency mode takes up to %u "
				      "(token, expert) pairs per rank and a "
				      "hidden size that is a multiple of 8 "
				      "(this group: %u x top-%u, hidden %u)",
			 EKC_LL_MAXTK, s->max_tokens, s->topk, s->hidden);
		return EP_EUNSUPPORTED;
	}
	return 0;
}

static int ll_make(struct epd_group *g, struct epd_cuda_group *c, char *err,
		   size_t errlen)
{
	struct epd_cuda *cu = g->srv->dev_state;
	const struct epp_join *s = &g->shape;
	const uint32_t rpn = s->ranks_per_node, W = s->world_size;
	int rc = ll_shape(s, err, errlen);
	if (rc)
		return rc;
	struct ekc_ll_layout L;
	ekc_ll_layout_of(W, s->max_tokens, s->hidden, s->num_experts / W,
			 s->topk, &L);
	c->ll_h = calloc(rpn, sizeof(*c->ll_h));
	uint8_t *zero = calloc(1, L.flags_end);
	if (!c->ll_h || !zero) {
		free(zero);
		free(c->ll_h);
		c->ll_h = NULL;
		snprintf(err, errlen, "out of memory");
		return EP_ENOMEM;
	}
	epd_stall_mark("making the low-latency regions", s->name);
	for (uint32_t l = 0; l < rpn && !rc; l++) {
		const int di = g->local[l] ? g->local[l]->dev_index : -1;
		if (di < 0 || (rc = cu_use_dev(cu, di, err, errlen)))
			break;
		const struct cudev *d = &cu->dev[di];
		const uint64_t size = (L.total + d->gran - 1) / d->gran * d->gran;
		if (c->ll_size && c->ll_size != size) {
			snprintf(err, errlen, "GPUs of different allocation "
					      "granularity in one group");
			rc = EP_EUNSUPPORTED;
			break;
		}
		c->ll_size = size;
		CUmemAllocationProp p = {
			.type = CU_MEM_ALLOCATION_TYPE_PINNED,
			.requestedHandleTypes =
				CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
			.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE,
				     .id = di}};
		CUresult r = cu_drv->cuMemCreate(&c->ll_h[l], size, &p, 0);
		if (r) {
			c->ll_h[l] = 0;
			rc = ekc_fail(cu_drv, r, "cuMemCreate", err, errlen);
			if (r == CUDA_ERROR_OUT_OF_MEMORY)
				rc = EP_ENOMEM;
			break;
		}
		/* the flags zeroed through a mapping of the daemon's, by a
		 * copy (no kernel: group.c, drain) awaited before the unmap:
		 * cuMemcpyHtoD from pageable memory returned before the
		 * copy engine wrote, and the unmap under it faulted the
		 * daemon's context (every MPS client with it) */
		CUdeviceptr ptr = 0;
		r = cu_drv->cuMemAddressReserve(&ptr, size, d->gran, 0, 0);
		if (!r) {
			r = cu_drv->cuMemMap(ptr, size, 0, c->ll_h[l], 0);
			if (!r) {
				CUmemAccessDesc a = {
					.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE,
						     .id = di},
					.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
				r = cu_drv->cuMemSetAccess(ptr, size, &a, 1);
				if (!r)
					r = ekc_write(cu_drv, ptr, zero,
						      L.flags_end);
				cu_drv->cuMemUnmap(ptr, size);
			}
			cu_drv->cuMemAddressFree(ptr, size);
		}
		if (r)
			rc = ekc_fail(cu_drv, r, "zeroing a low-latency region",
				      err, errlen);
	}
	free(zero);
	if (rc) {
		epd_err("group %s: %s", s->name, err);
		cu_ll_free(c, rpn);
		return rc;
	}
	epd_info("group %s: low-latency regions of %llu MiB per rank",
		 s->name, (unsigned long long)(c->ll_size >> 20));
	return 0;
}

int epd_cuda_ll_export(struct epd_group *g, uint32_t l, int *fd,
		       uint64_t *size, char *err, size_t errlen)
{
	struct epd_cuda_group *c = g->dev_group;
	if (!c || !c->h) {
		snprintf(err, errlen, "the group has no GPU state");
		return EP_EBACKEND;
	}
	int rc = c->ll_h ? 0 : ll_make(g, c, err, errlen);
	if (rc)
		return rc;
	int v = -1;
	CUresult r = cu_drv->cuMemExportToShareableHandle(
		&v, c->ll_h[l], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	if (r)
		return ekc_fail(cu_drv, r, "cuMemExportToShareableHandle", err,
				errlen);
	*fd = v;
	*size = c->ll_size;
	return 0;
}
