/* SPDX-License-Identifier: MIT */
/*
 * The host barrier thread (hostbar.h). One barrier at a time, as the
 * resident barrier kernel: wait for a first doorbell beyond the last
 * barrier, then for every local rank's (within the budget), check that all
 * rang the same number, then publish completion (the control page's
 * completed words) and release (the done words), in that order.
 */
#include "hostbar.h"
#include "util/spin.h"

#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "epp.h"

#define SPIN_NS 1000000ull   /* busy polling after the last progress */
#define IDLE_SPIN_NS 2000000ull /* and with nothing requested, before the
				   futex: waking takes tens of us, and
				   without MPS a done word seen late costs a
				   rescheduling of each rank's context
				   (measured: 30 us late -> 70 us more) */
#define NAP_NS 20000         /* then polls this far apart */
#define SLEEP_MAX_S 1          /* a futex wait re-checks after this */

struct epd_hostbar {
	pthread_t thread;
	uint8_t *map;
	uint32_t rpn;
	uint64_t budget_ns;
	uint64_t last;
	struct ek_bar_state st;
};

static uint32_t *word(uint8_t *map, uint32_t l, uint32_t off)
{
	return (uint32_t *)(map + EPP_CTL_HB + (size_t)l * EPP_CTL_HB_STRIDE +
			    off);
}

static uint32_t *sleep_word(uint8_t *map)
{
	return (uint32_t *)(map + EPP_CTL_GROUP_SLOT + EPP_CTL_HB_SLEEP);
}

static uint32_t ld(const uint32_t *p)
{
	return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

/* *p = max(*p, v), comparing 32-bit sequence numbers. */
static void raise_to(uint32_t *p, uint32_t v)
{
	uint32_t cur = __atomic_load_n(p, __ATOMIC_RELAXED);
	while ((int32_t)(v - cur) > 0 &&
	       !__atomic_compare_exchange_n(p, &cur, v, true, __ATOMIC_RELEASE,
					    __ATOMIC_RELAXED))
		;
}

static bool stopping(const struct epd_hostbar *h)
{
	return __atomic_load_n(&h->st.stop, __ATOMIC_ACQUIRE) != 0;
}

/* A wait that started (or last progressed) at t0 has spun for longer
 * than limit_ns (the clock is read every 64 polls); otherwise one pause. */
static bool spun_out(uint64_t t0, unsigned *spins, uint64_t limit_ns)
{
	if ((++*spins & 63) || epd_now_ns() - t0 < limit_ns) {
		epd_cpu_relax();
		return false;
	}
	return true;
}

/* One poll of a wait: spin, then nap between polls. */
static void backoff(uint64_t t0, unsigned *spins)
{
	if (spun_out(t0, spins, SPIN_NS)) {
		struct timespec ts = {0, NAP_NS};
		nanosleep(&ts, NULL);
	}
}

/* Local ranks (bit mask) with a doorbell behind k, or ahead of last
 * (ahead = true). */
static uint64_t bells(struct epd_hostbar *h, uint32_t k, bool ahead)
{
	uint64_t m = 0;
	for (uint32_t l = 0; l < h->rpn; l++) {
		int32_t d = (int32_t)(ld(word(h->map, l, EPP_HB_BELL)) - k);
		if (ahead ? d > 0 : d < 0)
			m |= 1ull << l;
	}
	return m;
}

/* A rank posted a barrier it has not rung yet. */
static bool requested(struct epd_hostbar *h)
{
	for (uint32_t l = 0; l < h->rpn; l++)
		if ((int32_t)(ld(word(h->map, l, EPP_HB_REQ)) -
			      (uint32_t)h->last) > 0)
			return true;
	return false;
}

static void fail(struct epd_hostbar *h, uint32_t state, uint32_t k,
		 uint64_t missing)
{
	h->st.missing = missing;
	h->st.seq = k;
	__atomic_store_n(&h->st.state, state, __ATOMIC_RELEASE);
}

/* Idle: sleep on the futex until a rank posts a request (or the stop). */
static void idle_sleep(struct epd_hostbar *h)
{
	uint32_t *sw = sleep_word(h->map);
	__atomic_store_n(sw, 1, __ATOMIC_SEQ_CST);
	/* a rank stores its request, then reads the sleep word: one of us
	 * sees the other's store */
	if (!requested(h) && !bells(h, (uint32_t)h->last, true) &&
	    !stopping(h)) {
		struct timespec ts = {SLEEP_MAX_S, 0};
		syscall(SYS_futex, sw, FUTEX_WAIT, 1, &ts, NULL, 0);
	}
	__atomic_store_n(sw, 0, __ATOMIC_SEQ_CST);
}

static void *run(void *arg)
{
	struct epd_hostbar *h = arg;
	/* short naps really short: the default slack is 50 us */
	prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
	pthread_setname_np(pthread_self(), "epd-hostbar");
	uint64_t t0 = epd_now_ns();
	unsigned spins = 0;
	while (!stopping(h)) {
		uint32_t last = (uint32_t)h->last;
		uint64_t rung = bells(h, last, true);
		if (!rung) {
			if (requested(h)) {
				backoff(t0, &spins);
			} else if (spun_out(t0, &spins, IDLE_SPIN_NS)) {
				idle_sleep(h);
				t0 = epd_now_ns();
				spins = 0;
			}
			continue;
		}
		/* the number the first rank rang: every rank must ring it */
		uint32_t k = ld(word(h->map, (uint32_t)__builtin_ctzll(rung),
				     EPP_HB_BELL));
		uint64_t start = epd_now_ns(), notyet;
		spins = 0;
		while ((notyet = bells(h, k, false))) {
			if (stopping(h))
				goto out;
			if (epd_now_ns() - start > h->budget_ns) {
				fail(h, EK_BAR_TIMEOUT, k, notyet);
				return NULL;
			}
			backoff(start, &spins);
		}
		const uint64_t arrived = epd_now_ns();
		uint64_t bad = 0;
		for (uint32_t l = 0; l < h->rpn; l++)
			if (ld(word(h->map, l, EPP_HB_BELL)) != k)
				bad |= 1ull << l;
		if (bad) {
			fail(h, EK_BAR_MISMATCH, k, bad);
			return NULL;
		}
		h->last += (uint32_t)(k - last);
		/* completion first, then the release (see ekc_barrier) */
		for (uint32_t l = 0; l < h->rpn; l++)
			__atomic_store_n((uint64_t *)(h->map +
						      (size_t)l * EPP_CTL_SLOT +
						      EPP_CTL_COMPLETED),
					 h->last, __ATOMIC_RELEASE);
		for (uint32_t l = 0; l < h->rpn; l++)
			raise_to(word(h->map, l, EPP_HB_DONE), k);
		__atomic_store_n(&h->st.busy_ns,
				 h->st.busy_ns + (epd_now_ns() - arrived),
				 __ATOMIC_RELAXED);
		__atomic_store_n(&h->st.last, h->last, __ATOMIC_RELEASE);
		__atomic_store_n(&h->st.count, h->st.count + 1,
				 __ATOMIC_RELEASE);
		t0 = epd_now_ns();
		spins = 0;
	}
out:
	__atomic_store_n(&h->st.state, EK_BAR_STOPPED, __ATOMIC_RELEASE);
	return NULL;
}

int epd_hostbar_start(struct epd_hostbar **out, uint8_t *map, uint32_t rpn,
		      uint64_t budget_ns, uint64_t last, char *err,
		      size_t errlen)
{
	if (rpn == 0 || rpn > 64 ||
	    EPP_CTL_HB + (size_t)rpn * EPP_CTL_HB_STRIDE > EPP_CTL_GROUP_SLOT) {
		snprintf(err, errlen, "host barrier: %u local ranks", rpn);
		return EP_EINVAL;
	}
	struct epd_hostbar *h = calloc(1, sizeof(*h));
	if (!h) {
		snprintf(err, errlen, "host barrier: out of memory");
		return EP_ENOMEM;
	}
	h->map = map;
	h->rpn = rpn;
	h->budget_ns = budget_ns;
	h->last = last;
	h->st.last = last;
	h->st.state = EK_BAR_RUNNING;
	for (uint32_t l = 0; l < rpn; l++) {
		uint32_t v = (uint32_t)last;
		__atomic_store_n(word(map, l, EPP_HB_BELL), v, __ATOMIC_RELAXED);
		__atomic_store_n(word(map, l, EPP_HB_REQ), v, __ATOMIC_RELAXED);
		__atomic_store_n(word(map, l, EPP_HB_DONE), v, __ATOMIC_RELAXED);
	}
	int rc = pthread_create(&h->thread, NULL, run, h);
	if (rc) {
		snprintf(err, errlen, "host barrier thread: %s", strerror(rc));
		free(h);
		return EP_ENOMEM;
	}
	*out = h;
	return 0;
}

struct ek_bar_state *epd_hostbar_state(struct epd_hostbar *h)
{
	return &h->st;
}

void epd_hostbar_stop(struct epd_hostbar *h)
{
	if (!h)
		return;
	__atomic_store_n(&h->st.stop, 1, __ATOMIC_RELEASE);
	syscall(SYS_futex, sleep_word(h->map), FUTEX_WAKE, 1, NULL, NULL, 0);
}

void epd_hostbar_free(struct epd_hostbar *h)
{
	if (!h)
		return;
	epd_hostbar_stop(h);
	pthread_join(h->thread, NULL);
	free(h);
}

void epd_hostbar_release(uint8_t *map, uint32_t rpn, uint32_t far)
{
	for (uint32_t l = 0; l < rpn && l < 64; l++)
		raise_to(word(map, l, EPP_HB_DONE), far);
}
