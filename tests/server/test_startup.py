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


def test_the_ready_line_counts_every_model_served_in_its_tensors_and_bytes(ckpt: Path, tmp_path: Path) -> None:
    """After a keeper reclaim a daemon serves several models: the ready line gave one model's tensors beside every
    model's bytes (``tensors=138 bytes=145356800`` for two). Its ``models``, ``tensors`` and ``bytes`` are of every
    model served; its ``key`` (and load time) of the one it was started for."""
    from wcache.plan.key import RankSpec
    from wcache.server.backends.host import HostBackend
    from wcache.server.load import load_model
    from wcache.server.startup import ready_fields, started_model
    from wcache.server.store import Store

    backend = HostBackend()
    whole, half = (load_model(RankSpec(ckpt, tp_size=n), backend=backend, threads=2) for n in (1, 2))
    store = Store(backend, [whole, half])
    try:
        m = started_model(store, half.key)
        assert m is half
        fields = ready_fields(tmp_path / "wcache-rank0.sock", store, m)
        assert (fields["key"], fields["models"]) == (half.key.short(), 2)
        assert fields["tensors"] == len(whole.table) + len(half.table) > len(half.table)
        assert fields["bytes"] == whole.slab_bytes + half.slab_bytes
    finally:
        store.close()
