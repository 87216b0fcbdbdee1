"""Why a copy-mode fetch costs about what a page-cache disk load costs (wcache-demo's table on the CPU box).

Starts ``wcache-server`` (host backend) on the demo's checkpoint (``wcache.demo.DEMO_SHAPE``), then runs fresh
"engine" processes, as the demo does; each measures, with the minor page faults each step takes:

- ``copy``: a copy-mode fetch (``fetch(key, mode="copy")``, every view built), split by the client's own timings
  into map / copy (one ``clone`` of the slab) / views;
- ``disk``: the demo's disk load (``safetensors.torch.load_file`` of every shard, each tensor cloned into the
  engine's memory; page cache warm);
- ``fresh_write``: writing the slab's size once into memory just allocated (``torch.empty(n).fill_(1)``): what
  first-touching fresh anonymous memory costs (page faults, zeroing), with no source at all;
- ``warm_copy``: copying the mapped slab into memory already touched: the memcpy alone;
- ``thp_copy``: copying it into a fresh anonymous mapping advised ``MADV_HUGEPAGE`` (2 MiB pages where the
  kernel has them): what a huge-page destination would change.

    python benchmarks/copy_mode_bench.py [--engines 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from wcache.demo import DEMO_SHAPE
from wcache.server.process import spawn_daemon
from wcache.synthetic import make_llama_checkpoint

ENGINE = r"""
import asyncio, glob, json, mmap, resource, sys, time
import torch
from safetensors.torch import load_file
from wcache import WCacheClient, WeightCacheKey
model, sock = sys.argv[1], sys.argv[2]
key = WeightCacheKey.from_checkpoint(model)

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def timed(fn):
    f0, t0 = faults(), time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3, faults() - f0

async def main():
    client = WCacheClient(sock)
    r = {}
    f0, t0 = faults(), time.perf_counter()
    c = (await client.fetch(key, mode="copy")).materialize()
    r["copy_ms"], r["copy_faults"] = (time.perf_counter() - t0) * 1e3, faults() - f0
    r.update({f"copy_{k}_ms": v for k, v in c.timings.items()})
    def disk():
        ref = {}
        for f in sorted(glob.glob(model + "/*.safetensors")):
            ref.update({k: v.clone() for k, v in load_file(f).items()})
        return ref
    ref, r["disk_ms"], r["disk_faults"] = timed(disk)
    w = await client.fetch(key)
    (slab,) = [s.base for s in w._keepalive]  # the mapped slab (zero_copy): the copy's source
    n = slab.numel()
    r["slab_bytes"] = n
    _, r["fresh_write_ms"], r["fresh_write_faults"] = timed(lambda: torch.empty(n, dtype=torch.uint8).fill_(1))
    dst = torch.empty(n, dtype=torch.uint8).fill_(0)
    _, r["warm_copy_ms"], r["warm_copy_faults"] = timed(lambda: dst.copy_(slab))
    def thp():
        mm = mmap.mmap(-1, n, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
        torch.frombuffer(mm, dtype=torch.uint8).copy_(slab)
        return mm
    _, r["thp_copy_ms"], r["thp_copy_faults"] = timed(thp)
    r["identical"] = all(torch.equal(c[k], v) for k, v in ref.items())
    r["torch_threads"] = torch.get_num_threads()
    await w.release()
    print(json.dumps(r))

asyncio.run(main())
"""


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=10, help="fresh engine processes (default 10)")
    ap.add_argument("--out", type=Path, help="write the JSON here too")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="wcache-copybench-"))
    try:
        model = make_llama_checkpoint(work / "model", DEMO_SHAPE, shards=2, seed=0)
        sock = work / "sock"
        sock.mkdir(mode=0o700)
        d = spawn_daemon(model, sock, timeout=300)
        try:
            runs = []
            for _ in range(args.engines):
                out = subprocess.run(
                    [sys.executable, "-c", ENGINE, str(model), str(d.socket)],
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=True,
                )
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        finally:
            d.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = [k for k, v in runs[0].items() if isinstance(v, float | int) and not isinstance(v, bool)]
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    result: dict[str, Any] = {
        "benchmark": "copy_mode_bench",
        "date": datetime.date.today().isoformat(),
        "host": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "transparent_hugepage": thp.read_text().strip() if thp.exists() else "",
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "checkpoint_bytes": DEMO_SHAPE.nbytes(),
        "engines": args.engines,
        "all_identical": all(r["identical"] for r in runs),
        "stats": {k: _stats([float(r[k]) for r in runs]) for k in keys},
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
