/* SPDX-License-Identifier: MIT */
/* daemon/backend/cuda/hostbar.c, the host barrier thread, driven by CPU threads that
 * play the ranks' streams: post the request (and wake the thread), ring,
 * wait for done. Nobody leaves barrier k before every rank rang it; a rank
 * that never rings is a timeout naming it; a rank that rings another number
 * is a mismatch naming it; a stop ends a wait; release raises done words
 * and nothing lowers them; numbers wrap past 2^32. */
#include "harness.h"
#include "backend/cuda/hostbar.h"

#include "epp.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define RPN 4
#define ROUNDS 3000

static uint8_t *map;
static uint32_t arrived[ROUNDS + 2];
static uint64_t base; /* the group's op number at start */

static uint32_t *hw(uint32_t l, uint32_t off)
{
	return (uint32_t *)(map + EPP_CTL_HB + l * EPP_CTL_HB_STRIDE + off);
}

/* What libep does on the CPU, then what the rank's stream does. */
static void post(uint32_t l, uint32_t k)
{
	uint32_t *sw = (uint32_t *)(map + EPP_CTL_GROUP_SLOT +
				    EPP_CTL_HB_SLEEP);
	__atomic_store_n(hw(l, EPP_HB_REQ), k, __ATOMIC_SEQ_CST);
	if (__atomic_load_n(sw, __ATOMIC_SEQ_CST))
		syscall(SYS_futex, sw, FUTEX_WAKE, 1, NULL, NULL, 0);
}

static void ring(uint32_t l, uint32_t k)
{
	__atomic_store_n(hw(l, EPP_HB_BELL), k, __ATOMIC_RELEASE);
}

static bool wait_done(uint32_t l, uint32_t k, unsigned ms)
{
	uint64_t end = th_now_ns() + ms * 1000000ull;
	while ((int32_t)(__atomic_load_n(hw(l, EPP_HB_DONE),
					 __ATOMIC_ACQUIRE) -
			 k) < 0) {
		if (th_now_ns() > end)
			return false;
		sched_yield();
	}
	return true;
}

static void *rank_rounds(void *arg)
{
	uint32_t l = (uint32_t)(uintptr_t)arg;
	for (uint32_t i = 1; i <= ROUNDS; i++) {
		uint32_t k = (uint32_t)(base + i);
		post(l, k);
		if (i % 97 == l * 13) /* a late rank now and then */
			th_sleep_ms(2);
		__atomic_fetch_add(&arrived[i], 1, __ATOMIC_SEQ_CST);
		ring(l, k);
		TH_CHECK(wait_done(l, k, 5000), "rank %u: barrier %u stuck", l,
			 i);
		uint32_t a = __atomic_load_n(&arrived[i], __ATOMIC_SEQ_CST);
		TH_CHECK(a == RPN, "rank %u left barrier %u with %u of %d "
				   "ranks arrived",
			 l, i, a, RPN);
	}
	return NULL;
}

static void fresh_map(void)
{
	memset(map, 0, EPP_BUF_HEADER);
}

static struct ek_bar_state *st_of(struct epd_hostbar *h)
{
	return epd_hostbar_state(h);
}

static uint32_t state(struct epd_hostbar *h, uint32_t want, unsigned ms)
{
	uint64_t end = th_now_ns() + ms * 1000000ull;
	uint32_t s;
	while ((s = __atomic_load_n(&st_of(h)->state, __ATOMIC_ACQUIRE)) !=
		       want &&
	       th_now_ns() < end)
		th_sleep_ms(1);
	return s;
}

/* A thread for 3 ranks on a fresh page, each of which posted barrier 1. */
static struct epd_hostbar *three_posted(uint64_t budget_ns)
{
	char err[128];
	struct epd_hostbar *h;
	fresh_map();
	TH_CHECK(epd_hostbar_start(&h, map, 3, budget_ns, 0, err,
				   sizeof(err)) == 0,
		 "%s", err);
	for (uint32_t l = 0; l < 3; l++)
		post(l, 1);
	return h;
}

static void rounds(uint64_t start, const char *what)
{
	char err[128];
	struct epd_hostbar *h;
	fresh_map();
	memset(arrived, 0, sizeof(arrived));
	base = start;
	TH_CHECK(epd_hostbar_start(&h, map, RPN, 10000000000ull, base, err,
				   sizeof(err)) == 0,
		 "%s", err);
	pthread_t t[RPN];
	for (uintptr_t l = 0; l < RPN; l++)
		TH_CHECK(pthread_create(&t[l], NULL, rank_rounds, (void *)l) == 0,
			 "thread");
	for (int l = 0; l < RPN; l++)
		pthread_join(t[l], NULL);
	struct ek_bar_state *s = st_of(h);
	TH_CHECK(__atomic_load_n(&s->count, __ATOMIC_ACQUIRE) == ROUNDS &&
			 __atomic_load_n(&s->last, __ATOMIC_ACQUIRE) ==
				 base + ROUNDS,
		 "count %llu last %llu", (unsigned long long)s->count,
		 (unsigned long long)s->last);
	for (uint32_t l = 0; l < RPN; l++) {
		uint64_t c = __atomic_load_n(
			(uint64_t *)(map + l * EPP_CTL_SLOT + EPP_CTL_COMPLETED),
			__ATOMIC_ACQUIRE);
		TH_CHECK(c == base + ROUNDS, "rank %u completed %llu", l,
			 (unsigned long long)c);
	}
	uint64_t busy = __atomic_load_n(&s->busy_ns, __ATOMIC_RELAXED);
	TH_CHECK(busy > 0 && busy / ROUNDS < 1000000000ull,
		 "engine time %llu ns over %d barriers",
		 (unsigned long long)busy, ROUNDS);
	printf("ok: %d barriers of %d ranks (%s): nobody left one before "
	       "every rank rang it; completed words and counts right "
	       "(engine %.2f us per barrier)\n",
	       ROUNDS, RPN, what, (double)busy / ROUNDS / 1e3);

	/* Idle: the thread sleeps on the futex; a request wakes it. */
	uint32_t *sw = (uint32_t *)(map + EPP_CTL_GROUP_SLOT +
				    EPP_CTL_HB_SLEEP);
	uint64_t end = th_now_ns() + 3000000000ull;
	while (!__atomic_load_n(sw, __ATOMIC_SEQ_CST) && th_now_ns() < end)
		th_sleep_ms(1);
	TH_CHECK(__atomic_load_n(sw, __ATOMIC_SEQ_CST) == 1,
		 "the idle thread never slept");
	th_sleep_ms(20);
	uint32_t k = (uint32_t)(base + ROUNDS + 1);
	uint64_t t0 = th_now_ns();
	for (uint32_t l = 0; l < RPN; l++) {
		post(l, k);
		ring(l, k);
	}
	for (uint32_t l = 0; l < RPN; l++)
		TH_CHECK(wait_done(l, k, 5000), "after sleeping: rank %u", l);
	uint64_t us = (th_now_ns() - t0) / 1000;
	/* the futex wait's own re-check is 1 s away */
	TH_CHECK(us < 500000, "a sleeping thread took %llu us to serve",
		 (unsigned long long)us);
	printf("ok: the idle thread slept and a request woke it (%llu us)\n",
	       (unsigned long long)us);
	epd_hostbar_free(h);
}

int main(void)
{
	th_init("unit: the host barrier thread", 120);
	map = aligned_alloc(4096, EPP_BUF_HEADER);
	TH_CHECK(map, "memory");
	char err[128];
	struct epd_hostbar *h;

	rounds(0, "from 0");
	rounds(0xffffffffull - 1000, "across 2^32");

	/* A rank that never rings: timeout naming it, nobody released. */
	h = three_posted(50000000ull);
	ring(0, 1);
	ring(1, 1);
	uint32_t s = state(h, EK_BAR_TIMEOUT, 5000);
	TH_CHECK(s == EK_BAR_TIMEOUT, "state %u", s);
	TH_CHECK(st_of(h)->missing == 1u << 2 && st_of(h)->seq == 1,
		 "missing %llx seq %u", (unsigned long long)st_of(h)->missing,
		 st_of(h)->seq);
	for (uint32_t l = 0; l < 3; l++)
		TH_CHECK(*hw(l, EPP_HB_DONE) == 0, "rank %u released", l);
	epd_hostbar_free(h);
	printf("ok: a rank that never rang: timeout naming local rank 2, "
	       "nobody released\n");

	/* A rank that rings another number: mismatch naming it. */
	h = three_posted(5000000000ull);
	ring(0, 1);
	ring(2, 1);
	th_sleep_ms(10);
	ring(1, 2);
	s = state(h, EK_BAR_MISMATCH, 5000);
	TH_CHECK(s == EK_BAR_MISMATCH && st_of(h)->missing == 1u << 1 &&
			 st_of(h)->seq == 1,
		 "state %u missing %llx seq %u", s,
		 (unsigned long long)st_of(h)->missing, st_of(h)->seq);
	epd_hostbar_free(h);
	printf("ok: a rank that rang barrier 2 in barrier 1: mismatch naming "
	       "local rank 1\n");

	/* Stopped mid-wait (a failed group): the thread ends at once; the
	 * release raises the done words, and nothing lowers them. */
	h = three_posted(60000000000ull);
	ring(0, 1);
	th_sleep_ms(20);
	uint64_t t0 = th_now_ns();
	epd_hostbar_stop(h);
	s = state(h, EK_BAR_STOPPED, 5000);
	TH_CHECK(s == EK_BAR_STOPPED, "state %u after stop", s);
	epd_hostbar_free(h);
	TH_CHECK(th_now_ns() - t0 < 2000000000ull, "stop took too long");
	epd_hostbar_release(map, 3, 1u << 30);
	epd_hostbar_release(map, 3, 5);
	for (uint32_t l = 0; l < 3; l++)
		TH_CHECK(*hw(l, EPP_HB_DONE) == 1u << 30, "rank %u done %u", l,
			 *hw(l, EPP_HB_DONE));
	printf("ok: stop ends a barrier's wait; release raises every done "
	       "word and a lower one does not lower it\n");

	TH_CHECK(epd_hostbar_start(&h, map, 0, 1, 0, err, sizeof(err)) ==
			 EP_EINVAL,
		 "0 ranks accepted");
	TH_CHECK(epd_hostbar_start(&h, map, 65, 1, 0, err, sizeof(err)) ==
			 EP_EINVAL,
		 "65 ranks accepted");
	printf("ok: 0 and 65 local ranks refused: %s\n", err);
	free(map);
	return 0;
}
