"""The client's ctypes CUDA driver binding, checked without a GPU: every entry point the client
calls is declared with argtypes, the structs it packs have cuda.h's layouts, errors carry the driver's name
for the CUresult, and failed mappings are undone (a fake libcuda records the calls)."""

from __future__ import annotations

import ast
import ctypes
import inspect
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from wcache.client import cuda, driver
from wcache.errors import UnsupportedPlatformError

SOURCES = [Path(driver.__file__), Path(cuda.__file__)]


def _called_entry_points() -> set[str]:
    """Every ``cu*`` attribute called in the client's CUDA modules (``d.cuX(...)``, ``driver().cuX(...)``)."""
    names: set[str] = set()
    for src in SOURCES:
        for node in ast.walk(ast.parse(src.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("cu") and node.attr[2:3].isupper():
                names.add(node.attr)
    return names


def test_every_called_entry_point_is_declared() -> None:
    called = _called_entry_points()
    assert {"cuMemImportFromShareableHandle", "cuMemMap", "cuMemSetAccess", "cuIpcOpenMemHandle"} <= called
    assert called <= set(driver.SIGNATURES), called - set(driver.SIGNATURES)


@pytest.mark.parametrize("name", sorted(driver.SIGNATURES))
def test_signatures_are_valid_ctypes_prototypes(name: str) -> None:
    symbols, _ = driver.SIGNATURES[name]
    assert symbols and all(s.startswith(name) for s in symbols)
    argtypes = driver.argtypes(name)
    assert argtypes and driver.IPC_HANDLE not in argtypes
    ctypes.CFUNCTYPE(driver.CUresult, *argtypes)  # raises TypeError for anything ctypes cannot pass


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    """cuda.h's struct, as ctypes lays it out: the bytes the driver module packs must match it."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


def test_packed_structs_are_laid_out_as_cuda_h() -> None:
    prop = CUmemAllocationProp()
    prop.type = driver.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = driver.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location.type = driver.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 3
    assert ctypes.sizeof(prop) == 32 and CUmemAllocationProp.win32HandleMetaData.offset == 16
    assert driver.allocation_prop(3) == bytes(prop)
    acc = CUmemAccessDesc()
    acc.location.type = driver.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = 5
    acc.flags = driver.CU_MEM_ACCESS_FLAGS_PROT_READ
    assert driver.access_desc(5, driver.CU_MEM_ACCESS_FLAGS_PROT_READ) == bytes(acc)
    assert ctypes.sizeof(driver.ipc_handle_type()) == driver.IPC_HANDLE_SIZE == 64
    assert ctypes.sizeof(driver.CUdeviceptr) == 8


def test_the_driver_module_makes_no_ctypes_struct_when_imported() -> None:
    """A ctypes Structure class or POINTER type costs ~40 us to make, and the module loads in a fetch's window:
    the IPC handle's (the legacy export's) is made on first use only."""
    code = (
        "import ctypes\n"
        "import wcache.client.driver as d\n"
        "made = [v for v in vars(d).values() if isinstance(v, type) and issubclass(v, (ctypes.Structure, ctypes._Pointer))]\n"
        "assert not made, made\n"
        "assert not d._IPC_HANDLE\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class FakeLib:
    """Stands in for ctypes.CDLL("libcuda.so.1"): each entry point returns what ``results`` says
    (0 by default) and records its call."""

    def __init__(self, results: dict[str, list[int]] | None = None, missing: tuple[str, ...] = ()) -> None:
        self.calls: list[str] = []
        self.results = results or {}
        self.missing = missing

    def __getattr__(self, symbol: str) -> Callable[..., int]:
        if symbol in self.missing or not symbol.startswith("cu"):
            raise AttributeError(symbol)

        def call(*args: Any) -> int:
            self.calls.append(symbol)
            if symbol in ("cuGetErrorName", "cuGetErrorString"):
                text = b"CUDA_ERROR_INVALID_VALUE" if symbol == "cuGetErrorName" else b"invalid argument"
                args[1]._obj.value = text
                return 0
            queue = self.results.get(symbol)
            return queue.pop(0) if queue else 0

        fn: Callable[..., int] = call
        self.__dict__[symbol] = fn  # argtypes/restype get set on it like on a ctypes function
        return fn


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeLib]]:
    def install(**kw: Any) -> FakeLib:
        lib = FakeLib(**kw)
        monkeypatch.setattr(driver, "_DRIVER", None)
        monkeypatch.setattr(ctypes, "CDLL", lambda name: lib)
        return lib

    yield install
    driver._DRIVER = None


def test_no_driver_library_is_unsupported_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(driver, "_DRIVER", None)
    monkeypatch.setattr(ctypes, "CDLL", refuse)
    with pytest.raises(UnsupportedPlatformError, match=r"libcuda\.so\.1"):
        driver.driver()


def test_old_driver_without_an_entry_point_is_unsupported_platform(fake: Callable[..., FakeLib]) -> None:
    """Entry points are looked up on first use: a driver without one fails the call that needs it (and the check
    of them all), not the calls it has."""
    fake(missing=("cuMemImportFromShareableHandle",))
    driver.ipc_open(bytes(64))
    with pytest.raises(UnsupportedPlatformError, match="cuMemImportFromShareableHandle"):
        driver.vmm_import_map(5, 2 << 20, 0, read_only=True)
    with pytest.raises(UnsupportedPlatformError, match="cuMemImportFromShareableHandle"):
        driver.driver().resolve_all()


def test_a_mapping_looks_up_only_the_entry_points_it_calls(fake: Callable[..., FakeLib]) -> None:
    """A restart's first fetch pays for the half dozen symbols it uses, not the table (looked up once each)."""
    lib = fake()
    timings: dict[str, float] = {}
    driver.vmm_import_map(5, 2 << 20, 0, read_only=True, timings=timings)
    used = {"cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", "cuMemRelease"}
    assert set(vars(driver.driver())) - {"_lib"} == used and set(lib.calls) == used
    parts = {"reserve", "map_range", "set_access", "set_access_refused"}
    assert set(timings) == {"import_handle", "reserve_map_access"} | parts and all(v >= 0 for v in timings.values())
    assert timings["reserve_map_access"] >= sum(timings[p] for p in parts - {"set_access_refused"}) * 0.999
    driver.vmm_import_map(5, 2 << 20, 0, read_only=True)
    assert set(vars(driver.driver())) - {"_lib"} == used


def test_device_uuids_are_formatted_as_torch_formats_them(fake: Callable[..., FakeLib]) -> None:
    lib = fake()

    def count(out: Any) -> int:
        out._obj.value = 2
        return 0

    raw = [bytes(range(16)), bytes(range(16, 32))]

    def uuid(out: Any, dev: Any) -> int:
        ctypes.memmove(ctypes.addressof(out._obj), raw.pop(0), 16)
        return 0

    lib.__dict__["cuDeviceGetCount"] = count
    lib.__dict__["cuDeviceGetUuid_v2"] = uuid
    assert driver.device_uuids() == [
        "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f",
        "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f",
    ]
    lib2 = fake(results={"cuDeviceGetCount": [3]})  # CUDA_ERROR_NOT_INITIALIZED: no context yet, ask torch
    assert driver.device_uuids() is None and lib2.calls == ["cuDeviceGetCount"]


def test_ipc_open_falls_back_to_the_unversioned_symbol(fake: Callable[..., FakeLib]) -> None:
    lib = fake(missing=("cuIpcOpenMemHandle_v2",))
    driver.ipc_open(bytes(64))
    assert lib.calls == ["cuIpcOpenMemHandle"]


def test_error_names_call_and_driver_code(fake: Callable[..., FakeLib]) -> None:
    lib = fake(results={"cuMemMap": [1]})
    with pytest.raises(driver.CudaDriverError) as info:
        driver.vmm_import_map(5, 2 << 20, 0, read_only=True)
    assert (info.value.call, info.value.code, info.value.name) == ("cuMemMap", 1, "CUDA_ERROR_INVALID_VALUE")
    assert str(info.value) == "cuMemMap failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument"
    assert isinstance(info.value, RuntimeError)
    # the reservation is undone and the imported handle released
    tail = [c for c in lib.calls if not c.startswith("cuGetError")]
    assert tail == [
        "cuMemImportFromShareableHandle",
        "cuMemAddressReserve",
        "cuMemMap",
        "cuMemUnmap",
        "cuMemAddressFree",
        "cuMemRelease",
    ]


def test_read_only_falls_back_to_read_write(fake: Callable[..., FakeLib]) -> None:
    lib = fake(results={"cuMemSetAccess": [1, 0]})
    _addr, read_only = driver.vmm_import_map(5, 2 << 20, 0, read_only=True)
    assert read_only is False
    assert lib.calls.count("cuMemSetAccess") == 2
    assert lib.calls[-1] == "cuMemRelease"  # the mapping keeps the memory; the handle goes at once
    lib2 = fake()
    assert driver.vmm_import_map(5, 2 << 20, 0, read_only=True)[1] is True
    assert lib2.calls.count("cuMemSetAccess") == 1


def test_ipc_handle_must_be_64_bytes(fake: Callable[..., FakeLib]) -> None:
    fake()
    with pytest.raises(ValueError, match="64 bytes"):
        driver.ipc_open(b"x" * 10)


def test_client_uses_no_cuda_bindings() -> None:
    """The client's CUDA path must not need cuda-bindings (69-130 ms to import on the H200)."""
    client_dir = Path(inspect.getfile(cuda)).parent
    for src in sorted(client_dir.glob("*.py")):
        for node in ast.walk(ast.parse(src.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "cuda" for a in node.names), src.name
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "cuda", src.name
            elif isinstance(node, ast.Attribute):
                assert node.attr != "_bindings", f"{src.name} calls wcache._cuda._bindings (cuda-bindings)"


def test_look_up_resolves_what_the_library_has_and_leaves_the_rest_to_raise_where_called(
    fake: Callable[..., FakeLib],
) -> None:
    """A fetch looks its entry points up while the daemon answers (cuda.look_up): a driver without one of them must
    not fail that (a host daemon's fetch needs none), only the call that needs it."""
    lib = fake(missing=("cuMemImportFromShareableHandle",))
    cuda.look_up()
    resolved = set(vars(driver.driver())) - {"_lib"}
    assert resolved == set(cuda._FETCH_CALLS) - {"cuMemImportFromShareableHandle"}
    assert lib.calls == []  # looked up, none called
    with pytest.raises(UnsupportedPlatformError, match="cuMemImportFromShareableHandle"):
        driver.vmm_import_map(5, 2 << 20, 0, read_only=True)
