"""The host-memory tier: a copy of every loaded slab in shared memory, for fast reloads.

``wcache-server --host-tier BYTES`` keeps, in a private directory on tmpfs (default
``/dev/shm/wcache-<uid>``), one entry per served key: ``<id>.slab`` (the slab's bytes,
exactly as laid out) and ``<id>.meta`` (msgpack: format, key, tensor table, aliases,
payload bytes, size, sampled digest, a deposit's buffers). A daemon restart, or a PRELOAD /
load-on-demand of a model evicted from the device, then fills the device slab from that file at
host-to-device speed instead of reading and sharding the checkpoint again. Deposits (write-back)
are saved once committed and restored when an engine asks for their recipe key after an eviction
or a restart: the recipe key names the checkpoint's fingerprint, so an engine of a changed
checkpoint never asks for an entry of the old one.

An entry is used only if its key equals the key the daemon computes from the checkpoint
*now* (names, headers and sampled data blocks: the fingerprint, so a changed checkpoint
never reloads stale bytes), its size matches and a digest of 16 sampled 4 KiB blocks of
the slab file matches; anything else is logged, removed and loaded from disk. Entries are
written to temporary names and renamed (slab first, meta last): a present meta means a
complete slab. Entries beyond the budget are removed least recently used first (meta
mtime, touched on use). Several daemons of one user may share the directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from wcache.checkpoint import SAMPLE_BLOCK, _sample_offsets
from wcache.errors import ProtocolError, TierEntryError, WCacheError
from wcache.key import WeightCacheKey
from wcache.proto import TensorTable
from wcache.server.backends.base import PinnedFile, Slab
from wcache.server.security import check_private_dir

__all__ = ["FORMAT", "HostTier", "TierEntry", "default_tier_dir"]

log = logging.getLogger("wcache.tier")

FORMAT = 1


def default_tier_dir() -> Path:
    return Path(f"/dev/shm/wcache-{os.geteuid()}")


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


def _digest(path: Path, size: int) -> str:
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as fh:
        for off in _sample_offsets(size):
            h.update(os.pread(fh.fileno(), SAMPLE_BLOCK, off))
    return h.hexdigest()


class HostTier:
    """``pin``: how to keep entries page-locked in this process for DMA-speed refills (the backend's
    ``pinner()``: CUDA backends), or None."""

    def __init__(self, directory: Path, budget: int, *, pin: Callable[[Path, int], PinnedFile] | None = None) -> None:
        self.dir = Path(os.path.abspath(directory))
        self.budget = budget
        self.pin = pin
        self._pinned: dict[Path, PinnedFile] = {}
        self._lock = threading.Lock()
        #: one save at a time in this process: two saves of one key shared a temporary file (and the budget's
        #: count of what is stored), so a late one wrote into the entry the other had just completed
        self._save_lock = threading.Lock()
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=False)
        except FileExistsError:
            pass
        check_private_dir(self.dir, what="host tier directory")
        self._remove_dead_temporaries()

    def _remove_dead_temporaries(self) -> None:
        """Remove the temporary files of saves whose daemon died in the middle (``.<entry>.<pid>.tmp`` and
        ``.metatmp``): on tmpfs they are memory, outside every budget. A live process's save is left alone."""
        for p in self.dir.glob(".*.*tmp"):
            parts = p.name.split(".")
            if len(parts) < 4 or parts[-1] not in ("tmp", "metatmp") or not parts[2].isdigit():
                continue
            pid = int(parts[2])
            if pid == os.getpid():
                continue
            try:
                os.kill(pid, 0)
                continue  # alive (or not ours to signal: EPERM), its save may be in progress
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            try:
                size = p.stat().st_size
                p.unlink()
            except FileNotFoundError:
                continue
            log.info("host tier removed %s bytes=%d (left by pid %d, which died during a save)", p.name, size, pid)

    @staticmethod
    def entry_id(key: WeightCacheKey) -> str:
        wire = msgpack.packb(sorted(key.to_wire().items()))
        return hashlib.sha256(wire).hexdigest()[:32]

    def _paths(self, key: WeightCacheKey) -> tuple[Path, Path]:
        i = self.entry_id(key)
        return self.dir / f"{i}.slab", self.dir / f"{i}.meta"

    def entries(self) -> list[tuple[Path, Path, int]]:
        """(slab, meta, bytes) of every complete entry, least recently used first."""
        out = []
        for meta in self.dir.glob("*.meta"):
            slab = meta.with_suffix(".slab")
            try:
                out.append((meta.stat().st_mtime, slab, meta, slab.stat().st_size))
            except FileNotFoundError:
                continue
        return [(s, m, n) for _, s, m, n in sorted(out)]

    def _pin_in_background(self, slab: Path, size: int) -> None:
        pinner = self.pin

        def pin() -> None:
            assert pinner is not None
            t0 = time.perf_counter()
            try:
                p = pinner(slab, size)
            except Exception as exc:  # a thread of its own: whatever goes wrong is logged, serving goes on
                log.warning("host tier pin failed entry=%s: %s: %s", slab.stem, type(exc).__name__, exc)
                return
            with self._lock:
                old = self._pinned.pop(slab, None)
                self._pinned[slab] = p
            if old is not None:
                old.close()
            try:
                gone = os.stat(slab).st_ino != p.inode
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
        """After a refill from ``entry`` through staging: page-lock it now, so that the next refill (after
        an eviction) is one DMA copy. Not during the refill: both would compete for the driver and memory."""
        if entry.pinned is None:
            self._pin_in_background(entry.slab_path, entry.size)

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
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def lookup(self, key: WeightCacheKey) -> TierEntry | None:
        slab, meta = self._paths(key)
        if not meta.exists():
            return None
        try:
            m: Any = msgpack.unpackb(meta.read_bytes(), raw=False, strict_map_key=True)
            if not isinstance(m, dict) or m.get("format") != FORMAT:
                raise TierEntryError(f"unknown tier format {m.get('format') if isinstance(m, dict) else m!r}")
            if m.get("key") != key.to_wire():
                raise TierEntryError("its key differs from the checkpoint's key now")
            size = int(m["size"])
            if slab.stat().st_size != size:
                raise TierEntryError(f"slab file has {slab.stat().st_size} bytes, the entry says {size}")
            if _digest(slab, size) != m.get("digest"):
                raise TierEntryError("sampled digest of the slab file differs (corrupted or rewritten)")
            table = TensorTable.from_wire(m["tensors"], [size])
            aliases = {str(a): str(t) for a, t in dict(m.get("aliases", {})).items()}
            with self._lock:
                pinned = self._pinned.get(slab)
            if pinned is not None and pinned.inode != slab.stat().st_ino:  # rewritten by another daemon
                self._unpin(slab)
                pinned = None
            buffers = tuple(str(b) for b in m.get("buffers", ()))
            names = set(table.names)
            if any(t not in names or a in names for a, t in aliases.items()) or not set(buffers) <= names | set(
                aliases
            ):
                raise TierEntryError("its aliases or buffers name tensors its table does not hold")
            entry = TierEntry(slab, meta, size, table, aliases, int(m["payload"]), pinned, buffers)

        except (WCacheError, ProtocolError, OSError, KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            log.warning("host tier entry %s rejected (%s); removed, loading from disk", meta.name, exc)
            self.remove(slab, meta)
            return None
        os.utime(meta)  # least recently used goes first
        return entry

    def save(
        self,
        key: WeightCacheKey,
        slab: Slab,
        table: TensorTable,
        aliases: dict[str, str],
        payload: int,
        *,
        buffers: tuple[str, ...] = (),
    ) -> bool:
        """Copy ``slab`` into the tier (evicting older entries to fit the budget). False if it cannot fit.
        ``buffers``: a deposit's tensors that are module buffers (kept with the entry)."""
        with self._save_lock:
            return self._save(key, slab, table, aliases, payload, buffers)

    def _save(
        self,
        key: WeightCacheKey,
        slab: Slab,
        table: TensorTable,
        aliases: dict[str, str],
        payload: int,
        buffers: tuple[str, ...],
    ) -> bool:
        size = slab.size
        if size > self.budget:
            log.info("host tier skip key=%s bytes=%d over --host-tier %d", key.short(), size, self.budget)
            return False
        slab_path, meta_path = self._paths(key)
        entries = [e for e in self.entries() if e[0] != slab_path]
        used = sum(n for _, _, n in entries)
        for old_slab, old_meta, n in entries:
            if used + size <= self.budget:
                break
            self.remove(old_slab, old_meta)
            used -= n
            log.info("host tier evict entry=%s bytes=%d", old_meta.stem, n)
        t0 = time.perf_counter()
        tmp = self.dir / f".{slab_path.stem}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            try:
                slab.save_to(fd)
            finally:
                os.close(fd)
            meta = {
                "format": FORMAT,
                "key": key.to_wire(),
                "size": size,
                "payload": payload,
                "tensors": table.to_wire(),
                "aliases": dict(aliases),
                "buffers": list(buffers),
                "digest": _digest(tmp, size),
            }
            tmp_meta = tmp.with_suffix(".metatmp")
            tmp_meta.write_bytes(msgpack.packb(meta, use_bin_type=True))
            os.chmod(tmp_meta, 0o600)
            self._unpin(slab_path)  # a pinned mapping of an older file with this name
            os.replace(tmp, slab_path)
            os.replace(tmp_meta, meta_path)
        except BaseException:
            for p in (tmp, tmp.with_suffix(".metatmp")):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
            raise
        secs = time.perf_counter() - t0
        self._pin_in_background(slab_path, size)
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
