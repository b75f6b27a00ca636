/* SPDX-License-Identifier: MIT */
/*
 * What this build has: the device backends and the transports compiled in
 * (Automake conditionals), named here, at the top, where the daemon is put
 * together. The layers below only receive them: the server picks a
 * backend (server.c), the cluster a transport (epd_cluster_init).
 */
#include "server.h"
#include "core/backend.h"
#include "transport/transport.h"

#ifdef HAVE_CUDA
extern const struct epd_backend_ops epd_cuda_backend;
#endif
#ifdef HAVE_EPD_RDMA
extern const struct epd_transport_ops epd_rdma_transport;
#endif
extern const struct epd_transport_ops epd_tcp_transport;

/* In the order `backend = auto` tries them. */
const struct epd_backend_ops *const epd_backends[] = {
#ifdef HAVE_CUDA
	&epd_cuda_backend,
#endif
	NULL,
};

/* In the order `transport = auto` tries them. */
const struct epd_transport_ops *const epd_transports[] = {
#ifdef HAVE_EPD_RDMA
	&epd_rdma_transport,
#endif
	&epd_tcp_transport,
	NULL,
};
