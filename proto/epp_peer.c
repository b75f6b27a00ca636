/* SPDX-License-Identifier: MIT */
/* Codecs of the daemon-to-daemon frames (epp_peer.h). */
#include "epp_peer.h"

#include <string.h>

static size_t finish(const struct epp_wr *w)
{
	return w->err ? 0 : w->off;
}

static int done(const struct epp_rd *r)
{
	return epp_rd_end(r) ? EP_EPROTO : 0;
}

size_t epp_peer_hello_encode(const struct epp_peer_hello *m, uint8_t *buf,
			     size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, buf, cap);
	epp_put_u16(&w, m->major);
	epp_put_u16(&w, m->minor);
	epp_put_str(&w, m->node);
	epp_put_u32(&w, m->index);
	for (int i = 0; i < EPP_PEER_NONCE; i++)
		epp_put_u8(&w, m->nonce[i]);
	return finish(&w);
}

int epp_peer_hello_decode(const uint8_t *p, size_t len,
			  struct epp_peer_hello *m)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	m->major = epp_get_u16(&r);
	m->minor = epp_get_u16(&r);
	epp_get_str(&r, m->node, sizeof(m->node));
	m->index = epp_get_u32(&r);
	for (int i = 0; i < EPP_PEER_NONCE; i++)
		m->nonce[i] = epp_get_u8(&r);
	return done(&r);
}

size_t epp_peer_heartbeat_encode(const struct epp_peer_heartbeat *m,
				 uint8_t *buf, size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, buf, cap);
	epp_put_u64(&w, m->epoch);
	epp_put_str(&w, m->row);
	return finish(&w);
}

int epp_peer_heartbeat_decode(const uint8_t *p, size_t len,
			      struct epp_peer_heartbeat *m)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	m->epoch = epp_get_u64(&r);
	epp_get_str(&r, m->row, sizeof(m->row));
	return done(&r);
}

size_t epp_peer_barrier_encode(const struct epp_peer_barrier *m, uint8_t *buf,
			       size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, buf, cap);
	epp_put_str(&w, m->group);
	epp_put_u32(&w, m->local);
	epp_put_u64(&w, m->seq);
	/* each only where said: decode gives back what was encoded */
	if (m->xops != UINT64_MAX || m->step != EPP_STEP_ALL)
		epp_put_u64(&w, m->xops);
	if (m->step != EPP_STEP_ALL)
		epp_put_u8(&w, m->step);
	return finish(&w);
}

int epp_peer_barrier_decode(const uint8_t *p, size_t len,
			    struct epp_peer_barrier *m)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	epp_get_str(&r, m->group, sizeof(m->group));
	m->local = epp_get_u32(&r);
	m->seq = epp_get_u64(&r);
	const size_t tail = r.err ? 0 : r.len - r.off;
	m->xops = tail >= 8 ? epp_get_u64(&r) : UINT64_MAX;
	m->step = tail == 9 ? epp_get_u8(&r) : EPP_STEP_ALL;
	/* unknown data ops are sent as none; a step names one of 32 */
	if ((tail == 8 && m->xops == UINT64_MAX) ||
	    (tail == 9 && m->step >= 32))
		return EP_EPROTO;
	return done(&r);
}

size_t epp_peer_gfail_encode(const struct epp_peer_gfail *m, uint8_t *buf,
			     size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, buf, cap);
	epp_put_str(&w, m->group);
	epp_put_u32(&w, (uint32_t)m->code);
	epp_put_str(&w, m->msg);
	epp_put_u64(&w, m->round);
	epp_put_u64(&w, m->xops);
	return finish(&w);
}

int epp_peer_gfail_decode(const uint8_t *p, size_t len,
			  struct epp_peer_gfail *m)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	epp_get_str(&r, m->group, sizeof(m->group));
	m->code = (int32_t)epp_get_u32(&r);
	epp_get_str(&r, m->msg, sizeof(m->msg));
	m->round = epp_get_u64(&r);
	m->xops = epp_get_u64(&r);
	if (done(&r) || m->code >= 0)
		return EP_EPROTO;
	return 0;
}

void epp_peer_put_op(struct epp_wr *w, const char *group, uint64_t op)
{
	epp_put_str(w, group);
	epp_put_u64(w, op);
}

int epp_peer_op_decode(const uint8_t *p, size_t len, struct epp_peer_op *m)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	epp_get_str(&r, m->group, sizeof(m->group));
	m->op = epp_get_u64(&r);
	if (r.err)
		return EP_EPROTO;
	m->body = p + r.off;
	m->body_len = len - r.off;
	return 0;
}

int epp_peer_xmeta_decode(const struct epp_peer_op *op,
			  struct epp_peer_xmeta *m)
{
	struct epp_rd r;
	epp_rd_init(&r, op->body, op->body_len);
	m->rank = epp_get_u32(&r);
	m->tokens = epp_get_u32(&r);
	m->flags = epp_get_u32(&r);
	if (r.err || (m->flags & ~(EPP_DISPATCH_WEIGHTS | EPP_DISPATCH_CACHED |
				   EPP_DISPATCH_TOOBIG)))
		return EP_EPROTO;
	m->data = op->body + r.off;
	m->data_len = op->body_len - r.off;
	return 0;
}

void epp_peer_put_xrows(struct epp_wr *w, uint16_t type, uint64_t handle,
			uint32_t count)
{
	epp_put_u16(w, type);
	epp_put_u64(w, handle);
	epp_put_u32(w, count);
}

int epp_peer_xrows_type(const struct epp_peer_op *op, uint16_t *type)
{
	struct epp_rd r;
	epp_rd_init(&r, op->body, op->body_len);
	*type = epp_get_u16(&r);
	return r.err ? EP_EPROTO : 0;
}

int epp_peer_xrows_decode(const struct epp_peer_op *op, size_t rec,
			  struct epp_peer_xrows *m)
{
	struct epp_rd r;
	epp_rd_init(&r, op->body, op->body_len);
	m->type = epp_get_u16(&r);
	m->handle = epp_get_u64(&r);
	m->count = epp_get_u32(&r);
	if (r.err ||
	    (m->type != EPP_DISPATCH && m->type != EPP_COMBINE &&
	     m->type != (EPP_COMBINE | EPP_XROWS_WEIGHTS)) ||
	    op->body_len - r.off != (size_t)m->count * rec)
		return EP_EPROTO;
	m->recs = op->body + r.off;
	return 0;
}

int epp_peer_shape_decode(const struct epp_peer_op *op,
			  uint32_t v[EPP_PEER_SHAPE_N], uint64_t *nodes_hash,
			  uint32_t *recv_rows)
{
	struct epp_rd r;
	epp_rd_init(&r, op->body, op->body_len);
	for (int i = 0; i < EPP_PEER_SHAPE_N; i++)
		v[i] = epp_get_u32(&r);
	*nodes_hash = 0;
	*recv_rows = 0;
	/* 1.21: a named node list's hash (8 bytes), then recv_rows (4),
	 * each only where set: the tail's length says which */
	const size_t tail = r.err ? 0 : r.len - r.off;
	if (tail == 8 || tail == 12) {
		*nodes_hash = epp_get_u64(&r);
		if (!*nodes_hash)
			return EP_EPROTO; /* no list is sent as none */
	}
	if (tail == 4 || tail == 12) {
		*recv_rows = epp_get_u32(&r);
		if (!*recv_rows)
			return EP_EPROTO;
	}
	return done(&r);
}

#define WIN_BYTES 20

int epp_peer_xwin_decode(const struct epp_peer_op *op,
			 struct epp_peer_xwin *m)
{
	struct epp_rd r;
	epp_rd_init(&r, op->body, op->body_len);
	m->wid = epp_get_u16(&r);
	m->n = epp_get_u32(&r);
	if (r.err || m->n > EPP_MAX_WORLD ||
	    op->body_len - r.off != (size_t)m->n * WIN_BYTES)
		return EP_EPROTO;
	m->ent = op->body + r.off;
	return 0;
}

void epp_peer_xwin_get(const struct epp_peer_xwin *m, uint32_t i,
		       struct epp_peer_window *out)
{
	struct epp_rd r;
	epp_rd_init(&r, m->ent + (size_t)i * WIN_BYTES, WIN_BYTES);
	out->addr = epp_get_u64(&r);
	out->rkey = epp_get_u32(&r);
	out->len = epp_get_u64(&r);
}

void epp_peer_put_window(struct epp_wr *w, const struct epp_peer_window *e)
{
	epp_put_u64(w, e->addr);
	epp_put_u32(w, e->rkey);
	epp_put_u64(w, e->len);
}
