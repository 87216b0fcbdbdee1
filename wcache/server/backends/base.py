"""What a slab backend provides: everything device-specific lives behind these two interfaces.

The loader (wcache/server/loader.py) plans jobs and runs reader threads; *how* bytes reach a slab is
the slab's ``writer`` (host: ``sendfile`` and ``preadv`` into the memfd's mapping; CUDA: pinned
staging buffers and streams). Writers read with the read primitives (wcache/server/reads.py: jobs,
files, direct reads), which the loader uses too: a backend never imports the loader. Page-locking host-tier files, synchronising with the device, memory
figures for STATUS, export and adoption are the backend's too. Loader, store, tier, daemon and the
reclaim check import no device API (tests/server/test_boundary.py enforces it); the client maps
slabs in wcache/client/mapping.py.

Importing a backend imports no torch: torch comes with the first load (``Slab.tensor``, casts,
transforms), so a daemon that only serves what its keeper or a takeover handed it starts without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from wcache.proto import DeviceInfo, SlabDescriptor

if TYPE_CHECKING:
    import torch

    from wcache.server.reads import Files, Job

__all__ = [
    "DEFAULT_STAGING",
    "Backend",
    "LoadAborted",
    "MemoryRegion",
    "PinnedFile",
    "Slab",
    "StagedWriter",
    "Writer",
]

# A backend's staging budget unless it is built with another (--staging-bytes): bytes of pinned host memory
# for device loads, split into two buffers per reader thread (16 threads: 16 MiB reads). A fresh daemon
# page-locks it before its first copies: H200, 16 GB from the page cache
# (benchmarks/results/cold_load-cuda0-2026-11-29-run6-staging.json, run7): 0.59-0.79 s with 512 MiB,
# 0.70-0.76 s with 1 GiB, 0.87-0.92 s with 2 GiB; cold (disk-bound) 7.8-8.7 s with 512 MiB, 8.4 with 2 GiB.
DEFAULT_STAGING = 512 << 20


class MemoryRegion(NamedTuple):
    """A slab's bytes as this process maps them, for a transport that registers memory (NIXL, docs/fleet.md):
    ``address`` .. ``address + length`` in this process, ``kind`` "host" (DRAM) or "cuda" (GPU memory),
    ``device`` the CUDA ordinal (0 for host memory)."""

    address: int
    length: int
    kind: str
    device: int


class Writer(Protocol):
    """Writes loader jobs into one slab; ``write`` is called from several reader threads at once."""

    def write(self, job: Job, files: Files) -> None:
        """Copy the job's file extents to slab offset ``job.dest`` on (may return before the bytes land)."""
        ...

    def finish(self) -> None:
        """Every write (and every torch copy into the slab, such as casts) has landed."""
        ...

    def close(self) -> None:
        """Release what writing needed (mappings, staging, streams); called whether or not it finished."""
        ...


class LoadAborted(Exception):
    """Raised by ``StagedWriter.stage`` once ``abort`` was called: another job of the load failed (the loader
    raises that job's error, not this)."""


@runtime_checkable
class StagedWriter(Writer, Protocol):
    """A writer that also takes jobs read in pieces by several threads (``--io stream``): the loader asks
    for one staging buffer per job, every thread reads its next block of the front into it, and the thread
    that reads a job's last block commits it. Offered by writers whose slab is filled from staging (CUDA)."""

    def stage(self, job: Job) -> tuple[int, memoryview]:
        """A page-aligned buffer of at least ``job.nbytes + 2 * ALIGN_IO`` bytes, the job's alone until its
        commit, and its slot number. Blocks while every buffer is in use; raises LoadAborted once ``abort`` was
        called."""
        ...

    def commit(self, job: Job, slot: int, start: int) -> None:
        """Bytes ``[start, start + job.nbytes)`` of the slot's buffer are the job's: copy them to
        ``job.dest`` (may return before they land) and give the buffer back once the copy has read it."""
        ...

    def abort(self) -> None:
        """The load failed: wake every ``stage`` waiting for a buffer (they raise)."""
        ...


class PinnedFile(Protocol):
    """A host-tier slab file kept page-locked for this backend's refills (see ``Backend.pinner``)."""

    inode: int  # the file pinned: a rewritten entry is another inode

    def close(self) -> None: ...


class Slab(Protocol):
    """One contiguous allocation holding a rank's tensors at their layout offsets."""

    size: int
    #: whether O_DIRECT reads make sense for loads into it (device slabs: reads land in staging buffers)
    direct_io: bool
    #: host memory a load's writer may stage through, two buffers per reader thread: the loader cuts its
    #: jobs to fit (host slabs stage nothing, their jobs are cut the same way). Its backend's budget, given
    #: when the backend was built (``make_backend``, ``--staging-bytes``): no caller passes it to a load
    staging_bytes: int

    def writer(self, jobs: Sequence[Job], threads: int, direct: set[Path], staged: Sequence[Job] = ()) -> Writer:
        """A writer for ``jobs`` run by up to ``threads`` readers; files in ``direct`` may be read with
        O_DIRECT (only offered where ``direct_io``). ``staged``: the jobs the loader would read in pieces
        (``StagedWriter``) if the writer offers it; a writer that does not gets them through ``write``."""
        ...

    def tensor(self) -> torch.Tensor:
        """A writable uint8 tensor over the whole slab, for casts and transforms (only before seal()).
        Imports torch."""
        ...

    def synchronize(self) -> None:
        """Wait for the device to finish copies into the slab made through ``tensor()``."""
        ...

    def copy_pinned(self, pinned: PinnedFile) -> bool:
        """Fill the slab from a page-locked tier file in one copy; False where this slab cannot."""
        ...

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes of the slab from ``offset`` (sealed or not; the reclaim check compares them)."""
        ...

    def seal(self) -> None:
        """Loading is done: drop writable access the daemon no longer needs."""
        ...

    def save_to(self, fd: int) -> None:
        """Write the slab's ``size`` bytes to the file ``fd`` from offset 0 (the host tier)."""
        ...

    def region(self) -> MemoryRegion:
        """Where this process maps the slab, for registering it with NIXL (docs/fleet.md): writable until
        ``seal()`` (a fill writes into it), read-only afterwards on the host backend (a source serves it).
        Valid until ``seal()`` for a writable region, until ``close()`` for a sealed one: a caller
        deregisters before either."""
        ...

    def export(self) -> tuple[SlabDescriptor, list[int]]:
        """The descriptor for STATE (its ``fd`` is 0 when a descriptor travels) and the fds to
        send. The daemon keeps owning those fds; the kernel duplicates them into the peer."""
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str  # "host" | "cuda"
    device: DeviceInfo
    #: the ``staging_bytes`` of every slab it allocates (see ``Slab``), fixed when it is built
    staging_bytes: int

    def check_device(self, loads: bool) -> None:
        """Before the daemon takes its lock or touches a checkpoint: raise UnsupportedPlatformError, with a
        message that says what to do, if this device cannot be used at all here (CUDA: a torch without CUDA
        where ``loads`` needs torch, no cuda-bindings, no GPU visible, an index past the visible ones). Cheap,
        and it creates no device context (``prepare_loads`` must come first where one is made)."""
        ...

    def check_platform(self) -> None:
        """Raise UnsupportedPlatformError if this machine cannot share this kind of memory."""
        ...

    def prepare_loads(self) -> None:
        """Called before ``check_platform`` by a daemon that will load (no keeper or takeover to serve it
        from): set up whatever loads need first. CUDA: torch's runtime context before the driver's (see
        CudaBackend.prepare_loads)."""
        ...

    def allocate(self, nbytes: int) -> Slab: ...

    def adopt(self, desc: SlabDescriptor, fd: int) -> Slab:
        """Serve a slab another daemon handed over (TAKEOVER): ``fd`` is its exported descriptor."""
        ...

    def pinner(self) -> Callable[[Path, int], PinnedFile] | None:
        """How host-tier files are page-locked for faster refills (``(path, size) -> PinnedFile``), or
        None where refills gain nothing from it (host slabs)."""
        ...

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory for STATUS; (0, 0) where it does not apply."""
        ...
