/* SPDX-License-Identifier: MIT */
/*
 * The cluster (cluster_int.h): its configuration and key, its nodes'
 * membership (up, down, the heartbeats and the view), the transport's
 * choice, and the status. The node table is nodes.c's, the span
 * operations the core calls for groups across nodes span.c's.
 */
#include "cluster_int.h"

/* One entry of peers, name@host:port, into nd; -1 (err says why). */
int cl_parse_peer(char *t, struct cnode *nd, char *err, size_t errlen)
{
	char *at = strchr(t, '@'), *colon = strrchr(t, ':');
	if (!at || !colon || colon < at) {
		snprintf(err, errlen, "peers: '%s' is not name@host:port", t);
		return -1;
	}
	*at = *colon = 0;
	const char *host = at + 1, *port = colon + 1;
	if (!epp_node_name_valid(t)) {
		snprintf(err, errlen,
			 "peers: node name '%s' is not 1..%d of "
			 "[A-Za-z0-9_.-]",
			 t, EPP_NODE_NAME_MAX);
		return -1;
	}
	if (!*host || strlen(host) >= sizeof(nd->host)) {
		snprintf(err, errlen,
			 "peers: host of %s is empty or longer than %zu bytes",
			 t, sizeof(nd->host) - 1);
		return -1;
	}
	char *end;
	long pn = strtol(port, &end, 10);
	if (end == port || *end || pn <= 0 || pn > 65535) {
		snprintf(err, errlen, "peers: bad port '%s' for %s", port, t);
		return -1;
	}
	snprintf(nd->name, sizeof(nd->name), "%s", t);
	snprintf(nd->host, sizeof(nd->host), "%s", host);
	nd->port = (int)pn;
	return 0;
}

/* The cluster's nodes from `peers`, of any length; names must be
 * distinct, and this node's among them. */
static int parse_peers(struct epd_cluster *cl, const char *spec,
		       const char *self, char *err, size_t errlen)
{
	char *buf = strdup(spec);
	size_t cap = 1;
	for (const char *p = spec; *p; p++)
		cap += *p == ',' || *p == ' ';
	cl->node = calloc(cap, sizeof(*cl->node));
	if (!buf || !cl->node) {
		free(buf);
		snprintf(err, errlen, "out of memory");
		return -1;
	}
	cl->n = 0;
	cl->cap = (int)cap;
	cl->self = -1;
	int rc = 0;
	for (char *save, *t = strtok_r(buf, ", \t", &save); t && !rc;
	     t = strtok_r(NULL, ", \t", &save)) {
		struct cnode *nd = &cl->node[cl->n];
		if ((rc = cl_parse_peer(t, nd, err, errlen)))
			break;
		/* distinct names: checked against the others by a hash
		 * table's worth of work only at start (n^2 string compares
		 * for a few thousand nodes is milliseconds) */
		for (int i = 0; i < cl->n && !rc; i++)
			if (!strcmp(cl->node[i].name, nd->name)) {
				snprintf(err, errlen, "peers: %s listed twice",
					 nd->name);
				rc = -1;
			}
		if (!rc && !strcmp(nd->name, self))
			cl->self = cl->n;
		cl->n++;
	}
	free(buf);
	if (!rc && cl->self < 0) {
		snprintf(err, errlen, "node_name '%s' is not in peers", self);
		rc = -1;
	}
	return rc;
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
	struct stat st;
	if (!fstat(fd, &st) && (st.st_mode & 077))
		epd_warn("cluster key %s can be read by others (mode %04o): "
			 "whoever reads it can join the cluster; chmod 600 it",
			 path, (unsigned)(st.st_mode & 07777));
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
int cl_resolve(const char *host, int port, struct sockaddr_storage *sa)
{
	if (!uv_ip4_addr(host, port, (struct sockaddr_in *)sa))
		return 0;
	if (!uv_ip6_addr(host, port, (struct sockaddr_in6 *)sa))
		return 0;
	return -1;
}

/* The first address of a resolved name, with the port set. */
int cl_first_addr(const struct addrinfo *ai, int port,
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

/* ---- frames ---- */

static void fail_groups(struct epd_cluster *cl, int n, const char *why)
{
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &cl->srv->groups)
	{
		struct epd_group *g = LIST_ENTRY(it, struct epd_group, node);
		if (g->nnodes > 1 && g->state != EPD_G_FAILED &&
		    epd_group_node_of(g, (uint32_t)n) != UINT32_MAX)
			epd_group_fail(g, EP_EPEERLOST,
				       "node %s (the group's node %u) is down: "
				       "%s",
				       cl->node[n].name,
				       epd_group_node_of(g, (uint32_t)n), why);
	}
}

bool cl_dials(const struct epd_cluster *cl, int n)
{
	/* (peer_connect = all needs the same table everywhere: peers) */
	return cl->srv->cfg.peer_connect_all
		       ? n > cl->self
		       : strcmp(cl->node[cl->self].name, cl->node[n].name) < 0;
}

/* Is node n wanted: connected to, and watched? */
static bool wanted(const struct epd_cluster *cl, int n)
{
	return cl->srv->cfg.peer_connect_all || cl->node[n].groups > 0;
}

void cl_node_down(struct epd_cluster *cl, int n, const char *why)
{
	struct cnode *nd = &cl->node[n];
	nd->since_ns = epd_now_ns();
	cl->epoch++;
	const bool agreed = nd->idle_close || nd->bye_asked || nd->bye_agreed;
	nd->idle_close = nd->bye_asked = nd->bye_agreed = false;
	if (agreed && wanted(cl, n)) {
		/* closed by agreement while a group here began to need it:
		 * no failure; the group waits for a new connection (the
		 * dialler dials again: it needs the node too, or will) */
		nd->state = NODE_DOWN;
		epd_info("node %s (index %d): unused connection closed; a "
			 "group here waits for a new one; view epoch %llu",
			 nd->name, n, (unsigned long long)cl->epoch);
		epd_xop_node_down(cl->srv, (uint32_t)n);
		nd->backoff_ns = 0;
		nd->next_dial_ns = 0;
		return;
	}
	if (agreed || !wanted(cl, n)) {
		/* closed for lack of use (here or there): no failure */
		nd->state = NODE_IDLE;
		epd_info("node %s (index %d): connection closed (%s), no group "
			 "here spans it; view epoch %llu",
			 nd->name, n, why, (unsigned long long)cl->epoch);
		epd_xop_node_down(cl->srv, (uint32_t)n);
		return;
	}
	nd->state = NODE_DOWN;
	nd->downs++;
	snprintf(nd->why, sizeof(nd->why), "%s", why);
	epd_warn("node %s (index %d) down: %s; view epoch %llu", nd->name, n,
		 why, (unsigned long long)cl->epoch);
	fail_groups(cl, n, why);
	epd_xop_node_down(cl->srv, (uint32_t)n);
}

void cl_node_up(struct pconn *c)
{
	struct epd_cluster *cl = c->cl;
	struct cnode *nd = &cl->node[c->peer];
	if (nd->conn && nd->conn != c)
		cl_conn_close(nd->conn, "replaced by a new connection");
	nd->conn = c;
	nd->state = NODE_UP;
	nd->last_rx_ns = nd->since_ns = epd_now_ns();
	nd->why[0] = 0;
	nd->backoff_ns = 0;
	cl->epoch++;
	epd_notice("node %s (index %d) up at %s; view epoch %llu", nd->name,
		   c->peer, c->addr, (unsigned long long)cl->epoch);
	cl_groups_nodes_up(cl, c->peer);
}

void cl_groups_nodes_up(struct epd_cluster *cl, int n)
{
	/* groups that waited for it, and now have every node */
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &cl->srv->groups)
	{
		struct epd_group *g = LIST_ENTRY(it, struct epd_group, node);
		if (g->await_nodes &&
		    epd_group_node_of(g, (uint32_t)n) != UINT32_MAX &&
		    cl->srv->span->nodes_up(g))
			epd_group_nodes_up(g);
	}
}

/* Connected, and not closing by agreement: a group may count on it. */
bool cl_node_usable(const struct cnode *nd)
{
	return nd->state == NODE_UP && !nd->bye_asked && !nd->bye_agreed;
}

void cl_bye(struct pconn *c, uint8_t kind)
{
	struct epd_cluster *cl = c->cl;
	const int n = c->peer;
	struct cnode *nd = &cl->node[n];
	if (nd->conn != c)
		return; /* an older connection's */
	if (kind == EPP_BYE_ASK) {
		/* the dialler would close: agree unless a group here needs
		 * the node (then the connection stays) */
		const uint8_t ans = nd->groups ? EPP_BYE_NO : EPP_BYE_YES;
		nd->bye_agreed = ans == EPP_BYE_YES;
		cl_conn_send(c, EPP_PEER_BYE, &ans, 1);
		return;
	}
	if (!nd->bye_asked)
		return; /* an answer to nothing asked: ignored */
	if (kind == EPP_BYE_NO) {
		/* the other end needs it: it stays, and groups here that
		 * waited meanwhile go on */
		nd->bye_asked = false;
		nd->unused_ns = epd_now_ns();
		cl_groups_nodes_up(cl, n);
		return;
	}
	/* agreed: close; a group here that needs the node meanwhile
	 * waits, and the node is dialled again */
	nd->idle_close = true;
	cl_conn_close(c, "unused (closed by agreement)");
}

/* A handshake refused, by us or by the peer: counted, kept for the status
 * and logged (by both sides: the dialler too learns why). */
void cl_note_rejection(struct epd_cluster *cl, const char *who,
			   const char *why)
{
	cl->rejected++;
	cl->reject_ns = epd_now_ns();
	snprintf(cl->reject_addr, sizeof(cl->reject_addr), "%s", who);
	snprintf(cl->reject_why, sizeof(cl->reject_why), "%s", why);
	epd_log_limited(&cl->srv->log_rl, "peer connection %s rejected: %s", who, why);
}

/* S self, U up, D down, I idle (on demand: no group here spans it). */
static char state_letter(int state)
{
	return state == NODE_SELF ? 'S'
	       : state == NODE_UP ? 'U'
	       : state == NODE_IDLE ? 'I'
				    : 'D';
}

/* This node's row of the matrix (state_letter). */
static void my_row(const struct epd_cluster *cl, char *row)
{
	if (cl->n > MATRIX_MAX || !cl_static(cl)) {
		row[0] = 0;
		return;
	}
	for (int n = 0; n < cl->n; n++)
		row[n] = state_letter(cl->node[n].state);
	row[cl->n] = 0;
}

void cl_send_beat(struct pconn *c)
{
	uint8_t buf[8 + 2 + MATRIX_MAX + 8];
	struct epp_peer_heartbeat hb = {.epoch = c->cl->epoch};
	my_row(c->cl, hb.row);
	size_t n = epp_peer_heartbeat_encode(&hb, buf, sizeof(buf));
	cl_conn_send(c, EPP_PEER_HEARTBEAT, buf, (uint32_t)n);
}

static void on_tick(uv_timer_t *t)
{
	struct epd_cluster *cl = t->data;
	const struct epd_config *cfg = &cl->srv->cfg;
	uint64_t now = epd_now_ns();
	uint64_t silent = (uint64_t)cfg->heartbeat_ms * cfg->heartbeat_miss *
			  1000000ull,
		 linger = (uint64_t)cfg->peer_linger_ms * 1000000ull;
	uint8_t buf[8 + 2 + MATRIX_MAX + 8];
	struct epp_peer_heartbeat hb = {.epoch = cl->epoch};
	my_row(cl, hb.row);
	size_t hbn = epp_peer_heartbeat_encode(&hb, buf, sizeof(buf));
	/* handshakes that never finish */
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &cl->conns)
	{
		struct pconn *c = LIST_ENTRY(it, struct pconn, node);
		if (!c->authed && now - c->born_ns > silent)
			cl_reject(c, "no handshake within %u ms",
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
			cl_conn_close(nd->conn, why);
			continue;
		}
		if (nd->state == NODE_UP && !wanted(cl, n) && cl_dials(cl, n) &&
		    !nd->bye_asked && now - nd->unused_ns >= linger) {
			/* on demand: unused past the linger; the dialler
			 * asks the other end, which may need it (PEER_BYE) */
			const uint8_t ask = EPP_BYE_ASK;
			nd->bye_asked = true;
			cl_conn_send(nd->conn, EPP_PEER_BYE, &ask, 1);
		}
		if (nd->state == NODE_UP)
			cl_conn_send(nd->conn, EPP_PEER_HEARTBEAT, buf,
				  (uint32_t)hbn);
		else if (wanted(cl, n) && cl_dials(cl, n) && !nd->conn &&
			 now >= nd->next_dial_ns)
			cl_dial(cl, n);
	}
	/* learnt nodes unused for a linger are forgotten: the table holds
	 * the nodes in use, not every node ever named */
	cl_failed_release(cl, now);
	if (cl->n > cl->fixed)
		cl_node_reclaim(cl, linger);
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
		if (nd->state == NODE_FREE)
			continue;
		if (!cl_resolve(nd->host, nd->port, &sa)) {
			if (addr_loopback(&sa))
				return i;
			continue;
		}
		struct addrinfo *res = NULL;
		if (getaddrinfo(nd->host, NULL, &resolve_hints, &res) == 0 &&
		    !cl_first_addr(res, nd->port, &sa) && addr_loopback(&sa)) {
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
		/* cut to wl if need be: a reason, not a value */
		if (snprintf(why, wl,
			     "node %s is on a loopback address (%s), which "
			     "the %s transport cannot route (ENODEV)",
			     cl->node[lo].name, cl->node[lo].host,
			     t->name) < 0)
			why[0] = 0;
		return false;
	}
	return true;
}

/* `transport`: a named one (it must work here), or auto: the first in
 * transports that can carry the cluster (rdma before tcp), saying
 * why the ones before it could not. */
static int pick_transport(struct epd_cluster *cl,
			  const struct epd_transport_ops *const *transports,
			  const char *name, char *err, size_t errlen)
{
	char why[160];
	if (strcmp(name, "auto")) {
		const struct epd_transport_ops *t = NULL;
		for (int i = 0; transports[i] && !t; i++)
			if (!strcmp(transports[i]->name, name))
				t = transports[i];
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
	for (int i = 0; transports[i]; i++) {
		const struct epd_transport_ops *t = transports[i];
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

/* What start needs of the configuration before any socket: the peers
 * (this node among them), the key, and this node's address to listen on
 * (into sa). */
static int cluster_prepare(struct epd_cluster *cl,
			   const struct epd_config *cfg,
			   struct sockaddr_storage *sa, char *err,
			   size_t errlen)
{
	if (parse_peers(cl, cfg->peers, cfg->node_name, err, errlen))
		return -1;
	cl->fixed = cl->n;
	if (!cfg->cluster_key_file[0]) {
		snprintf(err, errlen, "peers given but no cluster_key_file");
		return -1;
	}
	if (cfg->peer_connect_all && cfg->peer_lookup != EPD_LOOKUP_PEERS) {
		snprintf(err, errlen,
			 "peer_connect = all needs peer_lookup = peers (every "
			 "node of peers, in the same order everywhere)");
		return -1;
	}
	if (load_key(cl, cfg->cluster_key_file, err, errlen))
		return -1;
	const struct cnode *me = &cl->node[cl->self];
	if (!cl_resolve(me->host, me->port, sa))
		return 0;
	/* a name: resolved once, here, to the address to listen on */
	struct addrinfo *res = NULL;
	int rc = getaddrinfo(me->host, NULL, &resolve_hints, &res);
	if (rc || cl_first_addr(res, me->port, sa)) {
		snprintf(err, errlen,
			 "host '%s' of this node does not resolve: %s",
			 me->host, rc ? gai_strerror(rc) : "no IPv4/IPv6 address");
		if (res)
			freeaddrinfo(res);
		return -1;
	}
	freeaddrinfo(res);
	return 0;
}

/* A cluster to prepare from cfg (libsodium ready), or NULL with err. */
static struct epd_cluster *cluster_new(char *err, size_t errlen)
{
	if (sodium_init() < 0) {
		snprintf(err, errlen, "libsodium failed to initialize");
		return NULL;
	}
	struct epd_cluster *cl = calloc(1, sizeof(*cl));
	if (!cl)
		snprintf(err, errlen, "out of memory");
	return cl;
}

int epd_cluster_check(const struct epd_config *cfg, char *err, size_t errlen)
{
	if (!cfg->peers || !cfg->peers[0])
		return 0;
	struct epd_cluster *cl = cluster_new(err, errlen);
	if (!cl)
		return -1;
	struct sockaddr_storage sa;
	int rc = cluster_prepare(cl, cfg, &sa, err, errlen);
	sodium_memzero(cl->key, sizeof(cl->key));
	free(cl->node);
	free(cl);
	return rc;
}

int epd_cluster_init(struct epd_server *srv,
		     const struct epd_transport_ops *const *transports,
		     char *err, size_t errlen)
{
	const struct epd_config *cfg = &srv->cfg;
	if (!cfg->peers || !cfg->peers[0])
		return 0;
	struct epd_cluster *cl = cluster_new(err, errlen);
	struct epd_xnode *xn = cl ? calloc(1, sizeof(*xn)) : NULL;
	if (!cl || !xn) {
		if (cl)
			snprintf(err, errlen, "out of memory");
		free(cl);
		free(xn);
		return -1;
	}
	LIST_INIT(&xn->xstash);
	LIST_INIT(&xn->xzombies);
	cl->srv = srv;
	LIST_INIT(&cl->conns);
	struct sockaddr_storage sa;
	if (cluster_prepare(cl, cfg, &sa, err, errlen) ||
	    pick_transport(cl, transports, cfg->transport, err, errlen))
		goto err;
	epd_cluster_id(cl->key, cl->cluster_id);
	for (int n = 0; n < cl->n; n++)
		cl->node[n].state = cfg->peer_connect_all ? NODE_DOWN : NODE_IDLE;
	cl->node[cl->self].state = NODE_SELF;
	struct cnode *me = &cl->node[cl->self];
	cl->tr = cl->tops->open(srv->loop, &cl_tr_cb, cl, err, errlen);
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
	srv->span = &cl_span_ops;
	epd_notice("cluster: node %s, index %d of %d, %s on %s:%d, "
		   "heartbeat %u ms x %u%s%s",
		   me->name, cl->self, cl->n, cl->tops->name, me->host,
		   me->port, cfg->heartbeat_ms, cfg->heartbeat_miss, "; ",
		   cl->transport_why);
	return 0;
err:
	free(cl->node);
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
		/* no group failures while stopping; a connection that never
		 * said who it is has no node */
		int n = cl_conn_node(c);
		if (n >= 0)
			cl->node[n].state = NODE_DOWN;
		cl_conn_close(c, "daemon stopping");
	}
	uv_close((uv_handle_t *)&cl->tick, NULL);
	cl->tops->free(cl->tr);
	cl->tr = NULL;
}

void epd_cluster_free(struct epd_server *srv)
{
	if (srv->cluster)
		free(srv->cluster->node);
	free(srv->cluster);
	free(srv->xnode);
	srv->cluster = NULL;
	srv->xnode = NULL;
	srv->span = NULL;
}

/* Node cn's connection if rows can be written to it (see
 * epd_cluster_wconn). */
static struct epd_tconn *wconn(const struct epd_cluster *cl, int cn)
{
	if (!cl || !cl->tops->write || !cl->tr || cn < 0 || cn >= cl->n ||
	    cl->node[cn].state != NODE_UP)
		return NULL;
	struct pconn *c = cl->node[cn].conn;
	return c && c->authed && c->tc && c->minor >= 6 &&
			       cl->tops->can_write(c->tc)
		       ? c->tc
		       : NULL;
}

void *epd_cluster_status(struct epd_server *srv)
{
	struct epd_cluster *cl = srv->cluster;
	if (!cl)
		return NULL;
	json_t *peers = json_array(), *matrix = json_array();
	char *row = malloc((size_t)cl->n + 1);
	if (!row)
		return NULL;
	uint64_t now = epd_now_ns();
	/* one row per node: ours now, the others' from their last beat
	 * ('?' where none came); only for a cluster small enough to show */
	for (int n = 0; n < cl->n && cl->n <= MATRIX_MAX && cl_static(cl); n++) {
		char r[MATRIX_MAX + 1];
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
		if (nd->state == NODE_FREE) { /* a forgotten node's slot */
			row[n] = '-';
			continue;
		}
		const char *st = nd->state == NODE_SELF ? "self"
				 : nd->state == NODE_UP ? "up"
				 : nd->state == NODE_IDLE ? "idle"
							: "down";
		row[n] = state_letter(nd->state);
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
				  : wconn(cl, n)
					  ? "rdma-write"
					  : "frames"));
	}
	row[cl->n] = 0;
	json_t *o = json_pack("{s:s, s:i, s:i, s:I, s:s, s:s, s:I, s:o, s:o}",
			      "node", cl->node[cl->self].name, "index", cl->self,
			      "nodes", cl->n - cl->nfree, "view_epoch",
			      (json_int_t)cl->epoch,
			      "transport", cl->tops->name, "row", row,
			      "rejected", (json_int_t)cl->rejected, "peers",
			      peers, "matrix", matrix);
	free(row);
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

struct epd_transport *epd_cluster_transport(const struct epd_server *srv)
{
	struct epd_cluster *cl = srv->cluster;
	return cl && cl->tops->write ? cl->tr : NULL;
}

struct epd_tconn *epd_cluster_wconn(const struct epd_group *g, uint32_t n)
{
	return n < g->nnodes ? wconn(g->srv->cluster, (int)g->node_map[n])
			     : NULL;
}

