"""A --transform that waits for a gate file: it marks that the load has reached it (``WCACHE_TEST_GATE_REACHED``),
then returns once ``WCACHE_TEST_GATE`` exists (a load held in the middle, released by the test; 120 s at most)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch


def gate(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    Path(os.environ["WCACHE_TEST_GATE_REACHED"]).touch()
    gate_file = Path(os.environ["WCACHE_TEST_GATE"])
    deadline = time.monotonic() + 120
    while not gate_file.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return tensors
