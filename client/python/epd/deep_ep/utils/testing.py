# SPDX-License-Identifier: MIT
"""Timing helpers with DeepEP's names and return values."""
import os
import sys

_l2 = None


def flush_l2_cache(enabled=True):
    """Overwrite a buffer larger than the GPU's L2 cache."""
    global _l2
    import torch
    if not enabled or not torch.cuda.is_available():
        return
    if _l2 is None:
        _l2 = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    _l2.zero_()


def bench(fn, num_warmups=50, num_tests=50, post_fn=None, flush_l2=True):
    """(mean, min, max) seconds of fn over num_tests runs timed with CUDA
    events (the first run dropped), after num_warmups."""
    import time
    import torch
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    for _ in range(num_warmups):
        fn()
    times = []
    for _ in range(num_tests):
        flush_l2_cache(flush_l2)
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), \
                torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            times.append((a, b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if post_fn is not None:
            post_fn()
    if cuda:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in times]
    times = times[1:] if len(times) > 1 else times
    return sum(times) / len(times), min(times), max(times)


def bench_kineto(fn, kernel_names, *a, **kw):
    raise NotImplementedError(
        "epd's deep_ep: bench_kineto times DeepEP's own kernels by name; "
        "epd runs its ops in the daemon (use bench())")


class empty_suppress:
    def __enter__(self):
        return self

    def __exit__(self, *_):
        pass


class suppress_stdout_stderr:
    """Redirect file descriptors 1 and 2 to /dev/null inside the block."""

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self._null = os.open(os.devnull, os.O_WRONLY)
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(self._null, 1)
        os.dup2(self._null, 2)
        return self

    def __exit__(self, *_):
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for f in (*self._saved, self._null):
            os.close(f)
