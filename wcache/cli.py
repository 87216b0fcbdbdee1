"""``wcache``: operator commands against running daemons.

    wcache status [--socket-path P | --socket-dir D] [--json]

Prints one row per daemon socket found (models, bytes, leases, clients, uptime), or the
STATUS_REPLY frames as JSON. Exit status 1 if no daemon answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from wcache.client import WCacheClient
from wcache.errors import WCacheError
from wcache.paths import default_socket_dir
from wcache.proto import StatusReply

__all__ = ["main"]


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


def _row(path: Path, r: StatusReply | str) -> list[str]:
    if isinstance(r, str):
        return [str(path), "-", "-", "-", "-", "-", "-", r]
    m = r.models[0] if r.models else None
    key = m.key if m else {}
    return [
        str(path),
        f"{key.get('architecture', '')}@{str(key.get('fingerprint', ''))[:12]}",
        f"tp{key.get('tp_rank', '?')}/{key.get('tp_size', '?')} {key.get('dtype', '')}",
        f"{r.backend}:{r.device.uuid or r.device.kind}",
        f"{(m.bytes if m else 0) / 1e9:.2f} GB",
        str(m.leases if m else 0),
        str(r.connections),
        f"up {r.uptime_seconds:.0f}s",
    ]


def _to_json(r: StatusReply) -> dict[str, Any]:
    return r.to_wire()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="wcache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("status", help="what each daemon serves, and who holds leases")
    where = st.add_mutually_exclusive_group()
    where.add_argument("--socket-path", type=Path)
    where.add_argument("--socket-dir", type=Path)
    st.add_argument("--json", action="store_true")
    st.add_argument("--timeout", type=float, default=5.0)
    args = ap.parse_args(argv)
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
        rows = [
            ["SOCKET", "MODEL", "RANK", "DEVICE", "SLAB", "LEASES", "CONNS", "UPTIME"],
            *(_row(p, r) for p, r in results),
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0 if any(isinstance(r, StatusReply) for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
