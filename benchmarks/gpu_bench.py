"""GPU benchmarks (README, Measured), side by side in one run on the lent H200.

Generates a 16 GB Llama-3-8B-shaped bf16 checkpoint (291 tensors, 4 shards) and a
MoE-like layout of 50,000 tensors, then measures:

- ``safetensors.torch.load_file(device="cuda:0")`` cold (page cache dropped) and warm;
- per-tensor torch CUDA IPC (how the modelled system exports): a child process rebuilds
  291 CUDA tensors sent through torch.multiprocessing;
- wcache daemons (VMM and legacy IPC export): load time, zero_copy fetch (connect, HELLO,
  GET_STATE, map, every view) in fresh engine processes, copy mode, engine memory added
  (``mem_get_info``), daemon memory (nvidia-smi), bit-identity against safetensors;
- the 50,000-tensor layout's zero_copy fetch; TP=2 from two daemons on the one GPU.

Each fetch is timed three ways: ``zero_copy`` = fetch + ``materialize()`` (every per-name
view built, the target's definition), ``fetch_only`` (the mapping returned; views are cut per
group on first look-up), ``fetch_groups`` (fetch + ``groups()``: one stacked view per group).
``--only-moe`` runs just the 50,000-tensor step.

Every step has its own deadline and writes what it got; the JSON lands in --out.

    python benchmarks/gpu_bench.py --out $OUT/gpu_bench.json --work /tmp/wcache-bench
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from wcache.server.process import spawn_daemon  # noqa: E402

RESULTS: dict[str, Any] = {"benchmark": "gpu_bench", "date": datetime.date.today().isoformat(), "steps": {}}
OUT: Path = Path("gpu_bench.json")
LOGS: Path = Path("/tmp/wcache-bench/logs")


def save() -> None:
    OUT.write_text(json.dumps(RESULTS, indent=2, default=str) + "\n")


@contextlib.contextmanager
def step(name: str) -> Iterator[dict[str, Any]]:
    rec: dict[str, Any] = {}
    RESULTS["steps"][name] = rec
    t0 = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        yield rec
        rec["ok"] = True
    except Exception as exc:
        rec["ok"] = False
        rec["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        rec["step_seconds"] = round(time.perf_counter() - t0, 2)
        print(f"   {json.dumps(rec, default=str)[:600]}", flush=True)
        save()


def nvidia_smi(*args: str) -> str | None:
    """``nvidia-smi ARGS`` output, or None where it is missing or fails."""
    try:
        q = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return q.stdout if q.returncode == 0 else None


def gpu_apps_mib(index: int | None = None) -> dict[int, int] | None:
    """pid -> MiB of every process holding GPU memory (on GPU ``index``, or any), from
    ``nvidia-smi --query-compute-apps`` (``memory.used`` reads 0 in the lent VM); None without nvidia-smi."""
    text = nvidia_smi(
        "--query-compute-apps=pid,used_memory",
        "--format=csv,noheader,nounits",
        *(["-i", str(index)] if index is not None else []),
    )
    if text is None:
        return None
    out: dict[int, int] = {}
    for line in text.strip().splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            out[int(pid)] = int(mib)
    return out


def gpu_used_mib(index: int = 0) -> int | None:
    """Memory used on GPU ``index`` (MiB), all processes: what the driver holds, a process or not."""
    text = nvidia_smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(index))
    return int(text.split()[0]) if text is not None and text.strip().isdigit() else None


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_py(code: str, *args: str, timeout: float = 300, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a fresh Python process (a restarted engine) from a script file; its last stdout line is JSON."""
    script = LOGS / f"child-{abs(hash(code))}.py"
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}): {out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# ---------------------------------------------------------------------------------------------- children

CONTEXT_ONLY = r"""
import json, os, subprocess, torch
torch.empty(1, device="cuda:0"); torch.cuda.synchronize()
q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                   capture_output=True, text=True, timeout=30).stdout
mine = [int(m) for p, m in (l.split(",") for l in q.strip().splitlines()) if int(p) == os.getpid()]
print(json.dumps({"cuda_context_only_mib": mine[0] if mine else None}))
"""

SAFETENSORS_LOAD = r"""
import glob, json, sys, time, torch
from safetensors.torch import load_file
torch.empty(1, device="cuda:0"); torch.cuda.synchronize()
t0 = time.perf_counter(); n = 0
for f in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
    n += len(load_file(f, device="cuda:0"))
torch.cuda.synchronize()
print(json.dumps({"seconds": time.perf_counter() - t0, "tensors": n}))
"""

PER_TENSOR_IPC = r"""
import glob, json, sys, time, torch, torch.multiprocessing as mp
from safetensors.torch import load_file

def child(q, r):
    import torch, time
    torch.empty(1, device="cuda:0"); torch.cuda.synchronize()
    r.put("ready")
    t0 = time.perf_counter()
    d = q.get()
    torch.cuda.synchronize()
    n = sum(1 for t in d.values() if t.is_cuda)
    r.put({"rebuild_ms": (time.perf_counter() - t0) * 1e3, "tensors": n,
           "distinct_blocks": len({t.untyped_storage().data_ptr() for t in d.values()})})
    r.get()

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    tensors = {}
    for f in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
        tensors.update(load_file(f, device="cuda:0"))
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, r)); p.start()
    assert r.get(timeout=120) == "ready"
    q.put(tensors)
    res = r.get(timeout=120)
    r.put("done"); p.join(30)
    print(json.dumps(res))
"""

ENGINE = r"""
import asyncio, glob, json, statistics, sys, time
t_start = time.perf_counter()
import torch
from wcache import WCacheClient, WeightCacheKey
sock, model, repeats, check = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
tp_rank, tp_size = int(sys.argv[5]), int(sys.argv[6])
key = WeightCacheKey.from_checkpoint(model, tp_rank=tp_rank, tp_size=tp_size)
torch.empty(1, device="cuda:0"); torch.cuda.synchronize()   # an engine has its CUDA context before loading
ctx_ready = time.perf_counter() - t_start

async def main():
    client = WCacheClient(sock, timeout=120)
    free0, total = torch.cuda.mem_get_info(0)
    alloc0 = torch.cuda.memory_allocated(0)
    t0 = time.perf_counter(); w = (await client.fetch(key)).materialize(); first = time.perf_counter() - t0
    free1, _ = torch.cuda.mem_get_info(0)
    res = {"first_fetch_ms": first * 1e3, "first_fetch_phases_ms": w.timings, "tensors": len(w),
           "process_to_context_s": ctx_ready,
           "engine_device_bytes_added": free0 - free1,
           "engine_torch_allocated_added": torch.cuda.memory_allocated(0) - alloc0}
    identical = None
    if check:
        from safetensors.torch import load_file
        identical = True
        for f in sorted(glob.glob(model + "/*.safetensors")):
            for name, t in load_file(f).items():
                if not torch.equal(w[name].cpu(), t):
                    identical = False
    res["identical_to_safetensors"] = identical
    await w.release(); del w   # the previous fetch's tensors are freed outside every timed region
    zc, lazy, grouped, phases = [], [], [], []
    for _ in range(repeats):
        # zero_copy: connect, HELLO, GET_STATE, map, and every per-name view built (materialize)
        t0 = time.perf_counter(); w = await client.fetch(key); t1 = time.perf_counter()
        w.materialize(); zc.append(time.perf_counter() - t0); lazy.append(t1 - t0)
        phases.append(dict(w.timings, materialize=(time.perf_counter() - t1) * 1e3))
        await w.release(); del w
        # the same fetch, every group as one stacked view (what fused-MoE engines take)
        t0 = time.perf_counter(); w = await client.fetch(key); gs = w.groups(); grouped.append(time.perf_counter() - t0)
        await w.release(); del w, gs
    res["phases_ms_median"] = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    cp = []
    for _ in range(max(3, repeats // 4)):
        t0 = time.perf_counter(); c = (await client.fetch(key, mode="copy")).materialize(); torch.cuda.synchronize()
        cp.append(time.perf_counter() - t0); del c; torch.cuda.empty_cache()
    med = lambda xs: statistics.median(xs) * 1e3
    res.update({"zero_copy_ms_median": med(zc), "zero_copy_ms_min": min(zc) * 1e3,
                "zero_copy_ms_p90": sorted(zc)[int(0.9 * (len(zc) - 1))] * 1e3,
                "fetch_only_ms_median": med(lazy), "fetch_groups_ms_median": med(grouped),
                "copy_ms_median": med(cp), "repeats": repeats})
    print(json.dumps(res))

asyncio.run(main())
"""

TP2_ENGINE = r"""
import asyncio, glob, json, sys, time, torch
from safetensors.torch import load_file
from wcache import WCacheClient, WeightCacheKey
from wcache.plan.sharding import LLAMA_PLAN
sock_dir, model = sys.argv[1], sys.argv[2]
torch.empty(1, device="cuda:0"); torch.cuda.synchronize()
keys = [WeightCacheKey.from_checkpoint(model, tp_rank=r, tp_size=2) for r in (0, 1)]
async def main():
    c = WCacheClient(socket_dir=sock_dir, timeout=120)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        w0, w1 = await asyncio.gather(c.fetch(keys[0]), c.fetch(keys[1]))
        times.append(time.perf_counter() - t0)
        await asyncio.gather(w0.release(), w1.release())
    w0, w1 = await asyncio.gather(c.fetch(keys[0]), c.fetch(keys[1]))
    ok = True
    for f in sorted(glob.glob(model + "/*.safetensors")):
        for name, t in load_file(f, device="cuda:0").items():
            dim = LLAMA_PLAN.dim_for(name)
            if dim is None:
                ok &= torch.equal(w0[name], t) and torch.equal(w1[name], t)
            else:
                ok &= torch.equal(torch.cat([w0[name], w1[name]], dim=dim), t)
    print(json.dumps({"pair_fetch_ms_median": sorted(times)[len(times) // 2] * 1e3, "shards_concatenate": bool(ok)}))
asyncio.run(main())
"""


# ---------------------------------------------------------------------------------------------- daemons


class Daemon:
    """A wcache-server subprocess (wcache.server.process) plus what the benchmark reads off it."""

    def __init__(self, model: Path, sock_dir: Path, *args: str, name: str, env: dict[str, str] | None = None) -> None:
        sock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(sock_dir, 0o700)
        self.d = spawn_daemon(model, sock_dir, *args, log=LOGS / f"daemon-{name}.log", env=env, timeout=None)
        self.log = self.d.log
        self.proc = self.d.proc
        self.ready_s = -1.0

    def wait(self, timeout: float) -> Path:
        self.d.wait_ready(timeout)
        self.ready_s = self.d.ready_seconds
        return self.d.socket

    def load_seconds(self) -> float | None:
        m = re.search(r" loaded .*?seconds=([\d.]+)", self.log.read_text())
        return float(m.group(1)) if m else None

    def slab_bytes(self) -> int | None:
        m = re.search(r" loaded .*?bytes_stored=(\d+)", self.log.read_text())
        return int(m.group(1)) if m else None

    def gpu_mib(self) -> int | None:
        return (gpu_apps_mib() or {}).get(self.proc.pid)

    def stop(self) -> None:
        self.d.stop()


def main() -> None:
    global OUT, LOGS
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/wcache-bench"))
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--only-moe", action="store_true", help="only the 50,000-tensor fetch")
    ap.add_argument("--only-fetch", action="store_true", help="only the 16 GB checkpoint's VMM fetch")
    args = ap.parse_args()
    OUT = args.out
    OUT.parent.mkdir(parents=True, exist_ok=True)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    LOGS = work / "logs"
    LOGS.mkdir(exist_ok=True)
    os.environ["PYTHONPATH"] = f"{REPO}:{os.environ.get('PYTHONPATH', '')}"

    import torch

    from wcache.synthetic import LLAMA3_8B, make_llama_checkpoint

    RESULTS["machine"] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    model = work / "llama3-8b"
    moe = work / "moe-50k"
    daemons: list[Daemon] = []
    socks: dict[str, Path] = {}
    try:
        with step("generate_checkpoints") as r:
            t0 = time.perf_counter()
            if not args.only_moe and not (model / "config.json").exists():
                make_llama_checkpoint(model, LLAMA3_8B, shards=4, seed=0, device="cuda:0")
            r["llama_bytes"] = sum(f.stat().st_size for f in model.glob("*.safetensors"))
            r["llama_seconds"] = time.perf_counter() - t0
            if not (args.skip_moe or args.only_fetch) and not (moe / "config.json").exists():
                make_moe(moe)
            r["moe_tensors"] = 50_000

        if args.only_moe:
            fetch_moe_step(moe, work / "sock" / "moe", daemons)
            return

        if args.only_fetch:
            with step("fetch_vmm") as r:
                d = Daemon(model, work / "sock" / "vmm", "--device", "cuda:0", name="vmm")
                daemons.append(d)
                path = d.wait(600)
                r.update(run_py(ENGINE, str(path), str(model), str(args.repeats), "1", "0", "1", timeout=300))
            return

        with step("safetensors_load_file_cuda") as r:
            r["page_cache_dropped"] = drop_caches()
            r["cold"] = run_py(SAFETENSORS_LOAD, str(model), timeout=240)
            r["warm"] = run_py(SAFETENSORS_LOAD, str(model), timeout=240)

        with step("per_tensor_torch_ipc") as r:
            r.update(run_py(PER_TENSOR_IPC, str(model), timeout=300))

        sock = work / "sock"
        with step("daemon_load") as r:
            free0, total = torch.cuda.mem_get_info(0)
            drop_caches()
            vmm = Daemon(model, sock / "vmm", "--device", "cuda:0", "--cuda-export", "vmm", name="vmm")
            daemons.append(vmm)
            socks["vmm"] = vmm.wait(600)
            r["vmm_cold_load_s"] = vmm.load_seconds()
            r["vmm_ready_s"] = vmm.ready_s
            ipc = Daemon(model, sock / "ipc", "--device", "cuda:0", "--cuda-export", "ipc", name="ipc")
            daemons.append(ipc)
            socks["ipc"] = ipc.wait(600)
            r["ipc_warm_load_s"] = ipc.load_seconds()
            r["ipc_ready_s"] = ipc.ready_s
            slab = sum(f.stat().st_size for f in model.glob("*.safetensors"))
            r["checkpoint_bytes"] = slab
            r["vmm_daemon_gpu_mib"] = vmm.gpu_mib()
            r["ipc_daemon_gpu_mib"] = ipc.gpu_mib()
            r["device_bytes_used_by_both_daemons"] = free0 - torch.cuda.mem_get_info(0)[0]
            # a process that only started its CUDA context (torch): what every daemon pays besides the slab
            r.update(run_py(CONTEXT_ONLY, timeout=120))
            ctx = r.get("cuda_context_only_mib")
            if ctx is not None and r["vmm_daemon_gpu_mib"] is not None:
                slab_mib = (vmm.slab_bytes() or slab) / 2**20
                r["vmm_daemon_overhead_beyond_context_pct"] = (
                    100 * (r["vmm_daemon_gpu_mib"] - ctx - slab_mib) / slab_mib
                )

        for name in ("vmm", "ipc"):
            with step(f"fetch_{name}") as r:
                path = socks[name]
                r.update(
                    run_py(
                        ENGINE,
                        str(path),
                        str(model),
                        str(args.repeats),
                        "1" if name == "vmm" else "0",
                        "0",
                        "1",
                        timeout=600,
                    )
                )
                r["second_engine"] = run_py(
                    ENGINE, str(path), str(model), str(args.repeats), "0", "0", "1", timeout=300
                )

        with step("tp2_two_daemons_one_gpu") as r:
            tp_dir = sock / "tp2"
            pair = [
                Daemon(model, tp_dir, "--device", "cuda:0", "--tp-size", "2", "--tp-rank", str(k), name=f"tp{k}")
                for k in (0, 1)
            ]
            daemons.extend(pair)
            for d in pair:
                d.wait(600)
            r["rank_load_s"] = [d.load_seconds() for d in pair]
            r.update(run_py(TP2_ENGINE, str(tp_dir), str(model), timeout=600))
            for k in (0, 1):
                r[f"rank{k}"] = run_py(
                    ENGINE, str(tp_dir / f"wcache-rank{k}.sock"), str(model), "10", "0", str(k), "2", timeout=300
                )
            for d in pair:
                d.stop()

        if not args.skip_moe:
            fetch_moe_step(moe, sock / "moe", daemons)
    finally:
        for d in daemons:
            d.stop()
        summarise()
        save()


def fetch_moe_step(moe: Path, sock_dir: Path, daemons: list[Daemon]) -> None:
    """A daemon on the 50,000-tensor checkpoint, then 20 fetches from a fresh engine process."""
    with step("fetch_moe_50k") as r:
        d = Daemon(moe, sock_dir, "--device", "cuda:0", name="moe")
        daemons.append(d)
        msock = d.wait(900)
        r["load_s"] = d.load_seconds()
        r.update(run_py(ENGINE, str(msock), str(moe), "20", "1", "0", "1", timeout=600))


def make_moe(path: Path, n: int = 50_000) -> None:
    """50,000 small bf16 tensors (expert-style names), one file, like a fine-grained MoE."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda:0").manual_seed(0)
    data = torch.randn(n * 64 * 128, generator=g, device="cuda:0").to(torch.bfloat16).cpu()
    tensors = {
        f"model.layers.{i // 1000}.mlp.experts.{(i % 1000) // 3}.w{i % 3}.weight": data[i * 8192 : (i + 1) * 8192]
        .view(64, 128)
        .clone()
        for i in range(n)
    }
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["MoeLikeForCausalLM"]}))


def summarise() -> None:
    s = RESULTS["steps"]
    g: Callable[..., Any] = lambda *ks: _dig(s, *ks)  # noqa: E731
    RESULTS["summary"] = {
        "safetensors_cold_s": g("safetensors_load_file_cuda", "cold", "seconds"),
        "safetensors_warm_s": g("safetensors_load_file_cuda", "warm", "seconds"),
        "per_tensor_ipc_rebuild_ms": g("per_tensor_torch_ipc", "rebuild_ms"),
        "vmm_zero_copy_ms_median": g("fetch_vmm", "zero_copy_ms_median"),
        "ipc_zero_copy_ms_median": g("fetch_ipc", "zero_copy_ms_median"),
        "vmm_copy_ms_median": g("fetch_vmm", "copy_ms_median"),
        "ipc_copy_ms_median": g("fetch_ipc", "copy_ms_median"),
        "moe_50k_zero_copy_ms_median": g("fetch_moe_50k", "zero_copy_ms_median"),
        "moe_50k_fetch_groups_ms_median": g("fetch_moe_50k", "fetch_groups_ms_median"),
        "moe_50k_fetch_only_ms_median": g("fetch_moe_50k", "fetch_only_ms_median"),
        "engine_device_bytes_added_vmm": g("fetch_vmm", "engine_device_bytes_added"),
        "identical_to_safetensors": g("fetch_vmm", "identical_to_safetensors"),
        "tp2_shards_concatenate": g("tp2_two_daemons_one_gpu", "shards_concatenate"),
        "targets": {"zero_copy_ms": 5, "moe_50k_ms": 50, "copy_ms": 30},
    }


def _dig(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


if __name__ == "__main__":
    main()
