"""Resharding for a fleet fill (docs/fleet.md, "Resharding"): which bytes of which source slab go where in the
target slab. Pure Python: no torch, no I/O, no NIXL.

Every slab of an untransformed key is a :class:`~wcache.plan.layout.Layout` the target can compute from the
checkpoint's headers alone: for each tensor its slice (``Placement.shard``: ``length`` entries of one
dimension from ``start``, or the whole tensor), its served dtype and its offset, C-contiguous. So a target
of any tensor-parallel layout is filled from sources of any other by intersecting, per tensor, the target's
slice with the sources' along the shard dimension:

- a dim-0 slice is one contiguous range in both slabs;
- a slice of dimension ``d > 0`` is ``prod(shape[:d])`` runs of ``(end - start) * prod(shape[d+1:])``
  elements, at the source's and the target's row strides: one :class:`Copy` with ``count`` runs (the
  reader turns it into NIXL's strided descriptors, docs/fleet.md "Strided shards").

Where several sources hold a piece (three TP=1 peers, or a TP=1 and a TP=2 peer) the pieces are split into
``chunk``-byte stripes and each goes to the source with the fewest bytes so far: striping. Where none holds
a piece the plan is impossible (FillError, reason ``layout``). Identical layouts (a same-key fill, and the
only kind for a load-time transform or a deposit, whose layouts only the source knows) are one range per
stripe, padding included; otherwise the target's padding stays zero, as a load leaves it.

Served dtypes must agree: a plan never casts (each source's layout was planned for the same key dtype).
"""

from __future__ import annotations

from collections.abc import Sequence

from wcache.errors import FillError
from wcache.plan.layout import Layout, Placement
from wcache.proto._record import record
from wcache.proto.frames import DTYPE_SIZES

__all__ = ["DEFAULT_CHUNK", "Copy", "FillPlan", "plan_fill", "plan_same"]

#: stripe size: pieces larger than this are split between the sources that hold them
DEFAULT_CHUNK = 64 << 20


@record
class Copy:
    """``count`` runs of ``length`` bytes: run *i* from source slab offset ``src + i * src_stride`` to target
    slab offset ``dst + i * dst_stride``. ``count`` 1: one contiguous range (strides 0)."""

    source: int  # index into the plan's sources
    src: int
    dst: int
    length: int
    count: int = 1
    src_stride: int = 0
    dst_stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.length * self.count


@record
class FillPlan:
    """Every copy of a fill, in target order; ``per_source``: bytes each source serves."""

    copies: tuple[Copy, ...]
    per_source: tuple[int, ...]
    total_bytes: int  # the target slab's size

    @property
    def nbytes(self) -> int:
        return sum(self.per_source)

    def for_source(self, k: int) -> list[Copy]:
        return [c for c in self.copies if c.source == k]


def _fail(what: str, **details: object) -> FillError:
    return FillError(f"cannot fill this layout from the peers' slabs: {what}", details={"reason": "layout", **details})


def plan_same(total_bytes: int, sources: int, *, chunk: int = DEFAULT_CHUNK) -> FillPlan:
    """A target whose slab is byte for byte each source's (same key, or a transformed or deposited slab the
    target cannot lay out itself): ``chunk``-byte stripes, round robin over the ``sources``."""
    if sources < 1:
        raise _fail("no source")
    copies = []
    per = [0] * sources
    for i, off in enumerate(range(0, total_bytes, chunk)):
        n = min(chunk, total_bytes - off)
        k = i % sources
        copies.append(Copy(k, off, off, n))
        per[k] += n
    return FillPlan(tuple(copies), tuple(per), total_bytes)


def _extent(p: Placement, dim: int) -> tuple[int, int]:
    """The slice of ``p``'s full tensor along ``dim`` that its slab holds: [start, end)."""
    if p.shard is None:
        return 0, p.source.shape[dim]
    if p.shard.dim != dim:
        raise ValueError("another dimension")
    return p.shard.start, p.shard.start + p.shard.length


def plan_fill(target: Layout, sources: Sequence[Layout], *, chunk: int = DEFAULT_CHUNK) -> FillPlan:
    """The copies that fill ``target`` from ``sources`` (index = the source's position); FillError (reason
    ``layout``) when some tensor slice is held by none of them, or a source serves it in another dtype."""
    if not sources:
        raise _fail("no source")
    if chunk < 1:
        raise ValueError("chunk must be positive")
    if all(_same(target, s) for s in sources):
        return plan_same(target.total_bytes, len(sources), chunk=chunk)
    by_name = [{p.source.name: p for p in s.placements} for s in sources]
    per = [0] * len(sources)
    copies: list[Copy] = []
    for t in target.placements:
        if t.nbytes == 0:
            continue
        have: list[tuple[int, Placement]] = []
        for k, names in enumerate(by_name):
            s = names.get(t.source.name)
            if s is None:
                continue
            if s.dtype != t.dtype or s.source.shape != t.source.shape:
                raise _fail(
                    f"{t.source.name} is {s.dtype} {list(s.source.shape)} at source {k}, "
                    f"{t.dtype} {list(t.source.shape)} here",
                    tensor=t.source.name,
                )
            have.append((k, s))
        copies.extend(_tensor(t, have, per, chunk))
    return FillPlan(tuple(_merged(copies, chunk)), tuple(per), target.total_bytes)


def _same(a: Layout, b: Layout) -> bool:
    return a.total_bytes == b.total_bytes and [
        (p.source.name, p.dtype, p.shape, p.offset, p.shard) for p in a.placements
    ] == [(p.source.name, p.dtype, p.shape, p.offset, p.shard) for p in b.placements]


def _tensor(t: Placement, have: list[tuple[int, Placement]], per: list[int], chunk: int) -> list[Copy]:
    """The copies of one target tensor: its slice along the split dimension, cut where the sources' slices
    begin and end, in stripes of at most ``chunk`` bytes, each from the least-loaded source holding it."""
    name = t.source.name
    full = t.source.shape
    esize = DTYPE_SIZES[t.dtype]
    if not full:  # a scalar: one element, whole everywhere
        k = min((k for k, _ in have), key=lambda k: per[k], default=None)
        if k is None:
            raise _fail(f"no source holds {name}", tensor=name)
        s = next(s for j, s in have if j == k)
        per[k] += t.nbytes
        return [Copy(k, s.offset, t.offset, t.nbytes)]
    dims = {p.shard.dim for p in [t, *(s for _, s in have)] if p.shard is not None}
    dim = t.shard.dim if t.shard is not None else (min(dims) if dims else 0)
    usable = []
    for k, s in have:
        try:
            usable.append((k, s, *_extent(s, dim)))
        except ValueError:
            continue  # split along another dimension (another plan): not combinable here
    t0, t1 = _extent(t, dim)
    cuts = sorted({t0, t1, *(x for _, _, a, b in usable for x in (a, b) if t0 < x < t1)})
    outer = 1
    for n in full[:dim]:
        outer *= n
    inner = esize
    for n in full[dim + 1 :]:
        inner *= n
    per_index = outer * inner  # bytes of one index along ``dim``, over all runs
    step = max(1, chunk // max(per_index, 1))
    out: list[Copy] = []
    for a, b in zip(cuts, cuts[1:]):
        holders = [(k, s, s0, s1) for k, s, s0, s1 in usable if s0 <= a and b <= s1]
        if not holders:
            raise _fail(f"no source holds {name}[{a}:{b}] along dim {dim}", tensor=name, dim=dim, start=a, end=b)
        for lo in range(a, b, step):
            hi = min(b, lo + step)
            k, s, s0, s1 = min(holders, key=lambda h: per[h[0]])
            run = (hi - lo) * inner
            src = s.offset + (lo - s0) * inner
            dst = t.offset + (lo - t0) * inner
            if outer == 1 or (s1 - s0 == hi - lo and t1 - t0 == hi - lo):  # one contiguous range both sides
                c = Copy(k, src, dst, run * outer)
            else:
                c = Copy(k, src, dst, run, outer, (s1 - s0) * inner, (t1 - t0) * inner)
            per[k] += c.nbytes
            out.append(c)
    return out


def _merged(copies: list[Copy], chunk: int) -> list[Copy]:
    """Neighbouring contiguous copies from one source that continue each other on both sides become one copy
    of up to ``chunk`` bytes: fewer descriptors for the same bytes. (Not across a gap: what lies between two
    source tensors may be another rank's slice, not padding.)"""
    out: list[Copy] = []
    for c in copies:
        if out:
            p = out[-1]
            if (
                p.count == 1
                and c.count == 1
                and c.source == p.source
                and c.src == p.src + p.length
                and c.dst == p.dst + p.length
                and p.length + c.length <= chunk
            ):
                out[-1] = Copy(p.source, p.src, p.dst, p.length + c.length)
                continue
        out.append(c)
    return out
