/* SPDX-License-Identifier: MIT */
/*
 * ekc: the CUDA side of the kernels interface, shared by epd and libep.
 *
 * The driver is reached through dlopen("libcuda.so.1") and cuGetProcAddress,
 * never linked: one binary runs on machines with and without a GPU. Kernels
 * are compiled ahead of time into a fatbin embedded in the binary and loaded
 * with cuModuleLoadData (no run-time compilation, no CUDA runtime).
 */
#ifndef EKC_H
#define EKC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda.h>

#include "../ek.h"

#ifndef __CUDACC__ /* the host side only (kernels need none of it) */
/* Every driver entry point epd and libep use. */
#define EKC_FUNCS(X)                                                           \
	X(cuInit)                                                              \
	X(cuDriverGetVersion)                                                  \
	X(cuGetErrorString)                                                    \
	X(cuDeviceGetCount)                                                    \
	X(cuDeviceGet)                                                         \
	X(cuDeviceGetName)                                                     \
	X(cuDeviceGetUuid)                                                     \
	X(cuDeviceGetAttribute)                                                \
	X(cuDeviceCanAccessPeer)                                               \
	X(cuDevicePrimaryCtxRetain)                                            \
	X(cuDevicePrimaryCtxRelease)                                           \
	X(cuCtxSetCurrent)                                                     \
	X(cuCtxGetCurrent)                                                     \
	X(cuCtxGetDevice)                                                      \
	X(cuCtxSynchronize)                                                    \
	X(cuMemGetAllocationGranularity)                                       \
	X(cuMemCreate)                                                         \
	X(cuMemRelease)                                                        \
	X(cuMemAddressReserve)                                                 \
	X(cuMemAddressFree)                                                    \
	X(cuMemMap)                                                            \
	X(cuMemUnmap)                                                          \
	X(cuMemSetAccess)                                                      \
	X(cuMemExportToShareableHandle)                                        \
	X(cuMemImportFromShareableHandle)                                      \
	X(cuMemRetainAllocationHandle)                                         \
	X(cuMemGetAddressRange)                                                \
	X(cuMemHostRegister)                                                   \
	X(cuMemHostUnregister)                                                 \
	X(cuMemHostGetDevicePointer)                                           \
	X(cuMemcpyHtoD)                                                        \
	X(cuMemcpyDtoH)                                                        \
	X(cuMemcpyDtoHAsync)                                                   \
	X(cuMemcpyDtoDAsync)                                                   \
	X(cuMemsetD32)                                                         \
	X(cuMemsetD32Async)                                                    \
	X(cuMemsetD8)                                                          \
	X(cuStreamCreate)                                                      \
	X(cuStreamDestroy)                                                     \
	X(cuStreamSynchronize)                                                 \
	X(cuStreamQuery)                                                       \
	X(cuStreamWaitValue32)                                                 \
	X(cuStreamWriteValue32)                                                \
	X(cuEventCreate)                                                       \
	X(cuEventDestroy)                                                      \
	X(cuEventRecord)                                                       \
	X(cuEventSynchronize)                                                  \
	X(cuEventElapsedTime)                                                  \
	X(cuModuleLoadData)                                                    \
	X(cuModuleUnload)                                                      \
	X(cuModuleGetFunction)                                                 \
	X(cuLaunchKernel)                                                      \
	X(cuLaunchCooperativeKernel)                                           \
	X(cuLaunchKernelEx)                                                    \
	X(cuMemAlloc)                                                          \
	X(cuMemAllocAsync)                                                     \
	X(cuMemFree)                                                           \
	X(cuMemcpyHtoDAsync)                                                   \
	X(cuMemcpyDtoD)                                                        \
	X(cuOccupancyMaxActiveBlocksPerMultiprocessor)                         \
	X(cuStreamWaitEvent)                                                   \
	X(cuCtxEnablePeerAccess)                                               \
	X(cuMemHostAlloc)                                                      \
	X(cuMemFreeHost)                                                       \
	X(cuFuncSetAttribute)                                                  \
	X(cuFuncGetAttribute)                                                  \
	X(cuEventQuery)                                                         \
	X(cuLaunchHostFunc)                                                    \
	X(cuStreamIsCapturing)                                                 \
	X(cuStreamBeginCapture)                                                \
	X(cuStreamEndCapture)                                                  \
	X(cuGraphDestroy)                                                      \
	X(cuGraphInstantiateWithFlags)                                         \
	X(cuGraphLaunch)                                                       \
	X(cuGraphExecDestroy)                                                  \
	X(cuUserObjectCreate)                                                  \
	X(cuUserObjectRelease)                                                 \
	X(cuGraphRetainUserObject)

struct ekc_driver {
	void *lib;
	int version;
#define EKC_MEMBER(f) __typeof__(f) *f;
	EKC_FUNCS(EKC_MEMBER)
#undef EKC_MEMBER
	/* the CUDA 12.3 forms (with edge data), asked for by that version */
	__typeof__(cuStreamGetCaptureInfo_v3) *cuStreamGetCaptureInfo3;
	__typeof__(cuGraphNodeGetDependencies_v2) *cuGraphNodeGetDependencies2;
};

/* Load the driver once per process. 0, or -1 with why in err (no library,
 * a missing symbol, cuInit failing: a machine without a usable GPU). */
int ekc_load(struct ekc_driver *d, char *err, size_t errlen);

/* "cuXxx failed: CUDA_ERROR_..." into err; returns EP_EBACKEND. */
int ekc_fail(const struct ekc_driver *d, CUresult r, const char *what,
	     char *err, size_t errlen);

/* n bytes of device memory in the current context written from host
 * memory src, or zeroed if src is NULL (n a multiple of 4), landed when
 * the call returns. cuMemcpyHtoD from pageable memory returns once the
 * bytes are staged, before the copy engine writes them, and cuMemsetD8 is
 * asynchronous to the host, both on the legacy stream, which kernels on
 * non-blocking streams do not wait for: memory unmapped or read by such a
 * kernel right after would race the write (the daemon's unmap of a fresh
 * low-latency region faulted its context, and every MPS client with it).
 * A private non-blocking stream: no other work is waited for. Zeroing may
 * run a kernel (the daemon, which must not wait for SMs other groups hold,
 * copies zeros instead). */
CUresult ekc_write(const struct ekc_driver *d, CUdeviceptr dst,
		   const void *src, size_t n);

#endif

/* Layout of a rank's device region: control words, then the data fields of
 * struct epp_buf at EKC_CTRL_BYTES. Words sit on separate 128-byte lines. */
#define EKC_CTRL_BYTES 4096u
#define EKC_DOORBELL 0u    /* u32: the rank's stream rang op k */
#define EKC_DONE 128u      /* u32: op k finished for this rank */
#define EKC_RAIL_DONE 256u /* u32: phase 1 of barrier k done */
#define EKC_BAR_DOORBELL 384u /* u32: barrier k rung, for the resident
				 barrier kernel (no message to the daemon) */
#define EKC_RECV_COUNT 512u /* u32: rows received by the latest dispatch
			       (EPP_DEV_RECV_COUNT) */

/* Kernel arguments of the barrier: pointers into each local rank's region. */
#define EKC_MAX_LOCAL 64
/* ekc_combine_fetch: the rows fetched into L2 this many column steps (of
 * 512 bytes a row) ahead, 4 steps a fetch */
#define EKC_COMBINE_FETCH 4
/* ekc_combine_lean: each lane's L2 prefetch this many column steps ahead */
#define EKC_COMBINE_LPF 4
struct ekc_barrier_args {
	CUdeviceptr ctrl[EKC_MAX_LOCAL]; /* region base of local rank l */
	uint64_t *completed;             /* host-mapped, [rpn] stride words */
	uint32_t completed_stride;       /* in uint64_t */
	int32_t *error;                  /* host-mapped: set on a timeout */
	uint64_t budget_ns;              /* wait budget of each phase */
	uint32_t rpn;
	uint32_t seq;
	uint32_t nremote;                /* remote rail peers (0: one node) */
	uint32_t release;                /* 0: only wait (before data kernels);
					    1: barrier, then release; 2: only
					    release (after data kernels, which
					    waited for every doorbell) */
	uint32_t *work;  /* the data kernels' work counters, reset to ~0 */
	uint32_t nwork;
	/* host-mapped: nonzero once the daemon released the group (its
	 * waits end at once, writing no error: the group's is set) */
	const volatile uint32_t *released;
};

/* The resident barrier (under MPS): one warp in the daemon's context runs
 * every barrier of a group from its start to its end, fed by the ranks'
 * EKC_BAR_DOORBELL words alone. Its state (struct ek_bar_state, ek.h) is
 * in daemon-private host memory, mapped for the device. */
struct ekc_fastbar_args {
	CUdeviceptr ctrl[EKC_MAX_LOCAL]; /* region base of local rank l */
	uint64_t *completed;             /* host-mapped, as for ekc_barrier */
	uint32_t completed_stride;
	uint32_t rpn;
	struct ek_bar_state *host;         /* device view */
	uint64_t budget_ns;              /* from a barrier's first arrival */
	uint64_t last;                   /* barriers before the kernel */
};

/* A rank's stream under MPS: ring the doorbell, then wait for done with a
 * kernel of one thread (stream memory operations wait in the GPU's front
 * end, which re-polls slowly: ~20 us per barrier measured). The kernel
 * spins for a short budget only (EP_RING_SPIN_US); libep enqueues a stream
 * wait on the same done word behind it, which holds the stream if the op
 * takes longer. A killed rank's kernel thus ends within the budget: MPS
 * tears a dead client's context down only after its kernels end. A group
 * that fails gets its done words written far ahead. */
/* ep_stream_copies: up to EKC_COPY_MAX copies in one launch (grid.y = the
 * piece): count elements of elt bytes (1, 2, 4, 8 or 16), element i from
 * src + i * sstride * elt to dst + i * dstride * elt. */
#define EKC_COPY_MAX 16
struct ekc_copy_piece {
	uint64_t dst, src, count;
	uint32_t elt, dstride, sstride, pad;
};
struct ekc_copies_args {
	struct ekc_copy_piece p[EKC_COPY_MAX];
};

struct ekc_ring_args {
	uint32_t *bell;
	const uint32_t *done;
	uint32_t k;
	uint32_t pad;
	uint64_t budget_ns;
};

/* A stream-ordered op captured into a CUDA graph (libep_graph.c): its
 * number is known only when a replay reaches it, so a host node of the
 * graph writes it into the op's slot (pinned host memory) and this kernel
 * reads it there, rings, spins for done as ekc_ring_wait does, and on
 * success opens the op's gate, on which a stream wait of the graph
 * (a fixed value: gate == 1) holds the rest. skip: the host node could not
 * post the op (its error is the group's): open the gate, ring nothing.
 * budget_ns 0: ring only (no MPS: a spinning kernel would hold the GPU's
 * time slice; libep's watcher opens the gate). */
struct ekc_gslot {
	uint32_t k;    /* op number of the current replay */
	uint32_t skip; /* nonzero: not posted */
	uint32_t gate; /* 1 once op k is done for this rank */
	uint32_t pad[13];
};
struct ekc_post_args {
	const struct ekc_gslot *slot; /* device view of the host slot */
	uint32_t *gate;               /* &slot->gate, the same view */
	uint32_t *bell;
	const uint32_t *done;
	uint64_t budget_ns;
};

/* ekc_copy_tma: warps per block; each warp holds two rows in shared
 * memory. */
#define EKC_TMA_WARPS 4

/* Fields of a rank's region, as in enum epp_buf_field (same order). */
enum {
	EKC_F_X,
	EKC_F_SCALES,
	EKC_F_TOPK,
	EKC_F_WEIGHTS,
	EKC_F_RECV_X,
	EKC_F_RECV_SCALES,
	EKC_F_RECV_TOPK,
	EKC_F_RECV_WEIGHTS,
	EKC_F_RECV_SRC,
	EKC_F_RECV_PE,
	EKC_F_Y,
	EKC_F_BIAS,
	EKC_F_OUT,
	EKC_F_CW,     /* combine_w [R, K] f32 */
	EKC_F_CW_OUT, /* combined_w [T, K] f32 */
	EKC_F_RANK_PREFIX, /* rank_prefix [W, W] i32 */
	EKC_F_BIAS2,       /* combine_bias2 [T, H] bf16 */
	EKC_F_N,
};

/* Control page slot (see proto/epp.h; repeated here for device code). */
#define EKC_CTL_SLOT 256u
#define EKC_CTL_OP_ERR_CODE 12u
#define EKC_CTL_OP_ERR_SEQ 16u
#define EKC_CTL_RECV 24u
#define EKC_CTL_RECV_SEQ 32u
#define EKC_CTL_OP_ERR_POS 40u
#define EKC_CTL_PE 32768u /* i32 per expert, from the page's start */
#define EKC_EEXPERT (-1012) /* EP_EEXPERT */
#define EKC_ETOOBIG (-1010) /* EP_ETOOBIG */
#define EKC_ETIMEDOUT (-110) /* EP_ETIMEDOUT (-ETIMEDOUT) */
/* The op's error word (ekc_disp_args.err) holds the first bad (rank,
 * token, k) of an expert index (EP_EEXPERT), or, with this bit, a rank
 * that asked for more tokens than the group's maximum: (rank << 32) |
 * tokens asked (EP_ETOOBIG; set by the daemon before the kernels). Too
 * many tokens wins over a bad index, as on the host backend: the count
 * then judges no index. */
#define EKC_ERR_TOOBIG (1ull << 63)
/* With this bit (and no position): a kernel's wait for rank l's doorbell
 * ran past the group's timeout, (l); the op changes nothing more and the
 * kernel raised the group's error word (the daemon fails the group). */
#define EKC_ERR_WAIT (1ull << 62)
/* In a combine's or cached dispatch's published op error (EKC_ESTALE):
 * the rest is the error word of the dispatch that made its handle, which
 * failed (EPP_OP_ERR_HANDLE) */
#define EKC_ERR_HANDLE (1ull << 61)
/* With EKC_ERR_TOOBIG: local rank d would receive rows above the group's
 * receive capacity (max_recv): (d << 32) | rows (EP_ETOOBIG). */
#define EKC_ERR_RECV (1ull << 60)
#define EKC_ESTALE (-1009) /* EP_ESTALE */

/* Dispatch and combine arguments. Pointers are device addresses; off[]
 * are offsets from a region's base. */
struct ekc_disp_args {
	CUdeviceptr region[EKC_MAX_LOCAL];
	uint64_t off[EKC_F_N];
	/* recv_x of rank l: its region + rx[l] (the receive area its op
	 * named; off[EKC_F_RECV_X] is not used) */
	uint64_t rx[EKC_MAX_LOCAL];
	/* combine: row r < yrows[l] of rank l's combine_y (dispatch: of x)
	 * is at its region + yo[l] + r * row (its registered memory, mod
	 * 2^64); a later row is the region's field (yrows 0: every row) */
	uint64_t yo[EKC_MAX_LOCAL];
	uint32_t yrows[EKC_MAX_LOCAL];
	/* combine: home token t < orows[l] of rank l goes to its region +
	 * oo[l] + t * row (its registered output, mod 2^64), a later one to
	 * the region's combined field */
	uint64_t oo[EKC_MAX_LOCAL];
	uint32_t orows[EKC_MAX_LOCAL];
	uint32_t tokens[EKC_MAX_LOCAL]; /* T of each rank (the handle's) */
	uint64_t weights_mask;          /* ranks that gave topk_weights */
	uint64_t rank_mask;             /* copy: sources, combine: homes this
					   launch handles (its GPU's ranks) */
	uint64_t bias_mask;             /* combine: ranks that gave a bias */
	uint64_t bias2_mask;            /* and a second one */
	uint64_t order_mask;            /* combine: homes summing in their
					   topk_idx field's slot order */
	uint32_t cw;                    /* combine: sum top-k weights too */
	uint64_t *mask;    /* [W][Tmax] destination bit masks */
	int64_t *topk;     /* [W][Tmax][K] each rank's topk_idx as the count
			      read and checked it (daemon memory: the rank
			      may write its own copy meanwhile) */
	uint32_t *blk;     /* [W][nblk_max][W] block counts */
	uint32_t *base;    /* [W][nblk_max][W] block bases */
	uint32_t *recv;    /* [W] rows received */
	uint32_t *rp;      /* [W][W] the handle's rank prefix matrix (inclusive
			      over sources), copied to every rank's field */
	int32_t *slot;     /* [W][Tmax][W] the handle's routing */
	unsigned long long *err; /* first bad (s, t, k), or ~0 */
	/* the handle's: its dispatch's final error word (~0: none), in its
	 * tables, written by that (fresh) dispatch as it publishes its
	 * counts; a combine or cached dispatch that finds it set changes
	 * nothing and fails alone. NULL: none kept. */
	unsigned long long *rerr;
	uint32_t *gsync;   /* ekc_prep's grid barrier, from ~0 */
	/* gate_reset: ekc_gate sets *err = err0 and *gsync = ~0 before its
	 * waits (a dispatch under MPS; otherwise a memset does) */
	unsigned long long err0;
	uint32_t gate_reset;
	/* ekc_prep lets the row copy be launched at its start (cuda_pdl;
	 * the copy then waits for it on the GPU) */
	uint32_t copy_early;
	/* the op's counts are published by the row copy's block 0 (after
	 * ekc_prep, and for a cached dispatch), not by ekc_scan (the
	 * three-launch prep) */
	uint32_t copy_publishes;
	/* [E] a fresh dispatch's received rows per expert, counted by the
	 * count (a token once per distinct expert), published and cleared
	 * by the scan: zero between dispatches */
	uint32_t *pe;
	uint32_t *work;    /* next item of copy/combine (this GPU's), from ~0 */
	void *host_ctl;    /* control page (device view), slots of 256 B */
	uint32_t W, H, K, E, elt, nscales, Tmax, nblk_max;
	uint32_t max_recv; /* rows a rank may receive (the group's recv_rows) */
	uint32_t seq;
	uint32_t cached;
	uint32_t wait; /* kernels wait for the doorbells themselves (MPS) */
	/* ekc_copy_tma: the bytes of a row's fp8 scales when the bulk-copy
	 * engine moves them (a multiple of 16), else 0 */
	uint32_t tma_sc;
	/* How long such a wait (and ekc_prep's grid barrier) may spin, in
	 * ns: the group's timeout. Past it the kernel writes 1 + the local
	 * rank to group_err (host memory, the poll's word) and gives up. */
	uint64_t budget_ns;
	volatile int32_t *group_err;
	/* host-mapped: nonzero once the daemon released the group (its
	 * CPU's store, on no GPU queue): a wait ends at once, the op
	 * changes nothing more and group_err is left alone */
	const volatile uint32_t *released;
	/* EPD_CUDA_TRACE: [EKC_TR_N][2] globaltimer ns of each stage's first
	 * start and (stored inverted, so both are atomicMin) last end, or
	 * NULL */
	unsigned long long *trace;
	/* EPD_CUDA_TRACE: bit i set by a block of the row copy or the
	 * combine that ran on SM i, or NULL */
	uint32_t *smmask;
};

enum { EKC_TR_DOORBELL, EKC_TR_COUNT, EKC_TR_SCAN, EKC_TR_SLOT, EKC_TR_COPY,
       EKC_TR_COMBINE, EKC_TR_N };
/* The trace buffer: the stages' [EKC_TR_N][2] times, then smmask (8 words:
 * SMs 0-255). */
#define EKC_TR_SMMASK (EKC_TR_N * 16)
#define EKC_TR_BYTES (EKC_TR_SMMASK + 32)

/* The fatbin of the kernels in kernels/cuda, embedded at build time. */
extern const unsigned char ekc_fatbin[];
extern const size_t ekc_fatbin_size;


/*
 * Low-latency (decode) dispatch and combine (ekc_ll.cu): kernels on the
 * rank's own stream that write straight into its peers' public regions,
 * mapped in this process; no daemon in an op's path.
 *
 * Two buffers b (the caller alternates them, as DeepEP's low-latency mode
 * does, so that two micro-batches can be in flight: dispatch A, dispatch
 * B, then A's and B's receive hooks, experts and combines). Each rank's
 * public region holds:
 *   cnt[p]   [W][E] u64   (seq << 32 | rows), source s's rows per expert,
 *                         written by every source into every rank (an
 *                         all-gather of the counts); p = dispatch seq & 1,
 *                         read only inside that dispatch's send part
 *   cflag    [W] u64      dispatch seq: source s's counts are written (a
 *                         receiver spins on W flags, not W*E counts)
 *   done     [W] u64      dispatch seq: source s's rows have landed
 *   cdone    [W] u64      combine seq: source s's combine rows landed
 *   cready   [W] u64      combine seq: source s's cx rows are written
 *   bflag    [W] u64      barrier seq (ekc_ll_barrier): source s came
 *   pset[p]  [W] u64      shrink mode: the ranks source s counted as
 *                         present in dispatch seq (p = seq & 1), written
 *                         before its done flag (below)
 *   tk[b]    [El][W*N] i32  source's t*K+k of each received row
 *   rx[b]    [El][W*N][H] bf16  received rows, per local expert packed in
 *                         source rank order, then source (t, k) order
 *   comb[b]  [N*K][H] bf16  combine rows, by the home's (t, k)
 *   cx[b]    [El][W*N][H] bf16  zero-copy combine input: the experts'
 *                         rows where the homes read them (DeepEP's
 *                         get_next_low_latency_combine_buffer)
 * A flag is a sequence number the kernels advance themselves (private
 * words below), so captured work replays correctly; a wait ends at that
 * number or a later one (a peer may be one op ahead). Why one set of flags
 * and rows per buffer suffice: a source writes a rank's cnt, rx, comb for
 * op n+2 only after that rank posted its counts of n+2, which it does only
 * once its work of op n is done (stream order).
 *
 * The private region (never mapped by a peer): the u32 words EKC_LL_PRIV_*,
 * then per buffer b the tables of its dispatch, snapshotted so that the
 * receive hook and the combine never read cnt (a peer may be rewriting
 * it): key[N*K] i32 and pos[N*K] i32 (each (t, k)'s expert and its place
 * among this rank's rows there), off[E] u32 (where this rank's rows start
 * at each expert) and rows[El][W] u32 (what each source sent here).
 */
#define EKC_LL_MAXW 64
#define EKC_LL_TPB 512 /* threads a block of every low-latency kernel */
#define EKC_LL_MAXE 1024
#define EKC_LL_MAXTK 65536 /* N * K: the plan counts in 16 bits per warp */
#define EKC_LL_PRIV_DSEQ 0
#define EKC_LL_PRIV_CSEQ 1
#define EKC_LL_PRIV_ERR 2
#define EKC_LL_PRIV_DCTR 3
#define EKC_LL_PRIV_CCTR 4
#define EKC_LL_PRIV_BSEQ 5  /* [2]: the dispatch seq of buffer b */
#define EKC_LL_PRIV_CBSEQ 7 /* [2]: the combine seq of buffer b */
#define EKC_LL_PRIV_POISON 9 /* nonzero once a wait failed: for good */
#define EKC_LL_PRIV_BARSEQ 10 /* the last barrier's seq */
#define EKC_LL_PRIV_MASK 16 /* [EKC_LL_MAXW]: 1 = rank masked (shrink) */
#define EKC_LL_PRIV_PSET 80 /* u64 [2] at this word: buffer b's present set */
#define EKC_LL_PRIV_ABN 84 /* u64 at this word: the ranks that gave this
			      one up in the dispatch EKC_LL_PRIV_ABNSEQ */
#define EKC_LL_PRIV_ABNSEQ 86
#define EKC_LL_PRIV_DEC 128 /* u64 [EKC_LL_WAITS][EKC_LL_MAXW] at this word */
#define EKC_LL_PRIV_TABLES 4096u /* bytes */
/* Shrink mode (DeepEP's, a.shrink): a rank masked in this rank's words is
 * neither sent to nor waited for; a peer that does not come to a wait
 * within the timeout, that the daemon says has left (the gone bits), or
 * whose flags carry the poison mark is masked there and then, and the op
 * goes on without it. The blocks of a grid decide each (wait, source)
 * once, by a compare-and-swap on its decision word (seq << 1 | absent),
 * so that every block of the rank uses the same present set. The waits:
 * the dispatch's counts, its done flags, the combine's done and ready
 * flags, the barrier's. */
enum { EKC_LL_W_CNT, EKC_LL_W_DONE, EKC_LL_W_CDONE, EKC_LL_W_CREADY,
       EKC_LL_W_BAR, EKC_LL_WAITS };
/* err bits */
#define EKC_LL_ETIMEDOUT 1u /* a peer's rows or counts never came */
#define EKC_LL_EEXPERT 2u   /* a top-k index outside [-1, E) */
#define EKC_LL_EPEER 4u     /* a peer's counts or (t, k) out of range */
#define EKC_LL_ETOOBIG 8u   /* more than N tokens, or > W*N rows/expert */
#define EKC_LL_ERELEASED 16u /* the daemon released the group (a rank left) */
#define EKC_LL_EPEERFAIL 32u /* a peer's flag carried the poison mark */
#define EKC_LL_EPOISONED 64u /* an earlier failure: the op did nothing */
#define EKC_LL_EMASK 128u /* shrink: a source counted other ranks present
			     than this rank did (rows may be misplaced) */
/* The errors above that poison the rank's state (EKC_LL_PRIV_POISON): its
 * sequence numbers may be out of step with the peers', so every later op
 * does nothing but raise EKC_LL_EPOISONED and put the mark on its flags
 * (every flag's high word: EKC_LL_MARK), and a peer that sees the mark
 * fails and is poisoned too. One failure ends the group's low-latency
 * mode on every rank within one op, never silently. */
#define EKC_LL_EFATAL (EKC_LL_ETIMEDOUT | EKC_LL_ERELEASED | EKC_LL_EPEERFAIL | \
		       EKC_LL_EMASK)
#define EKC_LL_MARK 0x504f4953u /* "POIS" */
/* Shrink mode: a counts flag a rank swapped for this mark gave its source
 * up for that dispatch and those after (until ep_ll_mask unmasks it). */
#define EKC_LL_OUT 0x4f555421u /* "OUT!" */

/* A dispatch with a cast to fp8 (a.fp8): each row's 128-channel groups
 * g scaled so that the largest magnitude amax (at least 1e-4) becomes 448:
 * scale = amax * fl(1/448), the values times fl(448/amax) (each step
 * rounded to fp32, then to e4m3 to nearest even); _ROUND: the scale
 * rounded up to a power of two, the values times its inverse; _UE8M0:
 * rounded, and the scale's exponent byte stored, four groups to an i32.
 * rx[b] then holds [El][W*N][H] e4m3 and after them, at sc[b], the
 * scales column-major: [El][H/128][W*N] f32 or [El][H/512][W*N] i32. */
#define EKC_LL_FP8 1u
#define EKC_LL_FP8_ROUND 2u
#define EKC_LL_FP8_UE8M0 3u

struct ekc_ll_layout {
	uint64_t cnt[2], cflag, done, cdone, cready, bflag, pset[2], flags_end;
	uint64_t tk[2], rx[2], comb[2], cx[2], total;
	uint64_t sc[2]; /* inside rx[b]: a fp8 dispatch's scales (above) */
	uint64_t tab[2]; /* private: buffer b's tables (key, pos, off, rows) */
	uint64_t priv_total;
};

static inline uint64_t ekc_ll_align(uint64_t v)
{
	return (v + 4095) & ~(uint64_t)4095;
}

static inline void ekc_ll_layout_of(uint32_t W, uint32_t N, uint32_t H,
				 uint32_t El, uint32_t K,
				 struct ekc_ll_layout *L)
{
	const uint64_t E = (uint64_t)El * W, WN = (uint64_t)W * N;
	uint64_t o = 0;
	for (int p = 0; p < 2; p++) {
		L->cnt[p] = o;
		o += W * E * 8;
	}
	L->cflag = o;
	o += W * 8;
	L->done = o;
	o += W * 8;
	L->cdone = o;
	o += W * 8;
	L->cready = o;
	o += W * 8;
	L->bflag = o;
	o += W * 8;
	for (int p = 0; p < 2; p++) {
		L->pset[p] = o;
		o += W * 8;
	}
	o = L->flags_end = ekc_ll_align(o);
	for (int p = 0; p < 2; p++) {
		L->tk[p] = o;
		o = ekc_ll_align(o + El * WN * 4);
	}
	for (int p = 0; p < 2; p++) {
		L->rx[p] = o;
		L->sc[p] = o + El * WN * H;
		o = ekc_ll_align(o + El * WN * H * 2);
	}
	for (int p = 0; p < 2; p++) {
		L->comb[p] = o;
		o = ekc_ll_align(o + (uint64_t)N * K * H * 2);
	}
	for (int p = 0; p < 2; p++) {
		L->cx[p] = o;
		o = ekc_ll_align(o + El * WN * H * 2);
	}
	L->total = o;
	o = EKC_LL_PRIV_TABLES;
	for (int p = 0; p < 2; p++) {
		L->tab[p] = o;
		o += (2 * (uint64_t)N * K + 2 * E) * 4;
	}
	L->priv_total = o;
}

/* One low-latency op of one rank. Device addresses throughout. */
struct ekc_ll_args {
	uint64_t peer[EKC_LL_MAXW]; /* each rank's public region, mapped here */
	struct ekc_ll_layout L;
	uint64_t priv;       /* this rank's private words and tables */
	uint64_t x;          /* dispatch: [T, H] bf16 */
	uint64_t topk;       /* [T, K] i64 (dispatch; combine: the same) */
	uint64_t weights;    /* combine: [T, K] f32 */
	uint64_t ex;         /* combine: [El, W*N, H] bf16, the experts' rows */
	uint64_t out;        /* combine: [T, H] bf16 */
	uint64_t recv_count; /* dispatch: [El] i32 */
	uint64_t layout;     /* dispatch: [El, W] i64 (begin << 32 | rows) */
	uint64_t src_info;   /* dispatch: [El, W*N] i32 source token or -1 */
	uint64_t timeout_ns;
	uint64_t released; /* u32 the daemon raises when the group fails
			      (host memory mapped for the GPU), or 0 */
	uint64_t herr;     /* u32 host mirror of the err word's fatal and
			      poisoned bits (the host reads it without a
			      copy; each store carries one, so racing
			      stores never hide the mode's end), or 0 */
	uint32_t rank, W, N, H, El, K, T;
	uint32_t buf;  /* 0 or 1: the buffer of this op (a combine: its
			  dispatch's) */
	uint32_t gpu_scope; /* every rank on this GPU: flags at GPU scope */
	uint32_t fp8;  /* dispatch: EKC_LL_FP8_*, 0 for bf16 rows */
	uint32_t shrink; /* shrink mode (EKC_LL_PRIV_MASK) */
	uint32_t stall_ms; /* fault injection for tests: a dispatch holds its
			      done flags back this long after its rows (a
			      source that fails between counts and rows) */
	uint64_t gone; /* shrink: u64 of the ranks that left the group (host
			  memory the daemon writes before it raises released),
			  or 0 */
	uint64_t trace; /* u64[EKC_LL_TR_N] globaltimer stamps, or 0 */
};

/* The low-latency mode of GPU ranks across nodes (ekc_llx.cu, libep_ll.c):
 * each (token, k) is one pseudo token of a second GPU group of the same
 * ranks (top-1, at most N*K tokens a rank), moved by the daemons' own
 * stream-ordered dispatch and combine, which cross nodes. These kernels,
 * on the rank's stream around those ops, do what the host path
 * (libep_llhost.c) does on the CPU: expand the tokens into pseudo tokens,
 * lay the received rows out per local expert (cast to fp8 on the way),
 * gather the experts' rows back for the combine, and sum each token's
 * rows at home. A pseudo token's weight word carries its place among its
 * source's rows to that expert (the receiver's layout needs no scan), or
 * EKC_LLX_MARK: its source had more than N tokens. */
#define EKC_LLX_MARK 0x7fc0e7b1u
#define EKC_LLX_MAXE 4096 /* experts (the protocol's maximum) */
#define EKC_LLX_TPB 512
enum { EKC_LLX_EEXPERT, EKC_LLX_ETOOBIG, EKC_LLX_NERR };
struct ekc_llx_args {
	uint64_t x, topk;   /* send: [T, H] bf16, [T, K] i64 */
	uint64_t key;       /* [N*K] i32: each (t, k)'s expert, -1 skipped */
	uint64_t sx, stk, sw; /* the pseudo group's send rows [n, H] bf16,
				 top-1 index [n] i64, weight word [n] u32 */
	uint64_t rx, rtk, rw, rsrc; /* its received rows [R, H], local expert
				       [R] i64, weight word [R] u32, source
				       (rank, pseudo token) [R][2] i32 */
	uint64_t nrecv;     /* u32: its latest dispatch's rows (device) */
	uint64_t nrec;      /* u32: this buffer's, kept for the combine */
	uint64_t place;     /* [max_recv] i64: each received row's place
			       (el * W*N + p), or -1 */
	uint64_t out_rx, out_sc; /* [El, W*N, H] bf16 or e4m3; scales */
	uint64_t recv_count, layout, src_info; /* [El] i32, [El, W] i64,
						  [El, W*N] i32 */
	uint64_t ex;        /* combine: the experts' rows [El, W*N, H] */
	uint64_t cy;        /* the pseudo group's combine_y [R, H] */
	uint64_t comb;      /* its combined rows [n, H] */
	uint64_t weights;   /* [T, K] f32 */
	uint64_t out;       /* [T, H] bf16 */
	uint64_t err;       /* u32[EKC_LLX_NERR] host memory mapped for the
			       GPU: 1 once that error was seen */
	uint64_t failed[3]; /* u32 host words (the control page) nonzero once
			       the pseudo group or the group failed, or an
			       op of the pseudo group failed alone; or 0 */
	uint32_t W, N, H, El, K, T, over, fp8, max_recv;
};

/* Stamps of the trace (ns of the GPU's global timer): block 0's passage
 * through each stage, the last block's flags, the latest block start and
 * end (atomicMax; the caller zeroes those two before the op). */
enum { EKC_LL_TR_D_START, EKC_LL_TR_D_PLAN, EKC_LL_TR_D_CNT, EKC_LL_TR_D_COPY,
       EKC_LL_TR_D_FLAGS, EKC_LL_TR_D_RECV, EKC_LL_TR_D_END,
       EKC_LL_TR_D_MAXSTART, EKC_LL_TR_D_MAXEND, EKC_LL_TR_C_START,
       EKC_LL_TR_C_COPY, EKC_LL_TR_C_FLAGS, EKC_LL_TR_C_RECV,
       EKC_LL_TR_C_END, EKC_LL_TR_C_MAXSTART, EKC_LL_TR_C_MAXEND,
       EKC_LL_TR_N };

#endif
