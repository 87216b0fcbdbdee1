"""The one exception tree of wcache, and the error codes carried by ERROR frames.

Every error wcache raises on purpose derives from :class:`WCacheError`. Errors that
travel in ERROR frames carry an :class:`ErrorCode`; each code is declared by exactly one
class (``code=`` in its class statement, from which ``ERROR_CLASSES`` is derived), so a client re-raises the
daemon's error as the same type.

::

    WCacheError                         (code: INTERNAL unless a subclass says otherwise)
    ├── ProtocolError                   PROTOCOL_ERROR      a break of docs/protocol.md; one of the two below
    │   ├── LocalProtocolError            -                 we tried to send something illegal (a bug here)
    │   └── RemoteProtocolError         PROTOCOL_ERROR      the peer's bytes or frames break docs/protocol.md
    │       ├── FrameTooLargeError      FRAME_TOO_LARGE     length prefix over the limit (size, max_size)
    │       ├── UnsupportedVersionError UNSUPPORTED_VERSION no common protocol version (offered, supported)
    │       └── UnexpectedFrameError    UNEXPECTED_FRAME    a valid frame in the wrong connection state
    ├── CacheUnavailableError           UNAVAILABLE         no daemon: no socket, refused, timeout, died; or a slab
    │                                                       this process cannot map (its address space, its driver)
    ├── ServerError                     (any daemon code)   the daemon refused or failed a request
    │   ├── PermissionDeniedError       PERMISSION_DENIED   peer uid is not the daemon's uid
    │   ├── NotReadyError               NOT_READY           the daemon holds no weights (yet)
    │   ├── KeyMismatchError            KEY_MISMATCH        fingerprint fields differ (fields)
    │   ├── UnknownLeaseError           UNKNOWN_LEASE       not a lease of this connection
    │   ├── LimitExceededError          LIMIT_EXCEEDED      too many leases / connections
    │   ├── DeviceMismatchError         DEVICE_MISMATCH     engine and daemon on different GPUs
    │   ├── UnsupportedPlatformError    UNSUPPORTED_PLATFORM the platform cannot share this memory
    │   ├── OutOfMemoryError            OUT_OF_MEMORY       a PRELOAD does not fit; details name what is pinned
    │   ├── InUseError                  IN_USE              EVICT of a model with live leases; a second TAKEOVER
    │   ├── NotFoundError               NOT_FOUND           no model under that key
    │   ├── KeyUnprovenError            KEY_UNPROVEN        a GET_STATE's files proof the daemon cannot use
    │   └── InternalError               INTERNAL            an unexpected failure inside the daemon
    ├── CheckpointError                 INVALID_CHECKPOINT  a checkpoint directory or file is unusable
    ├── ShardingError                   INVALID_PLAN        no plan, a bad plan file, a dimension that does not divide
    ├── TransformError                  INVALID_TRANSFORM   a --transform that cannot be imported, or a bad result
    ├── IncompatibleModelError            -                 cached tensors that do not fit the engine's module
    ├── TierEntryError                    -                 a host tier entry that no longer matches (dropped)
    ├── InsecurePathError                 -                 socket directory/file fails the ownership check
    ├── FillError                         -                 a fill from peers failed (reason); the daemon loads from disk
    └── DaemonRunningError                -                 another daemon holds this socket's one-daemon lock

Classes marked ``-`` are raised locally and never sent. **Whose fault** (h11's model): a
``RemoteProtocolError`` is the peer's, so the daemon answers it with a fatal ERROR of its code and
closes; a ``LocalProtocolError`` is ours — the daemon logs it as a bug and, if it can, tells the peer
``INTERNAL`` (its ``code``), never ``PROTOCOL_ERROR``. ``CheckpointError``, ``ShardingError`` and
``TransformError`` are the requester's: raised locally (the engine computing a key) or sent (a PRELOAD
of a bad directory, plan or transform), and a client re-raises them as the same class. The module
imports nothing beyond the standard library so that ``wcache.proto`` can stay pure.

**What an engine's fallback catches: ``WCacheError``.** Every failure on the cache path — no daemon
(``CacheUnavailableError``), a refusal (``ServerError``), a daemon whose frames the client rejects
(``ProtocolError``: it broke docs/protocol.md, so nothing it sent is used), a checkpoint whose key
cannot be computed (``CheckpointError``, ``ShardingError``) — leaves loading from disk as the right
next step; catching only ``CacheUnavailableError`` would turn a misbehaving daemon into a crashed
engine. ``wcache.nn.load_weights`` and ``wcache.integrations.transformers.from_pretrained`` catch
``WCacheError`` and log the reason (README, "Use it").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wcache.error_codes import ErrorCode

__all__ = [
    "ERROR_CLASSES",
    "CacheUnavailableError",
    "CheckpointError",
    "DaemonRunningError",
    "DeviceMismatchError",
    "ErrorCode",
    "FillError",
    "FrameTooLargeError",
    "InsecurePathError",
    "InUseError",
    "IncompatibleModelError",
    "InternalError",
    "KeyMismatchError",
    "KeyUnprovenError",
    "LimitExceededError",
    "LocalProtocolError",
    "NotReadyError",
    "OutOfMemoryError",
    "NotFoundError",
    "PermissionDeniedError",
    "ProtocolError",
    "RemoteProtocolError",
    "ServerError",
    "ShardingError",
    "TierEntryError",
    "TransformError",
    "UnexpectedFrameError",
    "UnknownLeaseError",
    "UnsupportedPlatformError",
    "UnsupportedVersionError",
    "WCacheError",
    "describe_fields",
    "error_from_frame",
]


class _Code:
    """An error class's ``code``: the ErrorCode member named, looked up when first read (``wcache.error_codes``
    is imported then: an engine's fetch that raises nothing never builds the IntEnum)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, cls: type[Any] | None = None) -> ErrorCode:
        from wcache.error_codes import ErrorCode

        return ErrorCode[self.name]


#: ErrorCode name -> the class a received ERROR of that code is raised as (each class's ``code=``, in
#: ``WCacheError.__init_subclass__``)
_RAISED_AS: dict[str, type[WCacheError]] = {}


class WCacheError(Exception):
    """Root of every error wcache raises on purpose.

    ``details`` is a JSON/msgpack-friendly map with structured facts (e.g. the
    mismatched key fields); it travels in ERROR frames unchanged.

    A subclass declares its code in its class statement: ``code="NOT_FOUND"`` makes it the class an ERROR of
    that code is raised as (``ERROR_CLASSES``, one class per code); ``sent_as="INTERNAL"`` gives it a code
    without that (``LocalProtocolError``: a received INTERNAL is the daemon's ``InternalError``). A subclass
    that declares neither has its base's code.
    """

    code = _Code("INTERNAL")

    def __init_subclass__(cls, *, code: str = "", sent_as: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code and sent_as:
            raise TypeError(f"{cls.__qualname__}: declare code= or sent_as=, not both")
        if code or sent_as:
            type.__setattr__(cls, "code", _Code(code or sent_as))
        if code:
            holder = _RAISED_AS.setdefault(code, cls)
            if holder is not cls:
                raise TypeError(f"{cls.__qualname__}: code {code} is {holder.__qualname__}'s (one class per code)")

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = dict(details or {})


class ProtocolError(WCacheError, code="PROTOCOL_ERROR"):
    """A break of the wire contract: catch this for either side's. Raise one of its two subclasses —
    ``RemoteProtocolError`` (the peer's input) or ``LocalProtocolError`` (our own frame) — so the handler
    knows whose fault it is. A received ERROR frame with code ``PROTOCOL_ERROR`` (the peer's verdict on
    our frames) is raised as this class; engines fall back to disk on it (``except WCacheError``)."""


class LocalProtocolError(ProtocolError, sent_as="INTERNAL"):
    """We tried to send a frame the protocol does not allow in this state (a bug in the caller).

    Never sent as ``PROTOCOL_ERROR``: the peer did nothing wrong. Its ``code`` is ``INTERNAL``, so even a
    handler that converts it to an ERROR frame tells the peer the truth."""


class RemoteProtocolError(ProtocolError):
    """The peer's bytes or frames break docs/protocol.md: bad framing, bad msgpack, bad field types,
    a frame in the wrong state. Answered with a fatal ERROR of its code, then the connection closes."""


class FrameTooLargeError(RemoteProtocolError, code="FRAME_TOO_LARGE"):
    """A length prefix above the configured maximum; raised before the body is buffered."""

    @classmethod
    def for_size(cls, size: int, max_size: int) -> FrameTooLargeError:
        return cls(
            f"frame of {size} bytes exceeds the limit of {max_size} bytes",
            details={"size": size, "max_size": max_size},
        )

    @property
    def size(self) -> int:
        return int(self.details.get("size", -1))

    @property
    def max_size(self) -> int:
        return int(self.details.get("max_size", -1))


class UnsupportedVersionError(RemoteProtocolError, code="UNSUPPORTED_VERSION"):
    """The peers share no protocol version."""


class UnexpectedFrameError(RemoteProtocolError, code="UNEXPECTED_FRAME"):
    """A well-formed frame that is not allowed in the connection's current state."""


class CacheUnavailableError(WCacheError, code="UNAVAILABLE"):
    """No usable daemon: socket missing, connection refused, timeout, or the daemon died; or a slab of its STATE
    that this process cannot map though it passed the protocol's checks — ``mmap`` out of address space, the CUDA
    driver refusing the import (``details``: ``slab``, ``kind``, ``size``; the cause chained). The daemon's memory
    is then as unusable to the engine as if none ran (wcache/client/mapping.py, ``_unmappable``).

    Engines treat this as "load from disk instead" — as every other WCacheError (module docstring).
    """


class ServerError(WCacheError):
    """The daemon answered a request with an ERROR frame."""


class PermissionDeniedError(ServerError, code="PERMISSION_DENIED"):
    """The peer may not use this socket: its uid is not the daemon's, or (peer channel) its proof of the secret fails."""


class NotReadyError(ServerError, code="NOT_READY"):
    """The daemon holds no weights yet."""


def _show(value: Any) -> str:
    if value is None:
        return "nothing"  # the field is not in the request, or the daemon does not know it
    if isinstance(value, str):
        return repr(value) if not value else value if len(value) <= 24 else value[:12] + "…"
    return str(value)


def describe_fields(fields: Mapping[str, Any]) -> str:
    """KEY_MISMATCH's ``fields`` (name -> ``[served, requested]``, docs/protocol.md §4.3) in words, each value
    labelled: ``tp_size: requested 1, served 2; dtype: requested float16, served bfloat16``."""
    parts = []
    for name, pair in fields.items():
        served, requested = pair if isinstance(pair, list | tuple) and len(pair) == 2 else (pair, None)
        if None not in (served, requested) and type(served) is not type(requested):
            # the same text, another type ("0" for 0, True for 1): quoted and named, or the two would read alike
            show = f"{requested!r} ({type(requested).__name__}), served {served!r} ({type(served).__name__})"
            parts.append(f"{name}: requested {show}")
        else:
            parts.append(f"{name}: requested {_show(requested)}, served {_show(served)}")
    return "; ".join(parts)


class _KeyDiff:
    """``fields`` (name -> ``[served, requested]``) of a KEY_MISMATCH or NOT_FOUND, and the two sides by name."""

    details: dict[str, Any]

    @property
    def fields(self) -> dict[str, Any]:
        raw = self.details.get("fields", {})
        return dict(raw) if isinstance(raw, dict) else {}

    @property
    def requested_values(self) -> dict[str, Any]:
        """What the request named, for each field that differs (None: not named)."""
        return {k: v[1] for k, v in self.fields.items() if isinstance(v, list | tuple) and len(v) == 2}

    @property
    def served_values(self) -> dict[str, Any]:
        """What the compared served model has, for each field that differs (None: no such field)."""
        return {k: v[0] for k, v in self.fields.items() if isinstance(v, list | tuple) and len(v) == 2}


class KeyMismatchError(_KeyDiff, ServerError, code="KEY_MISMATCH"):
    """The requested key differs from every served one; ``fields`` names each differing field against the
    closest served model (``details["closest"]``), as ``[served, requested]`` — ``requested_values`` and
    ``served_values`` give the two sides by name, and the message labels them."""


class UnknownLeaseError(ServerError, code="UNKNOWN_LEASE"):
    """Not a lease (or deposit) of this connection."""


class LimitExceededError(ServerError, code="LIMIT_EXCEEDED"):
    """Over a limit: leases or deposits of a connection, models, connections, slabs of a hand-off or a keeper."""


class DeviceMismatchError(ServerError, code="DEVICE_MISMATCH"):
    """The engine and the daemon are on different GPUs (or backends)."""


class UnsupportedPlatformError(ServerError, code="UNSUPPORTED_PLATFORM"):
    """This platform cannot share the daemon's memory; use the host backend or load from disk."""


class OutOfMemoryError(ServerError, code="OUT_OF_MEMORY"):
    """A PRELOAD does not fit the memory budget even after evicting every unleased model;
    ``details["pinned"]`` lists the keys held by leases."""


class InUseError(ServerError, code="IN_USE"):
    """EVICT of a model that live leases still hold; TAKEOVER of a daemon already handing over."""


class NotFoundError(_KeyDiff, ServerError, code="NOT_FOUND"):
    """The daemon holds no model under that key (EVICT), or none at all (GET_STATE). An EVICT's names the
    fields that differ from the closest served model, as KeyMismatchError does (empty when none is served)."""


class KeyUnprovenError(ServerError, code="KEY_UNPROVEN"):
    """A GET_STATE's proof (docs/protocol.md §4.3.1) names files this daemon did not read as they are, or cannot
    complete the key (``details.proof`` says why): not a refusal of the key, which the client then computes from
    the headers and asks for on the same connection (the reference client does it itself)."""


class InternalError(ServerError, code="INTERNAL"):
    """An unexpected failure inside the daemon (a bug there, its own protocol violations included)."""


class CheckpointError(WCacheError, code="INVALID_CHECKPOINT"):
    """A checkpoint directory or file is missing, truncated, inconsistent, not a regular file, over a
    metadata size cap, or holds tensors the protocol cannot carry (names over 1024 characters, rank
    over 16, dimensions of 2**48 or more); the message names the file, the tensor and the limit.

    Sent as ``INVALID_CHECKPOINT`` when a PRELOAD names such a directory."""


class ShardingError(WCacheError, code="INVALID_PLAN"):
    """Tensor parallel sharding is impossible: no plan, a bad plan file, or a dimension not divisible by
    tp_size. Sent as ``INVALID_PLAN``."""


class TransformError(WCacheError, code="INVALID_TRANSFORM"):
    """A load-time transform (``--transform module:function``) that cannot be imported or called, or
    whose result is not a dict of str -> torch.Tensor of a protocol dtype. Sent as ``INVALID_TRANSFORM``."""


class IncompatibleModelError(WCacheError):
    """The cached tensors do not fit the engine's module or configuration: parameters missing or extra,
    shapes that differ, or a quantization / parallel layout the cache does not serve. Raised in the
    engine (``wcache.nn.attach``, ``wcache.integrations``); the message lists the names."""


class TierEntryError(WCacheError):
    """A host tier entry whose metadata, key, size or digest no longer matches: it is removed and the
    model loaded from disk (never sent)."""


class InsecurePathError(WCacheError):
    """A socket directory or file that another user could tamper with."""


class FillError(WCacheError):
    """A fill from peer daemons could not finish (docs/fleet.md): no peer, a refusal, a transfer error or
    deadline, bytes that fail verification, or NIXL missing (``details["reason"]`` names which). The target
    frees the half-filled slab and loads from disk; never sent."""


class DaemonRunningError(WCacheError):
    """Another daemon holds the one-daemon lock of this socket (``details["holder_pid"]``): stop it, or
    choose another socket path. Not a security failure (that is ``InsecurePathError``)."""


if TYPE_CHECKING:
    #: ERROR frame code -> the exception class a client raises for it (1:1), from each class's ``code=``
    ERROR_CLASSES: dict[ErrorCode, type[WCacheError]]


def __getattr__(name: str) -> Any:
    """``ErrorCode`` (wcache.error_codes) and ``ERROR_CLASSES`` (ERROR frame code -> the exception class a client
    raises for it, 1:1), made when first read."""
    if name == "ErrorCode":
        from wcache.error_codes import ErrorCode

        return ErrorCode
    if name == "ERROR_CLASSES":
        from wcache.error_codes import ErrorCode

        return {ErrorCode[code]: cls for code, cls in _RAISED_AS.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def error_from_frame(code: int, message: str, details: dict[str, Any]) -> WCacheError:
    """Build the exception for a received ERROR frame; an unknown code becomes ``ServerError``."""
    from wcache.error_codes import ErrorCode

    try:
        ecode = ErrorCode(code)
    except ValueError:
        return ServerError(f"[code {code}] {message}", details=details)
    return _RAISED_AS.get(ecode.name, ServerError)(message, details=details)
