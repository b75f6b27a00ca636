/* SPDX-License-Identifier: MIT */
/*
 * The smallest libep program, built by tests/install/check against an
 * installed tree with nothing but pkg-config:
 *
 *   cc example.c $(pkg-config --cflags --libs libep) -o example
 *
 * One rank: connect (argv[1], else $EPD_SOCKET or the default socket),
 * join a one-rank group, run a barrier, leave. Prints "example: ok".
 */
#include <ep/ep.h>

#include <stdio.h>

int main(int argc, char **argv)
{
	ep_conn_t *c;
	int rc = ep_connect(argc > 1 ? argv[1] : NULL, &c);
	if (rc) {
		fprintf(stderr, "connect: %s: %s\n", ep_strerror(rc), ep_errmsg());
		return 1;
	}
	struct ep_group_config cfg = {.name = "example", .world_size = 1,
				      .ranks_per_node = 1, .rank = 0,
				      .num_experts = 4, .hidden = 128,
				      .max_tokens_per_rank = 8, .topk = 2,
				      .dtype = EP_DTYPE_BF16};
	ep_group_t *g;
	if ((rc = ep_join(c, &cfg, 0, &g)) || (rc = ep_barrier(g)) ||
	    (rc = ep_leave(g))) {
		fprintf(stderr, "example: %s: %s\n", ep_strerror(rc), ep_errmsg());
		ep_close(c);
		return 1;
	}
	ep_close(c);
	printf("example: ok\n");
	return 0;
}
