"""``wcache-server``: load one rank of a checkpoint and serve it on a Unix socket.

This module is the command: its options (``build_parser``, ``parse_args``) and ``main``; the start-up
phases it runs, in their order, are wcache/server/startup.py's ``run``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from wcache import __version__
from wcache.command import CommandParser
from wcache.errors import WCacheError
from wcache.paths import DEFAULT_SOCKET_DIR_HELP, socket_name
from wcache.plan.key import tp_problem
from wcache.server.service import add_log_level, ignore_hangup
from wcache.server.startup import run
from wcache.units import size_arg

__all__ = ["build_parser", "main", "parse_args"]

log = logging.getLogger("wcache.server")

#: --max-frame-size bounds: below 64 KiB not even a small model's STATE fits; the length prefix is 4 bytes.
MIN_FRAME_SIZE = 64 * 1024
MAX_FRAME_SIZE = (1 << 32) - 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    _check_ranges(p, args)
    if args.takeover is not None and (args.model is not None or args.socket_path or args.socket_dir):
        p.error("--takeover serves the running daemon's socket and models: no --model/--socket-path/--socket-dir")
    if not args.keeper_check > 0:
        p.error(f"--keeper-check must be a positive number of seconds, got {args.keeper_check}")
    problem = tp_problem(args.tp_rank, args.tp_size, flags=True)
    if problem is not None:
        p.error(problem)
    _check_fleet(p, args)
    return args


def _check_fleet(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The fleet options (docs/fleet.md): a fill needs a model to fill; the peer channel's security must be one
    complete mode (``args.peer_security``, None without --fill-from)."""
    args.peer_security = None
    if args.fill_from is None and args.peer_listen is None:
        for opt in ("fill_fingerprint", "peer_cert", "peer_key", "peer_ca", "peer_secret_file"):
            if getattr(args, opt) is not None:
                p.error(f"--{opt.replace('_', '-')} belongs to --fill-from or --peer-listen (docs/fleet.md)")
        return
    if args.fill_from is not None and args.model is None:
        p.error("--fill-from fills the rank of --model: name the checkpoint directory (it may hold no weights)")
    if not args.fill_timeout > 0:
        p.error(f"--fill-timeout {args.fill_timeout} must be a positive number of seconds")
    if args.peer_max_fills < 1:
        p.error(f"--peer-max-fills {args.peer_max_fills} must be at least 1")
    from wcache.server.fill import resolve_peers
    from wcache.server.peer_auth import PeerSecurity
    from wcache.server.peer_channel import parse_address

    try:
        if args.fill_from is not None and not args.fill_from.startswith("dns:"):
            resolve_peers(args.fill_from)
        args.peer_security = PeerSecurity.configure(
            cert=args.peer_cert, key=args.peer_key, ca=args.peer_ca, secret_file=args.peer_secret_file
        )
        if args.peer_listen is not None:
            args.peer_listen = parse_address(args.peer_listen, listen=True)
            args.peer_security.check_listen(args.peer_listen[0])
    except ValueError as exc:
        p.error(str(exc))


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="wcache-server",
        description="Keep one tensor-parallel rank of a safetensors checkpoint resident and hand it to "
        "engines over a Unix socket (docs/protocol.md). Sizes take bytes or K/M/G/T suffixes (16G, 512MiB; "
        "KB/MB/GB/TB are powers of 1000).",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument(
        "--model",
        type=Path,
        help="checkpoint directory (safetensors + config.json); more with PRELOAD / wcache preload",
    )
    p.add_argument(
        "--load-on-demand",
        action="store_true",
        help="serve a GET_STATE for another rank/dtype/transform of a checkpoint loaded before by loading it",
    )
    p.add_argument(
        "--memory-budget",
        type=size_arg,
        default=0,
        metavar="SIZE",
        help="most slab bytes held at once; a new model (PRELOAD, a deposit's COMMIT) evicts unleased models, least "
        "recently used first (0: none)",
    )
    p.add_argument(
        "--host-tier",
        type=size_arg,
        default=0,
        metavar="SIZE",
        help="keep a copy of every loaded model in shared memory (up to SIZE, least recently used out) and reload "
        "from it on restart, PRELOAD or load-on-demand instead of the checkpoint (0: off)",
    )
    p.add_argument(
        "--host-tier-dir", type=Path, help="private directory for the host tier (default /dev/shm/wcache-UID)"
    )
    p.add_argument(
        "--takeover",
        type=Path,
        metavar="SOCKET",
        help="take over the daemon serving SOCKET (e.g. an upgrade): receive its models' memory (VMM or memfd "
        "fds) and its listening socket, then serve them there; it exits. No disk read; engines keep their mappings. "
        "Its options are not handed over: give this daemon the same ones (--keeper, --host-tier, --memory-budget, "
        "peer options, ...)",
    )
    p.add_argument(
        "--keeper",
        nargs="?",
        const="",
        metavar="SOCKET",
        help="a wcache-keeper (its socket; default: wcache-keeper.sock beside this daemon's socket) holds this "
        "daemon's models across restarts: they are reclaimed at start instead of loaded, and kept or dropped as "
        "the daemon loads or evicts them",
    )
    p.add_argument(
        "--keeper-check",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="with --keeper: how often to check that the keeper still holds every model (a restarted keeper "
        "holds nothing; they are kept there again; default %(default)s)",
    )
    p.add_argument(
        "--tp-rank", type=int, default=0, help="tensor-parallel rank this daemon serves, in [0, --tp-size) (default 0)"
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel world size: each rank gets its slice of every sharded tensor (default 1: whole tensors)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        type=_device_arg,
        help="cpu (host shared memory) or cuda:K, K a visible GPU's index (by UUID or MIG instance: "
        "CUDA_VISIBLE_DEVICES=UUID with cuda:0; default: cpu)",
    )
    p.add_argument(
        "--cuda-export",
        default="vmm",
        choices=["vmm", "ipc"],
        help="how a CUDA slab is shared: vmm (fd over SCM_RIGHTS, read-only mappings) or ipc (cudaIpcMemHandle)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32", "float64"],
        help="cast floating-point tensors to this dtype at load (part of the key; default auto: as stored)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--socket-path",
        type=Path,
        help="socket file; its directory must be yours with mode 0700 (not /tmp itself: a subdirectory of it)",
    )
    where.add_argument(
        "--socket-dir",
        type=Path,
        help=f"private directory for {socket_name(0)} etc. (default: {DEFAULT_SOCKET_DIR_HELP}, created 0700)",
    )
    p.add_argument(
        "--shard-plan",
        type=Path,
        help="JSON sharding plan for architectures without a built-in one (format: docs/shard-plans.md)",
    )
    p.add_argument(
        "--io",
        default="buffered",
        type=_io_arg,
        metavar="{buffered,direct,auto,stream[:BLOCK]}",
        help="GPU loads: page-cache reads (default), O_DIRECT reads, auto (direct for files mostly not cached), "
        "or stream: files mostly not cached read with O_DIRECT in BLOCK-sized reads (default 512KiB) that all "
        "threads take in file order, the way fastsafetensors reads, one copy per job (docs/performance.md); cached "
        "files are read as with buffered. Measured on the H200's disk: direct was not faster cold (9.19 vs 9.15 s for 16 GB) "
        "and leaves the page cache empty for the next start",
    )
    p.add_argument(
        "--transform",
        default="",
        metavar="MODULE:FUNCTION",
        help="rewrite the rank's tensors once at load (e.g. wcache.transforms:fuse_llama_qkv_gate_up); part of the key",
    )
    fleet = p.add_argument_group(
        "fleet fill", "fill the slab from peer daemons over NIXL before reading the checkpoint (docs/fleet.md)"
    )
    fleet.add_argument(
        "--fill-from",
        metavar="HOST:PORT[,...]|dns:NAME:PORT",
        help="peers to fill this rank from (every address NAME resolves to, with dns:); any failure loads from "
        "disk, with one log line naming the reason. A --model directory without weights gets the checkpoint's "
        "small files and safetensors headers from a peer first",
    )
    fleet.add_argument(
        "--fill-fingerprint",
        metavar="HEX",
        help="the key fingerprint a directory without weights must have (else the first peer's checkpoint is taken)",
    )
    fleet.add_argument(
        "--fill-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a fill must be done within this plus its bytes at 50 MB/s, or at a capped peer's --peer-max-rate shared "
        "by its --peer-max-fills where that is slower; every grant must come within it (default 30)",
    )
    fleet.add_argument(
        "--peer-listen",
        metavar="HOST:PORT",
        help="serve this daemon's resident slabs to peer daemons' fills on a TCP port (authenticated unless "
        "HOST is loopback); each slab is registered with NIXL once",
    )
    fleet.add_argument(
        "--peer-max-rate",
        type=size_arg,
        default=0,
        metavar="RATE",
        help="bytes per second served to peers in all, e.g. 2G (0: no cap), so this node's engines are not starved",
    )
    fleet.add_argument(
        "--peer-max-fills",
        type=int,
        default=4,
        metavar="N",
        help="fills served at once; more get LIMIT_EXCEEDED (default %(default)s)",
    )
    fleet.add_argument("--peer-cert", type=Path, help="this daemon's TLS certificate for the peer channel (mutual TLS)")
    fleet.add_argument("--peer-key", type=Path, help="its private key")
    fleet.add_argument("--peer-ca", type=Path, help="the fleet's CA: peers must present a certificate it signed")
    fleet.add_argument(
        "--peer-secret-file",
        type=Path,
        help="a lab's shared secret (mode 0600, >= 16 bytes) instead of certificates: TLS with proofs of the secret",
    )
    p.add_argument("--ready-file", type=Path, help="write a JSON line here once serving")
    p.add_argument("--verify-content", action="store_true", help="fingerprint the data too, not only headers")
    p.add_argument(
        "--threads",
        type=int,
        default=min(16, os.cpu_count() or 4),
        help="reader threads for loading (default: cores, <= 16)",
    )
    p.add_argument(
        "--staging-bytes",
        type=size_arg,
        metavar="SIZE",
        help="pinned host staging for GPU loads, split across reader threads (default 512 MiB)",
    )
    p.add_argument(
        "--max-frame-size",
        type=size_arg,
        default=64 * 1024 * 1024,
        metavar="SIZE",
        help="largest frame accepted or sent, in [64KiB, 4GiB-1] (default 64MiB; a STATE frame must fit)",
    )
    p.add_argument(
        "--idle-timeout", type=float, default=0, help="close connections silent this long, in s (0: never; leases live)"
    )
    p.add_argument(
        "--deposit-timeout",
        type=float,
        default=600,
        metavar="S",
        help="abandon a write-back deposit not committed this long after its slab was handed out, freeing its slab "
        "and its slot (0: never; default 600)",
    )
    p.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus text metrics on 127.0.0.1:PORT (0: off)"
    )
    p.add_argument(
        "--frame-timeout",
        type=float,
        default=10.0,
        help="max seconds to finish sending a started frame (default %(default)s)",
    )
    add_log_level(p)
    return p


def _device_arg(text: str) -> str:
    """argparse ``type=`` for ``--device``: cpu, cuda or cuda:K (whether that GPU exists is the backend's
    check at start: CudaBackend.check_device)."""
    from wcache.server.startup import device_index

    try:
        device_index(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _io_arg(text: str) -> str:
    """argparse ``type=`` for ``--io``: the mode string as given, checked (the loader parses it again).
    The plain modes need no import: a daemon that only serves kept slabs never imports the loader."""
    if text in ("buffered", "direct", "auto"):
        return text
    from wcache.server.loader import parse_io

    try:
        parse_io(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _check_ranges(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse values the daemon would accept and then serve nobody with (it would still report ready)."""
    if not MIN_FRAME_SIZE <= args.max_frame_size <= MAX_FRAME_SIZE:
        p.error(
            f"--max-frame-size {args.max_frame_size} must be in [{MIN_FRAME_SIZE}, {MAX_FRAME_SIZE}] bytes "
            "(64KiB to 4GiB-1: the length prefix is 4 bytes); the default 64MiB fits ~300k tensors"
        )
    if not args.idle_timeout >= 0:  # also refuses NaN
        p.error(f"--idle-timeout {args.idle_timeout} must be >= 0 seconds (0: never close idle connections)")
    if not 0 <= args.deposit_timeout < float("inf"):  # also refuses NaN
        p.error(f"--deposit-timeout {args.deposit_timeout} must be >= 0 seconds (0: never abandon a deposit)")
    if not args.frame_timeout > 0:
        p.error(f"--frame-timeout {args.frame_timeout} must be a positive number of seconds")
    if args.threads < 1:
        p.error(f"--threads {args.threads} must be at least 1")
    if args.staging_bytes is not None and args.staging_bytes < 1:
        p.error("--staging-bytes must be positive (leave it out for the default 512MiB)")
    if not 0 <= args.metrics_port <= 65535:
        p.error(f"--metrics-port {args.metrics_port} must be a TCP port in [0, 65535] (0: off)")


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """SIGINT/SIGTERM before the daemon serves (checkpoint checks, load, reclaim): one log line, then exit at
    once. Reader threads may be blocked in a read of a large file, so this does not wait for them; the kernel
    frees the slab and the lock, as after a crash, and nothing was served yet. Once serving, the daemon's own
    handlers take over (drain, unlink the socket, exit 0)."""
    name = signal.Signals(signum).name
    log.warning("%s while starting (nothing served yet): exiting without serving", name)
    logging.shutdown()
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s wcache-server[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupted)
    ignore_hangup()  # from the start: a terminal closing while the checkpoint loads must not end the daemon
    try:
        return run(args)
    except WCacheError as exc:
        print(f"wcache-server: error: {exc.message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
