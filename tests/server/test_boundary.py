"""The backend boundary (issue 19 step 1) and the torch-free daemon start (issue 20, daemon restart).

Everything device-specific lives in wcache/server/backends/ (and wcache/_cuda.py): the loader, the store,
the tier, the daemon and the reclaim check name no device API. No daemon start-up module imports torch at
import time; a daemon serving only what its keeper handed back never imports it.
"""

from __future__ import annotations

import ast
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import DaemonProc
from wcache import WCacheClient
from wcache.plan.key import RankSpec, WeightCacheKey
from wcache.server.process import DaemonProcess

SERVER = Path(__file__).resolve().parents[2] / "wcache" / "server"
SHARED = [SERVER / f"{m}.py" for m in ("loader", "store", "tier", "daemon", "service", "listen", "reclaim")]
#: dotted names and identifiers only a backend may use
DEVICE_NAMES = ("torch.cuda", "cudaHost", "is_cuda", "cuda.bindings", "cuda.cuda", "mem_get_info")
#: modules a daemon imports to start: none may import torch when imported
START_MODULES = [
    "wcache.server.cli",
    "wcache.server.startup",
    "wcache.server.daemon",
    "wcache.server.service",
    "wcache.server.store",
    "wcache.server.loader",
    "wcache.server.tier",
    "wcache.server.reclaim",
    "wcache.server.keeper",
    "wcache.server.keeper_link",
    "wcache.server.backends.host",
    "wcache.server.backends.cuda",
    "wcache._cuda",
    "wcache.plan.rank",
]


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


def _device_uses(path: Path) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            names = [_dotted(node)]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        found += [f"{path.name}:{node.lineno}: {n}" for n in names if any(d in n for d in DEVICE_NAMES)]  # type: ignore[attr-defined]
    return found


def test_shared_server_modules_name_no_device_api() -> None:
    assert all(p.exists() for p in SHARED)
    bad = [u for p in SHARED for u in _device_uses(p)]
    assert bad == [], "device-specific code belongs in wcache/server/backends/: " + "; ".join(bad)


def test_the_check_sees_device_code() -> None:
    """The check above would catch what these modules held before (the CUDA backend still does)."""
    assert any("torch.cuda" in u for u in _device_uses(SERVER / "backends" / "cuda.py"))


def test_no_start_module_imports_torch_at_top_level() -> None:
    """torch is imported inside the functions that need it (a load's casts, transforms, CUDA copies)."""
    for mod in START_MODULES:
        path = Path(__file__).resolve().parents[2] / (mod.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only; `if TYPE_CHECKING:` blocks are not run
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "torch" for a in node.names), f"{mod} imports torch"
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] != "torch", f"{mod} imports from torch"


def test_importing_the_daemon_start_path_loads_no_torch() -> None:
    code = f"import sys\nfor m in {START_MODULES!r}: __import__(m)\nsys.exit(1 if 'torch' in sys.modules else 0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 0, "importing the daemon's start-up modules imported torch\n" + out.stderr


def _maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's libraries mapped (it imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/PID/maps")
async def test_a_daemon_restarted_on_its_keeper_serves_without_torch_and_imports_it_for_a_cast(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], ckpt: Path
) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt)
    first = daemon_factory(ckpt, "--keeper")
    first.stop(signal.SIGKILL)

    second = daemon_factory(ckpt, "--keeper")
    (served,) = (await WCacheClient(second.socket).status()).models
    assert served.key == key.to_wire()
    assert not _maps_torch(second.pid), "a daemon serving only kept models imported torch"
    async with await WCacheClient(second.socket).fetch(key) as w:  # served from the kept slab
        assert w.server.server_pid == second.pid and len(w.keys()) > 0
    assert not _maps_torch(second.pid)

    # a load that needs torch (a dtype cast) imports it then, and is served
    r = await WCacheClient(second.socket).preload(RankSpec(ckpt, dtype="float32"))
    assert r.bytes > served.bytes
    assert _maps_torch(second.pid)
