"""What the daemon's check of a reclaimed model (wcache/server/reclaim.py) costs, host backend, on CPU.

For each checkpoint: load it into a sealed memfd slab, then time ``check_model`` (key recomputed from disk,
layout compared, SAMPLES ranges of SAMPLE_BYTES compared with the files) with the checkpoint's pages in the
page cache (warm) and evicted from it with POSIX_FADV_DONTNEED (cold: what a daemon restarted long after
the load sees). Writes one JSON line per case.

    python benchmarks/reclaim_check_bench.py [--big-gb 2] [--repeat 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from wcache.plan.key import RankSpec
from wcache.server.backends.host import HostBackend
from wcache.server.load import load_model
from wcache.server.reclaim import SAMPLE_BYTES, SAMPLES, check_model
from wcache.synthetic import TINY, LlamaShape, make_llama_checkpoint


def _evict(ckpt: Path) -> None:
    for f in ckpt.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench(ckpt: Path, repeat: int) -> list[dict[str, object]]:
    model = load_model(RankSpec(ckpt), backend=HostBackend())
    out: list[dict[str, object]] = []
    try:
        for mode in ("warm", "cold"):
            times = []
            for _ in range(repeat):
                if mode == "cold":
                    _evict(ckpt)
                t0 = time.perf_counter()
                check = check_model(model)
                times.append(time.perf_counter() - t0)
                assert check.reason is None, check.reason
            out.append(
                {
                    "checkpoint_bytes": sum(f.stat().st_size for f in ckpt.glob("*.safetensors")),
                    "files": len(list(ckpt.glob("*.safetensors"))),
                    "mode": mode,
                    "samples": SAMPLES,
                    "sample_bytes": SAMPLE_BYTES,
                    "ms_median": round(statistics.median(times) * 1e3, 2),
                    "ms_max": round(max(times) * 1e3, 2),
                    "repeat": repeat,
                }
            )
    finally:
        model.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-gb", type=float, default=2.0, help="size of the larger synthetic checkpoint (0: skip)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        rows += bench(make_llama_checkpoint(Path(tmp) / "tiny", TINY, shards=2, seed=1), args.repeat)
        if args.big_gb > 0:
            layers = max(1, round(args.big_gb * 1e9 / 2 / 47e6) - 3)  # ~47M params per layer at this width
            shape = LlamaShape(hidden=2048, intermediate=5632, layers=layers, heads=16, kv_heads=8, vocab=32000)
            rows += bench(make_llama_checkpoint(Path(tmp) / "big", shape, shards=4, seed=2), args.repeat)
    for r in rows:
        print(json.dumps(r))
    if args.out is not None:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
