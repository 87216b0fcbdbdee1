"""One rank of a checkpoint: what a request names (``RankSpec``) and what can be known of it without
reading tensor data (``RankPlan``).

A ``RankSpec`` is the one description of a rank — checkpoint directory, tensor parallel rank and size,
dtype, shard plan file, load-time transform, fingerprint kind — that the key, the plan, the daemon's
loader, the client's PRELOAD, ``wcache.nn`` and the ``wcache-server`` CLI all take, so that they agree
(two bugs came from spelling it out six times: a PRELOAD's "already held" check without
``verify_content``, and ``nn.load_weights``'s key without ``transform``; issue 19).

``plan_rank(spec)`` reads the headers and the fingerprint once; the daemon's budget check, its "already
held" check and its loader all use that one ``RankPlan``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcache.key import KeyFacts, WeightCacheKey, checkpoint_files
from wcache.proto._record import record

if TYPE_CHECKING:  # a key (the engine's restart path) needs none of them: plan_rank imports them
    from wcache.checkpoint import Checkpoint
    from wcache.layout import Layout
    from wcache.proto.admin_frames import Preload
    from wcache.sharding import ShardPlan

__all__ = ["RankPlan", "RankSpec", "check_tp", "plan_rank", "tp_problem"]

PathLike = str | os.PathLike[str]


def tp_problem(tp_rank: object, tp_size: object, *, flags: bool = False) -> str | None:
    """What is wrong with a tensor-parallel rank and world size, in words (None: nothing). The one range
    check of every place that takes ranks: RankSpec (keys, PRELOAD, ``wcache.nn``), ``wcache-server`` and
    ``wcache preload`` / ``evict``; ``flags`` names them as the command lines do (``--tp-rank``)."""
    rank, size = ("--tp-rank", "--tp-size") if flags else ("tp_rank", "tp_size")
    for name, value in ((size, tp_size), (rank, tp_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name} must be an integer, got {value!r}"
    assert isinstance(tp_rank, int) and isinstance(tp_size, int)
    if tp_size < 1:
        return f"{size} {tp_size} must be at least 1 (1: one rank serves whole tensors)"
    if not 0 <= tp_rank < tp_size:
        last = f"0..{tp_size - 1}" if tp_size > 1 else "0"
        return f"{rank} {tp_rank} must be in [0, {tp_size}) for {size} {tp_size} (ranks {last})"
    return None


def check_tp(tp_rank: object, tp_size: object) -> None:
    """Raise ShardingError (INVALID_PLAN on the wire) for a rank outside ``[0, tp_size)`` or a size below 1."""
    problem = tp_problem(tp_rank, tp_size)
    if problem is not None:
        from wcache.errors import ShardingError

        raise ShardingError(problem, details={"tp_rank": repr(tp_rank), "tp_size": repr(tp_size)})


@record
class RankSpec:
    """One rank of a checkpoint as a request names it. Immutable and hashable; build variants with
    ``dataclasses.replace``.

    ``checkpoint`` and ``plan_file`` are made absolute (a PRELOAD names paths on the daemon's machine);
    ``dtype`` ``None`` (or ``"auto"``) means as stored. ``verify_content`` fingerprints all data instead
    of a sample (the key's ``fingerprint_kind``); it is the daemon's policy (``--verify-content``), not a
    PRELOAD field."""

    checkpoint: Path
    tp_rank: int = 0
    tp_size: int = 1
    dtype: str | None = None
    plan_file: Path | None = None
    transform: str = ""
    verify_content: bool = False

    def __post_init__(self) -> None:
        check_tp(self.tp_rank, self.tp_size)
        object.__setattr__(self, "checkpoint", Path(os.path.abspath(self.checkpoint)))
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", None)
        if self.plan_file is not None and str(self.plan_file) == "":
            object.__setattr__(self, "plan_file", None)
        elif self.plan_file is not None:
            object.__setattr__(self, "plan_file", Path(os.path.abspath(self.plan_file)))

    @classmethod
    def of(cls, checkpoint: PathLike | RankSpec, **fields: Any) -> RankSpec:
        """``checkpoint`` as a spec: a RankSpec (with ``fields`` replaced), or a directory with ``fields``.
        Lets the keyword-argument APIs (``from_checkpoint(dir, tp_rank=...)``) and the spec ones meet."""
        if isinstance(checkpoint, RankSpec):
            return dataclasses.replace(checkpoint, **fields) if fields else checkpoint
        return cls(Path(checkpoint), **fields)

    @classmethod
    def from_preload(cls, req: Preload, *, verify_content: bool = False) -> RankSpec:
        """The rank a PRELOAD frame names, under the daemon's fingerprint policy."""
        return cls(
            Path(req.model),
            tp_rank=req.tp_rank,
            tp_size=req.tp_size,
            dtype=req.dtype,
            plan_file=Path(req.plan_file) if req.plan_file else None,
            transform=req.transform,
            verify_content=verify_content,
        )

    def to_preload(self, id: int) -> Preload:
        """The PRELOAD frame asking a daemon for this rank (``verify_content`` is the daemon's choice)."""
        from wcache.proto.admin_frames import Preload

        return Preload(
            id=id,
            model=str(self.checkpoint),
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            dtype=self.dtype or "auto",
            plan_file=str(self.plan_file) if self.plan_file is not None else "",
            transform=self.transform,
        )


@record
class RankPlan:
    """A rank's open checkpoint, key, shard plan and slab layout: computed once per load, then passed on.
    ``facts``: what the key took from the files and their identity before they were read, when that identity
    proves the key to engines (docs/protocol.md §4.3.1), else None."""

    checkpoint: Checkpoint
    key: WeightCacheKey
    plan: ShardPlan | None
    layout: Layout
    spec: RankSpec
    facts: KeyFacts | None = None

    def close(self) -> None:
        self.checkpoint.close()

    def __enter__(self) -> RankPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plan_rank(spec: RankSpec | PathLike, **fields: Any) -> RankPlan:
    """Headers, key, plan and layout of one rank; raises CheckpointError / ShardingError before any data.

    ``spec``: a RankSpec, or a checkpoint directory with RankSpec's fields as keywords (``tp_rank=``...).
    The plan holds the checkpoint's open descriptors (``checkpoint.fd``): the key's fingerprint was
    read through them and the loader reads the data through them, so the bytes served are those of
    the files validated here even if the directory changes meanwhile. ``close()`` (or ``with``)
    releases them; an unreferenced plan releases them when collected."""
    from wcache.checkpoint import Checkpoint
    from wcache.layout import plan_layout
    from wcache.sharding import VOCAB_PADDED_TRANSFORMS, resolve_plan

    spec = RankSpec.of(spec, **fields)
    files = checkpoint_files(spec.checkpoint)  # before anything is read: what an engine's proof must match
    read_ns = time.time_ns()
    ckpt = Checkpoint.open(spec.checkpoint)
    try:
        plan = resolve_plan(ckpt.architecture, spec.tp_size, spec.plan_file)
        key = WeightCacheKey.from_spec(spec, checkpoint=ckpt, plan=plan)
        layout = plan_layout(
            ckpt,
            tp_rank=spec.tp_rank,
            tp_size=spec.tp_size,
            dtype=key.dtype,
            plan=plan,
            vocab_padding=VOCAB_PADDED_TRANSFORMS.get(spec.transform),
        )
        facts = KeyFacts.recorded(files, read_ns, ckpt, key)
    except BaseException:
        ckpt.close()
        raise
    return RankPlan(ckpt, key, plan, layout, spec, facts)
