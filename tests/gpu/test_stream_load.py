"""``--io stream`` on the CUDA slab (docs/performance.md, cold loads): the staged front (512 KiB O_DIRECT blocks by every thread
into job-sized pinned buffers, one copy per job) fills the device slab with the bytes a buffered load does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wcache.plan.checkpoint import Checkpoint
from wcache.plan.layout import Layout, plan_layout
from wcache.plan.sharding import resolve_plan
from wcache.server import loader
from wcache.server.backends.cuda import CudaBackend
from wcache.server.reads import Job


def _layout(ckpt: Path, rank: int, tp: int) -> Layout:
    c = Checkpoint.open(ckpt)
    plan = resolve_plan(c.architecture, tp) if tp > 1 else None
    return plan_layout(c, tp_rank=rank, tp_size=tp, dtype="bfloat16", plan=plan)


def _load(lay: Layout, io: str) -> torch.Tensor:
    slab = CudaBackend(0, staging_bytes=16 << 20).allocate(lay.total_bytes)
    try:
        loader.load_into(lay, slab, threads=8, progress=False, io=io)
        slab.synchronize()
        return slab.tensor()[: lay.total_bytes].cpu()
    finally:
        slab.close()


@pytest.mark.parametrize(("rank", "tp", "io"), [(0, 1, "stream:64KiB"), (1, 2, "stream:64KiB"), (0, 1, "stream")])
def test_stream_load_on_gpu_is_bit_identical(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, rank: int, tp: int, io: str
) -> None:
    lay = _layout(ckpt, rank, tp)
    want = _load(lay, "buffered")
    monkeypatch.setattr(loader, "page_cache_fraction", lambda path: 0.0)  # every file read as if cold
    staged: list[int] = []
    real = loader._streamed

    def spy(jobs: list[Job], files: set[Path]) -> list[Job]:
        out = real(jobs, files)
        staged.append(len(out))
        return out

    monkeypatch.setattr(loader, "_streamed", spy)
    got = _load(lay, io)
    assert staged and staged[0] > 0  # the front ran
    assert torch.equal(got, want)
