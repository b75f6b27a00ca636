/* SPDX-License-Identifier: MIT */
/*
 * test_cluster's shared parts: the cluster of three daemons this program
 * starts (main.c), and the helpers its scenarios share (common.c). The
 * scenarios, by topic: membership.c (silent nodes, wrong keys, rejoins,
 * RDMA device removal), ops.c (barriers with a late rank, dispatch and
 * combine across nodes, mismatches, restarts, stalls), failures.c (nodes
 * and ranks lost), peers.c (raw, fake and hostile peers).
 */
#ifndef TEST_CLUSTER_H
#define TEST_CLUSTER_H

#include "harness.h"

#include <sys/stat.h>
#include "epp.h"
#include "epp_peer.h"
#include "ref.h"
#include "cluster/peerauth.h"

#include <jansson.h>
#include <poll.h>
#include <sodium.h>
#include <signal.h>
#include <stdarg.h>
#include <string.h>
#include <errno.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#define NODES 3
#define DELAY_MS 40
#define MAXW TH_MAXW

/* Beats of 100 ms; a node is down after MISS silent ones. 10 leaves room
 * for a loaded 2-core machine (tests run in parallel); sanitizer builds,
 * several times slower, set EPD_TEST_SLOW and get 20, times
 * EPD_TEST_ALARM_SCALE on an emulated CPU. */
#define BEAT_MS 100

struct late {
	int nodes, rpn;
	char name[32];
	uint64_t enter[MAXW][MAXW], leave[MAXW][MAXW];
	volatile int entered;
	int codes[MAXW];
	char msgs[MAXW][256];
	uint64_t took_ms[MAXW];
};

extern struct th_daemon D[NODES];
extern char peers[256], keyfile[160], badkey[160];
extern char optv[NODES][7][300];
extern int base_port;
extern int miss; /* the silent beats after which a node is down */
/* The transport under test (EPD_TEST_TRANSPORT: tcp by default, rdma in
 * tests/rdma-vm) and the host every node listens on (EPD_TEST_PEER_HOST:
 * loopback by default; an address of an rxe device's interface for
 * rdma). Raw-TCP fake peers are tcp-only. */
extern const char *transport;
extern bool rdma, two_devices;
extern uint8_t fake_ktx[32];
extern uint64_t fake_ntx;
extern const struct ep_group_config pc_cfg;

void start_node(int i, const char *key, bool fresh);
json_t *cluster_of(int i);
void wait_row(int i, const char *want);
void wait_all_up(void);
struct late *late_new(int nodes, int rpn, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
ep_group_t *join(struct late *s, int rank, ep_conn_t **c,
	uint32_t timeout_ms);
int late_rank(int rank, void *arg);
void check_late(int nodes, int rpn);
int xrank(int r, void *arg);
void check_xdispatch(int nodes, int rpn, struct ref_case c, int bad);
int shape_rank(int rank, void *arg);
struct late *every_rank_gets(const char *name, th_child_fn fn,
	unsigned wait_s, int want,
	const char *frag);
void check_shape_mismatch(void);
ep_group_t *join_2x2(struct late *s, int rank, ep_conn_t **c,
	struct ep_buffers *b);
void to_every_rank(struct ep_buffers *b, uint32_t T, uint32_t K);
int rank_done(struct late *s, int rank, int rc, ep_group_t *g,
	ep_conn_t *c);
int wmis_rank(int rank, void *arg);
void check_mismatch(const char *name, th_child_fn fn, const char *frag,
	const char *what);
void check_weights_mismatch(void);
int hmis_rank(int rank, void *arg);
void check_handle_mismatch(void);
int second_op_rank(int rank, void *arg);
void check_kind_mismatch(void);
void check_op_mismatch(void);
int restart_rank(int who, void *arg);
int restart_new(int i, void *arg);
bool restart_once(void);
void check_restart(void);
int xbig_rank(int rank, void *arg);
void check_xtoobig(void);
void check_bad_joins(void);
int xstall_rank(int rank, void *arg);
void check_remote_stall(void);
int xstall1_rank(int rank, void *arg);
void check_remote_stall_one(void);
int loss_rank(struct late *s, int rank, bool victim,
	uint64_t limit_ns);
int lost_rank(int rank, void *arg);
void check_node_loss(void);
int xlost_rank(int rank, void *arg);
void check_node_loss_streaming(void);
int rank_loss_rank(int rank, void *arg);
void check_remote_rank_loss(void);
int early_loss_rank(int rank, void *arg);
void check_early_remote_loss(void);
void check_silent_node(void);
void check_wrong_key(void);
int removal_rank(int rank, void *arg);
void check_device_removal(const char *dev);
void check_rejoins(void);
int raw_peer_of(int node);
int raw_peer(void);
void expect_dropped(int fd);
void flood(int node, unsigned ms);
int accept_queue(int node);
void check_peer_flood(void);
void check_bad_peers(void);
void send_hello_as(int fd, const char *name, uint32_t idx,
	const uint8_t nonce[32]);
uint8_t *recv_type(int fd, uint16_t type, uint32_t *len);
int n1_ups_on_n2(void);
void check_resets(void);
void check_relay(void);
int fake_n2_for(int from, uint8_t ktx[32]);
int fake_n2(void);
void send_peer_k(int fd, const uint8_t ktx[32], uint64_t *ntx,
	uint16_t type, const void *p, size_t n);
void send_peer(int fd, uint16_t type, const void *p, size_t n);
int pc_bystander(int rank, void *arg);
int pc_rank(int rank, void *arg);
int pd_rank(int rank, void *arg);
void pc_drain(int fd);
size_t shape_frame(uint8_t *b, size_t cap, const char *key,
	const struct ep_group_config *c);
uint16_t pc_frame(const char *gk, unsigned *seed, uint8_t *b,
	size_t cap, size_t *len);
void check_peer_chaos(void);
void check_bad_member(void);
int xwin_rank(int rank, void *arg);
void check_bad_windows(void);

#endif
