/* SPDX-License-Identifier: MIT */
/*
 * Fuzz target for the daemon-to-daemon decoders (proto/epp_peer.h): every
 * peer frame's payload. Built with libFuzzer (clang -fsanitize=fuzzer
 * -DEPP_LIBFUZZER) it is a coverage-guided fuzzer; in `make check` a driver
 * feeds it mutations of valid frames and random bytes. A decoder either
 * rejects its input or returns values within their rules: strings
 * terminated inside their arrays, bodies inside the input, counts that fit
 * the bytes there are, and what decodes re-encodes to the same bytes.
 */
#include "epp_peer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void must(int cond, const char *what)
{
	if (!cond) {
		fprintf(stderr, "fuzz_peer: invariant broken: %s\n", what);
		abort();
	}
}

static int inside(const uint8_t *p, size_t n, const uint8_t *data,
		  size_t size)
{
	return p >= data && p + n <= data + size;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	uint8_t b[EPP_ERRMSG_MAX + 512];
	size_t n;
	struct epp_peer_hello he;
	if (epp_peer_hello_decode(data, size, &he) == 0) {
		must(memchr(he.node, 0, sizeof(he.node)) != NULL, "hello name");
		n = epp_peer_hello_encode(&he, b, sizeof(b));
		must(n == size && !memcmp(b, data, n), "hello re-encode");
	}
	struct epp_peer_heartbeat hb;
	if (epp_peer_heartbeat_decode(data, size, &hb) == 0) {
		must(memchr(hb.row, 0, sizeof(hb.row)) != NULL, "row");
		n = epp_peer_heartbeat_encode(&hb, b, sizeof(b));
		must(n == size && !memcmp(b, data, n), "heartbeat re-encode");
	}
	struct epp_peer_barrier ba;
	if (epp_peer_barrier_decode(data, size, &ba) == 0) {
		must(memchr(ba.group, 0, sizeof(ba.group)) != NULL, "group");
		n = epp_peer_barrier_encode(&ba, b, sizeof(b));
		must(n == size && !memcmp(b, data, n), "barrier re-encode");
	}
	struct epp_peer_gfail gf;
	if (epp_peer_gfail_decode(data, size, &gf) == 0) {
		must(gf.code < 0, "failure code");
		must(memchr(gf.msg, 0, sizeof(gf.msg)) != NULL, "message");
		n = epp_peer_gfail_encode(&gf, b, sizeof(b));
		must(n == size && !memcmp(b, data, n), "gfail re-encode");
	}
	struct epp_peer_op op;
	if (epp_peer_op_decode(data, size, &op) == 0) {
		must(memchr(op.group, 0, sizeof(op.group)) != NULL, "op group");
		must(inside(op.body, op.body_len, data, size), "op body");
		struct epp_peer_xmeta xm;
		if (epp_peer_xmeta_decode(&op, &xm) == 0) {
			must(inside(xm.data, xm.data_len, data, size),
			     "xmeta data");
			must(!(xm.flags & ~(EPP_DISPATCH_WEIGHTS |
					    EPP_DISPATCH_CACHED |
					    EPP_DISPATCH_TOOBIG)),
			     "xmeta flags");
		}
		/* rows of the sizes a group can have */
		const size_t recs[] = {8 + 256, 8 + 14336, 8};
		for (int i = 0; i < 3; i++) {
			struct epp_peer_xrows xr;
			if (epp_peer_xrows_decode(&op, recs[i], &xr) == 0) {
				must(xr.type == EPP_DISPATCH ||
					     xr.type == EPP_COMBINE ||
					     xr.type == (EPP_COMBINE |
							 EPP_XROWS_WEIGHTS),
				     "xrows type");
				must(inside(xr.recs, (size_t)xr.count * recs[i],
					    data, size),
				     "xrows records");
			}
		}
		uint32_t sh[EPP_PEER_SHAPE_N];
		uint64_t nh;
		uint32_t rr;
		if (epp_peer_shape_decode(&op, sh, &nh, &rr) == 0)
			must(op.body_len == 4u * EPP_PEER_SHAPE_N + (nh ? 8u : 0u) +
						   (rr ? 4u : 0u),
			     "shape");
		struct epp_peer_xwin xw;
		if (epp_peer_xwin_decode(&op, &xw) == 0) {
			must(xw.n <= EPP_MAX_WORLD, "windows");
			for (uint32_t i = 0; i < xw.n; i++) {
				struct epp_peer_window e;
				epp_peer_xwin_get(&xw, i, &e);
			}
			must(inside(xw.ent, (size_t)xw.n * 20, data, size),
			     "window entries");
		}
	}
	return 0;
}

#ifndef EPP_LIBFUZZER
#include "fuzz_driver.h"

int main(int argc, char **argv)
{
	long iters = argc > 1 ? atol(argv[1]) : 200000;
	enum { NS = 7 };
	static uint8_t seeds[NS][1024];
	size_t len[NS];
	struct epp_peer_hello he = {.major = 1, .minor = 7, .index = 2};
	strcpy(he.node, "node-2");
	memset(he.nonce, 0xa5, sizeof(he.nonce));
	len[0] = epp_peer_hello_encode(&he, seeds[0], sizeof(seeds[0]));
	struct epp_peer_heartbeat hb = {.epoch = 9};
	strcpy(hb.row, "USU");
	len[1] = epp_peer_heartbeat_encode(&hb, seeds[1], sizeof(seeds[1]));
	struct epp_peer_barrier ba = {.local = 3, .seq = 77, .xops = 12,
				      .step = 2};
	strcpy(ba.group, "moe~1000");
	len[2] = epp_peer_barrier_encode(&ba, seeds[2], sizeof(seeds[2]));
	struct epp_peer_gfail gf = {.code = EP_EPEERLOST, .round = 4,
				    .xops = 5};
	strcpy(gf.group, "moe");
	strcpy(gf.msg, "rank 3 left");
	len[3] = epp_peer_gfail_encode(&gf, seeds[3], sizeof(seeds[3]));
	struct epp_wr w;
	/* XMETA: 2 tokens x top-2, with weights */
	epp_wr_init(&w, seeds[4], sizeof(seeds[4]));
	epp_peer_put_op(&w, "moe", 12);
	epp_put_u32(&w, 5);
	epp_put_u32(&w, 2);
	epp_put_u32(&w, EPP_DISPATCH_WEIGHTS);
	for (int i = 0; i < 4; i++)
		epp_put_u64(&w, (uint64_t)i);
	for (int i = 0; i < 4; i++)
		epp_put_u32(&w, 0x3f800000u);
	len[4] = w.off;
	/* XROWS: 3 records of 8 bytes (rows of zero bytes) */
	epp_wr_init(&w, seeds[5], sizeof(seeds[5]));
	epp_peer_put_op(&w, "moe", 13);
	epp_peer_put_xrows(&w, EPP_COMBINE, 12, 3);
	for (int i = 0; i < 6; i++)
		epp_put_u32(&w, (uint32_t)i);
	len[5] = w.off;
	/* XWIN: 2 windows */
	epp_wr_init(&w, seeds[6], sizeof(seeds[6]));
	epp_peer_put_op(&w, "moe", 0);
	epp_put_u16(&w, 3);
	epp_put_u32(&w, 2);
	for (int i = 0; i < 2; i++) {
		struct epp_peer_window e = {.addr = 4096u * (unsigned)i,
					    .rkey = 7, .len = 1 << 20};
		epp_peer_put_window(&w, &e);
	}
	len[6] = w.off;
	static uint8_t buf[1200];
	const uint8_t *sp[NS];
	for (int i = 0; i < NS; i++)
		sp[i] = seeds[i];
	fuzz_drive(iters, 0x2545f4914f6cdd1dull, sp, len, NS, 5, buf,
		   sizeof(buf));
	printf("ok: %ld peer fuzz inputs, every decoder held its rules\n",
	       iters);
	return 0;
}
#endif
