#!/usr/bin/env python3
# NCCL all-to-all (torch.distributed.all_to_all_single), one process per GPU,
# moving the same bytes as epd's dispatch of the DeepSeek-V3 shape: every
# rank sends the rows it would dispatch, split by destination as the routing
# gives them. Prints per-GPU GB/s counted as bench_gpu counts (bytes read +
# written: the rank's tokens read once, the rows it receives written once).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
import os
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

T, H, K, E = int(os.environ.get("EPD_BENCH_TOKENS", 4096)), 7168, 8, 256


def run(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    per = E // world
    topk = torch.argsort(torch.rand(T, E, device="cuda", generator=g), 1)[:, :K]
    dest = torch.zeros(T, world, dtype=torch.bool, device="cuda")
    dest.scatter_(1, topk // per, True)
    send_counts = dest.sum(0)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    send = torch.cat([x[dest[:, d]] for d in range(world)])
    recv = torch.empty(int(recv_counts.sum()), H, dtype=torch.bfloat16,
                       device="cuda")
    sc, rc = send_counts.tolist(), recv_counts.tolist()

    def a2a():
        dist.all_to_all_single(recv, send, rc, sc)

    for _ in range(5):
        a2a()
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        dist.barrier()
        a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        a.record()
        a2a()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ms = sorted(ts)[10]
    gbs = (T + recv.shape[0]) * H * 2 / (ms / 1e3) / 1e9
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{ms:.3f} {gbs:.0f}\n")
        print(f"perf: NCCL all_to_all_single, {world} GPUs, same rows as "
              f"dispatch: {ms:.3f} ms, {gbs:.0f} GB/s per GPU "
              f"(read + write)")
    dist.destroy_process_group()


if __name__ == "__main__":
    world = torch.cuda.device_count()
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/nccl.txt"
    mp.spawn(run, args=(world, 29511, out), nprocs=world)
