"""Write-back on the CUDA backend (docs/protocol.md §4.13): an engine deposits GPU tensors into a VMM slab
of the daemon's GPU, a later fetch of the recipe key maps them zero_copy; an engine SIGKILLed mid-deposit
leaves nothing (the GPU memory comes back); ``--cuda-export ipc`` refuses deposits; a deposited slab is
kept by the keeper and handed over by a takeover like a loaded one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import DaemonProc
from wcache import UnsupportedPlatformError, WCacheClient, WeightCacheKey
from wcache.plan.recipe import RecipeKey

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
#: the large tensor of every deposit here: its size makes the slab visible in cudaMemGetInfo
BIG = 256 * MIB


def recipe(base: WeightCacheKey, **extra: str | int) -> RecipeKey:
    return RecipeKey.of(base, engine="test-engine", engine_version="1.0", quantization="fp8", **extra)


def gpu_tensors(device: str = "cuda:0") -> dict[str, torch.Tensor]:
    """What an FP8 post-processing leaves: fp8 weights + fp32 block scales, a bf16 tensor, a buffer, and one
    CPU tensor (written host to device), one non-contiguous (transposed) view."""
    g = torch.Generator(device=device).manual_seed(11)
    big = torch.randn(BIG // 2 // 1024, 1024, generator=g, device=device).to(torch.bfloat16)
    return {
        "layers.0.weight": torch.randn(512, 256, generator=g, device=device).to(torch.float8_e4m3fn),
        "layers.0.weight_scale_inv": torch.rand(4, 2, generator=g, device=device),
        "layers.1.weight": big,
        "layers.2.weight": torch.randn(64, 32, generator=g, device=device).t(),
        "rotary.inv_freq": torch.rand(16, generator=torch.Generator().manual_seed(3)),
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


async def wait_for(what: Callable[[], object], deadline_s: float = 30.0, why: str = "") -> None:
    deadline = time.monotonic() + deadline_s
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {deadline_s} s: {why}")
        await asyncio.sleep(0.05)


def gpu_free() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info(0)[0])


async def origins(daemon: DaemonProc) -> dict[str, str]:
    st = await WCacheClient(daemon.socket).status()
    return {RecipeKey.from_wire(dict(m.key)).short() if "engine" in m.key else "ckpt": m.origin for m in st.models}


async def test_deposit_on_gpu_then_fetch_zero_copy_bit_identical(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path
) -> None:
    d = daemon_factory(ckpt, "--device", "cuda:0")
    key = recipe(WeightCacheKey.from_checkpoint(ckpt))
    ts = gpu_tensors()
    ts["lm_head.weight"] = ts["layers.1.weight"]  # tied
    client = WCacheClient(d.socket)
    allocated = torch.cuda.memory_allocated(0)
    done = await client.deposit(key, ts, kinds={"rotary.inv_freq": "buffer"})
    assert torch.cuda.memory_allocated(0) <= allocated + MIB  # the slab is the daemon's, not torch's
    assert done.tensors == 5 and done.bytes >= BIG
    assert (await origins(d))[key.short()] == "deposit"
    async with await client.fetch(key) as w:
        assert torch.cuda.memory_allocated(0) <= allocated + MIB  # mapped, not copied
        assert w.server.backend == "cuda" and w.buffers == {"rotary.inv_freq"}
        assert w.aliases == {"lm_head.weight": "layers.1.weight"}
        assert len({w[n].untyped_storage().data_ptr() for n in w}) == 1  # one mapped slab
        for name, t in ts.items():
            assert w[name].is_cuda and w[name].dtype == t.dtype and w[name].shape == t.shape, name
            assert torch.equal(bits(w[name]), bits(t)), name


async def test_ipc_export_refuses_deposits_naming_the_flag(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path
) -> None:
    d = daemon_factory(ckpt, "--device", "cuda:0", "--cuda-export", "ipc")
    key = recipe(WeightCacheKey.from_checkpoint(ckpt))
    with pytest.raises(UnsupportedPlatformError, match="--cuda-export vmm"):
        await WCacheClient(d.socket).deposit(key, gpu_tensors())
    assert set(await origins(d)) == {"ckpt"}  # nothing published, the checkpoint not evicted


#: a fresh engine that stops at STEP of a CUDA deposit and waits to be SIGKILLed (argv: socket, step,
#: marker, base key JSON); half_written: the slab is mapped read-write and half the tensors are copied in
ENGINE = """
import asyncio, json, sys, threading
from pathlib import Path
import torch
from tests.gpu.test_deposit_cuda import gpu_tensors, recipe
from wcache.channel import connect, expect
from wcache.client import cuda
from wcache.plan.key import WeightCacheKey
from wcache.proto import Deposit, DepositSlab, DepositTensor

async def main(sock, step, marker, base):
    ts = gpu_tensors()
    ch, _ = await connect(Path(sock), software="gpu-deposit-engine", name=step)
    table = tuple(DepositTensor(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in ts.items())
    await ch.send(Deposit(id=ch.conn.next_request_id(), key=recipe(base).to_wire(), tensors=table))
    keep = []
    if step != "deposit_sent":
        frame, fds = await expect(ch)
        assert isinstance(frame, DepositSlab) and frame.slabs[0].kind == "cuda_vmm", frame
        if step == "half_written":
            desc = frame.slabs[0]
            buf, ro = cuda.vmm_import(fds[0], desc.offset, desc.size, 0, read_only=False)
            assert not ro
            base_t = buf.tensor()
            for e in list(frame.tensors)[: len(frame.tensors) // 2]:
                src = ts[e.name].contiguous().reshape(-1).view(torch.uint8).to("cuda:0")
                base_t[e.offset : e.offset + src.numel()].copy_(src)
            torch.cuda.synchronize()
            keep.append(buf)
    Path(marker).touch()
    threading.Event().wait()

sock, step, marker, key_json = sys.argv[1:5]
asyncio.run(main(sock, step, marker, WeightCacheKey.from_wire(json.loads(key_json))))
"""


@pytest.mark.parametrize("step", ["deposit_sent", "slab_received", "half_written"])
async def test_engine_sigkilled_mid_deposit_leaves_nothing_and_gives_the_memory_back(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path, step: str
) -> None:
    d = daemon_factory(ckpt, "--device", "cuda:0")
    base = WeightCacheKey.from_checkpoint(ckpt)
    key = recipe(base)
    torch.empty(1, device="cuda:0")
    before = gpu_free()
    marker = tmp_path / "at-step"
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(d.socket), step, str(marker), json.dumps(base.to_wire())],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    try:
        await wait_for(lambda: marker.exists() or engine.poll() is not None, 120, f"engine reached {step}")
        assert engine.poll() is None, f"the engine exited with {engine.returncode} before {step}"
        if step != "deposit_sent":  # the daemon holds the slab now: the measure below can see it go
            assert gpu_free() <= before - BIG
        os.kill(engine.pid, signal.SIGKILL)
        assert engine.wait(30) == -signal.SIGKILL
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    assert key.short() not in await origins(d)
    # the engine's context and the daemon's slab are gone: free memory back to within 64 MiB of before
    # (the daemon may have made its own small allocations meanwhile)
    await wait_for(lambda: gpu_free() >= before - 64 * MIB, why=f"GPU memory back after a kill at {step}")
    await WCacheClient(d.socket).deposit(key, gpu_tensors())  # the key is free for the next engine
    assert (await origins(d))[key.short()] == "deposit"


async def test_deposited_gpu_slab_is_kept_and_handed_over_like_a_loaded_one(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path
) -> None:
    """KEEP sends the deposit's VMM fd to the keeper (under its recipe key); a takeover daemon
    adopts the deposited slab (no load, origin "takeover") and serves the same bytes under the recipe key."""
    from wcache.server.process import spawn_daemon, spawn_keeper

    keeper = spawn_keeper(socket_dir)
    new: DaemonProc | None = None
    try:
        old = daemon_factory(ckpt, "--device", "cuda:0", "--keeper")
        key = recipe(WeightCacheKey.from_checkpoint(ckpt))
        ts = gpu_tensors()
        await WCacheClient(old.socket).deposit(key, ts)

        async def kept() -> bool:
            return key.to_wire() in [dict(m.key) for m in (await WCacheClient(keeper.socket).status()).models]

        deadline = time.monotonic() + 30
        while not await kept():
            assert time.monotonic() < deadline, "the keeper never held the deposit"
            await asyncio.sleep(0.05)
        new = spawn_daemon(None, socket_dir, "--device", "cuda:0", "--keeper", takeover=old.socket, timeout=120)
        assert old.proc.wait(60) == 0
        assert (await origins(new))[key.short()] == "takeover"
        async with await WCacheClient(new.socket).fetch(key) as w:
            assert w.server.server_pid == new.pid
            assert all(torch.equal(bits(w[n]), bits(t)) for n, t in ts.items())
    finally:
        if new is not None:
            new.stop()
        keeper.stop()
