"""Connection-level resource limits (docs/reliability.md, connection limits): memory before HELLO, a read budget
across connections, peers that never read their replies, lease bookkeeping, idle peers at the cap."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProc
from tests.server.test_faults import _raw, _read_reply
from wcache import WCacheClient, WeightCacheKey
from wcache.channel import Channel, ReadBudget
from wcache.errors import FrameTooLargeError, LimitExceededError
from wcache.plan.key import RankSpec
from wcache.proto import PROTOCOL_VERSION, Connection, GetState, Hello, Role, pack_frame
from wcache.proto.codec import MAX_HANDSHAKE_FRAME
from wcache.server.backends.host import HostBackend
from wcache.server.load import load_model
from wcache.server.process import DaemonProcess
from wcache.server.store import Store, split_descriptors

HELLO = pack_frame(Hello(versions=(PROTOCOL_VERSION,)).to_wire())


# ------------------------------------------------------------------ class 1: memory before and after HELLO
async def test_big_frame_before_hello_refused_before_its_body(daemon: DaemonProc, ckpt: Path) -> None:
    """A 1 MiB length prefix before HELLO is FRAME_TOO_LARGE at once, with no byte of the body sent (the
    daemon used to wait for up to 64 MiB from anyone who connected)."""
    s = _raw(daemon.socket, 20)
    try:
        s.sendall(struct.pack(">I", 1 << 20) + b"\x80")
        reply = await asyncio.to_thread(_read_reply, s)
        assert reply is not None and reply["code"] == 2 and reply["fatal"] is True
        assert reply["details"] == {"size": 1 << 20, "max_size": MAX_HANDSHAKE_FRAME}
        assert "before the handshake" in reply["message"]
    finally:
        s.close()
    async with await WCacheClient(daemon.socket).fetch(WeightCacheKey.from_checkpoint(ckpt)) as w:
        assert len(w) > 0


async def test_request_above_the_request_limit_refused(daemon: DaemonProc) -> None:
    """After HELLO no request comes near 1 MiB: a 60 MiB length is refused before its body, and HELLO_OK
    announces the limit."""
    s = _raw(daemon.socket, 20)
    try:
        s.sendall(HELLO)
        ok = await asyncio.to_thread(_read_reply, s)
        assert ok is not None and ok["type"] == "HELLO_OK" and ok["max_frame_size"] == 1 << 20
        s.sendall(struct.pack(">I", 60 << 20) + b"\x80" * 1000)
        reply = await asyncio.to_thread(_read_reply, s)
        assert reply is not None and reply["code"] == 2 and reply["details"]["size"] == 60 << 20
    finally:
        s.close()


async def test_read_budget_refuses_the_frame_that_does_not_fit() -> None:
    """Claims are made from the length prefix, before the body; the connection that does not fit gets
    FrameTooLargeError, the others keep theirs, and a closed channel gives its claim back. Small frames
    (every request an engine sends) always fit."""
    budget = ReadBudget(3 << 20)
    pairs = [socket.socketpair() for _ in range(3)]
    chans = [
        Channel(
            a,
            Connection(Role.SERVER, max_frame_size=4 << 20, max_handshake_frame=8 << 20),
            budget=budget,
        )
        for a, _ in pairs
    ]
    try:
        for _, b in pairs[:2]:
            b.sendall(struct.pack(">I", 1536 << 10) + b"\x80" * 100)  # 1.5 MiB announced, 100 bytes sent
        tasks = [asyncio.ensure_future(ch.receive()) for ch in chans[:2]]
        deadline = time.monotonic() + 10
        while budget.held < 3 << 20:
            assert time.monotonic() < deadline, budget.held
            await asyncio.sleep(0.01)
        pairs[2][1].sendall(struct.pack(">I", 1 << 20) + b"\x80")
        with pytest.raises(FrameTooLargeError, match="retry later"):
            await asyncio.wait_for(chans[2].receive(), 10)
        assert budget.held == 3 << 20 and budget.peers == 2
        small = socket.socketpair()
        sch = Channel(small[0], Connection(Role.SERVER), budget=budget)
        small[1].sendall(HELLO)
        frame, _ = await asyncio.wait_for(sch.receive(), 10)
        assert isinstance(frame, Hello)
        sch.close()
        small[1].close()
        chans[0].close()
        assert budget.held == 1536 << 10
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for ch in chans:
            ch.close()
        for _, b in pairs:
            b.close()
    assert budget.held == 0 and budget.peers == 0


# ------------------------------------------------------------------ class 4: peers that never read
_PEERS = """
import asyncio, select, socket, struct, sys, time
from wcache import WCacheClient, WeightCacheKey
from wcache.proto import Connection, GetState, Hello, Role, PROTOCOL_VERSION

sock_path, ckpt = sys.argv[1], sys.argv[2]
key = WeightCacheKey.from_checkpoint(ckpt)
conn = Connection(Role.CLIENT)
slow = socket.socket(socket.AF_UNIX)
slow.connect(sock_path)
slow.sendall(conn.send(Hello(versions=(PROTOCOL_VERSION,))))
head = slow.recv(4, socket.MSG_WAITALL)
conn.receive_data(head + slow.recv(struct.unpack(">I", head)[0], socket.MSG_WAITALL))
assert [f.TYPE for f in conn.events()] == ["HELLO_OK"]
for i in range(1, 61):  # and never read the STATEs (each carries a descriptor)
    slow.sendall(conn.send(GetState(id=i, key=key.to_wire())))
time.sleep(0.5)  # the daemon answers what it can meanwhile; nothing below depends on how much

async def main() -> None:
    for _ in range(3):
        async with await WCacheClient(sock_path, timeout=30).fetch(key) as w:
            assert len(w) > 0
    print("served", flush=True)

asyncio.run(main())
poll = select.poll()
poll.register(slow, select.POLLRDHUP)
assert poll.poll(60_000), "the daemon never closed the peer that does not read"
slow.settimeout(10)
try:
    while data := slow.recv(1 << 16):  # what was queued for it before the daemon gave up on it
        conn.receive_data(data)
except ConnectionResetError:  # closed with requests of ours still unread in its queue: a reset after the data
    pass
states = [f for f in conn.events() if f.TYPE == "STATE"]
print("slow peer closed after", len(states), "STATEs", flush=True)
"""


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A directory under /tmp that a uid-65534 daemon can write its socket and ready file in."""
    d = Path(tempfile.mkdtemp(prefix="wcache-limits-"))
    try:
        (d / "sock").mkdir(mode=0o700)
        if os.geteuid() == 0:
            for p in (d, d / "sock"):
                os.chown(p, 65534, 65534)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _as_nobody(cmd: list[str]) -> list[str]:
    """Run ``cmd`` as uid 65534 without root's capabilities (CAP_SYS_RESOURCE lifts the in-flight
    descriptor limit): setpriv keeps only CAP_DAC_READ_SEARCH, to reach the interpreter under /root."""
    if os.geteuid() != 0:
        return cmd
    keep = "+dac_read_search"
    return [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        f"--inh-caps={keep}",
        f"--ambient-caps={keep}",
        *cmd,
    ]


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="needs setpriv to drop root")
def test_peer_that_never_reads_does_not_block_other_engines(nobody_dir: Path, ckpt: Path) -> None:
    """A non-root daemon with RLIMIT_NOFILE 48: one peer asks for 60 STATEs and reads none. Their
    descriptors would sit in its socket and count against the uid's in-flight limit (ETOOMANYREFS for
    every engine); the daemon sends it at most its share of unread descriptors, serves the others, and
    closes it after the send deadline."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    sdir = nobody_dir / "sock"
    ready, log = nobody_dir / "ready.json", nobody_dir / "daemon.log"

    cmd = [sys.executable, "-m", "wcache.server.cli", "--model", str(ckpt), "--socket-dir", str(sdir)]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            ["sh", "-c", 'ulimit -n 48 && exec "$@"', "sh", *_as_nobody([*cmd, "--ready-file", str(ready)])],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
        )
    d = DaemonProcess(proc, log, ready, time.perf_counter())
    try:
        d.wait_ready(60)
        out = subprocess.run(
            _as_nobody([sys.executable, "-c", _PEERS, str(d.socket), str(ckpt)]),
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
        assert out.returncode == 0, out.stderr[-3000:] + d.log_text()[-3000:]
        assert "served" in out.stdout
        sent = int(out.stdout.split("closed after ")[1].split()[0])
        assert 1 <= sent <= 3  # RLIMIT_NOFILE 48 // 16: its share of unread descriptors, of the 60 it asked
        assert d.proc.poll() is None
    finally:
        rc = d.stop()
    assert rc == 0  # it served on to a clean stop


# ------------------------------------------------------------------ class 7: lease bookkeeping
class _NoScan(dict[int, Any]):
    """A lease dict that refuses to be scanned: per-request lease work must not look at every lease."""

    def values(self) -> Any:
        raise AssertionError("scanned every lease")

    items = keys = __iter__ = values


def test_lease_bookkeeping_does_not_scan_leases(ckpt: Path) -> None:
    backend = HostBackend()
    model = load_model(RankSpec(ckpt), backend=backend)
    store = Store(backend, [model], max_leases_per_connection=64)
    try:
        key = WeightCacheKey.from_checkpoint(ckpt).to_wire()
        granted: dict[int, list[int]] = {}
        for conn in range(200):  # 12,800 live leases
            for i in range(64):
                state, _, _ = store.acquire(conn, 1, GetState(id=i + 1, key=key))  # (the slab's own fds)
                granted.setdefault(conn, []).append(state.lease)
        store.leases = _NoScan(store.leases)
        assert store.leased(model.key) == 12_800
        with pytest.raises(LimitExceededError):
            store.acquire(0, 1, GetState(id=99, key=key))
        from wcache.proto import Release

        released = store.release(5, Release(id=1, lease=granted[5][0]))
        assert released.leases_left == 12_799
        store.acquire(5, 1, GetState(id=2, key=key))
        assert len(store.drop_connection(7)) == 64
        assert store.leased(model.key) == 12_800 - 64 and store.held_by(7) == 0 and store.held_by(5) == 64
        assert len(dict.values(store.leases)) == 12_800 - 64
    finally:
        store.close()


# ------------------------------------------------------------------ class 8: idle peers at the cap
async def test_idle_peers_give_way_to_a_new_engine(daemon: DaemonProc, ckpt: Path) -> None:
    """1,024 connections (the cap): one engine holding a lease, 1,003 idle after HELLO, 20 that never said
    HELLO. A new engine is served (it used to get `too many connections`): the daemon closes a connection
    that has not said HELLO first, then the longest-idle one holding no lease — never the lease holder,
    whose leases live with its connection."""
    key = WeightCacheKey.from_checkpoint(ckpt)
    holder = await WCacheClient(daemon.socket, timeout=30).fetch(key)
    idle: list[socket.socket] = []
    fresh: list[socket.socket] = []
    try:

        def open_idle() -> None:
            for _ in range(1003):
                s = _raw(daemon.socket, 20)
                s.sendall(HELLO)
                reply = _read_reply(s)
                assert reply is not None and reply["type"] == "HELLO_OK", reply
                idle.append(s)

        await asyncio.to_thread(open_idle)
        fresh.extend(_raw(daemon.socket, 20) for _ in range(20))
        newcomer = await WCacheClient(daemon.socket, timeout=30).fetch(key)  # the 1,025th: served
        assert len(newcomer) > 0

        def more_engines() -> None:
            for _ in range(20):  # 19 more take the places of those without HELLO, the 20th an idle one's
                s = _raw(daemon.socket, 20)
                idle.append(s)
                s.sendall(HELLO)
                reply = _read_reply(s)
                assert reply is not None and reply["type"] == "HELLO_OK", reply

        await asyncio.to_thread(more_engines)
        status = await WCacheClient(daemon.socket, timeout=30).status()
        assert status.models[0].leases == 2  # the holder's lease is untouched
        await newcomer.release()
        idle[0].settimeout(20)
        reply = await asyncio.to_thread(_read_reply, idle[0])  # the longest idle gave way, and was told
        assert reply is not None and reply["code"] == 23 and reply["fatal"] is True
        assert "reconnect" in reply["message"]
        idle[-1].setblocking(False)
        with pytest.raises(BlockingIOError):  # the newest idle one is still open
            idle[-1].recv(1)
    finally:
        await holder.release()
        for s in idle + fresh:
            s.close()
    assert daemon.proc.poll() is None


def test_connection_table_policy() -> None:
    from wcache.server.listen import ConnectionTable, Peer

    table = ConnectionTable(3)
    a, b, c = Peer(1, open=True), Peer(2, open=True), Peer(3)
    for p in (a, b, c):
        table.add(p)
    b.active = a.active - 1  # b idle longest
    pinned: Callable[[int], bool] = lambda cid: cid == 2  # noqa: E731
    assert table.make_room(pinned) is c  # no HELLO yet: first to go
    table.remove(3)
    table.add(Peer(4, open=True, busy=True))
    assert table.make_room(pinned) is a  # b holds a lease, 4 is busy
    table.remove(1)
    table.add(Peer(5, open=True, busy=True))
    assert table.make_room(pinned) is None  # everyone holds or works: refuse the new one


# ------------------------------------------------------------------ what a peer can make the daemon hold
def test_descriptor_shares_leave_room_to_accept_and_answer() -> None:
    """Connections, slabs and the daemon's own reserve never add up past RLIMIT_NOFILE; slabs get at least
    a quarter of what is shared, connections what the limit allows up to their cap."""
    for nofile in (48, 128, 1024, 4096, 20_000, 1 << 20):
        for cap in (1, 64, 1024, 100_000):
            connections, slabs = split_descriptors(nofile, cap)
            reserve = min(1024, max(16, nofile // 8))
            assert connections + slabs + reserve <= max(nofile, reserve + 2), (nofile, cap)
            assert 1 <= connections <= cap and slabs >= max(1, (nofile - reserve) // 4)
    assert split_descriptors(20_000, 1024) == (1024, 20_000 - 1024 - 1024)


def test_committed_deposits_cannot_exhaust_the_daemons_descriptors(socket_dir: Path, ckpt: Path) -> None:
    """RLIMIT_NOFILE 128: 100 committed 1-byte deposits under new recipe keys once held a descriptor each, and
    the next engines got CacheUnavailableError (accept failed). The daemon holds at most its share of slabs
    (split_descriptors, Store.fit_descriptors): past it the least recently used unleased model goes, like
    bytes past the budget, and 40 engines fetch at once while one holds the checkpoint."""
    from tests.server.deposit_engine import recipe_key

    ready, log = socket_dir.parent / "ready.json", socket_dir.parent / "daemon.log"
    cmd = [sys.executable, "-m", "wcache.server.cli", "--model", str(ckpt), "--socket-dir", str(socket_dir)]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            ["sh", "-c", 'ulimit -n 128 && exec "$@"', "sh", *cmd, "--ready-file", str(ready)],
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    d = DaemonProcess(proc, log, ready, time.perf_counter())
    probe = Store(HostBackend())
    probe.fit_descriptors(split_descriptors(128, 1024)[1])
    base = WeightCacheKey.from_checkpoint(ckpt)

    async def scenario() -> None:
        import torch

        async with await WCacheClient(d.socket).fetch(base):  # the checkpoint is pinned by this engine
            for i in range(100):
                done = await WCacheClient(d.socket).deposit(recipe_key(base, postprocess=i), {"b": torch.ones(1)})
                assert done.tensors == 1
            st = await WCacheClient(d.socket).status()
            assert len(st.models) == probe.max_models
            assert any("engine" not in m.key for m in st.models)  # the leased checkpoint was never the one to go
            newest = recipe_key(base, postprocess=99)
            fetched = await asyncio.gather(*(WCacheClient(d.socket, timeout=30).fetch(newest) for _ in range(40)))
            try:
                assert all(torch.equal(w["b"], torch.ones(1)) for w in fetched)
            finally:
                for w in fetched:
                    await w.release()

    try:
        d.wait_ready(60)
        asyncio.run(scenario())
        assert len(os.listdir(f"/proc/{d.pid}/fd")) < 128 - 16
    finally:
        rc = d.stop()
    assert rc == 0
