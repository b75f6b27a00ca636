/* SPDX-License-Identifier: MIT */
/* What the daemon's polling threads (host barrier, RDMA proxy) share: the
 * monotonic clock (clock.h) and a pause between polls. */
#ifndef EPD_SPIN_H
#define EPD_SPIN_H

#include "clock.h"

static inline void epd_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ volatile("yield" ::: "memory");
#endif
}

#endif
