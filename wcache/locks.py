"""Who holds a daemon's lock (``<socket>.lock``, an exclusive ``flock``): read from ``/proc/locks``, matched by
device and inode, never by taking the lock (a daemon starting that moment would then fail) nor from the pid
written inside the file (it stays after a SIGKILL, and any process of the uid can write it). Shared by the
keeper's owner check and the client's wait for a restarting daemon; imports nothing heavy. Also ``exited``: whether
the process that named a temporary file after its pid is gone."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["exited", "lock_holder", "lock_holders"]


def lock_holder(socket_path: str | os.PathLike[str], proc_locks: str = "/proc/locks") -> int | None:
    """The pid holding the exclusive ``flock`` of ``<socket_path>.lock`` (0: held by a process whose pid is not
    visible here, e.g. in another pid namespace), or None when nobody holds it or it cannot be told (no lock
    file, no ``/proc/locks``)."""
    return lock_holders([socket_path], proc_locks).get(str(socket_path))


def lock_holders(socket_paths: Iterable[str | os.PathLike[str]], proc_locks: str = "/proc/locks") -> dict[str, int]:
    """``lock_holder`` of many sockets from one read of ``/proc/locks``: socket path -> holder pid, for those
    whose lock is held (the others are left out)."""
    files: dict[tuple[int, int, int], str] = {}
    for path in socket_paths:
        try:
            st = os.stat(str(Path(path)) + ".lock")
        except OSError:
            continue
        files[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = str(path)
    if not files:
        return {}
    try:
        with open(proc_locks) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return {}
    held: dict[str, int] = {}
    for line in lines:
        f = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12345 fe:00:2148881 0 EOF"; waiters ("1: -> FLOCK ...") hold nothing
        if len(f) < 6 or f[1] != "FLOCK" or f[3] != "WRITE":
            continue
        try:
            maj, mnr, ino = f[5].split(":")
            name = files.get((int(maj, 16), int(mnr, 16), int(ino)))
        except ValueError:
            continue
        if name is None or name in held:
            continue
        try:
            held[name] = max(int(f[4]), 0)
        except ValueError:
            held[name] = 0
    return held


def exited(pid: int) -> bool:
    """Whether no process ``pid`` exists (a writer that named its temporary file after its pid died mid-write):
    False for this process, one alive, and one not ours to signal (EPERM: it may be writing)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False
