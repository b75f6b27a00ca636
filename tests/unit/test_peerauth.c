/* SPDX-License-Identifier: MIT */
/* daemon/cluster/peerauth.c: the rdma connect request's private data. Made by one
 * node and checked by another of the same cluster it passes; every field
 * changed, and another key, make the check fail with its reason. */
#include "harness.h"
#include "cluster/peerauth.h"

#include <sodium.h>
#include <string.h>
#include <sys/uio.h>

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

	/* The handshake's proof depends on every input: both names, both
	 * nonces (and their order: the direction) and the key. */
	uint8_t n1[EPD_NONCE], n2[EPD_NONCE], pr[EPD_PROOF], x[EPD_PROOF];
	randombytes_buf(n1, sizeof(n1));
	randombytes_buf(n2, sizeof(n2));
	epd_peer_proof(key, "a", "b", n1, n2, pr);
	epd_peer_proof(key, "a", "b", n1, n2, x);
	TH_CHECK(!memcmp(pr, x, EPD_PROOF), "the proof is not a function");
	epd_peer_proof(key, "a", "c", n1, n2, x);
	TH_CHECK(memcmp(pr, x, EPD_PROOF), "the receiver's name is not bound");
	epd_peer_proof(key, "b", "a", n1, n2, x);
	TH_CHECK(memcmp(pr, x, EPD_PROOF), "the direction is not bound");
	epd_peer_proof(key, "a", "b", n2, n1, x);
	TH_CHECK(memcmp(pr, x, EPD_PROOF), "the nonces' order is not bound");
	epd_peer_proof(key, "ab", "", n1, n2, x);
	TH_CHECK(memcmp(pr, x, EPD_PROOF), "names are not length-prefixed");
	epd_peer_proof(other, "a", "b", n1, n2, x);
	TH_CHECK(memcmp(pr, x, EPD_PROOF), "the key is not bound");
	uint8_t ka[32], kb[32];
	epd_peer_key(key, "a", "b", n1, n2, ka);
	epd_peer_key(key, "b", "a", n2, n1, kb);
	TH_CHECK(memcmp(ka, kb, 32) && memcmp(ka, pr, 32),
		 "the directions share a key, or the key is the proof");
	/* Frame tags: over the bytes in order, however they are cut; each
	 * frame number and each bit changes the tag. */
	uint8_t frame[300], t1[EPD_TAG], t2[EPD_TAG];
	randombytes_buf(frame, sizeof(frame));
	struct iovec whole = {frame, sizeof(frame)};
	struct iovec cut[3] = {{frame, 24}, {frame + 24, 0},
			       {frame + 24, sizeof(frame) - 24}};
	epd_frame_tag(ka, 5, &whole, 1, t1);
	epd_frame_tag(ka, 5, cut, 3, t2);
	TH_CHECK(!memcmp(t1, t2, EPD_TAG), "a cut frame tags differently");
	epd_frame_tag(ka, 6, &whole, 1, t2);
	TH_CHECK(memcmp(t1, t2, EPD_TAG), "the frame number is not bound");
	epd_frame_tag(kb, 5, &whole, 1, t2);
	TH_CHECK(memcmp(t1, t2, EPD_TAG), "the key is not bound");
	frame[299] ^= 0x80;
	epd_frame_tag(ka, 5, &whole, 1, t2);
	TH_CHECK(memcmp(t1, t2, EPD_TAG), "a changed bit keeps the tag");
	printf("ok: handshake proofs bind names, nonces, direction and key; "
	       "frame tags bind number, key and every bit\n");
	return 0;
}
