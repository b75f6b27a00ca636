/* SPDX-License-Identifier: MIT */
/*
 * The daemon as an operator sees it: epctl status (text and JSON), exit
 * codes, SIGHUP reload, SIGTERM with ranks inside a barrier, peer
 * credentials, socket mode, a stale or live socket at start.
 */
#include "harness.h"

#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

static int run_cmd(const char *cmd, char *out, size_t cap)
{
	FILE *p = popen(cmd, "r");
	TH_CHECK(p, "popen %s", cmd);
	size_t n = fread(out, 1, cap - 1, p);
	out[n] = 0;
	int st = pclose(p);
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void check_epctl(const struct th_daemon *d)
{
	char cmd[512], *out = malloc(1 << 20);
	/* A group of two, one rank joined through this process. */
	ep_conn_t *c;
	ep_group_t *g;
	struct ep_group_config cfg = th_group("moe.layer-0", 2, 1, 5000);
	TH_OK(ep_connect(d->sock, &c));
	TH_OK(ep_join(c, &cfg, EP_JOIN_NOWAIT, &g));

	snprintf(cmd, sizeof(cmd), "%s -s %s status", th_epctl_bin(),
		 d->sock);
	TH_CHECK(run_cmd(cmd, out, 1 << 20) == 0, "epctl status failed");
	TH_CHECK(strstr(out, "backend host"), "no backend line: %s", out);
	TH_CHECK(strstr(out, "moe.layer-0:1"), "no client rank: %s", out);
	TH_CHECK(strstr(out, "forming"), "no group state: %s", out);
	printf("%s", out);

	snprintf(cmd, sizeof(cmd), "%s -s %s status --json", th_epctl_bin(),
		 d->sock);
	TH_CHECK(run_cmd(cmd, out, 1 << 20) == 0, "epctl status --json");
	json_error_t je;
	json_t *root = json_loads(out, 0, &je);
	TH_CHECK(root, "epctl --json is not JSON: %s", je.text);
	json_t *gs = json_object_get(root, "groups");
	TH_CHECK(json_array_size(gs) == 1, "groups: %s", out);
	json_t *g0 = json_array_get(gs, 0);
	TH_CHECK(!strcmp(json_string_value(json_object_get(g0, "name")),
			 "moe.layer-0"),
		 "group name");
	TH_CHECK(json_integer_value(json_array_get(
			 json_object_get(g0, "missing"), 0)) == 0,
		 "missing rank 0 not listed");
	json_t *d0 = json_object_get(root, "daemon");
	TH_CHECK(!strcmp(json_string_value(json_object_get(d0, "socket")),
			 d->sock),
		 "socket");
	json_t *cl = json_object_get(root, "clients");
	bool found = false;
	size_t i;
	json_t *v;
	json_array_foreach(cl, i, v) found |=
		json_integer_value(json_object_get(v, "pid")) == getpid();
	TH_CHECK(found, "this process is not among the clients: %s", out);
	json_decref(root);
	TH_OK(ep_leave(g));
	ep_close(c);

	/* Unreachable daemon: exit 1 and a clear message. */
	snprintf(cmd, sizeof(cmd), "%s -s %s/none status 2>&1",
		 th_epctl_bin(), d->dir);
	TH_CHECK(run_cmd(cmd, out, 1 << 20) == 1, "exit code for no daemon");
	TH_CHECK(strstr(out, "unreachable"), "message: %s", out);
	snprintf(cmd, sizeof(cmd), "%s -s %s frobnicate 2>&1", th_epctl_bin(),
		 d->sock);
	TH_CHECK(run_cmd(cmd, out, 1 << 20) == 2, "exit code for usage");
	free(out);
	printf("ok: epctl status, --json, exit codes\n");
}

/* Send SIGHUP and wait for the daemon's verdict in its log (the n-th
 * reload's line). Returns true if it reloaded, false if it kept the old
 * configuration. */
static bool hup(struct th_daemon *d, int n)
{
	kill(d->pid, SIGHUP);
	for (int i = 0; i < 500; i++) {
		char cmd[300], out[64];
		snprintf(cmd, sizeof(cmd),
			 "grep -c -e 'configuration reloaded' -e 'keeping the "
			 "running' %s",
			 d->log);
		run_cmd(cmd, out, sizeof(out));
		if (atoi(out) >= n) {
			snprintf(cmd, sizeof(cmd),
				 "grep -e 'configuration reloaded' -e 'keeping "
				 "the running' %s | tail -n 1 | grep -c "
				 "reloaded",
				 d->log);
			run_cmd(cmd, out, sizeof(out));
			return atoi(out) == 1;
		}
		th_sleep_ms(10);
	}
	TH_CHECK(0, "no reload verdict in the log");
	return false;
}

/* The default timeout a new group gets now. */
static bool new_group_timeout(struct th_daemon *d, const char *want)
{
	ep_conn_t *c;
	char *js;
	struct ep_group_config cfg = th_group("r", 2, 0, 0);
	ep_group_t *g;
	TH_OK(ep_connect(d->sock, &c));
	TH_OK(ep_join(c, &cfg, EP_JOIN_NOWAIT, &g));
	TH_OK(ep_daemon_status(c, &js));
	bool ok = strstr(js, want) != NULL;
	free(js);
	ep_close(c);
	return ok;
}

static void check_reload(struct th_daemon *d)
{
	/* The file changes the timeout and tries to change what the command
	 * line set (log level, allow_users): the command line wins, as at
	 * start. */
	FILE *f = fopen(d->conf, "w");
	fprintf(f, "[epd]\nlog_level = debug\ntimeout_ms = 1234\n"
		   "allow_users = 4242\n");
	fclose(f);
	TH_CHECK(hup(d, 1), "reload refused");
	TH_CHECK(new_group_timeout(d, "\"timeout_ms\":1234"),
		 "timeout not reloaded");
	ep_conn_t *c;
	char *js;
	TH_OK(ep_connect(d->sock, &c)); /* root: still allowed */
	TH_OK(ep_daemon_status(c, &js));
	ep_close(c);
	TH_CHECK(strstr(js, "\"log_level\":\"debug\"") == NULL,
		 "the file overrode -l: %s", js);
	free(js);
	printf("ok: SIGHUP reloads the file and keeps the command line's "
	       "overrides\n");

	/* A bad file, then a deleted one: the running configuration stays. */
	f = fopen(d->conf, "w");
	fprintf(f, "[epd]\ntimeout_ms = lots\n");
	fclose(f);
	TH_CHECK(!hup(d, 2), "a bad file was applied");
	TH_CHECK(new_group_timeout(d, "\"timeout_ms\":1234"),
		 "a bad file changed the timeout");
	/* the failure shows: epctl check says degraded, and why */
	char cmd[512], out[2048];
	snprintf(cmd, sizeof(cmd), "%s -s %s check 2>&1", th_epctl_bin(),
		 d->sock);
	int rc = run_cmd(cmd, out, sizeof(out));
	TH_CHECK(rc == 1 && strstr(out, "the last reload failed") &&
			 strstr(out, "bad value 'lots' for 'timeout_ms'"),
		 "epctl check after a failed reload (exit %d): %s", rc, out);
	unlink(d->conf);
	TH_CHECK(!hup(d, 3), "a deleted file was applied");
	TH_CHECK(new_group_timeout(d, "\"timeout_ms\":1234"),
		 "a deleted file reset the timeout");
	f = fopen(d->conf, "w");
	fclose(f);
	TH_CHECK(hup(d, 4), "a good file refused");
	rc = run_cmd(cmd, out, sizeof(out));
	TH_CHECK(rc == 0, "epctl check after a good reload (exit %d): %s", rc,
		 out);
	printf("ok: a bad or deleted file on reload keeps the running "
	       "configuration, and epctl check says degraded naming the "
	       "error until a reload succeeds\n");
}

static void check_shutdown(struct th_daemon *d)
{
	/* Two ranks of a three-rank group, one waiting in a (ready) barrier. */
	ep_conn_t *c[2];
	ep_group_t *g[2];
	for (int r = 0; r < 2; r++) {
		struct ep_group_config cfg = th_group("sd", 2, (uint32_t)r,
						      60000);
		TH_OK(ep_connect(d->sock, &c[r]));
		TH_OK(ep_join(c[r], &cfg, EP_JOIN_NOWAIT, &g[r]));
	}
	pid_t pid = fork();
	if (pid == 0) {
		/* rank 0 waits forever for rank 1, until the daemon stops */
		int rc = ep_barrier(g[0]);
		_exit(rc == EP_ESHUTDOWN ? 0 : 10 + (rc & 0xf));
	}
	th_sleep_ms(200);
	th_daemon_stop(d);
	int st;
	waitpid(pid, &st, 0);
	TH_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0,
		 "rank in barrier did not get EP_ESHUTDOWN (status 0x%x)", st);
	/* The other connection learns it too, on its next call. */
	TH_EXPECT_RC(ep_barrier(g[1]), EP_ESHUTDOWN);
	ep_close(c[0]);
	ep_close(c[1]);
	printf("ok: SIGTERM: rank in barrier got shutdown, socket removed\n");
}

static void check_creds(const struct th_daemon *d)
{
	if (geteuid() != 0) {
		printf("skip: peer credential check needs root\n");
		return;
	}
	pid_t pid = fork();
	if (pid == 0) {
		if (setgid(65534) || setuid(65534))
			_exit(3);
		ep_conn_t *c;
		int rc = ep_connect(d->sock, &c);
		/* mode 0660 keeps nobody out at the file; else the uid check */
		_exit(rc == EP_EACCES ? 0 : 10 + (-rc & 0x7f) % 100);
	}
	int st;
	waitpid(pid, &st, 0);
	TH_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0,
		 "uid 65534 was not refused (status 0x%x)", st);
	printf("ok: a uid outside allow_users is refused\n");
}

/* One connection shared by threads (ep.h: calls are serialized inside the
 * handle): every thread's status round trips come back whole and to it, and
 * each thread's ep_errmsg() is its own. Under ThreadSanitizer (scripts/test)
 * this also checks libep's locking. */
struct shared_conn {
	ep_conn_t *c;
	int id, ok;
	char why[300];
};

static void *status_thread(void *arg)
{
	struct shared_conn *t = arg;
	for (int i = 0; i < 200; i++) {
		char *js = NULL;
		int rc = ep_daemon_status(t->c, &js);
		if (rc) {
			snprintf(t->why, sizeof(t->why), "status %d: %s", rc,
				 ep_errmsg());
			return NULL;
		}
		json_t *root = json_loads(js, 0, NULL);
		free(js);
		if (!root || !json_object_get(root, "daemon")) {
			snprintf(t->why, sizeof(t->why), "status reply %d "
				 "is not the daemon's JSON", i);
			json_decref(root);
			return NULL;
		}
		json_decref(root);
		if (t->id == 0 && i % 50 == 0) {
			/* an error in this thread only */
			if (ep_barrier(NULL) != EP_EINVAL ||
			    !strstr(ep_errmsg(), "NULL group")) {
				snprintf(t->why, sizeof(t->why),
					 "own error message: '%s'",
					 ep_errmsg());
				return NULL;
			}
		} else if (t->id != 0 && ep_errmsg()[0]) {
			snprintf(t->why, sizeof(t->why),
				 "another thread's message: '%s'", ep_errmsg());
			return NULL;
		}
	}
	t->ok = 1;
	return NULL;
}

static void check_threads(const struct th_daemon *d)
{
	ep_conn_t *c;
	TH_OK(ep_connect(d->sock, &c));
	pthread_t th[4];
	struct shared_conn t[4];
	for (int i = 0; i < 4; i++) {
		t[i] = (struct shared_conn){.c = c, .id = i};
		TH_CHECK(!pthread_create(&th[i], NULL, status_thread, &t[i]),
			 "pthread_create");
	}
	for (int i = 0; i < 4; i++) {
		pthread_join(th[i], NULL);
		TH_CHECK(t[i].ok, "thread %d on a shared connection: %s", i,
			 t[i].why);
	}
	ep_close(c);
	printf("ok: 4 threads x 200 status round trips on one connection; "
	       "error messages stay per thread\n");
}

/* Configurations epd must refuse, each with a message naming the fault;
 * it exits non-zero and leaves no socket behind. */
static void check_bad_configs(const char *dir)
{
	const char *epd = getenv("EPD_BIN") ? getenv("EPD_BIN") : "./epd";
	char key[512];
	snprintf(key, sizeof(key), "%s/k", dir);
	FILE *f = fopen(key, "w");
	TH_CHECK(f, "key file");
	fputs("a-test-cluster-key\n", f);
	fclose(f);
	TH_CHECK(!chmod(key, 0600), "chmod");
	char shortkey[512];
	snprintf(shortkey, sizeof(shortkey), "%s/k5", dir);
	f = fopen(shortkey, "w");
	TH_CHECK(f, "key file");
	fputs("12345", f);
	fclose(f);
	/* a line past the INI parser's limit, which it would split */
	char longline[600];
	size_t lo = (size_t)snprintf(longline, sizeof(longline),
				     "[epd]\nnode_name = a\npeers = ");
	for (int i = 0; i < 12; i++)
		lo += (size_t)snprintf(longline + lo, sizeof(longline) - lo,
				       "%sgpu-node-%02d@127.0.0.1:71%02d",
				       i ? ", " : "", i, i);
	snprintf(longline + lo, sizeof(longline) - lo,
		 "\ncluster_key_file = %%s\n");
	struct {
		const char *text, *args, *frag;
	} cases[] = {
		{"[other]\nx = 1\n", "-t", "unknown section [other]"},
		{"[epd]\nfrobnicate = 1\n", "-t", "unknown key 'frobnicate'"},
		{"[epd]\ntimeout_ms = 0\n", "-t",
		 "bad value '0' for 'timeout_ms': expected 1..3600000"},
		{"[epd]\nbackend = quantum\n", "-t",
		 "bad value 'quantum' for 'backend': expected auto|host|cuda"},
		{"[epd]\ntransport = carrier-pigeon\n", "-t",
		 "bad value 'carrier-pigeon' for 'transport'"},
		{"[epd\nlog_level = info\n", "-t", "syntax error"},
		{"log_level = info\n", "-t", "outside a section"},
		{"[epd]\n", "-t -o timeout_ms", "is not key=value"},
		{"[epd]\n", "-t -o heartbeat_miss=1",
		 "bad value '1' for 'heartbeat_miss': expected 2..100"},
		{"[epd]\nsocket_mode = 0999\n", "-t",
		 "bad value '0999' for 'socket_mode': expected 0..777 (octal)"},
		{"[epd]\nmax_queued_bytes = 64K\n", "-t",
		 "for 'max_queued_bytes': expected bytes (K, M, G, T "
		 "suffixes), at least 1048576"},
		{"[epd]\nmax_bytes = 1Q\n", "-t", "bad value '1Q' for 'max_bytes'"},
		{"[epd]\nlog_level = loud\n", "-t",
		 "bad value 'loud' for 'log_level': expected error|warning"},
		{"[epd]\n", "-t -o node_name=",
		 "bad value '' for 'node_name': expected text of 1 to 63 bytes"},
		{"[epd]\n", "-t -o peer_connect=some",
		 "bad value 'some' for 'peer_connect': expected all|on-demand"},
		{"[epd]\n", "-t -o worker_threads=-1",
		 "bad value '-1' for 'worker_threads': expected 0..256"},
		{"[epd]\n", "-t -o cuda_resident_barrier=maybe",
		 "bad value 'maybe' for 'cuda_resident_barrier'"},
		{"[epd]\ncuda_tma = sometimes\n", "-t",
		 "bad value 'sometimes' for 'cuda_tma'"},
		{"[epd]\nhost_barrier = 2\n", "-t",
		 "bad value '2' for 'host_barrier'"},
		{"[epd]\ncuda_copy_sms = many\n", "-t",
		 "bad value 'many' for 'cuda_copy_sms'"},
		{"[epd]\ncuda_fused_prep = often\n", "-t",
		 "bad value 'often' for 'cuda_fused_prep'"},
		{"[epd]\ncuda_combine_fetch = often\n", "-t",
		 "bad value 'often' for 'cuda_combine_fetch'"},
		{"[epd]\ncuda_pdl = often\n", "-t",
		 "bad value 'often' for 'cuda_pdl'"},
		{"[epd]\ncuda_copy_blocks_per_sm = 0\n", "-t",
		 "bad value '0' for 'cuda_copy_blocks_per_sm'"},
		{"[epd]\n", "-t -o cuda_copy_blocks_per_sm=33",
		 "bad value '33' for 'cuda_copy_blocks_per_sm': expected 1..32 "
		 "or auto"},
		{"[epd]\nnode_name = a\npeers = a@127.0.0.1:1, b\n"
		 "cluster_key_file = %s\n",
		 "", "'b' is not name@host:port"},
		{"[epd]\nnode_name = c\npeers = a@127.0.0.1:1, "
		 "b@127.0.0.1:2\ncluster_key_file = %s\n",
		 "", "node_name"},
		{"[epd]\nnode_name = a\npeers = a@127.0.0.1:1, "
		 "b@127.0.0.1:2\n",
		 "", "no cluster_key_file"},
		/* epd -t makes the checks start makes */
		{"[epd]\nnode_name = a\npeers = a@127.0.0.1:1, "
		 "b@127.0.0.1:2\n",
		 "-t", "no cluster_key_file"},
		{"[epd]\nnode_name = c\npeers = a@127.0.0.1:1, "
		 "b@127.0.0.1:2\ncluster_key_file = %s\n",
		 "-t", "node_name 'c' is not in peers"},
		{"[epd]\nnode_name = a\npeers = a@127.0.0.1:1, "
		 "b@127.0.0.1:2\ncluster_key_file = %s5\n",
		 "-t", "need at least 16 bytes"},
		{"[epd]\nnode_name = a\npeers = a@127.0.0.1:1, "
		 "b@127.0.0.1:2x\ncluster_key_file = %s\n",
		 "-t", "bad port '2x' for b"},
		{"[epd]\nnode_name = a\npeers = a@127.0.0.1:1, "
		 "a@127.0.0.1:2\ncluster_key_file = %s\n",
		 "-t", "a listed twice"},
		{longline, "-t", "line longer than 199 bytes"},
		{"[epd]\npeer_lookup = everywhere\n", "-t",
		 "bad value 'everywhere' for 'peer_lookup'"},
		{"[epd]\npeer_nodes_max = 1\n", "-t",
		 "bad value '1' for 'peer_nodes_max': expected 2..1048576"},
		{"[epd]\nnode_name = a\npeers = a@127.0.0.1:1\n"
		 "cluster_key_file = %s\npeer_lookup = job\n"
		 "peer_connect = all\n",
		 "-t", "peer_connect = all needs peer_lookup = peers"},
		{"[epd]\nnode_name = a\npeers = a@127.0.0.1:1, "
		 "b@127.0.0.1:2\ncluster_key_file = %s\ntransport = rdma\n",
		 "", "transport rdma: "},
	};
	char conf[512], sock[512], cmd[2048], out[4096], text[1024];
	snprintf(conf, sizeof(conf), "%s/bad.conf", dir);
	snprintf(sock, sizeof(sock), "%s/bad.sock", dir);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		/* transport rdma with a peer on 127.0.0.1: no device here,
		 * or (tests/rdma-vm) a device that cannot route loopback */
		snprintf(text, sizeof(text), cases[i].text, key);
		f = fopen(conf, "w");
		TH_CHECK(f, "config file");
		fputs(text, f);
		fclose(f);
		snprintf(cmd, sizeof(cmd), "%s -s %s -c %s %s 2>&1", epd, sock,
			 conf, cases[i].args);
		int rc = run_cmd(cmd, out, sizeof(out));
		TH_CHECK(rc != 0, "case %zu: epd accepted:\n%s", i, text);
		TH_CHECK(strstr(out, cases[i].frag), "case %zu: '%s' not in: %s",
			 i, cases[i].frag, out);
		/* why: no device, a peer on loopback, or (a build without
		 * libibverbs/librdmacm) no rdma transport at all */
		if (strstr(cases[i].text, "transport = rdma"))
			TH_CHECK(strstr(out, "no RDMA device") ||
					 strstr(out, "loopback address") ||
					 strstr(out, "not in this build"),
				 "case %zu: %s", i, out);
		struct stat sb;
		TH_CHECK(stat(sock, &sb) != 0, "case %zu: socket left behind",
			 i);
		/* the line that says it */
		char *line = strstr(out, cases[i].frag);
		while (line > out && line[-1] != '\n')
			line--;
		char *nl = strchr(line, '\n');
		if (nl)
			*nl = 0;
		printf("ok: refused (exit %d): %s\n", rc, line);
	}
	/* A missing file given with -c is an error too. */
	snprintf(cmd, sizeof(cmd), "%s -s %s -c %s/none.conf -t 2>&1", epd,
		 sock, dir);
	TH_CHECK(run_cmd(cmd, out, sizeof(out)) != 0 &&
			 strstr(out, "cannot open config"),
		 "missing config: %s", out);
	printf("ok: a missing config file -> refused\n");
	/* and the values these keys take are accepted */
	/* (every key of epd.conf(5) but peers, which the cluster cases
	 * give, each with a valid value) */
	const char *good =
		"[epd]\ncuda_pdl = no\ncuda_copy_blocks_per_sm = auto\n"
		"cuda_copy_sms = auto\ncuda_combine_fetch = lean\n"
		"socket = /run/epd-unused.sock\nsocket_mode = 0600\n"
		"backend = host\nlog_level = warn\ntimeout_ms = 1000\n"
		"frame_timeout_ms = 1000\nallow_users = 0\n"
		"shared_groups = pub-\ncuda_sms = 0\ncuda_tma = yes\n"
		"cuda_fused_prep = on\ncuda_resident_barrier = no\n"
		"host_barrier = true\nnode_name = n0\ncluster_key_file =\n"
		"transport = tcp\nheartbeat_ms = 100\n"
		"peer_connect = on-demand\npeer_lookup = peers\n"
		"peer_nodes_max = 64\npeer_linger_ms = 0\n"
		"heartbeat_miss = 4\npeer_handshakes_max = 8\n"
		"peer_handshakes_per_host = 2\nmax_connections_per_user = 8\n"
		"max_groups_per_user = 8\nmax_bytes_per_user = 1G\n"
		"max_connections = 16\nmax_groups = 16\nmax_bytes = 2G\n"
		"max_queued_bytes = 1M\nmax_handle_bytes = 64M\n"
		"worker_threads = 2\n";
	f = fopen(conf, "w");
	TH_CHECK(f, "config file");
	fputs(good, f);
	fclose(f);
	snprintf(cmd, sizeof(cmd),
		 "%s -s %s -c %s -t -o cuda_copy_blocks_per_sm=2 -o "
		 "cuda_pdl=yes 2>&1",
		 epd, sock, conf);
	TH_CHECK(run_cmd(cmd, out, sizeof(out)) == 0 &&
			 strstr(out, "configuration ok"),
		 "the GPU keys' values refused: %s", out);
	printf("ok: every key takes a valid value (and the GPU keys "
	       "their auto and lean forms)\n");
}

/* Configurations of any size: 128 nodes of realistic names, the file's
 * peers over many lines (each under the parser's limit), and the same
 * list as one -o value of about 4 KB. epd -t takes both whole: the last
 * node is this one, so a list cut short would fail. No daemon starts, so
 * nothing dials the (loopback) addresses. */
static void check_large_configs(const char *dir)
{
	const char *epd = getenv("EPD_BIN") ? getenv("EPD_BIN") : "./epd";
	enum { NODES = 128 };
	char key[512], conf[512], sock[512], out[4096];
	snprintf(key, sizeof(key), "%s/k", dir);
	snprintf(conf, sizeof(conf), "%s/large.conf", dir);
	snprintf(sock, sizeof(sock), "%s/large.sock", dir);
	char *one = malloc(NODES * 48), *cmd = malloc(NODES * 48 + 1024);
	TH_CHECK(one && cmd, "out of memory");
	FILE *f = fopen(conf, "w");
	TH_CHECK(f, "config file");
	fprintf(f, "[epd]\nnode_name = gpu-node-%03d.rack%02d\n", NODES - 1,
		(NODES - 1) / 16);
	fprintf(f, "cluster_key_file = %s\npeers =", key);
	size_t off = 0;
	for (int i = 0; i < NODES; i++) {
		char ent[64];
		snprintf(ent, sizeof(ent),
			 "gpu-node-%03d.rack%02d@127.0.%d.%d:7101", i, i / 16,
			 i / 200, 1 + i % 200);
		/* four a line, the continuation indented */
		fprintf(f, "%s%s%s", i % 4 ? ", " : (i ? ",\n  " : " "), ent,
			"");
		off += (size_t)snprintf(one + off, (size_t)NODES * 48 - off,
					"%s%s", i ? "," : "", ent);
	}
	fprintf(f, "\n");
	fclose(f);
	snprintf(cmd, (size_t)NODES * 48 + 1024, "%s -s %s -c %s -t 2>&1",
		 epd, sock, conf);
	TH_CHECK(run_cmd(cmd, out, sizeof(out)) == 0 &&
			 strstr(out, "configuration ok"),
		 "a 128-node peers list over several lines: %s", out);
	/* the file's list replaced by -o, this node the last entry */
	snprintf(cmd, (size_t)NODES * 48 + 1024,
		 "%s -s %s -c %s -t -o peers=%s 2>&1", epd, sock, conf, one);
	TH_CHECK(run_cmd(cmd, out, sizeof(out)) == 0 &&
			 strstr(out, "configuration ok"),
		 "a 128-node peers list of %zu bytes in -o: %s", off, out);
	/* and a list cut before this node is refused: not silently taken */
	char *cut = strstr(one, "gpu-node-127");
	TH_CHECK(cut, "the list");
	cut[-1] = 0;
	snprintf(cmd, (size_t)NODES * 48 + 1024,
		 "%s -s %s -c %s -t -o peers=%s 2>&1", epd, sock, conf, one);
	TH_CHECK(run_cmd(cmd, out, sizeof(out)) != 0 &&
			 strstr(out, "is not in peers"),
		 "a list without this node: %s", out);
	free(one);
	free(cmd);
	printf("ok: 128 nodes of realistic names, in the file over several "
	       "lines and as one -o value of %zu bytes: taken whole\n",
	       off);
}

static void low_soft_nofile(void)
{
	struct rlimit rl = {256, 4096};
	setrlimit(RLIMIT_NOFILE, &rl);
}

/* The soft descriptor limit a service starts with (systemd's is 1024) is
 * raised to the hard one: clients, group buffers and peer connections
 * all take descriptors. */
static void check_nofile(void)
{
	struct rlimit me;
	TH_CHECK(getrlimit(RLIMIT_NOFILE, &me) == 0, "getrlimit");
	if (me.rlim_max < 4096) {
		printf("skip: the hard descriptor limit here is %llu\n",
		       (unsigned long long)me.rlim_max);
		return;
	}
	struct th_daemon d;
	th_daemon_child_hook = low_soft_nofile;
	th_daemon_start(&d, NULL);
	th_daemon_child_hook = NULL;
	char path[64], line[256];
	snprintf(path, sizeof(path), "/proc/%d/limits", (int)d.pid);
	FILE *f = fopen(path, "r");
	TH_CHECK(f, "open %s", path);
	unsigned long long soft = 0, hard = 0;
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, "Max open files", 14))
			sscanf(line + 14, "%llu %llu", &soft, &hard);
	fclose(f);
	TH_CHECK(soft == 4096 && hard == 4096,
		 "descriptor limits %llu/%llu, want 4096/4096", soft, hard);
	th_daemon_stop(&d);
	printf("ok: the soft descriptor limit 256 raised to the hard 4096\n");
}

/* Lines of d's log that contain frag. */
static int log_lines(const struct th_daemon *d, const char *frag)
{
	FILE *f = fopen(d->log, "r");
	TH_CHECK(f, "open %s", d->log);
	char line[1024];
	int n = 0;
	while (fgets(line, sizeof(line), f))
		n += strstr(line, frag) != NULL;
	fclose(f);
	return n;
}

/* epctl's calls (a monitor polling status and check every few seconds)
 * leave nothing in the log at the default level: a connection that
 * holds no group connects and goes at debug. */
static void check_quiet_polls(const struct th_daemon *d)
{
	if (strcmp(getenv("EPD_TEST_LOG_LEVEL") ? getenv("EPD_TEST_LOG_LEVEL")
						 : "info",
		   "info")) {
		printf("skip: quiet polls (the test daemons log at %s)\n",
		       getenv("EPD_TEST_LOG_LEVEL"));
		return;
	}
	char cmd[512], out[8192];
	const int before = log_lines(d, "client ");
	for (int i = 0; i < 5; i++) {
		snprintf(cmd, sizeof(cmd), "%s -s %s %s", th_epctl_bin(),
			 d->sock, i % 2 ? "check" : "status");
		run_cmd(cmd, out, sizeof(out));
	}
	th_sleep_ms(100); /* the daemon's last close */
	const int after = log_lines(d, "client ");
	TH_CHECK(after == before, "5 epctl calls logged %d client lines",
		 after - before);
	printf("ok: 5 epctl calls leave no line in the log at info\n");
}

int main(void)
{
	th_init("daemon: epctl, reload, credentials, shutdown", 120);
	struct th_daemon d;
	/* mode 0666 so that the uid check (not the file mode) is tested */
	th_daemon_start(&d, "-o", "allow_users=root", "-o",
			"socket_mode=0666", NULL);
	struct stat sb;
	TH_CHECK(stat(d.sock, &sb) == 0 && (sb.st_mode & 0777) == 0666,
		 "socket mode %o", sb.st_mode & 0777);
	check_epctl(&d);
	check_quiet_polls(&d);
	check_nofile();
	check_threads(&d);
	check_creds(&d);
	check_reload(&d);

	/* A second daemon on a live socket refuses to start. */
	char cmd[512], out[4096];
	snprintf(cmd, sizeof(cmd), "%s -s %s -c %s 2>&1",
		 getenv("EPD_BIN") ? getenv("EPD_BIN") : "./epd", d.sock,
		 d.conf);
	TH_CHECK(run_cmd(cmd, out, sizeof(out)) == 1, "second epd started");
	TH_CHECK(strstr(out, "another daemon is listening"), "%s", out);
	printf("ok: a second daemon on a live socket refuses to start\n");

	check_shutdown(&d);
	check_bad_configs(d.dir);
	check_large_configs(d.dir);

	/* A stale socket file (its daemon died) is replaced at start. */
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", d.sock);
	int fd = socket(AF_UNIX, SOCK_STREAM, 0);
	TH_CHECK(bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0,
		 "bind stale socket");
	close(fd);
	th_daemon_start_in(&d, NULL);
	printf("ok: a stale socket file is replaced at start\n");

	/* Its socket file removed, a second daemon takes the path; the
	 * first one, stopping, leaves the second one's socket alone. */
	struct th_daemon d2 = d;
	TH_CHECK(unlink(d.sock) == 0, "unlink");
	th_daemon_start_in(&d2, NULL);
	kill(d.pid, SIGTERM);
	int st;
	TH_CHECK(waitpid(d.pid, &st, 0) == d.pid && WIFEXITED(st) &&
			 WEXITSTATUS(st) == 0,
		 "first daemon's exit 0x%x", st);
	d.pid = 0;
	TH_CHECK(access(d2.sock, F_OK) == 0,
		 "the stopping daemon removed the other daemon's socket");
	ep_conn_t *c2;
	TH_OK(ep_connect(d2.sock, &c2));
	ep_close(c2);
	printf("ok: a stopping daemon leaves a socket it does not own\n");
	th_daemon_stop(&d2);
	return 0;
}
