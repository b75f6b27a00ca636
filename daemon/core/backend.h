/* SPDX-License-Identifier: MIT */
/*
 * A device backend: where a GPU group's buffers live and how its ranks'
 * stream-ordered operations run. The host path (group.c, ops.c, the host
 * kernels) needs none of it: a host group has no backend (g->dev NULL).
 * A backend is compiled in by its Automake conditional and named in
 * server/registry.c; the server picks one at start (`backend =
 * auto|host|cuda`).
 *
 * The backend reports upward only through what it is given: a staged
 * operation's results come back through the completion callback it sets
 * on each member (epd_member_complete_fn), not through the server.
 */
#ifndef EPD_BACKEND_H
#define EPD_BACKEND_H

#include <stddef.h>
#include <stdint.h>

struct epd_server;
struct epd_group;
struct epd_member;
struct epd_aop;
struct epp_join;

struct epd_backend_ops {
	const char *name;
	/* Find the devices: 0, or -1 with why (the server then runs host
	 * groups only). */
	int (*init)(struct epd_server *srv, char *why, size_t len);
	void (*fini)(struct epd_server *srv);
	/* The devices as JSON (a jansson json_t *), or NULL. */
	void *(*status)(struct epd_server *srv);

	/* A device rank joins g (its region is made; nothing is replied). */
	int (*add_rank)(struct epd_group *g, struct epd_member *m,
			const struct epp_join *j, char *err, size_t errlen);
	void (*remove_rank)(struct epd_group *g, uint32_t l);
	/* A descriptor of rank l's region for the JOIN reply, and its size. */
	int (*export_region)(struct epd_group *g, uint32_t l, int *fd,
			     uint64_t *size);
	/* Every local rank joined. */
	int (*group_ready)(struct epd_group *g, char *err, size_t errlen);
	/* A stream-ordered op from m (checked against the group already). */
	void (*op)(struct epd_member *m, const struct epd_aop *op);
	/* m gives back its hold on handle seq (the ops it sent before may
	 * still use it): 0, or an EP_ code with why. */
	int (*release)(struct epd_group *g, struct epd_member *m, uint64_t seq,
		       char *err, size_t errlen);
	/* The group failed: errors to the ranks, every stream released.
	 * Idempotent. */
	void (*group_failed)(struct epd_group *g);
	void (*group_free)(struct epd_group *g);
	/* The group's device state as JSON, or NULL. */
	void *(*group_status)(struct epd_group *g);
	/* A descriptor of local rank l's low-latency region (all of the
	 * group's regions are made at the first call) and its size; NULL:
	 * no low-latency mode. */
	int (*ll_export)(struct epd_group *g, uint32_t l, int *fd,
			 uint64_t *size, char *err, size_t errlen);
	/* Local rank l's memory, n chunks (fds[i] of chunk[i] bytes, taken:
	 * closed whatever happens), mapped back to back: *id names it for
	 * l's combines, *bytes its size. NULL: no registered memory. */
	int (*mem_reg)(struct epd_group *g, uint32_t l, int *fds,
		       const uint64_t *chunk, uint32_t n, uint32_t *id,
		       uint64_t *bytes, char *err, size_t errlen);
	/* l is done with registration id (unmapped once no op of the group
	 * still reads it). */
	int (*mem_dereg)(struct epd_group *g, uint32_t l, uint32_t id,
			 char *err, size_t errlen);
};


#endif
