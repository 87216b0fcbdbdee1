"""The sans-I/O connection: handshake, version negotiation, request/reply pairing, leases."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any, get_args

import pytest

from wcache.errors import (
    ErrorCode,
    LocalProtocolError,
    PermissionDeniedError,
    ProtocolError,
    RemoteProtocolError,
    UnexpectedFrameError,
    UnsupportedVersionError,
)
from wcache.proto import (
    PROTOCOL_VERSION,
    Connection,
    DeviceInfo,
    ErrorFrame,
    GetState,
    Hello,
    HelloOk,
    Misdirected,
    Phase,
    Release,
    Released,
    Role,
    Service,
    Status,
    connection,
    pack_frame,
)
from wcache.proto.connection import transitions
from wcache.proto.examples import EXAMPLES
from wcache.proto.fields import REGISTRY, Frame, Int, Message, Str, message, wire
from wcache.proto.frames import FRAME_TYPES, decode_frame, load_frames


def _ok(version: int = PROTOCOL_VERSION) -> HelloOk:
    return HelloOk(version=version, software="t", backend="host", device=DeviceInfo("cpu"), max_frame_size=1 << 20)


def _open_pair() -> tuple[Connection, Connection]:
    c, s = Connection(Role.CLIENT), Connection(Role.SERVER)
    s.receive_data(c.send(Hello(versions=(PROTOCOL_VERSION,))))
    (hello,) = s.events()
    assert isinstance(hello, Hello)
    c.receive_data(s.send(s.hello_reply(hello, software="t", backend="host", device=DeviceInfo("cpu"))))
    assert [f.TYPE for f in c.events()] == ["HELLO_OK"]
    assert c.phase is s.phase is Phase.OPEN
    assert c.version == s.version == PROTOCOL_VERSION
    return c, s


def test_handshake_and_request_cycle() -> None:
    c, s = _open_pair()
    s.receive_data(c.send(EXAMPLES["GET_STATE"]))
    assert list(s.events()) == [EXAMPLES["GET_STATE"]]
    c.receive_data(s.send(EXAMPLES["STATE"]))
    assert list(c.events()) == [EXAMPLES["STATE"]]
    assert c.leases == {1001}
    assert s.leases == set()  # a server's leases are its store's, one ledger (wcache/server/store.py)
    s.receive_data(c.send(Release(id=2, lease=1001)))
    list(s.events())
    c.receive_data(s.send(Released(id=2, lease=1001)))
    list(c.events())
    assert c.leases == s.leases == set()
    assert c.pending == s.pending == {}


def test_a_request_over_the_limit_the_server_announced_is_refused_before_it_is_sent() -> None:
    """HELLO_OK announces the largest frame body the server takes (``max_frame_size``; a daemon's is 1 MiB): a
    client refuses to send a bigger request (LocalProtocolError naming both sizes, nothing pending), where it
    used to send it and lose the connection to the server's fatal FRAME_TOO_LARGE; a body of exactly the limit,
    and any request within it, still goes out."""
    c, s = Connection(Role.CLIENT), Connection(Role.SERVER, max_frame_size=512)
    s.receive_data(c.send(Hello(versions=(PROTOCOL_VERSION,))))
    (hello,) = s.events()
    assert isinstance(hello, Hello)
    c.receive_data(s.send(s.hello_reply(hello, software="t", backend="host", device=DeviceInfo("cpu"))))
    list(c.events())

    def get_state(rid: int, size: int) -> GetState:  # a GET_STATE whose body is ``size`` bytes
        return next(
            f for n in range(size) if len(pack_frame((f := GetState(id=rid, key={"k": "x" * n})).to_wire())) == size + 4
        )

    with pytest.raises(LocalProtocolError, match="513 bytes, over the 512 bytes"):
        c.send(get_state(1, 513))
    assert c.pending == {} and c.phase is Phase.OPEN
    s.receive_data(c.send(get_state(1, 512)))
    assert [f.TYPE for f in s.events()] == ["GET_STATE"]


def test_a_retracted_reply_leaves_its_request_pending_for_an_error() -> None:
    """A STATE whose descriptors the kernel refused never left: retract() makes its GET_STATE pending again, the
    ERROR that answers it is legal, and the client never held the lease."""
    c, s = _open_pair()
    s.receive_data(c.send(EXAMPLES["GET_STATE"]))
    (request,) = s.events()
    assert isinstance(request, GetState)
    s.send(EXAMPLES["STATE"])
    assert s.pending == {}
    s.retract(request)
    assert s.pending == {request.id: "GET_STATE"}
    c.receive_data(s.send(ErrorFrame(id=request.id, code=ErrorCode.LIMIT_EXCEEDED, message="in flight")))
    assert [f.TYPE for f in c.events()] == ["ERROR"] and c.leases == set() and c.pending == {}
    with pytest.raises(LocalProtocolError):
        s.retract(EXAMPLES["STATE"])  # not a request


def test_version_negotiation_picks_highest_common() -> None:
    s = Connection(Role.SERVER, supported_versions=(1, 2, 3))
    assert s.hello_reply(Hello(versions=(2, 1, 9)), software="", backend="host", device=DeviceInfo("cpu")).version == 2


def test_unsupported_version() -> None:
    s = Connection(Role.SERVER)
    with pytest.raises(UnsupportedVersionError) as info:
        s.hello_reply(Hello(versions=(7, 8)), software="", backend="host", device=DeviceInfo("cpu"))
    assert info.value.details == {"offered": [7, 8], "supported": [PROTOCOL_VERSION]}
    s.receive_data(Connection(Role.CLIENT).send(Hello(versions=(7,))))
    list(s.events())
    data = s.fatal_error(info.value)
    assert s.phase is Phase.CLOSED
    c = Connection(Role.CLIENT)
    c.send(Hello(versions=(7,)))
    c.receive_data(data)
    (err,) = c.events()
    assert isinstance(err, ErrorFrame) and err.fatal and err.code == 3
    assert c.phase is Phase.CLOSED


def test_client_rejects_version_it_did_not_offer() -> None:
    raw = pack_frame(_ok(5).to_wire())
    c = Connection(Role.CLIENT)
    c.send(Hello(versions=(PROTOCOL_VERSION,)))
    c.receive_data(raw)
    with pytest.raises(UnexpectedFrameError, match="version 5"):
        list(c.events())


@pytest.mark.parametrize("frame", [EXAMPLES["GET_STATE"], EXAMPLES["STATUS"], EXAMPLES["RELEASE"]])
def test_request_before_hello_is_unexpected(frame: object) -> None:
    s = Connection(Role.SERVER)
    s.receive_data(pack_frame(frame.to_wire()))  # type: ignore[attr-defined]  # a client skipping HELLO
    with pytest.raises(UnexpectedFrameError):
        list(s.events())


def test_server_may_not_send_state_unasked() -> None:
    _, s = _open_pair()
    with pytest.raises(LocalProtocolError):
        s.send(EXAMPLES["STATE"])


def test_client_rejects_unsolicited_reply() -> None:
    c, _ = _open_pair()
    other = Connection(Role.SERVER)
    other.phase = Phase.OPEN
    other.pending[1] = "GET_STATE"
    c.receive_data(other.send(EXAMPLES["STATE"]))
    with pytest.raises(UnexpectedFrameError, match="answers no pending request"):
        list(c.events())


def test_reply_type_must_match_request() -> None:
    c, s = _open_pair()
    s.receive_data(c.send(Status(id=5)))
    list(s.events())
    s.pending[5] = "RELEASE"  # make the server believe otherwise, so it sends a mismatched reply
    c.receive_data(s.send(Released(id=5, lease=1)))
    with pytest.raises(UnexpectedFrameError):
        list(c.events())


def test_duplicate_request_id() -> None:
    c, s = _open_pair()
    c.send(Status(id=9))
    with pytest.raises(LocalProtocolError, match="already waiting"):
        c.send(Status(id=9))


def test_release_of_unknown_lease_is_local_error() -> None:
    c, _ = _open_pair()
    with pytest.raises(LocalProtocolError, match="not held"):
        c.send(Release(id=3, lease=42))


def test_pending_limit() -> None:
    c, _ = _open_pair()
    for i in range(1, 65):
        c.send(Status(id=i))
    with pytest.raises(LocalProtocolError, match="more than 64"):
        c.send(Status(id=65))


def test_error_answers_pending_request_and_connection_stays_open() -> None:
    c, s = _open_pair()
    s.receive_data(c.send(GetState(id=1, key={})))
    list(s.events())
    c.receive_data(s.send(ErrorFrame(id=1, code=21, message="nope")))
    (err,) = c.events()
    assert isinstance(err, ErrorFrame) and not err.fatal
    assert c.phase is Phase.OPEN and c.pending == {}


def test_eof_inside_frame() -> None:
    s = Connection(Role.SERVER)
    data = Connection(Role.CLIENT).send(Hello(versions=(PROTOCOL_VERSION,)))
    s.receive_data(data[:-3])
    s.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="stream ended inside a frame"):
        list(s.events())
    assert s.phase is Phase.CLOSED


def test_clean_eof() -> None:
    s = Connection(Role.SERVER)
    s.receive_data(b"")
    assert list(s.events()) == []
    assert s.eof and s.phase is Phase.CLOSED


def test_nothing_after_fatal_error() -> None:
    _, s = _open_pair()
    s.fatal_error(ProtocolError("bye"))
    with pytest.raises(LocalProtocolError):
        s.send(ErrorFrame(id=0, code=1, message="again", fatal=True))


def _served(service: Service) -> tuple[Connection, Connection]:
    c, s = Connection(Role.CLIENT), Connection(Role.SERVER, service=service)
    s.receive_data(c.send(Hello(versions=(PROTOCOL_VERSION,))))
    (hello,) = s.events()
    assert isinstance(hello, Hello)
    c.receive_data(s.send(s.hello_reply(hello, software="t", backend="host", device=DeviceInfo("cpu"))))
    list(c.events())
    return c, s


@pytest.mark.parametrize(
    ("service", "request_name"),
    [(Service.DAEMON, "RECLAIM"), (Service.DAEMON, "UNKEEP"), (Service.KEEPER, "GET_STATE")],
)
def test_a_request_for_the_other_service_is_misdirected_not_fatal(service: Service, request_name: str) -> None:
    """The daemon and keeper dispatchers no longer reject each other's requests by hand: the connection marks
    them, with the NOT_FOUND to answer; the id is pending, so that ERROR is legal and the connection serves on."""
    c, s = _served(service)
    s.receive_data(c.send(EXAMPLES[request_name]))
    (event,) = s.events()
    assert isinstance(event, Misdirected) and event.request == EXAMPLES[request_name]
    assert event.error.code is ErrorCode.NOT_FOUND and event.error.details["service"] == service.value
    c.receive_data(s.send(ErrorFrame.from_exception(event.error, event.id)))
    (reply,) = c.events()
    assert isinstance(reply, ErrorFrame) and not reply.fatal and s.phase is Phase.OPEN
    s.receive_data(c.send(Status(id=99)))
    assert list(s.events()) == [Status(id=99)]  # both services answer STATUS


def test_a_client_naming_its_service_cannot_send_the_other_ones_requests() -> None:
    c, s = Connection(Role.CLIENT, service=Service.KEEPER), Connection(Role.SERVER)
    s.receive_data(c.send(Hello(versions=(PROTOCOL_VERSION,))))
    (hello,) = s.events()
    assert isinstance(hello, Hello)
    c.receive_data(s.send(s.hello_reply(hello, software="t", backend="host", device=DeviceInfo("cpu"))))
    list(c.events())
    c.send(EXAMPLES["RECLAIM"])
    with pytest.raises(LocalProtocolError, match="does not serve GET_STATE"):
        c.send(EXAMPLES["GET_STATE"])


def test_descriptors_go_with_the_frame_that_announces_them() -> None:
    """receive_data(data, fds): STATE takes fd_count of them; a daemon refuses any; unannounced ones are an error."""
    c, s = _open_pair()
    s.receive_data(c.send(EXAMPLES["GET_STATE"]))
    list(s.events())
    data = s.send(EXAMPLES["STATE"])
    c.receive_data(data[:1], [7])
    c.receive_data(data[1:], [8])  # one more than STATE announces, with no frame after it
    with pytest.raises(RemoteProtocolError, match="no frame announced"):
        list(c.received())
    assert c.release_fds() == [8]

    daemon = Connection(Role.SERVER, service=Service.DAEMON)
    assert not daemon.accepts_fds and Connection(Role.SERVER, service=Service.KEEPER).accepts_fds
    with pytest.raises(RemoteProtocolError, match="may not send file descriptors"):
        daemon.receive_data(b"\x00", [5])
    assert daemon.release_fds() == [5]  # still the owner's to close


def test_a_frame_announcing_more_descriptors_than_arrived_is_refused() -> None:
    c, s = _open_pair()
    s.receive_data(c.send(EXAMPLES["GET_STATE"]))
    list(s.events())
    c.receive_data(s.send(EXAMPLES["STATE"]))
    with pytest.raises(RemoteProtocolError, match="announces 1 file descriptor"):
        list(c.received())


def test_a_deposit_cycle_pairs_and_its_slab_brings_one_descriptor() -> None:
    """DEPOSIT -> DEPOSIT_SLAB (one fd) -> COMMIT -> DEPOSITED (docs/protocol.md §4.13); a daemon serves both
    requests and still refuses descriptors from its clients."""
    c, s = Connection(Role.CLIENT), Connection(Role.SERVER, service=Service.DAEMON)
    s.receive_data(c.send(Hello(versions=(PROTOCOL_VERSION,))))
    (hello,) = s.events()
    assert isinstance(hello, Hello)
    c.receive_data(s.send(s.hello_reply(hello, software="t", backend="host", device=DeviceInfo("cpu"))))
    list(c.events())
    assert not s.accepts_fds
    s.receive_data(c.send(EXAMPLES["DEPOSIT"]))
    assert list(s.events()) == [EXAMPLES["DEPOSIT"]]  # served, not Misdirected
    c.receive_data(s.send(EXAMPLES["DEPOSIT_SLAB"]), [9])
    ((slab, fds),) = list(c.received())
    assert slab == EXAMPLES["DEPOSIT_SLAB"] and fds == [9]
    s.receive_data(c.send(EXAMPLES["COMMIT"]))
    assert list(s.events()) == [EXAMPLES["COMMIT"]]
    c.receive_data(s.send(EXAMPLES["DEPOSITED"]))
    assert list(c.events()) == [EXAMPLES["DEPOSITED"]]
    assert c.pending == s.pending == {}
    with pytest.raises(LocalProtocolError):  # DEPOSITED answers a COMMIT, nothing else
        s.send(EXAMPLES["DEPOSITED"])


def test_get_state_pipelined_behind_hello_is_answered_after_hello_ok() -> None:
    """§5.1 pipelining: the client sends HELLO and GET_STATE in one write; the server takes both, answers
    HELLO_OK first, then STATE; both sides end OPEN with the lease held."""
    c, s = Connection(Role.CLIENT), Connection(Role.SERVER)
    get_state = EXAMPLES["GET_STATE"]
    assert isinstance(get_state, GetState)
    data = c.send(Hello(versions=(PROTOCOL_VERSION,))) + c.send(get_state)
    assert c.phase is Phase.HELLO_SENT and c.pending == {get_state.id: "GET_STATE"}
    s.receive_data(data)
    hello, request = list(s.events())
    assert isinstance(hello, Hello) and request == EXAMPLES["GET_STATE"]
    with pytest.raises(LocalProtocolError):  # the reply may not overtake HELLO_OK
        s.send(EXAMPLES["STATE"])
    out = s.send(s.hello_reply(hello, software="t", backend="host", device=DeviceInfo("cpu")))
    out += s.send(EXAMPLES["STATE"])
    c.receive_data(out)
    assert [f.TYPE for f in c.events()] == ["HELLO_OK", "STATE"]
    assert c.phase is s.phase is Phase.OPEN and c.leases == {1001} and s.leases == set()


@pytest.mark.parametrize("frame", [EXAMPLES["STATUS"], EXAMPLES["PRELOAD"], EXAMPLES["DEPOSIT"]])
def test_only_get_state_may_be_pipelined(frame: object) -> None:
    """Other requests wait for HELLO_OK: the client refuses to send them, the server to take them."""
    c = Connection(Role.CLIENT)
    hello = c.send(Hello(versions=(PROTOCOL_VERSION,)))
    with pytest.raises(LocalProtocolError):
        c.send(frame)  # type: ignore[arg-type]
    s = Connection(Role.SERVER)
    s.receive_data(hello + pack_frame(frame.to_wire()))  # type: ignore[attr-defined]
    with pytest.raises(UnexpectedFrameError):
        list(s.events())


def test_a_refused_hello_drops_the_pipelined_request() -> None:
    """A HELLO the server refuses (no common version) closes the connection with a fatal ERROR: the pipelined
    GET_STATE is never answered, and the client sees the ERROR, not a STATE."""
    c, s = Connection(Role.CLIENT), Connection(Role.SERVER, supported_versions=(PROTOCOL_VERSION + 1,))
    s.receive_data(c.send(Hello(versions=(PROTOCOL_VERSION,))) + c.send(EXAMPLES["GET_STATE"]))
    hello = next(iter(s.events()))
    assert isinstance(hello, Hello)
    with pytest.raises(UnsupportedVersionError) as err:
        s.hello_reply(hello)
    c.receive_data(s.fatal_error(err.value))
    (reply,) = list(c.events())
    assert isinstance(reply, ErrorFrame) and reply.fatal and c.phase is s.phase is Phase.CLOSED


# --------------------------------------------------------------------------- the peer channel (docs/protocol.md §10)


def _peer_pair(*, auth: bool) -> tuple[Connection, Connection]:
    c = Connection(Role.CLIENT, service=Service.PEER, auth=auth)
    s = Connection(Role.SERVER, service=Service.PEER, auth=auth)
    s.receive_data(c.send(Hello(versions=(PROTOCOL_VERSION,))))
    (hello,) = s.events()
    assert isinstance(hello, Hello)
    c.receive_data(s.send(s.hello_reply(hello, software="t", backend="host", device=DeviceInfo("cpu"))))
    assert [f.TYPE for f in c.events()] == ["HELLO_OK"]
    return c, s


def _exchange(c: Connection, s: Connection, request: str, reply: str) -> None:
    s.receive_data(c.send(EXAMPLES[request]))
    assert [f.TYPE for f in s.events()] == [request]
    c.receive_data(s.send(EXAMPLES[reply]))
    assert [f.TYPE for f in c.events()] == [reply]


def test_a_shared_secret_peer_channel_authenticates_before_any_request() -> None:
    c, s = _peer_pair(auth=True)
    assert c.phase is s.phase is Phase.AUTH
    assert c.frame_limit == s.frame_limit == 64 * 1024  # an unproven peer sends small frames only
    with pytest.raises(LocalProtocolError):
        c.send(EXAMPLES["PEER_QUERY"])
    early = Connection(Role.SERVER, service=Service.PEER, auth=True)
    early.receive_data(Connection(Role.CLIENT).send(Hello(versions=(PROTOCOL_VERSION,))))
    list(early.events())
    early.send(_ok())
    early.receive_data(pack_frame(EXAMPLES["PEER_QUERY"].to_wire()))
    with pytest.raises(UnexpectedFrameError) as err:
        list(early.events())  # a query before the proofs: no offer, no NIXL metadata
    assert err.value.details["phase"] == "auth"
    _exchange(c, s, "PEER_AUTH", "PEER_CHALLENGE")
    assert c.phase is s.phase is Phase.AUTH
    _exchange(c, s, "PEER_PROOF", "PEER_AUTH_OK")
    assert [c.phase, s.phase] == [Phase.OPEN, Phase.OPEN]


def test_a_failed_proof_closes_the_peer_channel() -> None:
    c, s = _peer_pair(auth=True)
    _exchange(c, s, "PEER_AUTH", "PEER_CHALLENGE")
    s.receive_data(c.send(EXAMPLES["PEER_PROOF"]))
    list(s.events())
    c.receive_data(s.fatal_error(PermissionDeniedError("not this fleet's secret"), id=2))
    (err,) = c.events()
    assert isinstance(err, ErrorFrame) and err.fatal and err.code == ErrorCode.PERMISSION_DENIED
    assert c.phase is s.phase is Phase.CLOSED


def test_peer_offers_hold_leases_until_release() -> None:
    c, s = _peer_pair(auth=False)
    assert c.phase is s.phase is Phase.OPEN  # mutual TLS authenticated the connection already
    _exchange(c, s, "PEER_QUERY", "PEER_OFFER")
    assert c.leases == {77} and not s.leases  # the source's ledger is its handler's, not the connection's
    _exchange(c, s, "PEER_READ", "PEER_READ_OK")
    _exchange(c, s, "PEER_FILES", "PEER_FILES_REPLY")
    s.receive_data(c.send(Release(id=9, lease=77)))
    (rel,) = s.events()
    assert isinstance(rel, Release)
    c.receive_data(s.send(Released(id=9, lease=77)))
    list(c.events())
    assert not c.leases and not s.leases and not c.pending and not s.pending
    with pytest.raises(LocalProtocolError):
        c.send(Release(id=10, lease=77))


def test_the_peer_channel_misdirects_daemon_requests_and_only_it_authenticates() -> None:
    c, s = _peer_pair(auth=False)
    s.receive_data(pack_frame(GetState(id=1, key={}).to_wire()))
    (ev,) = s.events()
    assert isinstance(ev, Misdirected) and ev.error.code == ErrorCode.NOT_FOUND
    assert "peer" in ev.error.message
    with pytest.raises(ValueError, match="peer channel"):
        Connection(Role.SERVER, service=Service.DAEMON, auth=True)


# --------------------------------------------------------------------------- the tables, derived from the frames


@pytest.fixture
def toy_frames() -> Iterator[tuple[Any, Any]]:
    """A request and its reply that no frame module declares: registered for the test, then gone."""

    @message("TOY_HOLD", reply="TOY_HELD", service=Service.KEEPER)
    class ToyHold(Frame):
        id: int = wire(Int(lo=1))
        what: str = wire(Str())

    @message("TOY_HELD")
    class ToyHeld(Frame):
        id: int = wire(Int(lo=1))
        slabs: int = wire(Int(hi=4))

        @property
        def fd_count(self) -> int:
            return self.slabs

    try:
        yield ToyHold, ToyHeld
    finally:
        del REGISTRY["TOY_HOLD"], REGISTRY["TOY_HELD"]


def test_a_new_frame_is_one_declaration(toy_frames: tuple[Any, Any]) -> None:
    """A request and its reply declared with ``@message``, and nowhere else, are in every table: the decoder's,
    both ends' transitions, the requests of the service that answers it and its union, the frames that bring
    descriptors; a client and a keeper exchange them, and a daemon answers the request NOT_FOUND."""
    hold, held = toy_frames
    assert FRAME_TYPES["TOY_HOLD"] is toy_frames[0]
    assert decode_frame({"type": "TOY_HELD", "id": 1, "slabs": 2}) == held(id=1, slabs=2)
    assert {row: after for row, after in connection.TRANSITIONS.items() if row[3].startswith("TOY_")} == {
        (Role.CLIENT, Phase.OPEN, "send", "TOY_HOLD"): Phase.OPEN,
        (Role.SERVER, Phase.OPEN, "recv", "TOY_HOLD"): Phase.OPEN,
        (Role.SERVER, Phase.OPEN, "send", "TOY_HELD"): Phase.OPEN,
        (Role.CLIENT, Phase.OPEN, "recv", "TOY_HELD"): Phase.OPEN,
    }
    serves = connection.SERVES
    assert "TOY_HOLD" in serves[Service.KEEPER] and "TOY_HOLD" not in serves[Service.DAEMON] | serves[Service.PEER]
    assert "TOY_HELD" in connection.CARRIES_FDS and "TOY_HOLD" not in connection.CARRIES_FDS
    assert hold in get_args(connection.KeeperRequest) and hold not in get_args(connection.DaemonRequest)

    c, s = _served(Service.KEEPER)
    s.receive_data(c.send(hold(id=5, what="x")))
    assert list(s.events()) == [hold(id=5, what="x")]
    c.receive_data(s.send(held(id=5, slabs=2)), [7, 8])
    assert list(c.received()) == [(held(id=5, slabs=2), [7, 8])] and c.pending == s.pending == {}
    with pytest.raises(LocalProtocolError):
        s.send(held(id=5, slabs=0))  # answered already
    c, d = _served(Service.DAEMON)
    d.receive_data(c.send(hold(id=1, what="y")))
    (event,) = d.events()
    assert isinstance(event, Misdirected) and event.error.code is ErrorCode.NOT_FOUND


@pytest.mark.parametrize(
    ("base", "type_", "declared", "why"),
    [
        (Frame, "TOY_ASK", {"reply": "TOY_ANSWER"}, "declares its reply and service"),  # served by no one
        (Frame, "TOY_ASK", {"service": Service.DAEMON}, "declares its reply and service"),  # answered by nothing
        (Frame, "TOY_TELL", {"pipelined": True}, "only a request is pipelined"),
        (Frame, "TOY_TELL", {"phase": Phase.AUTH, "moves": {Phase.AUTH: Phase.OPEN}}, "phase= or moves="),
        (Message, "", {"reply": "TOY_ANSWER", "service": Service.DAEMON}, "a part of a frame"),
        (Message, "TOY_TELL", {}, "a frame \\(a Frame subclass\\) has a type"),
        (Frame, "", {}, "a frame \\(a Frame subclass\\) has a type"),
    ],
)
def test_a_declaration_that_cannot_hang_together_is_refused_where_it_is_made(
    base: type[Message], type_: str, declared: dict[str, Any], why: str
) -> None:
    with pytest.raises(TypeError, match=why):

        @message(type_, **declared)
        class Toy(base):  # type: ignore[valid-type,misc]
            id: int = wire(Int(lo=1))

    assert "TOY_ASK" not in REGISTRY and "TOY_TELL" not in REGISTRY


def test_every_frame_declares_a_place_that_hangs_together() -> None:
    """What the frames declare is consistent, so that the tables derived from it say what docs/protocol.md §5
    says: a request is the client's, answered by a service, its replies frames the server sends in every phase
    the request travels in (but before HELLO_OK, where only the handshake answers); every other frame is a reply
    or the handshake's or ERROR; each row a frame has at one end has its mirror at the other; the tables hold
    exactly what the classes declare (CARRIES_FDS: the frames that count descriptors, each example with some)."""
    registry = load_frames()
    replies = {r for cls in registry.values() for r in cls.REPLIES}
    for t, cls in registry.items():
        if cls.REPLIES:
            assert cls.SENDER is Role.CLIENT and cls.SERVICES and t not in replies, t
            for r in cls.REPLIES:
                reply = registry[r]
                assert reply.SENDER is Role.SERVER and not reply.REPLIES, (t, r)
                assert {p for p, _ in cls.MOVES} - {Phase.HELLO_SENT} <= {p for p, _ in reply.MOVES}, (t, r)
        else:
            assert t in replies or t in ("HELLO", "HELLO_OK", "ERROR"), f"{t} is no request and answers none"
            assert not cls.SERVICES and not cls.PIPELINED, t
        rows = transitions(cls)
        mirror = {Phase.HELLO_SENT: Phase.HELLO_RECEIVED}
        for phase, after in cls.MOVES:
            sent, received = ("send", "recv") if cls.SENDER is Role.CLIENT else ("recv", "send")
            assert rows[(Role.CLIENT, phase, sent)] is after, t
            assert rows[(Role.SERVER, mirror.get(phase, phase), received)] is mirror.get(after, after), t
        assert len(rows) == 2 * len(cls.MOVES), t
        assert {row[:3]: after for row, after in connection.TRANSITIONS.items() if row[3] == t} == rows
    assert {s: {t for t, c in registry.items() if s in c.SERVICES} for s in Service} == connection.SERVES
    assert {t for t, cls in registry.items() if cls.fd_count is not Frame.fd_count} == connection.CARRIES_FDS
    assert all(EXAMPLES[t].fd_count > 0 for t in connection.CARRIES_FDS)
    assert {t for t, cls in registry.items() if cls.PIPELINED} == {"GET_STATE"}  # §5.1: only GET_STATE


def test_the_type_checkers_request_unions_name_what_the_frames_declare() -> None:
    """``DaemonRequest`` and ``KeeperRequest`` as the type checker reads them (connection.py's annotations, which
    the servers' match statements are checked against) name the requests each service declares it answers."""
    tree = ast.parse(inspect.getsource(connection))
    spelled = {
        ast.unparse(n.target): {x.id for x in ast.walk(n.value) if isinstance(x, ast.Name)}
        for n in ast.walk(tree)
        if isinstance(n, ast.AnnAssign)
        and n.value is not None
        and ast.unparse(n.target) in ("DaemonRequest", "KeeperRequest")
    }
    assert spelled == {
        "DaemonRequest": {cls.__name__ for cls in get_args(connection.DaemonRequest)},
        "KeeperRequest": {cls.__name__ for cls in get_args(connection.KeeperRequest)},
    }
    assert {cls.TYPE for cls in get_args(connection.DaemonRequest)} == connection.SERVES[Service.DAEMON]


def _pair_in(phase: Phase) -> tuple[Connection, Connection]:
    """A client and a server (of no particular service) in ``phase``, in the client's view."""
    if phase is Phase.AUTH:
        c, s = Connection(Role.CLIENT, auth=True), Connection(Role.SERVER, auth=True)
    else:
        c, s = Connection(Role.CLIENT), Connection(Role.SERVER)
    s.receive_data(c.send(Hello(versions=(PROTOCOL_VERSION,))))
    (hello,) = s.events()
    assert isinstance(hello, Hello)
    if phase is not Phase.HELLO_SENT:
        c.receive_data(s.send(s.hello_reply(hello, software="t", backend="host", device=DeviceInfo("cpu"))))
        list(c.events())
    assert c.phase is phase
    return c, s


@pytest.mark.parametrize(
    ("request_type", "phase", "reply_type"),
    [
        (t, phase, r)
        for t, cls in sorted(load_frames().items())
        for phase, _ in cls.MOVES
        for r in (*cls.REPLIES, "ERROR")
        if cls.REPLIES
    ],
)
def test_every_request_travels_and_is_answered_where_it_declares(
    request_type: str, phase: Phase, reply_type: str
) -> None:
    """Generated from the declarations: each request, in each phase it declares, goes from a client to a server,
    and each of its replies (and ERROR) comes back, with the phases the declarations say at both ends."""
    c, s = _pair_in(phase)
    request = EXAMPLES[request_type]
    if isinstance(request, Release):
        c.leases.add(request.lease)  # a client releases only a lease it holds
    s.receive_data(c.send(request))
    assert list(s.events()) == [request]
    out = b""
    if phase is Phase.HELLO_SENT:  # a pipelined request: answered after HELLO_OK
        out = s.send(_ok())
    rid: int = getattr(request, "id", 0)
    reply = (
        ErrorFrame(id=rid, code=ErrorCode.NOT_FOUND, message="no") if reply_type == "ERROR" else EXAMPLES[reply_type]
    )
    c.receive_data(out + s.send(dataclasses.replace(reply, id=rid)))  # type: ignore[call-arg]
    assert [f.TYPE for f in c.events()][-1] == reply_type
    after = dict(type(reply).MOVES).get(phase if phase is not Phase.HELLO_SENT else Phase.OPEN)
    assert c.phase is s.phase is after and c.pending == s.pending == {}
