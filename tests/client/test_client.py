"""wcache/client/client.py against daemons that misbehave (tests/client/fake_daemon.py): what either fetch accepts
of a daemon's answers."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from tests.client.fake_daemon import FakeDaemon, Peer, memfd, memfd_slab, state
from wcache import WCacheClient, WeightCacheKey
from wcache.errors import RemoteProtocolError
from wcache.proto.table import TensorEntry

KEY = WeightCacheKey("0" * 32, "LlamaForCausalLM", 1, 0, "float32")
ONE = [TensorEntry("w", "float32", (4,), (1,), 0, 0)]


def _fetch(client: WCacheClient, key: WeightCacheKey, blocking: bool) -> Any:
    return client.fetch_sync(key) if blocking else asyncio.run(client.fetch(key))


def _open_memfds() -> int:
    """This process's descriptors of the fake daemon's memfds."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:wcache-fake-slab")
        except OSError:
            pass
    return n


OTHER_MODELS = {
    "another fingerprint": {"fingerprint": "f" * 32},
    "another dtype": {"dtype": "bfloat16"},
    "another rank": {"tp_rank": 1, "tp_size": 2},
    "another plan": {"plan": "builtin:llama/1"},
    "a recipe": {"engine": "vllm"},
    "a field of another type": {"tp_size": "1"},
}


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
@pytest.mark.parametrize("served", list(OTHER_MODELS.values()), ids=list(OTHER_MODELS))
def test_a_state_for_another_key_than_the_one_asked_for_is_refused(
    served: dict[str, Any], blocking: bool, tmp_path: Path
) -> None:
    """A full key (scanned, resolved, built by the engine): a STATE serving another model's key is a break of
    docs/protocol.md §4.4 (the daemon serves only the key asked for) — RemoteProtocolError, the slab's descriptor
    closed. Only a proven key's STATE was compared (``adopt``); a full key's was mapped and handed to the engine
    as the weights of the key it asked for."""

    def scenario(peer: Peer) -> None:
        request = peer.opening()
        fd = memfd(16)
        try:
            peer.send(state(request, [memfd_slab(0, 16)], ONE, key={**request["key"], **served}), [fd])
        finally:
            os.close(fd)
        peer.hold()

    sock = tmp_path / "fake.sock"
    before = _open_memfds()  # other tests' weights, until the collector frees them
    with FakeDaemon(sock, scenario), pytest.raises(RemoteProtocolError, match="the daemon served key"):
        _fetch(WCacheClient(sock, wait_for_daemon=0, timeout=10), KEY, blocking)
    assert _open_memfds() == before  # the STATE's descriptor closed (the fake daemon's own closed before it returns)


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
def test_the_full_key_sent_after_a_refused_proof_is_checked_too(blocking: bool, ckpt: Path, tmp_path: Path) -> None:
    """A daemon refuses the proof (KEY_UNPROVEN), the client scans the headers and asks for the full key on the same
    connection (docs/protocol.md §4.3.1); a STATE serving another fingerprint is refused, and the one of the key
    asked for accepted."""
    from wcache.error_codes import ErrorCode

    fingerprint: list[str] = []

    def scenario(peer: Peer) -> None:
        request = peer.opening()
        assert "fingerprint" not in request["key"]  # a proof
        peer.send(
            {
                "type": "ERROR",
                "id": request["id"],
                "code": int(ErrorCode.KEY_UNPROVEN),
                "message": "these files were not read here",
                "fatal": False,
                "details": {},
            }
        )
        request = peer.read()
        served = {**request["key"], "fingerprint": fingerprint[0] if fingerprint else "f" * 32}
        fd = memfd(16)
        try:
            peer.send(state(request, [memfd_slab(0, 16)], ONE, key=served), [fd])
        finally:
            os.close(fd)
        peer.released()

    sock = tmp_path / "fake.sock"
    client = WCacheClient(sock, wait_for_daemon=0, timeout=10)
    with FakeDaemon(sock, scenario):
        with pytest.raises(RemoteProtocolError, match="the daemon served key"):
            _fetch(client, WeightCacheKey.from_checkpoint(ckpt), blocking)
        fingerprint.append(WeightCacheKey.from_checkpoint(ckpt).resolve().fingerprint)
        w = _fetch(client, WeightCacheKey.from_checkpoint(ckpt), blocking)
        assert not w.key_proven and w.key.fingerprint == fingerprint[0]
        w.release_sync()
