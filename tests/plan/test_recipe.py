"""RecipeKey: the key of deposited weights (docs/protocol.md §4.13)."""

from __future__ import annotations

import pytest

from wcache.plan.key import WeightCacheKey
from wcache.plan.recipe import RecipeKey, key_from_wire

BASE = WeightCacheKey("8f3a", "LlamaForCausalLM", 2, 0, "bfloat16")


def test_recipe_fields_round_trip_and_every_one_must_match() -> None:
    k = RecipeKey.of(BASE, engine="vllm", engine_version="0.11.0", quantization="fp8", postprocess=1)
    wire = k.to_wire()
    assert wire["engine"] == "vllm" and wire["postprocess"] == 1 and wire["fingerprint"] == "8f3a"
    assert key_from_wire(wire) == k and hash(key_from_wire(wire)) == hash(k)
    assert k.diff_wire(wire) == {}
    assert k.diff_wire({**wire, "postprocess": 2}) == {"postprocess": [1, 2]}
    assert k.diff_wire({**wire, "postprocess": "1"}) == {"postprocess": [1, "1"]}  # a type is part of it
    missing = {n: v for n, v in wire.items() if n != "quantization"}
    assert k.diff_wire(missing) == {"quantization": ["fp8", None]}  # no default for a recipe field
    assert set(k.diff_wire(BASE.to_wire())) == {"engine", "engine_version", "quantization", "postprocess"}
    assert set(BASE.diff_wire(wire)) == {"engine", "engine_version", "quantization", "postprocess"}
    assert k != BASE and isinstance(key_from_wire(BASE.to_wire()), WeightCacheKey)
    assert "vllm/fp8" in k.short()


def test_recipe_key_refuses_what_it_cannot_carry() -> None:
    with pytest.raises(ValueError, match="engine"):
        RecipeKey.of(BASE, quantization="fp8")
    with pytest.raises(ValueError, match="checkpoint key fields"):
        RecipeKey.of(BASE, engine="e", dtype="float16")
    with pytest.raises(ValueError, match="string or an integer"):
        RecipeKey.of(BASE, engine="e", fused=True)
    # the bounds of every key on the wire (docs/protocol.md §7), checked before the daemon would refuse it
    with pytest.raises(ValueError, match="at most 64 fields"):
        RecipeKey.of(BASE, engine="e", **{f"f{i}": i for i in range(60)})
    with pytest.raises(ValueError, match="16384 characters"):
        RecipeKey.of(BASE, engine="e", **{f"f{i}": "x" * 1000 for i in range(17)})
    with pytest.raises(ValueError, match="too long"):
        RecipeKey.of(BASE, engine="e", note="x" * 1025)
    assert len(RecipeKey.of(BASE, engine="e", **{f"f{i}": i for i in range(54)}).to_wire()) == 64  # the limit itself
