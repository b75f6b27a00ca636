/* SPDX-License-Identifier: MIT */
/* proto/: every header field and payload rule, round trips and rejections. */
#include "harness.h"
#include "epp.h"
#include "epp_rbuf.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void hdr_roundtrip(void)
{
	struct epp_hdr h, o;
	epp_hdr_init(&h, EPP_JOIN, 0x0102030405060708ull);
	h.flags = EPP_F_JOIN_NOWAIT;
	h.nfds = 1;
	h.length = 77;
	uint8_t b[EPP_HDR_SIZE];
	epp_hdr_encode(&h, b);
	/* little-endian on the wire, whatever the host */
	TH_CHECK(b[0] == 'E' && b[1] == 'P' && b[2] == 'D' && b[3] == '1',
		 "magic bytes");
	TH_CHECK(b[16] == 0x08 && b[23] == 0x01, "req_id byte order");
	TH_OK(epp_hdr_decode(b, &o, NULL, 0));
	TH_CHECK(!memcmp(&h, &o, sizeof(h)), "round trip");
}

static void hdr_rejects(void)
{
	struct epp_hdr h, o;
	uint8_t b[EPP_HDR_SIZE];
	char err[256];
#define REJECT(field, value, code, frag)                                       \
	do {                                                                   \
		epp_hdr_init(&h, EPP_STATUS, 1);                               \
		h.field = value;                                               \
		epp_hdr_encode(&h, b);                                         \
		TH_EXPECT_RC(epp_hdr_decode(b, &o, err, sizeof(err)), code);   \
		TH_CHECK(strstr(err, frag), "message '%s' lacks '%s'", err,    \
			 frag);                                                \
	} while (0)
	REJECT(magic, 0x31445046, EP_EPROTO, "bad magic");
	REJECT(ver_major, 2, EP_EVERSION, "protocol version 2.");
	REJECT(ver_major, 0, EP_EVERSION, "not supported");
	REJECT(length, EPP_MAX_PAYLOAD + 1, EP_EPROTO, "exceeds");
	REJECT(nfds, EPP_MAX_FDS + 1, EP_EPROTO, "descriptors");
	REJECT(flags, 0x8000, EP_EPROTO, "unknown flags");
	/* A newer minor version is accepted. */
	epp_hdr_init(&h, EPP_STATUS, 1);
	h.ver_minor = 200;
	h.length = EPP_MAX_PAYLOAD;
	epp_hdr_encode(&h, b);
	TH_OK(epp_hdr_decode(b, &o, err, sizeof(err)));
}

static struct epp_join good_join(void)
{
	struct epp_join j = {.world_size = 8, .ranks_per_node = 4, .rank = 5,
			     .num_experts = 256, .hidden = 7168,
			     .max_tokens = 4096, .topk = 8,
			     .dtype = EP_DTYPE_FP8, .timeout_ms = 100,
			     .recv_areas = 1};
	strcpy(j.name, "moe:0.layer-1_a");
	return j;
}

/* 1.12: receive areas, a host and a GPU join; one area is sent as none;
 * the count is bounded; one-node groups only; the layout holds them. */
static void join_areas(void)
{
	uint8_t b[256];
	char err[256];
	struct epp_join j = good_join(), o;
	j.ranks_per_node = 8;
	size_t n1 = epp_join_encode(&j, b, sizeof(b));
	for (int gpu = 0; gpu < 2; gpu++) {
		j.recv_areas = 3;
		if (gpu) {
			memset(j.gpu_uuid, 0xab, sizeof(j.gpu_uuid));
			j.rank_flags = EPP_RANK_MPS;
		}
		size_t n = epp_join_encode(&j, b, sizeof(b));
		TH_CHECK(n == n1 + 4 + (gpu ? 20 : 0), "areas sent: %zu", n);
		memset(&o, 0x5a, sizeof(o));
		memset(o.name, 0, sizeof(o.name));
		TH_OK(epp_join_decode(b, n, &o, err, sizeof(err)));
		uint8_t b2[256]; /* every field, by its encoding (padding) */
		TH_CHECK(epp_join_encode(&o, b2, sizeof(b2)) == n &&
				 !memcmp(b, b2, n) && o.recv_areas == 3 &&
				 !memcmp(o.gpu_uuid, j.gpu_uuid, 16),
			 "areas round trip");
		/* an explicit count of 1 (or 0) is not how one area is sent */
		for (uint32_t v = 0; v < 2; v++) {
			struct epp_wr w;
			epp_wr_init(&w, b + n - 4, 4);
			epp_put_u32(&w, v);
			TH_EXPECT_RC(epp_join_decode(b, n, &o, err,
						     sizeof(err)),
				     EP_EPROTO);
		}
		j.recv_areas = EPP_MAX_RECV_AREAS + 1;
		n = epp_join_encode(&j, b, sizeof(b));
		TH_EXPECT_RC(epp_join_decode(b, n, &o, err, sizeof(err)),
			     EP_EINVAL);
		TH_CHECK(strstr(err, "recv_areas 17"), "message '%s'", err);
	}
	j = good_join(); /* 8 ranks, 4 per node */
	j.recv_areas = 2;
	size_t n = epp_join_encode(&j, b, sizeof(b));
	TH_EXPECT_RC(epp_join_decode(b, n, &o, err, sizeof(err)),
		     EP_EUNSUPPORTED);
	TH_CHECK(strstr(err, "across nodes"), "message '%s'", err);
	/* the layout: area a lies a areas past the first, the fields
	 * after them past all of them */
	struct epp_buf one, three;
	j.ranks_per_node = 8;
	j.recv_areas = 1;
	TH_OK(epp_buf_layout(&j, &one));
	j.recv_areas = 3;
	TH_OK(epp_buf_layout(&j, &three));
	uint64_t area = (uint64_t)8 * 4096 * 7168;
	TH_CHECK(three.recv_areas == 3 && three.recv_area_bytes == area &&
			 one.recv_areas == 1 && one.recv_area_bytes == area,
		 "areas of the layout");
	TH_CHECK(epp_buf_recv_area(&three, 2) ==
			 three.off[EPP_BUF_RECV_X] + 2 * area,
		 "area 2's offset");
	TH_CHECK(three.off[EPP_BUF_RECV_SCALES] >=
			 three.off[EPP_BUF_RECV_X] + 3 * area,
		 "the field after the areas");
	TH_CHECK(three.rank_stride >= one.rank_stride + 2 * area,
		 "a region holds the areas");
}

/* 1.21: a join naming its nodes and its receive capacity; malformed
 * lists refused; the layout of a fixed capacity is the same size at any
 * world size. */
static void join_nodes_recv(void)
{
	uint8_t b[512];
	char err[256];
	struct epp_join j = good_join(), o;
	static const char names[] = "gpu-a\0gpu-b";
	j.nodes = names;
	j.num_nodes = 2;
	j.recv_rows = 9000;
	const uint16_t fl = epp_join_flags(&j);
	TH_CHECK(fl == (EPP_F_JOIN_NODES | EPP_F_JOIN_RECV), "flags 0x%x", fl);
	size_t n = epp_join_encode(&j, b, sizeof(b));
	TH_OK(epp_join_decode_flags(b, n, fl, &o, err, sizeof(err)));
	TH_CHECK(o.num_nodes == 2 && !strcmp(epp_join_node(&o, 0), "gpu-a") &&
			 !strcmp(epp_join_node(&o, 1), "gpu-b") &&
			 o.recv_rows == 9000 && o.world_size == 8,
		 "round trip");
	/* without the flags the same bytes are not a join */
	TH_CHECK(epp_join_decode_flags(b, n, 0, &o, err, sizeof(err)),
		 "read without its flags");
	/* a bad name, a name past the list's bytes, a count of 0 */
	static const char bad[] = "gpu a\0gpu-b";
	j.nodes = bad;
	n = epp_join_encode(&j, b, sizeof(b));
	TH_EXPECT_RC(epp_join_decode_flags(b, n, fl, &o, err, sizeof(err)),
		     EP_EPROTO);
	TH_CHECK(strstr(err, "node 0 of the group's list"), "'%s'", err);
	j.nodes = names;
	n = epp_join_encode(&j, b, sizeof(b));
	b[4] = 3; /* 3 names in the bytes of 2 */
	TH_EXPECT_RC(epp_join_decode_flags(b, n, fl, &o, err, sizeof(err)),
		     EP_EPROTO);
	b[4] = 0;
	TH_EXPECT_RC(epp_join_decode_flags(b, n, fl, &o, err, sizeof(err)),
		     EP_EPROTO);
	/* recv_rows past world x max_tokens */
	j.recv_rows = 8 * 4096 + 1;
	n = epp_join_encode(&j, b, sizeof(b));
	TH_EXPECT_RC(epp_join_decode_flags(b, n, fl, &o, err, sizeof(err)),
		     EP_EINVAL);
	TH_CHECK(strstr(err, "recv_rows 32769"), "'%s'", err);
	/* DeepSeek-V3's shape, 8192 rows a rank: a rank's region at world
	 * 8 and 256 differs by the rank prefix matrix alone (W^2 x 4
	 * bytes), where the worst case grows 32-fold */
	struct epp_buf l8, l256, w8, w256;
	struct epp_join d = good_join();
	d.dtype = EP_DTYPE_BF16;
	d.ranks_per_node = 1;
	d.num_experts = 256;
	d.recv_rows = 8192;
	d.world_size = 8;
	TH_OK(epp_buf_layout(&d, &l8));
	d.world_size = 256;
	TH_OK(epp_buf_layout(&d, &l256));
	d.recv_rows = 0;
	TH_OK(epp_buf_layout(&d, &w256));
	d.world_size = 8;
	TH_OK(epp_buf_layout(&d, &w8));
	TH_CHECK(l8.max_recv == 8192 && l256.max_recv == 8192, "max_recv");
	TH_CHECK(l256.rank_stride - l8.rank_stride <= (4u << 20),
		 "a rank's region grew from %llu to %llu bytes with the world",
		 (unsigned long long)l8.rank_stride,
		 (unsigned long long)l256.rank_stride);
	TH_CHECK(w256.rank_stride > 16 * w8.rank_stride,
		 "the worst case does grow with the world");
	printf("ok: a rank's region at recv_rows 8192 (DeepSeek-V3 shape): "
	       "%.2f GB at world 8, %.2f GB at 256 (worst case: %.2f and "
	       "%.2f GB)\n",
	       l8.rank_stride / 1e9, l256.rank_stride / 1e9,
	       w8.rank_stride / 1e9, w256.rank_stride / 1e9);
}

static void join_codec(void)
{
	uint8_t b[256];
	char err[256];
	struct epp_join j = good_join(), o;
	size_t n = epp_join_encode(&j, b, sizeof(b));
	TH_CHECK(n > 0, "encode");
	memset(&o, 0x5a, sizeof(o));
	memset(o.name, 0, sizeof(o.name));
	TH_OK(epp_join_decode(b, n, &o, err, sizeof(err)));
	/* every field, by its encoding (the struct has padding) */
	uint8_t b2[256];
	TH_CHECK(epp_join_encode(&o, b2, sizeof(b2)) == n && !memcmp(b, b2, n) &&
			 !strcmp(o.name, j.name) && o.link == 0,
		 "round trip");
	/* linked (1.16): the id is the last 8 bytes, with the flag */
	j.link = 0x1122334455667788ull;
	size_t ln = epp_join_encode(&j, b2, sizeof(b2));
	TH_CHECK(ln == n + 8, "a linked join is 8 bytes longer");
	TH_OK(epp_join_decode_flags(b2, ln, EPP_F_JOIN_LINK, &o, err,
				    sizeof(err)));
	TH_CHECK(o.link == j.link && o.world_size == j.world_size,
		 "linked round trip");
	TH_EXPECT_RC(epp_join_decode(b2, ln, &o, err, sizeof(err)),
		     EP_EPROTO); /* without the flag: 8 bytes too many */
	TH_EXPECT_RC(epp_join_decode_flags(b, n, EPP_F_JOIN_LINK, &o, err,
					   sizeof(err)),
		     EP_EPROTO); /* the flag, no id: the tail is eaten */
	j.link = 0;
	/* Every prefix is malformed, and so is one extra byte. */
	for (size_t k = 0; k < n; k++)
		TH_EXPECT_RC(epp_join_decode(b, k, &o, err, sizeof(err)),
			     EP_EPROTO);
	b[n] = 0;
	TH_EXPECT_RC(epp_join_decode(b, n + 1, &o, err, sizeof(err)),
		     EP_EPROTO);
	/* Field rules. */
#define BAD(stmt, frag)                                                        \
	do {                                                                   \
		j = good_join();                                               \
		stmt;                                                          \
		n = epp_join_encode(&j, b, sizeof(b));                         \
		TH_EXPECT_RC(epp_join_decode(b, n, &o, err, sizeof(err)),      \
			     EP_EINVAL);                                       \
		TH_CHECK(strstr(err, frag), "%s: message '%s'", #stmt, err);   \
	} while (0)
	BAD(strcpy(j.name, ""), "group name");
	BAD(strcpy(j.name, "a b"), "group name");
	BAD(strcpy(j.name, "a/b"), "group name");
	BAD(j.world_size = 0, "world_size 0");
	BAD(j.world_size = 2000, "world_size 2000");
	BAD(j.ranks_per_node = 3, "does not divide");
	BAD(j.ranks_per_node = 0, "ranks_per_node 0");
	BAD(j.rank = 8, "rank 8 out of range");
	BAD(j.num_experts = 100, "multiple of world_size");
	BAD(j.num_experts = 0, "num_experts 0");
	BAD(j.hidden = 100, "multiple of 128");
	BAD(j.hidden = 0, "hidden 0");
	BAD(j.max_tokens = 1u << 20, "max_tokens_per_rank");
	BAD(j.topk = 0, "topk 0");
	BAD(j.topk = 33, "topk 33");
	BAD(j.dtype = 3, "unknown dtype 3");
	BAD(j.timeout_ms = 4000000, "timeout_ms");
	/* A name with an embedded NUL or longer than the field. */
	j = good_join();
	n = epp_join_encode(&j, b, sizeof(b));
	b[2 + 3] = 0;
	TH_EXPECT_RC(epp_join_decode(b, n, &o, err, sizeof(err)), EP_EPROTO);
	struct epp_wr w;
	epp_wr_init(&w, b, sizeof(b));
	char longname[100];
	memset(longname, 'a', 99);
	longname[99] = 0;
	epp_put_str(&w, longname);
	TH_EXPECT_RC(epp_join_decode(b, w.off + 40, &o, err, sizeof(err)),
		     EP_EPROTO);
}

static void other_codecs(void)
{
	uint8_t b[2048];
	struct epp_join_ok jo = {.group_id = 42, .epoch = 7, .node_index = 1,
				 .buf_size = 1ull << 40, .ready = 1},
			   jo2;
	size_t n = epp_join_ok_encode(&jo, b, sizeof(b));
	TH_OK(epp_join_ok_decode(b, n, &jo2));
	/* field by field: the struct has padding after ready */
	TH_CHECK(jo2.group_id == jo.group_id && jo2.epoch == jo.epoch &&
			 jo2.node_index == jo.node_index &&
			 jo2.buf_size == jo.buf_size && jo2.ready == jo.ready &&
			 jo2.dev_size == jo.dev_size,
		 "join_ok round trip");
	TH_EXPECT_RC(epp_join_ok_decode(b, n - 1, &jo2), EP_EPROTO);

	int code;
	char msg[EPP_ERRMSG_MAX];
	n = epp_error_encode(EP_EPEERLOST, "rank 3 died", b, sizeof(b));
	TH_OK(epp_error_decode(b, n, &code, msg, sizeof(msg)));
	TH_CHECK(code == EP_EPEERLOST && !strcmp(msg, "rank 3 died"), "error");
	/* a non-negative code is not an error */
	n = epp_error_encode(5, "x", b, sizeof(b));
	TH_EXPECT_RC(epp_error_decode(b, n, &code, msg, sizeof(msg)),
		     EP_EPROTO);
	/* an over-long message is cut, not overflowed */
	char big[3000];
	memset(big, 'x', sizeof(big) - 1);
	big[sizeof(big) - 1] = 0;
	n = epp_error_encode(EP_EINVAL, big, b, sizeof(b));
	TH_OK(epp_error_decode(b, n, &code, msg, sizeof(msg)));
	TH_CHECK(strlen(msg) == EPP_ERRMSG_MAX - 1, "message length %zu",
		 strlen(msg));
	/* the writer refuses to overflow */
	struct epp_wr w;
	epp_wr_init(&w, b, 3);
	epp_put_u32(&w, 1);
	TH_CHECK(w.err && w.off == 0, "writer overflow");
	/* LL_MAP and its reply; a short or long payload is refused */
	struct epp_ll_map lm = {.group_id = 77, .local = 5}, lm2;
	size_t ln = epp_ll_map_encode(&lm, b, sizeof(b));
	TH_CHECK(ln == 12 && !epp_ll_map_decode(b, ln, &lm2) &&
			 lm2.group_id == 77 && lm2.local == 5,
		 "ll-map round trip");
	TH_CHECK(epp_ll_map_decode(b, ln - 1, &lm2) &&
			 epp_ll_map_decode(b, ln + 1, &lm2),
		 "ll-map of a wrong length accepted");
	struct epp_ll_map_ok lo = {.size = 1ull << 33, .local = 3, .gpu = 2},
			     lo2;
	ln = epp_ll_map_ok_encode(&lo, b, sizeof(b));
	TH_CHECK(ln == 16 && !epp_ll_map_ok_decode(b, ln, &lo2) &&
			 lo2.size == lo.size && lo2.local == 3 && lo2.gpu == 2,
		 "ll-map reply round trip");
	TH_CHECK(epp_ll_map_ok_decode(b, ln - 4, &lo2), "short ll-map reply");

	TH_CHECK(strcmp(ep_strerror(EP_EPEERLOST), "unknown error"),
		 "strerror of a private code");
	TH_CHECK(!strcmp(ep_strerror(-ETIMEDOUT), strerror(ETIMEDOUT)),
		 "strerror of an errno code");
	TH_CHECK(!strcmp(ep_strerror(-5000), "unknown error"), "unknown");
}

/* COMBINE's registered places (1.13 rows in, 1.14 rows out): each tail
 * only with its flag, in that order; a frame cut short anywhere in them is
 * refused. */
static void combine_places(void)
{
	uint8_t b[256];
	const struct epp_combine base = {
		.group_id = 9, .handle = {.group_id = 9, .epoch = 2, .seq = 77},
		.num_rows = 5, .hidden = 128, .flags = EPP_COMBINE_BIAS};
	size_t plain = epp_combine_encode(&base, b, sizeof(b));
	TH_CHECK(plain > 0, "plain combine encodes");
	for (int v = 0; v < 4; v++) {
		struct epp_combine c = base, d;
		memset(&d, 0xa5, sizeof(d));
		if (v & 1) {
			c.flags |= EPP_COMBINE_YREG;
			c.reg = 3;
			c.reg_off = 0x123456789abcull;
		}
		if (v & 2) {
			c.flags |= EPP_COMBINE_OUTREG;
			c.out_reg = 4;
			c.out_rows = 17;
			c.out_off = 0xfedcba98ull;
		}
		size_t n = epp_combine_encode(&c, b, sizeof(b));
		TH_CHECK(n == plain + (v & 1 ? 12 : 0) + (v & 2 ? 16 : 0),
			 "variant %d: %zu bytes", v, n);
		TH_OK(epp_combine_decode(b, n, &d));
		TH_CHECK(d.flags == c.flags && d.num_rows == c.num_rows &&
				 d.reg == (v & 1 ? 3u : 0u) &&
				 d.reg_off == (v & 1 ? c.reg_off : 0) &&
				 d.out_reg == (v & 2 ? 4u : 0u) &&
				 d.out_rows == (v & 2 ? 17u : 0u) &&
				 d.out_off == (v & 2 ? c.out_off : 0),
			 "variant %d round trip", v);
		for (size_t cut = plain; cut < n; cut++)
			TH_CHECK(epp_combine_decode(b, cut, &d),
				 "variant %d cut to %zu bytes accepted", v,
				 cut);
		TH_CHECK(epp_combine_decode(b, n + 1, &d),
			 "variant %d with a trailing byte accepted", v);
	}
}

/* Frames with descriptors over a socketpair, and the fd count check. */
static void frames_with_fds(void)
{
	int sv[2];
	TH_CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
	struct epp_hdr h, o;
	epp_hdr_init(&h, EPP_OK, 9);
	h.length = 5;
	h.nfds = 1;
	int fd = dup(1);
	TH_OK(epp_send_frame(sv[0], &h, "hello", &fd));
	close(fd);
	uint8_t *p;
	int fds[EPP_MAX_FDS];
	TH_OK(epp_recv_frame(sv[1], &o, &p, fds, 1000, NULL, 0));
	TH_CHECK(o.req_id == 9 && !memcmp(p, "hello", 5), "frame");
	TH_CHECK(fcntl(fds[0], F_GETFD) >= 0, "descriptor arrived");
	close(fds[0]);
	free(p);
	/* announce one descriptor, send none */
	TH_OK(epp_send_frame(sv[0], &h, "hello", NULL));
	char err[128];
	TH_EXPECT_RC(epp_recv_frame(sv[1], &o, &p, fds, 1000, err,
				    sizeof(err)),
		     EP_EPROTO);
	TH_CHECK(strstr(err, "announced 1"), "%s", err);
	/* nothing to read: timeout */
	TH_EXPECT_RC(epp_recv_frame(sv[1], &o, &p, fds, 50, NULL, 0),
		     EP_ETIMEDOUT);
	close(sv[0]);
	TH_EXPECT_RC(epp_recv_frame(sv[1], &o, &p, fds, 1000, NULL, 0),
		     EP_ECONNRESET);
	close(sv[1]);
}

/* The stream buffer and the framing loop (epp_rbuf.h). */
struct seen {
	int n, stop_at;
	uint16_t type[8];
	uint8_t first[8];
};

static int on_frame(void *arg, const struct epp_hdr *h, const uint8_t *f)
{
	struct seen *s = arg;
	s->type[s->n] = h->type;
	s->first[s->n] = h->length ? f[EPP_HDR_SIZE] : 0;
	s->n++;
	return s->n == s->stop_at ? 7 : 0;
}

static void put_frame(struct epp_rbuf *b, uint16_t type, uint8_t fill,
		      uint32_t len, size_t trailer)
{
	uint8_t hb[EPP_HDR_SIZE], body[256], tag[16];
	struct epp_hdr h;
	epp_hdr_init(&h, type, 1);
	h.length = len;
	epp_hdr_encode(&h, hb);
	memset(body, fill, sizeof(body));
	memset(tag, 0xee, sizeof(tag));
	TH_OK(epp_rbuf_put(b, hb, sizeof(hb)));
	TH_OK(epp_rbuf_put(b, body, len));
	TH_OK(epp_rbuf_put(b, tag, trailer));
}

static void rbuf_frames(void)
{
	struct epp_rbuf b = {0};
	struct epp_hdr h;
	char err[128];
	size_t want;
	/* three frames with 16-byte trailers, the last one incomplete */
	put_frame(&b, EPP_STATUS, 0x11, 5, 16);
	put_frame(&b, EPP_BARRIER, 0x22, 200, 16);
	put_frame(&b, EPP_LEAVE, 0x33, 9, 16);
	b.len -= 4;
	struct seen s = {0};
	TH_OK(epp_frames(&b, 16, on_frame, &s, &h, err, sizeof(err), &want));
	TH_CHECK(s.n == 2 && s.type[0] == EPP_STATUS && s.first[0] == 0x11 &&
			 s.type[1] == EPP_BARRIER && s.first[1] == 0x22,
		 "frames seen: %d", s.n);
	TH_CHECK(want == EPP_HDR_SIZE + 9 + 16, "want %zu", want);
	TH_CHECK(epp_rbuf_live(&b) == want - 4, "live %zu", epp_rbuf_live(&b));
	/* more room than is left at the end: the live bytes move to the
	 * front, the buffer does not grow */
	size_t cap = b.cap;
	TH_CHECK(b.off > 0, "frames were taken off the front");
	TH_OK(epp_rbuf_room(&b, b.cap - b.len + 1, 0));
	TH_CHECK(b.off == 0 && b.cap == cap, "compacted, cap %zu -> %zu", cap,
		 b.cap);
	memset(b.p + b.len, 0xee, 4);
	b.len += 4;
	TH_OK(epp_frames(&b, 16, on_frame, &s, &h, err, sizeof(err), &want));
	TH_CHECK(s.n == 3 && s.first[2] == 0x33 && want == 0 &&
			 epp_rbuf_live(&b) == 0,
		 "the third frame, nothing left");
	/* a stop from the callback: that frame is taken, the next stays */
	put_frame(&b, EPP_STATUS, 1, 3, 0);
	put_frame(&b, EPP_STATUS, 2, 3, 0);
	struct seen t = {.stop_at = 1};
	TH_CHECK(epp_frames(&b, 0, on_frame, &t, &h, err, sizeof(err),
			    NULL) == 7 &&
			 t.n == 1 && epp_rbuf_live(&b) == EPP_HDR_SIZE + 3,
		 "stopped after one frame");
	/* garbage: the header's error, nothing taken */
	memset(b.p + b.off, 'x', EPP_HDR_SIZE);
	TH_EXPECT_RC(epp_frames(&b, 0, on_frame, &t, &h, err, sizeof(err),
				NULL),
		     EP_EPROTO);
	TH_CHECK(strstr(err, "bad magic") && t.n == 1 &&
			 epp_rbuf_live(&b) == EPP_HDR_SIZE + 3,
		 "garbage refused: %s", err);
	/* a large buffer shrinks back once drained */
	epp_rbuf_take(&b, epp_rbuf_live(&b));
	TH_OK(epp_rbuf_room(&b, 1 << 20, 0));
	size_t big = b.cap;
	epp_rbuf_shrink(&b, 65536, 4096);
	TH_CHECK(big >= (1 << 20) && b.cap == 4096, "cap %zu -> %zu", big,
		 b.cap);
	epp_rbuf_free(&b);
	TH_CHECK(!b.p && !b.cap, "freed");
}

/* 1.22: entries of a join's node list, name or name@host:port */
static void node_entries(void)
{
	char longhost[128];
	memset(longhost, 'h', sizeof(longhost));
	snprintf(longhost, sizeof(longhost), "n@%.*s:1", EPP_NODE_HOST_MAX + 1,
		 "hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh"
		 "hhhhhhhhhhhhhhhhhhhh");
	const char *good[] = {"n1", "n1@127.0.0.1:7101", "n1@[::1]:7101",
			      "gpu-node-07@gpu-node-07.example:65535",
			      "a@b:1"};
	const char *bad[] = {"", "n1@", "n1@:7", "n1@h:0", "n1@h:65536",
			     "n1@h:7x", "@h:1", "n 1@h:1", "n1@h h:1",
			     "n1@h:", "n1@h:123456", longhost};
	for (size_t i = 0; i < sizeof(good) / sizeof(*good); i++)
		TH_CHECK(epp_node_entry_valid(good[i]), "refused '%s'",
			 good[i]);
	for (size_t i = 0; i < sizeof(bad) / sizeof(*bad); i++)
		TH_CHECK(!epp_node_entry_valid(bad[i]), "took '%s'", bad[i]);
}

int main(void)
{
	th_init("proto", 30);
	node_entries();
	hdr_roundtrip();
	hdr_rejects();
	join_codec();
	join_areas();
	join_nodes_recv();
	other_codecs();
	combine_places();
	frames_with_fds();
	rbuf_frames();
	printf("ok: proto\n");
	return 0;
}
