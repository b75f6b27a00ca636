/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend: the barrier engines (the barrier kernel on the
 * group's stream, the host barrier thread, the opt-in resident kernel) and
 * the control page's words.
 */
#include "cuda_int.h"

uint8_t *cu_slot(struct epd_group *g, uint32_t l)
{
	return g->map + (size_t)l * EPP_CTL_SLOT;
}

/* Local rank l's rows per expert in the control page (1.15). */
size_t cu_ctl_pe_bytes(const struct epd_group *g)
{
	return (size_t)g->shape.num_experts / g->shape.world_size * 4;
}

void *cu_ctl_pe(struct epd_group *g, uint32_t l)
{
	return g->map + EPP_CTL_PE + (size_t)l * cu_ctl_pe_bytes(g);
}

volatile uint64_t *cu_completed_word(struct epd_group *g, uint32_t l)
{
	return (volatile uint64_t *)(cu_slot(g, l) + EPP_CTL_COMPLETED);
}

volatile int32_t *cu_group_error_word(struct epd_group *g)
{
	return (volatile int32_t *)(g->map + EPP_CTL_GROUP_SLOT);
}

  
/* The resident barrier kernel needs MPS on every GPU of the group and
 * for every rank (without it a spinning kernel would hold the GPU's time
 * slice from the ranks' contexts), and is not configured off. */
static bool resident_ok(const struct epd_group *g)
{
	const struct epd_cuda_group *c = g->dev_group;
	const struct epd_cuda *cu = g->srv->dev_state;
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
	struct epd_cuda_group *c = g->dev_group;
	struct cudev *d = &cu_state(g->srv)->dev[c->dev0];
	uint32_t rpn = g->shape.ranks_per_node;
	void *hp = NULL;
	CUdeviceptr hd = 0;
	CUresult r = cu_drv->cuMemHostAlloc(&hp, sizeof(*c->fb),
				       CU_MEMHOSTALLOC_DEVICEMAP |
					       CU_MEMHOSTALLOC_PORTABLE);
	if (r)
		return cu_err(r, "cuMemHostAlloc for the resident barrier",
			      err, errlen);
	memset(hp, 0, sizeof(*c->fb));
	r = cu_drv->cuMemHostGetDevicePointer(&hd, hp, 0);
	if (!r)
		r = cu_drv->cuStreamCreate(&c->fbstream, CU_STREAM_NON_BLOCKING);
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
		r = cu_drv->cuLaunchKernel(d->fastbar, 1, 1, 1, 32, 1, 1, 0,
				      c->fbstream, params, NULL);
	if (r) {
		cu_drv->cuMemFreeHost(hp);
		return cu_err(r, "starting the resident barrier", err, errlen);
	}
	c->fb = hp;
	__atomic_store_n((uint32_t *)(g->map + EPP_CTL_GROUP_SLOT +
				      EPP_CTL_FEATURES),
			 EPP_FEAT_FAST_BARRIER | EPP_FEAT_KERNEL_WAIT,
			 __ATOMIC_RELEASE);
	epd_info("group %s: resident barrier kernel on GPU %d (MPS)",
		 g->shape.name, c->dev0);
	cu_poll_arm(c);
	return 0;
}

/* The host barrier thread (hostbar.h), unless configured off, and the
 * feature bit that tells libep to ring its host doorbell instead of
 * sending barriers. */
static int hostbar_start(struct epd_group *g, char *err, size_t errlen)
{
	struct epd_cuda_group *c = g->dev_group;
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
	cu_poll_arm(c);
	return 0;
}

/* A single-node group's barrier engine: the resident kernel where it can
 * run, else the host thread. Groups across nodes have none (staged). */
int cu_barrier_engine_start(struct epd_group *g, char *err,
				size_t errlen)
{
	if (g->nnodes > 1)
		return 0;
	return resident_ok(g) ? fastbar_start(g, err, errlen)
			      : hostbar_start(g, err, errlen);
}

/* End the barrier engine (group failed or freed): the kernel polls the
 * stop word while idle and while waiting; the thread is woken. */
void cu_fastbar_stop(struct epd_cuda_group *c)
{
	if (c->hb)
		epd_hostbar_stop(c->hb);
	else if (c->fb)
		__atomic_store_n(&c->fb->stop, 1, __ATOMIC_RELEASE);
}

/* The newest op known: enqueued, or released by the resident barrier. */
uint64_t cu_known_top(const struct epd_cuda_group *c)
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
uint64_t cu_widen(uint32_t v, uint64_t ref)
{
	return ref + (uint64_t)(int64_t)(int32_t)(v - (uint32_t)ref);
}

/* Ops every rank saw complete, from the control page. */
void cu_refresh_completed(struct epd_group *g)
{
	struct epd_cuda_group *c = g->dev_group;
	uint64_t ref = cu_known_top(c), done = UINT64_MAX;
	for (uint32_t l = 0; l < g->shape.ranks_per_node; l++) {
		uint64_t v = cu_widen((uint32_t)*cu_completed_word(g, l), ref);
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

/* Arguments of the barrier kernel of op k (the group's ranks, control
 * page, budget, counters); release as in struct ekc_barrier_args. */
struct ekc_barrier_args cu_barrier_args(struct epd_group *g, uint64_t k,
					    uint32_t release)
{
	struct epd_cuda_group *c = g->dev_group;
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
		.nwork = (uint32_t)c->ndevs,
		.released = (const volatile uint32_t *)(uintptr_t)(
			c->ctl_dev + EPP_CTL_GROUP_SLOT + EPP_CTL_RELEASED)};
	for (uint32_t l = 0; l < rpn; l++)
		a.ctrl[l] = c->ptr[l];
	return a;
}
