# SPDX-License-Identifier: MIT
"""Python binding of libep, the client library of epd (ctypes, no build step).

One rank of a one-rank group, end to end (with epd running; the socket is
$EPD_SOCKET or the default path):

>>> import numpy as np
>>> import epd
>>> def bf16(a):   # float32 -> bf16 bits (these values are exact in bf16)
...     return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)
>>> with epd.connect() as conn:
...     with conn.join("doctest", world_size=1, ranks_per_node=1, rank=0,
...                    num_experts=4, hidden=128, max_tokens_per_rank=8,
...                    topk=2) as g:
...         x = bf16(np.arange(3 * 128).reshape(3, 128) / 4)
...         topk_idx = np.array([[0, 1], [2, -1], [3, 0]], dtype=np.int64)
...         res = g.dispatch(x, topk_idx, num_tokens=3, as_numpy=True)
...         out = g.combine(res.recv_x, res.handle, as_numpy=True)
>>> res.recv_x.shape, res.recv_topk_idx.shape, out.shape
((3, 128), (3, 2), (3, 128))
>>> bool((out == x).all())   # each token went to one rank: it comes back
True

Arrays are anything with the buffer protocol (bytes, bytearray,
array.array, numpy arrays, torch CPU tensors via .numpy()). bf16 is raw
16-bit storage: pass uint16/int16 views (torch: t.view(torch.int16)).
Outputs are bytearrays, or with as_numpy=True numpy arrays shaped
[rows, hidden] (bf16 as uint16 bits, fp8 as uint8), [rows, topk], ...
A rank with no tokens passes num_tokens=0 and empty (or None) arrays.
Errors raise epd.Error with .code (negative, see ep/ep.h) and the daemon's
message. Leaving a group or closing its connection (in either order, or by
leaving their with blocks) is always safe; a group used after its
connection closed raises epd.Error (EP_EINVAL).

The library: $EP_LIBRARY if set, else the libdir this package was installed
with (make install), else the dynamic linker's search path.
"""
from ._lib import (  # noqa: F401 (the constants of ep/ep.h)
    BF16, FP8, EINVAL, ETOOBIG, EUNSUPPORTED, EMISMATCH, JOIN_NOWAIT,
    JOIN_CUDA, DISPATCH_WEIGHTS, COMBINE_BIAS, COMBINE_WEIGHTS,
    COMBINE_BIAS2, LL_HOOK, LL_ZERO_COPY, LL_FP8, LL_ROUND_SCALE, LL_UE8M0,
    LL_TOPK, COPIES_MAX)
from ._lib import _ABI, _lib, _DeviceArray, Error, Handle  # noqa: F401
from .group import DispatchResult, MemRegion, Group  # noqa: F401
from .conn import (Conn, connect, node_names, status, copy_piece,  # noqa: F401
                   stream_copies)

__all__ = ["connect", "Error", "Conn", "Group", "Handle", "DispatchResult",
           "BF16", "FP8", "status"]
