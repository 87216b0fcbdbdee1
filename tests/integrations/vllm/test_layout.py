"""The daemon's vLLM parameter layout (``--transform wcache.transforms:vllm_layout``) as vLLM takes it: the padded
vocabulary cut where vLLM's VocabParallelEmbedding takes each rank's rows (against vLLM's own functions where vLLM
is installed, and required to be in the vLLM job), MoE experts stacked as FusedMoE holds them, and two rank daemons
serving it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import DaemonProc


def test_vllm_layout_pads_the_vocabulary_and_stacks_experts() -> None:
    import torch

    from wcache.errors import ShardingError
    from wcache.transforms import vllm_layout

    emb = torch.randn(1000, 8)
    out = vllm_layout({"model.embed_tokens.weight": emb, "lm_head.weight": emb}, {"vocab_size": 1000})
    assert (
        out["model.embed_tokens.weight"].shape == (1024, 8)
        and out["lm_head.weight"] is out["model.embed_tokens.weight"]
    )
    assert torch.equal(out["lm_head.weight"][:1000], emb) and not out["lm_head.weight"][1000:].any()
    # rank 1 of 2: vLLM's share is 512 rows (1024 / 2), of which 488 real ones (the daemon cut rows 512..999)
    out = vllm_layout({"lm_head.weight": emb[512:]}, {"vocab_size": 1000, "wcache_tp_size": 2, "wcache_tp_rank": 1})
    assert out["lm_head.weight"].shape == (512, 8) and torch.equal(out["lm_head.weight"][:488], emb[512:])
    with pytest.raises(ShardingError, match="not split as vLLM splits it"):  # an even split: 500 rows at rank 0
        vllm_layout({"lm_head.weight": emb[:600]}, {"vocab_size": 1000, "wcache_tp_size": 2})
    p = "model.layers.0.mlp.experts"
    experts = {f"{p}.{j}.{k}.weight": torch.full((4, 2), float(j)) for j in range(3) for k in ("gate_proj", "up_proj")}
    experts |= {f"{p}.{j}.down_proj.weight": torch.full((2, 4), float(j)) for j in range(3)}
    out = vllm_layout(experts, {"vocab_size": 64})
    assert set(out) == {f"{p}.w13_weight", f"{p}.w2_weight"}
    assert out[f"{p}.w13_weight"].shape == (3, 8, 2) and out[f"{p}.w2_weight"].shape == (3, 2, 4)
    assert torch.equal(out[f"{p}.w13_weight"][2], torch.full((8, 2), 2.0))


@pytest.mark.parametrize(("vocab", "tp"), [(1000, 2), (32016, 2), (32016, 4), (32000, 4), (151936, 8), (1000, 1)])
def test_padded_vocab_shards_are_vllms(vocab: int, tp: int) -> None:
    """The daemon cuts each rank's embedding rows where vLLM's VocabParallelEmbedding takes them from the
    checkpoint: vLLM's own pad_vocab_size / vocab_range_from_global_vocab_size (when vLLM is installed),
    else the formula they implement."""
    from wcache.plan.sharding import padded_vocab_shard

    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            pad_vocab_size,
            vocab_range_from_global_vocab_size,
        )
    except ImportError:
        if os.environ.get("WCACHE_REQUIRE_VLLM") == "1":
            raise  # the vLLM job checks against vLLM's own functions

        def pad_vocab_size(v: int, pad_to: int = 64) -> int:
            return -(-v // pad_to) * pad_to

        def vocab_range_from_global_vocab_size(v: int, rank: int, world: int) -> tuple[int, int]:
            per = v // world
            return rank * per, (rank + 1) * per

    padded = pad_vocab_size(vocab, 64)
    for rank in range(tp):
        first, last = vocab_range_from_global_vocab_size(padded, rank, tp)
        shard = padded_vocab_shard("lm_head.weight", vocab, rank, tp, 64)
        assert (shard.start, shard.start + shard.length) == (first, min(last, vocab))


async def test_two_rank_daemons_serve_vllms_padded_vocabulary(
    daemon_factory: Callable[..., DaemonProc], tmp_path: Path
) -> None:
    """TP=2, a 1000-row vocabulary: vLLM pads it to 1024 and gives each rank 512 rows; each daemon serves its
    rank's rows in that layout (rank 1: checkpoint rows 512..999 and 24 zero rows)."""
    import torch
    from safetensors.torch import load_file

    from wcache import WCacheClient, WeightCacheKey
    from wcache.nn import load_from_disk
    from wcache.synthetic import LlamaShape, make_llama_checkpoint

    transform = "wcache.transforms:vllm_layout"
    model = make_llama_checkpoint(tmp_path / "m", LlamaShape(64, 128, 1, 4, 2, 1000), seed=3)
    full = load_file(str(model / "model.safetensors"))
    for rank in (0, 1):
        d = daemon_factory(model, "--tp-rank", str(rank), "--tp-size", "2", "--transform", transform)
        key = WeightCacheKey.from_checkpoint(model, tp_rank=rank, tp_size=2, transform=transform)
        disk = load_from_disk(model, tp_rank=rank, tp_size=2, transform=transform)  # the engine's fallback
        async with await WCacheClient(d.socket).fetch(key) as w:
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                got, real = w[name], full[name][rank * 512 : (rank + 1) * 512]
                assert got.shape == (512, 64)
                assert torch.equal(got[: len(real)], real) and not got[len(real) :].any()
                assert torch.equal(disk[name], got)
