/* SPDX-License-Identifier: MIT */
/*
 * A transport between the daemons of a cluster: what the cluster
 * (cluster/) needs to talk to another node, whatever carries the bytes.
 *
 *   - A stream per pair of nodes: reliable, ordered bytes, opened by one
 *     side's dial and the other's accept. The cluster puts its frames,
 *     handshake and authentication on it; the transport knows nothing of
 *     them (it may carry a few bytes of the dialler's in its connect
 *     request, checked before anything is set up for the dialler: the
 *     rdma transport does).
 *   - Optionally, one-sided writes: a region of this node's memory
 *     registered, and a write from it to a peer's registered region,
 *     queued by any thread, with an immediate that tells the peer that
 *     every write before it is placed. Where a transport (or a connection)
 *     has none, the cross-node op engine sends rows as frames.
 *
 * Implementations: transport/tcp (libuv), transport/rdma (librdmacm and
 * libibverbs, compiled in by its Automake conditional); server/registry.c
 * lists those compiled in, and the cluster is handed that list. Everything runs on the libuv loop thread except
 * write(), hold() and release() where said.
 *
 * The objects a transport hands out begin with these public parts (the
 * transport's own structs embed them first), so the cluster can read a
 * connection's user pointer or a region's keys without a call.
 */
#ifndef EPD_TRANSPORT_H
#define EPD_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <uv.h>

struct epd_transport_ops;

struct epd_transport {
	const struct epd_transport_ops *ops;
};

struct epd_tconn {
	struct epd_transport *t;
	void *user; /* the cluster's, given at dial or returned by accept */
};

/* A registered region: its keys for writes from it (lkey) and into it
 * (rkey, sent to the peers). */
struct epd_tmr {
	uint32_t lkey, rkey;
};

/* One write: len bytes from laddr (lkey) to raddr (rkey) on conn; with
 * EPD_CMD_IMM the write carries imm and its completion reports cookie. */
#define EPD_CMD_IMM 1u
struct epd_cmd {
	void *conn; /* a held struct epd_tconn */
	uint64_t laddr, raddr, cookie;
	uint32_t lkey, rkey, len, imm;
	uint32_t flags;
};

/* The cluster's side, on the loop thread; arg is the one given to open(). */
struct epd_transport_cb {
	/* Someone connected (addr: who, for the log). pdata: the bytes of
	 * the dialler's connect request, or NULL where the transport has
	 * none. The user pointer to accept it, or NULL and why to refuse. */
	void *(*accept)(void *arg, struct epd_tconn *tc, const char *addr,
			const void *pdata, uint8_t plen, char *why, size_t wl);
	/* The stream is up, both ways. */
	void (*established)(void *arg, void *user);
	/* Where the next bytes of the stream go: at least `want` bytes at the
	 * returned pointer (*room says how many), or NULL (out of memory:
	 * the connection closes). Then rx() says how many were put there. */
	uint8_t *(*rx_buf)(void *arg, void *user, size_t want, size_t *room);
	void (*rx)(void *arg, void *user, size_t n);
	/* The connection is gone (no more calls for it); the transport frees
	 * it. Not called after close(). */
	void (*closed)(void *arg, void *user, const char *why);
	/* Writes only: a peer's write with immediate landed here (every
	 * write it posted before on this connection is placed); our write
	 * with immediate (and every one before it) completed. */
	void (*imm)(void *arg, void *user, uint32_t imm);
	void (*written)(void *arg, void *user, uint64_t cookie);
};

struct epd_transport_ops {
	const char *name;
	/* It cannot reach a node on a loopback address (the RDMA CM cannot
	 * route over lo): not chosen by `transport = auto` then. */
	bool no_loopback;
	/* Can it run here? why: what was found, or why not. */
	bool (*available)(char *why, size_t len);
	struct epd_transport *(*open)(uv_loop_t *loop,
				      const struct epd_transport_cb *cb,
				      void *arg, char *err, size_t errlen);
	int (*listen)(struct epd_transport *t, const struct sockaddr *sa,
		      char *err, size_t errlen);
	/* Connect; pdata (at most 56 bytes, where the transport carries any)
	 * travels in the connect request. NULL if it cannot even start. */
	struct epd_tconn *(*dial)(struct epd_transport *t,
				  const struct sockaddr *sa, const void *pdata,
				  uint8_t plen, void *user);
	/* Queue n pieces as one unit of the stream. Each piece is copied,
	 * except piece `keep` (>= 0) when done is given: it is sent from
	 * where it is and done(done_arg) runs once the transport no longer
	 * needs it (also when the connection fails first). -1 if the
	 * connection cannot send (then done is not called). */
	int (*send)(struct epd_tconn *tc, const struct iovec *iov, int n,
		    int keep, void (*done)(void *), void *done_arg);
	/* Close; no callback for it afterwards. */
	void (*close)(struct epd_tconn *tc);
	/* Stop listening, close every connection, free (once the last
	 * connection is gone). */
	void (*free)(struct epd_transport *t);
	/* Why dials fail now (its device was removed), or NULL. */
	const char *(*down_why)(const struct epd_transport *t);
	/* Whether bytes sent in the connect request are checked before the
	 * peer gets anything (then the cluster fills and checks pdata). */
	bool pdata;

	/* One-sided writes; NULL where the transport has none. */
	/* Can this connection write (up, and in the domain regions are
	 * registered in)? */
	bool (*can_write)(const struct epd_tconn *tc);
	/* Register [p, p + len) for local reads, or also for the peers'
	 * writes. NULL and why if it cannot (no connection yet). */
	struct epd_tmr *(*reg)(struct epd_transport *t, void *p, size_t len,
			       bool remote_write, char *why, size_t wl);
	void (*dereg)(struct epd_tmr *m);
	/* A connection is freed only once nobody holds it and the writes
	 * queued for it were posted: hold it while another thread may queue
	 * writes on it (loop thread). */
	void (*hold)(struct epd_tconn *tc);
	void (*release)(struct epd_tconn *tc);
	/* Queue one write (c->conn held); any thread. Its ticket, 0 if
	 * refused (stopping). */
	uint64_t (*write)(struct epd_transport *t, struct epd_cmd *c);
	/* Writes posted so far, and in how many batches. */
	uint64_t (*stats)(const struct epd_transport *t, uint64_t *batches);
};


#endif
