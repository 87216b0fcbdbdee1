"""``wcache-demo``: restart an "engine" a few times, with and without the cache.

1. Builds a Llama-shaped bf16 checkpoint locally (embedded default, no downloads).
2. Times the usual start: ``safetensors.torch.load_file`` of every shard.
3. Starts ``wcache-server`` on it (host shared-memory backend unless --device cuda:K).
4. Restarts an engine process N times; each fetches the weights zero-copy and in copy
   mode, checks them bit for bit against the disk load, and reports the times.
5. Kills the daemon (SIGKILL, a crash) and starts it again: ``wcache-keeper`` held its slab,
   so the new daemon reclaims it instead of loading; one more engine run checks the bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from wcache import WCacheClient, __version__
from wcache.command import CommandParser, plain_text
from wcache.errors import WCacheError
from wcache.proto import ModelInfo
from wcache.server.process import DaemonProcess, spawn_daemon, spawn_keeper
from wcache.server.startup import make_backend
from wcache.synthetic import LlamaShape, make_llama_checkpoint

#: 8 layers, hidden 1024, vocab 32000 — big enough to show the gap, quick to build (``DEMO_SHAPE.nbytes()``
#: bytes of bf16; the demo prints the size it built, the README quotes it: tests/server/test_demo.py checks).
DEMO_SHAPE = LlamaShape(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, vocab=32000)

ENGINE = r"""
import asyncio, glob, json, sys, time
t_start = time.perf_counter()
import torch
from safetensors.torch import load_file
from wcache import WCacheClient, WeightCacheKey
model, sock, dev = sys.argv[1], sys.argv[2], sys.argv[3]
key = WeightCacheKey.from_checkpoint(model)
if dev != "cpu":  # an engine has its CUDA context up before it loads weights: not part of either timing
    torch.empty(1, device=dev); torch.cuda.synchronize()

async def main():
    client = WCacheClient(sock)
    t0 = time.perf_counter(); w = (await client.fetch(key)).materialize(); zc = time.perf_counter() - t0
    t0 = time.perf_counter(); c = (await client.fetch(key, mode="copy")).materialize(); cp = time.perf_counter() - t0
    t0 = time.perf_counter(); ref = {}
    for f in sorted(glob.glob(model + "/*.safetensors")):
        ref.update({k: v.clone() for k, v in load_file(f, device=dev).items()})  # into the engine's own memory
    if dev != "cpu":
        torch.cuda.synchronize()
    disk = time.perf_counter() - t0
    same = all(torch.equal(w[k], v) and torch.equal(c[k], v) for k, v in ref.items())
    n = sum(t.nbytes for t in ref.values())
    t0 = time.perf_counter(); torch.empty(n, dtype=torch.uint8, device=dev).fill_(1)  # fresh memory, written once
    if dev != "cpu":
        torch.cuda.synchronize()
    fresh = time.perf_counter() - t0
    await w.release()
    print(json.dumps({"zero_copy_ms": zc * 1e3, "copy_ms": cp * 1e3, "disk_ms": disk * 1e3, "fresh_ms": fresh * 1e3,
                      "bytes": n, "tensors": len(w), "identical": same}))

asyncio.run(main())
"""


def engine_restart(label: str, model: Path, sock: str, device: str) -> dict[str, float] | None:
    """One engine process: fetch zero_copy and copy, load from disk (onto ``device``), compare; print a row.
    Returns the engine's figures, or None if it failed or its tensors differed."""
    out = subprocess.run(
        [sys.executable, "-P", "-c", ENGINE, str(model), sock, device],  # -P: as process._spawn's
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        return None
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"{label:>7}  {r['disk_ms']:>8.1f}ms  {r['zero_copy_ms']:>8.2f}ms  {r['copy_ms']:>7.1f}ms  "
        f"{r['tensors']:>7}  {r['identical']}"
    )
    return r if r["identical"] else None


def _served(sock: str) -> tuple[ModelInfo, ...]:
    """The models a daemon serves (STATUS): where each came from, and how long its load took."""
    return asyncio.run(WCacheClient(sock).status()).models


def why_copy_costs(r: dict[str, float], device: str) -> str:
    """The demo's account of its copy column, from one engine's own measurements (benchmarks/copy_mode_bench.py
    splits it further: benchmarks/results/copy_mode-cpu-2026-12-01.json)."""
    mb = r["bytes"] / 1e6
    if device != "cpu":
        return (
            f"copy = the same, then one device-to-device copy of the slab ({mb:.0f} MB) into the engine's own memory."
        )
    page = mmap.PAGESIZE
    return (
        f"copy = the same, then one copy of the slab into the engine's own memory ({r['copy_ms']:.0f} ms in the last\n"
        f"            engine, its disk load {r['disk_ms']:.0f} ms). Both are a copy of {mb:.0f} MB into memory the engine\n"
        f"            has just allocated (the files are in the page cache), and the first touch of fresh memory costs\n"
        f"            a page fault and a zeroed page per {page // 1024} KiB page ({int(r['bytes']) // page:,} of them): writing\n"
        f"            {mb:.0f} MB of fresh memory alone took {r['fresh_ms']:.0f} ms there. zero_copy touches no new memory."
    )


def build_parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="wcache-demo", description=plain_text(__doc__), formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    ap.add_argument(
        "--restarts",
        type=int,
        default=3,
        help="how many times an engine is started (a fresh process each time, one table row each) before the "
        "daemon's crash and restart (default 3)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the daemon keeps the weights and the engines load them from disk to: cpu (host shared "
        "memory, the default) or cuda:K (GPU K; needs a CUDA build of torch and cuda-bindings)",
    )
    ap.add_argument("--model", type=Path, help="use this checkpoint instead of building the demo one")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.restarts < 1:
        ap.error(f"--restarts {args.restarts} must be at least 1")
    if args.model is not None and not (args.model / "config.json").is_file():
        ap.error(f"--model {args.model}: not a checkpoint directory (no config.json there)")
    try:  # an unusable device: say so now, not after building the checkpoint and starting the daemon
        make_backend(args.device).check_device(loads=True)
    except (ValueError, WCacheError) as exc:
        print(f"wcache-demo: {exc}", file=sys.stderr)
        return 1

    work = Path(tempfile.mkdtemp(prefix="wcache-demo-"))
    os.chmod(work, 0o700)
    daemon: DaemonProcess | None = None
    keeper: DaemonProcess | None = None
    try:
        model = args.model
        if model is None:
            t0 = time.perf_counter()
            model = make_llama_checkpoint(work / "model", DEMO_SHAPE, shards=2, seed=0)
            size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
            print(f"built a Llama-shaped checkpoint: {size / 1e6:.0f} MB in {time.perf_counter() - t0:.1f} s ({model})")
        sock_dir = work / "sock"
        sock_dir.mkdir(mode=0o700)
        t0 = time.perf_counter()
        try:
            keeper = spawn_keeper(sock_dir, log=work / "keeper.log")
            daemon = spawn_daemon(
                model, sock_dir, "--device", args.device, "--keeper", log=work / "daemon.log", timeout=300
            )
        except (RuntimeError, TimeoutError) as exc:
            print(f"wcache-demo: the daemon or its keeper did not start: {exc}", file=sys.stderr)
            return 1
        sock = str(daemon.socket)
        print(f"wcache-server ready in {time.perf_counter() - t0:.1f} s (process start + load), socket {sock}")
        print()
        print(f"{'restart':>7}  {'disk load':>10}  {'zero_copy':>10}  {'copy':>9}  {'tensors':>7}  identical")
        for i in range(1, args.restarts + 1):
            if engine_restart(str(i), model, sock, args.device) is None:
                return 1
        # a daemon crash: the keeper held the slab, so the new daemon loads nothing
        loaded = _served(sock)
        daemon.stop(signal.SIGKILL)
        t0 = time.perf_counter()
        try:
            daemon = spawn_daemon(
                model, sock_dir, "--device", args.device, "--keeper", log=work / "daemon2.log", timeout=300
            )
        except (RuntimeError, TimeoutError) as exc:
            print(f"wcache-demo: the daemon did not restart: {exc}", file=sys.stderr)
            return 1
        ready = time.perf_counter() - t0
        # the reclaim's duration is the figure the daemon's reclaim line reports to operators
        m = re.search(r"reclaimed from keeper=.*? seconds=([\d.]+)", daemon.log_text())
        if [x.origin for x in _served(str(daemon.socket))] != ["keeper"] or m is None:
            print(f"wcache-demo: the restarted daemon did not reclaim its slab:\n{daemon.log_text()[-2000:]}")
            return 1
        disk = [x.load_seconds for x in loaded if x.origin == "disk"]
        first = f" (the first start loaded it in {disk[0] * 1e3:.0f} ms)" if disk else ""
        print()
        print(
            f"daemon killed (SIGKILL) and restarted: its slab came back from wcache-keeper in "
            f"{float(m.group(1)) * 1e3:.0f} ms, nothing loaded{first}; ready {ready:.1f} s after start "
            "(the process starting: it imports no torch, having nothing to load)"
        )
        last = engine_restart("after", model, str(daemon.socket), args.device)
        if last is None:
            return 1
        print()
        print("disk load = safetensors.torch.load_file of every shard into the engine's memory (page cache warm);")
        print("zero_copy = connect + HELLO + GET_STATE + map + build every tensor view: no byte copied, and")
        print("            every engine shares the daemon's one copy.")
        print(why_copy_costs(last, args.device))
        print("On a GPU (--device cuda:0) the disk load goes to the GPU too; a fresh engine's first fetch of 16 GB")
        print("took 3.6-4.0 ms on an H200 (the driver's import and first touch included); see README's Measured table.")
        return 0
    finally:
        if daemon is not None:
            daemon.stop()
        if keeper is not None:
            keeper.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
