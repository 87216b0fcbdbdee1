"""What ``make_backend`` builds: the backend ``--device`` names, with the staging budget ``--staging-bytes`` gives
it. The budget travels with the backend's slabs (``Slab.staging_bytes``): a load cuts its jobs to it without any
caller passing it (docs/architecture.md, "Backends")."""

from __future__ import annotations

from pathlib import Path

import pytest

from wcache.plan.checkpoint import Checkpoint
from wcache.plan.layout import plan_layout
from wcache.server import loader
from wcache.server.backends.base import DEFAULT_STAGING
from wcache.server.reads import Job
from wcache.server.startup import make_backend


def test_the_default_budget_is_the_backends() -> None:
    slab = make_backend("cpu").allocate(4096)
    try:
        assert slab.staging_bytes == DEFAULT_STAGING
    finally:
        slab.close()


@pytest.mark.parametrize("staging", [2 << 20, 64 << 20])
def test_a_load_cuts_its_jobs_to_the_budget_the_backend_was_built_with(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, staging: int
) -> None:
    chunks: list[int] = []
    real = loader._execute

    def spy(jobs: list[Job], slab: object, threads: int, chunk: int, *args: object, **kwargs: object) -> int:
        chunks.append(chunk)
        assert all(j.nbytes <= chunk for j in jobs)
        return real(jobs, slab, threads, chunk, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loader, "_execute", spy)
    lay = plan_layout(Checkpoint.open(ckpt), tp_rank=0, tp_size=1, dtype="bfloat16", plan=None)
    slab = make_backend("cpu", staging_bytes=staging).allocate(lay.total_bytes)
    try:
        assert slab.staging_bytes == staging
        loader.load_into(lay, slab, threads=2, progress=False)
    finally:
        slab.close()
    assert chunks == [loader._chunk(2, staging)]
