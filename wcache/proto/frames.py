"""Typed frames of protocol version 2 (docs/protocol.md §4) and their one encoder/decoder.

Each frame is a frozen dataclass (``@record``, see ``_record.py``: nothing compiled at import)
with ``TYPE`` (the wire value of the ``type`` field), ``to_wire()`` -> map and
``from_wire(map)`` -> frame. ``from_wire`` validates every field's type and range and raises :class:`~wcache.errors.ProtocolError` naming the frame and field;
unknown fields are ignored so that newer peers may add fields with defaults
(schema evolution: a field never changes type; new fields always have a default).
"""

from __future__ import annotations

import math
import operator
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import field
from itertools import accumulate, chain, repeat
from typing import Any, ClassVar, NamedTuple, Union, get_args

from wcache.errors import ErrorCode, ProtocolError, WCacheError
from wcache.proto._record import record
from wcache.proto.codec import Preencoded

__all__ = [
    "DTYPE_SIZES",
    "MODES",
    "SLAB_KINDS",
    "DeviceInfo",
    "ErrorFrame",
    "Evict",
    "Evicted",
    "Frame",
    "GetState",
    "Hello",
    "HelloOk",
    "LeaseInfo",
    "ModelInfo",
    "Preload",
    "Preloaded",
    "Release",
    "Released",
    "SlabDescriptor",
    "State",
    "Status",
    "StatusReply",
    "TakeoverState",
    "Takeover",
    "HandedModel",
    "Keep",
    "Kept",
    "MAX_KEPT_FDS",
    "Reclaim",
    "Reclaimed",
    "Unkeep",
    "TensorEntry",
    "TensorGroup",
    "TensorTable",
    "decode_frame",
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
MODES = ("zero_copy", "copy")
#: How a slab is exported: a shared-memory fd, a legacy CUDA IPC handle, or a CUDA VMM fd.
SLAB_KINDS = ("memfd", "cuda_ipc", "cuda_vmm")

MAX_NAME = 1024  # bytes of a tensor name or key string
MAX_PATH = 4096  # bytes of a file system path
MAX_DIMS = 16
MAX_VERSIONS = 16
KeyMap = dict[str, Union[str, int]]


def _fail(frame: str, fld: str, what: str) -> ProtocolError:
    return ProtocolError(f"{frame}.{fld}: {what}", details={"frame": frame, "field": fld})


class _Fields:
    """Typed, validated access to one decoded map; failures name frame and field."""

    __slots__ = ("frame", "m")
    _REQUIRED: ClassVar[object] = object()

    def __init__(self, frame: str, m: Any) -> None:
        if not isinstance(m, dict):
            raise ProtocolError(f"{frame}: expected a map, got {type(m).__name__}")
        self.frame = frame
        self.m = m

    def _get(self, name: str, default: Any) -> Any:
        if name in self.m:
            return self.m[name]
        if default is _Fields._REQUIRED:
            raise _fail(self.frame, name, "missing")
        return default

    def integer(self, name: str, default: Any = _REQUIRED, lo: int = 0, hi: int = 2**63 - 1) -> int:
        v = self._get(name, default)
        if type(v) is not int or not lo <= v <= hi:
            raise _fail(self.frame, name, f"expected an integer in [{lo}, {hi}]")
        return v

    def string(self, name: str, default: Any = _REQUIRED, max_len: int = MAX_NAME) -> str:
        v = self._get(name, default)
        if type(v) is not str or len(v) > max_len:
            raise _fail(self.frame, name, f"expected a string of at most {max_len} characters")
        return v

    def choice(self, name: str, options: Sequence[str], default: Any = _REQUIRED) -> str:
        v = self.string(name, default)
        if v not in options:
            raise _fail(self.frame, name, f"expected one of {list(options)}, got {v!r}")
        return v

    def boolean(self, name: str, default: Any = _REQUIRED) -> bool:
        v = self._get(name, default)
        if type(v) is not bool:
            raise _fail(self.frame, name, "expected a boolean")
        return v

    def number(self, name: str, default: Any = _REQUIRED) -> float:
        v = self._get(name, default)
        if type(v) is int:
            v = float(v)
        if type(v) is not float or not math.isfinite(v):
            raise _fail(self.frame, name, "expected a finite number")
        return v

    def binary(self, name: str, default: Any = _REQUIRED, max_len: int = 4096) -> bytes:
        v = self._get(name, default)
        if type(v) is not bytes or len(v) > max_len:
            raise _fail(self.frame, name, f"expected bin of at most {max_len} bytes")
        return v

    def array(self, name: str, default: Any = _REQUIRED) -> Sequence[Any]:
        v = self._get(name, default)
        if type(v) is not tuple and type(v) is not list:
            raise _fail(self.frame, name, "expected an array")
        return v

    def mapping(self, name: str, default: Any = _REQUIRED) -> dict[str, Any]:
        v = self._get(name, default)
        if type(v) is not dict or any(type(k) is not str for k in v):
            raise _fail(self.frame, name, "expected a map with string keys")
        return v

    def key(self, name: str) -> KeyMap:
        v = self.mapping(name)
        for k, x in v.items():
            if len(k) > MAX_NAME or not (type(x) is str or type(x) is int):
                raise _fail(self.frame, name, f"key field {k[:64]!r} must be a string or integer")
            if type(x) is str and len(x) > MAX_NAME:
                raise _fail(self.frame, name, f"key field {k[:64]!r} is too long")
        return v

    def str_map(self, name: str, default: Any = _REQUIRED) -> dict[str, str]:
        v = self.mapping(name, default)
        for k, x in v.items():
            if type(x) is not str or len(k) > MAX_NAME or len(x) > MAX_NAME:
                raise _fail(self.frame, name, "expected a map of strings to strings")
        return v


def _plain(frame: str, fld: str, v: Any, depth: int = 0) -> Any:
    """Validate free-form ERROR details and return them with arrays as lists.

    Allowed: nested maps (str keys) and arrays of str, int, float, bool, nil, bin; depth <= 8.
    """
    if depth > 8:
        raise _fail(frame, fld, "nested too deeply")
    if v is None or type(v) in (str, int, float, bool, bytes):
        return v
    if type(v) is list or type(v) is tuple:
        return [_plain(frame, fld, x, depth + 1) for x in v]
    if type(v) is dict:
        if any(type(k) is not str for k in v):
            raise _fail(frame, fld, "map keys must be strings")
        return {k: _plain(frame, fld, x, depth + 1) for k, x in v.items()}
    raise _fail(frame, fld, f"unsupported value type {type(v).__name__}")


# --------------------------------------------------------------------------- shared parts


@record
class DeviceInfo:
    """Where the daemon's slabs live. ``uuid`` identifies a GPU across CUDA_VISIBLE_DEVICES."""

    kind: str  # "cpu" | "cuda"
    index: int = 0
    uuid: str = ""
    name: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "index": self.index, "uuid": self.uuid, "name": self.name}

    @classmethod
    def from_wire(cls, m: Any) -> DeviceInfo:
        f = _Fields("DeviceInfo", m)
        return cls(
            kind=f.choice("kind", ("cpu", "cuda")),
            index=f.integer("index", 0, hi=1 << 16),
            uuid=f.string("uuid", ""),
            name=f.string("name", ""),
        )


@record
class SlabDescriptor:
    """One exported slab (docs/protocol.md §4.4).

    ``fd`` is the position of this slab's file descriptor among those passed with the
    STATE frame via SCM_RIGHTS, or -1 when the slab travels as ``handle`` bytes.
    ``offset`` is where the slab starts inside the exported allocation.
    """

    size: int
    kind: str
    fd: int = -1
    handle: bytes = b""
    offset: int = 0
    device_uuid: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "kind": self.kind,
            "fd": self.fd,
            "handle": self.handle,
            "offset": self.offset,
            "device_uuid": self.device_uuid,
        }

    @classmethod
    def from_wire(cls, m: Any) -> SlabDescriptor:
        f = _Fields("SlabDescriptor", m)
        return cls(
            size=f.integer("size"),
            kind=f.choice("kind", SLAB_KINDS),
            fd=f.integer("fd", -1, lo=-1, hi=253),
            handle=f.binary("handle", b""),
            offset=f.integer("offset", 0),
            device_uuid=f.string("device_uuid", ""),
        )


class TensorEntry(NamedTuple):
    """One tensor of a STATE frame: a strided view into slab ``slab`` at byte ``offset``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    slab: int
    offset: int


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
        raise _fail("TensorTable", what, f"length {len(data)} is not a multiple of {a.itemsize}")
    a.frombytes(data)
    if _BIG_ENDIAN:
        a.byteswap()
    return a


_BIG_ENDIAN = sys.byteorder == "big"


class TensorGroup(NamedTuple):
    """``length`` tensors of one dtype, shape and stride, ``step`` bytes apart in one slab.

    Tensor ``j`` of the group (0-based) starts at byte ``offset + j * step``. MoE experts and
    layer stacks form long groups, so a client builds them with one stacked view instead of
    one view per tensor; ``step`` is 0 when ``length`` is 1. On the wire: ``counts``.
    """

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    slab: int
    offset: int
    step: int
    length: int


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
        steps > 0 in groups of several; every non-empty tensor's extent inside its slab.
        """
        f = _Fields("TensorTable", m)
        names = tuple(f.array("names"))
        table = tuple(f.array("dtypes"))
        limit = 1 << 31
        dix = f.binary("dtype_index", max_len=limit)
        ranks = f.binary("ranks", max_len=limit)
        raw_counts = f.binary("counts", max_len=limit)
        n, g = len(names), len(dix)
        if len(ranks) != g or len(raw_counts) != 4 * g:
            raise _fail("TensorTable", "dtype_index", "group column lengths differ")
        counts = _from_le("I", raw_counts, "counts")
        if (g and min(counts) == 0) or sum(counts) != n:
            raise _fail("TensorTable", "counts", f"group counts must be >= 1 and sum to the {n} names")
        if n == 0:
            return cls((), ())
        lengths = set(map(len, names)) if set(map(type, names)) == {str} else {0}
        if min(lengths) == 0 or max(lengths) > MAX_NAME:
            raise _fail("TensorTable", "names", f"tensor names must be strings of 1..{MAX_NAME} characters")
        if len(set(names)) != n:
            raise _fail("TensorTable", "names", "duplicate tensor name")
        if not table or any(type(d) is not str or d not in DTYPE_SIZES for d in table):
            raise _fail("TensorTable", "dtypes", f"unknown dtype in {[str(d)[:32] for d in table[:8]]}")
        if max(dix) >= len(table):
            raise _fail("TensorTable", "dtype_index", "index past the dtype table")
        if max(ranks) > MAX_DIMS:
            raise _fail("TensorTable", "ranks", f"rank above {MAX_DIMS}")
        total = sum(ranks)
        raw_shape, raw_stride = f.binary("shapes", max_len=limit), f.binary("strides", max_len=limit)
        raw_slabs, raw_offsets = f.binary("slabs", max_len=limit), f.binary("offsets", max_len=limit)
        raw_steps = f.binary("steps", max_len=limit)
        if (
            len(raw_shape) != 8 * total
            or len(raw_stride) != 8 * total
            or len(raw_slabs) != 4 * g
            or len(raw_offsets) != 8 * g
            or len(raw_steps) != 8 * g
        ):
            raise _fail("TensorTable", "shapes", "column lengths differ from the groups/ranks")
        for raw, what in ((raw_shape, "shapes"), (raw_stride, "strides")):
            # < 2**48 <=> the two high bytes of every little-endian uint64 are zero (C-speed count)
            if raw[6::8].count(0) != total or raw[7::8].count(0) != total:
                raise _fail("TensorTable", what, "entries must be below 2**48")
        slabs = _from_le("I", raw_slabs, "slabs")
        if max(slabs) >= len(slab_sizes):
            raise _fail("TensorTable", "slabs", f"slab index past the {len(slab_sizes)} slab(s)")
        flat_shape = _from_le("Q", raw_shape, "shapes")
        flat_stride = _from_le("Q", raw_stride, "strides")
        offsets = _from_le("Q", raw_offsets, "offsets")
        steps = _from_le("Q", raw_steps, "steps")
        dtypes = tuple(map(table.__getitem__, dix))
        sizes = tuple(map(DTYPE_SIZES.__getitem__, dtypes))
        if any(map(operator.mod, offsets, sizes)) or any(map(operator.mod, steps, sizes)):
            raise _fail("TensorTable", "offsets", "an offset or step is not a multiple of its element size")
        if any(c > 1 and s == 0 for c, s in zip(counts, steps)):
            raise _fail("TensorTable", "steps", "a group of several tensors needs a step > 0")
        shapes = _split(flat_shape.tolist(), ranks)
        strides = _split(flat_stride.tolist(), ranks)
        spans = _spans(flat_shape, flat_stride, ranks, shapes, strides, dtypes)
        # a group's last tensor ends at offset + (count - 1) * step + span (empty tensors span 0)
        lasts = map(operator.add, offsets, map(operator.mul, steps, map(operator.sub, counts, repeat(1))))
        ends = map(lambda e, s: e + s if s else 0, lasts, spans)
        if not all(map(operator.le, ends, map(slab_sizes.__getitem__, slabs))):
            raise _fail("TensorTable", "offsets", "a tensor runs past the end of its slab")
        groups = tuple(map(TensorGroup._make, zip(dtypes, shapes, strides, slabs, offsets, steps, counts)))
        return cls(names, groups)


@record
class ModelInfo:
    """One served model in a STATUS_REPLY."""

    key: KeyMap
    backend: str
    bytes: int
    tensors: int
    leases: int
    load_seconds: float = 0.0
    last_use: float = 0.0  # unix time of the last GET_STATE, 0 if never

    def to_wire(self) -> dict[str, Any]:
        return {
            "key": dict(self.key),
            "backend": self.backend,
            "bytes": self.bytes,
            "tensors": self.tensors,
            "leases": self.leases,
            "load_seconds": self.load_seconds,
            "last_use": self.last_use,
        }

    @classmethod
    def from_wire(cls, m: Any) -> ModelInfo:
        f = _Fields("ModelInfo", m)
        return cls(
            key=f.key("key"),
            backend=f.string("backend"),
            bytes=f.integer("bytes"),
            tensors=f.integer("tensors"),
            leases=f.integer("leases"),
            load_seconds=f.number("load_seconds", 0.0),
            last_use=f.number("last_use", 0.0),
        )


@record
class LeaseInfo:
    """One live lease in a STATUS_REPLY."""

    lease: int
    mode: str
    pid: int
    age_seconds: float

    def to_wire(self) -> dict[str, Any]:
        return {"lease": self.lease, "mode": self.mode, "pid": self.pid, "age_seconds": self.age_seconds}

    @classmethod
    def from_wire(cls, m: Any) -> LeaseInfo:
        f = _Fields("LeaseInfo", m)
        return cls(
            lease=f.integer("lease"),
            mode=f.choice("mode", MODES),
            pid=f.integer("pid", 0),
            age_seconds=f.number("age_seconds", 0.0),
        )


# --------------------------------------------------------------------------- frames


@record
class Hello:
    """Client -> daemon, first frame: the protocol versions the client speaks."""

    TYPE: ClassVar[str] = "HELLO"
    versions: tuple[int, ...]
    software: str = ""
    name: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "versions": list(self.versions), "software": self.software, "name": self.name}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Hello:
        f = _Fields(cls.TYPE, m)
        versions = f.array("versions")
        if not 0 < len(versions) <= MAX_VERSIONS or any(type(v) is not int or not 0 < v < 2**31 for v in versions):
            raise _fail(cls.TYPE, "versions", f"expected 1..{MAX_VERSIONS} positive integers")
        return cls(tuple(versions), f.string("software", ""), f.string("name", ""))


@record
class HelloOk:
    """Daemon -> client: the chosen version and what the daemon serves from where."""

    TYPE: ClassVar[str] = "HELLO_OK"
    version: int
    software: str
    backend: str  # "host" | "cuda"
    device: DeviceInfo
    max_frame_size: int
    server_pid: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "version": self.version,
            "software": self.software,
            "backend": self.backend,
            "device": self.device.to_wire(),
            "max_frame_size": self.max_frame_size,
            "server_pid": self.server_pid,
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> HelloOk:
        f = _Fields(cls.TYPE, m)
        return cls(
            version=f.integer("version", lo=1, hi=2**31 - 1),
            software=f.string("software", ""),
            backend=f.choice("backend", ("host", "cuda")),
            device=DeviceInfo.from_wire(f.mapping("device")),
            max_frame_size=f.integer("max_frame_size", lo=1, hi=2**32 - 1),
            server_pid=f.integer("server_pid", 0),
        )


@record
class GetState:
    """Client -> daemon: lease the weights served under ``key``."""

    TYPE: ClassVar[str] = "GET_STATE"
    id: int
    key: KeyMap
    mode: str = "zero_copy"
    device_uuid: str = ""  # the client's GPU; "" = no check (host backend)

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "id": self.id,
            "key": dict(self.key),
            "mode": self.mode,
            "device_uuid": self.device_uuid,
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> GetState:
        f = _Fields(cls.TYPE, m)
        return cls(
            id=f.integer("id", lo=1),
            key=f.key("key"),
            mode=f.choice("mode", MODES, "zero_copy"),
            device_uuid=f.string("device_uuid", ""),
        )


def _aliases(f: _Fields, frame: str, tensors: TensorTable) -> dict[str, str]:
    """The optional ``aliases`` map: each a new name (not a tensor's) for an existing tensor."""
    aliases = f.str_map("aliases", {})
    known = set(tensors.names) if aliases else set()
    for a, t in aliases.items():
        if a in known or t not in known:
            raise _fail(frame, "aliases", f"alias {a[:64]!r} -> {t[:64]!r} is not a new name for a tensor")
    return aliases


@record
class State:
    """Daemon -> client: a lease and everything needed to map the weights."""

    TYPE: ClassVar[str] = "STATE"
    id: int
    lease: int
    key: KeyMap
    mode: str
    slabs: tuple[SlabDescriptor, ...]
    tensors: TensorTable
    aliases: dict[str, str] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "id": self.id,
            "lease": self.lease,
            "key": dict(self.key),
            "mode": self.mode,
            "slabs": [s.to_wire() for s in self.slabs],
            "tensors": self.tensors.encoded(),
            "aliases": dict(self.aliases),
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> State:
        f = _Fields(cls.TYPE, m)
        slabs = tuple(SlabDescriptor.from_wire(s) for s in f.array("slabs"))
        if len(slabs) > 1024:
            raise _fail(cls.TYPE, "slabs", "more than 1024 slabs")
        fds = [s.fd for s in slabs if s.fd >= 0]
        if sorted(fds) != list(range(len(fds))):
            raise _fail(cls.TYPE, "slabs", "fd positions must be 0..n-1, each once")
        tensors = TensorTable.from_wire(f.mapping("tensors"), [s.size for s in slabs])
        aliases = _aliases(f, cls.TYPE, tensors)
        return cls(
            id=f.integer("id", lo=1),
            lease=f.integer("lease", lo=1),
            key=f.key("key"),
            mode=f.choice("mode", MODES),
            slabs=slabs,
            tensors=tensors,
            aliases=aliases,
        )

    @property
    def fd_count(self) -> int:
        """How many file descriptors travel with this frame (SCM_RIGHTS)."""
        return sum(1 for s in self.slabs if s.fd >= 0)


@record
class Release:
    """Client -> daemon: end a lease held by this connection."""

    TYPE: ClassVar[str] = "RELEASE"
    id: int
    lease: int

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "lease": self.lease}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Release:
        f = _Fields(cls.TYPE, m)
        return cls(id=f.integer("id", lo=1), lease=f.integer("lease", lo=1))


@record
class Released:
    """Daemon -> client: the lease is over; ``leases_left`` on that model, all clients."""

    TYPE: ClassVar[str] = "RELEASED"
    id: int
    lease: int
    leases_left: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "lease": self.lease, "leases_left": self.leases_left}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Released:
        f = _Fields(cls.TYPE, m)
        return cls(id=f.integer("id", lo=1), lease=f.integer("lease", lo=1), leases_left=f.integer("leases_left", 0))


@record
class Status:
    """Client -> daemon: report what is served (operators)."""

    TYPE: ClassVar[str] = "STATUS"
    id: int

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Status:
        return cls(id=_Fields(cls.TYPE, m).integer("id", lo=1))


@record
class StatusReply:
    """Daemon -> client: models, leases, connections, uptime."""

    TYPE: ClassVar[str] = "STATUS_REPLY"
    id: int
    software: str
    backend: str
    device: DeviceInfo
    uptime_seconds: float
    connections: int
    models: tuple[ModelInfo, ...] = ()
    leases: tuple[LeaseInfo, ...] = ()
    device_free_bytes: int = 0  # free memory of the daemon's GPU (0 for the host backend)
    device_total_bytes: int = 0
    tier_bytes: int = 0  # bytes in the host-memory tier (--host-tier), 0 when off
    tier_budget: int = 0
    tier_entries: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "id": self.id,
            "software": self.software,
            "backend": self.backend,
            "device": self.device.to_wire(),
            "uptime_seconds": self.uptime_seconds,
            "connections": self.connections,
            "models": [x.to_wire() for x in self.models],
            "leases": [x.to_wire() for x in self.leases],
            "device_free_bytes": self.device_free_bytes,
            "device_total_bytes": self.device_total_bytes,
            "tier_bytes": self.tier_bytes,
            "tier_budget": self.tier_budget,
            "tier_entries": self.tier_entries,
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> StatusReply:
        f = _Fields(cls.TYPE, m)
        return cls(
            id=f.integer("id", lo=1),
            software=f.string("software", ""),
            backend=f.choice("backend", ("host", "cuda")),
            device=DeviceInfo.from_wire(f.mapping("device")),
            uptime_seconds=f.number("uptime_seconds"),
            connections=f.integer("connections"),
            models=tuple(ModelInfo.from_wire(x) for x in f.array("models", [])),
            leases=tuple(LeaseInfo.from_wire(x) for x in f.array("leases", [])),
            device_free_bytes=f.integer("device_free_bytes", 0),
            device_total_bytes=f.integer("device_total_bytes", 0),
            tier_bytes=f.integer("tier_bytes", 0),
            tier_budget=f.integer("tier_budget", 0),
            tier_entries=f.integer("tier_entries", 0),
        )


@record
class ErrorFrame:
    """Either direction: a request failed (``id`` > 0) or the connection did (``id`` 0).

    ``fatal`` means the sender closes the connection right after this frame.
    """

    TYPE: ClassVar[str] = "ERROR"
    id: int
    code: int
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    fatal: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "id": self.id,
            "code": self.code,
            "message": self.message,
            "details": dict(self.details),
            "fatal": self.fatal,
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> ErrorFrame:
        f = _Fields(cls.TYPE, m)
        details = _plain(cls.TYPE, "details", f.mapping("details", {}))
        return cls(
            id=f.integer("id", 0),
            code=f.integer("code", hi=2**31 - 1),
            message=f.string("message", "", max_len=65536),
            details=details,
            fatal=f.boolean("fatal", False),
        )

    @classmethod
    def from_exception(cls, exc: WCacheError, id: int = 0, *, fatal: bool = False) -> ErrorFrame:
        return cls(id=id, code=int(exc.code), message=exc.message[:65536], details=exc.details, fatal=fatal)

    @property
    def error_code(self) -> ErrorCode | int:
        try:
            return ErrorCode(self.code)
        except ValueError:
            return self.code


@record
class Preload:
    """Client -> daemon: load a checkpoint directory (on the daemon's machine) for one rank and keep it."""

    TYPE: ClassVar[str] = "PRELOAD"
    id: int
    model: str
    tp_rank: int = 0
    tp_size: int = 1
    dtype: str = "auto"
    plan_file: str = ""
    transform: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "id": self.id,
            "model": self.model,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "dtype": self.dtype,
            "plan_file": self.plan_file,
            "transform": self.transform,
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Preload:
        f = _Fields(cls.TYPE, m)
        tp_size = f.integer("tp_size", 1, lo=1, hi=1 << 16)
        return cls(
            id=f.integer("id", lo=1),
            model=f.string("model", max_len=MAX_PATH),
            tp_rank=f.integer("tp_rank", 0, hi=tp_size - 1),
            tp_size=tp_size,
            dtype=f.string("dtype", "auto"),
            plan_file=f.string("plan_file", "", max_len=MAX_PATH),
            transform=f.string("transform", ""),
        )


@record
class Preloaded:
    """Daemon -> client: the model is resident (``load_seconds`` 0 if it already was)."""

    TYPE: ClassVar[str] = "PRELOADED"
    id: int
    key: KeyMap
    bytes: int
    tensors: int
    load_seconds: float = 0.0
    evicted: tuple[KeyMap, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "id": self.id,
            "key": dict(self.key),
            "bytes": self.bytes,
            "tensors": self.tensors,
            "load_seconds": self.load_seconds,
            "evicted": [dict(k) for k in self.evicted],
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Preloaded:
        f = _Fields(cls.TYPE, m)
        evicted = tuple(_Fields(cls.TYPE, {"key": k}).key("key") for k in f.array("evicted", ()))
        return cls(
            id=f.integer("id", lo=1),
            key=f.key("key"),
            bytes=f.integer("bytes"),
            tensors=f.integer("tensors"),
            load_seconds=f.number("load_seconds", 0.0),
            evicted=evicted,
        )


@record
class Evict:
    """Client -> daemon: drop the model served under ``key`` (refused while leases hold it)."""

    TYPE: ClassVar[str] = "EVICT"
    id: int
    key: KeyMap

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "key": dict(self.key)}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Evict:
        f = _Fields(cls.TYPE, m)
        return cls(id=f.integer("id", lo=1), key=f.key("key"))


@record
class Evicted:
    """Daemon -> client: the model is gone; ``bytes`` were freed."""

    TYPE: ClassVar[str] = "EVICTED"
    id: int
    key: KeyMap
    bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "key": dict(self.key), "bytes": self.bytes}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Evicted:
        f = _Fields(cls.TYPE, m)
        return cls(id=f.integer("id", lo=1), key=f.key("key"), bytes=f.integer("bytes"))


@record
class HandedModel:
    """One model in a TAKEOVER_STATE: everything a new daemon needs to serve it."""

    key: KeyMap
    slabs: tuple[SlabDescriptor, ...]
    tensors: TensorTable
    aliases: dict[str, str] = field(default_factory=dict)
    payload: int = 0
    load_seconds: float = 0.0
    source: str = ""  # the checkpoint directory it was loaded from ("" unknown)

    def to_wire(self) -> dict[str, Any]:
        return {
            "key": dict(self.key),
            "slabs": [s.to_wire() for s in self.slabs],
            "tensors": self.tensors.to_wire(),
            "aliases": dict(self.aliases),
            "payload": self.payload,
            "load_seconds": self.load_seconds,
            "source": self.source,
        }

    @classmethod
    def from_wire(cls, m: Any) -> HandedModel:
        f = _Fields("HandedModel", m)
        slabs = tuple(SlabDescriptor.from_wire(s) for s in f.array("slabs"))
        if not 1 <= len(slabs) <= MAX_HANDOFF_FDS:
            raise _fail("HandedModel", "slabs", f"expected 1..{MAX_HANDOFF_FDS} slabs")
        tensors = TensorTable.from_wire(f.mapping("tensors"), [s.size for s in slabs])
        aliases = _aliases(f, "HandedModel", tensors)
        return cls(
            key=f.key("key"),
            slabs=slabs,
            tensors=tensors,
            aliases=aliases,
            payload=f.integer("payload", 0),
            load_seconds=f.number("load_seconds", 0.0),
            source=f.string("source", "", max_len=MAX_PATH),
        )


#: File descriptors one TAKEOVER_STATE may carry (slabs + the listening socket): one recvmsg's worth.
MAX_HANDOFF_FDS = 16


@record
class Takeover:
    """New daemon -> running daemon: hand over your models and your listening socket, then exit."""

    TYPE: ClassVar[str] = "TAKEOVER"
    id: int
    backend: str  # the new daemon's backend ("host" | "cuda"): must be the running one's
    device_uuid: str = ""  # the new daemon's GPU: must be the running one's
    pid: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "id": self.id,
            "backend": self.backend,
            "device_uuid": self.device_uuid,
            "pid": self.pid,
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Takeover:
        f = _Fields(cls.TYPE, m)
        return cls(
            id=f.integer("id", lo=1),
            backend=f.string("backend"),
            device_uuid=f.string("device_uuid", ""),
            pid=f.integer("pid", 0),
        )


@record
class TakeoverState:
    """Running daemon -> new daemon: its models (slabs travel as fds) and its listening socket (an fd)."""

    TYPE: ClassVar[str] = "TAKEOVER_STATE"
    id: int
    models: tuple[HandedModel, ...]
    listener_fd: int
    pid: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "id": self.id,
            "models": [m.to_wire() for m in self.models],
            "listener_fd": self.listener_fd,
            "pid": self.pid,
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> TakeoverState:
        f = _Fields(cls.TYPE, m)
        models = tuple(HandedModel.from_wire(x) for x in f.array("models"))
        listener = f.integer("listener_fd", lo=0, hi=MAX_HANDOFF_FDS - 1)
        fds = [s.fd for x in models for s in x.slabs if s.fd >= 0] + [listener]
        if len(fds) > MAX_HANDOFF_FDS or sorted(fds) != list(range(len(fds))):
            raise _fail(cls.TYPE, "listener_fd", f"fd positions must be 0..n-1, each once, n <= {MAX_HANDOFF_FDS}")
        return cls(id=f.integer("id", lo=1), models=models, listener_fd=listener, pid=f.integer("pid", 0))

    @property
    def fd_count(self) -> int:
        return 1 + sum(1 for x in self.models for s in x.slabs if s.fd >= 0)


#: Slabs one KEEP or RECLAIMED may carry: one recvmsg's worth of descriptors.
MAX_KEPT_FDS = 16


def _kept_fds(frame: str, models: Sequence[HandedModel]) -> int:
    """Check that the slabs' fd positions are 0..n-1, each once, n <= MAX_KEPT_FDS; return n."""
    fds = [s.fd for x in models for s in x.slabs]
    if len(fds) > MAX_KEPT_FDS or sorted(fds) != list(range(len(fds))):
        raise _fail(frame, "models", f"slab fd positions must be 0..n-1, each once, n <= {MAX_KEPT_FDS}")
    return len(fds)


@record
class Keep:
    """Daemon -> keeper: hold this model's slabs (they travel as fds) for the daemon serving ``owner``."""

    TYPE: ClassVar[str] = "KEEP"
    id: int
    owner: str  # the depositing daemon's socket path: who may RECLAIM it
    backend: str
    device_uuid: str
    model: HandedModel
    pid: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "id": self.id,
            "owner": self.owner,
            "backend": self.backend,
            "device_uuid": self.device_uuid,
            "model": self.model.to_wire(),
            "pid": self.pid,
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Keep:
        f = _Fields(cls.TYPE, m)
        model = HandedModel.from_wire(f.mapping("model"))
        _kept_fds(cls.TYPE, [model])
        return cls(
            id=f.integer("id", lo=1),
            owner=f.string("owner", max_len=MAX_PATH),
            backend=f.string("backend"),
            device_uuid=f.string("device_uuid", ""),
            model=model,
            pid=f.integer("pid", 0),
        )

    @property
    def fd_count(self) -> int:
        return len(self.model.slabs)


@record
class Unkeep:
    """Daemon -> keeper: stop holding the model ``key`` of ``owner`` (evicted: its memory is freed)."""

    TYPE: ClassVar[str] = "UNKEEP"
    id: int
    owner: str
    key: KeyMap

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "owner": self.owner, "key": dict(self.key)}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Unkeep:
        f = _Fields(cls.TYPE, m)
        return cls(id=f.integer("id", lo=1), owner=f.string("owner", max_len=MAX_PATH), key=f.key("key"))


@record
class Kept:
    """Keeper -> daemon: the answer to KEEP and UNKEEP: what it now holds for ``owner``."""

    TYPE: ClassVar[str] = "KEPT"
    id: int
    models: int
    bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "models": self.models, "bytes": self.bytes}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Kept:
        f = _Fields(cls.TYPE, m)
        return cls(id=f.integer("id", lo=1), models=f.integer("models"), bytes=f.integer("bytes"))


@record
class Reclaim:
    """Daemon -> keeper, at start: the models kept for ``owner`` on this backend and device."""

    TYPE: ClassVar[str] = "RECLAIM"
    id: int
    owner: str
    backend: str
    device_uuid: str = ""
    pid: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "id": self.id,
            "owner": self.owner,
            "backend": self.backend,
            "device_uuid": self.device_uuid,
            "pid": self.pid,
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Reclaim:
        f = _Fields(cls.TYPE, m)
        return cls(
            id=f.integer("id", lo=1),
            owner=f.string("owner", max_len=MAX_PATH),
            backend=f.string("backend"),
            device_uuid=f.string("device_uuid", ""),
            pid=f.integer("pid", 0),
        )


@record
class Reclaimed:
    """Keeper -> daemon: the kept models (their slabs travel as fds; the keeper keeps holding them)
    and how many entries of ``owner`` it dropped because they were on another backend or device."""

    TYPE: ClassVar[str] = "RECLAIMED"
    id: int
    models: tuple[HandedModel, ...] = ()
    dropped: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "id": self.id, "models": [x.to_wire() for x in self.models], "dropped": self.dropped}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Reclaimed:
        f = _Fields(cls.TYPE, m)
        models = tuple(HandedModel.from_wire(x) for x in f.array("models", []))
        _kept_fds(cls.TYPE, models)
        return cls(id=f.integer("id", lo=1), models=models, dropped=f.integer("dropped", 0))

    @property
    def fd_count(self) -> int:
        return sum(len(x.slabs) for x in self.models)


Frame = Union[
    Hello,
    HelloOk,
    GetState,
    State,
    Release,
    Released,
    Status,
    StatusReply,
    ErrorFrame,
    Preload,
    Preloaded,
    Evict,
    Evicted,
    Takeover,
    TakeoverState,
    Keep,
    Unkeep,
    Kept,
    Reclaim,
    Reclaimed,
]
FRAME_TYPES: dict[str, Any] = {c.TYPE: c for c in get_args(Frame)}


def decode_frame(m: Mapping[str, Any]) -> Frame:
    """Turn a decoded frame map into its typed frame, or raise ProtocolError."""
    t = m.get("type")
    if type(t) is not str:
        raise ProtocolError("frame has no string 'type' field")
    cls = FRAME_TYPES.get(t)
    if cls is None:
        raise ProtocolError(f"unknown frame type {t[:64]!r}", details={"type": t[:64]})
    frame: Frame = cls.from_wire(m)
    return frame
