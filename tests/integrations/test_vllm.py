"""The vLLM loader plugin against a real vLLM install (skipped where vLLM is not installed).

What runs on a CPU-only machine with vLLM's CUDA wheel: plugin discovery through the
``vllm.general_plugins`` entry point and vLLM's loader registry, extra-config validation,
and the quantization refusal on a real ``ModelConfig``. Building a vLLM model needs a
platform vLLM supports (a GPU); see docs/integrations.md for what was run where.
"""

from __future__ import annotations

from pathlib import Path

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
