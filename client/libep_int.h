/* SPDX-License-Identifier: MIT */
/* libep internals. */
#ifndef LIBEP_INT_H
#define LIBEP_INT_H

#include <pthread.h>
#include <stdbool.h>

#include "ep/ep.h"
#include "epp.h"
#include "list.h"

struct ep_conn {
	int fd;
	pthread_mutex_t mu;
	uint64_t next_req;
	uint64_t client_id;
	int dead;      /* set once the stream is unusable */
	bool shutdown; /* the daemon announced its shutdown */
	char backend[16];
	struct list_node groups;
};

struct ep_group {
	struct list_node node; /* in conn->groups */
	ep_conn_t *conn;
	uint64_t id;
	uint32_t epoch, node_index;
	uint32_t timeout_ms;
	struct epp_join cfg;
	void *buf;
	size_t buf_size;
	struct epp_buf layout;
};

int ep__fail(int code, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
int ep__rpc(ep_conn_t *c, uint16_t type, uint16_t flags, const void *payload,
	    uint32_t len, uint8_t **reply, uint32_t *rlen, int *fds,
	    unsigned maxfds, int timeout_ms);
int ep__group_op_timeout(const ep_group_t *g);

#endif
