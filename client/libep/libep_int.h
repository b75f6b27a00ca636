/* SPDX-License-Identifier: MIT */
/* libep internals. */
#ifndef LIBEP_INT_H
#define LIBEP_INT_H

#include <pthread.h>
#include <stdbool.h>

#include "ep/ep.h"
#include "epp.h"
#include "list.h"

struct ep_conn {
	int fd;
	/* mu: one request and its reply at a time (the reader); wmu: one
	 * frame written at a time, taken alone by stream-ordered frames (a
	 * CUDA graph's host node must not wait for a request's reply) */
	pthread_mutex_t mu, wmu;
	uint64_t next_req; /* atomic */
	uint64_t client_id;
	uint16_t minor; /* the daemon's protocol minor version */
	int dead;      /* set once the stream is unusable */
	int async_err; /* an error reply to a stream-ordered request */
	bool shutdown; /* the daemon announced its shutdown */
	char backend[16];
	char node[EP_NODE_NAME_MAX + 1]; /* the daemon's node name (1.21) */
	struct list_node groups;
};

/* The req_id of a frame no reply is waited for (stream-ordered): its
 * ERROR is the connection's asynchronous error whenever it arrives. */
#define EP__REQ_ASYNC (1ull << 63)
/* Send one frame (h's req_id assigned here, with EP__REQ_ASYNC if async)
 * under c->wmu; an error makes the connection dead and is returned. */
int ep__send(ep_conn_t *c, struct epp_hdr *h, const void *payload,
	     bool async);
/* The same with h->nfds descriptors (fds) riding on the frame. */
int ep__send_fds(ep_conn_t *c, struct epp_hdr *h, const void *payload,
		 const int *fds, bool async);

/* How long a control request (leave, status, release) may take. */
#define EP__CTL_TIMEOUT_MS 10000

struct ep_group {
	struct list_node node; /* in conn->groups */
	ep_conn_t *conn;
	uint64_t id;
	uint32_t epoch, node_index;
	uint32_t timeout_ms;
	struct epp_join cfg; /* cfg.nodes: the node list (owned), or NULL */
	void *buf;
	size_t buf_size;
	struct epp_buf layout;
	/* GPU ranks */
	int cuda_device;
	uint64_t dev_ptr; /* CUdeviceptr of this rank's region */
	uint64_t dev_handle;
	void *ring_fn;   /* CUfunction ekc_ring_wait in the rank's context */
	bool ring_tried; /* looked it up (NULL: memops) */
	const struct ep__ll_ops *llops; /* the low-latency mode's way */
	const struct ep__gpu_ops *gpu;  /* a GPU rank's part, else NULL */
	bool mps, mps_known; /* an MPS client of the GPU (libep_cuda.c) */
	size_t dev_size;
	uint64_t ctl_dev; /* the control page, registered: its device view */
	uint64_t sent; /* stream-ordered ops enqueued */
	uint64_t op_err_seen; /* last op error reported */
	uint64_t toobig_seq;  /* a dispatch of too many tokens: reported to
				 this rank when it was enqueued */
	uint64_t last_dispatch; /* seq of the last dispatch op */
	bool last_cached;       /* and whether it was a cached one */
	struct ep_graphs *gr;   /* ops captured into CUDA graphs (libep_graph.c) */
	struct ep_ll *ll;       /* the low-latency mode (libep_ll.c) */
	struct ep_llh *llh;     /* and a host rank's (libep_llhost.c) */
	struct ep_llx *llx;     /* a GPU rank's across nodes (libep_ll.c) */
	struct list_node mregs; /* registered memory (libep_mreg.c) */
};

/* A handle made by a dispatch captured into a CUDA graph: seq is this bit
 * and the record's id (the routing is a new one at every replay). */
#define EP__GSEQ (1ull << 63)
/* ep__graph_capture: a cached dispatch */
#define EP__GFLAG_CACHED (1u << 31)

/* A GPU rank's part of a group, as the core sees it. The cuda module
 * (cuda/libep_cuda.c and its siblings, or cuda/libep_nocuda.c in a build
 * without CUDA: EP_EUNSUPPORTED) defines it as ep__gpu; the public joins
 * (join.c) hand it to ep__join, and the group keeps it (g->gpu, NULL for
 * a host rank). The core never names the cuda module's functions: it
 * calls them through this table (tests/layering). */
struct ep__gpu_ops {
	/* a JOIN's device uuid and rank flags of device dev */
	int (*prepare)(int dev, uint8_t uuid[16], uint32_t *rank_flags);
	/* map the rank's region from fd (closed either way) */
	int (*map)(ep_group_t *g, int fd, uint64_t size);
	/* the low-latency mode's way for group g (NULL: none) */
	const struct ep__ll_ops *(*ll_ops)(const ep_group_t *g);
	/* 0, or the error of a replayed graph's op that could not be
	 * posted */
	int (*graph_error)(ep_group_t *g);
	/* The teardown, in this order: leave what the rank joined besides
	 * the group (the pseudo group of the low-latency mode across
	 * nodes), while the daemon still serves it; then, once the group is
	 * left (or the connection closed), wait for the rank's queued work
	 * and free everything the GPU part holds (registrations, graphs,
	 * the low-latency mode, the mappings). */
	void (*leave)(ep_group_t *g);
	void (*unmap)(ep_group_t *g);
};
extern const struct ep__gpu_ops ep__gpu;
/* libep_ctl.c: this rank's words in the control page: its error word,
 * its slot, the ops every rank completed (32 bits, and widened against
 * the ops sent), the wait until at most `behind` ops are incomplete, and
 * an op that failed alone (reported once). */
int ep__ctl_error(const ep_group_t *g);
const uint8_t *ep__ctl_slot(const ep_group_t *g);
uint64_t ep__completed_full(const ep_group_t *g);
int ep__wait_completed(ep_group_t *g, uint64_t behind);
/* Until none of the rank's ops is incomplete, for at most timeout_ms (or
 * until the group fails, or the daemon hangs up). */
int ep__wait_drained(ep_group_t *g, int timeout_ms);
/* Ops sent and not complete; the wait of ep__wait_completed, returning
 * the control page's error code as it is (no call that could take a
 * caller's lock), or EP_ETIMEDOUT with its message. */
uint64_t ep__inflight(const ep_group_t *g);
int ep__wait_until(ep_group_t *g, uint64_t behind);
/* Until dispatch k's count is in the control page (published once its
 * routing is known; from a daemon below 1.15, once it completed), or the
 * group failed. */
int ep__wait_count(ep_group_t *g, uint64_t k);
int ep__op_error(ep_group_t *g);
/* The same, but an op that named a failed dispatch's handle gives that
 * dispatch's error (its cause), not EP_ESTALE. */
int ep__op_error_cause(ep_group_t *g);
int ep__group_failed(ep_group_t *g);
int ep__check_handle(const ep_group_t *g, const ep_handle_t *h);
/* This rank's COMBINE / DISPATCH request, checked as the daemon will,
 * encoded into frame[128]; its length in *len. */
int ep__combine_request(ep_group_t *g, const ep_handle_t *h, unsigned flags,
			uint8_t *frame, uint32_t *len);
/* A place in registered memory: registration reg (0: none, the group's
 * buffer), byte off, rows rows. */
struct ep__place {
	uint32_t reg, rows;
	uint64_t off;
};
/* The same with combine_y's rows (in) and the combined rows (out) in
 * registered memory (NULL: none). */
int ep__combine_request_reg(ep_group_t *g, const ep_handle_t *h,
			    unsigned flags, const struct ep__place *in,
			    const struct ep__place *out, uint8_t *frame,
			    uint32_t *len);
/* The same with x's rows in registered memory: reg (0: none), at byte
 * off. */
int ep__dispatch_request_reg(ep_group_t *g, uint32_t num_tokens,
			     unsigned flags, const ep_handle_t *cached,
			     uint32_t reg, uint64_t off, uint8_t *frame,
			     uint32_t *len);
int ep__dispatch_request(ep_group_t *g, uint32_t num_tokens, unsigned flags,
			 const ep_handle_t *cached, uint8_t *frame,
			 uint32_t *len);
/* g's RELEASE of handle h, encoded into buf[cap]: its length, 0 if it
 * does not fit. */
size_t ep__release_encode(const ep_group_t *g, const ep_handle_t *h,
			  uint8_t *buf, size_t cap);
/* Send h's release with no reply awaited (an error reply is the
 * connection's asynchronous error). */
int ep__release_async(ep_group_t *g, const ep_handle_t *h);
/* ep_stream_copies' arguments, checked alike with and without CUDA:
 * EP_EINVAL, or 0 and the copies with elements in *todo. */
int ep__copies_check(const struct ep_copy *c, unsigned n, unsigned *todo);
/* A GPU rank's buffers follow the control words in its region. */
#define EP__DEV_DATA 4096u
uint64_t ep__ctl_completed(const ep_group_t *g);

/* ep_join linked to group id link (0: none; 1.16): the new group fails
 * whenever that one does, also while it forms; with ext (NULL: none)'s
 * num_nodes/nodes and recv_rows (1.21); gpu: the GPU part a join with
 * EP_JOIN_CUDA takes (NULL: such a join is refused). */
int ep__join(ep_conn_t *c, const struct ep_group_config *cfg, unsigned flags,
	     uint64_t link, const struct epp_join *ext,
	     const struct ep__gpu_ops *gpu, ep_group_t **out);
/* Unmap and free a group's handle (no message to the daemon). */
void ep__group_free(ep_group_t *g);
/* The low-latency mode (ep.h): libep_llapi.c has the ep_ll_* calls, which
 * check their arguments and go on through the group's table, chosen once
 * at join (g->llops): a host rank's way (ep__ll_host_ops,
 * libep_llhost.c: the daemon's path), a GPU rank's of one node (the
 * kernels, cuda/libep_ll.c) or across nodes (the daemon's path,
 * cuda/libep_llx.c); none in a build without CUDA for a GPU rank (there
 * is no such rank). fp8: 0 or EK_LL_FP8* (kernels/ek.h). A way without
 * shrink mode leaves those entries NULL, and no_shrink says why. */
struct ep__ll_ops {
	int (*dispatch)(ep_group_t *g, const void *x, const int64_t *topk_idx,
			uint32_t num_tokens, unsigned flags, int fp8,
			void *stream, struct ep_ll_recv *out);
	int (*dispatch_hook)(ep_group_t *g, uint32_t buffer, void *stream);
	int (*combine)(ep_group_t *g, uint32_t buffer, const void *expert_out,
		       const float *weights, void *out, unsigned flags,
		       void *stream);
	int (*combine_hook)(ep_group_t *g, uint32_t buffer, void *stream);
	int (*combine_buffer)(ep_group_t *g, uint32_t buffer, void **rows);
	int (*error)(ep_group_t *g);
	/* a top-k below the group's (EP_LL_TOPK) */
	bool topk_below;
	int (*shrink)(ep_group_t *g);
	int (*mask)(ep_group_t *g, uint32_t rank, int masked, void *stream);
	int (*mask_query)(ep_group_t *g, int32_t *mask, void *stream);
	int (*mask_clean)(ep_group_t *g, void *stream);
	int (*barrier)(ep_group_t *g, void *stream);
	/* what a call of shrink mode (what) answers without it */
	int (*no_shrink)(ep_group_t *g, const char *what, bool on);
};
extern const struct ep__ll_ops ep__ll_host_ops;
/* The low-latency errors that do not end the mode, by precedence (a bad
 * expert index, then too many tokens or rows): 0 if neither. */
int ep__ll_soft_error(bool expert, bool toobig);
/* The buffer the host path's next dispatch takes (0 or 1). */
uint32_t ep__llh_next(const ep_group_t *g);
/* ep_leave: leave the pseudo group first; group free: free it all. */
void ep__llh_leave(ep_group_t *g);
void ep__llh_fini(ep_group_t *g);
/* The end of a rank's low-latency mode on the daemon's path (host ranks,
 * GPU ranks across nodes): a failed op, kept; every later call returns
 * it. ep__ll_die ends it with rc (the message: the last error's) and
 * returns rc; ep__ll_gate returns the kept end, or ends it when group g
 * (NULL: none) failed, else 0; the cause it ends with is
 * ep__group_failed's (an op of g that failed alone before g did). */
struct ep__ll_end {
	int rc;
	char msg[EPP_ERRMSG_MAX + 96];
};
int ep__ll_die(struct ep__ll_end *e, int rc);
int ep__ll_gate(struct ep__ll_end *e, ep_group_t *g);
/* The pseudo group's name: the group's (cut to fit) and a hash of all of
 * it, so that every rank, on every node, names the same group. */
void ep__llh_name(const char *name, char out[EP_GROUP_NAME_MAX + 1]);

int ep__fail(int code, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
int ep__rpc(ep_conn_t *c, uint16_t type, uint16_t flags, const void *payload,
	    uint32_t len, uint8_t **reply, uint32_t *rlen, int *fds,
	    unsigned maxfds, int timeout_ms);
/* ep__rpc sending nsfds descriptors with the request. */
int ep__rpc_fds(ep_conn_t *c, uint16_t type, uint16_t flags,
		const void *payload, uint32_t len, const int *sfds,
		unsigned nsfds, uint8_t **reply, uint32_t *rlen, int *fds,
		unsigned maxfds, int timeout_ms);
int ep__group_op_timeout(const ep_group_t *g);

#endif
