"""GPU tests need CUDA and cuda-bindings; without them every test here is skipped."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def _why_skip() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("cuda") is None:
        return "cuda-bindings is not installed"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _why_skip()
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
