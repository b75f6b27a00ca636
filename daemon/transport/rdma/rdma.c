/* SPDX-License-Identifier: MIT */
/*
 * The rdma transport (rdma_int.h): connection management. The CM event
 * channel on the loop, listening and dialling with private data, device
 * removal, freeing, and the transport table (transport.h).
 */
#include "rdma_int.h"

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
		if (rd_post_recv(rc, i)) {
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
	uv_poll_start(&rc->cq_poll, UV_READABLE, rd_on_cq);
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
		rd_pump(rc); /* what was answered before the event */
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

void rconn_free(struct epd_rconn *rc)
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
	rd_rdma_maybe_free(rd);
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

void epd_rdma_close(struct epd_rconn *rc)
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
		uv_close((uv_handle_t *)&rc->cq_poll, rd_handle_closed);
	}
	uv_close((uv_handle_t *)&rc->reaper, rd_handle_closed);
}

static void relisten_closed(uv_handle_t *h)
{
	struct epd_rdma *rd = h->data;
	rd->relisten_init = false;
	rd_rdma_maybe_free(rd);
}

static void linger_closed(uv_handle_t *h)
{
	struct epd_rdma *rd = h->data;
	rd->linger_init = false;
	rd_rdma_maybe_free(rd);
}

/* The channel goes last: after every id made on it. */
/* The transport is freed once it was closed and nothing refers to it any
 * more: connections, and regions (a freed group's windows stay
 * registered a grace period and may be released after the transport
 * closed: epd_rdma_dereg then frees it). */
void rd_rdma_maybe_free(struct epd_rdma *rd)
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
	rd_rdma_maybe_free(rd);
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
