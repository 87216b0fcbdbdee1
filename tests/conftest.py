"""Shared fixtures: tiny synthetic checkpoints and real wcache-server subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from wcache.synthetic import TINY, LlamaShape, make_llama_checkpoint

READY_TIMEOUT = 60.0


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 10 MB Llama-shaped bf16 checkpoint in two shards with an index."""
    return make_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY, shards=2, seed=1)


@pytest.fixture(scope="session")
def tied_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = LlamaShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512, tie_word_embeddings=True)
    return make_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "tied", shape, seed=2)


@pytest.fixture
def socket_dir(tmp_path: Path) -> Path:
    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    return d


@dataclass
class DaemonProc:
    proc: subprocess.Popen[bytes]
    socket: Path
    log: Path
    ready: dict[str, object]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def server_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "wcache.server.cli", *args]


def start_daemon(model: Path, socket_dir: Path, *extra: str, log_dir: Path | None = None) -> DaemonProc:
    """Start wcache-server through its CLI and wait (with a deadline) for its ready file."""
    log_dir = log_dir or socket_dir.parent
    tag = f"{int(time.time() * 1e6)}"
    ready = log_dir / f"ready-{tag}.json"
    log = log_dir / f"daemon-{tag}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            server_cmd("--model", str(model), "--socket-dir", str(socket_dir), "--ready-file", str(ready), *extra),
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + READY_TIMEOUT
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"daemon not ready after {READY_TIMEOUT} s:\n{log.read_text()}")
        time.sleep(0.02)
    info = json.loads(ready.read_text())
    return DaemonProc(proc, Path(str(info["socket"])), log, info)


@pytest.fixture
def daemon_factory(socket_dir: Path) -> Iterator[Callable[..., DaemonProc]]:
    started: list[DaemonProc] = []

    def factory(model: Path, *extra: str, sdir: Path | None = None) -> DaemonProc:
        d = start_daemon(model, sdir or socket_dir, *extra)
        started.append(d)
        return d

    yield factory
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProc], ckpt: Path) -> DaemonProc:
    return daemon_factory(ckpt)
