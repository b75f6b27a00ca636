/* SPDX-License-Identifier: MIT */
#include "harness.h"
#include "epp.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

void (*th_daemon_child_hook)(void);
static struct th_daemon *daemons[8];
static int ndaemons;
static pid_t main_pid;

/* Temporary directories of this test, removed when it ends by returning
 * from main or exit() (a pass or a skip); a failure (th_fail_exit, the
 * alarm, a signal) keeps them, logs included, for a look. */
/* a cluster's daemons one each, and the test's own */
#define TH_MAX_TMPDIRS (TH_MAX_NODES + 16)
static char tmpdirs[TH_MAX_TMPDIRS][64];
static int ntmpdirs;

static int rm_entry(const char *path, const struct stat *sb, int flag,
		    struct FTW *ftw)
{
	(void)sb;
	(void)flag;
	(void)ftw;
	return remove(path) && errno != ENOENT ? -1 : 0;
}

static void rm_tmpdirs(void)
{
	if (getpid() != main_pid || getenv("EPD_TEST_KEEP"))
		return;
	for (int i = 0; i < ntmpdirs; i++)
		nftw(tmpdirs[i], rm_entry, 8, FTW_DEPTH | FTW_PHYS);
	ntmpdirs = 0;
}

const char *th_tmpdir(const char *prefix)
{
	TH_CHECK(ntmpdirs < TH_MAX_TMPDIRS, "too many temporary directories");
	char *d = tmpdirs[ntmpdirs];
	snprintf(d, sizeof(tmpdirs[0]), "%s/%s.XXXXXX",
		 getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", prefix);
	TH_CHECK(mkdtemp(d), "mkdtemp %s: %s", d, strerror(errno));
	if (ntmpdirs++ == 0)
		atexit(rm_tmpdirs);
	return d;
}

void th_daemon_dump_log(const struct th_daemon *d)
{
	FILE *f = fopen(d->log, "r");
	if (!f)
		return;
	char line[1024];
	fprintf(stderr, "---- %s ----\n", d->log);
	while (fgets(line, sizeof(line), f))
		fputs(line, stderr);
	fprintf(stderr, "---- end ----\n");
	fclose(f);
}

void th_fail_exit(void)
{
	if (getpid() == main_pid) {
		for (int i = 0; i < ndaemons; i++) {
			if (daemons[i]->pid > 0)
				kill(daemons[i]->pid, SIGKILL);
			th_daemon_dump_log(daemons[i]);
		}
	}
	_exit(1);
}

static void on_alarm(int sig)
{
	(void)sig;
	static const char msg[] = "test timed out (alarm)\n";
	if (write(2, msg, sizeof(msg) - 1) < 0)
		_exit(1);
	th_fail_exit();
}

void th_init(const char *name, unsigned timeout_s)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	main_pid = getpid();
	signal(SIGALRM, on_alarm);
	signal(SIGPIPE, SIG_IGN);
	/* EPD_TEST_ALARM_SCALE: an emulated CPU (tests/rdma-vm) under a
	 * sanitizer runs several times slower */
	timeout_s *= th_scale();
	alarm(timeout_s);
	printf("# %s\n", name);
}

unsigned th_scale(void)
{
	const char *sc = getenv("EPD_TEST_ALARM_SCALE");
	int v = sc ? atoi(sc) : 1;
	return v > 1 && v <= 100 ? (unsigned)v : 1;
}

uint64_t th_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t th_seed(void)
{
	const char *es = getenv("EPD_TEST_SEED");
	uint64_t seed = es ? strtoull(es, NULL, 0) : (uint64_t)time(NULL);
	printf("seed %llu (EPD_TEST_SEED=%llu repeats this run)\n",
	       (unsigned long long)seed, (unsigned long long)seed);
	return seed;
}

static bool port_free(int port)
{
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return false;
	struct sockaddr_in a = {.sin_family = AF_INET,
				.sin_port = htons((uint16_t)port),
				.sin_addr.s_addr = htonl(INADDR_ANY)};
	bool ok = bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
	close(fd);
	return ok;
}

uint32_t th_rnd(uint64_t *s)
{
	*s = *s * 6364136223846793005ull + 1442695040888963407ull;
	return (uint32_t)(*s >> 33);
}

uint64_t th_fnv(uint64_t h, const void *p, size_t n)
{
	const uint8_t *b = p;
	for (size_t i = 0; i < n; i++)
		h = (h ^ b[i]) * 0x100000001b3ull;
	return h;
}

int th_ports(int n)
{
	int lo = 32768, hi = 60999;
	FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
	if (f) {
		if (fscanf(f, "%d %d", &lo, &hi) != 2)
			lo = 32768, hi = 60999;
		fclose(f);
	}
	/* below the ephemeral range from 10000 (clear of the well-known
	 * and registered services tests might meet), else above it */
	int a0 = 10000, a1 = lo - n, b0 = hi + 1, b1 = 65535 - n;
	int na = a1 > a0 ? a1 - a0 : 0, nb = b1 > b0 ? b1 - b0 : 0;
	TH_CHECK(na + nb > 0, "no %d ports outside the ephemeral range %d-%d",
		 n, lo, hi);
	uint64_t x = th_now_ns() ^ ((uint64_t)getpid() << 32);
	for (int tries = 0; tries < 1000; tries++) {
		int k = (int)(th_rnd(&x) % (uint64_t)(na + nb));
		int base = k < na ? a0 + k : b0 + (k - na);
		bool ok = true;
		for (int i = 0; i < n && ok; i++)
			ok = port_free(base + i);
		if (ok)
			return base;
	}
	TH_CHECK(0, "no %d free consecutive ports outside %d-%d", n, lo, hi);
	return -1;
}

void th_sleep_ms(unsigned ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

static const char *env_or(const char *k, const char *def)
{
	const char *v = getenv(k);
	return v && *v ? v : def;
}

const char *th_epctl_bin(void)
{
	return env_or("EPCTL_BIN", "./epctl");
}

void th_daemon_start_in(struct th_daemon *d, const char *const *args)
{
	const char *bin = env_or("EPD_BIN", "./epd");
	const char *argv[48];
	int n = 0;
	argv[n++] = bin;
	argv[n++] = "--socket";
	argv[n++] = d->sock;
	argv[n++] = "--config";
	argv[n++] = d->conf;
	argv[n++] = "--log-level";
	argv[n++] = env_or("EPD_TEST_LOG_LEVEL", "info");
	for (int i = 0; args && args[i] && n < 46; i++)
		argv[n++] = args[i];
	/* EPD_TEST_DAEMON_OPTS="key=value ...": one -o each, after the
	 * test's own arguments (an experiment's knob, e.g. a barrier engine) */
	char *opts = strdup(env_or("EPD_TEST_DAEMON_OPTS", ""));
	TH_CHECK(opts, "out of memory");
	for (char *sv, *t = strtok_r(opts, " ", &sv); t && n < 45;
	     t = strtok_r(NULL, " ", &sv)) {
		argv[n++] = "-o";
		argv[n++] = t;
	}
	argv[n] = NULL;
	pid_t pid = fork();
	TH_CHECK(pid >= 0, "fork: %s", strerror(errno));
	if (pid == 0) {
		int fd = open(d->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
		if (fd >= 0) {
			dup2(fd, 1);
			dup2(fd, 2);
		}
		alarm(0);
		if (th_daemon_child_hook)
			th_daemon_child_hook();
		execv(bin, (char *const *)argv);
		fprintf(stderr, "exec %s: %s\n", bin, strerror(errno));
		_exit(127);
	}
	d->pid = pid;
	free(opts);
	bool known = false;
	for (int i = 0; i < ndaemons; i++)
		known |= daemons[i] == d;
	if (!known && ndaemons < 8)
		daemons[ndaemons++] = d;
	/* Ready when a client can complete the hello. */
	/* 5 s, times the run's slowness (an emulated CPU under a sanitizer
	 * starts a daemon with an RDMA device in more) */
	for (unsigned i = 0; i < 500 * th_scale(); i++) {
		ep_conn_t *c;
		if (ep_connect(d->sock, &c) == 0) {
			ep_close(c);
			return;
		}
		int st;
		if (waitpid(pid, &st, WNOHANG) == pid) {
			d->pid = 0;
			TH_CHECK(0, "epd exited at start (status 0x%x)", st);
		}
		th_sleep_ms(10);
	}
	TH_CHECK(0, "epd did not come up on %s", d->sock);
}

/* A new daemon directory with an empty configuration, and epd started
 * in it with args. */
static void daemon_new(struct th_daemon *d, const char *const *args)
{
	memset(d, 0, sizeof(*d));
	snprintf(d->dir, sizeof(d->dir), "%s", th_tmpdir("epdtest"));
	snprintf(d->sock, sizeof(d->sock), "%s/epd.sock", d->dir);
	snprintf(d->log, sizeof(d->log), "%s/epd.log", d->dir);
	snprintf(d->conf, sizeof(d->conf), "%s/epd.conf", d->dir);
	FILE *f = fopen(d->conf, "w");
	TH_CHECK(f, "cannot write %s", d->conf);
	fprintf(f, "[epd]\n");
	fclose(f);
	th_daemon_start_in(d, args);
}

void th_daemon_start(struct th_daemon *d, ...)
{
	const char *args[40];
	int n = 0;
	va_list ap;
	va_start(ap, d);
	for (const char *a; (a = va_arg(ap, const char *)) && n < 39;)
		args[n++] = a;
	va_end(ap);
	args[n] = NULL;
	daemon_new(d, args);
}

void th_cluster_start(struct th_daemon *d, int n, const char *tag,
		      const char *const *extra)
{
	TH_CHECK(n >= 2 && n <= TH_MAX_NODES, "a cluster of %d nodes", n);
	const char *tr = env_or("EPD_TEST_TRANSPORT", "");
	int port = th_ports(n);
	/* every node on 127.0.0.1, each its own port: the list has no
	 * length limit (a daemon takes -o values of any length) */
	const size_t cap = (size_t)n * 40 + 16;
	char *peers = malloc(cap), key[192], kv[6][320];
	TH_CHECK(peers, "out of memory");
	size_t off = (size_t)snprintf(peers, cap, "peers=");
	for (int i = 0; i < n; i++)
		off += (size_t)snprintf(peers + off, cap - off,
					"%sn%d@127.0.0.1:%d", i ? ", " : "", i,
					port + i);
	snprintf(key, sizeof(key), "%s/cluster.key", th_tmpdir(tag));
	FILE *f = fopen(key, "w");
	TH_CHECK(f, "cannot write %s", key);
	fprintf(f, "%s-cluster-key-%d-0123456789abcdef\n", tag, getpid());
	fclose(f);
	TH_CHECK(!chmod(key, 0600), "chmod %s", key);
	bool learnt = false; /* peers of each node: itself alone */
	for (int k = 0; extra && extra[k]; k++)
		learnt |= !strncmp(extra[k], "peer_lookup=", 12) &&
			  strcmp(extra[k], "peer_lookup=peers");
	char self[64];
	for (int i = 0; i < n; i++) {
		snprintf(kv[0], sizeof(kv[0]), "node_name=n%d", i);
		snprintf(self, sizeof(self), "peers=n%d@127.0.0.1:%d", i,
			 port + i);
		snprintf(kv[2], sizeof(kv[2]), "cluster_key_file=%s", key);
		snprintf(kv[3], sizeof(kv[3]), "heartbeat_ms=100");
		snprintf(kv[4], sizeof(kv[4]), "heartbeat_miss=%d",
			 getenv("EPD_TEST_SLOW") ? 40 : 20);
		snprintf(kv[5], sizeof(kv[5]), "transport=%s", *tr ? tr : "tcp");
		const char *args[40];
		int a = 0;
		for (int k = 0; k < 6; k++) {
			args[a++] = "-o";
			args[a++] = k != 1 ? kv[k] : learnt ? self : peers;
		}
		for (int k = 0; extra && extra[k] && a < 39; k++)
			args[a++] = extra[k];
		args[a] = NULL;
		daemon_new(&d[i], args);
		d[i].peer_port = port + i;
	}
	free(peers);
	/* connected on demand (the default): nothing to wait for; with
	 * peer_connect=all every node sees every other up: its row of the
	 * status has no D */
	bool all = false;
	for (int k = 0; extra && extra[k]; k++)
		all |= !strcmp(extra[k], "peer_connect=all");
	for (int i = 0; all && i < n; i++)
		for (int t = 0;; t++) {
			ep_conn_t *c;
			char *js = NULL;
			TH_OK(ep_connect(d[i].sock, &c));
			TH_OK(ep_daemon_status(c, &js));
			ep_close(c);
			const char *row = strstr(js, "\"row\":\"");
			bool up = row && strlen(row + 7) > (size_t)n &&
				  !memchr(row + 7, 'D', (size_t)n);
			free(js);
			if (up)
				break;
			TH_CHECK(t < 1000, "node %d never saw the cluster up", i);
			th_sleep_ms(10);
		}
}

bool th_daemon_alive(struct th_daemon *d)
{
	int st;
	if (d->pid <= 0)
		return false;
	if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
		d->pid = 0;
		return false;
	}
	return true;
}

void th_daemon_stop(struct th_daemon *d)
{
	TH_CHECK(th_daemon_alive(d), "epd died before the end of the test");
	kill(d->pid, SIGTERM);
	int st = 0;
	for (int i = 0; i < 1000; i++) {
		if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
			d->pid = 0;
			TH_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0,
				 "epd exit status 0x%x", st);
			struct stat sb;
			TH_CHECK(stat(d->sock, &sb) != 0,
				 "socket %s left behind", d->sock);
			return;
		}
		th_sleep_ms(10);
	}
	TH_CHECK(0, "epd did not stop within 10 s of SIGTERM");
}

int th_fds(pid_t pid)
{
	char path[64];
	snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
	DIR *d = opendir(path);
	if (!d)
		return -1;
	int n = 0;
	for (struct dirent *e; (e = readdir(d));)
		n += e->d_name[0] != '.';
	closedir(d);
	return n;
}

int th_maps(pid_t pid, const char *match)
{
	char path[64], line[512];
	snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
	FILE *f = fopen(path, "r");
	if (!f)
		return -1;
	int n = 0;
	while (fgets(line, sizeof(line), f))
		n += strstr(line, match) != NULL;
	fclose(f);
	return n;
}

struct th_capture th_stderr_capture(void)
{
	char path[] = "/tmp/th-stderr.XXXXXX";
	struct th_capture c;
	c.fd = mkstemp(path);
	TH_CHECK(c.fd >= 0, "mkstemp");
	unlink(path);
	fflush(stderr);
	c.saved = dup(2);
	TH_CHECK(c.saved >= 0 && dup2(c.fd, 2) == 2, "redirecting stderr");
	return c;
}

size_t th_stderr_collect(struct th_capture c, char *buf, size_t cap)
{
	fflush(stderr);
	dup2(c.saved, 2);
	close(c.saved);
	size_t n = 0;
	ssize_t r = 1;
	while (n + 1 < cap && r > 0) {
		r = pread(c.fd, buf + n, cap - 1 - n, (off_t)n);
		if (r > 0)
			n += (size_t)r;
	}
	buf[n] = 0;
	close(c.fd);
	return n;
}

void *th_shared(size_t size)
{
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE,
		       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	TH_CHECK(p != MAP_FAILED, "mmap: %s", strerror(errno));
	memset(p, 0, size);
	return p;
}

void th_spawn(pid_t *pids, int n, th_child_fn fn, void *arg)
{
	fflush(NULL);
	for (int i = 0; i < n; i++) {
		pid_t p = fork();
		TH_CHECK(p >= 0, "fork: %s", strerror(errno));
		if (p == 0) {
			ndaemons = 0; /* children never kill the daemons */
			main_pid = 0;
			int rc = fn(i, arg);
			fflush(NULL);
			_exit(rc);
		}
		pids[i] = p;
	}
}

int th_wait_all(const pid_t *pids, int n, unsigned timeout_s)
{
	int bad = 0;
	uint64_t end = th_now_ns() + (uint64_t)timeout_s * 1000000000ull;
	for (int i = 0; i < n; i++) {
		int st;
		for (;;) {
			pid_t r = waitpid(pids[i], &st, WNOHANG);
			if (r == pids[i])
				break;
			if (th_now_ns() > end) {
				fprintf(stderr, "child %d (pid %d) hangs; "
						"killing it\n",
					i, (int)pids[i]);
				kill(pids[i], SIGKILL);
				waitpid(pids[i], &st, 0);
				break;
			}
			th_sleep_ms(5);
		}
		if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
			fprintf(stderr, "child %d failed (status 0x%x)\n", i,
				st);
			bad++;
		}
	}
	return bad;
}

void th_reap(pid_t pid, unsigned timeout_s)
{
	int st;
	uint64_t end = th_now_ns() + (uint64_t)timeout_s * 1000000000ull;
	while (waitpid(pid, &st, WNOHANG) != pid) {
		if (th_now_ns() > end) {
			kill(pid, SIGKILL);
			waitpid(pid, &st, 0);
			return;
		}
		th_sleep_ms(5);
	}
}

struct ep_group_config th_group(const char *name, uint32_t world,
				uint32_t rank, uint32_t timeout_ms)
{
	struct ep_group_config c = {
		.name = name,
		.world_size = world,
		.ranks_per_node = world,
		.rank = rank,
		.num_experts = world * 4,
		.hidden = 256,
		.max_tokens_per_rank = 64,
		.topk = 4,
		.dtype = EP_DTYPE_BF16,
		.timeout_ms = timeout_ms,
	};
	return c;
}

ep_group_t *th_join(const struct th_daemon *d, const struct ep_group_config *c,
		    ep_conn_t **conn)
{
	ep_group_t *g;
	TH_OK(ep_connect(d->sock, conn));
	TH_OK(ep_join(*conn, c, 0, &g));
	return g;
}

void th_raw_join(int fd, const struct epp_join *j, uint64_t req,
		 struct epp_join_ok *ok)
{
	uint8_t buf[512], *p;
	struct epp_hdr hd, rh;
	epp_hdr_init(&hd, EPP_JOIN, req);
	hd.length = (uint32_t)epp_join_encode(j, buf, sizeof(buf));
	TH_OK(epp_send_frame(fd, &hd, buf, NULL));
	int fds[EPP_MAX_FDS];
	TH_OK(epp_recv_frame(fd, &rh, &p, fds, 5000, NULL, 0));
	TH_CHECK(rh.type == EPP_OK && rh.nfds == 1 && rh.req_id == req,
		 "join reply: type %u, %u descriptors", rh.type, rh.nfds);
	TH_OK(epp_join_ok_decode(p, rh.length, ok));
	free(p);
	close(fds[0]);
}

void th_late_rounds(ep_group_t *g, int rank, int world, unsigned delay_ms,
		    uint64_t enter[][TH_MAXW], uint64_t leave[][TH_MAXW])
{
	for (int late = 0; late < world; late++) {
		TH_OK(ep_barrier(g)); /* line up */
		if (rank == late)
			th_sleep_ms(delay_ms);
		enter[late][rank] = th_now_ns();
		TH_OK(ep_barrier(g));
		leave[late][rank] = th_now_ns();
	}
}

void *th_poisoned(size_t n, int byte)
{
	void *p = malloc(n + 1);
	TH_CHECK(p, "out of memory");
	memset(p, byte, n + 1);
	return p;
}

bool th_all_is(const void *p, size_t n, int byte)
{
	const uint8_t *b = p;
	for (size_t i = 0; i < n; i++)
		if (b[i] != (uint8_t)byte)
			return false;
	return true;
}

size_t th_first_diff(const void *a, const void *b, size_t n)
{
	const uint8_t *x = a, *y = b;
	size_t i = 0;
	while (i < n && x[i] == y[i])
		i++;
	return i;
}
