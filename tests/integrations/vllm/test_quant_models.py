"""The hand-built quantized checkpoints without vLLM: same seed, same bytes; each file holds what its format's
``quantization_config`` promises. (That vLLM dequantizes them to the float layer is test_quant.py's job.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integrations.vllm.models import LLAMA
from tests.integrations.vllm.quant_models import BUILDERS, GROUP, make_quantized

Q = "model.layers.0.self_attn.q_proj."


@pytest.mark.parametrize("method", BUILDERS)
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path, method: str) -> None:
    a = make_quantized(tmp_path / "a", method, seed=0)
    b = make_quantized(tmp_path / "b", method, seed=0)
    c = make_quantized(tmp_path / "c", method, seed=1)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert "quantization_config" in json.loads((a / "config.json").read_text())


def test_tensor_names_dtypes_and_shapes(tmp_path: Path) -> None:
    h = LLAMA.hidden
    want: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {
        "ct_w8a8_int8": {"weight": (torch.int8, (h, h)), "weight_scale": (torch.float32, (h, 1))},
        "ct_w4a16": {
            "weight_packed": (torch.int32, (h, h // 8)),
            "weight_scale": (torch.bfloat16, (h, h // GROUP)),
            "weight_shape": (torch.int64, (2,)),
        },
        "ct_w8a16": {"weight_packed": (torch.int32, (h, h // 4))},
        "ct_fp8": {"weight": (torch.float8_e4m3fn, (h, h)), "weight_scale": (torch.float32, (h, 1))},
        "awq": {
            "qweight": (torch.int32, (h, h // 8)),
            "qzeros": (torch.int32, (h // GROUP, h // 8)),
            "scales": (torch.float16, (h // GROUP, h)),
        },
        "gptq_int4": {
            "qweight": (torch.int32, (h // 8, h)),
            "qzeros": (torch.int32, (h // GROUP, h // 8)),
            "scales": (torch.float16, (h // GROUP, h)),
            "g_idx": (torch.int32, (h,)),
        },
        "gptq_int8": {"qweight": (torch.int32, (h // 4, h)), "qzeros": (torch.int32, (h // GROUP, h // 4))},
        "fp8": {"weight": (torch.float8_e4m3fn, (h, h)), "weight_scale": (torch.float32, ())},
    }
    for method, tensors in want.items():
        t = load_file(str(make_quantized(tmp_path / method, method) / "model.safetensors"))
        for name, (dtype, shape) in tensors.items():
            assert (t[Q + name].dtype, tuple(t[Q + name].shape)) == (dtype, shape), (method, name)
        assert t["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_gptq_int4_unpacks_to_values_around_its_zero(tmp_path: Path) -> None:
    """Nibble k of word j along ``in`` is row 8j + k; symmetric values sit around 8 and span the range."""
    t = load_file(str(make_quantized(tmp_path / "g", "gptq_int4") / "model.safetensors"))
    packed = t[Q + "qweight"].to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(packed >> (4 * k)) & 0xF for k in range(8)], dim=1).reshape(-1, packed.shape[1])
    assert q.shape == (LLAMA.hidden, LLAMA.hidden)
    assert (int(q.min()), int(q.max())) == (1, 15)  # round(w / (amax / 7)) + 8: -7..7 shifted
    assert abs(float(q.float().mean()) - 8) < 0.5
    zeros = t[Q + "qzeros"].to(torch.int64) & 0xFFFFFFFF
    assert all(bool((((zeros >> (4 * k)) & 0xF) == 7).all()) for k in range(8))  # zero - 1, GPTQ v1
