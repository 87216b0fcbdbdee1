"""The wcache wire protocol, pure: no asyncio, sockets or torch (docs/protocol.md).

Layers, each importing only those above it (docs/architecture.md): ``codec`` (length prefix +
msgpack), ``fields`` (field kinds and the one generic encoder/decoder), ``table`` (the columnar
tensor table), ``daemon_frames`` (an engine's frames), ``admin_frames``, ``deposit_frames`` and
``peer_frames`` (the others, by use), ``frames`` (the registry and ``decode_frame``), ``connection``
(the per-connection state machine: which service, which phase, which descriptors). Bytes in, typed
frames out.

Every name here is imported on first access (PEP 562), from the module that defines it: ``import
wcache.proto`` loads nothing, and an engine's restart loads only the modules its frames need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wcache.proto.codec import DEFAULT_MAX_FRAME_SIZE, FrameBuffer, decode_body, pack_frame
    from wcache.proto.connection import (
        PROTOCOL_VERSION,
        SUPPORTED_VERSIONS,
        Connection,
        DaemonRequest,
        Event,
        KeeperRequest,
        Misdirected,
        Phase,
        Role,
        Service,
    )
    from wcache.proto.frames import (
        BACKENDS,
        DTYPE_SIZES,
        CheckpointProof,
        Commit,
        Deposit,
        Deposited,
        DepositSlab,
        DepositTensor,
        DeviceInfo,
        ErrorFrame,
        Evict,
        Evicted,
        FileStat,
        Frame,
        GetState,
        HandedModel,
        Hello,
        HelloOk,
        Keep,
        Kept,
        LeaseInfo,
        ModelInfo,
        Preload,
        Preloaded,
        Reclaim,
        Reclaimed,
        Release,
        Released,
        SlabDescriptor,
        State,
        Status,
        StatusReply,
        Takeover,
        TakeoverState,
        TensorEntry,
        TensorGroup,
        TensorTable,
        Unkeep,
        decode_frame,
        tensor_extent,
    )

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
    "TakeoverState",
    "TensorEntry",
    "TensorGroup",
    "TensorTable",
    "Unkeep",
    "decode_body",
    "decode_frame",
    "pack_frame",
    "tensor_extent",
]

#: public name -> the module defining it (imported on first access)
_HOME: dict[str, str] = {
    **dict.fromkeys(("DEFAULT_MAX_FRAME_SIZE", "FrameBuffer", "decode_body", "pack_frame"), "wcache.proto.codec"),
    **dict.fromkeys(
        (
            "PROTOCOL_VERSION",
            "SUPPORTED_VERSIONS",
            "Connection",
            "DaemonRequest",
            "Event",
            "KeeperRequest",
            "Misdirected",
            "Phase",
            "Role",
            "Service",
        ),
        "wcache.proto.connection",
    ),
    **dict.fromkeys(
        (
            "BACKENDS",
            "DTYPE_SIZES",
            "CheckpointProof",
            "Commit",
            "Deposit",
            "Deposited",
            "DepositSlab",
            "DepositTensor",
            "DeviceInfo",
            "ErrorFrame",
            "Evict",
            "Evicted",
            "FileStat",
            "Frame",
            "GetState",
            "HandedModel",
            "Hello",
            "HelloOk",
            "Keep",
            "Kept",
            "LeaseInfo",
            "ModelInfo",
            "Preload",
            "Preloaded",
            "Reclaim",
            "Reclaimed",
            "Release",
            "Released",
            "SlabDescriptor",
            "State",
            "Status",
            "StatusReply",
            "Takeover",
            "TakeoverState",
            "TensorEntry",
            "TensorGroup",
            "TensorTable",
            "Unkeep",
            "decode_frame",
            "tensor_extent",
        ),
        "wcache.proto.frames",
    ),
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'wcache.proto' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later look-ups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
