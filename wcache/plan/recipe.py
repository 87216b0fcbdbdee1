"""The key of deposited weights: a rank's checkpoint key plus the engine's recipe (docs/protocol.md §4.13).

What an engine deposits is what it runs after its own post-processing, so the key must name everything
that shaped those bytes beyond the checkpoint: the engine and its version, the quantization method and a
hash of its config, the post-processing's own version, the device type and capability. Those fields are
the engine's to choose (``engine`` is required); the daemon keeps every one and a GET_STATE maps the
deposit only by naming each with the same value — a plain checkpoint key, or another recipe, gets
``KEY_MISMATCH`` naming the fields that differ.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from wcache.errors import ProtocolError
from wcache.plan.key import KeyValue, WeightCacheKey
from wcache.proto.fields import Key

__all__ = ["RECIPE_FIELDS", "RecipeKey", "key_from_wire"]

#: The recipe fields an engine conventionally names (any others it sends are kept the same way).
RECIPE_FIELDS = (
    "engine",
    "engine_version",
    "quantization",
    "quant_config",
    "postprocess",
    "device_type",
    "device_capability",
)
_BASE = frozenset(f.name for f in fields(WeightCacheKey))


@dataclass(frozen=True, slots=True)
class RecipeKey(WeightCacheKey):
    """A WeightCacheKey plus ``recipe``: every non-checkpoint field of the wire key, sorted by name.

    Never equal to a WeightCacheKey (dataclass equality compares the class), so a deposit and the raw
    checkpoint it came from are two models of one daemon."""

    recipe: tuple[tuple[str, KeyValue], ...] = ()

    @classmethod
    def of(cls, base: WeightCacheKey, **recipe: KeyValue) -> RecipeKey:
        """The recipe key of ``base`` (a rank's checkpoint key) as post-processed by the engine ``recipe``
        names: at least ``engine``; conventionally the fields of RECIPE_FIELDS. ValueError for a field
        that would shadow a checkpoint field, no engine, or a key over the protocol's bounds (64 fields,
        16,384 characters)."""
        if not recipe.get("engine"):
            raise ValueError("a recipe key needs a non-empty engine= (the engine that post-processed the weights)")
        clash = sorted(set(recipe) & _BASE)
        if clash:
            raise ValueError(f"recipe fields {clash} are checkpoint key fields; give them in the base key")
        for k, v in recipe.items():
            if not isinstance(v, str | int) or isinstance(v, bool):
                raise ValueError(f"recipe field {k!r} must be a string or an integer, got {type(v).__name__}")
        wire = {**base.to_wire(), **recipe}
        try:  # the bounds every frame's key has (docs/protocol.md §7), by the decoder's own check
            Key().decode("RecipeKey", "key", wire, {})
        except ProtocolError as exc:
            raise ValueError(f"a recipe key the protocol cannot carry: {exc.message}") from None
        return cls.from_wire(wire)

    @property
    def engine(self) -> str:
        return str(dict(self.recipe).get("engine", ""))

    def to_wire(self) -> dict[str, KeyValue]:
        out: dict[str, KeyValue] = {f.name: getattr(self, f.name) for f in fields(WeightCacheKey)}
        out.update(self.recipe)
        return out

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> RecipeKey:
        known = {f.name: m[f.name] for f in fields(WeightCacheKey) if f.name in m}
        return cls(**known, recipe=tuple(sorted((k, v) for k, v in m.items() if k not in _BASE)))

    def diff_wire(self, requested: dict[str, Any]) -> dict[str, list[Any]]:
        """As WeightCacheKey's; a recipe field absent from ``requested`` always differs (no default)."""
        out = WeightCacheKey.diff_wire(WeightCacheKey.from_wire(self.to_wire()), requested)
        served = dict(self.recipe)
        for name in list(out):
            if name in served:
                del out[name]  # the base diff saw it as a field it does not know
        for name, value in served.items():
            want = requested.get(name)
            if want != value or type(want) is not type(value):
                out[name] = [value, want]
        return out

    def short(self) -> str:
        r = dict(self.recipe)
        quant = f"/{r['quantization']}" if r.get("quantization") else ""
        return f"{WeightCacheKey.short(self)}/{r.get('engine', '?')}{quant}"


def key_from_wire(m: dict[str, Any]) -> WeightCacheKey:
    """The key a wire map names: a RecipeKey when it names an ``engine`` (a deposit), else a checkpoint key.
    Adopting handed-over models (takeover, keeper) must use this, or a deposit would come back served
    under its checkpoint's plain key."""
    if "engine" in m:
        return RecipeKey.from_wire(m)
    return WeightCacheKey.from_wire(m)
