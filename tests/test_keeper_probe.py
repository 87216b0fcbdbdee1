"""wcache/keeper_probe.py: how many models a keeper holds for a rank, asked by a fetch whose daemon is restarting
(wcache/client/wait.py) and by a daemon's start-up. A fake keeper answers STATUS; whatever it names, the probe
does bounded work and an engine's fetch ends in a WCacheError (the fallback an engine catches) within its timeout."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.client.fake_daemon import FakeDaemon, Peer
from wcache import WCacheClient, WeightCacheKey
from wcache.errors import CacheUnavailableError
from wcache.keeper_probe import keeper_kept
from wcache.proto.engine import pack

KEY = WeightCacheKey("0" * 32, "LlamaForCausalLM", 1, 0, "float32")
DEVICE = {"kind": "cpu", "index": 0, "uuid": "", "name": ""}
HELLO_OK = {
    "type": "HELLO_OK",
    "version": 2,
    "software": "fake keeper",
    "backend": "host",
    "device": DEVICE,
    "max_frame_size": 1 << 20,
    "server_pid": os.getpid(),
}


def _keeper(owners: list[str]) -> Callable[[Peer], None]:
    """A keeper whose STATUS_REPLY lists one model of KEY per owner name."""

    def scenario(peer: Peer) -> None:
        assert peer.read()["type"] == "HELLO"
        peer.send(HELLO_OK)
        req = peer.read()
        models: list[dict[str, Any]] = [
            {"key": KEY.to_wire(), "backend": "host", "bytes": 16, "tensors": 1, "leases": 0, "owner": o}
            for o in owners
        ]
        reply = {
            "type": "STATUS_REPLY",
            "id": req["id"],
            "backend": "host",
            "device": DEVICE,
            "uptime_seconds": 1.0,
            "connections": 1,
            "models": models,
        }
        peer.sock.sendall(pack(reply))
        peer.hold(30)

    return scenario


def test_a_keeper_counts_the_models_it_holds_for_this_socket_however_spelled(tmp_path: Path) -> None:
    """Entries kept for this socket count, under its real path or another spelling of it (a directory reached
    through a symlink: an older keeper's record); entries of other sockets and unresolvable names do not."""
    real = tmp_path / "run"
    real.mkdir()
    (tmp_path / "var-run").symlink_to(real)
    sock = real / "wcache-rank0.sock"
    owners = [str(sock), str(tmp_path / "var-run" / "wcache-rank0.sock"), str(real / "wcache-rank1.sock"), "/x\0/y"]
    with FakeDaemon(tmp_path / "keeper.sock", _keeper(owners)):
        assert asyncio.run(keeper_kept(tmp_path / "keeper.sock", 0, timeout=5, owner=sock)) == 2


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
def test_a_keeper_naming_an_owner_with_a_nul_byte_leaves_the_fetch_cache_unavailable(
    blocking: bool, tmp_path: Path
) -> None:
    """The fetch finds no daemon and asks the keeper beside it whether one is coming back: an owner name holding a
    NUL byte made ``os.path.realpath`` raise ValueError out of the fetch, past an engine's ``except WCacheError``."""
    client = WCacheClient(tmp_path / "wcache-rank0.sock", wait_for_daemon=1.0, timeout=5)
    keeper = _keeper(["/run/wcache\0/wcache-rank0.sock"])
    with FakeDaemon(tmp_path / "wcache-keeper.sock", keeper), pytest.raises(CacheUnavailableError):
        client.fetch_sync(KEY) if blocking else asyncio.run(client.fetch(KEY))


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
def test_a_keeper_naming_thousands_of_owners_does_not_hold_the_fetch_past_its_timeout(
    blocking: bool, tmp_path: Path
) -> None:
    """4,000 models kept for as many long owner names of this socket's file name (~17 MB of STATUS_REPLY): each
    was resolved (~3.4 ms apiece, synchronously, past the probe's own timeout), and a fetch with a 2 s timeout
    returned after ~15 s. Now at most 64 names are resolved."""
    owners = [f"/{i:04d}" + "/a" * 2030 + "/wcache-rank0.sock" for i in range(4000)]
    timeout = 2.0
    client = WCacheClient(tmp_path / "wcache-rank0.sock", wait_for_daemon=1.0, timeout=timeout)
    with FakeDaemon(tmp_path / "wcache-keeper.sock", _keeper(owners)):
        t0 = time.monotonic()
        with pytest.raises(CacheUnavailableError):
            client.fetch_sync(KEY) if blocking else asyncio.run(client.fetch(KEY))
        took = time.monotonic() - t0
    assert took < timeout + 2.0, f"fetch(timeout={timeout}) returned after {took:.1f} s"
