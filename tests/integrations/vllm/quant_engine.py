"""One vLLM engine process for the quantized-checkpoint tests:
``python -m tests.integrations.vllm.quant_engine SPEC.json``.

SPEC: {"out": DIR, "runs": [{"name", "model", "dtype"}...]}. Each run builds an ``LLM`` with vLLM's default
loader (CPU, eager, engine core and worker in this process), generates greedily from fixed token ids, asks the worker what ``process_weights_after_loading``
left on the quantized layers (``module_state``, through ``LLM.apply_model``), writes ``DIR/NAME.json`` and shuts
the engine down. A run whose ``LLM()`` or generation raises records the error (type, message, traceback tail) and
the process goes on with the next run. Runs in vLLM's own virtualenv, not the test's.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, cast

import torch

PROMPTS = [[1, 5, 9, 300 + i] for i in range(3)]
MAX_TOKENS = 8
#: the layers whose state is reported in full (one fused attention input, one row-parallel MLP output)
SAMPLE_LAYERS = ("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj")
_MODULE_INTERNALS = {"training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


def _describe(value: Any) -> str:
    if isinstance(value, torch.nn.Parameter):
        return f"Parameter {type(value).__name__} {tuple(value.shape)} {value.dtype}"
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype}"
    if callable(value):
        return f"callable {getattr(value, '__qualname__', type(value).__name__)}"
    return type(value).__name__


def _layer_state(module: torch.nn.Module) -> dict[str, Any]:
    qm = module.quant_method
    scheme = getattr(module, "scheme", None)
    kernels = {
        type(v).__name__: {
            k: _describe(x) for k, x in vars(v).items() if not isinstance(x, (bool, int, float, str, type(None)))
        }
        for o in (qm, scheme)
        if o is not None
        for v in vars(o).values()
        if "Kernel" in type(v).__name__
    }
    attrs = {
        k: _describe(v)
        for k, v in vars(module).items()
        if k not in _MODULE_INTERNALS
        and not k.startswith("_")
        and not isinstance(v, (bool, int, float, str, type(None)))
    }
    return {
        "quant_method": type(qm).__name__,
        "scheme": type(scheme).__name__ if scheme is not None else None,
        "kernels": kernels,
        "supports_pre_processed_weights": bool(getattr(qm, "supports_pre_processed_weights", False)),
        "params": {n: _describe(p) for n, p in module.named_parameters(recurse=False)},
        "buffers": {n: _describe(b) for n, b in module.named_buffers(recurse=False)},
        "attrs": attrs,
    }


def _probe(module: torch.nn.Module, dtype: torch.dtype) -> dict[str, Any]:
    """The layer's output on a fixed input (``x`` returned too): the test compares it with the float layer."""
    inp = cast(int, module.input_size)  # vLLM LinearBase's int; nn.Module types attributes as submodules
    x = torch.randn(4, inp, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        y = module(x)[0]
    return {"x": x.float().tolist(), "y": y.float().tolist()}


def module_state(model: torch.nn.Module) -> dict[str, Any]:
    """What post-processing left: per quant method class its layer count and pre-processed-weights flag; the
    sample layers in full, with their output on a fixed input; placeholders ((0,)-sized parameters) and callables (kernel handles in closures)
    counted over every layer with a quant method."""
    methods: dict[str, dict[str, Any]] = {}
    placeholders: list[str] = []
    handles: list[str] = []
    tensors = 0
    for name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if qm is None or not hasattr(qm, "process_weights_after_loading"):
            continue
        entry = methods.setdefault(
            type(qm).__name__,
            {"layers": 0, "supports_pre_processed_weights": bool(getattr(qm, "supports_pre_processed_weights", False))},
        )
        entry["layers"] += 1
        for pname, p in module.named_parameters(recurse=False):
            tensors += 1
            if p.numel() == 0:
                placeholders.append(f"{name}.{pname}")
        for aname, v in vars(module).items():
            if not aname.startswith("_") and callable(v) and not isinstance(v, (torch.Tensor, torch.nn.Module)):
                handles.append(f"{name}.{aname}")
    sample = {n: _layer_state(m) for n, m in model.named_modules() if n in SAMPLE_LAYERS}
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() > 1)
    for n, m in model.named_modules():
        if n in SAMPLE_LAYERS:
            sample[n]["probe"] = _probe(m, dtype)
    return {"methods": methods, "params": tensors, "placeholders": placeholders, "handles": handles, "sample": sample}


def run(spec: dict[str, Any], out: Path) -> None:
    from vllm import LLM, SamplingParams

    from tests.integrations.vllm.quant_engine import module_state as state  # by reference for the worker

    name = spec["name"]
    print(f"=== RUN {name}", flush=True)
    result: dict[str, Any] = {"name": name, "amx": bool(torch.cpu._is_amx_tile_supported())}
    started = time.perf_counter()
    llm = None
    try:
        llm = LLM(
            model=spec["model"],
            dtype=spec.get("dtype", "bfloat16"),
            enforce_eager=True,
            max_model_len=128,
            skip_tokenizer_init=True,
            seed=0,
            distributed_executor_backend="uni",  # the worker in this process: its exception reaches us as raised
        )
        result["start_s"] = round(time.perf_counter() - started, 2)
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        result["state"] = llm.apply_model(state)[0]
    except Exception as exc:
        result["error_type"] = type(exc).__name__
        result["error"] = str(exc)[:2000]
        result["traceback"] = traceback.format_exc()[-4000:]
    (out / f"{name}.json").write_text(json.dumps(result))
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
        del llm
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()  # the next run initializes its own (one-rank, gloo) process group
    gc.collect()
    print(f"=== END {name}", flush=True)


def main() -> None:
    # the engine core in this process too (with the "uni" executor): a load that fails raises its own
    # exception here instead of vLLM's "Engine core initialization failed", and no process is spawned per run
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # LLM.apply_model(module_state)
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    for r in spec["runs"]:
        run(r, out)


if __name__ == "__main__":
    main()
