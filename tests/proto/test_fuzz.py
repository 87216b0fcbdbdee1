"""Fuzzing the decoder.

Invariant: for ANY input bytes, fed whole or one byte at a time, a server-side
``Connection`` yields only typed frames or raises ``wcache.errors.RemoteProtocolError`` (or a
subclass: the peer broke the protocol) — never another exception (our own ``LocalProtocolError`` or the
base ``ProtocolError`` included), never a hang, never unbounded buffering.
"""

from __future__ import annotations

import struct

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wcache.errors import RemoteProtocolError
from wcache.proto import PROTOCOL_VERSION, Connection, Event, Frame, Role, pack_frame
from wcache.proto.frames import FRAME_TYPES

from .strategies import frames

MAX = 1 << 16


def _drive(data: bytes, *, chunk: int, role: Role = Role.SERVER) -> list[Event]:
    conn = Connection(role, max_frame_size=MAX)
    out: list[Event] = []
    try:
        for i in range(0, len(data), chunk):
            conn.receive_data(data[i : i + chunk])
            out.extend(conn.events())
        conn.receive_data(b"")
        out.extend(conn.events())
    except RemoteProtocolError:
        pass
    assert conn.buffered <= MAX + 4 + chunk
    return out


def _both_ways(data: bytes) -> None:
    for role in (Role.SERVER, Role.CLIENT):
        whole = _drive(data, chunk=max(1, len(data)), role=role)
        if len(data) <= 2048:
            assert _drive(data, chunk=1, role=role) == whole


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_random_bytes(data: bytes) -> None:
    _both_ways(data)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bodies_with_valid_prefix(body: bytes) -> None:
    _both_ways(struct.pack(">I", len(body)) + body)


json_like = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=20),
        st.binary(max_size=20),
    ),
    lambda c: st.one_of(
        st.lists(c, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=10), st.integers(-(2**63), 2**64 - 1)), c, max_size=5),
    ),
    max_leaves=20,
)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(sorted(FRAME_TYPES)), st.dictionaries(st.text(max_size=12), json_like, max_size=8))
def test_wrong_field_types(kind: str, fields: dict[str, object]) -> None:
    """Well-formed msgpack maps of a known type but arbitrary fields."""
    fields = {**fields, "type": kind}
    _both_ways(pack_frame(fields))


@settings(max_examples=300, deadline=None)
@given(frames, st.data())
def test_mutated_valid_frames(frame: Frame, data: st.DataObject) -> None:
    raw = bytearray(pack_frame(frame.to_wire()))
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        pos = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and raw:
            del raw[pos]
        elif op == "truncate":
            del raw[pos:]
    _both_ways(bytes(raw))


def test_msgpack_ext_and_timestamp_rejected() -> None:
    for value in (msgpack.ExtType(5, b"x"), msgpack.Timestamp(1, 0)):
        body = msgpack.packb({"type": "HELLO", "versions": [PROTOCOL_VERSION], "x": value})
        conn = Connection(Role.SERVER)
        conn.receive_data(struct.pack(">I", len(body)) + body)
        try:
            list(conn.events())
        except RemoteProtocolError as exc:
            assert "ext" in str(exc)
        else:  # pragma: no cover - would be a bug
            raise AssertionError("ext type accepted")
