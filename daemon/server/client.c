/* SPDX-License-Identifier: MIT */
/*
 * Client connections: framed reads with strict validation, a queue of
 * outgoing frames (with descriptors), and the request dispatch table.
 */
#include "server.h"
#include "util/stall.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* A client that reads nothing is dropped once this much waits for it:
 * libep reads every reply it asks for, so its queue holds one reply (at
 * most a frame) and the odd notice. 16 MiB each, times 256 connections of
 * one uid, let one user hold 4 GiB of the daemon's memory. */
#define OUTQ_MAX (EPP_HDR_SIZE + EPP_MAX_PAYLOAD + (1u << 20))
/* Past max_queued_bytes for all clients together, a client that had more
 * than this waiting when another reply came is dropped too (so never one
 * that reads, whose queue is empty when it asks). */
#define OUTQ_SMALL (64u << 10)
/* Descriptors waiting in one client's queue: libep waits for every reply
 * that carries one, so more than a few means a client that asks (joins and
 * leaves, maps) without reading; left alone it held every descriptor of
 * the daemon, and no other client could connect or make a group. */
#define OUTQ_FDS_MAX 32u
#define RBUF_MIN 4096
#define RBUF_KEEP (64u << 10) /* more than this is shrunk after a frame */

static void client_io(uv_poll_t *h, int status, int events);

static void client_update_poll(struct epd_client *c)
{
	if (c->closing || c->doomed)
		return;
	int ev = UV_READABLE | UV_DISCONNECT;
	if (!LIST_EMPTY(&c->outq))
		ev |= UV_WRITABLE;
	uv_poll_start(&c->poll, ev, client_io);
}

static void out_free(struct epd_out *o)
{
	for (unsigned i = 0; i < o->nfds; i++)
		close(o->fds[i]);
	free(o);
}

/* Write what the socket takes now. Returns 0, or -1 if the peer is gone. */
static int client_flush(struct epd_client *c)
{
	while (!LIST_EMPTY(&c->outq)) {
		struct epd_out *o = LIST_ENTRY(c->outq.next, struct epd_out,
					       node);
		long n = epp_sendmsg(c->fd, o->data + o->off, o->len - o->off,
				     o->off == 0 ? o->fds : NULL,
				     o->off == 0 ? o->nfds : 0);
		if (n == -EAGAIN)
			break;
		if (n < 0) {
			epd_debug("client %lu: send failed: %s",
				  (unsigned long)c->s.id, strerror((int)-n));
			return -1;
		}
		if (o->off == 0) {
			/* the descriptors went with the first byte */
			for (unsigned i = 0; i < o->nfds; i++)
				close(o->fds[i]);
			c->outq_fds -= o->nfds;
			o->nfds = 0;
		}
		o->off += (size_t)n;
		if (o->off == o->len) {
			c->outq_bytes -= o->len;
			c->s.srv->outq_total -= o->len;
			list_del(&o->node);
			out_free(o);
		}
	}
	return 0;
}

/* Why a client's queue (with `waiting` bytes before the reply just
 * added) is past a bound, or NULL. */
static const char *outq_over(const struct epd_client *c, size_t waiting)
{
	if (c->outq_bytes > OUTQ_MAX)
		return "output queue over limit (client not reading)";
	if (c->outq_fds > OUTQ_FDS_MAX)
		return "more than 32 descriptors queued for it (client not "
		       "reading)";
	if (c->s.srv->outq_total > c->s.srv->cfg.limits.queued_bytes &&
	    waiting > OUTQ_SMALL)
		return "the replies queued for all clients are over "
		       "max_queued_bytes, and this client reads none of its "
		       "own";
	return NULL;
}

/* The session's send (core.h): c is the session's container. */
static int client_send(struct epd_session *s, uint16_t type, uint16_t flags,
		       uint64_t req_id, const void *payload, uint32_t len,
		       const int *fds, unsigned nfds)
{
	struct epd_client *c = (struct epd_client *)s;
	if (c->closing || c->doomed) {
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
		return EP_ECONNRESET;
	}
	struct epd_out *o = malloc(sizeof(*o) + EPP_HDR_SIZE + len);
	if (!o) {
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
		return EP_ENOMEM;
	}
	if (nfds > EPD_OUT_FDS) {
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
		free(o);
		return EP_EINVAL;
	}
	struct epp_hdr h;
	epp_hdr_init(&h, type, req_id);
	h.flags = flags;
	h.length = len;
	h.nfds = (uint16_t)nfds;
	epp_hdr_encode(&h, o->data);
	if (len)
		memcpy(o->data + EPP_HDR_SIZE, payload, len);
	o->len = EPP_HDR_SIZE + len;
	o->off = 0;
	o->nfds = nfds;
	for (unsigned i = 0; i < nfds; i++)
		o->fds[i] = fds[i];
	/* what waited for it before this reply: a client that reads its
	 * replies (libep waits for each) has nothing */
	const size_t waiting = c->outq_bytes;
	list_add_tail(&c->outq, &o->node);
	c->outq_bytes += o->len;
	c->outq_fds += nfds;
	c->s.srv->outq_total += o->len;
	/* A send never tears anything down itself: its caller may be in the
	 * middle of a group's state change (failing a group replies to every
	 * rank, and several may be dead at once). The close runs from the
	 * loop once the caller returned. */
	const char *over = outq_over(c, waiting);
	if (over) {
		epd_client_doom(c, over);
		return EP_ECONNRESET;
	}
	if (client_flush(c)) {
		epd_client_doom(c, "send failed");
		return EP_ECONNRESET;
	}
	client_update_poll(c);
	return 0;
}

int epd_client_send(struct epd_client *c, uint16_t type, uint16_t flags,
		    uint64_t req_id, const void *payload, uint32_t len,
		    const int *fds, unsigned nfds)
{
	return client_send(&c->s, type, flags, req_id, payload, len, fds,
			   nfds);
}

static void handle_closed(uv_handle_t *h)
{
	struct epd_client *c = h->data;
	if (--c->pending_handles == 0) {
		close(c->fd);
		epp_rbuf_free(&c->rb);
		free(c);
	}
}

static void reaper_cb(uv_idle_t *h)
{
	struct epd_server *srv = h->data;
	uv_idle_stop(h);
	/* A close removes only its own client from the list; one it dooms
	 * (a reply that fails) restarts this handle for the next turn. */
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->clients)
	{
		struct epd_client *c = LIST_ENTRY(it, struct epd_client, node);
		if (c->doomed && !c->closing)
			epd_client_close(c, c->why);
	}
}

void epd_client_doom(struct epd_client *c, const char *why)
{
	if (c->closing || c->doomed)
		return;
	c->doomed = true;
	snprintf(c->why, sizeof(c->why), "%s", why);
	uv_poll_stop(&c->poll);
	struct epd_server *srv = c->s.srv;
	if (!uv_is_closing((uv_handle_t *)&srv->reaper))
		uv_idle_start(&srv->reaper, reaper_cb);
}

void epd_client_close(struct epd_client *c, const char *why)
{
	if (c->closing)
		return;
	/* a rank's end, and any close for a cause (a bound, a bad frame), at
	 * info; the plain end of a connection that holds no group (epctl, a
	 * monitor's poll, a rank that left), at debug: a node polled every
	 * few seconds does not fill its journal */
	const bool plain = LIST_EMPTY(&c->s.members) &&
			   (!strcmp(why, "connection closed by peer") ||
			    !strcmp(why, "daemon shutting down"));
	epd_log(plain ? EPD_LOG_DEBUG : EPD_LOG_INFO,
		"client %lu (pid %d, uid %u) disconnected: %s",
		(unsigned long)c->s.id, (int)c->s.pid, (unsigned)c->s.uid, why);
	/* Try once more to deliver what is queued (an error reply). */
	client_flush(c);
	c->closing = true;
	uv_poll_stop(&c->poll);
	/* Removing a member may fail its group and reply to other ranks;
	 * those replies never close anything synchronously (doom), so this
	 * list is ours alone while we walk it. */
	while (!LIST_EMPTY(&c->s.members)) {
		struct epd_member *m = LIST_ENTRY(c->s.members.next,
						  struct epd_member, cnode);
		epd_member_remove(m, why);
	}
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &c->outq)
	{
		struct epd_out *o = LIST_ENTRY(it, struct epd_out, node);
		list_del(&o->node);
		c->s.srv->outq_total -= o->len;
		out_free(o);
	}
	for (unsigned i = 0; i < c->nfdq; i++)
		close(c->fdq[i]);
	c->nfdq = 0;
	list_del(&c->node);
	c->pending_handles = 2;
	uv_close((uv_handle_t *)&c->poll, handle_closed);
	uv_close((uv_handle_t *)&c->frame_timer, handle_closed);
}

static void handle_hello(struct epd_client *c, const struct epp_hdr *h,
			 const uint8_t *p)
{
	struct epp_rd r;
	epp_rd_init(&r, p, h->length);
	uint16_t major = epp_get_u16(&r);
	const uint16_t minor = epp_get_u16(&r);
	epp_get_str(&r, c->name, sizeof(c->name));
	epp_printable(c->name);
	if (epp_rd_end(&r)) {
		epd_session_error(&c->s, h->req_id, EP_EPROTO,
				 "malformed hello payload (%u bytes)",
				 h->length);
		return;
	}
	if (major != EPP_VERSION_MAJOR) {
		epd_session_error(&c->s, h->req_id, EP_EVERSION,
				 "client speaks protocol %u, daemon %u.%u",
				 major, EPP_VERSION_MAJOR, EPP_VERSION_MINOR);
		return;
	}
	struct epp_hello_ok ok = {.major = EPP_VERSION_MAJOR,
				  .minor = EPP_VERSION_MINOR,
				  .client_id = c->s.id};
	snprintf(ok.daemon_version, sizeof(ok.daemon_version), "%s",
		 PACKAGE_VERSION);
	snprintf(ok.backend, sizeof(ok.backend), "%s", c->s.srv->backend);
	/* 1.21: this node's name, which a job's rendezvous gathers into a
	 * group's node list (an older client's decoder reads no more) */
	if (minor >= 21)
		snprintf(ok.node, sizeof(ok.node), "%s",
			 c->s.srv->cfg.node_name);
	uint8_t buf[192];
	size_t n = epp_hello_ok_encode(&ok, buf, sizeof(buf));
	epd_client_send(c, EPP_OK, 0, h->req_id, buf, (uint32_t)n, NULL, 0);
}

static int get_group_id(struct epd_client *c, const struct epp_hdr *h,
			const uint8_t *p, uint64_t *gid)
{
	struct epp_rd r;
	epp_rd_init(&r, p, h->length);
	*gid = epp_get_u64(&r);
	if (epp_rd_end(&r)) {
		epd_session_error(&c->s, h->req_id, EP_EPROTO,
				 "malformed %s payload (%u bytes, expected 8)",
				 epp_type_name(h->type), h->length);
		return -1;
	}
	return 0;
}

/* RELEASE; quiet (EPP_F_ASYNC): no reply on success */
static void handle_release(struct epd_client *c, const struct epp_hdr *h,
			   const uint8_t *p, bool quiet)
{
	struct epp_release rl;
	if (epp_release_decode(p, h->length, &rl))
		epd_session_error(&c->s, h->req_id, EP_EPROTO,
				 "malformed release payload (%u bytes)",
				 h->length);
	else
		epd_op_release(&c->s, h->req_id, &rl, quiet);
}

/* Stream-ordered requests: the usual payload, then u64 seq. */
static void handle_async(struct epd_client *c, const struct epp_hdr *h,
			 const uint8_t *p)
{
	struct epd_aop op = {.type = h->type};
	uint64_t gid = 0;
	int bad = 0;
	if (h->type == EPP_RELEASE) {
		/* from a replayed CUDA graph's host node: no reply on
		 * success (nothing after the handle) */
		handle_release(c, h, p, true);
		return;
	}
	if (h->length < 8) {
		bad = 1;
	} else {
		struct epp_rd r;
		epp_rd_init(&r, p + h->length - 8, 8);
		op.seq = epp_get_u64(&r);
		uint32_t n = h->length - 8;
		if (h->type == EPP_BARRIER) {
			epp_rd_init(&r, p, n);
			gid = epp_get_u64(&r);
			bad = epp_rd_end(&r);
		} else if (h->type == EPP_DISPATCH) {
			struct epp_dispatch d;
			bad = epp_dispatch_decode(p, n, &d);
			gid = d.group_id;
			op.tokens = d.num_tokens;
			op.flags = d.flags;
			op.handle = d.flags & EPP_DISPATCH_CACHED ? d.handle.seq
								  : 0;
			op.reg = d.reg;
			op.rows = d.num_tokens;
			op.reg_off = d.reg_off;
		} else if (h->type == EPP_COMBINE) {
			struct epp_combine cb;
			bad = epp_combine_decode(p, n, &cb);
			gid = cb.group_id;
			op.flags = cb.flags;
			op.handle = cb.handle.seq;
			op.reg = cb.reg;
			op.rows = cb.num_rows;
			op.reg_off = cb.reg_off;
			op.out_reg = cb.out_reg;
			op.out_rows = cb.out_rows;
			op.out_off = cb.out_off;
		} else {
			epd_session_error(&c->s, h->req_id, EP_EPROTO,
					 "%s cannot be stream-ordered",
					 epp_type_name(h->type));
			return;
		}
	}
	if (bad) {
		epd_session_error(&c->s, h->req_id, EP_EPROTO,
				 "malformed stream-ordered %s (%u bytes)",
				 epp_type_name(h->type), h->length);
		return;
	}
	epd_group_async(&c->s, h->req_id, gid, &op);
}

/* MEM_REG: the frame's descriptors are the chunks (taken: *nfds = 0). */
static void handle_mem_reg(struct epd_client *c, const struct epp_hdr *h,
			   const uint8_t *p, int *fds, unsigned *nfds)
{
	struct epp_mem_reg mr;
	if (epp_mem_reg_decode(p, h->length, &mr)) {
		epd_session_error(&c->s, h->req_id, EP_EPROTO,
				 "malformed mem-reg payload (%u bytes)",
				 h->length);
		return;
	}
	if (mr.nchunks != *nfds || !mr.nchunks) {
		epd_session_error(&c->s, h->req_id, EP_EPROTO,
				 "mem-reg of %u chunks came with %u "
				 "descriptors",
				 mr.nchunks, *nfds);
		return;
	}
	*nfds = 0;
	epd_op_mem_reg(&c->s, h->req_id, &mr, fds);
}

/* A payload that did not decode: EP_EPROTO, naming it. */
static void malformed(struct epd_client *c, const struct epp_hdr *h,
		      const char *what)
{
	epd_session_error(&c->s, h->req_id, EP_EPROTO,
			 "malformed %s payload (%u bytes)", what, h->length);
}

static void handle_join(struct epd_client *c, const struct epp_hdr *h,
			const uint8_t *p)
{
	struct epp_join j;
	char err[256];
	int rc = epp_join_decode_flags(p, h->length, h->flags, &j, err,
				       sizeof(err));
	if (rc)
		epd_session_error(&c->s, h->req_id, rc, "%s", err);
	else
		epd_group_join(&c->s, h->req_id, h->flags, &j);
}

static void handle_status(struct epd_client *c, const struct epp_hdr *h)
{
	if (h->length) {
		epd_session_error(&c->s, h->req_id, EP_EPROTO,
				 "status takes no payload");
		return;
	}
	char *js = epd_status_json(c->s.srv, &c->s);
	if (!js) {
		epd_session_error(&c->s, h->req_id, EP_ENOMEM,
				 "cannot build status");
		return;
	}
	size_t n = strlen(js);
	if (n > EPP_MAX_PAYLOAD)
		epd_session_error(&c->s, h->req_id, EP_ETOOBIG,
				 "status of %zu bytes exceeds a frame", n);
	else
		epd_client_send(c, EPP_OK, 0, h->req_id, js, (uint32_t)n, NULL,
				0);
	free(js);
}

/* May this frame be handled at all? If not, the client was answered (and
 * a refused one closed). */
static bool frame_admitted(struct epd_client *c, const struct epp_hdr *h)
{
	if (c->refused) {
		char why[sizeof(c->why)];
		snprintf(why, sizeof(why), "%s", c->why);
		epd_session_error(&c->s, h->req_id, c->refused, "%s", why);
		epd_client_close(c, why);
		return false;
	}
	if (c->s.srv->stopping) {
		epd_session_error(&c->s, h->req_id, EP_ESHUTDOWN,
				 "daemon is shutting down");
		return false;
	}
	if ((h->flags &
	     ~(EPP_F_JOIN_NOWAIT | EPP_F_JOIN_LINK | EPP_F_JOIN_NODES |
	       EPP_F_JOIN_RECV | EPP_F_JOIN_SECRET)) &&
	    h->type == EPP_JOIN) {
		epd_session_error(&c->s, h->req_id, EP_EPROTO,
				 "flags 0x%x not valid for join", h->flags);
		return false;
	}
	if (h->flags && h->flags != EPP_F_ASYNC && h->type != EPP_JOIN) {
		epd_session_error(&c->s, h->req_id, EP_EPROTO,
				 "flags 0x%x not valid for %s", h->flags,
				 epp_type_name(h->type));
		return false;
	}
	return true;
}

static void handle_frame(struct epd_client *c, const struct epp_hdr *h,
			 const uint8_t *p, int *fds, unsigned *nfds)
{
	uint64_t gid;
	epd_stall_mark(epp_type_name(h->type), c->name);
	epd_debug("client %lu: %s req %lu len %u", (unsigned long)c->s.id,
		  epp_type_name(h->type), (unsigned long)h->req_id, h->length);
	if (!frame_admitted(c, h))
		return;
	if (h->flags == EPP_F_ASYNC) {
		handle_async(c, h, p);
		return;
	}
	switch (h->type) {
	case EPP_HELLO:
		handle_hello(c, h, p);
		break;
	case EPP_JOIN:
		handle_join(c, h, p);
		break;
	case EPP_LEAVE:
		if (!get_group_id(c, h, p, &gid))
			epd_group_leave(&c->s, h->req_id, gid);
		break;
	case EPP_BARRIER:
		if (!get_group_id(c, h, p, &gid))
			epd_group_barrier(&c->s, h->req_id, gid);
		break;
	case EPP_DISPATCH: {
		struct epp_dispatch d;
		if (epp_dispatch_decode(p, h->length, &d))
			malformed(c, h, "dispatch");
		else
			epd_op_dispatch(&c->s, h->req_id, &d);
		break;
	}
	case EPP_COMBINE: {
		struct epp_combine cb;
		if (epp_combine_decode(p, h->length, &cb))
			malformed(c, h, "combine");
		else
			epd_op_combine(&c->s, h->req_id, &cb);
		break;
	}
	case EPP_RELEASE:
		handle_release(c, h, p, false);
		break;
	case EPP_LL_MAP: {
		struct epp_ll_map lm;
		if (epp_ll_map_decode(p, h->length, &lm))
			malformed(c, h, "ll-map");
		else
			epd_op_ll_map(&c->s, h->req_id, &lm);
		break;
	}
	case EPP_MEM_REG:
		handle_mem_reg(c, h, p, fds, nfds);
		break;
	case EPP_MEM_DEREG: {
		struct epp_mem_dereg md;
		if (epp_mem_dereg_decode(p, h->length, &md))
			malformed(c, h, "mem-dereg");
		else
			epd_op_mem_dereg(&c->s, h->req_id, &md);
		break;
	}
	case EPP_STATUS:
		handle_status(c, h);
		break;
	default:
		c->s.srv->n_proto_errors++;
		epd_session_error(&c->s, h->req_id, EP_EPROTO,
				 "unknown message type %u", h->type);
	}
}

/* A frame that cannot be trusted: reply and disconnect after the reply. */
static void client_fatal(struct epd_client *c, uint64_t req_id, int code,
			 const char *msg)
{
	c->s.srv->n_proto_errors++;
	epd_warn("client %lu (pid %d): %s; disconnecting",
		 (unsigned long)c->s.id, (int)c->s.pid, msg);
	epd_session_error(&c->s, req_id, code, "%s", msg);
	epd_client_close(c, msg);
}

static void frame_timeout(uv_timer_t *t)
{
	struct epd_client *c = t->data;
	if (c->refused) {
		epd_client_close(c, "refused");
		return;
	}
	char msg[160];
	snprintf(msg, sizeof(msg),
		 "truncated frame: %zu bytes of a frame arrived, the rest not "
		 "within %u ms",
		 epp_rbuf_live(&c->rb), c->s.srv->cfg.frame_timeout_ms);
	client_fatal(c, 0, EP_EPROTO, msg);
}

static int client_frame(void *arg, const struct epp_hdr *h,
			const uint8_t *frame)
{
	struct epd_client *c = arg;
	int fds[EPP_MAX_FDS];
	unsigned nfds = h->nfds;
	if (nfds && h->type != EPP_MEM_REG) {
		client_fatal(c, h->req_id, EP_EPROTO,
			     "descriptors come only with mem-reg");
		return 1;
	}
	/* A frame's descriptors arrive with its first byte: more queued than
	 * this frame claims while it ends the bytes received belong to no
	 * frame (a later one's would have come with a byte after it). */
	if (c->nfdq > nfds &&
	    frame + EPP_HDR_SIZE + h->length == c->rb.p + c->rb.len) {
		client_fatal(c, h->req_id, EP_EPROTO,
			     "descriptors that no frame claims (they come only "
			     "with mem-reg)");
		return 1;
	}
	if (nfds > c->nfdq) {
		char msg[96];
		snprintf(msg, sizeof(msg),
			 "frame announces %u descriptors, %u arrived", nfds,
			 c->nfdq);
		client_fatal(c, h->req_id, EP_EPROTO, msg);
		return 1;
	}
	memcpy(fds, c->fdq, nfds * sizeof(int));
	c->nfdq -= nfds;
	memmove(c->fdq, c->fdq + nfds, c->nfdq * sizeof(int));
	handle_frame(c, h, frame + EPP_HDR_SIZE, fds, &nfds);
	for (unsigned i = 0; i < nfds; i++) /* not taken */
		close(fds[i]);
	return c->closing || c->doomed;
}

/* Parse and handle every complete frame received. The buffer grows as
 * bytes arrive, not when a header announces a large frame: a header costs
 * no memory. */
static void client_parse(struct epd_client *c)
{
	const size_t before = epp_rbuf_live(&c->rb);
	struct epp_hdr h;
	char err[256];
	int rc = epp_frames(&c->rb, 0, client_frame, c, &h, err, sizeof(err),
			    NULL);
	if (c->closing || c->doomed)
		return;
	if (rc) {
		/* decode filled h before judging it: echo req_id */
		client_fatal(c, h.req_id, rc, err);
		return;
	}
	/* A large frame's buffer is given back once it was handled. */
	epp_rbuf_shrink(&c->rb, RBUF_KEEP, RBUF_MIN);
	/* One deadline for a whole frame from its first byte: a frame fed a
	 * byte at a time does not get a new one with every byte. */
	const size_t live = epp_rbuf_live(&c->rb);
	if (!live)
		uv_timer_stop(&c->frame_timer);
	else if (live < before ||
		 !uv_is_active((uv_handle_t *)&c->frame_timer))
		uv_timer_start(&c->frame_timer, frame_timeout,
			       c->s.srv->cfg.frame_timeout_ms, 0);
}

/* Reads per readiness callback: a client that keeps its socket full gets
 * its turn and then waits for the others' (the poll is level-triggered,
 * so what is left is read on the loop's next turn). Without a budget one
 * flooding client held the loop for seconds under a sanitizer and other
 * clients' replies waited. */
#define READS_PER_TURN 8


static void client_read(struct epd_client *c)
{
	for (int turn = 0; turn < READS_PER_TURN; turn++) {
		if (c->rb.len == c->rb.cap &&
		    epp_rbuf_room(&c->rb, 1, RBUF_MIN)) {
			epd_client_close(c, "out of memory");
			return;
		}
		int fds[EPP_MAX_FDS];
		unsigned nfds = 0;
		bool trunc = false;
		long n = epp_recvmsg(c->fd, c->rb.p + c->rb.len,
				     c->rb.cap - c->rb.len, fds, &nfds, EPP_MAX_FDS,
				     &trunc);
		/* Queued for the frame they came with; more than one frame
		 * may carry unclaimed: a client that sends descriptors no
		 * frame claims is cut off before they pile up. */
		if (trunc || nfds > EPP_MAX_FDS - c->nfdq) {
			for (unsigned i = 0; i < nfds; i++)
				close(fds[i]);
			client_fatal(c, 0, EP_EPROTO,
				     trunc ? "descriptors truncated"
					   : "more descriptors than frames "
					     "claim");
			return;
		}
		memcpy(c->fdq + c->nfdq, fds, nfds * sizeof(int));
		c->nfdq += nfds;
		if (n == -EAGAIN)
			return;
		if (n < 0) {
			char why[96];
			snprintf(why, sizeof(why), "read failed: %s",
				 strerror((int)-n));
			epd_client_close(c, why);
			return;
		}
		if (n == 0) {
			if (epp_rbuf_live(&c->rb))
				epd_warn("client %lu: closed with %zu bytes of "
					 "a truncated frame",
					 (unsigned long)c->s.id,
					 epp_rbuf_live(&c->rb));
			epd_client_close(c, "connection closed by peer");
			return;
		}
		c->rb.len += (size_t)n;
		client_parse(c);
		if (c->closing || c->doomed)
			return;
	}
}

static void client_io(uv_poll_t *h, int status, int events)
{
	struct epd_client *c = h->data;
	if (c->doomed)
		return;
	if (status < 0) {
		/* libuv reports a socket error (POLLERR) as EBADF: say the
		 * socket's own error */
		int e = 0;
		socklen_t el = sizeof(e);
		char why[96];
		if (status == UV_EBADF &&
		    !getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &e, &el) && e)
			snprintf(why, sizeof(why), "socket error: %s",
				 strerror(e));
		else
			snprintf(why, sizeof(why), "%s", uv_strerror(status));
		epd_client_close(c, why);
		return;
	}
	if (events & UV_WRITABLE) {
		if (client_flush(c)) {
			epd_client_close(c, "send failed");
			return;
		}
	}
	if (events & (UV_READABLE | UV_DISCONNECT))
		client_read(c);
	client_update_poll(c);
}

/* A refused connection: its first frame (the hello) is answered with the
 * error and the connection closed: replying before the client's bytes are
 * read would reset the connection under the reply. At most a frame
 * timeout. */
static void client_refuse(struct epd_client *c, int code, const char *fmt,
			  ...) __attribute__((format(printf, 3, 4)));
static void client_refuse(struct epd_client *c, int code, const char *fmt,
			  ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(c->why, sizeof(c->why), fmt, ap);
	va_end(ap);
	c->refused = code;
	uv_timer_start(&c->frame_timer, frame_timeout,
		       c->s.srv->cfg.frame_timeout_ms, 0);
	client_update_poll(c);
}

bool epd_uid_allowed(const struct epd_config *cfg, uid_t uid)
{
	if (cfg->nallow == 0 || uid == 0 || uid == geteuid())
		return true;
	for (unsigned i = 0; i < cfg->nallow; i++)
		if (cfg->allow_uids[i] == uid)
			return true;
	return false;
}

void epd_client_accept(struct epd_server *srv, int fd)
{
	struct ucred cred;
	socklen_t len = sizeof(cred);
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len)) {
		epd_warn("SO_PEERCRED failed on a new connection: %m");
		close(fd);
		return;
	}
	struct epd_client *c = calloc(1, sizeof(*c));
	if (!c) {
		close(fd);
		return;
	}
	c->s.srv = srv;
	c->s.send = client_send;
	c->fd = fd;
	c->s.id = ++srv->next_client_id;
	c->s.pid = cred.pid;
	c->s.uid = cred.uid;
	c->s.gid = cred.gid;
	c->connected_ns = epd_now_ns();
	int nomem = epp_rbuf_room(&c->rb, RBUF_MIN, RBUF_MIN);
	LIST_INIT(&c->outq);
	LIST_INIT(&c->s.members);
	list_add_tail(&srv->clients, &c->node);
	uv_poll_init(srv->loop, &c->poll, fd);
	uv_timer_init(srv->loop, &c->frame_timer);
	c->poll.data = c;
	c->frame_timer.data = c;
	if (nomem) {
		epd_client_close(c, "out of memory");
		return;
	}
	if (!epd_uid_allowed(&srv->cfg, cred.uid)) {
		srv->n_rejected++;
		epd_warn("rejecting pid %d: uid %u is not in allow_users",
			 (int)cred.pid, (unsigned)cred.uid);
		client_refuse(c, EP_EACCES,
			      "uid %u is not allowed to use this daemon",
			      (unsigned)cred.uid);
		return;
	}
	const struct epd_limits *lim = &srv->cfg.limits;
	uint32_t n = 0, mine = 0;
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &srv->clients)
	{
		struct epd_client *o = LIST_ENTRY(it, struct epd_client, node);
		if (o == c || o->closing || o->doomed || o->refused)
			continue;
		n++;
		mine += o->s.uid == c->s.uid;
	}
	const char *lname = NULL;
	if (lim->conns && n >= lim->conns)
		lname = "max_connections";
	else if (lim->conns_per_uid && mine >= lim->conns_per_uid) /* root too */
		lname = "max_connections_per_user";
	if (lname) {
		srv->n_limited++;
		epd_log_limited(&srv->log_rl, "refusing pid %d (uid %u): %s reached",
				(int)cred.pid, (unsigned)cred.uid, lname);
		client_refuse(c, EP_ELIMIT, "%s (%u) reached for uid %u", lname,
			      !strcmp(lname, "max_connections")
				      ? lim->conns
				      : lim->conns_per_uid,
			      (unsigned)cred.uid);
		return;
	}
	srv->n_accepted++;
	/* at debug: a rank's join says who it is at info */
	epd_debug("client %lu connected: pid %d uid %u", (unsigned long)c->s.id,
		  (int)c->s.pid, (unsigned)c->s.uid);
	client_update_poll(c);
}
