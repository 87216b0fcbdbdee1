"""wcache/integrations/vllm/loader.py inside a real vLLM (skipped without vLLM; a failure under
``WCACHE_REQUIRE_VLLM=1``): discovery through the ``vllm.general_plugins`` entry point and vLLM's loader registry,
the refusals before anything is fetched on vLLM's own config objects, and the load order's fallbacks. Building a
model end to end is test_e2e.py's job."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.integrations.vllm import require_vllm
from wcache import WeightCacheKey
from wcache.errors import IncompatibleModelError, WCacheError
from wcache.integrations.vllm import LOAD_FORMAT, parse_extra_config
from wcache.synthetic import TINY, make_llama_checkpoint

require_vllm()

from vllm.config import ModelConfig, ParallelConfig  # noqa: E402  (after the skip: vLLM is there)
from vllm.config.load import LoadConfig  # noqa: E402
from vllm.model_executor.model_loader import get_model_loader  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402

from wcache.integrations.vllm.loader import WCacheModelLoader  # noqa: E402


def _loader(**extra: Any) -> Any:
    load_general_plugins()  # runs the 'wcache' entry point like `vllm serve` does
    return get_model_loader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config=extra))


def test_vllm_finds_the_loader_through_its_plugin_registry() -> None:
    loader = _loader(mode="copy")
    assert type(loader) is WCacheModelLoader
    assert loader.options["mode"] == "copy"
    with pytest.raises(ValueError, match="unknown"):
        _loader(bogus=1)


def test_quantized_model_config_is_refused_before_any_load(tmp_path: Path) -> None:
    model = make_llama_checkpoint(tmp_path / "m", TINY, seed=0)
    mc = ModelConfig(model=str(model), dtype="bfloat16", skip_tokenizer_init=True)
    mc.quantization = "fp8"  # what --quantization fp8 sets; the refusal happens before the daemon is asked
    with pytest.raises(IncompatibleModelError, match="does not serve quantization 'fp8'"):
        _loader(socket="/nonexistent").load_model(vllm_config=None, model_config=mc)


def test_a_pipeline_parallel_engine_is_refused_before_the_daemon_is_asked(tmp_path: Path) -> None:
    model = make_llama_checkpoint(tmp_path / "m", TINY, seed=0)
    mc = ModelConfig(model=str(model), dtype="bfloat16", skip_tokenizer_init=True)
    vc = SimpleNamespace(parallel_config=ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(WCacheError, match="pipeline parallelism"):  # even with fallback on: not a daemon outage
        _loader(socket="/nonexistent").load_model(vllm_config=vc, model_config=mc)


def test_a_deposit_that_does_not_fit_this_build_falls_back_to_the_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: an unexpected error while using a deposit (post-processing or registration raising, e.g. a
    deposit from an older build of the same post-processing version) must not fail the engine's load: the model is
    loaded from the daemon's checkpoint tensors instead, and deposited again."""
    loader = WCacheModelLoader.__new__(WCacheModelLoader)
    loader.options = parse_extra_config({})
    loader.load_config = SimpleNamespace(device="cpu")
    calls: list[str] = []
    model = object()

    def broken_deposit(*args: Any) -> Any:
        calls.append("deposit")
        raise RuntimeError("size mismatch in process_weights_after_loading")

    def from_cache(*args: Any) -> Any:
        calls.append("cache")
        return model

    monkeypatch.setattr(loader, "_key", lambda model_config: WeightCacheKey("f", "A", 1, 0, "bfloat16"), raising=False)
    monkeypatch.setattr(loader, "_load_from_deposit", broken_deposit, raising=False)
    monkeypatch.setattr(loader, "_load_from_cache", from_cache, raising=False)
    monkeypatch.setattr(loader, "_deposit", lambda m, key: calls.append("redeposit"), raising=False)
    vllm_config = SimpleNamespace(parallel_config=None, device_config=SimpleNamespace(device="cpu"))
    model_config = SimpleNamespace(quantization=None, hf_config=SimpleNamespace(), model="m")
    assert loader.load_model(vllm_config, model_config) is model
    assert calls == ["deposit", "cache", "redeposit"]


def _bare_loader(monkeypatch: pytest.MonkeyPatch, keys: list[WeightCacheKey]) -> tuple[Any, list[Any]]:
    """A loader whose steps are stood in for, recording (step, key) calls; ``_key`` hands out ``keys`` in turn (the
    checkpoint as it is at each computation)."""
    from wcache.integrations.vllm import loader as loader_module

    loader = WCacheModelLoader.__new__(WCacheModelLoader)
    loader.options = parse_extra_config({})
    loader.load_config = SimpleNamespace(device="cpu")
    calls: list[Any] = []
    handed = iter(keys)
    monkeypatch.setattr(loader, "_key", lambda model_config: next(handed), raising=False)
    monkeypatch.setattr(loader_module, "recipe_key", lambda base, *args: ("recipe", base))
    monkeypatch.setattr(loader, "_deposit", lambda m, key: calls.append(("deposit", key)), raising=False)
    return loader, calls


VLLM_CONFIG = SimpleNamespace(parallel_config=None, device_config=SimpleNamespace(device="cpu"))
MODEL_CONFIG = SimpleNamespace(quantization=None, hf_config=SimpleNamespace(), model="m")
OLD, NEW = WeightCacheKey("0" * 32, "A", 1, 0, "bfloat16"), WeightCacheKey("1" * 32, "A", 1, 0, "bfloat16")


def test_one_checkpoint_key_serves_the_recipe_the_fetch_and_the_deposit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe's base, the checkpoint tensors fetched for a deposit's rebuilt modules or for the load, and the
    deposit's recipe are one key: computed again for the fetch, a checkpoint changed in between mixed its tensors
    with the other's recipe (a deposit of the old checkpoint's post-processed weights beside the new one's rebuilt
    modules, or the new one's weights deposited under the old one's recipe)."""
    from wcache import KeyMismatchError

    loader, calls = _bare_loader(monkeypatch, [OLD, NEW])
    model = object()

    def deposit(vllm_config: Any, model_config: Any, prefix: str, key: Any, device: Any, base: Any) -> Any:
        calls.append(("from_deposit", key, base))
        raise KeyMismatchError("not deposited yet")

    def from_cache(vllm_config: Any, model_config: Any, prefix: str, base: Any) -> Any:
        calls.append(("from_cache", base))
        return model

    monkeypatch.setattr(loader, "_load_from_deposit", deposit, raising=False)
    monkeypatch.setattr(loader, "_load_from_cache", from_cache, raising=False)
    assert loader.load_model(VLLM_CONFIG, MODEL_CONFIG) is model
    assert calls == [("from_deposit", ("recipe", OLD), OLD), ("from_cache", OLD), ("deposit", ("recipe", OLD))]


@pytest.mark.parametrize("changed", [False, True], ids=["unchanged", "changed"])
def test_a_checkpoint_that_changed_while_it_loaded_from_disk_is_not_deposited(
    changed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon lacks the recipe and refuses the checkpoint (KEY_MISMATCH: it serves another), so vLLM loads
    from disk, then deposits under the recipe made from the key computed before the load. A checkpoint changed
    meanwhile would deposit its weights under the older one's recipe: it is computed again, and deposited only if
    it is the same."""
    from wcache import KeyMismatchError

    loader, calls = _bare_loader(monkeypatch, [OLD, NEW if changed else OLD])
    model = object()

    def refused(*args: Any) -> Any:
        raise KeyMismatchError("not served")

    monkeypatch.setattr(loader, "_load_from_deposit", refused, raising=False)
    monkeypatch.setattr(loader, "_load_from_cache", refused, raising=False)
    monkeypatch.setattr(loader, "_load_from_disk", lambda *args: model, raising=False)
    assert loader.load_model(VLLM_CONFIG, MODEL_CONFIG) is model
    assert calls == ([] if changed else [("deposit", ("recipe", OLD))])
