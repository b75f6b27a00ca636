# SPDX-License-Identifier: MIT
"""The deep_ep shim's registration policy (_Sub.region_of, _extents), on
any machine: the allocator's segments and the group's registrations are
stand-ins that record what was asked, so that what the policy decides is
checked without a GPU. Asserted:
  - the extent registered for a tensor is the allocator segment that holds
    it when that fits in _MREG_SPAN, else a window of _MREG_SPAN inside
    the segment around it, and always the tensor's own range last;
  - a second tensor in a registered segment finds the registration (no
    new one), as a training step's next activations must;
  - a registration whose memory was remapped is dropped (deregistered) at
    the next miss, and the miss registers again;
  - at most _MREG_KEEP registrations are kept, the least recently used
    deregistered first;
  - a segment too big to register (EP_ETOOBIG) falls back to the tensor's
    range; memory that cannot be registered at all (EP_EUNSUPPORTED) turns
    registration off for good, with no further tries.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                "client", "python"))
import torch  # noqa: E402
import epd  # noqa: E402
from epd.deep_ep.buffers import shapes  # noqa: E402

MiB = 1 << 20
SEGS = []  # (address, total_size) of the allocator's segments


def snapshot():
    return [{"address": a, "total_size": s} for a, s in SEGS]


torch.cuda.memory_snapshot = snapshot


class FakeTensor:
    def __init__(self, ptr, nbytes):
        self.ptr, self.nbytes = ptr, nbytes

    def is_contiguous(self):
        return True

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.nbytes

    def element_size(self):
        return 1


class FakeRegion:
    def __init__(self, group, base, nbytes):
        self.group, self.base, self.nbytes = group, base, nbytes
        self.live = True

    def covers(self, ptr, n):
        return self.live and self.base <= ptr and \
            ptr + n <= self.base + self.nbytes and \
            not any(self.base <= a < self.base + self.nbytes
                    for a in self.group.remapped)

    def deregister(self):
        assert self.live, "deregistered twice"
        self.live = False
        self.group.dropped.append((self.base, self.nbytes))


class FakeGroup:
    def __init__(self, fail=None):
        self.asked, self.dropped, self.remapped = [], [], set()
        self.fail = fail or {}  # size: error code

    def mem_register(self, ptr, n):
        self.asked.append((ptr, n))
        if n in self.fail:
            raise epd.Error(self.fail[n], "refused")
        return FakeRegion(self, ptr, n)


def sub_with(group):
    s = shapes._Sub.__new__(shapes._Sub)
    s.mreg_on, s.g, s.mregs, s.registered = True, group, [], 0
    s.refused = 0
    return s


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what, flush=True)


def main():
    span = shapes._MREG_SPAN
    # the extents, best first
    SEGS[:] = [(1 << 40, 512 * MiB), (2 << 40, 4 * span)]
    ex = shapes._extents((1 << 40) + 100 * MiB, 10 * MiB)
    check(ex == [(1 << 40, 512 * MiB), ((1 << 40) + 100 * MiB, 10 * MiB)],
          f"a segment within the span, then the tensor: {ex}")
    big = 2 << 40
    ex = shapes._extents(big + 2 * span, 10 * MiB)
    lo, n = ex[0]
    check(n == span and lo <= big + 2 * span and
          big + 2 * span + 10 * MiB <= lo + n and ex[1] ==
          (big + 2 * span, 10 * MiB),
          "a bigger segment: a window of the span around the tensor")
    ex = shapes._extents(big + 10 * MiB, 10 * MiB)
    check(ex[0] == (big, span), f"the window stays inside the segment "
          f"at its start: {ex[0]}")
    ex = shapes._extents(big + 4 * span - 10 * MiB, 10 * MiB)
    check(ex[0] == (big + 3 * span, span), "and at its end")
    ex = shapes._extents(big, 2 * span)
    check(ex == [(big, 2 * span)], "a tensor bigger than the span: its "
          "range alone")
    ex = shapes._extents(5 << 40, MiB)
    check(ex == [(5 << 40, MiB)], "memory of no segment: its range alone")

    # the next activations in a registered segment find the registration
    g = FakeGroup()
    s = sub_with(g)
    a, b = FakeTensor((1 << 40) + 8 * MiB, MiB), \
        FakeTensor((1 << 40) + 300 * MiB, 64 * MiB)
    ra = s.region_of(a)
    rb = s.region_of(b)
    check(ra is rb and s.registered == 1 and
          g.asked == [(1 << 40, 512 * MiB)],
          "two tensors of one segment: one registration, of the segment")
    # torch remapped part of it: dropped at the next miss, registered again
    g.remapped.add((1 << 40) + 400 * MiB)
    r2 = s.region_of(FakeTensor((1 << 40) + 420 * MiB, MiB))
    check(g.dropped == [(1 << 40, 512 * MiB)] and r2 is not ra and
          s.registered == 2 and s.mregs == [r2] and not ra.live,
          "a registration of remapped memory dropped at the next miss")
    g.remapped.clear()

    # at most _MREG_KEEP, the least recently used dropped first
    g = FakeGroup()
    s = sub_with(g)
    SEGS[:] = [((10 + i) << 40, 64 * MiB)
               for i in range(shapes._MREG_KEEP + 2)]
    regs = [s.region_of(FakeTensor(((10 + i) << 40) + MiB, MiB))
            for i in range(shapes._MREG_KEEP)]
    s.region_of(FakeTensor((10 << 40) + 2 * MiB, MiB))  # the first, used
    s.region_of(FakeTensor(((10 + shapes._MREG_KEEP) << 40) + MiB, MiB))
    check(len(s.mregs) == shapes._MREG_KEEP and not regs[1].live and
          regs[0].live and g.dropped == [(11 << 40, 64 * MiB)],
          f"{shapes._MREG_KEEP} kept, the least recently used dropped")

    # a segment too big to register: the tensor's range; memory of the
    # wrong kind: off for good
    SEGS[:] = [(1 << 40, 512 * MiB)]
    g = FakeGroup(fail={512 * MiB: epd.ETOOBIG})
    s = sub_with(g)
    r = s.region_of(FakeTensor((1 << 40) + MiB, 2 * MiB))
    check(r is not None and (r.base, r.nbytes) == ((1 << 40) + MiB, 2 * MiB)
          and g.asked == [(1 << 40, 512 * MiB), ((1 << 40) + MiB, 2 * MiB)],
          "EP_ETOOBIG for the segment: the tensor's range registered")
    g = FakeGroup(fail={512 * MiB: epd.EUNSUPPORTED})
    s = sub_with(g)
    r = s.region_of(FakeTensor((1 << 40) + MiB, 2 * MiB))
    r2 = s.region_of(FakeTensor((1 << 40) + 8 * MiB, 2 * MiB))
    check(r is None and r2 is None and not s.mreg_on and len(g.asked) == 1,
          "EP_EUNSUPPORTED: registration off, no further tries")

    # with expandable segments (turned on by a Buffer): a tensor from a
    # segment made before is copied alone (one try, no narrower extent),
    # the next one in an expandable segment registers; only _REFUSALS in
    # a row turn registering off
    saved_es, shapes._ES = shapes._ES, True
    try:
        SEGS[:] = [(1 << 40, 512 * MiB), (3 << 40, 64 * MiB)]
        g = FakeGroup(fail={512 * MiB: epd.EUNSUPPORTED})
        s = sub_with(g)
        r = s.region_of(FakeTensor((1 << 40) + MiB, 2 * MiB))
        check(r is None and s.mreg_on and s.refused == 1 and
              len(g.asked) == 1,
              "expandable segments: an old segment's tensor copied alone, "
              "registering stays on")
        r = s.region_of(FakeTensor((3 << 40) + MiB, 2 * MiB))
        check(r is not None and s.refused == 0 and len(g.asked) == 2,
              "expandable segments: the next tensor registers")
        for i in range(shapes._REFUSALS):
            s.region_of(FakeTensor((1 << 40) + (i + 2) * MiB, MiB))
        check(not s.mreg_on and len(g.asked) == 2 + shapes._REFUSALS,
              f"{shapes._REFUSALS} refusals in a row: registering off")
    finally:
        shapes._ES = saved_es
    return 0


if __name__ == "__main__":
    sys.exit(main())
