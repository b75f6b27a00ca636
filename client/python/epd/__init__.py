# SPDX-License-Identifier: MIT
"""Python binding of libep, the client library of epd (ctypes, no build step).

One rank of a one-rank group, end to end (with epd running; the socket is
$EPD_SOCKET or the default path):

>>> import numpy as np
>>> import epd
>>> def bf16(a):   # float32 -> bf16 bits (these values are exact in bf16)
...     return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)
>>> with epd.connect() as conn:
...     with conn.join("doctest", world_size=1, ranks_per_node=1, rank=0,
...                    num_experts=4, hidden=128, max_tokens_per_rank=8,
...                    topk=2) as g:
...         x = bf16(np.arange(3 * 128).reshape(3, 128) / 4)
...         topk_idx = np.array([[0, 1], [2, -1], [3, 0]], dtype=np.int64)
...         res = g.dispatch(x, topk_idx, num_tokens=3, as_numpy=True)
...         out = g.combine(res.recv_x, res.handle, as_numpy=True)
>>> res.recv_x.shape, res.recv_topk_idx.shape, out.shape
((3, 128), (3, 2), (3, 128))
>>> bool((out == x).all())   # each token went to one rank: it comes back
True

Arrays are anything with the buffer protocol (bytes, bytearray,
array.array, numpy arrays, torch CPU tensors via .numpy()). bf16 is raw
16-bit storage: pass uint16/int16 views (torch: t.view(torch.int16)).
Outputs are bytearrays, or with as_numpy=True numpy arrays shaped
[rows, hidden] (bf16 as uint16 bits, fp8 as uint8), [rows, topk], ...
A rank with no tokens passes num_tokens=0 and empty (or None) arrays.
Errors raise epd.Error with .code (negative, see ep/ep.h) and the daemon's
message. Leaving a group or closing its connection (in either order, or by
leaving their with blocks) is always safe; a group used after its
connection closed raises epd.Error (EP_EINVAL).

The library: $EP_LIBRARY if set, else the libdir this package was installed
with (make install), else the dynamic linker's search path.
"""
import ctypes
import errno
import json
import os

__all__ = ["connect", "Error", "Conn", "Group", "Handle", "DispatchResult",
           "BF16", "FP8", "status"]

BF16 = 1
FP8 = 2
EINVAL = -errno.EINVAL  # EP_EINVAL (ep/ep.h)
ETOOBIG = -1010  # EP_ETOOBIG: more tokens than the group holds
EUNSUPPORTED = -1013  # EP_EUNSUPPORTED
EMISMATCH = -1003  # EP_EMISMATCH: ranks disagree (join or operation)
JOIN_NOWAIT = 1
JOIN_CUDA = 2
DISPATCH_WEIGHTS = 1
COMBINE_BIAS = 1
COMBINE_WEIGHTS = 0x2  # EP_COMBINE_WEIGHTS
COMBINE_BIAS2 = 0x4  # EP_COMBINE_BIAS2
LL_HOOK = 0x1  # EP_LL_HOOK: the receive half left to the hook
LL_ZERO_COPY = 0x2  # EP_LL_ZERO_COPY: rows already in the combine buffer
LL_FP8 = 0x4  # EP_LL_FP8: the dispatch casts the rows to fp8
LL_ROUND_SCALE = 0x8  # EP_LL_ROUND_SCALE: scales rounded up to 2^n
LL_UE8M0 = 0x10  # EP_LL_UE8M0: the scales' exponent bytes, 4 to an int32


def LL_TOPK(k):
    """EP_LL_TOPK(k): a dispatch's topk_idx has k columns (at most the
    group's topk; the kernels only)."""
    return k << 8


# The libep ABI this binding's structs and calls are written for
# (EP_ABI_VERSION of ep/ep.h): the library is libep.so.<_ABI>, and one
# that says otherwise (ep_abi_version) is refused at import.
_ABI = 1
_SONAME = f"libep.so.{_ABI}"


def _candidates():
    env = os.environ.get("EP_LIBRARY")
    if env:
        return [env]
    out = []
    try:  # written by make install: where libep went
        from . import _config
        out.append(os.path.join(_config.LIBDIR, _config.SONAME))
    except (ImportError, AttributeError):
        pass
    out.append(_SONAME)
    out += [os.path.join(d, _SONAME) for d in
            ("/usr/local/lib", "/usr/lib", "/usr/lib/x86_64-linux-gnu",
             "/usr/lib/aarch64-linux-gnu")]
    return out


def _load():
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        abi = getattr(lib, "ep_abi_version", None)
        if abi is None:
            errors.append(f"{path}: no ep_abi_version (a libep older "
                          f"than ABI {_ABI})")
            continue
        abi.restype = ctypes.c_uint
        abi.argtypes = []
        if abi() != _ABI:
            errors.append(f"{path}: libep ABI {abi()}, this binding is "
                          f"written for ABI {_ABI}")
            continue
        return lib
    raise ImportError("epd: cannot load libep (set EP_LIBRARY to its "
                      "path): " + "; ".join(errors))


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
                        ("max_recv", ctypes.c_uint64),
                        ("combine_topk_weights", ctypes.c_void_p),
                        ("combined_topk_weights", ctypes.c_void_p),
                        ("rank_prefix_matrix", ctypes.c_void_p),
                        ("combine_bias2", ctypes.c_void_p)]


class _CombineIn(ctypes.Structure):
    _fields_ = [("y", ctypes.c_void_p), ("num_rows", ctypes.c_uint32),
                ("hidden", ctypes.c_uint32), ("bias", ctypes.c_void_p),
                ("topk_weights", ctypes.c_void_p),
                ("bias2", ctypes.c_void_p)]


class _CombineOut(ctypes.Structure):
    _fields_ = [("out", ctypes.c_void_p),
                ("combined_topk_weights", ctypes.c_void_p)]


class _LLRecv(ctypes.Structure):
    _fields_ = [("buffer", ctypes.c_uint32), ("recv_x", ctypes.c_void_p),
                ("recv_count", ctypes.c_void_p),
                ("layout_range", ctypes.c_void_p),
                ("src_info", ctypes.c_void_p),
                ("local_experts", ctypes.c_uint32),
                ("max_recv", ctypes.c_uint32),
                ("recv_scales", ctypes.c_void_p)]


class _DeviceArray:
    """Device memory of the group, for torch.as_tensor (zero copy; the
    tensor keeps this object alive)."""

    def __init__(self, ptr=0, shape=(0,), typestr="|u1"):
        self._set(ptr, shape, typestr)

    def _set(self, ptr, shape, typestr):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
            "version": 3, "strides": None}


_lib.ep_strerror.restype = ctypes.c_char_p
_lib.ep_errmsg.restype = ctypes.c_char_p
class _JoinOpts(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t),
                ("nodes", ctypes.POINTER(ctypes.c_char_p)),
                ("recv_rows", ctypes.c_uint32),
                ("secret", ctypes.c_char_p),
                ("secret_len", ctypes.c_size_t)]


_lib.ep_connect.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
_lib.ep_conn_node.argtypes = [ctypes.c_void_p]
_lib.ep_conn_node.restype = ctypes.c_char_p
_lib.ep_join_ex.argtypes = [ctypes.c_void_p, ctypes.POINTER(_GroupConfig),
                            ctypes.POINTER(_JoinOpts), ctypes.c_uint,
                            ctypes.POINTER(ctypes.c_void_p)]
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
_lib.ep_combine_ex.argtypes = [ctypes.c_void_p, ctypes.POINTER(Handle),
                               ctypes.POINTER(_CombineIn),
                               ctypes.POINTER(_CombineOut)]
_lib.ep_get_buffers_sized.argtypes = [ctypes.c_void_p,
                                      ctypes.POINTER(_Buffers),
                                      ctypes.c_size_t]
_lib.ep_barrier_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_lib.ep_dispatch_stream.argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                                    ctypes.c_uint, ctypes.POINTER(Handle),
                                    ctypes.c_void_p, ctypes.POINTER(Handle)]
_lib.ep_combine_stream.argtypes = [ctypes.c_void_p, ctypes.POINTER(Handle),
                                   ctypes.c_uint, ctypes.c_void_p]
_lib.ep_handle_release.argtypes = [ctypes.c_void_p, ctypes.POINTER(Handle)]
_lib.ep_handle_release_async.argtypes = [ctypes.c_void_p,
                                         ctypes.POINTER(Handle)]
_lib.ep_mem_register.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_void_p)]
_lib.ep_mem_covers.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_size_t]
_lib.ep_mem_range.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                              ctypes.POINTER(ctypes.c_size_t)]
_lib.ep_mem_range.restype = None
_lib.ep_mem_deregister.argtypes = [ctypes.c_void_p]
_lib.ep_dispatch_stream_reg.argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                                        ctypes.c_uint, ctypes.POINTER(Handle),
                                        ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.POINTER(Handle)]
_lib.ep_combine_stream_reg.argtypes = [ctypes.c_void_p, ctypes.POINTER(Handle),
                                       ctypes.c_uint, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_uint32,
                                       ctypes.c_void_p]


class _CombineMem(ctypes.Structure):
    _fields_ = [("y_reg", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("rows", ctypes.c_uint32), ("out_reg", ctypes.c_void_p),
                ("out", ctypes.c_void_p)]


_lib.ep_combine_stream_mem.argtypes = [ctypes.c_void_p, ctypes.POINTER(Handle),
                                       ctypes.c_uint,
                                       ctypes.POINTER(_CombineMem),
                                       ctypes.c_void_p]
_lib.ep_group_recv_areas.argtypes = [ctypes.c_void_p]
_lib.ep_group_recv_areas.restype = ctypes.c_uint32
_lib.ep_recv_area.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
_lib.ep_recv_area.restype = ctypes.c_void_p
_lib.ep_dispatch_recv_count_device.argtypes = [ctypes.c_void_p]
_lib.ep_dispatch_recv_count_device.restype = ctypes.c_uint64
_lib.ep_dispatch_recv_count.argtypes = [ctypes.c_void_p,
                                        ctypes.POINTER(Handle)]
_lib.ep_dispatch_recv_expert_counts.argtypes = [
    ctypes.c_void_p, ctypes.POINTER(Handle), ctypes.POINTER(ctypes.c_int32),
    ctypes.c_uint32]
for _f in ("ep_group_sync", "ep_group_error", "ep_ll_error"):
    getattr(_lib, _f).argtypes = [ctypes.c_void_p]
_lib.ep_ll_dispatch.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_uint32,
                                ctypes.c_uint, ctypes.c_void_p,
                                ctypes.POINTER(_LLRecv)]
for _f in ("ep_ll_dispatch_hook", "ep_ll_combine_hook"):
    getattr(_lib, _f).argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                                  ctypes.c_void_p]
_lib.ep_ll_combine.argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                               ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_uint,
                               ctypes.c_void_p]
_lib.ep_ll_combine_buffer.argtypes = [ctypes.c_void_p, ctypes.c_uint32,
                                      ctypes.POINTER(ctypes.c_void_p)]
_lib.ep_ll_shrink.argtypes = [ctypes.c_void_p]
_lib.ep_ll_mask.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                            ctypes.c_void_p]
_lib.ep_ll_mask_query.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_void_p]
for _f in ("ep_ll_mask_clean", "ep_ll_barrier"):
    getattr(_lib, _f).argtypes = [ctypes.c_void_p, ctypes.c_void_p]


class _Copy(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_void_p), ("src", ctypes.c_void_p),
                ("count", ctypes.c_uint64), ("elt", ctypes.c_uint32),
                ("dst_stride", ctypes.c_uint32),
                ("src_stride", ctypes.c_uint32)]


COPIES_MAX = 16
_lib.ep_stream_copies.argtypes = [ctypes.POINTER(_Copy), ctypes.c_uint,
                                  ctypes.c_void_p]
_libc = ctypes.CDLL(None)
_libc.free.argtypes = [ctypes.c_void_p]


def _check(rc):
    if rc:
        raise Error(rc, _lib.ep_errmsg().decode(errors="replace"))


def _ptr(buf, nbytes, what):
    """Address of a readable buffer of at least nbytes (kept alive by caller).
    None for nothing to pass (no buffer, or zero bytes wanted)."""
    if buf is None or nbytes == 0:
        return None, None
    mv = memoryview(buf)
    if not mv.c_contiguous:
        import numpy
        mv = memoryview(numpy.ascontiguousarray(buf))
    mv = mv.cast("B")
    if mv.nbytes < nbytes:
        raise ValueError(f"{what}: {mv.nbytes} bytes, need {nbytes}")
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    keep = (ctypes.c_char * mv.nbytes).from_buffer(mv)
    return ctypes.addressof(keep), keep


def _out(nbytes, as_numpy, dtype):
    """An output buffer of nbytes (at least one element, so that it has an
    address) and its view: bytes, or a flat numpy array of dtype."""
    if as_numpy:
        import numpy
        size = numpy.dtype(dtype).itemsize
        buf = bytearray(max(nbytes, size))
        return buf, numpy.frombuffer(buf, dtype=dtype)[:nbytes // size]
    buf = bytearray(max(nbytes, 1))
    return buf, memoryview(buf)[:nbytes]


def _closed():
    return Error(EINVAL, "the group was left, or its connection closed")


class DispatchResult:
    """recv_x [R, H] (bf16 raw or fp8 bytes), recv_x_scales [R, H/128] f32,
    recv_topk_idx [R, K] i64 (local experts, -1 elsewhere), recv_topk_weights
    [R, K] f32, num_recv_tokens_per_expert [E/world] i32, handle."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class MemRegion:
    """Registered device memory of a Group (Group.mem_register): base and
    nbytes are the allocations' extent; covers(ptr, n) says whether a range
    lies inside and is still the memory registered."""

    def __init__(self, group, p):
        self._group, self._p = group, p
        b, n = ctypes.c_uint64(), ctypes.c_size_t()
        _lib.ep_mem_range(p, ctypes.byref(b), ctypes.byref(n))
        self.base, self.nbytes = b.value, n.value

    def covers(self, ptr, nbytes):
        if not self._p:
            return False
        rc = _lib.ep_mem_covers(self._p, ptr, nbytes)
        if rc < 0:
            _check(rc)
        return rc == 1

    def deregister(self):
        """Idempotent; the daemon unmaps it once no combine reads it."""
        if self._p:
            p, self._p = self._p, None
            self._group._mregs.discard(self)
            _check(_lib.ep_mem_deregister(p))


class Group:
    """A joined group. Its methods raise epd.Error after leave() or after
    its connection closed (libep freed it then)."""

    def __init__(self, conn, handle, cfg):
        self._conn, self._handle, self.cfg = conn, handle, cfg
        self._mregs = set()

    @property
    def _g(self):
        if not self._handle:
            raise _closed()
        return self._handle

    @property
    def _per(self):
        return self.cfg["num_experts"] // self.cfg["world_size"]

    def barrier(self):
        _check(_lib.ep_barrier(self._g))

    def leave(self):
        """Leave the group (idempotent; a no-op once the connection
        closed, which left it)."""
        if self._handle:
            for r in list(self._mregs):  # ep_leave frees them
                r._p = None
            self._mregs.clear()
            g, self._handle = self._handle, None
            self._conn._groups.discard(self)
            _check(_lib.ep_leave(g))

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.leave()

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
        cap = c.get("recv_rows") or W * c["max_tokens_per_rank"]
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
        if as_numpy:  # [rows, ...], as the buffers are laid out
            return DispatchResult(
                num_recv=R, handle=h,
                recv_x=rx[:R * H].reshape(R, H),
                recv_x_scales=rs[:R * ns].reshape(R, ns),
                recv_topk_idx=ri[:R * K].reshape(R, K),
                recv_topk_weights=rw[:R * K].reshape(R, K),
                num_recv_tokens_per_expert=re_)
        return DispatchResult(
            num_recv=R, handle=h, recv_x=rx[:R * H * elt],
            recv_x_scales=rs[:R * ns * 4], recv_topk_idx=ri[:R * K * 8],
            recv_topk_weights=rw[:R * K * 4], num_recv_tokens_per_expert=re_)

    # ---- GPU ranks (joined with cuda_device): stream-ordered, zero copy ----

    _TYPES = {"bf16": ("<i2", 2), "fp8": ("|u1", 1), "int64": ("<i8", 8),
              "float32": ("<f4", 4), "int32": ("<i4", 4)}

    def tensor(self, field, shape, dtype, area=0, owner=None):
        """A torch tensor over a field of this rank's device buffers (names
        as in struct ep_buffers: x, topk_idx, recv_x, combine_y, ...);
        bf16 fields come back as torch.bfloat16. area: recv_x's receive
        area (see recv_areas). owner: an object of class _DeviceArray's
        kind to carry the memory (the tensor keeps it alive), else one is
        made."""
        import torch
        typestr, _ = self._TYPES[dtype]
        if area:
            if field != "recv_x":
                raise ValueError("only recv_x has receive areas")
            ptr = _lib.ep_recv_area(self._g, area)
            if not ptr:
                raise ValueError(f"no receive area {area} in this group")
        else:
            ptr = self._field_ptr(field)
        a = owner if owner is not None else _DeviceArray()
        a._set(ptr, shape, typestr)
        t = torch.as_tensor(a, device="cuda")
        return t.view(torch.bfloat16) if dtype == "bf16" else t

    @property
    def recv_areas(self):
        """Receive areas of recv_x (Conn.join's recv_areas)."""
        return _lib.ep_group_recv_areas(self._g)

    def _field_ptr(self, field):
        b = _Buffers()
        _check(_lib.ep_get_buffers_sized(self._g, ctypes.byref(b),
                                         ctypes.sizeof(b)))
        ptr = getattr(b, field)
        if not ptr:
            raise ValueError(f"no field {field} in this group")
        return ptr

    def host_field(self, field, count, dtype):
        """A copy of the first count elements of a field of a host
        group's buffer (numpy array of dtype "int32", "float32", ...), as
        the latest op left it: e.g. recv_src ([R, 2] source rank and
        token) or rank_prefix_matrix ([W, W]) after a dispatch."""
        import numpy
        if self._per_gpu:
            raise ValueError("host_field: a GPU group (use tensor())")
        dt = numpy.dtype(dtype)
        raw = ctypes.string_at(self._field_ptr(field), count * dt.itemsize)
        return numpy.frombuffer(raw, dtype=dt).copy()

    def rank_prefix_matrix(self):
        """DeepEP's rank_prefix_matrix of the latest dispatch: [W, W]
        int32, entry [s][d] the rows rank d received from ranks 0..s (a
        numpy copy for a host group, a view on the device for a GPU
        group: read it in stream order after the dispatch)."""
        W = self.cfg["world_size"]
        if self._per_gpu:
            return self.tensor("rank_prefix_matrix", (W, W), "int32")
        return self.host_field("rank_prefix_matrix", W * W,
                               "int32").reshape(W, W)

    @property
    def _per_gpu(self):
        return self.cfg.get("cuda_device") is not None

    @staticmethod
    def _stream(stream):
        if stream is None:
            return None  # the legacy default stream
        return stream if isinstance(stream, int) else stream.cuda_stream

    def barrier_stream(self, stream=None):
        _check(_lib.ep_barrier_stream(self._g, self._stream(stream)))

    def dispatch_stream(self, num_tokens, stream=None, weights=False,
                        handle=None, area=0, region=None, ptr=0):
        """Enqueue a dispatch of the first num_tokens rows of the x,
        topk_idx (and topk_weights) buffers; returns its Handle at once.
        area: the receive area this rank's rows go to. region (a
        MemRegion): x's rows are read at device address ptr inside it
        instead of from the x buffer."""
        if not 0 <= area < 256:
            raise ValueError(f"receive area {area} out of range")
        h = Handle()
        fl = (DISPATCH_WEIGHTS if weights else 0) | int(area) << 24
        cached = ctypes.byref(handle) if handle else None
        if region is None:
            _check(_lib.ep_dispatch_stream(self._g, num_tokens, fl, cached,
                                           self._stream(stream),
                                           ctypes.byref(h)))
        else:
            _check(_lib.ep_dispatch_stream_reg(self._g, num_tokens, fl,
                                               cached, region._p, ptr,
                                               self._stream(stream),
                                               ctypes.byref(h)))
        return h

    def combine_stream(self, handle, stream=None, bias=False,
                       weights=False, bias2=False):
        """Enqueue a combine of combine_y (and combine_bias with bias,
        combine_bias2 with bias2, DeepEP's second bias); with weights,
        combine_topk_weights are summed into combined_topk_weights too."""
        _check(_lib.ep_combine_stream(self._g, ctypes.byref(handle),
                                      (COMBINE_BIAS if bias else 0) |
                                      (COMBINE_BIAS2 if bias2 else 0) |
                                      (COMBINE_WEIGHTS if weights else 0),
                                      self._stream(stream)))

    def mem_register(self, ptr, nbytes):
        """Register this rank's device memory [ptr, ptr + nbytes) (made
        with the CUDA virtual memory API and POSIX-descriptor handles, as
        PyTorch's expandable segments): a MemRegion, widened to the
        allocations under the range."""
        mr = ctypes.c_void_p()
        _check(_lib.ep_mem_register(self._g, ptr, nbytes, ctypes.byref(mr)))
        r = MemRegion(self, mr.value)
        self._mregs.add(r)
        return r

    def combine_stream_reg(self, handle, region, ptr, rows, stream=None,
                           bias=False, weights=False, bias2=False):
        """combine_stream with this rank's rows read at device address ptr
        inside region (a MemRegion), not from combine_y."""
        _check(_lib.ep_combine_stream_reg(
            self._g, ctypes.byref(handle),
            (COMBINE_BIAS if bias else 0) | (COMBINE_BIAS2 if bias2 else 0) |
            (COMBINE_WEIGHTS if weights else 0), region._p, ptr, rows,
            self._stream(stream)))

    def combine_stream_mem(self, handle, region=None, ptr=None, rows=0,
                           out_region=None, out_ptr=None, stream=None,
                           bias=False, weights=False, bias2=False):
        """combine_stream with this rank's rows read at ptr inside region
        (None: from combine_y) and the combined rows (the handle's
        num_tokens) written at out_ptr inside out_region (None: into
        combined), both MemRegions of this group."""
        m = _CombineMem(region._p if region is not None else None,
                        ptr if region is not None else None, rows,
                        out_region._p if out_region is not None else None,
                        out_ptr if out_region is not None else None)
        _check(_lib.ep_combine_stream_mem(
            self._g, ctypes.byref(handle),
            (COMBINE_BIAS if bias else 0) | (COMBINE_BIAS2 if bias2 else 0) |
            (COMBINE_WEIGHTS if weights else 0), ctypes.byref(m),
            self._stream(stream)))

    def release(self, handle, wait=True):
        """This rank is done with the handle (its combine and cached
        dispatches ran, or, on a GPU rank, were enqueued): the daemon frees
        the routing once every local rank released it. wait=False (GPU
        ranks): no answer awaited; a refusal becomes the connection's
        asynchronous error (ep_handle_release_async)."""
        f = _lib.ep_handle_release if wait else _lib.ep_handle_release_async
        _check(f(self._g, ctypes.byref(handle)))

    def recv_count(self, handle):
        """Rows received by that dispatch: the CPU waits until its routing
        is known (on a GPU rank the rows follow in stream order)."""
        _check(_lib.ep_dispatch_recv_count(self._g, ctypes.byref(handle)))
        return handle.num_recv

    def recv_expert_counts(self, handle):
        """Rows received per local expert (a list) by the latest dispatch,
        the fresh one of handle; a GPU rank's CPU waits as for
        recv_count."""
        n = self._per
        out = (ctypes.c_int32 * n)()
        _check(_lib.ep_dispatch_recv_expert_counts(
            self._g, ctypes.byref(handle), out, n))
        return list(out)

    def recv_count_device(self):
        """Device address of a uint32: the rows received by the latest
        stream-ordered dispatch, written in stream order (no CPU wait); 0
        for a host group."""
        return _lib.ep_dispatch_recv_count_device(self._g)

    def sync(self):
        _check(_lib.ep_group_sync(self._g))

    # ---- low-latency mode (ep.h, ep_ll_*): GPU ranks (one node or
    # several) with torch tensors on the rank's stream; host ranks (one
    # node or several) with numpy arrays (or CPU tensors), each call
    # complete on return ----

    def _ll_view(self, ptr, shape, typestr):
        if not self._per_gpu:
            # libep's host memory: a numpy copy (a view would outlive the
            # memory once the group is left: Python stays memory-safe)
            import numpy
            dt = numpy.dtype("<u2" if typestr == "<i2" else typestr)
            n = 1
            for d in shape:
                n *= d
            raw = (ctypes.c_char * max(n * dt.itemsize, 1)).from_address(ptr)
            return numpy.frombuffer(raw, dtype=dt,
                                    count=n).reshape(shape).copy()
        import torch
        t = torch.as_tensor(_DeviceArray(ptr, shape, typestr),
                            device="cuda")
        return t.view(torch.bfloat16) if typestr == "<i2" else t

    @staticmethod
    def _ll_in(a):
        """(address or None, what keeps it alive) of an input: a torch
        tensor (contiguous), or anything numpy takes."""
        if a is None:
            return None, None
        if hasattr(a, "data_ptr"):
            return (a.data_ptr() if a.numel() else None), a
        import numpy
        a = numpy.ascontiguousarray(a)
        return (a.ctypes.data if a.size else None), a

    @staticmethod
    def _ll_out(a):
        """Address of an output written in place: a torch tensor, or a
        writable C-contiguous numpy array."""
        if hasattr(a, "data_ptr"):
            return a.data_ptr() if a.numel() else None
        import numpy
        if not isinstance(a, numpy.ndarray) or not a.flags.c_contiguous \
                or not a.flags.writeable:
            raise ValueError("out: a writable C-contiguous numpy array")
        return a.ctypes.data if a.size else None

    def ll_dispatch(self, x, topk_idx, num_tokens=None, hook=False,
                    stream=None, fp8=False, round_scale=False, ue8m0=False):
        """Low-latency dispatch. x [T, hidden] bf16 (a host rank: uint16
        bits), topk_idx [T, topk] int64, contiguous: torch tensors on the
        GPU for a GPU rank (the op goes on the stream), numpy arrays for a
        host rank (done on return). Returns a dict: buffer (0/1, for
        ll_combine and the hooks), recv_x [El, W*max_tokens, hidden] bf16,
        recv_count [El] int32, layout_range [El, W] int64, src_info
        [El, W*max_tokens] int32: views of this rank's low-latency memory
        (torch on the GPU, valid until the dispatch after next), or numpy
        copies on the host. hook: ll_dispatch_hook(buffer) completes it later.
        fp8: recv_x is float8_e4m3fn (uint8 where torch has no fp8, and on
        the host) and recv_scales its per-128 scales,
        [El, W*max_tokens, hidden/128] float32 column-major in the last
        two (round_scale: powers of two; ue8m0: [El, W*max_tokens,
        hidden/512] int32 of exponent bytes)."""
        T = (x.shape[0] if num_tokens is None else num_tokens)
        f = (LL_HOOK if hook else 0) | (LL_FP8 if fp8 else 0) | \
            (LL_ROUND_SCALE if round_scale else 0) | \
            (LL_UE8M0 if ue8m0 else 0)
        K = topk_idx.shape[1] if len(topk_idx.shape) == 2 else 0
        if K and K != self.cfg["topk"]:
            f |= LL_TOPK(K)  # fewer columns than the group's top-k
        r = _LLRecv()
        px, kx = self._ll_in(x if T else None)
        pt, kt = self._ll_in(topk_idx if T else None)
        rc = _lib.ep_ll_dispatch(self._g, px, pt, T, f,
                                 self._stream(stream), ctypes.byref(r))
        _check(rc)
        El, R, H = r.local_experts, r.max_recv, self.cfg["hidden"]
        W = self.cfg["world_size"]
        if fp8:
            rx = self._ll_view(r.recv_x, (El, R, H), "|u1")
            if self._per_gpu:
                import torch
                if hasattr(torch, "float8_e4m3fn"):
                    rx = rx.view(torch.float8_e4m3fn)
            G = H // 512 if ue8m0 else H // 128
            sc = self._ll_view(r.recv_scales, (El, G, R),
                               "<i4" if ue8m0 else "<f4")
            sc = sc.transpose(1, 2) if self._per_gpu else \
                sc.transpose(0, 2, 1)
        else:
            rx, sc = self._ll_view(r.recv_x, (El, R, H), "<i2"), None
        return {"buffer": r.buffer, "recv_x": rx, "recv_scales": sc,
                "recv_count": self._ll_view(r.recv_count, (El,), "<i4"),
                "layout_range": self._ll_view(r.layout_range, (El, W),
                                              "<i8"),
                "src_info": self._ll_view(r.src_info, (El, R), "<i4")}

    def ll_dispatch_hook(self, buffer, stream=None):
        _check(_lib.ep_ll_dispatch_hook(self._g, buffer,
                                        self._stream(stream)))

    def ll_combine(self, buffer, expert_out, weights, out, hook=False,
                   stream=None):
        """Low-latency combine of buffer's dispatch into out [T, hidden]
        bf16 (weights [T, topk] float32); expert_out None: zero copy (the
        rows are in ll_combine_buffer(buffer)). On a host rank: numpy
        arrays, out written in place (uint16 bf16 bits)."""
        f = (LL_ZERO_COPY if expert_out is None else 0) | \
            (LL_HOOK if hook else 0)
        if expert_out is None and not self._per_gpu:
            # a host rank's combine buffer is this object's array
            # (ll_combine_buffer): into libep's, then zero copy
            p = ctypes.c_void_p()
            _check(_lib.ep_ll_combine_buffer(self._g, buffer,
                                             ctypes.byref(p)))
            a = self._ll_cx(buffer)
            ctypes.memmove(p.value, a.ctypes.data, a.nbytes)
        pe, ke = self._ll_in(expert_out)
        pw, kw = self._ll_in(weights)
        _check(_lib.ep_ll_combine(self._g, buffer, pe, pw,
                                  self._ll_out(out), f,
                                  self._stream(stream)))

    def ll_combine_hook(self, buffer, stream=None):
        _check(_lib.ep_ll_combine_hook(self._g, buffer,
                                       self._stream(stream)))

    def ll_combine_buffer(self, buffer):
        """[El, W*max_tokens, hidden] bf16: where a zero-copy combine of
        buffer reads the experts' rows (a host rank: a numpy uint16 array
        of this object's, which ll_combine copies from)."""
        p = ctypes.c_void_p()
        _check(_lib.ep_ll_combine_buffer(self._g, buffer, ctypes.byref(p)))
        if not self._per_gpu:
            return self._ll_cx(buffer)
        c = self.cfg
        W = c["world_size"]
        return self._ll_view(p.value, (c["num_experts"] // W,
                                       W * c["max_tokens_per_rank"],
                                       c["hidden"]), "<i2")

    def _ll_cx(self, buffer):
        """A host rank's zero-copy rows of buffer: an array this object
        owns, copied into libep's combine buffer by ll_combine."""
        import numpy
        cx = self.__dict__.setdefault("_ll_cxs", {})
        if buffer not in cx:
            c = self.cfg
            W = c["world_size"]
            cx[buffer] = numpy.zeros((c["num_experts"] // W,
                                      W * c["max_tokens_per_rank"],
                                      c["hidden"]), numpy.uint16)
        return cx[buffer]

    # ---- shrink mode (ep.h, ep_ll_shrink): a rank that fails is masked
    # and the others go on; GPU ranks of one node ----

    def ll_shrink(self):
        """Turn shrink mode on (every rank alike, before the ops it
        should cover); maps the low-latency regions now."""
        _check(_lib.ep_ll_shrink(self._g))

    def ll_mask(self, rank, masked=True, stream=None):
        """Mask (or unmask) a rank, on the stream."""
        _check(_lib.ep_ll_mask(self._g, rank, 1 if masked else 0,
                               self._stream(stream)))

    def ll_mask_query(self, out, stream=None):
        """Copy the mask (int32 [world], 1: masked) into out, a
        contiguous int32 CUDA tensor, on the stream."""
        _check(_lib.ep_ll_mask_query(self._g, out.data_ptr(),
                                     self._stream(stream)))

    def ll_mask_clean(self, stream=None):
        _check(_lib.ep_ll_mask_clean(self._g, self._stream(stream)))

    def ll_barrier(self, stream=None):
        """A barrier of the ranks not masked, on the stream (in shrink
        mode a rank that does not come is masked)."""
        _check(_lib.ep_ll_barrier(self._g, self._stream(stream)))

    def ll_error(self):
        """None, or the first error the low-latency ops raised (read and
        cleared; on a GPU rank synchronize the stream first). A failed wait (a peer
        that timed out, left or failed) is kept: it ends the group's
        low-latency mode, and every later ll_* call raises it too."""
        rc = _lib.ep_ll_error(self._g)
        return Error(rc, _lib.ep_errmsg().decode()) if rc else None

    def error(self):
        rc = _lib.ep_group_error(self._g)
        return Error(rc, _lib.ep_errmsg().decode()) if rc else None

    def combine(self, y, handle, bias=None, as_numpy=False,
                topk_weights=None, bias2=None):
        """The combined rows [num_tokens, hidden] (bf16 bits). With
        topk_weights ([num_recv, topk] f32, the rows' weights), also their
        sums per token and slot over the ranks it went to, in ascending
        rank order (DeepEP's combined_topk_weights): returns (rows,
        weights) then."""
        H, K = self.cfg["hidden"], self.cfg["topk"]
        py, k1 = _ptr(y, handle.num_recv * H * 2, "y")
        pb, k2 = _ptr(bias, handle.num_tokens * H * 2, "bias")
        pb2, k5 = _ptr(bias2, handle.num_tokens * H * 2, "bias2")
        bo, ro = _out(handle.num_tokens * H * 2, as_numpy, "uint16")
        addr = ctypes.addressof((ctypes.c_char * len(bo)).from_buffer(bo))
        cin = _CombineIn(y=py, num_rows=handle.num_recv, hidden=H, bias=pb,
                         bias2=pb2)
        cout = _CombineOut(out=addr)
        if topk_weights is not None:
            pw, k3 = _ptr(topk_weights, handle.num_recv * K * 4,
                          "topk_weights")
            wo, rw = _out(handle.num_tokens * K * 4, as_numpy, "float32")
            cin.topk_weights = pw
            cout.combined_topk_weights = ctypes.addressof(
                (ctypes.c_char * len(wo)).from_buffer(wo))
        _check(_lib.ep_combine_ex(self._g, ctypes.byref(handle),
                                  ctypes.byref(cin), ctypes.byref(cout)))
        rows = ro.reshape(handle.num_tokens, H) if as_numpy else ro
        if topk_weights is None:
            return rows
        return rows, (rw.reshape(handle.num_tokens, K) if as_numpy else rw)


def node_names(conn, group=None, ranks_per_node=None):
    """The node list of a group spanning the ranks of a torch.distributed
    process group (None: the default one), each rank on conn's daemon:
    every rank's Conn.node gathered, node i named by rank
    i * ranks_per_node. The ranks must be node-major with the same number
    a node (ranks_per_node: counted when None). Collective: every rank of
    the process group calls it."""
    import torch.distributed as dist
    names = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, conn.node, group)
    rpn = ranks_per_node or names.count(names[0])
    if len(names) % rpn or any(
            names[i] != names[i - i % rpn] or names.count(names[i]) != rpn
            for i in range(len(names))):
        raise ValueError("the process group's ranks are not node-major "
                         f"with {rpn} a node: {names}")
    return names[::rpn]


class Conn:
    """A connection to epd. close() (or leaving its with block) leaves
    every group still joined on it; those Group objects then raise
    epd.Error. Groups keep their connection alive."""

    def __init__(self, socket=None):
        c = ctypes.c_void_p()
        self._c = None
        self._groups = set()
        _check(_lib.ep_connect(socket.encode() if socket else None,
                               ctypes.byref(c)))
        self._c = c

    @property
    def _conn(self):
        if not self._c:
            raise Error(EINVAL, "the connection is closed")
        return self._c

    @property
    def node(self):
        """The name of the node whose daemon this connection reaches
        (what a job gathers into a group's node list)."""
        return _lib.ep_conn_node(self._conn).decode()

    def join(self, name, world_size, ranks_per_node, rank, num_experts,
             hidden, max_tokens_per_rank, topk, dtype=BF16, timeout_ms=0,
             wait=True, cuda_device=None, recv_areas=1, nodes=None,
             recv_rows=0, secret=None):
        """cuda_device: a GPU rank on that device (its buffers in GPU
        memory; use the *_stream methods and Group.tensor). recv_areas:
        recv_x as that many areas (1..16, every rank alike, one-node
        groups); each dispatch names the area its rows go to. nodes: the
        group's nodes, the names of node 0, 1, ... (each rank's
        Conn.node, gathered by the job: node_names() does it over a
        torch process group); None: node i is the i-th of the daemons'
        peers. recv_rows: the rows a rank may receive (0: world_size x
        max_tokens_per_rank); a dispatch past it fails on every rank.
        secret: the job's secret (bytes or str, 1..256 bytes), the same on
        every rank: the group is then the job's own (another secret, or
        none, names another group)."""
        cfg = dict(name=name, world_size=world_size,
                   ranks_per_node=ranks_per_node, rank=rank,
                   num_experts=num_experts, hidden=hidden,
                   max_tokens_per_rank=max_tokens_per_rank, topk=topk,
                   dtype=dtype, timeout_ms=timeout_ms,
                   cuda_device=cuda_device, recv_rows=recv_rows)
        if not 1 <= recv_areas <= 16:
            raise ValueError(f"recv_areas {recv_areas}: 1..16")
        gc = _GroupConfig(name.encode(), world_size, ranks_per_node, rank,
                          num_experts, hidden, max_tokens_per_rank, topk,
                          dtype, timeout_ms,
                          0 if cuda_device is None else cuda_device)
        flags = (0 if wait else JOIN_NOWAIT) | \
            (JOIN_CUDA if cuda_device is not None else 0) | \
            int(recv_areas) << 8
        g = ctypes.c_void_p()
        opts = None
        if nodes is not None or recv_rows or secret:
            opts = _JoinOpts(size=ctypes.sizeof(_JoinOpts),
                             recv_rows=int(recv_rows))
            if secret:
                sb = secret.encode() if isinstance(secret, str) else \
                    bytes(secret)
                opts.secret, opts.secret_len = sb, len(sb)
            if nodes is not None:
                if len(nodes) != world_size // ranks_per_node:
                    raise ValueError(
                        f"nodes names {len(nodes)} nodes; world_size "
                        f"{world_size} at {ranks_per_node} a node is "
                        f"{world_size // ranks_per_node}")
                arr = (ctypes.c_char_p * len(nodes))(
                    *[str(n).encode() for n in nodes])
                opts.nodes = arr
        _check(_lib.ep_join_ex(self._conn, ctypes.byref(gc),
                               ctypes.byref(opts) if opts else None, flags,
                               ctypes.byref(g)))
        grp = Group(self, g, cfg)
        self._groups.add(grp)
        return grp

    def status(self):
        p = ctypes.c_void_p()
        _check(_lib.ep_daemon_status(self._conn, ctypes.byref(p)))
        try:
            return json.loads(ctypes.string_at(p).decode())
        finally:
            _libc.free(p)

    def close(self):
        """Close (idempotent). libep leaves and frees the groups still
        joined: their Group objects are cut loose first."""
        if self._c:
            for grp in list(self._groups):
                grp._handle = None
                for r in grp._mregs:  # freed by ep_close
                    r._p = None
                grp._mregs.clear()
            self._groups.clear()
            c, self._c = self._c, None
            _lib.ep_close(c)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


def connect(socket=None):
    return Conn(socket)


def copy_piece(dst, src, nbytes):
    """A contiguous copy of nbytes for stream_copies, in the widest
    elements (16 bytes down to 1) that the addresses and size allow."""
    for e in (16, 8, 4, 2, 1):
        if not (dst | src | nbytes) % e:
            return (dst, src, nbytes // e, e, 1, 1)


def stream_copies(copies, stream):
    """Device copies in one kernel launch on stream (a torch stream or a
    raw CUstream as int), in the current CUDA context: each a tuple (dst,
    src, count, elt, dst_stride, src_stride) of device addresses, count
    elements of elt bytes, strides in elements (ep_stream_copies(3))."""
    n = len(copies)
    arr = (_Copy * max(n, 1))(*[_Copy(*c) for c in copies])
    _check(_lib.ep_stream_copies(arr, n, Group._stream(stream)))


def status(socket=None):
    with connect(socket) as c:
        return c.status()
