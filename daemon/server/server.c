/* SPDX-License-Identifier: MIT */
/*
 * The server: the Unix socket listener (own or socket-activated), signals
 * (TERM/INT stop, HUP reloads), systemd notifications, the backend choice.
 */
#include "server.h"
#include "sd.h"
#include "cluster/cluster.h"
#include "core/backend.h"
#include "util/stall.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>


static void notify_status(struct epd_server *srv)
{
	unsigned nc = 0, ng = 0;
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->clients) nc++;
	LIST_FOREACH(it, tmp, &srv->groups) ng++;
	epd_sd_notify("STATUS=backend %s, %u clients, %u groups", srv->backend,
		   nc, ng);
}

static void on_listen(uv_poll_t *h, int status, int events)
{
	struct epd_server *srv = h->data;
	(void)events;
	if (status < 0) {
		epd_err("listener: %s", uv_strerror(status));
		return;
	}
	for (int i = 0; i < 64; i++) {
		int fd = accept4(srv->listen_fd, NULL, NULL,
				 SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0 && (errno == EMFILE || errno == ENFILE)) {
			/* Out of descriptors: the pending connection would
			 * keep the listener readable and this loop spinning.
			 * Spend the reserve to accept it and close it at once
			 * (its client sees a reset), then take the reserve
			 * back, as nginx and libuv's docs advise. */
			int e = errno;
			srv->n_limited++;
			epd_log_limited(&srv->log_rl, "accept: %s; closing new "
					     "connections until descriptors "
					     "are free",
					strerror(e));
			if (srv->reserve_fd >= 0) {
				close(srv->reserve_fd);
				fd = accept4(srv->listen_fd, NULL, NULL,
					     SOCK_CLOEXEC);
				if (fd >= 0)
					close(fd);
				srv->reserve_fd =
					open("/dev/null", O_RDONLY | O_CLOEXEC);
			}
			if (fd < 0)
				break;
			continue;
		}
		if (fd < 0) {
			if (errno != EAGAIN && errno != EINTR)
				epd_warn("accept: %m");
			break;
		}
		epd_client_accept(srv, fd);
	}
	notify_status(srv);
}

static int listen_socket(struct epd_server *srv)
{
	const struct epd_config *cfg = &srv->cfg;
	int n = epd_sd_listen_fds();
	if (n > 1) {
		epd_err("socket activation passed %d sockets; expected one", n);
		return -1;
	}
	if (n == 1) {
		srv->listen_fd = epd_sd_first_fd();
		srv->socket_activated = true;
		fcntl(srv->listen_fd, F_SETFL,
		      fcntl(srv->listen_fd, F_GETFL) | O_NONBLOCK);
		epd_info("using the socket passed by systemd");
		return 0;
	}
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if (strlen(cfg->socket_path) >= sizeof(sa.sun_path)) {
		epd_err("socket path too long: %s", cfg->socket_path);
		return -1;
	}
	strcpy(sa.sun_path, cfg->socket_path);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		epd_err("socket: %m");
		return -1;
	}
	/* A stale socket file from a dead daemon is replaced; a live daemon's
	 * is not. */
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 ||
	    errno == EAGAIN) {
		epd_err("another daemon is listening on %s", cfg->socket_path);
		close(fd);
		return -1;
	}
	unlink(cfg->socket_path);
	/* Started by hand, not by systemd: its directory may not exist yet
	 * (/run is a tmpfs). Only the last component is made, 0755. */
	char dir[sizeof(sa.sun_path)];
	snprintf(dir, sizeof(dir), "%s", cfg->socket_path);
	char *slash = strrchr(dir, '/');
	if (slash && slash != dir) {
		*slash = 0;
		if (mkdir(dir, 0755) == 0)
			epd_info("created %s for the socket", dir);
		else if (errno != EEXIST)
			epd_warn("cannot create %s: %m", dir);
	}
	mode_t old = umask(0777 & ~cfg->socket_mode);
	int rc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
	umask(old);
	if (rc) {
		epd_err("bind %s: %m", cfg->socket_path);
		close(fd);
		return -1;
	}
	chmod(cfg->socket_path, cfg->socket_mode);
	struct stat st;
	if (stat(cfg->socket_path, &st) == 0) {
		srv->sock_dev = st.st_dev;
		srv->sock_ino = st.st_ino;
	}
	if (listen(fd, 128)) {
		epd_err("listen %s: %m", cfg->socket_path);
		close(fd);
		unlink(cfg->socket_path);
		return -1;
	}
	srv->listen_fd = fd;
	srv->unlink_socket = true;
	return 0;
}

/* The socket file, if it is still the one we bound: another daemon may
 * have replaced it (after removing ours) and must keep it. */
static void unlink_own_socket(struct epd_server *srv)
{
	struct stat st;
	if (!srv->unlink_socket)
		return;
	if (stat(srv->cfg.socket_path, &st) == 0 &&
	    (st.st_dev != srv->sock_dev || st.st_ino != srv->sock_ino)) {
		epd_notice("%s is no longer our socket; leaving it",
			   srv->cfg.socket_path);
		return;
	}
	unlink(srv->cfg.socket_path);
}

static void on_stop_signal(uv_signal_t *h, int sig)
{
	struct epd_server *srv = h->data;
	epd_notice("received %s, shutting down", strsignal(sig));
	epd_server_stop(srv);
}

/* Clients whose uid a narrowed allow_users no longer admits. */
static void close_disallowed(struct epd_server *srv)
{
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->clients)
	{
		struct epd_client *c = LIST_ENTRY(it, struct epd_client, node);
		if (!epd_uid_allowed(&srv->cfg, c->s.uid)) {
			epd_notice("client %lu (pid %d): uid %u is no longer in "
				   "allow_users; closing",
				   (unsigned long)c->s.id, (int)c->s.pid,
				   (unsigned)c->s.uid);
			epd_client_doom(c, "uid removed from allow_users");
		}
	}
}

/* The configuration a reload would run: the file, then the command line's
 * overrides, as at start. 0, or -1 (logged) to keep the running one. */
static int reload_config(struct epd_server *srv, struct epd_config *c)
{
	epd_config_defaults(c);
	if (srv->config_path[0] &&
	    epd_config_load(c, srv->config_path, srv->config_existed))
		return -1;
	for (int i = 0; i < srv->noverrides; i++)
		if (epd_config_set(c, srv->overrides[i]))
			return -1;
	return 0;
}

/* A loop turn missed for this long is logged (util/stall.h). */
#define STALL_WARN_MS 1000

static void on_sd_watchdog(uv_timer_t *t)
{
	(void)t;
	epd_sd_notify("WATCHDOG=1");
}

static void on_hup(uv_signal_t *h, int sig)
{
	struct epd_server *srv = h->data;
	(void)sig;
	epd_sd_notify("RELOADING=1\nMONOTONIC_USEC=%lu",
		   (unsigned long)(epd_now_ns() / 1000));
	struct epd_config c;
	srv->reloads++;
	srv->reload_ns = epd_now_ns();
	epd_log_capture(srv->reload_error, sizeof(srv->reload_error));
	const int failed = reload_config(srv, &c);
	epd_log_capture(NULL, 0);
	srv->reload_failed = failed;
	if (failed) {
		/* seen in the status and by epctl check (degraded) until a
		 * reload succeeds */
		srv->reload_failures++;
		epd_err("reload of %s failed; keeping the running "
			"configuration",
			srv->config_path);
	} else {
		srv->reload_error[0] = 0;
		if (strcmp(c.socket_path, srv->cfg.socket_path))
			epd_warn("socket path changes need a restart; still "
				 "on %s",
				 srv->cfg.socket_path);
		/* What can change at run time. */
		srv->cfg.log_level = c.log_level;
		epd_log_level = c.log_level;
		srv->cfg.timeout_ms = c.timeout_ms;
		srv->cfg.frame_timeout_ms = c.frame_timeout_ms;
		srv->cfg.cuda_sms = c.cuda_sms;
		srv->cfg.cuda_copy_sms = c.cuda_copy_sms;
		srv->cfg.cuda_no_resident = c.cuda_no_resident;
		srv->cfg.cuda_no_tma = c.cuda_no_tma;
		srv->cfg.cuda_no_fused_prep = c.cuda_no_fused_prep;
		srv->cfg.cuda_combine_fetch = c.cuda_combine_fetch;
		srv->cfg.nallow = c.nallow;
		memcpy(srv->cfg.allow_uids, c.allow_uids,
		       sizeof(c.allow_uids));
		memcpy(&srv->cfg.limits, &c.limits, sizeof(c.limits));
		epd_notice("configuration reloaded from %s%s (log level %s, "
			   "timeout %u ms)",
			   srv->config_path,
			   srv->noverrides ? " and the command line" : "",
			   epd_log_level_name(epd_log_level),
			   srv->cfg.timeout_ms);
		close_disallowed(srv);
	}
	epd_config_free(&c);
	epd_sd_notify("READY=1");
	notify_status(srv);
}

int epd_server_overrides(struct epd_server *srv, char *const *kv, int n)
{
	srv->overrides = calloc((size_t)n + 1, sizeof(char *));
	if (!srv->overrides)
		return -1;
	for (int i = 0; i < n; i++)
		if (!(srv->overrides[srv->noverrides++] = strdup(kv[i])))
			return -1;
	return 0;
}

/* auto: the first device backend compiled in that finds its devices
 * (CUDA when a driver and a GPU are there), else host, saying why. */
static int choose_backend(struct epd_server *srv)
{
	const char *want = srv->cfg.backend;
	srv->backend = "host";
	srv->dev = NULL;
	if (!strcmp(want, "host")) {
		snprintf(srv->backend_reason, sizeof(srv->backend_reason),
			 "host requested");
		return 0;
	}
	char why[160];
	snprintf(why, sizeof(why), "epd was built without the %s backend",
		 strcmp(want, "auto") ? want : "cuda");
	for (const struct epd_backend_ops *const *b = epd_backends; *b; b++) {
		if (strcmp(want, "auto") && strcmp(want, (*b)->name))
			continue;
		if ((*b)->init(srv, why, sizeof(why)) == 0) {
			srv->dev = *b;
			srv->backend = (*b)->name;
			snprintf(srv->backend_reason,
				 sizeof(srv->backend_reason), "%s", why);
			return 0;
		}
	}
	snprintf(srv->backend_reason, sizeof(srv->backend_reason), "%s", why);
	if (strcmp(want, "auto")) {
		epd_err("backend %s requested, but %s", want, why);
		return -1;
	}
	epd_notice("no CUDA backend (%s): running the host backend", why);
	return 0;
}

int epd_server_init(struct epd_server *srv, uv_loop_t *loop,
		    const struct epd_config *cfg, const char *config_path)
{
	memset(srv, 0, sizeof(*srv));
	/* A peer or client that resets its connection must cost us an EPIPE
	 * on that connection, never the process: libuv's stream writes and
	 * the rdma/tcp transports use plain write(2). */
	signal(SIGPIPE, SIG_IGN);
	srv->loop = loop;
	srv->cfg = *cfg;
	snprintf(srv->config_path, sizeof(srv->config_path), "%s",
		 config_path ? config_path : "");
	srv->config_existed = config_path && access(config_path, F_OK) == 0;
	srv->start_ns = epd_now_ns();
	srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	srv->epoch = (uint32_t)time(NULL);
	srv->systemd = getenv("NOTIFY_SOCKET") != NULL;
	LIST_INIT(&srv->clients);
	LIST_INIT(&srv->groups);
	if (choose_backend(srv))
		return -1;
	srv->pool = epd_pool_new(cfg->worker_threads);
	if (!srv->pool) {
		epd_err("cannot start the data-path threads");
		return -1;
	}
	if (listen_socket(srv)) {
		epd_pool_free(srv->pool);
		return -1;
	}
	char err[256];
	if (epd_cluster_init(srv, epd_transports, err, sizeof(err))) {
		epd_err("%s", err);
		close(srv->listen_fd);
		if (srv->unlink_socket)
			unlink(srv->cfg.socket_path);
		epd_pool_free(srv->pool);
		return -1;
	}
	uv_idle_init(loop, &srv->reaper);
	srv->reaper.data = srv;
	uv_poll_init(loop, &srv->listen_poll, srv->listen_fd);
	srv->listen_poll.data = srv;
	uv_poll_start(&srv->listen_poll, UV_READABLE, on_listen);
	uv_signal_init(loop, &srv->sig_term);
	uv_signal_init(loop, &srv->sig_int);
	uv_signal_init(loop, &srv->sig_hup);
	srv->sig_term.data = srv->sig_int.data = srv->sig_hup.data = srv;
	uv_signal_start(&srv->sig_term, on_stop_signal, SIGTERM);
	uv_signal_start(&srv->sig_int, on_stop_signal, SIGINT);
	uv_signal_start(&srv->sig_hup, on_hup, SIGHUP);
	/* a loop that stands still is said in the log (util/stall.h), and,
	 * under systemd's WatchdogSec=, gets the service restarted */
	epd_stall_start(loop, STALL_WARN_MS);
	uv_timer_init(loop, &srv->sd_watchdog);
	srv->sd_watchdog.data = srv;
	srv->sd_watchdog_usec = epd_sd_watchdog_usec();
	if (srv->sd_watchdog_usec) {
		uint64_t ms = srv->sd_watchdog_usec / 2000;
		uv_timer_start(&srv->sd_watchdog, on_sd_watchdog, ms ? ms : 1,
			       ms ? ms : 1);
	}
	epd_notice("epd %s listening on %s (backend %s: %s; %u data-path "
		   "threads)",
		   PACKAGE_VERSION,
		   srv->socket_activated ? "(socket activation)"
					 : cfg->socket_path,
		   srv->backend, srv->backend_reason,
		   epd_pool_size(srv->pool));
	return 0;
}

int epd_server_run(struct epd_server *srv)
{
	epd_sd_notify("READY=1\nMAINPID=%d", (int)getpid());
	notify_status(srv);
	uv_run(srv->loop, UV_RUN_DEFAULT);
	epd_xop_stash_free(srv);
	epd_xbufs_free(srv);
	epd_cluster_free(srv);
	if (srv->dev)
		srv->dev->fini(srv);
	epd_pool_free(srv->pool);
	srv->pool = NULL;
	if (srv->reserve_fd >= 0)
		close(srv->reserve_fd);
	for (int i = 0; i < srv->noverrides; i++)
		free(srv->overrides[i]);
	free(srv->overrides);
	return 0;
}

void epd_server_stop(struct epd_server *srv)
{
	if (srv->stopping)
		return;
	srv->stopping = true;
	epd_sd_notify("STOPPING=1");
	uv_poll_stop(&srv->listen_poll);
	uv_close((uv_handle_t *)&srv->listen_poll, NULL);
	close(srv->listen_fd);
	unlink_own_socket(srv);
	/* Pending ops fail with ESHUTDOWN; every rank is told. */
	epd_groups_shutdown(srv);
	epd_cluster_stop(srv);
	epd_xwin_flush(srv);
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->clients)
	{
		struct epd_client *c = LIST_ENTRY(it, struct epd_client, node);
		uint8_t buf[128];
		size_t n = epp_error_encode(EP_ESHUTDOWN,
					    "daemon is shutting down", buf,
					    sizeof(buf));
		epd_client_send(c, EPP_NOTICE, 0, 0, buf, (uint32_t)n, NULL, 0);
		epd_client_close(c, "daemon shutting down");
	}
	uv_close((uv_handle_t *)&srv->reaper, NULL);
	uv_close((uv_handle_t *)&srv->sig_term, NULL);
	uv_close((uv_handle_t *)&srv->sig_int, NULL);
	uv_close((uv_handle_t *)&srv->sig_hup, NULL);
	uv_close((uv_handle_t *)&srv->sd_watchdog, NULL);
	epd_stall_stop();
}
