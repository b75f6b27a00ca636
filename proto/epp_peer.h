/* SPDX-License-Identifier: MIT */
/*
 * Daemon-to-daemon frames (the peer port; protocol 1.3 and later): one
 * codec per message, as for the client frames in epp.h, so that the daemon
 * reads peer bytes only through decoders a fuzzer feeds
 * (tests/fuzz/fuzz_peer.c). A decoder checks structure: lengths, string
 * sizes, counts against the room the payload has; it returns 0 or
 * EP_EPROTO. What a value means for a group (is this rank on that node,
 * is this op expected) is the daemon's to judge.
 */
#ifndef EPP_PEER_H
#define EPP_PEER_H

#include "epp.h"

#define EPP_NODE_NAME_MAX 63
#define EPP_MAX_NODES 64
#define EPP_PEER_NONCE 32
/* A group as the nodes name it: "name~uid" for a user's group. */
/* name, ~uid, and #tag of a job's secret (16 hex digits) */
#define EPP_GKEY_MAX (EP_GROUP_NAME_MAX + 12 + 17)

struct epp_peer_hello {
	uint16_t major, minor;
	char node[EPP_NODE_NAME_MAX + 1];
	uint32_t index;
	uint8_t nonce[EPP_PEER_NONCE];
};
size_t epp_peer_hello_encode(const struct epp_peer_hello *m, uint8_t *buf,
			     size_t cap);
int epp_peer_hello_decode(const uint8_t *p, size_t len,
			  struct epp_peer_hello *m);

/* The sender's view: its epoch and its row of the connectivity matrix
 * (one letter a node). */
struct epp_peer_heartbeat {
	uint64_t epoch;
	char row[EPP_MAX_NODES + 1];
};
size_t epp_peer_heartbeat_encode(const struct epp_peer_heartbeat *m,
				 uint8_t *buf, size_t cap);
int epp_peer_heartbeat_decode(const uint8_t *p, size_t len,
			      struct epp_peer_heartbeat *m);

/* A rail peer entered barrier seq. */
struct epp_peer_barrier {
	char group[EPP_GKEY_MAX + 1];
	uint32_t local;
	uint64_t seq;
	/* 1.21: the data ops the sender's ranks completed before this
	 * barrier (every node's alike); UINT64_MAX from an older peer */
	uint64_t xops;
	/* 1.21: a dissemination barrier's step (groups of more than
	 * EPP_DISSEM_NODES nodes: step s goes to node + 2^s and says that
	 * node and all it heard from entered the round); EPP_STEP_ALL: the
	 * sender's arrival, to every node */
	uint8_t step;
};
#define EPP_STEP_ALL 0xff
#define EPP_DISSEM_NODES 4
size_t epp_peer_barrier_encode(const struct epp_peer_barrier *m, uint8_t *buf,
			       size_t cap);
int epp_peer_barrier_decode(const uint8_t *p, size_t len,
			    struct epp_peer_barrier *m);

/* The group failed on the sender after `round` barriers and `xops` data
 * ops; code is negative. */
struct epp_peer_gfail {
	char group[EPP_GKEY_MAX + 1];
	int32_t code;
	char msg[EPP_ERRMSG_MAX];
	uint64_t round, xops;
};
size_t epp_peer_gfail_encode(const struct epp_peer_gfail *m, uint8_t *buf,
			     size_t cap);
int epp_peer_gfail_decode(const uint8_t *p, size_t len,
			  struct epp_peer_gfail *m);

/* XMETA, XROWS, GSHAPE and XWIN start with the group and an op number;
 * their bodies follow (decoded below, once the group is known). */
struct epp_peer_op {
	char group[EPP_GKEY_MAX + 1];
	uint64_t op;
	const uint8_t *body; /* inside the decoded payload */
	size_t body_len;
};
void epp_peer_put_op(struct epp_wr *w, const char *group, uint64_t op);
int epp_peer_op_decode(const uint8_t *p, size_t len, struct epp_peer_op *m);

/* XMETA body: a source rank's routing inputs for a dispatch; data holds
 * tokens x topk int64 indices, then as many fp32 weights with
 * EPP_DISPATCH_WEIGHTS (nothing for a cached dispatch). */
struct epp_peer_xmeta {
	uint32_t rank, tokens, flags;
	const uint8_t *data;
	size_t data_len;
};
int epp_peer_xmeta_decode(const struct epp_peer_op *op,
			  struct epp_peer_xmeta *m);

/* XROWS body: count records of (u32 destination, u32 slot, row bytes) of
 * an op of `type` along `handle`; rec is the size of one record. */
struct epp_peer_xrows {
	uint16_t type;
	uint64_t handle;
	uint32_t count;
	const uint8_t *recs;
};
void epp_peer_put_xrows(struct epp_wr *w, uint16_t type, uint64_t handle,
			uint32_t count);
/* The op type alone (the record size depends on it): 0 or EP_EPROTO. */
int epp_peer_xrows_type(const struct epp_peer_op *op, uint16_t *type);
int epp_peer_xrows_decode(const struct epp_peer_op *op, size_t rec,
			  struct epp_peer_xrows *m);

/* GSHAPE body: the group's shape, EPP_PEER_SHAPE_N u32 fields, then
 * (1.21) a u64 hash of its node list where the job named its nodes, and
 * u32 recv_rows where it set them (0 here where not). */
#define EPP_PEER_SHAPE_N 8
int epp_peer_shape_decode(const struct epp_peer_op *op,
			  uint32_t v[EPP_PEER_SHAPE_N], uint64_t *nodes_hash,
			  uint32_t *recv_rows);

/* XWIN body: window id and n receive windows of (addr, rkey, len). */
struct epp_peer_xwin {
	uint16_t wid;
	uint32_t n;
	const uint8_t *ent;
};
struct epp_peer_window {
	uint64_t addr, len;
	uint32_t rkey;
};
int epp_peer_xwin_decode(const struct epp_peer_op *op,
			 struct epp_peer_xwin *m);
void epp_peer_xwin_get(const struct epp_peer_xwin *m, uint32_t i,
		       struct epp_peer_window *out);
void epp_peer_put_window(struct epp_wr *w, const struct epp_peer_window *e);

#endif
