"""Socket directory checks, one daemon per socket, peer-credential refusal."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

from tests.conftest import DaemonProc, server_cmd, start_daemon

ROOT = os.geteuid() == 0


def run_server(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(server_cmd(*args), capture_output=True, text=True, timeout=timeout, check=False)


def test_socket_and_dir_modes(daemon: DaemonProc) -> None:
    assert daemon.socket.stat().st_mode & 0o777 == 0o600
    assert daemon.socket.parent.stat().st_mode & 0o777 == 0o700


def test_default_socket_dir_is_created_private(tmp_path: Path, ckpt: Path) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        server_cmd("--model", str(ckpt), "--ready-file", str(ready)), env=env, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        d = tmp_path / "wcache"
        assert d.stat().st_mode & 0o777 == 0o700
        assert (d / "wcache-rank0.sock").exists()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err


def test_second_daemon_refused_naming_holder(daemon: DaemonProc, ckpt: Path, socket_dir: Path) -> None:
    t0 = time.monotonic()
    out = run_server("--model", str(ckpt), "--socket-dir", str(socket_dir))
    assert out.returncode == 1
    assert time.monotonic() - t0 < 30
    assert f"pid {daemon.proc.pid}" in out.stderr and "already serves" in out.stderr
    assert daemon.proc.poll() is None  # the first one is untouched


@pytest.mark.parametrize("mode", [0o777, 0o755, 0o770, 0o701])
def test_open_directory_refused(tmp_path: Path, ckpt: Path, mode: int) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, mode)
    out = run_server("--model", str(ckpt), "--socket-dir", str(d))
    assert out.returncode == 1
    assert f"chmod 700 {d}" in out.stderr
    assert not list(d.iterdir())


def test_symlinked_directory_refused(tmp_path: Path, ckpt: Path, socket_dir: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(socket_dir)
    out = run_server("--model", str(ckpt), "--socket-dir", str(link))
    assert out.returncode == 1 and "symlink" in out.stderr


def test_socket_path_in_open_directory_refused(tmp_path: Path, ckpt: Path) -> None:
    os.chmod(tmp_path, 0o755)
    out = run_server("--model", str(ckpt), "--socket-path", str(tmp_path / "x.sock"))
    assert out.returncode == 1 and "chmod 700" in out.stderr


@pytest.mark.skipif(not ROOT, reason="needs root to chown")
def test_directory_of_another_user_refused(tmp_path: Path, ckpt: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    out = run_server("--model", str(ckpt), "--socket-dir", str(d))
    assert out.returncode == 1 and "owned by uid 65534" in out.stderr


@pytest.mark.skipif(not ROOT, reason="needs root to switch uid in a child")
def test_peer_with_other_uid_refused(daemon_factory: Callable[..., DaemonProc], ckpt: Path) -> None:
    """Even if the file permissions are opened by mistake, SO_PEERCRED stops other users."""
    # Under /tmp, not tmp_path (/tmp/pytest-of-root is 0700): uid 65534 must traverse to the socket. The daemon's
    # log and ready file go beside the socket directory, so both live in `top`, removed with it.
    top = Path(tempfile.mkdtemp(prefix="wcache-uid-test-"))
    try:
        _refused_across_uids(daemon_factory, ckpt, top)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _refused_across_uids(daemon_factory: Callable[..., DaemonProc], ckpt: Path, top: Path) -> None:
    socket_dir = top / "sock"
    socket_dir.mkdir(mode=0o700)
    d = daemon_factory(ckpt, sdir=socket_dir)
    os.chmod(top, 0o711)
    os.chmod(socket_dir, 0o711)
    os.chmod(d.socket, 0o666)
    child = f"""
import os, socket, struct, sys
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect({str(d.socket)!r})
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk: break
    data += chunk
sys.stdout.buffer.write(data)
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    (n,) = struct.unpack(">I", out.stdout[:4])
    frame = msgpack.unpackb(out.stdout[4 : 4 + n])
    assert frame["type"] == "ERROR" and frame["code"] == 10 and frame["fatal"] is True
    assert "uid 65534" in frame["message"]
    # the log line is the feature here: an operator sees which uid was refused (a security event)
    assert "refused" in d.log_text() and "uid=65534" in d.log_text()
    assert d.proc.poll() is None  # and the daemon serves on
    d.stop()


def test_stale_socket_and_lock_recovered(ckpt: Path, socket_dir: Path) -> None:
    first = start_daemon(ckpt, socket_dir)
    first.stop(9)  # SIGKILL: socket file and lock file stay behind
    assert first.socket.exists()
    second = start_daemon(ckpt, socket_dir)
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(second.socket))
        s.close()
    finally:
        assert second.stop() == 0
    assert not second.socket.exists()


def test_symlink_planted_at_the_socket_path_is_replaced(tmp_path: Path, ckpt: Path, socket_dir: Path) -> None:
    """A symlink where the socket goes (left by anyone who could write there) is removed, never followed."""
    target = tmp_path / "elsewhere"
    target.write_text("precious")
    link = socket_dir / "wcache-rank0.sock"
    link.symlink_to(target)
    d = start_daemon(ckpt, socket_dir)
    try:
        import stat as st

        assert st.S_ISSOCK(os.lstat(d.socket).st_mode)
        assert target.read_text() == "precious"
    finally:
        assert d.stop() == 0
