"""``wcache``: operator commands against running daemons.

    wcache status [--socket-path P | --socket-dir D] [--json]
    wcache preload DIR [--tp-rank N --tp-size M --dtype D --transform MOD:FN] [--socket-path P | --socket-dir D]
    wcache evict DIR [same options]

``status`` prints one row per model of each daemon socket found (model, rank, tier, device,
bytes, leases, last use, connections, uptime) and a line of device memory and host-tier use,
or the STATUS_REPLY frames as JSON; exit 0 only if every socket found answered (1: none found, or
one of them is unreachable — a stale socket of a crashed daemon counts; its row says why).
``preload`` asks the daemon of that rank to load and keep a checkpoint (evicting unleased
models, least recently used first, under its --memory-budget); ``evict`` drops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from wcache import __version__
from wcache.client import WCacheClient
from wcache.errors import CheckpointError, WCacheError
from wcache.paths import DEFAULT_SOCKET_DIR_HELP, default_socket_dir
from wcache.proto import StatusReply

__all__ = ["build_parser", "main"]


def _sockets(args: argparse.Namespace) -> list[Path]:
    if args.socket_path:
        return [args.socket_path]
    d = args.socket_dir or default_socket_dir()
    return sorted(Path(d).glob("*.sock"))


async def _status(paths: list[Path], timeout: float) -> list[tuple[Path, StatusReply | str]]:
    async def one(p: Path) -> tuple[Path, StatusReply | str]:
        try:
            return p, await WCacheClient(p, timeout=timeout).status()
        except WCacheError as exc:
            return p, f"{type(exc).__name__}: {exc.message}"

    return list(await asyncio.gather(*(one(p) for p in paths)))


HEADER = [
    "SOCKET",
    "MODEL",
    "RANK",
    "TIER",
    "DEVICE",
    "SLAB",
    "ORIGIN",
    "LOADED",
    "LEASES",
    "LAST USE",
    "CONNS",
    "UPTIME",
]


def _rows(path: Path, r: StatusReply | str, now: float) -> list[list[str]]:
    if isinstance(r, str):
        return [[str(path), *["-"] * (len(HEADER) - 2), r]]
    rows = []
    keeper = r.software.startswith("wcache-keeper/")  # holds daemons' slabs across their restarts
    tier = "keeper" if keeper else "device" if r.backend == "cuda" else "host"
    for m in r.models or (None,):
        key = m.key if m else {}
        rows.append(
            [
                str(path),
                f"{key.get('architecture', '')}@{str(key.get('fingerprint', ''))[:12]}" if m else "(none)",
                f"tp{key.get('tp_rank', '?')}/{key.get('tp_size', '?')} {key.get('dtype', '')}" if m else "-",
                tier if m else "-",
                f"{m.backend} (kept)" if keeper and m else f"{r.backend}:{r.device.uuid or r.device.kind}",
                f"{(m.bytes if m else 0) / 1e9:.2f} GB",
                (m.origin or "-") if m else "-",
                _loaded(m.bytes, m.load_seconds) if m else "-",
                str(m.leases if m else 0),
                f"{now - m.last_use:.0f}s ago" if m and m.last_use else "never",
                str(r.connections),
                f"up {r.uptime_seconds:.0f}s",
            ]
        )
    return rows


def _loaded(nbytes: int, seconds: float) -> str:
    """How long the bytes took to arrive (a load, a tier refill, a fill from peers) and at what rate."""
    if seconds <= 0:
        return "-"
    return f"{seconds:.2f} s ({nbytes / seconds / 1e9:.2f} GB/s)"


def _summary(path: Path, r: StatusReply) -> str:
    parts = []
    if r.device_total_bytes:
        parts.append(f"device memory {r.device_free_bytes / 1e9:.1f} of {r.device_total_bytes / 1e9:.1f} GB free")
    if r.tier_budget:
        parts.append(f"host tier {r.tier_bytes / 1e9:.2f} of {r.tier_budget / 1e9:.2f} GB in {r.tier_entries} entries")
    return f"{path}: " + "; ".join(parts) if parts else ""


def _to_json(r: StatusReply) -> dict[str, Any]:
    return r.to_wire()


async def _manage(args: argparse.Namespace) -> int:
    client = WCacheClient(args.socket_path, socket_dir=args.socket_dir)
    try:
        if args.cmd == "preload":
            r = await client.preload(
                args.model,
                tp_rank=args.tp_rank,
                tp_size=args.tp_size,
                dtype=args.dtype,
                plan_file=args.shard_plan,
                transform=args.transform,
                timeout=args.timeout,
            )
            gone = ", ".join(f"{k.get('architecture')}@{str(k.get('fingerprint'))[:12]}" for k in r.evicted)
            print(
                f"resident: {r.tensors} tensors, {r.bytes / 1e9:.2f} GB, loaded in {r.load_seconds:.2f} s"
                + (f"; evicted {gone}" if gone else "")
            )
        else:
            from wcache.key import WeightCacheKey

            key = WeightCacheKey.from_checkpoint(
                args.model,
                tp_rank=args.tp_rank,
                tp_size=args.tp_size,
                dtype=args.dtype,
                plan_file=args.shard_plan,
                transform=args.transform,
            )
            ev = await client.evict(key, timeout=args.timeout)
            print(f"evicted: {ev.bytes / 1e9:.2f} GB freed")
    except WCacheError as exc:
        from wcache.server.startup import pytorch_bin_hint

        hint = (
            pytorch_bin_hint(args.model)
            if not isinstance(exc, CheckpointError) or "PyTorch .bin" not in exc.message
            else ""
        )
        print(
            f"wcache {args.cmd}: {type(exc).__name__}: {exc.message}" + (f". {hint}" if hint else ""), file=sys.stderr
        )
        return 1
    return 0


def _where(p: argparse.ArgumentParser) -> None:
    w = p.add_mutually_exclusive_group()
    w.add_argument("--socket-path", type=Path, help="one daemon's socket file")
    w.add_argument(
        "--socket-dir", type=Path, help=f"directory of the daemons' sockets (default: {DEFAULT_SOCKET_DIR_HELP})"
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="wcache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{status,preload,evict}")
    st = sub.add_parser(
        "status",
        help="what each daemon serves, and who holds leases (exit 1 if one is unreachable)",
        description="One row per model of each daemon socket found; exit 0 only if every one answered.",
    )
    _where(st)
    st.add_argument("--json", action="store_true", help="print the STATUS_REPLY frames as JSON, one per socket")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each daemon (default 5)")
    for name, help_ in (
        ("preload", "load a checkpoint into the daemon of its rank and keep it resident"),
        ("evict", "drop a checkpoint's model from the daemon of its rank (refused while engines hold leases)"),
    ):
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("model", type=Path, help="checkpoint directory (safetensors + config.json)")
        sp.add_argument("--tp-rank", type=int, default=0, help="tensor-parallel rank, in [0, --tp-size) (default 0)")
        sp.add_argument("--tp-size", type=int, default=1, help="tensor-parallel world size (default 1)")
        sp.add_argument(
            "--dtype",
            default=None,
            choices=["auto", "bfloat16", "float16", "float32", "float64"],
            help="dtype the model is (to be) served in (default: as stored)",
        )
        sp.add_argument("--shard-plan", type=Path, help="JSON sharding plan (format: docs/shard-plans.md)")
        sp.add_argument(
            "--transform", default="", metavar="MODULE:FUNCTION", help="load-time transform, as wcache-server's"
        )
        _where(sp)
        sp.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the daemon (default 600)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd in ("preload", "evict"):
        return asyncio.run(_manage(args))
    paths = _sockets(args)
    if not paths:
        print(f"wcache: no daemon sockets in {args.socket_dir or default_socket_dir()}", file=sys.stderr)
        return 1
    results = asyncio.run(_status(paths, args.timeout))
    if args.json:
        print(
            json.dumps(
                {str(p): (_to_json(r) if isinstance(r, StatusReply) else {"error": r}) for p, r in results},
                indent=2,
                default=str,
            )
        )
    else:
        now = time.time()
        rows = [HEADER]
        for p, r in results:
            rows += _rows(p, r, now)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        for p, r in results:
            line = _summary(p, r) if isinstance(r, StatusReply) else ""
            if line:
                print(line)
    return 0 if all(isinstance(r, StatusReply) for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
