"""The handful of CUDA driver calls the client maps slabs with, through ctypes over libcuda.so.1.

The engine has torch, and torch has already loaded the driver library; importing
``cuda.bindings`` for a dozen calls cost a restarting engine 69-130 ms on the H200 (docs/performance.md),
more than the whole fetch. Here each entry point is one ``ctypes`` function looked up once
(``dlopen`` of an already loaded library is a table look-up). The daemon keeps cuda-bindings
(``wcache._cuda``) for what it does once per load.

Every call checks its ``CUresult`` and raises :class:`CudaDriverError` (a ``RuntimeError``)
naming the call and the driver's name and text for the code, e.g.
``cuMemMap failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument``. No driver library:
:class:`~wcache.errors.UnsupportedPlatformError`.

Constants follow cuda.h (CUDA >= 11.0 for the VMM calls). The structs the mapping passes (an allocation's
properties, an access descriptor, a UUID) are bytes laid out as cuda.h lays them out (``struct``, x86-64 and
aarch64 alike) and every pointer argument is a ``c_void_p``: a ctypes ``Structure`` class and its ``POINTER`` type
cost ~40 us each to create, and this module loads in a fetch's window (docs/performance.md). The one struct
passed by value, the legacy IPC handle, is a ``Structure`` made on its first use (the legacy export only).
"""

from __future__ import annotations

import ctypes
import struct
import time
from collections.abc import Callable
from ctypes import byref, c_char_p, c_int, c_size_t, c_uint, c_ulonglong, c_void_p
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "SIGNATURES",
    "CudaDriverError",
    "DeviceBuffer",
    "access_desc",
    "allocation_prop",
    "check",
    "current_device",
    "device_uuids",
    "granularity",
    "ipc_close",
    "ipc_handle_type",
    "ipc_open",
    "vmm_import_map",
    "vmm_unmap",
]

LIBRARY = "libcuda.so.1"

CUresult = c_int
CUdeviceptr = c_ulonglong  # 64-bit platforms only (like CUDA itself since 12.0)
CUmemGenericAllocationHandle = c_ulonglong

# enums (cuda.h)
CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CUDA_SUCCESS = 0

#: CUmemAllocationProp (32 bytes): type, requestedHandleTypes, location {type, id}, win32HandleMetaData (a
#: pointer, at offset 16), allocFlags {compressionType, gpuDirectRDMACapable (uint8), usage (uint16), reserved[4]}
_ALLOCATION_PROP = struct.Struct("=iiiiQBBH4x")
#: CUmemAccessDesc (12 bytes): location {type, id}, flags
_ACCESS_DESC = struct.Struct("=iii")
#: sizeof(CUuuid), sizeof(CUipcMemHandle)
UUID_SIZE, IPC_HANDLE_SIZE = 16, 64


def allocation_prop(index: int) -> bytes:
    """A CUmemAllocationProp: pinned device memory on device ``index``, exportable as a POSIX fd."""
    return _ALLOCATION_PROP.pack(
        CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CU_MEM_LOCATION_TYPE_DEVICE, index,
        0, 0, 0, 0,
    )  # fmt: skip


def access_desc(index: int, flags: int) -> bytes:
    """A CUmemAccessDesc: ``flags`` (CU_MEM_ACCESS_FLAGS_PROT_*) for device ``index``."""
    return _ACCESS_DESC.pack(CU_MEM_LOCATION_TYPE_DEVICE, index, flags)


_IPC_HANDLE: list[type[ctypes.Structure]] = []


def ipc_handle_type() -> type[ctypes.Structure]:
    """CUipcMemHandle (64 bytes, passed by value: a ctypes Structure, made once on first use)."""
    if not _IPC_HANDLE:

        class CUipcMemHandle(ctypes.Structure):
            _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]

        _IPC_HANDLE.append(CUipcMemHandle)
    return _IPC_HANDLE[0]


#: stands for CUipcMemHandle in an argtypes tuple (its Structure is made when the entry point is first looked up)
IPC_HANDLE = "CUipcMemHandle"

#: name in libcuda -> (argtypes); every function returns CUresult. The first name found wins. Pointer arguments
#: (out-parameters, structs) are ``c_void_p``: callers pass ``byref(...)`` or bytes.
SIGNATURES: dict[str, tuple[tuple[str, ...], tuple[Any, ...]]] = {
    "cuGetErrorName": (("cuGetErrorName",), (CUresult, c_void_p)),
    "cuGetErrorString": (("cuGetErrorString",), (CUresult, c_void_p)),
    "cuCtxGetDevice": (("cuCtxGetDevice",), (c_void_p,)),
    "cuDeviceGetCount": (("cuDeviceGetCount",), (c_void_p,)),
    "cuDeviceGet": (("cuDeviceGet",), (c_void_p, c_int)),
    # MIG instances have their own UUID through _v2 (CUDA >= 11.4), as the runtime reports them
    "cuDeviceGetUuid": (("cuDeviceGetUuid_v2", "cuDeviceGetUuid"), (c_void_p, c_int)),
    "cuMemGetAllocationGranularity": (("cuMemGetAllocationGranularity",), (c_void_p, c_void_p, c_int)),
    "cuMemImportFromShareableHandle": (("cuMemImportFromShareableHandle",), (c_void_p, c_void_p, c_int)),
    "cuMemAddressReserve": (("cuMemAddressReserve",), (c_void_p, c_size_t, c_size_t, CUdeviceptr, c_ulonglong)),
    "cuMemMap": (("cuMemMap",), (CUdeviceptr, c_size_t, c_size_t, CUmemGenericAllocationHandle, c_ulonglong)),
    "cuMemSetAccess": (("cuMemSetAccess",), (CUdeviceptr, c_size_t, c_void_p, c_size_t)),
    "cuMemUnmap": (("cuMemUnmap",), (CUdeviceptr, c_size_t)),
    "cuMemAddressFree": (("cuMemAddressFree",), (CUdeviceptr, c_size_t)),
    "cuMemRelease": (("cuMemRelease",), (CUmemGenericAllocationHandle,)),
    # cuda.h: #define cuIpcOpenMemHandle cuIpcOpenMemHandle_v2 (CUDA >= 11.0)
    "cuIpcOpenMemHandle": (("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"), (c_void_p, IPC_HANDLE, c_uint)),
    "cuIpcCloseMemHandle": (("cuIpcCloseMemHandle",), (CUdeviceptr,)),
}


def argtypes(name: str) -> list[Any]:
    """The ctypes argtypes of entry point ``name`` (SIGNATURES', the IPC handle's Structure made)."""
    return [ipc_handle_type() if t is IPC_HANDLE else t for t in SIGNATURES[name][1]]


class CudaDriverError(RuntimeError):
    """A CUDA driver call returned an error; ``code`` is the CUresult, ``name`` its CUDA_ERROR_* name."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        super().__init__(f"{call} failed: {name} ({code}){': ' + text if text else ''}")
        self.call, self.code, self.name = call, code, name


class _Driver:
    """The entry points (attributes named as in ``SIGNATURES``), each looked up in the library on its first use:
    a restart's first fetch resolves the half dozen it calls, not the whole table (``resolve_all`` checks every
    one, for tests and diagnostics)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        fn = self._resolve(name)
        if fn is None:
            symbol = SIGNATURES[name][0][0]
            raise _unsupported(
                f"the CUDA driver ({LIBRARY}) has no {symbol}; update the NVIDIA driver "
                "(CUDA >= 11.0 is needed to map wcache's GPU slabs)",
                details={"missing": symbol},
            )
        return fn

    def _resolve(self, name: str) -> Any:
        """Entry point ``name`` with its argtypes set, kept as this object's attribute (later look-ups find it: no
        ``__getattr__``); None where the library has none of its symbols. AttributeError for a name ``SIGNATURES``
        does not declare."""
        entry = SIGNATURES.get(name)
        if entry is None:
            raise AttributeError(name)
        for symbol in entry[0]:
            try:
                fn = getattr(self._lib, symbol)
            except AttributeError:
                continue
            fn.argtypes = argtypes(name)
            fn.restype = CUresult
            setattr(self, name, fn)
            return fn
        return None

    def look_up(self, names: tuple[str, ...]) -> None:
        """Look the entry points ``names`` up now where the library has them (one it lacks is left for its first
        call to raise on, where it matters): the first fetch does it while the daemon answers."""
        for name in names:
            if name not in vars(self):
                self._resolve(name)

    def resolve_all(self) -> None:
        """Look every entry point up now (UnsupportedPlatformError naming the first one missing)."""
        for name in SIGNATURES:
            getattr(self, name)


_DRIVER: _Driver | None = None


def _unsupported(message: str, details: dict[str, Any]) -> Exception:
    """UnsupportedPlatformError (the error tree is imported when one is raised: the driver loads in a fetch's
    window, docs/performance.md)."""
    from wcache.errors import UnsupportedPlatformError

    return UnsupportedPlatformError(message, details=details)


def driver() -> _Driver:
    """The driver entry points, resolved on first use (torch has normally loaded the library)."""
    global _DRIVER
    if _DRIVER is None:
        try:
            lib = ctypes.CDLL(LIBRARY)
        except OSError as exc:
            raise _unsupported(
                f"cannot load the CUDA driver library {LIBRARY} ({exc}); install the NVIDIA driver, "
                "or use a --device cpu daemon",
                details={"missing": LIBRARY},
            ) from exc
        _DRIVER = _Driver(lib)
    return _DRIVER


def _describe(code: int) -> tuple[str, str]:
    d = driver()
    name, text = c_char_p(), c_char_p()
    label = name.value.decode() if d.cuGetErrorName(code, byref(name)) == 0 and name.value else "CUDA_ERROR_UNKNOWN"
    detail = text.value.decode() if d.cuGetErrorString(code, byref(text)) == 0 and text.value else ""
    return label, detail


def check(code: int, call: str) -> None:
    """Raise :class:`CudaDriverError` for a non-zero CUresult."""
    if code != CUDA_SUCCESS:
        name, text = _describe(code)
        raise CudaDriverError(call, code, name, text)


def current_device() -> int | None:
    """The device of the calling thread's current context, None when no context is current."""
    dev = c_int()
    return int(dev.value) if driver().cuCtxGetDevice(byref(dev)) == CUDA_SUCCESS else None


def device_uuids() -> list[str] | None:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` of every visible device, by ordinal (the ordinals torch uses:
    both follow CUDA_VISIBLE_DEVICES), formatted as torch formats them; None when the driver is not initialised
    in this process (no CUDA context yet: ask torch). Microseconds, where torch's ``get_device_properties``
    first queries every property of the device."""
    d = driver()
    n = c_int()
    if d.cuDeviceGetCount(byref(n)) != CUDA_SUCCESS:
        return None
    out = []
    for i in range(n.value):
        dev, uuid = c_int(), ctypes.create_string_buffer(UUID_SIZE)
        if d.cuDeviceGet(byref(dev), i) != CUDA_SUCCESS or d.cuDeviceGetUuid(byref(uuid), dev) != CUDA_SUCCESS:
            return None
        h = uuid.raw.hex()
        out.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}")
    return out


_GRANULARITY: dict[int, int] = {}


def granularity(index: int) -> int:
    """Minimum VMM granularity of device ``index`` (cached: it is a property of the GPU)."""
    gran = _GRANULARITY.get(index)
    if gran is None:
        out = c_size_t()
        check(
            driver().cuMemGetAllocationGranularity(
                byref(out), allocation_prop(index), CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
            "cuMemGetAllocationGranularity",
        )
        gran = _GRANULARITY[index] = int(out.value)
    return gran


def vmm_import_map(
    fd: int, size: int, index: int, *, read_only: bool, timings: dict[str, float] | None = None
) -> tuple[int, bool]:
    """Import a POSIX-fd VMM handle (the caller keeps and closes ``fd``), reserve ``size`` bytes,
    map and set access on device ``index`` — read-only where the driver allows. Returns
    (address, mapped read-only). The allocation handle is released at once: the mapping keeps the
    memory alive until :func:`vmm_unmap`. ``timings`` (ms, added to): ``import_handle``
    (cuMemImportFromShareableHandle), ``reserve_map_access`` (cuMemAddressReserve + cuMemMap + cuMemSetAccess),
    and its parts ``reserve``, ``map_range`` (cuMemMap), ``set_access`` (with ``set_access_refused``: a read-only
    attempt the driver refused before the read-write one)."""
    d = driver()
    t0 = time.perf_counter()
    handle = CUmemGenericAllocationHandle()
    check(
        d.cuMemImportFromShareableHandle(byref(handle), c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        "cuMemImportFromShareableHandle",
    )
    t1 = time.perf_counter()
    try:
        ptr = CUdeviceptr()
        check(d.cuMemAddressReserve(byref(ptr), size, 0, 0, 0), "cuMemAddressReserve")
        addr = int(ptr.value)
        try:
            t2 = time.perf_counter()
            check(d.cuMemMap(addr, size, 0, handle, 0), "cuMemMap")
            t3 = time.perf_counter()
            ro = False
            refused = 0.0
            if read_only:
                ro = d.cuMemSetAccess(addr, size, access_desc(index, CU_MEM_ACCESS_FLAGS_PROT_READ), 1) == CUDA_SUCCESS
                if not ro:
                    refused = time.perf_counter() - t3
            if not ro:
                acc = access_desc(index, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                check(d.cuMemSetAccess(addr, size, acc, 1), "cuMemSetAccess")
            if timings is not None:
                t4 = time.perf_counter()
                for name, ms in (
                    ("import_handle", t1 - t0),
                    ("reserve_map_access", t4 - t1),
                    ("reserve", t2 - t1),
                    ("map_range", t3 - t2),
                    ("set_access", t4 - t3),
                    ("set_access_refused", refused),
                ):
                    timings[name] = timings.get(name, 0.0) + ms * 1e3
            return addr, ro
        except BaseException:
            d.cuMemUnmap(addr, size)  # fails harmlessly when nothing was mapped
            d.cuMemAddressFree(addr, size)
            raise
    finally:
        d.cuMemRelease(handle)


def vmm_unmap(addr: int, size: int) -> None:
    d = driver()
    d.cuMemUnmap(addr, size)
    d.cuMemAddressFree(addr, size)


def ipc_open(handle: bytes) -> int:
    """Open a 64-byte legacy IPC handle on the current context; returns the allocation's base."""
    if len(handle) != IPC_HANDLE_SIZE:
        raise ValueError(f"a CUipcMemHandle is {IPC_HANDLE_SIZE} bytes, got {len(handle)}")
    h = ipc_handle_type().from_buffer_copy(handle)
    ptr = CUdeviceptr()
    check(driver().cuIpcOpenMemHandle(byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
    return int(ptr.value)


def ipc_close(base: int) -> None:
    driver().cuIpcCloseMemHandle(base)


class DeviceBuffer:
    """Owns one mapped device range; exposes it for ``torch.as_tensor`` (no copy). The client's mappings and the
    daemon's allocations (``wcache._cuda``) alike: ``release`` (None: nothing) runs once, on ``close`` or when the
    last reference goes."""

    def __init__(self, ptr: int, size: int, index: int, release: Callable[[], None] | None) -> None:
        self.ptr, self.size, self.index = ptr, size, index
        self._release = release
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }

    def tensor(self) -> torch.Tensor:
        import torch  # the daemon's backend imports this module without torch (wcache._cuda)

        return torch.as_tensor(self, device=f"cuda:{self.index}")

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver frees it anyway
            pass
