/* SPDX-License-Identifier: MIT */
/* What group.c and coll.c share, inside the core. */
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

#endif
