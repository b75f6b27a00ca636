# SPDX-License-Identifier: MIT
"""A connection to epd (epd.Conn, epd.connect), the node list of a job
(epd.node_names), the daemon's status, and the stream copy helpers."""
import ctypes
import json

from ._lib import (_lib, _libc, _check, _GroupConfig, _JoinOpts, _Copy,
                   Error)
from ._lib import (  # the constants of ep/ep.h
    BF16, EINVAL, JOIN_NOWAIT, JOIN_CUDA)
from .group import Group


def node_names(conn, group=None, ranks_per_node=None):
    """The node list of a group spanning the ranks of a torch.distributed
    process group (None: the default one), each rank on conn's daemon:
    every rank's Conn.node gathered, node i named by rank
    i * ranks_per_node. The ranks must be node-major with the same number
    a node (ranks_per_node: counted when None). Collective: every rank of
    the process group calls it."""
    import torch.distributed as dist
    names = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, conn.node, group)
    rpn = ranks_per_node or names.count(names[0])
    if len(names) % rpn or any(
            names[i] != names[i - i % rpn] or names.count(names[i]) != rpn
            for i in range(len(names))):
        raise ValueError("the process group's ranks are not node-major "
                         f"with {rpn} a node: {names}")
    return names[::rpn]


class Conn:
    """A connection to epd. close() (or leaving its with block) leaves
    every group still joined on it; those Group objects then raise
    epd.Error. Groups keep their connection alive."""

    def __init__(self, socket=None):
        c = ctypes.c_void_p()
        self._c = None
        self._groups = set()
        _check(_lib.ep_connect(socket.encode() if socket else None,
                               ctypes.byref(c)))
        self._c = c

    @property
    def _conn(self):
        if not self._c:
            raise Error(EINVAL, "the connection is closed")
        return self._c

    @property
    def node(self):
        """The name of the node whose daemon this connection reaches
        (what a job gathers into a group's node list)."""
        return _lib.ep_conn_node(self._conn).decode()

    def join(self, name, world_size, ranks_per_node, rank, num_experts,
             hidden, max_tokens_per_rank, topk, dtype=BF16, timeout_ms=0,
             wait=True, cuda_device=None, recv_areas=1, nodes=None,
             recv_rows=0, secret=None):
        """cuda_device: a GPU rank on that device (its buffers in GPU
        memory; use the *_stream methods and Group.tensor). recv_areas:
        recv_x as that many areas (1..16, every rank alike, one-node
        groups); each dispatch names the area its rows go to. nodes: the
        group's nodes, the names of node 0, 1, ... (each rank's
        Conn.node, gathered by the job: node_names() does it over a
        torch process group); None: node i is the i-th of the daemons'
        peers. recv_rows: the rows a rank may receive (0: world_size x
        max_tokens_per_rank); a dispatch past it fails on every rank.
        secret: the job's secret (bytes or str, 1..256 bytes), the same on
        every rank: the group is then the job's own (another secret, or
        none, names another group)."""
        cfg = dict(name=name, world_size=world_size,
                   ranks_per_node=ranks_per_node, rank=rank,
                   num_experts=num_experts, hidden=hidden,
                   max_tokens_per_rank=max_tokens_per_rank, topk=topk,
                   dtype=dtype, timeout_ms=timeout_ms,
                   cuda_device=cuda_device, recv_rows=recv_rows)
        if not 1 <= recv_areas <= 16:
            raise ValueError(f"recv_areas {recv_areas}: 1..16")
        gc = _GroupConfig(name.encode(), world_size, ranks_per_node, rank,
                          num_experts, hidden, max_tokens_per_rank, topk,
                          dtype, timeout_ms,
                          0 if cuda_device is None else cuda_device)
        flags = (0 if wait else JOIN_NOWAIT) | \
            (JOIN_CUDA if cuda_device is not None else 0) | \
            int(recv_areas) << 8
        g = ctypes.c_void_p()
        opts = None
        if nodes is not None or recv_rows or secret:
            opts = _JoinOpts(size=ctypes.sizeof(_JoinOpts),
                             recv_rows=int(recv_rows))
            if secret:
                sb = secret.encode() if isinstance(secret, str) else \
                    bytes(secret)
                opts.secret, opts.secret_len = sb, len(sb)
            if nodes is not None:
                if len(nodes) != world_size // ranks_per_node:
                    raise ValueError(
                        f"nodes names {len(nodes)} nodes; world_size "
                        f"{world_size} at {ranks_per_node} a node is "
                        f"{world_size // ranks_per_node}")
                arr = (ctypes.c_char_p * len(nodes))(
                    *[str(n).encode() for n in nodes])
                opts.nodes = arr
        _check(_lib.ep_join_ex(self._conn, ctypes.byref(gc),
                               ctypes.byref(opts) if opts else None, flags,
                               ctypes.byref(g)))
        grp = Group(self, g, cfg)
        self._groups.add(grp)
        return grp

    def status(self):
        p = ctypes.c_void_p()
        _check(_lib.ep_daemon_status(self._conn, ctypes.byref(p)))
        try:
            return json.loads(ctypes.string_at(p).decode())
        finally:
            _libc.free(p)

    def close(self):
        """Close (idempotent). libep leaves and frees the groups still
        joined: their Group objects are cut loose first."""
        if self._c:
            for grp in list(self._groups):
                grp._handle = None
                for r in grp._mregs:  # freed by ep_close
                    r._p = None
                grp._mregs.clear()
            self._groups.clear()
            c, self._c = self._c, None
            _lib.ep_close(c)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


def connect(socket=None):
    return Conn(socket)


def copy_piece(dst, src, nbytes):
    """A contiguous copy of nbytes for stream_copies, in the widest
    elements (16 bytes down to 1) that the addresses and size allow."""
    for e in (16, 8, 4, 2, 1):
        if not (dst | src | nbytes) % e:
            return (dst, src, nbytes // e, e, 1, 1)


def stream_copies(copies, stream):
    """Device copies in one kernel launch on stream (a torch stream or a
    raw CUstream as int), in the current CUDA context: each a tuple (dst,
    src, count, elt, dst_stride, src_stride) of device addresses, count
    elements of elt bytes, strides in elements (ep_stream_copies(3))."""
    n = len(copies)
    arr = (_Copy * max(n, 1))(*[_Copy(*c) for c in copies])
    _check(_lib.ep_stream_copies(arr, n, Group._stream(stream)))


def status(socket=None):
    with connect(socket) as c:
        return c.status()

