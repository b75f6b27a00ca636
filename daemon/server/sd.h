/* SPDX-License-Identifier: MIT */
/*
 * The service manager: state notifications and socket activation. With
 * libsystemd, sd.c (sd_notify, sd_listen_fds); without it, sd_none.c:
 * there is no manager to tell and no socket passed.
 */
#ifndef EPD_SD_H
#define EPD_SD_H

#include <stdint.h>

/* Tell the manager (READY=1, STATUS=..., see sd_notify(3)). */
void epd_sd_notify(const char *fmt, ...)
	__attribute__((format(printf, 1, 2)));
/* The number of sockets the manager passed (they start at fd
 * epd_sd_first_fd()), or a negative errno. */
int epd_sd_listen_fds(void);
int epd_sd_first_fd(void);
/* The service manager's watchdog interval (WatchdogSec=), in us, or 0
 * when it watches nothing: then epd sends WATCHDOG=1 twice per interval
 * from its loop, so a loop that stands still gets the service restarted. */
uint64_t epd_sd_watchdog_usec(void);

#endif
