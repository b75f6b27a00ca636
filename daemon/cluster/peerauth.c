/* SPDX-License-Identifier: MIT */
#include "peerauth.h"

#include "epp.h"

#include <endian.h>
#include <sys/uio.h>
#include <sodium.h>
#include <string.h>

#define PD_MAGIC 0x52445045u /* "EPDR" */

void epd_cluster_id(const uint8_t key[32], uint8_t id[8])
{
	uint8_t h[32];
	crypto_generichash(h, sizeof(h), key, 32,
			   (const uint8_t *)"epd-cluster-id", 14);
	memcpy(id, h, 8);
}

static void proof(const uint8_t key[32], const uint8_t id[8],
		  uint32_t index, uint8_t out[16])
{
	uint8_t msg[20], mac[crypto_auth_hmacsha256_BYTES];
	uint32_t le = htole32(index);
	memcpy(msg, "epd-rdma", 8);
	memcpy(msg + 8, id, 8);
	memcpy(msg + 16, &le, 4);
	crypto_auth_hmacsha256(mac, msg, sizeof(msg), key);
	memcpy(out, mac, 16);
}

size_t epd_pdata_make(const uint8_t key[32], const uint8_t id[8],
		      uint32_t index, uint8_t *out)
{
	struct epp_wr w;
	epp_wr_init(&w, out, EPD_PDATA_LEN);
	epp_put_u32(&w, PD_MAGIC);
	epp_put_u16(&w, EPP_VERSION_MAJOR);
	epp_put_u16(&w, EPP_VERSION_MINOR);
	for (int i = 0; i < 8; i++)
		epp_put_u8(&w, id[i]);
	epp_put_u32(&w, index);
	uint8_t pr[16];
	proof(key, id, index, pr);
	for (int i = 0; i < 16; i++)
		epp_put_u8(&w, pr[i]);
	return w.off;
}

const char *epd_pdata_check(const uint8_t key[32], const uint8_t id[8],
			    int nodes, int self, const uint8_t *p, size_t len,
			    uint32_t *index)
{
	uint32_t magic, idx;
	uint16_t major;
	if (len < EPD_PDATA_LEN)
		return "no epd connect data";
	memcpy(&magic, p, 4);
	memcpy(&major, p + 4, 2);
	if (le32toh(magic) != PD_MAGIC)
		return "no epd connect data";
	if (le16toh(major) != EPP_VERSION_MAJOR)
		return "another protocol major version";
	if (memcmp(p + 8, id, 8))
		return "another cluster (cluster id)";
	memcpy(&idx, p + 16, 4);
	idx = le32toh(idx);
	if ((int64_t)idx >= nodes || (int64_t)idx == self)
		return "an unknown node index";
	uint8_t pr[16];
	proof(key, id, idx, pr);
	if (sodium_memcmp(pr, p + 20, 16))
		return "a wrong proof of the cluster key";
	*index = idx;
	return NULL;
}

static void derive(const uint8_t key[32], const char *label, const char *from,
		   const char *to, const uint8_t *fn, const uint8_t *tn,
		   uint8_t out[32])
{
	crypto_generichash_state st;
	crypto_generichash_init(&st, key, 32, 32);
	crypto_generichash_update(&st, (const uint8_t *)label, strlen(label));
	const char *names[2] = {from, to};
	for (int i = 0; i < 2; i++) {
		uint8_t n = (uint8_t)strnlen(names[i], 255);
		crypto_generichash_update(&st, &n, 1);
		crypto_generichash_update(&st, (const uint8_t *)names[i], n);
	}
	crypto_generichash_update(&st, fn, EPD_NONCE);
	crypto_generichash_update(&st, tn, EPD_NONCE);
	crypto_generichash_final(&st, out, 32);
}

void epd_peer_proof(const uint8_t key[32], const char *from, const char *to,
		    const uint8_t from_nonce[EPD_NONCE],
		    const uint8_t to_nonce[EPD_NONCE], uint8_t out[EPD_PROOF])
{
	derive(key, "epd-proof-v2", from, to, from_nonce, to_nonce, out);
}

void epd_peer_key(const uint8_t key[32], const char *from, const char *to,
		  const uint8_t from_nonce[EPD_NONCE],
		  const uint8_t to_nonce[EPD_NONCE], uint8_t out[32])
{
	derive(key, "epd-key-v2", from, to, from_nonce, to_nonce, out);
}

void epd_frame_tag(const uint8_t dkey[32], uint64_t n,
		   const struct iovec *iov, int niov, uint8_t tag[EPD_TAG])
{
	/* one-time Poly1305 key: the first 32 bytes of ChaCha20(dkey,
	 * nonce = the frame's number) */
	uint8_t otk[crypto_onetimeauth_KEYBYTES];
	uint8_t nonce[crypto_stream_chacha20_ietf_NONCEBYTES] = {0};
	uint64_t le = htole64(n);
	memcpy(nonce, &le, 8);
	crypto_stream_chacha20_ietf(otk, sizeof(otk), nonce, dkey);
	crypto_onetimeauth_state st;
	crypto_onetimeauth_init(&st, otk);
	for (int i = 0; i < niov; i++)
		if (iov[i].iov_len)
			crypto_onetimeauth_update(&st, iov[i].iov_base,
						  iov[i].iov_len);
	crypto_onetimeauth_final(&st, tag);
	sodium_memzero(otk, sizeof(otk));
}
