# SPDX-License-Identifier: MIT
"""deep_ep.utils as DeepEP 2.x lays it out (1.x: EventOverlap here)."""
from . import envs, event, gate, math, refs, semantic, testing  # noqa: F401
from .event import EventHandle, EventOverlap  # noqa: F401
