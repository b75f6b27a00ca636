/* SPDX-License-Identifier: MIT */
/* What group.c, join.c and coll.c share, inside the core. */
#ifndef EPD_GROUP_INT_H
#define EPD_GROUP_INT_H

#include "core.h"

/* The group's join or collective timer fired. */
void epd_group_timeout(uv_timer_t *t);
/* The member of c in group gid, or NULL (replied with the error). */
struct epd_member *epd_member_lookup(struct epd_session *c, uint64_t req_id,
				     uint64_t gid);
/* For epd_list_ranks: local index l has not joined. */
bool epd_not_joined(struct epd_group *g, uint32_t l, void *arg);
/* The hash of a job's secret (keyed BLAKE2b, 32 bytes). */
void epd_secret_hash(const struct epp_join *j, uint8_t out[32]);
/* Every local rank joined: ready (across nodes once its nodes are up),
 * its waiting joiners answered; or still waiting for its nodes. */
void epd_group_became_ready(struct epd_group *g);
/* Member m's JOIN answered (its group's id, buffers and descriptors). */
void epd_join_reply(struct epd_member *m);
/* Group ch, linked to group pname, fails as that one did (why). */
void epd_group_link_fail(struct epd_group *ch, int code, const char *pname,
			 const char *why);
/* Group g's own arrays (members, barrier and node tables) and g itself
 * freed: what group_create allocates before anything else holds it. */
void epd_group_mem_free(struct epd_group *g);
/* The group gone: out of the server's list, its timer closed, then
 * freed. */
void epd_group_destroy(struct epd_group *g);

#endif
