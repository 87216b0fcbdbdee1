"""Daemon restart on a keeper (docs/performance.md, "Daemon restart"): process start -> ready file, after SIGKILL.

A wcache-keeper runs; a daemon (``--keeper``) loads the checkpoint; then ``--samples`` times: SIGKILL the
daemon (a crash) and start it again with the same arguments, timing ``spawn_daemon`` from process start
to its ready file. Each restarted daemon reclaims the slab (nothing is read from disk) and should not
import torch (``torch_mapped``: libtorch in /proc/PID/maps). CPU and GPU alike:

    python benchmarks/keeper_restart_bench.py --device cpu --samples 5
    python benchmarks/keeper_restart_bench.py --device cuda:0 --model /tmp/wcache-bench/llama3-8b --out $OUT/restart.json

The JSON's top-level ``keeper_restart_spawn_to_ready_s`` is {median, max, samples}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _torch_mapped(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def run(args: argparse.Namespace) -> dict[str, Any]:
    from wcache.server.process import spawn_daemon, spawn_keeper
    from wcache.synthetic import TINY, make_llama_checkpoint

    work = Path(tempfile.mkdtemp(prefix="wcache-restart-"))
    model = args.model
    if model is None:
        model = make_llama_checkpoint(work / "tiny", TINY, shards=2, seed=1)
    sock = work / "sock"
    sock.mkdir(mode=0o700)
    dev = ("--device", args.device, "--keeper")
    res: dict[str, Any] = {
        "benchmark": "keeper_restart_bench",
        "date": datetime.date.today().isoformat(),
        "device": args.device,
        "model": str(model),
    }
    samples: list[float] = []
    torch_mapped: list[bool] = []
    reloaded: list[bool] = []
    k = spawn_keeper(sock, log=work / "k.log")
    d = None
    try:
        d = spawn_daemon(model, sock, *dev, log=work / "d0.log", timeout=600)
        res["first_spawn_to_ready_s"] = d.ready_seconds
        for i in range(args.samples):
            d.stop(signal.SIGKILL)
            d = spawn_daemon(model, sock, *dev, log=work / f"d{i + 1}.log", timeout=600)
            samples.append(d.ready_seconds)
            torch_mapped.append(_torch_mapped(d.pid))
            reloaded.append("loaded bytes_read" in d.log_text())
    finally:
        if d is not None:
            d.stop()
        k.stop()
        if args.model is None:
            shutil.rmtree(work, ignore_errors=True)
    res["keeper_restart_spawn_to_ready_s"] = {
        "median": statistics.median(samples),
        "max": max(samples),
        "samples": samples,
    }
    res["restarted_daemon_imported_torch"] = torch_mapped
    res["restarted_daemon_read_disk"] = reloaded
    res["targets"] = {"keeper_restart_spawn_to_ready_s": 1.0}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: a tiny synthetic one)")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    res = run(args)
    text = json.dumps(res, indent=2) + "\n"
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
