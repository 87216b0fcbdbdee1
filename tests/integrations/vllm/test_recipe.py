"""wcache/integrations/vllm/recipe.py: the recipe key of a rank's post-processed state, from plain objects standing
in for vLLM's configs (vLLM's compile factors, the one field vLLM itself gives, in the last test)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.integrations.vllm import require_vllm
from wcache import WeightCacheKey
from wcache.integrations.vllm.recipe import (
    POSTPROCESS_VERSION,
    device_recipe,
    engine_config_digest,
    recipe_key,
    recipe_quantization,
)
from wcache.plan.recipe import RecipeKey
from wcache.synthetic import TINY, make_llama_checkpoint


@pytest.fixture
def base(tmp_path: Path) -> WeightCacheKey:
    return WeightCacheKey.from_checkpoint(make_llama_checkpoint(tmp_path / "m", TINY, seed=0), dtype="bfloat16")


class Hf:
    """A Hugging Face config: what the digest reads of one (``to_dict``)."""

    def __init__(self, **kw: Any) -> None:
        self.kw = kw

    def to_dict(self) -> dict[str, Any]:
        return dict(self.kw)


def _configs(rope: float = 1e4, moe: str = "auto") -> tuple[Any, Any]:
    model = SimpleNamespace(quantization=None, hf_config=Hf(rope_theta=rope), compute_hash=lambda: "m")
    return SimpleNamespace(kernel_config=SimpleNamespace(compute_hash=lambda: moe)), model


def test_the_recipe_key_names_engine_version_quantization_and_device(base: WeightCacheKey) -> None:
    plain = SimpleNamespace(quantization=None, hf_config=SimpleNamespace())
    key = recipe_key(base, plain, torch.device("cpu"), "0.32.0")
    assert isinstance(key, RecipeKey) and key != base
    wire = key.to_wire()
    assert {k: wire[k] for k in ("engine", "engine_version", "quantization", "quant_config", "postprocess")} == {
        "engine": "vllm",
        "engine_version": "0.32.0",
        "quantization": "",
        "quant_config": "",
        "postprocess": POSTPROCESS_VERSION,
    }
    assert wire["device_type"] == "cpu" and str(torch.backends.cpu.get_cpu_capability()) in str(
        wire["device_capability"]
    )
    assert WeightCacheKey.from_wire(wire) == base  # the checkpoint fields (dtype, transform...) are the base's
    # another vLLM version is another recipe
    assert recipe_key(base, plain, torch.device("cpu"), "0.33.0") != key


def test_the_quantization_fields_name_the_method_and_hash_its_config() -> None:
    def model(qc: Any) -> SimpleNamespace:
        return SimpleNamespace(quantization="fp8", hf_config=SimpleNamespace(quantization_config=qc))

    q1, q2 = (
        recipe_quantization(model({"weight_block_size": [1]})),
        recipe_quantization(model({"weight_block_size": [2]})),
    )
    assert q1["quantization"] == "fp8" and len(q1["quant_config"]) == 16 and q1["quant_config"] != q2["quant_config"]
    # a config object hashes as its dict: the same checkpoint is the same recipe however vLLM hands it over
    assert recipe_quantization(model(Hf(weight_block_size=[1]))) == q1
    assert recipe_quantization(model(SimpleNamespace(weight_block_size=[1]))) == q1
    assert recipe_quantization(SimpleNamespace()) == {"quantization": "", "quant_config": ""}


def test_the_device_fields_name_the_cuda_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert device_recipe(torch.device("cuda", 0)) == {"device_type": "cuda", "device_capability": "9.0"}
    assert device_recipe(torch.device("meta")) == {"device_type": "meta", "device_capability": ""}
    cpu = device_recipe(torch.device("cpu"))["device_capability"]
    assert cpu.split("+")[0] == str(torch.backends.cpu.get_cpu_capability())


def test_the_recipe_key_names_what_else_shapes_the_post_processed_bytes(base: WeightCacheKey) -> None:
    """Found by review: two engines that post-process differently must not share a deposit. A rope override
    (rotary caches are deposited buffers), another MoE backend (FlashInfer swaps w1/w3, AITER shuffles: the
    kernel config), another model config hash — each is another recipe; the same configuration is the same
    recipe, and a config that cannot be read counts as a stable marker."""

    def key(vllm_config: Any, model_config: Any) -> RecipeKey:
        return recipe_key(base, model_config, torch.device("cpu"), "0.32.0", vllm_config)

    v, m = _configs()
    assert key(v, m) == key(*_configs())
    assert key(*_configs(rope=1e6)) != key(v, m)
    assert key(*_configs(moe="flashinfer_cutlass")) != key(v, m)
    other_model = SimpleNamespace(quantization=None, hf_config=Hf(rope_theta=1e4), compute_hash=lambda: "n")
    assert key(v, other_model) != key(v, m)
    assert engine_config_digest(None, None) == engine_config_digest(None, None)  # no configs: markers, not errors
    assert engine_config_digest(None, m) != engine_config_digest(v, m)


def test_vllms_compile_factors_are_part_of_the_recipe(base: WeightCacheKey) -> None:
    """A kernel-selecting environment variable (vLLM's compile factors) is another recipe."""
    env = require_vllm("vllm.envs")
    v, m = _configs()
    before = recipe_key(base, m, torch.device("cpu"), "0.32.0", v)
    real = env.compile_factors
    try:
        env.compile_factors = lambda: {**real(), "VLLM_USE_FLASHINFER_MOE_FP16": "1"}
        assert recipe_key(base, m, torch.device("cpu"), "0.32.0", v) != before
    finally:
        env.compile_factors = real
