"""CUDA backend: the slab lives on one GPU and is exported once, for every lease.

``export="vmm"`` (default, see benchmarks/results/ for the measurement): cuMemCreate with
the POSIX-fd handle type; each STATE carries the fd (SCM_RIGHTS) — a capability handed
to one checked peer, mapped read-only by zero_copy clients where the driver allows.
``export="ipc"``: a cudaMalloc'd slab (torch) and its 64-byte cudaIpcMemHandle in the
STATE frame. Either way: one handle per rank, never one per tensor.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import queue
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from wcache import _cuda
from wcache.errors import DeviceMismatchError, OutOfMemoryError, UnsupportedPlatformError
from wcache.proto import DeviceInfo, SlabDescriptor
from wcache.server.backends.base import DEFAULT_STAGING, LoadAborted, MemoryRegion, PinnedFile
from wcache.server.reads import ALIGN_IO, Files, Job, read_direct, read_job

if TYPE_CHECKING:
    import torch

__all__ = ["CudaBackend", "CudaDepositSlab", "CudaIpcSlab", "CudaVmmSlab"]

log = logging.getLogger("wcache.loader")

EXPORTS = ("vmm", "ipc")


class _Staging:
    """All reader threads' pinned buffers in one anonymous mapping. Each thread page-locks its own
    buffers (``cudaHostRegister`` of its slice) when it takes them, so registration runs in parallel
    and overlaps the other threads' copies instead of delaying the first copy (a fresh daemon's 2 GiB
    of cudaHostAlloc took ~0.85 s on the H200, one up-front registration of 512 MiB ~0.1 s; a tier
    reload measured 0.62 s this way, 0.61 s registering up front). Falls back to torch's pinned
    allocator where registration is refused."""

    def __init__(self, slots: int, size: int) -> None:
        import torch

        self.size = size
        self.slots = slots
        self.mm: mmap.mmap | None = None
        self.base: torch.Tensor | None = None
        self.registered: list[int] = []
        try:
            self.mm = mmap.mmap(-1, slots * size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self.mm.madvise(mmap.MADV_HUGEPAGE)  # fewer pages to fault in and pin, where THP allows
            self.base = torch.frombuffer(self.mm, dtype=torch.uint8)
        except (OSError, ValueError) as exc:
            log.debug("staging: no anonymous mapping (%s); using cudaHostAlloc", exc)
        self.next = 0
        self.lock = threading.Lock()

    def take(self, n: int) -> list[torch.Tensor]:
        """``n`` page-aligned pinned buffers of ``size`` bytes for the calling thread."""
        import torch

        with self.lock:
            first = self.next
            self.next += n
        if first + n > self.slots:
            raise RuntimeError(f"staging has {self.slots} buffers, all taken")
        if self.base is not None:
            piece = self.base[first * self.size : (first + n) * self.size]
            err = torch.cuda.cudart().cudaHostRegister(piece.data_ptr(), piece.numel(), 0)  # type: ignore[no-untyped-call]
            if int(err) == 0:
                with self.lock:
                    self.registered.append(piece.data_ptr())
                return [piece[i * self.size : (i + 1) * self.size] for i in range(n)]
            log.debug("staging: cudaHostRegister refused (%s); using cudaHostAlloc", err)
        # cudaHostAlloc is page-aligned in practice; over-allocate a page to be sure (O_DIRECT needs it)
        raw = [torch.empty(self.size + ALIGN_IO, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
        return [b[(-b.data_ptr()) % ALIGN_IO :][: self.size] for b in raw]

    def close(self) -> None:
        import torch

        with self.lock:
            ptrs, self.registered = self.registered, []
        for ptr in ptrs:
            torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]
        self.base = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view is still referenced somewhere: the mapping goes with it
                pass
            self.mm = None


class _DeviceWorker:
    """Per-thread pinned double buffer (from the shared staging) and CUDA stream."""

    def __init__(self, device: torch.device, staging: _Staging) -> None:
        import torch

        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        size = staging.size
        self.bufs = staging.take(2)  # page-aligned (the mapping's slices are multiples of pages)
        self.views = [memoryview((ctypes.c_char * size).from_address(b.data_ptr())).cast("B") for b in self.bufs]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def slot(self) -> int:
        i = self.turn
        self.turn ^= 1
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()  # the copy out of this buffer has finished: reuse it
        return i

    def finish(self) -> None:
        self.stream.synchronize()


class _DeviceWriter:
    """Device slab writes: each reader thread reads into one of its two pinned buffers (O_DIRECT for the
    files in ``direct``) while the other is copied to the slab on its own stream (double buffering).
    2 buffers per thread that can run a copy job, each as large as the largest job (<= chunk) + 2 pages:
    room to read an aligned superset with O_DIRECT. A small model does not pin the whole staging budget.

    ``staged`` jobs (``--io stream``) are read in blocks by every thread into a shared pool of job-sized
    buffers (``stage`` / ``commit``, the loader's front): one copy per job; a buffer comes back to the pool
    with the event of its copy, synchronised before it is filled again."""

    #: staging buffers for the staged front: jobs being read + jobs being copied (16 threads x 512 KiB
    #: blocks span at most 2 jobs of 16 MiB)
    STAGED_BUFFERS = 6

    def __init__(
        self, target: torch.Tensor, jobs: Sequence[Job], threads: int, direct: set[Path], staged: Sequence[Job] = ()
    ) -> None:
        self.target = target
        self.direct = direct
        self.local = threading.local()
        self.workers: list[_DeviceWorker] = []
        self.lock = threading.Lock()
        front = {id(j) for j in staged}
        copies = [j.nbytes for j in jobs if not j.cast and id(j) not in front]
        self.staging: _Staging | None = None
        self.pool_size = min(len(staged), self.STAGED_BUFFERS)
        sizes = copies + [j.nbytes for j in staged]
        if sizes:
            size = -(-max(sizes) // ALIGN_IO) * ALIGN_IO + 2 * ALIGN_IO
            self.staging = _Staging(2 * min(threads, len(copies)) + self.pool_size, size)
        #: the staged pool: (slot, the event of the copy last made from it, or None), and its buffers
        self.free: queue.SimpleQueue[tuple[int, torch.cuda.Event | None]] = queue.SimpleQueue()
        self.pool: list[torch.Tensor] = []
        self.aborted = False
        self.streams: list[torch.cuda.Stream] = []

    def _worker(self) -> _DeviceWorker:
        w: _DeviceWorker | None = getattr(self.local, "w", None)
        if w is None:
            assert self.staging is not None
            w = self.local.w = _DeviceWorker(self.target.device, self.staging)
            with self.lock:
                self.workers.append(w)
        return w

    def write(self, job: Job, files: Files) -> None:
        import torch

        n = job.nbytes
        w = self._worker()
        i = w.slot()
        start = 0
        f, off, _ = job.extents[0]
        dfd = files.direct_fd(f) if f in self.direct and len(job.extents) == 1 else -1
        if dfd >= 0:
            start = read_direct(dfd, w.views[i], off, n, f"{f}: {job.label}")
        else:
            read_job(files, job, w.views[i][:n])
        with torch.cuda.stream(w.stream):
            self.target[job.dest : job.dest + n].copy_(w.bufs[i][start : start + n], non_blocking=True)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(w.stream)
        w.events[i] = ev

    def stage(self, job: Job) -> tuple[int, memoryview]:
        with self.lock:
            grow = len(self.pool) < self.pool_size
            if grow:
                assert self.staging is not None
                self.pool.append(self.staging.take(1)[0])  # page-locked as it is first needed
                slot, ev = len(self.pool) - 1, None
        while not grow:
            if self.aborted:
                raise LoadAborted("another job of this load failed")
            try:
                slot, ev = self.free.get(timeout=0.1)
                break
            except queue.Empty:
                continue
        if ev is not None:
            ev.synchronize()  # the copy out of this buffer has finished: refill it
        buf = self.pool[slot]
        return slot, memoryview((ctypes.c_char * buf.numel()).from_address(buf.data_ptr())).cast("B")

    def commit(self, job: Job, slot: int, start: int) -> None:
        import torch

        stream = getattr(self.local, "stream", None)
        if stream is None:
            stream = self.local.stream = torch.cuda.Stream(self.target.device)  # type: ignore[no-untyped-call]
            with self.lock:
                self.streams.append(stream)
        n = job.nbytes
        with torch.cuda.stream(stream):
            self.target[job.dest : job.dest + n].copy_(self.pool[slot][start : start + n], non_blocking=True)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(stream)
        self.free.put((slot, ev))

    def abort(self) -> None:
        self.aborted = True

    def finish(self) -> None:
        import torch

        for w in self.workers:
            w.finish()
        for s in self.streams:
            s.synchronize()
        torch.cuda.synchronize(self.target.device)  # also the casts' copies (default stream)

    def close(self) -> None:
        self.workers.clear()
        self.streams.clear()
        self.pool.clear()
        if self.staging is not None:
            self.staging.close()
            self.staging = None


CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads (H2D copies)


class _PinnedTierFile:
    """A tier file mapped and registered with the CUDA driver (page-locked): a device slab refills
    from it with one host-to-device copy at DMA speed (16 GB: 0.29 s on the H200) instead of
    going through staging buffers. Registration costs 0.67 s per 16 GB, paid in the background."""

    def __init__(self, path: Path, size: int) -> None:
        import torch

        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.inode = os.fstat(fd).st_ino  # the file pinned: a rewritten entry is another inode
            # read-only: the device only reads it, and Linux refuses to page-lock writable shared
            # mappings of files outside tmpfs (a --host-tier-dir on disk)
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.tensor: torch.Tensor | None = torch.frombuffer(self.mm, dtype=torch.uint8)
        assert self.tensor is not None
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size, CUDA_HOST_REGISTER_READ_ONLY)  # type: ignore[no-untyped-call]
        if int(err) != 0:
            self.tensor = None
            self.mm.close()
            raise OSError(f"cudaHostRegister: error {int(err)} ({err})")

    def close(self) -> None:
        if self.tensor is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())  # type: ignore[no-untyped-call]
            self.tensor = None
            try:
                self.mm.close()
            except BufferError:  # a copy in flight still references it: the mapping goes with it
                pass


class _CudaSlab:
    """What both CUDA slabs share: a device tensor over the slab, staged writes, sync on seal."""

    size: int
    index: int
    staging_bytes: int  # the pinned staging a load's writer takes: its backend's (base.Slab)
    direct_io = True  # reads land in pinned staging buffers: O_DIRECT skips the page-cache copy
    _t: torch.Tensor | None

    def tensor(self) -> torch.Tensor:
        if self._t is None:
            raise RuntimeError("slab is closed")
        return self._t

    def writer(self, jobs: Sequence[Job], threads: int, direct: set[Path], staged: Sequence[Job] = ()) -> _DeviceWriter:
        return _DeviceWriter(self.tensor(), jobs, threads, direct, staged)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.tensor().device)

    def copy_pinned(self, pinned: PinnedFile) -> bool:
        """One DMA copy from a page-locked tier file (``CudaBackend.pinner``)."""
        import torch

        if not isinstance(pinned, _PinnedTierFile) or pinned.tensor is None:
            return False
        target = self.tensor()
        target.copy_(pinned.tensor[: self.size], non_blocking=True)
        torch.cuda.synchronize(target.device)
        return True

    def read(self, offset: int, n: int) -> bytes:
        """Through the driver (cuMemcpyDtoH on this process's mapping): no torch needed."""
        if offset < 0 or n < 0 or offset + n > self.size:
            raise ValueError(f"bytes {offset}..{offset + n} are outside the slab of {self.size}")
        return _cuda.memcpy_dtoh(self._ptr() + offset, n, self.index)

    def _ptr(self) -> int:
        return int(self.tensor().data_ptr())

    def region(self) -> MemoryRegion:
        """The daemon's own device mapping of the slab (read-write: CUDA has no read-only registration to
        offer; a source only ever exposes it for remote READs, docs/fleet.md)."""
        return MemoryRegion(self._ptr(), self.size, "cuda", self.index)

    def seal(self) -> None:
        import torch

        torch.cuda.synchronize(self.index)
        torch.cuda.empty_cache()  # cast/transform scratch: the daemon keeps only the slab (+ its context)

    def save_to(self, fd: int, chunk: int = 256 << 20) -> None:
        """Device -> two pinned buffers (copy of chunk i+1 overlaps the write of chunk i) -> file."""
        import torch

        src = self.tensor()
        size = src.numel()
        bufs = [torch.empty(min(chunk, size), dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        views = [memoryview((ctypes.c_char * b.numel()).from_address(b.data_ptr())).cast("B") for b in bufs]
        stream = torch.cuda.Stream(self.index)  # type: ignore[no-untyped-call]
        pending: list[tuple[int, int, int, torch.cuda.Event]] = []  # offset, length, buffer, copy done

        def flush() -> None:
            off, n, k, ev = pending.pop(0)
            ev.synchronize()
            done = 0
            while done < n:
                done += os.pwrite(fd, views[k][done:n], off + done)

        for i, off in enumerate(range(0, size, chunk)):
            n = min(chunk, size - off)
            k = i % 2
            if len(pending) == 2:
                flush()  # frees buffer k (the older of the two)
            with torch.cuda.stream(stream):
                bufs[k][:n].copy_(src[off : off + n], non_blocking=True)
                ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
                ev.record(stream)
            pending.append((off, n, k, ev))
        while pending:
            flush()


class CudaIpcSlab(_CudaSlab):
    """A cudaMalloc'd slab (through torch) shared as a 64-byte cudaIpcMemHandle."""

    def __init__(self, nbytes: int, index: int, *, staging_bytes: int = DEFAULT_STAGING) -> None:
        import torch

        self.size = nbytes
        self.index = index
        self.staging_bytes = staging_bytes
        self._t = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
        self.handle, self.offset = _cuda.ipc_handle(self._t.data_ptr())
        self.uuid = _cuda.device_uuid(index)

    def export(self) -> tuple[SlabDescriptor, list[int]]:
        desc = SlabDescriptor(
            size=self.size, kind="cuda_ipc", handle=self.handle, offset=self.offset, device_uuid=self.uuid
        )
        return desc, []

    def close(self) -> None:
        import torch

        self._t = None
        torch.cuda.empty_cache()


class CudaVmmSlab(_CudaSlab):
    """A cuMemCreate'd slab shared as a POSIX fd (SCM_RIGHTS)."""

    def __init__(self, nbytes: int, index: int, adopt_fd: int = -1, *, staging_bytes: int = DEFAULT_STAGING) -> None:
        self.size = nbytes
        self.index = index
        self.staging_bytes = staging_bytes
        self.alloc = (
            _cuda.VmmAllocation.adopt(adopt_fd, nbytes, index) if adopt_fd >= 0 else _cuda.vmm_allocate(nbytes, index)
        )
        self._t = None  # the torch view, made on first use: an adopted slab is served without torch
        self._closed = False
        self.uuid = _cuda.device_uuid(index)

    def tensor(self) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("slab is closed")
        if self._t is None:
            self._t = self.alloc.buffer.tensor()[: self.size]
        return self._t

    def _ptr(self) -> int:
        if self._closed:
            raise RuntimeError("slab is closed")
        return int(self.alloc.ptr)

    def export(self) -> tuple[SlabDescriptor, list[int]]:
        return SlabDescriptor(size=self.size, kind="cuda_vmm", fd=0, device_uuid=self.uuid), [self.alloc.fd]

    def close(self) -> None:
        self._t = None
        self._closed = True
        self.alloc.close()


class CudaDepositSlab(CudaVmmSlab):
    """A VMM slab an engine writes (DEPOSIT_SLAB hands it the fd, docs/protocol.md §4.13).

    The daemon never writes it and never needs torch for it: the engine copied its tensors in and
    synchronised before COMMIT. ``seal()`` cannot revoke the engine's mapping (CUDA has no
    F_SEAL_WRITE); what COMMIT guarantees for a CUDA deposit is written in §4.13 and docs/security.md.
    Exported, kept and adopted exactly like a loaded VMM slab (kind ``cuda_vmm``)."""

    def seal(self) -> None:
        """Nothing to synchronise or drop: no scratch was allocated for it in this process."""


class CudaBackend:
    name = "cuda"

    def __init__(self, index: int, export: str = "vmm", *, staging_bytes: int = DEFAULT_STAGING) -> None:
        if export not in EXPORTS:
            raise ValueError(f"export must be one of {EXPORTS}")
        self.index = index
        self.export = export
        #: pinned host memory each load into one of its slabs stages through (base.Slab.staging_bytes)
        self.staging_bytes = staging_bytes
        self.device = DeviceInfo(kind="cuda", index=index)

    def prepare_loads(self) -> None:
        """Initialise torch's CUDA runtime on this device before the driver path (``_cuda``) touches the
        context. Measured on the H200 (16 GB, page cache warm): a daemon whose driver calls (platform
        probe, UUID) came first and torch's runtime second loaded at 4.7 GB/s (3.43 s); the same
        daemon with torch initialised first at 27 GB/s (0.59 s). A daemon that only reclaims from its
        keeper skips this and never imports torch."""
        import torch

        torch.cuda.init()  # type: ignore[no-untyped-call]
        torch.empty(1, device=f"cuda:{self.index}")

    def check_device(self, loads: bool) -> None:
        """Can ``cuda:<index>`` be used here at all? Asked before the lock and the checkpoint, and before any
        device context exists: the torch build (only where ``loads`` or ``--cuda-export ipc`` need torch: a
        daemon serving what its keeper holds does not), cuda-bindings, the OS, and the devices the driver counts (torch's count where torch
        loads, which makes no context; the driver's cuInit + cuDeviceGetCount otherwise). Every message ends in
        what to do."""
        where = f"{sys.platform} {platform.release()}"
        problems = []
        if sys.platform != "linux" or "microsoft" in platform.release().lower():
            problems.append(f"CUDA memory cannot be shared between processes on {where}")
        torch_count: Callable[[], int] | None = None
        if loads or self.export == "ipc":  # ipc slabs are torch allocations, even the platform probe's
            import torch

            torch_count = torch.cuda.device_count
            if torch.version.cuda is None:
                problems.append(
                    f"this torch ({torch.__version__}) was built without CUDA: install a CUDA build of torch "
                    "(pip install torch --index-url https://download.pytorch.org/whl/cu128, or the command "
                    "pytorch.org gives for your CUDA driver)"
                )
        try:
            _cuda._bindings()
        except UnsupportedPlatformError:
            problems.append("the cuda-bindings package is not installed (pip install cuda-bindings)")
        if problems:
            raise UnsupportedPlatformError(
                f"--device cuda:{self.index} cannot be used here: {'; and '.join(problems)}. Or serve host shared "
                "memory instead: --device cpu",
                details={"platform": where, "device": f"cuda:{self.index}"},
            )
        count = int(torch_count()) if torch_count is not None else _cuda.device_count()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        entries = [e.strip() for e in visible.split(",")] if visible else []
        hidden = ""
        if visible is not None and count < len(entries):  # the driver stops at the first entry it cannot find
            hidden = (
                f" CUDA_VISIBLE_DEVICES={visible!r} names {len(entries)}, but {entries[count]!r} is not a GPU "
                "or MIG instance of this machine, which hides it and every entry after it (nvidia-smi -L lists "
                "the GPUs and MIG instances with their UUIDs)."
            )
        elif visible is not None and not entries:
            hidden = " CUDA_VISIBLE_DEVICES is set but empty, which hides every GPU."
        if count == 0:
            raise UnsupportedPlatformError(
                f"--device cuda:{self.index}: no CUDA device is visible to this process.{hidden or ' '}"
                + (
                    ""
                    if hidden
                    else "Check that nvidia-smi lists a GPU (in a container: that the runtime passes one in). "
                )
                + "Or serve host shared memory instead: --device cpu",
                details={"platform": where, "device": f"cuda:{self.index}", "visible": 0},
            )
        if self.index >= count:
            names = "cuda:0" if count == 1 else f"cuda:0 .. cuda:{count - 1}"
            raise UnsupportedPlatformError(
                f"--device cuda:{self.index} does not exist: {count} CUDA device{'s' if count > 1 else ''} "
                f"visible ({names}).{hidden} Pass one of those (indices count the visible devices only)",
                details={"platform": where, "device": f"cuda:{self.index}", "visible": count},
            )

    def check_platform(self) -> None:
        """Before anything loads: can this machine share CUDA memory between processes? Asks the driver
        (cuda-bindings), not torch, so a daemon serving only kept slabs starts without torch; with
        ``export="ipc"`` the probe allocates through torch."""
        where = f"{sys.platform} {platform.release()}"
        alternatives = "alternatives: --device cpu (host shared memory) or loading weights from disk"
        if sys.platform != "linux" or "microsoft" in platform.release().lower():
            raise UnsupportedPlatformError(
                f"CUDA IPC is not supported on {where}; {alternatives}", details={"platform": where}
            )
        _cuda._bindings()  # raises UnsupportedPlatformError naming the missing package
        count = _cuda.device_count()
        if count == 0:
            raise UnsupportedPlatformError(
                f"no CUDA device is available to the driver on {where}; {alternatives}",
                details={"platform": where},
            )
        if self.index >= count:
            raise UnsupportedPlatformError(
                f"cuda:{self.index} does not exist ({count} visible: "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); {alternatives}",
                details={"platform": where},
            )
        self.device = DeviceInfo(
            kind="cuda", index=self.index, uuid=_cuda.device_uuid(self.index), name=_cuda.device_name(self.index)
        )
        # a tiny round trip proves the driver lets us export this kind of memory
        try:
            if self.export == "vmm":
                _cuda.vmm_allocate(1 << 21, self.index).close()  # cuMemCreate + export to an fd
            else:
                probe = self.allocate(1 << 21)
                try:
                    probe.export()
                finally:
                    probe.close()
        except UnsupportedPlatformError:
            raise
        except Exception as exc:
            raise UnsupportedPlatformError(
                f"this driver/platform refused to export CUDA memory ({self.export}): {exc}; {alternatives}",
                details={"platform": where, "export": self.export},
            ) from exc

    def adopt(self, desc: SlabDescriptor, fd: int) -> CudaVmmSlab:
        """A slab handed over by another daemon (its VMM fd); legacy IPC slabs cannot be re-exported."""
        if desc.kind != "cuda_vmm":
            raise UnsupportedPlatformError(
                f"a {desc.kind} slab cannot be handed over (only cuda_vmm; start with --cuda-export vmm)"
            )
        if desc.device_uuid != self.device.uuid:
            raise DeviceMismatchError(f"the slab is on GPU {desc.device_uuid}, this daemon serves {self.device.uuid}")
        return CudaVmmSlab(desc.size, self.index, adopt_fd=fd)

    def allocate(self, nbytes: int) -> CudaIpcSlab | CudaVmmSlab:
        """A slab for a load: torch is imported first, so its runtime owns the context as it always did."""
        import torch  # noqa: F401

        if self.export == "ipc":
            return CudaIpcSlab(nbytes, self.index, staging_bytes=self.staging_bytes)
        return CudaVmmSlab(nbytes, self.index, staging_bytes=self.staging_bytes)

    def check_deposits(self) -> None:
        """Before anything is laid out or evicted for a DEPOSIT: legacy IPC slabs cannot be handed to an
        engine writable and then served (docs/protocol.md §4.13), only VMM ones."""
        if self.export != "vmm":
            raise UnsupportedPlatformError(
                f"this daemon exports CUDA slabs as legacy IPC handles (--cuda-export {self.export}), which cannot "
                "take deposits: restart it with --cuda-export vmm (the default), or let the engine post-process "
                "on every start",
                details={"backend": self.name, "export": self.export},
            )

    def check_room(self, nbytes: int, freeing: int = 0) -> None:
        """OutOfMemoryError when the GPU's free memory, with ``freeing`` bytes given back (evictions), cannot
        hold ``nbytes`` more: decided before anything is evicted for a load."""
        free, total = self.memory_info()
        if total and nbytes > free + freeing:
            raise OutOfMemoryError(
                f"a slab of {nbytes} bytes ({nbytes / 2**30:.2f} GiB) does not fit cuda:{self.index}: {free} of "
                f"{total} bytes free" + (f", {freeing} more after evicting" if freeing else "") + ". Fix: free GPU "
                "memory (evict models, stop other processes on the GPU) or load fewer bytes per daemon (a larger "
                "--tp-size)",
                details={"needed": nbytes, "free": free, "total": total, "where": f"cuda:{self.index}"},
            )

    def allocate_deposit(self, nbytes: int) -> CudaDepositSlab:
        """A VMM slab an engine writes (its fd travels in DEPOSIT_SLAB); OutOfMemoryError first when the
        GPU has less free memory than the allocation (granularity-rounded) needs."""
        self.check_deposits()
        self.check_room(nbytes)  # free now: a deposit evicts nothing before its COMMIT
        return CudaDepositSlab(nbytes, self.index)

    def pinner(self) -> Callable[[Path, int], PinnedFile] | None:
        return _PinnedTierFile

    def memory_info(self) -> tuple[int, int]:
        return _cuda.mem_get_info(self.index)
