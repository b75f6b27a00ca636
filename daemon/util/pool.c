/* SPDX-License-Identifier: MIT */
#include "pool.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

struct epd_pool {
	pthread_mutex_t run_mu; /* one job at a time */
	pthread_mutex_t mu;
	pthread_cond_t work, done;
	pthread_t *threads;
	unsigned n;
	uint64_t generation;
	void (*fn)(void *, uint32_t);
	void *arg;
	uint32_t items, next, finished;
	unsigned active;
	bool stop;
};

/* Take items until none are left; returns how many this thread did. */
static uint32_t drain(struct epd_pool *p)
{
	uint32_t did = 0;
	for (;;) {
		uint32_t i = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED);
		if (i >= p->items)
			return did;
		p->fn(p->arg, i);
		did++;
	}
}

static void *worker(void *arg)
{
	struct epd_pool *p = arg;
	uint64_t seen = 0;
	pthread_mutex_lock(&p->mu);
	for (;;) {
		while (!p->stop && p->generation == seen)
			pthread_cond_wait(&p->work, &p->mu);
		if (p->stop)
			break;
		seen = p->generation;
		p->active++;
		pthread_mutex_unlock(&p->mu);
		uint32_t did = drain(p);
		pthread_mutex_lock(&p->mu);
		p->finished += did;
		p->active--;
		pthread_cond_broadcast(&p->done);
	}
	pthread_mutex_unlock(&p->mu);
	return NULL;
}

struct epd_pool *epd_pool_new(unsigned nthreads)
{
	if (nthreads == 0) {
		long c = sysconf(_SC_NPROCESSORS_ONLN);
		nthreads = c > 0 ? (unsigned)c : 1;
	}
	struct epd_pool *p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	pthread_mutex_init(&p->run_mu, NULL);
	pthread_mutex_init(&p->mu, NULL);
	pthread_cond_init(&p->work, NULL);
	pthread_cond_init(&p->done, NULL);
	/* The caller of epd_pool_run works too: n-1 helpers. */
	p->threads = calloc(nthreads, sizeof(pthread_t));
	if (!p->threads) {
		free(p);
		return NULL;
	}
	for (unsigned i = 0; i + 1 < nthreads; i++) {
		if (pthread_create(&p->threads[i], NULL, worker, p))
			break;
		p->n++;
	}
	return p;
}

void epd_pool_free(struct epd_pool *p)
{
	if (!p)
		return;
	pthread_mutex_lock(&p->mu);
	p->stop = true;
	pthread_cond_broadcast(&p->work);
	pthread_mutex_unlock(&p->mu);
	for (unsigned i = 0; i < p->n; i++)
		pthread_join(p->threads[i], NULL);
	free(p->threads);
	free(p);
}

unsigned epd_pool_size(const struct epd_pool *p)
{
	return p->n + 1;
}

void epd_pool_run(struct epd_pool *p, uint32_t n,
		  void (*fn)(void *arg, uint32_t i), void *arg)
{
	if (n == 0)
		return;
	pthread_mutex_lock(&p->run_mu);
	pthread_mutex_lock(&p->mu);
	/* a helper that woke late for the last job must be out of it */
	while (p->active)
		pthread_cond_wait(&p->done, &p->mu);
	p->fn = fn;
	p->arg = arg;
	p->items = n;
	p->next = 0;
	p->finished = 0;
	p->generation++;
	pthread_cond_broadcast(&p->work);
	pthread_mutex_unlock(&p->mu);
	uint32_t did = drain(p);
	pthread_mutex_lock(&p->mu);
	p->finished += did;
	/* every item done, and no helper still inside this job */
	while (p->finished < n || p->active)
		pthread_cond_wait(&p->done, &p->mu);
	p->items = 0; /* late wakers find nothing to do */
	pthread_mutex_unlock(&p->mu);
	pthread_mutex_unlock(&p->run_mu);
}
