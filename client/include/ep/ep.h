/* SPDX-License-Identifier: MIT */
/*
 * libep: the client library of epd, the expert-parallel communication daemon.
 *
 * A rank (one process per GPU, usually) connects to its node's epd, joins a
 * group, and runs collective operations on it. The daemon owns the
 * communication buffers; the client maps them.
 *
 * Errors: every function that can fail returns 0 or a negative code below
 * (negative errno values, or private codes at -1000 and lower). ep_strerror()
 * names a code; ep_errmsg() gives the calling thread's most recent detailed
 * message (for example which ranks never arrived at a barrier).
 *
 * Threads: calls on one ep_conn_t (and its groups) are serialized by a mutex
 * inside the handle, so a connection may be shared between threads, but a
 * thread blocked in a collective holds the connection until it returns. Use
 * one connection per thread for concurrent collectives.
 */
#ifndef EP_EP_H
#define EP_EP_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EP_VERSION_MAJOR 0
#define EP_VERSION_MINOR 1

/* Error codes. Values from errno are negated; private ones start at -1000. */
enum {
	EP_OK = 0,
	EP_EINVAL = -EINVAL,            /* an argument is out of range */
	EP_ENOMEM = -ENOMEM,            /* out of memory */
	EP_ETIMEDOUT = -ETIMEDOUT,      /* a collective did not complete in time */
	EP_ECONNREFUSED = -ECONNREFUSED,/* no daemon listens on the socket */
	EP_ENOENT = -ENOENT,            /* the socket path does not exist */
	EP_EACCES = -EACCES,            /* the daemon refused this user */
	EP_EBUSY = -EBUSY,              /* an operation is already in flight */
	EP_EPROTO = -EPROTO,            /* a malformed frame */
	EP_ECONNRESET = -ECONNRESET,    /* the daemon closed the connection */
	EP_EPEERLOST = -1001,           /* a rank of the group left or died */
	EP_EVERSION = -1002,            /* protocol major versions differ */
	EP_EMISMATCH = -1003,           /* JOIN contradicts the existing group */
	EP_ENOTREADY = -1004,           /* not every rank of the group joined yet */
	EP_EDUPRANK = -1005,            /* that rank of the group is taken */
	EP_ESHUTDOWN = -1006,           /* the daemon is shutting down */
	EP_ENOGROUP = -1007,            /* no such group on this connection */
	EP_EFAILED = -1008,             /* the group failed earlier; rejoin */
	EP_ESTALE = -1009,              /* a handle from another group or epoch */
	EP_ETOOBIG = -1010,             /* exceeds what the group was sized for */
	EP_ESHAPE = -1011,              /* hidden, dtype or top-k do not match */
	EP_EEXPERT = -1012,             /* an expert index is out of range */
	EP_EUNSUPPORTED = -1013,        /* not supported by this daemon/backend */
	EP_EBACKEND = -1014,            /* the backend failed (device error) */
};

/* Name of an error code; never NULL. */
const char *ep_strerror(int code);

/* The calling thread's most recent detailed error message, or "". */
const char *ep_errmsg(void);

typedef enum {
	EP_DTYPE_BF16 = 1, /* bfloat16, raw 16-bit storage */
	EP_DTYPE_FP8 = 2,  /* fp8 e4m3 with fp32 scales per 128 channels */
} ep_dtype_t;

typedef struct ep_conn ep_conn_t;
typedef struct ep_group ep_group_t;

/* Connect to the daemon. path NULL: $EPD_SOCKET, else /run/epd/epd.sock. */
int ep_connect(const char *path, ep_conn_t **out);

/* Close the connection: leaves every group still joined on it. */
void ep_close(ep_conn_t *conn);

#define EP_GROUP_NAME_MAX 63

struct ep_group_config {
	const char *name;            /* [A-Za-z0-9_.:-], 1..63 characters */
	uint32_t world_size;         /* ranks in the group, all nodes */
	uint32_t ranks_per_node;     /* ranks on each node */
	uint32_t rank;               /* this rank, node_index*rpn + local */
	/* The MoE shape the group's buffers are sized for. */
	uint32_t num_experts;        /* multiple of world_size */
	uint32_t hidden;             /* multiple of 128 */
	uint32_t max_tokens_per_rank;
	uint32_t topk;               /* 1..32 */
	ep_dtype_t dtype;
	uint32_t timeout_ms;         /* collective timeout; 0: daemon default */
};

#define EP_JOIN_NOWAIT 0x1u /* return before every local rank joined */

/* Join (or create) a group. Blocks until every rank of this node joined
 * (or the timeout passed) unless flags has EP_JOIN_NOWAIT. */
int ep_join(ep_conn_t *conn, const struct ep_group_config *cfg,
	    unsigned flags, ep_group_t **out);

/* Leave the group and free the handle. The other ranks' pending and later
 * operations on the group fail with EP_EPEERLOST. */
int ep_leave(ep_group_t *group);

/* Global barrier: no rank returns before every rank of the group entered.
 * Two sequential phases: the scale-out rail, then the node. */
int ep_barrier(ep_group_t *group);

/* The daemon's status (version, clients, groups) as a JSON document;
 * *json is malloc'd, the caller frees it. */
int ep_daemon_status(ep_conn_t *conn, char **json);

/* Identity of a joined group. */
uint64_t ep_group_id(const ep_group_t *group);
uint32_t ep_group_rank(const ep_group_t *group);
uint32_t ep_group_world_size(const ep_group_t *group);

#ifdef __cplusplus
}
#endif
#endif /* EP_EP_H */
