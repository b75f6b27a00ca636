/* SPDX-License-Identifier: MIT */
#include "gpu_util.h"

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

struct ekc_driver tg_drv;

CUstream tg_rank_init(int rank, int *gpu, void *p, size_t len,
		      CUdeviceptr *dev)
{
	char err[256];
	TH_CHECK(ekc_load(&tg_drv, err, sizeof(err)) == 0, "%s", err);
	int n = 1, which = 0;
	CU(tg_drv.cuDeviceGetCount(&n));
	const char *sp = getenv("EPD_GPU_SPREAD");
	if (sp && *sp == '1' && n > 0)
		which = rank % n;
	if (gpu)
		*gpu = which;
	CUdevice d;
	CUcontext ctx;
	CU(tg_drv.cuDeviceGet(&d, which));
	CU(tg_drv.cuDevicePrimaryCtxRetain(&ctx, d));
	CU(tg_drv.cuCtxSetCurrent(ctx));
	if (p) {
		uintptr_t page = (uintptr_t)p & ~(uintptr_t)4095;
		size_t sz = ((uintptr_t)p + len - page + 4095) & ~(size_t)4095;
		CU(tg_drv.cuMemHostRegister((void *)page, sz,
					    CU_MEMHOSTREGISTER_DEVICEMAP |
						    CU_MEMHOSTREGISTER_PORTABLE));
		CU(tg_drv.cuMemHostGetDevicePointer(dev, p, 0));
	}
	CUstream st;
	CU(tg_drv.cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
	return st;
}

ep_group_t *tg_ll_join(const char *sock, const char *name, uint32_t world,
		       uint32_t rpn, uint32_t r, uint32_t experts,
		       uint32_t hidden, uint32_t topk, uint32_t timeout_ms,
		       CUstream *st, ep_conn_t **conn)
{
	int gpu;
	*st = tg_rank_init((int)r, &gpu, NULL, 0, NULL);
	struct ep_group_config cfg = th_group(name, world, r, timeout_ms);
	if (rpn)
		cfg.ranks_per_node = rpn;
	cfg.num_experts = experts;
	cfg.hidden = hidden;
	cfg.topk = topk;
	cfg.cuda_device = gpu;
	ep_group_t *g;
	TH_OK(ep_connect(sock, conn));
	TH_OK(ep_join(*conn, &cfg, EP_JOIN_CUDA, &g));
	return g;
}

uint16_t tg_bf16_rand(uint64_t *s, int scale_exp)
{
	uint64_t v = ref_mix(s);
	uint16_t e = (uint16_t)(127 + scale_exp + (int)(v % 5) - 2);
	switch (v % 64) {
	case 0: return 0x0000;
	case 1: return 0x8000;
	case 2: return (uint16_t)(((e > 20 ? e - 20 : 1) << 7) | (v >> 9 & 0x7f));
	default:
		return (uint16_t)((v >> 8 & 1) << 15 | e << 7 | (v >> 9 & 0x7f));
	}
}

void tg_upload(CUdeviceptr dst, const void *src, size_t n)
{
	CU(tg_drv.cuMemcpyHtoD(dst, src, n));
	CU(tg_drv.cuStreamSynchronize(NULL));
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

double tg_median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(double), cmp_double);
	return v[n / 2];
}

void tg_line_up(uint32_t *arrive, uint32_t *gen, uint32_t n)
{
	uint32_t g = __atomic_load_n(gen, __ATOMIC_SEQ_CST);
	if (__atomic_add_fetch(arrive, 1, __ATOMIC_SEQ_CST) == n) {
		__atomic_store_n(arrive, 0, __ATOMIC_SEQ_CST);
		__atomic_add_fetch(gen, 1, __ATOMIC_SEQ_CST);
	} else {
		while (__atomic_load_n(gen, __ATOMIC_SEQ_CST) == g)
			;
	}
}

static int probe(int i, void *arg)
{
	(void)i, (void)arg;
	char err[256];
	if (ekc_load(&tg_drv, err, sizeof(err))) {
		printf("skip: %s\n", err);
		return TH_SKIP;
	}
	int n = 0;
	if (tg_drv.cuDeviceGetCount(&n) || n < 1) {
		printf("skip: no GPU\n");
		return TH_SKIP;
	}
	return 0;
}

int tg_probe(void)
{
	pid_t p;
	int st;
	th_spawn(&p, 1, probe, NULL);
	waitpid(p, &st, 0);
	if (!WIFEXITED(st) || WEXITSTATUS(st) == TH_SKIP)
		return TH_SKIP;
	TH_CHECK(WEXITSTATUS(st) == 0, "GPU probe failed");
	return 0;
}

int tg_barrier_after_graphs(ep_group_t *g, CUstream st)
{
	int rc = EP_EBUSY;
	for (int tries = 0; rc == EP_EBUSY && tries < 1000; tries++) {
		rc = ep_barrier_stream(g, st);
		if (rc == EP_EBUSY)
			th_sleep_ms(2);
	}
	return rc;
}

const char *tg_cluster2(struct th_daemon d[2], const char *tag, int miss)
{
	char m[40];
	snprintf(m, sizeof(m), "heartbeat_miss=%d", miss);
	const char *extra[] = {"-b", "cuda", "-o", m, NULL};
	th_cluster_start(d, 2, tag, extra);
	const char *tr = getenv("EPD_TEST_TRANSPORT");
	return tr && *tr ? tr : "tcp";
}
