/* SPDX-License-Identifier: MIT */
/*
 * epctl: the operator's view of epd.
 *
 * Exit codes: 0 ok, 1 the daemon is unreachable or refused, 2 usage,
 * 3 the daemon answered something malformed.
 */
#include <getopt.h>
#include <stdbool.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep/ep.h"

enum { EXIT_UNREACHABLE = 1, EXIT_USAGE = 2, EXIT_PROTO = 3 };

struct cmd {
	const char *name;
	int (*fn)(ep_conn_t *c, int argc, char **argv);
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

static void print_status(json_t *root)
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
	json_t *cl = json_object_get(root, "cluster");
	if (json_is_object(cl)) {
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
		json_array_foreach(json_object_get(cl, "peers"), i, p)
		{
			if (!strcmp(jstr(p, "state"), "self"))
				continue;
			printf("  %-12s %-22s %-5s %-4s downs %lld%s%s\n",
			       jstr(p, "name"), jstr(p, "addr"),
			       jstr(p, "state"), jstr(p, "transport"),
			       jint(p, "downs"),
			       *jstr(p, "last_error") ? ", last: " : "",
			       jstr(p, "last_error"));
		}
	}
	json_t *clients = json_object_get(root, "clients");
	printf("\nclients: %zu connected (accepted %lld, rejected %lld, "
	       "protocol errors %lld)\n",
	       json_array_size(clients), jint(d, "clients_accepted"),
	       jint(d, "clients_rejected"), jint(d, "protocol_errors"));
	size_t i, k;
	json_t *c, *m, *g;
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
	json_t *groups = json_object_get(root, "groups");
	printf("\ngroups: %zu\n", json_array_size(groups));
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

static int cmd_status(ep_conn_t *c, int argc, char **argv)
{
	bool json = false;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--json") || !strcmp(argv[i], "-j")) {
			json = true;
		} else {
			fprintf(stderr, "epctl status: unknown argument %s\n",
				argv[i]);
			return EXIT_USAGE;
		}
	}
	char *text;
	int rc = ep_daemon_status(c, &text);
	if (rc) {
		fprintf(stderr, "epctl: status failed: %s: %s\n",
			ep_strerror(rc), ep_errmsg());
		return EXIT_UNREACHABLE;
	}
	json_error_t jerr;
	json_t *root = json_loads(text, 0, &jerr);
	free(text);
	if (!root || !json_is_object(json_object_get(root, "daemon"))) {
		fprintf(stderr, "epctl: malformed status from epd: %s\n",
			root ? "no daemon object" : jerr.text);
		json_decref(root);
		return EXIT_PROTO;
	}
	if (json) {
		json_dumpf(root, stdout, JSON_INDENT(2) | JSON_SORT_KEYS);
		putchar('\n');
	} else {
		print_status(root);
	}
	json_decref(root);
	return 0;
}

static const struct cmd cmds[] = {
	{"status", cmd_status, "[--json]",
	 "the daemon, its clients and its groups"},
};

static void usage(FILE *f)
{
	fprintf(f, "usage: epctl [-s SOCKET] COMMAND [ARGS]\n"
		   "  -s, --socket PATH  control socket (default $EPD_SOCKET "
		   "or /run/epd/epd.sock)\n"
		   "  -V, --version      print the version\n\ncommands:\n");
	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
		fprintf(f, "  %s %-10s %s\n", cmds[i].name, cmds[i].args,
			cmds[i].help);
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
	ep_conn_t *c;
	int rc = ep_connect(sock, &c);
	if (rc) {
		fprintf(stderr, "epctl: epd is unreachable: %s\n", ep_errmsg());
		return EXIT_UNREACHABLE;
	}
	rc = cmd->fn(c, argc - optind, argv + optind);
	ep_close(c);
	return rc;
}
