# SPDX-License-Identifier: MIT
"""Timing helpers with DeepEP's names and return values."""
import os
import sys

_l2 = None


def flush_l2_cache(enabled=True):
    """Overwrite a buffer of twice the GPU's L2 cache (50 MB on an H100;
    256 MiB where torch does not say): every line the timed call could
    find in L2 is evicted. Kept per process: ranks that share a GPU each
    hold one."""
    global _l2
    import torch
    if not enabled or not torch.cuda.is_available():
        return
    if _l2 is None:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        l2 = getattr(props, "L2_cache_size", 0)
        _l2 = torch.empty(2 * l2 if l2 > 0 else 256 << 20, dtype=torch.int8,
                          device="cuda")
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


def kernel_means(events, names, per=1, spans=()):
    """From a Chrome trace's events: for each name, the mean duration in
    seconds of the kernels whose names contain it, or with per > 1 the
    per means of the first, the second, ... of each period of per such
    kernels in time order. A name no kernel has is looked up in spans,
    the (name, start event, end event) of epd's normal ops on this rank's
    streams (deep_ep.utils.spans). RuntimeError if neither has it, or
    their number is not whole periods."""
    from .spans import durations
    # ("kernel"; "Kernel" in older PyTorch)
    kernels = sorted((e for e in events
                      if str(e.get("cat", "")).lower() == "kernel" and
                      e.get("ph") == "X"), key=lambda e: e["ts"])
    out = []
    for name in names:
        durs = [e["dur"] / 1e6 for e in kernels if name in e["name"]]
        what = "kernels"
        if not durs:
            durs, what = durations(spans, name), "epd ops"
        if not durs:
            raise RuntimeError(
                f"bench_kineto: no kernel named *{name}* ran in this "
                f"process, and no epd op of that name ran on its streams")
        if len(durs) % per:
            raise RuntimeError(f"bench_kineto: {len(durs)} {what} named "
                               f"*{name}*, not periods of {per}")
        periods = len(durs) // per
        out.append([sum(durs[j::per]) / periods for j in range(per)]
                   if per > 1 else sum(durs) / len(durs))
    return out


def bench_kineto(fn, kernel_names, num_tests=30, suppress_kineto_output=False,
                 trace_path=None, flush_l2=True, barrier_comm_profiling=False,
                 num_kernels_per_period=1, barrier=None):
    """Mean GPU time in seconds of the kernels whose names contain each of
    kernel_names (a name, or a tuple: a list back) over num_tests calls of
    fn, from PyTorch's profiler: the kernels this process ran. epd's
    low-latency ops are kernels on the caller's stream and are found here;
    the normal ops run in the daemon, and a name no kernel has is looked
    up in their spans on this rank's streams (deep_ep.utils.spans: DeepEP's
    dispatch_impl is epd's dispatch op, dispatch_copy_epilogue_impl the
    shim's work after it, and so on; RuntimeError if neither has it). With
    num_kernels_per_period n > 1 a name's entry is n means: of the first,
    the second, ... of its kernels in each call (a dispatch's send and its
    receive hook). barrier_comm_profiling: before each call the GPU waits
    ~10 ms and the ranks meet (dist.all_reduce, or barrier()), so that no
    rank's kernels wait for a late one. EP_USE_NVIDIA_TOOLS=1: ones, no
    profiling (for Nsight and the sanitizer), as DeepEP's."""
    import json
    import tempfile
    import torch
    names = (kernel_names,) if isinstance(kernel_names, str) \
        else tuple(kernel_names)
    many = not isinstance(kernel_names, str)
    if int(os.environ.get("EP_USE_NVIDIA_TOOLS", 0)):
        return [1] * len(names) if many else 1
    from . import spans as _spans
    fn()  # first use (allocations, lazy set-up) outside the profile
    torch.cuda.synchronize()
    meet = barrier_comm_profiling and \
        not int(os.environ.get("EP_DISABLE_BARRIER_PROFILING", 0))
    if meet and barrier is None:
        import torch.distributed as dist
        one = torch.ones(1, dtype=torch.float, device="cuda")
        barrier = lambda: dist.all_reduce(one)  # noqa: E731
    quiet = suppress_stdout_stderr if suppress_kineto_output \
        else empty_suppress
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA],
        schedule=torch.profiler.schedule(wait=0, warmup=1, active=1,
                                         repeat=1))
    ops = []  # epd's normal ops in the profiled pass (spans.py)
    with quiet(), prof:
        try:
            for p in range(2):  # a warm-up pass, then the profiled one
                if p == 1:
                    _spans.measure(ops)
                for _ in range(num_tests):
                    flush_l2_cache(flush_l2)
                    if meet:
                        torch.cuda._sleep(int(2e7))
                        barrier()
                    fn()
                torch.cuda.synchronize()
                prof.step()
        finally:
            _spans.measure(None)
    with tempfile.TemporaryDirectory() as d:
        path = trace_path or os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    out = kernel_means(events, names, num_kernels_per_period, ops)
    return out if many else out[0]


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
