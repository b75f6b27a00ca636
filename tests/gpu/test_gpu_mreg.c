/* SPDX-License-Identifier: MIT */
/*
 * Registered memory on a GPU, in C (ep_combine_stream_mem, protocol 1.13
 * and 1.14): two ranks on one GPU, each with one allocation of the CUDA
 * virtual memory API (POSIX descriptor handles) that holds its combine
 * rows and its output.
 *
 * Asserted, on fresh random inputs every round:
 *   - every mix of the two places (rows from combine_y or read in place,
 *     result into combined or written into the rank's own memory), the two
 *     ranks mixing differently, is bitwise equal to the independent
 *     reference; a result written in place leaves combined untouched;
 *   - libep refuses an output that does not fit its registration
 *     (EP_ESTALE) and a missing output (EP_EINVAL);
 *   - frames forged past libep (this test's sendmsg rewrites the COMBINE
 *     frame that libep checked): an output outside its registration, at a
 *     misaligned offset, of an unknown registration, with more rows than
 *     the group holds, and rows in outside their registration: the group
 *     fails with EP_EINVAL for every rank, the daemon logs why, writes
 *     nothing, and serves the next group.
 *
 * EPD_TEST_SEED repeats a run. Exit 77 without a GPU.
 */
#include "gpu_util.h"
#include "ref.h"
#include "epp.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define POISON 0xa5
#define W 2
#define ROUNDS 12

enum forge {
	F_NONE,
	F_OUT_PAST,   /* out_off: the last 16 bytes of the registration */
	F_OUT_ALIGN,  /* out_off 8 */
	F_OUT_REG,    /* out_reg: one never made */
	F_OUT_ROWS,   /* out_rows: one more than the group's maximum */
	F_IN_PAST,    /* reg_off (the rows in): the last 16 bytes */
	F_N
};

static const char *const forge_why[F_N] = {
	[F_OUT_PAST] = "output has rows outside its registration",
	[F_OUT_ALIGN] = "output has rows outside its registration",
	[F_OUT_REG] = "output names no registration of its",
	[F_OUT_ROWS] = "output has more rows than the group holds",
	[F_IN_PAST] = "has rows outside its registration",
};

struct ctx {
	const struct th_daemon *gpu;
	struct ref_case c;
	uint64_t seed;
	int forge; /* F_NONE: the rounds; else one forged combine */
	char name[32];
	int mixes[4]; /* rounds run of each (rows in place, out in place) */
};

/* This process's forged frame (in the rank that forges; one frame). */
static int forge_mode;
static uint64_t forge_bytes; /* the registration's size */
static uint32_t forge_max;   /* the group's max tokens */

/* libep's frames go out through sendmsg (proto/epp_io.c): the test's own
 * definition is the one its libep calls. The next COMBINE frame with a
 * registered output is rewritten as forge_mode says, after every check of
 * libep's. */
ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
	static ssize_t (*real)(int, const struct msghdr *, int);
	if (!real)
		real = (ssize_t(*)(int, const struct msghdr *, int))dlsym(
			RTLD_NEXT, "sendmsg");
	if (forge_mode && msg->msg_iovlen == 1 &&
	    msg->msg_iov[0].iov_len >= EPP_HDR_SIZE + 8) {
		uint8_t *b = msg->msg_iov[0].iov_base;
		struct epp_hdr h;
		struct epp_combine cb;
		if (!epp_hdr_decode(b, &h, NULL, 0) && h.type == EPP_COMBINE &&
		    EPP_HDR_SIZE + (size_t)h.length == msg->msg_iov[0].iov_len &&
		    !epp_combine_decode(b + EPP_HDR_SIZE, h.length - 8, &cb) &&
		    (cb.flags & EPP_COMBINE_OUTREG)) {
			switch (forge_mode) {
			case F_OUT_PAST: cb.out_off = forge_bytes - 16; break;
			case F_OUT_ALIGN: cb.out_off = 8; break;
			case F_OUT_REG: cb.out_reg = 999; break;
			case F_OUT_ROWS: cb.out_rows = forge_max + 1; break;
			case F_IN_PAST: cb.reg_off = forge_bytes - 16; break;
			}
			/* the same flags: the same length */
			if (epp_combine_encode(&cb, b + EPP_HDR_SIZE,
					       h.length - 8) == h.length - 8)
				forge_mode = F_NONE;
		}
	}
	return real(fd, msg, flags);
}

/* One allocation of the virtual memory API, mapped read-write. */
static CUdeviceptr vmm_alloc(int gpu, size_t need, size_t *size,
			     CUmemGenericAllocationHandle *mh)
{
	CUmemAllocationProp prop = {
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
		.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = gpu}};
	size_t gran;
	CU(tg_drv.cuMemGetAllocationGranularity(
		&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
	*size = (need + gran - 1) / gran * gran;
	CUdeviceptr va;
	CU(tg_drv.cuMemCreate(mh, *size, &prop, 0));
	CU(tg_drv.cuMemAddressReserve(&va, *size, 0, 0, 0));
	CU(tg_drv.cuMemMap(va, *size, 0, *mh, 0));
	CUmemAccessDesc acc = {.location = prop.location,
			       .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	CU(tg_drv.cuMemSetAccess(va, *size, &acc, 1));
	return va;
}

static void down(void *dst, CUdeviceptr src, size_t n)
{
	if (n)
		CU(tg_drv.cuMemcpyDtoH(dst, src, n));
}

static void up(CUdeviceptr dst, const void *src, size_t n)
{
	if (n)
		tg_upload(dst, src, n);
}

static int rank_main(int r, void *arg)
{
	struct ctx *x = arg;
	struct ref_case c = x->c;
	const uint32_t H = c.hidden, K = c.topk, T = c.tokens[r];
	const uint64_t cap = (uint64_t)W * c.max_tokens;
	const size_t rowb = (size_t)H * 2;
	int gpu;
	CUstream st = tg_rank_init(r, &gpu, NULL, 0, NULL);
	struct ep_group_config cfg = {
		.name = x->name, .world_size = W, .ranks_per_node = W,
		.rank = (uint32_t)r, .num_experts = c.experts, .hidden = H,
		.max_tokens_per_rank = c.max_tokens, .topk = K,
		.dtype = EP_DTYPE_BF16, .timeout_ms = 20000,
		.cuda_device = gpu};
	ep_conn_t *gc;
	ep_group_t *g;
	TH_OK(ep_connect(x->gpu->sock, &gc));
	TH_OK(ep_join(gc, &cfg, EP_JOIN_CUDA, &g));
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	/* the rank's own memory: its output, then its rows */
	const size_t out_bytes = ((size_t)c.max_tokens * rowb + 255) & ~255ul;
	size_t size;
	CUmemGenericAllocationHandle mh;
	CUdeviceptr va = vmm_alloc(gpu, out_bytes + cap * rowb, &size, &mh);
	const CUdeviceptr out_d = va, y_d = va + out_bytes;
	ep_mreg_t *mr;
	TH_OK(ep_mem_register(g, (const void *)(uintptr_t)va, size, &mr));
	uint8_t *got = malloc((size_t)c.max_tokens * rowb + 1);
	uint8_t *want = malloc((size_t)c.max_tokens * rowb + 1);
	uint8_t *poison = malloc((size_t)c.max_tokens * rowb + 1);
	memset(poison, POISON, (size_t)c.max_tokens * rowb);
	const int rounds = x->forge ? 1 : ROUNDS;
	for (int i = 0; i < rounds; i++) {
		c.seed = x->seed + (uint64_t)i * 7919u;
		struct ref_inputs in[W], in2[W];
		struct ref_recv exp[W], exp2[W];
		ref_gen_world(&c, in, in2, exp, exp2);
		up(tg_dptr(b.x), in[r].x, (size_t)T * rowb);
		up(tg_dptr(b.topk_idx), in[r].topk, (size_t)T * K * 8);
		up(tg_dptr(b.topk_weights), in[r].weights, (size_t)T * K * 4);
		up(tg_dptr(b.combine_bias), in[r].bias, (size_t)T * rowb);
		ep_handle_t h;
		TH_OK(ep_dispatch_stream(g, T, EP_DISPATCH_WEIGHTS, NULL, st,
					 &h));
		TH_OK(ep_dispatch_recv_count(g, &h));
		const uint32_t R = h.num_recv;
		TH_CHECK(R == exp[r].R, "round %d rank %d: %u rows, want %u", i,
			 r, R, exp[r].R);
		uint16_t *ys[W];
		for (uint32_t d = 0; d < W; d++)
			ys[d] = ref_gen_y(&c, d, exp[d].R, (uint64_t)i);
		/* the mix of places: the two ranks differ every round */
		const int mix = x->forge ? (r == 0 ? 3 : 0) : (i + r) % 4;
		const bool yin = mix & 1, oin = mix & 2;
		x->mixes[mix] += r == 0;
		up(yin ? y_d : tg_dptr(b.combine_y), ys[r], (size_t)R * rowb);
		CU(tg_drv.cuMemsetD8(tg_dptr(b.combined), POISON,
				     (size_t)c.max_tokens * rowb));
		CU(tg_drv.cuMemsetD8(out_d, POISON, out_bytes));
		struct ep_combine_mem m = {
			.y_reg = yin ? mr : NULL,
			.y = yin ? (const void *)(uintptr_t)y_d : NULL,
			.rows = R,
			.out_reg = oin ? mr : NULL,
			.out = oin ? (void *)(uintptr_t)out_d : NULL};
		if (i == 0 && !x->forge && T) {
			/* libep's own refusals (nothing goes out): an output
			 * that does not fit its registration, none at all */
			struct ep_combine_mem bad = m;
			bad.out_reg = mr;
			bad.out = (void *)(uintptr_t)(va + size - 16);
			TH_EXPECT_RC(ep_combine_stream_mem(g, &h,
							   EP_COMBINE_BIAS,
							   &bad, st),
				     EP_ESTALE);
			bad.out = NULL;
			TH_EXPECT_RC(ep_combine_stream_mem(g, &h,
							   EP_COMBINE_BIAS,
							   &bad, st),
				     EP_EINVAL);
		}
		if (x->forge && r == 0) {
			forge_mode = x->forge;
			forge_bytes = size;
			forge_max = c.max_tokens;
		}
		/* the group's failure (forged) may come back at once, with
		 * the daemon's reply to a rank's next frame, or at the sync */
		int rc1 = ep_combine_stream_mem(g, &h, EP_COMBINE_BIAS, &m, st);
		if (!x->forge)
			TH_OK(rc1);
		CU(tg_drv.cuStreamSynchronize(st));
		if (x->forge) {
			TH_CHECK(r != 0 || forge_mode == F_NONE,
				 "the frame was not forged");
			int rc = ep_group_sync(g);
			TH_CHECK(rc1 == EP_EINVAL || (!rc1 && rc == EP_EINVAL),
				 "forged %d rank %d: the combine gave %d, the "
				 "group's error is %d (%s), want EP_EINVAL",
				 x->forge, r, rc1, rc, ep_errmsg());
			/* nothing was written, in place or not */
			down(got, out_d, (size_t)T * rowb);
			TH_CHECK(th_first_diff(got, poison, (size_t)T * rowb) ==
					 (size_t)T * rowb,
				 "forged %d rank %d: its memory was written",
				 x->forge, r);
		} else {
			TH_OK(ep_group_sync(g));
			ref_combine(&c, in, exp, ys, (uint32_t)r,
				    (uint16_t *)want);
			down(got, oin ? out_d : tg_dptr(b.combined),
			     (size_t)T * rowb);
			size_t d = th_first_diff(got, want, (size_t)T * rowb);
			TH_CHECK(d == (size_t)T * rowb,
				 "round %d rank %d mix %d: combined differs at "
				 "byte %zu of %zu",
				 i, r, mix, d, (size_t)T * rowb);
			if (oin) { /* and combined was not written */
				down(got, tg_dptr(b.combined),
				     (size_t)T * rowb);
				TH_CHECK(th_first_diff(got, poison,
						       (size_t)T * rowb) ==
						 (size_t)T * rowb,
					 "round %d rank %d: combined written "
					 "as well",
					 i, r);
			}
			TH_OK(ep_handle_release(g, &h));
		}
		for (uint32_t d = 0; d < W; d++) {
			free(ys[d]);
			ref_free_inputs(&in[d]);
			ref_free_inputs(&in2[d]);
			ref_free_recv(&exp[d]);
			ref_free_recv(&exp2[d]);
		}
	}
	if (!x->forge) {
		TH_OK(ep_mem_deregister(mr));
		TH_OK(ep_barrier(g));
	}
	TH_OK(ep_leave(g));
	ep_close(gc);
	CU(tg_drv.cuMemUnmap(va, size));
	CU(tg_drv.cuMemAddressFree(va, size));
	CU(tg_drv.cuMemRelease(mh));
	free(got);
	free(want);
	free(poison);
	return 0;
}

static void run(struct ctx *x, const char *what)
{
	pid_t pids[W];
	th_spawn(pids, W, rank_main, x);
	TH_CHECK(th_wait_all(pids, W, 200) == 0, "%s failed", what);
}

/* Does the daemon's log say group name failed, with want and without
 * unwanted (NULL: anything)? */
static bool log_has(const struct th_daemon *d, const char *name,
		    const char *want, const char *unwanted)
{
	FILE *f = fopen(d->log, "r");
	if (!f)
		return false;
	char line[4096], head[64];
	snprintf(head, sizeof(head), "group %s failed", name);
	bool found = false;
	while (!found && fgets(line, sizeof(line), f))
		found = strstr(line, head) && strstr(line, want) &&
			!(unwanted && strstr(line, unwanted));
	fclose(f);
	return found;
}

int main(void)
{
	th_init("gpu: registered memory, rows in and the result out", 600);
	if (tg_probe())
		return TH_SKIP;
	uint64_t seed = th_seed();
	struct th_daemon gpu;
	th_daemon_start(&gpu, "--backend", "cuda", NULL);
	struct ctx *x = th_shared(sizeof(*x));
	x->gpu = &gpu;
	x->seed = seed;
	x->c = (struct ref_case){.world = W, .experts = 8, .hidden = 512,
				 .topk = 4, .max_tokens = 64,
				 .tokens = {64, 37}, .dtype = EP_DTYPE_BF16,
				 .weights = true, .bias = true};
	snprintf(x->name, sizeof(x->name), "mreg");
	run(x, "rounds");
	printf("ok: %d rounds, rows in place / out in place mixed (%d %d %d "
	       "%d rounds of each on rank 0), bitwise equal to the reference; "
	       "combined untouched where the result went to the rank's "
	       "memory\n",
	       ROUNDS, x->mixes[0], x->mixes[1], x->mixes[2], x->mixes[3]);
	printf("ok: libep refuses an output past its registration "
	       "(EP_ESTALE) and a missing one (EP_EINVAL)\n");
	x->c.tokens[1] = 0; /* a rank with no tokens: it writes nothing */
	snprintf(x->name, sizeof(x->name), "mreg-t0");
	run(x, "rounds with a rank of no tokens");
	printf("ok: the same with a rank of no tokens\n");
	x->c.tokens[1] = 37;
	for (int f = F_OUT_PAST; f < F_N; f++) {
		x->forge = f;
		snprintf(x->name, sizeof(x->name), "mreg-forged%d", f);
		run(x, x->name);
		TH_CHECK(log_has(&gpu, x->name, forge_why[f],
				 f == F_IN_PAST ? "output" : NULL),
			 "the daemon's log does not say why group %s failed "
			 "('%s')",
			 x->name, forge_why[f]);
		printf("ok: forged combine %d (%s): EP_EINVAL on both ranks, "
		       "nothing written, the reason in the daemon's log\n",
		       f, forge_why[f]);
	}
	x->forge = F_NONE;
	snprintf(x->name, sizeof(x->name), "mreg-after");
	run(x, "rounds after the forged frames");
	printf("ok: the daemon serves the next group bitwise\n");
	TH_CHECK(th_daemon_alive(&gpu), "the daemon died");
	th_daemon_stop(&gpu);
	return 0;
}
