"""Cold and warm daemon loads vs other loaders, side by side (docs/performance.md).

On a GPU (``--device cuda:0``), same 16 GB Llama-3-8B-shaped checkpoint:
wcache-server load cold (page cache dropped) and warm, a TP=2 rank's read fraction,
``safetensors.torch.load_file(device=...)`` cold/warm, fastsafetensors and
runai-model-streamer cold/warm when they import, and the disk's own ceiling that day (the
same files read cold by as many threads in 64 MiB preads into nothing, O_DIRECT and buffered:
no loader can beat it). On the CPU (``--device cpu``): the
host backend's load against ``safetensors.torch.load_file`` + materialising the tensors
in memory, as a ratio.

wcache's figure is the daemon's own ``loaded ... seconds=`` line (reading, copying,
synchronising; not the Python start-up), the others are timed inside their process
after ``import torch`` and CUDA initialisation, so both exclude interpreter start-up.

    python benchmarks/cold_load_bench.py --device cuda:0 --out $OUT/cold_load.json
    python benchmarks/cold_load_bench.py --device cpu --repeats 3      # CPU ratio, medians of 3
    # the read-pattern variants against fastsafetensors, same run (a short device call)
    python benchmarks/cold_load_bench.py --device cuda:0 --only wcache wcache_stream wcache_stream_512k \
        wcache_stream_4m fastsafetensors disk_direct disk_direct_512k
    # the suite's cold step: wcache and fastsafetensors adjacent, in both orders, then the disk's ceiling;
    # one cold run per entry (page cache dropped before each), warm runs only for --warm
    python benchmarks/cold_load_bench.py --device cuda:0 --sequence wcache fastsafetensors fastsafetensors \
        wcache disk_direct --warm wcache

``--sequence`` runs loaders in exactly that order (a name may repeat) and reports the sequence as run,
``pairs_wcache_over_fastsafetensors`` (each wcache run over the fastsafetensors run next to it) and the ratio
of the medians: the machine's drift over the run shows as the spread of the pairs.

``--io stream`` variants read as fastsafetensors 0.5.0 does (docs/performance.md);
``variants_over_fastsafetensors_cold`` gives each wcache variant's cold ratio and warm seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from wcache.server.process import spawn_daemon  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_bench import drop_caches  # noqa: E402

SAFETENSORS = r"""
import glob, json, sys, time, torch
from safetensors.torch import load_file
dev = sys.argv[2]
if dev != "cpu":
    torch.empty(1, device=dev); torch.cuda.synchronize()
t0 = time.perf_counter(); n = 0
for f in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
    d = load_file(f, device=dev)
    if dev == "cpu":
        d = {k: v.clone() for k, v in d.items()}   # materialise: load_file on cpu only maps
    n += len(d)
if dev != "cpu":
    torch.cuda.synchronize()
print(json.dumps({"seconds": time.perf_counter() - t0, "tensors": n}))
"""

FASTSAFETENSORS = r"""
import glob, json, sys, time, torch
from fastsafetensors import fastsafe_open
dev = sys.argv[2]
torch.empty(1, device=dev); torch.cuda.synchronize()
files = sorted(glob.glob(sys.argv[1] + "/*.safetensors"))
t0 = time.perf_counter(); n = 0
with fastsafe_open(filenames=files, nogds=True, device=dev) as f:
    for k in f.keys():
        t = f.get_tensor(k); n += 1
torch.cuda.synchronize()
print(json.dumps({"seconds": time.perf_counter() - t0, "tensors": n}))
"""

RUNAI = r"""
import glob, json, sys, time, torch
from runai_model_streamer import SafetensorsStreamer
dev = sys.argv[2]
torch.empty(1, device=dev); torch.cuda.synchronize()
t0 = time.perf_counter(); n = 0
with SafetensorsStreamer() as s:
    for f in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
        s.stream_file(f)
        for name, t in s.get_tensors():
            t.to(dev); n += 1
torch.cuda.synchronize()
print(json.dumps({"seconds": time.perf_counter() - t0, "tensors": n}))
"""


DISK = r"""
import glob, json, mmap, os, sys, time
from concurrent.futures import ThreadPoolExecutor
files, direct, threads = sorted(glob.glob(sys.argv[1] + "/*.safetensors")), sys.argv[2] == "direct", int(sys.argv[3])
chunk = int(sys.argv[4]) if len(sys.argv) > 4 else 64 << 20
jobs = [(f, off) for f in files for off in range(0, os.path.getsize(f), chunk)]
flag = os.O_RDONLY | (os.O_DIRECT if direct else 0)
fds = {f: os.open(f, flag) for f in files}
def run(j):
    buf = getattr(tl, "buf", None)
    if buf is None:
        buf = tl.buf = mmap.mmap(-1, chunk)
    f, off = j
    return os.preadv(fds[f], [buf], off)
import threading; tl = threading.local()
t0 = time.perf_counter()
with ThreadPoolExecutor(threads) as ex:
    n = sum(ex.map(run, jobs))
s = time.perf_counter() - t0
print(json.dumps({"seconds": s, "bytes": n, "gb_s": n / s / 1e9, "threads": threads, "read_bytes": chunk}))
"""


def child(code: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(code)
    try:
        out = subprocess.run(
            [sys.executable, fh.name, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    finally:
        os.unlink(fh.name)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1][:300] if out.stderr.strip() else f"rc {out.returncode}"}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def daemon_load(model: Path, device: str, work: Path, *extra: str) -> dict[str, Any]:
    """Start wcache-server, read its 'loaded' line, stop it."""
    sock = work / "sock"
    sock.mkdir(mode=0o700, exist_ok=True)
    os.chmod(sock, 0o700)
    log = work / "daemon.log"
    try:
        d = spawn_daemon(model, sock, "--device", device, *extra, log=log, timeout=600)
    except (RuntimeError, TimeoutError) as exc:
        return {"error": str(exc)[-1500:]}
    ready_s = d.ready_seconds
    d.stop()
    text = log.read_text()
    m = re.search(
        r"loaded bytes_read=(\d+) bytes_stored=(\d+) seconds=([\d.]+) read_gb_s=([\d.]+) read_fraction=([\d.]+)", text
    )
    if not m:
        return {"error": text[-1500:]}
    return {
        "seconds": float(m.group(3)),
        "bytes_read": int(m.group(1)),
        "read_gb_s": float(m.group(4)),
        "read_fraction": float(m.group(5)),
        "process_start_to_ready_s": ready_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", type=Path, help="checkpoint (default: generate one)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/wcache-bench"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--repeats", type=int, default=1, help="cold and warm runs per loader (the median is reported)")
    ap.add_argument("--only", nargs="*", help="loaders to run (default: all)")
    ap.add_argument("--threads", type=int, help="wcache-server --threads")
    ap.add_argument("--sequence", nargs="+", help="loaders to run cold, in this order (repeats allowed)")
    ap.add_argument("--warm", nargs="*", default=None, help="with --sequence: loaders also run warm once")
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = f"{REPO}:{os.environ.get('PYTHONPATH', '')}"
    from wcache.synthetic import LLAMA3_8B, LlamaShape, make_llama_checkpoint

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    gpu = args.device != "cpu"
    model = args.model or (work / ("llama3-8b" if gpu else "cold-cpu"))
    if not (model / "config.json").exists():
        shape = (
            LLAMA3_8B
            if gpu
            else LlamaShape(hidden=1536, intermediate=4096, layers=32, heads=16, kv_heads=8, vocab=64000)
        )
        make_llama_checkpoint(model, shape, shards=4 if gpu else 2, seed=0, device="cuda:0" if gpu else "cpu")
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    res: dict[str, Any] = {
        "benchmark": "cold_load_bench",
        "date": datetime.date.today().isoformat(),
        "device": args.device,
        "checkpoint_bytes": size,
        "cpus": os.cpu_count(),
    }
    runs: dict[str, dict[str, Any]] = {}
    wextra = ["--threads", str(args.threads)] if args.threads else []
    loaders: list[tuple[str, Any]] = [
        ("wcache", lambda: daemon_load(model, args.device, work, *wextra)),
        ("safetensors", lambda: child(SAFETENSORS, str(model), args.device)),
    ]
    if gpu:
        t = str(args.threads or 16)
        loaders += [  # the disk's own ceiling: the same reads with no copy at all (64 MiB preads, threads)
            ("disk_direct", lambda: child(DISK, str(model), "direct", t)),
            ("disk_buffered", lambda: child(DISK, str(model), "buffered", t)),
            # fastsafetensors' nogds pattern with no copy: 512 KiB O_DIRECT reads in file order
            ("disk_direct_512k", lambda: child(DISK, str(model), "direct", t, str(512 << 10))),
        ]
        loaders += [
            ("wcache_buffered_io", lambda: daemon_load(model, args.device, work, "--io", "buffered")),
            # smaller pinned staging: less to page-lock in a fresh daemon, 8-16 MiB reads
            (
                "wcache_staging_512m",
                lambda: daemon_load(model, args.device, work, *wextra, "--staging-bytes", "536870912"),
            ),
            (
                "wcache_staging_1g",
                lambda: daemon_load(model, args.device, work, *wextra, "--staging-bytes", "1073741824"),
            ),
            ("wcache_direct_io", lambda: daemon_load(model, args.device, work, *wextra, "--io", "direct")),
            # fastsafetensors' read pattern (docs/performance.md): O_DIRECT blocks in file order
            # for uncached files, buffered whole jobs for cached ones (the warm rows)
            ("wcache_stream", lambda: daemon_load(model, args.device, work, *wextra, "--io", "stream")),
            ("wcache_stream_512k", lambda: daemon_load(model, args.device, work, *wextra, "--io", "stream:512KiB")),
            ("wcache_stream_4m", lambda: daemon_load(model, args.device, work, *wextra, "--io", "stream:4MiB")),
            ("fastsafetensors", lambda: child(FASTSAFETENSORS, str(model), args.device)),
            ("runai_model_streamer", lambda: child(RUNAI, str(model), args.device)),
        ]
    if args.sequence:
        known = dict(loaders)
        unknown = [n for n in args.sequence + (args.warm or []) if n not in known]
        if unknown:
            ap.error(f"unknown loaders {unknown}; known: {sorted(known)}")
        res["sequence"] = _sequence(known, args.sequence, args.warm or [], runs)
        loaders = []
    for name, fn in loaders:
        if args.only and name not in args.only:
            continue
        colds, warms, dropped = [], [], True
        for _ in range(max(1, args.repeats)):
            dropped = drop_caches() and dropped
            colds.append(fn())
        for _ in range(max(1, args.repeats) if not name.startswith("disk_") else 0):
            warms.append(fn())
        runs[name] = {
            "cold": _median_run(colds),
            "warm": _median_run(warms) if warms else {},
            "cold_all_s": [r.get("seconds") for r in colds],
            "warm_all_s": [r.get("seconds") for r in warms],
            "page_cache_dropped": dropped,
        }
        print(name, json.dumps(runs[name]), flush=True)
    res["runs"] = runs
    tp = daemon_load(model, args.device, work, "--tp-size", "2", "--tp-rank", "1")
    res["tp2_rank1_warm"] = tp
    w, s = runs.get("wcache", {"cold": {}, "warm": {}}), runs.get("safetensors", {"cold": {}, "warm": {}})
    res["summary"] = {
        "wcache_cold_s": w["cold"].get("seconds"),
        "wcache_warm_s": w["warm"].get("seconds"),
        "safetensors_cold_s": s["cold"].get("seconds"),
        "safetensors_warm_s": s["warm"].get("seconds"),
        "tp2_rank_read_fraction": tp.get("read_fraction"),
        "fastsafetensors_cold_s": runs.get("fastsafetensors", {}).get("cold", {}).get("seconds"),
        "disk_direct_read_s": runs.get("disk_direct", {}).get("cold", {}).get("seconds"),
        "disk_buffered_read_s": runs.get("disk_buffered", {}).get("cold", {}).get("seconds"),
        "wcache_over_safetensors_cold": _ratio(w["cold"], s["cold"]),
        "wcache_over_safetensors_warm": _ratio(w["warm"], s["warm"]),
        "targets": {"cold_s": 7.0, "warm_s": 1.0, "tp2_read_fraction": 0.55} if gpu else {"ratio_max": 1.0},
    }
    # wcache's cold load over fastsafetensors' in the same run (medians), and each adjacent pair's ratio
    fst = runs.get("fastsafetensors", {}).get("cold", {})
    res["wcache_over_fastsafetensors_cold"] = _ratio(w["cold"], fst)
    res["pairs_wcache_over_fastsafetensors"] = runs.get("wcache", {}).get("pairs_over_fastsafetensors", [])
    # every wcache variant of this run against the same fastsafetensors run (cold), and its warm load
    res["variants_over_fastsafetensors_cold"] = {
        name: {"cold_ratio": _ratio(r["cold"], fst), "warm_s": r["warm"].get("seconds")}
        for name, r in runs.items()
        if name.startswith("wcache")
    }
    print(json.dumps(res["summary"], indent=2))
    dest = args.out or REPO / "benchmarks" / "results" / f"cold_load-{args.device.replace(':', '')}-{res['date']}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(res, indent=2) + "\n")


def _sequence(
    loaders: dict[str, Any], order: list[str], warm: list[str], runs: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Run ``order`` cold (page cache dropped before each), then each of ``warm`` once warm (after a run of it
    that filled the page cache); fill ``runs`` as the per-loader loop does. Returns the sequence as run."""
    done: list[dict[str, Any]] = []
    colds: dict[str, list[dict[str, Any]]] = {}
    for name in order:
        dropped = drop_caches()
        r = loaders[name]()
        colds.setdefault(name, []).append(r)
        done.append({"loader": name, "seconds": r.get("seconds"), "page_cache_dropped": dropped, **r})
        print(name, "cold", json.dumps(r), flush=True)
    for name in warm:
        if done[-1]["loader"] != name:  # its files into the page cache first (the drops above emptied it)
            loaders[name]()
        r = loaders[name]()
        done.append({"loader": name, "warm": True, **r})
        runs.setdefault(name, {})["warm"] = r
        print(name, "warm", json.dumps(r), flush=True)
    for name, rs in colds.items():
        runs.setdefault(name, {}).update(
            cold=_median_run(rs), cold_all_s=[r.get("seconds") for r in rs], page_cache_dropped=True
        )
        runs[name].setdefault("warm", {})
    pairs = []
    for i, a in enumerate(done[:-1]):
        b = done[i + 1]
        if {a["loader"], b["loader"]} == {"wcache", "fastsafetensors"} and not a.get("warm") and not b.get("warm"):
            w, f = (a, b) if a["loader"] == "wcache" else (b, a)
            if w.get("seconds") and f.get("seconds"):
                pairs.append(float(w["seconds"]) / float(f["seconds"]))
    if pairs:
        runs.setdefault("wcache", {})["pairs_over_fastsafetensors"] = pairs
    return done


def _median_run(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median time (the lower middle one for an even count)."""
    ok = sorted((r for r in rs if "seconds" in r), key=lambda r: float(r["seconds"]))
    return ok[(len(ok) - 1) // 2] if ok else rs[0]


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    if "seconds" in a and "seconds" in b and b["seconds"]:
        return float(a["seconds"]) / float(b["seconds"])
    return None


if __name__ == "__main__":
    main()
