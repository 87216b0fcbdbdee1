"""``wcache-server``: load one rank of a checkpoint and serve it on a Unix socket.

Order of work, so that a bad start costs nothing: arguments -> socket directory checks
-> one-daemon lock -> platform check -> checkpoint headers, key and shard plan (no data)
-> load into one slab -> listen -> ready line (and ready file).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from wcache import __version__
from wcache.errors import CheckpointError, WCacheError
from wcache.paths import DEFAULT_SOCKET_DIR_HELP, default_socket_dir, socket_name
from wcache.server.backends.base import Backend
from wcache.server.security import DaemonLock, check_private_dir, check_socket_path, ensure_socket_dir
from wcache.units import size_arg

if TYPE_CHECKING:
    from wcache.proto import HandedModel
    from wcache.rank import RankSpec
    from wcache.server.backends.base import Slab
    from wcache.server.keeper_link import KeeperLink
    from wcache.server.store import ServedModel

__all__ = ["build_parser", "checkpoint_errors", "main", "make_backend", "parse_args", "pytorch_bin_hint"]

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
    if args.tp_size < 1 or not 0 <= args.tp_rank < args.tp_size:
        p.error(f"--tp-rank {args.tp_rank} must be in [0, --tp-size {args.tp_size})")
    return args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
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
        help="most slab bytes held at once; PRELOAD evicts unleased models, least recently used first (0: none)",
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
        "fds) and its listening socket, then serve them there; it exits. No disk read; engines keep their mappings",
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
        "holds nothing; they are kept there again)",
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
    p.add_argument("--device", default="cpu", help="cpu (host shared memory) or cuda:K (default: cpu)")
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
        "or stream: files mostly not cached read with O_DIRECT in BLOCK-sized reads (default 1MiB) that all "
        "threads take in file order, the way fastsafetensors reads (docs/performance.md); cached files are read "
        "as with buffered. Measured on the H200's disk: direct was not faster cold (9.19 vs 9.15 s for 16 GB) "
        "and leaves the page cache empty for the next start",
    )
    p.add_argument(
        "--transform",
        default="",
        metavar="MODULE:FUNCTION",
        help="rewrite the rank's tensors once at load (e.g. wcache.transforms:fuse_llama_qkv_gate_up); part of the key",
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
        "--metrics-port", type=int, default=0, help="serve Prometheus text metrics on 127.0.0.1:PORT (0: off)"
    )
    p.add_argument("--frame-timeout", type=float, default=10.0, help="max seconds to finish sending a started frame")
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="log lines on stderr at or above this level (default INFO: one line per event that matters)",
    )
    return p


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
    if not args.frame_timeout > 0:
        p.error(f"--frame-timeout {args.frame_timeout} must be a positive number of seconds")
    if args.threads < 1:
        p.error(f"--threads {args.threads} must be at least 1")
    if args.staging_bytes is not None and args.staging_bytes < 1:
        p.error("--staging-bytes must be positive (leave it out for the default 512MiB)")
    if not 0 <= args.metrics_port <= 65535:
        p.error(f"--metrics-port {args.metrics_port} must be a TCP port in [0, 65535] (0: off)")


def make_backend(device: str, cuda_export: str = "vmm") -> Backend:
    if device == "cpu":
        from wcache.server.backends.host import HostBackend

        return HostBackend()
    if device == "cuda" or device.startswith("cuda:"):
        from wcache.server.backends.cuda import CudaBackend

        backend: Backend = CudaBackend(int(device.split(":", 1)[1]) if ":" in device else 0, cuda_export)
        return backend
    raise SystemExit(f"wcache-server: error: --device must be cpu or cuda:K, got {device!r}")


def resolve_socket(args: argparse.Namespace) -> Path:
    if args.socket_path is not None:
        path = Path(os.path.abspath(args.socket_path))
        if path.parent == Path(os.path.abspath(default_socket_dir())):
            ensure_socket_dir(path.parent)  # the default directory is ours to create, 0700
        check_private_dir(path.parent)
        check_socket_path(path)
        return path
    d = args.socket_dir if args.socket_dir is not None else default_socket_dir()
    if args.socket_dir is None:
        ensure_socket_dir(d)
    else:
        check_private_dir(Path(os.path.abspath(d)))
    path = Path(os.path.abspath(d)) / socket_name(args.tp_rank)
    check_socket_path(path)
    return path


def pytorch_bin_hint(root: Path) -> str:
    """What to do with a checkpoint that has PyTorch ``.bin`` weights but no safetensors ("" otherwise):
    wcache reads safetensors only (it never unpickles), so they must be converted once."""
    try:
        bins = sorted(root.glob("*.bin"))
        if not bins or any(root.glob("*.safetensors")):
            return ""
    except OSError:
        return ""
    return (
        f"{root} holds PyTorch .bin weights ({bins[0].name}{' ...' if len(bins) > 1 else ''}) and no .safetensors: "
        "wcache reads safetensors only (it never unpickles). Convert once, e.g. with transformers: python -c "
        f"\"from transformers import AutoModelForCausalLM as M; M.from_pretrained('{root}')"
        f".save_pretrained('{root}-safetensors', safe_serialization=True)\" and serve {root}-safetensors"
    )


@contextlib.contextmanager
def checkpoint_errors(model: str) -> Iterator[None]:
    """Errors a malformed checkpoint raises from deep inside a parser, as the CheckpointError they are:
    JSON nested past the recursion limit (config.json, the index, a header, a plan) and a tensor name
    that is not valid UTF-8 (a lone surrogate from a JSON escape) when its table is encoded."""
    try:
        yield
    except CheckpointError as exc:
        hint = pytorch_bin_hint(Path(model))
        if not hint:
            raise
        raise CheckpointError(f"{exc.message}. {hint}", details=exc.details) from exc
    except RecursionError as exc:
        raise CheckpointError(f"checkpoint {model}: a JSON file there is nested too deeply to parse ({exc})") from None
    except UnicodeError as exc:
        raise CheckpointError(
            f"checkpoint {model}: a tensor name or string is not valid UTF-8 ({exc}); fix the checkpoint's names"
        ) from None


def adopt(models: tuple[HandedModel, ...], fds: list[int], backend: Backend) -> list[ServedModel]:
    """Serve models whose slabs another process handed over (their fd fields index ``fds``). Every fd in
    ``fds`` is consumed: adopted by a slab, or closed (on failure too)."""
    from wcache.recipe import key_from_wire
    from wcache.server.loader import LoadStats
    from wcache.server.store import ServedModel

    served: list[ServedModel] = []
    adopted: list[Slab] = []  # each owns its fd from here on
    used: set[int] = set()
    try:
        for hm in models:
            slabs = []
            for desc in hm.slabs:
                slab = backend.adopt(desc, fds[desc.fd])
                used.add(desc.fd)
                adopted.append(slab)
                slabs.append(slab)
            stats = LoadStats(0, hm.payload, hm.load_seconds)
            key = key_from_wire(dict(hm.key))  # a deposit keeps its recipe key (docs/protocol.md §4.13)
            source = Path(hm.source) if hm.source else None
            served.append(
                ServedModel(
                    key,
                    hm.tensors,
                    dict(hm.aliases),
                    slabs,
                    backend,
                    hm.payload,
                    stats,
                    0.0,
                    source,
                    origin=hm.origin,
                    buffers=hm.buffers,
                )
            )
            hm.tensors.encoded()
    except BaseException:
        for s in adopted:
            s.close()
        raise
    finally:
        for i, fd in enumerate(fds):
            if i not in used:
                os.close(fd)
    return served


def take_over(sock_path: Path, backend: Backend, lock: DaemonLock) -> tuple[list[ServedModel], socket.socket]:
    """--takeover: the running daemon's models (adopted slabs) and its listening socket; then its lock."""
    import asyncio

    from wcache.client.client import take_over as request

    t0 = time.perf_counter()
    state, fds = asyncio.run(request(sock_path, backend=backend.name, device_uuid=backend.device.uuid))
    listener = socket.socket(fileno=os.dup(fds[state.listener_fd]))
    models: list[ServedModel] = []
    try:
        models = adopt(state.models, fds, backend)  # closes the listener's original fd with the unused ones
        for m in models:
            m.origin = "takeover"  # STATUS: handed over by the old daemon
        lock.acquire(wait=10.0)  # the old daemon releases it right after sending
    except BaseException:
        for m in models:
            m.close()
        listener.close()
        raise
    log.info(
        "took over socket=%s from pid=%d models=%d bytes=%d seconds=%.3f",
        sock_path,
        state.pid,
        len(models),
        sum(m.slab_bytes for m in models),
        time.perf_counter() - t0,
    )
    return models, listener


def _keeper_holds_some(args: argparse.Namespace, sock_path: Path) -> bool:
    """Whether a keeper (``--keeper``) holds models of this rank (STATUS, 0.5 s at most): then start-up
    reclaims them without torch; otherwise this daemon loads, and its backend sets loads up first."""
    if args.keeper is None:
        return False
    import asyncio

    from wcache.keeper_probe import keeper_kept
    from wcache.paths import KEEPER_SOCKET

    kpath = Path(args.keeper) if args.keeper else sock_path.parent / KEEPER_SOCKET
    return asyncio.run(keeper_kept(kpath, args.tp_rank)) > 0


def reclaim(link: KeeperLink, backend: Backend, plan_file: Path | None = None) -> list[ServedModel]:
    """--keeper: the models the keeper holds for this daemon's socket that pass the checks against their
    checkpoint (wcache/server/reclaim.py), adopted; none if it is not running."""
    import asyncio

    from wcache.server.reclaim import admit

    t0 = time.perf_counter()
    try:
        state, fds = asyncio.run(link.reclaim())
    except (WCacheError, OSError, TimeoutError) as exc:
        log.warning("keeper %s: nothing reclaimed (%s); loading as usual", link.path, exc)
        return []
    models, stale = admit(link, state, fds, backend, adopt, plan_file=plan_file)  # one bad model drops alone
    link.reclaimed(models)
    log.info(
        "reclaimed from keeper=%s socket=%s models=%d bytes=%d dropped=%d stale=%d seconds=%.3f",
        link.path,
        link.owner,
        len(models),
        sum(m.slab_bytes for m in models),
        state.dropped,
        stale,
        time.perf_counter() - t0,
    )
    return models


def drop(evicted: list[ServedModel], link: KeeperLink | None, reason: str) -> None:
    """Log models evicted at start (already closed) and tell the keeper to drop them."""
    import asyncio

    for m in evicted:
        log.info("evicted key=%s bytes=%d reason=%s", m.key.short(), m.slab_bytes, reason)
        if link is not None:
            asyncio.run(link.unkeep(m))


def rank_spec(args: argparse.Namespace) -> RankSpec:
    """The rank ``--model``, ``--tp-rank``, ``--tp-size``, ``--dtype``, ``--shard-plan``, ``--transform`` and
    ``--verify-content`` name: the one description the daemon plans, keys and loads (wcache.rank)."""
    from wcache.rank import RankSpec

    return RankSpec(
        Path(args.model),
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        dtype=args.dtype,
        plan_file=args.shard_plan,
        transform=args.transform,
        verify_content=args.verify_content,
    )


def write_ready(path: Path, payload: dict[str, object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload) + "\n")
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> int:
    from wcache.rank import RankPlan, plan_rank
    from wcache.server.daemon import Daemon
    from wcache.server.loader import DEFAULT_STAGING
    from wcache.server.store import Store, load_model

    if args.takeover is not None:
        sock_path = Path(os.path.abspath(args.takeover))
        check_private_dir(sock_path.parent)
    else:
        sock_path = resolve_socket(args)
    lock = DaemonLock(sock_path)
    if args.takeover is None:
        lock.acquire()
    try:
        backend = make_backend(args.device, args.cuda_export)
        if args.takeover is None and not _keeper_holds_some(args, sock_path):  # it will load: set loads up first
            backend.prepare_loads()
        backend.check_platform()
        handed: list[ServedModel] = []
        listener = None
        if args.takeover is not None:
            handed, listener = take_over(sock_path, backend, lock)
        tier = None
        if args.host_tier > 0:
            from wcache.server.tier import HostTier, default_tier_dir

            tier = HostTier(args.host_tier_dir or default_tier_dir(), args.host_tier, pin=backend.pinner())

        def planner(spec: RankSpec) -> RankPlan:
            with checkpoint_errors(str(spec.checkpoint)):
                return plan_rank(spec)

        def loader(rp: RankPlan) -> ServedModel:
            with checkpoint_errors(str(rp.spec.checkpoint)):
                return load_model(
                    rp,
                    backend=backend,
                    threads=args.threads,
                    staging_bytes=args.staging_bytes or DEFAULT_STAGING,
                    io=args.io,
                    tier=tier,
                )

        link: KeeperLink | None = None
        reclaimed: list[ServedModel] = []
        if args.keeper is not None:
            from wcache.paths import KEEPER_SOCKET
            from wcache.server.keeper_link import KeeperLink

            kpath = Path(args.keeper) if args.keeper else sock_path.parent / KEEPER_SOCKET
            link = KeeperLink(
                Path(os.path.abspath(kpath)), owner=sock_path, backend=backend.name, device_uuid=backend.device.uuid
            )
            if args.takeover is None:  # after a takeover the keeper already holds what was handed over
                reclaimed = handed = reclaim(link, backend, args.shard_plan)
        store = Store(backend, handed, budget=args.memory_budget or None)
        try:
            if store.budget is not None and store.resident_bytes > store.budget:  # a lowered --memory-budget
                drop(store.make_room(0), link, "budget")
            if args.model is not None:
                spec = rank_spec(args)
                with planner(spec) as rp:
                    held = store.models.get(rp.key)
                    if held is not None:
                        store.remember_source(held, spec.checkpoint)
                        log.info(
                            "serving key=%s bytes=%d from the keeper: nothing loaded", rp.key.short(), held.slab_bytes
                        )
                    else:
                        drop(store.make_room(rp.layout.total_bytes), link, "load")
                        store.add(loader(rp))
            if link is not None:
                import asyncio

                have = {id(m) for m in reclaimed}
                for m in list(store.models.values()):
                    if id(m) not in have:
                        asyncio.run(link.keep(m))
            daemon = Daemon(
                store,
                sock_path,
                software=f"wcache/{__version__}",
                max_frame_size=args.max_frame_size,
                idle_timeout=args.idle_timeout or None,
                frame_timeout=args.frame_timeout,
                metrics_port=args.metrics_port,
                loader=loader,
                planner=planner,
                verify_content=args.verify_content,
                load_on_demand=args.load_on_demand,
                listener=listener,
                on_handover=lock.release,
                tier=tier,
                keeper=link,
                keeper_check=args.keeper_check,
            )

            def ready() -> None:
                models = list(store.models.values())
                m = models[0] if models else None
                log.info(
                    "ready socket=%s key=%s backend=%s device=%s tensors=%d bytes=%d load_s=%.2f read_gb_s=%.2f "
                    "models=%d budget=%s",
                    sock_path,
                    m.key.short() if m else "-",
                    backend.name,
                    backend.device.uuid or backend.device.kind,
                    len(m.table) if m else 0,
                    store.resident_bytes,
                    m.stats.seconds if m else 0.0,
                    m.stats.gb_per_s if m else 0.0,
                    len(models),
                    store.budget if store.budget is not None else "none",
                )
                if args.ready_file is not None:
                    write_ready(
                        args.ready_file,
                        {"socket": str(sock_path), "pid": os.getpid(), "key": m.key.to_wire() if m else None},
                    )

            import uvloop

            uvloop.run(daemon.serve(ready))
        finally:
            store.close()
            if tier is not None:
                tier.close()
    finally:
        lock.release()
    return 0


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
    try:
        return run(args)
    except WCacheError as exc:
        print(f"wcache-server: error: {exc.message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
