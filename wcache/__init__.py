"""wcache: a persistent GPU weight cache for LLM inference engines.

Public API (everything else is internal)::

    from wcache import WCacheClient, WeightCacheKey
    key = WeightCacheKey.from_checkpoint("/models/llama", tp_rank=0, tp_size=1)
    async with await WCacheClient(socket_path=...).fetch(key) as weights:
        model.load_state_dict(weights, assign=True)

Client names are imported lazily so that ``import wcache.proto`` stays free of asyncio
and torch (docs/protocol.md is implementable without either).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wcache.errors import (
    CacheUnavailableError,
    CheckpointError,
    DeviceMismatchError,
    InsecurePathError,
    KeyMismatchError,
    NotReadyError,
    PermissionDeniedError,
    ProtocolError,
    ServerError,
    ShardingError,
    TransformError,
    UnknownLeaseError,
    UnsupportedPlatformError,
    WCacheError,
)
from wcache.key import WeightCacheKey

if TYPE_CHECKING:
    from wcache.client import CachedWeights, WCacheClient

__version__ = "0.1.0"

__all__ = [
    "CacheUnavailableError",
    "CachedWeights",
    "CheckpointError",
    "DeviceMismatchError",
    "InsecurePathError",
    "KeyMismatchError",
    "NotReadyError",
    "PermissionDeniedError",
    "ProtocolError",
    "ServerError",
    "ShardingError",
    "TransformError",
    "UnknownLeaseError",
    "UnsupportedPlatformError",
    "WCacheClient",
    "WCacheError",
    "WeightCacheKey",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in ("WCacheClient", "CachedWeights"):
        from wcache import client

        return getattr(client, name)
    raise AttributeError(f"module 'wcache' has no attribute {name!r}")
