/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend: daemon-owned device regions (cuMem, exported as POSIX
 * file descriptors), the group's stream, and stream-ordered barriers.
 *
 * A rank's op k is, on the rank's stream, "doorbell := k" then "wait until
 * done >= k" (libep). Once every local rank asked for op k over the socket,
 * the daemon's stream waits for every doorbell (cuStreamWaitValue32: a
 * front-end wait, no SM spins while the ranks compute) and launches the
 * barrier kernel, which runs both phases and writes done and a completion
 * counter into the host-mapped control page. The loop polls that page while
 * ops are in flight; an op older than the group's timeout is diagnosed from
 * the doorbells (which ranks never rang) and the group fails: errors go to
 * the control page, and every stream is released by writing doorbells and
 * done words far ahead, from a second stream that nothing blocks.
 */
#include "core/epd.h"
#include "core/backend.h"
#include "hostbar.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


#include "ekc.h"

_Static_assert(EKC_RECV_COUNT == EPP_DEV_RECV_COUNT,
	       "the device receive count's place, as libep knows it");

#define MAX_DEV 16
#define MAX_INFLIGHT EPP_MAX_INFLIGHT
#define POLL_MS 1

struct cudev {
	CUdevice dev;
	CUcontext ctx; /* primary context, retained on first use */
	CUmodule mod;
	CUfunction barrier, fastbar, count, scan, slot, prep, copy, copy_tma,
		combine;
	int smem_optin; /* dynamic shared memory a block may opt into */
	size_t gran;
	int occ_copy, occ_combine, occ_prep; /* resident blocks per SM */
	uint8_t uuid[16];
	char name[96];
	int sms;
	bool mps;
	char code[96]; /* which image of the fatbin the driver loaded */
};

struct epd_cuda {
	struct ekc_driver drv;
	int ndev;
	struct cudev dev[MAX_DEV];
	/* Rung by the driver's thread when a staged op's inputs are in host
	 * memory (cuLaunchHostFunc), so that the loop does not wait for its
	 * next poll; lives as long as the server. */
	uv_async_t wake;
};

struct epd_cuda_group {
	struct epd_group *g;
	CUmemGenericAllocationHandle *h; /* [rpn] */
	CUdeviceptr *ptr;                /* [rpn] region base */
	size_t size;                     /* per rank */
	int dev0;                        /* where the group's kernels run */
	CUstream stream, aux;
	bool registered;
	CUdeviceptr ctl_dev; /* the control page, as the GPU sees it */
	uint64_t enqueued;  /* ops on the device stream */
	uint64_t completed; /* ops every rank saw complete */
	uint64_t oldest_ns; /* when the oldest incomplete op was enqueued */
	uint64_t enq_ns[MAX_INFLIGHT];
	/* when the first and the last rank's message of op k came in */
	uint64_t msg_seq[MAX_INFLIGHT], msg_first_ns[MAX_INFLIGHT],
		msg_last_ns[MAX_INFLIGHT];
	/* the last dispatch's and combine's CPU side, in us: first to last
	 * rank's message, last message to the enqueue, the enqueue itself */
	double cpu_us[2][3];
	bool enq_fast[MAX_INFLIGHT]; /* op run by the resident barrier */
	uint64_t wait_ns; /* since when some rank's request is missing */
	/* dispatch scratch (daemon-only device memory) */
	CUdeviceptr mask, blk, base, err, work, topk;
	uint32_t tmax, nblk_max;
	struct route {
		uint64_t seq; /* the dispatch op; 0: empty */
		uint32_t tokens[EKC_MAX_LOCAL];
		CUdeviceptr slot, recv;
	} routes[EPD_MAX_HANDLES];
	uint64_t ndisp;
	/* dispatch rows by the bulk-copy engine: shared memory per block and
	 * resident blocks per SM (0: the SIMT copy) */
	unsigned tma_smem;
	int occ_tma;
	/* Several GPUs: each pushes its own ranks' tokens (dispatch) and pulls
	 * its own ranks' tokens (combine); devs[0] is dev0, whose stream
	 * orders everything. */
	int ndevs;
	int devs[MAX_DEV];
	uint64_t dev_mask[MAX_DEV];
	CUstream dstream[MAX_DEV];
	CUevent ev_in, ev_out[MAX_DEV];
	/* device time of the last dispatch and combine kernels */
	CUevent ev[2][2];
	uint64_t ev_seq[2];
	double last_us[2];
	/* EPD_CUDA_TRACE set: each stage's span in the last dispatch and
	 * combine (ekc_disp_args.trace), copied to pinned host memory at the
	 * end of the op; in us from the op's first kernel start */
	CUdeviceptr trace;
	unsigned long long *trace_host[2];
	double trace_us[2][EKC_TR_N][2];
	uv_timer_t poll;
	bool poll_closing, poll_slow;
	bool released;
	/* The group's barrier engine, if any: the resident barrier kernel
	 * (under MPS) on its own stream, its state in daemon-private pinned
	 * host memory; or the host barrier thread (hb), its state in it. */
	CUstream fbstream;
	struct ek_bar_state *fb; /* set once the engine runs */
	struct epd_hostbar *hb;
	uint64_t fb_counted; /* its barriers already in g->n_barrier */
	/* A group across nodes: each op's data is copied to the group's host
	 * buffer, runs on the host path with the other nodes, and comes back;
	 * one op at a time (stage_*). */
	bool staged;
	int stage_phase; /* 0: none, 1: inputs copying out, 2: host path */
	uint64_t stage_k;
	uint16_t stage_type;
	bool stage_cached;
	uint64_t stage_handle; /* combine, cached dispatch: the GPU handle */
	uint64_t stage_hseq;   /* the host path's routing */
	uint32_t stage_tokens[EKC_MAX_LOCAL], stage_flags[EKC_MAX_LOCAL];
	uint32_t stage_recv[EKC_MAX_LOCAL];
	uint32_t stage_replies;
	int stage_rc;
	char stage_err[256];
	CUevent stage_ev;
	struct {
		uint64_t gpu, host;
	} hmap[EPD_MAX_HANDLES]; /* GPU handle -> host routing */
	uint64_t nhmap;
};

static struct ekc_driver *D;

static int cu_err(CUresult r, const char *what, char *err, size_t errlen)
{
	int rc = ekc_fail(D, r, what, err, errlen);
	epd_err("%s", err);
	return rc;
}

/* Make dev's primary context current (retained once). */
static int use_dev(struct epd_cuda *cu, int i, char *err, size_t errlen)
{
	struct cudev *d = &cu->dev[i];
	CUresult r;
	if (!d->ctx) {
		r = D->cuDevicePrimaryCtxRetain(&d->ctx, d->dev);
		if (r)
			return cu_err(r, "cuDevicePrimaryCtxRetain", err,
				      errlen);
		D->cuCtxSetCurrent(d->ctx);
		r = D->cuModuleLoadData(&d->mod, ekc_fatbin);
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
			   {&d->combine, "ekc_combine"}};
		for (size_t f = 0; !r && f < sizeof(fns) / sizeof(fns[0]); f++)
			r = D->cuModuleGetFunction(fns[f].f, d->mod,
						   fns[f].name);
		if (r) {
			cu_err(r, "loading the kernels", err, errlen);
			D->cuDevicePrimaryCtxRelease(d->dev);
			d->ctx = NULL;
			return EP_EBACKEND;
		}
		int mps = 0;
		D->cuDeviceGetAttribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED,
					d->dev);
		d->mps = mps;
		/* The fatbin holds sm_90 code and compute_90 PTX: on another
		 * architecture the driver compiles the PTX at load. Say which. */
		int bin = 0, ptx = 0, ccmaj = 0, ccmin = 0;
		D->cuFuncGetAttribute(&bin, CU_FUNC_ATTRIBUTE_BINARY_VERSION,
				      d->barrier);
		D->cuFuncGetAttribute(&ptx, CU_FUNC_ATTRIBUTE_PTX_VERSION,
				      d->barrier);
		D->cuDeviceGetAttribute(
			&ccmaj, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
			d->dev);
		D->cuDeviceGetAttribute(
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
		if (D->cuOccupancyMaxActiveBlocksPerMultiprocessor(
			    &d->occ_copy, d->copy, 256, 0) ||
		    d->occ_copy < 1)
			d->occ_copy = 1;
		if (D->cuOccupancyMaxActiveBlocksPerMultiprocessor(
			    &d->occ_combine, d->combine, 256, 0) ||
		    d->occ_combine < 1)
			d->occ_combine = 1;
		if (D->cuOccupancyMaxActiveBlocksPerMultiprocessor(
			    &d->occ_prep, d->prep, 256, 0))
			d->occ_prep = 0; /* count, scan, slot: three launches */
		D->cuDeviceGetAttribute(
			&d->smem_optin,
			CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
			d->dev);
		d->smem_optin -= 1024; /* the kernel's static shared memory */
		if (d->smem_optin <= 0 ||
		    D->cuFuncSetAttribute(
			    d->copy_tma,
			    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
			    d->smem_optin))
			d->smem_optin = 0; /* the SIMT copy only */
	}
	r = D->cuCtxSetCurrent(d->ctx);
	return r ? cu_err(r, "cuCtxSetCurrent", err, errlen) : 0;
}

static void poll_cb(uv_timer_t *t);

/* A staged op's copies are done (or some other stream event): poll the
 * staged groups now. */
static void wake_cb(uv_async_t *a)
{
	struct epd_server *srv = a->data;
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->groups)
	{
		struct epd_group *g = LIST_ENTRY(it, struct epd_group, node);
		if (g->cu && g->cu->staged && g->state == EPD_G_READY &&
		    !g->cu->poll_closing)
			poll_cb(&g->cu->poll);
	}
}

/* On the driver's thread: only the (thread-safe) wake. */
static void CUDA_CB stage_wake(void *p)
{
	uv_async_send(p);
}

static int epd_cuda_init(struct epd_server *srv, char *why, size_t len)
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
	D = &cu->drv;
	int n = 0;
	if (D->cuDeviceGetCount(&n) || n == 0) {
		snprintf(why, len, "the CUDA driver sees no GPU");
		free(cu);
		D = NULL;
		return -1;
	}
	cu->ndev = n > MAX_DEV ? MAX_DEV : n;
	for (int i = 0; i < cu->ndev; i++) {
		struct cudev *d = &cu->dev[i];
		CUuuid u;
		D->cuDeviceGet(&d->dev, i);
		D->cuDeviceGetName(d->name, sizeof(d->name), d->dev);
		D->cuDeviceGetUuid(&u, d->dev);
		memcpy(d->uuid, u.bytes, 16);
		D->cuDeviceGetAttribute(
			&d->sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
			d->dev);
		int mps = 0;
		D->cuDeviceGetAttribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED,
					d->dev);
		d->mps = mps;
		CUmemAllocationProp p = {
			.type = CU_MEM_ALLOCATION_TYPE_PINNED,
			.requestedHandleTypes =
				CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
			.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE,
				     .id = i}};
		D->cuMemGetAllocationGranularity(
			&d->gran, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
		if (!d->gran)
			d->gran = 2u << 20;
	}
	srv->cuda = cu;
	uv_async_init(srv->loop, &cu->wake, wake_cb);
	cu->wake.data = srv;
	uv_unref((uv_handle_t *)&cu->wake);
	snprintf(why, len, "%d GPU%s (%s), driver %d.%d%s", cu->ndev,
		 cu->ndev > 1 ? "s" : "", cu->dev[0].name, D->version / 1000,
		 D->version % 1000 / 10, cu->dev[0].mps ? ", MPS" : ", no MPS");
	return 0;
}

static void epd_cuda_fini(struct epd_server *srv)
{
	struct epd_cuda *cu = srv->cuda;
	if (!cu)
		return;
	for (int i = 0; i < cu->ndev; i++)
		if (cu->dev[i].ctx) {
			D->cuCtxSetCurrent(cu->dev[i].ctx);
			D->cuModuleUnload(cu->dev[i].mod);
			D->cuDevicePrimaryCtxRelease(cu->dev[i].dev);
		}
	/* the loop has ended (every group freed, its streams drained): the
	 * wake is closed for uv_loop_close */
	uv_close((uv_handle_t *)&cu->wake, NULL);
	uv_run(srv->loop, UV_RUN_NOWAIT);
	/* the driver library stays loaded: unloading it is not safe */
	free(cu);
	srv->cuda = NULL;
}

static int find_dev(struct epd_cuda *cu, const uint8_t uuid[16])
{
	for (int i = 0; i < cu->ndev; i++)
		if (!memcmp(cu->dev[i].uuid, uuid, 16))
			return i;
	return -1;
}

static struct epd_cuda_group *cg_get(struct epd_group *g, char *err,
				     size_t errlen)
{
	if (g->cu)
		return g->cu;
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
	g->cu = c;
	return c;
}

static int epd_cuda_add_rank(struct epd_group *g, struct epd_member *m,
		      const struct epp_join *j, char *err, size_t errlen)
{
	struct epd_cuda *cu = g->srv->cuda;
	if (!cu) {
		snprintf(err, errlen, "this epd runs the host backend (%s)",
			 g->srv->backend_reason);
		return EP_EUNSUPPORTED;
	}
	int di = find_dev(cu, j->gpu_uuid);
	if (di < 0) {
		snprintf(err, errlen, "the rank's GPU is not visible to epd "
				      "(check CUDA_VISIBLE_DEVICES)");
		return EP_EINVAL;
	}
	struct epd_cuda_group *c = cg_get(g, err, errlen);
	if (!c)
		return EP_ENOMEM;
	int rc = use_dev(cu, di, err, errlen);
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
	CUresult r = D->cuMemCreate(&h, size, &p, 0);
	if (r) {
		rc = ekc_fail(D, r, "cuMemCreate", err, errlen);
		goto err;
	}
	r = D->cuMemAddressReserve(&ptr, size, d->gran, 0, 0);
	if (r) {
		rc = ekc_fail(D, r, "cuMemAddressReserve", err, errlen);
		goto err_release;
	}
	r = D->cuMemMap(ptr, size, 0, h, 0);
	if (r) {
		rc = ekc_fail(D, r, "cuMemMap", err, errlen);
		goto err_free;
	}
	/* Every GPU of the daemon that can reach it gets access, so the
	 * group's kernels on any of them can work across the node. */
	CUmemAccessDesc acc[MAX_DEV];
	int nacc = 0;
	for (int i = 0; i < cu->ndev; i++) {
		int ok = i == di;
		if (!ok)
			D->cuDeviceCanAccessPeer(&ok, cu->dev[i].dev, d->dev);
		if (ok)
			acc[nacc++] = (CUmemAccessDesc){
				.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE,
					     .id = i},
				.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	}
	r = D->cuMemSetAccess(ptr, size, acc, (size_t)nacc);
	if (r) {
		rc = ekc_fail(D, r, "cuMemSetAccess", err, errlen);
		goto err_unmap;
	}
	r = D->cuMemsetD8(ptr, 0, EKC_CTRL_BYTES);
	if (r) {
		rc = ekc_fail(D, r, "cuMemsetD8", err, errlen);
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
	m->cuda_dev = di;
	m->mps = j->rank_flags & EPP_RANK_MPS;
	epd_info("group %s: rank %u on GPU %d (%s), region of %zu MiB at "
		 "0x%llx",
		 g->shape.name, m->rank, di, d->name, size >> 20,
		 (unsigned long long)ptr);
	return 0;

err_unmap:
	D->cuMemUnmap(ptr, size);
err_free:
	D->cuMemAddressFree(ptr, size);
err_release:
	D->cuMemRelease(h);
err:
	epd_err("group %s: %s", g->shape.name, err);
	return rc;
}

static void free_region(struct epd_cuda_group *c, uint32_t l)
{
	if (!c->ptr[l])
		return;
	D->cuMemUnmap(c->ptr[l], c->size);
	D->cuMemAddressFree(c->ptr[l], c->size);
	D->cuMemRelease(c->h[l]);
	c->ptr[l] = 0;
}

static void epd_cuda_remove_rank(struct epd_group *g, uint32_t l)
{
	/* While forming, a leaving rank's region goes; once ready, the group
	 * fails and everything goes with it. */
	if (g->cu && g->state == EPD_G_FORMING)
		free_region(g->cu, l);
}

static int epd_cuda_export(struct epd_group *g, uint32_t l, int *fd, uint64_t *size)
{
	struct epd_cuda_group *c = g->cu;
	int v = -1;
	CUresult r = D->cuMemExportToShareableHandle(
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

static uint8_t *slot(struct epd_group *g, uint32_t l)
{
	return g->map + (size_t)l * EPP_CTL_SLOT;
}

static volatile uint64_t *completed_word(struct epd_group *g, uint32_t l)
{
	return (volatile uint64_t *)(slot(g, l) + EPP_CTL_COMPLETED);
}

static volatile int32_t *group_error_word(struct epd_group *g)
{
	return (volatile int32_t *)(g->map + EPP_CTL_GROUP_SLOT);
}

static void poll_cb(uv_timer_t *t);
static void poll_arm(struct epd_cuda_group *c);

/* The resident barrier kernel needs MPS on every GPU of the group and
 * for every rank (without it a spinning kernel would hold the GPU's time
 * slice from the ranks' contexts), and is not configured off. */
static bool resident_ok(const struct epd_group *g)
{
	const struct epd_cuda_group *c = g->cu;
	const struct epd_cuda *cu = g->srv->cuda;
	if (g->srv->cfg.cuda_no_resident)
		return false;
	for (int i = 0; i < c->ndevs; i++)
		if (!cu->dev[c->devs[i]].mps)
			return false;
	for (uint32_t l = 0; l < g->shape.ranks_per_node; l++)
		if (!g->local[l]->mps)
			return false;
	return true;
}

/* The resident barrier kernel, and the feature bit that tells libep to
 * ring it instead of sending barriers. */
static int fastbar_start(struct epd_group *g, char *err, size_t errlen)
{
	struct epd_cuda_group *c = g->cu;
	struct cudev *d = &g->srv->cuda->dev[c->dev0];
	uint32_t rpn = g->shape.ranks_per_node;
	void *hp = NULL;
	CUdeviceptr hd = 0;
	CUresult r = D->cuMemHostAlloc(&hp, sizeof(*c->fb),
				       CU_MEMHOSTALLOC_DEVICEMAP |
					       CU_MEMHOSTALLOC_PORTABLE);
	if (r)
		return cu_err(r, "cuMemHostAlloc for the resident barrier",
			      err, errlen);
	memset(hp, 0, sizeof(*c->fb));
	r = D->cuMemHostGetDevicePointer(&hd, hp, 0);
	if (!r)
		r = D->cuStreamCreate(&c->fbstream, CU_STREAM_NON_BLOCKING);
	struct ekc_fastbar_args a = {
		.completed = (uint64_t *)(uintptr_t)(c->ctl_dev +
						     EPP_CTL_COMPLETED),
		.completed_stride = EPP_CTL_SLOT / 8,
		.rpn = rpn,
		.host = (struct ek_bar_state *)(uintptr_t)hd,
		.budget_ns = (uint64_t)g->timeout_ms * 1000000ull,
		.last = c->enqueued};
	for (uint32_t l = 0; l < rpn; l++)
		a.ctrl[l] = c->ptr[l];
	void *params[] = {&a};
	if (!r)
		r = D->cuLaunchKernel(d->fastbar, 1, 1, 1, 32, 1, 1, 0,
				      c->fbstream, params, NULL);
	if (r) {
		D->cuMemFreeHost(hp);
		return cu_err(r, "starting the resident barrier", err, errlen);
	}
	c->fb = hp;
	__atomic_store_n((uint32_t *)(g->map + EPP_CTL_GROUP_SLOT +
				      EPP_CTL_FEATURES),
			 EPP_FEAT_FAST_BARRIER | EPP_FEAT_KERNEL_WAIT,
			 __ATOMIC_RELEASE);
	epd_info("group %s: resident barrier kernel on GPU %d (MPS)",
		 g->shape.name, c->dev0);
	poll_arm(c);
	return 0;
}

/* The host barrier thread (hostbar.h), unless configured off, and the
 * feature bit that tells libep to ring its host doorbell instead of
 * sending barriers. */
static int hostbar_start(struct epd_group *g, char *err, size_t errlen)
{
	struct epd_cuda_group *c = g->cu;
	if (g->srv->cfg.no_host_barrier)
		return 0;
	int rc = epd_hostbar_start(&c->hb, g->map, g->shape.ranks_per_node,
				   (uint64_t)g->timeout_ms * 1000000ull,
				   c->enqueued, err, errlen);
	if (rc)
		return rc;
	c->fb = epd_hostbar_state(c->hb);
	__atomic_store_n((uint32_t *)(g->map + EPP_CTL_GROUP_SLOT +
				      EPP_CTL_FEATURES),
			 EPP_FEAT_HOST_BARRIER, __ATOMIC_RELEASE);
	epd_info("group %s: host barrier thread", g->shape.name);
	poll_arm(c);
	return 0;
}

/* A single-node group's barrier engine: the resident kernel where it can
 * run, else the host thread. Groups across nodes have none (staged). */
static int barrier_engine_start(struct epd_group *g, char *err,
				size_t errlen)
{
	if (g->nnodes > 1)
		return 0;
	return resident_ok(g) ? fastbar_start(g, err, errlen)
			      : hostbar_start(g, err, errlen);
}

/* End the barrier engine (group failed or freed): the kernel polls the
 * stop word while idle and while waiting; the thread is woken. */
static void fastbar_stop(struct epd_cuda_group *c)
{
	if (c->hb)
		epd_hostbar_stop(c->hb);
	else if (c->fb)
		__atomic_store_n(&c->fb->stop, 1, __ATOMIC_RELEASE);
}

/* The newest op known: enqueued, or released by the resident barrier. */
static uint64_t known_top(const struct epd_cuda_group *c)
{
	uint64_t t = c->enqueued;
	if (c->fb) {
		uint64_t f = __atomic_load_n(&c->fb->last, __ATOMIC_ACQUIRE);
		if (f > t)
			t = f;
	}
	return t;
}

/* A 32-bit sequence number written by a kernel, widened near ref. */
static uint64_t widen(uint32_t v, uint64_t ref)
{
	return ref + (uint64_t)(int64_t)(int32_t)(v - (uint32_t)ref);
}

/* Ops every rank saw complete, from the control page. */
static void refresh_completed(struct epd_group *g)
{
	struct epd_cuda_group *c = g->cu;
	uint64_t ref = known_top(c), done = UINT64_MAX;
	for (uint32_t l = 0; l < g->shape.ranks_per_node; l++) {
		uint64_t v = widen((uint32_t)*completed_word(g, l), ref);
		if (v < done)
			done = v;
	}
	if (done != UINT64_MAX && done > c->completed && done <= ref) {
		c->completed = done;
		c->oldest_ns = done < c->enqueued
				       ? c->enq_ns[(done + 1) % MAX_INFLIGHT]
				       : 0;
	}
}

static int epd_cuda_group_ready(struct epd_group *g, char *err, size_t errlen)
{
	struct epd_cuda_group *c = g->cu;
	struct epd_cuda *cu = g->srv->cuda;
	uint32_t rpn = g->shape.ranks_per_node;
	if (rpn > EKC_MAX_LOCAL) {
		snprintf(err, errlen, "at most %d GPU ranks per node",
			 EKC_MAX_LOCAL);
		return EP_EUNSUPPORTED;
	}
	c->dev0 = g->local[0]->cuda_dev;
	for (uint32_t l = 1; l < rpn; l++) {
		int ok = 1, dl = g->local[l]->cuda_dev;
		if (dl != c->dev0)
			D->cuDeviceCanAccessPeer(&ok, cu->dev[c->dev0].dev,
						 cu->dev[dl].dev);
		if (!ok) {
			snprintf(err, errlen, "GPU %d cannot reach GPU %d (no "
					      "peer access)",
				 c->dev0, dl);
			return EP_EUNSUPPORTED;
		}
	}
	/* The GPUs of the group, dev0 first, and their ranks. */
	c->ndevs = 0;
	for (uint32_t l = 0; l < rpn; l++) {
		int dl = g->local[l]->cuda_dev, i;
		for (i = 0; i < c->ndevs && c->devs[i] != dl; i++)
			;
		if (i == c->ndevs) {
			c->devs[c->ndevs++] = dl;
			c->dev_mask[i] = 0;
		}
		c->dev_mask[i] |= 1ull << l;
	}
	int rc;
	for (int i = 0; i < c->ndevs && c->ndevs > 1; i++) {
		if ((rc = use_dev(cu, c->devs[i], err, errlen)))
			return rc;
		for (int j = 0; j < c->ndevs; j++) {
			if (j == i)
				continue;
			if ((rc = use_dev(cu, c->devs[j], err, errlen)))
				return rc;
			D->cuCtxSetCurrent(cu->dev[c->devs[i]].ctx);
			CUresult pr = D->cuCtxEnablePeerAccess(
				cu->dev[c->devs[j]].ctx, 0);
			if (pr && pr != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
				return cu_err(pr, "cuCtxEnablePeerAccess", err,
					      errlen);
		}
		if (i == 0)
			continue;
		D->cuCtxSetCurrent(cu->dev[c->devs[i]].ctx);
		CUresult er = D->cuStreamCreate(&c->dstream[i],
						CU_STREAM_NON_BLOCKING);
		if (!er)
			er = D->cuEventCreate(&c->ev_out[i],
					      CU_EVENT_DISABLE_TIMING);
		if (er)
			return cu_err(er, "a stream on another GPU", err,
				      errlen);
	}
	rc = use_dev(cu, c->dev0, err, errlen);
	if (rc)
		return rc;
	CUresult r = D->cuEventCreate(&c->ev_in, CU_EVENT_DISABLE_TIMING);
	if (r)
		return cu_err(r, "cuEventCreate", err, errlen);
	/* Across nodes the whole buffer is the staging area of the copies. */
	c->staged = g->nnodes > 1;
	r = D->cuMemHostRegister(g->map,
				 c->staged ? g->buf_size : EPP_BUF_HEADER,
				 CU_MEMHOSTREGISTER_DEVICEMAP |
					 CU_MEMHOSTREGISTER_PORTABLE);
	if (!r && c->staged)
		r = D->cuEventCreate(&c->stage_ev, CU_EVENT_DISABLE_TIMING);
	if (r)
		return cu_err(r, "cuMemHostRegister of the control page", err,
			      errlen);
	c->registered = true;
	r = D->cuMemHostGetDevicePointer(&c->ctl_dev, g->map, 0);
	if (r)
		return cu_err(r, "cuMemHostGetDevicePointer", err, errlen);
	r = D->cuStreamCreate(&c->stream, CU_STREAM_NON_BLOCKING);
	if (!r)
		r = D->cuStreamCreate(&c->aux, CU_STREAM_NON_BLOCKING);
	if (r)
		return cu_err(r, "cuStreamCreate", err, errlen);
	/* Dispatch scratch: masks, block counts and bases, the error word,
	 * and a routing (slots, receive counts) per kept handle. */
	/* Rows of a multiple of 16 bytes, two per warp in shared memory: the
	 * bulk-copy engine moves them. */
	size_t rowb = (size_t)g->shape.hidden * g->layout.elt;
	size_t smem = (size_t)EKC_TMA_WARPS * 2 * rowb;
	struct cudev *d0 = &cu->dev[c->dev0];
	if (!g->srv->cfg.cuda_no_tma && rowb % 16 == 0 &&
	    smem <= (size_t)d0->smem_optin &&
	    !D->cuOccupancyMaxActiveBlocksPerMultiprocessor(
		    &c->occ_tma, d0->copy_tma, EKC_TMA_WARPS * 32, smem) &&
	    c->occ_tma > 0)
		c->tma_smem = (unsigned)smem;
	else
		c->occ_tma = 0;
	c->tmax = g->shape.max_tokens ? g->shape.max_tokens : 1;
	c->nblk_max = (c->tmax + 255) / 256;
	size_t W = rpn;
	r = D->cuMemAlloc(&c->mask, W * c->tmax * 8);
	if (!r)
		r = D->cuMemAlloc(&c->topk, W * c->tmax * g->shape.topk * 8);
	if (!r)
		r = D->cuMemAlloc(&c->blk, W * c->nblk_max * W * 4);
	if (!r)
		r = D->cuMemAlloc(&c->base, W * c->nblk_max * W * 4);
	if (!r)
		r = D->cuMemAlloc(&c->err, 16); /* + ekc_prep's grid barrier */
	if (!r)
		r = D->cuMemAlloc(&c->work, MAX_DEV * 4);
	if (!r)
		r = D->cuMemsetD32(c->work, 0xffffffffu, MAX_DEV);
	if (!r && getenv("EPD_CUDA_TRACE")) {
		r = D->cuMemAlloc(&c->trace, EKC_TR_N * 16);
		for (int i = 0; !r && i < 2; i++)
			r = D->cuMemHostAlloc((void **)&c->trace_host[i],
					      EKC_TR_N * 16, 0);
	}
	for (int i = 0; !r && i < EPD_MAX_HANDLES; i++) {
		r = D->cuMemAlloc(&c->routes[i].slot, W * c->tmax * W * 4);
		if (!r)
			r = D->cuMemAlloc(&c->routes[i].recv, W * 4);
	}
	if (r)
		return cu_err(r, "allocating the dispatch scratch", err,
			      errlen);
	for (int i = 0; !r && i < 4; i++)
		r = D->cuEventCreate(&c->ev[i / 2][i % 2], CU_EVENT_DEFAULT);
	if (r)
		return cu_err(r, "cuEventCreate", err, errlen);
	return barrier_engine_start(g, err, errlen);
}

static void poll_arm(struct epd_cuda_group *c)
{
	if (!c->poll_closing &&
	    (c->poll_slow || !uv_is_active((uv_handle_t *)&c->poll))) {
		uv_timer_start(&c->poll, poll_cb, POLL_MS, POLL_MS);
		c->poll_slow = false;
	}
}

/* The host routing of a GPU handle (a group across nodes), or 0. */
static uint64_t hmap_find(const struct epd_cuda_group *c, uint64_t gpu)
{
	for (int i = 0; i < EPD_MAX_HANDLES; i++)
		if (c->hmap[i].gpu == gpu && gpu)
			return c->hmap[i].host;
	return 0;
}

static struct route *route_find(struct epd_cuda_group *c, uint64_t seq)
{
	for (int i = 0; i < EPD_MAX_HANDLES; i++)
		if (c->routes[i].seq == seq && seq)
			return &c->routes[i];
	return NULL;
}

static CUresult launch(struct epd_cuda_group *c, CUfunction f, unsigned gx,
		       unsigned gy, unsigned bx, void *args)
{
	void *params[] = {args};
	return D->cuLaunchKernel(f, gx, gy ? gy : 1, 1, bx, 1, 1, 0, c->stream,
				 params, NULL);
}

/* SMs' worth of blocks for the data kernels: cuda_sms, or all. */
static unsigned sms_cap(const struct epd_group *g, const struct cudev *d)
{
	unsigned cap = g->srv->cfg.cuda_sms;
	return cap && (int)cap < d->sms ? cap : (unsigned)d->sms;
}

/* count + scan + slot as one cooperative launch (ekc_prep): configured,
 * and its grid (a block per 256 tokens of each rank) resident at once.
 * Under MPS other clients' kernels may hold SMs: the driver then waits
 * until the whole grid fits, as a cooperative launch must. */
static bool use_prep(const struct epd_group *g, const struct cudev *d)
{
	const struct epd_cuda_group *c = g->cu;
	return !g->srv->cfg.cuda_no_fused_prep && d->occ_prep > 0 &&
	       (uint64_t)c->nblk_max * g->shape.ranks_per_node <=
		       (uint64_t)d->occ_prep * (uint64_t)d->sms;
}

/* Below 32 SMs the SMs' bulk-copy units are the limit (measured: 0.48 of
 * D2D at 16 SMs against 0.66 for the SIMT copy). */
static bool use_tma(const struct epd_cuda_group *c, unsigned sms)
{
	return c->tma_smem && sms >= 32;
}

/* The SMs of the row copy: the bulk copies of 14 KB rows saturate memory
 * from ~32 SMs on, and more of them contend (H200, DeepSeek-V3 shape, bf16:
 * 0.80-0.82 of D2D at 32 SMs, 0.76 at 132); shorter rows need more SMs
 * (fp8, 7 KB: 0.49 at 32, 0.68-0.72 at 64-80, 0.68 at 132). cuda_copy_sms
 * caps them (auto: 32 SMs per 14 KB of row), leaving the rest to the
 * ranks. */
static unsigned copy_sms(const struct epd_cuda_group *c, unsigned sms)
{
	unsigned cap = c->g->srv->cfg.cuda_copy_sms;
	if (cap == EPD_COPY_SMS_AUTO) {
		uint64_t rowb = (uint64_t)c->g->shape.hidden * c->g->layout.elt;
		uint64_t n = rowb ? (32ull * 14336 + rowb - 1) / rowb : 32;
		cap = n < 32 ? 32 : n > 1024 ? 1024 : (unsigned)n;
	}
	if (use_tma(c, sms) && cap && sms > cap && use_tma(c, cap))
		return cap;
	return sms;
}

/* The dispatch row copy of one GPU: bulk copies or SIMT. */
static CUresult launch_copy(struct epd_cuda_group *c, const struct cudev *d,
			    unsigned sms, CUstream s, void *args)
{
	void *params[] = {args};
	sms = copy_sms(c, sms);
	if (use_tma(c, sms))
		return D->cuLaunchKernel(d->copy_tma, sms * (unsigned)c->occ_tma,
					 1, 1, EKC_TMA_WARPS * 32, 1, 1,
					 c->tma_smem, s, params, NULL);
	return D->cuLaunchKernel(d->copy, sms * (unsigned)d->occ_copy, 1, 1,
				 256, 1, 1, 0, s, params, NULL);
}

/* The other GPUs' part of a copy or combine: each waits for dev0's
 * stream so far, works on its own ranks (rank_mask), and is joined back
 * by join_devs. a->rank_mask is left for dev0's own part. */
static CUresult spread(struct epd_group *g, struct ekc_disp_args *a,
		       unsigned sms_cap, bool combine)
{
	struct epd_cuda_group *c = g->cu;
	struct epd_cuda *cu = g->srv->cuda;
	if (c->ndevs == 1)
		return 0;
	CUresult r = D->cuEventRecord(c->ev_in, c->stream);
	for (int i = 1; !r && i < c->ndevs; i++) {
		struct cudev *d = &cu->dev[c->devs[i]];
		D->cuCtxSetCurrent(d->ctx);
		struct ekc_disp_args b = *a;
		b.rank_mask = c->dev_mask[i];
		b.work = (uint32_t *)(uintptr_t)c->work + i;
		unsigned sms = sms_cap < (unsigned)d->sms ? sms_cap
							  : (unsigned)d->sms;
		void *params[] = {&b};
		r = D->cuStreamWaitEvent(c->dstream[i], c->ev_in, 0);
		if (!r && combine)
			r = D->cuLaunchKernel(d->combine,
					      sms * (unsigned)d->occ_combine, 1,
					      1, 256, 1, 1, 0, c->dstream[i],
					      params, NULL);
		else if (!r)
			r = launch_copy(c, d, sms, c->dstream[i], &b);
		if (!r)
			r = D->cuEventRecord(c->ev_out[i], c->dstream[i]);
	}
	D->cuCtxSetCurrent(cu->dev[c->dev0].ctx);
	return r;
}

/* dev0's stream waits for every other GPU's part. */
static CUresult join_devs(struct epd_cuda_group *c)
{
	CUresult r = 0;
	for (int i = 1; !r && i < c->ndevs; i++)
		r = D->cuStreamWaitEvent(c->stream, c->ev_out[i], 0);
	return r;
}

/* EPD_CUDA_TRACE: the stages' times of op `which` to pinned memory. */
static CUresult trace_fetch(struct epd_cuda_group *c, int which)
{
	if (!c->trace)
		return CUDA_SUCCESS;
	return D->cuMemcpyDtoHAsync(c->trace_host[which], c->trace,
				    EKC_TR_N * 16, c->stream);
}

/* Spans in us from the first stage start (after the op completed). */
static void trace_read(struct epd_cuda_group *c, int which)
{
	const unsigned long long *t = c->trace_host[which];
	unsigned long long t0 = ~0ull;
	for (int i = 0; i < EKC_TR_N; i++)
		if (t[2 * i] < t0)
			t0 = t[2 * i];
	for (int i = 0; i < EKC_TR_N; i++) {
		unsigned long long b = t[2 * i], e = ~t[2 * i + 1];
		c->trace_us[which][i][0] = b != ~0ull ? (double)(b - t0) / 1e3
						      : -1;
		c->trace_us[which][i][1] = e && t0 != ~0ull
						   ? ((double)e - (double)t0) / 1e3
						   : -1;
	}
}

/* Dispatch or combine k on the group's stream (the doorbells are waited
 * for already). Returns a driver error, or 0. */
static CUresult enqueue_data(struct epd_group *g, uint64_t k,
			     struct epd_aop *const *ops, const char **what)
{
	struct epd_cuda_group *c = g->cu;
	struct cudev *d = &g->srv->cuda->dev[c->dev0];
	const uint32_t W = g->shape.ranks_per_node;
	const struct epd_aop *op0 = ops[0];
	struct ekc_disp_args a = {
		.W = W, .H = g->shape.hidden, .K = g->shape.topk,
		.E = g->shape.num_experts, .elt = g->layout.elt,
		.nscales = g->layout.nscales, .Tmax = c->tmax,
		.nblk_max = c->nblk_max, .seq = (uint32_t)k,
		.mask = (uint64_t *)(uintptr_t)c->mask,
		.topk = (int64_t *)(uintptr_t)c->topk,
		.blk = (uint32_t *)(uintptr_t)c->blk,
		.base = (uint32_t *)(uintptr_t)c->base,
		.err = (unsigned long long *)(uintptr_t)c->err,
		.gsync = (uint32_t *)(uintptr_t)(c->err + 8),
		.work = (uint32_t *)(uintptr_t)c->work,
		.host_ctl = (void *)(uintptr_t)c->ctl_dev};
	for (uint32_t l = 0; l < W; l++) {
		a.region[l] = c->ptr[l];
		if (ops[l]->flags & EPP_DISPATCH_WEIGHTS &&
		    ops[l]->type == EPP_DISPATCH)
			a.weights_mask |= 1ull << l;
		if (ops[l]->flags & EPP_COMBINE_BIAS &&
		    ops[l]->type == EPP_COMBINE)
			a.bias_mask |= 1ull << l;
	}
	for (int f = 0; f < EKC_F_N; f++)
		a.off[f] = EKC_CTRL_BYTES + g->layout.off[f];
	bool fresh = op0->type == EPP_DISPATCH &&
		     !(op0->flags & EPP_DISPATCH_CACHED);
	struct route *rt;
	if (fresh) {
		/* the oldest routing makes room */
		rt = &c->routes[c->ndisp++ % EPD_MAX_HANDLES];
		rt->seq = k;
		for (uint32_t l = 0; l < W; l++)
			rt->tokens[l] = ops[l]->tokens;
	} else {
		rt = route_find(c, op0->handle); /* ops_agree checked it */
		if (!rt)
			return CUDA_ERROR_INVALID_VALUE;
	}
	memcpy(a.tokens, rt->tokens, sizeof(a.tokens));
	a.slot = (int32_t *)(uintptr_t)rt->slot;
	a.recv = (uint32_t *)(uintptr_t)rt->recv;
	a.cached = !fresh;
	a.wait = d->mps; /* the kernels wait for the doorbells themselves */
	unsigned sms = sms_cap(g, d);
	CUresult r;
	int which = op0->type == EPP_COMBINE;
	CUevent *ev = c->ev[which];
	if (c->trace) {
		a.trace = (unsigned long long *)(uintptr_t)c->trace;
		r = D->cuMemsetD32Async(c->trace, 0xffffffffu, EKC_TR_N * 4,
					c->stream);
		if (r)
			return r;
	}
	r = D->cuEventRecord(ev[0], c->stream);
	if (r)
		return r;
	c->ev_seq[which] = k;
	a.rank_mask = c->dev_mask[0];
	if (c->ndevs == 1)
		a.rank_mask = W >= 64 ? ~0ull : (1ull << W) - 1;
	if (op0->type == EPP_COMBINE) {
		*what = "combine";
		r = spread(g, &a, sms, true);
		if (!r)
			r = launch(c, d->combine, sms * (unsigned)d->occ_combine,
				   1, 256, &a);
		if (!r)
			r = join_devs(c);
		if (!r)
			r = D->cuEventRecord(ev[1], c->stream);
		return r ? r : trace_fetch(c, which);
	}
	*what = "dispatch";
	r = D->cuMemsetD32Async(c->err, 0xffffffffu, 3, c->stream);
	bool split = true;
	if (!r && fresh && use_prep(g, d)) {
		void *params[] = {&a};
		r = D->cuLaunchCooperativeKernel(d->prep, c->nblk_max, W, 1, 256,
						 1, 1, 0, c->stream, params);
		split = r == CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
		if (split) {
			/* fewer SMs than the device has (an MPS limit):
			 * three launches from now on */
			epd_warn("dispatch prep: the cooperative grid does not "
				 "fit; using three launches");
			d->occ_prep = 0;
			r = 0;
		}
	}
	if (!r && split) {
		if (fresh)
			r = launch(c, d->count, c->nblk_max, W, 256, &a);
		if (!r)
			r = launch(c, d->scan, 1, 1, 1024, &a);
		if (!r && fresh)
			r = launch(c, d->slot, c->nblk_max, W, 256, &a);
	}
	if (!r)
		r = spread(g, &a, sms, false);
	if (!r)
		r = launch_copy(c, d, sms, c->stream, &a);
	if (!r)
		r = join_devs(c);
	/* per-expert counts are made by ekc_copy */
	if (!r)
		r = D->cuEventRecord(ev[1], c->stream);
	return r ? r : trace_fetch(c, which);
}

/* Do the ranks' ops k agree? Fails the group if not. */
static bool ops_agree(struct epd_group *g, uint64_t k,
		      struct epd_aop *const *ops)
{
	const uint32_t W = g->shape.ranks_per_node;
	for (uint32_t l = 1; l < W; l++) {
		const char *why = NULL;
		if (ops[l]->type != ops[0]->type ||
		    ops[l]->fast != ops[0]->fast)
			why = "another operation";
		else if (ops[l]->type != EPP_BARRIER &&
			 ((ops[l]->flags ^ ops[0]->flags) &
			  EPP_DISPATCH_CACHED &&
			  ops[l]->type == EPP_DISPATCH))
			why = "a cached dispatch while others dispatch afresh";
		else if (ops[l]->handle != ops[0]->handle)
			why = "another handle";
		if (why) {
			epd_group_fail(g, EP_EMISMATCH,
				       "op %llu: rank %u asked for %s than rank "
				       "%u (%s vs %s)",
				       (unsigned long long)k,
				       g->local[l]->rank, why,
				       g->local[0]->rank,
				       epp_type_name(ops[l]->type),
				       epp_type_name(ops[0]->type));
			return false;
		}
	}
	if (ops[0]->type != EPP_BARRIER &&
	    (ops[0]->type == EPP_COMBINE ||
	     (ops[0]->flags & EPP_DISPATCH_CACHED)) &&
	    !(g->cu->staged ? hmap_find(g->cu, ops[0]->handle) != 0
			    : route_find(g->cu, ops[0]->handle) != NULL)) {
		epd_group_fail(g, EP_ESTALE,
			       "op %llu: handle %llu is unknown or was evicted "
			       "(the group keeps the last %d dispatches)",
			       (unsigned long long)k,
			       (unsigned long long)ops[0]->handle,
			       EPD_MAX_HANDLES);
		return false;
	}
	return true;
}

/* Arguments of the barrier kernel of op k (the group's ranks, control
 * page, budget, counters); release as in struct ekc_barrier_args. */
static struct ekc_barrier_args barrier_args(struct epd_group *g, uint64_t k,
					    uint32_t release)
{
	struct epd_cuda_group *c = g->cu;
	uint32_t rpn = g->shape.ranks_per_node;
	struct ekc_barrier_args a = {
		.completed = (uint64_t *)(uintptr_t)(c->ctl_dev +
						     EPP_CTL_COMPLETED),
		.completed_stride = EPP_CTL_SLOT / 8,
		.error = (int32_t *)(uintptr_t)(c->ctl_dev +
						EPP_CTL_GROUP_SLOT),
		.budget_ns = (uint64_t)g->timeout_ms * 1000000ull,
		.rpn = rpn,
		.seq = (uint32_t)k,
		.release = release,
		.work = (uint32_t *)(uintptr_t)c->work,
		.nwork = (uint32_t)c->ndevs};
	for (uint32_t l = 0; l < rpn; l++)
		a.ctrl[l] = c->ptr[l];
	return a;
}

/* Across nodes. A field of local rank l: on the device, in host memory. */
static CUdeviceptr dfield(struct epd_group *g, uint32_t l, int f)
{
	return g->cu->ptr[l] + EKC_CTRL_BYTES + g->layout.off[f];
}

/* Copies of field f of every local rank, rows[l] rows of `per` bytes,
 * device to host (out) or back. */
static CUresult stage_copy(struct epd_group *g, int f, const uint32_t *rows,
			   size_t per, bool out)
{
	struct epd_cuda_group *c = g->cu;
	CUresult r = 0;
	for (uint32_t l = 0; !r && l < g->shape.ranks_per_node; l++) {
		size_t n = (size_t)rows[l] * per;
		if (!n)
			continue;
		r = out ? D->cuMemcpyDtoHAsync(epd_region(g, l, f),
					       dfield(g, l, f), n, c->stream)
			: D->cuMemcpyHtoDAsync(dfield(g, l, f),
					       epd_region(g, l, f), n,
					       c->stream);
	}
	return r;
}

static void enqueue_ready(struct epd_group *g);

/* Op k of a group across nodes, step 1: once every local rank rang, its
 * inputs are copied to the host buffer; poll_cb sees the copies done. */
static void stage_begin(struct epd_group *g, uint64_t k,
			struct epd_aop *const *ops)
{
	struct epd_cuda_group *c = g->cu;
	const uint32_t rpn = g->shape.ranks_per_node, H = g->shape.hidden;
	const uint32_t K = g->shape.topk, ns = g->layout.nscales;
	const size_t rowb = (size_t)H * g->layout.elt;
	const struct epd_aop *op0 = ops[0];
	uint32_t T[EKC_MAX_LOCAL], R[EKC_MAX_LOCAL], Tw[EKC_MAX_LOCAL];
	c->stage_type = op0->type;
	c->stage_cached = op0->type == EPP_DISPATCH &&
			  (op0->flags & EPP_DISPATCH_CACHED);
	c->stage_handle = op0->handle;
	const struct ek_route *rt = NULL;
	if (op0->type == EPP_COMBINE || c->stage_cached)
		rt = epd_route_find(g, hmap_find(c, op0->handle));
	CUresult r = 0;
	for (uint32_t l = 0; !r && l < rpn; l++) {
		r = D->cuStreamWaitValue32(c->stream, c->ptr[l] + EKC_DOORBELL,
					   (cuuint32_t)k,
					   CU_STREAM_WAIT_VALUE_GEQ);
		uint32_t rank = g->local[l]->rank;
		c->stage_flags[l] = ops[l]->flags;
		c->stage_tokens[l] = rt ? rt->num_tokens[rank] : ops[l]->tokens;
		T[l] = c->stage_tokens[l];
		R[l] = rt ? rt->num_recv[rank] : 0;
		Tw[l] = ops[l]->flags & EPP_DISPATCH_WEIGHTS ? T[l] : 0;
	}
	if (!r && op0->type == EPP_DISPATCH) {
		r = stage_copy(g, EKC_F_X, T, rowb, true);
		if (!r && ns)
			r = stage_copy(g, EKC_F_SCALES, T, (size_t)ns * 4, true);
		if (!r && !c->stage_cached)
			r = stage_copy(g, EKC_F_TOPK, T, (size_t)K * 8, true);
		if (!r && !c->stage_cached)
			r = stage_copy(g, EKC_F_WEIGHTS, Tw, (size_t)K * 4,
				       true);
	} else if (!r && op0->type == EPP_COMBINE) {
		for (uint32_t l = 0; l < rpn; l++)
			Tw[l] = ops[l]->flags & EPP_COMBINE_BIAS ? T[l] : 0;
		r = stage_copy(g, EKC_F_Y, R, (size_t)H * 2, true);
		if (!r)
			r = stage_copy(g, EKC_F_BIAS, Tw, (size_t)H * 2, true);
	}
	if (!r)
		r = D->cuEventRecord(c->stage_ev, c->stream);
	if (!r)
		r = D->cuLaunchHostFunc(c->stream, stage_wake,
					&g->srv->cuda->wake);
	if (r) {
		char err[200];
		ekc_fail(D, r, "staging op inputs", err, sizeof(err));
		epd_group_fail(g, EP_EBACKEND, "op %llu: %s",
			       (unsigned long long)k, err);
		return;
	}
	c->stage_phase = 1;
	c->stage_k = k;
	c->enq_fast[k % MAX_INFLIGHT] = false;
	c->enq_ns[k % MAX_INFLIGHT] = epd_now_ns();
	if (c->enqueued <= c->completed)
		c->oldest_ns = c->enq_ns[k % MAX_INFLIGHT];
	c->enqueued = k;
	poll_arm(c);
}

static void staged_reply(struct epd_member *m, int code, const char *msg,
			 const void *p, uint32_t len);

/* Step 2: the inputs are in host memory: the host path with the other
 * nodes; each rank's result comes back to staged_reply. */
static void stage_host(struct epd_group *g)
{
	struct epd_cuda_group *c = g->cu;
	c->stage_phase = 2;
	c->stage_replies = 0;
	c->stage_rc = 0;
	c->stage_err[0] = 0;
	switch (c->stage_type) {
	case EPP_BARRIER:
		epd_group_staged_barrier(g, c->stage_k, staged_reply);
		break;
	case EPP_DISPATCH:
		epd_ops_staged_enter(g, EPP_DISPATCH, c->stage_cached,
				     c->stage_cached
					     ? hmap_find(c, c->stage_handle)
					     : 0,
				     c->stage_tokens, c->stage_flags,
				     c->stage_k, staged_reply);
		break;
	default:
		epd_ops_staged_enter(g, EPP_COMBINE, false,
				     hmap_find(c, c->stage_handle),
				     c->stage_tokens, c->stage_flags,
				     c->stage_k, staged_reply);
	}
}

/* Step 3: the results back to the device, then the release. */
static void stage_finish(struct epd_group *g)
{
	struct epd_cuda_group *c = g->cu;
	const uint32_t rpn = g->shape.ranks_per_node, H = g->shape.hidden;
	const uint32_t K = g->shape.topk, ns = g->layout.nscales;
	const uint64_t k = c->stage_k;
	c->stage_phase = 0;
	if (g->state != EPD_G_READY)
		return; /* failed: the streams were released */
	char err[256];
	if (use_dev(g->srv->cuda, c->dev0, err, sizeof(err))) {
		epd_group_fail(g, EP_EBACKEND, "%s", err);
		return;
	}
	CUresult r = 0;
	if (c->stage_rc == EP_EEXPERT) {
		/* that op alone fails, changing nothing (the position is in
		 * this daemon's log) */
		epd_warn("group %s: op %llu: %s", g->shape.name,
			 (unsigned long long)k, c->stage_err);
		for (uint32_t l = 0; l < rpn; l++) {
			uint8_t *s = slot(g, l);
			__atomic_store_n((uint64_t *)(s + EPP_CTL_OP_ERR_POS),
					 UINT64_MAX, __ATOMIC_RELAXED);
			__atomic_store_n((int32_t *)(s + EPP_CTL_OP_ERR_CODE),
					 EP_EEXPERT, __ATOMIC_RELAXED);
			__atomic_store_n((uint64_t *)(s + EPP_CTL_RECV), 0,
					 __ATOMIC_RELAXED);
			__atomic_store_n((uint64_t *)(s + EPP_CTL_RECV_SEQ), k,
					 __ATOMIC_RELEASE);
			__atomic_store_n((uint64_t *)(s + EPP_CTL_OP_ERR_SEQ), k,
					 __ATOMIC_RELEASE);
		}
	} else if (c->stage_rc) {
		epd_group_fail(g, c->stage_rc, "%s", c->stage_err);
		return;
	} else if (c->stage_type == EPP_DISPATCH) {
		if (!c->stage_cached) {
			c->hmap[c->nhmap % EPD_MAX_HANDLES].gpu = k;
			c->hmap[c->nhmap++ % EPD_MAX_HANDLES].host =
				c->stage_hseq;
		}
		const uint32_t *R = c->stage_recv;
		r = stage_copy(g, EKC_F_RECV_X, R,
			       (size_t)H * g->layout.elt, false);
		if (!r && ns)
			r = stage_copy(g, EKC_F_RECV_SCALES, R, (size_t)ns * 4,
				       false);
		if (!c->stage_cached) { /* a cached one: rows and scales */
			uint32_t one[EKC_MAX_LOCAL];
			for (uint32_t l = 0; l < rpn; l++)
				one[l] = 1;
			if (!r)
				r = stage_copy(g, EKC_F_RECV_TOPK, R,
					       (size_t)K * 8, false);
			if (!r)
				r = stage_copy(g, EKC_F_RECV_WEIGHTS, R,
					       (size_t)K * 4, false);
			if (!r)
				r = stage_copy(g, EKC_F_RECV_SRC, R, 8, false);
			if (!r)
				r = stage_copy(g, EKC_F_RECV_PE, one,
					       (size_t)g->shape.num_experts /
						       g->shape.world_size * 4,
					       false);
		}
		for (uint32_t l = 0; !r && l < rpn; l++)
			r = D->cuMemsetD32Async(c->ptr[l] + EKC_RECV_COUNT,
						R[l], 1, c->stream);
		for (uint32_t l = 0; l < rpn; l++) {
			uint8_t *s = slot(g, l);
			__atomic_store_n((uint64_t *)(s + EPP_CTL_RECV), R[l],
					 __ATOMIC_RELAXED);
			__atomic_store_n((uint64_t *)(s + EPP_CTL_RECV_SEQ), k,
					 __ATOMIC_RELEASE);
		}
	} else if (c->stage_type == EPP_COMBINE) {
		r = stage_copy(g, EKC_F_OUT, c->stage_tokens, (size_t)H * 2,
			       false);
	}
	struct ekc_barrier_args a = barrier_args(g, k, 2);
	if (!r)
		r = launch(c, g->srv->cuda->dev[c->dev0].barrier, 1, 1,
			   (rpn + 31) / 32 * 32, &a);
	if (r) {
		ekc_fail(D, r, "staging op results", err, sizeof(err));
		epd_group_fail(g, EP_EBACKEND, "op %llu: %s",
			       (unsigned long long)k, err);
		return;
	}
	enqueue_ready(g); /* the next op */
	poll_arm(c);
}

/* A staged op's result for one rank (its member's completion callback). */
static void staged_reply(struct epd_member *m, int code, const char *msg,
			 const void *p, uint32_t len)
{
	struct epd_group *g = m->group;
	struct epd_cuda_group *c = g ? g->cu : NULL;
	if (!c || c->stage_phase != 2)
		return;
	if (code && !c->stage_rc) {
		c->stage_rc = code;
		snprintf(c->stage_err, sizeof(c->stage_err), "%s",
			 msg ? msg : ep_strerror(code));
	}
	if (!code && c->stage_type == EPP_DISPATCH && p) {
		struct epp_dispatch_ok ok;
		if (epp_dispatch_ok_decode(p, len, &ok) == 0) {
			c->stage_recv[m->local] = ok.num_recv;
			c->stage_hseq = ok.handle.seq;
		}
	}
	if (++c->stage_replies == g->shape.ranks_per_node)
		stage_finish(g);
}

/* Is some rank's request for the next op missing while another rank's
 * is in? (wait_ns: since when; poll_cb times it out.) Ops that every rank
 * asked for and that wait behind a staged op are not missing. */
static void request_wait(struct epd_group *g)
{
	struct epd_cuda_group *c = g->cu;
	uint64_t lo = UINT64_MAX, hi = 0;
	for (uint32_t l = 0; l < g->shape.ranks_per_node; l++) {
		uint64_t a = g->local[l]->async_seq;
		lo = a < lo ? a : lo;
		hi = a > hi ? a : hi;
	}
	if (g->state == EPD_G_READY && hi > c->enqueued && lo <= c->enqueued) {
		if (!c->wait_ns)
			c->wait_ns = epd_now_ns();
	} else {
		c->wait_ns = 0;
	}
}

/* Enqueue every op that all local ranks asked for. */
static void enqueue_ready(struct epd_group *g)
{
	struct epd_cuda_group *c = g->cu;
	struct epd_cuda *cu = g->srv->cuda;
	uint32_t rpn = g->shape.ranks_per_node;
	uint64_t upto = UINT64_MAX;
	for (uint32_t l = 0; l < rpn; l++)
		if (g->local[l]->async_seq < upto)
			upto = g->local[l]->async_seq;
	if (upto <= c->enqueued)
		return;
	char err[256];
	if (use_dev(cu, c->dev0, err, sizeof(err))) {
		epd_group_fail(g, EP_EBACKEND, "%s", err);
		return;
	}
	if (c->staged) {
		/* one op at a time through the host path */
		if (c->stage_phase || g->state != EPD_G_READY)
			return;
		uint64_t k = c->enqueued + 1;
		struct epd_aop *ops[EKC_MAX_LOCAL];
		for (uint32_t l = 0; l < rpn; l++)
			ops[l] = &g->local[l]->aq[k % MAX_INFLIGHT];
		if (ops_agree(g, k, ops))
			stage_begin(g, k, ops);
		request_wait(g);
		return;
	}
	struct ekc_barrier_args a = barrier_args(g, 0, 1);
	struct epd_aop *ops[EKC_MAX_LOCAL];
	for (uint64_t k = c->enqueued + 1; k <= upto; k++) {
		/* a number a rank skipped: a barrier it rang on the device */
		struct epd_aop gap = {.seq = k, .type = EPP_BARRIER,
				      .fast = true};
		for (uint32_t l = 0; l < rpn; l++) {
			ops[l] = &g->local[l]->aq[k % MAX_INFLIGHT];
			if (ops[l]->seq != k)
				ops[l] = &gap;
		}
		if (!ops_agree(g, k, ops))
			return;
		c->enq_fast[k % MAX_INFLIGHT] = ops[0]->fast;
		if (ops[0]->fast) {
			/* the resident kernel runs it (and counts it) */
			c->enq_ns[k % MAX_INFLIGHT] = epd_now_ns();
			if (c->enqueued <= c->completed)
				c->oldest_ns = c->enq_ns[k % MAX_INFLIGHT];
			c->enqueued = k;
			continue;
		}
		CUresult r = 0;
		const char *what = "barrier";
		bool data = ops[0]->type != EPP_BARRIER;
		unsigned bthreads = (rpn + 31) / 32 * 32;
		uint64_t t0 = epd_now_ns();
		a.seq = (uint32_t)k;
		if (!cu->dev[c->dev0].mps) {
			/* Without MPS a spinning kernel would hold the GPU's
			 * time slice from the ranks: wait in the front end. */
			for (uint32_t l = 0; l < rpn && !r; l++)
				r = D->cuStreamWaitValue32(
					c->stream, c->ptr[l] + EKC_DOORBELL,
					(cuuint32_t)k, CU_STREAM_WAIT_VALUE_GEQ);
		}
		/* Under MPS the kernels poll the doorbells themselves: the
		 * barrier kernel for a barrier, count/scan/combine for data
		 * (no launch and no driver call per rank just to wait). */
		if (!r && data)
			r = enqueue_data(g, k, ops, &what);
		/* Every op ends with the barrier kernel: it releases the ranks
		 * and publishes completion, after the data in stream order.
		 * After data kernels only the release is left: they (or the
		 * stream, without MPS) waited for every rank's doorbell. */
		a.release = data ? 2 : 1;
		if (!r)
			r = launch(c, cu->dev[c->dev0].barrier, 1, 1, bthreads,
				   &a);
		if (r) {
			ekc_fail(D, r, what, err, sizeof(err));
			epd_group_fail(g, EP_EBACKEND, "enqueueing op %llu: %s",
				       (unsigned long long)k, err);
			return;
		}
		c->enq_ns[k % MAX_INFLIGHT] = epd_now_ns();
		if (c->enqueued <= c->completed)
			c->oldest_ns = c->enq_ns[k % MAX_INFLIGHT];
		c->enqueued = k;
		if (data && c->msg_seq[k % MAX_INFLIGHT] == k) {
			double *cpu = c->cpu_us[ops[0]->type == EPP_COMBINE];
			uint64_t f = c->msg_first_ns[k % MAX_INFLIGHT],
				 l = c->msg_last_ns[k % MAX_INFLIGHT];
			cpu[0] = (double)(l - f) / 1e3;
			cpu[1] = t0 > l ? (double)(t0 - l) / 1e3 : 0;
			cpu[2] = (double)(c->enq_ns[k % MAX_INFLIGHT] - t0) / 1e3;
		}
		switch (ops[0]->type) {
		case EPP_BARRIER: g->n_barrier++; break;
		case EPP_DISPATCH: g->n_dispatch++; break;
		case EPP_COMBINE: g->n_combine++; break;
		}
	}
	c->wait_ns = 0;
	poll_arm(c);
}

static void epd_cuda_op(struct epd_member *m, const struct epd_aop *op)
{
	struct epd_group *g = m->group;
	struct epd_cuda_group *c = g->cu;
	uint64_t seq = op->seq;
	/* With the resident barrier, the numbers a rank skips are barriers
	 * it rang on the device. */
	if (seq != m->async_seq + 1 && !(c->fb && seq > m->async_seq)) {
		epd_group_fail(g, EP_EPROTO,
			       "rank %u sent stream-ordered op %llu after "
			       "%llu",
			       m->rank, (unsigned long long)seq,
			       (unsigned long long)m->async_seq);
		return;
	}
	refresh_completed(g);
	const struct epd_aop *old = &m->aq[seq % MAX_INFLIGHT];
	if (seq > c->completed + MAX_INFLIGHT - 1 ||
	    (old->seq > c->enqueued && old->seq != seq)) {
		epd_group_fail(g, EP_EBUSY,
			       "rank %u has more than %d stream-ordered ops "
			       "in flight",
			       m->rank, MAX_INFLIGHT);
		return;
	}
	m->aq[seq % MAX_INFLIGHT] = *op;
	m->aq[seq % MAX_INFLIGHT].fast = false;
	m->async_seq = seq;
	uint64_t now = epd_now_ns();
	if (c->msg_seq[seq % MAX_INFLIGHT] != seq) {
		c->msg_seq[seq % MAX_INFLIGHT] = seq;
		c->msg_first_ns[seq % MAX_INFLIGHT] = now;
	}
	c->msg_last_ns[seq % MAX_INFLIGHT] = now;
	enqueue_ready(g);
	request_wait(g);
	poll_arm(c);
}

static bool in_mask(struct epd_group *g, uint32_t l, void *arg)
{
	(void)g;
	return (*(uint64_t *)arg >> l) & 1;
}

static bool no_request(struct epd_group *g, uint32_t l, void *arg)
{
	return g->local[l]->async_seq < *(uint64_t *)arg;
}

/* the doorbell read from the device on the aux stream (the main stream
 * may be blocked on it) */
static bool no_doorbell(struct epd_group *g, uint32_t l, void *arg)
{
	uint32_t v = 0;
	if (D->cuMemcpyDtoH(&v, g->cu->ptr[l] + EKC_DOORBELL, 4))
		return false;
	return (int32_t)(v - (uint32_t)*(uint64_t *)arg) < 0;
}

static void poll_cb(uv_timer_t *t)
{
	struct epd_cuda_group *c = t->data;
	struct epd_group *g = c->g;
	if (g->state != EPD_G_READY) {
		uv_timer_stop(t);
		return;
	}
	refresh_completed(g);
	if (c->staged && c->stage_phase == 1) {
		CUresult q = D->cuEventQuery(c->stage_ev);
		if (q == CUDA_SUCCESS) {
			stage_host(g);
			if (g->state != EPD_G_READY)
				return;
		} else if (q != CUDA_ERROR_NOT_READY) {
			char err[200];
			ekc_fail(D, q, "staging op inputs", err, sizeof(err));
			epd_group_fail(g, EP_EBACKEND, "%s", err);
			return;
		}
	}
	if (c->fb) {
		uint32_t st = __atomic_load_n(&c->fb->state, __ATOMIC_ACQUIRE);
		uint64_t n = __atomic_load_n(&c->fb->count, __ATOMIC_RELAXED);
		g->n_barrier += n - c->fb_counted;
		c->fb_counted = n;
		if (st == EK_BAR_TIMEOUT || st == EK_BAR_MISMATCH) {
			char miss[512];
			uint64_t mask = c->fb->missing;
			uint64_t k = widen(c->fb->seq, known_top(c));
			epd_list_ranks(miss, sizeof(miss), g, in_mask, &mask);
			if (st == EK_BAR_TIMEOUT)
				epd_group_fail(g, EP_ETIMEDOUT,
					       "barrier %llu timed out after "
					       "%u ms %s; ranks whose stream "
					       "never arrived: %s",
					       (unsigned long long)k,
					       g->timeout_ms,
					       c->hb ? "(host barrier)"
						     : "on the device",
					       miss);
			else
				epd_group_fail(g, EP_EMISMATCH,
					       "barrier %llu: ranks %s rang "
					       "another op number (their "
					       "streams ordered ops "
					       "differently)",
					       (unsigned long long)k, miss);
			return;
		}
	}
	/* device time of the last completed dispatch and combine */
	for (int i = 0; i < 2; i++) {
		float ms;
		if (c->ev_seq[i] && c->ev_seq[i] <= c->completed &&
		    D->cuEventElapsedTime(&ms, c->ev[i][0], c->ev[i][1]) ==
			    CUDA_SUCCESS) {
			c->last_us[i] = ms * 1000.0;
			c->ev_seq[i] = 0;
			if (c->trace)
				trace_read(c, i);
		}
	}
	int32_t kerr = *group_error_word(g);
	if (kerr) {
		epd_group_fail(g, EP_ETIMEDOUT,
			       "barrier %llu: the device wait for local rank "
			       "%d timed out after %u ms",
			       (unsigned long long)c->completed + 1, kerr - 1,
			       g->timeout_ms);
		return;
	}
	uint64_t now = epd_now_ns(), budget = (uint64_t)g->timeout_ms * 1000000ull;
	if (c->wait_ns && now - c->wait_ns > budget) {
		char miss[512];
		uint64_t k = c->enqueued + 1;
		epd_list_ranks(miss, sizeof(miss), g, no_request, &k);
		epd_group_fail(g, EP_ETIMEDOUT,
			       "barrier %llu timed out after %u ms; ranks never "
			       "arrived: %s",
			       (unsigned long long)k, g->timeout_ms, miss);
		return;
	}
	if (c->completed >= c->enqueued) {
		if (c->wait_ns)
			return;
		if (!c->fb) {
			uv_timer_stop(t);
		} else if (!c->poll_slow) {
			/* the resident barrier's errors and counts */
			uv_timer_start(t, poll_cb, 20, 20);
			c->poll_slow = true;
		}
		return;
	}
	/* the resident kernel times its own barriers out */
	if (c->enq_fast[(c->completed + 1) % MAX_INFLIGHT])
		return;
	if (now - c->oldest_ns > budget) {
		char miss[512];
		uint64_t k = c->completed + 1;
		epd_list_ranks(miss, sizeof(miss), g, no_doorbell, &k);
		epd_group_fail(g, EP_ETIMEDOUT,
			       "barrier %llu timed out after %u ms on the "
			       "device; ranks whose stream never arrived: %s",
			       (unsigned long long)k, g->timeout_ms,
			       *miss ? miss : "none (the daemon's stream)");
	}
}

static void epd_cuda_group_failed(struct epd_group *g)
{
	struct epd_cuda_group *c = g->cu;
	if (!c || c->released)
		return;
	c->released = true;
	uint32_t rpn = g->shape.ranks_per_node;
	/* The error, for every rank's next call. */
	for (uint32_t l = 0; l < rpn; l++) {
		uint8_t *s = slot(g, l);
		size_t n = strnlen(g->last_error, EPP_CTL_MSG_MAX - 1);
		memcpy(s + EPP_CTL_ERR_MSG, g->last_error, n); /* cut */
		s[EPP_CTL_ERR_MSG + n] = 0;
		__atomic_store_n((int32_t *)(s + EPP_CTL_ERR_CODE),
				 g->fail_code, __ATOMIC_RELEASE);
	}
	fastbar_stop(c);
	if (c->fb) {
		char words[256];
		size_t n = 0;
		for (uint32_t l = 0; l < rpn && n < sizeof(words) - 24; l++)
			n += (size_t)snprintf(words + n, sizeof(words) - n,
					      " %llu",
					      (unsigned long long)*completed_word(g, l));
		epd_info("group %s: the %s released %llu barriers, the "
			 "last %llu; completed words:%s",
			 g->shape.name,
			 c->hb ? "host barrier" : "resident barrier",
			 (unsigned long long)c->fb->count,
			 (unsigned long long)c->fb->last, words);
	}
	/* Release: every doorbell and done word far ahead of any op a rank
	 * could have queued, from the aux stream. Not the resident barrier's
	 * doorbells: it would take a far value for a barrier every rank rang
	 * and write it as completed (it is told to stop instead). The host
	 * barrier's done words are raised here (and never lowered). */
	uint64_t top = known_top(c);
	for (uint32_t l = 0; l < rpn; l++)
		if (g->local[l] && g->local[l]->async_seq > top)
			top = g->local[l]->async_seq;
	uint32_t far = (uint32_t)(top + MAX_INFLIGHT + (1u << 30));
	if (c->hb)
		epd_hostbar_release(g->map, rpn, far);
	if (!c->stream)
		return;
	char err[160];
	if (use_dev(g->srv->cuda, c->dev0, err, sizeof(err)))
		return;
	for (uint32_t l = 0; l < rpn; l++) {
		if (!c->ptr[l])
			continue;
		D->cuStreamWriteValue32(c->aux, c->ptr[l] + EKC_DOORBELL, far,
					0);
		D->cuStreamWriteValue32(c->aux, c->ptr[l] + EKC_DONE, far, 0);
	}
	epd_notice("group %s: released every rank's stream after: %s",
		   g->shape.name, g->last_error);
}

static void poll_closed(uv_handle_t *h)
{
	free(h->data);
}

static void epd_cuda_group_free(struct epd_group *g)
{
	struct epd_cuda_group *c = g->cu;
	if (!c)
		return;
	char err[160];
	if (g->srv->cuda && c->dev0 >= 0 &&
	    !use_dev(g->srv->cuda, c->dev0, err, sizeof(err))) {
		if (c->stream) {
			/* released: the stream drains at once */
			if (!c->released && c->enqueued > c->completed)
				epd_cuda_group_failed(g);
			fastbar_stop(c);
			if (c->fbstream) {
				D->cuStreamSynchronize(c->fbstream);
				D->cuStreamDestroy(c->fbstream);
			}
			D->cuStreamSynchronize(c->aux);
			D->cuStreamSynchronize(c->stream);
			D->cuStreamDestroy(c->stream);
			D->cuStreamDestroy(c->aux);
		}
		if (c->registered)
			D->cuMemHostUnregister(g->map);
		if (c->fb && !c->hb)
			D->cuMemFreeHost(c->fb);
	}
	/* the host barrier thread reads the control page: gone before it */
	epd_hostbar_free(c->hb);
	c->hb = NULL;
	c->fb = NULL;
	for (int i = 0; i < 4; i++)
		if (c->ev[i / 2][i % 2])
			D->cuEventDestroy(c->ev[i / 2][i % 2]);
	if (c->ev_in)
		D->cuEventDestroy(c->ev_in);
	if (c->stage_ev)
		D->cuEventDestroy(c->stage_ev);
	for (int i = 1; i < c->ndevs; i++) {
		if (!c->dstream[i])
			continue;
		D->cuCtxSetCurrent(g->srv->cuda->dev[c->devs[i]].ctx);
		D->cuStreamSynchronize(c->dstream[i]);
		D->cuStreamDestroy(c->dstream[i]);
		D->cuEventDestroy(c->ev_out[i]);
	}
	if (c->dev0 >= 0 && g->srv->cuda)
		D->cuCtxSetCurrent(g->srv->cuda->dev[c->dev0].ctx);
	CUdeviceptr scratch[] = {c->mask, c->topk, c->blk, c->base, c->err,
				 c->work, c->trace};
	for (int i = 0; i < 2; i++)
		if (c->trace_host[i])
			D->cuMemFreeHost(c->trace_host[i]);
	for (size_t i = 0; i < sizeof(scratch) / sizeof(scratch[0]); i++)
		if (scratch[i])
			D->cuMemFree(scratch[i]);
	for (int i = 0; i < EPD_MAX_HANDLES; i++) {
		if (c->routes[i].slot)
			D->cuMemFree(c->routes[i].slot);
		if (c->routes[i].recv)
			D->cuMemFree(c->routes[i].recv);
	}
	for (uint32_t l = 0; l < g->shape.ranks_per_node; l++)
		free_region(c, l);
	free(c->h);
	free(c->ptr);
	g->cu = NULL;
	c->poll_closing = true;
	uv_close((uv_handle_t *)&c->poll, poll_closed);
}

static void *epd_cuda_group_status(struct epd_group *g)
{
	struct epd_cuda_group *c = g->cu;
	if (!c)
		return NULL;
	unsigned sms = sms_cap(g, &g->srv->cuda->dev[c->dev0]);
	/* the barrier engine's own time per barrier (last arrival seen to
	 * release), in us */
	double eng_us = 0;
	if (c->fb) {
		uint64_t n = __atomic_load_n(&c->fb->count, __ATOMIC_ACQUIRE);
		uint64_t b = __atomic_load_n(&c->fb->busy_ns, __ATOMIC_RELAXED);
		eng_us = n ? (double)b / (double)n / 1e3 : 0;
	}
	json_t *o = json_pack("{s:i, s:i, s:b, s:b, s:s, s:f, s:s, s:i, s:s, s:I, s:I, s:f, s:f}",
			 "gpu", c->dev0, "gpus", c->ndevs, "staged", c->staged,
			 "resident_barrier", c->fb && !c->hb, "barrier",
			 c->hb	   ? "host"
			 : c->fb ? "kernel"
				 : "stream",
			 "barrier_engine_us", eng_us, "row_copy", use_tma(c, sms) ? "tma" : "simt",
			 "row_copy_sms", (int)copy_sms(c, sms),
			 "dispatch_prep",
			 use_prep(g, &g->srv->cuda->dev[c->dev0]) ? "fused"
								  : "split",
			 "ops_enqueued", (json_int_t)c->enqueued,
			 "ops_completed", (json_int_t)c->completed,
			 "last_dispatch_us", c->last_us[0], "last_combine_us",
			 c->last_us[1]);
	if (o)
		for (int w = 0; w < 2; w++)
			json_object_set_new(
				o, w ? "last_combine_cpu_us" : "last_dispatch_cpu_us",
				json_pack("{s:f, s:f, s:f}", "gather",
					  c->cpu_us[w][0], "lag", c->cpu_us[w][1],
					  "enqueue", c->cpu_us[w][2]));
	if (o && c->trace) {
		/* {"dispatch": {"count": [start_us, end_us], ...}, ...} */
		static const char *const stage[EKC_TR_N] = {
			"doorbell", "count", "scan", "slot", "copy", "combine"};
		json_t *tr = json_object();
		for (int w = 0; w < 2; w++) {
			json_t *st = json_object();
			for (int i = 0; i < EKC_TR_N; i++)
				if (c->trace_us[w][i][1] >= 0)
					json_object_set_new(
						st, stage[i],
						json_pack("[f, f]",
							  c->trace_us[w][i][0],
							  c->trace_us[w][i][1]));
			json_object_set_new(tr, w ? "combine" : "dispatch", st);
		}
		json_object_set_new(o, "trace_us", tr);
	}
	return o;
}

static void *epd_cuda_status(struct epd_server *srv)
{
	struct epd_cuda *cu = srv->cuda;
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
	return json_pack("{s:i, s:o}", "driver_version", D->version, "devices",
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
	.group_failed = epd_cuda_group_failed,
	.group_free = epd_cuda_group_free,
	.group_status = epd_cuda_group_status,
};
