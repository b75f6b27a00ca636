/* SPDX-License-Identifier: MIT */
/* The service manager through libsystemd (sd.h). */
#include "sd.h"

#include <stdarg.h>
#include <stdio.h>
#include <systemd/sd-daemon.h>

void epd_sd_notify(const char *fmt, ...)
{
	char msg[256];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	sd_notify(0, msg);
}

int epd_sd_listen_fds(void)
{
	return sd_listen_fds(1);
}

uint64_t epd_sd_watchdog_usec(void)
{
	uint64_t usec = 0;
	return sd_watchdog_enabled(0, &usec) > 0 ? usec : 0;
}

int epd_sd_first_fd(void)
{
	return SD_LISTEN_FDS_START;
}
