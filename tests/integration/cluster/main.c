/* SPDX-License-Identifier: MIT */
/*
 * Several daemons on one machine (loopback ports), the tcp transport:
 * membership, the two-phase barrier across nodes with a late rank in every
 * position (the diagonal case in particular: neither on the leaver's node
 * nor on its rail), a daemon killed and restarted, a wrong cluster key, a
 * wrong protocol version and garbage on the peer port.
 *
 * One program on purpose: every scenario runs against the one cluster of
 * three daemons it starts, in order (later ones kill, stop and rejoin its
 * nodes), and tests/rdma-vm boots a guest per program run; as separate
 * programs each would pay a cluster start (seconds under the guest's
 * software CPU) and the order between them would be lost. The scenarios
 * live in files by topic (cluster.h says which); this one starts the
 * cluster and runs them in order.
 */
#include "cluster.h"

int main(void)
{
	th_init("cluster: tcp membership and the barrier across nodes", 240);
	if (getenv("EPD_TEST_SLOW"))
		miss = 20;
	/* an emulated CPU under TSan: a daemon streaming rows was once
	 * silent 3.5 s there (tests/rdma-vm, EPD_TEST_ALARM_SCALE=4) */
	miss *= (int)th_scale();
	TH_CHECK(sodium_init() >= 0, "libsodium");
	base_port = th_ports(NODES);
	const char *ph = getenv("EPD_TEST_PEER_HOST");
	if (getenv("EPD_TEST_TRANSPORT") && *getenv("EPD_TEST_TRANSPORT"))
		transport = getenv("EPD_TEST_TRANSPORT");
	rdma = !strcmp(transport, "rdma");
	char hosts[NODES][64];
	if (ph && strchr(ph, ',')) {
		/* one host per node: nodes on different devices (a second
		 * rxe), whose rows then go as frames */
		char buf[256], *save = NULL;
		snprintf(buf, sizeof(buf), "%s", ph);
		char *t = strtok_r(buf, ",", &save);
		for (int i = 0; i < NODES; i++) {
			TH_CHECK(t, "EPD_TEST_PEER_HOST names %d hosts", i);
			snprintf(hosts[i], sizeof(hosts[i]), "%s", t);
			t = strtok_r(NULL, ",", &save);
		}
		two_devices = strcmp(hosts[0], hosts[1]) ||
			      strcmp(hosts[1], hosts[2]);
		ph = hosts[0];
	} else if (ph && *ph) {
		for (int i = 0; i < NODES; i++)
			snprintf(hosts[i], sizeof(hosts[i]), "%s", ph);
	}
	if (ph && *ph)
		snprintf(peers, sizeof(peers), "n0@%s:%d, n1@%s:%d, n2@%s:%d",
			 hosts[0], base_port, hosts[1], base_port + 1,
			 hosts[2], base_port + 2);
	else
		snprintf(peers, sizeof(peers),
			 "n0@127.0.0.1:%d, n1@localhost:%d, n2@127.0.0.1:%d",
			 base_port, base_port + 1, base_port + 2);
	printf("transport %s, peers %s\n", transport, peers);
	const char *kdir = th_tmpdir("epdkeys");
	snprintf(keyfile, sizeof(keyfile), "%s/cluster.key", kdir);
	snprintf(badkey, sizeof(badkey), "%s/other.key", kdir);
	FILE *f = fopen(keyfile, "w");
	fprintf(f, "a-shared-secret-of-this-test-cluster-%d\n", getpid());
	fclose(f);
	f = fopen(badkey, "w");
	fprintf(f, "some-other-secret-that-is-not-the-key-%d\n", getpid());
	fclose(f);
	TH_CHECK(!chmod(keyfile, 0600) && !chmod(badkey, 0600), "chmod");
	for (int i = 0; i < NODES; i++)
		start_node(i, keyfile, true);
	wait_all_up();
	/* the full matrix, from every node's heartbeats */
	for (int t = 0;; t++) {
		json_t *cl = cluster_of(0);
		json_t *m = json_object_get(cl, "matrix");
		bool ok = json_array_size(m) == 3 &&
			  !strcmp(json_string_value(json_array_get(m, 0)), "SUU") &&
			  !strcmp(json_string_value(json_array_get(m, 1)), "USU") &&
			  !strcmp(json_string_value(json_array_get(m, 2)), "UUS");
		json_decref(cl);
		if (ok)
			break;
		TH_CHECK(t < 200, "node 0 never saw the full matrix");
		th_sleep_ms(10);
	}
	printf("ok: 3 daemons see each other; node 0's matrix: SUU/USU/UUS\n");
	{
		json_t *cl = cluster_of(0);
		const char *tr = json_string_value(
			json_object_get(cl, "transport"));
		const char *want = rdma ? "rdma" : "tcp";
		TH_CHECK(tr && !strcmp(tr, want), "transport %s, want %s",
			 tr ? tr : "(none)", want);
		/* auto with an RDMA device (tests/rdma-vm) and peers on
		 * loopback: tcp, and it says why */
		const char *why = json_string_value(
			json_object_get(cl, "transport_reason"));
		TH_CHECK(why, "no transport reason");
		if (!rdma && access("/sys/class/infiniband/rxe0", F_OK) == 0)
			TH_CHECK(strstr(why, "loopback"), "reason: %s", why);
		json_t *p1 = json_array_get(json_object_get(cl, "peers"), 1);
		const char *pt = json_string_value(
			json_object_get(p1, "transport"));
		TH_CHECK(pt && !strcmp(pt, want),
			 "peer n1's transport %s, want %s", pt ? pt : "(none)",
			 want);
		printf("ok: the cluster and each peer run %s (%s)\n", want,
		       why);
		json_decref(cl);
	}
	/* EPD_TEST_EXPECT_FRAMES=1 (tests/rdma-vm with node 1 on a second
	 * device): some connection is on another device than its node's
	 * first one, so rows to that peer go as frames while others go by
	 * RDMA WRITE; the dispatch checks below then cover both at once. */
	if (rdma && getenv("EPD_TEST_EXPECT_FRAMES")) {
		char rows[NODES * NODES * 4] = "";
		int frames = 0, writes = 0;
		for (int i = 0; i < NODES; i++) {
			json_t *cl = cluster_of(i);
			size_t k;
			json_t *p;
			json_array_foreach(json_object_get(cl, "peers"), k, p)
			{
				const char *r = json_string_value(
					json_object_get(p, "rows"));
				TH_CHECK(r, "node %d: no rows for peer %zu", i,
					 k);
				frames += !strcmp(r, "frames");
				writes += !strcmp(r, "rdma-write");
				snprintf(rows + strlen(rows),
					 sizeof(rows) - strlen(rows), "%s%c",
					 (int)k == i ? "" : "",
					 (int)k == i   ? 'S'
					 : *r == 'f' ? 'F'
						     : 'W');
			}
			snprintf(rows + strlen(rows), sizeof(rows) - strlen(rows),
				 "%s", i + 1 < NODES ? "/" : "");
			json_decref(cl);
		}
		TH_CHECK(frames > 0 && writes > 0,
			 "rows per peer (F frames, W rdma-write): %s", rows);
		printf("ok: a connection on a second device carries rows as "
		       "frames, the others by RDMA WRITE (per node: %s)\n",
		       rows);
	}

	check_late(2, 2);
	check_late(3, 2);
	check_late(2, 4);
	uint64_t seed = (uint64_t)time(NULL);
	printf("seed %llu\n", (unsigned long long)seed);
	struct ref_case c1 = {.seed = seed, .experts = 16, .hidden = 256,
			      .topk = 4, .max_tokens = 96,
			      .tokens = {96, 0, 37, 96, 5, 64},
			      .dtype = EP_DTYPE_BF16, .weights = true,
			      .bias = true};
	check_xdispatch(2, 2, c1, 3);
	struct ref_case c2 = {.seed = seed + 1, .experts = 24, .hidden = 384,
			      .topk = 6, .max_tokens = 64,
			      .tokens = {64, 17, 0, 64, 33, 1},
			      .dtype = EP_DTYPE_FP8, .weights = true};
	check_xdispatch(3, 2, c2, -1);
	struct ref_case c3 = {.seed = seed + 2, .experts = 64, .hidden = 512,
			      .topk = 8, .max_tokens = 40,
			      .tokens = {40, 40, 3, 0, 40, 12, 7, 40},
			      .dtype = EP_DTYPE_BF16, .mode = REF_ONE_EXPERT,
			      .special = 9, .bias = true};
	check_xdispatch(2, 4, c3, -1);
	/* no group spans nodes any more: the kept buffers are freed */
	for (int t = 0;; t++) {
		json_t *pc = cluster_of(0);
		json_int_t kept =
			json_integer_value(json_object_get(pc, "pooled_bytes"));
		json_decref(pc);
		if (kept == 0)
			break;
		TH_CHECK(t < 300, "node 0 still keeps %lld bytes of row "
			 "buffers with no group across nodes",
			 (long long)kept);
		th_sleep_ms(10);
	}
	printf("ok: row buffers kept between ops, freed with the last group "
	       "across nodes\n");
	check_bad_joins();
	check_remote_stall();
	check_remote_stall_one();
	check_shape_mismatch();
	check_weights_mismatch();
	check_handle_mismatch();
	check_kind_mismatch();
	check_op_mismatch();
	check_restart();
	check_xtoobig();
	check_remote_rank_loss();
	check_early_remote_loss();
	check_node_loss();
	check_node_loss_streaming();
	check_late(3, 2); /* a new group across all nodes after the rejoin */
	check_silent_node();
	check_wrong_key();
	check_rejoins();
	if (!rdma) { /* fake peers speak raw tcp */
		check_relay();
		check_resets();
		check_bad_peers();
		check_peer_flood();
		check_bad_member();
		check_peer_chaos();
		check_bad_windows();
	} else {
		printf("skip: raw-tcp fake peers (relay, resets, bad peers, "
		       "bad members, bad windows) under rdma\n");
	}
	check_late(2, 2);
	const char *rxe = getenv("EPD_TEST_RXE_DELETE");
	if (rdma && rxe && *rxe)
		check_device_removal(rxe);
	/* Every daemon stops with a peer connection open that never said
	 * who it is (accepted: the daemon's hello arrived). Stopping marked
	 * the node of each peer connection down, and such a one has none:
	 * node[-1] was written (a heap underflow; a crash under TSan). */
	int strangers[NODES];
	for (int i = 0; i < NODES; i++) {
		strangers[i] = rdma ? -1 : raw_peer_of(i);
		if (strangers[i] < 0)
			continue;
		struct pollfd pf = {.fd = strangers[i], .events = POLLIN};
		char b[64];
		TH_CHECK(poll(&pf, 1, 5000) == 1 &&
				 read(strangers[i], b, sizeof(b)) > 0,
			 "node %d's hello to a new peer connection", i);
	}
	for (int i = 0; i < NODES; i++)
		th_daemon_stop(&D[i]);
	for (int i = 0; i < NODES; i++)
		if (strangers[i] >= 0)
			close(strangers[i]);
	if (!rdma)
		printf("ok: daemons stopped with a peer connection that never "
		       "said hello: exit status 0\n");
	return 0;
}
