"""The host tier's files (wcache/server/tier.py): two saves of one key at once, what a daemon killed in the
middle of a save leaves behind, a deposit's save that a later commit superseded, files under an entry's name that
the daemon did not write, and the block checksums a refill verifies on every copy path."""

from __future__ import annotations

import asyncio
import fcntl
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from tests.conftest import DaemonProc
from wcache import WCacheClient
from wcache.plan.key import RankSpec, WeightCacheKey
from wcache.plan.recipe import RecipeKey
from wcache.proto.table import TensorEntry, TensorTable
from wcache.server.tier import HostTier

SIZE = 1 << 20


class _Slab:
    """A slab whose bytes are ``fill``; ``save_to`` can stop half way until ``resume`` is set."""

    def __init__(self, fill: int, *, halfway: threading.Event | None = None) -> None:
        self.size = SIZE
        self.data = bytes([fill]) * SIZE
        self.halfway = halfway
        self.resume = threading.Event()

    def save_to(self, fd: int) -> None:
        half = SIZE // 2
        os.pwrite(fd, self.data[:half], 0)
        if self.halfway is not None:
            self.halfway.set()
            assert self.resume.wait(30)
        os.pwrite(fd, self.data[half:], half)


def _table() -> TensorTable:
    return TensorTable.from_entries([TensorEntry("w", "uint8", (SIZE,), (1,), 0, 0)])


def test_two_saves_of_one_key_at_once_do_not_mix_their_bytes(ckpt: Path, tmp_path: Path) -> None:
    """A deposit replaced by another of the same recipe key is saved again while the first save runs: both
    wrote one temporary file (its name was the entry's and the pid), so the late save's bytes went into the
    entry the other had just completed. The entry must be one slab's bytes, whole."""
    tier = HostTier(tmp_path / "tier", 1 << 30)
    key = WeightCacheKey.from_checkpoint(ckpt)
    halfway = threading.Event()
    first, second = _Slab(1, halfway=halfway), _Slab(2)
    errors: list[BaseException] = []

    def save_first() -> None:
        try:
            tier.save(key, first, _table(), {}, SIZE)  # type: ignore[arg-type]
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    t = threading.Thread(target=save_first)
    t.start()
    assert halfway.wait(30)
    done = threading.Thread(target=tier.save, args=(key, second, _table(), {}, SIZE))
    done.start()
    done.join(0.5)  # the second save may wait for the first (it must not interleave with it)
    first.resume.set()
    t.join(30)
    done.join(30)
    assert not t.is_alive() and not done.is_alive() and not errors
    entry = tier.lookup(key)
    assert entry is not None
    data = entry.slab_path.read_bytes()
    assert data in (first.data, second.data)
    assert not [p.name for p in tier.dir.iterdir() if p.suffix not in (".slab", ".meta")]  # no temporary left


def test_temporary_files_of_a_dead_daemon_are_removed(tmp_path: Path) -> None:
    """A daemon killed during a save left its temporary slab in the tier directory (tmpfs: memory) for
    good, outside every budget. The next HostTier on the directory removes those of dead processes only."""
    tier_dir = tmp_path / "tier"
    HostTier(tier_dir, 1 << 30)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    dead_pid = int(dead.stdout)
    stem = "0" * 32
    left = [tier_dir / f".{stem}.{dead_pid}.tmp", tier_dir / f".{stem}.{dead_pid}.metatmp"]
    alive = [tier_dir / f".{stem}.{os.getpid()}.tmp"]  # another live daemon's save in progress
    for p in left + alive:
        p.write_bytes(b"x" * 4096)
    HostTier(tier_dir, 1 << 30)
    assert [p.exists() for p in left] == [False, False]
    assert alive[0].exists()


def test_an_eviction_during_a_save_frees_the_slab_after_the_save() -> None:
    """A deposit is saved to the tier in a thread while the daemon serves on; an EVICT meanwhile closes the model.
    The slab must stay open until the save has read it (a host slab's fd could otherwise be reused under the save,
    a CUDA slab unmapped), and be freed right after; a model closed already is not saved."""
    from wcache.server.loader import LoadStats
    from wcache.server.store import ServedModel

    class Slab:
        size = SIZE
        closed = 0

        def close(self) -> None:
            self.closed += 1

    slab = Slab()
    key = WeightCacheKey("f", "A", 1, 0, "bfloat16")
    stats = LoadStats(SIZE, SIZE, 0.1)
    model = ServedModel(key, _table(), {}, [cast("Any", slab)], cast("Any", object()), SIZE, stats)
    assert model.hold()
    model.close()  # the eviction, while the save holds it
    assert slab.closed == 0 and not model.hold()  # still open for the save; nothing new may hold it
    model.release_hold()
    assert slab.closed == 1 and model.slabs == []
    model.close()
    assert slab.closed == 1


def test_an_entry_whose_aliases_or_buffers_name_no_tensor_is_rejected(tmp_path: Path) -> None:
    """A meta file (same user, private directory) whose aliases or buffers point outside its table would make every
    fetch of it fail in the client: the entry is rejected and removed instead, and the model loaded as usual. (Its
    checksum is made to match: the table's consistency is checked on its own.)"""
    from wcache.server.tier import _pack_meta, _unpack_meta

    tier = HostTier(tmp_path / "tier", 1 << 30)
    key = WeightCacheKey("f", "A", 1, 0, "bfloat16")
    for bad in ({"aliases": {"x": "missing"}}, {"buffers": ["missing"]}, {"aliases": {"w": "w"}}):
        assert tier.save(key, cast("Any", _Slab(3)), _table(), {}, SIZE)
        slab, meta = tier._paths(key)
        m = _unpack_meta(meta.read_bytes())
        m.update(bad)
        meta.write_bytes(_pack_meta(m))
        assert tier.lookup(key) is None, bad
        assert not meta.exists() and not slab.exists()
    assert tier.save(key, cast("Any", _Slab(3)), _table(), {}, SIZE)
    assert tier.lookup(key) is not None


def test_a_deposits_save_publishes_only_over_its_own_tombstone(tmp_path: Path) -> None:
    """v1's save is still running when v2 is committed under the key (``supersede``, before DEPOSITED): v1 must not
    be published after that, or a crash before v2's save would leave v1 to restore. v2's save then publishes."""
    tier = HostTier(tmp_path / "tier", 1 << 30)
    key = WeightCacheKey("f", "A", 1, 0, "bfloat16")
    tier.supersede(key, "g1")
    halfway = threading.Event()
    v1, v2 = _Slab(1, halfway=halfway), _Slab(2)
    saved: list[bool] = []
    t = threading.Thread(target=lambda: saved.append(tier.save(key, v1, _table(), {}, SIZE, generation="g1")))  # type: ignore[arg-type]
    t.start()
    assert halfway.wait(30)
    tier.supersede(key, "g2")  # v2 committed while v1 is being written
    v1.resume.set()
    t.join(30)
    assert saved == [False] and tier.lookup(key) is None
    assert not tier.save(key, cast("Any", _Slab(3)), _table(), {}, SIZE, generation="g1")  # late, any time
    assert tier.save(key, cast("Any", v2), _table(), {}, SIZE, generation="g2")
    entry = tier.lookup(key)
    assert entry is not None and entry.generation == "g2" and entry.slab_path.read_bytes() == v2.data
    assert tier.lookup(key, generation="g1") is None  # a daemon that committed g1 never restores another
    assert [p.name for p in tier.dir.iterdir() if p.suffix not in (".slab", ".meta")] == []


def _lookup_with_deadline(tier: HostTier, key: WeightCacheKey) -> object:
    """``tier.lookup(key)`` in a thread: a lookup that blocks (a FIFO opened for reading) fails here, not forever."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(tier.lookup(key)), daemon=True)
    t.start()
    t.join(10)
    assert out, "lookup blocked"
    return out[0]


def _release(path: Path) -> None:
    """Let a reader stuck opening the FIFO ``path`` go (only a lookup that blocked would be)."""
    if path.exists() and stat.S_ISFIFO(os.lstat(path).st_mode):
        os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))


@pytest.mark.parametrize("which", ["meta", "slab"])
@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory", "hardlink", "mode"])
def test_a_file_the_daemon_did_not_write_is_absent_never_followed_or_waited_on(
    tmp_path: Path, which: str, kind: str
) -> None:
    """An entry's meta or slab replaced by a FIFO, a symlink to a copy of the real file outside the directory, a
    directory, a second link to the file, or a copy readable by others: the lookup answers at once, None, and
    removes what is the daemon's (not a directory, nor the file a link points at); the budget does not count it;
    the key is saved again afterwards, except over a directory (which stays, and the save fails)."""
    tier = HostTier(tmp_path / "tier", 1 << 30)
    key = WeightCacheKey("f", "A", 1, 0, "bfloat16")
    assert tier.save(key, cast("Any", _Slab(4)), _table(), {}, SIZE)
    slab, meta = tier._paths(key)
    path = meta if which == "meta" else slab
    outside = tmp_path / f"outside.{which}"
    outside.write_bytes(path.read_bytes())
    os.chmod(outside, 0o666)
    keep = path.with_name("kept")
    if kind == "hardlink":
        os.link(path, keep)  # the daemon's own file, with a second name
    else:
        path.unlink()
        if kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "symlink":
            path.symlink_to(outside)
        elif kind == "directory":
            path.mkdir()
        else:
            path.write_bytes(outside.read_bytes())
            os.chmod(path, 0o644)
    try:
        assert _lookup_with_deadline(tier, key) is None
        assert tier.entries() == []
        assert outside.read_bytes() and stat.S_IMODE(outside.stat().st_mode) == 0o666  # never touched
        assert path.is_dir() if kind == "directory" else not os.path.lexists(path)
        if kind == "directory":
            with pytest.raises(OSError):
                tier.save(key, cast("Any", _Slab(5)), _table(), {}, SIZE)
            assert tier.entries() == [] and _lookup_with_deadline(tier, key) is None
        else:
            assert tier.save(key, cast("Any", _Slab(5)), _table(), {}, SIZE)
            entry = tier.lookup(key)
            assert entry is not None and entry.slab_path.read_bytes() == bytes([5]) * SIZE
    finally:
        _release(path)
    if kind == "hardlink":
        assert keep.exists()  # the other name is not the entry's: left alone


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("where", ["none", "first", "middle", "last"])
def test_a_refill_checks_every_block_on_every_copy_path(tmp_path: Path, threads: int, where: str) -> None:
    """A host-tier refill into a host slab (one thread sendfiles, in the kernel; the others read into the slab's
    mapping) verifies every 1 MiB block's CRC-32 on the bytes it copied: one byte flipped anywhere, the short last
    block included, fails the refill; an unaltered file is copied whole."""
    from wcache.errors import TierEntryError
    from wcache.server.backends.host import HostBackend
    from wcache.server.loader import load_file_into
    from wcache.server.reads import Files, Job, read_job
    from wcache.server.tier import CHECK_BLOCK, BlockCrcs, _block_crcs

    size = 8 * CHECK_BLOCK + 4096
    data = bytearray(os.urandom(size))
    f = tmp_path / "entry.slab"
    f.write_bytes(bytes(data))
    fd = os.open(f, os.O_RDONLY)
    try:
        check = BlockCrcs(_block_crcs(fd, size), size)
    finally:
        os.close(fd)
    flip = {"none": None, "first": 10, "middle": 5 * CHECK_BLOCK + 77, "last": size - 1}[where]
    if flip is not None:
        data[flip] ^= 0x80
        f.write_bytes(bytes(data))
    slab = HostBackend(staging_bytes=4 * threads << 20).allocate(size)
    fd = os.open(f, os.O_RDONLY)
    try:
        if flip is not None:  # the read path on its own (mapping and staging writers): the flipped block alone
            start = flip - flip % CHECK_BLOCK
            n = min(CHECK_BLOCK, size - start)
            job = Job(None, start, [(f, start, n)])
            with pytest.raises(TierEntryError, match="differs from its checksum"):
                read_job(Files(opened={f: fd}, check=check), job, memoryview(bytearray(n)))
        if flip is None:
            load_file_into(f, slab, threads=threads, fd=fd, check=check)
            assert slab.read(0, size) == bytes(data)
        else:
            with pytest.raises(TierEntryError, match="differs from its checksum"):
                load_file_into(f, slab, threads=threads, fd=fd, check=check)
    finally:
        os.close(fd)
        slab.close()


def _held_after_its_check(tier: HostTier, reached: threading.Event, gate: threading.Event, wait: float = 30.0) -> None:
    """``tier``'s saves stop right after they checked their tombstone, the directory's lock held, until ``gate``
    (``wait`` seconds at most)."""
    check = tier._tombstone_of

    def held(meta: Path, key: WeightCacheKey, generation: str) -> bool:
        ok = check(meta, key, generation)
        reached.set()
        assert gate.wait(wait)
        return ok

    tier._tombstone_of = held  # type: ignore[method-assign]


def test_a_supersede_that_cannot_lock_reports_it_and_a_later_one_under_the_lock_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Daemon B (another socket, same directory) saves its deposit of g0: it checked its tombstone under the
    directory's lock and is stopped there. Daemon A commits g1: its ``supersede`` cannot have the lock. Before, it
    removed the entry by path, unlocked, and returned as if done (A then took the commit as settled); B went on and
    published g0 after A's COMMIT, and A's restores, once its record's entry settled, and every other socket's took
    g0. Now it reports that it did not supersede (the caller keeps the commit unsettled and calls again); the call
    under the lock then leaves g1's tombstone whatever B published, and a save of g0 never lands after it."""
    from wcache.server import tier as tier_mod

    monkeypatch.setattr(tier_mod, "LOCK_WAIT_S", 0.2)
    a = HostTier(tmp_path / "tier", 1 << 30)
    b = HostTier(tmp_path / "tier", 1 << 30)
    key = WeightCacheKey("f", "A", 1, 0, "bfloat16")
    b.supersede(key, "g0")
    reached, gate = threading.Event(), threading.Event()
    _held_after_its_check(b, reached, gate)
    saved: list[bool] = []
    t = threading.Thread(
        target=lambda: saved.append(b.save(key, cast("Any", _Slab(0)), _table(), {}, SIZE, generation="g0"))
    )
    t.start()
    try:
        assert reached.wait(30)
        assert a.supersede(key, "g1") is False  # B holds the lock: not superseded
    finally:
        gate.set()
        t.join(30)
    assert saved == [True] and a.generation_of(key) == "g0"  # B published after A's COMMIT: what a retry must undo
    assert a.supersede(key, "g1", latest=lambda: True)
    assert a.generation_of(key) == "g1" and a.lookup(key) is None
    assert not b.save(key, cast("Any", _Slab(0)), _table(), {}, SIZE, generation="g0")  # too late, any time
    assert a.save(key, cast("Any", _Slab(1)), _table(), {}, SIZE, generation="g1")
    entry = b.lookup(key)
    assert entry is not None and entry.generation == "g1" and entry.slab_path.read_bytes() == _Slab(1).data


def test_a_supersede_overtaken_by_a_later_commit_writes_nothing(tmp_path: Path) -> None:
    """A retried tombstone whose commit a later COMMIT of the key superseded meanwhile (``latest`` False under the
    lock) leaves the later one's tombstone and save in place."""
    tier = HostTier(tmp_path / "tier", 1 << 30)
    key = WeightCacheKey("f", "A", 1, 0, "bfloat16")
    tier.supersede(key, "g2")
    assert tier.save(key, cast("Any", _Slab(2)), _table(), {}, SIZE, generation="g2")
    assert tier.supersede(key, "g1", latest=lambda: False)
    entry = tier.lookup(key)
    assert entry is not None and entry.generation == "g2"


def test_a_supersede_without_waiting_tries_the_lock_once_and_an_unopenable_directory_raises(tmp_path: Path) -> None:
    """``supersede(wait=False)`` (the daemon's background retry) makes one attempt at the directory's lock and
    returns False at once where another process holds it, keeping no thread waiting; a directory that cannot be
    opened is not the lock held: OSError, not a False the caller would retry for good."""
    tier = HostTier(tmp_path / "tier", 1 << 30)
    key = WeightCacheKey("f", "A", 1, 0, "bfloat16")
    lock = os.open(tier.dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # another daemon of the directory holds it
    try:
        t0 = time.monotonic()
        assert tier.supersede(key, "g1", wait=False) is False
        assert time.monotonic() - t0 < 0.5
        assert tier.generation_of(key) is None
    finally:
        os.close(lock)
    assert tier.supersede(key, "g1", wait=False)
    assert tier.generation_of(key) == "g1"
    os.rename(tier.dir, tmp_path / "moved")
    with pytest.raises(OSError) as err:
        tier.supersede(key, "g2", wait=False)
    assert not isinstance(err.value, TimeoutError)


async def test_pending_tombstone_retries_keep_no_worker_thread_of_the_daemon(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """Another daemon of the directory holds the tier's lock (hung) while more COMMITs than the daemon has worker
    threads wait for their tombstones. Before, each retry held a worker thread for LOCK_WAIT_S at a time (or
    blocked behind the one that did on the process's own lock): every other piece of work of the daemon run in a
    thread — a PRELOAD's planning, a restore's lookup — queued behind them (14 s for a PRELOAD with 12 pending).
    Now one worker retries them all, one attempt at the lock each per round, and the PRELOAD takes its usual time."""
    tier_dir = tmp_path / "tier"
    d = daemon_factory(ckpt, "--host-tier", "1G", "--host-tier-dir", str(tier_dir))
    base = WeightCacheKey.from_checkpoint(ckpt)
    client = WCacheClient(d.socket, timeout=300)
    await client.preload(RankSpec(ckpt))  # served already: a PRELOAD plans it in a worker thread, loads nothing
    pending = min(32, (os.cpu_count() or 1) + 4) + 6  # more than the daemon's default executor has threads
    lock = os.open(tier_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        keys = [RecipeKey.of(base, engine=f"e{i}") for i in range(pending)]
        await asyncio.gather(
            *(
                WCacheClient(d.socket, timeout=300).deposit(k, {"w": torch.full((1024,), float(i))})
                for i, k in enumerate(keys)
            )
        )  # every COMMIT answered (DEPOSITED), its tombstone retried in the background
        t0 = time.monotonic()
        await client.preload(RankSpec(ckpt))
        took = time.monotonic() - t0
    finally:
        os.close(lock)
    assert took < 3.0, f"a PRELOAD of a served model took {took:.1f} s while {pending} tombstones were retried"
    tier = HostTier(tier_dir, 1 << 30)
    for _ in range(500):  # once the lock is free every tombstone is written, and every deposit saved
        if all(tier.lookup(k) is not None for k in keys):
            break
        await asyncio.sleep(0.02)
    assert all(tier.lookup(k) is not None for k in keys)
