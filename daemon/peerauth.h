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

#endif
