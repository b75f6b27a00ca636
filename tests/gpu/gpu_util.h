/* SPDX-License-Identifier: MIT */
/* GPU test helpers: the driver (through ekc), a rank's context and stream,
 * shared host memory the GPU can reach, a skip probe. */
#ifndef TG_GPU_UTIL_H
#define TG_GPU_UTIL_H

#include "ekc.h"
#include "harness.h"
#include "ref.h"

#include <string.h>

extern struct ekc_driver tg_drv;

#define CU(call)                                                               \
	do {                                                                   \
		CUresult r_ = (call);                                          \
		if (r_ != CUDA_SUCCESS) {                                      \
			char e_[200];                                          \
			ekc_fail(&tg_drv, r_, #call, e_, sizeof(e_));          \
			TH_CHECK(0, "%s", e_);                                 \
		}                                                              \
	} while (0)

/* In a rank (after fork): driver, primary context of its GPU (GPU 0, or
 * rank % GPUs with EPD_GPU_SPREAD=1; in *gpu), the shared block
 * [p, p+len) registered for the GPU (its device address in *dev), and a
 * non-blocking stream. */
CUstream tg_rank_init(int rank, int *gpu, void *p, size_t len,
		      CUdeviceptr *dev);
/* In the parent: 0 if a GPU is usable (probed in a child, so the parent
 * never initializes CUDA), else TH_SKIP. */
int tg_probe(void);

/* The median of v[0..n) (sorts v). */
double tg_median(double *v, int n);

/* Every one of n rank processes' CPUs at the same point, within a
 * microsecond or so: a sense-reversing line-up on two words of shared
 * memory (epd's own barrier replies to ranks one after another, tens of us
 * apart). */
void tg_line_up(uint32_t *arrive, uint32_t *gen, uint32_t n);

/* A barrier on st once the CUDA graphs of g's ops are destroyed: CUDA
 * lets their records go shortly after the destroys, and until then libep
 * refuses direct ops with EP_EBUSY (retried, 2 s at most). Its return
 * code. */
int tg_barrier_after_graphs(ep_group_t *g, CUstream st);

/* n bytes from host memory to dst, landed when it returns. A plain
 * cuMemcpyHtoD from pageable memory may return once the bytes are staged,
 * before the DMA lands (CUDA's "API synchronization behavior"), and the
 * ranks' work runs on non-blocking streams, which do not wait for the
 * null stream's copy: so the copy, then a wait for the null stream. */
void tg_upload(CUdeviceptr dst, const void *src, size_t n);

/* Small integers as bf16 bits (exact). */
static inline uint16_t tg_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	return (uint16_t)(u >> 16);
}

/* rc keeps the first error of a sequence of calls (each call is made
 * whatever the one before returned, as a replayed graph makes them). */
#define TG_FIRST(rc, call)                                                     \
	do {                                                                   \
		int r_ = (call);                                               \
		if (!(rc))                                                     \
			(rc) = r_;                                             \
	} while (0)

/* A low-latency test's rank: its context and stream (tg_rank_init, in
 * *st), connected to the daemon at sock and joined to group `name` of
 * world ranks as rank r, rpn ranks a node (0: all on one), with the shape
 * given, on its GPU. */
ep_group_t *tg_ll_join(const char *sock, const char *name, uint32_t world,
		       uint32_t rpn, uint32_t r, uint32_t experts,
		       uint32_t hidden, uint32_t topk, uint32_t timeout_ms,
		       CUstream *st, ep_conn_t **conn);

/* Two daemons on the cuda backend, nodes n0 and n1 of a cluster on this
 * host over $EPD_TEST_TRANSPORT (tcp by default; rdma where a device
 * exists), a peer lost after `miss` heartbeats of 100 ms, a shared key in
 * a fresh directory named after tag: started and up in each other's view
 * when it returns. The transport's name. */
const char *tg_cluster2(struct th_daemon d[2], const char *tag, int miss);

/* A random bf16 (bits) for tests that compare bits: mostly normal values
 * of 2^(scale_exp - 2) .. 2^(scale_exp + 2) of either sign, with +0.0,
 * -0.0 and tiny values among them. */
uint16_t tg_bf16_rand(uint64_t *s, int scale_exp);

/* A device address that ep_get_buffers() returned as a pointer. */
static inline CUdeviceptr tg_dptr(const void *p)
{
	return (CUdeviceptr)(uintptr_t)p;
}

#endif
