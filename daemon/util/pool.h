/* SPDX-License-Identifier: MIT */
/* A fixed pool of data-path threads running parallel-for jobs. */
#ifndef EPD_POOL_H
#define EPD_POOL_H

#include <stdint.h>

struct epd_pool;

/* nthreads 0: one per online core. */
struct epd_pool *epd_pool_new(unsigned nthreads);
void epd_pool_free(struct epd_pool *p);
unsigned epd_pool_size(const struct epd_pool *p);
/* Run fn(arg, i) for i in [0, n) on the pool and the calling thread; returns
 * when all are done. Jobs from several callers run one after another. */
void epd_pool_run(struct epd_pool *p, uint32_t n,
		  void (*fn)(void *arg, uint32_t i), void *arg);

#endif
