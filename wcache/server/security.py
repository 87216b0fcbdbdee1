"""Who may reach the daemon: a private socket directory, a 0600 socket (made in listen.py), one daemon per socket.

The system we are modelled on trusted any explicitly given socket path; we check every
directory, default or given: owned by the daemon's uid, a real directory (not a
symlink), no group/other permission bits. The kernel's SO_PEERCRED check on each
connection (the server shell, service.py: SameUid) is the second layer.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import NoReturn

from wcache.errors import DaemonRunningError, InsecurePathError

__all__ = ["SHARED_DIRS", "DaemonLock", "check_private_dir", "check_socket_path", "ensure_socket_dir"]


def _shared(path: Path, st: os.stat_result) -> bool:
    """A directory every user writes into (sticky and world-writable, like /tmp and /dev/shm): its mode and
    owner are right as they are, so the advice is a private subdirectory, never chmod/chown."""
    open_ = st.st_uid != os.geteuid() or st.st_mode & 0o077
    return bool(open_) and (bool(st.st_mode & stat.S_ISVTX and st.st_mode & 0o002) or str(path) in SHARED_DIRS)


#: Directories shared by all users by design: never advise changing their mode or owner.
SHARED_DIRS = frozenset({"/tmp", "/var/tmp", "/dev/shm", "/run", "/run/user", "/var/run"})


def _alternatives(what: str) -> str:
    if what == "host tier directory":
        return "pass --host-tier-dir DIR naming a directory you own with mode 0700"
    return (
        "set $XDG_RUNTIME_DIR to a private directory of yours (e.g. /run/user/UID; the default is then "
        "$XDG_RUNTIME_DIR/wcache) or pass --socket-dir DIR naming a directory you own with mode 0700"
    )


def check_private_dir(path: Path, what: str = "socket directory") -> None:
    """Raise InsecurePathError unless ``path`` is a directory we own with mode 0700 or stricter.

    The message says what to do next; for a shared directory such as /tmp it suggests a private
    subdirectory (``mkdir -m 700``), never ``chmod``/``chown`` of the shared directory itself."""
    try:
        st = os.lstat(path)
    except FileNotFoundError as exc:
        raise InsecurePathError(f"{what} {path} does not exist; create it with: mkdir -m 700 {path}") from exc
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise InsecurePathError(
            f"{what} {path} is a symlink; use the real directory path (refusing: another user could redirect it)"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise InsecurePathError(f"{what} {path} is not a directory")
    if _shared(path, st):
        sub = path / f"wcache-{uid}"
        raise InsecurePathError(
            f"{what} {path} is shared by all users (mode {stat.S_IMODE(st.st_mode):04o}): any of them could "
            f"replace or race files there. Use a private subdirectory instead: mkdir -m 700 {sub} and put the "
            f"files there (e.g. --socket-path {sub}/NAME.sock), or leave out --socket-path/--socket-dir: "
            "wcache-server then creates its default directory ($XDG_RUNTIME_DIR/wcache, else /tmp/wcache-UID) "
            "with mode 0700",
            details={"path": str(path), "shared": True},
        )
    if st.st_uid != uid:
        raise InsecurePathError(
            f"{what} {path} is owned by uid {st.st_uid}, not by this daemon's uid {uid}: refusing, since its owner "
            f"could read or replace what is put there (another user may have created it first). "
            f"Fix: {_alternatives(what)}",
            details={"path": str(path), "owner_uid": st.st_uid},
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


def check_socket_path(path: Path) -> None:
    """Refuse a socket path that names something other than a (stale) socket or a symlink: the daemon
    replaces what is there when it binds, and a regular file or directory given by mistake is not ours to
    delete. A symlink is replaced, never followed (tests/server/test_security.py)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(st.st_mode) or stat.S_ISLNK(st.st_mode):
        return
    kind = "directory" if stat.S_ISDIR(st.st_mode) else "regular file" if stat.S_ISREG(st.st_mode) else "file"
    raise InsecurePathError(
        f"socket path {path} is an existing {kind}, not a socket: refusing to replace it (binding would delete "
        "it); choose another --socket-path, or remove it yourself if it is not needed",
        details={"path": str(path)},
    )


class DaemonLock:
    """``fcntl.flock`` on ``<socket>.lock``: one daemon per socket, and only the holder
    may remove a stale socket file. The lock file holds the holder's pid."""

    def __init__(self, socket_path: Path) -> None:
        self.path = Path(str(socket_path) + ".lock")
        self.fd = -1

    def acquire(self, wait: float = 0.0) -> None:
        """Take the lock; with ``wait``, retry that many seconds (a hand-off: the old daemon releases it)."""
        deadline = time.monotonic() + wait
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise self._unusable(exc) from exc
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

    def _unusable(self, exc: OSError) -> InsecurePathError:
        """The lock file cannot be opened: another user's (e.g. root's, from a daemon once run as root), or a
        symlink planted there (O_NOFOLLOW: ELOOP)."""
        try:
            owner: int | str = os.lstat(self.path).st_uid
        except OSError:
            owner = "unknown"
        why = "is a symlink" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror}; owner uid {owner})"
        return InsecurePathError(
            f"lock file {self.path} {why}: this daemon (uid {os.geteuid()}) cannot take the one-daemon lock. "
            f"If no daemon runs there, remove it (as its owner: rm {self.path}), or choose another --socket-path "
            "/ --socket-dir",
            details={"path": str(self.path), "owner_uid": owner},
        )

    def _refuse(self, fd: int, exc: OSError) -> NoReturn:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise DaemonRunningError(
                f"another wcache-server (pid {holder}) already serves {self.path.name[:-5]}: "
                f"lock {self.path} is held; stop it first or choose another --socket-path",
                details={"holder_pid": holder},
            ) from exc
        raise self._unusable(exc) from exc

    def release(self) -> None:
        # The lock file stays: unlinking it would let two daemons lock two different inodes.
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
