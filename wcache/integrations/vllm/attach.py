"""Fetched tensors onto a vLLM model built on meta: found by vLLM's module names, cast as vLLM's weight loaders
cast, registered in the parameter classes (and with the attributes) vLLM's post-processing reads, and counted
afterwards. Plain torch: ``weights`` is any name -> tensor mapping (a :class:`~wcache.client.CachedWeights`
for a deposit also has ``aliases`` and ``buffers``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from wcache.errors import IncompatibleModelError
from wcache.integrations.vllm.plan import PLAN_TENSOR, own_tensors

__all__ = [
    "attach_rebuilt",
    "by_module_name",
    "cast_to_built",
    "count_module_state",
    "parameter_attributes",
    "rebuild_names",
    "register_deposit",
    "register_tensor",
    "restore_attributes",
    "restore_parameter_classes",
    "zero_copy_parameters",
]

#: how vLLM's module tree names a tensor the daemon serves under another name (vLLM 0.32 nests FusedMoE's
#: stacked expert weights in a ``routed_experts`` submodule)
MODULE_RENAMES = ((".experts.routed_experts.", ".experts."),)


def _named_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer name of ``model`` with its tensor, a tensor under each of its names."""
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def by_module_name(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The cached tensor for each parameter and buffer name of ``model`` that the cache serves.

    A tensor vLLM registers under several names (a MoE router that is also a submodule of its experts,
    tied embeddings) is found under any of them, and names vLLM's module tree spells differently from the
    daemon's vLLM layout (``MODULE_RENAMES``) are matched; every name of one tensor gets the same cached
    tensor, so ties stay one Parameter."""
    names: dict[int, list[str]] = {}
    for n, t in _named_state(model):
        names.setdefault(id(t), []).append(n)
    out: dict[str, torch.Tensor] = {}
    for group in names.values():
        candidates = [c for n in group for c in (n, *(n.replace(a, b) for a, b in MODULE_RENAMES if a in n))]
        found = next((c for c in candidates if c in weights), None)
        if found is not None:
            out.update(dict.fromkeys(group, weights[found]))
    return out


def cast_to_built(built: Mapping[str, torch.Tensor], found: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``found`` with each floating tensor whose dtype differs from its built parameter's cast to it (an
    owned copy; integer tensors never). vLLM's weight loaders do this cast when they copy a checkpoint
    tensor into the parameter ``create_weights`` made (AWQ's fp16 ``scales`` into the model dtype), and the
    daemon serves quantized checkpoints as stored: the same cast, bit for bit. A tensor under several names
    is cast once."""
    out: dict[str, torch.Tensor] = {}
    made: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    for n, t in found.items():
        p = built.get(n)
        if p is not None and p.dtype != t.dtype and p.is_floating_point() and t.is_floating_point():
            cast = made.get((id(t), p.dtype))
            if cast is None:
                cast = made[(id(t), p.dtype)] = t.to(p.dtype)
            out[n] = cast
        else:
            out[n] = t
    return out


def _like(t: torch.Tensor, built: torch.Tensor) -> nn.Parameter:
    """``t`` as a parameter of ``built``'s class with its attributes: vLLM's quantized layers create
    ``BasevLLMParameter`` subclasses (``PackedvLLMParameter``, ``GroupQuantScaleParameter``) whose
    properties (``input_dim``, ``packed_dim``, ``output_dim``) their post-processing reads."""
    cls = type(built) if isinstance(built, nn.Parameter) else nn.Parameter
    p = torch.Tensor._make_subclass(cls, t.detach(), False)
    p.__dict__.update(vars(built))
    return p


def restore_parameter_classes(model: nn.Module, built: Mapping[str, torch.Tensor]) -> int:
    """After ``attach`` (which makes plain Parameters): every parameter of ``model`` in the class and with
    the attributes of the one vLLM built under that name (``built``); a tensor under several names stays one
    Parameter. Returns how many were re-classed."""
    made: dict[int, nn.Parameter] = {}
    n_made = 0
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        like = built.get(name)
        if like is None:
            continue
        q = made.get(id(p))
        if q is None:
            if type(p) is type(like):
                q = p
            else:
                q = _like(p, like)
                n_made += 1
            made[id(p)] = q
        for a, v in vars(like).items():
            setattr(q, a, v)
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name)._parameters[leaf] = q
    return n_made


def parameter_attributes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The attributes vLLM set on each built parameter (``weight_loader``, ``output_dim``, ...), by name."""
    return {n: dict(vars(p)) for n, p in model.named_parameters(remove_duplicate=False)}


def restore_attributes(model: nn.Module, attrs: Mapping[str, Mapping[str, Any]]) -> None:
    """Give each parameter the attributes its built namesake had (:func:`parameter_attributes`) that it lacks:
    a registered tensor replaced the parameter vLLM built, and its post-processing reads them."""
    for n, p in model.named_parameters(remove_duplicate=False):
        for a, v in attrs.get(n, {}).items():
            if not hasattr(p, a):
                setattr(p, a, v)


def register_tensor(modules: dict[str, nn.Module], name: str, tensor: torch.Tensor, is_param: bool) -> torch.Tensor:
    """Register ``tensor`` under ``name`` whether or not the built model declares it (post-processing may
    have created it), replacing what is there — as vLLM's own daemon loader (``_apply_entries``) does. A
    non-persistent buffer stays non-persistent; ``modules``: the model's modules by name. Returns what was
    registered (a parameter is an ``nn.Parameter``); IncompatibleModelError for a name whose module the
    model lacks (a deposit of another model build)."""
    module_name, _, leaf = name.rpartition(".")
    module = modules.get(module_name)
    if module is None:
        raise IncompatibleModelError(
            f"the deposit names {name!r}, but the model has no module {module_name!r}: it was deposited by "
            "another model build; evict the recipe (wcache evict) or start with deposit: false",
            details={"name": name},
        )
    persistent = leaf not in module._non_persistent_buffers_set
    module._parameters.pop(leaf, None)
    module._buffers.pop(leaf, None)
    module._non_persistent_buffers_set.discard(leaf)
    if is_param:
        p = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)
        module.register_parameter(leaf, p)
        return p
    module.register_buffer(leaf, tensor, persistent=persistent)
    return tensor


def register_deposit(model: nn.Module, weights: Any, clone_buffers: bool) -> dict[str, torch.Tensor]:
    """Register every tensor of a deposit (``weights``: its ``buffers`` as buffers, the rest as parameters,
    its ``aliases`` as the very tensor of their target; the plan tensor not) on ``model``; returns what was
    registered by name. ``clone_buffers`` (zero_copy): buffers are module state vLLM may write at run time
    (attention's k/v scales are filled in place), so they become the engine's own copies, never the read-only
    mapping."""
    modules = dict(model.named_modules(remove_duplicate=False))
    registered: dict[str, torch.Tensor] = {}
    for name in weights:
        if name == PLAN_TENSOR or name in weights.aliases:
            continue
        is_param = name not in weights.buffers
        t = weights[name] if is_param or not clone_buffers else weights[name].clone()
        registered[name] = register_tensor(modules, name, t, is_param)
    for alias, target in weights.aliases.items():
        t = registered[target]
        registered[alias] = register_tensor(modules, alias, t, isinstance(t, nn.Parameter))
    return registered


def rebuild_names(model: nn.Module, plan: Mapping[str, str], registered: Mapping[str, torch.Tensor]) -> set[str]:
    """The parameter and buffer names of the plan's ``rebuild`` modules that the deposit did not give
    (``registered``): their kernels keep their weights in opaque handles, so they come from the checkpoint."""
    rebuild = {n for n, m in plan.items() if m == "rebuild"}
    deposited = {id(t) for t in registered.values()}
    return {
        n
        for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
        if n.rpartition(".")[0] in rebuild and id(t) not in deposited
    }


def _tensor_at(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, leaf = name.rpartition(".")
    t = own_tensors(model.get_submodule(module_name)).get(leaf)
    assert t is not None, name
    return t


def attach_rebuilt(model: nn.Module, checkpoint: Mapping[str, torch.Tensor], wanted: set[str]) -> int:
    """Register the checkpoint tensors (load layout) of the ``wanted`` names (:func:`rebuild_names`): cast as
    vLLM's weight loaders cast, parameters in the class vLLM built them in. Returns how many distinct tensors
    were registered; IncompatibleModelError listing the names the checkpoint lacks that the model has only on
    meta."""
    built = dict(model.named_parameters(remove_duplicate=False))
    found = cast_to_built(built, {n: t for n, t in by_module_name(model, checkpoint).items() if n in wanted})
    lacking = sorted(n for n in wanted if n not in found and _tensor_at(model, n).is_meta)
    if lacking:
        raise IncompatibleModelError(
            f"the checkpoint key lacks {len(lacking)} tensor(s) of modules rebuilt from it: " + ", ".join(lacking[:8]),
            details={"missing": lacking},
        )
    modules = dict(model.named_modules(remove_duplicate=False))
    made: dict[int, torch.Tensor] = {}
    for n, t in found.items():
        obj = made.get(id(t))
        if obj is None and n in built:
            obj = _like(t, built[n])  # vLLM's parameter class: its post-processing reads it
        made[id(t)] = register_tensor(modules, n, obj if obj is not None else t, n in built)
    return len(made)


def zero_copy_parameters(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> int:
    """How many of the module's parameters and buffers still live in the daemon's memory (after vLLM's
    post-processing, which may have replaced some with engine-owned tensors, e.g. oneDNN-packed fp32
    linear weights on CPU)."""
    cached = {weights[n].untyped_storage().data_ptr() for n in weights}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(1 for t in tensors.values() if t.device.type != "meta" and t.untyped_storage().data_ptr() in cached)


def count_module_state(
    model: nn.Module, weights: Mapping[str, torch.Tensor], copied: set[int] | frozenset[int] = frozenset()
) -> dict[str, Any]:
    """Every tensor the model keeps as module state (parameters and buffers, a tied tensor once):
    ``module_state`` of them; ``mapped``: views of the deposit ``weights`` (sharing its storage);
    ``copied``: the engine's own copies of deposited buffers (``copied``: their ids); and the names of the
    others, ``recreated`` (by post-processing: the ``(0,)`` placeholders of modules whose kernels hold
    their weights in opaque handles), with ``recreated_bytes``."""
    deposit = {weights[n].untyped_storage().data_ptr() for n in weights}
    first: dict[int, tuple[str, torch.Tensor]] = {}
    for n, t in _named_state(model):
        if t is not None:
            first.setdefault(id(t), (n, t))
    mapped, copies, recreated, nbytes = 0, 0, [], 0
    for key, (n, t) in first.items():
        if not t.is_meta and t.untyped_storage().data_ptr() in deposit:
            mapped += 1
        elif key in copied:
            copies += 1
        else:
            recreated.append(n)
            nbytes += 0 if t.is_meta else t.numel() * t.element_size()
    return {
        "module_state": len(first),
        "mapped": mapped,
        "copied": copies,
        "recreated": sorted(recreated),
        "recreated_bytes": nbytes,
    }
