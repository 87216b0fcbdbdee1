"""wcache/integrations/vllm/plan.py on plain torch modules: stand-in quantization methods with vLLM's two hooks
(``process_weights_after_loading(layer)``, ``supports_pre_processed_weights``) are observed, planned and followed
as vLLM's are."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from wcache.errors import IncompatibleModelError
from wcache.integrations.vllm.plan import (
    PLAN_ATTR,
    PLAN_MODES,
    count_modes,
    decode_plan,
    encode_plan,
    following_plan,
    observing,
    plan_postprocessing,
    snapshot_postprocessing,
)


class Method:
    """A stand-in for a vLLM quantization method: ``post`` is what its post-processing does to the layer."""

    def __init__(self, supports: bool = True, post: Callable[[nn.Module], None] | None = None) -> None:
        self.supports_pre_processed_weights = supports
        self.post = post
        self.ran: list[tuple[int, bool]] = []  # (layer id, under already_processed)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.ran.append((id(layer), PROCESSED[0]))
        if self.post is not None:
            self.post(layer)


#: whether the stand-in of vLLM's weights_already_processed() is active
PROCESSED = [False]


@contextlib.contextmanager
def already_processed() -> Iterator[None]:
    PROCESSED[0] = True
    try:
        yield
    finally:
        PROCESSED[0] = False


def is_method(qm: Any) -> bool:
    return isinstance(qm, Method)


def layer(method: Method | None = None, out: int = 4, inp: int = 3) -> nn.Linear:
    m = nn.Linear(inp, out, bias=False)
    m.quant_method = method or Method()  # type: ignore[assignment]
    m.weight.requires_grad_(False)
    return m


def postprocess(model: nn.Module) -> None:
    """vLLM's process_weights_after_loading, as far as module methods go."""
    for module in model.modules():
        qm: Any = getattr(module, "quant_method", None)
        if is_method(qm):
            qm.process_weights_after_loading(module)


def _set(name: str, make: Callable[[], torch.Tensor]) -> Callable[[nn.Module], None]:
    def post(m: nn.Module) -> None:
        setattr(m, name, nn.Parameter(make(), requires_grad=False))

    return post


def test_the_plan_follows_what_post_processing_did_to_each_module() -> None:
    model: Any = nn.ModuleDict(
        {
            "packed": layer(),  # CPU linear: packed into a handle, a (0,) placeholder left
            "kept": layer(),  # embedding / LM head: a handle built, the weight untouched
            "replaced": layer(),  # CPU MoE: prepacked into new tensors, pre-processed weights supported
            "replaced_unsupported": layer(Method(supports=False)),
            "strided": layer(),
            "plain": nn.LayerNorm(3),  # no quantization method: nothing to plan
        }
    )
    before = snapshot_postprocessing(model, is_method)
    assert set(before) == {"packed", "kept", "replaced", "replaced_unsupported", "strided"}
    model["packed"].weight = nn.Parameter(torch.empty(0), requires_grad=False)
    model["replaced"].weight = nn.Parameter(torch.ones(4, 3), requires_grad=False)
    model["replaced_unsupported"].weight = nn.Parameter(torch.ones(4, 3), requires_grad=False)
    model["strided"].weight = nn.Parameter(torch.ones(3, 4).t(), requires_grad=False)
    assert plan_postprocessing(model, before) == {
        "packed": "rebuild",
        "kept": "rerun",
        "replaced": "preprocessed",
        "replaced_unsupported": "rebuild",
        "strided": "rebuild",
    }


def test_a_tensor_created_empty_counts_as_emptied_but_one_empty_before_does_not() -> None:
    model: Any = nn.ModuleDict({"was_empty": layer(), "new_empty": layer()})
    model["was_empty"].register_buffer("scale", torch.empty(0))
    before = snapshot_postprocessing(model, is_method)
    model["new_empty"].register_buffer("handle_placeholder", torch.empty(0))
    assert plan_postprocessing(model, before) == {"was_empty": "rerun", "new_empty": "rebuild"}


def test_observing_leaves_the_plan_on_the_model_and_nothing_when_post_processing_raises() -> None:
    model: Any = nn.ModuleDict({"a": layer(Method(post=_set("weight", lambda: torch.ones(4, 3)))), "b": layer()})
    with observing(model, is_method):
        postprocess(model)
    assert model.__dict__[PLAN_ATTR] == {"a": "preprocessed", "b": "rerun"}
    again: Any = nn.ModuleDict({"a": layer()})
    with pytest.raises(RuntimeError, match="kernel"), observing(again, is_method):
        raise RuntimeError("kernel set-up failed")
    assert PLAN_ATTR not in again.__dict__


def test_following_the_plan_runs_only_preprocessed_modules_under_already_processed() -> None:
    shared = Method()  # one method object for two layers, as vLLM shares one per config
    model: Any = nn.ModuleDict(
        {"moe": layer(Method()), "emb": layer(shared), "lin": layer(shared), "norm": nn.LayerNorm(3)}
    )
    plan = {"moe": "preprocessed", "emb": "rerun", "lin": "rebuild"}
    with following_plan(model, plan, is_method, already_processed) as spent:
        postprocess(model)
    ran = {"moe": model["moe"].quant_method.ran, "shared": shared.ran}
    assert ran["moe"] == [(id(model["moe"]), True)]
    assert sorted(ran["shared"]) == sorted([(id(model["emb"]), False), (id(model["lin"]), False)])
    assert set(spent) == set(PLAN_MODES) and all(ms >= 0 for ms in spent.values())
    # the methods are their classes' own again: a later post-processing is not wrapped
    assert all("process_weights_after_loading" not in vars(m) for m in (shared, model["moe"].quant_method))
    postprocess(model)
    assert model["moe"].quant_method.ran[-1] == (id(model["moe"]), False)


def test_a_plan_that_does_not_fit_the_built_model_is_refused_before_anything_runs() -> None:
    model: Any = nn.ModuleDict({"a": layer(), "b": layer(Method(supports=False))})
    for plan, named in [
        ({"a": "rerun"}, "does not name module 'b'"),  # another model build
        ({"a": "rerun", "b": "preprocessed"}, "does not support pre-processed weights"),  # another vLLM
    ]:
        with (
            pytest.raises(IncompatibleModelError, match=named),
            following_plan(model, plan, is_method, already_processed),
        ):
            postprocess(model)
        assert not model["a"].quant_method.ran and "process_weights_after_loading" not in vars(model["a"].quant_method)


def test_the_plan_tensor_round_trips_and_a_foreign_one_is_refused() -> None:
    plan = {"a": "rerun", "b.c": "rebuild", "d": "preprocessed"}
    t = encode_plan(plan)
    assert t.dtype == torch.uint8 and decode_plan(t) == plan
    assert count_modes(plan) == {"preprocessed": 1, "rerun": 1, "rebuild": 1} and count_modes({})["rerun"] == 0
    for blob in [b'{"version": 9, "modules": {}}', b'{"version": 1, "modules": {"a": "skip"}}', b"not json", b"[]"]:
        with pytest.raises(IncompatibleModelError, match="not a post-processing plan"):
            decode_plan(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
