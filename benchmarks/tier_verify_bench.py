"""What verifying every byte of a host-tier entry costs (wcache/server/tier.py), host backend, on CPU.

Three figures, for a tier file of ``--gib`` GiB of random bytes in shared memory:

- ``hash``: single-thread throughput of the candidate checksums over bytes already in memory (zlib.crc32
  whole and per 1 MiB block; hashlib sha256, sha1, blake2b) — the choice of checksum;
- ``save_crcs``: ``_block_crcs`` (what a save adds: the CRC-32 of every 1 MiB block, on up to 8 threads);
- ``restore``: ``load_file_into`` of the file into a new host slab (memfd) with and without the block check
  (``BlockCrcs``: the bytes read into the slab's mapping, or read back where sendfile copied them), for each
  ``--threads``; the two are interleaved, ``--repeat`` times each: the medians, and the overhead of the best
  runs (the steadier figure on a shared machine; ``load_avg_*`` says how shared).

    python benchmarks/tier_verify_bench.py [--gib 1] [--threads 1 2] [--repeat 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wcache.server.backends.host import HostBackend
from wcache.server.loader import load_file_into
from wcache.server.tier import CHECK_BLOCK, BlockCrcs, _block_crcs


def _best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, nargs="*", default=[1, os.cpu_count() or 1])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    size = int(args.gib * (1 << 30))
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "bytes": size,
        "block": CHECK_BLOCK,
        "load_avg_before": os.getloadavg()[0],
    }
    fd, name = tempfile.mkstemp(prefix="tierbench-", suffix=".slab", dir="/dev/shm")
    path = Path(name)
    try:
        block = os.urandom(CHECK_BLOCK)
        for off in range(0, size, CHECK_BLOCK):
            os.write(fd, block[: min(CHECK_BLOCK, size - off)])
        data = memoryview(path.read_bytes())
        hashes: dict[str, Callable[[], object]] = {
            "crc32": lambda: zlib.crc32(data),
            "crc32_1MiB_blocks": lambda: [zlib.crc32(data[o : o + CHECK_BLOCK]) for o in range(0, size, CHECK_BLOCK)],
            "sha256": lambda: hashlib.sha256(data).digest(),
            "sha1": lambda: hashlib.sha1(data).digest(),
            "blake2b": lambda: hashlib.blake2b(data).digest(),
        }
        out["hash_gb_s"] = {k: round(size / _best(f, 3) / 1e9, 2) for k, f in hashes.items()}
        data.release()
        crcs = b""

        def save() -> None:
            nonlocal crcs
            crcs = _block_crcs(fd, size)

        out["save_crcs_s"] = round(_best(save, 3), 3)
        check = BlockCrcs(crcs, size)
        backend = HostBackend()
        rows = []
        for threads in args.threads:
            times: dict[str, list[float]] = {"unchecked": [], "checked": []}
            for _ in range(args.repeat):
                for mode in times:
                    slab = backend.allocate(size)
                    rfd = os.open(path, os.O_RDONLY)
                    try:
                        t0 = time.perf_counter()
                        load_file_into(path, slab, threads=threads, fd=rfd, check=check if mode == "checked" else None)
                        times[mode].append(time.perf_counter() - t0)
                    finally:
                        os.close(rfd)
                        slab.close()
            med = {k: statistics.median(v) for k, v in times.items()}
            best = {k: min(v) for k, v in times.items()}
            rows.append(
                {
                    "threads": threads,
                    "unchecked_s": round(med["unchecked"], 3),
                    "checked_s": round(med["checked"], 3),
                    "unchecked_gb_s": round(size / med["unchecked"] / 1e9, 2),
                    "checked_gb_s": round(size / med["checked"] / 1e9, 2),
                    "overhead": round(med["checked"] / med["unchecked"] - 1, 3),
                    "overhead_of_best": round(best["checked"] / best["unchecked"] - 1, 3),
                    "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
                }
            )
        out["restore"] = rows
        out["load_avg_after"] = os.getloadavg()[0]
    finally:
        os.close(fd)
        path.unlink()
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
