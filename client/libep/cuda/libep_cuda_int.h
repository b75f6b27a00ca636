/* SPDX-License-Identifier: MIT */
/* libep internals shared by libep_cuda.c and libep_graph.c (CUDA builds). */
#ifndef LIBEP_CUDA_INT_H
#define LIBEP_CUDA_INT_H

#include "libep_int.h"
#include "ekc.h"

extern struct ekc_driver ep__drv;
/* EP_EBACKEND with the driver's words for r. */
int ep__cufail(CUresult r, const char *what);
/* Import the allocation behind fd (closed here), map size bytes of it
 * read-write for device dev: *p, *h; on failure nothing is left mapped.
 * access: what a failed cuMemSetAccess means, for the message. */
int ep__cuda_import(int fd, uint64_t size, int dev, const char *access,
		    CUdeviceptr *p, CUmemGenericAllocationHandle *h);
/* The group's features (EPP_FEAT_*), set by the daemon before READY. */
uint32_t ep__features(const ep_group_t *g);
/* May this rank wait for an op with a spinning kernel (the daemon's
 * EPP_FEAT_KERNEL_WAIT, unless EP_NO_KERNEL_WAIT=1)? */
bool ep__kernel_wait(const ep_group_t *g);
/* How long a rank's ring kernel spins (EP_RING_SPIN_US). */
uint64_t ep__ring_spin_ns(void);
/* The op's frame to the daemon: payload, then its number k. */
int ep__send_op(ep_group_t *g, uint16_t type, const uint8_t *payload,
		uint32_t len, uint64_t k);
/* The rank's words of the host barrier (EPP_FEAT_HOST_BARRIER), and the
 * post of barrier k there (waking the daemon's thread if it sleeps). */
uint64_t ep__hb_words(const ep_group_t *g);
void ep__hb_post(ep_group_t *g, uint64_t k);
/* ekc_post_wait in the current context (loaded with the ring kernel when
 * the group was mapped), or NULL. */
CUfunction ep__post_fn(void);
/* A kernel of the module in the current context, or NULL. */
enum { EP__FN_RING, EP__FN_POST, EP__FN_LL_DISPATCH, EP__FN_LL_DISPATCH_RECV,
       EP__FN_LL_COMBINE, EP__FN_LL_COMBINE_RECV, EP__FN_LL_COMBINE_PULL,
       EP__FN_LL_BARRIER, EP__FN_COPIES, EP__FN_LLX_SEND,
       EP__FN_LLX_RECV_COUNT, EP__FN_LLX_RECV_ROWS, EP__FN_LLX_GATHER,
       EP__FN_LLX_SUM, EP__FN_BARRIER_WAIT, EP__FN_N };
CUfunction ep__fn(int which);
/* Make device dev's primary context current. */
int ep__use_ctx(int dev);
/* Device dev's SM count (*sms). */
int ep__sm_count(int dev, int *sms);
/* Whether stream is being captured into a CUDA graph (*yes). */
int ep__stream_capturing(void *stream, bool *yes);
/* n u32 words of pinned host memory, zeroed, mapped for the GPU (*dev):
 * the low-latency kernels' error words the host reads without a copy.
 * EP_EBACKEND naming what. */
int ep__host_words(size_t n, volatile uint32_t **host, CUdeviceptr *dev,
		   const char *what);
/* libep_mreg.c: where len bytes at y lie in mr (EP_ESTALE if not inside
 * it, or not the allocations registered), and the registrations' end (at
 * unmap). */
int ep__mreg_place(const ep_group_t *g, const ep_mreg_t *mr, const void *y,
		   size_t len, uint32_t *id, uint64_t *off);
void ep__mreg_fini(ep_group_t *g);
/* libep_ll.c: the low-latency state's end (at unmap), and a GPU rank's
 * low-latency way for group g (one node: the kernels; across nodes: the
 * daemon's path, libep_llx.c). */
void ep__ll_fini(ep_group_t *g);
const struct ep__ll_ops *ep__ll_gpu_ops(const ep_group_t *g);
/* libep_llx.c: the low-latency mode of GPU ranks across nodes (the
 * entries of such a group's table, libep_ll.c), and its state's end. */
int ep__llx_dispatch(ep_group_t *g, const void *x, const int64_t *topk_idx,
		     uint32_t num_tokens, int fp8, void *stream,
		     struct ep_ll_recv *out);
int ep__llx_dispatch_hook(ep_group_t *g, uint32_t buffer, void *stream);
int ep__llx_combine(ep_group_t *g, uint32_t buffer, const void *expert_out,
		    const float *weights, void *out, unsigned flags,
		    void *stream);
int ep__llx_combine_hook(ep_group_t *g, uint32_t buffer, void *stream);
int ep__llx_combine_buffer(ep_group_t *g, uint32_t buffer, void **rows);
int ep__llx_error(ep_group_t *g);
void ep__llx_fini(ep_group_t *g);
/* its pseudo group left (ep_leave, before the group is) */
void ep__llx_leave(ep_group_t *g);
/* For tests/bench/gpu/bench_ll: the low-latency kernels stamp their stages
 * (EKC_LL_TR_*) into u64[EKC_LL_TR_N] at device address trace (0: off).
 * EP_EINVAL before the group's first low-latency call, else the blocks
 * of its kernels' grid. */
int ep__ll_trace(ep_group_t *g, uint64_t trace);

/* libep_graph.c: the group's graph state (at map), its end (at unmap), and
 * an op captured on stream s: type 0 a barrier of the resident kernel,
 * else EPP_BARRIER, EPP_DISPATCH (flags EP_DISPATCH_* | EP__GFLAG_CACHED
 * with h the cached handle) or EPP_COMBINE (EP_COMBINE_*, h). A captured
 * dispatch's handle in *out. */
int ep__graph_init(ep_group_t *g);
/* 0, or the error of a replayed graph's op that could not be posted */
int ep__graph_error(ep_group_t *g);
void ep__graph_fini(ep_group_t *g);
int ep__graph_capture(ep_group_t *g, uint16_t type, uint32_t tokens,
		      unsigned flags, const ep_handle_t *h, CUstream s,
		      ep_handle_t *out);
/* 0, or EP_EBUSY while records of the group's captured ops live. */
int ep__graph_direct_ok(ep_group_t *g);

#endif
