/* SPDX-License-Identifier: MIT */
/* The rdma transport of the cluster (rdma.c): a byte stream per peer over
 * an RC queue pair, driven from the libuv loop. */
#ifndef EPD_RDMA_H
#define EPD_RDMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <uv.h>

struct epd_rdma;
struct epd_rconn;
struct epd_rmr;
struct epd_cmd;

/* Callbacks, on the loop thread. request: a peer's connect request with
 * its private data; return the connection's user pointer to accept, NULL
 * to reject. established: the stream is up (both sides). bytes: the next
 * bytes of the stream. closed: the connection is gone (no more calls). */
struct epd_rdma_ops {
	/* A connect request: the user pointer to accept it, or NULL and why
	 * (sent to the dialler in the reject's private data). */
	void *(*request)(void *arg, struct epd_rconn *rc, const void *pdata,
			 uint8_t len, char *why, size_t wl);
	void (*established)(void *arg, void *user);
	void (*bytes)(void *arg, void *user, const uint8_t *p, size_t n);
	void (*closed)(void *arg, void *user, const char *why);
	/* A peer's RDMA WRITE with immediate landed here (every write it
	 * posted before on this connection is placed). */
	void (*imm)(void *arg, void *user, uint32_t imm);
	/* Our write with immediate (and every write before it on this
	 * connection) completed: its cookie (47 bits). */
	void (*written)(void *arg, void *user, uint64_t cookie);
};

/* Whether an RDMA device exists (why: what was found, or why not). */
bool epd_rdma_available(char *why, size_t len);

struct epd_rdma *epd_rdma_new(uv_loop_t *loop, const struct epd_rdma_ops *ops,
			      void *arg, char *err, size_t errlen);
int epd_rdma_listen(struct epd_rdma *rd, const struct sockaddr *sa, char *err,
		    size_t errlen);
/* Connect; pdata (at most 56 bytes) travels in the connect request. */
struct epd_rconn *epd_rdma_dial(struct epd_rdma *rd, const struct sockaddr *sa,
				const void *pdata, uint8_t plen, void *user);
/* Queue the n pieces (copied) on the stream. -1 if the connection is not
 * up. */
int epd_rdma_send(struct epd_rconn *rc, const struct iovec *iov, int n);
/* Close; no callback for it afterwards. */
void epd_rdma_close(struct epd_rconn *rc);
void epd_rdma_free(struct epd_rdma *rd);

/* Writes. A connection is freed only once nobody holds it (loop thread)
 * and the proxy took every write queued before; hold it while another
 * thread may queue writes for it. */
void epd_rdma_hold(struct epd_rconn *rc);
void epd_rdma_release(struct epd_rconn *rc);
/* Up, and its queue pair in the domain where regions are registered. */
bool epd_rdma_can_write(const struct epd_rconn *rc);
/* Register [p, p + len): for local reads (a write's source) or also for
 * the peers' writes (remote_write). NULL with why before the first
 * connection (no domain yet) or if the device refuses. */
struct epd_rmr *epd_rdma_reg(struct epd_rdma *rd, void *p, size_t len,
			     bool remote_write, char *why, size_t wl);
void epd_rdma_dereg(struct epd_rmr *m);
/* "RDMA device X removed" after a device removal (its connections failed
 * and its objects were given back; listening resumes when a device has
 * the address again), else NULL. */
const char *epd_rdma_removed(const struct epd_rdma *rd);
uint32_t epd_rmr_lkey(const struct epd_rmr *m);
uint32_t epd_rmr_rkey(const struct epd_rmr *m);
/* Queue one write (c->conn: a held epd_rconn that can write) on the
 * proxy; any thread. Its ticket (proxy.h), 0 if refused. */
uint64_t epd_rdma_write(struct epd_rdma *rd, struct epd_cmd *c);
/* Writes the proxy posted so far, and in how many batches. */
uint64_t epd_rdma_stats(const struct epd_rdma *rd, uint64_t *batches);

#endif
