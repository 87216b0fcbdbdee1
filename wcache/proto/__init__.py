"""The wcache wire protocol, pure: no asyncio, sockets or torch (docs/protocol.md).

Layers, each importing only those above it (docs/architecture.md): ``codec`` (length prefix +
msgpack), ``fields`` (field kinds and the one generic encoder/decoder), ``table`` (the columnar
tensor table), ``daemon_frames``, ``peer_frames`` and ``fleet_frames`` (the frames by service), ``frames`` (the
registry and ``decode_frame``), ``connection`` (the per-connection state machine: which service,
which phase, which descriptors). Bytes in, typed frames out.
"""

from typing import TYPE_CHECKING, Any

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
    Commit,
    Deposit,
    Deposited,
    DepositSlab,
    DepositTensor,
    DeviceInfo,
    ErrorFrame,
    Evict,
    Evicted,
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
    TakeoverAdopted,
    TakeoverDone,
    TakeoverState,
    TensorEntry,
    TensorGroup,
    TensorTable,
    Unkeep,
    as_received,
    decode_frame,
    tensor_extent,
)

if TYPE_CHECKING:  # imported on first use (``__getattr__``): an engine's restart never needs them
    from wcache.proto.fleet_frames import (
        PeerAuth,
        PeerAuthOk,
        PeerBlock,
        PeerChallenge,
        PeerFile,
        PeerFiles,
        PeerFilesReply,
        PeerModel,
        PeerOffer,
        PeerProof,
        PeerQuery,
        PeerRead,
        PeerReadOk,
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
    "Commit",
    "Deposit",
    "DepositSlab",
    "DepositTensor",
    "Deposited",
    "Evict",
    "Evicted",
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


def __getattr__(name: str) -> Any:
    """The peer channel's frames (wcache/proto/fleet_frames.py), imported on first use (PEP 562)."""
    if name in _FLEET:
        from wcache.proto import fleet_frames

        return getattr(fleet_frames, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_FLEET = frozenset(
    [
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
    ]
)
