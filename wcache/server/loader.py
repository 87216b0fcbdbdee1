"""Filling a slab from safetensors files according to a Layout (the torch worker's job).

Reads run in a thread pool (``os.preadv`` releases the GIL). Where the slab is host
memory and a tensor needs no cast, its bytes (or, for a dim-0 shard, only the rank's
rows) are read straight to their final offset: no intermediate copy. Otherwise the
tensor is read into a buffer, sliced and cast with torch, and copied into the slab.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from wcache.errors import CheckpointError
from wcache.layout import Layout, Placement
from wcache.server.backends.base import Slab

__all__ = ["LoadStats", "load_into", "torch_dtype"]

log = logging.getLogger("wcache.loader")


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"dtype {name!r} is not available in this torch build")
    return dt


@dataclass(frozen=True)
class LoadStats:
    bytes_read: int
    bytes_stored: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _pread_into(fd: int, view: memoryview, offset: int, where: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(f"{where}: file ended early (truncated while loading?)")
        done += n


class _Files:
    """One read-only fd per checkpoint file, shared by the reader threads."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        fd = self.fds.get(path)
        if fd is None:
            fd = self.fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _read_span(p: Placement) -> tuple[int, int]:
    """(file offset, bytes) of what must be read for p: only the rank's rows for a dim-0 shard."""
    src = p.source
    if p.shard is not None and p.shard.dim == 0 and src.shape[0]:
        row = src.nbytes // src.shape[0]
        return src.start + p.shard.start * row, p.shard.length * row
    return src.start, src.nbytes


def _load_one(p: Placement, files: _Files, slab: Slab, host: memoryview | None) -> int:
    src = p.source
    where = f"{src.file}: tensor {src.name!r}"
    if p.nbytes == 0:
        return 0
    start, length = _read_span(p)
    direct = p.dtype == src.dtype and (p.shard is None or p.shard.dim == 0)
    fd = files.fd(src.file)
    if direct and host is not None:
        _pread_into(fd, host[p.offset : p.offset + length], start, where)
        return length
    buf = bytearray(length)
    _pread_into(fd, memoryview(buf), start, where)
    t = torch.frombuffer(buf, dtype=torch.uint8).view(torch_dtype(src.dtype))
    if p.shard is not None and p.shard.dim != 0:
        t = t.reshape(src.shape).narrow(p.shard.dim, p.shard.start, p.shard.length)
    if p.dtype != src.dtype:
        t = t.to(torch_dtype(p.dtype))
    out = t.contiguous().reshape(-1).view(torch.uint8)
    slab.tensor()[p.offset : p.offset + p.nbytes].copy_(out)
    return length


def load_into(layout: Layout, slab: Slab, *, threads: int = 8) -> LoadStats:
    """Fill ``slab`` with every placement of ``layout``; raises CheckpointError on short files."""
    t0 = time.perf_counter()
    files = _Files()
    host = slab.host_buffer()
    try:
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="wcache-load") as pool:
            read = sum(pool.map(lambda p: _load_one(p, files, slab, host), layout.placements))
        if slab.tensor().is_cuda:
            torch.cuda.synchronize(slab.tensor().device)
    finally:
        if host is not None:
            host.release()
        files.close()
    return LoadStats(read, layout.payload_bytes, time.perf_counter() - t0)
