"""The CPU-checkable parts of benchmarks/fp8_writeback_bench.py: the recipe key, digests, the FP8 skeleton
start 2 builds, and that the GPU part fails (never skips) without a GPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from wcache import WeightCacheKey
from wcache.synthetic import LlamaShape, make_llama_checkpoint

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_writeback_bench.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fp8_writeback_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_recipe_key_names_engine_quantization_config_and_device(bench: ModuleType) -> None:
    base = WeightCacheKey("f" * 64, "LlamaForCausalLM", 1, 0, "bfloat16")
    key = bench.recipe_key(base, {"weight_block_size": [128, 128]}, engine_version="5.17.0", capability=(9, 0))
    wire = key.to_wire()
    assert wire["engine"] == "transformers" and wire["quantization"] == "fp8"
    assert wire["device_type"] == "cuda" and wire["device_capability"] == "9.0"
    assert wire["quant_config"] == bench.config_hash({"weight_block_size": [128, 128]})
    other = bench.recipe_key(base, {"weight_block_size": [64, 64]}, engine_version="5.17.0", capability=(9, 0))
    assert other != key  # another config is another recipe


def test_digests_catch_one_flipped_bit_and_a_missing_name(bench: ModuleType) -> None:
    a = {"w": torch.arange(16, dtype=torch.float32).to(torch.float8_e4m3fn), "s": torch.ones(2, 2)}
    b = {"w": a["w"].clone(), "s": a["s"].clone()}
    assert bench.differences(bench.digests(a), bench.digests(b)) == []
    b["w"].view(torch.uint8)[3] ^= 1
    assert bench.differences(bench.digests(a), bench.digests(b)) == ["w"]
    del b["s"]
    assert bench.differences(bench.digests(a), bench.digests(b)) == ["s", "w"]


def test_fp8_skeleton_has_fp8_weights_and_block_scales_all_on_meta(bench: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    shape = LlamaShape(hidden=256, intermediate=512, layers=1, heads=4, kv_heads=2, vocab=384)
    model_dir = make_llama_checkpoint(tmp_path / "m", shape, seed=0)
    model = bench.fp8_skeleton(model_dir)
    state = bench.state_tensors(model)
    q = "model.layers.0.self_attn.q_proj"
    assert state[q + ".weight"].dtype == torch.float8_e4m3fn and state[q + ".weight"].is_meta
    assert state[q + ".weight_scale_inv"].dtype == torch.float32
    assert tuple(state[q + ".weight_scale_inv"].shape) == (2, 2)  # 256x256 in 128x128 blocks
    k = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    assert tuple(state[k].shape) == (1, 2)  # 128 rows
    assert state["lm_head.weight"].dtype == torch.bfloat16  # not converted, as the quantizer leaves it
    assert all(t.is_meta for t in state.values())  # nothing allocated: start 2 attaches the deposit
    assert "model.rotary_emb.inv_freq" in state  # a buffer: deposited by start 1, attached by start 2


def test_gpu_part_fails_loudly_without_a_gpu(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a GPU"):
        bench.start1(tmp_path / "s.sock", tmp_path, "cuda:0", tmp_path / "d.json")
    with pytest.raises(RuntimeError, match="needs a GPU"):
        bench.start2(tmp_path / "s.sock", tmp_path, "cuda:0", tmp_path / "d.json")
