# SPDX-License-Identifier: MIT
"""deep_ep.buffers as DeepEP 2.x lays it out."""
from . import elastic, legacy  # noqa: F401
from .legacy import Buffer  # noqa: F401
from .elastic import ElasticBuffer, EPHandle  # noqa: F401
