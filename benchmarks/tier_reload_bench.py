"""What a host-tier reload costs in a *fresh* daemon process, by reader threads and staging size (docs/performance.md).

A restarted daemon finds its slab in the host tier (a file in shared memory) and copies it to a new GPU
slab with the loader's pinned staging pipeline (``load_file_into``). The staging is new in a new
process: it is mapped and page-locked before the first copy, so its size is part of the restart time.
Each configuration runs in its own process (torch and the CUDA context started first, not timed):

- ``seconds``: slab allocation + staging setup + the copy (what the daemon logs as ``load_s``);
- ``staging_map_s``: mapping the staging; ``register_s_max`` / ``_sum``: page-locking it, which each
  reader thread does for its own buffers (the longest one, and all of them added up);
- ``checked``: whether the refill verified every 1 MiB block's CRC-32 on the staged bytes, as the daemon's
  refills do (wcache/server/tier.py); ``--checks`` picks (default both, so the cost is the difference).

    python benchmarks/tier_reload_bench.py --device cuda:0 --model /tmp/wcache-bench/llama3-8b --out F
    python benchmarks/tier_reload_bench.py --synthetic-gib 15 --threads 12 16 --staging-mib 128 256 512 --out F
(``--synthetic-gib``: a tier file of random bytes instead of the checkpoint's; no checkpoint needed.)
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
from typing import Any

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, sys, time
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
from wcache.server import loader
from wcache.server.backends import cuda as cuda_backend
from wcache.server.backends.cuda import CudaBackend
path, dev, threads, staging = Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
checked = sys.argv[6] == "on"
torch.empty(1, device=dev); torch.cuda.synchronize()
spent, took = [], []
init, take = cuda_backend._Staging.__init__, cuda_backend._Staging.take
def timed_init(self, *a, **k):
    t = time.perf_counter(); init(self, *a, **k); spent.append(time.perf_counter() - t)
def timed_take(self, *a, **k):
    t = time.perf_counter(); r = take(self, *a, **k); took.append(time.perf_counter() - t); return r
cuda_backend._Staging.__init__, cuda_backend._Staging.take = timed_init, timed_take
backend = CudaBackend(torch.device(dev).index or 0, staging_bytes=staging)
size = path.stat().st_size
fd = os.open(path, os.O_RDONLY)
check = None
if checked:  # the checksums a save writes into the meta (not timed: the refill's cost is what is measured)
    from wcache.server.tier import BlockCrcs, _block_crcs
    check = BlockCrcs(_block_crcs(fd, size), size)
t0 = time.perf_counter()
slab = backend.allocate(size)
stats = loader.load_file_into(path, slab, threads=threads, started=t0, fd=fd, check=check)
seconds = time.perf_counter() - t0
with open(path, "rb") as fh:
    fh.seek(size - 4096)
    ok = bool(slab.tensor()[-4096:].cpu().numpy().tobytes() == fh.read())
print(json.dumps({"seconds": seconds, "staging_map_s": sum(spent), "register_s_max": max(took, default=0.0),
                  "register_s_sum": sum(took), "gb_s": size / seconds / 1e9, "tail_ok": ok, "checked": checked}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", type=Path, default=Path("/tmp/wcache-bench/llama3-8b"))
    ap.add_argument("--tier-file", type=Path, default=Path("/dev/shm/wcache-tier-bench.slab"))
    ap.add_argument("--threads", type=int, nargs="*", default=[8, 16])
    ap.add_argument("--staging-mib", type=int, nargs="*", default=[256, 512])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--checks", nargs="*", choices=["off", "on"], default=["off", "on"])
    ap.add_argument("--synthetic-gib", type=float, help="a tier file of random bytes instead of the checkpoint's")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    # the tier file: the checkpoint's bytes back to back in shared memory, as a tier entry holds a slab
    files = [] if args.synthetic_gib else sorted(args.model.glob("*.safetensors"))
    if not files and not args.synthetic_gib:
        raise SystemExit(f"no checkpoint in {args.model}")
    t = time.perf_counter()
    with open(args.tier_file, "wb") as out:
        if args.synthetic_gib:
            block = os.urandom(1 << 20) * 64  # non-zero pages (a fallocated tmpfs page reads as the zero page)
            left = int(args.synthetic_gib * (1 << 30))
            while left:
                left -= out.write(block[: min(left, len(block))])
        for f in files:
            with open(f, "rb") as src:
                size = os.fstat(src.fileno()).st_size
                done = 0
                while done < size:
                    done += os.sendfile(out.fileno(), src.fileno(), done, size - done)
        out.truncate(-(-out.tell() // (64 << 20)) * (64 << 20))  # a whole number of slab granules
    size = args.tier_file.stat().st_size
    res: dict[str, Any] = {
        "benchmark": "tier_reload_bench",
        "date": datetime.date.today().isoformat(),
        "device": args.device,
        "bytes": size,
        "write_tier_file_s": round(time.perf_counter() - t, 2),
        "runs": [],
    }
    try:
        for threads in args.threads:
            for mib, checks in ((m, c) for m in args.staging_mib for c in args.checks):
                for _ in range(args.repeats):
                    p = subprocess.run(
                        [
                            sys.executable,
                            "-c",
                            CHILD,
                            str(REPO),
                            str(args.tier_file),
                            args.device,
                            str(threads),
                            str(mib << 20),
                            checks,
                        ],
                        capture_output=True,
                        text=True,
                        timeout=120,
                        check=False,
                    )
                    r: dict[str, Any] = {"threads": threads, "staging_mib": mib, "checked": checks == "on"}
                    if p.returncode == 0:
                        r.update(json.loads(p.stdout.strip().splitlines()[-1]))
                    else:
                        r["error"] = (p.stderr.strip().splitlines() or [f"rc {p.returncode}"])[-1][:300]
                    res["runs"].append(r)
                    print(json.dumps(r), flush=True)
                    args.out.write_text(json.dumps(res, indent=2) + "\n")
    finally:
        args.tier_file.unlink(missing_ok=True)
    ok = [r for r in res["runs"] if "seconds" in r]
    for checked in (False, True):
        mine = [r for r in ok if r["checked"] == checked]
        if mine:
            res["best_checked" if checked else "best"] = min(mine, key=lambda r: r["seconds"])
    res["targets"] = {"tier_reload_s": 0.5}
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: res.get(k) for k in ("best", "best_checked")}), flush=True)


if __name__ == "__main__":
    main()
