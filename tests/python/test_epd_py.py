# SPDX-License-Identifier: MIT
"""The Python binding against a daemon: join, barrier, layout, dispatch,
cached dispatch, combine and errors, with 4 rank processes, every output
compared bitwise with a reference written here in plain Python."""
import multiprocessing as mp
import os
import random
import struct
import subprocess
import sys
import tempfile
import time

import epd

W, H, K, E, TMAX = 4, 256, 3, 16, 24
PER = E // W
SEED = int(os.environ.get("EPD_TEST_SEED", time.time()))


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bf16_f32(h):
    return struct.unpack("<f", struct.pack("<I", h << 16))[0]


def f32_bf16(f):
    u = struct.unpack("<I", struct.pack("<f", f))[0]
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x40
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def inputs(rank, salt=0):
    r = random.Random(SEED * 131 + rank * 7 + salt)
    rt = random.Random(SEED * 131 + rank * 7)  # routing: no salt
    T = [TMAX, 0, 11, 17][rank]
    x = [r.getrandbits(1) << 15 | (120 + r.randrange(11)) << 7 | r.getrandbits(7)
         for _ in range(T * H)]
    topk = []
    for _ in range(T):
        row = []
        for _ in range(K):
            e = -1 if rt.randrange(6) == 0 else rt.randrange(E)
            row.append(-1 if e in row else e)
        topk.append(row)
    w = [r.randrange(1000) / 999 for _ in range(T * K)]
    bias = [r.getrandbits(1) << 15 | (120 + r.randrange(11)) << 7 | r.getrandbits(7)
            for _ in range(T * H)]
    return T, x, topk, w, bias


def goes(row, d):
    return any(e >= 0 and e // PER == d for e in row)


def ref_recv(all_in, d):
    rows = []
    for s in range(W):
        T, x, topk, w, _ = all_in[s]
        for t in range(T):
            if goes(topk[t], d):
                rows.append((s, t))
    return rows


def arr(code, seq):
    import array
    return array.array(code, seq)


def rank_main(rank, sock, q):
    try:
        all_in = [inputs(s) for s in range(W)]
        all_in2 = [inputs(s, 1) for s in range(W)]
        T, x, topk, w, bias = all_in[rank]
        with epd.connect(sock) as c:
            g = c.join("py", world_size=W, ranks_per_node=W, rank=rank,
                       num_experts=E, hidden=H, max_tokens_per_rank=TMAX,
                       topk=K, timeout_ms=20000)
            g.barrier()
            flat = arr("q", [e for row in topk for e in row])
            per_rank, per_expert, in_rank = g.get_dispatch_layout(flat, T)
            assert per_rank == [sum(goes(topk[t], d) for t in range(T))
                                for d in range(W)], "layout per rank"
            # a bad expert fails the op for every rank, then all goes on
            bad = arr("q", flat)
            if rank == 2:
                bad[4] = E
            try:
                g.dispatch(arr("H", x), bad, T, arr("f", w))
                raise AssertionError("a bad expert index was accepted")
            except epd.Error as e:
                assert e.code == -1012, e
            res = g.dispatch(arr("H", x), flat, T, arr("f", w))
            rows = ref_recv(all_in, rank)
            assert res.num_recv == len(rows), (res.num_recv, len(rows))
            assert g.recv_count_device() == 0  # a host group: no device count
            want_x, want_i, want_w = [], [], []
            for s, t in rows:
                sx, stk, sw = all_in[s][1], all_in[s][2], all_in[s][3]
                want_x += sx[t * H:(t + 1) * H]
                for k in range(K):
                    e = stk[t][k]
                    here = e >= 0 and e // PER == rank
                    want_i.append(e - rank * PER if here else -1)
                    want_w.append(f32(sw[t * K + k]) if here else 0.0)
            assert bytes(res.recv_x) == bytes(arr("H", want_x)), "recv_x"
            assert bytes(res.recv_topk_idx) == bytes(arr("q", want_i)), "topk"
            assert bytes(res.recv_topk_weights) == bytes(arr("f", want_w)), "weights"
            # cached dispatch of new data
            x2 = all_in2[rank][1]
            res2 = g.dispatch(arr("H", x2), None, T, handle=res.handle)
            want2 = []
            for s, t in rows:
                want2 += all_in2[s][1][t * H:(t + 1) * H]
            assert bytes(res2.recv_x) == bytes(arr("H", want2)), "cached"
            # combine of y = 2 x the received rows' first element pattern
            ry = random.Random(SEED + 99)
            ys = {d: [[ry.getrandbits(1) << 15 | (121 + ry.randrange(9)) << 7
                       | ry.getrandbits(7) for _ in range(H)]
                      for _ in ref_recv(all_in, d)] for d in range(W)}
            y = arr("H", [v for row in ys[rank] for v in row])
            out = g.combine(y, res.handle, bias=arr("H", bias))
            want = []
            for t in range(T):
                for j in range(H):
                    acc = bf16_f32(bias[t * H + j])
                    for d in range(W):
                        rr = ref_recv(all_in, d)
                        if (rank, t) in rr:
                            acc = f32(acc + bf16_f32(ys[d][rr.index((rank, t))][j]))
                    want.append(f32_bf16(acc))
            assert bytes(out) == bytes(arr("H", want)), "combined"
            st = c.status()
            assert any(gr["name"] == "py" for gr in st["groups"]), st
            g.barrier()
            g.leave()
        q.put((rank, None))
    except Exception as e:  # reported to the parent
        q.put((rank, repr(e)))


def main():
    binary = os.environ.get("EPD_BIN", "./epd")
    d = tempfile.mkdtemp(prefix="epdpy.")
    sock = os.path.join(d, "epd.sock")
    log = open(os.path.join(d, "epd.log"), "w")
    p = subprocess.Popen([binary, "-s", sock, "-c", "/dev/null",
                          "--backend", "host"], stdout=log, stderr=log)
    try:
        for _ in range(500):
            try:
                epd.status(sock)
                break
            except epd.Error:
                time.sleep(0.01)
        try:
            epd.connect(os.path.join(d, "nope"))
            raise AssertionError("connected to nothing")
        except epd.Error as e:
            assert e.code == -2, e  # ENOENT
        q = mp.Queue()
        procs = [mp.Process(target=rank_main, args=(r, sock, q)) for r in range(W)]
        for pr in procs:
            pr.start()
        errs = [q.get(timeout=120) for _ in procs]
        for pr in procs:
            pr.join(30)
        bad = [e for e in errs if e[1]]
        if bad:
            print("FAIL:", bad)
            return 1
        print(f"ok: python binding, {W} ranks (seed {SEED}): layout, dispatch, "
              "cached dispatch, combine bitwise equal to a Python reference; "
              "a bad expert raises epd.Error(-1012)")
        return 0
    finally:
        p.terminate()
        p.wait(10)
        if p.returncode != 0:
            print(open(os.path.join(d, "epd.log")).read())


if __name__ == "__main__":
    sys.exit(main())
