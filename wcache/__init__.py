"""wcache: a persistent GPU weight cache for LLM inference engines.

Public API (everything else is internal)::

    from wcache import WCacheClient, WeightCacheKey
    key = WeightCacheKey.from_checkpoint("/models/llama", tp_rank=0, tp_size=1)
    async with await WCacheClient(socket_path=...).fetch(key) as weights:
        model.load_state_dict(weights, assign=True)

``RankSpec`` names a rank the way every other rank-taking API takes it (``WeightCacheKey.from_spec``,
``WCacheClient.preload``): ``RankSpec("/models/llama", tp_rank=0, tp_size=1)``.

Every public name is imported on first access (PEP 562): ``import wcache`` itself loads nothing,
so an engine's restart pays only for the modules its path uses (the key, the protocol, the
client), and ``import wcache.proto`` stays free of asyncio and torch (docs/protocol.md is
implementable without either).
"""

from __future__ import annotations

import gc
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wcache.client import CachedWeights, WCacheClient
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
    from wcache.plan.key import RankSpec, WeightCacheKey

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
    "RankSpec",
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

#: public name -> the module defining it (imported on first access)
_HOME = {
    "WCacheClient": "wcache.client.client",
    "CachedWeights": "wcache.client.client",
    "WeightCacheKey": "wcache.plan.key",
    "RankSpec": "wcache.plan.key",
    **{n: "wcache.errors" for n in __all__ if n.endswith("Error")},
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'wcache' has no attribute {name!r}")
    collecting = gc.isenabled()
    gc.disable()  # the import builds ~100 objects per class: collections meanwhile sweep torch's heap, find nothing
    try:
        # the import statement's own path: python -X importtime reports the home (importlib.import_module's does not)
        __import__(home)
        value = getattr(sys.modules[home], name)
    finally:
        if collecting:
            codec = sys.modules.get("wcache.proto.codec")  # loaded by every home but wcache.errors
            if codec is not None:
                codec.keep_young()  # the modules stay: no collection passes over them afterwards either
            gc.enable()
    globals()[name] = value  # later look-ups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
