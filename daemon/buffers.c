/* SPDX-License-Identifier: MIT */
/* Group buffers on the host backend: one memfd per group, mapped by the
 * daemon's workers and by every rank (passed with SCM_RIGHTS). */
#include "epd.h"

#include <errno.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

uint64_t epd_buf_size(const struct epp_join *shape)
{
	(void)shape;
	return 4096;
}

int epd_buf_create(struct epd_group *g)
{
	char name[96];
	snprintf(name, sizeof(name), "epd:%s", g->shape.name);
	int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0) {
		epd_err("memfd_create for group %s: %m", g->shape.name);
		return -errno;
	}
	uint64_t size = epd_buf_size(&g->shape);
	if (ftruncate(fd, (off_t)size)) {
		int e = errno;
		epd_err("ftruncate of %lu bytes for group %s: %m",
			(unsigned long)size, g->shape.name);
		close(fd);
		return -e;
	}
	/* The size is part of the contract with the ranks: seal it. */
	fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
	g->buf_fd = fd;
	g->buf_size = size;
	return 0;
}

void epd_buf_destroy(struct epd_group *g)
{
	if (g->buf_fd >= 0)
		close(g->buf_fd);
	g->buf_fd = -1;
}
