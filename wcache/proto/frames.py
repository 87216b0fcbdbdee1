"""Typed frames of protocol version 2 (docs/protocol.md §4) and their one decoder.

The frames live by service: ``daemon_frames`` (the daemon's, plus the handshake, STATUS and ERROR
every service speaks), ``peer_frames`` (takeover and keeper) and ``fleet_frames`` (the peer channel
between daemons of a fleet, docs/protocol.md §10); their fields are declared once
(``fields.py``) and one generic codec encodes and decodes them all; the tensor table is in
``table``. This module is the registry: :data:`Frame`, :data:`FRAME_TYPES` and
:func:`decode_frame`, tagged by the ``type`` field, and it re-exports every frame.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wcache.errors import ProtocolError
from wcache.proto.codec import DEFAULT_MAX_FRAME_SIZE, decode_body, pack_frame
from wcache.proto.daemon_frames import (
    BACKENDS,
    MODES,
    SLAB_KINDS,
    TENSOR_KINDS,
    Commit,
    Deposit,
    Deposited,
    DepositSlab,
    DepositTensor,
    DeviceInfo,
    ErrorFrame,
    Evict,
    Evicted,
    GetState,
    Hello,
    HelloOk,
    LeaseInfo,
    ModelInfo,
    Preload,
    Preloaded,
    Release,
    Released,
    SlabDescriptor,
    State,
    Status,
    StatusReply,
)
from wcache.proto.fields import MAX_NAME, MAX_PATH, REGISTRY, KeyMap, Message
from wcache.proto.peer_frames import (
    MAX_HANDOFF_FDS,
    MAX_KEPT_FDS,
    HandedModel,
    Keep,
    Kept,
    Reclaim,
    Reclaimed,
    Takeover,
    TakeoverAdopted,
    TakeoverDone,
    TakeoverState,
    Unkeep,
)
from wcache.proto.table import DTYPE_SIZES, MAX_DIMS, TensorEntry, TensorGroup, TensorTable, tensor_extent

__all__ = [
    "BACKENDS",
    "DTYPE_SIZES",
    "FRAME_TYPES",
    "MAX_DIMS",
    "MAX_HANDOFF_FDS",
    "MAX_KEPT_FDS",
    "MAX_NAME",
    "MAX_PATH",
    "MEMORY_KINDS",
    "MODES",
    "SLAB_KINDS",
    "TENSOR_KINDS",
    "Commit",
    "Deposit",
    "DepositSlab",
    "DepositTensor",
    "Deposited",
    "DeviceInfo",
    "ErrorFrame",
    "Evict",
    "Evicted",
    "Frame",
    "GetState",
    "HandedModel",
    "Hello",
    "HelloOk",
    "Keep",
    "KeyMap",
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
    "TakeoverAdopted",
    "TakeoverDone",
    "TakeoverState",
    "TensorEntry",
    "TensorGroup",
    "TensorTable",
    "Unkeep",
    "as_received",
    "decode_frame",
    "tensor_extent",
]

#: the frames of the daemon's and the keeper's services (an engine's restart imports only these)
LocalFrame = (
    Hello
    | HelloOk
    | GetState
    | State
    | Release
    | Released
    | Status
    | StatusReply
    | ErrorFrame
    | Preload
    | Preloaded
    | Evict
    | Evicted
    | Takeover
    | TakeoverState
    | TakeoverAdopted
    | TakeoverDone
    | Keep
    | Unkeep
    | Kept
    | Reclaim
    | Reclaimed
    | Deposit
    | DepositSlab
    | Commit
    | Deposited
)
if TYPE_CHECKING:  # the peer channel's frames are imported where a peer channel is used (not on an engine's path)
    from wcache.proto.fleet_frames import (
        MEMORY_KINDS,
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

    Frame = (
        LocalFrame
        | PeerAuth
        | PeerChallenge
        | PeerProof
        | PeerAuthOk
        | PeerQuery
        | PeerOffer
        | PeerRead
        | PeerReadOk
        | PeerFiles
        | PeerFilesReply
    )
else:
    Frame = LocalFrame

#: the frame types of the peer channel (docs/protocol.md §10): wcache.proto.fleet_frames registers them when it
#: is imported — by a daemon's peer channel, or by ``decode_frame`` meeting one — so an engine's restart, which
#: never speaks them, does not pay for their classes (~2.4 ms of imports)
FLEET_FRAME_TYPES = frozenset(
    {
        "PEER_AUTH",
        "PEER_CHALLENGE",
        "PEER_PROOF",
        "PEER_AUTH_OK",
        "PEER_QUERY",
        "PEER_OFFER",
        "PEER_READ",
        "PEER_READ_OK",
        "PEER_FILES",
        "PEER_FILES_REPLY",
    }
)
#: frame type -> class: every ``@message`` declared with a type (a test checks it equals ``Frame``'s members, with
#: the peer channel's once imported)
FRAME_TYPES: dict[str, type[Message]] = REGISTRY


def decode_frame(m: Mapping[str, Any]) -> Frame:
    """Turn a decoded frame map into its typed frame, or raise ProtocolError."""
    t = m.get("type")
    if type(t) is not str:
        raise ProtocolError("frame has no string 'type' field")
    cls = FRAME_TYPES.get(t)
    if cls is None and t in FLEET_FRAME_TYPES:
        import wcache.proto.fleet_frames  # registers them  # noqa: F401

        cls = FRAME_TYPES.get(t)
    if cls is None:
        raise ProtocolError(f"unknown frame type {t[:64]!r}", details={"type": t[:64]})
    frame: Frame = cls.from_wire(m)  # type: ignore[assignment]  # REGISTRY holds exactly Frame's members
    return frame


def as_received(frame: Frame, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> Frame:
    """``frame`` as its receiver gets it: encoded, checked against the receiver's ``max_frame_size`` and
    decoded by the one decoder every receiver runs. A sender that builds a frame from a peer's input (the
    daemon laying out a DEPOSIT's STATE, a daemon handing over its models) checks it here before it commits
    to anything, so that what it accepts is never refused by its receivers: no second set of rules to drift
    apart from the decoder's. Raises FrameTooLargeError past the size, else ProtocolError naming the
    field a receiver refuses (an integer too large for its wire column included)."""
    try:
        data = pack_frame(frame.to_wire(), max_frame_size)
    except OverflowError as exc:  # an integer no wire column holds (the tensor table's uint64 arrays)
        raise ProtocolError(
            f"{frame.TYPE}: an integer does not fit its wire field ({exc})", details={"frame": frame.TYPE}
        ) from None
    return decode_frame(decode_body(data[4:]))


#: names this module (and the package) re-export from fleet_frames on first use
FLEET_NAMES = frozenset(
    {
        "MEMORY_KINDS",
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
    }
)


def __getattr__(name: str) -> Any:
    """The peer channel's frames, imported on first use (PEP 562)."""
    if name in FLEET_NAMES:
        from wcache.proto import fleet_frames

        return getattr(fleet_frames, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
