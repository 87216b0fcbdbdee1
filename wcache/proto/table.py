"""The tensor table of STATE and HandedModel (docs/protocol.md §4.6): columnar, grouped.

Tensors of one (slab, dtype, shape, stride) at a constant spacing form a :class:`TensorGroup`;
the numeric columns travel as little-endian integer arrays in msgpack bin fields, so a
50,000-tensor table encodes once and decodes and validates with C-level builtins in a few ms.
The field kinds of frames that carry one, ``Table`` and ``Aliases``, are ``fields.py``'s: this module imports no
declarations, and an engine's own frames (``engine``) decode their table here too.
"""

from __future__ import annotations

import math
import operator
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import field
from functools import partial
from itertools import accumulate, chain, repeat
from typing import TYPE_CHECKING, Any, NamedTuple

from wcache.proto._record import named_tuple, record
from wcache.proto.codec import Preencoded, fail
from wcache.proto.limits import MAX_DIMS, MAX_NAME

__all__ = [
    "DTYPE_SIZES",
    "MAX_DIMS",
    "TensorEntry",
    "TensorGroup",
    "TensorTable",
    "tensor_extent",
]

#: dtype name -> bytes per element. Names are torch's (``str(torch.bfloat16)[6:]``).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


# The tuples below are typing.NamedTuple classes for type checkers and ``named_tuple``'s at run time (the same
# behaviour without namedtuple's eval of a ``__new__``: tests/proto/test_record.py pins it).
if TYPE_CHECKING:

    class TensorEntry(NamedTuple):
        name: str
        dtype: str
        shape: tuple[int, ...]
        stride: tuple[int, ...]
        slab: int
        offset: int

else:
    TensorEntry = named_tuple(
        "TensorEntry",
        ("name", "dtype", "shape", "stride", "slab", "offset"),
        """One tensor of a STATE frame: a strided view into slab ``slab`` at byte ``offset``.""",
        __name__,
    )


def tensor_extent(dtype: str, shape: Sequence[int], stride: Sequence[int]) -> int:
    """Bytes a strided view spans from its first element: 0 for an empty tensor."""
    if any(s == 0 for s in shape):
        return 0
    span = 1
    for s, st in zip(shape, stride):
        span += (s - 1) * st
    return span * DTYPE_SIZES[dtype]


def _le_array(code: str, values: Iterable[int]) -> bytes:
    a = array(code, values)
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tobytes()


def _from_le(code: str, data: bytes, what: str) -> array[int]:
    a = array(code)
    if len(data) % a.itemsize:
        raise fail("TensorTable", what, f"length {len(data)} is not a multiple of {a.itemsize}")
    a.frombytes(data)
    if _BIG_ENDIAN:
        a.byteswap()
    return a


_BIG_ENDIAN = sys.byteorder == "big"


if TYPE_CHECKING:

    class TensorGroup(NamedTuple):
        dtype: str
        shape: tuple[int, ...]
        stride: tuple[int, ...]
        slab: int
        offset: int
        step: int
        length: int

else:
    TensorGroup = named_tuple(
        "TensorGroup",
        ("dtype", "shape", "stride", "slab", "offset", "step", "length"),
        """``length`` tensors of one dtype, shape and stride, ``step`` bytes apart in one slab.

Tensor ``j`` of the group (0-based) starts at byte ``offset + j * step``. MoE experts and
layer stacks form long groups, so a client builds them with one stacked view instead of
one view per tensor; ``step`` is 0 when ``length`` is 1. On the wire: ``counts``.
""",
        __name__,
    )

#: a TensorGroup from a tuple of its 7 fields in order, made in C (``_make`` is a Python call per group that counts
#: the fields too): the decoder's zip of its columns gives exactly those
_new_group = partial(tuple.__new__, TensorGroup)


def _spans(
    flat_shape: array[int],
    flat_stride: array[int],
    ranks: bytes,
    shapes: tuple[tuple[int, ...], ...],
    strides: tuple[tuple[int, ...], ...],
    dtypes: tuple[str, ...],
) -> Iterable[int]:
    """Bytes each group's view spans (``tensor_extent``), computed column-wise where possible."""
    itemsizes = map(DTYPE_SIZES.__getitem__, dtypes)
    r = ranks[0]
    if r and ranks.count(r) == len(ranks) and min(flat_shape) > 0:
        # one rank, no empty tensor: span = 1 + sum_d (shape_d - 1) * stride_d, one C pass per dim
        elems: Iterable[int] = repeat(1)
        for d in range(r):
            terms = map(operator.mul, map(operator.sub, flat_shape[d::r], repeat(1)), flat_stride[d::r])
            elems = map(operator.add, elems, terms)
        return map(operator.mul, elems, itemsizes)
    # mixed ranks: per distinct (shape, stride, dtype); real checkpoints repeat few shapes
    keys = list(zip(shapes, strides, dtypes))
    span_of = {k: tensor_extent(k[2], k[0], k[1]) for k in set(keys)}
    return map(span_of.__getitem__, keys)


def _split(flat: list[int], ranks: bytes) -> tuple[tuple[int, ...], ...]:
    """Cut a flat dimension list into one tuple per group."""
    r = ranks[0]
    if ranks.count(r) == len(ranks):  # one rank for all groups: the common, fast case
        if r == 0:
            return ((),) * len(ranks)
        return tuple(zip(*[iter(flat)] * r))
    bounds = list(accumulate(ranks, initial=0))
    return tuple(map(tuple, map(flat.__getitem__, map(slice, bounds[:-1], bounds[1:]))))


def _chains(offsets: list[int], step: int) -> list[list[int]]:
    """Cut sorted offsets into arithmetic progressions of ``step`` (each offset joins the chain
    ending ``step`` below it, if any)."""
    runs: list[list[int]] = []
    tail: dict[int, list[int]] = {}
    for o in offsets:
        run = tail.pop(o - step, None)
        if run is None:
            run = []
            runs.append(run)
        run.append(o)
        tail.setdefault(o, run)
    return runs


def _group(entries: Iterable[TensorEntry]) -> tuple[tuple[str, ...], tuple[TensorGroup, ...]]:
    """Tensors of one (slab, dtype, shape, stride) at a constant spacing become one group.

    Per class, the offsets are cut into arithmetic progressions for a few candidate steps
    (the distances from the first offset to the next four) and the cut with the fewest
    chains wins: MoE experts whose gate and up projections alternate form two groups, not
    one per expert. Groups are listed by (slab, offset), so a dense checkpoint's table
    keeps its layout order.
    """
    classes: dict[tuple[int, str, tuple[int, ...], tuple[int, ...]], dict[int, list[str]]] = {}
    for e in entries:
        at = classes.setdefault((e.slab, e.dtype, tuple(e.shape), tuple(e.stride)), {})
        at.setdefault(e.offset, []).append(e.name)
    runs: list[tuple[TensorGroup, list[str]]] = []
    for (slab, dtype, shape, stride), at in classes.items():
        offsets = sorted(at)
        size = DTYPE_SIZES[dtype]
        steps = {o - offsets[0] for o in offsets[1:5] if (o - offsets[0]) % size == 0}
        best = min((_chains(offsets, st) for st in sorted(steps)), key=len, default=[[o] for o in offsets])
        names = {o: iter(ns) for o, ns in at.items()}
        for run in best:
            step = run[1] - run[0] if len(run) > 1 else 0
            runs.append(
                (TensorGroup(dtype, shape, stride, slab, run[0], step, len(run)), [next(names[o]) for o in run])
            )
        # tensors sharing an offset (and shape) beyond the first: one group each
        for o, it in names.items():
            runs.extend((TensorGroup(dtype, shape, stride, slab, o, 0, 1), [n]) for n in it)
    runs.sort(key=lambda r: (r[0].slab, r[0].offset, r[1][0]))
    return tuple(chain.from_iterable(r[1] for r in runs)), tuple(r[0] for r in runs)


@record
class TensorTable:
    """The tensors of a STATE frame: names plus column-wise groups (``TensorGroup``).

    On the wire (docs/protocol.md §4.6) the numeric columns are packed little-endian
    integer arrays in msgpack bin fields, one entry per group, so a 50,000-tensor MoE
    table decodes and validates in a few milliseconds::

        names        array of str            n tensor names, group after group
        dtypes       array of str            the dtype table (distinct dtype names)
        dtype_index  bin, uint8 x g          index into dtypes
        ranks        bin, uint8 x g          number of dimensions
        shapes       bin, uint64 x sum(ranks) all dimensions, group after group
        strides      bin, uint64 x sum(ranks) all strides (in elements), same order
        slabs        bin, uint32 x g         slab index
        offsets      bin, uint64 x g         byte offset of the group's first tensor in the slab
        steps        bin, uint64 x g         bytes from one tensor of the group to the next
        counts       bin, uint32 x g         tensors in the group (>= 1, summing to n)
    """

    names: tuple[str, ...]
    groups: tuple[TensorGroup, ...]
    _encoded: list[Preencoded] = field(default_factory=list, compare=False, repr=False)

    def encoded(self) -> Preencoded:
        """The wire map, msgpack-encoded once per table (the daemon reuses it per STATE)."""
        if not self._encoded:
            self._encoded.append(Preencoded(self.to_wire()))
        return self._encoded[0]

    @classmethod
    def from_entries(cls, entries: Iterable[TensorEntry]) -> TensorTable:
        return cls(*_group(entries))

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[TensorEntry]:
        names = iter(self.names)
        for g in self.groups:
            for j in range(g.length):
                yield TensorEntry(next(names), g.dtype, g.shape, g.stride, g.slab, g.offset + j * g.step)

    def to_wire(self) -> dict[str, Any]:
        groups = self.groups
        table = sorted({g.dtype for g in groups})
        index = {d: i for i, d in enumerate(table)}
        return {
            "names": self.names,
            "dtypes": tuple(table),
            "dtype_index": bytes(index[g.dtype] for g in groups),
            "ranks": bytes(len(g.shape) for g in groups),
            "shapes": _le_array("Q", chain.from_iterable(g.shape for g in groups)),
            "strides": _le_array("Q", chain.from_iterable(g.stride for g in groups)),
            "slabs": _le_array("I", (g.slab for g in groups)),
            "offsets": _le_array("Q", (g.offset for g in groups)),
            "steps": _le_array("Q", (g.step for g in groups)),
            "counts": _le_array("I", (g.length for g in groups)),
        }

    @classmethod
    def from_wire(cls, m: Any, slab_sizes: Sequence[int]) -> TensorTable:
        """Validate column-wise with C-level builtins (a few ms for 50,000 names).

        Checks: consistent column lengths; unique names of 1..1024 characters; group counts
        >= 1 summing to the number of names; known dtypes; rank <= 16; dimensions and strides
        in [0, 2**48); slab indices in range; offsets and steps multiples of the element size,
        steps > 0 in groups of several and 0 in groups of one; every tensor's extent inside its slab (an empty
        one's offset too); every group's elements (its stacked view's: count times each tensor's, an empty tensor's
        non-zero dimensions multiplied) times its element size below 2**63.
        """
        if type(m) is not dict:
            raise fail("TensorTable", "", f"expected a map, got {type(m).__name__}")
        names = tuple(_array(m, "names"))
        table = tuple(_array(m, "dtypes"))
        dix = _column(m, "dtype_index")
        ranks = _column(m, "ranks")
        raw_counts = _column(m, "counts")
        n, g = len(names), len(dix)
        if len(ranks) != g or len(raw_counts) != 4 * g:
            raise fail("TensorTable", "dtype_index", "group column lengths differ")
        counts = _from_le("I", raw_counts, "counts")
        if (g and min(counts) == 0) or sum(counts) != n:
            raise fail("TensorTable", "counts", f"group counts must be >= 1 and sum to the {n} names")
        if n == 0:
            return cls((), ())
        try:
            # TypeError unless every name is a str, at C speed (0.2 ms for 50,000 names; a set of their types 0.9),
            # a slice at a time: one join of all would make a string of every name (2 MB for 50,000, ~1.5 ms of
            # fresh pages in a fresh engine), the slices' reuse the same small block
            for i in range(0, n, _JOIN_SLICE):
                "".join(names[i : i + _JOIN_SLICE])
            lengths = set(map(len, names))
        except TypeError:
            lengths = {0}
        if min(lengths) == 0 or max(lengths) > MAX_NAME:
            raise fail("TensorTable", "names", f"tensor names must be strings of 1..{MAX_NAME} characters")
        if len(set(names)) != n:
            raise fail("TensorTable", "names", "duplicate tensor name")
        if not table or any(type(d) is not str or d not in DTYPE_SIZES for d in table):
            raise fail("TensorTable", "dtypes", f"unknown dtype in {[str(d)[:32] for d in table[:8]]}")
        if max(dix) >= len(table):
            raise fail("TensorTable", "dtype_index", "index past the dtype table")
        if max(ranks) > MAX_DIMS:
            raise fail("TensorTable", "ranks", f"rank above {MAX_DIMS}")
        total = sum(ranks)
        raw_shape, raw_stride = _column(m, "shapes"), _column(m, "strides")
        raw_slabs, raw_offsets = _column(m, "slabs"), _column(m, "offsets")
        raw_steps = _column(m, "steps")
        if (
            len(raw_shape) != 8 * total
            or len(raw_stride) != 8 * total
            or len(raw_slabs) != 4 * g
            or len(raw_offsets) != 8 * g
            or len(raw_steps) != 8 * g
        ):
            raise fail("TensorTable", "shapes", "column lengths differ from the groups/ranks")
        for raw, what in ((raw_shape, "shapes"), (raw_stride, "strides")):
            # < 2**48 <=> the two high bytes of every little-endian uint64 are zero (C-speed count)
            if raw[6::8].count(0) != total or raw[7::8].count(0) != total:
                raise fail("TensorTable", what, "entries must be below 2**48")
        slabs = _from_le("I", raw_slabs, "slabs")
        if max(slabs) >= len(slab_sizes):
            raise fail("TensorTable", "slabs", f"slab index past the {len(slab_sizes)} slab(s)")
        flat_shape = _from_le("Q", raw_shape, "shapes")
        flat_stride = _from_le("Q", raw_stride, "strides")
        offsets = _from_le("Q", raw_offsets, "offsets")
        steps = _from_le("Q", raw_steps, "steps")
        dtypes = tuple(map(table.__getitem__, dix))
        sizes = tuple(map(DTYPE_SIZES.__getitem__, dtypes))
        if any(map(operator.mod, offsets, sizes)) or any(map(operator.mod, steps, sizes)):
            raise fail("TensorTable", "offsets", "an offset or step is not a multiple of its element size")
        # a group of several tensors is spaced (step > 0), a group of one is not (step 0: its stacked view's first
        # stride, step / s, must be an int64 too, and nothing else bounds it): a group has one tensor iff step is 0
        if any(map(operator.ne, map((1).__eq__, counts), map(operator.not_, steps))):
            if any(c > 1 and s == 0 for c, s in zip(counts, steps)):
                raise fail("TensorTable", "steps", "a group of several tensors needs a step > 0")
            raise fail("TensorTable", "steps", "a group of one tensor has step 0")
        shapes = _split(flat_shape.tolist(), ranks)
        strides = _split(flat_stride.tolist(), ranks)
        spans = _spans(flat_shape, flat_stride, ranks, shapes, strides, dtypes)
        # a group's last tensor ends at offset + (count - 1) * step + span (empty tensors span 0: their offset and
        # step inside the slab too, as a view is made at them)
        lasts = map(operator.add, offsets, map(operator.mul, steps, map(operator.sub, counts, repeat(1))))
        if not all(map(operator.le, map(operator.add, lasts, spans), map(slab_sizes.__getitem__, slabs))):
            raise fail("TensorTable", "offsets", "a tensor runs past the end of its slab")
        # a view's size in bytes is an int64 (torch's numel): zero strides could make a huge tensor of a small
        # extent, and a group's stacked view holds count of them. torch multiplies the dimensions one at a time,
        # so an empty tensor's other dimensions count too: the product of the non-zero ones (shape (2**47, 2**47, 0)
        # is empty, and torch refuses to make it)
        elements = list(map(math.prod, shapes))
        if 0 in elements:
            elements = [e or math.prod(filter(None, shape)) for e, shape in zip(elements, shapes)]
        if max(map(operator.mul, map(operator.mul, elements, sizes), counts)) >= _MAX_BYTES:
            raise fail(
                "TensorTable",
                "shapes",
                "a group's elements (count x each tensor's, an empty tensor's non-zero dimensions multiplied) "
                "times its element size must be below 2**63",
            )
        groups = tuple(map(_new_group, zip(dtypes, shapes, strides, slabs, offsets, steps, counts)))
        return cls(names, groups)


#: a tensor's size in bytes is below this (torch's sizes are int64)
_MAX_BYTES = 1 << 63

#: names type-checked per ``join`` in TensorTable.from_wire
_JOIN_SLICE = 2048


def _column(m: dict[str, Any], name: str, limit: int = 1 << 31) -> bytes:
    v = m.get(name)
    if type(v) is not bytes or len(v) > limit:
        raise fail("TensorTable", name, f"expected bin of at most {limit} bytes")
    return v


def _array(m: dict[str, Any], name: str) -> Sequence[Any]:
    v = m.get(name)
    if type(v) is not tuple and type(v) is not list:
        raise fail("TensorTable", name, "expected an array")
    return v
