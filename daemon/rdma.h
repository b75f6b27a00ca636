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

/* Callbacks, on the loop thread. request: a peer's connect request with
 * its private data; return the connection's user pointer to accept, NULL
 * to reject. established: the stream is up (both sides). bytes: the next
 * bytes of the stream. closed: the connection is gone (no more calls). */
struct epd_rdma_ops {
	void *(*request)(void *arg, struct epd_rconn *rc, const void *pdata,
			 uint8_t len);
	void (*established)(void *arg, void *user);
	void (*bytes)(void *arg, void *user, const uint8_t *p, size_t n);
	void (*closed)(void *arg, void *user, const char *why);
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

#endif
