/* SPDX-License-Identifier: MIT */
/*
 * epp: the epd wire protocol, shared by epd, libep and epctl.
 *
 * A frame is a fixed 24-byte little-endian header followed by `length` bytes
 * of payload. File descriptors travel with SCM_RIGHTS on the first byte of a
 * frame; the header says how many (nfds).
 *
 *   off size field
 *     0    4 magic      "EPD1" (0x31445045 little-endian)
 *     4    1 ver_major  incompatible changes
 *     5    1 ver_minor  compatible additions
 *     6    2 type       enum epp_type
 *     8    2 flags      EPP_F_*; unknown flags are an error
 *    10    2 nfds       file descriptors attached (<= EPP_MAX_FDS)
 *    12    4 length     payload bytes (<= EPP_MAX_PAYLOAD)
 *    16    8 req_id     echoed in the reply; 0 for unsolicited notices
 *
 * Version history:
 *   1.0  HELLO, JOIN, LEAVE, BARRIER, STATUS, OK, ERROR, NOTICE.
 *   1.1  DISPATCH, COMBINE; the group buffer layout (struct epp_buf).
 *   1.2  JOIN may carry a CUDA device UUID (a GPU rank); its OK then carries
 *        the device region size and a second descriptor (the rank's cuMem
 *        region). BARRIER with EPP_F_ASYNC: stream-ordered, no reply on
 *        success. The control page (struct epp_ctl) heads the group buffer.
 *   1.3  Daemon-to-daemon frames on the peer port: PEER_HELLO, PEER_AUTH,
 *        PEER_HEARTBEAT, PEER_BARRIER, PEER_XMETA, PEER_XROWS, PEER_GFAIL,
 *        PEER_GSHAPE (same header).
 *   1.4  The group slot of the control page carries feature bits
 *        (EPP_CTL_FEATURES). With EPP_FEAT_FAST_BARRIER a GPU rank's
 *        stream-ordered barrier sends no frame: it rings the device
 *        doorbell of a barrier kernel resident for the group's life, and
 *        the op numbers the daemon sees may skip those barriers. With
 *        EPP_FEAT_KERNEL_WAIT (under MPS) a rank rings and waits with a
 *        one-thread kernel on its stream instead of stream memory ops.
 *   1.5  EPP_FEAT_HOST_BARRIER: as FAST_BARRIER, but the doorbell and the
 *        done word are host words of the control page (EPP_CTL_HB), served
 *        by a daemon thread; the rank first posts the barrier's number
 *        (EPP_HB_REQ) and wakes that thread if it sleeps (a futex on
 *        EPP_CTL_HB_SLEEP in the group slot).
 *   1.6  PEER_XWIN: rdma windows of a group; rows by RDMA WRITE.
 *   1.7  Peers: PEER_AUTH is a proof bound to both names, both nonces and
 *        the direction, and every peer frame after it is followed by a
 *        16-byte tag (daemon/peerauth.h); a peer below 1.7 is refused.
 *        Group names on the peer port are keys (name~uid for a user's
 *        group). Client frames are unchanged.
 *   1.8  RELEASE: a rank gives back its hold on a dispatch's handle. A
 *        handle lives until every local rank released it (or the group
 *        ends); the daemon no longer keeps only the last 32.
 *        COMBINE with EPP_COMBINE_WEIGHTS also sums each received row's
 *        top-k weights (combine_w) into combined_w on the token's home
 *        rank; the buffer layout gains those two fields at its end; peer
 *        XROWS of such a combine carry the weights after each row (their
 *        type field has EPP_XROWS_WEIGHTS). A host rank's dispatch of more
 *        tokens than the group's maximum fails that op for every rank
 *        (EP_ETOOBIG), not for that rank alone: it takes part with no
 *        tokens (peer XMETA flag EPP_DISPATCH_TOOBIG).
 *   1.9  The buffer layout gains rank_prefix [W, W] i32, written by every
 *        dispatch for every local rank, and combine_bias2 [T_max, H] bf16
 *        at its end; COMBINE flag EPP_COMBINE_BIAS2 adds that second bias.
 *   1.10 RELEASE with EPP_F_ASYNC: no reply on success (an error is an
 *        ERROR reply no one waits for). libep sends it from a CUDA graph's
 *        host node, which may not block on a reply.
 *   1.11 LL_MAP: a GPU rank of a one-node group asks for local rank l's
 *        low-latency region (the kernels of kernels/cuda/ekc_ll.cu write
 *        into the peers' regions from the rank's own stream); the OK
 *        carries its size and one descriptor. The daemon makes the
 *        group's regions at the first request and never reads them.
 *   1.12 JOIN may end with u32 recv_areas (2..EPP_MAX_RECV_AREAS, sent only
 *        above 1): the receive rows field holds that many areas of
 *        [R_max, H], one after the other, and a DISPATCH names in its
 *        flags (EPP_DISPATCH_AREA) the area its received rows go to, each
 *        rank its own. Every rank of a group joins with the same number;
 *        a group across nodes has one area.
 *   1.13 MEM_REG: a GPU rank of a one-node group passes descriptors of its
 *        own device memory (one per allocation, the only frame that may
 *        carry descriptors to the daemon; descriptors no frame claims
 *        end the connection); the daemon maps them and replies with an
 *        id. A stream-ordered COMBINE with EPP_COMBINE_YREG then names
 *        where its rows are (u32 reg, u64 offset after the flags), a
 *        DISPATCH with EPP_DISPATCH_XREG where x is (after the handle).
 *        MEM_DEREG ends a registration.
 *   1.14 A stream-ordered COMBINE with EPP_COMBINE_OUTREG writes its
 *        combined rows into the rank's registered memory (u32 reg, u32
 *        rows, u64 offset, after the YREG part if any) instead of the
 *        combined field: the rank's own output tensor, no copy out.
 *   1.15 A GPU group's control page carries a fresh dispatch's received
 *        rows per local expert (EPP_CTL_PE), published with its count
 *        (EPP_CTL_RECV_SEQ) once the routing is known, before the rows
 *        land: a rank's CPU waits for the counts alone, as DeepEP's does,
 *        and the op's rows follow in stream order.
 *   1.16 JOIN with EPP_F_JOIN_LINK ends with u64 link: the id of a group
 *        this connection has joined. The new group fails whenever that
 *        one does (at once if it has; joiners still waiting for the
 *        group get that error and are removed), so a group libep makes
 *        for another (the host ranks' low-latency pseudo group) never
 *        waits out its timeout for a rank its group already lost.
 *        Links are one level deep: the named group may not itself be
 *        linked, and a group with linked groups may not be (EP_EINVAL).
 *   1.17 A GPU group's control page names the ranks that left it
 *        (EPP_CTL_GONE), written before the group is released: the
 *        low-latency kernels of shrink mode mask them and go on.
 *   1.18 A stream-ordered combine or cached dispatch whose handle's
 *        dispatch failed (a bad expert index, too many tokens) fails
 *        alone and changes nothing, as that dispatch did: its op error is
 *        EP_ESTALE, EPP_CTL_OP_ERR_POS holding that dispatch's error
 *        word with EPP_OP_ERR_HANDLE set. (Before, it ran on the tables
 *        the failed dispatch had left.)
 *   1.19 The same across nodes: a stream-ordered combine or cached
 *        dispatch naming the handle of a staged dispatch that failed
 *        alone fails alone on every node (each daemon learnt the same
 *        verdict; none runs it with the others), instead of failing the
 *        group. A bad expert index found on another node has no position
 *        here: its word is EPP_OP_ERR_NOPOS.
 *   1.20 Between daemons: a group's frames to a node go in the order
 *        GSHAPE, its other frames, GFAIL (sent also where the failure
 *        came from another node, to that node too); a group that fails
 *        on ranks that ran different ops at op N says N data ops done
 *        at most; a group that fails before it sent its GSHAPE
 *        (while forming, or one a node refused to form) sends it just
 *        before the GFAIL, and a failed group answers a
 *        GSHAPE with its own GSHAPE and GFAIL. A daemon takes a group's
 *        frames from a node only between that node's GSHAPE and GFAIL,
 *        keeps those after its GFAIL for its next group of the key, and
 *        takes a GFAIL only from the group whose GSHAPE it had (doc/
 *        design.md, section 5). A 1.19 peer's failure of a group that
 *        never sent its shape is ignored: the ops wait out the timeout.
 *   1.21 A group names its nodes: a JOIN with EPP_F_JOIN_NODES starts
 *        with u32 n and n node names (str each, EPP_NODE_NAME_MAX bytes
 *        at most, distinct), the daemons of the group's node indices 0..
 *        n-1 (n = world_size / ranks_per_node); the rest follows as
 *        before. Every rank of the group names the same list. Without
 *        it, node i is the i-th entry of every daemon's `peers`. The OK
 *        to a HELLO of minor 21 or later ends with str node: the
 *        daemon's node name, what a job's rendezvous gathers. A GSHAPE
 *        of a group that names its nodes ends with u64: a hash of the
 *        names in order (nodes that were told different lists fail the
 *        group with EP_EMISMATCH). A JOIN with EPP_F_JOIN_RECV starts
 *        with u32 recv_rows (before the node list): the rows a rank of
 *        the group may receive (1..world_size x max_tokens; without it,
 *        that product), which sizes the receive fields; a dispatch that
 *        would give a rank more fails alone on every rank (EP_ETOOBIG,
 *        on the control page EPP_OP_ERR_TOOBIG | EPP_OP_ERR_RECV with
 *        (rank << 32) | rows). A GSHAPE of such a group ends with u32
 *        recv_rows (after the nodes' hash, if any). A JOIN with
 *        EPP_F_JOIN_SECRET starts (after recv_rows) with u16 n and n
 *        bytes (1..EPP_SECRET_MAX): the job's secret. The group's key
 *        then carries a tag of it ("name#tag"), so a join with another
 *        secret, or none, makes or finds another group: no rank without
 *        the secret joins, squats or sees the details of it.
 *   1.22 Node tables of their own: an entry of a JOIN's node list may
 *        be name@host:port (epp_node_entry_valid), an address a daemon
 *        with peer_lookup = job may dial; the GSHAPE's hash covers the
 *        names alone. Between daemons whose peer_lookup is not peers,
 *        a PEER_HELLO's index and the rdma connect data's are each
 *        node's own (a label): a node is its name, and a daemon learns
 *        a node that dials in with the cluster key's proof; their
 *        heartbeats carry no row of the matrix.
 *   1.23 COMBINE flag EPP_COMBINE_TOPK_ORDER: the home rank's rows of
 *        each token are summed in the order of each rank's last top-k
 *        slot in the token's row of the home's topk_idx field (DeepEP
 *        V2's order), ranks that row does not name after them in
 *        ascending order.
 *
 * Rules: a frame with a bad magic, a newer major version, a length over the
 * maximum or an nfds that does not match the descriptors received cannot be
 * trusted: the daemon replies ERROR and disconnects. A well-framed message of
 * an unknown type or with a malformed payload gets an ERROR reply and the
 * connection stays.
 */
#ifndef EPP_H
#define EPP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ep/ep.h"

#define EPP_MAGIC 0x31445045u
#define EPP_VERSION_MAJOR 1
#define EPP_VERSION_MINOR 23
/* Stream-ordered ops a GPU rank may have in flight (libep waits before
 * more; the daemon's rings are this deep). */
#define EPP_MAX_INFLIGHT 1024
#define EPP_HDR_SIZE 24
#define EPP_MAX_PAYLOAD (1u << 20)
#define EPP_MAX_WORLD 1024 /* ranks of a group */
#define EPP_MAX_TOPK 32    /* a token's experts (a JOIN's topk) */
/* Descriptors one frame may carry: a MEM_REG's chunks (1.13); every other
 * frame carries 2 at most. */
#define EPP_MAX_FDS 64
#define EPP_ERRMSG_MAX 1024

enum epp_type {
	EPP_HELLO = 1,   /* C->D: u16 major, u16 minor, str name */
	EPP_JOIN = 2,    /* C->D: struct epp_join */
	EPP_LEAVE = 3,   /* C->D: u64 group_id */
	EPP_BARRIER = 4, /* C->D: u64 group_id */
	EPP_STATUS = 5,  /* C->D: empty */
	EPP_DISPATCH = 6, /* C->D: struct epp_dispatch; OK: epp_dispatch_ok */
	EPP_COMBINE = 7,  /* C->D: struct epp_combine; OK: empty */
	EPP_RELEASE = 8,  /* C->D: struct epp_release; OK: empty (1.8) */
	EPP_LL_MAP = 9,   /* C->D: struct epp_ll_map; OK: epp_ll_map_ok and
			     one descriptor (1.11) */
	EPP_MEM_REG = 10, /* C->D: struct epp_mem_reg and one descriptor per
			     chunk; OK: struct epp_mem_reg_ok (1.13) */
	EPP_MEM_DEREG = 11, /* C->D: struct epp_mem_dereg; OK: empty (1.13) */
	/* Between daemons (peer port). */
	EPP_PEER_HELLO = 32,     /* u16 major, u16 minor, str node, u32 index,
				    32-byte nonce */
	EPP_PEER_AUTH = 33,      /* 32-byte HMAC(key, peer nonce || node) */
	EPP_PEER_HEARTBEAT = 34, /* u64 view epoch */
	EPP_PEER_BARRIER = 35,   /* str group, u32 local index, u64 seq */
	EPP_PEER_XMETA = 36,     /* str group, u64 op, u32 rank, u32 tokens,
				    u32 flags, i64 topk[T*K], f32 w[T*K] */
	EPP_PEER_XROWS = 37,     /* str group, u64 op, u16 type, u64 handle,
				    u32 n, n x (u32 rank, u32 slot, row) */
	EPP_PEER_GFAIL = 38,     /* str group, i32 code, str message, u64 last
				    barrier entered, u64 data ops completed */
	EPP_PEER_GSHAPE = 39,    /* str group, u64 op (0), then the group's
				    world, rpn, experts, hidden, max tokens,
				    top-k, dtype, timeout (u32 each) */
	EPP_PEER_XWIN = 40,      /* str group, u64 op (0), u16 window id,
				    u32 rpn, rpn x (u64 addr, u32 rkey,
				    u64 bytes): where the sender's local ranks
				    receive rows by RDMA WRITE (protocol 1.6,
				    rdma transport) */
	EPP_PEER_BYE = 41,       /* u8 EPP_BYE_*: closing an unused
				    connection, agreed by both ends (1.21) */
	EPP_OK = 64,     /* D->C: reply; payload depends on the request */
	EPP_ERROR = 65,  /* D->C: i32 code, str message */
	EPP_NOTICE = 66, /* D->C: unsolicited; i32 code, str message */
};

/* PEER_BYE: the dialler asks to close a connection no group of its
 * needs; the other end agrees where none of its groups needs it either
 * (and takes the node as going away: its new groups wait for a new
 * connection), else refuses; the dialler closes on the agreement. */
enum { EPP_BYE_ASK = 0, EPP_BYE_YES = 1, EPP_BYE_NO = 2 };

enum epp_flags {
	EPP_F_JOIN_NOWAIT = 0x1, /* JOIN: reply before the group is ready */
	EPP_F_ASYNC = 0x2,       /* BARRIER, DISPATCH, COMBINE: stream-
				    ordered; errors go to the control page,
				    no reply on success. RELEASE: no reply
				    on success */
	EPP_F_JOIN_LINK = 0x4,   /* JOIN: linked to another group (1.16) */
	EPP_F_JOIN_NODES = 0x8,  /* JOIN: the group's node list first (1.21) */
	EPP_F_JOIN_RECV = 0x10,  /* JOIN: u32 recv_rows first (1.21) */
	EPP_F_JOIN_SECRET = 0x20, /* JOIN: the job's secret (1.21) */
	EPP_F_ALL = 0x3f,
};

struct epp_hdr {
	uint32_t magic;
	uint8_t ver_major;
	uint8_t ver_minor;
	uint16_t type;
	uint16_t flags;
	uint16_t nfds;
	uint32_t length;
	uint64_t req_id;
};

/* JOIN request. */
struct epp_join {
	char name[EP_GROUP_NAME_MAX + 1];
	uint32_t world_size, ranks_per_node, rank;
	uint32_t num_experts, hidden, max_tokens, topk, dtype;
	uint32_t timeout_ms;
	uint8_t gpu_uuid[16]; /* all zero: a host rank */
	uint32_t rank_flags;  /* EPP_RANK_*, with a UUID only */
	uint32_t recv_areas;  /* 1.12: areas of received rows, 1 or more */
	uint64_t link;        /* 1.16: with EPP_F_JOIN_LINK, the group it is
				 linked to (encoded last when not 0) */
	/* 1.21: with EPP_F_JOIN_NODES (num_nodes > 0), the group's node
	 * names in node-index order: num_nodes NUL-terminated strings one
	 * after the other in nodes (not owned: the frame's, or the
	 * caller's for encode). */
	uint32_t num_nodes;
	const char *nodes;
	/* 1.21: with EPP_F_JOIN_RECV (not 0), the rows a rank may receive;
	 * 0: world_size x max_tokens */
	uint32_t recv_rows;
	/* 1.21: with EPP_F_JOIN_SECRET (secret_len > 0), the job's secret
	 * (not owned, as nodes) */
	uint32_t secret_len;
	const uint8_t *secret;
};
#define EPP_SECRET_MAX 256

/* A node's name: [A-Za-z0-9_.-], 1..EPP_NODE_NAME_MAX characters. */
#define EPP_NODE_NAME_MAX 63
bool epp_node_name_valid(const char *name);
/* An entry of a group's node list (protocol 1.22): a node's name, or
 * name@host:port (an address the job gives, which a daemon with
 * peer_lookup = job may dial; host up to EPP_NODE_HOST_MAX of
 * [A-Za-z0-9_.:-] or an IPv6 literal in brackets, port 1..65535). */
#define EPP_NODE_HOST_MAX 63
#define EPP_NODE_ENTRY_MAX (EPP_NODE_NAME_MAX + 1 + EPP_NODE_HOST_MAX + 6)
bool epp_node_entry_valid(const char *entry);
/* The length of an entry's name (what precedes its '@', if any). */
size_t epp_node_entry_name_len(const char *entry);
/* Name i of a join's node list (i < num_nodes). */
const char *epp_join_node(const struct epp_join *j, uint32_t i);

#define EPP_RANK_MPS 0x1 /* the rank's CUDA context runs under MPS */

bool epp_uuid_is_zero(const uint8_t uuid[16]);

/* OK reply to JOIN; the group's shared buffer travels with it, and for a
 * GPU rank a second descriptor: its device region (dev_size bytes). */
struct epp_join_ok {
	uint64_t group_id;
	uint32_t epoch;
	uint32_t node_index;
	uint64_t buf_size;
	uint32_t ready;
	uint64_t dev_size; /* 0: host group */
};

/* The control page heads the group buffer: one slot per local rank, written
 * by the daemon (and its kernels, through a host mapping), read by the
 * rank. Offsets in bytes within a slot. */
#define EPP_CTL_SLOT 256u
#define EPP_CTL_COMPLETED 0u   /* u64: last stream-ordered op completed */
#define EPP_CTL_ERR_CODE 8u    /* i32: the group's error, 0 if none */
#define EPP_CTL_OP_ERR_CODE 12u /* i32: error of one op (group goes on) */
#define EPP_CTL_OP_ERR_SEQ 16u /* u64: that op */
#define EPP_CTL_RECV 24u       /* u64: rows received by a dispatch */
#define EPP_CTL_RECV_SEQ 32u   /* u64: that dispatch */
#define EPP_CTL_OP_ERR_POS 40u /* u64: (rank << 48 | token << 16 | k) */
/* In EPP_CTL_OP_ERR_POS (1.18): the op named a handle whose dispatch
 * failed; the rest of the word is that dispatch's, whose flags say its
 * error: too many tokens ((rank << 32) | tokens), a wait past the group's
 * timeout (local rank), else a bad expert index at the position above */
#define EPP_OP_ERR_HANDLE (1ull << 61)
#define EPP_OP_ERR_TOOBIG (1ull << 63)
#define EPP_OP_ERR_WAIT (1ull << 62)
/* (1.21) With EPP_OP_ERR_TOOBIG: local or global rank (bits 32..59)
 * would receive rows (bits 0..31), above the group's recv_rows. */
#define EPP_OP_ERR_RECV (1ull << 60)
/* (1.19) A bad expert index whose position this daemon does not know (a
 * staged op: another node found it, and its log names it). */
#define EPP_OP_ERR_NOPOS (EPP_OP_ERR_HANDLE - 1)
#define EPP_CTL_ERR_MSG 48u    /* NUL-terminated message of the group */
#define EPP_CTL_MSG_MAX (EPP_CTL_SLOT - EPP_CTL_ERR_MSG)
/* The last slot is the group's: the device kernels' error word (i32 at 0),
 * then the group's features (u32 at EPP_CTL_FEATURES), set before READY. */
#define EPP_CTL_GROUP_SLOT (EPP_BUF_HEADER - EPP_CTL_SLOT)
#define EPP_CTL_FEATURES 8u
/* u32: nonzero once the daemon gave the group up (released every rank's
 * stream); the group's kernels stop waiting when they see it. The daemon's
 * CPU stores it, so no GPU queue stands between the release and a kernel
 * that spins for a rank that will never come. */
#define EPP_CTL_RELEASED 16u
/* u64 (1.17): bit r set once world rank r of a group of at most 64 ranks
 * left it or died, stored before EPP_CTL_RELEASED (the low-latency
 * kernels of shrink mode mask those ranks and go on). */
#define EPP_CTL_GONE 24u
#define EPP_FEAT_FAST_BARRIER 1u /* barriers by device doorbell alone */
#define EPP_FEAT_KERNEL_WAIT 2u  /* MPS: ranks ring and wait with a kernel */
#define EPP_FEAT_HOST_BARRIER 4u /* barriers by host doorbell alone */
/* In a GPU rank's device region (before the fields at its first 4 KiB):
 * u32, the rows this rank received in its latest dispatch that succeeded,
 * written on the device in stream order (ep_dispatch_recv_count_device). */
#define EPP_DEV_RECV_COUNT 512u
#define EPP_CTL_HB_SLEEP 64u     /* u32 futex: the host barrier thread sleeps */
/* Host barrier words of local rank l at EPP_CTL_HB + l * EPP_CTL_HB_STRIDE,
 * each u32 on its own cache line (the rank's GPU writes the doorbell, the
 * daemon's thread the done word, the rank's CPU the request). */
#define EPP_CTL_HB 16384u
#define EPP_CTL_HB_STRIDE 256u
/* 1.15: a fresh dispatch's received rows per expert, i32 [experts of this
 * node's ranks]: local rank l's experts at EPP_CTL_PE + l * (E / world) * 4,
 * written before that rank's EPP_CTL_RECV_SEQ names the dispatch (zeros if
 * the op failed). A cached dispatch leaves them as they were. */
#define EPP_CTL_PE 32768u
#define EPP_CTL_PE_MAX 16384u /* bytes: EPP_MAX_EXPERTS i32 */
#define EPP_HB_BELL 0u   /* GPU of rank l: barrier k reached on the stream */
#define EPP_HB_DONE 64u  /* daemon: barrier k released (far ahead: failed) */
#define EPP_HB_REQ 128u  /* CPU of rank l: barrier k enqueued */

/* OK reply to HELLO. */
struct epp_hello_ok {
	uint16_t major, minor;
	uint64_t client_id;
	char daemon_version[32];
	char backend[16];
	char node[EPP_NODE_NAME_MAX + 1]; /* 1.21; "" from an older daemon */
};

/* DISPATCH: the rank's inputs are in its send region of the group buffer. */
#define EPP_DISPATCH_WEIGHTS 0x1 /* topk_weights are given */
#define EPP_DISPATCH_CACHED 0x2  /* reuse the routing of `handle` */
/* x is not the region's field but registered memory: the frame goes on
 * with u32 reg, u64 offset (1.13) */
#define EPP_DISPATCH_XREG 0x4
/* Peer XMETA only (1.8): that rank asked for more tokens than the group's
 * maximum; it takes part with none, and the op fails for every rank. */
#define EPP_DISPATCH_TOOBIG 0x80
/* 1.12: the area of recv_x this rank's received rows go to (bits 24..31;
 * below the group's recv_areas) */
#define EPP_DISPATCH_AREA_SHIFT 24
#define EPP_DISPATCH_AREA_MASK 0xff000000u
#define EPP_DISPATCH_AREA_OF(f) ((uint32_t)(f) >> EPP_DISPATCH_AREA_SHIFT)
#define EPP_MAX_RECV_AREAS 16u
#define EPP_COMBINE_BIAS 0x1     /* add the bias region */
#define EPP_COMBINE_BIAS2 0x4    /* and the second bias region (1.9) */
#define EPP_COMBINE_WEIGHTS 0x2  /* sum combine_w into combined_w (1.8) */
/* combine_y is not the region's field but registered memory: the frame
 * goes on with u32 reg, u64 offset (1.13) */
#define EPP_COMBINE_YREG 0x8
/* combined's first out_rows rows go to registered memory: the frame goes
 * on with u32 out_reg, u32 out_rows, u64 out_off (1.14) */
#define EPP_COMBINE_OUTREG 0x10
/* this home rank's sums in its topk_idx field's slot order (1.23) */
#define EPP_COMBINE_TOPK_ORDER 0x20
#define EPP_XROWS_WEIGHTS 0x100  /* XROWS type bit: rows carry K f32 */

/* A dispatch's routing, as the client holds it. */
struct epp_handle {
	uint64_t group_id;
	uint32_t epoch;
	uint64_t seq;
};

struct epp_dispatch {
	uint64_t group_id;
	uint32_t num_tokens, hidden, dtype, topk, flags;
	struct epp_handle handle; /* with EPP_DISPATCH_CACHED */
	/* with EPP_DISPATCH_XREG: x's num_tokens rows are at byte reg_off
	 * of this rank's registration reg */
	uint32_t reg;
	uint64_t reg_off;
};

struct epp_dispatch_ok {
	struct epp_handle handle;
	uint32_t num_recv;
};

struct epp_combine {
	uint64_t group_id;
	struct epp_handle handle;
	uint32_t num_rows, hidden, flags;
	/* with EPP_COMBINE_YREG: combine_y's num_rows rows are at byte
	 * reg_off of this rank's registration reg */
	uint32_t reg;
	uint64_t reg_off;
	/* with EPP_COMBINE_OUTREG: combined's rows below out_rows are
	 * written at byte out_off of this rank's registration out_reg */
	uint32_t out_reg, out_rows;
	uint64_t out_off;
};

/* MEM_REG (1.13): a GPU rank's own device memory, made with the virtual
 * memory API, imported by the daemon so that ops read it in place. The
 * frame carries one descriptor (cuMemExportToShareableHandle, POSIX file
 * descriptor) per chunk; the daemon maps the chunks back to back, chunk i
 * of chunk[i] bytes from its start, as they lie in the rank's address
 * space. */
#define EPP_MAX_REG_CHUNKS EPP_MAX_FDS
#define EPP_MAX_REGS 64 /* live registrations of one rank in one group */
struct epp_mem_reg {
	uint64_t group_id;
	uint32_t nchunks;
	uint64_t chunk[EPP_MAX_REG_CHUNKS];
};
struct epp_mem_reg_ok {
	uint32_t reg; /* 1 or more; unique in the group for this rank */
	uint64_t bytes;
};
struct epp_mem_dereg {
	uint64_t group_id;
	uint32_t reg;
};
size_t epp_mem_reg_encode(const struct epp_mem_reg *m, uint8_t *out,
			  size_t cap);
int epp_mem_reg_decode(const uint8_t *p, size_t len, struct epp_mem_reg *m);
size_t epp_mem_reg_ok_encode(const struct epp_mem_reg_ok *m, uint8_t *out,
			     size_t cap);
int epp_mem_reg_ok_decode(const uint8_t *p, size_t len,
			  struct epp_mem_reg_ok *m);
size_t epp_mem_dereg_encode(const struct epp_mem_dereg *m, uint8_t *out,
			    size_t cap);
int epp_mem_dereg_decode(const uint8_t *p, size_t len,
			 struct epp_mem_dereg *m);

/* RELEASE: this rank no longer uses the handle (a GPU rank's handle is the
 * dispatch's op number; its stream-ordered ops already sent may still use
 * it: the daemon keeps the routing until they ran). */
struct epp_release {
	uint64_t group_id;
	struct epp_handle handle;
};

size_t epp_release_encode(const struct epp_release *r, uint8_t *out,
			  size_t cap);
int epp_release_decode(const uint8_t *p, size_t len, struct epp_release *r);

/* LL_MAP: local rank `local`'s low-latency region of the group. */
struct epp_ll_map {
	uint64_t group_id;
	uint32_t local;
};

struct epp_ll_map_ok {
	uint64_t size; /* bytes of the region (its descriptor travels along) */
	uint32_t local;
	uint32_t gpu; /* the daemon's index of the region's GPU */
};

size_t epp_ll_map_encode(const struct epp_ll_map *m, uint8_t *out,
			 size_t cap);
int epp_ll_map_decode(const uint8_t *p, size_t len, struct epp_ll_map *m);
size_t epp_ll_map_ok_encode(const struct epp_ll_map_ok *m, uint8_t *out,
			    size_t cap);
int epp_ll_map_ok_decode(const uint8_t *p, size_t len,
			 struct epp_ll_map_ok *m);

size_t epp_dispatch_encode(const struct epp_dispatch *d, uint8_t *out,
			   size_t cap);
int epp_dispatch_decode(const uint8_t *p, size_t len, struct epp_dispatch *d);
size_t epp_dispatch_ok_encode(const struct epp_dispatch_ok *d, uint8_t *out,
			      size_t cap);
int epp_dispatch_ok_decode(const uint8_t *p, size_t len,
			   struct epp_dispatch_ok *d);
size_t epp_combine_encode(const struct epp_combine *c, uint8_t *out,
			  size_t cap);
int epp_combine_decode(const uint8_t *p, size_t len, struct epp_combine *c);

/*
 * The group buffer: one shared mapping of buf_size bytes, a header page then
 * one region per local rank (rank_stride bytes apart). Within a region, at
 * the offsets below (all 4096-aligned; bytes):
 *   send side   x [T_max, H] (2 bytes bf16, 1 byte fp8), x_scales
 *               [T_max, H/128] f32 (fp8 only), topk_idx [T_max, K] i64,
 *               topk_weights [T_max, K] f32
 *   receive     recv_x [R_max, H], recv_scales [R_max, H/128] f32,
 *               recv_topk_idx [R_max, K] i64, recv_topk_weights [R_max, K]
 *               f32, recv_src [R_max, 2] i32 (source rank, source token),
 *               recv_per_expert [E/W] i32
 *   combine     combine_y [R_max, H] bf16, combine_bias [T_max, H] bf16,
 *               combined [T_max, H] bf16
 *   combine's top-k weights (1.8)  combine_w [R_max, K] f32 (the rank's
 *               received rows' weights), combined_w [T_max, K] f32
 *   (1.9)       rank_prefix [W, W] i32: after each dispatch (fresh or
 *               cached), [s][d] = the rows rank d received from ranks
 *               0..s (DeepEP's rank_prefix_matrix), the same on every
 *               rank; combine_bias2 [T_max, H] bf16 (EPP_COMBINE_BIAS2:
 *               DeepEP's pair of biases, added after the first)
 * R_max = W * T_max: every token of every rank could come here. With
 * recv_areas > 1 (1.12) the recv_x field is that many [R_max, H] areas,
 * area a at off[EPP_BUF_RECV_X] + a * recv_area_bytes; the other fields
 * are one each.
 */
enum epp_buf_field {
	EPP_BUF_X,
	EPP_BUF_X_SCALES,
	EPP_BUF_TOPK_IDX,
	EPP_BUF_TOPK_WEIGHTS,
	EPP_BUF_RECV_X,
	EPP_BUF_RECV_SCALES,
	EPP_BUF_RECV_TOPK_IDX,
	EPP_BUF_RECV_TOPK_WEIGHTS,
	EPP_BUF_RECV_SRC,
	EPP_BUF_RECV_PER_EXPERT,
	EPP_BUF_COMBINE_Y,
	EPP_BUF_COMBINE_BIAS,
	EPP_BUF_COMBINED,
	EPP_BUF_COMBINE_W,
	EPP_BUF_COMBINED_W,
	EPP_BUF_RANK_PREFIX,
	EPP_BUF_COMBINE_BIAS2,
	EPP_BUF_NFIELDS,
};

#define EPP_BUF_HEADER 65536u /* control page: 256 slots */
#define EPP_BUF_MAX (1ull << 42) /* refuse shapes past 4 TiB of mapping */

struct epp_buf {
	uint64_t off[EPP_BUF_NFIELDS]; /* within a rank's region */
	uint64_t rank_stride;
	uint64_t total;
	uint32_t elt;          /* bytes per element of x: 2 or 1 */
	uint32_t max_tokens;   /* T_max */
	uint64_t max_recv;     /* R_max */
	uint32_t nscales;      /* H/128 for fp8, else 0 */
	uint32_t recv_areas;   /* areas in the recv_x field (1.12) */
	uint64_t recv_area_bytes; /* R_max * H * elt: one area */
};

/* Compute the layout from a (validated) join. 0, or EP_ETOOBIG. */
int epp_buf_layout(const struct epp_join *shape, struct epp_buf *b);

/* Where field lies for local rank l, from the start of the group's
 * shared mapping (the one mapping rule the daemon and libep share). */
static inline uint64_t epp_buf_field(const struct epp_buf *b, uint32_t l,
				     int field)
{
	return EPP_BUF_HEADER + (uint64_t)l * b->rank_stride + b->off[field];
}

/* Offset within a rank's region of recv_x area a (below recv_areas). */
static inline uint64_t epp_buf_recv_area(const struct epp_buf *b, uint32_t a)
{
	return b->off[EPP_BUF_RECV_X] + (uint64_t)a * b->recv_area_bytes;
}

/* Little-endian cursor over a payload. A read past the end, or a string
 * without its terminator, sets err; later reads return zeros. */
struct epp_rd {
	const uint8_t *p;
	size_t len, off;
	bool err;
};

struct epp_wr {
	uint8_t *p;
	size_t cap, off;
	bool err; /* ran out of room */
};

void epp_rd_init(struct epp_rd *r, const void *p, size_t len);
uint8_t epp_get_u8(struct epp_rd *r);
uint16_t epp_get_u16(struct epp_rd *r);
uint32_t epp_get_u32(struct epp_rd *r);
uint64_t epp_get_u64(struct epp_rd *r);
/* u16 length then bytes (no NUL on the wire); copied NUL-terminated into
 * dst of size cap; longer than cap-1 sets err. */
void epp_get_str(struct epp_rd *r, char *dst, size_t cap);
/* 0 if every byte was consumed and no read failed, else EP_EPROTO. */
int epp_rd_end(const struct epp_rd *r);

void epp_wr_init(struct epp_wr *w, void *p, size_t cap);
void epp_put_u8(struct epp_wr *w, uint8_t v);
void epp_put_u16(struct epp_wr *w, uint16_t v);
void epp_put_u32(struct epp_wr *w, uint32_t v);
void epp_put_u64(struct epp_wr *w, uint64_t v);
void epp_put_str(struct epp_wr *w, const char *s);
void epp_put_bytes(struct epp_wr *w, const void *p, size_t n);

/* Header. encode writes EPP_HDR_SIZE bytes. decode checks magic, major
 * version, flags, nfds and length; on failure it returns a negative code and
 * a message in err (which may be NULL). */
void epp_hdr_encode(const struct epp_hdr *h, uint8_t out[EPP_HDR_SIZE]);
int epp_hdr_decode(const uint8_t in[EPP_HDR_SIZE], struct epp_hdr *h,
		   char *err, size_t errlen);
void epp_hdr_init(struct epp_hdr *h, uint16_t type, uint64_t req_id);
const char *epp_type_name(uint16_t type);

/* Payload codecs. decode returns 0 or EP_EPROTO/EP_EINVAL with a message. */
size_t epp_join_encode(const struct epp_join *j, uint8_t *out, size_t cap);
/* The flags a join's payload needs (EPP_F_JOIN_LINK, EPP_F_JOIN_NODES,
 * EPP_F_JOIN_RECV, EPP_F_JOIN_SECRET). */
uint16_t epp_join_flags(const struct epp_join *j);
/* JOIN's payload as the header's flags say: with EPP_F_JOIN_RECV u32
 * recv_rows first, then with EPP_F_JOIN_SECRET the secret, then with
 * EPP_F_JOIN_NODES the node list (j->nodes and j->secret point into p), with EPP_F_JOIN_LINK the last 8 bytes are j->link (not
 * 0), the rest as epp_join_decode. */
int epp_join_decode_flags(const uint8_t *p, size_t len, uint16_t flags,
			  struct epp_join *j, char *err, size_t errlen);
int epp_join_decode(const uint8_t *p, size_t len, struct epp_join *j,
		    char *err, size_t errlen);
bool epp_group_name_valid(const char *name);
/* Make a string from outside fit for logs, JSON and terminals: every byte
 * outside printable ASCII becomes '?' (in place). A client's name, a
 * peer's node name: one could hide from the status (JSON takes only
 * UTF-8), forge log lines or drive a terminal with escapes otherwise. */
void epp_printable(char *s);
size_t epp_join_ok_encode(const struct epp_join_ok *j, uint8_t *out, size_t cap);
int epp_join_ok_decode(const uint8_t *p, size_t len, struct epp_join_ok *j);
size_t epp_hello_ok_encode(const struct epp_hello_ok *h, uint8_t *out,
			   size_t cap);
int epp_hello_ok_decode(const uint8_t *p, size_t len, struct epp_hello_ok *h);
size_t epp_error_encode(int code, const char *msg, uint8_t *out, size_t cap);
int epp_error_decode(const uint8_t *p, size_t len, int *code, char *msg,
		     size_t cap);

/* Socket I/O with descriptors (blocking or not, as the socket is).
 * epp_sendmsg: one sendmsg with fds attached; returns bytes sent or -errno.
 * epp_recvmsg: one recvmsg; received fds are appended to fds[*nfds] up to
 * fdcap (extra ones are closed and flagged with *truncated). */
long epp_sendmsg(int fd, const void *buf, size_t len, const int *fds,
		 unsigned nfds);
long epp_recvmsg(int fd, void *buf, size_t len, int *fds, unsigned *nfds,
		 unsigned fdcap, bool *truncated);

/* Blocking helpers for clients: send a whole frame; receive a whole frame
 * (payload malloc'd into *payload, caller frees) waiting at most timeout_ms
 * (-1: forever). Return 0 or a negative code. */
int epp_send_frame(int fd, const struct epp_hdr *h, const void *payload,
		   const int *fds);
int epp_recv_frame(int fd, struct epp_hdr *h, uint8_t **payload, int *fds,
		   int timeout_ms, char *err, size_t errlen);

#endif /* EPP_H */
