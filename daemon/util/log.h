/* SPDX-License-Identifier: MIT */
/* Logging: lowercase messages, the observed cause; level set at run time. */
#ifndef EPD_LOG_H
#define EPD_LOG_H

#include <stddef.h>

enum epd_log_level {
	EPD_LOG_ERR = 3,
	EPD_LOG_WARN = 4,
	EPD_LOG_NOTICE = 5,
	EPD_LOG_INFO = 6,
	EPD_LOG_DEBUG = 7,
};

extern int epd_log_level;

/* Parse "error|warning|notice|info|debug"; -1 if unknown. */
int epd_log_parse_level(const char *s);
const char *epd_log_level_name(int level);
/* When stderr is the journal (JOURNAL_STREAM): each message goes to it
 * with sd_journal_send, carrying EPD_GROUP, EPD_NODE, EPD_RANK and
 * EPD_PID fields where the message names them (else a <N> prefix). */
void epd_log_init(void);

/* The subject fields of a message, "" where it names none. */
struct epd_log_fields {
	char group[80], node[80], rank[16], pid[16];
};
void epd_log_fields(const char *line, struct epd_log_fields *f);
void epd_log(int level, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
/* From here on, this thread's first error message is also kept in buf
 * (cap bytes; "" until one comes); NULL stops. The error of a reload
 * that failed, for the status. */
void epd_log_capture(char *buf, size_t cap);

#include <stdint.h>

/* Warnings caused from outside (refused connections, peers, descriptor
 * exhaustion) go through a token bucket of 20, refilled at 10 a second,
 * so that a flood cannot flood the log; what was dropped is counted in
 * the next line that passes. Zeroed state is a full bucket. */
struct epd_ratelimit {
	double tokens;
	uint64_t refill_ns, dropped;
};
void epd_log_limited(struct epd_ratelimit *rl, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

#define epd_err(...) epd_log(EPD_LOG_ERR, __VA_ARGS__)
#define epd_warn(...) epd_log(EPD_LOG_WARN, __VA_ARGS__)
#define epd_notice(...) epd_log(EPD_LOG_NOTICE, __VA_ARGS__)
#define epd_info(...) epd_log(EPD_LOG_INFO, __VA_ARGS__)
#define epd_debug(...)                                                         \
	do {                                                                   \
		if (epd_log_level >= EPD_LOG_DEBUG)                            \
			epd_log(EPD_LOG_DEBUG, __VA_ARGS__);                   \
	} while (0)

#endif
