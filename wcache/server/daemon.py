"""The daemon: the request handler of the weights service, served by the server shell (service.py).

The shell accepts, checks the peer, moves bytes and turns failures into ERROR frames; parsing lives in
wcache.proto, lease logic in store.py. This module answers one request at a time (``handle``): GET_STATE,
RELEASE, STATUS, PRELOAD, EVICT, TAKEOVER, DEPOSIT and COMMIT (docs/protocol.md §4). Nothing a client sends
can stop the daemon: every exception in a request ends at most that connection (docs/protocol.md §6).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, assert_never, cast

from wcache.channel import DEFAULT_READ_BUDGET, ReadBudget
from wcache.errors import (
    CheckpointError,
    DeviceMismatchError,
    FrameTooLargeError,
    InternalError,
    InUseError,
    KeyMismatchError,
    LimitExceededError,
    NotFoundError,
    OutOfMemoryError,
    ProtocolError,
    ShardingError,
    TransformError,
    UnexpectedFrameError,
    UnknownLeaseError,
    UnsupportedPlatformError,
    WCacheError,
)
from wcache.plan.key import RankSpec, WeightCacheKey
from wcache.plan.rank import RankPlan, plan_rank
from wcache.plan.recipe import key_from_wire
from wcache.proto import (
    Commit,
    Connection,
    DaemonRequest,
    Deposit,
    Evict,
    Evicted,
    Frame,
    GetState,
    HandedModel,
    Hello,
    HelloOk,
    Preload,
    Preloaded,
    Release,
    Service,
    Status,
    StatusReply,
    Takeover,
    TakeoverAdopted,
    TakeoverDone,
    TakeoverState,
    as_received,
)
from wcache.proto.codec import MAX_REQUEST_SIZE
from wcache.proto.frames import MAX_HANDOFF_FDS
from wcache.server.keeper_link import CommitRecord, KeeperLink
from wcache.server.listen import bind_private_socket
from wcache.server.metrics import MAX_CONNECTIONS as METRICS_CONNECTIONS
from wcache.server.metrics import Metrics, listen_metrics, serve_metrics
from wcache.server.service import ConnectionLimits, Context, Reply, SameUid, Shell, raise_nofile, stop_on_signals
from wcache.server.store import ServedModel, Store, split_descriptors
from wcache.server.tier import HostTier, TierEntry, tier_holds

if TYPE_CHECKING:
    from wcache.server.fill import Filled, PeerFill
    from wcache.server.peer import PeerListener

__all__ = ["Daemon"]

log = logging.getLogger("wcache.server")

#: seconds a deposit may stay uncommitted after its DEPOSIT_SLAB (``--deposit-timeout``): writing even a large
#: model's tensors into the slab takes seconds
DEFAULT_DEPOSIT_TIMEOUT = 600.0


#: the longest pause between two rounds of the tombstone retries (``Daemon._write_tombstones``)
TOMBSTONE_RETRY_S = 0.5
#: the pause before a tombstone whose directory could not be opened (not the lock held) is tried again
TOMBSTONE_FAILED_RETRY_S = 30.0
#: a checkpoint planned while a file was too fresh to prove its key is planned again this long after the file
#: settles (RACY_NS after its change), and at most this many times while its files keep changing (~2 s apart)
PROVE_MARGIN_S = 0.05
PROVE_TRIES = 8


@dataclass(eq=False)
class _Tombstone:
    """A COMMIT's host-tier tombstone not written yet (``Daemon._supersede_later``)."""

    generation: str
    #: whether the store counts the commit unsettled (a COMMIT of this daemon; not one the record flagged at start)
    counted: bool
    #: why the last attempt failed other than the lock being held (logged once), and when to try again
    failed: str | None = None
    next_try: float = 0.0


class _HandedOver(Exception):
    """A request this daemon may not answer: it handed its models over (``Daemon.handle``)."""


@dataclass(eq=False)
class _Handoff:
    """A hand-off in progress: TAKEOVER_STATE went to ``conn`` (the new daemon, ``pid``) with ``models``."""

    conn: int
    pid: int
    models: list[ServedModel]
    timer: asyncio.TimerHandle | None = None

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


class Daemon:
    """The weights service. ``limits``: its connections' (the shell's); the rest is what it serves with."""

    service = Service.DAEMON
    holding = "lease"
    auth = False  # same-uid peers of a Unix socket: SO_PEERCRED is the proof

    def __init__(
        self,
        store: Store,
        socket_path: Path,
        *,
        software: str,
        limits: ConnectionLimits | None = None,
        read_budget: int = DEFAULT_READ_BUDGET,
        metrics_port: int = 0,
        metrics_listener: socket.socket | None = None,
        metrics_wait: float = 10.0,
        loader: Callable[[RankPlan, Callable[[int], None]], ServedModel] | None = None,
        planner: Callable[[RankSpec], RankPlan] = plan_rank,
        verify_content: bool = False,
        load_on_demand: bool = False,
        listener: socket.socket | None = None,
        on_handover: Callable[[], None] | None = None,
        tier: HostTier | None = None,
        keeper: KeeperLink | None = None,
        keeper_check: float = 5.0,
        tier_restore: Callable[[TierEntry, WeightCacheKey], ServedModel | None] | None = None,
        handoff_timeout: float = 10.0,
        deposit_timeout: float | None = DEFAULT_DEPOSIT_TIMEOUT,
        peers: PeerListener | None = None,
        peer_fill: PeerFill | None = None,
    ) -> None:
        self.store = store
        #: --peer-listen: the peer channel (docs/fleet.md), served by a shell of its own beside this one
        self.peers = peers
        #: --fill-from: PRELOAD, a load on demand and a recipe key asked for try the peers first (docs/fleet.md)
        self.peer_fill = peer_fill
        self.socket_path = Path(socket_path)
        self.software = software
        limits = limits or ConnectionLimits()
        #: no client -> daemon frame is large: requests are capped far below --max-frame-size (§7). An open
        #: connection holding no lease and silent idle_timeout is closed; one holding a lease never is (its
        #: leases live with it, docs/security.md)
        self.limits = replace(limits, max_frame_size=min(limits.max_frame_size, MAX_REQUEST_SIZE))
        self.metrics_port = metrics_port
        #: --metrics-port's socket, bound before the load (``listen_metrics``); without it serve() binds
        #: ``metrics_port`` itself, trying for ``metrics_wait`` seconds (after a --takeover the old daemon holds
        #: the port until it stops), and serves without metrics if it cannot
        self._metrics_listener = metrics_listener
        self.metrics_wait = metrics_wait
        self.metrics = Metrics()
        self._tag = f"socket={self.socket_path}"
        self.shell = Shell(
            self,
            limits=self.limits,
            tag=self._tag,
            log=log,
            peer_check=SameUid("daemon"),
            budget=ReadBudget(read_budget),
            metrics=self.metrics,
        )
        #: PRELOAD and load-on-demand: plan a RankSpec once (headers, fingerprint), then load that plan; the loader
        #: calls its second argument with the bytes of any slab beyond the plan's before allocating it (``load_model``)
        self.loader = loader
        self.planner = planner
        #: --verify-content: the fingerprint kind of every rank this daemon plans (not a PRELOAD field)
        self.verify_content = verify_content
        self.load_on_demand = load_on_demand
        self._preload_lock = asyncio.Lock()
        self.started = time.monotonic()
        self._stop = asyncio.Event()
        #: a listening socket handed over by the previous daemon (--takeover), used instead of binding
        self._listener: socket.socket | None = listener
        self._on_handover = on_handover
        self.tier = tier
        #: fills a slab from a host-tier entry (the loader's threads and staging): deposits come back this way
        self.tier_restore = tier_restore
        self._tier_saves: set[asyncio.Task[None]] = set()
        #: COMMITs whose host-tier tombstone is retried (``_supersede_later``): key -> the last such COMMIT of it
        self._tombstones: dict[WeightCacheKey, _Tombstone] = {}
        #: the one task retrying them all (``_write_tombstones``), cancelled at stop and hand-over
        self._tombstone_worker: asyncio.Task[None] | None = None
        #: checkpoints planned again once their files have settled (``_prove_when_settled``), cancelled at stop
        self._provers: dict[RankSpec, asyncio.Task[None]] = {}
        #: wcache-keeper holding this daemon's slabs across restarts (--keeper): told of every load and eviction
        self.keeper = keeper
        #: every COMMIT's generation (``<socket>.deposits``, keeper_link.CommitRecord), written before any engine can
        #: lease the deposit: the keeper's own record, or without a keeper one this daemon keeps (a keeper this
        #: socket's daemons used before may hold an older generation), which nothing settles
        self._commits = keeper.record if keeper is not None else CommitRecord(Path(f"{self.socket_path}.deposits"))
        # an entry stays while the host tier may still hold an older generation of its key (the COMMIT's tombstone
        # not yet written), though the keeper holds the new one: it is what keeps a restore from taking the older
        self._commits.pending = store.superseding
        #: whether a tier restore refused for want of a record that vouches for its key was logged (once)
        self._unvouched_logged = False
        self.keeper_check = keeper_check
        #: TAKEOVER: from TAKEOVER_STATE sent until the new daemon's TAKEOVER_ADOPTED (or the hand-off fails);
        #: a new daemon silent for longer than this gives the hand-off up (docs/protocol.md §4.10)
        self.handoff_timeout = handoff_timeout
        #: a deposit not committed this many seconds after its DEPOSIT_SLAB is abandoned (None: never): the deposits in
        #: progress are few (``Store.max_deposits``) and their bytes count in every room check, so engines that never
        #: commit would hold write-back off for every other engine
        self.deposit_timeout = deposit_timeout
        #: the hand-off in progress (TAKEOVER_STATE sent, TAKEOVER_ADOPTED awaited), if any
        self._handoff: _Handoff | None = None
        self._handed_over = False

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        self._stop.set()

    async def serve(
        self,
        on_ready: object | None = None,
        *,
        signals: bool = True,
        on_stopping: Callable[[], None] | None = None,
    ) -> None:
        """Serve until stop() (or SIGTERM/SIGINT, with ``signals``); then drain and unlink the socket. ``on_ready``
        is called once the socket serves, ``on_stopping`` once the stop begins (the process's readiness
        notifications: wcache/server/notify.py)."""
        with stop_on_signals(self.stop, signals=signals, log=log, tag=self._tag):
            self._fd_limits()
            listener = self._listener if self._listener is not None else bind_private_socket(self.socket_path)
            self._listener = listener
            http: asyncio.AbstractServer | None = None
            later: asyncio.Task[asyncio.AbstractServer | None] | None = None
            if self._metrics_listener is not None:
                http = await serve_metrics(self._metrics_listener, self.render_metrics)
            elif self.metrics_port:
                later = asyncio.ensure_future(self._metrics_later())
            self.shell.start(listener)
            if self.peers is not None:
                self.peers.start()
            self._resume_tombstones()
            self._prove_pending()
            if callable(on_ready):
                on_ready()
            watch = asyncio.ensure_future(self._watch_keeper()) if self.keeper is not None else None
            try:
                await self._stop.wait()
            finally:
                if on_stopping is not None:
                    on_stopping()
                if later is not None:
                    later.cancel()
                    (done,) = await asyncio.gather(later, return_exceptions=True)
                    http = done if isinstance(done, asyncio.AbstractServer) else None
                if http is not None:
                    http.close()
                if watch is not None:
                    watch.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watch
                provers = list(self._provers.values())  # none starts once the stop has begun (_prove_pending)
                for task in provers:
                    task.cancel()
                await asyncio.gather(*provers, return_exceptions=True)
                if self.peers is not None:
                    await self.peers.stop()
                await self.shell.close()
                if not self._handed_over:  # after a hand-off the socket file is the new daemon's
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.socket_path)
                await self.shell.drain()
                await self._cancel_supersedes()
                await self._finish_tier_saves()
        log.info("stopped %s leases_ended=%d", self._tag, len(self.store.leases))

    async def _metrics_later(self) -> asyncio.AbstractServer | None:
        """--metrics-port bound once serving (no listener was bound before the load): retried while the port is
        in use for ``metrics_wait`` seconds, then one line, and the daemon serves on without metrics."""
        deadline = time.monotonic() + self.metrics_wait
        while True:
            try:
                sock = listen_metrics(self.metrics_port)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    continue
                log.error(
                    "metrics off %s: --metrics-port %d: cannot listen on 127.0.0.1:%d (%s); serving without metrics",
                    self._tag,
                    self.metrics_port,
                    self.metrics_port,
                    exc.strerror or exc,
                )
                return None
            try:
                return await serve_metrics(sock, self.render_metrics)
            except BaseException:
                sock.close()
                raise

    async def _cancel_supersedes(self) -> None:
        """A stop ends the tombstone retries: their commits stay unsettled, and ``<socket>.deposits`` keeps their
        entries, flagged, which guard the next daemon's restores of their keys (and have it retry them)."""
        task, self._tombstone_worker = self._tombstone_worker, None
        if task is None:
            return
        task.cancel()
        if self._tombstones:
            log.info(
                "stopping %s: %d host tier tombstone(s) not written, their record entries kept",
                self._tag,
                len(self._tombstones),
            )
        await asyncio.gather(task, return_exceptions=True)

    async def _finish_tier_saves(self) -> None:
        """A stop waits for the host-tier saves in progress (a deposit committed just before it): the tier is what
        brings a deposit back after the restart, and a save cut off publishes nothing (the process then ended with
        its thread mid-copy, or the store closed the slab under it)."""
        saves = list(self._tier_saves)
        if saves:
            log.info("stopping %s: waiting for %d host tier save(s)", self._tag, len(saves))
            await asyncio.gather(*saves, return_exceptions=True)

    def _fd_limits(self) -> None:
        """Connections and slabs (models, deposits in progress) get their shares of RLIMIT_NOFILE
        (``split_descriptors``), so that no peer can make the daemon run out of descriptors to accept and
        answer with; the shell gives each peer its share of unread descriptors from what is left."""
        nofile = raise_nofile()
        metrics = METRICS_CONNECTIONS + 1 if self.metrics_port or self._metrics_listener is not None else 0
        connections, slabs = split_descriptors(nofile, self.limits.connections, metrics)
        self.store.fit_descriptors(slabs)
        if connections < self.limits.connections:
            self.limits = replace(self.limits, connections=connections)
            self.shell.limit_connections(connections)
        log.info(
            "descriptor shares %s nofile=%d connections=%d models=%d deposits=%d",
            self._tag,
            nofile,
            self.limits.connections,
            self.store.max_models,
            self.store.max_deposits,
        )

    async def _watch_keeper(self) -> None:
        """Every ``keeper_check`` seconds: a keeper that restarted holds nothing; deposit the models again."""
        assert self.keeper is not None
        while True:
            await asyncio.sleep(self.keeper_check)
            await self.keeper.check(lambda: list(self.store.models.values()))

    # ------------------------------------------------------------------ the shell's handler (service.Handler)
    def hello(self, conn: Connection, hello: Hello, ctx: Context) -> HelloOk:
        backend = self.store.backend
        return conn.hello_reply(
            hello, software=self.software, backend=backend.name, device=backend.device, server_pid=os.getpid()
        )

    def holds(self, ctx: Context) -> bool:
        """A connection holding leases is never closed for silence or room: its engine maps the weights. Nor is
        one in the middle of a hand-off (its own deadline is ``handoff_timeout``)."""
        return self.store.held_by(ctx.id) > 0 or (self._handoff is not None and self._handoff.conn == ctx.id)

    def protects(self) -> Callable[[Context], bool]:
        return lambda ctx: False

    def closed(self, ctx: Context) -> None:
        if self._handoff is not None and self._handoff.conn == ctx.id:  # the new daemon refused, died or broke it
            self._hand_over_failed("its connection ended before TAKEOVER_DONE")
        ended = self.store.drop_connection(ctx.id)
        if ended:
            log.info(
                "connection closed %s pid=%d leases_ended=%d leases_left=%d",
                self._tag,
                ctx.pid,
                len(ended),
                len(self.store.leases),
            )

    async def handle(self, request: Frame, fds: list[int], ctx: Context) -> Reply | Frame:
        # the connection lets through only requests (the transition table) of this service
        frame = cast("DaemonRequest", request)
        try:
            if not self._handed_over:
                return await self._handle(frame, ctx)
        except _HandedOver:
            pass
        # docs/protocol.md §4.10 step 4: once TAKEOVER_DONE is out this daemon's models are the new daemon's and its
        # connections close; a request still arriving on one while the busy ones drain, or one whose load ended
        # after it, is not answered here (a DEPOSITED or PRELOADED from this daemon would name a model the daemon
        # serving the socket never gets): the connection closes, and the engine reconnects to it
        log.info("closing %s pid=%d: %s after the hand-off (the new daemon serves)", self._tag, ctx.pid, frame.TYPE)
        ctx.end()
        await asyncio.sleep(0)  # the cancellation lands here
        raise AssertionError("a connection ended by ctx.end() went on")

    async def _handle(self, frame: DaemonRequest, ctx: Context) -> Reply | Frame:
        conn_id, pid = ctx.id, ctx.pid
        if self._handoff is not None and self._handoff.conn == conn_id and not isinstance(frame, TakeoverAdopted):
            self._hand_over_failed(f"{frame.TYPE} instead of TAKEOVER_ADOPTED")
            raise UnexpectedFrameError(
                f"{frame.TYPE} after TAKEOVER_STATE: only TAKEOVER_ADOPTED may follow it (the hand-off is off)",
                details={"type": frame.TYPE},
            )
        match frame:
            case GetState():
                return await self._get_state(frame, conn_id, pid)
            case Release():
                released = self.store.release(conn_id, frame)
                self.metrics.releases += 1
                log.info(
                    "lease released %s pid=%d lease=%d leases_left=%d",
                    self._tag,
                    pid,
                    frame.lease,
                    released.leases_left,
                )
                return released
            case Status():
                return self.status_reply(frame.id)
            case Preload():
                spec = RankSpec.from_preload(frame, verify_content=self.verify_content)
                preloaded = await self._preload(spec, frame.id, pid)
                assert preloaded is not None  # None only for a load on demand's ``wanted``
                return preloaded
            case Takeover():
                return await self._hand_over(frame, ctx)
            case TakeoverAdopted():
                return self._adopted(frame, conn_id)
            case Evict():
                gone = self.store.evict(frame.key)
                if self.keeper is not None:
                    await self.keeper.unkeep(gone)
                log.info(
                    "evicted %s pid=%d key=%s bytes=%d resident=%d",
                    self._tag,
                    pid,
                    gone.key.short(),
                    gone.slab_bytes,
                    self.store.resident_bytes,
                )
                return Evicted(id=frame.id, key=gone.key.to_wire(), bytes=gone.slab_bytes)
            case Deposit():
                return await self._deposit(frame, conn_id, pid)
            case Commit():
                return await self._commit(frame, conn_id, pid)
            case _:
                assert_never(frame)

    async def _get_state(self, frame: GetState, conn_id: int, pid: int) -> Reply:
        """GET_STATE: a lease and the slabs' descriptors; the lease is revoked if the kernel refuses them."""
        t0 = time.perf_counter()
        frame = self.store.completed(frame)  # a proof's key, whole (docs/protocol.md §4.3.1): once per request
        try:
            state, fds, model = self.store.acquire(conn_id, pid, frame, completed=True)
        except (KeyMismatchError, NotFoundError):
            if not await self._load_on_demand(frame, pid):
                raise
            state, fds, model = self.store.acquire(conn_id, pid, frame, completed=True)

        def granted() -> None:
            self.metrics.observe_fetch(frame.mode, time.perf_counter() - t0)
            log.info(
                "lease granted %s pid=%d lease=%d mode=%s key=%s tensors=%d bytes=%d leases=%d",
                self._tag,
                pid,
                state.lease,
                frame.mode,
                model.key.short(),
                len(state.tensors),
                model.slab_bytes,
                len(self.store.leases),
            )

        return Reply(state, fds, undo=lambda: self.store.revoke(state.lease), after=granted)

    async def _deposit(self, req: Deposit, conn_id: int, pid: int) -> Reply:
        """DEPOSIT (docs/protocol.md §4.13): room, a writable slab, DEPOSIT_SLAB with its descriptor. The
        deposit is the connection's until COMMIT: if it closes first, drop_connection frees the slab (and so
        does a DEPOSIT_SLAB whose descriptor the kernel refused)."""
        reply, fds, dep = self.store.begin_deposit(conn_id, pid, req)  # evicts nothing: a promise until COMMIT
        log.info(
            "deposit started %s pid=%d deposit=%d key=%s tensors=%d bytes=%d pending=%d",
            self._tag,
            pid,
            dep.id,
            dep.key.short(),
            len(dep.table),
            dep.slab.size,
            self.store.pending_bytes,
        )

        def sent() -> None:
            if self.deposit_timeout is not None:
                asyncio.get_running_loop().call_later(
                    self.deposit_timeout,
                    self.store.abandon,  # a no-op for a deposit committed or abandoned by then (ids are not reused)
                    dep.id,
                    f"not committed within {self.deposit_timeout:g} s (--deposit-timeout)",
                )

        return Reply(
            reply, fds, undo=lambda: self.store.abandon(dep.id, "its DEPOSIT_SLAB could not be sent"), after=sent
        )

    async def _commit(self, req: Commit, conn_id: int, pid: int) -> Reply:
        """COMMIT: seal the slab read-only, make room, serve it under the recipe key, tell the host tier and the
        keeper (before DEPOSITED: no older generation of the key survives in either, a crash included; the
        generation is recorded in ``<socket>.deposits`` before the first await, so before any engine leases it)."""
        reply, model, old, evicted = self.store.commit_deposit(conn_id, req)
        # the generation on disk before the first await, i.e. before any engine can lease it: a crash after one
        # was served never brings back an older generation a keeper holds (the next daemon's reclaim drops it)
        self._commits.committed(model.key, model.generation)
        settled, failed = True, None
        if self.tier is not None:
            latest = self._latest(model.key, model.generation)
            try:
                settled = await asyncio.to_thread(self.tier.supersede, model.key, model.generation, latest=latest)
            except OSError as exc:  # not the lock held: the directory cannot be opened (it may not pass by itself)
                settled, failed = False, f"{type(exc).__name__}: {exc}"
        if settled:
            self.store.settled(model.key)
            self._superseded(model.key, model.generation)
        else:  # the tier's lock held by another daemon: unsettled (restores take this generation only) until then
            self._supersede_later(model.key, model.generation, model, failed)
        await self._evicted(evicted, "deposit")
        if self.keeper is not None:
            await self.keeper.commit(model, old)
        log.info(
            "deposited %s pid=%d deposit=%d key=%s tensors=%d bytes=%d seconds=%.3f replaced=%s resident=%d",
            self._tag,
            pid,
            req.deposit,
            model.key.short(),
            len(model.table),
            model.slab_bytes,
            model.stats.seconds,
            old is not None,
            self.store.resident_bytes,
        )
        return Reply(reply, after=(lambda: self._save_to_tier(model)) if settled else None)

    def _latest(self, key: WeightCacheKey, generation: str) -> Callable[[], bool]:
        """Whether ``generation`` is still the last committed under ``key`` here (asked by ``HostTier.supersede``
        under the tier's lock, in a worker thread: reads of one dict entry each): the store's, or where the store
        has none (a COMMIT of the daemon before this one, whose tombstone the record flags) the record's."""
        kid = self._commits.key_id(key)

        def latest() -> bool:
            last = self.store.generations.get(key)
            return not self._handed_over and (last if last is not None else self._commits.keys.get(kid)) == generation

        return latest

    def _superseded(self, key: WeightCacheKey, generation: str) -> None:
        """A COMMIT of ``generation`` found the tier holding nothing older: an earlier COMMIT of the key whose
        tombstone is still retried is covered by it, where ``generation`` is still the last one."""
        if not self._latest(key, generation)():
            return
        self._commits.tombstone_written(key, generation)
        earlier = self._tombstones.pop(key, None)
        if earlier is not None and earlier.counted:
            self.store.settled(key)

    def _supersede_later(
        self, key: WeightCacheKey, generation: str, model: ServedModel | None, failed: str | None = None
    ) -> None:
        """The COMMIT of ``generation`` (``model``; None: a COMMIT of the daemon before this one, its record entry
        flagged) could not write its host-tier tombstone (another daemon holds the tier's lock, and may publish an
        older generation it checked under it before letting go; or, ``failed``, the directory could not be opened):
        retried in the background (``_write_tombstones``) until it is written under the lock, or a later COMMIT of
        the key supersedes this one. Meanwhile the commit is not settled: this daemon's restores of the key take
        this generation only, and ``<socket>.deposits`` keeps its entry, flagged (which guards the restores of the
        next daemon of the socket, across a crash or a TAKEOVER, and has it retry the tombstone). Then the entry
        settles by the usual rule and the deposit, where it is served, is saved."""
        tier = self.tier
        assert tier is not None
        log.warning(
            "host tier tombstone %s key=%s generation=%s not written (%s): retrying in the background, restores of "
            "the key take this generation only until then",
            self._tag,
            key.short(),
            generation,
            failed or "the tier's lock is held",
        )
        self._commits.tombstone_pending(key, generation)
        earlier = self._tombstones.get(key)
        if earlier is not None and earlier.counted:  # its tombstone is covered by this one's, to come
            self.store.settled(key)
        item = _Tombstone(generation, model is not None)
        if failed is not None:
            item.failed, item.next_try = failed, time.monotonic() + TOMBSTONE_FAILED_RETRY_S
        self._tombstones[key] = item
        if self._tombstone_worker is None or self._tombstone_worker.done():
            self._tombstone_worker = asyncio.get_running_loop().create_task(self._write_tombstones(tier))

    def _prove_later(self, rp: RankPlan) -> None:
        """``rp`` recorded no facts only because its files were too fresh: plan it again once they have settled."""
        self.store.prove_later(rp.spec, rp.facts, rp.proof_after_ns)
        self._prove_pending()

    def _prove_pending(self) -> None:
        """Plan again, once their files have settled, the checkpoints ``store.unproven`` names (planned while a
        file was too fresh for its identity to prove the key): without it, a daemon started on a checkpoint just
        written, the common case of a node that downloads one and starts, had every engine scan the headers for
        its whole life."""
        if self._stop.is_set() or self._handed_over:  # a load that ends during the stop's drain: not planned again
            self.store.unproven.clear()
            return
        while self.store.unproven:
            spec, after_ns = self.store.unproven.pop(0)
            if spec in self._provers:  # one planning per spec: a second PRELOAD of it meanwhile adds none
                continue
            task = asyncio.get_running_loop().create_task(self._prove_when_settled(spec, after_ns))
            self._provers[spec] = task
            task.add_done_callback(functools.partial(self._proved, spec))

    def _proved(self, spec: RankSpec, task: asyncio.Task[None]) -> None:
        if self._provers.get(spec) is task:
            del self._provers[spec]

    async def _prove_when_settled(self, spec: RankSpec, after_ns: int) -> None:
        """Plan ``spec`` after ``after_ns`` (and again, ``PROVE_TRIES`` times in all, while a file keeps changing):
        where that planning records the files' identity and gives the key of a model served here, engines prove
        those files from then on (docs/protocol.md §4.3.1) — what a daemon started then would have recorded. A
        checkpoint that changed meanwhile gives another key, recorded for no model here."""
        for _ in range(PROVE_TRIES):
            await asyncio.sleep(max(0.0, (after_ns - time.time_ns()) / 1e9) + PROVE_MARGIN_S)
            if self._handed_over:
                return
            try:
                rp = await asyncio.to_thread(self.planner, spec)
            except (WCacheError, OSError) as exc:
                log.info("key proof %s checkpoint=%s not recorded: %s", self._tag, spec.checkpoint, exc)
                return
            with rp:
                if rp.facts is not None:
                    model = self.store.models.get(rp.key)
                    if model is not None:
                        self.store.remember_facts(rp.facts)
                        model.facts = model.facts or rp.facts
                        log.info(
                            "key proof recorded %s key=%s checkpoint=%s files=%d: engines prove these files now",
                            self._tag,
                            rp.key.short(),
                            spec.checkpoint,
                            len(rp.facts.files),
                        )
                    return
                if rp.proof_after_ns is None:
                    return
                after_ns = rp.proof_after_ns

    def _resume_tombstones(self) -> None:
        """At start: the entries of ``<socket>.deposits`` flagged as waiting for their COMMIT's tombstone (the
        daemon before this one stopped, crashed or handed over first) are retried here."""
        for kid, wire in list(self._commits.tombstones.items()):
            generation = self._commits.keys.get(kid)
            try:
                key = key_from_wire(dict(wire))
            except (TypeError, ValueError):
                continue
            if generation is None or self._commits.key_id(key) != kid or key in self._tombstones:
                continue
            if self.tier is None:
                log.warning(
                    "host tier tombstone %s key=%s generation=%s pending in %s, and no --host-tier here: its entry "
                    "stays",
                    self._tag,
                    key.short(),
                    generation,
                    self._commits.path.name,
                )
                continue
            self._supersede_later(key, generation, None, None)

    async def _write_tombstones(self, tier: HostTier) -> None:
        """Retry every pending tombstone (``_tombstones``) in rounds: one attempt each at the tier's lock, which
        keeps no worker thread waiting (``supersede(wait=False)``), then a pause (growing to
        ``TOMBSTONE_RETRY_S``). A tombstone whose directory cannot be opened is logged once and tried again every
        ``TOMBSTONE_FAILED_RETRY_S``."""
        pause = 0.05
        while self._tombstones and not self._handed_over:
            await asyncio.sleep(pause)
            pause = min(2 * pause, TOMBSTONE_RETRY_S)
            for key, item in list(self._tombstones.items()):
                if self._tombstones.get(key) is not item or time.monotonic() < item.next_try:
                    continue
                latest = self._latest(key, item.generation)
                wrote = False

                def still(latest: Callable[[], bool] = latest) -> bool:  # under the lock: is it written now
                    nonlocal wrote
                    wrote = latest()
                    return wrote

                try:
                    done = await asyncio.to_thread(tier.supersede, key, item.generation, latest=still, wait=False)
                except OSError as exc:
                    if item.failed is None:
                        log.warning(
                            "host tier tombstone %s key=%s generation=%s not written (%s: %s): its record entry "
                            "stays; retried every %g s",
                            self._tag,
                            key.short(),
                            item.generation,
                            type(exc).__name__,
                            exc,
                            TOMBSTONE_FAILED_RETRY_S,
                        )
                    item.failed = f"{type(exc).__name__}: {exc}"
                    item.next_try = time.monotonic() + TOMBSTONE_FAILED_RETRY_S
                    continue
                if self._handed_over:
                    return
                if not done or self._tombstones.get(key) is not item:
                    continue
                del self._tombstones[key]
                await self._tombstone_written(key, item, wrote)

    async def _tombstone_written(self, key: WeightCacheKey, item: _Tombstone, wrote: bool) -> None:
        """The tier holds nothing older than ``item``'s generation now (``wrote``), or a later COMMIT of the key
        came first (its tombstone follows, or is written). The record's entry is then settled by the usual rule:
        it goes if the keeper holds the deposit served under the key, or, where none is served, holds nothing of
        the key (an UNKEEP confirms it); the deposit served is saved."""
        if item.counted:
            self.store.settled(key)
        if not wrote:
            return
        log.info("host tier tombstone %s key=%s generation=%s written late", self._tag, key.short(), item.generation)
        self._commits.tombstone_written(key, item.generation)
        model = self.store.models.get(key)
        if model is not None and model.generation == item.generation:
            if self.keeper is not None:
                await self.keeper.settle(model)
            self._save_to_tier(model)
        elif model is None and self.keeper is not None and not self.store.superseding(key):
            await self.keeper.drop(key)  # the keeper holds nothing of the key once it confirms: the entry goes

    async def _hand_over(self, req: Takeover, ctx: Context) -> Reply:
        """TAKEOVER (docs/protocol.md §4.10): give a new daemon (same uid, same device) every model's slabs and
        the listening socket, and stop only once it confirms (TAKEOVER_ADOPTED) that it adopted them all.
        Until then this daemon keeps its lock and its connections; new ones queue on the shared socket. A
        hand-off that fails at any point (refused here, a TAKEOVER_STATE over the new daemon's frame limit,
        the new daemon refusing it, dying or silent past ``handoff_timeout``, the models changing meanwhile)
        leaves this daemon serving and accepting as before. Engines' mappings stay valid either way: they
        reference the memory, not this process."""
        pid = ctx.pid
        backend = self.store.backend
        if self._handoff is not None or self._handed_over:
            raise InUseError("this daemon is already handing over to another: wait for it to stop")
        if req.backend != backend.name or (backend.device.uuid and req.device_uuid != backend.device.uuid):
            raise DeviceMismatchError(
                f"the new daemon serves {req.backend} {req.device_uuid or '-'}, this one "
                f"{backend.name} {backend.device.uuid or '-'}: nothing handed over",
                details={"backend": backend.name, "device_uuid": backend.device.uuid},
            )
        held = list(self.store.models.values())
        models: list[HandedModel] = []
        fds: list[int] = []
        for m in held:
            descs = m.export(fds)
            by_handle = [d.kind for d in descs if d.fd < 0]
            if by_handle:  # (the fds listed so far are the slabs' own: nothing to close)
                raise UnsupportedPlatformError(
                    f"{m.key.short()}: a {by_handle[0]} slab cannot be handed over (use --cuda-export vmm)"
                )
            models.append(m.handed(descs))
        if len(fds) + 1 > MAX_HANDOFF_FDS:
            raise LimitExceededError(f"{len(fds)} slabs: a hand-off carries at most {MAX_HANDOFF_FDS - 1}")
        assert self._listener is not None
        keeper = str(self.keeper.path) if self.keeper is not None else ""
        reply = TakeoverState(id=req.id, models=tuple(models), listener_fd=len(fds), pid=os.getpid(), keeper=keeper)
        try:  # what the new daemon's decoder will make of it, off the event loop (tens of MB for big tables)
            await asyncio.to_thread(as_received, reply, req.max_frame_size)
        except FrameTooLargeError as exc:
            raise LimitExceededError(
                f"the hand-off is {exc.details.get('size')} bytes, over the {req.max_frame_size} the new daemon "
                "accepts (its --max-frame-size): nothing handed over; EVICT models first, or give the new daemon "
                "a larger --max-frame-size",
                details={"size": exc.details.get("size"), "max_size": req.max_frame_size},
            ) from None
        except ProtocolError as exc:
            raise InternalError(f"a model here cannot be handed over ({exc.message}): nothing handed over") from None
        if not self._holds(held):  # evicted meanwhile: its descriptor may be closed
            raise InUseError("the models changed while the hand-off was prepared: nothing handed over; retry")
        self._handoff = _Handoff(ctx.id, pid, held)
        self.shell.stop_accepting()  # no new connection lands here meanwhile: they queue for whoever serves next
        fds.append(self._listener.fileno())

        def sent() -> None:  # the new daemon has this long to adopt them all, else this one serves on
            handoff = self._handoff
            assert handoff is not None
            handoff.timer = asyncio.get_running_loop().call_later(self.handoff_timeout, self._hand_over_expired, ctx)

        return Reply(
            reply, fds, undo=lambda: self._hand_over_failed("TAKEOVER_STATE's descriptors refused"), after=sent
        )

    def _adopted(self, frame: TakeoverAdopted, conn_id: int) -> Reply:
        """TAKEOVER_ADOPTED: the new daemon adopted ``frame.models`` models; TAKEOVER_DONE if that is all of
        them, unchanged since (this daemon then stops), else the hand-off is off and this daemon serves on."""
        handoff = self._handoff
        if handoff is None or handoff.conn != conn_id:
            raise UnknownLeaseError("TAKEOVER_ADOPTED with no hand-off open on this connection")
        if frame.models != len(handoff.models) or not self._holds(handoff.models):
            self._hand_over_failed(f"adopted {frame.models} of {len(handoff.models)} models, or they changed")
            raise InUseError(
                f"the new daemon adopted {frame.models} of the {len(handoff.models)} models handed over, or they "
                "changed meanwhile: this daemon serves on; retry the takeover",
                details={"adopted": frame.models, "handed": len(handoff.models)},
            )
        return Reply(TakeoverDone(id=frame.id, pid=os.getpid()), after=self._handed)

    def _handed(self) -> None:
        """The TAKEOVER_DONE is out: the new daemon serves from now on."""
        handoff = self._handoff
        assert handoff is not None
        handoff.cancel()
        self._handoff = None
        self._handed_over = True
        pid, models = handoff.pid, handoff.models
        log.info(
            "handed over %s to pid=%d models=%d bytes=%d leases_dropped=%d",
            self._tag,
            pid,
            len(models),
            self.store.resident_bytes,
            len(self.store.leases),
        )
        # the socket's record and its keeper entries are the new daemon's from now on: nothing here writes the
        # record or asks the keeper again (before the lock goes: the new daemon reads the record once it holds it)
        self._commits.hand_over()
        if self.keeper is not None:
            self.keeper.hand_over()
        if self._tombstone_worker is not None:  # the record's flagged entries: the new daemon retries them
            self._tombstone_worker.cancel()
        if self._on_handover is not None:
            self._on_handover()  # releases the one-daemon lock for the new daemon
        self.stop()

    def _holds(self, models: list[ServedModel]) -> bool:
        """Whether the store serves exactly ``models`` (the same objects, in any LRU order), as when a hand-off
        began: a fetch meanwhile only reorders them."""
        now = {id(m) for m in self.store.models.values()}
        return len(now) == len(models) and now == {id(m) for m in models}

    def _hand_over_expired(self, ctx: Context) -> None:
        """No TAKEOVER_ADOPTED within ``handoff_timeout``: serve on, and end the new daemon's connection."""
        if self._handoff is not None and self._handoff.conn == ctx.id:
            self._hand_over_failed(f"no TAKEOVER_ADOPTED within {self.handoff_timeout} s")
            ctx.end()

    def _hand_over_failed(self, why: str) -> None:
        handoff, self._handoff = self._handoff, None
        if handoff is None:
            return
        handoff.cancel()
        if not self._stop.is_set():
            self.shell.resume_accepting()
        log.warning("hand-off failed %s to pid=%d reason=%s: serving on", self._tag, handoff.pid, why)

    async def _load_on_demand(self, req: GetState, pid: int) -> bool:
        """With --load-on-demand: load the requested variant (rank, dtype, transform) of a checkpoint the
        daemon loaded before. True if a model now matches the request."""
        if "engine" in req.key:  # a recipe key (write-back) is deposited, never loaded: maybe in the host tier
            return await self._restore_deposit(req, pid)
        if not self.load_on_demand:
            return False
        source = self.store.source_for(req.key)
        k = req.key
        if source is None or not isinstance(k.get("tp_rank"), int) or not isinstance(k.get("tp_size"), int):
            return False
        dtype, transform = k.get("dtype", "auto"), k.get("transform", "")
        try:
            spec = RankSpec(
                source,
                tp_rank=int(k["tp_rank"]),
                tp_size=int(k["tp_size"]),
                dtype=str(dtype),
                transform=str(transform),
                verify_content=self.verify_content,
            )
            log.info(
                "load on demand %s pid=%d source=%s tp=%s/%s dtype=%s",
                self._tag,
                pid,
                source,
                k["tp_rank"],
                k["tp_size"],
                dtype,
            )
            await self._preload(spec, req.id, pid, wanted=req.key)
        except (CheckpointError, ShardingError, TransformError) as exc:
            # a variant this checkpoint has no plan, dtype or transform for: the request's answer is KEY_MISMATCH
            # (docs/protocol.md §4.9), as for any key it cannot be served under, not the PRELOAD's codes
            log.info("load on demand refused %s pid=%d: %s", self._tag, pid, exc.message)
            return False
        return any(not m.key.diff_wire(req.key) for m in self.store.models.values())

    async def _evicted(self, models: Sequence[ServedModel], reason: str) -> None:
        """Models the store evicted to make room: one log line each, and the keeper lets them go too."""
        for m in models:
            log.info("evicted %s key=%s bytes=%d reason=%s", self._tag, m.key.short(), m.slab_bytes, reason)
            if self.keeper is not None:
                await self.keeper.unkeep(m)

    def _recorded_generation(self, key: WeightCacheKey) -> tuple[bool, str | None]:
        """Whether the host tier may restore ``key``, and the generation it must be (None: whichever it holds):
        the one the socket's record names (``<socket>.deposits``: written at COMMIT before any engine could lease
        it, across crashes) — a daemon that crashed between serving a deposit and the host tier's tombstone of
        the older one restores only that generation, never the older entry still there. A key the record does not
        name is restorable only where the record is whole: a damaged, unreadable or once full one may have lost
        its entry (``CommitRecord.partial``), so the key is absent and the engine deposits again."""
        allowed, generation = self._commits.restorable(key)
        if not allowed and not self._unvouched_logged:
            self._unvouched_logged = True
            log.warning(
                "host tier restore refused %s key=%s: %s lost entries (damaged, unreadable or full), so it cannot "
                "vouch for a key it does not name; engines deposit such keys again (logged once)",
                self._tag,
                key.short(),
                self._commits.path.name,
            )
        return allowed, generation

    async def _restore_deposit(self, req: GetState, pid: int) -> bool:
        """A recipe key this daemon does not serve (a deposit evicted, lost with a restart, or made on another
        node): filled from the peers that serve it (--fill-from, origin "peer ADDR"), else from a host-tier entry
        of it (origin "tier"). True if it is served now; one fill at a time, so concurrent requests for the key
        share it."""
        tier, restore, filler = self.tier, self.tier_restore, self.peer_fill
        if (tier is None or restore is None) and filler is None:
            return False
        try:
            key = key_from_wire(dict(req.key))
        except (TypeError, ValueError):
            return False
        async with self._preload_lock:
            if self._handed_over:  # queued behind a load that ended after the hand-off: the new daemon serves it
                raise _HandedOver
            if key in self.store.models:
                return True
            with self.store.restore(key) as since:  # a deposit committed meanwhile drops this restore
                model: ServedModel | None = None
                if tier is not None and restore is not None:  # this node's own copy first: local memory, checked
                    allowed, want = (True, since) if since is not None else self._recorded_generation(key)
                    entry = await asyncio.to_thread(tier.lookup, key, generation=want) if allowed else None
                    if entry is not None:
                        # the room is held until the model is added, below: no await between
                        with self.store.loading(entry.size) as evicted:
                            await self._evicted(evicted, "tier-restore")
                            model = await asyncio.to_thread(restore, entry, key)
                if model is None and filler is not None:
                    # the room is held until the model is added, below: no await between
                    with self._room_from_thread() as room:
                        model = await self._filled(functools.partial(filler.key, key, room, "not served"))
                    if model is not None and model.source is None:
                        model.source = self.store.source_for(key.to_wire())
                if model is None:
                    return False
                if self._handed_over:  # restored after the hand-off: nothing is added here any more
                    model.close()
                    raise _HandedOver
                if not self.store.add_restored(model, since):  # a COMMIT of the key landed meanwhile: it stays
                    log.info(
                        "deposit restore dropped %s pid=%d key=%s (committed anew meanwhile)",
                        self._tag,
                        pid,
                        key.short(),
                    )
                    return key in self.store.models
            if self.keeper is not None:
                await self.keeper.keep(model)
        log.info(
            "deposit restored %s pid=%d key=%s origin=%s tensors=%d bytes=%d seconds=%.2f",
            self._tag,
            pid,
            key.short(),
            model.origin,
            len(model.table),
            model.slab_bytes,
            model.stats.seconds,
        )
        return True

    async def _filled(self, call: Callable[[], Filled]) -> ServedModel | None:
        """One ``PeerFill`` call in a worker thread (the fill runs its own loop there: this one serves on), its
        outcome counted in the metrics."""
        filled = await asyncio.to_thread(call)
        self.metrics.observe_fill(*filled.outcome)
        return filled.model

    @contextlib.contextmanager
    def _room_from_thread(
        self, models: int = 1, reason: str = "peer-fill", evicted: list[ServedModel] | None = None
    ) -> Iterator[Callable[[int], None]]:
        """``store.loading`` for a load in a worker thread that learns a size as it runs (a fill from the offer, a
        transform from its output): the callable it yields runs ``store.hold`` on this loop (the store is the
        loop's), waited for, holding the bytes and ``models`` slots (a fill's model; none for a transform's
        output, whose load holds its slot already) until the block ends (the caller adds the model with no await
        after it, or the load failed), so that a deposit or a load meanwhile cannot take the room made for it; the
        models evicted for it are appended to ``evicted``. Before, the room was made and not held: a deposit during
        the fill took it, and the filled model put the store over its budget."""
        loop = asyncio.get_running_loop()
        held = slots = 0
        ended = False

        async def room(nbytes: int) -> None:
            nonlocal held, slots
            if ended:  # the request the load was for is gone (cancelled): nothing would release this room
                raise OutOfMemoryError("the request this load was for has ended", details={"needed": nbytes})
            victims = self.store.hold(nbytes, models)
            held += nbytes
            slots += models
            if evicted is not None:
                evicted.extend(victims)
            await self._evicted(victims, reason)

        def call(nbytes: int) -> None:
            future = asyncio.run_coroutine_threadsafe(room(nbytes), loop)
            try:
                future.result(60.0)
            except TimeoutError:  # not left to hold the room later, for a load that gave up on it
                future.cancel()
                raise

        try:
            yield call
        finally:
            ended = True
            self.store.unhold(held, slots)

    def _save_to_tier(self, model: ServedModel) -> None:
        """Copy a committed deposit into the host tier in the background (serving goes on meanwhile)."""
        tier = self.tier
        if tier is None:
            return

        async def save() -> None:
            if not model.hold():  # evicted already
                return
            try:
                await asyncio.to_thread(
                    tier.save,
                    model.key,
                    model.slabs[0],
                    model.table,
                    dict(model.aliases),
                    model.payload_bytes,
                    buffers=model.buffers,
                    generation=model.generation,
                )
            except Exception as exc:  # the tier is an optimisation: serving goes on without it
                log.warning("host tier save failed key=%s: %s: %s", model.key.short(), type(exc).__name__, exc)
            finally:
                model.release_hold()  # an eviction meanwhile frees the slab now, not under the save

        task = asyncio.get_running_loop().create_task(save())
        self._tier_saves.add(task)
        task.add_done_callback(self._tier_saves.discard)

    async def _preload(
        self, spec: RankSpec, rid: int, pid: int, *, wanted: dict[str, str | int] | None = None
    ) -> Preloaded | None:
        """Load a model in a worker thread (the daemon keeps serving), after making room for it. The rank
        is planned once: that plan's key answers "already held", its layout the budget, and it is filled from
        the peers (--fill-from) or loaded. One at a time: a second request for the key finds it held."""
        if self.loader is None:
            raise NotFoundError("this daemon was started without a loader for PRELOAD")
        loader = self.loader
        async with self._preload_lock:
            if self._handed_over:  # queued behind a load that ended after the hand-off: nothing is loaded here
                raise _HandedOver
            rp = await asyncio.to_thread(self.planner, spec)
            with rp:
                key = rp.key
                held = self.store.models.get(key)
                if held is not None:
                    self.store.remember_source(held, spec.checkpoint, rp.facts)
                    self._prove_later(rp)
                    return Preloaded(id=rid, key=key.to_wire(), bytes=held.slab_bytes, tensors=len(held.table))
                differ = key.diff_wire(wanted) if wanted is not None else None
                if differ:
                    # a load on demand whose plan gives another key than the request's (a field the variant does
                    # not set: its layout, architecture, one the daemon does not know): loading it would evict for
                    # nothing, the request could not be served from it
                    log.info(
                        "load on demand skipped %s pid=%d: the plan's key %s is not the one asked for (%s)",
                        self._tag,
                        pid,
                        key.short(),
                        ", ".join(sorted(differ)),
                    )
                    return None
                # the planned layout's bytes and the model's slot; a slab the load makes beyond them (a transform's
                # output, a larger host-tier entry of a transformed key) is held too, once its size is known
                with self.store.loading(rp.layout.total_bytes) as evicted:
                    await self._evicted(evicted, "preload")
                    model = None

                    def add(m: ServedModel) -> None:
                        if self._handed_over:  # loaded after the hand-off: the new daemon does not get it
                            m.close()
                            raise _HandedOver
                        self.store.add(m)

                    # a host-tier entry of the key first (the loader refills from it), then the peers, the disk last;
                    # each attempt's room beyond the plan is its own: a failed fill's is given back before the disk's
                    if self.peer_fill is not None and not await asyncio.to_thread(tier_holds, self.tier, key):
                        with self._room_from_thread(0, "preload", evicted) as room:
                            model = await self._filled(
                                functools.partial(self.peer_fill.rank, rp, "loading from disk", room)
                            )
                            if model is not None:
                                add(model)
                    if model is None:
                        with self._room_from_thread(0, "preload", evicted) as room:
                            model = await asyncio.to_thread(loader, rp, room)
                            add(model)
                    self._prove_later(rp)
            if self.keeper is not None:
                await self.keeper.keep(model)
        log.info(
            "preloaded %s pid=%d key=%s origin=%s tensors=%d bytes=%d load_s=%.2f resident=%d models=%d",
            self._tag,
            pid,
            model.key.short(),
            model.origin,
            len(model.table),
            model.slab_bytes,
            model.stats.seconds,
            self.store.resident_bytes,
            len(self.store.models),
        )
        return Preloaded(
            id=rid,
            key=model.key.to_wire(),
            bytes=model.slab_bytes,
            tensors=len(model.table),
            load_seconds=model.stats.seconds,
            evicted=tuple(m.key.to_wire() for m in evicted),
        )

    def render_metrics(self) -> str:
        tier = "device" if self.store.backend.name == "cuda" else "host"
        models = list(self.store.models.values())
        # key.short() leaves fields out (transform, layout, a recipe's): two models can share it, so each sample also
        # names its whole key by digest, as the host tier names its entry of the key (a label set per model, once)
        entries = self.tier.entries() if self.tier is not None else []
        return self.metrics.render(
            resident=[(tier, m.key.short(), HostTier.entry_id(m.key), m.slab_bytes) for m in models]
            + [("host_tier", meta.stem, meta.stem, n) for _, meta, n in entries],
            leases=len(self.store.leases),
            connections=len(self.shell),
            uptime=time.monotonic() - self.started,
            load_seconds=sum(m.stats.seconds for m in models),
            kept=self.keeper.kept(models) if self.keeper is not None else None,
        )

    def status_reply(self, rid: int) -> StatusReply:
        backend = self.store.backend
        free, total = backend.memory_info()
        entries = self.tier.entries() if self.tier is not None else []
        return StatusReply(
            id=rid,
            software=self.software,
            backend=backend.name,
            device=backend.device,
            uptime_seconds=time.monotonic() - self.started,
            connections=len(self.shell),
            models=self.store.model_infos(),
            leases=self.store.lease_infos(),
            device_free_bytes=free,
            device_total_bytes=total,
            tier_bytes=sum(n for _, _, n in entries),
            tier_budget=self.tier.budget if self.tier is not None else 0,
            tier_entries=len(entries),
            tier_pinned=self.tier.pinned() if self.tier is not None else 0,
        )
