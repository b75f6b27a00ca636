# SPDX-License-Identifier: MIT
"""libep through ctypes: the library (loaded and checked for its ABI), its
structs and entry points, the constants of ep/ep.h, and the helpers the
binding's classes share. Re-exported by the package (epd)."""
import ctypes
import errno
import os

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
COMBINE_TOPK_ORDER = 0x8  # EP_COMBINE_TOPK_ORDER
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
_lib.ep_combine_inplace.argtypes = [ctypes.c_void_p, ctypes.POINTER(Handle),
                                    ctypes.c_uint]
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


