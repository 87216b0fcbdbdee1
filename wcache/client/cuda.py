"""Client side of the CUDA backend: pick the GPU by UUID, map the daemon's slab.

The driver calls go through ``wcache.client.driver`` (ctypes over the libcuda.so.1 torch has
loaded), not cuda-bindings: importing those cost a restarting engine 69-130 ms (issue 20).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from wcache import _cuda
from wcache.client import driver
from wcache.errors import DeviceMismatchError, ProtocolError, UnsupportedPlatformError
from wcache.proto import SlabDescriptor

__all__ = ["ipc_open", "local_uuid", "map_slab", "vmm_import", "write_vmm_deposit"]


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise UnsupportedPlatformError(
            "the daemon serves GPU memory but this process sees no CUDA device; "
            "run the engine on that GPU, use a --device cpu daemon, or load from disk"
        )


def local_uuid(device: torch.device | None, daemon_uuid: str) -> str:
    """The UUID this client sends in GET_STATE: its chosen device's, or the daemon's GPU if visible."""
    _require_cuda()
    if device is not None and device.type == "cuda":
        return _cuda.device_uuid(device.index if device.index is not None else torch.cuda.current_device())
    if _cuda.device_index_for_uuid(daemon_uuid) is None:
        visible = [_cuda.device_uuid(i) for i in range(torch.cuda.device_count())]
        raise DeviceMismatchError(
            f"the daemon's GPU {daemon_uuid} is not visible to this process (visible: {visible}); "
            "check CUDA_VISIBLE_DEVICES",
            details={"daemon": daemon_uuid, "visible": visible},
        )
    return daemon_uuid


def _make_current(index: int) -> None:
    """Make device ``index``'s primary context current on this thread (torch's, so tensors agree).

    ``set_device`` does it on CUDA >= 12 runtimes; only when the driver reports no such context
    does a one-element allocation force it (the caching allocator's first segment: ~ms).
    """
    torch.cuda.set_device(index)
    if driver.current_device() != index:
        torch.empty(1, device=f"cuda:{index}")


def ipc_open(handle: bytes, offset: int, size: int, index: int) -> _cuda.DeviceBuffer:
    """Open a legacy IPC handle on device ``index``; the buffer closes the handle."""
    _make_current(index)
    base = driver.ipc_open(handle)
    return _cuda.DeviceBuffer(base + offset, size, index, lambda: driver.ipc_close(base))


def vmm_import(fd: int, offset: int, size: int, index: int, *, read_only: bool) -> tuple[_cuda.DeviceBuffer, bool]:
    """Import a VMM fd (the caller closes it), map it; returns the buffer and whether it is read-only."""
    _make_current(index)
    gran = driver.granularity(index)
    total = max(gran, -(-(offset + size) // gran) * gran)
    ptr, ro = driver.vmm_import_map(fd, total, index, read_only=read_only)
    return _cuda.DeviceBuffer(ptr + offset, size, index, lambda: driver.vmm_unmap(ptr, total)), ro


def _slab_device(desc: SlabDescriptor) -> int:
    _require_cuda()
    index = _cuda.device_index_for_uuid(desc.device_uuid)
    if index is None:
        raise DeviceMismatchError(f"slab lives on GPU {desc.device_uuid}, which this process cannot see")
    return index


def map_slab(desc: SlabDescriptor, fd: int, device: torch.device | None) -> _cuda.DeviceBuffer:
    """Map one CUDA slab of a STATE frame (``fd``: its descriptor, -1 for an IPC handle)."""
    index = _slab_device(desc)
    if device is not None and device.type == "cuda" and device.index not in (None, index):
        raise DeviceMismatchError(f"asked for cuda:{device.index}, but the slab lives on cuda:{index}")
    if desc.kind == "cuda_ipc":
        if len(desc.handle) != 64:
            raise ProtocolError(f"cuda_ipc handle must be 64 bytes, got {len(desc.handle)}")
        return ipc_open(desc.handle, desc.offset, desc.size, index)
    if fd < 0:
        raise ProtocolError("cuda_vmm slab without a file descriptor")
    buf, _read_only = vmm_import(fd, desc.offset, desc.size, index, read_only=True)
    return buf


def write_vmm_deposit(desc: SlabDescriptor, fd: int, sources: Iterable[tuple[int, torch.Tensor]]) -> None:
    """Write-back into a CUDA daemon's deposit slab (docs/protocol.md §4.13): import the VMM fd (the caller
    closes it), map it read-write, copy each ``(offset, flat uint8 tensor)`` into it — device to device
    for tensors on the slab's GPU, host to device or across GPUs otherwise —, wait for the copies, then
    unmap. After this returns the process holds no mapping of, and no handle to, the allocation: the
    daemon's COMMIT guarantee rests on that (docs/security.md, "Write-back")."""
    if fd < 0:
        raise ProtocolError("cuda_vmm deposit slab without a file descriptor")
    index = _slab_device(desc)
    buf, _ = vmm_import(fd, desc.offset, desc.size, index, read_only=False)
    try:
        base = buf.tensor()
        src: torch.Tensor | None = None
        for offset, src in sources:
            base[offset : offset + src.numel()].copy_(src, non_blocking=True)
        del src
        torch.cuda.synchronize(index)  # every copy has landed before the mapping goes (and before COMMIT)
        del base
    except BaseException:
        torch.cuda.synchronize(index)  # no copy may still target the range once it is unmapped
        raise
    finally:
        buf.close()
