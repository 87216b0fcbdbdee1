"""docs/shard-plans.md's example plan (GPT-NeoX) shards a GPT-NeoX-named checkpoint as the page says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from wcache.errors import ShardingError
from wcache.plan.checkpoint import Checkpoint
from wcache.plan.key import WeightCacheKey
from wcache.plan.sharding import Shard, load_plan_file, shard_tensors

DOC = Path(__file__).parents[2] / "docs" / "shard-plans.md"
HIDDEN, VOCAB, FF = 64, 128, 256


def _doc_plan(tmp_path: Path) -> Path:
    block = re.search(r"```json\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    plan = tmp_path / "gpt-neox.json"
    plan.write_text(block.group(1))
    json.loads(block.group(1))
    return plan


def _neox(root: Path) -> Path:
    root.mkdir()
    t: dict[str, torch.Tensor] = {
        "gpt_neox.embed_in.weight": torch.zeros(VOCAB, HIDDEN),
        "embed_out.weight": torch.zeros(VOCAB, HIDDEN),
        "gpt_neox.final_layer_norm.weight": torch.zeros(HIDDEN),
        "gpt_neox.final_layer_norm.bias": torch.zeros(HIDDEN),
    }
    p = "gpt_neox.layers.0."
    for ln in ("input_layernorm", "post_attention_layernorm"):
        t[p + ln + ".weight"] = torch.zeros(HIDDEN)
        t[p + ln + ".bias"] = torch.zeros(HIDDEN)
    t[p + "attention.query_key_value.weight"] = torch.zeros(3 * HIDDEN, HIDDEN)
    t[p + "attention.query_key_value.bias"] = torch.zeros(3 * HIDDEN)
    t[p + "attention.dense.weight"] = torch.zeros(HIDDEN, HIDDEN)
    t[p + "attention.dense.bias"] = torch.zeros(HIDDEN)
    t[p + "attention.rotary_emb.inv_freq"] = torch.zeros(8)
    t[p + "mlp.dense_h_to_4h.weight"] = torch.zeros(FF, HIDDEN)
    t[p + "mlp.dense_h_to_4h.bias"] = torch.zeros(FF)
    t[p + "mlp.dense_4h_to_h.weight"] = torch.zeros(HIDDEN, FF)
    t[p + "mlp.dense_4h_to_h.bias"] = torch.zeros(HIDDEN)
    save_file(t, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    return root


def test_doc_plan_shards_gpt_neox(tmp_path: Path) -> None:
    plan = load_plan_file(_doc_plan(tmp_path))
    ckpt = Checkpoint.open(_neox(tmp_path / "neox"))
    shards = shard_tensors(ckpt.tensors.values(), plan, tp_rank=1, tp_size=2)
    p = "gpt_neox.layers.0."
    assert shards[p + "attention.query_key_value.weight"] == Shard(0, HIDDEN * 3 // 2, HIDDEN * 3 // 2)
    assert shards[p + "mlp.dense_4h_to_h.weight"] == Shard(1, FF // 2, FF // 2)
    assert shards[p + "attention.dense.bias"] is None and shards[p + "input_layernorm.bias"] is None
    assert shards["embed_out.weight"] == Shard(0, VOCAB // 2, VOCAB // 2)
    key = WeightCacheKey.from_checkpoint(ckpt.path, tp_rank=1, tp_size=2, plan_file=tmp_path / "gpt-neox.json")
    assert key.plan == plan.id and key.plan.startswith("file:")


def test_without_a_plan_the_error_names_both_ways_to_give_one(tmp_path: Path) -> None:
    with pytest.raises(ShardingError, match=r"plan_file=.*--shard-plan"):
        WeightCacheKey.from_checkpoint(_neox(tmp_path / "neox"), tp_rank=0, tp_size=2).resolve()
