# SPDX-License-Identifier: MIT
"""Python binding of libep, the client library of epd (ctypes, no build step).

    import epd
    conn = epd.connect()                       # $EPD_SOCKET or /run/epd/epd.sock
    g = conn.join("moe0", world_size=8, ranks_per_node=8, rank=r,
                  num_experts=64, hidden=1024, max_tokens_per_rank=256, topk=8)
    g.barrier()
    res = g.dispatch(x, topk_idx, topk_weights)  # x: [T, H] bf16 (raw 16 bits)
    out = g.combine(y, res.handle, bias=None)     # y: [R, H] bf16
    g.leave(); conn.close()

Arrays are anything with the buffer protocol (bytes, bytearray, array.array,
numpy arrays, torch CPU tensors via .numpy()). bf16 is raw 16-bit storage:
pass uint16/int16 views (torch: t.view(torch.int16)). Outputs are bytearrays
(or numpy arrays when numpy is importable and as_numpy=True is passed).
Errors raise epd.Error with .code (negative, see ep/ep.h) and the daemon's
message. The library is found through $EP_LIBRARY, else libep.so.0.
"""
import ctypes
import ctypes.util
import json
import os

__all__ = ["connect", "Error", "Conn", "Group", "Handle", "DispatchResult",
           "BF16", "FP8", "status"]

BF16 = 1
FP8 = 2
JOIN_NOWAIT = 1
JOIN_CUDA = 2
DISPATCH_WEIGHTS = 1
COMBINE_BIAS = 1


def _load():
    path = os.environ.get("EP_LIBRARY") or ctypes.util.find_library("ep") \
        or "libep.so.0"
    return ctypes.CDLL(path)


_lib = _load()


class Error(Exception):
    """A libep error: .code is the negative code, str() the message."""

    def __init__(self, code, message):
        super().__init__(f"{_lib.ep_strerror(code).decode()}: {message}")
        self.code = code
        self.message = message


class _GroupConfig(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("world_size", ctypes.c_uint32),
                ("ranks_per_node", ctypes.c_uint32),
                ("rank", ctypes.c_uint32), ("num_experts", ctypes.c_uint32),
                ("hidden", ctypes.c_uint32),
                ("max_tokens_per_rank", ctypes.c_uint32),
                ("topk", ctypes.c_uint32), ("dtype", ctypes.c_int),
                ("timeout_ms", ctypes.c_uint32),
                ("cuda_device", ctypes.c_int)]


class Handle(ctypes.Structure):
    """A dispatch's routing (a plain value), for combine and cached dispatch."""
    _fields_ = [("group_id", ctypes.c_uint64), ("seq", ctypes.c_uint64),
                ("epoch", ctypes.c_uint32), ("num_tokens", ctypes.c_uint32),
                ("num_recv", ctypes.c_uint32)]


class _DispatchIn(ctypes.Structure):
    _fields_ = [("num_tokens", ctypes.c_uint32), ("hidden", ctypes.c_uint32),
                ("dtype", ctypes.c_int), ("topk", ctypes.c_uint32),
                ("x", ctypes.c_void_p), ("x_scales", ctypes.c_void_p),
                ("topk_idx", ctypes.c_void_p),
                ("topk_weights", ctypes.c_void_p)]


class _DispatchOut(ctypes.Structure):
    _fields_ = [("capacity", ctypes.c_uint64), ("recv_x", ctypes.c_void_p),
                ("recv_x_scales", ctypes.c_void_p),
                ("recv_topk_idx", ctypes.c_void_p),
                ("recv_topk_weights", ctypes.c_void_p),
                ("num_recv_tokens_per_expert", ctypes.c_void_p),
                ("num_recv", ctypes.c_uint32)]


class _Buffers(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in (
        "x", "x_scales", "topk_idx", "topk_weights", "recv_x",
        "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "recv_src",
        "num_recv_tokens_per_expert", "combine_y", "combine_bias",
        "combined")] + [("max_tokens", ctypes.c_uint32),
                        ("max_recv", ctypes.c_uint64)]


class _DeviceArray:
    """Device memory of the group, for torch.as_tensor (zero copy)."""

    def __init__(self, ptr, shape, typestr):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
            "version": 3, "strides": None}


_lib.ep_strerror.restype = ctypes.c_char_p
_lib.ep_errmsg.restype = ctypes.c_char_p
_lib.ep_connect.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
_lib.ep_close.argtypes = [ctypes.c_void_p]
_lib.ep_join.argtypes = [ctypes.c_void_p, ctypes.POINTER(_GroupConfig),
                         ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)]
for _f in ("ep_leave", "ep_barrier"):
    getattr(_lib, _f).argtypes = [ctypes.c_void_p]
_lib.ep_daemon_status.argtypes = [ctypes.c_void_p,
                                  ctypes.POINTER(ctypes.c_void_p)]
_lib.ep_get_dispatch_layout.argtypes = [ctypes.c_void_p] + \
    [ctypes.c_void_p, ctypes.c_uint32] + [ctypes.c_void_p] * 3
_lib.ep_dispatch.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DispatchIn),
                             ctypes.POINTER(Handle),
                             ctypes.POINTER(_DispatchOut),
                             ctypes.POINTER(Handle)]
_lib.ep_combine.argtypes = [ctypes.c_void_p, ctypes.POINTER(Handle),
                            ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32,
                            ctypes.c_void_p, ctypes.c_void_p]
_lib.ep_get_buffers.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Buffers)]
_lib.ep_barrier_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_lib.ep_dispatch_stream.argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                                    ctypes.c_uint, ctypes.POINTER(Handle),
                                    ctypes.c_void_p, ctypes.POINTER(Handle)]
_lib.ep_combine_stream.argtypes = [ctypes.c_void_p, ctypes.POINTER(Handle),
                                   ctypes.c_uint, ctypes.c_void_p]
_lib.ep_dispatch_recv_count_device.argtypes = [ctypes.c_void_p]
_lib.ep_dispatch_recv_count_device.restype = ctypes.c_uint64
_lib.ep_dispatch_recv_count.argtypes = [ctypes.c_void_p,
                                        ctypes.POINTER(Handle)]
for _f in ("ep_group_sync", "ep_group_error"):
    getattr(_lib, _f).argtypes = [ctypes.c_void_p]
_libc = ctypes.CDLL(None)
_libc.free.argtypes = [ctypes.c_void_p]


def _check(rc):
    if rc:
        raise Error(rc, _lib.ep_errmsg().decode(errors="replace"))


def _ptr(buf, nbytes, what):
    """Address of a readable buffer of at least nbytes (kept alive by caller)."""
    if buf is None:
        return None, None
    mv = memoryview(buf).cast("B")
    if mv.nbytes < nbytes:
        raise ValueError(f"{what}: {mv.nbytes} bytes, need {nbytes}")
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    keep = (ctypes.c_char * mv.nbytes).from_buffer(mv)
    return ctypes.addressof(keep), keep


def _out(nbytes, as_numpy, dtype):
    buf = bytearray(max(nbytes, 1))
    if as_numpy:
        import numpy
        return buf, numpy.frombuffer(buf, dtype=dtype)[:nbytes // numpy.dtype(dtype).itemsize]
    return buf, memoryview(buf)[:nbytes]


class DispatchResult:
    """recv_x [R, H] (bf16 raw or fp8 bytes), recv_x_scales [R, H/128] f32,
    recv_topk_idx [R, K] i64 (local experts, -1 elsewhere), recv_topk_weights
    [R, K] f32, num_recv_tokens_per_expert [E/world] i32, handle."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class Group:
    def __init__(self, conn, handle, cfg):
        self._conn, self._g, self.cfg = conn, handle, cfg

    @property
    def _per(self):
        return self.cfg["num_experts"] // self.cfg["world_size"]

    def barrier(self):
        _check(_lib.ep_barrier(self._g))

    def leave(self):
        if self._g:
            g, self._g = self._g, None
            _check(_lib.ep_leave(g))

    def get_dispatch_layout(self, topk_idx, num_tokens):
        W, E, K = self.cfg["world_size"], self.cfg["num_experts"], self.cfg["topk"]
        pi, k1 = _ptr(topk_idx, num_tokens * K * 8, "topk_idx")
        per_rank, per_expert = (ctypes.c_int32 * W)(), (ctypes.c_int32 * E)()
        in_rank = (ctypes.c_uint8 * max(num_tokens * W, 1))()
        _check(_lib.ep_get_dispatch_layout(self._g, pi, num_tokens, per_rank,
                                           per_expert, in_rank))
        return list(per_rank), list(per_expert), bytes(in_rank)[:num_tokens * W]

    def dispatch(self, x, topk_idx, num_tokens, topk_weights=None,
                 x_scales=None, handle=None, as_numpy=False):
        c = self.cfg
        H, K, W = c["hidden"], c["topk"], c["world_size"]
        fp8 = c["dtype"] == FP8
        elt, ns = (1, H // 128) if fp8 else (2, 0)
        px, k1 = _ptr(x, num_tokens * H * elt, "x")
        ps, k2 = _ptr(x_scales, num_tokens * ns * 4, "x_scales") if fp8 else (None, None)
        pi, k3 = _ptr(topk_idx, num_tokens * K * 8, "topk_idx") if handle is None else (None, None)
        pw, k4 = _ptr(topk_weights, num_tokens * K * 4, "topk_weights")
        din = _DispatchIn(num_tokens, H, c["dtype"], K, px, ps, pi, pw)
        cap = W * c["max_tokens_per_rank"]
        bx, rx = _out(cap * H * elt, as_numpy, "uint8" if fp8 else "uint16")
        bs, rs = _out(cap * ns * 4, as_numpy, "float32")
        bi, ri = _out(cap * K * 8, as_numpy, "int64")
        bw, rw = _out(cap * K * 4, as_numpy, "float32")
        be, re_ = _out(self._per * 4, as_numpy, "int32")
        addr = lambda b: ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b))
        dout = _DispatchOut(cap, addr(bx), addr(bs) if ns else None, addr(bi),
                            addr(bw), addr(be), 0)
        h = Handle()
        _check(_lib.ep_dispatch(self._g, ctypes.byref(din),
                                ctypes.byref(handle) if handle else None,
                                ctypes.byref(dout), ctypes.byref(h)))
        R = dout.num_recv
        cut = lambda a, n: a[:n]
        return DispatchResult(
            num_recv=R, handle=h,
            recv_x=cut(rx, R * H * elt if not as_numpy else R * H),
            recv_x_scales=cut(rs, R * ns * 4 if not as_numpy else R * ns),
            recv_topk_idx=cut(ri, R * K * 8 if not as_numpy else R * K),
            recv_topk_weights=cut(rw, R * K * 4 if not as_numpy else R * K),
            num_recv_tokens_per_expert=re_)

    # ---- GPU ranks (joined with cuda_device): stream-ordered, zero copy ----

    _TYPES = {"bf16": ("<i2", 2), "fp8": ("|u1", 1), "int64": ("<i8", 8),
              "float32": ("<f4", 4), "int32": ("<i4", 4)}

    def tensor(self, field, shape, dtype):
        """A torch tensor over a field of this rank's device buffers (names
        as in struct ep_buffers: x, topk_idx, recv_x, combine_y, ...);
        bf16 fields come back as torch.bfloat16."""
        import torch
        b = _Buffers()
        _check(_lib.ep_get_buffers(self._g, ctypes.byref(b)))
        ptr = getattr(b, field)
        if not ptr:
            raise ValueError(f"no field {field} in this group")
        typestr, _ = self._TYPES[dtype]
        t = torch.as_tensor(_DeviceArray(ptr, shape, typestr), device="cuda")
        return t.view(torch.bfloat16) if dtype == "bf16" else t

    @staticmethod
    def _stream(stream):
        if stream is None:
            return None  # the legacy default stream
        return stream if isinstance(stream, int) else stream.cuda_stream

    def barrier_stream(self, stream=None):
        _check(_lib.ep_barrier_stream(self._g, self._stream(stream)))

    def dispatch_stream(self, num_tokens, stream=None, weights=False,
                        handle=None):
        """Enqueue a dispatch of the first num_tokens rows of the x,
        topk_idx (and topk_weights) buffers; returns its Handle at once."""
        h = Handle()
        _check(_lib.ep_dispatch_stream(
            self._g, num_tokens, DISPATCH_WEIGHTS if weights else 0,
            ctypes.byref(handle) if handle else None, self._stream(stream),
            ctypes.byref(h)))
        return h

    def combine_stream(self, handle, stream=None, bias=False):
        _check(_lib.ep_combine_stream(self._g, ctypes.byref(handle),
                                      COMBINE_BIAS if bias else 0,
                                      self._stream(stream)))

    def recv_count(self, handle):
        """Rows received by that dispatch (the CPU waits for it)."""
        _check(_lib.ep_dispatch_recv_count(self._g, ctypes.byref(handle)))
        return handle.num_recv

    def recv_count_device(self):
        """Device address of a uint32: the rows received by the latest
        stream-ordered dispatch, written in stream order (no CPU wait); 0
        for a host group."""
        return _lib.ep_dispatch_recv_count_device(self._g)

    def sync(self):
        _check(_lib.ep_group_sync(self._g))

    def error(self):
        rc = _lib.ep_group_error(self._g)
        return Error(rc, _lib.ep_errmsg().decode()) if rc else None

    def combine(self, y, handle, bias=None, as_numpy=False):
        H = self.cfg["hidden"]
        py, k1 = _ptr(y, handle.num_recv * H * 2, "y")
        pb, k2 = _ptr(bias, handle.num_tokens * H * 2, "bias")
        bo, ro = _out(handle.num_tokens * H * 2, as_numpy, "uint16")
        addr = ctypes.addressof((ctypes.c_char * len(bo)).from_buffer(bo))
        _check(_lib.ep_combine(self._g, ctypes.byref(handle), py,
                               handle.num_recv, H, pb, addr))
        return ro


class Conn:
    def __init__(self, socket=None):
        c = ctypes.c_void_p()
        _check(_lib.ep_connect(socket.encode() if socket else None,
                               ctypes.byref(c)))
        self._c = c

    def join(self, name, world_size, ranks_per_node, rank, num_experts,
             hidden, max_tokens_per_rank, topk, dtype=BF16, timeout_ms=0,
             wait=True, cuda_device=None):
        """cuda_device: a GPU rank on that device (its buffers in GPU
        memory; use the *_stream methods and Group.tensor)."""
        cfg = dict(name=name, world_size=world_size,
                   ranks_per_node=ranks_per_node, rank=rank,
                   num_experts=num_experts, hidden=hidden,
                   max_tokens_per_rank=max_tokens_per_rank, topk=topk,
                   dtype=dtype, timeout_ms=timeout_ms)
        gc = _GroupConfig(name.encode(), world_size, ranks_per_node, rank,
                          num_experts, hidden, max_tokens_per_rank, topk,
                          dtype, timeout_ms,
                          0 if cuda_device is None else cuda_device)
        flags = (0 if wait else JOIN_NOWAIT) | \
            (JOIN_CUDA if cuda_device is not None else 0)
        g = ctypes.c_void_p()
        _check(_lib.ep_join(self._c, ctypes.byref(gc), flags,
                            ctypes.byref(g)))
        return Group(self, g, cfg)

    def status(self):
        p = ctypes.c_void_p()
        _check(_lib.ep_daemon_status(self._c, ctypes.byref(p)))
        try:
            return json.loads(ctypes.string_at(p).decode())
        finally:
            _libc.free(p)

    def close(self):
        if self._c:
            _lib.ep_close(self._c)
            self._c = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


def connect(socket=None):
    return Conn(socket)


def status(socket=None):
    with connect(socket) as c:
        return c.status()
