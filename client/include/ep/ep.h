/* SPDX-License-Identifier: MIT */
/*
 * libep: the client library of epd, the expert-parallel communication daemon.
 *
 * A rank (one process per GPU, usually) connects to its node's epd, joins a
 * group, and runs collective operations on it. The daemon owns the
 * communication buffers; the client maps them.
 *
 * Errors: every function that can fail returns 0 or a negative code below
 * (negative errno values, or private codes at -1000 and lower). ep_strerror()
 * names a code; ep_errmsg() gives the calling thread's most recent detailed
 * message (for example which ranks never arrived at a barrier).
 *
 * Threads: calls on one ep_conn_t (and its groups) are serialized by a mutex
 * inside the handle, so a connection may be shared between threads, but a
 * thread blocked in a collective holds the connection until it returns. Use
 * one connection per thread for concurrent collectives.
 */
#ifndef EP_EP_H
#define EP_EP_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EP_VERSION_MAJOR 0
#define EP_VERSION_MINOR 1

/*
 * The ABI this header describes: N of the library's soname, libep.so.N.
 * It changes whenever a function goes or changes its parameters, or a
 * struct the caller allocates (ep_group_config, ep_dispatch_in, ...)
 * changes its layout; the library then has a new soname, and a program
 * built against this header keeps loading the library it was built for.
 * Two structs may grow within one ABI, by fields appended at their end:
 * ep_join_opts (its size field) and ep_buffers (ep_get_buffers passes
 * sizeof the caller's struct). A binding that does not compile this
 * header (ctypes, say) checks ep_abi_version() before it calls anything
 * else.
 */
#define EP_ABI_VERSION 1

/* The ABI of the loaded library (EP_ABI_VERSION where it was built). */
unsigned ep_abi_version(void);

/* Error codes. Values from errno are negated; private ones start at -1000. */
enum {
	EP_OK = 0,
	EP_EINVAL = -EINVAL,            /* an argument is out of range */
	EP_ENOMEM = -ENOMEM,            /* out of memory */
	EP_ETIMEDOUT = -ETIMEDOUT,      /* a collective did not complete in time */
	EP_ECONNREFUSED = -ECONNREFUSED,/* no daemon listens on the socket */
	EP_ENOENT = -ENOENT,            /* the socket path does not exist */
	EP_EACCES = -EACCES,            /* the daemon refused this user */
	EP_EBUSY = -EBUSY,              /* an operation is already in flight */
	EP_EPROTO = -EPROTO,            /* a malformed frame */
	EP_ECONNRESET = -ECONNRESET,    /* the daemon closed the connection */
	EP_EPEERLOST = -1001,           /* a rank of the group left or died */
	EP_EVERSION = -1002,            /* protocol major versions differ */
	EP_EMISMATCH = -1003,           /* JOIN contradicts the existing group */
	EP_ENOTREADY = -1004,           /* not every rank of the group joined yet */
	EP_EDUPRANK = -1005,            /* that rank of the group is taken */
	EP_ESHUTDOWN = -1006,           /* the daemon is shutting down */
	EP_ENOGROUP = -1007,            /* no such group on this connection */
	EP_EFAILED = -1008,             /* the group failed earlier; rejoin */
	EP_ESTALE = -1009,              /* a handle from another group or epoch */
	EP_ETOOBIG = -1010,             /* exceeds what the group was sized for */
	EP_ESHAPE = -1011,              /* hidden, dtype or top-k do not match */
	EP_EEXPERT = -1012,             /* an expert index is out of range */
	EP_EUNSUPPORTED = -1013,        /* not supported by this daemon/backend */
	EP_EBACKEND = -1014,            /* the backend failed (device error) */
	EP_ELIMIT = -1015,              /* a per-user or daemon-wide limit of
					   the daemon's configuration */
};

/* Name of an error code; never NULL. */
const char *ep_strerror(int code);

/* The calling thread's most recent detailed error message, or "". */
const char *ep_errmsg(void);

typedef enum {
	EP_DTYPE_BF16 = 1, /* bfloat16, raw 16-bit storage */
	EP_DTYPE_FP8 = 2,  /* fp8 e4m3 with fp32 scales per 128 channels */
} ep_dtype_t;

typedef struct ep_conn ep_conn_t;
typedef struct ep_group ep_group_t;

/* Connect to the daemon. path NULL: $EPD_SOCKET, else /run/epd/epd.sock. */
int ep_connect(const char *path, ep_conn_t **out);

/* Close the connection: leaves every group still joined on it. */
void ep_close(ep_conn_t *conn);

/* The name of the node whose daemon this connection reaches (its
 * `node_name`); "" from a daemon older than protocol 1.21. A job's
 * rendezvous gathers these to name its groups' nodes (ep_join_nodes). */
const char *ep_conn_node(const ep_conn_t *conn);

#define EP_NODE_NAME_MAX 63

#define EP_GROUP_NAME_MAX 63

struct ep_group_config {
	const char *name;            /* [A-Za-z0-9_.:-], 1..63 characters */
	uint32_t world_size;         /* ranks in the group, all nodes */
	uint32_t ranks_per_node;     /* ranks on each node */
	uint32_t rank;               /* this rank, node_index*rpn + local */
	/* The MoE shape the group's buffers are sized for. */
	uint32_t num_experts;        /* multiple of world_size */
	uint32_t hidden;             /* multiple of 128 */
	uint32_t max_tokens_per_rank;
	uint32_t topk;               /* 1..32 */
	ep_dtype_t dtype;
	uint32_t timeout_ms;         /* collective timeout; 0: daemon default */
	int cuda_device;             /* with EP_JOIN_CUDA: the rank's GPU */
};

#define EP_JOIN_NOWAIT 0x1u /* return before every local rank joined */
#define EP_JOIN_CUDA 0x2u   /* a GPU rank on cfg->cuda_device: the daemon
			       keeps its buffers in that GPU's memory */
/* Receive areas: recv_x as n areas of [max_recv, hidden] (2..16; every
 * rank of the group alike, else EP_EMISMATCH; one-node groups only, else
 * EP_EUNSUPPORTED). Each dispatch names the area its received rows go to
 * (EP_DISPATCH_AREA), so that a rank can keep one dispatch's rows while
 * later ones arrive elsewhere (ep_recv_area gives each area's address). */
#define EP_JOIN_RECV_AREAS(n) (((unsigned)(n) & 0xffu) << 8)
#define EP_RECV_AREAS_MAX 16u

/* Join (or create) a group. Blocks until every rank of this node joined
 * (or the timeout passed) unless flags has EP_JOIN_NOWAIT. */
int ep_join(ep_conn_t *conn, const struct ep_group_config *cfg,
	    unsigned flags, ep_group_t **out);

/* Join a group that names its nodes: nodes[i] is the name of the daemon
 * (ep_conn_node) that serves the ranks i*ranks_per_node ..
 * (i+1)*ranks_per_node-1, for world_size / ranks_per_node nodes. The job
 * chooses: any nodes of the cluster, in any order, and every rank of the
 * group passes the same list (else EP_EMISMATCH). nodes NULL is ep_join:
 * node i is then the i-th entry of every daemon's `peers`. An entry may
 * also be name@host:port, an address daemons with peer_lookup = job dial
 * (epd.conf(5)); with peer_lookup = dns a name outside peers is found by
 * DNS. A name the daemon does not know and cannot learn is EP_EINVAL;
 * this rank's node other than this daemon, EP_EMISMATCH. */
int ep_join_nodes(ep_conn_t *conn, const struct ep_group_config *cfg,
		  const char *const *nodes, unsigned flags, ep_group_t **out);

/* More of a join, for ep_join_ex. The caller sets size to
 * sizeof(struct ep_join_opts) as it was compiled: the library reads no
 * field past it (taken as 0), so the struct can grow. */
struct ep_join_opts {
	size_t size;
	/* the group's nodes, as ep_join_nodes; NULL: node i is the i-th
	 * entry of peers */
	const char *const *nodes;
	/* The rows a rank of the group may receive (the receive fields'
	 * size, every rank alike, else EP_EMISMATCH): 1 ..
	 * world_size * max_tokens_per_rank; 0: that product, the worst
	 * case (every token of every rank to one rank), which grows with
	 * the world. A dispatch that would give a rank more fails on every
	 * rank alike with EP_ETOOBIG naming the rank and the rows, and
	 * changes nothing (DeepEP's num_worst_tokens plays this role). */
	uint32_t recv_rows;
	/* The job's secret (1..256 bytes, NULL: none), which the job's
	 * rendezvous hands every rank: a group joined with a secret is the
	 * job's own. A join with another secret, or none, makes or finds
	 * another group of that name, never this one (no squatting, no
	 * joining a missing rank of it), and the daemon's status shows its
	 * details to its members only. */
	const void *secret;
	size_t secret_len;
};

/* ep_join with opts (NULL: as ep_join). */
int ep_join_ex(ep_conn_t *conn, const struct ep_group_config *cfg,
	       const struct ep_join_opts *opts, unsigned flags,
	       ep_group_t **out);

/* Leave the group and free the handle. The other ranks' pending and later
 * operations on the group fail with EP_EPEERLOST. */
int ep_leave(ep_group_t *group);

/* Global barrier: no rank returns before every rank of the group entered.
 * Two sequential phases: the scale-out rail, then the node. */
int ep_barrier(ep_group_t *group);

/*
 * Dispatch and combine (DeepEP normal-mode semantics, deterministic).
 *
 * Expert e lives on rank e / (num_experts / world). Dispatch sends each token
 * once to every rank hosting one of its top-k experts; a rank receives rows
 * ordered by source rank, then source token. recv_topk_idx holds local
 * expert indices (-1 where the expert lives elsewhere); recv_topk_weights
 * are masked the same way (0.0), or all 0.0 without topk_weights. Combine
 * returns, for each token, bias + the rows of every rank it went to, summed
 * in fp32 in ascending rank order and rounded once to bf16 (nearest even);
 * zeros (plus bias) for tokens sent nowhere.
 */

/* A dispatch's routing, for combine and cached dispatch. A plain value:
 * copy it freely. The daemon keeps a handle's routing until every local
 * rank of the group released it (ep_handle_release) or the group ends;
 * nothing is evicted. The routings held count against the daemon's
 * max_handle_bytes: a dispatch past it fails the group with EP_ELIMIT,
 * saying what is held. A handle the rank released gets EP_ESTALE. */
typedef struct ep_handle {
	uint64_t group_id;
	uint64_t seq;
	uint32_t epoch;
	uint32_t num_tokens; /* this rank's tokens in that dispatch */
	uint32_t num_recv;   /* rows this rank received */
} ep_handle_t;

/* Zero-copy views of this rank's part of the group buffer. The send side
 * and combine inputs are written by the rank; the rest is written by the
 * daemon during an operation and read by the rank afterwards. */
struct ep_buffers {
	void *x;              /* [max_tokens, hidden] bf16 or fp8 */
	float *x_scales;      /* [max_tokens, hidden/128] (fp8 only) */
	int64_t *topk_idx;    /* [max_tokens, topk] */
	float *topk_weights;  /* [max_tokens, topk] */
	const void *recv_x;   /* [max_recv, hidden] */
	const float *recv_x_scales;
	const int64_t *recv_topk_idx;
	const float *recv_topk_weights;
	const int32_t *recv_src; /* [max_recv, 2]: source rank, source token */
	const int32_t *num_recv_tokens_per_expert; /* [num_experts / world] */
	uint16_t *combine_y;     /* [max_recv, hidden] bf16 */
	uint16_t *combine_bias;  /* [max_tokens, hidden] bf16 */
	const uint16_t *combined; /* [max_tokens, hidden] bf16 */
	uint32_t max_tokens;
	uint64_t max_recv;
	/* combine with EP_COMBINE_WEIGHTS */
	float *combine_topk_weights;        /* [max_recv, topk] f32 */
	const float *combined_topk_weights; /* [max_tokens, topk] f32 */
	/* after each dispatch: [world, world] i32, entry [s][d] the rows rank
	 * d received from ranks 0..s (DeepEP's rank_prefix_matrix) */
	const int32_t *rank_prefix_matrix;
	uint16_t *combine_bias2; /* [max_tokens, hidden] bf16 */
};

/* Fill *out (size bytes of it: sizeof the caller's struct ep_buffers,
 * at least the ABI's first size; fields past size are not written).
 * ep_get_buffers passes the size for you. */
int ep_get_buffers_sized(ep_group_t *group, struct ep_buffers *out,
			 size_t size);
#define ep_get_buffers(group, out) \
	ep_get_buffers_sized((group), (out), sizeof *(out))
/* The group's receive areas (1 unless joined with EP_JOIN_RECV_AREAS). */
uint32_t ep_group_recv_areas(const ep_group_t *group);
/* recv_x of area a ([max_recv, hidden]; a host address, or a device one
 * for a GPU group), or NULL when a is not below ep_group_recv_areas. */
const void *ep_recv_area(ep_group_t *group, uint32_t a);

/* Local: tokens per rank [world], tokens per expert [num_experts] and
 * is_token_in_rank [num_tokens, world] (0/1) from topk_idx. */
int ep_get_dispatch_layout(ep_group_t *group, const int64_t *topk_idx,
			   uint32_t num_tokens, int32_t *num_tokens_per_rank,
			   int32_t *num_tokens_per_expert,
			   uint8_t *is_token_in_rank);

#define EP_DISPATCH_WEIGHTS 0x1u /* topk_weights in the buffer are valid */
/* ep_dispatch_inplace, ep_dispatch_stream: this rank's received rows (and
 * only they: scales, indices and the rest have one place) go to receive
 * area a (below the group's areas, else EP_EINVAL); area 0 is recv_x. */
#define EP_DISPATCH_AREA(a) (((unsigned)(a) & 0xffu) << 24)
#define EP_COMBINE_BIAS 0x1u     /* add combine_bias */
#define EP_COMBINE_BIAS2 0x4u    /* and combine_bias2 (DeepEP's bias pair) */
#define EP_COMBINE_WEIGHTS 0x2u  /* also sum combine_topk_weights (each
				    received row's [topk] f32) into
				    combined_topk_weights on the token's home
				    rank; every rank of the combine alike */
/* Sum this rank's tokens in DeepEP V2's order: each token's rows by the
 * position of each rank's last slot in the token's row of this rank's
 * topk_idx buffer field as it is at the combine (write the dispatch's
 * top-k there again if it changed since), rows of ranks the row does not
 * name after them in ascending rank; without it, ascending rank. A
 * rank's own choice (EP_COMBINE_TOPK_ORDER on one rank, not another, is
 * no mismatch). */
#define EP_COMBINE_TOPK_ORDER 0x8u

/* Zero-copy dispatch of the first num_tokens rows of the send buffers.
 * cached: reuse that handle's routing (topk_idx is not read; only recv_x
 * and recv_x_scales are written). *handle receives the routing. */
int ep_dispatch_inplace(ep_group_t *group, uint32_t num_tokens,
			unsigned flags, const ep_handle_t *cached,
			ep_handle_t *handle);
/* Zero-copy combine of combine_y (handle->num_recv rows) into combined. */
int ep_combine_inplace(ep_group_t *group, const ep_handle_t *handle,
		       unsigned flags);

/* This rank is done with the handle: its routing is freed once every
 * local rank released it. A GPU rank may release right after enqueueing
 * its last op that uses the handle: ops already sent keep it. Releasing a
 * handle twice, or one of another group, gives EP_ESTALE; a host rank's
 * release while an op of its group that uses the handle is in progress,
 * EP_EBUSY. On a failed group it succeeds (its handles went with it). */
int ep_handle_release(ep_group_t *group, const ep_handle_t *handle);
/* The same without waiting for the daemon's answer, for a GPU rank that
 * releases on a hot path or from a finalizer: the call sends the release
 * and returns. A refusal (a handle not held) then becomes the
 * connection's asynchronous error (ep_group_error, and the next request's
 * answer). On a host rank it is ep_handle_release. */
int ep_handle_release_async(ep_group_t *group, const ep_handle_t *handle);

struct ep_dispatch_in {
	uint32_t num_tokens;
	uint32_t hidden; /* must match the group */
	ep_dtype_t dtype;
	uint32_t topk;
	const void *x;
	const float *x_scales;      /* fp8 */
	const int64_t *topk_idx;    /* unused for a cached dispatch */
	const float *topk_weights;  /* may be NULL */
};

struct ep_dispatch_out {
	uint64_t capacity; /* rows each array below holds */
	void *recv_x;      /* any of these may be NULL: not copied */
	float *recv_x_scales;
	int64_t *recv_topk_idx;
	float *recv_topk_weights;
	int32_t *num_recv_tokens_per_expert;
	uint32_t num_recv; /* set on return */
};

/* Dispatch with copies from and to caller arrays. More rows than capacity:
 * EP_ETOOBIG (the dispatch happened; *handle is valid). */
int ep_dispatch(ep_group_t *group, const struct ep_dispatch_in *in,
		const ep_handle_t *cached, struct ep_dispatch_out *out,
		ep_handle_t *handle);
/* Combine y [num_rows, hidden] bf16 (num_rows = handle->num_recv) into
 * out [handle->num_tokens, hidden] bf16; bias [num_tokens, hidden] or
 * NULL. */
int ep_combine(ep_group_t *group, const ep_handle_t *handle,
	       const uint16_t *y, uint32_t num_rows, uint32_t hidden,
	       const uint16_t *bias, uint16_t *out);

/* Combine with every input and output named (ep_combine is this with the
 * top-k weights left out). With topk_weights [num_rows, topk] (the rows'
 * weights as dispatch gave them, or changed), combined_topk_weights
 * [handle->num_tokens, topk] receives, per token and slot, their fp32 sum
 * over the ranks the token went to, in ascending rank order from +0.0
 * (what DeepEP's combine returns; 0.0 for tokens sent nowhere). Both or
 * neither; every rank of the combine alike (else EP_EMISMATCH). */
struct ep_combine_in {
	const uint16_t *y;   /* [num_rows, hidden] bf16 */
	uint32_t num_rows;   /* = handle->num_recv */
	uint32_t hidden;
	const uint16_t *bias; /* [num_tokens, hidden] bf16, or NULL */
	const float *topk_weights; /* [num_rows, topk] f32, or NULL */
	/* a second bias added after the first (DeepEP's pair), or NULL */
	const uint16_t *bias2;
};
struct ep_combine_out {
	uint16_t *out;       /* [num_tokens, hidden] bf16 */
	float *combined_topk_weights; /* [num_tokens, topk] f32, or NULL */
};
int ep_combine_ex(ep_group_t *group, const ep_handle_t *handle,
		  const struct ep_combine_in *in, struct ep_combine_out *out);

/* The daemon's status (version, clients, groups) as a JSON document;
 * *json is malloc'd, the caller frees it. */
int ep_daemon_status(ep_conn_t *conn, char **json);

/*
 * Stream-ordered operations (GPU ranks, EP_JOIN_CUDA). The call enqueues the
 * op on `stream` (a CUstream or cudaStream_t; NULL is the legacy default
 * stream) and returns without waiting: later work on the stream runs after
 * the op. The CPU waits only when 1024 ops are still in flight. Errors are
 * asynchronous: once a group fails (a rank died, a timeout), every rank's
 * stream is released, and the error is returned by the next call and by
 * ep_group_error() and ep_group_sync().
 *
 * CUDA graphs: an op enqueued on a stream being captured is numbered, and
 * reaches the daemon, at each replay (every rank replays the same ops in
 * the same order). A captured dispatch's handle names the routing of the
 * current replay: captured combines and cached dispatches may use it;
 * ep_dispatch_recv_count, ep_handle_release (the graph releases each
 * replay's routing itself) and direct ops may not (EP_EINVAL; read the
 * count with ep_dispatch_recv_count_device). Too many tokens is refused
 * at capture (EP_ETOOBIG). While graphs holding this rank's ops of the
 * group exist, its direct stream ops of the group are refused (EP_EBUSY);
 * they work again shortly after cuGraphExecDestroy and cuGraphDestroy.
 * An op a replay could not post (the group failed) is skipped: the error
 * comes from ep_group_error and ep_group_sync.
 */
int ep_barrier_stream(ep_group_t *group, void *stream);
/* Stream-ordered dispatch of the first num_tokens rows of the device send
 * buffers (ep_get_buffers on a GPU group gives device addresses), and
 * combine of combine_y into combined. *handle is filled at once; its
 * num_recv is unknown (UINT32_MAX) until ep_dispatch_recv_count. A bad
 * expert index fails that op alone, changing nothing; the error comes back
 * from ep_group_sync and ep_group_error. More tokens than the group's
 * maximum: the op is enqueued all the same (stream order), this call
 * returns EP_ETOOBIG and fills no handle, and every other rank's op fails
 * with EP_ETOOBIG naming this rank (from ep_dispatch_recv_count or
 * ep_group_sync); the group goes on. */
int ep_dispatch_stream(ep_group_t *group, uint32_t num_tokens, unsigned flags,
		       const ep_handle_t *cached, void *stream,
		       ep_handle_t *handle);
int ep_combine_stream(ep_group_t *group, const ep_handle_t *handle,
		      unsigned flags, void *stream);
/* The rows this rank received in that dispatch: the CPU waits for it (as
 * DeepEP's CPU sync does) until the op's routing is known, not until its
 * rows landed: they follow on the stream, and work queued there after the
 * dispatch sees them. Without waiting, size outputs for max_recv. */
int ep_dispatch_recv_count(ep_group_t *group, ep_handle_t *handle);
/* The rows this rank received per local expert (num_experts / world_size
 * of them, into counts[0..n)) in its latest dispatch, which must be the
 * fresh dispatch of `handle` (a cached one counts nothing new: EP_EINVAL).
 * A token counts once per distinct local expert of its top-k. On a GPU
 * rank the CPU waits as ep_dispatch_recv_count does (no longer once that
 * returned); on a host rank the counts are those its ep_dispatch wrote. */
int ep_dispatch_recv_expert_counts(ep_group_t *group,
				   const ep_handle_t *handle, int32_t *counts,
				   uint32_t n);
/* Without waiting: the device address (a CUdeviceptr) of a uint32 that
 * holds the rows this rank received in its latest stream-ordered dispatch
 * that succeeded, written in stream order. Work queued on the same stream
 * after ep_dispatch_stream reads that dispatch's count (CUDA-graph
 * friendly); outputs are sized for max_recv. 0 for a host group. */
uint64_t ep_dispatch_recv_count_device(const ep_group_t *group);
/* Device copies in one kernel launch on `stream` (the current context's
 * GPU): copy i moves count elements of elt bytes (1, 2, 4, 8 or 16), the
 * j-th from src + j * src_stride * elt to dst + j * dst_stride * elt
 * (strides in elements; 0 means 1); the copies may run in any order and
 * must not overlap. For the small copies a rank makes on its stream
 * between two ops (a dispatch's routing input in, its outputs out): each
 * separate copy is one more dependent step there, and every rank of the
 * group waits for the slowest. At most EP_COPIES_MAX copies; EP_EINVAL
 * for a bad element size or a pointer not aligned to it. */
#define EP_COPIES_MAX 16
struct ep_copy {
	void *dst;
	const void *src;
	uint64_t count;
	uint32_t elt, dst_stride, src_stride;
};
int ep_stream_copies(const struct ep_copy *copies, unsigned n, void *stream);
/* 0, or the group's asynchronous error (non-blocking). */
int ep_group_error(ep_group_t *group);
/* Wait until this rank's stream-ordered ops completed on the device: 0.
 * If the group failed (or the timeout passed) first, its error. A
 * replayed graph's ops count once the replay reached them (synchronize
 * the stream first to wait for a whole replay). */
int ep_group_sync(ep_group_t *group);
/* This rank's region of device memory (CUdeviceptr) and, in *size, its
 * size: every field ep_get_buffers returns for a GPU group lies inside it.
 * 0 (and *size 0) for host groups. */
uint64_t ep_group_device_region(const ep_group_t *group, size_t *size);

/*
 * Low-latency mode (decode; DeepEP's low_latency_dispatch/combine), GPU
 * ranks of a one-node group (bf16 rows, hidden a multiple of 8; the
 * dispatch may cast them to fp8). Each op is a
 * kernel on the caller's stream that writes straight into the other
 * ranks' low-latency regions (made by the daemon at the first call, never
 * read by it); no daemon in an op's path, and CUDA-graph capturable (the
 * sequence numbers advance on the device). Every rank makes the same
 * calls in the same order.
 *
 * Host ranks (one node or several) have the same calls, outputs and bits
 * on the daemon's path: stream is ignored, each call is complete on
 * return (the hooks only report a failure), the outputs are host memory
 * (valid until the dispatch after next). The (token, k) rows go through a
 * second group of the same ranks (the group's name with ":ll-" and a
 * hash), joined at the first low-latency call and left with the group. A
 * failed op (a rank died or left, a timeout: the daemon's error) ends the
 * mode as below. GPU ranks of a group across nodes take that way too,
 * on the device: the second group is a GPU group whose stream-ordered
 * dispatch and combine (the daemons', which cross nodes) run on the
 * caller's stream between small kernels of libep's; the outputs are
 * libep's device memory. The same bits as the kernels, the daemons'
 * speed (a message pair through each daemon an op), no CPU wait, and
 * CUDA-graph capturable. The group's low-latency ops must then run in one
 * order on the device (one stream, or streams ordered by events); shrink
 * mode and a narrower top-k are the one-node kernels' only.
 *
 * ep_ll_dispatch sends this rank's num_tokens (<= max_tokens) rows of x
 * [T, hidden] to the ranks of its top-k experts (topk_idx [T, topk] i64,
 * -1 skips). Buffer out->buffer (0, 1: the two buffers alternate, so two
 * micro-batches may be in flight) receives them: recv_x [El, W*max_tokens,
 * hidden] bf16, per local expert packed by source rank, then source
 * (token, k) order; recv_count [El] i32; layout_range [El, W] i64
 * (begin << 32 | rows) and src_info [El, W*max_tokens] i32 (source token,
 * -1 past the count). They stay valid until the dispatch after next.
 * EP_LL_HOOK: this call only sends; ep_ll_dispatch_hook(buffer) later
 * waits for the rows and writes the outputs (overlap in between).
 *
 * ep_ll_combine returns that buffer's rows to their tokens' home ranks
 * and sums them there: out [T, hidden] bf16 = sum over k of weights[t, k]
 * * row, in fp32 from +0.0 in top-k order, each product rounded, rounded
 * once to bf16 (bitwise reproducible). expert_out is [El, W*max_tokens,
 * hidden] bf16 in recv_x's order; with EP_LL_ZERO_COPY it is not given:
 * the rows are already in ep_ll_combine_buffer(buffer) and each home reads
 * them there (no copy). EP_LL_HOOK: ep_ll_combine_hook(buffer) later
 * waits and sums.
 *
 * Errors (a peer that never came within the group's timeout, a bad expert
 * index, too many tokens) are bits the kernels raise on the device; the
 * ops never trap or hang. ep_ll_error reads them (synchronize the stream
 * first) and clears them, except a fatal one. A failed wait is fatal to
 * the group's low-latency mode: a peer that did not come within the
 * timeout (EP_ETIMEDOUT), the group's failure (a rank left or died: its code,
 * mostly EP_EPEERLOST, seen by the waiting kernels at once, not at the
 * timeout), or a peer whose op failed (EP_EFAILED; the failure travels
 * on the flags, so every rank's kernels end within one op and none reads
 * rows placed out of step). From then on ep_ll_error and every ep_ll_*
 * call return that error; the kernels they still launch move no rows,
 * report zero received rows and write NaN into a combine's out (a graph
 * replayed in a loop must not take stale rows for a result): join a new
 * group. A rank with more than max_tokens: its call returns EP_ETOOBIG at
 * once (it took part with no tokens, so that every rank finishes) and
 * every rank's ep_ll_error reports EP_ETOOBIG.
 */
#define EP_LL_HOOK 0x1      /* the receive half is left to *_hook */
#define EP_LL_ZERO_COPY 0x2 /* combine: rows already in the combine buffer */
/*
 * Dispatch with a cast to fp8 (hidden a multiple of 128): recv_x is then
 * [El, W*max_tokens, hidden] e4m3 and recv_scales, per 128 channels,
 * column-major [El, hidden/128, W*max_tokens] f32 (element (e, row, g) at
 * (e * hidden/128 + g) * W*max_tokens + row). Each group's scale is amax
 * * fl(1/448), amax its largest magnitude (at least 1e-4; NaNs take no
 * part), and its values are multiplied by fl(448/amax) (DeepEP's
 * multiplier) and rounded to nearest even e4m3 (every step rounded to
 * fp32). EP_LL_ROUND_SCALE: the scale rounded up
 * to a power of two, the values multiplied by its inverse. EP_LL_UE8M0
 * (hidden a multiple of 512; implies the rounding): the scales' exponent
 * bytes, four groups to an i32 (group 4i + j in byte j), [El, hidden/512,
 * W*max_tokens] i32.
 */
#define EP_LL_FP8 0x4
#define EP_LL_ROUND_SCALE 0x8
#define EP_LL_UE8M0 0x10
/* Dispatch: topk_idx has k columns (1 .. the group's topk), every rank's
 * dispatch alike; its combine's weights then [T, k] too. 0 (the default):
 * the group's topk. On the kernels only (GPU ranks of one node), else
 * EP_EUNSUPPORTED unless k is the group's. */
#define EP_LL_TOPK(k) ((unsigned)(k) << 8)
#define EP_LL_TOPK_OF(flags) (((flags) >> 8) & 0xffu)
struct ep_ll_recv {
	uint32_t buffer;        /* 0 or 1: give it to combine and the hooks */
	void *recv_x;           /* device addresses, in this rank's region */
	int32_t *recv_count;
	int64_t *layout_range;
	int32_t *src_info;
	uint32_t local_experts; /* El = experts / world */
	uint32_t max_recv;      /* W * max_tokens: recv_x's second extent */
	void *recv_scales;      /* EP_LL_FP8: the scales (above); else NULL */
};
int ep_ll_dispatch(ep_group_t *group, const void *x, const int64_t *topk_idx,
		   uint32_t num_tokens, unsigned flags, void *stream,
		   struct ep_ll_recv *out);
int ep_ll_dispatch_hook(ep_group_t *group, uint32_t buffer, void *stream);
int ep_ll_combine(ep_group_t *group, uint32_t buffer, const void *expert_out,
		  const float *weights, void *out, unsigned flags,
		  void *stream);
int ep_ll_combine_hook(ep_group_t *group, uint32_t buffer, void *stream);
/* Where the experts' rows of buffer's next zero-copy combine go
 * ([El, W*max_tokens, hidden] bf16, device address). */
int ep_ll_combine_buffer(ep_group_t *group, uint32_t buffer, void **rows);
/* 0, or the first error the low-latency kernels raised (cleared). */
int ep_ll_error(ep_group_t *group);

/*
 * Shrink mode (DeepEP's): a rank that fails no longer ends the mode.
 * ep_ll_shrink turns it on for this rank's low-latency kernels (every rank
 * of the group alike, before the ops it should cover; GPU ranks of one
 * node, else EP_EUNSUPPORTED). Each rank keeps a mask of ranks: a masked
 * rank is neither sent to nor waited for. A wait masks the rank it waits
 * for, and the op goes on without it, when that rank left the group or
 * died (the daemon says so at once, protocol 1.17), did not come within
 * the group's timeout, or failed (its flags carry the mark). A dispatch
 * then delivers the rows of the ranks that came, a combine sums the rows
 * of the experts whose ranks came (a (t, k) of a masked rank's expert is
 * left out, as -1 is), and no row goes to a masked rank. A rank that
 * failed between its counts and its rows leaves a hole: its rows keep
 * their places in recv_x and recv_count, with none in layout_range and
 * -1 in src_info. The ranks must agree on who is present: each dispatch
 * checks that every source counted the same ranks as the receiver (a
 * rank's rows are placed after those of the ranks before it), and a
 * disagreement ends the mode with EP_EMISMATCH rather than misplace rows.
 *
 * ep_ll_mask sets (masked 1) or clears rank's mask word (not this rank's
 * own); ep_ll_mask_query copies the mask words, int32 [world] (1 masked),
 * to device memory; ep_ll_mask_clean clears them all; all three on the
 * stream, in its order. ep_ll_barrier waits on the stream for every rank
 * not masked (one block; in shrink mode it masks a rank that does not
 * come, as any wait does, which is DeepEP's clean_low_latency_buffer).
 */
int ep_ll_shrink(ep_group_t *group);
int ep_ll_mask(ep_group_t *group, uint32_t rank, int masked, void *stream);
int ep_ll_mask_query(ep_group_t *group, int32_t *mask, void *stream);
int ep_ll_mask_clean(ep_group_t *group, void *stream);
int ep_ll_barrier(ep_group_t *group, void *stream);

/*
 * Registered memory (GPU ranks of a one-node group): the daemon maps a
 * range of the rank's own device memory, so that a stream-ordered combine
 * reads the rank's rows where they are (ep_combine_stream_reg) instead of
 * from combine_y, which the caller would have to copy them into. The
 * memory must come from the CUDA virtual memory API with POSIX
 * file-descriptor handles requested (cuMemCreate with
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; PyTorch's expandable segments
 * are such memory), else EP_EUNSUPPORTED. ep_mem_register widens
 * [ptr, ptr + len) to the allocations under it and passes them to the
 * daemon as descriptors (at most EP_MEM_REG_CHUNKS of them, else
 * EP_ETOOBIG); while registered they stay alive, held by libep and the
 * daemon, even where the caller frees or unmaps them. Host groups and
 * groups across nodes: EP_EUNSUPPORTED. ep_leave deregisters what is
 * left.
 */
typedef struct ep_mreg ep_mreg_t;
#define EP_MEM_REG_CHUNKS 64
int ep_mem_register(ep_group_t *group, const void *ptr, size_t len,
		    ep_mreg_t **mr);
/* 1 if [ptr, ptr + len) lies inside mr and every allocation under it is
 * still the one registered; 0 if not (the caller's allocator put another
 * allocation there: register again); a negative EP_ code on error. */
int ep_mem_covers(const ep_mreg_t *mr, const void *ptr, size_t len);
/* The range mr covers (the allocations' extent). */
void ep_mem_range(const ep_mreg_t *mr, uint64_t *base, size_t *len);
int ep_mem_deregister(ep_mreg_t *mr);
/* ep_combine_stream with this rank's rows (handle->num_recv of them, or
 * rows where the handle's count is not known on the host) read from y,
 * device memory inside mr (ep_mem_covers must hold: EP_ESTALE if not), not
 * from combine_y; bias and weights still come from the buffers. Not in a
 * CUDA graph capture (EP_EUNSUPPORTED). y must stay unchanged until the
 * combine ran on the stream. */
int ep_combine_stream_reg(ep_group_t *group, const ep_handle_t *handle,
			  unsigned flags, const ep_mreg_t *mr, const void *y,
			  uint32_t rows, void *stream);
/* Where a stream-ordered combine reads its rows and writes its result in
 * registered memory; a NULL registration is the group's buffer for that
 * side (combine_y, combined). */
struct ep_combine_mem {
	const ep_mreg_t *y_reg; /* rows rows at y (as ep_combine_stream_reg) */
	const void *y;
	uint32_t rows;
	/* the combined rows, the handle's num_tokens of them, written at out
	 * (inside out_reg) instead of combined: the caller's own output, no
	 * copy out; combined_w (EP_COMBINE_WEIGHTS) is still the buffer's */
	const ep_mreg_t *out_reg;
	void *out;
};
/* ep_combine_stream with the places of mem (EP_ESTALE where ep_mem_covers
 * does not hold for one). Not in a CUDA graph capture (EP_EUNSUPPORTED).
 * y must stay unchanged and out untouched until the combine ran on the
 * stream. */
int ep_combine_stream_mem(ep_group_t *group, const ep_handle_t *handle,
			  unsigned flags, const struct ep_combine_mem *mem,
			  void *stream);

/* ep_dispatch_stream with this rank's x rows (num_tokens of them, fp8
 * bytes for an fp8 group; scales, indices and weights still from the
 * buffers) read from x, device memory inside mr (EP_ESTALE if
 * ep_mem_covers does not hold), not from the x buffer. Not in a CUDA graph
 * capture (EP_EUNSUPPORTED). x must stay unchanged until the dispatch ran
 * on the stream. */
int ep_dispatch_stream_reg(ep_group_t *group, uint32_t num_tokens,
			   unsigned flags, const ep_handle_t *cached,
			   const ep_mreg_t *mr, const void *x, void *stream,
			   ep_handle_t *handle);

/* Identity of a joined group. */
uint64_t ep_group_id(const ep_group_t *group);
uint32_t ep_group_rank(const ep_group_t *group);
uint32_t ep_group_world_size(const ep_group_t *group);

#ifdef __cplusplus
}
#endif
#endif /* EP_EP_H */
