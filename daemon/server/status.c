/* SPDX-License-Identifier: MIT */
/* `epctl status`: the daemon, its clients and its groups as JSON. */
#include "server.h"
#include "cluster/cluster.h"
#include "core/backend.h"
#include "util/stall.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static json_t *shape_json(const struct epp_join *s)
{
	return json_pack("{s:I, s:I, s:I, s:I, s:s, s:I}", "num_experts",
			 (json_int_t)s->num_experts, "hidden",
			 (json_int_t)s->hidden, "max_tokens_per_rank",
			 (json_int_t)s->max_tokens, "topk",
			 (json_int_t)s->topk, "dtype",
			 s->dtype == EP_DTYPE_FP8 ? "fp8" : "bf16", "recv_areas",
			 (json_int_t)s->recv_areas);
}

static json_t *group_json(struct epd_group *g)
{
	json_t *joined = json_array(), *missing = json_array();
	uint32_t rpn = g->shape.ranks_per_node;
	for (uint32_t l = 0; l < rpn; l++) {
		json_int_t r = (json_int_t)(g->node_index * rpn + l);
		json_array_append_new(g->local[l] ? joined : missing,
				      json_integer(r));
	}
	json_t *o = json_pack(
		"{s:s, s:s, s:I, s:I, s:s, s:I, s:I, s:I, s:I, s:o, s:o, s:I, "
		"s:o, s:{s:I, s:I, s:I, s:I, s:I}, s:I}",
		"name", g->shape.name, "backend", g->dev ? g->dev->name : "host", "id",
		(json_int_t)g->id, "epoch",
		(json_int_t)g->epoch, "state", epd_group_state_name(g->state),
		"world_size", (json_int_t)g->shape.world_size,
		"ranks_per_node", (json_int_t)rpn, "node_index",
		(json_int_t)g->node_index, "nodes", (json_int_t)g->nnodes,
		"joined", joined, "missing", missing, "timeout_ms",
		(json_int_t)g->timeout_ms, "shape", shape_json(&g->shape),
		"ops", "barrier", (json_int_t)g->n_barrier, "dispatch",
		(json_int_t)g->n_dispatch, "combine", (json_int_t)g->n_combine,
		"errors", (json_int_t)g->n_errors, "bytes_moved",
		(json_int_t)g->bytes_moved, "buffer_bytes",
		(json_int_t)g->buf_size);
	if (o) {
		json_object_set_new(
			o, "op_seconds",
			json_pack("{s:f, s:f, s:f}", "barrier",
				  (double)g->op_ns[0] / 1e9, "dispatch",
				  (double)g->op_ns[1] / 1e9, "combine",
				  (double)g->op_ns[2] / 1e9));
		json_object_set_new(o, "owner_uid",
				    json_integer((json_int_t)g->owner));
		json_object_set_new(o, "shared", json_boolean(g->shared));
		/* the group it fails with (libep's low-latency pseudo group
		 * names its group), or null */
		json_object_set_new(o, "linked_to",
				    g->link_parent
					    ? json_string(g->link_parent->shape.name)
					    : json_null());
		/* handles not yet released (host routings) */
		json_object_set_new(o, "handles",
				    json_pack("{s:I, s:I}", "held",
					      (json_int_t)g->nhandles, "bytes",
					      (json_int_t)g->handle_bytes));
	}
	if (o && g->state == EPD_G_FAILED)
		json_object_set_new(o, "last_error",
				    json_pack("{s:i, s:s, s:s}", "code",
					      g->fail_code, "name",
					      ep_strerror(g->fail_code),
					      "message", g->last_error));
	else if (o)
		json_object_set_new(o, "last_error", json_null());
	json_t *spans = json_array();
	for (uint32_t n = 0; n < g->nnodes; n++)
		json_array_append_new(
			spans, json_string(epd_cluster_node_name(g, n)));
	if (o)
		json_object_set_new(o, "spans", spans);
	else
		json_decref(spans);
	/* across nodes: how rows reach this node's ranks */
	if (o && g->nnodes > 1)
		json_object_set_new(o, "rows_in",
				    json_string(g->xw ? "rdma-write" : "frames"));
	json_t *cu = g->dev ? g->dev->group_status(g) : NULL;
	if (o && cu)
		json_object_set_new(o, g->dev->name, cu);
	return o;
}

/* A connection and its groups (those of a job's secret only to a viewer
 * vs that is a member of them too). */
static json_t *client_json(struct epd_client *c, uint64_t now,
			   const struct epd_session *vs)
{
	json_t *ms = json_array();
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &c->s.members)
	{
		struct epd_member *m = LIST_ENTRY(it, struct epd_member, cnode);
		if (!epd_group_visible(m->group, vs))
			continue;
		json_array_append_new(
			ms, json_pack("{s:s, s:I, s:I, s:s, s:i, s:b}", "group",
				      m->group->shape.name, "group_id",
				      (json_int_t)m->group->id, "rank",
				      (json_int_t)m->rank, "pending",
				      m->pending_req
					      ? epp_type_name(m->pending_type)
					      : "",
				      "gpu", m->dev_index, "mps", m->mps));
	}
	return json_pack("{s:I, s:i, s:I, s:s, s:f, s:o}", "id",
			 (json_int_t)c->s.id, "pid", (int)c->s.pid, "uid",
			 (json_int_t)c->s.uid, "name", c->name, "connected_s",
			 (double)(now - c->connected_ns) / 1e9, "groups", ms);
}

/* A group of a job's secret, to a viewer outside it: that it exists, its
 * state and size, no ranks, pids, shape or use. */
static json_t *private_group_json(const struct epd_group *g)
{
	return json_pack("{s:s, s:s, s:I, s:I, s:b}", "name", g->shape.name,
			 "state", epd_group_state_name(g->state), "world_size",
			 (json_int_t)g->shape.world_size, "nodes",
			 (json_int_t)g->nnodes, "private", 1);
}

/* What session `vs` may see: root everything; another user its own
 * connections and the groups it owns or that are shared, and counts of the
 * rest (no names, pids or uids of other users). A group of a job's secret
 * shows its details to its own members only (root included: to others it
 * is a name and a state). */
char *epd_status_json(struct epd_server *srv, const struct epd_session *vs)
{
	const uid_t viewer = vs->uid;
	uint64_t now = epd_now_ns();
	json_t *clients = json_array(), *groups = json_array();
	struct list_node *it, *tmp;
	json_int_t hidden_clients = 0, hidden_groups = 0;
	LIST_FOREACH(it, tmp, &srv->clients)
	{
		struct epd_client *c = LIST_ENTRY(it, struct epd_client, node);
		if (viewer == 0 || c->s.uid == viewer)
			json_array_append_new(clients, client_json(c, now, vs));
		else
			hidden_clients++;
	}
	LIST_FOREACH(it, tmp, &srv->groups)
	{
		struct epd_group *g = LIST_ENTRY(it, struct epd_group, node);
		if (epd_group_visible(g, vs))
			json_array_append_new(groups, group_json(g));
		else if (g->has_secret && (viewer == 0 || viewer == g->owner))
			json_array_append_new(groups, private_group_json(g));
		else
			hidden_groups++;
	}
	json_t *root = json_pack(
		"{s:{s:s, s:i, s:f, s:s, s:s, s:s, s:b, s:s, s:I, s:I, s:I, "
		"s:{s:i, s:i}}, s:o, s:o}",
		"daemon", "version", PACKAGE_VERSION, "pid", (int)getpid(),
		"uptime_s", (double)(now - srv->start_ns) / 1e9, "backend",
		srv->backend, "backend_reason", srv->backend_reason, "socket",
		srv->cfg.socket_path, "systemd", srv->systemd, "log_level",
		epd_log_level_name(epd_log_level), "clients_accepted",
		(json_int_t)srv->n_accepted, "clients_rejected",
		(json_int_t)srv->n_rejected, "protocol_errors",
		(json_int_t)srv->n_proto_errors, "protocol", "major",
		EPP_VERSION_MAJOR, "minor", EPP_VERSION_MINOR, "clients",
		clients, "groups", groups);
	if (!root)
		return NULL;
	/* the document's schema (epctl(8)): raised when a field changes
	 * meaning or goes away, not when one is added */
	json_object_set_new(root, "schema", json_integer(1));
	json_object_set_new(root, "other_users",
			    json_pack("{s:I, s:I}", "clients", hidden_clients,
				      "groups", hidden_groups));
	json_object_set_new(json_object_get(root, "daemon"), "limits",
			    json_pack("{s:I, s:I, s:I, s:I, s:I, s:I}",
				      "connections_per_user",
				      (json_int_t)srv->cfg.limits.conns_per_uid,
				      "groups_per_user",
				      (json_int_t)srv->cfg.limits.groups_per_uid,
				      "bytes_per_user",
				      (json_int_t)srv->cfg.limits.bytes_per_uid,
				      "connections",
				      (json_int_t)srv->cfg.limits.conns,
				      "groups", (json_int_t)srv->cfg.limits.groups,
				      "bytes", (json_int_t)srv->cfg.limits.bytes));
	json_object_set_new(json_object_get(root, "daemon"), "limit_refusals",
			    json_integer((json_int_t)srv->n_limited));
	/* SIGHUP reloads: a failed one keeps the running configuration, and
	 * says so here until one succeeds */
	json_object_set_new(
		json_object_get(root, "daemon"), "reload",
		json_pack("{s:I, s:I, s:b, s:s, s:f}", "count",
			  (json_int_t)srv->reloads, "failures",
			  (json_int_t)srv->reload_failures, "failed",
			  srv->reload_failed, "error", srv->reload_error,
			  "age_s",
			  srv->reload_ns ? (double)(now - srv->reload_ns) / 1e9
					 : 0.0));
	/* how often the event loop stood still (util/stall.h) */
	uint64_t stalls, longest;
	epd_stall_stats(&stalls, &longest);
	json_object_set_new(json_object_get(root, "daemon"), "loop_stalls",
			    json_pack("{s:I, s:I}", "count", (json_int_t)stalls,
				      "longest_ms", (json_int_t)longest));
	/* the device backend's devices ("cuda": null without one) */
	json_t *cu = srv->dev ? srv->dev->status(srv) : NULL;
	json_object_set_new(json_object_get(root, "daemon"),
			    srv->dev ? srv->dev->name : "cuda",
			    cu ? cu : json_null());
	json_t *cl = epd_cluster_status(srv);
	if (cl)
		json_object_set_new(cl, "pooled_bytes",
				    json_integer((json_int_t)
							 epd_xbufs_bytes(srv)));
	json_object_set_new(root, "cluster", cl ? cl : json_null());
	char *s = json_dumps(root, JSON_COMPACT);
	json_decref(root);
	return s;
}
