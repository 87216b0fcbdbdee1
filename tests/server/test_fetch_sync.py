"""``fetch_sync`` on a blocking socket (docs/performance.md, the restart path): the same requests through the same sans-I/O connection,
no event loop started, and the same errors and lease lifetime as ``fetch``."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import DaemonProc
from tests.server.test_fetch import reference
from wcache import CacheUnavailableError, KeyMismatchError, WCacheClient, WeightCacheKey


def _leases(daemon: DaemonProc) -> int:
    status = asyncio.run(WCacheClient(daemon.socket).status())
    return int(status.models[0].leases)


@pytest.fixture
def no_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting an event loop fails the test (the old fetch_sync ran asyncio.run per fetch)."""

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("fetch_sync started an event loop")

    monkeypatch.setattr(asyncio, "run", refuse)
    monkeypatch.setattr(asyncio, "new_event_loop", refuse)


def test_zero_copy_without_an_event_loop(daemon: DaemonProc, ckpt: Path, no_event_loop: None) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt)
    w = WCacheClient(daemon.socket).fetch_sync(key)
    ref = reference(ckpt)
    assert set(w) == set(ref) and not w.released
    for name, t in ref.items():
        assert torch.equal(w[name].view(torch.int16), t.view(torch.int16)), name
    assert set(w.timings) >= {"connect", "state", "wait", "decode", "map", "views"}
    # the time the reads waited for the daemon, and the time the frames took to decode, lie within the handshake's
    # and the STATE's, apart
    assert w.timings["wait"] >= 0 and w.timings["decode"] > 0
    assert w.timings["wait"] + w.timings["decode"] <= w.timings["connect"] + w.timings["state"]
    w.release_sync()
    assert w.released


def test_lease_lives_until_release_and_async_release_works(daemon: DaemonProc, ckpt: Path) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt)
    w = WCacheClient(daemon.socket).fetch_sync(key)
    assert _leases(daemon) == 1
    asyncio.run(w.release())  # the socket was left non-blocking for the asyncio layer
    assert _leases(daemon) == 0


def test_copy_mode_owns_memory_and_releases(daemon: DaemonProc, ckpt: Path, no_event_loop: None) -> None:
    w = WCacheClient(daemon.socket).fetch_sync(WeightCacheKey.from_checkpoint(ckpt), mode="copy")
    assert w.released and w.mode == "copy"
    name = "model.layers.0.mlp.up_proj.weight"
    w[name].add_(1)  # the engine's own memory


def test_daemon_errors_keep_their_class_and_the_client_stays_usable(
    daemon: DaemonProc, ckpt: Path, no_event_loop: None
) -> None:
    client = WCacheClient(daemon.socket)
    with pytest.raises(KeyMismatchError):
        client.fetch_sync(WeightCacheKey.from_checkpoint(ckpt, dtype="float16"))
    with pytest.raises(ValueError, match="mode"):
        client.fetch_sync(WeightCacheKey.from_checkpoint(ckpt), mode="bogus")
    client.fetch_sync(WeightCacheKey.from_checkpoint(ckpt)).release_sync()


def test_no_daemon_is_cache_unavailable(tmp_path: Path, ckpt: Path, no_event_loop: None) -> None:
    client = WCacheClient(tmp_path / "nothing.sock", wait_for_daemon=0)
    with pytest.raises(CacheUnavailableError, match="no wcache daemon"):
        client.fetch_sync(WeightCacheKey.from_checkpoint(ckpt))


def test_a_silent_peer_is_cache_unavailable_after_the_timeout(tmp_path: Path, ckpt: Path) -> None:
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(str(path))
        srv.listen(1)  # accepts into the backlog, never answers HELLO
        with pytest.raises(CacheUnavailableError, match="did not answer"):
            WCacheClient(path, timeout=0.2).fetch_sync(WeightCacheKey.from_checkpoint(ckpt))


def test_a_peer_closing_mid_request_is_cache_unavailable(tmp_path: Path, ckpt: Path) -> None:
    path = tmp_path / "closing.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(str(path))
        srv.listen(1)

        def accept_and_close() -> None:
            c, _ = srv.accept()
            c.recv(1 << 16)
            c.close()

        t = threading.Thread(target=accept_and_close)
        t.start()
        try:
            with pytest.raises(CacheUnavailableError, match="closed the connection"):
                WCacheClient(path, timeout=30).fetch_sync(WeightCacheKey.from_checkpoint(ckpt))
        finally:
            t.join(30)


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
def test_get_state_goes_out_in_the_same_write_as_hello(
    daemon: DaemonProc, ckpt: Path, monkeypatch: pytest.MonkeyPatch, blocking: bool
) -> None:
    """Pipelining (docs/protocol.md §5.1): the client's first write holds HELLO and GET_STATE, and nothing
    more is sent before STATE comes back — one round trip fewer for a restart's first fetch."""
    from wcache import channel
    from wcache.proto.codec import decode_body

    writes: list[list[str]] = []  # each write's frames, by type

    def frames(data: bytes) -> list[str]:
        out, at = [], 0
        while at < len(data):
            n = int.from_bytes(data[at : at + 4], "big")
            out.append(decode_body(data[at + 4 : at + 4 + n])["type"])
            at += 4 + n
        return out

    real_blocking, real_async = channel.Channel.send_bytes_blocking, channel.Channel.send_bytes

    def spy_blocking(self: Any, data: bytes, timeout: float) -> None:
        writes.append(frames(data))
        real_blocking(self, data, timeout)

    async def spy_async(self: Any, data: bytes, fds: Any = ()) -> None:
        writes.append(frames(data))
        await real_async(self, data, fds)

    monkeypatch.setattr(channel.Channel, "send_bytes_blocking", spy_blocking)
    monkeypatch.setattr(channel.Channel, "send_bytes", spy_async)
    key = WeightCacheKey.from_checkpoint(ckpt).resolve()  # whole: no proof a daemon may refuse (§4.3.1)
    c = WCacheClient(daemon.socket)
    w = c.fetch_sync(key) if blocking else asyncio.run(c.fetch(key))
    ref = reference(ckpt)
    assert all(torch.equal(w[k], v) for k, v in ref.items())
    assert writes == [["HELLO", "GET_STATE"]]
    assert _leases(daemon) == 1
    monkeypatch.undo()
    w.release_sync() if blocking else asyncio.run(w.release())


def test_the_engine_checks_the_daemons_gpu_itself(daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipelined GET_STATE cannot name the engine's GPU (the daemon's is not known yet): on HELLO_OK from a
    CUDA daemon the client checks it is the GPU the engine chose, DEVICE_MISMATCH otherwise."""
    from wcache import DeviceMismatchError
    from wcache.client import cuda
    from wcache.proto.engine import DeviceInfo, HelloOk

    hello = HelloOk(2, "t", "cuda", DeviceInfo("cuda", 0, "GPU-daemon", ""), 1 << 20, 0)
    monkeypatch.setattr(cuda, "local_uuid", lambda device, daemon_uuid: "GPU-engine")
    with pytest.raises(DeviceMismatchError, match="GPU-engine"):
        WCacheClient(daemon.socket)._check_device(hello)
    monkeypatch.setattr(cuda, "local_uuid", lambda device, daemon_uuid: daemon_uuid)
    WCacheClient(daemon.socket)._check_device(hello)


def test_a_big_state_is_received_in_place_by_either_fetch(
    daemon_factory: Callable[..., DaemonProc], tmp_path: Path
) -> None:
    """A STATE over codec.DIRECT_BODY (3,000 tensors: ~200 KB) is received straight into the buffer it is decoded
    from (channel: recvmsg_into the connection's receive_space), its descriptor with it; both fetches map every
    tensor bit-identical."""
    import json

    from safetensors.torch import save_file

    from wcache.proto.codec import DIRECT_BODY

    model = tmp_path / "many"
    model.mkdir()
    g = torch.Generator().manual_seed(3)
    tensors = {
        f"model.layers.{i // 100}.mlp.experts.{i % 100}.projection_with_a_long_name.weight": torch.randn(
            4, 8, generator=g
        ).to(torch.bfloat16)
        for i in range(3000)
    }
    save_file(tensors, str(model / "model.safetensors"))
    (model / "config.json").write_text(json.dumps({"architectures": ["MoeLikeForCausalLM"]}))
    daemon = daemon_factory(model)
    key = WeightCacheKey.from_checkpoint(model)
    for w in (WCacheClient(daemon.socket).fetch_sync(key), asyncio.run(_fetched(daemon.socket, key))):
        assert len(w) == 3000 and w.timings["state"] >= 0
        for name, t in tensors.items():
            assert torch.equal(w[name].view(torch.int16), t.view(torch.int16)), name
        w.release_sync()
    assert sum(len(n) for n in tensors) > DIRECT_BODY  # the names alone make the STATE a direct one


async def _fetched(sock: Path, key: WeightCacheKey) -> Any:
    return await WCacheClient(sock).fetch(key)
