/* SPDX-License-Identifier: MIT */
/*
 * The core of epd: groups (EP communicators), their members (ranks joined
 * through a client session), the two-phase barrier and the entry of
 * dispatch and combine, independent of the device backend (backend.h) and
 * of the transport between nodes (the cluster registers struct
 * epd_span_ops). Layers above (server/, cluster/) call down into it; it
 * reports up only through what they registered: a session's send
 * function, a member's completion callback, the span operations.
 *
 * Threads: every object here belongs to the libuv loop thread. Data-path
 * work (dispatch, combine) runs on worker threads that touch only the
 * group's buffers and hand results back to the loop.
 */
#ifndef EPD_CORE_H
#define EPD_CORE_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <unistd.h>
#include <uv.h>

#include "ek.h"
#include "epp.h"
#include "epp_peer.h"
#include "list.h"
#include "util/clock.h"
#include "util/config.h"
#include "util/log.h"
#include "util/pool.h"

/* A group's key (EPP_GKEY_MAX, epp_peer.h): its name in its owner's
 * namespace ("name~uid"), or the bare name for root's groups and shared
 * ones; the key is what the nodes of a group agree on. */

struct epd_server;
struct epd_group;
struct epd_member;
struct epd_cluster;
struct epd_xnode;
struct epd_xop;
struct epd_xwin;

/* A client connection as the core sees it: who is at the other end, the
 * members it joined, and how to answer it. server/client.c embeds one at
 * the start of each connection. */
struct epd_session {
	struct epd_server *srv;
	uint64_t id;
	pid_t pid;
	uid_t uid;
	gid_t gid;
	struct list_node members; /* struct epd_member.cnode */
	/* Queue a frame to it; fds are owned by the queue (closed after
	 * sending, or at once on failure). 0 or an EP_ code; a failure
	 * never tears anything down from inside the call. */
	int (*send)(struct epd_session *s, uint16_t type, uint16_t flags,
		    uint64_t req_id, const void *payload, uint32_t len,
		    const int *fds, unsigned nfds);
};

static inline int epd_session_send(struct epd_session *s, uint16_t type,
				   uint16_t flags, uint64_t req_id,
				   const void *payload, uint32_t len,
				   const int *fds, unsigned nfds)
{
	return s->send(s, type, flags, req_id, payload, len, fds, nfds);
}
/* An EPP_ERROR reply. */
void epd_session_error(struct epd_session *s, uint64_t req_id, int code,
		       const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

/* How the core reaches a group's other nodes. The cluster registers these
 * at its start (srv->span); without a cluster no group spans nodes and
 * none is called. Calls are for groups with nnodes > 1 only. */
struct epd_span_ops {
	/* This node's index and the cluster's size. */
	int (*self)(const struct epd_server *srv);
	int (*size)(const struct epd_server *srv);
	/* The cluster's index of the node of that name, or -1. */
	int (*resolve)(struct epd_server *srv, const char *name, char *err,
		       size_t errlen);
	/* A join's list of nodes is being resolved (on), or was (off): the
	 * nodes it named so far are not forgotten meanwhile. */
	void (*resolve_pin)(struct epd_server *srv, bool on);
	/* A group spanning nodes was made here (its node_map set): the
	 * cluster connects to its nodes (freed undoes it). */
	void (*formed)(struct epd_group *g);
	/* Is every other node of g connected? If not, the group waits
	 * (forming) and the cluster calls epd_group_nodes_up(g) once they
	 * are; nodes_missing names those it waits for ("n3 (why), n7"). */
	bool (*nodes_up)(struct epd_group *g);
	void (*nodes_missing)(struct epd_group *g, char *out, size_t cap);
	/* Local index l entered barrier seq: to its rail peers; a down node
	 * fails the group (then EP_EPEERLOST is returned). */
	int (*arrival)(struct epd_group *g, uint32_t l, uint64_t seq);
	/* The same to group node `to` alone, as dissemination step `step`
	 * (groups of more than EPP_DISSEM_NODES nodes). */
	int (*arrival_to)(struct epd_group *g, uint32_t l, uint64_t seq,
			  uint32_t to, uint8_t step);
	/* Every local rank entered the current dispatch or combine. */
	void (*op_start)(struct epd_group *g);
	/* The global ranks of other nodes the current op still waits for,
	 * as "3,5" (for the timeout's message). */
	void (*missing)(struct epd_group *g, char *out, size_t cap);
	/* The group is ready here (frames kept for it now apply). */
	void (*ready)(struct epd_group *g);
	/* The group failed here; tell: the failure is this node's own, to
	 * be told to the others. */
	void (*failed)(struct epd_group *g, int code, const char *msg,
		       bool tell);
	/* A group of key (spanning nnodes, the cluster's indices of its
	 * nodes in node_map, hashed as nodes_hash; the shape of join j) that
	 * this node refused to form: the others fail it at its first op. */
	void (*failed_key)(struct epd_server *srv, const char *key,
			   const struct epp_join *j, uint32_t nnodes,
			   const uint32_t *node_map, uint64_t nodes_hash,
			   int code, const char *msg);
	/* The group is being freed. */
	void (*freed)(struct epd_group *g);
	/* The name of the group's node n, for messages. */
	const char *(*node_name)(const struct epd_group *g, uint32_t n);
};

/* A stream-ordered op a GPU rank asked for. */
struct epd_aop {
	uint64_t seq;
	uint64_t handle; /* cached dispatch, combine: the dispatch's seq */
	uint32_t tokens, flags;
	uint32_t asked; /* a dispatch with EPP_DISPATCH_TOOBIG: the tokens the
			   rank asked for (it takes part with none) */
	/* a combine with EPP_COMBINE_YREG (a dispatch with
	 * EPP_DISPATCH_XREG): combine_y's rows (x's), the frame's num_rows
	 * (num_tokens), at byte reg_off of registration reg */
	uint32_t reg, rows;
	uint64_t reg_off;
	/* a combine with EPP_COMBINE_OUTREG: its combined rows below
	 * out_rows go to byte out_off of registration out_reg */
	uint32_t out_reg, out_rows;
	uint64_t out_off;
	uint16_t type; /* EPP_BARRIER, EPP_DISPATCH, EPP_COMBINE */
	bool fast;     /* a barrier run by the resident kernel (no frame) */
	bool released; /* a fresh dispatch whose handle the rank released
			  before the daemon enqueued it (the backend's) */
	uint64_t released_last; /* then: the rank's last op sent, which
				   (and every op before it) may name it */
};

/* Does op read its main input (a dispatch's x, a combine's rows) from the
 * rank's registered memory (op->reg, op->reg_off, op->rows)? */
static inline bool epd_aop_reg(const struct epd_aop *op)
{
	return op->flags & (op->type == EPP_COMBINE ? EPP_COMBINE_YREG
			    : op->type == EPP_DISPATCH ? EPP_DISPATCH_XREG
						       : 0);
}

/* Does op (a combine) write its combined rows into the rank's registered
 * memory (op->out_reg, op->out_off, op->out_rows)? */
static inline bool epd_aop_outreg(const struct epd_aop *op)
{
	return op->type == EPP_COMBINE && (op->flags & EPP_COMBINE_OUTREG);
}

/* Close n descriptors (a request's, not taken). */
static inline void epd_close_fds(int *fds, unsigned n)
{
	for (unsigned i = 0; i < n; i++)
		if (fds[i] >= 0)
			close(fds[i]);
}

/* A rank of a group, as joined through one client connection. */
struct epd_member;
struct epd_backend_ops;
/* Where a member's pending operation reports its end, when it is not a
 * client's request (a GPU rank's staged op: the backend set it). */
typedef void (*epd_member_complete_fn)(struct epd_member *m, int code,
				       const char *msg, const void *p,
				       uint32_t len);

struct epd_member {
	struct list_node cnode; /* in client->members */
	struct epd_session *client;
	struct epd_group *group;
	uint32_t rank, local;
	uint64_t barrier_seq;  /* barriers entered (monotonic) */
	uint64_t pending_req;  /* request in flight, 0 if none */
	/* non-NULL: the pending op is the backend's (pending_req is its op
	 * number), and its result goes here instead of to the client */
	epd_member_complete_fn complete;
	uint16_t pending_type; /* EPP_BARRIER, EPP_DISPATCH, EPP_COMBINE, or
				  EPP_JOIN (waiting for ready) */
	/* its last dispatch or combine, refused for its own arguments (its
	 * error replied), until it enters a collective again: named where
	 * the others time out waiting for it */
	uint16_t refused_type;
	int refused_code;
	/* Parameters of the pending dispatch or combine. */
	uint32_t op_tokens, op_flags, op_rows;
	/* Device ranks: the device (index into the backend's list; -1: a host
	 * rank), whether it runs under MPS, and the
	 * stream-ordered ops this rank asked for (monotonic). */
	int dev_index;
	bool mps;
	uint64_t async_seq;
	struct epd_aop *aq; /* ring of the rank's ops not yet enqueued */
};

enum epd_group_state {
	EPD_G_FORMING, /* some local ranks missing */
	EPD_G_READY,
	EPD_G_FAILED, /* a rank left or died, or a collective timed out */
};

enum epd_peer {
	EPD_PEER_NONE, /* nothing of its group yet */
	EPD_PEER_OPEN, /* its shape came: its frames are this group's */
	EPD_PEER_OVER, /* its group failed: what it sends is a later one's */
};

#define EPD_NODE_RELEASED UINT32_MAX /* see epd_group.nodes_released */

struct epd_group {
	struct list_node node; /* in server->groups */
	struct epd_server *srv;
	uint64_t id;
	uint32_t epoch;
	struct epp_join shape; /* name, world, rpn, experts, hidden, ... */
	uid_t owner;                 /* the uid that created it */
	bool shared;                 /* open to every admitted uid */
	char key[EPP_GKEY_MAX + 1];  /* see EPP_GKEY_MAX */
	uint32_t node_index, nnodes;
	/* [nnodes]: the cluster's index (struct epd_span_ops) of the group's
	 * node n. The job names its nodes at join (EPP_F_JOIN_NODES, any
	 * nodes in any order; nodes_hash is then an FNV-1a hash of the
	 * names, which every node checks alike); without a list, node n is
	 * the cluster's n (nodes_hash 0). */
	uint32_t *node_map;
	uint64_t nodes_hash;
	/* A failed group lets go of its nodes once nothing can still learn
	 * its failure from it (the cluster's tick, a timeout after failed_ns):
	 * node_map's entries other than node_index are then
	 * EPD_NODE_RELEASED, and its ranks keep its error until they leave. */
	uint64_t failed_ns;
	bool nodes_released;
	/* the job's secret, hashed (EPP_F_JOIN_SECRET): every joiner's must
	 * match; its first 8 bytes tag the key. has_secret false: none */
	bool has_secret;
	uint8_t secret_hash[32];
	bool await_nodes; /* every local rank joined; waits for its nodes */
	/* [nnodes], across nodes: where node n's group of this key stands
	 * for this one (enum epd_peer). A node sends its group's shape first
	 * (GSHAPE), then the group's frames, and its failure (GFAIL) last,
	 * on one ordered connection. So frames from n before its shape are
	 * an earlier group's there (a job restarted under the same name):
	 * dropped; frames after its failure are a later group's: kept for
	 * the next group of this key here. */
	uint8_t *peer;
	bool announced; /* its shape went to the other nodes */
	uint32_t timeout_ms;
	enum epd_group_state state;
	int fail_code;
	char last_error[EPP_ERRMSG_MAX];
	struct epd_member **local; /* [ranks_per_node] */
	uint32_t njoined;
	uint64_t created_ns;

	/* Barrier: round = barriers completed by this node. Phase 1 (rail) for
	 * local index l is done for round k when rail_done[l] >= k; it needs
	 * the local rank and every remote rail peer (rail_remote[l*nnodes+n],
	 * monotonic arrival counters from other nodes) at k. Phase 2 (node)
	 * completes round k once rail_done[l] >= k for every l. */
	uint64_t round;
	uint64_t *rail_done;
	uint64_t *rail_remote;
	/* [nnodes]: node n's latest barrier arrival (seq) and the data ops
	 * its ranks completed before it (UINT64_MAX: not said), checked
	 * against this node's program (epd_coll_order) */
	uint64_t *arr_seq, *arr_xops;
	/* The rail phase across more than EPP_DISSEM_NODES nodes: a
	 * dissemination barrier per rail (N log N messages, not N^2) of
	 * dis_steps steps; [rpn * dis_steps] the highest round received at
	 * step s (from node - 2^s) and sent (to node + 2^s). 0 steps: every
	 * node's arrival to every node (rail_remote). */
	uint32_t dis_steps;
	uint64_t *dis_recv, *dis_sent;
	uint64_t round_started_ns;

	uv_timer_t timer; /* join or collective timeout */
	bool timer_closing;

	/* The collective in progress: its type (0: none), how many local
	 * ranks entered, and for dispatch/combine the handle they name. */
	uint16_t coll_type;
	uint32_t coll_arrived;
	uint64_t coll_seq;
	bool coll_cached;
	bool coll_cw; /* a combine that sums top-k weights */
	/* the current dispatch's rank that asked for too many tokens */
	uint32_t toobig_rank, toobig_tokens;
	/* the rank epd_ops_toobig named last, for a GPU group's staged op:
	 * rank << 32 | its tokens (UINT32_MAX: asked on another node), as
	 * the control page's EPP_CTL_OP_ERR_POS carries it; UINT64_MAX none */
	uint64_t toobig_pos;
	bool busy;         /* a job runs on the data-path threads */
	bool free_pending; /* destroyed while busy: the job frees it */
	bool destroyed;    /* off the server's list, its timer closing */

	/* Handles: the routing of every dispatch not yet released by all
	 * local ranks, sorted by seq (handles.c). */
	struct epd_handle_ent *handles;
	size_t nhandles, hcap;
	uint64_t handle_bytes; /* their memory, against max_handle_bytes */
	uint64_t next_seq;

	/* Linked groups (JOIN with EPP_F_JOIN_LINK): this group fails when
	 * link_parent does; linked lists the groups linked to this one. */
	struct epd_group *link_parent;
	struct list_node link_node; /* in link_parent->linked */
	struct list_node linked;

	uint64_t n_barrier, n_dispatch, n_combine, n_errors;
	uint64_t bytes_moved;
	/* host path: when the collective's first local rank arrived, and the
	 * time from there to completion summed per kind (barrier, dispatch,
	 * combine), for the metrics' mean latency */
	uint64_t coll_start_ns;
	uint64_t op_ns[3];

	/* Across nodes: dispatches and combines by op number (the same on
	 * every node of the group); xop_next is this node's next one. Another
	 * node may run up to EPD_XOPS_MAX ops ahead: its routings and rows
	 * wait here (a ring of open ops, grown on demand: xop[id % xcap]);
	 * beyond that the group fails with EP_ETOOBIG. Memory: per op ahead,
	 * at most the other nodes' routings (tokens x top-k x 12 bytes per
	 * rank) and, for combine, their rows for this node's ranks. */
#define EPD_XOPS_MAX 1024
	struct epd_xop **xop;
	uint32_t xcap;
	uint64_t xop_next;
	size_t xout_hint; /* bytes packed for one node by the last op */
	/* Failing because the nodes ran different ops at this number: the
	 * others may finish the ops before it, not this one (UINT64_MAX:
	 * none). */
	uint64_t xop_disagree;
	/* The group failed on another node, after its ranks entered barrier
	 * round_limit and it completed xop_limit data ops: work up to there
	 * can still finish here; anything beyond fails with rfail_code. */
	int rfail_code;
	uint64_t rfail_round, rfail_xop;
	char rfail_msg[EPP_ERRMSG_MAX];

	/* GPU group: device regions, streams, stream-ordered progress. */
	/* The device backend of its ranks (NULL: host ranks) and the
	 * backend's state for the group (touched by that backend only). */
	const struct epd_backend_ops *dev;
	void *dev_group;

	/* rdma transport: its windows (xnode.c), or NULL: rows by frames */
	struct epd_xwin *xw;

	/* Backend buffer shared with the ranks, and the daemon's mapping. */
	int buf_fd;
	uint64_t buf_size;
	uint8_t *map;
	struct epp_buf layout;
};

struct epd_server {
	uv_loop_t *loop;
	struct epd_config cfg;
	char config_path[256];
	bool config_existed; /* then a reload needs it */
	/* reloads (SIGHUP), and the last one's result: failed, why, when */
	uint64_t reloads, reload_failures, reload_ns;
	bool reload_failed;
	char reload_error[256];
	char **overrides;    /* -o key=value, for reloads */
	int noverrides;
	uv_poll_t listen_poll;
	int listen_fd;
	bool socket_activated;
	bool unlink_socket;
	dev_t sock_dev; /* the socket file we bound */
	ino_t sock_ino;
	uv_signal_t sig_term, sig_int, sig_hup;
	uv_timer_t sd_watchdog; /* WATCHDOG=1 to systemd, when it asks */
	uint64_t sd_watchdog_usec;
	uv_idle_t reaper; /* closes doomed clients (client.c) */
	struct list_node clients;
	struct list_node groups;
	uint64_t next_client_id, next_group_id;
	uint32_t epoch;
	uint64_t start_ns;
	bool stopping;
	const char *backend;        /* "host" or "cuda" */
	char backend_reason[256];
	bool systemd;
	struct epd_pool *pool;
	/* The device backend found at start (NULL: host only), and its state
	 * (touched by that backend only). */
	const struct epd_backend_ops *dev;
	void *dev_state;
	/* Other nodes (NULL: a single node): the cluster and its cross-node
	 * op engine's state (cluster/ only), and what the core may ask of
	 * them (NULL without a cluster). */
	struct epd_cluster *cluster;
	struct epd_xnode *xnode;
	const struct epd_span_ops *span;
	uint64_t n_accepted, n_rejected, n_proto_errors, n_limited;
	size_t outq_total; /* bytes of replies queued for all clients */
	int reserve_fd; /* spent to accept-and-close when out of descriptors */
	struct epd_ratelimit log_rl; /* warnings caused from outside */
};

/* join.c, group.c */
int epd_group_join(struct epd_session *c, uint64_t req_id, uint16_t flags,
		   const struct epp_join *j);
int epd_group_leave(struct epd_session *c, uint64_t req_id, uint64_t gid);
/* Fail the groups linked to g (EPP_F_JOIN_LINK) with code: g failed
 * (why). */
void epd_group_links_fail(struct epd_group *g, int code, const char *why);
int epd_group_barrier(struct epd_session *c, uint64_t req_id, uint64_t gid);
int epd_group_async(struct epd_session *c, uint64_t req_id, uint64_t gid,
		    const struct epd_aop *op);
/* Shared by group.c, ops.c and the cluster. */
/* By key (what other nodes send); a client's name becomes a key with
 * epd_group_key. */
struct epd_group *epd_group_find(struct epd_server *srv, const char *key);
/* Every node of g (waiting for them) is connected now. */
void epd_group_nodes_up(struct epd_group *g);
/* The group's node index of the cluster's node cn, or UINT32_MAX where cn
 * is none of the group's nodes. */
uint32_t epd_group_node_of(const struct epd_group *g, uint32_t cn);
/* The key of group `name` joined by uid, with the tag of its job's secret
 * (the first 8 bytes of secret_hash; NULL: none). */
bool epd_group_key(const struct epd_config *cfg, uid_t uid, const char *name,
		   const uint8_t *secret_hash, char *key, size_t cap);
/* May session c see this group's details (status)? A group of a job's
 * secret: only its own members. */
bool epd_group_visible(const struct epd_group *g,
		       const struct epd_session *c);
void epd_list_ranks(char *out, size_t cap, struct epd_group *g,
		    bool (*missing)(struct epd_group *, uint32_t l, void *),
		    void *arg);
struct epd_member *epd_member_find(struct epd_session *c, uint64_t gid);
void epd_group_fail(struct epd_group *g, int code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
void epd_member_reply_ok(struct epd_member *m, const void *p, uint32_t len);
void epd_member_reply_err(struct epd_member *m, int code, const char *msg);
/* Checks common to every collective request; replies the error itself.
 * Returns the member, or NULL. */
struct epd_member *epd_coll_enter(struct epd_session *c, uint64_t req_id,
				  uint64_t gid);
/* Then, once the rank's own checks passed: false (replied, and the group
 * failed) if the other ranks are in another collective. */
bool epd_coll_agree(struct epd_member *m, uint64_t req_id, uint16_t type);
void epd_group_arm_timer(struct epd_group *g);
/* Op `op` (number k, 0: none) timed out (where: "", or where it waited):
 * the group fails with EP_ETIMEDOUT, naming `who` (e.g. "ranks never
 * arrived"): the local ranks for which missing() holds, then extra (other
 * ranks, "3,5"), or `none` when there are none. */
void epd_group_timed_out(struct epd_group *g, const char *op, uint64_t k,
			 const char *where, const char *who,
			 bool (*missing)(struct epd_group *, uint32_t l, void *),
			 void *arg, const char *extra, const char *none);
/* A data-path job of g ended (loop thread): true if its result is still
 * wanted; false if the group was destroyed (then freed now) or failed
 * while it ran, after drop(arg) freed the job. */
bool epd_group_job_ended(struct epd_group *g, void (*drop)(void *),
			 void *arg);
/* Free what a group owns once no job uses it. */
void epd_group_free(struct epd_group *g);
/* A member goes away (leave or disconnect). */
void epd_member_remove(struct epd_member *m, const char *why);
/* Fail every group (daemon shutdown). */
void epd_groups_shutdown(struct epd_server *srv);
const char *epd_group_state_name(enum epd_group_state s);

/* ops.c: dispatch and combine. */
int epd_op_dispatch(struct epd_session *c, uint64_t req_id,
		    const struct epp_dispatch *d);
int epd_op_combine(struct epd_session *c, uint64_t req_id,
		   const struct epp_combine *cb);

/* ll.c: LL_MAP, a rank's share of the low-latency mode. And the checks
 * of a request for something of GPU groups of one node (what: its name,
 * for the message; backend_has: the backend does it): 0, or an EP_ code
 * with *why. */
int epd_one_node_gpu(const struct epd_group *g, bool backend_has,
		     const char *what, const char **why);
int epd_op_ll_map(struct epd_session *c, uint64_t req_id,
		  const struct epp_ll_map *lm);

/* mreg.c: MEM_REG (fds: one per chunk, taken) and MEM_DEREG. */
int epd_op_mem_reg(struct epd_session *c, uint64_t req_id,
		   const struct epp_mem_reg *mr, int *fds);
int epd_op_mem_dereg(struct epd_session *c, uint64_t req_id,
		     const struct epp_mem_dereg *md);

/* handles.c: the group's handles. */
struct epd_handle_ent;
/* The routing of handle seq, or NULL (unknown, or released by all). */
struct ek_route *epd_route_find(struct epd_group *g, uint64_t seq);
/* Does local rank l still hold handle seq? */
bool epd_handle_held(const struct epd_group *g, uint64_t seq, uint32_t l);
/* Keep route (taken on success) as handle seq, held by every local rank;
 * extra: bytes the backend holds for it too. EP_ELIMIT past
 * max_handle_bytes, with why in err. */
int epd_handle_add(struct epd_group *g, uint64_t seq, struct ek_route *r,
		   uint64_t extra, char *err, size_t errlen);
/* Local rank l gives its hold back (the last frees it): 0 or EP_ESTALE. */
int epd_handle_release(struct epd_group *g, uint64_t seq, uint32_t l);
/* Free handle seq whoever holds it (a backend that owns the holds). */
void epd_handle_drop(struct epd_group *g, uint64_t seq);
void epd_handles_free(struct epd_group *g);
/* quiet: no OK on success (EPP_F_ASYNC); an error is replied either way */
int epd_op_release(struct epd_session *c, uint64_t req_id,
		   const struct epp_release *rl, bool quiet);

/* ops.c, shared with the cross-node engine (cluster/xnode.c) */
/* A fresh dispatch's routing r gives a rank more rows than the group's
 * receive capacity (recv_rows): the op fails alone on every rank alike
 * (EP_ETOOBIG, the lowest such rank named in err); *pos its control-page
 * word (EPP_OP_ERR_RECV | rank << 32 | rows). Any thread. */
struct ek_route;
bool epd_recv_over(const struct epd_group *g, const struct ek_route *r,
		   char *err, size_t errlen, uint64_t *pos);
/* Did a rank of the dispatch (flags by rank, W of them) ask for more
 * tokens than the maximum? Then why, naming it. */
bool epd_ops_toobig(struct epd_group *g, const uint32_t *flags, uint32_t W,
		    char *err, size_t errlen);
uint8_t *epd_region(struct epd_group *g, uint32_t l, int field);
void epd_ops_finish(struct epd_group *g, uint16_t type, bool cached,
		    uint64_t seq, struct ek_route **route, int rc,
		    const char *err, uint64_t bytes);

/* buffers.c: the group's shared memory. */
int epd_buf_create(struct epd_group *g);
void epd_buf_destroy(struct epd_group *g);

/* Device backends: backend.h. */
/* GPU groups across nodes: every local rank entered the op (its inputs
 * staged in host memory); run it on the host path (group.c, ops.c); each
 * member's result goes to done (its pending_req is set to seq). */
void epd_group_staged_barrier(struct epd_group *g, uint64_t seq,
			      epd_member_complete_fn done);
void epd_ops_staged_enter(struct epd_group *g, uint16_t type, bool cached,
			  uint64_t host_seq, const uint32_t *tokens,
			  const uint32_t *flags, uint64_t seq,
			  epd_member_complete_fn done);

/* group.c: the group failed on another node (see rfail_*). */
void epd_group_remote_failure(struct epd_group *g, const char *node,
			      int code, const char *msg, uint64_t round,
			      uint64_t xops);
/* Apply a remote failure if the work now asked for is beyond it. */
bool epd_group_remote_check(struct epd_group *g);
/* group.c: a rail peer on node `node` entered barrier seq. */
/* Every node's ranks run the same collectives in the same order: the
 * barrier arrivals that came, against what this node's ranks run now.
 * False if the group failed on a disagreement (EP_EMISMATCH). */
bool epd_coll_order(struct epd_group *g);
void epd_group_remote_arrival(struct epd_group *g, uint32_t node, uint32_t l,
			      uint64_t seq, uint64_t xops, uint8_t step);

#endif
