"""Typed frames of protocol version 2 (docs/protocol.md §4) and their one decoder.

The frames live by use: ``daemon_frames`` (what a restarting engine speaks: the handshake, GET_STATE, STATE,
RELEASE, ERROR), ``admin_frames`` (STATUS, PRELOAD, EVICT), ``deposit_frames`` (write-back), ``peer_frames``
(takeover and keeper) and ``fleet_frames`` (the peer channel between daemons of a fleet, docs/protocol.md §10);
their fields are declared once (``fields.py``) and one generic codec encodes and decodes
them all; the tensor table is in ``table``. This module is the registry: :data:`Frame`, :data:`FRAME_TYPES` and
:func:`decode_frame`, tagged by the ``type`` field, and it re-exports every frame.

Only ``daemon_frames`` is imported with this module (an engine's restart needs nothing else: building the
other ~20 classes was a quarter of its ``import wcache``); the other modules (FRAME_MODULES) are all imported
the first time a frame of theirs arrives (:func:`decode_frame`), or one of their names, ``Frame`` or
``FRAME_TYPES`` is read here (PEP 562). A daemon, which decodes every request, has them all after its first
few frames or its imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from functools import reduce
from operator import or_
from typing import TYPE_CHECKING, Any

from wcache.errors import ProtocolError
from wcache.proto.codec import DEFAULT_MAX_FRAME_SIZE, decode_body, pack_frame
from wcache.proto.daemon_frames import (
    BACKENDS,
    MODES,
    SLAB_KINDS,
    CheckpointProof,
    DeviceInfo,
    ErrorFrame,
    FileStat,
    GetState,
    Hello,
    HelloOk,
    Release,
    Released,
    SlabDescriptor,
    State,
)
from wcache.proto.fields import MAX_NAME, MAX_PATH, REGISTRY, KeyMap, Message
from wcache.proto.table import DTYPE_SIZES, MAX_DIMS, TensorEntry, TensorGroup, TensorTable, tensor_extent

if TYPE_CHECKING:
    from wcache.proto.admin_frames import (
        Evict,
        Evicted,
        LeaseInfo,
        ModelInfo,
        Preload,
        Preloaded,
        Status,
        StatusReply,
    )
    from wcache.proto.deposit_frames import (
        TENSOR_KINDS,
        Commit,
        Deposit,
        Deposited,
        DepositSlab,
        DepositTensor,
    )
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

    Frame = (
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
    #: frame type -> class: every ``@message`` declared with a type (a test checks it equals ``Frame``'s members)
    FRAME_TYPES: dict[str, type[Message]]

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
    "CheckpointProof",
    "Commit",
    "Deposit",
    "DepositSlab",
    "DepositTensor",
    "Deposited",
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
    "load_frames",
    "tensor_extent",
]

#: The modules that declare frames, in the order they are loaded; a new frame module is added here.
FRAME_MODULES = (
    "wcache.proto.daemon_frames",
    "wcache.proto.admin_frames",
    "wcache.proto.deposit_frames",
    "wcache.proto.peer_frames",
    "wcache.proto.fleet_frames",
)
_loaded = False


def load_frames() -> dict[str, type[Message]]:
    """Import every frame module (FRAME_MODULES); returns the registry, frame type -> class."""
    global _loaded
    if not _loaded:
        for module in FRAME_MODULES:
            importlib.import_module(module)
        _loaded = True
    return REGISTRY


def decode_frame(m: Mapping[str, Any]) -> Frame:
    """Turn a decoded frame map into its typed frame, or raise ProtocolError."""
    t = m.get("type")
    if type(t) is not str:
        raise ProtocolError("frame has no string 'type' field")
    cls = REGISTRY.get(t) or load_frames().get(t)
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


def __getattr__(name: str) -> Any:
    if name == "FRAME_TYPES":
        return load_frames()
    if name == "Frame":  # the union of every frame class, as the annotation above spells it
        return reduce(or_, load_frames().values())
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    load_frames()  # a frame module's name: re-exported once every frame module is loaded
    from wcache.proto._lazy import export

    return export(globals(), name, FRAME_MODULES[1:])


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
