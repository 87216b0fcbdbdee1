"""vLLM on the CPU: ``LLM()`` start-to-ready and ``get_model`` time, wcache vs vLLM's default loader, one run.

Runs in a virtualenv with vLLM (``bash .ci/vllm.sh`` makes ``.venv-vllm``):

    .venv-vllm/bin/python benchmarks/vllm_cpu_bench.py --out benchmarks/results/vllm_cpu-DATE.json

It builds a Llama-shaped checkpoint (default ~0.5 GB bf16, vocabulary 32000), starts a daemon on it with vLLM's
layout (``--transform wcache.transforms:vllm_layout``), and spawns one fresh engine process per sample,
alternating default loader and wcache. Each child times: the spawn to ``LLM()`` returning (imports, engine
start, weights, KV cache, warm-up), ``LLM()`` alone, and ``get_model`` (the model loader's whole job), and
generates 8 greedy tokens so the tokens of both loaders can be compared. The engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``) so that ``get_model`` can be timed around vLLM's own
call. The default loader reads from the page cache (the files were just written): a cold disk would widen
the gap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD = r"""
import json, sys, time
t0 = float(sys.argv[1])
import vllm.v1.worker.cpu_model_runner as runner
from vllm import LLM, SamplingParams
imported = time.time()
spent = {}
orig = runner.get_model
def timed(**kw):
    s = time.perf_counter(); m = orig(**kw); spent["get_model_s"] = time.perf_counter() - s; return m
runner.get_model = timed
kw = json.loads(sys.argv[3])
s = time.perf_counter()
llm = LLM(model=sys.argv[2], dtype="bfloat16", enforce_eager=True, max_model_len=256, skip_tokenizer_init=True,
          distributed_executor_backend="uni", **kw)
spent["llm_s"] = time.perf_counter() - s
spent["spawn_to_ready_s"] = time.time() - t0
spent["import_s"] = imported - t0
out = llm.generate([{"prompt_token_ids": [1, 5, 9, 300]}], SamplingParams(temperature=0, max_tokens=8, detokenize=False),
                   use_tqdm=False)
spent["tokens"] = list(out[0].outputs[0].token_ids)
print("RESULT " + json.dumps(spent), flush=True)
"""


def child(model: Path, kw: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, "-c", CHILD, repr(time.time()), str(model), json.dumps(kw)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            data: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
            return data
    raise RuntimeError(f"child failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def summary(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=3, help="engine processes per loader (default 3)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    args = ap.parse_args()

    import vllm

    from wcache.server.process import spawn_daemon
    from wcache.synthetic import LlamaShape, make_llama_checkpoint

    shape = LlamaShape(args.hidden, args.intermediate, args.layers, 16, 4, 32000)
    with tempfile.TemporaryDirectory(prefix="wcache-vllm-bench-") as tmp:
        work = Path(tmp)
        model = make_llama_checkpoint(work / "llama", shape, seed=0)
        nbytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        sdir = work / "sock"
        sdir.mkdir(mode=0o700)
        daemon = spawn_daemon(model, sdir, "--transform", "wcache.transforms:vllm_layout", timeout=300)
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
        }
        wc = {"load_format": "wcache", "model_loader_extra_config": {"socket": str(daemon.socket), "fallback": False}}
        runs: dict[str, list[dict[str, Any]]] = {"default": [], "wcache": []}
        try:
            child(model, {}, env)  # warm-up: bytecode, page cache, oneDNN's first use
            for _ in range(args.samples):
                runs["default"].append(child(model, {}, env))
                runs["wcache"].append(child(model, wc, env))
        finally:
            daemon.stop()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "what": "vLLM CPU engine start, default loader (page cache warm) vs --load-format wcache (zero_copy)",
        "vllm": vllm.__version__,
        "machine": {"cpus": os.cpu_count()},
        "checkpoint": {"shape": shape.__dict__, "bytes": nbytes},
        "tokens_identical": all(r["tokens"] == runs["default"][0]["tokens"] for rs in runs.values() for r in rs),
    }
    for name, rs in runs.items():
        result[name] = {
            k: summary([r[k] for r in rs]) for k in ("spawn_to_ready_s", "llm_s", "get_model_s", "import_s")
        }
    result["get_model_speedup"] = result["default"]["get_model_s"]["median"] / result["wcache"]["get_model_s"]["median"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: v for k, v in result.items() if k in ("default", "wcache", "get_model_speedup", "tokens_identical")},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
