"""A deposit replaced, restored and committed at once (wcache/server/daemon.py with a host tier): what the daemon
serves under a recipe key is always the deposit last committed under it, never an older one the tier still held
or a restore that a commit overtook (docs/reliability.md, "Host tier"). In-process daemons on the host backend:
the tier's save and restore are held at the point where the interleaving matters."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.server.deposit_engine import recipe_key
from wcache import WCacheClient, WeightCacheKey
from wcache.client import CachedWeights
from wcache.errors import KeyMismatchError, NotFoundError
from wcache.server.backends.host import HostBackend
from wcache.server.daemon import Daemon
from wcache.server.load import load_from_tier
from wcache.server.store import ServedModel, Store
from wcache.server.tier import HostTier, TierEntry


@dataclass
class InProcess:
    daemon: Daemon
    tier: HostTier
    store: Store

    @property
    def socket(self) -> Path:
        return self.daemon.socket_path


@pytest.fixture
async def served(socket_dir: Path, tmp_path: Path) -> AsyncIterator[InProcess]:
    backend = HostBackend(staging_bytes=16 << 20)
    store = Store(backend)
    tier = HostTier(tmp_path / "tier", 1 << 30)

    def restore(entry: TierEntry, key: WeightCacheKey) -> ServedModel | None:
        return load_from_tier(tier, entry, key, backend, 2, None)

    daemon = Daemon(store, socket_dir / "d.sock", software="test", tier=tier, tier_restore=restore)
    ready = asyncio.Event()
    task = asyncio.ensure_future(daemon.serve(ready.set))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        yield InProcess(daemon, tier, store)
    finally:
        daemon.stop()
        await asyncio.wait_for(task, 30)
        await asyncio.wait_for(asyncio.gather(*daemon._tier_saves, return_exceptions=True), 30)
        store.close()
        tier.close()


def _version(n: int) -> dict[str, torch.Tensor]:
    """Deposit ``n`` of one recipe: the same names and shapes, other bytes."""
    g = torch.Generator().manual_seed(n)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}


def _holds(w: CachedWeights, ts: dict[str, torch.Tensor]) -> bool:
    return set(w) == set(ts) and all(torch.equal(w[n], t) for n, t in ts.items())


async def _until(what: Callable[[], object], why: str, deadline_s: float = 20.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {deadline_s} s: {why}")
        await asyncio.sleep(0.01)


async def _saved(d: InProcess) -> None:
    await _until(lambda: not d.daemon._tier_saves, "the deposit's background save finished")


async def test_a_replaced_deposit_is_not_restored_while_its_replacement_is_being_saved(
    served: InProcess, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1 is committed and saved; v2 replaces it (DEPOSITED) and its save is still running when the key is
    evicted and asked for: the tier's v1 must not be restored (it was, origin "tier"). Once v2's save is done,
    v2 comes back from the tier."""
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    client = WCacheClient(served.socket)
    await client.deposit(key, _version(1))
    await _saved(served)
    gate = threading.Event()
    save = served.tier.save

    def held(*args: Any, **kwargs: Any) -> bool:
        assert gate.wait(30)
        return save(*args, **kwargs)

    monkeypatch.setattr(served.tier, "save", held)
    done = await client.deposit(key, _version(2))
    assert done.replaced
    await client.evict(key)
    try:
        with pytest.raises((KeyMismatchError, NotFoundError)):
            async with await client.fetch(key) as w:
                raise AssertionError(f"served after the eviction: v1 {_holds(w, _version(1))}")
    finally:
        gate.set()
    await _saved(served)
    async with await client.fetch(key) as w:
        assert _holds(w, _version(2))
    assert [m.origin for m in served.store.models.values()] == ["tier"]


async def test_a_restore_overtaken_by_a_commit_serves_the_commit_and_frees_its_slab(
    served: InProcess, ckpt: Path
) -> None:
    """Engine A's GET_STATE restores v1 from the tier while engine B deposits and commits v2 under the same key:
    v2 is what A gets and what is served afterwards (v1 was, and v2's slab leaked), and the restored slab is freed."""
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    await WCacheClient(served.socket).deposit(key, _version(1))
    await _saved(served)
    await WCacheClient(served.socket).evict(key)
    restored: list[ServedModel] = []
    filled, gate = threading.Event(), threading.Event()
    restore = served.daemon.tier_restore
    assert restore is not None

    def held(entry: TierEntry, k: WeightCacheKey) -> ServedModel | None:
        m = restore(entry, k)
        assert m is not None
        restored.append(m)
        filled.set()
        assert gate.wait(30)
        return m

    served.daemon.tier_restore = held
    engine_a = asyncio.ensure_future(WCacheClient(served.socket).fetch(key))
    try:
        await _until(filled.is_set, "engine A's restore filled its slab")
        done = await WCacheClient(served.socket).deposit(key, _version(2))  # engine B
        assert not done.replaced  # nothing was served under the key when B committed
    finally:
        gate.set()
    async with await asyncio.wait_for(engine_a, 30) as w:
        assert _holds(w, _version(2))
    (model,) = served.store.models.values()
    assert model.origin == "deposit" and model is not restored[0]
    assert restored[0].slabs == []  # the overtaken restore's slab is closed, not left behind


async def test_generations_are_kept_only_while_they_matter(served: InProcess, ckpt: Path) -> None:
    """The generation of each committed deposit is kept while the tier may still hold an older one or a restore
    of the key runs — not for ever: a map of every recipe key ever committed grew ~18 KB a key (3,000 unique keys
    committed and evicted: RSS 28 -> 81 MiB)."""
    base = WeightCacheKey.from_checkpoint(ckpt)
    client = WCacheClient(served.socket)
    for i in range(20):
        key = recipe_key(base, postprocess=i)
        await client.deposit(key, _version(i))
        await client.evict(key)
    await _saved(served)
    assert served.store.generations == {} and not served.store.restoring


def _filled(value: int, size: int) -> Any:
    """A sealed host slab of ``size`` bytes of one value (the caller closes it)."""
    import os

    slab = HostBackend().allocate(size)
    _, (fd,) = slab.export()
    os.pwrite(fd, bytes([value]) * size, 0)
    slab.seal()
    return slab


@pytest.mark.parametrize("moment", ["the slab opened", "the meta opened"])
def test_a_lookup_racing_a_commit_leaves_the_commits_tombstone_and_its_save(
    moment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Daemon Y looks a recipe key up while daemon X, on the same tier directory, commits a new generation of it:
    X's ``supersede`` replaces g1's meta by g2's tombstone and removes g1's slab either after Y read the meta and
    before it opens the slab (Y finds the slab missing), or while Y opens the meta (Y holds the replaced file: no
    link left). Y refuses the entry and removes only the files it examined: g2's tombstone stays, the tier records
    g2, and X's save of g2 is published. Before, Y removed the files by path — g2's tombstone —, the tier recorded
    no generation of the key (a kept g1 then passed the reclaim's check) and X's save found no tombstone of its
    generation and published nothing: the deposit was lost from the tier."""
    import os

    from wcache.plan.recipe import RecipeKey
    from wcache.proto.table import TensorEntry, TensorTable
    from wcache.server import tier as tier_mod

    size = 1 << 16
    table = TensorTable.from_entries([TensorEntry("w", "uint8", (size,), (1,), 0, 0)])
    x = HostTier(tmp_path / "tier", 1 << 30)
    y = HostTier(tmp_path / "tier", 1 << 30)
    key = RecipeKey.of(WeightCacheKey("f" * 64, "LlamaForCausalLM", 1, 0, "bfloat16"), engine="test")
    g1, g2 = _filled(1, size), _filled(2, size)
    x.supersede(key, "g1")
    assert x.save(key, g1, table, {}, size, generation="g1")
    slab_path, meta_path = y._paths(key)
    fired: list[bool] = []
    if moment == "the slab opened":
        open_own = tier_mod._open_own

        def x_commits_before_y_opens_the_slab(path: Path) -> int | None:
            if path == slab_path and not fired:
                fired.append(True)
                x.supersede(key, "g2")
            return open_own(path)

        monkeypatch.setattr(tier_mod, "_open_own", x_commits_before_y_opens_the_slab)
    else:
        fstat = os.fstat

        def x_commits_while_y_opens_the_meta(fd: int) -> os.stat_result:
            if not fired and os.readlink(f"/proc/self/fd/{fd}") == str(meta_path):
                fired.append(True)
                x.supersede(key, "g2")  # Y's descriptor now names the replaced meta (no link left)
            return fstat(fd)

        monkeypatch.setattr(os, "fstat", x_commits_while_y_opens_the_meta)
    try:
        assert y.lookup(key) is None and fired
    finally:
        monkeypatch.undo()
    assert x.generation_of(key) == "g2"
    assert x.save(key, g2, table, {}, size, generation="g2")
    entry = y.lookup(key)
    assert entry is not None and entry.generation == "g2"
    g1.close()
    g2.close()


def test_an_eviction_racing_a_commit_leaves_the_commits_tombstone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Daemon X saves key B and must evict key A's entry to fit its budget; between X listing the entries and
    removing A's, daemon Y (same directory) commits g2 of A: its tombstone replaces A's meta. X removes the files
    it listed only: g2's tombstone stays and the tier still records g2 of A. Before, X removed A's paths — the
    tombstone —, and the tier recorded no generation of A (a kept older deposit of A then passed the check)."""
    from wcache.plan.recipe import RecipeKey
    from wcache.proto.table import TensorEntry, TensorTable

    size = 1 << 16
    table = TensorTable.from_entries([TensorEntry("w", "uint8", (size,), (1,), 0, 0)])
    x = HostTier(tmp_path / "tier", size + size // 2)  # room for one entry
    y = HostTier(tmp_path / "tier", size + size // 2)
    base = WeightCacheKey("f" * 64, "LlamaForCausalLM", 1, 0, "bfloat16")
    a, b = RecipeKey.of(base, engine="a"), RecipeKey.of(base, engine="b")
    s1, s2 = _filled(1, size), _filled(2, size)
    x.supersede(a, "g1")
    assert x.save(a, s1, table, {}, size, generation="g1")
    listing = x._listing

    def y_commits_after_x_listed() -> list[tuple[Path, Path, int, tuple[int, int]]]:
        out = listing()
        y.supersede(a, "g2")
        return out

    monkeypatch.setattr(x, "_listing", y_commits_after_x_listed)
    x.supersede(b, "h1")
    assert x.save(b, s2, table, {}, size, generation="h1")
    monkeypatch.undo()
    assert x.generation_of(a) == "g2"
    s1.close()
    s2.close()


def test_a_meta_refused_while_a_save_publishes_leaves_the_new_entry_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Daemon Y reads a damaged meta (refused on the meta alone, its slab never opened) while daemon X publishes a
    new entry of the key (slab and meta, under the directory lock). Y removes what it examined only: X's new meta
    and its new slab stay, and the entry is whole. Before, a refusal on the meta alone removed whatever slab was at
    the path — X's — leaving X's meta without its bytes: the next lookup dropped the entry, X's save lost."""
    import os

    from wcache.proto.table import TensorEntry, TensorTable

    size = 1 << 16
    table = TensorTable.from_entries([TensorEntry("w", "uint8", (size,), (1,), 0, 0)])
    x = HostTier(tmp_path / "tier", 1 << 30)
    y = HostTier(tmp_path / "tier", 1 << 30)
    key = WeightCacheKey("e" * 64, "LlamaForCausalLM", 1, 0, "bfloat16")
    old, new = _filled(1, size), _filled(2, size)
    assert x.save(key, old, table, {}, size, generation="")
    slab_path, meta_path = y._paths(key)
    with open(meta_path, "r+b") as f:  # damaged: its checksum fails
        f.seek(20)
        f.write(b"\xff" * 8)
    read = y._read_meta_seen
    fired: list[bool] = []

    def read_while_x_publishes(meta: Path, seen: list[int | None]) -> dict[str, Any] | None:
        try:
            return read(meta, seen)
        finally:
            if not fired:
                fired.append(True)
                assert x.save(key, new, table, {}, size, generation="")  # X publishes a whole new entry

    monkeypatch.setattr(y, "_read_meta_seen", read_while_x_publishes)
    assert y.lookup(key) is None and fired  # the damaged meta: refused
    monkeypatch.undo()
    assert os.path.exists(slab_path)
    entry = x.lookup(key)
    assert entry is not None and entry.size == size
    old.close()
    new.close()
