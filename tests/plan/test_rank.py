"""RankSpec (wcache/plan/key.py): one description of a rank, taken by the key, the planner (wcache/plan/rank.py) and
the loader; the engines' keyword APIs build it from every one of its fields."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from wcache import nn
from wcache.errors import CacheUnavailableError
from wcache.plan.checkpoint import Checkpoint
from wcache.plan.key import RankSpec, WeightCacheKey
from wcache.plan.rank import plan_rank
from wcache.proto import Preload

FUSE = "wcache.transforms:fuse_llama_qkv_gate_up"


def plan_file(where: Path) -> Path:
    """A shard plan file for Llama checkpoints (docs/shard-plans.md): the attention and MLP inputs split by rows."""
    plan = where / "plan.json"
    rules = [{"pattern": r".*(q|k|v|gate|up)_proj\.weight", "dim": 0}, {"pattern": r".*", "dim": None}]
    plan.write_text(json.dumps({"name": "mine", "rules": rules}))
    return plan


def test_spec_normalises_what_the_apis_spell_differently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    a = RankSpec.from_preload(Preload(1, "m", 0, 1, "auto", "", ""))  # the frame's "as stored", "no plan file"
    assert a == RankSpec(tmp_path / "m") and a.checkpoint.is_absolute() and a.dtype is None and a.plan_file is None
    assert RankSpec(Path("m"), dtype="auto") == a
    b = RankSpec(Path("m"), tp_rank=1, tp_size=2, plan_file=Path("p.json"))
    assert b.plan_file == tmp_path / "p.json" and hash(b) == hash(dataclasses.replace(b))
    assert dataclasses.replace(b, transform="x:y").transform == "x:y"


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
    assert WeightCacheKey.from_checkpoint(ckpt, transform="pkg.mod:fn", verify_content=True) == key
    with plan_rank(spec) as rp:
        assert rp.key == key and rp.spec == spec


def test_a_load_plans_the_rank_once(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon plans a PRELOAD once and loads that plan: the checkpoint is opened (headers parsed and
    fingerprint read) once, not once for the budget check and again for the load."""
    from wcache.server.backends.host import HostBackend
    from wcache.server.load import load_model

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
    with pytest.raises(TypeError, match="unexpected keyword argument 'tp_size'"):  # the plan has the rank's fields
        load_model(rp, backend=HostBackend(), tp_size=2)  # type: ignore[call-arg]


#: the engines' keyword APIs: each takes a directory and RankSpec's fields (but those listed) as keywords
KEYWORD_APIS: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "WeightCacheKey.from_checkpoint": (WeightCacheKey.from_checkpoint, ()),
    "wcache.nn.load_weights": (nn.load_weights, ()),
    "wcache.nn.load_from_disk": (nn.load_from_disk, ("verify_content",)),  # the disk has one fingerprint policy
}


@pytest.mark.parametrize("name", sorted(KEYWORD_APIS))
def test_every_keyword_api_takes_the_specs_fields(name: str) -> None:
    """A field added to RankSpec without its keyword (or with another default) fails here: the keyword APIs
    spell RankSpec's fields out, typed, instead of taking ``**fields``."""
    fn, left_out = KEYWORD_APIS[name]
    params = inspect.signature(fn).parameters
    first = next(iter(params.values()))
    assert first.name == "model_dir" and first.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert not [p for p in params.values() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    for f in dataclasses.fields(RankSpec):
        if f.name == "checkpoint" or f.name in left_out:
            continue
        assert f.name in params, f"{name} lacks RankSpec's {f.name}"
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY and params[f.name].default == f.default, f.name


def test_the_keyword_apis_forward_every_field(ckpt: Path, tmp_path: Path) -> None:
    """Each keyword API builds the very RankSpec its keywords name: the key, a fetch's key and a disk load."""
    plan = plan_file(tmp_path)
    fields: dict[str, Any] = {"tp_rank": 1, "tp_size": 2, "dtype": "float32", "plan_file": plan, "transform": FUSE}
    spec = RankSpec(ckpt, **fields, verify_content=True)
    key = WeightCacheKey.from_spec(spec)
    assert key.tp_rank == 1 and key.dtype == "float32" and key.plan.startswith("file:") and key.transform == FUSE
    assert WeightCacheKey.from_checkpoint(ckpt, **fields, verify_content=True) == key

    class Recording:
        def __init__(self) -> None:
            self.keys: list[WeightCacheKey] = []

        async def fetch(self, key: WeightCacheKey, *, mode: str) -> None:
            self.keys.append(key)
            raise CacheUnavailableError("no daemon in this test")

    rec = Recording()
    with pytest.raises(CacheUnavailableError):
        asyncio.run(nn.load_weights(ckpt, **fields, verify_content=True, client=rec, fallback=False))
    assert rec.keys == [key] and rec.keys[0].fingerprint_kind == "content"
    disk = nn.load_from_disk(ckpt, **fields)
    want = nn._from_disk(dataclasses.replace(spec, verify_content=False), "cpu")
    assert disk.keys() == want.keys() and any(n.endswith("qkv_proj.weight") for n in disk)
    assert all(torch.equal(disk[n], want[n]) and disk[n].dtype is torch.float32 for n in want)


def test_the_planner_lays_out_the_other_ranks_of_its_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    """``RankPlan.layout_of``: the layout a daemon planning that rank itself would have (a built-in plan at
    another size, its own plan file at any size), None for a plan it cannot resolve."""
    plan = plan_file(tmp_path)
    with plan_rank(RankSpec(ckpt)) as rp:
        for r in range(2):
            with plan_rank(RankSpec(ckpt, tp_rank=r, tp_size=2)) as other:
                assert rp.layout_of(r, 2, other.key.plan) == other.layout and other.key.plan.startswith("builtin:")
        assert rp.layout_of(0, 1, "none") == rp.layout
        assert rp.layout_of(0, 2, "file:0123456789abcdef") is None  # a plan file it does not have
        assert rp.layout_of(0, 2, "builtin:another") is None
    with plan_rank(RankSpec(ckpt, plan_file=plan)) as rp, plan_rank(RankSpec(ckpt, 1, 2, plan_file=plan)) as other:
        assert rp.layout_of(1, 2, rp.key.plan) == other.layout != rp.layout


def test_a_layout_the_checkpoint_cannot_be_split_into_is_none(ckpt: Path, tmp_path: Path) -> None:
    """A peer's offer names any ``tp_rank``, ``tp_size`` and ``plan``: a size the plan cannot split the tensors
    into, a rank outside ``[0, tp_size)`` or a size below 1 is no layout (None), as an unknown plan is — it was a
    ShardingError, which failed a fill that another peer could have served."""
    with plan_rank(RankSpec(ckpt, tp_size=2)) as two:
        builtin = two.key.plan
    with plan_rank(RankSpec(ckpt)) as rp:
        assert builtin.startswith("builtin:") and rp.layout_of(0, 2, builtin) is not None
        assert rp.layout_of(0, 3, builtin) is None  # 256 rows do not split by 3
        for rank, size in ((2, 2), (-1, 2), (0, 0), (0, -4)):
            assert rp.layout_of(rank, size, builtin) is None
    with plan_rank(RankSpec(ckpt, plan_file=plan_file(tmp_path))) as rp:
        assert rp.layout_of(0, 3, rp.key.plan) is None  # its own plan file, at a size it cannot split by
        assert rp.layout_of(4, 2, rp.key.plan) is None
