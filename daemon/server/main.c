/* SPDX-License-Identifier: MIT */
/* epd: the expert-parallel communication daemon. */
#include "server.h"
#include "cluster/cluster.h"

#include <getopt.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f)
{
	fprintf(f,
		"usage: epd [options]\n"
		"  -c, --config PATH     configuration file (default %s)\n"
		"  -s, --socket PATH     control socket (default %s)\n"
		"  -b, --backend NAME    auto, host or cuda\n"
		"  -l, --log-level LVL   error, warning, notice, info, debug\n"
		"  -o, --set KEY=VALUE   override a configuration key\n"
		"  -t, --check-config    check the configuration and exit\n"
		"  -V, --version         print the version and exit\n"
		"  -h, --help            this text\n",
		EPD_DEFAULT_CONFIG, EPD_DEFAULT_SOCKET);
}

/* Descriptors: every client connection, group buffer and peer connection
 * holds some. The soft limit a service starts with is often 1024 (systemd's
 * default) while the hard one is far higher: take the hard one, as a
 * server that accepts thousands of connections must, and say so when even
 * that is below what the configured limits may need. */
static void raise_nofile(const struct epd_config *cfg)
{
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl))
		return;
	if (rl.rlim_cur < rl.rlim_max) {
		rlim_t was = rl.rlim_cur;
		rl.rlim_cur = rl.rlim_max;
		if (setrlimit(RLIMIT_NOFILE, &rl))
			rl.rlim_cur = was;
	}
	const uint64_t need = (uint64_t)cfg->limits.conns + 256;
	if (cfg->limits.conns && rl.rlim_cur != RLIM_INFINITY &&
	    (uint64_t)rl.rlim_cur < need)
		epd_warn("descriptor limit %llu is below max_connections + 256 "
			 "(%llu): clients past it are refused",
			 (unsigned long long)rl.rlim_cur,
			 (unsigned long long)need);
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{"config", required_argument, NULL, 'c'},
		{"socket", required_argument, NULL, 's'},
		{"backend", required_argument, NULL, 'b'},
		{"log-level", required_argument, NULL, 'l'},
		{"set", required_argument, NULL, 'o'},
		{"check-config", no_argument, NULL, 't'},
		{"version", no_argument, NULL, 'V'},
		{"help", no_argument, NULL, 'h'},
		{0},
	};
	const char *config = NULL;
	char *over[64];
	int nover = 0, opt, rc = 0;
	bool check = false;
	struct epd_config cfg = {0};
	uv_loop_t loop;
	struct epd_server srv;

	epd_log_init();
	/* Command-line values override the file: collect them as key=value
	 * and apply them after it. Every way out frees them (out). */
	while ((opt = getopt_long(argc, argv, "c:s:b:l:o:tVh", opts, NULL)) !=
	       -1) {
		const char *key = NULL;
		switch (opt) {
		case 'c': config = optarg; continue;
		case 's': key = "socket"; break;
		case 'b': key = "backend"; break;
		case 'l': key = "log_level"; break;
		case 'o': key = ""; break;
		case 't': check = true; continue;
		case 'V': printf("epd %s\n", PACKAGE_VERSION); goto out;
		case 'h': usage(stdout); goto out;
		default: usage(stderr); rc = 2; goto out;
		}
		if (nover == 64) {
			fprintf(stderr, "epd: too many overrides\n");
			rc = 2;
			goto out;
		}
		/* any length: a value is never cut here */
		const size_t kl = strlen(key), vl = strlen(optarg);
		if ((over[nover] = malloc(kl + vl + 2)))
			snprintf(over[nover], kl + vl + 2, "%s%s%s", key,
				 *key ? "=" : "", optarg);
		if (!over[nover]) {
			fprintf(stderr, "epd: out of memory\n");
			rc = 1;
			goto out;
		}
		nover++;
	}
	if (optind < argc) {
		usage(stderr);
		rc = 2;
		goto out;
	}
	epd_config_defaults(&cfg);
	if (epd_config_load(&cfg, config ? config : EPD_DEFAULT_CONFIG,
			    config != NULL)) {
		rc = 1;
		goto out;
	}
	for (int i = 0; i < nover; i++)
		if (epd_config_set(&cfg, over[i])) {
			rc = 2;
			goto out;
		}
	epd_log_level = cfg.log_level;
	if (check) {
		/* every check start makes of the configuration, short of
		 * opening sockets and devices */
		char err[512];
		if (epd_cluster_check(&cfg, err, sizeof(err))) {
			fprintf(stderr, "epd: %s\n", err);
			rc = 1;
			goto out;
		}
		printf("configuration ok\n");
		goto out;
	}
	raise_nofile(&cfg);
	uv_loop_init(&loop);
	if (epd_server_init(&srv, &loop, &cfg,
			    config ? config : EPD_DEFAULT_CONFIG) ||
	    epd_server_overrides(&srv, over, nover)) {
		rc = 1;
		goto out;
	}
	epd_server_run(&srv);
	uv_loop_close(&loop);
	epd_notice("stopped");
out:
	for (int i = 0; i < nover; i++)
		free(over[i]);
	epd_config_free(&cfg);
	return rc;
}
