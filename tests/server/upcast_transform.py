"""A load-time transform that returns every floating tensor as float32 (an engine that computes in fp32): the
transformed rank is twice the bytes of its planned bf16 layout. ``tests.server.upcast_transform:upcast``."""

from __future__ import annotations

from typing import Any

import torch


def upcast(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
