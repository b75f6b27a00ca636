/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend (backend.h), its shared parts. The backend is split by
 * role: device.c (the driver, devices, the backend table, status),
 * region.c (ranks' device regions), barrier.c (the barrier engines),
 * group.c (a group's life: ready, failed, freed, its status), launch.c
 * (one dispatch or combine enqueued), queue.c (ranks' ops in order, the
 * poll that completes them), stage.c (groups across nodes: ops staged
 * through host memory).
 *
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
#ifndef EPD_CUDA_INT_H
#define EPD_CUDA_INT_H

#include "core/core.h"
#include "core/backend.h"
#include "hostbar.h"
#include "util/stall.h"

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
		combine, combine_fetch, combine_lean, gate;
	int smem_optin; /* dynamic shared memory a block may opt into */
	int smem_sm;    /* shared memory of a SM */
	size_t gran;
	int occ_copy, occ_combine, occ_combine_fetch, occ_combine_lean,
		occ_prep; /* resident blocks per SM */
	int l2; /* bytes of L2 */
	uint8_t uuid[16];
	char name[96];
	int sms;
	bool mps;
	bool pools; /* the stream-ordered allocator (cuMemAllocAsync) */
	bool no_pdl; /* the driver refused programmatic dependent launch */
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
	/* the low-latency regions (ll.c), made at the first LL_MAP */
	CUmemGenericAllocationHandle *ll_h; /* [rpn] */
	uint64_t ll_size;                   /* per rank */
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
	CUdeviceptr pe; /* rows per expert, zero between dispatches */
	uint32_t tmax, nblk_max;
	/* Handles: one entry per fresh dispatch (its op number) until every
	 * local rank released it and the stream passed the last op that may
	 * use it; then the entry (and its device tables) is reused. */
	struct route *routes;
	uint32_t nroutes, rcap;
	uint64_t route_bytes; /* device tables, against max_handle_bytes */
	/* dispatch rows by the bulk-copy engine: shared memory per block and
	 * resident blocks per SM (0: the SIMT copy) */
	unsigned tma_smem;
	int occ_tma;
	/* the same when cu_copy_sms caps the copy below the SMs it may use:
	 * cuda_copy_blocks_per_sm (more shared memory asked than used) */
	unsigned tma_smem_cap;
	int occ_tma_cap;
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
	int sms_used[2]; /* SMs the last copy / combine ran on (trace) */
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
	/* registered memory of the ranks (mreg.c) */
	struct cu_mreg *mregs;
	uint32_t nmregs, mreg_cap, mreg_next;
};

/* A rank's registered memory, mapped at va. */
struct cu_mreg {
	uint32_t id, local;
	CUdeviceptr va;
	uint64_t bytes, reserved; /* mapped, and the address range */
	uint64_t *chunk;          /* the mappings' sizes, in order */
	uint64_t last_k; /* the last combine that names it */
	bool dead;       /* deregistered: unmapped once completed >= last_k */
};

/* A GPU handle: the routing of dispatch op `seq`. */
struct route {
	uint64_t seq;  /* the dispatch's op number; 0: a free entry */
	uint32_t tokens[EKC_MAX_LOCAL];
	CUdeviceptr slot, recv; /* device tables (none for a staged group) */
	uint64_t host; /* staged: the host path's handle */
	/* staged: its dispatch's error word (EPP_CTL_OP_ERR_POS, without
	 * EPP_OP_ERR_HANDLE) where it failed alone, else UINT64_MAX */
	uint64_t fail;
	uint64_t held; /* local ranks that have not released it */
	/* Released by all: once the ops up to last_use are on the stream
	 * (and out of the staged path), the entry is free. */
	bool dead;
	uint64_t last_use;
};

extern const struct epd_backend_ops epd_cuda_backend;

/* The backend's state (srv->dev_state), and a group's (g->dev_group). */
static inline struct epd_cuda *cu_state(const struct epd_server *srv)
{
	return srv->dev_state;
}


static inline struct epd_cuda_group *cu_group(const struct epd_group *g)
{
	return g->dev_group;
}

/* Does op o name a handle (a combine, or a cached dispatch)? */
static inline bool cu_op_named(const struct epd_aop *o)
{
	return o->type == EPP_COMBINE ||
	       (o->type == EPP_DISPATCH && (o->flags & EPP_DISPATCH_CACHED));
}

/* Op k is on the stream (fast: the resident kernel runs it): the poll
 * times it from now, the oldest op's clock starting here if none was
 * outstanding. */
static inline void cu_enqueued(struct epd_cuda_group *c, uint64_t k,
			       bool fast)
{
	c->enq_fast[k % MAX_INFLIGHT] = fast;
	c->enq_ns[k % MAX_INFLIGHT] = epd_now_ns();
	if (c->enqueued <= c->completed)
		c->oldest_ns = c->enq_ns[k % MAX_INFLIGHT];
	c->enqueued = k;
}

/* The driver API, loaded at run time (device.c). */
extern struct ekc_driver *cu_drv;

/* Shared between the files of the backend. */
struct ekc_barrier_args cu_barrier_args(struct epd_group *g, uint64_t k, uint32_t release);
int cu_barrier_engine_start(struct epd_group *g, char *err, size_t errlen);
volatile uint64_t *cu_completed_word(struct epd_group *g, uint32_t l);
unsigned cu_copy_sms(const struct epd_cuda_group *c, unsigned sms);
/* The dispatch row copy on sms SMs' worth of blocks: its SMs (as
 * cu_copy_sms), blocks a SM, shared memory a block, bulk copies or SIMT. */
struct cu_copy_form {
	unsigned sms, per_sm, smem;
	bool tma;
};
void cu_copy_form(const struct epd_cuda_group *c, const struct cudev *d,
		  unsigned sms, struct cu_copy_form *f);
int cu_err(CUresult r, const char *what, char *err, size_t errlen);
CUresult cu_enqueue_data(struct epd_group *g, uint64_t k, struct epd_aop *const *ops, const char **what);
CUresult cu_dispatch_reset(struct epd_group *g, struct epd_aop *const *ops);
void cu_enqueue_ready(struct epd_group *g);
int epd_cuda_add_rank(struct epd_group *g, struct epd_member *m, const struct epp_join *j, char *err, size_t errlen);
int epd_cuda_export(struct epd_group *g, uint32_t l, int *fd, uint64_t *size);
void epd_cuda_fini(struct epd_server *srv);
void epd_cuda_group_failed(struct epd_group *g);
void epd_cuda_group_free(struct epd_group *g);
int epd_cuda_group_ready(struct epd_group *g, char *err, size_t errlen);
void *epd_cuda_group_status(struct epd_group *g);
int epd_cuda_init(struct epd_server *srv, char *why, size_t len);
void epd_cuda_op(struct epd_member *m, const struct epd_aop *op);
void epd_cuda_remove_rank(struct epd_group *g, uint32_t l);
void *epd_cuda_status(struct epd_server *srv);
void cu_fastbar_stop(struct epd_cuda_group *c);
int cu_find_dev(struct epd_cuda *cu, const uint8_t uuid[16]);
void cu_free_region(struct epd_cuda_group *c, uint32_t l);
volatile int32_t *cu_group_error_word(struct epd_group *g);
/* handles.c */
struct route *cu_route_find(struct epd_cuda_group *c, uint64_t seq);
/* The host path's handle of GPU handle seq (a staged group), or 0. */
uint64_t cu_route_host(struct epd_cuda_group *c, uint64_t seq);
/* The entry of fresh dispatch k (ops: the ranks' requests, for the token
 * counts; host: a staged group's host handle, or 0 until known); false
 * with the group failed (EP_ELIMIT past max_handle_bytes). */
bool cu_route_make(struct epd_group *g, uint64_t k,
		   struct epd_aop *const *ops, uint64_t host);
bool cu_route_usable(struct epd_group *g, struct epd_member *m, uint64_t h);
int epd_cuda_release(struct epd_group *g, struct epd_member *m, uint64_t h,
		     char *err, size_t errlen);
void cu_routes_free(struct epd_cuda_group *c);
/* group.c: device memory of the group's, from the stream-ordered pool
 * where the device has one: freeing it then never waits for other work on
 * the GPU (cuMemFree of cuMemAlloc's memory may wait for the whole device,
 * and the loop thread must not: group.c, drain). Free with cuMemFree once
 * the group's streams drained. */
CUresult cu_dev_alloc(struct epd_cuda_group *c, CUdeviceptr *p, size_t n);
uint32_t cu_routes_held(const struct epd_cuda_group *c);
uint64_t cu_known_top(const struct epd_cuda_group *c);
CUresult cu_launch(struct epd_cuda_group *c, CUfunction f, unsigned gx, unsigned gy, unsigned bx, void *args);
bool cu_ops_agree(struct epd_group *g, uint64_t k, struct epd_aop *const *ops);
void cu_poll_arm(struct epd_cuda_group *c);
void cu_poll_cb(uv_timer_t *t);
void cu_refresh_completed(struct epd_group *g);
void cu_request_wait(struct epd_group *g);
/* The bytes of a row's fp8 scales that the bulk-copy row copy moves with
 * the row (a multiple of 16), or 0: its lanes store them then. */
static inline uint32_t cu_tma_scale_bytes(const struct epd_group *g)
{
	uint32_t b = g->layout.nscales * 4;
	return b % 16 ? 0 : b;
}
uint8_t *cu_slot(struct epd_group *g, uint32_t l);
void *cu_ctl_pe(struct epd_group *g, uint32_t l);
size_t cu_ctl_pe_bytes(const struct epd_group *g);
unsigned cu_sms_cap(const struct epd_group *g, const struct cudev *d);
void cu_stage_begin(struct epd_group *g, uint64_t k, struct epd_aop *const *ops);
void cu_stage_host(struct epd_group *g);
bool cu_stage_refuse(struct epd_group *g, uint64_t k,
		     struct epd_aop *const *ops, uint64_t fail);
void CUDA_CB cu_stage_wake(void *p);
void cu_trace_read(struct epd_cuda_group *c, int which);
/* mreg.c */
int epd_cuda_mem_reg(struct epd_group *g, uint32_t l, int *fds,
		     const uint64_t *chunk, uint32_t n, uint32_t *id,
		     uint64_t *bytes, char *err, size_t errlen);
int epd_cuda_mem_dereg(struct epd_group *g, uint32_t l, uint32_t id,
		       char *err, size_t errlen);
struct cu_mreg *cu_mreg_find(struct epd_cuda_group *c, uint32_t l,
			     uint32_t id);
void cu_mreg_sweep(struct epd_cuda_group *c);
void cu_mreg_free(struct epd_cuda_group *c, bool drained);
/* ll.c */
int epd_cuda_ll_export(struct epd_group *g, uint32_t l, int *fd,
		       uint64_t *size, char *err, size_t errlen);
void cu_ll_free(struct epd_cuda_group *c, uint32_t rpn);
int cu_use_dev(struct epd_cuda *cu, int i, char *err, size_t errlen);
bool cu_use_prep(const struct epd_group *g, const struct cudev *d);
bool cu_use_tma(const struct epd_cuda_group *c, unsigned sms);
uint64_t cu_widen(uint32_t v, uint64_t ref);

#endif
