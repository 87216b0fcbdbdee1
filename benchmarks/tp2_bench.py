"""TP=2 across two GPUs, on the lent 2-GPU machine.

- Two daemons: rank 0 on physical GPU 0 and rank 1 on physical GPU 1, both started with
  CUDA_VISIBLE_DEVICES=1,0 (so rank 0 is ``--device cuda:1``): engines must find the GPU
  by UUID, not by index.
- One engine process per rank, each with its own CUDA_VISIBLE_DEVICES, fetching
  concurrently; every shard compared bit for bit with the slice of the safetensors tensor.
- One process seeing both GPUs awaits both ranks with asyncio.gather.
- A TP=2 forward (column/row-parallel, NCCL all-reduce) of a small Llama served the same
  way, against the TP=1 forward from safetensors.

    python benchmarks/tp2_bench.py --out $OUT/tp2_bench.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_bench  # noqa: E402
from gpu_bench import RESULTS, Daemon, save, step  # noqa: E402

ENV_NCCL = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

RANK_ENGINE = r"""
import asyncio, json, statistics, sys, time
import torch
from safetensors import safe_open
from wcache import WCacheClient, WeightCacheKey
from wcache import _cuda
from wcache.plan.sharding import LLAMA_PLAN
sock, model, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
key = WeightCacheKey.from_checkpoint(model, tp_rank=rank, tp_size=2)
torch.empty(1, device="cuda:0"); torch.cuda.synchronize()
async def main():
    c = WCacheClient(sock, timeout=120)
    t0 = time.perf_counter(); w = await c.fetch(key); first = (time.perf_counter() - t0) * 1e3
    dev = next(iter(w.values())).device
    ok = True; checked = 0
    import glob
    for f in sorted(glob.glob(model + "/*.safetensors")):
        with safe_open(f, "pt", device="cpu") as fh:
            for name in fh.keys():
                full = fh.get_tensor(name)
                dim = LLAMA_PLAN.dim_for(name)
                if dim is not None:
                    n = full.shape[dim] // 2
                    full = full.narrow(dim, rank * n, n)
                ok &= torch.equal(w[name].cpu(), full); checked += 1
    await w.release()
    ts = []
    for _ in range(20):
        t0 = time.perf_counter(); w = await c.fetch(key); ts.append((time.perf_counter() - t0) * 1e3); await w.release()
    print(json.dumps({"rank": rank, "visible_uuid": _cuda.device_uuid(0), "tensor_device": str(dev),
                      "first_fetch_ms": first, "fetch_ms_median": statistics.median(ts),
                      "shards_identical": bool(ok), "tensors_checked": checked}))
asyncio.run(main())
"""

PAIR_ENGINE = r"""
import asyncio, json, statistics, sys, time, torch
from wcache import WCacheClient, WeightCacheKey, _cuda
sock_dir, model = sys.argv[1], sys.argv[2]
torch.empty(1, device="cuda:0"); torch.empty(1, device="cuda:1")
keys = [WeightCacheKey.from_checkpoint(model, tp_rank=r, tp_size=2) for r in (0, 1)]
async def main():
    c = WCacheClient(socket_dir=sock_dir, timeout=120)
    ts = []
    for _ in range(20):
        t0 = time.perf_counter()
        w0, w1 = await asyncio.gather(c.fetch(keys[0]), c.fetch(keys[1]))
        ts.append((time.perf_counter() - t0) * 1e3)
        devs = [str(next(iter(w.values())).device) for w in (w0, w1)]
        await asyncio.gather(w0.release(), w1.release())
    print(json.dumps({"pair_fetch_ms_median": statistics.median(ts), "pair_fetch_ms_min": min(ts),
                      "rank_devices": devs, "uuids": [_cuda.device_uuid(0), _cuda.device_uuid(1)]}))
asyncio.run(main())
"""

FORWARD = r"""
import asyncio, glob, json, os, sys, torch, torch.distributed as dist
import torch.multiprocessing as mp
sys.path.insert(0, os.path.join(os.environ["WCACHE_REPO"], "benchmarks"))
from tp_forward import llama_forward

def worker(rank, sock_dir, model, out):
    from wcache import WCacheClient, WeightCacheKey
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, init_method="tcp://127.0.0.1:29533")
    cfg = json.load(open(model + "/config.json"))
    key = WeightCacheKey.from_checkpoint(model, tp_rank=rank, tp_size=2)
    w = asyncio.run(WCacheClient(socket_dir=sock_dir).fetch(key))
    dev = next(iter(w.values())).device
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg["vocab_size"], (64,), device=dev)
    with torch.no_grad():
        logits = llama_forward(w, cfg, tokens, tp=2)
    if rank == 0:
        from safetensors.torch import load_file
        full = {}
        for f in sorted(glob.glob(model + "/*.safetensors")):
            full.update(load_file(f, device=str(dev)))
        with torch.no_grad():
            ref = llama_forward(full, cfg, tokens, tp=1)
        diff = (logits - ref).abs()
        res = {"max_abs_diff": diff.max().item(), "ref_abs_max": ref.abs().max().item(),
               "rel_max_diff": (diff.max() / ref.abs().max()).item(),
               "argmax_agreement": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
               "close_bf16": bool(torch.allclose(logits, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()))}
        json.dump(res, open(out, "w"))
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    sock_dir, model, out = sys.argv[1], sys.argv[2], sys.argv[3]
    mp.spawn(worker, args=(sock_dir, model, out), nprocs=2, join=True)
    print(open(out).read())
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/wcache-bench"))
    args = ap.parse_args()
    gpu_bench.OUT = args.out
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = args.work
    gpu_bench.LOGS = work / "logs"
    gpu_bench.LOGS.mkdir(parents=True, exist_ok=True)
    os.environ.update(ENV_NCCL)
    os.environ["PYTHONPATH"] = f"{REPO}:{os.environ.get('PYTHONPATH', '')}"
    os.environ["WCACHE_REPO"] = str(REPO)
    RESULTS["benchmark"] = "tp2_bench"
    RESULTS["date"] = datetime.date.today().isoformat()

    import torch

    from wcache.synthetic import LLAMA3_8B, LlamaShape, make_llama_checkpoint

    RESULTS["machine"] = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    big, small = work / "llama3-8b", work / "small"
    daemons: list[Daemon] = []
    try:
        with step("generate") as r:
            t0 = time.perf_counter()
            if not (big / "config.json").exists():
                make_llama_checkpoint(big, LLAMA3_8B, shards=4, seed=0, device="cuda:0")
            if not (small / "config.json").exists():
                shape = LlamaShape(hidden=1024, intermediate=2816, layers=4, heads=16, kv_heads=4, vocab=32000)
                make_llama_checkpoint(small, shape, shards=1, seed=3, device="cuda:0")
            r["seconds"] = time.perf_counter() - t0

        permuted = {**os.environ, "CUDA_VISIBLE_DEVICES": "1,0"}
        with step("daemons") as r:
            for model, name in ((big, "big"), (small, "small")):
                for rank in (0, 1):
                    # CUDA_VISIBLE_DEVICES=1,0: cuda:1 is physical GPU 0 (rank 0), cuda:0 is GPU 1 (rank 1)
                    d = Daemon(
                        model,
                        work / "tp2sock" / name,
                        "--tp-size",
                        "2",
                        "--tp-rank",
                        str(rank),
                        "--device",
                        f"cuda:{1 - rank}",
                        name=f"tp2-{name}-{rank}",
                        env=permuted,
                    )
                    daemons.append(d)
            for d in daemons:
                d.wait(600)
            r["load_s"] = {d.log.stem: d.load_seconds() for d in daemons}

        big_dir = work / "tp2sock" / "big"
        with step("engine_per_rank_own_visible_devices") as r:
            procs = []
            for rank in (0, 1):
                script = gpu_bench.LOGS / f"rank_engine_{rank}.py"
                script.write_text(RANK_ENGINE)
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(rank)}
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(script), str(big_dir / f"wcache-rank{rank}.sock"), str(big), str(rank)],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        env=env,
                    )
                )
            for rank, p in enumerate(procs):
                out, err = p.communicate(timeout=400)
                if p.returncode != 0:
                    raise RuntimeError(f"rank {rank} engine failed: {err[-3000:]}")
                r[f"rank{rank}"] = json.loads(out.strip().splitlines()[-1])

        with step("one_process_gather_both_ranks") as r:
            r.update(gpu_bench.run_py(PAIR_ENGINE, str(big_dir), str(big), timeout=300))

        with step("tp2_forward_vs_tp1") as r:
            r.update(
                gpu_bench.run_py(
                    FORWARD,
                    str(work / "tp2sock" / "small"),
                    str(small),
                    str(gpu_bench.LOGS / "forward.json"),
                    timeout=300,
                )
            )
    finally:
        for d in daemons:
            d.stop()
        save()


if __name__ == "__main__":
    main()
