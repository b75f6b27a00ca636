#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The CUDA IPC facts the daemon's use of ranks' own tensors rests on
(doc/design.md, section 8), checked on this machine: a torch process (the
rank) exports the allocation under a tensor, another process (the
daemon's stand-in, the driver API alone) opens it.

Asserted:
  - the importer reads the exporter's bytes through the opened handle;
  - after the exporter frees the tensor and empties torch's cache (the
    cudaFree), and after the exporter exits, the importer's mapping still
    reads the old bytes: a rank cannot make the daemon fault by freeing a
    tensor it handed over (the memory lives until the daemon closes it);
  - memory allocated afresh at the same address has another handle;
  - the same handle opened twice in one context: reported (either the same
    address or CUDA_ERROR_ALREADY_MAPPED; the daemon caches by handle).
Timed: cuIpcGetMemHandle and cuPointerGetAttributes on the rank, the first
cuIpcOpenMemHandle on the importer (perf lines).
"""
import ctypes
import multiprocessing as mp
import os
import sys
import time

MB = 1 << 20
CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]

    def raw(self):
        return ctypes.string_at(ctypes.addressof(self), 64)

    def set(self, b):
        ctypes.memmove(ctypes.addressof(self), b, 64)


def drv():
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                         Handle, ctypes.c_uint]
    cu.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(Handle), ctypes.c_uint64]
    return cu


def chk(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")


def importer(q_in, q_out):
    cu = drv()
    chk(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    chk(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    chk(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
    chk(cu.cuCtxSetCurrent(ctx), "setcurrent")
    h = Handle()
    ptr = ctypes.c_uint64()
    buf = (ctypes.c_uint8 * 64)()

    def read(p, off=0):
        r = cu.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(p + off), 64)
        return r, bytes(buf)

    while True:
        msg = q_in.get()
        if msg[0] == "quit":
            return
        if msg[0] == "open":
            h.set(msg[1])
            t0 = time.perf_counter()
            r = cu.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h,
                                         CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            dt = time.perf_counter() - t0
            q_out.put((r, ptr.value, dt))
        elif msg[0] == "open2":
            h.set(msg[1])
            p2 = ctypes.c_uint64()
            r = cu.cuIpcOpenMemHandle_v2(ctypes.byref(p2), h,
                                         CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            q_out.put((r, p2.value))
        elif msg[0] == "read":
            q_out.put(read(msg[1], msg[2]))
        elif msg[0] == "close":
            q_out.put(cu.cuIpcCloseMemHandle(ctypes.c_uint64(msg[1])))


def exporter(q_imp, q_res, q_done):
    import torch
    cu = drv()
    torch.cuda.init()
    x = torch.empty(64 * MB, dtype=torch.uint8, device="cuda")
    x.copy_(torch.arange(64 * MB, dtype=torch.int64, device="cuda")
            .remainder(251).to(torch.uint8))
    torch.cuda.synchronize()
    p = x.data_ptr() + 4096  # a pointer inside the allocation
    start, size = ctypes.c_uint64(), ctypes.c_uint64()
    bid = ctypes.c_uint64()
    attrs = (ctypes.c_int * 3)(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                               CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                               CU_POINTER_ATTRIBUTE_BUFFER_ID)
    data = (ctypes.c_void_p * 3)(ctypes.cast(ctypes.byref(start), ctypes.c_void_p),
                                 ctypes.cast(ctypes.byref(size), ctypes.c_void_p),
                                 ctypes.cast(ctypes.byref(bid), ctypes.c_void_p))
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        chk(cu.cuPointerGetAttributes(3, attrs, data, ctypes.c_uint64(p)),
            "cuPointerGetAttributes")
    t_attr = (time.perf_counter() - t0) / n
    h = Handle()
    t0 = time.perf_counter()
    for _ in range(n):
        chk(cu.cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(start.value)),
            "cuIpcGetMemHandle")
    t_get = (time.perf_counter() - t0) / n
    off = p - start.value
    q_done.put(("meta", start.value, size.value, bid.value, off, t_attr,
                t_get, h.raw()))
    cmd = q_imp.get()  # "free"
    assert cmd == "free"
    old_start = start.value
    del x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    y = torch.full((64 * MB,), 7, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    chk(cu.cuPointerGetAttributes(3, attrs, data, ctypes.c_uint64(y.data_ptr())),
        "attrs y")
    h2 = Handle()
    chk(cu.cuIpcGetMemHandle(ctypes.byref(h2), ctypes.c_uint64(start.value)),
        "handle y")
    q_done.put(("freed", old_start, start.value, h2.raw()))
    cmd = q_imp.get()  # "exit"
    del y
    torch.cuda.empty_cache()


def main():
    ctx = mp.get_context("spawn")
    qi, qo = ctx.Queue(), ctx.Queue()
    qe, qd = ctx.Queue(), ctx.Queue()
    imp = ctx.Process(target=importer, args=(qi, qo))
    exp = ctx.Process(target=exporter, args=(qe, None, qd))
    imp.start()
    exp.start()
    fails = 0

    def check(cond, what):
        nonlocal fails
        print(("ok: " if cond else "FAIL: ") + what, flush=True)
        fails += 0 if cond else 1

    meta = qd.get(timeout=120)
    _, start, size, bid, off, t_attr, t_get, hb = meta
    print(f"perf: rank cuPointerGetAttributes {t_attr * 1e6:.2f} us, "
          f"cuIpcGetMemHandle {t_get * 1e6:.2f} us (allocation {size >> 20} "
          f"MiB, buffer id {bid})", flush=True)
    qi.put(("open", hb))
    r, p, dt = qo.get(timeout=60)
    print(f"perf: importer first cuIpcOpenMemHandle {dt * 1e6:.0f} us", flush=True)
    check(r == 0, f"importer opened the handle (CUresult {r})")
    want = bytes((off + i) % 251 for i in range(64))
    qi.put(("read", p, off))
    r, got = qo.get(timeout=60)
    check(r == 0 and got == want, "importer reads the exporter's bytes")
    qi.put(("open2", hb))
    r2, p2 = qo.get(timeout=60)
    print(f"ok: info: the same handle opened again: CUresult {r2}, "
          f"{'same address' if p2 == p else hex(p2)}", flush=True)
    if r2 == 0 and p2 != p:
        qi.put(("close", p2))
        qo.get(timeout=60)
    qe.put("free")
    _, old, new, h2 = qd.get(timeout=120)
    check(h2 != hb, "a fresh allocation has another handle"
          f" ({'same' if old == new else 'other'} address)")
    qi.put(("read", p, off))
    r, got = qo.get(timeout=60)
    check(r == 0 and got == want,
          f"after the rank freed it, the mapping reads the old bytes "
          f"(CUresult {r})")
    qe.put("exit")
    exp.join(60)
    qi.put(("read", p, off))
    r, got = qo.get(timeout=60)
    check(r == 0 and got == want,
          f"after the rank exited, the mapping reads the old bytes "
          f"(CUresult {r})")
    qi.put(("close", p))
    check(qo.get(timeout=60) == 0, "the importer closes the handle")
    qi.put(("quit",))
    imp.join(60)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
