"""The CUDA backend end to end: real daemons on the GPU, both export kinds."""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import DaemonProc
from wcache import CacheUnavailableError, DeviceMismatchError, UnsupportedPlatformError, WCacheClient, WeightCacheKey
from wcache.plan.key import RankSpec
from wcache.plan.sharding import LLAMA_PLAN

EXPORTS = ["vmm", "ipc"]


def reference(model: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(model / "*.safetensors"))):
        out.update(load_file(f))
    return out


@pytest.fixture(params=EXPORTS)
def gpu_daemon(request: pytest.FixtureRequest, daemon_factory: Callable[..., DaemonProc], ckpt: Path) -> DaemonProc:
    return daemon_factory(ckpt, "--device", "cuda:0", "--cuda-export", request.param)


async def test_zero_copy_on_gpu_bit_identical_no_engine_memory(gpu_daemon: DaemonProc, ckpt: Path) -> None:
    torch.empty(1, device="cuda:0")
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info(0)
    allocated_before = torch.cuda.memory_allocated(0)
    w = await WCacheClient(gpu_daemon.socket).fetch(WeightCacheKey.from_checkpoint(ckpt))
    free_after, _ = torch.cuda.mem_get_info(0)
    assert torch.cuda.memory_allocated(0) == allocated_before  # the engine allocated nothing
    assert free_before - free_after < 4 << 20  # mapping the daemon's slab costs no device memory
    ref = reference(ckpt)
    assert set(w) == set(ref)
    for name, t in ref.items():
        assert w[name].is_cuda
        assert torch.equal(w[name].cpu().view(torch.int16), t.view(torch.int16)), name
    assert len({w[n].untyped_storage().data_ptr() for n in w}) == 1
    assert w.server.backend == "cuda"
    await w.release()
    assert (await WCacheClient(gpu_daemon.socket).status()).models[0].leases == 0


async def test_copy_mode_on_gpu(gpu_daemon: DaemonProc, ckpt: Path) -> None:
    w = await WCacheClient(gpu_daemon.socket).fetch(WeightCacheKey.from_checkpoint(ckpt), mode="copy")
    assert w.released
    ref = reference(ckpt)
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(w[name].cpu(), ref[name])
    w[name].zero_()  # owned memory
    async with await WCacheClient(gpu_daemon.socket).fetch(WeightCacheKey.from_checkpoint(ckpt)) as again:
        assert torch.equal(again[name].cpu(), ref[name])


ENGINE = """
import asyncio, sys, time
from wcache import WCacheClient, WeightCacheKey
async def main():
    w = await WCacheClient(sys.argv[1]).fetch(WeightCacheKey.from_checkpoint(sys.argv[2]))
    s = float(sum(t.float().sum().item() for t in w.values()))
    print("fetched", s, flush=True)
    await asyncio.sleep(120)
asyncio.run(main())
"""


async def test_engine_killed_while_mapped(gpu_daemon: DaemonProc, ckpt: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", ENGINE, str(gpu_daemon.socket), str(ckpt)], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), 120)
        assert line.startswith(b"fetched")
        assert (await WCacheClient(gpu_daemon.socket).status()).models[0].leases == 1
    finally:
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()
    deadline = time.monotonic() + 5
    while (await WCacheClient(gpu_daemon.socket).status()).models[0].leases:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    ref = reference(ckpt)
    async with await WCacheClient(gpu_daemon.socket).fetch(WeightCacheKey.from_checkpoint(ckpt)) as w:
        assert all(torch.equal(w[n].cpu(), ref[n]) for n in ref)  # the slab is intact for the next engine


async def test_daemon_killed(gpu_daemon: DaemonProc, ckpt: Path) -> None:
    os.kill(gpu_daemon.proc.pid, signal.SIGKILL)
    gpu_daemon.proc.wait(10)
    t0 = time.monotonic()
    with pytest.raises(CacheUnavailableError):
        await WCacheClient(gpu_daemon.socket).fetch(WeightCacheKey.from_checkpoint(ckpt))
    assert time.monotonic() - t0 < 1.0


async def test_device_mismatch_by_uuid(daemon_factory: Callable[..., DaemonProc], ckpt: Path) -> None:
    from wcache.channel import connect, expect
    from wcache.proto import GetState

    d = daemon_factory(ckpt, "--device", "cuda:0")
    ch, hello = await connect(d.socket, software="test", name="test")
    try:
        assert hello.device.uuid.startswith("GPU-")
        key = WeightCacheKey.from_checkpoint(ckpt)
        await ch.send(GetState(id=1, key=key.to_wire(), device_uuid="GPU-00000000-0000-0000-0000-000000000000"))
        with pytest.raises(DeviceMismatchError):
            await expect(ch)
    finally:
        ch.close()


async def test_tp2_two_daemons_one_gpu(daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path) -> None:
    for r in (0, 1):  # O_DIRECT reads (single-extent jobs) on one rank, page-cache reads on the other
        io = "direct" if r == 0 else "buffered"
        daemon_factory(ckpt, "--device", "cuda:0", "--tp-size", "2", "--tp-rank", str(r), "--io", io)
    keys = [WeightCacheKey.from_checkpoint(ckpt, tp_rank=r, tp_size=2) for r in (0, 1)]
    w0, w1 = await asyncio.gather(*(WCacheClient(socket_dir=socket_dir).fetch(k) for k in keys))
    ref = reference(ckpt)
    for name, full in ref.items():
        dim = LLAMA_PLAN.dim_for(name)
        got = full.cuda() if dim is None else torch.cat([w0[name], w1[name]], dim=dim)
        if dim is None:
            assert torch.equal(w0[name], got) and torch.equal(w1[name], got)
        else:
            assert torch.equal(got.cpu(), full), name
    await asyncio.gather(w0.release(), w1.release())


def test_platform_check_names_alternatives() -> None:
    from wcache.server.backends.cuda import CudaBackend

    with pytest.raises(UnsupportedPlatformError, match="--device cpu"):
        CudaBackend(index=torch.cuda.device_count() + 5).check_platform()


@pytest.mark.parametrize("visible", [None, "MIG-00000000-0000-0000-0000-000000000000"])
def test_an_index_or_mig_entry_that_is_not_visible_is_one_line_before_the_lock(
    ckpt: Path, socket_dir: Path, visible: str | None
) -> None:
    """On a real driver: an index past the visible GPUs, or a CUDA_VISIBLE_DEVICES entry naming no GPU or MIG
    instance, is one line saying what to do, exit 1, nothing in the socket directory (checked before the lock)."""
    env = {**os.environ}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    index = torch.cuda.device_count() + 5 if visible is None else 0
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "wcache.server.cli",
            "--model",
            str(ckpt),
            "--socket-dir",
            str(socket_dir),
            "--device",
            f"cuda:{index}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()[-1:]
    assert f"--device cuda:{index}" in line and ("does not exist" in line if visible is None else visible in line)
    assert list(socket_dir.iterdir()) == []
    from wcache.server.backends.cuda import CudaBackend

    CudaBackend(0).check_device(True)  # the visible GPU passes, torch's count making no context first


async def test_takeover_on_gpu_keeps_engine_mappings(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path
) -> None:
    from wcache.server.process import spawn_daemon

    old = daemon_factory(ckpt, "--device", "cuda:0")
    key = WeightCacheKey.from_checkpoint(ckpt)
    engine = await WCacheClient(old.socket).fetch(key)
    new = spawn_daemon(None, socket_dir, "--device", "cuda:0", takeover=old.socket, timeout=120)
    try:
        assert old.proc.wait(60) == 0
        assert [m.origin for m in (await WCacheClient(new.socket).status()).models] == ["takeover"]  # no disk read
        ref = reference(ckpt)
        for name, t in ref.items():  # the old daemon is gone; the engine's VMM mappings still hold the weights
            assert torch.equal(engine[name].cpu().view(torch.int16), t.view(torch.int16)), name
        async with await WCacheClient(new.socket).fetch(key) as w:
            assert w.server.server_pid == new.pid
            assert all(torch.equal(w[n].cpu().view(torch.int16), t.view(torch.int16)) for n, t in ref.items())
        await engine.release()
    finally:
        new.stop()


async def test_takeover_refused_for_ipc_slabs(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path
) -> None:
    old = daemon_factory(ckpt, "--device", "cuda:0", "--cuda-export", "ipc")
    r = subprocess.run(
        [sys.executable, "-m", "wcache.server.cli", "--takeover", str(old.socket), "--device", "cuda:0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode != 0 and "cannot be handed over" in r.stderr + r.stdout
    assert old.proc.poll() is None  # nothing changed: the old daemon still serves
    async with await WCacheClient(old.socket).fetch(WeightCacheKey.from_checkpoint(ckpt)) as w:
        assert len(w) > 0


async def test_keeper_holds_gpu_slabs_across_a_daemon_crash(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path
) -> None:
    """The keeper has no CUDA context, yet its VMM fds keep the slab's GPU memory alive after the daemon
    is SIGKILLed; the restarted daemon imports it (no load), and the engine's mapping stays valid."""
    from wcache.server.process import spawn_keeper

    keeper = spawn_keeper(socket_dir)
    try:
        first = daemon_factory(ckpt, "--device", "cuda:0", "--keeper")
        key = WeightCacheKey.from_checkpoint(ckpt)
        assert [m.key for m in (await WCacheClient(keeper.socket).status()).models] == [key.to_wire()]
        engine = await WCacheClient(first.socket).fetch(key)
        first.stop(signal.SIGKILL)
        second = daemon_factory(ckpt, "--device", "cuda:0", "--keeper")
        assert [m.origin for m in (await WCacheClient(second.socket).status()).models] == ["keeper"]  # no load
        ref = reference(ckpt)
        async with await WCacheClient(second.socket).fetch(key) as w:
            assert w.server.server_pid == second.pid
            assert all(torch.equal(w[n].cpu().view(torch.int16), t.view(torch.int16)) for n, t in ref.items())
        assert all(torch.equal(engine[n].cpu().view(torch.int16), t.view(torch.int16)) for n, t in ref.items())
        await engine.release()
    finally:
        rc = keeper.stop()
    assert rc == 0


@pytest.mark.parametrize("where", ["shm", "disk"])
async def test_host_tier_reload_on_gpu(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path, where: str
) -> None:
    """Restart from the tier (staged copy), then refill after eviction from the page-locked entry. The
    entry is pinned read-only, which Linux allows outside tmpfs too (a --host-tier-dir on disk)."""
    if where == "shm" and not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    base = Path(tempfile.mkdtemp(dir="/dev/shm")) if where == "shm" else tmp_path
    args = ("--device", "cuda:0", "--host-tier", str(1 << 30), "--host-tier-dir", str(base / "tier"))
    first = daemon_factory(ckpt, *args)
    assert [m.origin for m in (await WCacheClient(first.socket).status()).models] == ["disk"]
    assert len(list((base / "tier").glob("*.slab"))) == 1  # saved to the tier
    first.stop()
    second = daemon_factory(ckpt, *args)
    # the first refill of an entry this daemon did not write is staged (every block checked), then it is pinned
    assert [(m.origin, m.tier_copy) for m in (await WCacheClient(second.socket).status()).models] == [
        ("tier", "staged")
    ]
    ref = reference(ckpt)
    key = WeightCacheKey.from_checkpoint(ckpt)
    client = WCacheClient(second.socket)
    try:
        await _tier_refills(second, client, key, ckpt, ref)
    finally:
        second.stop()
        if where == "shm":
            shutil.rmtree(base, ignore_errors=True)


async def _tier_refills(
    second: DaemonProc, client: WCacheClient, key: WeightCacheKey, ckpt: Path, ref: dict[str, torch.Tensor]
) -> None:
    async with await client.fetch(key) as w:
        assert all(torch.equal(w[n].cpu().view(torch.int16), t.view(torch.int16)) for n, t in ref.items())
    deadline = time.monotonic() + 60
    while (await client.status()).tier_pinned < 1 and time.monotonic() < deadline:  # pinned in the background
        await asyncio.sleep(0.05)
    assert (await client.status()).tier_pinned == 1, second.log_text()[-4000:]
    await client.evict(key)
    await client.preload(RankSpec(ckpt))  # refilled from the page-locked tier entry: one DMA copy
    assert [(m.origin, m.tier_copy) for m in (await client.status()).models] == [("tier", "pinned")]
    async with await client.fetch(key) as w:
        assert all(torch.equal(w[n].cpu().view(torch.int16), t.view(torch.int16)) for n, t in ref.items())
