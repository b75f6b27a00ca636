/* SPDX-License-Identifier: MIT */
/* Replies to a client session (core.h), whatever carries them. */
#include "core.h"

#include <stdarg.h>
#include <stdio.h>

void epd_session_error(struct epd_session *s, uint64_t req_id, int code,
		       const char *fmt, ...)
{
	char msg[EPP_ERRMSG_MAX];
	uint8_t buf[EPP_ERRMSG_MAX + 16];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	epd_debug("client %lu (pid %d): error %d (%s): %s",
		  (unsigned long)s->id, (int)s->pid, code, ep_strerror(code),
		  msg);
	size_t n = epp_error_encode(code, msg, buf, sizeof(buf));
	epd_session_send(s, EPP_ERROR, 0, req_id, buf, (uint32_t)n, NULL, 0);
}
