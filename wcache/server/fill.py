"""The target side of a fleet fill (docs/fleet.md, "A fill, step by step"): ask the peers for the key, plan which
bytes to READ from which (wcache/plan/reshard.py), READ them with NIXL straight into a new slab, verify, seal — or
raise FillError, having freed the half-filled slab and released everything it held.

Nothing here serves: ``fill`` returns a ``ServedModel`` the daemon adds to its store like a loaded one (origin
``peer ADDR[ +N]``), or the FillError whose reason the daemon logs before it loads from disk. ``PeerFill`` is
what a daemon started with ``--fill-from`` calls, at start and on demand (PRELOAD, a load on demand, a GET_STATE
of a recipe key it does not hold): one blocking fill per call, on an event loop and a NIXL agent of its own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from wcache.errors import (
    CacheUnavailableError,
    CheckpointError,
    FillError,
    LimitExceededError,
    NotFoundError,
    OutOfMemoryError,
    PermissionDeniedError,
    ProtocolError,
    RemoteProtocolError,
    WCacheError,
)
from wcache.plan.checkpoint import SAMPLE_BLOCK, Checkpoint, _sample_offsets
from wcache.plan.key import WeightCacheKey
from wcache.plan.layout import Layout
from wcache.plan.rank import RankPlan
from wcache.plan.reshard import DEFAULT_CHUNK, Copy, plan_fill, plan_same
from wcache.proto import DTYPE_SIZES, Frame, Release
from wcache.proto.fleet_frames import PeerModel, PeerOffer, PeerQuery, PeerRead, PeerReadOk
from wcache.server.agent_process import AgentProcess, RemoteTransfer
from wcache.server.backends.base import Backend, MemoryRegion, Slab
from wcache.server.loader import LoadStats
from wcache.server.nixl import Agent, Transfer
from wcache.server.peer_auth import PeerSecurity
from wcache.server.peer_channel import GRANT_SECONDS, MIN_GRANT, StreamChannel, connect_peer, parse_address
from wcache.server.reads import placement_extents
from wcache.server.store import ServedModel

__all__ = [
    "MIN_GRANT",
    "Deadline",
    "FillConfig",
    "Filled",
    "PeerFill",
    "batches",
    "check_sampled_blocks",
    "deadline_for",
    "fetch_files",
    "fill",
    "grant_bytes",
    "resolve_peers",
]

log = logging.getLogger("wcache.fleet")

#: slabs of failed fills that a NIXL agent may still map (it could not deregister them): held, never freed, for the
#: daemon's life — freed, a CUDA IPC slab would go back to torch's allocator, and a later model's memory could be
#: written through that mapping
KEPT: list[Slab] = []

#: dim-1 shards go as NIXL's strided lists (benchmarks/fleet_fill_bench.py, "strided"; docs/fleet.md)
STRIDED = True

#: grants a target has asked for and not yet used, per source (``_pull``)
AHEAD = 2
#: the fills a source's cap is taken to be shared by when its offer does not say (``--peer-max-fills``'s default)
ASSUMED_FILLS = 4


def grant_bytes(max_rate: int, chunk: int) -> int:
    """Bytes per PEER_READ from a source whose cap is ``max_rate`` bytes/s (0: none, ``chunk``, a batch)."""
    if max_rate <= 0:
        return chunk
    return max(1, min(chunk, max(MIN_GRANT, int(max_rate * GRANT_SECONDS))))


def resolve_peers(spec: str) -> list[tuple[str, int]]:
    """``HOST:PORT[,HOST:PORT...]``, or ``dns:NAME:PORT``: every address NAME resolves to (a headless Service's
    pods), in the resolver's order, each once. ValueError for a malformed spec; an unresolvable name gives []."""
    if spec.startswith("dns:"):
        host, port = parse_address(spec[4:])
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            return []
        out: list[tuple[str, int]] = []
        for info in infos:
            addr = (str(info[4][0]), port)
            if addr not in out:
                out.append(addr)
        return out
    return [parse_address(p.strip()) for p in spec.split(",") if p.strip()]


@dataclass(frozen=True)
class FillConfig:
    peers: tuple[tuple[str, int], ...]
    security: PeerSecurity
    software: str
    #: connecting, TLS and the proofs, per peer
    connect_timeout: float = 5.0
    #: the whole fill must be done by this many seconds plus its bytes at ``min_rate``, or at what a capped source's
    #: ``max_rate`` gives it where that is slower (``deadline_for``; else reason ``deadline``); and every grant
    #: must come within this many seconds (plus what a shared cap makes it wait)
    timeout: float = 30.0
    min_rate: float = 50e6
    #: a capped source whose share of a fill would take longer than this at its whole ``max_rate`` is not waited
    #: for: the fill is refused before it starts (reason ``deadline``, naming the cap)
    max_capped_seconds: float = 3600.0
    chunk: int = DEFAULT_CHUNK
    #: compare every byte with the local checkpoint (``--verify-content``)
    verify_content: bool = False
    #: 64 random ranges compared with the local checkpoint files (when the target has real ones)
    samples: int = 64


class _Grants:
    """A source's channel during a fill, shared by the pulls of its leases (a peer holding several slabs of one
    fill: a TP=1 target filled from one peer's TP=2 ranks): one PEER_READ sent at a time, and one reader routing
    each PEER_READ_OK to the pull of its lease (the source answers in order, so each lease's grants come in
    order). Before, each pull awaited the channel's next frame itself: the second pull's wait replaced the
    first's, grants went to the pull of another lease, and the fill waited until ``--fill-timeout`` and loaded
    from disk. A failure of the channel (an ERROR, EOF) fails every pull of the source."""

    def __init__(self, ch: StreamChannel) -> None:
        self.ch = ch
        self._sending = asyncio.Lock()
        self._queues: dict[int, asyncio.Queue[PeerReadOk | BaseException]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def ask(self, lease: int, nbytes: int) -> None:
        self._queues.setdefault(lease, asyncio.Queue())
        async with self._sending:  # a frame's bytes are not interleaved with another pull's
            await self.ch.send(PeerRead(id=self.ch.conn.next_request_id(), lease=lease, bytes=nbytes))
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())

    async def next(self, lease: int) -> PeerReadOk:
        got = await self._queues[lease].get()
        if isinstance(got, BaseException):
            raise got
        return got

    async def _read(self) -> None:
        from wcache.channel import expect

        try:
            while True:
                ok, _ = await expect(self.ch)
                queue = self._queues.get(ok.lease) if isinstance(ok, PeerReadOk) else None
                if queue is None or not isinstance(ok, PeerReadOk):
                    raise RemoteProtocolError(f"{ok.TYPE} answered a PEER_READ of this fill's leases")
                queue.put_nowait(ok)
        except BaseException as exc:
            for queue in self._queues.values():
                queue.put_nowait(exc)
            if not isinstance(exc, Exception):  # a cancellation (close), KeyboardInterrupt, SystemExit
                raise

    async def close(self) -> None:
        """Stop the reader (every grant asked for has come, or the fill failed)."""
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


@dataclass
class _Source:
    addr: str
    ch: StreamChannel
    offer: PeerOffer | None = None
    agent_name: str | None = None
    leases: set[int] = field(default_factory=set)
    #: the fill's PEER_READs and their grants on ``ch`` (every pull of this source's leases)
    grants: _Grants | None = None


@dataclass(frozen=True)
class Deadline:
    """How long one source's share of a fill may take: ``seconds`` from the start of its READs, each grant within
    ``stall`` seconds of the wait for it beginning; ``terms``: how ``seconds`` was reckoned (its error names it)."""

    seconds: float
    stall: float
    terms: str


def deadline_for(addr: str, nbytes: int, total: int, offer: PeerOffer, cfg: FillConfig) -> Deadline:
    """The deadline of a source's ``nbytes`` of a fill of ``total`` bytes: ``--fill-timeout`` plus the fill's bytes
    at ``min_rate`` (50 MB/s), as always — or, from a source whose offer names a ``max_rate`` that makes its share
    slower, ``--fill-timeout`` plus its share at that rate divided among the ``max_fills`` fills the cap may be
    shared by (ASSUMED_FILLS where the offer does not say): the time the cap needs at worst, but never more than
    ``max_capped_seconds`` (what the offer says is the peer's word: a peer announcing a million fills would hold
    the fill for ever). FillError (reason ``deadline``) up front when the share would take over
    ``max_capped_seconds`` even at the whole cap.

    Each grant (``stall``) must come within ``--fill-timeout`` plus its turn behind the other fills' grants at the
    cap (AHEAD grants of each of ``max_fills``), that turn at most ``--fill-timeout`` itself: a stall is never
    more than twice ``--fill-timeout``, whatever the offer says. Before, the turn followed ``max_fills`` and
    ``max_rate`` unbounded, up to the whole deadline: a source announcing a million fills that stopped granting
    held the fill (and a daemon's PRELOAD lock) an hour. The price: an honest source whose grants are shared by
    so many fills that one waits longer than ``--fill-timeout`` for its turn (at the default 30 s, some 1500 fills
    at 10 ms grains, some 230 at a 1 MB/s cap's 64 KiB ones) fails fills it would have served."""
    floor = cfg.timeout + total / cfg.min_rate
    terms = f"--fill-timeout {cfg.timeout:g} s + {total} bytes at {cfg.min_rate / 1e6:g} MB/s"
    if offer.max_rate <= 0:
        return Deadline(floor, cfg.timeout, terms)
    alone = nbytes / offer.max_rate
    cap = f"peer {addr}'s --peer-max-rate {offer.max_rate} bytes/s"
    if alone > cfg.max_capped_seconds:
        raise FillError(
            f"{nbytes} bytes of this fill at {cap} would take {alone:.0f} s even with the cap to themselves, over "
            f"the {cfg.max_capped_seconds:g} s a fill waits for a capped source: not started",
            details={"reason": "deadline", "peer": addr, "max_rate": offer.max_rate},
        )
    fills = offer.max_fills or ASSUMED_FILLS
    capped = cfg.timeout + min(alone * fills, cfg.max_capped_seconds)
    # a grant waits for those asked before it: this fill's AHEAD and as many of each other fill sharing the cap —
    # at most --fill-timeout of them (the offer's max_fills and max_rate are the peer's word)
    turn = min(AHEAD * fills * grant_bytes(offer.max_rate, cfg.chunk) / offer.max_rate, cfg.timeout)
    stall = min(capped, cfg.timeout + turn)
    if capped <= floor:
        return Deadline(floor, stall, f"{terms} ({cap})")
    terms = f"--fill-timeout {cfg.timeout:g} s + {nbytes} bytes at {cap}, shared by up to {fills} fills"
    if alone * fills > cfg.max_capped_seconds:
        terms += f", at most {cfg.max_capped_seconds:g} s"
    return Deadline(capped, stall, terms)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, FillError):
        return str(exc.details.get("reason", "fill"))
    if isinstance(exc, CacheUnavailableError):
        return "no-peer"
    if isinstance(exc, ssl.SSLError | PermissionDeniedError):
        return "auth"
    if isinstance(exc, NotFoundError):
        return "not-found"
    if isinstance(exc, OutOfMemoryError):
        return "room"
    if isinstance(exc, LimitExceededError | ProtocolError):
        return "refused"
    if isinstance(exc, TimeoutError):
        return "deadline"
    return "transfer"


async def _connect(addr: tuple[str, int], cfg: FillConfig) -> _Source:
    ch, _ = await connect_peer(*addr, cfg.security, timeout=cfg.connect_timeout, software=cfg.software, name="fill")
    return _Source(f"{addr[0]}:{addr[1]}", ch)


async def _request(src: _Source, frame: Frame, timeout: float) -> object:
    from wcache.channel import expect

    await src.ch.send(frame)
    reply, _ = await asyncio.wait_for(expect(src.ch), timeout)
    return reply


def _source_layout(model: PeerModel, key: WeightCacheKey, rp: RankPlan) -> Layout | str:
    """The layout of an offered slab, as the target's planner computes it from the headers; else why the offer
    is of no use (a layout it cannot plan, or an offered table that is not that layout's)."""
    mk = model.key
    if not key.diff_wire(dict(mk)):
        src = rp.layout
    else:
        tp_rank, tp_size, plan = mk.get("tp_rank"), mk.get("tp_size"), mk.get("plan", "none")
        if not isinstance(tp_rank, int) or not isinstance(tp_size, int) or not isinstance(plan, str):
            return "its key names no tp_rank, tp_size and plan"
        other = rp.layout_of(tp_rank, tp_size, plan)
        if other is None:
            return f"this checkpoint has no layout rank {tp_rank} of {tp_size} under plan {plan!r}"
        src = other
    if model.size != src.total_bytes or list(model.tensors) != list(src.table()):
        return f"its size ({model.size} bytes) or tensor table is not that of the layout its key names"
    return src


def _skipped(src: _Source, model: PeerModel, why: str) -> None:
    """One offered slab the fill does not use (the others may still fill it): one line naming the peer."""
    log.info("peer offer skipped peer=%s lease=%d: %s", src.addr, model.lease, why)


async def fill(
    key: WeightCacheKey,
    rp: RankPlan | None,
    backend: Backend,
    agent: Agent | AgentProcess,
    cfg: FillConfig,
    *,
    room: Callable[[int], None] | None = None,
) -> ServedModel:
    """Fill a slab for ``key`` from the peers in ``cfg``. ``rp``: the key's rank planned from its checkpoint (local
    files or peer stubs), whose planner gives the layouts of the offered slabs to reshard from; or None for a
    same-layout fill (a deposit's recipe key, a transformed layout): the offered slab is then copied byte for byte
    with its table. ``room``: called with the slab's size before it is allocated (a same-layout fill learns it
    from the offer), to make room or raise. FillError on any failure, with nothing left allocated or held."""
    layout, ckpt = (rp.layout, rp.checkpoint) if rp is not None else (None, None)
    t0 = time.perf_counter()
    if not cfg.peers:
        raise FillError("no peer to fill from", details={"reason": "no-peer"})
    results = await asyncio.gather(*(_connect(a, cfg) for a in cfg.peers), return_exceptions=True)
    sources = [r for r in results if isinstance(r, _Source)]
    failures = [r for r in results if isinstance(r, BaseException)]
    slab: Slab | None = None
    reg = None
    try:
        if not sources:
            why = _reason(failures[0]) if failures else "no-peer"
            what = "no peer admitted this daemon" if why == "auth" else "no peer answered"
            raise FillError(f"{what}: {failures[0] if failures else 'none'}", details={"reason": why})
        want = key.to_wire()
        offers = await asyncio.gather(
            *(_request(s, PeerQuery(id=s.ch.conn.next_request_id(), key=want), cfg.connect_timeout) for s in sources),
            return_exceptions=True,
        )
        usable: list[tuple[_Source, PeerModel, Layout | None]] = []
        refusals: list[BaseException] = []
        for s, o in zip(sources, offers):
            if isinstance(o, BaseException):
                refusals.append(o)
                continue
            assert isinstance(o, PeerOffer)
            s.offer = o
            s.leases = {m.lease for m in o.models}
            for m in o.models:
                if rp is None:
                    if not key.diff_wire(dict(m.key)):
                        usable.append((s, m, None))
                    else:
                        _skipped(s, m, "a same-layout fill takes only a slab under exactly its key")
                    continue
                try:
                    src = _source_layout(m, key, rp)
                except WCacheError as exc:  # the planner refusing what the peer named: of no use, as above
                    src = exc.message
                if isinstance(src, str):
                    _skipped(s, m, src)
                else:
                    usable.append((s, m, src))
        if not usable:
            why = _reason(refusals[0]) if refusals and len(refusals) == len(sources) else "not-found"
            raise FillError(
                f"no peer holds a slab that fills {key.short()}" + (f" ({refusals[0]})" if refusals else ""),
                details={"reason": why},
            )
        if layout is None:
            first = usable[0][1]
            total = first.size
            # a deposit's recipe key: another node's deposit under it may be another generation (other bytes, the
            # same size and table), so the slab is one peer's, not stripes of several; a transformed layout: the same
            # bytes wherever the same key and table are served
            deposit = "engine" in want
            usable = usable[:1] if deposit else [u for u in usable if _same_slab(u[1], first)]
            plan = plan_same(total, len(usable), chunk=cfg.chunk)
        else:
            total = layout.total_bytes
            plan = plan_fill(layout, [u[2] for u in usable if u[2] is not None], chunk=cfg.chunk)
        deadlines = {  # before anything is allocated or asked for: a cap too slow refuses the fill here
            k: deadline_for(s.addr, n, plan.nbytes, s.offer, cfg)
            for k, ((s, _, _), n) in enumerate(zip(usable, plan.per_source))
            if n and s.offer is not None
        }
        if room is not None:
            try:
                room(total)
            except WCacheError as exc:
                raise FillError(f"no room for {total} bytes: {exc.message}", details={"reason": "room"}) from exc
        slab = backend.allocate(total)
        reg = agent.register_slab(slab)
        region = reg.region
        start = time.monotonic()
        jobs: list[Callable[[], Coroutine[Any, Any, int]]] = []
        for k, (s, m, _) in enumerate(usable):
            copies = plan.for_source(k)
            if not copies:
                continue
            if s.agent_name is None:
                assert s.offer is not None
                s.agent_name = agent.add_peer(s.offer.agent)
            remote = MemoryRegion(m.address, m.size, m.memory, m.device)
            assert s.offer is not None
            grant = grant_bytes(s.offer.max_rate, cfg.chunk)
            dl = deadlines[k]
            if s.grants is None:
                s.grants = _Grants(s.ch)
            jobs.append(functools.partial(_pull, agent, s, m.lease, copies, region, remote, grant, start, dl))
        done = await _all_or_none(jobs)
        agent.deregister(reg)
        reg = None
        # every READ landed: the sources' leases (a --peer-max-fills slot each, and what keeps a slab the source
        # evicted in its memory) go back now, not after the verification, which reads this node's checkpoint
        # (the whole rank with --verify-content: minutes on a large one)
        await _let_go(sources)
        first = usable[0][1]
        if layout is not None and ckpt is not None:
            _verify(slab, layout, ckpt, cfg)
        slab.seal()
        seconds = time.perf_counter() - t0
        used = sorted({u[0].addr for k, u in enumerate(usable) if plan.per_source[k]})
        buffers: tuple[str, ...] = ()
        if layout is not None:
            table, aliases, payload = layout.table(), dict(layout.aliases), layout.payload_bytes
        else:
            table, aliases, payload, buffers = first.tensors, dict(first.aliases), first.payload, first.buffers
        table.encoded()
        model = ServedModel(
            key,
            table,
            aliases,
            [slab],
            backend,
            payload,
            LoadStats(done, total, seconds, done),
            source=ckpt.path if ckpt is not None else None,
            origin=_origin(used),
            buffers=buffers,
        )
        log.info(
            "filled from peers key=%s peers=%s bytes=%d seconds=%.3f gb_s=%.2f register_s=%.4f resharded=%s",
            key.short(),
            ",".join(used),
            done,
            seconds,
            done / seconds / 1e9 if seconds else 0.0,
            agent_register_seconds(usable),
            any(u[2] is not layout for u in usable) if layout is not None else False,
        )
        slab = None  # the model owns it now
        return model
    except FillError:
        raise
    except BaseException as exc:
        if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
            raise
        raise FillError(f"{type(exc).__name__}: {exc}", details={"reason": _reason(exc)}) from exc
    finally:
        freed = True
        if reg is not None:
            # nothing writes into the slab after this (a child agent that cannot say so is killed)
            try:
                agent.deregister(reg)
            except Exception as exc:  # UCX may still hold the slab (an in-process agent, a child stuck in the kernel)
                freed = False
                if slab is not None:
                    KEPT.append(slab)
                log.error(
                    "fill key=%s: NIXL could not deregister the slab (%s); keeping it (%d bytes) for the daemon's life",
                    key.short(),
                    exc,
                    slab.size if slab is not None else 0,
                )
        try:
            if slab is not None and freed:
                slab.close()  # never a half-filled slab served
        finally:
            await _let_go(sources)


@dataclass(frozen=True)
class Filled:
    """What one ``PeerFill`` call gave: the model, or None and the FillError's reason (already logged)."""

    model: ServedModel | None
    reason: str = ""

    @property
    def outcome(self) -> tuple[str, int, float]:
        """(reason, bytes, seconds): ``Metrics.observe_fill``'s arguments."""
        if self.model is None:
            return self.reason, 0, 0.0
        return "", self.model.stats.bytes_read, self.model.stats.seconds


def _beyond_plan(planned: int, room: Callable[[int], None] | None, size: int) -> None:
    """``fill``'s ``room`` for a transformed rank (``PeerFill.rank``): the caller made room for the ``planned``
    bytes of its layout; an offered slab larger than that (a transform's output can be: vLLM's padded vocabulary,
    a dequantisation) needs ``room`` for the bytes beyond the plan, as a host-tier entry of the key does
    (``load_model``), or OutOfMemoryError without it."""
    if size <= planned:
        return
    if room is None:
        raise OutOfMemoryError(
            f"the offered slab is larger than the {planned} bytes of the rank's planned layout, the room this "
            "daemon made for it",
            details={"needed": size, "planned": planned},
        )
    room(size - planned)


def _agent_name() -> str:
    return f"wcache-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"


class PeerFill:
    """``--fill-from``: a daemon's fills from its peers, at start and on demand (docs/fleet.md, "When a daemon
    fills"). Each call is one blocking fill — its own event loop and NIXL agent, in the calling thread (the
    daemon calls it in a worker thread, so its own loop serves on) — and never raises for a fill that failed:
    it logs one line naming the key, the peers and the reason, followed by ``then`` (what the caller does
    next), and returns the reason. ``spec``: the ``--fill-from`` text; a ``dns:NAME:PORT`` one is resolved
    again for every fill, so a daemon asks the peers a headless Service lists now, not those it listed when
    the daemon started (a fleet grows)."""

    def __init__(
        self, cfg: FillConfig, backend: Backend, *, spec: str = "", agent_name: Callable[[], str] = _agent_name
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.spec = spec
        self._agent_name = agent_name

    @property
    def peers(self) -> str:
        """The peers the last fill asked (or will ask, before the first)."""
        return ",".join(f"{h}:{p}" for h, p in self.cfg.peers)

    def _config(self) -> FillConfig:
        if self.spec.startswith("dns:"):
            self.cfg = replace(self.cfg, peers=tuple(resolve_peers(self.spec)))
        return self.cfg

    def rank(self, rp: RankPlan, then: str = "loading from disk", room: Callable[[int], None] | None = None) -> Filled:
        """The rank ``rp`` plans: resharded from any layout the peers hold (an untransformed key, planned and
        verified from ``rp``'s headers), or byte for byte from a slab under exactly its key (a load-time
        transform, whose layout only a source knows). Room for ``rp``'s layout is the caller's to make; an offered
        slab under the transformed key larger than the planned layout is held beyond it through ``room(bytes)``
        (the caller's budget: make room or raise), as the disk path holds a transform's output, and refused
        (reason ``room``; the disk path) where that fails or no ``room`` is given. The offer's size is the peer's
        word: it never takes the daemon past its ``--memory-budget``."""
        transformed = bool(rp.spec.transform)
        fits = functools.partial(_beyond_plan, rp.layout.total_bytes, room) if transformed else None
        filled = self._run(rp.key, None if transformed else rp, fits, then)
        if filled.model is not None:
            filled.model.source = rp.spec.checkpoint
            filled.model.facts = rp.facts  # its local files give its key, as for a disk load (§4.3.1)
        return filled

    def key(self, key: WeightCacheKey, room: Callable[[int], None], then: str) -> Filled:
        """A slab served under exactly ``key`` (a deposit's recipe key), copied byte for byte with its table;
        ``room(size)`` once the offer says how large it is, before it is allocated."""
        return self._run(key, None, room, then)

    def _run(
        self,
        key: WeightCacheKey,
        rp: RankPlan | None,
        room: Callable[[int], None] | None,
        then: str,
    ) -> Filled:
        agent: AgentProcess | None = None
        cfg = self._config()
        try:
            # in a child process: a NIXL/UCX abort there fails this fill, not the daemon (agent_process.py)
            agent = AgentProcess(self._agent_name(), timeout=max(60.0, 2 * cfg.timeout))
            coro = fill(key, rp, self.backend, agent, cfg, room=room)
            return Filled(asyncio.run(coro))
        except FillError as exc:
            reason = str(exc.details.get("reason", "fill"))
            log.warning(
                "fill failed key=%s peers=%s reason=%s: %s; %s",
                key.short(),
                self.peers or "-",
                reason,
                exc.message,
                then,
            )
            return Filled(None, reason)
        finally:
            if agent is not None:
                agent.close()


async def fetch_files(root: Path, cfg: FillConfig, key: dict[str, str | int]) -> list[str]:
    """A node without the checkpoint: the small files and safetensors stubs of the checkpoint ``key`` names (a
    subset: ``{}`` for whatever the peers serve) from the first peer that has them, written into ``root``
    (wcache/peer_files.py). A peer's files are checked before any of them is in ``root``: they must make a
    checkpoint, whose fingerprint and architecture are ``key``'s where ``key`` names them (a source whose directory
    changed since it loaded the key sends another checkpoint's files under it); files that do not are discarded and
    the next peer asked. FillError when no peer sends them."""
    from wcache.peer_files import write_files
    from wcache.proto.fleet_frames import PeerFiles, PeerFilesReply

    last: BaseException | None = None
    for addr in cfg.peers:
        try:
            src = await _connect(addr, cfg)
        except (WCacheError, OSError, TimeoutError, ssl.SSLError) as exc:
            last = exc
            continue
        try:
            reply = await _request(src, PeerFiles(id=src.ch.conn.next_request_id(), key=key), cfg.connect_timeout)
            assert isinstance(reply, PeerFilesReply)
        except (WCacheError, OSError, TimeoutError, EOFError) as exc:
            last = exc
            continue
        finally:
            src.ch.close()
        if not any(f.name.endswith(".safetensors") for f in reply.files):
            last = FillError(f"peer {src.addr} sent no safetensors headers", details={"reason": "not-found"})
            continue
        try:
            written = await asyncio.to_thread(write_files, root, reply.files, lambda d: _files_give(d, key))
        except CheckpointError as exc:  # not a checkpoint, or not the one asked for: nothing of it in root
            log.warning("checkpoint files from peer=%s refused: %s", src.addr, exc.message)
            last = FillError(f"the files peer {src.addr} sent: {exc.message}", details={"reason": "verify"})
            continue
        except (OSError, ValueError) as exc:  # a name too long here, a size past its limit, a full disk; the marker
            last = FillError(
                f"writing the files peer {src.addr} sent into {root} failed: {exc}", details={"reason": "write"}
            )
            continue
        log.info("checkpoint files from peer=%s dir=%s files=%d", src.addr, root, len(written))
        return written
    raise FillError(
        f"no peer sent the checkpoint's files: {last}", details={"reason": _reason(last) if last else "no-peer"}
    )


def _files_give(staged: Path, key: dict[str, str | int]) -> None:
    """CheckpointError unless the files staged in ``staged`` make a checkpoint whose sampled fingerprint and
    architecture are those ``key`` names (the key's inputs: config.json, the file names, the headers and the
    sampled blocks, which the stubs carry)."""
    with Checkpoint.open(staged, tensors=False) as ckpt:
        got = {"fingerprint": ckpt.fingerprint(), "architecture": ckpt.architecture}
    if key.get("fingerprint_kind", "sampled") != "sampled":  # every byte's: not what stubs can give
        del got["fingerprint"]
    for name, value in got.items():
        if name in key and key[name] != value:
            raise CheckpointError(f"they are a checkpoint whose {name} is {value}, not {key[name]} as asked")


def _same_slab(m: PeerModel, first: PeerModel) -> bool:
    """Whether ``m`` lays out its slab as ``first`` does (size, table, aliases, buffers): striped together only then."""
    return (m.size, m.tensors, m.aliases, m.buffers, m.payload) == (
        first.size,
        first.tensors,
        first.aliases,
        first.buffers,
        first.payload,
    )


def _origin(used: Sequence[str]) -> str:
    """STATUS's origin of a filled model: ``peer ADDR``, or ``peer ADDR +N`` for N more peers (the field holds
    64 characters; the log line names them all)."""
    return "peer " + used[0] + (f" +{len(used) - 1}" if len(used) > 1 else "")


def agent_register_seconds(usable: Sequence[tuple[_Source, PeerModel, Layout | None]]) -> float:
    """What registering the offered slabs cost their sources (the most of them)."""
    return max((m.register_seconds for _, m, _ in usable), default=0.0)


async def _all_or_none(jobs: list[Callable[[], Coroutine[Any, Any, int]]]) -> int:
    """Run the per-source pulls together; the first failure cancels the others (bytes READ in all)."""
    tasks = [asyncio.ensure_future(j()) for j in jobs]
    try:
        return sum(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _pull(
    agent: Agent | AgentProcess,
    src: _Source,
    lease: int,
    copies: list[Copy],
    local: MemoryRegion,
    remote: MemoryRegion,
    grant: int,
    start: float,
    limit: Deadline,
) -> int:
    """READ ``copies`` from one source in batches of at most ``grant`` bytes (``grant_bytes``: a 64 MiB batch
    from an uncapped source, a hundredth of a second of its rate from a capped one), each granted first
    (PEER_READ). Grants are asked for AHEAD batches ahead, each once the batch AHEAD before it is posted, so the
    source has the next request in hand when it answers one (a capped source's grants follow one another at
    its rate, whatever this side's round trip); and a batch's READ is in flight while the next is posted (two
    at a time), so neither the grants' round trips nor the posting leaves the link idle. All by ``start`` +
    ``limit.seconds``, each grant within ``limit.stall`` seconds: else FillError (reason ``deadline``) naming
    the source, how far it got and the deadline's terms (a capped source's rate among them)."""
    assert src.grants is not None
    grants = src.grants
    todo = batches(copies, grant)
    done = 0
    inflight: list[Transfer | RemoteTransfer] = []
    deadline = start + limit.seconds
    whole = sum(c.nbytes for b in todo for c in b)

    def late(what: str) -> FillError:
        return FillError(
            f"{what} ({done} of {whole} bytes READ from it; the fill's deadline {limit.seconds:.1f} s: {limit.terms})",
            details={"reason": "deadline", "peer": src.addr, "deadline": limit.terms},
        )

    async def ask(k: int) -> None:
        await grants.ask(lease, sum(c.nbytes for c in todo[k]))

    try:
        for k in range(min(AHEAD, len(todo))):
            await ask(k)
        for k, batch in enumerate(todo):
            left = deadline - time.monotonic()
            if left <= 0:
                raise late(f"the fill from {src.addr} passed its deadline")
            wait = min(left, limit.stall)
            try:
                await asyncio.wait_for(grants.next(lease), wait)  # the grant of batch k (answered in order)
            except TimeoutError:
                within = "the fill's deadline" if wait == left else f"{wait:.1f} s of waiting for it"
                raise late(
                    f"no grant of {sum(c.nbytes for c in batch)} bytes came from {src.addr} within {within}"
                ) from None
            assert src.agent_name is not None
            for part, strided in (
                ([c for c in batch if c.count == 1], False),
                ([c for c in batch if c.count > 1], STRIDED),
            ):
                if part:
                    inflight.append(
                        agent.start_read(src.agent_name, part, local, remote, deadline=deadline, strided=strided)
                    )
            if k + AHEAD < len(todo):  # after the post: what is READ never runs ahead of the grants (above)
                await ask(k + AHEAD)
            while len(inflight) > 2:
                await _landed(inflight.pop(0))
            done += sum(c.nbytes for c in batch)
        while inflight:
            await _landed(inflight.pop(0))
    except FillError as exc:
        if exc.details.get("reason") != "deadline" or "deadline" in exc.details:
            raise
        raise late(f"a READ from {src.addr} passed the fill's deadline") from exc  # NIXL's names no cap
    finally:
        for t in inflight:
            t.release()
    return done


async def _landed(t: Transfer | RemoteTransfer) -> None:
    """Wait for one posted READ (polling, sleeping between polls), then release it."""
    try:
        pause = 1e-4
        while not t.done():
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2e-3)
    finally:
        t.release()


def batches(copies: Sequence[Copy], limit: int) -> list[list[Copy]]:
    """``copies`` in order, in batches of at most ``limit`` bytes; a copy larger than ``limit`` is split: a range
    into ranges, a strided copy into whole rows (a row larger than ``limit`` into ranges). The batches cover
    exactly the bytes of ``copies``."""
    if limit < 1:
        raise ValueError(f"a batch holds at least one byte, not {limit}")
    out: list[list[Copy]] = [[]]
    n = 0
    for c in copies:
        for piece in _split(c, limit):
            if out[-1] and n + piece.nbytes > limit:
                out.append([])
                n = 0
            out[-1].append(piece)
            n += piece.nbytes
    return [b for b in out if b]


def _split(c: Copy, limit: int) -> Iterator[Copy]:
    if c.nbytes <= limit:
        yield c
        return
    if c.count > 1 and c.length <= limit:
        step = limit // c.length
        for i in range(0, c.count, step):
            k = min(step, c.count - i)
            strided = k > 1
            yield Copy(
                c.source,
                c.src + i * c.src_stride,
                c.dst + i * c.dst_stride,
                c.length,
                k,
                c.src_stride if strided else 0,
                c.dst_stride if strided else 0,
            )
        return
    for i in range(c.count):
        src, dst = c.src + i * c.src_stride, c.dst + i * c.dst_stride
        for off in range(0, c.length, limit):
            yield Copy(c.source, src + off, dst + off, min(limit, c.length - off))


async def _let_go(sources: list[_Source]) -> None:
    """Stop the sources' grants, RELEASE their leases and close their connections. Idempotent."""
    try:
        for s in sources:
            if s.grants is not None:
                await s.grants.close()
                s.grants = None
    finally:  # a cancellation meanwhile must not leave the sources' connections open
        await _release(sources)


async def _release(sources: list[_Source]) -> None:
    """RELEASE every lease still held (best effort: a dead peer's end with its connection), then close."""
    for s in sources:
        if s.ch.closed:
            continue
        try:
            for lease in sorted(s.leases):
                if lease in s.ch.conn.leases:
                    await _request(s, Release(id=s.ch.conn.next_request_id(), lease=lease), 2.0)
        except (WCacheError, OSError, EOFError, TimeoutError):
            pass
        finally:
            s.ch.close()


# --------------------------------------------------------------------------- verification (docs/fleet.md)


def _verify(slab: Slab, layout: Layout, ckpt: Checkpoint, cfg: FillConfig) -> None:
    from wcache.server.reclaim import compare_samples

    bad = check_sampled_blocks(slab, layout, ckpt)
    if bad is None and cfg.samples and not _is_stub(ckpt):
        _, _, bad = compare_samples(slab, layout, cfg.samples, 4096)
    if bad is None and cfg.verify_content:
        bad = _compare_all(slab, layout)
    if bad is not None:
        raise FillError(f"the peers' bytes differ from the checkpoint's: {bad}", details={"reason": "verify"})


def _is_stub(ckpt: Checkpoint) -> bool:
    from wcache.peer_files import stub_names

    names = stub_names(ckpt.path)
    return any(f.name in names for f in ckpt.files)


def check_sampled_blocks(slab: Slab, layout: Layout, ckpt: Checkpoint) -> str | None:
    """Compare the key's sampled fingerprint blocks (16 x 4 KiB per safetensors file, docs/protocol.md §4.3) with
    the slab wherever they hold bytes of tensors this rank stores uncast; the first difference, or None."""
    by_file: dict[Path, list[tuple[int, int, int]]] = {}  # file -> (file offset, length, slab offset)
    for p in layout.placements:
        if p.dtype != p.source.dtype:
            continue
        pos = p.offset
        for f, off, n in placement_extents(p):
            by_file.setdefault(f, []).append((off, n, pos))
            pos += n
    for f in ckpt.files:
        fd = ckpt.fd(f)
        start = 8 + len(ckpt.headers[f.name])
        size = os.fstat(fd).st_size - start
        for rel in _sample_offsets(size):
            b0 = start + rel
            block = os.pread(fd, SAMPLE_BLOCK, b0)
            b1 = b0 + len(block)
            for off, n, pos in by_file.get(f, ()):
                lo, hi = max(off, b0), min(off + n, b1)
                if lo < hi and slab.read(pos + lo - off, hi - lo) != block[lo - b0 : hi - b0]:
                    return f"{f.name}: a sampled block at byte {b0} differs in the slab at {pos + lo - off}"
    return None


def _compare_all(slab: Slab, layout: Layout) -> str | None:
    """Every byte of every tensor against the local files (``--verify-content``)."""
    from wcache.server.reclaim import expected_bytes

    piece = 16 << 20
    files: dict[Path, int] = {}
    try:
        for p in layout.placements:
            item = DTYPE_SIZES[p.dtype]
            count = p.nbytes // item
            step = max(1, piece // item)
            for first in range(0, count, step):
                m = min(step, count - first)
                if slab.read(p.offset + first * item, m * item) != expected_bytes(files, p, first, m):
                    return f"tensor {p.source.name!r} elements {first}..{first + m - 1}"
    finally:
        for fd in files.values():
            os.close(fd)
    return None
