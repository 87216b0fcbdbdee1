"""RankSpec: one description of a rank, taken by the key, the plan and the loader (wcache/rank.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from wcache.checkpoint import Checkpoint
from wcache.key import WeightCacheKey
from wcache.proto import Preload
from wcache.rank import RankSpec, plan_rank


def test_spec_normalises_what_the_apis_spell_differently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    a = RankSpec.of("m", dtype="auto", plan_file="")  # the PRELOAD frame's spellings of "as stored", "none"
    assert a == RankSpec(tmp_path / "m") and a.checkpoint.is_absolute() and a.dtype is None and a.plan_file is None
    b = RankSpec.of("m", tp_rank=1, tp_size=2, plan_file="p.json")
    assert b.plan_file == tmp_path / "p.json" and hash(b) == hash(RankSpec.of(b))
    assert RankSpec.of(b, transform="x:y") == dataclasses.replace(b, transform="x:y")


def test_preload_frame_round_trip_keeps_every_field_but_the_daemons_policy(tmp_path: Path) -> None:
    spec = RankSpec(tmp_path / "m", 1, 2, "float16", tmp_path / "p.json", "pkg.mod:fn", verify_content=True)
    frame = spec.to_preload(5)
    assert frame == Preload(5, str(tmp_path / "m"), 1, 2, "float16", str(tmp_path / "p.json"), "pkg.mod:fn")
    assert RankSpec.from_preload(frame, verify_content=True) == spec
    assert RankSpec.from_preload(frame).verify_content is False  # --verify-content is the daemon's choice
    assert RankSpec(tmp_path / "m").to_preload(1).dtype == "auto"


def test_the_key_counts_every_field_of_the_spec(ckpt: Path) -> None:
    spec = RankSpec(ckpt, transform="pkg.mod:fn", verify_content=True)
    key = WeightCacheKey.from_spec(spec)
    assert key.transform == "pkg.mod:fn" and key.fingerprint_kind == "content"
    assert WeightCacheKey.from_checkpoint(spec) == key  # the keyword API and the spec one meet
    assert WeightCacheKey.from_checkpoint(ckpt, transform="pkg.mod:fn", verify_content=True) == key
    with plan_rank(spec) as rp:
        assert rp.key == key and rp.spec == spec


def test_a_load_plans_the_rank_once(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon plans a PRELOAD once and loads that plan: the checkpoint is opened (headers parsed and
    fingerprint read) once, not once for the budget check and again for the load."""
    from wcache.server.backends.host import HostBackend
    from wcache.server.store import load_model

    opened: list[Path] = []
    real = Checkpoint.open.__func__  # type: ignore[attr-defined]

    def counting(cls: type[Checkpoint], path: Path) -> Checkpoint:
        opened.append(Path(path))
        return real(cls, path)  # type: ignore[no-any-return]

    monkeypatch.setattr(Checkpoint, "open", classmethod(counting))
    with plan_rank(RankSpec(ckpt)) as rp:
        model = load_model(rp, backend=HostBackend(), threads=2)
    try:
        assert opened == [ckpt] and model.key == rp.key and model.source == ckpt
    finally:
        model.close()
    with pytest.raises(TypeError, match="takes no rank fields"):
        load_model(rp, backend=HostBackend(), tp_size=2)
