"""The one way wcache opens a file named by a checkpoint directory (or a plan file).

A checkpoint directory belongs to whoever wrote it, and the daemon reads it with its own
privileges, so every file it opens there goes through :func:`open_regular` (docs/security.md,
"Checkpoint files"):

- **Symlinks are followed** — a Hugging Face cache snapshot is a directory of symlinks into
  ``blobs/`` — but what they lead to must be a **regular file**. FIFOs, devices, sockets and
  directories are refused by ``stat`` before anything is opened (no device is ever opened) and
  again by ``fstat`` after the open (a file swapped in between is caught).
- Files are opened ``O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC``: a FIFO swapped in between
  the ``stat`` and the ``open`` does not block the open (and is then refused by ``fstat``).
  ``O_NONBLOCK`` has no effect on reads of regular files.
- Metadata (JSON) is read through that descriptor with a **size cap** (:func:`read_metadata`):
  never more than cap + 1 bytes, whatever the file claims.
- The caller **keeps the descriptor**: the checkpoint's fingerprint, headers and tensor data
  are all read from it, so replacing a file after it was validated changes nothing that is served.

Errors are the caller's error class (``CheckpointError`` for checkpoints, ``ShardingError`` for
plan files), name the file and say what to do.

The daemon's own small files (the host tier's metadata, the commit record) are written the other way round:
:func:`write_new` creates the file, never through a link, and writes all of it. Files written for others to read
(a synthetic checkpoint's) get :func:`created_mode`, what ``open()`` gives a new file under the process umask.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from wcache.errors import CheckpointError, WCacheError

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_INDEX_BYTES",
    "created_mode",
    "file_kind",
    "open_regular",
    "read_at_most",
    "read_capped",
    "read_capped_stat",
    "read_metadata",
]

#: config.json, generation_config.json, shard-plan files: a few KB in practice.
MAX_CONFIG_BYTES = 16 << 20
#: model.safetensors.index.json: ~100 bytes per tensor (DeepSeek-V3's 91k tensors: ~9 MB).
MAX_INDEX_BYTES = 64 << 20

_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, for an error message ("a FIFO", "a symlink" from ``lstat``...)."""
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(
    path: str | os.PathLike[str], *, what: str = "file", error: type[WCacheError] = CheckpointError
) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only, following symlinks, if it is a regular file; return ``(fd, fstat)``.

    Raises ``error`` (from the OSError) when it is missing, unreadable or anything but a regular
    file; ``FileNotFoundError`` travels as ``__cause__`` so that callers can treat an optional
    file's absence apart.
    """
    p = os.fspath(path)
    try:
        before = os.stat(p)
        if not stat.S_ISREG(before.st_mode):
            raise error(f"{p}: {what} is {file_kind(before.st_mode)}; it must be a regular file (or a symlink to one)")
        fd = os.open(p, _FLAGS)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        reason = "does not exist" if isinstance(exc, FileNotFoundError) else f"cannot be opened ({exc})"
        raise error(f"{p}: {what} {reason}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(
                f"{p}: {what} is {file_kind(st.st_mode)} (replaced while being opened); it must be a regular file"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_capped(
    path: str | os.PathLike[str], limit: int, *, what: str = "file", error: type[WCacheError] = CheckpointError
) -> bytes:
    """All of a regular file's bytes, refusing one of more than ``limit`` bytes (reads at most limit + 1)."""
    return read_capped_stat(path, limit, what=what, error=error)[0]


def read_capped_stat(
    path: str | os.PathLike[str], limit: int, *, what: str = "file", error: type[WCacheError] = CheckpointError
) -> tuple[bytes, os.stat_result]:
    """:func:`read_capped`, with the ``fstat`` of the descriptor the bytes were read through: the file that was
    read, whatever ``path`` names by the time the caller looks again."""
    fd, st = open_regular(path, what=what, error=error)
    try:
        if st.st_size > limit:
            raise error(f"{os.fspath(path)}: {what} is {st.st_size} bytes, over the {limit}-byte limit for metadata")
        data = read_at_most(fd, limit + 1)
    except OSError as exc:
        raise error(f"{os.fspath(path)}: {what} cannot be read ({exc})") from exc
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while read
        raise error(f"{os.fspath(path)}: {what} is over the {limit}-byte limit for metadata")
    return data, st


def read_at_most(fd: int, n: int) -> bytes:
    """The bytes of ``fd`` from its position on, up to ``n`` (fewer at the end of the file)."""
    chunks: list[bytes] = []
    got = 0
    while got < n:
        chunk = os.read(fd, min(1 << 20, n - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes, where: str, *, error: type[WCacheError] = CheckpointError) -> Any:
    """``json.loads`` whose every failure (bad UTF-8, bad JSON, nesting too deep) is ``error``."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise error(f"{where}: not valid JSON ({detail})") from None


def read_metadata(
    path: Path, limit: int, *, what: str = "file", error: type[WCacheError] = CheckpointError
) -> tuple[bytes, os.stat_result] | None:
    """:func:`read_capped_stat` of an optional metadata file (``config.json``, the index): None where it does not
    exist; a dangling symlink is ``error``, as it names a file that should be there."""
    try:
        return read_capped_stat(path, limit, what=what, error=error)
    except WCacheError as exc:
        if isinstance(exc.__cause__, FileNotFoundError) and not path.is_symlink():
            return None
        raise


def write_new(path: str | os.PathLike[str], data: bytes, mode: int = 0o600) -> None:
    """Create ``path`` (it must not exist: O_EXCL; a symbolic link there is not followed: O_NOFOLLOW) with ``mode``
    and write all of ``data``; OSError as the OS says. The caller renames it into place."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def created_mode(mode: int = 0o666) -> int:
    """The permission bits of a file created with ``mode`` (``open()``'s 0o666 by default) under the process umask,
    as a file written the ordinary way gets them: for a writer that makes its files 0600 whatever the umask (the
    safetensors library). The umask is read from /proc/self/status (Linux 4.7 on), else set and set back."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, ValueError, StopIteration, IndexError):
        umask = os.umask(0o077)
        os.umask(umask)
    return mode & ~umask & 0o7777
