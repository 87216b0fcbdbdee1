"""Resharding plans (wcache/plan/reshard.py): a target slab built by a plan's copies from source slabs is bit-identical
to the safetensors slices the target's own layout names — for random shapes, shard dimensions and
tensor-parallel sizes (hypothesis), and for the loader's real slabs of a Llama checkpoint (TP=1 -> TP=2 both
ranks, TP=2 -> TP=1, three TP=1 sources striped)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from wcache.errors import FillError
from wcache.plan.checkpoint import Checkpoint
from wcache.plan.layout import Layout, plan_layout
from wcache.plan.reshard import Copy, FillPlan, plan_fill, plan_same
from wcache.plan.sharding import load_plan_file, resolve_plan


def apply(plan: FillPlan, sources: list[bytes]) -> bytes:
    """What a fill does with a plan, on bytes: every run of every copy."""
    out = bytearray(plan.total_bytes)
    for c in plan.copies:
        src = sources[c.source]
        for i in range(c.count):
            s, d = c.src + i * c.src_stride, c.dst + i * c.dst_stride
            out[d : d + c.length] = src[s : s + c.length]
    return bytes(out)


def reference(layout: Layout, full: dict[str, np.ndarray]) -> bytes:
    """The slab as the safetensors slices say it should be: each tensor's shard, C-contiguous at its offset."""
    out = bytearray(layout.total_bytes)
    for p in layout.placements:
        a = full[p.source.name]
        if p.shard is not None:
            idx = [slice(None)] * a.ndim
            idx[p.shard.dim] = slice(p.shard.start, p.shard.start + p.shard.length)
            a = a[tuple(idx)]
        raw = np.ascontiguousarray(a).tobytes()
        out[p.offset : p.offset + len(raw)] = raw
    return bytes(out)


@st.composite
def checkpoints(draw: st.DrawFn) -> tuple[dict[str, np.ndarray], dict[str, int | None]]:
    """Tensors of rank 0..3 whose split dimension (or none) divides by 4, with distinct bytes everywhere."""
    n = draw(st.integers(1, 6))
    tensors: dict[str, np.ndarray] = {}
    dims: dict[str, int | None] = {}
    for i in range(n):
        rank = draw(st.integers(0, 3))
        shape = [draw(st.integers(1, 5)) for _ in range(rank)]
        dim = draw(st.none() | st.integers(0, rank - 1)) if rank else None
        if dim is not None:
            shape[dim] *= 4
        dtype = draw(st.sampled_from([np.float32, np.int16, np.uint8]))
        size = int(np.prod(shape, dtype=np.int64))
        data = (np.arange(size, dtype=np.int64) * 7 + i * 1000).astype(dtype).reshape(shape)
        tensors[f"t{i}"] = data
        dims[f"t{i}"] = dim
    return tensors, dims


def _layouts(root: Path, dims: dict[str, int | None], specs: list[tuple[int, int]]) -> list[Layout]:
    plan_path = root / "plan.json"
    rules = [{"pattern": name, "dim": d} for name, d in dims.items()]
    plan_path.write_text(json.dumps({"name": "random", "rules": rules}))
    plan = load_plan_file(plan_path)
    ckpt = Checkpoint.open(root)
    try:
        return [plan_layout(ckpt, tp_rank=r, tp_size=n, dtype="float32", plan=plan) for r, n in specs]
    finally:
        ckpt.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=checkpoints(),
    source_tp=st.sampled_from([1, 2, 4]),
    target_tp=st.sampled_from([1, 2, 4]),
    chunk=st.sampled_from([8, 64, 1 << 20]),
    extra=st.booleans(),
)
def test_a_planned_fill_is_bit_identical_to_the_safetensors_slices(
    data: tuple[dict[str, np.ndarray], dict[str, int | None]], source_tp: int, target_tp: int, chunk: int, extra: bool
) -> None:
    tensors, dims = data
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        save_file(tensors, str(root / "model.safetensors"))
        (root / "config.json").write_text("{}")
        specs = [(r, source_tp) for r in range(source_tp)]
        if extra:  # a second, whole copy: striping between two kinds of source
            specs.append((0, 1))
        (*sources,) = _layouts(root, dims, specs)
        targets = _layouts(root, dims, [(r, target_tp) for r in range(target_tp)])
    slabs = [reference(s, tensors) for s in sources]
    for t in targets:
        plan = plan_fill(t, sources, chunk=chunk)
        assert apply(plan, slabs) == reference(t, tensors)
        same = all(s.placements == t.placements for s in sources)
        # every payload byte read once and nothing else; an identical layout is read whole, padding included
        assert plan.nbytes == (t.total_bytes if same else t.payload_bytes)
        assert sum(plan.per_source) == plan.nbytes


def test_a_slice_no_source_holds_is_a_layout_error(tmp_path: Path) -> None:
    tensors = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    rank0, whole = _layouts(tmp_path, {"w": 0}, [(0, 2), (0, 1)])
    with pytest.raises(FillError, match=r"no source holds w\[4:8\]") as err:
        plan_fill(whole, [rank0])
    assert err.value.details["reason"] == "layout"
    other = _layouts(tmp_path, {"w": 1}, [(0, 2)])[0]
    with pytest.raises(FillError, match="no source holds w"):
        plan_fill(rank0, [other])  # split along another dimension: not combinable


def test_plan_same_stripes_round_robin() -> None:
    plan = plan_same(10, 3, chunk=4)
    assert plan.copies == (Copy(0, 0, 0, 4), Copy(1, 4, 4, 4), Copy(2, 8, 8, 2))
    assert plan.per_source == (4, 4, 2)


# --------------------------------------------------------------------------- the loader's own slabs


def _loaded(ckpt: Path, tp_rank: int, tp_size: int) -> tuple[Layout, bytes]:
    from wcache.plan.key import RankSpec
    from wcache.plan.rank import plan_rank
    from wcache.server.backends.host import HostBackend
    from wcache.server.load import load_model

    with plan_rank(RankSpec(ckpt, tp_rank=tp_rank, tp_size=tp_size)) as rp:
        model = load_model(rp, backend=HostBackend(), threads=2)
        try:
            slab = model.slabs[0]
            return rp.layout, slab.read(0, slab.size)
        finally:
            model.close()


def test_loader_slabs_reshard_between_tp1_and_tp2(ckpt: Path) -> None:
    whole = _loaded(ckpt, 0, 1)
    ranks = [_loaded(ckpt, r, 2) for r in range(2)]
    assert resolve_plan("LlamaForCausalLM", 2) is not None
    for layout, want in ranks:  # TP=1 -> TP=2, each rank only its slices
        plan = plan_fill(layout, [whole[0]])
        assert apply(plan, [whole[1]]) == want
        assert plan.nbytes < 0.6 * len(whole[1])
        strided = [c for c in plan.copies if c.count > 1]
        assert strided  # o_proj / down_proj: dim-1 shards
    plan = plan_fill(whole[0], [r[0] for r in ranks])  # TP=2 -> TP=1
    assert apply(plan, [r[1] for r in ranks]) == whole[1]
    assert min(plan.per_source) > 0.4 * plan.nbytes


def test_three_identical_sources_are_striped_evenly(ckpt: Path) -> None:
    layout, data = _loaded(ckpt, 0, 1)
    plan = plan_fill(layout, [layout, layout, layout], chunk=1 << 20)
    assert apply(plan, [data, data, data]) == data
    assert max(plan.per_source) - min(plan.per_source) <= 1 << 20
