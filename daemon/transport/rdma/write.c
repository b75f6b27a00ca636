/* SPDX-License-Identifier: MIT */
/*
 * The rdma transport (rdma_int.h): one-sided writes. Regions registered in
 * the shared protection domain, writes queued on the proxy by any thread
 * and posted by its thread, and connections held (and freed only once the
 * proxy passed their last write).
 */
#include "rdma_int.h"

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

void rd_handle_closed(uv_handle_t *h)
{
	struct epd_rconn *rc = h->data;
	rc->handles--;
	rconn_release(rc);
}

void epd_rdma_hold(struct epd_rconn *rc)
{
	rc->refs++;
}

void epd_rdma_release(struct epd_rconn *rc)
{
	if (--rc->refs == 0)
		rconn_release(rc);
}

bool epd_rdma_can_write(const struct epd_rconn *rc)
{
	return rc && rc->connected && !rc->closing && !rc->own_pd &&
	       rc->pd && rc->rd->proxy;
}

struct epd_rmr *epd_rdma_reg(struct epd_rdma *rd, void *p, size_t len,
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

void epd_rdma_dereg(struct epd_rmr *m)
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
	rd_rdma_maybe_free(rd); /* the last region of a transport that closed */
}

/* 0 once the device is gone (writes with it fail, on a connection that
 * is failing anyway) */
uint64_t epd_rdma_write(struct epd_rdma *rd, struct epd_cmd *c)
{
	return rd->proxy ? epd_proxy_push(rd->proxy, c) : 0;
}

uint64_t epd_rdma_stats(const struct epd_rdma *rd, uint64_t *batches)
{
	*batches = 0;
	return rd->proxy ? epd_proxy_posted(rd->proxy, batches) : 0;
}

/* The proxy's poster (its thread): a chain of work requests per run of
 * commands for one connection, within its budget of outstanding writes.
 * A connection that is closing gets nothing (its writes are lost with
 * it; its groups fail on the loop). */
void rd_post(void *arg, const struct epd_cmd *c, size_t n)
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
