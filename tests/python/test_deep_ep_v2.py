# SPDX-License-Identifier: MIT
"""epd's deep_ep.ElasticBuffer (DeepEP V2's API) against a daemon, with 2
and 4 rank processes over a gloo group ($EPD_TEST_WORLDS), on the host
backend with CPU tensors, or (EPD_TEST_BACKEND=cuda) on the GPU; then 4
ranks on two clustered daemons (EPD_TEST_NODES=0: not). Every output is
compared bitwise with a reference of V2's semantics written here (plain
loops over every rank's inputs, which each rank makes again from the
seed): dispatch (bf16 and fp8, the latter expanded with TMA-aligned
column-major scales too; expert_alignment, expanded rows with and
without zero padding, without CPU sync, cached, cached expanded with
weights, cumulative expert counts, do_handle_copy),
the handle (recv_src_metadata, psums, per-expert counts,
dst_buffer_slot_idx), combine in V2's order (each rank's rows by its last
top-k slot, from a bias or a pair) of received and of expanded rows and
of top-k weights; the domains, the groups' timeout (V2's larger one),
the barrier, deep_ep.utils.refs against
the same reference, a rank entering the barrier late (each rank in turn:
on two daemons the other node's ranks, the diagonal of DeepEP issue 651)
and none leaving before it, and the clear errors (a num_bytes too small,
a cached dispatch with top-k, previous_event without
allocate_on_comm_stream, what epd does not run). Skipped (77) without
torch."""
import os
import sys
import time

from torch_ranks import on_two_nodes, run_ranks, start_epd, stop_epd

H, K, E = 256, 4, 16
NMAX = 64
SEED = int(os.environ.get("EPD_TEST_SEED", int(time.time())))
CUDA = os.environ.get("EPD_TEST_BACKEND", "host") == "cuda"


def tokens(r):
    return [37, 0, 64, 5, 21, 64, 1, 50][r % 8]


def gen(torch, *key):
    g = torch.Generator()
    s = SEED
    for k in key:
        s = s * 1000003 + k
    g.manual_seed(s % (1 << 62))
    return g


def inputs(torch, r):
    T = tokens(r)
    g = gen(torch, r, 1)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    q = torch.randint(0, 256, (T, H), generator=g, dtype=torch.int32).to(
        torch.uint8)
    q[(q & 0x7F) == 0x7F] = 0  # no NaN patterns in the e4m3 bytes
    sc = torch.rand((T, H // 128), generator=g) + 0.5
    idx = torch.rand((T, E), generator=g).argsort(dim=1)[:, :K]
    idx[torch.rand((T, K), generator=g) < 0.2] = -1
    w = torch.rand((T, K), generator=g)
    w[idx < 0] = 0
    bias = torch.randn((T, H), generator=g).to(torch.bfloat16)
    bias2 = torch.randn((T, H), generator=g).to(torch.bfloat16)
    return dict(T=T, x=x, q=q, sc=sc, idx=idx.long(), w=w, bias=bias,
                bias2=bias2)


def world(torch, W):
    """Every rank's inputs and, per destination, its received (source,
    token) rows in order."""
    ins = [inputs(torch, r) for r in range(W)]
    per = E // W
    recv = []
    for d in range(W):
        recv.append([(s, t) for s in range(W) for t in range(ins[s]["T"])
                     if any(e >= 0 and e // per == d
                            for e in ins[s]["idx"][t].tolist())])
    return ins, recv


def ref_dispatch(torch, ins, rows, me, W, align):
    """V2's non-expanded outputs on rank me, and its expanded layout."""
    per = E // W
    R = len(rows)
    rti = torch.full((R, K), -1, dtype=torch.long)
    for i, (s, t) in enumerate(rows):
        for k, e in enumerate(ins[s]["idx"][t].tolist()):
            if e >= 0 and e // per == me:
                rti[i, k] = e - me * per
    counts = [int((rti == e).sum()) for e in range(per)]
    aligned = [(c + align - 1) // align * align for c in counts]
    start = [sum(aligned[:e]) for e in range(per)]
    pos = torch.full((R, K), -1, dtype=torch.long)
    nxt = list(start)
    for i in range(R):
        for k in range(K):
            e = int(rti[i, k])
            if e >= 0:
                pos[i, k] = nxt[e]
                nxt[e] += 1
    per_src = [sum(1 for s, _ in rows if s == src) for src in range(W)]
    return dict(rti=rti, counts=counts, aligned=aligned, start=start,
                pos=pos, per_src=per_src, n=sum(aligned))


def bf16(torch, f32):
    return f32.to(torch.bfloat16)


def ref_combine(torch, ins, recv, W, h, ys, bias):
    """V2's combine on home h: each token's rows (ys[d]: rank d's [R_d, H]
    bf16) by each rank's last top-k slot, fp32 from the bias (a pair:
    first plus second), one rounding."""
    per = E // W
    T = ins[h]["T"]
    out = torch.empty((T, H), dtype=torch.bfloat16)
    for t in range(T):
        if bias is None:
            acc = torch.zeros(H, dtype=torch.float32)
        elif isinstance(bias, tuple):
            acc = bias[0][t].float() + bias[1][t].float()
        else:
            acc = bias[t].float().clone()
        row = ins[h]["idx"][t].tolist()
        last = {}
        for k, e in enumerate(row):
            if e >= 0:
                last[e // per] = k
        for d in sorted(last, key=lambda d: last[d]):
            i = recv[d].index((h, t))
            acc = acc + ys[d][i].float()
        out[t] = bf16(torch, acc)
    return out


def wide(torch, shape, g):
    """bf16 values of magnitudes 2^-24..2^24: fp32 sums of them round, so
    that the order of a combine's sum shows in its result."""
    v = torch.randn(shape, generator=g) * torch.exp2(
        torch.randint(-24, 25, shape, generator=g).float())
    return v.to(torch.bfloat16)


def same(a, b, what):
    import torch
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)}, want "
                             f"{tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise AssertionError(f"{what}: dtype {a.dtype}, want {b.dtype}")
    ab = a.contiguous().view(torch.uint8) if a.element_size() == 1 else a
    bb = b.contiguous().view(torch.uint8) if b.element_size() == 1 else b
    if a.dtype == torch.bfloat16:
        ab, bb = ab.view(torch.int16), bb.view(torch.int16)
    if not torch.equal(ab, bb):
        bad = (ab != bb).nonzero()[:3].tolist()
        raise AssertionError(f"{what}: differs at {bad}")


def dev(torch, t):
    return t.cuda() if CUDA else t


def rank_main(torch, dist, group, r, W, nodes=1):
    import epd.deep_ep as deep_ep
    ins, recv = world(torch, W)
    me = ins[r]
    fp8ok = hasattr(torch, "float8_e4m3fn")

    # too little memory: a clear error on every rank, naming the bytes
    small = deep_ep.ElasticBuffer(group, num_bytes=4096,
                                  explicitly_destroy=True)
    try:
        small.dispatch(dev(torch, me["x"]), topk_idx=dev(torch, me["idx"]),
                       num_experts=E, num_max_tokens_per_rank=NMAX)
        raise AssertionError("a dispatch past num_bytes")
    except ValueError as e:
        assert "num_bytes=4096" in str(e) and "bytes a rank" in str(e), e
    small.destroy()

    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(group, NMAX, H, K)
    assert hint % (2 << 20) == 0 and hint > 0, hint
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=NMAX,
                                hidden=H, num_topk=K, explicitly_destroy=True,
                                num_cpu_timeout_secs=300,
                                num_gpu_timeout_secs=100)
    assert buf.num_bytes == hint
    assert buf.get_logical_domain_size() == (1, W)
    assert buf.get_physical_domain_size() == (nodes, W // nodes)
    assert (buf.rank_idx, buf.num_ranks) == (r, W)
    assert buf.scaleup_rank_idx == r and buf.scaleout_rank_idx == 0
    for _ in range(3):
        buf.barrier()
    buf.barrier(use_comm_stream=False, with_cpu_sync=True)
    for what in ("engram_fetch", "pp_send", "all_gather"):
        try:
            getattr(buf, what)(None, 0) if what != "all_gather" else \
                buf.all_gather(None)
            raise AssertionError(what)
        except NotImplementedError as e:
            assert what in str(e), e

    x, idx, w = (dev(torch, me[k]) for k in ("x", "idx", "w"))
    for align in (1, 4):
        ref = ref_dispatch(torch, ins, recv[r], r, W, align)
        R = len(recv[r])
        stats = dev(torch, torch.zeros(E // W, dtype=torch.int32))
        for fp8 in (False, True):
            if fp8:
                # (e4m3 bytes as uint8 where torch has no float8: the host
                # backend moves them alike)
                q = me["q"].view(torch.float8_e4m3fn) if fp8ok else me["q"]
                xin = (dev(torch, q), dev(torch, me["sc"]))
            else:
                xin = x
            rx, rti, rtw, hd, ev = buf.dispatch(
                xin, topk_idx=idx, topk_weights=w, num_experts=E,
                expert_alignment=align, do_handle_copy=(align == 1),
                cumulative_local_expert_recv_stats=stats)
            tag = f"align {align} {'fp8' if fp8 else 'bf16'}"
            if fp8:
                rq, rsf = rx
                want = torch.stack([ins[s]["q"][t] for s, t in recv[r]]) \
                    if R else me["q"][:0]
                same(rq.view(torch.uint8), want, f"recv_x {tag}")
                want = torch.stack([ins[s]["sc"][t] for s, t in recv[r]]) \
                    if R else me["sc"][:0]
                same(rsf, want, f"recv scales {tag}")
            else:
                want = torch.stack([ins[s]["x"][t] for s, t in recv[r]]) \
                    if R else me["x"][:0]
                same(rx, want, f"recv_x {tag}")
            same(rti, ref["rti"], f"recv_topk_idx {tag}")
            # (another rank's slots: 0)
            want = torch.stack([ins[s]["w"][t] for s, t in recv[r]]) \
                if R else me["w"][:0]
            same(rtw, want.masked_fill(ref["rti"] < 0, 0),
                 f"recv_topk_weights {tag}")
            assert hd.num_recv_tokens == R
            assert hd.num_recv_tokens_per_expert_list == ref["aligned"], \
                (hd.num_recv_tokens_per_expert_list, ref["aligned"])
            same(hd.psum_num_recv_tokens_per_expert,
                 torch.tensor(ref["aligned"], dtype=torch.int32).cumsum(
                     0).to(torch.int32), f"psum per expert {tag}")
            same(hd.psum_num_recv_tokens_per_scaleup_rank,
                 torch.tensor(ref["per_src"]).cumsum(0).to(torch.int32),
                 f"psum per rank {tag}")
            meta = torch.full((R, 2 + K), -1, dtype=torch.int32)
            for i, (s, t) in enumerate(recv[r]):
                meta[i, 0] = s * NMAX + t
                meta[i, 1] = i
                for k in range(K):
                    if ref["rti"][i, k] >= 0:
                        meta[i, 2 + k] = i
            same(hd.recv_src_metadata, meta, f"recv_src_metadata {tag}")
            # where each of this rank's slots landed on its destination
            per = E // W
            dst = torch.full((me["T"], K), -1, dtype=torch.int32)
            for t in range(me["T"]):
                for k, e in enumerate(me["idx"][t].tolist()):
                    if e >= 0:
                        dst[t, k] = recv[e // per].index((r, t))
            same(hd.dst_buffer_slot_idx, dst, f"dst_buffer_slot_idx {tag}")
            assert not me["T"] or (hd.topk_idx.data_ptr() !=
                                   idx.data_ptr()) == (align == 1), \
                "do_handle_copy"
            # cached: the same rows, the same handle
            crx, crti, crtw, chd, _ = buf.dispatch(xin, handle=hd)
            assert chd is hd and crtw is None
            same(crx[0] if fp8 else crx, rx[0] if fp8 else rx,
                 f"cached recv_x {tag}")
            same(crti, rti, f"cached recv_topk_idx {tag}")
            if fp8:
                # expanded, with the scales TMA-aligned column-major
                (eq, esf), _, _, _, _ = buf.dispatch(
                    xin, topk_idx=idx, topk_weights=w, num_experts=E,
                    expert_alignment=align, do_expand=True,
                    use_tma_aligned_col_major_sf=True)
                n = ref["n"]
                assert tuple(esf.shape) == (n, H // 128) and \
                    esf.stride() == (1, (n + 3) // 4 * 4), \
                    (tuple(esf.shape), esf.stride())
                for i, (s, t) in enumerate(recv[r]):
                    for k in range(K):
                        p = int(ref["pos"][i, k])
                        if p >= 0:
                            same(eq[p].view(torch.uint8), ins[s]["q"][t],
                                 f"expanded e4m3 row {tag}")
                            same(esf[p], ins[s]["sc"][t],
                                 f"expanded scales {tag}")
            if not fp8:
                combines(torch, buf, hd, ins, recv, r, W, tag)
            del hd, chd
        same(stats, torch.tensor(ref["counts"], dtype=torch.int32) * 2,
             f"cumulative stats align {align}")

        # expanded: a row per local slot, expert segments aligned
        for zero in (False, True):
            rx, rti, rtw, hd, _ = buf.dispatch(
                x, topk_idx=idx, topk_weights=w, num_experts=E,
                expert_alignment=align, do_expand=True,
                do_zero_padding=zero)
            tag = f"expanded align {align} zero {zero}"
            assert rti is None and rx.size(0) == ref["n"], (rx.shape, ref)
            assert hd.num_expanded_tokens == ref["n"]
            pos = ref["pos"]
            same(hd.recv_src_metadata[:, 2:], pos.to(torch.int32),
                 f"slots {tag}")
            for i, (s, t) in enumerate(recv[r]):
                for k in range(K):
                    p = int(pos[i, k])
                    if p >= 0:
                        same(rx[p], ins[s]["x"][t], f"row {tag}")
                        same(rtw[p], ins[s]["w"][t, k], f"weight {tag}")
            ends = [ref["start"][e] + ref["counts"][e]
                    for e in range(E // W)]
            same(hd.psum_num_recv_tokens_per_expert,
                 torch.tensor(ends, dtype=torch.int32), f"psum {tag}")
            same(hd.num_unaligned_recv_tokens_per_expert,
                 torch.tensor(ref["counts"], dtype=torch.int32),
                 f"unaligned counts {tag}")
            if zero:
                for e in range(E // W):
                    a, b = ends[e], ref["start"][e] + ref["aligned"][e]
                    assert bool((rx[a:b].float() == 0).all()) and \
                        bool((rtw[a:b] == 0).all()), f"padding {tag}"
            # cached expanded with weights: the same rows and weights
            crx, _, crtw, _, _ = buf.dispatch(x, handle=hd, topk_weights=w,
                                              do_expand=True,
                                              do_zero_padding=zero)
            v = pos[pos >= 0]
            same(crx[v], rx[v], f"cached rows {tag}")
            same(crtw[v], rtw[v], f"cached weights {tag}")
            # expanded combine: each token's slots summed here first
            n = rx.size(0)
            slots = dev(torch, wide(torch, (n, H),
                                    gen(torch, r, 7, align, zero)))
            cx, cw, _ = buf.combine(slots, hd, topk_weights=rtw)
            ys = []
            for d in range(W):
                rd = ref_dispatch(torch, ins, recv[d], d, W, align)
                sd = wide(torch, (rd["n"], H), gen(torch, d, 7, align, zero))
                y = torch.zeros((len(recv[d]), H), dtype=torch.float32)
                for k in range(K):
                    p = rd["pos"][:, k]
                    y = y + torch.where((p >= 0).unsqueeze(1),
                                        sd[p.clamp(min=0)].float(),
                                        torch.zeros(()))
                ys.append(y.to(torch.bfloat16))
            same(cx, ref_combine(torch, ins, recv, W, r, ys, None),
                 f"combined {tag}")
            same(cw, me["w"], f"combined weights {tag}")
            del hd

    # without CPU sync: the worst case's rows, counts on the device
    rx, rti, rtw, hd, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                       num_experts=E, do_cpu_sync=False)
    R = len(recv[r])
    assert rx.size(0) == W * NMAX and hd.num_recv_tokens_per_expert_list \
        is None
    assert int(hd.psum_num_recv_tokens_per_scaleup_rank[-1]) == R
    same(rx[:R], torch.stack([ins[s]["x"][t] for s, t in recv[r]])
         if R else me["x"][:0], "recv_x without sync")
    assert bool((rti[R:] == -1).all()), "padding rows' indices"

    # the errors
    try:
        buf.dispatch(x, topk_idx=idx, handle=hd)
        raise AssertionError("a cached dispatch with top-k")
    except ValueError as e:
        assert "cached" in str(e), e
    try:
        buf.dispatch(x, topk_idx=idx, num_experts=E,
                     num_max_tokens_per_rank=NMAX * 2)
        raise AssertionError("another num_max_tokens_per_rank")
    except ValueError as e:
        assert "num_max_tokens_per_rank" in str(e), e
    try:
        buf.dispatch(x, topk_idx=idx, num_experts=E,
                     previous_event=buf.capture())
        raise AssertionError("previous_event without allocate_on_comm_stream")
    except ValueError as e:
        assert "allocate_on_comm_stream" in str(e), e
    # the groups' timeout: the larger of V2's two (300 s)
    mine = [g for g in buf._v1._conn.status().get("groups", [])
            if g["name"].startswith(buf._v1._name)]
    assert len(mine) >= 2 and all(g["timeout_ms"] == 300000 for g in mine), \
        [(g["name"], g["timeout_ms"]) for g in mine]
    del hd
    refs_check(torch, dist, deep_ep, ins, recv, r, W)
    late_rank(torch, dist, buf, r, W)
    buf.barrier()
    buf.destroy()
    return True


def late_rank(torch, dist, buf, r, W):
    """DeepEP issue 651's case: one rank enters the barrier late (on two
    nodes: each rank of the other node and another local index in turn,
    the diagonal); no rank may leave before it entered. Each rank's exit
    (its stream done, on GPU ranks) against the late one's entry, on this
    machine's clock."""
    for late in range(1, W):
        dist.barrier()
        if r == late:
            time.sleep(0.25)
        t_in = time.time()
        buf.barrier()
        if CUDA:
            torch.cuda.current_stream().synchronize()
        t_out = time.time()
        ts = [None] * W
        dist.all_gather_object(ts, (t_in, t_out))
        for q in range(W):
            if ts[q][1] < ts[late][0]:
                raise AssertionError(
                    f"rank {q} left the barrier {ts[late][0] - ts[q][1]:.3f}"
                    f" s before rank {late} entered it")


def combines(torch, buf, hd, ins, recv, r, W, tag):
    """Combine of random rows along hd: no bias, one, a pair; weights."""
    R = len(recv[r])
    ys = [wide(torch, (len(recv[d]), H), gen(torch, d, 5))
          for d in range(W)]
    me = ins[r]
    for bias in (None, dev(torch, me["bias"]),
                 (dev(torch, me["bias"]), dev(torch, me["bias2"]))):
        rw = torch.stack([ins[s]["w"][t] for s, t in recv[r]]) if R \
            else me["w"][:0]
        cx, cw, _ = buf.combine(dev(torch, ys[r]), hd,
                                topk_weights=dev(torch, rw), bias=bias)
        rb = None if bias is None else (me["bias"] if not isinstance(
            bias, tuple) else (me["bias"], me["bias2"]))
        nb = 0 if bias is None else 2 if isinstance(bias, tuple) else 1
        same(cx, ref_combine(torch, ins, recv, W, r, ys, rb),
             f"combined {tag}, {nb} biases")
        same(cw, me["w"], f"combined weights {tag}")


def refs_check(torch, dist, deep_ep, ins, recv, r, W):
    """deep_ep.utils.refs against this file's reference."""
    from epd.deep_ep.utils import refs
    me = ins[r]
    rx, rti, rtw, rsrc, n = refs.dispatch(me["x"], me["idx"], me["w"], NMAX,
                                          E)
    want = ref_dispatch(torch, ins, recv[r], r, W, 1)
    same(rti, want["rti"], "refs.dispatch recv_topk_idx")
    same(rsrc, torch.tensor([s * NMAX + t for s, t in recv[r]],
                            dtype=torch.int32), "refs.dispatch sources")
    same(n, torch.tensor(want["per_src"], dtype=torch.int32),
         "refs.dispatch counts")
    # refs.combine, recipe (True, False): the order checked above
    ys = [wide(torch, (len(recv[d]), H), gen(torch, d, 9))
          for d in range(W)]
    T = me["T"]
    y = torch.zeros((T, K, H), dtype=torch.bfloat16)
    per = E // W
    for t in range(T):
        for k, e in enumerate(me["idx"][t].tolist()):
            if e >= 0:
                d = e // per
                last = max(j for j, e2 in enumerate(me["idx"][t].tolist())
                           if e2 >= 0 and e2 // per == d)
                if k == last:
                    y[t, k] = ys[d][recv[d].index((r, t))]
    got = refs.combine(y, me["idx"], 1, W, E, (me["bias"], me["bias2"]),
                       True, False)
    same(got, ref_combine(torch, ins, recv, W, r, ys,
                          (me["bias"], me["bias2"])), "refs.combine")


def main():
    try:
        import torch  # noqa: F401
    except ImportError:
        print("skip: no torch for", sys.executable)
        return 77
    os.environ["EPD_TEST_SEED"] = str(SEED)
    p, sock, d = start_epd("cuda" if CUDA else "host")
    ok = True
    try:
        for W in [int(w) for w in os.environ.get("EPD_TEST_WORLDS",
                                                 "2 4").split()]:
            t0 = time.time()
            if run_ranks(rank_main, W, sock, CUDA) is None:
                ok = False
                print(f"FAIL: ElasticBuffer with {W} ranks (seed {SEED})")
                break
            print(f"ok: ElasticBuffer {W} ranks "
                  f"({'cuda' if CUDA else 'host'}, seed {SEED}, "
                  f"{time.time() - t0:.1f} s)")
    finally:
        ok = stop_epd(p, d, show_log=not ok) and ok
    if ok:
        ok = on_two_nodes(lambda socks: run_ranks(
            rank_main, 4, socks, CUDA, args=(2,)) is not None,
            "cuda" if CUDA else "host")
        print(("ok" if ok else "FAIL") +
              f": ElasticBuffer 4 ranks on 2 daemons (seed {SEED})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
