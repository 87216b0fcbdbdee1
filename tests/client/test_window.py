"""A fetch's window (``client._ahead``: what the engine does while the daemon answers HELLO and GET_STATE): the CUDA
mapping's first-time work done there, and only in an engine where CUDA is up."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from wcache.client import client, cuda, mapping


def test_a_fetch_window_prepares_the_cuda_mapping_only_where_cuda_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The window (client._ahead) looks the driver's entry points up and builds torch's parsers for the views' ops
    in a CUDA engine; a host engine's does neither (its first torch.empty would cost what the warm-up saves)."""
    done: list[str] = []
    monkeypatch.setattr(cuda, "look_up", lambda: done.append("look_up"))
    monkeypatch.setattr(mapping, "warm", lambda: done.append("warm"))
    for up in (False, True):
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda up=up: up)
        timings: dict[str, float] = {}
        client._ahead(timings)()
        assert timings["ahead"] >= 0
    assert done == ["look_up", "warm"]


def test_warm_runs_the_views_ops_on_nothing() -> None:
    """mapping.warm runs the ops the views are cut with (view to a dtype, as_strided, unbind), on an empty tensor."""
    seen: list[tuple[str, int]] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            seen.append(
                (getattr(func, "__name__", str(func)), sum(t.numel() for t in args if isinstance(t, torch.Tensor)))
            )
            return out

    with Record():
        mapping.warm()
    assert {"view", "as_strided", "unbind"} <= {name for name, _ in seen}
    assert all(n == 0 for _, n in seen)
