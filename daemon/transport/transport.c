/* SPDX-License-Identifier: MIT */
/* The transports this build has (Automake conditionals). */
#include "transport.h"

#include <string.h>

#ifdef HAVE_EPD_RDMA
extern const struct epd_transport_ops epd_rdma_transport;
#endif
extern const struct epd_transport_ops epd_tcp_transport;

const struct epd_transport_ops *const epd_transports[] = {
#ifdef HAVE_EPD_RDMA
	&epd_rdma_transport,
#endif
	&epd_tcp_transport,
	NULL,
};

const struct epd_transport_ops *epd_transport_find(const char *name)
{
	for (int i = 0; epd_transports[i]; i++)
		if (!strcmp(epd_transports[i]->name, name))
			return epd_transports[i];
	return NULL;
}
