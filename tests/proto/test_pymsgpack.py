"""msgpack in Python for an engine's small frames (wcache/proto/pymsgpack.py) against msgpack itself: whatever it
returns is msgpack's answer, and anything it does not handle it declines (Unsupported) rather than decide."""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wcache.errors import RemoteProtocolError
from wcache.proto import examples
from wcache.proto.codec import Preencoded, decode_body, encode_body
from wcache.proto.pymsgpack import MAX_DEPTH, Unsupported, packb, unpack_body

#: every integer width msgpack has, and the edges between them
EDGES = [
    0, 1, 31, 32, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1,
    -1, -31, -32, -33, -127, -128, -129, -32767, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63),
]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from(EDGES),
    st.text(max_size=40),
    st.text(min_size=30, max_size=300),
    st.binary(max_size=300),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=20),
        st.lists(inner, max_size=20).map(tuple),
        st.dictionaries(st.text(max_size=20), inner, max_size=20),
    ),
    max_leaves=60,
)
maps = st.dictionaries(st.text(max_size=20), values, max_size=20)


def reference(body: bytes) -> Any:
    """What codec.decode_body makes of ``body``: the map, or the RemoteProtocolError class."""
    try:
        return decode_body(body)
    except RemoteProtocolError:
        return RemoteProtocolError


def ours(body: bytes) -> Any:
    try:
        return unpack_body(body)
    except Unsupported:
        return Unsupported


def same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (True is not 1, a tuple not a list; NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack(">d", a) == struct.pack(">d", b) or (math.isnan(a) and math.isnan(b))
    if type(a) is tuple:
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@given(values)
@settings(max_examples=400)
def test_packb_is_msgpacks(value: Any) -> None:
    assert packb(value) == msgpack.packb(value, use_bin_type=True)


@pytest.mark.parametrize("n", EDGES)
def test_every_integer_width(n: int) -> None:
    assert packb(n) == msgpack.packb(n)
    assert same(unpack_body(packb({"n": n})), {"n": n})


@pytest.mark.parametrize("size", [0, 15, 16, 31, 32, 255, 256, 65535, 65536])
def test_every_length_form(size: int) -> None:
    for value in ("x" * size, b"x" * size, ["x"] * size, {f"{i:06}": None for i in range(size)}):
        assert packb(value) == msgpack.packb(value, use_bin_type=True)
        body = packb({"v": value})
        assert same(unpack_body(body), decode_body(body))


@pytest.mark.parametrize(
    "value",
    [1.5, 2**64, -(2**63) - 1, "\udc80", {1: 2}, [object()], True.__class__, bytearray(b"x"), {"a": [[[]]]}],
    ids=["float", "u64+1", "i64-1", "surrogate", "int key", "object", "type", "bytearray", "fine"],
)
def test_packb_declines_what_it_does_not_encode(value: Any) -> None:
    """A float, an integer past 64 bits, a lone surrogate, another type: Unsupported (msgpack then encodes it, or
    raises what it raises); a map key of another scalar type is encoded as msgpack does."""
    try:
        expected: bytes | None = msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        expected = None
    try:
        got: bytes | None = packb(value)
    except Unsupported:
        got = None
    assert got is None or got == expected
    if type(value) in (float, bytearray) or value == [object()]:
        assert got is None


def test_packb_declines_deep_nesting() -> None:
    deep: Any = []
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(Unsupported):
        packb(deep)


@given(maps)
@settings(max_examples=400)
def test_unpack_body_is_decode_bodys(value: dict[str, Any]) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    assert same(ours(body), reference(body))


@given(maps, st.data())
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_a_damaged_body_is_declined_or_decoded_alike(value: dict[str, Any], data: st.DataObject) -> None:
    """Bytes flipped, cut or appended: whatever unpack_body returns is decode_body's answer; where decode_body
    refuses the body, unpack_body declines it."""
    body = bytearray(msgpack.packb(value, use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    tail = data.draw(st.binary(max_size=4))
    for damaged in (bytes(body), bytes(body[:cut]), bytes(body) + tail):
        got, want = ours(damaged), reference(damaged)
        assert got is Unsupported or same(got, want), (damaged, got, want)


@given(st.binary(max_size=200))
@settings(max_examples=1000)
def test_arbitrary_bytes(body: bytes) -> None:
    got = ours(body)
    assert got is Unsupported or same(got, reference(body))


@pytest.mark.parametrize(
    "body",
    [
        b"",
        msgpack.packb([1, 2]),
        msgpack.packb({"a": 1}) + b"\x00",
        msgpack.packb({b"bytes-key": 1}),
        msgpack.packb({"a": {1: 2}}),
        b"\x81\xa1a\xc1",
        b"\x81\xa1a\xd4\x01\x00",  # fixext 1
        b"\x81\xa1a\xdd\xff\xff\xff\xff",
        b"\x81\xa1a\xdf\x7f\xff\xff\xff",
        b"\x81\xa1a\xdb\x00\x00\x00\x05ab",
        b"\x81\xa1a\xa1\xff",  # not UTF-8
        b"\x81\xa1a\xed\xa0\x80",  # a UTF-8-encoded surrogate inside fixint bytes, for the record
        b"\x81\xa1k" + b"\x91" * 5000 + b"\xc0",
    ],
)
def test_declines_what_decode_body_refuses(body: bytes) -> None:
    got = ours(body)
    assert got is Unsupported or same(got, reference(body))
    if reference(body) is RemoteProtocolError:
        assert got is Unsupported


def test_floats_decode_as_msgpacks() -> None:
    for x in (0.0, -0.0, 1.5, float("inf"), float("nan"), 1e38, 1e308, 5e-324):
        bodies = [msgpack.packb({"f": x})]
        if abs(x) < 3e38:  # float32's range
            bodies.append(msgpack.packb({"f": x}, use_single_float=True))
        for body in bodies:
            assert same(unpack_body(body), decode_body(body))


@pytest.mark.parametrize("name", sorted(examples.EXAMPLES))
def test_every_example_frame(name: str) -> None:
    """The protocol's examples (docs/protocol.md §8): the same bytes, and the same map back."""
    wire = examples.EXAMPLES[name].to_wire()
    body = encode_body(wire)
    assert same(unpack_body(body), decode_body(body))
    try:
        assert packb(wire) == body
    except Unsupported:  # declined only for what it does not encode: a float, a preencoded table
        assert _holds(wire, (float, Preencoded))


def _holds(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, types):
        return True
    if isinstance(value, dict):
        return any(_holds(v, types) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds(v, types) for v in value)
    return False
