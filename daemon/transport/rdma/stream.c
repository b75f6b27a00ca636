/* SPDX-License-Identifier: MIT */
/*
 * The rdma transport (rdma_int.h): the byte stream over a connection's
 * queue pair: queued bytes cut into SENDs, receives handed up, the
 * completion queue (also the one-sided writes' completions).
 */
#include "rdma_int.h"

/* A receive's bytes, into the buffer the cluster gives. */
static void deliver(struct epd_rconn *rc, const uint8_t *p, size_t n)
{
	size_t room = 0;
	uint8_t *to = rc->rd->cb->rx_buf(rc->rd->arg, rc->base.user, n, &room);
	if (!to || room < n) {
		rconn_fail(rc, "out of memory");
		return;
	}
	memcpy(to, p, n);
	rc->rd->cb->rx(rc->rd->arg, rc->base.user, n);
}

void rconn_fail(struct epd_rconn *rc, const char *why)
{
	void *u = rc->base.user;
	rc->base.user = NULL;
	if (u)
		rc->rd->cb->closed(rc->rd->arg, u, why);
	epd_rdma_close(rc);
}

int rd_post_recv(struct epd_rconn *rc, uint32_t i)
{
	struct ibv_sge sge = {.addr = (uintptr_t)(rc->mem + (size_t)i * RD_CHUNK),
			      .length = RD_CHUNK,
			      .lkey = rc->mr->lkey};
	struct ibv_recv_wr wr = {.wr_id = i, .sg_list = &sge, .num_sge = 1},
			   *bad;
	return ibv_post_recv(rc->id->qp, &wr, &bad);
}

/* Post queued bytes while send slots are free. */
void rd_pump(struct epd_rconn *rc)
{
	/* Not established yet: bytes wait in sq (the passive side can
	 * receive the dialler's hello, and answer it, before its own
	 * ESTABLISHED event; its queue pair may not send before). */
	if (!rc->connected)
		return;
	while (rc->nfree > 0 && epp_rbuf_live(&rc->sq)) {
		uint32_t s = rc->free_slot[--rc->nfree];
		size_t n = epp_rbuf_live(&rc->sq);
		if (n > RD_CHUNK)
			n = RD_CHUNK;
		uint8_t *buf = rc->mem + (size_t)(RD_RECVS + s) * RD_CHUNK;
		memcpy(buf, rc->sq.p + rc->sq.off, n);
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
		epp_rbuf_take(&rc->sq, n);
	}
}

void rd_on_cq(uv_poll_t *p, int status, int events)
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
			if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
				/* a peer's rows are placed; no bytes here */
				if (rc->base.user && rc->rd->cb->imm)
					rc->rd->cb->imm(rc->rd->arg, rc->base.user,
							 ntohl(wc[i].imm_data));
				if (!rc->closing && rd_post_recv(rc, slot)) {
					rconn_fail(rc, "ibv_post_recv failed");
					return;
				}
			} else if (wc[i].wr_id & WR_WRITE) {
				uint64_t id = wc[i].wr_id;
				__atomic_fetch_sub(
					&rc->wr_out,
					(int)((id & ~(WR_WRITE | WR_IMM)) >>
					      WR_COUNT_SHIFT),
					__ATOMIC_RELEASE);
				if (id & WR_IMM && rc->base.user &&
				    rc->rd->cb->written)
					rc->rd->cb->written(rc->rd->arg, rc->base.user,
							     id & WR_COOKIE_MASK);
			} else if (wc[i].opcode & IBV_WC_RECV) {
				if (rc->base.user)
					deliver(rc, rc->mem + (size_t)slot *
								  RD_CHUNK,
						wc[i].byte_len);
				if (!rc->closing && rd_post_recv(rc, slot)) {
					rconn_fail(rc, "ibv_post_recv failed");
					return;
				}
			} else {
				rc->free_slot[rc->nfree++] = slot - RD_RECVS;
			}
		}
		if (!rc->closing)
			rd_pump(rc);
	}
	if (n < 0 && !rc->closing)
		rconn_fail(rc, "ibv_poll_cq failed");
}

int epd_rdma_send(struct epd_rconn *rc, const struct iovec *iov, int n)
{
	if (rc->closing || !rc->qp)
		return -1;
	size_t need = 0;
	for (int i = 0; i < n; i++)
		need += iov[i].iov_len;
	/* room for the whole unit first: a stream never gets half of one */
	if (epp_rbuf_room(&rc->sq, need, 65536))
		return -1;
	for (int i = 0; i < n; i++)
		epp_rbuf_put(&rc->sq, iov[i].iov_base, iov[i].iov_len);
	rd_pump(rc);
	return rc->closing ? -1 : 0;
}
