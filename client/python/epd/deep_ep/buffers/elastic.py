# SPDX-License-Identifier: MIT
"""DeepEP V2's ElasticBuffer (deep_ep.ElasticBuffer, DeepEP 2.x's current
API) on epd, written for epd from V2's documented semantics.

What runs underneath:

- The groups are this package's legacy Buffer's (one epd group per shape:
  hidden, dtype, top-k, experts), joined with the job's secret and the
  torch group's nodes; their timeout is the larger of num_cpu_timeout_secs
  and num_gpu_timeout_secs.
- barrier() is epd's two-phase barrier (the rail phase across nodes, then
  the node phase) on a group of its own: globally correct whatever
  `sequential` says; epd never runs the phases in parallel.
- dispatch() and combine() are epd's ops. epd reduces each token once, on
  its home rank, with no intermediate reduction per node: V2's direct
  (non-hybrid) mode. So get_logical_domain_size() is (1, num_ranks) (the
  physical one is (nodes, ranks per node)), received tokens are ordered by
  source rank then source token (by src_token_global_idx), and a combine
  sums each token's rows from its bias in the order of each rank's last
  top-k slot, in fp32, rounded once to bf16 (V2's order,
  EP_COMBINE_TOPK_ORDER). The results do not depend on timing, so
  `deterministic` changes nothing (EPHandle.deterministic_sort has nothing
  to sort).
- The V2 layouts (expanded rows, aligned expert segments, zero padding,
  the TMA-aligned column-major scales, recv_src_metadata) are made from
  the op's outputs by torch operations on the comm stream.

Not supported (each raises NotImplementedError naming it): CPU segments
(num_cpu_bytes), Engram, pipeline-parallel send/recv, AGRS, an expanded
combine with allow_multiple_reduction=False, UE8M0 packed scales."""
import os
import weakref
from typing import NamedTuple

from . import legacy as _legacy
from . import shapes as _shapes
from ..utils.event import EventHandle, EventOverlap
from ..utils.envs import check_torch_deterministic
from ..utils import spans as _spans

_ALIGN = 2 << 20  # the buffer sizes' granule (V2: 2 MiB)
_MAX_TOPK = 32    # epd's largest top-k (EPP_MAX_TOPK)


def _torch():
    import torch
    return torch


def _round_up(x, a):
    return (x + a - 1) // a * a


class EPHandle:
    """A dispatch's handle: V2's attributes (see ElasticBuffer.dispatch),
    and the epd routing its combine and cached dispatches use."""

    def __init__(self, do_expand, num_experts, expert_alignment,
                 num_max_tokens_per_rank, num_sms, topk_idx,
                 num_recv_tokens, num_expanded_tokens,
                 num_recv_tokens_per_expert_list,
                 psum_num_recv_tokens_per_scaleup_rank,
                 psum_num_recv_tokens_per_expert,
                 num_unaligned_recv_tokens_per_expert, recv_src_metadata,
                 dst_buffer_slot_idx, token_metadata_at_forward=None,
                 channel_linked_list=None):
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = \
            num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = \
            psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = \
            num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        # V2's hybrid-mode forwarding state: epd has none (direct mode)
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.cached_recv_src_metadata_before_sort = None
        # epd's side: the routing (combine, cached dispatch), the received
        # rows' local top-k (-1: another rank's slot) and slot positions
        self._rt = None
        self._rti = None
        self._pos = None
        self._buffer = None

    def deterministic_sort(self, do_cpu_sync, is_cached_dispatch, recv_x,
                           recv_sf, recv_topk_idx, recv_topk_weights,
                           channel_linked_list):
        """V2 sorts a dispatch's received tokens by src_token_global_idx
        when asked to be deterministic; epd's are in that order already
        (source rank, then source token) whatever the timing: nothing to
        do."""


class _EpdOut(NamedTuple):
    """What epd's dispatch gave: the rows and their scales, top-k and
    weights, the rank prefix matrix, the sources, the routing and the
    rows per local expert."""
    recv_x: object
    recv_sf: object
    rti: object
    rtw: object
    rp: object
    rsrc: object
    rt: object
    pe: object


class _EpOpts(NamedTuple):
    """A V2 dispatch's choices, as its epilogue takes them."""
    E: int
    nmax: int
    align: int
    do_cpu_sync: bool
    do_expand: bool
    zero_pad: bool
    col_major: bool
    do_handle_copy: bool
    num_sms: int
    stats: object


class _Slots:
    """Where a dispatch's received (row, k) go (ElasticBuffer._slots)."""
    counts = aligned = start = lst = pos = None


class ElasticBuffer:
    """DeepEP V2's ElasticBuffer on epd (see the module's docstring)."""

    def __init__(self, group, num_bytes=None, num_cpu_bytes=0,
                 num_max_tokens_per_rank=0, hidden=0, num_topk=0,
                 use_fp8_dispatch=False, deterministic=False,
                 allow_hybrid_mode=True, allow_multiple_reduction=True,
                 prefer_overlap_with_compute=True, sl_idx=3,
                 num_allocated_qps=0, num_cpu_timeout_secs=300,
                 num_gpu_timeout_secs=100, explicitly_destroy=False,
                 socket_path=None):
        torch = _torch()
        self._v1 = None
        self.explicitly_destroy = explicitly_destroy
        if num_cpu_bytes:
            raise NotImplementedError(
                "ElasticBuffer(num_cpu_bytes=...): epd's deep_ep has no "
                "CPU segments (Engram storage)")
        for name, v in (("num_cpu_timeout_secs", num_cpu_timeout_secs),
                        ("num_gpu_timeout_secs", num_gpu_timeout_secs)):
            if not 0 < v <= 3600:
                raise ValueError(f"ElasticBuffer: {name}={v}, not in "
                                 f"1..3600 (epd's largest group timeout)")
        if num_bytes is None:
            if num_max_tokens_per_rank <= 0 or hidden <= 0:
                raise ValueError(
                    "ElasticBuffer: give num_bytes, or "
                    "num_max_tokens_per_rank and hidden")
            num_bytes = self.get_buffer_size_hint(
                group, num_max_tokens_per_rank, hidden, num_topk,
                use_fp8_dispatch, allow_hybrid_mode,
                allow_multiple_reduction)
        self.group = group
        self.rank_idx, self.num_ranks = group.rank(), group.size()
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.num_bytes = int(num_bytes)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.sl_idx = int(os.environ.get("EP_OVERRIDE_RDMA_SL", sl_idx))
        # epd's daemons own the connections between nodes; the figure is
        # kept for callers that size by it (V2's automatic choice)
        self.num_allocated_qps = num_allocated_qps or \
            (65 if allow_hybrid_mode else 17)
        v1 = _legacy.Buffer(group, num_nvl_bytes=self.num_bytes,
                            explicitly_destroy=True, socket_path=socket_path)
        self._v1 = v1
        v1._timeout_ms = 1000 * max(num_cpu_timeout_secs,
                                    num_gpu_timeout_secs)
        # one receive area a group (the rows are laid out anew anyway):
        # the Buffer's bytes go to the shapes' groups, not to spare areas
        v1._areas_max = 1
        self.num_rdma_ranks = self.num_ranks // v1._rpn
        self.num_nvlink_ranks = v1._rpn
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx
        self._gpu = v1._device is not None
        # the GPU's SMs (get_theoretical_num_sms, each dispatch's default)
        self._sms = torch.cuda.get_device_properties(
            v1._device).multi_processor_count if self._gpu else 4
        self._bar = None  # the barrier's group (_barrier_group)
        if self._gpu:
            torch.cuda.synchronize()
        group.barrier()

    # ---- life ----

    def destroy(self):
        """Leave epd's groups (needs explicitly_destroy=True)."""
        assert self.explicitly_destroy, \
            "`explicitly_destroy` flag must be set"
        self._destroy()

    def _destroy(self):
        # every op this rank enqueued is done before its groups are left
        # (a stream barrier still queued would otherwise see its rank
        # leave, and every other rank's fail)
        if self._v1 is not None and self._gpu:
            _torch().cuda.synchronize()
        if self._bar is not None:
            g, self._bar = self._bar, None
            try:
                g.leave()
            except Exception:
                pass
        if self._v1 is not None:
            v1, self._v1 = self._v1, None
            v1._destroy()

    def __del__(self):
        if not getattr(self, "explicitly_destroy", True):
            try:
                self._destroy()
            except Exception:
                pass

    def _live(self):
        if self._v1 is None:
            raise RuntimeError("ElasticBuffer: destroyed")
        return self._v1

    # ---- sizes ----

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank, hidden,
                             num_topk=0, use_fp8_dispatch=False,
                             allow_hybrid_mode=True,
                             allow_multiple_reduction=True):
        """The bytes a rank's epd groups take for these settings (2 MiB
        multiples): the fp8 dispatch's group, and, unless
        use_fp8_dispatch, the bf16 one too (a buffer sized for bf16 also
        dispatches fp8, as V2's does). num_topk 0: room for epd's largest
        top-k."""
        W = group.size()
        K = num_topk or _MAX_TOPK
        total = 0
        for fp8 in ((True,) if use_fp8_dispatch else (True, False)):
            fixed, area = _shapes._region_bytes(
                hidden, fp8, K, num_max_tokens_per_rank,
                W * num_max_tokens_per_rank)
            total += fixed + area
        return _round_up(total, _ALIGN)

    @staticmethod
    def get_engram_storage_size_hint(num_entries, hidden,
                                     num_max_tokens_per_rank, dtype=None):
        """(GPU bytes, CPU bytes) V2 would size; epd runs no Engram
        (ElasticBuffer.engram_* raise NotImplementedError)."""
        es = 2 if dtype is None else dtype.itemsize
        row = _round_up(hidden * es, 32)
        return (_round_up(row * num_max_tokens_per_rank, _ALIGN),
                _round_up(row * num_entries, _ALIGN))

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes,
                                num_max_inflight_tensors):
        """V2's size for pipeline-parallel send/recv (epd runs none)."""
        return _round_up(_round_up(num_max_tensor_bytes, 32) *
                         num_max_inflight_tensors * 4, _ALIGN)

    @staticmethod
    def get_agrs_num_max_session_bytes(group, shapes, dtype):
        """V2's bytes of one AGRS session (epd runs no AGRS)."""
        import math
        if not isinstance(shapes[0], tuple):
            shapes = (shapes,)
        return sum(_round_up(group.size() * math.prod(s) * dtype.itemsize,
                             32) for s in shapes)

    @staticmethod
    def get_agrs_buffer_size_hint(group, num_max_session_bytes):
        return _round_up(num_max_session_bytes, _ALIGN)

    def memory_bytes(self):
        """Bytes this rank's epd groups hold (at most num_bytes, plus the
        barrier's small group)."""
        return self._live().memory_bytes()

    # ---- domains and resources ----

    def get_physical_domain_size(self):
        """(nodes, GPU ranks per node) of the group."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self):
        """(1, num_ranks): epd's ops run as V2's direct mode (the module's
        docstring)."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts, num_topk,
                                num_scaleout_topk=0, rdma_gbs=0,
                                nvlink_gbs=0, sm_read_gbs=200,
                                sm_write_gbs=50):
        """An even SM count (at least 4): the daemon chooses the SMs of its
        own kernels; this figure is recorded in the handle, as V2's."""
        if num_scaleout_topk:
            raise ValueError("num_scaleout_topk must be 0")
        want = 24 if self.prefer_overlap_with_compute else 64
        return max(4, min(self._sms, want) // 2 * 2)

    def get_theoretical_num_qps(self, num_sms):
        return min(num_sms + 1, self.num_allocated_qps)

    @staticmethod
    def capture():
        """An event on the current stream (previous_event of an op)."""
        return EventHandle()

    def get_comm_stream(self):
        return self._live().get_comm_stream()

    # ---- barrier ----

    def _barrier_group(self):
        """The barrier's own epd group (every rank of the torch group; the
        smallest shape), joined at the first barrier."""
        if self._bar is None:
            v1 = self._live()
            W = self.num_ranks
            self._bar = v1._conn.join(
                f"{v1._name}-bar", world_size=W, ranks_per_node=v1._rpn,
                rank=self.rank_idx, num_experts=W, hidden=128,
                max_tokens_per_rank=1, topk=1,
                cuda_device=v1._device, timeout_ms=v1._timeout_ms,
                nodes=v1._nodes if W > v1._rpn else None,
                secret=v1._secret)
        return self._bar

    def barrier(self, use_comm_stream=True, with_cpu_sync=False,
                sequential=True):
        """epd's two-phase barrier (every rank's stream, or CPU, waits
        until every rank of the group arrived: the rail phase across
        nodes, then the node phase). sequential is accepted and changes
        nothing: epd never runs the phases in parallel. On GPU ranks the
        barrier is on the comm stream (use_comm_stream) ordered after the
        current stream, which waits for it; with_cpu_sync: the device is
        synchronized before and after."""
        torch = _torch()
        g = self._barrier_group()
        if not self._gpu:
            g.barrier()
            return
        if with_cpu_sync:
            torch.cuda.synchronize()
        cur = torch.cuda.current_stream()
        if use_comm_stream:
            comm = self._v1._comm
            comm.wait_stream(cur)
            a = _spans.mark(comm)
            g.barrier_stream(comm.cuda_stream)
            _spans.add("epd_barrier", a, _spans.mark(comm))
            cur.wait_stream(comm)
        else:
            a = _spans.mark(cur)
            g.barrier_stream(cur.cuda_stream)
            _spans.add("epd_barrier", a, _spans.mark(cur))
        if with_cpu_sync:
            torch.cuda.synchronize()

    # ---- dispatch ----

    def dispatch(self, x, topk_idx=None, topk_weights=None,
                 cumulative_local_expert_recv_stats=None, num_experts=None,
                 num_max_tokens_per_rank=None, expert_alignment=None,
                 num_sms=0, num_qps=0, previous_event=None,
                 previous_event_before_epilogue=None,
                 async_with_compute_stream=False,
                 allocate_on_comm_stream=False, handle=None,
                 do_handle_copy=True, do_cpu_sync=None, do_expand=False,
                 do_zero_padding=False, use_tma_aligned_col_major_sf=False):
        """V2's dispatch: (recv_x or (recv_x, recv_sf), recv_topk_idx,
        recv_topk_weights, handle, event).

        recv_x holds the received tokens by source rank, then source
        token; with do_expand one row per (token, local expert) slot,
        expert after expert, each expert's segment starting at a multiple
        of expert_alignment (do_zero_padding: the gaps zeroed) and
        recv_topk_idx None, recv_topk_weights then [rows] (each slot's
        weight). recv_topk_idx: local expert indices, -1 for another
        rank's; recv_topk_weights: the token's weights, 0 in another
        rank's slots. The handle's recv_src_metadata [tokens, 2 + top-k] int32:
        src_token_global_idx (source rank * num_max_tokens_per_rank +
        token), the token's row, then for each top-k slot held here the
        row of recv_x that carries it (-1: another rank's). Without
        do_cpu_sync the outputs have the worst case's rows (those past
        the received count: -1 indices, zero weights) and
        num_recv_tokens_per_expert_list is None."""
        torch = _torch()
        check_torch_deterministic()
        v1 = self._live()
        fp8 = isinstance(x, tuple)
        x, sf = x if fp8 else (x, None)
        if sf is not None and sf.dtype != torch.float32:
            raise NotImplementedError(
                "ElasticBuffer.dispatch: fp8 scales must be float32 "
                "(UE8M0 packed scales are not supported)")
        cached = handle is not None
        topk_idx, num_experts, nmax, expert_alignment, do_cpu_sync = \
            self._dispatch_params(handle, topk_idx, num_experts,
                                  num_max_tokens_per_rank, expert_alignment,
                                  do_cpu_sync, do_expand)
        nmax = nmax or self.num_max_tokens_per_rank
        if previous_event is not None and not allocate_on_comm_stream:
            raise ValueError("dispatch: previous_event needs "
                             "allocate_on_comm_stream=True")
        if do_zero_padding and not do_expand:
            raise ValueError("dispatch: do_zero_padding needs do_expand")
        T, H = x.shape
        K = topk_idx.size(1)
        W = self.num_ranks
        if num_experts % W:
            raise ValueError(f"dispatch: {num_experts} experts over {W} "
                             f"ranks")
        if nmax <= 0 or T > nmax:
            raise ValueError(f"dispatch: {T} tokens, num_max_tokens_per_"
                             f"rank is {nmax}")
        if expert_alignment < 1:
            raise ValueError(f"dispatch: expert_alignment "
                             f"{expert_alignment}")
        num_sms = num_sms or self.get_theoretical_num_sms(num_experts, K)
        if num_qps and num_qps > self.num_allocated_qps:
            raise ValueError(f"dispatch: {num_qps} QPs, "
                             f"{self.num_allocated_qps} allocated")
        sub = self._group(H, fp8, K, num_experts, nmax)
        # epd's op (on the comm stream for GPU ranks, the caller's
        # stream not waiting for it)
        prev = EventOverlap(previous_event) if previous_event is not None \
            else None
        rt_c = handle._rt if cached and topk_weights is None else None
        # rows out: the count (the CPU waits for it), the worst case, or
        # a cached dispatch's: its handle's (one that carries weights is
        # a fresh epd dispatch of the handle's top-k: the same rows)
        worst = handle._rt.R if cached else 0 if do_cpu_sync else W * nmax
        out = v1._run_dispatch(
            sub, (x, sf, topk_idx if rt_c is None else None,
                  topk_weights if rt_c is None else None, None, rt_c, worst,
                  prev, True, allocate_on_comm_stream),
            f"the group was sized for num_max_tokens_per_rank={nmax}")
        recv_x, recv_sf, rti, rtw, pe, rt, rp, rsrc, _ = out
        op_end, _spans.last_end = _spans.last_end, None
        if rt_c is not None:
            rt = rt_c
            rti = handle._rti
        elif cached:
            # the fresh routing is not kept: the handle's stays
            _shapes._release_all(rt.entries)
            rt = handle._rt
        comm = v1._comm if self._gpu else None
        compute = torch.cuda.current_stream() if self._gpu else None
        ev0 = previous_event_before_epilogue
        if ev0 is not None and ev0.event is not None and comm is not None:
            comm.wait_event(ev0.event)  # the epilogue waits for it
        ctx = torch.cuda.stream(comm) if comm is not None else _Nothing()
        with ctx:
            res = self._dispatch_epilogue(
                handle, _EpdOut(recv_x, recv_sf, rti, rtw, rp, rsrc, rt, pe),
                topk_idx, topk_weights, T, K,
                _EpOpts(num_experts, nmax, expert_alignment, do_cpu_sync,
                        do_expand, do_zero_padding,
                        use_tma_aligned_col_major_sf, do_handle_copy,
                        num_sms, cumulative_local_expert_recv_stats))
            _spans.add("epd_dispatch_copy_epilogue_impl", op_end,
                       _spans.mark(comm))
        recv_x, recv_sf, rti_out, rtw_out, hnd = res
        outs = [recv_x, recv_sf, rti_out, rtw_out, hnd.recv_src_metadata,
                hnd.psum_num_recv_tokens_per_scaleup_rank,
                hnd.psum_num_recv_tokens_per_expert,
                hnd.num_unaligned_recv_tokens_per_expert,
                hnd.dst_buffer_slot_idx]
        evo = self._finish(compute, comm, outs, async_with_compute_stream,
                           allocate_on_comm_stream)
        return ((recv_x, recv_sf) if fp8 else recv_x), rti_out, rtw_out, \
            hnd, evo

    @staticmethod
    def _dispatch_params(handle, topk_idx, num_experts,
                         num_max_tokens_per_rank, expert_alignment,
                         do_cpu_sync, do_expand):
        """A dispatch's routing input and choices: a cached dispatch's
        from its handle (those given must agree with it; no CPU sync),
        a fresh one's as given, with V2's defaults: (topk_idx,
        num_experts, num_max_tokens_per_rank (None: the Buffer's),
        expert_alignment, do_cpu_sync)."""
        cached = handle is not None
        if cached:
            if topk_idx is not None:
                raise ValueError("dispatch: a cached dispatch takes no "
                                 "topk_idx (the handle's is used)")
            if do_cpu_sync:
                raise ValueError("dispatch: a cached dispatch does no CPU "
                                 "sync")
            for name, given, have in (
                    ("num_experts", num_experts, handle.num_experts),
                    ("expert_alignment", expert_alignment,
                     handle.expert_alignment),
                    ("num_max_tokens_per_rank", num_max_tokens_per_rank,
                     handle.num_max_tokens_per_rank)):
                if given is not None and given != have:
                    raise ValueError(f"dispatch: {name}={given}, the "
                                     f"handle's is {have}")
            if do_expand != handle.do_expand:
                raise ValueError("dispatch: do_expand differs from the "
                                 "handle's dispatch")
            topk_idx = handle.topk_idx
            num_experts = handle.num_experts
            expert_alignment = handle.expert_alignment
            nmax = handle.num_max_tokens_per_rank
            do_cpu_sync = False
        else:
            if topk_idx is None:
                raise ValueError("dispatch: give topk_idx or a handle")
            if num_experts is None:
                raise ValueError("dispatch: give num_experts")
            nmax = num_max_tokens_per_rank
            expert_alignment = expert_alignment or 1
            do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        return topk_idx, num_experts, nmax, expert_alignment, do_cpu_sync

    def _group(self, H, fp8, K, E, nmax):
        """The epd group of a shape (made at its first use, within the
        bytes the Buffer was given: every rank computes the same sizes, so
        every rank refuses alike)."""
        v1 = self._live()
        key = (H, fp8, K, E)
        sub = v1._subs.get(key)
        if sub is not None:
            if sub.tmax != nmax:
                raise ValueError(
                    f"dispatch: num_max_tokens_per_rank={nmax}, this "
                    f"shape's group was made for {sub.tmax}")
            return sub
        fixed, area = _shapes._region_bytes(H, fp8, K, nmax,
                                            self.num_ranks * nmax)
        need = fixed + area
        used = v1._mem_used
        if used + need > self.num_bytes:
            raise ValueError(
                f"ElasticBuffer: a group of hidden {H}, "
                f"{'fp8' if fp8 else 'bf16'}, top-{K}, {E} experts and "
                f"{nmax} tokens a rank needs {need} bytes a rank; "
                f"{self.num_bytes - used} of num_bytes={self.num_bytes} "
                f"are left (get_buffer_size_hint sizes a buffer)")
        return v1._sub(key, nmax, tmax=nmax)

    def _finish(self, compute, comm, outs, async_, alloc_comm):
        """The op's end for the caller's stream: an event to wait for
        (async_with_compute_stream), or the current stream waits now. The
        outputs were made on the comm stream: unless allocate_on_comm_
        stream, their memory is also the caller's stream's."""
        if comm is None:
            return EventOverlap(EventHandle() if async_ else None)
        if not alloc_comm:
            for t in outs:
                if t is not None:
                    t.record_stream(compute)
        if async_:
            return EventOverlap(EventHandle(comm),
                                [t for t in outs if t is not None])
        compute.wait_stream(comm)
        return EventOverlap(None)

    def _dispatch_epilogue(self, handle, got, topk_idx, topk_weights, T, K,
                           o):
        """V2's outputs from epd's (got: _EpdOut; o: _EpOpts), on the
        current stream: the comm stream for GPU ranks."""
        sl = self._slots(handle, got, K, o)
        out_x, out_sf, out_rti, out_w = self._expanded(
            handle, got, topk_weights, sl, K, o)
        if out_sf is not None and o.col_major:
            out_sf = _col_major(out_sf)
        if handle is not None:
            return out_x, out_sf, out_rti, out_w, handle
        hnd = self._v2_handle(got, sl, topk_idx, T, K, out_x, o)
        return out_x, out_sf, out_rti, out_w, hnd

    def _slots(self, handle, got, K, o):
        """Where each received (row, k) goes: each local expert's count
        (added to the stats), aligned rows and start, the aligned rows as
        a list with the CPU sync, and each (row, k)'s slot (its expert's
        segment with do_expand, else its row; -1: not here). A cached
        dispatch's slots are its handle's."""
        torch = _torch()
        rti, R = got.rti, got.recv_x.size(0)
        dev = got.recv_x.device
        El = o.E // self.num_ranks
        i64 = torch.int64
        align = o.align
        sl = _Slots()
        cached = handle is not None
        if not cached or o.stats is not None:
            # received rows' local slots (rows by source rank then token),
            # El for another rank's; each local expert's count (El: the
            # rest)
            valid = rti >= 0
            flat = torch.where(valid, rti, torch.full_like(rti, El)).view(-1)
            allc = torch.bincount(flat, minlength=El + 1)
            sl.counts = allc[:El].to(torch.int32)
            if o.stats is not None:
                o.stats.add_(sl.counts.to(o.stats.dtype))
        if cached:
            sl.pos = handle._pos
            return sl
        # with the CPU sync, each local expert's aligned rows as a list:
        # from the counts the CPU already has (epd's per-expert counts,
        # pe), so the epilogue waits for the GPU nowhere
        pe = got.pe
        if o.do_cpu_sync:
            sl.lst = [(c + align - 1) // align * align for c in pe] \
                if pe is not None and len(pe) == El else None
        sl.aligned = (sl.counts + (align - 1)) // align * align
        if o.do_cpu_sync and sl.lst is None:
            sl.lst = sl.aligned.tolist()
        sl.start = torch.cumsum(sl.aligned, 0) - sl.aligned  # segments'
        if o.do_expand:
            # slot (i, k) of expert e: e's start + its rank among e's
            # slots in (row, k) order
            order = torch.sort(flat, stable=True).indices
            sk = flat[order]
            gstart = torch.cumsum(allc, 0) - allc
            startx = torch.cat([sl.start.to(i64),
                                torch.full((1,), -1, dtype=i64,
                                           device=dev)])
            within = torch.arange(flat.numel(), dtype=i64, device=dev) \
                - gstart[sk]
            p = torch.where(sk < El, startx[sk] + within,
                            torch.full_like(within, -1))
            pos = torch.empty_like(p)
            pos[order] = p
            sl.pos = pos.view(R, K)
        else:
            rows = torch.arange(R, dtype=i64, device=dev).unsqueeze(1)
            sl.pos = torch.where(valid, rows.expand(R, K),
                                 torch.full_like(rti, -1))
        return sl

    def _expanded(self, handle, got, topk_weights, sl, K, o):
        """x, its scales, top-k and weights as V2 gives them: with
        do_expand, each (row, k) in its expert's aligned segment (the
        padding zeroed with do_zero_padding; the rows: the CPU sync's
        count, a cached dispatch's, else the worst case), else epd's."""
        torch = _torch()
        recv_x, recv_sf, rtw = got.recv_x, got.recv_sf, got.rtw
        cached = handle is not None
        if not o.do_expand:
            return recv_x, recv_sf, got.rti, \
                rtw if topk_weights is not None else None
        R, dev = recv_x.size(0), recv_x.device
        if cached:
            n = handle.num_expanded_tokens
        elif o.do_cpu_sync:
            n = sum(sl.lst)
        else:  # the worst case: every row in every slot, padded
            El = o.E // self.num_ranks
            n = R * min(K, El) + El * (o.align - 1)
        pos = sl.pos
        vflat = pos.view(-1) >= 0
        src_row = torch.arange(R, dtype=torch.int64, device=dev).unsqueeze(
            1).expand(R, K).reshape(-1)
        tgt = torch.where(vflat, pos.view(-1),
                          torch.full_like(pos.view(-1), n))
        # one spare row takes every invalid slot's write; fp8 rows move as
        # bytes
        mk = torch.zeros if o.zero_pad else torch.empty
        xb = recv_x.view(torch.uint8) if recv_x.element_size() == 1 \
            else recv_x
        ex = mk((n + 1, recv_x.size(1)), dtype=xb.dtype, device=dev)
        ex[tgt] = xb[src_row]
        out_x = ex[:n].view(recv_x.dtype)
        out_sf = None
        if recv_sf is not None:
            es = mk((n + 1, recv_sf.size(1)), dtype=recv_sf.dtype,
                    device=dev)
            es[tgt] = recv_sf[src_row]
            out_sf = es[:n]
        out_w = None
        if topk_weights is not None or (cached and rtw is not None):
            ew = mk((n + 1,), dtype=torch.float32, device=dev)
            ew[tgt] = rtw.reshape(-1).to(torch.float32)
            out_w = ew[:n]
        return out_x, out_sf, None, out_w

    def _v2_handle(self, got, sl, topk_idx, T, K, out_x, o):
        """The handle of a fresh dispatch: each received row's source
        (rank * num_max_tokens_per_rank + token) and slots, the prefix
        sums per rank and per expert, and where each of this rank's (t, k)
        landed at its destination; it holds epd's routing."""
        torch = _torch()
        rp, rsrc, R = got.rp, got.rsrc, got.recv_x.size(0)
        dev = got.recv_x.device
        W, me = self.num_ranks, self.rank_idx
        i32 = torch.int32
        E, nmax = o.E, o.nmax
        src_rank = torch.bucketize(torch.arange(R, dtype=i32, device=dev),
                                   rp[:, me].contiguous(), right=True)
        gidx = src_rank.to(i32) * nmax + rsrc.to(i32)
        gidx = torch.where(rsrc >= 0, gidx, torch.full_like(gidx, -1))
        meta = torch.empty((R, 2 + K), dtype=i32, device=dev)
        meta[:, 0] = gidx
        meta[:, 1] = torch.arange(R, dtype=i32, device=dev)
        meta[:, 2:] = sl.pos.to(i32)
        psum_rank = rp[:, me].contiguous().to(i32)
        if o.do_expand:
            psum_e = (sl.start + sl.counts).to(i32)
        else:
            psum_e = torch.cumsum(sl.aligned, 0).to(i32)
        # where each of this rank's slots landed: the destination's row
        per = E // W
        d = torch.where(topk_idx >= 0, topk_idx // per,
                        torch.full_like(topk_idx, -1))
        onehot = torch.zeros((T, W + 1), dtype=i32, device=dev)
        onehot.scatter_(1, torch.where(d >= 0, d, torch.full_like(d, W)),
                        1)
        onehot = onehot[:, :W]
        before = torch.cumsum(onehot, 0) - onehot  # mine earlier, per rank
        base = rp[me] - onehot.sum(0)  # rows from ranks before me
        dst = torch.where(
            d >= 0,
            (base.unsqueeze(0) + before).gather(1, d.clamp(min=0)),
            torch.full_like(d, -1)).to(i32)
        tk = topk_idx.clone() if o.do_handle_copy else topk_idx
        num_recv = R  # the count itself with the CPU sync, else the worst
        nexp = out_x.size(0) if o.do_expand else \
            sum(sl.lst) if sl.lst is not None else 0
        hnd = EPHandle(o.do_expand, E, o.align, nmax, o.num_sms, tk,
                       num_recv, nexp, sl.lst, psum_rank, psum_e,
                       sl.counts if o.do_expand else None, meta, dst)
        hnd._rt, hnd._rti, hnd._pos = got.rt, got.rti, sl.pos
        hnd._buffer = weakref.ref(self)
        # the routing lives as long as the handle
        weakref.finalize(hnd, _shapes._release_all, got.rt.entries).atexit = \
            False
        return hnd

    # ---- combine ----

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0,
                num_qps=0, previous_event=None,
                previous_event_before_epilogue=None,
                async_with_compute_stream=False,
                allocate_on_comm_stream=False):
        """V2's combine: (combined_x [tokens, hidden] bf16,
        combined_topk_weights [tokens, top-k] f32 or None, event).

        Each token's sum starts from its bias (a pair: the first plus the
        second, in fp32) and adds, in fp32, one bf16 row from each rank
        it went to, in the order of each rank's last top-k slot; one
        rounding to bf16. x: the received rows' outputs (the dispatch's
        row order), or with an expanded handle one row per slot, which
        this rank first sums per token in slot order (fp32, rounded to
        bf16: V2's allow_multiple_reduction). topk_weights ([rows, top-k],
        or [slots] expanded): combined_topk_weights takes each slot's
        weight from the rank that holds that slot's expert."""
        torch = _torch()
        check_torch_deterministic()
        v1 = self._live()
        if not isinstance(handle, EPHandle) or handle._rt is None:
            raise ValueError("combine: not a handle of this ElasticBuffer's "
                             "dispatch")
        if handle._buffer is None or handle._buffer() is not self:
            raise ValueError("combine: the handle is another "
                             "ElasticBuffer's")
        if previous_event is not None and not allocate_on_comm_stream:
            raise ValueError("combine: previous_event needs "
                             "allocate_on_comm_stream=True")
        if num_qps and num_qps > self.num_allocated_qps:
            raise ValueError(f"combine: {num_qps} QPs, "
                             f"{self.num_allocated_qps} allocated")
        rt = handle._rt
        R, K = rt.R, rt.sub.K
        if x.dim() != 2 or x.dtype != torch.bfloat16:
            raise ValueError(f"combine: x must be 2-D bf16, got "
                             f"{list(x.shape)} {x.dtype}")
        comm = v1._comm if self._gpu else None
        compute = torch.cuda.current_stream() if self._gpu else None
        pos, rti = handle._pos, handle._rti
        if comm is not None:
            if previous_event is not None and previous_event.event is not \
                    None:
                comm.wait_event(previous_event.event)
            else:
                comm.wait_stream(compute)
        ctx = torch.cuda.stream(comm) if comm is not None else _Nothing()
        with ctx:
            if handle.do_expand:
                if not self.allow_multiple_reduction:
                    raise NotImplementedError(
                        "ElasticBuffer.combine: an expanded combine with "
                        "allow_multiple_reduction=False (each slot's row "
                        "summed on its home rank)")
                if x.size(0) < handle.num_expanded_tokens:
                    raise ValueError(
                        f"combine: x has {x.size(0)} rows, the expanded "
                        f"dispatch {handle.num_expanded_tokens}")
                y = _slot_sums(x, pos)
                w = None
                if topk_weights is not None:
                    if topk_weights.dim() != 1:
                        raise ValueError("combine: an expanded handle's "
                                         "topk_weights are [slots]")
                    w = torch.where(
                        pos >= 0, topk_weights.float()[pos.clamp(min=0)],
                        torch.zeros((), dtype=torch.float32, device=x.device))
            else:
                if x.size(0) < R or x.size(1) != rt.sub.H:
                    raise ValueError(f"combine: x must be [{R}, "
                                     f"{rt.sub.H}], got {list(x.shape)}")
                y = x[:R]
                w = None
                if topk_weights is not None:
                    if tuple(topk_weights.shape[1:]) != (K,) or \
                            topk_weights.size(0) < R:
                        raise ValueError(
                            f"combine: topk_weights must be [{R}, {K}], "
                            f"got {list(topk_weights.shape)}")
                    # each slot's weight from the rank holding its expert
                    w = topk_weights[:R].float().masked_fill(rti < 0, 0.0)
            ev0 = previous_event_before_epilogue
            if ev0 is not None and ev0.event is not None and comm is not None:
                comm.wait_event(ev0.event)
        # (epd's combine, ordered after the comm stream's work above)
        out, wout, _ = v1._combine(
            y, rt, w, bias, EventOverlap(EventHandle(comm)) if comm else None,
            True, True, topk=handle.topk_idx)
        return out, wout, self._finish(compute, comm, [out, wout],
                                       async_with_compute_stream,
                                       allocate_on_comm_stream)

    # ---- what epd does not run ----

    def _unsupported(self, what):
        raise NotImplementedError(
            f"ElasticBuffer.{what}: not supported by epd's deep_ep (the "
            f"daemon runs expert-parallel dispatch, combine and barriers)")

    def engram_write(self, storage, sf=None):
        self._unsupported("engram_write")

    def engram_fetch(self, indices, num_qps=0):
        self._unsupported("engram_fetch")

    def pp_set_config(self, num_max_tensor_bytes, num_max_inflight_tensors):
        self._unsupported("pp_set_config")

    def pp_send(self, t, dst_rank_idx, num_sms=0):
        self._unsupported("pp_send")

    def pp_recv(self, t, src_rank_idx, num_sms=0):
        self._unsupported("pp_recv")

    def create_agrs_session(self):
        self._unsupported("create_agrs_session")

    def destroy_agrs_session(self):
        self._unsupported("destroy_agrs_session")

    def agrs_new_session(self, enabled=True):
        self._unsupported("agrs_new_session")

    def agrs_set_config(self, num_max_session_bytes, *args, **kwargs):
        self._unsupported("agrs_set_config")

    def agrs_get_inplace_tensor(self, *args, **kwargs):
        self._unsupported("agrs_get_inplace_tensor")

    def all_gather(self, t):
        self._unsupported("all_gather")


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _col_major(sf):
    """sf [n, g] as a TMA-aligned column-major view: element (i, j) at
    j * align(n, 4) + i (the same values)."""
    torch = _torch()
    n, g = sf.shape
    ld = _round_up(max(n, 1), 4)
    st = torch.empty((g, ld), dtype=sf.dtype, device=sf.device)
    st[:, :n] = sf.t()
    return st.t()[:n]


def _slot_sums(x, pos):
    """Per received token, its slots' rows of x (pos [R, K], -1: none)
    summed in slot order in fp32 from +0.0, rounded once to bf16."""
    torch = _torch()
    R, K = pos.shape
    acc = torch.zeros((R, x.size(1)), dtype=torch.float32, device=x.device)
    for k in range(K):
        p = pos[:, k]
        rows = x[p.clamp(min=0)].float()
        acc += torch.where((p >= 0).unsqueeze(1), rows,
                           torch.zeros((), dtype=torch.float32,
                                       device=x.device))
    return acc.to(torch.bfloat16)
