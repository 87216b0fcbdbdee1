"""Why does a daemon whose CUDA driver calls came before torch's runtime copy slowly? (docs/performance.md, cold loads)

A daemon that starts driver-first (reclaiming from its keeper without torch) and must then load a model
copied host-to-device at 4.7 GB/s instead of 27 GB/s (backends/cuda.py ``prepare_loads``). Each order runs
in a fresh process and times pinned host-to-device copies (256 MiB x 16) from torch's pinned allocator and
from an anonymous mapping registered with cudaHostRegister (the loader's staging), so the JSON says which
start-up order and which kind of pinned memory is slow.

    python benchmarks/driver_order_probe.py --out r.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, mmap, sys, time
order = sys.argv[1]
if order == "bindings_first":      # what a torch-free daemon does (wcache/_cuda.py)
    from cuda.bindings import driver as d
    d.cuInit(0)
    err, dev = d.cuDeviceGet(0)
    err, ctx = d.cuDevicePrimaryCtxRetain(dev)
    d.cuCtxSetCurrent(ctx)
    err, free, total = d.cuMemGetInfo()
elif order == "ctypes_first":      # the same calls through libcuda with ctypes (what the client does)
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuInit(0)
    dev = ctypes.c_int(); cu.cuDeviceGet(ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p(); cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    cu.cuCtxSetCurrent(ctx)
import torch
torch.cuda.init(); torch.empty(1, device="cuda:0"); torch.cuda.synchronize()
n = 256 << 20
dst = torch.empty(n, dtype=torch.uint8, device="cuda:0")
def bw(src):
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(16):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 16 * n / (time.perf_counter() - t0) / 1e9
res = {"order": order}
res["torch_pinned_gb_s"] = bw(torch.empty(n, dtype=torch.uint8, pin_memory=True))
mm = mmap.mmap(-1, n, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
mm.madvise(mmap.MADV_HUGEPAGE)
host = torch.frombuffer(mm, dtype=torch.uint8)
err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), n, 0)
res["register_err"] = int(err)
res["registered_gb_s"] = bw(host)
res["pageable_gb_s"] = bw(torch.empty(n, dtype=torch.uint8))
print(json.dumps(res))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    res: dict[str, Any] = {"benchmark": "driver_order_probe", "date": datetime.date.today().isoformat(), "runs": []}
    for order in ("torch_first", "bindings_first", "ctypes_first", "torch_first"):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, order], capture_output=True, text=True, timeout=120, check=False
        )
        if out.returncode != 0:
            res["runs"].append({"order": order, "error": out.stderr[-1500:]})
        else:
            res["runs"].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(res["runs"][-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
