"""Which read pattern does this machine's disk serve fastest, cold? (docs/performance.md, cold loads)

fastsafetensors 0.5.0 beat wcache's cold load and even a 16-thread 64 MiB O_DIRECT read with no copy at
all (docs/performance.md). This bench reads the same checkpoint cold (page cache dropped before each run)
into nothing, in several patterns, in one run, with fastsafetensors' own load (device copy included) at the
start and at the end as the noise band, and wcache's own cold load (default ``--io``) after the first:

- ``front``: one sequential front over the files in path order; each of T threads takes the next BLOCK
  of it (fastsafetensors' nogds pattern at T=16, BLOCK=512 KiB);
- ``chunks``: each thread reads its own CHUNK-sized job, jobs in file order (wcache's default plan);
- ``perfile``: F files at once, each with its own front and T/F threads.

It also records the block device's queue settings and what cuFile reports, so the note can say what bounds
a cold load on this VM.

    python benchmarks/disk_pattern_bench.py --model /tmp/wcache-bench/llama3-8b --device cuda:0 --out r.json
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from cold_load_bench import child  # noqa: E402  (a script in a fresh process; its last stdout line is JSON)
from gpu_bench import drop_caches  # noqa: E402

# argv: model pattern threads block direct(0|1) files_at_once huge(0|1)
READER = r"""
import glob, json, mmap, os, sys, threading, time
model, pattern, threads, block, direct, per = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", int(sys.argv[6])
huge = sys.argv[7] == "1"   # read into 2 MiB-aligned transparent huge pages: fewer DMA segments per read
files = sorted(glob.glob(model + "/*.safetensors"))
flag = os.O_RDONLY | (os.O_DIRECT if direct else 0)
fds = [os.open(f, flag) for f in files]
sizes = [os.path.getsize(f) for f in files]
def blocks(i):
    return [(fds[i], off, min(block, sizes[i] - off)) for off in range(0, sizes[i], block)]
if pattern == "perfile":
    queues = [[b for i in range(g, len(files), per) for b in blocks(i)] for g in range(per)]
else:   # front and chunks: one queue in file order; chunks = front with a big block
    queues = [[b for i in range(len(files)) for b in blocks(i)]]
lock = threading.Lock()
cursor = [0] * len(queues)
total = [0]
def buffer():
    if not huge:
        return memoryview(mmap.mmap(-1, block))
    mm = mmap.mmap(-1, block + (4 << 20))
    mm.madvise(mmap.MADV_HUGEPAGE)
    addr = __import__("ctypes").addressof(__import__("ctypes").c_char.from_buffer(mm))
    skip = (-addr) % (2 << 20)
    view = memoryview(mm)[skip : skip + block]
    view[::4096] = b"\x00" * len(view[::4096])   # fault the pages in now
    return view
def worker(q):
    buf = buffer()
    mine = 0
    while True:
        with lock:
            k = cursor[q]
            if k >= len(queues[q]):
                break
            cursor[q] = k + 1
        fd, off, n = queues[q][k]
        want = -(-n // 4096) * 4096 if direct else n
        got = os.preadv(fd, [buf[:want]], off)
        mine += min(got, n)
    with lock:
        total[0] += mine
t0 = time.perf_counter()
ts = [threading.Thread(target=worker, args=(i % len(queues),)) for i in range(threads)]
for t in ts: t.start()
for t in ts: t.join()
s = time.perf_counter() - t0
print(json.dumps({"seconds": s, "bytes": total[0], "gb_s": total[0] / s / 1e9}))
"""

PATTERNS: list[tuple[str, str, int, int, bool, int, bool, int]] = [
    # name, pattern, threads, block, O_DIRECT, files at once, huge-page buffers, round
    ("front16_512k_direct", "front", 16, 512 << 10, True, 1, False, 1),  # fastsafetensors' nogds pattern, no copy
    ("front16_1m_direct", "front", 16, 1 << 20, True, 1, False, 1),
    ("front16_4m_direct", "front", 16, 4 << 20, True, 1, False, 1),
    ("front32_1m_direct", "front", 32, 1 << 20, True, 1, False, 1),
    ("front64_512k_direct", "front", 64, 512 << 10, True, 1, False, 1),
    ("front8_2m_direct", "front", 8, 2 << 20, True, 1, False, 1),
    ("perfile4x4_1m_direct", "perfile", 16, 1 << 20, True, 4, False, 1),
    ("chunks16_16m_direct", "chunks", 16, 16 << 20, True, 1, False, 1),
    ("chunks16_16m_buffered", "chunks", 16, 16 << 20, False, 1, False, 1),  # wcache's default plan, no copy
    ("front16_1m_buffered", "front", 16, 1 << 20, False, 1, False, 1),
    # round 2 (after round 1 found 512 KiB far ahead): queue depth and request size around it
    ("r2_front16_512k_direct", "front", 16, 512 << 10, True, 1, False, 2),
    ("r2_front8_512k_direct", "front", 8, 512 << 10, True, 1, False, 2),
    ("r2_front12_512k_direct", "front", 12, 512 << 10, True, 1, False, 2),
    ("r2_front24_512k_direct", "front", 24, 512 << 10, True, 1, False, 2),
    ("r2_front32_512k_direct", "front", 32, 512 << 10, True, 1, False, 2),
    ("r2_front16_256k_direct", "front", 16, 256 << 10, True, 1, False, 2),
    ("r2_front32_256k_direct", "front", 32, 256 << 10, True, 1, False, 2),
    ("r2_front16_768k_direct", "front", 16, 768 << 10, True, 1, False, 2),
    ("r2_front16_1016k_direct", "front", 16, 1016 << 10, True, 1, False, 2),  # 254 pages: one request
    ("r2_front16_1m_direct_huge", "front", 16, 1 << 20, True, 1, True, 2),
    ("r2_front16_512k_direct_huge", "front", 16, 512 << 10, True, 1, True, 2),
    ("r2_perfile2x8_512k_direct", "perfile", 16, 512 << 10, True, 2, False, 2),
]


def block_device_facts(model: Path) -> dict[str, Any]:
    """The queue settings of the block device under ``model`` and the mount it is on."""
    facts: dict[str, Any] = {}
    dev = os.stat(model).st_dev
    facts["st_dev"] = f"{os.major(dev)}:{os.minor(dev)}"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        parts = line.split()
        if parts[2] == facts["st_dev"]:
            sep = parts.index("-")
            facts["mount"] = {"point": parts[4], "fstype": parts[sep + 1], "source": parts[sep + 2]}
    sysdev = Path(f"/sys/dev/block/{facts['st_dev']}")
    if sysdev.exists():
        real = sysdev.resolve()
        disk = real if (real / "queue").exists() else real.parent
        facts["block_device"] = disk.name
        q = disk / "queue"
        for k in (
            "max_sectors_kb",
            "max_hw_sectors_kb",
            "nr_requests",
            "read_ahead_kb",
            "scheduler",
            "rotational",
            "logical_block_size",
            "max_segments",
            "nomerges",
        ):
            try:
                facts[k] = (q / k).read_text().strip()
            except OSError:
                pass
        mq = disk / "mq"
        facts["hw_queues"] = len(list(mq.iterdir())) if mq.exists() else None
    return facts


def cufile_facts() -> dict[str, Any]:
    """What the cuFile library says on this machine (GPUDirect Storage), without loading anything else."""
    out: dict[str, Any] = {}
    for tool in ("/usr/local/cuda/gds/tools/gdscheck", "gdscheck"):
        try:
            r = subprocess.run([tool, "-p"], check=False, capture_output=True, text=True, timeout=30)
            out["gdscheck"] = (r.stdout + r.stderr)[-4000:]
            break
        except (OSError, subprocess.TimeoutExpired) as exc:
            out.setdefault("gdscheck_errors", []).append(f"{tool}: {exc}")
    code = r"""
import json
res = {}
try:
    from cuda.bindings import cufile
    res["module"] = "cuda.bindings.cufile"
    try:
        cufile.driver_open()
        res["driver_open"] = "ok"
        try:
            props = cufile.driver_get_properties()
            res["properties"] = {k: str(getattr(props, k)) for k in dir(props) if not k.startswith("_")}
        except Exception as e:
            res["properties_error"] = repr(e)
        cufile.driver_close()
    except Exception as e:
        res["driver_open"] = repr(e)
except Exception as e:
    res["import_error"] = repr(e)
print(json.dumps(res))
"""
    out["python"] = child(code, timeout=60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", nargs="*", help="pattern names to run (default: all; 'wcache' for the daemon's load)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/wcache-bench"))
    ap.add_argument("--round", type=int, default=2, help="the pattern round to run without --only (1 or 2)")
    ap.add_argument("--wcache-io", nargs="*", default=["buffered", "stream"], help="wcache --io modes to load cold")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    import cold_load_bench as clb

    res: dict[str, Any] = {
        "benchmark": "disk_pattern_bench",
        "date": datetime.date.today().isoformat(),
        "model": str(args.model),
        "bytes": sum(f.stat().st_size for f in args.model.glob("*.safetensors")),
        "cpus": os.cpu_count(),
        "block_device": block_device_facts(args.model),
    }
    runs: dict[str, Any] = {}
    t_all = time.perf_counter()

    def fst(tag: str) -> None:
        dropped = drop_caches()
        r = child(clb.FASTSAFETENSORS, str(args.model), args.device, timeout=120)
        runs[tag] = {**r, "page_cache_dropped": dropped}
        print(tag, json.dumps(runs[tag]), flush=True)

    fst("fastsafetensors_first")
    for io in args.wcache_io:  # wcache's own cold loads, same run
        dropped = drop_caches()
        tag = "wcache" if io == "buffered" else f"wcache_{io.replace(':', '_')}"
        runs[tag] = {**clb.daemon_load(args.model, args.device, args.work, "--io", io), "page_cache_dropped": dropped}
        print(tag, json.dumps(runs[tag]), flush=True)
    for name, pattern, threads, block, direct, per, huge, rnd in PATTERNS:
        if (args.only and name not in args.only) or (not args.only and rnd != args.round):
            continue
        dropped = drop_caches()
        flags = ("1" if direct else "0", str(per), "1" if huge else "0")
        r = child(READER, str(args.model), pattern, str(threads), str(block), *flags)
        runs[name] = {
            **r,
            "pattern": pattern,
            "threads": threads,
            "block": block,
            "direct": direct,
            "files_at_once": per,
            "huge_pages": huge,
            "page_cache_dropped": dropped,
        }
        print(name, json.dumps(runs[name]), flush=True)
    fst("fastsafetensors_last")
    res["runs"] = runs
    band = [runs[k]["seconds"] for k in ("fastsafetensors_first", "fastsafetensors_last") if "seconds" in runs[k]]
    res["fastsafetensors_band_s"] = band
    if band:
        ref = min(band)
        res["over_best_fastsafetensors"] = {k: round(v["seconds"] / ref, 3) for k, v in runs.items() if "seconds" in v}
    res["cufile"] = cufile_facts()
    res["wall_s"] = time.perf_counter() - t_all
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("fastsafetensors_band_s", "over_best_fastsafetensors") if k in res}))


if __name__ == "__main__":
    main()
