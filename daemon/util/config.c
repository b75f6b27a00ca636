/* SPDX-License-Identifier: MIT */
/* Configuration: an INI file (inih) plus key=value overrides. */
#include "config.h"
#include "log.h"

#include <errno.h>
#include <stddef.h>
#include <ini.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void epd_config_defaults(struct epd_config *c)
{
	memset(c, 0, sizeof(*c));
	snprintf(c->socket_path, sizeof(c->socket_path), "%s",
		 EPD_DEFAULT_SOCKET);
	c->socket_mode = 0660;
	snprintf(c->backend, sizeof(c->backend), "auto");
	c->log_level = EPD_LOG_INFO;
	c->timeout_ms = 30000;
	c->cuda_copy_sms = EPD_COPY_SMS_AUTO; /* PERFORMANCE.md */
	c->cuda_combine_fetch = -1;
	/* The resident barrier's rank-side kernel and the daemon's data
	 * kernels spin on each other's words: under MPS that wedged the GPU
	 * (epd.conf(5), PERFORMANCE.md): opt-in only. */
	c->cuda_no_resident = true;
	c->frame_timeout_ms = 5000;
	c->worker_threads = 0;
	gethostname(c->node_name, sizeof(c->node_name) - 1);
	snprintf(c->transport, sizeof(c->transport), "auto");
	c->heartbeat_ms = 500;
	c->heartbeat_miss = 4;
	c->peer_linger_ms = 30000;
	c->peer_lookup = EPD_LOOKUP_PEERS;
	c->peer_nodes_max = 4096;
	c->limits = (struct epd_limits){.conns_per_uid = 256,
					.groups_per_uid = 64,
					.bytes_per_uid = 1ull << 40,
					.conns = 4096,
					.groups = 1024,
					.bytes = 4ull << 40,
					.handle_bytes = 4ull << 30,
					.queued_bytes = 256ull << 20,
					.handshakes = 64,
					.handshakes_per_host = 8};
}

void epd_config_free(struct epd_config *c)
{
	free(c->peers);
	c->peers = NULL;
}

/* peers: the list (append: after what is there, as a continuation). */
static int set_peers(struct epd_config *c, const char *v, bool append)
{
	const size_t old = append && c->peers ? strlen(c->peers) : 0,
		     n = strlen(v);
	char *p = malloc(old + n + 3);
	if (!p)
		return -3;
	if (old)
		memcpy(p, c->peers, old);
	snprintf(p + old, n + 3, "%s%s", old && n ? ", " : "", v);
	free(c->peers);
	c->peers = p;
	return 0;
}

static int parse_u64(const char *v, uint64_t *out)
{
	char *end;
	errno = 0;
	unsigned long long x = strtoull(v, &end, 10);
	uint64_t mul = 1;
	switch (*end) {
	case 'K': case 'k': mul = 1ull << 10; end++; break;
	case 'M': case 'm': mul = 1ull << 20; end++; break;
	case 'G': case 'g': mul = 1ull << 30; end++; break;
	case 'T': case 't': mul = 1ull << 40; end++; break;
	}
	if (errno || end == v || *end || x > UINT64_MAX / mul)
		return -1;
	*out = x * mul;
	return 0;
}

/* yes/true/on or no/false/off. */
static int parse_bool(const char *v, bool *out)
{
	static const char *const yes[] = {"yes", "true", "on"},
				 *const no[] = {"no", "false", "off"};
	for (int i = 0; i < 3; i++) {
		if (!strcmp(v, yes[i]))
			return *out = true, 0;
		if (!strcmp(v, no[i]))
			return *out = false, 0;
	}
	return -1;
}

static int parse_u32(const char *v, uint32_t min, uint32_t max, int base,
		     uint32_t *out)
{
	char *end;
	errno = 0;
	unsigned long x = strtoul(v, &end, base);
	if (errno || end == v || *end || x < min || x > max)
		return -1;
	*out = (uint32_t)x;
	return 0;
}

static int parse_allow(struct epd_config *c, const char *v)
{
	char buf[1024];
	snprintf(buf, sizeof(buf), "%s", v);
	c->nallow = 0;
	for (char *save, *t = strtok_r(buf, ", ", &save); t;
	     t = strtok_r(NULL, ", ", &save)) {
		uint32_t uid;
		if (c->nallow == EPD_MAX_ALLOW)
			return -1;
		if (parse_u32(t, 0, UINT32_MAX - 1, 10, &uid)) {
			struct passwd *pw = getpwnam(t);
			if (!pw)
				return -1;
			uid = pw->pw_uid;
		}
		c->allow_uids[c->nallow++] = uid;
	}
	return 0;
}

/* The keys that need more than a table row. Each returns 0 or -2. */
static int set_log_level(struct epd_config *c, const char *v)
{
	int l = epd_log_parse_level(v);
	if (l < 0)
		return -2;
	c->log_level = l;
	return 0;
}

static int set_allow(struct epd_config *c, const char *v)
{
	return parse_allow(c, v) ? -2 : 0;
}

static int set_combine_fetch(struct epd_config *c, const char *v)
{
	bool b;
	if (!strcmp(v, "auto"))
		c->cuda_combine_fetch = -1;
	else if (!strcmp(v, "lean"))
		c->cuda_combine_fetch = 2;
	else if (parse_bool(v, &b))
		return -2;
	else
		c->cuda_combine_fetch = b;
	return 0;
}

static int set_peers_key(struct epd_config *c, const char *v)
{
	return set_peers(c, v, false);
}

static int set_peer_connect(struct epd_config *c, const char *v)
{
	if (strcmp(v, "all") && strcmp(v, "on-demand"))
		return -2;
	c->peer_connect_all = !strcmp(v, "all");
	return 0;
}

static int set_peer_lookup(struct epd_config *c, const char *v)
{
	if (!strcmp(v, "peers"))
		c->peer_lookup = EPD_LOOKUP_PEERS;
	else if (!strcmp(v, "dns"))
		c->peer_lookup = EPD_LOOKUP_DNS;
	else if (!strcmp(v, "job"))
		c->peer_lookup = EPD_LOOKUP_JOB;
	else
		return -2;
	return 0;
}

/* Every key of epd.conf(5): how its value is read, where it goes, and
 * what a valid one is (said in the refusal of a bad one). */
enum key_kind {
	K_STR,	   /* text of 1.. (or 0.. with lo 0) bytes below the field */
	K_CHOICE,  /* one of the words of `expect`, kept as text */
	K_U32,	   /* lo..hi in base `base` */
	K_U32_AUTO, /* the same, or "auto" (stored as hi2) */
	K_U64,	   /* bytes, K/M/G/T suffixes, at least lo */
	K_OFF,	   /* yes/no, kept as its "off" flag */
	K_FN	   /* its own function */
};

struct key {
	const char *name;
	enum key_kind kind;
	size_t off, size;
	uint32_t lo, hi, hi2;
	int base;
	int (*fn)(struct epd_config *c, const char *v);
	const char *expect; /* K_CHOICE's words, K_FN's form */
};

#define F(f) offsetof(struct epd_config, f), sizeof(((struct epd_config *)0)->f)
#define STR(n, f, lo) {n, K_STR, F(f), lo, 0, 0, 0, NULL, NULL}
#define CHOICE(n, f, w) {n, K_CHOICE, F(f), 0, 0, 0, 0, NULL, w}
#define U32(n, f, lo, hi) {n, K_U32, F(f), lo, hi, 0, 10, NULL, NULL}
#define U32A(n, f, lo, hi, a) {n, K_U32_AUTO, F(f), lo, hi, a, 10, NULL, NULL}
#define U64(n, f, lo) {n, K_U64, F(f), lo, 0, 0, 0, NULL, NULL}
#define OFF(n, f) {n, K_OFF, F(f), 0, 0, 0, 0, NULL, NULL}
#define FN(n, fn, w) {n, K_FN, 0, 0, 0, 0, 0, 0, fn, w}

static const struct key keys[] = {
	STR("socket", socket_path, 1),
	{"socket_mode", K_U32, F(socket_mode), 0, 0777, 0, 8, NULL, NULL},
	CHOICE("backend", backend, "auto|host|cuda"),
	FN("log_level", set_log_level, "error|warning|warn|notice|info|debug"),
	U32("timeout_ms", timeout_ms, 1, 3600000),
	U32("frame_timeout_ms", frame_timeout_ms, 1, 600000),
	FN("allow_users", set_allow,
	   "up to 32 user names or uids, separated by commas"),
	STR("shared_groups", shared_groups, 0),
	U32("cuda_sms", cuda_sms, 0, 1024),
	U32A("cuda_copy_sms", cuda_copy_sms, 0, 1024, EPD_COPY_SMS_AUTO),
	U32A("cuda_copy_blocks_per_sm", cuda_copy_bps, 1, 32, 0),
	FN("cuda_combine_fetch", set_combine_fetch, "auto|lean|yes|no"),
	OFF("cuda_tma", cuda_no_tma),
	OFF("cuda_fused_prep", cuda_no_fused_prep),
	OFF("cuda_pdl", cuda_no_pdl),
	OFF("cuda_resident_barrier", cuda_no_resident),
	OFF("host_barrier", no_host_barrier),
	STR("node_name", node_name, 1),
	FN("peers", set_peers_key, "name@host:port, ..."),
	STR("cluster_key_file", cluster_key_file, 0),
	CHOICE("transport", transport, "auto|tcp|rdma"),
	U32("heartbeat_ms", heartbeat_ms, 10, 60000),
	FN("peer_connect", set_peer_connect, "all|on-demand"),
	FN("peer_lookup", set_peer_lookup, "peers|dns|job"),
	U32("peer_nodes_max", peer_nodes_max, 2, 1u << 20),
	U32("peer_linger_ms", peer_linger_ms, 0, 86400000),
	U32("heartbeat_miss", heartbeat_miss, 2, 100),
	U32("peer_handshakes_max", limits.handshakes, 1, 1u << 16),
	U32("peer_handshakes_per_host", limits.handshakes_per_host, 1,
	    1u << 16),
	U32("max_connections_per_user", limits.conns_per_uid, 0, 1u << 20),
	U32("max_groups_per_user", limits.groups_per_uid, 0, 1u << 20),
	U64("max_bytes_per_user", limits.bytes_per_uid, 0),
	U32("max_connections", limits.conns, 0, 1u << 20),
	U32("max_groups", limits.groups, 0, 1u << 20),
	U64("max_bytes", limits.bytes, 0),
	U64("max_queued_bytes", limits.queued_bytes, 1u << 20),
	U64("max_handle_bytes", limits.handle_bytes, 0),
	U32("worker_threads", worker_threads, 0, 256),
};

/* The table's fields are of the sizes its kinds write. */
_Static_assert(sizeof(((struct epd_config *)0)->socket_mode) == 4 &&
		       sizeof(((struct epd_config *)0)->cuda_sms) == 4 &&
		       sizeof(((struct epd_config *)0)->worker_threads) == 4,
	       "K_U32 fields are 32 bits");

static const struct key *key_find(const char *name)
{
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
		if (!strcmp(keys[i].name, name))
			return &keys[i];
	return NULL;
}

/* What a valid value of key k is, for the refusal of a bad one. */
static void key_expect(const struct key *k, char *out, size_t n)
{
	switch (k->kind) {
	case K_STR:
		snprintf(out, n, "text of %u to %zu bytes", k->lo,
			 k->size - 1);
		break;
	case K_U32:
	case K_U32_AUTO:
		snprintf(out, n, k->base == 8 ? "%o..%o (octal)%s" : "%u..%u%s",
			 k->lo, k->hi,
			 k->kind == K_U32_AUTO ? " or auto" : "");
		break;
	case K_U64:
		if (k->lo)
			snprintf(out, n,
				 "bytes (K, M, G, T suffixes), at least %u",
				 k->lo);
		else
			snprintf(out, n, "bytes (K, M, G, T suffixes)");
		break;
	case K_OFF:
		snprintf(out, n, "yes|no|true|false|on|off");
		break;
	default:
		snprintf(out, n, "%s", k->expect);
	}
}

/* Returns 0, or -1 for an unknown key, -2 for a bad value, -3 out of
 * memory. */
static int set_key(struct epd_config *c, const char *key, const char *v)
{
	const struct key *k = key_find(key);
	if (!k)
		return -1;
	char *f = (char *)c + k->off;
	uint32_t u;
	uint64_t x;
	bool b;
	switch (k->kind) {
	case K_STR:
		if (strlen(v) < k->lo || strlen(v) >= k->size)
			return -2;
		memcpy(f, v, strlen(v) + 1);
		return 0;
	case K_CHOICE: {
		const size_t n = strlen(v);
		const char *w = k->expect;
		bool ok = false;
		while (!ok && *w) {
			const size_t wl = strcspn(w, "|");
			ok = wl == n && !strncmp(w, v, n);
			w += wl + (w[wl] == '|');
		}
		if (!ok || n >= k->size)
			return -2;
		memcpy(f, v, n + 1);
		return 0;
	}
	case K_U32_AUTO:
		if (!strcmp(v, "auto")) {
			memcpy(f, &k->hi2, 4);
			return 0;
		}
		/* fall through */
	case K_U32:
		if (parse_u32(v, k->lo, k->hi, k->base, &u))
			return -2;
		memcpy(f, &u, 4);
		return 0;
	case K_U64:
		if (parse_u64(v, &x) || x < k->lo)
			return -2;
		memcpy(f, &x, 8);
		return 0;
	case K_OFF:
		if (parse_bool(v, &b))
			return -2;
		*(bool *)f = !b;
		return 0;
	case K_FN:
		return k->fn(c, v);
	}
	return -1;
}

/* "bad value 'v' for 'key': expected ..." into out. */
static void bad_value(const char *key, const char *v, char *out, size_t n)
{
	char want[128] = "";
	const struct key *k = key_find(key);
	if (k)
		key_expect(k, want, sizeof(want));
	snprintf(out, n, "bad value '%.200s' for '%s': expected %s", v, key,
		 want);
}

struct load_ctx {
	struct epd_config *c;
	const char *path;
	int bad;
	FILE *f;
	int line;     /* lines read */
	int too_long; /* the first line over the limit, or 0 */
};

/* inih's reader, fgets with a check: a line that does not fit the
 * parser's buffer (num bytes) ends the parse, never split into a second
 * line that would be taken as a key of its own. */
static char *read_line(char *str, int num, void *arg)
{
	struct load_ctx *l = arg;
	if (!fgets(str, num, l->f))
		return NULL;
	l->line++;
	size_t n = strlen(str);
	if (n == (size_t)num - 1 && str[n - 1] != '\n' && !feof(l->f)) {
		l->too_long = l->line;
		return NULL;
	}
	return str;
}

static int ini_cb(void *user, const char *section, const char *name,
		  const char *value)
{
	struct load_ctx *l = user;
	if (!*section) {
		epd_err("%s: '%s' is outside a section (keys go under [epd])",
			l->path, name);
		l->bad = 1;
		return 1;
	}
	if (strcmp(section, "epd")) {
		epd_err("%s: unknown section [%s]", l->path, section);
		l->bad = 1;
		return 1;
	}
	/* peers on several lines (a continuation, or the key again): one
	 * list */
	int rc = !strcmp(name, "peers") ? set_peers(l->c, value, true)
					: set_key(l->c, name, value);
	if (rc == -3)
		epd_err("%s: out of memory", l->path);
	else if (rc == -1)
		epd_err("%s: unknown key '%s'", l->path, name);
	else if (rc == -2) {
		char m[512];
		bad_value(name, value, m, sizeof(m));
		epd_err("%s: %s", l->path, m);
	}
	if (rc)
		l->bad = 1;
	return 1;
}

int epd_config_load(struct epd_config *c, const char *path, bool required)
{
	FILE *f = fopen(path, "re");
	if (!f) {
		if (errno == ENOENT && !required)
			return 0;
		epd_err("cannot open config %s: %m", path);
		return -1;
	}
	struct load_ctx l = {.c = c, .path = path, .f = f};
	int rc = ini_parse_stream(read_line, &l, ini_cb, &l);
	fclose(f);
	if (l.too_long) {
		epd_err("%s:%d: line longer than %d bytes (the INI parser's "
			"limit); give a long peers list on several lines, each "
			"continuation indented",
			path, l.too_long, EPD_CONFIG_LINE_MAX);
		return -1;
	}
	if (rc > 0) {
		epd_err("%s:%d: syntax error", path, rc);
		return -1;
	}
	return l.bad ? -1 : 0;
}

int epd_config_set(struct epd_config *c, const char *kv)
{
	char key[64];
	const char *eq = strchr(kv, '=');
	if (!eq || eq == kv || (size_t)(eq - kv) >= sizeof(key)) {
		epd_err("override '%s' is not key=value", kv);
		return -1;
	}
	memcpy(key, kv, (size_t)(eq - kv));
	key[eq - kv] = 0;
	int rc = set_key(c, key, eq + 1);
	if (rc == -3)
		epd_err("out of memory");
	else if (rc == -1)
		epd_err("unknown key '%s'", key);
	else if (rc == -2) {
		char m[512];
		bad_value(key, eq + 1, m, sizeof(m));
		epd_err("%s", m);
	}
	return rc ? -1 : 0;
}
