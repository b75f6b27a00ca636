#!/usr/bin/env python3
# A straightforward dispatch/combine reference in PyTorch on the same GPU,
# same shape as bench_gpu (8 ranks' tokens in one process): dispatch by
# boolean-mask gathers per destination, combine by index_add in fp32.
# Prints "dispatch_ms combine_ms" (medians) for bench_gpu's speed-up line.
import sys
import torch

W, T, H, K, E = 8, int(sys.argv[1]) if len(sys.argv) > 1 else 4096, 7168, 8, 256
per = E // W
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(1)
x = torch.randn(W * T, H, device=dev, generator=g).to(torch.bfloat16)
topk = torch.argsort(torch.rand(W * T, E, device=dev, generator=g), dim=1)[:, :K]
dest = torch.zeros(W * T, W, dtype=torch.bool, device=dev)
dest.scatter_(1, topk // per, True)


def dispatch():
    # rows grouped by source rank then token: the flat order already is
    return [x[dest[:, d]] for d in range(W)]


recv = dispatch()
idx = [dest[:, d].nonzero().squeeze(1) for d in range(W)]


def combine():
    out = torch.zeros(W * T, H, device=dev, dtype=torch.float32)
    for d in range(W):
        out.index_add_(0, idx[d], recv[d].float())
    return out.to(torch.bfloat16)


def bench(fn):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[5]


print(f"{bench(dispatch):.3f} {bench(combine):.3f}")
