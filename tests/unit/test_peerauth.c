/* SPDX-License-Identifier: MIT */
/* daemon/peerauth.c: the rdma connect request's private data. Made by one
 * node and checked by another of the same cluster it passes; every field
 * changed, and another key, make the check fail with its reason. */
#include "harness.h"
#include "peerauth.h"

#include <sodium.h>
#include <string.h>

static void expect(const char *got, const char *frag, const char *what)
{
	TH_CHECK(got && strstr(got, frag), "%s: got '%s', want '%s'", what,
		 got ? got : "(accepted)", frag);
}

int main(void)
{
	th_init("unit: rdma connect data between daemons", 30);
	TH_CHECK(sodium_init() >= 0, "libsodium");
	uint8_t key[32], other[32], id[8], oid[8];
	randombytes_buf(key, sizeof(key));
	memcpy(other, key, sizeof(key));
	other[31] ^= 1;
	epd_cluster_id(key, id);
	epd_cluster_id(other, oid);
	TH_CHECK(memcmp(id, oid, 8), "two keys, one cluster id");
	uint8_t again[8];
	epd_cluster_id(key, again);
	TH_CHECK(!memcmp(id, again, 8), "the cluster id is not a function of "
					"the key");

	uint8_t p[64];
	size_t n = epd_pdata_make(key, id, 2, p);
	TH_CHECK(n == EPD_PDATA_LEN && n <= 56, "length %zu", n);
	uint32_t idx = 99;
	TH_CHECK(!epd_pdata_check(key, id, 4, 0, p, n, &idx) && idx == 2,
		 "node 2's data refused by node 0");
	printf("ok: node 2's connect data passes node 0's check\n");

	uint8_t q[64];
	memcpy(q, p, n);
	expect(epd_pdata_check(key, id, 4, 0, q, n - 1, &idx), "no epd",
	       "short");
	q[0] ^= 0xff;
	expect(epd_pdata_check(key, id, 4, 0, q, n, &idx), "no epd", "magic");
	memcpy(q, p, n);
	q[4] ^= 0x01;
	expect(epd_pdata_check(key, id, 4, 0, q, n, &idx), "major version",
	       "version");
	memcpy(q, p, n);
	expect(epd_pdata_check(other, oid, 4, 0, q, n, &idx), "another cluster",
	       "cluster id");
	/* same id (forged), other key: the proof fails */
	expect(epd_pdata_check(other, id, 4, 0, q, n, &idx), "wrong proof",
	       "key");
	expect(epd_pdata_check(key, id, 2, 0, q, n, &idx), "unknown node",
	       "index past the cluster");
	expect(epd_pdata_check(key, id, 4, 2, q, n, &idx), "unknown node",
	       "own index");
	/* another index with node 2's proof */
	q[16] = 3;
	expect(epd_pdata_check(key, id, 4, 0, q, n, &idx), "wrong proof",
	       "index swapped");
	memcpy(q, p, n);
	q[30] ^= 0x40;
	expect(epd_pdata_check(key, id, 4, 0, q, n, &idx), "wrong proof",
	       "proof bit");
	printf("ok: short, magic, version, cluster id, key, index and proof "
	       "changes are each refused with their reason\n");
	return 0;
}
