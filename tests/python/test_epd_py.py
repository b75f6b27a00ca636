# SPDX-License-Identifier: MIT
"""The Python binding against a daemon: join, barrier, layout, dispatch,
cached dispatch, combine and errors, with 4 rank processes, every output
compared bitwise with a reference written here in plain Python."""
import multiprocessing as mp
import os
import shutil
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
    if (u & 0x7FFFFFFF) > 0x7F800000:  # every NaN: the canonical one
        return 0x7FFF
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
            # the rows per local expert: a token once per distinct expert
            want_pe = [0] * PER
            for s, t in rows:
                for e in set(all_in[s][2][t]):
                    if e >= 0 and e // PER == rank:
                        want_pe[e - rank * PER] += 1
            assert g.recv_expert_counts(res.handle) == want_pe, "per expert"
            # the stream copies: element sizes, and no CUDA context here
            assert epd.copy_piece(4096, 8192, 48) == (4096, 8192, 3, 16, 1, 1)
            assert epd.copy_piece(4098, 8192, 6) == (4098, 8192, 3, 2, 1, 1)
            try:
                epd.stream_copies([(16, 32, 1, 3, 1, 1)], 0)
                raise AssertionError("an element of 3 bytes was accepted")
            except epd.Error as e:
                assert e.code == -22, e  # EP_EINVAL
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
            # a NaN with a payload and the sign set, and infinities of
            # either sign, in each rank's first row: every NaN sum comes
            # back as the canonical 0x7fff (on the GPU's rounding too)
            for d in range(W):
                if ys[d]:
                    ys[d][0][0] = 0xFFA5
                    ys[d][0][1] = 0x7F80 | (d & 1) << 15
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
            # with the rows' top-k weights: their fp32 sums per token and
            # slot, in ascending rank order, come back too
            rw = random.Random(SEED + 77)
            wd = {d: [f32((rw.randrange(20001) - 10000) / (1 + rw.randrange(97)))
                      for _ in range(len(ref_recv(all_in, d)) * K)]
                  for d in range(W)}
            out2, cw = g.combine(y, res.handle, bias=arr("H", bias),
                                 topk_weights=arr("f", wd[rank]))
            assert bytes(out2) == bytes(out), "combined (with weights)"
            wantw = []
            for t in range(T):
                for k in range(K):
                    acc = 0.0
                    for d in range(W):
                        rr = ref_recv(all_in, d)
                        if (rank, t) in rr:
                            acc = f32(acc + wd[d][rr.index((rank, t)) * K + k])
                    wantw.append(acc)
            assert bytes(cw) == bytes(arr("f", wantw)), "combined_topk_weights"
            st = c.status()
            mine = [gr for gr in st["groups"] if gr["name"] == "py"]
            assert mine and mine[0]["handles"]["held"] >= 1, st
            # released: the routing is gone for this rank
            g.release(res.handle)
            try:
                g.combine(y, res.handle, bias=arr("H", bias))
                raise AssertionError("combined along a released handle")
            except epd.Error as e:
                assert e.code == -1009 and "released" in str(e), e
            g.barrier()
            g.leave()
        q.put((rank, None))
    except Exception as e:  # reported to the parent
        q.put((rank, repr(e)))


def one_rank(c, name, dtype=epd.BF16, hidden=128, topk=2):
    return c.join(name, world_size=1, ranks_per_node=1, rank=0,
                  num_experts=4, hidden=hidden, max_tokens_per_rank=8,
                  topk=topk, dtype=dtype)


def check_lifetimes(sock):
    """Every order of leave and close, with and without with blocks: no
    crash (a double free aborts this process), a clear error after."""
    c = epd.connect(sock)
    g = one_rank(c, "life1")
    g.leave()
    g.leave()  # idempotent
    c.close()
    c.close()
    c = epd.connect(sock)
    g = one_rank(c, "life2")
    c.close()  # leaves the group in libep
    g.leave()  # a no-op now
    try:
        g.barrier()
        raise AssertionError("a group of a closed connection ran a barrier")
    except epd.Error as e:
        assert e.code == epd.EINVAL, e
    with epd.connect(sock) as c:
        with one_rank(c, "life3") as g:
            g.barrier()
    for op in (g.barrier, lambda: c.status(), lambda: one_rank(c, "x")):
        try:
            op()
            raise AssertionError("used after its with block")
        except epd.Error as e:
            assert e.code == epd.EINVAL, e
    c = epd.connect(sock)
    g = one_rank(c, "life4")
    del c  # the group keeps its connection
    import gc
    gc.collect()
    g.barrier()
    g.leave()
    del g
    gc.collect()
    groups = [x["name"] for x in epd.status(sock)["groups"]]
    assert not any(n.startswith("life") for n in groups), groups
    print("ok: python lifetimes: leave/close in every order, with blocks, "
          "a group keeping its connection alive; use after close "
          "raises EP_EINVAL")


def check_nodes_recv(sock):
    """Conn.node names the daemon; a one-node group naming its node and
    its receive capacity: dispatches within it run, one past it raises
    EP_ETOOBIG naming the rank; a list naming another node is refused."""
    with epd.connect(sock) as c:
        me = c.node
        assert me, "the daemon named no node"
        g = c.join("nodes1", world_size=1, ranks_per_node=1, rank=0,
                   num_experts=4, hidden=128, max_tokens_per_rank=8,
                   topk=1, nodes=[me], recv_rows=5)
        x = bytearray(8 * 128 * 2)
        import array
        idx = array.array("q", [0] * 8)
        r = g.dispatch(x, idx, 4)
        assert r.num_recv == 4, r.num_recv
        try:
            g.dispatch(x, idx, 6)
            raise AssertionError("6 rows received past recv_rows 5")
        except epd.Error as e:
            assert e.code == epd.ETOOBIG and "would receive 6 rows" in \
                str(e), e
        g.leave()
        try:
            c.join("nodes2", world_size=1, ranks_per_node=1, rank=0,
                   num_experts=4, hidden=128, max_tokens_per_rank=8,
                   topk=1, nodes=["not-" + me])
            raise AssertionError("a list without this node was taken")
        except epd.Error as e:
            assert e.code == epd.EINVAL and "does not know" in str(e), e
    print(f"ok: python: Conn.node ({me}), a group naming its node with "
          "recv_rows: past it EP_ETOOBIG; another node refused")


def check_numpy(sock):
    try:
        import numpy as np
    except ImportError:
        print("skip: numpy shapes (no numpy)")
        return
    with epd.connect(sock) as c:
        with one_rank(c, "np_bf16") as g:
            x = np.arange(5 * 128, dtype=np.uint16).reshape(5, 128) & 0x3fff
            idx = np.array([[0, 1], [2, -1], [3, 0], [1, 2], [-1, -1]],
                           dtype=np.int64)
            r = g.dispatch(x, idx, num_tokens=5, as_numpy=True)
            assert r.recv_x.shape == (4, 128) and r.recv_x.dtype == np.uint16
            assert r.recv_topk_idx.shape == (4, 2)
            assert r.recv_topk_weights.shape == (4, 2)
            assert r.recv_x_scales.shape == (4, 0)
            assert (r.recv_x == x[:4]).all()
            out = g.combine(r.recv_x, r.handle, as_numpy=True)
            assert out.shape == (5, 128) and (out[:4] == x[:4]).all()
            assert (out[4] == 0).all()
            # a rank with no tokens: empty arrays of the right rank
            r0 = g.dispatch(np.empty((0, 128), np.uint16),
                            np.empty((0, 2), np.int64), num_tokens=0,
                            as_numpy=True)
            assert r0.num_recv == 0 and r0.recv_x.shape == (0, 128)
            o0 = g.combine(r0.recv_x, r0.handle, as_numpy=True)
            assert o0.shape == (0, 128)
            # non-contiguous input (a column slice) is accepted
            wide = np.zeros((5, 256), np.uint16)
            wide[:, ::2] = x
            r2 = g.dispatch(wide[:, ::2], idx, num_tokens=5, as_numpy=True)
            assert (r2.recv_x == x[:4]).all()
        with one_rank(c, "np_fp8", dtype=epd.FP8, hidden=256) as g:
            x = np.arange(3 * 256, dtype=np.uint8).reshape(3, 256) & 0x7f
            sc = np.ones((3, 2), np.float32)
            idx = np.array([[0, 1], [2, -1], [3, 0]], dtype=np.int64)
            r = g.dispatch(x, idx, num_tokens=3, x_scales=sc, as_numpy=True)
            assert r.recv_x.shape == (3, 256) and r.recv_x.dtype == np.uint8
            assert r.recv_x_scales.shape == (3, 2)
            assert (r.recv_x == x).all() and (r.recv_x_scales == sc).all()
    print("ok: numpy results shaped [rows, hidden] (bf16 as uint16 bits, "
          "fp8 as uint8 with [rows, hidden/128] scales); empty and "
          "non-contiguous inputs accepted")


LL = dict(W=2, E=8, H=128, K=2, N=4)


def ll_inputs(rank):
    r = random.Random(SEED * 17 + rank)
    N, H, K, E = LL["N"], LL["H"], LL["K"], LL["E"]
    T = [N, 3][rank]
    x = [[r.getrandbits(1) << 15 | (120 + r.randrange(11)) << 7 |
          r.getrandbits(7) for _ in range(H)] for _ in range(T)]
    topk = [[-1 if r.randrange(5) == 0 else r.randrange(E) for _ in range(K)]
            for _ in range(T)]
    w = [[f32(r.randrange(-1000, 1000) / 997) for _ in range(K)]
         for _ in range(T)]
    return T, x, topk, w


def ll_rank(rank, sock, q):
    """A host rank's low-latency dispatch and combine (numpy), against a
    reference: rows per local expert by source rank, then (token, k);
    the combine's sum in top-k order, each product rounded to fp32."""
    try:
        import numpy as np
        W, E, H, K, N = (LL[k] for k in ("W", "E", "H", "K", "N"))
        El = E // W
        ins = [ll_inputs(s) for s in range(W)]
        T, x, topk, w = ins[rank]
        with epd.connect(sock) as c:
            with c.join("py_ll", world_size=W, ranks_per_node=W, rank=rank,
                        num_experts=E, hidden=H, max_tokens_per_rank=N,
                        topk=K) as g:
                for zero_copy in (False, True):
                    r = g.ll_dispatch(np.array(x, np.uint16).reshape(T, H),
                                      np.array(topk, np.int64).reshape(T, K))
                    assert r["recv_x"].shape == (El, W * N, H)
                    assert r["recv_x"].dtype == np.uint16
                    # the reference: (expert, source rank, token, k)
                    places = {}
                    for el in range(El):
                        p = 0
                        for s in range(W):
                            begin = p
                            for t in range(ins[s][0]):
                                for k in range(K):
                                    if ins[s][2][t][k] == rank * El + el:
                                        assert list(r["recv_x"][el, p]) == \
                                            ins[s][1][t]
                                        assert r["src_info"][el, p] == t
                                        places[(s, t, k)] = (el, p)
                                        p += 1
                            assert r["layout_range"][el, s] == \
                                (begin << 32 | (p - begin))
                        assert r["recv_count"][el] == p
                        assert (r["src_info"][el, p:] == -1).all()
                    # each expert's output row: its place, scaled
                    y = (np.arange(El * W * N * H, dtype=np.uint32) * 7 +
                         rank * 11) % 251
                    y = (0x3c00 + y).astype(np.uint16).reshape(El, W * N, H)
                    if zero_copy:
                        g.ll_combine_buffer(r["buffer"])[...] = y
                    out = np.zeros((T, H), np.uint16)
                    g.ll_combine(r["buffer"], None if zero_copy else y,
                                 np.array(w, np.float32).reshape(T, K), out)
                    q.put(("places", rank, places))
                    allp = {}
                    for _ in range(W):
                        allp.update(q_in[rank].get(timeout=60))
                    for t in range(T):
                        acc = [0.0] * H
                        for k in range(K):
                            e = topk[t][k]
                            if e < 0:
                                continue
                            d = e // El
                            el, p = allp[(d, rank, t, k)]
                            yd = (np.arange(El * W * N * H, dtype=np.uint32)
                                  * 7 + d * 11) % 251
                            row = (0x3c00 + yd).reshape(El, W * N, H)[el, p]
                            for ch in range(H):
                                acc[ch] = f32(acc[ch] + f32(
                                    w[t][k] * bf16_f32(int(row[ch]))))
                        assert list(out[t]) == [f32_bf16(a) for a in acc], \
                            (rank, t)
                r = g.ll_dispatch(np.array(x, np.uint16).reshape(T, H),
                                  np.array(topk, np.int64).reshape(T, K),
                                  fp8=True)
                assert r["recv_x"].dtype == np.uint8
                assert r["recv_scales"].shape == (El, W * N, H // 128)
                assert g.ll_error() is None
                kept = int(r["recv_count"].sum())
        # the host outputs are copies: still readable once the group
        # is gone (no view of freed memory)
        assert int(r["recv_count"].sum()) == kept
        r["recv_x"].sum()
        q.put(("done", rank, None))
    except Exception as e:  # noqa: BLE001
        import traceback
        q.put(("done", rank, traceback.format_exc() or repr(e)))


q_in = None


def check_ll(sock):
    """The low-latency calls on host ranks with numpy arrays."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        print("skip: the low-latency calls on host ranks (no numpy)")
        return
    global q_in
    W = LL["W"]
    q = mp.Queue()
    q_in = [mp.Queue() for _ in range(W)]
    procs = [mp.Process(target=ll_rank, args=(r, sock, q)) for r in range(W)]
    for pr in procs:
        pr.start()
    done, errs = 0, []
    while done < W:
        kind, rank, v = q.get(timeout=120)
        if kind == "places":  # each rank's places of its rows, to all
            tagged = {(rank,) + k: p for k, p in v.items()}
            for qi in q_in:
                qi.put(tagged)
        else:
            done += 1
            if v:
                errs.append(v)
    for pr in procs:
        pr.join(30)
    assert not errs, errs
    print(f"ok: the low-latency calls on {W} host ranks (numpy): layout, "
          "rows, src_info and the combine (plain and zero copy) bitwise "
          "against a Python reference; fp8 shapes")


def check_doctest(sock):
    try:
        import numpy  # noqa: F401  (the examples use it)
    except ImportError:
        print("skip: the module's docstring examples (no numpy)")
        return
    import doctest
    os.environ["EPD_SOCKET"] = sock
    res = doctest.testmod(epd, verbose=False)
    assert res.failed == 0 and res.attempted > 0, res
    print(f"ok: the module's docstring examples run ({res.attempted} lines)")


def check_abi():
    """The binding refuses, at import, a library of no or another ABI
    (one built from another ep.h would read and write its structs
    wrongly), naming why; the right one loads."""
    import ctypes.util
    lib = os.environ.get("EP_LIBRARY") or epd._lib._name
    other = ctypes.util.find_library("m")  # a library with no libep ABI
    code = "import epd"
    cases = [(other, "no ep_abi_version")]
    d = tempfile.mkdtemp(prefix="epdabi.")
    cc = (os.environ.get("EPD_CC") or "cc").split()
    src = os.path.join(d, "abi2.c")
    with open(src, "w") as f:
        f.write("unsigned ep_abi_version(void) { return 2; }\n")
    so = os.path.join(d, "libep.so.2")
    if shutil.which(cc[0]) and subprocess.run(
            cc + ["-shared", "-fPIC", "-o", so, src]).returncode == 0:
        cases.append((so, "libep ABI 2, this binding is written for ABI 1"))
    for path, want in cases:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                           text=True, env=dict(os.environ, EP_LIBRARY=path))
        assert r.returncode != 0 and want in r.stderr, (path, r.stderr)
    r = subprocess.run([sys.executable, "-c", "import epd; print(epd._ABI)"],
                       capture_output=True, text=True,
                       env=dict(os.environ, EP_LIBRARY=lib))
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr
    shutil.rmtree(d)
    print("ok: the binding refuses at import a library without libep's "
          f"ABI{' or of ABI 2' if len(cases) > 1 else ''} and loads ABI 1")


def main():
    check_abi()
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
        check_lifetimes(sock)
        check_nodes_recv(sock)
        check_numpy(sock)
        check_ll(sock)
        check_doctest(sock)
        print(f"ok: python binding, {W} ranks (seed {SEED}): layout, dispatch, "
              "cached dispatch, combine bitwise equal to a Python reference; "
              "a bad expert raises epd.Error(-1012)")
        return 0
    finally:
        p.terminate()
        p.wait(10)
        if p.returncode != 0:
            print(open(os.path.join(d, "epd.log")).read())
        elif not os.environ.get("EPD_TEST_KEEP"):
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
