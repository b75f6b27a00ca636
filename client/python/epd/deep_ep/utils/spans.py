# SPDX-License-Identifier: MIT
"""The stream time of epd's normal ops, for bench_kineto.

A GPU rank's normal dispatch or combine runs in the daemon: its kernels
are the daemon's, and the rank's profiler does not see them. What the
rank's stream does see is the op's span: from the moment the stream
reaches the op (its inputs in place) to the moment the op is done for
every rank (the stream's wait ends), and after it the shim's own work
that turns epd's outputs into DeepEP's (copies, V2's layouts).

While a list is given to measure(), the shim records a CUDA event pair
for each such span on the stream that runs it, under these names (each
holds the DeepEP kernel name a test asks bench_kineto for, so a
DeepEP test finds the op's time where it looks for its kernel's):

    epd_dispatch_impl                  the dispatch op
    epd_dispatch_copy_epilogue_impl    op done -> V2's outputs ready
    epd_combine_impl                   the combine op (rows and sums)
    epd_combine_reduce_epilogue_impl   op done -> outputs ready (the
                                       reduction itself is in the op)
    epd_barrier                        a stream barrier

Nothing is recorded when no list is given (the default)."""

_on = None  # the list spans go to while measuring, else None
last_end = None  # the end event of the last op recorded


def measure(into):
    """Record spans into the list into (None: stop). Returns the list
    recorded into before."""
    global _on, last_end
    prev, _on = _on, into
    last_end = None
    return prev


def mark(stream):
    """A timing event recorded on stream now, or None when not
    measuring."""
    if _on is None or stream is None:
        return None
    import torch
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev


def add(name, start, end):
    """Keep the span (name, start, end) where both events exist."""
    global last_end
    if _on is not None and start is not None and end is not None:
        _on.append((name, start, end))
        last_end = end


def durations(spans, name):
    """The seconds of the spans whose names contain name, in the order
    recorded. The events must have completed."""
    return [a.elapsed_time(b) / 1e3 for n, a, b in spans if name in n]
