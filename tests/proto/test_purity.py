"""wcache/proto is pure: no asyncio, socket or torch, directly or through what it imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PROTO = Path(__file__).resolve().parents[2] / "wcache" / "proto"
FORBIDDEN = {"asyncio", "socket", "torch", "selectors", "threading", "uvloop", "pickle", "numpy"}
ALLOWED_WCACHE = {"wcache.proto", "wcache.errors", "wcache.error_codes"}


def test_no_forbidden_imports_in_source() -> None:
    files = sorted(PROTO.glob("*.py"))
    assert files
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in FORBIDDEN, f"{f.name} imports {n}"
                if n.startswith("wcache"):
                    assert any(n == a or n.startswith(a + ".") for a in ALLOWED_WCACHE), f"{f.name} imports {n}"


def test_importing_proto_loads_no_io_or_torch() -> None:
    # threading is left out: Python's import machinery (editable installs) may load it
    code = (
        "import sys, wcache.proto, wcache.proto.examples; "
        f"bad = sorted(m for m in {sorted(FORBIDDEN - {'threading'})!r} if m in sys.modules); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
