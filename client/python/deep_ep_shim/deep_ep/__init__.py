# SPDX-License-Identifier: MIT
"""`import deep_ep` on epd: this optional package (installed from epd's
client/python/deep_ep_shim, never by default, so that a real DeepEP is not
shadowed by accident) is epd.deep_ep under DeepEP's name, submodules
included (deep_ep.utils.envs, deep_ep.buffers.legacy, deep_ep.buffer)."""
import sys

import epd.deep_ep as _impl
from epd.deep_ep import *  # noqa: F401,F403
from epd.deep_ep import (Buffer, Config, ElasticBuffer,  # noqa: F401
                         EPHandle, EventHandle, EventOverlap, topk_idx_t,
                         __version__)

for _name, _mod in list(sys.modules.items()):
    if _name.startswith("epd.deep_ep."):
        sys.modules["deep_ep." + _name[len("epd.deep_ep."):]] = _mod
sys.modules["deep_ep.buffer"] = _impl.buffer
buffer = _impl.buffer
utils = _impl.utils
buffers = _impl.buffers
