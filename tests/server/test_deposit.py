"""Write-back (docs/protocol.md §4.13) against real daemons on the host backend: DEPOSIT, write, COMMIT,
then GET_STATE maps the deposited tensors zero-copy; leases, concurrency, budgets, bad tables, and an
engine SIGKILLed at each step of a deposit."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from tests.conftest import DaemonProc
from tests.server.deposit_engine import STEPS, recipe_key, tensors
from wcache import WCacheClient, WeightCacheKey
from wcache.channel import Channel, connect, expect
from wcache.errors import (
    InUseError,
    KeyMismatchError,
    LocalProtocolError,
    NotFoundError,
    OutOfMemoryError,
    ProtocolError,
    RemoteProtocolError,
    UnknownLeaseError,
    UnsupportedPlatformError,
)
from wcache.nn import load_from_disk
from wcache.plan.key import RankSpec
from wcache.plan.recipe import RecipeKey
from wcache.proto import (
    Commit,
    Deposit,
    Deposited,
    DepositSlab,
    DepositTensor,
    DeviceInfo,
    ErrorFrame,
    SlabDescriptor,
)
from wcache.server.backends.base import Backend
from wcache.server.store import Store, deposit_layout

ROOT = Path(__file__).resolve().parents[2]


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def wait_for(what: Callable[[], object], deadline_s: float = 20.0, why: str = "") -> None:
    """Poll ``what`` until it is true (a state, not a duration): fail with ``why`` at the deadline."""
    deadline = time.monotonic() + deadline_s
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {deadline_s} s: {why}")
        await asyncio.sleep(0.02)


async def models(daemon: DaemonProc) -> dict[str, str]:
    """key short-name -> origin of every model the daemon serves."""
    st = await WCacheClient(daemon.socket).status()
    return {RecipeKey.from_wire(dict(m.key)).short() if "engine" in m.key else "ckpt": m.origin for m in st.models}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


async def test_deposit_then_fetch_is_bit_identical_and_zero_copy(daemon: DaemonProc, ckpt: Path) -> None:
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    ts = tensors()
    ts["lm_head.weight"] = ts["layers.1.weight"]  # a tie: the same tensor object under two names
    client = WCacheClient(daemon.socket)
    done = await client.deposit(key, ts, kinds={"rotary.inv_freq": "buffer"})
    assert done.tensors == 4 and not done.replaced and done.key == key.to_wire()
    assert (await models(daemon))[key.short()] == "deposit"
    async with await client.fetch(key) as w:
        assert set(w) == set(ts)
        assert w.aliases == {"lm_head.weight": "layers.1.weight"}
        assert w.buffers == {"rotary.inv_freq"}
        for name, t in ts.items():
            assert w[name].dtype == t.dtype and w[name].shape == t.shape, name
            assert torch.equal(bits(w[name]), bits(t)), name
        assert len({w[n].untyped_storage().data_ptr() for n in w}) == 1  # one mapped slab
    # the checkpoint's own key still maps the checkpoint, and a recipe that differs is refused by field
    async with await client.fetch(WeightCacheKey.from_checkpoint(ckpt)) as raw:
        assert "model.norm.weight" in raw
    with pytest.raises(KeyMismatchError) as info:
        await client.fetch(recipe_key(WeightCacheKey.from_checkpoint(ckpt), postprocess=2))
    assert "postprocess" in info.value.details["fields"]


async def test_leased_model_is_never_replaced(daemon: DaemonProc, ckpt: Path) -> None:
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    client = WCacheClient(daemon.socket)
    idle = fd_count(daemon.pid)  # no connection yet: the listener, logs and the checkpoint's slab
    await client.deposit(key, tensors())
    async with await client.fetch(key) as w:
        with pytest.raises(InUseError) as info:
            await client.deposit(key, tensors())
        assert info.value.details["leases"] == 1
        assert torch.equal(bits(w["layers.0.weight"]), bits(tensors()["layers.0.weight"]))
    # unleased, a second deposit replaces it
    again = await client.deposit(key, {"x": torch.ones(3)})
    assert again.replaced
    async with await client.fetch(key) as w:
        assert set(w) == {"x"}
    await wait_for(lambda: fd_count(daemon.pid) == idle + 1, why="one deposit slab open, the replaced one closed")


async def test_concurrent_second_deposit_of_a_key_is_refused(daemon: DaemonProc, ckpt: Path) -> None:
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    table = (DepositTensor("w", "float32", (4,)),)
    ch, _ = await connect(daemon.socket, software="t", name="first")
    try:
        await ch.send(Deposit(id=ch.conn.next_request_id(), key=key.to_wire(), tensors=table))
        slab, fds = await expect(ch)
        assert isinstance(slab, DepositSlab) and len(fds) == 1
        os.close(fds[0])
        with pytest.raises(InUseError) as info:
            await WCacheClient(daemon.socket).deposit(key, {"w": torch.ones(4)})
        assert info.value.details["in_progress"] is True
        await ch.send(Commit(id=ch.conn.next_request_id(), deposit=slab.deposit))
        await expect(ch)
    finally:
        ch.close()
    async with await WCacheClient(daemon.socket).fetch(key) as w:
        assert torch.equal(w["w"], torch.zeros(4))  # the first deposit's bytes (never written: zeros)


async def _four_floats(ch: Channel[Any], key: RecipeKey) -> tuple[DepositSlab, list[int]]:
    """DEPOSIT of one float32[4] on ``ch`` (request id 1): its DEPOSIT_SLAB and writable descriptor."""
    await ch.send(Deposit(id=1, key=key.to_wire(), tensors=(DepositTensor("w", "float32", (4,)),)))
    slab, fds = await expect(ch)
    assert isinstance(slab, DepositSlab) and len(fds) == 1
    return slab, fds


async def test_commit_while_still_mapped_is_refused_and_leaves_nothing(daemon: DaemonProc, ckpt: Path) -> None:
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    before = fd_count(daemon.pid)
    ch, _ = await connect(daemon.socket, software="t", name="mapper")
    try:
        slab, fds = await _four_floats(ch, key)
        mm = mmap.mmap(fds[0], slab.slabs[0].size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        await ch.send(Commit(id=2, deposit=slab.deposit))
        with pytest.raises(InUseError):
            await expect(ch)
        mm.close()
        os.close(fds[0])
        await ch.send(Commit(id=3, deposit=slab.deposit))
        with pytest.raises(UnknownLeaseError):  # any answer to COMMIT ended the deposit
            await expect(ch)
    finally:
        ch.close()
    assert key.short() not in await models(daemon)
    await wait_for(lambda: fd_count(daemon.pid) == before, why="the refused slab's fd closed")


def _write_four_floats(fd: int, slab: DepositSlab) -> None:
    """What an engine does before COMMIT: map the slab writable, write ``w`` = 0, 1, 2, 3, unmap."""
    (entry,) = slab.tensors
    mm = mmap.mmap(fd, slab.slabs[0].size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    mm[entry.offset : entry.offset + 16] = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    mm.close()


async def test_after_commit_nothing_the_engine_kept_can_write_the_slab(daemon: DaemonProc, ckpt: Path) -> None:
    """Once DEPOSITED, every way the depositing engine could still reach its host slab is refused by the seals
    COMMIT added: through the descriptor it got, a dup of it or a /proc/self/fd reopen, no writable shared
    mapping, pwrite, splice from a pipe, ftruncate or fallocate, and a read-only mapping cannot be mprotect'ed
    writable; the deposit serves the bytes committed."""
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    ch, _ = await connect(daemon.socket, software="t", name="keeper-of-fds")
    kept: list[int] = []
    try:
        slab, fds = await _four_floats(ch, key)
        kept += fds
        size, (entry,) = slab.slabs[0].size, slab.tensors
        _write_four_floats(fds[0], slab)
        kept.append(os.dup(fds[0]))
        await ch.send(Commit(id=2, deposit=slab.deposit))
        assert isinstance((await expect(ch))[0], Deposited)
        kept.append(os.open(f"/proc/self/fd/{kept[1]}", os.O_RDWR))  # the kernel lets it open; writes are refused
        r, w = os.pipe()
        kept += [r, w]
        for fd in kept[:3]:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", entry.offset)
            os.write(w, b"x")
            with pytest.raises(PermissionError):
                os.splice(r, fd, 1, offset_dst=entry.offset)
            assert os.read(r, 1) == b"x"
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            with pytest.raises(PermissionError):
                os.posix_fallocate(fd, 0, size + 4096)
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
            try:
                assert libc.mprotect(addr, size, mmap.PROT_READ | mmap.PROT_WRITE) == -1
                assert ctypes.get_errno() == errno.EACCES
            finally:
                libc.munmap(addr, size)
    finally:
        ch.close()
        for fd in kept:
            os.close(fd)
    async with await WCacheClient(daemon.socket).fetch(key) as weights:
        assert torch.equal(weights["w"], torch.arange(4, dtype=torch.float32))


@pytest.mark.parametrize("holder", ["child-mapping", "vmsplice"])
async def test_a_commit_is_refused_while_the_engine_can_still_reach_the_pages(
    daemon: DaemonProc, ckpt: Path, holder: str
) -> None:
    """The engine unmapped, but another process still maps the slab writable (a child it started: a fork's
    inherited mapping is the same to the kernel), or the slab's pages sit in a pipe it vmspliced them into: the
    seal cannot be added, so COMMIT is refused (IN_USE), nothing is served under the key and the key takes the
    next deposit."""
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    ch, _ = await connect(daemon.socket, software="t", name=holder)
    child: subprocess.Popen[str] | None = None
    pipe: tuple[int, int] | None = None
    try:
        slab, fds = await _four_floats(ch, key)
        size = slab.slabs[0].size
        if holder == "child-mapping":
            child = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"import mmap, sys; m = mmap.mmap({fds[0]}, {size}, mmap.MAP_SHARED, "
                    "mmap.PROT_READ | mmap.PROT_WRITE); print('mapped', flush=True); sys.stdin.read()",
                ],
                pass_fds=fds,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert child.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
            assert line.strip() == "mapped"
            _write_four_floats(fds[0], slab)
        else:

            class IoVec(ctypes.Structure):
                _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

            mm = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            pipe = os.pipe()
            iov = IoVec(ctypes.addressof(ctypes.c_char.from_buffer(mm)), 4096)
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.vmsplice(pipe[1], ctypes.byref(iov), 1, 0) == 4096, os.strerror(ctypes.get_errno())
            del iov
            mm.close()  # unmapped: only the pipe holds the pages
        os.close(fds[0])
        await ch.send(Commit(id=2, deposit=slab.deposit))
        with pytest.raises(InUseError):
            await expect(ch)
    finally:
        ch.close()
        if child is not None:
            child.kill()
            child.wait(30)
            for f in (child.stdin, child.stdout):
                if f is not None:
                    f.close()
        if pipe is not None:
            os.close(pipe[0])
            os.close(pipe[1])
    assert key.short() not in await models(daemon)
    await WCacheClient(daemon.socket).deposit(key, {"w": torch.ones(4)})
    assert (await models(daemon))[key.short()] == "deposit"


@pytest.mark.parametrize("step", STEPS)
async def test_engine_killed_mid_deposit_leaves_nothing(
    daemon: DaemonProc, ckpt: Path, tmp_path: Path, step: str
) -> None:
    base = WeightCacheKey.from_checkpoint(ckpt)
    key = recipe_key(base)
    before = fd_count(daemon.pid)  # no connection yet
    marker = tmp_path / "at-step"
    engine = subprocess.Popen(
        [sys.executable, "-m", "tests.server.deposit_engine", str(daemon.socket), step, str(marker)]
        + [json.dumps(base.to_wire())],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    try:
        await wait_for(lambda: marker.exists() or engine.poll() is not None, 60, f"engine reached {step}")
        assert engine.poll() is None, f"the engine exited with {engine.returncode} before {step}"
        os.kill(engine.pid, signal.SIGKILL)
        assert engine.wait(30) == -signal.SIGKILL
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    assert key.short() not in await models(daemon)
    await wait_for(lambda: fd_count(daemon.pid) == before, why=f"the daemon's fds back to {before} after {step}")
    # and the key is free for the next engine: a deposit now succeeds
    await WCacheClient(daemon.socket).deposit(key, tensors())
    assert (await models(daemon))[key.short()] == "deposit"


@pytest.mark.parametrize("restart", ["tier", "keeper"])
async def test_a_daemon_killed_mid_deposit_serves_none_of_it_after_a_restart(
    daemon_factory: Callable[..., DaemonProc],
    ckpt: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    restart: str,
) -> None:
    """The daemon is SIGKILLed while an engine maps its deposit slab, half written; restarted with its host
    tier or on its keeper (what outlives a daemon), it serves the checkpoint and nothing under the recipe key:
    an uncommitted deposit is never saved to the tier nor kept (the engine, still alive, maps the orphaned
    slab)."""
    extra = {
        "tier": ("--host-tier", str(1 << 30), "--host-tier-dir", str(tmp_path / "tier")),
        "keeper": ("--keeper",),
    }[restart]
    if restart == "keeper":
        request.getfixturevalue("keeper")
    first = daemon_factory(ckpt, *extra)
    base = WeightCacheKey.from_checkpoint(ckpt)
    marker = tmp_path / "at-step"
    engine = subprocess.Popen(
        [sys.executable, "-m", "tests.server.deposit_engine", str(first.socket), "half_written", str(marker)]
        + [json.dumps(base.to_wire())],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    try:
        await wait_for(lambda: marker.exists() or engine.poll() is not None, 60, "engine reached half_written")
        assert engine.poll() is None, f"the engine exited with {engine.returncode}"
        first.stop(signal.SIGKILL)
        second = daemon_factory(ckpt, *extra)
        assert set(await models(second)) == {"ckpt"}
        with pytest.raises((KeyMismatchError, NotFoundError)):
            async with await WCacheClient(second.socket).fetch(recipe_key(base), timeout=15):
                pass
    finally:
        engine.kill()
        engine.wait(30)


async def test_deposit_over_budget_is_refused_before_allocation(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path
) -> None:
    base = WeightCacheKey.from_checkpoint(ckpt)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    daemon = daemon_factory(ckpt, "--memory-budget", str(size + (1 << 20)))
    client = WCacheClient(daemon.socket)
    before = fd_count(daemon.pid)  # no connection yet
    async with await client.fetch(base):  # the checkpoint is leased: it cannot make room
        with pytest.raises(OutOfMemoryError) as info:
            await client.deposit(recipe_key(base), {"big": torch.zeros(1 << 20, dtype=torch.float32)})
        assert info.value.details["needed"] >= 4 << 20
    assert set(await models(daemon)) == {"ckpt"}
    await wait_for(lambda: fd_count(daemon.pid) == before, why="no slab left open")


async def test_deposit_larger_than_memory_is_refused_before_allocation(daemon: DaemonProc, ckpt: Path) -> None:
    """No budget: the host's memory (or the daemon's cgroup) refuses a 128 TiB table before a byte is allocated."""
    ch, _ = await connect(daemon.socket, software="t", name="huge")
    try:
        key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
        await ch.send(Deposit(id=1, key=key.to_wire(), tensors=(DepositTensor("w", "uint8", (1 << 37, 1024)),)))
        with pytest.raises(OutOfMemoryError):
            await expect(ch)
    finally:
        ch.close()
    assert set(await models(daemon)) == {"ckpt"}


def _fatal_reply(daemon: DaemonProc, bad: dict[str, object]) -> ErrorFrame:
    """Send the wire map ``bad`` after HELLO on a raw socket (this side's encoder checks no rule) and return
    the daemon's last frame before it closed the connection: its fatal ERROR."""
    import socket as socketlib

    from wcache.proto import Connection, Hello, Role, decode_body, decode_frame, pack_frame

    with socketlib.socket(socketlib.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(daemon.socket))
        conn = Connection(Role.CLIENT)
        s.sendall(conn.send(Hello(versions=(2,))))
        data = b""
        while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):  # HELLO_OK first
            data += s.recv(65536)
        s.sendall(pack_frame(bad))
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    frames = []
    while data:
        n = int.from_bytes(data[:4], "big")
        frames.append(decode_frame(decode_body(data[4 : 4 + n])))
        data = data[4 + n :]
    err = frames[-1]
    assert isinstance(err, ErrorFrame) and err.fatal, frames
    return err


async def _ckpt_bytes(daemon: DaemonProc) -> int:
    (m,) = (await WCacheClient(daemon.socket).status()).models
    return m.bytes


def _budget_for_one(daemon_factory: Callable[..., DaemonProc], ckpt: Path) -> tuple[DaemonProc, int]:
    """A daemon serving ``ckpt`` with a budget 1 MiB over its slab, and the slab's bytes: a deposit of that
    size fits only once the checkpoint is evicted."""
    from wcache.server.load import planned_bytes

    size = planned_bytes(RankSpec(ckpt))[1]
    return daemon_factory(ckpt, "--memory-budget", str(size + (1 << 20))), size


async def _open_deposit(ch: Channel[Any], key: RecipeKey, nbytes: int) -> DepositSlab:
    """DEPOSIT one uint8 tensor of ``nbytes`` on ``ch``; its writable slab's fd is closed at once."""
    await ch.send(
        Deposit(id=ch.conn.next_request_id(), key=key.to_wire(), tensors=(DepositTensor("w", "uint8", (nbytes,)),))
    )
    slab, fds = await expect(ch)
    assert isinstance(slab, DepositSlab)
    for fd in fds:
        os.close(fd)
    return slab


async def test_an_uncommitted_deposit_evicts_nothing(daemon_factory: Callable[..., DaemonProc], ckpt: Path) -> None:
    """A deposit in progress is a promise, not a model (docs/protocol.md §4.13): admitted against room that
    evicting would free, it evicts nothing until its COMMIT. An engine that never commits leaves the served
    checkpoint served (it used to be evicted at DEPOSIT, and never came back); the one that commits evicts it
    then (DEPOSITED.evicted)."""
    base = WeightCacheKey.from_checkpoint(ckpt)
    daemon, size = _budget_for_one(daemon_factory, ckpt)
    client = WCacheClient(daemon.socket)
    before = fd_count(daemon.pid)
    ch, _ = await connect(daemon.socket, software="t", name="promise")
    try:
        await _open_deposit(ch, recipe_key(base), size)  # fits only once the checkpoint goes
        assert await models(daemon) == {"ckpt": "disk"}
        async with await client.fetch(base) as w:  # still served, mapped, bit for bit
            assert torch.equal(w["model.norm.weight"], load_from_disk(ckpt)["model.norm.weight"])
    finally:
        ch.close()  # abandoned: never committed
    await wait_for(lambda: fd_count(daemon.pid) == before, why="the abandoned deposit's slab closed")
    assert await models(daemon) == {"ckpt": "disk"}
    done = await client.deposit(recipe_key(base), {"w": torch.zeros(size, dtype=torch.uint8)})
    assert done.evicted == (base.to_wire(),)
    assert set(await models(daemon)) == {recipe_key(base).short()}


async def test_a_commit_whose_room_got_leased_meanwhile_is_refused_and_evicts_nothing(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path
) -> None:
    """Admitted against the room evicting the idle checkpoint would free; an engine leases the checkpoint
    before the COMMIT: OUT_OF_MEMORY for the COMMIT, the deposit dropped, the checkpoint still served."""
    base = WeightCacheKey.from_checkpoint(ckpt)
    daemon, size = _budget_for_one(daemon_factory, ckpt)
    before = fd_count(daemon.pid)
    ch, _ = await connect(daemon.socket, software="t", name="late")
    try:
        slab = await _open_deposit(ch, recipe_key(base), size)
        async with await WCacheClient(daemon.socket).fetch(base):
            await ch.send(Commit(id=ch.conn.next_request_id(), deposit=slab.deposit))
            with pytest.raises(OutOfMemoryError) as info:
                await expect(ch)
            assert info.value.details["pinned"] == [base.short()]
    finally:
        ch.close()
    assert await models(daemon) == {"ckpt": "disk"}
    await wait_for(lambda: fd_count(daemon.pid) == before, why="the dropped deposit's slab closed")


async def test_a_deposit_the_memory_cannot_hold_is_refused_before_anything_is_evicted(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path
) -> None:
    """A budget larger than the host: a deposit that fits the budget only once the checkpoint is evicted, and
    the host's memory not at all, is refused (OUT_OF_MEMORY, naming the host) with the checkpoint still
    served (it used to be evicted first, unlogged, and the DEPOSIT refused after)."""
    budget = 1 << 46  # 64 TiB
    daemon = daemon_factory(ckpt, "--memory-budget", str(budget))
    size = await _ckpt_bytes(daemon)
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    ch, _ = await connect(daemon.socket, software="t", name="huge")
    try:
        wire = DepositTensor("w", "uint8", (2, (budget - size // 2) // 2))
        await ch.send(Deposit(id=ch.conn.next_request_id(), key=key.to_wire(), tensors=(wire,)))
        with pytest.raises(OutOfMemoryError) as info:
            await expect(ch)
        assert "host" in info.value.details["where"] or "cgroup" in info.value.details["where"]
    finally:
        ch.close()
    assert await models(daemon) == {"ckpt": "disk"}


def test_deposits_in_progress_count_in_every_room_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared memory is counted as used only once written, so three DEPOSITs of 0.8 x the free memory were
    all accepted: every host room check (deposits and loads) deducts what slabs being written still lack."""
    from wcache.server.backends import host

    room = 100 << 20
    monkeypatch.setattr(host, "memory_room", lambda: host.MemoryRoom("a test room", room, 0))
    store = Store(host.HostBackend())
    try:
        first = Deposit(id=1, key=_one_tensor_deposit().key, tensors=(DepositTensor("w", "uint8", (80 << 20,)),))
        reply, fds, _ = store.begin_deposit(1, 1, first)
        with pytest.raises(OutOfMemoryError) as info:
            store.begin_deposit(
                2,
                1,
                Deposit(id=1, key=recipe_key(WeightCacheKey("g", "A", 1, 0, "bf16")).to_wire(), tensors=first.tensors),
            )
        assert info.value.details["promised"] == 80 << 20
        with pytest.raises(OutOfMemoryError):  # a load, too
            store.backend.allocate(30 << 20)
        store.drop_connection(1)  # abandoned: its promise is gone
        store.backend.allocate(30 << 20).close()
    finally:
        store.close()


@pytest.mark.parametrize(
    "seals",
    [fcntl.F_SEAL_SEAL, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL],
    ids=["seal-seal", "every-seal"],
)
async def test_a_slab_the_engine_sealed_itself_is_refused_at_commit(daemon: DaemonProc, ckpt: Path, seals: int) -> None:
    """An engine that adds F_SEAL_SEAL itself: the daemon cannot add its own seals. The COMMIT gets a fatal
    PROTOCOL_ERROR saying so (it used to get nothing: a PermissionError traceback and a dropped
    connection); the deposit is dropped, its slab freed, and the key takes a proper deposit after."""
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    before = fd_count(daemon.pid)
    ch, _ = await connect(daemon.socket, software="t", name="sealer")
    try:
        slab, fds = await _four_floats(ch, key)
        fcntl.fcntl(fds[0], fcntl.F_ADD_SEALS, seals)
        os.close(fds[0])
        await ch.send(Commit(id=2, deposit=slab.deposit))
        with pytest.raises(ProtocolError) as info:
            await expect(ch)
        assert "F_SEAL_SEAL" in info.value.message and info.value.details == {"frame": "COMMIT", "field": "deposit"}
    finally:
        ch.close()
    assert set(await models(daemon)) == {"ckpt"}
    await wait_for(lambda: fd_count(daemon.pid) == before, why="the refused slab's fd closed")
    await WCacheClient(daemon.socket).deposit(key, tensors())
    assert (await models(daemon))[key.short()] == "deposit"


@pytest.mark.parametrize(
    ("tensors_", "aliases", "what"),
    [
        ((DepositTensor("w", "float32", (4,)), DepositTensor("w", "float32", (2,))), {}, "listed twice"),
        ((DepositTensor("w", "float32", (4,)),), {"w": "w"}, "not a new name"),  # overlapping names
        ((DepositTensor("w", "float32", (4,)),), {"tied": "missing"}, "not a new name"),
        ((DepositTensor("w", "float32", (1 << 47, 4)),), {}, "at most"),  # too big to lay out
        # 0 bytes, but the contiguous strides of the layout reach 2**48: no client's decoder takes that STATE
        ((DepositTensor("w", "uint8", (0, 1 << 24, 1 << 24)),), {}, "strides: entries must be below 2**48"),
        # strides past 2**64: the table's uint64 columns cannot even hold them (was a fatal INTERNAL)
        ((DepositTensor("w", "uint8", (0, 1 << 40, 1 << 40)),), {}, "does not fit its wire field"),
    ],
)
async def test_malformed_table_is_refused(
    daemon: DaemonProc, ckpt: Path, tensors_: tuple[DepositTensor, ...], aliases: dict[str, str], what: str
) -> None:
    """Bad tables never reach the store: a fatal PROTOCOL_ERROR naming the DEPOSIT field, nothing allocated.
    That includes every table the daemon's own clients would refuse to map: the daemon runs the STATE it
    would serve through the clients' decoder at DEPOSIT (docs/protocol.md §4.13), so nothing is committed
    that no engine can fetch (or that a later takeover cannot hand over)."""
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    err = _fatal_reply(daemon, Deposit(id=1, key=key.to_wire(), tensors=tensors_, aliases=aliases).to_wire())
    assert err.code == 1 and what in err.message, err
    assert err.details.get("frame") == "DEPOSIT", err
    assert set(await models(daemon)) == {"ckpt"}


async def test_a_key_over_its_bounds_is_refused(daemon: DaemonProc, ckpt: Path) -> None:
    """A recipe key of 25,000 fields fits the 1 MiB request frame, and every fetch once compared it field by
    field: keys are bounded (64 fields, 16,384 characters, docs/protocol.md §7) in every frame."""
    key = {**recipe_key(WeightCacheKey.from_checkpoint(ckpt)).to_wire(), **{f"f{i}": i for i in range(25_000)}}
    wire = Deposit(id=1, key=key, tensors=(DepositTensor("w", "int8", (1,)),)).to_wire()
    err = _fatal_reply(daemon, wire)
    assert err.code == 1 and err.details == {"frame": "DEPOSIT", "field": "key"} and "at most 64 fields" in err.message
    assert set(await models(daemon)) == {"ckpt"}


async def test_a_deposit_over_the_daemons_request_limit_is_refused_before_it_is_sent(
    daemon: DaemonProc, ckpt: Path
) -> None:
    """30,000 tensors (a large MoE model's count) make a DEPOSIT frame of about 1.8 MB, over the 1 MiB the
    daemon announces in HELLO_OK: the client refuses it naming both sizes, before anything is sent, with a
    WCacheError (the engines' fallback), and the daemon serves on. It was sent: the daemon closed the
    connection on its length prefix and the engine got CacheUnavailableError ('Broken pipe'), as if no daemon
    ran."""
    base = WeightCacheKey.from_checkpoint(ckpt)
    ts = {f"model.layers.{i // 512}.mlp.experts.{i % 512}.w": torch.zeros(1) for i in range(30_000)}
    with pytest.raises(LocalProtocolError, match=r"DEPOSIT is \d+ bytes, over the 1048576 bytes"):
        await WCacheClient(daemon.socket).deposit(recipe_key(base), ts)
    assert set(await models(daemon)) == {"ckpt"}


def test_bad_dtype_is_refused_by_the_client_and_the_decoder() -> None:
    with pytest.raises(ValueError, match="dtype"):
        asyncio.run(
            WCacheClient("/nonexistent.sock").deposit(
                RecipeKey.of(WeightCacheKey("f", "A", 1, 0, "bfloat16"), engine="e"),
                {"c": torch.zeros(2, dtype=torch.complex64)},
            )
        )
    wire = Deposit(
        id=1,
        key=RecipeKey.of(WeightCacheKey("f", "A", 1, 0, "bfloat16"), engine="e").to_wire(),
        tensors=(DepositTensor("w", "float32", (4,)),),
    ).to_wire()
    wire["tensors"][0]["dtype"] = "complex64"
    with pytest.raises(RemoteProtocolError) as info:
        Deposit.from_wire(wire)
    assert info.value.details == {"frame": "DepositTensor", "field": "dtype"}


async def test_takeover_keeps_a_deposit_under_its_recipe_key(daemon: DaemonProc, ckpt: Path, socket_dir: Path) -> None:
    """A new daemon adopts a deposit as a deposit: under its recipe key (not the checkpoint's plain key) and
    with its buffers — else the checkpoint's key would map post-processed bytes. STATUS says how this daemon
    got it (origin "takeover")."""
    from wcache.server.process import spawn_daemon

    base = WeightCacheKey.from_checkpoint(ckpt)
    key = recipe_key(base)
    ts = tensors()
    await WCacheClient(daemon.socket).deposit(key, ts, kinds={"rotary.inv_freq": "buffer"})
    new = spawn_daemon(None, socket_dir, takeover=daemon.socket, timeout=60)
    try:
        assert daemon.proc.wait(30) == 0
        assert (await models(new))[key.short()] == "takeover"
        async with await WCacheClient(new.socket).fetch(key) as w:
            assert w.buffers == {"rotary.inv_freq"}
            assert all(torch.equal(bits(w[n]), bits(t)) for n, t in ts.items())
        async with await WCacheClient(new.socket).fetch(base) as raw:
            assert "layers.0.weight" not in raw and "model.norm.weight" in raw
    finally:
        new.stop()


def _one_tensor_deposit() -> Deposit:
    key = RecipeKey.of(WeightCacheKey("f", "A", 1, 0, "bfloat16"), engine="e")
    return Deposit(id=1, key=key.to_wire(), tensors=(DepositTensor("w", "float32", (4,)),))


def _store_that_must_not_evict(backend: object) -> Store:
    store = Store(cast("Backend", backend), budget=1 << 20)

    def make_room(nbytes: int) -> list[object]:
        raise AssertionError("a refused deposit may not evict anything")

    store.make_room = make_room  # type: ignore[method-assign,assignment]
    return store


def test_a_backend_without_writable_slabs_refuses_deposits() -> None:
    """A backend with no deposit path: UNSUPPORTED_PLATFORM, naming what to do, with nothing allocated."""

    class NoDeposits:
        name = "tpu"
        device = DeviceInfo(kind="tpu")

        def allocate(self, nbytes: int) -> object:
            raise AssertionError("nothing may be allocated")

    store = _store_that_must_not_evict(NoDeposits())
    with pytest.raises(UnsupportedPlatformError, match="cannot take deposits"):
        store.begin_deposit(1, 1, _one_tensor_deposit())
    assert store.deposits == {} and store.pending_bytes == 0


def test_cuda_ipc_export_refuses_deposits_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """--cuda-export ipc: legacy IPC slabs cannot be handed out writable, so a DEPOSIT is refused
    (UNSUPPORTED_PLATFORM, naming --cuda-export vmm) before anything is evicted or allocated."""
    from wcache.server.backends import cuda as cuda_backend

    def no_slab(*args: object) -> object:
        raise AssertionError("nothing may be allocated")

    monkeypatch.setattr(cuda_backend, "CudaDepositSlab", no_slab)
    monkeypatch.setattr(cuda_backend, "CudaIpcSlab", no_slab)
    store = _store_that_must_not_evict(cuda_backend.CudaBackend(0, export="ipc"))
    with pytest.raises(UnsupportedPlatformError, match="--cuda-export vmm") as info:
        store.begin_deposit(1, 1, _one_tensor_deposit())
    assert info.value.details == {"backend": "cuda", "export": "ipc"}
    assert store.deposits == {} and store.pending_bytes == 0


def test_cuda_deposit_larger_than_free_gpu_memory_is_refused_before_allocation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from wcache.server.backends import cuda as cuda_backend

    def no_slab(*args: object) -> object:
        raise AssertionError("nothing may be allocated")

    monkeypatch.setattr(cuda_backend, "CudaDepositSlab", no_slab)
    backend = cuda_backend.CudaBackend(0, export="vmm")
    monkeypatch.setattr(backend, "memory_info", lambda: (100, 1 << 30))
    store = Store(cast("Backend", backend))
    with pytest.raises(OutOfMemoryError, match="does not fit cuda:0") as info:
        store.begin_deposit(1, 1, _one_tensor_deposit())
    assert info.value.details["free"] == 100
    assert store.deposits == {} and store.pending_bytes == 0


def _deposit_slab(kind: str, ts: dict[str, torch.Tensor]) -> DepositSlab:
    req = Deposit(
        id=1,
        key=RecipeKey.of(WeightCacheKey("f", "A", 1, 0, "bfloat16"), engine="e").to_wire(),
        tensors=tuple(DepositTensor(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in ts.items()),
    )
    table, size, _ = deposit_layout(req)
    fd = 0 if kind != "cuda_ipc" else -1
    desc = SlabDescriptor(size=size, kind=kind, fd=fd, handle=b"\0" * 64 if fd < 0 else b"", device_uuid="GPU-x")
    return DepositSlab(id=1, deposit=5, slabs=(desc,), tensors=table)


def test_client_writes_a_cuda_vmm_deposit_through_the_cuda_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's one deposit writer dispatches on the slab kind: a cuda_vmm slab goes to
    wcache.client.cuda.write_vmm_deposit with every tensor's bytes at the daemon's offsets."""
    from wcache.client import cuda, mapping

    ts = tensors()
    slab = _deposit_slab("cuda_vmm", ts)
    got: list[tuple[int, torch.Tensor]] = []

    def fake(desc: SlabDescriptor, fd: int, sources: Iterable[tuple[int, torch.Tensor]]) -> None:
        assert desc is slab.slabs[0] and fd == 77
        got.extend(sources)

    monkeypatch.setattr(cuda, "write_vmm_deposit", fake)
    mapping.write_deposit(slab, 77, ts)
    assert [off for off, _ in got] == [e.offset for e in slab.tensors]
    for (_, b), e in zip(got, slab.tensors, strict=True):
        assert torch.equal(b, bits(ts[e.name])), e.name


def test_client_refuses_a_deposit_slab_it_cannot_write(tmp_path: Path) -> None:
    from wcache.client import mapping

    ts = tensors()
    with pytest.raises(RemoteProtocolError, match="cuda_ipc"):
        mapping.write_deposit(_deposit_slab("cuda_ipc", ts), -1, ts)
    # a table that disagrees with the engine's tensors (shape) is refused before any byte is written
    slab = _deposit_slab("memfd", {**ts, "rotary.inv_freq": torch.zeros(8)})
    fd = os.memfd_create("t")
    try:
        os.ftruncate(fd, slab.slabs[0].size)
        with pytest.raises(RemoteProtocolError, match=r"rotary\.inv_freq"):
            mapping.write_deposit(slab, fd, ts)
    finally:
        os.close(fd)


async def test_deposit_module_then_attach_to_a_meta_built_module(daemon: DaemonProc, ckpt: Path) -> None:
    """wcache.nn.deposit_module: parameters and buffers by module path, a tie deposited once (alias); a module
    built on meta then attaches the fetched tensors zero-copy and computes what the first one did."""
    from torch import nn

    from wcache.nn import attach, deposit_module, empty_parameters

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.embed.weight  # tied
            self.register_buffer("scale", torch.full((8,), 0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(self.embed(x) * self.get_buffer("scale"))
            return out

    torch.manual_seed(0)
    first = Tiny().requires_grad_(False)
    with torch.no_grad():
        first.get_buffer("scale").mul_(3)  # "post-processing": a buffer the init would not recreate
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt), postprocess=1)
    client = WCacheClient(daemon.socket)
    done = await deposit_module(first, key, client)
    assert done.tensors == 2  # embed.weight (head.weight its alias) and scale
    with empty_parameters():
        second = Tiny()
    async with await client.fetch(key) as w:
        assert w.aliases == {"head.weight": "embed.weight"} and w.buffers == {"scale"}
        attach(second, w)
        assert second.head.weight is second.embed.weight
        x = torch.arange(4)
        assert torch.equal(second(x), first(x))


async def test_deposits_in_progress_per_connection_are_limited(daemon: DaemonProc, ckpt: Path) -> None:
    from wcache.errors import LimitExceededError

    base = WeightCacheKey.from_checkpoint(ckpt)
    ch, _ = await connect(daemon.socket, software="t", name="many")
    try:
        for i in range(4):
            k = recipe_key(base, postprocess=i)
            await ch.send(
                Deposit(id=ch.conn.next_request_id(), key=k.to_wire(), tensors=(DepositTensor("w", "int8", (1,)),))
            )
            _, fds = await expect(ch)
            os.close(fds[0])
        k = recipe_key(base, postprocess=99)
        await ch.send(
            Deposit(id=ch.conn.next_request_id(), key=k.to_wire(), tensors=(DepositTensor("w", "int8", (1,)),))
        )
        with pytest.raises(LimitExceededError):
            await expect(ch)
    finally:
        ch.close()
    assert set(await models(daemon)) == {"ckpt"}


async def test_an_absent_recipe_on_a_load_on_demand_daemon_loads_nothing(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path
) -> None:
    """A recipe key is deposited, never loaded: asking a --load-on-demand daemon for one it lacks answers
    KEY_MISMATCH at once and loads no checkpoint variant (it used to load the variant the recipe's checkpoint
    fields name, e.g. another dtype, before answering)."""
    d = daemon_factory(ckpt, "--load-on-demand")
    before = [dict(m.key) for m in (await WCacheClient(d.socket).status()).models]
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt, dtype="float32"))  # a variant it does not hold
    with pytest.raises(KeyMismatchError):
        await WCacheClient(d.socket).fetch(key)
    assert [dict(m.key) for m in (await WCacheClient(d.socket).status()).models] == before


async def test_deposits_in_progress_on_the_daemon_are_limited(daemon: DaemonProc, ckpt: Path) -> None:
    """Beside 4 per connection, the daemon holds at most MAX_DEPOSITS deposits in progress in all (each
    holds a descriptor and promised memory): the next is LIMIT_EXCEEDED, not fatal, until one ends."""
    from wcache.errors import LimitExceededError
    from wcache.server.store import MAX_DEPOSITS

    base = WeightCacheKey.from_checkpoint(ckpt)
    chans = [(await connect(daemon.socket, software="t", name=f"many-{i}"))[0] for i in range(MAX_DEPOSITS // 4 + 1)]
    try:
        for i in range(MAX_DEPOSITS):
            await _open_deposit(chans[i // 4], recipe_key(base, postprocess=i), 1)
        with pytest.raises(LimitExceededError) as info:
            await _open_deposit(chans[-1], recipe_key(base, postprocess=MAX_DEPOSITS), 1)
        assert info.value.details == {"deposits": MAX_DEPOSITS, "limit": MAX_DEPOSITS}
        held = fd_count(daemon.pid)
        chans[0].close()  # its 4 deposits are abandoned: room for more
        await wait_for(lambda: fd_count(daemon.pid) <= held - 5, why="4 slabs and a connection closed")
        await _open_deposit(chans[-1], recipe_key(base, postprocess=MAX_DEPOSITS), 1)
    finally:
        for ch in chans:
            ch.close()


def test_the_room_made_for_a_load_is_held_until_it_ends() -> None:
    """A PRELOAD makes room, then loads in a worker thread while the daemon serves: a DEPOSIT meanwhile saw the room
    as free and took it, and the daemon ended over its --memory-budget (34 MB resident against 26). The load's
    bytes now count against the budget until it ends (``Store.loading``), in every room check."""
    from wcache.server.backends import host

    store = Store(host.HostBackend(), budget=1 << 20)
    try:
        big = Deposit(id=1, key=_one_tensor_deposit().key, tensors=(DepositTensor("w", "uint8", (600 << 10,)),))
        with store.loading(600 << 10) as evicted:
            assert evicted == [] and store.loading_bytes == 600 << 10
            with pytest.raises(OutOfMemoryError) as info:
                store.begin_deposit(1, 1, big)  # the rest of the budget, 424 KiB, does not hold 600 KiB
            assert info.value.details["loading"] == 600 << 10 and store.deposits == {}
            with pytest.raises(OutOfMemoryError):
                store.make_room(600 << 10)  # nor another load
        assert store.loading_bytes == 0  # the load ended (failed here: nothing added): its room is free again
        store.begin_deposit(1, 1, big)
        assert store.pending_bytes == 600 << 10
    finally:
        store.close()


def test_a_held_model_is_not_evicted_and_an_evicted_one_counts_until_freed(ckpt: Path) -> None:
    """A model a reader holds (a peer's fill, a host-tier save) frees nothing when evicted: its slab stays until
    the reader is done. A PRELOAD evicted such a model and the daemon held 20 MB of slabs against a 15 MB budget,
    counting 10. Room is no longer made by evicting a held model; one evicted while held (EVICT) counts against the
    budget until its last reader lets go."""
    from wcache.server.backends.host import HostBackend
    from wcache.server.load import load_model

    m = load_model(RankSpec(ckpt), backend=HostBackend(), threads=2)
    size = m.slab_bytes
    store = Store(HostBackend(), [m], budget=size + size // 2)
    try:
        assert m.hold()  # a peer's fill reads it
        with pytest.raises(OutOfMemoryError) as info:
            store.make_room(size)  # evicting it would free nothing now
        assert store.models and info.value.details["pinned"] == [m.key.short()]
        store.evict(m.key.to_wire())  # an explicit EVICT: gone from the table, its bytes still held
        assert not store.models and store.lingering_bytes == size
        with pytest.raises(OutOfMemoryError):
            store.make_room(size)
        m.release_hold()  # the reader is done: the slab is freed, and its bytes with it
        assert store.lingering_bytes == 0 and m.slabs == []
        assert store.make_room(size) == []
    finally:
        store.close()
