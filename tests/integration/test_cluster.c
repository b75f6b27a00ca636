/* SPDX-License-Identifier: MIT */
/*
 * Several daemons on one machine (loopback ports), the tcp transport:
 * membership, the two-phase barrier across nodes with a late rank in every
 * position (the diagonal case in particular: neither on the leaver's node
 * nor on its rail), a daemon killed and restarted, a wrong cluster key, a
 * wrong protocol version and garbage on the peer port.
 */
#include "harness.h"
#include "epp.h"

#include <jansson.h>
#include <signal.h>
#include <string.h>
#include <errno.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#define NODES 3
#define DELAY_MS 40
#define MAXW 8

static struct th_daemon D[NODES];
static char peers[256], keyfile[160], badkey[160];
static char optv[NODES][6][300];
static int base_port;

static void start_node(int i, const char *key, bool fresh)
{
	snprintf(optv[i][0], 300, "node_name=n%d", i);
	snprintf(optv[i][1], 300, "peers=%s", peers);
	snprintf(optv[i][2], 300, "cluster_key_file=%s", key);
	const char *args[] = {"-o", optv[i][0], "-o", optv[i][1], "-o",
			      optv[i][2], "-o", "heartbeat_ms=100", "-o",
			      "heartbeat_miss=5", NULL};
	if (fresh)
		th_daemon_start(&D[i], "-o", optv[i][0], "-o", optv[i][1], "-o",
				optv[i][2], "-o", "heartbeat_ms=100", "-o",
				"heartbeat_miss=5", NULL);
	else
		th_daemon_start_in(&D[i], args);
}

static json_t *cluster_of(int i)
{
	ep_conn_t *c;
	char *js;
	TH_OK(ep_connect(D[i].sock, &c));
	TH_OK(ep_daemon_status(c, &js));
	ep_close(c);
	json_t *root = json_loads(js, 0, NULL);
	free(js);
	TH_CHECK(root, "status is not JSON");
	json_t *cl = json_incref(json_object_get(root, "cluster"));
	json_decref(root);
	return cl;
}

/* Until node i's row reads `want` (S self, U up, D down). */
static void wait_row(int i, const char *want)
{
	for (int t = 0; t < 500; t++) {
		json_t *cl = cluster_of(i);
		bool ok = !strcmp(json_string_value(json_object_get(cl, "row")),
				  want);
		json_decref(cl);
		if (ok)
			return;
		th_sleep_ms(10);
	}
	TH_CHECK(0, "node %d never saw the cluster as %s", i, want);
}

static void wait_all_up(void)
{
	wait_row(0, "SUU");
	wait_row(1, "USU");
	wait_row(2, "UUS");
}

struct late {
	int nodes, rpn;
	char name[32];
	uint64_t enter[MAXW][MAXW], leave[MAXW][MAXW];
	volatile int entered;
	int codes[MAXW];
	char msgs[MAXW][256];
};

static ep_group_t *join(struct late *s, int rank, ep_conn_t **c,
			uint32_t timeout_ms)
{
	int world = s->nodes * s->rpn, node = rank / s->rpn;
	struct ep_group_config cfg = th_group(s->name, (uint32_t)world,
					      (uint32_t)rank, timeout_ms);
	cfg.ranks_per_node = (uint32_t)s->rpn;
	ep_group_t *g;
	TH_OK(ep_connect(D[node].sock, c));
	TH_OK(ep_join(*c, &cfg, 0, &g));
	return g;
}

static int late_rank(int rank, void *arg)
{
	struct late *s = arg;
	int world = s->nodes * s->rpn;
	ep_conn_t *c;
	ep_group_t *g = join(s, rank, &c, 20000);
	for (int late = 0; late < world; late++) {
		TH_OK(ep_barrier(g));
		if (rank == late)
			th_sleep_ms(DELAY_MS);
		s->enter[late][rank] = th_now_ns();
		TH_OK(ep_barrier(g));
		s->leave[late][rank] = th_now_ns();
	}
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

static void check_late(int nodes, int rpn)
{
	struct late *s = th_shared(sizeof(*s));
	s->nodes = nodes;
	s->rpn = rpn;
	snprintf(s->name, sizeof(s->name), "x%dx%d", nodes, rpn);
	int world = nodes * rpn;
	pid_t pids[MAXW];
	th_spawn(pids, world, late_rank, s);
	TH_CHECK(th_wait_all(pids, world, 60) == 0, "%dx%d: a rank failed",
		 nodes, rpn);
	int diagonal = 0;
	for (int late = 0; late < world; late++) {
		uint64_t le = s->enter[late][late];
		for (int r = 0; r < world; r++) {
			TH_CHECK(s->leave[late][r] >= le,
				 "%dx%d, late rank %d: rank %d left %.3f ms "
				 "before it entered",
				 nodes, rpn, late, r,
				 (double)(le - s->leave[late][r]) / 1e6);
			bool other_node = r / rpn != late / rpn;
			bool other_rail = r % rpn != late % rpn;
			if (other_node && other_rail) {
				/* the diagonal: it really waited */
				double w = (double)(s->leave[late][r] -
						    s->enter[late][r]) /
					   1e6;
				TH_CHECK(w >= DELAY_MS * 0.5,
					 "diagonal rank %d waited %.3f ms for "
					 "late rank %d",
					 r, w, late);
				diagonal++;
			}
		}
	}
	printf("ok: %d nodes x %d ranks, every late rank (%d diagonal "
	       "pairs): nobody left early\n",
	       nodes, rpn, diagonal);
}

static int lost_rank(int rank, void *arg)
{
	struct late *s = arg;
	ep_conn_t *c;
	ep_group_t *g = join(s, rank, &c, 20000);
	TH_OK(ep_barrier(g));
	if (rank / s->rpn == 1) /* node 1's ranks: their daemon dies */
		for (;;)
			pause();
	__atomic_fetch_add(&s->entered, 1, __ATOMIC_SEQ_CST);
	uint64_t t0 = th_now_ns();
	s->codes[rank] = ep_barrier(g);
	snprintf(s->msgs[rank], sizeof(s->msgs[rank]), "%s", ep_errmsg());
	TH_CHECK(th_now_ns() - t0 < 5000000000ull, "peer loss took too long");
	ep_leave(g);
	ep_close(c);
	return 0;
}

static void check_node_loss(void)
{
	struct late *s = th_shared(sizeof(*s));
	s->nodes = 2;
	s->rpn = 2;
	snprintf(s->name, sizeof(s->name), "lost");
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

/* A hung daemon (SIGSTOP) closes nothing: only the missed heartbeats tell
 * (100 ms x 5 here). */
static void check_silent_node(void)
{
	kill(D[2].pid, SIGSTOP);
	uint64_t t0 = th_now_ns();
	wait_row(0, "SUD");
	double ms = (double)(th_now_ns() - t0) / 1e6;
	TH_CHECK(ms >= 400 && ms < 3000,
		 "a silent node was marked down after %.0f ms (5 beats of "
		 "100 ms)",
		 ms);
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

static void check_wrong_key(void)
{
	th_daemon_stop(&D[2]);
	wait_row(0, "SUD");
	start_node(2, badkey, false);
	th_sleep_ms(800);
	wait_row(0, "SUD");
	wait_row(2, "DDS");
	json_t *cl = cluster_of(0);
	TH_CHECK(json_integer_value(json_object_get(cl, "rejected")) > 0,
		 "no rejection counted");
	json_decref(cl);
	FILE *f = fopen(D[0].log, "r");
	char line[512];
	bool seen = false;
	while (f && fgets(line, sizeof(line), f))
		seen |= strstr(line, "wrong cluster key") != NULL;
	if (f)
		fclose(f);
	TH_CHECK(seen, "node 0 did not log the wrong key");
	printf("ok: a node with the wrong cluster key is rejected and logged\n");
	th_daemon_stop(&D[2]);
	start_node(2, keyfile, false);
	wait_all_up();
}

static int raw_peer(void)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = {.sin_family = AF_INET,
				 .sin_port = htons((uint16_t)base_port)};
	inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
	TH_CHECK(connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0,
		 "connect to the peer port");
	return fd;
}

static void expect_dropped(int fd)
{
	char b[256];
	/* the daemon sends its hello, then closes on what we sent */
	for (int i = 0; i < 100; i++) {
		ssize_t n = read(fd, b, sizeof(b));
		if (n == 0)
			break;
		TH_CHECK(n > 0, "read: %s", strerror(errno));
	}
	close(fd);
}

static void check_bad_peers(void)
{
	json_t *cl = cluster_of(0);
	json_int_t before = json_integer_value(json_object_get(cl, "rejected"));
	json_decref(cl);
	/* a newer major version */
	int fd = raw_peer();
	struct epp_hdr h;
	epp_hdr_init(&h, EPP_PEER_HELLO, 0);
	h.ver_major = EPP_VERSION_MAJOR + 1;
	uint8_t hb[EPP_HDR_SIZE];
	epp_hdr_encode(&h, hb);
	TH_CHECK(write(fd, hb, sizeof(hb)) == sizeof(hb), "write");
	expect_dropped(fd);
	/* garbage */
	fd = raw_peer();
	uint8_t junk[200];
	for (size_t i = 0; i < sizeof(junk); i++)
		junk[i] = (uint8_t)(i * 37 + 11);
	TH_CHECK(write(fd, junk, sizeof(junk)) == sizeof(junk), "write");
	expect_dropped(fd);
	/* a well-formed hello from a node that does not exist */
	fd = raw_peer();
	uint8_t p[128];
	struct epp_wr w;
	epp_wr_init(&w, p, sizeof(p));
	epp_put_u16(&w, EPP_VERSION_MAJOR);
	epp_put_u16(&w, EPP_VERSION_MINOR);
	epp_put_str(&w, "intruder");
	epp_put_u32(&w, 7);
	for (int i = 0; i < 32; i++)
		epp_put_u8(&w, 0);
	epp_hdr_init(&h, EPP_PEER_HELLO, 0);
	h.length = (uint32_t)w.off;
	epp_hdr_encode(&h, hb);
	TH_CHECK(write(fd, hb, sizeof(hb)) == sizeof(hb) &&
			 write(fd, p, w.off) == (ssize_t)w.off,
		 "write");
	expect_dropped(fd);
	cl = cluster_of(0);
	TH_CHECK(json_integer_value(json_object_get(cl, "rejected")) >=
			 before + 3,
		 "rejections not counted");
	json_decref(cl);
	wait_all_up(); /* nothing else disturbed */
	printf("ok: wrong version, garbage and an unknown node on the peer "
	       "port: rejected, the cluster undisturbed\n");
}

int main(void)
{
	th_init("cluster: tcp membership and the barrier across nodes", 240);
	base_port = 20000 + (int)(getpid() % 15000) * 3;
	snprintf(peers, sizeof(peers),
		 "n0@127.0.0.1:%d, n1@127.0.0.1:%d, n2@127.0.0.1:%d",
		 base_port, base_port + 1, base_port + 2);
	char kdir[64];
	snprintf(kdir, sizeof(kdir), "%s/epdkeys.XXXXXX",
		 getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
	TH_CHECK(mkdtemp(kdir), "mkdtemp");
	snprintf(keyfile, sizeof(keyfile), "%s/cluster.key", kdir);
	snprintf(badkey, sizeof(badkey), "%s/other.key", kdir);
	FILE *f = fopen(keyfile, "w");
	fprintf(f, "a-shared-secret-of-this-test-cluster-%d\n", getpid());
	fclose(f);
	f = fopen(badkey, "w");
	fprintf(f, "some-other-secret-that-is-not-the-key-%d\n", getpid());
	fclose(f);
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

	check_late(2, 2);
	check_late(3, 2);
	check_late(2, 4);
	check_node_loss();
	check_late(3, 2); /* a new group across all nodes after the rejoin */
	check_silent_node();
	check_wrong_key();
	check_bad_peers();
	check_late(2, 2);
	for (int i = 0; i < NODES; i++)
		th_daemon_stop(&D[i]);
	return 0;
}
