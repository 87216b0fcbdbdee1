"""wcache/integrations/vllm/checks.py: what ``--load-format wcache`` refuses before anything is fetched. Plain
config dicts and objects stand in for vLLM's; one test checks the parallel refusals against vLLM's own
``ParallelConfig``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.integrations.vllm import require_vllm
from wcache.errors import IncompatibleModelError, WCacheError
from wcache.integrations.vllm.checks import check_engine, check_parallel, check_quantization, quant_config_dict

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


def test_awq_is_served_and_other_quantization_is_refused_naming_the_method() -> None:
    check_quantization(None)
    for name in ("awq", "auto_awq", "awq_marlin"):  # vLLM's names for an AWQ checkpoint
        check_quantization(name, AWQ)
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
    with pytest.raises(IncompatibleModelError, match=r"tensor_parallel_size=2.*--load-format auto") as exc:
        check_quantization("awq", AWQ, tp_size=2)
    assert exc.value.details["tp_size"] == 2


def test_a_quantization_config_object_reads_as_its_dict() -> None:
    class WithToDict:
        def to_dict(self) -> dict[str, Any]:
            return {"quant_method": "gptq"}

    assert quant_config_dict(None) is None and quant_config_dict(AWQ) is AWQ
    assert quant_config_dict(WithToDict()) == {"quant_method": "gptq"}
    assert quant_config_dict(SimpleNamespace(quant_method="fp8")) == {"quant_method": "fp8"}
    with pytest.raises(IncompatibleModelError, match=r"'awq' \(checkpoint quant_method 'gptq'\)"):
        check_quantization("awq", WithToDict())


PARALLEL_REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"pipeline_parallel_size": 2}, "pipeline parallelism"),
    ({"prefill_context_parallel_size": 2}, "prefill context parallelism"),
    ({"tensor_parallel_size": 2, "decode_context_parallel_size": 2}, "decode context parallelism"),
    ({"enable_expert_parallel": True}, "expert parallelism"),
    ({"enable_expert_parallel": True, "data_parallel_size": 2}, "data_parallel_size=2"),
]


def _parallel(**kw: Any) -> SimpleNamespace:
    """What check_parallel reads of vLLM's ParallelConfig, with its defaults."""
    fields = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "prefill_context_parallel_size": 1}
    fields |= {"decode_context_parallel_size": 1, "data_parallel_size": 1, "enable_expert_parallel": False}
    return SimpleNamespace(**{**fields, **kw})


def test_parallel_layouts_the_daemon_does_not_serve_are_refused_naming_the_mode() -> None:
    check_parallel(None)
    check_parallel(_parallel(tensor_parallel_size=2))  # tensor parallel: the daemon's shards
    check_parallel(_parallel(data_parallel_size=2))  # replicas of one TP group
    for kw, named in PARALLEL_REFUSED:
        with pytest.raises(IncompatibleModelError, match=named) as exc:
            check_parallel(_parallel(**kw))
        assert "--load-format auto" in str(exc.value) and exc.value.details["parallel"]


def test_vllms_parallel_config_reads_the_same() -> None:
    require_vllm()
    from vllm.config import ParallelConfig

    check_parallel(ParallelConfig(tensor_parallel_size=2))
    check_parallel(ParallelConfig(data_parallel_size=2))
    for kw, named in PARALLEL_REFUSED:
        with pytest.raises(WCacheError, match=named):
            check_parallel(ParallelConfig(**kw))


def test_the_engine_check_reads_both_from_vllms_configs() -> None:
    def model(quantization: str | None = None, qc: Any = None) -> SimpleNamespace:
        return SimpleNamespace(quantization=quantization, hf_config=SimpleNamespace(quantization_config=qc))

    check_engine(None, SimpleNamespace())  # configs that set nothing: nothing to refuse
    check_engine(SimpleNamespace(parallel_config=_parallel()), model("awq", AWQ))
    with pytest.raises(IncompatibleModelError, match="tensor_parallel_size=2"):  # the TP size from the parallel config
        check_engine(SimpleNamespace(parallel_config=_parallel(tensor_parallel_size=2)), model("awq", AWQ))
    with pytest.raises(IncompatibleModelError, match="'fp8'"):
        check_engine(SimpleNamespace(parallel_config=None), model("fp8"))
    with pytest.raises(IncompatibleModelError, match="pipeline parallelism"):
        check_engine(SimpleNamespace(parallel_config=_parallel(pipeline_parallel_size=2)), model())
