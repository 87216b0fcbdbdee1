"""The sans-I/O connection: bytes in, typed frames out; frames in, bytes out.

Everything that affects the connection's state lives in this module: the transition
table ``TRANSITIONS`` (docs/protocol.md §5), which service answers which requests
(``SERVES``), which frames bring file descriptors (``CARRIES_FDS``, docs/protocol.md §2.2),
the outstanding request ids, and (on a client) the leases the peer granted it. The asyncio server
and client only move bytes and descriptors between a socket and a :class:`Connection`. A server's leases
live in one ledger, its store's (wcache/server/store.py): its connections do not keep a second copy.

A server connection knows the service it speaks for (:class:`Service`): a request for another
service (a RECLAIM to a daemon, a GET_STATE to a keeper or a peer channel) comes out as
:class:`Misdirected`, carrying the non-fatal ``NOT_FOUND`` error to answer it with.

A peer channel in the shared-secret mode (``auth=True``, docs/protocol.md §10.2) passes through
``AUTH`` after the handshake: only the authentication frames may travel until PEER_AUTH_OK, and
frames stay as small as before the handshake.

Errors: a frame the *peer* may not send now raises :class:`UnexpectedFrameError`
(a :class:`ProtocolError`); a frame *we* may not send raises
:class:`LocalProtocolError`. Malformed bytes raise :class:`ProtocolError`. After any
of these from ``events()`` the connection should send ``fatal_error()`` and close.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from functools import reduce
from operator import or_
from typing import TYPE_CHECKING, Any, cast

from wcache.errors import (
    LocalProtocolError,
    NotFoundError,
    ProtocolError,
    UnexpectedFrameError,
    UnsupportedVersionError,
    WCacheError,
)
from wcache.proto.codec import (
    DEFAULT_MAX_FRAME_SIZE,
    MAX_HANDSHAKE_FRAME,
    MAX_REPRESENTABLE,
    FrameBuffer,
    decode_body,
    gc_paused,
    pack_frame,
)
from wcache.proto.daemon_frames import ErrorFrame, Hello, HelloOk, Release, Released, State

if TYPE_CHECKING:  # the request unions name every service's requests: built when first read (``__getattr__``)
    from wcache.proto.fleet_frames import PeerOffer  # the peer channel's: never on an engine's path
    from wcache.proto.frames import (
        Commit,
        Deposit,
        Evict,
        Frame,
        GetState,
        Keep,
        Preload,
        Reclaim,
        Status,
        Takeover,
        TakeoverAdopted,
        Unkeep,
    )

    DaemonRequest = GetState | Release | Status | Preload | Evict | Takeover | TakeoverAdopted | Deposit | Commit
    KeeperRequest = Keep | Unkeep | Reclaim | Status

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
]

#: The protocol version this implementation speaks (docs/protocol.md §3).
PROTOCOL_VERSION = 2
SUPPORTED_VERSIONS: tuple[int, ...] = (PROTOCOL_VERSION,)


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class Service(enum.Enum):
    """What a server speaks for: a daemon serves weights, a keeper holds slabs for daemons (§4.11), a peer
    channel offers a daemon's slabs to other daemons of a fleet over TCP (§10)."""

    DAEMON = "daemon"
    KEEPER = "keeper"
    PEER = "peer"


class Phase(enum.Enum):
    START = "start"  # nothing exchanged yet
    HELLO_SENT = "hello_sent"  # client: HELLO out, awaiting HELLO_OK
    HELLO_RECEIVED = "hello_received"  # server: HELLO in, must answer HELLO_OK or fatal ERROR
    AUTH = "auth"  # peer channel, shared-secret mode: HELLO_OK sent, proofs not yet exchanged (§10.2)
    OPEN = "open"  # requests and replies flow
    CLOSED = "closed"  # a fatal ERROR went either way, or the stream ended


SEND, RECV = "send", "recv"
#: (role, phase, direction, frame type) -> next phase. Absent = not allowed.
#: A fatal ERROR (either direction, any phase) always leads to CLOSED; see _after().
TRANSITIONS: dict[tuple[Role, Phase, str, str], Phase] = {
    (Role.CLIENT, Phase.START, SEND, "HELLO"): Phase.HELLO_SENT,
    (Role.CLIENT, Phase.HELLO_SENT, RECV, "HELLO_OK"): Phase.OPEN,
    # pipelining (docs/protocol.md §5.1): GET_STATE may follow HELLO before HELLO_OK is back, saving a round trip
    (Role.CLIENT, Phase.HELLO_SENT, SEND, "GET_STATE"): Phase.HELLO_SENT,
    (Role.CLIENT, Phase.OPEN, SEND, "GET_STATE"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, SEND, "RELEASE"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, SEND, "STATUS"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, SEND, "PRELOAD"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, SEND, "EVICT"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, SEND, "TAKEOVER"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "TAKEOVER_STATE"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, SEND, "TAKEOVER_ADOPTED"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "TAKEOVER_DONE"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "PRELOADED"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "EVICTED"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "STATE"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "RELEASED"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "STATUS_REPLY"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "ERROR"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, SEND, "KEEP"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, SEND, "UNKEEP"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, SEND, "RECLAIM"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "KEPT"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, SEND, "DEPOSIT"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "DEPOSIT_SLAB"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, SEND, "COMMIT"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "DEPOSITED"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "RECLAIMED"): Phase.OPEN,
    (Role.SERVER, Phase.START, RECV, "HELLO"): Phase.HELLO_RECEIVED,
    (Role.SERVER, Phase.HELLO_RECEIVED, SEND, "HELLO_OK"): Phase.OPEN,
    # a pipelined GET_STATE, answered after HELLO_OK (the server answers in order)
    (Role.SERVER, Phase.HELLO_RECEIVED, RECV, "GET_STATE"): Phase.HELLO_RECEIVED,
    (Role.SERVER, Phase.OPEN, RECV, "GET_STATE"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "RELEASE"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "STATUS"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "PRELOAD"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "EVICT"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "TAKEOVER"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "TAKEOVER_STATE"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "TAKEOVER_ADOPTED"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "TAKEOVER_DONE"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "PRELOADED"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "EVICTED"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "STATE"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "RELEASED"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "STATUS_REPLY"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "ERROR"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "KEEP"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "UNKEEP"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "RECLAIM"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "KEPT"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "DEPOSIT"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "DEPOSIT_SLAB"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "COMMIT"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "DEPOSITED"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "RECLAIMED"): Phase.OPEN,
    # the peer channel (§10): authentication in the shared-secret mode, then fills
    (Role.CLIENT, Phase.AUTH, SEND, "PEER_AUTH"): Phase.AUTH,
    (Role.CLIENT, Phase.AUTH, RECV, "PEER_CHALLENGE"): Phase.AUTH,
    (Role.CLIENT, Phase.AUTH, SEND, "PEER_PROOF"): Phase.AUTH,
    (Role.CLIENT, Phase.AUTH, RECV, "PEER_AUTH_OK"): Phase.OPEN,
    (Role.SERVER, Phase.AUTH, RECV, "PEER_AUTH"): Phase.AUTH,
    (Role.SERVER, Phase.AUTH, SEND, "PEER_CHALLENGE"): Phase.AUTH,
    (Role.SERVER, Phase.AUTH, RECV, "PEER_PROOF"): Phase.AUTH,
    (Role.SERVER, Phase.AUTH, SEND, "PEER_AUTH_OK"): Phase.OPEN,
    # a refused proof (PERMISSION_DENIED): the connection stays unproven, admitting nothing but proofs
    (Role.CLIENT, Phase.AUTH, RECV, "ERROR"): Phase.AUTH,
    (Role.SERVER, Phase.AUTH, SEND, "ERROR"): Phase.AUTH,
    (Role.CLIENT, Phase.OPEN, SEND, "PEER_QUERY"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "PEER_OFFER"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, SEND, "PEER_READ"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "PEER_READ_OK"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, SEND, "PEER_FILES"): Phase.OPEN,
    (Role.CLIENT, Phase.OPEN, RECV, "PEER_FILES_REPLY"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "PEER_QUERY"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "PEER_OFFER"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "PEER_READ"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "PEER_READ_OK"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, RECV, "PEER_FILES"): Phase.OPEN,
    (Role.SERVER, Phase.OPEN, SEND, "PEER_FILES_REPLY"): Phase.OPEN,
}

#: Request type -> the reply type that answers it (ERROR answers any request).
REPLY_TO: dict[str, str] = {
    "GET_STATE": "STATE",
    "RELEASE": "RELEASED",
    "STATUS": "STATUS_REPLY",
    "PRELOAD": "PRELOADED",
    "EVICT": "EVICTED",
    "TAKEOVER": "TAKEOVER_STATE",
    "TAKEOVER_ADOPTED": "TAKEOVER_DONE",
    "KEEP": "KEPT",
    "UNKEEP": "KEPT",
    "RECLAIM": "RECLAIMED",
    "DEPOSIT": "DEPOSIT_SLAB",
    "COMMIT": "DEPOSITED",
    "PEER_AUTH": "PEER_CHALLENGE",
    "PEER_PROOF": "PEER_AUTH_OK",
    "PEER_QUERY": "PEER_OFFER",
    "PEER_READ": "PEER_READ_OK",
    "PEER_FILES": "PEER_FILES_REPLY",
}
#: The requests each service answers; a server with a service answers the others' with NOT_FOUND.
SERVES: dict[Service, frozenset[str]] = {
    Service.DAEMON: frozenset(
        {"GET_STATE", "RELEASE", "STATUS", "PRELOAD", "EVICT", "TAKEOVER", "TAKEOVER_ADOPTED", "DEPOSIT", "COMMIT"}
    ),
    Service.KEEPER: frozenset({"KEEP", "UNKEEP", "RECLAIM", "STATUS"}),
    Service.PEER: frozenset({"PEER_AUTH", "PEER_PROOF", "PEER_QUERY", "PEER_READ", "PEER_FILES", "RELEASE"}),
}
#: Frames that bring file descriptors (``fd_count`` of them, docs/protocol.md §2.2); no other frame may.
CARRIES_FDS = frozenset({"STATE", "TAKEOVER_STATE", "KEEP", "RECLAIMED", "DEPOSIT_SLAB"})
#: The requests of each service, by frame type (the unions above, for runtime use: ``__getattr__``)
_UNIONS = {
    "DaemonRequest": (
        "GET_STATE",
        "RELEASE",
        "STATUS",
        "PRELOAD",
        "EVICT",
        "TAKEOVER",
        "TAKEOVER_ADOPTED",
        "DEPOSIT",
        "COMMIT",
    ),
    "KeeperRequest": ("KEEP", "UNKEEP", "RECLAIM", "STATUS"),
}
#: How many requests may wait for a reply on one connection.
MAX_PENDING = 64


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


if TYPE_CHECKING:
    #: What a connection yields: a frame, or a request the server does not serve.
    Event = Frame | Misdirected


def __getattr__(name: str) -> Any:
    """``DaemonRequest``, ``KeeperRequest`` and ``Event`` at run time (they import every frame module; any other
    name, ``__path__`` that ``from ... import`` looks for included, imports nothing)."""
    types = _UNIONS.get(name)
    if types is None and name != "Event":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from wcache.proto import frames

    if types is None:
        return frames.Frame | Misdirected
    registry = frames.load_frames()
    return reduce(or_, (registry[t] for t in types))


def _decode_frame() -> Callable[[Any], Frame]:
    """``frames.decode_frame``: the registry is imported with the first frame received, not with this module (a
    client's first frame is the HELLO_OK: an engine loads the registry while the daemon answers, not before its
    HELLO is out)."""
    from wcache.proto.frames import decode_frame

    return decode_frame


class Connection:
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
    ) -> None:
        """``max_frame_size``: the largest frame body accepted once the handshake is done;
        ``max_handshake_frame``: before it (HELLO / HELLO_OK), so that a peer that has not even said HELLO
        cannot make this side buffer a big body (docs/protocol.md §7). ``auth``: a peer channel in the
        shared-secret mode: AUTH follows the handshake (§10.2)."""
        if auth and service not in (None, Service.PEER):
            raise ValueError("only the peer channel authenticates in the protocol")
        self.role = role
        self.service = service
        self.auth = auth
        self.phase = Phase.START
        self.version: int | None = None
        self.supported_versions = supported_versions
        self.max_frame_size = max_frame_size
        #: request id -> request frame type, for requests awaiting a reply
        self.pending: dict[int, str] = {}
        #: leases the peer granted this side (a STATE received) and has not ended (its RELEASED): a client's
        #: record of what it may RELEASE. Empty on a server: it grants leases, and its store is their ledger
        self.leases: set[int] = set()
        self.max_handshake_frame = min(max_handshake_frame, max_frame_size)
        # a client assembles a big frame (a STATE) where its reader receives it: codec.FrameBuffer's ``direct``
        self._buffer = FrameBuffer(max_frame_size, direct=role is Role.CLIENT)
        self._eof = False
        self._next_id = 1
        #: descriptors received and not yet handed out with a frame (this connection's until released)
        self._fds: list[int] = []

    # ------------------------------------------------------------------ inbound
    @property
    def accepts_fds(self) -> bool:
        """Whether any frame this side may receive brings descriptors (a daemon's clients never send any)."""
        if self.role is Role.CLIENT or self.service is None:
            return True
        return bool(SERVES[self.service] & CARRIES_FDS)

    def receive_data(self, data: bytes | bytearray | memoryview, fds: Iterable[int] = ()) -> None:
        """Feed bytes from the peer, with the descriptors that came with them (SCM_RIGHTS); ``b""`` marks
        the end of the stream. The descriptors are the connection's from here on: each goes out with the
        frame that announces it, and :meth:`release_fds` returns the rest for closing. ProtocolError when
        this peer may not send descriptors at all."""
        if fds:
            self._fds.extend(fds)
            if not self.accepts_fds:
                raise ProtocolError("this peer may not send file descriptors")
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
            self._fds.extend(fds)
            if not self.accepts_fds:
                raise ProtocolError("this peer may not send file descriptors")
        self._buffer.filled(n)

    def release_fds(self) -> list[int]:
        """Every descriptor received and not handed out with a frame through :meth:`received` (for the
        owner to close: on close, or after an error)."""
        out, self._fds = self._fds, []
        return out

    @property
    def buffered(self) -> int:
        return self._buffer.buffered

    @property
    def demand(self) -> int:
        """Bytes held once the frame in progress is complete (its announced length, checked first)."""
        return self._buffer.demand

    @property
    def frame_limit(self) -> int:
        """The largest frame body accepted now: small until the handshake is done."""
        return self.max_frame_size if self.phase is Phase.OPEN else self.max_handshake_frame

    def _set_limit(self) -> None:
        buf = self._buffer
        buf.max_frame_size = self.frame_limit
        buf.limit_reason = "" if self.phase is Phase.OPEN else "before the handshake (HELLO / HELLO_OK are small)"

    @property
    def eof(self) -> bool:
        return self._eof

    def events(self) -> Iterator[Event]:
        """Like :meth:`received`, for callers that move no descriptors (pure tests, fuzzers): frames only,
        no descriptor accounting (descriptors given to receive_data stay with the connection: release_fds)."""
        for event, _ in self._decode(with_fds=False):
            yield event

    def received(self) -> Iterator[tuple[Event, list[int]]]:
        """Yield each complete frame received so far, validated against the state, with the descriptors it
        announces (``fd_count``; the caller owns them).

        Raises ProtocolError (or a subclass) on malformed bytes, an illegal frame, a frame announcing more
        descriptors than arrived, or descriptors that no frame announces. A stream that ends inside a frame
        raises ProtocolError too.
        """
        return self._decode(with_fds=True)

    def _decode(self, *, with_fds: bool) -> Iterator[tuple[Event, list[int]]]:
        while self.phase is not Phase.CLOSED:
            self._set_limit()  # the phase may have changed with the previous frame
            body = self._buffer.next_body()
            if body is None:
                if with_fds and self._fds and not self._buffer.buffered:
                    # descriptors travel with the first byte of the frame that announces them: these came with none
                    raise ProtocolError(f"{len(self._fds)} file descriptor(s) arrived that no frame announced")
                if self._eof:
                    self.phase = Phase.CLOSED
                    if self._buffer.buffered:
                        raise ProtocolError(f"stream ended inside a frame ({self._buffer.buffered} bytes pending)")
                return
            with gc_paused(len(body)):
                frame = _decode_frame()(decode_body(body))
            want = frame.fd_count if with_fds and frame.TYPE in CARRIES_FDS else 0
            if want > len(self._fds):
                raise ProtocolError(f"{frame.TYPE} announces {want} file descriptor(s), {len(self._fds)} arrived")
            self._on(RECV, frame)  # an illegal frame leaves its descriptors to release_fds
            fds, self._fds = self._fds[:want], self._fds[want:]
            if self.role is Role.SERVER and self.service is not None and self._misdirected(frame):
                yield Misdirected(frame, self.service), fds
            else:
                yield frame, fds

    def _misdirected(self, frame: Frame) -> bool:
        assert self.service is not None
        return frame.TYPE in REPLY_TO and frame.TYPE not in SERVES[self.service]

    # ------------------------------------------------------------------ outbound
    def send(self, frame: Frame) -> bytes:
        """Validate ``frame`` against the state, update the state, return its bytes."""
        if self.role is Role.CLIENT and self.service is not None and self._misdirected(frame):
            raise LocalProtocolError(f"a wcache {self.service.value} does not serve {frame.TYPE}")
        self._on(SEND, frame)
        return pack_frame(frame.to_wire(), max_frame_size=MAX_REPRESENTABLE)

    def retract(self, request: Frame) -> None:
        """Undo the reply just sent to ``request`` when none of its bytes left (the kernel refused its
        descriptors): the request is pending again, to be answered with an ERROR."""
        rid = getattr(request, "id", 0)
        if request.TYPE not in REPLY_TO or rid in self.pending:
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
        nxt = TRANSITIONS.get((self.role, self.phase, direction, t))
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
            return
        rid = frame.id
        if frame.TYPE in REPLY_TO:  # a request
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
        if req is None or (not isinstance(frame, ErrorFrame) and REPLY_TO[req] != frame.TYPE):
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
