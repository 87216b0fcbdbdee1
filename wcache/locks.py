"""Who holds a daemon's lock (``<socket>.lock``, an exclusive ``flock``): read from ``/proc/locks``, matched by
device and inode, never by taking the lock (a daemon starting that moment would then fail) nor from the pid
written inside the file (it stays after a SIGKILL, and any process of the uid can write it). Shared by the
keeper's owner check and the client's wait for a restarting daemon; imports nothing heavy."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["lock_holder"]


def lock_holder(socket_path: str | os.PathLike[str], proc_locks: str = "/proc/locks") -> int | None:
    """The pid holding the exclusive ``flock`` of ``<socket_path>.lock`` (0: held by a process whose pid is not
    visible here, e.g. in another pid namespace), or None when nobody holds it or it cannot be told (no lock
    file, no ``/proc/locks``)."""
    try:
        st = os.stat(str(Path(socket_path)) + ".lock")
        with open(proc_locks) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in lines:
        f = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12345 fe:00:2148881 0 EOF"; waiters ("1: -> FLOCK ...") hold nothing
        if len(f) < 6 or f[1] != "FLOCK" or f[3] != "WRITE":
            continue
        try:
            maj, mnr, ino = f[5].split(":")
            if (int(maj, 16), int(mnr, 16), int(ino)) != want:
                continue
        except ValueError:
            continue
        try:
            return max(int(f[4]), 0)
        except ValueError:
            return 0
    return None
