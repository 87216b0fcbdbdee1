"""The vLLM loader plugin against a real vLLM install (skipped where vLLM is not installed).

What runs on a CPU-only machine with vLLM's CUDA wheel: plugin discovery through the
``vllm.general_plugins`` entry point and vLLM's loader registry, extra-config validation,
and the quantization refusal on a real ``ModelConfig``. Building a vLLM model needs a
platform vLLM supports (a GPU); see docs/integrations.md for what was run where.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from wcache.errors import WCacheError
from wcache.integrations.vllm import LOAD_FORMAT, check_quantization, parse_extra_config


def test_extra_config_is_validated() -> None:
    assert parse_extra_config(None)["mode"] == "zero_copy"
    assert parse_extra_config({"mode": "copy", "fallback": False})["fallback"] is False
    with pytest.raises(ValueError, match=r"unknown .* keys"):
        parse_extra_config({"sockets": "/x"})
    with pytest.raises(ValueError, match="mode must be"):
        parse_extra_config({"mode": "mmap"})


def test_quantized_models_are_refused() -> None:
    check_quantization(None)
    with pytest.raises(WCacheError, match="quantization 'fp8' is not supported"):
        check_quantization("fp8")


def test_vllm_finds_the_loader_through_its_plugin_registry() -> None:
    pytest.importorskip("vllm")
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # runs the 'wcache' entry point like `vllm serve` does
    loader = get_model_loader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"mode": "copy"}))
    assert type(loader).__name__ == "WCacheModelLoader"
    assert loader.options["mode"] == "copy"
    with pytest.raises(ValueError, match="unknown"):
        get_model_loader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"bogus": 1}))


def test_quantized_model_config_is_refused_before_any_load(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    from wcache.synthetic import TINY, make_llama_checkpoint

    model = make_llama_checkpoint(tmp_path / "m", TINY, seed=0)
    mc = ModelConfig(model=str(model), dtype="bfloat16", skip_tokenizer_init=True)
    mc.quantization = "fp8"  # what --quantization fp8 sets; the refusal happens before the daemon is asked
    load_general_plugins()
    loader = get_model_loader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"socket": "/nonexistent"}))
    with pytest.raises(WCacheError, match="not supported"):
        loader.load_model(vllm_config=None, model_config=mc)


def test_parallel_layouts_the_daemon_does_not_serve_are_refused_naming_the_mode() -> None:
    pytest.importorskip("vllm")
    from vllm.config import ParallelConfig

    from wcache.integrations.vllm import check_parallel

    check_parallel(ParallelConfig(tensor_parallel_size=2))  # tensor parallel: the daemon's shards
    check_parallel(ParallelConfig(data_parallel_size=2))  # replicas of one TP group
    cases: list[tuple[dict[str, Any], str]] = [
        ({"pipeline_parallel_size": 2}, "pipeline parallelism"),
        ({"prefill_context_parallel_size": 2}, "prefill context parallelism"),
        ({"tensor_parallel_size": 2, "decode_context_parallel_size": 2}, "decode context parallelism"),
        ({"enable_expert_parallel": True}, "expert parallelism"),
        ({"enable_expert_parallel": True, "data_parallel_size": 2}, "data_parallel_size=2"),
    ]
    for kw, named in cases:
        with pytest.raises(WCacheError, match=named):
            check_parallel(ParallelConfig(**kw))


def test_a_pipeline_parallel_engine_is_refused_before_the_daemon_is_asked(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.config import ModelConfig, ParallelConfig
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    from wcache.synthetic import TINY, make_llama_checkpoint

    model = make_llama_checkpoint(tmp_path / "m", TINY, seed=0)
    mc = ModelConfig(model=str(model), dtype="bfloat16", skip_tokenizer_init=True)
    load_general_plugins()
    loader = get_model_loader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"socket": "/nonexistent"}))
    vc = SimpleNamespace(parallel_config=ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(WCacheError, match="pipeline parallelism"):  # even with fallback on: not a daemon outage
        loader.load_model(vllm_config=vc, model_config=mc)


def test_vllm_layout_pads_the_vocabulary_and_stacks_experts() -> None:
    import torch

    from wcache.errors import ShardingError
    from wcache.transforms import vllm_layout

    emb = torch.randn(1000, 8)
    out = vllm_layout({"model.embed_tokens.weight": emb, "lm_head.weight": emb}, {"vocab_size": 1000})
    assert (
        out["model.embed_tokens.weight"].shape == (1024, 8)
        and out["lm_head.weight"] is out["model.embed_tokens.weight"]
    )
    assert torch.equal(out["lm_head.weight"][:1000], emb) and not out["lm_head.weight"][1000:].any()
    with pytest.raises(ShardingError, match="tensor-parallel"):  # an even TP split of an unpadded vocabulary
        vllm_layout({"lm_head.weight": emb[:500]}, {"vocab_size": 1000})
    p = "model.layers.0.mlp.experts"
    experts = {f"{p}.{j}.{k}.weight": torch.full((4, 2), float(j)) for j in range(3) for k in ("gate_proj", "up_proj")}
    experts |= {f"{p}.{j}.down_proj.weight": torch.full((2, 4), float(j)) for j in range(3)}
    out = vllm_layout(experts, {"vocab_size": 64})
    assert set(out) == {f"{p}.w13_weight", f"{p}.w2_weight"}
    assert out[f"{p}.w13_weight"].shape == (3, 8, 2) and out[f"{p}.w2_weight"].shape == (3, 2, 4)
    assert torch.equal(out[f"{p}.w13_weight"][2], torch.full((8, 2), 2.0))
