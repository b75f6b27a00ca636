/* SPDX-License-Identifier: MIT */
/*
 * A rank's JOIN: the group's key and secret checked, its node list
 * resolved (join_nodes), the group found or made (quotas, shape), linked
 * to its parent, and the rank its member; the group becomes ready in
 * group.c once every local rank is in.
 */
#include "core.h"
#include "backend.h"
#include "group_int.h"

#include <sodium.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* May uid create one more group of `bytes`? 0, or EP_ELIMIT with why. */
static int group_quota(struct epd_server *srv, uid_t uid, uint64_t bytes,
		       char *err, size_t errlen)
{
	const struct epd_limits *lim = &srv->cfg.limits;
	uint32_t n = 0, mine = 0;
	uint64_t total = 0, my_bytes = 0;
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->groups)
	{
		struct epd_group *g = LIST_ENTRY(it, struct epd_group, node);
		n++;
		total += g->layout.total;
		if (g->owner == uid) {
			mine++;
			my_bytes += g->layout.total;
		}
	}
	if (lim->groups && n >= lim->groups) {
		snprintf(err, errlen, "the daemon serves %u groups, its limit "
				      "(max_groups)", n);
		return EP_ELIMIT;
	}
	if (lim->bytes && total + bytes > lim->bytes) {
		snprintf(err, errlen, "a group of %llu bytes would take the "
				      "daemon's buffers past max_bytes (%llu)",
			 (unsigned long long)bytes,
			 (unsigned long long)lim->bytes);
		return EP_ELIMIT;
	}
	/* root too: in containers every job is often uid 0 */
	if (lim->groups_per_uid && mine >= lim->groups_per_uid) {
		snprintf(err, errlen, "uid %u has %u groups, its limit "
				      "(max_groups_per_user)", (unsigned)uid, mine);
		return EP_ELIMIT;
	}
	if (lim->bytes_per_uid && my_bytes + bytes > lim->bytes_per_uid) {
		snprintf(err, errlen, "a group of %llu bytes would take uid %u "
				      "past max_bytes_per_user (%llu)",
			 (unsigned long long)bytes, (unsigned)uid,
			 (unsigned long long)lim->bytes_per_uid);
		return EP_ELIMIT;
	}
	return 0;
}

/* The nodes a join names: the cluster's index of each of the group's
 * nodes, and their names' hash (0 without a list). */
struct join_nodes {
	uint32_t *map; /* [nnodes], malloc'd */
	uint64_t hash;
};

static struct epd_group *group_create(struct epd_server *srv, uid_t owner,
				      const char *key, bool shared,
				      const struct epp_join *j,
				      struct join_nodes *jn, char *err,
				      size_t errlen, int *code)
{
	struct epp_buf lay;
	*code = epp_buf_layout(j, &lay);
	if (*code) {
		snprintf(err, errlen, "buffers of %llu bytes exceed the "
				      "protocol's limit",
			 (unsigned long long)lay.total);
		return NULL;
	}
	*code = group_quota(srv, owner, lay.total, err, errlen);
	if (*code)
		return NULL;
	struct epd_group *g = calloc(1, sizeof(*g));
	if (!g)
		goto err_nomem;
	g->srv = srv;
	g->shape = *j;
	g->owner = owner;
	g->shared = shared;
	snprintf(g->key, sizeof(g->key), "%s", key);
	g->id = ++srv->next_group_id;
	g->epoch = srv->epoch;
	g->nnodes = j->world_size / j->ranks_per_node;
	g->node_index = j->rank / j->ranks_per_node;
	g->shape.num_nodes = 0; /* the list is the join frame's */
	g->shape.nodes = NULL;
	g->node_map = jn->map; /* the group's from here on */
	jn->map = NULL;
	g->nodes_hash = jn->hash;
	g->timeout_ms = j->timeout_ms ? j->timeout_ms : srv->cfg.timeout_ms;
	g->state = EPD_G_FORMING;
	g->shape.link = 0; /* a joiner's, not the group's */
	g->toobig_pos = UINT64_MAX;
	g->xop_disagree = UINT64_MAX;
	LIST_INIT(&g->linked);
	LIST_INIT(&g->link_node);
	g->created_ns = epd_now_ns();
	g->buf_fd = -1;
	g->local = calloc(j->ranks_per_node, sizeof(*g->local));
	g->rail_done = calloc(j->ranks_per_node, sizeof(*g->rail_done));
	g->rail_remote = calloc((size_t)j->ranks_per_node * g->nnodes,
				sizeof(*g->rail_remote));
	g->peer = calloc(g->nnodes, 1);
	g->arr_seq = calloc(g->nnodes, sizeof(*g->arr_seq));
	g->arr_xops = calloc(g->nnodes, sizeof(*g->arr_xops));
	/* the rail phase of many nodes: a dissemination barrier */
	while (g->nnodes > EPP_DISSEM_NODES &&
	       (1u << g->dis_steps) < g->nnodes)
		g->dis_steps++;
	const size_t ds = (size_t)j->ranks_per_node * (g->dis_steps + 1);
	g->dis_recv = calloc(ds, sizeof(*g->dis_recv));
	g->dis_sent = calloc(ds, sizeof(*g->dis_sent));
	if (!g->local || !g->rail_done || !g->rail_remote || !g->peer ||
	    !g->arr_seq || !g->arr_xops || !g->dis_recv || !g->dis_sent)
		goto err_free;
	*code = epd_buf_create(g);
	if (*code) {
		snprintf(err, errlen,
			 "cannot create the group's buffer of %llu bytes: %s",
			 (unsigned long long)g->layout.total,
			 ep_strerror(*code));
		goto err_free_nocode;
	}
	uv_timer_init(srv->loop, &g->timer);
	g->timer.data = g;
	list_add_tail(&srv->groups, &g->node);
	if (g->nnodes > 1)
		srv->span->formed(g); /* connects to its nodes */
	epd_info("group %s (id %lu, uid %u) created: world %u, %u per node, "
		 "node %u, %u experts, hidden %u, %u tokens, top-%u, timeout "
		 "%u ms, %u receive area%s",
		 g->shape.name, (unsigned long)g->id, (unsigned)g->owner,
		 j->world_size, j->ranks_per_node, g->node_index,
		 j->num_experts, j->hidden, j->max_tokens, j->topk,
		 g->timeout_ms, g->layout.recv_areas,
		 g->layout.recv_areas == 1 ? "" : "s");
	return g;

err_free:
	*code = EP_ENOMEM;
	snprintf(err, errlen, "out of memory");
err_free_nocode:
	if (g)
		epd_group_mem_free(g);
	return NULL;
err_nomem:
	*code = EP_ENOMEM;
	snprintf(err, errlen, "out of memory");
	return NULL;
}

/* Does j describe the same group as g? */
static int shape_check(const struct epd_group *g, const struct epp_join *j,
		       uint64_t nodes_hash, char *err, size_t errlen)
{
	const struct epp_join *s = &g->shape;
#define CHECK(f)                                                               \
	if (s->f != j->f) {                                                    \
		snprintf(err, errlen,                                          \
			 "group %s has " #f " %u, this join says %u", s->name, \
			 s->f, j->f);                                          \
		return EP_EMISMATCH;                                           \
	}
	CHECK(world_size)
	CHECK(ranks_per_node)
	CHECK(num_experts)
	CHECK(hidden)
	CHECK(max_tokens)
	CHECK(topk)
	CHECK(dtype)
	CHECK(recv_areas)
	CHECK(recv_rows)
#undef CHECK
	uint32_t t = j->timeout_ms ? j->timeout_ms : g->srv->cfg.timeout_ms;
	if (t != g->timeout_ms) {
		snprintf(err, errlen, "group %s has timeout_ms %u, this join "
				      "says %u",
			 s->name, g->timeout_ms, t);
		return EP_EMISMATCH;
	}
	if (nodes_hash != g->nodes_hash) {
		snprintf(err, errlen,
			 "group %s %s; this join %s",
			 s->name,
			 g->nodes_hash ? "names its nodes"
				       : "was joined without a node list",
			 nodes_hash ? "names other nodes"
				    : "names none");
		return EP_EMISMATCH;
	}
	if (j->rank / j->ranks_per_node != g->node_index) {
		snprintf(err, errlen,
			 "rank %u is on node %u, but this daemon serves node "
			 "%u of group %s",
			 j->rank, j->rank / j->ranks_per_node, g->node_index,
			 s->name);
		return EP_EMISMATCH;
	}
	return 0;
}

/* The hash of a join's node names (an entry's name, not the address a
 * job may give with it: ranks that reach the same nodes by other
 * addresses name the same group): FNV-1a, 64 bits, over the names and
 * their NULs. */
static uint64_t names_hash(const struct epp_join *j)
{
	uint64_t h = 0xcbf29ce484222325ull;
	const char *e = j->nodes;
	for (uint32_t n = 0; n < j->num_nodes; n++, e += strlen(e) + 1) {
		/* each name and its terminating NUL */
		const size_t nl = epp_node_entry_name_len(e);
		for (size_t i = 0; i <= nl; i++)
			h = (h ^ (uint8_t)(i < nl ? e[i] : 0)) *
			    0x100000001b3ull;
	}
	return h ? h : 1; /* 0 is "no list" */
}

/* The cluster's index of each node a join names (or, without a list, of
 * node n = the cluster's n), checked: this daemon is the joining rank's
 * node, every name is known here and named once. */
static int join_nodes(struct epd_server *srv, const struct epp_join *j,
		      struct join_nodes *jn, char *err, size_t errlen)
{
	const uint32_t nnodes = j->world_size / j->ranks_per_node,
		       mine = j->rank / j->ranks_per_node;
	const char *self = srv->cfg.node_name;
	if (nnodes > 1 && !srv->span) {
		snprintf(err, errlen,
			 "group %s spans %u nodes, but this daemon has no "
			 "cluster configured",
			 j->name, nnodes);
		return EP_EUNSUPPORTED;
	}
	if (j->num_nodes && j->num_nodes != nnodes) {
		snprintf(err, errlen,
			 "group %s names %u nodes; world_size %u at %u ranks "
			 "per node is %u",
			 j->name, j->num_nodes, j->world_size,
			 j->ranks_per_node, nnodes);
		return EP_EINVAL;
	}
	const int me = srv->span ? srv->span->self(srv) : 0;
	if (!j->num_nodes && nnodes > 1 &&
	    nnodes > (uint32_t)srv->span->size(srv)) {
		snprintf(err, errlen,
			 "group %s spans %u nodes; the cluster has %d (the "
			 "group names no nodes: node i is the i-th of peers)",
			 j->name, nnodes, srv->span->size(srv));
		return EP_EINVAL;
	}
	if (!j->num_nodes && nnodes > 1 && (int)mine != me) {
		snprintf(err, errlen,
			 "rank %u lives on node %u; this daemon is node %d "
			 "(the group names no nodes: node i is the i-th of "
			 "peers)",
			 j->rank, mine, me);
		return EP_EMISMATCH;
	}
	jn->map = malloc(nnodes * sizeof(*jn->map));
	if (!jn->map) {
		snprintf(err, errlen, "out of memory");
		return EP_ENOMEM;
	}
	if (!j->num_nodes) {
		for (uint32_t n = 0; n < nnodes; n++)
			jn->map[n] = nnodes > 1 ? n : (uint32_t)me;
		jn->hash = 0;
		return 0;
	}
	const char *name = j->nodes;
	for (uint32_t n = 0; n < nnodes; n++, name += strlen(name) + 1) {
		/* its name, without the address a job may give */
		char nm[EPP_NODE_NAME_MAX + 1];
		snprintf(nm, sizeof(nm), "%.*s",
			 (int)epp_node_entry_name_len(name), name);
		const bool is_self = !strcmp(nm, self);
		char why[256] = "";
		int cn = is_self ? me
			 : srv->span ? srv->span->resolve(srv, name, why,
							  sizeof(why))
				     : -1;
		if (cn < 0) {
			snprintf(err, errlen, "group %s names node %s: %s",
				 j->name, nm,
				 why[0] ? why
					: "this daemon does not know it (not "
					  "in its peers)");
			return EP_EINVAL;
		}
		for (uint32_t o = 0; o < n; o++)
			if (jn->map[o] == (uint32_t)cn) {
				snprintf(err, errlen,
					 "group %s names node %s twice (node "
					 "%u and %u)",
					 j->name, nm, o, n);
				return EP_EINVAL;
			}
		if (is_self && n != mine) {
			snprintf(err, errlen,
				 "group %s names this node (%s) as node %u, "
				 "but rank %u is on node %u",
				 j->name, self, n, j->rank, mine);
			return EP_EMISMATCH;
		}
		if (!is_self && n == mine) {
			snprintf(err, errlen,
				 "group %s names %s as node %u, where rank %u "
				 "lives; this daemon is %s",
				 j->name, nm, n, j->rank, self);
			return EP_EMISMATCH;
		}
		jn->map[n] = (uint32_t)cn;
	}
	jn->hash = names_hash(j);
	return 0;
}

static int group_join(struct epd_session *c, uint64_t req_id, uint16_t flags,
		      const struct epp_join *j, struct join_nodes *jn);

int epd_group_join(struct epd_session *c, uint64_t req_id, uint16_t flags,
		   const struct epp_join *j)
{
	struct epd_server *srv = c->srv;
	char err[512];
	int code;
	struct join_nodes jn = {0};
	/* the nodes a list names stay while it is resolved: a full table
	 * does not forget one named earlier in the same list */
	if (srv->span && j->num_nodes)
		srv->span->resolve_pin(srv, true);
	code = join_nodes(srv, j, &jn, err, sizeof(err));
	if (srv->span && j->num_nodes)
		srv->span->resolve_pin(srv, false);
	if (code) {
		free(jn.map); /* a list refused after its map was made */
		epd_session_error(c, req_id, code, "%s", err);
		return code;
	}
	code = group_join(c, req_id, flags, j, &jn);
	free(jn.map); /* NULL where the new group took it */
	return code;
}

/* 1.16: a join linked to group j->link of this connection: *parent, or
 * an error (replied) if there is none, it is linked itself, or it failed
 * (here, or on another node: the group of key is failed with it). */
static int join_parent(struct epd_session *c, uint64_t req_id,
		       const struct epp_join *j, const char *key,
		       const struct join_nodes *jn,
		       struct epd_group **parent)
{
	struct epd_server *srv = c->srv;
	const uint32_t nnodes = j->world_size / j->ranks_per_node;
	struct epd_member *pm = epd_member_find(c, j->link);
	if (!pm) {
		epd_session_error(c, req_id, EP_ENOGROUP,
				 "the group to link %s to (id %lu) is not "
				 "joined on this connection",
				 j->name, (unsigned long)j->link);
		return EP_ENOGROUP;
	}
	struct epd_group *pg = pm->group;
	/* one level deep: no chains or cycles, so a failure reaches every
	 * linked group in one step (a chain as long as a uid's groups once
	 * recursed that deep on the loop's stack) */
	if (pg->link_parent) {
		epd_session_error(c, req_id, EP_EINVAL,
				 "group %s is itself linked to group %s: links "
				 "are one level deep",
				 pg->shape.name, pg->link_parent->shape.name);
		return EP_EINVAL;
	}
	/* failed, or failing on another node (a local op past what that node
	 * did would fail it; the linked group's would) */
	const bool failed = pg->state == EPD_G_FAILED;
	if (failed || pg->rfail_code) {
		const int code = failed ? pg->fail_code : pg->rfail_code;
		const char *why = failed ? pg->last_error : pg->rfail_msg;
		epd_session_error(c, req_id, code,
				 "group %s, which %s is linked to, failed: %s",
				 pg->shape.name, j->name, why);
		/* where it formed already, it fails at its first op (it can
		 * never have this node's ranks) */
		struct epd_group *o = epd_group_find(srv, key);
		if (o && o->state != EPD_G_FAILED)
			epd_group_link_fail(o, code, pg->shape.name, why);
		else if (!o && nnodes > 1 && srv->span->failed_key)
			srv->span->failed_key(srv, key, j, nnodes, jn->map,
					      jn->hash, code,
					      "a rank's linked group failed "
					      "here");
		return code;
	}
	*parent = pg;
	return 0;
}

/* The group of key for join j: found (the same job's, not failed, of the
 * same shape) or made; an error (replied) otherwise. sh: the hash of the
 * join's secret (if it has one). */
static int join_group(struct epd_session *c, uint64_t req_id,
		      const struct epp_join *j, struct join_nodes *jn,
		      const char *key, bool shared, const uint8_t sh[32],
		      struct epd_group **out)
{
	struct epd_server *srv = c->srv;
	char err[512];
	int code;
	struct epd_group *g = epd_group_find(srv, key);
	if (!g) {
		g = group_create(srv, c->uid, key, shared, j, jn, err,
				 sizeof(err), &code);
		if (!g) {
			if (code == EP_ELIMIT)
				srv->n_limited++;
			epd_session_error(c, req_id, code, "%s", err);
			return code;
		}
		if (j->secret_len) {
			g->has_secret = true;
			memcpy(g->secret_hash, sh, 32);
		}
		*out = g;
		return 0;
	}
	if (j->secret_len ? !g->has_secret || sodium_memcmp(sh, g->secret_hash,
							    32)
			  : g->has_secret) {
		/* the tag matched, the secret not (2^-64 apart) */
		epd_session_error(c, req_id, EP_EMISMATCH,
				 "group %s belongs to another job", j->name);
		return EP_EMISMATCH;
	}
	if (g->state == EPD_G_FAILED) {
		epd_session_error(c, req_id, EP_EFAILED,
				 "group %s failed (%s); it ends when its last "
				 "rank leaves",
				 g->shape.name, g->last_error);
		return EP_EFAILED;
	}
	code = shape_check(g, j, jn->hash, err, sizeof(err));
	if (code) {
		epd_session_error(c, req_id, code, "%s", err);
		return code;
	}
	*out = g;
	return 0;
}

/* Group g linked to parent (the join's link): refused if g is parent, has
 * groups linked to it, or is linked to another; else linked. */
static int join_link(struct epd_session *c, uint64_t req_id,
		     struct epd_group *g, struct epd_group *parent)
{
	if (parent == g) {
		epd_session_error(c, req_id, EP_EINVAL,
				 "group %s cannot be linked to itself",
				 g->shape.name);
		return EP_EINVAL;
	}
	if (g->link_parent && g->link_parent != parent) {
		epd_session_error(c, req_id, EP_EMISMATCH,
				 "group %s is linked to group %s; this join "
				 "names another",
				 g->shape.name, g->link_parent->shape.name);
		return EP_EMISMATCH;
	}
	if (!LIST_EMPTY(&g->linked)) {
		epd_session_error(c, req_id, EP_EINVAL,
				 "group %s has groups linked to it: links are "
				 "one level deep",
				 g->shape.name);
		return EP_EINVAL;
	}
	if (!g->link_parent) {
		g->link_parent = parent;
		list_add_tail(&parent->linked, &g->link_node);
	}
	return 0;
}

/* Is rank j->rank of g free? If not, EP_EDUPRANK (replied): checked
 * before anything of the join touches g: a duplicate's link must not
 * link the group to a group of the duplicate's connection. */
static int join_rank_free(struct epd_session *c, uint64_t req_id,
			  const struct epd_group *g, const struct epp_join *j)
{
	const struct epd_member *o = g->local[j->rank % j->ranks_per_node];
	if (!o)
		return 0;
	epd_session_error(c, req_id, EP_EDUPRANK,
			 "rank %u of group %s is already joined by pid %d",
			 j->rank, g->shape.name, (int)o->client->pid);
	return EP_EDUPRANK;
}

/* A member for rank j->rank of g (free): made, its GPU rank's state added
 * by the backend (a GPU group takes GPU ranks only, a host group host
 * ranks); an error (replied) otherwise. */
static int join_member(struct epd_session *c, uint64_t req_id,
		       struct epd_group *g, const struct epp_join *j,
		       struct epd_member **out)
{
	char err[512];
	const uint32_t l = j->rank % j->ranks_per_node;
	const bool gpu = !epp_uuid_is_zero(j->gpu_uuid);
	if (gpu != (g->dev != NULL) && g->njoined) {
		epd_session_error(c, req_id, EP_EMISMATCH,
				 "group %s has %s ranks; this rank is a %s rank",
				 g->shape.name, g->dev ? "GPU" : "host",
				 gpu ? "GPU" : "host");
		return EP_EMISMATCH;
	}
	if (gpu && !g->srv->dev) {
		epd_session_error(c, req_id, EP_EUNSUPPORTED,
				 "this epd has no GPU backend (%s)",
				 g->srv->backend_reason);
		return EP_EUNSUPPORTED;
	}
	struct epd_member *m = calloc(1, sizeof(*m));
	if (!m) {
		epd_session_error(c, req_id, EP_ENOMEM, "out of memory");
		return EP_ENOMEM;
	}
	m->client = c;
	m->group = g;
	m->rank = j->rank;
	m->local = l;
	m->dev_index = -1;
	if (gpu) {
		/* set first: a failed first rank's partial state is freed with
		 * the group, by the backend */
		g->dev = g->srv->dev;
		const int code = g->dev->add_rank(g, m, j, err, sizeof(err));
		if (code) {
			free(m);
			epd_session_error(c, req_id, code, "%s", err);
			return code;
		}
	}
	*out = m;
	return 0;
}

static int group_join(struct epd_session *c, uint64_t req_id, uint16_t flags,
		      const struct epp_join *j, struct join_nodes *jn)
{
	struct epd_server *srv = c->srv;
	int code;
	/* a job's secret: its own group of the name (a joiner with another
	 * secret, or none, makes or finds another) */
	uint8_t sh[32];
	if (j->secret_len)
		epd_secret_hash(j, sh);
	char key[EPP_GKEY_MAX + 1];
	bool shared = epd_group_key(&srv->cfg, c->uid, j->name,
				    j->secret_len ? sh : NULL, key,
				    sizeof(key));
	struct epd_group *parent = NULL, *g = NULL;
	if ((flags & EPP_F_JOIN_LINK) &&
	    (code = join_parent(c, req_id, j, key, jn, &parent)))
		return code;
	if ((code = join_group(c, req_id, j, jn, key, shared, sh, &g)) ||
	    (code = join_rank_free(c, req_id, g, j)))
		return code;
	struct epd_member *m = NULL;
	if ((parent && (code = join_link(c, req_id, g, parent))) ||
	    (code = join_member(c, req_id, g, j, &m))) {
		/* a group this join made, and nobody joined, goes */
		if (g->njoined == 0)
			epd_group_destroy(g);
		return code;
	}
	m->barrier_seq = g->round;
	m->pending_req = req_id;
	m->pending_type = EPP_JOIN;
	list_add_tail(&c->members, &m->cnode);
	g->local[m->local] = m;
	g->njoined++;
	epd_info("group %s: rank %u joined (client %lu, pid %d), %u/%u local",
		 g->shape.name, j->rank, (unsigned long)c->id, (int)c->pid,
		 g->njoined, g->shape.ranks_per_node);
	if (g->njoined == g->shape.ranks_per_node) {
		epd_group_became_ready(g);
		/* waiting for its nodes: a joiner that does not wait hears
		 * now */
		if (g->state == EPD_G_FORMING && (flags & EPP_F_JOIN_NOWAIT))
			epd_join_reply(m);
	} else {
		if (flags & EPP_F_JOIN_NOWAIT)
			epd_join_reply(m);
		if (g->njoined == 1 || !uv_is_active((uv_handle_t *)&g->timer))
			uv_timer_start(&g->timer, epd_group_timeout, g->timeout_ms,
				       0);
	}
	return 0;
}
