"""Llama-shaped synthetic checkpoints, made locally (no downloads) for the demo, tests and
benchmarks. Values are random; shapes, names, config.json and the sharded index are
what Hugging Face writes for LlamaForCausalLM.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from wcache.files import created_mode

__all__ = [
    "FP8_TINY",
    "LLAMA3_8B",
    "TINY",
    "LlamaShape",
    "make_fp8_llama_checkpoint",
    "make_llama_checkpoint",
    "shape_for_size",
]


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_word_embeddings: bool = False

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                (p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (self.intermediate, h)),
                (p + "mlp.up_proj.weight", (self.intermediate, h)),
                (p + "mlp.down_proj.weight", (h, self.intermediate)),
            ]
        out.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab, h)))
        return out

    def config(self, dtype: str) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "hidden_act": "silu",
            "torch_dtype": dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }

    def nbytes(self, itemsize: int = 2) -> int:
        """Bytes of every tensor together (the checkpoint's payload) at ``itemsize`` bytes per element."""
        total = 0
        for _, shape in self.tensors():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total * itemsize


def shape_for_size(nbytes: int, itemsize: int = 2) -> LlamaShape:
    """The Llama shape of the widest hidden size (4096 down to 64) whose embeddings and four layers (one, for
    the smallest sizes) fit in ``nbytes``, with as many layers as then fit: a checkpoint of at most ``nbytes``,
    close to it, that shards at tensor-parallel sizes 1, 2 and 4. ValueError below the smallest (one 64-wide
    layer)."""
    shapes = []
    for hidden in (4096, 2048, 1024, 512, 256, 128, 64):
        heads = hidden // 128 if hidden >= 1024 else max(4, hidden // 64)
        vocab = 32000 if hidden >= 1024 else 4096 if hidden >= 256 else 512
        shapes.append(LlamaShape(hidden, round(hidden * 2.75 / 64) * 64, 0, heads, max(4, heads // 4), vocab))
    for least in (4, 1):
        for base in shapes:
            fixed = base.nbytes(itemsize)
            per_layer = dataclasses.replace(base, layers=1).nbytes(itemsize) - fixed
            if fixed + least * per_layer <= nbytes:
                return dataclasses.replace(base, layers=(nbytes - fixed) // per_layer)
    smallest = dataclasses.replace(shapes[-1], layers=1).nbytes(itemsize)
    raise ValueError(f"a Llama-shaped checkpoint needs at least {smallest} bytes (one 64-wide layer), not {nbytes}")


#: Llama-3-8B shapes: 291 tensors, 16.06 GB in bf16.
LLAMA3_8B = LlamaShape(4096, 14336, 32, 32, 8, 128256)
#: A few MB: the demo's and the tests' default.
TINY = LlamaShape(hidden=256, intermediate=688, layers=4, heads=8, kv_heads=4, vocab=4096)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A safetensors file as ``save_pretrained`` writes it, with the mode the other files get (the library's
    writer makes it 0600 whatever the umask)."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, created_mode())


def make_llama_checkpoint(
    path: str | os.PathLike[str],
    shape: LlamaShape = TINY,
    *,
    dtype: torch.dtype = torch.bfloat16,
    shards: int = 1,
    seed: int = 0,
    device: str = "cpu",
) -> Path:
    """Write ``config.json`` and ``shards`` safetensors files (+ index when > 1) under ``path``."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    names = shape.tensors()
    gen = torch.Generator(device=device).manual_seed(seed)
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(shards):
        chunk = names[s * per : (s + 1) * per]
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for name, shp in chunk:
            t = torch.randn(shp, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype)
            tensors[name] = t.cpu()
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        _save(tensors, root / fname)
        del tensors
    dtype_name = str(dtype).removeprefix("torch.")
    (root / "config.json").write_text(json.dumps(shape.config(dtype_name), indent=2) + "\n")
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (root / "wcache-synthetic.json").write_text(json.dumps({"shape": asdict(shape), "seed": seed}) + "\n")
    return root


#: FP8 block-wise: every projection is whole 128-blocks at TP=1 and TP=2 (k/v too: no GQA).
FP8_TINY = LlamaShape(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=4, vocab=1024)
_FP8_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FP8_FMT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def quantize_blockwise(
    w: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)`` with ``w ≈ q * scale_inv`` per block: scale_inv [ceil(out/b0), ceil(in/b1)]
    float32, as DeepSeek-V3 / Qwen3-FP8 store it (edge blocks may be partial)."""
    out, inp = w.shape
    b0, b1 = block
    so, si = -(-out // b0), -(-inp // b1)
    padded = torch.zeros(so * b0, si * b1, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w.float()
    amax = padded.reshape(so, b0, si, b1).abs().amax(dim=(1, 3))
    scale = amax.clamp(min=1e-12) / torch.finfo(dtype).max
    full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:out, :inp]
    return (w.float() / full).to(dtype), scale.contiguous()


def make_fp8_llama_checkpoint(
    path: str | os.PathLike[str],
    shape: LlamaShape = FP8_TINY,
    *,
    block: tuple[int, int] = (128, 128),
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    seed: int = 0,
) -> Path:
    """An FP8 block-wise Llama checkpoint in one file: each ``*_proj.weight`` in ``fp8_dtype`` with its
    float32 ``weight_scale_inv``; embeddings, norms and ``lm_head`` in bf16; config.json with
    ``quantization_config`` (quant_method fp8, dynamic activations, ``weight_block_size``)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shp in shape.tensors():
        w = torch.randn(shp, generator=gen, dtype=torch.float32).mul_(0.02)
        if name.rsplit(".", 2)[-2] in _FP8_PROJ:
            tensors[name], tensors[name + "_scale_inv"] = quantize_blockwise(w, block, fp8_dtype)
        else:
            tensors[name] = w.to(torch.bfloat16)
    _save(tensors, root / "model.safetensors")
    config = shape.config("bfloat16")
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": _FP8_FMT[fp8_dtype],
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    meta = {"shape": asdict(shape), "seed": seed, "fp8": {"block": list(block), "dtype": str(fp8_dtype)}}
    (root / "wcache-synthetic.json").write_text(json.dumps(meta) + "\n")
    return root


if __name__ == "__main__":  # python -m wcache.synthetic DIR [--size SIZE ...]: ``wcache make-checkpoint``
    from wcache.cli import make_checkpoint_main

    # named as it was run, as argparse names a module run with -m from Python 3.14 on
    here = __spec__  # None: run as a file
    prog = f"{os.path.basename(sys.executable)} -m {here.name}" if here is not None else os.path.basename(sys.argv[0])
    sys.exit(make_checkpoint_main(prog))
