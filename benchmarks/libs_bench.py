"""What prometheus_client, tqdm and rich would cost the daemon (docs/architecture.md, "Libraries").

Three measurements, each alternating the variants sample by sample so that a shared machine's load falls on
all of them alike:

- ``import``: in a fresh interpreter that has already imported the daemon's start-up modules (those a daemon
  restarted on its keeper imports: cli, startup, daemon, store, loader, metrics), the time and resident memory
  that ``import LIB`` adds, and how many modules it brings;
- ``restart``: a daemon restarted on its wcache-keeper after SIGKILL (benchmarks/keeper_restart_bench.py's
  path: nothing read from disk, no torch), spawn -> ready file (``spawn_daemon``'s, which polls every 20 ms,
  and the ready file's mtime, to the kernel's tick), and its VmRSS once ready — as it is, and with
  each library imported at interpreter start (a ``sitecustomize`` on PYTHONPATH), which is what importing it
  from a start-up module would cost;
- ``no_tty``: what each progress display writes to a pipe (a daemon under systemd: stderr is the journal)
  while 8 threads report a load: bytes, newline-terminated lines, carriage returns and ANSI escapes.

Bytecode is compiled first (``compileall`` over wcache and each library). Run::

    python benchmarks/libs_bench.py --samples 15 --out benchmarks/results/libs-cpu-2026-12-01.json
"""

from __future__ import annotations

import argparse
import compileall
import datetime
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

#: the wcache modules a daemon restarted on its keeper has imported when it is ready (PYTHONPROFILEIMPORTTIME)
START_MODULES = (
    "wcache.server.cli",
    "wcache.server.startup",
    "wcache.server.daemon",
    "wcache.server.store",
    "wcache.server.loader",
    "wcache.server.metrics",
)
LIBS = ("prometheus_client", "tqdm", "rich.progress")

_IMPORT_PROBE = """
import sys, time
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
{preload}
n0, r0 = len(sys.modules), rss()
t0 = time.perf_counter()
{stmt}
t1 = time.perf_counter()
print(t1 - t0, rss() - r0, len(sys.modules) - n0, "torch" in sys.modules)
"""


def _stats(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def measure_imports(samples: int) -> dict[str, Any]:
    preload = "\n".join(f"import {m}" for m in START_MODULES)
    variants = {"daemon_start_modules": ("", preload)} | {lib: (preload, f"import {lib}") for lib in LIBS}
    raw: dict[str, dict[str, list[float]]] = {v: {"seconds": [], "rss_bytes": [], "modules": []} for v in variants}
    torch: dict[str, bool] = {}
    for _ in range(samples):
        for name, (pre, stmt) in variants.items():
            out = subprocess.run(
                [sys.executable, "-c", _IMPORT_PROBE.format(preload=pre, stmt=stmt)],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            ).stdout.split()
            raw[name]["seconds"].append(float(out[0]))
            raw[name]["rss_bytes"].append(float(out[1]))
            raw[name]["modules"].append(float(out[2]))
            torch[name] = out[3] == "True"
    res: dict[str, Any] = {}
    for name, r in raw.items():
        res[name] = {
            "seconds": _stats(r["seconds"]),
            "rss_bytes_median": statistics.median(r["rss_bytes"]),
            "new_modules": int(statistics.median(r["modules"])),
            "imports_torch": torch[name],
        }
    return res


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return -1


def measure_restart(samples: int) -> dict[str, Any]:
    from wcache.server.process import spawn_daemon, spawn_keeper
    from wcache.synthetic import TINY, make_llama_checkpoint

    work = Path(tempfile.mkdtemp(prefix="wcache-libs-"))
    model = make_llama_checkpoint(work / "tiny", TINY, shards=2, seed=1)
    sock = work / "sock"
    sock.mkdir(mode=0o700)
    envs: dict[str, dict[str, str]] = {"none": {**os.environ, "PYTHONPATH": str(REPO)}}
    for lib in LIBS:
        shim = work / f"shim-{lib}"
        shim.mkdir()
        (shim / "sitecustomize.py").write_text(f"import {lib}\n")
        envs[lib] = {**os.environ, "PYTHONPATH": f"{shim}{os.pathsep}{REPO}"}
    ready: dict[str, list[float]] = {v: [] for v in envs}
    ready_file: dict[str, list[float]] = {v: [] for v in envs}
    rss: dict[str, list[float]] = {v: [] for v in envs}
    read_disk: dict[str, list[bool]] = {v: [] for v in envs}
    dev = ("--device", "cpu", "--keeper")
    k = spawn_keeper(sock, log=work / "k.log")
    d = None
    try:
        d = spawn_daemon(model, sock, *dev, log=work / "d.log", timeout=600)
        i = 0
        for _ in range(samples):
            for name, env in envs.items():
                d.stop(signal.SIGKILL)
                i += 1
                t0 = time.time_ns()
                d = spawn_daemon(model, sock, *dev, log=work / f"d{i}.log", env=env, timeout=600)
                ready[name].append(d.ready_seconds)
                ready_file[name].append((d.ready_file.stat().st_mtime_ns - t0) / 1e9)
                rss[name].append(float(_rss(d.pid)))
                read_disk[name].append("loaded bytes_read" in d.log_text())
    finally:
        if d is not None:
            d.stop()
        k.stop()
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(ready["none"])
    base_file = statistics.median(ready_file["none"])
    return {
        name: {
            "spawn_to_ready_s": _stats(ready[name]),
            "added_s_median": statistics.median(ready[name]) - base,
            "spawn_to_ready_file_mtime_s": _stats(ready_file[name]),
            "added_file_mtime_s_median": statistics.median(ready_file[name]) - base_file,
            "vmrss_bytes_median": statistics.median(rss[name]),
            "added_vmrss_bytes_median": statistics.median(rss[name]) - statistics.median(rss["none"]),
            "read_disk": any(read_disk[name]),
        }
        for name in envs
    }


_NO_TTY_PROBE = """
import sys, threading, time
TOTAL, THREADS, STEPS = 8 << 30, 8, 200
kind = sys.argv[1]
if kind == "wcache":
    from wcache.server.loader import _Progress
    bar = _Progress(TOTAL, sys.stderr if sys.stderr.isatty() else None)  # what load_into(progress=None) builds
    add, close = bar.add, bar.close
elif kind.startswith("tqdm"):
    from tqdm import tqdm
    bar = tqdm(total=TOTAL, unit="B", unit_scale=True, desc="loading", **({"disable": None} if kind == "tqdm_disable_none" else {}))
    add, close = bar.update, bar.close
else:
    from rich.console import Console
    from rich.progress import Progress
    p = Progress(console=Console(stderr=True))  # a daemon's stdout is not for progress
    p.start()
    task = p.add_task("loading", total=TOTAL)
    add, close = (lambda n: p.advance(task, n)), p.stop
def reader():
    for _ in range(STEPS):
        add(TOTAL // (THREADS * STEPS))
        time.sleep(0.01)
ts = [threading.Thread(target=reader) for _ in range(THREADS)]
[t.start() for t in ts]
[t.join() for t in ts]
close()
"""


def measure_no_tty() -> dict[str, Any]:
    res: dict[str, Any] = {}
    for kind in ("wcache", "tqdm", "tqdm_disable_none", "rich"):
        err = subprocess.run(
            [sys.executable, "-c", _NO_TTY_PROBE, kind],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=True,
            env={**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm-256color"},
        ).stderr
        res[kind] = {
            "bytes": len(err),
            "lines": err.count(b"\n"),
            "carriage_returns": err.count(b"\r"),
            "ansi_escapes": err.count(b"\x1b"),
            "tail": err[-200:].decode(errors="replace"),
        }
    return res


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--out", type=argparse.FileType("w"), default=sys.stdout, help="the JSON (default: stdout)")
    args = ap.parse_args()
    compileall.compile_dir(str(REPO / "wcache"), quiet=1)
    for lib in ("prometheus_client", "tqdm", "rich"):
        spec = importlib.util.find_spec(lib)
        assert spec is not None and spec.origin is not None, f"{lib} is not installed"
        compileall.compile_dir(str(Path(spec.origin).parent), quiet=1)
    res: dict[str, Any] = {
        "benchmark": "libs_bench",
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core {platform.machine()}, Python {platform.python_version()}",
        "versions": {d: _version(d) for d in ("prometheus_client", "tqdm", "rich")},
        "start_modules": list(START_MODULES),
        "loadavg_before": _loadavg(),
    }
    res["import"] = measure_imports(args.samples)
    res["restart"] = measure_restart(args.samples)
    res["no_tty"] = measure_no_tty()
    res["loadavg_after"] = _loadavg()
    json.dump(res, args.out, indent=2)
    args.out.write("\n")


if __name__ == "__main__":
    main()
