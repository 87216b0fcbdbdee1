"""A minimal Llama forward pass, TP=1 or tensor-parallel over torch.distributed.

Column-parallel q/k/v/gate/up (each rank holds its heads / its slice of the MLP),
row-parallel o/down followed by an all-reduce, vocab-parallel embedding and lm_head
(gathered) — exactly the sharding wcache's built-in Llama plan serves. Used by
benchmarks/tp2_bench.py to check that weights served by two daemons on two GPUs give
the same logits as TP=1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["llama_forward"]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    # x: [T, H, D]
    t, _, d = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _all_reduce(x: torch.Tensor, tp: int) -> torch.Tensor:
    if tp > 1:
        dist.all_reduce(x)
    return x


def llama_forward(
    w: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], tokens: torch.Tensor, tp: int = 1
) -> torch.Tensor:
    """Logits [T, vocab] (full vocab on every rank) for one sequence ``tokens`` [T]."""
    hidden = cfg["hidden_size"]
    heads, kv_heads = cfg["num_attention_heads"] // tp, cfg["num_key_value_heads"] // tp
    hd = hidden // cfg["num_attention_heads"]
    eps, theta = cfg.get("rms_norm_eps", 1e-5), cfg.get("rope_theta", 10000.0)
    rank = dist.get_rank() if tp > 1 else 0
    emb = w["model.embed_tokens.weight"]  # [vocab/tp, hidden]
    lo = rank * emb.shape[0]
    local = tokens - lo
    inside = (local >= 0) & (local < emb.shape[0])
    x = emb[local.clamp(0, emb.shape[0] - 1)] * inside[:, None].to(emb.dtype)
    x = _all_reduce(x, tp)
    t = tokens.shape[0]
    mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(t, heads, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(t, kv_heads, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, kv_heads, hd)
        q, k = _rope(q, theta), _rope(k, theta)
        rep = heads // kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = torch.einsum("thd,shd->hts", q.float(), k.float()) / hd**0.5 + mask
        o = torch.einsum("hts,shd->thd", att.softmax(-1), v.float()).to(x.dtype).reshape(t, heads * hd)
        x = x + _all_reduce(o @ w[p + "self_attn.o_proj.weight"].T, tp)
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        m = F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + _all_reduce(m @ w[p + "mlp.down_proj.weight"].T, tp)
    x = _rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", emb)
    logits = x.float() @ head.float().T  # [T, vocab/tp]
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits)
        logits = torch.cat(parts, dim=-1)
    return logits
