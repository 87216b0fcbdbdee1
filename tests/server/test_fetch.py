"""End to end on the host backend: real daemon subprocesses, real Unix sockets."""

from __future__ import annotations

import asyncio
import glob
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import DaemonProc, run_cli
from tests.server import exposition
from wcache import KeyMismatchError, UnknownLeaseError, WCacheClient, WeightCacheKey
from wcache.plan.sharding import LLAMA_PLAN


def reference(model: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(model / "*.safetensors"))):
        out.update(load_file(f))
    return out


async def test_zero_copy_bit_identical(daemon: DaemonProc, ckpt: Path) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt)
    async with await WCacheClient(daemon.socket).fetch(key) as w:
        ref = reference(ckpt)
        assert set(w) == set(ref)
        for name, t in ref.items():
            assert w[name].dtype == t.dtype and w[name].shape == t.shape
            assert torch.equal(w[name].view(torch.int16), t.view(torch.int16)), name
        # zero copy: every tensor is a view of the one mapped slab
        assert len({w[n].untyped_storage().data_ptr() for n in w}) == 1
        # the reads' waits and the frames' decoding, apart, within the handshake's and the STATE's time
        assert w.timings["wait"] >= 0 and w.timings["decode"] > 0
        assert w.timings["wait"] + w.timings["decode"] <= w.timings["connect"] + w.timings["state"]
        status = await WCacheClient(daemon.socket).status()
        assert status.models[0].leases == 1 and status.leases[0].lease == w.lease
    assert w.released
    status = await WCacheClient(daemon.socket).status()
    assert status.models[0].leases == 0


async def test_copy_mode_owns_memory_and_releases(daemon: DaemonProc, ckpt: Path) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt)
    w = await WCacheClient(daemon.socket).fetch(key, mode="copy")
    assert w.released and w.mode == "copy"
    assert (await WCacheClient(daemon.socket).status()).models[0].leases == 0
    ref = reference(ckpt)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(w[name], ref[name])
    w[name].add_(1)  # owned memory: writable, and the daemon's copy is untouched
    async with await WCacheClient(daemon.socket).fetch(key) as again:
        assert torch.equal(again[name], ref[name])


async def test_release_is_idempotent_and_sync_variants(daemon: DaemonProc, ckpt: Path) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt)
    client = WCacheClient(daemon.socket)
    w = await client.fetch(key)
    await w.release()
    await w.release()
    w2 = await asyncio.to_thread(client.fetch_sync, key)
    assert len(w2) == len(w)
    w2.release_sync()
    assert (await client.status()).models[0].leases == 0


async def test_fetch_sync_refuses_inside_loop(daemon: DaemonProc, ckpt: Path) -> None:
    with pytest.raises(RuntimeError, match="running event loop"):
        WCacheClient(daemon.socket).fetch_sync(WeightCacheKey.from_checkpoint(ckpt))


async def test_key_mismatch_names_fields(daemon: DaemonProc, ckpt: Path) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt, dtype="float16")
    with pytest.raises(KeyMismatchError) as info:
        await WCacheClient(daemon.socket).fetch(key)
    assert set(info.value.fields) == {"dtype"}
    assert info.value.fields["dtype"] == ["bfloat16", "float16"]  # [served, requested], docs/protocol.md §4.3
    assert info.value.requested_values == {"dtype": "float16"} and info.value.served_values == {"dtype": "bfloat16"}
    assert "dtype: requested float16, served bfloat16" in str(info.value)
    # the connection-level failure cost nothing: the daemon still serves
    async with await WCacheClient(daemon.socket).fetch(WeightCacheKey.from_checkpoint(ckpt)) as w:
        assert len(w) > 0


async def test_tied_weights_alias(daemon_factory: Callable[..., DaemonProc], tied_ckpt: Path) -> None:
    d = daemon_factory(tied_ckpt)
    async with await WCacheClient(d.socket).fetch(WeightCacheKey.from_checkpoint(tied_ckpt)) as w:
        assert w.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
        assert w["lm_head.weight"] is w["model.embed_tokens.weight"]


async def test_dtype_cast(daemon_factory: Callable[..., DaemonProc], ckpt: Path) -> None:
    d = daemon_factory(ckpt, "--dtype", "float32")
    key = WeightCacheKey.from_checkpoint(ckpt, dtype="float32")
    async with await WCacheClient(d.socket).fetch(key) as w:
        ref = reference(ckpt)
        for name in ref:
            assert w[name].dtype == torch.float32
            assert torch.equal(w[name], ref[name].float())


async def test_tp2_two_daemons_concurrently(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path
) -> None:
    daemon_factory(ckpt, "--tp-size", "2", "--tp-rank", "0")
    daemon_factory(ckpt, "--tp-size", "2", "--tp-rank", "1")
    keys = [WeightCacheKey.from_checkpoint(ckpt, tp_rank=r, tp_size=2) for r in (0, 1)]
    client = WCacheClient(socket_dir=socket_dir)
    w0, w1 = await asyncio.gather(client.fetch(keys[0]), client.fetch(keys[1]))
    try:
        assert w0.key.tp_rank == 0 and w1.key.tp_rank == 1
        ref = reference(ckpt)
        for name, full in ref.items():
            dim = LLAMA_PLAN.dim_for(name)
            if dim is None:
                assert torch.equal(w0[name], full) and torch.equal(w1[name], full)
            else:
                assert w0[name].shape[dim] * 2 == full.shape[dim]
                assert torch.equal(torch.cat([w0[name], w1[name]], dim=dim), full), name
    finally:
        await asyncio.gather(w0.release(), w1.release())


async def test_tp_rank_key_mismatch(daemon: DaemonProc, ckpt: Path) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt, tp_rank=1, tp_size=2)
    with pytest.raises(KeyMismatchError) as info:
        await WCacheClient(daemon.socket).fetch(key)
    assert {"tp_rank", "tp_size", "plan"} <= set(info.value.fields)
    assert info.value.requested_values["tp_size"] == 2 and info.value.served_values["tp_size"] == 1
    assert "tp_size: requested 2, served 1" in info.value.message


async def test_64_concurrent_clients(daemon: DaemonProc, ckpt: Path) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt)
    name = "model.layers.3.self_attn.o_proj.weight"
    expected = reference(ckpt)[name]

    async def one(i: int) -> bool:
        w = await WCacheClient(daemon.socket, timeout=60).fetch(key, mode="copy" if i % 4 == 0 else "zero_copy")
        ok = torch.equal(w[name], expected)
        await w.release()
        return ok

    assert all(await asyncio.gather(*(one(i) for i in range(64))))
    assert (await WCacheClient(daemon.socket).status()).models[0].leases == 0


async def test_cancel_mid_fetch_then_next_works(daemon: DaemonProc, ckpt: Path) -> None:
    key = WeightCacheKey.from_checkpoint(ckpt)
    client = WCacheClient(daemon.socket)
    for delay in (0.0, 0.0005, 0.001, 0.002, 0.004):
        task = asyncio.ensure_future(client.fetch(key))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            w = await task
            await w.release()
        except asyncio.CancelledError:
            pass
    async with await client.fetch(key) as w:
        assert len(w) == len(reference(ckpt))
    for _ in range(100):  # the daemon ends cancelled fetches' leases when their sockets close
        if (await client.status()).models[0].leases == 0:
            break
        await asyncio.sleep(0.02)
    assert (await client.status()).models[0].leases == 0


async def test_unknown_lease(daemon: DaemonProc, ckpt: Path) -> None:
    """Another connection's lease, or a made-up one: the same UNKNOWN_LEASE answer."""
    from wcache.channel import connect, expect
    from wcache.proto import Release

    client = WCacheClient(daemon.socket)
    w = await client.fetch(WeightCacheKey.from_checkpoint(ckpt))
    ch, _ = await connect(daemon.socket, software="test", name="test")
    try:
        for lease in (w.lease, 12345):
            ch.conn.leases.add(lease)  # convince our own connection object, to reach the daemon's check
            await ch.send(Release(id=ch.conn.next_request_id(), lease=lease))
            with pytest.raises(UnknownLeaseError):
                await expect(ch)
    finally:
        ch.close()
    assert (await client.status()).models[0].leases == 1
    await w.release()


def test_wcache_status_cli(daemon: DaemonProc, socket_dir: Path, ckpt: Path) -> None:
    """A row names the model as an operator knows it: checkpoint directory, fingerprint, rank and dtype, origin,
    size."""
    import json

    out = run_cli("status", "--socket-dir", str(socket_dir))
    assert out.returncode == 0, out.stderr
    head, row = out.stdout.splitlines()[:2]
    assert head.split()[:7] == ["SOCKET", "CHECKPOINT", "FINGERPRINT", "RANK", "ORIGIN", "SIZE", "TIER"]
    cells = row.split()
    fingerprint = WeightCacheKey.from_checkpoint(ckpt).resolve().fingerprint[:12]
    assert cells[:8] == [str(daemon.socket), str(ckpt), fingerprint, "tp0/1", "bfloat16", "disk", "10.0", "MB"], row
    assert "host:cpu" in cells
    js = run_cli("status", "--socket-path", str(daemon.socket), "--json")
    doc = json.loads(js.stdout)[str(daemon.socket)]
    assert doc["type"] == "STATUS_REPLY" and doc["models"][0]["tensors"] == 39
    assert doc["models"][0]["source"] == str(ckpt) and doc["models"][0]["origin"] == "disk"
    none = run_cli("status", "--socket-path", str(socket_dir / "nope.sock"))
    assert none.returncode == 1 and "CacheUnavailableError" in none.stdout


async def test_prometheus_metrics(daemon_factory: Callable[..., DaemonProc], ckpt: Path) -> None:
    import socket as _socket
    import urllib.request

    s = _socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    d = daemon_factory(ckpt, "--metrics-port", str(port))
    key = WeightCacheKey.from_checkpoint(ckpt)
    client = WCacheClient(d.socket)
    async with await client.fetch(key):
        pass
    await client.fetch(key, mode="copy")
    with pytest.raises(KeyMismatchError):
        await client.fetch(WeightCacheKey.from_checkpoint(ckpt, dtype="float16"))

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""

    status, text = await asyncio.to_thread(get, "/metrics")
    assert status == 200
    exposition.parse(text)  # what was served, under the reference parser
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert lines['wcache_fetches_total{mode="zero_copy"}'] == "1"
    assert lines['wcache_fetches_total{mode="copy"}'] == "1"
    assert lines["wcache_releases_total"] == "2"
    assert lines['wcache_errors_total{code="KEY_MISMATCH"}'] == "1"
    assert lines['wcache_fetch_seconds_bucket{le="+Inf"}'] == "2"
    assert lines["wcache_leases"] == "0"
    assert "wcache_kept_models" not in lines  # no --keeper
    resident = [k for k in lines if k.startswith("wcache_resident_bytes")]
    assert len(resident) == 1 and 'tier="host"' in resident[0] and int(float(lines[resident[0]])) > 9_000_000
    assert (await asyncio.to_thread(get, "/other"))[0] == 404


async def test_moe_layout_groups_and_names(daemon_factory: Callable[..., DaemonProc], tmp_path: Path) -> None:
    """Experts come back as a few stacked group views; per-name tensors equal them and safetensors."""
    from safetensors.torch import save_file

    model = tmp_path / "moe"
    model.mkdir()
    g = torch.Generator().manual_seed(1)
    ref = {
        f"model.layers.{i // 60}.mlp.experts.{(i % 60) // 3}.w{i % 3}.weight": torch.randn(16, 32, generator=g).to(
            torch.bfloat16
        )
        for i in range(600)
    }
    ref["model.norm.weight"] = torch.randn(32, generator=g).to(torch.bfloat16)
    save_file(ref, str(model / "model.safetensors"))
    (model / "config.json").write_text('{"architectures": ["MoeLikeForCausalLM"]}')
    d = daemon_factory(model)
    async with await WCacheClient(d.socket).fetch(WeightCacheKey.from_checkpoint(model)) as w:
        groups = w.groups()
        assert sum(len(gr.names) for gr in groups) == len(ref) and len(groups) < 10
        for gr in groups:
            for j, name in enumerate(gr.names):
                assert torch.equal(gr.tensor[j].view(torch.int16), ref[name].view(torch.int16)), name
        assert set(w) == set(ref)
        for name, t in ref.items():
            assert torch.equal(w[name].view(torch.int16), t.view(torch.int16)), name
