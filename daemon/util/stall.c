/* SPDX-License-Identifier: MIT */
/* The event loop's stall watch (stall.h). */
#include "stall.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "log.h"

#define TICK_MS 100 /* the loop's beat when it is idle */

static struct {
	uv_loop_t *loop;
	uv_timer_t beat_timer;
	uv_check_t turn;
	pthread_t thread;
	bool running;
	unsigned warn_ms;
	_Atomic uint64_t beat_ns; /* the loop's last turn */
	_Atomic bool stop;
	pthread_mutex_t lock; /* what, obj */
	const char *what;
	char obj[64];
	_Atomic uint64_t stalls, longest_ms;
} w = {.lock = PTHREAD_MUTEX_INITIALIZER};

void epd_stall_mark(const char *what, const char *obj)
{
	if (!w.running)
		return;
	pthread_mutex_lock(&w.lock);
	w.what = what;
	snprintf(w.obj, sizeof(w.obj), "%s", obj ? obj : "");
	pthread_mutex_unlock(&w.lock);
}

static void beat(void)
{
	atomic_store_explicit(&w.beat_ns, epd_now_ns(), memory_order_release);
}

static void on_turn(uv_check_t *h)
{
	(void)h;
	beat();
	epd_stall_mark(NULL, NULL);
}

static void on_beat(uv_timer_t *t)
{
	(void)t;
	beat();
}

static void *watch(void *arg)
{
	(void)arg;
	uint64_t stalled_since = 0, next_report = 0;
	while (!atomic_load(&w.stop)) {
		struct timespec ts = {0, 50 * 1000000L};
		nanosleep(&ts, NULL);
		uint64_t now = epd_now_ns();
		uint64_t b = atomic_load_explicit(&w.beat_ns,
						  memory_order_acquire);
		uint64_t ms = now > b ? (now - b) / 1000000ull : 0;
		if (ms < w.warn_ms + TICK_MS) {
			if (stalled_since && b >= stalled_since) {
				/* from the turn before the stall to the one
				 * after it */
				uint64_t len = (b - stalled_since) / 1000000ull;
				epd_notice("event loop: running again after a "
					   "stall of about %llu ms",
					   (unsigned long long)len);
				if (len > atomic_load(&w.longest_ms))
					atomic_store(&w.longest_ms, len);
			}
			stalled_since = 0;
			continue;
		}
		if (!stalled_since) {
			stalled_since = b;
			next_report = 0;
			atomic_fetch_add(&w.stalls, 1);
		}
		if (now < next_report)
			continue;
		next_report = now + 5000 * 1000000ull;
		const char *what;
		char obj[64];
		pthread_mutex_lock(&w.lock);
		what = w.what;
		memcpy(obj, w.obj, sizeof(obj));
		pthread_mutex_unlock(&w.lock);
		epd_warn("event loop: no turn for %llu ms; it was %s%s%s%s "
			 "(every client and peer of this daemon waits)",
			 (unsigned long long)ms,
			 what ? what : "in a callback that set no mark",
			 obj[0] ? " (" : "", obj, obj[0] ? ")" : "");
		if (ms > atomic_load(&w.longest_ms))
			atomic_store(&w.longest_ms, ms);
	}
	return NULL;
}

int epd_stall_start(uv_loop_t *loop, unsigned warn_ms)
{
	if (w.running || !warn_ms)
		return 0;
	w.loop = loop;
	w.warn_ms = warn_ms;
	atomic_store(&w.stop, false);
	beat();
	uv_timer_init(loop, &w.beat_timer);
	uv_timer_start(&w.beat_timer, on_beat, TICK_MS, TICK_MS);
	uv_unref((uv_handle_t *)&w.beat_timer);
	uv_check_init(loop, &w.turn);
	uv_check_start(&w.turn, on_turn);
	uv_unref((uv_handle_t *)&w.turn);
	w.running = true;
	if (pthread_create(&w.thread, NULL, watch, NULL)) {
		w.running = false;
		uv_close((uv_handle_t *)&w.beat_timer, NULL);
		uv_close((uv_handle_t *)&w.turn, NULL);
		epd_warn("event loop: the stall watch could not start");
		return -1;
	}
	return 0;
}

void epd_stall_stop(void)
{
	if (!w.running)
		return;
	atomic_store(&w.stop, true);
	pthread_join(w.thread, NULL);
	w.running = false;
	uv_close((uv_handle_t *)&w.beat_timer, NULL);
	uv_close((uv_handle_t *)&w.turn, NULL);
}

void epd_stall_stats(uint64_t *count, uint64_t *longest_ms)
{
	*count = atomic_load(&w.stalls);
	*longest_ms = atomic_load(&w.longest_ms);
}
