/* SPDX-License-Identifier: MIT */
/*
 * Daemons that learn their nodes (peer_lookup, epd.conf(5)): each one's
 * peers names only itself.
 *
 * 1. peer_lookup = dns: a 2-node job names its nodes by bare names; the
 *    node named lower (a1) finds the other (localhost) by its name at
 *    its own peer port, and the other learns a1 when it dials in. The
 *    group forms, runs barriers and a dispatch and combine whose rows are
 *    checked bitwise; each daemon's status lists the node it learnt. An
 *    address in a job's list is refused there (it takes peer_lookup =
 *    job).
 * 2. Peers that dial a dns-mode daemon with bad hellos (a name over the
 *    limit, a name with a space, an empty one, a well-formed unknown
 *    name that sends a frame instead of the key's proof, and 16 more
 *    names in turn): each connection is dropped, no name is learnt (a
 *    node is learnt only once its proof of the cluster key checks out),
 *    and the job runs again on the same daemons.
 * 3. peer_lookup = job with peer_nodes_max = 2: a join naming more nodes
 *    than the table holds is refused, naming the limit, and the node it
 *    named first is not forgotten to make room. Learnt nodes are
 *    forgotten once unused: at once where a new job's node needs the
 *    room (never one a group, forming or not, still names), and after
 *    peer_linger_ms anyway; an unused learnt node takes the address a
 *    new job gives, one in use keeps its own. A group that failed lets
 *    go of its nodes a timeout after the failure, though its rank stays
 *    connected: they are forgotten, the rank keeps the group's error.
 * (test_placement runs its whole suite with peer_lookup = job too:
 * tests/integration/placement_job.)
 */
#include "harness.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "epp.h"

#define H 128
#define K 2
#define T 6

static struct th_daemon D[3];
static int PORT;

static int dns_rank(int r, void *arg)
{
	(void)arg;
	const char *nodes[] = {"a1", "localhost"};
	struct ep_group_config cfg = {
		.name = "dns", .world_size = 2, .ranks_per_node = 1,
		.rank = (uint32_t)r, .num_experts = 4, .hidden = H,
		.max_tokens_per_rank = T, .topk = K, .dtype = EP_DTYPE_BF16,
		.timeout_ms = 20000};
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(D[r].sock, &c));
	TH_CHECK(!strcmp(ep_conn_node(c), nodes[r]), "rank %d on '%s'", r,
		 ep_conn_node(c));
	TH_OK(ep_join_nodes(c, &cfg, nodes, 0, &g));
	for (int i = 0; i < 3; i++)
		TH_OK(ep_barrier(g));
	/* every token of both ranks to expert 0 (rank 0) alone: rank 0
	 * receives rank 0's rows, then rank 1's */
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	uint16_t *x = b.x;
	for (uint32_t i = 0; i < T * H; i++)
		x[i] = (uint16_t)(0x3c00 + (uint32_t)r * 0x100 + i % 97);
	for (uint32_t i = 0; i < T * K; i++)
		b.topk_idx[i] = i % K ? -1 : 0;
	ep_handle_t h;
	TH_OK(ep_dispatch_inplace(g, T, 0, NULL, &h));
	TH_CHECK(h.num_recv == (r ? 0u : 2u * T), "rank %d received %u", r,
		 h.num_recv);
	const uint16_t *rx = b.recv_x;
	for (uint32_t i = 0; i < h.num_recv * H; i++) {
		const uint32_t src = i / (T * H), k = i % (T * H);
		TH_CHECK(rx[i] == (uint16_t)(0x3c00 + src * 0x100 + k % 97),
			 "row element %u", i);
	}
	for (uint32_t i = 0; i < h.num_recv * H; i++)
		b.combine_y[i] = rx[i];
	TH_OK(ep_combine_inplace(g, &h, 0));
	for (uint32_t i = 0; i < T * H; i++)
		TH_CHECK(b.combined[i] == x[i], "combined element %u", i);
	TH_OK(ep_handle_release(g, &h));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

static void expect_join(int d, const char *name, const char *const *list,
			uint32_t n, const char *frag)
{
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(D[d].sock, &c));
	struct ep_group_config cfg = {
		.name = name, .world_size = n, .ranks_per_node = 1, .rank = 0,
		.num_experts = 4 * n, .hidden = H, .max_tokens_per_rank = T,
		.topk = K, .dtype = EP_DTYPE_BF16, .timeout_ms = 2000};
	TH_EXPECT_RC(ep_join_nodes(c, &cfg, list, EP_JOIN_NOWAIT, &g),
		     EP_EINVAL);
	TH_CHECK(strstr(ep_errmsg(), frag), "want '%s' in: %s", frag,
		 ep_errmsg());
	ep_close(c);
}

/* A raw peer connection to the daemon listening on 127.0.0.1:PORT
 * ("localhost"): a hello naming `name`, then (junk) one frame that is
 * not the key's proof; the daemon must drop it. */
static void bad_hello(const char *name, bool junk)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = {.sin_family = AF_INET,
				 .sin_port = htons((uint16_t)PORT)};
	inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
	TH_CHECK(fd >= 0 && connect(fd, (struct sockaddr *)&sa,
				    sizeof(sa)) == 0,
		 "connect to the peer port: %s", strerror(errno));
	uint8_t b[1024];
	struct epp_wr w;
	epp_wr_init(&w, b, sizeof(b));
	epp_put_u16(&w, EPP_VERSION_MAJOR);
	epp_put_u16(&w, EPP_VERSION_MINOR);
	epp_put_str(&w, name);
	epp_put_u32(&w, 7);
	for (int i = 0; i < 32; i++)
		epp_put_u8(&w, (uint8_t)i);
	TH_CHECK(!w.err, "hello of %zu bytes", strlen(name));
	struct epp_hdr h;
	epp_hdr_init(&h, EPP_PEER_HELLO, 0);
	h.length = (uint32_t)w.off;
	/* (the daemon may drop it while it writes: a reset is fine) */
	(void)epp_send_frame(fd, &h, b, NULL);
	if (junk) {
		epp_hdr_init(&h, EPP_PEER_HELLO, 1);
		(void)epp_send_frame(fd, &h, b, NULL);
	}
	/* its own hello may come first; then the end, within the
	 * handshake's time */
	char rb[512];
	uint64_t t0 = th_now_ns();
	for (;;) {
		ssize_t n = read(fd, rb, sizeof(rb));
		if (n <= 0)
			break;
		TH_CHECK(th_now_ns() - t0 < 20000000000ull * th_scale(),
			 "a bad hello (%.40s) was not dropped", name);
	}
	close(fd);
}

/* Does daemon d's status hold frag? */
static bool status_has(int d, const char *frag)
{
	ep_conn_t *c;
	char *js;
	TH_OK(ep_connect(D[d].sock, &c));
	TH_OK(ep_daemon_status(c, &js));
	ep_close(c);
	const bool has = strstr(js, frag) != NULL;
	free(js);
	return has;
}

/* Wait (up to secs) until daemon d's status holds frag (want) or no
 * longer does. */
static void wait_status(int d, const char *frag, bool want, double secs,
			const char *what)
{
	const uint64_t t0 = th_now_ns();
	while (status_has(d, frag) != want) {
		TH_CHECK(th_now_ns() - t0 < (uint64_t)(secs * 1e9 * th_scale()),
			 "%s: the status %s '%s' after %.1f s", what,
			 want ? "lacks" : "still has", frag, secs);
		usleep(20000);
	}
}

/* A join of this node (j0, daemon 2) and `other` that waits for it
 * (EP_JOIN_NOWAIT: the group forms later, or never); its connection. */
static ep_conn_t *join_open_g(const char *name, const char *other,
			      uint32_t timeout_ms, ep_group_t **gp)
{
	ep_conn_t *c;
	ep_group_t *g;
	const char *list[] = {"j0", other};
	TH_OK(ep_connect(D[2].sock, &c));
	struct ep_group_config cfg = {
		.name = name, .world_size = 2, .ranks_per_node = 1, .rank = 0,
		.num_experts = 8, .hidden = H, .max_tokens_per_rank = T,
		.topk = K, .dtype = EP_DTYPE_BF16, .timeout_ms = timeout_ms};
	TH_OK(ep_join_nodes(c, &cfg, list, EP_JOIN_NOWAIT, &g));
	if (gp)
		*gp = g;
	return c;
}

static ep_conn_t *join_open(const char *name, const char *other)
{
	return join_open_g(name, other, 60000, NULL);
}

static void start(struct th_daemon *d, const char *name, const char *host,
		  int port, const char *key, const char *lookup,
		  const char *extra)
{
	char nn[80], peers[160], kf[300], lk[40];
	snprintf(nn, sizeof(nn), "node_name=%s", name);
	snprintf(peers, sizeof(peers), "peers=%s@%s:%d", name, host, port);
	snprintf(kf, sizeof(kf), "cluster_key_file=%s", key);
	snprintf(lk, sizeof(lk), "peer_lookup=%s", lookup);
	th_daemon_start(d, "-o", nn, "-o", peers, "-o", kf, "-o", lk, "-o",
			"transport=tcp", "-o", "heartbeat_ms=100", "-o",
			"peer_linger_ms=1000", "-o", extra, NULL);
}

int main(void)
{
	th_init("test_lookup", 120);
	char key[256];
	snprintf(key, sizeof(key), "%s/cluster.key", th_tmpdir("epdlookup"));
	FILE *f = fopen(key, "w");
	TH_CHECK(f, "cannot write %s", key);
	fprintf(f, "lookup-cluster-key-%d-0123456789abcdef\n", getpid());
	fclose(f);
	TH_CHECK(!chmod(key, 0600), "chmod %s", key);
	/* one port, two addresses: peer_lookup = dns reaches a node by its
	 * name at this node's own port */
	PORT = th_ports(1);
	start(&D[0], "a1", "127.0.0.2", PORT, key, "dns", "heartbeat_miss=20");
	start(&D[1], "localhost", "127.0.0.1", PORT, key, "dns",
	      "heartbeat_miss=20");
	pid_t p[2];
	th_spawn(p, 2, dns_rank, NULL);
	TH_CHECK(th_wait_all(p, 2, 60) == 0, "the dns job");
	for (int d = 0; d < 2; d++) {
		ep_conn_t *c;
		char *js;
		TH_OK(ep_connect(D[d].sock, &c));
		TH_OK(ep_daemon_status(c, &js));
		ep_close(c);
		const char *other = d ? "\"name\":\"a1\"" : "\"name\":\"localhost\"";
		TH_CHECK(strstr(js, other), "daemon %d does not list %s: %s", d,
			 other, js);
		free(js);
	}
	printf("ok: peer_lookup = dns: a 2-node job by bare names (a1 dials "
	       "localhost by its name, localhost learns a1 as it dials in): "
	       "barriers, a dispatch and combine bitwise; each status lists "
	       "the other node\n");
	/* bad hellos to "localhost" (dns mode): dropped, nothing learnt */
	char longname[300];
	memset(longname, 'x', sizeof(longname) - 1);
	longname[sizeof(longname) - 1] = 0;
	bad_hello(longname, false);
	bad_hello("a1 b", false);
	bad_hello("", false);
	bad_hello("intruder", true);
	/* (those without a frame after the hello wait out the daemon's
	 * handshake time: a few) */
	for (int i = 0; i < 16; i++) {
		char nm[32];
		snprintf(nm, sizeof(nm), "ghost%d", i);
		bad_hello(nm, i % 4 != 0);
	}
	{
		ep_conn_t *c;
		char *js;
		TH_OK(ep_connect(D[1].sock, &c));
		TH_OK(ep_daemon_status(c, &js));
		ep_close(c);
		TH_CHECK(!strstr(js, "intruder") && !strstr(js, "ghost") &&
				 !strstr(js, "xxxxxxxx"),
			 "a bad hello's name was learnt: %s", js);
		free(js);
	}
	th_spawn(p, 2, dns_rank, NULL);
	TH_CHECK(th_wait_all(p, 2, 60) == 0, "the dns job after bad hellos");
	printf("ok: 20 bad hellos to a dns-mode daemon (a 299-byte name, a "
	       "space, an empty name, unknown names without the key's "
	       "proof): each dropped, none learnt; the job runs again\n");
	const char *addr[] = {"a1", "b2@127.0.0.1:9"};
	expect_join(0, "addr", addr, 2, "only with peer_lookup = job");
	printf("ok: an address in a job's list, where peer_lookup is dns: "
	       "EP_EINVAL\n");
	start(&D[2], "j0", "127.0.0.3", PORT, key, "job", "peer_nodes_max=2");
	const char *three[] = {"j0", "p1@127.0.0.1:9", "p2@127.0.0.1:9"};
	expect_join(2, "full", three, 3,
		    "node table is full (peer_nodes_max 2, every node in use)");
	printf("ok: peer_lookup = job, peer_nodes_max 2: a join naming a "
	       "third node is refused, naming the limit (the node it named "
	       "first is not forgotten to make room)\n");
	/* learnt nodes are forgotten once unused: the table holds the
	 * nodes in use, however many jobs came and went (q1, q2 at the
	 * discard port: never reached, their groups never form) */
	ep_conn_t *c1 = join_open("q1job", "q1@127.0.0.1:9");
	TH_CHECK(status_has(2, "\"name\":\"q1\""), "q1 not learnt");
	const char *q2[] = {"j0", "q2@127.0.0.1:9"};
	expect_join(2, "q2full", q2, 2, "every node in use");
	ep_close(c1); /* its group goes; q1 is unused */
	wait_status(2, "\"name\":\"q1job\"", false, 10, "q1job's end");
	ep_conn_t *c2 = NULL;
	const uint64_t t0 = th_now_ns();
	for (;;) { /* (the group's end reaches the loop a moment later) */
		ep_conn_t *c;
		ep_group_t *g;
		TH_OK(ep_connect(D[2].sock, &c));
		struct ep_group_config cfg = {
			.name = "q2job", .world_size = 2, .ranks_per_node = 1,
			.num_experts = 8, .hidden = H, .max_tokens_per_rank = T,
			.topk = K, .dtype = EP_DTYPE_BF16, .timeout_ms = 60000};
		if (ep_join_nodes(c, &cfg, q2, EP_JOIN_NOWAIT, &g) == 0) {
			c2 = c;
			break;
		}
		TH_CHECK(strstr(ep_errmsg(), "every node in use") &&
				 th_now_ns() - t0 < 10000000000ull * th_scale(),
			 "q2's join: %s", ep_errmsg());
		ep_close(c);
		usleep(20000);
	}
	TH_CHECK(status_has(2, "\"name\":\"q2\"") &&
			 !status_has(2, "\"name\":\"q1\""),
		 "q1 not forgotten for q2");
	printf("ok: a full table (peer_nodes_max 2) makes room for a new "
	       "job's node by forgetting an unused learnt one at once, and "
	       "only an unused one (refused while q1's group was there)\n");
	/* an unused learnt node takes the address the next job gives */
	ep_close(c2);
	wait_status(2, "\"nodes\":1", true, 10, "q2's group's end");
	TH_CHECK(!status_has(2, "\"name\":\"q2\""), "q2 still listed");
	printf("ok: learnt nodes unused for peer_linger_ms are forgotten "
	       "(the table holds only this node again)\n");
	c1 = join_open("q3job", "q3@127.0.0.1:9");
	ep_close(c1);
	wait_status(2, "\"name\":\"q3job\"", false, 10, "q3job's end");
	c1 = join_open("q3job", "q3@127.0.0.2:9");
	TH_CHECK(status_has(2, "\"addr\":\"127.0.0.2:9\""),
		 "q3 kept its first address while unused");
	c2 = join_open("q3job2", "q3@127.0.0.3:9");
	TH_CHECK(status_has(2, "\"addr\":\"127.0.0.2:9\""),
		 "q3 re-addressed while a group used it");
	ep_close(c1);
	ep_close(c2);
	printf("ok: a learnt node nothing uses takes the address a new job "
	       "gives; one in use keeps its own\n");
	/* a group that failed (its node never came: the join's timeout)
	 * while its rank stays connected lets go of its node a timeout
	 * after the failure: the node is forgotten, the rank keeps the
	 * group's error */
	ep_group_t *g5;
	c1 = join_open_g("q5job", "q5@127.0.0.1:9", 300, &g5);
	wait_status(2, "\"state\":\"failed\"", true, 10, "q5job's failure");
	wait_status(2, "\"name\":\"q5\"", false, 10,
		    "q5 released by its failed group");
	TH_CHECK(status_has(2, "\"name\":\"q5job\""),
		 "the failed group went with its node");
	int rc5 = ep_barrier(g5);
	TH_CHECK(rc5 == EP_ETIMEDOUT && strstr(ep_errmsg(), "q5"),
		 "the failed group's rank: %d %s", rc5, ep_errmsg());
	ep_close(c1);
	wait_status(2, "\"name\":\"q5job\"", false, 10, "q5job's end");
	printf("ok: a failed group whose rank stays connected releases its "
	       "node a timeout after the failure (the node is forgotten); "
	       "its rank still gets the group's error naming the node\n");
	/* a forming group that lost one of its local ranks forms when that
	 * rank is back, not when its other node comes: two local ranks wait
	 * for node "localhost" (stopped), one leaves, the node comes back */
	th_daemon_stop(&D[1]);
	char other[64];
	snprintf(other, sizeof(other), "localhost@127.0.0.1:%d", PORT);
	const char *l6[] = {"j0", other};
	ep_conn_t *c6[2];
	ep_group_t *g6[2];
	for (int r = 0; r < 2; r++) {
		TH_OK(ep_connect(D[2].sock, &c6[r]));
		struct ep_group_config cfg = {
			.name = "q6job", .world_size = 4, .ranks_per_node = 2,
			.rank = (uint32_t)r, .num_experts = 8, .hidden = H,
			.max_tokens_per_rank = T, .topk = K,
			.dtype = EP_DTYPE_BF16, .timeout_ms = 60000};
		TH_OK(ep_join_nodes(c6[r], &cfg, l6, EP_JOIN_NOWAIT, &g6[r]));
	}
	int rc6 = ep_barrier(g6[0]);
	TH_CHECK(rc6 == EP_ENOTREADY &&
			 strstr(ep_errmsg(), "waiting for its nodes: localhost"),
		 "a group waiting for its nodes: %d %s", rc6, ep_errmsg());
	ep_close(c6[1]);
	wait_status(2, "\"missing\":[1]", true, 10, "q6job's rank 1 leaving");
	start(&D[1], "localhost", "127.0.0.1", PORT, key, "dns",
	      "heartbeat_miss=20");
	wait_status(2, "\"state\":\"up\"", true, 10, "node localhost up");
	usleep(200000);
	TH_CHECK(status_has(2, "\"state\":\"forming\""),
		 "q6job formed without its rank 1");
	rc6 = ep_barrier(g6[0]);
	TH_CHECK(rc6 == EP_ENOTREADY && strstr(ep_errmsg(), "not joined: 1"),
		 "q6job's rank 0: %d %s", rc6, ep_errmsg());
	ep_close(c6[0]);
	printf("ok: a forming group that lost a local rank does not form "
	       "when its node comes (EP_ENOTREADY naming the rank); while "
	       "it waits for a node, EP_ENOTREADY names the node\n");
	for (int d = 0; d < 3; d++)
		th_daemon_stop(&D[d]);
	printf("ok\n");
	return 0;
}
