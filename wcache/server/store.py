"""What the daemon serves, and who holds it: the loaded model and its leases.

A lease belongs to the connection that asked for it. RELEASE ends only leases of the
same connection (the seed design's RELEASE freed the cache for every engine); a closed
connection ends all of its leases. No I/O here: the daemon calls in with decoded frames.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wcache.checkpoint import Checkpoint
from wcache.errors import (
    DeviceMismatchError,
    KeyMismatchError,
    LimitExceededError,
    UnknownLeaseError,
    WCacheError,
)
from wcache.key import WeightCacheKey
from wcache.layout import ALIGN, Layout, plan_layout
from wcache.proto import (
    DTYPE_SIZES,
    GetState,
    LeaseInfo,
    ModelInfo,
    Release,
    Released,
    SlabDescriptor,
    State,
    TensorEntry,
    TensorTable,
)
from wcache.server.backends.base import Backend, Slab
from wcache.server.loader import DEFAULT_STAGING, LoadStats, load_into, torch_dtype
from wcache.sharding import resolve_plan
from wcache.transforms import Transform, load_transform

__all__ = ["Lease", "ServedModel", "Store", "load_model"]

log = logging.getLogger("wcache.server")


@dataclass
class ServedModel:
    key: WeightCacheKey
    table: TensorTable
    aliases: dict[str, str]
    slabs: list[Slab]
    backend: Backend
    payload_bytes: int
    stats: LoadStats
    last_use: float = 0.0

    @property
    def slab_bytes(self) -> int:
        return sum(s.size for s in self.slabs)

    def close(self) -> None:
        for s in self.slabs:
            s.close()
        self.slabs.clear()


def load_model(
    model_dir: str | os.PathLike[str],
    *,
    backend: Backend,
    tp_rank: int = 0,
    tp_size: int = 1,
    dtype: str | None = None,
    plan_file: str | os.PathLike[str] | None = None,
    verify_content: bool = False,
    threads: int = 8,
    staging_bytes: int = DEFAULT_STAGING,
    io: str = "buffered",
    transform: str = "",
) -> ServedModel:
    """Validate, shard, allocate one slab, load, (transform,) seal. Every check runs before data is read."""
    ckpt = Checkpoint.open(model_dir)
    plan = resolve_plan(ckpt.architecture, tp_size, plan_file)
    key = WeightCacheKey.from_checkpoint(
        Path(model_dir),
        tp_rank=tp_rank,
        tp_size=tp_size,
        dtype=dtype,
        plan_file=plan_file,
        verify_content=verify_content,
        checkpoint=ckpt,
        transform=transform,
    )
    fn = load_transform(transform) if transform else None
    layout = plan_layout(ckpt, tp_rank=tp_rank, tp_size=tp_size, dtype=key.dtype, plan=plan)
    started = time.perf_counter()
    slab = backend.allocate(layout.total_bytes)
    try:
        stats = load_into(layout, slab, threads=threads, staging_bytes=staging_bytes, io=io, started=started)
        if fn is not None:
            loaded = slab
            slab, table, aliases, payload = _transformed(fn, layout, loaded, backend, ckpt.config, transform)
            loaded.close()
        else:
            table, aliases, payload = layout.table(), layout.aliases, layout.payload_bytes
        slab.seal()
    except BaseException:
        slab.close()
        raise
    table.encoded()  # encode the tensor table once; every STATE reuses it
    return ServedModel(key, table, aliases, [slab], backend, payload, stats)


def _transformed(
    fn: Transform, layout: Layout, slab: Slab, backend: Backend, config: dict[str, Any], spec: str
) -> tuple[Slab, TensorTable, dict[str, str], int]:
    """Run a load-time transform over the loaded tensors and pack its result into a new slab."""
    base = slab.tensor()
    views: dict[str, torch.Tensor] = {
        p.source.name: base[p.offset : p.offset + p.nbytes].view(torch_dtype(p.dtype)).reshape(p.shape)
        for p in layout.placements
    }
    for alias, target in layout.aliases.items():
        views[alias] = views[target]
    with torch.no_grad():
        result = fn(dict(views), config)
    if not isinstance(result, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in result.items()
    ):
        raise WCacheError(f"transform {spec!r} must return a dict of str -> torch.Tensor")
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
            raise WCacheError(f"transform {spec!r} returned {name!r} of unsupported dtype {dtype}")
        names[id(t)] = name
        shape = tuple(t.shape)
        stride = tuple(int(x) for x in torch.empty(shape, device="meta").stride())
        entries.append(TensorEntry(name, dtype, shape, stride, 0, offset))
        placed.append((offset, t))
        offset = (offset + t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN
    out = backend.allocate(max(offset, ALIGN))
    try:
        dest = out.tensor()
        for off, t in placed:
            n = t.numel() * t.element_size()
            if n:
                dest[off : off + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        if dest.is_cuda:
            torch.cuda.synchronize(dest.device)
    except BaseException:
        out.close()
        raise
    log.info("transform %s: %d tensors in, %d out, %d aliases", spec, len(views), len(entries), len(aliases))
    return out, TensorTable.from_entries(entries), aliases, sum(t.numel() * t.element_size() for _, t in placed)


@dataclass
class Lease:
    id: int
    conn_id: int
    pid: int
    mode: str
    created: float = field(default_factory=time.monotonic)


class Store:
    def __init__(self, model: ServedModel, *, max_leases_per_connection: int = 64) -> None:
        self.model = model
        self.leases: dict[int, Lease] = {}
        self.max_leases_per_connection = max_leases_per_connection
        self._next_lease = secrets.randbits(31) + 1  # not reused across daemon restarts

    def acquire(self, conn_id: int, pid: int, req: GetState) -> tuple[State, list[int]]:
        """Grant a lease for ``req``; raises KeyMismatchError / DeviceMismatchError / LimitExceededError."""
        m = self.model
        diff = m.key.diff_wire(req.key)
        if diff:
            raise KeyMismatchError(
                "requested key differs from the served one in: " + ", ".join(sorted(diff)),
                details={"fields": diff},
            )
        dev = m.backend.device
        if req.device_uuid and dev.uuid and req.device_uuid != dev.uuid:
            raise DeviceMismatchError(
                f"engine is on GPU {req.device_uuid}, the daemon serves GPU {dev.uuid}",
                details={"client": req.device_uuid, "daemon": dev.uuid},
            )
        held = sum(1 for lease in self.leases.values() if lease.conn_id == conn_id)
        if held >= self.max_leases_per_connection:
            raise LimitExceededError(f"connection already holds {held} leases (limit {self.max_leases_per_connection})")
        lease = Lease(self._next_lease, conn_id, pid, req.mode)
        self._next_lease += 1
        self.leases[lease.id] = lease
        m.last_use = time.time()
        descs: list[SlabDescriptor] = []
        fds: list[int] = []
        for slab in m.slabs:
            desc, slab_fds = slab.export()
            if slab_fds:
                desc = dataclasses.replace(desc, fd=len(fds))
                fds.extend(slab_fds)
            descs.append(desc)
        state = State(
            id=req.id,
            lease=lease.id,
            key=m.key.to_wire(),
            mode=req.mode,
            slabs=tuple(descs),
            tensors=m.table,
            aliases=m.aliases,
        )
        return state, fds

    def release(self, conn_id: int, req: Release) -> Released:
        lease = self.leases.get(req.lease)
        if lease is None or lease.conn_id != conn_id:
            # Same answer for "no such lease" and "someone else's": nothing to learn by probing.
            raise UnknownLeaseError(f"lease {req.lease} is not held by this connection")
        del self.leases[req.lease]
        return Released(id=req.id, lease=req.lease, leases_left=len(self.leases))

    def drop_connection(self, conn_id: int) -> list[Lease]:
        ended = [lease for lease in self.leases.values() if lease.conn_id == conn_id]
        for lease in ended:
            del self.leases[lease.id]
        return ended

    def model_info(self) -> ModelInfo:
        m = self.model
        return ModelInfo(
            key=m.key.to_wire(),
            backend=m.backend.name,
            bytes=m.slab_bytes,
            tensors=len(m.table),
            leases=len(self.leases),
            load_seconds=m.stats.seconds,
            last_use=m.last_use,
        )

    def lease_infos(self) -> tuple[LeaseInfo, ...]:
        now = time.monotonic()
        return tuple(LeaseInfo(x.id, x.mode, x.pid, now - x.created) for x in self.leases.values())
