"""wcache-server --takeover: a new daemon takes the running one's memory and socket; no disk read,
engines' zero_copy mappings stay valid, new connections reach the new daemon."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from tests.conftest import DaemonProc
from wcache import WCacheClient, WeightCacheKey
from wcache.nn import load_from_disk
from wcache.server.process import spawn_daemon


async def test_takeover_hands_over_memory_socket_and_lock(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path
) -> None:
    old = daemon_factory(ckpt)
    key = WeightCacheKey.from_checkpoint(ckpt)
    ref = load_from_disk(ckpt)
    engine = await WCacheClient(old.socket).fetch(key)  # an engine mapped before the hand-off
    (loaded,) = (await WCacheClient(old.socket).status()).models
    new = spawn_daemon(None, socket_dir, takeover=old.socket, timeout=60)
    try:
        assert old.proc.wait(30) == 0
        (m,) = (await WCacheClient(new.socket).status()).models
        assert (loaded.origin, m.origin) == ("disk", "takeover")  # handed over, not read from disk
        assert m.load_seconds == loaded.load_seconds  # the old daemon's load: not loaded again
        assert new.socket == old.socket and old.socket.exists()
        # the engine's views are still the weights (the memory outlives the old daemon)
        assert all(torch.equal(engine[k], v) for k, v in ref.items())
        async with await WCacheClient(new.socket).fetch(key) as w:
            assert w.server.server_pid == new.pid
            assert all(torch.equal(w[k], v) for k, v in ref.items())
        await engine.release()  # its connection went with the old daemon: not an error
        third = subprocess.run(
            [sys.executable, "-m", "wcache.server.cli", "--model", str(ckpt), "--socket-dir", str(socket_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert third.returncode != 0 and f"pid {new.pid}" in third.stderr  # the new daemon holds the lock
    finally:
        new.stop()


def test_takeover_refuses_model_and_socket_arguments(ckpt: Path, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "wcache.server.cli", "--takeover", str(tmp_path / "x.sock"), "--model", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2 and "--takeover serves the running daemon's socket" in r.stderr
