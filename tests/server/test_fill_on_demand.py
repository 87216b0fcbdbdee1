"""A daemon started with ``--fill-from`` fills from its peers on demand, not only at start (docs/fleet.md, "When a
daemon fills"): a PRELOAD, a load on demand and a GET_STATE of a recipe key it does not hold try the peers first
and fall back to the host tier or the disk, one fill per key however many ask. In this process: the target a
``Daemon`` on the host backend serving a real Unix socket through the server shell, the sources
``PeerService``s on the peer shell (tests/server/test_fill.py's ``sources``), NIXL over loopback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import serving_here
from tests.server.deposit_engine import recipe_key
from tests.server.test_fill import NONE, _bytes, _cfg, _listening, _load, _memfds, sources
from tests.server.test_tier_generations import _until
from wcache import WCacheClient, WeightCacheKey
from wcache.errors import KeyMismatchError, OutOfMemoryError
from wcache.plan.key import RankSpec
from wcache.plan.rank import RankPlan, plan_rank
from wcache.proto.fleet_frames import PeerRead
from wcache.server.backends.host import HostBackend
from wcache.server.daemon import Daemon
from wcache.server.fill import FillConfig, PeerFill
from wcache.server.load import load_from_tier, load_model
from wcache.server.peer import PeerListener, PeerService
from wcache.server.store import ServedModel, Store
from wcache.server.tier import HostTier, TierEntry
from wcache.synthetic import TINY, make_llama_checkpoint

pytest.importorskip("nixl_cu12", reason="the fleet extra (pip install -e '.[fleet]') is not installed")

FUSE = "wcache.transforms:fuse_llama_qkv_gate_up"


@contextlib.asynccontextmanager
async def target(
    socket_dir: Path,
    cfg: FillConfig,
    *,
    tier: HostTier | None = None,
    spec: str = "",
    budget: int | None = None,
    **kw: Any,
) -> AsyncIterator[Daemon]:
    """A daemon holding nothing, filling from ``cfg``'s peers (its PeerFill) and loading from disk after."""
    backend = HostBackend()
    store = Store(backend, budget=budget)

    def loader(rp: RankPlan, room: Callable[[int], None]) -> ServedModel:
        return load_model(rp, backend=backend, threads=2, tier=tier, room=room)

    def restore(entry: TierEntry, key: WeightCacheKey) -> ServedModel | None:
        assert tier is not None
        return load_from_tier(tier, entry, key, backend, 2, None)

    d = Daemon(
        store,
        socket_dir / "target.sock",
        software="wcache/test",
        loader=loader,
        tier=tier,
        tier_restore=restore if tier is not None else None,
        peer_fill=PeerFill(cfg, backend, spec=spec),
        **kw,
    )
    try:
        async with serving_here(d, 60) as served:
            yield served
    finally:
        store.close()


def _origins(d: Daemon) -> dict[str, str]:
    return {m.key.short(): m.origin for m in d.store.models.values()}


def _rank_bytes(ckpt: Path, tp_rank: int = 0, tp_size: int = 1, **kw: Any) -> bytes:
    m = load_model(RankSpec(ckpt, tp_rank=tp_rank, tp_size=tp_size, **kw), backend=HostBackend(), threads=2)
    try:
        return _bytes(m)
    finally:
        m.close()


async def test_a_preload_and_a_load_on_demand_fill_from_a_peer(ckpt: Path, socket_dir: Path) -> None:
    """PRELOAD of rank 0 of 2 and then a GET_STATE of rank 1 of 2 (load on demand: a variant of a checkpoint the
    daemon holds) are both resharded from the peer's TP=1 slab; STATUS names the peer; the bytes are a disk
    load's. On main's code both loaded from disk."""
    async with sources(_load(ckpt)) as ports, target(socket_dir, _cfg(ports), load_on_demand=True) as d:
        peer = f"peer 127.0.0.1:{ports[0]}"
        client = WCacheClient(d.socket_path)
        done = await client.preload(RankSpec(ckpt, tp_rank=0, tp_size=2), timeout=60)
        key0 = WeightCacheKey.from_checkpoint(ckpt, tp_rank=0, tp_size=2)
        assert done.key == key0.to_wire()
        key1 = WeightCacheKey.from_checkpoint(ckpt, tp_rank=1, tp_size=2)
        async with await client.fetch(key1, timeout=60) as w:
            assert "model.norm.weight" in w
        assert _origins(d) == {key0.short(): peer, key1.short(): peer}
        assert (await client.status()).models[0].origin == peer
        for key, rank in ((key0, 0), (key1, 1)):
            assert _bytes(d.store.models[key]) == _rank_bytes(ckpt, rank, 2)
        assert d.metrics.fills[("filled", "")] == 2 and d.metrics.fill_bytes > 0


async def test_a_dns_spec_is_resolved_again_for_every_fill(ckpt: Path, socket_dir: Path) -> None:
    """--fill-from dns:NAME:PORT: the first PRELOAD finds no peer there (disk); a peer that joined the fleet
    since is asked by the next one (on main's code the peers were those NAME resolved to at start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    spec = f"dns:localhost:{port}"
    cfg = _cfg([], connect_timeout=2.0)
    async with target(socket_dir, cfg, spec=spec) as d:
        client = WCacheClient(d.socket_path)
        await client.preload(RankSpec(ckpt, tp_rank=0, tp_size=2), timeout=60)
        assert d.metrics.fills[("failed", "no-peer")] == 1
        svc = PeerService(Store(HostBackend(), [_load(ckpt)]), NONE, software="wcache/test")
        listener = PeerListener(svc, "127.0.0.1", port)
        listener.start()
        try:
            await client.preload(RankSpec(ckpt, tp_rank=1, tp_size=2), timeout=60)
            await _until(lambda: not svc.fills, "the target released its leases")
        finally:
            await listener.stop()
            svc.store.close()
        assert sorted(_origins(d).values()) == ["disk", f"peer 127.0.0.1:{port}"]


async def test_a_transformed_key_is_filled_byte_for_byte(ckpt: Path, socket_dir: Path) -> None:
    """A load-time transform's layout only its source knows: the key is filled from a slab under exactly it,
    byte for byte (on main's code the offer's table was checked against the untransformed layout: refused, and
    the rank loaded from disk)."""
    fused = load_model(RankSpec(ckpt, transform=FUSE), backend=HostBackend(), threads=2)
    want = _bytes(fused)
    async with sources(fused) as ports, target(socket_dir, _cfg(ports)) as d:
        done = await WCacheClient(d.socket_path).preload(RankSpec(ckpt, transform=FUSE), timeout=60)
        (m,) = d.store.models.values()
        assert m.key.to_wire() == done.key and m.origin == f"peer 127.0.0.1:{ports[0]}"
        assert _bytes(m) == want and "model.layers.0.self_attn.qkv_proj.weight" in m.table.names


@pytest.mark.parametrize("fits", [False, True], ids=["past-the-budget", "within-the-budget"])
async def test_a_transformed_rank_offered_larger_than_planned_is_filled_only_within_the_budget(
    ckpt: Path, socket_dir: Path, tmp_path: Path, fits: bool
) -> None:
    """A peer offers a slab under exactly the transformed key four times the size of the rank's planned layout (a
    hostile fleet member, or a transform that lays it out larger). With ``--memory-budget`` twice the plan (the
    loaded slab and the transform's output, the plan's size here, exist at once) the PRELOAD cannot make room for
    it: the fill is refused (reason ``room``) and the rank loads from disk, within the budget — before, the offer
    sized the slab and the daemon served four times the plan. With a budget that holds the offer, the PRELOAD makes
    room beyond the plan (as the disk path does for a transform's output) and serves the peer's slab."""
    with plan_rank(RankSpec(ckpt, transform=FUSE)) as rp:
        key, planned = rp.key, rp.layout.total_bytes
    shape = dataclasses.replace(TINY, layers=TINY.layers * 4)
    big = load_model(RankSpec(make_llama_checkpoint(tmp_path / "big", shape, seed=3)), backend=HostBackend())
    offered = dataclasses.replace(big, key=key)  # the source's store closes it
    size = offered.slab_bytes
    assert size > 2 * planned
    budget = size if fits else 2 * planned
    async with peer(offered) as (_, port), target(socket_dir, _cfg([port]), budget=budget) as d:
        await WCacheClient(d.socket_path).preload(RankSpec(ckpt, transform=FUSE), timeout=60)
        if fits:
            assert _origins(d) == {key.short(): f"peer 127.0.0.1:{port}"}
            assert d.store.resident_bytes == size and d.metrics.fills[("filled", "")] == 1
        else:
            assert _origins(d) == {key.short(): "disk"}
            assert d.store.resident_bytes <= planned
            assert d.metrics.fills[("failed", "room")] == 1
        assert (d.store.loading_bytes, d.store.loading_models) == (0, 0)  # the room held for the load is given back


async def test_a_larger_fill_that_fails_gives_its_room_back_before_the_disk_path(
    ckpt: Path, socket_dir: Path, tmp_path: Path
) -> None:
    """``--memory-budget`` twice the plan: exactly what the disk path needs (the loaded slab and the transform's
    output, the plan's size here). A peer offers ~1.4x the plan under the transformed key (room made for the bytes
    beyond the plan) and fails mid-fill: the PRELOAD loads from disk. Before, the failed fill's room beyond the plan
    stayed held through the disk path, whose transform output was then refused OUT_OF_MEMORY."""
    with plan_rank(RankSpec(ckpt, transform=FUSE)) as rp:
        key, planned = rp.key, rp.layout.total_bytes
    shape = dataclasses.replace(TINY, layers=TINY.layers + 3)
    big = load_model(RankSpec(make_llama_checkpoint(tmp_path / "big", shape, seed=3)), backend=HostBackend())
    offered = dataclasses.replace(big, key=key)  # the source's store closes it
    assert planned < offered.slab_bytes <= 2 * planned
    async with peer(offered) as (svc, port):
        _break_second_grants(svc)
        async with target(socket_dir, _cfg([port], chunk=1 << 20), budget=2 * planned) as d:
            await WCacheClient(d.socket_path).preload(RankSpec(ckpt, transform=FUSE), timeout=60)
            assert _origins(d) == {key.short(): "disk"}
            assert d.store.resident_bytes <= planned and d.metrics.fills[("failed", "transfer")] == 1
            assert (d.store.loading_bytes, d.store.loading_models) == (0, 0)


async def test_a_recipe_key_asked_for_at_once_is_filled_once(ckpt: Path, socket_dir: Path) -> None:
    """A GET_STATE of a recipe key (a deposit) this daemon does not hold fills it from the peer that serves it;
    a second GET_STATE of the key while that fill runs waits for it and shares it: the source served one fill.
    A recipe key no peer holds (and no host tier) is refused as before."""
    m = _load(ckpt)
    recipe = recipe_key(m.key)
    deposit = dataclasses.replace(m, key=recipe, origin="deposit", buffers=("model.norm.weight",))
    rate = m.slab_bytes // 2  # two seconds for the fill: the second request lands in it
    async with peer(deposit, max_rate=rate) as (svc, port), target(socket_dir, _cfg([port])) as d:
        client = WCacheClient(d.socket_path)
        first = asyncio.ensure_future(client.fetch(recipe, timeout=60))
        await _until(lambda: svc.fills, "the fill is under way")
        second = asyncio.ensure_future(client.fetch(recipe, timeout=60))
        await asyncio.sleep(0.1)
        assert svc.fills and not first.done()  # the second GET_STATE came while the fill ran
        async with await first as a, await second as b:
            assert a.buffers == {"model.norm.weight"} == b.buffers
            for name in a:
                assert torch.equal(a[name], b[name])
        assert svc.fills_done == 1 and svc.bytes_served == m.slab_bytes
        assert _origins(d) == {recipe.short(): f"peer 127.0.0.1:{port}"}
        assert _bytes(d.store.models[recipe]) == _bytes(deposit)
        with pytest.raises(KeyMismatchError):  # as before: what is served under the closest key
            await client.fetch(recipe_key(m.key, postprocess=2), timeout=60)
        assert d.metrics.fills[("filled", "")] == 1 and d.metrics.fills[("failed", "not-found")] == 1


async def test_a_recipe_key_is_filled_from_one_peer_not_striped_across_deposits(
    ckpt: Path, socket_dir: Path, tmp_path: Path
) -> None:
    """Two nodes serve deposits under one recipe key that hold other bytes (another generation: the same size and
    table): the target's slab is one of them byte for byte. It was striped across both — a slab nobody deposited."""
    m = _load(ckpt)
    other_ckpt = tmp_path / "other"
    make_llama_checkpoint(other_ckpt, TINY, seed=1234)  # the same shapes, other bytes
    other = _load(other_ckpt)
    recipe = recipe_key(m.key)
    a = dataclasses.replace(m, key=recipe, origin="deposit")
    b = dataclasses.replace(other, key=recipe, origin="deposit")
    assert a.slab_bytes == b.slab_bytes and _bytes(a) != _bytes(b)
    async with peer(a) as (_, port_a), peer(b) as (_, port_b):
        cfg = _cfg([port_a, port_b], chunk=64 << 10)  # stripes of 64 KiB: both peers would serve some
        async with target(socket_dir, cfg) as d:
            async with await WCacheClient(d.socket_path).fetch(recipe, timeout=60):
                pass
            got = _bytes(d.store.models[recipe])
            assert got in (_bytes(a), _bytes(b))
    other.close()


async def test_a_recipe_keys_fill_holds_its_room_against_a_deposit_meanwhile(ckpt: Path, socket_dir: Path) -> None:
    """A GET_STATE of a recipe key fills it from a peer into room made once the offer says its size; that room is
    held against ``--memory-budget`` until the model is served, so a deposit while the fill READs (the budget:
    the filled slab and half a deposit) is OUT_OF_MEMORY, and the store stays within the budget. Before, the room
    was made and not held: the deposit took it, and the filled model put the store over its budget."""
    m = _load(ckpt)
    recipe = recipe_key(m.key)
    deposit = dataclasses.replace(m, key=recipe, origin="deposit")
    extra = 1 << 20
    budget = m.slab_bytes + extra // 2
    reading, go = asyncio.Event(), asyncio.Event()
    async with peer(deposit) as (svc, port):
        original = svc.handle

        async def held(request: Any, fds: list[int], ctx: Any) -> Any:
            if isinstance(request, PeerRead):  # the target made its room and allocated its slab
                reading.set()
                await go.wait()
            return await original(request, fds, ctx)

        svc.handle = held  # type: ignore[method-assign]
        async with target(socket_dir, _cfg([port]), budget=budget) as d:
            client = WCacheClient(d.socket_path)
            fetch = asyncio.ensure_future(_fetched(client, recipe))
            try:
                await asyncio.wait_for(reading.wait(), 30)
                with pytest.raises(OutOfMemoryError):
                    await client.deposit(
                        recipe_key(m.key, postprocess=2), {"w": torch.zeros(extra // 4, dtype=torch.float32)}
                    )
            finally:
                go.set()
                assert await asyncio.wait_for(fetch, 60) > 0
            assert _origins(d) == {recipe.short(): f"peer 127.0.0.1:{port}"}
            assert d.store.resident_bytes + d.store.pending_bytes <= budget and d.store.loading_bytes == 0


@contextlib.asynccontextmanager
async def peer(*models: ServedModel, **kw: Any) -> AsyncIterator[tuple[PeerService, int]]:
    """One source serving ``models`` on the peer shell: its service and port."""
    svc = PeerService(Store(HostBackend(), list(models)), NONE, software="wcache/test", **kw)
    try:
        async with _listening(svc) as port:
            yield svc, port
            await _until(lambda: not svc.fills, "the target released its leases")
    finally:
        svc.close()
        svc.store.close()


async def _fetched(client: WCacheClient, key: WeightCacheKey) -> int:
    """Fetch ``key``, release it; the tensors it held."""
    async with await client.fetch(key, timeout=60) as w:
        return len(w)


def _break_second_grants(svc: PeerService) -> None:
    """The source's handler fails on the second PEER_READ of every fill (the shell answers INTERNAL)."""
    original = svc.handle
    grants: dict[int, int] = {}

    async def failing(request: Any, fds: list[int], ctx: Any) -> Any:
        if isinstance(request, PeerRead):
            grants[request.lease] = grants.get(request.lease, 0) + 1
            if grants[request.lease] == 2:
                raise RuntimeError("the source broke")
        return await original(request, fds, ctx)

    svc.handle = failing  # type: ignore[method-assign]


async def test_a_peer_failing_mid_fill_on_demand_leaves_the_disk_and_the_tier(
    ckpt: Path, socket_dir: Path, tmp_path: Path
) -> None:
    """The source fails mid-fill: a PRELOAD and a GET_STATE of a recipe key load from disk / are refused as
    not served — each with the fill's reason counted, the half-filled slab freed, nothing half-filled served."""
    m = _load(ckpt)
    recipe = recipe_key(m.key)
    deposit = dataclasses.replace(m, key=recipe, origin="deposit")
    async with peer(m, deposit) as (svc, port):
        _break_second_grants(svc)
        gc.collect()  # what earlier tests left to the collector is not counted
        before = _memfds()
        async with target(socket_dir, _cfg([port], chunk=1 << 20)) as d:
            client = WCacheClient(d.socket_path)
            await client.preload(RankSpec(ckpt), timeout=60)
            assert _origins(d) == {m.key.short(): "disk"}
            assert _bytes(d.store.models[m.key]) == _bytes(m)
            with pytest.raises(KeyMismatchError):  # not served: what is served under the closest key
                await client.fetch(recipe, timeout=60)
            assert recipe not in d.store.models
            failed = {reason: n for (outcome, reason), n in d.metrics.fills.items() if outcome == "failed"}
            assert sum(failed.values()) == 2 and set(failed) <= {"transfer", "deadline"}
            assert d.metrics.fills[("filled", "")] == 0
            gc.collect()
            assert _memfds() == before + 1  # the slab served, no half-filled one left


async def test_this_nodes_host_tier_comes_before_the_peers(ckpt: Path, socket_dir: Path, tmp_path: Path) -> None:
    """A key this node's host tier holds is refilled from it, the peers not asked (local memory, every block
    checked, against a network transfer): a GET_STATE of a recipe key and a PRELOAD of the checkpoint, with a
    peer serving both."""
    m = _load(ckpt)
    recipe = recipe_key(m.key)
    deposit = dataclasses.replace(m, key=recipe, origin="deposit")
    tier = HostTier(tmp_path / "tier", 1 << 30)
    try:
        tier.supersede(recipe, "g1")  # as a COMMIT of the deposit on this node did, then its save
        assert tier.save(recipe, m.slabs[0], m.table, dict(m.aliases), m.payload_bytes, generation="g1")
        assert tier.save(m.key, m.slabs[0], m.table, dict(m.aliases), m.payload_bytes)
        async with peer(m, deposit) as (svc, port), target(socket_dir, _cfg([port]), tier=tier) as d:
            client = WCacheClient(d.socket_path)
            assert await _fetched(client, recipe) > 0
            await client.preload(RankSpec(ckpt), timeout=60)
            assert _origins(d) == {recipe.short(): "tier", m.key.short(): "tier"}
            assert _bytes(d.store.models[recipe]) == _bytes(m) == _bytes(d.store.models[m.key])
            assert svc.fills_done == 0 and svc.bytes_served == 0 and not d.metrics.fills
    finally:
        tier.close()
