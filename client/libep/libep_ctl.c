/* SPDX-License-Identifier: MIT */
/*
 * libep on GPU ranks, the part every build has: the control page (host
 * memory shared with the daemon), which carries completions and
 * asynchronous errors, and the waits on it. The stream-ordered operations
 * themselves are in libep_cuda.c (built with CUDA) or libep_nocuda.c.
 */
#include "libep_int.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

const uint8_t *ep__ctl_slot(const ep_group_t *g)
{
	uint32_t l = g->cfg.rank % g->cfg.ranks_per_node;
	return (const uint8_t *)g->buf + (size_t)l * EPP_CTL_SLOT;
}

int ep__ctl_error(const ep_group_t *g)
{
	return __atomic_load_n((const int32_t *)(ep__ctl_slot(g) +
						 EPP_CTL_ERR_CODE),
			       __ATOMIC_ACQUIRE);
}

uint64_t ep__ctl_completed(const ep_group_t *g)
{
	return __atomic_load_n((const uint64_t *)(ep__ctl_slot(g) +
						  EPP_CTL_COMPLETED),
			       __ATOMIC_ACQUIRE);
}

/* Why op error (code, pos) happened, into errmsg: after "op N changed
 * nothing: ". */
static int op_cause(ep_group_t *g, int code, uint64_t pos)
{
	if (code == EP_ETOOBIG && pos != UINT64_MAX &&
	    (pos & EPP_OP_ERR_RECV)) {
		/* (flags |) rank << 32 | rows it would receive */
		struct epp_buf lay;
		(void)epp_buf_layout(&g->cfg, &lay);
		return ep__fail(code,
				"rank %llu would receive %u rows, above the "
				"group's receive capacity of %llu rows a rank "
				"(recv_rows at join)",
				(unsigned long long)((pos >> 32) & 0xfffffffull),
				(uint32_t)pos,
				(unsigned long long)lay.max_recv);
	}
	if (code == EP_ETOOBIG && pos != UINT64_MAX) {
		/* rank << 32 | its tokens, UINT32_MAX where a staged op's
		 * rank asked on another node */
		char n[48] = "more tokens than";
		if ((uint32_t)pos != UINT32_MAX)
			snprintf(n, sizeof(n), "%u tokens, above",
				 (uint32_t)pos);
		return ep__fail(code,
				"rank %llu dispatched %s the group's maximum "
				"of %u per rank",
				(unsigned long long)((pos >> 32) & 0x7fffffffull),
				n, g->cfg.max_tokens);
	}
	if (code == EP_ETOOBIG) /* staged: the daemon's log names the rank */
		return ep__fail(code,
				"a rank dispatched more tokens than the group's "
				"maximum of %u per rank (the daemons' logs name "
				"it)",
				g->cfg.max_tokens);
	if (code == EP_ETIMEDOUT) /* the group fails with it as well */
		return ep__fail(code,
				"the daemon's kernel waited the group's timeout "
				"for local rank %llu's stream to reach it",
				(unsigned long long)(pos & 0xffffffffull));
	if (pos == UINT64_MAX) /* found on another node: in its log */
		return ep__fail(code,
				"an expert index out of range (the daemons' "
				"logs name it)");
	return ep__fail(code,
			"expert index out of range at rank %llu, token %llu, "
			"k %llu",
			(unsigned long long)(pos >> 48),
			(unsigned long long)((pos >> 16) & 0xffffffffull),
			(unsigned long long)(pos & 0xffff));
}

/* An op that failed alone (the group goes on), reported once; where it
 * named a failed dispatch's handle, with EP_ESTALE, or (cause) with that
 * dispatch's error. */
static int op_error(ep_group_t *g, bool cause)
{
	if (!g->buf || g->cuda_device < 0)
		return 0;
	const uint8_t *sl = ep__ctl_slot(g);
	uint64_t seq = __atomic_load_n((const uint64_t *)(sl +
							  EPP_CTL_OP_ERR_SEQ),
				       __ATOMIC_ACQUIRE);
	if (seq <= g->op_err_seen || seq > g->sent)
		return 0;
	g->op_err_seen = seq;
	if (seq == g->toobig_seq)
		return 0; /* this rank's own, told at once */
	const int code = *(const int32_t *)(sl + EPP_CTL_OP_ERR_CODE);
	const uint64_t pos = *(const uint64_t *)(sl + EPP_CTL_OP_ERR_POS);
	char why[200];
	if (code == EP_ESTALE && pos != UINT64_MAX &&
	    (pos & EPP_OP_ERR_HANDLE)) {
		/* a combine or cached dispatch: the word is its handle's
		 * dispatch's, with that dispatch's flags */
		const uint64_t dw = pos & ~EPP_OP_ERR_HANDLE;
		const int dc = dw & EPP_OP_ERR_TOOBIG ? EP_ETOOBIG
			       : dw & EPP_OP_ERR_WAIT ? EP_ETIMEDOUT
						      : EP_EEXPERT;
		/* a staged dispatch's bad index, found on another node */
		(void)op_cause(g, dc, dw == EPP_OP_ERR_NOPOS ? UINT64_MAX : dw);
		snprintf(why, sizeof(why), "%s", ep_errmsg());
		return ep__fail(cause ? dc : code,
				"op %llu changed nothing: the dispatch that "
				"made its handle failed (%s: %s)",
				(unsigned long long)seq, ep_strerror(dc), why);
	}
	(void)op_cause(g, code, pos);
	snprintf(why, sizeof(why), "%s", ep_errmsg());
	return ep__fail(code, "op %llu changed nothing: %s",
			(unsigned long long)seq, why);
}

int ep__op_error(ep_group_t *g)
{
	return op_error(g, false);
}

int ep__op_error_cause(ep_group_t *g)
{
	return op_error(g, true);
}

/* The group's failure, 0 if it goes on. An op of it that failed alone
 * and is not reported yet comes first, once, as the cause (a dispatch
 * refused for a bad expert index, then a peer lost before the rank looked):
 * the error a pipeline's first failure gave. Later calls give the group's
 * error. */
int ep__group_failed(ep_group_t *g)
{
	const int c = g->buf ? ep__ctl_error(g) : 0;
	if (!c)
		return 0;
	const char *gm = (const char *)ep__ctl_slot(g) + EPP_CTL_ERR_MSG;
	const int op = ep__op_error(g);
	if (!op)
		return ep__fail(c, "%.*s", (int)EPP_CTL_MSG_MAX, gm);
	char om[256];
	snprintf(om, sizeof(om), "%s", ep_errmsg());
	return ep__fail(op, "%s; the group then failed (%s): %.*s", om,
			ep_strerror(c), (int)EPP_CTL_MSG_MAX, gm);
}

int ep_group_error(ep_group_t *g)
{
	if (!g)
		return ep__fail(EP_EINVAL, "NULL group");
	int e = ep__group_failed(g);
	if (e)
		return e;
	if (g->conn->async_err)
		return g->conn->async_err;
	int ge = g->gpu ? g->gpu->graph_error(g) : 0;
	return ge ? ge : ep__op_error(g);
}

/* The kernel stores 32-bit sequence numbers. */
uint64_t ep__completed_full(const ep_group_t *g)
{
	uint64_t v = ep__ctl_completed(g) & 0xffffffffull;
	/* a replayed graph's host node advances sent on CUDA's thread */
	uint64_t sent = __atomic_load_n(&g->sent, __ATOMIC_ACQUIRE);
	uint64_t full = (sent & ~0xffffffffull) | v;
	if (full > sent)
		full -= 1ull << 32;
	return full;
}

uint64_t ep__inflight(const ep_group_t *g)
{
	return __atomic_load_n(&g->sent, __ATOMIC_ACQUIRE) -
	       ep__completed_full(g);
}

/* Has dispatch k published its count (1.15: once the routing is known,
 * before its rows land)? 0: no dispatch to look for. */
static bool count_out(const ep_group_t *g, uint64_t k)
{
	if (!k)
		return false;
	uint64_t seq = __atomic_load_n((const uint64_t *)(ep__ctl_slot(g) +
							  EPP_CTL_RECV_SEQ),
				       __ATOMIC_ACQUIRE);
	return (uint32_t)seq == (uint32_t)k; /* the kernel's 32 bits */
}

static uint64_t now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

/* Has the daemon closed this connection (it died or stopped)? Its
 * memory stays mapped, but nothing will write the group's words again. */
static bool daemon_gone(const ep_conn_t *c)
{
	struct pollfd p = {.fd = c->fd, .events = POLLRDHUP};
	return poll(&p, 1, 0) == 1 && p.revents & (POLLRDHUP | POLLHUP);
}

/* Until at most `behind` ops are incomplete or dispatch k's count is out;
 * spinning for the first 100 us (a count comes tens of us after the last
 * rank rang), then in 20 us sleeps, looking every millisecond or so
 * whether the daemon is still there. */
static int wait_for_ms(ep_group_t *g, uint64_t behind, uint64_t k,
		       int timeout_ms)
{
	const uint64_t t0 = now_us();
	uint64_t end = t0 / 1000 + (uint64_t)timeout_ms;
	unsigned naps = 0;
	while (ep__inflight(g) > behind && !count_out(g, k)) {
		int e = ep__ctl_error(g);
		if (e) {
			if (getenv("EP_DEBUG"))
				fprintf(stderr,
					"libep: rank %u: sent %llu completed "
					"%llu (raw %llu)\n",
					g->cfg.rank,
					(unsigned long long)g->sent,
					(unsigned long long)ep__completed_full(g),
					(unsigned long long)ep__ctl_completed(g));
			/* the daemon's word for it (no lock taken: the graph
			 * code calls this with its own held) */
			return ep__fail(e, "%.*s", (int)EPP_CTL_MSG_MAX,
					(const char *)ep__ctl_slot(g) +
						EPP_CTL_ERR_MSG);
		}
		uint64_t t = now_us();
		if (t / 1000 > end)
			return ep__fail(EP_ETIMEDOUT,
					"%llu stream-ordered ops still not "
					"complete",
					(unsigned long long)ep__inflight(g));
		if (t - t0 > 100) {
			if (++naps % 50 == 0 && daemon_gone(g->conn))
				return ep__fail(EP_ECONNRESET,
						"epd closed the connection with "
						"%llu stream-ordered ops not "
						"complete",
						(unsigned long long)ep__inflight(
							g));
			usleep(20);
		}
	}
	return 0;
}

static int wait_for(ep_group_t *g, uint64_t behind, uint64_t k)
{
	return wait_for_ms(g, behind, k, ep__group_op_timeout(g));
}

int ep__wait_until(ep_group_t *g, uint64_t behind)
{
	return wait_for(g, behind, 0);
}

int ep__wait_drained(ep_group_t *g, int timeout_ms)
{
	return wait_for_ms(g, 0, 0, timeout_ms);
}

int ep__wait_count(ep_group_t *g, uint64_t k)
{
	if (g->conn->minor < 15) /* an older daemon: once it completed */
		return wait_for(g, g->sent - k, 0);
	return wait_for(g, g->sent - k, k);
}

/* Wait until at most `behind` ops are incomplete. Ops that completed are
 * good even if the group failed after them (a rank leaving once its work
 * is done): the error belongs to the ops that did not complete. */
int ep__wait_completed(ep_group_t *g, uint64_t behind)
{
	/* the group's error comes with the daemon's message, which may be
	 * EP_ETIMEDOUT too (a rank never arrived): never told apart by code */
	return ep__wait_until(g, behind);
}

int ep_group_sync(ep_group_t *g)
{
	if (!g)
		return ep__fail(EP_EINVAL, "NULL group");
	if (g->cuda_device < 0)
		return 0;
	int rc = ep__wait_completed(g, 0);
	if (rc && ep__ctl_error(g))
		return ep__group_failed(g); /* its cause first */
	return rc ? rc : ep__op_error(g);
}

int ep_dispatch_recv_expert_counts(ep_group_t *g, const ep_handle_t *h,
				   int32_t *counts, uint32_t n)
{
	if (!g || !h || !counts)
		return ep__fail(EP_EINVAL, "NULL argument");
	int rc = ep__check_handle(g, h);
	if (rc)
		return rc;
	const uint32_t per = g->cfg.num_experts / g->cfg.world_size;
	const uint32_t l = g->cfg.rank % g->cfg.ranks_per_node;
	if (n < per)
		return ep__fail(EP_EINVAL,
				"room for %u counts; this rank has %u experts",
				n, per);
	if (g->cuda_device < 0) {
		memcpy(counts,
		       (const uint8_t *)g->buf +
			       epp_buf_field(&g->layout, l,
					     EPP_BUF_RECV_PER_EXPERT),
		       (size_t)per * 4);
		return 0;
	}
	if (h->seq != g->last_dispatch || g->last_cached)
		return ep__fail(EP_EINVAL,
				"the counts per expert are known for the "
				"latest fresh dispatch alone (not a cached or "
				"captured one)");
	if (g->conn->minor < 15)
		return ep__fail(EP_EUNSUPPORTED,
				"the daemon (protocol 1.%u) publishes no counts "
				"per expert: 1.15 or later",
				g->conn->minor);
	if ((rc = ep__wait_count(g, g->last_dispatch)))
		return rc;
	if ((rc = ep__op_error(g)))
		return rc;
	memcpy(counts,
	       (const uint8_t *)g->buf + EPP_CTL_PE + (size_t)l * per * 4,
	       (size_t)per * 4);
	return 0;
}

uint64_t ep_dispatch_recv_count_device(const ep_group_t *g)
{
	return g && g->dev_ptr ? g->dev_ptr + EPP_DEV_RECV_COUNT : 0;
}

uint64_t ep_group_device_region(const ep_group_t *g, size_t *size)
{
	if (size)
		*size = g ? g->dev_size : 0;
	return g ? g->dev_ptr : 0;
}
