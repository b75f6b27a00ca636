/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend: loading the driver, finding the devices, the backend
 * table and the devices' status.
 */
#include "cuda_int.h"

struct ekc_driver *cu_drv;

int cu_err(CUresult r, const char *what, char *err, size_t errlen)
{
	int rc = ekc_fail(cu_drv, r, what, err, errlen);
	epd_err("%s", err);
	return rc;
}

/* Make dev's primary context current (retained once). */
int cu_use_dev(struct epd_cuda *cu, int i, char *err, size_t errlen)
{
	struct cudev *d = &cu->dev[i];
	CUresult r;
	if (!d->ctx) {
		r = cu_drv->cuDevicePrimaryCtxRetain(&d->ctx, d->dev);
		if (r)
			return cu_err(r, "cuDevicePrimaryCtxRetain", err,
				      errlen);
		cu_drv->cuCtxSetCurrent(d->ctx);
		r = cu_drv->cuModuleLoadData(&d->mod, ekc_fatbin);
		struct {
			CUfunction *f;
			const char *name;
		} fns[] = {{&d->barrier, "ekc_barrier"},
			   {&d->fastbar, "ekc_fastbar"},
			   {&d->count, "ekc_count"},
			   {&d->scan, "ekc_scan"},
			   {&d->slot, "ekc_slot"},
			   {&d->prep, "ekc_prep"},
			   {&d->copy, "ekc_copy"},
			   {&d->copy_tma, "ekc_copy_tma"},
			   {&d->combine, "ekc_combine"},
			   {&d->combine_fetch, "ekc_combine_fetch"},
			   {&d->combine_lean, "ekc_combine_lean"},
			   {&d->gate, "ekc_gate"}};
		for (size_t f = 0; !r && f < sizeof(fns) / sizeof(fns[0]); f++)
			r = cu_drv->cuModuleGetFunction(fns[f].f, d->mod,
						   fns[f].name);
		if (r) {
			cu_err(r, "loading the kernels", err, errlen);
			cu_drv->cuDevicePrimaryCtxRelease(d->dev);
			d->ctx = NULL;
			return EP_EBACKEND;
		}
		int mps = 0;
		cu_drv->cuDeviceGetAttribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED,
					d->dev);
		d->mps = mps;
		int pools = 0;
		cu_drv->cuDeviceGetAttribute(
			&pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, d->dev);
		d->pools = pools;
		/* The fatbin holds sm_90 code and compute_90 PTX: on another
		 * architecture the driver compiles the PTX at load. Say which. */
		int bin = 0, ptx = 0, ccmaj = 0, ccmin = 0;
		cu_drv->cuFuncGetAttribute(&bin, CU_FUNC_ATTRIBUTE_BINARY_VERSION,
				      d->barrier);
		cu_drv->cuFuncGetAttribute(&ptx, CU_FUNC_ATTRIBUTE_PTX_VERSION,
				      d->barrier);
		cu_drv->cuDeviceGetAttribute(
			&ccmaj, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
			d->dev);
		cu_drv->cuDeviceGetAttribute(
			&ccmin, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
			d->dev);
		if (bin == 90 && ccmaj * 10 + ccmin == 90)
			snprintf(d->code, sizeof(d->code), "sm_90 cubin");
		else
			snprintf(d->code, sizeof(d->code),
				 "compute_%d PTX, compiled by the driver for "
				 "sm_%d%d (binary version %d)",
				 ptx, ccmaj, ccmin, bin);
		epd_info("GPU %d (%s): kernels: %s", i, d->name, d->code);
		/* A grid of the resident blocks (warps take tokens from a
		 * counter, so blocks held back by other kernels cost no
		 * second wave). */
		if (cu_drv->cuOccupancyMaxActiveBlocksPerMultiprocessor(
			    &d->occ_copy, d->copy, 256, 0) ||
		    d->occ_copy < 1)
			d->occ_copy = 1;
		if (cu_drv->cuOccupancyMaxActiveBlocksPerMultiprocessor(
			    &d->occ_combine, d->combine, 256, 0) ||
		    d->occ_combine < 1)
			d->occ_combine = 1;
		if (cu_drv->cuOccupancyMaxActiveBlocksPerMultiprocessor(
			    &d->occ_combine_fetch, d->combine_fetch, 256, 0) ||
		    d->occ_combine_fetch < 1)
			d->occ_combine_fetch = 1;
		if (cu_drv->cuOccupancyMaxActiveBlocksPerMultiprocessor(
			    &d->occ_combine_lean, d->combine_lean, 256, 0) ||
		    d->occ_combine_lean < 1)
			d->occ_combine_lean = 1;
		if (cu_drv->cuDeviceGetAttribute(&d->l2,
					CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
					d->dev))
			d->l2 = 0;
		if (cu_drv->cuOccupancyMaxActiveBlocksPerMultiprocessor(
			    &d->occ_prep, d->prep, 256, 0))
			d->occ_prep = 0; /* count, scan, slot: three launches */
		cu_drv->cuDeviceGetAttribute(
			&d->smem_optin,
			CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
			d->dev);
		d->smem_optin -= 1024; /* the kernel's static shared memory */
		if (d->smem_optin <= 0 ||
		    cu_drv->cuFuncSetAttribute(
			    d->copy_tma,
			    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
			    d->smem_optin))
			d->smem_optin = 0; /* the SIMT copy only */
		if (cu_drv->cuDeviceGetAttribute(
			    &d->smem_sm,
			    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
			    d->dev))
			d->smem_sm = 0;
	}
	r = cu_drv->cuCtxSetCurrent(d->ctx);
	return r ? cu_err(r, "cuCtxSetCurrent", err, errlen) : 0;
}

/* A staged op's copies are done (or some other stream event): poll the
 * staged groups now. */
static void wake_cb(uv_async_t *a)
{
	struct epd_server *srv = a->data;
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->groups)
	{
		struct epd_group *g = LIST_ENTRY(it, struct epd_group, node);
		struct epd_cuda_group *c = cu_group(g);
		if (g->dev == &epd_cuda_backend && c && c->staged &&
		    g->state == EPD_G_READY && !c->poll_closing)
			cu_poll_cb(&c->poll);
	}
}

/* On the driver's thread: only the (thread-safe) wake. */
void CUDA_CB cu_stage_wake(void *p)
{
	uv_async_send(p);
}

int epd_cuda_init(struct epd_server *srv, char *why, size_t len)
{
	struct epd_cuda *cu = calloc(1, sizeof(*cu));
	if (!cu) {
		snprintf(why, len, "out of memory");
		return -1;
	}
	if (ekc_load(&cu->drv, why, len)) {
		free(cu);
		return -1;
	}
	cu_drv = &cu->drv;
	int n = 0;
	if (cu_drv->cuDeviceGetCount(&n) || n == 0) {
		snprintf(why, len, "the CUDA driver sees no GPU");
		free(cu);
		cu_drv = NULL;
		return -1;
	}
	cu->ndev = n > MAX_DEV ? MAX_DEV : n;
	for (int i = 0; i < cu->ndev; i++) {
		struct cudev *d = &cu->dev[i];
		CUuuid u;
		cu_drv->cuDeviceGet(&d->dev, i);
		cu_drv->cuDeviceGetName(d->name, sizeof(d->name), d->dev);
		cu_drv->cuDeviceGetUuid(&u, d->dev);
		memcpy(d->uuid, u.bytes, 16);
		cu_drv->cuDeviceGetAttribute(
			&d->sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
			d->dev);
		int mps = 0;
		cu_drv->cuDeviceGetAttribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED,
					d->dev);
		d->mps = mps;
		CUmemAllocationProp p = {
			.type = CU_MEM_ALLOCATION_TYPE_PINNED,
			.requestedHandleTypes =
				CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
			.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE,
				     .id = i}};
		cu_drv->cuMemGetAllocationGranularity(
			&d->gran, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
		if (!d->gran)
			d->gran = 2u << 20;
	}
	srv->dev_state = cu;
	uv_async_init(srv->loop, &cu->wake, wake_cb);
	cu->wake.data = srv;
	uv_unref((uv_handle_t *)&cu->wake);
	snprintf(why, len, "%d GPU%s (%s), driver %d.%d%s", cu->ndev,
		 cu->ndev > 1 ? "s" : "", cu->dev[0].name, cu_drv->version / 1000,
		 cu_drv->version % 1000 / 10, cu->dev[0].mps ? ", MPS" : ", no MPS");
	return 0;
}

void epd_cuda_fini(struct epd_server *srv)
{
	struct epd_cuda *cu = srv->dev_state;
	if (!cu)
		return;
	for (int i = 0; i < cu->ndev; i++)
		if (cu->dev[i].ctx) {
			cu_drv->cuCtxSetCurrent(cu->dev[i].ctx);
			cu_drv->cuModuleUnload(cu->dev[i].mod);
			cu_drv->cuDevicePrimaryCtxRelease(cu->dev[i].dev);
		}
	/* the loop has ended (every group freed, its streams drained): the
	 * wake is closed for uv_loop_close */
	uv_close((uv_handle_t *)&cu->wake, NULL);
	uv_run(srv->loop, UV_RUN_NOWAIT);
	/* the driver library stays loaded: unloading it is not safe */
	free(cu);
	srv->dev_state = NULL;
}

int cu_find_dev(struct epd_cuda *cu, const uint8_t uuid[16])
{
	for (int i = 0; i < cu->ndev; i++)
		if (!memcmp(cu->dev[i].uuid, uuid, 16))
			return i;
	return -1;
}

void *epd_cuda_status(struct epd_server *srv)
{
	struct epd_cuda *cu = srv->dev_state;
	if (!cu)
		return NULL;
	json_t *devs = json_array();
	for (int i = 0; i < cu->ndev; i++) {
		char u[48];
		const uint8_t *b = cu->dev[i].uuid;
		snprintf(u, sizeof(u),
			 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
			 "%02x%02x%02x%02x%02x%02x",
			 b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8],
			 b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
		json_array_append_new(
			devs, json_pack("{s:i, s:s, s:s, s:i, s:b, s:b, s:s}",
					"index", i, "name", cu->dev[i].name,
					"uuid", u, "sms", cu->dev[i].sms,
					"mps", cu->dev[i].mps, "in_use",
					cu->dev[i].ctx != NULL, "kernels",
					cu->dev[i].ctx ? cu->dev[i].code
						       : "not loaded yet"));
	}
	return json_pack("{s:i, s:o}", "driver_version", cu_drv->version, "devices",
			 devs);
}

/* The cuda backend (backend.h). */
const struct epd_backend_ops epd_cuda_backend = {
	.name = "cuda",
	.init = epd_cuda_init,
	.fini = epd_cuda_fini,
	.status = epd_cuda_status,
	.add_rank = epd_cuda_add_rank,
	.remove_rank = epd_cuda_remove_rank,
	.export_region = epd_cuda_export,
	.group_ready = epd_cuda_group_ready,
	.op = epd_cuda_op,
	.release = epd_cuda_release,
	.group_failed = epd_cuda_group_failed,
	.group_free = epd_cuda_group_free,
	.group_status = epd_cuda_group_status,
	.ll_export = epd_cuda_ll_export,
	.mem_reg = epd_cuda_mem_reg,
	.mem_dereg = epd_cuda_mem_dereg,
};
