"""Load-time transforms: rewrite a rank's tensors once in the daemon, so engines skip their own
post-processing (``wcache-server --transform module:function``).

A transform is ``fn(tensors: dict[str, Tensor], config: dict) -> dict[str, Tensor]``; ``config`` is
config.json plus ``wcache_tp_rank`` / ``wcache_tp_size`` (the rank it works for). It runs on
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

from wcache.errors import ShardingError, TransformError
from wcache.plan.quant import SCALE_SUFFIX, fp8_block_size
from wcache.plan.sharding import VOCAB_PADDED_TRANSFORMS, VOCAB_ROWS

__all__ = [
    "PACKED_ALONG_OUT",
    "VLLM_VOCAB_PADDING",
    "Transform",
    "fuse_llama_qkv_gate_up",
    "load_transform",
    "rank_config",
    "stack_experts",
    "vllm_layout",
]

Transform = Callable[[dict[str, torch.Tensor], dict[str, Any]], dict[str, torch.Tensor]]
FUSE_SPEC = "wcache.transforms:fuse_llama_qkv_gate_up"
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def rank_config(config: dict[str, Any], tp_rank: int, tp_size: int) -> dict[str, Any]:
    """The ``config`` a transform receives: config.json plus the rank it works for."""
    return {**config, "wcache_tp_rank": tp_rank, "wcache_tp_size": tp_size}


def load_transform(spec: str) -> Transform:
    """Import ``package.module:function``; a clear error if it is not one."""
    if not _SPEC.match(spec):
        raise TransformError(f"--transform {spec!r} is not of the form package.module:function")
    mod, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as exc:
        raise TransformError(f"--transform {spec!r}: cannot import it ({exc})") from exc
    if not callable(fn):
        raise TransformError(f"--transform {spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


def fuse_llama_qkv_gate_up(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """vLLM's Llama layout: ``qkv_proj`` = [q; k; v] and ``gate_up_proj`` = [gate; up] along dim 0.

    AWQ checkpoints (``PACKED_ALONG_OUT``): their ``qweight`` / ``qzeros`` [in (groups), out/8] int32 and
    ``scales`` [groups, out] are fused along dim 1, their output dimension, which is where vLLM's loaders put
    each part (packed columns stay whole words: every part's output size is a multiple of 8).

    Applied per rank to the rank's shards, which is exactly what vLLM's QKVParallelLinear and
    MergedColumnParallelLinear hold. FP8 block-wise checkpoints: the parts' ``weight_scale_inv``
    are fused the same way (block rows stacked), which is vLLM's fused scale layout when every
    part's rows are whole blocks; a part that is not is a WCacheError naming it and the block
    (its last block would be shared with the next part's rows).
    """
    block = fp8_block_size(config)
    packed = _packed_along_out(config)
    leaves = "|".join(("weight", "bias", "weight" + SCALE_SUFFIX, *packed))
    out: dict[str, torch.Tensor] = {}
    fused: set[str] = set()
    for name in tensors:
        for parts, target in (
            (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
            (("gate_proj", "up_proj"), "gate_up_proj"),
        ):
            m = re.fullmatch(rf"(.*)\.{parts[0]}\.({leaves})", name)
            if m:
                names = [f"{m.group(1)}.{p}.{m.group(2)}" for p in parts]
                if all(n in tensors for n in names):
                    if m.group(2) == "weight" + SCALE_SUFFIX:
                        _check_scale_fusion(tensors, names, block, target)
                    elif m.group(2) == "weight" and 0 < sum(n + SCALE_SUFFIX in tensors for n in names) < len(names):
                        raise TransformError(f"cannot fuse {names} into {target}: only some of them have block scales")
                    dim = 1 if m.group(2) in packed else 0
                    out[f"{m.group(1)}.{target}.{m.group(2)}"] = torch.cat([tensors[n] for n in names], dim=dim)
                    fused.update(names)
    for name, t in tensors.items():
        if name not in fused:
            out[name] = t
    return out


#: quantization methods (config.json ``quantization_config.quant_method``) whose linear tensors are stored
#: [in-ish, out-ish]: fused along dim 1 (vLLM's ``output_dim=1`` parameters), each part's columns in q, k, v
#: (gate, up) order, as vLLM's ``PackedvLLMParameter`` / ``GroupQuantScaleParameter`` loaders place them
PACKED_ALONG_OUT: dict[str, tuple[str, ...]] = {"awq": ("qweight", "qzeros", "scales")}


def _packed_along_out(config: dict[str, Any]) -> tuple[str, ...]:
    q = config.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    return PACKED_ALONG_OUT.get(method, ()) if isinstance(method, str) else ()


#: vLLM pads embedding and LM-head rows to a multiple of this (``DEFAULT_VOCAB_PADDING_SIZE``).
VLLM_VOCAB_PADDING = VOCAB_PADDED_TRANSFORMS["wcache.transforms:vllm_layout"]


_EXPERT = re.compile(r"(.*\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_W13 = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's FusedMoE layout: per-expert ``experts.J.{gate,up,down}_proj.weight`` (Qwen-MoE) or
    ``experts.J.{w1,w3,w2}.weight`` (Mixtral) become ``experts.w13_weight`` [E, 2I, H] ([gate; up] per
    expert) and ``experts.w2_weight`` [E, H, I]. A layer whose experts are incomplete is left as it is."""
    layers: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m:
            layers.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    out = dict(tensors)
    for prefix, experts in layers.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))) or any(len(experts[j]) != 3 for j in ids):
            continue
        w13, w2 = [], []
        for j in ids:
            parts = experts[j]
            gate_up = sorted((k for k in parts if k in _W13), key=_W13.__getitem__)
            (down,) = (k for k in parts if k not in _W13)
            w13.append(torch.cat([parts[k] for k in gate_up], dim=0))
            w2.append(parts[down])
            for k in parts:
                del out[f"{prefix}.{j}.{k}.weight"]
        out[f"{prefix}.w13_weight"] = torch.stack(w13)
        out[f"{prefix}.w2_weight"] = torch.stack(w2)
    return out


def vllm_layout(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """vLLM's parameter layout for the Llama family and Qwen/Mixtral MoE: :func:`fuse_llama_qkv_gate_up`,
    MoE experts stacked as FusedMoE holds them (:func:`stack_experts`), and the embedding and LM
    head padded with zero rows to vLLM's padded vocabulary (``VocabParallelEmbedding`` /
    ``ParallelLMHead`` hold ``round_up(vocab, 64) / tp_size`` rows per rank and zero the padding).

    At tensor-parallel size > 1 the daemon already cut this rank's rows as vLLM splits the *padded* vocabulary
    (``wcache.plan.sharding.padded_vocab_shard``, keyed by this transform's name); here they are padded to the
    rank's share. Tied weights stay one tensor.
    """
    out = fuse_llama_qkv_gate_up(stack_experts(tensors), config)
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise TransformError("vllm_layout: config.json has no positive integer vocab_size")
    tp_size = config.get("wcache_tp_size", 1)
    padded = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    if not isinstance(tp_size, int) or tp_size < 1 or padded % tp_size:
        raise ShardingError(f"vllm_layout: a vocabulary padded to {padded} rows cannot be split into {tp_size} ranks")
    per = padded // tp_size
    done: dict[int, torch.Tensor] = {}
    for name in VOCAB_ROWS:
        orig = out.get(name)
        if orig is None:
            continue
        if id(orig) in done:  # tied: the same padded tensor
            out[name] = done[id(orig)]
            continue
        t = orig
        rows = t.shape[0]
        if rows > per:
            raise ShardingError(
                f"vllm_layout: {name} has {rows} rows on this rank, more than vLLM's {per} (vocabulary {vocab} padded "
                f"to {padded}, {tp_size} ranks): the rank was not split as vLLM splits it"
            )
        if rows < per:
            t = torch.cat([t, torch.zeros((per - rows, *t.shape[1:]), dtype=t.dtype, device=t.device)], dim=0)
        out[name] = done[id(orig)] = t
    return out


def _check_scale_fusion(
    tensors: dict[str, torch.Tensor], scales: list[str], block: tuple[int, int] | None, target: str
) -> None:
    """Stacking block scales is only the fused weight's scale if every part's rows are whole blocks."""
    if block is None:
        raise TransformError(
            f"cannot fuse {scales[0]!r} and its siblings into {target}: config.json has no "
            "quantization_config.weight_block_size (quant_method 'fp8') giving the block size"
        )
    for s in scales:
        w = tensors.get(s.removesuffix(SCALE_SUFFIX))
        if w is None:
            raise TransformError(f"cannot fuse block scale {s!r} into {target}: its weight is missing")
        if w.dim() < 1 or w.shape[0] % block[0]:
            raise TransformError(
                f"cannot fuse FP8 {s.removesuffix(SCALE_SUFFIX)!r} into {target}: its {w.shape[0]} rows (on this "
                f"rank) are not a multiple of the block {block[0]} (weight_block_size {list(block)}), so its last "
                f"scale block would cover rows of the next part; serve it without --transform {FUSE_SPEC}"
            )
