# SPDX-License-Identifier: MIT
"""DeepEP's normal-mode Buffer, run by epd.

Each rank talks to its node's epd (the socket is $EPD_SOCKET or the
default path). DeepEP sizes its buffer in bytes and takes hidden, dtype and
top-k per call; an epd group is sized at join. So a Buffer joins one epd
group per shape it meets (hidden, bf16 or fp8, top-k, number of experts),
lazily, at the first dispatch of that shape: every rank makes the same
calls in the same order (DeepEP requires it too), so every rank joins at
the same call. At that join the ranks agree, through the torch group, on
the group's maximum tokens per rank: the largest first call rounded up to
a power of two (at least 128), or $EPD_DEEP_EP_MAX_TOKENS. A dispatch of
more tokens than that raises ValueError naming the variable, on every rank
at once (the op goes to the daemon all the same and fails there).

Outputs are fresh tensors (copies out of epd's buffers, made on the comm
stream; a dispatch's recv_x is a receive area of the group handed out
instead, and a combine's output in memory the daemon can import is written
there by the daemon: one of a few output slots, registered once and
handed out as combined_x until that tensor dies); inputs are copied in,
except a combine's rows and a dispatch's x in such memory (PyTorch's
expandable segments), which it reads in place (registered memory, the
allocator's segment around them registered at once;
$EPD_DEEP_EP_REGISTER=0: off; $EPD_DEEP_EP_REGISTER_X=0: x copied;
$EPD_DEEP_EP_OUT_SLOTS=0: the combine's output copied); handles are DeepEP's 6-tuples, and the routing they name lives in
the daemon until the tuple's recv_src_idx tensor is freed (released then:
ep_handle_release). A dispatch from is_token_in_rank alone (no top-k)
routes through a group of top-k shape with at least as many slots as
ranks (the one already joined, or the last get_dispatch_layout's), each
rank's first expert standing for the rank, so it costs no group of its
own; else through a group with one expert per rank. Its per-expert counts,
when num_tokens_per_expert is given, are summed over the ranks with one
all_reduce of the torch group (DeepEP's own exchange; the top-k path needs
none).

Memory: a shape's group holds, per rank, combine_y and the received
top-k, weights and sources for world x max tokens rows, and one or more
receive areas of as many rows of x (_region_bytes). The groups of a
Buffer share the bytes it was given (num_nvl_bytes + num_rdma_bytes): a
group takes receive areas past its first (up to 3) only from what its
shapes' earlier groups left of them ($EPD_DEEP_EP_RECV_AREAS sets the
count outright); a dispatch that finds no free area copies recv_x out of
the first. Buffer.memory_bytes() says what the groups took.

Low-latency mode has DeepEP's semantics (the per-local-expert layout,
src_info, layout_range, counts, fp8 with per-128 scales, the weighted
combine, the receive hook, zero copy). GPU ranks run it through libep's
ep_ll_* (_ll_kernels): on one node epd's kernels, one kernel on the
rank's stream per op (or two with the hook); across nodes libep's
kernels around the daemons' stream-ordered ops; both capturable in CUDA
graphs. Elsewhere (host ranks, ranks of one node sharing a GPU without
MPS, or EPD_DEEP_EP_LL_KERNELS=0) it goes over the daemon's normal path: each
(token, k) is a pseudo token of one expert in a group of its own shape,
and the weighted sum is made at home; the same bits, not the kernels'
speed, and the hook has nothing left to do there.

Shrink mode (enable_shrink, DeepEP's masking of ranks) runs on the
kernels (libep ep_ll_shrink): a rank that leaves, dies, does not come
within the timeout or fails is masked by the ranks that wait for it, and
they go on without it; the low_latency_*_mask_buffer calls read and write
the mask, and clean_low_latency_buffer is a barrier that masks a rank that
does not come. The low-latency group forms at a shape's first dispatch,
with every rank; to cover a rank that fails before it, the Buffer joins
that group at construction when num_rdma_bytes is the value
get_low_latency_rdma_size_hint returned in this process (its shape is
known then), with room for up to _LL_SHRINK_TOPK experts per token.
Elsewhere (the daemon's path) a rank that dies or leaves fails the group
on every rank (EP_EPEERLOST), and the job joins a new one.
"""
import os
import socket
import uuid
import weakref

import epd
from ..utils.event import EventHandle, EventOverlap
from ..utils.envs import check_nvlink_connections, check_torch_deterministic
from ..utils.math import per_token_cast_to_fp8
from ..utils import spans as _spans


def _torch():
    import torch
    return torch


# num_rdma_bytes -> (num_max_dispatch_tokens_per_rank, hidden, num_ranks,
# num_experts) of get_low_latency_rdma_size_hint's answers in this process
_LL_HINTS = {}
# the top-k room of a low-latency group joined at construction (shrink)
_LL_SHRINK_TOPK = 16


class Config:
    """DeepEP's tuning config. epd picks its own launch shape; the values
    are kept and reported, and the size hints answer honestly."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6,
                 num_max_nvl_chunked_recv_tokens=256,
                 num_max_rdma_chunked_send_tokens=6,
                 num_max_rdma_chunked_recv_tokens=128):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 0  # epd's daemon owns and sizes the buffers

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 0

    def __repr__(self):
        return (f"Config(num_sms={self.num_sms}, nvl_chunk="
                f"{self.num_max_nvl_chunked_send_tokens})")


topk_idx_t = None  # set on import (torch.int64)


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


class Buffer:
    """DeepEP's intranode/internode normal-mode Buffer on epd (see the
    module's docstring for what differs underneath)."""

    num_sms = 20
    _timeout_ms = 0  # the groups' timeout (0: the daemon's default)
    _areas_max = 3  # receive areas a group may take (_recv_areas)

    def __init__(self, group=None, num_nvl_bytes=0, num_rdma_bytes=0,
                 low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 explicitly_destroy=False, enable_shrink=False, comm=None,
                 socket_path=None):
        torch = _torch()
        import torch.distributed as dist
        check_nvlink_connections(group)
        if group is None:
            if comm is not None:
                raise NotImplementedError(
                    "epd's deep_ep: mpi4py communicators are not "
                    "supported; pass a torch.distributed group")
            raise ValueError("Either 'group' or 'comm' must be provided.")
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        # the bytes a rank's groups may take (_recv_areas), and those its
        # normal-mode groups took
        self._mem_given = max(0, int(num_nvl_bytes)) + \
            max(0, int(num_rdma_bytes))
        self._mem_used = 0
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self._subs = {}
        self._empties = {}  # device: a 0-element int32 tensor
        self._conn = None
        host = os.environ.get("EPD_DEEP_EP_HOST") == "1"
        self._device = None
        if torch.cuda.is_available() and not host:
            self._device = torch.cuda.current_device()
        sock = socket_path or os.environ.get("EPD_SOCKET")
        self._conn = epd.connect(sock)
        # the rendezvous: each rank's daemon (its node name, or host and
        # socket from a daemon that names none), and rank 0's token, which
        # names the job's groups and is their secret (a rank of another
        # job, root or not, cannot join, squat or read them)
        node = self._conn.node or f"{socket.gethostname()}:{sock}"
        me = (node, uuid.uuid4().hex)
        allv = [None] * self.group_size
        dist.all_gather_object(allv, me, group)
        hosts = [a[0] for a in allv]
        rpn = hosts.count(hosts[0])
        for i, hv in enumerate(hosts):
            if hosts.count(hv) != rpn or hosts[i - i % rpn] != hv:
                raise ValueError(
                    "epd's deep_ep: the group's ranks must be node-major "
                    f"with the same number per node; got {hosts}")
        self._rpn = rpn
        # the group's nodes, in node order: whichever nodes the job got
        self._nodes = hosts[::rpn] if self._conn.node else None
        self._secret = allv[0][1]
        if self._device is not None and rpn == self.group_size and \
                os.environ.get("EPD_DEEP_EP_REGISTER", "1") != "0":
            _expandable(torch)  # from here on: memory read in place
        self._name = "dep-" + allv[0][1][:12]
        if self._device is not None:
            self._comm = torch.cuda.Stream()
            self._comm_ptr = self._comm.cuda_stream  # (a CUstream)
            self._order = torch.cuda.Event()  # _streams' compute point
            self._done = torch.cuda.Event()  # _finish's comm point
            self._ar = torch.arange(self.group_size, dtype=torch.int64,
                                    device="cuda")
        self._layout_experts = None
        self._layout_topk = None  # top-k of the last get_dispatch_layout
        # why the low-latency ops run on the daemon's path (None: epd's
        # kernels where they apply, _ll_kernels)
        self._ll_off = None if os.environ.get(
            "EPD_DEEP_EP_LL_KERNELS", "1") != "0" else \
            "EPD_DEEP_EP_LL_KERNELS=0"
        if enable_shrink:
            self._ll_shrink_start(low_latency_mode, num_rdma_bytes)

    # ---- shrink mode (the module's docstring) ----

    def _ll_shrink_start(self, low_latency_mode, num_rdma_bytes):
        if self._device is None or self._rpn != self.group_size or \
                self._ll_off is not None:
            self._destroy()
            raise NotImplementedError(
                "epd's deep_ep: shrink mode runs on epd's low-latency "
                "kernels: GPU ranks of one node (this Buffer's low-latency "
                "ops go over the daemon's path)")
        hint = _LL_HINTS.get(num_rdma_bytes)
        if not low_latency_mode or hint is None or \
                hint[2] != self.group_size:
            return  # each shape's group: shrink once it formed
        N, H, _, E = hint
        if E % self.group_size or H % 128:
            return
        self._llk_sub(("llk", H, E, None, N), H, E,
                      min(E, _LL_SHRINK_TOPK), N)
        # every rank mapped every region before any can leave
        _torch().distributed.barrier(self.group)

    def _llk_sub(self, key, H, E, K, N):
        """The low-latency kernels' group of a shape (made at its first
        use; in shrink mode, with shrink mode on)."""
        sub = self._subs.get(key)
        if sub is None:
            sub = _Sub(self, (H, False, K, E), N, tag=f"llk{N}-")
            sub.ll_gen = [0, 0]
            self._subs[key] = sub
            if self.enable_shrink:
                sub.g.ll_shrink()
        return sub

    def _ll_shrink_subs(self):
        if not self.enable_shrink:
            raise ValueError("epd's deep_ep: the mask buffer needs "
                             "enable_shrink=True")
        return [s for k, s in self._subs.items()
                if k[0] == "llk" and s.g is not None]

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Mask (mask=True) or unmask a rank in this rank's low-latency
        ops, on the current stream."""
        subs = self._ll_shrink_subs()
        st = _torch().cuda.current_stream()
        for s in subs:
            s.g.ll_mask(rank_to_mask, mask, stream=st)

    def low_latency_query_mask_buffer(self, mask_status):
        """mask_status [num_ranks] int32 CUDA: 1 where this rank masks
        that rank (in any of its low-latency groups)."""
        torch = _torch()
        if tuple(mask_status.shape) != (self.group_size,) or \
                mask_status.dtype != torch.int32 or not mask_status.is_cuda:
            raise ValueError(f"mask_status must be [{self.group_size}] "
                             f"int32 on the GPU")
        subs = self._ll_shrink_subs()
        st = torch.cuda.current_stream()
        mask_status.zero_()
        tmp = torch.empty_like(mask_status)
        for s in subs:
            s.g.ll_mask_query(tmp, stream=st)
            torch.maximum(mask_status, tmp, out=mask_status)

    def low_latency_clean_mask_buffer(self):
        """Unmask every rank."""
        subs = self._ll_shrink_subs()
        st = _torch().cuda.current_stream()
        for s in subs:
            s.g.ll_mask_clean(stream=st)

    # ---- life ----

    def destroy(self):
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._destroy()

    def _destroy(self):
        if self._device is not None and self._subs:
            # the ops this rank enqueued are done before it leaves (one
            # still queued would see its rank leave, and the others fail)
            self._comm.synchronize()
        for s in self._subs.values():
            s.leave()
        held = any(s.leaving for s in self._subs.values())
        self._subs = {}
        if self._conn is not None:
            # a group that recv_x tensors still use keeps the connection
            # (its Group object holds it) until the last one is freed
            if not held:
                self._conn.close()
            self._conn = None

    def __del__(self):
        if not getattr(self, "explicitly_destroy", True):
            try:
                self._destroy()
            except Exception:
                pass

    # ---- statics ----

    @staticmethod
    def is_sm90_compiled():
        """True where fp8 dispatch works: epd's fp8 path is in every build;
        torch needs float8_e4m3fn to hand it over."""
        return hasattr(_torch(), "float8_e4m3fn")

    @staticmethod
    def set_num_sms(new_num_sms):
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture():
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks):
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks):
        return Config(Buffer.num_sms, 4, 256, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank,
                                       hidden, num_ranks, num_experts):
        """A size hint only (epd sizes its own buffers): two receive
        buffers of every expert's rows, rounded up to 128 MiB."""
        b = 2 * num_max_dispatch_tokens_per_rank * num_ranks * \
            (num_experts // max(num_ranks, 1)) * (hidden * 2 + 64)
        n = (b + (128 << 20) - 1) // (128 << 20) * (128 << 20)
        # shrink mode joins the low-latency group of a Buffer given this
        # size at its construction (the module's docstring)
        _LL_HINTS[n] = (num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                        num_experts)
        return n

    def get_comm_stream(self):
        return self._comm if self._device is not None else None

    def get_local_buffer_tensor(self, dtype, size=None, offset=0,
                                use_rdma_buffer=False):
        raise NotImplementedError(
            "epd's deep_ep: the daemon owns the buffers; there is no raw "
            "local buffer to view")

    # ---- layout ----

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None,
                            async_finish=False, allocate_on_comm_stream=False):
        """(num_tokens_per_rank [W] int32, None, num_tokens_per_expert [E]
        int32, is_token_in_rank [T, W] bool, event): computed with torch on
        the caller's stream (every -1 skipped; an expert counted once per
        slot that names it, a rank once per token)."""
        torch = _torch()
        W = self.group_size
        if num_experts % W:
            raise ValueError(f"num_experts {num_experts} is not a multiple "
                             f"of the group's {W} ranks")
        self._layout_experts = num_experts
        self._layout_topk = topk_idx.size(1)
        if previous_event is not None and previous_event.event is not None:
            previous_event.event.current_stream_wait()
        ti = topk_idx.long()
        T = ti.size(0)
        valid = ti >= 0
        per_expert = torch.bincount(ti[valid], minlength=num_experts)
        per_expert = per_expert[:num_experts].to(torch.int32)
        ranks = torch.where(valid, ti // (num_experts // W),
                            torch.full_like(ti, W))
        in_rank = torch.zeros((T, W + 1), dtype=torch.bool,
                              device=ti.device)
        in_rank.scatter_(1, ranks, True)
        in_rank = in_rank[:, :W].contiguous()
        per_rank = in_rank.sum(dim=0).to(torch.int32)
        ev = EventHandle() if async_finish else None
        return per_rank, None, per_expert, in_rank, EventOverlap(ev)

    # ---- the groups ----

    def _sub(self, key, T, tmax=None):
        # more tokens than a group holds is not refused here: the op goes
        # to the daemon all the same and fails for every rank at once
        # (dispatch() raises ValueError on each), instead of the others
        # waiting for this rank until the group's timeout. tmax: the
        # tokens a rank may send (every rank's alike), else chosen here
        sub = self._subs.get(key)
        if sub is not None:
            return sub
        import torch.distributed as dist
        env = os.environ.get("EPD_DEEP_EP_MAX_TOKENS")
        if tmax is not None:
            pass
        elif env:
            tmax = int(env)
        else:
            ts = [None] * self.group_size
            dist.all_gather_object(ts, int(T), self.group)
            tmax = 128
            while tmax < max(ts):
                tmax *= 2
        sub = _Sub(self, key, tmax)
        self._subs[key] = sub
        self._mem_used += sub.bytes
        return sub

    def memory_bytes(self):
        """Bytes of device (or host) memory this rank's groups hold in
        the daemon (the low-latency ones too), receive areas included."""
        return sum(s.bytes for s in self._subs.values()
                   if s.g is not None and hasattr(s, "bytes"))

    def _in_rank_key(self, H, fp8):
        """The shape a dispatch from is_token_in_rank alone goes through.
        A token goes to at most W ranks, so a shape with at least W top-k
        slots carries it, each rank's first expert standing for the rank
        (_in_rank_topk): the same rows and order, and no second group's
        memory. That is the first such shape already joined, else the last
        get_dispatch_layout's (the group formed now), else one expert per
        rank (K = E = W). Every rank makes the same calls, so every rank
        picks the same."""
        W = self.group_size
        for key in self._subs:  # (the low-latency ones are 5-tuples)
            if len(key) == 4 and key[:2] == (H, fp8) and key[2] >= W:
                return key
        if self._layout_topk is not None and self._layout_topk >= W:
            return (H, fp8, self._layout_topk, self._layout_experts)
        return (H, fp8, W, W)

    @staticmethod
    def _in_rank_topk(sub, in_rank, ar):
        """is_token_in_rank [T, W] as sub's top-k [T, K]: rank r's first
        expert where the token goes to r, -1 elsewhere (ar: 0..W-1 on
        in_rank's device)."""
        torch = _torch()
        T = in_rank.size(0)
        t = torch.where(in_rank.bool(), (ar * sub.per).expand(T, -1),
                        torch.full((T, sub.W), -1, dtype=torch.int64,
                                   device=in_rank.device))
        if sub.K > sub.W:
            t = torch.cat([t, torch.full((T, sub.K - sub.W), -1,
                                         dtype=torch.int64,
                                         device=in_rank.device)], dim=1)
        return t

    @staticmethod
    def _routing(handle):
        r = getattr(handle[3], "_epd", None) if handle is not None and \
            len(handle) == 6 else None
        if r is None:
            raise ValueError("not a handle of epd's deep_ep dispatch")
        if r.sub.g is None:
            raise ValueError("the handle's Buffer was destroyed")
        return r

    # ---- dispatch ----

    def dispatch(self, x, handle=None, num_tokens_per_rank=None,
                 num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0,
                 config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        """DeepEP's dispatch: (recv_x or (recv_x, recv_x_scales),
        recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)."""
        torch = _torch()
        check_torch_deterministic()
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        fp8 = x_scales is not None
        T, H = x.shape
        ue8m0 = fp8 and x_scales.dtype == torch.int32
        if ue8m0:  # packed exponents: fp32 powers of two for the group
            x_scales = _ue8m0_unpack(x_scales, H // 128)
        W = self.group_size
        rt = None
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch takes no top-k")
            rt = self._routing(handle)
            sub = rt.sub
            if H != sub.H or T != rt.T:
                raise ValueError(
                    f"cached dispatch: x is [{T}, {H}], the handle's "
                    f"dispatch was [{rt.T}, {sub.H}]")
            in_rank = handle[4]
            if fp8 != sub.fp8:
                # the same routing in the other dtype's group: a fresh
                # dispatch of the kept routing input there, once; cached
                # dispatches on its handle after that
                alt = rt.alts.get(fp8)
                sub2 = alt.sub if alt else \
                    self._sub((H, fp8, sub.K, sub.E), T)
                run = self._gpu_dispatch if sub2.gpu else self._host_dispatch
                out = run(sub2, x, x_scales, rt.topk, None, in_rank, alt,
                          0, previous_event, async_finish,
                          allocate_on_comm_stream)
                if alt is None:
                    rt.alts[fp8] = out[5]
                    rt.entries.append((weakref.ref(sub2), out[5].h))
                rxs = _ue8m0_pack(out[1]) if ue8m0 else out[1]
                return ((out[0], rxs) if fp8 else out[0], None, None,
                        None, None, out[8])
        else:
            if is_token_in_rank is None and topk_idx is None:
                raise ValueError("dispatch needs topk_idx or is_token_in_rank")
            if topk_idx is not None:
                E = num_tokens_per_expert.numel() if \
                    num_tokens_per_expert is not None else self._layout_experts
                if E is None:
                    raise ValueError("dispatch: give num_tokens_per_expert "
                                     "(or call get_dispatch_layout first)")
                key = (H, fp8, topk_idx.size(1), E)
            else:
                key = self._in_rank_key(H, fp8)
            sub = self._sub(key, T)
            in_rank = is_token_in_rank
            if in_rank is None:
                in_rank = self.get_dispatch_layout(topk_idx, key[3])[3]
        if num_worst_tokens and num_worst_tokens > sub.cap:
            raise ValueError(f"num_worst_tokens {num_worst_tokens} exceeds "
                             f"what the group holds ({sub.cap} rows)")
        out = self._run_dispatch(
            sub, (x, x_scales, topk_idx, topk_weights, in_rank, rt,
                  num_worst_tokens, previous_event, async_finish,
                  allocate_on_comm_stream),
            f"the group of this shape was sized for {sub.tmax} tokens per "
            f"rank at its first dispatch: set EPD_DEEP_EP_MAX_TOKENS (the "
            f"same on every rank) to the largest count")
        recv_x, recv_xs, rti, rtw, pe, rt_new, rp, rsrc, ev = out
        if ue8m0:
            recv_xs = _ue8m0_pack(recv_xs)
        if handle is not None:
            return ((recv_x, recv_xs) if fp8 else recv_x, None, None, None,
                    None, ev)
        if num_worst_tokens:
            pe_list = []
        elif topk_idx is None:
            pe_list = self._global_counts(sub, num_tokens_per_expert)
        else:
            pe_list = pe
        if expert_alignment > 1:
            a = expert_alignment
            pe_list = [(c + a - 1) // a * a for c in pe_list]
        if topk_idx is None:
            rti = rtw = None
        rsrc._epd = rt_new
        # not at interpreter exit: the daemon frees a connection's holds
        # when it closes, and libep may be half torn down by then
        weakref.finalize(rsrc, _release_all, rt_new.entries).atexit = False
        # the handle's unused members: one empty tensor per device
        empty = self._empties.get(x.device)
        if empty is None:
            empty = self._empties[x.device] = torch.empty(
                0, dtype=torch.int32, device=x.device)
        hnd = (rp, empty, empty, rsrc, in_rank, empty)
        return ((recv_x, recv_xs) if fp8 else recv_x, rti, rtw, pe_list,
                hnd, ev)

    def _run_dispatch(self, sub, args, too_many):
        """The GPU or host dispatch of sub; too many tokens (this rank's or
        another's: every rank of the group gets it) as ValueError."""
        run = self._gpu_dispatch if sub.gpu else self._host_dispatch
        try:
            return run(sub, *args)
        except epd.Error as e:
            if e.code != epd.ETOOBIG:
                raise
            raise ValueError(f"epd's deep_ep: {e.message}; {too_many}") \
                from e

    def _global_counts(self, sub, num_tokens_per_expert):
        """Per local expert, over every source: DeepEP's counts for a
        dispatch without top-k (one all_reduce of the torch group)."""
        if num_tokens_per_expert is None:
            return []
        torch = _torch()
        import torch.distributed as dist
        E = num_tokens_per_expert.numel()
        t = num_tokens_per_expert.to(torch.int64)
        if dist.get_backend(self.group) == "gloo":
            t = t.cpu()
        t = t.clone()
        dist.all_reduce(t, group=self.group)
        per = E // self.group_size
        return t[self.rank * per:(self.rank + 1) * per].tolist()

    def _streams(self, previous_event):
        torch = _torch()
        compute = torch.cuda.current_stream()
        if previous_event is not None and previous_event.event is not None:
            self._comm.wait_event(previous_event.event.event)
        else:
            # wait_stream without a new event each time (a wait takes the
            # event's record of that moment; recording it again later
            # does not move an earlier wait)
            self._order.record(compute)
            self._comm.wait_event(self._order)
        return compute, self._comm

    def _finish(self, compute, comm, outs, async_finish, alloc_comm,
                recorded=False):
        if not alloc_comm and not recorded:
            for t in outs:
                if t is not None:
                    t.record_stream(comm)
        if async_finish:
            return EventOverlap(EventHandle(comm), outs)
        self._done.record(comm)  # reused, as _order (_streams says why)
        compute.wait_event(self._done)
        return EventOverlap(None)

    def _gpu_dispatch(self, sub, x, xs, topk_idx, topk_weights, in_rank,
                      rt, worst, prev, async_finish, alloc_comm):
        torch = _torch()
        T = x.size(0)
        compute, comm = self._streams(prev)
        if T > sub.tmax:  # nothing copied; every rank's op fails
            sub.g.dispatch_stream(T, stream=comm,
                                  weights=topk_weights is not None)
            raise AssertionError("a dispatch of too many tokens succeeded")
        # the received rows go straight to a free receive area, handed out
        # as recv_x (no copy); with none free (or in a CUDA graph, where a
        # replay would write the captured area again) to area 0 and copied
        cap = torch.cuda.is_current_stream_capturing()
        area, aev = (0, None) if cap else sub.take()
        if aev is not None:
            comm.wait_event(aev)  # the area's last user is done with it
        held = [area]  # the area, until a recv_x tensor owns it
        try:
            return self._gpu_dispatch_in(sub, x, xs, topk_idx, topk_weights,
                                         in_rank, rt, worst, async_finish,
                                         alloc_comm, compute, comm, held,
                                         cap)
        finally:
            if held[0]:  # failed, or no rows: the area is free again
                sub.free.append((held[0], None))

    def _gpu_dispatch_in(self, sub, x, xs, topk_idx, topk_weights, in_rank,
                         rt, worst, async_finish, alloc_comm, compute, comm,
                         held, cap):
        torch = _torch()
        area = held[0]
        T, H, K = x.size(0), sub.H, sub.K
        ns = H // 128
        cached = rt is not None
        # The CPU's work is ordered by what waits for it: first what the
        # dispatch needs on the stream (every rank's op starts only when
        # the last rank rang); then the count, which comes once the
        # routing is known (protocol 1.15), while the rows still move; then
        # the outputs, queued behind the op on the comm stream. A caller
        # that runs ahead overlaps all of it with the op's rows. The small
        # copies between two ops are one launch each way
        # (epd.stream_copies): each separate one is a dependent step on
        # the comm stream, and every rank waits for the slowest.
        # x read where it is (registered memory), as the combine's rows
        xv = x.view(torch.uint8) if sub.fp8 else x
        reg = sub.region_of(xv) if T and _REG_X and not cap else None
        dt = torch.float8_e4m3fn if sub.fp8 else torch.bfloat16
        dev = x.device
        # the current stream is set directly, and only for torch's own
        # copies (torch.cuda.stream's context looks the device and the
        # streams up again each time, tens of us of CPU under MPS); the
        # caller's is set back whatever happens
        on = torch.cuda.set_stream
        cur = [compute]

        def to(s_):
            if cur[0] is not s_:
                on(s_)
                cur[0] = s_
        pieces = []

        def piece(name, src, nbytes):  # into the region's field
            pieces.append(epd.copy_piece(sub.ptr[name], src.data_ptr(),
                                         nbytes))
        try:
            if T and reg is None:
                to(comm)
                sub.x[:T].copy_(xv)
            elif T:
                x.record_stream(comm)  # read until the dispatch ran
            if T:
                if sub.fp8:
                    if xs.dtype == torch.float32 and xs.is_contiguous():
                        piece("scales", xs, T * ns * 4)
                    else:
                        to(comm)
                        sub.scales[:T].copy_(xs)  # any strides
                if not cached:
                    if topk_idx is not None and \
                            topk_idx.dtype == torch.int64 and \
                            topk_idx.is_contiguous():
                        piece("topk", topk_idx, T * K * 8)
                    elif topk_idx is not None:
                        to(comm)
                        sub.topk[:T].copy_(topk_idx)
                    else:
                        to(comm)
                        sub.topk[:T].copy_(self._in_rank_topk(
                            sub, in_rank, self._ar))
                    if topk_weights is not None:
                        if topk_weights.dtype == torch.float32 and \
                                topk_weights.is_contiguous():
                            piece("w", topk_weights, T * K * 4)
                        else:
                            to(comm)
                            sub.w[:T].copy_(topk_weights)
                if worst:  # no CPU wait below: read until the copies ran
                    for t_ in (xs, topk_idx, topk_weights):
                        if t_ is not None:
                            t_.record_stream(comm)
            if pieces:
                _copies(pieces, self._comm_ptr)
            a = _spans.mark(comm)
            h = sub.g.dispatch_stream(
                T, stream=self._comm_ptr, weights=topk_weights is not None,
                handle=rt.h if cached else None, area=area, region=reg,
                ptr=xv.data_ptr() if reg is not None else 0)
            _spans.add("epd_dispatch_impl", a, _spans.mark(comm))
        finally:
            to(compute)
        # the routing input a cached dispatch in the other dtype needs:
        # the caller's topk_idx itself (DeepEP's handle holds the caller's
        # is_token_in_rank the same way); without one, the handle's
        # is_token_in_rank gives it again
        kept = None if cached else topk_idx
        R = rt.R if cached else worst if worst else None
        if R is None:
            try:
                R = sub.g.recv_count(h)  # the CPU waits for the count
                # the rows per expert come with it (the control page)
                pe = sub.g.recv_expert_counts(h)
            except BaseException:
                try:
                    sub.g.release(h)
                except epd.Error:
                    pass
                raise
        else:
            pe = []
        # R rows (num_worst_tokens: that many, those past the count -1);
        # the small outputs are views (as_strided: one call each) of one
        # copy of the span of received scales, top-k, weights and sources
        recv_xs = rti = rtw = rsrc = rp = None
        mo = sub.moff
        alloc = comm if alloc_comm else compute
        pieces = []
        try:
            to(alloc)
            if sub.fp8 or not cached:
                meta = torch.empty_like(sub.meta)  # on the current stream
                if not alloc_comm:
                    # before a copy into it is queued: dropped by an
                    # exception, its memory waits for the comm stream
                    meta.record_stream(comm)
                pieces.append(epd.copy_piece(meta.data_ptr(),
                                             sub.ptr["meta"],
                                             sub.meta.numel() * 4))
                if sub.fp8:
                    recv_xs = meta.view(torch.float32).as_strided(
                        (R, ns), (ns, 1), mo["scales"] // 4)
                if not cached:
                    rti = meta.view(torch.int64).as_strided(
                        (R, K), (K, 1), mo["topk"] // 8)
                    rtw = meta.view(torch.float32).as_strided(
                        (R, K), (K, 1), mo["w"] // 4)
                    rsrc = torch.empty((R,), dtype=torch.int32, device=dev)
                    rp = torch.empty((sub.W, sub.W), dtype=torch.int32,
                                     device=dev)
                    if not alloc_comm:
                        rsrc.record_stream(comm)
                        rp.record_stream(comm)
                    # the source tokens: every other int32 of the pairs
                    pieces.append((rsrc.data_ptr(), sub.ptr["src"] + 4, R,
                                   4, 1, 2))
                    pieces.append(epd.copy_piece(rp.data_ptr(),
                                                 sub.ptr["rp"],
                                                 sub.W * sub.W * 4))
            if not area:
                recv_x = torch.empty((R, H), dtype=dt, device=dev)
                if not alloc_comm:
                    recv_x.record_stream(comm)
            if pieces:  # one launch, behind the op
                _copies(pieces, self._comm_ptr)
            if not cached and worst:  # rows past the received count: -1
                to(comm)
                pad = torch.arange(R, device=dev) >= \
                    sub.count[0].to(torch.int64)
                rti.masked_fill_(pad.unsqueeze(1), -1)
                rtw.masked_fill_(pad.unsqueeze(1), 0.0)
                rsrc.masked_fill_(pad, -1)
            if area:
                # the area itself, given back when the tensor is freed
                recv_x = sub.g.tensor("recv_x", (R, H),
                                      "fp8" if sub.fp8 else "bf16",
                                      area=area, owner=_Lease(sub, area))
                held[0] = 0
                if sub.fp8:
                    recv_x = recv_x.view(dt)
            else:
                to(comm)
                recv_x.view(torch.uint8 if sub.fp8 else dt).copy_(
                    sub.recv_x[:R])
        finally:
            to(compute)
        # (every output's memory is recorded on the comm stream above; an
        # area is not the allocator's)
        ev = self._finish(compute, comm, [recv_x, recv_xs, rti, rtw, rsrc,
                                          rp], async_finish, alloc_comm,
                          recorded=True)
        if cached:
            return recv_x, recv_xs, None, None, None, None, None, None, ev
        return (recv_x, recv_xs, rti, rtw, pe, _Routing(sub, h, T, R, kept),
                rp, rsrc, ev)

    def _host_dispatch(self, sub, x, xs, topk_idx, topk_weights, in_rank,
                       rt, worst, prev, async_finish, alloc_comm):
        torch = _torch()
        T, W = x.size(0), sub.W
        cached = rt is not None
        xn = x.contiguous().view(torch.uint8 if sub.fp8 else torch.int16)
        sn = xs.float().contiguous().numpy() if sub.fp8 else None
        tn = wn = None
        if not cached:
            if topk_idx is not None:
                tn = topk_idx.long().contiguous().numpy()
            else:
                tn = self._in_rank_topk(
                    sub, in_rank.cpu(),
                    torch.arange(W, dtype=torch.int64)).contiguous().numpy()
            if topk_weights is not None:
                wn = topk_weights.float().contiguous().numpy()
        res = sub.g.dispatch(xn.numpy(), tn, T, topk_weights=wn,
                             x_scales=sn, handle=rt.h if cached else None,
                             as_numpy=True)
        R = res.num_recv
        n = worst or R

        def rows(a, dtype, fill):
            t = torch.from_numpy(a.copy()).view(dtype)
            if n == R:
                return t
            o = torch.full((n,) + tuple(t.shape[1:]), fill, dtype=t.dtype)
            o[:R] = t
            return o
        if sub.fp8:
            recv_x = rows(res.recv_x, torch.uint8, 0)
            if hasattr(torch, "float8_e4m3fn") and \
                    x.dtype == torch.float8_e4m3fn:
                recv_x = recv_x.view(torch.float8_e4m3fn)
            recv_xs = rows(res.recv_x_scales, torch.float32, 0)
        else:
            recv_x = rows(res.recv_x.view("int16"), torch.int16, 0).view(
                torch.bfloat16)
            recv_xs = None
        ev = EventOverlap(EventHandle() if async_finish else None)
        if cached:
            return recv_x, recv_xs, None, None, None, None, None, None, ev
        rti = rows(res.recv_topk_idx, torch.int64, -1)
        rtw = rows(res.recv_topk_weights, torch.float32, 0)
        src = sub.g.host_field("recv_src", R * 2, "int32").reshape(R, 2)
        rsrc = rows(src[:, 1].copy(), torch.int32, -1)
        rp = torch.from_numpy(sub.g.rank_prefix_matrix())
        pe = res.num_recv_tokens_per_expert.tolist()
        return (recv_x, recv_xs, rti, rtw, pe,
                _Routing(sub, res.handle, T, n, torch.from_numpy(tn.copy())), rp,
                rsrc, ev)

    # ---- combine ----

    def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish=False,
                allocate_on_comm_stream=False):
        """DeepEP's combine: (combined_x [T, H] bf16, combined_topk_weights
        [T, K] f32 or None, event). The rows are summed in fp32 from the
        bias (a pair: the first plus the second) in ascending rank order,
        rounded once to bf16."""
        return self._combine(x, self._routing(handle), topk_weights, bias,
                             previous_event, async_finish,
                             allocate_on_comm_stream)

    def _combine(self, x, rt, topk_weights, bias, previous_event,
                 async_finish, allocate_on_comm_stream, topk=None):
        """combine() of routing rt; topk ([T, K] int64): each token's rows
        summed in the order of its row's slots (EP_COMBINE_TOPK_ORDER)."""
        torch = _torch()
        check_torch_deterministic()
        sub = rt.sub
        bias2 = None
        if isinstance(bias, tuple):
            if len(bias) != 2:
                raise ValueError("bias: a tensor or a pair")
            bias, bias2 = bias
        for b in (bias, bias2):
            if b is not None and (tuple(b.shape) != (rt.T, sub.H) or
                                  b.dtype != torch.bfloat16):
                raise ValueError(f"combine: a bias must be [{rt.T}, "
                                 f"{sub.H}] bf16, got {list(b.shape)} "
                                 f"{b.dtype}")
        if x.dim() != 2 or x.size(0) != rt.R or x.size(1) != sub.H or \
                x.dtype != torch.bfloat16:
            raise ValueError(f"combine: x must be [{rt.R}, {sub.H}] bf16, "
                             f"got {list(x.shape)} {x.dtype}")
        if topk_weights is not None and tuple(topk_weights.shape) != \
                (rt.R, sub.K):
            raise ValueError(f"combine: topk_weights must be [{rt.R}, "
                             f"{sub.K}], got {list(topk_weights.shape)}")
        run = self._gpu_combine if sub.gpu else self._host_combine
        return run(sub, rt, x, topk_weights, bias, bias2, previous_event,
                   async_finish, allocate_on_comm_stream, topk)

    def _gpu_combine(self, sub, rt, x, tw, bias, bias2, prev, async_finish,
                     alloc_comm, topk=None):
        torch = _torch()
        T, H, K, R = rt.T, sub.H, sub.K, rt.R
        compute, comm = self._streams(prev)
        # the rows read where they are (no copy), and the combined rows
        # written straight into out, unless capturing: a registration's
        # check is a host-side fact of this moment
        cap = torch.cuda.is_current_stream_capturing()
        reg = sub.region_of(x) if R and not cap else None
        slot = sub.out_slot() if T and not cap and \
            rt.h.num_tokens == T else None
        oreg = None
        if slot is not None:
            (st, oreg), oev = slot
            if oev is not None:
                comm.wait_event(oev)  # the slot's last reader is done
            lease = _OutLease(sub, (st, oreg))
            lease._set(st.data_ptr(), (T, H), "<i2")
            out = torch.as_tensor(lease, device=x.device).view(
                torch.bfloat16)
        with torch.cuda.stream(comm if alloc_comm else compute):
            if slot is None:
                out = torch.empty((T, H), dtype=torch.bfloat16,
                                  device=x.device)
            wout = torch.empty((T, K), dtype=torch.float32,
                               device=x.device) if tw is not None else None
        with torch.cuda.stream(comm):
            if R:
                if reg is None:
                    sub.y[:R].copy_(x)
                else:
                    x.record_stream(comm)  # read until the combine ran
                if tw is not None:
                    sub.cw[:R].copy_(tw)
            if bias is not None and T:
                sub.bias[:T].copy_(bias)
            if bias2 is not None and T:
                sub.bias2[:T].copy_(bias2)
            if topk is not None and T:
                sub.topk[:T].copy_(topk)
            flags = dict(bias=bias is not None, weights=tw is not None,
                         bias2=bias2 is not None,
                         topk_order=topk is not None)
            a = _spans.mark(comm)
            if reg is None and oreg is None:
                sub.g.combine_stream(rt.h, stream=comm, **flags)
            else:
                sub.g.combine_stream_mem(
                    rt.h, reg, x.data_ptr() if reg is not None else None, R,
                    oreg, st.data_ptr() if oreg is not None else None,
                    stream=comm, **flags)
            b = _spans.mark(comm)
            _spans.add("epd_combine_impl", a, b)
            if oreg is None:
                out.copy_(sub.out[:T])
            sub.in_place["rows"] += reg is not None
            sub.in_place["out"] += oreg is not None
            if wout is not None:
                wout.copy_(sub.cw_out[:T])
            _spans.add("epd_combine_reduce_epilogue_impl", b,
                       _spans.mark(comm))
        ev = self._finish(compute, comm, [out, wout], async_finish,
                          alloc_comm)
        return out, wout, ev

    def _host_combine(self, sub, rt, x, tw, bias, bias2, prev, async_finish,
                      alloc_comm, topk=None):
        torch = _torch()
        R = rt.h.num_recv  # rows past it (num_worst_tokens) are padding
        y = x[:R].contiguous().view(torch.int16).numpy()
        b = bias.contiguous().view(torch.int16).numpy() if bias is not None \
            else None
        b2 = bias2.contiguous().view(torch.int16).numpy() \
            if bias2 is not None else None
        w = tw[:R].float().contiguous().numpy() if tw is not None else None
        tk = topk.long().contiguous().numpy() if topk is not None else None
        res = sub.g.combine(y, rt.h, bias=b, as_numpy=True, topk_weights=w,
                            bias2=b2, topk_order=tk)
        rows, wts = res if w is not None else (res, None)
        out = torch.from_numpy(rows.view("int16").copy()).view(torch.bfloat16)
        wout = torch.from_numpy(wts.copy()) if wts is not None else None
        return out, wout, EventOverlap(EventHandle() if async_finish
                                       else None)

    # ---- low latency: DeepEP's semantics over the normal path ----

    def _ll_sub(self, H, E, K, nmax):
        """The group of a low-latency shape: one pseudo token per (token,
        k) with that one expert, at most nmax * K per rank, exactly (a rank
        past nmax tokens fails the op for every rank)."""
        key = ("ll", H, E, K, nmax)
        sub = self._subs.get(key)
        if sub is None:
            sub = _Sub(self, (H, False, 1, E), nmax * K, tag=f"ll{nmax}x{K}-")
            self._subs[key] = sub
        return sub

    @staticmethod
    def _ll_routing(handle):
        ll = getattr(handle[0], "_epd", None) if isinstance(handle, tuple) \
            and len(handle) == 5 else None
        if not isinstance(ll, _LLRouting):
            raise ValueError("not a handle of epd's deep_ep "
                             "low_latency_dispatch")
        return ll

    def low_latency_dispatch(self, x, topk_idx,
                             num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False,
                             async_finish=False, return_recv_hook=False):
        """DeepEP's low-latency dispatch: (recv_x [local experts, ranks x
        num_max, H] (bf16, or fp8 with per-128 scales, column-major),
        recv_count, handle, event, hook). Each local expert's rows are
        packed in source rank order, then source token order (DeepEP's
        order between and within source ranks depends on timing; this one
        is fixed), with layout_range and src_info as DeepEP's. The rows
        are ready on return: the hook has nothing left to do."""
        torch = _torch()
        check_torch_deterministic()
        N, E, W = num_max_dispatch_tokens_per_rank, num_experts, \
            self.group_size
        if x.dim() != 2 or x.dtype != torch.bfloat16:
            raise ValueError("low_latency_dispatch: x must be [T, H] bf16")
        T, H = x.shape
        if topk_idx.dim() != 2 or topk_idx.size(0) != T:
            raise ValueError(f"low_latency_dispatch: topk_idx must be "
                             f"[{T}, K]")
        if E % W or N < 1:
            raise ValueError(f"low_latency_dispatch: {E} experts over {W} "
                             f"ranks, at most {N} tokens")
        if use_fp8 and (H % 128 or not hasattr(torch, "float8_e4m3fn")):
            raise ValueError("low_latency_dispatch: fp8 needs hidden % 128 "
                             "== 0 and a torch with float8_e4m3fn")
        if use_ue8m0 and not round_scale:
            raise ValueError("low_latency_dispatch: use_ue8m0 needs "
                             "round_scale")
        K, El, WN = topk_idx.size(1), E // W, W * N
        if self._ll_kernels(H, use_fp8, use_ue8m0):
            res = self._ll_kernel_dispatch(
                x, topk_idx, N, E, cumulative_local_expert_recv_stats,
                async_finish, return_recv_hook,
                (use_fp8, round_scale, use_ue8m0))
            if res is not None:
                return res
        sub = self._ll_sub(H, E, K, N)
        idx = topk_idx.long().reshape(T * K, 1)
        xr = x.repeat_interleave(K, dim=0)
        out = self._run_dispatch(
            sub, (xr, None, idx, None, None, None, 0, None, False, False),
            f"low_latency_dispatch takes at most "
            f"num_max_dispatch_tokens_per_rank={N} tokens per rank")
        recv_x, _, rti, _, _, rt, rp, rsrc, _ = out
        dev = recv_x.device
        R = recv_x.size(0)
        ar = torch.arange(R, device=dev)
        # every received pseudo token has its one expert here
        e = rti[:, 0].to(dev)
        ends = rp[:, self.rank].to(device=dev, dtype=torch.int64)
        src_rank = torch.searchsorted(ends, ar, right=True)
        # rows by expert, in received order within one (unique keys: the
        # sort is deterministic); counts from the sorted keys (no atomics,
        # so also under torch.use_deterministic_algorithms)
        order = torch.argsort(e * max(R, 1) + ar)
        es = e[order]
        bounds = torch.searchsorted(es, torch.arange(El + 1, device=dev))
        start, counts = bounds[:-1], bounds[1:] - bounds[:-1]
        pos = ar - start[es]
        rows = recv_x[order]
        src_info = torch.full((El, WN), -1, dtype=torch.int32, device=dev)
        src_info[es, pos] = (rsrc.to(device=dev, dtype=torch.int64)[order] //
                             K).to(torch.int32)
        # per (expert, source rank): sources are in order within an expert
        k2 = es * W + src_rank[order]
        b2 = torch.searchsorted(k2, torch.arange(El * W + 1, device=dev))
        per = (b2[1:] - b2[:-1]).view(El, W)
        layout = ((b2[:-1].view(El, W) - start.unsqueeze(1)) << 32) | per
        recv_count = counts.to(torch.int32)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(
                recv_count.to(cumulative_local_expert_recv_stats.device))
        if use_fp8:
            q, sinv = per_token_cast_to_fp8(rows, round_scale,
                                            skip_nan=True, one_div=True)
            px = torch.empty((El, WN, H), dtype=torch.float8_e4m3fn,
                             device=dev)
            px.view(torch.uint8)[es, pos] = q.view(torch.uint8)
            if use_ue8m0:
                packed = _ue8m0_pack(sinv)
                ps = torch.zeros((El, packed.size(1), WN), dtype=torch.int32,
                                 device=dev).transpose(1, 2)
                ps[es, pos] = packed
            else:
                ps = torch.zeros((El, H // 128, WN), dtype=torch.float32,
                                 device=dev).transpose(1, 2)
                ps[es, pos] = sinv
            recv = (px, ps)
        else:
            recv = torch.empty((El, WN, H), dtype=torch.bfloat16, device=dev)
            recv[es, pos] = rows
        ll = _LLRouting(rt, order, es, pos, T, K, (El, WN, H))
        src_info._epd = ll
        weakref.finalize(src_info, _release_all, rt.entries).atexit = False
        handle = (src_info, layout, N, H, E)
        ev = EventOverlap(EventHandle() if async_finish else None)
        return recv, recv_count, handle, ev, _ready

    # ---- low latency by epd's own kernels (libep ep_ll_*): GPU ranks of
    # one node, bf16 rows; the kernels write into the peers' regions from
    # this rank's stream, no daemon in the op's path ----

    def _ll_kernels(self, H, use_fp8, use_ue8m0):
        """True: the low-latency ops run through libep's ep_ll_* (on one
        node epd's kernels, each op a kernel on this rank's stream that
        writes into the peers' regions; across nodes libep's kernels
        around the daemons' stream-ordered ops), the default wherever
        they apply: GPU ranks, hidden a multiple of 128 (of 512 with UE8M0
        scales), and on one node ranks that share a GPU under MPS (libep
        refuses without it, on every rank alike before any rank wrote a
        peer, and this Buffer goes on on the daemon's path: _ll_path says
        which and why).
        EPD_DEEP_EP_LL_KERNELS=0: the daemon's path always. What differs
        between the two: a rank with more than num_max tokens raises at
        once on both; on the kernels the other ranks learn it from their
        kernels' error word (epd.Group.ll_error), not by a raise in the
        same call."""
        return (self._device is not None and
                H % (512 if use_fp8 and use_ue8m0 else 128) == 0 and
                self._ll_off is None)

    def _ll_path(self):
        """("kernels", None) or ("daemon", the reason): where this
        Buffer's low-latency ops of a hidden size the kernels take go
        (_ll_kernels)."""
        if self._ll_off is not None:
            return "daemon", self._ll_off
        if self._device is None:
            return "daemon", "host ranks"
        return "kernels", None

    def _ll_kernel_dispatch(self, x, topk_idx, N, E, stats, async_finish,
                            return_recv_hook, cast):
        torch = _torch()
        T, H = x.shape
        K = topk_idx.size(1)
        # shrink mode's group joined at construction, where it fits
        sub = self._subs.get(("llk", H, E, None, N))
        if sub is None or sub.g is None or K > sub.K:
            sub = self._llk_sub(("llk", H, E, K, N), H, E, K, N)
        st = torch.cuda.current_stream()
        xc = x.contiguous()
        idx = topk_idx.to(torch.int64).contiguous()
        try:
            r = sub.g.ll_dispatch(xc, idx, T, hook=return_recv_hook,
                                  stream=st, fp8=cast[0],
                                  round_scale=cast[0] and cast[1],
                                  ue8m0=cast[0] and cast[2])
        except epd.Error as e:
            if e.code == epd.EUNSUPPORTED and sub.ll_gen == [0, 0]:
                # refused at the first op, by every rank alike (e.g. a
                # shared GPU without MPS): the daemon's path from now on
                self._ll_off = e.message
                return None
            if e.code == epd.ETOOBIG:  # it took part with none
                raise ValueError(
                    f"low_latency_dispatch takes at most "
                    f"num_max_dispatch_tokens_per_rank={N} tokens per rank "
                    f"(this rank has {T})") from e
            raise
        b = r["buffer"]
        sub.ll_gen[b] += 1
        if stats is not None and not return_recv_hook:
            stats.add_(r["recv_count"].to(stats.device))
        ll = _LLKernel(sub, b, sub.ll_gen[b], T, K, (xc, idx))
        src_info = r["src_info"]
        src_info._epd = ll
        handle = (src_info, r["layout_range"], N, H, E)
        ev = EventOverlap(EventHandle() if async_finish else None)
        def recv_hook():
            ll.check()
            sub.g.ll_dispatch_hook(b, torch.cuda.current_stream())
            # the counts exist once the receive ran
            if stats is not None:
                stats.add_(r["recv_count"].to(stats.device))
        hook = recv_hook if return_recv_hook else _ready
        recv = (r["recv_x"], r["recv_scales"]) if cast[0] else r["recv_x"]
        return recv, r["recv_count"], handle, ev, hook

    def _ll_kernel_combine(self, ll, x, topk_idx, topk_weights, zero_copy,
                           async_finish, return_recv_hook, out):
        torch = _torch()
        ll.check()
        T, K, sub = ll.T, ll.K, ll.sub
        H = sub.H
        for t, n in ((topk_idx, "topk_idx"), (topk_weights, "topk_weights")):
            if tuple(t.shape) != (T, K):
                raise ValueError(f"low_latency_combine: {n} must be [{T}, "
                                 f"{K}], got {list(t.shape)}")
        El, WN = sub.per, sub.W * sub.tmax
        if not zero_copy and (tuple(x.shape) != (El, WN, H) or
                              x.dtype != torch.bfloat16):
            raise ValueError(f"low_latency_combine: x must be [{El}, {WN}, "
                             f"{H}] bf16, got {list(x.shape)} {x.dtype}")
        res = out if out is not None and out.is_contiguous() else \
            torch.empty((T, H), dtype=torch.bfloat16, device=topk_idx.device)
        w = topk_weights.to(torch.float32).contiguous()
        st = torch.cuda.current_stream()
        hook = return_recv_hook and not zero_copy
        sub.g.ll_combine(ll.b, None if zero_copy else x.contiguous(), w, res,
                         hook=hook, stream=st)
        ev = EventOverlap(EventHandle() if async_finish else None)
        if not hook:
            if out is not None and res is not out:
                out.copy_(res)
                res = out
            return res, ev, _ready

        def recv_hook(_keep=(w, x)):
            ll.check()
            sub.g.ll_combine_hook(ll.b, torch.cuda.current_stream())
            if out is not None and res is not out:
                out.copy_(res)
        return (out if out is not None else res), ev, recv_hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle,
                            use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False,
                            out=None, combine_wait_recv_cost_stats=None):
        """DeepEP's low-latency combine: (combined_x [T, H] bf16, event,
        hook). Each token's rows come back as they are (bf16; use_logfmt
        changes nothing, the rows are exact) and are summed at home in
        fp32 from +0.0 in top-k order, each times its weight (an index -1
        skipped), rounded once to bf16."""
        torch = _torch()
        check_torch_deterministic()
        lk = getattr(handle[0], "_epd", None) if isinstance(handle, tuple) \
            and len(handle) == 5 else None
        if isinstance(lk, _LLKernel):
            return self._ll_kernel_combine(lk, x, topk_idx, topk_weights,
                                           zero_copy, async_finish,
                                           return_recv_hook, out)
        ll = self._ll_routing(handle)
        sub = ll.rt.sub
        if sub.g is None:
            raise ValueError("the handle's Buffer was destroyed")
        if zero_copy:
            if ll.zbuf is None:
                raise ValueError("zero_copy: call "
                                 "get_next_low_latency_combine_buffer first")
            x = ll.zbuf
        if tuple(x.shape) != ll.shape or x.dtype != torch.bfloat16:
            raise ValueError(f"low_latency_combine: x must be "
                             f"{list(ll.shape)} bf16, got {list(x.shape)} "
                             f"{x.dtype}")
        T, K = ll.T, ll.K
        for t, n in ((topk_idx, "topk_idx"), (topk_weights, "topk_weights")):
            if tuple(t.shape) != (T, K):
                raise ValueError(f"low_latency_combine: {n} must be [{T}, "
                                 f"{K}], got {list(t.shape)}")
        H = ll.shape[2]
        y = torch.empty((ll.order.numel(), H), dtype=torch.bfloat16,
                        device=x.device)
        y[ll.order] = x[ll.es, ll.pos]
        run = self._gpu_combine if sub.gpu else self._host_combine
        part, _, _ = run(sub, ll.rt, y, None, None, None, None, False, False)
        part = part.to(x.device).view(T, K, H)
        valid = (topk_idx >= 0).to(x.device)
        w = topk_weights.to(device=x.device, dtype=torch.float32)
        acc = torch.zeros((T, H), dtype=torch.float32, device=x.device)
        for k in range(K):
            term = part[:, k].float() * w[:, k:k + 1]
            acc = torch.where(valid[:, k:k + 1], acc + term, acc)
        res = acc.to(torch.bfloat16)
        if out is not None:
            out.copy_(res)
            res = out
        ev = EventOverlap(EventHandle() if async_finish else None)
        return res, ev, _ready

    def get_next_low_latency_combine_buffer(self, handle):
        """The tensor a zero_copy low_latency_combine of this handle reads
        (its x): [local experts, ranks x num_max, H] bf16."""
        torch = _torch()
        lk = getattr(handle[0], "_epd", None) if isinstance(handle, tuple) \
            and len(handle) == 5 else None
        if isinstance(lk, _LLKernel):
            lk.check()
            return lk.sub.g.ll_combine_buffer(lk.b)
        ll = self._ll_routing(handle)
        if ll.zbuf is None:
            ll.zbuf = torch.empty(ll.shape, dtype=torch.bfloat16,
                                  device=ll.order.device)
        return ll.zbuf

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank,
                                 hidden, num_experts):
        """Nothing to clean: epd's buffers carry no state between ops.
        In shrink mode, a barrier of the ranks not masked on the current
        stream (a rank that does not come is masked, as DeepEP's is)."""
        if not self.enable_shrink:
            return
        subs = self._ll_shrink_subs()
        st = _torch().cuda.current_stream()
        for s in subs:
            s.g.ll_barrier(stream=st)


def _ready():
    """The receive hook: the data is there already."""


class _LLKernel:
    """A low-latency handle of epd's kernels: the group, the buffer (0/1)
    its dispatch used and that buffer's generation (a later dispatch on
    the same buffer, the one after next, overwrites it), the dispatch's
    inputs (kept alive until the receive is done)."""
    __slots__ = ("sub", "b", "gen", "T", "K", "keep")

    def __init__(self, sub, b, gen, T, K, keep):
        self.sub, self.b, self.gen, self.T, self.K = sub, b, gen, T, K
        self.keep = keep

    def check(self):
        if self.sub.g is None:
            raise ValueError("the handle's Buffer was destroyed")
        if self.sub.ll_gen[self.b] != self.gen:
            raise ValueError("this low-latency handle's buffer was reused "
                             "by a later dispatch (results live until the "
                             "dispatch after next)")


class _LLRouting:
    """A low-latency handle's inside: the normal-mode routing of its
    pseudo tokens, and where each received row sits in the per-expert
    layout (order: rows by expert; es, pos: their expert and place)."""
    __slots__ = ("rt", "order", "es", "pos", "T", "K", "shape", "zbuf")

    def __init__(self, rt, order, es, pos, T, K, shape):
        self.rt, self.order, self.es, self.pos = rt, order, es, pos
        self.T, self.K, self.shape, self.zbuf = T, K, shape, None
