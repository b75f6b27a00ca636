# SPDX-License-Identifier: MIT
"""DeepEP's low-latency calls of the Buffer (legacy.py), as a class the
Buffer takes them from.

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
import weakref

import epd
from ..utils.event import EventHandle, EventOverlap
from ..utils.envs import check_torch_deterministic
from ..utils.math import per_token_cast_to_fp8
from .shapes import _torch, _release_all, _ue8m0_pack, _Sub


# num_rdma_bytes -> (num_max_dispatch_tokens_per_rank, hidden, num_ranks,
# num_experts) of get_low_latency_rdma_size_hint's answers in this process
_LL_HINTS = {}
# the top-k room of a low-latency group joined at construction (shrink)
_LL_SHRINK_TOPK = 16

class LowLatency:
    """The Buffer's low-latency calls and shrink mode (DeepEP's
    low_latency_*, clean_low_latency_buffer, the mask buffer)."""

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
