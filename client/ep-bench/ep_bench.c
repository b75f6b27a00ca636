/* SPDX-License-Identifier: MIT */
/*
 * ep-bench: N rank processes against a running epd. Reports dispatch and
 * combine bandwidth (bytes read plus written per second) as a ratio to memcpy
 * measured in the same run, with 1 thread and with as many threads as cores,
 * and the barrier latency. Inputs are random (never zeros); the default shape
 * is DeepSeek-V3's (hidden 7168, top-8 of 256 experts) with 512 tokens per
 * rank to fit a small machine.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "ep/ep.h"

#define MAX_SAMPLES 4096

#define MAX_NODES 16

struct opts {
	const char *sock;
	const char *socks[MAX_NODES]; /* -s a,b,...: one daemon per node */
	int nodes, world;
	const char *group;
	int ranks;
	int iters;
	int linger_ms;
	uint32_t tokens, hidden, topk, experts;
	ep_dtype_t dtype;
	int skip_ops;
	int ll; /* --ll: the low-latency calls (ep_ll_*) */
};

struct shared {
	double barrier_us[MAX_SAMPLES];
	double dispatch_us[MAX_SAMPLES];
	double combine_us[MAX_SAMPLES];
	uint64_t recv_rows[1024];
	uint64_t xrows[1024]; /* rows each rank sends to other nodes */
	uint64_t ll_rows[1024]; /* --ll: (token, k) rows each rank got */
	int samples;
};

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(double), cmp_double);
	return n ? v[n / 2] : 0;
}

static uint64_t rng_next(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

#define FAIL(...)                                                              \
	do {                                                                   \
		fprintf(stderr, "ep-bench rank %d: ", rank);                   \
		fprintf(stderr, __VA_ARGS__);                                  \
		fprintf(stderr, "\n");                                         \
		return 1;                                                      \
	} while (0)

#define CALL(what, expr)                                                       \
	do {                                                                   \
		int rc_ = (expr);                                              \
		if (rc_)                                                       \
			FAIL("%s: %s: %s", what, ep_strerror(rc_),             \
			     ep_errmsg());                                     \
	} while (0)

/* Random inputs in the zero-copy buffers: bf16 of moderate size (or fp8
 * bytes with scales), distinct experts per token. */
static uint64_t fill_inputs(ep_group_t *g, const struct opts *o, int rank)
{
	uint64_t xrows = 0;
	const uint32_t epr = o->experts / (uint32_t)o->world;
	struct ep_buffers b;
	ep_get_buffers(g, &b);
	uint64_t s = 0x1234 + (uint64_t)rank * 7919;
	size_t n = (size_t)o->tokens * o->hidden;
	if (o->dtype == EP_DTYPE_FP8) {
		uint8_t *x = b.x;
		for (size_t i = 0; i < n; i++)
			x[i] = (uint8_t)rng_next(&s);
		for (size_t i = 0; i < (size_t)o->tokens * (o->hidden / 128);
		     i++)
			b.x_scales[i] = 1.0f + (float)(rng_next(&s) % 100);
	} else {
		uint16_t *x = b.x;
		for (size_t i = 0; i < n; i++)
			x[i] = (uint16_t)(0x3c00 + rng_next(&s) % 0x0800);
	}
	for (uint32_t t = 0; t < o->tokens; t++) {
		int64_t *row = b.topk_idx + (size_t)t * o->topk;
		for (uint32_t k = 0; k < o->topk; k++) {
			int64_t e;
			bool dup;
			do {
				e = (int64_t)(rng_next(&s) % o->experts);
				dup = false;
				for (uint32_t j = 0; j < k; j++)
					dup |= row[j] == e;
			} while (dup);
			row[k] = e;
		}
		for (uint32_t k = 0; k < o->topk; k++)
			b.topk_weights[(size_t)t * o->topk + k] = 1.0f / o->topk;
		/* distinct destination ranks on other nodes */
		for (uint32_t k = 0; k < o->topk; k++) {
			uint32_t d = (uint32_t)row[k] / epr;
			bool seen = false;
			for (uint32_t j = 0; j < k; j++)
				seen |= (uint32_t)row[j] / epr == d;
			if (!seen && (int)d / o->ranks != rank / o->ranks)
				xrows++;
		}
	}
	return xrows;
}

static int rank_main(int rank, const struct opts *o, struct shared *s)
{
	ep_conn_t *c;
	ep_group_t *g;
	CALL("connect", ep_connect(o->socks[rank / o->ranks], &c));
	struct ep_group_config cfg = {
		.name = o->group,
		.world_size = (uint32_t)o->world,
		.ranks_per_node = (uint32_t)o->ranks,
		.rank = (uint32_t)rank,
		.num_experts = o->experts,
		.hidden = o->hidden,
		.max_tokens_per_rank = o->tokens,
		.topk = o->topk,
		.dtype = o->dtype,
	};
	CALL("join", ep_join(c, &cfg, 0, &g));
	int n = o->iters > MAX_SAMPLES ? MAX_SAMPLES : o->iters;
	if (!o->skip_ops && o->ll) {
		/* the low-latency calls: the group's send buffers as the
		 * caller's arrays, the experts' rows random */
		struct ep_buffers b;
		ep_get_buffers(g, &b);
		fill_inputs(g, o, rank);
		const uint64_t el = o->experts / (uint32_t)o->world,
			       wn = (uint64_t)o->world * o->tokens;
		uint16_t *y = malloc(el * wn * o->hidden * 2 + 2),
			 *out = malloc((size_t)o->tokens * o->hidden * 2 + 2);
		if (!y || !out)
			FAIL("out of memory");
		uint64_t rs = 99 + (uint64_t)rank;
		for (uint64_t i = 0; i < el * wn * o->hidden; i++)
			y[i] = (uint16_t)(0x3c00 + rng_next(&rs) % 0x0800);
		struct ep_ll_recv rv;
		for (int i = 0; i < n + 3; i++) {
			CALL("barrier", ep_barrier(g));
			uint64_t t0 = now_ns();
			CALL("ll dispatch",
			     ep_ll_dispatch(g, b.x, b.topk_idx, o->tokens, 0,
					    NULL, &rv));
			uint64_t t1 = now_ns();
			CALL("barrier", ep_barrier(g));
			uint64_t t2 = now_ns();
			CALL("ll combine",
			     ep_ll_combine(g, rv.buffer, y, b.topk_weights,
					   out, 0, NULL));
			uint64_t t3 = now_ns();
			if (rank == 0 && i >= 3) { /* 3 to warm up */
				s->dispatch_us[i - 3] = (double)(t1 - t0) / 1e3;
				s->combine_us[i - 3] = (double)(t3 - t2) / 1e3;
			}
		}
		uint64_t got = 0;
		for (uint64_t e = 0; e < el; e++)
			got += (uint64_t)rv.recv_count[e];
		s->ll_rows[rank] = got;
		free(y);
		free(out);
	} else if (!o->skip_ops) {
		ep_handle_t h;
		struct ep_buffers b;
		ep_get_buffers(g, &b);
		s->xrows[rank] = fill_inputs(g, o, rank);
		/* warm up: fault in the buffers */
		for (int i = 0; i < 3; i++) {
			CALL("dispatch", ep_dispatch_inplace(
						 g, o->tokens,
						 EP_DISPATCH_WEIGHTS, NULL, &h));
			memcpy(b.combine_y, b.recv_x,
			       o->dtype == EP_DTYPE_BF16
				       ? (size_t)h.num_recv * o->hidden * 2
				       : 0);
			CALL("combine", ep_combine_inplace(g, &h, 0));
			if (i < 2)
				CALL("release", ep_handle_release(g, &h));
		}
		s->recv_rows[rank] = h.num_recv;
		for (int i = 0; i < n; i++) {
			CALL("barrier", ep_barrier(g));
			uint64_t t0 = now_ns();
			CALL("dispatch", ep_dispatch_inplace(
						 g, o->tokens,
						 EP_DISPATCH_WEIGHTS, NULL, &h));
			uint64_t t1 = now_ns();
			CALL("barrier", ep_barrier(g));
			uint64_t t2 = now_ns();
			CALL("combine", ep_combine_inplace(g, &h, 0));
			uint64_t t3 = now_ns();
			CALL("release", ep_handle_release(g, &h));
			if (rank == 0) {
				s->dispatch_us[i] = (double)(t1 - t0) / 1e3;
				s->combine_us[i] = (double)(t3 - t2) / 1e3;
			}
		}
	}
	for (int i = 0; i < 50; i++)
		CALL("barrier", ep_barrier(g));
	for (int i = 0; i < n; i++) {
		uint64_t t0 = now_ns();
		for (int k = 0; k < 10; k++)
			CALL("barrier", ep_barrier(g));
		if (rank == 0)
			s->barrier_us[i] = (double)(now_ns() - t0) / 10 / 1e3;
	}
	if (rank == 0)
		s->samples = n;
	if (rank == 0 && o->linger_ms) {
		printf("holding the group for %d ms\n", o->linger_ms);
		fflush(stdout);
	}
	if (o->linger_ms)
		usleep((useconds_t)o->linger_ms * 1000);
	ep_barrier(g);
	ep_leave(g);
	ep_close(c);
	return 0;
}

struct copy_arg {
	uint8_t *dst, *src;
	size_t n;
	bool stream;
};

/* A copy with streaming stores (a written line is not read first), as the
 * host backend writes received rows; memcpy where the CPU has none. */
static void stream_copy(uint8_t *dst, const uint8_t *src, size_t n)
{
#if defined(__x86_64__) && defined(__SSE2__)
	__m128i *d = (__m128i *)(void *)dst;
	const __m128i *q = (const __m128i *)(const void *)src;
	for (size_t i = 0; i < n / 64; i++) {
		__m128i a = _mm_loadu_si128(q + 4 * i);
		__m128i b = _mm_loadu_si128(q + 4 * i + 1);
		__m128i c = _mm_loadu_si128(q + 4 * i + 2);
		__m128i e = _mm_loadu_si128(q + 4 * i + 3);
		_mm_stream_si128(d + 4 * i, a);
		_mm_stream_si128(d + 4 * i + 1, b);
		_mm_stream_si128(d + 4 * i + 2, c);
		_mm_stream_si128(d + 4 * i + 3, e);
	}
	_mm_sfence();
	memcpy(dst + n / 64 * 64, src + n / 64 * 64, n % 64);
#else
	memcpy(dst, src, n);
#endif
}

static void *copy_thread(void *p)
{
	struct copy_arg *a = p;
	if (a->stream)
		stream_copy(a->dst, a->src, a->n);
	else
		memcpy(a->dst, a->src, a->n);
	return NULL;
}

/* Copy bandwidth (bytes read + written per second, GB/s) with nthreads,
 * median of 7, over 256 MiB of random data: memcpy, or (stream) with
 * streaming stores. */
static double copy_gbs(int nthreads, bool stream)
{
	size_t n = 256u << 20;
	uint8_t *src = malloc(n), *dst = malloc(n);
	if (!src || !dst)
		return 0;
	uint64_t s = 42;
	for (size_t i = 0; i < n; i += 8) {
		uint64_t v = rng_next(&s);
		memcpy(src + i, &v, 8);
	}
	memset(dst, 1, n);
	double t[7];
	for (int rep = 0; rep < 7; rep++) {
		pthread_t th[64];
		struct copy_arg a[64];
		size_t per = n / (size_t)nthreads;
		uint64_t t0 = now_ns();
		for (int i = 0; i < nthreads; i++) {
			a[i] = (struct copy_arg){dst + per * (size_t)i,
						 src + per * (size_t)i, per,
						 stream};
			pthread_create(&th[i], NULL, copy_thread, &a[i]);
		}
		for (int i = 0; i < nthreads; i++)
			pthread_join(th[i], NULL);
		t[rep] = (double)(now_ns() - t0) / 1e9;
	}
	double med = median(t, 7);
	free(src);
	free(dst);
	return 2.0 * (double)n / med / 1e9;
}

/* Loopback TCP (the tcp transport's path between daemons on one machine):
 * one connection, 512 MiB one way, GB/s of payload moved. */
struct tcp_arg {
	int fd;
	size_t n;
};

static void *tcp_writer(void *p)
{
	struct tcp_arg *a = p;
	static uint8_t buf[1 << 20];
	memset(buf, 0x5a, sizeof(buf));
	for (size_t off = 0; off < a->n;) {
		ssize_t k = write(a->fd, buf, sizeof(buf));
		if (k <= 0)
			break;
		off += (size_t)k;
	}
	return NULL;
}

static double tcp_loopback_gbs(void)
{
	int ls = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sa = {.sin_family = AF_INET,
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t len = sizeof(sa);
	if (ls < 0 || bind(ls, (struct sockaddr *)&sa, sizeof(sa)) ||
	    listen(ls, 1) || getsockname(ls, (struct sockaddr *)&sa, &len))
		return 0;
	int w = socket(AF_INET, SOCK_STREAM, 0);
	if (connect(w, (struct sockaddr *)&sa, sizeof(sa)))
		return 0;
	int r = accept(ls, NULL, NULL);
	close(ls);
	struct tcp_arg a = {.fd = w, .n = 512u << 20};
	static uint8_t buf[1 << 20];
	pthread_t th;
	uint64_t t0 = now_ns();
	pthread_create(&th, NULL, tcp_writer, &a);
	size_t got = 0;
	while (got < a.n) {
		ssize_t k = read(r, buf, sizeof(buf));
		if (k <= 0)
			break;
		got += (size_t)k;
	}
	double t = (double)(now_ns() - t0) / 1e9;
	pthread_join(th, NULL);
	close(w);
	close(r);
	return (double)got / t / 1e9;
}

/* One op's line: time per call, GB/s of the fewest bytes, and that as a
 * share of the memcpy ceilings (mc1, 1 thread: printed unless 0). */
static void print_op(const char *what, double us, double bytes, double mcn,
		     int nthr, double mc1)
{
	const double gbs = bytes / us / 1e3;
	printf("%s %9.1f us per call, %.2f GB/s, %.2f of memcpy (%d threads)",
	       what, us, gbs, gbs / mcn, nthr);
	if (mc1)
		printf(", %.2f of memcpy (1 thread)", gbs / mc1);
	printf("\n");
}

/* A whole number of 0..2^31-1 for option -opt: 0, or -1 (said why). */
static int num(int opt, const char *arg, long *out)
{
	char *end;
	errno = 0;
	long v = strtol(arg, &end, 10);
	if (errno || end == arg || *end || v < 0 || v > INT32_MAX) {
		fprintf(stderr, "ep-bench: -%c: '%s' is not a number of "
			"0..%d\n", opt == 'L' ? 'L' : opt, arg, INT32_MAX);
		return -1;
	}
	*out = v;
	return 0;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: ep-bench [-s SOCKET[,SOCKET...]] [-n RANKS] [-i ITERS] [-g GROUP]\n"
		"                [-T TOKENS] [-H HIDDEN] [-k TOPK] [-E EXPERTS]\n"
		"                [--fp8] [--ll] [--barrier-only] [--linger-ms MS]\n"
		"  --ll: the low-latency calls (ep_ll_dispatch/combine; bf16)\n");
}

/* The options into *o: 0, or the exit status (after usage or help). */
static int parse_opts(int argc, char **argv, struct opts *o)
{
	static const struct option lo[] = {
		{"socket", required_argument, NULL, 's'},
		{"ranks", required_argument, NULL, 'n'},
		{"iters", required_argument, NULL, 'i'},
		{"group", required_argument, NULL, 'g'},
		{"tokens", required_argument, NULL, 'T'},
		{"hidden", required_argument, NULL, 'H'},
		{"topk", required_argument, NULL, 'k'},
		{"experts", required_argument, NULL, 'E'},
		{"fp8", no_argument, NULL, 'F'},
		{"barrier-only", no_argument, NULL, 'B'},
		{"ll", no_argument, NULL, 'l'},
		{"linger-ms", required_argument, NULL, 'L'},
		{"help", no_argument, NULL, 'h'},
		{0},
	};
	int opt;
	long v = 0;
	while ((opt = getopt_long(argc, argv, "s:n:i:g:T:H:k:E:h", lo, NULL)) !=
	       -1) {
		if (strchr("niTHkEL", opt) && num(opt, optarg, &v))
			return 2;
		switch (opt) {
		case 's': o->sock = optarg; break;
		case 'n': o->ranks = (int)v; break;
		case 'i': o->iters = (int)v; break;
		case 'g': o->group = optarg; break;
		case 'T': o->tokens = (uint32_t)v; break;
		case 'H': o->hidden = (uint32_t)v; break;
		case 'k': o->topk = (uint32_t)v; break;
		case 'E': o->experts = (uint32_t)v; break;
		case 'F': o->dtype = EP_DTYPE_FP8; break;
		case 'B': o->skip_ops = 1; break;
		case 'l': o->ll = 1; break;
		case 'L': o->linger_ms = (int)v; break;
		case 'h': usage(stdout); return 1;
		default: usage(stderr); return 2;
		}
	}
	/* -s a,b,...: daemons of a cluster, -n ranks on each */
	static char socks[4096];
	if (o->sock && strlen(o->sock) >= sizeof(socks)) {
		fprintf(stderr, "ep-bench: -s: a list longer than %zu bytes\n",
			sizeof(socks) - 1);
		return 2;
	}
	snprintf(socks, sizeof(socks), "%s", o->sock ? o->sock : "");
	o->nodes = 0;
	for (char *save, *t = strtok_r(socks, ",", &save); t;
	     t = strtok_r(NULL, ",", &save)) {
		if (o->nodes == MAX_NODES) {
			fprintf(stderr, "ep-bench: -s: more than %d sockets\n",
				MAX_NODES);
			return 2;
		}
		o->socks[o->nodes++] = t;
	}
	if (o->nodes == 0)
		o->socks[o->nodes++] = NULL; /* $EPD_SOCKET or the default */
	o->world = o->ranks * o->nodes;
	if (o->ranks < 1 || o->world > 1024 || o->iters < 1 || o->tokens < 1 ||
	    o->experts % (uint32_t)o->world) {
		usage(stderr);
		return 2;
	}
	return 0;
}

/* The ceilings measured in the same run: memcpy and the streaming-store
 * copy (GB/s, read+write) with 1 and nthr threads, one loopback tcp
 * stream (across nodes). */
struct ceilings {
	int nthr;
	double mc1, mcn, sc1, scn, tcp;
};

static void measure_ceilings(const struct opts *o, struct ceilings *c)
{
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	*c = (struct ceilings){.nthr = ncpu > 64  ? 64
				       : ncpu < 1 ? 1
						  : (int)ncpu};
	if (o->skip_ops)
		return;
	c->mc1 = copy_gbs(1, false);
	c->mcn = copy_gbs(c->nthr, false);
	/* the host backend writes received rows with streaming stores: a
	 * copy that does so too bounds the dispatch */
	c->sc1 = copy_gbs(1, true);
	c->scn = copy_gbs(c->nthr, true);
	if (o->nodes > 1)
		c->tcp = tcp_loopback_gbs();
}

/* Every rank as a process; how many failed (-1: fork failed). */
static int run_ranks(const struct opts *o, struct shared *s)
{
	pid_t pids[1024];
	fflush(NULL);
	for (int r = 0; r < o->world; r++) {
		pids[r] = fork();
		if (pids[r] < 0) {
			perror("fork");
			return -1;
		}
		if (pids[r] == 0)
			_exit(rank_main(r, o, s));
	}
	int bad = 0;
	for (int r = 0; r < o->world; r++) {
		int st;
		waitpid(pids[r], &st, 0);
		bad += !WIFEXITED(st) || WEXITSTATUS(st);
	}
	return bad;
}

static void report_ll(const struct opts *o, struct shared *s,
		      const struct ceilings *c)
{
	int n = s->samples;
	uint64_t rows = 0;
	for (int r = 0; r < o->world; r++)
		rows += s->ll_rows[r];
	/* the fewest bytes: dispatch reads every token and writes every
	 * (token, k) row where it lands; combine reads every row and writes
	 * every token */
	double row = (double)o->hidden * 2,
	       tokens = (double)o->tokens * o->world;
	double dbytes = (tokens + (double)rows) * row,
	       cbytes = ((double)rows + tokens) * row;
	double dt = median(s->dispatch_us, n), ct = median(s->combine_us, n);
	printf("low-latency calls (host ranks): %d ranks (%d node%s x %d), "
	       "%u tokens/rank, hidden %u, top-%u of %u experts, bf16; %llu "
	       "(token, k) rows in all\n",
	       o->world, o->nodes, o->nodes > 1 ? "s" : "", o->ranks,
	       o->tokens, o->hidden, o->topk, o->experts,
	       (unsigned long long)rows);
	printf("memcpy ceiling (read+write): %.2f GB/s with 1 thread, %.2f "
	       "GB/s with %d threads\n",
	       c->mc1, c->mcn, c->nthr);
	print_op("ll dispatch:", dt, dbytes, c->mcn, c->nthr, 0);
	print_op("ll combine: ", ct, cbytes, c->mcn, c->nthr, 0);
}

static void report_ops(const struct opts *o, struct shared *s,
		       const struct ceilings *c)
{
	int n = s->samples;
	uint64_t rows = 0, xrows = 0;
	for (int r = 0; r < o->world; r++) {
		rows += s->recv_rows[r];
		xrows += s->xrows[r];
	}
	uint32_t elt = o->dtype == EP_DTYPE_FP8 ? 1 : 2;
	double row = (double)o->hidden * elt +
		     (o->dtype == EP_DTYPE_FP8 ? o->hidden / 128 * 4 : 0);
	/* The fewest bytes: each input read once, each output written once.
	 * dispatch reads every token, writes every received row; combine
	 * reads every row, writes every token. */
	double tokens = (double)o->tokens * o->world;
	double dbytes = (tokens + (double)rows) * row;
	double cbytes = ((double)rows + tokens) * o->hidden * 2;
	double dt = median(s->dispatch_us, n), ct = median(s->combine_us, n);
	printf("shape: %d ranks (%d node%s x %d), %u tokens/rank, hidden %u, "
	       "top-%u of %u experts, %s; %llu rows received in all\n",
	       o->world, o->nodes, o->nodes > 1 ? "s" : "", o->ranks,
	       o->tokens, o->hidden, o->topk, o->experts,
	       o->dtype == EP_DTYPE_FP8 ? "fp8" : "bf16",
	       (unsigned long long)rows);
	printf("memcpy ceiling (read+write): %.2f GB/s with 1 thread, %.2f "
	       "GB/s with %d threads\n",
	       c->mc1, c->mcn, c->nthr);
	printf("streaming-store copy ceiling (read+write, as the dispatch "
	       "writes its rows): %.2f GB/s with 1 thread, %.2f GB/s with %d "
	       "threads\n",
	       c->sc1, c->scn, c->nthr);
	print_op("dispatch:", dt, dbytes, c->mcn, c->nthr, c->mc1);
	printf("          %.2f of the streaming-store copy (%d threads), "
	       "%.2f of it (1 thread)\n",
	       dbytes / dt / 1e3 / c->scn, c->nthr, dbytes / dt / 1e3 / c->sc1);
	print_op("combine: ", ct, cbytes, c->mcn, c->nthr, c->mc1);
	if (o->nodes > 1) {
		/* rows that cross nodes, each way, against the loopback TCP
		 * ceiling of this run */
		double xb = (double)xrows * row,
		       xc = (double)xrows * o->hidden * 2;
		printf("between nodes: %llu rows per call; loopback tcp "
		       "ceiling %.2f GB/s (one connection)\n",
		       (unsigned long long)xrows, c->tcp);
		printf("dispatch: %.2f GB/s between nodes, %.2f of the tcp "
		       "ceiling; combine: %.2f GB/s, %.2f\n",
		       xb / dt / 1e3, xb / dt / 1e3 / c->tcp, xc / ct / 1e3,
		       xc / ct / 1e3 / c->tcp);
	}
}

int main(int argc, char **argv)
{
	struct opts o = {.ranks = 8, .iters = 20, .group = "bench",
			 .tokens = 512, .hidden = 7168, .topk = 8,
			 .experts = 256, .dtype = EP_DTYPE_BF16};
	int rc = parse_opts(argc, argv, &o);
	if (rc)
		return rc == 1 ? 0 : rc;
	struct shared *s = mmap(NULL, sizeof(*s), PROT_READ | PROT_WRITE,
				MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (s == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	struct ceilings c;
	measure_ceilings(&o, &c);
	int bad = run_ranks(&o, s);
	if (bad) {
		if (bad > 0)
			fprintf(stderr, "ep-bench: %d ranks failed\n", bad);
		return 1;
	}
	if (!o.skip_ops && o.ll)
		report_ll(&o, s, &c);
	else if (!o.skip_ops)
		report_ops(&o, s, &c);
	printf("barrier: %d ranks, %d barriers: median %.1f us per barrier\n",
	       o.world, s->samples * 10, median(s->barrier_us, s->samples));
	return 0;
}
