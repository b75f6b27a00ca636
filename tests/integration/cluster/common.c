/* SPDX-License-Identifier: MIT */
/* test_cluster: the cluster's nodes and what the scenarios share. */
#include "cluster.h"

struct th_daemon D[NODES];
char peers[256], keyfile[160], badkey[160];
char optv[NODES][7][300];
int base_port;

int miss = 10;

const char *transport = "auto";
bool rdma, two_devices;

void start_node(int i, const char *key, bool fresh)
{
	snprintf(optv[i][0], 300, "node_name=n%d", i);
	snprintf(optv[i][1], 300, "peers=%s", peers);
	snprintf(optv[i][2], 300, "cluster_key_file=%s", key);
	snprintf(optv[i][3], 300, "heartbeat_ms=%d", BEAT_MS);
	snprintf(optv[i][4], 300, "heartbeat_miss=%d", miss);
	snprintf(optv[i][5], 300, "transport=%s", transport);
	/* the membership matrix of every node: the whole mesh connected
	 * (test_placement covers connections on demand) */
	const char *args[] = {"-o", optv[i][0], "-o", optv[i][1], "-o",
			      optv[i][2], "-o", optv[i][3], "-o",
			      optv[i][4], "-o", optv[i][5], "-o",
			      "peer_connect=all", NULL};
	if (fresh)
		th_daemon_start(&D[i], "-o", optv[i][0], "-o", optv[i][1], "-o",
				optv[i][2], "-o", optv[i][3], "-o", optv[i][4],
				"-o", optv[i][5], "-o", "peer_connect=all",
				NULL);
	else
		th_daemon_start_in(&D[i], args);
}

json_t *cluster_of(int i)
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
void wait_row(int i, const char *want)
{
	for (int t = 0; t < 500 * (int)th_scale(); t++) {
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

void wait_all_up(void)
{
	wait_row(0, "SUU");
	wait_row(1, "USU");
	wait_row(2, "UUS");
}

/* Shared state of one scenario: a group of nodes x rpn ranks. */
struct late *late_new(int nodes, int rpn, const char *fmt, ...)
{
	struct late *s = th_shared(sizeof(*s));
	s->nodes = nodes;
	s->rpn = rpn;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(s->name, sizeof(s->name), fmt, ap);
	va_end(ap);
	return s;
}

ep_group_t *join(struct late *s, int rank, ep_conn_t **c,
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

int late_rank(int rank, void *arg)
{
	struct late *s = arg;
	int world = s->nodes * s->rpn;
	ep_conn_t *c;
	ep_group_t *g = join(s, rank, &c, 20000);
	th_late_rounds(g, rank, world, DELAY_MS, s->enter, s->leave);
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}
