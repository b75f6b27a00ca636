/* SPDX-License-Identifier: MIT */
/* daemon/util/log.c: the journal fields taken from the daemon's messages (each
 * names its subject first), on messages as the daemon writes them; and a
 * message to a journal that cannot take it is still written, with its
 * priority prefix, not lost. */
#include "harness.h"
#include "util/log.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void want(const char *line, const char *group, const char *node,
		 const char *rank, const char *pid)
{
	struct epd_log_fields f;
	epd_log_fields(line, &f);
	TH_CHECK(!strcmp(f.group, group) && !strcmp(f.node, node) &&
			 !strcmp(f.rank, rank) && !strcmp(f.pid, pid),
		 "'%s': group '%s' node '%s' rank '%s' pid '%s'", line, f.group,
		 f.node, f.rank, f.pid);
}

/* What epd_log(WARN, msg) wrote to stderr (a temporary file), with
 * stderr named as the journal's stream (JOURNAL_STREAM) or not: its
 * length, the text in buf. */
static size_t logged(bool journal, const char *msg, char *buf, size_t cap)
{
	struct th_capture c = th_stderr_capture();
	if (journal) {
		struct stat st;
		fstat(2, &st);
		char js[64];
		snprintf(js, sizeof(js), "%lu:%lu", (unsigned long)st.st_dev,
			 (unsigned long)st.st_ino);
		setenv("JOURNAL_STREAM", js, 1);
	} else {
		unsetenv("JOURNAL_STREAM");
	}
	epd_log_init();
	epd_log(EPD_LOG_WARN, "%s", msg);
	return th_stderr_collect(c, buf, cap);
}

int main(void)
{
	th_init("test_log", 30);
	want("group moe0: rank 3 (pid 1234) removed: left", "moe0", "", "3",
	     "1234");
	want("group x2x2 failed: on node n0: dispatch timed out after 400 ms "
	     "waiting for the other nodes of the group; ranks never arrived: "
	     "2,3",
	     "x2x2", "n0", "", "");
	want("node n1 (index 1) down: silent for 1060 ms; view epoch 7", "",
	     "n1", "", "");
	want("client 4 (pid 524, uid 0) disconnected: connection closed by "
	     "peer",
	     "", "", "", "524");
	want("group g: rank 1 on GPU 0 (NVIDIA H200), region of 4 MiB", "g",
	     "", "1", "");
	want("epd 0.1.0 listening on /run/epd/epd.sock (backend host)", "", "",
	     "", "");
	want("group ranks: rank ready", "ranks", "", "", ""); /* not a number */
	printf("ok: journal fields EPD_GROUP, EPD_NODE, EPD_RANK, EPD_PID from "
	       "the daemon's messages\n");

	/* stderr "is" the journal (JOURNAL_STREAM names it), but no journal
	 * listens: the message still comes out, with <priority>. */
	char buf[256];
	size_t n = logged(true, "group jg: rank 2 (pid 77) left", buf,
			  sizeof(buf));
	/* where a journal does listen (a systemd machine), it took the
	 * message and the file stays empty; else the prefixed line */
	TH_CHECK(n == 0 || !strcmp(buf, "<4>group jg: rank 2 (pid 77) left\n"),
		 "journal fallback wrote '%s'", buf);
	printf("ok: a journal message %s\n",
	       n ? "with no journal listening is written with its <4> prefix"
		 : "went to the journal");

	/* A message carrying a name from outside with a newline and a
	 * terminal escape: one line, the control characters shown as '?'. */
	logged(false,
	       "peer rejected: node 'x\n00:00:00.000 epd notice: all is "
	       "well\x1b[2J' unknown",
	       buf, sizeof(buf));
	char *nl = strchr(buf, '\n');
	TH_CHECK(nl && nl[1] == 0 && !strchr(buf, 0x1b) &&
			 strstr(buf, "node 'x?00:00:00.000 epd notice: all is "
				     "well?[2J' unknown"),
		 "logged '%s'", buf);
	printf("ok: control characters in a message are logged as '?', on "
	       "one line\n");
	return 0;
}
