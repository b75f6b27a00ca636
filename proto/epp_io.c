/* SPDX-License-Identifier: MIT */
/* epp: socket I/O with descriptors, blocking frame helpers, error names. */
#include "epp.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

long epp_sendmsg(int fd, const void *buf, size_t len, const int *fds,
		 unsigned nfds)
{
	struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
	union {
		char buf[CMSG_SPACE(sizeof(int) * EPP_MAX_FDS)];
		struct cmsghdr align;
	} u;
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
	if (nfds > EPP_MAX_FDS)
		return -EINVAL;
	if (nfds) {
		memset(&u, 0, sizeof(u));
		msg.msg_control = u.buf;
		msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
		struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
		memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
	}
	ssize_t n;
	do
		n = sendmsg(fd, &msg, MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	return n < 0 ? -errno : n;
}

long epp_recvmsg(int fd, void *buf, size_t len, int *fds, unsigned *nfds,
		 unsigned fdcap, bool *truncated)
{
	struct iovec iov = {.iov_base = buf, .iov_len = len};
	union {
		char buf[CMSG_SPACE(sizeof(int) * EPP_MAX_FDS)];
		struct cmsghdr align;
	} u;
	struct msghdr msg = {.msg_iov = &iov,
			     .msg_iovlen = 1,
			     .msg_control = u.buf,
			     .msg_controllen = sizeof(u.buf)};
	ssize_t n;
	do
		n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	if (msg.msg_flags & MSG_CTRUNC)
		*truncated = true;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c;
	     c = CMSG_NXTHDR(&msg, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		int *in = (int *)CMSG_DATA(c);
		for (size_t i = 0; i < k; i++) {
			int v;
			memcpy(&v, in + i, sizeof(int));
			if (*nfds < fdcap) {
				fds[(*nfds)++] = v;
			} else {
				close(v);
				*truncated = true;
			}
		}
	}
	return n;
}

int epp_send_frame(int fd, const struct epp_hdr *h, const void *payload,
		   const int *fds)
{
	uint8_t stackbuf[512];
	size_t total = EPP_HDR_SIZE + h->length;
	uint8_t *buf = total <= sizeof(stackbuf) ? stackbuf : malloc(total);
	if (!buf)
		return EP_ENOMEM;
	epp_hdr_encode(h, buf);
	if (h->length)
		memcpy(buf + EPP_HDR_SIZE, payload, h->length);
	size_t off = 0;
	int rc = 0;
	while (off < total) {
		long n = epp_sendmsg(fd, buf + off, total - off,
				     off == 0 ? fds : NULL,
				     off == 0 && fds ? h->nfds : 0);
		if (n == -EAGAIN) {
			struct pollfd p = {.fd = fd, .events = POLLOUT};
			poll(&p, 1, 1000);
			continue;
		}
		if (n < 0) {
			rc = n == -EPIPE ? EP_ECONNRESET : (int)n;
			break;
		}
		off += (size_t)n;
	}
	if (buf != stackbuf)
		free(buf);
	return rc;
}

static long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

/* Read exactly len bytes, collecting descriptors; deadline in ms or -1. */
static int read_full(int fd, uint8_t *buf, size_t len, int *fds,
		     unsigned *nfds, long deadline)
{
	size_t off = 0;
	bool trunc = false;
	while (off < len) {
		int wait = -1;
		if (deadline >= 0) {
			long left = deadline - now_ms();
			wait = left > 0 ? (int)left : 0;
		}
		struct pollfd p = {.fd = fd, .events = POLLIN};
		int pr = poll(&p, 1, wait);
		if (pr < 0 && errno == EINTR)
			continue;
		if (pr < 0)
			return -errno;
		if (pr == 0)
			return EP_ETIMEDOUT;
		long n = epp_recvmsg(fd, buf + off, len - off, fds, nfds,
				     EPP_MAX_FDS, &trunc);
		if (n == -EAGAIN)
			continue;
		if (n < 0)
			return n == -ECONNRESET ? EP_ECONNRESET : (int)n;
		if (n == 0)
			return EP_ECONNRESET;
		off += (size_t)n;
	}
	return trunc ? EP_EPROTO : 0;
}

int epp_recv_frame(int fd, struct epp_hdr *h, uint8_t **payload, int *fds,
		   int timeout_ms, char *err, size_t errlen)
{
	uint8_t hb[EPP_HDR_SIZE];
	unsigned nfds = 0;
	int got[EPP_MAX_FDS];
	long deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
	*payload = NULL;
	int rc = read_full(fd, hb, sizeof(hb), got, &nfds, deadline);
	if (rc)
		goto err_fds;
	rc = epp_hdr_decode(hb, h, err, errlen);
	if (rc)
		goto err_fds;
	if (h->length) {
		*payload = malloc(h->length);
		if (!*payload) {
			rc = EP_ENOMEM;
			goto err_fds;
		}
		rc = read_full(fd, *payload, h->length, got, &nfds, deadline);
		if (rc)
			goto err_payload;
	}
	if (nfds != h->nfds) {
		if (err)
			snprintf(err, errlen,
				 "frame announced %u descriptors, %u arrived",
				 h->nfds, nfds);
		rc = EP_EPROTO;
		goto err_payload;
	}
	for (unsigned i = 0; i < nfds; i++) {
		if (fds)
			fds[i] = got[i];
		else
			close(got[i]);
	}
	return 0;

err_payload:
	free(*payload);
	*payload = NULL;
err_fds:
	for (unsigned i = 0; i < nfds; i++)
		close(got[i]);
	return rc;
}

const char *ep_strerror(int code)
{
	switch (code) {
	case EP_OK: return "success";
	case EP_EPEERLOST: return "a rank of the group left or died";
	case EP_EVERSION: return "protocol version mismatch";
	case EP_EMISMATCH: return "ranks disagree (join or operation)";
	case EP_ENOTREADY: return "group not ready: not every rank joined";
	case EP_EDUPRANK: return "rank already joined";
	case EP_ESHUTDOWN: return "daemon shutting down";
	case EP_ENOGROUP: return "no such group";
	case EP_EFAILED: return "group failed earlier";
	case EP_ESTALE: return "handle from another group or epoch";
	case EP_ETOOBIG: return "exceeds the group's buffers";
	case EP_ESHAPE: return "shape or dtype does not match the group";
	case EP_EEXPERT: return "expert index out of range";
	case EP_EUNSUPPORTED: return "not supported";
	case EP_EBACKEND: return "backend failure";
	case EP_ELIMIT: return "a limit of the daemon's configuration was reached";
	}
	if (code < 0 && code > -1000)
		return strerror(-code);
	return "unknown error";
}
