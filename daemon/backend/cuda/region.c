/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend: each rank's device region (cuMem, exported as a file
 * descriptor for the rank to map) and the group's scratch.
 */
#include "cuda_int.h"

static struct epd_cuda_group *cg_get(struct epd_group *g, char *err,
				     size_t errlen)
{
	if (g->dev_group)
		return g->dev_group;
	uint32_t rpn = g->shape.ranks_per_node;
	struct epd_cuda_group *c = calloc(1, sizeof(*c));
	if (c) {
		c->h = calloc(rpn, sizeof(*c->h));
		c->ptr = calloc(rpn, sizeof(*c->ptr));
	}
	if (!c || !c->h || !c->ptr) {
		if (c) {
			free(c->h);
			free(c->ptr);
		}
		free(c);
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	c->g = g;
	c->dev0 = -1;
	uv_timer_init(g->srv->loop, &c->poll);
	c->poll.data = c;
	g->dev_group = c;
	return c;
}

int epd_cuda_add_rank(struct epd_group *g, struct epd_member *m,
		      const struct epp_join *j, char *err, size_t errlen)
{
	epd_stall_mark("making a rank's GPU region", g->shape.name);
	struct epd_cuda *cu = g->srv->dev_state;
	if (!cu) {
		snprintf(err, errlen, "this epd runs the host backend (%s)",
			 g->srv->backend_reason);
		return EP_EUNSUPPORTED;
	}
	int di = cu_find_dev(cu, j->gpu_uuid);
	if (di < 0) {
		snprintf(err, errlen, "the rank's GPU is not visible to epd "
				      "(check CUDA_VISIBLE_DEVICES)");
		return EP_EINVAL;
	}
	struct epd_cuda_group *c = cg_get(g, err, errlen);
	if (!c)
		return EP_ENOMEM;
	int rc = cu_use_dev(cu, di, err, errlen);
	if (rc)
		return rc;
	struct cudev *d = &cu->dev[di];
	uint32_t l = m->local;
	size_t want = EKC_CTRL_BYTES + g->layout.rank_stride;
	size_t size = (want + d->gran - 1) / d->gran * d->gran;
	if (c->size && c->size != size) {
		snprintf(err, errlen, "GPUs of different allocation "
				      "granularity in one group");
		return EP_EUNSUPPORTED;
	}
	CUmemAllocationProp p = {
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
		.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = di}};
	CUmemGenericAllocationHandle h;
	CUdeviceptr ptr = 0;
	CUresult r = cu_drv->cuMemCreate(&h, size, &p, 0);
	if (r) {
		rc = ekc_fail(cu_drv, r, "cuMemCreate", err, errlen);
		goto err;
	}
	r = cu_drv->cuMemAddressReserve(&ptr, size, d->gran, 0, 0);
	if (r) {
		rc = ekc_fail(cu_drv, r, "cuMemAddressReserve", err, errlen);
		goto err_release;
	}
	r = cu_drv->cuMemMap(ptr, size, 0, h, 0);
	if (r) {
		rc = ekc_fail(cu_drv, r, "cuMemMap", err, errlen);
		goto err_free;
	}
	/* Every GPU of the daemon that can reach it gets access, so the
	 * group's kernels on any of them can work across the node. */
	CUmemAccessDesc acc[MAX_DEV];
	int nacc = 0;
	for (int i = 0; i < cu->ndev; i++) {
		int ok = i == di;
		if (!ok)
			cu_drv->cuDeviceCanAccessPeer(&ok, cu->dev[i].dev, d->dev);
		if (ok)
			acc[nacc++] = (CUmemAccessDesc){
				.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE,
					     .id = i},
				.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	}
	r = cu_drv->cuMemSetAccess(ptr, size, acc, (size_t)nacc);
	if (r) {
		rc = ekc_fail(cu_drv, r, "cuMemSetAccess", err, errlen);
		goto err_unmap;
	}
	/* Zeroed by a copy, not a memset: a memset is a kernel, and this
	 * thread must not wait for SMs that other groups' kernels may hold
	 * (group.c, drain: the loop thread never waits on the GPU unbounded). */
	static const uint8_t zero[EKC_CTRL_BYTES];
	r = ekc_write(cu_drv, ptr, zero, sizeof(zero));
	if (r) {
		rc = ekc_fail(cu_drv, r, "zeroing the region's control bytes",
			      err, errlen);
		goto err_unmap;
	}
	m->aq = calloc(MAX_INFLIGHT, sizeof(*m->aq));
	if (!m->aq) {
		snprintf(err, errlen, "out of memory");
		rc = EP_ENOMEM;
		goto err_unmap;
	}
	c->h[l] = h;
	c->ptr[l] = ptr;
	c->size = size;
	m->dev_index = di;
	m->mps = j->rank_flags & EPP_RANK_MPS;
	epd_info("group %s: rank %u on GPU %d (%s), region of %zu MiB at "
		 "0x%llx",
		 g->shape.name, m->rank, di, d->name, size >> 20,
		 (unsigned long long)ptr);
	return 0;

err_unmap:
	cu_drv->cuMemUnmap(ptr, size);
err_free:
	cu_drv->cuMemAddressFree(ptr, size);
err_release:
	cu_drv->cuMemRelease(h);
err:
	epd_err("group %s: %s", g->shape.name, err);
	return rc;
}

void cu_free_region(struct epd_cuda_group *c, uint32_t l)
{
	if (!c->ptr[l])
		return;
	cu_drv->cuMemUnmap(c->ptr[l], c->size);
	cu_drv->cuMemAddressFree(c->ptr[l], c->size);
	cu_drv->cuMemRelease(c->h[l]);
	c->ptr[l] = 0;
}

void epd_cuda_remove_rank(struct epd_group *g, uint32_t l)
{
	/* While forming, a leaving rank's region goes; once ready, the group
	 * fails and everything goes with it. */
	if (g->dev_group && g->state == EPD_G_FORMING)
		cu_free_region(g->dev_group, l);
}

int epd_cuda_export(struct epd_group *g, uint32_t l, int *fd, uint64_t *size)
{
	struct epd_cuda_group *c = g->dev_group;
	int v = -1;
	CUresult r = cu_drv->cuMemExportToShareableHandle(
		&v, c->h[l], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	if (r) {
		char err[160];
		return cu_err(r, "cuMemExportToShareableHandle", err,
			      sizeof(err));
	}
	*fd = v;
	*size = c->size;
	return 0;
}
