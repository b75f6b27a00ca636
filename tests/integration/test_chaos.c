/* SPDX-License-Identifier: MIT */
/*
 * Chaos clients: processes that speak the protocol on raw sockets with
 * hostile values, in random order, for a while. Each one opens
 * connections, joins groups of a few fixed names (so that chaos clients
 * meet in groups and their operations really run), maps the group buffer
 * and scribbles over it (inputs, indices, the control page, other ranks'
 * regions) while operations read it, and sends barriers, dispatches,
 * cached dispatches, combines, releases, LL maps, memory registrations
 * with stray descriptors, deregistrations and leaves with fields that are
 * right, nearly right or random; some frames are mutated (bits flipped,
 * cut short, a length or a descriptor count that lies), group ids are
 * guessed, and connections are dropped at random moments. With root the
 * chaos runs under another uid (another user of the node).
 *
 * The operator reloads the configuration (SIGHUP) every second of it,
 * and at the end stops the daemon (SIGTERM) in the middle of more chaos.
 * Then the same on two daemons in a cluster: the chaos clients connect to
 * either, their groups span both nodes (a rank of the connection's node
 * mostly), the bystander has a rank on each, and the daemons are stopped
 * one after the other under chaos.
 *
 * Asserts: no daemon dies or stops answering; a bystander job of two
 * ranks runs barriers, dispatches and combines throughout and every
 * result is bitwise equal to the independent reference (tests/lib/ref.c),
 * with no error; every reply to a chaos client is a well-formed frame for
 * its request, and none says a daemon found its peer's frames wrong
 * (whatever ranks do, honest daemons agree); afterwards every daemon's
 * descriptors and shared mappings are back to what they were, and stopped
 * under chaos each exits cleanly (so that a sanitizer's report fails the
 * test).
 *
 * EPD_CHAOS_SECONDS sets the length (default 15 s); EPD_TEST_SEED repeats
 * a run.
 */
#include "harness.h"
#include "epp.h"
#include "ref.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define NCHAOS 4
#define CHAOS_UID 4242
#define NNAMES 4   /* chaos group names */
#define MAXG 4     /* groups a chaos connection keeps */
#define MAXH 8     /* handles a chaos group keeps */
#define MAXPEND 16 /* joins awaiting their reply */

struct shared {
	/* the daemons chaos clients connect to: one, or the two nodes of a
	 * cluster (groups then span both) */
	const struct th_daemon *node[2];
	int nodes;
	const struct th_daemon *by_d[2]; /* each bystander rank's daemon */
	uint32_t by_rpn;
	volatile int stop, by_stop;
	volatile int stopping; /* the daemon is being stopped under chaos */
	volatile uint64_t by_rounds;
	volatile uint64_t replies[NCHAOS], frames[NCHAOS], ops_ok[NCHAOS];
	volatile uint64_t ok_of[NCHAOS][16]; /* OK replies by request type */
};
static struct shared *S;
static uint64_t Seed;

/* This chaos client's connection now: hostile (mutated frames, random
 * flags and fields, garbage) or mostly right (valid frames with values
 * near the group's, so that operations run on scribbled buffers). */
static bool Hostile;

static uint64_t rnd(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}
#define ONE_IN(s, n) (rnd(s) % (n) == 0)

/* ---------- the bystander: a real job that must never notice ---------- */

static const struct ref_case By = {
	.seed = 0, .world = 2, .experts = 8, .hidden = 256, .topk = 3,
	.max_tokens = 12, .tokens = {12, 7}, .dtype = EP_DTYPE_BF16,
	.mode = REF_RANDOM, .weights = true, .bias = true};

static int bystander(int r, void *arg)
{
	(void)arg;
	struct ref_case c = By;
	c.seed = Seed;
	const uint32_t W = c.world, H = c.hidden, K = c.topk;
	struct ref_inputs in[2], in2[2];
	struct ref_recv exp[2], exp2[2];
	ref_gen_world(&c, in, in2, exp, exp2);
	uint16_t *ys[2];
	for (uint32_t d = 0; d < W; d++)
		ys[d] = ref_gen_y(&c, d, exp[d].R, 5);
	const struct ref_inputs *me = &in[r];
	uint16_t *want = malloc((size_t)me->T * H * 2 + 2);
	ref_combine(&c, in, exp, ys, (uint32_t)r, want);

	struct ep_group_config cfg = {
		.name = "bystander", .world_size = W,
		.ranks_per_node = S->by_rpn, .rank = (uint32_t)r,
		.num_experts = c.experts, .hidden = H,
		.max_tokens_per_rank = c.max_tokens, .topk = K,
		.dtype = EP_DTYPE_BF16, .timeout_ms = 60000};
	ep_conn_t *conn;
	ep_group_t *g = th_join(S->by_d[r], &cfg, &conn);
	const uint64_t cap = (uint64_t)W * c.max_tokens;
	uint8_t *rx = malloc(cap * H * 2);
	int64_t *ri = malloc(cap * K * 8);
	float *rw = malloc(cap * K * 4);
	uint16_t *out = malloc((size_t)me->T * H * 2 + 2);
	const uint64_t R = exp[r].R;
	for (;;) {
		TH_OK(ep_barrier(g));
		struct ep_dispatch_in din = {
			.num_tokens = me->T, .hidden = H,
			.dtype = EP_DTYPE_BF16, .topk = K, .x = me->x,
			.topk_idx = me->topk, .topk_weights = me->weights};
		struct ep_dispatch_out dout = {.capacity = cap, .recv_x = rx,
					       .recv_topk_idx = ri,
					       .recv_topk_weights = rw};
		memset(rx, 0xa5, cap * H * 2);
		ep_handle_t h;
		TH_OK(ep_dispatch(g, &din, NULL, &dout, &h));
		TH_CHECK(dout.num_recv == R, "bystander rank %d got %u rows, "
			 "want %lu", r, dout.num_recv, (unsigned long)R);
		TH_CHECK(th_first_diff(rx, exp[r].x, R * H * 2) == R * H * 2,
			 "bystander rank %d: recv_x differs", r);
		TH_CHECK(th_first_diff(ri, exp[r].topk, R * K * 8) == R * K * 8,
			 "bystander rank %d: recv_topk_idx differs", r);
		TH_CHECK(th_first_diff(rw, exp[r].weights, R * K * 4) ==
				 R * K * 4,
			 "bystander rank %d: recv_topk_weights differs", r);
		memset(out, 0xa5, (size_t)me->T * H * 2);
		TH_OK(ep_combine(g, &h, ys[r], (uint32_t)R, H, me->bias, out));
		TH_CHECK(th_first_diff(out, want, (size_t)me->T * H * 2) ==
				 (size_t)me->T * H * 2,
			 "bystander rank %d: combined differs", r);
		TH_OK(ep_handle_release(g, &h));
		if (r == 0) {
			S->by_rounds++;
			if (S->by_stop)
				S->by_stop = 2;
		}
		TH_OK(ep_barrier(g));
		if (S->by_stop == 2)
			break;
	}
	TH_OK(ep_leave(g));
	ep_close(conn);
	return 0;
}

/* ---------- chaos clients ---------- */

struct cgroup {
	bool live;
	uint64_t gid;
	uint8_t *map;
	size_t size;
	uint32_t local;
	struct epp_join j;
	struct epp_buf b;
	bool have_b;
	struct epp_handle h[MAXH];
	uint32_t nrecv[MAXH]; /* the rows its dispatch received */
	int nh;
};

struct pend {
	uint64_t req;
	struct epp_join j;
};

struct cconn {
	int fd;
	uint64_t req;
	struct cgroup g[MAXG];
	struct pend pend[MAXPEND];
	uint16_t type[256]; /* of request req, at req % 256 */
	uint64_t *rs;
	int me;
	int node; /* of the daemon it is connected to */
	bool dead; /* the daemon closed it (after a fatal frame) */
};

/* The shape of chaos group name i. On one node: worlds 1 (every op
 * runs), 2 and 3. On two: worlds 2 and 4 across both nodes, a rank of the
 * connection's node mostly (one of the other node's sometimes). */
static void shape_of(int i, const struct cconn *c, struct epp_join *j)
{
	static const uint32_t world[NNAMES] = {1, 2, 2, 3};
	static const uint32_t xworld[NNAMES] = {2, 4, 2, 4};
	uint64_t *rs = c->rs;
	memset(j, 0, sizeof(*j));
	if (S->nodes > 1) {
		snprintf(j->name, sizeof(j->name), "xchaos%d", i);
		j->world_size = xworld[i];
		j->ranks_per_node = xworld[i] / 2;
		uint32_t node = ONE_IN(rs, 8) ? 1 - (uint32_t)c->node
					      : (uint32_t)c->node;
		j->rank = node * j->ranks_per_node +
			  (uint32_t)(rnd(rs) % j->ranks_per_node);
	} else {
		snprintf(j->name, sizeof(j->name), "chaos%d", i);
		j->world_size = world[i];
		j->ranks_per_node = world[i];
		j->rank = (uint32_t)(rnd(rs) % world[i]);
	}
	j->num_experts = 4 * j->world_size;
	j->hidden = 256;
	j->max_tokens = 8;
	j->topk = 2;
	j->dtype = i == 2 ? EP_DTYPE_FP8 : EP_DTYPE_BF16;
	j->timeout_ms = 300;
	j->recv_areas = 1 + (i == 1);
}

static uint64_t pick_gid(struct cconn *c)
{
	uint64_t *rs = c->rs;
	int k = (int)(rnd(rs) % MAXG);
	for (int i = 0; i < MAXG && !c->g[k].live; i++)
		k = (k + 1) % MAXG;
	if (c->g[k].live && !ONE_IN(rs, 10))
		return c->g[k].gid;
	if (ONE_IN(rs, 3))
		return rnd(rs);
	return 1 + rnd(rs) % 40; /* guessed: ids are small numbers */
}

static struct cgroup *pick_group(struct cconn *c)
{
	int k = (int)(rnd(c->rs) % MAXG);
	return c->g[k].live ? &c->g[k] : NULL;
}

static void drop_group(struct cgroup *g)
{
	if (g->map)
		munmap(g->map, g->size);
	memset(g, 0, sizeof(*g));
}

static void conn_close(struct cconn *c)
{
	if (c->fd >= 0)
		close(c->fd);
	c->fd = -1;
	for (int k = 0; k < MAXG; k++)
		drop_group(&c->g[k]);
	memset(c->pend, 0, sizeof(c->pend));
}

/* The daemon's messages for a peer daemon's frame that breaks the
 * protocol (EP_EPROTO). */
static const char *const Peer_blame[] = {
	"sent a malformed", "sent a routing", "sent unexpected rows",
	"sent more rows",
	"sent more early combine rows", "sent a row out of range",
	"rows from other nodes", "sent malformed windows",
	"sent its windows twice", "offered a window of",
	"signalled written rows"};

/* Every reply must be well-formed: OK, ERROR or NOTICE, an error's code
 * one of the library's, with a message. (Its request id may be any: a
 * mutated frame's id is echoed.) */
static void on_reply(struct cconn *c, const struct epp_hdr *h,
		     const uint8_t *p, int *fds)
{
	S->replies[c->me]++;
	TH_CHECK(h->type == EPP_OK || h->type == EPP_ERROR ||
			 h->type == EPP_NOTICE,
		 "chaos %d: reply of type %u", c->me, h->type);
	if (h->type != EPP_OK) {
		int code;
		char msg[EPP_ERRMSG_MAX];
		TH_OK(epp_error_decode(p, h->length, &code, msg, sizeof(msg)));
		TH_CHECK(code < 0 && strcmp(ep_strerror(code), "unknown error"),
			 "chaos %d: error code %d (%s)", c->me, code, msg);
		TH_CHECK(msg[0], "chaos %d: error %d without a message", c->me,
			 code);
		/* Whatever ranks do, one daemon never finds another's frames
		 * wrong: the daemons are honest, so that would be two
		 * daemons that disagree on a group's state. */
		for (size_t i = 0; i < sizeof(Peer_blame) / sizeof(*Peer_blame);
		     i++)
			TH_CHECK(!strstr(msg, Peer_blame[i]),
				 "chaos %d: the daemons disagree: %s (%s)",
				 c->me, ep_strerror(code), msg);
		if (getenv("EPD_CHAOS_TRACE"))
			fprintf(stderr, "TRACE %s %d %s\n",
				epp_type_name(c->type[h->req_id % 256]), code,
				msg);
		for (unsigned i = 0; i < h->nfds; i++)
			close(fds[i]);
		return;
	}
	S->ops_ok[c->me]++;
	S->ok_of[c->me][c->type[h->req_id % 256] % 16]++;
	struct pend *pj = NULL;
	for (int i = 0; i < MAXPEND; i++)
		if (c->pend[i].req && c->pend[i].req == h->req_id)
			pj = &c->pend[i];
	struct epp_join_ok ok;
	if (pj && h->nfds >= 1 && !epp_join_ok_decode(p, h->length, &ok)) {
		struct cgroup *g = NULL;
		for (int k = 0; k < MAXG && !g; k++)
			if (!c->g[k].live)
				g = &c->g[k];
		if (g && ok.buf_size && ok.buf_size < (1u << 30)) {
			void *m = mmap(NULL, ok.buf_size, PROT_READ |
					PROT_WRITE, MAP_SHARED, fds[0], 0);
			if (m != MAP_FAILED) {
				memset(g, 0, sizeof(*g));
				g->live = true;
				g->gid = ok.group_id;
				g->map = m;
				g->size = ok.buf_size;
				g->j = pj->j;
				g->local = pj->j.rank % (pj->j.ranks_per_node
							 ? pj->j.ranks_per_node
							 : 1);
				g->have_b = !epp_buf_layout(&pj->j, &g->b);
			}
		}
		pj->req = 0;
	} else if (c->type[h->req_id % 256] == EPP_DISPATCH) {
		/* a dispatch's handle: keep it for combines */
		struct epp_dispatch_ok d;
		if (!epp_dispatch_ok_decode(p, h->length, &d)) {
			for (int k = 0; k < MAXG; k++) {
				struct cgroup *g = &c->g[k];
				if (g->live && g->gid == d.handle.group_id) {
					g->h[g->nh % MAXH] = d.handle;
					g->nrecv[g->nh % MAXH] = d.num_recv;
					g->nh++;
				}
			}
		}
	}
	for (unsigned i = 0; i < h->nfds; i++)
		close(fds[i]);
}

/* Read what has come, waiting up to ms for the first frame. */
static void drain(struct cconn *c, int ms)
{
	while (c->fd >= 0 && !c->dead) {
		struct pollfd pf = {.fd = c->fd, .events = POLLIN};
		int n = poll(&pf, 1, ms);
		if (n <= 0)
			return;
		ms = 0;
		struct epp_hdr h;
		uint8_t *p;
		int fds[EPP_MAX_FDS];
		char err[256];
		int rc = epp_recv_frame(c->fd, &h, &p, fds, 5000, err,
					sizeof(err));
		if (rc == EP_ECONNRESET || rc == EP_ESHUTDOWN ||
		    rc == EP_EPEERLOST || (rc && S->stopping)) {
			c->dead = true; /* (a stopping daemon may cut a frame) */
			return;
		}
		TH_CHECK(rc == 0, "chaos %d: a reply that is not a frame: %s "
			 "(%s)", c->me, ep_strerror(rc), err);
		on_reply(c, &h, p, fds);
		free(p);
	}
}

/* Send a frame, perhaps mutated: bits flipped, cut short, a length or
 * descriptor count that lies. A write the daemon refused (it closed the
 * connection) marks it dead. */
static void send_frame(struct cconn *c, uint16_t type, uint16_t flags,
		       const uint8_t *pl, uint32_t len, const int *fds,
		       unsigned nfds)
{
	uint64_t *rs = c->rs;
	uint8_t b[EPP_HDR_SIZE + 2048];
	struct epp_hdr h;
	if (c->fd < 0 || c->dead || len > sizeof(b) - EPP_HDR_SIZE)
		return;
	epp_hdr_init(&h, type, ++c->req);
	c->type[c->req % 256] = type;
	h.flags = flags;
	h.length = len;
	h.nfds = (uint16_t)nfds;
	size_t n = EPP_HDR_SIZE + len;
	int m = Hostile ? (int)(rnd(rs) % 24) : 1000; /* below 6: mutated */
	if (m == 0)
		h.length = (uint32_t)rnd(rs) % (len + 64);
	else if (m == 1)
		h.nfds = (uint16_t)(rnd(rs) % 4);
	else if (m == 2)
		h.ver_minor = (uint8_t)rnd(rs);
	epp_hdr_encode(&h, b);
	if (len)
		memcpy(b + EPP_HDR_SIZE, pl, len);
	if (m == 3 || m == 4) {
		int flips = 1 + (int)(rnd(rs) % 6);
		for (int f = 0; f < flips; f++)
			b[rnd(rs) % n] ^= (uint8_t)(1u << (rnd(rs) % 8));
	} else if (m == 5) {
		n = rnd(rs) % n; /* cut short: the rest never comes */
	}
	S->frames[c->me]++;
	size_t off = 0;
	while (off < n) {
		/* descriptors ride on the first byte, as libep sends them */
		long k = epp_sendmsg(c->fd, b + off, n - off, off ? NULL : fds,
				     off ? 0 : nfds);
		if (k <= 0) {
			c->dead = true;
			return;
		}
		off += (size_t)k;
	}
	if (m == 5 && ONE_IN(rs, 2))
		conn_close(c); /* and gone */
}

static void send_gid(struct cconn *c, uint16_t type, uint16_t flags)
{
	uint8_t p[8];
	struct epp_wr w;
	epp_wr_init(&w, p, sizeof(p));
	epp_put_u64(&w, pick_gid(c));
	send_frame(c, type, flags, p, (uint32_t)w.off, NULL, 0);
}

static uint16_t op_flags(uint64_t *rs)
{
	switch (rnd(rs) % (Hostile ? 8 : 60)) {
	case 0:
		return EPP_F_ASYNC;
	case 1:
		return (uint16_t)rnd(rs);
	default:
		return 0;
	}
}

/* A handle of the group (and the rows its dispatch received, in *rows),
 * or a made-up one. */
static struct epp_handle pick_handle(struct cconn *c, uint64_t gid,
				     uint32_t *rows)
{
	uint64_t *rs = c->rs;
	*rows = (uint32_t)(rnd(rs) % 20);
	for (int k = 0; k < MAXG; k++) {
		struct cgroup *g = &c->g[k];
		if (g->live && g->gid == gid && g->nh && !ONE_IN(rs, 4)) {
			int n = g->nh < MAXH ? g->nh : MAXH;
			int i = (int)(rnd(rs) % (uint64_t)n);
			struct epp_handle h = g->h[i];
			*rows = g->nrecv[i];
			if (ONE_IN(rs, 6))
				h.seq += rnd(rs) % 3;
			return h;
		}
	}
	return (struct epp_handle){.group_id = gid,
				   .epoch = (uint32_t)(rnd(rs) % 3),
				   .seq = rnd(rs) % 6};
}

static const struct cgroup *group_of(struct cconn *c, uint64_t gid)
{
	for (int k = 0; k < MAXG; k++)
		if (c->g[k].live && c->g[k].gid == gid)
			return &c->g[k];
	return NULL;
}

static uint32_t near(uint64_t *rs, uint32_t v)
{
	switch (rnd(rs) % (Hostile ? 10 : 60)) {
	case 0:
		return (uint32_t)rnd(rs);
	case 1:
		return v + 1;
	case 2:
		return v ? v - 1 : 0;
	default:
		return v;
	}
}

static void do_join(struct cconn *c)
{
	uint64_t *rs = c->rs;
	struct epp_join j;
	int name = (int)(rnd(rs) % (NNAMES + 1));
	if (name == NNAMES) {
		/* the bystander's name: same uid, a taken rank */
		shape_of(1, c, &j);
		snprintf(j.name, sizeof(j.name), "bystander");
		j.world_size = By.world;
		j.ranks_per_node = S->by_rpn;
		j.rank = S->nodes > 1 ? (uint32_t)c->node
				      : (uint32_t)(rnd(rs) % By.world);
		j.num_experts = By.experts;
		j.max_tokens = By.max_tokens;
		j.topk = By.topk;
		j.recv_areas = 1;
	} else {
		shape_of(name, c, &j);
	}
	if (ONE_IN(rs, Hostile ? 3 : 30)) {
		switch (rnd(rs) % 7) {
		case 0: j.world_size = near(rs, j.world_size); break;
		case 1: j.rank = near(rs, j.rank); break;
		case 2: j.hidden = near(rs, j.hidden); break;
		case 3: j.max_tokens = near(rs, j.max_tokens); break;
		case 4: j.topk = near(rs, j.topk); break;
		case 5: j.recv_areas = near(rs, j.recv_areas); break;
		default: j.gpu_uuid[rnd(rs) % 16] = (uint8_t)rnd(rs); break;
		}
	}
	uint8_t p[512];
	uint32_t len = (uint32_t)epp_join_encode(&j, p, sizeof(p));
	uint16_t flags = ONE_IN(rs, 3) ? 0 : EPP_F_JOIN_NOWAIT;
	/* linked (1.16) to a group of this connection's, mostly: chains,
	 * cycles, links to itself or to guessed ids included */
	if (ONE_IN(rs, 4)) {
		j.link = pick_gid(c);
		flags |= EPP_F_JOIN_LINK;
	}
	if (ONE_IN(rs, 20))
		flags = (uint16_t)rnd(rs);
	for (int i = 0; i < MAXPEND; i++)
		if (!c->pend[i].req) {
			c->pend[i].req = c->req + 1;
			c->pend[i].j = j;
			break;
		}
	send_frame(c, EPP_JOIN, flags, p, len, NULL, 0);
}

/* Scribble over a mapped group buffer: the rank's own inputs mostly
 * (indices near and far out of range, any float bits), else anywhere. */
static void scribble(struct cconn *c)
{
	uint64_t *rs = c->rs;
	struct cgroup *g = pick_group(c);
	if (!g)
		return;
	if (g->have_b && !ONE_IN(rs, 4)) {
		const struct epp_buf *b = &g->b;
		uint32_t T = b->max_tokens, K = g->j.topk, E = g->j.num_experts;
		int64_t *ti = (int64_t *)(g->map +
			epp_buf_field(b, g->local, EPP_BUF_TOPK_IDX));
		float *tw = (float *)(g->map +
			epp_buf_field(b, g->local, EPP_BUF_TOPK_WEIGHTS));
		uint8_t *x = g->map + epp_buf_field(b, g->local, EPP_BUF_X);
		bool bad = Hostile || ONE_IN(rs, 4);
		for (uint32_t i = 0; i < T * K; i++) {
			int64_t v = (int64_t)(rnd(rs) % (E + 1)) - 1;
			if (bad && ONE_IN(rs, 16))
				v = (int64_t)rnd(rs);
			else if (bad && ONE_IN(rs, 16))
				v = E + (int64_t)(rnd(rs) % 3);
			ti[i] = v;
			uint32_t bits = (uint32_t)rnd(rs);
			memcpy(&tw[i], &bits, 4);
		}
		for (uint32_t i = 0; i < T * g->j.hidden * b->elt; i += 8) {
			uint64_t v = rnd(rs);
			memcpy(x + i, &v, 8);
		}
		return;
	}
	/* anywhere: the control page, other ranks' regions, the tail */
	size_t at = rnd(rs) % g->size;
	size_t n = 1 + rnd(rs) % 512;
	if (at + n > g->size)
		n = g->size - at;
	for (size_t i = 0; i < n; i++)
		g->map[at + i] = (uint8_t)rnd(rs);
}

static void do_dispatch(struct cconn *c)
{
	uint64_t *rs = c->rs;
	struct epp_dispatch d = {.group_id = pick_gid(c)};
	const struct cgroup *g = group_of(c, d.group_id);
	struct epp_join j = g ? g->j : (struct epp_join){.hidden = 256,
		.max_tokens = 8, .topk = 2, .dtype = EP_DTYPE_BF16};
	d.num_tokens = near(rs, (uint32_t)(rnd(rs) % (j.max_tokens + 1)));
	d.hidden = near(rs, j.hidden);
	d.dtype = near(rs, j.dtype);
	d.topk = near(rs, j.topk);
	switch (rnd(rs) % (Hostile ? 6 : 12)) {
	case 0: case 6: case 7: d.flags = EPP_DISPATCH_CACHED; break;
	case 1: d.flags = EPP_DISPATCH_XREG; break;
	case 2: d.flags = (uint32_t)rnd(rs); break;
	case 3: d.flags = (uint32_t)(rnd(rs) % 3) << EPP_DISPATCH_AREA_SHIFT;
		break;
	case 4: d.flags = 0; break;
	default: d.flags = EPP_DISPATCH_WEIGHTS;
	}
	uint32_t rows;
	d.handle = pick_handle(c, d.group_id, &rows);
	d.reg = (uint32_t)(rnd(rs) % 3);
	d.reg_off = rnd(rs) % 3 ? rnd(rs) % 4096 : rnd(rs);
	uint8_t p[256];
	uint32_t len = (uint32_t)epp_dispatch_encode(&d, p, sizeof(p));
	send_frame(c, EPP_DISPATCH, op_flags(rs), p, len, NULL, 0);
}

static void do_combine(struct cconn *c)
{
	uint64_t *rs = c->rs;
	struct epp_combine b = {.group_id = pick_gid(c)};
	const struct cgroup *g = group_of(c, b.group_id);
	uint32_t H = g ? g->j.hidden : 256, rows;
	b.handle = pick_handle(c, b.group_id, &rows);
	b.num_rows = near(rs, rows);
	b.hidden = near(rs, H);
	static const uint32_t fl[] = {0, EPP_COMBINE_BIAS, EPP_COMBINE_BIAS2,
				      EPP_COMBINE_WEIGHTS, EPP_COMBINE_YREG,
				      EPP_COMBINE_OUTREG};
	b.flags = fl[rnd(rs) % (Hostile ? 6 : 4)] |
		  (ONE_IN(rs, 3) ? fl[rnd(rs) % 4] : 0);
	if (ONE_IN(rs, Hostile ? 8 : 60))
		b.flags = (uint32_t)rnd(rs);
	b.reg = (uint32_t)(rnd(rs) % 3);
	b.reg_off = rnd(rs) % 4096;
	b.out_reg = (uint32_t)(rnd(rs) % 3);
	b.out_rows = (uint32_t)(rnd(rs) % 20);
	b.out_off = ONE_IN(rs, 3) ? rnd(rs) : rnd(rs) % 4096;
	uint8_t p[256];
	uint32_t len = (uint32_t)epp_combine_encode(&b, p, sizeof(p));
	send_frame(c, EPP_COMBINE, op_flags(rs), p, len, NULL, 0);
}

static void do_release(struct cconn *c)
{
	struct epp_release r = {.group_id = pick_gid(c)};
	uint32_t rows;
	r.handle = pick_handle(c, r.group_id, &rows);
	uint8_t p[64];
	uint32_t len = (uint32_t)epp_release_encode(&r, p, sizeof(p));
	send_frame(c, EPP_RELEASE, ONE_IN(c->rs, 3) ? EPP_F_ASYNC : 0, p, len,
		   NULL, 0);
}

static void do_ll_map(struct cconn *c)
{
	struct epp_ll_map m = {.group_id = pick_gid(c),
			       .local = (uint32_t)(rnd(c->rs) % 4)};
	uint8_t p[64];
	uint32_t len = (uint32_t)epp_ll_map_encode(&m, p, sizeof(p));
	send_frame(c, EPP_LL_MAP, 0, p, len, NULL, 0);
}

/* A registration with stray descriptors: a memfd, /dev/null, a pipe, the
 * socket itself; as many as it says, or not. */
static void do_mem_reg(struct cconn *c)
{
	uint64_t *rs = c->rs;
	struct epp_mem_reg m = {.group_id = pick_gid(c)};
	unsigned nfds = (unsigned)(rnd(rs) % 4);
	m.nchunks = ONE_IN(rs, 4) ? (uint32_t)(rnd(rs) % 70) : nfds;
	if (m.nchunks > EPP_MAX_REG_CHUNKS)
		m.nchunks = EPP_MAX_REG_CHUNKS;
	for (uint32_t i = 0; i < m.nchunks; i++)
		m.chunk[i] = ONE_IN(rs, 3) ? rnd(rs) : 2u << 20;
	int fds[4], pp[2] = {-1, -1};
	for (unsigned i = 0; i < nfds; i++) {
		switch (rnd(rs) % 4) {
		case 0:
			fds[i] = memfd_create("chaos", MFD_CLOEXEC);
			if (fds[i] >= 0 && ftruncate(fds[i], 2u << 20))
				fds[i] = -1;
			break;
		case 1:
			fds[i] = open("/dev/null", O_RDWR | O_CLOEXEC);
			break;
		case 2:
			if (pp[0] < 0 && pipe(pp))
				pp[0] = pp[1] = -1;
			fds[i] = dup(pp[0]);
			break;
		default:
			fds[i] = dup(c->fd);
		}
		if (fds[i] < 0)
			fds[i] = open("/dev/null", O_RDONLY | O_CLOEXEC);
	}
	uint8_t p[1024];
	uint32_t len = (uint32_t)epp_mem_reg_encode(&m, p, sizeof(p));
	send_frame(c, EPP_MEM_REG, 0, p, len, fds, nfds);
	for (unsigned i = 0; i < nfds; i++)
		close(fds[i]);
	if (pp[0] >= 0) {
		close(pp[0]);
		close(pp[1]);
	}
}

static void do_mem_dereg(struct cconn *c)
{
	struct epp_mem_dereg m = {.group_id = pick_gid(c),
				  .reg = (uint32_t)(rnd(c->rs) % 4)};
	uint8_t p[64];
	uint32_t len = (uint32_t)epp_mem_dereg_encode(&m, p, sizeof(p));
	send_frame(c, EPP_MEM_DEREG, 0, p, len, NULL, 0);
}

static void do_hello(struct cconn *c)
{
	uint8_t p[128];
	struct epp_wr w;
	epp_wr_init(&w, p, sizeof(p));
	epp_put_u16(&w, Hostile && ONE_IN(c->rs, 4) ? (uint16_t)rnd(c->rs)
					 : EPP_VERSION_MAJOR);
	epp_put_u16(&w, (uint16_t)(rnd(c->rs) % (Hostile ? 20 : 16)));
	epp_put_str(&w, "chaos");
	send_frame(c, EPP_HELLO, 0, p, (uint32_t)w.off, NULL, 0);
}

static void do_garbage(struct cconn *c)
{
	uint8_t p[512];
	uint32_t len = (uint32_t)(rnd(c->rs) % sizeof(p));
	for (uint32_t i = 0; i < len; i++)
		p[i] = (uint8_t)rnd(c->rs);
	send_frame(c, (uint16_t)(rnd(c->rs) % 80), op_flags(c->rs), p, len,
		   NULL, 0);
}

static int chaos_connect(struct cconn *c)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	c->node = (int)(rnd(c->rs) % (uint64_t)S->nodes);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s",
		 S->node[c->node]->sock);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	TH_CHECK(fd >= 0, "socket");
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
		return fd;
	TH_CHECK(S->stopping, "chaos: the daemon refused a connection: %s",
		 strerror(errno));
	close(fd);
	return -1; /* stopped, as it should be */
}

static int chaos(int me, void *arg)
{
	(void)arg;
	if (getuid() == 0 && me % 2 == 0 &&
	    (setgid(CHAOS_UID) || setuid(CHAOS_UID)))
		return 99;
	uint64_t rs = Seed * 0x9e3779b97f4a7c15ull + (uint64_t)me + 1;
	struct cconn c = {.fd = -1, .rs = &rs, .me = me};
	while (!S->stop) {
		if (c.fd < 0 || c.dead) {
			conn_close(&c);
			c.dead = false;
			c.fd = chaos_connect(&c);
			if (c.fd < 0) {
				th_sleep_ms(5);
				continue;
			}
			Hostile = ONE_IN(&rs, 4);
			if (!ONE_IN(&rs, 5))
				do_hello(&c);
			if (!Hostile)
				do_join(&c);
		}
		switch (rnd(&rs) % 16) {
		case 0: case 1: do_join(&c); break;
		case 2: case 3: case 4: scribble(&c); break;
		case 5: send_gid(&c, EPP_BARRIER, op_flags(&rs)); break;
		case 6: case 7: do_dispatch(&c); break;
		case 8: do_combine(&c); break;
		case 9: do_release(&c); break;
		case 10: do_ll_map(&c); break;
		case 11: do_mem_reg(&c); break;
		case 12: do_mem_dereg(&c); break;
		case 13:
			if (ONE_IN(&rs, 3))
				send_gid(&c, EPP_LEAVE, 0);
			else
				send_frame(&c, EPP_STATUS, 0, NULL, 0, NULL, 0);
			break;
		case 14:
			if (Hostile)
				do_garbage(&c);
			break;
		default:
			if (ONE_IN(&rs, Hostile ? 4 : 40))
				conn_close(&c); /* replies pending, ops in flight */
		}
		drain(&c, ONE_IN(&rs, 4) ? (int)(rnd(&rs) % 30) : 0);
	}
	conn_close(&c);
	return 0;
}

static const uint16_t Must[] = {EPP_JOIN, EPP_BARRIER, EPP_DISPATCH,
				EPP_COMBINE, EPP_RELEASE};

/* One phase of chaos on the n daemons dv: the bystander (one rank a node
 * on two nodes) runs throughout; the operator reloads every daemon's
 * configuration each second. Checks that every daemon lives, that the
 * chaos reached the operations (on two nodes: operations of groups across
 * both), that the bystander went on, and that afterwards every daemon's
 * descriptors and shared mappings are back to what they were. */
static void phase(struct th_daemon *const *dv, int n, int seconds,
		  const char *what)
{
	S->nodes = n;
	for (int i = 0; i < n; i++)
		S->node[i] = dv[i];
	S->by_rpn = n > 1 ? 1 : By.world;
	for (uint32_t r = 0; r < By.world; r++)
		S->by_d[r] = dv[n > 1 ? r : 0];
	S->stop = S->by_stop = 0;
	S->by_rounds = 0;
	for (int i = 0; i < NCHAOS; i++) {
		S->replies[i] = S->frames[i] = S->ops_ok[i] = 0;
		for (int k = 0; k < 16; k++)
			S->ok_of[i][k] = 0;
	}
	pid_t by[2];
	th_spawn(by, (int)By.world, bystander, NULL);
	while (S->by_rounds < 3)
		th_sleep_ms(5);
	int fd0[2], map0[2];
	for (int i = 0; i < n; i++) {
		fd0[i] = th_fds(dv[i]->pid);
		map0[i] = th_maps(dv[i]->pid, "memfd:");
	}
	uint64_t r0 = S->by_rounds;

	pid_t ch[NCHAOS];
	th_spawn(ch, NCHAOS, chaos, NULL);
	uint64_t end = th_now_ns() + (uint64_t)seconds * 1000000000ull;
	for (int t = 1; th_now_ns() < end; t++) {
		th_sleep_ms(100);
		for (int i = 0; i < n; i++) {
			TH_CHECK(th_daemon_alive(dv[i]), "%s: daemon %d died",
				 what, i);
			if (t % 10 == 0) /* the operator reloads */
				kill(dv[i]->pid, SIGHUP);
		}
	}
	S->stop = 1;
	TH_CHECK(th_wait_all(ch, NCHAOS, 60) == 0, "%s: a chaos client failed",
		 what);
	uint64_t frames = 0, replies = 0, ok = 0;
	for (int i = 0; i < NCHAOS; i++) {
		frames += S->frames[i];
		replies += S->replies[i];
		ok += S->ops_ok[i];
	}
	printf("%s, %d s: %lu chaos frames, %lu replies (%lu OK); bystander "
	       "%lu rounds during the chaos\n",
	       what, seconds, (unsigned long)frames, (unsigned long)replies,
	       (unsigned long)ok, (unsigned long)(S->by_rounds - r0));
	/* the chaos must reach the operations, not only the decoders:
	 * joins, barriers, dispatches and combines that ran (on scribbled
	 * buffers). Across nodes two chaos clients must meet in a group and
	 * agree on a handle for a combine: a few a run, so the combine and
	 * the release are counted there, not required. */
	for (size_t k = 0; k < sizeof(Must) / sizeof(Must[0]); k++) {
		uint64_t m = 0;
		for (int i = 0; i < NCHAOS; i++)
			m += S->ok_of[i][Must[k]];
		printf("  %s: %lu OK\n", epp_type_name(Must[k]),
		       (unsigned long)m);
		TH_CHECK(m > 0 || (n > 1 && Must[k] != EPP_JOIN &&
				   Must[k] != EPP_BARRIER &&
				   Must[k] != EPP_DISPATCH),
			 "%s: no chaos %s ever succeeded", what,
			 epp_type_name(Must[k]));
	}
	TH_CHECK(S->by_rounds > r0, "%s: the bystander made no progress",
		 what);

	/* Back to rest: every chaos connection, group and mapping gone. */
	for (int i = 0; i < n; i++) {
		int fd1 = -1, map1 = -1;
		for (int t = 0; t < 200; t++) {
			fd1 = th_fds(dv[i]->pid);
			map1 = th_maps(dv[i]->pid, "memfd:");
			if (fd1 == fd0[i] && map1 == map0[i])
				break;
			th_sleep_ms(50);
		}
		TH_CHECK(fd1 == fd0[i], "%s: daemon %d has %d descriptors, %d "
			 "before", what, i, fd1, fd0[i]);
		TH_CHECK(map1 == map0[i], "%s: daemon %d maps %d memfd regions, "
			 "%d before", what, i, map1, map0[i]);
	}
	S->by_stop = 1;
	TH_CHECK(th_wait_all(by, (int)By.world, 60) == 0,
		 "%s: the bystander failed", what);
}

/* The operator stops the daemons, one after the other, in the middle of
 * the chaos: each exits with status 0 and removes its socket
 * (th_daemon_stop; a sanitizer's report would change the status). */
static void stop_under_chaos(struct th_daemon *const *dv, int n)
{
	S->stop = 0;
	S->stopping = 1;
	pid_t ch[NCHAOS];
	th_spawn(ch, NCHAOS, chaos, NULL);
	for (int i = 0; i < n; i++) {
		th_sleep_ms(1500);
		th_daemon_stop(dv[i]);
	}
	S->stop = 1;
	TH_CHECK(th_wait_all(ch, NCHAOS, 60) == 0,
		 "a chaos client failed while the daemons stopped");
	S->stopping = 0;
}

int main(void)
{
	th_init("test_chaos", 600);
	Seed = th_seed();
	const char *e = getenv("EPD_CHAOS_SECONDS");
	int seconds = e ? atoi(e) : 15;
	S = th_shared(sizeof(*S));

	struct th_daemon d;
	th_daemon_start(&d, "-o", "socket_mode=0666", NULL);
	TH_CHECK(chmod(d.dir, 0755) == 0, "chmod %s", d.dir);
	struct th_daemon *one[] = {&d};
	phase(one, 1, seconds, "one node");
	stop_under_chaos(one, 1);
	printf("ok: one node: SIGHUP every second under the chaos, and "
	       "SIGTERM in the middle of it: exit status 0\n");

	/* Two daemons in a cluster: chaos groups span both nodes (a node's
	 * daemon then also carries what its ranks' chaos does to the other
	 * node), and the bystander has a rank on each. */
	struct th_daemon dn[2];
	const char *extra[] = {"-o", "socket_mode=0666", NULL};
	th_cluster_start(dn, 2, "epdchaos", extra);
	for (int i = 0; i < 2; i++)
		TH_CHECK(chmod(dn[i].dir, 0755) == 0, "chmod %s", dn[i].dir);
	struct th_daemon *two[] = {&dn[0], &dn[1]};
	phase(two, 2, seconds, "two nodes");
	stop_under_chaos(two, 2);
	printf("ok: two nodes: SIGHUP every second under the chaos, and "
	       "SIGTERM to each node in the middle of it: exit status 0\n");
	return 0;
}
