"""The recipe key of a vLLM rank's post-processed state (docs/protocol.md §4.13, docs/integrations.md "Write-back
of the post-processed state"): the checkpoint key plus every field that decides the bytes vLLM's
post-processing makes of it, so two engines that post-process differently never share a deposit.

Reads vLLM's config objects by attribute and method only: plain objects stand in for them in the tests."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch

from wcache.integrations.vllm.checks import quant_config_dict

if TYPE_CHECKING:
    from wcache.plan.key import WeightCacheKey
    from wcache.plan.recipe import RecipeKey

__all__ = ["POSTPROCESS_VERSION", "device_recipe", "engine_config_digest", "recipe_key", "recipe_quantization"]

#: the post-processing version of this plugin's write-back (part of the recipe key): bump it when what is
#: deposited, or how a start that maps a deposit post-processes, changes
POSTPROCESS_VERSION = "wcache-vllm-1"


def _digest(value: Any) -> str:
    """A SHA-256 prefix of ``value`` as canonical JSON (what the recipe's hashed fields hold)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def recipe_quantization(model_config: Any) -> dict[str, str]:
    """The recipe key's quantization fields: ``quantization`` (vLLM's method name, ``""`` unquantized) and
    ``quant_config`` (a SHA-256 prefix of the checkpoint's ``quantization_config``, ``""`` without one).

    The one place the recipe names quantization: a quantized model ``check_quantization`` lets through
    (AWQ) gets its method and config hash here, so a deposit of another quantization never matches."""
    method = getattr(model_config, "quantization", None) or ""
    qc = quant_config_dict(getattr(getattr(model_config, "hf_config", None), "quantization_config", None))
    return {"quantization": str(method), "quant_config": _digest(qc) if qc else ""}


def device_recipe(device: torch.device) -> dict[str, str]:
    """``device_type`` and ``device_capability``: a CUDA device's compute capability (``"9.0"``); on the
    CPU the ISA torch dispatches to plus the bf16 / AMX extensions vLLM's CPU kernels choose their packing
    by (``"AVX2"``, ``"AVX512+avx512_bf16+amx"``)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {"device_type": "cuda", "device_capability": f"{major}.{minor}"}
    if device.type == "cpu":
        cap = str(torch.backends.cpu.get_cpu_capability())
        for flag, probe in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx", "_is_amx_tile_supported")):
            check = getattr(torch.cpu, probe, None)
            if check is not None and check():
                cap += f"+{flag}"
        return {"device_type": "cpu", "device_capability": cap}
    return {"device_type": device.type, "device_capability": ""}


def _call(obj: Any, *path: str) -> Any:
    """``obj.a.b()`` for path ("a", "b"); a vLLM without that API gives a stable marker instead."""
    try:
        for name in path[:-1]:
            obj = getattr(obj, name)
        return getattr(obj, path[-1])()
    except Exception as exc:
        return f"<{type(exc).__name__}>"


def engine_config_digest(vllm_config: Any, model_config: Any) -> str:
    """A SHA-256 prefix of what else decides the post-processed bytes: the effective Hugging Face config (with
    ``--hf-overrides`` / rope scaling applied: buffers computed at init, like rotary caches, are deposited), the
    model config's own hash, the kernel config (``moe_backend``: FlashInfer swaps w1/w3, AITER shuffles), and the
    environment variables vLLM keys its compile cache on (``envs.compile_factors()``: kernel-selecting flags
    such as ``VLLM_USE_FLASHINFER_MOE_FP16``). Any that cannot be read count as their type's name."""
    try:
        import vllm.envs as vllm_envs
    except ImportError:
        vllm_envs = None
    return _digest(
        {
            "hf_config": _call(model_config, "hf_config", "to_dict"),
            "model": _call(model_config, "compute_hash"),
            "kernel": _call(vllm_config, "kernel_config", "compute_hash"),
            "env": _call(vllm_envs, "compile_factors"),
        }
    )


def recipe_key(
    base: WeightCacheKey, model_config: Any, device: torch.device, engine_version: str, vllm_config: Any = None
) -> RecipeKey:
    """The RecipeKey of ``base`` (the rank's checkpoint key: fingerprint, rank layout, dtype, transform)
    as vLLM ``engine_version`` post-processes it on ``device`` under ``vllm_config``
    (:func:`engine_config_digest`)."""
    from wcache.plan.recipe import RecipeKey

    return RecipeKey.of(
        base,
        engine="vllm",
        engine_version=engine_version,
        **recipe_quantization(model_config),
        postprocess=POSTPROCESS_VERSION,
        engine_config=engine_config_digest(vllm_config, model_config),
        **device_recipe(device),
    )
