"""The cache key: which bytes a daemon serves, computed the same way by daemon and engine.

A key names a checkpoint (fingerprint of its file names, headers and a data sample), the rank's
sharding and dtype, and the slab layout version. The daemon refuses a GET_STATE whose
key differs in any field and names those fields (``KEY_MISMATCH``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Union

from wcache.checkpoint import FLOATING, Checkpoint, DtypeBytes
from wcache.errors import (
    CheckpointError,
    KeyMismatchError,
    NotFoundError,
    ShardingError,
    TransformError,
    WCacheError,
    describe_fields,
)
from wcache.proto._record import record
from wcache.proto.frames import MAX_NAME

if TYPE_CHECKING:
    from wcache.rank import RankSpec
    from wcache.sharding import ShardPlan

#: Bump when placement rules change (wcache.layout): a cached slab of another layout is another key. Defined
#: here only — layout.py re-exports it, so the key need not import the layout (tests/test_layout.py).
LAYOUT_VERSION = 2  # 2: quantized checkpoints keep their stored dtypes (docs/protocol.md §4.4)

__all__ = ["WeightCacheKey", "closest", "key_mismatch", "not_served"]

KeyValue = Union[str, int]


class _Unset:
    """``plan`` not given to ``from_spec`` (None is a resolved plan: none)."""


_UNSET = _Unset()


def resolve_dtype(counted: DtypeBytes, config: dict[str, Any], requested: str | None) -> str:
    """The key's ``dtype``: ``None``/``"auto"`` -> the floating dtype holding the most bytes (``counted``:
    ``Checkpoint.dtype_bytes()``); FP8 checkpoints are served as stored, never cast (``wcache.quant``)."""
    from wcache.quant import is_fp8_checkpoint, stored_dtype

    if counted.fp8 or is_fp8_checkpoint({}, config):
        return stored_dtype(counted, requested)
    if requested not in (None, "auto"):
        if requested not in FLOATING:
            raise CheckpointError(f"dtype {requested!r} is not one of auto, {', '.join(sorted(FLOATING))}")
        return str(requested)
    return max(counted.floating, key=counted.floating.__getitem__) if counted.floating else "float32"


#: a key field over the protocol's string limit -> whose input it came from, and what to do
_TOO_LONG: dict[str, tuple[type[WCacheError], str]] = {
    "architecture": (CheckpointError, "shorten config.json's architectures[0]"),
    "plan": (ShardingError, "use a shorter plan id"),
    "transform": (TransformError, "use a shorter module:function path for the transform"),
}


@record
class WeightCacheKey:
    """Identity of one rank's weights. Field names and types are part of the wire format (§4.3)."""

    fingerprint: str
    architecture: str
    tp_size: int
    tp_rank: int
    dtype: str
    plan: str = "none"
    layout: int = LAYOUT_VERSION
    fingerprint_kind: str = "sampled"  # "sampled" (names, headers, 16 data blocks per file) | "content"
    transform: str = ""  # load-time transform spec (wcache.transforms), "" for none

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str] | RankSpec,
        *,
        checkpoint: Checkpoint | None = None,
        **fields: Any,
    ) -> WeightCacheKey:
        """The key a daemon started with the same arguments serves: ``path`` is a RankSpec, or a
        checkpoint directory with RankSpec's fields as keywords (``tp_rank``, ``tp_size``, ``dtype``,
        ``plan_file``, ``transform``, ``verify_content``). See ``from_spec``."""
        from wcache.rank import RankSpec

        return cls.from_spec(RankSpec.of(path, **fields), checkpoint=checkpoint)

    @classmethod
    def from_spec(
        cls, spec: RankSpec, *, checkpoint: Checkpoint | None = None, plan: ShardPlan | _Unset | None = _UNSET
    ) -> WeightCacheKey:
        """The key of one rank. Reads headers and 64 KiB of data per file (all data with
        ``spec.verify_content``), through the descriptors ``checkpoint`` validated them from (a
        checkpoint opened here is closed before returning); ``plan``: the rank's shard plan when the
        caller resolved it already (``wcache.rank.plan_rank``).

        Raises CheckpointError / ShardingError, and for a key string the protocol cannot carry (over
        1024 characters, docs/protocol.md §7) the class of whatever it came from (``_TOO_LONG``)."""
        if checkpoint is None:  # the key's own: headers and bytes per dtype, not a validated entry per tensor
            with Checkpoint.open(spec.checkpoint, tensors=False) as ckpt:
                return cls.from_spec(spec, checkpoint=ckpt, plan=plan)
        ckpt = checkpoint
        if isinstance(plan, _Unset):
            plan = None
            if spec.tp_size != 1 or spec.plan_file is not None:  # else no plan: sharding not imported
                from wcache.sharding import resolve_plan

                plan = resolve_plan(ckpt.architecture, spec.tp_size, spec.plan_file)

        key = cls(
            fingerprint=ckpt.fingerprint(content=spec.verify_content),
            architecture=ckpt.architecture,
            tp_size=spec.tp_size,
            tp_rank=spec.tp_rank,
            dtype=resolve_dtype(ckpt.dtype_bytes(), ckpt.config, spec.dtype),
            plan=plan.id if plan is not None else "none",
            layout=LAYOUT_VERSION,
            fingerprint_kind="content" if spec.verify_content else "sampled",
            transform=spec.transform,
        )
        for name, value in key.to_wire().items():
            if isinstance(value, str) and len(value) > MAX_NAME:
                err, fix = _TOO_LONG.get(name, (CheckpointError, "check the checkpoint's config.json"))
                raise err(
                    f"key field {name!r} is {len(value)} characters; the protocol carries at most {MAX_NAME} "
                    f"(docs/protocol.md §7): {fix}"
                )
        return key

    def to_wire(self) -> dict[str, KeyValue]:
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> WeightCacheKey:
        """Build from a validated wire map; missing fields take their defaults, extra ones are
        ignored here (``diff_wire`` reports them)."""
        known = {name: m[name] for name in _FIELDS if name in m}
        return cls(**known)

    def diff_wire(self, requested: dict[str, Any]) -> dict[str, list[Any]]:
        """Fields where ``requested`` differs from this key: name -> [served, requested].

        A field absent from ``requested`` counts as its default; a field this daemon does
        not know is always a difference (the client expects something we cannot promise).
        """
        served = self.to_wire()
        out: dict[str, list[Any]] = {}
        defaults = _DEFAULTS
        for name, value in served.items():
            want = requested.get(name, defaults[name])
            if want != value or type(want) is not type(value):
                out[name] = [value, requested.get(name)]
        for name in requested:
            if name not in served:
                out[name] = [None, requested[name]]
        return out

    def short(self) -> str:
        """A log-friendly one-liner."""
        return f"{self.architecture or 'model'}@{self.fingerprint[:12]}/tp{self.tp_rank}of{self.tp_size}/{self.dtype}"


_FIELDS = tuple(f.name for f in fields(WeightCacheKey))
_DEFAULTS = {f.name: f.default for f in fields(WeightCacheKey)}


def closest(
    requested: dict[str, Any], keys: Iterable[WeightCacheKey]
) -> tuple[WeightCacheKey, dict[str, list[Any]]] | None:
    """The served key nearest ``requested`` and its ``diff_wire``: the same checkpoint (fingerprint) first, then
    the fewest differing fields, then the last in ``keys`` (a store lists the most recently used last)."""
    best: tuple[tuple[bool, int], WeightCacheKey, dict[str, list[Any]]] | None = None
    for k in keys:
        d = k.diff_wire(requested)
        score = ("fingerprint" in d, len(d))
        if best is None or score <= best[0]:
            best = (score, k, d)
    return None if best is None else (best[1], best[2])


def _served(keys: list[WeightCacheKey]) -> str:
    shown = ", ".join(k.short() for k in keys[:8])
    return shown + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def key_mismatch(requested: dict[str, Any], keys: Iterable[WeightCacheKey]) -> WCacheError:
    """The error a GET_STATE of a key none of ``keys`` equals gets: KEY_MISMATCH naming, per field, the
    requested and the served value of the closest model (NOT_FOUND when nothing is served)."""
    held = list(keys)
    near = closest(requested, held)
    if near is None:
        return NotFoundError("the daemon holds no weights; PRELOAD a model first")
    key, diff = near
    many = f" (closest of {len(held)} served: {_served(held)})" if len(held) > 1 else ""
    return KeyMismatchError(
        f"requested key differs from the served {key.short()}: {describe_fields(diff)}{many}",
        details={"fields": diff, "served": [k.short() for k in held], "closest": key.short()},
    )


def not_served(requested: dict[str, Any], keys: Iterable[WeightCacheKey]) -> NotFoundError:
    """The NOT_FOUND of an EVICT of a key not held: what was asked for, and how it differs from the closest
    served model, per field (``describe_fields``)."""
    held = list(keys)
    near = closest(requested, held)
    asked = f"{requested.get('architecture', '?')}@{str(requested.get('fingerprint', '?'))[:12]}"
    asked += f"/tp{requested.get('tp_rank', '?')}of{requested.get('tp_size', '?')}/{requested.get('dtype', '?')}"
    if near is None:
        return NotFoundError(f"no model is served under the requested key {asked}: this daemon serves none")
    key, diff = near
    return NotFoundError(
        f"no model is served under the requested key {asked}; the closest served, {key.short()}, differs in "
        f"{describe_fields(diff)}" + (f" (served: {_served(held)})" if len(held) > 1 else ""),
        details={"fields": diff, "served": [k.short() for k in held], "closest": key.short()},
    )
