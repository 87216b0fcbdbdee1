"""``wcache-server``'s start-up, after its arguments are parsed (wcache/server/cli.py): the phases ``run``
goes through, in an order where a bad start costs nothing: socket directory checks (and a hold on the
directory) -> the --model directory is there (one stat) -> device check -> one-daemon lock -> --metrics-port
bound -> platform check -> takeover or keeper reclaim -> checkpoint headers, key and shard plan (no data) ->
load into one slab -> listen -> ready line (and ready file, and systemd's READY=1 under a Type=notify unit:
wcache/server/notify.py). At the end, clean or not, the lock file goes, and the default socket directory with
the last user of it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcache import __version__
from wcache.errors import CheckpointError, WCacheError
from wcache.paths import default_socket_dir, socket_name
from wcache.proto.codec import DEFAULT_MAX_FRAME_SIZE
from wcache.server.backends.base import DEFAULT_STAGING, Backend
from wcache.server.notify import notify
from wcache.server.security import (
    DaemonLock,
    check_private_dir,
    check_socket_path,
    ensure_socket_dir,
    hold_socket_dir,
)

if TYPE_CHECKING:
    from wcache.plan.key import RankSpec, WeightCacheKey
    from wcache.plan.rank import RankPlan
    from wcache.proto import HandedModel
    from wcache.server.backends.base import Slab
    from wcache.server.fill import FillConfig, PeerFill
    from wcache.server.keeper_link import KeeperLink
    from wcache.server.metrics import Metrics
    from wcache.server.peer import PeerListener
    from wcache.server.store import ServedModel, Store
    from wcache.server.tier import HostTier, TierEntry

__all__ = [
    "adopt",
    "checkpoint_errors",
    "device_index",
    "fetch_checkpoint_files",
    "fill_from_peers",
    "make_backend",
    "metrics_listener",
    "peer_fill",
    "pytorch_bin_hint",
    "rank_spec",
    "ready_fields",
    "reclaim",
    "resolve_socket",
    "run",
    "started_model",
    "take_over",
]

log = logging.getLogger("wcache.server")


def device_index(device: str) -> int | None:
    """``--device``: None for ``cpu``, the index K of ``cuda`` / ``cuda:K``; ValueError (its message says what
    to pass) for anything else."""
    if device == "cpu":
        return None
    if device == "cuda":
        return 0
    head, _, index = device.partition(":")
    if head == "cuda" and index.isdigit() and index.isascii():
        return int(index)
    raise ValueError(
        f"--device must be cpu, cuda or cuda:K (K: the index of a visible GPU, from 0), got {device!r}"
        + (
            f"; for a GPU or MIG instance by UUID, pass CUDA_VISIBLE_DEVICES={index} and --device cuda:0"
            if head == "cuda" and index.startswith(("GPU-", "MIG-"))
            else ""
        )
    )


def make_backend(device: str, cuda_export: str = "vmm", staging_bytes: int = DEFAULT_STAGING) -> Backend:
    """The backend ``--device`` names, with its staging budget (``--staging-bytes``): every load into its
    slabs stages through that much pinned memory at most (``Slab.staging_bytes``)."""
    index = device_index(device)
    if index is None:
        from wcache.server.backends.host import HostBackend

        return HostBackend(staging_bytes=staging_bytes)
    from wcache.server.backends.cuda import CudaBackend

    return CudaBackend(index, cuda_export, staging_bytes=staging_bytes)


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
    from wcache.plan.recipe import key_from_wire
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
                    generation=hm.generation,
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


def take_over(
    sock_path: Path,
    backend: Backend,
    lock: DaemonLock,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    keeper: Path | None = None,
) -> tuple[list[ServedModel], socket.socket]:
    """--takeover (docs/protocol.md §4.10): the running daemon's models (adopted slabs) and its listening
    socket, then its lock. The running daemon stops only once this one has adopted every model and said so
    (TAKEOVER_ADOPTED, answered by TAKEOVER_DONE); whatever fails before that — a refusal, a TAKEOVER_STATE
    over ``max_frame_size`` or one this side's decoder refuses, a slab it cannot adopt, a running daemon that keeps
    its models with another keeper than ``keeper`` (this one's ``--keeper`` socket, None: none) — raises here (the
    daemon exits with that error) and leaves the running daemon serving, holding its lock."""
    import asyncio

    t0 = time.perf_counter()
    try:
        pid, models, listener = asyncio.run(_take_over(sock_path, backend, max_frame_size, keeper))
    except WCacheError as exc:
        raise type(exc)(
            f"--takeover {sock_path}: {exc.message} (nothing was taken over: the running daemon serves on)",
            details=exc.details,
        ) from exc
    try:
        lock.acquire(wait=10.0)  # the old daemon releases it right after TAKEOVER_DONE
    except BaseException:
        for m in models:
            m.close()
        listener.close()
        raise
    log.info(
        "took over socket=%s from pid=%d models=%d bytes=%d seconds=%.3f",
        sock_path,
        pid,
        len(models),
        sum(m.slab_bytes for m in models),
        time.perf_counter() - t0,
    )
    return models, listener


async def _take_over(
    sock_path: Path, backend: Backend, max_frame_size: int, keeper: Path | None = None, timeout: float = 60.0
) -> tuple[int, list[ServedModel], socket.socket]:
    """TAKEOVER, adopt everything TAKEOVER_STATE hands over, TAKEOVER_ADOPTED, TAKEOVER_DONE; on any failure
    the adopted slabs and the listener are closed and the connection with them (the old daemon serves on)."""
    import asyncio

    from wcache.channel import close_fds, connect, expect
    from wcache.proto import Takeover, TakeoverAdopted, TakeoverDone, TakeoverState

    async with asyncio.timeout(timeout):
        ch, _ = await connect(
            sock_path,
            software=f"wcache/{__version__}",
            name="wcache-server --takeover",
            max_frame_size=max_frame_size,
        )
        try:
            request = Takeover(
                id=ch.conn.next_request_id(),
                backend=backend.name,
                device_uuid=backend.device.uuid,
                pid=os.getpid(),
                max_frame_size=max_frame_size,
            )
            await ch.send(request)
            state, fds = await expect(ch)
            assert isinstance(state, TakeoverState)  # the transition table admits nothing else
            mine = str(keeper) if keeper is not None else ""
            if state.keeper != mine:  # its keeper holds these slabs: this daemon could neither free nor reclaim them
                close_fds(fds)
                raise WCacheError(
                    f"the running daemon keeps its models with the keeper at {state.keeper}: start this one with "
                    f"--keeper {state.keeper}"
                    if state.keeper
                    else f"the running daemon keeps its models with no keeper, this one with {mine}: start it "
                    "without --keeper (a model handed over is not held by that keeper)"
                )
            try:
                listener = socket.socket(fileno=os.dup(fds[state.listener_fd]))
            except BaseException:
                close_fds(fds)
                raise
            models: list[ServedModel] = []
            try:
                models = adopt(state.models, fds, backend)  # closes the listener's original fd with the unused ones
                for m in models:
                    m.origin = "takeover"  # STATUS: handed over by the old daemon
                await ch.send(TakeoverAdopted(id=ch.conn.next_request_id(), models=len(models), pid=os.getpid()))
                done, _ = await expect(ch)
                assert isinstance(done, TakeoverDone)
            except BaseException:
                for m in models:
                    m.close()
                listener.close()
                raise
        finally:
            ch.close()
    return state.pid, models, listener


def _keeper_holds_some(args: argparse.Namespace, sock_path: Path) -> bool:
    """Whether a keeper (``--keeper``) holds models of this rank (STATUS, 0.5 s at most): then start-up
    reclaims them without torch; otherwise this daemon loads, and its backend sets loads up first."""
    if args.keeper is None:
        return False
    import asyncio

    from wcache.keeper_probe import keeper_kept
    from wcache.paths import KEEPER_SOCKET

    kpath = Path(args.keeper) if args.keeper else sock_path.parent / KEEPER_SOCKET
    return asyncio.run(keeper_kept(kpath, args.tp_rank, owner=sock_path)) > 0


def restorer(
    tier: HostTier, store: Store, backend: Backend, args: argparse.Namespace
) -> Callable[[TierEntry, WeightCacheKey], ServedModel | None]:
    """How the daemon fills a slab from a host-tier entry (a deposit asked for again): the loader's threads
    (the staging is the backend's); the checkpoint directory is the one the store knows for the key's
    fingerprint."""

    from wcache.server.load import load_from_tier

    def restore(entry: TierEntry, key: WeightCacheKey) -> ServedModel | None:
        return load_from_tier(tier, entry, key, backend, args.threads, store.source_for(key.to_wire()))

    return restore


def reclaim(
    link: KeeperLink, backend: Backend, plan_file: Path | None = None, tier: HostTier | None = None
) -> list[ServedModel]:
    """--keeper: the models the keeper holds for this daemon's socket that pass the checks against their
    checkpoint (wcache/server/reclaim.py) and, for a deposit, against the generation ``tier`` records, adopted;
    none if it is not running."""
    import asyncio

    from wcache.server.reclaim import admit

    t0 = time.perf_counter()
    try:
        state, fds = asyncio.run(link.reclaim())
    except (WCacheError, OSError, TimeoutError) as exc:
        log.warning("keeper %s: nothing reclaimed (%s); loading as usual", link.path, exc)
        return []
    models, stale = admit(link, state, fds, backend, adopt, plan_file=plan_file, tier=tier)  # one bad model drops alone
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
    ``--verify-content`` name: the one description the daemon plans, keys and loads (wcache.plan.key); also what
    ``wcache preload`` / ``evict DIR`` name (``model`` their directory)."""
    from wcache.plan.key import RankSpec

    return RankSpec(
        Path(args.model),
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        dtype=args.dtype,
        plan_file=args.shard_plan,
        transform=args.transform or "",
        verify_content=getattr(args, "verify_content", False),  # wcache preload / evict: the daemon's policy
    )


def _fill_config(args: argparse.Namespace) -> FillConfig:
    from wcache.server.fill import FillConfig, resolve_peers

    return FillConfig(
        tuple(resolve_peers(args.fill_from)),
        args.peer_security,
        f"wcache/{__version__}",
        timeout=args.fill_timeout,
        verify_content=args.verify_content,
    )


def fetch_checkpoint_files(args: argparse.Namespace, root: Path) -> None:
    """--fill-from with a --model directory holding no weights, or a fill of a peer's files cut short (a crash or
    a full disk part way: ``fill_incomplete``): the checkpoint's small files and safetensors stubs from a peer
    (docs/fleet.md, "A node without the checkpoint"); a directory with weights is left alone. Without them there
    is nothing to load from disk either: the CheckpointError says why."""
    import asyncio

    from wcache.errors import FillError
    from wcache.peer_files import fill_incomplete
    from wcache.plan.checkpoint import INDEX_NAME
    from wcache.server.fill import fetch_files

    cut_short = fill_incomplete(root)
    if (any(root.glob("*.safetensors")) or (root / INDEX_NAME).exists()) and not cut_short:
        return
    key: dict[str, str | int] = {"fingerprint": args.fill_fingerprint} if args.fill_fingerprint else {}
    try:
        asyncio.run(fetch_files(root, _fill_config(args), key))
    except FillError as exc:
        what = "holds a fill of a peer's files cut short" if cut_short else "holds no weights"
        raise CheckpointError(
            f"{root} {what} and no peer sent the checkpoint's files ({exc.details.get('reason')}: {exc.message})"
        ) from exc


def peer_fill(args: argparse.Namespace, backend: Backend) -> PeerFill:
    """--fill-from: what fills this daemon's slabs from its peers, at start and on demand (wcache/server/fill.py)."""
    from wcache.server.fill import PeerFill

    return PeerFill(_fill_config(args), backend, spec=args.fill_from)


def fill_from_peers(
    args: argparse.Namespace,
    rp: RankPlan,
    filler: PeerFill,
    tier: HostTier | None,
    outcomes: list[tuple[str, int, float]],
    room: Callable[[int], None] | None = None,
) -> ServedModel | None:
    """--fill-from at start: the rank's slab from the peers, or None for the loader — this node's host tier
    holds the key (refilled from there, the peers not asked), or after one log line naming the reason, the disk
    path. A directory of stubs whose key is not --fill-fingerprint is refused. ``room(bytes)``: room beyond the
    planned layout for a transformed key's larger slab (``PeerFill.rank``)."""
    from wcache.server.tier import tier_holds

    if args.fill_fingerprint and rp.key.fingerprint != args.fill_fingerprint:
        raise CheckpointError(
            f"{rp.spec.checkpoint}: its key's fingerprint is {rp.key.fingerprint}, not --fill-fingerprint "
            f"{args.fill_fingerprint}: refusing to serve another checkpoint"
        )
    if tier_holds(tier, rp.key):
        return None
    filled = filler.rank(rp, "loading from disk", room)
    outcomes.append(filled.outcome)
    return filled.model


def metrics_listener(port: int) -> socket.socket:
    """--metrics-port's listening socket, bound before anything is loaded: a port in use (another process, any
    local user, holds it) fails the start with one line and nothing loaded for nothing. After a --takeover the
    old daemon holds the port until it stops: the new one binds it once serving (``Daemon._metrics_later``)."""
    from wcache.server.metrics import listen_metrics

    try:
        return listen_metrics(port)
    except OSError as exc:
        held = "another process holds it: " if exc.errno == errno.EADDRINUSE else ""
        raise WCacheError(
            f"--metrics-port {port}: cannot listen on 127.0.0.1:{port} ({exc.strerror or exc}); "
            f"{held}pick another port, or 0 for no metrics"
        ) from None


def peer_listener(args: argparse.Namespace, store: Store, metrics: Metrics) -> PeerListener:
    """--peer-listen: the peer channel's handler and listener (started by the daemon once it serves)."""
    from wcache.server.peer import PeerListener, PeerService

    service = PeerService(
        store,
        args.peer_security,
        software=f"wcache/{__version__}",
        max_fills=args.peer_max_fills,
        max_rate=args.peer_max_rate,
        metrics=metrics,
    )
    host, port = args.peer_listen
    return PeerListener(service, host, port, metrics=metrics)


def started_model(store: Store, started: WeightCacheKey | None) -> ServedModel | None:
    """The model the daemon was started for (``started``: --model's key), not whichever the keeper handed back
    first (it hands back every model it held for this socket: another --tp-size's, a PRELOAD's); else the first
    served, or None."""
    m = store.models.get(started) if started is not None else None
    return m if m is not None else next(iter(store.models.values()), None)


def ready_fields(sock_path: Path, store: Store, m: ServedModel | None) -> dict[str, object]:
    """The fields of the daemon's ready log line, in order: its socket and device; the key of ``m``
    (``started_model``) and how its bytes came (seconds, read rate: 0 for slabs handed over or reclaimed); then
    every model served together (after a keeper reclaim, several): how many, their tensors and their slab bytes,
    and the --memory-budget."""
    backend = store.backend
    return {
        "socket": sock_path,
        "backend": backend.name,
        "device": backend.device.uuid or backend.device.kind,
        "key": m.key.short() if m else "-",
        "load_s": f"{m.stats.seconds if m else 0.0:.2f}",
        "read_gb_s": f"{m.stats.gb_per_s if m else 0.0:.2f}",
        "models": len(store.models),
        "tensors": sum(len(x.table) for x in store.models.values()),
        "bytes": store.resident_bytes,
        "budget": store.budget if store.budget is not None else "none",
    }


def write_ready(path: Path, payload: dict[str, object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload) + "\n")
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> int:
    from wcache.plan.rank import plan_rank
    from wcache.server.daemon import Daemon
    from wcache.server.load import load_model
    from wcache.server.service import ConnectionLimits
    from wcache.server.store import Store

    if args.takeover is not None:
        sock_path = Path(os.path.abspath(args.takeover))
        check_private_dir(sock_path.parent)
    else:
        sock_path = resolve_socket(args)
    hold = hold_socket_dir(sock_path.parent)
    lock = DaemonLock(sock_path)
    workers: Workers | None = None
    try:
        if args.model is not None and args.fill_from is None:  # (--fill-from fetches a missing one from a peer)
            from wcache.plan.checkpoint import check_directory

            check_directory(args.model)  # a mistyped --model is named as such, not as the lock of a daemon running
        backend = make_backend(args.device, args.cuda_export, args.staging_bytes or DEFAULT_STAGING)
        loads = args.takeover is None and not _keeper_holds_some(args, sock_path)
        backend.check_device(loads)  # an unusable device: one line, before the lock is taken or a file read
        if args.takeover is None:
            lock.acquire()
    except BaseException:
        hold.release()
        raise
    metrics_sock: socket.socket | None = None
    try:
        if args.metrics_port and args.takeover is None:  # a port in use fails the start, before any load
            metrics_sock = metrics_listener(args.metrics_port)
        if loads:  # set loads up first (CudaBackend.prepare_loads says why)
            backend.prepare_loads()
        backend.check_platform()
        tier = None
        if args.host_tier > 0:  # before a takeover: from TAKEOVER_DONE on, a failure here would lose the models
            from wcache.server.tier import HostTier, default_tier_dir

            # --verify-content: no refill by one DMA copy (the one way that checks only sampled blocks, tier.py)
            pin = None if args.verify_content else backend.pinner()
            tier = HostTier(args.host_tier_dir or default_tier_dir(), args.host_tier, pin=pin)
        handed: list[ServedModel] = []
        listener = None
        kpath: Path | None = None
        if args.keeper is not None:
            from wcache.paths import KEEPER_SOCKET

            kpath = Path(os.path.abspath(Path(args.keeper) if args.keeper else sock_path.parent / KEEPER_SOCKET))
        if args.takeover is not None:
            handed, listener = take_over(sock_path, backend, lock, args.max_frame_size, kpath)

        def planner(spec: RankSpec) -> RankPlan:
            with checkpoint_errors(str(spec.checkpoint)):
                return plan_rank(spec)

        def loader(rp: RankPlan, room: Callable[[int], None]) -> ServedModel:
            with checkpoint_errors(str(rp.spec.checkpoint)):
                return load_model(
                    rp,
                    backend=backend,
                    threads=args.threads,
                    io=args.io,
                    tier=tier,
                    room=room,
                )

        link: KeeperLink | None = None
        reclaimed: list[ServedModel] = []
        if kpath is not None:
            from wcache.server.keeper_link import KeeperLink

            link = KeeperLink(kpath, owner=sock_path, backend=backend.name, device_uuid=backend.device.uuid)
            if args.takeover is None:  # after a takeover the keeper already holds what was handed over
                reclaimed = handed = reclaim(link, backend, args.shard_plan, tier)
        store = Store(backend, handed, budget=args.memory_budget or None)
        filler = peer_fill(args, backend) if args.fill_from is not None else None
        fill_outcomes: list[tuple[str, int, float]] = []  # (reason or "", bytes, seconds) of each fill: metrics
        try:
            if store.budget is not None and store.resident_bytes > store.budget:  # a lowered --memory-budget
                drop(store.make_room(0, models=0), link, "budget")
            started: WeightCacheKey | None = None  # the --model's key: the one the ready line names
            if args.model is not None:
                spec = rank_spec(args)
                if args.fill_from is not None:
                    fetch_checkpoint_files(args, spec.checkpoint)
                with planner(spec) as rp:
                    started = rp.key
                    store.prove_later(spec, rp.facts, rp.proof_after_ns)  # files too fresh: planned again later
                    held = store.models.get(rp.key)
                    if held is not None:
                        store.remember_source(held, spec.checkpoint)
                        log.info(
                            "serving key=%s bytes=%d from the keeper: nothing loaded", rp.key.short(), held.slab_bytes
                        )
                    else:
                        with store.loading(rp.layout.total_bytes) as evicted:
                            drop(evicted, link, "load")

                            beyond_evicted: list[ServedModel] = []

                            def beyond(n: int) -> None:  # a slab beyond the plan (a transform's output) gets room too
                                # called inside the fill's event loop: the keeper is told after it (``drop`` runs one)
                                beyond_evicted.extend(store.make_room(n, models=0))

                            try:
                                filled = (
                                    fill_from_peers(args, rp, filler, tier, fill_outcomes, beyond)
                                    if filler is not None
                                    else None
                                )
                            finally:
                                drop(beyond_evicted, link, "load")
                                beyond_evicted.clear()
                            if filled is None:
                                filled = loader(rp, lambda n: drop(store.make_room(n, models=0), link, "load"))
                            store.add(filled)
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
                limits=ConnectionLimits(
                    max_frame_size=args.max_frame_size,
                    idle_timeout=args.idle_timeout or None,
                    frame_timeout=args.frame_timeout,
                ),
                metrics_port=args.metrics_port,
                metrics_listener=metrics_sock,
                deposit_timeout=args.deposit_timeout or None,
                loader=loader,
                planner=planner,
                verify_content=args.verify_content,
                load_on_demand=args.load_on_demand,
                listener=listener,
                on_handover=lock.release,
                tier=tier,
                keeper=link,
                keeper_check=args.keeper_check,
                tier_restore=restorer(tier, store, backend, args) if tier is not None else None,
                peer_fill=filler,
            )
            for reason, nbytes, seconds in fill_outcomes:
                daemon.metrics.observe_fill(reason, nbytes, seconds)
            if args.peer_listen is not None:
                daemon.peers = peer_listener(args, store, daemon.metrics)

            def ready() -> None:
                m = started_model(store, started)
                log.info("ready %s", " ".join(f"{k}={v}" for k, v in ready_fields(sock_path, store, m).items()))
                if args.ready_file is not None:
                    payload: dict[str, object] = {
                        "socket": str(sock_path),
                        "pid": os.getpid(),
                        "key": m.key.to_wire() if m else None,
                    }
                    if daemon.peers is not None:  # the peer channel's address (a port 0 is chosen at bind)
                        payload["peer"] = f"{daemon.peers.host}:{daemon.peers.port}"
                    write_ready(args.ready_file, payload)
                # systemd (Type=notify): started once the socket serves, not when the process was forked
                notify(
                    READY=1,
                    MAINPID=os.getpid(),
                    STATUS=f"serving {len(store.models)} model(s) on {sock_path}",
                )

            def stopping() -> None:
                notify(STOPPING=1, STATUS=f"stopping: draining {sock_path}")

            import asyncio

            import uvloop

            workers = Workers()

            async def serve() -> None:
                asyncio.get_running_loop().set_default_executor(workers)  # asyncio.to_thread's: the loads
                await daemon.serve(ready, on_stopping=stopping)

            uvloop.run(serve())
        finally:
            store.close()
            if tier is not None:
                tier.close()
    finally:
        if metrics_sock is not None:  # (a no-op once the daemon's server has served and closed it)
            metrics_sock.close()
        lock.release()  # a clean stop leaves neither the lock file nor (the default one, if empty) the directory
        hold.release()
    if workers is not None and workers.busy:
        # a stop does not wait for a load in a worker thread (a PRELOAD's, a load on demand: minutes for a big
        # checkpoint, forever for a read that never returns) while the lock would keep a new daemon out: the lock
        # is released above, and the process ends without joining the thread (its model was never served)
        log.warning("stopped with %d load(s) still running in a worker thread: not waiting for them", workers.busy)
        logging.shutdown()
        os._exit(0)
    return 0


class Workers(ThreadPoolExecutor):
    """The event loop's default executor (``asyncio.to_thread``), whose shutdown does not wait for its threads:
    ``busy`` counts the calls still running then (``run`` exits past them)."""

    def __init__(self) -> None:
        super().__init__(thread_name_prefix="wcache-worker")
        self._running: set[Future[Any]] = set()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future = super().submit(fn, *args, **kwargs)
        self._running.add(future)
        future.add_done_callback(self._running.discard)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=True)

    @property
    def busy(self) -> int:
        return len(self._running)
