"""Fleet fill over NIXL (docs/fleet.md): raw NIXL READ throughput between two processes, and how to read
dim-1 (strided) shards.

A source process allocates a slab with the daemon's backend (host memfd or CUDA VMM), fills it, seals it,
registers it with NIXL once and hands its agent metadata and region to this process, which reads it into a
fresh slab of the same backend (allocated, registered, read, deregistered, closed for every repetition: what
a fill does). Reported: ``register_s`` (the source's one registration, and the target's per fill),
``raw_gb_s`` (bytes over the whole of it: allocation, registration, READ, deregistration; the best
configuration), ``read_only_gb_s`` (the READ alone), and for a dim-1 shard (every row's half: the TP=1 -> TP=2 case of o_proj/down_proj)
three ways to read it: one descriptor per row, NIXL's strided descriptors, and the whole rows read into a
staging buffer and sliced locally.

    python benchmarks/fleet_fill_bench.py --device cpu --gib 1 --out benchmarks/results/fleet_fill-cpu-2026-12-01.json
    python benchmarks/fleet_fill_bench.py --device cuda:0 --gib 16 --chunk 64M --reps 1 --out $OUT/fleet_fill-cuda.json

The fill itself (two daemons, ``fill_over_nixl_raw``) is measured by the same script once the peer service
exists (docs/fleet.md, "What is measured").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from wcache.plan.reshard import Copy
from wcache.server.backends.base import Backend, MemoryRegion, Slab
from wcache.server.nixl import Agent, nixl_module
from wcache.server.startup import make_backend

ROW = 4096 * 2  # bytes of one bf16 row of a 4096-wide matrix (o_proj)
_T0 = time.monotonic()


def _say(what: str) -> None:
    """One progress line on stderr (the JSON goes to stdout at the end): where a slow or stuck run is."""
    print(f"[fleet_fill_bench +{time.monotonic() - _T0:.1f}s] {what}", file=sys.stderr, flush=True)


def _fill_pattern(slab: Slab, backend: Backend) -> None:
    """A byte pattern that differs by offset (so a misplaced range shows), written through the slab's tensor."""
    import torch

    t = slab.tensor()
    step = 1 << 26
    base = torch.arange(step, dtype=torch.int64, device=t.device)
    for off in range(0, slab.size, step):
        n = min(step, slab.size - off)
        t[off : off + n].copy_(((base[:n] + off) * 2654435761 >> 13).to(torch.uint8))
    slab.synchronize()


def _expected(offset: int, n: int) -> bytes:
    import numpy as np

    i = np.arange(offset, offset + n, dtype=np.int64)
    return ((i * 2654435761) >> 13).astype(np.uint8).tobytes()


def serve(device: str, size: int) -> None:
    """The source: one slab, registered once; prints {metadata, region, register_s}; exits on stdin EOF."""
    backend = make_backend(device)
    backend.check_platform()
    slab = backend.allocate(size)
    _fill_pattern(slab, backend)
    slab.seal()
    _say(f"source: {size} bytes written and sealed on {device}")
    agent = Agent(f"bench-src-{os.getpid()}")
    reg = agent.register(slab.region())
    md = agent.metadata([reg])
    r = reg.region
    print(json.dumps({"metadata": md.hex(), "region": list(r), "register_s": reg.seconds}), flush=True)
    sys.stdin.read()
    agent.deregister(reg)
    agent.close()
    slab.close()


class Target:
    def __init__(self, device: str, peer: dict[str, Any]) -> None:
        self.backend = make_backend(device)
        self.backend.check_platform()
        self.agent = Agent(f"bench-dst-{os.getpid()}")
        self.peer = self.agent.add_peer(bytes.fromhex(peer["metadata"]))
        self.remote = MemoryRegion(*peer["region"])

    def fresh(self, size: int) -> tuple[Slab, Any]:
        slab = self.backend.allocate(size)
        return slab, self.agent.register(slab.region())

    def read(self, copies: list[Copy], local: MemoryRegion, *, strided: bool = False) -> float:
        t0 = time.perf_counter()
        deadline = time.monotonic() + 600
        self.agent.start_read(self.peer, copies, local, self.remote, deadline=deadline, strided=strided).wait()
        return time.perf_counter() - t0


def contiguous(t: Target, size: int, chunk: int, reps: int, prefault: bool) -> dict[str, Any]:
    """The whole slab in ``chunk``-byte descriptors, into a fresh slab each time (allocation and first touch
    included, as in a fill). ``prefault``: allocate the host slab's pages first (MADV_POPULATE_WRITE), so
    the READ does not take a page fault per 4 KiB in the middle of the transport's copy."""
    from wcache.server.reads import populate

    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        slab, reg = t.fresh(size)
        try:
            local = reg.region
            if prefault and local.kind == "host":
                populate(local.address, 0, size, "bench")
            blocks = [Copy(0, o, o, min(chunk, size - o)) for o in range(0, size, chunk)]
            secs = t.read(blocks, local)
            _say(f"contiguous READ chunk={chunk} prefault={prefault}: {size / secs / 1e9:.2f} GB/s")
            t.agent.deregister(reg)
            total = time.perf_counter() - t0
            ok = all(slab.read(o, 4096) == _expected(o, 4096) for o in (0, size // 2, size - 4096))
        finally:
            slab.close()
        runs.append({"read_s": secs, "gb_s": size / secs / 1e9, "with_alloc_s": total, "register_s": reg.seconds})
        if not ok:
            raise SystemExit("raw READ: bytes differ from the source's")
    best = min(runs, key=lambda r: r["read_s"])
    return {"bytes": size, "chunk": chunk, "prefault": prefault, "descriptors": -(-size // chunk), "runs": runs, **best}


def strided(t: Target, rows: int, reps: int) -> dict[str, Any]:
    """A [rows, 4096] bf16 matrix's right half (dim-1 shard of TP=2): per-row descriptors, NIXL strided
    descriptors, or the whole rows into staging and a local slice. The three alternate within each repetition
    (a shared machine's load drifts), and the median decides."""
    import statistics

    half = ROW // 2
    ways = ("per_row", "nixl_strided", "superset_slice")
    times: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(reps):
        for how in ways:
            size = rows * half if how != "superset_slice" else rows * ROW
            slab, reg = t.fresh(max(size, 4096))
            try:
                local = reg.region
                t0 = time.perf_counter()
                if how == "superset_slice":
                    t.read([Copy(0, 0, 0, rows * ROW)], local)
                    _slice_locally(slab, rows)
                else:
                    blk = Copy(0, half, 0, half, rows, ROW, half)
                    t.read([blk], local, strided=how == "nixl_strided")
                times[how].append(time.perf_counter() - t0)
                t.agent.deregister(reg)
                for r in (0, 1, rows // 2, rows - 1):
                    if slab.read(r * half, half) != _expected(r * ROW + half, half):
                        raise SystemExit(f"{how}: row {r} differs from the source's")
            finally:
                slab.close()
    out: dict[str, Any] = {"rows": rows, "run_bytes": half, "useful_bytes": rows * half, "reps": reps}
    for how in ways:
        med = statistics.median(times[how])
        out[how] = {"median_s": med, "useful_gb_s": rows * half / med / 1e9, "runs": times[how]}
    out["pick"] = min(ways, key=lambda k: out[k]["median_s"])
    _say(f"strided: {out['pick']} fastest")
    return out


def _slice_locally(slab: Slab, rows: int) -> None:
    """Keep every row's right half at the front of the slab (what a fill would copy into the target slab)."""
    t = slab.tensor()
    m = t[: rows * ROW].view(rows, ROW)
    t[: rows * ROW // 2].view(rows, ROW // 2).copy_(m[:, ROW // 2 :].clone())
    slab.synchronize()


# --------------------------------------------------------------------------- the fill (two and more daemons)


def _fill_part(device: str, model: Path, work: Path, reps: int, targets: list[int]) -> dict[str, Any]:
    """A source daemon (``--peer-listen``) holding ``model``; in the same run: raw NIXL READs of its offered slab
    into fresh slabs with this process's agent (what ``fill`` uses), ``fill`` itself (connect, query, plan,
    allocate, register, grants, READ, verify, seal, release) of the same bytes, alternating, and 1/2/4 target
    daemons filling from the one source at once. ``fill_over_nixl_raw``: the fills' median throughput over the raw
    READs' (``_best``: best over best)."""
    import asyncio
    import statistics

    from wcache.channel import expect
    from wcache.plan.key import RankSpec
    from wcache.plan.rank import plan_rank
    from wcache.proto import Release
    from wcache.proto.fleet_frames import PeerOffer, PeerQuery
    from wcache.server.fill import FillConfig, fill
    from wcache.server.peer_auth import PeerSecurity
    from wcache.server.peer_channel import connect_peer
    from wcache.server.process import spawn_daemon

    sec = PeerSecurity.configure(cert=None, key=None, ca=None, secret_file=None)
    sdir = work / "source"
    sdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    source = spawn_daemon(model, sdir, "--device", device, "--peer-listen", "127.0.0.1:0", timeout=600)
    peer = str(json.loads(source.ready_file.read_text())["peer"])
    _say(f"fill: source daemon ready on {peer}")
    host, port = peer.rsplit(":", 1)
    backend = make_backend(device)
    backend.check_platform()
    agent = Agent(f"bench-fill-{os.getpid()}")
    out: dict[str, Any] = {"model": str(model), "source": peer}
    try:
        with plan_rank(RankSpec(model)) as rp:
            size = rp.layout.total_bytes

            async def raw() -> float:
                ch, _ = await connect_peer(host, int(port), sec, timeout=10, software="bench")
                try:
                    await ch.send(PeerQuery(id=1, key=rp.key.to_wire()))
                    offer, _ = await expect(ch)
                    assert isinstance(offer, PeerOffer)
                    m = offer.models[0]
                    name = agent.add_peer(offer.agent)
                    remote = MemoryRegion(m.address, m.size, m.memory, m.device)
                    t0 = time.perf_counter()
                    slab = backend.allocate(m.size)
                    try:
                        reg = agent.register(slab.region())
                        copies = [Copy(0, o, o, min(64 << 20, m.size - o)) for o in range(0, m.size, 64 << 20)]
                        agent.start_read(name, copies, reg.region, remote, deadline=time.monotonic() + 600).wait()
                        agent.deregister(reg)
                        secs = time.perf_counter() - t0
                    finally:
                        slab.close()
                    await ch.send(Release(id=2, lease=m.lease))
                    await expect(ch)
                    return secs
                finally:
                    ch.close()

            async def one_fill() -> float:
                cfg = FillConfig(((host, int(port)),), sec, "bench")
                t0 = time.perf_counter()
                model_ = await fill(rp.key, rp, backend, agent, cfg)
                secs = time.perf_counter() - t0
                model_.close()
                return secs

            raws, fills = [], []
            for _ in range(reps):  # alternating: a shared machine's load drifts
                raws.append(asyncio.run(raw()))
                _say(f"fill: raw READ of the offered slab {raws[-1]:.2f} s")
                fills.append(asyncio.run(one_fill()))
                _say(f"fill: fill of the same bytes {fills[-1]:.2f} s")
        out.update(
            bytes=size,
            raw_s=raws,
            fill_s=fills,
            raw_gb_s=size / statistics.median(raws) / 1e9,
            gb_s=size / statistics.median(fills) / 1e9,
            # medians of the alternated repetitions (a shared machine's load drifts; one lucky run skews a best)
            fill_over_nixl_raw=statistics.median(raws) / statistics.median(fills),
            fill_over_nixl_raw_best=min(raws) / min(fills),
            source_register_s=_source_register_s(source),
        )
        out["scaling"] = [_targets(model, work, device, peer, n) for n in targets]
    finally:
        agent.close()
        source.stop()
    return out


def _source_register_s(source: Any) -> float:
    """The source's NIXL registration of its slab, from its one log line (``registered for peers ...``)."""
    for line in source.log_text().splitlines():
        if "registered for peers" in line and "seconds=" in line:
            return float(line.rsplit("seconds=", 1)[1].split()[0])
    return -1.0


def _targets(model: Path, work: Path, device: str, peer: str, n: int) -> dict[str, Any]:
    """``n`` target daemons filling from the one source at once: each one's fill seconds and the aggregate."""
    import asyncio

    from wcache import WCacheClient
    from wcache.server.process import spawn_daemon

    ds: list[Any] = []
    t0 = time.perf_counter()
    try:
        for i in range(n):
            sock_dir = work / f"target-{n}-{i}"
            sock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            ds.append(spawn_daemon(model, sock_dir, "--device", device, "--fill-from", peer, timeout=None))
        for d in ds:
            d.wait_ready(600)
        wall = time.perf_counter() - t0
        _say(f"fill: {n} target daemon(s) ready in {wall:.1f} s")
        infos = [asyncio.run(WCacheClient(d.socket).status()).models[0] for d in ds]
    finally:
        for d in ds:
            d.stop()
    origins = [m.origin for m in infos]
    secs = [m.load_seconds for m in infos]
    nbytes = infos[0].bytes
    return {
        "targets": n,
        "origins": origins,
        "fill_s": secs,
        "per_target_gb_s": [nbytes / x / 1e9 for x in secs],
        "aggregate_gb_s": n * nbytes / max(secs) / 1e9,
        "wall_s_with_daemon_starts": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu (host memfd slabs) or cuda:K (VMM slabs), both sides")
    ap.add_argument("--gib", type=float, default=1.0, help="slab size for the contiguous READ")
    ap.add_argument("--chunk", type=str, default="64M,1G", help="descriptor sizes to try (K/M/G)")
    ap.add_argument("--rows", type=int, default=16384, help="rows of the strided case (x 8 KiB each)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--fill", type=Path, metavar="CHECKPOINT", help="measure the fill of this checkpoint's rank too")
    ap.add_argument("--work", type=Path, default=Path("/tmp/wcache-fleet-bench"), help="daemons' socket dirs")
    ap.add_argument("--targets", default="1,2,4", help="target daemons filling at once from one source")
    ap.add_argument("--raw", action=argparse.BooleanOptionalAction, default=True, help="the raw part")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = int(args.gib * (1 << 30)) // 4096 * 4096
    if args.serve:
        serve(args.device, size)
        return
    if not args.raw:
        only: dict[str, Any] = {"bench": "fleet_fill", "part": "fill", "device": args.device, "host": platform.node()}
        only["fill"] = _fill_part(
            args.device, args.fill, args.work, args.reps, [int(n) for n in args.targets.split(",")]
        )
        only["load_average"] = os.getloadavg()
        _write(only, args.out)
        return
    nixl = nixl_module()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), *sys.path])}
    src = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--device", args.device, "--gib", str(args.gib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert src.stdout is not None
        peer = json.loads(src.stdout.readline())
        _say("raw: source ready")
        t = Target(args.device, peer)
        from wcache.units import size_arg

        result: dict[str, Any] = {
            "bench": "fleet_fill",
            "part": "raw",
            "device": args.device,
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "nixl": nixl.__name__,
            "ucx_tls": os.environ.get("UCX_TLS", "(UCX default: shared memory between processes of one host)"),
            "source_register_s": peer["register_s"],
            "contiguous": [
                contiguous(t, size, size_arg(c), args.reps, pre)
                for c in args.chunk.split(",")
                for pre in ((False, True) if args.device == "cpu" else (False,))  # GPU pages need no populating
            ],
            "strided": strided(t, min(args.rows, size // ROW), args.reps),
        }
        # what a fill is compared with: a fresh slab allocated, registered, (populated,) READ, deregistered
        best = min(result["contiguous"], key=lambda r: min(x["with_alloc_s"] for x in r["runs"]))
        result["raw_gb_s"] = size / min(x["with_alloc_s"] for x in best["runs"]) / 1e9
        result["raw_config"] = {"chunk": best["chunk"], "prefault": best["prefault"]}
        result["read_only_gb_s"] = max(r["gb_s"] for r in result["contiguous"])
        result["register_s"] = best["register_s"]
        result["load_average"] = os.getloadavg()
        t.agent.close()
    finally:
        if src.stdin is not None:
            src.stdin.close()
        src.wait(timeout=60)
    if args.fill is not None:
        result["fill"] = _fill_part(
            args.device, args.fill, args.work, args.reps, [int(n) for n in args.targets.split(",")]
        )
    _write(result, args.out)


def _write(result: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
