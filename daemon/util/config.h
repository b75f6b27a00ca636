/* SPDX-License-Identifier: MIT */
/* The daemon's configuration (config.c; keys in epd.conf(5)). */
#ifndef EPD_CONFIG_H
#define EPD_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

/* configure: --with-socket, --sysconfdir */
#define EPD_DEFAULT_SOCKET EPD_SOCKET_PATH
#ifndef EPD_SYSCONFDIR
#define EPD_SYSCONFDIR "/etc"
#endif
#define EPD_DEFAULT_CONFIG EPD_SYSCONFDIR "/epd/epd.conf"
#define EPD_MAX_ALLOW 32

/* cuda_copy_sms = auto: 32 SMs per 14 KB row (more for shorter rows) */
#define EPD_COPY_SMS_AUTO 0xffffffffu

struct epd_config {
	char socket_path[108];
	unsigned socket_mode;
	char backend[16];          /* auto|host|cuda */
	int log_level;
	uint32_t timeout_ms;       /* default collective timeout */
	uint32_t frame_timeout_ms; /* a partial frame older than this: error */
	unsigned nallow;           /* 0: anyone who can open the socket */
	uid_t allow_uids[EPD_MAX_ALLOW];
	/* Group-name prefixes whose groups any admitted user may join ("*":
	 * every group); other groups belong to the uid that created them. */
	char shared_groups[512];
	unsigned worker_threads;   /* data-path threads; 0: one per core */
	unsigned cuda_sms;         /* SMs for dispatch/combine; 0: all */
	unsigned cuda_copy_sms;    /* SMs for the bulk-copy row copy; 0: as
				      cuda_sms; EPD_COPY_SMS_AUTO: by row */
	unsigned cuda_copy_bps;    /* the bulk-copy row copy's blocks a SM;
				      0: as many as fit */
	bool cuda_no_resident;     /* no resident barrier kernel under MPS */
	bool cuda_no_tma;          /* dispatch rows by SIMT copies only */
	bool cuda_no_fused_prep;   /* count, scan, slot as three launches */
	bool cuda_no_pdl;          /* no programmatic dependent launch */
	int cuda_combine_fetch;    /* rows fetched into L2 ahead: -1 auto,
				      0 no, 1 yes (ekc_combine_fetch), 2 lean
				      (ekc_combine_lean) */
	bool no_host_barrier;      /* GPU barriers without the host thread */
	/* Cluster (empty peers: a single node). */
	char node_name[64];
	char *peers;               /* "name@host:port, ..." the nodes this
				      one may reach (malloc'd; NULL: none) */
	char cluster_key_file[256];
	char transport[8];         /* auto|tcp|rdma */
	uint32_t heartbeat_ms, heartbeat_miss;
	/* peer_connect: false (on-demand, the default) connects to the
	 * nodes this node's groups span, while they do and peer_linger_ms
	 * after; true (all) to every node of peers */
	bool peer_connect_all;
	uint32_t peer_linger_ms;
	/* peer_lookup: which nodes outside peers this one may reach (the
	 * address book grows at run time): none (peers, the default), those
	 * found by name (dns: the host of that name at this node's peer
	 * port), or also those a job's node list gives as name@host:port
	 * (job); and how many nodes the table may hold */
	enum { EPD_LOOKUP_PEERS, EPD_LOOKUP_DNS, EPD_LOOKUP_JOB } peer_lookup;
	uint32_t peer_nodes_max;
	/* Limits (0: none): per uid (root included: in containers every
	 * job is often uid 0) and for the whole daemon. Bytes are group buffers
	 * (shared memory or GPU memory) charged to the group's owner. */
	struct epd_limits {
		uint32_t conns_per_uid, groups_per_uid;
		uint64_t bytes_per_uid;
		uint32_t conns, groups;
		uint64_t bytes;
		/* Per group: memory of the routings kept for handles not
		 * yet released (host memory; on a GPU group also its device
		 * tables). Past it a fresh dispatch fails the group. */
		uint64_t handle_bytes;
		/* Replies queued for clients that have not read them, all
		 * clients together: past it, a client with more than 64 KiB
		 * queued is dropped. */
		uint64_t queued_bytes;
		/* Inbound peer connections not yet authenticated, in all and
		 * from one host (1 or more): over a cap the oldest is
		 * dropped. */
		uint32_t handshakes, handshakes_per_host;
	} limits;
};

void epd_config_defaults(struct epd_config *c);
/* What a configuration holds on the heap (its peers). */
void epd_config_free(struct epd_config *c);
/* Load a file (missing file is fine unless required). Returns 0 or -1 with a
 * message logged. A line longer than the INI parser's limit
 * (EPD_CONFIG_LINE_MAX bytes) is refused, naming it; `peers` given on
 * several lines (the key again, or indented continuation lines) joins
 * them. */
#define EPD_CONFIG_LINE_MAX 199
int epd_config_load(struct epd_config *c, const char *path, bool required);
/* Apply one key=value override (section "epd"), of any length: it
 * replaces what the file said. */
int epd_config_set(struct epd_config *c, const char *kv);

#endif
