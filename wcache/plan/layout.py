"""Slab layout: where each (sharded, cast) tensor of a rank lives in its one slab.

Pure Python. Tensors are placed in checkpoint-file order (so reads are sequential),
each at an offset aligned to ``ALIGN`` bytes; the slab's size is a multiple of ``ALIGN``.
Tied weights absent from the checkpoint become aliases (``lm_head.weight`` ->
``model.embed_tokens.weight`` when ``tie_word_embeddings``). A change of these rules bumps
``wcache.plan.key.LAYOUT_VERSION``: the key above carries the version, so a slab of another layout is another key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from wcache.errors import CheckpointError
from wcache.plan.checkpoint import FLOATING, Checkpoint, TensorInfo
from wcache.plan.quant import fp8_block_size, is_fp8_checkpoint
from wcache.plan.quant import resolve_dtype as key_dtype
from wcache.plan.sharding import Shard, ShardPlan, shard_tensors
from wcache.proto.codec import DEFAULT_MAX_FRAME_SIZE
from wcache.proto.frames import DTYPE_SIZES, TensorEntry, TensorTable

__all__ = [
    "ALIGN",
    "FLOATING",
    "Layout",
    "Placement",
    "align_up",
    "contiguous_strides",
    "is_quantized",
    "plan_layout",
    "resolve_dtype",
    "serves_as_stored",
]

ALIGN = 256  # bytes: CUDA's allocation granularity for vectorised access, and cache lines


def is_quantized(config: Mapping[str, Any]) -> bool:
    """config.json has a ``quantization_config`` naming a ``quant_method`` (AWQ, GPTQ, compressed-tensors,
    FP8...): a checkpoint whose tensors are served as stored, never cast."""
    q = config.get("quantization_config")
    return isinstance(q, dict) and bool(q.get("quant_method"))


def serves_as_stored(ckpt: Checkpoint) -> bool:
    """Every tensor keeps its checkpoint dtype: FP8 checkpoints (wcache.plan.quant) and every other quantized one.

    A quantized checkpoint's floating tensors are not all the model's dtype: scales the engine keeps in
    float32 (compressed-tensors int8 / FP8 ``weight_scale``), AWQ / GPTQ fp16 ``scales``; which of them the
    engine casts to its dtype is the engine's business (vLLM's weight loaders cast on copy into a parameter
    of another dtype), so the daemon serves the checkpoint's bytes."""
    return is_fp8_checkpoint(ckpt.tensors, ckpt.config) or is_quantized(ckpt.config)


def resolve_dtype(ckpt: Checkpoint, requested: str | None) -> str:
    """``None``/``"auto"`` -> the floating dtype holding the most bytes in the checkpoint (the key's dtype:
    ``wcache.plan.quant.resolve_dtype``).

    FP8 checkpoints: the dtype of their unquantized tensors, any other refused (wcache.plan.quant). Other quantized
    checkpoints are served as stored too (:func:`serves_as_stored`); their key's dtype names the dtype the
    engine runs in (a castable one, or ``auto``), which the engine's own casts follow."""
    return key_dtype(ckpt.dtype_bytes(), ckpt.config, requested)


@dataclass(frozen=True, slots=True)
class Placement:
    """One tensor of the rank: read ``source`` (sliced by ``shard``), cast to ``dtype``,
    store C-contiguous at ``offset``."""

    source: TensorInfo
    shard: Shard | None
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Layout:
    placements: tuple[Placement, ...]
    aliases: dict[str, str]
    total_bytes: int  # slab size, a multiple of ALIGN
    dtype: str
    #: the checkpoint whose open descriptors the loader reads placements through (None: by path)
    checkpoint: Checkpoint | None = field(default=None, compare=False, repr=False)

    @property
    def payload_bytes(self) -> int:
        return sum(p.nbytes for p in self.placements)

    def table(self) -> TensorTable:
        """The STATE frame's tensor table for this layout (slab 0)."""
        return TensorTable.from_entries(
            [
                TensorEntry(p.source.name, p.dtype, p.shape, contiguous_strides(p.shape), 0, p.offset)
                for p in self.placements
            ]
        )


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-order strides in elements (a zero-sized dimension counts as 1, as in torch)."""
    stride = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def align_up(n: int) -> int:
    """``n`` rounded up to the slab alignment."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_layout(
    ckpt: Checkpoint,
    *,
    tp_rank: int,
    tp_size: int,
    dtype: str,
    plan: ShardPlan | None,
    vocab_padding: int | None = None,
) -> Layout:
    """Place every tensor of the rank; raises ShardingError before any data is read."""
    shards = shard_tensors(
        ckpt.tensors.values(),
        plan,
        tp_rank,
        tp_size,
        block=fp8_block_size(ckpt.config),
        vocab_padding=vocab_padding,
    )
    as_stored = serves_as_stored(ckpt)
    order = sorted(ckpt.tensors.values(), key=lambda t: (str(t.file), t.start))
    placements: list[Placement] = []
    offset = 0
    for t in order:
        shard = shards[t.name]
        shape = list(t.shape)
        if shard is not None:
            shape[shard.dim] = shard.length
        out_dtype = dtype if t.dtype in FLOATING and not as_stored else t.dtype
        p = Placement(t, shard, out_dtype, tuple(shape), offset)
        placements.append(p)
        offset = align_up(offset + p.nbytes)
    aliases: dict[str, str] = {}
    tie = ckpt.config.get("tie_word_embeddings")
    if tie is True and "lm_head.weight" not in ckpt.tensors and "model.embed_tokens.weight" in ckpt.tensors:
        aliases["lm_head.weight"] = "model.embed_tokens.weight"
    _check_table_size(ckpt, placements)
    return Layout(tuple(placements), aliases, max(offset, ALIGN), dtype, ckpt)


#: STATE bytes beside the tensor table: slab descriptors, key, aliases, lease fields.
_STATE_OVERHEAD = 64 << 10


def _check_table_size(ckpt: Checkpoint, placements: list[Placement]) -> None:
    """Refuse a rank whose STATE frame could not fit the default frame limit (docs/protocol.md §7).

    An upper bound, computed without encoding: per tensor its UTF-8 name + 5 bytes of msgpack
    string header, and one group's columns (dtype index, rank, shape and stride of 8 bytes per
    dimension, slab, offset, step, count) as if no two tensors shared a group."""
    need = _STATE_OVERHEAD + sum(len(p.source.name.encode()) + 5 + 26 + 16 * len(p.shape) for p in placements)
    if need > DEFAULT_MAX_FRAME_SIZE:
        raise CheckpointError(
            f"{ckpt.path}: the tensor table of {len(placements)} tensors may need {need} bytes, over the "
            f"{DEFAULT_MAX_FRAME_SIZE}-byte frame limit (docs/protocol.md §7): this checkpoint cannot be served "
            "in one STATE frame (shorter tensor names, or fewer tensors per rank with --tp-size)"
        )
