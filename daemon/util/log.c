/* SPDX-License-Identifier: MIT */
#include "clock.h"
#include "log.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#ifdef HAVE_LIBSYSTEMD
#include <systemd/sd-journal.h>
#endif

int epd_log_level = EPD_LOG_INFO;
static bool journal;
static _Thread_local char *capture;
static _Thread_local size_t capture_cap;

void epd_log_capture(char *buf, size_t cap)
{
	capture = buf;
	capture_cap = cap;
	if (buf && cap)
		buf[0] = 0;
}

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
	journal = js && sscanf(js, "%lu:%lu", &dev, &ino) == 2 &&
		  fstat(2, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
}

/* The word after `key ` in line (up to a space, ':', ',' or ')'), or 0. */
static int word_after(const char *line, const char *key, char *out,
		      size_t cap)
{
	const char *p = line;
	size_t kl = strlen(key);
	while ((p = strstr(p, key)) != NULL) {
		if ((p == line || p[-1] == ' ' || p[-1] == '(') &&
		    p[kl] == ' ' && p[kl + 1] && p[kl + 1] != ' ')
			break;
		p += kl;
	}
	if (!p)
		return 0;
	p += kl + 1;
	size_t n = strcspn(p, " :,)");
	if (!n || n >= cap)
		return 0;
	memcpy(out, p, n);
	out[n] = 0;
	return 1;
}

void epd_log_fields(const char *line, struct epd_log_fields *f)
{
	memset(f, 0, sizeof(*f));
	/* Every message names its subject first ("group G: ...", "node N
	 * (index i) ...", "client C (pid P, uid U) ..."); its rank and pid,
	 * where it names one, follow. */
	if (!strncmp(line, "group ", 6))
		word_after(line, "group", f->group, sizeof(f->group));
	if (!strncmp(line, "node ", 5))
		word_after(line, "node", f->node, sizeof(f->node));
	else
		word_after(line, "on node", f->node, sizeof(f->node));
	if (!word_after(line, "rank", f->rank, sizeof(f->rank)) ||
	    strspn(f->rank, "0123456789") != strlen(f->rank))
		f->rank[0] = 0;
	if (!word_after(line, "pid", f->pid, sizeof(f->pid)) ||
	    strspn(f->pid, "0123456789") != strlen(f->pid))
		f->pid[0] = 0;
}

#ifdef HAVE_LIBSYSTEMD
/* Under systemd: the message with its priority and the fields the journal
 * can filter on (journalctl EPD_GROUP=moe0). */
static int journal_send(int level, const char *line)
{
	struct epd_log_fields f;
	epd_log_fields(line, &f);
	char msg[1100], prio[16], g[96], n[96], r[32], p[32];
	struct iovec iov[7];
	int k = 0;
#define FIELD(buf, ...)                                                        \
	do {                                                                   \
		int len_ = snprintf(buf, sizeof(buf), __VA_ARGS__);            \
		iov[k].iov_base = buf;                                         \
		iov[k++].iov_len = len_ < (int)sizeof(buf) ? (size_t)len_      \
							     : sizeof(buf) - 1; \
	} while (0)
	FIELD(msg, "MESSAGE=%s", line);
	FIELD(prio, "PRIORITY=%d", level);
	iov[k].iov_base = (void *)"SYSLOG_IDENTIFIER=epd";
	iov[k++].iov_len = strlen("SYSLOG_IDENTIFIER=epd");
	if (f.group[0])
		FIELD(g, "EPD_GROUP=%s", f.group);
	if (f.node[0])
		FIELD(n, "EPD_NODE=%s", f.node);
	if (f.rank[0])
		FIELD(r, "EPD_RANK=%s", f.rank);
	if (f.pid[0])
		FIELD(p, "EPD_PID=%s", f.pid);
#undef FIELD
	return sd_journal_sendv(iov, k);
}
#endif

void epd_log(int level, const char *fmt, ...)
{
	if (level > epd_log_level)
		return;
	char line[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	/* one message, one line: a control character from outside (in a
	 * name, a path) cannot start a forged line or drive a terminal */
	for (char *q = line; *q; q++)
		if ((unsigned char)*q < 0x20 || *q == 0x7f)
			*q = '?';
	if (level <= EPD_LOG_ERR && capture && capture_cap && !capture[0])
		snprintf(capture, capture_cap, "%s", line);
	if (journal) {
#ifdef HAVE_LIBSYSTEMD
		if (journal_send(level, line) == 0)
			return;
#endif
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

#define LOG_BURST 20
#define LOG_RATE 10
void epd_log_limited(struct epd_ratelimit *rl, const char *fmt, ...)
{
	uint64_t now = epd_now_ns();
	double t = rl->tokens + (double)(now - rl->refill_ns) * LOG_RATE / 1e9;
	rl->tokens = t > LOG_BURST || !rl->refill_ns ? LOG_BURST : t;
	rl->refill_ns = now;
	if (rl->tokens < 1) {
		rl->dropped++;
		return;
	}
	rl->tokens -= 1;
	char msg[256];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (rl->dropped)
		epd_warn("%s (%llu similar messages dropped)", msg,
			 (unsigned long long)rl->dropped);
	else
		epd_warn("%s", msg);
	rl->dropped = 0;
}
