"""Tiny quantized Llama checkpoints for vLLM, written by hand (no quantization library, no downloads).

Each builder takes the float32 weights of the same seeded tiny Llama (``tests.integrations.vllm.models.LLAMA``
shape; ``FP8_TINY`` for block-wise FP8, whose 128x128 blocks need 256-wide projections), quantizes every
``*_proj`` linear weight the way the format's producer does (llm-compressor, AutoAWQ, AutoGPTQ, DeepSeek-V3's
FP8 release) and writes ``model.safetensors`` + ``config.json`` with its ``quantization_config``. Embeddings, norms
and ``lm_head`` stay bf16 (every format here leaves them unquantized). The names, dtypes and packings are the
ones vLLM 0.32's ``create_weights`` expects:

========================  ================================================================================
``ct_w8a8_int8``          compressed-tensors ``int-quantized``: ``weight`` int8 [out, in], ``weight_scale``
                          float32 [out, 1] (channel); activations int8 dynamic per token
``ct_w4a16``              compressed-tensors ``pack-quantized`` 4-bit symmetric, group 32: ``weight_packed``
                          int32 [out, in/8] (value + 8, nibble k of word j = column 8j + k),
                          ``weight_scale`` bf16 [out, in/32], ``weight_shape`` int64 [2]
``ct_w8a16``              the same, 8-bit (value + 128, 4 per int32)
``ct_fp8``                compressed-tensors ``float-quantized``: ``weight`` float8_e4m3fn [out, in],
                          ``weight_scale`` float32 [out, 1]; activations FP8 dynamic per token
``awq``                   AutoAWQ GEMM 4-bit, zero point, group 32: ``qweight`` int32 [in, out/8] packed along
                          out in AWQ's order (0 2 4 6 1 3 5 7), ``qzeros`` int32 [in/32, out/8] likewise,
                          ``scales`` fp16 [in/32, out]
``gptq_int4`` / ``_int8``  AutoGPTQ symmetric, group 32, no act-order: ``qweight`` int32 [in/8 (in/4), out]
                          packed along in, ``qzeros`` int32 (zero - 1, GPTQ v1), ``scales`` fp16 [in/32, out],
                          ``g_idx`` int32 [in]
``fp8``                   vLLM ``fp8`` per-tensor: ``weight`` float8_e4m3fn, ``weight_scale`` float32 scalar
``fp8_block``             vLLM ``fp8`` block-wise 128x128 (``weight_scale_inv``), ``wcache.synthetic``'s builder
========================  ================================================================================
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.integrations.vllm.models import LLAMA
from wcache.synthetic import FP8_TINY, LlamaShape, make_fp8_llama_checkpoint

__all__ = ["BUILDERS", "GROUP", "float_weights", "make_quantized"]

GROUP = 32
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
Tensors = dict[str, torch.Tensor]


def float_weights(shape: LlamaShape, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen, dtype=torch.float32).mul_(0.02) for n, s in shape.tensors()}


def _pack(q: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack unsigned ``bits``-wide values along ``dim`` into int32: value k of each word at bits ``k*bits``;
    with ``order``, word slot k holds the group's element ``order[k]`` (AWQ's interleave)."""
    per = 32 // bits
    q = q.to(torch.int64).movedim(dim, -1)
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)
    if order is not None:
        q = q[..., list(order)]
    word = torch.zeros(q.shape[:-1], dtype=torch.int64)
    for k in range(per):
        word |= q[..., k] << (bits * k)
    word = torch.where(word >= 2**31, word - 2**32, word)  # two's complement into int32
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def _sym_groups(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group quantization along ``in``: ``(q signed [out, in], scale float32 [out, in/GROUP])``."""
    out, inp = w.shape
    g = w.reshape(out, inp // GROUP, GROUP)
    qmax = 2 ** (bits - 1) - 1
    scale = g.abs().amax(-1).clamp(min=1e-8) / qmax
    q = torch.round(g / scale[..., None]).clamp(-qmax - 1, qmax).to(torch.int64)
    return q.reshape(out, inp), scale


def _ct_int8(name: str, w: torch.Tensor) -> Tensors:
    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
    return {name: torch.round(w / scale).clamp(-127, 127).to(torch.int8), name + "_scale": scale}


def _ct_fp8(name: str, w: torch.Tensor) -> Tensors:
    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-8) / torch.finfo(torch.float8_e4m3fn).max
    return {name: (w / scale).to(torch.float8_e4m3fn), name + "_scale": scale}


def _ct_pack(bits: int) -> Callable[[str, torch.Tensor], Tensors]:
    def quant(name: str, w: torch.Tensor) -> Tensors:
        q, scale = _sym_groups(w, bits)
        base = name.removesuffix(".weight")
        return {
            base + ".weight_packed": _pack(q + 2 ** (bits - 1), bits, 1),
            base + ".weight_scale": scale.to(torch.bfloat16),
            base + ".weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
        }

    return quant


def _gptq(bits: int) -> Callable[[str, torch.Tensor], Tensors]:
    def quant(name: str, w: torch.Tensor) -> Tensors:
        q, scale = _sym_groups(w, bits)
        zero = 2 ** (bits - 1)
        base = name.removesuffix(".weight")
        groups, out = w.shape[1] // GROUP, w.shape[0]
        return {
            base + ".qweight": _pack((q + zero).t(), bits, 0),
            base + ".qzeros": _pack(torch.full((groups, out), zero - 1), bits, 1),
            base + ".scales": scale.t().contiguous().to(torch.float16),
            base + ".g_idx": (torch.arange(w.shape[1]) // GROUP).to(torch.int32),
        }

    return quant


def _awq(name: str, w: torch.Tensor) -> Tensors:
    out, inp = w.shape
    g = w.t().reshape(inp // GROUP, GROUP, out)  # [groups, GROUP, out]
    lo, hi = g.amin(1), g.amax(1)
    scale = ((hi - lo).clamp(min=1e-8) / 15).to(torch.float16).float()
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale[:, None] + zero[:, None]).clamp(0, 15).reshape(inp, out)
    base = name.removesuffix(".weight")
    return {
        base + ".qweight": _pack(q, 4, 1, _AWQ_ORDER),
        base + ".qzeros": _pack(zero, 4, 1, _AWQ_ORDER),
        base + ".scales": scale.to(torch.float16),
    }


def _fp8_tensor(name: str, w: torch.Tensor) -> Tensors:
    scale = w.abs().amax().clamp(min=1e-8) / torch.finfo(torch.float8_e4m3fn).max
    return {name: (w / scale).to(torch.float8_e4m3fn), name + "_scale": scale.reshape(())}


def _ct_config(fmt: str, weights: dict[str, Any], acts: dict[str, Any] | None) -> dict[str, Any]:
    group: dict[str, Any] = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }


def _ct_weights(bits: int, kind: str, strategy: str, group_size: int | None = None) -> dict[str, Any]:
    return {
        "num_bits": bits,
        "type": kind,
        "symmetric": True,
        "strategy": strategy,
        "group_size": group_size,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
    }


def _ct_dynamic_acts(kind: str) -> dict[str, Any]:
    return {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token", "dynamic": True, "observer": None}


def _gptq_config(bits: int) -> dict[str, Any]:
    return {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": False, "sym": True}


#: method name -> (per-weight quantizer, quantization_config)
_FORMATS: dict[str, tuple[Callable[[str, torch.Tensor], Tensors], dict[str, Any]]] = {
    "ct_w8a8_int8": (
        _ct_int8,
        _ct_config("int-quantized", _ct_weights(8, "int", "channel"), _ct_dynamic_acts("int")),
    ),
    "ct_w4a16": (_ct_pack(4), _ct_config("pack-quantized", _ct_weights(4, "int", "group", GROUP), None)),
    "ct_w8a16": (_ct_pack(8), _ct_config("pack-quantized", _ct_weights(8, "int", "group", GROUP), None)),
    "ct_fp8": (
        _ct_fp8,
        _ct_config("float-quantized", _ct_weights(8, "float", "channel"), _ct_dynamic_acts("float")),
    ),
    "awq": (_awq, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}),
    "gptq_int4": (_gptq(4), _gptq_config(4)),
    "gptq_int8": (_gptq(8), _gptq_config(8)),
    "fp8": (_fp8_tensor, {"quant_method": "fp8", "activation_scheme": "dynamic"}),
}


def make_quantized(path: Path, method: str, *, seed: int = 0) -> Path:
    """Write the tiny Llama quantized with ``method`` (a key of ``BUILDERS``) under ``path``; same seed, same
    bytes."""
    if method == "fp8_block":
        return make_fp8_llama_checkpoint(path, FP8_TINY, seed=seed)
    quant, qconfig = _FORMATS[method]
    path.mkdir(parents=True, exist_ok=True)
    tensors: Tensors = {}
    for name, w in float_weights(LLAMA, seed).items():
        if name.rsplit(".", 2)[-2] in _PROJ:
            tensors.update(quant(name, w))
        else:
            tensors[name] = w.to(torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = LLAMA.config("bfloat16")
    config["quantization_config"] = qconfig
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


#: every format this module builds
BUILDERS: tuple[str, ...] = (*_FORMATS, "fp8_block")
