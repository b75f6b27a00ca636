/* SPDX-License-Identifier: MIT */
/*
 * The cluster (cluster.c): the daemons of other nodes, their membership,
 * handshake and heartbeats over a transport (transport/transport.h); and
 * its cross-node op engine (xnode.c): dispatch and combine of groups that
 * span nodes, rows as frames or by one-sided writes. Both register
 * upward only through struct epd_span_ops (core.h).
 */
#ifndef EPD_CLUSTER_H
#define EPD_CLUSTER_H

#include "core/core.h"

struct epd_transport;
struct epd_tconn;
struct epd_sref;

/* cluster.c: other nodes (nothing without `peers`); registers the span
 * operations (span.c, srv->span). */
struct epd_transport_ops;
/* transports: those compiled in, NULL-terminated, in the order `transport
 * = auto` tries them. */
int epd_cluster_init(struct epd_server *srv,
		     const struct epd_transport_ops *const *transports,
		     char *err, size_t errlen);
/* The checks epd_cluster_init makes of cfg, without starting anything
 * (epd -t): 0, or -1 with err saying why. */
int epd_cluster_check(const struct epd_config *cfg, char *err, size_t errlen);
void epd_cluster_stop(struct epd_server *srv);
void epd_cluster_free(struct epd_server *srv);
/* The transport if it has one-sided writes (rdma), else NULL (tcp, or no
 * cluster). */
struct epd_transport *epd_cluster_transport(const struct epd_server *srv);
/* Group g's node n's connection if rows can be written to it (a
 * transport with writes, protocol 1.6, up, in the domain of the regions),
 * else NULL. Every n below is the group's node index (g->node_map gives
 * the cluster's). */
struct epd_tconn *epd_cluster_wconn(const struct epd_group *g, uint32_t n);
/* A frame to g's node n (dropped if n is not up: the group
 * fails through the membership): a copied, b copied too, or with ref sent
 * in place and held until written. */
void epd_cluster_send(struct epd_group *g, uint32_t n, uint16_t type,
		      const void *a, size_t na, const void *b, size_t nb,
		      struct epd_sref *ref);
/* Tell node n that g failed here (its code and message, and how far this
 * node got): a node whose group formed after the failure was told. */
void epd_cluster_tell_failed(struct epd_group *g, uint32_t n);
void *epd_cluster_status(struct epd_server *srv);
/* The name of the cluster's node cn. */
const char *epd_cluster_name_at(const struct epd_server *srv, uint32_t cn);
/* The name of g's node n. */
const char *epd_cluster_node_name(const struct epd_group *g, uint32_t n);

/* xnode.c: dispatch and combine across nodes. Its state: */
struct epd_xnode {
	/* frames for groups not ready here yet (barrier arrivals for groups
	 * not created yet among them) */
	struct list_node xstash;
	uint64_t xstash_bytes;
	struct epd_xbufs *xbufs; /* large buffers kept between ops */
	/* one-sided-write windows of freed groups, kept registered a grace
	 * period (peers' writes in flight), and the next window id */
	struct list_node xzombies;
	uint16_t next_wid;
};

void epd_xop_start(struct epd_group *g);
void epd_xop_frame(struct epd_server *srv, uint16_t type, uint32_t from,
		   const uint8_t *p, uint32_t len);
/* A rail peer's barrier arrival (m decoded from p): to its group, or kept
 * until the group exists here. */
void epd_xop_arrival(struct epd_server *srv, uint32_t from,
		     const struct epp_peer_barrier *m, const uint8_t *p,
		     uint32_t len);
void epd_xop_drop(struct epd_group *g);
/* The global ranks of other nodes the current op still waits for, as
 * "3,5" (dispatch: whose routing never came; combine: every rank of a
 * node whose rows did not all come, or "-" if unknown). */
void epd_xop_missing(struct epd_group *g, char *out, size_t cap);
/* The group became ready here: frames that came before it, now; and its
 * shape to the other nodes, which check theirs against it. */
void epd_xop_replay(struct epd_group *g);
void epd_xop_announce(struct epd_group *g);
/* one-sided writes: node `from`'s writes of an op are placed here (imm), and
 * our writes of an op to node `to` completed (cookie). */
void epd_xop_imm(struct epd_server *srv, uint32_t from, uint32_t imm);
void epd_xop_written(struct epd_server *srv, uint32_t to, uint64_t cookie);
/* A group's write windows: released (after a grace period) with the
 * group; all of them at once at shutdown. */
void epd_xwin_free(struct epd_group *g);
void epd_xwin_flush(struct epd_server *srv);
void epd_xop_stash_free(struct epd_server *srv);
/* A group's shape (GSHAPE payload) for group key: join j's, with its
 * timeout; into buf, the length returned (0: it does not fit). */
struct epp_join;
size_t epd_xop_shape_encode(const char *key, const struct epp_join *j,
			    uint32_t timeout_ms, uint64_t nodes_hash,
			    uint8_t *buf, size_t cap);
/* Node `from` went down: what it sent for groups not ready here goes. */
void epd_xop_node_down(struct epd_server *srv, uint32_t from);
/* Node `from` (named node) says its group m->group failed (GFAIL): what it
 * sent for a group not ready here goes (a later group there sends its
 * shape afresh), and the group here fails if it is that group's partner.
 */
struct epp_peer_gfail;
void epd_xop_failure(struct epd_server *srv, uint32_t from,
		     const struct epp_peer_gfail *m, const char *node);
void epd_xbufs_free(struct epd_server *srv);
/* Free the kept buffers once no group spans nodes. */
void epd_xbufs_trim(struct epd_server *srv);
size_t epd_xbufs_bytes(const struct epd_server *srv); /* kept for reuse */
/* A packed buffer shared by the frames that send it (loop thread only):
 * back to the pool when the last write completed. */
struct epd_sref {
	struct epd_server *srv;
	uint8_t *p;
	size_t cap;
	int refs;
};
void epd_sref_put(struct epd_sref *r);

#endif
