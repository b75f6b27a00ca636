/* SPDX-License-Identifier: MIT */
#include "ekc.h"

#include <dlfcn.h>
#include <stdio.h>

#include "ep/ep.h"

int ekc_load(struct ekc_driver *d, char *err, size_t errlen)
{
	d->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!d->lib) {
		snprintf(err, errlen, "no CUDA driver (%s)", dlerror());
		return -1;
	}
	__typeof__(cuGetProcAddress) *gpa =
		(__typeof__(cuGetProcAddress) *)dlsym(d->lib,
						       "cuGetProcAddress_v2");
	if (!gpa) {
		snprintf(err, errlen, "CUDA driver too old: no "
				      "cuGetProcAddress_v2");
		goto err_close;
	}
	/* Ask for the CUDA 12.0 ABI of each entry point: the _v2 memops and
	 * the rest as cuda.h declares them. */
#define EKC_GET(f)                                                             \
	{                                                                      \
		CUdriverProcAddressQueryResult st;                             \
		if (gpa(#f, (void **)&d->f, 12000, CU_GET_PROC_ADDRESS_DEFAULT, \
			&st) != CUDA_SUCCESS ||                                \
		    !d->f) {                                                   \
			snprintf(err, errlen,                                  \
				 "CUDA driver lacks %s (status %d)", #f,       \
				 (int)st);                                     \
			goto err_close;                                        \
		}                                                              \
	}
	EKC_FUNCS(EKC_GET)
#undef EKC_GET
	/* CUDA 12.3 forms */
#define EKC_GET123(f, member)                                                  \
	{                                                                      \
		CUdriverProcAddressQueryResult st;                             \
		if (gpa(#f, (void **)&d->member, 12030,                        \
			CU_GET_PROC_ADDRESS_DEFAULT, &st) != CUDA_SUCCESS ||   \
		    !d->member) {                                              \
			snprintf(err, errlen,                                  \
				 "CUDA driver lacks %s (12.3; status %d)", #f, \
				 (int)st);                                     \
			goto err_close;                                        \
		}                                                              \
	}
	EKC_GET123(cuStreamGetCaptureInfo, cuStreamGetCaptureInfo3)
	EKC_GET123(cuGraphNodeGetDependencies, cuGraphNodeGetDependencies2)
#undef EKC_GET123
	CUresult r = d->cuInit(0);
	if (r != CUDA_SUCCESS) {
		const char *s = NULL;
		d->cuGetErrorString(r, &s);
		snprintf(err, errlen, "cuInit failed: %s", s ? s : "?");
		goto err_close;
	}
	d->cuDriverGetVersion(&d->version);
	return 0;

err_close:
	dlclose(d->lib);
	d->lib = NULL;
	return -1;
}

CUresult ekc_write(const struct ekc_driver *d, CUdeviceptr dst,
		   const void *src, size_t n)
{
	CUstream s;
	CUresult r = d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
	if (r)
		return r;
	r = src ? d->cuMemcpyHtoDAsync(dst, src, n, s)
		: d->cuMemsetD32Async(dst, 0, n / 4, s);
	const CUresult rs = d->cuStreamSynchronize(s);
	if (!r)
		r = rs;
	d->cuStreamDestroy(s);
	return r;
}

int ekc_fail(const struct ekc_driver *d, CUresult r, const char *what,
	     char *err, size_t errlen)
{
	const char *s = NULL;
	if (d->cuGetErrorString)
		d->cuGetErrorString(r, &s);
	snprintf(err, errlen, "%s failed: %s (%d)", what, s ? s : "?", (int)r);
	return EP_EBACKEND;
}
