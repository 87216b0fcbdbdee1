"""Filling a slab from safetensors files according to a Layout, at the storage's speed.

Every placement becomes *extents*: byte ranges of a file that land back to back at the
tensor's final slab offset. A full tensor or a dim-0 shard is one extent (only the
rank's rows are read); a shard of dimension k > 0 is one extent per index of the
dimensions before k (row pieces), so a rank reads about 1/tp of the bytes.
Extents are grouped into jobs of at most ``chunk`` bytes with a contiguous destination.

Reader threads (``os.preadv`` releases the GIL) run the jobs; each job goes to the slab's
*writer* (wcache/server/backends/), which owns the device-specific part:

- host slab (memfd, backends/host.py): one thread ``sendfile``s from the checkpoint into the memfd
  at the slab offset (an in-kernel copy; shared-memory pages are allocated as they are written,
  unzeroed); writes to one file serialise on its inode lock, so the other threads ``preadv`` into
  the slab's shared mapping, whose page faults run in parallel;
- device slab (backends/cuda.py): each thread owns two pinned staging buffers and a CUDA stream; it
  reads into one buffer while the previous one is copied to the slab (double buffering), so
  reads and host-to-device copies overlap and pinned memory stays bounded by ``staging_bytes``.

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

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from wcache.errors import CheckpointError
from wcache.files import open_regular
from wcache.plan.checkpoint import Checkpoint
from wcache.plan.layout import Layout, Placement
from wcache.server.backends.base import LoadAborted, Slab, StagedWriter

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGN_IO",
    "DEFAULT_STAGING",
    "BlockCheck",
    "IO_MODES",
    "STREAM_BLOCK",
    "Files",
    "Job",
    "LoadStats",
    "load_file_into",
    "load_into",
    "map_readonly",
    "parse_io",
    "placement_extents",
    "populate",
    "read_direct",
    "read_job",
    "send_job",
    "torch_dtype",
]

log = logging.getLogger("wcache.loader")

# Bytes of pinned host memory for device loads, split into two buffers per reader thread (16 threads:
# 16 MiB reads). A fresh daemon page-locks it before its first copies: H200, 16 GB from the page cache
# (benchmarks/results/cold_load-cuda0-2026-11-29-run6-staging.json, run7): 0.59-0.79 s with 512 MiB,
# 0.70-0.76 s with 1 GiB, 0.87-0.92 s with 2 GiB; cold (disk-bound) 7.8-8.7 s with 512 MiB, 8.4 with 2 GiB.
DEFAULT_STAGING = 512 << 20
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

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def read_fraction(self) -> float:
        return self.bytes_read / self.checkpoint_bytes if self.checkpoint_bytes else 1.0


Extent = tuple[Path, int, int]  # file, byte offset, length


def placement_extents(p: Placement) -> list[Extent]:
    """The file byte ranges that hold this placement's (sharded, uncast) bytes, in slab order."""
    src = p.source
    if p.nbytes == 0 or src.nbytes == 0:
        return []
    if p.shard is None:
        return [(src.file, src.start, src.nbytes)]
    shape = src.shape
    item = src.nbytes
    for s in shape:
        item //= s
    d = p.shard.dim
    inner = item
    for s in shape[d + 1 :]:
        inner *= s  # bytes of one index of dim d
    outer = 1
    for s in shape[:d]:
        outer *= s
    span = shape[d] * inner  # bytes of one outer index
    piece = p.shard.length * inner
    first = src.start + p.shard.start * inner
    return [(src.file, first + o * span, piece) for o in range(outer)]


@dataclass
class _Job:
    placement: Placement | None  # the first placement; None: a flat copy of a file (the host tier)
    dest: int  # slab offset where the first extent lands
    extents: list[Extent] = field(default_factory=list)
    cast: bool = False
    more: list[Placement] = field(default_factory=list)  # further placements continuing in the slab

    @property
    def nbytes(self) -> int:
        return sum(e[2] for e in self.extents)

    @property
    def label(self) -> str:
        if self.placement is None:
            return "slab copy"
        if not self.more:
            return f"tensor {self.placement.source.name!r}"
        return f"tensors {self.placement.source.name!r} .. {self.more[-1].source.name!r}"

    def add(self, f: Path, off: int, n: int) -> None:
        last = self.extents[-1] if self.extents else None
        if last is not None and last[0] == f and last[1] + last[2] == off:
            self.extents[-1] = (f, last[1], last[2] + n)  # contiguous in the file: one read
        else:
            self.extents.append((f, off, n))


def _jobs(layout: Layout, chunk: int) -> list[_Job]:
    """Jobs of at most ``chunk`` bytes, each landing contiguously in the slab. Small tensors that
    follow each other in the slab share a job (a 50,000-tensor MoE checkpoint is a few hundred
    jobs, not 50,000), and reads contiguous in the file are merged into one."""
    jobs: list[_Job] = []
    job: _Job | None = None  # the open job
    filled = 0  # bytes in it
    for p in layout.placements:
        extents = placement_extents(p)
        if not extents:
            continue
        if p.dtype != p.source.dtype:
            jobs.append(_Job(p, p.offset, list(extents), cast=True))
            continue
        if job is not None and job.dest + filled == p.offset:
            if not job.extents:  # a job just opened after a full one: it starts with this tensor
                job.placement, job.more = p, []
            elif job.placement is not p:
                job.more.append(p)
        else:
            if job is not None:
                jobs.append(job)
            job, filled = _Job(p, p.offset), 0
        for f, start, length in extents:
            off, left = start, length
            while left:
                take = min(left, chunk - filled)
                job.add(f, off, take)
                off, left, filled = off + take, left - take, filled + take
                if filled == chunk:
                    jobs.append(job)
                    job, filled = _Job(p, job.dest + filled), 0
    if job is not None and job.extents:
        jobs.append(job)
    return jobs


ALIGN_IO = 4096  # O_DIRECT offset/length/buffer alignment


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


def _streamed(jobs: list[_Job], files: set[Path]) -> list[_Job]:
    """The jobs a stream load reads as a front of blocks: one file range (no row pieces), no cast, in ``files``."""
    return [j for j in jobs if not j.cast and len(j.extents) == 1 and j.extents[0][0] in files]


def _pieces(job: _Job, block: int) -> list[tuple[int, int]]:
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


_RESIDENT = bytes(i & 1 for i in range(256))


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    """libc with mmap, munmap, mincore and madvise typed (addresses as integers), loaded once."""
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC = libc
    return _LIBC


def map_readonly(fd: int, size: int) -> tuple[int, Callable[[], None]]:
    """Map ``size`` bytes of ``fd`` read-only and shared (sealed memfds allow nothing else): the address and
    the call that unmaps it. OSError when the kernel refuses. An address, not a Python buffer: a read-only
    ``mmap`` object exports no writable buffer, and ctypes cannot take the address of any other."""
    libc = _libc()
    addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes: {os.strerror(err)}")
    return int(addr), lambda: libc.munmap(addr, size)


def page_cache_fraction(path: Path | int) -> float:
    """Fraction of a file's pages resident in the page cache (mmap + mincore), 0..1; 1.0 if unknown.
    ``path``: a path, or an open descriptor (mapped as is, not closed)."""
    try:
        own = not isinstance(path, int)
        src = path if isinstance(path, int) else os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            size = os.fstat(src).st_size
            if size == 0:
                return 1.0
            page = os.sysconf("SC_PAGE_SIZE")
            addr, unmap = map_readonly(src, size)
        finally:
            if own:
                os.close(src)
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if _libc().mincore(addr, size, vec) != 0:
                return 1.0
            return bytes(vec).translate(_RESIDENT).count(1) / pages  # bit 0: resident (C speed: 4M pages per 16 GB)
        finally:
            unmap()
    except (OSError, AttributeError, ValueError):
        return 1.0


class BlockCheck(Protocol):
    """Verifies bytes a load read from a file before the load counts them as loaded (a host-tier entry's
    ``BlockCrcs``): called with a ``block``-aligned file offset and the bytes read from there (whole blocks,
    the file's last one possibly shorter); raises (a WCacheError) on bytes that differ."""

    @property
    def block(self) -> int: ...

    def __call__(self, offset: int, data: memoryview) -> None: ...


class _Files:
    """One read-only fd per file (and an O_DIRECT one where asked), shared by the reader threads.

    With a ``checkpoint`` the fds are its own validated descriptors (borrowed, not closed here) and
    a path it does not hold is an error; ``opened`` maps paths to descriptors the caller opened and
    checked (borrowed too: a host-tier slab file); any other path is opened once through
    ``open_regular``. ``check``: every byte read is passed to it (``BlockCheck``)."""

    def __init__(
        self,
        checkpoint: Checkpoint | None = None,
        *,
        opened: dict[Path, int] | None = None,
        check: BlockCheck | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.fds: dict[Path, int] = dict(opened or {})
        self.owned: list[int] = []
        self.direct_fds: dict[Path, int] = {}
        self.lock = threading.Lock()
        self.check = check

    def direct_fd(self, path: Path) -> int:
        """An O_DIRECT fd of the same open file as ``fd(path)``, or -1 where the filesystem refuses it (tmpfs...)
        or the load is checked (its reads go through ``read_job``, which checks them)."""
        if self.check is not None:
            return -1
        fd = self.direct_fds.get(path)
        if fd is None:
            base = self.fd(path)
            with self.lock:
                fd = self.direct_fds.get(path)
                if fd is None:
                    fd = _reopen_direct(base)
                    self.direct_fds[path] = fd
        return fd

    def fd(self, path: Path) -> int:
        fd = self.fds.get(path)
        if fd is None:
            with self.lock:
                fd = self.fds.get(path)
                if fd is None:
                    if self.checkpoint is not None:
                        fd = self.checkpoint.fd(path)
                    else:
                        fd, _ = open_regular(path, what="slab file")
                        self.owned.append(fd)
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    self.fds[path] = fd
        return fd

    def close(self) -> None:
        for fd in [*self.owned, *self.direct_fds.values()]:
            if fd >= 0:
                os.close(fd)
        self.owned.clear()
        self.fds.clear()
        self.direct_fds.clear()


def _reopen_direct(fd: int) -> int:
    """``fd``'s file opened again with O_DIRECT through /proc/self/fd (the inode, not a path), or -1."""
    try:
        new = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECT", 0))
    except OSError:
        return -1
    a, b = os.fstat(fd), os.fstat(new)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # cannot happen through /proc; never read another file
        os.close(new)
        return -1
    return new


def _read(files: _Files, job: _Job, view: memoryview) -> None:
    """Fill ``view`` with the job's extents, back to back."""
    pos = 0
    for f, off, n in job.extents:
        fd = files.fd(f)
        done = 0
        while done < n:
            got = os.preadv(fd, [view[pos + done : pos + n]], off + done)
            if got == 0:
                raise CheckpointError(f"{f}: {job.label}: file ended early (truncated while loading?)")
            done += got
        pos += n
    if files.check is not None:
        pos = 0
        for _, off, n in job.extents:
            files.check(off, view[pos : pos + n])
            pos += n


def _send(files: _Files, job: _Job, out_fd: int) -> None:
    """Copy the job's extents into the memfd ``out_fd`` from slab offset ``job.dest`` on, in the kernel."""
    os.lseek(out_fd, job.dest, os.SEEK_SET)
    for f, off, n in job.extents:
        fd = files.fd(f)
        done = 0
        while done < n:
            try:
                got = os.sendfile(out_fd, fd, off + done, n - done)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise CheckpointError(f"shared memory is full while loading {f}: {job.label} ({exc})") from exc
                raise
            if got == 0:
                raise CheckpointError(f"{f}: {job.label}: file ended early (truncated while loading?)")
            done += got
    if files.check is not None:
        _check_sent(files.check, job, out_fd)


def _check_sent(check: BlockCheck, job: _Job, out_fd: int) -> None:
    """The bytes ``sendfile`` copied into the slab (in the kernel: nothing else saw them), checked where they landed:
    through a read-only mapping of the slab's range (no second copy; it does not hinder sealing, and is gone after)."""
    start = job.dest - job.dest % mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(out_fd, job.dest + job.nbytes - start, mmap.MAP_SHARED, mmap.PROT_READ, offset=start)
    view = memoryview(mm)
    try:
        pos = job.dest - start
        for _, off, n in job.extents:
            check(off, view[pos : pos + n])
            pos += n
    finally:
        view.release()
        try:
            mm.close()
        except BufferError:  # a slice held by a failed check's traceback: unmapped when that goes
            pass


def _read_direct(fd: int, view: memoryview, off: int, n: int, where: str) -> int:
    """O_DIRECT read of [off, off+n) into ``view`` (page-aligned, >= n + 2*ALIGN_IO bytes).

    Reads the aligned superset; returns where the wanted bytes start in ``view``.
    """
    start = off - off % ALIGN_IO
    delta = off - start
    want = delta + n
    length = -(-want // ALIGN_IO) * ALIGN_IO
    got = 0
    while got < want:
        r = os.preadv(fd, [view[got:length]], start + got)
        if r == 0 or (r % ALIGN_IO and got + r < want):
            raise CheckpointError(f"{where}: file ended early (truncated while loading?)")
        got += r
    return delta


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
    staging_bytes: int = DEFAULT_STAGING,
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
    chunk = _chunk(threads, staging_bytes)
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
    staging_bytes: int = DEFAULT_STAGING,
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
    chunk = min(FLAT_CHUNK, _chunk(threads, staging_bytes))
    if check is not None:
        chunk = max(check.block, chunk - chunk % check.block)
    jobs = [_Job(None, off, [(path, off, min(chunk, slab.size - off))]) for off in range(0, slab.size, chunk)]
    files = _Files(opened={path: fd} if fd is not None else None, check=check)
    total = _execute(jobs, slab, threads, chunk, set(), progress, files=files)
    return LoadStats(total, total, time.perf_counter() - t0, total)


def _chunk(threads: int, staging_bytes: int) -> int:
    return max(1 << 20, min(MAX_CHUNK, staging_bytes // (2 * threads)))


def _execute(
    jobs: list[_Job],
    slab: Slab,
    threads: int,
    chunk: int,
    direct: set[Path],
    progress: TextIO | bool | None,
    checkpoint: Checkpoint | None = None,
    *,
    block: int = 0,
    files: _Files | None = None,
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
    files = files if files is not None else _Files(checkpoint)
    staged = _streamed(jobs, direct) if block else []
    writer = slab.writer(jobs, threads, direct, staged)
    if not isinstance(writer, StagedWriter):
        staged = []
    target = slab.tensor() if any(j.cast for j in jobs) else None  # casts run in torch (imported then)
    front = {id(j) for j in staged}
    failed: list[BaseException] = []  # the staged jobs' own errors (not the LoadAborted they cause elsewhere)
    items: list[_Job | _Block] = []
    for job in _ordered(jobs):
        if id(job) in front:
            st = _StagedJob(job, len(pieces := _pieces(job, block)))
            items.extend(_Block(st, p, n) for p, n in pieces)
        else:
            items.append(job)

    def run(item: _Job | _Block) -> None:
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

    def __init__(self, job: _Job, blocks: int) -> None:
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

    def read(self, files: _Files, writer: StagedWriter) -> bool:
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
        _read_direct(fd, view[pos : pos + self.n], self.offset, need, f"{f}: {st.job.label}")  # offset is aligned
        with st.lock:
            st.left -= 1
            last = st.left == 0
        if last:
            st.view = None
            writer.commit(st.job, st.slot, off - st.base)
        return last


MADV_POPULATE_WRITE = 23  # Linux >= 5.14: allocate the pages of a range now, failing with an errno


def _populate(base: int, off: int, n: int, where: str) -> None:
    """Allocate the shared-memory pages of slab bytes [off, off+n) before writing them through the
    mapping: a page that cannot be allocated is then a clear error here, not a SIGBUS in a write.
    Costs what the write's page faults would have (the pages are zeroed either way)."""
    page = mmap.PAGESIZE
    start = (base + off) // page * page
    end = -(-(base + off + n) // page) * page
    if _libc().madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOMEM, errno.ENOSPC, errno.EFAULT):
            raise CheckpointError(f"shared memory is full while loading {where} ({os.strerror(err)})")
        # EINVAL: an older kernel; the writes fault the pages in as before


def _ordered(jobs: list[_Job]) -> Iterator[_Job]:
    """Jobs in file order: neighbouring threads read neighbouring ranges (readahead-friendly)."""
    return iter(sorted(jobs, key=lambda j: (str(j.extents[0][0]), j.extents[0][1])))


def _cast_job(files: _Files, job: _Job, target: torch.Tensor) -> None:
    """Read a placement whole and cast it with torch on the slab's device (a no-op move for host slabs)."""
    import torch

    p = job.placement
    assert p is not None
    raw = bytearray(job.nbytes)
    _read(files, job, memoryview(raw))
    shape = list(p.source.shape)
    if p.shard is not None:
        shape[p.shard.dim] = p.shard.length
    t: Any = torch.frombuffer(raw, dtype=torch.uint8).to(target.device)
    t = t.view(torch_dtype(p.source.dtype)).reshape(shape).to(torch_dtype(p.dtype))
    target[p.offset : p.offset + p.nbytes].copy_(t.reshape(-1).view(torch.uint8))


# What backends' writers use (wcache/server/backends/): the job, the shared fds and the file reads.
Job = _Job
Files = _Files
read_job = _read
send_job = _send
read_direct = _read_direct
populate = _populate
