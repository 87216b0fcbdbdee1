"""Framing and strict decoding (docs/protocol.md §2)."""

from __future__ import annotations

import gc
import struct
import sys
from collections.abc import Iterator

import msgpack
import pytest

from wcache.errors import FrameTooLargeError, RemoteProtocolError
from wcache.proto import FrameBuffer, codec, decode_body, pack_frame
from wcache.proto.codec import DIRECT_BODY, gc_paused
from wcache.proto.connection import PROTOCOL_VERSION, Connection, Role
from wcache.proto.daemon_frames import DeviceInfo, Hello, HelloOk


def test_length_checked_before_body() -> None:
    buf = FrameBuffer(max_frame_size=100)
    buf.feed(struct.pack(">I", 101))  # only the prefix: the body never needs to arrive
    with pytest.raises(FrameTooLargeError) as info:
        buf.next_body()
    assert (info.value.size, info.value.max_size) == (101, 100)
    assert info.value.details == {"size": 101, "max_size": 100}


def test_huge_length_prefix() -> None:
    buf = FrameBuffer()
    buf.feed(b"\xff\xff\xff\xff")
    with pytest.raises(FrameTooLargeError):
        buf.next_body()


def test_zero_length_frame() -> None:
    buf = FrameBuffer()
    buf.feed(b"\x00\x00\x00\x00")
    with pytest.raises(RemoteProtocolError, match="zero-length"):
        buf.next_body()


def test_pack_frame_limit() -> None:
    with pytest.raises(FrameTooLargeError):
        pack_frame({"type": "X", "blob": b"x" * 200}, max_frame_size=100)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (msgpack.packb([1, 2]), "must be a msgpack map"),
        (msgpack.packb({"a": 1}) + b"\x00", "trailing"),
        (msgpack.packb({b"bytes-key": 1}), "keys must be strings"),
        (b"\xc1", "malformed"),
        (b"\xdd\xff\xff\xff\xff", "malformed"),  # array32 of 4G entries in 5 bytes
        (b"\xdf\x7f\xff\xff\xff", "malformed"),  # map32 of 2G entries
        (b"\xdb\x00\x00\x00\x05ab", "malformed"),  # str32 longer than the body
        (msgpack.packb({"s": b"\xff".decode("latin-1")})[:-1] + b"\xff", "malformed"),
    ],
)
def test_strict_decoding(body: bytes, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        decode_body(body)


def test_deep_nesting_is_a_protocol_error() -> None:
    body = b"\x81\xa1k" + b"\x91" * 5000 + b"\xc0"
    with pytest.raises(RemoteProtocolError):
        decode_body(body)


def test_buffer_compacts() -> None:
    buf = FrameBuffer()
    frame = pack_frame({"type": "STATUS", "id": 1})
    for _ in range(1000):
        buf.feed(frame)
        assert buf.next_body() is not None
    assert buf.buffered == 0
    assert len(buf._buf) < 10 * len(frame)


def _big(n: int, tag: int = 0) -> bytes:
    """One frame whose body is at least ``n`` bytes (a msgpack map with one bin value)."""
    return pack_frame({"type": "STATUS", "id": tag + 1, "pad": bytes([tag]) * n})


@pytest.mark.parametrize("cut", [1, 3, 4, 5, 1000, DIRECT_BODY - 1, DIRECT_BODY + 7])
def test_direct_body_assembles_in_place_whatever_arrives_how(cut: int) -> None:
    """A client's big frame is received into one buffer of its announced size (``space``/``filled``) or fed in
    pieces, and the frames around it come out as from an ordinary buffer, in order."""
    small, big, after = pack_frame({"type": "STATUS", "id": 9}), _big(3 * DIRECT_BODY, 1), _big(10, 2)
    stream = small + big + after
    ref, direct = FrameBuffer(), FrameBuffer(direct=True)
    ref.feed(stream)
    want = [ref.next_body(), ref.next_body(), ref.next_body()]
    got: list[bytes | bytearray] = []
    pos, turn = 0, 0
    while pos < len(stream):
        space = direct.space()
        if space is not None and turn % 2:  # every other read goes straight into the body
            n = min(len(space), cut, len(stream) - pos)
            space[:n] = stream[pos : pos + n]
            direct.filled(n)
        else:
            n = min(cut, len(stream) - pos)
            direct.feed(stream[pos : pos + n])
        pos, turn = pos + n, turn + 1
        assert direct.demand >= direct.buffered
        while (body := direct.next_body()) is not None:
            got.append(body)
    assert [bytes(b) for b in got] == want
    assert direct.buffered == 0 and direct.space() is None
    assert type(got[1]) is bytearray  # the big one is the buffer received into, not a copy


def test_direct_body_checks_the_limit_before_making_its_buffer() -> None:
    buf = FrameBuffer(max_frame_size=DIRECT_BODY * 2, direct=True)
    buf.feed(struct.pack(">I", DIRECT_BODY * 2 + 1))
    with pytest.raises(FrameTooLargeError):
        buf.next_body()
    assert buf.space() is None


def test_direct_body_refuses_more_than_its_space() -> None:
    buf = FrameBuffer(direct=True)
    buf.feed(_big(DIRECT_BODY)[:10])
    assert buf.next_body() is None
    space = buf.space()
    assert space is not None
    with pytest.raises(ValueError, match="do not fit"):
        buf.filled(len(space) + 1)


class _Node:
    """A container the cyclic GC tracks."""


def _generation_of(obj: object) -> int:
    return next(g for g in range(3) if any(o is obj for o in gc.get_objects(generation=g)))


keeps = pytest.mark.skipif(not codec.KEEPS_YOUNG, reason="keep_young does nothing on this interpreter")


@pytest.fixture
def collecting(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The collector enabled, nothing frozen but the interpreter's own, for the test; the process's state as it was
    afterwards."""
    was = gc.isenabled()
    assert gc.get_freeze_count() <= codec.STARTUP_FROZEN
    monkeypatch.setattr(codec, "_frozen_seen", False)
    gc.enable()
    yield
    gc.unfreeze()
    if was:
        gc.enable()
    else:
        gc.disable()


@keeps
def test_a_kept_pause_moves_what_it_made_to_the_oldest_generation(collecting: None) -> None:
    """``gc_paused(keep=True)``: what the pause made is in the oldest generation when it ends, and no collection ran;
    without ``keep`` it stays young, for the next collection to traverse."""
    runs: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(count)
    try:
        with gc_paused(keep=True):
            kept = [_Node() for _ in range(5000)]
        assert runs == [] and gc.isenabled()
        assert _generation_of(kept[0]) > 0 and _generation_of(kept[-1]) > 0  # old: no young collection sees them
        with gc_paused():
            young = [_Node() for _ in range(10)]
        assert runs == [] and _generation_of(young[0]) == 0
    finally:
        gc.callbacks.remove(count)


@keeps
def test_a_kept_pause_leaves_frozen_objects_frozen_and_stops_looking(collecting: None) -> None:
    """Something frozen (a pre-fork server's ``gc.freeze``) stays frozen: the move is skipped, the pause still ends,
    and later pauses do not count the frozen heap again."""
    frozen = _Node()
    gc.freeze()
    n = gc.get_freeze_count()
    with gc_paused(keep=True):
        made = _Node()
    assert gc.get_freeze_count() == n and gc.isenabled()
    assert not any(o is frozen for g in range(3) for o in gc.get_objects(generation=g))
    assert _generation_of(made) == 0
    gc.unfreeze()  # nothing frozen now: the move stays off, the first sight of a frozen heap is remembered
    with gc_paused(keep=True):
        later = _Node()
    assert _generation_of(later) == 0


@keeps
def test_the_interpreters_own_frozen_objects_do_not_keep_the_move_off(
    collecting: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.12 starts with a few hundred objects frozen (its startup tuples): a permanent generation of at most
    STARTUP_FROZEN objects is the interpreter's, released by the first move, and the move works from then on. (The
    frozen set here is the test process's, taken for the interpreter's by raising the bound.)"""
    frozen = _Node()
    gc.freeze()
    monkeypatch.setattr(codec, "STARTUP_FROZEN", gc.get_freeze_count())
    with gc_paused(keep=True):
        made = _Node()
    assert gc.get_freeze_count() == 0 and not codec._frozen_seen
    assert _generation_of(frozen) == 2 and _generation_of(made) == 2
    with gc_paused(keep=True):
        later = _Node()
    assert _generation_of(later) == 2


def test_startup_frozen_is_python_312s_alone() -> None:
    """Only 3.12 starts with objects frozen; any frozen object elsewhere is a program's (the move stays off)."""
    assert (codec.STARTUP_FROZEN > 0) == (sys.version_info[:2] == (3, 12))


def test_a_pause_inside_a_pause_leaves_the_collector_to_the_outer_one(collecting: None) -> None:
    gc.disable()
    with gc_paused(keep=True):
        made = _Node()
    assert not gc.isenabled() and _generation_of(made) == 0


@keeps
def test_only_a_connection_that_keeps_what_it_decodes_moves_it(
    collecting: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's connection (``keep_decoded``, the client's) ends a large frame's decode with the frame in the
    oldest generation; a daemon's connections (the default) leave what they decode young, as before."""
    monkeypatch.setattr(codec, "GC_PAUSE_BYTES", 0)  # every frame is "large"
    for keep in (True, False):
        client, server = Connection(Role.CLIENT, keep_decoded=keep), Connection(Role.SERVER)
        server.receive_data(client.send(Hello(versions=(PROTOCOL_VERSION,))))
        (hello,) = server.events()
        assert isinstance(hello, Hello) and _generation_of(hello) == 0  # the daemon's decode left it young
        reply = server.hello_reply(hello, software="t", backend="host", device=DeviceInfo("cpu"))
        client.receive_data(server.send(reply))
        (ok,) = client.events()
        assert isinstance(ok, HelloOk)
        assert (_generation_of(ok) > 0) is keep
