"""The load's progress bar (docs/architecture.md, "Libraries"): drawn on the stream it is given, ending on the
whole load and a newline; with none given, on stderr only if that is a TTY — a daemon under systemd (stderr the
journal) writes nothing but its log lines."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from wcache.plan.checkpoint import Checkpoint
from wcache.plan.layout import plan_layout
from wcache.server.backends.host import HostBackend
from wcache.server.loader import load_into


def _load(ckpt: Path, progress: io.StringIO | None) -> int:
    lay = plan_layout(Checkpoint.open(ckpt), tp_rank=0, tp_size=1, dtype="bfloat16", plan=None)
    slab = HostBackend().allocate(lay.total_bytes)
    try:
        return load_into(lay, slab, threads=2, progress=progress).bytes_read
    finally:
        slab.close()


def test_the_bar_ends_on_the_whole_load(ckpt: Path) -> None:
    out = io.StringIO()
    total = _load(ckpt, out)
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1  # redrawn in place, one line when done
    gb = f"{total / 1e9:.2f}"
    assert f"[{'#' * 30}] {gb:>6}/{gb} GB" in text.rsplit("\r", 1)[-1]


def test_no_bar_without_a_tty(ckpt: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert not sys.stderr.isatty()  # pytest's capture
    _load(ckpt, None)
    assert capfd.readouterr().err == ""
