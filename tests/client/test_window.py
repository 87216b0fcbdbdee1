"""A fetch's window (``client._ahead``: what the engine does while the daemon answers HELLO and GET_STATE): the CUDA
mapping's first-time work done there, and only in an engine where CUDA is up."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from wcache.client import client, cuda


def test_a_fetch_window_prepares_the_cuda_mapping_only_where_cuda_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The window (client._ahead) looks the driver's entry points up in a CUDA engine, and not in a host engine's;
    it runs no torch op (a warm-up of the views' ops there made the window longer and the views no shorter)."""
    done: list[str] = []
    monkeypatch.setattr(cuda, "look_up", lambda: done.append("look_up"))
    ops: list[str] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            ops.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    for up in (False, True):
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda up=up: up)
        timings: dict[str, float] = {}
        with Record():
            client._ahead(timings)()
        assert timings["ahead"] >= 0
    assert done == ["look_up"] and ops == []
