/* SPDX-License-Identifier: MIT */
/*
 * The public joins. They are libep's top: the one place that names both
 * the core (ep__join) and the cuda module's GPU part (ep__gpu, which a
 * build without CUDA defines as refusing), and hands the second to the
 * first, as the daemon's server/registry.c hands its backends down. The
 * core reaches the GPU part only through that table (tests/layering).
 */
#include "libep_int.h"

#include <stdlib.h>
#include <string.h>

int ep_join(ep_conn_t *c, const struct ep_group_config *cfg, unsigned flags,
	    ep_group_t **out)
{
	return ep__join(c, cfg, flags, 0, NULL, &ep__gpu, out);
}

/* The node list packed as the protocol carries it (names one after the
 * other, each ended by a NUL), checked; into *packed (malloc'd). */
static int pack_nodes(const struct ep_group_config *cfg,
		      const char *const *nodes, char **packed, uint32_t *count)
{
	if (!cfg->ranks_per_node || cfg->world_size % cfg->ranks_per_node)
		return ep__fail(EP_EINVAL,
				"ranks_per_node %u does not divide world_size "
				"%u",
				cfg->ranks_per_node, cfg->world_size);
	const uint32_t n = cfg->world_size / cfg->ranks_per_node;
	size_t bytes = 0;
	for (uint32_t i = 0; i < n; i++) {
		if (!nodes[i] || !epp_node_entry_valid(nodes[i]))
			return ep__fail(EP_EINVAL,
					"nodes[%u] is not a node name (1..%d "
					"of [A-Za-z0-9_.-]) or name@host:port",
					i, EP_NODE_NAME_MAX);
		bytes += strlen(nodes[i]) + 1;
	}
	char *p = malloc(bytes);
	if (!p)
		return ep__fail(EP_ENOMEM, "out of memory");
	*packed = p;
	for (uint32_t i = 0; i < n; i++) {
		size_t l = strlen(nodes[i]) + 1;
		memcpy(p, nodes[i], l);
		p += l;
	}
	*count = n;
	return 0;
}

int ep_join_ex(ep_conn_t *c, const struct ep_group_config *cfg,
	       const struct ep_join_opts *opts, unsigned flags,
	       ep_group_t **out)
{
	/* the caller's struct, as far as its size covers ours */
	struct ep_join_opts o = {0};
	if (opts) {
		if (opts->size < sizeof(size_t))
			return ep__fail(EP_EINVAL,
					"ep_join_opts.size %zu: set it to "
					"sizeof(struct ep_join_opts)",
					opts->size);
		memcpy(&o, opts, opts->size < sizeof(o) ? opts->size
							: sizeof(o));
	}
	if (!o.nodes && !o.recv_rows && !o.secret)
		return ep_join(c, cfg, flags, out);
	if (o.secret && (!o.secret_len || o.secret_len > EPP_SECRET_MAX))
		return ep__fail(EP_EINVAL, "a job secret of %zu bytes (1..%d)",
				o.secret_len, EPP_SECRET_MAX);
	if (!c || !cfg || !out)
		return ep__fail(EP_EINVAL, "NULL argument");
	if (c->minor < 21)
		return ep__fail(EP_EUNSUPPORTED,
				"the daemon speaks protocol 1.%u; node lists, "
				"recv_rows and job secrets need 1.21",
				c->minor);
	struct epp_join ext = {.recv_rows = o.recv_rows,
			       .secret = o.secret,
			       .secret_len = o.secret ? (uint32_t)o.secret_len
						      : 0};
	char *packed = NULL;
	if (o.nodes) {
		int rc = pack_nodes(cfg, o.nodes, &packed, &ext.num_nodes);
		if (rc)
			return rc;
		ext.nodes = packed;
	}
	int rc = ep__join(c, cfg, flags, 0, &ext, &ep__gpu, out);
	free(packed);
	return rc;
}

int ep_join_nodes(ep_conn_t *c, const struct ep_group_config *cfg,
		  const char *const *nodes, unsigned flags, ep_group_t **out)
{
	const struct ep_join_opts o = {.size = sizeof(o), .nodes = nodes};
	return ep_join_ex(c, cfg, &o, flags, out);
}
