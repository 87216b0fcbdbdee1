"""Who may reach the daemon: a private socket directory, a 0600 socket (made in listen.py), one daemon per socket.

The system we are modelled on trusted any explicitly given socket path; we check every
directory, default or given: owned by the daemon's uid, a real directory (not a
symlink), no group/other permission bits. The kernel's SO_PEERCRED check on each
connection (the server shell, service.py: SameUid) is the second layer.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from wcache.errors import DaemonRunningError, InsecurePathError
from wcache.paths import default_socket_dir

__all__ = [
    "SHARED_DIRS",
    "DaemonLock",
    "DirectoryHold",
    "check_private_dir",
    "check_socket_path",
    "ensure_socket_dir",
    "hold_socket_dir",
]


log = logging.getLogger("wcache.server")


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


def _unsafe_above(path: Path) -> tuple[Path, os.stat_result] | None:
    """The first directory above ``path`` (from ``/`` down; a symlink's target chain too) that a user other
    than root and us could change: owned by such a user, or writable by group or others without the sticky
    bit (which would let them rename ``path``'s ancestors and put their own in their place)."""
    uid = os.geteuid()
    chain = Path(os.path.abspath(path)).parent

    def walk(top: Path, depth: int) -> tuple[Path, os.stat_result] | None:
        for d in [*reversed(top.parents), top]:
            try:
                st = os.lstat(d)
            except OSError:
                return None  # it is the path's own check that says what is missing
            if stat.S_ISLNK(st.st_mode) and depth < 8:
                bad = walk(Path(os.path.realpath(d)), depth + 1)  # the link sits in a checked directory
                if bad is not None:
                    return bad
                continue
            if st.st_uid not in (0, uid) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
                return d, st
        return None

    return walk(chain, 0)


def _check_above(path: Path, what: str) -> None:
    bad = _unsafe_above(path)
    if bad is None:
        return
    d, st = bad
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    xdg = (
        f" ($XDG_RUNTIME_DIR: the XDG base directory spec requires it to be yours with mode 0700; unset it to use "
        f"/tmp/wcache-{os.geteuid()})"
        if runtime and os.path.abspath(runtime) == str(d)
        else ""
    )
    if st.st_uid not in (0, os.geteuid()):
        why = f"is owned by uid {st.st_uid}, who could rename what is under it and put their own in its place"
        fix = f"use a {what} whose every parent directory is owned by root or by you"
    else:
        why = (
            f"has mode {stat.S_IMODE(st.st_mode):04o}: other users may write there, and without the sticky bit "
            "any of them could rename what is under it and put their own in its place"
        )
        fix = f"chmod go-w {d} (or chmod +t {d}, as /tmp has)"
    raise InsecurePathError(
        f"{what} {path} lies under {d}{xdg}, which {why}. Fix: {fix}, or {_alternatives(what)}",
        details={"path": str(path), "unsafe_parent": str(d), "owner_uid": st.st_uid},
    )


def check_private_dir(path: Path, what: str = "socket directory") -> None:
    """Raise InsecurePathError unless ``path`` is a directory we own with mode 0700 or stricter, under
    directories no other user can change (owned by root or us; writable by others only with the sticky bit).

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
    _check_above(path, what)


def ensure_socket_dir(path: Path) -> Path:
    """Create ``path`` as 0700 if missing (parents too), then check it is private. The directories above it are
    checked first (nothing is created under one another user could change); an ``$XDG_RUNTIME_DIR`` that is
    safe but not private (shared with the sticky bit, like /tmp) gets one warning line: any user may take the
    name ``wcache`` there first, and the daemon then refuses to start."""
    _check_above(path, "socket directory")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(os.path.abspath(runtime)) == Path(os.path.abspath(path)).parent:
        with contextlib.suppress(OSError):
            st = os.stat(runtime)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                log.warning(
                    "XDG_RUNTIME_DIR=%s is not private (mode %04o, owner uid %d; the XDG spec requires yours, 0700): "
                    "another user could create %s first; unset it to use /tmp/wcache-%d",
                    runtime,
                    stat.S_IMODE(st.st_mode),
                    st.st_uid,
                    path,
                    os.geteuid(),
                )
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
    """``fcntl.flock`` on ``<socket>.lock``: one daemon (or keeper: ``program``) per socket, and only the holder
    may remove a stale socket file. The file holds the holder's pid and program, for the refusal's message only
    (who holds it is read from ``/proc/locks``: wcache/locks.py).

    **The holder removes the file when it stops, while it still holds the lock** (``release``), and that is
    safe because of one check in ``acquire``: having got the ``flock``, a process checks that the path still
    names the inode it locked, and starts over on the path if not. Why that suffices: the file is unlinked only
    by a holder that passed the check, so while it holds, the path names its inode; a process that opened that
    inode earlier and gets the lock after the holder's unlink and close finds the path gone (or naming the
    file a newer daemon created and locked) and retries there instead of believing it holds the daemon's lock.
    Without the check, that process and the next one to create the file would both hold "the" lock (two
    inodes): tests/server/test_security.py runs the interleaving."""

    def __init__(self, socket_path: Path, program: str = "wcache-server") -> None:
        self.path = Path(str(socket_path) + ".lock")
        self.program = program
        self.fd = -1

    def acquire(self, wait: float = 0.0) -> None:
        """Take the lock; with ``wait``, retry that many seconds (a hand-off: the old daemon releases it)."""
        deadline = time.monotonic() + wait
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise self._unusable(exc) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and time.monotonic() < deadline:
                    os.close(fd)
                    time.sleep(0.01)
                    continue
                self._refuse(fd, exc)
            if _same_file(fd, self.path):
                break
            os.close(fd)  # we locked a file its holder removed on its way out: lock the path's file instead
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {self.program}\n".encode())
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
            f"lock file {self.path} {why}: this {self.program} (uid {os.geteuid()}) cannot take the one-daemon "
            f"lock. If no daemon runs there, remove it (as its owner: rm {self.path}), or choose another "
            "--socket-path / --socket-dir",
            details={"path": str(self.path), "owner_uid": owner},
        )

    def _refuse(self, fd: int, exc: OSError) -> NoReturn:
        written = os.read(fd, 256).decode(errors="replace").split()
        os.close(fd)
        holder = written[0] if written else "unknown"
        program = written[1] if len(written) > 1 else self.program  # a lock file of an older version: pid only
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise DaemonRunningError(
                f"another {program} (pid {holder}) already serves {self.path.name[:-5]}: "
                f"lock {self.path} is held; stop it first or choose another --socket-path / --socket-dir",
                details={"holder_pid": holder, "holder": program},
            ) from exc
        raise self._unusable(exc) from exc

    def release(self) -> None:
        """Remove the lock file, then unlock (the order the class docstring shows safe)."""
        if self.fd >= 0:
            if _same_file(self.fd, self.path):
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            os.close(self.fd)
            self.fd = -1


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` (not followed) names the file open as ``fd``."""
    try:
        st, at = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (at.st_dev, at.st_ino)


class DirectoryHold:
    """A shared ``flock`` on a socket directory, held by each wcache-server and wcache-keeper using it from its
    checks to its exit, so that the last one to stop can remove a directory wcache creates on demand (the
    default one, ``removable``) without pulling it from under one that is starting.

    ``release`` removes the directory only under an exclusive ``flock`` of it, which no process using it can
    hold at the same time, and with ``rmdir``, which refuses a directory that is not empty (another program's
    files, a crashed daemon's socket). ``acquire`` checks, once it holds its shared lock, that the path still
    names the directory it locked, and starts over (``recreate`` making it again) if not: a process that opened
    the directory just before it was removed does not go on using a directory nobody can reach."""

    #: how long ``acquire`` waits out another process's exclusive lock (held only while it removes the directory)
    WAIT = 5.0

    def __init__(self, path: Path, *, removable: bool) -> None:
        self.path = path
        self.removable = removable
        self.fd = -1

    def acquire(self, recreate: Callable[[], object] | None = None, what: str = "socket directory") -> None:
        deadline = time.monotonic() + self.WAIT
        while True:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                if recreate is None or time.monotonic() > deadline:
                    check_private_dir(self.path, what)  # raises: it does not exist, and how to create it
                    raise
                recreate()
                continue
            except OSError:
                check_private_dir(self.path, what)  # a symlink or not a directory: its own message
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) and time.monotonic() < deadline:
                    time.sleep(0.01)  # another process is removing it: then it is gone, or kept
                    continue
                raise DaemonRunningError(
                    f"{what} {self.path} stayed locked by another process for {self.WAIT:.0f} s ({exc.strerror})",
                    details={"path": str(self.path)},
                ) from exc
            if _same_file(fd, self.path):
                break
            os.close(fd)
        self.fd = fd
        try:
            check_private_dir(self.path, what)  # the directory now held is the one checked
        except BaseException:
            self.release()
            raise

    def release(self) -> bool:
        """Unlock; first remove the directory if ``removable``, empty, and no other process holds it. Returns
        whether it was removed."""
        removed = False
        if self.fd < 0:
            return removed
        try:
            if self.removable:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _same_file(self.fd, self.path):
                    os.rmdir(self.path)
                    removed = True
        except OSError:
            pass  # another daemon or keeper uses it, or something else is in it: it stays
        finally:
            os.close(self.fd)
            self.fd = -1
        return removed


def hold_socket_dir(directory: Path) -> DirectoryHold:
    """Hold ``directory`` (checked already) while this process uses it: the default socket directory, which
    wcache creates on demand, is removed again by the last daemon or keeper to stop (DirectoryHold)."""
    default = Path(os.path.abspath(default_socket_dir()))
    hold = DirectoryHold(directory, removable=directory == default)
    hold.acquire(recreate=(lambda: ensure_socket_dir(default)) if hold.removable else None)
    return hold
