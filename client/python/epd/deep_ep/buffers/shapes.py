# SPDX-License-Identifier: MIT
"""The epd group a DeepEP Buffer joins for each shape it meets, and what
the group's memory holds: the region's layout (_region_bytes), its receive
areas handed out as recv_x (_Lease) and its combine output slots
(_OutLease), and the registrations of torch's memory the daemon reads and
writes in place (_Sub.region_of). legacy.py says when a Buffer makes one.
"""
import os
import weakref

import epd


def _torch():
    import torch
    return torch


def _release_all(entries):
    """A handle's tuple was dropped: release its routing in every group
    that holds it (the dispatch's, and another dtype's cached ones)."""
    for sub_ref, h in entries:
        sub = sub_ref()
        if sub is None or sub.g is None:
            continue
        try:
            # a GPU rank's release goes without waiting for the daemon's
            # answer (a handle is released once: no refusal to wait for)
            sub.g.release(h, wait=not sub.gpu)
        except epd.Error:
            pass  # the group failed or was left: nothing is held any more


def _ue8m0_unpack(packed, n):
    """DeepEP's UE8M0 scales (int32 [T, ceil(n/4)], one exponent byte per
    128 columns, little-endian) as the fp32 scales [T, n] they stand for
    (2^(e-127), exact)."""
    torch = _torch()
    b = packed.contiguous().view(torch.uint8)[:, :n].to(torch.int32)
    return (b << 23).view(torch.float32)


def _ue8m0_pack(scales):
    """The inverse: fp32 powers of two [R, n] to int32 [R, ceil(n/4)]."""
    torch = _torch()
    R, n = scales.shape
    e = ((scales.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    pad = (-n) % 4
    if pad:
        e = torch.cat([e, torch.zeros((R, pad), dtype=torch.uint8,
                                      device=e.device)], dim=1)
    return e.contiguous().view(torch.int32)


class _Routing:
    """What a handle names: the group, epd's handle, the sizes, the routing
    input (topk, kept for a cached dispatch in the other dtype, which runs
    in that dtype's group: alts) and what to release."""
    __slots__ = ("sub", "h", "T", "R", "topk", "alts", "entries",
                 "__weakref__")

    def __init__(self, sub, h, T, R, topk=None):
        self.sub, self.h, self.T, self.R, self.topk = sub, h, T, R, topk
        self.alts = {}
        self.entries = [(weakref.ref(sub), h)]


# registrations a shape's group keeps (_Sub.region_of,
# $EPD_DEEP_EP_REGISTER_KEEP): each covers up to _MREG_SPAN of an allocator
# segment, so 8 span 8 GiB of a rank's activations. Each also holds its
# memory in the daemon until it is dropped, even after torch gave that
# memory back (empty_cache): more coverage, more memory held (the daemon
# allows 64 per rank and group; the output slots take two)
_MREG_KEEP = max(1, min(60, int(os.environ.get("EPD_DEEP_EP_REGISTER_KEEP",
                                               "8"))))
# the dispatch's x read in place too (1.22-1.29x the own API against
# 1.29-1.34x copied, PERFORMANCE.md, "The deep_ep shim"), unless
# $EPD_DEEP_EP_REGISTER_X=0
_REG_X = os.environ.get("EPD_DEEP_EP_REGISTER_X", "1") != "0"
# a combine's output written in place by the daemon into one of a few
# output slots (registered once, _Sub.out_slot), handed out as the fresh
# combined_x; $EPD_DEEP_EP_OUT_SLOTS of them per shape (0: copy out)
_OUT_SLOTS = int(os.environ.get("EPD_DEEP_EP_OUT_SLOTS", "2"))


# a dispatch's small copies in one launch each way (epd.stream_copies), or
# one launch per copy with $EPD_DEEP_EP_ONE_LAUNCH=0 (for comparison)
_ONE_LAUNCH = os.environ.get("EPD_DEEP_EP_ONE_LAUNCH", "1") != "0"


def _copies(pieces, stream):
    if _ONE_LAUNCH:
        epd.stream_copies(pieces, stream)
    else:
        for p in pieces:
            epd.stream_copies([p], stream)


# PyTorch's expandable segments: memory the daemon can import (cuMemCreate
# with a shareable handle), so a combine's rows and a dispatch's x are read
# where torch put them and a combine's output written in place; with the
# default allocator (cudaMalloc) they are copied: 1.3x and 2.8x the own API
# (PERFORMANCE.md, "The deep_ep shim") against 1.04 and 1.01. A Buffer of
# GPU ranks of one node turns them on for torch's allocations from then
# on (torch.cuda.memory._set_allocator_settings, what PyTorch recommends
# against fragmentation anyway) unless the caller chose: $PYTORCH_CUDA_-
# ALLOC_CONF or $PYTORCH_ALLOC_CONF names expandable_segments, or
# $EPD_DEEP_EP_EXPANDABLE=0. None: not decided yet; then True or False.
_ES = None


def _alloc_conf():
    return ",".join(os.environ.get(v, "") for v in
                    ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))


def expandable_segments():
    """Whether torch's CUDA allocations are in expandable segments (the
    caller's setting, or the one a Buffer made): None before any Buffer
    of GPU ranks asked."""
    return _ES


def _expandable(torch):
    global _ES
    if _ES is not None:
        return _ES
    conf = _alloc_conf().replace(" ", "")
    if "expandable_segments" in conf:
        _ES = "expandable_segments:True" in conf
    elif os.environ.get("EPD_DEEP_EP_EXPANDABLE", "1") == "0":
        _ES = False
    else:
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
        try:
            setter("expandable_segments:True")
            _ES = True
        except Exception:  # an older torch: the copies
            _ES = False
    return _ES


# EP_EUNSUPPORTED for this many registrations in a row: memory of the
# wrong kind all the time (registering off for good); with expandable
# segments a tensor in a segment made before they were on is copied alone
_REFUSALS = 8


# the most a registration of a caching-allocator segment spans (region_of)
_MREG_SPAN = 1 << 30


def _extents(ptr, n):
    """What to register for the n bytes at ptr, best first: the caching
    allocator's segment that holds them (at most _MREG_SPAN of it around
    them), so that the next tensors torch places in that segment (the next
    layer's activations, a grown expandable segment's old part) find the
    registration made; then the tensor's own range. Registering a fresh
    tensor's range alone would miss nearly every step: torch rarely hands
    a block back at the same place."""
    torch = _torch()
    out = []
    try:
        for sg in torch.cuda.memory_snapshot():
            a, sz = sg["address"], sg["total_size"]
            if a <= ptr and ptr + n <= a + sz:
                if sz <= _MREG_SPAN:
                    out.append((a, sz))
                elif n < _MREG_SPAN:
                    lo = max(a, ptr - (_MREG_SPAN - n) // 2)
                    hi = min(a + sz, lo + _MREG_SPAN)
                    lo = max(a, hi - _MREG_SPAN)
                    out.append((lo, hi - lo))
                break
    except Exception:  # no snapshot here: the tensor's range alone
        pass
    out.append((ptr, n))
    return out


def _region_bytes(H, fp8, K, tmax, cap):
    """(bytes of a shape's group region without its receive areas, bytes
    of one receive area), a rank's, as the daemon lays them out: the
    fields of ep_buffers (combine_y, the received top-k, weights, sources
    and scales: cap rows; x, the biases, the output: tmax rows)."""
    es, ns = (1 if fp8 else 2), (H // 128 if fp8 else 0)
    fixed = cap * (H * 2 + K * 16 + 8 + ns * 4) + \
        tmax * (H * es + 3 * H * 2 + K * 16 + ns * 4)
    return fixed, cap * H * es


def _recv_areas(buf, tag, fixed, per_area):
    """Receive areas of a shape's group: $EPD_DEEP_EP_RECV_AREAS (1..16)
    if set, for the normal ops of GPU ranks of a one-node group, else 1.
    Unset, up to 3 while the Buffer's bytes last: the shapes' groups
    share what DeepEP's Buffer was given (num_nvl_bytes + num_rdma_bytes
    a rank), each first group taking areas past the first only from what
    is left of it (a group of a shape has at least one whatever it costs:
    _Sub; a Buffer given 0 bytes gets 3). Area 0 stays the staging area
    of the copy path."""
    if buf._device is None or buf._rpn != buf.group_size or tag:
        return 1
    env = os.environ.get("EPD_DEEP_EP_RECV_AREAS")
    if env:
        n = int(env)
        if not 1 <= n <= 16:
            raise ValueError(f"EPD_DEEP_EP_RECV_AREAS={n}: 1..16")
        return n
    most = min(3, getattr(buf, "_areas_max", 3))
    if not buf._mem_given:
        return most
    left = buf._mem_given - buf._mem_used - fixed
    return max(1, min(most, left // per_area))


def _end_event():
    """The event a handed-out buffer's end leaves for its next writer (an
    event on the stream current then), None in a capture (an event
    recorded into a capture fires only in replays: the next op's wait for
    the caller's stream is the order left, _streams); raises at
    interpreter shutdown."""
    torch = _torch()
    if torch.cuda.is_current_stream_capturing():
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


class _Lease(epd._DeviceArray):
    """One receive area handed out as a dispatch's recv_x: torch keeps
    this object alive as long as the tensor's storage (any view of it), and
    its end gives the area back, with an event on the stream current then
    that the area's next dispatch waits for."""

    def __init__(self, sub, area):
        super().__init__()
        self.sub, self.area = sub, area
        sub.leases += 1

    def __del__(self):
        sub, self.sub = self.sub, None
        if sub is None:
            return
        try:
            ev, lost = _end_event(), False
        except Exception:  # interpreter shutdown: the area stays taken
            ev, lost = None, True
        sub.give_back(self.area, ev, lost)


class _OutLease(epd._DeviceArray):
    """One output slot handed out as a combine's combined_x: as _Lease,
    its end (the tensor's and every view's) gives the slot back, with an
    event on the stream current then that the slot's next combine waits
    for. It holds the slot's tensor, so the memory outlives the Buffer."""

    def __init__(self, sub, slot):
        super().__init__()
        self.sub, self.slot = sub, slot

    def __del__(self):
        sub, self.sub = self.sub, None
        if sub is None:
            return
        try:
            ev = _end_event()
        except Exception:  # interpreter shutdown: the slot stays taken
            return
        if sub.g is None:
            # the group is gone: the slot's memory goes back to torch
            # here, and the daemon may still be writing the combine that
            # filled it (the comm stream is how far that got)
            sub.comm.synchronize()
            return
        sub.out_free.append((self.slot, ev))


class _Sub:
    """One epd group of one shape, and views of this rank's buffers."""

    out_made = 0  # output slots made (out_slot; GPU ranks only)

    def __init__(self, buf, key, tmax, tag=""):
        torch = _torch()
        H, fp8, K, E = key
        self.key, self.H, self.fp8, self.K, self.E = key, H, fp8, K, E
        self.tmax, self.W = tmax, buf.group_size
        self.comm = getattr(buf, "_comm", None)  # the Buffer's comm stream
        self.per = E // self.W
        self.cap = self.W * tmax
        self.gpu = buf._device is not None
        self.leases, self.leaving = 0, False
        fixed, per_area = _region_bytes(H, fp8, K or 0, tmax, self.cap)
        areas = _recv_areas(buf, tag, fixed, per_area)
        # the region's bytes (Buffer.memory_bytes)
        self.bytes = fixed + areas * per_area
        # areas 1.. are handed out as recv_x tensors (_Lease), each with
        # the event its next dispatch waits for (None: none needed)
        self.free = [(a, None) for a in range(areas - 1, 0, -1)]
        name = f"{buf._name}-{tag}{H}-{'f' if fp8 else 'b'}{K}-{E}"
        self.g = buf._conn.join(
            name, world_size=self.W, ranks_per_node=buf._rpn,
            rank=buf.rank, num_experts=E, hidden=H,
            max_tokens_per_rank=tmax, topk=K,
            dtype=epd.FP8 if fp8 else epd.BF16,
            cuda_device=buf._device, recv_areas=areas,
            nodes=buf._nodes if buf.group_size > buf._rpn else None,
            secret=buf._secret, timeout_ms=buf._timeout_ms)
        # output slots (GPU ranks): ((tensor [tmax, H] bf16, its
        # registration), event or None) free
        self.out_free = []
        if not self.gpu:
            return
        t, cap, ns = self.g.tensor, self.cap, H // 128
        self.x = t("x", (tmax, H), "fp8" if fp8 else "bf16")
        self.recv_x = t("recv_x", (cap, H), "fp8" if fp8 else "bf16")
        if fp8:
            self.scales = t("x_scales", (tmax, ns), "float32")
            self.recv_scales = t("recv_x_scales", (cap, ns), "float32")
        self.topk = t("topk_idx", (tmax, K), "int64")
        self.w = t("topk_weights", (tmax, K), "float32")
        self.recv_topk = t("recv_topk_idx", (cap, K), "int64")
        self.recv_w = t("recv_topk_weights", (cap, K), "float32")
        self.recv_src = t("recv_src", (cap, 2), "int32")
        # the received scales (fp8), top-k, weights and sources lie one
        # after the other in the region: a dispatch's outputs are views of
        # one copy of that span (one copy on the comm stream, not four)
        first = self.recv_scales if fp8 else self.recv_topk
        base = first.data_ptr()
        self.moff = {n: f.data_ptr() - base for n, f in (
            ("scales", first), ("topk", self.recv_topk),
            ("w", self.recv_w), ("src", self.recv_src))}
        self.meta = t("recv_x_scales" if fp8 else "recv_topk_idx",
                      ((self.moff["src"] + cap * 8) // 4,), "int32")
        # device addresses of the fields the small copies touch
        # (epd.stream_copies: one launch for a dispatch's inputs, one for
        # its outputs)
        self.ptr = {n: f.data_ptr() for n, f in (
            ("topk", self.topk), ("w", self.w), ("meta", self.meta),
            ("src", self.recv_src))}
        if fp8:
            self.ptr["scales"] = self.scales.data_ptr()
        self.y = t("combine_y", (cap, H), "bf16")
        self.bias = t("combine_bias", (tmax, H), "bf16")
        self.bias2 = t("combine_bias2", (tmax, H), "bf16")
        self.out = t("combined", (tmax, H), "bf16")
        self.cw = t("combine_topk_weights", (cap, K), "float32")
        self.cw_out = t("combined_topk_weights", (tmax, K), "float32")
        self.rp = self.g.rank_prefix_matrix()
        self.ptr["rp"] = self.rp.data_ptr()
        self.count = torch.as_tensor(epd._DeviceArray(
            self.g.recv_count_device(), (1,), "<i4"), device="cuda")
        # a combine's expert rows read in place by the daemon (registered
        # memory, region_of): GPU ranks of one node, unless
        # $EPD_DEEP_EP_REGISTER=0; off for good once the caller's memory
        # proves not to be of the kind (no expandable segments)
        self.mregs = []  # most recently used first
        self.registered = 0  # registrations made (region_of's misses)
        # combines that read their rows in place, that wrote their
        # output in place (for tests and epctl-minded users)
        self.in_place = {"rows": 0, "out": 0}
        self.mreg_on = buf._rpn == buf.group_size and not tag and \
            os.environ.get("EPD_DEEP_EP_REGISTER", "1") != "0"
        self.refused = 0  # EP_EUNSUPPORTED in a row (_REFUSALS)

    def region_of(self, x):
        """The registration that holds x's bytes (made if none does), or
        None: copy them. For a combine's rows and a dispatch's x."""
        if not self.mreg_on or self.g is None or not x.is_contiguous():
            return None
        ptr, n = x.data_ptr(), x.numel() * x.element_size()
        for i, r in enumerate(self.mregs):
            # the range here, the allocations under it in libep
            if r.base <= ptr and ptr + n <= r.base + r.nbytes and \
                    r.covers(ptr, n):
                if i:
                    self.mregs.insert(0, self.mregs.pop(i))
                return r
        # a miss: registrations whose memory torch has since given back
        # or remapped go first (they would hold it in the daemon)
        for r in [r for r in self.mregs if not r.covers(r.base, r.nbytes)]:
            self.mregs.remove(r)
            r.deregister()
        r = None
        for lo, size in _extents(ptr, n):
            # too many allocations, a hole in the segment (memory torch
            # gave back): the next, narrower extent
            r = self._register(lo, size)
            if r is not None or not self.mreg_on or self.refused:
                break  # (memory of the wrong kind: no narrower try)
        if r is None:
            return None
        self.registered += 1
        self.mregs.insert(0, r)
        # registrations hold the allocations under them: a few recent ones
        while len(self.mregs) > _MREG_KEEP:
            self.mregs.pop().deregister()
        return r

    def out_slot(self):
        """A free output slot and the event its last user left, or None:
        copy out. Slots are torch memory registered once (a fresh tensor
        per combine would need a registration each time: the caching
        allocator rarely hands the same block back to a stream that
        recorded it); at most _OUT_SLOTS, made on demand."""
        if self.out_free:
            return self.out_free.pop()
        if not self.mreg_on or self.g is None or \
                self.out_made >= _OUT_SLOTS:
            return None
        torch = _torch()
        t = torch.empty((self.tmax, self.H), dtype=torch.bfloat16,
                        device="cuda")
        r = self._register(t.data_ptr(), t.numel() * 2)
        if r is None:
            return None
        self.out_made += 1
        return (t, r), None

    def _register(self, ptr, n):
        """A registration of [ptr, ptr + n), or None. Memory of the wrong
        kind (EP_EUNSUPPORTED) turns registering off for good without
        expandable segments, or after _REFUSALS in a row with them (a
        tensor from a segment made before they were on is copied)."""
        try:
            r = self.g.mem_register(ptr, n)
        except epd.Error as e:
            if e.code == epd.EUNSUPPORTED:
                self.refused += 1
                if not _ES or self.refused >= _REFUSALS:
                    self.mreg_on = False
            return None
        self.refused = 0
        return r

    def take(self):
        """A free receive area and its event, or (0, None): none free
        (the copy path)."""
        return self.free.pop() if self.free and self.g is not None \
            else (0, None)

    def give_back(self, area, ev, lost=False):
        self.leases -= 1
        if not lost:
            self.free.append((area, ev))
        if self.leaving and not self.leases:
            self.leave()

    def leave(self):
        """Leave the group, once no recv_x tensor lives in its areas (the
        Buffer's end does not free memory a tensor still uses)."""
        if self.leases:
            self.leaving = True
            return
        if self.g is not None:
            if self.out_made:
                # the daemon writes the combines' outputs into the slots,
                # torch memory that is freed below: not while one still
                # runs (the comm stream passes a combine once it is done)
                self.comm.synchronize()
            self.out_free = []
            g, self.g = self.g, None
            self.mregs = []  # ep_leave drops them
            try:
                g.leave()
            except epd.Error:
                pass
