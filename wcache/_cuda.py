"""CUDA plumbing of the daemon's CUDA backend (export) and shared helpers (device UUIDs; ``DeviceBuffer``, the
mapped range's owner, is the client driver's: ``wcache.client.driver``).

Two ways to share one slab between processes (docs/protocol.md §4.5):

- legacy IPC: ``cudaIpcGetMemHandle`` on a ``cudaMalloc`` allocation; the 64-byte handle
  travels as msgpack bin and the peer calls ``cudaIpcOpenMemHandle``;
- VMM: ``cuMemCreate`` with the POSIX-fd handle type; the fd travels with SCM_RIGHTS and
  the peer imports, reserves, maps and sets access (read-only where the driver allows).

Either way the mapped range becomes a torch tensor through ``__cuda_array_interface__``;
the holder object unmaps when torch frees the last view. The daemon side needs ``cuda-bindings``;
the client maps through ``wcache.client.driver`` (ctypes over libcuda.so.1, no import cost).

Importing this module imports no torch. Where torch is not imported (a daemon serving only what its
keeper or a takeover handed it: docs/performance.md, "Daemon restart"), device UUIDs, the context and memory
figures come from the driver (the primary context: the one torch's runtime uses once it is imported); where
torch is, they come from torch as before.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from typing import Any

from wcache.client.driver import DeviceBuffer
from wcache.errors import UnsupportedPlatformError

__all__ = [
    "DeviceBuffer",
    "device_index_for_uuid",
    "device_uuid",
    "ipc_handle",
    "vmm_allocate",
]


_DRIVER: Any = None


def _bindings() -> Any:
    """The CUDA driver API bindings (only the driver module: it imports in milliseconds)."""
    global _DRIVER
    if _DRIVER is not None:
        return _DRIVER
    try:
        driver = importlib.import_module("cuda.bindings.driver")
    except ImportError:
        try:  # cuda-python < 12.6 spelled it cuda.cuda
            driver = importlib.import_module("cuda.cuda")
        except ImportError as exc:
            raise UnsupportedPlatformError(
                "CUDA memory sharing needs the cuda-bindings package (pip install cuda-bindings); "
                "alternatives: the host backend (--device cpu) or loading from disk",
                details={"missing": "cuda-bindings"},
            ) from exc
    _DRIVER = driver
    return driver


def _check(result: Any, what: str) -> None:
    code = int(result[0] if isinstance(result, tuple) else result)
    if code != 0:
        driver = _bindings()
        try:
            _, name = driver.cuGetErrorName(code)
            label = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # best effort naming only
            label = str(result)
        raise RuntimeError(f"{what} failed: {label} ({code})")


def _torch() -> Any:
    """torch if this process has imported it (then its runtime owns the context), else None."""
    return sys.modules.get("torch")


_INIT = threading.Lock()
_PRIMARY: dict[int, Any] = {}  # device index -> its retained primary context (driver path)


def _driver_device(index: int) -> Any:
    driver = _bindings()
    _check(driver.cuInit(0), "cuInit")
    err, dev = driver.cuDeviceGet(index)
    _check(err, f"cuDeviceGet({index})")
    return dev


def device_count() -> int:
    """Visible CUDA devices (0 where the driver cannot initialise)."""
    torch = _torch()
    if torch is not None:
        return int(torch.cuda.device_count())
    driver = _bindings()
    if int(driver.cuInit(0)[0]) != 0:
        return 0
    err, n = driver.cuDeviceGetCount()
    return int(n) if int(err) == 0 else 0


def device_name(index: int) -> str:
    torch = _torch()
    if torch is not None:
        return str(torch.cuda.get_device_properties(index).name)
    driver = _bindings()
    err, name = driver.cuDeviceGetName(256, _driver_device(index))
    _check(err, "cuDeviceGetName")
    raw = bytes(name) if isinstance(name, (bytes, bytearray)) else str(name).encode()
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def device_uuid(index: int) -> str:
    """``GPU-xxxxxxxx-...`` of the visible device ``index`` (stable across CUDA_VISIBLE_DEVICES); torch
    formats its UUID as 8-4-4-4-12 lowercase hex digits, and so does the driver path here."""
    torch = _torch()
    if torch is not None:
        return "GPU-" + str(torch.cuda.get_device_properties(index).uuid).removeprefix("GPU-")
    driver = _bindings()
    get = getattr(driver, "cuDeviceGetUuid_v2", None) or driver.cuDeviceGetUuid  # v2: MIG UUIDs, as the runtime
    err, uuid = get(_driver_device(index))
    _check(err, "cuDeviceGetUuid")
    raw = uuid.bytes
    data = bytes(raw) if isinstance(raw, (bytes, bytearray)) else bytes(v & 0xFF for v in raw)
    h = data[:16].hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def device_index_for_uuid(uuid: str) -> int | None:
    for i in range(device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


def _make_current(index: int) -> None:
    """The device's primary context exists and is current in this thread: through torch where it is
    imported (as before), else through the driver (cuDevicePrimaryCtxRetain, retained once)."""
    torch = _torch()
    if torch is not None:
        torch.cuda.set_device(index)
        torch.empty(1, device=f"cuda:{index}")  # the primary context exists and is current
        return
    driver = _bindings()
    with _INIT:
        ctx = _PRIMARY.get(index)
        if ctx is None:
            err, ctx = driver.cuDevicePrimaryCtxRetain(_driver_device(index))
            _check(err, "cuDevicePrimaryCtxRetain")
            _PRIMARY[index] = ctx
    _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def mem_get_info(index: int) -> tuple[int, int]:
    """(free, total) bytes of device ``index``: torch's figures where it is imported, else the driver's in
    the primary context."""
    torch = _torch()
    if torch is not None:
        free, total = torch.cuda.mem_get_info(index)
        return int(free), int(total)
    _make_current(index)
    err, free, total = _bindings().cuMemGetInfo()
    _check(err, "cuMemGetInfo")
    return int(free), int(total)


def memcpy_dtoh(ptr: int, n: int, index: int) -> bytes:
    """``n`` bytes of device memory at ``ptr`` (a mapping of this process on device ``index``), read with
    the driver (synchronous): no torch needed (the reclaim check of a torch-free daemon)."""
    import ctypes

    _make_current(index)
    driver = _bindings()
    buf = bytearray(n)
    host = (ctypes.c_char * n).from_buffer(buf)
    _check(driver.cuMemcpyDtoH(ctypes.addressof(host), ptr, n), "cuMemcpyDtoH")
    del host
    return bytes(buf)


# ---------------------------------------------------------------- legacy IPC


def ipc_handle(ptr: int) -> tuple[bytes, int]:
    """(64-byte CUipcMemHandle, offset of ``ptr`` inside its allocation)."""
    driver = _bindings()
    err, handle = driver.cuIpcGetMemHandle(ptr)
    _check(err, "cuIpcGetMemHandle")
    err, base, _size = driver.cuMemGetAddressRange(ptr)
    _check(err, "cuMemGetAddressRange")
    raw = handle.reserved
    data = bytes(raw) if isinstance(raw, (bytes, bytearray)) else bytes(v & 0xFF for v in raw)
    return data, ptr - int(base)


# ---------------------------------------------------------------- VMM


def _prop(driver: Any, index: int) -> Any:
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = index
    prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _granularity(driver: Any, index: int) -> int:
    err, gran = driver.cuMemGetAllocationGranularity(
        _prop(driver, index), driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    )
    _check(err, "cuMemGetAllocationGranularity")
    return int(gran)


def _map(driver: Any, handle: Any, size: int, index: int, read_only: bool) -> tuple[int, bool]:
    """Reserve, map and set access; returns (address, mapped read-only)."""
    err, ptr = driver.cuMemAddressReserve(size, 0, 0, 0)
    _check(err, "cuMemAddressReserve")
    ptr = int(ptr)
    try:
        _check(driver.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
        acc = driver.CUmemAccessDesc()
        acc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = index
        flags = driver.CUmemAccess_flags
        if read_only:
            acc.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READ
            if int(driver.cuMemSetAccess(ptr, size, [acc], 1)[0]) == 0:
                return ptr, True
        acc.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(driver.cuMemSetAccess(ptr, size, [acc], 1), "cuMemSetAccess")
        return ptr, False
    except BaseException:
        driver.cuMemUnmap(ptr, size)
        driver.cuMemAddressFree(ptr, size)
        raise


class VmmAllocation:
    """The daemon's VMM slab: one physical allocation, mapped read-write here, exportable as an fd."""

    def __init__(self, nbytes: int, index: int) -> None:
        driver = _bindings()
        _make_current(index)
        self.index = index
        gran = _granularity(driver, index)
        self.size = max(gran, -(-nbytes // gran) * gran)
        err, self.handle = driver.cuMemCreate(self.size, _prop(driver, index), 0)
        _check(err, f"cuMemCreate({self.size} bytes)")
        try:
            self.ptr, _ = _map(driver, self.handle, self.size, index, read_only=False)
            err, fd = driver.cuMemExportToShareableHandle(
                self.handle, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
            )
            _check(err, "cuMemExportToShareableHandle")
            self.fd = int(fd)
        except BaseException:
            driver.cuMemRelease(self.handle)
            raise
        self.buffer = DeviceBuffer(self.ptr, self.size, index, None)

    @classmethod
    def adopt(cls, fd: int, nbytes: int, index: int) -> VmmAllocation:
        """Take over an allocation another process exported as ``fd`` (daemon hand-off): import it,
        map it here, and keep ``fd`` to export it again."""
        driver = _bindings()
        _make_current(index)
        self = cls.__new__(cls)
        self.index = index
        gran = _granularity(driver, index)
        self.size = max(gran, -(-nbytes // gran) * gran)
        err, self.handle = driver.cuMemImportFromShareableHandle(
            fd, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        _check(err, "cuMemImportFromShareableHandle")
        try:
            self.ptr, _ = _map(driver, self.handle, self.size, index, read_only=False)
        except BaseException:
            driver.cuMemRelease(self.handle)
            raise
        self.fd = fd
        self.buffer = DeviceBuffer(self.ptr, self.size, index, None)
        return self

    def close(self) -> None:
        driver = _bindings()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.handle is not None:
            driver.cuMemUnmap(self.ptr, self.size)
            driver.cuMemAddressFree(self.ptr, self.size)
            driver.cuMemRelease(self.handle)
            self.handle = None


def vmm_allocate(nbytes: int, index: int) -> VmmAllocation:
    return VmmAllocation(nbytes, index)
