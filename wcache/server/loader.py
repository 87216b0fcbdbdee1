"""Filling a slab from safetensors files according to a Layout, at the storage's speed.

Every placement becomes *extents*: byte ranges of a file that land back to back at the
tensor's final slab offset. A full tensor or a dim-0 shard is one extent (only the
rank's rows are read); a shard of dimension k > 0 is one extent per index of the
dimensions before k (row pieces), so a rank reads about 1/tp of the bytes.
Extents are grouped into jobs of at most ``chunk`` bytes with a contiguous destination. Extents,
jobs, the shared descriptors and the reads themselves are the read primitives (wcache/server/reads.py),
which the backends' writers use too; this module plans the jobs and runs them.

Reader threads (``os.preadv`` releases the GIL) run the jobs; each job goes to the slab's
*writer* (wcache/server/backends/), which owns the device-specific part:

- host slab (memfd, backends/host.py): one thread ``sendfile``s from the checkpoint into the memfd
  at the slab offset (an in-kernel copy; shared-memory pages are allocated as they are written,
  unzeroed); writes to one file serialise on its inode lock, so the other threads ``preadv`` into
  the slab's shared mapping, whose page faults run in parallel;
- device slab (backends/cuda.py): each thread owns two pinned staging buffers and a CUDA stream; it
  reads into one buffer while the previous one is copied to the slab (double buffering), so
  reads and host-to-device copies overlap and pinned memory stays bounded by the slab's
  ``staging_bytes`` (its backend's budget, set when the backend was built: ``--staging-bytes``).
  Jobs are cut to fit that budget on every slab (two per reader thread), host slabs included.

``io="stream"`` (``--io stream[:BLOCK]``) reads the way fastsafetensors 0.5.0's nogds reader does
(docs/performance.md): files less than half in the page cache are read with O_DIRECT in one sequential
front of BLOCK-sized reads (512 KiB default) at block-aligned file offsets, each thread taking the next
block, so all threads read neighbouring blocks of one file instead of each reading its own 16 MiB chunk.
The blocks of one job land in one staging buffer, and the thread that reads a job's last block copies the
whole job to the slab (one copy per job, not per block) — on slabs whose writer stages (CUDA,
``StagedWriter``); elsewhere, and for cached files, jobs are read whole as with buffered (the warm load is
unchanged).

Placements that need a dtype cast are read whole (their shard's extents) and cast with
torch on the slab's device. A file that ends early is a CheckpointError naming the file
and tensor. A progress bar is drawn on a TTY; a summary line is logged otherwise.

Checkpoint data is read through the descriptors ``Checkpoint.open`` validated the headers and
computed the fingerprint from (``layout.checkpoint``), never by reopening a path: a file
replaced after planning cannot be served under the planned key. O_DIRECT descriptors are
reopened from those (``/proc/self/fd/N``, the same inode, checked).

A load may carry a ``BlockCheck`` (a host-tier refill: the CRC-32 of every block of the file): every
byte read is passed to it before the load completes — the bytes in the mapping or staging buffer they
were read into, or, where ``sendfile`` copied them in the kernel, read back from the slab — and the
first block that differs fails the load. Checked loads read no file with O_DIRECT.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from wcache.errors import CheckpointError
from wcache.plan.layout import Layout
from wcache.server.backends.base import LoadAborted, Slab, StagedWriter
from wcache.server.reads import (
    ALIGN_IO,
    BlockCheck,
    Files,
    Job,
    page_cache_fraction,
    placement_extents,
    read_direct,
    read_job,
)

if TYPE_CHECKING:
    import torch

    from wcache.plan.checkpoint import Checkpoint

__all__ = [
    "IO_MODES",
    "STREAM_BLOCK",
    "LoadStats",
    "load_file_into",
    "load_into",
    "parse_io",
    "torch_dtype",
]

log = logging.getLogger("wcache.loader")

MAX_CHUNK = 64 << 20
# Host-tier copies (memory to device, no disk): 16 MiB jobs. H200, 16 GB, fresh process, 16 threads
# (benchmarks/results/tier_reload-*.json): 0.61 s with 16 MiB jobs, 0.71-0.78 s with 32 MiB, ~1.0 s with 64 MiB.
FLAT_CHUNK = 16 << 20
# ``--io stream``: O_DIRECT block per read for uncached files (fastsafetensors 0.5.0 reads 512 KiB blocks:
# its 16 MiB bounce buffer over 16 threads x 2 buffers). Bounds: one 4 KiB-aligned block, at most a chunk.
# H200 VM, 16 GB cold, 16 threads, no copy (benchmarks/results/disk_pattern-cuda0-2026-12-01.json): 512 KiB
# 8.44 s, 1 MiB 14.9 s, 4 MiB 13.3 s (the virtio disk takes at most 254 4 KiB segments per request: a
# 1 MiB read into 4 KiB pages becomes a 1016 KiB request and an 8 KiB one).
STREAM_BLOCK = 512 << 10
MIN_STREAM_BLOCK = 64 << 10
IO_MODES = ("buffered", "direct", "auto", "stream")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"dtype {name!r} is not available in this torch build")
    return dt


@dataclass(frozen=True)
class LoadStats:
    bytes_read: int
    bytes_stored: int
    seconds: float
    checkpoint_bytes: int = 0
    #: a host-tier refill's copy path (STATUS ``tier_copy``): "pinned" (one DMA copy), "staged" (reader threads)
    tier_copy: str = ""

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def read_fraction(self) -> float:
        return self.bytes_read / self.checkpoint_bytes if self.checkpoint_bytes else 1.0


def _jobs(layout: Layout, chunk: int) -> list[Job]:
    """Jobs of at most ``chunk`` bytes, each landing contiguously in the slab. Small tensors that
    follow each other in the slab share a job (a 50,000-tensor MoE checkpoint is a few hundred
    jobs, not 50,000), and reads contiguous in the file are merged into one."""
    jobs: list[Job] = []
    job: Job | None = None  # the open job
    filled = 0  # bytes in it
    for p in layout.placements:
        extents = placement_extents(p)
        if not extents:
            continue
        if p.dtype != p.source.dtype:
            jobs.append(Job(p, p.offset, list(extents), cast=True))
            continue
        if job is not None and job.dest + filled == p.offset:
            if not job.extents:  # a job just opened after a full one: it starts with this tensor
                job.placement, job.more = p, []
            elif job.placement is not p:
                job.more.append(p)
        else:
            if job is not None:
                jobs.append(job)
            job, filled = Job(p, p.offset), 0
        for f, start, length in extents:
            off, left = start, length
            while left:
                take = min(left, chunk - filled)
                job.add(f, off, take)
                off, left, filled = off + take, left - take, filled + take
                if filled == chunk:
                    jobs.append(job)
                    job, filled = Job(p, job.dest + filled), 0
    if job is not None and job.extents:
        jobs.append(job)
    return jobs


def parse_io(io: str) -> tuple[str, int]:
    """``--io`` as (mode, block): ``buffered``, ``direct``, ``auto``, ``stream`` or ``stream:SIZE``
    (block 0 for the modes that read whole jobs). Raises ValueError naming the accepted forms."""
    from wcache.units import parse_size

    mode, sep, size = io.partition(":")
    if mode not in IO_MODES or (sep and mode != "stream"):
        raise ValueError(f"io must be one of {', '.join(IO_MODES)} or stream:SIZE (e.g. stream:512KiB), got {io!r}")
    if mode != "stream":
        return mode, 0
    block = parse_size(size) if sep else STREAM_BLOCK
    if block % ALIGN_IO or not MIN_STREAM_BLOCK <= block <= MAX_CHUNK:
        raise ValueError(
            f"io {io!r}: the stream block must be a multiple of {ALIGN_IO} bytes in "
            f"[{MIN_STREAM_BLOCK >> 10}KiB, {MAX_CHUNK >> 20}MiB] (default {STREAM_BLOCK >> 10}KiB)"
        )
    return mode, block


def _streamed(jobs: list[Job], files: set[Path]) -> list[Job]:
    """The jobs a stream load reads as a front of blocks: one file range (no row pieces), no cast, in ``files``."""
    return [j for j in jobs if not j.cast and len(j.extents) == 1 and j.extents[0][0] in files]


def _pieces(job: Job, block: int) -> list[tuple[int, int]]:
    """The O_DIRECT reads of a one-extent job: (file offset, length) covering the job's 4 KiB-aligned
    superset, cut at multiples of ``block`` in the file (the front's blocks), in order."""
    _, off, n = job.extents[0]
    start = off - off % ALIGN_IO
    end = -(-(off + n) // ALIGN_IO) * ALIGN_IO
    out = []
    p = start
    while p < end:
        q = min(end, (p // block + 1) * block)
        out.append((p, q - p))
        p = q
    return out


class _Progress:
    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total = total
        self.done = 0
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.stream = stream
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if stream is not None:
            self._thread = threading.Thread(target=self._draw, name="wcache-progress", daemon=True)
            self._thread.start()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n

    def _line(self) -> str:
        el = max(time.perf_counter() - self.t0, 1e-9)
        rate = self.done / el
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(30 * frac)
        return (
            f"\rloading [{bar:<30}] {self.done / 1e9:6.2f}/{self.total / 1e9:.2f} GB "
            f"{rate / 1e9:5.2f} GB/s ETA {eta:4.1f}s"
        )

    def _draw(self) -> None:
        assert self.stream is not None
        while not self._stop.wait(0.25):
            self.stream.write(self._line())
            self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self.stream is not None:
            self._thread.join()
            self.stream.write(self._line() + "\n")
            self.stream.flush()


def load_into(
    layout: Layout,
    slab: Slab,
    *,
    threads: int = 8,
    progress: TextIO | bool | None = None,
    io: str = "buffered",
    started: float | None = None,
) -> LoadStats:
    """Fill ``slab`` with every placement of ``layout``. ``progress``: a stream for the bar,
    None to draw on stderr only if it is a TTY, False for none. ``io`` (device slabs only):
    ``direct`` reads with O_DIRECT (parallel reads straight from the disk, no page-cache
    copy), ``buffered`` through the page cache, ``auto`` picks direct for files that are
    less than half in the page cache (mincore), ``stream`` / ``stream:SIZE`` reads those files in
    blocks of SIZE (O_DIRECT on device slabs), in file order across all threads. ``started``: a ``time.perf_counter()`` taken
    before the slab was allocated, so that the reported time includes allocation."""
    mode, block = parse_io(io)
    t0 = time.perf_counter() if started is None else started
    threads = max(1, threads)
    chunk = _chunk(threads, slab.staging_bytes)
    jobs = _jobs(layout, chunk)
    ckpt = layout.checkpoint
    cold: set[Path] = set()  # files to read from the disk: all with direct, the mostly uncached ones otherwise
    if mode != "buffered" and (slab.direct_io or block):
        for f in sorted({p.source.file for p in layout.placements}):
            if mode == "direct" or page_cache_fraction(ckpt.fd(f) if ckpt is not None else f) < 0.5:
                cold.add(f)
    direct = cold if slab.direct_io and hasattr(os, "O_DIRECT") else set()
    total = _execute(jobs, slab, threads, chunk, direct, progress, ckpt, block=block)
    seconds = time.perf_counter() - t0
    ckpt_bytes = sum({(p.source.file, p.source.name): p.source.nbytes for p in layout.placements}.values())
    stats = LoadStats(total, layout.payload_bytes, seconds, ckpt_bytes)
    log.info(
        "loaded bytes_read=%d bytes_stored=%d seconds=%.2f read_gb_s=%.2f read_fraction=%.3f threads=%d chunk=%d "
        "direct_files=%d io=%s jobs=%d",
        stats.bytes_read,
        stats.bytes_stored,
        seconds,
        stats.gb_per_s,
        stats.read_fraction,
        threads,
        chunk,
        len(direct),
        io,
        len(jobs),
    )
    return stats


def load_file_into(
    path: Path,
    slab: Slab,
    *,
    threads: int = 8,
    progress: TextIO | bool | None = None,
    started: float | None = None,
    fd: int | None = None,
    check: BlockCheck | None = None,
) -> LoadStats:
    """Fill ``slab`` with the first ``slab.size`` bytes of ``path`` (a host-tier copy), with the
    same readers, staging and host-to-device pipeline as ``load_into``, in jobs of at most
    ``FLAT_CHUNK``: a restarted daemon page-locks less staging before its first copy.
    ``fd``: the file, opened and checked by the caller (read through it, never the path again);
    ``check``: verifies every byte copied (jobs are then whole multiples of its ``block``)."""
    t0 = time.perf_counter() if started is None else started
    threads = max(1, threads)
    chunk = min(FLAT_CHUNK, _chunk(threads, slab.staging_bytes))
    if check is not None:
        chunk = max(check.block, chunk - chunk % check.block)
    jobs = [Job(None, off, [(path, off, min(chunk, slab.size - off))]) for off in range(0, slab.size, chunk)]
    files = Files(opened={path: fd} if fd is not None else None, check=check)
    total = _execute(jobs, slab, threads, chunk, set(), progress, files=files)
    return LoadStats(total, total, time.perf_counter() - t0, total)


def _chunk(threads: int, staging: int) -> int:
    """The job size of a load by ``threads`` readers into a slab whose budget is ``staging``: two jobs per thread."""
    return max(1 << 20, min(MAX_CHUNK, staging // (2 * threads)))


def _execute(
    jobs: list[Job],
    slab: Slab,
    threads: int,
    chunk: int,
    direct: set[Path],
    progress: TextIO | bool | None,
    checkpoint: Checkpoint | None = None,
    *,
    block: int = 0,
    files: Files | None = None,
) -> int:
    """Run the jobs on ``threads`` readers; returns the bytes read. How bytes reach the slab (the
    host's sendfile / mapping, the device's pinned staging and streams) is the slab's writer.
    ``block`` (``--io stream``): the one-extent jobs of ``direct`` files are read as a front of
    ``block``-sized O_DIRECT reads into one staging buffer per job, where the writer stages."""
    total = sum(j.nbytes for j in jobs)
    stream: TextIO | None = sys.stderr if progress is None and sys.stderr.isatty() else None
    if progress not in (None, False, True):
        stream = progress  # type: ignore[assignment]
    bar = _Progress(total, stream)
    files = files if files is not None else Files(checkpoint)
    staged = _streamed(jobs, direct) if block else []
    writer = slab.writer(jobs, threads, direct, staged)
    if not isinstance(writer, StagedWriter):
        staged = []
    target = slab.tensor() if any(j.cast for j in jobs) else None  # casts run in torch (imported then)
    front = {id(j) for j in staged}
    failed: list[BaseException] = []  # the staged jobs' own errors (not the LoadAborted they cause elsewhere)
    items: list[Job | _Block] = []
    for job in _ordered(jobs):
        if id(job) in front:
            st = _StagedJob(job, len(pieces := _pieces(job, block)))
            items.extend(_Block(st, p, n) for p, n in pieces)
        else:
            items.append(job)

    def run(item: Job | _Block) -> None:
        if isinstance(item, _Block):
            assert isinstance(writer, StagedWriter)
            try:
                if item.read(files, writer):
                    bar.add(item.job.job.nbytes)
            except LoadAborted:
                raise
            except BaseException as exc:
                # at once, not when the main thread reaches this item: a job that failed holding a staging
                # buffer never gives it back, and earlier items may be waiting for one
                failed.append(exc)
                writer.abort()
                raise
            return
        if item.cast:
            assert target is not None
            _cast_job(files, item, target)
        else:
            writer.write(item, files)
        bar.add(item.nbytes)

    try:
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="wcache-load")
        try:
            for _ in pool.map(run, items):
                pass
        except BaseException as exc:
            if isinstance(writer, StagedWriter):
                writer.abort()  # a thread waiting for a staging buffer the failed job holds would wait forever
            pool.shutdown(wait=True, cancel_futures=True)
            if isinstance(exc, LoadAborted) and failed:
                raise failed[0] from None  # the job that failed, not one it woke
            raise
        pool.shutdown(wait=True)
        writer.finish()
    finally:
        writer.close()
        bar.close()
        files.close()
    return total


class _StagedJob:
    """A job read in blocks by several threads into one staging buffer (``--io stream``)."""

    def __init__(self, job: Job, blocks: int) -> None:
        self.job = job
        self.left = blocks
        self.lock = threading.Lock()
        self.slot = -1
        self.view: memoryview | None = None
        _, off, n = job.extents[0]
        self.base = off - off % ALIGN_IO  # the buffer holds the file from here
        self.end = off + n


@dataclass
class _Block:
    """One O_DIRECT read of the front: ``n`` bytes of the job's file at ``offset``."""

    job: _StagedJob
    offset: int
    n: int

    def read(self, files: Files, writer: StagedWriter) -> bool:
        """Read this block into the job's buffer; True when it was the job's last (then it is committed)."""
        st = self.job
        f, off, n = st.job.extents[0]
        with st.lock:
            if st.view is None:
                st.slot, st.view = writer.stage(st.job)
            view = st.view
        fd = files.direct_fd(f)
        if fd < 0:  # this filesystem refuses O_DIRECT (tmpfs): the same aligned reads, through the page cache
            fd = files.fd(f)
        pos = self.offset - st.base
        need = min(self.n, st.end - self.offset)  # the file may end inside the last (aligned) block
        read_direct(fd, view[pos : pos + self.n], self.offset, need, f"{f}: {st.job.label}")  # offset is aligned
        with st.lock:
            st.left -= 1
            last = st.left == 0
        if last:
            st.view = None
            writer.commit(st.job, st.slot, off - st.base)
        return last


def _ordered(jobs: list[Job]) -> Iterator[Job]:
    """Jobs in file order: neighbouring threads read neighbouring ranges (readahead-friendly)."""
    return iter(sorted(jobs, key=lambda j: (str(j.extents[0][0]), j.extents[0][1])))


def _cast_job(files: Files, job: Job, target: torch.Tensor) -> None:
    """Read a placement whole and cast it with torch on the slab's device (a no-op move for host slabs)."""
    import torch

    p = job.placement
    assert p is not None
    raw = bytearray(job.nbytes)
    read_job(files, job, memoryview(raw))
    shape = list(p.source.shape)
    if p.shard is not None:
        shape[p.shard.dim] = p.shard.length
    t: Any = torch.frombuffer(raw, dtype=torch.uint8).to(target.device)
    t = t.view(torch_dtype(p.source.dtype)).reshape(shape).to(torch_dtype(p.dtype))
    target[p.offset : p.offset + p.nbytes].copy_(t.reshape(-1).view(torch.uint8))
