# SPDX-License-Identifier: MIT
"""epd's deep_ep (DeepEP's normal-mode Buffer) against a daemon, with 2 and
4 rank processes over a gloo group ($EPD_TEST_WORLDS), on the host backend
with CPU tensors, or (EPD_TEST_BACKEND=cuda) on the GPU. Every output is
compared bitwise with a reference written here from DeepEP's documented
semantics: get_dispatch_layout, dispatch (bf16, fp8 with column-major
scales, with and without top-k, expert_alignment, num_worst_tokens,
async_finish, previous_event), rank_prefix_matrix and recv_src_idx in the
handle, cached dispatch, combine of rows (with a bias) and of top-k
weights, low-latency dispatch (per-expert layout, src_info,
layout_range, counts, fp8 where torch has it) and its weighted combine,
handles alive over 20 layers and released when dropped, one rank with too
many tokens (every rank raises), and the clear errors. Skipped (77)
without torch. On GPU ranks the low-latency ops run on epd's kernels
(their fp8 cast included) where they apply (MPS where ranks share the
GPU: EPD_TEST_LL_PATH=kernels or daemon checks which path ran and why);
EPD_DEEP_EP_LL_KERNELS=0 keeps them on the daemon's path."""
import gc
import os
import sys
import time

from torch_ranks import (held_handles, on_two_nodes, run_ranks, start_epd,
                         stop_epd)

# EPD_TEST_HIDDEN (a multiple of 128; 512 or more: UE8M0 scales on the
# low-latency kernels too)
H = int(os.environ.get("EPD_TEST_HIDDEN", "256"))
K, E = 4, 16
SEED = int(os.environ.get("EPD_TEST_SEED", int(time.time())))
CUDA = os.environ.get("EPD_TEST_BACKEND", "host") == "cuda"


def tokens(r):
    return [37, 0, 64, 5, 21, 64, 1, 50][r % 8]


def gen(torch, r, salt):
    g = torch.Generator()
    g.manual_seed(SEED * 1009 + r * 31 + salt)
    return g


def inputs(torch, r, W, salt=0):
    """Rank r's inputs (salt changes the data, never the routing)."""
    T = tokens(r)
    g, gr = gen(torch, r, salt), gen(torch, r, 0)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    q = torch.randint(0, 256, (T, H), generator=g, dtype=torch.int32).to(
        torch.uint8)
    q[(q & 0x7F) == 0x7F] = 0  # no NaN patterns in the e4m3 bytes
    sc = torch.rand((T, H // 128), generator=g) + 0.5
    idx = torch.rand((T, E), generator=gr).argsort(dim=1)[:, :K]
    idx[torch.rand((T, K), generator=gr) < 0.2] = -1
    w = torch.rand((T, K), generator=g)
    bias = torch.randn((T, H), generator=g).to(torch.bfloat16)
    return dict(T=T, x=x, q=q, sc=sc, idx=idx.long(), w=w, bias=bias)


def ref_world(torch, W, salt=0):
    ins = [inputs(torch, r, W, salt) for r in range(W)]
    per = E // W
    recv = []
    for d in range(W):
        rows = []  # (source, token), source-major
        for s in range(W):
            for t in range(ins[s]["T"]):
                if any(e >= 0 and e // per == d for e in ins[s]["idx"][t].tolist()):
                    rows.append((s, t))
        recv.append(rows)
    return ins, recv


def gather(ins, rows, key, torch):
    if not rows:
        return ins[0][key][:0]
    return torch.stack([ins[s][key][t] for s, t in rows])


def same(a, b, what):
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype:
        raise AssertionError(f"{what}: dtype {a.dtype} != {b.dtype}")
    if a.shape != b.shape or not torch_equal(a, b):
        raise AssertionError(f"{what}: differs ({list(a.shape)} vs "
                             f"{list(b.shape)})")


def torch_equal(a, b):
    import torch
    if a.dtype in (torch.bfloat16, torch.float32, torch.float16):
        a, b = a.contiguous().view(torch.int16 if a.element_size() == 2
                                   else torch.int32), \
            b.contiguous().view(torch.int16 if b.element_size() == 2
                                else torch.int32)
    return torch.equal(a, b)


def ref_ll_cast(torch, x, round_scale):
    """DeepEP's low-latency fp8 cast as documented: per 128 channels,
    scale = max(amax, 1e-4) * (1 / 448) (a product, as DeepEP's kernel
    computes it), rounded up to a power of two with round_scale (here
    through frexp) and values times 1 / scale, else values times
    fl(448 / amax), one correctly rounded division as DeepEP's kernel
    computes it (a tensor by a tensor: torch's 448.0 / amax would be
    reciprocal(amax) * 448, rounded twice, and differs in the last bit)."""
    m = x.size(0)
    xb = x.float().view(m, H // 128, 128)
    amax = xb.abs().amax(dim=2).clamp(min=1e-4)
    if round_scale:
        mant, ex = torch.frexp(amax * (1.0 / 448.0))
        ex = torch.where(mant == 0.5, ex - 1, ex)
        s = torch.ldexp(torch.ones_like(amax), ex)
        q = xb * (1.0 / s).unsqueeze(2)
    else:
        s = amax * (1.0 / 448.0)
        q = xb * (torch.full_like(amax, 448.0) / amax).unsqueeze(2)
    return q.to(torch.float8_e4m3fn).view(m, H), s


def ll_checks(torch, buf, ins, r, W, D):
    """DeepEP's low-latency dispatch and combine against a reference built
    from every rank's inputs: each local expert's rows in source rank
    order, then token order; src_info, layout_range, counts; fp8 with
    fp32 or UE8M0 scales; the combine's weighted sum in fp32 over top-k at
    home; zero copy; too many tokens on every rank."""
    per, N = E // W, 64
    me, T = ins[r], ins[r]["T"]
    fp8 = hasattr(torch, "float8_e4m3fn")
    modes = [(False, False, False)]
    if fp8:
        modes += [(True, False, False), (True, True, False), (True, True, True)]
    u8 = lambda t: t.cpu().contiguous().view(torch.uint8)  # noqa: E731
    for n, (use_fp8, rnd, ue8m0) in enumerate(modes):
        stats = D(torch.full((per,), 3, dtype=torch.int32))
        recv, cnt, handle, ev, hook = buf.low_latency_dispatch(
            D(me["x"]), D(me["idx"]), N, E,
            cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
            round_scale=rnd, use_ue8m0=ue8m0, async_finish=n % 2 == 1,
            return_recv_hook=n % 2 == 0)
        hook() if n % 2 == 0 else ev.current_stream_wait()
        if n == 0:
            # the path the first op took: EPD_TEST_LL_PATH says which one
            # the run expects (kernels: GPU ranks under MPS; daemon: host
            # ranks, or ranks sharing a GPU without MPS, refused by libep)
            path, why = buf._ll_path()
            want = os.environ.get("EPD_TEST_LL_PATH")
            assert want in (None, path), ("low-latency path", path, why)
            if want == "daemon" and CUDA and os.environ.get(
                    "EPD_DEEP_EP_LL_KERNELS") != "0":
                assert "MPS" in why, why
        src_info, layout, hn, hh, he = handle
        assert (hn, hh, he) == (N, H, E), handle[2:]
        for i in range(per):
            eg = r * per + i
            rows = [(s, t) for s in range(W) for t in range(ins[s]["T"])
                    for k in range(K) if int(ins[s]["idx"][t, k]) == eg]
            c = len(rows)
            what = f"low-latency expert {i} ({use_fp8=}, {rnd=}, {ue8m0=})"
            assert int(cnt[i]) == c, (what, int(cnt[i]), c)
            assert int(stats[i]) == c + 3, (what, "stats", stats.tolist(),
                                            cnt.tolist())
            same(src_info[i, :c], torch.tensor([t for _, t in rows],
                                               dtype=torch.int32),
                 what + ": src_info")
            want_l, b = [], 0
            for s in range(W):
                k_s = sum(1 for s2, _ in rows if s2 == s)
                want_l.append((b << 32) | k_s)
                b += k_s
            same(layout[i], torch.tensor(want_l, dtype=torch.int64),
                 what + ": layout_range")
            wx = gather(ins, rows, "x", torch).reshape(c, H)
            if not use_fp8:
                same(recv[i, :c], wx, what + ": rows")
                continue
            q, s = ref_ll_cast(torch, wx, rnd)
            assert torch.equal(u8(recv[0][i, :c]), u8(q)), what + ": fp8 rows"
            if ue8m0:
                e8 = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
                pad = (-e8.size(1)) % 4
                e8 = torch.cat([e8, torch.zeros((c, pad), dtype=torch.uint8)], 1)
                same(recv[1][i, :c], e8.contiguous().view(torch.int32),
                     what + ": UE8M0 scales")
            else:
                same(recv[1][i, :c], s, what + ": scales")
        del recv, handle, src_info, layout
    # combine: each expert returns its rows times 2^(expert % 4) (exact)
    recv, cnt, handle, _, _ = buf.low_latency_dispatch(
        D(me["x"]), D(me["idx"]), N, E, use_fp8=False)
    y = recv.clone()
    for i in range(per):
        y[i] = (recv[i].float() * 2.0 ** ((r * per + i) % 4)).to(torch.bfloat16)
    acc = torch.zeros((T, H), dtype=torch.float32)
    for k in range(K):
        e = me["idx"][:, k]
        term = me["x"].float() * torch.pow(2.0, (e % 4).float()).unsqueeze(1) \
            * me["w"][:, k:k + 1]
        acc = torch.where((e >= 0).unsqueeze(1), acc + term, acc)
    want = acc.to(torch.bfloat16)
    out = D(torch.empty((T, H), dtype=torch.bfloat16))
    got, ev, hook = buf.low_latency_combine(y, D(me["idx"]), D(me["w"]),
                                            handle, out=out,
                                            return_recv_hook=True)
    hook()
    assert got.data_ptr() == out.data_ptr(), "combine did not fill out="
    same(got, want, "low-latency combine")
    buf.get_next_low_latency_combine_buffer(handle)[:] = y
    got, ev, _ = buf.low_latency_combine(torch.empty(0), D(me["idx"]),
                                         D(me["w"]), handle, zero_copy=True,
                                         async_finish=True)
    ev.current_stream_wait()
    same(got, want, "low-latency combine, zero copy")
    del recv, handle, y
    # more tokens than num_max_dispatch_tokens_per_rank on some rank:
    # every rank raises, and the group of the shape goes on
    # (on epd's own kernels the rank over raises at once, the others find
    # ETOOBIG in their kernels' error word)
    kern = buf._ll_path()[0] == "kernels"
    over = tokens(r) > 16 if kern else max(tokens(s) for s in range(W)) > 16
    try:
        buf.low_latency_dispatch(D(me["x"]), D(me["idx"]), 16, E,
                                 use_fp8=False)
        ok = not over
    except ValueError as e:
        assert "num_max_dispatch_tokens_per_rank=16" in str(e), e
        ok = over
    assert ok, "too many low-latency tokens: no error, or an error for none"
    small = {k: v[:min(T, 16)] for k, v in me.items() if k != "T"}
    recv, cnt, handle, _, _ = buf.low_latency_dispatch(
        D(small["x"]), D(small["idx"]), 16, E, use_fp8=False)
    del recv, handle


def one_node_gpu(buf, W):
    """GPU ranks of one node (receive areas, registered memory)."""
    return CUDA and buf._rpn == W


def rank_main(torch, dist, group, r, W):
    sock = os.environ["EPD_SOCKET"]  # this rank's node
    import epd.deep_ep as deep_ep
    if not CUDA:
        # shrink mode runs on epd's low-latency kernels (GPU ranks)
        try:
            deep_ep.Buffer(group, 0, 1 << 20, low_latency_mode=True,
                           enable_shrink=True, explicitly_destroy=True)
            raise AssertionError("a host rank's shrink-mode Buffer")
        except NotImplementedError as e:
            assert "kernels" in str(e), e
    buf = deep_ep.Buffer(group, int(1e9), 0, explicitly_destroy=True)
    checks(torch, dist, deep_ep, buf, group, r, W, sock)
    buf.destroy()
    # a recv_x tensor kept from checks() still holds its rows
    global KEPT
    (insS, rx), = KEPT
    rows = ref_world(torch, W)[1][r]
    same(rx, gather(insS, rows, "x", torch).reshape(len(rows), H),
         "recv_x after the Buffer's end")
    KEPT = None
    del rx
    global KEPT_OUT
    out, want = KEPT_OUT
    same(out, want, "a combine's output after the Buffer's end")
    KEPT_OUT = None
    del out
    gc.collect()


KEPT = None
KEPT_OUT = None


def dev(torch, t):
    return t.cuda() if CUDA else t


def checks(torch, dist, deep_ep, buf, group, r, W, sock):
    per = E // W
    ins, recv = ref_world(torch, W)
    ins2, _ = ref_world(torch, W, salt=1)
    me, rows = ins[r], recv[r]
    T, R = me["T"], len(rows)
    D = lambda t: dev(torch, t)  # noqa: E731

    # Layout vs a computation with Python loops.
    pr, prr, pe, inr, _ = buf.get_dispatch_layout(D(me["idx"]), E)
    assert prr is None
    want_pe = [sum(1 for t in range(T) for e in me["idx"][t].tolist()
                   if e == i) for i in range(E)]
    want_in = [[any(e >= 0 and e // per == d for e in me["idx"][t].tolist())
                for d in range(W)] for t in range(T)]
    same(pe, torch.tensor(want_pe, dtype=torch.int32), "num_tokens_per_expert")
    same(inr, torch.tensor(want_in, dtype=torch.bool).reshape(T, W),
         "is_token_in_rank")
    same(pr, torch.tensor([sum(row[d] for row in want_in) for d in range(W)],
                          dtype=torch.int32), "num_tokens_per_rank")

    # The expected results on this rank.
    src = torch.tensor([t for _, t in rows], dtype=torch.int32)
    rp = torch.zeros((W, W), dtype=torch.int32)
    for d in range(W):
        for s in range(W):
            rp[s][d] = sum(1 for s2, _ in recv[d] if s2 <= s)
    ridx = gather(ins, rows, "idx", torch).reshape(R, K)
    local = (ridx >= 0) & (ridx // per == r)
    want_idx = torch.where(local, ridx - r * per, torch.full_like(ridx, -1))
    want_w = torch.where(local, gather(ins, rows, "w", torch).reshape(R, K),
                         torch.zeros((R, K)))
    cnt = [int((want_idx == i).any(dim=1).sum()) for i in range(per)]
    glob = [sum(int((ins[s]["idx"] == r * per + i).sum()) for s in range(W))
            for i in range(per)]

    def dispatch(x, **kw):
        a = kw.pop("async_", False)
        if kw.pop("previous", False):
            kw["previous_event"] = buf.capture()
        out = buf.dispatch(x, async_finish=a, **kw)
        if a:
            out[5].current_stream_wait()
        return out

    layout = dict(num_tokens_per_rank=pr, is_token_in_rank=inr,
                  num_tokens_per_expert=pe)
    handles = {}
    for fmt in ("bf16", "fp8"):
        for with_topk in (True, False):
            for a_, prev in ((False, False), (True, False), (False, True),
                             (True, True)):
                if fmt == "fp8":
                    # e4m3 bytes and column-major fp32 scales (DeepGEMM's)
                    xq = D(me["q"])
                    if CUDA and hasattr(torch, "float8_e4m3fn"):
                        xq = xq.view(torch.float8_e4m3fn)
                    x = (xq, D(me["sc"]).T.contiguous().T)
                else:
                    x = D(me["x"])
                kw = dict(layout)
                align = 4 if a_ else 1
                if with_topk:
                    kw.update(topk_idx=D(me["idx"]), topk_weights=D(me["w"]),
                              expert_alignment=align)
                rx, ri, rw, lst, h, _ = dispatch(x, async_=a_, previous=prev,
                                                 **kw)
                tag = f"{fmt} topk={with_topk} async={a_} prev={prev}"
                if fmt == "fp8":
                    same(rx[0].view(torch.uint8),
                         gather(ins, rows, "q", torch).reshape(R, H),
                         f"{tag}: recv_x")
                    same(rx[1], gather(ins, rows, "sc", torch).reshape(
                        R, H // 128), f"{tag}: recv_x_scales")
                else:
                    same(rx, gather(ins, rows, "x", torch).reshape(R, H),
                         f"{tag}: recv_x")
                same(h[0], rp, f"{tag}: rank_prefix_matrix")
                same(h[3], src, f"{tag}: recv_src_idx")
                if with_topk:
                    same(ri, want_idx, f"{tag}: recv_topk_idx")
                    same(rw, want_w, f"{tag}: recv_topk_weights")
                    assert lst == [(c + align - 1) // align * align
                                   for c in cnt], (tag, lst, cnt)
                else:
                    assert ri is None and rw is None, tag
                    assert lst == glob, (tag, lst, glob)
                handles[(fmt, with_topk)] = h

                if with_topk and not prev:
                    # outputs padded to a fixed size; no CPU sync
                    worst = W * 64
                    wx, wi, ww, wl, wh, _ = dispatch(
                        x, async_=a_, num_worst_tokens=worst, **kw)
                    assert wl == [], tag
                    wx0 = wx[0] if fmt == "fp8" else wx
                    assert wx0.size(0) == worst and wi.size(0) == worst
                    assert ww.size(0) == worst, tag
                    if fmt == "fp8":
                        same(wx0[:R].view(torch.uint8), rx[0].view(torch.uint8),
                             f"{tag}: worst recv_x")
                    else:
                        same(wx0[:R], rx, f"{tag}: worst recv_x")
                    same(wi[:R], ri, f"{tag}: worst recv_topk_idx")
                    same(ww[:R], rw, f"{tag}: worst recv_topk_weights")
                    assert bool((wi[R:] == -1).all()), f"{tag}: padding"
                    # its combine takes the padded rows
                    yw = torch.zeros((worst, H), dtype=torch.bfloat16)
                    yw[:R] = rx.cpu() if fmt == "bf16" else \
                        gather(ins, rows, "x", torch).reshape(R, H)
                    cw, _, _ = buf.combine(D(yw), wh)
                    wantc = ref_combine(torch, ins, recv, r, W,
                                        lambda d, s, t: ins[s]["x"][t])
                    same(cw, wantc, f"{tag}: combine of a worst-size handle")

                # cached dispatch of new data: the routing's rows
                if fmt == "fp8":
                    xq2 = D(ins2[r]["q"])
                    if CUDA and hasattr(torch, "float8_e4m3fn"):
                        xq2 = xq2.view(torch.float8_e4m3fn)
                    cx = dispatch((xq2, D(ins2[r]["sc"])), handle=h,
                                  async_=a_, previous=prev)[0]
                    same(cx[0].view(torch.uint8),
                         gather(ins2, rows, "q", torch).reshape(R, H),
                         f"{tag}: cached recv_x")
                else:
                    cx = dispatch(D(ins2[r]["x"]), handle=h, async_=a_,
                                  previous=prev)[0]
                    same(cx, gather(ins2, rows, "x", torch).reshape(R, H),
                         f"{tag}: cached recv_x")

    # fp8 with DeepEP's UE8M0 scales (int32, four exponent bytes each):
    # the receiver gets the same packed words, fresh and cached
    def ue8m0(rk, salt):
        g = gen(torch, rk, 50 + salt)
        e = torch.randint(100, 150, (tokens(rk), H // 128), generator=g,
                          dtype=torch.int32).to(torch.uint8)
        pad = torch.zeros((tokens(rk), (-(H // 128)) % 4), dtype=torch.uint8)
        return torch.cat([e, pad], dim=1).contiguous().view(torch.int32)
    xq = D(me["q"])
    if CUDA and hasattr(torch, "float8_e4m3fn"):
        xq = xq.view(torch.float8_e4m3fn)
    rx, _, _, _, hu, _ = buf.dispatch((xq, D(ue8m0(r, 0))), topk_idx=D(me["idx"]),
                                      **layout)
    want = torch.stack([ue8m0(s, 0)[t] for s, t in rows]) if rows else \
        ue8m0(r, 0)[:0]
    same(rx[1], want, "UE8M0 recv_x_scales")
    cx = buf.dispatch((xq, D(ue8m0(r, 1))), handle=hu)[0]
    want = torch.stack([ue8m0(s, 1)[t] for s, t in rows]) if rows else \
        ue8m0(r, 1)[:0]
    same(cx[1], want, "UE8M0 cached recv_x_scales")
    del hu

    # Outputs are fresh tensors. GPU ranks of one node get the received
    # rows in a receive area handed out as recv_x (no copy) until the tensor
    # is freed (areas 1 and 2 of 3); outputs past that are copies (and all
    # of them on host ranks and across nodes, where a group has one area).
    # Each keeps its bytes through the later dispatches, a freed area is
    # used again, and a tensor outlives the Buffer (rank_main's end).
    sub = buf._subs[(H, False, K, E)]
    # the dispatches without top-k went through the top-k shapes
    # (K >= W), and the Buffer's 1e9 bytes held 3 areas each
    assert K < W or not any(k[2:] == (W, W) for k in buf._subs
                            if len(k) == 4), list(buf._subs)
    areas = 3 if one_node_gpu(buf, W) else 1
    assert sub.g.recv_areas == areas, (sub.g.recv_areas, areas)
    global KEPT
    gc.collect()
    base, free0 = sub.leases, len(sub.free)  # (earlier outputs alive)
    assert base + free0 == areas - 1, (base, free0)
    kept = []
    for salt in range(20, 26):
        insS, _ = ref_world(torch, W, salt=salt)
        kept.append((insS, buf.dispatch(D(insS[r]["x"]),
                                         topk_idx=D(me["idx"]),
                                         **layout)[0]))
    assert sub.leases == base + (min(free0, 6) if R else 0), sub.leases
    for insS, rx in kept:
        same(rx, gather(insS, rows, "x", torch).reshape(R, H),
             "recv_x kept through later dispatches")
    KEPT = kept[:1]  # checked after the Buffer's end
    del kept, insS, rx
    gc.collect()
    one = 1 if free0 and R else 0  # KEPT's
    assert sub.leases == base + one, sub.leases
    assert len(sub.free) == free0 - one, (len(sub.free), free0)
    rx = buf.dispatch(D(me["x"]), topk_idx=D(me["idx"]), **layout)[0]
    same(rx, gather(ins, rows, "x", torch).reshape(R, H),
         "recv_x in an area used again")
    del rx

    # A cached dispatch in the other dtype than the handle's dispatch
    # (DeepEP's routing does not depend on it): twice, the second time on
    # the handle the first one made in that dtype's group.
    for (fmt, with_topk), h in handles.items():
        for _ in range(2):
            if fmt == "bf16":
                xq2 = D(ins2[r]["q"])
                if CUDA and hasattr(torch, "float8_e4m3fn"):
                    xq2 = xq2.view(torch.float8_e4m3fn)
                cx = buf.dispatch((xq2, D(ins2[r]["sc"])), handle=h)[0]
                same(cx[0].view(torch.uint8),
                     gather(ins2, rows, "q", torch).reshape(R, H),
                     f"fp8 cached dispatch on a bf16 handle (topk={with_topk})")
            else:
                cx = buf.dispatch(D(ins2[r]["x"]), handle=h)[0]
                same(cx, gather(ins2, rows, "x", torch).reshape(R, H),
                     f"bf16 cached dispatch on a fp8 handle (topk={with_topk})")

    # Combine: random rows per destination, summed in fp32 from the bias
    # in ascending rank order, one rounding to bf16; and the weights.
    def yrow(d, s, t):
        return ys[d][recv[d].index((s, t))]
    ys = [torch.randn((len(recv[d]), H), generator=gen(torch, d, 7)).to(
        torch.bfloat16) for d in range(W)]
    wys = [torch.randn((len(recv[d]), K), generator=gen(torch, d, 8))
           for d in range(W)]
    for with_topk in (True, False):
        h = handles[("bf16", with_topk)]
        for a_, prev in ((False, False), (True, True)):
            kw = dict(async_finish=a_)
            if prev:
                kw["previous_event"] = buf.capture()
            tw = D(wys[r]) if with_topk else None
            out, ow, ev = buf.combine(D(ys[r]), h, topk_weights=tw, **kw)
            if a_:
                ev.current_stream_wait()
            same(out, ref_combine(torch, ins, recv, r, W, yrow),
                 f"combine topk={with_topk} async={a_}")
            if with_topk:
                wr = torch.zeros((T, K))
                for d in range(W):
                    for i, (s, t) in enumerate(recv[d]):
                        if s == r:
                            wr[t] += wys[d][i]
                same(ow, wr, "combined_topk_weights")
            else:
                assert ow is None
        out, _, _ = buf.combine(D(ys[r]), h, bias=D(me["bias"]))
        same(out, ref_combine(torch, ins, recv, r, W, yrow, me["bias"]),
             "combine with a bias")
        out, _, _ = buf.combine(D(ys[r]), h, bias=(D(me["bias"]), None))
        same(out, ref_combine(torch, ins, recv, r, W, yrow, me["bias"]),
             "combine with a bias as a pair (bias, None)")
        b2 = ins2[r]["bias"]
        out, _, _ = buf.combine(D(ys[r]), h, bias=(D(me["bias"]), D(b2)))
        same(out, ref_combine(torch, ins, recv, r, W, yrow, me["bias"], b2),
             "combine with a pair of biases")
        out, _, _ = buf.combine(D(ys[r]), h, bias=(None, D(b2)))
        same(out, ref_combine(torch, ins, recv, r, W, yrow, None, b2),
             "combine with (None, bias)")
    # a fp8 handle's combine takes bf16 rows
    out, _, _ = buf.combine(D(ys[r]), handles[("fp8", True)])
    want = ref_combine(torch, ins, recv, r, W, yrow)
    same(out, want, "combine (fp8 handle)")
    # kept past the Buffer's end (an output slot's tensor with expandable
    # segments: its memory must outlive the group)
    global KEPT_OUT
    KEPT_OUT = (out, want)
    from epd.deep_ep.buffers import shapes as _shapes
    if one_node_gpu(buf, W) and _shapes.expandable_segments():
        # expandable segments (the caller's setting, or the one the
        # Buffer made unless $EPD_DEEP_EP_EXPANDABLE=0): the combines
        # above read the rows where torch put them
        # (registered memory, which groups across nodes do not take), not
        # through a copy: checked bit for bit against the reference all
        # the same
        placed = [s_.in_place for s_ in buf._subs.values()
                  if hasattr(s_, "in_place")]
        assert any(p_["rows"] for p_ in placed), \
            "expandable segments: no combine read its rows in place"
        assert not T or any(p_["out"] for p_ in placed), \
            "expandable segments: no combine wrote its output in place"
        print(f"ok: rank {r}: combines read torch's rows and wrote their "
              "outputs in place (registered memory)", flush=True)
    elif CUDA and not _shapes.expandable_segments():
        # torch's default allocator ($EPD_DEEP_EP_EXPANDABLE=0): not
        # memory the daemon can import; the first try said so
        # (EP_EUNSUPPORTED) and the rows are copied
        for s_ in buf._subs.values():
            assert not getattr(s_, "mregs", None), "registered without " \
                "expandable segments"

    # Clear errors.
    h = handles[("bf16", True)]
    for bad, exc in ((lambda: buf.combine(D(ys[r][:0] if R else
                                            torch.zeros((1, H), dtype=torch.bfloat16)), h),
                      ValueError),
                     (lambda: buf.combine(D(ys[r]), h,
                                          bias=D(me["bias"].float())),
                      ValueError),
                     # the mask needs shrink mode
                     (lambda: buf.low_latency_update_mask_buffer(0, True),
                      ValueError),
                     (lambda: buf.low_latency_query_mask_buffer(
                         torch.zeros(W, dtype=torch.int32)), ValueError),
                     (lambda: buf.combine(D(ys[r]), (1, 2, 3)), ValueError)):
        try:
            bad()
            raise AssertionError(f"no {exc.__name__}")
        except exc:
            pass
    # one rank dispatches more tokens than the shape's group was sized
    # for: every rank raises at once (the others from the daemon, naming
    # that rank, not after the group's timeout), and the group goes on
    # (the layers below)
    big_rank = W - 1
    nbig = 129 if T <= 128 else 2 * T
    t0 = time.monotonic()
    try:
        if r == big_rank:
            big = D(torch.zeros((nbig, H), dtype=torch.bfloat16))
            buf.dispatch(big, handle=None, topk_idx=D(torch.full(
                (nbig, K), -1, dtype=torch.long)),
                num_tokens_per_rank=None, is_token_in_rank=None,
                num_tokens_per_expert=layout["num_tokens_per_expert"])
        else:
            buf.dispatch(D(me["x"]), topk_idx=D(me["idx"]), **layout)
        raise AssertionError("no error for too many tokens")
    except ValueError as e:
        assert "EPD_DEEP_EP_MAX_TOKENS" in str(e), e
        if r != big_rank:
            assert f"rank {big_rank}" in str(e), e
    took = time.monotonic() - t0
    assert took < 5, f"too many tokens reported after {took:.1f} s"
    # the failed op's outputs were dropped while its copies may have been
    # queued: memory allocated right after holds what is written there
    # (a finding of this test: the copies landed in the next tensors)
    fresh = [D(torch.full((64,), 1000 + j, dtype=torch.int32))
             for j in range(32)]
    if CUDA:
        torch.cuda.synchronize()
    for j, f in enumerate(fresh):
        assert bool((f == 1000 + j).all()), ("memory after a failed op",
                                             j, f[:8].tolist())
    del fresh

    ll_checks(torch, buf, ins, r, W, D)

    # 20 layers' handles alive from forward to backward: combine in
    # reverse order; then every handle is released when dropped.
    layers = []
    for i in range(20):
        xi = D(inputs(torch, r, W, salt=100 + i)["x"])
        rx, _, _, _, hi, _ = buf.dispatch(xi, topk_idx=D(me["idx"]), **layout)
        layers.append((i, rx, hi))
    for i, rx, hi in reversed(layers):
        out, _, _ = buf.combine(rx, hi)
        li = [dict(ins[s], x=inputs(torch, s, W, salt=100 + i)["x"])
              for s in range(W)]
        same(out, ref_combine(torch, li, recv, r, W, None, xsum=True),
             f"layer {i}: combine of its own rows")
    held_before = held_handles(buf._conn)
    assert held_before > 0, "handles alive, but the daemon holds none"
    del layers, handles, h, hi, wh
    gc.collect()
    dist.barrier(group)
    for _ in range(100):
        if held_handles(buf._conn) == 0:
            break
        time.sleep(0.05)
    left = held_handles(buf._conn)
    assert left == 0, f"{left} handles still held after every rank dropped them"
    # libep's low-latency mode across nodes (GPU ranks): its pseudo groups
    # keep at most their two buffers' last routings, each counted twice
    # (a GPU group across nodes: the device routing and the daemons' host
    # one), however many ops ran
    ll_held, ll_groups = held_handles(buf._conn, ll=True)
    assert ll_held <= 4 * ll_groups, (ll_held, ll_groups)


def ref_combine(torch, ins, recv, h, W, row, bias=None, bias2=None,
                xsum=False):
    T = ins[h]["T"]
    acc = bias.float().clone() if bias is not None else torch.zeros((T, H))
    if bias2 is not None:
        acc += bias2.float()
    for d in range(W):
        for i, (s, t) in enumerate(recv[d]):
            if s == h:
                acc[t] += (ins[s]["x"][t] if xsum else row(d, s, t)).float()
    return acc.to(torch.bfloat16)


def lease_bookkeeping():
    """The receive areas' bookkeeping of the shim without a GPU (the GPU
    run checks the data): areas taken in order, given back with the event
    recorded when the tensor died, none while a capture runs, kept when no
    event can be made; leaving the group waits for the last live recv_x."""
    from epd.deep_ep.buffers import shapes

    class Ev:
        def record(self):
            self.recorded = True

    class Cuda:
        capturing, broken = False, False

        def is_current_stream_capturing(self):
            return self.capturing

        def Event(self):
            if self.broken:
                raise RuntimeError("no CUDA")
            return Ev()

    class Torch:
        cuda = Cuda()

    class G:
        left = 0

        def leave(self):
            self.left += 1

    saved = shapes._torch
    shapes._torch = lambda: Torch
    try:
        sub = shapes._Sub.__new__(shapes._Sub)
        sub.g, sub.leases, sub.leaving = G(), 0, False
        sub.free = [(a, None) for a in range(3, 0, -1)]  # areas 1..3
        g = sub.g
        a1, a2 = sub.take(), sub.take()
        assert (a1, a2) == ((1, None), (2, None)), (a1, a2)
        l1, l2 = shapes._Lease(sub, 1), shapes._Lease(sub, 2)
        assert sub.leases == 2
        del l1  # freed: back with its event
        assert sub.leases == 1 and sub.free[-1][0] == 1 and \
            sub.free[-1][1].recorded
        Torch.cuda.capturing = True
        l3 = shapes._Lease(sub, sub.take()[0])
        del l3  # freed inside a capture: back without an event
        assert sub.free[-1] == (1, None), sub.free
        Torch.cuda.capturing = False
        sub.leave()  # l2 lives: the group stays
        assert g.left == 0 and sub.leaving and sub.g is g
        Torch.cuda.broken = True
        del l2  # no event can be made: the area stays taken, the group goes
        assert sub.leases == 0 and all(a != 2 for a, _ in sub.free)
        assert g.left == 1 and sub.g is None
        assert sub.take() == (0, None)  # a left group hands out nothing
    finally:
        shapes._torch = saved
    print("ok: receive area bookkeeping (taken in order, given back with "
          "their event, none in a capture, leave after the last recv_x)")


def shape_sharing():
    """How the Buffer sizes its shapes' groups, with stand-ins: areas past
    the first only from what is left of the bytes DeepEP's Buffer was
    given, at least one, $EPD_DEEP_EP_RECV_AREAS over both; a dispatch
    from is_token_in_rank alone shares a top-k shape with at least W
    slots, its ranks' first experts as the top-k."""
    import torch
    from epd.deep_ep.buffers import legacy, shapes
    H, T, W = 7168, 4096, 8
    fixed, per = shapes._region_bytes(H, False, 8, T, W * T)
    assert per == W * T * H * 2, per
    # combine_y alone is a full area's size
    assert fixed > W * T * H * 2, fixed

    class B:
        _device, _rpn, group_size = 0, W, W
        _mem_given, _mem_used = int(2e9), 0
    b = B()
    n = shapes._recv_areas(b, "", fixed, per)
    assert n == (int(2e9) - fixed) // per == 2, n
    b._mem_used = int(2e9) - fixed  # nothing left past the first area
    assert shapes._recv_areas(b, "", fixed, per) == 1
    b._mem_used = int(1e12)
    assert shapes._recv_areas(b, "", fixed, per) == 1  # at least one
    b._mem_given, b._mem_used = 0, 0
    assert shapes._recv_areas(b, "", fixed, per) == 3  # nothing given
    b._mem_given = 1 << 50
    assert shapes._recv_areas(b, "", fixed, per) == 3  # at most 3
    assert shapes._recv_areas(b, "ll4x2-", fixed, per) == 1
    os.environ["EPD_DEEP_EP_RECV_AREAS"] = "5"
    try:
        assert shapes._recv_areas(b, "", fixed, per) == 5
        os.environ["EPD_DEEP_EP_RECV_AREAS"] = "17"
        try:
            shapes._recv_areas(b, "", fixed, per)
            raise AssertionError("17 areas taken")
        except ValueError as e:
            assert "1..16" in str(e), e
    finally:
        del os.environ["EPD_DEEP_EP_RECV_AREAS"]
    b._rpn = 4  # across nodes: one area
    assert shapes._recv_areas(b, "", fixed, per) == 1

    # the shape of a dispatch from is_token_in_rank alone
    buf = legacy.Buffer.__new__(legacy.Buffer)
    buf.group_size, buf._subs = 4, {}
    buf._layout_topk = buf._layout_experts = None
    assert buf._in_rank_key(64, False) == (64, False, 4, 4)
    buf._layout_topk, buf._layout_experts = 2, 16  # K < W: no
    assert buf._in_rank_key(64, False) == (64, False, 4, 4)
    buf._layout_topk = 6
    assert buf._in_rank_key(64, True) == (64, True, 6, 16)
    buf._subs = {("llk", 64, 16, 8, 128): 0, (64, True, 5, 32): 0,
                 (64, False, 8, 32): 0}
    assert buf._in_rank_key(64, True) == (64, True, 5, 32)
    assert buf._in_rank_key(32, True) == (32, True, 6, 16)

    class S:
        W, K, per = 4, 6, 4
    inr = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]],
                       dtype=torch.bool)
    t = legacy.Buffer._in_rank_topk(S, inr, torch.arange(4))
    want = torch.tensor([[0, -1, 8, 12, -1, -1], [-1] * 6,
                         [0, 4, 8, 12, -1, -1]])
    assert torch.equal(t, want), t
    print("ok: shapes' groups (receive areas within the Buffer's bytes; "
          "a dispatch without top-k through a top-k shape of W slots)")


def main():
    try:
        import torch  # noqa: F401
    except ImportError:
        print("skip: no torch for", sys.executable)
        return 77
    lease_bookkeeping()
    shape_sharing()
    # the rank processes import this file again: they must not pick
    # their own seed from the clock
    os.environ["EPD_TEST_SEED"] = str(SEED)
    p, sock, d = start_epd("cuda" if CUDA else "host")
    ok = True
    try:
        worlds = [int(w) for w in os.environ.get("EPD_TEST_WORLDS",
                                                 "2 4").split()]
        for W in worlds:
            t0 = time.time()
            if run_ranks(rank_main, W, sock, CUDA) is None:
                ok = False
                print(f"FAIL: deep_ep with {W} ranks (seed {SEED})")
                break
            print(f"ok: deep_ep {W} ranks ({'cuda' if CUDA else 'host'}, "
                  f"seed {SEED}, {time.time() - t0:.1f} s): layout, "
                  "dispatch bf16/fp8 (fp32 column-major and UE8M0 scales) "
                  "with and without top-k, alignment, num_worst_tokens, "
                  "async and previous events, rank_prefix_matrix, cached "
                  "dispatch (also in the other dtype), combine of rows, a "
                  "bias, a pair of biases and weights, low-latency dispatch "
                  f"({'bf16 and fp8' if hasattr(torch, 'float8_e4m3fn') else 'bf16; no fp8 in this torch'}) "
                  "and weighted combine bitwise equal to the reference; too "
                  "many tokens raised on every rank; 20 layers' handles "
                  "alive and released when dropped")
    finally:
        ok = stop_epd(p, d, show_log=not ok) and ok
    if ok:
        # the same checks with the group over two nodes: the same
        # reference, so bitwise equal to one node (GPU ranks: the
        # low-latency ops through libep's way across nodes)
        ok = on_two_nodes(two_nodes, "cuda" if CUDA else "host")
    return 0 if ok else 1


def two_nodes(socks):
    t0 = time.time()
    if CUDA and os.environ.get("EPD_DEEP_EP_LL_KERNELS") != "0":
        os.environ["EPD_TEST_LL_PATH"] = "kernels"
    ok = run_ranks(rank_main, 4, socks, CUDA) is not None
    print(f"{'ok' if ok else 'FAIL'}: deep_ep 2 nodes x 2 ranks "
          f"({'cuda' if CUDA else 'host'}, tcp, seed {SEED}, "
          f"{time.time() - t0:.1f} s): the same checks, bitwise equal to "
          "the same reference")
    return ok


if __name__ == "__main__":
    sys.exit(main())
