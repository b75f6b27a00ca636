/* SPDX-License-Identifier: MIT */
/*
 * Built without libsystemd (sd.h): epd runs, and is told nothing by and
 * tells nothing to a service manager (a unit with Type=notify or socket
 * activation needs the libsystemd build).
 */
#include "sd.h"

void epd_sd_notify(const char *fmt, ...)
{
	(void)fmt;
}

int epd_sd_listen_fds(void)
{
	return 0;
}

uint64_t epd_sd_watchdog_usec(void)
{
	return 0;
}

int epd_sd_first_fd(void)
{
	return 3;
}
