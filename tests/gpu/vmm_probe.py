#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Can the daemon import a rank's own tensors by file descriptor? The facts
doc/design.md section 8 names as the sound path, checked on this machine:
a torch process with PyTorch's expandable segments
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) exports the physical
allocations under a tensor as POSIX file descriptors; another process
(the daemon's stand-in: the driver API alone) imports them, maps them
contiguously and reads the tensor's bytes.

Asserted:
  - every allocation under the tensor was made with POSIX-descriptor
    handles requested (else the export fails and the shim must copy);
  - the importer reads the exporter's bytes through its own mapping;
  - after the exporter frees the tensor and empties torch's cache, and
    after it exits, the importer still reads the old bytes (its import
    keeps the physical memory alive: a rank cannot make the daemon fault);
  - a retained handle of a still-mapped chunk is the same value each time
    (what a rank-side cache of exports can key on).
Reported: the chunk size, the number of chunks under a 312 MB tensor, the
rank's cost of retaining and exporting one chunk and the importer's cost
of importing and mapping one (perf lines).
"""
import ctypes
import os
import socket
import sys
import time

MB = 1 << 20
POSIX_FD = 1


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handles", ctypes.c_int),
                ("loc", Loc), ("win32", ctypes.c_void_p),
                ("flags", ctypes.c_ubyte * 8)]


class Access(ctypes.Structure):
    _fields_ = [("loc", Loc), ("flags", ctypes.c_int)]


def drv():
    return ctypes.CDLL("libcuda.so.1")


def chk(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")


def importer(sock):
    cu = drv()
    chk(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    chk(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    chk(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
    chk(cu.cuCtxSetCurrent(ctx), "setcurrent")
    msg, fds, _, _ = socket.recv_fds(sock, 4096, 1024)
    chunk, total, off = (int(v) for v in msg.decode().split())
    va = ctypes.c_uint64()
    chk(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(total),
                               ctypes.c_size_t(0), ctypes.c_uint64(0),
                               ctypes.c_uint64(0)), "reserve")
    acc = Access(Loc(1, 0), 3)
    t0 = time.perf_counter()
    for i, fd in enumerate(fds):
        h = ctypes.c_uint64()
        chk(cu.cuMemImportFromShareableHandle(ctypes.byref(h),
                                              ctypes.c_void_p(fd), POSIX_FD),
            "import")
        os.close(fd)
        p = va.value + i * chunk
        chk(cu.cuMemMap(ctypes.c_uint64(p), ctypes.c_size_t(chunk),
                        ctypes.c_size_t(0), h, ctypes.c_uint64(0)), "map")
        chk(cu.cuMemRelease(h), "release")  # the mapping keeps it
        chk(cu.cuMemSetAccess(ctypes.c_uint64(p), ctypes.c_size_t(chunk),
                              ctypes.byref(acc), ctypes.c_size_t(1)),
            "access")
    dt = (time.perf_counter() - t0) / max(1, len(fds))
    buf = (ctypes.c_uint8 * 64)()

    def read(at):
        chk(cu.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(va.value + off + at),
                               ctypes.c_size_t(64)), "read")
        return bytes(buf)

    sock.sendall(f"{dt * 1e6:.1f}".encode())
    while True:
        cmd = sock.recv(64).decode()
        if not cmd or cmd == "quit":
            return
        at = int(cmd)
        sock.sendall(read(at))


def main():
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        a.close()
        try:
            importer(b)
        finally:
            os._exit(0)
    b.close()
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch
    cu = drv()
    fails = 0

    def check(cond, what):
        nonlocal fails
        print(("ok: " if cond else "FAIL: ") + what, flush=True)
        fails += 0 if cond else 1

    torch.cuda.init()
    torch.empty(1, device="cuda")  # a first, small segment
    n = 312 * MB
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    p = x.data_ptr()
    print(f"info: torch {torch.__version__}, tensor at {p:#x}", flush=True)
    gran = 2 * MB
    handles = []  # (first address, handle) of each chunk under x
    t0 = time.perf_counter()
    first = p - p % gran
    nret = 0
    for at in range(first, p + n, gran):
        h = ctypes.c_uint64()
        r = cu.cuMemRetainAllocationHandle(ctypes.byref(h), ctypes.c_uint64(at))
        nret += 1
        if r != 0:
            check(False, f"cuMemRetainAllocationHandle({at:#x}): CUresult {r}"
                  " (not VMM memory: expandable segments off?)")
            a.sendall(b"quit")
            return 1
        if handles and handles[-1][1] == h.value:
            cu.cuMemRelease(h)
        else:
            handles.append((at, h.value))
    t_ret = (time.perf_counter() - t0) / nret
    chunks = [handles[i + 1][0] - handles[i][0] for i in range(len(handles) - 1)]
    chunk = max(set(chunks), key=chunks.count) if chunks else gran
    print(f"perf: {len(handles)} chunks of {chunk >> 20} MiB under a 312 MiB "
          f"tensor; retain {t_ret * 1e6:.2f} us per 2 MiB step", flush=True)
    check(all(c == chunk for c in chunks), "the chunks are of one size")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    r = cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                   ctypes.c_uint64(handles[1][0] + 4096))
    print(f"info: cuMemGetAddressRange inside chunk 1: CUresult {r}, "
          f"{base.value - handles[1][0]:+#x} from its start, size "
          f"{size.value >> 20} MiB", flush=True)
    h2 = ctypes.c_uint64()
    chk(cu.cuMemRetainAllocationHandle(ctypes.byref(h2),
                                       ctypes.c_uint64(handles[0][0])), "re")
    check(h2.value == handles[0][1], "a chunk retained again: the same handle")
    cu.cuMemRelease(h2)
    prop = Prop()
    chk(cu.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop),
                                                  ctypes.c_uint64(handles[0][1])),
        "props")
    check(prop.handles & POSIX_FD,
          f"the chunks request POSIX descriptors (requestedHandleTypes "
          f"{prop.handles:#x})")
    fds = []
    t0 = time.perf_counter()
    for _, h in handles:
        fd = ctypes.c_int(-1)
        r = cu.cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_uint64(h),
                                            POSIX_FD, ctypes.c_uint64(0))
        if r != 0:
            check(False, f"cuMemExportToShareableHandle: CUresult {r}")
            a.sendall(b"quit")
            return 1
        fds.append(fd.value)
    t_exp = (time.perf_counter() - t0) / len(handles)
    print(f"perf: export {t_exp * 1e6:.2f} us per chunk", flush=True)
    off = p - handles[0][0]
    socket.send_fds(a, [f"{chunk} {chunk * len(handles)} {off}".encode()], fds)
    for fd in fds:
        os.close(fd)
    t_imp = a.recv(64).decode()
    print(f"perf: importer import+map+access {t_imp} us per chunk", flush=True)
    probes = [0, 4096, n // 2 + 12345, n - 64]
    want = {at: x[at:at + 64].cpu().numpy().tobytes() for at in probes}

    def reads_ok():
        for at in probes:
            a.sendall(str(at).encode())
            got = b""
            while len(got) < 64:
                got += a.recv(64 - len(got))
            if got != want[at]:
                return False
        return True

    check(reads_ok(), "the importer reads the tensor's bytes")
    for _, h in handles:
        cu.cuMemRelease(ctypes.c_uint64(h))
    del x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    y = torch.zeros(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    check(reads_ok(), "after the rank freed it (empty_cache, new tensor), "
          "the importer reads the old bytes")
    del y
    a.sendall(b"quit")
    os.waitpid(pid, 0)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
