/* SPDX-License-Identifier: MIT */
/*
 * The tcp transport (transport.h): one libuv tcp stream per pair of nodes.
 * Received bytes are read straight into the buffer the cluster offers
 * (rx_buf), and a piece sent with a done callback is written from where
 * it is (a pack of rows is not copied again). No one-sided writes: rows
 * travel as frames on the stream.
 */
#include "transport/transport.h"

#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_PIECES 4
/* Connections accepted in one turn of the loop. libuv accepts until the
 * backlog is empty, and under a flood of connections to the cluster port
 * it never was: the loop stalled for seconds and the node's ranks waited.
 * Past the burst the listener rests until the next turn. */
#define ACCEPT_BURST 16

extern const struct epd_transport_ops epd_tcp_transport;

struct tcp_transport {
	struct epd_transport base;
	uv_loop_t *loop;
	const struct epd_transport_cb *cb;
	void *arg;
	uv_tcp_t listener;
	bool listening;
	uv_check_t turn;   /* once a loop turn: the accept budget again */
	uv_idle_t resume;  /* accepting again after a full burst */
	unsigned accepts;  /* in this turn */
	int open_handles;  /* listener, turn, resume: freed after the last */
};

struct tcp_conn {
	struct epd_tconn base;
	uv_tcp_t tcp;
	uv_connect_t creq;
	bool closing; /* closed by the cluster or gone: no more callbacks */
};

struct wreq {
	uv_write_t req;
	void (*done)(void *);
	void *done_arg;
	uint8_t data[]; /* the copied pieces */
};

static struct tcp_transport *tt(struct epd_transport *t)
{
	return (struct tcp_transport *)t;
}

static bool tcp_available(char *why, size_t len)
{
	snprintf(why, len, "tcp is always there");
	return true;
}

static void conn_freed(uv_handle_t *h)
{
	free(h->data);
}

/* Gone by itself (read error, EOF, failed connect or write): tell the
 * cluster once, then free. */
static void conn_lost(struct tcp_conn *c, const char *why)
{
	if (c->closing)
		return;
	c->closing = true;
	struct tcp_transport *t = tt(c->base.t);
	uv_close((uv_handle_t *)&c->tcp, conn_freed);
	t->cb->closed(t->arg, c->base.user, why);
}

static void on_alloc(uv_handle_t *h, size_t want, uv_buf_t *b)
{
	struct tcp_conn *c = h->data;
	struct tcp_transport *t = tt(c->base.t);
	size_t room = 0;
	uint8_t *p = c->closing ? NULL
				: t->cb->rx_buf(t->arg, c->base.user,
						want < 4096 ? want : 4096, &room);
	*b = uv_buf_init((char *)p, p ? (unsigned)room : 0);
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b)
{
	struct tcp_conn *c = s->data;
	struct tcp_transport *t = tt(c->base.t);
	(void)b;
	if (c->closing || n == 0)
		return;
	if (n < 0) {
		conn_lost(c, n == UV_EOF      ? "connection closed"
			     : n == UV_ENOBUFS ? "out of memory"
					       : uv_strerror((int)n));
		return;
	}
	t->cb->rx(t->arg, c->base.user, (size_t)n);
}

static struct tcp_conn *conn_new(struct tcp_transport *t, void *user)
{
	struct tcp_conn *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->base.t = &t->base;
	c->base.user = user;
	uv_tcp_init(t->loop, &c->tcp);
	c->tcp.data = c;
	uv_tcp_nodelay(&c->tcp, 1);
	return c;
}

static void accept_one(struct tcp_transport *t);

static void on_turn(uv_check_t *h)
{
	struct tcp_transport *t = h->data;
	t->accepts = 0;
}

static void on_resume(uv_idle_t *h)
{
	struct tcp_transport *t = h->data;
	uv_idle_stop(h);
	t->accepts = 1;
	accept_one(t); /* the one left waiting; uv_accept listens again */
}

static void on_accept(uv_stream_t *ls, int status)
{
	struct tcp_transport *t = ls->data;
	if (status < 0)
		return;
	if (t->accepts >= ACCEPT_BURST) {
		/* not taken: libuv stops watching the listener until the
		 * next turn takes it (on_resume) */
		uv_idle_start(&t->resume, on_resume);
		return;
	}
	t->accepts++;
	accept_one(t);
}

static void accept_one(struct tcp_transport *t)
{
	uv_stream_t *ls = (uv_stream_t *)&t->listener;
	struct tcp_conn *c = conn_new(t, NULL);
	if (!c) { /* out of memory: the connection waits for a turn */
		uv_idle_start(&t->resume, on_resume);
		return;
	}
	if (uv_accept(ls, (uv_stream_t *)&c->tcp)) {
		c->closing = true;
		uv_close((uv_handle_t *)&c->tcp, conn_freed);
		return;
	}
	char addr[64] = "?";
	struct sockaddr_storage sa;
	int len = sizeof(sa);
	if (!uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&sa, &len)) {
		char ip[48];
		uv_ip_name((struct sockaddr *)&sa, ip, sizeof(ip));
		snprintf(addr, sizeof(addr), "%s:%d", ip,
			 ntohs(((struct sockaddr_in *)&sa)->sin_port));
	}
	char why[128];
	c->base.user = t->cb->accept(t->arg, &c->base, addr, NULL, 0, why,
				     sizeof(why));
	if (!c->base.user) {
		c->closing = true;
		uv_close((uv_handle_t *)&c->tcp, conn_freed);
		return;
	}
	uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
	t->cb->established(t->arg, c->base.user);
}

static struct epd_transport *tcp_open(uv_loop_t *loop,
				      const struct epd_transport_cb *cb,
				      void *arg, char *err, size_t errlen)
{
	struct tcp_transport *t = calloc(1, sizeof(*t));
	if (!t) {
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	t->base.ops = &epd_tcp_transport;
	t->loop = loop;
	t->cb = cb;
	t->arg = arg;
	uv_tcp_init(loop, &t->listener);
	t->listener.data = t;
	uv_check_init(loop, &t->turn);
	t->turn.data = t;
	uv_unref((uv_handle_t *)&t->turn);
	uv_idle_init(loop, &t->resume);
	t->resume.data = t;
	t->open_handles = 3;
	return &t->base;
}

static int tcp_listen(struct epd_transport *tp, const struct sockaddr *sa,
		      char *err, size_t errlen)
{
	struct tcp_transport *t = tt(tp);
	int rc = uv_tcp_bind(&t->listener, sa, 0);
	if (!rc)
		rc = uv_listen((uv_stream_t *)&t->listener, 64, on_accept);
	if (rc) {
		snprintf(err, errlen, "%s", uv_strerror(rc));
		return -1;
	}
	t->listening = true;
	uv_check_start(&t->turn, on_turn);
	return 0;
}

static void on_connect(uv_connect_t *req, int status)
{
	struct tcp_conn *c = req->data;
	struct tcp_transport *t = tt(c->base.t);
	if (c->closing)
		return;
	if (status < 0) {
		conn_lost(c, uv_strerror(status));
		return;
	}
	uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
	t->cb->established(t->arg, c->base.user);
}

static struct epd_tconn *tcp_dial(struct epd_transport *tp,
				  const struct sockaddr *sa, const void *pdata,
				  uint8_t plen, void *user)
{
	struct tcp_transport *t = tt(tp);
	(void)pdata;
	(void)plen;
	struct tcp_conn *c = conn_new(t, user);
	if (!c)
		return NULL;
	c->creq.data = c;
	if (uv_tcp_connect(&c->creq, &c->tcp, sa, on_connect)) {
		c->closing = true;
		uv_close((uv_handle_t *)&c->tcp, conn_freed);
		return NULL;
	}
	return &c->base;
}

static void write_done(uv_write_t *req, int status)
{
	struct wreq *w = (struct wreq *)req;
	(void)status; /* a failed write shows as a read error too */
	if (w->done)
		w->done(w->done_arg);
	free(w);
}

static int tcp_send(struct epd_tconn *tc, const struct iovec *iov, int n,
		    int keep, void (*done)(void *), void *done_arg)
{
	struct tcp_conn *c = (struct tcp_conn *)tc;
	if (c->closing || n > MAX_PIECES)
		return -1;
	if (!done)
		keep = -1;
	size_t copied = 0;
	for (int i = 0; i < n; i++)
		if (i != keep)
			copied += iov[i].iov_len;
	struct wreq *w = malloc(sizeof(*w) + copied);
	if (!w)
		return -1;
	uv_buf_t b[MAX_PIECES];
	unsigned nb = 0;
	size_t off = 0;
	for (int i = 0; i < n; i++) {
		if (!iov[i].iov_len)
			continue;
		char *p = iov[i].iov_base;
		if (i != keep) {
			p = memcpy(w->data + off, iov[i].iov_base,
				   iov[i].iov_len);
			off += iov[i].iov_len;
		}
		b[nb++] = uv_buf_init(p, (unsigned)iov[i].iov_len);
	}
	w->done = keep >= 0 ? done : NULL;
	w->done_arg = done_arg;
	if (uv_write(&w->req, (uv_stream_t *)&c->tcp, b, nb, write_done)) {
		free(w);
		return -1;
	}
	return 0;
}

static void tcp_close(struct epd_tconn *tc)
{
	struct tcp_conn *c = (struct tcp_conn *)tc;
	if (c->closing)
		return;
	c->closing = true;
	/* queued writes end with UV_ECANCELED: their done callbacks run */
	uv_close((uv_handle_t *)&c->tcp, conn_freed);
}

static void listener_closed(uv_handle_t *h)
{
	struct tcp_transport *t = h->data;
	if (--t->open_handles == 0)
		free(t);
}

static void tcp_free(struct epd_transport *tp)
{
	if (!tp)
		return;
	struct tcp_transport *t = tt(tp);
	/* connections are the cluster's to close (it did, before) */
	uv_close((uv_handle_t *)&t->listener, listener_closed);
	uv_close((uv_handle_t *)&t->turn, listener_closed);
	uv_close((uv_handle_t *)&t->resume, listener_closed);
}

static const char *tcp_down_why(const struct epd_transport *t)
{
	(void)t;
	return NULL;
}

const struct epd_transport_ops epd_tcp_transport = {
	.name = "tcp",
	.available = tcp_available,
	.open = tcp_open,
	.listen = tcp_listen,
	.dial = tcp_dial,
	.send = tcp_send,
	.close = tcp_close,
	.free = tcp_free,
	.down_why = tcp_down_why,
};
