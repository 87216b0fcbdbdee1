"""The client waits for a daemon that is coming back (its lock held, or a keeper holding its model), and
fails at once when nothing is coming (docs/protocol.md §9).

Real subprocesses: daemons started with ``--keeper`` and SIGKILLed, a keeper, and a stand-in process that
holds a daemon's lock. Durations are compared with the wait's own deadline, with wide margins; the
order of events is checked by state (connection attempts counted, the task still pending), not by time.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import DaemonProc
from wcache import CacheUnavailableError, WCacheClient, WeightCacheKey, channel
from wcache.client import client as client_mod
from wcache.locks import lock_holder
from wcache.nn import load_from_disk
from wcache.paths import socket_name
from wcache.server.process import DaemonProcess

#: A deadline no test reaches when the client does not wait (so "at once" is "far less than this").
LONG = 60.0

HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("locked", flush=True)
sys.stdin.read()  # hold it until the test closes our stdin (or kills us)
"""


@pytest.fixture
def key(ckpt: Path) -> WeightCacheKey:
    return WeightCacheKey.from_checkpoint(ckpt)


@pytest.fixture
def hold_lock(socket_dir: Path) -> Iterator[Callable[[], subprocess.Popen[str]]]:
    """Start a stand-in process holding ``<rank0 socket>.lock`` as a starting daemon would."""
    procs: list[subprocess.Popen[str]] = []

    def start() -> subprocess.Popen[str]:
        lock = str(socket_dir / socket_name(0)) + ".lock"
        p = subprocess.Popen(
            [sys.executable, "-c", HOLDER, lock], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "locked"
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait(30)
        for f in (p.stdin, p.stdout):
            if f is not None:
                f.close()


@pytest.fixture
def attempts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every failed connection attempt of the client, by its error message (a state the tests wait on)."""
    failed: list[str] = []

    def counted(real: Callable[..., Any]) -> Callable[..., Any]:
        async def counting(path: Path, **kw: Any) -> Any:
            try:
                return await real(path, **kw)
            except CacheUnavailableError as exc:
                failed.append(exc.message)
                raise

        return counting

    # a fetch's connect (an engine's connection) and the other requests' (the reference connection)
    monkeypatch.setattr(client_mod, "connect_engine", counted(channel.connect_engine))
    monkeypatch.setattr(client_mod, "connect", counted(channel.connect))
    return failed


async def _until(pred: Callable[[], bool], timeout: float = LONG) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "the state was not reached in time"
        await asyncio.sleep(0.01)


async def _raises_in(coro: Any) -> tuple[CacheUnavailableError, float]:
    t0 = time.monotonic()
    with pytest.raises(CacheUnavailableError) as info:
        await coro
    return info.value, time.monotonic() - t0


# ---------------------------------------------------------------------- nothing coming: at once


async def test_nothing_coming_fails_at_once(
    socket_dir: Path, key: WeightCacheKey, attempts: list[str], keeper: DaemonProcess
) -> None:
    sock = socket_dir / socket_name(0)
    client = WCacheClient(sock, wait_for_daemon=LONG, timeout=2 * LONG)
    # no socket, a keeper that holds nothing, no lock file
    err, took = await _raises_in(client.fetch(key))
    assert took < LONG / 4 and len(attempts) == 1 and "waited" not in err.message
    # a stale socket file and an unheld lock file, as a SIGKILLed daemon without a keeper leaves them
    sock.touch()
    (socket_dir / (socket_name(0) + ".lock")).write_text("999999\n")
    err, took = await _raises_in(client.fetch(key))
    assert took < LONG / 4 and len(attempts) == 2
    keeper.stop()
    err, took = await _raises_in(client.status())  # no keeper at all
    assert took < LONG / 4 and len(attempts) == 3


async def test_lock_check_leaves_the_lock_alone(socket_dir: Path, hold_lock: Callable[[], Any]) -> None:
    sock = socket_dir / socket_name(0)
    assert lock_holder(sock) is None  # no lock file
    holder = hold_lock()
    for _ in range(50):
        assert lock_holder(sock) == holder.pid
    holder.stdin.close()
    holder.wait(30)
    assert lock_holder(sock) is None  # the file stays, its pid with it: not trusted


# ---------------------------------------------------------------------- a daemon restarting after a crash


async def test_a_fetch_waits_for_a_daemon_restarted_after_a_crash(
    keeper: DaemonProcess,
    daemon_factory: Callable[..., DaemonProc],
    ckpt: Path,
    key: WeightCacheKey,
    attempts: list[str],
) -> None:
    first = daemon_factory(ckpt, "--keeper")
    first.stop(signal.SIGKILL)  # its model stays in the keeper; its socket file stays, refusing
    client = WCacheClient(first.socket, wait_for_daemon=LONG * 3, timeout=LONG * 4)
    pending = asyncio.ensure_future(client.fetch(key))
    await _until(lambda: len(attempts) >= 3 or pending.done())
    assert not pending.done()  # waiting, not failed
    second = await asyncio.to_thread(daemon_factory, ckpt, "--keeper")
    weights = await asyncio.wait_for(pending, LONG * 3)
    try:
        assert weights.server.server_pid == second.pid
        disk = load_from_disk(ckpt)
        assert all(torch.equal(weights[k], disk[k]) for k in disk)
    finally:
        await weights.release()


async def test_a_kept_model_without_a_daemon_fails_after_the_deadline(
    keeper: DaemonProcess,
    daemon_factory: Callable[..., DaemonProc],
    ckpt: Path,
    key: WeightCacheKey,
    attempts: list[str],
) -> None:
    first = daemon_factory(ckpt, "--keeper")
    first.stop(signal.SIGKILL)
    wait = 2.0
    err, took = await _raises_in(WCacheClient(first.socket, wait_for_daemon=wait, timeout=LONG).fetch(key))
    assert wait <= took < LONG / 2
    assert len(attempts) > 2  # retried, with a backoff
    assert "waited" in err.message and "keeper" in err.message
    assert "keeper" in err.details["reason"] and err.details["waited_s"] >= wait
    # the keeper holds nothing for another rank: nothing is coming for it
    other = WeightCacheKey.from_checkpoint(ckpt, tp_rank=1, tp_size=2)
    err, took = await _raises_in(WCacheClient(first.socket, wait_for_daemon=LONG, timeout=2 * LONG).fetch(other))
    assert took < LONG / 4 and "waited" not in err.message


# ---------------------------------------------------------------------- a live lock holder


async def test_a_held_lock_without_a_socket_is_waited_on(
    socket_dir: Path, key: WeightCacheKey, hold_lock: Callable[[], Any], attempts: list[str]
) -> None:
    holder = hold_lock()
    sock = socket_dir / socket_name(0)
    wait = 1.5
    err, took = await _raises_in(WCacheClient(sock, wait_for_daemon=wait, timeout=LONG).fetch(key))
    assert wait <= took < LONG / 2 and len(attempts) > 2
    assert f"pid {holder.pid}" in err.details["reason"] and err.details["waited_s"] >= wait

    # 0 disables the wait
    n = len(attempts)
    err, took = await _raises_in(WCacheClient(sock, wait_for_daemon=0).fetch(key))
    assert took < LONG / 4 and len(attempts) == n + 1

    # the request's own timeout bounds the wait, and its error names the wait
    err, took = await _raises_in(WCacheClient(sock, wait_for_daemon=LONG, timeout=1.0).fetch(key))
    assert 1.0 <= took < LONG / 2
    assert err.details["timeout_s"] == 1.0 and f"pid {holder.pid}" in err.details["reason"]


async def test_the_wait_stops_when_the_lock_holder_goes(
    socket_dir: Path, key: WeightCacheKey, hold_lock: Callable[[], Any], attempts: list[str]
) -> None:
    holder = hold_lock()
    client = WCacheClient(socket_dir / socket_name(0), wait_for_daemon=LONG, timeout=2 * LONG)
    pending = asyncio.ensure_future(client.fetch(key))
    await _until(lambda: len(attempts) >= 3 or pending.done())
    assert not pending.done()
    t0 = time.monotonic()
    holder.kill()  # a starting daemon that died: nothing is coming any more
    holder.wait(30)
    err, _ = await _raises_in(pending)
    assert time.monotonic() - t0 < LONG / 4
    assert "nothing is coming" in err.message


async def test_a_waiting_fetch_can_be_cancelled(
    socket_dir: Path, key: WeightCacheKey, hold_lock: Callable[[], Any], attempts: list[str]
) -> None:
    hold_lock()
    fds = len(os.listdir("/proc/self/fd"))
    client = WCacheClient(socket_dir / socket_name(0), wait_for_daemon=LONG, timeout=2 * LONG)
    pending = asyncio.ensure_future(client.fetch(key))
    await _until(lambda: len(attempts) >= 3)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    assert len(os.listdir("/proc/self/fd")) == fds  # no socket left behind


def test_the_wait_imports_no_server_module(socket_dir: Path, key: WeightCacheKey, hold_lock: Callable[[], Any]) -> None:
    hold_lock()
    code = (
        "import asyncio, sys\n"
        "from wcache import WCacheClient, WeightCacheKey, CacheUnavailableError\n"
        f"key = WeightCacheKey.from_wire({key.to_wire()!r})\n"
        f"c = WCacheClient({str(socket_dir / socket_name(0))!r}, wait_for_daemon=0.2)\n"
        "try:\n    asyncio.run(c.fetch(key))\nexcept CacheUnavailableError as e:\n    assert 'waited' in e.message\n"
        "print(sorted(m for m in sys.modules if m.startswith('wcache.server')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stderr
