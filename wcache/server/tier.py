"""The host-memory tier: a copy of every loaded slab in shared memory, for fast reloads.

``wcache-server --host-tier BYTES`` keeps, in a private directory on tmpfs (default
``/dev/shm/wcache-<uid>``), one entry per served key: ``<id>.slab`` (the slab's bytes,
exactly as laid out) and ``<id>.meta``. A daemon restart, or a PRELOAD / load-on-demand of a
model evicted from the device, then fills the device slab from that file at host-to-device
speed instead of reading and sharding the checkpoint again. Deposits (write-back) are saved
once committed and restored when an engine asks for their recipe key after an eviction or a
restart: the recipe key names the checkpoint's fingerprint, so an engine of a changed
checkpoint never asks for an entry of the old one.

What a restore verifies (docs/security.md, "The host tier"):

- **the meta, whole**: ``<id>.meta`` is msgpack ``{format, body, sha256}``; ``body`` (msgpack:
  key, size, payload, tensor table, aliases, buffers, generation, sampled digest, block
  checksums) is used only if its SHA-256 matches, its key equals the key asked for (for a
  checkpoint: computed from the checkpoint *now*, so a changed checkpoint never reloads stale
  bytes), and its table, aliases and buffers are consistent with the slab;
- **the slab file**: its size, and a digest of 16 sampled 4 KiB blocks at lookup (a cheap
  early refusal); then, as the restore reads it, the CRC-32 of **every** 1 MiB block
  (``BlockCrcs``, checked by the loader on the bytes it copies: in the mapping or staging
  buffer it read them into, or read back from the slab where ``sendfile`` copied them in the
  kernel). A refill by one DMA copy from the page-locked file (CUDA) is the exception: it
  checks the meta, size and sampled digest only, and copies a file whose every block this
  daemon checked (its first, staged refill) or wrote (its own save) before pinning it;
  ``--verify-content`` pins nothing, so every refill is staged and checked;
- **the files themselves**: both must be regular files of the daemon's uid, mode 0600, one
  link, opened ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat``: a symlink, a FIFO, a
  directory or a hard link is never followed, read or waited on. An entry that is not what
  the daemon wrote is treated as absent and removed (one log line); a directory under an
  entry's name is left where it is (it is not the daemon's to remove) and logged once.

Generations (deposits): every committed deposit carries a random generation. Its COMMIT
replaces the key's entry with a *tombstone* (a meta of that generation and no slab) before
DEPOSITED is sent, and a deposit's save publishes only over its own tombstone; so the tier
holds for a recipe key the last generation committed (by any daemon sharing the directory)
or nothing, never an older one, a crash before the save included. A daemon that committed a
deposit asks for its generation only (``lookup(key, generation=...)``): another generation's
entry is then absent for it (between its COMMIT and the tombstone, the older one is still there). The
tombstone is written under the directory's lock only (``supersede`` says when it could not have it: the caller
retries). Checkpoint entries have no generation: their bytes follow from their key.

Entries are written to temporary names and renamed (slab first, meta last) under a lock on
the directory (``flock``, shared by every daemon using it): a present meta means a complete
slab. Entries beyond the budget are removed least recently used first (meta mtime, touched on
use). Several daemons of one user may share the directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from wcache.errors import ProtocolError, TierEntryError, WCacheError
from wcache.files import file_kind, read_at_most, write_new
from wcache.locks import exited
from wcache.plan.checkpoint import SAMPLE_BLOCK, _sample_offsets
from wcache.plan.key import WeightCacheKey
from wcache.proto import TensorTable
from wcache.server.backends.base import PinnedFile, Slab
from wcache.server.security import check_private_dir

__all__ = ["CHECK_BLOCK", "FORMAT", "BlockCrcs", "HostTier", "TierEntry", "default_tier_dir"]

log = logging.getLogger("wcache.tier")

FORMAT = 2
#: every block of this many bytes of a slab file has its CRC-32 in the meta (the last one may be shorter)
CHECK_BLOCK = 1 << 20
#: a meta file over this size is not read (a table of 1M tensors is ~100 MB); a save that would write one skips
MAX_META_BYTES = 256 << 20
#: how long a save or a commit waits for another process's publish to finish before giving up on the lock
LOCK_WAIT_S = 2.0
#: an inode number no file has: the file was absent when examined (``HostTier._refuse``)
ABSENT = -1

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_ERRORS = (WCacheError, ProtocolError, OSError, KeyError, TypeError, ValueError, msgpack.UnpackException)


def default_tier_dir() -> Path:
    return Path(f"/dev/shm/wcache-{os.geteuid()}")


class _Foreign(Exception):
    """A file under an entry's name that the daemon did not write (a symlink, a FIFO, a directory, a hard link,
    another owner or mode): the entry is absent. ``ino``: the inode of the file found (None: unknown), so that
    only that file is removed (``HostTier._refuse``) — a file removed or replaced while it was opened (an entry
    superseded or published meanwhile) leaves the new one in place."""

    def __init__(self, message: str, ino: int | None = None) -> None:
        super().__init__(message)
        self.ino = ino


@dataclass(frozen=True)
class BlockCrcs:
    """The CRC-32 of every ``block`` bytes of a slab file of ``size`` bytes (little-endian uint32 each). Called by
    the loader with bytes it read from the file at a block-aligned ``offset`` (``loader.BlockCheck``); raises
    TierEntryError on the first block that differs."""

    crcs: bytes
    size: int
    block: int = CHECK_BLOCK

    def __call__(self, offset: int, data: memoryview) -> None:
        if offset % self.block or offset + len(data) > self.size:
            raise TierEntryError(f"bytes {offset}..{offset + len(data)} are not whole checked blocks of the entry")
        for pos in range(0, len(data), self.block):
            i = (offset + pos) // self.block
            piece = data[pos : pos + self.block]
            if len(piece) != min(self.block, self.size - offset - pos):
                raise TierEntryError(f"block {i} of the entry was read in part only")
            if zlib.crc32(piece) != int.from_bytes(self.crcs[4 * i : 4 * i + 4], "little"):
                raise TierEntryError(
                    f"block {i} (bytes {offset + pos}..{offset + pos + len(piece)}) of the slab file differs from its "
                    "checksum (corrupted or rewritten)"
                )


@dataclass(frozen=True)
class TierEntry:
    slab_path: Path
    meta_path: Path
    size: int
    table: TensorTable
    aliases: dict[str, str]
    payload: int
    pinned: PinnedFile | None = None  # the slab file page-locked in this daemon by its backend
    buffers: tuple[str, ...] = ()  # a deposit's tensors that are module buffers (STATE's ``buffers``)
    generation: str = ""  # the deposit's generation ("" for a checkpoint's entry)
    check: BlockCrcs | None = None  # every block's checksum, verified as the restore reads it
    inode: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the slab file verified at lookup: the restore reads that
    meta_inode: int | None = None  # the inode of the meta file lookup read (``discard`` removes only that one)


def tier_holds(tier: HostTier | None, key: WeightCacheKey) -> bool:
    """Whether ``tier`` has a whole entry of ``key``: this node's own, checked copy, refilled from before any peer
    is asked (docs/fleet.md, "When a daemon fills")."""
    return tier is not None and tier.lookup(key) is not None


def _open_own(path: Path) -> int | None:
    """A read-only descriptor of ``path`` if it is a file as the daemon writes entries: regular (not a symlink:
    ``O_NOFOLLOW``), of this uid, mode 0600 or stricter, one link. None if absent; _Foreign otherwise. Never
    blocks (``O_NONBLOCK``: a FIFO swapped in after the ``lstat`` opens at once, then ``fstat`` refuses it)."""
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(before.st_mode):
        raise _Foreign(f"{path.name} is {file_kind(before.st_mode)}", before.st_ino)
    try:
        fd = os.open(path, _OPEN)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Foreign(f"{path.name} became a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise _Foreign(f"{path.name} was replaced while being opened", before.st_ino)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_nlink != 1:
            raise _Foreign(
                f"{path.name} is not as the daemon writes entries (uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}, {st.st_nlink} links; written: this uid, 0600, 1 link)",
                st.st_ino,
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pack_meta(body: dict[str, Any]) -> bytes:
    packed = msgpack.packb(body, use_bin_type=True)
    out: bytes = msgpack.packb(
        {"format": FORMAT, "body": packed, "sha256": hashlib.sha256(packed).digest()}, use_bin_type=True
    )
    return out


def _unpack_meta(raw: bytes) -> dict[str, Any]:
    """The body of a meta file, if its format is this one and its SHA-256 matches; TierEntryError otherwise."""
    outer: Any = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    if not isinstance(outer, dict) or outer.get("format") != FORMAT:
        raise TierEntryError(f"unknown tier format {outer.get('format') if isinstance(outer, dict) else '?'}")
    packed = outer.get("body")
    if not isinstance(packed, bytes) or hashlib.sha256(packed).digest() != outer.get("sha256"):
        raise TierEntryError("the meta's checksum differs (corrupted or rewritten)")
    body: Any = msgpack.unpackb(packed, raw=False, strict_map_key=True)
    if not isinstance(body, dict):
        raise TierEntryError("the meta's body is not a map")
    return body


def _digest(fd: int, size: int) -> str:
    h = hashlib.sha256(size.to_bytes(8, "little"))
    for off in _sample_offsets(size):
        h.update(os.pread(fd, SAMPLE_BLOCK, off))
    return h.hexdigest()


def _block_crcs(fd: int, size: int) -> bytes:
    """The CRC-32 of every CHECK_BLOCK of the file ``fd`` (``size`` bytes), on up to 8 threads (zlib releases the
    GIL): 1 GiB in 0.28-0.42 s on one core of the 2-core machine (benchmarks/results/tier_verify-cpu-2026-12-01.json)."""
    if size == 0:
        return b""
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
        view = memoryview(mm)
        try:
            blocks = range(0, size, CHECK_BLOCK)
            with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(blocks)))) as pool:
                crcs = list(pool.map(lambda off: zlib.crc32(view[off : off + CHECK_BLOCK]), blocks))
        finally:
            view.release()
    return b"".join(c.to_bytes(4, "little") for c in crcs)


def _unlink(path: Path) -> bool:
    """Remove an entry's file, never a directory (unlink refuses one: EISDIR). False if it is still there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


class HostTier:
    """``pin``: how to keep entries page-locked in this process for DMA-speed refills (the backend's
    ``pinner()``: CUDA backends), or None (every refill staged and checked block by block)."""

    def __init__(self, directory: Path, budget: int, *, pin: Callable[[Path, int], PinnedFile] | None = None) -> None:
        self.dir = Path(os.path.abspath(directory))
        self.budget = budget
        self.pin = pin
        self._pinned: dict[Path, PinnedFile] = {}
        self._lock = threading.Lock()
        #: one save at a time in this process: two saves of one key shared a temporary file (and the budget's
        #: count of what is stored), so a late one wrote into the entry the other had just completed
        self._save_lock = threading.Lock()
        #: this process's half of the directory lock (the flock is per open file: threads need their own order)
        self._publish_lock = threading.Lock()
        #: paths refused and left in place (directories): logged once, not at every lookup
        self._reported: set[Path] = set()
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=False)
        except FileExistsError:
            pass
        check_private_dir(self.dir, what="host tier directory")
        self._remove_dead_temporaries()

    @contextlib.contextmanager
    def _publishing(self, *, wait: bool = True) -> Iterator[None]:
        """Hold the directory's lock (every daemon sharing it): publishing an entry, a tombstone, or removing an
        entry happens under it. TimeoutError after LOCK_WAIT_S in all, this process's own half of the lock
        included (a process holding it that long is not a save); ``wait`` False: TimeoutError at once where
        either half is held (one attempt, no thread kept waiting)."""
        deadline = time.monotonic() + LOCK_WAIT_S
        got = self._publish_lock.acquire(timeout=LOCK_WAIT_S) if wait else self._publish_lock.acquire(blocking=False)
        if not got:
            raise TimeoutError(f"host tier directory {self.dir} is being published by this process")
        try:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if not wait or time.monotonic() > deadline:
                            raise TimeoutError(
                                f"host tier directory {self.dir} stayed locked for {LOCK_WAIT_S if wait else 0} s"
                            ) from None
                        time.sleep(0.001)
                yield
            finally:
                os.close(fd)  # releases the flock
        finally:
            self._publish_lock.release()

    def _remove_dead_temporaries(self) -> None:
        """Remove the temporary files of saves whose daemon died in the middle (``.<entry>.<pid>.tmp``,
        ``.metatmp``, ``.stonetmp``): on tmpfs they are memory, outside every budget. A live process's are left."""
        for p in self.dir.glob(".*.*tmp"):
            parts = p.name.split(".")
            if len(parts) < 4 or parts[-1] not in ("tmp", "metatmp", "stonetmp") or not parts[2].isdigit():
                continue
            pid = int(parts[2])
            if not exited(pid):  # alive (or not ours to signal), its save may be in progress
                continue
            try:
                size = os.lstat(p).st_size
            except FileNotFoundError:
                continue
            if _unlink(p):
                log.info("host tier removed %s bytes=%d (left by pid %d, which died during a save)", p.name, size, pid)

    @staticmethod
    def entry_id(key: WeightCacheKey) -> str:
        wire = msgpack.packb(sorted(key.to_wire().items()))
        return hashlib.sha256(wire).hexdigest()[:32]

    def _paths(self, key: WeightCacheKey) -> tuple[Path, Path]:
        i = self.entry_id(key)
        return self.dir / f"{i}.slab", self.dir / f"{i}.meta"

    def entries(self) -> list[tuple[Path, Path, int]]:
        """(slab, meta, bytes) of every complete entry, least recently used first: both regular files (a
        tombstone has no slab; a symlink or FIFO is not counted)."""
        return [(s, m, n) for s, m, n, _ in self._listing()]

    def _listing(self) -> list[tuple[Path, Path, int, tuple[int, int]]]:
        """``entries``, each with the (meta, slab) inodes listed: an eviction removes those files only."""
        out = []
        for meta in self.dir.glob("*.meta"):
            slab = meta.with_suffix(".slab")
            try:
                ms, ss = os.lstat(meta), os.lstat(slab)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(ms.st_mode) and stat.S_ISREG(ss.st_mode):
                out.append((ms.st_mtime, slab, meta, ss.st_size, (ms.st_ino, ss.st_ino)))
        return [(s, m, n, ino) for _, s, m, n, ino in sorted(out)]

    def _pin_in_background(self, slab: Path, size: int, inode: tuple[int, int]) -> None:
        """Page-lock the slab file ``inode`` (the one this daemon wrote or checked whole), through a descriptor
        opened as lookups open it: a file put in its place meanwhile is not pinned."""
        pinner = self.pin

        def pin() -> None:
            assert pinner is not None
            t0 = time.perf_counter()
            try:
                fd = _open_own(slab)
                if fd is None:
                    return
                try:
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) != inode:
                        log.info("host tier pin skipped entry=%s (the file was replaced meanwhile)", slab.stem)
                        return
                    p = pinner(Path(f"/proc/self/fd/{fd}"), size)  # the same open file, not the path again
                finally:
                    os.close(fd)
            except Exception as exc:  # a thread of its own: whatever goes wrong is logged, serving goes on
                log.warning("host tier pin failed entry=%s: %s: %s", slab.stem, type(exc).__name__, exc)
                return
            with self._lock:
                old = self._pinned.pop(slab, None)
                self._pinned[slab] = p
            if old is not None:
                old.close()
            try:
                gone = p.inode != inode[1] or os.lstat(slab).st_ino != inode[1]
            except FileNotFoundError:
                gone = True
            if gone:  # removed or rewritten while we pinned it
                self._unpin(slab)
                log.info("host tier pin dropped entry=%s (the file was removed or replaced meanwhile)", slab.stem)
                return
            log.info("host tier pinned entry=%s bytes=%d seconds=%.2f", slab.stem, size, time.perf_counter() - t0)

        if pinner is not None:
            threading.Thread(target=pin, name="wcache-tier-pin", daemon=True).start()

    def pin_later(self, entry: TierEntry) -> None:
        """After a refill from ``entry`` through staging (which checked every block): page-lock it now, so that
        the next refill (after an eviction) is one DMA copy. Not during the refill: both would compete for the
        driver and memory."""
        if entry.pinned is None:
            self._pin_in_background(entry.slab_path, entry.size, entry.inode)

    def pinned(self) -> int:
        """Entries page-locked in this process now (STATUS ``tier_pinned``): a refill from one is one DMA copy."""
        with self._lock:
            return len(self._pinned)

    def _unpin(self, slab: Path) -> None:
        with self._lock:
            p = self._pinned.pop(slab, None)
        if p is not None:
            p.close()

    def close(self) -> None:
        for slab in list(self._pinned):
            self._unpin(slab)

    def remove(self, slab: Path, meta: Path) -> None:
        self._unpin(slab)
        for p in (meta, slab):  # meta first: the entry stops existing before its bytes go
            _unlink(p)

    def _refuse(self, slab: Path, meta: Path, why: object, seen: tuple[int | None, int | None] = (None, None)) -> None:
        """An entry that cannot be used: its files removed (those the daemon may remove: not a directory, which
        is left in place) and one log line; a path left in place is logged once, not at every lookup. Under the
        directory lock where it can be had (a save of another process may be publishing the entry anew).

        ``seen``: the (meta, slab) inodes the caller examined — only those files are removed; another file at the
        path now (a tombstone or an entry published since, by a COMMIT or a save of this daemon or another) is
        left, and ``ABSENT`` (the file was missing) leaves whatever is there now. None: removed whatever it is
        (a file the daemon did not write: a symlink, another uid's). Before, a lookup that found the slab file
        missing — a COMMIT's tombstone had just replaced the entry — removed that tombstone by path: the tier
        recorded no generation of the key and the COMMIT's save was never published."""

        left = self._remove_examined(slab, meta, seen) or []
        if left and set(left) <= self._reported:
            return
        self._reported.update(left)
        kept = f"; left in place (not the daemon's to remove): {', '.join(p.name for p in left)}" if left else ""
        log.warning("host tier entry %s refused (%s)%s; treated as absent", meta.stem, why, kept)

    def _remove_examined(
        self, slab: Path, meta: Path, seen: tuple[int | None, int | None], *, evicting: bool = False
    ) -> list[Path] | None:
        """Remove an entry's meta and slab if they are still the files of inodes ``seen`` (None: whatever is there;
        ``ABSENT``: nothing), under the directory lock where it can be had; returns the paths left in place that
        should have gone (not the daemon's to remove: a directory), or None (``evicting``) when the slab
        at the path is not the one examined: nothing of it was freed (this daemon's page-locked copy
        of a slab goes only with that slab)."""

        def ours(p: Path, ino: int | None) -> bool:
            if ino is None:
                return True
            try:
                return os.lstat(p).st_ino == ino
            except FileNotFoundError:
                return False

        def remove() -> list[Path] | None:
            if evicting and not ours(slab, seen[1]):
                return None
            return [
                p for p, ino in ((meta, seen[0]), (slab, seen[1])) if ours(p, ino) and not self._remove_one(p, slab)
            ]

        try:
            with self._publishing():
                return remove()
        except (OSError, TimeoutError):
            return remove()

    def _remove_one(self, p: Path, slab: Path) -> bool:
        if p == slab:
            self._unpin(slab)
        return _unlink(p)

    def _read_meta(self, meta: Path) -> dict[str, Any] | None:
        """The meta's body (format and checksum verified); None if there is none. _Foreign, TierEntryError."""
        return self._read_meta_seen(meta, [None])

    def _read_meta_seen(self, meta: Path, seen: list[int | None]) -> dict[str, Any] | None:
        """``_read_meta``; ``seen[0]`` becomes the inode of the file it opened (``ABSENT`` if none) before it reads
        it, so that a caller refusing what it read removes that file only (``_refuse``)."""
        fd = _open_own(meta)
        if fd is None:
            seen[0] = ABSENT
            return None
        try:
            seen[0] = os.fstat(fd).st_ino
            raw = read_at_most(fd, MAX_META_BYTES + 1)
            if len(raw) > MAX_META_BYTES:
                raise TierEntryError(f"the meta file is over {MAX_META_BYTES} bytes")
            body = _unpack_meta(raw)
            os.utime(fd)  # least recently used goes first (through the descriptor: never a path followed)
        finally:
            os.close(fd)
        return body

    def lookup(self, key: WeightCacheKey, *, generation: str | None = None) -> TierEntry | None:
        """The entry for ``key`` if it is whole and as the daemon wrote it (the module docstring says what is
        checked here and what the restore checks as it reads); None otherwise, removing what is not. With
        ``generation`` (the deposit the daemon last committed under ``key``), another generation's entry is None
        too, and left in place."""
        slab, meta = self._paths(key)
        fd = -1
        seen: list[int | None] = [None, None]  # the meta's and the slab's inodes, as examined (``_refuse``)
        try:
            # the slab at the path before the meta is read: refused on the meta alone, that slab goes, not one a
            # save published meanwhile (it leaves the meta, so the new entry would be left without its bytes)
            try:
                seen[1] = os.lstat(slab).st_ino
            except FileNotFoundError:
                seen[1] = ABSENT
            body = self._read_meta_seen(meta, seen)
            if body is None:
                return None
            if body.get("key") != key.to_wire():
                raise TierEntryError("its key differs from the key asked for (the checkpoint's key now)")
            found = str(body.get("generation", ""))
            if body.get("tombstone"):
                return None  # a deposit committed, its save not (yet) done: nothing of this key in the tier
            if generation is not None and found != generation:
                log.info(
                    "host tier entry %s is generation %s, not %s (served): not restored", meta.stem, found, generation
                )
                return None
            size = int(body["size"])
            seen[1] = None  # examined anew: the file opened now
            opened = _open_own(slab)
            if opened is None:
                seen[1] = ABSENT
                raise TierEntryError("its slab file is missing")
            fd = opened
            st = os.fstat(fd)
            seen[1] = st.st_ino
            if st.st_size != size:
                raise TierEntryError(f"slab file has {st.st_size} bytes, the entry says {size}")
            if _digest(fd, size) != body.get("digest"):
                raise TierEntryError("sampled digest of the slab file differs (corrupted or rewritten)")
            crcs = body.get("crc32")
            if (
                body.get("block") != CHECK_BLOCK
                or not isinstance(crcs, bytes)
                or len(crcs) != 4 * -(-size // CHECK_BLOCK)
            ):
                raise TierEntryError("its block checksums do not cover the slab")
            table = TensorTable.from_wire(body["tensors"], [size])
            aliases = {str(a): str(t) for a, t in dict(body.get("aliases", {})).items()}
            buffers = tuple(str(b) for b in body.get("buffers", ()))
            names = set(table.names)
            if any(t not in names or a in names for a, t in aliases.items()) or not set(buffers) <= names | set(
                aliases
            ):
                raise TierEntryError("its aliases or buffers name tensors its table does not hold")
            with self._lock:
                pinned = self._pinned.get(slab)
            if pinned is not None and pinned.inode != st.st_ino:  # rewritten by another daemon
                self._unpin(slab)
                pinned = None
            return TierEntry(
                slab,
                meta,
                size,
                table,
                aliases,
                int(body["payload"]),
                pinned,
                buffers,
                found,
                BlockCrcs(crcs, size),
                (st.st_dev, st.st_ino),
                seen[0],
            )
        except _Foreign as exc:
            if seen[0] is None:  # the meta's: the file found, no other one published at its path since
                seen[0] = exc.ino
            elif seen[1] is None:  # the slab's, as opened
                seen[1] = exc.ino
            self._refuse(slab, meta, exc, (seen[0], seen[1]))
        except _ERRORS as exc:
            self._refuse(slab, meta, f"{type(exc).__name__}: {exc}", (seen[0], seen[1]))
        finally:
            if fd >= 0:
                os.close(fd)
        return None

    def generation_of(self, key: WeightCacheKey) -> str | None:
        """The generation of the deposit the tier records under ``key`` — its entry's or its tombstone's (the last
        committed by any daemon sharing the directory) — or None where it records none (no entry, a checkpoint's,
        or one it cannot read: ``lookup`` refuses those)."""
        _, meta = self._paths(key)
        try:
            body = self._read_meta(meta)
        except (_Foreign, *_ERRORS):
            return None
        if body is None or body.get("key") != key.to_wire():
            return None
        return str(body.get("generation", "")) or None

    def open_slab(self, entry: TierEntry) -> int:
        """A descriptor of the slab file ``lookup`` checked (the caller closes it); TierEntryError if another file
        is there now."""
        try:
            fd = _open_own(entry.slab_path)
        except (_Foreign, OSError) as exc:
            raise TierEntryError(f"the slab file cannot be opened as checked ({exc})") from None
        if fd is None:
            raise TierEntryError("the slab file was removed")
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != entry.inode or st.st_size != entry.size:
            os.close(fd)
            raise TierEntryError("the slab file was replaced since it was checked")
        return fd

    def discard(self, entry: TierEntry, why: object) -> None:
        """The restore found ``entry`` altered (a block's checksum): removed, unless its files were replaced
        meanwhile (then they are another save's)."""
        try:
            if os.lstat(entry.slab_path).st_ino != entry.inode[1]:
                return
        except FileNotFoundError:
            return
        self._refuse(entry.slab_path, entry.meta_path, why, (entry.meta_inode, entry.inode[1]))

    def supersede(
        self, key: WeightCacheKey, generation: str, *, latest: Callable[[], bool] | None = None, wait: bool = True
    ) -> bool:
        """A deposit of ``generation`` was committed under ``key``: from now on the tier holds nothing of the key
        but that generation's save. Replaces the entry by a tombstone of ``generation`` (the old slab removed),
        under the directory's lock; called before DEPOSITED is sent, so that no crash can leave an older deposit to
        restore. Where the tombstone cannot be written, the entry is removed under the lock all the same (a save
        then finds no tombstone of its generation and publishes nothing: the key is absent, never older).

        ``latest``, asked under the lock: whether ``generation`` is still the last one the caller committed under
        the key (False: a later COMMIT's tombstone comes after, nothing is written). True once the tier holds
        nothing older than ``generation``. False, with nothing changed, where the lock was not had within
        LOCK_WAIT_S: another daemon of the directory holds it, and may be about to publish an older generation it
        checked under it, after anything removed now (before, the entry was removed by path and the commit taken
        as settled: that daemon's older generation then stayed). The caller keeps the commit unsettled (its
        restores take ``generation`` only) and calls again. ``wait`` False: one attempt at the lock, False at once
        where it is held. Any other failure to take the lock (the directory cannot be opened: ENOENT, EMFILE)
        raises OSError: nothing changed, and it may not pass by itself.

        Where the tier records ``generation`` already (its tombstone, or its save), nothing is written: a retry
        after another process wrote the tombstone (the daemon this one took over from) keeps the save."""
        slab, meta = self._paths(key)
        tmp = self.dir / f".{meta.stem}.{os.getpid()}.stonetmp"
        try:
            with self._publishing(wait=wait):
                if latest is not None and not latest():
                    return True
                if self.generation_of(key) == generation:
                    return True
                try:
                    try:
                        write_new(tmp, _pack_meta({"key": key.to_wire(), "generation": generation, "tombstone": True}))
                        os.replace(tmp, meta)
                    finally:
                        _unlink(tmp)
                    self._remove_one(slab, slab)
                except OSError as exc:
                    self.remove(slab, meta)
                    log.warning(
                        "host tier tombstone for key=%s not written (%s: %s); its entry removed instead",
                        key.short(),
                        type(exc).__name__,
                        exc,
                    )
                return True
        except TimeoutError:  # the lock held (an OSError too: this comes first)
            return False

    def save(
        self,
        key: WeightCacheKey,
        slab: Slab,
        table: TensorTable,
        aliases: dict[str, str],
        payload: int,
        *,
        buffers: tuple[str, ...] = (),
        generation: str = "",
    ) -> bool:
        """Copy ``slab`` into the tier (evicting older entries to fit the budget). False if it cannot fit, or if
        it is a deposit (``generation``) that a later commit under the key superseded meanwhile (its tombstone
        is not this generation's). ``buffers``: a deposit's tensors that are module buffers (kept with it)."""
        with self._save_lock:
            return self._save(key, slab, table, aliases, payload, buffers, generation)

    def _save(
        self,
        key: WeightCacheKey,
        slab: Slab,
        table: TensorTable,
        aliases: dict[str, str],
        payload: int,
        buffers: tuple[str, ...],
        generation: str,
    ) -> bool:
        size = slab.size
        if size > self.budget:
            log.info("host tier skip key=%s bytes=%d over --host-tier %d", key.short(), size, self.budget)
            return False
        slab_path, meta_path = self._paths(key)
        entries = [e for e in self._listing() if e[0] != slab_path]
        used = sum(n for _, _, n, _ in entries)
        for old_slab, old_meta, n, seen in entries:
            if used + size <= self.budget:
                break
            # the files listed only: a tombstone or an entry published at the path since (another daemon's
            # COMMIT or save) is not this eviction's to remove, nor are its bytes freed
            if self._remove_examined(old_slab, old_meta, seen, evicting=True) is None:
                continue
            used -= n
            log.info("host tier evict entry=%s bytes=%d", old_meta.stem, n)
        t0 = time.perf_counter()
        tmp = self.dir / f".{slab_path.stem}.{os.getpid()}.tmp"
        tmp_meta = tmp.with_suffix(".metatmp")
        for p in (tmp, tmp_meta):  # this process's own, from a save that failed before it could clean up
            _unlink(p)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                slab.save_to(fd)
                st = os.fstat(fd)
                body = {
                    "key": key.to_wire(),
                    "generation": generation,
                    "size": size,
                    "payload": payload,
                    "tensors": table.to_wire(),
                    "aliases": dict(aliases),
                    "buffers": list(buffers),
                    "digest": _digest(fd, size),
                    "block": CHECK_BLOCK,
                    "crc32": _block_crcs(fd, size),
                }
            finally:
                os.close(fd)
            packed = _pack_meta(body)
            if len(packed) > MAX_META_BYTES:
                log.info(
                    "host tier skip key=%s: its meta is %d bytes (over %d)", key.short(), len(packed), MAX_META_BYTES
                )
                return False
            write_new(tmp_meta, packed)
            with self._publishing():
                if generation and not self._tombstone_of(meta_path, key, generation):
                    log.info(
                        "host tier save of key=%s generation=%s dropped: the entry is not this generation's tombstone "
                        "(a later deposit was committed under the key, or the entry was removed)",
                        key.short(),
                        generation,
                    )
                    return False
                self._unpin(slab_path)  # a pinned mapping of an older file with this name
                os.replace(tmp, slab_path)
                try:
                    os.replace(tmp_meta, meta_path)
                except BaseException:
                    _unlink(slab_path)  # a slab without its meta would be memory no budget counts
                    raise
        finally:
            for p in (tmp, tmp_meta):
                _unlink(p)
        secs = time.perf_counter() - t0
        self._pin_in_background(slab_path, size, (st.st_dev, st.st_ino))
        log.info(
            "host tier saved key=%s bytes=%d seconds=%.2f gb_s=%.2f dir=%s used=%d budget=%d",
            key.short(),
            size,
            secs,
            size / secs / 1e9 if secs > 0 else 0.0,
            self.dir,
            used + size,
            self.budget,
        )
        return True

    def _tombstone_of(self, meta: Path, key: WeightCacheKey, generation: str) -> bool:
        """Whether ``meta`` is the tombstone ``supersede`` wrote for this generation of ``key`` (the one place a
        deposit's save may publish)."""
        try:
            body = self._read_meta(meta)
        except (_Foreign, *_ERRORS):
            return False
        return (
            body is not None
            and bool(body.get("tombstone"))
            and body.get("generation") == generation
            and body.get("key") == key.to_wire()
        )
