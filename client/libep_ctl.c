/* SPDX-License-Identifier: MIT */
/*
 * libep on GPU ranks, the part every build has: the control page (host
 * memory shared with the daemon), which carries completions and
 * asynchronous errors, and the waits on it. The stream-ordered operations
 * themselves are in libep_cuda.c (built with CUDA) or libep_nocuda.c.
 */
#include "libep_int.h"

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

/* An op that failed alone (the group goes on), reported once. */
int ep__op_error(ep_group_t *g)
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
	int code = *(const int32_t *)(sl + EPP_CTL_OP_ERR_CODE);
	uint64_t pos = *(const uint64_t *)(sl + EPP_CTL_OP_ERR_POS);
	if (code == EP_ETOOBIG && pos != UINT64_MAX)
		return ep__fail(code,
				"op %llu changed nothing: rank %llu dispatched "
				"%llu tokens, above the group's maximum of %u "
				"per rank",
				(unsigned long long)seq,
				(unsigned long long)((pos >> 32) & 0x7fffffffull),
				(unsigned long long)(pos & 0xffffffffull),
				g->cfg.max_tokens);
	if (code == EP_ETOOBIG) /* staged: the daemon's log names the rank */
		return ep__fail(code,
				"op %llu changed nothing: a rank dispatched "
				"more tokens than the group's maximum of %u per "
				"rank (the daemons' logs name it)",
				(unsigned long long)seq, g->cfg.max_tokens);
	if (code == EP_ETIMEDOUT) /* the group fails with it as well */
		return ep__fail(code,
				"op %llu changed nothing: the daemon's kernel "
				"waited the group's timeout for local rank "
				"%llu's stream to reach it",
				(unsigned long long)seq,
				(unsigned long long)(pos & 0xffffffffull));
	if (pos == UINT64_MAX) /* found on another node: in its log */
		return ep__fail(code,
				"op %llu changed nothing: an expert index out "
				"of range (the daemons' logs name it)",
				(unsigned long long)seq);
	return ep__fail(code,
			"op %llu changed nothing: expert index out of range "
			"at rank %llu, token %llu, k %llu",
			(unsigned long long)seq, (unsigned long long)(pos >> 48),
			(unsigned long long)((pos >> 16) & 0xffffffffull),
			(unsigned long long)(pos & 0xffff));
}

int ep_group_error(ep_group_t *g)
{
	if (!g)
		return ep__fail(EP_EINVAL, "NULL group");
	int e = g->buf ? ep__ctl_error(g) : 0;
	if (e)
		return ep__fail(e, "%.*s", (int)EPP_CTL_MSG_MAX,
				(const char *)ep__ctl_slot(g) + EPP_CTL_ERR_MSG);
	if (g->conn->async_err)
		return g->conn->async_err;
	int ge = ep__graph_error(g);
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

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

uint64_t ep__inflight(const ep_group_t *g)
{
	return __atomic_load_n(&g->sent, __ATOMIC_ACQUIRE) -
	       ep__completed_full(g);
}

int ep__wait_until(ep_group_t *g, uint64_t behind)
{
	uint64_t end = now_ms() + (uint64_t)ep__group_op_timeout(g);
	unsigned spins = 0;
	while (ep__inflight(g) > behind) {
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
		if (now_ms() > end)
			return ep__fail(EP_ETIMEDOUT,
					"%llu stream-ordered ops still not "
					"complete",
					(unsigned long long)ep__inflight(g));
		if (++spins > 100)
			usleep(20);
	}
	return 0;
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
	return rc ? rc : ep__op_error(g);
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
