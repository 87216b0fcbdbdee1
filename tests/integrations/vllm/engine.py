"""One vLLM engine process for the end-to-end job: ``python -m tests.integrations.vllm.engine SPEC.json``.

SPEC: {"out": DIR, "runs": [{"name", "model", "dtype", "load_format", "extra", "hold", "digest"}...]}. Each run
builds an ``LLM`` (CPU, eager), generates greedily from fixed token ids with logprobs, asks the worker what the
plugin recorded on the model and which linear layers vLLM packed into a kernel's handle (``apply_model``; with
``digest``, a SHA-256 of every tensor it keeps), writes
``DIR/NAME.json``, and — with ``hold`` — writes ``DIR/NAME.ready`` and serves on until ``DIR/NAME.go`` appears
(the test inspects the daemon meanwhile), then shuts the engine down. A run whose ``LLM()`` raises records the error. Runs in vLLM's own virtualenv, not the test's.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

PROMPTS = [[1, 5, 9, 300 + i] for i in range(4)]
HOLD_DEADLINE_S = 300.0


def state_digest(model: Any) -> dict[str, str]:
    """Every parameter and buffer the model keeps after post-processing: ``name -> "dtype shape sha256"``
    (a tied tensor under each name), for comparing two loads bit for bit through ``LLM.apply_model``."""
    import hashlib

    import torch

    out: dict[str, str] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t is None or t.is_meta:
            out[n] = "meta"
            continue
        data = t.detach().cpu().contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0)
        out[n] = f"{t.dtype} {tuple(t.shape)} {hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]}"
    return out


def packed_linears(model: Any) -> list[str]:
    """The linear layers whose weight vLLM's CPU post-processing moved into a kernel's handle (oneDNN or sgl-kernel:
    ``cpu_linear`` set, the weight left an empty placeholder), by module name. Where neither can build the matmul
    (oneDNN's bf16 on a CPU without bf16 instructions) vLLM keeps the weight and calls torch's linear: none."""
    return sorted(
        n
        for n, m in model.named_modules()
        if hasattr(m, "cpu_linear") and getattr(m, "weight", None) is not None and m.weight.numel() == 0
    )


def run(spec: dict[str, Any], out: Path) -> None:
    from vllm import LLM, SamplingParams

    from wcache.integrations.vllm import model_info

    name = spec["name"]
    print(f"=== RUN {name}", flush=True)
    kw: dict[str, Any] = {}
    if spec.get("load_format", "auto") != "auto":
        kw = {"load_format": spec["load_format"], "model_loader_extra_config": spec.get("extra", {})}
    result: dict[str, Any] = {"name": name}
    started = time.perf_counter()
    try:
        llm = LLM(
            model=spec["model"],
            dtype=spec.get("dtype", "bfloat16"),
            enforce_eager=True,
            max_model_len=256,
            skip_tokenizer_init=True,
            seed=0,
            **kw,
        )
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
        (out / f"{name}.json").write_text(json.dumps(result))
        print(f"=== END {name}", flush=True)
        return
    result["start_s"] = time.perf_counter() - started
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=3, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    result["logprobs"] = [
        [{str(k): v.logprob for k, v in step.items()} for step in (o.outputs[0].logprobs or [])] for o in outs
    ]
    result["model"] = llm.apply_model(model_info)[0]
    from tests.integrations.vllm.engine import packed_linears as packed  # by reference for the worker

    result["packed"] = llm.apply_model(packed)[0]
    if spec.get("digest"):
        from tests.integrations.vllm.engine import state_digest as digest  # by reference for the worker

        result["state"] = llm.apply_model(digest)[0]
    (out / f"{name}.json").write_text(json.dumps(result))
    if spec.get("hold"):
        (out / f"{name}.ready").write_text(str(os.getpid()))
        deadline = time.monotonic() + HOLD_DEADLINE_S
        while not (out / f"{name}.go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        # still serving while the test looked: one more generation on the daemon's memory
        again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], sp, use_tqdm=False)
        (out / f"{name}.again.json").write_text(json.dumps(list(again[0].outputs[0].token_ids)))
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    print(f"=== END {name}", flush=True)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    for r in spec["runs"]:
        run(r, out)


if __name__ == "__main__":
    main()
