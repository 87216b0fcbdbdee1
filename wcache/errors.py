"""The one exception tree of wcache, and the error codes carried by ERROR frames.

Every error wcache raises on purpose derives from :class:`WCacheError`. Errors that
travel in ERROR frames carry an :class:`ErrorCode`; each code maps to exactly one
class (``ERROR_CLASSES``), so a client re-raises the daemon's error as the same type.

::

    WCacheError                         (code: INTERNAL unless a subclass says otherwise)
    ├── ProtocolError                   PROTOCOL_ERROR      bytes or frames that break docs/protocol.md
    │   ├── LocalProtocolError            -                 we tried to send something illegal (a bug here)
    │   ├── FrameTooLargeError          FRAME_TOO_LARGE     length prefix over the limit (size, max_size)
    │   ├── UnsupportedVersionError     UNSUPPORTED_VERSION no common protocol version (offered, supported)
    │   └── UnexpectedFrameError        UNEXPECTED_FRAME    a valid frame in the wrong connection state
    ├── CacheUnavailableError           UNAVAILABLE         no daemon: no socket, refused, timeout, died
    ├── ServerError                     (any daemon code)   the daemon refused or failed a request
    │   ├── PermissionDeniedError       PERMISSION_DENIED   peer uid is not the daemon's uid
    │   ├── NotReadyError               NOT_READY           the daemon holds no weights (yet)
    │   ├── KeyMismatchError            KEY_MISMATCH        fingerprint fields differ (fields)
    │   ├── UnknownLeaseError           UNKNOWN_LEASE       not a lease of this connection
    │   ├── LimitExceededError          LIMIT_EXCEEDED      too many leases / connections
    │   ├── DeviceMismatchError         DEVICE_MISMATCH     engine and daemon on different GPUs
    │   ├── UnsupportedPlatformError    UNSUPPORTED_PLATFORM the platform cannot share this memory
    │   ├── OutOfMemoryError            OUT_OF_MEMORY       a PRELOAD does not fit; details name what is pinned
    │   ├── InUseError                  IN_USE              EVICT of a model with live leases
    │   ├── NotFoundError               NOT_FOUND           no model under that key
    │   └── InternalError               INTERNAL            an unexpected failure inside the daemon
    ├── CheckpointError                 -                   a checkpoint directory or file is unusable
    ├── ShardingError                   -                   no plan, or a dimension that does not divide
    └── InsecurePathError               -                   socket directory/file fails the ownership check

Classes marked ``-`` are raised locally and never sent. The module imports nothing
beyond the standard library so that ``wcache.proto`` can stay pure.

**What an engine's fallback catches: ``WCacheError``.** Every failure on the cache path — no daemon
(``CacheUnavailableError``), a refusal (``ServerError``), a daemon whose frames the client rejects
(``ProtocolError``: it broke docs/protocol.md, so nothing it sent is used), a checkpoint whose key
cannot be computed (``CheckpointError``, ``ShardingError``) — leaves loading from disk as the right
next step; catching only ``CacheUnavailableError`` would turn a misbehaving daemon into a crashed
engine. ``wcache.nn.load_weights`` and ``wcache.integrations.transformers.from_pretrained`` catch
``WCacheError`` and log the reason (README, "Use it").
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = [
    "ERROR_CLASSES",
    "CacheUnavailableError",
    "CheckpointError",
    "DeviceMismatchError",
    "ErrorCode",
    "FrameTooLargeError",
    "InsecurePathError",
    "InUseError",
    "InternalError",
    "KeyMismatchError",
    "LimitExceededError",
    "LocalProtocolError",
    "NotReadyError",
    "OutOfMemoryError",
    "NotFoundError",
    "PermissionDeniedError",
    "ProtocolError",
    "ServerError",
    "ShardingError",
    "UnexpectedFrameError",
    "UnknownLeaseError",
    "UnsupportedPlatformError",
    "UnsupportedVersionError",
    "WCacheError",
    "error_from_frame",
]


class ErrorCode(enum.IntEnum):
    """Codes of ERROR frames (docs/protocol.md §6). Values are part of the wire format."""

    PROTOCOL_ERROR = 1
    FRAME_TOO_LARGE = 2
    UNSUPPORTED_VERSION = 3
    UNEXPECTED_FRAME = 4
    PERMISSION_DENIED = 10
    NOT_READY = 20
    KEY_MISMATCH = 21
    UNKNOWN_LEASE = 22
    LIMIT_EXCEEDED = 23
    DEVICE_MISMATCH = 24
    UNSUPPORTED_PLATFORM = 25
    OUT_OF_MEMORY = 26
    IN_USE = 27
    NOT_FOUND = 28
    UNAVAILABLE = 30
    INTERNAL = 99


class WCacheError(Exception):
    """Root of every error wcache raises on purpose.

    ``details`` is a JSON/msgpack-friendly map with structured facts (e.g. the
    mismatched key fields); it travels in ERROR frames unchanged.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = dict(details or {})


class ProtocolError(WCacheError):
    """Input that breaks the wire contract: bad framing, bad msgpack, bad field types.

    Raised by a client for a daemon's frames too; engines fall back to disk on it (``except WCacheError``)."""

    code = ErrorCode.PROTOCOL_ERROR


class LocalProtocolError(ProtocolError):
    """We tried to send a frame the protocol does not allow in this state (a bug in the caller)."""


class FrameTooLargeError(ProtocolError):
    """A length prefix above the configured maximum; raised before the body is buffered."""

    code = ErrorCode.FRAME_TOO_LARGE

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


class UnsupportedVersionError(ProtocolError):
    """The peers share no protocol version."""

    code = ErrorCode.UNSUPPORTED_VERSION


class UnexpectedFrameError(ProtocolError):
    """A well-formed frame that is not allowed in the connection's current state."""

    code = ErrorCode.UNEXPECTED_FRAME


class CacheUnavailableError(WCacheError):
    """No usable daemon: socket missing, connection refused, timeout, or the daemon died.

    Engines treat this as "load from disk instead" — as every other WCacheError (module docstring).
    """

    code = ErrorCode.UNAVAILABLE


class ServerError(WCacheError):
    """The daemon answered a request with an ERROR frame."""


class PermissionDeniedError(ServerError):
    code = ErrorCode.PERMISSION_DENIED


class NotReadyError(ServerError):
    code = ErrorCode.NOT_READY


class KeyMismatchError(ServerError):
    """The requested key differs from the served one; ``fields`` names each differing field.

    ``fields`` maps field name to ``[served, requested]``.
    """

    code = ErrorCode.KEY_MISMATCH

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, details=details)
        raw = self.details.get("fields", {})
        self.fields: dict[str, Any] = dict(raw) if isinstance(raw, dict) else {}


class UnknownLeaseError(ServerError):
    code = ErrorCode.UNKNOWN_LEASE


class LimitExceededError(ServerError):
    code = ErrorCode.LIMIT_EXCEEDED


class DeviceMismatchError(ServerError):
    code = ErrorCode.DEVICE_MISMATCH


class UnsupportedPlatformError(ServerError):
    """This platform cannot share the daemon's memory; use the host backend or load from disk."""

    code = ErrorCode.UNSUPPORTED_PLATFORM


class OutOfMemoryError(ServerError):
    """A PRELOAD does not fit the memory budget even after evicting every unleased model;
    ``details["pinned"]`` lists the keys held by leases."""

    code = ErrorCode.OUT_OF_MEMORY


class InUseError(ServerError):
    """EVICT of a model that live leases still hold."""

    code = ErrorCode.IN_USE


class NotFoundError(ServerError):
    """The daemon holds no model under that key (EVICT), or none at all (GET_STATE)."""

    code = ErrorCode.NOT_FOUND


class InternalError(ServerError):
    code = ErrorCode.INTERNAL


class CheckpointError(WCacheError):
    """A checkpoint directory or file is missing, truncated, inconsistent, not a regular file, over a
    metadata size cap, or holds tensors the protocol cannot carry (names over 1024 characters, rank
    over 16, dimensions of 2**48 or more); the message names the file, the tensor and the limit."""


class ShardingError(WCacheError):
    """Tensor parallel sharding is impossible: no plan, or a dimension not divisible by tp_size."""


class InsecurePathError(WCacheError):
    """A socket directory or file that another user could tamper with."""


#: ERROR frame code -> the exception class a client raises for it (1:1).
ERROR_CLASSES: dict[ErrorCode, type[WCacheError]] = {
    ErrorCode.PROTOCOL_ERROR: ProtocolError,
    ErrorCode.FRAME_TOO_LARGE: FrameTooLargeError,
    ErrorCode.UNSUPPORTED_VERSION: UnsupportedVersionError,
    ErrorCode.UNEXPECTED_FRAME: UnexpectedFrameError,
    ErrorCode.PERMISSION_DENIED: PermissionDeniedError,
    ErrorCode.NOT_READY: NotReadyError,
    ErrorCode.KEY_MISMATCH: KeyMismatchError,
    ErrorCode.UNKNOWN_LEASE: UnknownLeaseError,
    ErrorCode.LIMIT_EXCEEDED: LimitExceededError,
    ErrorCode.DEVICE_MISMATCH: DeviceMismatchError,
    ErrorCode.UNSUPPORTED_PLATFORM: UnsupportedPlatformError,
    ErrorCode.OUT_OF_MEMORY: OutOfMemoryError,
    ErrorCode.IN_USE: InUseError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.UNAVAILABLE: CacheUnavailableError,
    ErrorCode.INTERNAL: InternalError,
}


def error_from_frame(code: int, message: str, details: dict[str, Any]) -> WCacheError:
    """Build the exception for a received ERROR frame; an unknown code becomes ``ServerError``."""
    try:
        ecode = ErrorCode(code)
    except ValueError:
        return ServerError(f"[code {code}] {message}", details=details)
    return ERROR_CLASSES[ecode](message, details=details)
