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

/* The yes/no options, each kept as its "off" flag (all default yes but
 * cuda_resident_barrier): the flag of key in c, or NULL. */
static bool *yes_no_flag(struct epd_config *c, const char *key)
{
	static const struct {
		const char *key;
		size_t off;
	} opts[] = {
		{"cuda_tma", offsetof(struct epd_config, cuda_no_tma)},
		{"cuda_fused_prep",
		 offsetof(struct epd_config, cuda_no_fused_prep)},
		{"cuda_pdl", offsetof(struct epd_config, cuda_no_pdl)},
		{"cuda_resident_barrier",
		 offsetof(struct epd_config, cuda_no_resident)},
		{"host_barrier", offsetof(struct epd_config, no_host_barrier)}};
	for (size_t i = 0; i < sizeof(opts) / sizeof(opts[0]); i++)
		if (!strcmp(key, opts[i].key))
			return (bool *)((char *)c + opts[i].off);
	return NULL;
}

/* Returns 0, or -1 for an unknown key, -2 for a bad value. */
static int set_key(struct epd_config *c, const char *key, const char *v)
{
	uint32_t u;
	bool *off;
	if (!strcmp(key, "socket")) {
		if (!*v || strlen(v) >= sizeof(c->socket_path))
			return -2;
		snprintf(c->socket_path, sizeof(c->socket_path), "%s", v);
	} else if (!strcmp(key, "socket_mode")) {
		if (parse_u32(v, 0, 0777, 8, &u))
			return -2;
		c->socket_mode = u;
	} else if (!strcmp(key, "backend")) {
		if (strcmp(v, "auto") && strcmp(v, "host") && strcmp(v, "cuda"))
			return -2;
		snprintf(c->backend, sizeof(c->backend), "%s", v);
	} else if (!strcmp(key, "log_level")) {
		int l = epd_log_parse_level(v);
		if (l < 0)
			return -2;
		c->log_level = l;
	} else if (!strcmp(key, "timeout_ms")) {
		if (parse_u32(v, 1, 3600000, 10, &u))
			return -2;
		c->timeout_ms = u;
	} else if (!strcmp(key, "frame_timeout_ms")) {
		if (parse_u32(v, 1, 600000, 10, &u))
			return -2;
		c->frame_timeout_ms = u;
	} else if (!strcmp(key, "allow_users")) {
		if (parse_allow(c, v))
			return -2;
	} else if (!strcmp(key, "shared_groups")) {
		if (strlen(v) >= sizeof(c->shared_groups))
			return -2;
		snprintf(c->shared_groups, sizeof(c->shared_groups), "%s", v);
	} else if (!strcmp(key, "cuda_sms")) {
		if (parse_u32(v, 0, 1024, 10, &u))
			return -2;
		c->cuda_sms = u;
	} else if (!strcmp(key, "cuda_copy_sms")) {
		if (!strcmp(v, "auto"))
			u = EPD_COPY_SMS_AUTO;
		else if (parse_u32(v, 0, 1024, 10, &u))
			return -2;
		c->cuda_copy_sms = u;
	} else if (!strcmp(key, "cuda_copy_blocks_per_sm")) {
		if (!strcmp(v, "auto"))
			u = 0;
		else if (parse_u32(v, 1, 32, 10, &u))
			return -2;
		c->cuda_copy_bps = u;
	} else if (!strcmp(key, "cuda_combine_fetch")) {
		bool b;
		if (!strcmp(v, "auto"))
			c->cuda_combine_fetch = -1;
		else if (!strcmp(v, "lean"))
			c->cuda_combine_fetch = 2;
		else if (parse_bool(v, &b))
			return -2;
		else
			c->cuda_combine_fetch = b;
	} else if ((off = yes_no_flag(c, key)) != NULL) {
		bool b;
		if (parse_bool(v, &b))
			return -2;
		*off = !b;
	} else if (!strcmp(key, "node_name")) {
		if (!*v || strlen(v) >= sizeof(c->node_name))
			return -2;
		snprintf(c->node_name, sizeof(c->node_name), "%s", v);
	} else if (!strcmp(key, "peers")) {
		return set_peers(c, v, false);
	} else if (!strcmp(key, "cluster_key_file")) {
		if (strlen(v) >= sizeof(c->cluster_key_file))
			return -2;
		snprintf(c->cluster_key_file, sizeof(c->cluster_key_file),
			 "%s", v);
	} else if (!strcmp(key, "transport")) {
		if (strcmp(v, "auto") && strcmp(v, "tcp") && strcmp(v, "rdma"))
			return -2;
		snprintf(c->transport, sizeof(c->transport), "%s", v);
	} else if (!strcmp(key, "heartbeat_ms")) {
		if (parse_u32(v, 10, 60000, 10, &u))
			return -2;
		c->heartbeat_ms = u;
	} else if (!strcmp(key, "peer_connect")) {
		if (strcmp(v, "all") && strcmp(v, "on-demand"))
			return -2;
		c->peer_connect_all = !strcmp(v, "all");
	} else if (!strcmp(key, "peer_lookup")) {
		if (!strcmp(v, "peers"))
			c->peer_lookup = EPD_LOOKUP_PEERS;
		else if (!strcmp(v, "dns"))
			c->peer_lookup = EPD_LOOKUP_DNS;
		else if (!strcmp(v, "job"))
			c->peer_lookup = EPD_LOOKUP_JOB;
		else
			return -2;
	} else if (!strcmp(key, "peer_nodes_max")) {
		if (parse_u32(v, 2, 1u << 20, 10, &c->peer_nodes_max))
			return -2;
	} else if (!strcmp(key, "peer_linger_ms")) {
		if (parse_u32(v, 0, 86400000, 10, &c->peer_linger_ms))
			return -2;
	} else if (!strcmp(key, "heartbeat_miss")) {
		if (parse_u32(v, 2, 100, 10, &u))
			return -2;
		c->heartbeat_miss = u;
	} else if (!strcmp(key, "peer_handshakes_max")) {
		if (parse_u32(v, 1, 1u << 16, 10, &c->limits.handshakes))
			return -2;
	} else if (!strcmp(key, "peer_handshakes_per_host")) {
		if (parse_u32(v, 1, 1u << 16, 10,
			      &c->limits.handshakes_per_host))
			return -2;
	} else if (!strcmp(key, "max_connections_per_user")) {
		if (parse_u32(v, 0, 1u << 20, 10, &c->limits.conns_per_uid))
			return -2;
	} else if (!strcmp(key, "max_groups_per_user")) {
		if (parse_u32(v, 0, 1u << 20, 10, &c->limits.groups_per_uid))
			return -2;
	} else if (!strcmp(key, "max_bytes_per_user")) {
		if (parse_u64(v, &c->limits.bytes_per_uid))
			return -2;
	} else if (!strcmp(key, "max_connections")) {
		if (parse_u32(v, 0, 1u << 20, 10, &c->limits.conns))
			return -2;
	} else if (!strcmp(key, "max_groups")) {
		if (parse_u32(v, 0, 1u << 20, 10, &c->limits.groups))
			return -2;
	} else if (!strcmp(key, "max_bytes")) {
		if (parse_u64(v, &c->limits.bytes))
			return -2;
	} else if (!strcmp(key, "max_queued_bytes")) {
		if (parse_u64(v, &c->limits.queued_bytes) ||
		    c->limits.queued_bytes < (1u << 20))
			return -2;
	} else if (!strcmp(key, "max_handle_bytes")) {
		if (parse_u64(v, &c->limits.handle_bytes))
			return -2;
	} else if (!strcmp(key, "worker_threads")) {
		if (parse_u32(v, 0, 256, 10, &u))
			return -2;
		c->worker_threads = u;
	} else {
		return -1;
	}
	return 0;
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
	else if (rc == -2)
		epd_err("%s: bad value '%s' for '%s'", l->path, value, name);
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
	else if (rc == -2)
		epd_err("bad value '%s' for '%s'", eq + 1, key);
	return rc ? -1 : 0;
}
