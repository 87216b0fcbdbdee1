"""A GPU is found by UUID, never by index (docs/protocol.md §4.5): under a permuted ``CUDA_VISIBLE_DEVICES`` an
engine finds the daemon's GPU at whatever local index it has, refuses a GPU it cannot see, and refuses to map a
slab onto another GPU than the one it chose (the CPU half of device remapping: the process's device view is simulated)."""

from __future__ import annotations

import pytest
import torch

from wcache import DeviceMismatchError, WCacheClient, _cuda
from wcache.client import cuda, driver
from wcache.proto.engine import DeviceInfo, HelloOk, SlabDescriptor

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"  # physical GPU 0: the daemon's (started with CUDA_VISIBLE_DEVICES=0)
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"  # physical GPU 1
C = "GPU-cccccccc-0000-0000-0000-000000000000"  # not visible here


@pytest.fixture
def permuted(monkeypatch: pytest.MonkeyPatch) -> None:
    """This engine runs with CUDA_VISIBLE_DEVICES=1,0: local cuda:0 is physical GPU 1, cuda:1 is physical GPU 0."""
    local = [B, A]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(local))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_cuda, "device_count", lambda: len(local))
    monkeypatch.setattr(_cuda, "device_uuid", lambda i: local[i])
    monkeypatch.setattr(driver, "device_uuids", lambda: None)  # as if CUDA were not initialised: torch's view


def _hello(uuid: str) -> HelloOk:
    return HelloOk(
        version=2,
        software="t",
        backend="cuda",
        device=DeviceInfo("cuda", 0, uuid, ""),
        max_frame_size=1 << 20,
        server_pid=0,
    )


def test_the_daemons_gpu_is_found_at_its_local_index(permuted: None) -> None:
    assert _cuda.device_index_for_uuid(A) == 1 and _cuda.device_index_for_uuid(B) == 0
    assert _cuda.device_index_for_uuid(C) is None
    assert cuda.local_uuid(None, A) == A  # no device chosen: the daemon's GPU, wherever it is here
    assert cuda.local_uuid(torch.device("cuda", 1), A) == A
    with pytest.raises(DeviceMismatchError, match="not visible"):
        cuda.local_uuid(None, C)
    # an engine asked for a GPU this process does not see: refused by name, not an IndexError past its fallback
    with pytest.raises(DeviceMismatchError, match="cuda:5"):
        cuda.local_uuid(torch.device("cuda", 5), A)


def test_an_engine_on_another_local_gpu_is_refused(permuted: None) -> None:
    """The engine chose cuda:0 (physical GPU 1) and the daemon serves physical GPU 0: DEVICE_MISMATCH before any
    mapping, from the client's own check of HELLO_OK (the GET_STATE was pipelined without a device_uuid)."""
    with pytest.raises(DeviceMismatchError, match=B):
        WCacheClient("/nonexistent.sock", device=torch.device("cuda", 0))._check_device(_hello(A))
    WCacheClient("/nonexistent.sock", device=torch.device("cuda", 1))._check_device(_hello(A))
    WCacheClient("/nonexistent.sock")._check_device(_hello(A))


def test_a_slab_maps_on_the_local_index_of_its_uuid(permuted: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """map_slab imports a daemon's VMM slab on the local index its UUID has (cuda:1 here), and refuses a device
    the engine named that is not where the slab lives, or a slab on a GPU it cannot see."""
    seen: list[int] = []

    def fake_import(
        fd: int, offset: int, size: int, index: int, *, read_only: bool, **kw: object
    ) -> tuple[object, bool]:
        seen.append(index)
        return object(), True

    monkeypatch.setattr(cuda, "vmm_import", fake_import)
    desc = SlabDescriptor(size=1 << 20, kind="cuda_vmm", fd=0, handle=b"", offset=0, device_uuid=A)
    cuda.map_slab(desc, 7, None)
    cuda.map_slab(desc, 7, torch.device("cuda", 1))
    assert seen == [1, 1]
    with pytest.raises(DeviceMismatchError, match="cuda:0"):
        cuda.map_slab(desc, 7, torch.device("cuda", 0))
    with pytest.raises(DeviceMismatchError, match="cannot see"):
        cuda.map_slab(SlabDescriptor(size=1 << 20, kind="cuda_vmm", fd=0, handle=b"", offset=0, device_uuid=C), 7, None)
