/* SPDX-License-Identifier: MIT */
/*
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
#include "cluster.h"
#include "peerauth.h"
#include "transport/transport.h"
#include "epp_rbuf.h"

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

#define MAX_NODES 64
#define NONCE 32

enum { NODE_DOWN, NODE_UP, NODE_SELF };

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
	uint16_t minor; /* the peer's protocol minor version */
	uint8_t nonce[NONCE], peer_nonce[NONCE];
	/* after the handshake: each direction's key and frame number;
	 * tagging starts after our AUTH (tx) and after theirs (rx) */
	uint8_t ktx[32], krx[32];
	uint64_t ntx, nrx;
	bool tx_tag, rx_tag;
	char addr[64];
};

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
	char row[MAX_NODES + 1]; /* its view of the cluster (heartbeats) */
	uint64_t epoch;          /* and its view epoch */
	char why[128];
};

struct epd_cluster {
	struct epd_server *srv;
	int self, n;
	struct cnode node[MAX_NODES];
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

static void conn_close(struct pconn *c, const char *why);

static int parse_peers(struct epd_cluster *cl, const char *spec,
		       const char *self, char *err, size_t errlen)
{
	char buf[2048];
	snprintf(buf, sizeof(buf), "%s", spec);
	cl->n = 0;
	cl->self = -1;
	for (char *save, *t = strtok_r(buf, ", ", &save); t;
	     t = strtok_r(NULL, ", ", &save)) {
		char *at = strchr(t, '@'), *colon = strrchr(t, ':');
		if (!at || !colon || colon < at || cl->n == MAX_NODES) {
			snprintf(err, errlen, "peers: '%s' is not name@host:port",
				 t);
			return -1;
		}
		struct cnode *nd = &cl->node[cl->n];
		*at = *colon = 0;
		snprintf(nd->name, sizeof(nd->name), "%s", t);
		snprintf(nd->host, sizeof(nd->host), "%s", at + 1);
		nd->port = atoi(colon + 1);
		if (nd->port <= 0 || nd->port > 65535) {
			snprintf(err, errlen, "peers: bad port for %s", t);
			return -1;
		}
		for (int i = 0; i < cl->n; i++)
			if (!strcmp(cl->node[i].name, nd->name)) {
				snprintf(err, errlen, "peers: %s listed twice",
					 nd->name);
				return -1;
			}
		if (!strcmp(nd->name, self))
			cl->self = cl->n;
		cl->n++;
	}
	if (cl->self < 0) {
		snprintf(err, errlen, "node_name '%s' is not in peers", self);
		return -1;
	}
	return 0;
}

static int load_key(struct epd_cluster *cl, const char *path, char *err,
		    size_t errlen)
{
	uint8_t buf[4096];
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		snprintf(err, errlen, "cluster key %s: %s", path,
			 strerror(errno));
		return -1;
	}
	ssize_t n = read(fd, buf, sizeof(buf));
	close(fd);
	if (n < 16) {
		snprintf(err, errlen, "cluster key %s: need at least 16 bytes",
			 path);
		return -1;
	}
	/* the file's bytes, whatever their form, give a 32-byte key */
	crypto_generichash(cl->key, sizeof(cl->key), buf, (size_t)n, NULL, 0);
	sodium_memzero(buf, sizeof(buf));
	return 0;
}

/* An IP address literal; -1 for a name. */
static int resolve(const char *host, int port, struct sockaddr_storage *sa)
{
	if (!uv_ip4_addr(host, port, (struct sockaddr_in *)sa))
		return 0;
	if (!uv_ip6_addr(host, port, (struct sockaddr_in6 *)sa))
		return 0;
	return -1;
}

/* The first address of a resolved name, with the port set. */
static int first_addr(const struct addrinfo *ai, int port,
		      struct sockaddr_storage *sa)
{
	for (; ai; ai = ai->ai_next) {
		if (ai->ai_family == AF_INET) {
			memcpy(sa, ai->ai_addr, sizeof(struct sockaddr_in));
			((struct sockaddr_in *)sa)->sin_port = htons(port);
			return 0;
		}
		if (ai->ai_family == AF_INET6) {
			memcpy(sa, ai->ai_addr, sizeof(struct sockaddr_in6));
			((struct sockaddr_in6 *)sa)->sin6_port =
				htons(port);
			return 0;
		}
	}
	return -1;
}

static const struct addrinfo resolve_hints = {.ai_socktype = SOCK_STREAM,
					      .ai_flags = AI_ADDRCONFIG};

/* ---- frames ---- */

static void sref_done(void *ref)
{
	epd_sref_put(ref);
}

/* One frame: header, a and the tag copied; b copied too, or with ref
 * sent from where it is, ref held until the transport is done with it. */
static void conn_write(struct pconn *c, uint16_t type, const void *a,
		       size_t na, const void *b, size_t nb,
		       struct epd_sref *ref)
{
	if (c->closing)
		return;
	uint8_t head[EPP_HDR_SIZE], tag[EPD_TAG];
	struct epp_hdr h;
	epp_hdr_init(&h, type, 0);
	h.length = (uint32_t)(na + nb);
	epp_hdr_encode(&h, head);
	struct iovec iov[4] = {{head, EPP_HDR_SIZE},
			       {(void *)a, na},
			       {(void *)b, nb},
			       {tag, EPD_TAG}};
	if (c->tx_tag)
		epd_frame_tag(c->ktx, c->ntx++, iov, 3, tag);
	if (ref)
		ref->refs++;
	if (!c->tc || c->cl->tops->send(c->tc, iov, c->tx_tag ? 4 : 3,
					ref ? 2 : -1, ref ? sref_done : NULL,
					ref)) {
		if (ref)
			ref->refs--;
		conn_close(c, "send failed");
	}
}

static void conn_send(struct pconn *c, uint16_t type, const void *p,
		      uint32_t len)
{
	conn_write(c, type, p, len, NULL, 0, NULL);
}

static void send_hello(struct pconn *c)
{
	struct epd_cluster *cl = c->cl;
	if (c->hello_sent)
		return;
	c->hello_sent = true;
	uint8_t buf[256];
	struct epp_peer_hello m = {.major = EPP_VERSION_MAJOR,
				   .minor = EPP_VERSION_MINOR,
				   .index = (uint32_t)cl->self};
	randombytes_buf(c->nonce, NONCE);
	memcpy(m.nonce, c->nonce, NONCE);
	snprintf(m.node, sizeof(m.node), "%s", cl->node[cl->self].name);
	size_t n = epp_peer_hello_encode(&m, buf, sizeof(buf));
	conn_send(c, EPP_PEER_HELLO, buf, (uint32_t)n);
}


static void fail_groups(struct epd_cluster *cl, int n, const char *why)
{
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &cl->srv->groups)
	{
		struct epd_group *g = LIST_ENTRY(it, struct epd_group, node);
		if (g->nnodes > 1 && (uint32_t)n < g->nnodes &&
		    g->state != EPD_G_FAILED)
			epd_group_fail(g, EP_EPEERLOST,
				       "node %s (index %d) is down: %s",
				       cl->node[n].name, n, why);
	}
}

static void node_down(struct epd_cluster *cl, int n, const char *why)
{
	struct cnode *nd = &cl->node[n];
	nd->state = NODE_DOWN;
	nd->downs++;
	nd->since_ns = epd_now_ns();
	snprintf(nd->why, sizeof(nd->why), "%s", why);
	cl->epoch++;
	epd_warn("node %s (index %d) down: %s; view epoch %llu", nd->name, n,
		 why, (unsigned long long)cl->epoch);
	fail_groups(cl, n, why);
}

static void node_up(struct pconn *c)
{
	struct epd_cluster *cl = c->cl;
	struct cnode *nd = &cl->node[c->peer];
	if (nd->conn && nd->conn != c)
		conn_close(nd->conn, "replaced by a new connection");
	nd->conn = c;
	nd->state = NODE_UP;
	nd->last_rx_ns = nd->since_ns = epd_now_ns();
	nd->why[0] = 0;
	nd->backoff_ns = 0;
	cl->epoch++;
	epd_notice("node %s (index %d) up at %s; view epoch %llu", nd->name,
		   c->peer, c->addr, (unsigned long long)cl->epoch);
}

/* A handshake refused, by us or by the peer: counted, kept for the status
 * and logged (by both sides: the dialler too learns why). */
static void note_rejection(struct epd_cluster *cl, const char *who,
			   const char *why)
{
	cl->rejected++;
	cl->reject_ns = epd_now_ns();
	snprintf(cl->reject_addr, sizeof(cl->reject_addr), "%s", who);
	snprintf(cl->reject_why, sizeof(cl->reject_why), "%s", why);
	epd_log_limited(&cl->srv->log_rl, "peer connection %s rejected: %s", who, why);
}

static void reject(struct pconn *c, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

static void reject(struct pconn *c, const char *fmt, ...)
{
	char msg[256];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	note_rejection(c->cl, c->addr, msg);
	conn_close(c, msg);
}

static void on_hello(struct pconn *c, const uint8_t *p, uint32_t len)
{
	struct epd_cluster *cl = c->cl;
	struct epp_peer_hello m;
	if (epp_peer_hello_decode(p, len, &m))
		return reject(c, "malformed hello");
	uint16_t major = m.major, minor = m.minor;
	const char *name = m.node;
	uint32_t idx = m.index;
	memcpy(c->peer_nonce, m.nonce, NONCE);
	if (major != EPP_VERSION_MAJOR || minor < 7)
		return reject(c, "it speaks protocol %u.%u, this node %u.%u "
				 "(1.7 or later: bound proofs, authenticated "
				 "frames)",
			      major, minor, EPP_VERSION_MAJOR,
			      EPP_VERSION_MINOR);
	if (idx >= (uint32_t)cl->n || (int)idx == cl->self ||
	    strcmp(cl->node[idx].name, name))
		return reject(c, "node '%s' (index %u) is not in peers", name,
			      idx);
	if (c->target >= 0 ? (int)idx != c->target : (int)idx > cl->self)
		return reject(c, "node %s dialled the wrong way", name);
	c->peer = (int)idx;
	c->minor = minor;
	c->got_hello = true;
	/* The rdma passive side may receive the dialler's hello before its
	 * own ESTABLISHED event (where it sends its hello): ours first, with
	 * the nonce the proof below is bound to. */
	send_hello(c);
	const char *me = cl->node[cl->self].name, *it = cl->node[idx].name;
	epd_peer_key(cl->key, me, it, c->nonce, c->peer_nonce, c->ktx);
	epd_peer_key(cl->key, it, me, c->peer_nonce, c->nonce, c->krx);
	uint8_t mac[EPD_PROOF];
	epd_peer_proof(cl->key, me, it, c->nonce, c->peer_nonce, mac);
	conn_send(c, EPP_PEER_AUTH, mac, EPD_PROOF);
	c->tx_tag = true; /* every frame after our proof */
}

static void on_auth(struct pconn *c, const uint8_t *p, uint32_t len)
{
	struct epd_cluster *cl = c->cl;
	if (!c->got_hello || len != EPD_PROOF)
		return reject(c, "authentication out of order");
	uint8_t want[EPD_PROOF];
	epd_peer_proof(cl->key, cl->node[c->peer].name,
		       cl->node[cl->self].name, c->peer_nonce, c->nonce, want);
	if (crypto_verify_32(want, p))
		return reject(c, "node %s: wrong cluster key, or a proof made "
				 "for another connection",
			      cl->node[c->peer].name);
	c->rx_tag = true; /* every frame after its proof */
	c->authed = true;
	node_up(c);
}

static void on_barrier(struct pconn *c, const uint8_t *p, uint32_t len)
{
	struct epp_peer_barrier m;
	if (epp_peer_barrier_decode(p, len, &m))
		return reject(c, "malformed barrier");
	epd_xop_arrival(c->cl->srv, (uint32_t)c->peer, &m, p, len);
}

static void on_heartbeat(struct pconn *c, const uint8_t *p, uint32_t len)
{
	struct cnode *nd = &c->cl->node[c->peer];
	struct epp_peer_heartbeat m;
	if (epp_peer_heartbeat_decode(p, len, &m) ||
	    strlen(m.row) != (size_t)c->cl->n)
		return reject(c, "malformed heartbeat");
	nd->epoch = m.epoch;
	memcpy(nd->row, m.row, sizeof(nd->row));
}

static void conn_frame(struct pconn *c, const struct epp_hdr *h,
		       const uint8_t *p)
{
	if (c->authed)
		c->cl->node[c->peer].last_rx_ns = epd_now_ns();
	switch (h->type) {
	case EPP_PEER_HELLO:
		if (c->got_hello)
			return reject(c, "second hello");
		return on_hello(c, p, h->length);
	case EPP_PEER_AUTH:
		if (c->authed)
			return reject(c, "second authentication");
		return on_auth(c, p, h->length);
	case EPP_PEER_GFAIL: {
		if (!c->authed)
			return reject(c, "%s before authentication",
				      epp_type_name(h->type));
		struct epp_peer_gfail m;
		if (epp_peer_gfail_decode(p, h->length, &m))
			return reject(c, "malformed group failure");
		struct epd_group *g = epd_group_find(c->cl->srv, m.group);
		if (g && (uint32_t)c->peer < g->nnodes)
			epd_group_remote_failure(g, c->cl->node[c->peer].name,
						 m.code, m.msg, m.round,
						 m.xops);
		return;
	}
	case EPP_PEER_XMETA:
	case EPP_PEER_XROWS:
	case EPP_PEER_GSHAPE:
	case EPP_PEER_XWIN:
		if (!c->authed)
			return reject(c, "%s before authentication",
				      epp_type_name(h->type));
		epd_xop_frame(c->cl->srv, h->type, (uint32_t)c->peer, p,
			      h->length);
		return;
	case EPP_PEER_HEARTBEAT:
	case EPP_PEER_BARRIER:
		if (!c->authed)
			return reject(c, "%s before authentication",
				      epp_type_name(h->type));
		if (h->type == EPP_PEER_BARRIER)
			on_barrier(c, p, h->length);
		else
			on_heartbeat(c, p, h->length);
		return;
	default:
		return reject(c, "unexpected %s frame (type %u)",
			      epp_type_name(h->type), h->type);
	}
}

/* One frame: its tag checked (once tagging started), then handled. 1:
 * stop (the connection is closing); 2: go on, but the frames after this
 * one carry a tag (the peer's proof just checked out). */
static int peer_frame(void *arg, const struct epp_hdr *h, const uint8_t *f)
{
	struct pconn *c = arg;
	const bool tagged = c->rx_tag;
	if (tagged) {
		uint8_t tag[EPD_TAG];
		struct iovec iov = {(void *)f, EPP_HDR_SIZE + h->length};
		epd_frame_tag(c->krx, c->nrx++, &iov, 1, tag);
		if (crypto_verify_16(tag, f + EPP_HDR_SIZE + h->length)) {
			reject(c, "a %s frame failed authentication "
				  "(changed, replayed or injected)",
			       epp_type_name(h->type));
			return 1;
		}
	}
	conn_frame(c, h, f + EPP_HDR_SIZE);
	return c->closing ? 1 : c->rx_tag != tagged ? 2 : 0;
}

/* The frames received (bytes from any transport). */
static void conn_parse(struct pconn *c)
{
	/* any bytes show the peer alive, also the middle of a long frame
	 * (heartbeats queue behind rows on this connection) */
	if (c->authed)
		c->cl->node[c->peer].last_rx_ns = epd_now_ns();
	struct epp_hdr h;
	char err[160];
	size_t want;
	int rc;
	do
		rc = epp_frames(&c->rb, c->rx_tag ? EPD_TAG : 0, peer_frame, c,
				&h, err, sizeof(err), &want);
	while (rc == 2 && !c->closing);
	if (c->closing)
		return;
	if (rc < 0) {
		reject(c, "%s", err);
		return;
	}
	/* a frame still arriving: it will fit where it starts */
	if (want &&
	    epp_rbuf_room(&c->rb, want - epp_rbuf_live(&c->rb), 8192))
		conn_close(c, "out of memory");
}

/* Dial node nd again later, later each time (from first_ns to 1 s: a
 * node that restarts after a run of refused dials, e.g. with the wrong key
 * first, is back within a second, not after the 5 s a longer backoff
 * reached; a refused dial costs one connection attempt). */
#define DIAL_BACKOFF_MAX_NS 1000000000ull
static void dial_later(struct cnode *nd, uint64_t first_ns)
{
	nd->backoff_ns = nd->backoff_ns ? nd->backoff_ns * 2 : first_ns;
	if (nd->backoff_ns > DIAL_BACKOFF_MAX_NS)
		nd->backoff_ns = DIAL_BACKOFF_MAX_NS;
	nd->next_dial_ns = epd_now_ns() + nd->backoff_ns;
}

static void conn_freed(uv_handle_t *hd)
{
	struct pconn *c = hd->data;
	epp_rbuf_free(&c->rb);
	free(c);
}

static void conn_close(struct pconn *c, const char *why)
{
	if (c->closing)
		return;
	c->closing = true;
	struct epd_cluster *cl = c->cl;
	list_del(&c->node);
	int n = c->peer >= 0 ? c->peer : c->target;
	if (c->target >= 0 && !c->authed) {
		/* a dial that failed: try again later, slower each time */
		struct cnode *t = &cl->node[c->target];
		dial_later(t, (uint64_t)cl->srv->cfg.heartbeat_ms * 1000000ull);
		snprintf(t->why, sizeof(t->why), "%s", why);
	}
	if (n >= 0 && cl->node[n].conn == c) {
		cl->node[n].conn = NULL;
		if (cl->node[n].state == NODE_UP)
			node_down(cl, n, why);
	}
	if (c->tc)
		cl->tops->close(c->tc);
	c->tc = NULL;
	/* freed from the loop's next turn: a caller up the stack (the
	 * frame loop) may still look at c */
	uv_close((uv_handle_t *)&c->reap, conn_freed);
}

static struct pconn *conn_new(struct epd_cluster *cl)
{
	struct pconn *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->cl = cl;
	c->peer = c->target = -1;
	c->born_ns = epd_now_ns();
	uv_timer_init(cl->srv->loop, &c->reap);
	c->reap.data = c;
	list_add_tail(&cl->conns, &c->node);
	return c;
}

/* The transport's callbacks (transport.h). */
static void *tr_accept(void *arg, struct epd_tconn *tc, const char *addr,
		       const void *pdata, uint8_t len, char *reason,
		       size_t rlen)
{
	struct epd_cluster *cl = arg;
	uint32_t idx = 0;
	const char *why =
		cl->stopping ? "stopping"
		: cl->tops->pdata
			? epd_pdata_check(cl->key, cl->cluster_id, cl->n,
					  cl->self, pdata, len, &idx)
			: NULL;
	if (why) {
		note_rejection(cl, addr, why);
		snprintf(reason, rlen, "%s", why);
		return NULL;
	}
	struct pconn *c = conn_new(cl);
	if (!c) {
		snprintf(reason, rlen, "out of memory");
		return NULL;
	}
	c->tc = tc;
	if (cl->tops->pdata)
		snprintf(c->addr, sizeof(c->addr), "%s, node %u", addr, idx);
	else
		snprintf(c->addr, sizeof(c->addr), "%s", addr);
	return c;
}

static void tr_established(void *arg, void *user)
{
	(void)arg;
	send_hello(user);
}

static uint8_t *tr_rx_buf(void *arg, void *user, size_t want, size_t *room)
{
	struct pconn *c = user;
	(void)arg;
	if (c->closing || epp_rbuf_room(&c->rb, want, 8192))
		return NULL;
	*room = c->rb.cap - c->rb.len;
	return c->rb.p + c->rb.len;
}

static void tr_rx(void *arg, void *user, size_t n)
{
	struct pconn *c = user;
	(void)arg;
	if (c->closing)
		return;
	c->rb.len += n;
	conn_parse(c);
}

static void tr_closed(void *arg, void *user, const char *why)
{
	struct pconn *c = user;
	(void)arg;
	c->tc = NULL; /* gone already */
	/* our dial refused: the other side logged why, and so do we */
	if (c->target >= 0 && !strncmp(why, "rejected by the peer", 20)) {
		char who[96];
		snprintf(who, sizeof(who), "to node %s",
			 c->cl->node[c->target].name);
		note_rejection(c->cl, who, why);
	}
	if (c->target >= 0 && !c->authed)
		epd_debug("dialling node %s: %s", c->cl->node[c->target].name,
			  why);
	conn_close(c, why);
}

/* A peer's rows for an op are placed (its last write's immediate). */
static void tr_imm(void *arg, void *user, uint32_t imm)
{
	struct epd_cluster *cl = arg;
	struct pconn *c = user;
	if (c->authed && !c->closing)
		epd_xop_imm(cl->srv, (uint32_t)c->peer, imm);
}

/* Our writes of an op to that peer completed. */
static void tr_written(void *arg, void *user, uint64_t cookie)
{
	struct epd_cluster *cl = arg;
	struct pconn *c = user;
	if (c->authed && !c->closing)
		epd_xop_written(cl->srv, (uint32_t)c->peer, cookie);
}

static const struct epd_transport_cb tr_cb = {
	.accept = tr_accept,
	.established = tr_established,
	.rx_buf = tr_rx_buf,
	.rx = tr_rx,
	.closed = tr_closed,
	.imm = tr_imm,
	.written = tr_written,
};

static void dial_addr(struct epd_cluster *cl, int n,
		      const struct sockaddr_storage *sa);

struct resolving {
	uv_getaddrinfo_t req;
	struct epd_cluster *cl;
	int n;
};

/* A peer named by host name is resolved anew at every dial, so a node
 * that comes back at another address is found. */
static void on_resolved(uv_getaddrinfo_t *req, int status,
			struct addrinfo *res)
{
	struct resolving *r = req->data;
	struct epd_cluster *cl = r->cl;
	struct cnode *nd = &cl->node[r->n];
	nd->resolving = false;
	struct sockaddr_storage sa;
	int rc = status ? status : first_addr(res, nd->port, &sa);
	uv_freeaddrinfo(res);
	if (cl->stopping || nd->conn || nd->state == NODE_UP) {
		free(r);
		return;
	}
	if (rc) {
		epd_warn("node %s: cannot resolve host '%s': %s", nd->name,
			 nd->host,
			 status ? uv_strerror(status) : "no IPv4/IPv6 address");
		free(r);
		dial_later(nd, 100000000ull); /* 100 ms, then slower */
		return;
	}
	int n = r->n;
	free(r);
	dial_addr(cl, n, &sa);
}

static void dial(struct epd_cluster *cl, int n)
{
	struct cnode *nd = &cl->node[n];
	struct sockaddr_storage sa;
	if (!resolve(nd->host, nd->port, &sa)) {
		dial_addr(cl, n, &sa);
		return;
	}
	if (nd->resolving)
		return;
	struct resolving *r = malloc(sizeof(*r));
	if (!r)
		return;
	r->cl = cl;
	r->n = n;
	r->req.data = r;
	int rc = uv_getaddrinfo(cl->srv->loop, &r->req, on_resolved, nd->host,
				NULL, &resolve_hints);
	if (rc) {
		epd_warn("node %s: cannot resolve host '%s': %s", nd->name,
			 nd->host, uv_strerror(rc));
		free(r);
		return;
	}
	nd->resolving = true;
}

static void dial_addr(struct epd_cluster *cl, int n,
		      const struct sockaddr_storage *sa)
{
	struct cnode *nd = &cl->node[n];
	struct pconn *c = conn_new(cl);
	if (!c)
		return;
	c->target = n;
	snprintf(c->addr, sizeof(c->addr), "%s%s%s:%d",
		 strcmp(cl->tops->name, "tcp") ? cl->tops->name : "",
		 strcmp(cl->tops->name, "tcp") ? " " : "", nd->host, nd->port);
	nd->conn = c;
	uint8_t pd[EPD_PDATA_LEN];
	size_t pl = cl->tops->pdata ? epd_pdata_make(cl->key, cl->cluster_id,
						     (uint32_t)cl->self, pd)
				    : 0;
	c->tc = cl->tops->dial(cl->tr, (const struct sockaddr *)sa, pd,
			       (uint8_t)pl, c);
	if (!c->tc) {
		const char *gone = cl->tops->down_why(cl->tr);
		char why[160];
		snprintf(why, sizeof(why), "%s dial failed%s%s%s",
			 cl->tops->name, gone ? " (" : "", gone ? gone : "",
			 gone ? ")" : "");
		conn_close(c, why);
	}
}

/* This node's row of the matrix: S self, U up, D down. */
static void my_row(const struct epd_cluster *cl, char *row)
{
	for (int n = 0; n < cl->n; n++)
		row[n] = cl->node[n].state == NODE_SELF ? 'S'
			 : cl->node[n].state == NODE_UP ? 'U'
							: 'D';
	row[cl->n] = 0;
}

static void on_tick(uv_timer_t *t)
{
	struct epd_cluster *cl = t->data;
	const struct epd_config *cfg = &cl->srv->cfg;
	uint64_t now = epd_now_ns();
	uint64_t silent = (uint64_t)cfg->heartbeat_ms * cfg->heartbeat_miss *
			  1000000ull;
	uint8_t buf[8 + 2 + MAX_NODES];
	struct epp_peer_heartbeat hb = {.epoch = cl->epoch};
	my_row(cl, hb.row);
	size_t hbn = epp_peer_heartbeat_encode(&hb, buf, sizeof(buf));
	/* handshakes that never finish */
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &cl->conns)
	{
		struct pconn *c = LIST_ENTRY(it, struct pconn, node);
		if (!c->authed && now - c->born_ns > silent)
			reject(c, "no handshake within %u ms",
			       (unsigned)(silent / 1000000));
	}
	for (int n = 0; n < cl->n; n++) {
		struct cnode *nd = &cl->node[n];
		if (n == cl->self)
			continue;
		if (nd->state == NODE_UP && now - nd->last_rx_ns > silent) {
			char why[64];
			snprintf(why, sizeof(why), "silent for %u ms",
				 (unsigned)((now - nd->last_rx_ns) / 1000000));
			conn_close(nd->conn, why);
			continue;
		}
		if (nd->state == NODE_UP)
			conn_send(nd->conn, EPP_PEER_HEARTBEAT, buf,
				  (uint32_t)hbn);
		else if (n > cl->self && !nd->conn && now >= nd->next_dial_ns)
			dial(cl, n);
	}
}

static bool addr_loopback(const struct sockaddr_storage *sa)
{
	if (sa->ss_family == AF_INET)
		return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >>
			24) == 127;
	if (sa->ss_family == AF_INET6)
		return IN6_IS_ADDR_LOOPBACK(
			&((const struct sockaddr_in6 *)sa)->sin6_addr);
	return false;
}

/* The first node whose host is a loopback address (by literal or by
 * name), or -1. */
static int loopback_node(const struct epd_cluster *cl)
{
	for (int i = 0; i < cl->n; i++) {
		struct sockaddr_storage sa;
		const struct cnode *nd = &cl->node[i];
		if (!resolve(nd->host, nd->port, &sa)) {
			if (addr_loopback(&sa))
				return i;
			continue;
		}
		struct addrinfo *res = NULL;
		if (getaddrinfo(nd->host, NULL, &resolve_hints, &res) == 0 &&
		    !first_addr(res, nd->port, &sa) && addr_loopback(&sa)) {
			freeaddrinfo(res);
			return i;
		}
		if (res)
			freeaddrinfo(res);
	}
	return -1;
}

/* Can transport t carry this cluster? why: what was found, or why not. */
static bool transport_usable(const struct epd_cluster *cl,
			     const struct epd_transport_ops *t, char *why,
			     size_t wl)
{
	if (!t->available(why, wl))
		return false;
	int lo = t->no_loopback ? loopback_node(cl) : -1;
	if (lo >= 0) {
		snprintf(why, wl,
			 "node %s is on a loopback address (%s), which the "
			 "%s transport cannot route (ENODEV)",
			 cl->node[lo].name, cl->node[lo].host, t->name);
		return false;
	}
	return true;
}

/* `transport`: a named one (it must work here), or auto: the first in
 * epd_transports that can carry the cluster (rdma before tcp), saying
 * why the ones before it could not. */
static int pick_transport(struct epd_cluster *cl, const char *name,
			  char *err, size_t errlen)
{
	char why[160];
	if (strcmp(name, "auto")) {
		const struct epd_transport_ops *t = epd_transport_find(name);
		if (!t) {
			snprintf(err, errlen,
				 "transport %s: not in this build (epd was "
				 "built without its libraries)",
				 name);
			return -1;
		}
		if (!transport_usable(cl, t, why, sizeof(why))) {
			snprintf(err, errlen, "transport %s: %s", name, why);
			return -1;
		}
		cl->tops = t;
		snprintf(cl->transport_why, sizeof(cl->transport_why),
			 "transport = %s", name);
		return 0;
	}
	char skipped[256] = "";
	for (int i = 0; epd_transports[i]; i++) {
		const struct epd_transport_ops *t = epd_transports[i];
		if (transport_usable(cl, t, why, sizeof(why))) {
			cl->tops = t;
			if (skipped[0])
				memcpy(cl->transport_why, skipped,
				       sizeof(skipped));
			else
				snprintf(cl->transport_why,
					 sizeof(cl->transport_why), "%.15s: %s",
					 t->name, why);
			return 0;
		}
		char one[192];
		snprintf(one, sizeof(one), "not %.15s: %s", t->name, why);
		size_t off = strlen(skipped);
		if (off + strlen(one) + 3 < sizeof(skipped))
			sprintf(skipped + off, "%s%s", off ? "; " : "", one);
	}
	snprintf(err, errlen, "no transport: %s", skipped);
	return -1;
}

static const struct epd_span_ops span_ops;

int epd_cluster_init(struct epd_server *srv, char *err, size_t errlen)
{
	const struct epd_config *cfg = &srv->cfg;
	if (!cfg->peers[0])
		return 0;
	if (sodium_init() < 0) {
		snprintf(err, errlen, "libsodium failed to initialize");
		return -1;
	}
	struct epd_cluster *cl = calloc(1, sizeof(*cl));
	struct epd_xnode *xn = calloc(1, sizeof(*xn));
	if (!cl || !xn) {
		snprintf(err, errlen, "out of memory");
		free(cl);
		free(xn);
		return -1;
	}
	LIST_INIT(&xn->xstash);
	LIST_INIT(&xn->xzombies);
	cl->srv = srv;
	LIST_INIT(&cl->conns);
	if (parse_peers(cl, cfg->peers, cfg->node_name, err, errlen))
		goto err;
	if (pick_transport(cl, cfg->transport, err, errlen))
		goto err;
	if (!cfg->cluster_key_file[0]) {
		snprintf(err, errlen, "peers given but no cluster_key_file");
		goto err;
	}
	if (load_key(cl, cfg->cluster_key_file, err, errlen))
		goto err;
	epd_cluster_id(cl->key, cl->cluster_id);
	cl->node[cl->self].state = NODE_SELF;
	struct sockaddr_storage sa;
	struct cnode *me = &cl->node[cl->self];
	if (resolve(me->host, me->port, &sa)) {
		/* a name: resolved once, here, to the address to listen on */
		struct addrinfo *res = NULL;
		int rc = getaddrinfo(me->host, NULL, &resolve_hints, &res);
		if (rc || first_addr(res, me->port, &sa)) {
			snprintf(err, errlen,
				 "host '%s' of this node does not resolve: %s",
				 me->host,
				 rc ? gai_strerror(rc) : "no IPv4/IPv6 address");
			if (res)
				freeaddrinfo(res);
			goto err;
		}
		freeaddrinfo(res);
	}
	cl->tr = cl->tops->open(srv->loop, &tr_cb, cl, err, errlen);
	if (!cl->tr)
		goto err;
	char lerr[160];
	if (cl->tops->listen(cl->tr, (struct sockaddr *)&sa, lerr,
			     sizeof(lerr))) {
		snprintf(err, errlen, "peer port %s:%d (%s): %s", me->host,
			 me->port, cl->tops->name, lerr);
		cl->tops->free(cl->tr);
		goto err;
	}
	uv_timer_init(srv->loop, &cl->tick);
	cl->tick.data = cl;
	uv_timer_start(&cl->tick, on_tick, 1, cfg->heartbeat_ms);
	srv->cluster = cl;
	srv->xnode = xn;
	srv->span = &span_ops;
	epd_notice("cluster: node %s, index %d of %d, %s on %s:%d, "
		   "heartbeat %u ms x %u%s%s",
		   me->name, cl->self, cl->n, cl->tops->name, me->host,
		   me->port, cfg->heartbeat_ms, cfg->heartbeat_miss, "; ",
		   cl->transport_why);
	return 0;
err:
	free(cl);
	free(xn);
	return -1;
}

void epd_cluster_stop(struct epd_server *srv)
{
	struct epd_cluster *cl = srv->cluster;
	if (!cl)
		return;
	cl->stopping = true; /* pending name lookups end without dialling */
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &cl->conns)
	{
		struct pconn *c = LIST_ENTRY(it, struct pconn, node);
		c->cl->node[c->peer >= 0 ? c->peer : c->target].state =
			NODE_DOWN; /* no group failures while stopping */
		conn_close(c, "daemon stopping");
	}
	uv_close((uv_handle_t *)&cl->tick, NULL);
	cl->tops->free(cl->tr);
	cl->tr = NULL;
}

void epd_cluster_free(struct epd_server *srv)
{
	free(srv->cluster);
	free(srv->xnode);
	srv->cluster = NULL;
	srv->xnode = NULL;
	srv->span = NULL;
}

static int span_self(const struct epd_server *srv)
{
	return srv->cluster ? srv->cluster->self : 0;
}

static int span_size(const struct epd_server *srv)
{
	return srv->cluster ? srv->cluster->n : 1;
}

static int span_arrival(struct epd_group *g, uint32_t l, uint64_t seq)
{
	struct epd_cluster *cl = g->srv->cluster;
	uint8_t buf[128];
	struct epp_peer_barrier m = {.local = l, .seq = seq};
	snprintf(m.group, sizeof(m.group), "%s", g->key);
	size_t bn = epp_peer_barrier_encode(&m, buf, sizeof(buf));
	for (uint32_t n = 0; n < g->nnodes; n++) {
		if ((int)n == cl->self)
			continue;
		struct cnode *nd = &cl->node[n];
		if (nd->state != NODE_UP) {
			epd_group_fail(g, EP_EPEERLOST,
				       "node %s (index %u) is down%s%s",
				       nd->name, n, nd->why[0] ? ": " : "",
				       nd->why);
			return EP_EPEERLOST;
		}
		conn_send(nd->conn, EPP_PEER_BARRIER, buf, (uint32_t)bn);
	}
	return 0;
}

void *epd_cluster_status(struct epd_server *srv)
{
	struct epd_cluster *cl = srv->cluster;
	if (!cl)
		return NULL;
	json_t *peers = json_array(), *matrix = json_array();
	char row[MAX_NODES + 1];
	uint64_t now = epd_now_ns();
	/* one row per node: ours now, the others' from their last beat
	 * ('?' where none came) */
	for (int n = 0; n < cl->n; n++) {
		char r[MAX_NODES + 1];
		if (n == cl->self)
			my_row(cl, r);
		else if (cl->node[n].state == NODE_UP && cl->node[n].row[0])
			memcpy(r, cl->node[n].row, sizeof(r));
		else {
			memset(r, '?', (size_t)cl->n);
			r[cl->n] = 0;
		}
		json_array_append_new(matrix, json_string(r));
	}
	for (int n = 0; n < cl->n; n++) {
		struct cnode *nd = &cl->node[n];
		const char *st = nd->state == NODE_SELF ? "self"
				 : nd->state == NODE_UP ? "up"
							: "down";
		row[n] = nd->state == NODE_SELF ? 'S'
			 : nd->state == NODE_UP ? 'U'
						: 'D';
		char addr[80];
		snprintf(addr, sizeof(addr), "%s:%d", nd->host, nd->port);
		json_array_append_new(
			peers,
			json_pack("{s:i, s:s, s:s, s:s, s:s, s:s, s:I, s:I, s:f, "
				  "s:s, s:s}",
				  "index", n, "name", nd->name, "addr", addr,
				  "state", st, "transport",
				  n == cl->self ? "-"
				  : cl->tops->name,
				  "transport_reason", cl->transport_why,
				  "view_epoch",
				  (json_int_t)(n == cl->self ? cl->epoch
							     : nd->epoch),
				  "downs", (json_int_t)nd->downs,
				  "since_s",
				  nd->since_ns ? (double)(now - nd->since_ns) /
							 1e9
					       : 0.0,
				  "last_error", nd->why,
				  /* how dispatch rows reach that node: by
				   * RDMA WRITE where its connection shares
				   * this node's protection domain (the first
				   * device), else as frames */
				  "rows",
				  n == cl->self ? "-"
				  : epd_cluster_wconn(cl->srv, (uint32_t)n)
					  ? "rdma-write"
					  : "frames"));
	}
	row[cl->n] = 0;
	json_t *o = json_pack("{s:s, s:i, s:i, s:I, s:s, s:s, s:I, s:o, s:o}",
			      "node", cl->node[cl->self].name, "index", cl->self,
			      "nodes", cl->n, "view_epoch", (json_int_t)cl->epoch,
			      "transport", cl->tops->name, "row", row,
			      "rejected", (json_int_t)cl->rejected, "peers",
			      peers, "matrix", matrix);
	if (o)
		json_object_set_new(o, "transport_reason",
				    json_string(cl->transport_why));
	if (o && cl->reject_ns)
		json_object_set_new(
			o, "last_rejection",
			json_pack("{s:s, s:s, s:f}", "peer", cl->reject_addr,
				  "why", cl->reject_why, "age_s",
				  (double)(now - cl->reject_ns) / 1e9));
	if (o && cl->tops->stats && cl->tr) {
		/* rows written by the proxy, in how many batches */
		uint64_t batches,
			writes = cl->tops->stats(cl->tr, &batches);
		json_object_set_new(o, "rdma_writes",
				    json_pack("{s:I, s:I}", "posted",
					      (json_int_t)writes, "batches",
					      (json_int_t)batches));
	}
	return o;
}

/* Tell the group's other nodes it failed here. */
static void group_failed(struct epd_group *g, int code, const char *msg)
{
	struct epd_cluster *cl = g->srv->cluster;
	uint8_t buf[EPP_ERRMSG_MAX + 128];
	if (!cl)
		return;
	/* How far this node got: the barriers it completed (every local rank
	 * entered them, so their arrivals went out) and the data ops it
	 * completed (their rows went out). The others may finish up to there;
	 * a rank that died never entered the next round. */
	struct epp_peer_gfail m = {.code = code, .round = g->round,
				   .xops = g->xop_next};
	snprintf(m.group, sizeof(m.group), "%s", g->key);
	snprintf(m.msg, sizeof(m.msg), "%s", msg);
	size_t gn = epp_peer_gfail_encode(&m, buf, sizeof(buf));
	for (uint32_t n = 0; n < g->nnodes; n++)
		if ((int)n != cl->self && cl->node[n].state == NODE_UP)
			conn_send(cl->node[n].conn, EPP_PEER_GFAIL, buf,
				  (uint32_t)gn);
}

void epd_cluster_send(struct epd_group *g, uint32_t n, uint16_t type,
		      const void *a, size_t na, const void *b, size_t nb,
		      struct epd_sref *ref)
{
	struct epd_cluster *cl = g->srv->cluster;
	if (!cl || (int)n >= cl->n || cl->node[n].state != NODE_UP)
		return;
	conn_write(cl->node[n].conn, type, a, na, b, nb, ref);
}

struct epd_transport *epd_cluster_transport(const struct epd_server *srv)
{
	struct epd_cluster *cl = srv->cluster;
	return cl && cl->tops->write ? cl->tr : NULL;
}

struct epd_tconn *epd_cluster_wconn(const struct epd_server *srv, uint32_t n)
{
	struct epd_cluster *cl = srv->cluster;
	if (!cl || !cl->tops->write || !cl->tr || (int)n >= cl->n ||
	    cl->node[n].state != NODE_UP)
		return NULL;
	struct pconn *c = cl->node[n].conn;
	return c && c->authed && c->tc && c->minor >= 6 &&
			       cl->tops->can_write(c->tc)
		       ? c->tc
		       : NULL;
}

const char *epd_cluster_node_name(const struct epd_server *srv, uint32_t n)
{
	struct epd_cluster *cl = srv->cluster;
	return cl && (int)n < cl->n ? cl->node[n].name : "local";
}

static void span_failed(struct epd_group *g, int code, const char *msg,
			bool tell)
{
	if (tell)
		group_failed(g, code, msg);
	epd_xop_drop(g); /* a running job is dropped when it ends */
}

static void span_ready(struct epd_group *g)
{
	epd_xop_announce(g); /* its shape to the others, who compare */
	epd_xop_replay(g);   /* what came before it was ready here */
}

static void span_freed(struct epd_group *g)
{
	epd_xop_drop(g);
	epd_xbufs_trim(g->srv);
	epd_xwin_free(g);
}

static const struct epd_span_ops span_ops = {
	.self = span_self,
	.size = span_size,
	.arrival = span_arrival,
	.op_start = epd_xop_start,
	.missing = epd_xop_missing,
	.ready = span_ready,
	.failed = span_failed,
	.freed = span_freed,
	.node_name = epd_cluster_node_name,
};
