"""Several models per daemon: PRELOAD/EVICT, the memory budget, LRU eviction that spares leased models."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import DaemonProc, run_cli
from wcache import KeyMismatchError, WCacheClient, WeightCacheKey
from wcache.channel import connect, expect
from wcache.errors import InUseError, NotFoundError, OutOfMemoryError
from wcache.nn import load_from_disk
from wcache.plan.key import RankSpec
from wcache.proto import GetState
from wcache.synthetic import LlamaShape, make_llama_checkpoint

SMALL = LlamaShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512)


@pytest.fixture(scope="module")
def small_models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = tmp_path_factory.mktemp("models")
    shapes = [dataclasses.replace(SMALL, vocab=512 + 64 * i) for i in range(3)]
    return [make_llama_checkpoint(base / f"m{i}", shape, seed=10 + i) for i, shape in enumerate(shapes)]


def _slab(model: Path) -> int:
    from wcache.server.load import planned_bytes

    return planned_bytes(RankSpec(model))[1]


async def test_preload_fetch_evict(daemon_factory: Callable[..., DaemonProc], small_models: list[Path]) -> None:
    a, b, _ = small_models
    d = daemon_factory(a)
    client = WCacheClient(d.socket)
    r = await client.preload(RankSpec(b))
    assert r.tensors == 21 and r.load_seconds > 0 and r.evicted == ()
    again = await client.preload(RankSpec(b))  # already resident: nothing loaded
    assert again.load_seconds == 0
    for m in (a, b):
        async with await client.fetch(WeightCacheKey.from_checkpoint(m)) as w:
            ref = load_from_disk(m)
            assert all(torch.equal(w[k], v) for k, v in ref.items())
    st = await client.status()
    assert len(st.models) == 2
    ev = await client.evict(WeightCacheKey.from_checkpoint(b))
    assert ev.bytes == _slab(b)
    with pytest.raises(KeyMismatchError):
        await client.fetch(WeightCacheKey.from_checkpoint(b))
    with pytest.raises(NotFoundError):
        await client.evict(WeightCacheKey.from_checkpoint(b))


async def test_key_mismatch_is_against_the_closest_served_model(
    daemon_factory: Callable[..., DaemonProc], small_models: list[Path]
) -> None:
    """With several models served, the fields named are those of the one nearest the request (the same
    checkpoint), not of whichever was used last."""
    a, b, _ = small_models
    d = daemon_factory(a)
    client = WCacheClient(d.socket)
    await client.preload(RankSpec(b))  # b is now the most recently used
    with pytest.raises(KeyMismatchError) as info:
        await client.fetch(WeightCacheKey.from_checkpoint(a, dtype="float16"))
    assert set(info.value.fields) == {"dtype"} and info.value.details["closest"].startswith("LlamaForCausalLM@")
    assert WeightCacheKey.from_checkpoint(a).fingerprint[:12] in info.value.details["closest"]


async def test_evict_of_a_key_not_served_names_requested_and_served_values(
    daemon_factory: Callable[..., DaemonProc], small_models: list[Path]
) -> None:
    d = daemon_factory(small_models[0], "--tp-size", "2", "--tp-rank", "0")
    with pytest.raises(NotFoundError) as info:
        await WCacheClient(d.socket).evict(WeightCacheKey.from_checkpoint(small_models[0]))
    assert info.value.requested_values["tp_size"] == 1 and info.value.served_values["tp_size"] == 2
    assert "tp_size: requested 1, served 2" in info.value.message and "tp0of1" in info.value.message


def test_wcache_evict_finds_what_is_served_of_the_checkpoint(
    daemon_factory: Callable[..., DaemonProc], small_models: list[Path], socket_dir: Path
) -> None:
    """``wcache evict DIR`` of a model loaded as tp0 of 2 evicts it (it used to default to --tp-size 1 and say
    NotFoundError naming nothing); with two of DIR's models served it names the options of each."""
    import asyncio

    a = small_models[0]
    d = daemon_factory(a, "--tp-size", "2", "--tp-rank", "0")
    asyncio.run(WCacheClient(d.socket).preload(RankSpec(a)))  # tp0/1 too, on the same daemon
    where = ("--socket-dir", str(socket_dir))
    both = run_cli("evict", str(a), *where)
    assert both.returncode == 1, both.stdout
    assert "--tp-rank 0 --tp-size 2 --dtype bfloat16" in both.stderr and "--tp-size 1" in both.stderr
    wrong = run_cli("evict", str(a), "--tp-rank", "1", "--tp-size", "2", *where)  # rank 1's daemon: none runs
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    one = run_cli("evict", str(a), "--tp-size", "1", *where)
    assert one.returncode == 0, one.stderr
    models = asyncio.run(WCacheClient(d.socket).status()).models
    assert [(m.key["tp_rank"], m.key["tp_size"]) for m in models] == [(0, 2)]
    rest = run_cli("evict", str(a), *where)
    assert rest.returncode == 0 and "tp0/2 bfloat16" in rest.stdout, rest.stderr
    assert asyncio.run(WCacheClient(d.socket).status()).models == ()
    none = run_cli("evict", str(a), *where)
    assert none.returncode == 1 and "NotFoundError" in none.stderr and "serve nothing" in none.stderr


async def test_budget_evicts_lru_but_never_a_leased_model(
    daemon_factory: Callable[..., DaemonProc], small_models: list[Path]
) -> None:
    a, b, c = small_models
    budget = _slab(a) + _slab(b) + _slab(c) // 2  # room for two models, not three
    d = daemon_factory(a, "--memory-budget", str(budget))
    client = WCacheClient(d.socket)
    await client.preload(RankSpec(b))
    held = await client.fetch(WeightCacheKey.from_checkpoint(a))  # a: leased (and most recently used)
    r = await client.preload(RankSpec(c))  # must evict b (unleased), not a
    assert [k["fingerprint"] for k in r.evicted] == [WeightCacheKey.from_checkpoint(b).fingerprint]
    keys = {m.key["fingerprint"] for m in (await client.status()).models}
    assert keys == {WeightCacheKey.from_checkpoint(m).fingerprint for m in (a, c)}
    held_c = await client.fetch(WeightCacheKey.from_checkpoint(c))
    with pytest.raises(OutOfMemoryError) as info:  # a and c leased: nothing may go
        await client.preload(RankSpec(b))
    assert len(info.value.details["pinned"]) == 2
    with pytest.raises(InUseError):
        await client.evict(WeightCacheKey.from_checkpoint(a))
    await held.release()
    await held_c.release()
    await client.preload(RankSpec(b))  # now a (least recently used, unleased) goes
    assert WeightCacheKey.from_checkpoint(a).fingerprint not in {
        m.key["fingerprint"] for m in (await client.status()).models
    }


async def test_empty_daemon_and_cli(small_models: list[Path], socket_dir: Path) -> None:
    from wcache.server.process import spawn_daemon

    d = spawn_daemon(small_models[0], socket_dir)  # placeholder start, then an empty one on another socket
    d.stop()
    empty = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wcache.server.cli",
            "--socket-dir",
            str(socket_dir),
            "--ready-file",
            str(socket_dir.parent / "r.json"),
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        import asyncio
        import time

        deadline = time.monotonic() + 60
        while not (socket_dir.parent / "r.json").exists():
            assert time.monotonic() < deadline and empty.poll() is None
            await asyncio.sleep(0.05)
        sock = socket_dir / "wcache-rank0.sock"
        with pytest.raises(NotFoundError):
            await WCacheClient(sock).fetch(WeightCacheKey.from_checkpoint(small_models[0]))

        def cli(*a: str) -> subprocess.CompletedProcess[str]:
            return run_cli(*a, "--socket-path", str(sock), timeout=120)

        out = await asyncio.to_thread(cli, "preload", str(small_models[1]))
        assert out.returncode == 0 and "resident: 21 tensors" in out.stdout, out.stderr
        async with await WCacheClient(sock).fetch(WeightCacheKey.from_checkpoint(small_models[1])) as w:
            assert len(w) == 21
        out = await asyncio.to_thread(cli, "evict", str(small_models[1]))
        assert out.returncode == 0 and "evicted" in out.stdout
        out = await asyncio.to_thread(cli, "evict", str(small_models[1]))
        assert out.returncode == 1 and "NotFoundError" in out.stderr
    finally:
        empty.terminate()
        empty.wait(30)


async def test_load_on_demand(daemon_factory: Callable[..., DaemonProc], ckpt: Path) -> None:
    d = daemon_factory(ckpt, "--load-on-demand")
    client = WCacheClient(d.socket)
    # another rank of the same checkpoint, then another dtype: loaded on demand from the known directory
    async with await client.fetch(WeightCacheKey.from_checkpoint(ckpt, tp_rank=1, tp_size=2)) as w:
        ref = load_from_disk(ckpt, tp_rank=1, tp_size=2)
        assert set(w) == set(ref) and all(torch.equal(w[k], v) for k, v in ref.items())
    async with await client.fetch(WeightCacheKey.from_checkpoint(ckpt, dtype="float32")) as w:
        assert w["model.norm.weight"].dtype == torch.float32
    assert len((await client.status()).models) == 3
    # a checkpoint the daemon never saw is still a mismatch
    other = ckpt.parent.parent / "never-seen"
    make_llama_checkpoint(other, dataclasses.replace(SMALL, vocab=768), seed=99)
    with pytest.raises(KeyMismatchError):
        await client.fetch(WeightCacheKey.from_checkpoint(other))


def test_a_fetch_compares_its_key_with_one_model_not_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GET_STATE, EVICT or load-on-demand check finds its model by the key it names (one hash lookup and
    one comparison), not by comparing the request with every model's key: 40 deposits under recipe keys of
    25,000 fields once slowed every checkpoint fetch from 13 ms to ~400 ms. Counted, not timed."""
    from wcache.plan.key import WeightCacheKey as Key
    from wcache.plan.recipe import RecipeKey
    from wcache.proto import Evict, GetState, TensorEntry, TensorTable
    from wcache.server.backends.host import HostBackend
    from wcache.server.loader import LoadStats
    from wcache.server.store import ServedModel, Store

    backend = HostBackend()
    base = Key("f" * 32, "LlamaForCausalLM", 1, 0, "bfloat16")
    keys: list[Key] = [RecipeKey.of(base, engine="e", postprocess=i) for i in range(40)] + [base]
    table = TensorTable.from_entries([TensorEntry("w", "uint8", (4,), (1,), 0, 0)])
    store = Store(
        backend, [ServedModel(k, table, {}, [backend.allocate(256)], backend, 4, LoadStats(0, 4, 0)) for k in keys]
    )
    compared: list[Key] = []
    for cls in (Key, RecipeKey):
        real = cls.diff_wire

        def counting(self: Key, requested: dict[str, object], real: Callable[..., object] = real) -> object:
            if any(self is k for k in keys):  # a served model's key (RecipeKey's own diff makes a base key)
                compared.append(self)
            return real(self, requested)

        monkeypatch.setattr(cls, "diff_wire", counting)
    try:
        for k in (base, keys[0], keys[20]):  # the last, the first and a middle one in LRU order
            compared.clear()
            state, fds, model = store.acquire(1, 1, GetState(id=1, key=k.to_wire()))
            assert model.key == k and compared == [k]
            store.revoke(state.lease)
        compared.clear()
        assert store.evict(Evict(id=1, key=keys[39].to_wire()).key).key == keys[39] and compared == [keys[39]]
        assert store.lookup({**base.to_wire(), "extra": 1}) is None  # a field the served key lacks: not it
        assert store.lookup({"architecture": "A"}) is None  # a map that names no key at all
    finally:
        store.close()


@pytest.mark.parametrize(
    "change",
    [
        {"layout": 1},  # a field the variant does not set
        {"architecture": "OtherForCausalLM"},
        {"zzz": "x"},  # a field this daemon does not know
        {"tp_rank": 5, "tp_size": 2},  # no such rank: INVALID_PLAN before
        {"dtype": "int8"},  # no such dtype: INVALID_CHECKPOINT before
        {"transform": "no_such_module:fn"},  # INVALID_TRANSFORM before
    ],
    ids=["layout", "architecture", "unknown-field", "rank", "dtype", "transform"],
)
async def test_load_on_demand_of_a_key_it_cannot_serve_loads_nothing(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, change: dict[str, str | int]
) -> None:
    """--load-on-demand: a GET_STATE whose key no load of the checkpoint gives is answered KEY_MISMATCH, having
    loaded and evicted nothing. It was loaded first (a variant of the fingerprint, evicting the unleased model under
    a budget) and then refused, each time: requests that alternated thrashed the daemon; a variant the planner
    refuses was answered with the PRELOAD's codes."""
    d = daemon_factory(ckpt, "--load-on-demand")
    client = WCacheClient(d.socket)
    before = (await client.status()).models
    key = {**WeightCacheKey.from_checkpoint(ckpt, dtype="float16").to_wire(), **change}
    ch, _ = await connect(d.socket, software="test", name="engine")
    try:
        await ch.send(GetState(id=1, key=key, mode="zero_copy", device_uuid=""))
        with pytest.raises(KeyMismatchError):
            await expect(ch)
    finally:
        ch.close()
    assert (await client.status()).models == before  # nothing loaded, nothing evicted
