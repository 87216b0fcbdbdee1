"""Tiny checkpoints for the vLLM end-to-end job, built locally (no downloads): a Llama with a vocabulary
vLLM must pad (1000 rows), optionally tied, with a word-level tokenizer so vLLM's OpenAI server can run;
and a Qwen3-MoE (``Qwen3MoeForCausalLM``: per-expert gate/up/down tensors, vLLM's FusedMoE stacks them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from wcache.synthetic import LlamaShape, make_llama_checkpoint

__all__ = ["LLAMA", "add_tokenizer", "make_llama", "make_qwen3_moe"]

#: 1000 rows: vLLM pads embed_tokens / lm_head to 1024
LLAMA = LlamaShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, vocab=1000)


def add_tokenizer(model: Path, vocab: int) -> None:
    """A word-level tokenizer over ``t0 .. t{vocab-1}`` (ids = the numbers) saved the way Hugging Face does."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")  # type: ignore[no-untyped-call]
    fast.save_pretrained(str(model))


def make_llama(path: Path, *, tied: bool = False, seed: int = 0) -> Path:
    shape = LlamaShape(**{**LLAMA.__dict__, "tie_word_embeddings": tied})
    root = make_llama_checkpoint(path, shape, seed=seed)
    add_tokenizer(root, shape.vocab)
    return root


def make_qwen3_moe(
    path: Path,
    *,
    hidden: int = 128,
    experts: int = 8,
    top_k: int = 2,
    moe_intermediate: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    vocab: int = 1024,
    seed: int = 0,
) -> Path:
    """Qwen3-MoE names and config (every layer sparse), bf16, random values."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).mul_(0.05).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:
        return (1 + torch.randn(n, generator=gen).mul_(0.05)).to(torch.bfloat16)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
        t[p + "self_attn.q_proj.weight"] = rnd(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = rnd(hidden, heads * head_dim)
        t[p + "self_attn.q_norm.weight"] = norm(head_dim)
        t[p + "self_attn.k_norm.weight"] = norm(head_dim)
        t[p + "mlp.gate.weight"] = rnd(experts, hidden)
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = rnd(moe_intermediate, hidden)
            t[q + "up_proj.weight"] = rnd(moe_intermediate, hidden)
            t[q + "down_proj.weight"] = rnd(hidden, moe_intermediate)
    t["model.norm.weight"] = norm(hidden)
    t["lm_head.weight"] = rnd(vocab, hidden)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": hidden,
        "intermediate_size": moe_intermediate * 4,
        "moe_intermediate_size": moe_intermediate,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    add_tokenizer(path, vocab)
    return path
