"""wcache/integrations/vllm/__init__.py: the entry point vLLM runs, and what importing the package costs."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.integrations.vllm import ROOT
from wcache.integrations import vllm as plugin


def test_the_entry_point_is_the_packages_register() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["vllm.general_plugins"] == {"wcache": "wcache.integrations.vllm:register"}
    assert callable(plugin.register)


def test_importing_the_package_imports_neither_vllm_nor_the_loader() -> None:
    """The vLLM-free modules are usable (and tested) without vLLM: only register() imports the loader, and
    vLLM with it."""
    code = (
        "import sys, wcache.integrations.vllm; "
        "print(*sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' or m.endswith('vllm.loader')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, cwd=ROOT
    )
    assert out.stdout.split() == []
