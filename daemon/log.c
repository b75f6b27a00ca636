/* SPDX-License-Identifier: MIT */
#include "log.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

int epd_log_level = EPD_LOG_INFO;
static bool journal;

static const char *const names[] = {
	[EPD_LOG_ERR] = "error", [EPD_LOG_WARN] = "warning",
	[EPD_LOG_NOTICE] = "notice", [EPD_LOG_INFO] = "info",
	[EPD_LOG_DEBUG] = "debug",
};

int epd_log_parse_level(const char *s)
{
	for (int i = EPD_LOG_ERR; i <= EPD_LOG_DEBUG; i++)
		if (!strcmp(s, names[i]))
			return i;
	if (!strcmp(s, "warn"))
		return EPD_LOG_WARN;
	return -1;
}

const char *epd_log_level_name(int level)
{
	return level >= EPD_LOG_ERR && level <= EPD_LOG_DEBUG ? names[level]
							      : "?";
}

void epd_log_init(void)
{
	/* JOURNAL_STREAM is "dev:ino" of the journal's stream socket. */
	const char *js = getenv("JOURNAL_STREAM");
	struct stat st;
	unsigned long dev, ino;
	if (js && sscanf(js, "%lu:%lu", &dev, &ino) == 2 &&
	    fstat(2, &st) == 0 && st.st_dev == dev && st.st_ino == ino)
		journal = true;
}

void epd_log(int level, const char *fmt, ...)
{
	if (level > epd_log_level)
		return;
	char line[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	if (journal) {
		fprintf(stderr, "<%d>%s\n", level, line);
	} else {
		struct timespec ts;
		struct tm tm;
		clock_gettime(CLOCK_REALTIME, &ts);
		gmtime_r(&ts.tv_sec, &tm);
		fprintf(stderr, "%02d:%02d:%02d.%03ld epd %s: %s\n", tm.tm_hour,
			tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000L,
			epd_log_level_name(level), line);
	}
}
