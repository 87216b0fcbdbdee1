"""The daemon's planning again of a checkpoint whose files were too fresh to prove its key (docs/protocol.md §4.3.1,
"Racy writes"), in process: a Daemon on the host backend, a checkpoint copied just now (its files within RACY_NS
of their change). One planning again per spec however many PRELOADs name it, none for a key no engine proves, and
none started once the stop has begun."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import serving_here
from wcache import WCacheClient, WeightCacheKey
from wcache.plan.key import RACY_NS, RankSpec
from wcache.plan.rank import RankPlan, plan_rank
from wcache.server.backends.host import HostBackend
from wcache.server.daemon import Daemon
from wcache.server.load import load_model
from wcache.server.store import ServedModel, Store


class Counting:
    """plan_rank, recording each spec it planned."""

    def __init__(self) -> None:
        self.specs: list[RankSpec] = []

    def __call__(self, spec: RankSpec) -> RankPlan:
        self.specs.append(spec)
        return plan_rank(spec)


def _fresh(ckpt: Path, tmp_path: Path) -> Path:
    model = tmp_path / "fresh"
    shutil.copytree(ckpt, model)  # every file changed now: a planning within RACY_NS records no facts
    return model


async def test_preloads_of_one_fresh_checkpoint_plan_it_again_once(
    ckpt: Path, tmp_path: Path, socket_dir: Path
) -> None:
    """Four PRELOADs of one fresh checkpoint: one planning again of it. Before, the pending check looked at a list
    the daemon emptied at once, and every PRELOAD started its own planning (headers and fingerprint; all of its
    bytes with --verify-content), all at the same moment, on the worker threads loads use."""
    backend = HostBackend()
    store = Store(backend)
    planner = Counting()
    model = _fresh(ckpt, tmp_path)
    d = Daemon(
        store,
        socket_dir / "wcache-rank0.sock",
        software="wcache/test",
        planner=planner,
        loader=lambda rp, room: load_model(rp, backend=backend, room=room),
    )
    try:
        async with serving_here(d):
            client = WCacheClient(d.socket_path)
            for _ in range(4):  # an engine per start-up, or 4 engines of one node, PRELOAD the node's checkpoint
                await client.preload(RankSpec(model))
            provers = len(d._provers)
            await asyncio.sleep(RACY_NS / 1e9 + 1.0)
            again = len(planner.specs) - 4
    finally:
        store.close()
    assert (provers, again) == (1, 1), f"{provers} prover tasks, {again} deferred plannings of one spec"


async def test_a_verify_content_daemon_does_not_read_the_checkpoint_again_for_a_proof_no_engine_sends(
    ckpt: Path, tmp_path: Path, socket_dir: Path
) -> None:
    """With --verify-content every key is a content key, for which the reference client never sends a proof
    (``WeightCacheKey.from_spec`` defers no such key: §4.3.1): no planning again. Before, it ran, and a content
    planning reads every byte of every shard again (``Checkpoint.fingerprint(content=True)``)."""
    backend = HostBackend()
    store = Store(backend)
    planner = Counting()
    model = _fresh(ckpt, tmp_path)
    assert WeightCacheKey.from_checkpoint(model, verify_content=True).proof() is None  # engines never prove it
    d = Daemon(
        store,
        socket_dir / "wcache-rank0.sock",
        software="wcache/test",
        planner=planner,
        verify_content=True,
        loader=lambda rp, room: load_model(rp, backend=backend, room=room),
    )
    try:
        async with serving_here(d):
            await WCacheClient(d.socket_path).preload(RankSpec(model))
            await asyncio.sleep(RACY_NS / 1e9 + 1.0)
    finally:
        store.close()
    deferred = planner.specs[1:]
    assert not deferred, f"{len(deferred)} deferred content planning(s): the whole checkpoint read again for nothing"


async def test_a_preload_finishing_during_the_stop_leaves_no_prover_behind(
    ckpt: Path, tmp_path: Path, socket_dir: Path
) -> None:
    """A PRELOAD that the stop's drain lets finish starts no planning again. Before, the stop cancelled the
    pending ones before it drained the connections, and one started by such a PRELOAD outlived ``serve()``."""
    backend = HostBackend()
    store = Store(backend)
    model = _fresh(ckpt, tmp_path)
    entered, go = threading.Event(), threading.Event()

    def loader(rp: RankPlan, room: Callable[[int], None]) -> ServedModel:
        entered.set()
        go.wait(30)
        return load_model(rp, backend=backend, room=room)

    d = Daemon(store, socket_dir / "wcache-rank0.sock", software="wcache/test", loader=loader)
    try:
        ready = asyncio.Event()
        serve = asyncio.ensure_future(d.serve(ready.set, signals=False))
        await ready.wait()
        preload = asyncio.ensure_future(WCacheClient(d.socket_path).preload(RankSpec(model)))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        d.stop()
        deadline = time.monotonic() + 10
        while d.socket_path.exists() and time.monotonic() < deadline:  # the stop is past the provers' cancel
            await asyncio.sleep(0.01)
        go.set()
        await asyncio.wait_for(serve, 30)
        await asyncio.gather(preload, return_exceptions=True)
        left = [repr(t) for t in d._provers.values() if not t.done()]
        for t in d._provers.values():
            t.cancel()
    finally:
        go.set()
        store.close()
    assert not left, f"prover task(s) still pending after serve() returned: {left}"
