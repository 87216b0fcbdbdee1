"""wcache-server --takeover: a new daemon takes the running one's memory and socket; no disk read,
engines' zero_copy mappings stay valid, new connections reach the new daemon."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import DaemonProc
from tests.server.deposit_engine import recipe_key
from wcache import CacheUnavailableError, WCacheClient, WeightCacheKey
from wcache.channel import connect_blocking, expect_blocking
from wcache.nn import load_from_disk
from wcache.plan.key import RankSpec
from wcache.plan.recipe import RecipeKey
from wcache.proto import Deposit, DepositTensor
from wcache.server.process import spawn_daemon


async def test_takeover_hands_over_memory_socket_and_lock(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path
) -> None:
    old = daemon_factory(ckpt)
    key = WeightCacheKey.from_checkpoint(ckpt)
    ref = load_from_disk(ckpt)
    engine = await WCacheClient(old.socket).fetch(key)  # an engine mapped before the hand-off
    (loaded,) = (await WCacheClient(old.socket).status()).models
    new = spawn_daemon(None, socket_dir, takeover=old.socket, timeout=60)
    try:
        assert old.proc.wait(30) == 0
        (m,) = (await WCacheClient(new.socket).status()).models
        assert (loaded.origin, m.origin) == ("disk", "takeover")  # handed over, not read from disk
        assert m.load_seconds == loaded.load_seconds  # the old daemon's load: not loaded again
        assert new.socket == old.socket and old.socket.exists()
        # the engine's views are still the weights (the memory outlives the old daemon)
        assert all(torch.equal(engine[k], v) for k, v in ref.items())
        async with await WCacheClient(new.socket).fetch(key) as w:
            assert w.server.server_pid == new.pid
            assert all(torch.equal(w[k], v) for k, v in ref.items())
        await engine.release()  # its connection went with the old daemon: not an error
        _refused_naming(ckpt, socket_dir, new.pid)  # the new daemon holds the lock
    finally:
        new.stop()


def test_a_takeover_serves_the_metrics_port_the_old_daemon_held(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path
) -> None:
    """Both daemons on one --metrics-port: the new one cannot bind it before the hand-off (the old one holds it
    until it stops), so it binds it once serving, and the port answers for the new daemon."""
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    old = daemon_factory(ckpt, "--metrics-port", str(port))
    new = spawn_daemon(None, socket_dir, "--metrics-port", str(port), takeover=old.socket, timeout=60)
    try:
        assert old.proc.wait(30) == 0
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, "the new daemon never served the metrics port"
                time.sleep(0.2)
        assert "wcache_resident_bytes" in text and new.proc.poll() is None
    finally:
        new.stop()


def _refused_naming(ckpt: Path, socket_dir: Path, holder: int) -> None:
    """A third daemon on the socket exits with an error naming the pid that holds the one-daemon lock."""
    third = subprocess.run(
        [sys.executable, "-m", "wcache.server.cli", "--model", str(ckpt), "--socket-dir", str(socket_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert third.returncode != 0 and f"pid {holder}" in third.stderr, third.stderr[-2000:]


def test_takeover_refuses_model_and_socket_arguments(ckpt: Path, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "wcache.server.cli", "--takeover", str(tmp_path / "x.sock"), "--model", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2 and "--takeover serves the running daemon's socket" in r.stderr


async def _fake_new_daemon(old: DaemonProc, then: str) -> None:
    """A new daemon that takes TAKEOVER_STATE and then fails: closes the connection (it died or its adoption
    failed), sends another request instead of TAKEOVER_ADOPTED, or confirms fewer models than it got."""
    from wcache.channel import close_fds, connect, expect
    from wcache.errors import InUseError, UnexpectedFrameError
    from wcache.proto import Status, Takeover, TakeoverAdopted, TakeoverState

    ch, _ = await connect(old.socket, software="t", name="failing-new-daemon")
    try:
        await ch.send(Takeover(id=ch.conn.next_request_id(), backend="host", pid=os.getpid()))
        state, fds = await expect(ch)
        assert isinstance(state, TakeoverState) and len(fds) == state.fd_count
        close_fds(fds)  # the listener's copy and the slabs: nothing adopted
        if then == "other-request":
            await ch.send(Status(id=ch.conn.next_request_id()))
            with pytest.raises(UnexpectedFrameError):
                await expect(ch)
        elif then == "too-few":
            await ch.send(TakeoverAdopted(id=ch.conn.next_request_id(), models=len(state.models) - 1))
            with pytest.raises(InUseError):
                await expect(ch)
    finally:
        ch.close()


async def _serves_and_holds_its_lock(old: DaemonProc, ckpt: Path, socket_dir: Path) -> None:
    """The old daemon is alive, accepts new connections, serves its model, and still holds its lock."""
    key = WeightCacheKey.from_checkpoint(ckpt)
    assert old.proc.poll() is None
    async with asyncio.timeout(20):  # a new connection is accepted and answered (it was not, once)
        async with await WCacheClient(old.socket, timeout=10).fetch(key) as w:
            assert w.server.server_pid == old.pid
            assert all(torch.equal(w[k], v) for k, v in load_from_disk(ckpt).items())
    _refused_naming(ckpt, socket_dir, old.pid)  # the old daemon still holds the lock


@pytest.mark.parametrize("then", ["close", "other-request", "too-few"])
async def test_a_hand_off_that_fails_after_takeover_state_leaves_the_old_daemon_serving(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path, then: str
) -> None:
    """The old daemon stops only once the new one confirms it adopted everything (TAKEOVER_ADOPTED). A new
    daemon that gets TAKEOVER_STATE and then dies, breaks the hand-off or confirms less than it got leaves
    the old daemon serving, accepting and holding its lock (it used to stop at once, or to stay alive, not
    accepting, lock held: no daemon at all); a real takeover then succeeds."""
    old = daemon_factory(ckpt)
    engine = await WCacheClient(old.socket).fetch(WeightCacheKey.from_checkpoint(ckpt))  # mapped across it all
    try:
        await _fake_new_daemon(old, then)
        await _serves_and_holds_its_lock(old, ckpt, socket_dir)
    finally:
        await engine.release()
    new = spawn_daemon(None, socket_dir, takeover=old.socket, timeout=60)
    try:
        assert old.proc.wait(30) == 0
        (m,) = (await WCacheClient(new.socket).status()).models
        assert m.origin == "takeover"
    finally:
        new.stop()


async def test_a_hand_off_too_large_for_the_new_daemon_is_refused_and_changes_nothing(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path
) -> None:
    """The old daemon checks TAKEOVER_STATE against the new daemon's frame limit (TAKEOVER's
    max_frame_size, its --max-frame-size) before it stops anything: a hand-off over it is LIMIT_EXCEEDED,
    the new daemon exits 1 saying why, and the old one serves on holding its lock (a 64 MiB hand-off once
    left it alive but deaf, lock held)."""
    old = daemon_factory(ckpt)
    base = WeightCacheKey.from_checkpoint(ckpt)
    long_names = {f"{'x' * 1000}.{i}": torch.ones(1) for i in range(100)}  # a 100 KB table
    await WCacheClient(old.socket).deposit(recipe_key(base), long_names)
    new = spawn_daemon(None, socket_dir, "--max-frame-size", "65536", takeover=old.socket, timeout=None)
    try:
        assert new.proc.wait(60) == 1
    finally:
        new.stop()
    # the new daemon's last line is the feature here: the operator who started it reads why it exited
    assert "over the 65536 the new daemon accepts" in new.log_text() and "serves on" in new.log_text()
    await _serves_and_holds_its_lock(old, ckpt, socket_dir)
    assert set(await _models(old)) == {"ckpt", recipe_key(base).short()}


async def _models(daemon: DaemonProc) -> dict[str, str]:
    st = await WCacheClient(daemon.socket).status()
    return {RecipeKey.from_wire(dict(m.key)).short() if "engine" in m.key else "ckpt": m.origin for m in st.models}


async def test_fetches_during_the_hand_off_do_not_spoil_it(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path
) -> None:
    """Between TAKEOVER_STATE and TAKEOVER_ADOPTED the old daemon keeps answering its open connections; a
    fetch there reorders its models (least recently used first) but changes none, so the confirmation is
    answered with TAKEOVER_DONE and the old daemon stops."""
    from wcache.channel import close_fds, connect, expect
    from wcache.proto import GetState, State, Takeover, TakeoverAdopted, TakeoverDone, TakeoverState

    old = daemon_factory(ckpt)
    base = WeightCacheKey.from_checkpoint(ckpt)
    await WCacheClient(old.socket).deposit(recipe_key(base), {"b": torch.ones(1)})  # now the checkpoint is LRU
    engine, _ = await connect(old.socket, software="t", name="engine")  # open before the hand-off
    ch, _ = await connect(old.socket, software="t", name="new-daemon")
    try:
        await ch.send(Takeover(id=ch.conn.next_request_id(), backend="host", pid=os.getpid()))
        state, fds = await expect(ch)
        assert isinstance(state, TakeoverState) and len(state.models) == 2
        close_fds(fds)
        await engine.send(GetState(id=engine.conn.next_request_id(), key=base.to_wire()))  # the LRU moves
        lease, lease_fds = await expect(engine)
        assert isinstance(lease, State)
        close_fds(lease_fds)
        await ch.send(TakeoverAdopted(id=ch.conn.next_request_id(), models=2, pid=os.getpid()))
        done, _ = await expect(ch)
        assert isinstance(done, TakeoverDone) and done.pid == old.pid
    finally:
        ch.close()
        engine.close()
    assert old.proc.wait(30) == 0


async def test_after_the_hand_off_the_old_daemon_answers_nothing_more(
    ckpt: Path, socket_dir: Path, tmp_path: Path
) -> None:
    """docs/protocol.md §4.10 step 4: once TAKEOVER_DONE is out, the old daemon's models are the new daemon's. A
    DEPOSIT arriving on a connection it still drains, and a PRELOAD whose load ends after the hand-off, are not
    answered by it (a DEPOSITED or PRELOADED there would name a model the daemon serving the socket never gets):
    their connections close, and the new daemon serves only what it was handed."""
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "WCACHE_TEST_SLOW_S": "3",
    }
    old = spawn_daemon(ckpt, socket_dir, env=env, log=tmp_path / "old.log")
    new = None
    try:
        key = WeightCacheKey.from_checkpoint(ckpt)
        # a PRELOAD still loading when the hand-off completes (the old daemon drains it)
        spec = RankSpec(ckpt, transform="tests.server.slow_transform:slow")
        loading = asyncio.ensure_future(WCacheClient(old.socket).preload(spec, timeout=60))
        # an engine's connection, open and idle across the hand-off
        ch, _ = connect_blocking(old.socket, software="test", name="engine", timeout=10)
        await asyncio.sleep(0.5)
        new = await asyncio.to_thread(spawn_daemon, None, socket_dir, takeover=old.socket, timeout=60)
        deposit = Deposit(
            id=1,
            key=recipe_key(key).to_wire(),
            tensors=(DepositTensor(name="w", dtype="float32", shape=(256,)),),
        )
        try:
            ch.send_blocking(deposit, 10)
            with pytest.raises((EOFError, ConnectionError)):
                expect_blocking(ch, 10)  # closed: no DEPOSIT_SLAB from a daemon that handed over
        finally:
            ch.close()
        with pytest.raises(CacheUnavailableError):
            await loading  # closed: no PRELOADED for a model the new daemon does not hold
        assert await asyncio.to_thread(old.proc.wait, 30) == 0
        (served,) = (await WCacheClient(new.socket).status()).models
        assert served.key == key.to_wire() and served.origin == "takeover"
    finally:
        loading.cancel()
        old.stop()
        if new is not None:
            new.stop()


async def test_a_takeover_keeps_the_running_daemons_keeper_or_takes_nothing(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path, keeper: DaemonProc
) -> None:
    """The running daemon keeps its models with a keeper: a new daemon started without ``--keeper`` (the upgrade
    command as written) took them over with no link to it, so an EVICT freed nothing the keeper held (its memory
    stayed allocated). It is refused now, naming the keeper, and the old daemon serves on; with ``--keeper`` the
    hand-off goes through and the new daemon frees what it evicts in the keeper too."""
    old = daemon_factory(ckpt, "--keeper")
    key = WeightCacheKey.from_checkpoint(ckpt)
    kept = await WCacheClient(keeper.socket).status()
    assert len(kept.models) == 1
    refused = spawn_daemon(None, socket_dir, takeover=old.socket, timeout=None)
    assert refused.proc.wait(60) == 1
    assert f"--keeper {keeper.socket}" in refused.log.read_text()
    await _serves_and_holds_its_lock(old, ckpt, socket_dir)
    new = spawn_daemon(None, socket_dir, "--keeper", takeover=old.socket, timeout=60)
    try:
        assert old.proc.wait(30) == 0
        await WCacheClient(new.socket).evict(key)
        async with asyncio.timeout(20):
            while (await WCacheClient(keeper.socket).status()).models:
                await asyncio.sleep(0.05)
    finally:
        new.stop()
