"""Starting ``wcache-server`` as a subprocess and waiting for it, with a deadline.

One helper for the demo, the benchmarks and the tests: start the CLI with a ready file,
wait until it exists (or the process dies, or the deadline passes — then raise with the
log), read the socket path from it, stop with SIGTERM (then SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["DaemonProcess", "spawn_daemon", "spawn_keeper"]


class DaemonProcess:
    def __init__(
        self, proc: subprocess.Popen[bytes], log: Path, ready: Path, started: float, name: str = "wcache-server"
    ) -> None:
        self.proc = proc
        self.name = name
        self.log = log
        self.ready_file = ready
        self.started = started
        self.info: dict[str, Any] = {}
        self.ready_seconds = -1.0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def socket(self) -> Path:
        return Path(str(self.info["socket"]))

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> DaemonProcess:
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise TimeoutError(f"{self.name} not ready after {timeout} s:\n{self.log_text()[-3000:]}")
            time.sleep(0.02)
        self.info = json.loads(self.ready_file.read_text())
        self.ready_seconds = time.perf_counter() - self.started
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def spawn_daemon(
    model: str | os.PathLike[str] | None,
    socket_dir: str | os.PathLike[str],
    *extra: str,
    log: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = 120.0,
    takeover: str | os.PathLike[str] | None = None,
) -> DaemonProcess:
    """Start ``wcache-server --model M --socket-dir D --ready-file ... *extra`` (or, with ``takeover``,
    ``wcache-server --takeover SOCKET ...``; ready and log files then go beside ``socket_dir``); wait
    for it unless ``timeout`` is None (then call ``wait_ready`` yourself)."""
    sdir = Path(socket_dir)
    tag = time.time_ns()
    ready = sdir.parent / f".wcache-ready-{tag}.json"
    log_path = Path(log) if log is not None else sdir.parent / f"wcache-server-{tag}.log"
    where = (
        ["--takeover", str(takeover)] if takeover is not None else ["--model", str(model), "--socket-dir", str(sdir)]
    )
    return _spawn("wcache.server.cli", [*where, *extra], ready, log_path, env, timeout)


def spawn_keeper(
    socket_dir: str | os.PathLike[str],
    *extra: str,
    log: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = 60.0,
) -> DaemonProcess:
    """Start ``wcache-keeper --socket-dir D --ready-file ... *extra`` and wait for it (see spawn_daemon)."""
    sdir = Path(socket_dir)
    tag = time.time_ns()
    ready = sdir.parent / f".wcache-keeper-ready-{tag}.json"
    log_path = Path(log) if log is not None else sdir.parent / f"wcache-keeper-{tag}.log"
    return _spawn(
        "wcache.server.keeper_cli", ["--socket-dir", str(sdir), *extra], ready, log_path, env, timeout, "wcache-keeper"
    )


def _spawn(
    module: str,
    args: list[str],
    ready: Path,
    log_path: Path,
    env: Mapping[str, str] | None,
    timeout: float | None,
    name: str = "wcache-server",
) -> DaemonProcess:
    started = time.perf_counter()
    with open(log_path, "wb") as fh:
        proc = subprocess.Popen(
            # -P: not the working directory first on the import path, where a directory named wcache (a clone,
            # next to where the command runs) would shadow the installed package
            [sys.executable, "-P", "-m", module, *args, "--ready-file", str(ready)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
        )
    d = DaemonProcess(proc, log_path, ready, started, name)
    return d.wait_ready(timeout) if timeout is not None else d
