"""A load with a load-time transform within --memory-budget (docs/protocol.md §4.9): the transform's output is a
second slab, sized by what the transform returned (``load._transformed``), allocated while the loaded slab still
exists. Room is made for, and held against the budget, the planned layout's bytes and then the output's before it
is allocated — every load path: PRELOAD, a load on demand, a host-tier refill of a transformed key, the start-up
load of ``--transform``. Where evicting every unleased model cannot make room, the load is refused
(OUT_OF_MEMORY) and leaves nothing allocated. Before, room was made for the plan only, and the daemon served the
output on top of it: over its budget, by the padding of ``vllm_layout`` or twice over for an upcast."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import serving_here
from wcache import WCacheClient
from wcache.errors import OutOfMemoryError
from wcache.plan.key import RankSpec
from wcache.plan.rank import RankPlan
from wcache.server.backends.host import HostBackend, HostSlab
from wcache.server.daemon import Daemon
from wcache.server.load import load_model, planned_bytes
from wcache.server.process import spawn_daemon
from wcache.server.store import ServedModel, Store
from wcache.server.tier import HostTier
from wcache.synthetic import LlamaShape, make_llama_checkpoint

#: a vocabulary that is not a multiple of vLLM's padding (64): vllm_layout adds rows to embed_tokens and lm_head
SHAPE = LlamaShape(hidden=256, intermediate=256, layers=1, heads=4, kv_heads=2, vocab=4033)
#: an output a little larger than the plan (vLLM's padded vocabulary), and one twice its size (fp32)
TRANSFORMS = ["wcache.transforms:vllm_layout", "tests.server.upcast_transform:upcast"]


@pytest.fixture(scope="module")
def odd_vocab_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "oddvocab", SHAPE, seed=7)


class LiveBytes(HostBackend):
    """A host backend that knows the bytes of its slabs not closed yet, and the most there were at once."""

    def __init__(self) -> None:
        super().__init__()
        self.slabs: list[HostSlab] = []
        self.peak = 0

    @property
    def live(self) -> int:
        return sum(s.size for s in self.slabs if s.fd >= 0)

    def allocate(self, nbytes: int) -> HostSlab:
        slab = super().allocate(nbytes)
        self.slabs.append(slab)
        self.peak = max(self.peak, self.live)
        return slab


def _sizes(ckpt: Path, transform: str) -> tuple[int, int, int]:
    """The bytes of the checkpoint's slab, of the transformed rank's planned layout and of its output."""
    _, plain = planned_bytes(RankSpec(ckpt))
    _, planned = planned_bytes(RankSpec(ckpt, transform=transform))
    out = load_model(RankSpec(ckpt, transform=transform), backend=HostBackend(), threads=2)
    try:
        return plain, planned, out.slab_bytes
    finally:
        out.close()


@contextlib.contextmanager
def _store(ckpt: Path, budget: int) -> Iterator[tuple[Store, LiveBytes, ServedModel]]:
    """A store of ``budget`` serving the checkpoint (unleased: a victim), its slabs on a ``LiveBytes``."""
    backend = LiveBytes()
    plain = load_model(RankSpec(ckpt), backend=backend, threads=2)
    store = Store(backend, [plain], budget=budget)
    try:
        yield store, backend, plain
    finally:
        store.close()


@contextlib.asynccontextmanager
async def _serving(store: Store, socket_dir: Path, tier: HostTier | None = None, **kw: Any) -> AsyncIterator[Daemon]:
    def loader(rp: RankPlan, room: Any) -> ServedModel:
        return load_model(rp, backend=store.backend, threads=2, tier=tier, room=room)

    daemon = Daemon(store, socket_dir / "wcache-rank0.sock", software="wcache/test", loader=loader, tier=tier, **kw)
    async with serving_here(daemon) as d:
        yield d


def _nothing_held(store: Store, backend: LiveBytes) -> None:
    """No load holds room any more, and every slab allocated is one a served model holds."""
    assert (store.loading_bytes, store.loading_models) == (0, 0)
    assert backend.live == store.resident_bytes


@pytest.mark.parametrize("transform", TRANSFORMS)
async def test_a_transformed_preload_evicts_for_its_output_and_stays_within_the_budget(
    odd_vocab_ckpt: Path, socket_dir: Path, transform: str
) -> None:
    """The budget holds the plan and the output at once, not the checkpoint besides: the checkpoint (unleased) is
    evicted for the output, and no more slab bytes than the budget exist at any time."""
    plain, planned, out = _sizes(odd_vocab_ckpt, transform)
    budget = planned + out
    assert out > planned and plain + planned + out > budget
    with _store(odd_vocab_ckpt, budget) as (store, backend, checkpoint):
        async with _serving(store, socket_dir) as d:
            pre = await WCacheClient(d.socket_path).preload(RankSpec(odd_vocab_ckpt, transform=transform))
            assert pre.bytes == out and pre.evicted == (checkpoint.key.to_wire(),)
            assert [m.slab_bytes for m in store.models.values()] == [out]
            assert backend.peak <= budget, f"{backend.peak} slab bytes at once against a {budget}-byte budget"
            _nothing_held(store, backend)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("how", ["preload", "on demand"])
async def test_a_transformed_load_whose_output_does_not_fit_is_refused_and_leaves_nothing(
    odd_vocab_ckpt: Path, socket_dir: Path, transform: str, how: str
) -> None:
    """The budget holds the checkpoint and the transformed rank's plan, not the output besides the plan: the load
    is refused with OUT_OF_MEMORY (a PRELOAD's answer; a GET_STATE of the key with --load-on-demand), nothing is
    evicted for it, and its slabs are freed. Before, it was served over the budget."""
    plain, planned, out = _sizes(odd_vocab_ckpt, transform)
    budget = plain + planned
    assert planned + out > budget
    spec = RankSpec(odd_vocab_ckpt, transform=transform)
    key, _ = planned_bytes(spec)
    with _store(odd_vocab_ckpt, budget) as (store, backend, checkpoint):
        async with _serving(store, socket_dir, load_on_demand=True) as d:
            client = WCacheClient(d.socket_path)
            load = client.preload(spec) if how == "preload" else client.fetch(key)
            with pytest.raises(OutOfMemoryError):
                await load
            assert list(store.models.values()) == [checkpoint]
            assert backend.peak <= budget
            _nothing_held(store, backend)


@pytest.mark.parametrize("transform", TRANSFORMS)
async def test_a_host_tier_refill_of_a_transformed_key_stays_within_the_budget(
    odd_vocab_ckpt: Path, socket_dir: Path, tmp_path: Path, transform: str
) -> None:
    """A PRELOAD of a transformed key the host tier holds is refilled from the entry, the output's size, not the
    plan's: room is made for the difference too (the checkpoint, unleased, evicted for it)."""
    plain, planned, out = _sizes(odd_vocab_ckpt, transform)
    tier = HostTier(tmp_path / "tier", 1 << 30)
    spec = RankSpec(odd_vocab_ckpt, transform=transform)
    load_model(spec, backend=HostBackend(), threads=2, tier=tier).close()  # the entry: the output's bytes
    budget = plain + planned
    assert plain + out > budget >= out
    with _store(odd_vocab_ckpt, budget) as (store, backend, checkpoint):
        async with _serving(store, socket_dir, tier=tier) as d:
            await WCacheClient(d.socket_path).preload(spec)
            assert [(m.origin, m.slab_bytes) for m in store.models.values()] == [("tier", out)]
            assert backend.peak <= budget
            _nothing_held(store, backend)


def test_a_daemon_started_with_a_transform_whose_output_does_not_fit_does_not_serve(
    odd_vocab_ckpt: Path, socket_dir: Path
) -> None:
    """``--transform`` at start with a budget between the plan and the (upcast) output: the daemon exits with an
    error instead of serving over its budget."""
    transform = "tests.server.upcast_transform:upcast"
    _, planned, out = _sizes(odd_vocab_ckpt, transform)
    budget = (planned + out) // 2
    assert planned < budget < out
    d = spawn_daemon(odd_vocab_ckpt, socket_dir, "--transform", transform, "--memory-budget", str(budget), timeout=None)
    try:
        with pytest.raises(RuntimeError, match="exited"):
            d.wait_ready(60)
    finally:
        d.stop()
    assert d.proc.returncode == 1 and not d.ready_file.exists()
