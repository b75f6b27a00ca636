/* SPDX-License-Identifier: MIT */
/* Intrusive doubly-linked list (circular, with a head node). */
#ifndef EPD_LIST_H
#define EPD_LIST_H

#include <stddef.h>

struct list_node {
	struct list_node *next, *prev;
};

#define LIST_INIT(h) ((h)->next = (h)->prev = (h))
#define LIST_EMPTY(h) ((h)->next == (h))
#define LIST_ENTRY(p, type, member)                                            \
	((type *)((char *)(p) - offsetof(type, member)))
/* Safe against removal of the current node. */
#define LIST_FOREACH(it, tmp, h)                                               \
	for ((it) = (h)->next, (tmp) = (it)->next; (it) != (h);                \
	     (it) = (tmp), (tmp) = (it)->next)

static inline void list_add_tail(struct list_node *h, struct list_node *n)
{
	n->prev = h->prev;
	n->next = h;
	h->prev->next = n;
	h->prev = n;
}

static inline void list_del(struct list_node *n)
{
	n->prev->next = n->next;
	n->next->prev = n->prev;
	n->next = n->prev = n;
}

#endif
