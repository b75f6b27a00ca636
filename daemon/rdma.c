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
 * Compiled whenever libibverbs and librdmacm are found; run only where an
 * RDMA device exists (the development and CI machines have none: see
 * README).
 */
#include "epd.h"

#ifdef HAVE_EPD_RDMA

#include "rdma.h"

#include <errno.h>
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

struct epd_rdma {
	uv_loop_t *loop;
	const struct epd_rdma_ops *ops;
	void *arg;
	struct rdma_event_channel *ch;
	struct rdma_cm_id *listener;
	uv_poll_t poll;
	int nconn; /* connections not yet freed (their ids use ch) */
	bool closing, poll_closed;
};

struct epd_rconn {
	struct epd_rdma *rd;
	struct rdma_cm_id *id;
	void *user; /* NULL once closed: no more callbacks */
	struct ibv_pd *pd;
	struct ibv_comp_channel *cc;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	uint8_t *mem; /* [RD_RECVS + RD_SENDS][RD_CHUNK] */
	uv_poll_t cq_poll;
	uv_timer_t reaper; /* closed last: frees the connection */
	int handles;       /* open libuv handles */
	bool polling, qp, connected, closing;
	uint8_t pdata[64];
	uint8_t plen;
	/* send slots not in flight, and bytes not yet posted */
	uint32_t free_slot[RD_SENDS];
	int nfree;
	uint8_t *pend;
	size_t plen_bytes, pcap, poff;
};

bool epd_rdma_available(char *why, size_t len)
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

static void rconn_fail(struct epd_rconn *rc, const char *why)
{
	void *u = rc->user;
	rc->user = NULL;
	if (u)
		rc->rd->ops->closed(rc->rd->arg, u, why);
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
	while (rc->nfree > 0 && rc->poff < rc->plen_bytes) {
		uint32_t s = rc->free_slot[--rc->nfree];
		size_t n = rc->plen_bytes - rc->poff;
		if (n > RD_CHUNK)
			n = RD_CHUNK;
		uint8_t *buf = rc->mem + (size_t)(RD_RECVS + s) * RD_CHUNK;
		memcpy(buf, rc->pend + rc->poff, n);
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
		rc->poff += n;
	}
	if (rc->poff == rc->plen_bytes)
		rc->poff = rc->plen_bytes = 0;
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
			if (wc[i].opcode & IBV_WC_RECV) {
				if (rc->user)
					rc->rd->ops->bytes(
						rc->rd->arg, rc->user,
						rc->mem + (size_t)slot * RD_CHUNK,
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
	rc->pd = ibv_alloc_pd(v);
	rc->cc = rc->pd ? ibv_create_comp_channel(v) : NULL;
	rc->cq = rc->cc ? ibv_create_cq(v, RD_RECVS + RD_SENDS, rc, rc->cc, 0)
			: NULL;
	if (!rc->cq || ibv_req_notify_cq(rc->cq, 0)) {
		snprintf(why, len, "verbs setup: %s", strerror(errno));
		return -1;
	}
	struct ibv_qp_init_attr qa = {
		.send_cq = rc->cq,
		.recv_cq = rc->cq,
		.qp_type = IBV_QPT_RC,
		.cap = {.max_send_wr = RD_SENDS,
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
	rc->rd = rd;
	rc->id = id;
	rc->user = user;
	id->context = rc;
	uv_timer_init(rd->loop, &rc->reaper);
	rc->reaper.data = rc;
	rc->handles = 1;
	rd->nconn++;
	return rc;
}

static void cm_event(struct epd_rdma *rd, struct rdma_cm_event *ev)
{
	struct epd_rconn *rc = ev->id->context;
	char why[160] = "";
	switch (ev->event) {
	case RDMA_CM_EVENT_CONNECT_REQUEST: {
		const struct rdma_conn_param *p = &ev->param.conn;
		struct epd_rconn *n = rconn_new(rd, ev->id, NULL);
		void *user = n ? rd->ops->request(rd->arg, n, p->private_data,
						  p->private_data_len)
			       : NULL;
		if (!user) {
			rdma_reject(ev->id, NULL, 0);
			epd_rdma_close(n); /* freed after the event's ack */
			return;
		}
		n->user = user;
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
		if (rc->user)
			rd->ops->established(rd->arg, rc->user);
		return;
	case RDMA_CM_EVENT_REJECTED:
	case RDMA_CM_EVENT_UNREACHABLE:
	case RDMA_CM_EVENT_ADDR_ERROR:
	case RDMA_CM_EVENT_ROUTE_ERROR:
	case RDMA_CM_EVENT_CONNECT_ERROR:
	case RDMA_CM_EVENT_DISCONNECTED:
	case RDMA_CM_EVENT_DEVICE_REMOVAL:
		if (rc && !rc->closing)
			rconn_fail(rc, rdma_event_str(ev->event));
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
	if (rc->pd)
		ibv_dealloc_pd(rc->pd);
	if (rc->id)
		rdma_destroy_id(rc->id);
	free(rc->mem);
	free(rc->pend);
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
	}
}

struct epd_rdma *epd_rdma_new(uv_loop_t *loop, const struct epd_rdma_ops *ops,
			      void *arg, char *err, size_t errlen)
{
	struct epd_rdma *rd = calloc(1, sizeof(*rd));
	if (!rd) {
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	rd->loop = loop;
	rd->ops = ops;
	rd->arg = arg;
	rd->ch = rdma_create_event_channel();
	if (!rd->ch) {
		snprintf(err, errlen, "rdma_create_event_channel: %s",
			 strerror(errno));
		free(rd);
		return NULL;
	}
	nonblock(rd->ch->fd);
	uv_poll_init(loop, &rd->poll, rd->ch->fd);
	rd->poll.data = rd;
	uv_poll_start(&rd->poll, UV_READABLE, on_cm);
	return rd;
}

int epd_rdma_listen(struct epd_rdma *rd, const struct sockaddr *sa, char *err,
		    size_t errlen)
{
	if (rdma_create_id(rd->ch, &rd->listener, NULL, RDMA_PS_TCP) ||
	    rdma_bind_addr(rd->listener, (struct sockaddr *)sa) ||
	    rdma_listen(rd->listener, 64)) {
		snprintf(err, errlen, "rdma listen: %s", strerror(errno));
		return -1;
	}
	return 0;
}

struct epd_rconn *epd_rdma_dial(struct epd_rdma *rd, const struct sockaddr *sa,
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

int epd_rdma_send(struct epd_rconn *rc, const struct iovec *iov, int n)
{
	if (rc->closing || !rc->connected)
		return -1;
	if (rc->poff) { /* drop what is posted already */
		memmove(rc->pend, rc->pend + rc->poff, rc->plen_bytes - rc->poff);
		rc->plen_bytes -= rc->poff;
		rc->poff = 0;
	}
	size_t need = rc->plen_bytes;
	for (int i = 0; i < n; i++)
		need += iov[i].iov_len;
	if (need > rc->pcap) {
		size_t cap = rc->pcap ? rc->pcap : 65536;
		while (cap < need)
			cap *= 2;
		uint8_t *p = realloc(rc->pend, cap);
		if (!p)
			return -1;
		rc->pend = p;
		rc->pcap = cap;
	}
	for (int i = 0; i < n; i++) {
		if (iov[i].iov_len)
			memcpy(rc->pend + rc->plen_bytes, iov[i].iov_base,
			       iov[i].iov_len);
		rc->plen_bytes += iov[i].iov_len;
	}
	pump(rc);
	return rc->closing ? -1 : 0;
}

static void handle_closed(uv_handle_t *h)
{
	struct epd_rconn *rc = h->data;
	if (--rc->handles == 0)
		rconn_free(rc);
}

void epd_rdma_close(struct epd_rconn *rc)
{
	if (!rc || rc->closing)
		return;
	rc->closing = true;
	rc->user = NULL;
	if (rc->connected)
		rdma_disconnect(rc->id);
	rc->id->context = NULL; /* later events find no connection */
	if (rc->polling) {
		uv_poll_stop(&rc->cq_poll);
		uv_close((uv_handle_t *)&rc->cq_poll, handle_closed);
	}
	uv_close((uv_handle_t *)&rc->reaper, handle_closed);
}

/* The channel goes last: after every id made on it. */
static void rdma_maybe_free(struct epd_rdma *rd)
{
	if (!rd->closing || !rd->poll_closed || rd->nconn > 0)
		return;
	if (rd->listener)
		rdma_destroy_id(rd->listener);
	rdma_destroy_event_channel(rd->ch);
	free(rd);
}

static void cm_poll_closed(uv_handle_t *h)
{
	struct epd_rdma *rd = h->data;
	rd->poll_closed = true;
	rdma_maybe_free(rd);
}

void epd_rdma_free(struct epd_rdma *rd)
{
	if (!rd || rd->closing)
		return;
	rd->closing = true;
	uv_poll_stop(&rd->poll);
	uv_close((uv_handle_t *)&rd->poll, cm_poll_closed);
}

#else /* no libibverbs/librdmacm */

#include "rdma.h"

#include <stdio.h>

bool epd_rdma_available(char *why, size_t len)
{
	snprintf(why, len, "epd was built without libibverbs/librdmacm");
	return false;
}

/* Never called: the cluster uses rdma only where it is available. */
struct epd_rdma *epd_rdma_new(uv_loop_t *loop, const struct epd_rdma_ops *ops,
			      void *arg, char *err, size_t errlen)
{
	(void)loop, (void)ops, (void)arg;
	snprintf(err, errlen, "epd was built without libibverbs/librdmacm");
	return NULL;
}
int epd_rdma_listen(struct epd_rdma *rd, const struct sockaddr *sa, char *err,
		    size_t errlen)
{
	(void)rd, (void)sa;
	snprintf(err, errlen, "epd was built without libibverbs/librdmacm");
	return -1;
}
struct epd_rconn *epd_rdma_dial(struct epd_rdma *rd, const struct sockaddr *sa,
				const void *pdata, uint8_t plen, void *user)
{
	(void)rd, (void)sa, (void)pdata, (void)plen, (void)user;
	return NULL;
}
int epd_rdma_send(struct epd_rconn *rc, const struct iovec *iov, int n)
{
	(void)rc, (void)iov, (void)n;
	return -1;
}
void epd_rdma_close(struct epd_rconn *rc) { (void)rc; }
void epd_rdma_free(struct epd_rdma *rd) { (void)rd; }

#endif
