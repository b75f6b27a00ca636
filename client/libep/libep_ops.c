/* SPDX-License-Identifier: MIT */
/* libep: buffers, layout, dispatch and combine. */
#include "libep_int.h"

#include <stdlib.h>
#include <string.h>

#include "ek.h"

/* A field of this rank's buffers: in the shared host buffer, or for a GPU
 * rank a device address in its region (after the control words). */
static uint8_t *region(ep_group_t *g, int field)
{
	if (g->dev_ptr)
		return (uint8_t *)(uintptr_t)(g->dev_ptr + EP__DEV_DATA +
					      g->layout.off[field]);
	uint32_t l = g->cfg.rank % g->cfg.ranks_per_node;
	return (uint8_t *)g->buf + epp_buf_field(&g->layout, l, field);
}

/* ABI 1's struct ep_buffers ends with combine_bias2: a caller's struct is
 * at least that, and what was appended later is written only to callers
 * compiled with it. */
#define BUFFERS_ABI1_SIZE                                                   \
	(offsetof(struct ep_buffers, combine_bias2) +                       \
	 sizeof(((struct ep_buffers *)0)->combine_bias2))

unsigned ep_abi_version(void)
{
	return EP_ABI_VERSION;
}

int ep_get_buffers_sized(ep_group_t *g, struct ep_buffers *out, size_t size)
{
	if (!g || !out)
		return ep__fail(EP_EINVAL, "NULL argument");
	if (size < BUFFERS_ABI1_SIZE)
		return ep__fail(EP_EINVAL,
				"struct ep_buffers of %zu bytes: ABI %u's is at "
				"least %zu (a program built against another "
				"ep.h?)",
				size, (unsigned)EP_ABI_VERSION,
				(size_t)BUFFERS_ABI1_SIZE);
	struct ep_buffers full, *b = &full;
	memset(&full, 0, sizeof full); /* padding too: callers may compare */
	b->x = region(g, EPP_BUF_X);
	b->x_scales = g->layout.nscales ? (float *)region(g, EPP_BUF_X_SCALES)
					: NULL;
	b->topk_idx = (int64_t *)region(g, EPP_BUF_TOPK_IDX);
	b->topk_weights = (float *)region(g, EPP_BUF_TOPK_WEIGHTS);
	b->recv_x = region(g, EPP_BUF_RECV_X);
	b->recv_x_scales = g->layout.nscales
				   ? (float *)region(g, EPP_BUF_RECV_SCALES)
				   : NULL;
	b->recv_topk_idx = (int64_t *)region(g, EPP_BUF_RECV_TOPK_IDX);
	b->recv_topk_weights = (float *)region(g, EPP_BUF_RECV_TOPK_WEIGHTS);
	b->recv_src = (int32_t *)region(g, EPP_BUF_RECV_SRC);
	b->num_recv_tokens_per_expert =
		(int32_t *)region(g, EPP_BUF_RECV_PER_EXPERT);
	b->combine_y = (uint16_t *)region(g, EPP_BUF_COMBINE_Y);
	b->combine_bias = (uint16_t *)region(g, EPP_BUF_COMBINE_BIAS);
	b->combined = (uint16_t *)region(g, EPP_BUF_COMBINED);
	b->combine_topk_weights = (float *)region(g, EPP_BUF_COMBINE_W);
	b->combined_topk_weights = (const float *)region(g, EPP_BUF_COMBINED_W);
	b->rank_prefix_matrix = (const int32_t *)region(g, EPP_BUF_RANK_PREFIX);
	b->combine_bias2 = (uint16_t *)region(g, EPP_BUF_COMBINE_BIAS2);
	b->max_tokens = g->layout.max_tokens;
	b->max_recv = g->layout.max_recv;
	if (size <= sizeof full) {
		memcpy(out, b, size);
	} else { /* a newer header's: what this library does not know, 0 */
		memcpy(out, b, sizeof full);
		memset((char *)out + sizeof full, 0, size - sizeof full);
	}
	return 0;
}

uint32_t ep_group_recv_areas(const ep_group_t *g)
{
	return g ? g->layout.recv_areas : 0;
}

const void *ep_recv_area(ep_group_t *g, uint32_t a)
{
	if (!g || a >= g->layout.recv_areas)
		return NULL;
	return region(g, EPP_BUF_RECV_X) +
	       (uint64_t)a * g->layout.recv_area_bytes;
}

static struct ek_shape shape_of(const ep_group_t *g)
{
	return (struct ek_shape){.world = g->cfg.world_size,
				 .num_experts = g->cfg.num_experts,
				 .hidden = g->cfg.hidden,
				 .topk = g->cfg.topk,
				 .elt = g->layout.elt,
				 .nscales = g->layout.nscales};
}

int ep_get_dispatch_layout(ep_group_t *g, const int64_t *topk_idx,
			   uint32_t num_tokens, int32_t *per_rank,
			   int32_t *per_expert, uint8_t *in_rank)
{
	if (!g || (num_tokens && !topk_idx) || !per_rank || !per_expert ||
	    (num_tokens && !in_rank))
		return ep__fail(EP_EINVAL, "NULL argument");
	struct ek_shape s = shape_of(g);
	char err[256];
	int rc = ek_validate_topk(&s, topk_idx, num_tokens, err, sizeof(err));
	if (rc)
		return ep__fail(rc, "%s", err);
	ek_layout(&s, topk_idx, num_tokens, per_rank, per_expert, in_rank);
	return 0;
}

int ep__check_handle(const ep_group_t *g, const ep_handle_t *h)
{
	if (h->group_id != g->id || h->epoch != g->epoch)
		return ep__fail(EP_ESTALE,
				"handle of group id %llu epoch %u used with "
				"group id %llu epoch %u",
				(unsigned long long)h->group_id, h->epoch,
				(unsigned long long)g->id, g->epoch);
	return 0;
}

int ep__dispatch_request(ep_group_t *g, uint32_t num_tokens, unsigned flags,
			 const ep_handle_t *cached, uint8_t *frame,
			 uint32_t *len)
{
	return ep__dispatch_request_reg(g, num_tokens, flags, cached, 0, 0,
					frame, len);
}

int ep__dispatch_request_reg(ep_group_t *g, uint32_t num_tokens,
			     unsigned flags, const ep_handle_t *cached,
			     uint32_t reg, uint64_t off, uint8_t *frame,
			     uint32_t *len)
{
	struct epp_dispatch dd, *d = &dd; /* filled, then encoded */
	if (flags & ~(EP_DISPATCH_WEIGHTS | EP_DISPATCH_AREA(~0u)))
		return ep__fail(EP_EINVAL, "unknown flags 0x%x", flags);
	uint32_t area = flags >> 24;
	if (area >= g->layout.recv_areas)
		return ep__fail(EP_EINVAL,
				"receive area %u: the group has %u", area,
				g->layout.recv_areas);
	/* Too many tokens: the request goes to the daemon all the same (a GPU
	 * rank's with its doorbell): the op then fails for every rank of the
	 * group at once (EP_ETOOBIG), changing nothing, instead of the others
	 * waiting for this one until the timeout. */
	*d = (struct epp_dispatch){.group_id = g->id,
				   .num_tokens = num_tokens,
				   .hidden = g->cfg.hidden,
				   .dtype = g->cfg.dtype,
				   .topk = g->cfg.topk,
				   .flags = (flags & EP_DISPATCH_WEIGHTS
						     ? EPP_DISPATCH_WEIGHTS
						     : 0) |
					    area << EPP_DISPATCH_AREA_SHIFT |
					    (reg ? EPP_DISPATCH_XREG : 0),
				   .reg = reg,
				   .reg_off = off};
	if (cached) {
		int rc = ep__check_handle(g, cached);
		if (rc)
			return rc;
		if (cached->num_tokens != num_tokens)
			return ep__fail(EP_ESHAPE,
					"cached dispatch of %u tokens with a "
					"handle of %u",
					num_tokens, cached->num_tokens);
		d->flags |= EPP_DISPATCH_CACHED;
		d->handle = (struct epp_handle){.group_id = cached->group_id,
						.epoch = cached->epoch,
						.seq = cached->seq};
	}
	*len = (uint32_t)epp_dispatch_encode(d, frame, 128);
	return 0;
}

int ep__combine_request(ep_group_t *g, const ep_handle_t *h, unsigned flags,
			uint8_t *frame, uint32_t *len)
{
	return ep__combine_request_reg(g, h, flags, NULL, NULL, frame, len);
}

int ep__combine_request_reg(ep_group_t *g, const ep_handle_t *h,
			    unsigned flags, const struct ep__place *in,
			    const struct ep__place *out, uint8_t *frame,
			    uint32_t *len)
{
	if (flags & ~(EP_COMBINE_BIAS | EP_COMBINE_BIAS2 | EP_COMBINE_WEIGHTS |
		      EP_COMBINE_TOPK_ORDER))
		return ep__fail(EP_EINVAL, "unknown flags 0x%x", flags);
	int rc = ep__check_handle(g, h);
	if (rc)
		return rc;
	struct epp_combine c = {.group_id = g->id,
				.handle = {.group_id = h->group_id,
					   .epoch = h->epoch,
					   .seq = h->seq},
				.num_rows = h->num_recv,
				.hidden = g->cfg.hidden,
				.flags = (flags & EP_COMBINE_BIAS
						  ? EPP_COMBINE_BIAS
						  : 0) |
					 (flags & EP_COMBINE_BIAS2
						  ? EPP_COMBINE_BIAS2
						  : 0) |
					 (flags & EP_COMBINE_WEIGHTS
						  ? EPP_COMBINE_WEIGHTS
						  : 0) |
					 (flags & EP_COMBINE_TOPK_ORDER
						  ? EPP_COMBINE_TOPK_ORDER
						  : 0) |
					 (in ? EPP_COMBINE_YREG : 0) |
					 (out ? EPP_COMBINE_OUTREG : 0)};
	if (in) {
		c.reg = in->reg;
		c.reg_off = in->off;
		c.num_rows = in->rows;
	}
	if (out) {
		c.out_reg = out->reg;
		c.out_off = out->off;
		c.out_rows = out->rows;
	}
	*len = (uint32_t)epp_combine_encode(&c, frame, 128);
	return 0;
}

int ep_dispatch_inplace(ep_group_t *g, uint32_t num_tokens, unsigned flags,
			const ep_handle_t *cached, ep_handle_t *handle)
{
	if (!g || !handle)
		return ep__fail(EP_EINVAL, "NULL argument");
	if (g->dev_ptr)
		return ep__fail(EP_EUNSUPPORTED,
				"a GPU rank dispatches on a stream "
				"(ep_dispatch_stream)");
	uint8_t buf[128], *rep;
	uint32_t n, rlen;
	int rc = ep__dispatch_request(g, num_tokens, flags, cached, buf, &n);
	if (rc)
		return rc;
	pthread_mutex_lock(&g->conn->mu);
	rc = ep__rpc(g->conn, EPP_DISPATCH, 0, buf, n, &rep, &rlen,
		     NULL, 0, ep__group_op_timeout(g));
	pthread_mutex_unlock(&g->conn->mu);
	if (rc)
		return rc;
	struct epp_dispatch_ok ok;
	rc = epp_dispatch_ok_decode(rep, rlen, &ok);
	free(rep);
	if (rc)
		return ep__fail(EP_EPROTO, "malformed dispatch reply");
	*handle = (ep_handle_t){.group_id = ok.handle.group_id,
				.seq = ok.handle.seq,
				.epoch = ok.handle.epoch,
				.num_tokens = num_tokens,
				.num_recv = ok.num_recv};
	return 0;
}

int ep_combine_inplace(ep_group_t *g, const ep_handle_t *h, unsigned flags)
{
	if (!g || !h)
		return ep__fail(EP_EINVAL, "NULL argument");
	if (g->dev_ptr)
		return ep__fail(EP_EUNSUPPORTED,
				"a GPU rank combines on a stream "
				"(ep_combine_stream)");
	uint8_t buf[128];
	uint32_t n;
	int rc = ep__combine_request(g, h, flags, buf, &n);
	if (rc)
		return rc;
	pthread_mutex_lock(&g->conn->mu);
	rc = ep__rpc(g->conn, EPP_COMBINE, 0, buf, n, NULL, NULL,
		     NULL, 0, ep__group_op_timeout(g));
	pthread_mutex_unlock(&g->conn->mu);
	return rc;
}

size_t ep__release_encode(const ep_group_t *g, const ep_handle_t *h,
			  uint8_t *buf, size_t cap)
{
	struct epp_release rl = {.group_id = g->id,
				 .handle = {.group_id = h->group_id,
					    .epoch = h->epoch,
					    .seq = h->seq}};
	return epp_release_encode(&rl, buf, cap);
}

int ep_handle_release(ep_group_t *g, const ep_handle_t *h)
{
	if (!g || !h)
		return ep__fail(EP_EINVAL, "NULL argument");
	if (h->seq & EP__GSEQ)
		return ep__fail(EP_EINVAL,
				"the handle of a dispatch captured into a CUDA "
				"graph: the graph releases each replay's "
				"routing itself");
	uint8_t buf[64];
	size_t n = ep__release_encode(g, h, buf, sizeof(buf));
	if (!n)
		return ep__fail(EP_EINVAL, "cannot encode the release");
	pthread_mutex_lock(&g->conn->mu);
	int rc = ep__rpc(g->conn, EPP_RELEASE, 0, buf, (uint32_t)n, NULL,
			 NULL, NULL, 0, EP__CTL_TIMEOUT_MS);
	pthread_mutex_unlock(&g->conn->mu);
	return rc;
}

int ep__copies_check(const struct ep_copy *c, unsigned n, unsigned *todo)
{
	if (!c || !n || n > EP_COPIES_MAX)
		return ep__fail(EP_EINVAL, "%u copies: 1..%d in one call", n,
				EP_COPIES_MAX);
	unsigned m = 0;
	for (unsigned i = 0; i < n; i++) {
		const uint32_t e = c[i].elt;
		if (e != 1 && e != 2 && e != 4 && e != 8 && e != 16)
			return ep__fail(EP_EINVAL,
					"copy %u: elements of %u bytes (1, 2, "
					"4, 8 or 16)",
					i, e);
		if (!c[i].count)
			continue;
		if (!c[i].dst || !c[i].src ||
		    ((uintptr_t)c[i].dst | (uintptr_t)c[i].src) % e)
			return ep__fail(EP_EINVAL,
					"copy %u: NULL or not aligned to its "
					"%u-byte elements",
					i, e);
		m++;
	}
	*todo = m;
	return 0;
}

int ep__release_async(ep_group_t *g, const ep_handle_t *h)
{
	uint8_t buf[64];
	size_t n = ep__release_encode(g, h, buf, sizeof(buf));
	if (!n)
		return ep__fail(EP_EINVAL, "cannot encode the release");
	struct epp_hdr hd;
	epp_hdr_init(&hd, EPP_RELEASE, 0);
	hd.flags = EPP_F_ASYNC;
	hd.length = (uint32_t)n;
	return ep__send(g->conn, &hd, buf, true);
}

int ep_handle_release_async(ep_group_t *g, const ep_handle_t *h)
{
	if (!g || !h)
		return ep__fail(EP_EINVAL, "NULL argument");
	if (g->cuda_device < 0) /* a host op may hold it: EP_EBUSY told */
		return ep_handle_release(g, h);
	if (h->seq & EP__GSEQ)
		return ep__fail(EP_EINVAL,
				"the handle of a dispatch captured into a CUDA "
				"graph: the graph releases each replay's "
				"routing itself");
	int rc = ep__check_handle(g, h);
	return rc ? rc : ep__release_async(g, h);
}

static int check_shape(const ep_group_t *g, uint32_t hidden,
		       ep_dtype_t dtype, uint32_t topk)
{
	if (topk == 0 || topk > 32)
		return ep__fail(EP_EINVAL, "topk %u out of range 1..32", topk);
	if (hidden != g->cfg.hidden || (uint32_t)dtype != g->cfg.dtype ||
	    topk != g->cfg.topk)
		return ep__fail(EP_ESHAPE,
				"hidden %u, dtype %u, top-%u do not match the "
				"group's hidden %u, dtype %u, top-%u",
				hidden, (unsigned)dtype, topk, g->cfg.hidden,
				g->cfg.dtype, g->cfg.topk);
	return 0;
}

int ep_dispatch(ep_group_t *g, const struct ep_dispatch_in *in,
		const ep_handle_t *cached, struct ep_dispatch_out *out,
		ep_handle_t *handle)
{
	if (!g || !in || !out || !handle)
		return ep__fail(EP_EINVAL, "NULL argument");
	if (g->dev_ptr)
		return ep__fail(EP_EUNSUPPORTED,
				"a GPU rank dispatches on a stream "
				"(ep_dispatch_stream)");
	int rc = check_shape(g, in->hidden, in->dtype, in->topk);
	if (rc)
		return rc;
	const uint32_t T = in->num_tokens, H = g->cfg.hidden,
		       K = g->cfg.topk;
	if (T > g->cfg.max_tokens) /* nothing copied: every rank learns */
		return ep_dispatch_inplace(g, T,
					   in->topk_weights ? EP_DISPATCH_WEIGHTS
							    : 0,
					   cached, handle);
	if (T && (!in->x || (g->layout.nscales && !in->x_scales) ||
		  (!cached && !in->topk_idx)))
		return ep__fail(EP_EINVAL, "x, x_scales (fp8) and topk_idx "
					   "are required");
	struct ep_buffers b;
	ep_get_buffers(g, &b);
	/* with no tokens the inputs may be NULL (memcpy's may not be) */
	if (T)
		memcpy(b.x, in->x, (size_t)T * H * g->layout.elt);
	if (T && g->layout.nscales)
		memcpy(b.x_scales, in->x_scales,
		       (size_t)T * g->layout.nscales * sizeof(float));
	if (T && !cached) {
		memcpy(b.topk_idx, in->topk_idx, (size_t)T * K * 8);
		if (in->topk_weights)
			memcpy(b.topk_weights, in->topk_weights,
			       (size_t)T * K * 4);
	}
	rc = ep_dispatch_inplace(g, T,
				 in->topk_weights ? EP_DISPATCH_WEIGHTS : 0,
				 cached, handle);
	if (rc)
		return rc;
	const uint64_t R = handle->num_recv;
	out->num_recv = handle->num_recv;
	if (R > out->capacity)
		return ep__fail(EP_ETOOBIG,
				"received %llu rows; the output holds %llu",
				(unsigned long long)R,
				(unsigned long long)out->capacity);
	if (out->recv_x)
		memcpy(out->recv_x, b.recv_x, R * H * g->layout.elt);
	if (out->recv_x_scales && g->layout.nscales)
		memcpy(out->recv_x_scales, b.recv_x_scales,
		       R * g->layout.nscales * sizeof(float));
	if (!cached) {
		if (out->recv_topk_idx)
			memcpy(out->recv_topk_idx, b.recv_topk_idx, R * K * 8);
		if (out->recv_topk_weights)
			memcpy(out->recv_topk_weights, b.recv_topk_weights,
			       R * K * 4);
		if (out->num_recv_tokens_per_expert)
			memcpy(out->num_recv_tokens_per_expert,
			       b.num_recv_tokens_per_expert,
			       (size_t)(g->cfg.num_experts /
					g->cfg.world_size) *
				       4);
	}
	return 0;
}

int ep_combine(ep_group_t *g, const ep_handle_t *h, const uint16_t *y,
	       uint32_t num_rows, uint32_t hidden, const uint16_t *bias,
	       uint16_t *out)
{
	struct ep_combine_in in = {.y = y, .num_rows = num_rows,
				   .hidden = hidden, .bias = bias};
	struct ep_combine_out o = {.out = out};
	return ep_combine_ex(g, h, &in, &o);
}

int ep_combine_ex(ep_group_t *g, const ep_handle_t *h,
		  const struct ep_combine_in *in, struct ep_combine_out *o)
{
	if (!g || !h || !in || !o)
		return ep__fail(EP_EINVAL, "NULL argument");
	const uint16_t *y = in->y, *bias = in->bias, *bias2 = in->bias2;
	const uint32_t num_rows = in->num_rows, hidden = in->hidden;
	uint16_t *out = o->out;
	const float *w = in->topk_weights;
	if ((num_rows && !y) || (h->num_tokens && !out))
		return ep__fail(EP_EINVAL, "NULL argument");
	bool cw = w || o->combined_topk_weights;
	if (cw && ((num_rows && !w) ||
		   (h->num_tokens && !o->combined_topk_weights)))
		return ep__fail(EP_EINVAL,
				"topk_weights and combined_topk_weights go "
				"together");
	if (g->dev_ptr)
		return ep__fail(EP_EUNSUPPORTED,
				"a GPU rank combines on a stream "
				"(ep_combine_stream)");
	if (hidden != g->cfg.hidden)
		return ep__fail(EP_ESHAPE, "hidden %u, the group's is %u",
				hidden, g->cfg.hidden);
	if (num_rows != h->num_recv)
		return ep__fail(EP_ESHAPE,
				"combine of %u rows; the handle received %u",
				num_rows, h->num_recv);
	int rc = ep__check_handle(g, h);
	if (rc)
		return rc;
	struct ep_buffers b;
	ep_get_buffers(g, &b);
	const size_t H = hidden;
	/* no rows or no tokens: y, bias and out may be NULL */
	if (num_rows)
		memcpy(b.combine_y, y, (size_t)num_rows * H * 2);
	if (bias && h->num_tokens)
		memcpy(b.combine_bias, bias, (size_t)h->num_tokens * H * 2);
	if (bias2 && h->num_tokens)
		memcpy(b.combine_bias2, bias2, (size_t)h->num_tokens * H * 2);
	const size_t K = g->cfg.topk;
	if (cw && num_rows)
		memcpy(b.combine_topk_weights, w, (size_t)num_rows * K * 4);
	rc = ep_combine_inplace(g, h,
				(bias ? EP_COMBINE_BIAS : 0) |
					(bias2 ? EP_COMBINE_BIAS2 : 0) |
					(cw ? EP_COMBINE_WEIGHTS : 0));
	if (rc)
		return rc;
	if (h->num_tokens)
		memcpy(out, b.combined, (size_t)h->num_tokens * H * 2);
	if (cw && h->num_tokens)
		memcpy(o->combined_topk_weights, b.combined_topk_weights,
		       (size_t)h->num_tokens * K * 4);
	return 0;
}
