/* SPDX-License-Identifier: MIT */
/* test_cluster: a hung node, a wrong key, rejoins again and again, an RDMA device removed under running daemons. */
#include "cluster.h"

/* A hung daemon (SIGSTOP) closes nothing: only the missed heartbeats tell
 * (100 ms x 5 here). */
void check_silent_node(void)
{
	kill(D[2].pid, SIGSTOP);
	uint64_t t0 = th_now_ns();
	wait_row(0, "SUD");
	double ms = (double)(th_now_ns() - t0) / 1e6;
	TH_CHECK(ms >= miss * BEAT_MS - 100 && ms < miss * BEAT_MS + 2500,
		 "a silent node was marked down after %.0f ms (%d beats of "
		 "%d ms)",
		 ms, miss, BEAT_MS);
	json_t *cl = cluster_of(0);
	json_t *p2 = json_array_get(json_object_get(cl, "peers"), 2);
	TH_CHECK(strstr(json_string_value(json_object_get(p2, "last_error")),
			"silent for"),
		 "reason: %s",
		 json_string_value(json_object_get(p2, "last_error")));
	json_decref(cl);
	kill(D[2].pid, SIGCONT);
	wait_all_up();
	printf("ok: a hung daemon is marked down after %.0f ms of silence "
	       "and rejoins when it resumes\n",
	       ms);
}

void check_wrong_key(void)
{
	th_daemon_stop(&D[2]);
	wait_row(0, "SUD");
	start_node(2, badkey, false);
	th_sleep_ms(800);
	wait_row(0, "SUD");
	wait_row(2, "DDS");
	/* (a dial every backoff: the first refusal may take a moment on a
	 * slow build) */
	for (int t = 0;; t++) {
		json_t *cl = cluster_of(0);
		json_int_t rej = json_integer_value(
			json_object_get(cl, "rejected"));
		json_decref(cl);
		if (rej > 0)
			break;
		TH_CHECK(t < 1000, "no rejection counted");
		th_sleep_ms(10);
	}
	FILE *f = fopen(D[0].log, "r");
	char line[512];
	bool seen = false;
	while (f && fgets(line, sizeof(line), f))
		/* tcp: the proof fails; rdma: the connect data names
		 * another cluster (its id comes from the key), refused
		 * by n2 and reported back to the dialler */
		seen |= strstr(line, "wrong cluster key") != NULL ||
			strstr(line, "another cluster") != NULL;
	if (f)
		fclose(f);
	TH_CHECK(seen, "node 0 did not log the wrong key");
	printf("ok: a node with the wrong cluster key is rejected and logged\n");
	th_daemon_stop(&D[2]);
	start_node(2, keyfile, false);
	wait_all_up();
}

/* The RDMA device removed under running daemons (`rdma link delete`,
 * tests/rdma-vm only: EPD_TEST_RXE_DELETE names the device): ranks of a
 * group across nodes waiting in a barrier get EP_EPEERLOST at once, every
 * daemon stays up and stops cleanly, and node 0's status says why its
 * peers are down. Last, since the cluster cannot come back without the
 * device. */
int removal_rank(int rank, void *arg)
{
	struct late *s = arg;
	ep_conn_t *c;
	ep_group_t *g = join(s, rank, &c, 20000);
	TH_OK(ep_barrier(g));
	__atomic_fetch_add(&s->entered, 1, __ATOMIC_SEQ_CST);
	if (rank == 3)
		for (;;)
			pause(); /* never enters: the others wait */
	s->codes[rank] = ep_barrier(g);
	snprintf(s->msgs[rank], sizeof(s->msgs[rank]), "%s", ep_errmsg());
	ep_leave(g);
	ep_close(c);
	return 0;
}

void check_device_removal(const char *dev)
{
	struct late *s = late_new(2, 2, "removal");
	pid_t pids[4];
	th_spawn(pids, 4, removal_rank, s);
	while (s->entered < 4)
		th_sleep_ms(2);
	th_sleep_ms(200);
	char cmd[160];
	/* The kernel finishes only once every daemon gave back every object
	 * on the device (uninterruptibly: no timeout can end the command), so
	 * a hang here is the daemons' fault: fail with their logs. */
	snprintf(cmd, sizeof(cmd), "rdma link delete %s", dev);
	uint64_t t0 = th_now_ns();
	pid_t del = fork();
	TH_CHECK(del >= 0, "fork");
	if (del == 0) {
		execlp("rdma", "rdma", "link", "delete", dev, (char *)NULL);
		_exit(127);
	}
	int st = 0;
	while (waitpid(del, &st, WNOHANG) == 0) {
		TH_CHECK(th_now_ns() - t0 < 60ull * 1000000000ull,
			 "%s hung 60 s: a daemon holds an object of the device",
			 cmd);
		th_sleep_ms(20);
	}
	TH_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s failed", cmd);
	uint64_t del_ms = (th_now_ns() - t0) / 1000000;
	TH_CHECK(th_wait_all(pids, 3, 30) == 0, "ranks 0-2 hung or failed");
	kill(pids[3], SIGKILL);
	th_reap(pids[3], 5);
	for (int r = 0; r < 3; r++)
		TH_CHECK(s->codes[r] == EP_EPEERLOST || s->codes[r] == EP_EFAILED,
			 "rank %d: %s: %s", r, ep_strerror(s->codes[r]),
			 s->msgs[r]);
	wait_row(0, "SDD");
	json_t *cl = cluster_of(0);
	json_t *p1 = json_array_get(json_object_get(cl, "peers"), 1);
	char why[160];
	snprintf(why, sizeof(why), "%s",
		 json_string_value(json_object_get(p1, "last_error")));
	json_decref(cl);
	for (int i = 0; i < NODES; i++)
		TH_CHECK(th_daemon_alive(&D[i]), "node %d died", i);
	TH_CHECK(strstr(why, "removed"), "node 0's reason for n1: %s", why);
	printf("ok: %s deleted under running daemons in %llu ms: the group's "
	       "ranks got %s; every daemon up; node 0 says n1 is down: %s\n",
	       dev, (unsigned long long)del_ms, s->msgs[0], why);
	/* EPD_TEST_RXE_NETDEV: the device comes back on that interface, and
	 * so does the cluster (the daemons listen again), groups work */
	const char *nd = getenv("EPD_TEST_RXE_NETDEV");
	if (!nd || !*nd)
		return;
	snprintf(cmd, sizeof(cmd), "rdma link add %s type rxe netdev %s", dev,
		 nd);
	TH_CHECK(system(cmd) == 0, "%s failed", cmd);
	t0 = th_now_ns();
	wait_all_up();
	printf("ok: %s added again: every node up again in %llu ms\n", dev,
	       (unsigned long long)((th_now_ns() - t0) / 1000000));
	check_late(2, 2);
}

/* Rejoin, again and again (EPD_TEST_REJOIN_ROUNDS, default 2; 20 in
 * tests/rdma-vm): node 2 killed (SIGKILL or SIGTERM in turn), or first
 * replaced by a node with the wrong key, then restarted with the right
 * one; every node must see every other up again each time. */
void check_rejoins(void)
{
	int rounds = getenv("EPD_TEST_REJOIN_ROUNDS")
			     ? atoi(getenv("EPD_TEST_REJOIN_ROUNDS"))
			     : 2;
	uint64_t worst = 0;
	for (int i = 0; i < rounds; i++) {
		if (i % 3 == 0) {
			kill(D[2].pid, SIGKILL);
			th_reap(D[2].pid, 10);
			D[2].pid = 0;
			unlink(D[2].sock);
		} else {
			th_daemon_stop(&D[2]);
		}
		wait_row(0, "SUD");
		if (i % 3 == 2) { /* the wrong key first */
			start_node(2, badkey, false);
			th_sleep_ms(300);
			wait_row(0, "SUD");
			th_daemon_stop(&D[2]);
		}
		uint64_t t0 = th_now_ns();
		start_node(2, keyfile, false);
		wait_all_up();
		uint64_t dt = th_now_ns() - t0;
		if (dt > worst)
			worst = dt;
	}
	printf("ok: %d rejoins (killed, stopped, after a wrong-key node): "
	       "every node up again each time, the slowest in %llu ms\n",
	       rounds, (unsigned long long)(worst / 1000000));
}
