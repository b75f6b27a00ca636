/* SPDX-License-Identifier: MIT */
/* daemon/transport/rdma/proxy.c, the data path's command ring and proxy thread, with a
 * poster that does what an RDMA WRITE does (copies len bytes from laddr to
 * raddr). Several producers through a small ring (so they wait for room):
 * every command arrives exactly once, each producer's in the order it
 * pushed them, and every byte lands; tickets pass once handed over; a
 * command pushed after the thread went to sleep still arrives; freeing
 * hands over what is queued; a ring that is not a power of two is refused. */
#include "harness.h"
#include "transport/rdma/proxy.h"

#include <pthread.h>
#include <string.h>

#define PRODUCERS 4
#define PER 10000u
#define SLOTS 64

static uint64_t src[PRODUCERS][PER], dst[PRODUCERS][PER];
static uint64_t next[PRODUCERS]; /* the poster's view: next index due */
static uint64_t delivered, out_of_order, imms;
static struct epd_proxy *px;

/* On the proxy thread only. */
static void post(void *arg, const struct epd_cmd *c, size_t n)
{
	TH_CHECK(arg == (void *)&delivered, "poster argument lost");
	TH_CHECK(n >= 1 && n <= 64, "a batch of %zu", n);
	for (size_t i = 0; i < n; i++) {
		uint32_t p = (uint32_t)(c[i].cookie >> 32);
		uint32_t k = (uint32_t)c[i].cookie;
		TH_CHECK(p < PRODUCERS && c[i].conn == &src[p],
			 "command %zu of a batch: bad producer %u", i, p);
		if (k != next[p])
			out_of_order++;
		next[p] = k + 1;
		memcpy((void *)(uintptr_t)c[i].raddr,
		       (const void *)(uintptr_t)c[i].laddr, c[i].len);
		if (c[i].flags & EPD_CMD_IMM)
			imms++;
		delivered++;
	}
}

static void *producer(void *arg)
{
	uint32_t p = (uint32_t)(uintptr_t)arg;
	for (uint32_t k = 0; k < PER; k++) {
		src[p][k] = ((uint64_t)p << 40) ^ (k * 0x9e3779b97f4a7c15ull);
		struct epd_cmd c = {.conn = &src[p],
				    .laddr = (uintptr_t)&src[p][k],
				    .raddr = (uintptr_t)&dst[p][k],
				    .len = 8,
				    .cookie = ((uint64_t)p << 32) | k,
				    .flags = k == PER - 1 ? EPD_CMD_IMM : 0};
		TH_CHECK(epd_proxy_push(px, &c) != 0, "push refused");
	}
	return NULL;
}

static bool wait_passed(uint64_t ticket, unsigned ms)
{
	uint64_t end = th_now_ns() + ms * 1000000ull;
	while (!epd_proxy_passed(px, ticket))
		if (th_now_ns() > end)
			return false;
	return true;
}

int main(void)
{
	char err[128];
	th_init("test_proxy", 60);

	TH_CHECK(!epd_proxy_new(48, post, &delivered, err, sizeof(err)) &&
			 strstr(err, "power of two"),
		 "a ring of 48 slots: %s", err);
	printf("ok: a ring of 48 slots is refused: %s\n", err);

	px = epd_proxy_new(SLOTS, post, &delivered, err, sizeof(err));
	TH_CHECK(px, "epd_proxy_new: %s", err);
	pthread_t t[PRODUCERS];
	for (uintptr_t p = 0; p < PRODUCERS; p++)
		TH_CHECK(pthread_create(&t[p], NULL, producer, (void *)p) == 0,
			 "pthread_create");
	for (int p = 0; p < PRODUCERS; p++)
		pthread_join(t[p], NULL);
	uint64_t head = epd_proxy_head(px);
	TH_CHECK(head == (uint64_t)PRODUCERS * PER, "head %llu",
		 (unsigned long long)head);
	TH_CHECK(wait_passed(head, 10000), "ticket %llu never passed",
		 (unsigned long long)head);
	uint64_t batches, posted = epd_proxy_posted(px, &batches);
	TH_CHECK(posted == head && delivered == head,
		 "posted %llu, delivered %llu, pushed %llu",
		 (unsigned long long)posted, (unsigned long long)delivered,
		 (unsigned long long)head);
	TH_CHECK(out_of_order == 0, "%llu commands out of their producer's "
				    "order", (unsigned long long)out_of_order);
	TH_CHECK(imms == PRODUCERS, "%llu writes with immediate, want %d",
		 (unsigned long long)imms, PRODUCERS);
	for (int p = 0; p < PRODUCERS; p++)
		TH_CHECK(!memcmp(src[p], dst[p], sizeof(src[p])),
			 "producer %d: bytes did not land", p);
	TH_CHECK(batches >= 1 && batches <= posted, "%llu batches",
		 (unsigned long long)batches);
	printf("ok: %d producers x %u commands through %d slots: each once, "
	       "in order, every byte landed (%llu batches)\n",
	       PRODUCERS, PER, SLOTS, (unsigned long long)batches);

	/* idle long enough for the futex sleep, then one more */
	th_sleep_ms(50);
	uint64_t v = 42, w = 0;
	struct epd_cmd c = {.conn = &src[0], .laddr = (uintptr_t)&v,
			    .raddr = (uintptr_t)&w, .len = 8,
			    .cookie = PER}; /* producer 0's next */
	uint64_t tk = epd_proxy_push(px, &c);
	TH_CHECK(tk == head + 1, "ticket %llu", (unsigned long long)tk);
	TH_CHECK(wait_passed(tk, 1000), "a command after a sleep was not "
					"taken within 1 s");
	TH_CHECK(w == 42, "its bytes did not land");
	printf("ok: a command pushed while the proxy slept is taken\n");

	/* free hands over what is queued */
	for (uint32_t k = 0; k < 1000; k++) {
		c.cookie = PER + 1 + k;
		TH_CHECK(epd_proxy_push(px, &c), "push refused");
	}
	epd_proxy_free(px);
	TH_CHECK(delivered == head + 1001 && out_of_order == 0,
		 "after free: %llu delivered, want %llu",
		 (unsigned long long)delivered,
		 (unsigned long long)head + 1001);
	printf("ok: freeing the proxy hands over the 1000 queued commands\n");
	return 0;
}
