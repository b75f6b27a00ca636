# SPDX-License-Identifier: MIT
"""A Megatron-shaped MoE stack on epd.deep_ep, as an example and a test.

Each of L layers (58, DeepSeek-V3's MoE layers, by default) is: a gate
(linear, top-k, softmax over the chosen logits), DeepEP dispatch of the
tokens with their probabilities, each rank's local experts (one linear map
each, rows weighted by their probability, summed in fp32), DeepEP combine,
and a residual. Dispatch and combine are autograd functions the way
Megatron's fused_a2a writes them: dispatch's backward is a combine of the
gradients (rows and probabilities), combine's backward a cached dispatch.
So all L handles are alive from the forward pass to the backward pass.

Every rank also runs the whole stack in one process (every rank's tokens
and every expert, no communication) and compares: the output of its tokens,
the gradient of its input and of its local experts' weights. The single
process rounds where DeepEP's semantics do (rows and their gradients are
bf16 per destination, summed in fp32 in ascending rank order and rounded
once); GEMMs of different batch sizes may still differ in their last fp32
bit, so the comparison allows 1e-9 of DeepEP's calc_diff (measured: 5e-15).
Run by tests/python/deep_ep in CI (host backend, CPU
tensors) and by tests/gpu/run on the GPU (EPD_TEST_BACKEND=cuda).

    python3 tests/python/test_megatron_moe.py   # epd running; EPD_SOCKET
"""
import os
import sys
import time

from torch_ranks import (held_handles, on_two_nodes, run_ranks, start_epd,
                         stop_epd)

L = int(os.environ.get("EPD_MOE_LAYERS", 58))
TOL = 1e-9  # calc_diff; see the docstring
H, K, T0 = 128, 2, 24
CUDA = os.environ.get("EPD_TEST_BACKEND", "host") == "cuda"


def ntok(r):
    return T0 + 7 * r


def setup(torch, W):
    E = 2 * W
    g = torch.Generator()
    g.manual_seed(4242)
    gates = [torch.randn((H, E), generator=g) / H ** 0.5 for _ in range(L)]
    experts = [[torch.randn((H, H), generator=g) / H ** 0.5 for _ in range(E)]
               for _ in range(L)]
    xs = [torch.randn((ntok(r), H), generator=g).to(torch.bfloat16)
          for r in range(W)]
    gout = [torch.randn((ntok(r), H), generator=g) for r in range(W)]
    return E, gates, experts, xs, gout


# The gate and the experts multiply in fp64 and round to fp32: a GEMM's
# blocking (which depends on the batch and the CPU) then cannot change a
# row's fp32 result, so rounding to bf16 and the top-k choices are the
# same in the distributed stack and the one-process reference.
def route(torch, x, gate):
    logits = (x.double() @ gate.double()).float()
    top, idx = torch.topk(logits, K, dim=1)
    return idx, torch.softmax(top, dim=1)


def expert_rows(torch, x, idx, prob, experts, base, per):
    """Rows [n, H]: for each row, sum over its slots that name a local
    expert (base + j) of prob * x @ W, in fp32 by slot order, then bf16."""
    y = torch.zeros((x.size(0), H), dtype=torch.float32, device=x.device)
    for k in range(idx.size(1)):
        for j in range(per):
            m = idx[:, k] == j
            if bool(m.any()):
                xw = (x[m].double() @ experts[base + j].double()).float()
                y[m] = y[m] + prob[m, k:k + 1] * xw
    return y.to(torch.bfloat16)


def make_functions(torch):
    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, prob, idx, buf, E):
            pr, _, pe, inr, _ = buf.get_dispatch_layout(idx, E)
            rx, ri, rw, _, h, _ = buf.dispatch(
                x, topk_idx=idx, topk_weights=prob, num_tokens_per_rank=pr,
                is_token_in_rank=inr, num_tokens_per_expert=pe)
            ctx.buf, ctx.h = buf, h
            ctx.mark_non_differentiable(ri)
            return rx, rw, ri, h

        @staticmethod
        def backward(ctx, grx, grw, _gri, _gh):
            gx, gw, _ = ctx.buf.combine(grx.to(torch.bfloat16).contiguous(),
                                        ctx.h, topk_weights=grw.contiguous())
            return gx, gw, None, None, None

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, h, buf):
            ctx.buf, ctx.h = buf, h
            return buf.combine(y, h)[0]

        @staticmethod
        def backward(ctx, gout):
            gy = ctx.buf.dispatch(gout.to(torch.bfloat16).contiguous(),
                                  handle=ctx.h)[0]
            return gy, None, None
    return Dispatch, Combine


def rank_main(torch, dist, group, r, W):
    sock = os.environ["EPD_SOCKET"]  # this rank's node
    import epd.deep_ep as deep_ep
    from epd.deep_ep.utils.math import calc_diff
    buf = deep_ep.Buffer(group, int(1e9), 0, explicitly_destroy=True)
    E, gates, experts, xs, gout = setup(torch, W)
    per = E // W
    dev = "cuda" if CUDA else "cpu"
    Dispatch, Combine = make_functions(torch)

    # distributed: this rank's tokens, its local experts. epd gets
    # tensors on the device; the gate and expert math run on the CPU
    # (where the one-process reference runs: a GPU GEMM rounds
    # differently, and one flipped top-k choice changes the rest)
    mine = [[w.clone().requires_grad_(i // per == r)
             for i, w in enumerate(le)]
            for le in experts]
    x0 = xs[r].to(dev).clone().requires_grad_(True)
    x = x0
    t0 = time.time()
    for li in range(L):
        idx, prob = route(torch, x.cpu(), gates[li])
        rx, rw, ri, h = Dispatch.apply(x, prob.to(dev), idx.to(dev),
                                       buf, E)
        y = expert_rows(torch, rx.cpu(), ri.cpu(), rw.cpu(), mine[li],
                        r * per, per)
        x = x + Combine.apply(y.to(dev), h, buf)
    alive = len(buf._subs) and held_handles(buf._conn)
    (x.float() * gout[r].to(dev)).sum().backward()
    t1 = time.time()

    # one process: every rank's tokens, every expert
    ref_e = [[w.clone().requires_grad_(True) for w in le] for le in experts]
    rx0 = [xx.clone().requires_grad_(True) for xx in xs]
    cur = list(rx0)
    for li in range(L):
        routes = [route(torch, c, gates[li]) for c in cur]
        outs = []
        for s in range(W):
            idx, prob = routes[s]
            # each destination's row gradient is bf16 (DeepEP's rows),
            # their sum fp32 rounded once: dispatch's backward combine
            cf = cur[s].float()
            acc = torch.zeros((idx.size(0), H))
            for d in range(W):  # ascending destination rank
                loc = (idx >= d * per) & (idx < (d + 1) * per)
                sel = loc.any(dim=1)
                if not bool(sel.any()):
                    continue
                li_idx = torch.where(loc, idx - d * per, torch.full_like(idx, -1))
                yd = expert_rows(torch, cf[sel].to(torch.bfloat16), li_idx[sel], prob[sel],
                                 ref_e[li], d * per, per)
                acc[sel] = acc[sel] + yd.float()
            outs.append(cur[s] + acc.to(torch.bfloat16))
        cur = outs
    sum((c.float() * g).sum() for c, g in zip(cur, gout)).backward()

    diffs = {}

    def close(a, b, what):
        d = calc_diff(a.detach().float().cpu(), b.detach().float().cpu())
        diffs[what] = d
        assert d < TOL, f"rank {r}: {what}: calc_diff {d:.3g}"
    close(x, cur[r], f"output after {L} layers")
    close(x0.grad, rx0[r].grad, "gradient of the input")
    for li in (0, L // 2, L - 1):
        for j in range(per):
            e = r * per + j
            close(mine[li][e].grad, ref_e[li][e].grad,
                  f"layer {li} expert {e} weight gradient")
    buf.destroy()
    return alive, t1 - t0, max(diffs.values())


def stack(W, sock, where):
    res = run_ranks(rank_main, W, sock, CUDA, timeout=900)
    if res is None:
        return False
    alive = max(x[0] for x in res)
    # every rank's L handles at once (one per layer)
    assert alive >= L, f"only {alive} handles alive before the backward"
    print(f"ok: {L}-layer MoE stack, {where}: {alive} handles alive from "
          f"forward to backward; output, input gradient and expert weight "
          f"gradients equal to one process (largest calc_diff "
          f"{max(x[2] for x in res):.2g}; forward+backward "
          f"{max(x[1] for x in res):.1f} s)")
    return True


def main():
    try:
        import torch  # noqa: F401
    except ImportError:
        print("skip: no torch for", sys.executable)
        return 77
    W = int(os.environ.get("EPD_MOE_RANKS", 4))
    p, sock, d = start_epd("cuda" if CUDA else "host")
    ok = False
    try:
        ok = stack(W, sock, f"{W} ranks ({'cuda' if CUDA else 'host'})")
    finally:
        ok = stop_epd(p, d, show_log=not ok) and ok
    if ok and not CUDA:
        ok = on_two_nodes(lambda socks: stack(
            4, socks, "2 nodes x 2 ranks (host, tcp)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
