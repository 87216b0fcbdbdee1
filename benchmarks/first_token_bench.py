"""Engine restart to first token, with and without the cache, on a GPU.

A daemon serves the 16 GB Llama-3-8B-shaped checkpoint on ``--device``. Fresh engine
processes then build the Hugging Face ``LlamaForCausalLM`` and compute one greedy token:

- ``wcache``: ``wcache.integrations.transformers.from_pretrained`` (config from the
  directory, zero_copy weights from the daemon, ``fallback=False``);
- ``disk_warm`` / ``disk_cold``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=bfloat16,
  device_map=device)`` with the page cache warm / dropped.

Each reports process start to first token (wall clock from the parent's spawn), and inside
the process: imports (torch, transformers' Llama code) + CUDA init, model load, first forward. The greedy continuation
(8 tokens) and the first logits must be identical across the paths.

    python benchmarks/first_token_bench.py --device cuda:0 --out $OUT/first_token.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from gpu_bench import drop_caches  # noqa: E402

ENGINE = r"""
import time
T0 = time.time()
import asyncio, hashlib, json, sys
import torch
mode, model, sock, device = sys.argv[1:5]
torch.empty(1, device=device)
# the engine's own code is imported before the clock for "load" starts: both paths pay it
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
T1 = time.time()
ids = torch.tensor([[128000, 791, 6864, 315, 9822, 374, 12366, 13]], device=device)

def first(m):
    with torch.no_grad():
        logits = m(ids).logits[0, -1].float()
    tok = int(logits.argmax())
    torch.cuda.synchronize()
    return logits, tok

def finish(m, t2, extra):
    logits, tok = first(m)
    t3 = time.time()
    with torch.no_grad():
        gen = m.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    print(json.dumps({"t0": T0, "first_token_at": t3, "imports_cuda_s": T1 - T0, "load_s": t2 - T1,
                      "forward_s": t3 - t2, "token": tok, "greedy": gen[0, ids.shape[1]:].tolist(),
                      "logits_sha256": hashlib.sha256(logits.cpu().numpy().tobytes()).hexdigest(),
                      "cuda_allocated_bytes": torch.cuda.memory_allocated(device), **extra}))

if mode == "wcache":
    from wcache import WCacheClient
    from wcache.integrations.transformers import from_pretrained
    async def main():
        m, w = await from_pretrained(model, client=WCacheClient(sock), fallback=False)
        t2 = time.time()
        finish(m, t2, {"source": "cache"})
        await w.release()
    asyncio.run(main())
else:
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, device_map=device)
    m.eval()
    finish(m, time.time(), {"source": "disk"})
"""


def engine(mode: str, model: Path, sock: str, device: str) -> dict[str, Any]:
    t = time.time()
    p = subprocess.run(
        [sys.executable, "-c", ENGINE, mode, str(model), sock, device],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if p.returncode != 0:
        return {"error": p.stderr[-3000:]}
    r: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    r["spawn_to_first_token_s"] = r["first_token_at"] - t
    r["process_wall_s"] = time.time() - t
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", type=Path, default=Path("/tmp/wcache-bench/llama3-8b"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from wcache.server.process import spawn_daemon
    from wcache.synthetic import LLAMA3_8B, make_llama_checkpoint

    if not (args.model / "config.json").exists():
        make_llama_checkpoint(args.model, LLAMA3_8B, shards=4, seed=0, device=args.device)
    res: dict[str, Any] = {"benchmark": "first_token_bench", "date": datetime.date.today().isoformat(), "runs": {}}
    work = Path(tempfile.mkdtemp(prefix="wcache-ftb-"))
    sock_dir = work / "sock"
    sock_dir.mkdir(mode=0o700)
    d = spawn_daemon(args.model, sock_dir, "--device", args.device, log=work / "daemon.log", timeout=600)
    try:
        sock = str(d.socket)
        plan = [("wcache", False)] * args.repeats + [("disk_warm", False), ("disk_cold", True)]
        for name, cold in plan:
            dropped = drop_caches() if cold else None
            r = engine("wcache" if name == "wcache" else "disk", args.model, sock, args.device)
            if dropped is not None:
                r["page_cache_dropped"] = dropped
            res["runs"].setdefault(name, []).append(r)
            print(name, json.dumps({k: v for k, v in r.items() if k != "greedy"})[:600], flush=True)
            args.out.write_text(json.dumps(res, indent=2) + "\n")
    finally:
        d.stop()
    ok = [r for rs in res["runs"].values() for r in rs if "error" not in r]
    res["identical_greedy_and_logits"] = (
        len({(tuple(r["greedy"]), r["logits_sha256"]) for r in ok}) == 1 if ok else None
    )

    def best(name: str) -> float | None:
        xs = [r["spawn_to_first_token_s"] for r in res["runs"].get(name, []) if "error" not in r]
        return min(xs) if xs else None

    res["summary"] = {
        "spawn_to_first_token_s": {n: best(n) for n in ("wcache", "disk_warm", "disk_cold")},
        "load_s": {
            n: min((r["load_s"] for r in res["runs"].get(n, []) if "error" not in r), default=None)
            for n in ("wcache", "disk_warm", "disk_cold")
        },
        "identical_greedy_and_logits": res["identical_greedy_and_logits"],
    }
    print(json.dumps(res["summary"], indent=1))
    args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
