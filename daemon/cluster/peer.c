/* SPDX-License-Identifier: MIT */
/*
 * The cluster (cluster_int.h): one connection to another node. Its
 * handshake (HELLO, AUTH), its authenticated frames in and out, the
 * transport's callbacks, and dialling (with backoff and name lookups).
 */
#include "cluster_int.h"

static void sref_done(void *ref)
{
	epd_sref_put(ref);
}

/* One frame: header, a and the tag copied; b copied too, or with ref
 * sent from where it is, ref held until the transport is done with it. */
void cl_conn_write(struct pconn *c, uint16_t type, const void *a,
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
		cl_conn_close(c, "send failed");
	}
}

void cl_conn_send(struct pconn *c, uint16_t type, const void *p,
		      uint32_t len)
{
	cl_conn_write(c, type, p, len, NULL, 0, NULL);
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
	cl_conn_send(c, EPP_PEER_HELLO, buf, (uint32_t)n);
}

void cl_reject(struct pconn *c, const char *fmt, ...)
{
	char msg[256];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	cl_note_rejection(c->cl, c->addr, msg);
	cl_conn_close(c, msg);
}

static void on_hello(struct pconn *c, const uint8_t *p, uint32_t len)
{
	struct epd_cluster *cl = c->cl;
	struct epp_peer_hello m;
	if (epp_peer_hello_decode(p, len, &m))
		return cl_reject(c, "malformed hello");
	epp_printable(m.node); /* named in the log and the status below */
	uint16_t major = m.major, minor = m.minor;
	const char *name = m.node;
	uint32_t idx = m.index;
	memcpy(c->peer_nonce, m.nonce, NONCE);
	if (major != EPP_VERSION_MAJOR || minor < 7)
		return cl_reject(c, "it speaks protocol %u.%u, this node %u.%u "
				 "(1.7 or later: bound proofs, authenticated "
				 "frames)",
			      major, minor, EPP_VERSION_MAJOR,
			      EPP_VERSION_MINOR);
	if (cl_static(cl)) {
		/* one table everywhere: the name at its index of peers */
		if (idx >= (uint32_t)cl->n || (int)idx == cl->self ||
		    strcmp(cl->node[idx].name, name))
			return cl_reject(c,
					 "node '%s' (index %u) is not in peers",
					 name, idx);
	} else {
		/* each node's own table: by name. A node not in it is learnt
		 * only once its proof of the cluster key checks out (on_auth):
		 * a peer without the key adds nothing to the table. */
		int n = cl_node_find(cl, name);
		if (n == cl->self || !epp_node_name_valid(name))
			return cl_reject(c, "node '%s' is not another node's "
					 "name", name);
		if (c->target >= 0 && n != c->target)
			return cl_reject(c, "node %s answered for %s", name,
					 cl->node[c->target].name);
		if (n < 0) {
			/* one connection a pair: the lower name dials */
			if (strcmp(cl->node[cl->self].name, name) < 0)
				return cl_reject(c, "node %s dialled the "
						 "wrong way", name);
			snprintf(c->unknown, sizeof(c->unknown), "%s", name);
		}
		idx = (uint32_t)n;
	}
	/* one connection a pair: the node that dials (cl_dials) */
	if (!c->unknown[0] &&
	    (c->target >= 0 ? (int)idx != c->target : cl_dials(cl, (int)idx)))
		return cl_reject(c, "node %s dialled the wrong way", name);
	c->peer = c->unknown[0] ? -1 : (int)idx;
	c->minor = minor;
	c->got_hello = true;
	/* The rdma passive side may receive the dialler's hello before its
	 * own ESTABLISHED event (where it sends its hello): ours first, with
	 * the nonce the proof below is bound to. */
	send_hello(c);
	const char *me = cl->node[cl->self].name,
		   *it = c->unknown[0] ? c->unknown : cl->node[idx].name;
	epd_peer_key(cl->key, me, it, c->nonce, c->peer_nonce, c->ktx);
	epd_peer_key(cl->key, it, me, c->peer_nonce, c->nonce, c->krx);
	uint8_t mac[EPD_PROOF];
	epd_peer_proof(cl->key, me, it, c->nonce, c->peer_nonce, mac);
	cl_conn_send(c, EPP_PEER_AUTH, mac, EPD_PROOF);
	c->tx_tag = true; /* every frame after our proof */
}

static void on_auth(struct pconn *c, const uint8_t *p, uint32_t len)
{
	struct epd_cluster *cl = c->cl;
	if (!c->got_hello || len != EPD_PROOF)
		return cl_reject(c, "authentication out of order");
	const char *it = c->unknown[0] ? c->unknown : cl->node[c->peer].name;
	uint8_t want[EPD_PROOF];
	epd_peer_proof(cl->key, it, cl->node[cl->self].name, c->peer_nonce,
		       c->nonce, want);
	if (crypto_verify_32(want, p))
		return cl_reject(c, "node %s: wrong cluster key, or a proof made "
				 "for another connection",
			      it);
	if (c->unknown[0]) {
		/* proven: learnt now (another connection of it may have been
		 * first) */
		char err[160];
		int n = cl_node_find(cl, c->unknown);
		if (n < 0 && (n = cl_node_add(cl, c->unknown, c->host, 0, err,
					      sizeof(err))) < 0)
			return cl_reject(c, "node %s: %s", c->unknown, err);
		c->peer = n;
		c->unknown[0] = 0;
	}
	c->rx_tag = true; /* every frame after its proof */
	c->authed = true;
	if (c->target >= 0) {
		/* we dialled: up at its first frame after this, which it
		 * sends once it checked our proof */
		c->await_up = true;
		return;
	}
	cl_node_up(c);
	cl_send_beat(c); /* the dialler takes the node as up on it */
}

static void on_barrier(struct pconn *c, const uint8_t *p, uint32_t len)
{
	struct epp_peer_barrier m;
	if (epp_peer_barrier_decode(p, len, &m))
		return cl_reject(c, "malformed barrier");
	epd_xop_arrival(c->cl->srv, (uint32_t)c->peer, &m, p, len);
}

static void on_heartbeat(struct pconn *c, const uint8_t *p, uint32_t len)
{
	struct cnode *nd = &c->cl->node[c->peer];
	struct epp_peer_heartbeat m;
	/* a row of every node, or none from a cluster too large for the
	 * matrix */
	const size_t rl = epp_peer_heartbeat_decode(p, len, &m)
				  ? SIZE_MAX
				  : strlen(m.row);
	if (rl != (c->cl->n > MATRIX_MAX || !cl_static(c->cl)
			   ? 0
			   : (size_t)c->cl->n))
		return cl_reject(c, "malformed heartbeat");
	nd->epoch = m.epoch;
	memcpy(nd->row, m.row, sizeof(nd->row));
}

static void conn_frame(struct pconn *c, const struct epp_hdr *h,
		       const uint8_t *p)
{
	if (c->authed)
		c->cl->node[c->peer].last_rx_ns = epd_now_ns();
	if (c->await_up) {
		/* the acceptor's first frame after its proof: it checked
		 * ours, and the node is up on both ends */
		c->await_up = false;
		cl_node_up(c);
		if (c->closing)
			return;
	}
	switch (h->type) {
	case EPP_PEER_HELLO:
		if (c->got_hello)
			return cl_reject(c, "second hello");
		return on_hello(c, p, h->length);
	case EPP_PEER_AUTH:
		if (c->authed)
			return cl_reject(c, "second authentication");
		return on_auth(c, p, h->length);
	case EPP_PEER_GFAIL: {
		if (!c->authed)
			return cl_reject(c, "%s before authentication",
				      epp_type_name(h->type));
		struct epp_peer_gfail m;
		if (epp_peer_gfail_decode(p, h->length, &m))
			return cl_reject(c, "malformed group failure");
		epp_printable(m.msg); /* for the log, the status, the ranks */
		epd_xop_failure(c->cl->srv, (uint32_t)c->peer, &m,
				c->cl->node[c->peer].name);
		return;
	}
	case EPP_PEER_XMETA:
	case EPP_PEER_XROWS:
	case EPP_PEER_GSHAPE:
	case EPP_PEER_XWIN:
		if (!c->authed)
			return cl_reject(c, "%s before authentication",
				      epp_type_name(h->type));
		epd_xop_frame(c->cl->srv, h->type, (uint32_t)c->peer, p,
			      h->length);
		return;
	case EPP_PEER_BYE:
		if (!c->authed)
			return cl_reject(c, "%s before authentication",
				      epp_type_name(h->type));
		if (h->length != 1 || p[0] > EPP_BYE_NO)
			return cl_reject(c, "malformed bye");
		cl_bye(c, p[0]);
		return;
	case EPP_PEER_HEARTBEAT:
	case EPP_PEER_BARRIER:
		if (!c->authed)
			return cl_reject(c, "%s before authentication",
				      epp_type_name(h->type));
		if (h->type == EPP_PEER_BARRIER)
			on_barrier(c, p, h->length);
		else
			on_heartbeat(c, p, h->length);
		return;
	default:
		return cl_reject(c, "unexpected %s frame (type %u)",
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
			cl_reject(c, "a %s frame failed authentication "
				  "(changed, replayed or injected)",
			       epp_type_name(h->type));
			return 1;
		}
	}
	conn_frame(c, h, f + EPP_HDR_SIZE);
	return c->closing ? 1 : c->rx_tag != tagged ? 2 : 0;
}

/* The payload of a frame before authentication: hello (versions, a node
 * name of at most 63 bytes, an index, a nonce) or authentication (a MAC). */
#define PREAUTH_PAYLOAD_MAX 256u

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
		cl_reject(c, "%s", err);
		return;
	}
	/* Before its proof, a peer sends a hello and an authentication of
	 * a few dozen bytes: a longer frame is refused before any buffer
	 * grows for it (an unauthenticated sender holds no more memory than
	 * this, times peer_handshakes_max connections). */
	if (!c->authed && want > EPP_HDR_SIZE + PREAUTH_PAYLOAD_MAX) {
		cl_reject(c, "a frame of %zu bytes before authentication (at "
			  "most %u)", want - EPP_HDR_SIZE,
			  PREAUTH_PAYLOAD_MAX);
		return;
	}
	/* a frame still arriving: it will fit where it starts */
	if (want &&
	    epp_rbuf_room(&c->rb, want - epp_rbuf_live(&c->rb), 8192))
		cl_conn_close(c, "out of memory");
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

void cl_conn_close(struct pconn *c, const char *why)
{
	if (c->closing)
		return;
	c->closing = true;
	struct epd_cluster *cl = c->cl;
	list_del(&c->node);
	int n = cl_conn_node(c);
	if (c->target >= 0 && (!c->authed || c->await_up)) {
		/* a dial that failed (before the other end took it): try
		 * again later, slower each time */
		struct cnode *t = &cl->node[c->target];
		dial_later(t, (uint64_t)cl->srv->cfg.heartbeat_ms * 1000000ull);
		snprintf(t->why, sizeof(t->why), "%s", why);
	}
	if (n >= 0 && cl->node[n].conn == c) {
		cl->node[n].conn = NULL;
		if (cl->node[n].state == NODE_UP)
			cl_node_down(cl, n, why);
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

/* Inbound connections that have not proven the key are capped, from one
 * host (peer_handshakes_per_host) and in all (peer_handshakes_max): over a
 * cap, the oldest such connection (that host's first) is dropped for the
 * new one. A flood of connections to the cluster port then holds a bounded
 * number of descriptors and buffers, it cannot starve the node's ranks of
 * descriptors, and a real peer, whose handshake takes a round trip or
 * two, still gets in: a flood from one host displaces only its own
 * connections. */
static void cap_handshakes(struct epd_cluster *cl, const char *host)
{
	const struct epd_limits *lim = &cl->srv->cfg.limits;
	struct pconn *oldest = NULL, *oldest_here = NULL;
	uint32_t n = 0, here = 0;
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &cl->conns)
	{
		struct pconn *c = LIST_ENTRY(it, struct pconn, node);
		if (c->target >= 0 || c->authed || c->closing)
			continue;
		/* the list is in the order connections came */
		if (!oldest)
			oldest = c;
		n++;
		if (!strcmp(c->host, host)) {
			if (!oldest_here)
				oldest_here = c;
			here++;
		}
	}
	if (here >= lim->handshakes_per_host)
		cl_reject(oldest_here, "displaced: %u unauthenticated "
			  "connections from %s (peer_handshakes_per_host)",
			  here + 1, host);
	else if (n >= lim->handshakes)
		cl_reject(oldest, "displaced: %u unauthenticated connections "
			  "(peer_handshakes_max)", n + 1);
}

/* The host part of "address:port". */
static void host_of(const char *addr, char *host, size_t cap)
{
	snprintf(host, cap, "%s", addr);
	char *colon = strrchr(host, ':');
	if (colon)
		*colon = 0;
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
			? epd_pdata_check(cl->key, cl->cluster_id,
					  cl_static(cl) ? cl->n : INT32_MAX,
					  cl_static(cl) ? cl->self : -1,
					  pdata, len, &idx)
			: NULL;
	if (why) {
		cl_note_rejection(cl, addr, why);
		snprintf(reason, rlen, "%s", why);
		return NULL;
	}
	char host[sizeof(((struct pconn *)0)->host)];
	host_of(addr, host, sizeof(host));
	cap_handshakes(cl, host);
	struct pconn *c = conn_new(cl);
	if (!c) {
		snprintf(reason, rlen, "out of memory");
		return NULL;
	}
	snprintf(c->host, sizeof(c->host), "%s", host);
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
		cl_note_rejection(c->cl, who, why);
	}
	if (c->target >= 0 && !c->authed)
		epd_debug("dialling node %s: %s", c->cl->node[c->target].name,
			  why);
	cl_conn_close(c, why);
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

const struct epd_transport_cb cl_tr_cb = {
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
	int rc = status ? status : cl_first_addr(res, nd->port, &sa);
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

void cl_dial(struct epd_cluster *cl, int n)
{
	struct cnode *nd = &cl->node[n];
	struct sockaddr_storage sa;
	if (!nd->port) { /* known only by its dialling in: it dials */
		snprintf(nd->why, sizeof(nd->why),
			 "no address known (it dialled in before)");
		return;
	}
	if (!cl_resolve(nd->host, nd->port, &sa)) {
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
		cl_conn_close(c, why);
	}
}
