"""Fleet fill between CUDA daemons (docs/fleet.md, "A fill, step by step"): the target's agent process maps the
slab it fills from the daemon's VMM export, with no torch, registers it with NIXL and READs into it; the rank is
resharded (TP=1 source, rank 1 of 2 target) and an engine fetches the safetensors slices. The agent aborted
mid-fill ends the fill, not the daemon: it loads from disk and serves."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.server.fleet_daemons import agent_processes, assert_slices, daemon_starter, origin, source
from wcache.server.nixl import MODULES
from wcache.server.process import DaemonProcess

if not any(importlib.util.find_spec(m) for m in MODULES):
    pytest.skip("NIXL (nixl-cu12 or nixl-cu13) is not installed", allow_module_level=True)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """CUDA daemons, each in a socket directory of its own; all stopped at the end."""
    with daemon_starter(tmp_path, "--device", "cuda:0", timeout=180.0) as start:
        yield start


def test_a_cuda_daemon_fills_a_resharded_rank_from_a_cuda_peer(
    ckpt: Path, daemons: Callable[..., DaemonProcess]
) -> None:
    src, peer = source(daemons, ckpt)
    target = daemons(ckpt, "--tp-rank", "1", "--tp-size", "2", "--fill-from", peer)
    assert origin(target) == f"peer {peer}"
    assert_slices(target, ckpt, ckpt, 1, 2)
    assert not agent_processes(target.pid)  # the fill's agent ended with it
    assert origin(src) == "disk"


def test_the_fill_agent_aborted_mid_fill_leaves_the_cuda_daemon_serving_from_disk(
    ckpt: Path, daemons: Callable[..., DaemonProcess]
) -> None:
    _, peer = source(daemons, ckpt, "--peer-max-rate", "2000000")  # ~5 s for the tiny rank's 10 MB
    target = daemons(ckpt, "--fill-from", peer, "--fill-timeout", "120", wait=False)
    deadline = time.monotonic() + 120
    while not (children := agent_processes(target.pid)):
        assert time.monotonic() < deadline and target.proc.poll() is None, target.log_text()[-2000:]
        time.sleep(0.02)
    time.sleep(1.0)  # inside the fill: the agent has mapped and registered the slab, READs under way
    os.kill(children[0], signal.SIGABRT)
    target.wait_ready(180)
    assert target.proc.poll() is None
    assert origin(target) == "disk"
    assert_slices(target, ckpt, ckpt)
    assert not agent_processes(target.pid)  # reaped
