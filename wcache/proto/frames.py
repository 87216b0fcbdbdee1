"""Typed frames of protocol version 2 (docs/protocol.md §4) and their one decoder.

The frames live by use: ``daemon_frames`` (what a restarting engine speaks: the handshake, GET_STATE, STATE,
RELEASE, ERROR), ``admin_frames`` (STATUS, PRELOAD, EVICT), ``deposit_frames`` (write-back), ``peer_frames``
(takeover and keeper) and ``fleet_frames`` (the peer channel between daemons of a fleet, docs/protocol.md §10);
each frame is declared once (``fields.py``: its fields, and its place in the protocol that ``connection``
derives its tables from), and one generic codec encodes and decodes them all; the tensor table is in
``table``. This module is the registry: :data:`FRAME_TYPES` (every :class:`Frame` class, by its ``type``)
and :func:`decode_frame`, and it re-exports the names of every frame module (their ``__all__``).

Only ``daemon_frames`` is imported with this module (an engine's restart needs nothing else: building the
other ~20 classes was a quarter of its ``import wcache``); the other modules (FRAME_MODULES) are all imported
the first time a frame of theirs arrives (:func:`decode_frame`) or ``FRAME_TYPES`` is read, and each when one
of its names is read here (PEP 562). A daemon, which decodes every request, has them all after its first few
frames or its imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wcache.errors import LocalProtocolError, RemoteProtocolError
from wcache.proto.codec import DEFAULT_MAX_FRAME_SIZE, decode_body, pack_frame
from wcache.proto.fields import MAX_NAME, MAX_PATH, REGISTRY, Frame, KeyMap
from wcache.proto.table import DTYPE_SIZES, MAX_DIMS, TensorEntry, TensorGroup, TensorTable, tensor_extent

if TYPE_CHECKING:  # every frame module's names, for the type checker; at run time read through __getattr__
    from wcache.proto.admin_frames import *  # noqa: F403
    from wcache.proto.daemon_frames import *  # noqa: F403
    from wcache.proto.deposit_frames import *  # noqa: F403
    from wcache.proto.fleet_frames import *  # noqa: F403
    from wcache.proto.peer_frames import *  # noqa: F403

    #: frame type -> class: every ``@message`` declared with a type
    FRAME_TYPES: dict[str, type[Frame]]

#: this module's own names; every frame module's (FRAME_MODULES, their ``__all__``) are re-exported too
__all__ = [
    "DTYPE_SIZES",
    "FRAME_MODULES",
    "FRAME_TYPES",
    "MAX_DIMS",
    "MAX_NAME",
    "MAX_PATH",
    "Frame",
    "KeyMap",
    "TensorEntry",
    "TensorGroup",
    "TensorTable",
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


def load_frames() -> dict[str, type[Frame]]:
    """Import every frame module (FRAME_MODULES); returns the registry, frame type -> class."""
    global _loaded
    if not _loaded:
        for module in FRAME_MODULES:
            importlib.import_module(module)
        _loaded = True
    return REGISTRY


def decode_frame(m: Mapping[str, Any]) -> Frame:
    """Turn a decoded frame map into its typed frame, or raise RemoteProtocolError."""
    t = m.get("type")
    if type(t) is not str:
        raise RemoteProtocolError("frame has no string 'type' field")
    cls = REGISTRY.get(t) or load_frames().get(t)
    if cls is None:
        raise RemoteProtocolError(f"unknown frame type {t[:64]!r}", details={"type": t[:64]})
    return cls.from_wire(m)


def as_received(frame: Frame, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> Frame:
    """``frame`` as its receiver gets it: encoded, checked against the receiver's ``max_frame_size`` and
    decoded by the one decoder every receiver runs. A sender that builds a frame from a peer's input (the
    daemon laying out a DEPOSIT's STATE, a daemon handing over its models) checks it here before it commits
    to anything, so that what it accepts is never refused by its receivers: no second set of rules to drift
    apart from the decoder's. Raises what a receiver's decoder would: FrameTooLargeError past the size, else
    RemoteProtocolError naming the field it refuses; LocalProtocolError for an integer too large for its wire
    column (no receiver gets it at all). Callers turn these into the error of the input they came from."""
    try:
        data = pack_frame(frame.to_wire(), max_frame_size)
    except OverflowError as exc:  # an integer no wire column holds (the tensor table's uint64 arrays)
        raise LocalProtocolError(
            f"{frame.TYPE}: an integer does not fit its wire field ({exc})", details={"frame": frame.TYPE}
        ) from None
    return decode_frame(decode_body(data[4:]))


def __getattr__(name: str) -> Any:
    """``FRAME_TYPES``, and the names of the frame modules (each imported when one of its names is first read;
    ``__path__``, which from-imports look for, imports none)."""
    if name == "FRAME_TYPES":
        return load_frames()
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from wcache.proto._lazy import export

    return export(globals(), name, FRAME_MODULES)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
