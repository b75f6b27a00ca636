/* SPDX-License-Identifier: MIT */
/*
 * libep on GPU ranks: the rank's device region (imported from the daemon's
 * exported cuMem allocation) and stream-ordered operations: on the rank's
 * stream, "doorbell := k" then "wait until done >= k"; the daemon's stream
 * does the rest. Built only with CUDA (libep_nocuda.c otherwise).
 */
#include "libep_cuda_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>

#define MAX_INFLIGHT EPP_MAX_INFLIGHT

uint64_t ep__hb_words(const ep_group_t *g)
{
	return EPP_CTL_HB + (uint64_t)(g->cfg.rank % g->cfg.ranks_per_node) *
				    EPP_CTL_HB_STRIDE;
}

void ep__hb_post(ep_group_t *g, uint64_t k)
{
	uint8_t *w = (uint8_t *)g->buf + ep__hb_words(g);
	uint32_t *sleeping = (uint32_t *)((uint8_t *)g->buf +
					  EPP_CTL_GROUP_SLOT + EPP_CTL_HB_SLEEP);
	__atomic_store_n((uint32_t *)(w + EPP_HB_REQ), (uint32_t)k,
			 __ATOMIC_SEQ_CST);
	if (__atomic_load_n(sleeping, __ATOMIC_SEQ_CST))
		syscall(SYS_futex, sleeping, FUTEX_WAKE, 1, NULL, NULL, 0);
}

struct ekc_driver ep__drv;
static int drv_rc = -1;
static char drv_err[256];
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

static void drv_load(void)
{
	drv_rc = ekc_load(&ep__drv, drv_err, sizeof(drv_err));
}

static int driver(void)
{
	pthread_once(&drv_once, drv_load);
	return drv_rc ? ep__fail(EP_EUNSUPPORTED, "%s", drv_err) : 0;
}

int ep__cufail(CUresult r, const char *what)
{
	char err[200];
	ekc_fail(&ep__drv, r, what, err, sizeof(err));
	return ep__fail(EP_EBACKEND, "%s", err);
}

/* A context on dev current: the caller's if it is on dev, else the
 * primary context (as the CUDA runtime would use). */
static int ensure_ctx(int dev)
{
	CUcontext cur = NULL;
	CUdevice d;
	if (ep__drv.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur &&
	    ep__drv.cuCtxGetDevice(&d) == CUDA_SUCCESS && (int)d == dev)
		return 0;
	CUcontext pc;
	CUresult r = ep__drv.cuDeviceGet(&d, dev);
	if (!r)
		r = ep__drv.cuDevicePrimaryCtxRetain(&pc, d);
	if (!r)
		r = ep__drv.cuCtxSetCurrent(pc);
	return r ? ep__cufail(r, "making a context current") : 0;
}

static CUfunction ring_fn(void);

static int cuda_prepare(int dev, uint8_t uuid[16], uint32_t *rank_flags)
{
	int rc = driver();
	if (rc)
		return rc;
	CUdevice d;
	CUresult r = ep__drv.cuDeviceGet(&d, dev);
	if (r)
		return ep__cufail(r, "cuDeviceGet");
	CUuuid u;
	r = ep__drv.cuDeviceGetUuid(&u, d);
	if (r)
		return ep__cufail(r, "cuDeviceGetUuid");
	memcpy(uuid, u.bytes, 16);
	if (rc = ensure_ctx(dev), rc)
		return rc;
	int mps = 0;
	ep__drv.cuDeviceGetAttribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, d);
	*rank_flags = mps ? EPP_RANK_MPS : 0;
	/* Under MPS, load the kernels' module now: loading it later, behind
	 * work the rank already queued (a stream gated on something only
	 * this rank will do), can wait for that work and deadlock. */
	if (mps)
		(void)ring_fn();
	return 0;
}

int ep__cuda_import(int fd, uint64_t size, int dev, const char *access,
		    CUdeviceptr *pp, CUmemGenericAllocationHandle *hp)
{
	CUmemGenericAllocationHandle h;
	CUresult r = ep__drv.cuMemImportFromShareableHandle(
		&h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	close(fd);
	if (r)
		return ep__cufail(r, "cuMemImportFromShareableHandle");
	CUdeviceptr p;
	r = ep__drv.cuMemAddressReserve(&p, size, 0, 0, 0);
	if (r) {
		ep__drv.cuMemRelease(h);
		return ep__cufail(r, "cuMemAddressReserve");
	}
	r = ep__drv.cuMemMap(p, size, 0, h, 0);
	if (r) {
		ep__drv.cuMemAddressFree(p, size);
		ep__drv.cuMemRelease(h);
		return ep__cufail(r, "cuMemMap");
	}
	CUmemAccessDesc a = {
		.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev},
		.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	r = ep__drv.cuMemSetAccess(p, size, &a, 1);
	if (r) {
		ep__drv.cuMemUnmap(p, size);
		ep__drv.cuMemAddressFree(p, size);
		ep__drv.cuMemRelease(h);
		return ep__cufail(r, access);
	}
	*pp = p;
	*hp = h;
	return 0;
}

static void cuda_unmap(ep_group_t *g);

static int cuda_map(ep_group_t *g, int fd, uint64_t size)
{
	int rc = ensure_ctx(g->cuda_device);
	if (rc) {
		close(fd);
		return rc;
	}
	CUdeviceptr p;
	CUmemGenericAllocationHandle h;
	rc = ep__cuda_import(fd, size, g->cuda_device, "cuMemSetAccess", &p,
			     &h);
	if (rc)
		return rc;
	CUresult r;
	g->dev_ptr = p;
	g->dev_handle = h;
	g->dev_size = size;
	/* The control page for the GPU: a host barrier's doorbell and done
	 * word are there (registered now, before any op is queued). */
	r = ep__drv.cuMemHostRegister(g->buf, EPP_BUF_HEADER,
				  CU_MEMHOSTREGISTER_DEVICEMAP |
					  CU_MEMHOSTREGISTER_PORTABLE);
	CUdeviceptr cd = 0;
	if (!r && (r = ep__drv.cuMemHostGetDevicePointer(&cd, g->buf, 0)))
		ep__drv.cuMemHostUnregister(g->buf);
	if (r) {
		cuda_unmap(g);
		return ep__cufail(r, "registering the control page");
	}
	g->ctl_dev = cd;
	LIST_INIT(&g->mregs);
	/* Loaded now: a capture may not load a module (and under MPS a load
	 * behind queued work can deadlock). */
	(void)ring_fn();
	int grc = ep__graph_init(g);
	if (grc) {
		cuda_unmap(g);
		return grc;
	}
	return 0;
}

/* Has the daemon released the group (its error in this rank's slot)? It
 * does so on a LEAVE before it replies, and when a connection closes: up
 * to 2 s for that to land. */
static bool released(const ep_group_t *g)
{
	for (int i = 0; i < 2000; i++) {
		if (ep__ctl_error(g))
			return true;
		usleep(1000);
	}
	return false;
}

static void cuda_unmap(ep_group_t *g)
{
	/* This group's work may still be queued on the rank's streams
	 * (stream-ordered ops, low-latency kernels waiting for peers, a
	 * graph's replay at its gate): the mappings and the control page go
	 * only once it is done, or the context faults (and under MPS the
	 * GPU's other clients with it). Once the daemon released the group,
	 * every such wait ends at once (the release's far doorbells, the
	 * low-latency kernels' released word, the graph watcher's gates), so
	 * the wait for the context is short. Without the release (a daemon
	 * that died) a stream wait would never end: no wait then, as
	 * before. */
	if (((g->dev_ptr && g->sent) || g->ll || g->llx) && g->buf &&
	    released(g) &&
	    !ep__use_ctx(g->cuda_device))
		(void)ep__drv.cuCtxSynchronize();
	ep__mreg_fini(g);
	ep__ll_fini(g);
	ep__graph_fini(g);
	if (g->ctl_dev)
		ep__drv.cuMemHostUnregister(g->buf);
	g->ctl_dev = 0;
	if (!g->dev_ptr)
		return;
	ep__drv.cuMemUnmap(g->dev_ptr, g->dev_size);
	ep__drv.cuMemAddressFree(g->dev_ptr, g->dev_size);
	ep__drv.cuMemRelease(g->dev_handle);
	g->dev_ptr = 0;
}

uint32_t ep__features(const ep_group_t *g)
{
	if (!g->buf || g->cuda_device < 0)
		return 0;
	return __atomic_load_n((const uint32_t *)((const uint8_t *)g->buf +
						  EPP_CTL_GROUP_SLOT +
						  EPP_CTL_FEATURES),
			       __ATOMIC_ACQUIRE);
}

/* Kernel `which` of kernel_names in the current context: the kernels'
 * module is loaded once per context (the fatbin is linked into libep).
 * NULL if it cannot be: the rank then rings and waits with stream memory
 * operations (and cannot capture ops into graphs). */
static const char *const kernel_names[EP__FN_N] = {
	"ekc_ring_wait",	"ekc_post_wait",       "ekc_ll_dispatch",
	"ekc_ll_dispatch_recv", "ekc_ll_combine",      "ekc_ll_combine_recv",
	"ekc_ll_combine_pull",	"ekc_ll_barrier",      "ekc_copies",
	"ekc_llx_send",		"ekc_llx_recv_count",  "ekc_llx_recv_rows",
	"ekc_llx_gather",	"ekc_llx_sum",	       "ekc_barrier_wait"};

static CUfunction kernel_fn(int which)
{
	static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
	static struct {
		CUcontext ctx;
		CUfunction fn[EP__FN_N];
	} cache[16];
	CUcontext cur = NULL;
	if (ep__drv.cuCtxGetCurrent(&cur) || !cur)
		return NULL;
	CUfunction fn = NULL;
	pthread_mutex_lock(&mu);
	int i;
	for (i = 0; i < 16 && cache[i].ctx && cache[i].ctx != cur; i++)
		;
	if (i < 16 && cache[i].ctx == cur) {
		fn = cache[i].fn[which];
	} else if (i < 16) {
		CUmodule mod;
		cache[i].ctx = cur;
		if (!ep__drv.cuModuleLoadData(&mod, ekc_fatbin))
			for (int k = 0; k < EP__FN_N; k++)
				if (ep__drv.cuModuleGetFunction(&cache[i].fn[k],
								mod,
								kernel_names[k]))
					cache[i].fn[k] = NULL;
		fn = cache[i].fn[which];
	}
	pthread_mutex_unlock(&mu);
	return fn;
}

static CUfunction ring_fn(void)
{
	return kernel_fn(0);
}

CUfunction ep__post_fn(void)
{
	return kernel_fn(EP__FN_POST);
}

CUfunction ep__fn(int which)
{
	return kernel_fn(which);
}

int ep__use_ctx(int dev)
{
	return ensure_ctx(dev);
}

int ep__sm_count(int dev, int *sms)
{
	CUdevice d;
	CUresult r = ep__drv.cuDeviceGet(&d, dev);
	if (!r)
		r = ep__drv.cuDeviceGetAttribute(
			sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d);
	return r ? ep__cufail(r, "the GPU's SM count") : 0;
}

int ep__stream_capturing(void *stream, bool *yes)
{
	CUstreamCaptureStatus cap = CU_STREAM_CAPTURE_STATUS_NONE;
	CUresult cr = ep__drv.cuStreamIsCapturing((CUstream)stream, &cap);
	if (cr)
		return ep__cufail(cr, "asking whether the stream is captured");
	*yes = cap != CU_STREAM_CAPTURE_STATUS_NONE;
	return 0;
}

int ep__host_words(size_t n, volatile uint32_t **host, CUdeviceptr *dev,
		   const char *what)
{
	CUresult r = ep__drv.cuMemHostAlloc((void **)host, n * sizeof(**host),
					    CU_MEMHOSTALLOC_DEVICEMAP |
						    CU_MEMHOSTALLOC_PORTABLE);
	if (r) {
		*host = NULL;
		return ep__cufail(r, what);
	}
	if ((r = ep__drv.cuMemHostGetDevicePointer(dev, (void *)*host, 0))) {
		ep__drv.cuMemFreeHost((void *)*host);
		*host = NULL;
		return ep__cufail(r, what);
	}
	memset((void *)*host, 0, n * sizeof(**host));
	return 0;
}

/* How long the ring kernel spins before it leaves the wait to the stream
 * memory operation behind it: EP_RING_SPIN_US, default 2 ms (longer than
 * any op of a healthy group on one GPU; the bound on how long a killed
 * rank's kernel holds the GPU's MPS server). */
uint64_t ep__ring_spin_ns(void)
{
	static uint64_t ns;
	uint64_t v = __atomic_load_n(&ns, __ATOMIC_RELAXED);
	if (v)
		return v;
	const char *e = getenv("EP_RING_SPIN_US");
	char *end;
	unsigned long long us = e && *e ? strtoull(e, &end, 10) : 2000;
	if (!e || !*e || *end || us == 0 || us > 60000000ull)
		us = 2000;
	v = (uint64_t)us * 1000u;
	__atomic_store_n(&ns, v, __ATOMIC_RELAXED);
	return v;
}

bool ep__kernel_wait(const ep_group_t *g)
{
	/* EP_NO_KERNEL_WAIT=1: stream memory operations instead */
	const char *no = getenv("EP_NO_KERNEL_WAIT");
	return (ep__features(g) & EPP_FEAT_KERNEL_WAIT) && !(no && *no == '1');
}

int ep__send_op(ep_group_t *g, uint16_t type, const uint8_t *payload,
		   uint32_t len, uint64_t k)
{
	uint8_t buf[192];
	memcpy(buf, payload, len);
	struct epp_wr w;
	epp_wr_init(&w, buf + len, 8);
	epp_put_u64(&w, k);
	struct epp_hdr h;
	epp_hdr_init(&h, type, 0);
	h.flags = EPP_F_ASYNC;
	h.length = len + 8;
	int rc = ep__send(g->conn, &h, buf, true);
	if (rc)
		return ep__fail(rc, "send to epd failed: %s", ep_strerror(rc));
	return 0;
}

/* Is this process an MPS client of the group's GPU (CUDA 12.3's
 * attribute; an older driver: no), with the kernel wait not turned off
 * (EP_NO_KERNEL_WAIT=1)? Asked once a group. */
static bool mps_client(ep_group_t *g)
{
	if (!g->mps_known) {
		const char *no = getenv("EP_NO_KERNEL_WAIT");
		CUdevice d;
		int on = 0;
		if (!(no && *no == '1') && !ep__drv.cuCtxGetDevice(&d) &&
		    ep__drv.cuDeviceGetAttribute(
			    &on, (CUdevice_attribute)133 /* MPS_ENABLED */, d))
			on = 0;
		g->mps = on != 0;
		g->mps_known = true;
	}
	return g->mps;
}

/* The ring kernel fn (ekc_ring_wait, or for a barrier ekc_barrier_wait,
 * the same code under a name profilers show as the barrier) on s: bell :=
 * k, then a short spin until done >= k. */
static CUresult ring(CUfunction fn, CUstream s, CUdeviceptr bell,
		     CUdeviceptr done, uint64_t k)
{
	struct ekc_ring_args a = {.bell = (uint32_t *)(uintptr_t)bell,
				  .done = (const uint32_t *)(uintptr_t)done,
				  .k = (uint32_t)k,
				  .budget_ns = ep__ring_spin_ns()};
	void *params[] = {&a};
	return ep__drv.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, params,
				      NULL);
}

/* A stream-ordered op: its frame to the daemon, then doorbell and wait on
 * the stream. A barrier of a group with the resident barrier kernel (type
 * 0) sends no frame: it rings that kernel's doorbell. Returns 0 and the
 * op's number in *seq. */
static int async_op(ep_group_t *g, uint16_t type, const uint8_t *payload,
		    uint32_t len, void *stream, uint64_t *seq)
{
	/* capturing() checked the rank and the group's error */
	int rc = ep__graph_direct_ok(g);
	if (rc)
		return rc;
	if (ep__inflight(g) >= MAX_INFLIGHT - 1 &&
	    (rc = ep__wait_completed(g, MAX_INFLIGHT - 2)))
		return rc;
	uint64_t k = g->sent + 1;
	if (!g->ring_tried && ep__features(g) & EPP_FEAT_KERNEL_WAIT) {
		g->ring_fn = ep__kernel_wait(g) ? ring_fn() : NULL;
		g->ring_tried = true;
	}
	if (type && (rc = ep__send_op(g, type, payload, len, k)))
		return rc;
	CUstream s = (CUstream)stream;
	CUdeviceptr bell = g->dev_ptr + (type ? EKC_DOORBELL : EKC_BAR_DOORBELL);
	CUresult r;
	/* a barrier waits in ekc_barrier_wait where ops wait in a kernel, and
	 * for a host barrier under MPS too (the daemon's thread answers it:
	 * no kernel of the daemon's has to run meanwhile) */
	CUfunction bar_fn =
		!type && (g->ring_fn ||
			  (ep__features(g) & EPP_FEAT_HOST_BARRIER &&
			   mps_client(g)))
			? ep__fn(EP__FN_BARRIER_WAIT)
			: NULL;
	if (!type && ep__features(g) & EPP_FEAT_HOST_BARRIER) {
		/* Post the request first: the daemon's thread may sleep until
		 * a rank has a barrier queued (and is woken if it does). */
		ep__hb_post(g, k);
		CUdeviceptr hw = g->ctl_dev + ep__hb_words(g);
		if (bar_fn)
			r = ring(bar_fn, s, hw + EPP_HB_BELL, hw + EPP_HB_DONE,
				 k);
		else
			r = ep__drv.cuStreamWriteValue32(s, hw + EPP_HB_BELL,
						     (cuuint32_t)k, 0);
		if (!r)
			r = ep__drv.cuStreamWaitValue32(s, hw + EPP_HB_DONE,
						    (cuuint32_t)k,
						    CU_STREAM_WAIT_VALUE_GEQ);
	} else if (g->ring_fn) {
		/* The kernel spins only a short while; a longer wait goes on
		 * in the stream's front end (the memory operation after it,
		 * already satisfied when the kernel saw done). Under MPS a
		 * killed process's context is torn down only after its
		 * kernels end: a kernel spinning for the op's whole timeout
		 * stalled every client of the GPU for that long. */
		r = ring(bar_fn ? bar_fn : (CUfunction)g->ring_fn, s, bell,
			 g->dev_ptr + EKC_DONE, k);
		if (!r)
			r = ep__drv.cuStreamWaitValue32(s, g->dev_ptr + EKC_DONE,
						    (cuuint32_t)k,
						    CU_STREAM_WAIT_VALUE_GEQ);
	} else {
		r = ep__drv.cuStreamWriteValue32(s, bell, (cuuint32_t)k, 0);
		if (!r)
			r = ep__drv.cuStreamWaitValue32(s, g->dev_ptr + EKC_DONE,
						    (cuuint32_t)k,
						    CU_STREAM_WAIT_VALUE_GEQ);
	}
	if (r)
		return ep__cufail(r, "enqueueing on the stream");
	g->sent = k;
	*seq = k;
	return 0;
}

/* Is the stream being captured into a CUDA graph? 0 and *yes, or the
 * error (also: not a GPU rank, the group failed). */
static int capturing(ep_group_t *g, void *stream, bool *yes)
{
	if (g->cuda_device < 0)
		return ep__fail(EP_EUNSUPPORTED,
				"not a GPU rank (join with EP_JOIN_CUDA)");
	int rc = ep__ctl_error(g) ? ep_group_error(g) : 0;
	return rc ? rc : ep__stream_capturing(stream, yes);
}

static int graph_handle_direct(const ep_handle_t *h)
{
	if (h && h->seq & EP__GSEQ)
		return ep__fail(EP_EINVAL,
				"the handle of a dispatch captured into a CUDA "
				"graph names a new routing at each replay: only "
				"ops captured into graphs may use it");
	return 0;
}

int ep_barrier_stream(ep_group_t *g, void *stream)
{
	uint8_t buf[8];
	struct epp_wr w;
	uint64_t seq;
	bool cap;
	if (!g)
		return ep__fail(EP_EINVAL, "NULL group");
	int rc = capturing(g, stream, &cap);
	if (rc)
		return rc;
	bool dev = ep__features(g) &
		   (EPP_FEAT_FAST_BARRIER | EPP_FEAT_HOST_BARRIER);
	if (cap)
		return ep__graph_capture(g, dev ? 0 : EPP_BARRIER, 0, 0, NULL,
					 (CUstream)stream, NULL);
	epp_wr_init(&w, buf, sizeof(buf));
	epp_put_u64(&w, g->id);
	if (dev)
		return async_op(g, 0, NULL, 0, stream, &seq);
	return async_op(g, EPP_BARRIER, buf, 8, stream, &seq);
}

/* ep_dispatch_stream, with x in registration mr at y (mr NULL: the
 * region's x). */
static int dispatch_stream(ep_group_t *g, uint32_t num_tokens, unsigned flags,
			   const ep_handle_t *cached, void *stream,
			   ep_handle_t *handle, const ep_mreg_t *mr,
			   const void *x)
{
	if (!g || !handle)
		return ep__fail(EP_EINVAL, "NULL argument");
	bool cap;
	int rc = capturing(g, stream, &cap);
	if (rc)
		return rc;
	if (mr && cap)
		return ep__fail(EP_EUNSUPPORTED,
				"a dispatch from registered memory cannot be "
				"captured into a CUDA graph (use "
				"ep_dispatch_stream)");
	uint32_t id = 0;
	uint64_t off = 0;
	/* too many tokens: nothing is read (the op fails for every rank) */
	if (mr && num_tokens <= g->cfg.max_tokens &&
	    (rc = ep__mreg_place(g, mr, x,
				 (size_t)num_tokens * g->cfg.hidden *
					 g->layout.elt,
				 &id, &off)))
		return rc;
	uint8_t buf[128];
	uint32_t n;
	if ((rc = ep__dispatch_request_reg(g, num_tokens, flags, cached, id,
					   off, buf, &n)))
		return rc;
	if (cap) {
		/* a replay cannot tell this rank alone: refused at capture */
		if (num_tokens > g->cfg.max_tokens)
			return ep__fail(EP_ETOOBIG,
					"%u tokens exceed the group's maximum "
					"of %u per rank: not captured",
					num_tokens, g->cfg.max_tokens);
		return ep__graph_capture(
			g, EPP_DISPATCH, num_tokens,
			flags | (cached ? EP__GFLAG_CACHED : 0), cached,
			(CUstream)stream, handle);
	}
	if ((rc = graph_handle_direct(cached)))
		return rc;
	uint64_t seq;
	rc = async_op(g, EPP_DISPATCH, buf, n, stream, &seq);
	if (rc)
		return rc;
	g->last_dispatch = seq;
	g->last_cached = cached != NULL;
	if (num_tokens > g->cfg.max_tokens) {
		/* enqueued all the same: every rank's op fails (the others
		 * learn from its count or ep_group_sync), this one now */
		g->toobig_seq = seq;
		return ep__fail(EP_ETOOBIG,
				"%u tokens exceed the group's maximum of %u per "
				"rank: dispatch %llu fails for every rank of the "
				"group and changes nothing",
				num_tokens, g->cfg.max_tokens,
				(unsigned long long)seq);
	}
	*handle = (ep_handle_t){.group_id = g->id,
				.seq = cached ? cached->seq : seq,
				.epoch = g->epoch,
				.num_tokens = num_tokens,
				.num_recv = UINT32_MAX};
	return 0;
}

int ep_dispatch_stream(ep_group_t *g, uint32_t num_tokens, unsigned flags,
		       const ep_handle_t *cached, void *stream,
		       ep_handle_t *handle)
{
	return dispatch_stream(g, num_tokens, flags, cached, stream, handle,
			       NULL, NULL);
}

int ep_dispatch_stream_reg(ep_group_t *g, uint32_t num_tokens,
			   unsigned flags, const ep_handle_t *cached,
			   const ep_mreg_t *mr, const void *x, void *stream,
			   ep_handle_t *handle)
{
	if (!mr || (!x && num_tokens))
		return ep__fail(EP_EINVAL, "NULL argument");
	return dispatch_stream(g, num_tokens, flags, cached, stream, handle,
			       mr, x);
}

/* ep_combine_stream with the places of mem (NULL: the buffers). */
static int combine_stream(ep_group_t *g, const ep_handle_t *h, unsigned flags,
			  void *stream, const struct ep_combine_mem *mem)
{
	if (!g || !h)
		return ep__fail(EP_EINVAL, "NULL argument");
	bool cap;
	int rc = capturing(g, stream, &cap);
	if (rc)
		return rc;
	struct ep__place in, out;
	const bool yreg = mem && mem->y_reg, oreg = mem && mem->out_reg;
	if ((yreg || oreg) && cap)
		return ep__fail(EP_EUNSUPPORTED,
				"a combine with registered memory cannot be "
				"captured into a CUDA graph (use "
				"ep_combine_stream)");
	if (yreg) {
		const uint32_t rows = mem->rows;
		if (!mem->y && rows)
			return ep__fail(EP_EINVAL, "NULL rows");
		if (h->num_recv != UINT32_MAX && rows != h->num_recv)
			return ep__fail(EP_ESHAPE,
					"combine of %u rows; the handle "
					"received %u",
					rows, h->num_recv);
		if (rows > g->layout.max_recv)
			return ep__fail(EP_ESHAPE,
					"combine of %u rows; the group receives "
					"%llu at most",
					rows,
					(unsigned long long)g->layout.max_recv);
		in.rows = rows;
		if ((rc = ep__mreg_place(g, mem->y_reg, mem->y,
					 (size_t)rows * g->cfg.hidden * 2,
					 &in.reg, &in.off)))
			return rc;
	}
	if (oreg) {
		/* the handle's tokens (ep__check_handle bounds them below) */
		out.rows = h->num_tokens;
		if (!mem->out && out.rows)
			return ep__fail(EP_EINVAL, "NULL output");
		if (out.rows > g->cfg.max_tokens)
			return ep__fail(EP_ESHAPE,
					"a handle of %u tokens; the group "
					"sends %u at most",
					out.rows, g->cfg.max_tokens);
		if ((rc = ep__mreg_place(g, mem->out_reg, mem->out,
					 (size_t)out.rows * g->cfg.hidden * 2,
					 &out.reg, &out.off)))
			return rc;
	}
	uint8_t buf[128];
	uint32_t n;
	if ((rc = ep__combine_request_reg(g, h, flags, yreg ? &in : NULL,
					  oreg ? &out : NULL, buf, &n)))
		return rc;
	if (cap)
		return ep__graph_capture(g, EPP_COMBINE, 0, flags, h,
					 (CUstream)stream, NULL);
	if ((rc = graph_handle_direct(h)))
		return rc;
	uint64_t seq;
	return async_op(g, EPP_COMBINE, buf, n, stream, &seq);
}

int ep_combine_stream(ep_group_t *g, const ep_handle_t *h, unsigned flags,
		      void *stream)
{
	return combine_stream(g, h, flags, stream, NULL);
}

int ep_combine_stream_reg(ep_group_t *g, const ep_handle_t *h,
			  unsigned flags, const ep_mreg_t *mr, const void *y,
			  uint32_t rows, void *stream)
{
	if (!mr || (!y && rows))
		return ep__fail(EP_EINVAL, "NULL argument");
	const struct ep_combine_mem m = {.y_reg = mr, .y = y, .rows = rows};
	return combine_stream(g, h, flags, stream, &m);
}

int ep_combine_stream_mem(ep_group_t *g, const ep_handle_t *h,
			  unsigned flags, const struct ep_combine_mem *mem,
			  void *stream)
{
	if (!mem)
		return ep__fail(EP_EINVAL, "NULL argument");
	return combine_stream(g, h, flags, stream, mem);
}

int ep_dispatch_recv_count(ep_group_t *g, ep_handle_t *h)
{
	if (!g || !h)
		return ep__fail(EP_EINVAL, "NULL argument");
	if (g->cuda_device < 0)
		return 0; /* host dispatches return their count */
	if (h->seq & EP__GSEQ)
		return ep__fail(EP_EINVAL,
				"a captured dispatch's count is read on the "
				"device (ep_dispatch_recv_count_device)");
	/* The count of the most recent dispatch (fresh or cached) of h's
	 * routing is in the control page once its routing is known (the
	 * rows land after, in stream order). */
	int rc = ep__wait_count(g, g->last_dispatch);
	if (rc)
		return rc;
	const uint8_t *sl = ep__ctl_slot(g);
	uint64_t seq = __atomic_load_n((const uint64_t *)(sl +
							  EPP_CTL_RECV_SEQ),
				       __ATOMIC_ACQUIRE);
	if ((uint32_t)seq != (uint32_t)g->last_dispatch)
		return ep__fail(EP_EINVAL,
				"the count of a dispatch is known only until "
				"the next dispatch");
	rc = ep__op_error(g);
	if (rc)
		return rc;
	h->num_recv = (uint32_t)*(const uint64_t *)(sl + EPP_CTL_RECV);
	return 0;
}

_Static_assert(EP_COPIES_MAX == EKC_COPY_MAX, "ep_stream_copies' limit");

int ep_stream_copies(const struct ep_copy *c, unsigned n, void *stream)
{
	unsigned m;
	int rc = ep__copies_check(c, n, &m);
	if (rc || !m)
		return rc;
	struct ekc_copies_args a;
	memset(&a, 0, sizeof(a));
	uint64_t most = 0;
	m = 0;
	for (unsigned i = 0; i < n; i++) {
		if (!c[i].count)
			continue;
		a.p[m++] = (struct ekc_copy_piece){
			.dst = (uint64_t)(uintptr_t)c[i].dst,
			.src = (uint64_t)(uintptr_t)c[i].src,
			.count = c[i].count, .elt = c[i].elt,
			.dstride = c[i].dst_stride ? c[i].dst_stride : 1,
			.sstride = c[i].src_stride ? c[i].src_stride : 1};
		if (c[i].count > most)
			most = c[i].count;
	}
	if ((rc = driver()))
		return rc;
	CUfunction fn = kernel_fn(EP__FN_COPIES);
	if (!fn)
		return ep__fail(EP_EUNSUPPORTED,
				"no CUDA context current on this thread, or "
				"libep's kernels do not load in it");
	/* one element a thread, up to two waves of 256-thread blocks on an
	 * H200's SMs: the copies are small, the launch is what costs */
	uint64_t blocks = (most + 255) / 256;
	if (blocks > 264)
		blocks = 264;
	void *params[] = {&a};
	CUresult r = ep__drv.cuLaunchKernel(fn, (unsigned)blocks, m, 1, 256, 1,
					    1, 0, (CUstream)stream, params,
					    NULL);
	if (r)
		return ep__cufail(r, "launching the copies");
	return 0;
}

const struct ep__gpu_ops ep__gpu = {
	.prepare = cuda_prepare,
	.map = cuda_map,
	.ll_ops = ep__ll_gpu_ops,
	.graph_error = ep__graph_error,
	.leave = ep__llx_leave,
	.unmap = cuda_unmap,
};
