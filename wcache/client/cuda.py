"""Client side of the CUDA backend: pick the GPU by UUID, map the daemon's slab.

The driver calls go through ``wcache.client.driver`` (ctypes over the libcuda.so.1 torch has
loaded), not cuda-bindings: importing those cost a restarting engine 69-130 ms (docs/performance.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from wcache.client import driver

if TYPE_CHECKING:  # the error tree is imported where an error is raised: this module loads in a fetch's window
    from wcache.proto import daemon_frames, engine

__all__ = [
    "ipc_open",
    "local_uuid",
    "look_up",
    "map_slab",
    "prepare",
    "visible_uuids",
    "vmm_import",
    "write_vmm_deposit",
]


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        from wcache.errors import UnsupportedPlatformError

        raise UnsupportedPlatformError(
            "the daemon serves GPU memory but this process sees no CUDA device; "
            "run the engine on that GPU, use a --device cpu daemon, or load from disk"
        )


def visible_uuids() -> list[str]:
    """The UUIDs of the devices this process sees, by local index: from the driver (microseconds) once CUDA is
    initialised here, else from torch (which initialises it; its first ``get_device_properties`` of a device
    queries every property)."""
    _require_cuda()
    try:
        uuids = driver.device_uuids()
    except Exception as exc:
        from wcache.errors import UnsupportedPlatformError

        if not isinstance(exc, UnsupportedPlatformError):
            raise
        uuids = None
    if uuids is None:
        from wcache import _cuda  # the daemon's module (cuda-bindings): only where the driver's context is not up

        uuids = [_cuda.device_uuid(i) for i in range(torch.cuda.device_count())]
    return uuids


def local_uuid(device: torch.device | None, daemon_uuid: str) -> str:
    """The UUID this client sends in GET_STATE: its chosen device's, or the daemon's GPU if visible."""
    visible = visible_uuids()
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if not 0 <= index < len(visible):
            from wcache.errors import DeviceMismatchError

            raise DeviceMismatchError(
                f"this process was asked to map onto {device}, but it sees {len(visible)} GPU(s) (visible: "
                f"{visible}); check the device and CUDA_VISIBLE_DEVICES",
                details={"device": str(device), "visible": visible},
            )
        return visible[index]
    if daemon_uuid not in visible:
        from wcache.errors import DeviceMismatchError

        raise DeviceMismatchError(
            f"the daemon's GPU {daemon_uuid} is not visible to this process (visible: {visible}); "
            "check CUDA_VISIBLE_DEVICES",
            details={"daemon": daemon_uuid, "visible": visible},
        )
    return daemon_uuid


#: the driver entry points a VMM slab's mapping calls (looked up ahead by ``prepare``)
_VMM_CALLS = (
    "cuMemImportFromShareableHandle",
    "cuMemAddressReserve",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemRelease",
    "cuMemUnmap",
    "cuMemAddressFree",
)


#: every entry point a fetch calls: the device queries (``prepare``) and a VMM slab's mapping
_FETCH_CALLS = (
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetUuid",
    "cuCtxGetDevice",
    "cuMemGetAllocationGranularity",
    *_VMM_CALLS,
)


def look_up() -> None:
    """The driver library loaded and every entry point a fetch calls looked up (~5 us each: a ctypes function made
    and its argtypes set), needing neither the daemon's GPU nor the slab: done while the daemon answers the HELLO
    (``client._ahead``). A library without one of them raises where that call is made, not here."""
    driver.driver().look_up(_FETCH_CALLS)


def prepare(uuid: str, timings: dict[str, float] | None = None) -> None:
    """A first mapping's work that does not need the slab, done ahead: the GPU ``uuid``'s context current on this
    thread, its VMM granularity, the driver's entry points looked up. The client calls it between HELLO_OK and
    the STATE (the daemon is answering the pipelined GET_STATE meanwhile: docs/protocol.md §5.1). ``timings``
    (ms): ``prepare_device`` (the visible GPUs' UUIDs: the first one loads the driver library's handle),
    ``prepare_context`` (the device's context current), ``prepare_driver`` (granularity, entry points)."""
    t0 = time.perf_counter()
    visible = visible_uuids()
    t1 = time.perf_counter()
    if uuid not in visible:
        return  # nothing will be mapped here: map_slab says why
    index = visible.index(uuid)
    _make_current(index)
    t2 = time.perf_counter()
    driver.granularity(index)
    d = driver.driver()
    for name in _VMM_CALLS:
        getattr(d, name)
    if timings is not None:
        timings["prepare_device"] = (t1 - t0) * 1e3
        timings["prepare_context"] = (t2 - t1) * 1e3
        timings["prepare_driver"] = (time.perf_counter() - t2) * 1e3


def _make_current(index: int) -> None:
    """Make device ``index``'s primary context current on this thread (torch's, so tensors agree).

    ``set_device`` does it on CUDA >= 12 runtimes; only when the driver reports no such context
    does a one-element allocation force it (the caching allocator's first segment: ~ms).
    """
    torch.cuda.set_device(index)
    if driver.current_device() != index:
        torch.empty(1, device=f"cuda:{index}")


def ipc_open(handle: bytes, offset: int, size: int, index: int) -> driver.DeviceBuffer:
    """Open a legacy IPC handle on device ``index``; the buffer closes the handle."""
    _make_current(index)
    base = driver.ipc_open(handle)
    return driver.DeviceBuffer(base + offset, size, index, lambda: driver.ipc_close(base))


def vmm_import(
    fd: int, offset: int, size: int, index: int, *, read_only: bool, timings: dict[str, float] | None = None
) -> tuple[driver.DeviceBuffer, bool]:
    """Import a VMM fd (the caller closes it), map it; returns the buffer and whether it is read-only
    (``timings``: the driver calls' ms, ``driver.vmm_import_map``)."""
    _make_current(index)
    gran = driver.granularity(index)
    total = max(gran, -(-(offset + size) // gran) * gran)
    ptr, ro = driver.vmm_import_map(fd, total, index, read_only=read_only, timings=timings)
    return driver.DeviceBuffer(ptr + offset, size, index, lambda: driver.vmm_unmap(ptr, total)), ro


def _slab_device(desc: engine.SlabDescriptor | daemon_frames.SlabDescriptor) -> int:
    visible = visible_uuids()
    if desc.device_uuid not in visible:
        from wcache.errors import DeviceMismatchError

        raise DeviceMismatchError(f"slab lives on GPU {desc.device_uuid}, which this process cannot see")
    return visible.index(desc.device_uuid)


def map_slab(
    desc: engine.SlabDescriptor, fd: int, device: torch.device | None, timings: dict[str, float] | None = None
) -> driver.DeviceBuffer:
    """Map one CUDA slab of a STATE frame (``fd``: its descriptor, -1 for an IPC handle; ``timings``: see
    ``vmm_import``)."""
    index = _slab_device(desc)
    if device is not None and device.type == "cuda" and device.index not in (None, index):
        from wcache.errors import DeviceMismatchError

        raise DeviceMismatchError(f"asked for cuda:{device.index}, but the slab lives on cuda:{index}")
    if desc.kind == "cuda_ipc":
        if len(desc.handle) != 64:
            from wcache.errors import RemoteProtocolError

            raise RemoteProtocolError(f"cuda_ipc handle must be 64 bytes, got {len(desc.handle)}")
        return ipc_open(desc.handle, desc.offset, desc.size, index)
    if fd < 0:
        from wcache.errors import RemoteProtocolError

        raise RemoteProtocolError("cuda_vmm slab without a file descriptor")
    buf, _read_only = vmm_import(fd, desc.offset, desc.size, index, read_only=True, timings=timings)
    return buf


def write_vmm_deposit(desc: daemon_frames.SlabDescriptor, fd: int, sources: Iterable[tuple[int, torch.Tensor]]) -> None:
    """Write-back into a CUDA daemon's deposit slab (docs/protocol.md §4.13): import the VMM fd (the caller
    closes it), map it read-write, copy each ``(offset, flat uint8 tensor)`` into it — device to device
    for tensors on the slab's GPU, host to device or across GPUs otherwise —, wait for the copies, then
    unmap. After this returns the process holds no mapping of, and no handle to, the allocation: the
    daemon's COMMIT guarantee rests on that (docs/security.md, "Write-back")."""
    if fd < 0:
        from wcache.errors import RemoteProtocolError

        raise RemoteProtocolError("cuda_vmm deposit slab without a file descriptor")
    index = _slab_device(desc)
    buf, _ = vmm_import(fd, desc.offset, desc.size, index, read_only=False)
    base: torch.Tensor | None = None
    src: torch.Tensor | None = None
    try:
        base = buf.tensor()
        for offset, src in sources:
            base[offset : offset + src.numel()].copy_(src, non_blocking=True)
        torch.cuda.synchronize(index)  # every copy has landed before the mapping goes (and before COMMIT)
    except BaseException:
        try:
            torch.cuda.synchronize(index)  # no copy may still target the range once it is unmapped
        finally:
            # the traceback keeps this frame: its tensor of the slab goes, and the mapping with the last tensor
            # holding the buffer (DeviceBuffer's own deallocation unmaps it), not under one (cuMemUnmap does not
            # know of torch's tensors: reading one would be an illegal address); none made, it is unmapped now
            if base is None:
                buf.close()
            del base, buf
        raise
    del base, src
    buf.close()
