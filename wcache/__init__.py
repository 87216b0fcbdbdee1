"""wcache: a persistent GPU weight cache for LLM inference engines.

Public API (everything else is internal)::

    from wcache import WCacheClient, WeightCacheKey
    key = WeightCacheKey.from_checkpoint("/models/llama", tp_rank=0, tp_size=1)
    async with await WCacheClient(socket_path=...).fetch(key) as weights:
        model.load_state_dict(weights, assign=True)

``RankSpec`` names a rank the way every other rank-taking API takes it (``WeightCacheKey.from_spec``,
``WCacheClient.preload``): ``RankSpec("/models/llama", tp_rank=0, tp_size=1)``. ``RecipeKey.of(key,
engine=...)`` is a deposit's key (write-back). Every error class of ``wcache.errors`` is a name here too, and
``wcache.nn`` (torch engines: ``load_weights``, ``attach``, ``guard_writes``) and ``wcache.integrations`` are
reachable as attributes after ``import wcache``.

Every public name is imported on first access (PEP 562): ``import wcache`` itself loads nothing,
so an engine's restart pays only for the modules its path uses (the key, the protocol, the
client), and ``import wcache.proto`` stays free of asyncio and torch (docs/protocol.md is
implementable without either). ``wcache.nn`` imports torch when first read.
"""

from __future__ import annotations

import gc
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wcache import integrations as integrations
    from wcache import nn as nn
    from wcache.client import CachedWeights, WCacheClient
    from wcache.errors import (
        CacheUnavailableError,
        CheckpointError,
        DaemonRunningError,
        DeviceMismatchError,
        FillError,
        FrameTooLargeError,
        IncompatibleModelError,
        InsecurePathError,
        InternalError,
        InUseError,
        KeyMismatchError,
        KeyUnprovenError,
        LimitExceededError,
        LocalProtocolError,
        NotFoundError,
        NotReadyError,
        OutOfMemoryError,
        PermissionDeniedError,
        ProtocolError,
        RemoteProtocolError,
        ServerError,
        ShardingError,
        TierEntryError,
        TransformError,
        UnexpectedFrameError,
        UnknownLeaseError,
        UnsupportedPlatformError,
        UnsupportedVersionError,
        WCacheError,
    )
    from wcache.plan.key import RankSpec, WeightCacheKey
    from wcache.plan.recipe import RecipeKey

__version__ = "0.1.0"

__all__ = [
    "CacheUnavailableError",
    "CachedWeights",
    "CheckpointError",
    "DaemonRunningError",
    "DeviceMismatchError",
    "FillError",
    "FrameTooLargeError",
    "InUseError",
    "IncompatibleModelError",
    "InsecurePathError",
    "InternalError",
    "KeyMismatchError",
    "KeyUnprovenError",
    "LimitExceededError",
    "LocalProtocolError",
    "NotFoundError",
    "NotReadyError",
    "OutOfMemoryError",
    "PermissionDeniedError",
    "ProtocolError",
    "RankSpec",
    "RecipeKey",
    "RemoteProtocolError",
    "ServerError",
    "ShardingError",
    "TierEntryError",
    "TransformError",
    "UnexpectedFrameError",
    "UnknownLeaseError",
    "UnsupportedPlatformError",
    "UnsupportedVersionError",
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
    "RecipeKey": "wcache.plan.recipe",
    **{n: "wcache.errors" for n in __all__ if n.endswith("Error")},
}
#: submodules reachable as attributes of ``wcache`` without their own import statement (``wcache.nn.load_weights``,
#: ``wcache.integrations.transformers.from_pretrained`` after ``import wcache``); not in ``__all__``: a star import
#: must not import torch
_SUBMODULES = frozenset({"nn", "integrations"})


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None and name in _SUBMODULES:
        home = f"{__name__}.{name}"
        __import__(home)  # the import system sets the attribute on this package
        return sys.modules[home]
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
    return sorted(set(globals()) | set(__all__) | _SUBMODULES)
