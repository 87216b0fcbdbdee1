"""CudaBackend.check_device: every unusable ``--device cuda:K`` is one UnsupportedPlatformError that says what to do,
before the daemon's lock, checkpoint or any device context (the driver's answers are stubbed here: no GPU)."""

from __future__ import annotations

import pytest
import torch

from wcache import _cuda
from wcache.errors import UnsupportedPlatformError
from wcache.server.backends.cuda import CudaBackend


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """cuda-bindings present, and the driver counting ``count[0]`` devices."""
    count = [0]
    monkeypatch.setattr(_cuda, "_bindings", object)
    monkeypatch.setattr(_cuda, "device_count", lambda: count[0])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return count


def refusal(index: int, loads: bool = False) -> str:
    with pytest.raises(UnsupportedPlatformError) as info:
        CudaBackend(index).check_device(loads)
    msg = info.value.message
    assert "\n" not in msg and "--device" in msg
    return msg


def test_no_gpu_visible(driver: list[int]) -> None:
    msg = refusal(0)
    assert "no CUDA device is visible" in msg and "nvidia-smi" in msg and "--device cpu" in msg


def test_a_uuid_or_mig_entry_that_is_not_visible_is_named(driver: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0f3c9a7e-0000-5000-8000-000000000000,1")
    msg = refusal(0)
    assert "'MIG-0f3c9a7e-0000-5000-8000-000000000000' is not a GPU or MIG instance" in msg
    assert "nvidia-smi -L" in msg
    driver[0] = 1  # the first entry resolved, the second did not: cuda:1 is hidden by it
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    msg = refusal(1)
    assert "does not exist: 1 CUDA device visible (cuda:0)" in msg and "'GPU-bbbb'" in msg


def test_index_out_of_range(driver: list[int]) -> None:
    driver[0] = 2
    msg = refusal(5)
    assert "cuda:5 does not exist: 2 CUDA devices visible (cuda:0 .. cuda:1)" in msg
    CudaBackend(1).check_device(False)  # a visible one passes


def test_missing_cuda_bindings_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> object:
        raise UnsupportedPlatformError("no cuda-bindings")

    monkeypatch.setattr(_cuda, "_bindings", missing)
    assert "pip install cuda-bindings" in refusal(0)


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a torch built without CUDA (the README's CPU build)")
def test_torch_without_cuda_is_named_where_the_daemon_loads(driver: list[int]) -> None:
    driver[0] = 1
    msg = refusal(0, loads=True)
    assert f"this torch ({torch.__version__}) was built without CUDA" in msg and "download.pytorch.org" in msg
    CudaBackend(0).check_device(False)  # serving only what a keeper holds needs no torch
