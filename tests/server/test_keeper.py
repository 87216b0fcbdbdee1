"""wcache-keeper: a daemon restarted after a crash gets its models back from the keeper, loading nothing —
and only what its own checkpoint would give: the keeper binds entries to the holder of the daemon's socket
lock, caps what it holds, and the daemon checks what it reclaims against the checkpoint on disk.

Real subprocesses: a keeper, daemons started with ``--keeper``, SIGKILL for the crash. A reclaimed model
carries its first load's ``load_seconds``: a daemon that reloaded it would report its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import DaemonProc, run_cli, serving_here
from wcache import WCacheClient, WeightCacheKey
from wcache.channel import close_fds, connect, expect
from wcache.errors import (
    CacheUnavailableError,
    DeviceMismatchError,
    KeyMismatchError,
    LimitExceededError,
    NotFoundError,
    PermissionDeniedError,
    ProtocolError,
)
from wcache.nn import load_from_disk
from wcache.paths import KEEPER_SOCKET
from wcache.plan.checkpoint import SAMPLE_BLOCK
from wcache.plan.key import RankSpec
from wcache.plan.rank import plan_rank
from wcache.proto import (
    PROTOCOL_VERSION,
    Connection,
    HandedModel,
    Hello,
    HelloOk,
    Keep,
    Kept,
    Reclaim,
    Reclaimed,
    SlabDescriptor,
    Status,
    pack_frame,
)
from wcache.proto.examples import EXAMPLES
from wcache.proto.frames import MAX_KEPT_FDS
from wcache.server import keeper as kp
from wcache.server import keeper_link as kl
from wcache.server.process import DaemonProcess, spawn_keeper
from wcache.server.security import DaemonLock
from wcache.server.service import Context

ROOT = Path(__file__).resolve().parents[2]


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
    ref = {k: v.clone() for k, v in load_from_disk(model).items()}
    key = WeightCacheKey.from_checkpoint(model)
    first = daemon_factory(model, "--keeper")
    assert [m.key for m in (await WCacheClient(keeper.socket).status()).models] == [key.to_wire()]
    loaded = (await WCacheClient(first.socket).status()).models[0]
    assert loaded.origin == "disk"
    engine = await WCacheClient(first.socket).fetch(key)
    first.stop(signal.SIGKILL)  # a crash: nothing is cleaned up

    second = daemon_factory(model, "--keeper")
    (served,) = (await WCacheClient(second.socket).status()).models
    assert served.origin == "keeper"  # reclaimed, not read from disk
    assert served.load_seconds == loaded.load_seconds  # the first load's: not loaded again
    async with await WCacheClient(second.socket).fetch(key) as w:
        assert w.server.server_pid == second.pid
        assert all(torch.equal(w[k], v) for k, v in ref.items())
    assert all(torch.equal(engine[k], v) for k, v in ref.items())  # the engine's mapping outlived the crash
    await engine.release()  # its daemon is gone: not an error

    kept = await WCacheClient(keeper.socket).status()
    assert [m.key for m in kept.models] == [key.to_wire()] and kept.software.startswith("wcache-keeper/")

    table = run_cli("status", "--socket-dir", str(second.socket.parent))
    assert table.returncode == 0
    (row,) = [line for line in table.stdout.splitlines() if "wcache-keeper.sock" in line]
    assert " keeper " in row and f"host (kept, for {second.socket.name})" in row and str(model) in row

    await WCacheClient(second.socket).evict(key)  # an eviction frees the memory in the keeper too
    assert (await WCacheClient(keeper.socket).status()).models == ()


async def test_a_kept_model_whose_checkpoint_changed_is_dropped_and_others_stay(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path, tied_ckpt: Path
) -> None:
    """Kept models carry their checkpoint directory. After a restart, one whose checkpoint now has another
    fingerprint (a new version was copied in while no daemon ran) is dropped and loaded again; a PRELOADed
    model from an unchanged checkpoint is served as kept — and load-on-demand still knows its directory."""
    first = daemon_factory(model, "--keeper", "--load-on-demand")
    client = WCacheClient(first.socket)
    await client.preload(RankSpec(tied_ckpt))
    first.stop(signal.SIGKILL)
    _flip_byte(model, sampled=True)
    new_key = WeightCacheKey.from_checkpoint(model)
    second = daemon_factory(model, "--keeper", "--load-on-demand")
    held = {WeightCacheKey.from_wire(dict(m.key)): m for m in (await WCacheClient(second.socket).status()).models}
    # the stale one was dropped and loaded again; the unchanged one is served as kept
    assert {k: m.origin for k, m in held.items()} == {
        new_key: "disk",
        WeightCacheKey.from_checkpoint(tied_ckpt): "keeper",
    }
    kept = {WeightCacheKey.from_wire(dict(m.key)) for m in (await WCacheClient(keeper.socket).status()).models}
    assert kept == set(held)
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
    st = await WCacheClient(new.socket).status()  # the reclaimed old one was evicted to load the new one
    assert [(m.key, m.origin) for m in st.models] == [(WeightCacheKey.from_checkpoint(tied_ckpt).to_wire(), "disk")]
    kept = await WCacheClient(keeper.socket).status()
    assert [m.key for m in kept.models] == [WeightCacheKey.from_checkpoint(tied_ckpt).to_wire()]


async def test_a_restart_on_the_keeper_names_the_model_it_was_started_for(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path, tied_ckpt: Path
) -> None:
    """The keeper hands back every model it held for the socket, in the order they were kept: the ready line and
    ready file name the ``--model``'s key, not the first one handed back (they named an older model's key)."""
    old = daemon_factory(model, "--keeper")
    await WCacheClient(old.socket).preload(RankSpec(tied_ckpt))
    assert len(await _kept_models(keeper.socket, n=2)) == 2
    old.stop(signal.SIGKILL)
    new = daemon_factory(tied_ckpt, "--keeper")
    assert new.info["key"] == WeightCacheKey.from_checkpoint(tied_ckpt).to_wire()
    assert {m.origin for m in (await WCacheClient(new.socket).status()).models} == {"keeper"}


async def _kept_models(path: Path, deadline_s: float = 20.0, n: int = 1) -> list[dict[str, str | int]]:
    """The keys a keeper holds, once it holds ``n`` (polling: the daemon deposits on its own schedule)."""
    t_end = asyncio.get_running_loop().time() + deadline_s
    while True:
        models = [m.key for m in (await WCacheClient(path).status()).models]
        if len(models) >= n or asyncio.get_running_loop().time() > t_end:
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
        d.stop(signal.SIGKILL)
        after = daemon_factory(model, "--keeper")
        assert [m.origin for m in (await WCacheClient(after.socket).status()).models] == ["keeper"]
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
    """A real keeper, in the test's process, that counts the handshakes it answers (one per connection of a
    daemon) and the KEEPs it gets."""

    def __init__(self, socket_path: Path, limits: kp.KeeperLimits | None = None) -> None:
        super().__init__(socket_path, limits=limits)
        self.connections = _Connections()
        self.keeps = 0

    def hello(self, conn: Connection, hello: Hello, ctx: Context) -> HelloOk:
        self.connections.one()
        return super().hello(conn, hello, ctx)

    def _keep(self, req: Keep, fds: list[int], pid: int) -> Kept:
        self.keeps += 1
        return super()._keep(req, fds, pid)


@contextlib.asynccontextmanager
async def _keeper_here(socket_dir: Path, limits: kp.KeeperLimits | None = None) -> AsyncIterator[_CountingKeeper]:
    async with serving_here(_CountingKeeper(socket_dir / KEEPER_SOCKET, limits)) as k:
        yield k


async def test_a_keeper_started_after_the_daemon_gets_its_models(
    daemon_factory: Callable[..., DaemonProc], model: Path, socket_dir: Path
) -> None:
    d = daemon_factory(model, "--keeper", "--keeper-check", "0.2")
    assert [m.origin for m in (await WCacheClient(d.socket).status()).models] == ["disk"]
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
    # the log line is the feature here (an operator sees the keeper go away once, not once per check):
    # one line each time the keeper goes away (before it first started, if a check ran then)
    assert 1 <= d.log_text().count("unreachable") <= 2


async def test_without_a_running_keeper_the_daemon_loads_and_serves(
    daemon_factory: Callable[..., DaemonProc], model: Path, socket_dir: Path
) -> None:
    d = daemon_factory(model, "--keeper")
    (m,) = (await WCacheClient(d.socket).status()).models
    assert m.origin == "disk" and m.load_seconds > 0
    # the operator's warning is the feature here: it names the keeper socket that was not there
    assert f"keeper {socket_dir / KEEPER_SOCKET}: nothing reclaimed (no wcache-keeper at " in d.log_text()
    async with await WCacheClient(d.socket).fetch(WeightCacheKey.from_checkpoint(model)) as w:
        assert len(w) > 0


async def test_a_keeper_that_is_not_there_is_called_a_keeper(socket_dir: Path) -> None:
    """What a daemon's --keeper says when no keeper runs (it said "no wcache daemon at .../wcache-keeper.sock")."""
    path = socket_dir / KEEPER_SOCKET
    with pytest.raises(CacheUnavailableError) as e:
        await kl.reclaim(path, owner=str(socket_dir / "o.sock"), backend="host", device_uuid="")
    assert e.value.message.startswith(f"no wcache-keeper at {path}:")


async def test_a_daemon_is_not_a_keeper(daemon: DaemonProc) -> None:
    with pytest.raises(NotFoundError, match="is a wcache daemon: RECLAIM goes to a wcache-keeper"):
        await kl.reclaim(daemon.socket, owner=str(daemon.socket), backend="host", device_uuid="")
    assert (await WCacheClient(daemon.socket).status()).models  # the daemon serves on


async def test_a_refused_model_is_not_offered_again_every_check(
    daemon_factory: Callable[..., DaemonProc], model: Path, socket_dir: Path
) -> None:
    """A keeper too small for the model (``--max-bytes``) refuses its KEEP (LIMIT_EXCEEDED) at start and at most
    once more in 15 periodic checks — not once every check — and the daemon serves on."""
    async with _keeper_here(socket_dir, kp.KeeperLimits(bytes=4096)) as keeper:
        # the keeper runs in this process: wait for the daemon in a thread
        d = await asyncio.to_thread(daemon_factory, model, "--keeper", "--keeper-check", "0.1")
        await keeper.connections.reach(keeper.connections.accepted + 15)  # 15 more checks
        assert 1 <= keeper.keeps <= 2 and keeper.entries == {}
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


def _sealed_memfd(size: int, data: bytes = b"", *, seals: int = kp.HOST_SEALS) -> int:
    fd = os.memfd_create("wcache-test-slab", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if data:
        os.pwrite(fd, data, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _memfd_model(tp_rank: int, *, seals: int = kp.HOST_SEALS) -> tuple[HandedModel, int]:
    keep = EXAMPLES["KEEP"]
    assert isinstance(keep, Keep)
    example = keep.model
    fd = _sealed_memfd(example.slabs[0].size, seals=seals)
    key = dict(example.key, tp_rank=tp_rank, tp_size=MAX_KEPT_FDS + 1)
    return HandedModel(key, (SlabDescriptor(size=example.slabs[0].size, kind="memfd", fd=0),), example.tensors), fd


@contextlib.contextmanager
def _holding_lock(socket_path: Path) -> Iterator[str]:
    """This process as the daemon of ``socket_path`` (it holds its lock): the owner the keeper accepts from it."""
    lock = DaemonLock(socket_path)
    lock.acquire()
    try:
        yield str(socket_path)
    finally:
        lock.release()


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


async def test_keeper_answers_keep_reclaim_unkeep_and_refuses_what_it_cannot_hold(
    keeper: DaemonProcess, socket_dir: Path
) -> None:
    with _holding_lock(socket_dir / "rank0.sock") as owner, _holding_lock(socket_dir / "elsewhere.sock") as other:
        await _keep_reclaim_unkeep(keeper, owner, other)


async def _keep_reclaim_unkeep(keeper: DaemonProcess, owner: str, elsewhere: str) -> None:
    path = keeper.socket
    idle = _open_fds(keeper.pid)  # no connection has been made yet: the keeper's own descriptors
    for rank in range(MAX_KEPT_FDS):
        m, fd = _memfd_model(rank)
        try:
            kept, _ = await kl.keep(path, owner=owner, backend="host", device_uuid="", model=m, fds=[fd])
        finally:
            os.close(fd)  # the keeper holds its own copy
        assert (kept.models, kept.bytes) == (rank + 1, (rank + 1) * m.slabs[0].size)
    # every connection closed, every slab held once (the test's copies are closed)
    assert await _fds_reach(keeper.pid, idle + MAX_KEPT_FDS) == idle + MAX_KEPT_FDS
    m, fd = _memfd_model(MAX_KEPT_FDS)
    with pytest.raises(LimitExceededError, match="one RECLAIM carries at most"):
        await kl.keep(path, owner=owner, backend="host", device_uuid="", model=m, fds=[fd])
    with pytest.raises(ProtocolError, match="owner"):  # fatal: the connection ends
        await kl.keep(path, owner="", backend="host", device_uuid="", model=m, fds=[fd])
    os.close(fd)
    # what it refused, it did not keep open (nor the connections it ended)
    assert await _fds_reach(keeper.pid, idle + MAX_KEPT_FDS) == idle + MAX_KEPT_FDS
    assert _open_fds(keeper.pid) == idle + MAX_KEPT_FDS  # and it stays so

    state, fds, _ = await kl.reclaim(path, owner=owner, backend="host", device_uuid="")
    try:
        assert len(state.models) == MAX_KEPT_FDS and state.dropped == 0 and len(fds) == MAX_KEPT_FDS
        assert sorted(s.fd for m in state.models for s in m.slabs) == list(range(MAX_KEPT_FDS))
        assert all(os.fstat(fd).st_size == state.models[0].slabs[0].size for fd in fds)
    finally:
        for fd in fds:
            os.close(fd)
    other, _, _ = await kl.reclaim(path, owner=elsewhere, backend="host", device_uuid="")
    assert other.models == () and other.dropped == 0

    kept = await kl.unkeep(path, owner=owner, key=state.models[0].key)
    assert kept.models == MAX_KEPT_FDS - 1
    with pytest.raises(NotFoundError, match="holds no model"):
        await kl.unkeep(path, owner=owner, key=state.models[0].key)

    # the owner now runs on another backend: what it kept there cannot be served, and is freed
    moved, fds, _ = await kl.reclaim(path, owner=owner, backend="cuda", device_uuid="GPU-1")
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
    # the start-up error (the feature) names the lock's holder, as the program it is
    assert f"another wcache-keeper (pid {keeper.pid}) already serves {KEEPER_SOCKET}" in second.log_text()
    m, fd = _memfd_model(0)
    with _holding_lock(socket_dir / "o.sock") as owner:
        asyncio.run(kl.keep(keeper.socket, owner=owner, backend="host", device_uuid="", model=m, fds=[fd]))
        os.close(fd)
        assert len(asyncio.run(WCacheClient(keeper.socket).status()).models) == 1
        assert keeper.stop() == 0
        assert not keeper.socket.exists()
        with pytest.raises(CacheUnavailableError):
            asyncio.run(kl.reclaim(keeper.socket, owner=owner, backend="host", device_uuid=""))


# ---------------------------------------------------------------------- what the keeper and the daemon do not trust


def _forged(ckpt: Path, *, key: WeightCacheKey | None = None) -> tuple[HandedModel, int]:
    """A model as the daemon of ``ckpt`` would deposit it — key, tensor table, slab size, source — whose
    slab holds random bytes instead of the checkpoint's (a sealed memfd, as the keeper demands)."""
    layout = plan_rank(RankSpec(ckpt)).layout
    fd = _sealed_memfd(layout.total_bytes, os.urandom(layout.total_bytes))
    model = HandedModel(
        (key or WeightCacheKey.from_checkpoint(ckpt)).to_wire(),
        (SlabDescriptor(size=layout.total_bytes, kind="memfd", fd=0),),
        layout.table(),
        dict(layout.aliases),
        layout.payload_bytes,
        1.0,
        str(ckpt),
    )
    return model, fd


async def _deposit(keeper: Path, owner: str, model: HandedModel, fd: int) -> None:
    try:
        await kl.keep(keeper, owner=owner, backend="host", device_uuid="", model=model, fds=[fd])
    finally:
        os.close(fd)


async def test_only_the_daemon_holding_its_socket_lock_may_keep_reclaim_or_unkeep(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path, socket_dir: Path
) -> None:
    """Another process of the uid that names a running daemon's socket cannot deposit slabs for it, take its
    slabs (a cuda_vmm descriptor could be mapped writable) or drop them; nor can it for a socket nobody serves.
    PERMISSION_DENIED, and the daemon's entry stays."""
    d = daemon_factory(model, "--keeper")
    key = WeightCacheKey.from_checkpoint(model)
    assert await _kept_models(keeper.socket) == [key.to_wire()]
    owner = str(d.socket)
    m, fd = _forged(model)
    with pytest.raises(PermissionDeniedError, match=f"pid {d.pid}"):
        await _deposit(keeper.socket, owner, m, fd)
    with pytest.raises(PermissionDeniedError, match="only the daemon serving that socket"):
        await kl.reclaim(keeper.socket, owner=owner, backend="host", device_uuid="")
    with pytest.raises(PermissionDeniedError):
        await kl.unkeep(keeper.socket, owner=owner, key=key.to_wire())
    m, fd = _forged(model)
    with pytest.raises(PermissionDeniedError, match="nobody holds it"):
        await _deposit(keeper.socket, str(socket_dir / "nobody.sock"), m, fd)
    assert [m.key for m in (await WCacheClient(keeper.socket).status()).models] == [key.to_wire()]


async def test_keeper_refuses_slabs_it_could_not_serve(keeper: DaemonProcess, socket_dir: Path) -> None:
    """A host slab must be a memfd of its declared size sealed against writes and resizing; a slab's kind must
    be its backend's. Anything else is refused with nothing kept (and nothing left open in the keeper)."""
    idle = _open_fds(keeper.pid)
    with _holding_lock(socket_dir / "rank0.sock") as owner:

        async def keep(m: HandedModel, fd: int, backend: str = "host") -> None:
            try:
                await kl.keep(keeper.socket, owner=owner, backend=backend, device_uuid="", model=m, fds=[fd])
            finally:
                os.close(fd)

        with pytest.raises(ProtocolError, match="not sealed"):  # writable: its bytes could change under engines
            await keep(*_memfd_model(0, seals=0))
        with pytest.raises(ProtocolError, match="not sealed"):
            await keep(*_memfd_model(0, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW))
        m, fd = _memfd_model(0)
        big = HandedModel(m.key, (SlabDescriptor(size=m.slabs[0].size + 4096, kind="memfd", fd=0),), m.tensors)
        with pytest.raises(ProtocolError, match="bytes, its slab"):
            await keep(big, fd)
        r, w = os.pipe()
        os.close(w)
        with pytest.raises(ProtocolError, match="not a memfd"):
            await keep(_memfd_model(0)[0], r)
        with pytest.raises(DeviceMismatchError, match="memfd slab cannot be served by the cuda backend"):
            await keep(*_memfd_model(0), backend="cuda")
    assert (await WCacheClient(keeper.socket).status()).models == ()
    assert await _fds_reach(keeper.pid, idle) == idle


async def _connections_reach(keeper: kp.Keeper, n: int, deadline_s: float = 30.0) -> None:
    """Until the keeper serves ``n`` connections (a client's close reaches it a moment later)."""
    t_end = asyncio.get_running_loop().time() + deadline_s
    while len(keeper.shell) != n:
        assert asyncio.get_running_loop().time() < t_end, f"{len(keeper.shell)} connections, want {n}"
        await asyncio.sleep(0.01)


async def test_keeper_caps_refuse_with_limit_exceeded_and_spare_other_owners(socket_dir: Path) -> None:
    """Caps on owners, slabs in all and connections (LIMIT_EXCEEDED; the keeper, and every owner's entries,
    as they were), and an idle connection closed after its deadline. (At the connection cap a connection that
    has not said HELLO gives way to a new one, unless it is a daemon's: test_idle_peers_cannot_lock_a_daemon_out.)"""
    limits = kp.KeeperLimits(connections=4, owners=2, fds=3, idle_seconds=0.5)
    async with _keeper_here(socket_dir, limits) as keeper:
        path = keeper.socket_path
        with (
            _holding_lock(socket_dir / "a.sock") as a,
            _holding_lock(socket_dir / "b.sock") as b,
            _holding_lock(socket_dir / "c.sock") as c,
        ):
            for owner, rank in ((a, 0), (a, 1), (b, 0)):
                await _deposit(path, owner, *_memfd_model(rank))
            with pytest.raises(LimitExceededError, match="would hold 4 slabs"):
                await _deposit(path, b, *_memfd_model(1))
            with pytest.raises(LimitExceededError, match="slabs for 2 daemons"):
                await _deposit(path, c, *_memfd_model(0))
            await _deposit(path, a, *_memfd_model(1))  # replacing an entry stays within the caps
            for owner, n in ((a, 2), (b, 1)):
                state, fds, _ = await kl.reclaim(path, owner=owner, backend="host", device_uuid="")
                for fd in fds:
                    os.close(fd)
                assert len(state.models) == n and state.dropped == 0

            await _connections_reach(keeper, 0)  # the requests' connections have closed
            # connections of this process, which holds the lock of a socket the keeper holds slabs for: a
            # daemon's, so none of them gives way, and a fifth is refused
            idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(limits.connections)]
            try:
                for s in idle:
                    s.setblocking(False)
                    await asyncio.get_running_loop().sock_connect(s, str(path))
                await _connections_reach(keeper, limits.connections)
                with pytest.raises(LimitExceededError, match="too many connections"):
                    await kl.reclaim(path, owner=a, backend="host", device_uuid="")
            finally:
                for s in idle:
                    s.close()
            await _connections_reach(keeper, 0)
            state, fds, _ = await kl.reclaim(path, owner=a, backend="host", device_uuid="")
            for fd in fds:
                os.close(fd)
            assert len(state.models) == 2

            # a peer that completes the handshake and then says nothing is closed after idle_seconds
            ch, _ = await connect(path, software="test", name="idle")
            try:
                with pytest.raises((EOFError, ConnectionError, CacheUnavailableError)):
                    await asyncio.wait_for(ch.receive(), 30)
            finally:
                ch.close()


@contextlib.asynccontextmanager
async def _idle_peers(path: Path) -> AsyncIterator[Callable[[str], Awaitable[str]]]:
    """Another process of this uid holding idle connections to ``path`` (tests/server/idle_peers.py): yields
    ``ask(command)``, its answer to one command, within a deadline."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.server.idle_peers", str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def command(line: str) -> str:
        stdin.write(line + "\n")
        stdin.flush()
        return stdout.readline().strip()

    async def ask(line: str) -> str:
        return await asyncio.wait_for(asyncio.to_thread(command, line), 120)

    try:
        yield ask
    finally:
        proc.kill()  # its sockets close with it (and a blocked readline returns)
        proc.wait(30)
        stdin.close()
        stdout.close()


async def test_idle_peers_cannot_lock_a_daemon_out_of_its_keeper(socket_dir: Path) -> None:
    """1,100 connections of another process of the uid that said HELLO and nothing else, against a keeper
    with its default cap of 64: each new one takes the place of the one idle longest, and a restarting
    daemon's RECLAIM is answered with its models (it was refused with LIMIT_EXCEEDED, so the daemon loaded from
    disk). A connection of the daemon holding its socket's lock never gives way: not even between its HELLO and
    its request while 200 more idle peers arrive."""
    limits = kp.KeeperLimits()
    async with _keeper_here(socket_dir, limits) as keeper:
        path = keeper.socket_path
        with _holding_lock(socket_dir / "rank0.sock") as owner:
            await _deposit(path, owner, *_memfd_model(0))
            async with _idle_peers(path) as peers:
                assert await peers("open 1100") == "opened 1100 ok=1100"  # each served, in an idle one's place
                assert len(keeper.shell) == limits.connections
                state, fds, _ = await kl.reclaim(path, owner=owner, backend="host", device_uuid="")
                close_fds(fds)
                assert len(state.models) == 1 and state.dropped == 0

                ch, _ = await connect(path, software="test", name="wcache-server")  # the daemon, before RECLAIM
                try:
                    assert await peers("open 200") == "opened 200 ok=200"
                    await ch.send(Reclaim(id=1, owner=owner, backend="host", device_uuid="", pid=os.getpid()))
                    reply, fds = await expect(ch)
                    close_fds(fds)
                    assert isinstance(reply, Reclaimed) and len(reply.models) == 1
                finally:
                    ch.close()
                assert await peers("live") == f"live {limits.connections - 1}"  # the cap held throughout


async def test_forged_slabs_are_not_served_and_do_not_spoil_the_real_one(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path, tied_ckpt: Path
) -> None:
    """While no daemon runs, a process of the uid takes the daemon's lock and deposits forged models: random
    bytes under another checkpoint's true key and table, and a float32 key of it over its bfloat16 table. The
    restarted daemon checks each reclaimed model against its checkpoint, drops (and UNKEEPs) the forgeries and
    serves the real one as reclaimed."""
    first = daemon_factory(model, "--keeper")
    loaded = (await WCacheClient(first.socket).status()).models[0]
    first.stop(signal.SIGKILL)
    tied = WeightCacheKey.from_checkpoint(tied_ckpt)
    with _holding_lock(first.socket) as owner:
        await _deposit(keeper.socket, owner, *_forged(tied_ckpt))
        await _deposit(
            keeper.socket, owner, *_forged(tied_ckpt, key=WeightCacheKey.from_checkpoint(tied_ckpt, dtype="float32"))
        )
    assert len((await WCacheClient(keeper.socket).status()).models) == 3

    second = daemon_factory(model, "--keeper")
    (served,) = (await WCacheClient(second.socket).status()).models
    assert served.key == loaded.key and served.load_seconds == loaded.load_seconds  # reclaimed, not reloaded
    assert [m.key for m in (await WCacheClient(keeper.socket).status()).models] == [loaded.key]
    ref = load_from_disk(tied_ckpt)
    await WCacheClient(second.socket).preload(RankSpec(tied_ckpt))
    async with await WCacheClient(second.socket).fetch(tied) as w:  # the checkpoint's bytes
        assert all(torch.equal(w[k], v) for k, v in ref.items())


async def test_a_forged_slab_under_the_daemons_own_key_is_dropped_and_the_model_loaded(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path
) -> None:
    first = daemon_factory(model, "--keeper")
    first.stop(signal.SIGKILL)
    with _holding_lock(first.socket) as owner:
        await _deposit(keeper.socket, owner, *_forged(model))  # replaces the real entry
    second = daemon_factory(model, "--keeper")
    ref = load_from_disk(model)
    async with await WCacheClient(second.socket).fetch(WeightCacheKey.from_checkpoint(model)) as w:
        assert all(torch.equal(w[k], v) for k, v in ref.items())  # the checkpoint's bytes, not the forgery's


def _admit_beside_a_good_one(model: Path, tmp_path: Path, bad: Callable[[HandedModel], HandedModel]) -> None:
    """``admit`` of two reclaimed models: one whose slab is ``model`` loaded (handed as the keeper would), then
    ``bad(that handed model)``, a memfd of the keeper's example size as its slab: the good one alone is served."""
    from wcache.proto import Reclaimed
    from wcache.server.backends.host import HostBackend
    from wcache.server.load import load_model
    from wcache.server.reclaim import admit
    from wcache.server.startup import adopt

    backend = HostBackend()
    good = load_model(RankSpec(model), backend=backend)
    try:
        fds: list[int] = []
        descs = good.export(fds)
        fds = [os.dup(fd) for fd in fds]
        handed = good.handed(descs)
        _, bad_fd = _memfd_model(0)
        state = Reclaimed(id=1, models=(bad(handed), handed), dropped=0)
        link = kl.KeeperLink(tmp_path / "no-keeper.sock", owner=tmp_path / "d.sock", backend="host", device_uuid="")
        served, dropped = admit(link, state, [*fds, bad_fd], backend, adopt)
        try:
            assert [m.key for m in served] == [good.key] and dropped == 1
        finally:
            for m in served:
                m.close()
    finally:
        good.close()


def test_one_model_that_cannot_be_adopted_does_not_spoil_the_others(model: Path, tmp_path: Path) -> None:
    """Daemon side: a reclaimed slab the backend refuses (its memfd smaller than the slab) drops that model
    only; the other is checked and served."""
    example, fd = _memfd_model(0)
    os.close(fd)
    _admit_beside_a_good_one(
        model,
        tmp_path,
        lambda handed: HandedModel(example.key, (SlabDescriptor(size=1 << 30, kind="memfd", fd=1),), example.tensors),
    )


@pytest.mark.parametrize(
    "spoil",
    [
        lambda key: {k: v for k, v in key.items() if k != "fingerprint"},  # an older daemon's key, or a forgery
        lambda key: {**key, "tp_size": "1"},  # a field of another type
        lambda key: {**key, "colour": "red"},  # a field the key drops on decoding: its UNKEEP would find nothing
    ],
    ids=["a field missing", "a field of another type", "a field the key drops"],
)
def test_a_kept_entry_whose_key_does_not_decode_is_dropped_and_the_others_served(
    spoil: Callable[[dict[str, Any]], dict[str, Any]], model: Path, tmp_path: Path
) -> None:
    """Daemon side: RECLAIMED holds an entry whose key map is no key this daemon keeps. ``admit`` decoded each key
    outside its per-model ``try``, so a key without ``fingerprint`` raised TypeError out of the start-up, on every
    restart while the keeper held it (docs/protocol.md §4.11: a model that fails is dropped, the others served).
    Now that entry alone is dropped; an UNKEEP by its own map is tried (here no keeper answers: a log line)."""
    example, fd = _memfd_model(0)
    os.close(fd)
    _admit_beside_a_good_one(
        model,
        tmp_path,
        lambda handed: HandedModel(
            spoil(dict(handed.key)), (SlabDescriptor(size=example.slabs[0].size, kind="memfd", fd=1),), example.tensors
        ),
    )


async def test_a_model_served_in_vllms_layout_is_reclaimed_after_a_crash(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path
) -> None:
    """A daemon serving a load-time transform (vLLM's layout) gets its slab back from the keeper too: its key is
    checked against the checkpoint (layout and bytes are the transform's own; the owner check guards them)."""
    transform = "wcache.transforms:vllm_layout"
    key = WeightCacheKey.from_checkpoint(model, transform=transform)
    first = daemon_factory(model, "--keeper", "--transform", transform)
    loaded = (await WCacheClient(first.socket).status()).models[0]
    async with await WCacheClient(first.socket).fetch(key) as w:
        ref = {k: w[k].clone() for k in w}
    first.stop(signal.SIGKILL)
    second = daemon_factory(model, "--keeper", "--transform", transform)
    (served,) = (await WCacheClient(second.socket).status()).models
    assert served.load_seconds == loaded.load_seconds  # reclaimed, not loaded again
    async with await WCacheClient(second.socket).fetch(key) as w:
        assert set(w) == set(ref) and all(torch.equal(w[k], v) for k, v in ref.items())


async def test_a_kept_deposit_is_served_after_a_crash_and_dropped_once_its_checkpoint_changes(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path
) -> None:
    """Write-back survives a daemon crash like a load does (docs/reliability.md): the restarted daemon serves the kept
    deposit under its recipe key (origin "keeper", buffers kept, the engine's bytes), not "unverifiable"; once
    the recipe's checkpoint changed on disk, the kept deposit is stale and dropped from the keeper too."""
    from tests.server.deposit_engine import recipe_key, tensors

    base = WeightCacheKey.from_checkpoint(model)
    key = recipe_key(base)
    ts = tensors()
    first = daemon_factory(model, "--keeper")
    await WCacheClient(first.socket).deposit(key, ts, kinds={"rotary.inv_freq": "buffer"})
    assert len((await WCacheClient(keeper.socket).status()).models) == 2  # the checkpoint and the deposit
    first.stop(signal.SIGKILL)

    second = daemon_factory(model, "--keeper")
    origins = {(("engine" in m.key), m.origin) for m in (await WCacheClient(second.socket).status()).models}
    assert origins == {(False, "keeper"), (True, "keeper")}
    async with await WCacheClient(second.socket).fetch(key) as w:
        assert w.buffers == {"rotary.inv_freq"}
        assert all(
            torch.equal(w[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)) for n, t in ts.items()
        )
    second.stop(signal.SIGKILL)

    _flip_byte(model, sampled=True)
    third = daemon_factory(model, "--keeper")
    served = (await WCacheClient(third.socket).status()).models
    assert [("engine" in m.key, m.origin) for m in served] == [(False, "disk")]
    kept = (await WCacheClient(keeper.socket).status()).models
    assert [("engine" in m.key) for m in kept] == [False]


async def test_a_kept_deposit_older_than_the_one_the_host_tier_records_is_not_served(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path, tmp_path: Path
) -> None:
    """v1 deposited and kept; the daemon restarted without ``--keeper`` (the host tier only) takes v2 (DEPOSITED);
    restarted with ``--keeper`` again, it reclaimed v1 from the keeper and served it under the key, although v2 was
    committed after it. A kept deposit carries its generation (HandedModel ``generation``) and is dropped where the
    host tier records another: the daemon serves v2, restored from the tier."""
    from wcache.plan.recipe import RecipeKey

    key = RecipeKey.of(WeightCacheKey.from_checkpoint(model), engine="test")
    tier = ("--host-tier", "1G", "--host-tier-dir", str(tmp_path / "tier"))

    async def deposit(d: DaemonProc, v: float) -> None:
        await WCacheClient(d.socket).deposit(key, {"w": torch.full((64, 64), v)})

    async def served(d: DaemonProc) -> float:
        async with await WCacheClient(d.socket).fetch(key, mode="copy") as w:
            return float(torch.unique(w["w"]).item())

    first = daemon_factory(model, "--keeper", *tier)
    await deposit(first, 1.0)
    assert len(await _kept_models(keeper.socket, n=2)) == 2
    first.stop()
    second = daemon_factory(model, *tier)
    await deposit(second, 2.0)
    assert await served(second) == 2.0
    second.stop()  # its drain waits for the tier's save
    third = daemon_factory(model, "--keeper", *tier)
    assert await served(third) == 2.0


async def test_a_kept_deposit_older_than_a_commit_the_keeper_missed_is_not_served_after_a_crash(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path
) -> None:
    """No host tier. v1 deposited and kept; the keeper stops answering (SIGSTOP), v2 is committed (DEPOSITED), the
    daemon crashes and the keeper resumes. The next daemon reclaimed v1 and served it under the key, although v2
    was committed after it. The daemon records a COMMIT's generation beside its socket until the keeper holds it
    (``<socket>.deposits``), and drops a kept deposit of another generation: the key is absent, never older.
    The record is settled by that RECLAIM (the file is gone), and the COMMIT paid one keeper timeout, not two."""
    from wcache.plan.recipe import RecipeKey

    key = RecipeKey.of(WeightCacheKey.from_checkpoint(model), engine="test")
    first = daemon_factory(model, "--keeper")
    record = Path(f"{first.socket}.deposits")
    await WCacheClient(first.socket).deposit(key, {"w": torch.full((64, 64), 1.0)})
    assert len(await _kept_models(keeper.socket, n=2)) == 2
    assert not record.exists()  # the keeper holds the last deposit: nothing to record
    keeper.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = asyncio.get_running_loop().time()
        await WCacheClient(first.socket, timeout=60).deposit(key, {"w": torch.full((64, 64), 2.0)})
        assert asyncio.get_running_loop().time() - t0 < 18  # one keeper timeout (10 s), not the UNKEEP's and KEEP's
        assert record.exists()
        first.stop(signal.SIGKILL)
    finally:
        keeper.proc.send_signal(signal.SIGCONT)
    second = daemon_factory(model, "--keeper")
    with pytest.raises(KeyMismatchError, match="served nothing"):  # the recipe key is absent (docs/protocol.md §4.9)
        await WCacheClient(second.socket).fetch(key, mode="copy")
    assert not record.exists()
    assert len(await _kept_models(keeper.socket, n=1)) == 1  # v1 dropped from the keeper too


def test_a_damaged_record_stays_damaged_while_a_stale_deposits_unkeep_is_unconfirmed() -> None:
    """The RECLAIM's drops of stale deposits: how many the keeper did not confirm decides whether a damaged record
    may become a known one (``reclaim.admit``). Before, it always did: a deposit dropped as stale because the record
    was damaged, whose UNKEEP the keeper did not answer, was still kept, and the next daemon served it."""
    from wcache.server import reclaim

    class Link:
        def __init__(self, answers: list[bool]) -> None:
            self.answers = answers

        async def drop(self, key: object, *, settle: bool = True) -> bool:
            return self.answers.pop(0)

    assert asyncio.run(reclaim._unkeep_all(Link([True, False, True]), ["a", "b", "c"])) == 1  # type: ignore[arg-type,list-item]
    assert asyncio.run(reclaim._unkeep_all(Link([True]), ["a"])) == 0  # type: ignore[arg-type,list-item]


async def test_a_deposit_committed_without_a_keeper_makes_the_kept_one_stale(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path
) -> None:
    """v1 deposited and kept; the daemon restarted without ``--keeper`` and without a host tier commits v2 and stops;
    restarted with ``--keeper``, it reclaimed v1 and served it under the key, although v2 was committed on this
    socket after it (docs/security.md listed it as open). A daemon without a keeper records every COMMIT's
    generation beside its socket (``<socket>.deposits``): the next daemon with a keeper drops the kept v1 — the key
    is absent, never older — and the RECLAIM settles the record."""
    from wcache.plan.recipe import RecipeKey

    key = RecipeKey.of(WeightCacheKey.from_checkpoint(model), engine="test")
    first = daemon_factory(model, "--keeper")
    await WCacheClient(first.socket).deposit(key, {"w": torch.full((64, 64), 1.0)})
    assert len(await _kept_models(keeper.socket, n=2)) == 2
    first.stop()
    second = daemon_factory(model)
    await WCacheClient(second.socket).deposit(key, {"w": torch.full((64, 64), 2.0)})
    record = Path(f"{second.socket}.deposits")
    assert record.exists()
    second.stop()
    third = daemon_factory(model, "--keeper")
    with pytest.raises(KeyMismatchError, match="served nothing"):
        await WCacheClient(third.socket).fetch(key, mode="copy")
    assert not record.exists()
    assert len(await _kept_models(keeper.socket, n=1)) == 1  # v1 dropped from the keeper too


async def test_a_deposit_kept_in_another_keeper_makes_the_older_one_kept_here_stale(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path, tmp_path: Path
) -> None:
    """No host tier. v1 deposited and kept in keeper A (the socket directory's); the daemon restarted with
    ``--keeper`` naming another keeper B commits v2, which B takes (the record's entry settled); restarted with A
    again, it reclaimed v1 from A and served it, although v2 was committed on this socket after it: the record
    had no entry of the key and was read as if A held its last generation. The record names the keeper it was
    settled against (its socket's real path) and vouches for that one only: A's v1 is stale — the key is absent,
    never older — while the checkpoint's model, checked against its files, is served from A as before; the record
    then names A (as no file does: A is the socket directory's keeper)."""
    from wcache.plan.recipe import RecipeKey

    key = RecipeKey.of(WeightCacheKey.from_checkpoint(model), engine="test")
    first = daemon_factory(model, "--keeper")
    record = Path(f"{first.socket}.deposits")
    await WCacheClient(first.socket).deposit(key, {"w": torch.full((64, 64), 1.0)})
    assert len(await _kept_models(keeper.socket, n=2)) == 2
    first.stop()

    other_dir = tmp_path / "other-keeper"
    other_dir.mkdir(mode=0o700)
    other = spawn_keeper(other_dir)
    try:
        second = daemon_factory(model, "--keeper", str(other.socket))
        await WCacheClient(second.socket).deposit(key, {"w": torch.full((64, 64), 2.0)})
        assert len(await _kept_models(other.socket, n=2)) == 2
        settled = kl.CommitRecord(record)  # B holds v2: no entry, and the record names B
        assert settled.keys == {} and settled.settled_in == os.path.realpath(other.socket)
        second.stop()
    finally:
        other.stop()

    third = daemon_factory(model, "--keeper")  # keeper A again, still holding v1 for this socket
    with pytest.raises(KeyMismatchError, match="served nothing"):
        await WCacheClient(third.socket).fetch(key, mode="copy")
    served = (await WCacheClient(third.socket).status()).models
    assert [("engine" in m.key, m.origin) for m in served] == [(False, "keeper")]
    assert await _kept_models(keeper.socket, n=1) == [WeightCacheKey.from_checkpoint(model).to_wire()]
    assert not record.exists()  # nothing recorded and the record names A, the socket directory's own keeper
    assert kl.CommitRecord(record, keeper=os.path.realpath(keeper.socket)).vouches


async def test_one_socket_spelled_two_ways_is_one_owner_in_the_keeper(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path, socket_dir: Path, tmp_path: Path
) -> None:
    """The socket directory reached through a symlink (``/var/run/wcache`` and ``/run/wcache`` on most systems) is
    the same socket, its lock and its ``.deposits`` record the same files: the keeper's owner is the socket's real
    path, so a daemon started on either spelling reclaims what the other kept. Before, the owner was the path as
    spelled: the daemon on the second spelling reclaimed nothing, its deposit v2 was kept beside v1, and the
    daemon restarted on the first spelling served v1 although v2 was committed on that socket after it."""
    from wcache.plan.recipe import RecipeKey

    alias = tmp_path / "alias"
    alias.symlink_to(socket_dir.parent, target_is_directory=True)
    key = RecipeKey.of(WeightCacheKey.from_checkpoint(model), engine="test")

    async def served(d: DaemonProc) -> float:
        async with await WCacheClient(d.socket).fetch(key, mode="copy") as w:
            return float(torch.unique(w["w"]).item())

    first = daemon_factory(model, "--keeper")
    await WCacheClient(first.socket).deposit(key, {"w": torch.full((64, 64), 1.0)})
    assert len(await _kept_models(keeper.socket, n=2)) == 2
    first.stop()
    second = daemon_factory(model, "--keeper", sdir=alias / socket_dir.name)
    assert await served(second) == 1.0  # reclaimed through the other spelling
    await WCacheClient(second.socket).deposit(key, {"w": torch.full((64, 64), 2.0)})
    assert len(await _kept_models(keeper.socket, n=2)) == 2  # v2 replaced v1: one owner
    second.stop()
    third = daemon_factory(model, "--keeper")
    assert await served(third) == 2.0


async def test_a_keep_racing_an_evict_hands_the_keeper_the_models_own_slab(
    ckpt: Path, socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KEEP waits for the keeper's handshake; meanwhile the model is evicted (its memfd closed) and the next
    slab the daemon allocates gets the freed descriptor number. The keeper must get the model's own slab or
    nothing — not whatever file has the number by then. Before, the KEEP carried the slab's own numbers, taken
    before the await: the keeper held another deposit's bytes (here 0xAB) under this model's key, which a
    daemon restarted after a crash served (the keeper's sealed-memfd check passes for any other slab). A KEEP
    whose model was closed before its turn sends nothing."""
    from wcache.server.backends.host import HostBackend
    from wcache.server.load import load_model

    backend = HostBackend()
    m = load_model(RankSpec(ckpt), backend=backend, threads=2)
    original = m.slabs[0].read(0, m.slabs[0].size)
    other = backend.allocate(m.slabs[0].size)  # the next slab: another deposit, sealed like any served one
    _, (other_fd,) = other.export()
    os.pwrite(other_fd, b"\xab" * other.size, 0)
    other.seal()
    stolen: list[int] = []
    real_keep = kl.keep

    async def keep_racing_an_evict(path: Path, *, fds: list[int], **kw: object) -> tuple[Kept, int]:
        m.close()  # evicted while the KEEP waits for the keeper's handshake
        for fd in fds:
            try:
                fcntl.fcntl(fd, fcntl.F_GETFD)
            except OSError:  # the number is free again: the next slab's memfd gets it
                stolen.append(os.dup2(other_fd, fd))
        return await real_keep(path, fds=fds, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(kl, "keep", keep_racing_an_evict)
    try:
        async with _keeper_here(socket_dir) as keeper:
            with _holding_lock(socket_dir / "wcache-rank0.sock") as owner:
                link = kl.KeeperLink(keeper.socket_path, owner=Path(owner), backend="host", device_uuid="")
                await link.keep(m)
                state, fds, _ = await kl.reclaim(keeper.socket_path, owner=owner, backend="host", device_uuid="")
                try:
                    assert [dict(x.key) for x in state.models] == [m.key.to_wire()]
                    assert os.pread(fds[0], len(original), 0) == original  # the model's bytes, not 0xAB
                finally:
                    close_fds(fds)
                keeps = keeper.keeps
                await link.keep(m)  # closed by now: no KEEP at all (before: one of no slab, a fatal PROTOCOL_ERROR)
                assert keeper.keeps == keeps
    finally:
        close_fds(stolen)
        other.close()


def test_a_damaged_commit_record_makes_every_kept_deposit_stale(tmp_path: Path) -> None:
    """``<socket>.deposits`` that cannot be parsed says nothing of which generation is the last: every kept deposit
    is dropped (stale), never served on a guess; a RECLAIM's ``reclaimed`` rewrites it. A readable one names the
    key's generation: another is stale, that one is not; settled entries leave no file. The damage outlives a
    COMMIT made before a RECLAIM acted on it: before, that COMMIT wrote a valid record of its one key, and the next
    daemon served the other kept deposits on its word. For the host tier the record stays partial even after the
    RECLAIM: it vouches for the keys it names from then on (their generation), not for a key it does not name."""
    from wcache.plan.recipe import RecipeKey

    k1 = RecipeKey.of(WeightCacheKey("a" * 64, "LlamaForCausalLM", 1, 0, "bfloat16"), engine="test")
    k2 = RecipeKey.of(WeightCacheKey("b" * 64, "LlamaForCausalLM", 1, 0, "bfloat16"), engine="test")
    path = tmp_path / "wcache-rank0.sock.deposits"
    here = os.path.realpath(tmp_path / KEEPER_SOCKET)  # the socket directory's keeper
    rec = kl.CommitRecord(path, keeper=here)
    assert rec.known and rec.stale(k1, "g1") is None and not path.exists()
    rec.committed(k1, "g2")
    again = kl.CommitRecord(path, keeper=here)
    assert again.stale(k1, "g1") is not None and again.stale(k1, "g2") is None and again.stale(k2, "g1") is None
    rec.settled(k1)
    assert not path.exists()
    path.write_text('{"format": "wcache-deposits/1", "keys": [')
    damaged = kl.CommitRecord(path, keeper=here)
    assert not damaged.known and damaged.stale(k2, "g1") is not None
    assert damaged.restorable(k1) == (False, None)  # no tier restore of a key it cannot vouch for
    damaged.committed(k1, "g3")  # a COMMIT before any RECLAIM acted on the damage (the keeper unreachable)
    again = kl.CommitRecord(path, keeper=here)  # the next daemon: still every kept deposit stale, not k2's "g1"
    assert not again.known and again.stale(k2, "g1") is not None and again.stale(k1, "g3") is not None
    again.reclaimed(set(), confirmed=False)  # a RECLAIM whose UNKEEP of a deposit it made stale was not confirmed
    assert not kl.CommitRecord(path).known  # still damaged: that deposit may still be kept
    again.reclaimed(set(), confirmed=True)
    again.settled(k1)  # the keeper holds g3: the entry stays, it vouches for k1's tier restore
    after = kl.CommitRecord(path, keeper=here)
    assert after.known and after.partial and after.stale(k1, "g3") is None and after.stale(k2, "g1") is None
    assert after.restorable(k1) == (True, "g3") and after.restorable(k2) == (False, None)


def test_a_full_commit_record_gives_up_its_entries_and_makes_every_kept_deposit_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon without a keeper records every COMMIT's generation and settles none, so ``<socket>.deposits`` grew
    by one entry per recipe key it was ever written back under. It holds ``MAX_KEYS`` at most: one more gives up
    the other entries and marks the record damaged — every kept deposit stale at the next RECLAIM, none served on a
    record that forgot its key — and the file stays that small; a RECLAIM's ``reclaimed`` makes it a record again
    for the keeper. For the host tier it is partial from then on: only the keys it names are restored."""
    from wcache.plan.recipe import RecipeKey

    monkeypatch.setattr(kl.CommitRecord, "MAX_KEYS", 3)
    base = WeightCacheKey("a" * 64, "LlamaForCausalLM", 1, 0, "bfloat16")
    keys = [RecipeKey.of(base, engine="test", variant=str(i)) for i in range(5)]
    path = tmp_path / "wcache-rank0.sock.deposits"
    here = os.path.realpath(tmp_path / KEEPER_SOCKET)  # the keeper of the daemon that reclaims next
    rec = kl.CommitRecord(path)
    for k in keys[:3]:
        rec.committed(k, "g1")
    rec.committed(keys[0], "g2")  # a key it holds: recorded, not one more
    assert rec.known and kl.CommitRecord(path, keeper=here).stale(keys[0], "g1") is not None
    assert kl.CommitRecord(path, keeper=here).stale(keys[4], "g0") is None
    rec.committed(keys[3], "g1")  # one more than it holds
    full = kl.CommitRecord(path, keeper=here)
    assert not full.known and full.keys == {kl.CommitRecord.key_id(keys[3]): "g1"}
    assert all(full.stale(k, "g1") is not None for k in keys)
    assert full.restorable(keys[0]) == (False, None) and full.restorable(keys[3]) == (True, "g1")
    rec.committed(keys[4], "g1")
    assert len(rec.keys) == 2 and len(path.read_bytes()) < 300
    rec.reclaimed(set(), confirmed=True)
    assert rec.known and rec.partial and kl.CommitRecord(path).restorable(keys[0]) == (False, None)


def test_status_counts_kept_models_for_the_socket_they_were_kept_for(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path, socket_dir: Path
) -> None:
    """Two ranks' daemons keep one model each; rank 1's crashes. Its row says the keeper holds one model for it
    (it used to count every rank's: "holds 2 model(s)"), and the keeper's rows name whose each model is."""
    daemon_factory(model, "--keeper", "--tp-size", "2", "--tp-rank", "0")
    r1 = daemon_factory(model, "--keeper", "--tp-size", "2", "--tp-rank", "1")
    r1.stop(signal.SIGKILL)
    out = run_cli("status", "--socket-dir", str(socket_dir))
    assert out.returncode == 1
    (row,) = [line for line in out.stdout.splitlines() if line.startswith(str(r1.socket))]
    assert f"the keeper at {keeper.socket} holds 1 model for it" in row
    kept = [line for line in out.stdout.splitlines() if line.startswith(str(keeper.socket))]
    assert sorted(line.split("(kept, for ")[1].split(")")[0] for line in kept) == [
        "wcache-rank0.sock",
        "wcache-rank1.sock",
    ]


async def test_sighup_leaves_the_daemon_and_the_keeper_serving(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], model: Path
) -> None:
    """A terminal closing sends SIGHUP to what was started from it with ``&``: neither process ends (its default
    action would: leases dropped, the keeper's slabs freed, the socket and its lock left behind)."""
    key = WeightCacheKey.from_checkpoint(model)
    daemon = daemon_factory(model, "--keeper")
    engine = await WCacheClient(daemon.socket).fetch(key)
    for proc in (daemon, keeper):
        proc.proc.send_signal(signal.SIGHUP)
    await asyncio.sleep(0.5)
    assert daemon.proc.poll() is None and keeper.proc.poll() is None
    status = await WCacheClient(daemon.socket).status()
    assert [lease.lease for lease in status.leases] == [engine.lease]  # the engine's lease held on
    assert [m.key for m in (await WCacheClient(keeper.socket).status()).models] == [key.to_wire()]
    await engine.release()
    assert daemon.stop(signal.SIGTERM) == 0  # SIGTERM still stops it, drained
