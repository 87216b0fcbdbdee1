"""The codes of ERROR frames (docs/protocol.md §6), re-exported by ``wcache.errors``.

Apart from the exception tree so that an engine's import does not build the IntEnum (a quarter of
``wcache.errors``' import): the error classes name their code, and this module is imported the first
time one is read — a daemon's start, or an error an engine raises or receives.
"""

from __future__ import annotations

import enum

__all__ = ["ErrorCode"]


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
    KEY_UNPROVEN = 29
    UNAVAILABLE = 30
    INVALID_CHECKPOINT = 40
    INVALID_PLAN = 41
    INVALID_TRANSFORM = 42
    INTERNAL = 99
