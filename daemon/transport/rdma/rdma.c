/* SPDX-License-Identifier: MIT */
/*
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
static void epd_rdma_close(struct epd_rconn *rc);
static void rconn_fail(struct epd_rconn *rc, const char *why);

static bool epd_rdma_available(char *why, size_t len)
{
	int n = 0;
	struct ibv_device **l = ibv_get_device_list(&n);
	if (!l) {
		snprintf(why, len, "no RDMA device (ibv_get_device_list: %s)",
			 strerror(errno));
		return false;
	}
	ibv_free_device_list(l);
	if (n <= 0) {
		snprintf(why, len, "no RDMA device (ibv_get_device_list found "
				   "none)");
		return false;
	}
	snprintf(why, len, "%d RDMA device%s", n, n > 1 ? "s" : "");
	return true;
}

static void nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);
	if (fl >= 0)
		fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* "rdma from ADDR" for the log. */
static void peer_name(struct rdma_cm_id *id, char *out, size_t cap)
{
	char ip[INET6_ADDRSTRLEN] = "?";
	const struct sockaddr *sa = rdma_get_peer_addr(id);
	if (sa && sa->sa_family == AF_INET)
		inet_ntop(AF_INET, &((const struct sockaddr_in *)sa)->sin_addr,
			  ip, sizeof(ip));
	else if (sa && sa->sa_family == AF_INET6)
		inet_ntop(AF_INET6,
			  &((const struct sockaddr_in6 *)sa)->sin6_addr, ip,
			  sizeof(ip));
	snprintf(out, cap, "rdma from %s", ip);
}

/* A receive's bytes, into the buffer the cluster gives. */
static void deliver(struct epd_rconn *rc, const uint8_t *p, size_t n)
{
	size_t room = 0;
	uint8_t *to = rc->rd->cb->rx_buf(rc->rd->arg, rc->base.user, n, &room);
	if (!to || room < n) {
		rconn_fail(rc, "out of memory");
		return;
	}
	memcpy(to, p, n);
	rc->rd->cb->rx(rc->rd->arg, rc->base.user, n);
}

static void rconn_fail(struct epd_rconn *rc, const char *why)
{
	void *u = rc->base.user;
	rc->base.user = NULL;
	if (u)
		rc->rd->cb->closed(rc->rd->arg, u, why);
	epd_rdma_close(rc);
}

static int post_recv(struct epd_rconn *rc, uint32_t i)
{
	struct ibv_sge sge = {.addr = (uintptr_t)(rc->mem + (size_t)i * RD_CHUNK),
			      .length = RD_CHUNK,
			      .lkey = rc->mr->lkey};
	struct ibv_recv_wr wr = {.wr_id = i, .sg_list = &sge, .num_sge = 1},
			   *bad;
	return ibv_post_recv(rc->id->qp, &wr, &bad);
}

/* Post queued bytes while send slots are free. */
static void pump(struct epd_rconn *rc)
{
	/* Not established yet: bytes wait in sq (the passive side can
	 * receive the dialler's hello, and answer it, before its own
	 * ESTABLISHED event; its queue pair may not send before). */
	if (!rc->connected)
		return;
	while (rc->nfree > 0 && epp_rbuf_live(&rc->sq)) {
		uint32_t s = rc->free_slot[--rc->nfree];
		size_t n = epp_rbuf_live(&rc->sq);
		if (n > RD_CHUNK)
			n = RD_CHUNK;
		uint8_t *buf = rc->mem + (size_t)(RD_RECVS + s) * RD_CHUNK;
		memcpy(buf, rc->sq.p + rc->sq.off, n);
		struct ibv_sge sge = {.addr = (uintptr_t)buf,
				      .length = (uint32_t)n,
				      .lkey = rc->mr->lkey};
		struct ibv_send_wr wr = {.wr_id = RD_RECVS + s,
					 .sg_list = &sge,
					 .num_sge = 1,
					 .opcode = IBV_WR_SEND,
					 .send_flags = IBV_SEND_SIGNALED},
				   *bad;
		if (ibv_post_send(rc->id->qp, &wr, &bad)) {
			rc->free_slot[rc->nfree++] = s;
			rconn_fail(rc, "ibv_post_send failed");
			return;
		}
		epp_rbuf_take(&rc->sq, n);
	}
}

static void on_cq(uv_poll_t *p, int status, int events)
{
	struct epd_rconn *rc = p->data;
	(void)events;
	if (status < 0) {
		rconn_fail(rc, uv_strerror(status));
		return;
	}
	struct ibv_cq *cq;
	void *ctx;
	while (ibv_get_cq_event(rc->cc, &cq, &ctx) == 0) {
		ibv_ack_cq_events(cq, 1);
		if (ibv_req_notify_cq(cq, 0)) {
			rconn_fail(rc, "ibv_req_notify_cq failed");
			return;
		}
	}
	struct ibv_wc wc[16];
	int n = 0;
	while (!rc->closing && (n = ibv_poll_cq(rc->cq, 16, wc)) > 0) {
		for (int i = 0; i < n && !rc->closing; i++) {
			if (wc[i].status != IBV_WC_SUCCESS) {
				rconn_fail(rc, ibv_wc_status_str(wc[i].status));
				return;
			}
			uint32_t slot = (uint32_t)wc[i].wr_id;
			if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
				/* a peer's rows are placed; no bytes here */
				if (rc->base.user && rc->rd->cb->imm)
					rc->rd->cb->imm(rc->rd->arg, rc->base.user,
							 ntohl(wc[i].imm_data));
				if (!rc->closing && post_recv(rc, slot)) {
					rconn_fail(rc, "ibv_post_recv failed");
					return;
				}
			} else if (wc[i].wr_id & WR_WRITE) {
				uint64_t id = wc[i].wr_id;
				__atomic_fetch_sub(
					&rc->wr_out,
					(int)((id & ~(WR_WRITE | WR_IMM)) >>
					      WR_COUNT_SHIFT),
					__ATOMIC_RELEASE);
				if (id & WR_IMM && rc->base.user &&
				    rc->rd->cb->written)
					rc->rd->cb->written(rc->rd->arg, rc->base.user,
							     id & WR_COOKIE_MASK);
			} else if (wc[i].opcode & IBV_WC_RECV) {
				if (rc->base.user)
					deliver(rc, rc->mem + (size_t)slot *
								  RD_CHUNK,
						wc[i].byte_len);
				if (!rc->closing && post_recv(rc, slot)) {
					rconn_fail(rc, "ibv_post_recv failed");
					return;
				}
			} else {
				rc->free_slot[rc->nfree++] = slot - RD_RECVS;
			}
		}
		if (!rc->closing)
			pump(rc);
	}
	if (n < 0 && !rc->closing)
		rconn_fail(rc, "ibv_poll_cq failed");
}

/* Protection domain, completion channel and queue, the queue pair, the
 * registered block, every receive posted. */
static int setup_qp(struct epd_rconn *rc, char *why, size_t len)
{
	struct ibv_context *v = rc->id->verbs;
	struct epd_rdma *rd = rc->rd;
	if (!rd->pd) {
		rd->pd = ibv_alloc_pd(v);
		rd->pd_ctx = rd->pd ? v : NULL;
	}
	if (rd->pd && rd->pd_ctx == v) {
		rc->pd = rd->pd;
	} else {
		rc->pd = ibv_alloc_pd(v); /* another device: frames only */
		rc->own_pd = rc->pd != NULL;
	}
	rc->cc = rc->pd ? ibv_create_comp_channel(v) : NULL;
	rc->cq = rc->cc ? ibv_create_cq(v, RD_RECVS + RD_SENDS + RD_WRITES,
					rc, rc->cc, 0)
			: NULL;
	if (!rc->cq || ibv_req_notify_cq(rc->cq, 0)) {
		snprintf(why, len, "verbs setup: %s", strerror(errno));
		return -1;
	}
	struct ibv_qp_init_attr qa = {
		.send_cq = rc->cq,
		.recv_cq = rc->cq,
		.qp_type = IBV_QPT_RC,
		.cap = {.max_send_wr = RD_SENDS + RD_WRITES,
			.max_recv_wr = RD_RECVS,
			.max_send_sge = 1,
			.max_recv_sge = 1}};
	if (rdma_create_qp(rc->id, rc->pd, &qa)) {
		snprintf(why, len, "rdma_create_qp: %s", strerror(errno));
		return -1;
	}
	rc->qp = true;
	size_t bytes = (size_t)(RD_RECVS + RD_SENDS) * RD_CHUNK;
	rc->mem = aligned_alloc(4096, bytes);
	rc->mr = rc->mem ? ibv_reg_mr(rc->pd, rc->mem, bytes,
				      IBV_ACCESS_LOCAL_WRITE)
			 : NULL;
	if (!rc->mr) {
		snprintf(why, len, "registering %zu bytes: %s", bytes,
			 strerror(errno));
		return -1;
	}
	for (uint32_t i = 0; i < RD_RECVS; i++)
		if (post_recv(rc, i)) {
			snprintf(why, len, "ibv_post_recv: %s", strerror(errno));
			return -1;
		}
	for (uint32_t i = 0; i < RD_SENDS; i++)
		rc->free_slot[rc->nfree++] = i;
	nonblock(rc->cc->fd);
	if (uv_poll_init(rc->rd->loop, &rc->cq_poll, rc->cc->fd)) {
		snprintf(why, len, "watching the completion channel failed");
		return -1;
	}
	rc->cq_poll.data = rc;
	rc->polling = true;
	rc->handles++;
	uv_poll_start(&rc->cq_poll, UV_READABLE, on_cq);
	return 0;
}

static struct rdma_conn_param conn_param(const struct epd_rconn *rc)
{
	return (struct rdma_conn_param){.private_data = rc->pdata,
					.private_data_len = rc->plen,
					.responder_resources = 1,
					.initiator_depth = 1,
					.retry_count = 7,
					.rnr_retry_count = 7};
}

static struct epd_rconn *rconn_new(struct epd_rdma *rd,
				   struct rdma_cm_id *id, void *user)
{
	struct epd_rconn *rc = calloc(1, sizeof(*rc));
	if (!rc)
		return NULL;
	rc->base.t = &rd->base;
	rc->base.user = user;
	rc->rd = rd;
	rc->id = id;
	id->context = rc;
	uv_timer_init(rd->loop, &rc->reaper);
	rc->reaper.data = rc;
	rc->handles = 1;
	rd->nconn++;
	rc->next = rd->conns;
	if (rc->next)
		rc->next->pprev = &rc->next;
	rc->pprev = &rd->conns;
	rd->conns = rc;
	return rc;
}

/* A reject's private data: "EPDX", then the reason, NUL-terminated (the
 * CM carries at most 148 bytes of it for RC). */
#define REJ_MAGIC "EPDX"
#define REJ_MAX 140

static void relisten_arm(struct epd_rdma *rd);

/* librdmacm closes a device's context only after it saw the device
 * leave the device list (and no id uses it): make it look. */
static void sync_devices(void)
{
	int n = 0;
	struct ibv_context **l = rdma_get_devices(&n);
	if (l)
		rdma_free_devices(l);
}

/* A device went away under us: give every object on it back, so that
 * the kernel can finish removing it, and fail what used it. */
static void device_removed(struct epd_rdma *rd, struct rdma_cm_id *id)
{
	struct ibv_context *v = id->verbs;
	if (!v)
		return;
	if (!strstr(rd->removed, ibv_get_device_name(v->device)))
		epd_warn("rdma: device %s removed: its connections and "
			 "registered regions are given back; groups that used "
			 "them fail", ibv_get_device_name(v->device));
	snprintf(rd->removed, sizeof(rd->removed), "RDMA device %s removed",
		 ibv_get_device_name(v->device));
	for (struct epd_rmr *m = rd->mrs; m; m = m->next)
		if (m->mr && m->ctx == v) {
			ibv_dereg_mr(m->mr);
			m->mr = NULL;
			m->base.lkey = m->base.rkey = 0;
		}
	if (rd->pd && rd->pd_ctx == v) {
		int users = 0;
		for (struct epd_rconn *c = rd->conns; c; c = c->next)
			users += c->pd == rd->pd && !c->own_pd;
		if (users) {
			rd->dead_pd = rd->pd;
			rd->dead_users = users;
		} else {
			ibv_dealloc_pd(rd->pd);
		}
		rd->pd = NULL;
		rd->pd_ctx = NULL;
	}
	for (struct epd_rconn *c = rd->conns, *nx; c; c = nx) {
		nx = c->next;
		if (!c->closing && c->id && c->id->verbs == v)
			rconn_fail(c, rd->removed);
	}
	if (rd->listener && (id == rd->listener || rd->listener->verbs == v)) {
		rd->drop_listener = true;
		rd->relisten = true;
	}
}

static void cm_event(struct epd_rdma *rd, struct rdma_cm_event *ev)
{
	struct epd_rconn *rc = ev->id->context;
	char why[160] = "";
	switch (ev->event) {
	case RDMA_CM_EVENT_CONNECT_REQUEST: {
		const struct rdma_conn_param *p = &ev->param.conn;
		struct epd_rconn *n = rconn_new(rd, ev->id, NULL);
		/* a refusal says why to the dialler: REJ_MAGIC, then text */
		char rej[REJ_MAX] = REJ_MAGIC;
		char addr[64];
		peer_name(ev->id, addr, sizeof(addr));
		void *user = n ? rd->cb->accept(rd->arg, &n->base, addr,
						p->private_data,
						p->private_data_len, rej + 4,
						sizeof(rej) - 4)
			       : NULL;
		if (!user) {
			if (!n)
				snprintf(rej + 4, sizeof(rej) - 4,
					 "out of memory");
			rdma_reject(ev->id, rej,
				    (uint8_t)(4 + strnlen(rej + 4,
							  sizeof(rej) - 5) + 1));
			epd_rdma_close(n); /* freed after the event's ack */
			return;
		}
		n->base.user = user;
		struct rdma_conn_param cp = conn_param(n);
		cp.private_data = NULL;
		cp.private_data_len = 0;
		if (setup_qp(n, why, sizeof(why)) || rdma_accept(ev->id, &cp))
			rconn_fail(n, why[0] ? why : "rdma_accept failed");
		return;
	}
	case RDMA_CM_EVENT_ADDR_RESOLVED:
		if (rc && rdma_resolve_route(ev->id, RD_TIMEOUT_MS))
			rconn_fail(rc, "rdma_resolve_route failed");
		return;
	case RDMA_CM_EVENT_ROUTE_RESOLVED:
		if (!rc)
			return;
		if (setup_qp(rc, why, sizeof(why))) {
			rconn_fail(rc, why);
			return;
		}
		struct rdma_conn_param cp = conn_param(rc);
		if (rdma_connect(ev->id, &cp))
			rconn_fail(rc, "rdma_connect failed");
		return;
	case RDMA_CM_EVENT_ESTABLISHED:
		if (!rc || rc->closing)
			return;
		rc->connected = true;
		pump(rc); /* what was answered before the event */
		if (rc->base.user && !rc->closing)
			rd->cb->established(rd->arg, rc->base.user);
		return;
	case RDMA_CM_EVENT_REJECTED: {
		/* the peer's reason, if it is an epd that said one */
		const char *pd = ev->param.conn.private_data;
		uint8_t pl = ev->param.conn.private_data_len;
		if (pd && pl > 5 && !memcmp(pd, REJ_MAGIC, 4) &&
		    memchr(pd + 4, 0, pl - 4))
			snprintf(why, sizeof(why), "rejected by the peer: %s",
				 pd + 4);
		else /* e.g. 8: nothing listens there (yet) */
			snprintf(why, sizeof(why),
				 "connection refused (CM reject status %d)",
				 ev->status);
		if (rc && !rc->closing)
			rconn_fail(rc, why);
		return;
	}
	case RDMA_CM_EVENT_DEVICE_REMOVAL:
		device_removed(rd, ev->id);
		return;
	case RDMA_CM_EVENT_UNREACHABLE:
	case RDMA_CM_EVENT_ADDR_ERROR:
	case RDMA_CM_EVENT_ROUTE_ERROR:
	case RDMA_CM_EVENT_CONNECT_ERROR:
	case RDMA_CM_EVENT_DISCONNECTED:
		/* while a removed device's address has none: say so */
		snprintf(why, sizeof(why), "%s%s%s", rdma_event_str(ev->event),
			 rd->relisten ? " after " : "",
			 rd->relisten ? rd->removed : "");
		if (rc && !rc->closing)
			rconn_fail(rc, why);
		return;
	default:
		return;
	}
}

static void rdma_maybe_free(struct epd_rdma *rd);

static void rconn_free(struct epd_rconn *rc)
{
	struct epd_rdma *rd = rc->rd;
	if (rc->qp)
		rdma_destroy_qp(rc->id);
	if (rc->mr)
		ibv_dereg_mr(rc->mr);
	if (rc->cq)
		ibv_destroy_cq(rc->cq);
	if (rc->cc)
		ibv_destroy_comp_channel(rc->cc);
	if (rc->own_pd)
		ibv_dealloc_pd(rc->pd);
	/* the removed device's shared domain, with its last queue pair
	 * (before the id: the last id may close the device context) */
	if (!rc->own_pd && rc->pd && rc->pd == rd->dead_pd &&
	    --rd->dead_users == 0) {
		ibv_dealloc_pd(rd->dead_pd);
		rd->dead_pd = NULL;
	}
	if (rc->id)
		rdma_destroy_id(rc->id);
	epd_debug("rdma: connection %p freed (%d left, %d regions)",
		  (void *)rc, rd->nconn - 1, rd->nmr);
	*rc->pprev = rc->next;
	if (rc->next)
		rc->next->pprev = rc->pprev;
	free(rc->mem);
	epp_rbuf_free(&rc->sq);
	free(rc);
	rd->nconn--;
	rdma_maybe_free(rd);
}

static void on_cm(uv_poll_t *p, int status, int events)
{
	struct epd_rdma *rd = p->data;
	(void)events;
	if (status < 0)
		return;
	struct rdma_cm_event *ev;
	/* ids are destroyed only in rconn_free, after every event is acked
	 * (libuv runs close callbacks after this one returns) */
	while (rdma_get_cm_event(rd->ch, &ev) == 0) {
		cm_event(rd, ev);
		rdma_ack_cm_event(ev);
		if (rd->drop_listener) {
			rdma_destroy_id(rd->listener);
			rd->listener = NULL;
			rd->drop_listener = false;
			sync_devices();
			relisten_arm(rd);
		}
	}
}

static void rd_post(void *arg, const struct epd_cmd *c, size_t n);
static int relisten(struct epd_rdma *rd);

static void relisten_tick(uv_timer_t *t)
{
	struct epd_rdma *rd = t->data;
	if (relisten(rd) || !rd->relisten || rd->closing)
		uv_timer_stop(t);
}

/* A node that only accepts never dials: it retries on its own. */
static void relisten_arm(struct epd_rdma *rd)
{
	if (!rd->relisten_init) {
		uv_timer_init(rd->loop, &rd->relisten_timer);
		rd->relisten_timer.data = rd;
		rd->relisten_init = true;
	}
	uv_timer_start(&rd->relisten_timer, relisten_tick, 1000, 1000);
}

static struct epd_rdma *epd_rdma_new(uv_loop_t *loop,
			      const struct epd_transport_cb *cb, void *arg,
			      char *err, size_t errlen)
{
	struct epd_rdma *rd = calloc(1, sizeof(*rd));
	if (!rd) {
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	rd->base.ops = &epd_rdma_transport;
	rd->loop = loop;
	rd->cb = cb;
	rd->arg = arg;
	rd->ch = rdma_create_event_channel();
	if (!rd->ch) {
		snprintf(err, errlen, "rdma_create_event_channel: %s",
			 strerror(errno));
		free(rd);
		return NULL;
	}
	rd->proxy = epd_proxy_new(RD_PROXY_SLOTS, rd_post, rd, err, errlen);
	if (!rd->proxy) {
		rdma_destroy_event_channel(rd->ch);
		free(rd);
		return NULL;
	}
	nonblock(rd->ch->fd);
	uv_poll_init(loop, &rd->poll, rd->ch->fd);
	rd->poll.data = rd;
	uv_poll_start(&rd->poll, UV_READABLE, on_cm);
	return rd;
}

static int epd_rdma_listen(struct epd_rdma *rd, const struct sockaddr *sa, char *err,
		    size_t errlen)
{
	size_t sl = sa->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
					      : sizeof(struct sockaddr_in);
	memcpy(&rd->listen_sa, sa, sl);
	if (rdma_create_id(rd->ch, &rd->listener, NULL, RDMA_PS_TCP) ||
	    rdma_bind_addr(rd->listener, (struct sockaddr *)sa) ||
	    rdma_listen(rd->listener, 64)) {
		snprintf(err, errlen, "rdma listen: %s", strerror(errno));
		if (rd->listener)
			rdma_destroy_id(rd->listener);
		rd->listener = NULL;
		return -1;
	}
	return 0;
}

/* After a device removal: listen again once a device has the address
 * (relisten_timer, every second). 1 if listening again. */
static int relisten(struct epd_rdma *rd)
{
	if (!rd->relisten || rd->closing)
		return 0;
	sync_devices(); /* also lets librdmacm close the removed device */
	char err[128];
	if (epd_rdma_listen(rd, (struct sockaddr *)&rd->listen_sa, err,
			    sizeof(err)))
		return 0;
	rd->relisten = false;
	epd_notice("rdma: listening again (a device has the address after %s)",
		   rd->removed);
	return 1;
}

static const char *epd_rdma_removed(const struct epd_rdma *rd)
{
	return rd && rd->removed[0] ? rd->removed : NULL;
}

static struct epd_rconn *epd_rdma_dial(struct epd_rdma *rd, const struct sockaddr *sa,
				const void *pdata, uint8_t plen, void *user)
{
	struct rdma_cm_id *id;
	if (plen > sizeof(((struct epd_rconn *)0)->pdata) ||
	    rdma_create_id(rd->ch, &id, NULL, RDMA_PS_TCP))
		return NULL;
	struct epd_rconn *rc = rconn_new(rd, id, user);
	if (!rc) {
		rdma_destroy_id(id);
		return NULL;
	}
	memcpy(rc->pdata, pdata, plen);
	rc->plen = plen;
	if (rdma_resolve_addr(id, NULL, (struct sockaddr *)sa, RD_TIMEOUT_MS)) {
		epd_rdma_close(rc);
		return NULL;
	}
	return rc;
}

static int epd_rdma_send(struct epd_rconn *rc, const struct iovec *iov, int n)
{
	if (rc->closing || !rc->qp)
		return -1;
	size_t need = 0;
	for (int i = 0; i < n; i++)
		need += iov[i].iov_len;
	/* room for the whole unit first: a stream never gets half of one */
	if (epp_rbuf_room(&rc->sq, need, 65536))
		return -1;
	for (int i = 0; i < n; i++)
		epp_rbuf_put(&rc->sq, iov[i].iov_base, iov[i].iov_len);
	pump(rc);
	return rc->closing ? -1 : 0;
}

/* Free once nobody holds it and the proxy has taken every write queued
 * so far (it skips a closing connection's); else linger. */
static void linger_tick(uv_timer_t *t)
{
	struct epd_rdma *rd = t->data;
	struct epd_rconn **pp = &rd->linger;
	while (*pp) {
		struct epd_rconn *rc = *pp;
		if (epd_proxy_passed(rd->proxy, rc->linger_ticket)) {
			*pp = rc->linger_next;
			rconn_free(rc);
		} else {
			pp = &rc->linger_next;
		}
	}
	if (!rd->linger)
		uv_timer_stop(t);
}

static void rconn_release(struct epd_rconn *rc)
{
	struct epd_rdma *rd = rc->rd;
	if (rc->handles > 0 || rc->refs > 0)
		return;
	rc->linger_ticket = rd->proxy ? epd_proxy_head(rd->proxy) : 0;
	if (!rd->proxy || epd_proxy_passed(rd->proxy, rc->linger_ticket)) {
		rconn_free(rc);
		return;
	}
	rc->linger_next = rd->linger;
	rd->linger = rc;
	if (!rd->linger_init) {
		uv_timer_init(rd->loop, &rd->linger_timer);
		rd->linger_timer.data = rd;
		rd->linger_init = true;
	}
	if (!uv_is_active((uv_handle_t *)&rd->linger_timer))
		uv_timer_start(&rd->linger_timer, linger_tick, 1, 1);
}

static void handle_closed(uv_handle_t *h)
{
	struct epd_rconn *rc = h->data;
	rc->handles--;
	rconn_release(rc);
}

static void epd_rdma_hold(struct epd_rconn *rc)
{
	rc->refs++;
}

static void epd_rdma_release(struct epd_rconn *rc)
{
	if (--rc->refs == 0)
		rconn_release(rc);
}

static bool epd_rdma_can_write(const struct epd_rconn *rc)
{
	return rc && rc->connected && !rc->closing && !rc->own_pd &&
	       rc->pd && rc->rd->proxy;
}

static struct epd_rmr *epd_rdma_reg(struct epd_rdma *rd, void *p, size_t len,
			     bool remote_write, char *why, size_t wl)
{
	if (!rd->pd) {
		snprintf(why, wl, "no RDMA connection yet");
		return NULL;
	}
	struct epd_rmr *m = calloc(1, sizeof(*m));
	if (!m) {
		snprintf(why, wl, "out of memory");
		return NULL;
	}
	m->rd = rd;
	m->ctx = rd->pd_ctx;
	m->mr = ibv_reg_mr(rd->pd, p, len,
			   remote_write ? IBV_ACCESS_LOCAL_WRITE |
						  IBV_ACCESS_REMOTE_WRITE
					: 0);
	if (!m->mr) {
		snprintf(why, wl, "ibv_reg_mr of %zu bytes: %s", len,
			 strerror(errno));
		free(m);
		return NULL;
	}
	m->base.lkey = m->mr->lkey;
	m->base.rkey = m->mr->rkey;
	rd->nmr++;
	m->next = rd->mrs;
	if (m->next)
		m->next->pprev = &m->next;
	m->pprev = &rd->mrs;
	rd->mrs = m;
	return m;
}

static void epd_rdma_dereg(struct epd_rmr *m)
{
	if (!m)
		return;
	struct epd_rdma *rd = m->rd;
	if (m->mr)
		ibv_dereg_mr(m->mr);
	*m->pprev = m->next;
	if (m->next)
		m->next->pprev = m->pprev;
	rd->nmr--;
	free(m);
	rdma_maybe_free(rd); /* the last region of a transport that closed */
}

/* 0 once the device is gone (writes with it fail, on a connection that
 * is failing anyway) */
static uint64_t epd_rdma_write(struct epd_rdma *rd, struct epd_cmd *c)
{
	return rd->proxy ? epd_proxy_push(rd->proxy, c) : 0;
}

static uint64_t epd_rdma_stats(const struct epd_rdma *rd, uint64_t *batches)
{
	*batches = 0;
	return rd->proxy ? epd_proxy_posted(rd->proxy, batches) : 0;
}

/* The proxy's poster (its thread): a chain of work requests per run of
 * commands for one connection, within its budget of outstanding writes.
 * A connection that is closing gets nothing (its writes are lost with
 * it; its groups fail on the loop). */
static void rd_post(void *arg, const struct epd_cmd *c, size_t n)
{
	(void)arg;
	struct ibv_send_wr wr[RD_SIGNAL];
	struct ibv_sge sge[RD_SIGNAL];
	size_t i = 0;
	while (i < n) {
		struct epd_rconn *rc = c[i].conn;
		size_t j = i;
		while (j < n && j - i < RD_SIGNAL && c[j].conn == rc)
			j++;
		const int k = (int)(j - i);
		bool dead = false;
		while (!(dead = __atomic_load_n(&rc->closing,
						__ATOMIC_ACQUIRE)) &&
		       __atomic_load_n(&rc->wr_out, __ATOMIC_ACQUIRE) + k >
			       RD_WRITES)
			sched_yield(); /* the loop reaps completions */
		if (dead) {
			i = j;
			continue;
		}
		for (int m = 0; m < k; m++) {
			const struct epd_cmd *x = &c[i + (size_t)m];
			const bool imm = x->flags & EPD_CMD_IMM;
			sge[m] = (struct ibv_sge){.addr = x->laddr,
						  .length = x->len,
						  .lkey = x->lkey};
			wr[m] = (struct ibv_send_wr){
				.next = m + 1 < k ? &wr[m + 1] : NULL,
				.sg_list = &sge[m],
				.num_sge = x->len ? 1 : 0,
				.opcode = imm ? IBV_WR_RDMA_WRITE_WITH_IMM
					      : IBV_WR_RDMA_WRITE,
				.imm_data = htonl(x->imm),
				.wr.rdma = {.remote_addr = x->raddr,
					    .rkey = x->rkey}};
			if (++rc->unsignaled == RD_SIGNAL || imm) {
				wr[m].send_flags = IBV_SEND_SIGNALED;
				wr[m].wr_id = WR_WRITE | (imm ? WR_IMM : 0) |
					      ((uint64_t)rc->unsignaled
					       << WR_COUNT_SHIFT) |
					      (x->cookie & WR_COOKIE_MASK);
				rc->unsignaled = 0;
			}
		}
		__atomic_fetch_add(&rc->wr_out, k, __ATOMIC_RELEASE);
		struct ibv_send_wr *bad = NULL;
		if (ibv_post_send(rc->id->qp, wr, &bad)) {
			/* the queue pair is broken: the loop sees its
			 * completion errors and fails the connection */
			int left = 0;
			for (struct ibv_send_wr *w = bad; w; w = w->next)
				left++;
			__atomic_fetch_sub(&rc->wr_out, left, __ATOMIC_RELEASE);
		}
		i = j;
	}
}

static void epd_rdma_close(struct epd_rconn *rc)
{
	if (!rc || rc->closing)
		return;
	__atomic_store_n(&rc->closing, true, __ATOMIC_RELEASE); /* proxy */
	rc->base.user = NULL;
	if (rc->connected)
		rdma_disconnect(rc->id);
	rc->id->context = NULL; /* later events find no connection */
	if (rc->polling) {
		uv_poll_stop(&rc->cq_poll);
		uv_close((uv_handle_t *)&rc->cq_poll, handle_closed);
	}
	uv_close((uv_handle_t *)&rc->reaper, handle_closed);
}

static void relisten_closed(uv_handle_t *h)
{
	struct epd_rdma *rd = h->data;
	rd->relisten_init = false;
	rdma_maybe_free(rd);
}

static void linger_closed(uv_handle_t *h)
{
	struct epd_rdma *rd = h->data;
	rd->linger_init = false;
	rdma_maybe_free(rd);
}

/* The channel goes last: after every id made on it. */
/* The transport is freed once it was closed and nothing refers to it any
 * more: connections, and regions (a freed group's windows stay
 * registered a grace period and may be released after the transport
 * closed: epd_rdma_dereg then frees it). */
static void rdma_maybe_free(struct epd_rdma *rd)
{
	if (!rd->closing || !rd->poll_closed || rd->nconn > 0 || rd->nmr > 0)
		return;
	if (rd->relisten_init) {
		if (!uv_is_closing((uv_handle_t *)&rd->relisten_timer))
			uv_close((uv_handle_t *)&rd->relisten_timer,
				 relisten_closed);
		return;
	}
	if (rd->linger_init) {
		if (!uv_is_closing((uv_handle_t *)&rd->linger_timer))
			uv_close((uv_handle_t *)&rd->linger_timer,
				 linger_closed);
		return;
	}
	epd_proxy_free(rd->proxy);
	if (rd->listener)
		rdma_destroy_id(rd->listener);
	rdma_destroy_event_channel(rd->ch);
	if (rd->pd)
		ibv_dealloc_pd(rd->pd);
	if (rd->dead_pd) /* not reached: freed with its last queue pair */
		ibv_dealloc_pd(rd->dead_pd);
	free(rd);
}

static void cm_poll_closed(uv_handle_t *h)
{
	struct epd_rdma *rd = h->data;
	rd->poll_closed = true;
	rdma_maybe_free(rd);
}

static void epd_rdma_free(struct epd_rdma *rd)
{
	if (!rd || rd->closing)
		return;
	rd->closing = true;
	uv_poll_stop(&rd->poll);
	uv_close((uv_handle_t *)&rd->poll, cm_poll_closed);
}

/* The transport interface: the public parts are the first members. */
static struct epd_transport *tr_open(uv_loop_t *loop,
				     const struct epd_transport_cb *cb,
				     void *arg, char *err, size_t errlen)
{
	struct epd_rdma *rd = epd_rdma_new(loop, cb, arg, err, errlen);
	return rd ? &rd->base : NULL;
}

static int tr_listen(struct epd_transport *t, const struct sockaddr *sa,
		     char *err, size_t errlen)
{
	return epd_rdma_listen((struct epd_rdma *)t, sa, err, errlen);
}

static struct epd_tconn *tr_dial(struct epd_transport *t,
				 const struct sockaddr *sa, const void *pdata,
				 uint8_t plen, void *user)
{
	struct epd_rconn *rc =
		epd_rdma_dial((struct epd_rdma *)t, sa, pdata, plen, user);
	return rc ? &rc->base : NULL;
}

/* Everything is copied into the send slots: done runs at once. */
static int tr_send(struct epd_tconn *tc, const struct iovec *iov, int n,
		   int keep, void (*done)(void *), void *done_arg)
{
	(void)keep;
	if (epd_rdma_send((struct epd_rconn *)tc, iov, n))
		return -1;
	if (done)
		done(done_arg);
	return 0;
}

static void tr_close(struct epd_tconn *tc)
{
	epd_rdma_close((struct epd_rconn *)tc);
}

static void tr_free(struct epd_transport *t)
{
	epd_rdma_free((struct epd_rdma *)t);
}

static const char *tr_down_why(const struct epd_transport *t)
{
	return epd_rdma_removed((const struct epd_rdma *)t);
}

static bool tr_can_write(const struct epd_tconn *tc)
{
	return epd_rdma_can_write((const struct epd_rconn *)tc);
}

static struct epd_tmr *tr_reg(struct epd_transport *t, void *p, size_t len,
			      bool remote_write, char *why, size_t wl)
{
	struct epd_rmr *m = epd_rdma_reg((struct epd_rdma *)t, p, len,
					 remote_write, why, wl);
	return m ? &m->base : NULL;
}

static void tr_dereg(struct epd_tmr *m)
{
	epd_rdma_dereg((struct epd_rmr *)m);
}

static void tr_hold(struct epd_tconn *tc)
{
	epd_rdma_hold((struct epd_rconn *)tc);
}

static void tr_release(struct epd_tconn *tc)
{
	epd_rdma_release((struct epd_rconn *)tc);
}

static uint64_t tr_write(struct epd_transport *t, struct epd_cmd *c)
{
	return epd_rdma_write((struct epd_rdma *)t, c);
}

static uint64_t tr_stats(const struct epd_transport *t, uint64_t *batches)
{
	return epd_rdma_stats((const struct epd_rdma *)t, batches);
}

const struct epd_transport_ops epd_rdma_transport = {
	.name = "rdma",
	.no_loopback = true,
	.pdata = true,
	.available = epd_rdma_available,
	.open = tr_open,
	.listen = tr_listen,
	.dial = tr_dial,
	.send = tr_send,
	.close = tr_close,
	.free = tr_free,
	.down_why = tr_down_why,
	.can_write = tr_can_write,
	.reg = tr_reg,
	.dereg = tr_dereg,
	.hold = tr_hold,
	.release = tr_release,
	.write = tr_write,
	.stats = tr_stats,
};
