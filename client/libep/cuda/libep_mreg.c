/* SPDX-License-Identifier: MIT */
/*
 * libep: registered memory (ep_mem_register). The rank's own device memory,
 * found allocation by allocation (cuMemRetainAllocationHandle), exported
 * as POSIX file descriptors and passed to the daemon, which maps the
 * allocations back to back as they lie here (daemon/core/mreg.c). libep
 * keeps a reference on each allocation while it is registered: its handle
 * value then names that allocation alone, so ep_mem_covers can tell
 * whether the caller's allocator has since mapped another one at the same
 * addresses (the daemon's mapping would still show the old memory).
 */
#include "libep_cuda_int.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct ep_mreg {
	struct list_node node; /* in group->mregs */
	ep_group_t *g;
	uint32_t id;
	uint32_t n;
	uint64_t base, bytes;
	uint64_t chunk[EP_MEM_REG_CHUNKS];
	CUmemGenericAllocationHandle h[EP_MEM_REG_CHUNKS];
};

/* The allocation mapped at a, retained (0: nothing of the VMM API). */
static CUmemGenericAllocationHandle held_at(uint64_t a)
{
	CUmemGenericAllocationHandle h;
	if (ep__drv.cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)a))
		return 0;
	return h;
}

/* Is allocation h mapped at a (nothing retained on return)? */
static bool same_at(uint64_t a, CUmemGenericAllocationHandle h)
{
	CUmemGenericAllocationHandle x = held_at(a);
	if (x)
		ep__drv.cuMemRelease(x);
	return x && x == h;
}

static void mr_free(ep_mreg_t *mr)
{
	for (uint32_t i = 0; i < mr->n; i++)
		ep__drv.cuMemRelease(mr->h[i]);
	list_del(&mr->node);
	free(mr);
}

/* Walk the allocations under [p, p + len) at granularity gran: their
 * extents and retained handles into mr (mr->n of them). */
static int walk(ep_mreg_t *mr, uint64_t p, uint64_t len, uint64_t gran)
{
	CUmemGenericAllocationHandle h = held_at(p);
	if (!h)
		return ep__fail(EP_EUNSUPPORTED,
				"0x%llx is not memory of the CUDA virtual "
				"memory API (cuMemCreate; PyTorch: "
				"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
				"True)",
				(unsigned long long)p);
	uint64_t a = p - p % gran;
	while (a >= gran && same_at(a - gran, h))
		a -= gran;
	mr->base = a;
	const uint64_t end = p + len;
	for (;;) {
		if (mr->n == EP_MEM_REG_CHUNKS) {
			ep__drv.cuMemRelease(h);
			return ep__fail(EP_ETOOBIG,
					"more than %d allocations under "
					"0x%llx + %llu",
					EP_MEM_REG_CHUNKS,
					(unsigned long long)p,
					(unsigned long long)len);
		}
		uint64_t e = a + gran;
		while (same_at(e, h))
			e += gran;
		mr->h[mr->n] = h;
		mr->chunk[mr->n++] = e - a;
		if (e >= end)
			break;
		a = e;
		h = held_at(a);
		if (!h)
			return ep__fail(EP_EINVAL,
					"0x%llx + %llu: nothing is mapped at "
					"0x%llx",
					(unsigned long long)p,
					(unsigned long long)len,
					(unsigned long long)a);
	}
	mr->bytes = a + mr->chunk[mr->n - 1] - mr->base;
	return 0;
}

int ep_mem_register(ep_group_t *g, const void *ptr, size_t len,
		    ep_mreg_t **out)
{
	if (!g || !ptr || !len || !out)
		return ep__fail(EP_EINVAL, "NULL argument or empty range");
	if (g->cuda_device < 0 || !g->dev_ptr)
		return ep__fail(EP_EUNSUPPORTED,
				"registered memory is a GPU rank's (join with "
				"EP_JOIN_CUDA)");
	int rc = ep__use_ctx(g->cuda_device);
	if (rc)
		return rc;
	CUmemAllocationProp prop = {
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE,
			     .id = g->cuda_device}};
	size_t gran = 0;
	CUresult r = ep__drv.cuMemGetAllocationGranularity(
		&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	if (r || !gran)
		return r ? ep__cufail(r, "cuMemGetAllocationGranularity")
			 : ep__fail(EP_EBACKEND, "no allocation granularity");
	ep_mreg_t *mr = calloc(1, sizeof(*mr));
	if (!mr)
		return ep__fail(EP_ENOMEM, "out of memory");
	LIST_INIT(&mr->node);
	mr->g = g;
	rc = walk(mr, (uint64_t)(uintptr_t)ptr, len, gran);
	int fds[EP_MEM_REG_CHUNKS];
	uint32_t nfd = 0;
	for (; !rc && nfd < mr->n; nfd++) {
		int fd = -1;
		r = ep__drv.cuMemExportToShareableHandle(
			&fd, mr->h[nfd], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
			0);
		if (r) {
			rc = ep__fail(EP_EUNSUPPORTED,
				      "the allocation at 0x%llx cannot be "
				      "exported as a file descriptor (made "
				      "without CU_MEM_HANDLE_TYPE_POSIX_FILE_"
				      "DESCRIPTOR; CUresult %d)",
				      (unsigned long long)mr->base, (int)r);
			break;
		}
		fds[nfd] = fd;
	}
	if (!rc) {
		struct epp_mem_reg m = {.group_id = g->id, .nchunks = mr->n};
		memcpy(m.chunk, mr->chunk, mr->n * sizeof(m.chunk[0]));
		uint8_t buf[16 + 8 * EP_MEM_REG_CHUNKS], *rep = NULL;
		uint32_t rlen = 0;
		size_t n = epp_mem_reg_encode(&m, buf, sizeof(buf));
		pthread_mutex_lock(&g->conn->mu);
		rc = ep__rpc_fds(g->conn, EPP_MEM_REG, 0, buf, (uint32_t)n, fds,
				 nfd, &rep, &rlen, NULL, 0, EP__CTL_TIMEOUT_MS);
		pthread_mutex_unlock(&g->conn->mu);
		struct epp_mem_reg_ok ok;
		if (!rc && (epp_mem_reg_ok_decode(rep, rlen, &ok) || !ok.reg ||
			    ok.bytes != mr->bytes))
			rc = ep__fail(EP_EPROTO, "malformed mem-reg reply");
		free(rep);
		if (!rc)
			mr->id = ok.reg;
	}
	for (uint32_t i = 0; i < nfd; i++)
		close(fds[i]);
	if (rc) {
		mr_free(mr);
		return rc;
	}
	pthread_mutex_lock(&g->conn->mu);
	list_add_tail(&g->mregs, &mr->node);
	pthread_mutex_unlock(&g->conn->mu);
	*out = mr;
	return 0;
}

int ep_mem_covers(const ep_mreg_t *mr, const void *ptr, size_t len)
{
	if (!mr)
		return ep__fail(EP_EINVAL, "NULL registration");
	const uint64_t p = (uint64_t)(uintptr_t)ptr;
	if (p < mr->base || len > mr->bytes || p - mr->base > mr->bytes - len)
		return 0;
	uint64_t a = mr->base;
	for (uint32_t i = 0; i < mr->n; a += mr->chunk[i++])
		if (a + mr->chunk[i] > p && a < p + len &&
		    !same_at(a, mr->h[i]))
			return 0;
	return 1;
}

void ep_mem_range(const ep_mreg_t *mr, uint64_t *base, size_t *len)
{
	*base = mr ? mr->base : 0;
	*len = mr ? (size_t)mr->bytes : 0;
}

int ep__mreg_place(const ep_group_t *g, const ep_mreg_t *mr, const void *y,
		   size_t len, uint32_t *id, uint64_t *off)
{
	if (!mr || mr->g != g)
		return ep__fail(EP_EINVAL, "a registration of another group");
	*id = mr->id;
	*off = 0;
	if (!len) /* nothing is read: no place to check */
		return 0;
	int c = ep_mem_covers(mr, y, len);
	if (c < 0)
		return c;
	if (!c)
		return ep__fail(EP_ESTALE,
				"0x%llx + %zu is not inside registration %u "
				"(0x%llx + %llu), or another allocation is "
				"mapped there now",
				(unsigned long long)(uintptr_t)y, len, mr->id,
				(unsigned long long)mr->base,
				(unsigned long long)mr->bytes);
	*off = (uint64_t)(uintptr_t)y - mr->base;
	return 0;
}

int ep_mem_deregister(ep_mreg_t *mr)
{
	if (!mr)
		return ep__fail(EP_EINVAL, "NULL registration");
	ep_group_t *g = mr->g;
	struct epp_mem_dereg m = {.group_id = g->id, .reg = mr->id};
	uint8_t buf[16];
	size_t n = epp_mem_dereg_encode(&m, buf, sizeof(buf));
	pthread_mutex_lock(&g->conn->mu);
	int rc = ep__rpc(g->conn, EPP_MEM_DEREG, 0, buf, (uint32_t)n, NULL,
			 NULL, NULL, 0, EP__CTL_TIMEOUT_MS);
	mr_free(mr);
	pthread_mutex_unlock(&g->conn->mu);
	/* a failed group or a lost daemon dropped it already */
	return rc == EP_ECONNRESET || rc == EP_ESHUTDOWN || rc == EP_EFAILED
		       ? 0
		       : rc;
}

void ep__mreg_fini(ep_group_t *g)
{
	if (!g->mregs.next) /* never initialised: no GPU rank */
		return;
	while (!LIST_EMPTY(&g->mregs))
		mr_free(LIST_ENTRY(g->mregs.next, ep_mreg_t, node));
}
