/* SPDX-License-Identifier: MIT */
/*
 * Jobs of one uid (root, as in containers) kept apart by their secrets.
 * Job A joins its group with its secret, its rank 1 not there yet. Job B,
 * also root, tries what a second job could:
 *  - join A's missing rank 1 under A's name (no secret, then its own);
 *  - squat A's name with another shape;
 *  - join A's low-latency helper group by its predictable name;
 *  - read A's group in the status.
 * Each lands in a group of its own (or sees no details); A's real rank 1
 * then joins, A's ops run and give A's rows, and its status shows A's
 * details to A's members only. A rank of A with a mistyped secret waits in
 * another group and its join times out saying so.
 */
#include "harness.h"

#include <string.h>
#include <unistd.h>

#define H 128
#define K 2

static const char SA[] = "job-A-secret-0123456789";
static const char SB[] = "job-B-secret-9876543210";
static const char SB2[] = "job-B-secret-other";

static struct ep_group_config cfg_of(const char *name, uint32_t rank,
				     uint32_t hidden)
{
	struct ep_group_config c = {
		.name = name, .world_size = 2, .ranks_per_node = 2,
		.rank = rank, .num_experts = 4, .hidden = hidden,
		.max_tokens_per_rank = 8, .topk = K, .dtype = EP_DTYPE_BF16,
		.timeout_ms = 3000};
	return c;
}

static int join_secret(ep_conn_t *c, const struct ep_group_config *cfg,
		       const char *secret, unsigned flags, ep_group_t **g)
{
	const struct ep_join_opts o = {.size = sizeof(o), .secret = secret,
				       .secret_len = secret ? strlen(secret)
							    : 0};
	return ep_join_ex(c, cfg, &o, flags, g);
}

static char *status_of(ep_conn_t *c)
{
	char *js;
	TH_OK(ep_daemon_status(c, &js));
	return js;
}

/* A's rank r: a dispatch of 4 tokens to expert r + 2k, and its rows. */
static uint32_t dispatch_rows(ep_group_t *g, uint32_t r, uint16_t *rows)
{
	uint16_t x[4 * H];
	int64_t idx[4 * K];
	for (uint32_t i = 0; i < 4 * H; i++)
		x[i] = (uint16_t)(0x3c00 + r * 64 + i % 64);
	for (uint32_t i = 0; i < 4 * K; i++)
		idx[i] = (int64_t)((r + i) % 4);
	struct ep_dispatch_in in = {.num_tokens = 4, .hidden = H,
				    .dtype = EP_DTYPE_BF16, .topk = K, .x = x,
				    .topk_idx = idx};
	struct ep_dispatch_out out = {.capacity = 16, .recv_x = rows};
	ep_handle_t h;
	TH_OK(ep_dispatch(g, &in, NULL, &out, &h));
	return out.num_recv;
}

struct shared {
	uint16_t rows[2][16 * H];
	uint32_t n[2];
};

int main(void)
{
	th_init("jobs: root jobs kept apart by their secrets", 120);
	struct th_daemon d;
	th_daemon_start(&d, NULL);
	struct shared *s = th_shared(sizeof(*s));

	/* job A: rank 0 joined, rank 1 not yet */
	ep_conn_t *a0;
	ep_group_t *ga0;
	struct ep_group_config ca = cfg_of("moe", 0, H);
	TH_OK(ep_connect(d.sock, &a0));
	TH_OK(join_secret(a0, &ca, SA, EP_JOIN_NOWAIT, &ga0));

	/* job B, root as well */
	ep_conn_t *b;
	ep_group_t *gb;
	TH_OK(ep_connect(d.sock, &b));
	/* 1. A's missing rank, without a secret and with B's: other groups,
	 * which never hear of A's (their own rank 0 is missing) */
	struct ep_group_config cb = cfg_of("moe", 1, H);
	TH_OK(ep_join(b, &cb, EP_JOIN_NOWAIT, &gb));
	TH_EXPECT_RC(ep_barrier(gb), EP_ENOTREADY);
	ep_group_t *gb2;
	TH_OK(join_secret(b, &cb, SB, EP_JOIN_NOWAIT, &gb2));
	TH_EXPECT_RC(ep_barrier(gb2), EP_ENOTREADY);
	/* 2. squat A's name with another shape: no mismatch for anyone */
	ep_group_t *gb3;
	struct ep_group_config cq = cfg_of("moe", 0, 2 * H);
	TH_OK(join_secret(b, &cq, SB2, EP_JOIN_NOWAIT, &gb3));
	TH_EXPECT_RC(ep_barrier(gb3), EP_ENOTREADY);
	/* 3. A's low-latency helper group by its name, without A's secret */
	char ll[80];
	snprintf(ll, sizeof(ll), "moe:ll-0123");
	ep_group_t *gb4;
	struct ep_group_config cl = cfg_of(ll, 1, H);
	TH_OK(ep_join(b, &cl, EP_JOIN_NOWAIT, &gb4));
	/* 4. the status B sees: A's group by name and state, no details */
	char *js = status_of(b);
	const char *pa = strstr(js, "\"private\":true");
	TH_CHECK(pa, "A's group is not in B's status as private: %s", js);
	TH_CHECK(!strstr(pa + 1, "\"private\":true") &&
			 !strstr(js, "\"id\":1,") &&
			 !strstr(js, "\"group_id\":1,"),
		 "B sees A's group's details or members: %s", js);
	free(js);
	printf("ok: job B (root) joined A's missing rank, squatted A's name "
	       "with another shape and joined a helper name: each in a "
	       "group of its own; B's status shows A's group as private\n");

	/* A's real rank 1 joins (another process): A forms, its ops run */
	pid_t pid = fork();
	if (pid == 0) {
		ep_group_t *g;
		ep_conn_t *c;
		struct ep_group_config ca1 = cfg_of("moe", 1, H);
		TH_OK(ep_connect(d.sock, &c));
		TH_OK(join_secret(c, &ca1, SA, 0, &g));
		TH_OK(ep_barrier(g));
		s->n[1] = dispatch_rows(g, 1, s->rows[1]);
		/* A's members see A's details */
		char *mj = status_of(c);
		TH_CHECK(strstr(mj, "\"joined\":[0,1]"), "A's member: %s", mj);
		free(mj);
		TH_OK(ep_barrier(g));
		TH_OK(ep_leave(g));
		ep_close(c);
		_exit(0);
	}
	int rc;
	const uint64_t t0 = th_now_ns();
	while ((rc = ep_barrier(ga0)) == EP_ENOTREADY &&
	       th_now_ns() - t0 < 10000000000ull)
		th_sleep_ms(5);
	TH_OK(rc);
	s->n[0] = dispatch_rows(ga0, 0, s->rows[0]);
	TH_OK(ep_barrier(ga0));
	TH_CHECK(th_wait_all(&pid, 1, 30) == 0, "A's rank 1");
	/* rank 0's tokens go to one rank each (2 to each), rank 1's to
	 * both: 6 rows each, as A alone would get */
	TH_CHECK(s->n[0] == 6 && s->n[1] == 6, "A's ranks received %u and %u "
					       "rows", s->n[0], s->n[1]);
	TH_OK(ep_leave(ga0));
	ep_close(a0);
	printf("ok: A's real rank 1 joined A's group, A's dispatch and "
	       "barrier ran (%u and %u rows); A's members see its ranks\n",
	       s->n[0], s->n[1]);

	/* a rank of a job with a mistyped secret waits in another group:
	 * its join times out, saying secrets may differ */
	ep_conn_t *m;
	ep_group_t *gm;
	TH_OK(ep_connect(d.sock, &m));
	struct ep_group_config cm = cfg_of("moe2", 0, H);
	cm.timeout_ms = 300;
	TH_EXPECT_RC(join_secret(m, &cm, "mistyped", 0, &gm), EP_ETIMEDOUT);
	TH_CHECK(strstr(ep_errmsg(), "secret"), "%s", ep_errmsg());
	ep_close(m);
	printf("ok: a rank with another secret waits in another group; its "
	       "join timeout says so: %s\n",
	       ep_errmsg());
	ep_close(b);
	th_daemon_stop(&d);
	printf("ok\n");
	return 0;
}
