"""``wcache-server --fill-from``: a daemon fills its rank from a peer before reading the checkpoint, and serves it
as if loaded (docs/fleet.md) — the tensors an engine fetches are the safetensors slices; a directory without
weights gets the checkpoint's small files and stubs first and serves an engine that computed its key there;
no peer means the disk path. The source here is the peer handler behind the tests' stand-in for the shell."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wcache import WCacheClient, WeightCacheKey
from wcache.rank import RankSpec, plan_rank
from wcache.server.backends.host import HostBackend
from wcache.server.peer import PeerService
from wcache.server.peer_auth import PeerSecurity
from wcache.server.process import DaemonProcess, spawn_daemon
from wcache.server.store import Store, load_model

from .peer_harness import Harness

pytest.importorskip("nixl_cu12", reason="the fleet extra (pip install -e '.[fleet]') is not installed")

NONE = PeerSecurity.configure(cert=None, key=None, ca=None, secret_file=None)


async def _ready(d: DaemonProcess, timeout: float = 120.0) -> DaemonProcess:
    """wait_ready without blocking the event loop (the source serves the fill from this process)."""
    deadline = time.monotonic() + timeout
    while not d.ready_file.exists():
        if d.proc.poll() is not None:
            raise RuntimeError(f"wcache-server exited with {d.proc.returncode}:\n{d.log_text()[-3000:]}")
        if time.monotonic() > deadline:
            d.proc.kill()
            raise TimeoutError(f"wcache-server not ready after {timeout} s:\n{d.log_text()[-3000:]}")
        await asyncio.sleep(0.05)
    return d.wait_ready(1)


def _full(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_slices(weights: object, ckpt: Path, tp_rank: int, tp_size: int) -> None:
    full = _full(ckpt)
    with plan_rank(RankSpec(ckpt, tp_rank=tp_rank, tp_size=tp_size)) as rp:
        for p in rp.layout.placements:
            t = full[p.source.name]
            if p.shard is not None:
                t = t.narrow(p.shard.dim, p.shard.start, p.shard.length)
            assert torch.equal(weights[p.source.name], t), p.source.name  # type: ignore[index]


async def test_a_daemon_fills_its_rank_from_a_peer_and_serves_it(ckpt: Path, socket_dir: Path) -> None:
    svc = PeerService(Store(HostBackend(), [load_model(RankSpec(ckpt), backend=HostBackend())]), NONE, software="t")
    try:
        async with Harness(svc).running() as port:
            d = spawn_daemon(
                ckpt, socket_dir, "--tp-rank", "1", "--tp-size", "2", "--fill-from", f"127.0.0.1:{port}", timeout=None
            )
            try:
                await _ready(d)
                (m,) = (await WCacheClient(d.socket).status()).models
                assert m.origin == f"peer 127.0.0.1:{port}" and m.key["tp_rank"] == 1
                key = WeightCacheKey.from_checkpoint(ckpt, tp_rank=1, tp_size=2)
                async with await WCacheClient(d.socket).fetch(key) as w:
                    _assert_slices(w, ckpt, 1, 2)
            finally:
                d.stop()
        assert svc.fills_done == 1 and not svc.fills
    finally:
        svc.close()
        svc.store.close()


async def test_a_node_without_the_checkpoint_serves_an_engine(ckpt: Path, socket_dir: Path, tmp_path: Path) -> None:
    svc = PeerService(Store(HostBackend(), [load_model(RankSpec(ckpt), backend=HostBackend())]), NONE, software="t")
    empty = tmp_path / "model"
    try:
        async with Harness(svc).running() as port:
            d = spawn_daemon(empty, socket_dir, "--fill-from", f"127.0.0.1:{port}", timeout=None)
            try:
                await _ready(d)
                key = WeightCacheKey.from_checkpoint(empty)  # what an engine started on that directory computes
                assert key == WeightCacheKey.from_checkpoint(ckpt)
                async with await WCacheClient(d.socket).fetch(key) as w:
                    _assert_slices(w, ckpt, 0, 1)
            finally:
                d.stop()
    finally:
        svc.close()
        svc.store.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def test_without_a_peer_the_daemon_loads_from_disk(ckpt: Path, socket_dir: Path) -> None:
    mport = _free_port()
    d = spawn_daemon(
        ckpt, socket_dir, "--fill-from", "127.0.0.1:1", "--fill-timeout", "5", "--metrics-port", str(mport)
    )
    try:
        (m,) = asyncio.run(WCacheClient(d.socket).status()).models
        assert m.origin == "disk"
        assert 'wcache_fills_total{outcome="failed",reason="no-peer"} 1' in _metrics(mport)
    finally:
        d.stop()


def test_fill_options_are_checked(ckpt: Path) -> None:
    from wcache.server.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--fill-fingerprint", "ab"])  # belongs to --fill-from
    with pytest.raises(SystemExit):
        parse_args(["--fill-from", "127.0.0.1:7070"])  # no --model to fill
    with pytest.raises(SystemExit):
        parse_args(["--model", str(ckpt), "--fill-from", "127.0.0.1:7070", "--peer-cert", "x"])  # half of mTLS
    args = parse_args(["--model", str(ckpt), "--fill-from", "dns:wcache-peers:7070"])
    assert args.peer_security.mode == "none"
