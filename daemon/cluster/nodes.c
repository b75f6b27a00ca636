/* SPDX-License-Identifier: MIT */
/*
 * The cluster's node table (cluster_int.h, struct cnode): the nodes of
 * peers, and with peer_lookup dns or job the nodes learnt from joins and
 * hellos, found by name, added, forgotten once unused (reclaim); and a
 * join's node list resolved to the table's indices (the span operations
 * resolve and resolve_pin).
 */
#include "cluster_int.h"

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
int cl_span_resolve(struct epd_server *srv, const char *entry, char *err,
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
		    cl_parse_peer(spec, &tmp, perr, sizeof(perr))) {
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

void cl_span_resolve_pin(struct epd_server *srv, bool on)
{
	struct epd_cluster *cl = srv->cluster;
	if (!cl)
		return;
	if (on)
		cl->resolve_gen++;
	cl->pinning = on;
}
