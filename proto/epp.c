/* SPDX-License-Identifier: MIT */
/* epp: frame header and payload codecs. */
#include "epp.h"

#include <stdio.h>
#include <string.h>

void epp_rd_init(struct epp_rd *r, const void *p, size_t len)
{
	r->p = p;
	r->len = len;
	r->off = 0;
	r->err = false;
}

static const uint8_t *rd_take(struct epp_rd *r, size_t n)
{
	if (r->err || r->len - r->off < n) {
		r->err = true;
		return NULL;
	}
	const uint8_t *q = r->p + r->off;
	r->off += n;
	return q;
}

uint8_t epp_get_u8(struct epp_rd *r)
{
	const uint8_t *q = rd_take(r, 1);
	return q ? q[0] : 0;
}

uint16_t epp_get_u16(struct epp_rd *r)
{
	const uint8_t *q = rd_take(r, 2);
	return q ? (uint16_t)(q[0] | q[1] << 8) : 0;
}

uint32_t epp_get_u32(struct epp_rd *r)
{
	const uint8_t *q = rd_take(r, 4);
	return q ? (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 |
			   (uint32_t)q[3] << 24
		 : 0;
}

uint64_t epp_get_u64(struct epp_rd *r)
{
	uint64_t lo = epp_get_u32(r);
	return lo | (uint64_t)epp_get_u32(r) << 32;
}

void epp_get_str(struct epp_rd *r, char *dst, size_t cap)
{
	size_t n = epp_get_u16(r);
	const uint8_t *q = rd_take(r, n);
	if (!q || n >= cap || memchr(q, 0, n)) {
		r->err = true;
		if (cap)
			dst[0] = 0;
		return;
	}
	memcpy(dst, q, n);
	dst[n] = 0;
}

int epp_rd_end(const struct epp_rd *r)
{
	return r->err || r->off != r->len ? EP_EPROTO : 0;
}

void epp_wr_init(struct epp_wr *w, void *p, size_t cap)
{
	w->p = p;
	w->cap = cap;
	w->off = 0;
	w->err = false;
}

static uint8_t *wr_take(struct epp_wr *w, size_t n)
{
	if (w->err || w->cap - w->off < n) {
		w->err = true;
		return NULL;
	}
	uint8_t *q = w->p + w->off;
	w->off += n;
	return q;
}

void epp_put_u8(struct epp_wr *w, uint8_t v)
{
	uint8_t *q = wr_take(w, 1);
	if (q)
		q[0] = v;
}

void epp_put_u16(struct epp_wr *w, uint16_t v)
{
	uint8_t *q = wr_take(w, 2);
	if (q) {
		q[0] = (uint8_t)v;
		q[1] = (uint8_t)(v >> 8);
	}
}

void epp_put_u32(struct epp_wr *w, uint32_t v)
{
	uint8_t *q = wr_take(w, 4);
	if (q)
		for (int i = 0; i < 4; i++)
			q[i] = (uint8_t)(v >> (8 * i));
}

void epp_put_u64(struct epp_wr *w, uint64_t v)
{
	epp_put_u32(w, (uint32_t)v);
	epp_put_u32(w, (uint32_t)(v >> 32));
}

void epp_put_bytes(struct epp_wr *w, const void *p, size_t n)
{
	uint8_t *q = wr_take(w, n);
	if (q && n)
		memcpy(q, p, n);
}

void epp_put_str(struct epp_wr *w, const char *s)
{
	size_t n = strnlen(s, 0xffff);
	epp_put_u16(w, (uint16_t)n);
	uint8_t *q = wr_take(w, n);
	if (q)
		memcpy(q, s, n);
}

void epp_hdr_init(struct epp_hdr *h, uint16_t type, uint64_t req_id)
{
	memset(h, 0, sizeof(*h));
	h->magic = EPP_MAGIC;
	h->ver_major = EPP_VERSION_MAJOR;
	h->ver_minor = EPP_VERSION_MINOR;
	h->type = type;
	h->req_id = req_id;
}

void epp_hdr_encode(const struct epp_hdr *h, uint8_t out[EPP_HDR_SIZE])
{
	struct epp_wr w;
	epp_wr_init(&w, out, EPP_HDR_SIZE);
	epp_put_u32(&w, h->magic);
	epp_put_u8(&w, h->ver_major);
	epp_put_u8(&w, h->ver_minor);
	epp_put_u16(&w, h->type);
	epp_put_u16(&w, h->flags);
	epp_put_u16(&w, h->nfds);
	epp_put_u32(&w, h->length);
	epp_put_u64(&w, h->req_id);
}

#define ERRF(...)                                                              \
	do {                                                                   \
		if (err)                                                       \
			snprintf(err, errlen, __VA_ARGS__);                    \
	} while (0)

int epp_hdr_decode(const uint8_t in[EPP_HDR_SIZE], struct epp_hdr *h,
		   char *err, size_t errlen)
{
	struct epp_rd r;
	epp_rd_init(&r, in, EPP_HDR_SIZE);
	h->magic = epp_get_u32(&r);
	h->ver_major = epp_get_u8(&r);
	h->ver_minor = epp_get_u8(&r);
	h->type = epp_get_u16(&r);
	h->flags = epp_get_u16(&r);
	h->nfds = epp_get_u16(&r);
	h->length = epp_get_u32(&r);
	h->req_id = epp_get_u64(&r);
	if (h->magic != EPP_MAGIC) {
		ERRF("bad magic 0x%08x (expected 0x%08x)", h->magic, EPP_MAGIC);
		return EP_EPROTO;
	}
	if (h->ver_major != EPP_VERSION_MAJOR) {
		ERRF("protocol version %u.%u not supported (this side speaks "
		     "%u.%u)",
		     h->ver_major, h->ver_minor, EPP_VERSION_MAJOR,
		     EPP_VERSION_MINOR);
		return EP_EVERSION;
	}
	if (h->length > EPP_MAX_PAYLOAD) {
		ERRF("frame length %u exceeds the maximum %u", h->length,
		     EPP_MAX_PAYLOAD);
		return EP_EPROTO;
	}
	if (h->nfds > EPP_MAX_FDS) {
		ERRF("frame announces %u descriptors (maximum %u)", h->nfds,
		     EPP_MAX_FDS);
		return EP_EPROTO;
	}
	if (h->flags & ~EPP_F_ALL) {
		ERRF("unknown flags 0x%x", h->flags & ~EPP_F_ALL);
		return EP_EPROTO;
	}
	return 0;
}

const char *epp_type_name(uint16_t type)
{
	switch (type) {
	case EPP_HELLO: return "hello";
	case EPP_JOIN: return "join";
	case EPP_LEAVE: return "leave";
	case EPP_BARRIER: return "barrier";
	case EPP_STATUS: return "status";
	case EPP_DISPATCH: return "dispatch";
	case EPP_COMBINE: return "combine";
	case EPP_RELEASE: return "release";
	case EPP_LL_MAP: return "ll-map";
	case EPP_MEM_REG: return "mem-reg";
	case EPP_MEM_DEREG: return "mem-dereg";
	case EPP_PEER_HELLO: return "peer-hello";
	case EPP_PEER_AUTH: return "peer-auth";
	case EPP_PEER_HEARTBEAT: return "peer-heartbeat";
	case EPP_PEER_BARRIER: return "peer-barrier";
	case EPP_PEER_XMETA: return "peer-routing";
	case EPP_PEER_XROWS: return "peer-rows";
	case EPP_PEER_GFAIL: return "peer-group-failed";
	case EPP_PEER_GSHAPE: return "peer-group-shape";
	case EPP_PEER_XWIN: return "peer-windows";
	case EPP_PEER_BYE: return "peer-bye";
	case EPP_OK: return "ok";
	case EPP_ERROR: return "error";
	case EPP_NOTICE: return "notice";
	}
	return "unknown";
}

void epp_printable(char *s)
{
	for (; *s; s++)
		if ((unsigned char)*s < 0x20 || (unsigned char)*s > 0x7e)
			*s = '?';
}

/* 1..max characters of [A-Za-z0-9_.-] and those of `extra`. */
static bool name_valid(const char *name, size_t max, const char *extra)
{
	size_t n = strlen(name);
	if (n == 0 || n > max)
		return false;
	for (size_t i = 0; i < n; i++) {
		char c = name[i];
		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
		      (c >= '0' && c <= '9') || c == '_' || c == '.' ||
		      c == '-' || strchr(extra, c)))
			return false;
	}
	return true;
}

bool epp_group_name_valid(const char *name)
{
	return name_valid(name, EP_GROUP_NAME_MAX, ":");
}

bool epp_node_name_valid(const char *name)
{
	return name_valid(name, EPP_NODE_NAME_MAX, "");
}

size_t epp_node_entry_name_len(const char *e)
{
	return strcspn(e, "@");
}

bool epp_node_entry_valid(const char *e)
{
	const char *at = strchr(e, '@');
	if (!at)
		return epp_node_name_valid(e);
	char name[EPP_NODE_NAME_MAX + 1];
	if ((size_t)(at - e) > EPP_NODE_NAME_MAX)
		return false;
	memcpy(name, e, (size_t)(at - e));
	name[at - e] = 0;
	const char *colon = strrchr(at, ':');
	if (!epp_node_name_valid(name) || !colon || colon == at + 1)
		return false;
	const char *host = at + 1;
	size_t hl = (size_t)(colon - host);
	if (hl > EPP_NODE_HOST_MAX)
		return false;
	for (size_t i = 0; i < hl; i++) {
		char c = host[i];
		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
		      (c >= '0' && c <= '9') || strchr("_.:-[]", c)))
			return false;
	}
	const char *p = colon + 1;
	unsigned long port = 0;
	if (!*p || strlen(p) > 5)
		return false;
	for (; *p; p++) {
		if (*p < '0' || *p > '9')
			return false;
		port = port * 10 + (unsigned long)(*p - '0');
	}
	return port >= 1 && port <= 65535;
}

const char *epp_join_node(const struct epp_join *j, uint32_t i)
{
	const char *s = j->nodes;
	while (i--)
		s += strlen(s) + 1;
	return s;
}

uint16_t epp_join_flags(const struct epp_join *j)
{
	return (j->link ? EPP_F_JOIN_LINK : 0) |
	       (j->num_nodes ? EPP_F_JOIN_NODES : 0) |
	       (j->recv_rows ? EPP_F_JOIN_RECV : 0) |
	       (j->secret_len ? EPP_F_JOIN_SECRET : 0);
}

size_t epp_join_encode(const struct epp_join *j, uint8_t *out, size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, out, cap);
	/* 1.21: recv_rows, then the node list, with their flags */
	if (j->recv_rows)
		epp_put_u32(&w, j->recv_rows);
	if (j->secret_len) {
		epp_put_u16(&w, (uint16_t)j->secret_len);
		epp_put_bytes(&w, j->secret, j->secret_len);
	}
	if (j->num_nodes) {
		const char *end = epp_join_node(j, j->num_nodes);
		size_t nb = (size_t)(end - j->nodes);
		epp_put_u32(&w, j->num_nodes);
		epp_put_u32(&w, (uint32_t)nb);
		epp_put_bytes(&w, j->nodes, nb);
	}
	epp_put_str(&w, j->name);
	epp_put_u32(&w, j->world_size);
	epp_put_u32(&w, j->ranks_per_node);
	epp_put_u32(&w, j->rank);
	epp_put_u32(&w, j->num_experts);
	epp_put_u32(&w, j->hidden);
	epp_put_u32(&w, j->max_tokens);
	epp_put_u32(&w, j->topk);
	epp_put_u32(&w, j->dtype);
	epp_put_u32(&w, j->timeout_ms);
	/* 1.2: the GPU, for GPU ranks only (1.1 daemons read host joins) */
	if (!epp_uuid_is_zero(j->gpu_uuid)) {
		for (int i = 0; i < 16; i++)
			epp_put_u8(&w, j->gpu_uuid[i]);
		epp_put_u32(&w, j->rank_flags);
	}
	/* 1.12: only above one (older daemons read the rest) */
	if (j->recv_areas > 1)
		epp_put_u32(&w, j->recv_areas);
	/* 1.16: with EPP_F_JOIN_LINK in the header */
	if (j->link)
		epp_put_u64(&w, j->link);
	return w.err ? 0 : w.off;
}

bool epp_uuid_is_zero(const uint8_t uuid[16])
{
	for (int i = 0; i < 16; i++)
		if (uuid[i])
			return false;
	return true;
}

/* Limits of a group's shape; a JOIN outside them is refused. */

#define EPP_MAX_EXPERTS 4096
#define EPP_MAX_HIDDEN 65536
#define EPP_MAX_TOKENS 65536
#define EPP_MAX_TIMEOUT_MS 3600000u
/* a one-node GPU group's per-expert counts fit between the host barrier
 * words (64 local ranks at most) and the group slot */
_Static_assert(EPP_MAX_EXPERTS * 4 <= EPP_CTL_PE_MAX &&
		       EPP_CTL_PE >= EPP_CTL_HB + 64 * EPP_CTL_HB_STRIDE &&
		       EPP_CTL_PE + EPP_CTL_PE_MAX <= EPP_CTL_GROUP_SLOT,
	       "the control page's per-expert counts");

int epp_join_decode(const uint8_t *p, size_t len, struct epp_join *j,
		    char *err, size_t errlen)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	epp_get_str(&r, j->name, sizeof(j->name));
	j->world_size = epp_get_u32(&r);
	j->ranks_per_node = epp_get_u32(&r);
	j->rank = epp_get_u32(&r);
	j->num_experts = epp_get_u32(&r);
	j->hidden = epp_get_u32(&r);
	j->max_tokens = epp_get_u32(&r);
	j->topk = epp_get_u32(&r);
	j->dtype = epp_get_u32(&r);
	j->timeout_ms = epp_get_u32(&r);
	memset(j->gpu_uuid, 0, sizeof(j->gpu_uuid));
	j->rank_flags = 0;
	j->recv_areas = 1;
	j->link = 0;
	j->num_nodes = 0;
	j->nodes = NULL;
	j->recv_rows = 0;
	j->secret_len = 0;
	j->secret = NULL;
	size_t tail = r.len >= r.off ? r.len - r.off : 0;
	if (tail == 20 || tail == 24) {
		for (int i = 0; i < 16; i++)
			j->gpu_uuid[i] = epp_get_u8(&r);
		j->rank_flags = epp_get_u32(&r);
		if (epp_uuid_is_zero(j->gpu_uuid) ||
		    (j->rank_flags & ~EPP_RANK_MPS))
			r.err = true; /* a host rank sends no UUID at all */
	}
	if (tail == 4 || tail == 24) {
		j->recv_areas = epp_get_u32(&r);
		if (j->recv_areas < 2)
			r.err = true; /* one area is sent as none */
	}
	if (epp_rd_end(&r)) {
		ERRF("malformed join payload (%zu bytes)", len);
		return EP_EPROTO;
	}
	if (!epp_group_name_valid(j->name)) {
		ERRF("group name must be 1..%d characters of [A-Za-z0-9_.:-]",
		     EP_GROUP_NAME_MAX);
		return EP_EINVAL;
	}
	if (j->world_size == 0 || j->world_size > EPP_MAX_WORLD) {
		ERRF("world_size %u out of range 1..%u", j->world_size,
		     EPP_MAX_WORLD);
		return EP_EINVAL;
	}
	if (j->ranks_per_node == 0 || j->world_size % j->ranks_per_node) {
		ERRF("ranks_per_node %u does not divide world_size %u",
		     j->ranks_per_node, j->world_size);
		return EP_EINVAL;
	}
	if (j->rank >= j->world_size) {
		ERRF("rank %u out of range for world_size %u", j->rank,
		     j->world_size);
		return EP_EINVAL;
	}
	if (j->num_experts == 0 || j->num_experts > EPP_MAX_EXPERTS ||
	    j->num_experts % j->world_size) {
		ERRF("num_experts %u must be a positive multiple of world_size "
		     "%u, at most %u",
		     j->num_experts, j->world_size, EPP_MAX_EXPERTS);
		return EP_EINVAL;
	}
	if (j->hidden == 0 || j->hidden % 128 || j->hidden > EPP_MAX_HIDDEN) {
		ERRF("hidden %u must be a positive multiple of 128, at most %u",
		     j->hidden, EPP_MAX_HIDDEN);
		return EP_EINVAL;
	}
	if (j->max_tokens > EPP_MAX_TOKENS) {
		ERRF("max_tokens_per_rank %u above %u", j->max_tokens,
		     EPP_MAX_TOKENS);
		return EP_EINVAL;
	}
	if (j->topk == 0 || j->topk > EPP_MAX_TOPK) {
		ERRF("topk %u out of range 1..%u", j->topk, EPP_MAX_TOPK);
		return EP_EINVAL;
	}
	if (j->dtype != EP_DTYPE_BF16 && j->dtype != EP_DTYPE_FP8) {
		ERRF("unknown dtype %u", j->dtype);
		return EP_EINVAL;
	}
	if (j->recv_areas > EPP_MAX_RECV_AREAS) {
		ERRF("recv_areas %u above %u", j->recv_areas,
		     EPP_MAX_RECV_AREAS);
		return EP_EINVAL;
	}
	if (j->recv_areas > 1 && j->world_size != j->ranks_per_node) {
		ERRF("recv_areas %u: a group across nodes has one area",
		     j->recv_areas);
		return EP_EUNSUPPORTED;
	}
	if (j->timeout_ms > EPP_MAX_TIMEOUT_MS) {
		ERRF("timeout_ms %u above %u", j->timeout_ms,
		     EPP_MAX_TIMEOUT_MS);
		return EP_EINVAL;
	}
	return 0;
}

/* The node list heading a JOIN with EPP_F_JOIN_NODES: u32 n, u32 bytes,
 * then n NUL-terminated names filling those bytes exactly. Returns the
 * list's length in the payload, or 0 (err says why); j->nodes points into
 * p. */
static size_t join_nodes_decode(const uint8_t *p, size_t len,
				struct epp_join *j, char *err, size_t errlen)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	const uint32_t n = epp_get_u32(&r), nb = epp_get_u32(&r);
	if (r.err || n == 0 || n > EPP_MAX_WORLD || nb > len - r.off ||
	    nb < 2 * (size_t)n || p[r.off + nb - 1]) {
		ERRF("malformed join payload: a node list of %u names in %u "
		     "bytes (1..%u names)",
		     n, nb, EPP_MAX_WORLD);
		return 0;
	}
	const char *s = (const char *)p + r.off, *end = s + nb;
	for (uint32_t i = 0; i < n; i++) {
		const char *z = memchr(s, 0, (size_t)(end - s));
		if (!z || !epp_node_entry_valid(s)) {
			ERRF("node %u of the group's list is not a node name "
			     "(1..%d of [A-Za-z0-9_.-]) or name@host:port",
			     i, EPP_NODE_NAME_MAX);
			return 0;
		}
		s = z + 1;
	}
	if (s != end) {
		ERRF("malformed join payload: bytes after the node list's %u "
		     "names", n);
		return 0;
	}
	j->num_nodes = n;
	j->nodes = (const char *)p + r.off;
	return r.off + nb;
}

static int join_decode_link(const uint8_t *p, size_t len, uint16_t flags,
			    struct epp_join *j, char *err, size_t errlen);

int epp_join_decode_flags(const uint8_t *p, size_t len, uint16_t flags,
			  struct epp_join *j, char *err, size_t errlen)
{
	uint32_t num_nodes = 0, recv_rows = 0;
	const char *nodes = NULL;
	if (flags & EPP_F_JOIN_RECV) {
		struct epp_rd r;
		epp_rd_init(&r, p, len);
		recv_rows = epp_get_u32(&r);
		if (r.err || !recv_rows) {
			ERRF("malformed join payload: recv_rows %u (1 or more)",
			     recv_rows);
			return EP_EPROTO;
		}
		p += 4;
		len -= 4;
	}
	uint32_t secret_len = 0;
	const uint8_t *secret = NULL;
	if (flags & EPP_F_JOIN_SECRET) {
		struct epp_rd r;
		epp_rd_init(&r, p, len);
		secret_len = epp_get_u16(&r);
		if (r.err || !secret_len || secret_len > EPP_SECRET_MAX ||
		    len - 2 < secret_len) {
			ERRF("malformed join payload: a job secret of %u bytes "
			     "(1..%d)",
			     secret_len, EPP_SECRET_MAX);
			return EP_EPROTO;
		}
		secret = p + 2;
		p += 2 + secret_len;
		len -= 2 + secret_len;
	}
	if (flags & EPP_F_JOIN_NODES) {
		size_t off = join_nodes_decode(p, len, j, err, errlen);
		if (!off)
			return EP_EPROTO;
		num_nodes = j->num_nodes;
		nodes = j->nodes;
		p += off;
		len -= off;
	}
	int rc = join_decode_link(p, len, flags, j, err, errlen);
	if (rc)
		return rc;
	j->num_nodes = num_nodes;
	j->nodes = nodes;
	j->recv_rows = recv_rows;
	j->secret_len = secret_len;
	j->secret = secret;
	const uint64_t most = (uint64_t)j->world_size * j->max_tokens;
	if (recv_rows > most) {
		ERRF("recv_rows %u is above world_size x max_tokens_per_rank = "
		     "%llu, the most a rank can receive",
		     recv_rows, (unsigned long long)most);
		return EP_EINVAL;
	}
	return 0;
}

static int join_decode_link(const uint8_t *p, size_t len, uint16_t flags,
			    struct epp_join *j, char *err, size_t errlen)
{
	if (!(flags & EPP_F_JOIN_LINK))
		return epp_join_decode(p, len, j, err, errlen);
	if (len < 8) {
		ERRF("malformed join payload (%zu bytes): no group to link to",
		     len);
		return EP_EPROTO;
	}
	struct epp_rd r;
	epp_rd_init(&r, p + len - 8, 8);
	const uint64_t link = epp_get_u64(&r);
	if (epp_rd_end(&r) || !link) {
		ERRF("malformed join payload: the group to link to is 0");
		return EP_EPROTO;
	}
	int rc = epp_join_decode(p, len - 8, j, err, errlen);
	if (!rc)
		j->link = link;
	return rc;
}

size_t epp_join_ok_encode(const struct epp_join_ok *j, uint8_t *out, size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, out, cap);
	epp_put_u64(&w, j->group_id);
	epp_put_u32(&w, j->epoch);
	epp_put_u32(&w, j->node_index);
	epp_put_u64(&w, j->buf_size);
	epp_put_u32(&w, j->ready);
	if (j->dev_size)
		epp_put_u64(&w, j->dev_size);
	return w.err ? 0 : w.off;
}

int epp_join_ok_decode(const uint8_t *p, size_t len, struct epp_join_ok *j)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	j->group_id = epp_get_u64(&r);
	j->epoch = epp_get_u32(&r);
	j->node_index = epp_get_u32(&r);
	j->buf_size = epp_get_u64(&r);
	j->ready = epp_get_u32(&r);
	j->dev_size = r.len - r.off == 8 ? epp_get_u64(&r) : 0;
	return epp_rd_end(&r);
}

size_t epp_hello_ok_encode(const struct epp_hello_ok *h, uint8_t *out,
			   size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, out, cap);
	epp_put_u16(&w, h->major);
	epp_put_u16(&w, h->minor);
	epp_put_u64(&w, h->client_id);
	epp_put_str(&w, h->daemon_version);
	epp_put_str(&w, h->backend);
	if (h->node[0]) /* 1.21, to a client of 1.21 or later */
		epp_put_str(&w, h->node);
	return w.err ? 0 : w.off;
}

int epp_hello_ok_decode(const uint8_t *p, size_t len, struct epp_hello_ok *h)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	h->major = epp_get_u16(&r);
	h->minor = epp_get_u16(&r);
	h->client_id = epp_get_u64(&r);
	epp_get_str(&r, h->daemon_version, sizeof(h->daemon_version));
	epp_get_str(&r, h->backend, sizeof(h->backend));
	h->node[0] = 0;
	if (!r.err && r.off < r.len)
		epp_get_str(&r, h->node, sizeof(h->node));
	return epp_rd_end(&r);
}

size_t epp_error_encode(int code, const char *msg, uint8_t *out, size_t cap)
{
	struct epp_wr w;
	char m[EPP_ERRMSG_MAX];
	snprintf(m, sizeof(m), "%s", msg ? msg : "");
	epp_wr_init(&w, out, cap);
	epp_put_u32(&w, (uint32_t)code);
	epp_put_str(&w, m);
	return w.err ? 0 : w.off;
}

int epp_error_decode(const uint8_t *p, size_t len, int *code, char *msg,
		     size_t cap)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	*code = (int)epp_get_u32(&r);
	epp_get_str(&r, msg, cap);
	if (*code >= 0)
		return EP_EPROTO;
	return epp_rd_end(&r);
}

static void put_handle(struct epp_wr *w, const struct epp_handle *h)
{
	epp_put_u64(w, h->group_id);
	epp_put_u32(w, h->epoch);
	epp_put_u64(w, h->seq);
}

static void get_handle(struct epp_rd *r, struct epp_handle *h)
{
	h->group_id = epp_get_u64(r);
	h->epoch = epp_get_u32(r);
	h->seq = epp_get_u64(r);
}

size_t epp_dispatch_encode(const struct epp_dispatch *d, uint8_t *out,
			   size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, out, cap);
	epp_put_u64(&w, d->group_id);
	epp_put_u32(&w, d->num_tokens);
	epp_put_u32(&w, d->hidden);
	epp_put_u32(&w, d->dtype);
	epp_put_u32(&w, d->topk);
	epp_put_u32(&w, d->flags);
	put_handle(&w, &d->handle);
	if (d->flags & EPP_DISPATCH_XREG) {
		epp_put_u32(&w, d->reg);
		epp_put_u64(&w, d->reg_off);
	}
	return w.err ? 0 : w.off;
}

int epp_dispatch_decode(const uint8_t *p, size_t len, struct epp_dispatch *d)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	d->group_id = epp_get_u64(&r);
	d->num_tokens = epp_get_u32(&r);
	d->hidden = epp_get_u32(&r);
	d->dtype = epp_get_u32(&r);
	d->topk = epp_get_u32(&r);
	d->flags = epp_get_u32(&r);
	get_handle(&r, &d->handle);
	d->reg = 0;
	d->reg_off = 0;
	if (d->flags & EPP_DISPATCH_XREG) {
		d->reg = epp_get_u32(&r);
		d->reg_off = epp_get_u64(&r);
	}
	return epp_rd_end(&r);
}

size_t epp_dispatch_ok_encode(const struct epp_dispatch_ok *d, uint8_t *out,
			      size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, out, cap);
	put_handle(&w, &d->handle);
	epp_put_u32(&w, d->num_recv);
	return w.err ? 0 : w.off;
}

int epp_dispatch_ok_decode(const uint8_t *p, size_t len,
			   struct epp_dispatch_ok *d)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	get_handle(&r, &d->handle);
	d->num_recv = epp_get_u32(&r);
	return epp_rd_end(&r);
}

size_t epp_combine_encode(const struct epp_combine *c, uint8_t *out,
			  size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, out, cap);
	epp_put_u64(&w, c->group_id);
	put_handle(&w, &c->handle);
	epp_put_u32(&w, c->num_rows);
	epp_put_u32(&w, c->hidden);
	epp_put_u32(&w, c->flags);
	if (c->flags & EPP_COMBINE_YREG) {
		epp_put_u32(&w, c->reg);
		epp_put_u64(&w, c->reg_off);
	}
	if (c->flags & EPP_COMBINE_OUTREG) {
		epp_put_u32(&w, c->out_reg);
		epp_put_u32(&w, c->out_rows);
		epp_put_u64(&w, c->out_off);
	}
	return w.err ? 0 : w.off;
}

int epp_combine_decode(const uint8_t *p, size_t len, struct epp_combine *c)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	c->group_id = epp_get_u64(&r);
	get_handle(&r, &c->handle);
	c->num_rows = epp_get_u32(&r);
	c->hidden = epp_get_u32(&r);
	c->flags = epp_get_u32(&r);
	c->reg = 0;
	c->reg_off = 0;
	if (c->flags & EPP_COMBINE_YREG) {
		c->reg = epp_get_u32(&r);
		c->reg_off = epp_get_u64(&r);
	}
	c->out_reg = c->out_rows = 0;
	c->out_off = 0;
	if (c->flags & EPP_COMBINE_OUTREG) {
		c->out_reg = epp_get_u32(&r);
		c->out_rows = epp_get_u32(&r);
		c->out_off = epp_get_u64(&r);
	}
	return epp_rd_end(&r);
}

size_t epp_mem_reg_encode(const struct epp_mem_reg *m, uint8_t *out,
			  size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, out, cap);
	if (m->nchunks > EPP_MAX_REG_CHUNKS)
		return 0;
	epp_put_u64(&w, m->group_id);
	epp_put_u32(&w, m->nchunks);
	for (uint32_t i = 0; i < m->nchunks; i++)
		epp_put_u64(&w, m->chunk[i]);
	return w.err ? 0 : w.off;
}

int epp_mem_reg_decode(const uint8_t *p, size_t len, struct epp_mem_reg *m)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	m->group_id = epp_get_u64(&r);
	m->nchunks = epp_get_u32(&r);
	if (m->nchunks > EPP_MAX_REG_CHUNKS)
		return EP_EPROTO;
	for (uint32_t i = 0; i < m->nchunks; i++)
		m->chunk[i] = epp_get_u64(&r);
	return epp_rd_end(&r);
}

size_t epp_mem_reg_ok_encode(const struct epp_mem_reg_ok *m, uint8_t *out,
			     size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, out, cap);
	epp_put_u32(&w, m->reg);
	epp_put_u64(&w, m->bytes);
	return w.err ? 0 : w.off;
}

int epp_mem_reg_ok_decode(const uint8_t *p, size_t len,
			  struct epp_mem_reg_ok *m)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	m->reg = epp_get_u32(&r);
	m->bytes = epp_get_u64(&r);
	return epp_rd_end(&r);
}

size_t epp_mem_dereg_encode(const struct epp_mem_dereg *m, uint8_t *out,
			    size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, out, cap);
	epp_put_u64(&w, m->group_id);
	epp_put_u32(&w, m->reg);
	return w.err ? 0 : w.off;
}

int epp_mem_dereg_decode(const uint8_t *p, size_t len,
			 struct epp_mem_dereg *m)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	m->group_id = epp_get_u64(&r);
	m->reg = epp_get_u32(&r);
	return epp_rd_end(&r);
}

size_t epp_release_encode(const struct epp_release *rl, uint8_t *out,
			  size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, out, cap);
	epp_put_u64(&w, rl->group_id);
	put_handle(&w, &rl->handle);
	return w.err ? 0 : w.off;
}

int epp_release_decode(const uint8_t *p, size_t len, struct epp_release *rl)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	rl->group_id = epp_get_u64(&r);
	get_handle(&r, &rl->handle);
	return epp_rd_end(&r);
}

size_t epp_ll_map_encode(const struct epp_ll_map *m, uint8_t *out,
			 size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, out, cap);
	epp_put_u64(&w, m->group_id);
	epp_put_u32(&w, m->local);
	return w.err ? 0 : w.off;
}

int epp_ll_map_decode(const uint8_t *p, size_t len, struct epp_ll_map *m)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	m->group_id = epp_get_u64(&r);
	m->local = epp_get_u32(&r);
	return epp_rd_end(&r);
}

size_t epp_ll_map_ok_encode(const struct epp_ll_map_ok *m, uint8_t *out,
			    size_t cap)
{
	struct epp_wr w;
	epp_wr_init(&w, out, cap);
	epp_put_u64(&w, m->size);
	epp_put_u32(&w, m->local);
	epp_put_u32(&w, m->gpu);
	return w.err ? 0 : w.off;
}

int epp_ll_map_ok_decode(const uint8_t *p, size_t len,
			 struct epp_ll_map_ok *m)
{
	struct epp_rd r;
	epp_rd_init(&r, p, len);
	m->size = epp_get_u64(&r);
	m->local = epp_get_u32(&r);
	m->gpu = epp_get_u32(&r);
	return epp_rd_end(&r);
}

static uint64_t align_up(uint64_t v, uint64_t a)
{
	return (v + a - 1) / a * a;
}

int epp_buf_layout(const struct epp_join *s, struct epp_buf *b)
{
	const uint64_t T = s->max_tokens, H = s->hidden, K = s->topk;
	/* the rows a rank may receive: the job's recv_rows, else the worst
	 * case (every token of every rank to this one) */
	const uint64_t R = s->recv_rows ? s->recv_rows
					: (uint64_t)s->world_size * T;
	uint64_t sizes[EPP_BUF_NFIELDS];
	if (s->ranks_per_node >= EPP_BUF_HEADER / EPP_CTL_SLOT)
		return EP_ETOOBIG;
	b->elt = s->dtype == EP_DTYPE_FP8 ? 1 : 2;
	b->nscales = s->dtype == EP_DTYPE_FP8 ? s->hidden / 128 : 0;
	b->max_tokens = s->max_tokens;
	b->max_recv = R;
	sizes[EPP_BUF_X] = T * H * b->elt;
	sizes[EPP_BUF_X_SCALES] = T * b->nscales * 4;
	sizes[EPP_BUF_TOPK_IDX] = T * K * 8;
	sizes[EPP_BUF_TOPK_WEIGHTS] = T * K * 4;
	b->recv_areas = s->recv_areas > 1 ? s->recv_areas : 1;
	b->recv_area_bytes = R * H * b->elt;
	sizes[EPP_BUF_RECV_X] = b->recv_area_bytes * b->recv_areas;
	sizes[EPP_BUF_RECV_SCALES] = R * b->nscales * 4;
	sizes[EPP_BUF_RECV_TOPK_IDX] = R * K * 8;
	sizes[EPP_BUF_RECV_TOPK_WEIGHTS] = R * K * 4;
	sizes[EPP_BUF_RECV_SRC] = R * 2 * 4;
	sizes[EPP_BUF_RECV_PER_EXPERT] =
		(uint64_t)(s->num_experts / s->world_size) * 4;
	sizes[EPP_BUF_COMBINE_Y] = R * H * 2;
	sizes[EPP_BUF_COMBINE_BIAS] = T * H * 2;
	sizes[EPP_BUF_COMBINED] = T * H * 2;
	sizes[EPP_BUF_COMBINE_W] = R * K * 4;
	sizes[EPP_BUF_COMBINED_W] = T * K * 4;
	sizes[EPP_BUF_RANK_PREFIX] =
		(uint64_t)s->world_size * s->world_size * 4;
	sizes[EPP_BUF_COMBINE_BIAS2] = T * H * 2;
	uint64_t off = 0;
	for (int i = 0; i < EPP_BUF_NFIELDS; i++) {
		b->off[i] = off;
		off = align_up(off + sizes[i], 4096);
	}
	b->rank_stride = align_up(off, 1u << 21);
	b->total = EPP_BUF_HEADER + b->rank_stride * s->ranks_per_node;
	return b->total > EPP_BUF_MAX ? EP_ETOOBIG : 0;
}
