# SPDX-License-Identifier: MIT
"""Registered memory (ep_mem_register, protocol 1.13) on a GPU: one rank
process with PyTorch's expandable segments, a one-rank group of epd (run
under tests/gpu/with_epd). Asserted:
  - a combine whose rows are read in place from a torch tensor equals,
    bit for bit, the combine of the same rows copied into combine_y, on
    fresh random rows each round; a dispatch whose x is read in place
    delivers the same rows as from the x buffer; a combine that writes
    its result into a torch tensor (protocol 1.14) equals the copied one
    bit for bit and leaves the combined buffer alone, and an output past
    its registration is refused (EP_ESTALE);
  - the registration covers its tensor and not memory past it;
  - after torch releases the memory (empty_cache) and maps new memory,
    a registration still naming the old allocations no longer covers the
    addresses, and a combine through it is refused (EP_ESTALE) instead
    of reading the old bytes; registering again works;
  - a deregistered region is refused; 64 live registrations are the most
    (EP_ELIMIT), and deregistering makes room;
  - the daemon keeps serving: a last combine after all that is correct.
"""
import os
import sys

os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                "client", "python"))
import epd  # noqa: E402

H, K, E, T = 1024, 2, 4, 512


def main():
    torch.cuda.set_device(0)
    conn = epd.connect(os.environ["EPD_SOCKET"])
    g = conn.join("mreg", world_size=1, ranks_per_node=1, rank=0,
                  num_experts=E, hidden=H, max_tokens_per_rank=T, topk=K,
                  dtype=epd.BF16, cuda_device=0)
    s = torch.cuda.current_stream()
    X = g.tensor("x", (T, H), "bf16")
    TK = g.tensor("topk_idx", (T, K), "int64")
    Y = g.tensor("combine_y", (T, H), "bf16")
    C = g.tensor("combined", (T, H), "bf16")
    gen = torch.Generator(device="cuda").manual_seed(7)
    X.copy_(torch.randn(T, H, device="cuda", generator=gen))
    TK.copy_(torch.stack([torch.arange(T, device="cuda") % E,
                          (torch.arange(T, device="cuda") + 1) % E], 1))
    h = g.dispatch_stream(T, stream=s)
    R = g.recv_count(h)
    assert R == T, R
    fails = 0

    def check(cond, what):
        nonlocal fails
        print(("ok: " if cond else "FAIL: ") + what, flush=True)
        fails += 0 if cond else 1

    def combine_both(rows, region):
        Y[:R].copy_(rows)
        g.combine_stream(h, stream=s)
        want = C.clone()
        C.zero_()
        g.combine_stream_reg(h, region, rows.data_ptr(), R, stream=s)
        got = C.clone()
        torch.cuda.synchronize()
        return torch.equal(want.view(torch.int16), got.view(torch.int16))

    rows = torch.randn(R, H, device="cuda", generator=gen).to(torch.bfloat16)
    region = g.mem_register(rows.data_ptr(), rows.numel() * 2)
    check(region.covers(rows.data_ptr(), rows.numel() * 2) and
          region.base <= rows.data_ptr() and
          not region.covers(region.base + region.nbytes - 2, 4),
          f"the registration covers the tensor ({region.nbytes >> 20} MiB "
          "of allocations) and nothing past them")
    same = all(combine_both(rows.copy_(torch.randn(
        R, H, device="cuda", generator=gen)), region) for _ in range(20))
    check(same, "20 combines read in place equal the copied ones bitwise")
    # the combined rows written into a torch tensor (protocol 1.14): equal
    # to the copied path's, and the combined buffer left alone
    out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    oregion = g.mem_register(out.data_ptr(), out.numel() * 2)
    placed = True
    for i in range(10):
        rows.copy_(torch.randn(R, H, device="cuda", generator=gen))
        Y[:R].copy_(rows)
        g.combine_stream(h, stream=s)
        want = C.clone()
        C.view(torch.int16).fill_(0x5a5a)
        out.view(torch.int16).fill_(-1)
        if i % 2:
            g.combine_stream_mem(h, region, rows.data_ptr(), R, oregion,
                                 out.data_ptr(), stream=s)
        else:
            g.combine_stream_mem(h, out_region=oregion,
                                 out_ptr=out.data_ptr(), stream=s)
        torch.cuda.synchronize()
        placed = placed and torch.equal(want.view(torch.int16),
                                        out.view(torch.int16)) and \
            bool((C.view(torch.int16) == 0x5a5a).all())
    check(placed, "10 combines written into a torch tensor (rows copied "
          "or in place) equal the copied ones bitwise; combined untouched")
    try:
        g.combine_stream_mem(h, out_region=oregion,
                             out_ptr=oregion.base + oregion.nbytes - 16,
                             stream=s)
        check(False, "an output past its registration was accepted")
    except epd.Error as e:
        check(e.code == -1009, f"an output past its registration is "
              f"refused: {e}")
    oregion.deregister()
    del out
    # torch gives the memory back and maps new memory at the same place
    ptr, n = rows.data_ptr(), rows.numel() * 2
    del rows
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    fresh = torch.randn(R, H, device="cuda", generator=gen).to(torch.bfloat16)
    moved = fresh.data_ptr() != ptr
    check(not region.covers(fresh.data_ptr(), n),
          "after empty_cache the old registration does not cover the new "
          f"tensor ({'elsewhere' if moved else 'at the same address'})")
    try:
        g.combine_stream_reg(h, region, fresh.data_ptr(), R, stream=s)
        check(False, "a combine through a stale registration ran")
    except epd.Error as e:
        check(e.code == -1009, f"a stale registration is refused: {e}")
    region.deregister()
    region2 = g.mem_register(fresh.data_ptr(), n)
    check(combine_both(fresh, region2), "registered again: bitwise equal")
    try:
        g.combine_stream_reg(h, region, fresh.data_ptr(), R, stream=s)
        check(False, "a deregistered region was used")
    except epd.Error as e:
        check(e.code == epd.EINVAL, f"a deregistered region is refused: {e}")
    # a dispatch whose x is read in place: the same rows arrive as from
    # the x buffer (which is zeroed first, so a read of it would show)
    RX = g.tensor("recv_x", (T, H), "bf16")
    xs = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    xr = g.mem_register(xs.data_ptr(), xs.numel() * 2)
    X.copy_(xs)
    h1 = g.dispatch_stream(T, stream=s)
    g.recv_count(h1)
    want = RX[:R].clone()
    g.release(h1)
    RX.zero_()
    X.zero_()
    h2 = g.dispatch_stream(T, stream=s, region=xr, ptr=xs.data_ptr())
    g.recv_count(h2)
    got = RX[:R].clone()
    g.release(h2)
    check(torch.equal(want.view(torch.int16), got.view(torch.int16)) and
          bool(got.view(torch.int16).any()),
          "a dispatch reading x in place delivers the rows bitwise")
    xr.deregister()
    # the daemon's bound on live registrations
    small = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    regs = []
    try:
        for _ in range(64):
            regs.append(g.mem_register(small.data_ptr(), 1 << 20))
        check(False, "65 live registrations were accepted")
    except epd.Error as e:
        check(e.code == -1015 and len(regs) == 63,
              f"registration {len(regs) + 2} refused: {e}")
    regs.pop().deregister()
    regs.append(g.mem_register(small.data_ptr(), 1 << 20))
    for r in regs:
        r.deregister()
    check(combine_both(fresh.copy_(torch.randn(
        R, H, device="cuda", generator=gen)), region2),
        "after all that, a combine in place is still bitwise equal")
    region2.deregister()
    g.release(h)
    g.leave()
    conn.close()
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
