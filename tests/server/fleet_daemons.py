"""What the fleet-fill daemon tests check, host and CUDA alike (tests/server/test_fill_daemon.py,
tests/gpu/test_fill_cuda.py): the bytes an engine fetches from a filled rank, and the fill's agent processes."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

from wcache import WCacheClient, WeightCacheKey
from wcache.plan.key import RankSpec
from wcache.plan.rank import plan_rank
from wcache.server.process import DaemonProcess, spawn_daemon

#: starts a daemon on a model with more arguments (``wait=False``: not waited for ready)
Starter = Callable[..., DaemonProcess]


@contextmanager
def daemon_starter(tmp_path: Path, *common: str, timeout: float = 120.0) -> Iterator[Starter]:
    """Start daemons (``common`` arguments first), each in a socket directory of its own; all stopped at the end."""
    started: list[DaemonProcess] = []

    def start(model: Path, *args: str, wait: bool = True) -> DaemonProcess:
        d = tmp_path / f"sock{len(started)}"
        d.mkdir(mode=0o700)
        p = spawn_daemon(model, d, *common, *args, timeout=timeout if wait else None)
        started.append(p)
        return p

    try:
        yield start
    finally:
        for p in started:
            p.stop()


def source(daemons: Starter, ckpt: Path, *args: str) -> tuple[DaemonProcess, str]:
    """A source daemon on ``ckpt`` serving peers on loopback, and its peer address."""
    d = daemons(ckpt, "--peer-listen", "127.0.0.1:0", *args)
    return d, str(json.loads(d.ready_file.read_text())["peer"])


def full_checkpoint(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_slices(d: DaemonProcess, key_dir: Path, ckpt: Path, tp_rank: int = 0, tp_size: int = 1) -> None:
    """What an engine fetches (its key computed from ``key_dir``) is the safetensors slices of ``ckpt``, on
    whichever device the daemon serves."""
    key = WeightCacheKey.from_checkpoint(key_dir, tp_rank=tp_rank, tp_size=tp_size)
    full = full_checkpoint(ckpt)

    async def check() -> None:
        async with await WCacheClient(d.socket).fetch(key) as w:
            with plan_rank(RankSpec(ckpt, tp_rank=tp_rank, tp_size=tp_size)) as rp:
                for p in rp.layout.placements:
                    t = full[p.source.name]
                    if p.shard is not None:
                        t = t.narrow(p.shard.dim, p.shard.start, p.shard.length)
                    assert torch.equal(w[p.source.name].cpu(), t), p.source.name

    asyncio.run(check())


def origin(d: DaemonProcess) -> str:
    """Where the daemon's one model came from (STATUS: ``disk``, ``peer HOST:PORT``, ...)."""
    (m,) = asyncio.run(WCacheClient(d.socket).status()).models
    return m.origin


def agent_processes(pid: int) -> list[int]:
    """The fill agents' child processes of ``pid`` (``wcache.server.agent_process``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"wcache.server.agent_process" in cmd:
            found.append(int(entry))
    return found
