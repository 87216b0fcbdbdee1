"""The commit record ``<socket>.deposits`` (docs/reliability.md, "The commit record") against the processes that
write it and the restores it guards: after a TAKEOVER only the new daemon writes it, a RECLAIM keeps the entries
that guard the host tier's restore, a record that lost entries (damaged, full) restores from the tier only the
keys it names, and a record vouches for what one keeper holds, the one it names. Real daemons and a keeper on the host backend; a held tier lock or a stopped keeper only widens
windows that exist anyway."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import struct
import termios
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import DaemonProc
from tests.server.test_commit_order import _never_older
from wcache import WCacheClient, WeightCacheKey
from wcache.channel import connect
from wcache.errors import WCacheError
from wcache.paths import KEEPER_SOCKET
from wcache.plan.key import RankSpec
from wcache.plan.recipe import RecipeKey
from wcache.proto import GetState
from wcache.server.keeper_link import CommitRecord
from wcache.server.process import DaemonProcess, spawn_daemon, spawn_keeper


async def _until(pred: Callable[[], bool | Awaitable[bool]], what: str, tries: int = 1000) -> None:
    """Poll ``pred`` (every 20 ms, 20 s at most) until it holds."""
    for _ in range(tries):
        got = pred()
        if await got if isinstance(got, Awaitable) else got:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


def _record(path: Path) -> dict[str, str]:
    try:
        return dict(json.loads(path.read_text())["keys"])
    except FileNotFoundError:
        return {}


async def _saved(tier_dir: Path, entries: int) -> None:
    """Until the tier holds ``entries`` published entries and no save is in progress."""
    await _until(
        lambda: len(list(tier_dir.glob("*.slab"))) >= entries and not list(tier_dir.glob(".*tmp")), "tier saves"
    )


async def _served_then_crashed(
    d: DaemonProc, key: RecipeKey, tier_dir: Path, v1: torch.Tensor, v2: torch.Tensor
) -> str:
    """v1 committed and saved in the host tier; v2 committed while another daemon of the directory holds the tier's
    lock (``HostTier.supersede`` waits up to LOCK_WAIT_S before the tombstone), served to another engine, and ``d``
    SIGKILLed before the tombstone: the tier still holds v1, the record names v2. Returns v2's generation."""
    record = Path(f"{d.socket}.deposits")
    kid = CommitRecord.key_id(key)
    client = WCacheClient(d.socket, timeout=60)
    await client.deposit(key, {"w": v1})
    await _saved(tier_dir, 2)  # the checkpoint's entry and v1's
    before = _record(record).get(kid)
    lock = os.open(tier_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        commit = asyncio.ensure_future(client.deposit(key, {"w": v2}))
        await _until(lambda: _record(record).get(kid) not in (None, before), "v2's COMMIT recorded")
        async with await WCacheClient(d.socket, timeout=60).fetch(key, mode="copy") as w:  # another engine
            assert torch.equal(w["w"], v2)  # served while its COMMIT waits for the tier's lock
        d.stop(signal.SIGKILL)
        commit.cancel()
    finally:
        os.close(lock)
    return _record(record)[kid]


async def test_the_old_daemon_writes_no_record_and_restores_nothing_after_a_takeover(
    keeper: DaemonProcess, ckpt: Path, socket_dir: Path, tmp_path: Path
) -> None:
    """D1 (--keeper, --host-tier) serves deposit K@v1 (kept). A GET_STATE of an evicted deposit K2 waits on D1's
    load lock (a PRELOAD is loading) when D2 takes the socket over. D2 commits K@v2 while the keeper does not
    answer: D2 records v2 in ``<socket>.deposits`` and serves it. Then D1's PRELOAD ends and its queued GET_STATE
    ran on: before, it restored K2 from the tier and offered it to the keeper, rewriting the record from D1's own
    map ({K2}: D2's entry for K gone), and after D2's crash the next daemon reclaimed the kept v1 and served it.
    Now a daemon that handed over adds no model and writes no record: the GET_STATE's connection is closed, the
    record keeps D2's entry, and the next daemon drops the kept v1."""
    tier_dir = tmp_path / "tier"
    reached, gate = tmp_path / "reached", tmp_path / "gate"
    env = {**os.environ, "WCACHE_TEST_GATE_REACHED": str(reached), "WCACHE_TEST_GATE": str(gate)}
    tier = ("--host-tier", "1G", "--host-tier-dir", str(tier_dir))
    keep = ("--keeper", "--keeper-check", "3600")
    procs: list[DaemonProc] = []
    stopped = False
    try:
        d1 = spawn_daemon(ckpt, socket_dir, *keep, *tier, env=env, timeout=60)
        procs.append(d1)
        record = Path(f"{d1.socket}.deposits")
        base = WeightCacheKey.from_checkpoint(ckpt)
        k, k2 = RecipeKey.of(base, engine="a"), RecipeKey.of(base, engine="b")
        kid = CommitRecord.key_id(k)
        v1, v2, b = torch.full((1 << 16,), 1.0), torch.full((1 << 16,), 2.0), torch.full((1 << 16,), 7.0)
        c1 = WCacheClient(d1.socket, timeout=60)
        await c1.deposit(k, {"w": v1})
        await c1.deposit(k2, {"w": b})
        await _saved(tier_dir, 3)  # the checkpoint, K and K2

        async def kept3() -> bool:
            return len((await WCacheClient(keeper.socket).status()).models) >= 3

        await _until(kept3, "the keeper holds the checkpoint, K and K2")
        assert _record(record) == {}  # settled: the keeper holds both deposits
        await c1.evict(k2)

        # D1 busy: a PRELOAD holding its load lock, and a GET_STATE of K2 read by D1, queued behind it
        pre = asyncio.ensure_future(c1.preload(RankSpec(ckpt, transform="tests.server.gate_transform:gate")))
        await _until(reached.exists, "the PRELOAD reached its transform")
        ch, _ = await connect(d1.socket, software="test", name="test")
        try:
            await ch.send(GetState(id=ch.conn.next_request_id(), key=k2.to_wire(), mode="copy"))

            def read_by_d1() -> bool:  # nothing left unread in the socket: D1 has the request
                raw = fcntl.ioctl(ch.sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
                return int(struct.unpack("i", raw)[0]) == 0

            await _until(read_by_d1, "D1 read the GET_STATE of K2")

            d2 = spawn_daemon(None, socket_dir, *keep, *tier, takeover=d1.socket, timeout=60)
            procs.append(d2)
            keeper.proc.send_signal(signal.SIGSTOP)  # the keeper does not answer (hung): D2 records v2
            stopped = True
            dep = asyncio.ensure_future(WCacheClient(d2.socket, timeout=60).deposit(k, {"w": v2}))
            await _until(lambda: kid in _record(record), "D2's COMMIT recorded K's new generation")
            v2_gen = _record(record)[kid]
            async with await WCacheClient(d2.socket, timeout=60).fetch(k, mode="copy") as w:  # another engine
                assert torch.equal(w["w"], v2)

            gate.touch()  # D1's PRELOAD ends after the hand-off; its queued GET_STATE runs on
            try:
                await asyncio.wait_for(pre, 30)
            except (WCacheError, OSError, EOFError):
                pass
            assert d1.proc.wait(30) == 0
            after = _record(record)
            assert after.get(kid) == v2_gen, f"the old daemon rewrote the record after the hand-off: {after}"
            with pytest.raises(EOFError):  # D1 closed the connection: nothing restored or served after the hand-off
                await asyncio.wait_for(ch.receive(), 30)
        finally:
            ch.close()
        assert not list(socket_dir.glob("*.deposits.*tmp"))  # every writer's temporary renamed or removed

        d2.stop(signal.SIGKILL)  # crash while the keeper has not taken v2
        dep.cancel()
        keeper.proc.send_signal(signal.SIGCONT)
        stopped = False
        d3 = spawn_daemon(ckpt, socket_dir, *keep, timeout=60)
        procs.append(d3)
        await _never_older(d3, k, v1)
    finally:
        if stopped:
            keeper.proc.send_signal(signal.SIGCONT)
        for p in procs:
            p.stop()


async def test_a_reclaim_keeps_the_entry_that_guards_the_tier_restore(
    ckpt: Path, socket_dir: Path, tmp_path: Path
) -> None:
    """D1 runs with ``--keeper`` while its keeper is down (it serves on, recording every COMMIT) and with a host
    tier; v2 is served and D1 crashes before v2's tombstone (``_served_then_crashed``): the record names v2, the
    tier holds v1. The keeper is up when D2 starts; its RECLAIM finds nothing of the key. Before, the RECLAIM
    rewrote the record to the keys it dropped (none), and D2 restored v1 from the tier. Now it keeps every entry
    but those of the deposits the keeper holds: D2 asks the tier for v2 only, and the key is absent."""
    tier_dir = tmp_path / "tier"
    tier = ("--host-tier", "1G", "--host-tier-dir", str(tier_dir))
    keep = ("--keeper", "--keeper-check", "3600")
    procs: list[DaemonProc] = []
    try:
        d1 = spawn_daemon(ckpt, socket_dir, *keep, *tier, timeout=60)  # no keeper running: it serves on without
        procs.append(d1)
        record = Path(f"{d1.socket}.deposits")
        key = RecipeKey.of(WeightCacheKey.from_checkpoint(ckpt), engine="test")
        v1, v2 = torch.full((1 << 18,), 1.0), torch.full((1 << 18,), 2.0)
        gen = await _served_then_crashed(d1, key, tier_dir, v1, v2)

        procs.append(spawn_keeper(socket_dir))  # the keeper is back, holding nothing
        d2 = spawn_daemon(ckpt, socket_dir, *keep, *tier, timeout=60)
        procs.append(d2)
        assert _record(record).get(CommitRecord.key_id(key)) == gen  # the RECLAIM kept the entry
        await _never_older(d2, key, v1)
    finally:
        for p in reversed(procs):
            p.stop()


async def test_a_damaged_record_restores_no_key_it_does_not_name_from_the_tier(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """v2 served, the daemon crashed before v2's tombstone (the tier holds v1), and the record is then damaged
    (unparseable). Before, a damaged record made the restore take whatever generation the tier held: v1. Now a
    record that lost entries vouches only for the keys it names: the key is absent (the engine deposits again)."""
    tier_dir = tmp_path / "tier"
    tier = ("--host-tier", "1G", "--host-tier-dir", str(tier_dir))
    d = daemon_factory(ckpt, *tier)
    key = RecipeKey.of(WeightCacheKey.from_checkpoint(ckpt), engine="test")
    v1, v2 = torch.full((1 << 18,), 1.0), torch.full((1 << 18,), 2.0)
    await _served_then_crashed(d, key, tier_dir, v1, v2)
    record = Path(f"{d.socket}.deposits")
    record.write_text('{"format": "wcache-deposits/1", "keys": {')
    second = daemon_factory(ckpt, *tier)
    await _never_older(second, key, v1)
    assert not CommitRecord(record).restorable(key)[0]  # still partial: never turned into a record that vouches


async def test_a_full_record_restores_no_key_it_does_not_name_from_the_tier(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """The record holds MAX_KEYS other keys when v2's COMMIT adds one more: it gives up its entries (damaged). v2
    is served, the daemon crashes before v2's tombstone (the tier holds v1). Before, the restarted daemon took
    whatever generation the tier held: v1. Now the full record keeps the entry of the COMMIT that overflowed it,
    and vouches for the keys it names only: v2 or nothing."""
    tier_dir = tmp_path / "tier"
    tier = ("--host-tier", "1G", "--host-tier-dir", str(tier_dir))
    key = RecipeKey.of(WeightCacheKey.from_checkpoint(ckpt), engine="test")
    v1, v2 = torch.full((1 << 18,), 1.0), torch.full((1 << 18,), 2.0)
    d = daemon_factory(ckpt, *tier)
    record = Path(f"{d.socket}.deposits")
    client = WCacheClient(d.socket, timeout=60)
    await client.deposit(key, {"w": v1})
    await _saved(tier_dir, 2)
    d.stop()
    others = {f"{i:064x}": "g" for i in range(CommitRecord.MAX_KEYS)}  # other recipe keys, committed earlier
    record.write_text(json.dumps({"format": CommitRecord.FORMAT, "keys": others}))
    d = daemon_factory(ckpt, *tier)
    lock = os.open(tier_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        client = WCacheClient(d.socket, timeout=60)
        commit = asyncio.ensure_future(client.deposit(key, {"w": v2}))
        await _until(lambda: len(_record(record)) < len(others), "v2's COMMIT overflowed the record")
        async with await WCacheClient(d.socket, timeout=60).fetch(key, mode="copy") as w:
            assert torch.equal(w["w"], v2)
        d.stop(signal.SIGKILL)
        commit.cancel()
    finally:
        os.close(lock)
    second = daemon_factory(ckpt, *tier)
    await _never_older(second, key, v1)


def test_an_entry_stays_until_the_tier_holds_nothing_older(tmp_path: Path) -> None:
    """The keeper may take a deposit (its periodic check) before its COMMIT's host-tier tombstone is written (the
    tier's lock held by another daemon): the keeper then holds the new generation, the tier still the older one.
    Before, the keeper's KEEP removed the key's entry at once, and a restore after a crash (or after an eviction)
    took the older generation from the tier. Now the entry stays while the COMMIT is not settled in the tier
    (``CommitRecord.pending``: the daemon's ``Store.superseding``), and goes at the next settlement after it."""
    key = RecipeKey.of(WeightCacheKey("a" * 64, "LlamaForCausalLM", 1, 0, "bfloat16"), engine="test")
    path = tmp_path / "wcache-rank0.sock.deposits"
    superseding = {key}
    rec = CommitRecord(path, keeper=os.path.realpath(tmp_path / KEEPER_SOCKET))  # the socket directory's keeper
    rec.pending = lambda k: k in superseding
    rec.committed(key, "g2")
    rec.settled(key)  # the keeper holds g2, the tier's tombstone not yet written
    assert CommitRecord(path).keys == {CommitRecord.key_id(key): "g2"}
    superseding.clear()
    rec.settled(key)
    assert not path.exists()


def test_an_entry_whose_tombstone_is_pending_stays_across_processes_until_it_is_written(tmp_path: Path) -> None:
    """An entry flagged as waiting for its COMMIT's host-tier tombstone is kept by every KEEP and RECLAIM, in this
    process and in the next one to open the record (after a TAKEOVER or a crash), until the tombstone is written;
    then it settles as any entry. A record written before the flag existed has none pending."""
    path = tmp_path / "sock.deposits"
    keeper = os.path.realpath(tmp_path / KEEPER_SOCKET)  # the socket directory's keeper
    key = RecipeKey.of(WeightCacheKey("f", "A", 1, 0, "bfloat16"), engine="e")
    kid = CommitRecord.key_id(key)
    r = CommitRecord(path, keeper=keeper)
    r.committed(key, "g1")
    r.tombstone_pending(key, "g1")
    r.settled(key)
    r.reclaimed({kid}, confirmed=True)
    assert r.keys == {kid: "g1"}
    r2 = CommitRecord(path, keeper=keeper)  # the next daemon of the socket
    assert r2.keys == {kid: "g1"} and r2.tombstones == {kid: key.to_wire()}
    r2.settled(key)
    assert kid in CommitRecord(path, keeper=keeper).keys
    r2.tombstone_written(key, "g0")  # not the entry's generation: nothing
    assert kid in r2.tombstones
    r2.tombstone_written(key, "g1")
    r2.settled(key)
    assert not path.exists()
    path.write_text(json.dumps({"format": CommitRecord.FORMAT, "keys": {kid: "g1"}, "keeper": keeper}))
    old = CommitRecord(path, keeper=keeper)  # a record without the flag's field
    assert old.tombstones == {}
    old.settled(key)
    assert not path.exists()


def test_a_record_vouches_only_for_the_keeper_it_was_settled_against(tmp_path: Path) -> None:
    """A settled entry says "this keeper holds the key's last generation, or nothing of it" of one keeper only.
    Before, the record did not say which: v1 kept in keeper A, v2 committed and settled in keeper B (its entry and
    the file gone), and a daemon back on A found no entry and served A's v1. Now the record names the keeper it was
    settled against (``"keeper"``, its socket's real path; no file: the socket directory's own keeper): a kept
    deposit of a key it does not name is stale in any other keeper, entries settle only against the named one, and
    a RECLAIM that dropped every such deposit (each drop confirmed) makes it name the RECLAIM's keeper. A record
    without the field (an older daemon's) vouches for no keeper; a daemon without a keeper keeps the field."""
    k1 = RecipeKey.of(WeightCacheKey("a" * 64, "LlamaForCausalLM", 1, 0, "bfloat16"), engine="test")
    k2 = RecipeKey.of(WeightCacheKey("b" * 64, "LlamaForCausalLM", 1, 0, "bfloat16"), engine="test")
    path = tmp_path / "wcache-rank0.sock.deposits"
    a = os.path.realpath(tmp_path / KEEPER_SOCKET)  # the socket directory's keeper
    b = os.path.realpath(tmp_path / "elsewhere" / KEEPER_SOCKET)

    in_a = CommitRecord(path, keeper=a)
    assert in_a.settled_in == a and in_a.stale(k1, "g0") is None  # no file: A's record
    in_a.committed(k1, "g1")
    in_a.settled(k1)  # A holds g1
    assert not path.exists()

    in_b = CommitRecord(path, keeper=b)  # restarted with keeper B, its RECLAIM not done (or failed)
    assert in_b.stale(k1, "g0") is not None  # whatever B holds of a key the record does not name
    in_b.committed(k1, "g2")
    in_b.settled(k1)  # B holds g2: the entry stays, A may still hold g1
    assert CommitRecord(path, keeper=a).stale(k1, "g1") is not None
    in_b.reclaimed({CommitRecord.key_id(k1)}, confirmed=False)  # a drop unconfirmed: it stays A's record
    assert CommitRecord(path).settled_in == a and CommitRecord(path).keys == {CommitRecord.key_id(k1): "g2"}
    in_b.reclaimed({CommitRecord.key_id(k1)}, confirmed=True)  # B served g2 and holds nothing else: B's record
    assert json.loads(path.read_text()) == {"format": CommitRecord.FORMAT, "keys": {}, "keeper": b}
    assert CommitRecord(path, keeper=b).stale(k1, "g2") is None
    assert CommitRecord(path, keeper=a).stale(k1, "g1") is not None  # back on A: its g1 is stale
    assert CommitRecord(path, keeper=a).stale(k2, "g1") is not None

    without = CommitRecord(path)  # a daemon without a keeper: records its COMMIT, keeps the field
    without.committed(k2, "g5")
    after = CommitRecord(path, keeper=b)
    assert after.settled_in == b and after.stale(k2, "g4") is not None and after.stale(k2, "g5") is None

    back = CommitRecord(path, keeper=a)
    back.reclaimed(set(), confirmed=True)  # back on A, every deposit it held dropped: A's record, k2's entry kept
    assert CommitRecord(path).settled_in == a and CommitRecord(path).keys == {CommitRecord.key_id(k2): "g5"}
    back.settled(k2)  # A holds g5: nothing left to record, and A needs no file
    assert not path.exists()

    path.write_text(json.dumps({"format": CommitRecord.FORMAT, "keys": {CommitRecord.key_id(k2): "g5"}}))
    older = CommitRecord(path, keeper=a)  # an older daemon's record: no field
    assert older.known and older.settled_in is None and not older.partial
    assert older.stale(k1, "g2") is not None and older.stale(k2, "g5") is None
    older.settled(k2)  # vouching for no keeper, it settles nothing
    assert CommitRecord(path).keys == {CommitRecord.key_id(k2): "g5"}
    path.write_text(json.dumps({"format": CommitRecord.FORMAT, "keys": {}, "keeper": ["x"]}))
    odd = CommitRecord(path, keeper=a)  # a field of another type names no keeper
    assert odd.known and odd.settled_in is None and odd.stale(k1, "g2") is not None


def test_a_full_record_keeps_the_entries_whose_tombstone_is_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A COMMIT past ``MAX_KEYS`` gives up the record's entries (it turns partial and damaged), but not those flagged
    as waiting for their host-tier tombstone: wiped with the others, their flag went too, and no later daemon of the
    socket retried the tombstone — the tier kept the older generation with no end. A record with flags and no
    ``keeper`` field (a daemon's before the field) loads its flags and vouches for no keeper."""
    monkeypatch.setattr(CommitRecord, "MAX_KEYS", 3)
    path = tmp_path / "sock.deposits"
    keeper = os.path.realpath(tmp_path / KEEPER_SOCKET)

    def key(i: int) -> RecipeKey:
        return RecipeKey.of(WeightCacheKey(f"{i:032x}", "A", 1, 0, "bfloat16"), engine="e")

    r = CommitRecord(path, keeper=keeper)
    r.committed(key(0), "g0")
    r.tombstone_pending(key(0), "g0")
    for i in (1, 2, 3):
        r.committed(key(i), f"g{i}")
    again = CommitRecord(path, keeper=keeper)
    k0, k3 = CommitRecord.key_id(key(0)), CommitRecord.key_id(key(3))
    assert again.keys == {k0: "g0", k3: "g3"} and again.tombstones == {k0: key(0).to_wire()}
    assert again.partial and not again.known
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({"format": CommitRecord.FORMAT, "keys": doc["keys"], "tombstones": doc["tombstones"]}))
    older = CommitRecord(path, keeper=keeper)
    assert older.tombstones == {k0: key(0).to_wire()} and older.settled_in is None and not older.vouches
