"""Host-memory tier and daemon hand-off on a GPU (docs/reliability.md).

On ``--device cuda:K`` with the 16 GB Llama-3-8B-shaped checkpoint:

1. daemon A loads it with ``--host-tier`` (its log gives the load and the tier copy times);
2. this process (an engine) fetches zero_copy and keeps the views;
3. daemon B starts with ``--takeover A``: time to ready, A's exit, no disk read, the
   engine's views still equal the checkpoint, a new fetch from B is identical, and the GPU
   holds one copy (per-process memory from nvidia-smi);
4. B stops; daemon C starts with ``--host-tier``: the slab comes back from shared memory
   (target: 16 GB on the GPU in <= 0.5 s);
5. C evicts the model and PRELOADs it again: from the tier inside a running daemon, which keeps
   the entry page-locked (one DMA copy; target <= 0.5 s);
6. a wcache-keeper runs; daemon D (``--keeper``) serves the model, the engine fetches, D is
   SIGKILLed (a crash); the GPU memory stays allocated (nvidia-smi), daemon E (``--keeper``)
   reclaims the slab instead of loading it (its log's reclaim time), the engine's views still
   hold the weights, E's fetch is identical; stopping the keeper frees the memory. E should not import
   torch (``keeper_restart_imported_torch``); benchmarks/keeper_restart_bench.py takes the median of 5.

    python benchmarks/handoff_bench.py --device cuda:0 --out $OUT/handoff.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_bench import gpu_apps_mib, gpu_used_mib  # noqa: E402


def grab(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from safetensors import safe_open

    from wcache import RankSpec, WCacheClient, WeightCacheKey
    from wcache.server.process import spawn_daemon
    from wcache.synthetic import LLAMA3_8B, make_llama_checkpoint

    if not (args.model / "config.json").exists():
        make_llama_checkpoint(args.model, LLAMA3_8B, shards=4, seed=0, device=args.device)
    work = Path(tempfile.mkdtemp(prefix="wcache-handoff-"))
    sock = work / "sock"
    sock.mkdir(mode=0o700)
    tier = Path(f"/dev/shm/wcache-handoff-{int(time.time())}")
    tier_args = ("--device", args.device, "--host-tier", str(64 << 30), "--host-tier-dir", str(tier))
    res: dict[str, Any] = {"benchmark": "handoff_bench", "date": datetime.date.today().isoformat()}
    key = WeightCacheKey.from_checkpoint(args.model)
    names = ["model.embed_tokens.weight", "model.layers.17.mlp.down_proj.weight", "lm_head.weight"]
    ref = {}
    for f in sorted(args.model.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for n in names:
                if n in fh.keys():  # noqa: SIM118
                    ref[n] = fh.get_tensor(n).to(args.device)
    torch.cuda.synchronize()
    try:
        a = spawn_daemon(args.model, sock, *tier_args, log=work / "a.log", timeout=600)
        la = a.log_text()
        res["a_load_s"] = grab(r"loaded bytes_read=\d+ bytes_stored=\d+ seconds=([\d.]+)", la)
        res["a_tier_save_s"] = grab(r"host tier saved .*? seconds=([\d.]+)", la)
        engine = await WCacheClient(a.socket).fetch(key)
        res["engine_views_ok_before"] = all(torch.equal(engine[n], ref[n]) for n in ref)
        apps_before = gpu_apps_mib() or {}
        res["gpu_mib_before_takeover"] = {"daemon_a": apps_before.get(a.pid), "all": sum(apps_before.values())}

        t0 = time.perf_counter()
        b = spawn_daemon(None, sock, "--device", args.device, takeover=a.socket, log=work / "b.log", timeout=300)
        res["takeover_spawn_to_ready_s"] = time.perf_counter() - t0
        res["a_exit_code"] = a.proc.wait(60)
        res["a_exit_after_spawn_s"] = time.perf_counter() - t0
        lb = b.log_text()
        res["takeover_import_s"] = grab(r"took over .*? seconds=([\d.]+)", lb)
        res["b_read_disk"] = "loaded bytes_read" in lb
        res["engine_views_ok_after"] = all(torch.equal(engine[n], ref[n]) for n in ref)
        async with await WCacheClient(b.socket).fetch(key) as w:
            res["b_fetch_ok"] = w.server.server_pid == b.pid and all(torch.equal(w[n], ref[n]) for n in ref)
        apps = gpu_apps_mib() or {}
        res["gpu_mib_after_takeover"] = {"daemon_b": apps.get(b.pid), "all": sum(apps.values())}
        await engine.release()
        del engine  # its mappings would keep A's slab allocated on the GPU for the rest of the run
        b.stop()

        t0 = time.perf_counter()
        c = spawn_daemon(args.model, sock, *tier_args, log=work / "c.log", timeout=300)
        res["tier_restart_spawn_to_ready_s"] = time.perf_counter() - t0
        lc = c.log_text()
        res["c_from_tier"] = "loaded from_host_tier" in lc
        res["tier_reload_restart_s"] = grab(r"loaded from_host_tier bytes_read=\d+ seconds=([\d.]+)", lc)
        client = WCacheClient(c.socket)
        deadline = time.monotonic() + 60  # the tier entry is page-locked in the background after a load
        while "host tier pinned" not in c.log_text() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        res["c_tier_pinned_s"] = grab(r"host tier pinned .*? seconds=([\d.]+)", c.log_text())
        await client.evict(key)
        r = await client.preload(RankSpec(Path(args.model)))
        res["tier_reload_after_evict_s"] = r.load_seconds
        res["tier_reload_after_evict_copy"] = (re.findall(r"from_host_tier .*? copy=(\w+)", c.log_text()) or ["?"])[-1]
        async with await client.fetch(key) as w:
            res["c_fetch_ok"] = all(torch.equal(w[n], ref[n]) for n in ref)
        c.stop()
        del w
        gc.collect()
        shutil.rmtree(tier, ignore_errors=True)  # D and E below have no tier: only the keeper can help them
        res.update(await keeper_restart(args, sock, work, key, ref))
        res["targets"] = {"tier_reload_s": 0.5}
    finally:
        shutil.rmtree(tier, ignore_errors=True)
        for name in ("a", "b", "c", "d", "e", "k"):
            p = work / f"{name}.log"
            if p.exists():
                res.setdefault("logs_tail", {})[name] = p.read_text()[-1500:]
    return res


async def keeper_restart(
    args: argparse.Namespace, sock: Path, work: Path, key: Any, ref: dict[str, Any]
) -> dict[str, Any]:
    import torch

    from wcache import WCacheClient
    from wcache.server.process import spawn_daemon, spawn_keeper

    res: dict[str, Any] = {}
    k = spawn_keeper(sock, log=work / "k.log")
    try:
        d = spawn_daemon(args.model, sock, "--device", args.device, "--keeper", log=work / "d.log", timeout=300)
        res["keeper_d_load_s"] = grab(r"loaded bytes_read=\d+ bytes_stored=\d+ seconds=([\d.]+)", d.log_text())
        engine = await WCacheClient(d.socket).fetch(key)
        res["keeper_gpu_used_mib_daemon_alive"] = gpu_used_mib()
        d.stop(signal.SIGKILL)
        await asyncio.sleep(1.0)
        res["keeper_gpu_used_mib_after_crash"] = gpu_used_mib()
        t0 = time.perf_counter()
        e = spawn_daemon(args.model, sock, "--device", args.device, "--keeper", log=work / "e.log", timeout=300)
        res["keeper_restart_spawn_to_ready_s"] = time.perf_counter() - t0
        res["keeper_restart_imported_torch"] = "libtorch" in Path(f"/proc/{e.pid}/maps").read_text()
        le = e.log_text()
        res["keeper_reclaim_s"] = grab(r"reclaimed from keeper=.*? seconds=([\d.]+)", le)
        res["keeper_restart_loaded"] = "loaded bytes_read" in le or "from_host_tier" in le
        res["keeper_engine_views_ok_after_crash"] = all(torch.equal(engine[n], ref[n]) for n in ref)
        t1 = time.perf_counter()
        async with await WCacheClient(e.socket).fetch(key) as w:
            res["keeper_e_first_fetch_s"] = time.perf_counter() - t1
            res["keeper_e_fetch_ok"] = w.server.server_pid == e.pid and all(torch.equal(w[n], ref[n]) for n in ref)
        await engine.release()
        del engine, w  # the engine's mappings hold the memory too: without them only the keeper does
        gc.collect()
        torch.cuda.synchronize()
        await asyncio.sleep(1.0)
        res["keeper_gpu_used_mib_engine_unmapped"] = gpu_used_mib()
        e.stop()
        await asyncio.sleep(1.0)
        res["keeper_gpu_used_mib_daemon_stopped"] = gpu_used_mib()  # still allocated: the keeper holds it
    finally:
        k.stop()
    await asyncio.sleep(1.0)
    res["keeper_gpu_used_mib_after_keeper_stop"] = gpu_used_mib()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", type=Path, default=Path("/tmp/wcache-bench/llama3-8b"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    res = asyncio.run(run(args))
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "logs_tail"}, indent=1))


if __name__ == "__main__":
    main()
