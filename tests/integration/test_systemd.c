/* SPDX-License-Identifier: MIT */
/*
 * systemd integration without systemd: a datagram socket stands in for
 * NOTIFY_SOCKET, and a listening socket is handed over as LISTEN_FDS. Checks
 * READY=1 / RELOADING=1 / STOPPING=1 and that clients are served on the
 * activated socket (which the daemon must not unlink).
 */
#include "harness.h"

#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

static char notify_path[108];
static int listen_fd = -1;

static void child_env(void)
{
	setenv("NOTIFY_SOCKET", notify_path, 1);
	if (listen_fd >= 0) {
		char pid[32];
		dup2(listen_fd, 3);
		snprintf(pid, sizeof(pid), "%d", (int)getpid());
		setenv("LISTEN_FDS", "1", 1);
		setenv("LISTEN_PID", pid, 1);
	}
}

/* Wait for a notification containing `what`. */
static void expect_notify(int fd, const char *what)
{
	uint64_t end = th_now_ns() + 5000000000ull;
	char buf[512];
	while (th_now_ns() < end) {
		struct pollfd p = {.fd = fd, .events = POLLIN};
		if (poll(&p, 1, 100) != 1)
			continue;
		ssize_t n = recv(fd, buf, sizeof(buf) - 1, 0);
		if (n <= 0)
			continue;
		buf[n] = 0;
		if (strstr(buf, what)) {
			printf("ok: notified %s\n", what);
			return;
		}
	}
	TH_CHECK(0, "no %s notification", what);
}

int main(void)
{
#ifndef HAVE_LIBSYSTEMD
	printf("skip: built without libsystemd\n");
	return TH_SKIP;
#endif
	th_init("systemd: notify and socket activation", 60);
	struct th_daemon d;
	/* A throwaway daemon gives us a private directory. */
	th_daemon_start(&d, NULL);
	th_daemon_stop(&d);

	snprintf(notify_path, sizeof(notify_path), "%s/notify", d.dir);
	int nfd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	memcpy(sa.sun_path, notify_path, strlen(notify_path) + 1);
	TH_CHECK(bind(nfd, (struct sockaddr *)&sa, sizeof(sa)) == 0,
		 "bind notify socket");

	/* The "socket unit": we create and listen, the daemon inherits. */
	listen_fd = socket(AF_UNIX, SOCK_STREAM, 0);
	struct sockaddr_un la = {.sun_family = AF_UNIX};
	memcpy(la.sun_path, d.sock, strlen(d.sock) + 1);
	TH_CHECK(bind(listen_fd, (struct sockaddr *)&la, sizeof(la)) == 0 &&
			 listen(listen_fd, 16) == 0,
		 "listen");
	th_daemon_child_hook = child_env;
	th_daemon_start_in(&d, NULL);
	close(listen_fd);
	expect_notify(nfd, "READY=1");

	char *js;
	ep_conn_t *c;
	TH_OK(ep_connect(d.sock, &c));
	TH_OK(ep_daemon_status(c, &js));
	TH_CHECK(strstr(js, "\"systemd\":true"), "status: %s", js);
	free(js);
	ep_close(c);

	kill(d.pid, SIGHUP);
	expect_notify(nfd, "RELOADING=1");
	expect_notify(nfd, "READY=1");
	kill(d.pid, SIGTERM);
	expect_notify(nfd, "STOPPING=1");
	for (int i = 0; i < 500 && th_daemon_alive(&d); i++)
		th_sleep_ms(10);
	TH_CHECK(!th_daemon_alive(&d), "epd did not stop");
	struct stat sb;
	TH_CHECK(stat(d.sock, &sb) == 0,
		 "epd removed the socket that systemd owns");
	printf("ok: socket activation; the unit's socket is left in place\n");
	return 0;
}
