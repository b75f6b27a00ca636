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

The low-latency calls (DeepEP's low_latency_*) are in lowlat.py, the
epd group of each shape (its memory, receive areas, registrations) in
shapes.py.
"""
import os
import socket
import uuid
import weakref
from typing import NamedTuple

import epd
from ..utils.event import EventHandle, EventOverlap
from ..utils.envs import check_nvlink_connections, check_torch_deterministic
from ..utils import spans as _spans
from .shapes import (_torch, _release_all, _ue8m0_unpack, _ue8m0_pack,
                     _Routing, _REG_X, _copies, _expandable, _Lease,
                     _OutLease, _Sub)
from .lowlat import LowLatency, _LL_HINTS


class _DispatchIn(NamedTuple):
    """One dispatch's inputs, as the GPU and host paths take them: x and
    its scales, the routing input (top-k, or is_token_in_rank), a cached
    dispatch's routing (rt), the rows to give without a count (worst, 0:
    the count), and the event and stream choices."""
    x: object
    xs: object
    topk_idx: object
    topk_weights: object
    in_rank: object
    rt: object
    worst: int
    prev: object
    async_finish: bool
    alloc_comm: bool


class _Streams:
    """The current stream, switched between the caller's (compute) and
    the comm stream by torch.cuda.set_stream, and only for torch's own
    copies: torch.cuda.stream's context looks the device and the streams
    up again each time, tens of us of CPU under MPS. back() sets the
    caller's again, whatever happened."""

    def __init__(self, torch, compute, comm):
        self._set = torch.cuda.set_stream
        self.compute, self.comm = compute, comm
        self._cur = compute

    def to(self, s):
        if self._cur is not s:
            self._set(s)
            self._cur = s

    def back(self):
        self.to(self.compute)


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

class Buffer(LowLatency):
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
                out = run(sub2, _DispatchIn(
                    x, x_scales, rt.topk, None, in_rank, alt, 0,
                    previous_event, async_finish, allocate_on_comm_stream))
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
            return run(sub, _DispatchIn(*args))
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

    def _gpu_dispatch(self, sub, d):
        torch = _torch()
        T = d.x.size(0)
        compute, comm = self._streams(d.prev)
        if T > sub.tmax:  # nothing copied; every rank's op fails
            sub.g.dispatch_stream(T, stream=comm,
                                  weights=d.topk_weights is not None)
            raise AssertionError("a dispatch of too many tokens succeeded")
        # the received rows go straight to a free receive area, handed out
        # as recv_x (no copy); with none free (or in a CUDA graph, where a
        # replay would write the captured area again) to area 0 and copied
        cap = torch.cuda.is_current_stream_capturing()
        area, aev = (0, None) if cap else sub.take()
        if aev is not None:
            comm.wait_event(aev)  # the area's last user is done with it
        held = [area]  # the area, until a recv_x tensor owns it
        # The CPU's work is ordered by what waits for it: first what the
        # dispatch needs on the stream (every rank's op starts only when
        # the last rank rang); then the count, which comes once the
        # routing is known (protocol 1.15), while the rows still move; then
        # the outputs, queued behind the op on the comm stream. A caller
        # that runs ahead overlaps all of it with the op's rows. The small
        # copies between two ops are one launch each way
        # (epd.stream_copies): each separate one is a dependent step on
        # the comm stream, and every rank waits for the slowest.
        st = _Streams(torch, compute, comm)
        try:
            h = self._gpu_send(sub, d, st, area, cap)
            R, pe = self._gpu_count(sub, d, h)
            outs = self._gpu_outputs(sub, d, st, R, held)
        finally:
            if held[0]:  # failed, or no rows: the area is free again
                sub.free.append((held[0], None))
        # (every output's memory is recorded on the comm stream; an area
        # is not the allocator's)
        ev = self._finish(compute, comm, list(outs), d.async_finish,
                          d.alloc_comm, recorded=True)
        recv_x, recv_xs, rti, rtw, rsrc, rp = outs
        if d.rt is not None:
            return recv_x, recv_xs, None, None, None, None, None, None, ev
        # the routing input a cached dispatch in the other dtype needs:
        # the caller's topk_idx itself (DeepEP's handle holds the caller's
        # is_token_in_rank the same way); without one, the handle's
        # is_token_in_rank gives it again
        return (recv_x, recv_xs, rti, rtw, pe,
                _Routing(sub, h, d.x.size(0), R, d.topk_idx), rp, rsrc, ev)

    def _gpu_send(self, sub, d, st, area, cap):
        """Dispatch d's inputs into sub's region (x read where it is when
        it lies in registered memory, as the combine's rows; the small
        inputs by one copy launch) and its op on the comm stream, into
        receive area `area`: its handle."""
        torch = _torch()
        x, xs, topk_idx, topk_weights = d.x, d.xs, d.topk_idx, \
            d.topk_weights
        T, K, ns = x.size(0), sub.K, sub.H // 128
        cached = d.rt is not None
        comm = st.comm
        xv = x.view(torch.uint8) if sub.fp8 else x
        reg = sub.region_of(xv) if T and _REG_X and not cap else None
        pieces = []

        def piece(name, src, nbytes):  # into the region's field
            pieces.append(epd.copy_piece(sub.ptr[name], src.data_ptr(),
                                         nbytes))
        try:
            if T and reg is None:
                st.to(comm)
                sub.x[:T].copy_(xv)
            elif T:
                x.record_stream(comm)  # read until the dispatch ran
            if T:
                if sub.fp8:
                    if xs.dtype == torch.float32 and xs.is_contiguous():
                        piece("scales", xs, T * ns * 4)
                    else:
                        st.to(comm)
                        sub.scales[:T].copy_(xs)  # any strides
                if not cached:
                    if topk_idx is not None and \
                            topk_idx.dtype == torch.int64 and \
                            topk_idx.is_contiguous():
                        piece("topk", topk_idx, T * K * 8)
                    elif topk_idx is not None:
                        st.to(comm)
                        sub.topk[:T].copy_(topk_idx)
                    else:
                        st.to(comm)
                        sub.topk[:T].copy_(self._in_rank_topk(
                            sub, d.in_rank, self._ar))
                    if topk_weights is not None:
                        if topk_weights.dtype == torch.float32 and \
                                topk_weights.is_contiguous():
                            piece("w", topk_weights, T * K * 4)
                        else:
                            st.to(comm)
                            sub.w[:T].copy_(topk_weights)
                if d.worst:  # no CPU wait below: read until the copies ran
                    for t_ in (xs, topk_idx, topk_weights):
                        if t_ is not None:
                            t_.record_stream(comm)
            if pieces:
                _copies(pieces, self._comm_ptr)
            a = _spans.mark(comm)
            h = sub.g.dispatch_stream(
                T, stream=self._comm_ptr, weights=topk_weights is not None,
                handle=d.rt.h if cached else None, area=area, region=reg,
                ptr=xv.data_ptr() if reg is not None else 0)
            _spans.add("epd_dispatch_impl", a, _spans.mark(comm))
        finally:
            st.back()
        return h

    @staticmethod
    def _gpu_count(sub, d, h):
        """The rows dispatch h gives this rank and its rows per expert:
        a cached dispatch's routing's, the worst case's (no count: the
        rows past it are -1), or the count (the CPU waits for it, then
        for the rows per expert in the control page)."""
        R = d.rt.R if d.rt is not None else d.worst if d.worst else None
        if R is not None:
            return R, []
        try:
            return sub.g.recv_count(h), sub.g.recv_expert_counts(h)
        except BaseException:
            try:
                sub.g.release(h)
            except epd.Error:
                pass
            raise

    def _gpu_outputs(self, sub, d, st, R, held):
        """The dispatch's outputs of R rows, queued behind its op on the
        comm stream: recv_x (the receive area held[0] itself, handed over,
        or a copy of its rows), and as views (as_strided: one call each)
        of one copy of the span of received scales, top-k, weights and
        sources, and the rank prefix matrix."""
        torch = _torch()
        cached, worst, alloc_comm = d.rt is not None, d.worst, d.alloc_comm
        K, H, ns, area = sub.K, sub.H, sub.H // 128, held[0]
        comm, dev = st.comm, d.x.device
        dt = torch.float8_e4m3fn if sub.fp8 else torch.bfloat16
        recv_xs = rti = rtw = rsrc = rp = None
        mo = sub.moff
        pieces = []
        try:
            st.to(comm if alloc_comm else st.compute)
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
                st.to(comm)
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
                st.to(comm)
                recv_x.view(torch.uint8 if sub.fp8 else dt).copy_(
                    sub.recv_x[:R])
        finally:
            st.back()
        return recv_x, recv_xs, rti, rtw, rsrc, rp

    def _host_dispatch(self, sub, d):
        torch = _torch()
        x, xs, topk_idx, topk_weights, in_rank, rt, worst, prev, \
            async_finish, alloc_comm = d
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
