"""CUDA backend: the slab lives on one GPU and is exported once, for every lease.

``export="vmm"`` (default, see benchmarks/results/ for the measurement): cuMemCreate with
the POSIX-fd handle type; each STATE carries the fd (SCM_RIGHTS) — a capability handed
to one checked peer, mapped read-only by zero_copy clients where the driver allows.
``export="ipc"``: a cudaMalloc'd slab (torch) and its 64-byte cudaIpcMemHandle in the
STATE frame. Either way: one handle per rank, never one per tensor.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

import torch

from wcache import _cuda
from wcache.errors import DeviceMismatchError, UnsupportedPlatformError
from wcache.proto import DeviceInfo, SlabDescriptor

__all__ = ["CudaBackend", "CudaIpcSlab", "CudaVmmSlab"]

EXPORTS = ("vmm", "ipc")


class _CudaSlab:
    """What both CUDA slabs share: a device tensor over the slab, no host view, sync on seal."""

    size: int
    index: int
    _t: torch.Tensor | None

    def tensor(self) -> torch.Tensor:
        if self._t is None:
            raise RuntimeError("slab is closed")
        return self._t

    def host_fd(self) -> int | None:
        return None

    def seal(self) -> None:
        torch.cuda.synchronize(self.index)
        torch.cuda.empty_cache()  # cast/transform scratch: the daemon keeps only the slab (+ its context)

    def save_to(self, fd: int, chunk: int = 256 << 20) -> None:
        """Device -> two pinned buffers (copy of chunk i+1 overlaps the write of chunk i) -> file."""
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

    def __init__(self, nbytes: int, index: int) -> None:
        self.size = nbytes
        self.index = index
        self._t = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
        self.handle, self.offset = _cuda.ipc_handle(self._t.data_ptr())
        self.uuid = _cuda.device_uuid(index)

    def export(self) -> tuple[SlabDescriptor, list[int]]:
        desc = SlabDescriptor(
            size=self.size, kind="cuda_ipc", handle=self.handle, offset=self.offset, device_uuid=self.uuid
        )
        return desc, []

    def close(self) -> None:
        self._t = None
        torch.cuda.empty_cache()


class CudaVmmSlab(_CudaSlab):
    """A cuMemCreate'd slab shared as a POSIX fd (SCM_RIGHTS)."""

    def __init__(self, nbytes: int, index: int, adopt_fd: int = -1) -> None:
        self.size = nbytes
        self.index = index
        self.alloc = (
            _cuda.VmmAllocation.adopt(adopt_fd, nbytes, index) if adopt_fd >= 0 else _cuda.vmm_allocate(nbytes, index)
        )
        self._t = self.alloc.buffer.tensor()[:nbytes]
        self.uuid = _cuda.device_uuid(index)

    def export(self) -> tuple[SlabDescriptor, list[int]]:
        return SlabDescriptor(size=self.size, kind="cuda_vmm", fd=0, device_uuid=self.uuid), [self.alloc.fd]

    def close(self) -> None:
        self._t = None
        self.alloc.close()


class CudaBackend:
    name = "cuda"

    def __init__(self, index: int, export: str = "vmm") -> None:
        if export not in EXPORTS:
            raise ValueError(f"export must be one of {EXPORTS}")
        self.index = index
        self.export = export
        self.device = DeviceInfo(kind="cuda", index=index)

    def check_platform(self) -> None:
        """Before anything loads: can this machine share CUDA memory between processes?"""
        where = f"{sys.platform} {platform.release()}"
        alternatives = "alternatives: --device cpu (host shared memory) or loading weights from disk"
        if sys.platform != "linux" or "microsoft" in platform.release().lower():
            raise UnsupportedPlatformError(
                f"CUDA IPC is not supported on {where}; {alternatives}", details={"platform": where}
            )
        if not torch.cuda.is_available():
            raise UnsupportedPlatformError(
                f"no CUDA device is available to torch {torch.__version__} on {where}; {alternatives}",
                details={"platform": where},
            )
        if self.index >= torch.cuda.device_count():
            raise UnsupportedPlatformError(
                f"cuda:{self.index} does not exist ({torch.cuda.device_count()} visible: "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); {alternatives}",
                details={"platform": where},
            )
        _cuda._bindings()  # raises UnsupportedPlatformError naming the missing package
        props = torch.cuda.get_device_properties(self.index)
        self.device = DeviceInfo(kind="cuda", index=self.index, uuid=_cuda.device_uuid(self.index), name=props.name)
        # a tiny round trip proves the driver lets us export this kind of memory
        probe = self.allocate(1 << 21)
        try:
            probe.export()
        except Exception as exc:
            raise UnsupportedPlatformError(
                f"this driver/platform refused to export CUDA memory ({self.export}): {exc}; {alternatives}",
                details={"platform": where, "export": self.export},
            ) from exc
        finally:
            probe.close()

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
        if self.export == "ipc":
            return CudaIpcSlab(nbytes, self.index)
        return CudaVmmSlab(nbytes, self.index)
