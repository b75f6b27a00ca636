/* SPDX-License-Identifier: MIT */
/*
 * The server: the daemon's loop, its Unix socket listener, signals,
 * reloads and client connections (framed requests in, replies out), on top
 * of the core (groups) and the cluster. main.c starts it.
 */
#ifndef EPD_SERVER_H
#define EPD_SERVER_H

#include "core/core.h"
#include "epp_rbuf.h"

/* Descriptors of one reply (a join's two regions at most). */
#define EPD_OUT_FDS 4

/* A queued outgoing frame. */
struct epd_out {
	struct list_node node;
	size_t len, off;
	int fds[EPD_OUT_FDS];
	unsigned nfds;
	uint8_t data[];
};

/* A client connection; s, the part the core sees, first. */
struct epd_client {
	struct epd_session s; /* srv, id, credentials, members, send */
	struct list_node node; /* in server->clients */
	int fd;
	uv_poll_t poll;
	uv_timer_t frame_timer; /* partial-frame timeout */
	char name[64];
	uint64_t connected_ns;
	struct epp_rbuf rb; /* bytes received, not yet handled */
	struct list_node outq;
	size_t outq_bytes;
	unsigned outq_fds; /* descriptors in outq, not yet sent */
	bool close_after_flush;
	bool closing;
	bool doomed; /* to be closed by the reaper (see epd_client_doom) */
	int refused; /* an error code: its first frame gets it, then close */
	char why[96]; /* why it is doomed or refused */
	int pending_handles; /* handles whose close callback is outstanding */
	/* Descriptors received and not yet claimed by a frame, in order: a
	 * frame's arrive with its first byte, before the frame is whole. */
	int fdq[EPP_MAX_FDS];
	unsigned nfdq;
};

/* server.c */
int epd_server_init(struct epd_server *srv, uv_loop_t *loop,
		    const struct epd_config *cfg, const char *config_path);
int epd_server_run(struct epd_server *srv);
void epd_server_stop(struct epd_server *srv);
/* The command line's key=value overrides, applied again on every reload
 * (copied). */
int epd_server_overrides(struct epd_server *srv, char *const *kv, int n);

/* client.c */
void epd_client_accept(struct epd_server *srv, int fd);
/* Queue a frame; fds are owned by the queue (closed after sending). */
int epd_client_send(struct epd_client *c, uint16_t type, uint16_t flags,
		    uint64_t req_id, const void *payload, uint32_t len,
		    const int *fds, unsigned nfds);
void epd_client_close(struct epd_client *c, const char *why);
bool epd_uid_allowed(const struct epd_config *cfg, uid_t uid);
/* Close c from the loop's next turn, not now: for paths that may run inside
 * another object's state change (a reply that fails while a group fails).
 * Idempotent; nothing more is sent to or read from c. */
void epd_client_doom(struct epd_client *c, const char *why);

/* registry.c: the device backends and the transports compiled in,
 * NULL-terminated, in the order `auto` tries them. */
extern const struct epd_backend_ops *const epd_backends[];
extern const struct epd_transport_ops *const epd_transports[];

/* status.c: JSON text, malloc'd. */
char *epd_status_json(struct epd_server *srv, const struct epd_session *viewer);

#endif
