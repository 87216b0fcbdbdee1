"""An engine that stops in the middle of a deposit (test_deposit.py SIGKILLs it there).

``python -m tests.server.deposit_engine SOCKET STEP MARKER``: runs the deposit of ``tensors()`` under
``recipe_key()`` up to STEP, touches MARKER, and waits to be killed. Steps (docs/protocol.md §4.13):
``deposit_sent`` (DEPOSIT out, reply unread), ``slab_received`` (DEPOSIT_SLAB and its fd in hand),
``half_written`` (mapped writable, half the tensors written), ``commit_sent`` (all written, still mapped,
COMMIT out: the daemon cannot seal a slab this engine maps, so nothing may be published).
"""

from __future__ import annotations

import asyncio
import mmap
import sys
import threading
from pathlib import Path

import torch

from wcache.channel import connect, expect
from wcache.plan.key import WeightCacheKey
from wcache.plan.recipe import RecipeKey
from wcache.proto import Commit, Deposit, DepositSlab, DepositTensor

STEPS = ("deposit_sent", "slab_received", "half_written", "commit_sent")


def recipe_key(base: WeightCacheKey, **extra: str | int) -> RecipeKey:
    return RecipeKey.of(base, engine="test-engine", engine_version="1.0", quantization="fp8", **extra)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "layers.0.weight": torch.randn(64, 48, generator=g).to(torch.float8_e4m3fn),
        "layers.0.weight_scale_inv": torch.rand(1, 1, generator=g),
        "layers.1.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "rotary.inv_freq": torch.rand(16, generator=g),
    }


async def run(socket: Path, step: str, marker: Path, base: WeightCacheKey) -> None:
    ts = tensors()
    ch, _ = await connect(socket, software="deposit-engine", name=f"deposit-engine-{step}")
    table = tuple(DepositTensor(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in ts.items())
    await ch.send(Deposit(id=ch.conn.next_request_id(), key=recipe_key(base).to_wire(), tensors=table))
    if step != "deposit_sent":
        frame, fds = await expect(ch)
        assert isinstance(frame, DepositSlab)
        if step != "slab_received":
            size = frame.slabs[0].size
            mm = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            base_t = torch.frombuffer(mm, dtype=torch.uint8)
            entries = list(frame.tensors)
            todo = entries[: len(entries) // 2] if step == "half_written" else entries
            for e in todo:
                src = ts[e.name].contiguous().reshape(-1).view(torch.uint8)
                base_t[e.offset : e.offset + src.numel()].copy_(src)
            if step == "commit_sent":
                await ch.send(Commit(id=ch.conn.next_request_id(), deposit=frame.deposit))
    marker.touch()
    threading.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    sock, step, mark, key_json = sys.argv[1:5]
    import json

    asyncio.run(run(Path(sock), step, Path(mark), WeightCacheKey.from_wire(json.loads(key_json))))
