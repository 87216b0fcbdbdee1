"""Who may reach the daemon: a private socket directory, a 0600 socket (made in listen.py), one daemon per socket.

The system we are modelled on trusted any explicitly given socket path; we check every
directory, default or given: owned by the daemon's uid, a real directory (not a
symlink), no group/other permission bits. The kernel's SO_PEERCRED check on each
connection (daemon.py) is the second layer.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import NoReturn

from wcache.errors import InsecurePathError

__all__ = ["DaemonLock", "check_private_dir", "ensure_socket_dir"]


def check_private_dir(path: Path, what: str = "socket directory") -> None:
    """Raise InsecurePathError unless ``path`` is a directory we own with mode 0700 or stricter."""
    try:
        st = os.lstat(path)
    except FileNotFoundError as exc:
        raise InsecurePathError(f"{what} {path} does not exist") from exc
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise InsecurePathError(
            f"{what} {path} is a symlink; use the real directory path (refusing: another user could redirect it)"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise InsecurePathError(f"{what} {path} is not a directory")
    if st.st_uid != uid:
        raise InsecurePathError(
            f"{what} {path} is owned by uid {st.st_uid}, not by this daemon's uid {uid}; "
            f"fix: chown {uid} {path} (or choose a directory you own)"
        )
    if st.st_mode & 0o077:
        raise InsecurePathError(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}, open to other users; fix: chmod 700 {path}"
        )


def ensure_socket_dir(path: Path) -> Path:
    """Create ``path`` as 0700 if missing (parents too), then check it is private."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=False)
    except FileExistsError:
        pass
    check_private_dir(path)
    return path


class DaemonLock:
    """``fcntl.flock`` on ``<socket>.lock``: one daemon per socket, and only the holder
    may remove a stale socket file. The lock file holds the holder's pid."""

    def __init__(self, socket_path: Path) -> None:
        self.path = Path(str(socket_path) + ".lock")
        self.fd = -1

    def acquire(self, wait: float = 0.0) -> None:
        """Take the lock; with ``wait``, retry that many seconds (a hand-off: the old daemon releases it)."""
        deadline = time.monotonic() + wait
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                self._refuse(fd, exc)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def _refuse(self, fd: int, exc: OSError) -> NoReturn:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise InsecurePathError(
                f"another wcache-server (pid {holder}) already serves {self.path.name[:-5]}: "
                f"lock {self.path} is held; stop it first or choose another --socket-path",
                details={"holder_pid": holder},
            ) from exc
        raise exc

    def release(self) -> None:
        # The lock file stays: unlinking it would let two daemons lock two different inodes.
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
