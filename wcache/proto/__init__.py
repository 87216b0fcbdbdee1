"""The wcache wire protocol, pure: no asyncio, sockets or torch (docs/protocol.md).

Layers, each importing only those above it (docs/architecture.md): ``codec`` (length prefix +
msgpack), ``fields`` (field kinds and the one generic encoder/decoder), ``table`` (the columnar
tensor table), ``daemon_frames`` (an engine's frames), ``admin_frames``, ``deposit_frames``,
``peer_frames`` and ``fleet_frames`` (the others, by use), ``frames`` (the registry and
``decode_frame``), ``connection`` (the per-connection state machine: which service, which phase,
which descriptors). Bytes in, typed frames out.

Every name here is imported on first access (PEP 562), from the module that defines it: ``import
wcache.proto`` loads nothing, and an engine's restart loads only the modules its frames need.
"""

# ruff: noqa: F405  (``__all__`` names what the star imports below give the type checker)
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names of __all__, for the type checker; at run time each is imported when first read
    from wcache.proto.codec import *  # noqa: F403
    from wcache.proto.connection import *  # noqa: F403
    from wcache.proto.frames import *  # noqa: F403

__all__ = [
    "BACKENDS",
    "DEFAULT_MAX_FRAME_SIZE",
    "DTYPE_SIZES",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "Connection",
    "DaemonRequest",
    "Event",
    "KeeperRequest",
    "Misdirected",
    "Service",
    "DeviceInfo",
    "ErrorFrame",
    "CheckpointProof",
    "Commit",
    "Deposit",
    "DepositSlab",
    "DepositTensor",
    "Deposited",
    "Evict",
    "Evicted",
    "FileStat",
    "Frame",
    "FrameBuffer",
    "GetState",
    "HandedModel",
    "Hello",
    "HelloOk",
    "Keep",
    "Kept",
    "LeaseInfo",
    "ModelInfo",
    "PeerAuth",
    "PeerAuthOk",
    "PeerBlock",
    "PeerChallenge",
    "PeerFile",
    "PeerFiles",
    "PeerFilesReply",
    "PeerModel",
    "PeerOffer",
    "PeerProof",
    "PeerQuery",
    "PeerRead",
    "PeerReadOk",
    "Phase",
    "Preload",
    "Preloaded",
    "Reclaim",
    "Reclaimed",
    "Release",
    "Released",
    "Role",
    "SlabDescriptor",
    "State",
    "Status",
    "StatusReply",
    "Takeover",
    "TakeoverAdopted",
    "TakeoverDone",
    "TakeoverState",
    "TensorEntry",
    "TensorGroup",
    "TensorTable",
    "Unkeep",
    "as_received",
    "decode_body",
    "decode_frame",
    "pack_frame",
    "tensor_extent",
]

#: where the names of ``__all__`` are defined (or re-exported), searched in this order
_MODULES = ("wcache.proto.codec", "wcache.proto.connection", "wcache.proto.frames")


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'wcache.proto' has no attribute {name!r}")
    from wcache.proto._lazy import export  # not at import: an engine's path reads no name here

    return export(globals(), name, _MODULES)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
