# SPDX-License-Identifier: MIT
"""The deep_ep shim's cost on the DeepSeek-V3 shape: W ranks sharing this
GPU (spawned, gloo group; EPD_SOCKET names the daemon), 4096 tokens per
rank, hidden 7168, top-8 of 256 experts, random bf16 rows (never zeros).

For dispatch and combine, the time per op of (a) epd's own API on the
group the shim joined (inputs already in epd's buffer, the dispatch's
count waited for on the CPU as the shim must, outputs left in epd's
buffer) and (b) the shim's Buffer.dispatch/combine (DeepEP's semantics:
inputs copied in, fresh output tensors copied out, handles released when
dropped), and (c) epd's own API doing the same copies with plain torch
(the fair baseline for the wrapper's own cost). Each is N ops back to back after a barrier, timed on every rank;
the slowest rank's mean is printed, and shim/own as the overhead.

    perf deep_ep W=8 dispatch own_us=.. shim_us=.. ratio=.. combine ...
"""
import os
import sys
import time

T, H, K, E = (int(os.environ.get(k, v)) for k, v in
              (("EPD_BENCH_T", 4096), ("EPD_BENCH_H", 7168),
               ("EPD_BENCH_K", 8), ("EPD_BENCH_E", 256)))
N = int(os.environ.get("EPD_BENCH_ITERS", 20))
# EPD_BENCH_API=v2: the shim under test is V2's ElasticBuffer (its
# dispatch with V2's outputs and handle, its combine in V2's order)
V2 = os.environ.get("EPD_BENCH_API", "v1") == "v2"


def rank_main(r, W, store, q):
    try:
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{store}",
                                rank=r, world_size=W)
        torch.cuda.set_device(0)
        group = dist.new_group(list(range(W)))
        import epd.deep_ep as deep_ep
        if V2:
            buf = deep_ep.ElasticBuffer(
                group, num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                use_fp8_dispatch=False, explicitly_destroy=True)
            v1 = buf._v1
        else:
            buf = deep_ep.Buffer(group, int(2e9), 0,
                                 explicitly_destroy=True)
            v1 = buf
        g = torch.Generator(device="cuda")
        g.manual_seed(1234 + r)
        x = torch.randn((T, H), device="cuda", generator=g).to(torch.bfloat16)
        scores = torch.rand((T, E), device="cuda", generator=g) + 0.1
        topk = torch.topk(scores, K, dim=1).indices
        w = torch.rand((T, K), device="cuda", generator=g)
        if V2:
            lay = dict(topk_idx=topk, topk_weights=w, num_experts=E)
            rx, _, _, hnd, _ = buf.dispatch(x, **lay)
        else:
            pr, _, pe, inr, _ = buf.get_dispatch_layout(topk, E)
            lay = dict(num_tokens_per_rank=pr, is_token_in_rank=inr,
                       num_tokens_per_expert=pe, topk_idx=topk,
                       topk_weights=w)
            rx, _, _, _, hnd, _ = buf.dispatch(x, **lay)
        sub = v1._subs[(H, False, K, E)]
        eg, st = sub.g, torch.cuda.current_stream()
        sub.x[:T].copy_(x)
        sub.topk[:T].copy_(topk)
        sub.w[:T].copy_(w)
        R = rx.size(0)
        sub.y[:R].copy_(rx)
        # the experts' output as a framework has it: a tensor of torch's
        # own (with expandable segments the daemon reads it in place)
        ex = rx.clone()

        def timed(fn):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            dist.barrier(group)
            t0 = time.perf_counter()
            for _ in range(N):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / N * 1e6

        def own_dispatch():
            h = eg.dispatch_stream(T, stream=st, weights=True)
            eg.recv_count(h)
            eg.release(h)
        h0 = eg.dispatch_stream(T, stream=st, weights=True)
        eg.recv_count(h0)

        def own_combine():
            eg.combine_stream(h0, stream=st, topk_order=V2)

        # (c) epd's own API doing the copies DeepEP's semantics need (x
        # in, fresh outputs out) with plain torch copies and no wrapper:
        # what the shim adds beyond that is the wrapper's own cost
        def copies_dispatch():
            sub.x[:T].copy_(x)
            sub.topk[:T].copy_(topk)
            sub.w[:T].copy_(w)
            h = eg.dispatch_stream(T, stream=st, weights=True)
            n = eg.recv_count(h)
            for f, dt in ((sub.recv_x, torch.bfloat16),
                          (sub.recv_topk, torch.int64),
                          (sub.recv_w, torch.float32)):
                torch.empty((n,) + tuple(f.shape[1:]), dtype=dt,
                            device="cuda").copy_(f[:n])
            eg.release(h)

        def copies_combine():
            sub.y[:R].copy_(rx)
            eg.combine_stream(h0, stream=st, topk_order=V2)
            torch.empty((T, H), dtype=torch.bfloat16,
                        device="cuda").copy_(sub.out[:T])

        # the copies alone, every rank at once
        def copy_y_in():
            sub.y[:R].copy_(rx)

        def copy_recv_out():
            torch.empty((R, H), dtype=torch.bfloat16,
                        device="cuda").copy_(sub.recv_x[:R])

        def shim_dispatch():
            buf.dispatch(x, **lay)

        def shim_combine():
            buf.combine(ex, hnd)
        # as in training: each layer's rows are a fresh tensor of torch's,
        # at a place of the allocator's choosing (six in turn here); the
        # registrations made while timed say whether they hit
        ring = [torch.empty_like(ex) for _ in range(6)]
        xring = [torch.empty_like(x) for _ in range(6)]
        for e_ in ring:
            e_.copy_(ex)
        for x_ in xring:
            x_.copy_(x)
        it = [0]

        def shim_combine_ring():
            it[0] += 1
            buf.combine(ring[it[0] % 6], hnd)

        def shim_dispatch_ring():
            it[0] += 1
            buf.dispatch(xring[it[0] % 6], **lay)
        res = {}
        for name, fn in (("ring_c", shim_combine_ring),
                         ("ring_d", shim_dispatch_ring)):
            timed(fn)  # the registrations' first round, untimed
            n0 = sub.registered
            res[name] = timed(fn)
            res[name + "_regs"] = float(sub.registered - n0)
        for name, fn in (("own_d", own_dispatch), ("shim_d", shim_dispatch),
                         ("own_c", own_combine), ("shim_c", shim_combine),
                         ("own_d2", own_dispatch), ("shim_d2", shim_dispatch),
                         ("cp_d", copies_dispatch), ("cp_c", copies_combine),
                         ("y_in", copy_y_in), ("recv_out", copy_recv_out)):
            res[name] = timed(fn)
        # where a dispatch's time goes, one op at a time (drained, every
        # rank lined up): the CPU until the dispatch is on the stream
        # (pre), its wait for the count (wait), and after it (post)
        stamp = {}
        ds0, rc0 = eg.dispatch_stream, eg.recv_count

        def ds_(*a, **k):
            h_ = ds0(*a, **k)
            stamp["ds"] = time.perf_counter()
            return h_

        def rc_(*a, **k):
            stamp["rc0"] = time.perf_counter()
            n_ = rc0(*a, **k)
            stamp["rc1"] = time.perf_counter()
            return n_
        eg.dispatch_stream, eg.recv_count = ds_, rc_
        for name, fn in (("own", own_dispatch), ("shim", shim_dispatch)):
            ph = {"pre": [], "wait": [], "post": [], "op": []}
            for _ in range(N):
                torch.cuda.synchronize()
                dist.barrier(group)
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                ph["pre"].append(stamp["ds"] - t0)
                ph["wait"].append(stamp["rc1"] - stamp["rc0"])
                ph["post"].append(t1 - stamp["rc1"])
                ph["op"].append(t1 - t0)
            for k_, v_ in ph.items():
                res[f"{name}_{k_}"] = sorted(v_)[len(v_) // 2] * 1e6
        del eg.dispatch_stream, eg.recv_count
        # the shim's CPU time by call (rank 0's, $EPD_BENCH_PROFILE=1; a
        # dispatch is collective: every rank runs them), one dispatch at a
        # time as above: printed as "prof" lines
        if os.environ.get("EPD_BENCH_PROFILE") == "1":
            import cProfile
            import io
            import pstats
            pr_ = cProfile.Profile()
            for _ in range(N):
                torch.cuda.synchronize()
                dist.barrier(group)
                if r == 0:
                    pr_.enable()
                shim_dispatch()
                if r == 0:
                    pr_.disable()
            if r == 0:
                out_ = io.StringIO()
                pstats.Stats(pr_, stream=out_).sort_stats(
                    "tottime").print_stats(25)
                for line in out_.getvalue().splitlines():
                    if line.strip():
                        print("prof", line, flush=True)
        dist.barrier(group)
        # the rank's CPU cost of finding x's registration (a dispatch's
        # check before it reads in place)
        if sub.mreg_on:
            t0 = time.perf_counter()
            for _ in range(N):
                sub.region_of(x)
            res["reg_us"] = (time.perf_counter() - t0) / N * 1e6
        else:
            res["reg_us"] = 0.0
        # did the shim's combine read ex in place (registered memory)?
        res["reg"] = float(bool(sub.in_place["rows"]))
        res["oreg"] = float(bool(sub.in_place["out"]))
        out0, _, _ = buf.combine(ex, hnd)
        sub.mreg_on = False
        out1, _, _ = buf.combine(ex, hnd)
        res["same"] = float(torch.equal(out0.view(torch.int16),
                                        out1.view(torch.int16)))
        eg.release(h0)
        allr = [None] * W
        dist.all_gather_object(allr, res, group)
        del hnd
        buf.destroy()
        q.put((r, allr, R))
    except BaseException:
        import traceback
        q.put((r, traceback.format_exc(), 0))


def main():
    import multiprocessing as mp
    import tempfile
    W = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    d = tempfile.mkdtemp(prefix="bench-deep-ep.")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, W, f"{d}/store", q))
          for r in range(W)]
    for p in ps:
        p.start()
    out = [q.get(timeout=500) for _ in ps]
    for p in ps:
        p.join(30)
    bad = [o for o in out if isinstance(o[1], str)]
    if bad:
        print(bad[0][1])
        return 1
    allr = out[0][1]
    worst = {k: max(r[k] for r in allr) for k in allr[0]}
    od = min(worst["own_d"], worst["own_d2"])
    sd = min(worst["shim_d"], worst["shim_d2"])
    oc, sc = worst["own_c"], worst["shim_c"]
    api = "ElasticBuffer" if V2 else "Buffer"
    print(f"perf deep_ep {api} W={W} T={T} H={H} top-{K}/{E}: dispatch own_us={od:.0f} "
          f"shim_us={sd:.0f} ratio={sd / od:.3f}; combine own_us={oc:.0f} "
          f"shim_us={sc:.0f} ratio={sc / oc:.3f} (slowest rank's mean of "
          f"{N}; dispatch: better of two rounds; combine rows "
          f"{'read in place (registered memory)' if min(r['reg'] for r in allr) else 'copied in'}, "
          f"output {'written in place' if min(r['oreg'] for r in allr) else 'copied out'})")
    print(f"perf deep_ep W={W} rows of six tensors in turn (fresh "
          f"activations): combine shim_us={worst['ring_c']:.0f} "
          f"ratio={worst['ring_c'] / oc:.3f}, dispatch "
          f"shim_us={worst['ring_d']:.0f} ratio={worst['ring_d'] / od:.3f}; "
          f"registrations made while timed: combine "
          f"{worst['ring_c_regs']:.0f}, dispatch {worst['ring_d_regs']:.0f}")
    print(f"perf deep_ep W={W} finding a registration (ep_mem_covers): "
          f"{worst['reg_us']:.1f} us on the rank's CPU")
    print(f"perf deep_ep W={W} one dispatch at a time (median, slowest "
          f"rank), us: own op={worst['own_op']:.0f} (to the stream "
          f"{worst['own_pre']:.0f}, count wait {worst['own_wait']:.0f}, "
          f"after {worst['own_post']:.0f}); shim op={worst['shim_op']:.0f} "
          f"(to the stream {worst['shim_pre']:.0f}, count wait "
          f"{worst['shim_wait']:.0f}, after {worst['shim_post']:.0f})")
    if not min(r["same"] for r in allr):
        print("FAIL: the combine from registered memory differs from the "
              "copy path's")
        return 1
    cd, cc = worst["cp_d"], worst["cp_c"]
    print(f"perf deep_ep W={W} own API with the same copies: dispatch "
          f"us={cd:.0f} shim/that={sd / cd:.3f}; combine us={cc:.0f} "
          f"shim/that={sc / cc:.3f}; the copies alone, all ranks at once: "
          f"expert rows in {worst['y_in']:.0f} us, received rows out "
          f"{worst['recv_out']:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
