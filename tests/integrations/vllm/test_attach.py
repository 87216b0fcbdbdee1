"""wcache/integrations/vllm/attach.py on plain torch modules: fetched tensors found by vLLM's module names, cast
as vLLM's weight loaders cast, registered in vLLM's parameter classes, and counted afterwards. A parameter
subclass with a property stands in for vLLM's ``BasevLLMParameter`` family; a dict with ``aliases`` and
``buffers`` for a fetched deposit."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from wcache.errors import IncompatibleModelError
from wcache.integrations.vllm.attach import (
    attach_rebuilt,
    by_module_name,
    cast_to_built,
    count_module_state,
    parameter_attributes,
    rebuild_names,
    register_deposit,
    register_tensor,
    restore_attributes,
    restore_parameter_classes,
    zero_copy_parameters,
)
from wcache.integrations.vllm.plan import PLAN_TENSOR, encode_plan
from wcache.nn import attach


class Packed(nn.Parameter):
    """Like vLLM's PackedvLLMParameter: made with keyword fields, read through properties."""

    def __new__(cls, data: torch.Tensor, packed_dim: int) -> Packed:
        return super().__new__(cls, data, requires_grad=False)

    def __init__(self, data: torch.Tensor, packed_dim: int) -> None:
        self._packed_dim = packed_dim

    @property
    def packed_dim(self) -> int:
        return self._packed_dim


class Fetched(dict[str, torch.Tensor]):
    """What a fetch of a deposit gives: name -> tensor (aliases included), ``aliases``, ``buffers``."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], aliases: Mapping[str, str] = {}, buffers: Iterable[str] = ()
    ):
        super().__init__({**tensors, **{a: tensors[t] for a, t in aliases.items()}})
        self.aliases = dict(aliases)
        self.buffers = frozenset(buffers)


def _linear(meta: bool = True) -> nn.Linear:
    with torch.device("meta" if meta else "cpu"):
        m = nn.Linear(3, 4, bias=False)
    m.weight.requires_grad_(False)
    return m


def test_deposited_names_are_registered_even_where_the_built_model_lacks_them() -> None:
    model: Any = nn.ModuleDict({"layer": _linear(meta=False)})
    model["layer"].register_buffer("cache", torch.zeros(2), persistent=False)
    modules = dict(model.named_modules(remove_duplicate=False))
    new = register_tensor(modules, "layer.w13_weight_packed", torch.ones(5), True)  # created by post-processing
    assert isinstance(new, nn.Parameter) and model["layer"].w13_weight_packed is new
    register_tensor(modules, "layer.cache", torch.ones(2), False)
    assert "layer.cache" not in model.state_dict()  # still non-persistent
    assert torch.equal(dict(model.named_buffers())["layer.cache"], torch.ones(2))
    register_tensor(modules, "layer.weight", torch.ones(4, 3), False)  # a parameter replaced by a buffer
    assert "weight" not in model["layer"]._parameters and torch.equal(model["layer"].weight, torch.ones(4, 3))
    with pytest.raises(IncompatibleModelError, match="no module 'missing'"):
        register_tensor(modules, "missing.weight", torch.ones(1), True)


def test_cached_tensors_are_found_under_every_name_and_vllms_expert_nesting() -> None:
    model: Any = nn.ModuleDict({"embed": nn.Embedding(4, 2), "head": nn.Linear(2, 4, bias=False)})
    model["head"].weight = model["embed"].weight  # tied: vLLM registers one tensor under two names
    experts = nn.Module()
    experts.register_parameter("w13_weight", nn.Parameter(torch.zeros(2, 2)))
    moe = nn.Module()
    moe.routed_experts = experts  # vLLM 0.32's FusedMoE nesting
    model["mlp"] = nn.ModuleDict({"experts": moe})
    cached = {"head.weight": torch.ones(4, 2), "mlp.experts.w13_weight": torch.full((2, 2), 2.0)}  # the daemon's
    found = by_module_name(model, cached)
    assert set(found) == {"embed.weight", "head.weight", "mlp.experts.routed_experts.w13_weight"}
    assert found["embed.weight"] is found["head.weight"] is cached["head.weight"]  # the tie: under its other name
    assert found["mlp.experts.routed_experts.w13_weight"] is cached["mlp.experts.w13_weight"]
    assert by_module_name(model, {}) == {}


def test_floating_tensors_are_cast_to_the_built_dtype_once_and_integers_never() -> None:
    built = {n: torch.empty(2, dtype=torch.bfloat16, device="meta") for n in ("scales", "tied", "qweight", "same")}
    built["qweight_int"] = torch.empty(2, dtype=torch.int32, device="meta")
    fp16, packed = torch.tensor([1.5, -2.25], dtype=torch.float16), torch.tensor([7, 9], dtype=torch.int32)
    same = torch.ones(2, dtype=torch.bfloat16)
    out = cast_to_built(built, {"scales": fp16, "tied": fp16, "qweight": packed, "qweight_int": packed, "same": same})
    assert out["scales"].dtype == torch.bfloat16 and torch.equal(out["scales"], fp16.to(torch.bfloat16))
    assert out["tied"] is out["scales"]  # one tensor under two names: one cast, still one tensor
    assert out["scales"].untyped_storage().data_ptr() != fp16.untyped_storage().data_ptr()  # an owned copy
    assert out["qweight"] is packed and out["qweight_int"] is packed and out["same"] is same
    assert cast_to_built({}, {"unbuilt": fp16})["unbuilt"] is fp16


def test_parameters_get_back_vllms_class_and_attributes_after_attach() -> None:
    model: Any = nn.ModuleDict({"a": _linear(), "tied": nn.Module()})
    model["a"].weight = Packed(torch.empty(4, 3, device="meta"), packed_dim=1)
    model["a"].weight.weight_loader = print  # what vLLM sets on each parameter
    model["tied"].weight = model["a"].weight
    built = dict(model.named_parameters(remove_duplicate=False))
    cached = torch.arange(12.0).reshape(4, 3)
    attach(model, {"a.weight": cached, "tied.weight": cached})
    assert type(model["a"].weight) is nn.Parameter
    assert restore_parameter_classes(model, built) == 1  # the tie re-classed once
    p: Any = model["a"].weight
    assert type(p) is Packed and p.packed_dim == 1 and vars(p)["weight_loader"] is print and model["tied"].weight is p
    assert p.untyped_storage().data_ptr() == cached.untyped_storage().data_ptr()  # still a view, not a copy
    assert restore_parameter_classes(model, built) == 0


def test_a_deposit_is_registered_with_its_buffers_copied_in_zero_copy_mode() -> None:
    model: Any = nn.ModuleDict({"a": _linear(), "tied": nn.Module()})
    model["a"].weight.output_dim = 0
    model["tied"].weight = model["a"].weight
    attrs = parameter_attributes(model)
    weight, scale = torch.ones(4, 3), torch.full((1,), 0.5)
    plan = encode_plan({"a": "rerun"})
    deposit = Fetched(
        {"a.weight": weight, "a.k_scale": scale, PLAN_TENSOR: plan},
        {"tied.weight": "a.weight"},
        {"a.k_scale", PLAN_TENSOR},
    )
    registered = register_deposit(model, deposit, clone_buffers=True)
    assert set(registered) == {"a.weight", "a.k_scale", "tied.weight"}  # the plan is not module state
    assert model["tied"].weight is model["a"].weight and torch.equal(model["a"].weight, weight)
    assert model["a"].weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()  # a view
    assert model["a"].k_scale.untyped_storage().data_ptr() != scale.untyped_storage().data_ptr()  # the engine's own
    assert not hasattr(model["a"].weight, "output_dim")
    restore_attributes(model, attrs)
    assert model["a"].weight.output_dim == 0
    kept: Any = nn.ModuleDict({"a": _linear()})
    register_deposit(kept, Fetched({"a.k_scale": scale}, buffers={"a.k_scale"}), clone_buffers=False)  # copy mode
    assert kept["a"].k_scale is scale
    with pytest.raises(IncompatibleModelError, match="another model build"):
        register_deposit(kept, Fetched({"b.weight": weight}), clone_buffers=False)


def _rebuilt_model() -> tuple[Any, dict[str, torch.Tensor]]:
    """``lin`` rebuilt from the checkpoint (its weight in vLLM's class), ``emb`` mapped from the deposit."""
    model: Any = nn.ModuleDict({"lin": _linear(), "emb": _linear()})
    model["lin"].weight = Packed(torch.empty(4, 3, device="meta"), packed_dim=0)
    model["lin"].register_buffer("zp", torch.zeros(1))  # computed at init: real, not meta
    registered = register_deposit(model, Fetched({"emb.weight": torch.ones(4, 3)}), clone_buffers=False)
    return model, registered


def test_rebuilt_modules_take_the_checkpoint_tensors_in_vllms_parameter_class() -> None:
    model, registered = _rebuilt_model()
    wanted = rebuild_names(model, {"lin": "rebuild", "emb": "rerun"}, registered)
    assert wanted == {"lin.weight", "lin.zp"}
    ckpt = {"lin.weight": torch.full((4, 3), 3.0, dtype=torch.float16), "emb.weight": torch.zeros(4, 3)}
    assert attach_rebuilt(model, ckpt, wanted) == 1  # lin.zp: not in the checkpoint, but real, so kept
    p = model["lin"].weight
    assert (
        type(p) is Packed and p.packed_dim == 0 and p.dtype == torch.float32 and torch.equal(p, torch.full((4, 3), 3.0))
    )
    assert torch.equal(model["emb"].weight, torch.ones(4, 3))  # the deposit's, not the checkpoint's
    model, registered = _rebuilt_model()
    with pytest.raises(IncompatibleModelError, match=r"lacks 1 tensor\(s\).*lin.weight") as exc:
        attach_rebuilt(model, {}, rebuild_names(model, {"lin": "rebuild"}, registered))
    assert exc.value.details["missing"] == ["lin.weight"]


def test_what_the_model_keeps_is_counted_against_the_daemons_memory() -> None:
    slab = torch.zeros(32)
    weights: dict[str, Any] = {"a.weight": slab[:12].view(4, 3), "b.weight": slab[12:24].view(4, 3)}
    model: Any = nn.ModuleDict({"a": _linear(), "b": _linear(), "c": _linear()})
    model["a"].weight = nn.Parameter(weights["a.weight"], requires_grad=False)  # still a view of the daemon's memory
    model["b"].weight = nn.Parameter(torch.empty(0), requires_grad=False)  # post-processing's placeholder
    model["c"].weight = nn.Parameter(torch.ones(2, 2), requires_grad=False)
    model["a"].register_buffer("scale", torch.ones(1))  # the engine's copy of a deposited buffer
    assert zero_copy_parameters(model, weights) == 1
    counts = count_module_state(model, weights, copied={id(model["a"].scale)})
    assert counts == {
        "module_state": 4,
        "mapped": 1,
        "copied": 1,
        "recreated": ["b.weight", "c.weight"],
        "recreated_bytes": 16,
    }
