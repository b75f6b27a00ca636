/* SPDX-License-Identifier: MIT */
/* The daemon's clock: monotonic nanoseconds, for every layer. */
#include "clock.h"

#include <time.h>

uint64_t epd_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
