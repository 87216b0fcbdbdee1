"""The sans-I/O connection: bytes in, typed frames out; frames in, bytes out.

Everything that affects the connection's state lives in this module, derived from one declaration per frame
(``@message`` in ``fields.py``: its reply, the services that answer it, the phases it travels in, whether it
may be pipelined, and its ``fd_count`` if it brings descriptors). From them come the transition table
``TRANSITIONS`` (docs/protocol.md §5: each frame's rows for the end that sends it, and their mirror for the
end that receives it), which service answers which requests (``SERVES``), which frames bring file
descriptors (``CARRIES_FDS``, docs/protocol.md §2.2) and each service's request union (``DaemonRequest``,
``KeeperRequest``). A connection reads a frame's rows from its class, so it needs no frame module beyond the
ones whose frames it meets; the tables, read here, import every frame module (``frames.FRAME_MODULES``).
This module also keeps the outstanding request ids and (on a client) the leases the peer granted it. The
asyncio server and client only move bytes and descriptors between a socket and a :class:`Connection`. A
server's leases live in one ledger, its store's (wcache/server/store.py): its connections do not keep a
second copy.

A server connection knows the service it speaks for (:class:`Service`): a request for another
service (a RECLAIM to a daemon, a GET_STATE to a keeper or a peer channel) comes out as
:class:`Misdirected`, carrying the non-fatal ``NOT_FOUND`` error to answer it with.

A peer channel in the shared-secret mode (``auth=True``, docs/protocol.md §10.2) passes through
``AUTH`` after the handshake: only the authentication frames may travel until PEER_AUTH_OK, and
frames stay as small as before the handshake.

Errors, by whose fault (h11's model): what the *peer* sent — malformed bytes, a bad field, a frame it may
not send now (:class:`UnexpectedFrameError`), descriptors it may not send — raises a
:class:`RemoteProtocolError`; a frame *we* may not send raises :class:`LocalProtocolError`. After either
from ``events()`` the connection should send ``fatal_error()`` and close.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import reduce
from operator import or_
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from wcache.errors import (
    LocalProtocolError,
    NotFoundError,
    RemoteProtocolError,
    UnexpectedFrameError,
    UnsupportedVersionError,
    WCacheError,
)
from wcache.proto.codec import (
    DEFAULT_MAX_FRAME_SIZE,
    MAX_HANDSHAKE_FRAME,
    MAX_REPRESENTABLE,
    Inbound,
    decode_body,
    gc_paused,
    pack_frame,
)
from wcache.proto.daemon_frames import ErrorFrame, Hello, HelloOk, Release, Released, State
from wcache.proto.fields import REGISTRY, Frame, Phase, Role, Service
from wcache.proto.limits import MAX_PENDING, PROTOCOL_VERSION, SUPPORTED_VERSIONS

if TYPE_CHECKING:  # the tables and request unions, derived from every frame when first read (``__getattr__``)
    from wcache.proto.fleet_frames import PeerOffer  # the peer channel's: never on an engine's path
    from wcache.proto.frames import (
        Commit,
        Deposit,
        Evict,
        GetState,
        Keep,
        Preload,
        Reclaim,
        Status,
        Takeover,
        TakeoverAdopted,
        Unkeep,
    )

    # the type checker's copy of ``requests(service)`` (match statements check against it; test_connection
    # checks it names what the frames declare)
    DaemonRequest: TypeAlias = (
        GetState | Release | Status | Preload | Evict | Takeover | TakeoverAdopted | Deposit | Commit
    )
    KeeperRequest: TypeAlias = Keep | Unkeep | Reclaim | Status
    #: (role, phase, direction, frame type) -> next phase, for every frame; absent = not allowed
    TRANSITIONS: dict[tuple[Role, Phase, str, str], Phase]
    #: the requests each service answers, by frame type; a server answers the others' with NOT_FOUND
    SERVES: dict[Service, frozenset[str]]
    #: the frames that bring file descriptors (``fd_count`` of them, docs/protocol.md §2.2); no other frame may
    CARRIES_FDS: frozenset[str]

__all__ = [
    "CARRIES_FDS",
    "PROTOCOL_VERSION",
    "SERVES",
    "SUPPORTED_VERSIONS",
    "TRANSITIONS",
    "Connection",
    "DaemonRequest",
    "Event",
    "KeeperRequest",
    "Misdirected",
    "Phase",
    "Role",
    "Service",
    "requests",
    "transitions",
]

SEND, RECV = "send", "recv"
#: The one phase that is named differently at the two ends: HELLO travelled, HELLO_OK not yet.
_MIRROR = {Phase.HELLO_SENT: Phase.HELLO_RECEIVED}
#: frame class -> its rows, (role, phase, direction) -> next phase (``transitions``, derived on first use)
_ROWS: dict[type[Frame], dict[tuple[Role, Phase, str], Phase]] = {}
#: service -> whether a request it answers brings descriptors (``Connection.accepts_fds``, derived on first use)
_ACCEPTS_FDS: dict[Service, bool] = {}
#: the request unions' names (``__getattr__``)
_UNIONS = {"DaemonRequest": Service.DAEMON, "KeeperRequest": Service.KEEPER}


def transitions(cls: type[Frame]) -> dict[tuple[Role, Phase, str], Phase]:
    """One frame's rows of the state machine, (role, phase, direction) -> next phase: each phase it declares
    (``MOVES``, in the client's view) for the end that sends it, and the mirror of that row for the end that
    receives it (a fatal ERROR, in any phase, closes the connection: ``Connection._on``)."""
    rows = _ROWS.get(cls)
    if rows is None:
        sends = cls.SENDER
        rows = {}
        for phase, after in cls.MOVES:
            for role in Role:
                here, there = (phase, after) if role is Role.CLIENT else (_mirror(phase), _mirror(after))
                rows[(role, here, SEND if role is sends else RECV)] = there
        _ROWS[cls] = rows
    return rows


def _mirror(phase: Phase) -> Phase:
    return _MIRROR.get(phase, phase)


def requests(service: Service) -> tuple[type[Frame], ...]:
    """The requests ``service`` answers (imports every frame module)."""
    return tuple(cls for cls in _frames() if service in cls.SERVICES)


class Misdirected:
    """A request for the other service, received by a server: answer it with ``error`` (NOT_FOUND,
    not fatal; the id is pending, so that ERROR is legal) and serve on."""

    __slots__ = ("error", "request")

    def __init__(self, request: Frame, service: Service) -> None:
        self.request = request
        where = {
            Service.DAEMON: "a wcache-keeper socket",
            Service.KEEPER: "a wcache-server socket (a keeper holds slabs for daemons and serves no models)",
            Service.PEER: "a daemon's Unix socket (the peer channel only offers slabs to other daemons)",
        }[service]
        self.error = NotFoundError(
            f"this socket is a wcache {service.value}: {request.TYPE} goes to {where}",
            details={"type": request.TYPE, "service": service.value},
        )

    @property
    def TYPE(self) -> str:  # as a frame's
        return self.request.TYPE

    @property
    def id(self) -> int:
        return getattr(self.request, "id", 0)

    def __repr__(self) -> str:
        return f"Misdirected({self.request!r})"


#: What a connection yields: a frame, or a request the server does not serve.
Event = Frame | Misdirected


def __getattr__(name: str) -> Any:
    """The tables and request unions, derived from every frame's declaration when read (they import every frame
    module; any other name, ``__path__`` that ``from ... import`` looks for included, imports nothing)."""
    if name == "TRANSITIONS":
        return {(*row, cls.TYPE): after for cls in _frames() for row, after in transitions(cls).items()}
    if name == "SERVES":
        return {service: frozenset(cls.TYPE for cls in requests(service)) for service in Service}
    if name == "CARRIES_FDS":
        return frozenset(cls.TYPE for cls in _frames() if cls.carries_fds())
    service = _UNIONS.get(name)
    if service is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return reduce(or_, requests(service))


def _frames() -> Iterable[type[Frame]]:
    from wcache.proto.frames import load_frames

    return load_frames().values()


def _accepts_fds(service: Service) -> bool:
    """Whether a request ``service`` answers brings descriptors (a keeper's KEEP; a daemon's none)."""
    accepts = _ACCEPTS_FDS.get(service)
    if accepts is None:
        accepts = _ACCEPTS_FDS[service] = any(cls.carries_fds() for cls in requests(service))
    return accepts


def _decode_frame(m: Any) -> Frame:
    """``frames.decode_frame``, without importing that module for a frame whose class is declared already (an
    engine's are, with ``daemon_frames``: its restart never loads the registry module); any other type goes
    through it, which loads the other frame modules. The same decoder either way: the class's ``from_wire``."""
    t = m.get("type")
    cls = REGISTRY.get(t) if type(t) is str else None
    if cls is not None:
        return cls.from_wire(m)
    from wcache.proto.frames import decode_frame

    return decode_frame(m)


class Connection(Inbound):
    """Protocol state of one connection, for either role.

    >>> conn = Connection(Role.CLIENT)
    >>> data = conn.send(Hello(versions=(2,)))   # bytes for the socket
    >>> conn.receive_data(chunk, fds)            # bytes (and descriptors) from the socket; b"" = EOF
    >>> for frame, fds in conn.received(): ...   # typed frames, validated, with their descriptors

    ``service``: what a server speaks for (None: both, for tests and fuzzing); a client may name the
    service it talks to, so that sending it a request it does not serve is a LocalProtocolError.
    """

    def __init__(
        self,
        role: Role,
        *,
        service: Service | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_handshake_frame: int = MAX_HANDSHAKE_FRAME,
        supported_versions: tuple[int, ...] = SUPPORTED_VERSIONS,
        auth: bool = False,
        keep_decoded: bool = False,
    ) -> None:
        """``max_frame_size``: the largest frame body accepted once the handshake is done;
        ``max_handshake_frame``: before it (HELLO / HELLO_OK), so that a peer that has not even said HELLO
        cannot make this side buffer a big body (docs/protocol.md §7). ``auth``: a peer channel in the
        shared-secret mode: AUTH follows the handshake (§10.2). ``keep_decoded``: what a large frame's decode makes
        is kept by the process (an engine's STATE: its table stays with the weights), so the decode's GC pause ends
        with it in the oldest generation (``codec.gc_paused(keep=True)``); a daemon's connections leave it young."""
        if auth and service not in (None, Service.PEER):
            raise ValueError("only the peer channel authenticates in the protocol")
        self.role = role
        self.service = service
        self.auth = auth
        self.keep_decoded = keep_decoded
        self.phase = Phase.START
        self.version: int | None = None
        self.supported_versions = supported_versions
        self.max_frame_size = max_frame_size
        #: the largest frame body the peer takes, as its HELLO_OK announced (a client's; None until then):
        #: send() refuses a bigger one, which the peer would end the connection for (FRAME_TOO_LARGE)
        self.peer_max_frame_size: int | None = None
        #: request id -> request frame type, for requests awaiting a reply
        self.pending: dict[int, str] = {}
        #: leases the peer granted this side (a STATE received) and has not ended (its RELEASED): a client's
        #: record of what it may RELEASE. Empty on a server: it grants leases, and its store is their ledger
        self.leases: set[int] = set()
        self.max_handshake_frame = min(max_handshake_frame, max_frame_size)
        # a client assembles a big frame (a STATE) where its reader receives it: codec.FrameBuffer's ``direct``
        super().__init__(max_frame_size, direct=role is Role.CLIENT)
        self._next_id = 1

    # ------------------------------------------------------------------ inbound
    @property
    def accepts_fds(self) -> bool:
        """Whether any frame this side may receive brings descriptors (a daemon's clients never send any)."""
        if self.role is Role.CLIENT or self.service is None:
            return True
        return _accepts_fds(self.service)

    def _admit_fds(self, fds: Iterable[int]) -> None:
        """The descriptors are this connection's (``Inbound``); RemoteProtocolError when this peer may not send
        any."""
        self._fds.extend(fds)
        if not self.accepts_fds:
            raise RemoteProtocolError("this peer may not send file descriptors")

    @property
    def frame_limit(self) -> int:
        """The largest frame body accepted now: small until the handshake is done."""
        return self.max_frame_size if self.phase is Phase.OPEN else self.max_handshake_frame

    def _set_limit(self) -> None:
        buf = self._buffer
        buf.max_frame_size = self.frame_limit
        buf.limit_reason = "" if self.phase is Phase.OPEN else "before the handshake (HELLO / HELLO_OK are small)"

    def events(self) -> Iterator[Event]:
        """Like :meth:`received`, for callers that move no descriptors (pure tests, fuzzers): frames only,
        no descriptor accounting (descriptors given to receive_data stay with the connection: release_fds)."""
        for event, _ in self._decode(with_fds=False):
            yield event

    def received(self) -> Iterator[tuple[Event, list[int]]]:
        """Yield each complete frame received so far, validated against the state, with the descriptors it
        announces (``fd_count``; the caller owns them).

        Raises RemoteProtocolError (or a subclass) on malformed bytes, an illegal frame, a frame announcing
        more descriptors than arrived, or descriptors that no frame announces. A stream that ends inside a
        frame raises RemoteProtocolError too.
        """
        return self._decode(with_fds=True)

    def _decode(self, *, with_fds: bool) -> Iterator[tuple[Event, list[int]]]:
        while self.phase is not Phase.CLOSED:
            self._set_limit()  # the phase may have changed with the previous frame
            body = self._buffer.next_body()
            if body is None:
                if with_fds and self._fds and not self._buffer.buffered:
                    # descriptors travel with the first byte of the frame that announces them: these came with none
                    raise RemoteProtocolError(f"{len(self._fds)} file descriptor(s) arrived that no frame announced")
                if self._eof:
                    self.phase = Phase.CLOSED
                    if self._buffer.buffered:
                        raise RemoteProtocolError(
                            f"stream ended inside a frame ({self._buffer.buffered} bytes pending)"
                        )
                return
            with gc_paused(len(body), keep=self.keep_decoded):
                frame = _decode_frame(decode_body(body))
            want = frame.fd_count if with_fds else 0  # 0 but for the frames that carry descriptors
            if want > len(self._fds):
                raise RemoteProtocolError(f"{frame.TYPE} announces {want} file descriptor(s), {len(self._fds)} arrived")
            self._on(RECV, frame)  # an illegal frame leaves its descriptors to release_fds
            fds, self._fds = self._fds[:want], self._fds[want:]
            if self.role is Role.SERVER and self.service is not None and self._misdirected(frame):
                yield Misdirected(frame, self.service), fds
            else:
                yield frame, fds

    def _misdirected(self, frame: Frame) -> bool:
        assert self.service is not None
        return bool(frame.REPLIES) and self.service not in frame.SERVICES

    # ------------------------------------------------------------------ outbound
    def send(self, frame: Frame) -> bytes:
        """Validate ``frame`` against the state, update the state, return its bytes. LocalProtocolError, the
        state unchanged, for a frame this side may not send now or one over the peer's announced
        ``max_frame_size``."""
        if self.role is Role.CLIENT and self.service is not None and self._misdirected(frame):
            raise LocalProtocolError(f"a wcache {self.service.value} does not serve {frame.TYPE}")
        data = pack_frame(frame.to_wire(), max_frame_size=MAX_REPRESENTABLE)
        limit = self.peer_max_frame_size
        if limit is not None and len(data) - 4 > limit:
            raise LocalProtocolError(
                f"{frame.TYPE} is {len(data) - 4} bytes, over the {limit} bytes the peer takes (its HELLO_OK "
                "max_frame_size, docs/protocol.md §7): nothing sent",
                details={"frame": frame.TYPE, "size": len(data) - 4, "max_size": limit},
            )
        self._on(SEND, frame)
        return data

    def retract(self, request: Frame) -> None:
        """Undo the reply just sent to ``request`` when none of its bytes left (the kernel refused its
        descriptors): the request is pending again, to be answered with an ERROR."""
        rid = getattr(request, "id", 0)
        if not request.REPLIES or rid in self.pending:
            raise LocalProtocolError(f"{request.TYPE} {rid} is not a request just answered: no reply to retract")
        self.pending[rid] = request.TYPE

    def next_request_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def hello_reply(self, hello: Hello, **fields: Any) -> HelloOk:
        """Server: choose the version for ``hello`` or raise UnsupportedVersionError."""
        common = set(hello.versions) & set(self.supported_versions)
        if not common:
            raise UnsupportedVersionError(
                f"no common protocol version: client offers {list(hello.versions)}, "
                f"daemon supports {list(self.supported_versions)}",
                details={"offered": list(hello.versions), "supported": list(self.supported_versions)},
            )
        return HelloOk(version=max(common), max_frame_size=self.max_frame_size, **fields)

    def fatal_error(self, exc: WCacheError, id: int = 0) -> bytes:
        """Bytes of a fatal ERROR frame for ``exc``; the connection is CLOSED afterwards."""
        return self.send(ErrorFrame.from_exception(exc, id, fatal=True))

    # ------------------------------------------------------------------ state
    def _on(self, direction: str, frame: Frame) -> None:
        t = frame.TYPE
        if isinstance(frame, ErrorFrame) and frame.fatal:
            if self.phase is Phase.CLOSED and direction == SEND:
                raise LocalProtocolError("connection is closed")
            self.phase = Phase.CLOSED
            return
        nxt = transitions(type(frame)).get((self.role, self.phase, direction))
        if nxt is Phase.OPEN and self.auth and t == "HELLO_OK":
            nxt = Phase.AUTH  # the shared-secret proofs come first (§10.2)
        if nxt is None:
            msg = f"{t} frame not allowed in phase {self.phase.value} ({self.role.value} {direction})"
            if direction == SEND:
                raise LocalProtocolError(msg)
            raise UnexpectedFrameError(msg, details={"type": t, "phase": self.phase.value})
        self._check_ids(direction, frame)
        self.phase = nxt

    def _check_ids(self, direction: str, frame: Frame) -> None:
        """Request/reply bookkeeping: ids pair replies with requests; STATE/RELEASED move leases."""
        if isinstance(frame, Hello):
            return
        err = LocalProtocolError if direction == SEND else UnexpectedFrameError
        if isinstance(frame, HelloOk):
            if frame.version not in self.supported_versions:
                raise err(
                    f"protocol version {frame.version} is not one this side speaks",
                    details={"chosen": frame.version, "supported": list(self.supported_versions)},
                )
            self.version = frame.version
            if direction == RECV:
                self.peer_max_frame_size = frame.max_frame_size
            return
        rid: int = getattr(frame, "id", 0)  # every frame but the handshake's has one
        if frame.REPLIES:  # a request
            if rid in self.pending:
                raise err(f"request id {rid} is already waiting for a reply")
            if len(self.pending) >= MAX_PENDING:
                raise err(f"more than {MAX_PENDING} requests waiting for replies")
            if isinstance(frame, Release) and direction == SEND and frame.lease not in self.leases:
                raise LocalProtocolError(f"lease {frame.lease} is not held on this connection")
            self.pending[rid] = frame.TYPE
            return
        if isinstance(frame, ErrorFrame) and rid == 0:
            return  # a connection-level error, answering no particular request
        req = self.pending.get(rid)
        if req is None or (not isinstance(frame, ErrorFrame) and frame.TYPE not in REGISTRY[req].REPLIES):
            raise err(f"{frame.TYPE} with id {rid} answers no pending request of that kind")
        del self.pending[rid]
        if direction == SEND:
            return  # a server's leases are its store's (one ledger), not the connection's
        if isinstance(frame, State):
            if frame.lease in self.leases:
                raise err(f"lease {frame.lease} granted twice on one connection")
            self.leases.add(frame.lease)
        elif frame.TYPE == "PEER_OFFER":  # every offered slab is held for this connection (§10.3)
            offer = cast("PeerOffer", frame)
            offered = {m.lease for m in offer.models}
            if offered & self.leases:
                raise err(f"lease(s) {sorted(offered & self.leases)} granted twice on one connection")
            self.leases |= offered
        elif isinstance(frame, Released):
            self.leases.discard(frame.lease)
