"""The ``wcache-keeper`` command (``python -m wcache.server.keeper`` too): its options, its socket, its
descriptor budget, and the keeper server (wcache/server/keeper.py) run until SIGTERM.

    wcache-keeper [--socket-dir DIR | --socket-path PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import sys
from dataclasses import replace
from pathlib import Path

from wcache import __version__
from wcache.command import CommandParser
from wcache.errors import WCacheError
from wcache.proto.frames import MAX_KEPT_FDS
from wcache.server.keeper import Keeper, KeeperLimits
from wcache.server.notify import notify
from wcache.server.security import DaemonLock, check_private_dir, ensure_socket_dir, hold_socket_dir
from wcache.server.service import add_log_level, ignore_hangup

__all__ = ["build_parser", "fd_budget", "keeper_socket", "main", "parse_args"]

log = logging.getLogger("wcache.keeper")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("max_connections", "max_owners", "max_fds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_bytes < 0:
        p.error("--max-bytes must be 0 (no cap) or a positive number of bytes")
    return args


def build_parser() -> argparse.ArgumentParser:
    from wcache.paths import KEEPER_SOCKET, default_socket_dir

    p = CommandParser(
        prog="wcache-keeper",
        description="Hold wcache daemons' slabs (GPU or shared memory) across daemon restarts. "
        "Stopping the keeper frees everything it holds.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket-path", type=Path, help="the keeper's socket file (its directory must be private)")
    where.add_argument(
        "--socket-dir", type=Path, help=f"directory for {KEEPER_SOCKET} (default: {default_socket_dir()})"
    )
    d = KeeperLimits()
    p.add_argument("--ready-file", type=Path, help="write a JSON line here once serving")
    p.add_argument(
        "--max-connections", type=int, default=d.connections, help=f"connections open at once (default {d.connections})"
    )
    p.add_argument(
        "--max-owners", type=int, default=d.owners, help=f"daemons (sockets) it holds slabs for (default {d.owners})"
    )
    p.add_argument(
        "--max-fds",
        type=int,
        default=d.fds,
        help=f"slabs (descriptors) held in all (default {d.fds}; each daemon at most {MAX_KEPT_FDS})",
    )
    p.add_argument("--max-bytes", type=int, default=d.bytes, help="bytes of slabs held in all (default 0: no cap)")
    p.add_argument(
        "--no-owner-check",
        action="store_true",
        help="accept KEEP/UNKEEP/RECLAIM for a socket from any process of the uid, not only the holder of its "
        "lock (for daemons in a pid namespace the keeper cannot see; the daemons still check what they reclaim)",
    )
    add_log_level(p)
    return p


def fd_budget(limits: KeeperLimits) -> KeeperLimits:
    """Raise the soft RLIMIT_NOFILE to what ``limits`` need (every slab held, plus each connection's socket
    and the descriptors one frame may bring, plus 64 of its own), up to the hard limit; where even that is
    too little, lower ``fds`` to fit, so that a full keeper refuses KEEPs instead of failing to accept."""
    need = limits.fds + limits.connections * (1 + MAX_KEPT_FDS) + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < need:
        fds = max(MAX_KEPT_FDS, soft - (need - limits.fds))
        log.warning(
            "RLIMIT_NOFILE is %d (hard %d): holding at most %d slabs instead of %d", soft, hard, fds, limits.fds
        )
        return replace(limits, fds=fds)
    return limits


def keeper_socket(socket_path: Path | None, socket_dir: Path | None) -> Path:
    """The keeper socket for --socket-path / --socket-dir (the default private directory if neither)."""
    from wcache.paths import KEEPER_SOCKET, default_socket_dir

    if socket_path is not None:
        path = Path(os.path.abspath(socket_path))
        check_private_dir(path.parent)
        return path
    if socket_dir is None:
        return ensure_socket_dir(default_socket_dir()) / KEEPER_SOCKET
    d = Path(os.path.abspath(socket_dir))
    check_private_dir(d)
    return d / KEEPER_SOCKET


def main(argv: list[str] | None = None) -> int:
    import json

    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s wcache-keeper[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    ignore_hangup()  # a terminal closing must not end the keeper (and free every slab it holds)
    try:
        path = keeper_socket(args.socket_path, args.socket_dir)
        hold = hold_socket_dir(path.parent)
    except WCacheError as exc:
        print(f"wcache-keeper: error: {exc.message}", file=sys.stderr)
        return 1
    lock = DaemonLock(path, program="wcache-keeper")
    try:
        lock.acquire()
    except WCacheError as exc:
        hold.release()
        print(f"wcache-keeper: error: {exc.message}", file=sys.stderr)
        return 1
    try:
        limits = fd_budget(
            KeeperLimits(
                connections=args.max_connections, owners=args.max_owners, fds=args.max_fds, bytes=args.max_bytes
            )
        )
        keeper = Keeper(path, limits=limits, check_owner=not args.no_owner_check)

        def ready() -> None:
            log.info(
                "ready socket=%s max_connections=%d max_owners=%d max_fds=%d max_bytes=%d owner_check=%s",
                path,
                limits.connections,
                limits.owners,
                limits.fds,
                limits.bytes,
                "off" if args.no_owner_check else "lock-holder",
            )
            if args.ready_file is not None:
                tmp = args.ready_file.with_name(args.ready_file.name + ".tmp")
                tmp.write_text(json.dumps({"socket": str(path), "pid": os.getpid()}) + "\n")
                os.replace(tmp, args.ready_file)
            notify(READY=1, MAINPID=os.getpid(), STATUS=f"holding slabs for daemons on {path}")

        def stopping() -> None:
            notify(STOPPING=1, STATUS=f"stopping: freeing {keeper.held_fds} slab(s)")

        import uvloop

        uvloop.run(keeper.serve(ready, on_stopping=stopping))
    finally:
        lock.release()
        hold.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
