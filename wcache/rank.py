"""Everything about one rank of a checkpoint that can be known without reading tensor data.

The daemon's loader, its PRELOAD budget check and the engine's disk fallback all start here,
so that they agree on the key, the sharding plan and the slab layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from wcache.checkpoint import Checkpoint
from wcache.key import WeightCacheKey
from wcache.layout import Layout, plan_layout
from wcache.sharding import ShardPlan, resolve_plan

__all__ = ["RankPlan", "plan_rank"]


@dataclass(frozen=True)
class RankPlan:
    checkpoint: Checkpoint
    key: WeightCacheKey
    plan: ShardPlan | None
    layout: Layout

    def close(self) -> None:
        self.checkpoint.close()

    def __enter__(self) -> RankPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plan_rank(
    model_dir: str | os.PathLike[str],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    dtype: str | None = None,
    plan_file: str | os.PathLike[str] | None = None,
    transform: str = "",
    verify_content: bool = False,
) -> RankPlan:
    """Headers, key, plan and layout of one rank; raises CheckpointError / ShardingError before any data.

    The plan holds the checkpoint's open descriptors (``checkpoint.fd``): the key's fingerprint was
    read through them and the loader reads the data through them, so the bytes served are those of
    the files validated here even if the directory changes meanwhile. ``close()`` (or ``with``)
    releases them; an unreferenced plan releases them when collected."""
    ckpt = Checkpoint.open(model_dir)
    try:
        plan = resolve_plan(ckpt.architecture, tp_size, plan_file)
        key = WeightCacheKey.from_checkpoint(
            Path(model_dir),
            tp_rank=tp_rank,
            tp_size=tp_size,
            dtype=dtype,
            plan_file=plan_file,
            verify_content=verify_content,
            checkpoint=ckpt,
            transform=transform,
        )
        layout = plan_layout(ckpt, tp_rank=tp_rank, tp_size=tp_size, dtype=key.dtype, plan=plan)
    except BaseException:
        ckpt.close()
        raise
    return RankPlan(ckpt, key, plan, layout)
