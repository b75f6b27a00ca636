/* SPDX-License-Identifier: MIT */
/*
 * Test harness: a private daemon per test (its own socket in a temporary
 * directory), rank processes made with fork, shared memory for stamps, and
 * checks that name the file and line. Every test has an alarm: no hang.
 * Exit codes follow automake: 0 pass, 1 fail, 77 skip.
 */
#ifndef TH_HARNESS_H
#define TH_HARNESS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>

#include "ep/ep.h"

#define TH_SKIP 77

#define TH_CHECK(cond, ...)                                                    \
	do {                                                                   \
		if (!(cond)) {                                                 \
			fprintf(stderr, "%s:%d: check failed: %s: ",          \
				__FILE__, __LINE__, #cond);                    \
			fprintf(stderr, __VA_ARGS__);                          \
			fprintf(stderr, "\n");                                 \
			th_fail_exit();                                        \
		}                                                              \
	} while (0)

/* rc must equal want; prints both codes' names and ep_errmsg(). */
#define TH_EXPECT_RC(rc, want)                                                 \
	do {                                                                   \
		int th_rc_ = (rc), th_want_ = (want);                          \
		TH_CHECK(th_rc_ == th_want_, "got %d (%s), want %d (%s): %s", \
			 th_rc_, ep_strerror(th_rc_), th_want_,                \
			 ep_strerror(th_want_), ep_errmsg());                  \
	} while (0)

#define TH_OK(rc) TH_EXPECT_RC(rc, 0)

struct th_daemon {
	pid_t pid;
	char dir[64];
	char sock[108];
	char log[192];
	char conf[192];
	int peer_port; /* th_cluster_start: its node's port on 127.0.0.1 */
};

/* The tests' random series (a 64-bit LCG: the next 31 bits) and hash of
 * outputs (64-bit FNV-1a from h). */
uint32_t th_rnd(uint64_t *s);
uint64_t th_fnv(uint64_t h, const void *p, size_t n);
#define TH_FNV0 0xcbf29ce484222325ull

/* Test start: alarm(timeout_s), line-buffered output. */
void th_init(const char *name, unsigned timeout_s);
void th_fail_exit(void) __attribute__((noreturn));
uint64_t th_now_ns(void);
/* A random test's seed: $EPD_TEST_SEED, else the time; printed as
 * "seed N (EPD_TEST_SEED=N repeats this run)". */
uint64_t th_seed(void);
void th_sleep_ms(unsigned ms);
/* The first of n consecutive TCP ports for daemons' cluster listeners:
 * outside the kernel's ephemeral range (ip_local_port_range), so no
 * outgoing connection of this or another test can be handed one of them
 * between this call and a daemon's bind, or between a daemon's stop and
 * its restart on the same port; each checked free by a bind on the
 * wildcard address.  A random block, so concurrent tests rarely meet. */
int th_ports(int n);

/* Start epd with extra arguments (NULL-terminated list of strings) and wait
 * until it accepts connections. */
void th_daemon_start(struct th_daemon *d, ...);
/* Called in the daemon's child process just before exec (environment,
 * inherited descriptors); NULL by default. */
extern void (*th_daemon_child_hook)(void);
/* Start it on an existing directory/socket (a restart). */
void th_daemon_start_in(struct th_daemon *d, const char *const *args);
/* SIGTERM and wait; checks a clean exit. */
void th_daemon_stop(struct th_daemon *d);
bool th_daemon_alive(struct th_daemon *d);
/* A cluster of n daemons on loopback ports (th_ports), nodes n0 .. n(n-1),
 * over $EPD_TEST_TRANSPORT (tcp by default), one cluster key written under
 * a new temporary directory named by tag, heartbeats every 100 ms (misses
 * allowed: 20, 40 with EPD_TEST_SLOW); extra (NULL-terminated, may be
 * NULL) follows the cluster's arguments, so its -o settings win. The
 * daemons connect on demand (their default); with "peer_connect=all" in
 * extra, returns once every node sees every other up. */
#define TH_MAX_NODES 256
/* With "peer_lookup=dns" or "=job" among extra, each node's peers name
 * only itself: the others are learnt (doc: epd.conf(5)). */
void th_cluster_start(struct th_daemon *d, int n, const char *tag,
		      const char *const *extra);
void th_daemon_dump_log(const struct th_daemon *d);
const char *th_epctl_bin(void);

/* A new temporary directory ($TMPDIR or /tmp, prefix.XXXXXX), removed
 * with what it holds when the test ends by exit (a pass or a skip); kept
 * after a failure, or with EPD_TEST_KEEP set. */
const char *th_tmpdir(const char *prefix);

/* Descriptors process pid holds (/proc/pid/fd), or -1 if it is gone; its
 * memory mappings whose line in /proc/pid/maps contains match. */
int th_fds(pid_t pid);
int th_maps(pid_t pid, const char *match);

/* Shared anonymous memory visible to forked ranks. */
void *th_shared(size_t size);

/* Everything written to stderr from th_stderr_capture() on goes to a
 * temporary file; th_stderr_collect() puts stderr back and returns what
 * was written (up to cap - 1 bytes, NUL-terminated in buf): its length. */
struct th_capture {
	int saved, fd;
};
struct th_capture th_stderr_capture(void);
size_t th_stderr_collect(struct th_capture c, char *buf, size_t cap);

/* Fork n children running fn(i, arg); exit status of fn is the child's. */
typedef int (*th_child_fn)(int i, void *arg);
void th_spawn(pid_t *pids, int n, th_child_fn fn, void *arg);
/* Wait for the children; returns how many did not exit 0. */
int th_wait_all(const pid_t *pids, int n, unsigned timeout_s);
/* EPD_TEST_ALARM_SCALE (default 1): how many times slower this run is
 * (an emulated CPU under a sanitizer); alarms and the few tests' own short
 * deadlines are multiplied by it. */
unsigned th_scale(void);

/* Reap a child whose exit is not judged (a victim the test killed). */
void th_reap(pid_t pid, unsigned timeout_s);

/* A default group config (small shape) for rank `rank` of `world`. */
/* n bytes (and one more, so n may be 0) all set to byte; exits on no
 * memory. Outputs are poisoned so that what a call did not write shows. */
void *th_poisoned(size_t n, int byte);
/* The first byte at which a and b differ, or n if none does. */
size_t th_first_diff(const void *a, const void *b, size_t n);
/* Are the n bytes at p all byte? */
bool th_all_is(const void *p, size_t n, int byte);

struct ep_group_config th_group(const char *name, uint32_t world,
				uint32_t rank, uint32_t timeout_ms);

/* Connect and join with retries of nothing: fails the test on error. */
/* A JOIN sent on a raw socket (tests that speak the protocol themselves):
 * checks the OK reply with the buffer descriptor, closes the descriptor,
 * and returns the decoded reply. */
struct epp_join;
struct epp_join_ok;
void th_raw_join(int fd, const struct epp_join *j, uint64_t req,
		 struct epp_join_ok *ok);

/* The late-rank rounds of the barrier tests (one node or several): for
 * each late in [0, world) the ranks line up in a barrier, rank late sleeps
 * delay_ms, and every rank stamps entering and leaving the next barrier in
 * enter[late][rank] and leave[late][rank] (CLOCK_MONOTONIC, one machine). */
#define TH_MAXW 8
void th_late_rounds(ep_group_t *g, int rank, int world, unsigned delay_ms,
		    uint64_t enter[][TH_MAXW], uint64_t leave[][TH_MAXW]);

ep_group_t *th_join(const struct th_daemon *d, const struct ep_group_config *c,
		    ep_conn_t **conn);

#endif
