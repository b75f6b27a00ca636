/* SPDX-License-Identifier: MIT */
/*
 * Groups: readiness once every local rank joined (a JOIN itself is
 * join.c's), failure when a rank goes away or a collective times out,
 * replies to members, the timeouts and their diagnosis, leaving,
 * shutdown. The collectives' entry and the barrier are in coll.c.
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
void epd_secret_hash(const struct epp_join *j, uint8_t out[32])
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

void epd_group_mem_free(struct epd_group *g)
{
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

void epd_group_free(struct epd_group *g)
{
	epd_handles_free(g);
	if (g->dev)
		g->dev->group_free(g);
	if (g->nnodes > 1 && g->srv->span)
		g->srv->span->freed(g); /* may keep the mapping a while */
	free(g->xop);
	epd_buf_destroy(g);
	epd_group_mem_free(g);
}


void epd_group_nodes_up(struct epd_group *g)
{
	if (g->state == EPD_G_FORMING && g->await_nodes)
		epd_group_became_ready(g);
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
void epd_group_destroy(struct epd_group *g)
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
void epd_group_link_fail(struct epd_group *ch, int code, const char *pname,
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
	/* a removal in epd_group_link_fail may destroy a linked group: it
	 * leaves this list, and the walk goes on from the next */
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &g->linked)
	epd_group_link_fail(LIST_ENTRY(it, struct epd_group, link_node), code,
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

void epd_join_reply(struct epd_member *m)
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

void epd_group_became_ready(struct epd_group *g)
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
			epd_join_reply(m);
	}
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
		epd_group_destroy(g);
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
