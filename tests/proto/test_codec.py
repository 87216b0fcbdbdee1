"""Framing and strict decoding (docs/protocol.md §2)."""

from __future__ import annotations

import struct

import msgpack
import pytest

from wcache.errors import FrameTooLargeError, ProtocolError
from wcache.proto import FrameBuffer, decode_body, pack_frame


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
    with pytest.raises(ProtocolError, match="zero-length"):
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
    with pytest.raises(ProtocolError, match=match):
        decode_body(body)


def test_deep_nesting_is_a_protocol_error() -> None:
    body = b"\x81\xa1k" + b"\x91" * 5000 + b"\xc0"
    with pytest.raises(ProtocolError):
        decode_body(body)


def test_buffer_compacts() -> None:
    buf = FrameBuffer()
    frame = pack_frame({"type": "STATUS", "id": 1})
    for _ in range(1000):
        buf.feed(frame)
        assert buf.next_body() is not None
    assert buf.buffered == 0
    assert len(buf._buf) < 10 * len(frame)
