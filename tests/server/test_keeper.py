"""wcache-keeper: a daemon restarted after a crash gets its models back from the keeper, loading nothing.

Real subprocesses: a keeper, daemons started with ``--keeper``, SIGKILL for the crash. The checkpoint
is changed between the crash and the restart in a byte its fingerprint does not sample: a daemon that
reloaded from disk would serve that byte, one that reclaimed its slab serves the original.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import DaemonProc, run_cli
from wcache import WCacheClient, WeightCacheKey
from wcache.checkpoint import SAMPLE_BLOCK
from wcache.errors import CacheUnavailableError, LimitExceededError, NotFoundError, ProtocolError
from wcache.nn import load_from_disk
from wcache.paths import KEEPER_SOCKET
from wcache.proto import PROTOCOL_VERSION, HandedModel, Hello, Keep, SlabDescriptor, Status, pack_frame
from wcache.proto.examples import EXAMPLES
from wcache.proto.frames import MAX_KEPT_FDS
from wcache.server import keeper as kp
from wcache.server.process import DaemonProcess, spawn_keeper


@pytest.fixture
def keeper(socket_dir: Path) -> Iterator[DaemonProcess]:
    k = spawn_keeper(socket_dir)
    try:
        yield k
    finally:
        k.stop()


@pytest.fixture
def model(ckpt: Path, tmp_path: Path) -> Path:
    """A private copy of the checkpoint (the test changes it)."""
    return Path(shutil.copytree(ckpt, tmp_path / "model"))


def _flip_byte(model: Path, *, sampled: bool) -> None:
    """Change one data byte of the first shard: the first one (the fingerprint samples it: the key changes)
    or one right after the first sampled block (the key stays the same)."""
    f = sorted(model.glob("*.safetensors"))[0]
    with open(f, "r+b") as fh:
        (hlen,) = struct.unpack("<Q", fh.read(8))
        off = 8 + hlen + (0 if sampled else SAMPLE_BLOCK + 100)
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0xFF]))


async def test_restart_after_a_crash_reclaims_the_models_and_reads_no_disk(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path
) -> None:
    ref = {k: v.clone() for k, v in load_from_disk(model).items()}  # not views of the file we change
    key = WeightCacheKey.from_checkpoint(model)
    first = daemon_factory(model, "--keeper")
    assert "kept in keeper" in first.log_text()
    engine = await WCacheClient(first.socket).fetch(key)
    first.stop(signal.SIGKILL)  # a crash: nothing is cleaned up

    _flip_byte(model, sampled=False)
    assert WeightCacheKey.from_checkpoint(model) == key
    assert any(not torch.equal(ref[k], v) for k, v in load_from_disk(model).items())  # disk now differs

    second = daemon_factory(model, "--keeper")
    log = second.log_text()
    assert "reclaimed from keeper" in log and "models=1" in log
    assert "nothing loaded" in log and "loaded bytes_read" not in log
    async with await WCacheClient(second.socket).fetch(key) as w:
        assert w.server.server_pid == second.pid
        assert all(torch.equal(w[k], v) for k, v in ref.items())  # the kept bytes, not the changed file
    assert all(torch.equal(engine[k], v) for k, v in ref.items())  # the engine's mapping outlived the crash
    await engine.release()  # its daemon is gone: not an error

    kept = await WCacheClient(keeper.socket).status()
    assert [m.key for m in kept.models] == [key.to_wire()] and kept.software.startswith("wcache-keeper/")

    table = run_cli("status", "--socket-dir", str(second.socket.parent))
    assert table.returncode == 0
    (row,) = [line for line in table.stdout.splitlines() if "wcache-keeper.sock" in line]
    assert " keeper " in row and "host (kept)" in row and key.fingerprint[:12] in row

    await WCacheClient(second.socket).evict(key)  # an eviction frees the memory in the keeper too
    assert (await WCacheClient(keeper.socket).status()).models == ()
    assert "unkept" in keeper.log_text()


async def test_a_kept_model_whose_checkpoint_changed_is_dropped_and_others_stay(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path, tied_ckpt: Path
) -> None:
    """Kept models carry their checkpoint directory. After a restart, one whose checkpoint now has another
    fingerprint (a new version was copied in while no daemon ran) is dropped and loaded again; a PRELOADed
    model from an unchanged checkpoint is served as kept — and load-on-demand still knows its directory."""
    first = daemon_factory(model, "--keeper", "--load-on-demand")
    client = WCacheClient(first.socket)
    await client.preload(tied_ckpt)
    first.stop(signal.SIGKILL)
    _flip_byte(model, sampled=True)
    new_key = WeightCacheKey.from_checkpoint(model)
    second = daemon_factory(model, "--keeper", "--load-on-demand")
    log = second.log_text()
    assert "changed since" in log and "stale=1" in log and "loaded bytes_read" in log
    held = {WeightCacheKey.from_wire(dict(m.key)) for m in (await WCacheClient(second.socket).status()).models}
    assert held == {new_key, WeightCacheKey.from_checkpoint(tied_ckpt)}
    kept = {WeightCacheKey.from_wire(dict(m.key)) for m in (await WCacheClient(keeper.socket).status()).models}
    assert kept == held
    # the kept tied model remembers where it came from: another dtype of it loads on demand
    async with await WCacheClient(second.socket).fetch(WeightCacheKey.from_checkpoint(tied_ckpt, dtype="float32")) as w:
        assert len(w) > 0


async def test_restart_with_another_model_keeps_the_old_one_under_the_budget(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path, tied_ckpt: Path
) -> None:
    """Reclaimed models are held like loaded ones: a budget too small for both evicts the old one
    (least recently used) to load the new one, and the keeper drops it."""
    old = daemon_factory(model, "--keeper")
    old_bytes = (await WCacheClient(old.socket).status()).models[0].bytes
    old.stop(signal.SIGKILL)
    new = daemon_factory(tied_ckpt, "--keeper", "--memory-budget", str(old_bytes))
    log = new.log_text()
    assert "reclaimed from keeper" in log and "reason=load" in log
    st = await WCacheClient(new.socket).status()
    assert [m.key for m in st.models] == [WeightCacheKey.from_checkpoint(tied_ckpt).to_wire()]
    kept = await WCacheClient(keeper.socket).status()
    assert [m.key for m in kept.models] == [WeightCacheKey.from_checkpoint(tied_ckpt).to_wire()]


async def _kept_models(path: Path, deadline_s: float = 20.0) -> list[dict[str, str | int]]:
    """The keys a keeper holds, once it holds any (polling: the daemon deposits on its own schedule)."""
    t_end = asyncio.get_running_loop().time() + deadline_s
    while True:
        models = [m.key for m in (await WCacheClient(path).status()).models]
        if models or asyncio.get_running_loop().time() > t_end:
            return models
        await asyncio.sleep(0.1)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


async def _kept_metric(port: int, want: str, deadline_s: float = 20.0) -> str:
    """``wcache_kept_models`` from the daemon's metrics, once it reads ``want`` (or the deadline passes)."""
    import urllib.request

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = str(r.read().decode())
        return next(line.split()[1] for line in text.splitlines() if line.startswith("wcache_kept_models "))

    t_end = asyncio.get_running_loop().time() + deadline_s
    while (value := await asyncio.to_thread(get)) != want and asyncio.get_running_loop().time() < t_end:
        await asyncio.sleep(0.1)
    return value


async def test_a_restarted_keeper_gets_the_models_again(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path, socket_dir: Path
) -> None:
    """A keeper that restarts holds nothing: the daemon notices (a new keeper pid) and deposits its models again,
    so the next daemon crash still loads nothing. ``wcache_kept_models`` follows."""
    port = _free_port()
    d = daemon_factory(model, "--keeper", "--keeper-check", "0.2", "--metrics-port", str(port))
    key = WeightCacheKey.from_checkpoint(model).to_wire()
    assert await _kept_models(keeper.socket) == [key]
    assert await _kept_metric(port, "1") == "1"
    keeper.stop()
    assert await _kept_metric(port, "0") == "0"  # the keeper is gone: a crash now would reload
    again = spawn_keeper(socket_dir)
    try:
        assert await _kept_models(again.socket) == [key]
        assert await _kept_metric(port, "1") == "1"
        assert "does not hold 1 model(s) of this daemon: keeping them" in d.log_text()
        d.stop(signal.SIGKILL)
        after = daemon_factory(model, "--keeper")
        assert "reclaimed from keeper" in after.log_text() and "loaded bytes_read" not in after.log_text()
    finally:
        again.stop()


class _Connections:
    """How many connections a socket has accepted: a daemon's periodic keeper checks each make one, so a test
    waits for N checks by waiting for N connections (not for a time it hopes N checks fit in)."""

    def __init__(self) -> None:
        self.accepted = 0
        self._changed = asyncio.Event()

    def one(self) -> None:
        self.accepted += 1
        self._changed.set()

    async def reach(self, n: int, deadline_s: float = 60.0) -> int:
        async with asyncio.timeout(deadline_s):
            while self.accepted < n:
                self._changed.clear()
                await self._changed.wait()
        return self.accepted


class _CountingKeeper(kp.Keeper):
    """A real keeper, in the test's process, that counts the connections it accepts."""

    def __init__(self, socket_path: Path) -> None:
        super().__init__(socket_path)
        self.connections = _Connections()

    def _accepted(self, sock: socket.socket) -> None:
        self.connections.one()
        super()._accepted(sock)


@contextlib.asynccontextmanager
async def _keeper_here(socket_dir: Path) -> AsyncIterator[_CountingKeeper]:
    k = _CountingKeeper(socket_dir / KEEPER_SOCKET)
    ready = asyncio.Event()
    task = asyncio.ensure_future(k.serve(ready.set, signals=False))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        yield k
    finally:
        k.stop()
        await task


async def test_a_keeper_started_after_the_daemon_gets_its_models(
    daemon_factory: Callable[..., DaemonProc], model: Path, socket_dir: Path
) -> None:
    d = daemon_factory(model, "--keeper", "--keeper-check", "0.2")
    assert "did not keep" in d.log_text()
    k = spawn_keeper(socket_dir)
    try:
        assert await _kept_models(k.socket) == [WeightCacheKey.from_checkpoint(model).to_wire()]
    finally:
        k.stop()
    # the keeper is gone; in its place a socket that hangs up on every check (each one fails, as with no
    # socket at all) and counts them
    checks = _Connections()

    def hang_up(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        checks.one()
        w.close()

    server = await asyncio.start_unix_server(hang_up, path=k.socket)
    try:
        await checks.reach(7)
    finally:
        server.close()
        await server.wait_closed()
    # one line each time the keeper goes away (before it first started, if a check ran then), not one per check
    assert 1 <= d.log_text().count("unreachable") <= 2


async def test_without_a_running_keeper_the_daemon_loads_and_serves(
    daemon_factory: Callable[..., DaemonProc], model: Path, socket_dir: Path
) -> None:
    d = daemon_factory(model, "--keeper")
    log = d.log_text()
    assert f"keeper {socket_dir / KEEPER_SOCKET}: nothing reclaimed" in log
    assert "did not keep" in log and "loaded bytes_read" in log
    async with await WCacheClient(d.socket).fetch(WeightCacheKey.from_checkpoint(model)) as w:
        assert len(w) > 0


async def test_a_daemon_is_not_a_keeper(daemon: DaemonProc) -> None:
    with pytest.raises(NotFoundError, match="is a wcache daemon: RECLAIM goes to a wcache-keeper"):
        await kp.reclaim(daemon.socket, owner=str(daemon.socket), backend="host", device_uuid="")
    assert (await WCacheClient(daemon.socket).status()).models  # the daemon serves on


async def test_a_refused_model_is_not_offered_again_every_check(
    daemon_factory: Callable[..., DaemonProc], model: Path, socket_dir: Path
) -> None:
    """The keeper already holds 16 slabs for this socket: the daemon's KEEP is refused (LIMIT_EXCEEDED) at start
    and at most once more by the periodic check — one warning, not one every check — and it serves on."""
    owner = str(socket_dir / "wcache-rank0.sock")
    async with _keeper_here(socket_dir) as keeper:
        for rank in range(MAX_KEPT_FDS):
            m, fd = _memfd_model(rank)
            await kp.keep(keeper.socket_path, owner=owner, backend="host", device_uuid="", model=m, fds=[fd])
            os.close(fd)
        # the keeper runs in this process: wait for the daemon in a thread
        d = await asyncio.to_thread(daemon_factory, model, "--keeper", "--keeper-check", "0.1")
        # the placeholders are unsealed memfds: the host backend refuses to serve them, and loads as usual
        assert "could not adopt the reclaimed slabs" in d.log_text() and "not sealed" in d.log_text()
        await keeper.connections.reach(keeper.connections.accepted + 15)  # 15 more checks
        log = d.log_text()
        assert "one RECLAIM carries at most" in log and log.count("did not keep") <= 2
        async with await WCacheClient(d.socket).fetch(WeightCacheKey.from_checkpoint(model)) as w:
            assert len(w) > 0


def test_keeper_check_must_be_positive(model: Path, socket_dir: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "wcache.server.cli", "--model", str(model), "--socket-dir", str(socket_dir)]
        + ["--keeper", "--keeper-check", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2 and "--keeper-check must be a positive number of seconds" in r.stderr


def _memfd_model(tp_rank: int) -> tuple[HandedModel, int]:
    keep = EXAMPLES["KEEP"]
    assert isinstance(keep, Keep)
    example = keep.model
    fd = os.memfd_create("wcache-test-slab")
    os.ftruncate(fd, example.slabs[0].size)
    key = dict(example.key, tp_rank=tp_rank, tp_size=MAX_KEPT_FDS + 1)
    return HandedModel(key, (SlabDescriptor(size=example.slabs[0].size, kind="memfd", fd=0),), example.tensors), fd


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _fds_reach(pid: int, want: int, deadline_s: float = 30.0) -> int:
    """The number of descriptors process ``pid`` has open, once it is ``want`` (or the deadline passed). A
    client's close reaches the keeper asynchronously: the socket of a connection just answered, and the
    descriptors a refused KEEP brought, are closed by the keeper a moment after the reply — so wait for the
    count rather than read it once (a leak never reaches ``want`` and fails at the deadline)."""
    t_end = asyncio.get_running_loop().time() + deadline_s
    while (n := _open_fds(pid)) != want and asyncio.get_running_loop().time() < t_end:
        await asyncio.sleep(0.02)
    return n


async def test_keeper_answers_keep_reclaim_unkeep_and_refuses_what_it_cannot_hold(keeper: DaemonProcess) -> None:
    path, owner = keeper.socket, "/run/wcache/rank0.sock"
    idle = _open_fds(keeper.pid)  # no connection has been made yet: the keeper's own descriptors
    for rank in range(MAX_KEPT_FDS):
        m, fd = _memfd_model(rank)
        try:
            kept, _ = await kp.keep(path, owner=owner, backend="host", device_uuid="", model=m, fds=[fd])
        finally:
            os.close(fd)  # the keeper holds its own copy
        assert (kept.models, kept.bytes) == (rank + 1, (rank + 1) * m.slabs[0].size)
    # every connection closed, every slab held once (the test's copies are closed)
    assert await _fds_reach(keeper.pid, idle + MAX_KEPT_FDS) == idle + MAX_KEPT_FDS
    m, fd = _memfd_model(MAX_KEPT_FDS)
    with pytest.raises(LimitExceededError, match="one RECLAIM carries at most"):
        await kp.keep(path, owner=owner, backend="host", device_uuid="", model=m, fds=[fd])
    with pytest.raises(ProtocolError, match="owner"):  # fatal: the connection ends
        await kp.keep(path, owner="", backend="host", device_uuid="", model=m, fds=[fd])
    os.close(fd)
    # what it refused, it did not keep open (nor the connections it ended)
    assert await _fds_reach(keeper.pid, idle + MAX_KEPT_FDS) == idle + MAX_KEPT_FDS
    assert _open_fds(keeper.pid) == idle + MAX_KEPT_FDS  # and it stays so

    state, fds, _ = await kp.reclaim(path, owner=owner, backend="host", device_uuid="")
    try:
        assert len(state.models) == MAX_KEPT_FDS and state.dropped == 0 and len(fds) == MAX_KEPT_FDS
        assert sorted(s.fd for m in state.models for s in m.slabs) == list(range(MAX_KEPT_FDS))
        assert all(os.fstat(fd).st_size == state.models[0].slabs[0].size for fd in fds)
    finally:
        for fd in fds:
            os.close(fd)
    other, _, _ = await kp.reclaim(path, owner="/elsewhere.sock", backend="host", device_uuid="")
    assert other.models == () and other.dropped == 0

    kept = await kp.unkeep(path, owner=owner, key=state.models[0].key)
    assert kept.models == MAX_KEPT_FDS - 1
    with pytest.raises(NotFoundError, match="holds no model"):
        await kp.unkeep(path, owner=owner, key=state.models[0].key)

    # the owner now runs on another backend: what it kept there cannot be served, and is freed
    moved, fds, _ = await kp.reclaim(path, owner=owner, backend="cuda", device_uuid="GPU-1")
    assert moved.models == () and moved.dropped == MAX_KEPT_FDS - 1 and fds == []
    assert (await WCacheClient(path).status()).models == ()
    assert await _fds_reach(keeper.pid, idle) == idle  # dropped entries are closed

    with pytest.raises(NotFoundError, match="is a wcache keeper"):
        await WCacheClient(path).fetch(WeightCacheKey.from_wire(dict(state.models[0].key)))


async def test_keeper_refuses_descriptors_no_frame_announces(keeper: DaemonProcess) -> None:
    """A keeper accepts descriptors, but only those a KEEP announces: a STATUS carrying one ends the connection
    (it would otherwise pile up in the keeper), and the keeper serves on."""
    from tests.server.test_faults import _raw, _read_reply

    s = _raw(keeper.socket)
    r, w = os.pipe()
    try:
        s.sendall(pack_frame(Hello(versions=(PROTOCOL_VERSION,)).to_wire()))
        assert (await asyncio.to_thread(_read_reply, s) or {}).get("type") == "HELLO_OK"
        s.sendmsg([pack_frame(Status(id=1).to_wire())], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", r))])
        reply = await asyncio.to_thread(_read_reply, s)
        assert reply is not None and reply["code"] == 1 and "no frame announced" in str(reply["message"])
    finally:
        s.close()
        os.close(r)
        os.close(w)
    assert (await WCacheClient(keeper.socket).status()).models == ()


def test_keeper_stop_frees_everything_and_one_keeper_per_socket(keeper: DaemonProcess, socket_dir: Path) -> None:
    second = spawn_keeper(socket_dir, timeout=None)
    assert second.proc.wait(30) != 0
    assert f"pid {keeper.pid}" in second.log_text()  # names the holder of the lock
    m, fd = _memfd_model(0)
    asyncio.run(kp.keep(keeper.socket, owner="/o.sock", backend="host", device_uuid="", model=m, fds=[fd]))
    os.close(fd)
    assert keeper.stop() == 0
    assert "models_freed=1" in keeper.log_text()
    assert not keeper.socket.exists()
    with pytest.raises(CacheUnavailableError):
        asyncio.run(kp.reclaim(keeper.socket, owner="/o.sock", backend="host", device_uuid=""))
