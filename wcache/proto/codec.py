"""Framing (docs/protocol.md §2): a 4-byte big-endian length, then one msgpack map.

Decoding is strict: no ext types (timestamps included), string/bin/array/map lengths
bounded by the frame body, string keys only at the top level, no trailing bytes.
A decode failure is the peer's, a :class:`~wcache.errors.RemoteProtocolError` (``FrameTooLargeError``
for a length over the limit; :func:`fail` for a field's); an encode failure ours, a
:class:`~wcache.errors.LocalProtocolError`.

msgpack and the error tree are imported when first used (a frame encoded or decoded, an error raised): an engine
whose fetch decodes its small frames with ``pymsgpack`` and raises nothing imports neither (docs/performance.md).
"""

from __future__ import annotations

import gc
import struct
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wcache.errors import RemoteProtocolError

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "DIRECT_BODY",
    "HEADER_SIZE",
    "MAX_HANDSHAKE_FRAME",
    "MAX_REQUEST_SIZE",
    "Preencoded",
    "FrameBuffer",
    "Inbound",
    "decode_body",
    "encode_body",
    "fail",
    "KEEPS_YOUNG",
    "gc_paused",
    "keep_young",
    "pack_frame",
]

HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size
#: Default maximum body size in bytes (docs/protocol.md §7); both peers may configure it.
DEFAULT_MAX_FRAME_SIZE = 64 * 1024 * 1024
#: Largest frame either side accepts before the handshake is done (HELLO, HELLO_OK: a few KiB at most;
#: docs/protocol.md §7). An unauthenticated peer cannot make the daemon buffer more than this.
MAX_HANDSHAKE_FRAME = 64 * 1024
#: Largest request a daemon accepts after the handshake: no client -> daemon frame comes near it (a GET_STATE
#: key is a few KiB); only daemon -> client frames (STATE, TAKEOVER_STATE) and frames to a keeper (KEEP) are big.
MAX_REQUEST_SIZE = 1024 * 1024
#: Absolute ceiling representable by the length prefix.
MAX_REPRESENTABLE = 2**32 - 1


def fail(frame: str, fld: str, what: str) -> RemoteProtocolError:
    """The one decode error of a frame's field, the peer's (what it sent breaks docs/protocol.md): names the frame
    (or part) and the field."""
    from wcache.errors import RemoteProtocolError

    return RemoteProtocolError(f"{frame}.{fld}: {what}", details={"frame": frame, "field": fld})


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed")


class Preencoded:
    """A value encoded to msgpack once and spliced into frames as is.

    The daemon serves the same tensor table to every client; encoding it once at load
    time makes a 50,000-tensor STATE cost microseconds to build per request.
    """

    __slots__ = ("data",)

    def __init__(self, value: Any) -> None:
        import msgpack

        self.data: bytes = msgpack.packb(value, use_bin_type=True)


def encode_body(payload: dict[str, Any]) -> bytes:
    """msgpack-encode one frame map (bin type for bytes, str for text)."""
    import msgpack

    try:
        if not any(type(v) is Preencoded for v in payload.values()):
            body: bytes = msgpack.packb(payload, use_bin_type=True)
            return body
        return _splice(payload)
    except (TypeError, ValueError, OverflowError) as exc:
        from wcache.errors import LocalProtocolError

        raise LocalProtocolError(f"cannot encode frame: {exc}") from exc


def _splice(payload: dict[str, Any]) -> bytes:
    import msgpack

    n = len(payload)
    parts = [bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)]
    for k, v in payload.items():
        parts.append(msgpack.packb(k, use_bin_type=True))
        parts.append(v.data if type(v) is Preencoded else msgpack.packb(v, use_bin_type=True))
    return b"".join(parts)


def pack_frame(payload: dict[str, Any], max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Length-prefix one encoded map; raises FrameTooLargeError past ``max_frame_size``."""
    body = encode_body(payload)
    if len(body) > max_frame_size:
        from wcache.errors import FrameTooLargeError

        raise FrameTooLargeError.for_size(len(body), max_frame_size)
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decode one frame body into a map with string keys, or raise ProtocolError."""
    import msgpack

    n = len(body)
    if n == 0:
        raise _malformed("empty frame body")
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=False,  # arrays decode as tuples: faster, and frames are immutable
            ext_hook=_reject_ext,
            max_ext_len=0,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
        )
    except msgpack.ExtraData as exc:
        raise _malformed("trailing bytes after the msgpack map in a frame") from exc
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException) as exc:
        raise _malformed(f"malformed msgpack in frame body: {exc}") from exc
    if not isinstance(obj, dict):
        raise _malformed(f"frame body must be a msgpack map, got {type(obj).__name__}")
    for k in obj:
        if type(k) is not str:
            raise _malformed("frame map keys must be strings")
    return obj


def _malformed(message: str) -> RemoteProtocolError:
    """The error of a body that is not one strict msgpack map (the error tree is imported on this path only: an
    engine decoding a big STATE raises nothing, and imports nothing more than msgpack for it)."""
    from wcache.errors import RemoteProtocolError

    return RemoteProtocolError(message)


#: whether :func:`keep_young` does anything here: CPython 3.11-3.13 with the GIL, whose ``gc.freeze`` and
#: ``gc.unfreeze`` splice the generations' lists (O(1)). The free-threaded build's walk the whole heap with every
#: thread stopped and have no generations to spare; 3.14's incremental collector's ``freeze`` walks an old space.
KEEPS_YOUNG = sys.version_info < (3, 14) and "t" not in getattr(sys, "abiflags", "")
#: the most objects a permanent generation may hold and be taken for the interpreter's own: CPython 3.12 starts
#: with its deep-frozen startup tuples there (375 on the 3.12.1 and 3.12.3 builds seen, the lent H200's among
#: them), where a ``gc.freeze()`` of any program's heap holds thousands (4,621 in a bare ``python3.12 -S``). The
#: others start with none: there any frozen object is a program's.
STARTUP_FROZEN = 1000 if sys.version_info[:2] == (3, 12) else 0
_frozen_seen = False


def keep_young() -> None:
    """Move every object the cyclic GC tracks into its oldest generation, without a collection.

    For the end of a pause (``gc_paused(keep=True)``, and ``wcache``'s lazy imports) over work whose objects an
    engine keeps: an import's modules and classes, a fetch's STATE and views. Left young, all of them are
    traversed by the next collection (one pass of ~0.6 ms after an engine's import on the CPU VM) and again when
    they move up, to find nothing. ``gc.freeze()`` then ``gc.unfreeze()`` does the move (the permanent
    generation goes back to the oldest).

    What it trades: the process's other young objects move with them, so a cycle among those (garbage already,
    or soon) waits for the next full collection instead of a young one — in a process whose heap is torch's, that
    may be many allocations away. An engine's fetch is a few such moves per process start; a daemon never asks
    for them. Skipped where :data:`KEEPS_YOUNG` is false, and for good once anything was found frozen (a pre-fork
    server's ``gc.freeze``, which the unfreeze would release; counting a frozen heap walks it), except for what the
    interpreter froze itself (at most :data:`STARTUP_FROZEN` objects: Python 3.12's startup tuples), which the first
    move releases to the oldest generation — immortal objects, which a collection traverses and never frees; left
    alone, they would keep the move off in every 3.12 process, and each pause's young objects (~3,000 after an
    engine's import) for the next collection to traverse, wherever it fell (0.46-0.65 ms on the H200's host, in the
    key's phase or the fetch's window). Not atomic against another thread: its ``gc.freeze()`` between the count and the unfreeze
    is undone, and a ``fork()`` between the two calls starts the child with everything frozen."""
    global _frozen_seen
    if not KEEPS_YOUNG or _frozen_seen:
        return
    if gc.get_freeze_count() > STARTUP_FROZEN:
        _frozen_seen = True
        return
    gc.freeze()
    gc.unfreeze()


@contextmanager
def gc_paused(size: int | None = None, *, keep: bool = False) -> Iterator[None]:
    """Pause the cyclic GC while decoding a large frame body (``size`` bytes; None: pause whatever the size).

    A frame of many small containers (arrays of maps, as a per-entry tensor table was) triggers
    collections that sweep the whole heap while nothing it decodes can form a cycle. STATE's columnar
    table decodes to a few tracked objects (its 50,000 names are strs, which the collector does not
    track): its msgpack decode takes the same time with or without the pause (4.5 ms, CPU VM, 2026-12-04).
    What pays is the rest of an engine's fetch (modules, views: tensors created in a process whose
    heap is torch's).
    ``keep``: what is made meanwhile stays (an engine's modules, its STATE, its views): it goes to the oldest
    generation as the pause ends (:func:`keep_young`, and what that trades) instead of being traversed by the
    next collection.
    """
    if (size is not None and size < GC_PAUSE_BYTES) or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if keep:
            keep_young()
        gc.enable()


GC_PAUSE_BYTES = 1 << 20


class FrameBuffer:
    """Reassembles frames from any chunking of the byte stream (down to 1 byte at a time).

    The length prefix is checked against ``max_frame_size`` as soon as its 4 bytes are
    in, before any of the body is kept waiting for the rest.

    ``direct``: a body of at least DIRECT_BODY bytes is assembled in one buffer of its announced size, made when
    the (checked) prefix is in, which the reader fills in place — :meth:`space` is the rest of it, to receive
    into (``recv_into``), :meth:`filled` counts what arrived there — and :meth:`next_body` returns it as is. A
    50,000-tensor STATE (2 MB) then costs one copy from the kernel instead of a chunk per read, a growing buffer
    and the body copied out of it (each a pass over fresh memory in a fresh engine). For the side that takes a
    big frame from a peer it trusts with its frame limit (a client from its daemon): a server buffers its peers'
    frames only as they arrive, against a budget claimed first (wcache/channel.py, ``ReadBudget``).
    """

    __slots__ = ("_body", "_buf", "_filled", "_need", "_pos", "direct", "limit_reason", "max_frame_size")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, *, direct: bool = False) -> None:
        if not 1 <= max_frame_size <= MAX_REPRESENTABLE:
            raise ValueError(f"max_frame_size must be in 1..{MAX_REPRESENTABLE}")
        self.max_frame_size = max_frame_size
        #: why the limit is what it is, for the error (e.g. "before the handshake")
        self.limit_reason = ""
        self.direct = direct
        self._buf = bytearray()
        self._pos = 0
        self._need = -1  # body length of the frame in progress, -1 while reading the prefix
        self._body: bytearray | None = None  # a direct body in progress, ``_filled`` bytes of it in
        self._filled = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame (for partial-frame timeouts)."""
        return len(self._buf) - self._pos + (self._filled if self._body is not None else 0)

    @property
    def demand(self) -> int:
        """Bytes this buffer will hold once the frame in progress is complete: what is buffered, or the
        announced body length if more (for a budget across connections, checked before the body arrives)."""
        held = self.buffered
        return held if self._need < 0 else max(held, self._need)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        body = self._body
        if body is not None and self._filled < len(body):
            take = min(len(data), len(body) - self._filled)
            body[self._filled : self._filled + take] = data[:take]
            self._filled += take
            if take == len(data):
                return
            data = data[take:]
        if self._pos and self._pos >= len(self._buf) // 2:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def space(self) -> memoryview | None:
        """The part of a direct body still to arrive, to receive into (then :meth:`filled`); None otherwise."""
        body = self._body
        if body is None or self._filled >= len(body):
            return None
        return memoryview(body)[self._filled :]

    def filled(self, n: int) -> None:
        """``n`` bytes were received into :meth:`space`."""
        body = self._body
        if body is None or not 0 <= n <= len(body) - self._filled:
            raise ValueError(f"{n} bytes do not fit the body in progress")
        self._filled += n

    def next_body(self) -> bytes | bytearray | None:
        """Return the next complete frame body, or None when more bytes are needed."""
        if self._body is not None:
            return self._direct_body()
        buf = self._buf
        if self._need < 0:
            if len(buf) - self._pos < HEADER_SIZE:
                return None
            (size,) = HEADER.unpack_from(buf, self._pos)
            if size > self.max_frame_size or size == 0:
                raise self._refused(size)
            self._pos += HEADER_SIZE
            self._need = size
            if self.direct and size >= DIRECT_BODY:
                have = min(len(buf) - self._pos, size)
                body = self._body = bytearray(size)
                body[:have] = memoryview(buf)[self._pos : self._pos + have]
                self._pos += have
                self._filled = have
                return self._direct_body()
        if len(buf) - self._pos < self._need:
            return None
        end = self._pos + self._need
        with memoryview(buf) as view:
            out = bytes(view[self._pos : end])
        self._pos = end
        self._need = -1
        return out

    def _refused(self, size: int) -> RemoteProtocolError:
        """The error for a length prefix of ``size`` (over the limit, or zero)."""
        from wcache.errors import FrameTooLargeError, RemoteProtocolError

        if size == 0:
            return RemoteProtocolError("zero-length frame")
        if not self.limit_reason:
            return FrameTooLargeError.for_size(size, self.max_frame_size)
        return FrameTooLargeError(
            f"frame of {size} bytes exceeds the limit of {self.max_frame_size} bytes {self.limit_reason}",
            details={"size": size, "max_size": self.max_frame_size},
        )

    def _direct_body(self) -> bytearray | None:
        body = self._body
        if body is None or self._filled < len(body):
            return None
        self._body, self._filled, self._need = None, 0, -1
        return body


class Inbound:
    """The receiving end of a connection, sans I/O: what a channel (``wcache.channel.Channel``) feeds — bytes and the
    descriptors that came with them — and what it asks of the frame in progress. The reference ``Connection`` and an
    engine's ``EngineConnection`` take their frames' bodies from ``_buffer`` and their descriptors from ``_fds``.

    The descriptors are the connection's once received: each goes out with the frame that announces it, and
    :meth:`release_fds` returns the rest for closing. ``_admit_fds`` is where a connection refuses descriptors its
    peer may not send (a daemon's clients send none)."""

    def __init__(self, max_frame_size: int, *, direct: bool) -> None:
        self._buffer = FrameBuffer(max_frame_size, direct=direct)
        self._eof = False
        #: descriptors received and not yet handed out with a frame (this connection's until released)
        self._fds: list[int] = []

    def _admit_fds(self, fds: Iterable[int]) -> None:
        self._fds.extend(fds)

    def receive_data(self, data: bytes | bytearray | memoryview, fds: Iterable[int] = ()) -> None:
        """Feed bytes from the peer, with the descriptors that came with them (SCM_RIGHTS); ``b""`` marks the end of
        the stream."""
        if fds:
            self._admit_fds(fds)
        if not data:
            self._eof = True
            return
        self._buffer.feed(data)

    def receive_space(self) -> memoryview | None:
        """Where the rest of the frame in progress goes, when this side assembles it in place (a client's big
        frames, ``FrameBuffer.direct``): receive into it, then :meth:`received_into`. None: use receive_data."""
        return self._buffer.space()

    def received_into(self, n: int, fds: Iterable[int] = ()) -> None:
        """``n`` bytes (> 0) arrived in :meth:`receive_space`, with these descriptors (as receive_data's)."""
        if fds:
            self._admit_fds(fds)
        self._buffer.filled(n)

    def release_fds(self) -> list[int]:
        """Every descriptor received and not handed out with a frame (for the owner to close: on close, or after an
        error)."""
        out, self._fds = self._fds, []
        return out

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame (for partial-frame timeouts)."""
        return self._buffer.buffered

    @property
    def demand(self) -> int:
        """Bytes held once the frame in progress is complete (its announced length, checked first)."""
        return self._buffer.demand

    @property
    def eof(self) -> bool:
        return self._eof


#: Bodies a ``direct`` FrameBuffer assembles in place (smaller ones go through its buffer: a HELLO_OK, a dense
#: STATE of a few KB).
DIRECT_BODY = 64 * 1024
