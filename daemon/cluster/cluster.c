/* SPDX-License-Identifier: MIT */
/*
 * The cluster (cluster_int.h): its nodes and their membership, the
 * heartbeats and the view, the transport's choice, the status, and the
 * span operations the core calls for groups across nodes.
 */
#include "cluster_int.h"

/* One entry of peers, name@host:port, into nd; -1 (err says why). */
static int parse_peer(char *t, struct cnode *nd, char *err, size_t errlen)
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
		if ((rc = parse_peer(t, nd, err, errlen)))
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
static bool node_usable(const struct cnode *nd)
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

static const struct epd_span_ops span_ops;

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
	srv->span = &span_ops;
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

static int span_self(const struct epd_server *srv)
{
	return srv->cluster ? srv->cluster->self : 0;
}

static int span_size(const struct epd_server *srv)
{
	return srv->cluster ? srv->cluster->n : 1;
}

bool cl_static(const struct epd_cluster *cl)
{
	return cl->srv->cfg.peer_lookup == EPD_LOOKUP_PEERS;
}

int cl_node_find(const struct epd_cluster *cl, const char *name)
{
	for (int n = 0; n < cl->n; n++)
		if (cl->node[n].state != NODE_FREE &&
		    !strcmp(cl->node[n].name, name))
			return n;
	return -1;
}

/* Does anything here still name learnt node n by its index? */
static bool node_in_use(const struct epd_cluster *cl, int n)
{
	const struct cnode *nd = &cl->node[n];
	if (nd->state != NODE_IDLE || nd->conn || nd->resolving ||
	    nd->groups ||
	    (cl->pinning && nd->resolved_gen == cl->resolve_gen))
		return true;
	/* (nd->groups counts every group here that names it, forming or
	 * failed: span_formed runs when a group is made); a connection in
	 * its handshake or being reaped names it by index too */
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &cl->conns)
	{
		const struct pconn *c = LIST_ENTRY(it, struct pconn, node);
		if (cl_conn_node(c) == n)
			return true;
	}
	return false;
}

/* Since when node nd has been unused: its last group's end, or its last
 * change of state (learnt, up, down), whichever came later. */
static uint64_t unused_since(const struct cnode *nd)
{
	return nd->unused_ns > nd->since_ns ? nd->unused_ns : nd->since_ns;
}

int cl_node_reclaim(struct epd_cluster *cl, uint64_t min_ns)
{
	const uint64_t now = epd_now_ns();
	int freed = 0;
	for (int n = cl->fixed; n < cl->n; n++) {
		struct cnode *nd = &cl->node[n];
		if (n == cl->self || nd->state == NODE_FREE ||
		    now - unused_since(nd) < min_ns || node_in_use(cl, n))
			continue;
		epd_info("node %s (index %d): forgotten, unused for %.1f s",
			 nd->name, n, (double)(now - unused_since(nd)) / 1e9);
		/* frames it sent for groups that never formed here */
		epd_xop_node_down(cl->srv, (uint32_t)n);
		memset(nd, 0, sizeof(*nd));
		nd->state = NODE_FREE;
		cl->nfree++;
		freed++;
	}
	/* free slots at the end shrink the table */
	while (cl->n > cl->fixed && cl->node[cl->n - 1].state == NODE_FREE) {
		cl->n--;
		cl->nfree--;
	}
	return freed;
}

int cl_node_add(struct epd_cluster *cl, const char *name, const char *host,
		int port, char *err, size_t errlen)
{
	const uint32_t max = cl->srv->cfg.peer_nodes_max;
	/* full: the learnt nodes nothing uses make room, however recent */
	if ((uint32_t)(cl->n - cl->nfree) >= max && !cl_node_reclaim(cl, 0)) {
		snprintf(err, errlen,
			 "the node table is full (peer_nodes_max %u, every "
			 "node in use)",
			 max);
		return -1;
	}
	int at = cl->n;
	for (int n = cl->fixed; cl->nfree && n < cl->n; n++)
		if (cl->node[n].state == NODE_FREE) {
			at = n;
			cl->nfree--;
			break;
		}
	if (at == cl->n && cl->n == cl->cap) {
		int cap = cl->cap * 2 > 8 ? cl->cap * 2 : 8;
		struct cnode *nn = realloc(cl->node, (size_t)cap * sizeof(*nn));
		if (!nn) {
			snprintf(err, errlen, "out of memory");
			return -1;
		}
		memset(nn + cl->cap, 0, (size_t)(cap - cl->cap) * sizeof(*nn));
		cl->node = nn;
		cl->cap = cap;
	}
	struct cnode *nd = &cl->node[at];
	memset(nd, 0, sizeof(*nd));
	snprintf(nd->name, sizeof(nd->name), "%s", name);
	snprintf(nd->host, sizeof(nd->host), "%s", host);
	nd->port = port;
	nd->state = NODE_IDLE;
	nd->since_ns = epd_now_ns();
	if (port)
		epd_info("node %s (index %d): learnt, at %s:%d", nd->name,
			 at, nd->host, port);
	else
		epd_info("node %s (index %d): learnt as it dialled in from %s "
			 "(no address to dial it at)",
			 nd->name, at, nd->host);
	if (at == cl->n)
		cl->n++;
	return at;
}

/* A node of a join's list, name or name@host:port: its index, found or
 * (peer_lookup dns or job) added. */
static int span_resolve(struct epd_server *srv, const char *entry, char *err,
			size_t errlen)
{
	struct epd_cluster *cl = srv->cluster;
	if (!cl)
		return -1;
	const int mode = srv->cfg.peer_lookup;
	char name[EPP_NODE_NAME_MAX + 1], host[sizeof(cl->node->host)] = "";
	int port = 0;
	const size_t nl = epp_node_entry_name_len(entry);
	if (nl > EPP_NODE_NAME_MAX) {
		snprintf(err, errlen, "a name longer than %d bytes",
			 EPP_NODE_NAME_MAX);
		return -1;
	}
	memcpy(name, entry, nl);
	name[nl] = 0;
	if (entry[nl] == '@') {
		struct cnode tmp;
		char spec[256], perr[160];
		snprintf(spec, sizeof(spec), "%s", entry);
		if (strlen(entry) >= sizeof(spec) ||
		    parse_peer(spec, &tmp, perr, sizeof(perr))) {
			snprintf(err, errlen, "not name@host:port");
			return -1;
		}
		snprintf(host, sizeof(host), "%s", tmp.host);
		port = tmp.port;
	}
	int n = cl_node_find(cl, name);
	if (n >= 0) {
		/* known: the address of peers stands, and a learnt one while
		 * the node is in use (it is where it was reached); a learnt
		 * node nothing uses, or one known only by its dialling in,
		 * takes the job's */
		struct cnode *nd = &cl->node[n];
		if (port && mode == EPD_LOOKUP_JOB && n >= cl->fixed &&
		    (nd->port != port || strcmp(nd->host, host)) &&
		    (!nd->port || !node_in_use(cl, n))) {
			epd_info("node %s (index %d): at %s:%d, as a job says "
				 "(was %s:%d)",
				 nd->name, n, host, port,
				 nd->port ? nd->host : "-", nd->port);
			snprintf(nd->host, sizeof(nd->host), "%s", host);
			nd->port = port;
		}
		nd->resolved_gen = cl->resolve_gen;
		return n;
	}
	if (mode == EPD_LOOKUP_PEERS) {
		snprintf(err, errlen,
			 "this daemon does not know it (not in its peers; "
			 "peer_lookup = peers)");
		return -1;
	}
	if (port && mode != EPD_LOOKUP_JOB) {
		snprintf(err, errlen,
			 "not in peers, and an address a job gives is taken "
			 "only with peer_lookup = job");
		return -1;
	}
	if (!port) { /* by its name, at this node's peer port */
		snprintf(host, sizeof(host), "%s", name);
		port = cl->node[cl->self].port;
	}
	n = cl_node_add(cl, name, host, port, err, errlen);
	if (n >= 0)
		cl->node[n].resolved_gen = cl->resolve_gen;
	return n;
}

static void span_resolve_pin(struct epd_server *srv, bool on)
{
	struct epd_cluster *cl = srv->cluster;
	if (!cl)
		return;
	if (on)
		cl->resolve_gen++;
	cl->pinning = on;
}

/* Local index l entered barrier seq: to group node `to` (a
 * dissemination step), or with step EPP_STEP_ALL to every other node. */
static int span_arrival_to(struct epd_group *g, uint32_t l, uint64_t seq,
			   uint32_t to, uint8_t step)
{
	struct epd_cluster *cl = g->srv->cluster;
	uint8_t buf[160];
	/* the data ops this node's ranks completed before the barrier:
	 * every node's must be the same (epd_coll_order) */
	struct epp_peer_barrier m = {.local = l, .seq = seq,
				     .xops = g->xop_next, .step = step};
	snprintf(m.group, sizeof(m.group), "%s", g->key);
	size_t bn = epp_peer_barrier_encode(&m, buf, sizeof(buf));
	for (uint32_t n = 0; n < g->nnodes; n++) {
		if (n == g->node_index || (step != EPP_STEP_ALL && n != to))
			continue;
		struct cnode *nd = &cl->node[g->node_map[n]];
		if (nd->state != NODE_UP) {
			epd_group_fail(g, EP_EPEERLOST,
				       "node %s (the group's node %u) is "
				       "down%s%s",
				       nd->name, n, nd->why[0] ? ": " : "",
				       nd->why);
			return EP_EPEERLOST;
		}
		cl_conn_send(nd->conn, EPP_PEER_BARRIER, buf, (uint32_t)bn);
	}
	return 0;
}

static int span_arrival(struct epd_group *g, uint32_t l, uint64_t seq)
{
	return span_arrival_to(g, l, seq, 0, EPP_STEP_ALL);
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

/* Tell the other nodes of group `key` (nnodes of them, at the cluster's
 * indices node_map, the names' hash nodes_hash) that it failed
 * here, having completed `round` barriers and `xops` data ops. A group
 * that never sent its shape (it failed forming, or never formed here: j
 * its join's, with timeout_ms) sends it first: the other nodes take a
 * failure only from a group whose shape they had (an earlier or later
 * group of the key is not theirs). */
static void gfail_send(struct epd_cluster *cl, const char *key,
		       uint32_t nnodes, const uint32_t *node_map,
		       uint64_t nodes_hash, int code, const char *msg,
		       uint64_t round, uint64_t xops, const struct epp_join *j,
		       uint32_t timeout_ms)
{
	uint8_t buf[EPP_ERRMSG_MAX + 128], shape[192];
	if (!cl)
		return;
	size_t sl = j ? epd_xop_shape_encode(key, j, timeout_ms, nodes_hash,
					     shape, sizeof(shape))
		      : 0;
	struct epp_peer_gfail m = {.code = code, .round = round, .xops = xops};
	snprintf(m.group, sizeof(m.group), "%s", key);
	snprintf(m.msg, sizeof(m.msg), "%s", msg);
	size_t gn = epp_peer_gfail_encode(&m, buf, sizeof(buf));
	for (uint32_t n = 0; n < nnodes; n++) {
		const int cn = (int)node_map[n];
		if (node_map[n] < (uint32_t)cl->n && cn != cl->self &&
		    cl->node[cn].state == NODE_UP) {
			if (sl)
				cl_conn_send(cl->node[cn].conn,
					     EPP_PEER_GSHAPE, shape,
					     (uint32_t)sl);
			cl_conn_send(cl->node[cn].conn, EPP_PEER_GFAIL, buf,
				     (uint32_t)gn);
		}
	}
}

/* The data ops the other nodes may still finish after this node's
 * failure: those it completed, up to one the nodes disagreed on. */
static uint64_t xops_done(const struct epd_group *g)
{
	return g->xop_next < g->xop_disagree ? g->xop_next : g->xop_disagree;
}

void epd_cluster_tell_failed(struct epd_group *g, uint32_t n)
{
	struct epd_cluster *cl = g->srv->cluster;
	uint8_t buf[EPP_ERRMSG_MAX + 128];
	if (!cl || n >= g->nnodes || n == g->node_index ||
	    g->node_map[n] >= (uint32_t)cl->n ||
	    cl->node[g->node_map[n]].state != NODE_UP)
		return;
	struct epp_peer_gfail m = {.code = g->fail_code, .round = g->round,
				   .xops = xops_done(g)};
	snprintf(m.group, sizeof(m.group), "%s", g->key);
	snprintf(m.msg, sizeof(m.msg), "%s", g->last_error);
	size_t gn = epp_peer_gfail_encode(&m, buf, sizeof(buf));
	cl_conn_send(cl->node[g->node_map[n]].conn, EPP_PEER_GFAIL, buf,
		     (uint32_t)gn);
}

/* Tell the group's other nodes it failed here. How far this node got:
 * the barriers it completed (every local rank entered them, so their
 * arrivals went out) and the data ops it completed (their rows went
 * out). The others may finish up to there; a rank that died never
 * entered the next round. */
static void group_failed(struct epd_group *g, int code, const char *msg)
{
	gfail_send(g->srv->cluster, g->key, g->nnodes, g->node_map,
		   g->nodes_hash, code, msg, g->round, xops_done(g),
		   g->announced ? NULL : &g->shape, g->timeout_ms);
}

/* A group this node refused to form (it is linked to a group that
 * failed): the nodes where it formed fail it at its first op. */
static void span_failed_key(struct epd_server *srv, const char *key,
			    const struct epp_join *j, uint32_t nnodes,
			    const uint32_t *node_map, uint64_t nodes_hash,
			    int code, const char *msg)
{
	gfail_send(srv->cluster, key, nnodes, node_map, nodes_hash, code, msg,
		   0, 0, j,
		   j->timeout_ms ? j->timeout_ms : srv->cfg.timeout_ms);
}

void epd_cluster_send(struct epd_group *g, uint32_t n, uint16_t type,
		      const void *a, size_t na, const void *b, size_t nb,
		      struct epd_sref *ref)
{
	struct epd_cluster *cl = g->srv->cluster;
	if (!cl || n >= g->nnodes || g->node_map[n] >= (uint32_t)cl->n)
		return;
	struct cnode *nd = &cl->node[g->node_map[n]];
	if (nd->state != NODE_UP)
		return;
	cl_conn_write(nd->conn, type, a, na, b, nb, ref);
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

const char *epd_cluster_name_at(const struct epd_server *srv, uint32_t cn)
{
	const struct epd_cluster *cl = srv->cluster;
	return cl && (int)cn < cl->n ? cl->node[cn].name : "?";
}

const char *epd_cluster_node_name(const struct epd_group *g, uint32_t n)
{
	struct epd_cluster *cl = g->srv->cluster;
	if (!cl || n >= g->nnodes)
		return "local";
	return g->node_map[n] < (uint32_t)cl->n ? cl->node[g->node_map[n]].name
						: "released";
}

static void span_failed(struct epd_group *g, int code, const char *msg,
			bool tell)
{
	if (tell)
		group_failed(g, code, msg);
	epd_xop_drop(g); /* a running job is dropped when it ends */
}

static void span_formed(struct epd_group *g)
{
	struct epd_cluster *cl = g->srv->cluster;
	for (uint32_t n = 0; n < g->nnodes; n++) {
		const int cn = (int)g->node_map[n];
		struct cnode *nd = &cl->node[cn];
		if (n == g->node_index || nd->groups++)
			continue;
		if (nd->state == NODE_IDLE)
			nd->state = NODE_DOWN; /* wanted now */
		/* dial at once, not at the next tick */
		if (nd->state != NODE_UP && !nd->conn && cl_dials(cl, cn)) {
			nd->backoff_ns = 0;
			nd->next_dial_ns = 0;
			cl_dial(cl, cn);
		}
	}
}

/* The group no longer spans its nodes here: each that no other group
 * spans lingers (peer_linger_ms), then its connection closes. */
static void nodes_release(struct epd_group *g)
{
	struct epd_cluster *cl = g->srv->cluster;
	if (g->nodes_released)
		return;
	for (uint32_t n = 0; cl && n < g->nnodes; n++) {
		struct cnode *nd = &cl->node[g->node_map[n]];
		if (n == g->node_index || !nd->groups || --nd->groups)
			continue;
		nd->unused_ns = epd_now_ns();
		if (nd->state == NODE_DOWN && !cl->srv->cfg.peer_connect_all)
			nd->state = NODE_IDLE; /* no longer wanted */
	}
}

/* Failed groups whose ranks are still connected let go of their nodes
 * once their timeout has passed since the failure: a node that forms
 * the group later is told the failure until then (epd_xop_frame), and
 * after that its own join has timed out. Else every failed group a rank
 * keeps open would hold its nodes in the table (connected, watched, not
 * forgotten) for as long as the rank likes. */
void cl_failed_release(struct epd_cluster *cl, uint64_t now)
{
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &cl->srv->groups)
	{
		struct epd_group *g = LIST_ENTRY(it, struct epd_group, node);
		const uint64_t wait = (uint64_t)g->timeout_ms * 1000000ull;
		if (g->nnodes < 2 || g->state != EPD_G_FAILED ||
		    g->nodes_released || now - g->failed_ns < wait)
			continue;
		nodes_release(g);
		g->nodes_released = true;
		for (uint32_t n = 0; n < g->nnodes; n++)
			if (n != g->node_index)
				g->node_map[n] = EPD_NODE_RELEASED;
		epd_info("group %s: failed %.1f s ago, its %u other nodes "
			 "released",
			 g->shape.name, (double)(now - g->failed_ns) / 1e9,
			 g->nnodes - 1);
	}
}

static bool span_nodes_up(struct epd_group *g)
{
	struct epd_cluster *cl = g->srv->cluster;
	for (uint32_t n = 0; n < g->nnodes; n++)
		if (n != g->node_index &&
		    !node_usable(&cl->node[g->node_map[n]]))
			return false;
	return true;
}

static void span_nodes_missing(struct epd_group *g, char *out, size_t cap)
{
	struct epd_cluster *cl = g->srv->cluster;
	size_t off = 0;
	out[0] = 0;
	for (uint32_t n = 0; n < g->nnodes && off + 1 < cap; n++) {
		const struct cnode *nd = &cl->node[g->node_map[n]];
		if (n == g->node_index || node_usable(nd))
			continue;
		int w = snprintf(out + off, cap - off, "%s%s%s%s%s",
				 off ? ", " : "", nd->name,
				 nd->why[0] ? " (" : "", nd->why,
				 nd->why[0] ? ")" : "");
		off += w > 0 ? (size_t)w : 0;
	}
	if (off >= cap && cap > 4)
		snprintf(out + cap - 4, 4, "...");
}

static void span_ready(struct epd_group *g)
{
	epd_xop_announce(g); /* its shape to the others, who compare */
	epd_xop_replay(g);   /* what came before it was ready here */
}

static void span_freed(struct epd_group *g)
{
	nodes_release(g);
	epd_xop_drop(g);
	epd_xbufs_trim(g->srv);
	epd_xwin_free(g);
}

static const struct epd_span_ops span_ops = {
	.self = span_self,
	.size = span_size,
	.resolve = span_resolve,
	.resolve_pin = span_resolve_pin,
	.formed = span_formed,
	.nodes_up = span_nodes_up,
	.nodes_missing = span_nodes_missing,
	.arrival = span_arrival,
	.arrival_to = span_arrival_to,
	.op_start = epd_xop_start,
	.missing = epd_xop_missing,
	.ready = span_ready,
	.failed = span_failed,
	.failed_key = span_failed_key,
	.freed = span_freed,
	.node_name = epd_cluster_node_name,
};
