"""Tests of wcache/integrations/vllm/, module by module, and the plugin inside a real vLLM.

What needs no vLLM (the recipe key, the post-processing observation and plan on plain torch modules, the casts
and registration, the refusals given plain configs) runs in the main test run. What needs vLLM calls
:func:`require_vllm`: a skip where vLLM is not installed, a failure in the vLLM job (``WCACHE_REQUIRE_VLLM=1``,
.ci/vllm.sh). The engine scripts (``engine.py``, ``quant_engine.py``) run as modules (``python -m``): run as
files, their directory would come first on ``sys.path``, and this package would shadow vLLM itself.
"""

from __future__ import annotations

import getpass
import importlib
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

#: the repository root: the engine processes run there, with it on PYTHONPATH (their workers import the tests)
ROOT = Path(__file__).parents[3]


def require_vllm(module: str = "vllm") -> Any:
    """``module`` of vLLM (a module: Any, as vLLM has no type stubs here); a skip without vLLM, a failure instead under ``WCACHE_REQUIRE_VLLM=1``."""
    if os.environ.get("WCACHE_REQUIRE_VLLM") == "1":
        return importlib.import_module(module)  # the vLLM job: a missing vLLM is a failure, not a skip
    import pytest  # here: the engine processes import this package too

    return pytest.importorskip(module)


#: the job's ``sitecustomize`` (vLLM's AMX kernels off: site/sitecustomize.py says why)
SITE = Path(__file__).with_name("site")


#: the temp directory of this test process's engine processes (``engine_tmp``), made on first use
_engine_tmp: Path | None = None


def engine_tmp() -> Path:
    """The temp directory (``TMPDIR``) every engine process of this test process gets: vLLM puts its ZMQ sockets
    (``VLLM_RPC_BASE_PATH``, one per engine core's channel) and its process group's ``FileStore`` (``vllm_dist_*``)
    in the temp directory and leaves them there (124 sockets and 6 files a job); this one is removed when the test
    session ends (``tests/conftest.py``)."""
    global _engine_tmp
    if _engine_tmp is None:
        _engine_tmp = Path(tempfile.mkdtemp(prefix="vllm-engines-"))
    return _engine_tmp


def remove_engine_tmp() -> None:
    """Remove ``engine_tmp``'s directory, if this process made one."""
    global _engine_tmp
    if _engine_tmp is not None:
        shutil.rmtree(_engine_tmp, ignore_errors=True)
        _engine_tmp = None


def engine_env(**extra: str) -> dict[str, str]:
    """The environment of an engine process: vLLM's CPU KV cache at 1 GiB, the repository importable, the job's
    ``sitecustomize`` (``SITE``) first, and ``engine_tmp`` for its temp files (torch's compile cache where it
    would be without it)."""
    tmp = engine_tmp()
    inductor = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TMPDIR": str(tmp),
        "VLLM_RPC_BASE_PATH": str(tmp),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(inductor)),
        **extra,
    }


def avx2_kernels() -> bool:
    """Whether vllm-cpu runs its AVX2 kernel library here: an x86 CPU without AVX-512 (vLLM's own rule,
    ``CpuPlatform.import_kernels``). That build has no WNA16 GEMM (``cpu_gemm_wna16``: AWQ, GPTQ and compressed-tensors
    4-bit do not run), and there oneDNN builds no bf16 matmul, so vLLM keeps dense linears' weights for torch's
    linear instead of packing them into handles (seen on an AVX2-only AMD EPYC, 2026-12-04)."""
    import torch

    return platform.machine() in ("x86_64", "AMD64") and not torch.cpu._is_avx512_supported()
