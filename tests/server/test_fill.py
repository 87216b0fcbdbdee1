"""A fleet fill end to end in one process (docs/fleet.md): the source's peer handler (wcache/server/peer.py) behind
a stand-in for the server shell, the target's fill (wcache/server/fill.py) over loopback TCP and NIXL, host
backend. Bytes are compared with what a disk load of the same key gives; every failure is a FillError with
its reason and leaves nothing allocated or held on either side."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.plan.test_rank import plan_file
from wcache.errors import CheckpointError, FillError, LimitExceededError, WCacheError
from wcache.peer_files import MARKER, refuse_stubs, write_files
from wcache.plan.key import RankSpec, WeightCacheKey
from wcache.plan.rank import RankPlan, plan_rank
from wcache.plan.recipe import RecipeKey
from wcache.plan.reshard import DEFAULT_CHUNK, Copy
from wcache.proto import Release
from wcache.server import agent_process
from wcache.server import fill as fill_mod
from wcache.server.agent_process import AgentProcess
from wcache.server.backends.host import HostBackend, HostSlab
from wcache.server.fill import (
    ASSUMED_FILLS,
    MIN_GRANT,
    FillConfig,
    batches,
    deadline_for,
    fill,
    grant_bytes,
    resolve_peers,
)
from wcache.server.load import load_model
from wcache.server.nixl import Agent
from wcache.server.peer import PeerListener, PeerService, RateCap
from wcache.server.peer_auth import PeerSecurity
from wcache.server.peer_channel import GRANT_SECONDS
from wcache.server.service import ConnectionLimits
from wcache.server.store import ServedModel, Store
from wcache.synthetic import TINY, make_llama_checkpoint

pytest.importorskip("nixl_cu12", reason="the fleet extra (pip install -e '.[fleet]') is not installed")
pytest.importorskip("cryptography", reason="the fleet extra (pip install -e '.[fleet]') is not installed")

NONE = PeerSecurity.configure(cert=None, key=None, ca=None, secret_file=None)


def _load(ckpt: Path, tp_rank: int = 0, tp_size: int = 1) -> ServedModel:
    return load_model(RankSpec(ckpt, tp_rank=tp_rank, tp_size=tp_size), backend=HostBackend(), threads=2)


def _bytes(m: ServedModel) -> bytes:
    return m.slabs[0].read(0, m.slabs[0].size)


@pytest.fixture
def agent() -> Iterator[AgentProcess]:
    """The fill's agent as a daemon makes it: in a child process (wcache/server/agent_process.py)."""
    a = AgentProcess(f"t-fill-{os.getpid()}-{time.monotonic_ns()}")
    yield a
    a.close()


@asynccontextmanager
async def sources(
    *models: ServedModel, security: PeerSecurity = NONE, max_fills: int = 4, max_rate: int = 0
) -> AsyncIterator[list[int]]:
    """One PeerService (own store) per model, each on a peer listener (the server shell) on loopback: ports."""
    async with AsyncExitStack() as stack:
        ports = []
        services = []
        for m in models:
            svc = PeerService(
                Store(HostBackend(), [m]), security, software="wcache/test", max_fills=max_fills, max_rate=max_rate
            )
            services.append(svc)
            stack.callback(svc.store.close)
            stack.callback(svc.close)
            ports.append(await stack.enter_async_context(_listening(svc)))
        yield ports
        deadline = time.monotonic() + 10  # a connection the test closed ends at the source a moment later
        while any(svc.fills for svc in services) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for svc in services:
            assert not svc.fills  # every fill released its leases (or its connection ended)


@asynccontextmanager
async def _listening(svc: PeerService, limits: ConnectionLimits | None = None) -> AsyncIterator[int]:
    listener = PeerListener(svc, "127.0.0.1", 0, limits=limits)
    _, port = listener.start()
    try:
        yield port
    finally:
        await listener.stop()


@pytest.mark.parametrize("rate", [0, 4_000_000], ids=["uncapped", "capped"])
async def test_one_peer_holding_both_tp2_ranks_fills_a_tp1_target(ckpt: Path, agent: AgentProcess, rate: int) -> None:
    """One source daemon serving both ranks of TP=2 offers two slabs on one connection; the TP=1 target reads from
    both at once, bit-identical to a disk load, capped or not. Before, the two pulls each awaited the channel's next
    frame for their grants: one's wait replaced the other's, grants went to the pull of the other lease, and the
    fill failed (``deadline``) and loaded from disk."""
    r0, r1 = _load(ckpt, 0, 2), _load(ckpt, 1, 2)
    want = _bytes(_load(ckpt))
    svc = PeerService(Store(HostBackend(), [r0, r1]), NONE, software="wcache/test", max_rate=rate)
    try:
        async with _listening(svc) as port:
            with plan_rank(RankSpec(ckpt)) as rp:
                got = await asyncio.wait_for(_fill(rp, agent, _cfg([port], timeout=5.0)), 60)
            try:
                assert _bytes(got) == want
            finally:
                got.close()
    finally:
        svc.close()
        svc.store.close()


async def test_a_listener_on_port_0_names_the_port_it_bound() -> None:
    """``--peer-listen HOST:0`` takes any free port: the shell's tag, which starts every peer log line, names that
    port (it named port 0, built before the bind)."""
    svc = PeerService(Store(HostBackend()), NONE, software="wcache/test")
    listener = PeerListener(svc, "127.0.0.1", 0)
    try:
        host, port = listener.start()
        assert port != 0
        assert listener.shell.tag == f"peer={host}:{port}"
    finally:
        await listener.stop()
        svc.store.close()


def _cfg(ports: list[int], security: PeerSecurity = NONE, **kw: object) -> FillConfig:
    return FillConfig(tuple(("127.0.0.1", p) for p in ports), security, "wcache/test", **kw)  # type: ignore[arg-type]


async def _fill(rp: RankPlan, agent: AgentProcess, cfg: FillConfig) -> ServedModel:
    return await fill(rp.key, rp, HostBackend(), agent, cfg)


async def test_tp1_fills_tp1_and_both_tp2_ranks_bit_identical(ckpt: Path, agent: AgentProcess) -> None:
    whole = _load(ckpt)
    want = {(r, n): _bytes(m) for r, n in ((0, 2), (1, 2)) for m in [_load(ckpt, r, n)]}
    want[(0, 1)] = _bytes(whole)
    async with sources(whole) as ports:
        for (r, n), expect in want.items():
            with plan_rank(RankSpec(ckpt, tp_rank=r, tp_size=n)) as rp:
                got = await _fill(rp, agent, _cfg(ports))
            try:
                assert _bytes(got) == expect
                assert got.origin == f"peer 127.0.0.1:{ports[0]}"
                assert list(got.table) == list(rp.layout.table()) and got.key == rp.key
            finally:
                got.close()


async def test_two_tp2_peers_fill_a_tp1_daemon_and_three_peers_are_striped(ckpt: Path, agent: AgentProcess) -> None:
    ranks = [_load(ckpt, r, 2) for r in range(2)]
    want = _bytes(_load(ckpt))
    async with sources(*ranks) as ports:
        with plan_rank(RankSpec(ckpt)) as rp:
            got = await _fill(rp, agent, _cfg(ports))
        assert _bytes(got) == want
        assert got.origin == f"peer 127.0.0.1:{min(ports)} +1"  # both peers served: each holds half
        got.close()
    async with sources(_load(ckpt), _load(ckpt), _load(ckpt)) as ports:
        with plan_rank(RankSpec(ckpt)) as rp:
            got = await _fill(rp, agent, _cfg(ports, chunk=1 << 20))
        assert _bytes(got) == want
        assert got.origin.endswith(" +2")  # every peer served a share
        got.close()


async def test_slabs_sharded_by_a_plan_file_fill_its_other_layouts(
    ckpt: Path, tmp_path: Path, agent: AgentProcess
) -> None:
    """A plan file's rules hold at any size: two TP=2 peers sharded by it fill a TP=1 target keyed by the same
    file, and a TP=1 peer fills both TP=2 ranks (the target plans the peers' layouts with its own plan)."""
    plan = plan_file(tmp_path)
    spec = RankSpec(ckpt, plan_file=plan)
    ranks = [load_model(dataclasses.replace(spec, tp_rank=r, tp_size=2), backend=HostBackend()) for r in range(2)]
    whole = load_model(spec, backend=HostBackend())
    assert whole.key.plan == ranks[0].key.plan and whole.key.plan.startswith("file:")
    want = [(m.key, _bytes(m)) for m in ranks]  # a source's store closes its models
    async with sources(*ranks) as ports:
        with plan_rank(spec) as rp:
            got = await _fill(rp, agent, _cfg(ports))
        assert _bytes(got) == _bytes(whole) and got.key == whole.key
        got.close()
    async with sources(whole) as ports:
        for r, (key, data) in enumerate(want):
            with plan_rank(dataclasses.replace(spec, tp_rank=r, tp_size=2)) as rp:
                got = await _fill(rp, agent, _cfg(ports))
            assert _bytes(got) == data and got.key == key
            got.close()


async def test_a_deposit_fills_by_its_recipe_key_byte_for_byte(ckpt: Path, agent: AgentProcess) -> None:
    m = _load(ckpt)
    recipe = RecipeKey.of(m.key, engine="vllm", postprocess=1)
    deposit = dataclasses.replace(m, key=recipe, origin="deposit", buffers=("model.norm.weight",))
    async with sources(deposit) as ports:
        got = await fill(recipe, None, HostBackend(), agent, _cfg(ports))
        assert _bytes(got) == _bytes(deposit) and got.key == recipe
        assert got.buffers == ("model.norm.weight",) and list(got.table) == list(deposit.table)
        got.close()
        with plan_rank(RankSpec(ckpt)) as rp, pytest.raises(FillError) as err:  # a plain key: not from a deposit
            await _fill(rp, agent, _cfg(ports))
        assert err.value.details["reason"] == "not-found"


class _Unplannable(PeerService):
    """A source whose offers name a layout the checkpoint cannot be split into: TP=3 of 256 rows under ``plan``."""

    plan = ""

    def _offer(self, req: Any, ctx: Any) -> Any:
        o = super()._offer(req, ctx)
        bad: dict[str, str | int] = {"tp_size": 3, "tp_rank": 0, "plan": self.plan}
        return dataclasses.replace(o, models=tuple(dataclasses.replace(m, key={**m.key, **bad}) for m in o.models))


async def test_an_offer_of_a_layout_that_cannot_be_planned_is_skipped(ckpt: Path, agent: AgentProcess) -> None:
    """One peer offers its slab under a key naming TP=3, which this checkpoint cannot be split into: that offer is
    skipped (as any offer the target cannot use) and the peer offering the exact key fills, whichever answers
    first. The planner's ShardingError failed the whole fill (reason ``transfer``) and dropped the honest offer."""
    honest = PeerService(Store(HostBackend(), [_load(ckpt)]), NONE, software="wcache/test")
    liar = _Unplannable(Store(HostBackend(), [_load(ckpt)]), NONE, software="wcache/test")
    with plan_rank(RankSpec(ckpt, tp_size=2)) as two:
        liar.plan = two.key.plan  # the built-in plan: it resolves at any size, and cannot split by 3
    try:
        async with _listening(honest) as good, _listening(liar) as bad:
            with plan_rank(RankSpec(ckpt)) as rp:
                for order in ([good, bad], [bad, good]):
                    got = await _fill(rp, agent, _cfg(order))
                    try:
                        assert got.origin == f"peer 127.0.0.1:{good}"
                        assert _bytes(got) == _bytes(honest.store.models[rp.key])
                    finally:
                        got.close()
                with pytest.raises(FillError) as err:  # the liar alone: nothing fills, as for any unusable offer
                    await _fill(rp, agent, _cfg([bad]))
                assert err.value.details["reason"] == "not-found"
        assert not honest.fills and not liar.fills  # the skipped offer's lease was released too
    finally:
        for svc in (honest, liar):
            svc.close()
            svc.store.close()


async def test_a_lying_peer_is_detected_and_nothing_is_served(ckpt: Path, tmp_path: Path, agent: AgentProcess) -> None:
    """The peer serves another checkpoint's bytes (same shapes and names, other values) under the real key."""
    other = make_llama_checkpoint(tmp_path / "other", TINY, shards=2, seed=7)
    real = _load(ckpt)
    liar = dataclasses.replace(_load(other), key=real.key)
    before = _memfds()
    async with sources(liar) as ports:
        with plan_rank(RankSpec(ckpt)) as rp, pytest.raises(FillError) as err:
            await _fill(rp, agent, _cfg(ports))
    assert err.value.details["reason"] == "verify"
    assert _memfds() <= before  # the half-filled slab was freed


def _fds_and_threads() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


async def test_a_failed_fill_ends_its_agent_process_at_once(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PeerFill``'s agent (a child process with a UCX worker: threads, sockets, pipes) is gone when its fill ends,
    failed or not: the process has exited and been reaped, and the daemon keeps none of its descriptors or threads.
    In-process, a failed fill's FillError traceback held the fill's frames in a cycle with the event loop's task,
    and the agent lived until the next full garbage collection: with the collector off, every failed fill kept
    ~5 descriptors and a thread."""
    import gc

    from wcache.server import fill as fill_mod

    procs: list[AgentProcess] = []

    class Watched(AgentProcess):
        def __init__(self, name: str, **kw: Any) -> None:
            super().__init__(name, **kw)
            procs.append(self)

    monkeypatch.setattr(fill_mod, "AgentProcess", Watched)
    other = make_llama_checkpoint(tmp_path / "other", TINY, shards=2, seed=7)
    real = _load(ckpt)
    liar = dataclasses.replace(_load(other), key=real.key)  # fails verification: reason ``verify``
    loop = asyncio.get_running_loop()
    async with sources(liar) as ports:
        pf = fill_mod.PeerFill(_cfg(ports), HostBackend())
        with plan_rank(RankSpec(ckpt)) as rp, ThreadPoolExecutor(1) as worker:  # as the daemon: off its loop
            assert (await loop.run_in_executor(worker, pf.rank, rp)).reason == "verify"
            gc.collect()
            before = _fds_and_threads()
            gc.disable()
            try:
                for _ in range(6):
                    assert (await loop.run_in_executor(worker, pf.rank, rp)).reason == "verify"
                    proc = procs[-1]._proc
                    assert procs[-1].closed and proc is not None and proc.returncode == 0  # exited, reaped
                deadline = time.monotonic() + 10  # the source ends its side of each connection a moment later
                while _fds_and_threads() > before and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                after = _fds_and_threads()
            finally:
                gc.enable()
    assert len(procs) == 7
    assert after[0] <= before[0] and after[1] <= before[1], (before, after)


def _memfds() -> int:
    return sum(1 for fd in os.listdir("/proc/self/fd") if "memfd:wcache-slab" in _link(fd))


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


async def test_a_source_failing_mid_fill_fails_it_and_frees_the_slab(ckpt: Path, agent: AgentProcess) -> None:
    """The source's handler fails on the second grant (the shell answers INTERNAL): the target gives up,
    releases its lease and frees its slab. (A source SIGKILLed mid-fill: tests/server/test_fill_daemon.py.)"""
    m = _load(ckpt)
    before = _memfds()
    svc = PeerService(Store(HostBackend(), [m]), NONE, software="wcache/test")
    original = svc.handle
    reads = 0

    async def failing(request, fds, ctx):
        nonlocal reads
        if type(request).__name__ == "PeerRead":
            reads += 1
            if reads == 2:
                raise RuntimeError("the source broke")
        return await original(request, fds, ctx)

    svc.handle = failing  # type: ignore[method-assign]
    async with _listening(svc) as port:
        with plan_rank(RankSpec(ckpt)) as rp, pytest.raises(FillError) as err:
            await _fill(rp, agent, _cfg([port], chunk=1 << 20))
    assert err.value.details["reason"] in ("transfer", "deadline")
    assert not svc.fills and _memfds() <= before
    svc.store.close()


@pytest.mark.parametrize("sig", [signal.SIGABRT, signal.SIGSTOP], ids=["aborted", "stopped"])
async def test_the_agent_process_dying_mid_fill_fails_the_fill_and_frees_the_slab(
    ckpt: Path, sig: signal.Signals
) -> None:
    """The fill's NIXL agent runs in a child process (wcache/server/agent_process.py), so UCX aborting it (its
    assertion when a source dies during the connection setup: docs/fleet.md) ends the fill, not the process
    that fills. Aborted at its first READ, the fill fails with reason ``nixl`` and names the signal. Stopped
    there, it fails once the child has not answered in ``timeout`` seconds, and the child is killed. Either way
    the slab is freed, the source's lease released and the child reaped. Before, the agent ran in the daemon:
    the abort was the daemon's, with every model it served."""
    m = _load(ckpt)
    before = _memfds()
    agent = AgentProcess(f"t-dies-{os.getpid()}-{time.monotonic_ns()}", timeout=2.0)
    pid = agent.pid
    assert pid is not None

    def die(n: int) -> None:
        os.kill(pid, sig)
        time.sleep(0.2)  # an abort's core and exit, before the READ is sent

    agent.on_post = die
    try:
        async with sources(m) as ports:
            with plan_rank(RankSpec(ckpt)) as rp, pytest.raises(FillError) as err:
                await asyncio.wait_for(_fill(rp, agent, _cfg(ports)), 30)
        assert err.value.details["reason"] == "nixl"
        if sig == signal.SIGABRT:
            assert err.value.details["status"] == -signal.SIGABRT and "SIGABRT" in err.value.message
        else:
            assert err.value.details["status"] is None and "did not answer" in err.value.message
        assert agent.closed and agent._proc is not None and agent._proc.returncode is not None  # reaped
        assert _memfds() <= before
    finally:
        agent.close()


async def test_a_slab_the_agent_process_may_still_map_is_kept_not_freed(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fill's agent stops answering mid-fill and SIGKILL does not end it (a process stuck in the kernel: here
    stopped, its kill made a no-op, the wait for it cut short): it may still map the slab, so the failed fill
    keeps the slab for the daemon's life (``fill.KEPT``) instead of freeing it. Before, the slab was freed after
    the 10 s wait: a CUDA IPC slab went back to torch's allocator with the child's mapping live."""
    m = _load(ckpt)
    before = _memfds()
    monkeypatch.setattr(agent_process, "KILL_WAIT_S", 0.2)
    agent = AgentProcess(f"t-stuck-{os.getpid()}-{time.monotonic_ns()}", timeout=2.0)
    proc = agent._proc
    assert proc is not None
    monkeypatch.setattr(proc, "kill", lambda: None)
    agent.on_post = lambda n: os.kill(proc.pid, signal.SIGSTOP)
    kept = len(fill_mod.KEPT)
    try:
        async with sources(m) as ports:
            with plan_rank(RankSpec(ckpt)) as rp, pytest.raises(FillError) as err:
                await asyncio.wait_for(_fill(rp, agent, _cfg(ports)), 30)
        assert err.value.details["reason"] == "nixl" and "did not answer" in err.value.message
        (slab,) = fill_mod.KEPT[kept:]
        assert isinstance(slab, HostSlab) and "memfd:wcache-slab" in _link(str(slab.fd))  # kept open, not freed
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for slab in fill_mod.KEPT[kept:]:
            slab.close()
        del fill_mod.KEPT[kept:]
        agent.close()
    assert _memfds() <= before


def _never_grant(svc: PeerService) -> None:
    """``svc`` answers every request but PEER_READ, which it never answers (a source that stops granting)."""
    original = svc.handle

    async def silent(request: Any, fds: list[int], ctx: Any) -> Any:
        if type(request).__name__ == "PeerRead":
            await asyncio.sleep(3600)
        return await original(request, fds, ctx)

    svc.handle = silent  # type: ignore[method-assign]


async def test_a_grant_that_never_comes_is_a_deadline_naming_the_source(ckpt: Path, agent: AgentProcess) -> None:
    """A source that stops answering PEER_READ: the fill fails at its deadline with a FillError that says which
    source and how far it got (it was ``TimeoutError:`` with no message), and the slab is freed."""
    m = _load(ckpt)
    before = _memfds()
    svc = PeerService(Store(HostBackend(), [m]), NONE, software="wcache/test")
    _never_grant(svc)
    try:
        async with _listening(svc) as port:
            with plan_rank(RankSpec(ckpt)) as rp, pytest.raises(FillError) as err:
                await _fill(rp, agent, _cfg([port], timeout=0.5, min_rate=1 << 40))
        assert err.value.details["reason"] == "deadline"
        assert f"127.0.0.1:{port}" in err.value.message and "no grant" in err.value.message
        assert _memfds() <= before
    finally:
        svc.close()
        svc.store.close()


async def test_no_peer_and_auth_refused_are_fill_errors(ckpt: Path, tmp_path: Path, agent: AgentProcess) -> None:
    with plan_rank(RankSpec(ckpt)) as rp:
        with pytest.raises(FillError) as err:
            await _fill(rp, agent, _cfg([1]))  # nothing listens on port 1
        assert err.value.details["reason"] == "no-peer"
        good, bad = (tmp_path / "a"), (tmp_path / "b")
        good.write_bytes(b"the fleet's secret, 32 bytes ok!")
        bad.write_bytes(b"a stranger's secret, also long..")
        for p in (good, bad):
            p.chmod(0o600)
        sec = PeerSecurity.configure(cert=None, key=None, ca=None, secret_file=good)
        other = PeerSecurity.configure(cert=None, key=None, ca=None, secret_file=bad)
        async with sources(_load(ckpt), security=sec) as ports:
            with pytest.raises(FillError) as err:
                await _fill(rp, agent, _cfg(ports, other))
            assert err.value.details["reason"] == "auth"
            got = await _fill(rp, agent, _cfg(ports, sec))  # the right secret fills
            got.close()


async def test_a_target_the_source_refuses_by_certificate_fails_with_reason_auth(
    ckpt: Path, tmp_path: Path, agent: AgentProcess
) -> None:
    """A mutual-TLS source refuses the target's certificate (another CA's, an expired one, none: the shared-secret
    mode) or its plain TCP: the fill's reason is ``auth`` and its message names why. The source's TLS alert stayed
    in its buffer and the target saw a bare close: reason ``transfer``, "peer closed the connection"."""
    from tests.server.test_peer_auth import make_ca, mtls, secret

    make_ca(tmp_path, "fleet")
    make_ca(tmp_path, "other")
    refused = {
        "unknown ca": mtls(tmp_path, "other", "fleet"),
        "certificate expired": mtls(tmp_path, "fleet-expired", "fleet"),
        "certificate required": secret(tmp_path, b"correct horse battery staple 42"),
        "peer channel is TLS": NONE,
    }
    async with sources(_load(ckpt), security=mtls(tmp_path, "fleet", "fleet")) as ports:
        with plan_rank(RankSpec(ckpt)) as rp:
            for why, target in refused.items():
                with pytest.raises(FillError) as err:
                    await _fill(rp, agent, _cfg(ports, target))
                assert err.value.details["reason"] == "auth", (why, err.value.message)
                assert why in err.value.message
            got = await _fill(rp, agent, _cfg(ports, mtls(tmp_path, "fleet", "fleet")))  # the fleet's certificate
            got.close()


async def test_the_rate_cap_paces_the_grants(ckpt: Path, agent: AgentProcess) -> None:
    m = _load(ckpt)
    size = m.slabs[0].size
    rate = size * 4  # bytes/s: a quarter of a second for the whole slab
    async with sources(m, max_rate=rate) as ports:
        with plan_rank(RankSpec(ckpt)) as rp:
            t0 = time.monotonic()
            got = await _fill(rp, agent, _cfg(ports, chunk=1 << 20))
            took = time.monotonic() - t0
    got.close()
    assert took >= size / rate - GRANT_SECONDS  # what an idle cap lends


async def test_the_rate_cap_holds_over_windows_shorter_than_a_batch(ckpt: Path) -> None:
    """What a target READs from a capped source follows the cap over any window of a tenth of a second, though
    the whole slab is one 64 MiB batch: the grants are a hundredth of a second of the rate each, asked for two
    ahead, so at most the rate times the window (and the hundredth of a second an idle cap lends) plus two
    grants lands in it (on main's code the whole slab was READ at once, after one grant that waited for all
    of it)."""
    m = _load(ckpt)
    size, want = m.slabs[0].size, _bytes(m)
    rate = size * 2  # half a second for the slab
    window = 0.1
    grant = grant_bytes(rate, DEFAULT_CHUNK)
    assert grant < size * window  # many grants per window
    agent = AgentProcess(f"t-posts-{os.getpid()}-{time.monotonic_ns()}")
    posts: list[tuple[float, int]] = []
    agent.on_post = lambda n: posts.append((time.monotonic(), n))
    try:
        async with sources(m, max_rate=rate) as ports:
            with plan_rank(RankSpec(ckpt)) as rp:
                got = await _fill(rp, agent, _cfg(ports))
        assert _bytes(got) == want
        got.close()
    finally:
        agent.close()
    assert sum(n for _, n in posts) == size
    worst = max(sum(n for t, n in posts if t0 <= t < t0 + window) for t0, _ in posts)
    assert worst <= rate * (window + GRANT_SECONDS) + 2 * grant, (worst, rate * window)


async def test_a_capped_source_is_given_the_time_its_cap_needs(ckpt: Path) -> None:
    """Two targets fill at once from a source capped at the slab's size per second that serves up to 2 fills: each
    gets half the cap, 2 s for its slab, past ``--fill-timeout`` (1.5 s here) plus its bytes at 50 MB/s (here
    nothing: ``min_rate`` huge). Its deadline is reckoned from the offer's ``max_rate`` and ``max_fills``; it was
    the fixed one, and every fill from a cap slower than 50 MB/s failed halfway (reason ``deadline``) after
    spending the source's bandwidth."""
    m = _load(ckpt)
    size, want = m.slabs[0].size, _bytes(m)
    agents = [AgentProcess(f"t-cap-{os.getpid()}-{i}-{time.monotonic_ns()}") for i in range(2)]
    try:
        async with sources(m, max_rate=size, max_fills=2) as ports:
            with plan_rank(RankSpec(ckpt)) as rp:
                cfg = _cfg(ports, timeout=1.5, min_rate=1 << 40)
                t0 = time.monotonic()
                got = await asyncio.gather(*(_fill(rp, a, cfg) for a in agents))
                took = time.monotonic() - t0
        for g in got:
            assert _bytes(g) == want and g.origin == f"peer 127.0.0.1:{ports[0]}"
            g.close()
        assert took >= 2 * size / size - 2 * GRANT_SECONDS  # the cap was shared: longer than the fixed deadline
    finally:
        for a in agents:
            a.close()


async def test_a_cap_too_slow_for_a_fill_refuses_it_before_anything_is_read(ckpt: Path, agent: AgentProcess) -> None:
    """A source whose cap would need longer than ``max_capped_seconds`` for its share even unshared is not waited
    for: the fill fails at once (reason ``deadline``, naming the cap), before a slab is allocated or a byte
    granted."""
    m = _load(ckpt)
    size = m.slabs[0].size
    before = _memfds()
    svc = PeerService(Store(HostBackend(), [m]), NONE, software="wcache/test", max_rate=size // 3)
    try:
        async with _listening(svc) as port:
            with plan_rank(RankSpec(ckpt)) as rp:
                t0 = time.monotonic()
                with pytest.raises(FillError) as err:
                    await _fill(rp, agent, _cfg([port], max_capped_seconds=1.0))
                assert time.monotonic() - t0 < 1.0
        assert err.value.details["reason"] == "deadline" and err.value.details["max_rate"] == size // 3
        assert f"--peer-max-rate {size // 3}" in err.value.message
        assert svc.bytes_served == 0 and not svc.fills and _memfds() <= before
    finally:
        svc.close()
        svc.store.close()


async def test_a_capped_source_that_stops_granting_fails_soon_and_the_error_names_its_cap(
    ckpt: Path, agent: AgentProcess
) -> None:
    """A capped source's deadline is long (its share at the cap, shared by its max fills: 16.5 s here), but a grant
    that does not come within ``--fill-timeout`` plus what the shared cap makes it wait ends the fill then, and
    the deadline's error names the cap it was reckoned from."""
    m = _load(ckpt)
    size = m.slabs[0].size
    svc = PeerService(Store(HostBackend(), [m]), NONE, software="wcache/test", max_rate=size // 4)
    _never_grant(svc)
    try:
        async with _listening(svc) as port:
            with plan_rank(RankSpec(ckpt)) as rp:
                t0 = time.monotonic()
                with pytest.raises(FillError) as err:
                    await _fill(rp, agent, _cfg([port], timeout=0.5, min_rate=1 << 40))
                assert time.monotonic() - t0 < 6  # the stall (0.6 s) and the RELEASE the source never answers (2 s)
        assert err.value.details["reason"] == "deadline" and "no grant" in err.value.message
        assert f"127.0.0.1:{port}'s --peer-max-rate {size // 4}" in err.value.message
    finally:
        svc.close()
        svc.store.close()


def test_a_fills_deadline_follows_the_cap_its_source_announces() -> None:
    from wcache.proto.examples import EXAMPLES
    from wcache.proto.fleet_frames import PeerOffer

    example = EXAMPLES["PEER_OFFER"]
    assert isinstance(example, PeerOffer)
    cfg = _cfg([1], timeout=30.0)

    def offer(max_rate: int, max_fills: int = 0) -> PeerOffer:
        return dataclasses.replace(example, max_rate=max_rate, max_fills=max_fills)

    gb = 10**9
    assert deadline_for("a", gb, 2 * gb, offer(0), cfg).seconds == pytest.approx(30 + 40)  # as always
    assert deadline_for("a", gb, 2 * gb, offer(10**9), cfg).seconds == pytest.approx(70)  # a cap faster than that
    slow = deadline_for("a", gb, 2 * gb, offer(20 * 10**6, 2), cfg)
    assert slow.seconds == pytest.approx(30 + 50 * 2) and "shared by up to 2 fills" in slow.terms
    assert deadline_for("a", gb, 2 * gb, offer(20 * 10**6), cfg).seconds == pytest.approx(30 + 50 * ASSUMED_FILLS)
    assert slow.stall < 31  # a grant is waited for --fill-timeout, and its turn behind the other fills' grants
    liar = deadline_for("a", gb, 2 * gb, offer(20 * 10**6, 10**9), cfg)  # a peer's word bounds nothing
    assert liar.seconds == pytest.approx(30 + cfg.max_capped_seconds) and liar.stall <= liar.seconds
    with pytest.raises(FillError) as err:  # 20 GB at 5 MB/s: over an hour even unshared
        deadline_for("a", 20 * gb, 20 * gb, offer(5 * 10**6), cfg)
    assert err.value.details["reason"] == "deadline"


def test_a_grants_stall_deadline_is_at_most_twice_the_fill_timeout() -> None:
    """Each grant must come within ``--fill-timeout`` plus its turn behind the other fills' grants (two grants of
    each of the offer's ``max_fills``), the turn at most ``--fill-timeout``: an honest source sharing its cap among
    64 fills gets its whole turn; an offer announcing a million fills, or a cap so slow that one grant is seconds
    of it, gets no more than twice ``--fill-timeout``. Before, the turn followed the offer unbounded: an hour."""
    from wcache.proto.examples import EXAMPLES
    from wcache.proto.fleet_frames import PeerOffer

    example = EXAMPLES["PEER_OFFER"]
    assert isinstance(example, PeerOffer)
    cfg = _cfg([1], timeout=30.0)
    gb = 10**9

    def stall(max_rate: int, max_fills: int, nbytes: int = gb) -> float:
        offer = dataclasses.replace(example, max_rate=max_rate, max_fills=max_fills)
        return deadline_for("a", nbytes, nbytes, offer, cfg).stall

    assert stall(20 * 10**6, 64) == pytest.approx(30 + 2 * 64 * GRANT_SECONDS)  # 10 ms grains, 64 fills
    assert stall(20 * 10**6, 10**6) == pytest.approx(2 * 30)
    assert stall(300_000, 10**6, 10**9 // 4) == pytest.approx(2 * 30)  # a 64 KiB grain is 0.2 s of this cap
    assert stall(300_000, 1, 10**9 // 4) == pytest.approx(30 + 2 * MIN_GRANT / 300_000)
    short = _cfg([1], timeout=0.5)
    offer = dataclasses.replace(example, max_rate=20 * 10**6, max_fills=10**6)
    assert deadline_for("a", gb, gb, offer, short).stall == pytest.approx(1.0)


async def test_a_source_announcing_many_fills_that_stops_granting_fails_the_fill_soon(
    ckpt: Path, agent: AgentProcess
) -> None:
    """A capped source whose offer announces a million fills sharing its cap, and that stops granting: the fill
    fails within twice ``--fill-timeout`` (reason ``deadline``), not after the hour its announced turn behind a
    million fills' grants would have given it (the fill, and a daemon's PRELOAD lock, held all that time)."""
    m = _load(ckpt)
    size = m.slabs[0].size
    svc = PeerService(Store(HostBackend(), [m]), NONE, software="wcache/test", max_rate=size // 4, max_fills=10**6)
    _never_grant(svc)
    try:
        async with _listening(svc) as port:
            with plan_rank(RankSpec(ckpt)) as rp:
                t0 = time.monotonic()
                with pytest.raises(FillError) as err:
                    await asyncio.wait_for(_fill(rp, agent, _cfg([port], timeout=0.5, min_rate=1 << 40)), 30)
                assert time.monotonic() - t0 < 8  # the stall (1 s) and the RELEASE the source never answers (2 s)
        assert err.value.details["reason"] == "deadline" and "no grant" in err.value.message
    finally:
        svc.close()
        svc.store.close()


async def test_a_read_past_the_slab_is_refused_and_books_nothing_on_the_cap(ckpt: Path, agent: AgentProcess) -> None:
    """One PEER_READ of 2**50 bytes from a peer of a capped source booked the cap's clock for years: no other peer
    got a grant again. A capped source grants at most its grain per read (a hundredth of a second of its rate, at
    least 64 KiB); an uncapped one at most its slab's size per read, twice that in all. More is LIMIT_EXCEEDED,
    booking nothing: the next peer's fill comes at the cap's pace."""
    from wcache.channel import expect
    from wcache.proto.fleet_frames import PeerOffer, PeerQuery, PeerRead, PeerReadOk
    from wcache.server.peer_channel import connect_peer

    want = _load(ckpt)
    size = want.slabs[0].size
    rate = size * 4
    grain = max(64 << 10, int(rate * GRANT_SECONDS))
    for cap in (0, rate):
        m = _load(ckpt)  # the source's store closes it
        async with sources(m, max_rate=cap) as ports:
            ch, _ = await connect_peer("127.0.0.1", ports[0], NONE, timeout=5, software="t")
            try:
                await ch.send(PeerQuery(id=1, key=m.key.to_wire()))
                offer, _ = await expect(ch)
                assert isinstance(offer, PeerOffer)
                lease = offer.models[0].lease
                for n in (2**50, size + 1) + ((grain + 1,) if cap else ()):
                    await ch.send(PeerRead(id=ch.conn.next_request_id(), lease=lease, bytes=n))
                    with pytest.raises(LimitExceededError):
                        await asyncio.wait_for(expect(ch), 5)
                each = grain if cap else size
                for _ in range(2 if not cap else 4):  # granted: twice the slab in all uncapped; grains capped
                    await ch.send(PeerRead(id=ch.conn.next_request_id(), lease=lease, bytes=each))
                    assert isinstance((await asyncio.wait_for(expect(ch), 5))[0], PeerReadOk)
                if not cap:
                    await ch.send(PeerRead(id=ch.conn.next_request_id(), lease=lease, bytes=1))
                    with pytest.raises(LimitExceededError):
                        await asyncio.wait_for(expect(ch), 5)
            finally:
                ch.close()
            if cap:
                with plan_rank(RankSpec(ckpt)) as rp:  # another peer fills at the cap's pace
                    got = await asyncio.wait_for(_fill(rp, agent, _cfg(ports)), 20)
                    assert _bytes(got) == _bytes(want)
                    got.close()
    want.close()


async def test_a_peer_reading_all_it_may_from_a_capped_source_leaves_the_others_their_share(
    ckpt: Path, agent: AgentProcess
) -> None:
    """At a capped source (4 MB/s, a 10 MB slab), a peer asks for all it may — whole-slab PEER_READs, then grains
    back to back, a new lease (PEER_QUERY, RELEASE) whenever one is used up — while a target fills with a 2 s
    ``--fill-timeout``: the target's fill completes. Before, the source granted a whole slab per read (2.5 s of
    its cap booked at once, the others' grants queued behind it past their stall deadlines: they failed and
    loaded from disk), for ever, as each new lease started its count again."""
    from wcache.channel import expect
    from wcache.proto.fleet_frames import PeerOffer, PeerQuery, PeerRead
    from wcache.server.peer import READS_PER_FILL

    m = _load(ckpt)
    size = m.slabs[0].size
    rate = 4_000_000
    grain = max(64 << 10, int(rate * GRANT_SECONDS))
    stop = asyncio.Event()

    async def greedy(port: int) -> None:
        from wcache.server.peer_channel import connect_peer

        ch, _ = await connect_peer("127.0.0.1", port, NONE, timeout=5, software="greedy")
        try:
            while not stop.is_set():
                await ch.send(PeerQuery(id=ch.conn.next_request_id(), key=m.key.to_wire()))
                offer, _ = await expect(ch)
                assert isinstance(offer, PeerOffer)
                lease, granted = offer.models[0].lease, 0
                while granted + size <= READS_PER_FILL * size and not stop.is_set():  # whole slabs, while granted
                    await ch.send(PeerRead(id=ch.conn.next_request_id(), lease=lease, bytes=size))
                    try:
                        await asyncio.wait_for(expect(ch), 30)
                    except LimitExceededError:
                        break  # refused: grains
                    granted += size
                while granted + grain <= READS_PER_FILL * size and not stop.is_set():
                    await ch.send(PeerRead(id=ch.conn.next_request_id(), lease=lease, bytes=grain))
                    await asyncio.wait_for(expect(ch), 30)
                    granted += grain
                await ch.send(Release(id=ch.conn.next_request_id(), lease=lease))
                await asyncio.wait_for(expect(ch), 30)
        finally:
            ch.close()

    async with sources(m, max_rate=rate) as ports:
        hog = asyncio.ensure_future(greedy(ports[0]))
        try:
            await asyncio.sleep(0.5)  # the greedy peer is reading
            with plan_rank(RankSpec(ckpt)) as rp:
                got = await asyncio.wait_for(_fill(rp, agent, _cfg(ports, timeout=2.0)), 60)
            try:
                assert _bytes(got) == _bytes(m)
            finally:
                got.close()
            assert not hog.done()  # it was reading all along
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(hog, return_exceptions=True), 30)


async def test_a_silent_peer_holding_a_fill_is_closed_after_its_time_and_frees_its_slot(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that takes a fill lease (PEER_QUERY) and goes silent — hung, SIGSTOPped, a host gone without a reset
    — holds the fill only ``max_fill_seconds``; then the shell's idle timeout ends its connection, the fill and its
    hold on the slab end, and the ``--peer-max-fills`` slot it took serves the next peer. Before, the shell asked
    ``holds`` once before an unbounded wait: the connection, the fill, the slot and the slab were held for ever.
    (Times scaled down: 0.5 s to fill, 0.5 s idle, ``holds`` asked again every 0.2 s.)"""
    from wcache.channel import expect
    from wcache.proto.fleet_frames import PeerOffer, PeerQuery
    from wcache.server.peer_channel import connect_peer

    m = _load(ckpt)
    svc = PeerService(Store(HostBackend(), [m]), NONE, software="wcache/test", max_fills=1)
    monkeypatch.setattr(svc, "max_fill_seconds", 0.5)
    limits = ConnectionLimits(connections=8, handshake_timeout=5.0, idle_timeout=0.5, hold_recheck=0.2)
    try:
        async with _listening(svc, limits) as port:
            silent, _ = await connect_peer("127.0.0.1", port, NONE, timeout=5, software="t")
            try:
                await silent.send(PeerQuery(id=1, key=m.key.to_wire()))
                assert isinstance((await expect(silent))[0], PeerOffer)
                assert svc.fills and m.held
                deadline = time.monotonic() + 10
                while (svc.fills or m.held) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert not svc.fills and not m.held  # the fill ended with its connection; the slab is free
                with pytest.raises(EOFError):
                    await asyncio.wait_for(silent.receive(), 5)  # the source closed it
            finally:
                silent.close()
            nxt, _ = await connect_peer("127.0.0.1", port, NONE, timeout=5, software="t")
            try:
                await nxt.send(PeerQuery(id=1, key=m.key.to_wire()))
                assert isinstance((await expect(nxt))[0], PeerOffer)  # the one slot is free again
            finally:
                nxt.close()
    finally:
        svc.close()
        svc.store.close()


async def test_a_target_that_keeps_talking_without_reading_loses_its_fill_and_slot(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target that takes a fill lease and never READs, but keeps its connection busy with cheap requests (a
    PEER_QUERY of a key the source does not hold, answered NOT_FOUND), loses the fill once ``max_fill_seconds``
    pass without a grant: the lease ends, the slab's hold is released, the one ``--peer-max-fills`` slot serves
    the next target, a PEER_READ or RELEASE of the ended lease is a non-fatal UNKNOWN_LEASE saying why, and the
    connection, no longer held, ends at the idle timeout once silent. The idle timeout counts only silence: the
    fill, the slot and the slab were held for as long as the target talked. (Times scaled down: 0.5 s without
    progress, the requests every 0.1 s, 2 s idle.)"""
    from wcache.channel import expect
    from wcache.errors import NotFoundError, UnknownLeaseError
    from wcache.proto.fleet_frames import PeerOffer, PeerQuery, PeerRead
    from wcache.server.peer_channel import connect_peer

    m = _load(ckpt)
    svc = PeerService(Store(HostBackend(), [m]), NONE, software="wcache/test", max_fills=1)
    monkeypatch.setattr(svc, "max_fill_seconds", 0.5)
    limits = ConnectionLimits(connections=8, handshake_timeout=5.0, idle_timeout=2.0, hold_recheck=0.2)
    bogus = {**m.key.to_wire(), "fingerprint": "0" * 32}
    try:
        async with _listening(svc, limits) as port:
            chatty, _ = await connect_peer("127.0.0.1", port, NONE, timeout=5, software="t")
            try:
                await chatty.send(PeerQuery(id=chatty.conn.next_request_id(), key=m.key.to_wire()))
                offer, _ = await expect(chatty)
                assert isinstance(offer, PeerOffer) and svc.fills and m.held
                lease = offer.models[0].lease
                deadline = time.monotonic() + 10
                while (svc.fills or m.held) and time.monotonic() < deadline:
                    await chatty.send(PeerQuery(id=chatty.conn.next_request_id(), key=bogus))
                    with pytest.raises(NotFoundError):
                        await asyncio.wait_for(expect(chatty), 5)
                    await asyncio.sleep(0.1)
                assert not svc.fills and not m.held  # the lease ended, the slab's hold released
                await chatty.send(PeerRead(id=chatty.conn.next_request_id(), lease=lease, bytes=1 << 16))
                with pytest.raises(UnknownLeaseError) as err:
                    await asyncio.wait_for(expect(chatty), 5)
                assert err.value.details.get("reason") == "no-progress"  # a clear error, and not fatal:
                await chatty.send(Release(id=chatty.conn.next_request_id(), lease=lease))
                with pytest.raises(UnknownLeaseError) as err:
                    await asyncio.wait_for(expect(chatty), 5)
                assert err.value.details.get("reason") == "no-progress"
                honest, _ = await connect_peer("127.0.0.1", port, NONE, timeout=5, software="t")
                try:
                    await honest.send(PeerQuery(id=1, key=m.key.to_wire()))
                    assert isinstance((await asyncio.wait_for(expect(honest), 5))[0], PeerOffer)  # the slot is free
                finally:
                    honest.close()
                with pytest.raises(EOFError):  # holding nothing, the silent connection ends at the idle timeout
                    await asyncio.wait_for(chatty.receive(), 10)
            finally:
                chatty.close()
    finally:
        svc.close()
        svc.store.close()


async def test_a_fill_reading_slowly_keeps_every_lease_of_its_connection(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Progress is the connection's: a target granted a PEER_READ every 0.1 s for three times
    ``max_fill_seconds`` keeps its fill — the lease it reads and the one it does not (a slab whose share of the
    fill is done, or that the plan did not use, stays held until the fill RELEASEs its leases); once it stops
    reading, both end ``max_fill_seconds`` later. (Times scaled down: 1 s without progress.)"""
    from wcache.channel import expect
    from wcache.errors import NotFoundError
    from wcache.proto.fleet_frames import PeerOffer, PeerQuery, PeerRead, PeerReadOk
    from wcache.server.peer_channel import connect_peer

    r0, r1 = _load(ckpt, 0, 2), _load(ckpt, 1, 2)
    svc = PeerService(Store(HostBackend(), [r0, r1]), NONE, software="wcache/test")
    monkeypatch.setattr(svc, "max_fill_seconds", 1.0)
    try:
        async with _listening(svc) as port:
            ch, _ = await connect_peer("127.0.0.1", port, NONE, timeout=5, software="t")
            try:
                want = WeightCacheKey.from_checkpoint(ckpt).to_wire()  # TP=1: both TP=2 ranks fill it
                await ch.send(PeerQuery(id=ch.conn.next_request_id(), key=want))
                offer, _ = await expect(ch)
                assert isinstance(offer, PeerOffer) and len(offer.models) == 2
                read = offer.models[0].lease
                until = time.monotonic() + 3 * svc.max_fill_seconds
                while time.monotonic() < until:
                    await ch.send(PeerRead(id=ch.conn.next_request_id(), lease=read, bytes=1 << 16))
                    assert isinstance((await asyncio.wait_for(expect(ch), 5))[0], PeerReadOk)
                    await asyncio.sleep(0.1)
                assert set(svc.fills) == {m.lease for m in offer.models} and r0.held and r1.held
                bogus = {**r0.key.to_wire(), "fingerprint": "0" * 32}
                deadline = time.monotonic() + 10
                while svc.fills and time.monotonic() < deadline:  # talking, no longer reading
                    await ch.send(PeerQuery(id=ch.conn.next_request_id(), key=bogus))
                    with pytest.raises(NotFoundError):
                        await asyncio.wait_for(expect(ch), 5)
                    await asyncio.sleep(0.1)
                assert not svc.fills and not r0.held and not r1.held
            finally:
                ch.close()
    finally:
        svc.close()
        svc.store.close()


async def test_a_refused_offer_holds_nothing_of_the_slab(ckpt: Path) -> None:
    """A source whose NIXL is missing (a daemon started with ``--peer-listen`` without the fleet extra: it starts,
    its registration logged and skipped) refuses every PEER_QUERY; each refusal held the slab once more and no fill
    recorded the hold, so an evict of the model freed nothing. A refused offer now holds nothing."""
    from wcache.channel import expect
    from wcache.proto.fleet_frames import PeerQuery
    from wcache.server.peer_channel import connect_peer

    def no_nixl() -> Agent:
        raise FillError("NIXL is not installed: pip install -e '.[fleet]'", details={"reason": "nixl-missing"})

    m = _load(ckpt)
    svc = PeerService(Store(HostBackend(), [m]), NONE, software="wcache/test", agent=no_nixl)
    async with _listening(svc) as port:
        ch, _ = await connect_peer("127.0.0.1", port, NONE, timeout=5, software="t")
        try:
            for i in range(3):
                await ch.send(PeerQuery(id=1 + i, key=m.key.to_wire()))
                with pytest.raises(WCacheError):
                    await asyncio.wait_for(expect(ch), 5)
                assert not svc.fills and not m.held
        finally:
            ch.close()
    svc.close()
    svc.store.close()


async def test_a_peer_connection_holds_at_most_64_fill_leases(ckpt: Path) -> None:
    """A local connection holds at most 64 leases (docs/protocol.md §7); a peer connection repeating PEER_QUERY
    got a lease (a hold on the slab) per query without bound, and every frame then walked them all."""
    from wcache.channel import expect
    from wcache.proto.fleet_frames import PeerOffer, PeerQuery
    from wcache.server.peer_channel import connect_peer

    m = _load(ckpt)
    async with sources(m) as ports:
        ch, _ = await connect_peer("127.0.0.1", ports[0], NONE, timeout=5, software="t")
        try:
            for i in range(64):
                await ch.send(PeerQuery(id=1 + i, key=m.key.to_wire()))
                assert isinstance((await expect(ch))[0], PeerOffer)
            await ch.send(PeerQuery(id=100, key=m.key.to_wire()))
            with pytest.raises(LimitExceededError, match="64 fill leases"):
                await expect(ch)
        finally:
            ch.close()


async def test_peer_files_are_read_off_the_event_loop(ckpt: Path) -> None:
    """PEER_FILES reads up to 48 MiB of the checkpoint's files: on the event loop, a peer asking again and again
    held the daemon's other requests (a local engine's STATUS: 9 -> 352 ms). Read in a worker thread, the loop
    answers meanwhile."""
    from wcache.channel import expect
    from wcache.peer_files import checkpoint_files
    from wcache.proto.fleet_frames import PeerFiles, PeerFilesReply
    from wcache.server.peer_channel import connect_peer

    def slow(root: Path) -> list[Any]:
        time.sleep(0.5)  # a slow disk
        return checkpoint_files(root)

    m = _load(ckpt)
    svc = PeerService(Store(HostBackend(), [m]), NONE, software="wcache/test", files=slow)
    lags: list[float] = []

    async def ticking() -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - t0)

    try:
        async with _listening(svc) as port:
            ch, _ = await connect_peer("127.0.0.1", port, NONE, timeout=5, software="t")
            ticker = asyncio.ensure_future(ticking())
            try:
                await ch.send(PeerFiles(id=1, key={}))
                reply, _ = await asyncio.wait_for(expect(ch), 10)
                assert isinstance(reply, PeerFilesReply) and reply.files
            finally:
                ticker.cancel()
                ch.close()
        assert lags and max(lags) < 0.3  # the loop went on while the files were read (0.5 s)
    finally:
        svc.close()
        svc.store.close()


async def test_peer_files_answers_in_memory_are_bounded(ckpt: Path) -> None:
    """A PEER_FILES answer (up to 48 MiB, ~160 MB with its TLS copies) stays in memory until its peer reads it or
    the send deadline ends the connection: peers that asked and never read held that much each, up to the
    connection cap. FILES_AT_ONCE answers are read or unsent at a time; a slot is free again once its answer is
    sent or its connection ends."""
    from wcache.proto.fleet_frames import PeerFiles, PeerFilesReply
    from wcache.server.peer import FILES_AT_ONCE
    from wcache.server.service import Context, Reply

    svc = PeerService(Store(HostBackend(), [_load(ckpt)]), NONE, software="wcache/test")
    try:
        ctxs = [Context(i) for i in range(FILES_AT_ONCE + 1)]
        unsent = [await svc.handle(PeerFiles(id=1, key={}), [], c) for c in ctxs[:FILES_AT_ONCE]]
        assert all(isinstance(r, Reply) and isinstance(r.frame, PeerFilesReply) for r in unsent)
        waiting = asyncio.ensure_future(svc.handle(PeerFiles(id=1, key={}), [], ctxs[-1]))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # every slot holds an answer not sent yet
        svc.closed(ctxs[0])  # that peer's connection ended (its send deadline): its slot is free
        third = await asyncio.wait_for(waiting, 10)
        assert isinstance(third, Reply)
        for r in (unsent[1], third):
            assert isinstance(r, Reply) and r.after is not None
            r.after()  # sent
        again = await asyncio.wait_for(svc.handle(PeerFiles(id=2, key={}), [], ctxs[1]), 10)
        assert isinstance(again, Reply)
    finally:
        svc.close()
        svc.store.close()


async def test_a_stray_file_in_the_sources_directory_is_skipped_not_answered_internal(
    ckpt: Path, tmp_path: Path
) -> None:
    """An 8-byte ``x.safetensors`` (length prefix 2**64-1) beside the checkpoint the source serves made every
    PEER_FILES answer an INTERNAL error (OverflowError reading the header): no target could fetch the files from it.
    The file is skipped and the checkpoint's files are answered."""
    import shutil
    import struct

    from wcache.proto.fleet_frames import PeerFiles, PeerFilesReply
    from wcache.server.service import Context, Reply

    src = tmp_path / "store" / "model"
    shutil.copytree(ckpt, src)
    m = _load(src)
    (src / "x.safetensors").write_bytes(struct.pack("<Q", 2**64 - 1))
    svc = PeerService(Store(HostBackend(), [m]), NONE, software="wcache/test")
    try:
        r = await svc.handle(PeerFiles(id=1, key={"fingerprint": m.key.fingerprint}), [], Context(0))
        assert isinstance(r, Reply) and isinstance(r.frame, PeerFilesReply), r
        assert sorted(f.name for f in r.frame.files) == sorted(p.name for p in ckpt.iterdir())
        assert r.after is not None
        r.after()
    finally:
        svc.close()
        svc.store.close()


def test_grants_follow_the_cap_and_cost_nothing_uncapped() -> None:
    assert grant_bytes(0, DEFAULT_CHUNK) == DEFAULT_CHUNK  # uncapped: a 64 MiB batch per PEER_READ, as before
    assert grant_bytes(10 << 30, DEFAULT_CHUNK) == DEFAULT_CHUNK  # a hundredth of 10 GiB/s is more than a batch
    assert grant_bytes(1 << 30, DEFAULT_CHUNK) == int((1 << 30) * GRANT_SECONDS)
    assert grant_bytes(1000, DEFAULT_CHUNK) == MIN_GRANT  # never a round trip per handful of bytes
    assert grant_bytes(1000, 4096) == 4096


_copies = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 8), st.integers(0, 24), st.integers(0, 24)), min_size=1, max_size=6
)


@settings(max_examples=300, deadline=None)
@given(copies=_copies, limit=st.integers(1, 100))
def test_batches_cover_the_same_bytes_within_their_limit(copies: list[tuple[int, int, int, int]], limit: int) -> None:
    """Batches of at most ``limit`` bytes, in order, move exactly the bytes of the copies (each target byte from
    the same source byte); copies already within the limit go whole, as uncapped fills always batch."""
    plan, src, dst = [], 0, 0
    for length, count, gap_src, gap_dst in copies:
        s_stride, d_stride = (length + gap_src, length + gap_dst) if count > 1 else (0, 0)
        plan.append(Copy(0, src, dst, length, count, s_stride, d_stride))
        src += length + count * (length + gap_src)
        dst += length + count * (length + gap_dst)
    out = batches(plan, limit)
    assert all(0 < sum(c.nbytes for c in b) <= limit for b in out)
    assert _moves([c for b in out for c in b]) == _moves(plan)
    if all(c.nbytes <= limit for c in plan):
        assert [c for b in out for c in b] == plan


def _moves(copies: Sequence[Copy]) -> dict[int, int]:
    """target byte -> source byte of every run of ``copies``."""
    out: dict[int, int] = {}
    for c in copies:
        for i in range(c.count):
            for j in range(c.length):
                assert c.dst + i * c.dst_stride + j not in out  # no byte twice
                out[c.dst + i * c.dst_stride + j] = c.src + i * c.src_stride + j
    return out


def test_rate_cap_books_grants_on_a_virtual_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("wcache.server.peer.time.monotonic", lambda: now[0])
    cap = RateCap(1000, burst=0.1)
    assert cap.delay(500) == pytest.approx(0.4)  # even the first grant waits for its bytes, less what idle lends
    assert cap.delay(500) == pytest.approx(0.9)  # behind the first
    now[0] += 5.0  # idle: no debt carried, no more than ``burst`` lent
    assert cap.delay(1000) == pytest.approx(0.9)
    now[0] += 1.0 - 0.05  # the next grant asked for late, by less than ``burst``: the lag is made up
    assert cap.delay(50) == pytest.approx(0.0)
    assert cap.delay(50) == pytest.approx(0.05)
    assert RateCap(0).delay(1 << 40) == 0.0


async def test_the_concurrent_fill_cap_refuses_a_second_target(ckpt: Path, agent: AgentProcess) -> None:
    from wcache.proto.fleet_frames import PeerQuery
    from wcache.server.peer_channel import connect_peer

    async with sources(_load(ckpt), max_fills=1) as ports:
        ch, _ = await connect_peer("127.0.0.1", ports[0], NONE, timeout=5, software="t")
        try:
            from wcache.channel import expect

            with plan_rank(RankSpec(ckpt)) as rp:
                await ch.send(PeerQuery(id=1, key=rp.key.to_wire()))
                await expect(ch)  # an offer: this connection holds the one fill
                with pytest.raises(FillError) as err:
                    await _fill(rp, agent, _cfg(ports))
            assert err.value.details["reason"] == "refused"
        finally:
            ch.close()


async def test_a_node_without_the_checkpoint_gets_files_keys_and_weights(
    ckpt: Path, tmp_path: Path, agent: AgentProcess
) -> None:
    from wcache.channel import expect
    from wcache.plan.key import WeightCacheKey
    from wcache.proto.fleet_frames import PeerFiles, PeerFilesReply
    from wcache.server.peer_channel import connect_peer

    m = _load(ckpt)
    empty = tmp_path / "model"
    async with sources(m) as ports:
        ch, _ = await connect_peer("127.0.0.1", ports[0], NONE, timeout=5, software="t")
        try:
            await ch.send(PeerFiles(id=1, key=m.key.to_wire()))
            reply, _ = await expect(ch)
        finally:
            ch.close()
        assert isinstance(reply, PeerFilesReply)
        written = write_files(empty, reply.files)
        assert "config.json" in written and (empty / MARKER).exists()
        # what the directory then holds: small files, sparse stubs of the real size, the marker
        for f in ckpt.glob("*.safetensors"):
            stub = empty / f.name
            assert stub.stat().st_size == f.stat().st_size
            assert stub.stat().st_blocks * 512 < f.stat().st_size // 4
        assert WeightCacheKey.from_checkpoint(empty) == m.key  # an engine computes the same key there
        with plan_rank(RankSpec(empty)) as rp:
            got = await _fill(rp, agent, _cfg(ports))
            assert _bytes(got) == _bytes(m)
            got.close()
            with pytest.raises(CheckpointError, match="hold no weights"):
                refuse_stubs(empty, rp.checkpoint.files)
        with pytest.raises(CheckpointError, match="hold no weights"):
            _load(empty)  # a daemon restarted there without peers never serves the holes
        from wcache.nn import load_from_disk

        with pytest.raises(CheckpointError, match="hold no weights"):
            load_from_disk(empty)  # nor does an engine's own disk fallback


async def test_a_source_sending_a_file_named_as_the_stub_marker_writes_nothing(ckpt: Path, tmp_path: Path) -> None:
    """A source whose PEER_FILES_REPLY holds a file named as the stub marker (wcache-peer-fill.json, sorted after
    the safetensors files): before, it was written over the marker the target had just written, the stubs were
    no longer named, and a daemon there loaded their zeros as weights. Now the reply does not decode: the fetch
    fails naming the source, and nothing is written."""
    from wcache.peer_files import checkpoint_files
    from wcache.proto.fleet_frames import PeerFile
    from wcache.server.fill import fetch_files

    m = _load(ckpt)

    def hostile(root: Path) -> list[PeerFile]:
        return [*checkpoint_files(root), PeerFile(name=MARKER, size=13, data=b'{"stubs": {}}')]

    svc = PeerService(Store(HostBackend(), [m]), NONE, software="wcache/test", files=hostile)
    empty = tmp_path / "model"
    try:
        async with _listening(svc) as port:
            with pytest.raises(FillError, match="stub marker"):
                await fetch_files(empty, _cfg([port]), m.key.to_wire())
    finally:
        svc.close()
        svc.store.close()
    assert not empty.exists() or not any(empty.iterdir())


async def test_a_peer_that_accepts_and_never_answers_is_named_as_not_answering(ckpt: Path, agent: AgentProcess) -> None:
    """A peer that accepts the TCP connection and never speaks (a hung daemon, a port another program holds): the
    fill fails with reason ``no-peer`` and a message naming the peer, the time it had and where it stopped. Before,
    the reason was ``deadline`` (a READ too slow, to an operator) and the message ``no peer answered: ``, empty."""
    import socket

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)  # the kernel accepts; nobody ever speaks
    port = lsock.getsockname()[1]
    try:
        with plan_rank(RankSpec(ckpt)) as rp, pytest.raises(FillError) as err:
            await _fill(rp, agent, _cfg([port], connect_timeout=0.5))
    finally:
        lsock.close()
    assert err.value.details["reason"] == "no-peer", err.value.details
    assert f"peer 127.0.0.1:{port} did not answer within 0.5 s (HELLO)" in err.value.message, err.value.message


async def test_the_sources_are_released_before_the_verification(
    ckpt: Path, agent: AgentProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once every READ landed, the source's bytes are no longer needed: its lease (here its only
    ``--peer-max-fills`` slot) goes back before the target verifies — with ``--verify-content`` a read of the whole
    rank from the target's disk, minutes on a large model, during which other targets were refused."""
    svc = PeerService(Store(HostBackend(), [_load(ckpt)]), NONE, software="wcache/test", max_fills=1)
    seen: list[int] = []
    real = fill_mod._verify

    def verify(*args: Any, **kwargs: Any) -> None:
        seen.append(len(svc.fills))  # the source's fills while the target verifies
        real(*args, **kwargs)

    monkeypatch.setattr(fill_mod, "_verify", verify)
    try:
        async with _listening(svc) as port:
            with plan_rank(RankSpec(ckpt)) as rp:
                got = await _fill(rp, agent, _cfg([port], verify_content=True))
            got.close()
    finally:
        svc.close()
        svc.store.close()
    assert seen == [0]


def test_fill_from_specs() -> None:
    assert resolve_peers("10.0.0.1:7070, 10.0.0.2:7071") == [("10.0.0.1", 7070), ("10.0.0.2", 7071)]
    assert resolve_peers("dns:localhost:7070")[0] in (("127.0.0.1", 7070), ("::1", 7070))
    assert resolve_peers("dns:no-such-name.invalid:7070") == []
    with pytest.raises(ValueError):
        resolve_peers("nohost")


def _changed_since_load(ckpt: Path, dst: Path) -> ServedModel:
    """A source's model loaded from a copy of ``ckpt`` whose config.json then changed (a new revision downloaded
    into the same directory): its PEER_FILES sends another checkpoint's files under the key it loaded."""
    import json
    import shutil

    shutil.copytree(ckpt, dst)
    m = _load(dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_theta"] = 1234.0
    (dst / "config.json").write_text(json.dumps(cfg))
    return m


async def test_files_that_are_not_the_key_asked_for_are_refused_and_the_next_peer_asked(
    ckpt: Path, tmp_path: Path
) -> None:
    """A stale source (its directory changed since it loaded the key) listed first: its files are another
    checkpoint's, checked in a staging directory beside the node's and discarded; the honest peer after it is
    asked, and the node's directory holds the key's files. With the stale source alone, the fetch fails (reason
    ``verify``) and leaves nothing in the directory. Before, the stale files were written, the start then refused
    them against --fill-fingerprint, and the directory, holding stubs, was never fetched again."""
    from wcache.peer_files import fill_incomplete, staging_dir
    from wcache.plan.key import WeightCacheKey
    from wcache.server.fill import fetch_files

    stale = _changed_since_load(ckpt, tmp_path / "stale" / "model")
    honest = _load(ckpt)
    want: dict[str, str | int] = {"fingerprint": honest.key.fingerprint}
    assert stale.key.fingerprint == honest.key.fingerprint
    async with sources(stale, honest) as ports:
        alone = tmp_path / "alone"
        with pytest.raises(FillError) as err:
            await fetch_files(alone, _cfg(ports[:1]), want)
        assert err.value.details["reason"] == "verify" and "fingerprint" in err.value.message
        assert list(alone.iterdir()) == [] and not staging_dir(alone).exists()
        node = tmp_path / "model"
        await fetch_files(node, _cfg(ports), want)
    assert WeightCacheKey.from_checkpoint(node).fingerprint == honest.key.fingerprint
    assert not fill_incomplete(node) and not staging_dir(node).exists()


async def test_a_fill_of_the_files_cut_short_is_completed_by_the_next_start(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start whose fill of the files stopped after the first stub (a crash, a full disk: config.json, the first
    stub and the marker there, the second stub missing) is followed by a start with the same --fill-from: it
    fetches the files again and the directory then has the checkpoint's key. Before, the one ``*.safetensors``
    passed for weights, nothing was fetched, and the load failed "hold no weights ... Fill from a peer again"."""
    import argparse

    from wcache.peer_files import checkpoint_files, fill_incomplete, stub_names
    from wcache.plan.key import WeightCacheKey
    from wcache.server.startup import fetch_checkpoint_files

    m = _load(ckpt)
    files = checkpoint_files(ckpt)
    node = tmp_path / "model"
    shards = [f.name for f in files if f.name.endswith(".safetensors")]
    replace = os.replace

    def crash_at_second_stub(src: object, dst: object) -> None:
        if Path(str(dst)).name == shards[1]:
            raise OSError(28, "No space left on device")
        replace(src, dst)  # type: ignore[arg-type]

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", crash_at_second_stub)
        with pytest.raises(OSError):
            write_files(node, files)
    assert stub_names(node) == {shards[0]} and not (node / shards[1]).exists() and fill_incomplete(node)
    svc = PeerService(Store(HostBackend(), [m]), NONE, software="wcache/test")
    try:
        async with _listening(svc) as port:
            args = argparse.Namespace(
                fill_from=f"127.0.0.1:{port}",
                peer_security=NONE,
                fill_timeout=30.0,
                verify_content=False,
                fill_fingerprint=m.key.fingerprint,
            )
            await asyncio.to_thread(fetch_checkpoint_files, args, node)
    finally:
        svc.close()
        svc.store.close()
    assert not fill_incomplete(node) and stub_names(node) == set(shards)
    assert WeightCacheKey.from_checkpoint(node) == m.key
