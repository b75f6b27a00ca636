/* SPDX-License-Identifier: MIT */
/*
 * epctl: the operator's view of epd. Every command reads the daemon's
 * status (one JSON document, schema in epctl(8)) and shows part of it.
 *
 * Exit codes: 0 ok, 1 the daemon is unreachable or refused, 2 usage,
 * 3 the daemon answered something malformed. `epctl check`: 0 healthy,
 * 1 degraded, 2 down.
 */
#include <getopt.h>
#include <stdbool.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep/ep.h"

enum { EXIT_UNREACHABLE = 1, EXIT_USAGE = 2, EXIT_PROTO = 3 };
enum { CHECK_HEALTHY = 0, CHECK_DEGRADED = 1, CHECK_DOWN = 2 };

/* The status schema this epctl reads ("schema" in the JSON). */
#define STATUS_SCHEMA 1

struct cmd {
	const char *name;
	void (*show)(json_t *root); /* NULL: the command handles it */
	const char *args;
	const char *help;
};

static const char *jstr(json_t *o, const char *k)
{
	const char *s = json_string_value(json_object_get(o, k));
	return s ? s : "";
}

static long long jint(json_t *o, const char *k)
{
	return json_integer_value(json_object_get(o, k));
}

static void fmt_duration(char *out, size_t cap, double s)
{
	long t = (long)s;
	if (t >= 86400)
		snprintf(out, cap, "%ldd %ldh", t / 86400, t % 86400 / 3600);
	else if (t >= 3600)
		snprintf(out, cap, "%ldh %ldm", t / 3600, t % 3600 / 60);
	else if (t >= 60)
		snprintf(out, cap, "%ldm %lds", t / 60, t % 60);
	else
		snprintf(out, cap, "%.1fs", s);
}

static void fmt_ranks(char *out, size_t cap, json_t *arr)
{
	size_t off = 0, i;
	json_t *v;
	out[0] = 0;
	json_array_foreach(arr, i, v)
	{
		int n = snprintf(out + off, cap - off, "%s%lld", i ? "," : "",
				 json_integer_value(v));
		if (n < 0 || (size_t)n >= cap - off) {
			snprintf(out + (cap > 4 ? cap - 4 : 0), 4, "...");
			return;
		}
		off += (size_t)n;
	}
	if (!off)
		snprintf(out, cap, "-");
}

/* How a GPU group's barriers run ("barrier" in the status). */
static const char *barrier_engine(const char *b)
{
	if (!strcmp(b, "kernel"))
		return "resident kernel";
	if (!strcmp(b, "host"))
		return "host thread";
	return "stream ops";
}

static void print_daemon(json_t *root)
{
	json_t *d = json_object_get(root, "daemon");
	char up[32];
	fmt_duration(up, sizeof(up),
		     json_number_value(json_object_get(d, "uptime_s")));
	json_t *proto = json_object_get(d, "protocol");
	printf("epd %s, pid %lld, up %s, backend %s (%s)\n", jstr(d, "version"),
	       jint(d, "pid"), up, jstr(d, "backend"),
	       jstr(d, "backend_reason"));
	printf("socket %s, protocol %lld.%lld, log level %s%s\n",
	       jstr(d, "socket"), jint(proto, "major"), jint(proto, "minor"),
	       jstr(d, "log_level"),
	       json_is_true(json_object_get(d, "systemd")) ? ", under systemd"
							   : "");
}

static void print_peers(json_t *root)
{
	json_t *cl = json_object_get(root, "cluster");
	if (!json_is_object(cl)) {
		printf("cluster: none (a single node)\n");
		return;
	}
	{
		size_t i;
		json_t *p;
		printf("cluster: node %s (index %lld of %lld), view epoch %lld, "
		       "%s (%s), rejected %lld, %.1f MiB of row buffers kept\n"
		       "  peers: %s  (S self, U up, D down)\n",
		       jstr(cl, "node"), jint(cl, "index"), jint(cl, "nodes"),
		       jint(cl, "view_epoch"), jstr(cl, "transport"),
		       jstr(cl, "transport_reason"), jint(cl, "rejected"),
		       (double)jint(cl, "pooled_bytes") / 1048576.0,
		       jstr(cl, "row"));
		json_t *lr = json_object_get(cl, "last_rejection");
		if (json_is_object(lr))
			printf("  last rejected peer: %s, %.0f s ago: %s\n",
			       jstr(lr, "peer"),
			       json_real_value(json_object_get(lr, "age_s")),
			       jstr(lr, "why"));
		json_t *row;
		printf("  connectivity (row: that node's view):\n");
		json_array_foreach(json_object_get(cl, "matrix"), i, row)
		{
			json_t *pi = json_array_get(json_object_get(cl, "peers"),
						    i);
			printf("    %-12s %s  epoch %lld\n", jstr(pi, "name"),
			       json_string_value(row), jint(pi, "view_epoch"));
		}
		/* idle peers (no group here needs them): counted, not
		 * listed, in a cluster of hundreds */
		size_t idle = 0;
		json_array_foreach(json_object_get(cl, "peers"), i, p)
		{
			if (!strcmp(jstr(p, "state"), "idle"))
				idle++;
			if (!strcmp(jstr(p, "state"), "self") ||
			    !strcmp(jstr(p, "state"), "idle"))
				continue;
			printf("  %-12s %-22s %-5s %-4s downs %lld%s%s\n",
			       jstr(p, "name"), jstr(p, "addr"),
			       jstr(p, "state"), jstr(p, "transport"),
			       jint(p, "downs"),
			       *jstr(p, "last_error") ? ", last: " : "",
			       jstr(p, "last_error"));
		}
		if (idle)
			printf("  %zu other nodes idle (no group here spans "
			       "them)\n",
			       idle);
	}
}

static void print_clients(json_t *root)
{
	json_t *d = json_object_get(root, "daemon");
	json_t *clients = json_object_get(root, "clients");
	printf("clients: %zu connected (accepted %lld, rejected %lld, "
	       "protocol errors %lld)\n",
	       json_array_size(clients), jint(d, "clients_accepted"),
	       jint(d, "clients_rejected"), jint(d, "protocol_errors"));
	size_t i, k;
	json_t *c, *m;
	if (json_array_size(clients))
		printf("  %4s %8s %6s %-10s %s\n", "ID", "PID", "UID", "UP",
		       "GROUP:RANK");
	json_array_foreach(clients, i, c)
	{
		char line[256] = "", cup[32];
		size_t off = 0;
		json_array_foreach(json_object_get(c, "groups"), k, m)
		{
			int n = snprintf(line + off, sizeof(line) - off,
					 "%s%s:%lld%s%s", k ? " " : "",
					 jstr(m, "group"), jint(m, "rank"),
					 *jstr(m, "pending") ? " in " : "",
					 jstr(m, "pending"));
			if (n < 0 || (size_t)n >= sizeof(line) - off)
				break;
			off += (size_t)n;
		}
		fmt_duration(cup, sizeof(cup),
			     json_number_value(json_object_get(c, "connected_s")));
		printf("  %4lld %8lld %6lld %-10s %s\n", jint(c, "id"),
		       jint(c, "pid"), jint(c, "uid"), cup,
		       off ? line : "-");
	}
}

static void print_groups(json_t *root)
{
	size_t i;
	json_t *g;
	json_t *groups = json_object_get(root, "groups");
	printf("groups: %zu\n", json_array_size(groups));
	if (json_array_size(groups))
		printf("  %-16s %5s %-8s %-5s %5s %-8s %-16s %-16s %8s %8s "
		       "%8s %6s\n",
		       "NAME", "ID", "STATE", "BACKEND", "WORLD", "NODE",
		       "JOINED", "MISSING", "BARRIERS", "DISPATCH", "COMBINE",
		       "ERRORS");
	json_array_foreach(groups, i, g)
	{
		char joined[64], missing[64], node[24];
		fmt_ranks(joined, sizeof(joined), json_object_get(g, "joined"));
		fmt_ranks(missing, sizeof(missing),
			  json_object_get(g, "missing"));
		snprintf(node, sizeof(node), "%lld/%lld", jint(g, "node_index"),
			 jint(g, "nodes"));
		json_t *ops = json_object_get(g, "ops");
		printf("  %-16s %5lld %-8s %-5s %5lld %-8s %-16s %-16s %8lld "
		       "%8lld %8lld %6lld\n",
		       jstr(g, "name"), jint(g, "id"), jstr(g, "state"),
		       jstr(g, "backend"), jint(g, "world_size"), node, joined,
		       missing, jint(ops, "barrier"), jint(ops, "dispatch"),
		       jint(ops, "combine"), jint(ops, "errors"));
		json_t *cu = json_object_get(g, "cuda");
		if (json_is_object(cu))
			printf("    gpu %lld%s: barrier %s, row copy %s on %lld "
			       "SMs, "
			       "ops completed %lld, last dispatch %.0f us, "
			       "combine %.0f us\n",
			       jint(cu, "gpu"),
			       json_is_true(json_object_get(cu, "staged"))
				       ? " (staged through host memory)"
				       : "",
			       barrier_engine(jstr(cu, "barrier")),
			       jstr(cu, "row_copy"), jint(cu, "row_copy_sms"),
			       jint(cu, "ops_completed"),
			       json_number_value(
				       json_object_get(cu, "last_dispatch_us")),
			       json_number_value(
				       json_object_get(cu, "last_combine_us")));
		json_t *le = json_object_get(g, "last_error");
		if (json_is_object(le))
			printf("    last error: %s: %s\n", jstr(le, "name"),
			       jstr(le, "message"));
	}
}

static void print_status(json_t *root)
{
	print_daemon(root);
	if (json_is_object(json_object_get(root, "cluster")))
		print_peers(root);
	putchar('\n');
	print_clients(root);
	putchar('\n');
	print_groups(root);
}

/* Health, for monitoring: 0 healthy (answers, every group and every
 * peer fine), 1 degraded (answers, but a group failed or a peer is down),
 * 2 down (unreachable or a malformed answer: handled by the caller). */
static int check(json_t *root, bool quiet)
{
	char why[512] = "";
	size_t off = 0, i;
	json_t *g, *p;
	json_array_foreach(json_object_get(root, "groups"), i, g)
	{
		if (strcmp(jstr(g, "state"), "failed") || off >= sizeof(why))
			continue;
		json_t *le = json_object_get(g, "last_error");
		int n = snprintf(why + off, sizeof(why) - off,
				 "%sgroup %s failed: %s", off ? "; " : "",
				 jstr(g, "name"), jstr(le, "message"));
		off += n > 0 ? (size_t)n : 0;
	}
	json_t *cl = json_object_get(root, "cluster");
	size_t up = 0, n_peers = 0;
	json_array_foreach(json_object_get(cl, "peers"), i, p)
	{
		/* an idle node is no group's: not a fault */
		if (!strcmp(jstr(p, "state"), "self") ||
		    !strcmp(jstr(p, "state"), "idle"))
			continue;
		n_peers++;
		if (!strcmp(jstr(p, "state"), "up")) {
			up++;
		} else if (off < sizeof(why)) {
			int n = snprintf(why + off, sizeof(why) - off,
					 "%snode %s down: %s", off ? "; " : "",
					 jstr(p, "name"),
					 jstr(p, "last_error"));
			off += n > 0 ? (size_t)n : 0;
		}
	}
	json_t *d = json_object_get(root, "daemon");
	json_t *rl = json_object_get(d, "reload");
	if (json_is_true(json_object_get(rl, "failed")) && off < sizeof(why)) {
		int n = snprintf(why + off, sizeof(why) - off,
				 "%sthe last reload failed (the running "
				 "configuration is the one before): %s",
				 off ? "; " : "", jstr(rl, "error"));
		off += n > 0 ? (size_t)n : 0;
	}
	if (!quiet) {
		if (off)
			printf("degraded: %s\n", why);
		else
			printf("healthy: epd %s, backend %s, %zu groups%s",
			       jstr(d, "version"), jstr(d, "backend"),
			       json_array_size(json_object_get(root, "groups")),
			       json_is_object(cl) ? "" : "\n");
		if (!off && json_is_object(cl))
			printf(", cluster %zu/%zu peers up\n", up, n_peers);
	}
	return off ? CHECK_DEGRADED : CHECK_HEALTHY;
}

/* OpenMetrics text (what Prometheus scrapes; no C library for it is
 * packaged, and the format is a few lines). */
static void om_escape(const char *s, char *out, size_t cap)
{
	size_t o = 0;
	for (; *s && o + 3 < cap; s++) {
		if (*s == '"' || *s == '\\') {
			out[o++] = '\\';
			out[o++] = *s;
		} else if (*s == '\n') {
			out[o++] = '\\';
			out[o++] = 'n';
		} else {
			out[o++] = *s;
		}
	}
	out[o] = 0;
}

static void om_head(const char *name, const char *type, const char *help)
{
	printf("# TYPE %s %s\n# HELP %s %s\n", name, type, name, help);
}

/* The daemon's own metrics: up, uptime, counters, clients. */
static void metrics_daemon(json_t *root)
{
	json_t *d = json_object_get(root, "daemon");
	om_head("epd_up", "gauge", "1 while the daemon answers.");
	printf("epd_up 1\n");
	om_head("epd_uptime_seconds", "gauge", "Seconds since the daemon started.");
	printf("epd_uptime_seconds %.3f\n",
	       json_number_value(json_object_get(d, "uptime_s")));
	static const struct {
		const char *key, *name, *help;
	} dc[] = {
		{"clients_accepted", "epd_clients_accepted",
		 "Connections accepted."},
		{"clients_rejected", "epd_clients_rejected",
		 "Connections refused (allow_users, limits)."},
		{"protocol_errors", "epd_protocol_errors",
		 "Malformed or unexpected frames from clients."},
		{"limit_refusals", "epd_limit_refusals",
		 "Requests refused by a per-user or daemon-wide limit."},
	};
	for (size_t i = 0; i < sizeof(dc) / sizeof(dc[0]); i++) {
		om_head(dc[i].name, "counter", dc[i].help);
		printf("%s_total %lld\n", dc[i].name, jint(d, dc[i].key));
	}
	om_head("epd_clients", "gauge", "Connected clients (visible to the caller).");
	printf("epd_clients %zu\n",
	       json_array_size(json_object_get(root, "clients")));
}

/* Per group: ops, latency, errors, bytes, buffers, handles, failure. */
static void metrics_groups(json_t *root)
{
	size_t i;
	json_t *g;
	json_t *groups = json_object_get(root, "groups");
	static const char *const opn[] = {"barrier", "dispatch", "combine"};
	/* per group: a sample per op kind where `op`, else one; the value is
	 * the group's `key` (in `in` when set), or its failed state */
	static const struct {
		const char *name, *type, *help, *in, *key;
		bool op;
	} gm[] = {
		{"epd_group_ops_total", "counter",
		 "Operations completed, per group and kind.", "ops", NULL, true},
		{"epd_group_op_seconds_total", "counter",
		 "Seconds from a collective's first arrival to its completion, "
		 "summed, per group and kind (host path); divided by "
		 "epd_group_ops_total, the mean latency.",
		 "op_seconds", NULL, true},
		{"epd_group_errors_total", "counter",
		 "Operations that failed, per group.", "ops", "errors", false},
		{"epd_group_moved_bytes_total", "counter",
		 "Bytes of rows moved by dispatch and combine, per group.",
		 "ops", "bytes_moved", false},
		{"epd_group_buffer_bytes", "gauge",
		 "Bytes of the group's buffers on this node.", NULL,
		 "buffer_bytes", false},
		{"epd_group_handles", "gauge",
		 "Dispatch handles not yet released by every local rank, per "
		 "group (host routings).",
		 "handles", "held", false},
		{"epd_group_handle_bytes", "gauge",
		 "Bytes of those routings, per group (against "
		 "max_handle_bytes).",
		 "handles", "bytes", false},
		{"epd_group_failed", "gauge",
		 "1 if the group failed (its last error in epctl status).", NULL,
		 NULL, false},
	};
	for (size_t m = 0; m < sizeof(gm) / sizeof(gm[0]); m++) {
		/* the family's name: without _total for counters */
		size_t fl = strlen(gm[m].name) -
			    (strcmp(gm[m].type, "counter") ? 0 : 6);
		printf("# TYPE %.*s %s\n# HELP %.*s %s\n", (int)fl,
		       gm[m].name, gm[m].type, (int)fl, gm[m].name,
		       gm[m].help);
		json_array_foreach(groups, i, g)
		{
			char name[160];
			om_escape(jstr(g, "name"), name, sizeof(name));
			json_t *o = gm[m].in ? json_object_get(g, gm[m].in) : g;
			for (int k = 0; k < (gm[m].op ? 3 : 1); k++) {
				printf("%s{group=\"%s\"", gm[m].name, name);
				if (gm[m].op)
					printf(",op=\"%s\"", opn[k]);
				json_t *v = json_object_get(
					o, gm[m].op ? opn[k] : gm[m].key ? gm[m].key : "");
				if (!gm[m].key && !gm[m].op)
					printf("} %d\n",
					       !strcmp(jstr(g, "state"), "failed"));
				else if (json_is_real(v))
					printf("} %.9f\n", json_real_value(v));
				else
					printf("} %lld\n",
					       (long long)json_integer_value(v));
			}
		}
	}
}

/* Per peer node a group here needs: up, downs; peers rejected. */
static void metrics_peers(json_t *root)
{
	size_t i;
	json_t *p;
	json_t *cl = json_object_get(root, "cluster");
	if (json_is_object(cl)) {
		om_head("epd_peer_up", "gauge",
			"1 if the peer node is up, per peer a group here needs.");
		json_array_foreach(json_object_get(cl, "peers"), i, p)
		{
			if (!strcmp(jstr(p, "state"), "self") ||
			    !strcmp(jstr(p, "state"), "idle"))
				continue;
			char name[160];
			om_escape(jstr(p, "name"), name, sizeof(name));
			printf("epd_peer_up{peer=\"%s\",transport=\"%s\"} %d\n",
			       name, jstr(p, "transport"),
			       !strcmp(jstr(p, "state"), "up"));
		}
		om_head("epd_peer_downs", "counter", "Times the peer went down, per peer.");
		json_array_foreach(json_object_get(cl, "peers"), i, p)
		{
			if (!strcmp(jstr(p, "state"), "self"))
				continue;
			char name[160];
			om_escape(jstr(p, "name"), name, sizeof(name));
			printf("epd_peer_downs_total{peer=\"%s\"} %lld\n", name,
			       jint(p, "downs"));
		}
		om_head("epd_cluster_peers_rejected", "counter", "Peer connections rejected (key, version, cluster id).");
		printf("epd_cluster_peers_rejected_total %lld\n",
		       jint(cl, "rejected"));
	}
}

/* The status as OpenMetrics text. */
static void print_metrics(json_t *root)
{
	metrics_daemon(root);
	metrics_groups(root);
	metrics_peers(root);
	printf("# EOF\n");
}

static const struct cmd cmds[] = {
	{"status", print_status, "[--json]",
	 "the daemon, its peers, clients and groups"},
	{"groups", print_groups, "[--json]", "the groups, one line each"},
	{"peers", print_peers, "[--json]", "the cluster's nodes and links"},
	{"check", NULL, "[-q]",
	 "health: exit 0 healthy, 1 degraded, 2 down"},
	{"metrics", print_metrics, "",
	 "counters and gauges in the OpenMetrics text format"},
};

static void usage(FILE *f)
{
	fprintf(f, "usage: epctl [-s SOCKET] COMMAND [ARGS]\n"
		   "  -s, --socket PATH  control socket (default $EPD_SOCKET "
		   "or " EPD_SOCKET_PATH ")\n"
		   "  -V, --version      print the version\n"
		   "  -h, --help         this help\n\ncommands:\n");
	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
		fprintf(f, "  %-8s %-9s %s\n", cmds[i].name, cmds[i].args,
			cmds[i].help);
}

/* The status document, or NULL with a message (and *why: the exit). */
static json_t *fetch(const char *sock, bool quiet, int *why)
{
	ep_conn_t *c;
	int rc = ep_connect(sock, &c);
	if (rc) {
		if (!quiet)
			fprintf(stderr, "epctl: epd is unreachable: %s\n",
				ep_errmsg());
		*why = EXIT_UNREACHABLE;
		return NULL;
	}
	char *text;
	rc = ep_daemon_status(c, &text);
	ep_close(c);
	if (rc) {
		if (!quiet)
			fprintf(stderr, "epctl: status failed: %s: %s\n",
				ep_strerror(rc), ep_errmsg());
		*why = EXIT_UNREACHABLE;
		return NULL;
	}
	json_error_t jerr;
	json_t *root = json_loads(text, 0, &jerr);
	free(text);
	const char *bad = !root ? jerr.text
			  : !json_is_object(json_object_get(root, "daemon"))
			      ? "no daemon object"
			  : !json_is_integer(json_object_get(root, "schema"))
			      ? "no schema version"
			      : NULL;
	if (!bad && jint(root, "schema") > STATUS_SCHEMA && !quiet)
		fprintf(stderr, "epctl: note: the daemon's status schema is "
				"%lld, this epctl reads %d\n",
			jint(root, "schema"), STATUS_SCHEMA);
	if (bad) {
		if (!quiet)
			fprintf(stderr, "epctl: malformed status from epd: %s\n",
				bad);
		json_decref(root);
		*why = EXIT_PROTO;
		return NULL;
	}
	return root;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{"socket", required_argument, NULL, 's'},
		{"version", no_argument, NULL, 'V'},
		{"help", no_argument, NULL, 'h'},
		{0},
	};
	const char *sock = NULL;
	int opt;
	while ((opt = getopt_long(argc, argv, "+s:Vh", opts, NULL)) != -1) {
		switch (opt) {
		case 's': sock = optarg; break;
		case 'V': printf("epctl %s\n", PACKAGE_VERSION); return 0;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return EXIT_USAGE;
		}
	}
	if (optind >= argc) {
		usage(stderr);
		return EXIT_USAGE;
	}
	const struct cmd *cmd = NULL;
	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
		if (!strcmp(argv[optind], cmds[i].name))
			cmd = &cmds[i];
	if (!cmd) {
		fprintf(stderr, "epctl: unknown command '%s'\n", argv[optind]);
		usage(stderr);
		return EXIT_USAGE;
	}
	/* the arguments, before anything is asked of the daemon */
	bool json = false, quiet = false;
	for (int i = optind + 1; i < argc; i++) {
		if (cmd->show && cmd->show != print_metrics &&
		    (!strcmp(argv[i], "--json") || !strcmp(argv[i], "-j"))) {
			json = true;
		} else if (!cmd->show &&
			   (!strcmp(argv[i], "-q") ||
			    !strcmp(argv[i], "--quiet"))) {
			quiet = true;
		} else {
			fprintf(stderr, "epctl %s: unknown argument %s\n",
				cmd->name, argv[i]);
			return EXIT_USAGE;
		}
	}
	int why = 0;
	json_t *root = fetch(sock, quiet, &why);
	if (!cmd->show) { /* check */
		int rc = root ? check(root, quiet) : CHECK_DOWN;
		if (!root && !quiet)
			printf("down\n");
		json_decref(root);
		return rc;
	}
	if (!root)
		return why;
	if (json) {
		json_t *part = cmd->show == print_groups
				       ? json_object_get(root, "groups")
			       : cmd->show == print_peers
				       ? json_object_get(root, "cluster")
				       : root;
		json_dumpf(part, stdout,
			   JSON_INDENT(2) | JSON_SORT_KEYS | JSON_ENCODE_ANY);
		putchar('\n');
	} else {
		cmd->show(root);
	}
	json_decref(root);
	return 0;
}
