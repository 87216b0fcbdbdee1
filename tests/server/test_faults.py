"""Faults: killed daemons and clients, hostile bytes, bad checkpoints, shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.conftest import DaemonProc, server_cmd
from wcache import CacheUnavailableError, WCacheClient, WeightCacheKey
from wcache.plan.key import RankSpec
from wcache.proto import PROTOCOL_VERSION, Hello, pack_frame
from wcache.server.process import spawn_daemon


async def _leases(d: DaemonProc) -> int:
    return (await WCacheClient(d.socket).status()).models[0].leases


async def _wait_leases(d: DaemonProc, n: int, deadline: float = 5.0) -> None:
    end = time.monotonic() + deadline
    while await _leases(d) != n:
        assert time.monotonic() < end, f"leases stuck at {await _leases(d)}, want {n}"
        await asyncio.sleep(0.02)


def _unix_sockets_at(path: Path) -> int:
    """Sockets bound or connected to ``path`` (its listener and every connection, accepted or still queued)."""
    with open("/proc/net/unix") as fh:
        return sum(1 for line in fh if line.rstrip().endswith(str(path)))


async def test_daemon_killed_mid_session(daemon: DaemonProc, ckpt: Path) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt)
    client = WCacheClient(daemon.socket, timeout=30)
    w = await client.fetch(key)
    name = "model.norm.weight"
    before = w[name].clone()
    os.kill(daemon.proc.pid, signal.SIGSTOP)  # a request will be in flight when it dies
    connected = _unix_sockets_at(daemon.socket)
    pending = asyncio.ensure_future(client.fetch(key))
    deadline = time.monotonic() + 30
    while _unix_sockets_at(daemon.socket) == connected:  # until its connection waits in the stopped daemon's queue
        assert time.monotonic() < deadline and not pending.done()
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    os.kill(daemon.proc.pid, signal.SIGKILL)
    with pytest.raises(CacheUnavailableError, match="closed the connection"):
        await pending
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    with pytest.raises(CacheUnavailableError):
        await client.fetch(key)
    assert time.monotonic() - t0 < 1.0
    assert w[name].equal(before)  # host mappings outlive the daemon
    await w.release()  # no daemon to tell: not an error


async def test_no_daemon(tmp_path: Path, ckpt: Path) -> None:
    with pytest.raises(CacheUnavailableError, match="no wcache daemon"):
        await WCacheClient(tmp_path / "nothing.sock").fetch(WeightCacheKey.from_checkpoint(ckpt))


CLIENT = """
import asyncio, sys
from wcache import WCacheClient, WeightCacheKey
async def main():
    w = await WCacheClient(sys.argv[1]).fetch(WeightCacheKey.from_checkpoint(sys.argv[2]))
    print("fetched", flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


async def test_client_killed_holding_lease(daemon: DaemonProc, ckpt: Path) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", CLIENT, str(daemon.socket), str(ckpt)], stdout=subprocess.PIPE)
        for _ in range(3)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), 60)
            assert line.strip() == b"fetched"
        assert await _leases(daemon) == 3
    finally:
        for p in procs:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
    await _wait_leases(daemon, 0)  # each killed client's lease ended with its connection
    async with await WCacheClient(daemon.socket).fetch(WeightCacheKey.from_checkpoint(ckpt)) as w:
        assert len(w) > 0


def _raw(path: Path, timeout: float = 10) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(str(path))
    return s


def _read_reply(s: socket.socket) -> dict[str, Any] | None:
    """One frame, or None if the daemon just closed."""
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
        chunk = s.recv(65536)
        if not chunk:
            return None
        data += chunk
    (n,) = struct.unpack(">I", data[:4])
    reply = msgpack.unpackb(data[4 : 4 + n])
    assert isinstance(reply, dict)
    return reply


_HELLO_LEN = len(pack_frame({"type": "HELLO"}))

#: hostile bytes sent first on a connection -> the ERROR code the daemon answers with (always fatal: the
#: connection closes after it) and a fragment of its message
HOSTILE: dict[str, tuple[bytes, int, str]] = {
    # the first 4 bytes read as a length: 0x7f13a501, over the pre-handshake limit
    "random bytes": (b"\x7f\x13\xa5\x01" + os.urandom(60), 2, "exceeds the limit"),
    "oversized length": (struct.pack(">I", 2**31) + b"x" * 16, 2, "exceeds the limit"),
    "zero length": (b"\x00\x00\x00\x00", 1, "zero-length frame"),
    "not a map": (struct.pack(">I", 4) + msgpack.packb([1, 2, 3]), 1, "map"),
    "trailing bytes": (
        struct.pack(">I", _HELLO_LEN - 4) + msgpack.packb([1, 2, 3]).ljust(_HELLO_LEN - 4, b"\xc0"),
        1,
        "trailing bytes",
    ),
    "unknown type": (pack_frame({"type": "REBOOT", "id": 1}), 1, "unknown frame type 'REBOOT'"),
    "wrong field type": (pack_frame({"type": "HELLO", "versions": "all"}), 1, "HELLO.versions"),
    "request before hello": (pack_frame({"type": "GET_STATE", "id": 1, "key": {}}), 4, "GET_STATE"),
    "future version only": (pack_frame(Hello(versions=(99,)).to_wire()), 3, "no common protocol version"),
    "ext type": (struct.pack(">I", 4) + b"\x81\xa1x\xd4", 1, "malformed msgpack"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
async def test_hostile_input_gets_error_and_daemon_serves_on(daemon: DaemonProc, ckpt: Path, name: str) -> None:
    data, code, message = HOSTILE[name]
    s = _raw(daemon.socket)
    try:
        s.sendall(data)
        reply = await asyncio.to_thread(_read_reply, s)
        assert reply is not None, "the daemon closed without an ERROR"
        assert (reply["type"], reply["code"], reply["fatal"]) == ("ERROR", code, True), reply
        assert message in str(reply["message"]), reply
        if name == "future version only":
            assert reply["details"] == {"offered": [99], "supported": [PROTOCOL_VERSION]}
        assert await asyncio.to_thread(s.recv, 1) == b""  # and the connection is closed
    finally:
        s.close()
    async with await WCacheClient(daemon.socket).fetch(WeightCacheKey.from_checkpoint(ckpt)) as w:
        assert len(w) > 0
    assert daemon.proc.poll() is None


async def test_client_sending_fds_is_refused(daemon: DaemonProc) -> None:
    s = _raw(daemon.socket)
    r, w = os.pipe()
    try:
        s.sendmsg(
            [pack_frame(Hello(versions=(PROTOCOL_VERSION,)).to_wire())],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", r))],
        )
        reply = await asyncio.to_thread(_read_reply, s)
        assert reply is not None and (reply["type"], reply["code"], reply["fatal"]) == ("ERROR", 1, True)
        assert "descriptors" in str(reply["message"])
        assert await asyncio.to_thread(s.recv, 1) == b""  # fatal: the connection is closed
    finally:
        s.close()
        os.close(r)
        os.close(w)
    assert (await WCacheClient(daemon.socket).status()).models  # and the daemon serves on


async def test_silent_client_dropped_after_handshake_timeout(daemon: DaemonProc) -> None:
    s = _raw(daemon.socket)
    s.settimeout(30)
    t0 = time.monotonic()
    try:
        assert await asyncio.to_thread(s.recv, 1) == b""  # closed, with no ERROR
    finally:
        s.close()
    assert 1 < time.monotonic() - t0 < 20  # the 3 s handshake deadline
    assert (await WCacheClient(daemon.socket).status()).models  # and the daemon serves on


async def test_sigterm_drains_and_unlinks(daemon: DaemonProc, ckpt: Path) -> None:
    w = await WCacheClient(daemon.socket).fetch(WeightCacheKey.from_checkpoint(ckpt))
    assert daemon.stop(signal.SIGTERM) == 0
    assert not daemon.socket.exists()
    await w.release()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate", "past the"),
        ("header_len", "header length"),
        ("bad_dtype", "unknown dtype"),
        ("overlap", "overlap"),
        ("shape", "needs"),
        ("missing_shard", "missing"),
    ],
)
def test_bad_checkpoint_is_a_clear_error(
    tmp_path: Path, ckpt: Path, socket_dir: Path, damage: str, message: str
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    f = sorted(bad.glob("*.safetensors"))[0]
    raw = f.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    names = [k for k in header if k != "__metadata__"]
    if damage == "truncate":
        f.write_bytes(raw[: len(raw) - 100])
    elif damage == "header_len":
        f.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    else:
        if damage == "bad_dtype":
            header[names[0]]["dtype"] = "Q7"
        elif damage == "overlap":
            a, b = sorted(names, key=lambda n: header[n]["data_offsets"][0])[:2]
            header[b]["data_offsets"] = [
                header[a]["data_offsets"][0],
                header[a]["data_offsets"][0] + header[b]["data_offsets"][1] - header[b]["data_offsets"][0],
            ]
        elif damage == "shape":
            header[names[0]]["shape"] = [s * 2 for s in header[names[0]]["shape"]]
        elif damage == "missing_shard":
            f.unlink()
        if damage != "missing_shard":
            hb = json.dumps(header).encode()
            hb += b" " * ((8 - len(hb) % 8) % 8)
            f.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + hlen :])
    out = subprocess.run(
        server_cmd("--model", str(bad), "--socket-dir", str(socket_dir)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1, out.stderr
    assert message in out.stderr
    assert f.name in out.stderr
    assert not (socket_dir / "wcache-rank0.sock").exists()


def test_sharding_errors_before_loading(tmp_path: Path, ckpt: Path, socket_dir: Path) -> None:
    out = subprocess.run(
        server_cmd("--model", str(ckpt), "--socket-dir", str(socket_dir), "--tp-size", "3", "--tp-rank", "0"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1 and "cannot split for tp_size 3" in out.stderr
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (other / "config.json").write_text(json.dumps(cfg))
    out = subprocess.run(
        server_cmd("--model", str(other), "--socket-dir", str(socket_dir), "--tp-size", "2", "--tp-rank", "1"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1 and "FancyNewForCausalLM" in out.stderr and "--shard-plan" in out.stderr


async def test_half_sent_frame_times_out_without_delaying_others(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path
) -> None:
    d = daemon_factory(ckpt, "--frame-timeout", "1.5")
    s = _raw(d.socket)
    s.settimeout(20)
    try:
        s.sendall(pack_frame(Hello(versions=(PROTOCOL_VERSION,)).to_wire()))
        assert (await asyncio.to_thread(_read_reply, s) or {}).get("type") == "HELLO_OK"
        whole = pack_frame({"type": "STATUS", "id": 1})
        s.sendall(whole[: len(whole) // 2])  # and stall
        t0 = time.monotonic()
        async with await WCacheClient(d.socket).fetch(WeightCacheKey.from_checkpoint(ckpt)) as w:
            assert len(w) > 0
        assert time.monotonic() - t0 < 1.0  # the stalled client delays nobody
        assert await asyncio.to_thread(s.recv, 1) == b""  # and is closed after --frame-timeout
        assert 1.0 < time.monotonic() - t0 < 10
    finally:
        s.close()
    assert d.proc.poll() is None


async def test_memfd_slab_cannot_be_written_by_a_client(daemon: DaemonProc, ckpt: Path) -> None:
    """The host slab is a sealed memfd: a client holding the fd cannot change the weights."""
    import mmap

    from wcache.channel import connect, expect
    from wcache.proto import GetState

    ch, _ = await connect(daemon.socket, software="test", name="test")
    try:
        await ch.send(GetState(id=1, key=WeightCacheKey.from_checkpoint(ckpt).to_wire()))
        state, fds = await expect(ch)
        (fd,) = fds
        size = os.fstat(fd).st_size
        with pytest.raises(PermissionError):
            mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        os.close(fd)
    finally:
        ch.close()


async def test_a_stop_does_not_wait_for_a_load_in_a_worker_thread(ckpt: Path, socket_dir: Path, tmp_path: Path) -> None:
    """SIGTERM while a PRELOAD loads (a minute here; a read that never returns, for ever): the daemon stops within
    its drain's grace and its lock is free at once for the next daemon on the socket — it used to wait for the
    worker thread, the lock held, so that a replacement refused to start."""
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "WCACHE_TEST_SLOW_S": "60",
    }
    old = spawn_daemon(ckpt, socket_dir, env=env, log=tmp_path / "old.log")
    spec = RankSpec(ckpt, transform="tests.server.slow_transform:slow")
    loading = asyncio.ensure_future(WCacheClient(old.socket).preload(spec, timeout=90))
    try:
        await asyncio.sleep(0.5)
        assert old.proc.poll() is None and not loading.done()
        t0 = time.monotonic()
        assert await asyncio.to_thread(old.stop, signal.SIGTERM, 30) == 0
        assert time.monotonic() - t0 < 20  # the drain's grace (5 s), not the load's minute
        with pytest.raises(CacheUnavailableError):
            await loading
        new = spawn_daemon(ckpt, socket_dir, timeout=60)  # the lock is free: it starts
        try:
            assert (await WCacheClient(new.socket).status()).models
        finally:
            new.stop()
    finally:
        loading.cancel()
        old.stop(signal.SIGKILL)
