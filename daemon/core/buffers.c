/* SPDX-License-Identifier: MIT */
/* Group buffers on the host backend: one memfd per group, mapped by the
 * daemon (its data-path threads work in it) and by every rank (passed with
 * SCM_RIGHTS). Sparse: only pages that are written take memory. */
#include "core.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

int epd_buf_create(struct epd_group *g)
{
	char name[96];
	int rc = epp_buf_layout(&g->shape, &g->layout);
	if (rc) {
		epd_err("group %s: buffers of %llu bytes exceed the limit",
			g->shape.name, (unsigned long long)g->layout.total);
		return rc;
	}
	snprintf(name, sizeof(name), "epd:%s", g->shape.name);
	int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0) {
		rc = errno == EMFILE || errno == ENFILE ? EP_ELIMIT : -errno;
		epd_err("memfd_create for group %s: %m", g->shape.name);
		return rc;
	}
	uint64_t size = g->layout.total;
	if (ftruncate(fd, (off_t)size)) {
		rc = -errno;
		epd_err("ftruncate of %llu bytes for group %s: %m",
			(unsigned long long)size, g->shape.name);
		goto err_fd;
	}
	/* The size is part of the contract with the ranks: seal it. */
	fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
	void *map = mmap(NULL, size, PROT_READ | PROT_WRITE,
			 MAP_SHARED | MAP_NORESERVE, fd, 0);
	if (map == MAP_FAILED) {
		rc = -errno;
		epd_err("mmap of %llu bytes for group %s: %m",
			(unsigned long long)size, g->shape.name);
		goto err_fd;
	}
	g->buf_fd = fd;
	g->buf_size = size;
	g->map = map;
	return 0;

err_fd:
	close(fd);
	return rc;
}

void epd_buf_destroy(struct epd_group *g)
{
	if (g->map)
		munmap(g->map, g->buf_size);
	g->map = NULL;
	if (g->buf_fd >= 0)
		close(g->buf_fd);
	g->buf_fd = -1;
}
