"""FP8 block-wise checkpoints (DeepSeek-V3 / Qwen3-FP8 layout), as far as the raw path cares.

Such a checkpoint stores each quantized linear weight ``X.weight`` [out, in] as ``float8_e4m3fn``
(or ``float8_e5m2``) next to ``X.weight_scale_inv`` float32 [ceil(out/b0), ceil(in/b1)], one scale per
b0 x b1 block, where ``[b0, b1]`` is config.json's ``quantization_config.weight_block_size``; the other
tensors (embeddings, norms, often ``lm_head``) stay in bf16.

The daemon serves such a checkpoint **as stored**: FP8 weights, their float32 scales and the bf16
tensors each in their own dtype. A cast makes no sense (a bf16 copy of an FP8 weight is not the
model, a bf16 scale loses precision), so the key's ``dtype`` names the dtype the unquantized floating
tensors are stored in (``auto`` resolves to it) and any other dtype is refused (:func:`resolve_dtype`, the key's
dtype of every checkpoint, FP8 or not). Pure Python, no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from wcache.errors import CheckpointError
from wcache.plan.checkpoint import FLOATING, FP8_DTYPES, DtypeBytes, TensorInfo

__all__ = [
    "FP8_DTYPES",
    "SCALE_SUFFIX",
    "fp8_block_size",
    "is_fp8_checkpoint",
    "resolve_dtype",
    "scale_name",
    "stored_dtype",
    "weight_name",
]

#: ``X.weight`` -> ``X.weight_scale_inv`` (the multiplier that dequantizes a block: w ≈ q * scale_inv)
SCALE_SUFFIX = "_scale_inv"


def scale_name(weight: str) -> str:
    """The block-scale tensor's name for a weight's name."""
    return weight + SCALE_SUFFIX


def weight_name(name: str) -> str | None:
    """The weight a block-scale tensor belongs to, or None if ``name`` is not a block scale."""
    return name.removesuffix(SCALE_SUFFIX) if name.endswith(".weight" + SCALE_SUFFIX) else None


def _quant_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    q = config.get("quantization_config")
    return q if isinstance(q, dict) else None


def fp8_block_size(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """``quantization_config.weight_block_size`` of an FP8 checkpoint, or None (not FP8, or per-tensor FP8).

    Raises CheckpointError when it is there but not two positive integers."""
    q = _quant_config(config)
    if q is None or q.get("quant_method") != "fp8" or q.get("weight_block_size") is None:
        return None
    b = q["weight_block_size"]
    if not (isinstance(b, list) and len(b) == 2 and all(type(x) is int and x > 0 for x in b)):
        raise CheckpointError(
            f"config.json quantization_config.weight_block_size {b!r} is not [rows, cols] of positive integers"
        )
    return (b[0], b[1])


def is_fp8_checkpoint(tensors: Mapping[str, TensorInfo], config: Mapping[str, Any]) -> bool:
    """config.json says ``quant_method: fp8``, or some tensor is stored in an FP8 dtype."""
    q = _quant_config(config)
    if q is not None and q.get("quant_method") == "fp8":
        return True
    return any(t.dtype in FP8_DTYPES for t in tensors.values())


def stored_dtype(counted: DtypeBytes, requested: str | None) -> str:
    """The key's ``dtype`` for an FP8 checkpoint: the floating dtype holding the most bytes among its
    unquantized tensors (block scales left out), which is what every tensor is served in or next to.
    ``counted``: the checkpoint's bytes per dtype (``Checkpoint.dtype_bytes()``).

    ``None``/``"auto"`` or that very dtype is accepted; any other is a CheckpointError (no cast)."""
    common = Counter(counted.weights or counted.scales).most_common(1)
    dtype = common[0][0] if common else "float32"
    if requested not in (None, "auto", dtype):
        fp8 = sorted(counted.fp8)
        raise CheckpointError(
            f"dtype {requested!r}: this is an FP8 checkpoint ({', '.join(fp8) or 'quant_method fp8'} weights with "
            f"block scales), served as stored without a cast; use dtype 'auto' (or {dtype!r}, "
            "the dtype its unquantized tensors are stored in)",
            details={"requested": requested, "stored": dtype},
        )
    return dtype


def resolve_dtype(counted: DtypeBytes, config: dict[str, Any], requested: str | None) -> str:
    """The key's ``dtype``: ``None``/``"auto"`` -> the floating dtype holding the most bytes (``counted``:
    ``Checkpoint.dtype_bytes()``); FP8 checkpoints are served as stored, never cast (:func:`stored_dtype`)."""
    if counted.fp8 or is_fp8_checkpoint({}, config):
        return stored_dtype(counted, requested)
    if requested not in (None, "auto"):
        if requested not in FLOATING:
            raise CheckpointError(f"dtype {requested!r} is not one of auto, {', '.join(sorted(FLOATING))}")
        return str(requested)
    return max(counted.floating, key=counted.floating.__getitem__) if counted.floating else "float32"
