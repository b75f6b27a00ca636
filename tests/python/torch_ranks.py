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


def held_handles(conn, ll=False):
    """Handles the daemon holds for epd.deep_ep's groups, as seen by conn
    (a rank's epd.Conn: the shim's groups are its job's, their details
    shown to their members only): host routings, and a GPU group's device
    routings. ll: those of libep's low-latency pseudo groups instead
    (named ":ll-"; each keeps the routings of its two buffers' last
    dispatches, for their combines, until the buffer's next dispatch) and
    how many such groups."""
    st = conn.status()
    gs = [g for g in st.get("groups", []) if g["name"].startswith("dep-")
          and (":ll-" in g["name"]) == ll]
    held = sum(g.get("handles", {}).get("held", 0) +
               g.get("cuda", {}).get("device_handles", 0) for g in gs)
    return (held, len(gs)) if ll else held


def free_ports(n):
    """The first of n consecutive TCP ports for daemons' listeners, outside
    the kernel's ephemeral range (no outgoing connection can be handed one
    before a daemon binds it), each checked free by a bind (as the C
    tests' th_ports)."""
    import random
    import socket
    lo, hi = 32768, 60999
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        pass
    spans = [(a, b) for a, b in ((10000, lo - n), (hi + 1, 65535 - n))
             if b > a]
    assert spans, f"no {n} ports outside the ephemeral range {lo}-{hi}"
    rnd = random.Random()
    for _ in range(1000):
        a, b = rnd.choice(spans)
        base = rnd.randrange(a, b)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} free consecutive ports outside {lo}-{hi}")


def start_cluster(nodes, backend):
    """([process], [socket], folder): `nodes` daemons clustered over tcp on
    this machine (each a node of its own), once every node sees every
    other up. Ranks that use different sockets are different nodes to
    epd.deep_ep (it tells nodes apart by host name and socket)."""
    import epd
    d = tempfile.mkdtemp(prefix="epdcluster.")
    key = os.path.join(d, "cluster.key")
    with open(key, "w") as f:
        f.write(f"a-secret-of-this-test-cluster-{os.getpid()}\n")
    base = free_ports(nodes)
    peers = ", ".join(f"n{i}@127.0.0.1:{base + i}" for i in range(nodes))
    ps, socks = [], []
    for i in range(nodes):
        sock = os.path.join(d, f"n{i}.sock")
        log = open(os.path.join(d, f"n{i}.log"), "w")
        ps.append(subprocess.Popen(
            [os.environ.get("EPD_BIN", "./epd"), "-s", sock, "-c",
             "/dev/null", "--backend", backend, "-o", f"node_name=n{i}",
             "-o", f"peers={peers}", "-o", f"cluster_key_file={key}",
             "-o", "heartbeat_ms=100", "-o", "transport=tcp"],
            stdout=log, stderr=log))
        socks.append(sock)
    for _ in range(3000):
        try:
            if all(all(p["state"] in ("self", "up") for p in
                       epd.status(s)["cluster"]["peers"]) for s in socks):
                break
        except epd.Error:
            pass
        time.sleep(0.01)
    return ps, socks, d


def on_two_nodes(body, backend="host"):
    """body(socks) over two clustered daemons of backend, socks[r] being
    rank r's of four (two a node), unless EPD_TEST_NODES=0; its truth, and
    the daemons' clean exit."""
    if os.environ.get("EPD_TEST_NODES", "2") == "0":
        return True
    ps, socks, d = start_cluster(2, backend)
    ok = False
    try:
        ok = body([socks[r // 2] for r in range(4)])
    finally:
        ok = stop_cluster(ps, d, show_log=not ok) and ok
    return ok


def stop_cluster(ps, d, show_log=False):
    ok = True
    for i, p in enumerate(ps):
        p.terminate()
        p.wait(20)
        if p.returncode != 0 or show_log:
            print(f"node {i}:",
                  open(os.path.join(d, f"n{i}.log")).read()[-3000:])
        ok = ok and p.returncode == 0
    return ok


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
    (module-level target; $EPD_SOCKET is the rank's daemon); [each rank's
    return value], or None after printing every failed rank's
    traceback."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="epdstore."), "store")
    # sock: one daemon for every rank, or a list: rank r's is sock[r]
    socks = sock if isinstance(sock, list) else [sock] * W
    ps = [ctx.Process(target=_wrap,
                      args=(target, r, W, store, cuda, socks[r], args, q))
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
