"""systemd's readiness protocol (wcache/server/notify.py): a ``Type=notify`` unit (docs/deploy/) counts
wcache-server and wcache-keeper as started when their ``READY=1`` datagram arrives, so that datagram must come
from the process systemd started (``NotifyAccess=main``) and only once the socket serves; ``STOPPING=1`` comes
when a SIGTERM begins the stop.

Real subprocesses, with ``NOTIFY_SOCKET`` naming a datagram socket this test binds (a path for the daemon, an
abstract name for the keeper, the two forms systemd uses); the sender's pid is read from SCM_CREDENTIALS, as
systemd reads it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from wcache import WCacheClient
from wcache.paths import KEEPER_SOCKET, socket_name
from wcache.server.notify import notify, notify_address
from wcache.server.process import DaemonProcess, spawn_daemon, spawn_keeper

DEADLINE_S = 60.0


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[socket.socket]:
    """A service manager's notification socket at a path (``NOTIFY_SOCKET=/...``), SO_PASSCRED on."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    s.bind(str(tmp_path / "notify"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def abstract_manager() -> Iterator[socket.socket]:
    """The same at an abstract name (``NOTIFY_SOCKET=@...``), as systemd binds its own."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    s.bind(f"\0wcache-test-notify-{os.getpid()}-{time.monotonic_ns()}")
    try:
        yield s
    finally:
        s.close()


def _env_for(s: socket.socket) -> dict[str, str]:
    name = s.getsockname()
    address = "@" + name[1:].decode() if isinstance(name, bytes) else str(name)
    return {**os.environ, "NOTIFY_SOCKET": address}


def _receive(s: socket.socket, proc: DaemonProcess) -> tuple[dict[str, str], int]:
    """The next notification's fields and its sender's pid; fails if ``proc`` exits first or none comes."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        exited = proc.proc.poll() is not None  # before the wait: what it sent before exiting is read below
        s.settimeout(0 if exited else 0.1)
        try:
            data, ancillary, _, _ = s.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
            break
        except (TimeoutError, BlockingIOError):
            assert not exited, f"{proc.name} exited with {proc.proc.returncode}:\n{proc.log_text()}"
            assert time.monotonic() < deadline, f"no notification from {proc.name}:\n{proc.log_text()}"
    (pid,) = [
        struct.unpack("3i", d)[0]
        for level, kind, d in ancillary
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
    ]
    fields = dict(line.split("=", 1) for line in data.decode().splitlines())
    return fields, pid


def _stopped(s: socket.socket, proc: DaemonProcess) -> tuple[dict[str, str], int]:
    proc.proc.send_signal(signal.SIGTERM)
    fields, pid = _receive(s, proc)
    assert proc.proc.wait(DEADLINE_S) == 0
    return fields, pid


def test_the_daemon_is_ready_for_systemd_once_its_socket_serves(
    manager: socket.socket, ckpt: Path, socket_dir: Path
) -> None:
    d = spawn_daemon(ckpt, socket_dir, env=_env_for(manager), timeout=None)
    try:
        ready, sender = _receive(manager, d)
        # the first notification: the socket answers STATUS already, with the model it was started for
        assert ready["READY"] == "1" and sender == d.pid and int(ready["MAINPID"]) == d.pid
        (m,) = asyncio.run(WCacheClient(socket_dir / socket_name(0)).status(timeout=5)).models
        assert m.source == str(ckpt)
        stopping, sender = _stopped(manager, d)
        assert stopping["STOPPING"] == "1" and sender == d.pid
    finally:
        d.stop()
    assert not (socket_dir / socket_name(0)).exists()


def test_the_keeper_is_ready_for_systemd_once_its_socket_serves(
    abstract_manager: socket.socket, socket_dir: Path
) -> None:
    k = spawn_keeper(socket_dir, env=_env_for(abstract_manager), timeout=None)
    try:
        ready, sender = _receive(abstract_manager, k)
        assert ready["READY"] == "1" and sender == k.pid and int(ready["MAINPID"]) == k.pid
        assert asyncio.run(WCacheClient(socket_dir / KEEPER_SOCKET).status(timeout=5)).models == ()
        stopping, sender = _stopped(abstract_manager, k)
        assert stopping["STOPPING"] == "1" and sender == k.pid
    finally:
        k.stop()


def test_the_notify_socket_forms() -> None:
    assert notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify_address("@/org/freedesktop/systemd1/notify/1") == b"\0/org/freedesktop/systemd1/notify/1"
    assert notify_address("") is None and notify_address("vsock:2:1234") is None


def test_without_a_manager_nothing_is_sent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify(READY=1) is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))  # a manager that is not there: no error
    assert notify(READY=1) is False
