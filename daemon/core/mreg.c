/* SPDX-License-Identifier: MIT */
/*
 * MEM_REG and MEM_DEREG: a GPU rank's own device memory, imported by the
 * daemon (the backend maps the chunks the rank passed as descriptors) so
 * that its combines read the expert rows where the rank wrote them, with
 * no copy into its region. The descriptors prove the rank holds the
 * memory (SCM_RIGHTS; nothing in the frame names memory by address), and
 * the import keeps the physical memory alive whatever the rank frees, so a
 * rank can make the daemon read only its own bytes, never fault.
 * Registrations belong to one rank of one group and go with the group.
 */
#include "backend.h"
#include "core.h"
#include "group_int.h"

int epd_op_mem_reg(struct epd_session *c, uint64_t req_id,
		   const struct epp_mem_reg *mr, int *fds)
{
	struct epd_member *m = epd_member_lookup(c, req_id, mr->group_id);
	if (!m) {
		epd_close_fds(fds, mr->nchunks);
		return EP_ENOGROUP;
	}
	struct epd_group *g = m->group;
	const struct epp_join *s = &g->shape;
	const char *why = NULL;
	int rc = epd_one_node_gpu(g, g->dev && g->dev->mem_reg,
				  "registered memory", &why);
	if (rc) {
		epd_close_fds(fds, mr->nchunks);
		epd_session_error(c, req_id, rc, "mem-reg in group %s: %s",
				 s->name, why);
		return rc;
	}
	char err[EPP_ERRMSG_MAX];
	struct epp_mem_reg_ok ok = {0};
	/* the backend takes the descriptors (closes them, success or not) */
	rc = g->dev->mem_reg(g, m->local, fds, mr->chunk, mr->nchunks, &ok.reg,
			     &ok.bytes, err, sizeof(err));
	if (rc) {
		epd_session_error(c, req_id, rc, "mem-reg in group %s: %s",
				 s->name, err);
		return rc;
	}
	uint8_t buf[16];
	size_t n = epp_mem_reg_ok_encode(&ok, buf, sizeof(buf));
	epd_session_send(c, EPP_OK, 0, req_id, buf, (uint32_t)n, NULL, 0);
	return 0;
}

int epd_op_mem_dereg(struct epd_session *c, uint64_t req_id,
		     const struct epp_mem_dereg *md)
{
	struct epd_member *m = epd_member_lookup(c, req_id, md->group_id);
	if (!m)
		return EP_ENOGROUP;
	struct epd_group *g = m->group;
	char err[EPP_ERRMSG_MAX] = "";
	int rc = g->dev && g->dev->mem_dereg
			 ? g->dev->mem_dereg(g, m->local, md->reg, err,
					     sizeof(err))
			 : EP_EINVAL;
	if (rc) {
		epd_session_error(c, req_id, rc, "mem-dereg in group %s: %s",
				 g->shape.name,
				 *err ? err : "no such registration");
		return rc;
	}
	epd_session_send(c, EPP_OK, 0, req_id, NULL, 0, NULL, 0);
	return 0;
}
