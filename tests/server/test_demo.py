"""The README's first command runs ``wcache-demo``: it must keep working (here on the small test checkpoint)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_restarts_engines_and_the_daemon(ckpt: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "wcache.demo", "--model", str(ckpt), "--restarts", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.strip().startswith(("1 ", "2 ", "after "))]
    assert [row[0] for row in rows] == ["1", "2", "after"] and all(row[-1] == "True" for row in rows)
    assert "came back from wcache-keeper in" in r.stdout and "nothing loaded" in r.stdout
