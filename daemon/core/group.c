/* SPDX-License-Identifier: MIT */
/*
 * Groups: creation on the first JOIN, readiness once every local rank joined,
 * failure when a rank goes away or a collective times out, replies to
 * members, the timeouts and their diagnosis, shutdown. The collectives'
 * entry and the barrier are in coll.c.
 */
#include "core.h"
#include "backend.h"
#include "group_int.h"

#include <sodium.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *epd_group_state_name(enum epd_group_state s)
{
	switch (s) {
	case EPD_G_FORMING: return "forming";
	case EPD_G_READY: return "ready";
	case EPD_G_FAILED: return "failed";
	}
	return "?";
}

struct epd_group *epd_group_find(struct epd_server *srv, const char *key)
{
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->groups)
	{
		struct epd_group *g = LIST_ENTRY(it, struct epd_group, node);
		if (!strcmp(g->key, key))
			return g;
	}
	return NULL;
}

/* Is name one of the shared_groups prefixes? */
static bool name_shared(const struct epd_config *cfg, const char *name)
{
	char buf[sizeof(cfg->shared_groups)];
	snprintf(buf, sizeof(buf), "%s", cfg->shared_groups);
	for (char *save, *t = strtok_r(buf, ", ", &save); t;
	     t = strtok_r(NULL, ", ", &save))
		if (!strcmp(t, "*") || !strncmp(name, t, strlen(t)))
			return true;
	return false;
}

/* Users' groups live in their own namespace: the same name from two uids
 * names two groups, so nobody can squat or join another user's group. */
bool epd_group_key(const struct epd_config *cfg, uid_t uid, const char *name,
		   const uint8_t *secret_hash, char *key, size_t cap)
{
	bool shared = name_shared(cfg, name);
	char tag[24] = "";
	if (secret_hash) {
		uint64_t t = 0;
		for (int i = 0; i < 8; i++)
			t = t << 8 | secret_hash[i];
		snprintf(tag, sizeof(tag), "#%016llx", (unsigned long long)t);
	}
	if (uid == 0 || shared)
		snprintf(key, cap, "%s%s", name, tag);
	else
		snprintf(key, cap, "%s~%u%s", name, (unsigned)uid, tag);
	return shared;
}

bool epd_group_visible(const struct epd_group *g,
		       const struct epd_session *c)
{
	if (g->has_secret)
		return epd_member_find((struct epd_session *)c, g->id) != NULL;
	return c->uid == 0 || c->uid == g->owner || g->shared;
}

/* The hash of a job's secret: keyed BLAKE2b, so that the tag in a key
 * says nothing of the secret. */
static void secret_hash(const struct epp_join *j, uint8_t out[32])
{
	static const uint8_t k[crypto_generichash_KEYBYTES_MIN] =
		"epd-job-secret.";
	crypto_generichash(out, 32, j->secret, j->secret_len, k, sizeof(k));
}

struct epd_member *epd_member_find(struct epd_session *c, uint64_t gid)
{
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &c->members)
	{
		struct epd_member *m = LIST_ENTRY(it, struct epd_member, cnode);
		if (m->group->id == gid)
			return m;
	}
	return NULL;
}

bool epd_group_job_ended(struct epd_group *g, void (*drop)(void *),
			 void *arg)
{
	g->busy = false;
	if (g->free_pending) { /* destroyed while the job ran */
		drop(arg);
		epd_group_free(g);
		return false;
	}
	if (g->state != EPD_G_READY) {
		/* failed while running: the ranks got the error already */
		drop(arg);
		return false;
	}
	return true;
}

void epd_group_free(struct epd_group *g)
{
	epd_handles_free(g);
	if (g->dev)
		g->dev->group_free(g);
	if (g->nnodes > 1 && g->srv->span)
		g->srv->span->freed(g); /* may keep the mapping a while */
	free(g->xop);
	epd_buf_destroy(g);
	free(g->local);
	free(g->rail_done);
	free(g->rail_remote);
	free(g->peer);
	free(g->arr_seq);
	free(g->arr_xops);
	free(g->dis_recv);
	free(g->dis_sent);
	free(g->node_map);
	free(g);
}

static void group_became_ready(struct epd_group *g);

void epd_group_nodes_up(struct epd_group *g)
{
	if (g->state == EPD_G_FORMING && g->await_nodes)
		group_became_ready(g);
}

uint32_t epd_group_node_of(const struct epd_group *g, uint32_t cn)
{
	for (uint32_t n = 0; n < g->nnodes; n++)
		if (g->node_map[n] == cn)
			return n;
	return UINT32_MAX;
}

static void group_timer_closed(uv_handle_t *h)
{
	struct epd_group *g = h->data;
	if (g->busy) /* the data-path job still reads the buffers */
		g->free_pending = true;
	else
		epd_group_free(g);
}

/* The one end of a group: idempotent (the last member's removal and a
 * failed join may both get here). */
static void group_destroy(struct epd_group *g)
{
	if (g->destroyed)
		return;
	g->destroyed = true;
	epd_info("group %s (id %lu) destroyed", g->shape.name,
		 (unsigned long)g->id);
	list_del(&g->node);
	/* no links outlive it, either way */
	list_del(&g->link_node);
	g->link_parent = NULL;
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &g->linked)
	{
		struct epd_group *ch = LIST_ENTRY(it, struct epd_group,
						  link_node);
		list_del(&ch->link_node);
		ch->link_parent = NULL;
	}
	g->timer_closing = true;
	uv_close((uv_handle_t *)&g->timer, group_timer_closed);
}

/* Clear a member's pending request: its id, and where its result goes
 * (the backend's completion callback, or NULL: the client). */
static uint64_t take_pending(struct epd_member *m, epd_member_complete_fn *done)
{
	uint64_t req = m->pending_req;
	*done = m->complete;
	m->pending_req = 0;
	m->pending_type = 0;
	m->complete = NULL;
	return req;
}

/* Reply to a member's pending request and clear it. */
void epd_member_reply_ok(struct epd_member *m, const void *p, uint32_t len)
{
	epd_member_complete_fn done;
	uint64_t req = take_pending(m, &done);
	if (done)
		done(m, 0, NULL, p, len);
	else
		epd_session_send(m->client, EPP_OK, 0, req, p, len, NULL, 0);
}

void epd_member_reply_err(struct epd_member *m, int code, const char *msg)
{
	epd_member_complete_fn done;
	uint64_t req = take_pending(m, &done);
	if (done)
		done(m, code, msg, NULL, 0);
	else
		epd_session_error(m->client, req, code, "%s", msg);
}

/* The global ranks of this node's local indices for which missing() holds,
 * as "3,5,7". */
void epd_list_ranks(char *out, size_t cap, struct epd_group *g,
		    bool (*missing)(struct epd_group *, uint32_t l, void *),
		    void *arg)
{
	size_t off = 0;
	out[0] = 0;
	for (uint32_t l = 0; l < g->shape.ranks_per_node; l++) {
		if (!missing(g, l, arg))
			continue;
		uint32_t r = g->node_index * g->shape.ranks_per_node + l;
		const struct epd_member *m = g->local[l];
		char why[96] = "";
		if (m && m->refused_type)
			snprintf(why, sizeof(why),
				 " (its last %s was refused: %s)",
				 epp_type_name(m->refused_type),
				 ep_strerror(m->refused_code));
		int n = snprintf(out + off, cap - off, "%s%u%s", off ? "," : "",
				 r, why);
		if (n < 0 || (size_t)n >= cap - off)
			break;
		off += (size_t)n;
	}
}

/* Group ch's linked group (named pname) failed (why): ch fails with that
 * code. Its ranks still waiting to join get the error and are removed,
 * as at the join timeout (the group goes with its last member). */
static void link_fail(struct epd_group *ch, int code, const char *pname,
		      const char *why)
{
	if (ch->state == EPD_G_FAILED || ch->destroyed)
		return;
	char msg[EPP_ERRMSG_MAX];
	snprintf(msg, sizeof(msg), "group %.64s, which it is linked to, "
		 "failed: %.900s",
		 pname, why);
	/* the ranks waiting to join it, before the failure replies to them */
	bool waiting[EPP_MAX_WORLD];
	const uint32_t rpn = ch->shape.ranks_per_node;
	for (uint32_t l = 0; l < rpn; l++)
		waiting[l] = ch->local[l] &&
			     ch->local[l]->pending_type == EPP_JOIN;
	/* failed first: its other nodes learn it (where it formed, its
	 * first op fails instead of waiting out the timeout) */
	epd_group_fail(ch, code, "%s", msg);
	for (uint32_t l = 0; l < rpn && !ch->destroyed; l++)
		if (waiting[l] && ch->local[l])
			epd_member_remove(ch->local[l], "the group it is "
							"linked to failed");
}

void epd_group_links_fail(struct epd_group *g, int code, const char *why)
{
	/* a removal in link_fail may destroy a linked group: it leaves this
	 * list, and the walk goes on from the next */
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &g->linked)
	link_fail(LIST_ENTRY(it, struct epd_group, link_node), code,
		  g->shape.name, why);
}

/* The group can no longer run collectives: every pending op fails with
 * `code`; later ops get the same code and message. */
void epd_group_fail(struct epd_group *g, int code, const char *fmt, ...)
{
	va_list ap;
	bool was_failed = g->state == EPD_G_FAILED;
	va_start(ap, fmt);
	vsnprintf(g->last_error, sizeof(g->last_error), fmt, ap);
	va_end(ap);
	/* Failed before anything below runs: a lower layer that reports a
	 * failure of its own while we notify it (a peer connection that dies
	 * on this send) finds the group failed already. */
	g->state = EPD_G_FAILED;
	g->fail_code = code;
	if (!was_failed)
		g->failed_ns = epd_now_ns();
	g->coll_type = 0;
	g->coll_arrived = 0;
	/* A rank leaving is how jobs end: not worth a warning. */
	epd_log(code == EP_EPEERLOST ? EPD_LOG_NOTICE : EPD_LOG_WARN,
		"group %s failed: %s", g->shape.name, g->last_error);
	if (!g->timer_closing)
		uv_timer_stop(&g->timer);
	if (g->dev)
		g->dev->group_failed(g);
	/* The group's other nodes learn it at once, not at their timeout;
	 * a running cross-node job is dropped when it ends. A failure that
	 * came from another node is told too, back to that node as well:
	 * a node's failure of a group is the last frame of that group from
	 * it, after which its frames are a later group's (doc/design.md
	 * section 5); that node's group, failed already, ignores it. */
	if (g->nnodes > 1 && g->srv->span)
		g->srv->span->failed(g, code, g->last_error, !was_failed);
	for (uint32_t l = 0; l < g->shape.ranks_per_node; l++) {
		struct epd_member *m = g->local[l];
		if (m && m->pending_req) {
			g->n_errors++;
			epd_member_reply_err(m, code, g->last_error);
		}
	}
	epd_group_links_fail(g, code, g->last_error);
}

static void join_reply(struct epd_member *m)
{
	struct epd_group *g = m->group;
	struct epp_join_ok ok = {.group_id = g->id,
				 .epoch = g->epoch,
				 .node_index = g->node_index,
				 .buf_size = g->buf_size,
				 .ready = g->state == EPD_G_READY};
	uint8_t buf[64];
	int fds[2] = {-1, -1};
	uint64_t req = m->pending_req;
	m->pending_req = 0;
	m->pending_type = 0;
	fds[0] = dup(g->buf_fd);
	if (fds[0] < 0) {
		epd_session_error(m->client, req, EP_ENOMEM,
				 "cannot duplicate the buffer descriptor: %m");
		return;
	}
	if (g->dev) {
		int rc = g->dev->export_region(g, m->local, &fds[1],
					       &ok.dev_size);
		if (rc) {
			close(fds[0]);
			epd_session_error(m->client, req, rc,
					 "cannot export the rank's GPU region");
			return;
		}
	}
	size_t n = epp_join_ok_encode(&ok, buf, sizeof(buf));
	epd_session_send(m->client, EPP_OK, 0, req, buf, (uint32_t)n, fds,
			g->dev ? 2 : 1);
}

bool epd_not_joined(struct epd_group *g, uint32_t l, void *arg)
{
	(void)arg;
	return g->local[l] == NULL;
}

static bool not_arrived(struct epd_group *g, uint32_t l, void *arg)
{
	uint64_t k = *(uint64_t *)arg;
	return !g->local[l] || g->local[l]->barrier_seq < k;
}

static bool not_in_coll(struct epd_group *g, uint32_t l, void *arg)
{
	return !g->local[l] || g->local[l]->pending_type != *(uint16_t *)arg;
}

void epd_group_timeout(uv_timer_t *t)
{
	struct epd_group *g = t->data;
	char miss[512];
	if (g->state == EPD_G_FORMING) {
		/* Joiners waiting for readiness give up and are removed. */
		char msg[1200];
		if (g->await_nodes) {
			g->srv->span->nodes_missing(g, miss, sizeof(miss));
			snprintf(msg, sizeof(msg),
				 "group %s not ready after %u ms: every rank "
				 "of this node joined, but these nodes of the "
				 "group never connected: %s",
				 g->shape.name, g->timeout_ms, miss);
		} else {
			epd_list_ranks(miss, sizeof(miss), g, epd_not_joined,
				       NULL);
			snprintf(msg, sizeof(msg),
				 "group %s not ready after %u ms; ranks never "
				 "joined: %s%s",
				 g->shape.name, g->timeout_ms, miss,
				 g->has_secret
					 ? " (a job's ranks join with one "
					   "secret: a rank with another is in "
					   "another group)"
					 : "");
		}
		epd_warn("%s", msg);
		/* every local rank joined and its nodes never came: the group
		 * fails, so that the ranks that did not wait for it (joined
		 * with EP_JOIN_NOWAIT) hear it too, and let go of its nodes;
		 * else it waits for whoever is missing to join */
		const bool fail = g->await_nodes;
		uint32_t stay = g->njoined;
		for (uint32_t l = 0; l < g->shape.ranks_per_node; l++) {
			struct epd_member *m = g->local[l];
			if (m && m->pending_type == EPP_JOIN) {
				epd_member_reply_err(m, EP_ETIMEDOUT, msg);
				epd_member_remove(m, "join timed out");
				if (--stay == 0)
					return; /* (the group is gone) */
			}
		}
		if (fail)
			epd_group_fail(g, EP_ETIMEDOUT, "%s", msg);
		return;
	}
	if (g->state != EPD_G_READY)
		return;
	if (!g->coll_type)
		return; /* nothing was waiting */
	if (g->coll_type != EPP_BARRIER && g->nnodes > 1 &&
	    g->coll_arrived == g->shape.ranks_per_node) {
		/* every local rank is in: name the remote ones missing */
		g->srv->span->missing(g, miss, sizeof(miss));
		epd_group_fail(g, EP_ETIMEDOUT,
			       "%s timed out after %u ms waiting for the other "
			       "nodes of the group; ranks never arrived: %s",
			       epp_type_name(g->coll_type), g->timeout_ms,
			       miss);
		return;
	}
	if (g->coll_type != EPP_BARRIER) {
		uint16_t type = g->coll_type;
		epd_group_timed_out(g, epp_type_name(type), 0, "",
				    "ranks never arrived", not_in_coll, &type,
				    NULL, "-");
		return;
	}
	uint64_t k = g->round + 1;
	/* Remote rail peers that never arrived (scale-out phase). */
	size_t off = 0;
	miss[0] = 0;
	const uint32_t S = g->dis_steps, N = g->nnodes;
	for (uint32_t l = 0; l < g->shape.ranks_per_node; l++)
		for (uint32_t n = 0; n < g->nnodes; n++) {
			/* dissemination: the partner of the first step that
			 * never came (it, or one it waits for, is missing) */
			uint32_t s = 0;
			while (s < S && g->dis_recv[l * S + s] >= k)
				s++;
			if (S ? s == S || n != (g->node_index + N -
						(1u << s) % N) % N
			      : n == g->node_index ||
					g->rail_remote[l * g->nnodes + n] >= k)
				continue;
			int w = snprintf(miss + off, sizeof(miss) - off,
					 "%s%u", off ? "," : "",
					 n * g->shape.ranks_per_node + l);
			if (w < 0 || (size_t)w >= sizeof(miss) - off)
				break;
			off += (size_t)w;
		}
	epd_group_timed_out(g, "barrier", k, "", "ranks never arrived",
			    not_arrived, &k, miss, "-");
}

void epd_group_timed_out(struct epd_group *g, const char *op, uint64_t k,
			 const char *where, const char *who,
			 bool (*missing)(struct epd_group *, uint32_t l, void *),
			 void *arg, const char *extra, const char *none)
{
	char miss[640], num[24] = "";
	epd_list_ranks(miss, sizeof(miss), g, missing, arg);
	if (extra && *extra) {
		size_t off = strlen(miss);
		snprintf(miss + off, sizeof(miss) - off, "%s%s", off ? "," : "",
			 extra);
	}
	if (k)
		snprintf(num, sizeof(num), " %llu", (unsigned long long)k);
	epd_group_fail(g, EP_ETIMEDOUT, "%s%s timed out after %u ms%s; %s: %s",
		       op, num, g->timeout_ms, where, who,
		       *miss ? miss : none);
}

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
	if (g) {
		free(g->local);
		free(g->rail_done);
		free(g->rail_remote);
		free(g->peer);
		free(g->arr_seq);
		free(g->arr_xops);
		free(g->dis_recv);
		free(g->dis_sent);
		free(g->node_map);
		free(g);
	}
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

static void group_became_ready(struct epd_group *g)
{
	/* across nodes, once every node of the group is connected */
	if (g->nnodes > 1 && !g->srv->span->nodes_up(g)) {
		if (!g->await_nodes)
			epd_info("group %s: every local rank joined; waiting "
				 "for its nodes' connections",
				 g->shape.name);
		g->await_nodes = true;
		if (!g->timer_closing &&
		    !uv_is_active((uv_handle_t *)&g->timer))
			uv_timer_start(&g->timer, epd_group_timeout,
				       g->timeout_ms, 0);
		return;
	}
	g->await_nodes = false;
	g->state = EPD_G_READY;
	uv_timer_stop(&g->timer);
	if (g->dev) {
		char err[256];
		int rc = g->dev->group_ready(g, err, sizeof(err));
		if (rc) {
			epd_group_fail(g, rc, "%s", err);
			for (uint32_t l = 0; l < g->shape.ranks_per_node; l++) {
				struct epd_member *m = g->local[l];
				if (m && m->pending_type == EPP_JOIN)
					epd_member_reply_err(m, rc, err);
			}
			return;
		}
	}
	epd_info("group %s ready (%u local ranks)", g->shape.name, g->njoined);
	if (g->nnodes > 1)
		g->srv->span->ready(g);
	for (uint32_t l = 0; l < g->shape.ranks_per_node; l++) {
		struct epd_member *m = g->local[l];
		if (m && m->pending_type == EPP_JOIN)
			join_reply(m);
	}
}

/* FNV-1a, 64 bits, over the names and their NULs. */
/* The hash of a join's node names (an entry's name, not the address a
 * job may give with it: ranks that reach the same nodes by other
 * addresses name the same group). */
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
			link_fail(o, code, pg->shape.name, why);
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
		secret_hash(j, sh);
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
			group_destroy(g);
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
		group_became_ready(g);
		/* waiting for its nodes: a joiner that does not wait hears
		 * now */
		if (g->state == EPD_G_FORMING && (flags & EPP_F_JOIN_NOWAIT))
			join_reply(m);
	} else {
		if (flags & EPP_F_JOIN_NOWAIT)
			join_reply(m);
		if (g->njoined == 1 || !uv_is_active((uv_handle_t *)&g->timer))
			uv_timer_start(&g->timer, epd_group_timeout, g->timeout_ms,
				       0);
	}
	return 0;
}

void epd_member_remove(struct epd_member *m, const char *why)
{
	struct epd_group *g = m->group;
	struct epd_session *c = m->client;
	g->local[m->local] = NULL;
	g->njoined--;
	list_del(&m->cnode);
	if (g->dev)
		g->dev->remove_rank(g, m->local);
	epd_info("group %s: rank %u (pid %d) removed: %s", g->shape.name,
		 m->rank, (int)c->pid, why);
	/* Who left a group that formed, before a failure releases it, and
	 * also once it failed (EPP_CTL_GONE: the low-latency kernels of
	 * shrink mode go on without each rank that goes). */
	if (g->state != EPD_G_FORMING && g->map && m->rank < 64)
		__atomic_fetch_or((uint64_t *)(g->map + EPP_CTL_GROUP_SLOT +
					       EPP_CTL_GONE),
				  1ull << m->rank, __ATOMIC_RELEASE);
	if (g->state == EPD_G_READY)
		epd_group_fail(g, EP_EPEERLOST, "rank %u (pid %d) left the group: %s",
			   m->rank, (int)c->pid, why);
	/* a forming group no longer has every local rank: it forms when
	 * they are all there again, not when its nodes come */
	if (g->state == EPD_G_FORMING)
		g->await_nodes = false;
	free(m->aq);
	free(m);
	if (g->njoined == 0)
		group_destroy(g);
	else if (g->state == EPD_G_FORMING && !g->timer_closing &&
		 !uv_is_active((uv_handle_t *)&g->timer))
		uv_timer_start(&g->timer, epd_group_timeout, g->timeout_ms, 0);
}

/* The member of group gid on this connection, or an ENOGROUP reply. */
struct epd_member *epd_member_lookup(struct epd_session *c, uint64_t req_id,
					uint64_t gid)
{
	struct epd_member *m = epd_member_find(c, gid);
	if (!m)
		epd_session_error(c, req_id, EP_ENOGROUP,
				 "group id %lu is not joined on this "
				 "connection",
				 (unsigned long)gid);
	return m;
}

int epd_group_leave(struct epd_session *c, uint64_t req_id, uint64_t gid)
{
	struct epd_member *m = epd_member_lookup(c, req_id, gid);
	if (!m)
		return EP_ENOGROUP;
	/* (a stream-ordered op in the host path does not hold a leave: the
	 * group fails as for any rank leaving with work queued) */
	if (m->pending_req && !m->complete) {
		epd_session_error(c, req_id, EP_EBUSY,
				 "an operation of this rank is in flight");
		return EP_EBUSY;
	}
	epd_member_remove(m, "left");
	epd_session_send(c, EPP_OK, 0, req_id, NULL, 0, NULL, 0);
	return 0;
}

void epd_groups_shutdown(struct epd_server *srv)
{
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->groups)
	{
		struct epd_group *g = LIST_ENTRY(it, struct epd_group, node);
		if (g->state != EPD_G_FAILED)
			epd_group_fail(g, EP_ESHUTDOWN, "daemon is shutting down");
		for (uint32_t l = 0; l < g->shape.ranks_per_node; l++) {
			struct epd_member *m = g->local[l];
			if (m && m->pending_req)
				epd_member_reply_err(m, EP_ESHUTDOWN,
						 "daemon is shutting down");
		}
	}
}
