"""The read primitives every load is built from: what a load reads and how bytes leave a file.

- an *extent* is a byte range of a file (``placement_extents``: the ranges that hold a placement's
  sharded, uncast bytes, in slab order); a ``Job`` is extents that land back to back at one slab
  offset;
- ``Files``: one read-only descriptor per file (the checkpoint's own validated ones, or files the
  caller opened and checked), an O_DIRECT one beside it where asked, and the ``BlockCheck`` every byte
  read is passed to (a host-tier refill);
- the reads: ``read_job`` (``preadv`` into a buffer), ``send_job`` (``sendfile`` into a memfd, in the
  kernel), ``read_direct`` (an O_DIRECT read of an aligned superset), ``populate`` (a shared mapping's
  pages allocated before it is written), ``map_readonly`` and ``page_cache_fraction`` (mmap + mincore).

The loader (wcache/server/loader.py) plans jobs and runs the reader threads; the backends' writers
(wcache/server/backends/) read each job with these into their slab. Both sit above this module, which
imports neither (tests/server/test_boundary.py), so backends never import the loader.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from wcache.errors import CheckpointError
from wcache.files import open_regular

if TYPE_CHECKING:
    from wcache.plan.checkpoint import Checkpoint
    from wcache.plan.layout import Placement

__all__ = [
    "ALIGN_IO",
    "MADV_POPULATE_WRITE",
    "BlockCheck",
    "Extent",
    "Files",
    "Job",
    "map_readonly",
    "page_cache_fraction",
    "placement_extents",
    "populate",
    "read_direct",
    "read_job",
    "send_job",
]

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
class Job:
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


ALIGN_IO = 4096  # O_DIRECT offset/length/buffer alignment

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


class Files:
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


def read_job(files: Files, job: Job, view: memoryview) -> None:
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


def send_job(files: Files, job: Job, out_fd: int) -> None:
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


def _check_sent(check: BlockCheck, job: Job, out_fd: int) -> None:
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


def read_direct(fd: int, view: memoryview, off: int, n: int, where: str) -> int:
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


MADV_POPULATE_WRITE = 23  # Linux >= 5.14: allocate the pages of a range now, failing with an errno


def populate(base: int, off: int, n: int, where: str) -> None:
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
