"""Write-back (docs/protocol.md §4.13): what a deposit of a post-processed vLLM model carries, and the deposit
itself — an optimisation that never fails the load."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from wcache.integrations.vllm.info import INFO_ATTR
from wcache.integrations.vllm.plan import PLAN_ATTR, PLAN_TENSOR, count_modes, encode_plan

if TYPE_CHECKING:
    from wcache.client import WCacheClient
    from wcache.plan.recipe import RecipeKey

__all__ = ["deposit_tensors", "write_back"]

# a child of vLLM's "vllm" logger: vLLM's handler prints it (its loggers do not propagate to the root)
log = logging.getLogger("vllm.wcache")


def deposit_tensors(
    model: nn.Module, plan: dict[str, str]
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """What a deposit of ``model`` carries: every parameter and buffer by module path (a tensor under
    several names once; the client makes the other names aliases), ``kinds`` of the buffers, and the names
    left out (meta tensors, dtypes the protocol does not carry, and the own tensors of ``rebuild`` modules,
    which the next start takes from the checkpoint); the plan tensor added."""
    from wcache.proto.table import DTYPE_SIZES

    modules = dict(model.named_modules())
    rebuilt = {id(modules[n]) for n, mode in plan.items() if mode == "rebuild" and n in modules}
    everything = dict(model.named_modules(remove_duplicate=False))
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    left_out: list[str] = []
    named: list[tuple[str, torch.Tensor, str]] = [
        (n, t, "parameter") for n, t in model.named_parameters(remove_duplicate=False)
    ]
    named += [(n, t, "buffer") for n, t in model.named_buffers(remove_duplicate=False) if t is not None]
    for name, t, kind in named:
        owner = everything[name.rpartition(".")[0]]
        if id(owner) in rebuilt or t.is_meta or str(t.dtype).removeprefix("torch.") not in DTYPE_SIZES:
            left_out.append(name)
            continue
        tensors[name] = t
        if kind == "buffer":
            kinds[name] = "buffer"
    tensors[PLAN_TENSOR] = encode_plan(plan)
    kinds[PLAN_TENSOR] = "buffer"
    return tensors, kinds, left_out


def write_back(model: nn.Module, key: RecipeKey, client: WCacheClient, timeout: float) -> bool:
    """Deposit the model's post-processed state under ``key`` through ``client``, by the plan its observed
    post-processing left (``PLAN_ATTR``). Records the outcome in the model's ``INFO_ATTR`` under
    ``"deposit"``: key, tensors, bytes, ms, left_out, modules per plan mode — or ``error``. Any failure is one
    WARNING and False: the load goes on, and the next start post-processes again."""
    info = model.__dict__.setdefault(INFO_ATTR, {})
    started = time.perf_counter()
    plan = model.__dict__.get(PLAN_ATTR)
    try:
        if plan is None:
            raise RuntimeError("vLLM's post-processing ran outside the plugin's observation")
        tensors, kinds, left_out = deposit_tensors(model, plan)
        done = asyncio.run(client.deposit(key, tensors, kinds=kinds, timeout=timeout))
    except Exception as exc:  # a deposit is an optimisation: never fail the load for it
        info["deposit"] = {"error": f"{type(exc).__name__}: {exc}"}
        log.warning(
            "wcache: deposit of %s failed (%s: %s); the next start post-processes again",
            key.short(),
            type(exc).__name__,
            exc,
        )
        return False
    ms = (time.perf_counter() - started) * 1e3
    info["deposit"] = {
        "key": key.short(),
        "tensors": done.tensors,
        "bytes": done.bytes,
        "ms": ms,
        "left_out": left_out,
        "modules": count_modes(plan),
    }
    log.info(
        "wcache: deposited %s tensors=%d bytes=%d ms=%.1f left_out=%d modules=%s socket=%s",
        key.short(),
        done.tensors,
        done.bytes,
        ms,
        len(left_out),
        info["deposit"]["modules"],
        client.socket_for(key),
    )
    return True
