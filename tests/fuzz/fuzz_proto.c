/* SPDX-License-Identifier: MIT */
/*
 * Fuzz target for every decoder that reads bytes from outside: the frame
 * header and each payload. Built with libFuzzer (clang -fsanitize=fuzzer
 * -DEPP_LIBFUZZER) it is a coverage-guided fuzzer; in `make check` a driver
 * feeds it mutations of valid frames and random bytes, and checks that each
 * decoder either rejects the input or returns values within their rules.
 */
#include "epp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void must(int cond, const char *what)
{
	if (!cond) {
		fprintf(stderr, "fuzz: invariant broken: %s\n", what);
		abort();
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char err[256];
	if (size >= EPP_HDR_SIZE) {
		struct epp_hdr h;
		if (epp_hdr_decode(data, &h, err, sizeof(err)) == 0) {
			must(h.magic == EPP_MAGIC, "magic");
			must(h.ver_major == EPP_VERSION_MAJOR, "major");
			must(h.length <= EPP_MAX_PAYLOAD, "length");
			must(h.nfds <= EPP_MAX_FDS, "nfds");
			must(!(h.flags & ~EPP_F_ALL), "flags");
		}
	}
	struct epp_join j;
	if (epp_join_decode(data, size, &j, err, sizeof(err)) == 0) {
		must(epp_group_name_valid(j.name), "group name");
		must(j.world_size && j.world_size % j.ranks_per_node == 0,
		     "world");
		must(j.rank < j.world_size, "rank");
		must(j.num_experts % j.world_size == 0, "experts");
		must(j.hidden % 128 == 0 && j.hidden, "hidden");
		must(j.topk >= 1 && j.topk <= 32, "topk");
		/* re-encoding gives the same bytes */
		uint8_t b[256];
		size_t n = epp_join_encode(&j, b, sizeof(b));
		must(n == size && !memcmp(b, data, n), "join re-encode");
	}
	/* the same bytes as a JOIN linked to a group: its last 8 bytes */
	if (epp_join_decode_flags(data, size, EPP_F_JOIN_LINK, &j, err,
				  sizeof(err)) == 0) {
		must(j.link != 0 && size >= 8, "join link");
		uint8_t b[256];
		size_t n = epp_join_encode(&j, b, sizeof(b));
		must(n == size && !memcmp(b, data, n), "linked join re-encode");
	}
	struct epp_join_ok jo;
	(void)epp_join_ok_decode(data, size, &jo);
	/* fixed-size op payloads: a decode that succeeds consumed exactly
	 * the bytes, and re-encodes to them */
	uint8_t b2[128];
	struct epp_dispatch d;
	if (epp_dispatch_decode(data, size, &d) == 0)
		must(epp_dispatch_encode(&d, b2, sizeof(b2)) == size &&
			     !memcmp(b2, data, size),
		     "dispatch re-encode");
	struct epp_combine cb;
	if (epp_combine_decode(data, size, &cb) == 0)
		must(epp_combine_encode(&cb, b2, sizeof(b2)) == size &&
			     !memcmp(b2, data, size),
		     "combine re-encode");
	struct epp_release rl;
	if (epp_release_decode(data, size, &rl) == 0)
		must(epp_release_encode(&rl, b2, sizeof(b2)) == size &&
			     !memcmp(b2, data, size),
		     "release re-encode");
	struct epp_hello_ok ho;
	if (epp_hello_ok_decode(data, size, &ho) == 0)
		must(strlen(ho.daemon_version) < sizeof(ho.daemon_version),
		     "hello version");
	int code;
	char msg[EPP_ERRMSG_MAX];
	if (epp_error_decode(data, size, &code, msg, sizeof(msg)) == 0)
		must(code < 0 && strlen(msg) < sizeof(msg), "error");
	return 0;
}

#ifndef EPP_LIBFUZZER
#include "fuzz_driver.h"

int main(int argc, char **argv)
{
	long iters = argc > 1 ? atol(argv[1]) : 200000;
	uint8_t seeds[6][512];
	size_t seedlen[6];
	struct epp_join j = {.world_size = 8, .ranks_per_node = 8, .rank = 3,
			     .num_experts = 64, .hidden = 1024,
			     .max_tokens = 128, .topk = 4, .dtype = 1};
	strcpy(j.name, "fuzz");
	seedlen[0] = epp_join_encode(&j, seeds[0], sizeof(seeds[0]));
	struct epp_hdr h;
	epp_hdr_init(&h, EPP_JOIN, 1);
	h.length = 40;
	epp_hdr_encode(&h, seeds[1]);
	seedlen[1] = EPP_HDR_SIZE;
	seedlen[2] = epp_error_encode(EP_EINVAL, "bad", seeds[2], 512);
	struct epp_hello_ok ho = {.major = 1, .client_id = 5};
	strcpy(ho.daemon_version, "0.1.0");
	strcpy(ho.backend, "host");
	seedlen[3] = epp_hello_ok_encode(&ho, seeds[3], 512);
	struct epp_dispatch d = {.group_id = 3, .num_tokens = 7, .hidden = 256,
				 .dtype = 1, .topk = 2,
				 .flags = EPP_DISPATCH_CACHED,
				 .handle = {.group_id = 3, .epoch = 1, .seq = 9}};
	seedlen[4] = epp_dispatch_encode(&d, seeds[4], 512);
	struct epp_release rl = {.group_id = 3,
				 .handle = {.group_id = 3, .epoch = 1, .seq = 9}};
	seedlen[5] = epp_release_encode(&rl, seeds[5], 512);
	uint8_t buf[600];
	const uint8_t *sp[6] = {seeds[0], seeds[1], seeds[2],
				seeds[3], seeds[4], seeds[5]};
	fuzz_drive(iters, 0x9e3779b97f4a7c15ull, sp, seedlen, 6, 4, buf,
		   sizeof(buf));
	printf("ok: %ld fuzz inputs, every decoder held its rules\n", iters);
	return 0;
}
#endif
