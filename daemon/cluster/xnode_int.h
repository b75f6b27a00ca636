/* SPDX-License-Identifier: MIT */
/*
 * Dispatch and combine for groups that span nodes (host backend, through
 * the cluster's transport): the engine's shared parts. Split by role:
 * xnode.c (an op's life: started, routed and packed by a job, completed),
 * xwin.c (rows by one-sided writes: windows, writes, their completions),
 * xframe.c (frames from other nodes, and the stash for groups not ready),
 * xbufs.c (large buffers kept between ops).
 *
 * Every node computes the same global routing (prefix sums over every
 * rank's counts), so slots agree without any agreement protocol:
 *  - dispatch: once the local ranks arrived, each node sends its ranks'
 *    topk_idx (and weights) to the group's other nodes (XMETA). With all of
 *    them, a job validates every rank's experts (a bad index fails the op on
 *    every node alike), routes, copies local rows, writes the metadata of
 *    rows that come from other nodes, and packs its rows for other nodes as
 *    (destination, slot, row) records (XROWS). The op ends when the job is
 *    done and every expected row arrived.
 *  - combine: the routing is the handle's. A job packs the rows whose home
 *    is on another node; a home stages the rows it receives at their slots
 *    in a per-destination buffer, so the one-node accumulation runs
 *    unchanged, in ascending rank order: the same bits as on one node.
 * Collectives are numbered per group on every node alike (op ids); a
 * node that is ahead may send combine rows early, which are staged.
 *
 * The tcp transport copies received rows on the loop thread. With the rdma
 * transport a dispatch's rows are written in place instead: each node
 * registers its local ranks' inputs and receive buffers when the group
 * forms and sends the receive buffers' addresses and keys to the group's
 * other nodes (XWIN, with a window id of its own); a job then queues one
 * RDMA WRITE per (row, destination) on the proxy, from the source rank's
 * input straight to the destination rank's slot on the other node, and a
 * last zero-byte write with immediate (window id, op) per node it wrote
 * to. The queue pair places that one after the rows, so its arrival
 * counts every row from that node (the receiver knows how many from its
 * own routing); its local completion says the inputs are read. Combine
 * rows, and rows to a node whose windows are not known, go as frames.
 */
#ifndef EPD_XNODE_INT_H
#define EPD_XNODE_INT_H

#include "cluster.h"
#include "transport/transport.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define FRAME_MAX (512u << 10) /* row records per XROWS frame */

/* Large buffers (packed rows, staged rows) kept between ops, on the loop
 * thread only. Fresh ones cost a page fault per 4 KiB and an munmap each
 * op, which measured (ep-bench, 2 nodes x 4 ranks, hidden 7168) as half
 * of a cross-node dispatch's time. Best fit; the smallest is evicted. */
#define XBUF_SLOTS 8
#define XBUF_KEEP (1ull << 30) /* bytes kept at most */

struct epd_xbufs {
	struct {
		uint8_t *p;
		size_t cap;
	} s[XBUF_SLOTS];
	int n;
	size_t bytes;
};

struct outbuf {
	uint8_t *p;
	size_t len, cap;
	uint32_t count;
};

/* A frame that came before its op could use it. */
struct xdefer {
	struct xdefer *next;
	uint32_t from, len;
	uint8_t data[];
};

struct epd_xop {
	struct epd_group *g;
	uint64_t recv_pos; /* past the receive capacity: its word */
	struct xdefer *deferred; /* combine rows before the routing */
	size_t deferred_bytes;
	uint64_t id;
	uint16_t type;
	bool cached, started, job_running, job_done, stage2;
	uint64_t handle;
	/* before it started here: the handle other nodes' combine rows named
	 * (0: none came), checked against this node's at the start */
	uint64_t claimed;
	/* the kind of dispatch other nodes' routings said (1 fresh, 2
	 * cached; 0: none came), checked against this node's */
	uint8_t meta_kind;
	uint32_t W;
	uint32_t *tokens, *flags;
	uint8_t *have; /* [W]: the routing (or arrival) of that rank came */
	int64_t **topk;  /* [W]; remote ones malloc'd */
	float **weights; /* [W]; remote ones malloc'd or NULL */
	uint32_t meta_have, meta_need;
	uint64_t rows_expected, rows_got;
	struct ek_route *route; /* fresh dispatch: owned until finish */
	bool own_route;
	uint16_t **staging; /* combine: [W], remote destinations */
	size_t *staging_cap;
	/* combine with top-k weights (cw: this node's ranks asked for it):
	 * the remote destinations' rows' weights, and how many rows came
	 * with and without them (every node must agree) */
	bool cw;
	float **wstaging;
	size_t *wstaging_cap;
	uint64_t rows_w, rows_nw;
	struct outbuf *out; /* [nnodes] */
	/* rdma writes: the connection of each node written to (held), and
	 * per node: an immediate sent (job), its completion (loop), its
	 * rows placed here (loop), and how many rows come from it */
	struct epd_tconn **wrc;
	uint8_t *wimm, *wsent, *wdone;
	uint64_t *rows_from;
	uv_work_t req;
	int rc;
	char err[EPP_ERRMSG_MAX];
	uint64_t bytes;
};

/* The rdma windows of a group. Set up on the loop thread when the group
 * forms; a peer's entry once, from its XWIN; read by jobs only for nodes
 * they were given a connection for (set before the job was queued). */
struct xpeer {
	bool have;
	uint16_t wid;
	uint64_t *addr, *len; /* [rpn]: receive buffers (RECV_X on) */
	uint32_t *rkey;
};

struct epd_xwin {
	uint16_t wid; /* this node's id of the group, in immediates */
	uint32_t rpn, nnodes;
	const struct epd_transport_ops *tops; /* that registered them */
	struct epd_tmr **src, **dst; /* [rpn]: inputs, receive buffers */
	struct xpeer *peer;          /* [nnodes] */
};

/* Freed groups' windows, registered until peers' writes are surely over. */
#define XWIN_GRACE_MS 2000
struct xzombie {
	struct list_node node;
	struct epd_server *srv;
	struct epd_xwin *xw;
	uint8_t *map;
	uint64_t size;
	int fd;
	uv_timer_t timer;
};

/* Frames for a group that is not ready on this node yet (its ranks are
 * still joining here, or it is not even created: a rail peer's barrier
 * arrival can come first): kept, within a bound, and replayed once it is.
 * The one place early frames wait. */
#define STASH_MAX (256ull << 20)

struct stashed {
	struct list_node node;
	char name[EPP_GKEY_MAX + 1];
	uint16_t type;
	uint32_t from, len;
	uint8_t data[];
};

/* Shared between the engine's files. */
bool xn_is_local(const struct epd_group *g, uint32_t rank);
uint32_t xn_lidx(const struct epd_group *g, uint32_t rank);
void xn_out_record(struct outbuf *o, uint32_t d, uint32_t slot, const void *a, size_t na, const void *b, size_t nb);
size_t xn_row_bytes(const struct epd_group *g, uint16_t type);
int xn_rows_out(struct epd_xop *x, const struct ek_rank_io *io, const struct ek_route *r);
uint8_t *xbuf_get(struct epd_server *srv, size_t want, size_t *cap);
void xbuf_put(struct epd_server *srv, uint8_t *p, size_t cap);
void xop_check(struct epd_group *g);
struct epd_xop *xop_get(struct epd_group *g, uint64_t id, uint16_t type);
void xop_submit(struct epd_xop *x);
/* The group fails: node `from` (UINT32_MAX: some node) ran op x along
 * handle theirs, this node along mine. */
void epd_xop_handle_mismatch(struct epd_group *g, const struct epd_xop *x,
			     uint32_t from, uint64_t theirs, uint64_t mine);
/* The same for a dispatch that node `from` ran cached (theirs_cached) or
 * fresh, and this node the other way. */
void epd_xop_kind_mismatch(struct epd_group *g, const struct epd_xop *x,
			   uint32_t from, bool theirs_cached);
/* Node `from` (UINT32_MAX: this node's ranks, starting it) runs op x as
 * `theirs` (a dispatch or a combine) where x is the other: EP_EMISMATCH
 * naming both, for every rank at once. */
void epd_xop_type_mismatch(struct epd_group *g, const struct epd_xop *x,
			   uint32_t from, uint16_t theirs);
/* Node `from` sent a frame of its op id (a `theirs`: dispatch or combine)
 * that this node finished without it (a combine that needed nothing from
 * that node): the nodes' ranks ran different ops there. EP_EMISMATCH. */
void epd_xop_past(struct epd_group *g, uint64_t id, uint32_t from,
		  uint16_t theirs);
void xwin_frame(struct epd_group *g, uint32_t from, const struct epp_peer_op *op);
void xwin_setup(struct epd_group *g);

#endif
