/* SPDX-License-Identifier: MIT */
/* The daemon's clock, for every layer and thread. */
#ifndef EPD_CLOCK_H
#define EPD_CLOCK_H

#include <stdint.h>

/* CLOCK_MONOTONIC in ns. */
uint64_t epd_now_ns(void);

#endif
