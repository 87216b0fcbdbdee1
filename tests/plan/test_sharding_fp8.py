"""FP8 block-wise checkpoints on the raw path: dtypes, no cast, block-scale sharding, fused transforms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wcache import CheckpointError, ShardingError, WCacheError, WeightCacheKey
from wcache.client.mapping import _DTYPES
from wcache.plan.checkpoint import Checkpoint
from wcache.plan.key import RankSpec
from wcache.plan.layout import plan_layout, resolve_dtype
from wcache.plan.quant import fp8_block_size
from wcache.plan.rank import plan_rank
from wcache.plan.sharding import LLAMA_PLAN
from wcache.server.backends.host import HostBackend
from wcache.server.loader import load_into
from wcache.synthetic import FP8_TINY, LlamaShape, make_fp8_llama_checkpoint
from wcache.transforms import fuse_llama_qkv_gate_up

BLOCK = 128
SCALE = "_scale_inv"


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fp8_llama_checkpoint(tmp_path_factory.mktemp("fp8") / "tiny", seed=3)


def expected_slice(ref: dict[str, torch.Tensor], name: str, rank: int, tp: int) -> torch.Tensor:
    """What rank ``rank`` of ``tp`` must hold, worked out from the plan and the block size alone."""
    full = ref[name]
    weight = name.removesuffix(SCALE)
    dim = LLAMA_PLAN.dim_for(weight) if tp > 1 else None
    if dim is None:
        return full
    rows = ref[weight].shape[dim] // tp  # the weight's shard
    if name.endswith(SCALE):
        return full.narrow(dim, rank * rows // BLOCK, rows // BLOCK)
    return full.narrow(dim, rank * rows, rows)


def load_rank(model: Path, rank: int, tp: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The rank's tensors as the daemon's loader writes them into a host slab (copied out)."""
    rp = plan_rank(RankSpec(model, tp_rank=rank, tp_size=tp))
    slab = HostBackend(staging_bytes=1 << 16).allocate(rp.layout.total_bytes)
    try:
        load_into(rp.layout, slab, threads=2, progress=False)
        base = slab.tensor()
        out = {
            p.source.name: base[p.offset : p.offset + p.nbytes].view(_DTYPES[p.dtype]).reshape(p.shape).clone()
            for p in rp.layout.placements
        }
    finally:
        slab.close()
    return out, [p.dtype for p in rp.layout.placements]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_dtypes_end_to_end(tmp_path: Path, fp8: torch.dtype) -> None:
    """F8_E4M3 / F8_E5M2 in the safetensors header -> wcache dtype names -> the client's torch dtype."""
    model = make_fp8_llama_checkpoint(tmp_path / "m", fp8_dtype=fp8)
    c = Checkpoint.open(model)
    name = str(fp8).removeprefix("torch.")
    w = c.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert w.dtype == name and w.nbytes == 256 * 256
    assert c.tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].dtype == "float32"
    assert _DTYPES[name] is fp8
    table = plan_rank(RankSpec(model)).layout.table()
    assert name in {e.dtype for e in table}
    config = json.loads((model / "config.json").read_text())["quantization_config"]
    assert config == {
        "quant_method": "fp8",
        "fmt": "e4m3" if fp8 is torch.float8_e4m3fn else "e5m2",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }


def test_builder_scales_dequantize_the_weights(fp8_ckpt: Path) -> None:
    ref = load_file(str(fp8_ckpt / "model.safetensors"))
    q, s = ref["model.layers.1.mlp.down_proj.weight"], ref["model.layers.1.mlp.down_proj.weight_scale_inv"]
    assert q.shape == (256, 512) and s.shape == (2, 4) and s.dtype == torch.float32
    deq = q.float() * s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    assert deq.abs().max() > 0
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert ref[name].dtype == torch.bfloat16


def test_served_as_stored_and_casts_refused(fp8_ckpt: Path) -> None:
    """No cast: FP8 weights, float32 scales and bf16 tensors keep their dtype; the key's dtype is bf16."""
    c = Checkpoint.open(fp8_ckpt)
    assert resolve_dtype(c, None) == resolve_dtype(c, "auto") == resolve_dtype(c, "bfloat16") == "bfloat16"
    lay = plan_layout(c, tp_rank=0, tp_size=1, dtype="bfloat16", plan=None)
    assert all(p.dtype == p.source.dtype for p in lay.placements)
    assert {p.dtype for p in lay.placements} == {"float8_e4m3fn", "float32", "bfloat16"}
    for bad in ("float16", "float32"):
        with pytest.raises(CheckpointError, match=r"FP8 checkpoint.*'auto'") as info:
            WeightCacheKey.from_checkpoint(fp8_ckpt, dtype=bad).resolve()
        assert info.value.details == {"requested": bad, "stored": "bfloat16"}


@pytest.mark.parametrize("tp", [1, 2])
def test_shards_bit_identical_to_the_expected_slices(fp8_ckpt: Path, tp: int) -> None:
    ref = load_file(str(fp8_ckpt / "model.safetensors"))
    for rank in range(tp):
        got, dtypes = load_rank(fp8_ckpt, rank, tp)
        assert set(got) == set(ref)
        assert "float8_e4m3fn" in dtypes
        for name in ref:
            assert same_bytes(got[name], expected_slice(ref, name, rank, tp)), name
        # every rank's scales dequantize exactly its own weight slice
        w = "model.layers.0.mlp.down_proj.weight"
        deq = got[w].float() * got[w + SCALE].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        full = ref[w].float() * ref[w + SCALE].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        assert torch.equal(deq, expected_slice({w: full}, w, rank, tp))


@pytest.mark.parametrize(
    ("shape", "tp", "tensor", "shard"),
    [
        (FP8_TINY, 4, "_proj.weight", 64),  # 256 rows / 4
        (LlamaShape(hidden=256, intermediate=512, layers=1, heads=4, kv_heads=2, vocab=512), 2, "k_proj.weight", 64),
        (LlamaShape(hidden=256, intermediate=640, layers=1, heads=4, kv_heads=4, vocab=512), 2, "_proj", 320),
    ],
)
def test_shard_not_a_multiple_of_the_block(tmp_path: Path, shape: LlamaShape, tp: int, tensor: str, shard: int) -> None:
    model = make_fp8_llama_checkpoint(tmp_path / "m", shape)
    with pytest.raises(ShardingError, match=rf"{tensor}.*shard of {shard} .*multiple of the FP8 block 128") as info:
        plan_rank(RankSpec(model, tp_rank=0, tp_size=tp))
    assert info.value.details["block"] == [128, 128] and info.value.details["shard"] == shard


def test_partial_edge_blocks_serve_whole_and_refuse_a_split(tmp_path: Path) -> None:
    """intermediate 600: ceil(600/128) = 5 scale rows, the last block partial; TP=1 serves it as stored."""
    shape = LlamaShape(hidden=256, intermediate=600, layers=1, heads=4, kv_heads=4, vocab=512)
    model = make_fp8_llama_checkpoint(tmp_path / "m", shape)
    ref = load_file(str(model / "model.safetensors"))
    assert ref["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (5, 2)
    got, _ = load_rank(model, 0, 1)
    assert all(same_bytes(got[n], ref[n]) for n in ref)
    with pytest.raises(ShardingError, match=r"(gate|up|down)_proj.*not a whole number of blocks"):
        plan_rank(RankSpec(model, tp_rank=1, tp_size=2))


def _rewrite_config(model: Path, **quant: object) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"].update(quant)
    cfg["quantization_config"] = {k: v for k, v in cfg["quantization_config"].items() if v is not None}
    (model / "config.json").write_text(json.dumps(cfg))


def test_missing_or_bad_block_size(tmp_path: Path) -> None:
    model = make_fp8_llama_checkpoint(tmp_path / "m")
    _rewrite_config(model, weight_block_size=None)
    plan_rank(RankSpec(model))  # as stored at TP=1: nothing to split
    with pytest.raises(ShardingError, match=r"weight_scale_inv.*no quantization_config.weight_block_size"):
        plan_rank(RankSpec(model, tp_rank=0, tp_size=2))
    for bad in ([128], [128, 0], "128x128"):
        _rewrite_config(model, weight_block_size=bad)
        with pytest.raises(CheckpointError, match="weight_block_size"):
            plan_rank(RankSpec(model, tp_rank=0, tp_size=2))
    assert fp8_block_size({"quantization_config": {"quant_method": "awq", "weight_block_size": [1]}}) is None


def test_scale_of_the_wrong_shape(tmp_path: Path) -> None:
    """A block scale whose shape does not match its weight in blocks of 128 is refused, naming both."""
    model = make_fp8_llama_checkpoint(tmp_path / "m")
    _rewrite_config(model, weight_block_size=[64, 128])
    with pytest.raises(ShardingError, match=r"block scale .*needs \[4, \d\]"):
        plan_rank(RankSpec(model, tp_rank=0, tp_size=2))


def test_fused_transform_fuses_scales_by_blocks(fp8_ckpt: Path) -> None:
    config = json.loads((fp8_ckpt / "config.json").read_text())
    for rank in (0, 1):
        t, _ = load_rank(fp8_ckpt, rank, 2)
        out = fuse_llama_qkv_gate_up(dict(t), config)
        p = "model.layers.0."
        for parts, target in ((("q", "k", "v"), "self_attn.qkv_proj"), (("gate", "up"), "mlp.gate_up_proj")):
            names = [p + ("self_attn." if target.startswith("self") else "mlp.") + f"{x}_proj.weight" for x in parts]
            assert same_bytes(out[p + target + ".weight"], torch.cat([t[n] for n in names]))
            scale = torch.cat([t[n + SCALE] for n in names])
            assert same_bytes(out[p + target + ".weight" + SCALE], scale)
            assert scale.shape[0] * BLOCK == out[p + target + ".weight"].shape[0]  # one scale row per 128 rows
            assert not any(n in out or n + SCALE in out for n in names)


def test_fused_transform_refuses_parts_that_are_not_whole_blocks() -> None:
    p = "model.layers.0.self_attn."
    fp8 = torch.float8_e4m3fn
    t = {
        p + "q_proj.weight": torch.zeros(256, 256, dtype=fp8),
        p + "k_proj.weight": torch.zeros(64, 256, dtype=fp8),
        p + "v_proj.weight": torch.zeros(64, 256, dtype=fp8),
        p + "q_proj.weight_scale_inv": torch.ones(2, 2),
        p + "k_proj.weight_scale_inv": torch.ones(1, 2),
        p + "v_proj.weight_scale_inv": torch.ones(1, 2),
    }
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    with pytest.raises(WCacheError, match=r"k_proj.weight.*64 rows.*multiple of the block 128"):
        fuse_llama_qkv_gate_up(t, config)
    with pytest.raises(WCacheError, match=r"no quantization_config.weight_block_size"):
        fuse_llama_qkv_gate_up(t, {})
    del t[p + "v_proj.weight_scale_inv"]
    with pytest.raises(WCacheError, match="only some of them have block scales"):
        fuse_llama_qkv_gate_up(t, config)
