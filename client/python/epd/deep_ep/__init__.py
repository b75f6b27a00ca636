# SPDX-License-Identifier: MIT
"""DeepEP's Python API (V1's Buffer, V2's ElasticBuffer) on epd: `import
epd.deep_ep as deep_ep`, or install the optional `deep_ep` shim (client/python/deep_ep_shim)
so that unmodified code that does `import deep_ep` runs on epd.

Laid out as DeepEP 2.x (deep_ep.buffers.legacy.Buffer, deep_ep.utils.*)
and 1.x (deep_ep.buffer.Buffer, deep_ep.utils.EventOverlap) both. Needs
torch; epd's daemon must be running (socket $EPD_SOCKET or the default).
"""
import torch as _torch

from . import utils  # noqa: F401
from .buffers import legacy as _legacy
from . import buffers  # noqa: F401
from .buffers.legacy import Buffer, Config  # noqa: F401
from .buffers.elastic import ElasticBuffer, EPHandle  # noqa: F401
from .utils.event import EventHandle, EventOverlap  # noqa: F401
from .utils.envs import (get_logical_domain_size,  # noqa: F401
                         get_physical_domain_size)

topk_idx_t = _torch.int64
_legacy.topk_idx_t = topk_idx_t
buffer = _legacy  # 1.x: deep_ep.buffer.Buffer
__version__ = "2.1.0+epd"
__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventOverlap",
           "EventHandle", "topk_idx_t"]
