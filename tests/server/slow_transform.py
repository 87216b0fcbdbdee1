"""A transform that takes ``WCACHE_TEST_SLOW_S`` seconds (default 3): a load still running while something else
happens (tests/server/test_takeover.py). ``--transform tests.server.slow_transform:slow`` with the repository on
the daemon's PYTHONPATH."""

from __future__ import annotations

import os
import time
from typing import Any


def slow(tensors: Any, config: Any) -> Any:
    time.sleep(float(os.environ.get("WCACHE_TEST_SLOW_S", "3")))
    return tensors
