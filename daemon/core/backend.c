/* SPDX-License-Identifier: MIT */
/* The device backends this build has (Automake conditionals). */
#include "backend.h"

#ifdef HAVE_CUDA
extern const struct epd_backend_ops epd_cuda_backend;
#endif

const struct epd_backend_ops *const epd_backends[] = {
#ifdef HAVE_CUDA
	&epd_cuda_backend,
#endif
	NULL,
};
