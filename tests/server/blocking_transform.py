"""A --transform that never returns: it marks that the load has reached it, then blocks (test_cli.py
interrupts a daemon there, in the middle of its start-up)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch


def block(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    Path(os.environ["WCACHE_TEST_LOADING"]).touch()
    threading.Event().wait()
    return tensors
