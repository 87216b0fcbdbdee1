"""The vLLM loader plugin against a real vLLM install (skipped where vLLM is not installed).

What runs on a CPU-only machine with vLLM's CUDA wheel: plugin discovery through the
``vllm.general_plugins`` entry point and vLLM's loader registry, extra-config validation,
and the quantization refusal on a real ``ModelConfig``. Building a vLLM model needs a
platform vLLM supports (a GPU); see docs/integrations.md for what was run where.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProc
from wcache.errors import IncompatibleModelError, WCacheError
from wcache.integrations.vllm import LOAD_FORMAT, check_quantization, parse_extra_config


def test_extra_config_is_validated() -> None:
    assert parse_extra_config(None)["mode"] == "zero_copy"
    assert parse_extra_config({"mode": "copy", "fallback": False})["fallback"] is False
    with pytest.raises(ValueError, match=r"unknown .* keys"):
        parse_extra_config({"sockets": "/x"})
    with pytest.raises(ValueError, match="mode must be"):
        parse_extra_config({"mode": "mmap"})


def test_awq_is_served_and_other_quantization_is_refused_naming_the_method() -> None:
    check_quantization(None)
    awq = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    for name in ("awq", "auto_awq", "awq_marlin"):  # vLLM's names for an AWQ checkpoint
        check_quantization(name, awq)
    ct: dict[str, Any] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    ct["config_groups"] = {"group_0": {"weights": {"num_bits": 4, "type": "int"}}}
    cases: list[tuple[str, dict[str, Any] | None, str]] = [
        ("fp8", None, r"quantization 'fp8'"),
        ("gptq", {"quant_method": "gptq", "bits": 4}, r"quantization 'gptq'.*g_idx"),
        ("compressed-tensors", ct, r"'compressed-tensors'.*format 'pack-quantized' weights int4"),
        ("awq", {"quant_method": "gptq"}, r"checkpoint quant_method 'gptq'"),  # a mislabelled checkpoint
    ]
    for method, qc, named in cases:
        with pytest.raises(IncompatibleModelError, match=named) as exc:
            check_quantization(method, qc)
        assert "--load-format auto" in str(exc.value) and exc.value.details["quantization"] == method
    # the shard plans do not cut packed int32 tensors: TP > 1 is refused, naming the size
    with pytest.raises(IncompatibleModelError, match=r"tensor_parallel_size=2.*--load-format auto"):
        check_quantization("awq", awq, tp_size=2)


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
    with pytest.raises(IncompatibleModelError, match="does not serve quantization 'fp8'"):
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
    # rank 1 of 2: vLLM's share is 512 rows (1024 / 2), of which 488 real ones (the daemon cut rows 512..999)
    out = vllm_layout({"lm_head.weight": emb[512:]}, {"vocab_size": 1000, "wcache_tp_size": 2, "wcache_tp_rank": 1})
    assert out["lm_head.weight"].shape == (512, 8) and torch.equal(out["lm_head.weight"][:488], emb[512:])
    with pytest.raises(ShardingError, match="not split as vLLM splits it"):  # an even split: 500 rows at rank 0
        vllm_layout({"lm_head.weight": emb[:600]}, {"vocab_size": 1000, "wcache_tp_size": 2})
    p = "model.layers.0.mlp.experts"
    experts = {f"{p}.{j}.{k}.weight": torch.full((4, 2), float(j)) for j in range(3) for k in ("gate_proj", "up_proj")}
    experts |= {f"{p}.{j}.down_proj.weight": torch.full((2, 4), float(j)) for j in range(3)}
    out = vllm_layout(experts, {"vocab_size": 64})
    assert set(out) == {f"{p}.w13_weight", f"{p}.w2_weight"}
    assert out[f"{p}.w13_weight"].shape == (3, 8, 2) and out[f"{p}.w2_weight"].shape == (3, 2, 4)
    assert torch.equal(out[f"{p}.w13_weight"][2], torch.full((8, 2), 2.0))


@pytest.mark.parametrize(("vocab", "tp"), [(1000, 2), (32016, 2), (32016, 4), (32000, 4), (151936, 8), (1000, 1)])
def test_padded_vocab_shards_are_vllms(vocab: int, tp: int) -> None:
    """The daemon cuts each rank's embedding rows where vLLM's VocabParallelEmbedding takes them from the
    checkpoint: vLLM's own pad_vocab_size / vocab_range_from_global_vocab_size (when vLLM is installed),
    else the formula they implement."""
    from wcache.sharding import padded_vocab_shard

    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            pad_vocab_size,
            vocab_range_from_global_vocab_size,
        )
    except ImportError:

        def pad_vocab_size(v: int, pad_to: int = 64) -> int:
            return -(-v // pad_to) * pad_to

        def vocab_range_from_global_vocab_size(v: int, rank: int, world: int) -> tuple[int, int]:
            per = v // world
            return rank * per, (rank + 1) * per

    padded = pad_vocab_size(vocab, 64)
    for rank in range(tp):
        first, last = vocab_range_from_global_vocab_size(padded, rank, tp)
        shard = padded_vocab_shard("lm_head.weight", vocab, rank, tp, 64)
        assert (shard.start, shard.start + shard.length) == (first, min(last, vocab))


async def test_two_rank_daemons_serve_vllms_padded_vocabulary(
    daemon_factory: Callable[..., DaemonProc], tmp_path: Path
) -> None:
    """TP=2, a 1000-row vocabulary: vLLM pads it to 1024 and gives each rank 512 rows; each daemon serves its
    rank's rows in that layout (rank 1: checkpoint rows 512..999 and 24 zero rows)."""
    import torch
    from safetensors.torch import load_file

    from wcache import WCacheClient, WeightCacheKey
    from wcache.nn import load_from_disk
    from wcache.synthetic import LlamaShape, make_llama_checkpoint

    transform = "wcache.transforms:vllm_layout"
    model = make_llama_checkpoint(tmp_path / "m", LlamaShape(64, 128, 1, 4, 2, 1000), seed=3)
    full = load_file(str(model / "model.safetensors"))
    for rank in (0, 1):
        d = daemon_factory(model, "--tp-rank", str(rank), "--tp-size", "2", "--transform", transform)
        key = WeightCacheKey.from_checkpoint(model, tp_rank=rank, tp_size=2, transform=transform)
        disk = load_from_disk(model, tp_rank=rank, tp_size=2, transform=transform)  # the engine's fallback
        async with await WCacheClient(d.socket).fetch(key) as w:
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                got, real = w[name], full[name][rank * 512 : (rank + 1) * 512]
                assert got.shape == (512, 64)
                assert torch.equal(got[: len(real)], real) and not got[len(real) :].any()
                assert torch.equal(disk[name], got)


# ---------------------------------------------------------------- write-back (docs/protocol.md §4.13)


class _Method:
    """A stand-in for a vLLM quantization method (what plan_postprocessing reads of one)."""

    def __init__(self, supports: bool) -> None:
        self.supports_pre_processed_weights = supports


def test_the_recipe_key_names_engine_version_quantization_and_device(tmp_path: Path) -> None:
    from types import SimpleNamespace

    import torch

    from wcache import WeightCacheKey
    from wcache.integrations.vllm import POSTPROCESS_VERSION, recipe_key, recipe_quantization
    from wcache.recipe import RecipeKey
    from wcache.synthetic import TINY, make_llama_checkpoint

    base = WeightCacheKey.from_checkpoint(make_llama_checkpoint(tmp_path / "m", TINY, seed=0), dtype="bfloat16")
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
    # another vLLM version, or another quantization config, is another recipe
    assert recipe_key(base, plain, torch.device("cpu"), "0.33.0") != key
    fp8 = SimpleNamespace(quantization="fp8", hf_config=SimpleNamespace(quantization_config={"weight_block_size": [1]}))
    other = SimpleNamespace(
        quantization="fp8", hf_config=SimpleNamespace(quantization_config={"weight_block_size": [2]})
    )
    q1, q2 = recipe_quantization(fp8), recipe_quantization(other)
    assert q1["quantization"] == "fp8" and len(q1["quant_config"]) == 16 and q1["quant_config"] != q2["quant_config"]


def test_the_recipe_key_names_what_else_shapes_the_post_processed_bytes(tmp_path: Path) -> None:
    """Found by review: two engines that post-process differently must not share a deposit. A rope override
    (rotary caches are deposited buffers), another MoE backend (FlashInfer swaps w1/w3, AITER shuffles: the
    kernel config), a kernel-selecting environment variable (vLLM's compile factors) — each is another recipe;
    the same configuration is the same recipe."""
    from types import SimpleNamespace

    import torch

    from wcache import WeightCacheKey
    from wcache.integrations import vllm as plugin
    from wcache.synthetic import TINY, make_llama_checkpoint

    base = WeightCacheKey.from_checkpoint(make_llama_checkpoint(tmp_path / "m", TINY, seed=0), dtype="bfloat16")

    class Hf:
        def __init__(self, **kw: Any) -> None:
            self.kw = kw

        def to_dict(self) -> dict[str, Any]:
            return dict(self.kw)

    def cfg(rope: float = 1e4, moe: str = "auto") -> tuple[Any, Any]:
        model = SimpleNamespace(quantization=None, hf_config=Hf(rope_theta=rope), compute_hash=lambda: "m")
        return SimpleNamespace(kernel_config=SimpleNamespace(compute_hash=lambda: moe)), model

    def key(vllm_config: Any, model_config: Any) -> Any:
        return plugin.recipe_key(base, model_config, torch.device("cpu"), "0.32.0", vllm_config)

    v, m = cfg()
    assert key(v, m) == key(*cfg())
    assert key(*cfg(rope=1e6)) != key(v, m)
    assert key(*cfg(moe="flashinfer_cutlass")) != key(v, m)
    env = pytest.importorskip("vllm.envs")  # the compile factors come from vLLM itself
    before = key(v, m)
    real = env.compile_factors
    try:
        env.compile_factors = lambda: {**real(), "VLLM_USE_FLASHINFER_MOE_FP16": "1"}
        assert key(v, m) != before
    finally:
        env.compile_factors = real


def _layer(out: int = 4, inp: int = 3, supports: bool = True) -> Any:
    from torch import nn

    m = nn.Linear(inp, out, bias=False)
    m.quant_method = _Method(supports)  # type: ignore[assignment]
    m.weight.requires_grad_(False)
    return m


def test_the_plan_follows_what_post_processing_did_to_each_module() -> None:
    import torch
    from torch import nn

    from wcache.integrations.vllm import plan_postprocessing, snapshot_postprocessing

    model = nn.ModuleDict(
        {
            "packed": _layer(),  # CPU linear: packed into a handle, a (0,) placeholder left
            "kept": _layer(),  # embedding / LM head: a handle built, the weight untouched
            "replaced": _layer(),  # CPU MoE: prepacked into new tensors, pre-processed weights supported
            "replaced_unsupported": _layer(supports=False),
            "strided": _layer(),
            "plain": nn.LayerNorm(3),  # no quantization method: nothing to plan
        }
    )
    before = snapshot_postprocessing(model, lambda qm: isinstance(qm, _Method))
    assert set(before) == {"packed", "kept", "replaced", "replaced_unsupported", "strided"}
    model["packed"].weight = nn.Parameter(torch.empty(0), requires_grad=False)
    model["replaced"].weight = nn.Parameter(torch.ones(4, 3), requires_grad=False)
    model["replaced_unsupported"].weight = nn.Parameter(torch.ones(4, 3), requires_grad=False)
    model["strided"].weight = nn.Parameter(torch.ones(3, 4).t(), requires_grad=False)
    assert plan_postprocessing(model, before) == {
        "packed": "rebuild",
        "kept": "rerun",
        "replaced": "preprocessed",
        "replaced_unsupported": "rebuild",
        "strided": "rebuild",
    }


def test_a_deposit_carries_module_state_but_not_what_is_rebuilt() -> None:
    import torch
    from torch import nn

    from wcache.errors import IncompatibleModelError
    from wcache.integrations.vllm import PLAN_TENSOR, decode_plan, deposit_tensors

    model = nn.ModuleDict({"a": _layer(), "b": _layer(), "tied": nn.Module()})
    model["tied"].weight = model["a"].weight  # a tie: one tensor, two names
    model["b"].register_buffer("scale", torch.ones(1))
    model["b"].register_buffer("never", torch.empty(2, device="meta"))
    plan = {"a": "rerun", "b": "rebuild"}
    tensors, kinds, left_out = deposit_tensors(model, plan)
    assert set(tensors) == {"a.weight", "tied.weight", PLAN_TENSOR}
    assert tensors["tied.weight"] is tensors["a.weight"]  # the client makes it an alias
    assert sorted(left_out) == ["b.never", "b.scale", "b.weight"]
    assert kinds == {PLAN_TENSOR: "buffer"}
    assert decode_plan(tensors[PLAN_TENSOR]) == plan
    with pytest.raises(IncompatibleModelError, match="not a post-processing plan"):
        decode_plan(torch.frombuffer(bytearray(b'{"version": 9}'), dtype=torch.uint8))


def test_deposited_names_are_registered_even_where_the_built_model_lacks_them() -> None:
    import torch
    from torch import nn

    from wcache.errors import IncompatibleModelError
    from wcache.integrations.vllm import _register

    model = nn.ModuleDict({"layer": _layer()})
    model["layer"].register_buffer("cache", torch.zeros(2), persistent=False)
    modules = dict(model.named_modules(remove_duplicate=False))
    new = _register(modules, "layer.w13_weight_packed", torch.ones(5), True)  # created by post-processing
    assert isinstance(new, nn.Parameter) and model["layer"].w13_weight_packed is new
    _register(modules, "layer.cache", torch.ones(2), False)
    assert "layer.cache" not in model.state_dict()  # still non-persistent
    assert torch.equal(dict(model.named_buffers())["layer.cache"], torch.ones(2))
    with pytest.raises(IncompatibleModelError, match="no module 'missing'"):
        _register(modules, "missing.weight", torch.ones(1), True)


def test_a_deposit_that_does_not_fit_this_build_falls_back_to_the_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: an unexpected error while using a deposit (post-processing or registration raising, e.g. a
    deposit from an older build of the same post-processing version) must not fail the engine's load: the model is
    loaded from the daemon's checkpoint tensors instead, and deposited again."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from wcache.integrations import vllm as plugin

    cls: Any = plugin._loader_class()
    loader = cls.__new__(cls)
    loader.options = plugin.parse_extra_config({})
    loader.load_config = SimpleNamespace(device="cpu")
    calls: list[str] = []
    model = object()

    def broken_deposit(*args: Any) -> Any:
        calls.append("deposit")
        raise RuntimeError("size mismatch in process_weights_after_loading")

    def from_cache(*args: Any) -> Any:
        calls.append("cache")
        return model

    from wcache import WeightCacheKey

    monkeypatch.setattr(loader, "_key", lambda model_config: WeightCacheKey("f", "A", 1, 0, "bfloat16"), raising=False)
    monkeypatch.setattr(loader, "_load_from_deposit", broken_deposit, raising=False)
    monkeypatch.setattr(loader, "_load_from_cache", from_cache, raising=False)
    monkeypatch.setattr(loader, "_deposit", lambda m, key: calls.append("redeposit"), raising=False)
    vllm_config = SimpleNamespace(parallel_config=None, device_config=SimpleNamespace(device="cpu"))
    model_config = SimpleNamespace(quantization=None, hf_config=SimpleNamespace(), model="m")
    assert loader.load_model(vllm_config, model_config) is model
    assert calls == ["deposit", "cache", "redeposit"]
