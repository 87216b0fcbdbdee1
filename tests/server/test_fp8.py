"""An FP8 block-wise checkpoint through real daemons on the host backend: TP=1, TP=2, the fused transform."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import DaemonProc, server_cmd
from wcache import WCacheClient, WeightCacheKey
from wcache.nn import load_from_disk
from wcache.plan.sharding import LLAMA_PLAN
from wcache.synthetic import make_fp8_llama_checkpoint
from wcache.transforms import FUSE_SPEC

BLOCK = 128
SCALE = "_scale_inv"


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fp8_llama_checkpoint(tmp_path_factory.mktemp("fp8") / "tiny", seed=4)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


async def test_tp1_zero_copy_serves_fp8_as_stored(daemon_factory: Callable[..., DaemonProc], fp8_ckpt: Path) -> None:
    d = daemon_factory(fp8_ckpt)
    key = WeightCacheKey.from_checkpoint(fp8_ckpt)
    assert key.dtype == "bfloat16"
    ref = load_file(str(fp8_ckpt / "model.safetensors"))
    async with await WCacheClient(d.socket).fetch(key) as w:
        assert set(w) == set(ref)
        for name, t in ref.items():
            assert same_bytes(w[name], t), name
        assert w["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
        assert w["model.layers.0.self_attn.q_proj.weight_scale_inv"].dtype == torch.float32
        assert len({w[n].untyped_storage().data_ptr() for n in w}) == 1  # zero copy: one mapped slab


async def test_tp2_shards_are_the_expected_slices(
    daemon_factory: Callable[..., DaemonProc], fp8_ckpt: Path, socket_dir: Path
) -> None:
    for r in (0, 1):
        daemon_factory(fp8_ckpt, "--tp-size", "2", "--tp-rank", str(r))
    client = WCacheClient(socket_dir=socket_dir)
    keys = [WeightCacheKey.from_checkpoint(fp8_ckpt, tp_rank=r, tp_size=2) for r in (0, 1)]
    w0, w1 = await asyncio.gather(client.fetch(keys[0]), client.fetch(keys[1]))
    try:
        ref = load_file(str(fp8_ckpt / "model.safetensors"))
        for name, full in ref.items():
            weight = name.removesuffix(SCALE)
            dim = LLAMA_PLAN.dim_for(weight)
            if dim is None:
                assert same_bytes(w0[name], full) and same_bytes(w1[name], full), name
                continue
            rows = ref[weight].shape[dim] // 2
            n = rows // BLOCK if name.endswith(SCALE) else rows
            for r, w in enumerate((w0, w1)):
                assert same_bytes(w[name], full.narrow(dim, r * n, n)), (name, r)
        disk = load_from_disk(fp8_ckpt, tp_rank=1, tp_size=2)  # the engine's fallback gives the same bytes
        assert set(disk) == set(w1) and all(same_bytes(disk[k], w1[k]) for k in disk)
    finally:
        await asyncio.gather(w0.release(), w1.release())


async def test_fused_transform_with_fp8_scales(
    daemon_factory: Callable[..., DaemonProc], fp8_ckpt: Path, socket_dir: Path
) -> None:
    daemon_factory(fp8_ckpt, "--tp-size", "2", "--tp-rank", "1", "--transform", FUSE_SPEC)
    key = WeightCacheKey.from_checkpoint(fp8_ckpt, tp_rank=1, tp_size=2, transform=FUSE_SPEC)
    plain = load_from_disk(fp8_ckpt, tp_rank=1, tp_size=2)
    async with await WCacheClient(socket_dir=socket_dir).fetch(key) as w:
        p = "model.layers.1.self_attn."
        for suffix in (".weight", ".weight" + SCALE):
            fused = torch.cat([plain[p + f"{x}_proj{suffix}"] for x in "qkv"])
            assert same_bytes(w[p + "qkv_proj" + suffix], fused)
        assert p + "q_proj.weight_scale_inv" not in w


def test_daemon_refuses_a_cast_of_an_fp8_checkpoint(fp8_ckpt: Path, socket_dir: Path) -> None:
    out = subprocess.run(
        server_cmd("--model", str(fp8_ckpt), "--socket-dir", str(socket_dir), "--dtype", "float16"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1
    assert "FP8 checkpoint" in out.stderr and "'auto'" in out.stderr
