"""The README's first command runs ``wcache-demo``: it must keep working (here on the small test checkpoint)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from wcache.demo import DEMO_SHAPE, build_parser


def test_demo_restarts_engines_and_the_daemon(ckpt: Path, tmp_path: Path) -> None:
    """Run as the console script runs it (``-P``: the working directory not on the import path), from a directory
    holding one named ``wcache`` (a newcomer's clone beside where they run it): the keeper, daemon and engines it
    starts must not import that directory instead of the installed package."""
    (tmp_path / "wcache").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # wcache as installed, not the repository's
    r = subprocess.run(
        [sys.executable, "-P", "-m", "wcache.demo", "--model", str(ckpt), "--restarts", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.strip().startswith(("1 ", "2 ", "after "))]
    assert [row[0] for row in rows] == ["1", "2", "after"] and all(row[-1] == "True" for row in rows)
    assert "came back from wcache-keeper in" in r.stdout and "nothing loaded" in r.stdout
    assert "first touch of fresh memory" in r.stdout  # the copy column is explained, with its own figures


def test_every_demo_option_is_explained() -> None:
    missing = [a.option_strings for a in build_parser()._actions if a.dest != "help" and not a.help]
    assert missing == []


def test_the_size_the_readme_quotes_is_the_demo_checkpoints() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"It builds a {DEMO_SHAPE.nbytes() / 1e6:.0f} MB Llama-shaped checkpoint" in readme


def test_an_unusable_device_is_one_line_before_anything_is_built(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "wcache.demo", "--device", "cuda:x"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr and "built a" not in r.stdout
    assert r.stderr.strip().startswith("wcache-demo: --device must be cpu, cuda or cuda:K")
