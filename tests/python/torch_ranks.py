# SPDX-License-Identifier: MIT
"""What the torch tests of epd.deep_ep share: an epd of their own, W rank
processes (spawned) over a gloo group, and each rank's set-up."""
import multiprocessing as mp
import os
import subprocess
import tempfile
import time
import traceback


def start_epd(backend):
    """(process, socket, folder): $EPD_BIN on a fresh socket, answering."""
    import epd
    d = tempfile.mkdtemp(prefix="epdtorch.")
    sock = os.path.join(d, "epd.sock")
    log = open(os.path.join(d, "epd.log"), "w")
    p = subprocess.Popen([os.environ.get("EPD_BIN", "./epd"), "-s", sock,
                          "-c", "/dev/null", "--backend", backend],
                         stdout=log, stderr=log)
    for _ in range(1000):
        try:
            epd.status(sock)
            break
        except epd.Error:
            time.sleep(0.01)
    return p, sock, d


def stop_epd(p, d, show_log=False):
    """Stop it; its log's tail when it failed or show_log."""
    p.terminate()
    p.wait(20)
    if p.returncode != 0 or show_log:
        print(open(os.path.join(d, "epd.log")).read()[-4000:])
    return p.returncode == 0


def _wrap(target, r, W, store, cuda, sock, args, q):
    try:
        os.environ["EPD_SOCKET"] = sock
        if not cuda:
            os.environ["EPD_DEEP_EP_HOST"] = "1"
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)  # W processes share the CPUs
        dist.init_process_group("gloo", init_method=f"file://{store}",
                                rank=r, world_size=W)
        if cuda:
            torch.cuda.set_device(0)
        group = dist.new_group(list(range(W)))
        out = target(torch, dist, group, r, W, *args)
        dist.barrier()
        dist.destroy_process_group()
        q.put((r, None, out))
    except BaseException:
        q.put((r, traceback.format_exc(), None))


def run_ranks(target, W, sock, cuda, args=(), timeout=600):
    """target(torch, dist, group, rank, W, *args) in W spawned processes
    (module-level target); [each rank's return value], or None after
    printing every failed rank's traceback."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="epdstore."), "store")
    ps = [ctx.Process(target=_wrap,
                      args=(target, r, W, store, cuda, sock, args, q))
          for r in range(W)]
    for p in ps:
        p.start()
    res = []
    try:
        res = [q.get(timeout=timeout) for _ in ps]
    finally:
        for p in ps:
            p.join(30)
            if p.is_alive():
                p.kill()
    bad = [x for x in res if x[1]]
    for r, tb, _ in sorted(bad):
        print(f"rank {r}:\n{tb}")
    if bad or len(res) != W:
        return None
    return [x[2] for x in sorted(res, key=lambda x: x[0])]
