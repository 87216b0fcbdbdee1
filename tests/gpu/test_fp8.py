"""An FP8 block-wise checkpoint served zero_copy from GPU memory: TP=1 and TP=2 ranks, bytes checked."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import DaemonProc
from wcache import WCacheClient, WeightCacheKey
from wcache.plan.sharding import LLAMA_PLAN
from wcache.synthetic import make_fp8_llama_checkpoint

EXPORTS = ["vmm", "ipc"]
BLOCK = 128
SCALE = "_scale_inv"


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fp8_llama_checkpoint(tmp_path_factory.mktemp("fp8") / "tiny", seed=5)


def same_bytes(gpu: torch.Tensor, ref: torch.Tensor) -> bool:
    return (
        gpu.is_cuda
        and gpu.dtype == ref.dtype
        and gpu.shape == ref.shape
        and torch.equal(gpu.cpu().view(torch.uint8), ref.view(torch.uint8))
    )


@pytest.mark.parametrize("export", EXPORTS)
async def test_fp8_zero_copy_on_gpu(daemon_factory: Callable[..., DaemonProc], fp8_ckpt: Path, export: str) -> None:
    d = daemon_factory(fp8_ckpt, "--device", "cuda:0", "--cuda-export", export)
    torch.empty(1, device="cuda:0")
    allocated_before = torch.cuda.memory_allocated(0)
    ref = load_file(str(fp8_ckpt / "model.safetensors"))
    async with await WCacheClient(d.socket).fetch(WeightCacheKey.from_checkpoint(fp8_ckpt)) as w:
        assert torch.cuda.memory_allocated(0) == allocated_before  # mapped, not copied
        assert w.server.backend == "cuda"
        assert set(w) == set(ref)
        for name, t in ref.items():
            assert same_bytes(w[name], t), name
        q = "model.layers.0.self_attn.q_proj.weight"
        assert w[q].dtype == torch.float8_e4m3fn and w[q + SCALE].dtype == torch.float32
        # the engine's dequantization of the mapped tensors is the checkpoint's
        deq = w[q].float() * w[q + SCALE].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        want = ref[q].float() * ref[q + SCALE].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        assert torch.equal(deq.cpu(), want)


async def test_fp8_tp2_on_one_gpu(daemon_factory: Callable[..., DaemonProc], fp8_ckpt: Path, socket_dir: Path) -> None:
    for r in (0, 1):
        daemon_factory(fp8_ckpt, "--device", "cuda:0", "--tp-size", "2", "--tp-rank", str(r))
    client = WCacheClient(socket_dir=socket_dir)
    keys = [WeightCacheKey.from_checkpoint(fp8_ckpt, tp_rank=r, tp_size=2) for r in (0, 1)]
    ws = await asyncio.gather(*(client.fetch(k) for k in keys))
    try:
        ref = load_file(str(fp8_ckpt / "model.safetensors"))
        for name, full in ref.items():
            weight = name.removesuffix(SCALE)
            dim = LLAMA_PLAN.dim_for(weight)
            for r, w in enumerate(ws):
                if dim is None:
                    assert same_bytes(w[name], full), name
                    continue
                rows = ref[weight].shape[dim] // 2
                n = rows // BLOCK if name.endswith(SCALE) else rows
                assert same_bytes(w[name], full.narrow(dim, r * n, n)), (name, r)
    finally:
        await asyncio.gather(*(w.release() for w in ws))
