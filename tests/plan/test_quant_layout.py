"""Quantized (non-FP8) checkpoints on the raw path: served as stored, and fused in vLLM's layout (pure, no daemon).

The tiny hand-built checkpoints of tests/integrations/vllm/quant_models.py: compressed-tensors W8A8 int8 (float32
``weight_scale``, which vLLM keeps in float32) and AWQ (int32 ``qweight`` / ``qzeros``, fp16 ``scales``), both with
bf16 embeddings and norms.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integrations.vllm.quant_models import make_quantized
from wcache.plan.checkpoint import Checkpoint
from wcache.plan.layout import is_quantized, plan_layout, resolve_dtype, serves_as_stored
from wcache.transforms import fuse_llama_qkv_gate_up, rank_config, vllm_layout


@pytest.mark.parametrize("method", ["ct_w8a8_int8", "awq", "gptq_int4"])
@pytest.mark.parametrize("dtype", [None, "bfloat16", "float32"])
def test_a_quantized_checkpoint_keeps_every_stored_dtype(tmp_path: Path, method: str, dtype: str | None) -> None:
    ckpt = Checkpoint.open(make_quantized(tmp_path / method, method))
    assert is_quantized(ckpt.config) and serves_as_stored(ckpt)
    key_dtype = resolve_dtype(ckpt, dtype)
    assert key_dtype == (dtype or "bfloat16")  # the dtype the engine runs in names the key
    lay = plan_layout(ckpt, tp_rank=0, tp_size=1, dtype=key_dtype, plan=None)
    # not cast to the key's dtype: float32 / fp16 scales, int tensors, bf16 embeddings all as stored
    assert {p.source.name: p.dtype for p in lay.placements} == {n: t.dtype for n, t in ckpt.tensors.items()}
    stored = {p.dtype for p in lay.placements}
    assert {"ct_w8a8_int8": "float32", "awq": "float16", "gptq_int4": "float16"}[method] in stored


def test_an_unquantized_checkpoint_is_still_cast(tmp_path: Path) -> None:
    from tests.integrations.vllm.models import make_llama

    ckpt = Checkpoint.open(make_llama(tmp_path / "llama", seed=0))
    assert not is_quantized(ckpt.config) and not serves_as_stored(ckpt)
    lay = plan_layout(ckpt, tp_rank=0, tp_size=1, dtype="float32", plan=None)
    assert {p.dtype for p in lay.placements} == {"float32"}


def test_vllm_layout_fuses_awq_tensors_along_their_output_dimension(tmp_path: Path) -> None:
    path = make_quantized(tmp_path / "awq", "awq")
    t = load_file(str(path / "model.safetensors"))
    config = rank_config(Checkpoint.open(path).config, 0, 1)
    out = vllm_layout(dict(t), config)
    for parts, fused in (
        (("q_proj", "k_proj", "v_proj"), "model.layers.0.self_attn.qkv_proj"),
        (("gate_proj", "up_proj"), "model.layers.1.mlp.gate_up_proj"),
    ):
        prefix = fused.rpartition(".")[0]
        for leaf in ("qweight", "qzeros", "scales"):
            names = [f"{prefix}.{p}.{leaf}" for p in parts]
            # where vLLM's PackedvLLMParameter / GroupQuantScaleParameter loaders put each part (output_dim=1)
            want = torch.cat([t[n] for n in names], dim=1)
            assert out[f"{fused}.{leaf}"].dtype == t[names[0]].dtype
            assert torch.equal(out[f"{fused}.{leaf}"], want)
            assert not any(n in out for n in names)
    # unfused projections pass through untouched
    assert torch.equal(out["model.layers.0.self_attn.o_proj.qweight"], t["model.layers.0.self_attn.o_proj.qweight"])


def test_gptq_tensors_are_not_fused(tmp_path: Path) -> None:
    """GPTQ is refused by the vLLM plugin (its g_idx is not fused): the transform leaves its tensors alone."""
    path = make_quantized(tmp_path / "gptq", "gptq_int4")
    t = load_file(str(path / "model.safetensors"))
    out = fuse_llama_qkv_gate_up(dict(t), rank_config(Checkpoint.open(path).config, 0, 1))
    assert "model.layers.0.self_attn.q_proj.qweight" in out
    assert "model.layers.0.self_attn.qkv_proj.qweight" not in out
