/* SPDX-License-Identifier: MIT */
/*
 * Users on one daemon: isolation and limits, with real uids (children of
 * the test switch to uids 4242 and 4343; needs root, else a skip).
 *
 * Asserts: a group belongs to its creator's namespace (the same name from
 * another uid is another group: no joining as a missing rank, no squatting
 * a name, no regions of another user's group); STATUS shows a user only its
 * own connections and groups and counts of the rest, root everything;
 * groups named by `shared_groups` are joined across uids; per-uid caps on
 * connections, groups and buffer bytes refuse with EP_ELIMIT and a message
 * naming the limit, and the refused user's other work and other users go on.
 */
#include "harness.h"

#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define UA 4242
#define UB 4343

static struct th_daemon D;

/* Run fn as uid in a child; returns its exit status (0 ok). */
static int as_user(uid_t uid, int (*fn)(void *), void *arg)
{
	pid_t pid = fork();
	TH_CHECK(pid >= 0, "fork");
	if (pid == 0) {
		if (setgid(uid) || setuid(uid))
			_exit(99);
		_exit(fn(arg));
	}
	int st;
	TH_CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
	return WIFEXITED(st) ? WEXITSTATUS(st) : 98;
}

struct shared {
	volatile int phase;
	volatile int step[4];
};
static struct shared *S;

static void wait_phase(int p)
{
	while (S->phase < p)
		th_sleep_ms(2);
}

static char *status_of(ep_conn_t *c)
{
	char *js;
	TH_OK(ep_daemon_status(c, &js));
	return js;
}

/* uid A: group "moe0" rank 0 (of 2), waits; sees only its own. */
static int user_a(void *arg)
{
	(void)arg;
	ep_conn_t *c;
	ep_group_t *g;
	struct ep_group_config cfg = th_group("moe0", 2, 0, 20000);
	TH_OK(ep_connect(D.sock, &c));
	TH_OK(ep_join(c, &cfg, EP_JOIN_NOWAIT, &g));
	S->step[0] = 1;
	wait_phase(1); /* B has joined its "moe0" as rank 1 */
	char *js = status_of(c);
	TH_CHECK(strstr(js, "\"uid\":4343") == NULL,
		 "A sees B's connection: %s", js);
	TH_CHECK(strstr(js, "\"other_users\":{\"clients\":"), "%s", js);
	/* A's group still misses rank 1: B did not take it */
	TH_CHECK(strstr(js, "\"state\":\"forming\""), "A's group: %s", js);
	free(js);
	/* A's rank 0 is alone: a barrier is refused as not ready */
	TH_EXPECT_RC(ep_barrier(g), EP_ENOTREADY);
	S->step[0] = 2;
	wait_phase(2);
	ep_close(c);
	return 0;
}

/* uid B: the same name, rank 1: a group of its own, not A's. */
static int user_b(void *arg)
{
	(void)arg;
	ep_conn_t *c;
	ep_group_t *g;
	struct ep_group_config cfg = th_group("moe0", 2, 1, 20000);
	TH_OK(ep_connect(D.sock, &c));
	TH_OK(ep_join(c, &cfg, EP_JOIN_NOWAIT, &g));
	char *js = status_of(c);
	TH_CHECK(strstr(js, "\"owner_uid\":4242") == NULL,
		 "B sees A's group: %s", js);
	TH_CHECK(strstr(js, "\"owner_uid\":4343"), "B's own group: %s", js);
	free(js);
	S->step[1] = 1;
	wait_phase(2);
	ep_close(c);
	return 0;
}

/* A shared group ("team." prefix): ranks of A and B meet in it. */
static int shared_rank(void *arg)
{
	int rank = (int)(intptr_t)arg;
	ep_conn_t *c;
	struct ep_group_config cfg = th_group("team.x", 2, (uint32_t)rank,
					      20000);
	ep_group_t *g = th_join(&D, &cfg, &c);
	for (int i = 0; i < 20; i++)
		TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

static void *shared_thread(void *arg)
{
	int rank = (int)(intptr_t)arg;
	return (void *)(intptr_t)as_user(rank ? UB : UA, shared_rank, arg);
}

/* Limits for uid A: 4 connections, 2 groups. */
static int limits_a(void *arg)
{
	(void)arg;
	ep_conn_t *c[5];
	for (int i = 0; i < 4; i++)
		TH_OK(ep_connect(D.sock, &c[i]));
	TH_EXPECT_RC(ep_connect(D.sock, &c[4]), EP_ELIMIT);
	TH_CHECK(strstr(ep_errmsg(), "max_connections_per_user"), "%s",
		 ep_errmsg());
	ep_group_t *g;
	const char *names[] = {"l0", "l1", "l2"};
	for (int i = 0; i < 3; i++) {
		struct ep_group_config cfg = th_group(names[i], 2, 0, 20000);
		int rc = ep_join(c[0], &cfg, EP_JOIN_NOWAIT, &g);
		if (i < 2) {
			TH_OK(rc);
		} else {
			TH_EXPECT_RC(rc, EP_ELIMIT);
			TH_CHECK(strstr(ep_errmsg(), "max_groups_per_user"),
				 "%s", ep_errmsg());
		}
	}
	/* a group larger than the byte cap */
	struct ep_group_config big = th_group("big", 2, 0, 20000);
	big.max_tokens_per_rank = 4096;
	big.hidden = 7168;
	ep_close(c[0]); /* its two groups end with it */
	TH_EXPECT_RC(ep_join(c[2], &big, EP_JOIN_NOWAIT, &g), EP_ELIMIT);
	TH_CHECK(strstr(ep_errmsg(), "max_bytes_per_user"), "%s",
		 ep_errmsg());
	/* a connection slot is free again */
	TH_OK(ep_connect(D.sock, &c[0]));
	for (int i = 0; i < 4; i++)
		ep_close(c[i]);
	return 0;
}

/* Meanwhile uid B is not limited by A's use. */
static int limits_b(void *arg)
{
	(void)arg;
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(D.sock, &c));
	struct ep_group_config cfg = th_group("l0", 2, 0, 20000);
	TH_OK(ep_join(c, &cfg, EP_JOIN_NOWAIT, &g));
	ep_close(c);
	return 0;
}

#include <pthread.h>
#include <sys/resource.h>

static void low_nofile(void)
{
	struct rlimit rl = {48, 48};
	setrlimit(RLIMIT_NOFILE, &rl);
}

/* A daemon out of descriptors: connections beyond are accepted and closed
 * (no busy loop on the listener, a bounded log), and once they go, new
 * clients are served again. Needs no second uid. */
static void check_emfile(void)
{
	struct th_daemon d;
	th_daemon_child_hook = low_nofile;
	th_daemon_start(&d, NULL);
	th_daemon_child_hook = NULL;
	enum { N = 80 };
	ep_conn_t *c[N];
	int ok = 0, refused = 0;
	for (int i = 0; i < N; i++) {
		int rc = ep_connect(d.sock, &c[i]);
		if (rc == 0)
			ok++;
		else
			c[i] = NULL, refused++;
	}
	TH_CHECK(ok > 10 && refused > 0, "%d connected, %d refused", ok,
		 refused);
	th_sleep_ms(300);
	for (int i = 0; i < N; i++)
		if (c[i])
			ep_close(c[i]);
	th_sleep_ms(100);
	ep_conn_t *x;
	TH_OK(ep_connect(d.sock, &x));
	ep_close(x);
	char cmd[300], out[64];
	snprintf(cmd, sizeof(cmd), "grep -c 'accept:' %s", d.log);
	FILE *f = popen(cmd, "r");
	TH_CHECK(f && fgets(out, sizeof(out), f), "grep");
	pclose(f);
	/* a burst of 20, then 10 a second (epd_log_limited) */
	TH_CHECK(atoi(out) <= 30, "%d accept warnings logged", atoi(out));
	th_daemon_stop(&d);
	printf("ok: out of descriptors: %d refused at once, %d accept "
	       "warnings, served again after\n",
	       refused, atoi(out));
}

int main(void)
{
	th_init("test_users", 120);
	if (geteuid() != 0) {
		printf("skip: switching uids needs root\n");
		return TH_SKIP;
	}
	th_daemon_start(&D, "-o", "socket_mode=0666", "-o",
			"shared_groups=team.", "-o",
			"max_connections_per_user=4", "-o",
			"max_groups_per_user=2", "-o", "max_bytes_per_user=64M",
			NULL);
	S = th_shared(sizeof(*S));
	TH_CHECK(chmod(D.dir, 0755) == 0, "chmod %s", D.dir);

	/* Namespaces: A and B both use "moe0". */
	pid_t pa = fork();
	if (pa == 0)
		_exit(as_user(UA, user_a, NULL));
	while (!S->step[0])
		th_sleep_ms(2);
	pid_t pb = fork();
	if (pb == 0)
		_exit(as_user(UB, user_b, NULL));
	while (!S->step[1])
		th_sleep_ms(2);
	/* root sees both, with owners */
	ep_conn_t *rc;
	TH_OK(ep_connect(D.sock, &rc));
	char *js = status_of(rc);
	TH_CHECK(strstr(js, "\"owner_uid\":4242") &&
			 strstr(js, "\"owner_uid\":4343"),
		 "root's status lacks an owner: %s", js);
	free(js);
	/* root's own "moe0" is a third group: no squatting either way */
	ep_group_t *rg;
	struct ep_group_config rcfg = th_group("moe0", 2, 1, 20000);
	TH_OK(ep_join(rc, &rcfg, EP_JOIN_NOWAIT, &rg));
	ep_close(rc);
	S->phase = 1;
	while (S->step[0] < 2)
		th_sleep_ms(2);
	S->phase = 2;
	int st;
	TH_CHECK(waitpid(pa, &st, 0) == pa && WIFEXITED(st) &&
			 WEXITSTATUS(st) == 0,
		 "user A failed (0x%x)", st);
	TH_CHECK(waitpid(pb, &st, 0) == pb && WIFEXITED(st) &&
			 WEXITSTATUS(st) == 0,
		 "user B failed (0x%x)", st);
	printf("ok: the same group name from two uids and root names three "
	       "groups; status shows each user its own\n");

	/* A shared group across uids. */
	pthread_t t[2];
	for (intptr_t r = 0; r < 2; r++)
		pthread_create(&t[r], NULL, shared_thread, (void *)r);
	for (int r = 0; r < 2; r++) {
		void *ret;
		pthread_join(t[r], &ret);
		TH_CHECK(ret == NULL, "shared-group rank %d failed", r);
	}
	printf("ok: a shared_groups group is joined by two uids\n");

	/* Limits. */
	TH_CHECK(as_user(UA, limits_a, NULL) == 0, "limits for A");
	TH_CHECK(as_user(UB, limits_b, NULL) == 0, "B limited by A");
	printf("ok: per-user caps on connections, groups, bytes (EP_ELIMIT)\n");
	check_emfile();
	TH_CHECK(th_daemon_alive(&D), "daemon died");
	th_daemon_stop(&D);
	printf("ok\n");
	return 0;
}
