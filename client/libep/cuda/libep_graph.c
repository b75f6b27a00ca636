/* SPDX-License-Identifier: MIT */
/*
 * libep on GPU ranks: stream-ordered ops captured into CUDA graphs.
 *
 * A direct stream op gets its number k, and sends its frame to the daemon,
 * when the rank enqueues it; the stream only rings doorbell := k and waits
 * for done >= k. Captured that way, every replay would ring the number of
 * the capture and reach no daemon. A captured op is instead three nodes:
 *
 *   host node   takes the group's next number k, sends the op's frame
 *               (its handle resolved to the number the dispatch it names got
 *               in this replay) and writes k into the op's slot, a line of
 *               pinned host memory, closing the slot's gate;
 *   kernel      reads k from the slot, rings, spins for done >= k a short
 *               while (as ekc_ring_wait) and opens the gate;
 *   stream wait gate == 1, a fixed value: it holds the stream when the
 *               kernel's spin ran out (then this file's watcher thread
 *               opens the gate once the control page says k completed).
 *
 * Numbers thus advance at replay time, in the order replays run, and the
 * daemon sees the same frames as for direct ops (nothing changes there).
 * Each captured op is a record, owned by the graph through a CUDA user
 * object: CUDA drops it when the graph and every instance are destroyed.
 * A captured fresh dispatch releases the routing of its previous replay
 * when it is replayed (every op that used it was sent before), and its last
 * one when the record goes.
 *
 * While any record lives, this rank's direct stream ops of the group are
 * refused (EP_EBUSY): a replay's host node may not have run yet, and a
 * direct op numbered before it would be rung after it on the stream.
 */
#include "libep_cuda_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#define NSLOTS 1024u
#define EP__GCHAIN 16 /* ops a host node posts (< EPP_MAX_INFLIGHT - 1) */
#define SLOTS_BYTES (NSLOTS * sizeof(struct ekc_gslot))

struct gop {
	struct ep_graphs *gs;
	uint32_t id, slot;
	uint16_t type; /* EPP_DISPATCH, EPP_COMBINE; 0: barrier */
	uint32_t tokens;
	unsigned flags;
	ep_handle_t h;   /* cached dispatch, combine: the handle named */
	struct gop *src; /* ... when that handle is a captured dispatch's */
	unsigned refs;   /* the graph's, and each op naming this one */
	uint64_t k;      /* the number of the latest replay (0: none yet) */
	bool pending;    /* posted; the watcher opens its gate once done */
	/* a chain head posts the ops captured right behind it on the same
	 * stream (each depending on the one before) in its host node */
	struct gop *chain[EP__GCHAIN];
	uint32_t nchain;
	struct gop *head; /* a chain's other op: its head */
	bool dead;       /* the graph let it go */
};

struct ep_graphs {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	ep_group_t *g; /* NULL once the group is left */
	struct ekc_gslot *slots;
	CUdeviceptr slots_dev;
	bool slot_used[NSLOTS];
	struct gop **ops; /* by id; NULL once freed */
	uint32_t nops, cap;
	uint32_t live;    /* records the graphs hold (written under mu, read
			     without it by every direct op) */
	uint32_t npending;
	pthread_t watcher;
	bool watching, stop;
	uint64_t posted_ns; /* the latest post (the watcher polls hard after) */
	/* the op captured last: a new one depending on its stream wait
	 * alone, in the same capture, joins its chain */
	struct gop *tail;
	CUgraphNode tail_node;
	cuuint64_t tail_cid;
	int err; /* a replay that could not post: the group's error */
	char msg[256];
};

/* Is environment variable name exactly val? */
static bool env_is(const char *name, const char *val)
{
	const char *v = getenv(name);
	return v && !strcmp(v, val);
}

/* A fresh dispatch that a replay ran: it holds that replay's routing. */
static bool holds_routing(const struct gop *o)
{
	return o->type == EPP_DISPATCH && !(o->flags & EP__GFLAG_CACHED) &&
	       o->k;
}

/* Its gate no longer watched; gs->mu held. */
static void unpend(struct ep_graphs *gs, struct gop *o)
{
	if (o->pending) {
		o->pending = false;
		gs->npending--;
	}
}

static struct gop *handle_op(struct ep_graphs *gs, const ep_handle_t *h)
{
	uint64_t id = h->seq & ~EP__GSEQ;
	return id < gs->nops ? gs->ops[id] : NULL;
}

int ep__graph_init(ep_group_t *g)
{
	if (env_is("EP_GRAPHS", "0"))
		return 0; /* no graph state, captures refused */
	struct ep_graphs *gs = calloc(1, sizeof(*gs));
	if (!gs)
		return ep__fail(EP_ENOMEM, "no memory for the graph state");
	CUresult r = ep__drv.cuMemHostAlloc((void **)&gs->slots, SLOTS_BYTES,
					    CU_MEMHOSTALLOC_DEVICEMAP |
						    CU_MEMHOSTALLOC_PORTABLE);
	if (!r)
		r = ep__drv.cuMemHostGetDevicePointer(&gs->slots_dev, gs->slots,
						      0);
	if (r) {
		if (gs->slots)
			ep__drv.cuMemFreeHost(gs->slots);
		free(gs);
		return ep__cufail(r, "allocating the graph slots");
	}
	memset(gs->slots, 0, SLOTS_BYTES);
	pthread_mutex_init(&gs->mu, NULL);
	pthread_cond_init(&gs->cv, NULL);
	gs->g = g;
	g->gr = gs;
	return 0;
}

/* Async release of routing k (no reply; an error is the connection's). */
static void release_async(ep_group_t *g, uint64_t k)
{
	ep_handle_t h = {.group_id = g->id, .seq = k, .epoch = g->epoch};
	(void)ep__release_async(g, &h);
}

/* Free what is unreferenced; gs->mu held. */
static void op_put(struct ep_graphs *gs, struct gop *o)
{
	if (!o || --o->refs)
		return;
	if (gs->tail == o)
		gs->tail = NULL;
	gs->ops[o->id] = NULL;
	op_put(gs, o->src);
	for (uint32_t i = 0; i < o->nchain; i++)
		op_put(gs, o->chain[i]);
	free(o);
}

static void gs_free_if_done(struct ep_graphs *gs)
{
	/* gs->mu held, and released here */
	bool done = !gs->g && !gs->live;
	pthread_mutex_unlock(&gs->mu);
	if (!done)
		return;
	/* Only the slots' pinned memory would need a CUDA call, which a
	 * user object's destructor may not make: it stays (64 KiB, once per
	 * group left while its graphs lived). */
	free(gs->ops);
	pthread_mutex_destroy(&gs->mu);
	pthread_cond_destroy(&gs->cv);
	free(gs);
}

/* The graph let the record go (CUDA's thread; no CUDA calls). */
static void op_destroy(void *p)
{
	struct gop *o = p;
	struct ep_graphs *gs = o->gs;
	pthread_mutex_lock(&gs->mu);
	o->dead = true;
	unpend(gs, o);
	if (gs->g && holds_routing(o))
		release_async(gs->g, o->k);
	gs->slot_used[o->slot] = false;
	__atomic_store_n(&gs->live, gs->live - 1, __ATOMIC_RELAXED);
	op_put(gs, o);
	gs_free_if_done(gs);
}

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void gs_error(struct ep_graphs *gs, int code, const char *msg)
{
	if (!gs->err) {
		gs->err = code;
		snprintf(gs->msg, sizeof(gs->msg), "%s", msg);
	}
}

/* The group's error from the control page (recorded), or 0. Not
 * ep_group_error: that takes gs->mu, which the caller holds. */
static int group_failed(struct ep_graphs *gs, ep_group_t *g)
{
	int rc = ep__ctl_error(g);
	if (rc) {
		char m[EPP_CTL_MSG_MAX + 1];
		memcpy(m, ep__ctl_slot(g) + EPP_CTL_ERR_MSG, EPP_CTL_MSG_MAX);
		m[EPP_CTL_MSG_MAX] = 0;
		gs_error(gs, rc, m);
	}
	return rc;
}

/* Wait until one more op may be in flight (ep__wait_until: its callers'
 * error path, ep_group_error, would take gs->mu). */
static int inflight_room(struct ep_graphs *gs, ep_group_t *g)
{
	int rc = ep__wait_until(g, EPP_MAX_INFLIGHT - 2);
	if (rc == EP_ETIMEDOUT && !ep__ctl_error(g)) /* this rank's own wait */
		gs_error(gs, rc, ep_errmsg());
	else if (rc)
		group_failed(gs, g);
	return rc;
}

/* Number op o, send its frame and write its slot; rc nonzero (an earlier
 * op of the chain failed) or a failure here: mark it skipped. gs->mu
 * held. */
static int post_one(struct ep_graphs *gs, ep_group_t *g, struct gop *o,
		    int rc)
{
	volatile struct ekc_gslot *s = &gs->slots[o->slot];
	if (o->pending) {
		/* The last replay's wait passed (its gate is open): it is
		 * done. A closed gate: that replay still runs, so this is a
		 * second instance of the graph replayed at the same time,
		 * which would share the op's slot. */
		if (!rc && !s->gate && !s->skip) {
			rc = EP_EBUSY;
			gs_error(gs, rc,
				 "two instances of one CUDA graph replayed at "
				 "the same time (its ops' slots are shared); "
				 "capture the graph once per instance");
		}
		unpend(gs, o);
	}
	if (!rc)
		rc = gs->err;
	if (!g && !rc) {
		rc = EP_ENOGROUP;
		gs_error(gs, rc, "a graph was replayed after its group was "
				 "left");
	}
	if (!rc)
		rc = group_failed(gs, g);
	ep_handle_t h = o->h;
	if (!rc && o->src) {
		if (!o->src->k) {
			rc = EP_EINVAL;
			gs_error(gs, rc,
				 "a captured op names the handle of a captured "
				 "dispatch that no replay ran yet");
		}
		h.seq = o->src->k;
	}
	uint8_t buf[128];
	uint32_t n = 0;
	if (!rc && o->type == EPP_DISPATCH)
		rc = ep__dispatch_request(g, o->tokens, o->flags & ~EP__GFLAG_CACHED,
					  o->flags & EP__GFLAG_CACHED ? &h
								      : NULL,
					  buf, &n);
	else if (!rc && o->type == EPP_COMBINE)
		rc = ep__combine_request(g, &h, o->flags, buf, &n);
	else if (!rc && o->type == EPP_BARRIER) {
		struct epp_wr w;
		epp_wr_init(&w, buf, 8);
		epp_put_u64(&w, g->id);
		n = 8;
	}
	if (rc)
		gs_error(gs, rc, ep_errmsg());
	if (!rc)
		rc = inflight_room(gs, g);
	if (!rc && holds_routing(o))
		release_async(g, o->k); /* the last replay's routing */
	uint64_t k = g ? g->sent + 1 : 0;
	if (!rc && o->type && (rc = ep__send_op(g, o->type, buf, n, k)))
		gs_error(gs, rc, ep_errmsg());
	if (!rc && !o->type && ep__features(g) & EPP_FEAT_HOST_BARRIER)
		ep__hb_post(g, k);
	if (rc) {
		s->skip = 1;
		return rc;
	}
	__atomic_store_n(&g->sent, k, __ATOMIC_RELEASE);
	if (o->type == EPP_DISPATCH)
		g->last_dispatch = k;
	o->k = k;
	s->gate = 0;
	s->k = (uint32_t)k;
	s->skip = 0;
	o->pending = true;
	gs->npending++;
	return 0;
}

/* A replay reached the head of a chain of captured ops: number every op
 * of the chain and send their frames at once, so that the daemon has
 * them early, as for direct ops (CUDA's thread; no CUDA calls). */
static void op_post(void *p)
{
	struct gop *head = p;
	struct ep_graphs *gs = head->gs;
	pthread_mutex_lock(&gs->mu);
	ep_group_t *g = gs->g;
	int rc = post_one(gs, g, head, 0);
	for (uint32_t i = 0; i < head->nchain; i++)
		rc = post_one(gs, g, head->chain[i], rc);
	gs->posted_ns = mono_ns();
	pthread_cond_signal(&gs->cv);
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	pthread_mutex_unlock(&gs->mu);
}

/* Opens the gate of every posted record whose op completed (or of all
 * once the group failed): the stream waits that a kernel's spin left. */
static void *watch(void *arg)
{
	struct ep_graphs *gs = arg;
	pthread_mutex_lock(&gs->mu);
	while (!gs->stop) {
		if (!gs->npending) {
			pthread_cond_wait(&gs->cv, &gs->mu);
			continue;
		}
		ep_group_t *g = gs->g;
		uint64_t done = ep__completed_full(g);
		bool failed = ep__ctl_error(g) != 0;
		for (uint32_t i = 0; i < gs->nops; i++) {
			struct gop *o = gs->ops[i];
			if (!o || !o->pending || (o->k > done && !failed))
				continue;
			__atomic_store_n(&gs->slots[o->slot].gate, 1,
					 __ATOMIC_RELEASE);
			unpend(gs, o);
		}
		/* hard for a millisecond after a post (a gate the kernel did
		 * not open: no MPS, or a long op), gently after */
		bool hard = mono_ns() - gs->posted_ns < 1000000u;
		pthread_mutex_unlock(&gs->mu);
		if (hard)
			sched_yield();
		else
			usleep(50);
		pthread_mutex_lock(&gs->mu);
	}
	pthread_mutex_unlock(&gs->mu);
	return NULL;
}

void ep__graph_fini(ep_group_t *g)
{
	struct ep_graphs *gs = g->gr;
	if (!gs)
		return;
	g->gr = NULL;
	pthread_mutex_lock(&gs->mu);
	/* a replay still waiting on a gate gets it opened (its error is
	 * EP_ENOGROUP from here on) */
	for (uint32_t i = 0; i < gs->nops; i++)
		if (gs->ops[i] && gs->ops[i]->pending)
			__atomic_store_n(&gs->slots[gs->ops[i]->slot].gate, 1,
					 __ATOMIC_RELEASE);
	gs->stop = true;
	pthread_cond_signal(&gs->cv);
	bool watching = gs->watching;
	pthread_mutex_unlock(&gs->mu);
	if (watching)
		pthread_join(gs->watcher, NULL);
	pthread_mutex_lock(&gs->mu);
	gs->g = NULL;
	if (!gs->live) {
		pthread_mutex_unlock(&gs->mu);
		ep__drv.cuMemFreeHost(gs->slots);
		pthread_mutex_lock(&gs->mu);
	}
	gs_free_if_done(gs);
}

int ep__graph_error(ep_group_t *g)
{
	struct ep_graphs *gs = g->gr;
	if (!gs)
		return 0;
	pthread_mutex_lock(&gs->mu);
	int rc = gs->err;
	char msg[sizeof(gs->msg)];
	memcpy(msg, gs->msg, sizeof(msg));
	pthread_mutex_unlock(&gs->mu);
	return rc ? ep__fail(rc, "a replayed CUDA graph: %s", msg) : 0;
}

int ep__graph_direct_ok(ep_group_t *g)
{
	struct ep_graphs *gs = g->gr;
	if (!gs)
		return 0;
	/* every direct op asks: a load, not the lock */
	uint32_t live = __atomic_load_n(&gs->live, __ATOMIC_RELAXED);
	if (live)
		return ep__fail(EP_EBUSY,
				"%u stream-ordered ops of this group are "
				"captured in CUDA graphs that still exist: "
				"until CUDA released them (after "
				"cuGraphExecDestroy and cuGraphDestroy), this "
				"rank's ops of the group go into graphs only "
				"(eager work: join a second group)",
				live);
	return 0;
}

/* Does every path from the capture's current dependencies deps[n] lead
 * back to node (so that what is captured now runs after it)? Looked for
 * through the graph's edges, up to a bound (no: a new chain). */
static bool after(CUgraphNode node, const CUgraphNode *deps, size_t n)
{
	enum { MAXV = 512 };
	CUgraphNode q[MAXV];
	size_t nq = 0;
	if (!n || n > MAXV)
		return false;
	/* every dependency must reach node: one that does not (a branch
	 * forked before it) could run first */
	for (size_t d = 0; d < n; d++) {
		size_t head = nq;
		bool found = false;
		q[nq++] = deps[d];
		while (head < nq && !found) {
			CUgraphNode v = q[head++];
			if (v == node) {
				found = true;
				break;
			}
			size_t m = 0;
			if (ep__drv.cuGraphNodeGetDependencies2(v, NULL, NULL, &m) ||
			    nq + m > MAXV)
				return false;
			if (!m)
				continue;
			if (ep__drv.cuGraphNodeGetDependencies2(v, q + nq, NULL, &m))
				return false;
			nq += m;
		}
		if (!found)
			return false;
		nq = 0;
	}
	return true;
}

/* Record o (its type, tokens, flags and handle h set) takes its place in
 * gs: the captured dispatch h names (its source), the chain it joins
 * (the op just captured on the same capture cid, which the stream's
 * nodes deps follow: posted by that chain's head), a gate slot, and the
 * watcher thread. An error (nothing taken) or 0. */
static int record_add(struct ep_graphs *gs, struct gop *o,
		      const ep_handle_t *h, cuuint64_t cid,
		      const CUgraphNode *deps, size_t ndeps)
{
	pthread_mutex_lock(&gs->mu);
	int rc = 0;
	if (h && h->seq & EP__GSEQ) {
		o->src = handle_op(gs, h);
		if (!o->src || o->src->dead)
			rc = ep__fail(EP_ESTALE,
				      "the handle of a captured dispatch whose "
				      "graph is gone");
		else
			o->src->refs++;
	}
	struct gop *head = NULL;
	if (!rc && gs->tail && !gs->tail->dead && gs->tail_cid == cid &&
	    !env_is("EP_GRAPH_NO_CHAIN", "1") &&
	    after(gs->tail_node, deps, ndeps)) {
		head = gs->tail->head ? gs->tail->head : gs->tail;
		if (head->nchain == EP__GCHAIN)
			head = NULL;
	}
	uint32_t slot = 0;
	while (!rc && slot < NSLOTS && gs->slot_used[slot])
		slot++;
	if (!rc && slot == NSLOTS)
		rc = ep__fail(EP_ELIMIT,
			      "%u ops of this group are captured in graphs "
			      "that exist: destroy some first",
			      NSLOTS);
	if (!rc && gs->nops == gs->cap) {
		uint32_t nc = gs->cap ? gs->cap * 2 : 64;
		struct gop **no = realloc(gs->ops, nc * sizeof(*no));
		if (!no)
			rc = ep__fail(EP_ENOMEM, "no memory for a captured op");
		else {
			gs->ops = no;
			gs->cap = nc;
		}
	}
	if (!rc && !gs->watching) {
		if (pthread_create(&gs->watcher, NULL, watch, gs))
			rc = ep__fail(EP_ENOMEM, "cannot start libep's graph "
						 "watcher thread");
		else
			gs->watching = true;
	}
	if (rc) {
		if (o->src)
			op_put(gs, o->src);
		pthread_mutex_unlock(&gs->mu);
		return rc;
	}
	o->slot = slot;
	o->id = gs->nops;
	if (head) { /* posted by the head's host node */
		o->head = head;
		head->chain[head->nchain++] = o;
		o->refs++;
	}
	gs->slot_used[slot] = true;
	gs->ops[gs->nops++] = o;
	__atomic_store_n(&gs->live, gs->live + 1, __ATOMIC_RELAXED);
	memset(&gs->slots[slot], 0, sizeof(gs->slots[slot]));
	pthread_mutex_unlock(&gs->mu);
	return 0;
}

/* The graph owns record o from here on (a CUDA user object, destroyed
 * with the graph), even if a node cannot be added after (the capture
 * then fails and the graph goes). */
static int record_own(struct ep_graphs *gs, struct gop *o, CUgraph graph)
{
	CUuserObject uo;
	CUresult r = ep__drv.cuUserObjectCreate(&uo, o, op_destroy, 1,
						CU_USER_OBJECT_NO_DESTRUCTOR_SYNC);
	if (r) {
		pthread_mutex_lock(&gs->mu);
		__atomic_store_n(&gs->live, gs->live - 1, __ATOMIC_RELAXED);
		gs->slot_used[o->slot] = false;
		op_put(gs, o);
		pthread_mutex_unlock(&gs->mu);
		return ep__cufail(r, "cuUserObjectCreate");
	}
	r = ep__drv.cuGraphRetainUserObject(graph, uo, 1,
					    CU_GRAPH_USER_OBJECT_MOVE);
	if (r) {
		ep__drv.cuUserObjectRelease(uo, 1);
		return ep__cufail(r, "cuGraphRetainUserObject");
	}
	return 0;
}

/* Record o's nodes on the capturing stream s: its host node (which posts
 * the op; a chain's head posts those after it), the kernel fn that rings
 * the doorbell, and the wait for its gate. */
static int capture_nodes(ep_group_t *g, struct gop *o, CUfunction fn,
			 CUstream s)
{
	CUdeviceptr sd = g->gr->slots_dev + o->slot * sizeof(struct ekc_gslot);
	CUdeviceptr bell = g->dev_ptr + (o->type ? EKC_DOORBELL
						 : EKC_BAR_DOORBELL);
	CUdeviceptr done = g->dev_ptr + EKC_DONE;
	if (!o->type && ep__features(g) & EPP_FEAT_HOST_BARRIER) {
		bell = g->ctl_dev + ep__hb_words(g) + EPP_HB_BELL;
		done = g->ctl_dev + ep__hb_words(g) + EPP_HB_DONE;
	}
	/* As a direct op's wait: the kernel spins for done a short while
	 * only where the daemon says ranks may (EPP_FEAT_KERNEL_WAIT, the
	 * opt-in resident barrier under MPS). Otherwise it only rings and
	 * the watcher opens the gate: without MPS a spinning kernel holds
	 * the GPU's time slice from the daemon, and under MPS a rank's
	 * kernel spinning on what the daemon's kernels write, while those
	 * spin on doorbells, wedges every client of the GPU. */
	struct ekc_post_args a = {
		.slot = (const struct ekc_gslot *)(uintptr_t)sd,
		.gate = (uint32_t *)(uintptr_t)(sd + offsetof(struct ekc_gslot,
							      gate)),
		.bell = (uint32_t *)(uintptr_t)bell,
		.done = (const uint32_t *)(uintptr_t)done,
		.budget_ns = ep__kernel_wait(g) ? ep__ring_spin_ns() : 0};
	void *params[] = {&a};
	CUresult r = o->head ? CUDA_SUCCESS
			     : ep__drv.cuLaunchHostFunc(s, op_post, o);
	if (!r)
		r = ep__drv.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, params,
					   NULL);
	if (!r)
		r = ep__drv.cuStreamWaitValue32(
			s, sd + offsetof(struct ekc_gslot, gate), 1,
			CU_STREAM_WAIT_VALUE_EQ);
	return r ? ep__cufail(r, "capturing the op's nodes") : 0;
}

int ep__graph_capture(ep_group_t *g, uint16_t type, uint32_t tokens,
		      unsigned flags, const ep_handle_t *h, CUstream s,
		      ep_handle_t *out)
{
	struct ep_graphs *gs = g->gr;
	if (!gs)
		return ep__fail(EP_EUNSUPPORTED, "CUDA graph capture is off for this rank (EP_GRAPHS=0)");
	CUstreamCaptureStatus st;
	CUgraph graph;
	cuuint64_t cid;
	const CUgraphNode *deps = NULL;
	size_t ndeps = 0;
	CUresult r = ep__drv.cuStreamGetCaptureInfo3(s, &st, &cid, &graph, &deps,
						     NULL, &ndeps);
	if (r)
		return ep__cufail(r, "cuStreamGetCaptureInfo");
	if (st != CU_STREAM_CAPTURE_STATUS_ACTIVE)
		return ep__fail(EP_EINVAL,
				"the stream's capture was invalidated");
	CUfunction fn = ep__post_fn();
	if (!fn)
		return ep__fail(EP_EBACKEND,
				"libep's kernels are not loaded in this "
				"context");
	struct gop *o = calloc(1, sizeof(*o));
	if (!o)
		return ep__fail(EP_ENOMEM, "no memory for a captured op");
	o->gs = gs;
	o->type = type;
	o->tokens = tokens;
	o->flags = flags;
	o->refs = 1;
	if (h)
		o->h = *h;
	int rc = record_add(gs, o, h, cid, deps, ndeps);
	if (rc) {
		free(o);
		return rc;
	}
	if ((rc = record_own(gs, o, graph)) || (rc = capture_nodes(g, o, fn, s)))
		return rc;
	/* the stream wait just captured: the node a next op must follow to
	 * join this chain */
	if (!ep__drv.cuStreamGetCaptureInfo3(s, &st, NULL, NULL, &deps, NULL,
					      &ndeps)) {
		pthread_mutex_lock(&gs->mu);
		gs->tail = ndeps == 1 ? o : NULL;
		gs->tail_node = ndeps == 1 ? deps[0] : NULL;
		gs->tail_cid = cid;
		pthread_mutex_unlock(&gs->mu);
	}
	if (out)
		*out = (ep_handle_t){.group_id = g->id,
				     .seq = h && (flags & EP__GFLAG_CACHED)
						    ? h->seq
						    : EP__GSEQ | o->id,
				     .epoch = g->epoch,
				     .num_tokens = tokens,
				     .num_recv = UINT32_MAX};
	return 0;
}
