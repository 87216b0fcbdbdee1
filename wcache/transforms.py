"""Load-time transforms: rewrite a rank's tensors once in the daemon, so engines skip their own
post-processing (``wcache-server --transform module:function``).

A transform is ``fn(tensors: dict[str, Tensor], config: dict) -> dict[str, Tensor]``; it runs on
the slab's device after loading, and its result is packed into a fresh slab. The spec string is
the transform's id in the cache key (field ``transform``): give a changed transform a new name.
Names that map to the very same tensor object in the result are served as aliases.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

import torch

from wcache.errors import WCacheError
from wcache.quant import SCALE_SUFFIX, fp8_block_size

__all__ = ["Transform", "fuse_llama_qkv_gate_up", "load_transform"]

Transform = Callable[[dict[str, torch.Tensor], dict[str, Any]], dict[str, torch.Tensor]]
FUSE_SPEC = "wcache.transforms:fuse_llama_qkv_gate_up"
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def load_transform(spec: str) -> Transform:
    """Import ``package.module:function``; a clear error if it is not one."""
    if not _SPEC.match(spec):
        raise WCacheError(f"--transform {spec!r} is not of the form package.module:function")
    mod, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as exc:
        raise WCacheError(f"--transform {spec!r}: cannot import it ({exc})") from exc
    if not callable(fn):
        raise WCacheError(f"--transform {spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


def fuse_llama_qkv_gate_up(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """vLLM's Llama layout: ``qkv_proj`` = [q; k; v] and ``gate_up_proj`` = [gate; up] along dim 0.

    Applied per rank to the rank's shards, which is exactly what vLLM's QKVParallelLinear and
    MergedColumnParallelLinear hold. FP8 block-wise checkpoints: the parts' ``weight_scale_inv``
    are fused the same way (block rows stacked), which is vLLM's fused scale layout when every
    part's rows are whole blocks; a part that is not is a WCacheError naming it and the block
    (its last block would be shared with the next part's rows).
    """
    block = fp8_block_size(config)
    out: dict[str, torch.Tensor] = {}
    fused: set[str] = set()
    for name in tensors:
        for parts, target in (
            (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
            (("gate_proj", "up_proj"), "gate_up_proj"),
        ):
            m = re.fullmatch(rf"(.*)\.{parts[0]}\.(weight|bias|weight{SCALE_SUFFIX})", name)
            if m:
                names = [f"{m.group(1)}.{p}.{m.group(2)}" for p in parts]
                if all(n in tensors for n in names):
                    if m.group(2) == "weight" + SCALE_SUFFIX:
                        _check_scale_fusion(tensors, names, block, target)
                    elif m.group(2) == "weight" and 0 < sum(n + SCALE_SUFFIX in tensors for n in names) < len(names):
                        raise WCacheError(f"cannot fuse {names} into {target}: only some of them have block scales")
                    out[f"{m.group(1)}.{target}.{m.group(2)}"] = torch.cat([tensors[n] for n in names], dim=0)
                    fused.update(names)
    for name, t in tensors.items():
        if name not in fused:
            out[name] = t
    return out


def _check_scale_fusion(
    tensors: dict[str, torch.Tensor], scales: list[str], block: tuple[int, int] | None, target: str
) -> None:
    """Stacking block scales is only the fused weight's scale if every part's rows are whole blocks."""
    if block is None:
        raise WCacheError(
            f"cannot fuse {scales[0]!r} and its siblings into {target}: config.json has no "
            "quantization_config.weight_block_size (quant_method 'fp8') giving the block size"
        )
    for s in scales:
        w = tensors.get(s.removesuffix(SCALE_SUFFIX))
        if w is None:
            raise WCacheError(f"cannot fuse block scale {s!r} into {target}: its weight is missing")
        if w.dim() < 1 or w.shape[0] % block[0]:
            raise WCacheError(
                f"cannot fuse FP8 {s.removesuffix(SCALE_SUFFIX)!r} into {target}: its {w.shape[0]} rows (on this "
                f"rank) are not a multiple of the block {block[0]} (weight_block_size {list(block)}), so its last "
                f"scale block would cover rows of the next part; serve it without --transform {FUSE_SPEC}"
            )
