"""The STATE tensor table: grouping on encode, and every validation rule on decode (§4.6)."""

from __future__ import annotations

from typing import Any

import pytest

from wcache.errors import RemoteProtocolError, UnsupportedVersionError
from wcache.proto import Connection, DeviceInfo, Hello, Role, TensorEntry, TensorGroup, TensorTable


def _experts(n: int, *, first: int = 0) -> list[TensorEntry]:
    # lexical name order (experts.0, experts.1, experts.10, ...) is not offset order
    return [TensorEntry(f"experts.{i}.w", "bfloat16", (4, 8), (8, 1), 0, first + 256 * i) for i in range(n)]


def test_equal_shapes_at_a_constant_spacing_form_one_group() -> None:
    entries = _experts(1000)
    t = TensorTable.from_entries(entries)
    assert t.groups == (TensorGroup("bfloat16", (4, 8), (8, 1), 0, 0, 256, 1000),)
    assert t.names == tuple(f"experts.{i}.w" for i in range(1000))
    assert list(t) == entries


def test_groups_split_where_shape_dtype_slab_or_spacing_change() -> None:
    entries = [
        TensorEntry("a", "bfloat16", (4, 8), (8, 1), 0, 0),
        TensorEntry("b", "bfloat16", (4, 8), (8, 1), 0, 256),
        TensorEntry("c", "bfloat16", (4, 8), (8, 1), 0, 1024),  # spacing changes
        TensorEntry("d", "float32", (4, 8), (8, 1), 0, 2048),  # dtype
        TensorEntry("e", "bfloat16", (8, 4), (4, 1), 0, 4096),  # shape
        TensorEntry("f", "bfloat16", (4, 8), (8, 1), 1, 0),  # slab
        TensorEntry("g", "bfloat16", (4, 8), (1, 4), 1, 256),  # stride
    ]
    t = TensorTable.from_entries(entries)
    assert [g.length for g in t.groups] == [2, 1, 1, 1, 1, 1]
    assert sorted(t) == sorted(entries)
    assert [(g.slab, g.offset) for g in t.groups] == sorted((g.slab, g.offset) for g in t.groups)


def test_interleaved_shapes_still_group_by_shape() -> None:
    # Qwen-MoE style: gate/up/down of each expert side by side, two shapes alternating
    entries = []
    for i in range(64):
        base = 3 * 512 * i
        entries.append(TensorEntry(f"e.{i}.gate", "bfloat16", (16, 16), (16, 1), 0, base))
        entries.append(TensorEntry(f"e.{i}.up", "bfloat16", (16, 16), (16, 1), 0, base + 512))
        entries.append(TensorEntry(f"e.{i}.down", "bfloat16", (8, 32), (32, 1), 0, base + 1024))
    t = TensorTable.from_entries(entries)
    assert sorted(g.length for g in t.groups) == [64, 64, 64]  # gate, up (alternating, step 1536), down
    assert sorted(t) == sorted(entries)


def _wire(**changes: Any) -> dict[str, Any]:
    m = TensorTable.from_entries(_experts(4)).to_wire()
    m.update(changes)
    return m


def _le(values: list[int], width: int) -> bytes:
    return b"".join(v.to_bytes(width, "little") for v in values)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"counts": _le([3], 4)}, "sum to the 4 names"),
        ({"counts": _le([0], 4)}, "counts"),
        ({"counts": _le([4, 0], 4)}, "group column lengths differ"),
        ({"steps": _le([0], 8)}, "step > 0"),
        ({"steps": _le([257], 8)}, "multiple of its element size"),
        ({"offsets": _le([1], 8)}, "multiple of its element size"),
        ({"offsets": _le([4096 - 3 * 256 - 62], 8)}, "runs past the end"),
        ({"steps": _le([1 << 40], 8)}, "runs past the end"),
        ({"slabs": _le([1], 4)}, "slab index past"),
        ({"names": ["a", "a", "b", "c"]}, "duplicate tensor name"),
        ({"names": ["a", "b", "c"]}, "sum to the 3 names"),
        ({"names": ["a", 7, "b", "c"]}, "names must be strings"),
        ({"names": ["a", b"x", "b", "c"]}, "names must be strings"),
        ({"names": ["a", None, "b", "c"]}, "names must be strings"),
        ({"names": ["a", "", "b", "c"]}, "names must be strings"),
        ({"names": ["a", "x" * 1025, "b", "c"]}, "names must be strings"),
        ({"dtypes": ["complex32"]}, "unknown dtype"),
        ({"dtype_index": b"\x01"}, "index past the dtype table"),
        ({"ranks": b"\x03"}, "column lengths differ"),
        ({"shapes": _le([4, 1 << 48], 8)}, "below 2\\*\\*48"),
        ({"steps": b"\x00" * 7}, "column lengths differ"),
    ],
)
def test_decoder_rejects(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        TensorTable.from_wire(_wire(**changes), [4096])


@pytest.mark.parametrize("at", [0, 2047, 2048, 4999])
@pytest.mark.parametrize("bad", [7, b"x", None, ("a",), {"a": 1}])
def test_a_name_that_is_not_a_string_is_refused_wherever_it_is(at: int, bad: Any) -> None:
    """The names' type check runs slice by slice (table._JOIN_SLICE): a bad name in any slice, the last included."""
    entries = _experts(5000)
    m = TensorTable.from_entries(entries).to_wire()
    names = list(m["names"])
    names[at] = bad
    with pytest.raises(RemoteProtocolError, match="names must be strings"):
        TensorTable.from_wire({**m, "names": tuple(names)}, [256 * 5000])
    assert len(TensorTable.from_wire(m, [256 * 5000])) == 5000


def test_decoder_accepts_the_exact_fit_and_empty_tensors() -> None:
    assert len(TensorTable.from_wire(_wire(), [3 * 256 + 64])) == 4
    empty = TensorTable.from_entries([TensorEntry("z", "float32", (0, 5), (5, 1), 0, 16)])
    assert TensorTable.from_wire(empty.to_wire(), [16]) == empty  # at the slab's end: a view can be made there


def _one(shape: tuple[int, ...], stride: tuple[int, ...], offset: int, *, n: int = 1, step: int = 0) -> dict[str, Any]:
    table = TensorTable(tuple(f"t{i}" for i in range(n)), (TensorGroup("uint8", shape, stride, 0, offset, step, n),))
    return table.to_wire()


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        # zero strides: an extent of one element, 2**80 of them (torch: "numel: integer multiplication overflow")
        (_one((1 << 40, 1 << 40), (0, 0), 0), "below 2\\*\\*63"),
        (_one((1 << 47, 1 << 16), (0, 0), 0), "below 2\\*\\*63"),
        # an empty tensor is still a view at its offset (torch: "Overflow when unpacking long long")
        (_one((0,), (1,), 1 << 63), "runs past the end"),
        (_one((0,), (1,), 4097), "runs past the end"),
        # a group of empty tensors whose last one is past the slab (torch: TypeError)
        (_one((0,), (1,), 0, n=2, step=(1 << 64) - 1), "runs past the end"),
        # four tensors of 2**62 bytes each, each within the bound: their stacked view has 2**64 elements (torch:
        # "numel: integer multiplication overflow" on any name's look-up, groups(), materialize())
        (_one((1 << 47, 1 << 15), (0, 0), 0, n=4, step=1), "below 2\\*\\*63"),
        (_one((1 << 47, 1 << 15), (0, 0), 0, n=2, step=1), "below 2\\*\\*63"),  # 2**63 bytes exactly
        # an empty tensor whose other dimensions multiply past 2**63 (torch multiplies them one at a time:
        # "numel: integer multiplication overflow" on the look-up, after a fetch that succeeded)
        (_one((1 << 47, 1 << 47, 0), (0, 0, 1), 0), "below 2\\*\\*63"),
        (_one((0, 1 << 32, 1 << 31), (0, 0, 1), 0), "below 2\\*\\*63"),
        # a group of one whose step, its stacked view's first stride, is no int64 (torch: TypeError "Overflow when
        # unpacking long long" from groups()), or any step but 0 (§4.6)
        (_one((4,), (1,), 0, step=(1 << 64) - 1), "a group of one tensor has step 0"),
        (_one((4,), (1,), 0, step=1 << 63), "a group of one tensor has step 0"),
        (_one((4,), (1,), 0, step=256), "a group of one tensor has step 0"),
    ],
)
def test_decoder_rejects_tables_torch_cannot_view(wire: dict[str, Any], match: str) -> None:
    """A table whose views torch cannot make is the daemon's error (RemoteProtocolError, a WCacheError: the engine
    falls back to disk), not a RuntimeError or ValueError when the engine first reads the tensor."""
    with pytest.raises(RemoteProtocolError, match=match):
        TensorTable.from_wire(wire, [4096])
    TensorTable.from_wire(_one((1 << 20, 1 << 20), (0, 0), 0), [4096])  # zero strides within the int64 bound
    # a group's bytes just below the bound: two tensors of 2**62 - 2**47 bytes
    TensorTable.from_wire(_one((1 << 47, (1 << 15) - 1), (0, 0), 0, n=2, step=1), [4096])
    # an empty tensor whose non-zero dimensions stay within it (tests/client/test_mapping.py makes its view)
    TensorTable.from_wire(_one((1 << 30, 1 << 29, 0), (0, 0, 1), 0), [4096])


def test_version_1_clients_get_unsupported_version() -> None:
    """Version 1 (per-tensor columns, pre-release) is not spoken any more: a clear error, not a misparse."""
    s = Connection(Role.SERVER)
    with pytest.raises(UnsupportedVersionError):
        s.hello_reply(Hello(versions=(1,)), software="", backend="host", device=DeviceInfo("cpu"))
