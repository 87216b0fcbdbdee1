"""The load pipeline: a rank's plan into one served slab, from its checkpoint or from the host tier.

``load_model`` validates, allocates one slab, fills it (``loader.load_into``: the reader threads and the
slab's writer), runs a load-time transform where the spec names one, seals it and returns the
``ServedModel`` the store serves; with a host tier, a valid entry for the key fills the slab instead
(``load_from_tier``: one DMA copy from a page-locked entry, else the loader's threads through the checked
file) and a model loaded from the checkpoint is copied into the tier. The store holds what this returns
and does no I/O; the daemon calls this off its event loop (``startup`` builds the closure it calls).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcache.errors import CheckpointError, TierEntryError, TransformError
from wcache.peer_files import refuse_stubs
from wcache.plan.key import RankSpec, WeightCacheKey
from wcache.plan.layout import ALIGN, Layout, align_up, contiguous_strides
from wcache.plan.rank import RankPlan, plan_rank
from wcache.proto import DTYPE_SIZES, TensorEntry, TensorTable
from wcache.server.backends.base import Backend, Slab
from wcache.server.loader import LoadStats, load_file_into, load_into, torch_dtype
from wcache.server.store import ServedModel
from wcache.server.tier import HostTier, TierEntry

if TYPE_CHECKING:
    import torch

    from wcache.transforms import Transform

__all__ = ["load_from_tier", "load_model", "planned_bytes"]

log = logging.getLogger("wcache.server")


def planned_bytes(spec: RankSpec) -> tuple[WeightCacheKey, int]:
    """The key and slab size a load of ``spec`` would have, from headers alone (for callers that only ask: the
    daemon plans once with ``plan_rank`` and loads that plan). The whole spec counts, ``verify_content`` and
    ``transform`` included (a PRELOAD that planned without ``verify_content`` never found a --verify-content
    daemon's model already held)."""
    with plan_rank(spec) as rp:
        return rp.key, rp.layout.total_bytes


def load_model(
    spec: RankSpec | RankPlan,
    *,
    backend: Backend,
    threads: int = 8,
    io: str = "buffered",
    tier: HostTier | None = None,
    room: Callable[[int], None] | None = None,
) -> ServedModel:
    """Validate, shard, allocate one slab, load, (transform,) seal. Every check runs before data is read.

    ``spec``: the rank, planned here; or its RankPlan, planned once by the caller (which keeps ownership of it).
    With a host ``tier``: a valid entry for the key fills the slab instead of the checkpoint, and a
    model loaded from the checkpoint is copied into the tier. ``room``: the caller made room for the planned
    layout's bytes; it is called with the bytes of any slab allocated beyond them, before that slab is — a
    transform's output (while the loaded slab still exists), the excess of a larger host-tier entry of a
    transformed key — to make room for and hold them, or raise (OutOfMemoryError) and allocate nothing more."""
    if isinstance(spec, RankPlan):
        return _load_planned(spec, backend, threads, io, tier, room)
    with plan_rank(spec) as rp:
        return _load_planned(rp, backend, threads, io, tier, room)


def _load_planned(
    rp: RankPlan,
    backend: Backend,
    threads: int,
    io: str,
    tier: HostTier | None,
    room: Callable[[int], None] | None,
) -> ServedModel:
    ckpt, key, layout = rp.checkpoint, rp.key, rp.layout
    transform = rp.spec.transform
    source = rp.spec.checkpoint
    refuse_stubs(source, ckpt.files)  # a node filled from a peer has headers only: never serve its holes
    if tier is not None:
        entry = tier.lookup(key)
        if entry is not None:
            if room is not None and entry.size > layout.total_bytes:  # a transformed key's entry: its output's size
                room(entry.size - layout.total_bytes)
            served = load_from_tier(tier, entry, key, backend, threads, source)
            if served is not None:
                served.facts = rp.facts
                return served
    fn = None
    if transform:
        from wcache.transforms import load_transform, rank_config  # imports torch: only loads with a transform

        fn = load_transform(transform)
    started = time.perf_counter()
    slab = backend.allocate(layout.total_bytes)
    try:
        stats = load_into(layout, slab, threads=threads, io=io, started=started)
        if fn is not None:
            loaded = slab
            config = rank_config(ckpt.config, key.tp_rank, key.tp_size)
            slab, table, aliases, payload = _transformed(fn, layout, loaded, backend, config, transform, room)
            loaded.close()
        else:
            table, aliases, payload = layout.table(), layout.aliases, layout.payload_bytes
        slab.seal()
    except BaseException:
        slab.close()
        raise
    table.encoded()  # encode the tensor table once; every STATE reuses it
    model = ServedModel(
        key, table, aliases, [slab], backend, payload, stats, source=source, origin="disk", facts=rp.facts
    )
    if tier is not None:
        try:
            tier.save(key, slab, table, aliases, payload)
        except (OSError, RuntimeError) as exc:  # the tier is an optimisation: serving goes on without it
            log.warning("host tier save failed key=%s: %s", key.short(), exc)
    return model


def load_from_tier(
    tier: HostTier,
    entry: TierEntry,
    key: WeightCacheKey,
    backend: Backend,
    threads: int,
    source: Path | None,
) -> ServedModel | None:
    """Fill a new slab from a host-tier entry: one DMA copy where it is page-locked here, else staged through
    the file ``lookup`` checked, every block's checksum verified on the bytes copied (tier.py says what each
    way verifies). None when the entry's file went away or was altered (then it is removed where it is still
    the one checked, and the caller loads from the checkpoint, or the deposit is absent)."""
    started = time.perf_counter()
    slab = backend.allocate(entry.size)
    try:
        if entry.pinned is not None and slab.copy_pinned(entry.pinned):  # page-locked here: one DMA copy
            stats = LoadStats(entry.size, entry.size, time.perf_counter() - started, entry.size, tier_copy="pinned")
        else:
            fd = tier.open_slab(entry)
            try:
                stats = load_file_into(
                    entry.slab_path,
                    slab,
                    threads=threads,
                    started=started,
                    fd=fd,
                    check=entry.check,
                )
            finally:
                os.close(fd)
            stats = dataclasses.replace(stats, tier_copy="staged")
        slab.seal()
    except TierEntryError as exc:  # replaced since lookup, or a block differs from its checksum
        slab.close()
        tier.discard(entry, exc)
        return None
    except CheckpointError as exc:  # the entry vanished or shrank under us: load from the checkpoint
        slab.close()
        log.warning("host tier read failed key=%s (%s); loading from disk", key.short(), exc)
        return None
    except BaseException:
        slab.close()
        raise
    log.info(
        "loaded from_host_tier bytes_read=%d seconds=%.2f read_gb_s=%.2f key=%s entry=%s copy=%s",
        stats.bytes_read,
        stats.seconds,
        stats.gb_per_s,
        key.short(),
        entry.meta_path.stem,
        stats.tier_copy,
    )
    tier.pin_later(entry)
    entry.table.encoded()
    return ServedModel(
        key,
        entry.table,
        entry.aliases,
        [slab],
        backend,
        entry.payload,
        stats,
        source=source,
        origin="tier",
        buffers=entry.buffers,
        generation=entry.generation,
    )


def _transformed(
    fn: Transform,
    layout: Layout,
    slab: Slab,
    backend: Backend,
    config: dict[str, Any],
    spec: str,
    room: Callable[[int], None] | None = None,
) -> tuple[Slab, TensorTable, dict[str, str], int]:
    """Run a load-time transform over the loaded tensors and pack its result into a new slab, ``room`` made for
    its bytes first (``load_model``): the loaded slab is still allocated then."""
    import torch

    base = slab.tensor()
    views: dict[str, torch.Tensor] = {
        p.source.name: base[p.offset : p.offset + p.nbytes].view(torch_dtype(p.dtype)).reshape(p.shape)
        for p in layout.placements
    }
    for alias, target in layout.aliases.items():
        views[alias] = views[target]
    try:
        with torch.no_grad():
            result = fn(dict(views), config)
    except (MemoryError, torch.OutOfMemoryError):
        raise  # the memory's, not the transform's fault
    except Exception as exc:  # the transform's own failure: INVALID_TRANSFORM, as one that cannot be imported
        raise TransformError(f"transform {spec!r} raised {type(exc).__name__}: {exc}"[:2048]) from exc
    if not isinstance(result, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in result.items()
    ):
        raise TransformError(f"transform {spec!r} must return a dict of str -> torch.Tensor")
    names: dict[int, str] = {}
    aliases: dict[str, str] = {}
    entries: list[TensorEntry] = []
    offset = 0
    placed: list[tuple[int, torch.Tensor]] = []
    for name, t in result.items():
        if id(t) in names:
            aliases[name] = names[id(t)]
            continue
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPE_SIZES:
            raise TransformError(
                f"transform {spec!r} returned {name!r} of unsupported dtype {dtype} "
                f"(the protocol carries {', '.join(sorted(DTYPE_SIZES))})"
            )
        names[id(t)] = name
        shape = tuple(t.shape)
        entries.append(TensorEntry(name, dtype, shape, contiguous_strides(shape), 0, offset))
        placed.append((offset, t))
        offset = align_up(offset + t.numel() * t.element_size())
    size = max(offset, ALIGN)
    if room is not None:
        room(size)
    out = backend.allocate(size)
    try:
        dest = out.tensor()
        for off, t in placed:
            n = t.numel() * t.element_size()
            if n:
                dest[off : off + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        out.synchronize()
    except BaseException:
        out.close()
        raise
    log.info("transform %s: %d tensors in, %d out, %d aliases", spec, len(views), len(entries), len(aliases))
    return out, TensorTable.from_entries(entries), aliases, sum(t.numel() * t.element_size() for _, t in placed)
