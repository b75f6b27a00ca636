/* SPDX-License-Identifier: MIT */
/* Proofs between daemons of a cluster that need no connection state: the
 * cluster id, and the private data of an rdma connect request (checked
 * before a queue pair is made for the peer). */
#ifndef EPD_PEERAUTH_H
#define EPD_PEERAUTH_H

#include <stddef.h>
#include <stdint.h>

#define EPD_PDATA_LEN 36 /* fits the 56 bytes of an RC connect request */

/* The cluster id: the first 8 bytes of BLAKE2b(key, "epd-cluster-id"). */
void epd_cluster_id(const uint8_t key[32], uint8_t id[8]);

/* Connect private data of node `index`: magic "EPDR", protocol version,
 * cluster id, index, and HMAC-SHA256(key, "epd-rdma" || id || index) cut
 * to 16 bytes. Writes EPD_PDATA_LEN bytes, returns that. (The proof names
 * no nonce, so it can be replayed: the HELLO/AUTH exchange with fresh
 * nonces still follows on the stream.) */
size_t epd_pdata_make(const uint8_t key[32], const uint8_t id[8],
		      uint32_t index, uint8_t *out);

/* NULL and *index if p is good data of another node of this cluster
 * (nodes: its size, self: this node's index), else why not. */
const char *epd_pdata_check(const uint8_t key[32], const uint8_t id[8],
			    int nodes, int self, const uint8_t *p, size_t len,
			    uint32_t *index);

/*
 * The handshake between two daemons (over tcp or rdma) and the frames
 * after it. Each end sends PEER_HELLO (its name and a fresh 32-byte
 * nonce); each then proves the cluster key with
 *   proof = BLAKE2b-256 keyed with the cluster key over
 *           "epd-proof-v2" || sender name || receiver name ||
 *           sender's nonce || receiver's nonce
 * (names as length-prefixed strings). The proof is bound to both nonces,
 * both names and the direction: a relay that passes one node's proof to
 * another fails, because the receiver's name and nonce differ. Each
 * direction then gets its own key, derived the same way with
 * "epd-key-v2", and every later frame carries a 16-byte tag: Poly1305
 * over the frame's header and payload, with a one-time key from ChaCha20
 * under the direction's key and the frame's number (the key derivation
 * of RFC 8439's AEAD). A frame out of order, replayed, cut or changed
 * fails its tag and the connection closes.
 */
#define EPD_NONCE 32
#define EPD_PROOF 32
#define EPD_TAG 16

void epd_peer_proof(const uint8_t key[32], const char *from, const char *to,
		    const uint8_t from_nonce[EPD_NONCE],
		    const uint8_t to_nonce[EPD_NONCE], uint8_t out[EPD_PROOF]);
/* The key of frames sent from `from` to `to` on this connection. */
void epd_peer_key(const uint8_t key[32], const char *from, const char *to,
		  const uint8_t from_nonce[EPD_NONCE],
		  const uint8_t to_nonce[EPD_NONCE], uint8_t out[32]);
/* The tag of frame number n, over the pieces in order. */
struct iovec;
void epd_frame_tag(const uint8_t dkey[32], uint64_t n,
		   const struct iovec *iov, int niov, uint8_t tag[EPD_TAG]);

#endif
