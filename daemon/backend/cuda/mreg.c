/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend: registered memory (core/mreg.c). A rank's chunks of
 * device memory, imported from the descriptors it passed and mapped back
 * to back in the daemon's address space, for its combines to read the
 * expert rows in place (ekc_disp_args.yo). The import holds the physical
 * memory: whatever the rank frees or unmaps, the daemon's mapping stays
 * valid until it unmaps it, which it does only once no op of the group
 * can still read it (a deregistered entry waits for the stream to pass
 * the last combine that named it) or when the group goes.
 */
#include "cuda_int.h"

/* Unmap the first `bytes` of r's mappings (cuMemUnmap takes whole
 * mappings), then free its address range. */
static void unmap_chunks(CUdeviceptr va, uint64_t bytes, uint64_t reserved,
			 const uint64_t *chunk)
{
	for (uint64_t off = 0, i = 0; off < bytes; off += chunk[i++])
		cu_drv->cuMemUnmap(va + off, chunk[i]);
	if (va)
		cu_drv->cuMemAddressFree(va, reserved);
}

static void unmap(struct cu_mreg *r)
{
	unmap_chunks(r->va, r->bytes, r->reserved, r->chunk);
	free(r->chunk);
	r->chunk = NULL;
	r->va = 0;
	r->bytes = 0;
}

int epd_cuda_mem_reg(struct epd_group *g, uint32_t l, int *fds,
		     const uint64_t *chunk, uint32_t n, uint32_t *id,
		     uint64_t *bytes, char *err, size_t errlen)
{
	struct epd_cuda_group *c = g->dev_group;
	struct epd_cuda *cu = cu_state(g->srv);
	int di = g->local[l]->dev_index;
	struct cudev *d = &cu->dev[di];
	uint32_t live = 0;
	for (uint32_t i = 0; i < c->nmregs; i++)
		live += c->mregs[i].local == l && !c->mregs[i].dead;
	uint64_t total = 0;
	int rc = 0;
	for (uint32_t i = 0; !rc && i < n; i++) {
		if (!chunk[i] || chunk[i] % d->gran || chunk[i] > (1ull << 40)) {
			snprintf(err, errlen,
				 "chunk %u is %llu bytes (not a positive "
				 "multiple of the GPU's %zu-byte granularity)",
				 i, (unsigned long long)chunk[i], d->gran);
			rc = EP_EINVAL;
		}
		total += chunk[i];
	}
	if (!rc && live >= EPP_MAX_REGS) {
		snprintf(err, errlen,
			 "the rank holds %u registrations in this group (the "
			 "most); deregister one first",
			 live);
		rc = EP_ELIMIT;
	}
	if (!rc && c->nmregs == c->mreg_cap) {
		uint32_t cap = c->mreg_cap ? 2 * c->mreg_cap : 8;
		struct cu_mreg *p = realloc(c->mregs, cap * sizeof(*p));
		if (!p) {
			snprintf(err, errlen, "out of memory");
			rc = EP_ENOMEM;
		} else {
			c->mregs = p;
			c->mreg_cap = cap;
		}
	}
	if (!rc)
		rc = cu_use_dev(cu, di, err, errlen);
	if (rc) {
		epd_close_fds(fds, n);
		return rc;
	}
	struct cu_mreg r = {.local = l, .reserved = total};
	CUresult e = cu_drv->cuMemAddressReserve(&r.va, total, d->gran, 0, 0);
	const char *what = "cuMemAddressReserve";
	if (e)
		r.va = 0;
	for (uint32_t i = 0; !e && i < n; i++) {
		CUmemGenericAllocationHandle h;
		what = "cuMemImportFromShareableHandle (not a descriptor of "
		       "GPU memory made with POSIX file-descriptor handles?)";
		e = cu_drv->cuMemImportFromShareableHandle(
			&h, (void *)(intptr_t)fds[i],
			CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
		close(fds[i]);
		fds[i] = -1;
		if (e)
			break;
		what = "cuMemMap (a chunk smaller than the rank said?)";
		e = cu_drv->cuMemMap(r.va + r.bytes, chunk[i], 0, h, 0);
		/* the mapping holds the memory now (or nothing does) */
		cu_drv->cuMemRelease(h);
		if (!e)
			r.bytes += chunk[i];
	}
	if (!e) {
		/* as the rank's region: every GPU of the daemon that can
		 * reach it (a group's kernels run on any of its GPUs) */
		CUmemAccessDesc acc[MAX_DEV];
		int nacc = 0;
		for (int i = 0; i < cu->ndev; i++) {
			int ok = i == di;
			if (!ok)
				cu_drv->cuDeviceCanAccessPeer(&ok, cu->dev[i].dev,
							 d->dev);
			if (ok)
				acc[nacc++] = (CUmemAccessDesc){
					.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE,
						     .id = i},
					.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
		}
		what = "cuMemSetAccess";
		e = cu_drv->cuMemSetAccess(r.va, r.bytes, acc, (size_t)nacc);
	}
	epd_close_fds(fds, n);
	if (!e) {
		r.chunk = malloc(n * sizeof(*r.chunk));
		if (!r.chunk) {
			unmap_chunks(r.va, r.bytes, r.reserved, chunk);
			snprintf(err, errlen, "out of memory");
			return EP_ENOMEM;
		}
		memcpy(r.chunk, chunk, n * sizeof(*r.chunk));
	}
	if (e) {
		unmap_chunks(r.va, r.bytes, r.reserved, chunk);
		ekc_fail(cu_drv, e, what, err, errlen);
		return EP_EINVAL;
	}
	/* ids are never 0 and not reused while the group lives */
	r.id = ++c->mreg_next;
	c->mregs[c->nmregs++] = r;
	*id = r.id;
	*bytes = r.bytes;
	epd_debug("group %s: rank %u registered %llu MiB in %u chunks as %u",
		  g->shape.name, g->local[l]->rank,
		  (unsigned long long)(r.bytes >> 20), n, r.id);
	return 0;
}

/* Unmap deregistered entries that no op can read any more. */
void cu_mreg_sweep(struct epd_cuda_group *c)
{
	for (uint32_t i = 0; i < c->nmregs;) {
		struct cu_mreg *r = &c->mregs[i];
		if (r->dead && r->last_k <= c->completed) {
			unmap(r);
			c->mregs[i] = c->mregs[--c->nmregs];
		} else {
			i++;
		}
	}
}

struct cu_mreg *cu_mreg_find(struct epd_cuda_group *c, uint32_t l,
			     uint32_t id)
{
	for (uint32_t i = 0; i < c->nmregs; i++)
		if (c->mregs[i].id == id && c->mregs[i].local == l)
			return &c->mregs[i];
	return NULL;
}

int epd_cuda_mem_dereg(struct epd_group *g, uint32_t l, uint32_t id,
		       char *err, size_t errlen)
{
	struct epd_cuda_group *c = g->dev_group;
	struct cu_mreg *r = c ? cu_mreg_find(c, l, id) : NULL;
	if (!r || r->dead) {
		snprintf(err, errlen, "rank %u has no registration %u",
			 g->local[l]->rank, id);
		return EP_EINVAL;
	}
	r->dead = true;
	if (g->state == EPD_G_READY) {
		cu_refresh_completed(g);
		cu_mreg_sweep(c);
		cu_poll_arm(c);
	}
	return 0;
}

/* The group goes: its streams drained (drained) or not (then the
 * mappings stay, as the regions do: work still running may read them). */
void cu_mreg_free(struct epd_cuda_group *c, bool drained)
{
	for (uint32_t i = 0; i < c->nmregs; i++) {
		if (drained)
			unmap(&c->mregs[i]);
		else
			free(c->mregs[i].chunk); /* the mapping stays */
	}
	free(c->mregs);
	c->mregs = NULL;
	c->nmregs = c->mreg_cap = 0;
}
