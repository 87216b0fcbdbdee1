"""Cost of building 50,000 tensor views on one device, by method (the 50,000-tensor MoE layout).

A 50,000-tensor STATE group is one stacked view split with ``unbind``; this measures what
that split costs per tensor on CPU and CUDA tensors, and the alternatives.

    python benchmarks/views_bench.py [--device cuda:0] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def timed(fn: Callable[[], Any], repeats: int = 7) -> float:
    xs = []
    for _ in range(repeats):
        gc.disable()
        t0 = time.perf_counter()
        r = fn()
        xs.append((time.perf_counter() - t0) * 1e3)
        del r
        gc.enable()
    return statistics.median(xs)


def methods(base: torch.Tensor, n: int) -> dict[str, float]:
    shape, stride = (64, 128), (128, 1)

    def stacked() -> torch.Tensor:
        return base.as_strided((n, *shape), (8192, *stride), 0)

    def inference() -> tuple[torch.Tensor, ...]:
        with torch.inference_mode():
            return stacked().unbind(0)

    def no_grad() -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return stacked().unbind(0)

    return {
        "unbind": timed(lambda: stacked().unbind(0)),
        "unbind_no_grad": timed(no_grad),
        "unbind_inference_mode": timed(inference),
        "aten_unbind": timed(lambda: torch.ops.aten.unbind.int(stacked(), 0)),
        "as_strided_loop": timed(lambda: [base.as_strided(shape, stride, i * 8192) for i in range(n)]),
        "dict_of_unbind": timed(lambda: dict(zip(map(str, range(n)), stacked().unbind(0)))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res: dict[str, Any] = {"benchmark": "views_bench", "torch": torch.__version__, "n": args.n, "ms": {}}
    devices = ["cpu"] + ([args.device] if args.device != "cpu" else [])
    for dev in devices:
        base = torch.zeros(args.n * 8192, dtype=torch.bfloat16, device=dev)
        res["ms"][dev] = methods(base, args.n)
        print(dev, json.dumps(res["ms"][dev]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
