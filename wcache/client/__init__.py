"""The engine side: fetch a rank's weights from a daemon as torch tensors.

``WCacheClient`` and ``CachedWeights`` are imported on first access (PEP 562), as ``wcache``'s own names: the
client's torch-free modules (``driver``, the ctypes CUDA driver binding the daemon's ``wcache._cuda`` shares)
import without the client and torch.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wcache.client.client import CachedWeights, WCacheClient

__all__ = ["CachedWeights", "WCacheClient"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'wcache.client' has no attribute {name!r}")
    __import__("wcache.client.client")  # as wcache's own names: python -X importtime reports it
    value = getattr(sys.modules["wcache.client.client"], name)
    globals()[name] = value  # later look-ups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
