/* SPDX-License-Identifier: MIT */
/*
 * LL_MAP: a GPU rank's share of the low-latency mode. Its ops run as
 * kernels on the rank's own stream (kernels/cuda/ekc_ll.cu) and write
 * straight into the other local ranks' low-latency regions; the daemon
 * owns those regions (made at the first request, freed with the group),
 * hands each rank a descriptor of every one, and never reads them: every
 * byte there is written by ranks. One node only: across nodes the rows
 * would need the daemons' proxy, which this mode does not have yet.
 */
#include "backend.h"
#include "core.h"
#include "group_int.h"

#include <unistd.h>

int epd_one_node_gpu(const struct epd_group *g, bool backend_has,
		     const char *what, const char **why)
{
	const struct epp_join *s = &g->shape;
	static __thread char msg[160];
	if (g->state == EPD_G_FAILED)
		return *why = "the group failed", EP_EFAILED;
	if (g->state != EPD_G_READY)
		return *why = "not every rank of the group joined", EP_ENOTREADY;
	if (!backend_has)
		snprintf(msg, sizeof(msg),
			 "%s is for GPU ranks (this group's ranks are host "
			 "ranks)",
			 what);
	else if (s->world_size != s->ranks_per_node)
		snprintf(msg, sizeof(msg),
			 "%s serves groups of one node (this group spans "
			 "several)",
			 what);
	else
		return 0;
	*why = msg;
	return EP_EUNSUPPORTED;
}

int epd_op_ll_map(struct epd_session *c, uint64_t req_id,
		  const struct epp_ll_map *lm)
{
	struct epd_member *m = epd_member_lookup(c, req_id, lm->group_id);
	if (!m)
		return EP_ENOGROUP;
	struct epd_group *g = m->group;
	const struct epp_join *s = &g->shape;
	const char *why = NULL;
	int rc = epd_one_node_gpu(g, g->dev && g->dev->ll_export,
				  "the low-latency mode", &why);
	if (!rc && lm->local >= s->ranks_per_node)
		rc = EP_EINVAL, why = "no such local rank";
	if (rc) {
		epd_session_error(c, req_id, rc, "ll-map of group %s: %s",
				 s->name, why);
		return rc;
	}
	char err[EPP_ERRMSG_MAX];
	int fd = -1;
	uint64_t size = 0;
	rc = g->dev->ll_export(g, lm->local, &fd, &size, err, sizeof(err));
	if (rc) {
		epd_session_error(c, req_id, rc, "ll-map of group %s: %s",
				 s->name, err);
		return rc;
	}
	struct epp_ll_map_ok ok = {.size = size,
				   .local = lm->local,
				   .gpu = (uint32_t)g->local[lm->local]->dev_index};
	uint8_t buf[32];
	size_t n = epp_ll_map_ok_encode(&ok, buf, sizeof(buf));
	epd_session_send(c, EPP_OK, 0, req_id, buf, (uint32_t)n, &fd, 1);
	return 0;
}
