/* SPDX-License-Identifier: MIT */
/*
 * The cluster's shared parts. cluster.c: the membership (peers, node up
 * and down, heartbeats, the view, the transport's choice, status); nodes.c:
 * the node table; span.c: the span operations the core calls; peer.c: one
 * connection to another node (handshake, authenticated frames, the
 * transport's callbacks, dialling).
 *
 * The cluster: daemons of other nodes, over a transport (transport.h: tcp,
 * or rdma, the same byte stream over an RC queue pair, whose connect
 * request carries version, cluster id, node index and a proof of the key,
 * checked before a queue pair is made for the peer).
 *
 * Every node lists all nodes in the same order (`peers`); a node's index is
 * its place there. One connection per pair: the lower index connects. Both
 * ends send PEER_HELLO (protocol version, name, index, a fresh nonce); each
 * answers with PEER_AUTH = HMAC-SHA256(cluster key, the other's nonce || its
 * own name), so each proves knowledge of the key without sending it, and a
 * replayed AUTH fails against a new nonce. (Since protocol 1.7 the proof
 * binds both names, both nonces and the direction, and every later frame
 * carries a tag: peerauth.h.) A node is up once the other's AUTH checks
 * out; a wrong key, a newer major version, an unknown name or
 * garbage are logged and the connection closed. Heartbeats every
 * heartbeat_ms; a node silent for heartbeat_miss beats is down. Every change
 * advances the view epoch; groups spanning a down node fail with peer-lost.
 * The lower index reconnects, so a node can leave, restart and rejoin
 * without restarting the others.
 *
 * Barrier arrivals travel as PEER_BARRIER to the rail peers (same local
 * index on the other nodes of the group) and feed the group's rail
 * counters (group.c), through the cross-node engine (xnode.c), which
 * keeps them, as it keeps every frame for a group not ready here yet.
 */
#ifndef EPD_CLUSTER_INT_H
#define EPD_CLUSTER_INT_H

#include "cluster.h"
#include "peerauth.h"
#include "transport/transport.h"
#include "epp_rbuf.h"

#include <sys/stat.h>
#include <sys/uio.h>

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netdb.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The connectivity matrix (every node's row of U/D, in heartbeats and the
 * status) is kept for clusters up to this size; a larger one beats with
 * an empty row (its status lists peers, not a matrix). */
#define MATRIX_MAX EPP_MAX_NODES
#define NONCE 32

/* DOWN: wanted (a group here spans it, or peer_connect = all) and not
 * connected; IDLE: neither wanted nor connected (on-demand); FREE: a
 * learnt node forgotten (cl_node_reclaim), its slot free for the next. */
enum { NODE_DOWN, NODE_UP, NODE_SELF, NODE_IDLE, NODE_FREE };

struct pconn {
	struct epd_tconn *tc; /* the transport's; NULL once it is gone */
	uv_timer_t reap;      /* closed to free the connection */
	struct list_node node; /* in cluster->conns */
	struct epd_cluster *cl;
	int peer;  /* node index once its HELLO arrived, else -1 */
	int target; /* outgoing: the node we dialled */
	uint64_t born_ns;
	struct epp_rbuf rb; /* bytes received, not yet handled */
	bool hello_sent, got_hello, authed, closing;
	/* we dialled, its proof checked out, and we wait for its first
	 * frame after it: the acceptor sends one once it checked ours, so
	 * both ends take the node as up only when both have proven the key
	 * (the acceptor may still drop a connection whose proof it has not
	 * checked, as a handshake over its caps) */
	bool await_up;
	uint16_t minor; /* the peer's protocol minor version */
	uint8_t nonce[NONCE], peer_nonce[NONCE];
	/* after the handshake: each direction's key and frame number;
	 * tagging starts after our AUTH (tx) and after theirs (rx) */
	uint8_t ktx[32], krx[32];
	uint64_t ntx, nrx;
	bool tx_tag, rx_tag;
	char addr[96]; /* "rdma host:port", host up to 63 bytes */
	char host[48]; /* inbound: the source address, without the port */
	/* inbound, a node table of its own: the name of a node not in it,
	 * from its hello, learnt only once its proof checks out ("" else) */
	char unknown[EPP_NODE_NAME_MAX + 1];
};

/* The node a peer connection is for: its peer once that one's hello
 * arrived, else the node dialled, else -1 (an inbound connection that has
 * not said who it is). */
static inline int cl_conn_node(const struct pconn *c)
{
	return c->peer >= 0 ? c->peer : c->target;
}

struct cnode {
	char name[64];
	char host[64];
	int port;
	int state;
	struct pconn *conn; /* authenticated, or being dialled */
	uint64_t last_rx_ns, since_ns;
	uint64_t downs;
	uint64_t next_dial_ns, backoff_ns; /* redial a failing node slower */
	bool resolving; /* its host name is being looked up */
	uint64_t resolved_gen; /* the join list that last named it */
	uint32_t groups;  /* groups here that span it (on-demand: wanted) */
	uint64_t unused_ns; /* when the last of them went (linger from) */
	/* closing an unused connection (PEER_BYE): we asked and wait for
	 * the answer (the dialler), or we agreed and it is going away; in
	 * both the node counts as not connected for new groups, and its
	 * close fails no group */
	bool bye_asked, bye_agreed;
	bool idle_close;  /* our connection closes for lack of use */
	char row[MATRIX_MAX + 1]; /* its view of the cluster (heartbeats) */
	uint64_t epoch;          /* and its view epoch */
	char why[128];
};

struct epd_cluster {
	struct epd_server *srv;
	int self, n, cap;
	/* [n] of [cap]: the nodes of `peers` in their order, then those
	 * learnt at run time (peer_lookup: found by name, given by a job,
	 * or dialling in); indices are this node's own, names the same
	 * everywhere */
	struct cnode *node;
	/* node[0..fixed) came from peers and stay; later ones are learnt
	 * and forgotten when unused (cl_node_reclaim); nfree: FREE slots */
	int fixed, nfree;
	uint64_t resolve_gen; /* the join list being resolved, */
	bool pinning;	      /* while it is */
	uint8_t key[32];
	const struct epd_transport_ops *tops;
	struct epd_transport *tr;
	char transport_why[256]; /* why this transport */
	uint8_t cluster_id[8];
	uv_timer_t tick;
	struct list_node conns;
	uint64_t epoch, rejected;
	uint64_t reject_ns; /* the last rejection: when, who, why */
	char reject_addr[64], reject_why[256];
	bool stopping;
};

static const struct addrinfo resolve_hints = {.ai_socktype = SOCK_STREAM,
					      .ai_flags = AI_ADDRCONFIG};

/* Shared between cluster.c and peer.c. */
void cl_conn_close(struct pconn *c, const char *why);
void cl_conn_send(struct pconn *c, uint16_t type, const void *p, uint32_t len);
void cl_conn_write(struct pconn *c, uint16_t type, const void *a, size_t na, const void *b, size_t nb, struct epd_sref *ref);
void cl_dial(struct epd_cluster *cl, int n);
/* Is the node table the same on every node (peer_lookup = peers: the
 * order of `peers`, which heartbeat rows and hello indices follow)? */
bool cl_static(const struct epd_cluster *cl);
/* Node `name` (host, port; port 0: no address known, never dialled)
 * appended to the table: its index, or -1 with err (the table is at
 * peer_nodes_max, or out of memory). */
int cl_node_add(struct epd_cluster *cl, const char *name, const char *host,
		int port, char *err, size_t errlen);
/* The index of node `name`, or -1. */
int cl_node_find(const struct epd_cluster *cl, const char *name);
/* Forget the learnt nodes nothing here uses (no group, forming or not,
 * spans it; no connection, dial or lookup of it is open; not named by
 * the join list being resolved) and unused for at least min_ns: their
 * slots are free and what this node kept of them (frames stashed for
 * groups not formed) is dropped. Returns how many. */
int cl_node_reclaim(struct epd_cluster *cl, uint64_t min_ns);
void cl_failed_release(struct epd_cluster *cl, uint64_t now);
/* One entry of peers, name@host:port (t, cut in place), into nd; -1
 * (err says why). */
int cl_parse_peer(char *t, struct cnode *nd, char *err, size_t errlen);
/* Connected, and not closing by agreement: may a group count on it? */
bool cl_node_usable(const struct cnode *nd);
/* nodes.c: a join's node list entry resolved to the table's index, and
 * the list being resolved pinned (struct epd_span_ops: resolve,
 * resolve_pin). */
int cl_span_resolve(struct epd_server *srv, const char *entry, char *err,
		    size_t errlen);
void cl_span_resolve_pin(struct epd_server *srv, bool on);
/* span.c: the table the cluster registers with the core at its start */
extern const struct epd_span_ops cl_span_ops;
/* Does this node dial node n (when it wants it)? With peer_connect =
 * all, the lower index dials; on demand, the lower name. */
bool cl_dials(const struct epd_cluster *cl, int n);
int cl_first_addr(const struct addrinfo *ai, int port, struct sockaddr_storage *sa);
void cl_node_down(struct epd_cluster *cl, int n, const char *why);
void cl_node_up(struct pconn *c);
/* A heartbeat to c now (this node's view epoch and row). */
void cl_send_beat(struct pconn *c);
/* A PEER_BYE (kind) from node c->peer. */
void cl_bye(struct pconn *c, uint8_t kind);
/* Groups that waited for node n, now connected (or no longer closing),
 * go on if every node of theirs is. */
void cl_groups_nodes_up(struct epd_cluster *cl, int n);
void cl_note_rejection(struct epd_cluster *cl, const char *who, const char *why);
void cl_reject(struct pconn *c, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
int cl_resolve(const char *host, int port, struct sockaddr_storage *sa);
extern const struct epd_transport_cb cl_tr_cb;

#endif
