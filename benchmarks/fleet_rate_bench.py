"""The fleet fill's rate cap at a finer grain than a batch (docs/fleet.md, "Bandwidth policy"): how close a capped
fill comes to the cap (``beyond_cap_s``: its seconds beyond the bytes over the rate: connecting, allocating
and populating the slab, the grants' turnarounds), and the most it READs in any window of 10, 50 and 100 ms against the cap times the
window — with the grants as they are now (a hundredth of a second of the rate each, an idle cap lending 10 ms)
and as they were (one grant per 64 MiB batch, each asked for once the one before was used, no lending),
alternated in one run; and an uncapped fill's throughput both ways (its grants are 64 MiB batches in both,
asked for two ahead now).

One process, host backend: a source ``PeerService`` on the peer shell holding one slab (a deposit's recipe key:
a same-layout fill, no checkpoint), the target's ``fill`` over loopback with an agent that notes when each READ
is posted (``Agent.on_post``).

    python benchmarks/fleet_rate_bench.py --mib 128 --rate 40M --out benchmarks/results/fleet_rate-cpu-2026-12-02.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from wcache.plan.key import WeightCacheKey
from wcache.plan.recipe import RecipeKey
from wcache.proto import TensorEntry, TensorTable
from wcache.server import fill as fill_module
from wcache.server.backends.host import HostBackend
from wcache.server.fill import FillConfig, fill, grant_bytes
from wcache.server.loader import LoadStats
from wcache.server.nixl import Agent
from wcache.server.peer import PeerListener, PeerService, RateCap
from wcache.server.peer_auth import PeerSecurity
from wcache.server.store import ServedModel, Store
from wcache.units import parse_size

WINDOWS = (0.01, 0.05, 0.1)


def worst(posts: list[tuple[float, int]], window: float) -> int:
    """The most bytes posted within any ``window`` seconds."""
    return max(sum(n for t, n in posts if t0 <= t < t0 + window) for t0, _ in posts)


def _model(backend: HostBackend, size: int) -> ServedModel:
    slab = backend.allocate(size)
    slab.tensor().fill_(0x5A)  # any bytes (nothing verifies a same-layout fill's), but every page touched
    slab.seal()
    key = RecipeKey.of(WeightCacheKey("f" * 32, "Bench", 1, 0, "bfloat16"), engine="bench")
    table = TensorTable.from_entries([TensorEntry("w", "uint8", (size,), (1,), 0, 0)])
    return ServedModel(key, table, {}, [slab], backend, size, LoadStats(size, size, 0.0), origin="deposit")


async def _one(svc: PeerService, port: int, model: ServedModel, rate: int, policy: str) -> dict[str, Any]:
    svc.cap = RateCap(rate, burst=0.0) if policy == "before" else RateCap(rate)
    before = fill_module.grant_bytes, fill_module.AHEAD
    if policy == "before":  # one grant per 64 MiB batch, each asked for once the one before was used
        fill_module.grant_bytes = lambda max_rate, chunk: chunk
        fill_module.AHEAD = 1
    agent = Agent(f"bench-rate-{os.getpid()}-{time.monotonic_ns()}")
    posts: list[tuple[float, int]] = []
    agent.on_post = lambda n: posts.append((time.monotonic(), n))
    sec = PeerSecurity.configure(cert=None, key=None, ca=None, secret_file=None)
    try:
        t0 = time.perf_counter()
        got = await fill(model.key, None, HostBackend(), agent, FillConfig((("127.0.0.1", port),), sec, "b"))
        seconds = time.perf_counter() - t0
        got.close()
    finally:
        fill_module.grant_bytes, fill_module.AHEAD = before
        agent.close()
    out: dict[str, Any] = {"seconds": seconds, "gb_s": model.slab_bytes / seconds / 1e9, "posts": len(posts)}
    if rate:
        out["beyond_cap_s"] = seconds - model.slab_bytes / rate  # what the fill took beyond the cap's own time
        for w in WINDOWS:
            out[f"worst_{int(w * 1000)}ms_over_cap"] = worst(posts, w) / (rate * w)
    return out


async def run(size: int, rate: int, reps: int) -> dict[str, Any]:
    backend = HostBackend()
    model = _model(backend, size)
    sec = PeerSecurity.configure(cert=None, key=None, ca=None, secret_file=None)
    svc = PeerService(Store(backend, [model]), sec, software="bench", max_rate=rate)
    listener = PeerListener(svc, "127.0.0.1", 0)
    _, port = listener.start()
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "now": [], "uncapped_before": [], "uncapped_now": []}
    try:
        for _ in range(reps):  # alternated: a shared machine's load drifts
            for policy in ("before", "now"):
                runs[policy].append(await _one(svc, port, model, rate, policy))
                runs[f"uncapped_{policy}"].append(await _one(svc, port, model, 0, policy))
    finally:
        await listener.stop()
        svc.store.close()

    def median(policy: str) -> dict[str, float]:
        keys = runs[policy][0].keys()
        return {k: statistics.median(r[k] for r in runs[policy]) for k in keys}

    return {
        "bytes": size,
        "rate": rate,
        "grant_bytes": {"before": 64 << 20, "now": grant_bytes(rate, 64 << 20)},
        "capped_before": median("before"),
        "capped_now": median("now"),
        "uncapped_before": median("uncapped_before"),
        "uncapped_now": median("uncapped_now"),
        "runs": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128, help="slab size")
    ap.add_argument("--rate", default="40M", help="the source's --peer-max-rate (bytes/s, K/M/G), below the uncapped")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    load = os.getloadavg()
    result = asyncio.run(run(args.mib << 20, parse_size(args.rate), args.reps))
    result.update(machine=platform.node(), cpus=os.cpu_count(), loadavg_before=load, loadavg_after=os.getloadavg())
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
