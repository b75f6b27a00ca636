/* SPDX-License-Identifier: MIT */
/* The data path's proxy thread and its command ring (see proxy.h). */
#include "proxy.h"
#include "util/spin.h"

#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define BATCH 64         /* commands per call of the poster at most */
#define SPIN_NS 200000ull /* idle spin before the futex sleep */

struct slot {
	_Atomic uint64_t stamp;
	struct epd_cmd cmd;
} __attribute__((aligned(64)));

struct epd_proxy {
	_Atomic uint64_t head __attribute__((aligned(64)));
	_Atomic uint64_t tail __attribute__((aligned(64)));
	_Atomic uint32_t sleeping __attribute__((aligned(64)));
	_Atomic int stopping;
	_Atomic uint64_t posted, batches;
	uint32_t mask;
	epd_proxy_post_fn post;
	void *arg;
	pthread_t thread;
	struct slot *ring;
};

static void wake(struct epd_proxy *p)
{
	if (atomic_load(&p->sleeping))
		syscall(SYS_futex, &p->sleeping, FUTEX_WAKE_PRIVATE, 1, NULL,
			NULL, 0);
}

static void *run(void *arg)
{
	struct epd_proxy *p = arg;
	struct epd_cmd batch[BATCH];
	uint64_t tail = 0, idle_since = 0;
	prctl(PR_SET_NAME, "epd-proxy");
	for (;;) {
		size_t n = 0;
		while (n < BATCH) {
			struct slot *s = &p->ring[(tail + n) & p->mask];
			if (atomic_load_explicit(&s->stamp,
						 memory_order_acquire) !=
			    tail + n + 1)
				break;
			batch[n++] = s->cmd;
		}
		if (n) {
			/* the slots are free again once copied out */
			for (size_t i = 0; i < n; i++)
				atomic_store_explicit(
					&p->ring[(tail + i) & p->mask].stamp,
					tail + i + p->mask + 1,
					memory_order_release);
			p->post(p->arg, batch, n);
			tail += n;
			atomic_store_explicit(&p->tail, tail,
					      memory_order_release);
			atomic_fetch_add(&p->posted, n);
			atomic_fetch_add(&p->batches, 1);
			idle_since = 0;
			continue;
		}
		/* nothing published at tail: done if stopping and nothing
		 * reserved either (a reserved slot is being written) */
		if (atomic_load(&p->stopping) && atomic_load(&p->head) == tail)
			break;
		uint64_t t = epd_now_ns();
		if (!idle_since)
			idle_since = t;
		if (t - idle_since < SPIN_NS || atomic_load(&p->head) != tail) {
			epd_cpu_relax();
			continue;
		}
		atomic_store(&p->sleeping, 1);
		if (atomic_load(&p->head) == tail && !atomic_load(&p->stopping)) {
			struct timespec to = {.tv_sec = 0, .tv_nsec = 100000000};
			syscall(SYS_futex, &p->sleeping, FUTEX_WAIT_PRIVATE, 1,
				&to, NULL, 0);
		}
		atomic_store(&p->sleeping, 0);
		idle_since = 0;
	}
	return NULL;
}

struct epd_proxy *epd_proxy_new(uint32_t slots, epd_proxy_post_fn post,
				void *arg, char *err, size_t errlen)
{
	if (slots < 2 || (slots & (slots - 1))) {
		snprintf(err, errlen, "proxy ring of %u slots: not a power of "
				      "two", slots);
		return NULL;
	}
	struct epd_proxy *p = aligned_alloc(64, sizeof(*p));
	struct slot *ring = aligned_alloc(64, (size_t)slots * sizeof(*ring));
	if (!p || !ring) {
		free(p);
		free(ring);
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	memset(p, 0, sizeof(*p));
	p->ring = ring;
	p->mask = slots - 1;
	p->post = post;
	p->arg = arg;
	for (uint32_t i = 0; i < slots; i++)
		atomic_init(&ring[i].stamp, i);
	int rc = pthread_create(&p->thread, NULL, run, p);
	if (rc) {
		snprintf(err, errlen, "starting the proxy thread: %s",
			 strerror(rc));
		free(ring);
		free(p);
		return NULL;
	}
	return p;
}

uint64_t epd_proxy_push(struct epd_proxy *p, const struct epd_cmd *c)
{
	if (atomic_load(&p->stopping))
		return 0;
	uint64_t pos = atomic_fetch_add(&p->head, 1);
	struct slot *s = &p->ring[pos & p->mask];
	unsigned spins = 0;
	while (atomic_load_explicit(&s->stamp, memory_order_acquire) != pos) {
		/* full: the proxy frees a slot per command it takes */
		if (atomic_load(&p->stopping))
			return 0;
		wake(p);
		if (++spins < 64)
			epd_cpu_relax();
		else
			sched_yield();
	}
	s->cmd = *c;
	atomic_store_explicit(&s->stamp, pos + 1, memory_order_release);
	wake(p);
	return pos + 1;
}

uint64_t epd_proxy_head(const struct epd_proxy *p)
{
	return atomic_load(&((struct epd_proxy *)p)->head);
}

bool epd_proxy_passed(const struct epd_proxy *p, uint64_t ticket)
{
	return atomic_load_explicit(&((struct epd_proxy *)p)->tail,
				    memory_order_acquire) >= ticket;
}

uint64_t epd_proxy_posted(const struct epd_proxy *p, uint64_t *batches)
{
	struct epd_proxy *q = (struct epd_proxy *)p;
	if (batches)
		*batches = atomic_load(&q->batches);
	return atomic_load(&q->posted);
}

void epd_proxy_free(struct epd_proxy *p)
{
	if (!p)
		return;
	atomic_store(&p->stopping, 1);
	atomic_store(&p->sleeping, 1); /* make sure the wake is sent */
	syscall(SYS_futex, &p->sleeping, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
	pthread_join(p->thread, NULL);
	free(p->ring);
	free(p);
}
