"""The planner: what can be known of one rank (a ``RankSpec``, wcache.plan.key) without reading tensor data
(``RankPlan``), the one module that composes the others of wcache.plan.

``plan_rank(spec)`` reads the headers and the fingerprint once; the daemon's budget check, its "already
held" check and its loader all use that one ``RankPlan``.
"""

from __future__ import annotations

import os
import time

from wcache.errors import CheckpointError, ShardingError
from wcache.plan.checkpoint import Checkpoint, _utf8
from wcache.plan.facts import KeyFacts, checkpoint_files
from wcache.plan.key import RACY_NS, RankSpec, WeightCacheKey
from wcache.plan.layout import Layout, plan_layout
from wcache.plan.sharding import VOCAB_PADDED_TRANSFORMS, ShardPlan, resolve_plan
from wcache.proto._record import record

__all__ = ["RankPlan", "plan_rank"]


@record
class RankPlan:
    """A rank's open checkpoint, key, shard plan and slab layout: computed once per load, then passed on.
    ``facts``: what the key took from the files and their identity before they were read, when that identity
    proves the key to engines (docs/protocol.md §4.3.1), else None. ``proof_after_ns``: where ``facts`` is None
    only because a file changed less than RACY_NS before the read, the time (``time.time_ns()``) after which a
    planning of the same files records them (the daemon plans again then, docs/protocol.md §4.3.1)."""

    checkpoint: Checkpoint
    key: WeightCacheKey
    plan: ShardPlan | None
    layout: Layout
    spec: RankSpec
    facts: KeyFacts | None = None
    proof_after_ns: int | None = None

    def layout_of(self, tp_rank: int, tp_size: int, plan_id: str) -> Layout | None:
        """The layout of this checkpoint's slab for rank ``tp_rank`` of ``tp_size`` under the shard plan ``plan_id``
        (a key's ``plan``), in this rank's dtype: another daemon's slab that the fleet fill reshards from
        (docs/fleet.md, "Resharding"). None for a layout this rank cannot plan: a plan file other than its own, a
        built-in plan the architecture lacks, a size the plan cannot split the tensors into or a rank outside
        ``[0, tp_size)`` (the key comes from a peer's offer: whatever it names is an answer, never an error)."""
        if plan_id == (self.plan.id if self.plan is not None else "none"):
            plan = self.plan  # a plan's rules do not depend on the size: its own plan file serves any
        elif plan_id == "none" or plan_id.startswith("builtin:"):
            try:
                plan = resolve_plan(
                    self.checkpoint.architecture, tp_size, has_config=self.checkpoint.config_raw is not None
                )
            except ShardingError:
                return None
            if plan_id != (plan.id if plan is not None else "none"):
                return None
        else:
            return None
        try:
            return plan_layout(self.checkpoint, tp_rank=tp_rank, tp_size=tp_size, dtype=self.layout.dtype, plan=plan)
        except ShardingError:
            return None

    def close(self) -> None:
        self.checkpoint.close()

    def __enter__(self) -> RankPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plan_rank(spec: RankSpec) -> RankPlan:
    """Headers, key, plan and layout of one rank; raises CheckpointError / ShardingError before any data.

    The plan holds the checkpoint's open descriptors (``checkpoint.fd``): the key's fingerprint was
    read through them and the loader reads the data through them, so the bytes served are those of
    the files validated here even if the directory changes meanwhile. ``close()`` (or ``with``)
    releases them; an unreferenced plan releases them when collected.

    The daemon plans what it will serve: the checkpoint's path travels as a string (STATUS, KEEP, TAKEOVER_STATE's
    ``source``), so a path that is not valid UTF-8 (legal on Linux) is a CheckpointError here, before it is served
    and every one of those frames fails to encode."""
    path = os.fspath(spec.checkpoint)
    if not _utf8(path):
        raise CheckpointError(
            f"{path!r}: the checkpoint's path is not valid UTF-8, and the daemon reports and hands over paths as "
            "strings (docs/protocol.md §2): rename it"
        )
    files = checkpoint_files(spec.checkpoint)  # before anything is read: what an engine's proof must match
    read_ns = time.time_ns()
    ckpt = Checkpoint.open(spec.checkpoint)
    try:
        plan = resolve_plan(ckpt.architecture, spec.tp_size, spec.plan_file, has_config=ckpt.config_raw is not None)
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
    after = None
    if facts is None and files is not None and KeyFacts.racy(files, read_ns):
        after = max(f.ctime_ns for f in files) + RACY_NS
    return RankPlan(ckpt, key, plan, layout, spec, facts, after)
