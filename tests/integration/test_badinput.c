/* SPDX-License-Identifier: MIT */
/*
 * Bad input over a raw socket: each malformed frame gets a precise error,
 * and a bystander group of two ranks keeps running barriers throughout.
 */
#include "harness.h"
#include "epp.h"

#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static const struct th_daemon *D;

static int raw_connect_to(const char *sock)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	TH_CHECK(fd >= 0, "socket");
	TH_CHECK(connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0,
		 "connect: %s", strerror(errno));
	return fd;
}

static int raw_connect(void)
{
	return raw_connect_to(D->sock);
}

static void raw_send(int fd, const void *p, size_t n)
{
	TH_CHECK(write(fd, p, n) == (ssize_t)n, "write: %s", strerror(errno));
}

static void send_hdr(int fd, uint32_t magic, uint8_t major, uint16_t type,
		     uint16_t flags, uint32_t len, uint64_t req,
		     const void *payload)
{
	struct epp_hdr h;
	epp_hdr_init(&h, type, req);
	h.magic = magic;
	h.ver_major = major;
	h.flags = flags;
	h.length = len;
	uint8_t b[EPP_HDR_SIZE];
	epp_hdr_encode(&h, b);
	raw_send(fd, b, sizeof(b));
	if (payload && len)
		raw_send(fd, payload, len);
}

/* Read one frame; expect ERROR with `code` and message containing `frag`. */
static void expect_error(int fd, uint64_t req, int code, const char *frag)
{
	struct epp_hdr h;
	uint8_t *p;
	char err[256];
	int rc = epp_recv_frame(fd, &h, &p, NULL, 5000, err, sizeof(err));
	TH_CHECK(rc == 0, "no reply: %s %s", ep_strerror(rc), err);
	TH_CHECK(h.type == EPP_ERROR, "reply type %u, want error", h.type);
	TH_CHECK(h.req_id == req, "reply req %lu, want %lu",
		 (unsigned long)h.req_id, (unsigned long)req);
	int got;
	char msg[EPP_ERRMSG_MAX];
	TH_OK(epp_error_decode(p, h.length, &got, msg, sizeof(msg)));
	free(p);
	TH_CHECK(got == code, "error %d (%s), want %d (%s): %s", got,
		 ep_strerror(got), code, ep_strerror(code), msg);
	TH_CHECK(strstr(msg, frag) != NULL, "message '%s' lacks '%s'", msg,
		 frag);
	printf("ok: %s -> %s\n", frag, msg);
}

/* The daemon closed this connection. */
static void expect_closed(int fd)
{
	struct pollfd p = {.fd = fd, .events = POLLIN};
	TH_CHECK(poll(&p, 1, 5000) == 1, "connection still open");
	char b;
	TH_CHECK(read(fd, &b, 1) <= 0, "more data after a fatal error");
	close(fd);
}

/* The connection still works: a STATUS round trip. */
static void expect_usable(int fd)
{
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_STATUS, 0, 0, 99, NULL);
	struct epp_hdr h;
	uint8_t *p;
	TH_OK(epp_recv_frame(fd, &h, &p, NULL, 5000, NULL, 0));
	TH_CHECK(h.type == EPP_OK && h.req_id == 99, "status failed");
	free(p);
}

struct bystander {
	const struct th_daemon *d;
	volatile int stop;
	volatile uint64_t count[2];
};

static int bystander_rank(int rank, void *arg)
{
	struct bystander *b = arg;
	ep_conn_t *c;
	struct ep_group_config cfg = th_group("bystander", 2, (uint32_t)rank,
					      20000);
	ep_group_t *g = th_join(b->d, &cfg, &c);
	/* Both stop at the same round: rank 0 decides, rank 1 follows. */
	for (;;) {
		TH_OK(ep_barrier(g));
		b->count[rank]++;
		if (rank == 0 && b->stop)
			b->stop = 2;
		TH_OK(ep_barrier(g));
		if (b->stop == 2)
			break;
	}
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

/* A client that joins and leaves a group of one, again and again, and
 * never reads: each join's reply carries the group buffer's descriptor.
 * Queued for a client that does not read, they once held every descriptor
 * of the daemon (no other client could connect or make a group); now it
 * is dropped after 32, and the descriptors are back. */
static void check_hoarder(void)
{
	/* at rest first: the connections of the checks before are gone */
	int fd0 = th_fds(D->pid);
	for (int t = 0, prev = -1; t < 100 && fd0 != prev; t++) {
		th_sleep_ms(50);
		prev = fd0;
		fd0 = th_fds(D->pid);
	}
	int fd = raw_connect();
	struct epp_join j = {.world_size = 1, .ranks_per_node = 1,
			     .num_experts = 4, .hidden = 128, .max_tokens = 1,
			     .topk = 1, .dtype = EP_DTYPE_BF16,
			     .timeout_ms = 1000, .recv_areas = 1};
	snprintf(j.name, sizeof(j.name), "hoard");
	uint8_t p[512], g[8];
	uint32_t len = (uint32_t)epp_join_encode(&j, p, sizeof(p));
	int most = 0, sent = 0;
	/* group ids count up from the daemon's last one: leave each guess
	 * of the one just made (a wrong guess only gets an error) */
	for (int i = 0; i < 4000; i++) {
		struct epp_hdr h;
		epp_hdr_init(&h, EPP_JOIN, 1000 + 2 * (uint64_t)i);
		h.length = len;
		if (epp_send_frame(fd, &h, p, NULL))
			break;
		struct epp_wr w;
		epp_wr_init(&w, g, sizeof(g));
		epp_put_u64(&w, (uint64_t)i + 1);
		epp_hdr_init(&h, EPP_LEAVE, 1001 + 2 * (uint64_t)i);
		h.length = 8;
		if (epp_send_frame(fd, &h, g, NULL))
			break;
		sent++;
		if (i % 50 == 0) {
			int n = th_fds(D->pid);
			if (n > most)
				most = n;
		}
	}
	/* (groups left in one batch of frames are freed on the loop's next
	 * turn: a few hundred buffers at most, never one per cycle) */
	TH_CHECK(most <= fd0 + 1000, "the daemon held %d descriptors for a "
		 "client that does not read (%d before)", most, fd0);
	/* dropped: its socket closes (what it had queued may come first) */
	struct pollfd pf = {.fd = fd, .events = POLLIN};
	char buf[4096];
	ssize_t n = 1;
	for (int t = 0; t < 500 && n != 0; t++) {
		TH_CHECK(poll(&pf, 1, 5000) == 1, "the hoarder was not dropped");
		n = read(fd, buf, sizeof(buf));
		if (n < 0)
			break; /* reset: dropped too */
	}
	close(fd);
	int fd1 = -1;
	for (int t = 0; t < 200; t++) {
		fd1 = th_fds(D->pid);
		if (fd1 == fd0)
			break;
		th_sleep_ms(10);
	}
	TH_CHECK(fd1 == fd0, "the daemon has %d descriptors, %d before", fd1,
		 fd0);
	printf("ok: a client that joins and leaves without reading: dropped "
	       "after %d cycles, the daemon held at most %d descriptors (%d "
	       "before)\n", sent, most, fd0);
}

/* Send n STATUS requests on a raw connection to sock and read nothing. */
static int status_flood(const char *sock, int n)
{
	int fd = raw_connect_to(sock);
	int small = 4096;
	setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
	for (int i = 0; i < n; i++) {
		uint8_t b[EPP_HDR_SIZE];
		struct epp_hdr h;
		epp_hdr_init(&h, EPP_STATUS, (uint64_t)i + 1);
		epp_hdr_encode(&h, b);
		if (send(fd, b, sizeof(b), MSG_NOSIGNAL) != sizeof(b))
			break;
	}
	return fd;
}

/* Did the daemon close fd (after what it had sent)? */
static bool was_closed(int fd)
{
	uint8_t b[65536];
	for (;;) {
		struct pollfd pf = {.fd = fd, .events = POLLIN};
		if (poll(&pf, 1, 200) != 1)
			return false; /* open, nothing more to read */
		ssize_t k = read(fd, b, sizeof(b));
		if (k <= 0)
			return true;
	}
}

/* Replies queued for clients that do not read, all together: bounded by
 * max_queued_bytes (here 1M). Four such clients, each with less than the
 * per-client bound queued: the first stays, the ones that push the total
 * past the bound are dropped; the daemon serves on. */
static void check_queued_total(void)
{
	struct th_daemon d;
	th_daemon_start(&d, "-o", "max_queued_bytes=1M", NULL);
	/* the size of one STATUS reply here */
	ep_conn_t *c;
	char *js;
	TH_OK(ep_connect(d.sock, &c));
	TH_OK(ep_daemon_status(c, &js));
	size_t one = strlen(js) + EPP_HDR_SIZE;
	free(js);
	/* about 600 KiB each, past what the sockets hold */
	int n = (int)((600u << 10) / one) + 200;
	int fd[4];
	for (int i = 0; i < 4; i++) {
		fd[i] = status_flood(d.sock, n);
		th_sleep_ms(100); /* handled in order */
	}
	bool closed[4];
	for (int i = 0; i < 4; i++)
		closed[i] = was_closed(fd[i]);
	TH_CHECK(!closed[0] && closed[1] && closed[2] && closed[3],
		 "dropped: %d %d %d %d, want 0 1 1 1 (%d requests of %zu "
		 "bytes each)",
		 closed[0], closed[1], closed[2], closed[3], n, one);
	TH_OK(ep_daemon_status(c, &js));
	free(js);
	ep_close(c);
	for (int i = 0; i < 4; i++)
		close(fd[i]);
	char cmd[300], out[256] = "";
	snprintf(cmd, sizeof(cmd), "grep -c 'over max_queued_bytes' %s", d.log);
	FILE *p = popen(cmd, "r");
	TH_CHECK(p && fgets(out, sizeof(out), p), "grep");
	pclose(p);
	TH_CHECK(atoi(out) >= 3, "the log names the bound %d times", atoi(out));
	th_daemon_stop(&d);
	printf("ok: four clients that read nothing, %d replies of %zu bytes "
	       "each: past max_queued_bytes (1M) the last three dropped, the "
	       "first kept\n", n, one);
}

/* A client named with bytes that are not printable ASCII (not UTF-8, a
 * newline, a terminal escape): it used to be missing from the status
 * (JSON takes only UTF-8), hidden from the operator. Now listed, its
 * name with '?' for those bytes. */
static void check_client_name(void)
{
	int fd = raw_connect();
	static const char name[] = "\xff\xfe\x1b[31mX\n";
	uint8_t p[64];
	struct epp_wr w;
	epp_wr_init(&w, p, sizeof(p));
	epp_put_u16(&w, EPP_VERSION_MAJOR);
	epp_put_u16(&w, EPP_VERSION_MINOR);
	epp_put_str(&w, name);
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_HELLO, 0,
		 (uint32_t)w.off, 7, p);
	struct epp_hdr h;
	uint8_t *rep;
	TH_OK(epp_recv_frame(fd, &h, &rep, NULL, 5000, NULL, 0));
	TH_CHECK(h.type == EPP_OK, "hello refused");
	free(rep);
	ep_conn_t *c;
	char *js;
	TH_OK(ep_connect(D->sock, &c));
	TH_OK(ep_daemon_status(c, &js));
	TH_CHECK(strstr(js, "???[31mX?") != NULL,
		 "the oddly named client is not in the status: %s", js);
	free(js);
	ep_close(c);
	close(fd);
	printf("ok: a client named with bytes outside printable ASCII is in "
	       "the status, named ???[31mX?\n");
}

/* A raw JOIN of `name` (world `world`, rank `rank`, one node; NOWAIT
 * unless world is 1), linked to group `link` if nonzero: the reply's
 * group id, or 0 with *code the error. */
static uint64_t link_join(int fd, const char *name, uint32_t world,
			  uint32_t rank, uint64_t link, uint64_t req,
			  int *code)
{
	struct epp_join j = {.world_size = world, .ranks_per_node = world,
			     .rank = rank, .num_experts = 4 * world,
			     .hidden = 128, .max_tokens = 8, .topk = 2,
			     .dtype = 1, .link = link};
	snprintf(j.name, sizeof(j.name), "%s", name);
	uint8_t b[512];
	size_t n = epp_join_encode(&j, b, sizeof(b));
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_JOIN,
		 (uint16_t)((link ? EPP_F_JOIN_LINK : 0) |
			    (world > 1 ? EPP_F_JOIN_NOWAIT : 0)),
		 (uint32_t)n, req, b);
	struct epp_hdr h;
	uint8_t *p;
	int fds[EPP_MAX_FDS];
	TH_OK(epp_recv_frame(fd, &h, &p, fds, 5000, NULL, 0));
	for (unsigned i = 0; i < h.nfds; i++)
		close(fds[i]);
	TH_CHECK(h.req_id == req, "join reply for %lu", (unsigned long)h.req_id);
	uint64_t id = 0;
	*code = 0;
	if (h.type == EPP_OK) {
		struct epp_join_ok ok;
		TH_OK(epp_join_ok_decode(p, h.length, &ok));
		id = ok.group_id;
	} else {
		char msg[EPP_ERRMSG_MAX];
		TH_OK(epp_error_decode(p, h.length, code, msg, sizeof(msg)));
		printf("ok: linked join of %s -> %s\n", name, msg);
	}
	free(p);
	return id;
}

/* Links are one level deep: a chain (a group linked to a linked group)
 * and a cycle (a group with linked groups joined linked to another) are
 * refused; the groups stay usable. A chain as long as a uid's groups
 * once recursed that deep on the daemon's stack when its head failed. */
static void check_link_depth(void)
{
	int fd = raw_connect(), fd2 = raw_connect(), code;
	const uint64_t a = link_join(fd, "lda", 2, 0, 0, 1, &code);
	TH_CHECK(a && !code, "join lda: %s", ep_strerror(code));
	const uint64_t b = link_join(fd, "ldb", 1, 0, a, 2, &code);
	TH_CHECK(b && !code, "join ldb linked to lda: %s", ep_strerror(code));
	TH_CHECK(!link_join(fd, "ldc", 1, 0, b, 3, &code) && code == EP_EINVAL,
		 "a chain: %s", ep_strerror(code));
	const uint64_t z = link_join(fd2, "ldz", 1, 0, 0, 4, &code);
	TH_CHECK(z && !code, "join ldz: %s", ep_strerror(code));
	/* lda's second rank, linked to ldz: lda has ldb linked to it */
	TH_CHECK(!link_join(fd2, "lda", 2, 1, z, 5, &code) &&
			 code == EP_EINVAL,
		 "a group with linked groups, linked: %s", ep_strerror(code));
	/* unlinked, the same rank joins */
	TH_CHECK(link_join(fd2, "lda", 2, 1, 0, 6, &code) && !code,
		 "lda's second rank: %s", ep_strerror(code));
	expect_usable(fd);
	expect_usable(fd2);
	close(fd2); /* lda fails, and ldb with it: one level */
	close(fd);
	/* every group went with its ranks: joined anew, each is new */
	fd = raw_connect();
	uint64_t id = 0;
	for (int i = 0; i < 100 && !id; i++) {
		th_sleep_ms(20);
		id = link_join(fd, "lda", 2, 0, 0, 7 + 2 * (uint64_t)i, &code);
	}
	TH_CHECK(id && link_join(fd, "ldb", 1, 0, id, 8, &code) && !code,
		 "lda and ldb anew: %s", ep_strerror(code));
	close(fd);
}

/* A duplicate rank's join, linked to a group of its own connection, is
 * refused before its link touches the group: the group of the rank it
 * tried to take is not linked to the intruder's, so the intruder's group
 * failing leaves it alone. */
static void check_dup_link(void)
{
	int fd = raw_connect(), fd2 = raw_connect(), code;
	const uint64_t v = link_join(fd, "dupv", 2, 0, 0, 1, &code);
	TH_CHECK(v && !code, "join dupv: %s", ep_strerror(code));
	const uint64_t own = link_join(fd2, "dupown", 1, 0, 0, 2, &code);
	TH_CHECK(own && !code, "join dupown: %s", ep_strerror(code));
	TH_CHECK(!link_join(fd2, "dupv", 2, 0, own, 3, &code) &&
			 code == EP_EDUPRANK,
		 "dupv's taken rank, linked: %s", ep_strerror(code));
	close(fd2); /* dupown fails */
	th_sleep_ms(100);
	int fd3 = raw_connect();
	TH_CHECK(link_join(fd3, "dupv", 2, 1, 0, 4, &code) && !code,
		 "dupv's second rank after the intruder's group failed: %s",
		 ep_strerror(code));
	expect_usable(fd);
	expect_usable(fd3);
	close(fd3);
	close(fd);
	printf("ok: a duplicate rank's linked join is refused before its link "
	       "touches the group (the intruder's group failing leaves it "
	       "alone)\n");
}

/* A raw JOIN of `name` (world 3, one node, NOWAIT) whose buffer is
 * mapped here: the control page, in *map. */
static int gone_join(uint32_t rank, const uint8_t **map, size_t *len)
{
	int fd = raw_connect();
	struct epp_join j = {.world_size = 3, .ranks_per_node = 3,
			     .rank = rank, .num_experts = 12, .hidden = 128,
			     .max_tokens = 8, .topk = 2, .dtype = 1};
	snprintf(j.name, sizeof(j.name), "gone");
	uint8_t b[512];
	size_t n = epp_join_encode(&j, b, sizeof(b));
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_JOIN, EPP_F_JOIN_NOWAIT,
		 (uint32_t)n, 40 + rank, b);
	struct epp_hdr h;
	uint8_t *p;
	int fds[EPP_MAX_FDS];
	TH_OK(epp_recv_frame(fd, &h, &p, fds, 5000, NULL, 0));
	TH_CHECK(h.type == EPP_OK && h.nfds >= 1, "join of gone rank %u", rank);
	struct epp_join_ok ok;
	TH_OK(epp_join_ok_decode(p, h.length, &ok));
	free(p);
	if (map) {
		void *m = mmap(NULL, ok.buf_size, PROT_READ, MAP_SHARED, fds[0],
			       0);
		TH_CHECK(m != MAP_FAILED, "mapping the group buffer: %m");
		*map = m;
		*len = ok.buf_size;
	}
	for (unsigned i = 0; i < h.nfds; i++)
		close(fds[i]);
	return fd;
}

/* The control page's gone word (protocol 1.17) once the set of bits
 * `want` is in it (2 s at most). */
static uint64_t gone_bits(const uint8_t *map, uint64_t want)
{
	uint64_t v = 0;
	for (int i = 0; i < 200; i++) {
		v = __atomic_load_n((const uint64_t *)(map + EPP_CTL_GROUP_SLOT +
						       EPP_CTL_GONE),
				    __ATOMIC_ACQUIRE);
		if ((v & want) == want)
			break;
		th_sleep_ms(10);
	}
	return v;
}

/* The daemon names each rank that leaves a formed group in the control
 * page (EPP_CTL_GONE), also after the first departure failed the group:
 * the low-latency kernels of shrink mode mask exactly those ranks. */
static void check_gone_word(void)
{
	const uint8_t *map;
	size_t len;
	int f0 = gone_join(0, &map, &len);
	int f1 = gone_join(1, NULL, NULL);
	int f2 = gone_join(2, NULL, NULL);
	expect_usable(f0); /* the joins are processed: the group formed */
	TH_CHECK(gone_bits(map, 0) == 0, "a gone bit before anyone left");
	close(f2);
	uint64_t v = gone_bits(map, 4);
	TH_CHECK(v == 4, "after rank 2 left: gone 0x%llx, want 0x4",
		 (unsigned long long)v);
	close(f1); /* the group failed already */
	v = gone_bits(map, 6);
	TH_CHECK(v == 6, "after rank 1 left too: gone 0x%llx, want 0x6",
		 (unsigned long long)v);
	close(f0);
	munmap((void *)map, len);
	printf("ok: the control page named rank 2, then rank 1, as each left "
	       "the group (the second after the group had failed)\n");
}

int main(void)
{
	th_init("bad input", 120);
	struct th_daemon d;
	th_daemon_start(&d, "-o", "frame_timeout_ms=300", NULL);
	D = &d;
	struct bystander *b = th_shared(sizeof(*b));
	b->d = &d;
	pid_t pids[2];
	th_spawn(pids, 2, bystander_rank, b);
	while (b->count[1] < 10)
		th_sleep_ms(1);

	int fd;
	/* Bad magic: untrusted stream, error then disconnect. */
	fd = raw_connect();
	send_hdr(fd, 0xdeadbeef, EPP_VERSION_MAJOR, EPP_STATUS, 0, 0, 1, NULL);
	expect_error(fd, 1, EP_EPROTO, "bad magic");
	expect_closed(fd);

	/* Newer major version. */
	fd = raw_connect();
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR + 1, EPP_STATUS, 0, 0, 2,
		 NULL);
	expect_error(fd, 2, EP_EVERSION, "not supported");
	expect_closed(fd);

	/* Oversized length. */
	fd = raw_connect();
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_JOIN, 0,
		 EPP_MAX_PAYLOAD + 1, 3, NULL);
	expect_error(fd, 3, EP_EPROTO, "exceeds the maximum");
	expect_closed(fd);

	/* Truncated frame: half a header, then silence. */
	fd = raw_connect();
	uint8_t half[10] = {0x45, 0x50, 0x44, 0x31, 1, 0, 5, 0, 0, 0};
	raw_send(fd, half, sizeof(half));
	expect_error(fd, 0, EP_EPROTO, "truncated frame");
	expect_closed(fd);

	/* Truncated payload: the header promises more than the client sends. */
	fd = raw_connect();
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_JOIN, 0, 100, 4, NULL);
	raw_send(fd, "abc", 3);
	expect_error(fd, 0, EP_EPROTO, "truncated frame: 27 bytes");
	expect_closed(fd);

	/* A slow frame: a byte every 100 ms never extends the deadline of
	 * 300 ms, which runs from the frame's first byte. */
	fd = raw_connect();
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_JOIN, 0, 1000, 11,
		 NULL);
	uint64_t slow0 = th_now_ns();
	for (int i = 0; i < 20; i++) {
		struct pollfd sp = {.fd = fd, .events = POLLIN};
		if (poll(&sp, 1, 100) == 1)
			break; /* the daemon answered: the deadline passed */
		if (write(fd, "x", 1) != 1)
			break;
	}
	expect_error(fd, 0, EP_EPROTO, "truncated frame");
	expect_closed(fd);
	uint64_t slow_ms = (th_now_ns() - slow0) / 1000000;
	TH_CHECK(slow_ms < 1500, "a slow frame stayed open %lu ms",
		 (unsigned long)slow_ms);

	/* Unknown type: an error, and the connection stays usable. */
	fd = raw_connect();
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, 777, 0, 4, 5, "abcd");
	expect_error(fd, 5, EP_EPROTO, "unknown message type 777");
	expect_usable(fd);
	/* Unknown flags. */
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_STATUS, 0x80, 0, 6,
		 NULL);
	expect_error(fd, 6, EP_EPROTO, "unknown flags");
	expect_closed(fd);

	/* Malformed payloads keep the connection. */
	fd = raw_connect();
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_JOIN, 0, 5, 7, "\x03\x00"
								      "abc");
	expect_error(fd, 7, EP_EPROTO, "malformed join payload");
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_BARRIER, 0, 3, 8,
		 "xyz");
	expect_error(fd, 8, EP_EPROTO, "malformed barrier payload");
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_BARRIER, 0, 8, 9,
		 "\x01\x02\x03\x04\x05\x06\x07\x08");
	expect_error(fd, 9, EP_ENOGROUP, "not joined on this connection");
	struct epp_join j = {.world_size = 4, .ranks_per_node = 4,
			     .rank = 9, .num_experts = 8, .hidden = 256,
			     .max_tokens = 8, .topk = 2, .dtype = 1};
	strcpy(j.name, "g");
	uint8_t jb[256];
	size_t jn = epp_join_encode(&j, jb, sizeof(jb));
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_JOIN, 0, (uint32_t)jn,
		 10, jb);
	expect_error(fd, 10, EP_EINVAL, "rank 9 out of range");
	j.rank = 0;
	j.topk = 33;
	jn = epp_join_encode(&j, jb, sizeof(jb));
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_JOIN, 0, (uint32_t)jn,
		 11, jb);
	expect_error(fd, 11, EP_EINVAL, "topk 33");
	strcpy(j.name, "bad name!");
	j.topk = 2;
	jn = epp_join_encode(&j, jb, sizeof(jb));
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_JOIN, 0, (uint32_t)jn,
		 12, jb);
	expect_error(fd, 12, EP_EINVAL, "group name");
	/* linked joins (1.16): no link id, a link of 0, a group this
	 * connection has not joined */
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_JOIN, EPP_F_JOIN_LINK,
		 5, 14, "\x03\x00" "abc");
	expect_error(fd, 14, EP_EPROTO, "no group to link to");
	strcpy(j.name, "lk");
	j.world_size = j.ranks_per_node = 1;
	j.link = 0;
	jn = epp_join_encode(&j, jb, sizeof(jb));
	memset(jb + jn, 0, 8);
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_JOIN, EPP_F_JOIN_LINK,
		 (uint32_t)jn + 8, 15, jb);
	expect_error(fd, 15, EP_EPROTO, "link to is 0");
	j.link = 77;
	jn = epp_join_encode(&j, jb, sizeof(jb));
	send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_JOIN, EPP_F_JOIN_LINK,
		 (uint32_t)jn, 16, jb);
	expect_error(fd, 16, EP_ENOGROUP, "to link lk to");
	j.link = 0;
	expect_usable(fd);
	close(fd);
	check_link_depth();
	check_dup_link();
	check_gone_word();

	/* Descriptors from a client: refused, disconnect. */
	fd = raw_connect();
	{
		struct epp_hdr h;
		epp_hdr_init(&h, EPP_STATUS, 13);
		uint8_t hb[EPP_HDR_SIZE];
		epp_hdr_encode(&h, hb);
		int devnull = 0;
		TH_CHECK(epp_sendmsg(fd, hb, sizeof(hb), &devnull, 1) ==
				 EPP_HDR_SIZE,
			 "sendmsg");
		expect_error(fd, 13, EP_EPROTO, "no frame claims");
		expect_closed(fd);
	}
	/* A frame that announces descriptors it did not bring, and
	 * descriptors on a frame other than mem-reg: refused, disconnect. */
	fd = raw_connect();
	{
		struct epp_hdr h;
		epp_hdr_init(&h, EPP_STATUS, 14);
		h.nfds = 1;
		uint8_t hb[EPP_HDR_SIZE];
		epp_hdr_encode(&h, hb);
		raw_send(fd, hb, sizeof(hb));
		expect_error(fd, 14, EP_EPROTO, "only with mem-reg");
		expect_closed(fd);
	}
	fd = raw_connect();
	{
		struct epp_mem_reg m = {.group_id = 1, .nchunks = 2,
					.chunk = {2u << 20, 2u << 20}};
		uint8_t pb[64];
		size_t pn = epp_mem_reg_encode(&m, pb, sizeof(pb));
		struct epp_hdr h;
		epp_hdr_init(&h, EPP_MEM_REG, 15);
		h.length = (uint32_t)pn;
		h.nfds = 2;
		uint8_t fb[EPP_HDR_SIZE + 64];
		epp_hdr_encode(&h, fb);
		memcpy(fb + EPP_HDR_SIZE, pb, pn);
		int one = 0; /* one descriptor of the two announced */
		TH_CHECK(epp_sendmsg(fd, fb, EPP_HDR_SIZE + pn, &one, 1) ==
				 (long)(EPP_HDR_SIZE + pn),
			 "sendmsg");
		expect_error(fd, 15, EP_EPROTO, "2 descriptors, 1 arrived");
		expect_closed(fd);
	}

	/* Group-level errors through libep. */
	ep_conn_t *c1, *c2, *c3;
	ep_group_t *g1, *g2;
	TH_OK(ep_connect(d.sock, &c1));
	TH_OK(ep_connect(d.sock, &c2));
	TH_OK(ep_connect(d.sock, &c3));
	struct ep_group_config cfg = th_group("strict", 4, 0, 5000);
	TH_OK(ep_join(c1, &cfg, EP_JOIN_NOWAIT, &g1));
	/* Barrier before the group is ready. */
	TH_EXPECT_RC(ep_barrier(g1), EP_ENOTREADY);
	TH_CHECK(strstr(ep_errmsg(), "ranks not joined: 1,2,3"),
		 "message: %s", ep_errmsg());
	printf("ok: barrier before ready -> %s\n", ep_errmsg());
	/* The same rank twice. */
	TH_EXPECT_RC(ep_join(c2, &cfg, EP_JOIN_NOWAIT, &g2), EP_EDUPRANK);
	printf("ok: second join of rank 0 -> %s\n", ep_errmsg());
	/* A join that contradicts the group. */
	cfg.rank = 1;
	cfg.hidden = 512;
	TH_EXPECT_RC(ep_join(c2, &cfg, EP_JOIN_NOWAIT, &g2), EP_EMISMATCH);
	TH_CHECK(strstr(ep_errmsg(), "hidden 256"), "message: %s",
		 ep_errmsg());
	printf("ok: contradicting join -> %s\n", ep_errmsg());
	cfg.hidden = 256;
	cfg.dtype = EP_DTYPE_FP8;
	TH_EXPECT_RC(ep_join(c2, &cfg, EP_JOIN_NOWAIT, &g2), EP_EMISMATCH);
	cfg.dtype = EP_DTYPE_BF16;
	cfg.world_size = 8;
	cfg.ranks_per_node = 4;
	TH_EXPECT_RC(ep_join(c3, &cfg, EP_JOIN_NOWAIT, &g2),
		     EP_EUNSUPPORTED);
	printf("ok: group spanning nodes without a cluster -> %s\n",
	       ep_errmsg());
	/* After all that, a correct join works. */
	cfg = th_group("strict", 4, 1, 5000);
	TH_OK(ep_join(c2, &cfg, EP_JOIN_NOWAIT, &g2));
	TH_OK(ep_leave(g2));
	TH_OK(ep_leave(g1));
	ep_close(c1);
	ep_close(c2);
	ep_close(c3);

	/* Stream-ordered frames (EPP_F_ASYNC) are for GPU groups only. */
	fd = raw_connect();
	{
		struct epp_join hj = {.world_size = 1, .ranks_per_node = 1,
				      .num_experts = 4, .hidden = 128,
				      .max_tokens = 8, .topk = 2, .dtype = 1};
		strcpy(hj.name, "hostonly");
		uint8_t buf[256];
		struct epp_join_ok jo;
		th_raw_join(fd, &hj, 20, &jo);
		size_t n = epp_join_encode(&hj, buf, sizeof(buf));
		struct epp_wr w;
		epp_wr_init(&w, buf, sizeof(buf));
		epp_put_u64(&w, jo.group_id);
		epp_put_u64(&w, 1); /* the stream sequence */
		send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_BARRIER,
			 EPP_F_ASYNC, (uint32_t)w.off, 21, buf);
		expect_error(fd, 21, EP_EUNSUPPORTED,
			     "no stream-ordered operations");
		send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_BARRIER,
			 EPP_F_ASYNC, 4, 22, buf);
		expect_error(fd, 22, EP_EPROTO, "malformed stream-ordered");
		send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_STATUS,
			 EPP_F_ASYNC, 8, 23, buf);
		expect_error(fd, 23, EP_EPROTO, "cannot be stream-ordered");
		send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_JOIN,
			 EPP_F_ASYNC, (uint32_t)n, 24, buf);
		expect_error(fd, 24, EP_EPROTO, "not valid for join");
		/* RELEASE with EPP_F_ASYNC (a graph's host node): no reply
		 * on success, an ERROR (with the async request's id) when
		 * it is malformed or names no handle */
		send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_RELEASE,
			 EPP_F_ASYNC, 4, 25 | (1ull << 63), buf);
		expect_error(fd, 25 | (1ull << 63), EP_EPROTO,
			     "malformed release payload");
		struct epp_release rl = {.group_id = jo.group_id,
					 .handle = {.group_id = jo.group_id,
						    .epoch = jo.epoch,
						    .seq = 77}};
		size_t rn = epp_release_encode(&rl, buf, sizeof(buf));
		send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_RELEASE,
			 EPP_F_ASYNC, (uint32_t)rn, 26, buf);
		expect_error(fd, 26, EP_ESTALE, "not held");
		/* LL_MAP (the low-latency regions): malformed, an unknown
		 * group, a host group, a rank out of range: each an error
		 * naming why, the connection kept */
		send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_LL_MAP, 0, 3, 27,
			 "abc");
		expect_error(fd, 27, EP_EPROTO, "malformed ll-map payload");
		struct epp_ll_map lm = {.group_id = jo.group_id + 1000};
		size_t ln = epp_ll_map_encode(&lm, buf, sizeof(buf));
		send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_LL_MAP, 0,
			 (uint32_t)ln, 28, buf);
		expect_error(fd, 28, EP_ENOGROUP, "not joined");
		lm.group_id = jo.group_id;
		ln = epp_ll_map_encode(&lm, buf, sizeof(buf));
		send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_LL_MAP, 0,
			 (uint32_t)ln, 29, buf);
		expect_error(fd, 29, EP_EUNSUPPORTED, "host ranks");
		/* MEM_REG (registered memory, GPU ranks only): on a host
		 * group refused with why, its descriptors closed by the
		 * daemon (none left open), the connection kept; malformed,
		 * and chunks that do not match the descriptors: errors */
		int before = th_fds(D->pid);
		struct epp_mem_reg mr = {.group_id = jo.group_id, .nchunks = 3,
					 .chunk = {2u << 20, 2u << 20, 2u << 20}};
		uint8_t fb[EPP_HDR_SIZE + 128];
		size_t mn = epp_mem_reg_encode(&mr, fb + EPP_HDR_SIZE, 128);
		int three[3];
		for (int i = 0; i < 3; i++)
			TH_CHECK((three[i] = memfd_create("reg", 0)) >= 0,
				 "memfd");
		struct epp_hdr mh;
		epp_hdr_init(&mh, EPP_MEM_REG, 30);
		mh.length = (uint32_t)mn;
		mh.nfds = 3;
		epp_hdr_encode(&mh, fb);
		TH_CHECK(epp_sendmsg(fd, fb, EPP_HDR_SIZE + mn, three, 3) ==
				 (long)(EPP_HDR_SIZE + mn),
			 "sendmsg");
		expect_error(fd, 30, EP_EUNSUPPORTED, "host ranks");
		/* chunks 3, descriptors 2 */
		epp_hdr_init(&mh, EPP_MEM_REG, 31);
		mh.length = (uint32_t)mn;
		mh.nfds = 2;
		epp_hdr_encode(&mh, fb);
		TH_CHECK(epp_sendmsg(fd, fb, EPP_HDR_SIZE + mn, three, 2) ==
				 (long)(EPP_HDR_SIZE + mn),
			 "sendmsg");
		expect_error(fd, 31, EP_EPROTO, "3 chunks came with 2");
		for (int i = 0; i < 3; i++)
			close(three[i]);
		send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_MEM_REG, 0, 3, 32,
			 "abc");
		expect_error(fd, 32, EP_EPROTO, "malformed mem-reg");
		struct epp_mem_dereg md = {.group_id = jo.group_id, .reg = 1};
		size_t dn = epp_mem_dereg_encode(&md, buf, sizeof(buf));
		send_hdr(fd, EPP_MAGIC, EPP_VERSION_MAJOR, EPP_MEM_DEREG, 0,
			 (uint32_t)dn, 33, buf);
		expect_error(fd, 33, EP_EINVAL, "no such registration");
		expect_usable(fd);
		int after = th_fds(D->pid);
		TH_CHECK(after == before,
			 "the daemon holds %d descriptors, %d before the "
			 "mem-regs",
			 after, before);
		printf("ok: mem-reg on a host group refused, its descriptors "
		       "closed (%d open before and after)\n",
		       after);
	}
	close(fd);
	/* libep's low-latency calls on a host group: the host path (the
	 * daemon's ops; test_ll tests it whole), its arguments checked */
	{
		ep_conn_t *lc;
		ep_group_t *lg;
		TH_OK(ep_connect(d.sock, &lc));
		struct ep_group_config lcfg = th_group("llhost", 1, 0, 5000);
		TH_OK(ep_join(lc, &lcfg, 0, &lg));
		int64_t idx[4] = {0, 1, -1, 3}; /* th_group: top-4 of 4 */
		uint16_t x[256] = {0};
		struct ep_ll_recv lr;
		TH_EXPECT_RC(ep_ll_combine(lg, 0, x, NULL, x, 0, NULL),
			     EP_EINVAL); /* no dispatch yet */
		TH_OK(ep_ll_dispatch(lg, x, idx, 1, 0, NULL, &lr));
		TH_CHECK(lr.local_experts == 4 && lr.recv_count[0] == 1 &&
				 lr.recv_count[1] == 1 && lr.recv_count[2] == 0 &&
				 lr.recv_count[3] == 1,
			 "ll dispatch on a host group: %u experts, %d %d %d %d "
			 "rows",
			 lr.local_experts, lr.recv_count[0], lr.recv_count[1],
			 lr.recv_count[2], lr.recv_count[3]);
		TH_EXPECT_RC(ep_ll_combine(lg, lr.buffer, x, NULL, x, 0, NULL),
			     EP_EINVAL); /* no weights */
		TH_EXPECT_RC(ep_ll_dispatch(lg, x, idx, 1, 0x40, NULL, &lr),
			     EP_EINVAL);
		TH_CHECK(ep_ll_error(lg) == 0, "ll error on a host group");
		TH_OK(ep_leave(lg));
		ep_close(lc);
		printf("ok: ll calls on a host group: the host path, bad "
		       "arguments refused\n");
	}

	/* A client that sends requests and never reads the replies: dropped
	 * once its queued replies pass the bound; nobody else notices. */
	fd = raw_connect();
	{
		int small = 4096;
		setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
		uint8_t req[EPP_HDR_SIZE * 256];
		for (int i = 0; i < 256; i++) {
			struct epp_hdr h;
			epp_hdr_init(&h, EPP_STATUS, (uint64_t)(1000 + i));
			epp_hdr_encode(&h, req + i * EPP_HDR_SIZE);
		}
		long sent = 0;
		bool dropped = false;
		while (sent < 200000 && !dropped) {
			ssize_t k = send(fd, req, sizeof(req), MSG_NOSIGNAL);
			if (k < 0) {
				TH_CHECK(errno == EPIPE || errno == ECONNRESET,
					 "send: %s", strerror(errno));
				dropped = true;
			} else {
				TH_CHECK(k == (ssize_t)sizeof(req),
					 "short send");
				sent += 256;
			}
		}
		/* Drain: some replies, then the end of the connection. */
		long got = 0;
		uint8_t rb[65536];
		for (;;) {
			struct pollfd pf = {.fd = fd, .events = POLLIN};
			TH_CHECK(poll(&pf, 1, 10000) == 1,
				 "the daemon neither answered nor closed a "
				 "client that reads nothing");
			ssize_t k = read(fd, rb, sizeof(rb));
			if (k <= 0)
				break;
			got += k;
		}
		TH_CHECK(got < sent * 64,
			 "all %ld replies came (%ld bytes): never dropped", sent,
			 got);
		printf("ok: a client that reads nothing: dropped after %ld "
		       "requests (%ld bytes of replies reached it)\n",
		       sent, got);
		close(fd);
	}

	/* Garbage from many connections. */
	unsigned seed = 12345;
	for (int i = 0; i < 50; i++) {
		fd = raw_connect();
		uint8_t junk[200];
		for (size_t k = 0; k < sizeof(junk); k++)
			junk[k] = (uint8_t)(rand_r(&seed) >> 7);
		if (i % 2) { /* a valid header, junk payload */
			struct epp_hdr h;
			epp_hdr_init(&h, (uint16_t)(1 + i % 6), (uint64_t)i);
			h.length = 100;
			epp_hdr_encode(&h, junk);
		}
		raw_send(fd, junk, sizeof(junk));
		close(fd);
	}

	check_hoarder();
	check_client_name();
	check_queued_total();

	/* The bystanders never noticed. */
	uint64_t before = b->count[0];
	while (b->count[0] < before + 50)
		th_sleep_ms(1);
	b->stop = 1;
	TH_CHECK(th_wait_all(pids, 2, 30) == 0, "a bystander rank failed");
	printf("ok: bystander group ran %lu barriers undisturbed\n",
	       (unsigned long)b->count[0]);
	th_daemon_stop(&d);
	return 0;
}
