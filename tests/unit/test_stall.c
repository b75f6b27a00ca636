/* SPDX-License-Identifier: MIT */
/* daemon/util/stall.c, the event loop's stall watch: a callback that
 * blocks the loop past the threshold is counted once, its length
 * measured, and what it was marked as doing is named in the log; a loop
 * that merely idles (no events for longer than the threshold) is no
 * stall. */
#include "harness.h"
#include "util/stall.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void block_loop(uv_timer_t *t)
{
	epd_stall_mark("a test's blocking callback", "group gstall");
	usleep(700 * 1000);
	uv_stop(t->loop);
}

static void quit(uv_timer_t *t)
{
	uv_stop(t->loop);
}

int main(void)
{
	th_init("test_stall", 30);
	struct th_capture cap = th_stderr_capture();
	uv_loop_t *loop = uv_default_loop();
	TH_CHECK(epd_stall_start(loop, 200) == 0, "start");
	uint64_t n, longest;
	/* idle for 600 ms: no events, the loop sleeps in epoll */
	uv_timer_t t;
	uv_timer_init(loop, &t);
	uv_timer_start(&t, quit, 600, 0);
	uv_run(loop, UV_RUN_DEFAULT);
	epd_stall_stats(&n, &longest);
	TH_CHECK(n == 0, "an idle loop counted as %llu stalls",
		 (unsigned long long)n);
	/* one callback blocks for 700 ms */
	uv_timer_start(&t, block_loop, 10, 0);
	uv_run(loop, UV_RUN_DEFAULT);
	uv_timer_start(&t, quit, 400, 0); /* turns again: the recovery */
	uv_run(loop, UV_RUN_DEFAULT);
	epd_stall_stats(&n, &longest);
	epd_stall_stop();
	uv_close((uv_handle_t *)&t, NULL);
	uv_run(loop, UV_RUN_DEFAULT);
	char log[4096];
	ssize_t r = (ssize_t)th_stderr_collect(cap, log, sizeof(log));
	TH_CHECK(n == 1, "%llu stalls counted, not 1", (unsigned long long)n);
	TH_CHECK(longest >= 600 && longest < 1000, "longest stall %llu ms",
		 (unsigned long long)longest);
	TH_CHECK(r > 0, "nothing logged");
	TH_CHECK(strstr(log, "a test's blocking callback (group gstall)"),
		 "the stall's mark not named: %s", log);
	TH_CHECK(strstr(log, "running again"), "no recovery line: %s", log);
	printf("ok: one stall of %llu ms counted and named; an idle loop is "
	       "none\n", (unsigned long long)longest);
	return 0;
}
