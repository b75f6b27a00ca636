/* SPDX-License-Identifier: MIT */
/* test_cluster: nodes and ranks lost mid-operation: every survivor learns it at once. */
#include "cluster.h"

/* A rank of a group that loses a part: victims wait to be killed (or
 * their daemon to be); the others enter a barrier, which must fail within
 * limit_ns; its code and message go to s. */
int loss_rank(struct late *s, int rank, bool victim,
		     uint64_t limit_ns)
{
	ep_conn_t *c;
	ep_group_t *g = join(s, rank, &c, 20000);
	TH_OK(ep_barrier(g));
	if (victim)
		for (;;)
			pause();
	__atomic_fetch_add(&s->entered, 1, __ATOMIC_SEQ_CST);
	uint64_t t0 = th_now_ns();
	s->codes[rank] = ep_barrier(g);
	snprintf(s->msgs[rank], sizeof(s->msgs[rank]), "%s", ep_errmsg());
	TH_CHECK(th_now_ns() - t0 < limit_ns,
		 "rank %d learnt of the loss after %.0f ms", rank,
		 (double)(th_now_ns() - t0) / 1e6);
	ep_leave(g);
	ep_close(c);
	return 0;
}

int lost_rank(int rank, void *arg)
{
	struct late *s = arg;
	/* node 1's ranks: their daemon dies */
	return loss_rank(s, rank, rank / s->rpn == 1, 5000000000ull);
}

void check_node_loss(void)
{
	struct late *s = late_new(2, 2, "lost");
	pid_t pids[4];
	th_spawn(pids, 4, lost_rank, s);
	while (s->entered < 2)
		th_sleep_ms(2);
	th_sleep_ms(100);
	json_t *cl = cluster_of(0);
	json_int_t epoch = json_integer_value(json_object_get(cl, "view_epoch"));
	json_decref(cl);
	kill(D[1].pid, SIGKILL); /* node 1's daemon dies */
	waitpid(D[1].pid, NULL, 0);
	D[1].pid = 0;
	TH_CHECK(th_wait_all(&pids[0], 2, 30) == 0, "node 0's ranks failed");
	kill(pids[2], SIGKILL);
	kill(pids[3], SIGKILL);
	th_reap(pids[2], 5);
	th_reap(pids[3], 5);
	for (int r = 0; r < 2; r++) {
		TH_EXPECT_RC(s->codes[r], EP_EPEERLOST);
		TH_CHECK(strstr(s->msgs[r], "node n1"), "message: %s",
			 s->msgs[r]);
	}
	wait_row(0, "SDU");
	cl = cluster_of(0);
	TH_CHECK(json_integer_value(json_object_get(cl, "view_epoch")) > epoch,
		 "view epoch did not advance");
	json_decref(cl);
	printf("ok: a daemon killed: its node is down, the group spanning it "
	       "failed: %s\n",
	       s->msgs[0]);
	/* it restarts and rejoins; nobody else restarted */
	unlink(D[1].sock);
	start_node(1, keyfile, false);
	wait_all_up();
	printf("ok: the node restarted and rejoined\n");
}

/* A daemon killed while rows stream to it: node 0's ranks, in a loop of
 * dispatch and combine with DeepSeek-sized rows, get EP_EPEERLOST; node 0
 * drops the writes in flight (run under ASan/TSan by scripts/test) and
 * goes on; the node restarts and rejoins. */
int xlost_rank(int rank, void *arg)
{
	struct late *s = arg;
	ep_conn_t *c;
	ep_group_t *g;
	/* DeepSeek-sized rows: under a sanitizer on the VM's emulated CPU
	 * one op can take seconds (the timeout scales, as the alarms do) */
	struct ep_group_config cfg = th_group(s->name, 4, (uint32_t)rank,
					      20000 * th_scale());
	cfg.ranks_per_node = 2;
	cfg.hidden = 7168;
	cfg.max_tokens_per_rank = 64; /* 64 x 8 rows of 14 KiB */
	cfg.topk = 8;
	cfg.num_experts = 32;
	TH_OK(ep_connect(D[rank / 2].sock, &c));
	TH_OK(ep_join(c, &cfg, 0, &g));
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	uint16_t *x = b.x;
	for (size_t i = 0; i < (size_t)64 * 7168; i++)
		x[i] = (uint16_t)(0x3c00 + (i * 7 + (size_t)rank) % 0x400);
	for (uint32_t t = 0; t < 64; t++)
		for (uint32_t k = 0; k < 8; k++) /* 5k: distinct mod 32 */
			b.topk_idx[t * 8 + k] =
				(int64_t)((t * 3 + k * 5 + (uint32_t)rank) % 32);
	int rc = 0;
	for (int i = 0; !rc && i < 100000; i++) {
		ep_handle_t h;
		rc = ep_dispatch_inplace(g, 64, 0, NULL, &h);
		if (!rc)
			rc = ep_combine_inplace(g, &h, 0);
		if (!rc)
			rc = ep_handle_release(g, &h);
		if (i == 2)
			__atomic_fetch_add(&s->entered, 1, __ATOMIC_SEQ_CST);
	}
	s->codes[rank] = rc;
	snprintf(s->msgs[rank], sizeof(s->msgs[rank]), "%s", ep_errmsg());
	ep_leave(g);
	ep_close(c);
	return 0;
}

void check_node_loss_streaming(void)
{
	struct late *s = late_new(2, 2, "xlost");
	pid_t pids[4];
	th_spawn(pids, 4, xlost_rank, s);
	for (int t = 0; s->entered < 4; t++) {
		TH_CHECK(t < 30000 * (int)th_scale(),
			 "the ranks never got through 3 rounds: %s",
			 s->msgs[0][0] ? s->msgs[0] : s->msgs[2]);
		th_sleep_ms(2);
	}
	th_sleep_ms(30);
	kill(D[1].pid, SIGKILL);
	waitpid(D[1].pid, NULL, 0);
	D[1].pid = 0;
	TH_CHECK(th_wait_all(pids, 4, 30) == 0, "a rank failed or hung");
	for (int r = 0; r < 2; r++) {
		TH_EXPECT_RC(s->codes[r], EP_EPEERLOST);
		TH_CHECK(strstr(s->msgs[r], "node n1"), "message: %s",
			 s->msgs[r]);
	}
	for (int r = 2; r < 4; r++)
		TH_CHECK(s->codes[r] != 0, "rank %d on the killed node's "
			 "daemon went on", r);
	printf("ok: a daemon killed while rows stream to it: node 0's ranks "
	       "get %s\n",
	       s->msgs[0]);
	unlink(D[1].sock);
	start_node(1, keyfile, false);
	wait_all_up();
}

/* A rank dies on node 1: the ranks on node 0 learn it at once. */
int rank_loss_rank(int rank, void *arg)
{
	return loss_rank(arg, rank, rank == 3, 3000000000ull); /* 3 killed */
}

void check_remote_rank_loss(void)
{
	struct late *s = late_new(2, 2, "rloss");
	pid_t pids[4];
	th_spawn(pids, 4, rank_loss_rank, s);
	while (s->entered < 3)
		th_sleep_ms(2);
	th_sleep_ms(100);
	kill(pids[3], SIGKILL);
	TH_CHECK(th_wait_all(pids, 3, 30) == 0, "a rank failed");
	th_reap(pids[3], 5);
	for (int r = 0; r < 3; r++)
		TH_EXPECT_RC(s->codes[r], EP_EPEERLOST);
	TH_CHECK(strstr(s->msgs[0], "on node n1") &&
			 strstr(s->msgs[0], "rank 3"),
		 "message: %s", s->msgs[0]);
	printf("ok: a rank killed on node 1 -> ranks on node 0 get peer "
	       "lost at once: %s\n",
	       s->msgs[0]);
}

/* Node 1's ranks join with another hidden: every rank gets EP_EMISMATCH. */
/* A rank dies on node 1 before node 0's ranks joined (node 1's notice of
 * the failure finds no group on node 0): node 0 learns it when its group
 * forms and its shape reaches node 1, so its first barrier fails at once,
 * not at the timeout. */
int early_loss_rank(int rank, void *arg)
{
	struct late *s = arg;
	if (rank < 2)
		th_sleep_ms(400); /* node 0 joins after the loss */
	ep_conn_t *c;
	ep_group_t *g = join(s, rank, &c, 20000);
	if (rank == 3)
		raise(SIGKILL);
	if (rank == 2) { /* node 1's group stays, failed, while node 0 asks */
		s->codes[rank] = ep_barrier(g);
		th_sleep_ms(1500);
		ep_leave(g);
		ep_close(c);
		return 0;
	}
	uint64_t t0 = th_now_ns();
	s->codes[rank] = ep_barrier(g);
	s->took_ms[rank] = (th_now_ns() - t0) / 1000000;
	snprintf(s->msgs[rank], sizeof(s->msgs[rank]), "%s", ep_errmsg());
	ep_leave(g);
	ep_close(c);
	return 0;
}

void check_early_remote_loss(void)
{
	struct late *s = late_new(2, 2, "eloss");
	pid_t pids[4];
	th_spawn(pids, 4, early_loss_rank, s);
	th_reap(pids[3], 30);
	TH_CHECK(th_wait_all(pids, 3, 60) == 0, "a rank failed");
	for (int r = 0; r < 3; r++)
		TH_EXPECT_RC(s->codes[r], EP_EPEERLOST);
	for (int r = 0; r < 2; r++)
		TH_CHECK(s->took_ms[r] < 5000,
			 "rank %d's barrier failed after %llu ms (timeout 20 "
			 "s): %s",
			 r, (unsigned long long)s->took_ms[r], s->msgs[r]);
	printf("ok: a rank killed on node 1 before node 0's ranks joined -> "
	       "node 0's first barrier fails in %llu ms: %s\n",
	       (unsigned long long)s->took_ms[0], s->msgs[0]);
}
