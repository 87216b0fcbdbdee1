"""An engine's half of the protocol in one module, for its restart's import budget (docs/performance.md).

An engine's fetch sends HELLO, GET_STATE and RELEASE and receives HELLO_OK, STATE, RELEASED and ERROR
(docs/protocol.md §3-§5). Through the frame declarations (``fields``, ``daemon_frames``, ``connection``: ~3 ms of
class building and msgpack's import in a fresh process) that was most of an engine's ``import wcache``. This module
speaks those frames directly — ``pymsgpack`` for the bytes (msgpack's C decoder for a STATE over 64 KiB), a
record per frame received (:class:`HelloOk`, :class:`State`, :class:`Released`) and :class:`EngineConnection`,
the client end's checks of §5 — and imports no declaration until something is refused.

The declarations stay the protocol's reference: the daemon, the keeper, every other request and the tests speak
through them, and this module is held to them:

- what it sends is byte for byte what they encode (tests: the golden examples and random requests);
- what it receives it checks at least as strictly as they do, and it hands whatever its checks refuse, and every
  ERROR (the failure path), to their decoder (``frames.decode_frame``): their error is the error raised, and a
  frame they accept that this module's checks did not is taken as they decoded it. So no frame is refused here
  that they accept; tests/proto/test_engine.py checks the converse, on arbitrary and damaged frames and on
  sequences of frames against the reference ``Connection``: nothing passes here that they refuse, and what
  passes is what they decode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

from wcache.proto._record import named_tuple
from wcache.proto.codec import (
    DEFAULT_MAX_FRAME_SIZE,
    HEADER,
    MAX_HANDSHAKE_FRAME,
    Inbound,
    gc_paused,
)
from wcache.proto.limits import (
    BACKENDS,
    INT32_MAX,
    INT64_MAX,
    MAX_BIN,
    MAX_DEPOSIT_TENSORS,
    MAX_DEVICE_INDEX,
    MAX_FD_POSITION,
    MAX_FRAME_FDS,
    MAX_KEY_CHARS,
    MAX_KEY_FIELDS,
    MAX_NAME,
    MAX_PENDING,
    MAX_STATE_SLABS,
    MAX_WIRE_FRAME_SIZE,
    MODES,
    PROTOCOL_VERSION,
    SLAB_KINDS,
    SUPPORTED_VERSIONS,
)
from wcache.proto.pymsgpack import SMALL_BODY, Unsupported, packb, unpack_body
from wcache.proto.table import TensorTable

if TYPE_CHECKING:
    from wcache.proto.daemon_frames import ErrorFrame
    from wcache.proto.fields import Frame

__all__ = [
    "DeviceInfo",
    "EngineConnection",
    "as_reference",
    "FileId",
    "HelloOk",
    "Released",
    "SlabDescriptor",
    "State",
]

_GET_STATE, _RELEASE = "GET_STATE", "RELEASE"
#: the phases of docs/protocol.md §5.1 a client passes through (the values of ``fields.Phase``)
START, HELLO_SENT, OPEN, CLOSED = "start", "hello_sent", "open", "closed"


# --------------------------------------------------------------------------- records of the frames received
# typing.NamedTuple classes for type checkers, ``named_tuple``'s at run time (as the tensor table's tuples): their
# fields are the declarations' (daemon_frames), in the same order.
if TYPE_CHECKING:

    class DeviceInfo(NamedTuple):
        kind: str
        index: int  # type: ignore[assignment]  # the field's name is the protocol's (shadows tuple.index)
        uuid: str
        name: str

    class HelloOk(NamedTuple):
        version: int
        software: str
        backend: str
        device: DeviceInfo
        max_frame_size: int
        server_pid: int

    class SlabDescriptor(NamedTuple):
        size: int
        kind: str
        fd: int
        handle: bytes
        offset: int
        device_uuid: str

    class State(NamedTuple):
        id: int
        lease: int
        key: dict[str, str | int]
        mode: str
        slabs: tuple[SlabDescriptor, ...]
        tensors: TensorTable
        aliases: dict[str, str]
        buffers: tuple[str, ...]

    class Released(NamedTuple):
        id: int
        lease: int
        leases_left: int

    #: what an engine's connection yields: its records, or an ERROR as the reference decodes it
    Received: TypeAlias = HelloOk | State | Released | Frame

    class FileId(NamedTuple):
        name: str
        dev: int
        ino: int
        size: int
        mtime_ns: int
        ctime_ns: int

else:
    DeviceInfo = named_tuple(
        "DeviceInfo", ("kind", "index", "uuid", "name"), "HELLO_OK's ``device``, as an engine takes it.", __name__
    )
    HelloOk = named_tuple(
        "HelloOk",
        ("version", "software", "backend", "device", "max_frame_size", "server_pid"),
        "HELLO_OK as an engine takes it (docs/protocol.md §4.2).",
        __name__,
    )
    SlabDescriptor = named_tuple(
        "SlabDescriptor",
        ("size", "kind", "fd", "handle", "offset", "device_uuid"),
        "One slab of a STATE as an engine takes it (docs/protocol.md §4.5).",
        __name__,
    )
    State = named_tuple(
        "State",
        ("id", "lease", "key", "mode", "slabs", "tensors", "aliases", "buffers"),
        "STATE as an engine takes it (docs/protocol.md §4.4).",
        __name__,
    )
    Released = named_tuple(
        "Released", ("id", "lease", "leases_left"), "RELEASED as an engine takes it (docs/protocol.md §4.7).", __name__
    )
    FileId = named_tuple(
        "FileId",
        ("name", "dev", "ino", "size", "mtime_ns", "ctime_ns"),
        "One checkpoint file as ``stat`` saw it: a GET_STATE proof's FileStat (docs/protocol.md §4.3.1).",
        __name__,
    )


class _Refused(Exception):
    """This module's checks refuse a frame: the reference decides (``_reference``)."""


# --------------------------------------------------------------------------- the requests an engine sends


def hello(software: str, name: str) -> dict[str, Any]:
    """HELLO's map (docs/protocol.md §4.1), as the declarations encode it."""
    return {"type": "HELLO", "versions": [PROTOCOL_VERSION], "software": software, "name": name}


def get_state(
    id: int,
    key: dict[str, str | int],
    mode: str,
    proof: tuple[tuple[FileId, ...], str] | None = None,
    device_uuid: str = "",
) -> dict[str, Any]:
    """GET_STATE's map (docs/protocol.md §4.3): ``proof`` the checkpoint files' identity and the dtype asked for
    (§4.3.1), left off the wire when None."""
    m: dict[str, Any] = {"type": _GET_STATE, "id": id, "key": dict(key), "mode": mode, "device_uuid": device_uuid}
    if proof is not None:
        files, dtype = proof
        m["proof"] = {
            "files": [
                {"name": f[0], "dev": f[1], "ino": f[2], "size": f[3], "mtime_ns": f[4], "ctime_ns": f[5]}
                for f in files
            ],
            "dtype": dtype,
        }
    return m


def release(id: int, lease: int) -> dict[str, Any]:
    """RELEASE's map (docs/protocol.md §4.7)."""
    return {"type": _RELEASE, "id": id, "lease": lease}


def pack(m: dict[str, Any]) -> bytes:
    """One frame's bytes: the length prefix and the map (pymsgpack; msgpack for what that declines)."""
    try:
        body = packb(m)
    except Unsupported:
        from wcache.proto.codec import encode_body

        body = encode_body(m)
    return HEADER.pack(len(body)) + body


# --------------------------------------------------------------------------- the frames an engine receives


def decode(body: bytes | bytearray) -> Received:
    """One frame body as an engine takes it: HELLO_OK, STATE or RELEASED as this module's records when its checks
    pass; anything else (an ERROR, a frame of another kind, a frame its checks refuse) as the reference decodes it
    — raising its RemoteProtocolError where it refuses it."""
    m: dict[str, Any] | None
    if len(body) <= SMALL_BODY:
        try:
            m = unpack_body(body)
        except Unsupported:
            m = None
    else:
        m = None
    if m is None:
        from wcache.proto.codec import decode_body

        m = decode_body(body)  # the reference's own decoder: its error, if any, is the one raised
    t = m.get("type")
    decoder = _DECODERS.get(t) if type(t) is str else None
    if decoder is not None:
        try:
            return decoder(m)
        except _Refused:
            pass
    return _reference(m)


def _reference(m: dict[str, Any]) -> Received:
    """``m`` as the declarations decode it (raising their RemoteProtocolError); their record of an engine's frame
    becomes this module's."""
    from wcache.proto.frames import decode_frame

    frame = decode_frame(m)
    convert = _FROM_REFERENCE.get(frame.TYPE)
    out: Received = convert(frame) if convert is not None else frame
    return out


def _int(m: dict[str, Any], name: str, lo: int, hi: int, absent: int | None = None) -> int:
    v = m.get(name, absent)
    if type(v) is not int or not lo <= v <= hi:
        raise _Refused
    return v


def _str(m: dict[str, Any], name: str, absent: str | None = None, max_len: int = MAX_NAME) -> str:
    v = m.get(name, absent)
    if type(v) is not str or len(v) > max_len:
        raise _Refused
    return v


def _choice(m: dict[str, Any], name: str, options: tuple[str, ...]) -> str:
    v = m.get(name)
    if type(v) is not str or v not in options:
        raise _Refused
    return v


def _map(v: Any) -> dict[str, Any]:
    if type(v) is not dict or any(type(k) is not str for k in v):
        raise _Refused
    return v


def _hello_ok(m: dict[str, Any]) -> HelloOk:
    d = _map(m.get("device"))
    device = DeviceInfo(
        _choice(d, "kind", ("cpu", "cuda")),
        _int(d, "index", 0, MAX_DEVICE_INDEX, 0),
        _str(d, "uuid", ""),
        _str(d, "name", ""),
    )
    return HelloOk(
        _int(m, "version", 1, INT32_MAX),
        _str(m, "software", ""),
        _choice(m, "backend", BACKENDS),
        device,
        _int(m, "max_frame_size", 1, MAX_WIRE_FRAME_SIZE),
        _int(m, "server_pid", 0, INT64_MAX, 0),
    )


def _key(v: Any) -> dict[str, str | int]:
    m = _map(v)
    if len(m) > MAX_KEY_FIELDS:
        raise _Refused
    chars = 0
    for k, x in m.items():
        if type(x) is str:
            chars += len(x)
            if len(x) > MAX_NAME:
                raise _Refused
        elif type(x) is not int:
            raise _Refused
        if len(k) > MAX_NAME:
            raise _Refused
        chars += len(k)
    if chars > MAX_KEY_CHARS:
        raise _Refused
    return m


def _slab(v: Any) -> SlabDescriptor:
    m = _map(v)
    handle = m.get("handle", b"")
    if type(handle) is not bytes or len(handle) > MAX_BIN:
        raise _Refused
    return SlabDescriptor(
        _int(m, "size", 0, INT64_MAX),
        _choice(m, "kind", SLAB_KINDS),
        _int(m, "fd", -1, MAX_FD_POSITION, -1),
        handle,
        _int(m, "offset", 0, INT64_MAX, 0),
        _str(m, "device_uuid", ""),
    )


def _state(m: dict[str, Any]) -> State:
    rid, lease = _int(m, "id", 1, INT64_MAX), _int(m, "lease", 1, INT64_MAX)
    key, mode = _key(m.get("key")), _choice(m, "mode", MODES)
    raw_slabs = m.get("slabs")
    if type(raw_slabs) is not tuple or len(raw_slabs) > MAX_STATE_SLABS:
        raise _Refused
    slabs = tuple(map(_slab, raw_slabs))
    fds = sorted(s.fd for s in slabs if s.fd >= 0)
    if len(fds) > MAX_FRAME_FDS or fds != list(range(len(fds))):
        raise _Refused
    raw_table = m.get("tensors")
    if type(raw_table) is not dict:
        raise _Refused
    try:
        table = TensorTable.from_wire(raw_table, [s.size for s in slabs])  # the one table decoder
    except Exception:
        raise _Refused from None
    aliases = _map(m.get("aliases", {}))
    if aliases:
        known = set(table.names)
        for a, t in aliases.items():
            if type(t) is not str or len(a) > MAX_NAME or len(t) > MAX_NAME or a in known or t not in known:
                raise _Refused
    buffers = m.get("buffers", ())
    if type(buffers) is not tuple or len(buffers) > MAX_DEPOSIT_TENSORS:
        raise _Refused
    for b in buffers:
        if type(b) is not str or len(b) > MAX_NAME:
            raise _Refused
    return State(rid, lease, key, mode, slabs, table, aliases, buffers)


def _released(m: dict[str, Any]) -> Released:
    return Released(
        _int(m, "id", 1, INT64_MAX), _int(m, "lease", 1, INT64_MAX), _int(m, "leases_left", 0, INT64_MAX, 0)
    )


_DECODERS: dict[str, Callable[[dict[str, Any]], Received]] = {
    "HELLO_OK": _hello_ok,
    "STATE": _state,
    "RELEASED": _released,
}


def _device_from(d: Any) -> DeviceInfo:
    return DeviceInfo(d.kind, d.index, d.uuid, d.name)


def _hello_from(f: Any) -> HelloOk:
    return HelloOk(f.version, f.software, f.backend, _device_from(f.device), f.max_frame_size, f.server_pid)


def _state_from(f: Any) -> State:
    slabs = tuple(SlabDescriptor(s.size, s.kind, s.fd, s.handle, s.offset, s.device_uuid) for s in f.slabs)
    return State(f.id, f.lease, f.key, f.mode, slabs, f.tensors, f.aliases, f.buffers)


def _released_from(f: Any) -> Released:
    return Released(f.id, f.lease, f.leases_left)


#: the reference's records of an engine's frames, as this module's (a frame its checks refused and theirs passed)
_FROM_REFERENCE: dict[str, Callable[[Any], Received]] = {
    "HELLO_OK": _hello_from,
    "STATE": _state_from,
    "RELEASED": _released_from,
}


# --------------------------------------------------------------------------- the client end of a connection


def _remote(message: str) -> Exception:
    from wcache.errors import RemoteProtocolError

    return RemoteProtocolError(message)


def _local(message: str, **details: Any) -> Exception:
    from wcache.errors import LocalProtocolError

    return LocalProtocolError(message, details=details or None)


class EngineConnection(Inbound):
    """The client end of an engine's connection to a daemon, sans I/O: the opening (HELLO and the pipelined
    GET_STATE, docs/protocol.md §5.1), a GET_STATE again on the same connection, RELEASE; the frames received,
    checked as the reference ``Connection`` checks a client's (the phase, the request each reply answers, the
    leases granted, the descriptors a frame announces, the frame size allowed before and after the handshake).

    A channel (``wcache.channel.Channel``) moves its bytes and descriptors as a ``Connection``'s; ``received()``
    yields each frame with the descriptors it brings — this module's records, and an ERROR as the reference
    decodes it (``daemon_frames.ErrorFrame``) — and raises the reference's errors: RemoteProtocolError (or a
    subclass) for what the daemon may not send, LocalProtocolError for what this end may not.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.phase = START
        self.max_frame_size = max_frame_size
        self.max_handshake_frame = min(MAX_HANDSHAKE_FRAME, max_frame_size)
        #: the largest frame body the daemon takes, as its HELLO_OK announced (None until then)
        self.peer_max_frame_size: int | None = None
        self.version: int | None = None
        #: request id -> request type, for requests awaiting a reply
        self.pending: dict[int, str] = {}
        #: leases the daemon granted this connection (STATE) and has not ended (RELEASED)
        self.leases: set[int] = set()
        super().__init__(max_frame_size, direct=True)  # a big STATE lands where it is decoded
        self._next_id = 1

    # ------------------------------------------------------------------ outbound
    def next_request_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def opening(self, software: str, name: str, request: dict[str, Any]) -> bytes:
        """HELLO and, behind it, the GET_STATE ``request`` (one write, one round trip: docs/protocol.md §5.1)."""
        if self.phase != START:
            raise _local(f"HELLO frame not allowed in phase {self.phase} (client send)")
        data = pack(hello(software, name))
        self.phase = HELLO_SENT
        return data + self.send(request)

    def send(self, request: dict[str, Any]) -> bytes:
        """A GET_STATE or RELEASE map's bytes, checked as the reference checks a client's request: its phase (a
        GET_STATE may go before HELLO_OK is back, a RELEASE not), a fresh id, a lease held (RELEASE), the size
        the daemon announced. LocalProtocolError, nothing changed, for a request this end may not send."""
        t, rid = request["type"], request["id"]
        if self.phase != OPEN and not (t == _GET_STATE and self.phase == HELLO_SENT):
            raise _local(f"{t} frame not allowed in phase {self.phase} (client send)")
        if rid in self.pending:
            raise _local(f"request id {rid} is already waiting for a reply")
        if len(self.pending) >= MAX_PENDING:
            raise _local(f"more than {MAX_PENDING} requests waiting for replies")
        if t == _RELEASE and request["lease"] not in self.leases:
            raise _local(f"lease {request['lease']} is not held on this connection")
        data = pack(request)
        limit = self.peer_max_frame_size
        if limit is not None and len(data) - 4 > limit:
            raise _local(
                f"{t} is {len(data) - 4} bytes, over the {limit} bytes the peer takes (its HELLO_OK "
                "max_frame_size, docs/protocol.md §7): nothing sent",
                frame=t,
                size=len(data) - 4,
                max_size=limit,
            )
        self.pending[rid] = t
        return data

    # ------------------------------------------------------------------ inbound (a Channel's interface: Inbound's)
    @property
    def frame_limit(self) -> int:
        """The largest frame body accepted now: small until the handshake is done."""
        return self.max_frame_size if self.phase == OPEN else self.max_handshake_frame

    def received(self) -> Iterator[tuple[Received, list[int]]]:
        """Each complete frame received so far, checked, with the descriptors it brings (the caller owns them).
        Raises as the reference connection's ``received()`` does."""
        while self.phase != CLOSED:
            buf = self._buffer
            buf.max_frame_size = self.frame_limit  # the phase may have changed with the previous frame
            buf.limit_reason = "" if self.phase == OPEN else "before the handshake (HELLO / HELLO_OK are small)"
            body = buf.next_body()
            if body is None:
                if self._fds and not buf.buffered:
                    raise _remote(f"{len(self._fds)} file descriptor(s) arrived that no frame announced")
                if self._eof:
                    self.phase = CLOSED
                    if buf.buffered:
                        raise _remote(f"stream ended inside a frame ({buf.buffered} bytes pending)")
                return
            with gc_paused(len(body), keep=True):  # an engine keeps what it decodes (its STATE's table)
                frame = decode(body)
            if isinstance(frame, State):
                want = sum(1 for s in frame.slabs if s.fd >= 0)
            elif isinstance(frame, (HelloOk, Released)):
                want = 0
            else:  # the reference's record (an ERROR, or a frame an engine never receives): as it declares
                want = frame.fd_count
            if want > len(self._fds):
                name = "STATE" if isinstance(frame, State) else getattr(frame, "TYPE", "")
                raise _remote(f"{name} announces {want} file descriptor(s), {len(self._fds)} arrived")
            self._on(frame)
            fds, self._fds = self._fds[:want], self._fds[want:]
            yield frame, fds

    def _on(self, frame: Received) -> None:
        """The reference's client-side checks of a received frame (``Connection._on``), for an engine's frames; a
        frame they refuse is refused with the reference's own error (``_refused``)."""
        phase = self.phase
        if isinstance(frame, HelloOk):
            if phase != HELLO_SENT or frame.version not in SUPPORTED_VERSIONS:
                raise self._refused(frame)
            self.version = frame.version
            self.peer_max_frame_size = frame.max_frame_size
            self.phase = OPEN
        elif isinstance(frame, (State, Released)):
            request = _GET_STATE if isinstance(frame, State) else _RELEASE
            if phase != OPEN or self.pending.get(frame.id) != request:
                raise self._refused(frame)
            if isinstance(frame, State) and frame.lease in self.leases:
                error = self._refused(frame)
                del self.pending[frame.id]  # as the reference: the reply is taken, then its lease refused
                raise error
            del self.pending[frame.id]
            if isinstance(frame, State):
                self.leases.add(frame.lease)
            else:
                self.leases.discard(frame.lease)
        else:
            self._on_other(frame)

    def _on_other(self, frame: Frame) -> None:
        """An ERROR (the reference's record: the failure path), or a frame an engine never receives."""
        from wcache.proto.daemon_frames import ErrorFrame

        if not isinstance(frame, ErrorFrame):
            raise self._refused(frame)
        if frame.fatal:
            self.phase = CLOSED
        elif self.phase == OPEN and (frame.id == 0 or frame.id in self.pending):
            self.pending.pop(frame.id, None)
        else:
            raise self._refused(frame)

    def _refused(self, frame: Received) -> Exception:
        """The error the reference connection raises for ``frame`` received in this connection's state: its class,
        message and details (the refusal path imports the declarations)."""
        from wcache.proto.connection import RECV, Connection
        from wcache.proto.fields import Phase, Role

        ref = Connection(Role.CLIENT)
        ref.phase, ref.version = Phase(self.phase), self.version
        ref.pending, ref.leases = dict(self.pending), set(self.leases)
        try:
            ref._on(RECV, as_reference(frame))
        except Exception as exc:
            return exc
        from wcache.errors import UnexpectedFrameError  # the reference took it: this module cannot (never seen)

        return UnexpectedFrameError(
            f"an engine's connection cannot take this {type(frame).__name__} in phase {self.phase}"
        )


def as_reference(frame: Received) -> Frame:
    """A frame as the declarations' record: this module's records converted (the refusal path, and the tests that
    hold this module to the declarations), any other frame as it is."""
    from wcache.proto import daemon_frames as d

    if isinstance(frame, HelloOk):
        device = d.DeviceInfo(*frame.device)
        return d.HelloOk(frame.version, frame.software, frame.backend, device, frame.max_frame_size, frame.server_pid)
    if isinstance(frame, State):
        slabs = tuple(d.SlabDescriptor(*s) for s in frame.slabs)
        return d.State(frame.id, frame.lease, frame.key, frame.mode, slabs, frame.tensors, frame.aliases, frame.buffers)
    if isinstance(frame, Released):
        return d.Released(*frame)
    return frame


def raise_error(frame: ErrorFrame) -> None:
    """Raise the error an ERROR frame carries, as its class (``errors.error_from_frame``)."""
    from wcache.errors import error_from_frame

    raise error_from_frame(frame.code, frame.message, frame.details)
