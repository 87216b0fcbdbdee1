"""vLLM's post-processing, observed module by module, and the plan a deposit carries of it.

A start that deposits watches ``process_weights_after_loading`` (:func:`observing`): the identity, storage,
shape and dtype of each quantized module's own tensors before and after (:func:`snapshot_postprocessing`,
:func:`plan_postprocessing`) decide how a later start that maps the deposit runs that module's method
(``PLAN_MODES``). That start follows the plan (:func:`following_plan`). The plan travels as one deposited
tensor (:func:`encode_plan` / :func:`decode_plan`).

vLLM-free: which modules count is ``is_method`` (vLLM's ``isinstance(qm, QuantizeMethodBase)``), and
``already_processed`` is vLLM's ``weights_already_processed``; plain torch modules with stand-in methods
exercise all of it in the tests."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from wcache.errors import IncompatibleModelError

__all__ = [
    "PLAN_ATTR",
    "PLAN_MODES",
    "PLAN_TENSOR",
    "count_modes",
    "decode_plan",
    "encode_plan",
    "following_plan",
    "observing",
    "own_tensors",
    "plan_postprocessing",
    "snapshot_postprocessing",
]

#: the deposited tensor (uint8, JSON) that says how each module's post-processing runs on a start that maps
#: the deposit: {"version": 1, "modules": {module name: "preprocessed" | "rerun" | "rebuild"}}
PLAN_TENSOR = "_wcache_postprocess"
PLAN_MODES = ("preprocessed", "rerun", "rebuild")
#: the attribute the observed post-processing leaves its plan in (:func:`observing`), for the deposit
PLAN_ATTR = "_wcache_plan"

#: is this a quantization method whose post-processing the plan covers (vLLM's QuantizeMethodBase)?
IsMethod = Callable[[Any], bool]
#: a tensor's identity for the before/after comparison of post-processing: id, storage, shape, dtype, meta
Sig = tuple[int, int, tuple[int, ...], torch.dtype, bool]
Snapshot = dict[str, dict[str, Sig]]


def _sig(t: torch.Tensor) -> Sig:
    ptr = 0 if t.is_meta else t.untyped_storage().data_ptr()
    return (id(t), ptr, tuple(t.shape), t.dtype, t.is_meta)


def own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameters and buffers (not its children's), by leaf name."""
    out: dict[str, torch.Tensor] = {n: t for n, t in module._parameters.items() if t is not None}
    out.update({n: t for n, t in module._buffers.items() if t is not None})
    return out


def snapshot_postprocessing(model: nn.Module, is_method: IsMethod) -> Snapshot:
    """Before post-processing: each module with a quantization method (``is_method(quant_method)``, vLLM's
    ``QuantizeMethodBase``) and the identity of its own tensors."""
    out: Snapshot = {}
    for name, module in model.named_modules():
        if is_method(getattr(module, "quant_method", None)):
            out[name] = {n: _sig(t) for n, t in own_tensors(module).items()}
    return out


def plan_postprocessing(model: nn.Module, before: Snapshot) -> dict[str, str]:
    """After post-processing: how a start that maps the deposit runs each module's post-processing.

    - ``rebuild``: it emptied a tensor (vLLM's CPU linear layers keep the packed weight in a oneDNN /
      sgl-kernel handle and leave a ``(0,)`` placeholder), left one non-contiguous (a deposit is
      contiguous), or replaced tensors with a method that cannot take pre-processed weights: the module's
      own tensors are not deposited; the next start gives it the checkpoint's and post-processes it;
    - ``rerun``: its tensors are the very ones it was given (it only built kernel state from them, like
      the CPU embedding / LM head's handle): it runs again on the deposited bytes, which are the same;
    - ``preprocessed``: it replaced them with new tensors (the CPU MoE's prepacked experts) and its method
      ``supports_pre_processed_weights``: the deposit maps them and it runs under
      ``weights_already_processed()``, rebuilding its Python-side state only."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        if name not in before:
            continue
        was, now = before[name], own_tensors(module)
        emptied = any(t.numel() == 0 and (n not in was or math.prod(was[n][2]) > 0) for n, t in now.items())
        strided = any(not t.is_meta and not t.is_contiguous() for t in now.values())
        if emptied or strided:
            plan[name] = "rebuild"
        elif {n: _sig(t) for n, t in now.items()} == was:
            plan[name] = "rerun"
        elif getattr(module.quant_method, "supports_pre_processed_weights", False):
            plan[name] = "preprocessed"
        else:
            plan[name] = "rebuild"
    return plan


@contextlib.contextmanager
def observing(model: nn.Module, is_method: IsMethod) -> Iterator[None]:
    """Around the model's post-processing: its plan left on the model (``PLAN_ATTR``) for the deposit. Nothing
    is left when the post-processing raises."""
    before = snapshot_postprocessing(model, is_method)
    yield
    model.__dict__[PLAN_ATTR] = plan_postprocessing(model, before)


def count_modes(plan: dict[str, str]) -> dict[str, int]:
    """How many modules the plan gives each mode (every mode named, 0 included): the load and deposit records."""
    modes = list(plan.values())
    return {m: modes.count(m) for m in PLAN_MODES}


def encode_plan(plan: dict[str, str]) -> torch.Tensor:
    """The plan as the deposited ``PLAN_TENSOR``: uint8 bytes of its JSON document."""
    blob = json.dumps({"version": 1, "modules": plan}, sort_keys=True).encode()
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


def decode_plan(t: torch.Tensor) -> dict[str, str]:
    """The plan a deposit carries; IncompatibleModelError for one this plugin cannot follow."""
    try:
        doc = json.loads(bytes(t.detach().cpu().contiguous().numpy().tobytes()).decode())
        plan = doc["modules"]
        ok = doc.get("version") == 1 and isinstance(plan, dict) and all(v in PLAN_MODES for v in plan.values())
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise IncompatibleModelError(
            f"the deposit's {PLAN_TENSOR} is not a post-processing plan this plugin follows; evict the recipe "
            "(wcache evict) or start with deposit: false"
        )
    return {str(k): str(v) for k, v in plan.items()}


def _planned_methods(model: nn.Module, plan: dict[str, str], is_method: IsMethod) -> tuple[dict[int, str], list[Any]]:
    """Each quantized module's plan mode (by module id) and its distinct methods; IncompatibleModelError for
    a module the plan does not name (another model build) or a ``preprocessed`` one whose method cannot take
    pre-processed weights (another vLLM)."""
    modes: dict[int, str] = {}
    methods: dict[int, Any] = {}
    for name, module in model.named_modules():
        qm: Any = getattr(module, "quant_method", None)
        if not is_method(qm):
            continue
        m = plan.get(name)
        if m is None:
            raise IncompatibleModelError(
                f"the deposit's post-processing plan does not name module {name!r}; evict the recipe "
                "(wcache evict) or start with deposit: false"
            )
        if m == "preprocessed" and not qm.supports_pre_processed_weights:
            raise IncompatibleModelError(
                f"{type(qm).__name__} of {name!r} does not support pre-processed weights in this vLLM"
            )
        modes[id(module)] = m
        methods[id(qm)] = qm
    return modes, list(methods.values())


@contextlib.contextmanager
def following_plan(
    model: nn.Module,
    plan: dict[str, str],
    is_method: IsMethod,
    already_processed: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Iterator[dict[str, float]]:
    """Around the model's post-processing on a start that maps a deposit: each module's method
    (``process_weights_after_loading(layer)``) runs as ``plan`` says — ``preprocessed`` under
    ``already_processed()``, ``rerun`` and ``rebuild`` as they are. Yields the ms spent per plan mode, filled
    in as the methods run; the methods are the classes' own again on exit. Raises what
    :func:`_planned_methods` raises, before anything runs."""
    modes, methods = _planned_methods(model, plan, is_method)
    spent = dict.fromkeys(PLAN_MODES, 0.0)

    def wrap(original: Any) -> Any:
        def run(layer: nn.Module) -> Any:
            m = modes[id(layer)]
            t0 = time.perf_counter()
            try:
                if m == "preprocessed":
                    with already_processed():
                        return original(layer)
                return original(layer)
            finally:
                spent[m] += (time.perf_counter() - t0) * 1e3

        return run

    for qm in methods:
        qm.process_weights_after_loading = wrap(qm.process_weights_after_loading)
    try:
        yield spent
    finally:
        for qm in methods:
            del qm.process_weights_after_loading  # the instance attribute: the class's method again
