"""The order of a COMMIT's records against the engines it serves (docs/protocol.md §4.13, docs/reliability.md):
once an engine was served a deposit, no crash brings back an older generation of its key — from the keeper or from
the host tier — and the last deposit committed is never dropped as stale. Real daemons and a keeper on the host
backend; a stopped keeper or a held tier lock only widens windows that exist anyway."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch

from tests.conftest import DaemonProc
from tests.server.test_tier_saves import _held_after_its_check
from wcache import WCacheClient, WeightCacheKey
from wcache.errors import KeyMismatchError
from wcache.plan.recipe import RecipeKey
from wcache.proto.table import TensorEntry, TensorTable
from wcache.server.keeper_link import CommitRecord
from wcache.server.process import DaemonProcess, spawn_daemon
from wcache.server.tier import HostTier


@pytest.fixture
def model(ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ckpt, tmp_path / "model"))


async def _never_older(d: DaemonProc, key: RecipeKey, older: torch.Tensor) -> None:
    """After the crash the restarted daemon ``d`` serves the key's newer generation or, the key absent
    (KEY_MISMATCH: the engine deposits again), nothing; never ``older``."""
    try:
        async with await WCacheClient(d.socket, timeout=60).fetch(key, mode="copy") as w:
            got = w["w"].clone()
    except KeyMismatchError:
        return
    assert not torch.equal(got, older), "the older generation served, a newer one having been committed and served"


async def test_a_commit_overtaken_in_the_keeper_queue_does_not_make_the_last_deposit_stale(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path
) -> None:
    """Two engines deposit the same recipe key back to back while the first COMMIT is still telling the keeper
    to UNKEEP the model it evicted. The second COMMIT's keeper work overtakes the first's (asyncio.Lock FIFO), and the
    first COMMIT's late ``_keep`` of its (already replaced, closed) model writes its generation into
    ``<socket>.deposits`` *after* the keeper took the second one. The record then names a generation that is not the
    last committed: a daemon crash afterwards dropped the last committed deposit (the one the keeper holds) as
    stale. Now a model closed before its keeper work's turn records nothing."""
    key = RecipeKey.of(WeightCacheKey.from_checkpoint(model), engine="test")
    ckpt_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    n = 2 << 20  # 8 MiB of float32
    budget = ckpt_bytes + (4 << 20)  # the checkpoint fits, the checkpoint and one deposit do not
    d = daemon_factory(model, "--keeper", "--keeper-check", "3600", "--memory-budget", str(budget))
    record = Path(f"{d.socket}.deposits")
    client = WCacheClient(d.socket, timeout=60)
    v1, v2 = torch.full((n,), 1.0), torch.full((n,), 2.0)

    keeper.proc.send_signal(signal.SIGSTOP)  # a slow keeper: the UNKEEP of the evicted checkpoint takes a while
    try:
        a = asyncio.ensure_future(client.deposit(key, {"w": v1}))
        for _ in range(200):  # A's COMMIT is published (the checkpoint evicted), its UNKEEP waits on the keeper
            models = (await WCacheClient(d.socket).status()).models
            if any("engine" in m.key for m in models):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("A's commit was not published")
        b = asyncio.ensure_future(client.deposit(key, {"w": v2}))  # engine B, same key
        await asyncio.sleep(1.5)  # B's COMMIT published (A replaced), its keeper work queued behind A's UNKEEP
    finally:
        keeper.proc.send_signal(signal.SIGCONT)
    await asyncio.wait_for(a, 30)
    done_b = await asyncio.wait_for(b, 30)
    assert done_b.replaced
    async with await client.fetch(key, mode="copy") as w:
        assert torch.equal(w["w"], v2)
    await asyncio.sleep(0.5)
    recorded = json.loads(record.read_text()) if record.exists() else None
    d.stop(signal.SIGKILL)  # crash: the keeper holds v2, the last deposit committed (DEPOSITED)
    second = daemon_factory(model, "--keeper", "--keeper-check", "3600")  # room for both
    try:
        async with await WCacheClient(second.socket, timeout=60).fetch(key, mode="copy") as w:
            assert torch.equal(w["w"], v2)
    except KeyMismatchError as exc:
        raise AssertionError(
            f"the last committed deposit (v2, kept) was dropped after the crash: {exc}; "
            f"<socket>.deposits before the crash: {recorded}; restarted daemon: "
            + " | ".join(line for line in second.log_text().splitlines() if "dropping kept" in line)
        ) from None


async def _kept(path: Path, n: int) -> None:
    """Until the keeper holds ``n`` models."""
    for _ in range(200):
        if len((await WCacheClient(path).status()).models) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the keeper never held {n} models")


async def test_a_deposit_served_before_a_crash_is_not_followed_by_an_older_one(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path
) -> None:
    """A COMMIT publishes the new deposit (engines lease it at once) before its keeper work: with the keeper slow
    (SIGSTOP, under its 10 s timeout), v2 is served to another engine while v2's COMMIT still waits on the UNKEEP
    of what it evicted; the daemon then crashes. Before, v2's generation reached ``<socket>.deposits`` only in
    ``KeeperLink.commit``, after that UNKEEP, and the restarted daemon reclaimed v1 from the keeper and served it.
    Now the generation is recorded at COMMIT before the first await, so before any engine can lease it: v1 is
    dropped as stale."""
    key = RecipeKey.of(WeightCacheKey.from_checkpoint(model), engine="test")
    ckpt_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    budget = ckpt_bytes + (6 << 20)  # the checkpoint and v1 (1 MiB) fit; the checkpoint and v2 (8 MiB) do not
    d = daemon_factory(model, "--keeper", "--keeper-check", "3600", "--memory-budget", str(budget))
    client = WCacheClient(d.socket, timeout=60)
    v1, v2 = torch.full((1 << 18,), 1.0), torch.full((2 << 20,), 2.0)
    await client.deposit(key, {"w": v1})
    await _kept(keeper.socket, 2)  # the checkpoint and v1

    keeper.proc.send_signal(signal.SIGSTOP)  # slow, not dead: its answers come before the 10 s timeout
    try:
        commit = asyncio.ensure_future(client.deposit(key, {"w": v2}))
        served = None
        for _ in range(200):  # v2 published (STATUS), its COMMIT waiting on the evicted checkpoint's UNKEEP
            ms = (await WCacheClient(d.socket).status()).models
            if any("engine" in m.key and m.bytes >= v2.numel() * 4 for m in ms):
                break
            await asyncio.sleep(0.02)
        async with await WCacheClient(d.socket, timeout=60).fetch(key, mode="copy") as w:  # another engine
            served = w["w"].clone()
        assert served is not None and torch.equal(served, v2), (
            commit.done() and commit.exception(),
            d.log_text()[-3000:],
        )  # v2 is served (its COMMIT still waits on the stopped keeper: its 10 s timeout)
        d.stop(signal.SIGKILL)  # crash before the COMMIT reached the keeper (no DEPOSITED yet)
        commit.cancel()
    finally:
        keeper.proc.send_signal(signal.SIGCONT)
    second = daemon_factory(model, "--keeper", "--keeper-check", "3600")
    await _never_older(second, key, v1)


async def test_a_deposit_served_before_a_crash_is_not_followed_by_the_tiers_older_one(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """A COMMIT publishes the new deposit (engines lease it at once) before the host tier's entry of the
    older generation is replaced by the tombstone (``HostTier.supersede`` runs after ``Store.commit_deposit`` and
    takes the tier directory's flock, which another daemon sharing the directory may hold for up to LOCK_WAIT_S).
    v2 is served to another engine inside that window, the daemon crashes; the restarted daemon restores v1 from
    the tier: bytes older than a generation engines were already served. Now the restarted daemon restores only
    the generation its ``<socket>.deposits`` names for the key (recorded at COMMIT, before any lease): the key is
    absent, never older."""
    key = RecipeKey.of(WeightCacheKey.from_checkpoint(ckpt), engine="test")
    tier_dir = tmp_path / "tier"
    tier = ("--host-tier", "1G", "--host-tier-dir", str(tier_dir))
    d = daemon_factory(ckpt, *tier)
    client = WCacheClient(d.socket, timeout=60)
    v1, v2 = torch.full((1 << 18,), 1.0), torch.full((1 << 18,), 2.0)
    await client.deposit(key, {"w": v1})
    for _ in range(200):  # v1's background save published (the checkpoint's entry and v1's)
        if len(list(tier_dir.glob("*.slab"))) >= 2 and not list(tier_dir.glob(".*tmp")):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)

    lock = os.open(tier_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # another daemon of the directory publishing: supersede waits (<= 2 s)
    try:
        commit = asyncio.ensure_future(client.deposit(key, {"w": v2}))
        await asyncio.sleep(0.3)
        async with await WCacheClient(d.socket, timeout=60).fetch(key, mode="copy") as w:  # another engine
            served = w["w"].clone()
        assert torch.equal(served, v2)  # v2 is served (its COMMIT waits up to LOCK_WAIT_S for the tier's lock)
        d.stop(signal.SIGKILL)  # crash before the tombstone (no DEPOSITED yet)
        commit.cancel()
    finally:
        os.close(lock)
    second = daemon_factory(ckpt, *tier)
    await _never_older(second, key, v1)


class _Bytes:
    """A slab holding ``t``'s bytes, for a ``HostTier.save`` in this process."""

    def __init__(self, t: torch.Tensor) -> None:
        self.data = t.numpy().tobytes()
        self.size = len(self.data)

    def save_to(self, fd: int) -> None:
        os.pwrite(fd, self.data, 0)


@asynccontextmanager
async def _publishing_older(tier_dir: Path, key: RecipeKey, older: torch.Tensor) -> AsyncIterator[HostTier]:
    """Daemon B of another socket sharing the tier (a ``HostTier`` in this process) committed ``older`` as
    generation g0 under ``key`` and saves it: inside the block it has checked its tombstone under the directory's
    lock and is stopped there, holding the lock; at the end of the block it publishes g0 and lets go."""
    b = HostTier(tier_dir, 1 << 30)
    b.supersede(key, "g0")
    reached, gate = threading.Event(), threading.Event()
    _held_after_its_check(b, reached, gate, wait=60)
    table = TensorTable.from_entries([TensorEntry("w", "float32", tuple(older.shape), (1,), 0, 0)])
    size = older.numel() * 4
    save = asyncio.ensure_future(asyncio.to_thread(b.save, key, _Bytes(older), table, {}, size, generation="g0"))  # type: ignore[arg-type]
    try:
        assert await asyncio.to_thread(reached.wait, 30)
        yield b
    finally:
        gate.set()
        published = await asyncio.wait_for(save, 30)
    assert published  # g0, after the COMMIT of the block: what A must undo


async def _until(pred: Callable[[], bool], what: str, tries: int = 1000) -> None:
    """Poll ``pred`` (every 20 ms, 20 s at most) until it holds."""
    for _ in range(tries):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


async def test_a_tombstone_another_daemons_publish_held_off_is_written_once_the_lock_frees(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """Daemon B of another socket sharing the host tier checked its tombstone of g0 under the tier's lock and is
    stopped holding it; daemon A commits v1 meanwhile (its ``supersede`` waits LOCK_WAIT_S for the lock); then B
    publishes g0. Before, A's ``supersede`` removed the entry unlocked and returned: the tier held g0 after A's
    COMMIT for good, and a third socket's daemon restored it (and A's own restore too, once its record's entry
    settled). Now A retries the tombstone under the lock once B lets go, then saves v1 and settles: the tier
    holds v1, the record's entry goes (the keeper holds v1), every socket serves v1."""
    key = RecipeKey.of(WeightCacheKey.from_checkpoint(ckpt), engine="test")
    tier_dir = tmp_path / "tier"
    tier = ("--host-tier", "1G", "--host-tier-dir", str(tier_dir))
    v0, v1 = torch.full((1 << 16,), 0.5), torch.full((1 << 16,), 1.0)
    a = daemon_factory(ckpt, "--keeper", "--keeper-check", "3600", *tier)
    record = Path(f"{a.socket}.deposits")
    client = WCacheClient(a.socket, timeout=60)
    async with _publishing_older(tier_dir, key, v0) as b:
        await client.deposit(key, {"w": v1})  # DEPOSITED after LOCK_WAIT_S: B holds the lock

    def settled() -> bool:
        got = b.generation_of(key)
        entry = b.lookup(key, generation=got) if got not in (None, "g0") else None
        return entry is not None and CommitRecord.key_id(key) not in CommitRecord(record).keys

    await _until(settled, "A's tombstone written and v1 saved once the lock freed, its record entry settled")
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    e = daemon_factory(ckpt, *tier, sdir=other)  # a third socket sharing the tier
    async with await WCacheClient(e.socket, timeout=60).fetch(key, mode="copy") as w:
        assert torch.equal(w["w"], v1)
    await client.evict(key)
    async with await client.fetch(key, mode="copy") as w:
        assert torch.equal(w["w"], v1)
    assert [m.origin for m in (await client.status()).models if "engine" in m.key] == ["tier"]


async def test_an_eviction_while_the_tombstone_is_held_off_restores_nothing_older(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """As above, and A evicts the key as soon as B has published g0 and asks for it again. Before, A's commit was
    settled (the keeper's KEEP removed its record entry) and the restore took whatever the tier held: g0, older
    than v1 which A had committed and served. Now the commit stays unsettled until the tombstone is written under
    the lock: the restore takes v1's generation only, so the key is absent (or v1), never g0."""
    key = RecipeKey.of(WeightCacheKey.from_checkpoint(ckpt), engine="test")
    tier_dir = tmp_path / "tier"
    v0, v1 = torch.full((1 << 16,), 0.5), torch.full((1 << 16,), 1.0)
    a = daemon_factory(
        ckpt, "--keeper", "--keeper-check", "3600", "--host-tier", "1G", "--host-tier-dir", str(tier_dir)
    )
    client = WCacheClient(a.socket, timeout=60)
    async with _publishing_older(tier_dir, key, v0):
        await client.deposit(key, {"w": v1})
    await client.evict(key)
    await _never_older(a, key, v0)


async def test_a_daemon_stopped_with_its_tombstone_held_off_leaves_the_entry_that_guards_the_restore(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """A commits v1 while B holds the tier's lock (as above), and is stopped (SIGTERM) before B lets go: its
    tombstone retry ends with it. B then publishes g0, and the next daemon of A's socket is asked for the key.
    Before, A's commit was settled and the keeper's KEEP had removed its record entry: the next daemon dropped the
    kept v1 (the tier records another generation) and restored g0 from the tier. Now A stops at once leaving the
    entry, which names v1's generation: the key is absent, never g0."""
    key = RecipeKey.of(WeightCacheKey.from_checkpoint(ckpt), engine="test")
    tier_dir = tmp_path / "tier"
    args = ("--keeper", "--keeper-check", "3600", "--host-tier", "1G", "--host-tier-dir", str(tier_dir))
    v0, v1 = torch.full((1 << 16,), 0.5), torch.full((1 << 16,), 1.0)
    a = daemon_factory(ckpt, *args)
    record = Path(f"{a.socket}.deposits")
    async with _publishing_older(tier_dir, key, v0):
        await WCacheClient(a.socket, timeout=60).deposit(key, {"w": v1})
        assert a.stop(timeout=20) == 0  # the retry cancelled: no wait for the lock
        assert CommitRecord.key_id(key) in CommitRecord(record).keys
    second = daemon_factory(ckpt, *args)
    await _never_older(second, key, v0)


async def test_a_takeover_while_the_tombstone_is_held_off_leaves_the_retry_to_the_new_daemon(
    keeper: DaemonProcess, ckpt: Path, socket_dir: Path, tmp_path: Path
) -> None:
    """A commits v1 while B holds the tier's lock (as above), and a new daemon A2 takes A's socket over before B
    lets go: A's retry ends at the hand-over. Before, A2's first KEEP of the handed v1 removed the record's entry
    (A2 knew nothing of A's unwritten tombstone), nobody wrote the tombstone, and once B published g0 an eviction
    and a restore on A2 served g0. Now the entry is flagged in the record until its tombstone is written: A2's KEEP
    leaves it, A2 retries the tombstone itself, and its restores take v1's generation only meanwhile; once written
    (B gone) the tier holds v1's generation and the entry settles."""
    key = RecipeKey.of(WeightCacheKey.from_checkpoint(ckpt), engine="test")
    kid = CommitRecord.key_id(key)
    tier_dir = tmp_path / "tier"
    args = ("--keeper", "--keeper-check", "3600", "--host-tier", "1G", "--host-tier-dir", str(tier_dir))
    v0, v1 = torch.full((1 << 16,), 0.5), torch.full((1 << 16,), 1.0)
    procs: list[DaemonProc] = []
    try:
        a = spawn_daemon(ckpt, socket_dir, *args, timeout=60)
        procs.append(a)
        record = Path(f"{a.socket}.deposits")
        async with _publishing_older(tier_dir, key, v0) as b:
            await WCacheClient(a.socket, timeout=60).deposit(key, {"w": v1})  # served; its tombstone held off
            generation = CommitRecord(record).keys[kid]
            a2 = spawn_daemon(None, socket_dir, *args, takeover=a.socket, timeout=60)
            procs.append(a2)
            assert a.proc.wait(30) == 0  # A handed over (its retry ended)
        client = WCacheClient(a2.socket, timeout=60)
        await client.evict(key)
        await _never_older(a2, key, v0)  # before: g0, A2's KEEP having removed the entry
        await _until(
            lambda: b.generation_of(key) == generation and kid not in CommitRecord(record).keys,
            "A2 wrote v1's tombstone once B let go, and the record's entry settled",
        )
        await _never_older(a2, key, v0)
    finally:
        for p in procs:
            p.stop()


async def test_an_entry_evicted_while_its_tombstone_is_held_off_goes_once_it_is_written(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """A commits v1 while another daemon holds the tier's lock, and evicts it (the keeper drops it) before the
    retry writes the tombstone. Before, the retry wrote it and returned, the model being closed, without settling:
    the record kept the entry for good (each such COMMIT one more, up to the record's limit, which then drops every
    kept deposit). Now the entry settles by the usual rule once the tombstone is written: the keeper holds nothing
    of the key and the tier nothing older, so it goes."""
    key = RecipeKey.of(WeightCacheKey.from_checkpoint(ckpt), engine="test")
    tier_dir = tmp_path / "tier"
    d = daemon_factory(
        ckpt, "--keeper", "--keeper-check", "3600", "--host-tier", "1G", "--host-tier-dir", str(tier_dir)
    )
    record = Path(f"{d.socket}.deposits")
    kid = CommitRecord.key_id(key)
    client = WCacheClient(d.socket, timeout=60)
    lock = os.open(tier_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # another daemon of the directory holds the tier's lock
    try:
        await client.deposit(key, {"w": torch.full((1 << 12,), 1.0)})  # DEPOSITED after LOCK_WAIT_S
        await client.evict(key)  # UNKEEP: the keeper holds nothing of the key now
        assert kid in CommitRecord(record).keys
    finally:
        os.close(lock)
    generation = CommitRecord(record).keys[kid]
    tier = HostTier(tier_dir, 1 << 30)
    await _until(lambda: tier.generation_of(key) == generation, "the retry wrote the tombstone once the lock freed")
    await _until(
        lambda: kid not in CommitRecord(record).keys, "the record's entry settled once the tombstone was written"
    )
