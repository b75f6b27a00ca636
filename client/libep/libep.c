/* SPDX-License-Identifier: MIT */
/* libep: connection, groups and collectives, over the epd control socket. */
#include "libep_int.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static _Thread_local char errmsg[EPP_ERRMSG_MAX];

const char *ep_errmsg(void)
{
	return errmsg;
}

int ep__fail(int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(errmsg, sizeof(errmsg), fmt, ap);
	va_end(ap);
	return code;
}

/* Margin over the daemon's own timeout before the client gives up on it. */
#define CLIENT_MARGIN_MS EP__CTL_TIMEOUT_MS

/* Read what the daemon already sent without waiting; note a shutdown. */
static void drain_notices(ep_conn_t *c)
{
	for (;;) {
		struct epp_hdr h;
		uint8_t *p;
		int fds[EPP_MAX_FDS];
		if (epp_recv_frame(c->fd, &h, &p, fds, 0, NULL, 0))
			return;
		int code;
		char msg[EPP_ERRMSG_MAX];
		if (h.type == EPP_NOTICE &&
		    !epp_error_decode(p, h.length, &code, msg, sizeof(msg)) &&
		    code == EP_ESHUTDOWN)
			c->shutdown = true;
		for (unsigned i = 0; i < h.nfds; i++)
			close(fds[i]);
		free(p);
	}
}

int ep__send(ep_conn_t *c, struct epp_hdr *h, const void *payload,
	     bool async)
{
	return ep__send_fds(c, h, payload, NULL, async);
}

int ep__send_fds(ep_conn_t *c, struct epp_hdr *h, const void *payload,
		 const int *fds, bool async)
{
	pthread_mutex_lock(&c->wmu);
	int rc = __atomic_load_n(&c->dead, __ATOMIC_ACQUIRE);
	if (!rc) {
		h->req_id = __atomic_add_fetch(&c->next_req, 1,
					       __ATOMIC_RELAXED) |
			    (async ? EP__REQ_ASYNC : 0);
		rc = epp_send_frame(c->fd, h, payload, fds);
		if (rc)
			__atomic_store_n(&c->dead, rc, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&c->wmu);
	return rc;
}

int ep__rpc(ep_conn_t *c, uint16_t type, uint16_t flags, const void *payload,
	    uint32_t len, uint8_t **reply, uint32_t *rlen, int *fds,
	    unsigned maxfds, int timeout_ms)
{
	return ep__rpc_fds(c, type, flags, payload, len, NULL, 0, reply, rlen,
			   fds, maxfds, timeout_ms);
}

int ep__rpc_fds(ep_conn_t *c, uint16_t type, uint16_t flags,
		const void *payload, uint32_t len, const int *sfds,
		unsigned nsfds, uint8_t **reply, uint32_t *rlen, int *fds,
		unsigned maxfds, int timeout_ms)
{
	if (c->dead)
		return ep__fail(c->dead, "connection unusable: %s",
				ep_strerror(c->dead));
	struct epp_hdr h;
	epp_hdr_init(&h, type, 0);
	h.flags = flags;
	h.length = len;
	h.nfds = (uint16_t)nsfds;
	int rc = ep__send_fds(c, &h, payload, nsfds ? sfds : NULL, false);
	if (rc) {
		/* A shutdown notice may be waiting behind the closed stream. */
		drain_notices(c);
		c->dead = c->shutdown ? EP_ESHUTDOWN : rc;
		return ep__fail(c->dead, "send to epd failed: %s",
				ep_strerror(c->dead));
	}
	for (;;) {
		struct epp_hdr rh;
		uint8_t *p;
		int got[EPP_MAX_FDS];
		char err[256] = "";
		rc = epp_recv_frame(c->fd, &rh, &p, got, timeout_ms, err,
				    sizeof(err));
		if (rc == EP_ETIMEDOUT) {
			c->dead = EP_ETIMEDOUT;
			return ep__fail(rc, "epd did not answer %s within %d "
					    "ms",
					epp_type_name(type), timeout_ms);
		}
		if (rc) {
			c->dead = c->shutdown ? EP_ESHUTDOWN : rc;
			return ep__fail(c->dead, "connection to epd lost: %s%s%s",
					ep_strerror(c->dead), *err ? ": " : "",
					err);
		}
		if (rh.type == EPP_NOTICE) {
			int code;
			char msg[EPP_ERRMSG_MAX];
			if (!epp_error_decode(p, rh.length, &code, msg,
					      sizeof(msg)) &&
			    code == EP_ESHUTDOWN)
				c->shutdown = true;
			free(p);
			for (unsigned i = 0; i < rh.nfds; i++)
				close(got[i]);
			continue;
		}
		if (rh.type == EPP_ERROR &&
		    (rh.req_id < h.req_id || rh.req_id & EP__REQ_ASYNC)) {
			/* a stream-ordered request failed (no one waits) */
			int code;
			char msg[EPP_ERRMSG_MAX];
			if (!epp_error_decode(p, rh.length, &code, msg,
					      sizeof(msg)) &&
			    !c->async_err) {
				c->async_err = code;
				ep__fail(code, "%s", msg);
			}
			free(p);
			continue;
		}
		if (rh.req_id != h.req_id) {
			/* a reply to nothing we asked: the stream is off */
			free(p);
			for (unsigned i = 0; i < rh.nfds; i++)
				close(got[i]);
			c->dead = EP_EPROTO;
			return ep__fail(EP_EPROTO, "reply for request %lu while "
						   "waiting for %lu",
					(unsigned long)rh.req_id,
					(unsigned long)h.req_id);
		}
		if (rh.type == EPP_ERROR) {
			int code;
			char msg[EPP_ERRMSG_MAX];
			rc = epp_error_decode(p, rh.length, &code, msg,
					      sizeof(msg));
			free(p);
			for (unsigned i = 0; i < rh.nfds; i++)
				close(got[i]);
			if (rc)
				return ep__fail(EP_EPROTO, "malformed error "
							   "reply");
			return ep__fail(code, "%s", msg);
		}
		if (rh.type != EPP_OK || rh.nfds > maxfds) {
			free(p);
			for (unsigned i = 0; i < rh.nfds; i++)
				close(got[i]);
			c->dead = EP_EPROTO;
			return ep__fail(EP_EPROTO, "unexpected %s reply with "
						   "%u descriptors",
					epp_type_name(rh.type), rh.nfds);
		}
		for (unsigned i = 0; i < maxfds; i++)
			fds[i] = i < rh.nfds ? got[i] : -1;
		if (reply) {
			*reply = p;
			*rlen = rh.length;
		} else {
			free(p);
		}
		errmsg[0] = 0;
		return 0;
	}
}

int ep_connect(const char *path, ep_conn_t **out)
{
	if (!out)
		return ep__fail(EP_EINVAL, "out is NULL");
	if (!path)
		path = getenv("EPD_SOCKET");
	if (!path || !*path)
		path = EPD_SOCKET_PATH; /* configure --with-socket */
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof(sa.sun_path))
		return ep__fail(EP_EINVAL, "socket path too long: %s", path);
	strcpy(sa.sun_path, path);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return ep__fail(-errno, "socket: %s", strerror(errno));
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa))) {
		int e = errno;
		close(fd);
		return ep__fail(-e, "cannot connect to epd at %s: %s", path,
				strerror(e));
	}
	ep_conn_t *c = calloc(1, sizeof(*c));
	if (!c) {
		close(fd);
		return ep__fail(EP_ENOMEM, "out of memory");
	}
	c->fd = fd;
	LIST_INIT(&c->groups);
	pthread_mutex_init(&c->mu, NULL);
	pthread_mutex_init(&c->wmu, NULL);
	/* HELLO: version check, and what the daemon is. */
	uint8_t buf[128];
	struct epp_wr w;
	epp_wr_init(&w, buf, sizeof(buf));
	epp_put_u16(&w, EPP_VERSION_MAJOR);
	epp_put_u16(&w, EPP_VERSION_MINOR);
	char name[64];
	snprintf(name, sizeof(name), "libep %d.%d", EP_VERSION_MAJOR,
		 EP_VERSION_MINOR);
	epp_put_str(&w, name);
	uint8_t *rep;
	uint32_t rlen;
	int rc = ep__rpc(c, EPP_HELLO, 0, buf, (uint32_t)w.off, &rep, &rlen,
			 NULL, 0, CLIENT_MARGIN_MS);
	if (rc) {
		ep_close(c);
		return rc;
	}
	struct epp_hello_ok ok;
	rc = epp_hello_ok_decode(rep, rlen, &ok);
	free(rep);
	if (rc) {
		ep_close(c);
		return ep__fail(EP_EPROTO, "malformed hello reply");
	}
	c->client_id = ok.client_id;
	c->minor = ok.minor;
	snprintf(c->backend, sizeof(c->backend), "%s", ok.backend);
	snprintf(c->node, sizeof(c->node), "%s", ok.node);
	*out = c;
	return 0;
}

/* A copy of a job's secret, wiped before it is freed. */
static void secret_free(uint8_t *p, size_t n)
{
	volatile uint8_t *v = p;
	for (size_t i = 0; i < n; i++)
		v[i] = 0;
	free(p);
}

void ep__group_free(ep_group_t *g)
{
	ep__llh_fini(g);
	if (g->gpu)
		g->gpu->unmap(g);
	if (g->buf && g->buf != MAP_FAILED)
		munmap(g->buf, g->buf_size);
	list_del(&g->node);
	free((char *)g->cfg.nodes);
	if (g->cfg.secret)
		secret_free((uint8_t *)g->cfg.secret, g->cfg.secret_len);
	free(g);
}

void ep_close(ep_conn_t *c)
{
	if (!c)
		return;
	/* The daemon removes this connection's ranks and releases their
	 * groups, so work still queued for them ends; then they are unmapped
	 * (group_free waits for it). */
	close(c->fd);
	struct list_node *it, *tmp;
	LIST_FOREACH(it, tmp, &c->groups)
	ep__group_free(LIST_ENTRY(it, ep_group_t, node));
	pthread_mutex_destroy(&c->mu);
	pthread_mutex_destroy(&c->wmu);
	free(c);
}

const char *ep_conn_node(const ep_conn_t *c)
{
	return c ? c->node : "";
}

/* The join request of cfg (flags, link, ext: ep__join's) into *j; the
 * node list and the secret it points to are malloc'd copies (*nodes,
 * *secret, NULL if none; nb: the list's bytes), which the group keeps. */
static int join_request(const ep_conn_t *c, const struct ep_group_config *cfg,
			unsigned flags, uint64_t link,
			const struct epp_join *ext,
			const struct ep__gpu_ops *gpu, struct epp_join *j,
			char **nodes, uint8_t **secret, size_t *nb)
{
	*nodes = NULL;
	*secret = NULL;
	*nb = 0;
	if (flags & ~(EP_JOIN_NOWAIT | EP_JOIN_CUDA | EP_JOIN_RECV_AREAS(~0u)))
		return ep__fail(EP_EINVAL, "unknown flags 0x%x", flags);
	memset(j, 0, sizeof(*j));
	j->recv_areas = (flags >> 8) & 0xffu;
	if (j->recv_areas > EP_RECV_AREAS_MAX)
		return ep__fail(EP_EINVAL, "%u receive areas: at most %u",
				j->recv_areas, EP_RECV_AREAS_MAX);
	if (!j->recv_areas)
		j->recv_areas = 1;
	if (strlen(cfg->name) > EP_GROUP_NAME_MAX)
		return ep__fail(EP_EINVAL, "group name longer than %d",
				EP_GROUP_NAME_MAX);
	strcpy(j->name, cfg->name);
	j->world_size = cfg->world_size;
	j->ranks_per_node = cfg->ranks_per_node;
	j->rank = cfg->rank;
	j->num_experts = cfg->num_experts;
	j->hidden = cfg->hidden;
	j->max_tokens = cfg->max_tokens_per_rank;
	j->topk = cfg->topk;
	j->dtype = (uint32_t)cfg->dtype;
	j->timeout_ms = cfg->timeout_ms;
	/* linked (1.16): fails with that group, even while forming; a daemon
	 * below 1.16 would refuse the flag */
	j->link = c->minor >= 16 ? link : 0;
	if (flags & EP_JOIN_CUDA) {
		if (flags & EP_JOIN_NOWAIT)
			return ep__fail(EP_EINVAL, "a GPU rank's join waits "
						   "for the group");
		if (!gpu)
			return ep__fail(EP_EUNSUPPORTED,
					"a GPU rank's join where none is "
					"served");
		int rc = gpu->prepare(cfg->cuda_device, j->gpu_uuid,
				      &j->rank_flags);
		if (rc)
			return rc;
	}
	if (!ext)
		return 0;
	j->recv_rows = ext->recv_rows;
	/* 1.21: the group's node list, a copy the group keeps (its
	 * low-latency pseudo group names the same nodes) */
	if (ext->num_nodes) {
		*nb = (size_t)(epp_join_node(ext, ext->num_nodes) - ext->nodes);
		*nodes = malloc(*nb);
		if (!*nodes)
			return ep__fail(EP_ENOMEM, "out of memory");
		memcpy(*nodes, ext->nodes, *nb);
		j->nodes = *nodes;
		j->num_nodes = ext->num_nodes;
	}
	/* the secret, kept too: the group's pseudo group joins with it */
	if (ext->secret_len) {
		*secret = malloc(ext->secret_len);
		if (!*secret) {
			free(*nodes);
			*nodes = NULL;
			return ep__fail(EP_ENOMEM, "out of memory");
		}
		memcpy(*secret, ext->secret, ext->secret_len);
		j->secret = *secret;
		j->secret_len = ext->secret_len;
	}
	return 0;
}

/* The joined group g (in its connection's list) takes its memory: the
 * buffer (fd, closed here) and, for a GPU rank (gpu: its part), its
 * device region (dfd). On failure the group is left and freed. */
static int join_attach(ep_group_t *g, const struct ep_group_config *cfg,
		       const struct epp_join_ok *ok, int fd, int dfd,
		       const struct ep__gpu_ops *gpu)
{
	g->buf = mmap(NULL, g->buf_size, PROT_READ | PROT_WRITE, MAP_SHARED,
		      fd, 0);
	close(fd);
	if (g->buf == MAP_FAILED) {
		int e = errno;
		if (dfd >= 0)
			close(dfd);
		ep_leave(g);
		return ep__fail(-e, "cannot map the group buffer: %s",
				strerror(e));
	}
	g->cuda_device = gpu ? cfg->cuda_device : -1;
	g->gpu = gpu;
	g->llops = gpu ? gpu->ll_ops(g) : &ep__ll_host_ops;
	int rc;
	if (gpu && (rc = gpu->map(g, dfd, ok->dev_size))) {
		char msg[EPP_ERRMSG_MAX];
		snprintf(msg, sizeof(msg), "%s", ep_errmsg());
		ep_leave(g);
		return ep__fail(rc, "%s", msg);
	}
	if (epp_buf_layout(&g->cfg, &g->layout) ||
	    g->layout.total != ok->buf_size) {
		ep_leave(g);
		return ep__fail(EP_EPROTO,
				"the daemon's buffer of %llu bytes does not "
				"match this library's layout",
				(unsigned long long)ok->buf_size);
	}
	return 0;
}

int ep__join(ep_conn_t *c, const struct ep_group_config *cfg, unsigned flags,
	     uint64_t link, const struct epp_join *ext,
	     const struct ep__gpu_ops *gpu, ep_group_t **out)
{
	if (!c || !cfg || !out || !cfg->name)
		return ep__fail(EP_EINVAL, "NULL argument");
	struct epp_join j;
	char *nodes;
	uint8_t *secret;
	size_t nb;
	int rc = join_request(c, cfg, flags, link, ext, gpu, &j, &nodes,
			      &secret, &nb);
	if (rc)
		return rc;
	const size_t cap = 256 + 16 + nb + 2 + j.secret_len;
	uint8_t *buf = malloc(cap);
	size_t n = buf ? epp_join_encode(&j, buf, cap) : 0;
	ep_group_t *g = n ? calloc(1, sizeof(*g)) : NULL;
	if (!g) {
		free(buf);
		free(secret);
		free(nodes);
		return ep__fail(EP_ENOMEM, "out of memory");
	}
	g->cuda_device = -1;
	g->llops = &ep__ll_host_ops;
	/* The daemon bounds the wait for readiness by the group timeout; its
	 * default is not known here, so allow the protocol maximum. */
	int wait = (int)(cfg->timeout_ms ? cfg->timeout_ms : 3600000) +
		   CLIENT_MARGIN_MS;
	uint8_t *rep;
	uint32_t rlen;
	int fds[2];
	pthread_mutex_lock(&c->mu);
	rc = ep__rpc(c, EPP_JOIN,
		     (flags & EP_JOIN_NOWAIT ? EPP_F_JOIN_NOWAIT : 0) |
			     epp_join_flags(&j),
		     buf, (uint32_t)n, &rep, &rlen, fds, 2, wait);
	pthread_mutex_unlock(&c->mu);
	free(buf);
	if (rc) {
		free(secret);
		free(nodes);
		free(g);
		return rc;
	}
	struct epp_join_ok ok;
	rc = epp_join_ok_decode(rep, rlen, &ok);
	free(rep);
	const bool cuda = flags & EP_JOIN_CUDA;
	if (rc || fds[0] < 0 || (cuda != (fds[1] >= 0)) ||
	    (cuda && !ok.dev_size)) {
		if (fds[0] >= 0)
			close(fds[0]);
		if (fds[1] >= 0)
			close(fds[1]);
		free(secret);
		free(nodes);
		free(g);
		return ep__fail(EP_EPROTO, "malformed join reply");
	}
	g->conn = c;
	g->id = ok.group_id;
	g->epoch = ok.epoch;
	g->node_index = ok.node_index;
	g->cfg = j; /* the node list and secret go with it */
	g->buf_size = ok.buf_size;
	g->timeout_ms = cfg->timeout_ms;
	pthread_mutex_lock(&c->mu);
	list_add_tail(&c->groups, &g->node);
	pthread_mutex_unlock(&c->mu);
	if ((rc = join_attach(g, cfg, &ok, fds[0], fds[1],
			      cuda ? gpu : NULL)))
		return rc;
	*out = g;
	return 0;
}

static void put_gid(uint8_t buf[8], uint64_t id)
{
	struct epp_wr w;
	epp_wr_init(&w, buf, 8);
	epp_put_u64(&w, id);
}

int ep_leave(ep_group_t *g)
{
	if (!g)
		return ep__fail(EP_EINVAL, "NULL group");
	ep_conn_t *c = g->conn;
	uint8_t buf[8];
	put_gid(buf, g->id);
	/* A GPU rank's stream-ordered ops still queued are waited for (up
	 * to the group's timeout, the daemon's default of 30 s where the
	 * group has none, or until the group fails): leaving before them
	 * would fail the other ranks' ops for a rank that only left early,
	 * and leave this rank's streams waiting on memory that is unmapped
	 * below. */
	if (g->cuda_device >= 0 && ep__inflight(g))
		(void)ep__wait_drained(g, (int)(g->timeout_ms ? g->timeout_ms
							      : 30000) +
						  CLIENT_MARGIN_MS);
	ep__llh_leave(g); /* the low-latency mode's pseudo group first */
	pthread_mutex_lock(&c->mu);
	int rc = ep__rpc(c, EPP_LEAVE, 0, buf, 8, NULL, NULL, NULL, 0,
			 CLIENT_MARGIN_MS);
	ep__group_free(g);
	pthread_mutex_unlock(&c->mu);
	/* The daemon also drops the rank when the connection is gone. */
	return rc == EP_ECONNRESET || rc == EP_ESHUTDOWN ? 0 : rc;
}

int ep__group_op_timeout(const ep_group_t *g)
{
	return (int)(g->timeout_ms ? g->timeout_ms : 3600000) +
	       CLIENT_MARGIN_MS;
}

int ep_barrier(ep_group_t *g)
{
	if (!g)
		return ep__fail(EP_EINVAL, "NULL group");
	uint8_t buf[8];
	put_gid(buf, g->id);
	pthread_mutex_lock(&g->conn->mu);
	int rc = ep__rpc(g->conn, EPP_BARRIER, 0, buf, 8, NULL, NULL, NULL, 0,
			 ep__group_op_timeout(g));
	pthread_mutex_unlock(&g->conn->mu);
	return rc;
}

int ep_daemon_status(ep_conn_t *c, char **json)
{
	if (!c || !json)
		return ep__fail(EP_EINVAL, "NULL argument");
	uint8_t *rep;
	uint32_t rlen;
	pthread_mutex_lock(&c->mu);
	int rc = ep__rpc(c, EPP_STATUS, 0, NULL, 0, &rep, &rlen, NULL, 0,
			 CLIENT_MARGIN_MS);
	pthread_mutex_unlock(&c->mu);
	if (rc)
		return rc;
	char *s = malloc((size_t)rlen + 1);
	if (!s) {
		free(rep);
		return ep__fail(EP_ENOMEM, "out of memory");
	}
	memcpy(s, rep, rlen);
	s[rlen] = 0;
	free(rep);
	*json = s;
	return 0;
}

uint64_t ep_group_id(const ep_group_t *g)
{
	return g ? g->id : 0;
}

uint32_t ep_group_rank(const ep_group_t *g)
{
	return g ? g->cfg.rank : 0;
}

uint32_t ep_group_world_size(const ep_group_t *g)
{
	return g ? g->cfg.world_size : 0;
}
