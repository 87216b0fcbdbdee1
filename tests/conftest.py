"""Shared fixtures: tiny synthetic checkpoints and real wcache-server subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar

import pytest

from tests.integrations.vllm import remove_engine_tmp
from wcache.server.process import DaemonProcess, spawn_daemon, spawn_keeper
from wcache.synthetic import TINY, LlamaShape, make_llama_checkpoint

READY_TIMEOUT = 60.0

#: The repository root, on every subprocess's import path: daemons start with ``-P`` (wcache.server.process: the
#: working directory is not on it), and some import the tests' own modules (a transform in tests/server)
ROOT = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)

#: Shared directories a run must leave as it found them: tests use tmp_path.
SHARED_TMP = (Path("/tmp"), Path("/dev/shm"))

#: What a run could leave there: wcache's own entries (a socket dir, a log, a fuzz corpus), and vLLM's (the vLLM
#: job's engines): its ZMQ sockets (a UUID), its process group's FileStore, the engines' temp directory
_LEFTOVER = re.compile(r".*wcache.*|vllm_dist_[0-9a-f]{32}|vllm-engines-.*|[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}")


def _leftover_entries() -> set[Path]:
    return {p for d in SHARED_TMP if d.is_dir() for p in d.iterdir() if _LEFTOVER.fullmatch(p.name)}


@pytest.fixture(scope="session", autouse=True)
def _leaves_nothing_in_shared_tmp() -> Iterator[None]:
    """Fail the run if it left new wcache or vLLM entries in /tmp or /dev/shm (``_LEFTOVER``). Another wcache or
    vLLM process running at the same time on this machine would be counted too: run alone."""
    before = _leftover_entries()
    yield
    remove_engine_tmp()
    left = sorted(str(p) for p in _leftover_entries() - before if p.exists())
    assert not left, f"the tests left these behind (use tmp_path, or remove them): {left}"


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


DaemonProc = DaemonProcess


class Service(Protocol):
    """A Daemon or a Keeper, as a test runs one in its own process."""

    async def serve(self, on_ready: Callable[[], None] | None = None, *, signals: bool = True) -> None: ...

    def stop(self) -> None: ...


S = TypeVar("S", bound=Service)


@contextlib.asynccontextmanager
async def serving_here(service: S, deadline_s: float = 30.0) -> AsyncIterator[S]:
    """Run ``service`` in this process (its socket real, no signal handlers) from ready until the block ends."""
    ready = asyncio.Event()
    task = asyncio.ensure_future(service.serve(ready.set, signals=False))
    try:
        await asyncio.wait_for(ready.wait(), deadline_s)
        yield service
    finally:
        service.stop()
        await asyncio.wait_for(task, deadline_s)


def server_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "wcache.server.cli", *args]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m wcache.cli ARGS`` (the operator CLI), output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "wcache.cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def start_daemon(model: Path, socket_dir: Path, *extra: str) -> DaemonProcess:
    """Start wcache-server through its CLI and wait (with a deadline) for its ready file."""
    return spawn_daemon(model, socket_dir, *extra, timeout=READY_TIMEOUT)


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
def keeper(socket_dir: Path) -> Iterator[DaemonProcess]:
    """A wcache-keeper in the test's socket directory."""
    k = spawn_keeper(socket_dir)
    try:
        yield k
    finally:
        k.stop()


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProc], ckpt: Path) -> DaemonProc:
    return daemon_factory(ckpt)
