/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend: a group's life once its ranks joined (ready: streams,
 * the barrier engine, the poll; failed; freed) and its status.
 */
#include "cuda_int.h"

/* The group's GPUs: every local rank's must reach the first's (peer
 * access); c->devs lists them, the first rank's first, and c->dev_mask
 * their ranks. */
static int group_gpus(struct epd_group *g, char *err, size_t errlen)
{
	struct epd_cuda_group *c = g->dev_group;
	struct epd_cuda *cu = g->srv->dev_state;
	uint32_t rpn = g->shape.ranks_per_node;
	if (rpn > EKC_MAX_LOCAL) {
		snprintf(err, errlen, "at most %d GPU ranks per node",
			 EKC_MAX_LOCAL);
		return EP_EUNSUPPORTED;
	}
	c->dev0 = g->local[0]->dev_index;
	for (uint32_t l = 1; l < rpn; l++) {
		int ok = 1, dl = g->local[l]->dev_index;
		if (dl != c->dev0)
			cu_drv->cuDeviceCanAccessPeer(&ok, cu->dev[c->dev0].dev,
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
		int dl = g->local[l]->dev_index, i;
		for (i = 0; i < c->ndevs && c->devs[i] != dl; i++)
			;
		if (i == c->ndevs) {
			c->devs[c->ndevs++] = dl;
			c->dev_mask[i] = 0;
		}
		c->dev_mask[i] |= 1ull << l;
	}
	return 0;
}

/* Between the group's GPUs (more than one): peer access both ways, and
 * on each but the first a stream and an event for its part of a copy. */
static int group_peers(struct epd_group *g, char *err, size_t errlen)
{
	struct epd_cuda_group *c = g->dev_group;
	struct epd_cuda *cu = g->srv->dev_state;
	int rc;
	for (int i = 0; i < c->ndevs && c->ndevs > 1; i++) {
		if ((rc = cu_use_dev(cu, c->devs[i], err, errlen)))
			return rc;
		for (int j = 0; j < c->ndevs; j++) {
			if (j == i)
				continue;
			if ((rc = cu_use_dev(cu, c->devs[j], err, errlen)))
				return rc;
			cu_drv->cuCtxSetCurrent(cu->dev[c->devs[i]].ctx);
			CUresult pr = cu_drv->cuCtxEnablePeerAccess(
				cu->dev[c->devs[j]].ctx, 0);
			if (pr && pr != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
				return cu_err(pr, "cuCtxEnablePeerAccess", err,
					      errlen);
		}
		if (i == 0)
			continue;
		cu_drv->cuCtxSetCurrent(cu->dev[c->devs[i]].ctx);
		CUresult er = cu_drv->cuStreamCreate(&c->dstream[i],
						CU_STREAM_NON_BLOCKING);
		if (!er)
			er = cu_drv->cuEventCreate(&c->ev_out[i],
					      CU_EVENT_DISABLE_TIMING);
		if (er)
			return cu_err(er, "a stream on another GPU", err,
				      errlen);
	}
	return 0;
}

/* On the first GPU: the control page (the whole buffer, the staging
 * area of the copies, across nodes) registered and seen by the device,
 * the group's streams and events. */
static int group_control(struct epd_group *g, char *err, size_t errlen)
{
	struct epd_cuda_group *c = g->dev_group;
	struct epd_cuda *cu = g->srv->dev_state;
	int rc = cu_use_dev(cu, c->dev0, err, errlen);
	if (rc)
		return rc;
	CUresult r = cu_drv->cuEventCreate(&c->ev_in, CU_EVENT_DISABLE_TIMING);
	if (r)
		return cu_err(r, "cuEventCreate", err, errlen);
	/* Across nodes the whole buffer is the staging area of the copies. */
	c->staged = g->nnodes > 1;
	r = cu_drv->cuMemHostRegister(g->map,
				 c->staged ? g->buf_size : EPP_BUF_HEADER,
				 CU_MEMHOSTREGISTER_DEVICEMAP |
					 CU_MEMHOSTREGISTER_PORTABLE);
	if (!r && c->staged)
		r = cu_drv->cuEventCreate(&c->stage_ev, CU_EVENT_DISABLE_TIMING);
	if (r)
		return cu_err(r, "cuMemHostRegister of the control page", err,
			      errlen);
	c->registered = true;
	r = cu_drv->cuMemHostGetDevicePointer(&c->ctl_dev, g->map, 0);
	if (r)
		return cu_err(r, "cuMemHostGetDevicePointer", err, errlen);
	r = cu_drv->cuStreamCreate(&c->stream, CU_STREAM_NON_BLOCKING);
	if (!r)
		r = cu_drv->cuStreamCreate(&c->aux, CU_STREAM_NON_BLOCKING);
	if (r)
		return cu_err(r, "cuStreamCreate", err, errlen);
	return 0;
}

/* Which row copy the group's ops launch: the bulk-copy kernel where its
 * rows fit (and how many blocks a SM, cuda_copy_blocks_per_sm), else the
 * SIMT one. */
static void group_copy_kernel(struct epd_group *g)
{
	struct epd_cuda_group *c = g->dev_group;
	struct epd_cuda *cu = g->srv->dev_state;
	/* Rows of a multiple of 16 bytes, two per warp in shared memory: the
	 * bulk-copy engine moves them. */
	size_t rowb = (size_t)g->shape.hidden * g->layout.elt;
	size_t smem = (size_t)EKC_TMA_WARPS * 2 * (rowb + cu_tma_scale_bytes(g));
	struct cudev *d0 = &cu->dev[c->dev0];
	if (!g->srv->cfg.cuda_no_tma && rowb % 16 == 0 &&
	    smem <= (size_t)d0->smem_optin &&
	    !cu_drv->cuOccupancyMaxActiveBlocksPerMultiprocessor(
		    &c->occ_tma, d0->copy_tma, EKC_TMA_WARPS * 32, smem) &&
	    c->occ_tma > 0)
		c->tma_smem = (unsigned)smem;
	else
		c->occ_tma = 0;
	/* cuda_copy_blocks_per_sm: fewer blocks a SM than fit, by asking
	 * each for more shared memory than it uses (no more than n fit), so
	 * that the scheduler spreads the copy's grid over more SMs whatever
	 * else is resident: a SM's bulk copies are a limit of their own */
	unsigned bps = g->srv->cfg.cuda_copy_bps ? g->srv->cfg.cuda_copy_bps
						  : 1; /* auto */
	c->tma_smem_cap = c->tma_smem;
	c->occ_tma_cap = c->occ_tma;
	if (c->occ_tma > 0 && bps < (unsigned)c->occ_tma &&
	    d0->smem_sm > 0) {
		size_t pad = (size_t)d0->smem_sm / (bps + 1) + 1;
		int occ = 0;
		if (pad > smem && pad <= (size_t)d0->smem_optin &&
		    !cu_drv->cuOccupancyMaxActiveBlocksPerMultiprocessor(
			    &occ, d0->copy_tma, EKC_TMA_WARPS * 32, pad) &&
		    occ == (int)bps) {
			c->tma_smem_cap = (unsigned)pad;
			c->occ_tma_cap = occ;
		} else if (g->srv->cfg.cuda_copy_bps) {
			epd_warn("group %s: cuda_copy_blocks_per_sm=%u cannot "
				 "be had (%d fit); %d a SM",
				 g->shape.name, bps, occ, c->occ_tma);
		}
	}
}

/* The dispatch's scratch on the first GPU (masks, block counts and
 * bases, the error word, per-expert counts; each handle's routing tables
 * are made by its dispatch: handles.c) and the ops' events. */
static int group_scratch(struct epd_group *g, char *err, size_t errlen)
{
	struct epd_cuda_group *c = g->dev_group;
	uint32_t rpn = g->shape.ranks_per_node;
	CUresult r;
	c->tmax = g->shape.max_tokens ? g->shape.max_tokens : 1;
	c->nblk_max = (c->tmax + 255) / 256;
	size_t W = rpn;
	r = cu_dev_alloc(c, &c->mask, W * c->tmax * 8);
	if (!r)
		r = cu_dev_alloc(c, &c->topk, W * c->tmax * g->shape.topk * 8);
	if (!r)
		r = cu_dev_alloc(c, &c->blk, W * c->nblk_max * W * 4);
	if (!r)
		r = cu_dev_alloc(c, &c->base, W * c->nblk_max * W * 4);
	if (!r)
		r = cu_dev_alloc(c, &c->err, 16); /* + ekc_prep's grid barrier */
	if (!r)
		r = cu_dev_alloc(c, &c->work, MAX_DEV * 4);
	if (!r) { /* a copy, not a memset kernel (region.c says why) */
		uint32_t ones[MAX_DEV];
		memset(ones, 0xff, sizeof(ones));
		r = ekc_write(cu_drv, c->work, ones, sizeof(ones));
	}
	if (!r)
		r = cu_dev_alloc(c, &c->pe, (size_t)g->shape.num_experts * 4);
	if (!r) {
		static const uint32_t zeros[EPP_CTL_PE_MAX / 4];
		r = ekc_write(cu_drv, c->pe, zeros, (size_t)g->shape.num_experts * 4);
	}
	if (!r && getenv("EPD_CUDA_TRACE")) {
		r = cu_dev_alloc(c, &c->trace, EKC_TR_BYTES);
		for (int i = 0; !r && i < 2; i++)
			r = cu_drv->cuMemHostAlloc((void **)&c->trace_host[i],
					      EKC_TR_BYTES, 0);
	}
	if (r)
		return cu_err(r, "allocating the dispatch scratch", err,
			      errlen);
	for (int i = 0; !r && i < 4; i++)
		r = cu_drv->cuEventCreate(&c->ev[i / 2][i % 2], CU_EVENT_DEFAULT);
	if (r)
		return cu_err(r, "cuEventCreate", err, errlen);
	return 0;
}

int epd_cuda_group_ready(struct epd_group *g, char *err, size_t errlen)
{
	epd_stall_mark("making a group's GPU state", g->shape.name);
	int rc = group_gpus(g, err, errlen);
	if (!rc)
		rc = group_peers(g, err, errlen);
	if (!rc)
		rc = group_control(g, err, errlen);
	if (rc)
		return rc;
	group_copy_kernel(g);
	rc = group_scratch(g, err, errlen);
	return rc ? rc : cu_barrier_engine_start(g, err, errlen);
}

void cu_poll_arm(struct epd_cuda_group *c)
{
	if (!c->poll_closing &&
	    (c->poll_slow || !uv_is_active((uv_handle_t *)&c->poll))) {
		uv_timer_start(&c->poll, cu_poll_cb, POLL_MS, POLL_MS);
		c->poll_slow = false;
	}
}

CUresult cu_dev_alloc(struct epd_cuda_group *c, CUdeviceptr *p, size_t n)
{
	*p = 0;
	/* the default pool's memory is not mapped for peer GPUs (that takes
	 * cuMemPoolSetAccess, for every user of the pool): a group over
	 * several GPUs keeps cuMemAlloc */
	if (!cu_state(c->g->srv)->dev[c->dev0].pools || c->ndevs > 1)
		return cu_drv->cuMemAlloc(p, n);
	/* on the aux stream, which holds at most release writes: usable on
	 * every stream once it is synchronised */
	CUresult r = cu_drv->cuMemAllocAsync(p, n, c->aux);
	if (!r)
		r = cu_drv->cuStreamSynchronize(c->aux);
	return r;
}

void epd_cuda_group_failed(struct epd_group *g)
{
	epd_stall_mark("releasing a failed group's streams", g->shape.name);
	struct epd_cuda_group *c = g->dev_group;
	if (!c || c->released)
		return;
	c->released = true;
	uint32_t rpn = g->shape.ranks_per_node;
	/* The error, for every rank's next call. */
	for (uint32_t l = 0; l < rpn; l++) {
		uint8_t *s = cu_slot(g, l);
		size_t n = strnlen(g->last_error, EPP_CTL_MSG_MAX - 1);
		memcpy(s + EPP_CTL_ERR_MSG, g->last_error, n); /* cut */
		s[EPP_CTL_ERR_MSG + n] = 0;
		__atomic_store_n((int32_t *)(s + EPP_CTL_ERR_CODE),
				 g->fail_code, __ATOMIC_RELEASE);
	}
	cu_fastbar_stop(c);
	if (c->fb) {
		char words[256];
		size_t n = 0;
		for (uint32_t l = 0; l < rpn && n < sizeof(words) - 24; l++)
			n += (size_t)snprintf(words + n, sizeof(words) - n,
					      " %llu",
					      (unsigned long long)*cu_completed_word(g, l));
		epd_info("group %s: the %s released %llu barriers, the "
			 "last %llu; completed words:%s",
			 g->shape.name,
			 c->hb ? "host barrier" : "resident barrier",
			 (unsigned long long)c->fb->count,
			 (unsigned long long)c->fb->last, words);
	}
	/* The group's kernels that wait for a doorbell (or a grid barrier)
	 * stop now: a store of this CPU's, seen by their next poll. The
	 * stream writes below may queue behind such a kernel (streams share
	 * the GPU's hardware queues), which would otherwise spin the whole
	 * group timeout for a rank that is gone and hold every stream
	 * behind it (found by the MPS kill storm: survivors released 20 s
	 * late, and once the whole GPU standing still). */
	__atomic_store_n((uint32_t *)(g->map + EPP_CTL_GROUP_SLOT +
				      EPP_CTL_RELEASED),
			 1u, __ATOMIC_RELEASE);
	/* Release: every doorbell and done word far ahead of any op a rank
	 * could have queued, from the aux stream. Not the resident barrier's
	 * doorbells: it would take a far value for a barrier every rank rang
	 * and write it as completed (it is told to stop instead). The host
	 * barrier's done words are raised here (and never lowered). */
	uint64_t top = cu_known_top(c);
	for (uint32_t l = 0; l < rpn; l++)
		if (g->local[l] && g->local[l]->async_seq > top)
			top = g->local[l]->async_seq;
	uint32_t far = (uint32_t)(top + MAX_INFLIGHT + (1u << 30));
	if (c->hb)
		epd_hostbar_release(g->map, rpn, far);
	if (!c->stream)
		return;
	char err[160];
	if (cu_use_dev(g->srv->dev_state, c->dev0, err, sizeof(err)))
		return;
	for (uint32_t l = 0; l < rpn; l++) {
		if (!c->ptr[l])
			continue;
		cu_drv->cuStreamWriteValue32(c->aux, c->ptr[l] + EKC_DOORBELL, far,
					0);
		cu_drv->cuStreamWriteValue32(c->aux, c->ptr[l] + EKC_DONE, far, 0);
	}
	epd_notice("group %s: released every rank's stream after: %s",
		   g->shape.name, g->last_error);
}

static void poll_closed(uv_handle_t *h)
{
	free(h->data);
}

/* Wait for a released group's stream until end (one deadline, DRAIN_MS
 * from the start of the free, for all its streams). The loop thread
 * must not block without bound on the GPU: work of other groups may hold
 * the SMs this stream needs until the loop serves them (a rank's exit, a
 * release). False: it did not drain (or the context is gone). */
#define DRAIN_MS 2000
static bool drain(CUstream s, uint64_t end, const char *group,
		  const char *which)
{
	for (unsigned us = 20;; us = us < 2000 ? us * 2 : us) {
		CUresult q = cu_drv->cuStreamQuery(s);
		if (q == CUDA_SUCCESS)
			return true;
		if (q != CUDA_ERROR_NOT_READY) {
			const char *e = NULL;
			cu_drv->cuGetErrorString(q, &e);
			epd_err("group %s: its %s stream: %s", group, which,
				e ? e : "unknown error");
			return false;
		}
		if (epd_now_ns() > end) {
			epd_err("group %s: its %s stream has not finished %u ms "
				"after the group was released", group, which,
				DRAIN_MS);
			return false;
		}
		struct timespec ts = {0, (long)us * 1000};
		nanosleep(&ts, NULL);
	}
}

void epd_cuda_group_free(struct epd_group *g)
{
	epd_stall_mark("freeing a group's GPU state", g->shape.name);
	struct epd_cuda_group *c = g->dev_group;
	if (!c)
		return;
	char err[160];
	/* Every stream of the group drained: its memory may go. If not, the
	 * device memory stays allocated and the control page registered
	 * (leaked, said in the log) rather than freed under work in flight. */
	bool drained = true;
	const char *name = g->shape.name;
	const uint64_t end = epd_now_ns() + DRAIN_MS * 1000000ull;
	if (g->srv->dev_state && c->dev0 >= 0 &&
	    !cu_use_dev(g->srv->dev_state, c->dev0, err, sizeof(err))) {
		if (c->stream) {
			/* released: the stream drains at once */
			if (!c->released && c->enqueued > c->completed)
				epd_cuda_group_failed(g);
			cu_fastbar_stop(c);
			if (c->fbstream) {
				drained &= drain(c->fbstream, end, name, "barrier");
				cu_drv->cuStreamDestroy(c->fbstream);
			}
			drained &= drain(c->aux, end, name, "release");
			drained &= drain(c->stream, end, name, "op");
			/* destroyed with work in it, a stream goes when the
			 * work is done */
			cu_drv->cuStreamDestroy(c->stream);
			cu_drv->cuStreamDestroy(c->aux);
		}
		for (int i = 1; i < c->ndevs; i++) {
			if (!c->dstream[i])
				continue;
			cu_drv->cuCtxSetCurrent(cu_state(g->srv)->dev[c->devs[i]].ctx);
			drained &= drain(c->dstream[i], end, name, "peer GPU's");
		}
		cu_drv->cuCtxSetCurrent(cu_state(g->srv)->dev[c->dev0].ctx);
		if (!drained)
			epd_err("group %s: its GPU memory (%zu MiB per rank and "
				"the scratch) is left allocated: work still "
				"running may write it",
				name, c->size >> 20);
		if (c->registered && drained)
			cu_drv->cuMemHostUnregister(g->map);
		else if (c->registered) {
			/* the control page stays registered, so it stays
			 * mapped too: unmapped, its addresses would come back
			 * in a later mmap that the driver refuses to register
			 * ("already mapped") */
			g->map = NULL;
		}
		if (c->fb && !c->hb && drained)
			cu_drv->cuMemFreeHost(c->fb);
	}
	/* the host barrier thread reads the control page: gone before it */
	epd_hostbar_free(c->hb);
	c->hb = NULL;
	c->fb = NULL;
	for (int i = 0; i < 4; i++)
		if (c->ev[i / 2][i % 2])
			cu_drv->cuEventDestroy(c->ev[i / 2][i % 2]);
	if (c->ev_in)
		cu_drv->cuEventDestroy(c->ev_in);
	if (c->stage_ev)
		cu_drv->cuEventDestroy(c->stage_ev);
	for (int i = 1; i < c->ndevs; i++) {
		if (!c->dstream[i])
			continue;
		cu_drv->cuCtxSetCurrent(cu_state(g->srv)->dev[c->devs[i]].ctx);
		cu_drv->cuStreamDestroy(c->dstream[i]);
		cu_drv->cuEventDestroy(c->ev_out[i]);
	}
	if (c->dev0 >= 0 && g->srv->dev_state)
		cu_drv->cuCtxSetCurrent(cu_state(g->srv)->dev[c->dev0].ctx);
	if (drained) {
		CUdeviceptr scratch[] = {c->mask, c->topk, c->blk, c->base,
					 c->err,  c->work, c->trace, c->pe};
		for (int i = 0; i < 2; i++)
			if (c->trace_host[i])
				cu_drv->cuMemFreeHost(c->trace_host[i]);
		for (size_t i = 0; i < sizeof(scratch) / sizeof(scratch[0]); i++)
			if (scratch[i])
				cu_drv->cuMemFree(scratch[i]);
		cu_routes_free(c);
		for (uint32_t l = 0; l < g->shape.ranks_per_node; l++)
			cu_free_region(c, l);
	} else {
		free(c->routes);
	}
	cu_mreg_free(c, drained);
	/* no mapping of the daemon's: the ranks' mappings keep the memory
	 * until they unmap it */
	cu_ll_free(c, g->shape.ranks_per_node);
	free(c->h);
	free(c->ptr);
	g->dev_group = NULL;
	c->poll_closing = true;
	uv_close((uv_handle_t *)&c->poll, poll_closed);
}

void *epd_cuda_group_status(struct epd_group *g)
{
	struct epd_cuda_group *c = g->dev_group;
	if (!c)
		return NULL;
	unsigned sms = cu_sms_cap(g, &cu_state(g->srv)->dev[c->dev0]);
	/* the barrier engine's own time per barrier (last arrival seen to
	 * release), in us */
	double eng_us = 0;
	if (c->fb) {
		uint64_t n = __atomic_load_n(&c->fb->count, __ATOMIC_ACQUIRE);
		uint64_t b = __atomic_load_n(&c->fb->busy_ns, __ATOMIC_RELAXED);
		eng_us = n ? (double)b / (double)n / 1e3 : 0;
	}
	const struct cudev *d0 = &cu_state(g->srv)->dev[c->dev0];
	struct cu_copy_form cf;
	cu_copy_form(c, d0, sms, &cf);
	json_t *o = json_pack("{s:i, s:i, s:b, s:b, s:s, s:f, s:s, s:i, s:i, s:s, s:b, s:I, s:I, s:I, s:I, s:f, s:f}",
			 "gpu", c->dev0, "gpus", c->ndevs, "staged", c->staged,
			 "resident_barrier", c->fb && !c->hb, "barrier",
			 c->hb	   ? "host"
			 : c->fb ? "kernel"
				 : "stream",
			 "barrier_engine_us", eng_us, "row_copy", cf.tma ? "tma" : "simt",
			 "row_copy_sms", (int)cf.sms,
			 "row_copy_blocks_per_sm", (int)cf.per_sm,
			 "dispatch_prep",
			 cu_use_prep(g, d0) ? "fused" : "split",
			 "pdl", !g->srv->cfg.cuda_no_pdl && !d0->no_pdl,
			 "ops_enqueued", (json_int_t)c->enqueued,
			 "ops_completed", (json_int_t)c->completed,
			 "device_handles", (json_int_t)cu_routes_held(c),
			 "device_handle_bytes", (json_int_t)c->route_bytes,
			 "last_dispatch_us", c->last_us[0], "last_combine_us",
			 c->last_us[1]);
	if (o) { /* the ranks' registered memory (mreg.c) */
		uint64_t rb = 0;
		uint32_t live = 0;
		for (uint32_t i = 0; i < c->nmregs; i++) {
			rb += c->mregs[i].bytes;
			live += !c->mregs[i].dead;
		}
		json_object_set_new(o, "registered",
				    json_pack("{s:i, s:i, s:I}", "live",
					      (int)live, "mapped",
					      (int)c->nmregs, "bytes",
					      (json_int_t)rb));
	}
	if (o) /* the low-latency regions (ll.c), 0 until the first use */
		json_object_set_new(o, "ll_region_bytes",
				    json_integer((json_int_t)c->ll_size));
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
			/* the SMs its row copy or combine ran on */
			json_object_set_new(st, "sms", json_integer(c->sms_used[w]));
			json_object_set_new(tr, w ? "combine" : "dispatch", st);
		}
		json_object_set_new(o, "trace_us", tr);
	}
	return o;
}
