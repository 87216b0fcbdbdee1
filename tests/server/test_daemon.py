"""The daemon's dispatch, in this process: a ``Daemon`` on the host backend serving a real Unix socket in
tmp_path through the server shell, driven by the client and by raw channels — GET_STATE / RELEASE / STATUS /
PRELOAD / EVICT / DEPOSIT / COMMIT / TAKEOVER, their errors, and its connection limits. No subprocess: what
needs a process of its own (signals, crashes, the keeper, the CLI) is tested with real ones elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import serving_here
from tests.server import exposition
from tests.server.deposit_engine import recipe_key, tensors
from wcache import WCacheClient, WeightCacheKey
from wcache.channel import Channel, close_fds, connect, expect
from wcache.errors import (
    InUseError,
    KeyMismatchError,
    LimitExceededError,
    NotFoundError,
    UnexpectedFrameError,
    UnknownLeaseError,
)
from wcache.nn import load_from_disk
from wcache.plan.key import RankSpec
from wcache.proto import (
    Commit,
    Deposit,
    Deposited,
    DepositSlab,
    DepositTensor,
    GetState,
    Reclaim,
    Release,
    Role,
    State,
    Status,
    StatusReply,
    Takeover,
    TakeoverAdopted,
    TakeoverDone,
    TakeoverState,
)
from wcache.server.backends.host import HostBackend
from wcache.server.daemon import Daemon
from wcache.server.load import load_model
from wcache.server.service import ConnectionLimits
from wcache.server.store import Store
from wcache.server.tier import HostTier


@pytest.fixture
def backend() -> HostBackend:
    return HostBackend()


@pytest.fixture
def store(backend: HostBackend, ckpt: Path) -> Iterator[Store]:
    s = Store(backend, [load_model(RankSpec(ckpt), backend=backend)])
    try:
        yield s
    finally:
        s.close()


@contextlib.asynccontextmanager
async def serving(store: Store, socket_dir: Path, **kw: Any) -> AsyncIterator[Daemon]:
    """A Daemon of ``store`` serving ``socket_dir/wcache-rank0.sock`` until the block ends."""
    async with serving_here(Daemon(store, socket_dir / "wcache-rank0.sock", software="wcache/test", **kw)) as d:
        yield d
    assert not d.socket_path.exists()


async def _open(d: Daemon) -> Channel[Any]:
    ch, _ = await connect(d.socket_path, software="test", name="test")
    return ch


async def _ask(ch: Channel[Any], frame: Any) -> Any:
    await ch.send(frame)
    reply, fds = await expect(ch)
    close_fds(fds)
    return reply


async def _status(d: Daemon) -> StatusReply:
    return await WCacheClient(d.socket_path).status()


async def test_get_state_release_and_status(store: Store, socket_dir: Path, ckpt: Path) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt)
    ref = load_from_disk(ckpt)
    async with serving(store, socket_dir) as d:
        w = await WCacheClient(d.socket_path).fetch(key)
        try:
            assert torch.equal(w["model.norm.weight"], ref["model.norm.weight"])
            st = await _status(d)
            assert st.software == "wcache/test" and st.backend == "host" and st.connections == 2  # fetch + status
            assert [m.leases for m in st.models] == [1] and [x.pid for x in st.leases] == [os.getpid()]
        finally:
            await w.release()
        assert (await _status(d)).models[0].leases == 0
        assert d.metrics.fetches["zero_copy"] == 1 and d.metrics.releases == 1 and not store.leases
        fam = exposition.parse(d.render_metrics())
        (model,) = store.models.values()
        labels = {"tier": "host", "key": key.short(), "key_id": HostTier.entry_id(key)}
        assert exposition.value(fam, "wcache_resident_bytes", **labels) == model.slab_bytes
        assert exposition.value(fam, "wcache_fetches_total", mode="zero_copy") == 1


async def test_preload_loads_once_and_evict_frees(backend: HostBackend, socket_dir: Path, ckpt: Path) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt)
    empty = Store(backend)
    try:
        async with serving(empty, socket_dir, loader=lambda rp, room: load_model(rp, backend=backend, room=room)) as d:
            client = WCacheClient(d.socket_path)
            first = await client.preload(RankSpec(ckpt))
            again = await client.preload(RankSpec(ckpt))
            assert first.key == again.key == key.to_wire() and first.load_seconds > 0
            assert again.load_seconds == 0  # already held: nothing loaded
            async with await client.fetch(key):
                with pytest.raises(InUseError):
                    await client.evict(key)
            gone = await client.evict(key)
            assert gone.bytes == first.bytes and (await _status(d)).models == ()
            with pytest.raises(NotFoundError):
                await client.evict(key)
    finally:
        empty.close()


async def test_preload_without_a_loader_is_refused(store: Store, socket_dir: Path, ckpt: Path) -> None:
    async with serving(store, socket_dir) as d:
        with pytest.raises(NotFoundError, match="without a loader"):
            await WCacheClient(d.socket_path).preload(RankSpec(ckpt))


async def test_deposit_and_commit_then_fetch(store: Store, socket_dir: Path, ckpt: Path) -> None:
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    ts = tensors()
    async with serving(store, socket_dir) as d:
        client = WCacheClient(d.socket_path)
        done = await client.deposit(key, ts)
        assert done.tensors == len(ts) and not done.replaced
        async with await client.fetch(key) as w:
            for name, t in ts.items():
                assert torch.equal(w[name].view(torch.uint8), t.view(torch.uint8)), name
        assert sorted(m.origin for m in (await _status(d)).models) == ["deposit", "disk"]
        assert not store.deposits


async def test_refusals_are_answered_and_the_connection_serves_on(store: Store, socket_dir: Path, ckpt: Path) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt).to_wire()
    async with serving(store, socket_dir) as d:
        ch = await _open(d)
        try:
            with pytest.raises(KeyMismatchError):
                await _ask(ch, GetState(id=1, key={**key, "tp_size": 2}))
            ch.conn.leases.add(99)  # our own connection would refuse to send it
            with pytest.raises(UnknownLeaseError):
                await _ask(ch, Release(id=2, lease=99))
            with pytest.raises(UnknownLeaseError):
                await _ask(ch, Commit(id=3, deposit=12345))
            with pytest.raises(NotFoundError, match="is a wcache daemon"):
                await _ask(ch, Reclaim(id=4, owner=str(d.socket_path), backend="host"))
            assert isinstance(await _ask(ch, Status(id=5)), StatusReply)
        finally:
            ch.close()
        errors = d.metrics.errors
        assert (errors["KEY_MISMATCH"], errors["UNKNOWN_LEASE"], errors["NOT_FOUND"]) == (1, 2, 1)


async def _begin_deposit(ch: Channel[Any], key: Any) -> DepositSlab:
    """DEPOSIT of one float32[4] on ``ch`` (request id 1): its DEPOSIT_SLAB (the descriptor closed here)."""
    slab = await _ask(ch, Deposit(id=1, key=key.to_wire(), tensors=(DepositTensor("w", "float32", (4,)),)))
    assert isinstance(slab, DepositSlab)
    return slab


async def test_a_commit_from_another_connection_is_refused_and_the_deposit_stays_its_engines(
    store: Store, socket_dir: Path, ckpt: Path
) -> None:
    """A deposit belongs to the connection that asked: another connection's COMMIT of its real id gets the same
    UNKNOWN_LEASE as a made-up id, changes nothing, and the engine's own COMMIT then publishes it."""
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    async with serving(store, socket_dir) as d:
        engine, other = await _open(d), await _open(d)
        try:
            slab = await _begin_deposit(engine, key)
            with pytest.raises(UnknownLeaseError):
                await _ask(other, Commit(id=1, deposit=slab.deposit))
            assert list(store.deposits) == [slab.deposit]
            assert isinstance(await _ask(engine, Commit(id=2, deposit=slab.deposit)), Deposited)
        finally:
            engine.close()
            other.close()
        assert sorted(m.origin for m in (await _status(d)).models) == ["deposit", "disk"]


async def test_a_deposit_not_committed_in_time_is_abandoned_and_its_slot_freed(
    store: Store, socket_dir: Path, ckpt: Path
) -> None:
    """Deposits in progress are few (``Store.max_deposits``, 16) and their bytes count in every room check: engines
    that open them and never COMMIT, on connections that stay open, held write-back off for every other engine
    for ever. One not committed ``deposit_timeout`` after its DEPOSIT_SLAB is abandoned: its key is free again,
    and its COMMIT is refused as any unknown deposit's."""
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    async with serving(store, socket_dir, deposit_timeout=0.5) as d:
        hog, engine = await _open(d), await _open(d)
        try:
            slab = await _begin_deposit(hog, key)
            with pytest.raises(InUseError):
                await _begin_deposit(engine, key)  # the key's deposit is in progress
            deadline = time.monotonic() + 20
            while store.deposits:
                assert time.monotonic() < deadline, "the deposit was not abandoned"
                await asyncio.sleep(0.05)
            assert isinstance(await _begin_deposit(engine, key), DepositSlab)  # the key is free again
            with pytest.raises(UnknownLeaseError):
                await _ask(hog, Commit(id=2, deposit=slab.deposit))
        finally:
            hog.close()
            engine.close()


async def test_an_idle_connection_with_a_deposit_in_progress_is_closed_and_the_deposit_freed(
    store: Store, socket_dir: Path, ckpt: Path
) -> None:
    """Idle deadline 0.3 s: a deposit in progress does not keep a silent connection open (only leases do); its
    closing frees the deposit, whose key is then free for the next one."""
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    async with serving(store, socket_dir, limits=ConnectionLimits(idle_timeout=0.3)) as d:
        ch = await _open(d)
        try:
            await _begin_deposit(ch, key)
            with pytest.raises((EOFError, ConnectionError)):
                await asyncio.wait_for(ch.receive(), 20)  # closed for silence
        finally:
            ch.close()
        deadline = time.monotonic() + 20
        while store.deposits:
            assert time.monotonic() < deadline, "the idle connection's deposit was not freed"
            await asyncio.sleep(0.01)
        await WCacheClient(d.socket_path).deposit(key, {"w": torch.ones(4)})


async def test_a_lease_holder_outlives_the_idle_deadline(store: Store, socket_dir: Path, ckpt: Path) -> None:
    """Idle deadline 0.3 s: a connection holding no lease is closed when silent; one holding a lease never is
    (its lease lives with its connection)."""
    key = WeightCacheKey.from_checkpoint(ckpt)
    async with serving(store, socket_dir, limits=ConnectionLimits(idle_timeout=0.3)) as d:
        holder = await WCacheClient(d.socket_path).fetch(key)  # its connection stays open with the lease
        try:
            idle = await _open(d)
            with pytest.raises((EOFError, ConnectionError)):
                await asyncio.wait_for(idle.receive(), 20)  # closed for silence
            idle.close()
            await asyncio.sleep(0.6)  # twice the deadline
            assert (await _status(d)).models[0].leases == 1  # the holder's connection, and its lease, live
        finally:
            await holder.release()


async def test_at_the_cap_lease_holders_keep_their_place(store: Store, socket_dir: Path, ckpt: Path) -> None:
    """Cap 2: a connection holding no lease gives way to a new one (told so); two lease holders fill the cap."""
    key = WeightCacheKey.from_checkpoint(ckpt)
    async with serving(store, socket_dir, limits=ConnectionLimits(connections=2)) as d:
        holder = await WCacheClient(d.socket_path).fetch(key)
        idle = await _open(d)
        try:
            assert isinstance(await _status(d), StatusReply)  # the third: the idle one gives way
            with pytest.raises(LimitExceededError, match="closed to admit a new connection"):
                await asyncio.wait_for(expect(idle), 20)
            second = await WCacheClient(d.socket_path).fetch(key)
            try:
                with pytest.raises(LimitExceededError, match="too many connections"):
                    await _status(d)
            finally:
                await second.release()
            assert (await _status(d)).models[0].leases == 1  # the first holder's lease lived throughout
        finally:
            idle.close()
            await holder.release()


async def test_a_hand_off_completes_only_once_every_model_is_adopted(
    store: Store, socket_dir: Path, ckpt: Path
) -> None:
    """TAKEOVER, TAKEOVER_STATE, then: a TAKEOVER_ADOPTED of fewer models is IN_USE, and a new daemon silent
    past the hand-off deadline loses its connection — either way the daemon accepts and serves on; another
    request in place of TAKEOVER_ADOPTED is fatal, and the daemon serves on; all of them adopted:
    TAKEOVER_DONE, and the daemon stops, leaving its socket file to the new daemon."""
    d = Daemon(store, socket_dir / "wcache-rank0.sock", software="wcache/test", handoff_timeout=0.5)
    async with serving_here(d):
        for ending in ("too few", "silent", "another request", "adopted"):
            ch = await _open(d)
            try:
                state = await _ask(ch, Takeover(id=1, backend="host"))
                assert isinstance(state, TakeoverState) and len(state.models) == 1
                if ending == "too few":
                    with pytest.raises(InUseError, match="adopted 0 of the 1"):
                        await _ask(ch, TakeoverAdopted(id=2, models=0))
                elif ending == "silent":
                    with pytest.raises((EOFError, ConnectionError)):
                        await asyncio.wait_for(ch.receive(), 20)
                elif ending == "another request":
                    with pytest.raises(UnexpectedFrameError, match="only TAKEOVER_ADOPTED"):
                        await _ask(ch, Status(id=2))
                else:
                    assert isinstance(await _ask(ch, TakeoverAdopted(id=2, models=1)), TakeoverDone)
                    break
            finally:
                ch.close()
            assert isinstance(await asyncio.wait_for(_status(d), 20), StatusReply), ending  # serving on
        await asyncio.wait_for(d._stop.wait(), 20)  # it stops by itself
    assert d.socket_path.exists()  # the new daemon's now


@pytest.fixture
def refused_fds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The daemon's next fd-carrying replies, one per entry of the returned list, are refused by "the kernel"
    (ETOOMANYREFS, as when this uid's descriptors in flight exceed its RLIMIT_NOFILE: nothing goes out)."""
    refusals: list[int] = []
    send = Channel._send_bytes

    async def refusing(self: Channel[Any], data: bytes, fds: list[int] | tuple[int, ...]) -> None:
        if fds and self.conn.role is Role.SERVER and refusals:
            refusals.pop()
            raise OSError(errno.ETOOMANYREFS, os.strerror(errno.ETOOMANYREFS))
        await send(self, data, fds)

    monkeypatch.setattr(Channel, "_send_bytes", refusing)
    return refusals


async def test_a_reply_whose_descriptors_are_refused_takes_back_what_it_granted(
    store: Store, socket_dir: Path, ckpt: Path, refused_fds: list[int]
) -> None:
    """STATE, DEPOSIT_SLAB and TAKEOVER_STATE refused at the first byte: a non-fatal LIMIT_EXCEEDED, and the
    lease (one ledger: the store's), the deposit and the hand-off are taken back — the same connection gets the
    lease and deposits the key again, and the daemon still accepts and serves."""
    key = WeightCacheKey.from_checkpoint(ckpt).to_wire()
    table = (DepositTensor("w", "float32", (4,)),)
    deposit = Deposit(id=0, key=recipe_key(WeightCacheKey.from_checkpoint(ckpt)).to_wire(), tensors=table)
    async with serving(store, socket_dir) as d:
        ch = await _open(d)
        try:
            refused_fds.append(1)
            with pytest.raises(LimitExceededError, match="descriptors are in flight"):
                await _ask(ch, GetState(id=1, key=key))
            assert not store.leases
            state = await _ask(ch, GetState(id=2, key=key))
            assert isinstance(state, State) and list(store.leases) == [state.lease]

            refused_fds.append(1)
            with pytest.raises(LimitExceededError):
                await _ask(ch, Deposit(id=3, key=deposit.key, tensors=table))
            assert not store.deposits
            slab = await _ask(ch, Deposit(id=4, key=deposit.key, tensors=table))  # not IN_USE: nothing was left
            assert isinstance(slab, DepositSlab)

            refused_fds.append(1)
            with pytest.raises(LimitExceededError):
                await _ask(ch, Takeover(id=5, backend="host"))
            assert isinstance(await asyncio.wait_for(_status(d), 20), StatusReply)  # still accepting
            assert not d._stop.is_set()
        finally:
            ch.close()


async def test_a_deposit_replacing_a_held_one_counts_its_bytes_until_freed(
    store: Store, socket_dir: Path, ckpt: Path
) -> None:
    """A COMMIT replaces the deposit served under its recipe key; while a reader (a peer's fill, a host-tier save)
    holds the old one, its slab stays allocated: its bytes count against the budget until the reader is done,
    as an evicted held model's do (``Store.lingering_bytes``)."""
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    async with serving(store, socket_dir) as d:
        client = WCacheClient(d.socket_path)
        await client.deposit(key, {"w": torch.ones(4096)})
        old = store.models[key]
        assert old.hold()  # a peer reads it
        done = await client.deposit(key, {"w": torch.zeros(4096)})
        assert done.replaced and store.models[key] is not old
        assert store.lingering_bytes == old.slab_bytes and old.slabs  # replaced, still held, still counted
        old.release_hold()
        assert store.lingering_bytes == 0 and old.slabs == []
