"""Tensor-parallel sharding plans: which dimension of each tensor a rank takes a slice of.

A plan is an ordered list of (regex, dim) rules; the first rule whose pattern matches
the whole tensor name wins; ``dim`` None means replicated. Built-in plans cover the
Llama family; anything else takes a JSON plan file (docs/shard-plans.md)::

    {"name": "my-arch", "rules": [{"pattern": ".*\\\\.wq\\\\.weight", "dim": 0},
                                  {"pattern": ".*norm.*", "dim": null}]}

FP8 block-wise checkpoints: a weight's ``weight_scale_inv`` is split with its weight, by whole
blocks (see :func:`shard_tensors`); plans need no rules for scales.

Everything is checked before any tensor data is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import field
from pathlib import Path

from wcache.errors import ShardingError
from wcache.plan.checkpoint import TensorInfo
from wcache.plan.quant import weight_name
from wcache.proto._record import record

__all__ = ["BUILTIN_PLANS", "Shard", "ShardPlan", "load_plan_file", "resolve_plan", "shard_tensors"]


@record
class Shard:
    """Rank's slice of a tensor: ``length`` entries of dimension ``dim`` from ``start``."""

    dim: int
    start: int
    length: int


@record
class ShardPlan:
    """Ordered (regex source, dim) rules; the patterns are compiled on the first ``dim_for`` (not at import:
    a TP>1 engine's restart imports this module for the plan's id)."""

    name: str
    rules: tuple[tuple[str, int | None], ...]
    id: str
    _compiled: list[tuple[re.Pattern[str], int | None]] = field(default_factory=list, compare=False, repr=False)

    def dim_for(self, name: str) -> int | None:
        if not self._compiled:
            self._compiled.extend((re.compile(p), d) for p, d in self.rules)
        for pattern, dim in self._compiled:
            if pattern.fullmatch(name):
                return dim
        raise KeyError(name)


def _plan(name: str, rules: Iterable[tuple[str, int | None]], id: str) -> ShardPlan:
    return ShardPlan(name, tuple(rules), id)


_LLAMA_RULES: list[tuple[str, int | None]] = [
    (r"model\.embed_tokens\.weight", 0),
    (r"lm_head\.weight", 0),
    (r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)", 0),
    (r".*\.(o_proj|down_proj)\.weight", 1),
    (r".*\.(o_proj|down_proj)\.bias", None),
    (r".*norm\.(weight|bias)", None),
    (r".*\.rotary_emb\.inv_freq", None),
]
#: Mixtral: each expert's w1/w3 column-parallel and w2 row-parallel, like a dense MLP; the router replicated.
_MIXTRAL_RULES: list[tuple[str, int | None]] = [
    (r".*\.block_sparse_moe\.experts\.\d+\.(w1|w3)\.weight", 0),
    (r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight", 1),
    (r".*\.block_sparse_moe\.gate\.weight", None),
]
#: Qwen2/3-MoE: experts' and shared expert's gate/up column-parallel, down row-parallel; routers replicated.
_QWEN_MOE_RULES: list[tuple[str, int | None]] = [
    (r".*\.mlp\.(experts\.\d+|shared_expert)\.(gate_proj|up_proj)\.weight", 0),
    (r".*\.mlp\.(experts\.\d+|shared_expert)\.down_proj\.weight", 1),
    (r".*\.mlp\.(gate|shared_expert_gate)\.weight", None),
]
LLAMA_PLAN = _plan("llama", _LLAMA_RULES, "builtin:llama/1")
MIXTRAL_PLAN = _plan("mixtral", _MIXTRAL_RULES + _LLAMA_RULES, "builtin:mixtral/1")
QWEN_MOE_PLAN = _plan("qwen-moe", _QWEN_MOE_RULES + _LLAMA_RULES, "builtin:qwen-moe/1")
#: architecture (config.json "architectures"[0]) -> plan
BUILTIN_PLANS: dict[str, ShardPlan] = {
    **dict.fromkeys(("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"), LLAMA_PLAN),
    "MixtralForCausalLM": MIXTRAL_PLAN,
    "Qwen2MoeForCausalLM": QWEN_MOE_PLAN,
    "Qwen3MoeForCausalLM": QWEN_MOE_PLAN,
}


def load_plan_file(path: str | os.PathLike[str]) -> ShardPlan:
    """Parse a JSON plan file; its id is a hash of its canonical content."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested past the parser's limit
        raise ShardingError(f"shard plan {p}: cannot read ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise ShardingError(f"shard plan {p}: expected an object with a 'rules' array")
    rules: list[tuple[str, int | None]] = []
    for i, r in enumerate(data["rules"]):
        if not isinstance(r, dict) or not isinstance(r.get("pattern"), str):
            raise ShardingError(f"shard plan {p}: rule {i} needs a string 'pattern'")
        dim = r.get("dim")
        if dim is not None and (type(dim) is not int or dim < 0):
            raise ShardingError(f"shard plan {p}: rule {i} 'dim' must be a non-negative integer or null")
        try:
            re.compile(r["pattern"])
        except re.error as exc:
            raise ShardingError(f"shard plan {p}: rule {i} pattern is not a valid regex ({exc})") from exc
        rules.append((r["pattern"], dim))
    canon = json.dumps(rules, separators=(",", ":")).encode()
    name = data.get("name") if isinstance(data.get("name"), str) else p.stem
    return _plan(str(name), rules, "file:" + hashlib.sha256(canon).hexdigest()[:16])


def resolve_plan(
    architecture: str, tp_size: int, plan_file: str | os.PathLike[str] | None = None, *, has_config: bool = True
) -> ShardPlan | None:
    """The plan for this architecture (a plan file wins); None when tp_size is 1 and no file. ``has_config``:
    whether the checkpoint has a config.json at all (its ``architectures[0]`` is ``architecture``): the error for
    a directory without one says so."""
    if plan_file is not None:
        return load_plan_file(plan_file)
    if tp_size == 1:
        return None
    plan = BUILTIN_PLANS.get(architecture)
    if plan is None:
        built_in = ", ".join(sorted(BUILTIN_PLANS))
        if not has_config:  # the architecture a built-in plan is picked by is config.json's architectures[0]
            which = f"the checkpoint directory has no config.json to name its architecture (built in: {built_in})"
        elif not architecture:
            which = f"its config.json names no architecture: no 'architectures' list (built in: {built_in})"
        else:
            which = f"for architecture {architecture!r} (built in: {built_in})"
        raise ShardingError(
            f"no built-in sharding plan to split into {tp_size} ranks: {which}; pass a JSON plan file: plan_file= from Python "
            "(RankSpec, which WCacheClient.preload takes; WeightCacheKey.from_checkpoint, wcache.nn.load_weights), "
            "--shard-plan on the command line (format: docs/shard-plans.md)",
            details={"architecture": architecture, "config_json": has_config, "tp_size": tp_size},
        )
    return plan


#: Load-time transforms whose layout pads the vocabulary (embedding and LM-head rows) to a multiple before the
#: engine splits it across ranks: spec -> the multiple. Torch-free, so planning a rank (and the keeper's
#: reclaim check) need not import the transform. vLLM: ``DEFAULT_VOCAB_PADDING_SIZE``.
VOCAB_PADDED_TRANSFORMS: dict[str, int] = {"wcache.transforms:vllm_layout": 64}
VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def padded_vocab_shard(name: str, rows: int, tp_rank: int, tp_size: int, padding: int) -> Shard:
    """vLLM's split of a vocabulary-parallel tensor: the vocabulary padded to ``padding`` rows is split evenly
    (``VocabParallelEmbedding``); this rank holds the real rows of its range (the transform pads the rest
    with zeros). Ranks of a 32016-row vocabulary at TP=2: rows 0..16031 and 16032..32015 (+48 zero rows)."""
    padded = -(-rows // padding) * padding
    if padded % tp_size:
        raise ShardingError(
            f"{name}: the vocabulary of {rows} rows padded to {padded} cannot be split into {tp_size} ranks",
            details={"tensor": name, "rows": rows, "padded": padded, "tp_size": tp_size},
        )
    per = padded // tp_size
    start = tp_rank * per
    length = min(per, rows - start)
    if length <= 0:
        raise ShardingError(
            f"{name}: rank {tp_rank} of {tp_size} would hold only padding rows of the {rows}-row vocabulary",
            details={"tensor": name, "rows": rows, "tp_rank": tp_rank, "tp_size": tp_size},
        )
    return Shard(0, start, length)


def shard_tensors(
    tensors: Iterable[TensorInfo],
    plan: ShardPlan | None,
    tp_rank: int,
    tp_size: int,
    *,
    block: tuple[int, int] | None = None,
    vocab_padding: int | None = None,
) -> dict[str, Shard | None]:
    """Each tensor's slice for this rank (None = whole tensor); raises ShardingError first.

    FP8 block-wise checkpoints (``block`` = config.json's ``quantization_config.weight_block_size``):
    ``X.weight_scale_inv`` always follows ``X.weight`` — the plan's rules are not consulted for it —
    split on the same dimension by whole blocks, so a rank's scales are exactly those of its weight
    rows/columns. A weight whose shard is not a multiple of the block is refused (its edge block's
    scale would be split across ranks), as is a scale whose shape does not match its weight.

    ``vocab_padding`` (``VOCAB_PADDED_TRANSFORMS`` of the key's transform): the embedding and LM head are split
    as the engine splits its padded vocabulary (:func:`padded_vocab_shard`), not evenly.
    """
    if not 0 <= tp_rank < tp_size:
        raise ShardingError(f"tp_rank {tp_rank} is not in [0, {tp_size})")
    infos = {t.name: t for t in tensors}
    out: dict[str, Shard | None] = {}
    unmatched: list[str] = []
    bad: list[str] = []
    scales: list[TensorInfo] = []
    for t in infos.values():
        if plan is None or tp_size == 1:
            out[t.name] = None
            continue
        if weight_name(t.name) is not None:
            scales.append(t)  # after its weight
            continue
        try:
            dim = plan.dim_for(t.name)
        except KeyError:
            unmatched.append(t.name)
            continue
        if dim is None:
            out[t.name] = None
            continue
        if vocab_padding and dim == 0 and t.name in VOCAB_ROWS and t.shape:  # the engine's padded split
            out[t.name] = padded_vocab_shard(t.name, t.shape[0], tp_rank, tp_size, vocab_padding)
            continue
        if dim >= len(t.shape) or t.shape[dim] % tp_size:
            bad.append(f"{t.name} (shape {list(t.shape)}, dim {dim})")
            continue
        n = t.shape[dim] // tp_size
        out[t.name] = Shard(dim, tp_rank * n, n)
    if unmatched:
        raise ShardingError(
            f"plan {plan.name if plan else ''!r} has no rule for {len(unmatched)} tensor(s): "
            + ", ".join(unmatched[:10])
            + (" ..." if len(unmatched) > 10 else "")
        )
    if bad:
        raise ShardingError(
            f"cannot split for tp_size {tp_size}: " + ", ".join(bad[:10]) + (" ..." if len(bad) > 10 else "")
        )
    for s in scales:
        out[s.name] = _scale_shard(s, infos, out, block, tp_size)
    return out


def _scale_shard(
    scale: TensorInfo,
    infos: dict[str, TensorInfo],
    shards: dict[str, Shard | None],
    block: tuple[int, int] | None,
    tp_size: int,
) -> Shard | None:
    """The block scale's slice: its weight's slice, in blocks (ShardingError if that is not whole blocks)."""
    wname = weight_name(scale.name)
    weight = infos.get(wname) if wname is not None else None
    if weight is None:
        raise ShardingError(f"block scale {scale.name!r} has no weight {wname!r} in the checkpoint to shard it with")
    shard = shards.get(weight.name)
    if shard is None:
        return None  # the weight is replicated: so is its scale
    if block is None:
        raise ShardingError(
            f"cannot split {scale.name!r} for tp_size {tp_size}: config.json has no "
            "quantization_config.weight_block_size (quant_method 'fp8') giving its block size"
        )
    if len(weight.shape) < 2:
        raise ShardingError(f"{weight.name!r} of shape {list(weight.shape)} has block scales but is not a matrix")
    lead = len(weight.shape) - 2  # block dims are the last two; leading (expert) dims are scaled 1:1
    want = [*weight.shape[:lead], *(-(-weight.shape[lead + i] // block[i]) for i in (0, 1))]
    if list(scale.shape) != want:
        raise ShardingError(
            f"block scale {scale.name!r} has shape {list(scale.shape)}, but {weight.name!r} of shape "
            f"{list(weight.shape)} in blocks of {list(block)} needs {want}"
        )
    if shard.dim < lead:
        return shard
    b = block[shard.dim - lead]
    if shard.length % b:
        size = weight.shape[shard.dim]
        fix = (
            f"use a tp_size that divides its {size // b} blocks evenly"
            if size % b == 0
            else f"dim {shard.dim} ({size}) is not a whole number of blocks: it can only be served whole (tp_size 1)"
        )
        raise ShardingError(
            f"cannot split {weight.name!r} (shape {list(weight.shape)}) for tp_size {tp_size}: a shard of "
            f"{shard.length} along dim {shard.dim} is not a multiple of the FP8 block {b} "
            f"(weight_block_size {list(block)}), and a block's scale cannot be split across ranks; {fix}",
            details={"tensor": weight.name, "shard": shard.length, "dim": shard.dim, "block": list(block)},
        )
    return Shard(shard.dim, shard.start // b, shard.length // b)
