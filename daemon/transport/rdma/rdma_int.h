/* SPDX-License-Identifier: MIT */
/*
 * The rdma transport's shared parts. rdma.c: connection management (the
 * CM events, listening and dialling, device removal, the transport table);
 * stream.c: the byte stream over a queue pair (sends, receives, the
 * completion queue); write.c: one-sided writes (regions, the proxy's
 * poster, holding connections while writes may be queued).
 *
 * The rdma transport of the cluster (librdmacm + libibverbs): a reliable,
 * ordered byte stream per peer over an RC queue pair, which cluster.c uses
 * exactly as it uses a tcp connection (same frames, same HELLO/AUTH).
 *
 * Connection management: one rdma_cm event channel, watched from the libuv
 * loop (uv_poll). A dial resolves the address and the route, creates the
 * queue pair and connects with private data that cluster.c fills (version,
 * cluster id, node index, a proof of the key) and checks on the other side
 * before accepting, so a stranger is rejected before any queue pair is
 * made for it.
 *
 * Data: each connection registers one block: RD_RECVS receive buffers, all
 * posted, and RD_SENDS send buffers. Bytes to send are queued and cut into
 * chunks of RD_CHUNK, each one SEND; a receive completion hands its bytes
 * up and reposts the buffer. Flow control is the RC transport's: a SEND
 * that finds no posted buffer is retried by the hardware (receiver not
 * ready, retried without limit). Completions come through a completion
 * channel per connection, also watched from the loop.
 *
 * Token rows (xnode.c) move by RDMA WRITE, one work request per row, from
 * the source rank's registered input to the destination rank's registered
 * receive buffer on the peer (its address and key came in the group's
 * XWIN frame); the last write to a peer carries an immediate that tells it
 * the op's rows from this node are all placed (RC orders it after them).
 * Writes are queued on the proxy (proxy.h) by any thread and posted by its
 * thread, at most RD_WRITES outstanding per queue pair, a completion asked
 * for every RD_SIGNAL writes and on each immediate. The regions live in
 * one protection domain shared by the queue pairs of the first device
 * (rd->pd); a connection on another device gets its own and is not offered
 * for writes (frames carry its rows).
 *
 * Compiled whenever libibverbs and librdmacm are found; run only where an
 * RDMA device exists (the development and CI machines have none: see
 * README).
 */
#ifndef EPD_RDMA_INT_H
#define EPD_RDMA_INT_H

#include "epp_rbuf.h"
#include "proxy.h"
#include "transport/transport.h"
#include "util/log.h"

#include <arpa/inet.h>
#include <errno.h>
#include <sched.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RD_CHUNK 65536
#define RD_RECVS 32
#define RD_SENDS 32
#define RD_TIMEOUT_MS 2000
#define RD_WRITES 1024 /* writes outstanding per queue pair */
#define RD_SIGNAL 64   /* a completion every this many writes */
#define RD_PROXY_SLOTS 8192
/* wr_id of a signaled write: marker, immediate, writes covered, cookie */
#define WR_WRITE (1ull << 63)
#define WR_IMM (1ull << 62)
#define WR_COUNT_SHIFT 47
#define WR_COOKIE_MASK ((1ull << WR_COUNT_SHIFT) - 1)

struct epd_rdma {
	struct epd_transport base;
	uv_loop_t *loop;
	const struct epd_transport_cb *cb;
	void *arg;
	struct rdma_event_channel *ch;
	struct rdma_cm_id *listener;
	uv_poll_t poll;
	int nconn; /* connections not yet freed (their ids use ch) */
	bool closing, poll_closed;
	/* the protection domain of the first device's queue pairs, where
	 * regions for writes are registered; freed last */
	struct ibv_pd *pd;
	struct ibv_context *pd_ctx;
	int nmr;
	/* Device removal (RDMA_CM_EVENT_DEVICE_REMOVAL): the kernel waits
	 * until every object on the device is gone. Regions are deregistered
	 * at once (their owners free the husks later), connections on it
	 * fail, the listener on it goes; the shared domain is freed with the
	 * last queue pair in it (dead_users), and librdmacm closes its device
	 * context once it learns the device is gone (sync_devices below). */
	struct epd_rconn *conns; /* every connection not yet freed */
	struct epd_rmr *mrs;     /* every region */
	struct ibv_pd *dead_pd;
	int dead_users;
	bool drop_listener; /* destroy it once the event is acked */
	bool relisten;      /* the listener went with a device */
	uv_timer_t relisten_timer; /* tries to listen again, every second */
	bool relisten_init;
	struct sockaddr_storage listen_sa;
	char removed[96];   /* the last removal, for errors and status */
	struct epd_proxy *proxy;
	/* connections closed while the proxy may still hold writes for
	 * them: freed once it passed linger_ticket */
	struct epd_rconn *linger;
	uv_timer_t linger_timer;
	bool linger_init;
};

struct epd_rmr {
	struct epd_tmr base; /* its keys */
	struct epd_rdma *rd;
	struct ibv_mr *mr; /* NULL once its device was removed */
	struct ibv_context *ctx;
	struct epd_rmr *next, **pprev;
};

struct epd_rconn {
	struct epd_tconn base; /* base.user: NULL once closed: no more
				  callbacks */
	struct epd_rdma *rd;
	struct rdma_cm_id *id;
	struct ibv_pd *pd;
	struct ibv_comp_channel *cc;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	uint8_t *mem; /* [RD_RECVS + RD_SENDS][RD_CHUNK] */
	uv_poll_t cq_poll;
	uv_timer_t reaper; /* closed last: frees the connection */
	int handles;       /* open libuv handles */
	bool polling, qp, connected, closing, own_pd;
	int refs;               /* epd_rdma_hold */
	int wr_out;             /* writes outstanding (atomic) */
	uint32_t unsignaled;    /* proxy thread only */
	uint64_t linger_ticket; /* proxy ticket to pass before the free */
	struct epd_rconn *linger_next;
	uint8_t pdata[64];
	uint8_t plen;
	struct epd_rconn *next, **pprev; /* rd->conns */
	/* send slots not in flight, and bytes not yet posted */
	uint32_t free_slot[RD_SENDS];
	int nfree;
	struct epp_rbuf sq;
};

extern const struct epd_transport_ops epd_rdma_transport;

/* Shared between the transport's files. */
bool epd_rdma_can_write(const struct epd_rconn *rc);
void epd_rdma_close(struct epd_rconn *rc);
void epd_rdma_dereg(struct epd_rmr *m);
void epd_rdma_hold(struct epd_rconn *rc);
struct epd_rmr *epd_rdma_reg(struct epd_rdma *rd, void *p, size_t len, bool remote_write, char *why, size_t wl);
void epd_rdma_release(struct epd_rconn *rc);
int epd_rdma_send(struct epd_rconn *rc, const struct iovec *iov, int n);
uint64_t epd_rdma_stats(const struct epd_rdma *rd, uint64_t *batches);
uint64_t epd_rdma_write(struct epd_rdma *rd, struct epd_cmd *c);
void rd_handle_closed(uv_handle_t *h);
void rd_on_cq(uv_poll_t *p, int status, int events);
int rd_post_recv(struct epd_rconn *rc, uint32_t i);
void rd_pump(struct epd_rconn *rc);
void rconn_fail(struct epd_rconn *rc, const char *why);
void rconn_free(struct epd_rconn *rc);
void rd_post(void *arg, const struct epd_cmd *c, size_t n);
void rd_rdma_maybe_free(struct epd_rdma *rd);

#endif
