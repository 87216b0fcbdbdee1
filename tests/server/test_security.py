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


# ---------------------------------------------------------------- what a clean stop leaves


def test_a_clean_stop_removes_its_lock_file_and_the_last_one_the_default_directory(tmp_path: Path, ckpt: Path) -> None:
    """Each daemon and keeper removes its ``<socket>.lock`` when it stops; the default socket directory (which
    wcache creates) goes with the last of them. A directory the operator named stays."""
    from wcache.server.process import spawn_daemon, spawn_keeper

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(run)}
    d = run / "wcache"  # the default directory under this XDG_RUNTIME_DIR
    d.mkdir(mode=0o700)
    keeper = spawn_keeper(d, env=env)
    r0 = spawn_daemon(ckpt, d, "--keeper", env=env, timeout=60)
    r1 = spawn_daemon(ckpt, d, "--keeper", "--tp-size", "2", "--tp-rank", "1", env=env, timeout=60)
    assert {p.name for p in d.iterdir()} >= {"wcache-rank0.sock.lock", "wcache-rank1.sock.lock"}
    assert r0.stop() == 0
    assert sorted(p.name for p in d.iterdir()) == [
        "wcache-keeper.sock",
        "wcache-keeper.sock.lock",
        "wcache-rank1.sock",
        "wcache-rank1.sock.lock",
    ]
    assert keeper.stop() == 0 and sorted(p.name for p in d.iterdir()) == ["wcache-rank1.sock", "wcache-rank1.sock.lock"]
    assert r1.stop() == 0
    assert not d.exists() and run.exists()

    mine = tmp_path / "mine"  # named with --socket-dir: the operator's, so it stays (empty)
    mine.mkdir(mode=0o700)
    r = spawn_daemon(ckpt, mine, env=env, timeout=60)
    assert r.stop() == 0 and mine.exists() and list(mine.iterdir()) == []


def test_a_lock_file_removed_while_another_waits_on_it_is_never_held_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interleaving ``DaemonLock`` is built for: B opens the lock file, the holder A removes it and stops, B
    gets the flock of the removed file. B must see that and lock the path's file instead; a third daemon C is then
    refused (before the inode check, B and C would both have held "the" lock)."""
    import fcntl

    from wcache.errors import DaemonRunningError
    from wcache.locks import lock_holder
    from wcache.server import security

    sock = tmp_path / "x.sock"
    a, b = security.DaemonLock(sock), security.DaemonLock(sock)
    a.acquire()
    real = fcntl.flock
    done: list[int] = []

    def flock(fd: int, op: int) -> None:
        if not done and op & fcntl.LOCK_EX:
            done.append(fd)
            a.release()  # A stops between B's open and B's flock: the file B opened is unlinked
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    b.acquire()
    monkeypatch.setattr(fcntl, "flock", real)
    # B holds the file the path names (the removed one cannot have its inode number: B had it open then)
    assert done and security._same_file(b.fd, sock.with_name("x.sock.lock"))
    assert lock_holder(sock) == os.getpid()
    with pytest.raises(DaemonRunningError):
        security.DaemonLock(sock).acquire()
    b.release()
    assert not sock.with_name("x.sock.lock").exists()


def test_the_directory_is_removed_only_by_its_last_user_even_while_one_is_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B opens the directory, A (its last user) removes it before B's flock: B finds its directory gone and makes
    it again instead of using one nobody can reach; A's removal waits for no one, and nobody removes a directory
    another holds."""
    import fcntl

    from wcache.server import security

    d = tmp_path / "wcache"
    d.mkdir(mode=0o700)

    def recreate() -> None:
        d.mkdir(mode=0o700, exist_ok=True)

    a, b, c = (security.DirectoryHold(d, removable=True) for _ in range(3))
    a.acquire(recreate)
    real = fcntl.flock
    removed: list[bool] = []

    def flock(fd: int, op: int) -> None:
        if not removed and op & fcntl.LOCK_SH:
            removed.append(a.release())  # A, the last user, stops between B's open and B's flock
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    b.acquire(recreate)
    monkeypatch.setattr(fcntl, "flock", real)
    assert removed == [True] and d.is_dir() and security._same_file(b.fd, d)  # B holds the directory made again
    c.acquire(recreate)
    assert c.release() is False and d.is_dir()  # B still uses it
    assert b.release() is True and not d.exists()


# ---------------------------------------------------------------- the directories above the socket directory


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_a_parent_other_users_may_write_without_the_sticky_bit_is_refused(
    tmp_path: Path, ckpt: Path, mode: int
) -> None:
    """An ``$XDG_RUNTIME_DIR`` (or any directory above the socket directory) others may write without the sticky
    bit lets any of them rename the socket directory away and put their own in its place: refused, before
    anything is created there, naming the directory and the fix."""
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, mode)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(run)}
    out = subprocess.run(
        server_cmd("--model", str(ckpt)), capture_output=True, text=True, timeout=60, check=False, env=env
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"lies under {run} ($XDG_RUNTIME_DIR" in out.stderr and f"chmod go-w {run}" in out.stderr
    assert list(run.iterdir()) == []
    (run / "s").mkdir(mode=0o700)  # a --socket-dir of the operator's under it: the same rule
    out = run_server("--model", str(ckpt), "--socket-dir", str(run / "s"))
    assert out.returncode == 1 and f"lies under {run}" in out.stderr
    assert list((run / "s").iterdir()) == []


def test_a_sticky_shared_parent_is_accepted(tmp_path: Path, ckpt: Path) -> None:
    """Sticky and world-writable, like /tmp (the default /tmp/wcache-UID lives there): others cannot rename what
    they do not own, so the daemon serves."""
    from wcache.server.process import spawn_daemon

    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o1777)
    d = run / "wcache"
    d.mkdir(mode=0o700)
    daemon = spawn_daemon(ckpt, d, env={**os.environ, "XDG_RUNTIME_DIR": str(run)}, timeout=60)
    assert daemon.stop() == 0


@pytest.mark.skipif(not ROOT, reason="needs root to chown")
def test_a_parent_owned_by_another_user_is_refused(tmp_path: Path, ckpt: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    (theirs / "sock").mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    out = run_server("--model", str(ckpt), "--socket-dir", str(theirs / "sock"))
    assert out.returncode == 1 and f"lies under {theirs}, which is owned by uid 65534" in out.stderr
