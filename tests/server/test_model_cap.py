"""The model cap (docs/protocol.md §7, "models per daemon": 64, or the slab descriptors' share of RLIMIT_NOFILE)
holds while a load runs: a load in progress (a PRELOAD, a load on demand, a host-tier restore, a fill) holds its
model slot from the room made for it until its model is served, as it holds its bytes (``Store.loading``). A
DEPOSIT or COMMIT meanwhile counts that slot: it evicts an unleased model for it, or is refused LIMIT_EXCEEDED,
exactly as it would with the model already added. Before, only the bytes were held: a deposit committed during
the load took the slot, and the load then added its model past the cap."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.server.deposit_engine import recipe_key
from wcache import WCacheClient, WeightCacheKey
from wcache.errors import LimitExceededError
from wcache.plan.key import RankSpec
from wcache.plan.recipe import RecipeKey
from wcache.proto import Commit, Deposit, DepositTensor, GetState
from wcache.server.backends.host import HostBackend
from wcache.server.process import DaemonProcess
from wcache.server.store import Store, split_descriptors

NOFILE = 64
GATE = "tests.server.gate_transform:gate"
BASE = WeightCacheKey("f", "A", 1, 0, "bfloat16")


def _deposit(store: Store, key: RecipeKey) -> int:
    """Begin a one-tensor deposit of ``key`` on connection 1 (the descriptors are the slab's own); its id."""
    tensor = DepositTensor("w", "float32", (4,))
    return store.begin_deposit(1, 1, Deposit(id=1, key=key.to_wire(), tensors=(tensor,)))[2].id


def _commit(store: Store, key: RecipeKey) -> list[WeightCacheKey]:
    """Deposit and commit ``key``: the keys of the models evicted for it."""
    _, _, _, evicted = store.commit_deposit(1, Commit(id=2, deposit=_deposit(store, key)))
    return [m.key for m in evicted]


def _lease(store: Store, key: RecipeKey) -> None:
    store.acquire(1, 1, GetState(id=3, key=key.to_wire()))


def test_a_deposit_during_a_load_counts_the_loads_model_slot() -> None:
    store = Store(HostBackend(), max_models=3)
    a, b, c, d = (recipe_key(BASE, postprocess=i) for i in range(4))
    try:
        assert _commit(store, a) == [] and _commit(store, b) == []
        _lease(store, b)
        with store.loading(0):  # the cap's last slot is the load's
            assert _commit(store, c) == [a]  # the unleased model goes for it, as if the load's model were added
            _lease(store, c)
            with pytest.raises(LimitExceededError) as info:  # b and c leased: nothing can go
                _deposit(store, d)
            assert info.value.details["loading"] == 1 and not store.deposits
            assert len(store.models) + store.loading_models == store.max_models
        assert store.loading_models == 0  # the load ended (failed here: nothing added): its slot is free again
        _deposit(store, d)
    finally:
        store.close()


def test_a_commit_during_a_preload_does_not_take_its_model_slot_past_the_cap(socket_dir: Path, ckpt: Path) -> None:
    """A daemon at RLIMIT_NOFILE 64 (a cap of 10 models) holds 9, every one leased; a PRELOAD is admitted for the
    last slot and held in its transform (a gate) while a DEPOSIT arrives: the deposit is refused, and the PRELOAD
    then serves the tenth model."""
    probe = Store(HostBackend())
    probe.fit_descriptors(split_descriptors(NOFILE, 1024)[1])
    cap = probe.max_models
    reached, gate = socket_dir.parent / "gate-reached", socket_dir.parent / "gate-open"
    env = {**os.environ, "WCACHE_TEST_GATE_REACHED": str(reached), "WCACHE_TEST_GATE": str(gate)}
    ready, log = socket_dir.parent / "ready.json", socket_dir.parent / "daemon.log"
    cmd = [sys.executable, "-m", "wcache.server.cli", "--model", str(ckpt), "--socket-dir", str(socket_dir)]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            ["sh", "-c", f'ulimit -n {NOFILE} && exec "$@"', "sh", *cmd, "--ready-file", str(ready)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
        )
    d = DaemonProcess(proc, log, ready, time.perf_counter())
    base = WeightCacheKey.from_checkpoint(ckpt)

    async def scenario() -> int:
        held = [await WCacheClient(d.socket).fetch(base)]  # the checkpoint, leased
        try:
            for i in range(cap - 2):  # cap - 1 models in all, every one leased: none may be evicted
                key = recipe_key(base, postprocess=i)
                await WCacheClient(d.socket).deposit(key, {"b": torch.ones(1)})
                held.append(await WCacheClient(d.socket).fetch(key))
            assert len((await WCacheClient(d.socket).status()).models) == cap - 1
            preload = asyncio.ensure_future(WCacheClient(d.socket).preload(RankSpec(ckpt, transform=GATE)))
            try:
                deadline = time.monotonic() + 60
                while not reached.exists():  # the PRELOAD holds the last slot, in its transform
                    assert time.monotonic() < deadline and not preload.done(), "the PRELOAD never reached the gate"
                    await asyncio.sleep(0.02)
                with pytest.raises(LimitExceededError):
                    await WCacheClient(d.socket).deposit(recipe_key(base, postprocess=1000), {"b": torch.ones(1)})
            finally:
                gate.touch()
            await asyncio.wait_for(preload, 60)
            return len((await WCacheClient(d.socket).status()).models)
        finally:
            for w in held:
                await w.release()

    try:
        d.wait_ready(60)
        models = asyncio.run(scenario())
    finally:
        d.stop()
    assert models == cap
