"""Reliability figures (docs/reliability.md): fuzz, hostile frames, killed clients and daemons, load.

Runs on the host backend (any machine); writes JSON to benchmarks/results/ and prints the
table kept in docs/reliability.md. Long: not part of the default CI run.

    python benchmarks/reliability.py [--fuzz-runs 1000000] [--hostile 100000] [--kills 100]
                                     [--load-clients 256] [--load-seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import glob
import json
import os
import random
import re
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from wcache import CacheUnavailableError, WCacheClient, WCacheError, WeightCacheKey
from wcache.channel import connect
from wcache.proto import PROTOCOL_VERSION, GetState, Hello, Release, Status, pack_frame
from wcache.server.process import DaemonProcess, spawn_daemon
from wcache.synthetic import TINY, make_llama_checkpoint

REPO = Path(__file__).resolve().parents[1]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


DEVICE = "cpu"


def gpu_used_mib() -> int | None:
    """Device memory in use, MiB: the sum over compute processes (``memory.used`` reads 0 in some VMs)."""
    apps = gpu_apps_mib()
    return None if apps is None else sum(apps.values())


def gpu_apps_mib() -> dict[int, int] | None:
    """pid -> MiB of every process holding memory on DEVICE."""
    if DEVICE == "cpu":
        return None
    from gpu_bench import gpu_apps_mib as apps

    return apps(int(DEVICE.split(":")[1]))


def start_daemon(model: Path, sock_dir: Path, *extra: str) -> DaemonProcess:
    return spawn_daemon(model, sock_dir, "--log-level", "WARNING", "--device", DEVICE, *extra)


async def leases(sock: Path) -> int:
    return (await WCacheClient(sock).status()).models[0].leases


# ------------------------------------------------------------------------------------------ fuzz


def fuzz(runs: int, procs: int = os.cpu_count() or 1) -> dict[str, Any]:
    """``runs`` inputs through the atheris harness, split over ``procs`` fuzzer processes."""
    t0 = time.perf_counter()
    each = -(-runs // procs)
    ps = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "fuzz" / "fuzz_decoder.py"),
                f"-runs={each}",
                "-max_len=4096",
                f"-seed={i + 1}",
                f"-artifact_prefix={tempfile.gettempdir()}/",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(procs)
    ]
    done, failures, tails = 0, 0, []
    for p in ps:
        _, err = p.communicate()
        m = re.search(r"Done (\d+) runs in (\d+) second", err)
        done += int(m.group(1)) if m else 0
        failures += p.returncode != 0
        tails.append(err.strip().splitlines()[-1][:200] if err.strip() else "")
    return {
        "inputs": done,
        "processes": procs,
        "seconds": time.perf_counter() - t0,
        "failures": failures,
        "tails": tails,
    }


# ------------------------------------------------------------------------------------------ hostile

FATAL_KINDS = [
    "random",
    "huge_length",
    "truncated",
    "wrong_types",
    "unknown_type",
    "version_skew",
    "before_hello",
    "ext_type",
    "garbage_after_hello",
]
NONFATAL_KINDS = ["release_unknown", "release_others", "wrong_key", "get_state_flood", "status"]


def hostile_bytes(kind: str, rnd: random.Random) -> bytes:
    if kind == "random":
        return bytes([0x7F]) + rnd.randbytes(rnd.randint(3, 200))
    if kind == "huge_length":
        return struct.pack(">I", rnd.randint(64 * 2**20 + 1, 2**32 - 1)) + rnd.randbytes(8)
    if kind == "truncated":
        f = pack_frame(Hello(versions=(PROTOCOL_VERSION,)).to_wire())
        return f[: rnd.randint(1, len(f) - 1)]
    if kind == "wrong_types":
        return pack_frame({"type": "HELLO", "versions": rnd.choice(["1", -1, [0], None, 3.5, {"a": 1}])})
    if kind == "unknown_type":
        return pack_frame({"type": rnd.choice(["REBOOT", "SHUTDOWN", "EVICT_ALL", ""]), "id": 1})
    if kind == "version_skew":
        return pack_frame(Hello(versions=(rnd.randint(3, 1000),)).to_wire())
    if kind == "before_hello":
        return pack_frame(GetState(id=1, key={}).to_wire())
    if kind == "ext_type":
        return struct.pack(">I", 4) + b"\x81\xa1x\xd4"  # a map whose value is an ext type
    hello = pack_frame(Hello(versions=(PROTOCOL_VERSION,)).to_wire())
    return hello + struct.pack(">I", 16) + rnd.randbytes(16)


async def one_fatal(sock: Path, data: bytes) -> str:
    r, w = await asyncio.open_unix_connection(str(sock))
    try:
        w.write(data)
        await w.drain()
        w.write_eof()
        got = await asyncio.wait_for(r.read(), 15)  # the daemon answers (ERROR) and closes
        return "error" if b"ERROR" in got else "closed"
    finally:
        w.close()


async def hostile(sock: Path, key: WeightCacheKey, total: int, workers: int = 16) -> dict[str, Any]:
    counts: dict[str, int] = dict.fromkeys(FATAL_KINDS + NONFATAL_KINDS, 0)
    outcomes: dict[str, int] = {"error": 0, "closed": 0, "hang": 0, "refused": 0}
    sent = 0
    holder = await WCacheClient(sock).fetch(key)  # a lease of another connection, to try to release
    lock = asyncio.Lock()

    async def take(n: int) -> int:
        nonlocal sent
        async with lock:
            n = min(n, total - sent)
            sent += n
            return n

    async def fatal_worker(seed: int) -> None:
        rnd = random.Random(seed)
        while await take(1):
            kind = rnd.choice(FATAL_KINDS)
            counts[kind] += 1
            try:
                outcomes[await one_fatal(sock, hostile_bytes(kind, rnd))] += 1
            except TimeoutError:
                outcomes["hang"] += 1
            except OSError:
                outcomes["refused"] += 1

    async def nonfatal_worker(seed: int) -> None:
        rnd = random.Random(seed)
        ch, _ = await connect(sock, software="reliability", name=f"nonfatal-{seed}")
        held: list[int] = []
        try:
            while n := await take(64):
                for _ in range(n):
                    kind = rnd.choice(NONFATAL_KINDS)
                    counts[kind] += 1
                    rid = ch.conn.next_request_id()
                    if kind in ("release_unknown", "release_others"):
                        lease = rnd.randint(1, 2**40) if kind == "release_unknown" else holder.lease
                        ch.conn.leases.add(lease)
                        frame: Any = Release(id=rid, lease=lease)
                    elif kind == "wrong_key":
                        frame = GetState(id=rid, key={**key.to_wire(), "dtype": "float16"})
                    elif kind == "get_state_flood":
                        frame = GetState(id=rid, key=key.to_wire())
                    else:
                        frame = Status(id=rid)
                    await ch.send(frame)
                    got, fds = await asyncio.wait_for(ch.receive(), 15)
                    for fd in fds:
                        os.close(fd)
                    if got.TYPE == "STATE":
                        held.append(got.lease)
                        if len(held) > 32:  # keep the flood near the 64-lease limit, both sides of it
                            ch.conn.leases.add(held[0])
                            await ch.send(Release(id=ch.conn.next_request_id(), lease=held.pop(0)))
                            await asyncio.wait_for(ch.receive(), 15)
                    outcomes["error"] += got.TYPE == "ERROR"
        finally:
            ch.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(fatal_worker(i) for i in range(workers)), *(nonfatal_worker(100 + i) for i in range(4)))
    seconds = time.perf_counter() - t0
    await holder.release()
    return {"frames": sent, "seconds": seconds, "by_kind": counts, "outcomes": outcomes}


# ------------------------------------------------------------------------------------------ kills

KILLED_CLIENT = r"""
import asyncio, sys
from wcache import WCacheClient, WeightCacheKey
async def main():
    c = WCacheClient(sys.argv[1]); k = WeightCacheKey.from_checkpoint(sys.argv[2])
    print("up", flush=True)
    while True:
        w = await c.fetch(k)
        await asyncio.sleep(0)
        await w.release()
asyncio.run(main())
"""


async def kill_clients(sock: Path, model: Path, n: int, batch: int = 10, daemon_pid: int = 0) -> dict[str, Any]:
    """Start ``n`` clients ``batch`` at a time, each in a fetch/release loop, and SIGKILL them mid-loop.

    On a GPU, per-process device memory comes from ``nvidia-smi --query-compute-apps``: the
    daemon's own figure must not change, and no killed client may still hold memory.
    """
    rnd = random.Random(0)
    killed = 0
    t0 = time.perf_counter()
    apps_before = gpu_apps_mib()
    gpu_before = None if apps_before is None else sum(apps_before.values())
    peak_procs = 0
    for start in range(0, n, batch):
        procs = [
            subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, str(sock), str(model)], stdout=subprocess.PIPE)
            for _ in range(min(batch, n - start))
        ]
        for p in procs:
            assert p.stdout is not None
            await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), 120)
        await asyncio.sleep(0.2)
        apps = gpu_apps_mib()
        peak_procs = max(peak_procs, len(apps) if apps else 0)
        for p in procs:
            await asyncio.sleep(rnd.random() * 0.01)  # at a random point of a fetch/release loop
            p.kill()
        for p in procs:
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
            killed += 1
    deadline = time.monotonic() + 10
    while (left := await leases(sock)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for _ in range(20):  # let the driver reclaim the killed processes' contexts (up to 10 s)
        await asyncio.sleep(0.5)
        apps = gpu_apps_mib()
        if apps is None or set(apps) <= {daemon_pid}:
            break
    apps_after = gpu_apps_mib()
    return {
        "clients_killed": killed,
        "leases_after": left,
        "seconds": time.perf_counter() - t0,
        "device": DEVICE,
        "gpu_used_mib_before": gpu_before,
        "gpu_used_mib_after": None if apps_after is None else sum(apps_after.values()),
        "daemon_gpu_mib_before": None if apps_before is None else apps_before.get(daemon_pid),
        "daemon_gpu_mib_after": None if apps_after is None else apps_after.get(daemon_pid),
        "peak_gpu_processes": peak_procs,
        "gpu_processes_after": None if apps_after is None else sorted(apps_after),
    }


async def kill_daemon(model: Path, sock_dir: Path, key: WeightCacheKey, clients: int = 20) -> dict[str, Any]:
    from wcache.nn import load_from_disk, load_weights

    d = start_daemon(model, sock_dir)
    os.kill(d.proc.pid, signal.SIGSTOP)  # requests will be in flight when it dies
    tasks = [asyncio.ensure_future(WCacheClient(d.socket, timeout=30).fetch(key)) for _ in range(clients)]
    await asyncio.sleep(0.5)
    t_kill = time.perf_counter()
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait()
    times, kinds = [], []
    for t in tasks:
        try:
            await t
            kinds.append("served")
        except CacheUnavailableError:
            kinds.append("CacheUnavailableError")
        except WCacheError as exc:
            kinds.append(type(exc).__name__)
        times.append(time.perf_counter() - t_kill)
    t0 = time.perf_counter()
    lw = await load_weights(model, client=WCacheClient(d.socket))
    fallback_s = time.perf_counter() - t0
    ref = load_from_disk(model)
    import torch

    same = lw.source == "disk" and all(torch.equal(lw.tensors[k], v) for k, v in ref.items())
    stale = d.socket.exists()
    d2 = start_daemon(model, sock_dir)  # stale socket and lock left by SIGKILL: the next daemon recovers
    second = subprocess.run(
        [sys.executable, "-m", "wcache.server.cli", "--model", str(model), "--socket-dir", str(sock_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    d2.stop()
    return {
        "clients": clients,
        "outcomes": {k: kinds.count(k) for k in set(kinds)},
        "max_seconds_to_error": max(times),
        "fallback_source": lw.source,
        "fallback_seconds": fallback_s,
        "fallback_identical": same,
        "stale_socket_left": stale,
        "next_daemon_recovered": True,
        "second_daemon_exit_code": second.returncode,
        "second_daemon_message": second.stderr.strip().splitlines()[-1][:160] if second.stderr else "",
    }


# ------------------------------------------------------------------------------------------ load

LOAD_WORKER = r"""
import asyncio, json, sys, time
from wcache import WCacheClient, WeightCacheKey
sock, model, clients, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
key = WeightCacheKey.from_checkpoint(model)
async def one(lat, errors):
    c = WCacheClient(sock, timeout=30)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        try:
            w = await c.fetch(key)
            lat.append(time.perf_counter() - t0)
            await w.release()
        except Exception as exc:
            errors.append(type(exc).__name__)
async def main():
    lat, errors = [], []
    await asyncio.gather(*(one(lat, errors) for _ in range(clients)))
    print(json.dumps({"lat": lat, "errors": errors}))
asyncio.run(main())
"""


async def load(sock: Path, model: Path, clients: int, seconds: float, procs: int = 4) -> dict[str, Any]:
    per = clients // procs
    slow_r, slow_w = await asyncio.open_unix_connection(str(sock))
    slow_w.write(pack_frame(Hello(versions=(PROTOCOL_VERSION,)).to_wire()))
    half = pack_frame({"type": "STATUS", "id": 1})
    slow_w.write(half[: len(half) // 2])  # a slow client holding a half-sent frame during the load
    await slow_w.drain()
    t_slow = time.monotonic()

    async def slow_closed() -> float:
        await slow_r.read()  # returns at EOF: when the daemon closes the stalled connection
        return time.monotonic() - t_slow

    slow_task = asyncio.ensure_future(slow_closed())
    ps = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            LOAD_WORKER,
            str(sock),
            str(model),
            str(per),
            str(seconds),
            stdout=asyncio.subprocess.PIPE,
        )
        for _ in range(procs)
    ]
    outs = await asyncio.gather(*(p.communicate() for p in ps))
    slow_closed_after = await asyncio.wait_for(slow_task, 30) if not slow_task.cancelled() else None
    slow_w.close()
    lat: list[float] = []
    errors: list[str] = []
    for out, _ in outs:
        r = json.loads(out.decode().strip().splitlines()[-1])
        lat += r["lat"]
        errors += r["errors"]
    lat.sort()
    return {
        "clients": per * procs,
        "seconds": seconds,
        "fetches": len(lat),
        "errors": len(errors),
        "error_kinds": sorted(set(errors)),
        "fetch_ms_p50": statistics.median(lat) * 1e3 if lat else None,
        "fetch_ms_p99": lat[int(0.99 * (len(lat) - 1))] * 1e3 if lat else None,
        "slow_half_frame_client_closed_after_s": slow_closed_after,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="wcache-rel-"))
    os.chmod(work, 0o700)
    model = make_llama_checkpoint(work / "model", TINY, shards=2, seed=0)
    key = WeightCacheKey.from_checkpoint(model)
    sock_dir = work / "sock"
    sock_dir.mkdir(mode=0o700)
    res: dict[str, Any] = {
        "benchmark": "reliability",
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
    }
    if args.only == "kills":
        d = start_daemon(model, sock_dir)
        try:
            async with await WCacheClient(d.socket).fetch(key):
                pass
            res["killed_clients"] = await kill_clients(d.socket, model, args.kills, daemon_pid=d.proc.pid)
            res["daemon_gpu_mib"] = gpu_used_mib()
        finally:
            d.stop()
        res["killed_daemon"] = await kill_daemon(model, sock_dir, key)
        return res
    if args.fuzz_runs:
        print("== fuzz", flush=True)
        res["fuzz_decoder"] = fuzz(args.fuzz_runs)
        print(res["fuzz_decoder"], flush=True)
    d = start_daemon(model, sock_dir, "--frame-timeout", "5")
    try:
        pid = d.proc.pid
        async with await WCacheClient(d.socket).fetch(key):
            pass
        base = {"rss_kib": rss_kib(pid), "fds": fd_count(pid)}
        print("== hostile", flush=True)
        res["hostile_frames"] = await hostile(d.socket, key, args.hostile)
        print("== kill clients", flush=True)
        res["killed_clients"] = await kill_clients(d.socket, model, args.kills, daemon_pid=d.proc.pid)
        print("== load", flush=True)
        res["load"] = await load(d.socket, model, args.load_clients, args.load_seconds)
        await asyncio.sleep(0.5)
        after = {"rss_kib": rss_kib(pid), "fds": fd_count(pid)}
        import torch
        from safetensors.torch import load_file

        ref: dict[str, Any] = {}
        for f in sorted(glob.glob(str(model / "*.safetensors"))):
            ref.update(load_file(f))
        async with await WCacheClient(d.socket).fetch(key) as w:
            valid = all(torch.equal(w[k], v) for k, v in ref.items())
        res["daemon_after_all"] = {
            "alive": d.proc.poll() is None,
            "valid_get_state_identical": valid,
            "leases": await leases(d.socket),
            "rss_kib_before": base["rss_kib"],
            "rss_kib_after": after["rss_kib"],
            "fds_before": base["fds"],
            "fds_after": after["fds"],
        }
    finally:
        d.stop()
    print("== kill daemon", flush=True)
    res["killed_daemon"] = await kill_daemon(model, sock_dir, key)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fuzz-runs", type=int, default=1_000_000)
    ap.add_argument("--hostile", type=int, default=100_000)
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--load-clients", type=int, default=256)
    ap.add_argument("--load-seconds", type=float, default=60.0)
    ap.add_argument("--device", default="cpu", help="daemon device: cpu or cuda:K (GPU rows)")
    ap.add_argument("--only", choices=["all", "kills"], default="all")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    res = asyncio.run(main_async(args))
    tag = "" if DEVICE == "cpu" else "-" + DEVICE.replace(":", "")
    out = args.out or REPO / "benchmarks" / "results" / f"reliability{tag}-{res['date']}.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
