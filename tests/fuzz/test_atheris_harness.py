"""The atheris harness runs, and holds its invariant for a short campaign (CI keeps it alive)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("fuzz_decoder.py")


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed")
def test_harness_short_campaign(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(HARNESS), "-runs=3000", "-max_len=2048", f"-artifact_prefix={tmp_path}/"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "Done 3000 runs" in out.stderr


def test_invariant_on_seeds_without_atheris() -> None:
    """The same check, on the seeds, runs even where atheris is missing."""
    sys.modules.setdefault("atheris", _FakeAtheris())  # type: ignore[arg-type]
    import importlib

    mod = importlib.import_module("tests.fuzz.fuzz_decoder")
    for seed in mod.seeds():
        mod.test_one_input(seed)
        mod.test_one_input(seed[: len(seed) // 2])


class _FakeAtheris:
    class _Ctx:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *a: object) -> None:
            return None

    def instrument_imports(self) -> _FakeAtheris._Ctx:
        return self._Ctx()
