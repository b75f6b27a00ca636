/* SPDX-License-Identifier: MIT */
/*
 * bench_gpu: dispatch and combine on the CUDA backend, DeepSeek-V3 shape
 * (8 ranks on one GPU, 4096 tokens per rank, hidden 7168, top-8 of 256
 * experts), bf16 and fp8, with the daemon's kernels on all SMs and on 16,
 * 32 and 66. Reports time per call (device time on rank 0's stream, ranks
 * lined up by a device barrier first), GB/s counting the fewest bytes (each
 * input read once, each output written once) and the ratio to a
 * device-to-device copy measured in the same run. Random inputs.
 *
 * EPD_BENCH_TOKENS, EPD_BENCH_ITERS override; EPD_BENCH_REF=file holds a
 * reference's "dispatch_ms combine_ms" to print the speed-up over it.
 */
#include "gpu_util.h"

#include <string.h>
#include <unistd.h>

#define MAXW 8
static int W = 8; /* EPD_BENCH_RANKS */

/* EPD_CUDA_TRACE: the daemon's stage spans of its last dispatch and
 * combine, from its status. */
static void print_trace(const char *js, const char *what)
{
	const char *p = strstr(js, "\"trace_us\":"), *e;
	int depth = 0;
	if (!p)
		return;
	e = p + 11;
	do
		depth += *e == '{' ? 1 : *e == '}' ? -1 : 0;
	while (*e && depth && e++);
	printf("perf: stage spans, %s (us from the first kernel start): "
	       "%.*s\n", what, (int)(e - p - 10), p + 11);
	if ((p = strstr(js, "\"last_dispatch_cpu_us\":")))
		printf("perf: the daemon's CPU, %s (first to last rank's "
		       "message, to the enqueue, the enqueue): %.*s\n", what,
		       (int)(strchr(p, '}') - p - 22), p + 23);
}

/* The daemon's status once its completion poll (every ms) has seen the
 * ops just synced. */
static char *settled_status(ep_conn_t *c)
{
	char *js;
	usleep(20000);
	TH_OK(ep_daemon_status(c, &js));
	return js;
}

/* A number of the status: the value after "key": (0 if absent). */
static double status_num(const char *js, const char *key)
{
	char k[64];
	snprintf(k, sizeof(k), "\"%s\":", key);
	const char *p = strstr(js, k);
	return p ? atof(p + strlen(k)) : 0;
}

struct shared {
	const struct th_daemon *d;
	int sms_cap; /* cuda_sms of this daemon (0: all) */
	int sms_used[2]; /* EPD_CUDA_TRACE: the SMs of the copy, combine */
	uint32_t T, H, K, E;
	int fp8, iters;
	uint64_t recv[MAXW];
	double disp_ms[64], comb_ms[64];
	double pdisp_ms[64], pcomb_ms[64]; /* pipelined: no CPU sync */
	double cdisp_ms[64]; /* cached dispatches, pipelined */
	double kcdisp_us;    /* the daemon's kernels, the last cached one */
	double d2d_gbs, fill_gbs;
	double kdisp_us, kcomb_us; /* the daemon's kernels alone */
};

/* Median device time (ms) of 9 runs: a copy of n bytes a -> b, or (b = 0)
 * a fill of a. */
static double ceiling_ms(CUdeviceptr a, CUdeviceptr b, size_t n)
{
	CUevent e0, e1;
	CU(tg_drv.cuEventCreate(&e0, 0));
	CU(tg_drv.cuEventCreate(&e1, 0));
	double t[9];
	for (int i = 0; i < 9; i++) {
		CU(tg_drv.cuEventRecord(e0, 0));
		if (b)
			CU(tg_drv.cuMemcpyDtoD(b, a, n));
		else
			CU(tg_drv.cuMemsetD32(a, 0x3f800000u + (unsigned)i,
					      n / 4));
		CU(tg_drv.cuEventRecord(e1, 0));
		CU(tg_drv.cuEventSynchronize(e1));
		float ms;
		CU(tg_drv.cuEventElapsedTime(&ms, e0, e1));
		t[i] = ms;
	}
	CU(tg_drv.cuEventDestroy(e0));
	CU(tg_drv.cuEventDestroy(e1));
	return tg_median(t, 9);
}

/* Read+write ceiling: a device-to-device copy of 2 GiB. */
static double d2d(void)
{
	size_t n = 2ull << 30;
	CUdeviceptr a, b;
	CU(tg_drv.cuMemAlloc(&a, n));
	CU(tg_drv.cuMemAlloc(&b, n));
	CU(tg_drv.cuMemsetD32(a, 0x3f803f80, n / 4));
	double ms = ceiling_ms(a, b, n);
	CU(tg_drv.cuMemFree(a));
	CU(tg_drv.cuMemFree(b));
	return 2.0 * (double)n / (ms / 1e3) / 1e9;
}

/* Write-only ceiling: a fill of 2 GiB (dispatch writes ~5 rows per token
 * it reads, so its mix sits between a copy and a fill). */
static double fill(void)
{
	size_t n = 2ull << 30;
	CUdeviceptr a;
	CU(tg_drv.cuMemAlloc(&a, n));
	double ms = ceiling_ms(a, 0, n);
	CU(tg_drv.cuMemFree(a));
	return (double)n / (ms / 1e3) / 1e9;
}

static int rank_main(int r, void *arg)
{
	struct shared *s = arg;
	int gpu;
	CUstream st = tg_rank_init(r, &gpu, NULL, 0, NULL);
	const uint32_t T = s->T, H = s->H, K = s->K, E = s->E;
	const uint32_t elt = s->fp8 ? 1 : 2, ns = s->fp8 ? H / 128 : 0;
	struct ep_group_config cfg = {
		.name = "bench", .world_size = (uint32_t)W,
		.ranks_per_node = (uint32_t)W,
		.rank = (uint32_t)r, .num_experts = E, .hidden = H,
		.max_tokens_per_rank = T, .topk = K,
		.dtype = s->fp8 ? EP_DTYPE_FP8 : EP_DTYPE_BF16,
		.timeout_ms = 60000, .cuda_device = gpu};
	ep_conn_t *c;
	ep_group_t *g;
	TH_OK(ep_connect(s->d->sock, &c));
	TH_OK(ep_join(c, &cfg, EP_JOIN_CUDA, &g));
	struct ep_buffers b;
	TH_OK(ep_get_buffers(g, &b));
	/* random inputs: moderate bf16 values (or fp8 bytes and scales),
	 * distinct experts per token */
	uint64_t seed = 77 + (uint64_t)r;
	size_t nx = (size_t)T * H;
	uint8_t *x = malloc(nx * elt);
	for (size_t i = 0; i < nx; i++) {
		uint64_t v = ref_mix(&seed);
		if (s->fp8)
			x[i] = (uint8_t)v;
		else
			((uint16_t *)x)[i] = (uint16_t)(0x3c00 + v % 0x800);
	}
	int64_t *idx = malloc((size_t)T * K * 8);
	float *w = malloc((size_t)T * K * 4), *sc = malloc((size_t)T * ns * 4 + 4);
	for (uint32_t t = 0; t < T; t++)
		for (uint32_t k = 0; k < K; k++) {
			int64_t e;
			bool dup;
			do {
				e = (int64_t)(ref_mix(&seed) % E);
				dup = false;
				for (uint32_t j = 0; j < k; j++)
					dup |= idx[(size_t)t * K + j] == e;
			} while (dup);
			idx[(size_t)t * K + k] = e;
			w[(size_t)t * K + k] = 1.0f / (float)K;
		}
	for (size_t i = 0; i < (size_t)T * ns; i++)
		sc[i] = 1.0f + (float)(ref_mix(&seed) % 100);
	tg_upload((CUdeviceptr)(uintptr_t)b.x, x, nx * elt);
	tg_upload((CUdeviceptr)(uintptr_t)b.topk_idx, idx,
			       (size_t)T * K * 8);
	tg_upload((CUdeviceptr)(uintptr_t)b.topk_weights, w,
			       (size_t)T * K * 4);
	if (ns)
		tg_upload((CUdeviceptr)(uintptr_t)b.x_scales, sc,
				       (size_t)T * ns * 4);
	/* y for combine: random bf16 rows, all of them */
	uint64_t maxr = (uint64_t)W * T;
	uint16_t *y = malloc(maxr * H * 2);
	for (size_t i = 0; i < maxr * H; i++)
		y[i] = (uint16_t)(0x3c00 + ref_mix(&seed) % 0x800);
	tg_upload((CUdeviceptr)(uintptr_t)b.combine_y, y,
			       maxr * H * 2);
	free(y);
	ep_handle_t h;
	/* EPD_BENCH_KEEP_HANDLES=1: the timed loops release nothing (an A/B of
	 * the release requests' cost; the handles go with the group) */
	const bool keep = getenv("EPD_BENCH_KEEP_HANDLES") != NULL;
	for (int i = 0; i < 3; i++) {
		TH_OK(ep_dispatch_stream(g, T, EP_DISPATCH_WEIGHTS, NULL, st,
					 &h));
		TH_OK(ep_combine_stream(g, &h, 0, st));
		TH_OK(ep_handle_release(g, &h));
	}
	TH_OK(ep_dispatch_stream(g, T, EP_DISPATCH_WEIGHTS, NULL, st, &h));
	TH_OK(ep_dispatch_recv_count(g, &h));
	TH_OK(ep_handle_release(g, &h));
	s->recv[r] = h.num_recv;
	CUevent ev[4];
	for (int i = 0; i < 4; i++)
		CU(tg_drv.cuEventCreate(&ev[i], 0));
	for (int i = 0; i < s->iters; i++) {
		TH_OK(ep_barrier_stream(g, st));
		CU(tg_drv.cuEventRecord(ev[0], st));
		TH_OK(ep_dispatch_stream(g, T, EP_DISPATCH_WEIGHTS, NULL, st,
					 &h));
		CU(tg_drv.cuEventRecord(ev[1], st));
		TH_OK(ep_barrier_stream(g, st));
		CU(tg_drv.cuEventRecord(ev[2], st));
		TH_OK(ep_combine_stream(g, &h, 0, st));
		CU(tg_drv.cuEventRecord(ev[3], st));
		if (!keep)
			TH_OK(ep_handle_release(g, &h));
		CU(tg_drv.cuStreamSynchronize(st));
		if (r == 0) {
			float a, bb;
			CU(tg_drv.cuEventElapsedTime(&a, ev[0], ev[1]));
			CU(tg_drv.cuEventElapsedTime(&bb, ev[2], ev[3]));
			s->disp_ms[i] = a;
			s->comb_ms[i] = bb;
		}
	}
	if (r == 0 && getenv("EPD_CUDA_TRACE")) {
		char *js = settled_status(c);
		print_trace(js, "one op");
		free(js);
	}
	/* Pipelined, as a training loop runs: everything enqueued first, one
	 * CPU sync at the end, events read afterwards. */
	CUevent pev[64][4];
	for (int i = 0; i < s->iters; i++)
		for (int j = 0; j < 4; j++)
			CU(tg_drv.cuEventCreate(&pev[i][j], 0));
	for (int i = 0; i < s->iters; i++) {
		TH_OK(ep_barrier_stream(g, st));
		CU(tg_drv.cuEventRecord(pev[i][0], st));
		TH_OK(ep_dispatch_stream(g, T, EP_DISPATCH_WEIGHTS, NULL, st,
					 &h));
		CU(tg_drv.cuEventRecord(pev[i][1], st));
		TH_OK(ep_barrier_stream(g, st));
		CU(tg_drv.cuEventRecord(pev[i][2], st));
		TH_OK(ep_combine_stream(g, &h, 0, st));
		CU(tg_drv.cuEventRecord(pev[i][3], st));
		if (!keep)
			TH_OK(ep_handle_release(g, &h));
	}
	CU(tg_drv.cuStreamSynchronize(st));
	for (int i = 0; i < s->iters && r == 0; i++) {
		float a, bb;
		CU(tg_drv.cuEventElapsedTime(&a, pev[i][0], pev[i][1]));
		CU(tg_drv.cuEventElapsedTime(&bb, pev[i][2], pev[i][3]));
		s->pdisp_ms[i] = a;
		s->pcomb_ms[i] = bb;
	}
	TH_OK(ep_group_sync(g));
	TH_OK(ep_barrier(g));
	if (r == 0) {
		char *js = settled_status(c), *p;
		s->kdisp_us = status_num(js, "last_dispatch_us");
		s->kcomb_us = status_num(js, "last_combine_us");
		print_trace(js, "pipelined");
		/* the SMs the row copy and the combine ran on (trace) */
		for (int op = 0; op < 2; op++) {
			const char *q = strstr(js, "\"trace_us\":");
			q = q ? strstr(q, op ? "\"combine\":{" : "\"dispatch\":{")
			      : NULL;
			q = q ? strstr(q, "\"sms\":") : NULL;
			s->sms_used[op] = q ? atoi(q + 6) : -1;
		}
		p = strstr(js, "\"row_copy_sms\":");
		const char *q = strstr(js, "\"row_copy_blocks_per_sm\":");
		printf("perf: row copy %s on %d SMs' worth, %d blocks a SM, "
		       "prep %s, pdl %s, barrier %s\n",
		       strstr(js, "\"row_copy\":\"tma\"") ? "tma" : "simt",
		       p ? atoi(p + 15) : -1, q ? atoi(q + 25) : -1,
		       strstr(js, "\"dispatch_prep\":\"fused\"") ? "fused" : "split",
		       strstr(js, "\"pdl\":true") ? "yes" : "no",
		       strstr(js, "\"barrier\":\"kernel\"") ? "resident kernel"
		       : strstr(js, "\"barrier\":\"host\"") ? "host thread"
							     : "stream ops");
		free(js);
		s->d2d_gbs = d2d();
		s->fill_gbs = fill();
	}
	TH_OK(ep_barrier(g));
	/* Cached dispatches, pipelined: one fresh dispatch's routing reused,
	 * as a training step's backward pass or DeepEP's cached mode does
	 * (the daemon's row copy alone). */
	ep_handle_t hf, hc;
	TH_OK(ep_dispatch_stream(g, T, EP_DISPATCH_WEIGHTS, NULL, st, &hf));
	for (int i = 0; i < s->iters; i++) {
		TH_OK(ep_barrier_stream(g, st));
		CU(tg_drv.cuEventRecord(pev[i][0], st));
		TH_OK(ep_dispatch_stream(g, T, 0, &hf, st, &hc));
		CU(tg_drv.cuEventRecord(pev[i][1], st));
		TH_CHECK(hc.seq == hf.seq, "a cached dispatch keeps its handle");
	}
	CU(tg_drv.cuStreamSynchronize(st));
	for (int i = 0; i < s->iters && r == 0; i++) {
		float a;
		CU(tg_drv.cuEventElapsedTime(&a, pev[i][0], pev[i][1]));
		s->cdisp_ms[i] = a;
	}
	TH_OK(ep_handle_release(g, &hf));
	TH_OK(ep_group_sync(g));
	TH_OK(ep_barrier(g));
	if (r == 0) {
		char *js = settled_status(c);
		s->kcdisp_us = status_num(js, "last_dispatch_us");
		free(js);
	}
	TH_OK(ep_barrier(g));
	TH_OK(ep_leave(g));
	ep_close(c);
	return 0;
}

int main(void)
{
	th_init("gpu: dispatch/combine benchmark", 550);
	if (tg_probe())
		return TH_SKIP;
	struct shared *s = th_shared(sizeof(*s));
	s->T = getenv("EPD_BENCH_TOKENS") ? (uint32_t)atoi(getenv(
						    "EPD_BENCH_TOKENS"))
					  : 4096;
	s->iters = getenv("EPD_BENCH_ITERS") ? atoi(getenv("EPD_BENCH_ITERS"))
					     : 20;
	if (s->iters > 64)
		s->iters = 64;
	if (getenv("EPD_BENCH_RANKS"))
		W = atoi(getenv("EPD_BENCH_RANKS"));
	TH_CHECK(W >= 1 && W <= MAXW && 256 % W == 0, "EPD_BENCH_RANKS");
	s->H = 7168;
	s->K = 8;
	s->E = 256;
	double ref_d = 0, ref_c = 0;
	if (getenv("EPD_BENCH_REF")) {
		FILE *f = fopen(getenv("EPD_BENCH_REF"), "r");
		if (f) {
			if (fscanf(f, "%lf %lf", &ref_d, &ref_c) != 2)
				ref_d = ref_c = 0;
			fclose(f);
		}
	}
	/* EPD_BENCH_SMS=a,b,...: bf16 (fp8 with EPD_BENCH_FP8=1) at these SM
	 * counts only (0: all) */
	char *sms[16] = {"0", "16", "32", "66"}, smsbuf[128];
	int nsms = 4, sweep = getenv("EPD_BENCH_SMS") != NULL;
	if (sweep) {
		snprintf(smsbuf, sizeof(smsbuf), "%s", getenv("EPD_BENCH_SMS"));
		nsms = 0;
		for (char *tok = strtok(smsbuf, ","); tok && nsms < 16;
		     tok = strtok(NULL, ","))
			sms[nsms++] = tok;
	}
	int only = getenv("EPD_BENCH_ONLY") != NULL; /* bf16, all SMs */
	const char *f8 = getenv("EPD_BENCH_FP8");
	for (int fp8 = sweep && f8 && *f8 == '1'; fp8 < 2; fp8++) {
		for (int i = 0; i < nsms; i++) {
			if ((fp8 || only) && i && !sweep) /* fp8: all SMs */
				break;
			if ((only || (sweep && !(f8 && *f8 == '1'))) && fp8)
				break;
			char kv[32];
			snprintf(kv, sizeof(kv), "cuda_sms=%s", sms[i]);
			struct th_daemon d;
			/* EPD_BENCH_OPT=key=value: one more daemon option */
			const char *xo = getenv("EPD_BENCH_OPT");
			if (xo)
				th_daemon_start(&d, "--backend", "cuda", "-o",
						kv, "-o", xo, NULL);
			else
				th_daemon_start(&d, "--backend", "cuda", "-o",
						kv, NULL);
			s->d = &d;
			s->fp8 = fp8;
			s->sms_cap = atoi(sms[i]);
			pid_t pids[MAXW];
			th_spawn(pids, W, rank_main, s);
			TH_CHECK(th_wait_all(pids, W, 300) == 0, "a rank failed");
			th_daemon_stop(&d);
			if (getenv("EPD_CUDA_TRACE")) {
				/* cuda_sms=N is N SMs' worth of blocks, which
				 * the block scheduler spreads over up to
				 * blocks-per-SM times N SMs: say how many */
				printf("perf: SMs the kernels ran on (cuda_sms=%s): "
				       "row copy %d, combine %d\n", sms[i],
				       s->sms_used[0], s->sms_used[1]);
				TH_CHECK(s->sms_used[0] > 0 && s->sms_used[1] > 0,
					 "the trace gave no SM counts");
				TH_CHECK(!s->sms_cap || s->sms_used[1] >= s->sms_cap,
					 "the combine ran on fewer SMs than cuda_sms");
			}
			uint64_t rows = 0;
			for (int r = 0; r < W; r++)
				rows += s->recv[r];
			double tokens = (double)s->T * W;
			/* one rank per GPU when spread: per-GPU share */
			int ngpu = getenv("EPD_GPU_SPREAD") ? W : 1;
			double rowb = (double)s->H * (fp8 ? 1 : 2) +
				      (fp8 ? s->H / 128 * 4 : 0);
			printf("perf: per GPU (%d GPU%s): dispatch %.0f GB/s, "
			       "combine %.0f GB/s\n",
			       ngpu, ngpu > 1 ? "s" : "",
			       (tokens + (double)rows) * rowb /
				       (tg_median(s->disp_ms, s->iters) / 1e3) /
				       1e9 / ngpu,
			       (tokens + (double)rows) * s->H * 2 /
				       (tg_median(s->comb_ms, s->iters) / 1e3) /
				       1e9 / ngpu);
			double row = (double)s->H * (fp8 ? 1 : 2) +
				     (fp8 ? s->H / 128 * 4 : 0);
			double db = (tokens + (double)rows) * row;
			double cb = (tokens + (double)rows) * s->H * 2;
			double dm = tg_median(s->disp_ms, s->iters),
			       cm = tg_median(s->comb_ms, s->iters);
			double dg = db / (dm / 1e3) / 1e9,
			       cg = cb / (cm / 1e3) / 1e9;
			printf("perf: %d ranks, ", W);
			printf("%s, SMs %s: dispatch %.3f ms, %.0f GB/s, "
			       "%.2f of D2D copy; combine %.3f ms, %.0f GB/s, "
			       "%.2f of D2D copy (D2D %.0f GB/s; %llu rows)\n",
			       fp8 ? "fp8" : "bf16", strcmp(sms[i], "0") ? sms[i] : "all(132)",
			       dm, dg, dg / s->d2d_gbs, cm, cg, cg / s->d2d_gbs,
			       s->d2d_gbs, (unsigned long long)rows);
			double pdm = tg_median(s->pdisp_ms, s->iters),
			       pcm = tg_median(s->pcomb_ms, s->iters);
			printf("perf: %s, SMs %s, pipelined (no CPU sync per "
			       "iteration): dispatch %.3f ms, %.2f of D2D; "
			       "combine %.3f ms, %.2f of D2D\n",
			       fp8 ? "fp8" : "bf16", strcmp(sms[i], "0") ? sms[i] : "all(132)",
			       pdm, db / (pdm / 1e3) / 1e9 / s->d2d_gbs, pcm,
			       cb / (pcm / 1e3) / 1e9 / s->d2d_gbs);
			if (i == 0)
				printf("perf: ceilings: D2D copy %.0f GB/s "
				       "(read+write), fill %.0f GB/s (write)\n",
				       s->d2d_gbs, s->fill_gbs);
			printf("perf: %s, SMs %s, the daemon's kernels alone "
			       "(last call): dispatch %.0f us, %.2f of D2D; "
			       "combine %.0f us, %.2f of D2D\n",
			       fp8 ? "fp8" : "bf16", strcmp(sms[i], "0") ? sms[i] : "all(132)",
			       s->kdisp_us,
			       db / (s->kdisp_us / 1e6) / 1e9 / s->d2d_gbs,
			       s->kcomb_us,
			       cb / (s->kcomb_us / 1e6) / 1e9 / s->d2d_gbs);
			double cdm = tg_median(s->cdisp_ms, s->iters);
			printf("perf: %s, SMs %s, cached dispatch (the routing "
			       "reused), pipelined: %.3f ms, %.2f of D2D; the "
			       "daemon's kernels alone (last call) %.0f us, "
			       "%.2f of D2D\n",
			       fp8 ? "fp8" : "bf16", strcmp(sms[i], "0") ? sms[i] : "all(132)",
			       cdm, db / (cdm / 1e3) / 1e9 / s->d2d_gbs,
			       s->kcdisp_us,
			       db / (s->kcdisp_us / 1e6) / 1e9 / s->d2d_gbs);
			if (!fp8 && i == 0 && ref_d > 0)
				printf("perf: speed-up over the PyTorch "
				       "reference on this GPU: dispatch %.1fx, "
				       "combine %.1fx\n",
				       ref_d / dm, ref_c / cm);
		}
	}
	return 0;
}
