# SPDX-License-Identifier: MIT
"""A joined group (epd.Group) and what its calls return: DispatchResult,
MemRegion."""
import ctypes

from ._lib import (_lib, _check, _ptr, _out, _closed, _DeviceArray, Error,
                   Handle, _DispatchIn, _DispatchOut, _Buffers, _CombineIn,
                   _CombineOut, _LLRecv, _CombineMem)
from ._lib import (  # the constants of ep/ep.h
    FP8, DISPATCH_WEIGHTS, COMBINE_BIAS, COMBINE_WEIGHTS, COMBINE_BIAS2,
    COMBINE_TOPK_ORDER,
    LL_HOOK, LL_ZERO_COPY, LL_FP8, LL_ROUND_SCALE, LL_UE8M0, LL_TOPK)


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

    @staticmethod
    def _cflags(bias, weights, bias2, topk_order):
        return (COMBINE_BIAS if bias else 0) | \
            (COMBINE_BIAS2 if bias2 else 0) | \
            (COMBINE_WEIGHTS if weights else 0) | \
            (COMBINE_TOPK_ORDER if topk_order else 0)

    def combine_stream(self, handle, stream=None, bias=False,
                       weights=False, bias2=False, topk_order=False):
        """Enqueue a combine of combine_y (and combine_bias with bias,
        combine_bias2 with bias2, DeepEP's second bias); with weights,
        combine_topk_weights are summed into combined_topk_weights too.
        topk_order: this rank's sums in the slot order of its topk_idx
        field (EP_COMBINE_TOPK_ORDER, DeepEP V2's order)."""
        _check(_lib.ep_combine_stream(
            self._g, ctypes.byref(handle),
            self._cflags(bias, weights, bias2, topk_order),
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
                           bias=False, weights=False, bias2=False,
                           topk_order=False):
        """combine_stream with this rank's rows read at device address ptr
        inside region (a MemRegion), not from combine_y."""
        _check(_lib.ep_combine_stream_reg(
            self._g, ctypes.byref(handle),
            self._cflags(bias, weights, bias2, topk_order), region._p, ptr,
            rows, self._stream(stream)))

    def combine_stream_mem(self, handle, region=None, ptr=None, rows=0,
                           out_region=None, out_ptr=None, stream=None,
                           bias=False, weights=False, bias2=False,
                           topk_order=False):
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
            self._cflags(bias, weights, bias2, topk_order), ctypes.byref(m),
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
                topk_weights=None, bias2=None, topk_order=None):
        """The combined rows [num_tokens, hidden] (bf16 bits). With
        topk_weights ([num_recv, topk] f32, the rows' weights), also their
        sums per token and slot over the ranks it went to, in ascending
        rank order (DeepEP's combined_topk_weights): returns (rows,
        weights) then. topk_order ([num_tokens, topk] int64, the
        dispatch's top-k): each token's rows summed in the order of each
        rank's last slot in its row (EP_COMBINE_TOPK_ORDER, DeepEP V2's
        order)."""
        if topk_order is not None:
            return self._combine_topk(y, handle, bias, as_numpy,
                                      topk_weights, bias2, topk_order)
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

    def _combine_topk(self, y, handle, bias, as_numpy, topk_weights, bias2,
                      topk):
        """combine() in top-k order: the inputs go into the buffer's
        fields (topk_idx included), then ep_combine_inplace."""
        import numpy
        if self._per_gpu:
            raise ValueError("combine: a GPU group combines on a stream")
        H, K = self.cfg["hidden"], self.cfg["topk"]
        R, T = handle.num_recv, handle.num_tokens
        b = _Buffers()
        _check(_lib.ep_get_buffers_sized(self._g, ctypes.byref(b),
                                         ctypes.sizeof(b)))

        def put(field, a, dtype, n):
            if n:
                a = numpy.ascontiguousarray(a, dtype=dtype).reshape(-1)
                if a.size < n:
                    raise ValueError(f"combine: {field} holds {a.size} "
                                     f"values, need {n}")
                ctypes.memmove(getattr(b, field), a.ctypes.data,
                               n * a.itemsize)
        put("combine_y", numpy.asarray(y).view(numpy.uint16), numpy.uint16,
            R * H)
        put("topk_idx", topk, numpy.int64, T * K)
        if bias is not None:
            put("combine_bias", numpy.asarray(bias).view(numpy.uint16),
                numpy.uint16, T * H)
        if bias2 is not None:
            put("combine_bias2", numpy.asarray(bias2).view(numpy.uint16),
                numpy.uint16, T * H)
        if topk_weights is not None:
            put("combine_topk_weights", topk_weights, numpy.float32, R * K)
        _check(_lib.ep_combine_inplace(
            self._g, ctypes.byref(handle),
            self._cflags(bias is not None, topk_weights is not None,
                         bias2 is not None, True)))
        raw = ctypes.string_at(b.combined, T * H * 2)
        rows = numpy.frombuffer(raw, dtype=numpy.uint16).copy()
        rows = rows.reshape(T, H) if as_numpy else memoryview(rows.tobytes())
        if topk_weights is None:
            return rows
        raw = ctypes.string_at(b.combined_topk_weights, T * K * 4)
        w = numpy.frombuffer(raw, dtype=numpy.float32).copy()
        return rows, (w.reshape(T, K) if as_numpy else memoryview(
            w.tobytes()))
