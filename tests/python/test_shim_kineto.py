# SPDX-License-Identifier: MIT
"""deep_ep.utils.testing.kernel_means, the part of the shim's bench_kineto
that reads the profiler's trace (the profiling itself needs a GPU: DeepEP's
test_low_latency.py runs it in tests/gpu/run): kernels picked by name in
time order, split per period (a dispatch's send, then its receive hook),
other events ignored, and a clear error when no such kernel ran or the
kernels are not whole periods."""
import sys

from epd.deep_ep.utils.testing import kernel_means


class Ev:
    """A completed CUDA event's stand-in: a time in milliseconds."""

    def __init__(self, ms):
        self.ms = ms

    def elapsed_time(self, end):
        return end.ms - self.ms


def k(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def main():
    ev = [
        # out of order on purpose: the split follows the time stamps
        k("ekc_ll_dispatch_recv", 30, 4.0),
        k("ekc_ll_dispatch", 10, 20.0),
        k("ekc_ll_combine", 50, 8.0),
        k("ekc_ll_dispatch", 110, 22.0),
        k("ekc_ll_dispatch_recv", 140, 6.0),
        k("ekc_ll_combine", 150, 10.0, cat="Kernel"),  # older PyTorch
        {"ph": "X", "cat": "cpu_op", "name": "ekc_ll_dispatch", "ts": 5,
         "dur": 999.0},  # a CPU event of that name: not a kernel
        {"ph": "i", "cat": "kernel", "name": "ekc_ll_combine", "ts": 7},
    ]
    d, c = kernel_means(ev, ("dispatch", "combine"))
    assert abs(d - (20 + 4 + 22 + 6) / 4 / 1e6) < 1e-12, d
    assert abs(c - 9.0 / 1e6) < 1e-12, c
    d0, d1 = kernel_means(ev, ("dispatch",), 2)[0]
    c0 = kernel_means(ev, ("combine",))[0]
    assert abs(d0 - 21e-6) < 1e-12 and abs(d1 - 5e-6) < 1e-12, (d0, d1)
    assert abs(c0 - 9e-6) < 1e-12, c0
    for names, per, what in ((("gemm",), 1, "no kernel named"),
                             (("combine",), 3, "not periods of 3")):
        try:
            kernel_means(ev, names, per)
        except RuntimeError as e:
            assert what in str(e), e
        else:
            raise AssertionError(f"no error for {names} per {per}")
    # epd's normal ops: no kernel of theirs in this process; their spans
    # on the rank's streams stand in (deep_ep.utils.spans)
    sp = [("epd_dispatch_impl", Ev(0.0), Ev(0.5)),
          ("epd_dispatch_copy_epilogue_impl", Ev(0.5), Ev(0.6)),
          ("epd_dispatch_impl", Ev(1.0), Ev(1.7)),
          ("epd_dispatch_copy_epilogue_impl", Ev(1.7), Ev(2.0))]
    d, cp = kernel_means(ev, ("dispatch_impl",
                              "dispatch_copy_epilogue_impl"), 1, sp)
    assert abs(d - 0.6e-3) < 1e-12, d  # (0.5 + 0.7) ms / 2
    assert abs(cp - 0.2e-3) < 1e-12, cp  # (0.1 + 0.3) ms / 2
    # a kernel of the name wins over a span of it
    assert kernel_means(ev, ("combine",), 1,
                        [("epd_combine_impl", Ev(0), Ev(9))])[0] == c
    for names, per, spans_, what in (
            (("combine_impl",), 1, sp, "no epd op of that name"),
            (("dispatch_impl",), 3, sp, "not periods of 3")):
        try:
            kernel_means(ev, names, per, spans_)
        except RuntimeError as e:
            assert what in str(e), e
        else:
            raise AssertionError(f"no error for {names} per {per}")
    # recording: nothing unless measuring; add keeps the last op's end
    from epd.deep_ep.utils import spans
    assert spans.mark(object()) is None
    spans.add("epd_barrier", Ev(0), Ev(1))
    assert spans.last_end is None
    into = []
    spans.measure(into)
    e1 = Ev(1)
    spans.add("epd_barrier", Ev(0), e1)
    spans.add("epd_barrier", None, Ev(2))  # half a span: dropped
    assert len(into) == 1 and spans.last_end is e1
    spans.measure(None)
    assert spans.last_end is None
    print("ok: bench_kineto's trace reading (kernels by name in time "
          "order, per-period split, CPU events ignored, epd ops' stream "
          "spans where no kernel has the name, clear errors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
