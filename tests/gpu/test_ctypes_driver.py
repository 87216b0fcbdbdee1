"""The client's ctypes driver path on a real GPU: a slab exported by the daemon side (cuda-bindings)
maps through wcache.client.driver bit-identically, read-only where the driver allows, and a fresh
engine fetches without ever importing cuda-bindings."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import DaemonProc
from wcache import _cuda
from wcache.client import cuda, driver


def test_vmm_slab_maps_through_ctypes() -> None:
    n = 3 << 20
    alloc = _cuda.vmm_allocate(n, 0)  # daemon side
    try:
        src = alloc.buffer.tensor()[:n]
        src.copy_(torch.arange(n, device="cuda:0", dtype=torch.int64).to(torch.uint8))
        torch.cuda.synchronize()
        fd = os.dup(alloc.fd)
        try:
            buf, read_only = cuda.vmm_import(fd, 4096, n - 4096, 0, read_only=True)
        finally:
            os.close(fd)
        view = buf.tensor()
        assert view.data_ptr() != src.data_ptr()
        assert torch.equal(view, src[4096:])
        assert isinstance(read_only, bool)
        del view
        buf.close()
        buf.close()  # idempotent
    finally:
        alloc.close()


def test_ipc_handle_opens_through_ctypes() -> None:
    t = torch.arange(1 << 20, device="cuda:0", dtype=torch.int32)
    handle, offset = _cuda.ipc_handle(t.data_ptr())
    # a process cannot open its own IPC handle: do it in a child
    code = (
        "import sys, torch\n"
        "from wcache.client import cuda\n"
        "torch.cuda.init()\n"
        "buf = cuda.ipc_open(bytes.fromhex(sys.argv[1]), int(sys.argv[2]), 4 << 20, 0)\n"
        "v = buf.tensor().view(torch.int32)\n"
        "print(int(v[12345]), int(v[-1]), 'cuda.bindings' in sys.modules)\n"
        "del v; buf.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, handle.hex(), str(offset)], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["12345", str((1 << 20) - 1), "False"]


def test_driver_error_carries_the_driver_name() -> None:
    torch.empty(1, device="cuda:0")
    fd = os.open(os.devnull, os.O_RDONLY)  # not a VMM handle
    try:
        with pytest.raises(driver.CudaDriverError, match=r"cuMemImportFromShareableHandle failed: CUDA_ERROR_\w+"):
            driver.vmm_import_map(fd, 2 << 20, 0, read_only=True)
    finally:
        os.close(fd)


@pytest.mark.parametrize("export", ["vmm", "ipc"])
def test_fresh_engine_fetch_never_imports_cuda_bindings(
    export: str, daemon_factory: Callable[..., DaemonProc], ckpt: Path
) -> None:
    d = daemon_factory(ckpt, "--device", "cuda:0", "--cuda-export", export)
    code = (
        "import sys, torch\n"
        "torch.empty(1, device='cuda:0')\n"
        "from wcache import WCacheClient, WeightCacheKey\n"
        "w = WCacheClient(sys.argv[1]).fetch_sync(WeightCacheKey.from_checkpoint(sys.argv[2]))\n"
        "s = sum(float(t.float().sum()) for t in w.values())\n"
        "print(all(t.is_cuda for t in w.values()), sorted(m for m in sys.modules if m.split('.')[0] == 'cuda'))\n"
        "w.release_sync()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(d.socket), str(ckpt)], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "True []", out.stdout + out.stderr


def test_driver_device_facts_equal_torchs() -> None:
    """A torch-free daemon names its GPU through the driver: the UUID and name must be torch's (the client's)."""
    code = (
        "import sys; from wcache import _cuda; assert 'torch' not in sys.modules; "
        "print(_cuda.device_uuid(0)); print(_cuda.device_name(0)); print(_cuda.device_count()); "
        "print(_cuda.mem_get_info(0)[1]); assert 'torch' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    uuid, name, count, total = out.stdout.split("\n")[:4]
    assert uuid == _cuda.device_uuid(0) and name == torch.cuda.get_device_properties(0).name
    assert int(count) == torch.cuda.device_count() and int(total) == torch.cuda.mem_get_info(0)[1]


def test_driver_uuids_are_torchs() -> None:
    """The client finds the daemon's GPU through the driver's UUIDs (microseconds): they must be torch's, in
    torch's order, and a prepared device maps without looking anything else up."""
    torch.empty(1, device="cuda:0")
    uuids = driver.device_uuids()
    assert uuids == [_cuda.device_uuid(i) for i in range(torch.cuda.device_count())]
    cuda.prepare(uuids[0])
    looked_up = set(vars(driver.driver()))
    assert {"cuMemImportFromShareableHandle", "cuMemMap", "cuMemSetAccess"} <= looked_up
