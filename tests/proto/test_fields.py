"""The field declarations drive the codec: generated from them, so a new frame or field is covered at once.

Every frame class round-trips through the generic codec; every field's limit (type, range, length, item
count, choice set) is enforced on decode with a ProtocolError that names the frame and field; a required
field that is missing is refused, an absent optional one takes its declared default.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator
from typing import Any

import pytest

from wcache.errors import RemoteProtocolError
from wcache.proto import decode_body, decode_frame, pack_frame
from wcache.proto.examples import EXAMPLES
from wcache.proto.fields import (
    MAX_KEY_CHARS,
    MAX_KEY_FIELDS,
    REGISTRY,
    Array,
    Bin,
    Bool,
    Choice,
    Float,
    Frame,
    Int,
    Key,
    Message,
    Nested,
    Plain,
    Str,
    StrMap,
    Table,
    message,
    wire,
)
from wcache.proto.frames import load_frames
from wcache.proto.limits import INT64_MAX

_MISSING: Any = dataclasses.MISSING


def test_the_registry_holds_every_frame_class_of_the_frame_modules() -> None:
    """Every Frame class of every module of FRAME_MODULES is registered under its type, and nothing else is: a
    frame module missing from FRAME_MODULES, or a frame outside them, shows here."""
    import inspect

    from wcache.proto import frames

    declared = {
        cls
        for module in map(importlib.import_module, frames.FRAME_MODULES)
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, Frame) and cls is not Frame
    }
    assert set(frames.load_frames().values()) == declared
    assert all(t == cls.TYPE for t, cls in REGISTRY.items())
    assert {cls.__module__ for cls in REGISTRY.values()} == set(frames.FRAME_MODULES)


def test_peer_frames_decode_in_a_process_that_never_imported_them() -> None:
    """An engine's restart does not import the peer channel's frames; a decoder meeting one imports them."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from wcache.proto import decode_body, decode_frame, pack_frame\n"
        "assert 'wcache.proto.fleet_frames' not in sys.modules\n"
        "f = decode_frame(decode_body(pack_frame({'type': 'PEER_QUERY', 'id': 3, 'key': {}})[4:]))\n"
        "print(type(f).__name__, f.id)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["PeerQuery", "3"]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_frame_round_trips_through_the_generic_codec(name: str) -> None:
    frame = EXAMPLES[name]
    wire = frame.to_wire()
    assert next(iter(wire)) == "type" and wire["type"] == name
    omitted = {n for n in type(frame)._OMIT if n not in wire}
    assert list(wire)[1:] == [f.name for f in dataclasses.fields(frame) if f.name not in omitted]
    assert decode_frame(decode_body(pack_frame(wire)[4:])) == frame
    assert type(frame).from_wire(decode_body(pack_frame(wire)[4:])) == frame


def _wire(name: str) -> dict[str, Any]:
    """The example's map as a receiver decodes it (a STATE's table is pre-encoded bytes in to_wire())."""
    return decode_body(pack_frame(EXAMPLES[name].to_wire())[4:])


def _bad_values(kind: Any) -> Iterator[tuple[str, Any]]:
    """Wire values that break ``kind``'s declared type or limits (one per limit)."""
    if isinstance(kind, Int):
        yield "string", "1"
        yield "bool", True
        yield "float", 1.0
        if kind.lo > -(2**63):
            yield "below lo", kind.lo - 1
        if kind.hi < 2**64 - 1:
            yield "above hi", kind.hi + 1
    elif isinstance(kind, Choice):
        yield "not a choice", "no-such-" + kind.options[0]
        yield "not a string", 1
    elif isinstance(kind, Str):
        yield "too long", "x" * (kind.max_len + 1)
        yield "bin", b"x"
    elif isinstance(kind, Bin):
        yield "too long", b"x" * (kind.max_len + 1)
        yield "string", "x"
    elif isinstance(kind, Bool):
        yield "int", 1
    elif isinstance(kind, Float):
        yield "nan", float("nan")
        yield "inf", float("inf")
        yield "string", "1.0"
    elif isinstance(kind, (Key, StrMap, Plain)):
        yield "array", [1]
        yield "int keys", {1: "x"}
        if isinstance(kind, Key):
            yield "float value", {"k": 1.5}
            yield "long value", {"k": "x" * 1025}
            yield "too many fields", {f"f{i}": i for i in range(MAX_KEY_FIELDS + 1)}
            yield "too many characters", {f"f{i}": "x" * 1000 for i in range(MAX_KEY_CHARS // 1000 + 1)}
        elif isinstance(kind, StrMap):
            yield "int value", {"k": 1}
        else:
            yield "too deep", {"k": [[[[[[[[[[1]]]]]]]]]]}
    elif isinstance(kind, (Nested, Table)):
        yield "not a map", [1]
    elif isinstance(kind, Array):
        yield "not an array", {"a": 1}
        if kind.min_items > 0:
            yield "too few", []
    else:  # pragma: no cover - a new kind needs its limits listed here
        raise AssertionError(f"no bad values for {type(kind).__name__}: add them to _bad_values")


def _cases() -> Iterator[Any]:
    """(frame type, path to the map holding the field, the part's name, field, bad value) for every field
    of every frame and of every part (nested map, first array item) found in the examples."""

    def walk(name: str, cls: type[Message], wire: dict[str, Any], path: tuple[Any, ...]) -> Iterator[Any]:
        for attr, kind, _absent, _factory in cls._SPEC:
            for what, bad in _bad_values(kind):
                yield pytest.param(
                    name, path, cls._NAME, attr, bad, id=f"{name}:{'.'.join(map(str, path + (attr,)))}:{what}"
                )
            if isinstance(kind, Array) and kind.max_items is not None and wire.get(attr):
                over = list(wire[attr]) * (kind.max_items + 1)
                yield pytest.param(
                    name, path, cls._NAME, attr, over[: kind.max_items + 1], id=f"{name}:{attr}:too many"
                )
            inner = kind.item if isinstance(kind, Array) else kind
            if isinstance(inner, Nested) and wire.get(attr):
                sub = wire[attr][0] if isinstance(kind, Array) else wire[attr]
                at = (attr, 0) if isinstance(kind, Array) else (attr,)
                yield from walk(name, inner.cls, sub, path + at)

    for name, cls in sorted(REGISTRY.items()):
        yield from walk(name, cls, _wire(name), ())


def _at(wire: dict[str, Any], path: tuple[Any, ...]) -> dict[str, Any]:
    for step in path:
        wire = wire[step]
    return wire


@pytest.mark.parametrize(("name", "path", "part", "attr", "bad"), list(_cases()))
def test_every_field_limit_is_enforced_on_decode(
    name: str, path: tuple[Any, ...], part: str, attr: str, bad: Any
) -> None:
    wire = _wire(name)
    _at(wire, path)[attr] = bad
    with pytest.raises(RemoteProtocolError) as info:
        decode_frame(wire)  # the map, not bytes: msgpack itself refuses some of these (int keys)
    assert info.value.details.get("frame") in (part, "TensorTable"), info.value
    if info.value.details.get("frame") == part:
        assert info.value.details.get("field") == attr


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_missing_fields_are_refused_or_defaulted(name: str) -> None:
    cls = REGISTRY[name]
    for attr, _kind, absent, factory in cls._SPEC:
        wire = _wire(name)
        wire.pop(attr, None)  # an omit_default field at its default is absent already
        if absent is _MISSING and factory is _MISSING:
            with pytest.raises(RemoteProtocolError) as info:
                decode_frame(wire)
            assert info.value.details == {"frame": name, "field": attr}
        else:
            got = decode_frame(wire)
            assert getattr(got, attr) == (factory() if absent is _MISSING else absent)


def test_backend_is_a_choice_in_every_frame() -> None:
    """``backend`` was validated in HELLO_OK and STATUS_REPLY and a free string in TAKEOVER, KEEP, RECLAIM and
    ModelInfo; one declaration now (docs/protocol.md: "host" or "cuda")."""
    parts: set[type[Message]] = set()
    todo: list[type[Message]] = list(REGISTRY.values())
    while todo:
        cls = todo.pop()
        parts.add(cls)
        for _, kind, _, _ in cls._SPEC:
            inner = kind.item if isinstance(kind, Array) else kind
            if isinstance(inner, Nested) and inner.cls not in parts:
                todo.append(inner.cls)
    assert {"ModelInfo", "HandedModel", "DeviceInfo"} <= {c.__name__ for c in parts}
    for cls in parts:
        for attr, kind, _, _ in cls._SPEC:
            if attr == "backend":
                assert isinstance(kind, Choice) and kind.options == ("host", "cuda"), cls


def test_int64_bound_is_the_default() -> None:
    assert Int().hi == INT64_MAX


def test_an_omit_default_field_keeps_old_bytes_and_travels_when_set() -> None:
    """Schema evolution (docs/protocol.md §2.1): a field added with ``omit_default`` leaves the frame's bytes as
    they were while it holds its default, is encoded once set, and an absent one decodes to the default."""
    from wcache.proto import ModelInfo

    old = ModelInfo(key={"fingerprint": "x"}, backend="host", bytes=1, tensors=1, leases=0)
    assert "origin" not in old.to_wire()
    assert ModelInfo.from_wire(old.to_wire()) == old
    new = dataclasses.replace(old, origin="deposit")
    assert new.to_wire()["origin"] == "deposit"
    assert ModelInfo.from_wire(new.to_wire()) == new


@message()
class _Cached(Message):
    """A part with a field that is not on the wire (a cache, as the tensor table keeps its encoding)."""

    a: int = wire(Int())
    memo: list[int] = dataclasses.field(default_factory=list, compare=False)
    b: str = wire(Str(), default="x")


@message()
class _Plain(Message):
    a: int = wire(Int())
    b: str = wire(Str(), default="x")


def test_the_decoder_builds_records_positionally_where_every_field_travels() -> None:
    """A part or frame whose fields are all on the wire is built by position (the record's fast ``__init__``);
    one with a field off the wire by keyword, that field taking its default. Every frame of the protocol, and
    every part nested in one, is of the first kind (a DEPOSIT's thousands of tensors decode that way)."""
    assert _Plain._POSITIONAL and not _Cached._POSITIONAL
    assert _Plain.from_wire({"a": 1}) == _Plain(1, "x") and _Plain.from_wire({"a": 1, "b": "y"}).b == "y"
    c = _Cached.from_wire({"a": 1, "b": "y"})
    assert (c.a, c.b, c.memo) == (1, "y", [])
    seen: set[type[Message]] = set()
    todo: list[type[Message]] = list(load_frames().values())
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            for _, declared_kind, _, _ in cls._SPEC:
                kind = getattr(declared_kind, "item", declared_kind)  # an array's items
                if isinstance(kind, Nested):
                    todo.append(kind.cls)
    assert len(seen) > len(REGISTRY)  # the parts (slab descriptors, deposit tensors, file stats...) are in
    assert sorted(c.__name__ for c in seen if not c._POSITIONAL) == []
