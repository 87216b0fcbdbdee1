"""wcache/integrations/vllm/deposit.py: what a deposit of a post-processed model carries, and the write-back into
a real daemon (host backend) — on plain torch modules, without vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.conftest import DaemonProc
from wcache import WCacheClient, WeightCacheKey
from wcache.errors import IncompatibleModelError
from wcache.integrations.vllm.deposit import deposit_tensors, write_back
from wcache.integrations.vllm.info import INFO_ATTR
from wcache.integrations.vllm.plan import PLAN_ATTR, PLAN_TENSOR, decode_plan
from wcache.plan.recipe import RecipeKey


def _layer() -> nn.Linear:
    m = nn.Linear(3, 4, bias=False)
    m.weight.requires_grad_(False)
    return m


def _model() -> Any:
    """``a`` keeps its weight and a buffer (rerun), ``b`` is rebuilt from the checkpoint, ``tied`` shares a's weight."""
    model: Any = nn.ModuleDict({"a": _layer(), "b": _layer(), "tied": nn.Module()})
    model["tied"].weight = model["a"].weight  # a tie: one tensor, two names
    model["a"].register_buffer("scale", torch.full((1,), 0.5))
    model["b"].register_buffer("scale", torch.ones(1))
    model["b"].register_buffer("never", torch.empty(2, device="meta"))
    return model


def test_a_deposit_carries_module_state_but_not_what_is_rebuilt() -> None:
    model = _model()
    plan = {"a": "rerun", "b": "rebuild"}
    tensors, kinds, left_out = deposit_tensors(model, plan)
    assert set(tensors) == {"a.weight", "a.scale", "tied.weight", PLAN_TENSOR}
    assert tensors["tied.weight"] is tensors["a.weight"]  # the client makes it an alias
    assert sorted(left_out) == ["b.never", "b.scale", "b.weight"]
    assert kinds == {"a.scale": "buffer", PLAN_TENSOR: "buffer"}
    assert decode_plan(tensors[PLAN_TENSOR]) == plan
    with pytest.raises(IncompatibleModelError, match="not a post-processing plan"):
        decode_plan(torch.frombuffer(bytearray(b'{"version": 9}'), dtype=torch.uint8))


def test_a_dtype_the_protocol_does_not_carry_is_left_out() -> None:
    model: Any = nn.ModuleDict({"a": _layer()})
    model["a"].register_buffer("mask", torch.zeros(2, dtype=torch.complex64))
    tensors, _, left_out = deposit_tensors(model, {"a": "rerun"})
    assert "a.mask" not in tensors and left_out == ["a.mask"]


def _recipe(ckpt: Path) -> RecipeKey:
    return RecipeKey.of(WeightCacheKey.from_checkpoint(ckpt), engine="vllm", engine_version="test", postprocess="t")


def test_write_back_deposits_the_observed_state_into_the_daemon(daemon: DaemonProc, ckpt: Path) -> None:
    model, key = _model(), _recipe(ckpt)
    model.__dict__[PLAN_ATTR] = {"a": "rerun", "b": "rebuild"}
    assert write_back(model, key, WCacheClient(daemon.socket), timeout=30.0)
    record = model.__dict__[INFO_ATTR]["deposit"]
    assert record["key"] == key.short() and record["tensors"] == 3  # a.weight (its tie an alias), a.scale, the plan
    assert record["modules"] == {"preprocessed": 0, "rerun": 1, "rebuild": 1}
    assert sorted(record["left_out"]) == ["b.never", "b.scale", "b.weight"] and record["bytes"] > 0
    w = WCacheClient(daemon.socket).fetch_sync(key)
    try:
        assert set(w) == {"a.weight", "a.scale", "tied.weight", PLAN_TENSOR}
        assert w.aliases == {"tied.weight": "a.weight"} and w.buffers == {"a.scale", PLAN_TENSOR}
        assert torch.equal(w["a.weight"], model["a"].weight) and torch.equal(w["a.scale"], model["a"].scale)
        assert decode_plan(w[PLAN_TENSOR]) == {"a": "rerun", "b": "rebuild"}
    finally:
        w.release_sync()


def test_a_failed_write_back_is_recorded_and_never_raised(tmp_path: Path, ckpt: Path) -> None:
    unobserved = _model()  # post-processing ran outside the observation: no plan to deposit by
    assert not write_back(unobserved, _recipe(ckpt), WCacheClient(tmp_path / "none.sock"), timeout=5.0)
    assert "outside the plugin's observation" in unobserved.__dict__[INFO_ATTR]["deposit"]["error"]
    model = _model()
    model.__dict__[PLAN_ATTR] = {"a": "rerun"}
    assert not write_back(model, _recipe(ckpt), WCacheClient(tmp_path / "none.sock", wait_for_daemon=0), timeout=5.0)
    assert model.__dict__[INFO_ATTR]["deposit"]["error"].startswith("CacheUnavailableError")
