"""The client's name -> view mapping: lazy per group, stacked group views, aliases (no daemon)."""

from __future__ import annotations

import pytest
import torch

from wcache.client.mapping import TensorViews
from wcache.proto import TensorEntry, TensorTable


def table_and_base() -> tuple[TensorTable, torch.Tensor, dict[str, torch.Tensor]]:
    """12 expert tensors (one group), a norm, and a float32 tensor, in one uint8 slab."""
    expected: dict[str, torch.Tensor] = {}
    entries = []
    slab = torch.zeros(1 << 16, dtype=torch.uint8)
    off = 0
    g = torch.Generator().manual_seed(0)
    for i in range(12):
        t = torch.randn(4, 8, generator=g).to(torch.bfloat16)
        name = f"model.layers.0.mlp.experts.{i}.w1.weight"
        slab[off : off + t.numel() * 2] = t.reshape(-1).view(torch.uint8)
        entries.append(TensorEntry(name, "bfloat16", (4, 8), (8, 1), 0, off))
        expected[name] = t
        off += 128  # 64 bytes of data, 64 bytes of padding: a constant step
    for name, t in [("model.norm.weight", torch.randn(8, generator=g).to(torch.bfloat16)), ("scale", torch.randn(3))]:
        slab[off : off + t.numel() * t.element_size()] = t.reshape(-1).view(torch.uint8)
        dt = "bfloat16" if t.dtype == torch.bfloat16 else "float32"
        entries.append(TensorEntry(name, dt, tuple(t.shape), (1,), 0, off))
        expected[name] = t
        off += 256
    return TensorTable.from_entries(entries), slab, expected


def test_views_are_built_per_group_on_first_lookup() -> None:
    table, slab, expected = table_and_base()
    assert len(table.groups) == 3 and table.groups[0].length == 12
    v = TensorViews(table, {"lm_head.weight": "model.norm.weight"}, [slab])
    assert all(x is None for x in v._views)  # a fetch builds no per-name tensor
    t = v["model.layers.0.mlp.experts.5.w1.weight"]
    assert torch.equal(t, expected["model.layers.0.mlp.experts.5.w1.weight"])
    assert v._views[0] is not None and v._views[1] is None and v._views[2] is None
    assert v["model.layers.0.mlp.experts.5.w1.weight"] is t  # cut once, then cached
    assert t.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()  # a view, no copy


def test_every_name_alias_and_order() -> None:
    table, slab, expected = table_and_base()
    v = TensorViews(table, {"lm_head.weight": "model.norm.weight"}, [slab])
    assert list(v) == [*table.names, "lm_head.weight"] and len(v) == len(expected) + 1
    for name, t in expected.items():
        assert v[name].dtype == t.dtype and torch.equal(v[name], t), name
    assert v["lm_head.weight"] is v["model.norm.weight"]
    not_a_name: object = 3
    assert "lm_head.weight" in v and "nope" not in v and not_a_name not in v
    with pytest.raises(KeyError):
        v["nope"]


def test_groups_are_stacked_views_matching_the_names() -> None:
    table, slab, expected = table_and_base()
    v = TensorViews(table, {}, [slab])
    groups = v.groups()
    assert [len(g.names) for g in groups] == [12, 1, 1]
    experts = groups[0]
    assert experts.tensor.shape == (12, 4, 8) and experts.tensor.dtype == torch.bfloat16
    for j, name in enumerate(experts.names):
        assert torch.equal(experts.tensor[j], expected[name])
    assert groups[2].tensor.shape == (1, 3) and torch.equal(groups[2].tensor[0], expected["scale"])
    assert all(x is None for x in v._views)  # stacked access builds no per-name tensors


def test_materialize_builds_everything() -> None:
    table, slab, _ = table_and_base()
    v = TensorViews(table, {}, [slab])
    v.materialize()
    assert all(x is not None for x in v._views)


@pytest.mark.parametrize("length", [1 << 16, (1 << 16) - 3, (1 << 16) - 2])
def test_a_slab_of_any_length_gives_every_dtype_its_views(length: int) -> None:
    """A slab's bytes need not be a multiple of an element size (the typed base is cut to one only then)."""
    table, slab, expected = table_and_base()
    v = TensorViews(table, {}, [slab[:length]])
    for name, t in expected.items():
        assert v[name].dtype == t.dtype and torch.equal(v[name], t), name
