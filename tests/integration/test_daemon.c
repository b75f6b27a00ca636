/* SPDX-License-Identifier: MIT */
/*
 * The daemon as an operator sees it: epctl status (text and JSON), exit
 * codes, SIGHUP reload, SIGTERM with ranks inside a barrier, peer
 * credentials, socket mode, a stale or live socket at start.
 */
#include "harness.h"

#include <jansson.h>
#include <signal.h>
#include <string.h>
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

static void check_reload(struct th_daemon *d)
{
	FILE *f = fopen(d->conf, "w");
	fprintf(f, "[epd]\nlog_level = debug\ntimeout_ms = 1234\n");
	fclose(f);
	kill(d->pid, SIGHUP);
	for (int i = 0; i < 200; i++) {
		ep_conn_t *c;
		char *js;
		TH_OK(ep_connect(d->sock, &c));
		TH_OK(ep_daemon_status(c, &js));
		ep_close(c);
		bool done = strstr(js, "\"log_level\":\"debug\"") != NULL;
		free(js);
		if (done) {
			/* The new default timeout applies to new groups. */
			struct ep_group_config cfg = th_group("r", 2, 0, 0);
			ep_group_t *g;
			TH_OK(ep_connect(d->sock, &c));
			TH_OK(ep_join(c, &cfg, EP_JOIN_NOWAIT, &g));
			TH_OK(ep_daemon_status(c, &js));
			TH_CHECK(strstr(js, "\"timeout_ms\":1234"),
				 "timeout not reloaded: %s", js);
			free(js);
			ep_close(c);
			printf("ok: SIGHUP reloaded log level and timeout\n");
			return;
		}
		th_sleep_ms(10);
	}
	TH_CHECK(0, "SIGHUP did not reload the configuration");
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

	/* A stale socket file (its daemon died) is replaced at start. */
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", d.sock);
	int fd = socket(AF_UNIX, SOCK_STREAM, 0);
	TH_CHECK(bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0,
		 "bind stale socket");
	close(fd);
	th_daemon_start_in(&d, NULL);
	printf("ok: a stale socket file is replaced at start\n");
	th_daemon_stop(&d);
	return 0;
}
