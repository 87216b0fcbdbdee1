"""The asyncio Unix-socket server: accept, check the peer, move bytes, dispatch.

Parsing lives in wcache.proto, lease logic in store.py; this module only moves bytes
between sockets and Connection objects and turns failures into ERROR frames. Nothing a
client sends can stop the daemon: every exception in a connection's handler ends at
most that connection (docs/protocol.md §6).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import signal
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import assert_never, cast

from wcache.channel import DEFAULT_READ_BUDGET, Channel, ReadBudget, peer_credentials
from wcache.errors import (
    DeviceMismatchError,
    FrameTooLargeError,
    InternalError,
    InUseError,
    KeyMismatchError,
    LimitExceededError,
    LocalProtocolError,
    NotFoundError,
    PermissionDeniedError,
    ProtocolError,
    UnexpectedFrameError,
    UnknownLeaseError,
    UnsupportedPlatformError,
    WCacheError,
)
from wcache.key import WeightCacheKey
from wcache.proto import (
    DEFAULT_MAX_FRAME_SIZE,
    Commit,
    Connection,
    DaemonRequest,
    Deposit,
    ErrorFrame,
    Evict,
    Evicted,
    GetState,
    HandedModel,
    Hello,
    Misdirected,
    Preload,
    Preloaded,
    Release,
    Role,
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
from wcache.rank import RankPlan, RankSpec, plan_rank
from wcache.recipe import key_from_wire
from wcache.server.keeper_link import KeeperLink
from wcache.server.listen import ConnectionTable, Peer, accept_loop, bind_private_socket
from wcache.server.metrics import Metrics, serve_metrics
from wcache.server.store import ServedModel, Store, split_descriptors
from wcache.server.tier import HostTier, TierEntry

__all__ = ["Daemon"]

log = logging.getLogger("wcache.server")


class Daemon:
    def __init__(
        self,
        store: Store,
        socket_path: Path,
        *,
        software: str,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        handshake_timeout: float = 3.0,
        idle_timeout: float | None = None,
        frame_timeout: float = 10.0,
        send_timeout: float = 10.0,
        max_connections: int = 1024,
        read_budget: int = DEFAULT_READ_BUDGET,
        max_unread_fds: int | None = None,
        shutdown_grace: float = 5.0,
        metrics_port: int = 0,
        loader: Callable[[RankPlan], ServedModel] | None = None,
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
    ) -> None:
        self.store = store
        self.socket_path = Path(socket_path)
        self.software = software
        self.max_frame_size = max_frame_size
        #: no client -> daemon frame is large: requests are capped far below --max-frame-size (§7)
        self.max_request_size = min(max_frame_size, MAX_REQUEST_SIZE)
        #: HELLO must arrive this soon after connecting (an unauthenticated peer holds a connection slot)
        self.handshake_timeout = handshake_timeout
        #: an open connection holding no lease and silent this long is closed (None: never); a connection
        #: holding a lease is never closed for silence (its leases live with it, docs/security.md)
        self.idle_timeout = idle_timeout
        self.frame_timeout = frame_timeout
        #: a reply must be taken by the peer within this many seconds, else the peer is closed
        self.send_timeout = send_timeout
        self.max_connections = max_connections
        self.read_budget = ReadBudget(read_budget)
        #: descriptors sent to one peer and not yet read by it (None: from RLIMIT_NOFILE at serve())
        self.max_unread_fds = max_unread_fds
        self._peers = ConnectionTable(max_connections)
        self.shutdown_grace = shutdown_grace
        self.metrics_port = metrics_port
        self.metrics = Metrics()
        #: PRELOAD and load-on-demand: plan a RankSpec once (headers, fingerprint), then load that plan
        self.loader = loader
        self.planner = planner
        #: --verify-content: the fingerprint kind of every rank this daemon plans (not a PRELOAD field)
        self.verify_content = verify_content
        self.load_on_demand = load_on_demand
        self._preload_lock = asyncio.Lock()
        self.started = time.monotonic()
        self._stop = asyncio.Event()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._busy: set[int] = set()
        self._next_conn = 1
        self._uid = os.geteuid()
        self._tag = f"socket={self.socket_path}"
        #: a listening socket handed over by the previous daemon (--takeover), used instead of binding
        self._listener: socket.socket | None = listener
        self._on_handover = on_handover
        self.tier = tier
        #: fills a slab from a host-tier entry (the loader's threads and staging): deposits come back this way
        self.tier_restore = tier_restore
        self._tier_saves: set[asyncio.Task[None]] = set()
        #: wcache-keeper holding this daemon's slabs across restarts (--keeper): told of every load and eviction
        self.keeper = keeper
        self.keeper_check = keeper_check
        #: TAKEOVER: from TAKEOVER_STATE sent until the new daemon's TAKEOVER_ADOPTED (or the hand-off fails);
        #: a new daemon silent for longer than this gives the hand-off up (docs/protocol.md §4.10)
        self.handoff_timeout = handoff_timeout
        self._handing_over = False
        self._handed_over = False
        self._accept_task: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        self._stop.set()

    async def serve(self, on_ready: object | None = None) -> None:
        """Serve until stop() or SIGTERM/SIGINT; then drain and unlink the socket."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop)
        self._fd_limits()
        listener = self._listener if self._listener is not None else bind_private_socket(self.socket_path)
        listener.setblocking(False)
        self._listener = listener
        http = await serve_metrics(self.metrics_port, self.render_metrics) if self.metrics_port else None
        if callable(on_ready):
            on_ready()
        self._resume_accepting()
        watch = asyncio.ensure_future(self._watch_keeper()) if self.keeper is not None else None
        try:
            await self._stop.wait()
        finally:
            if http is not None:
                http.close()
            for task in (self._accept_task, watch):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            listener.close()
            if not self._handed_over:  # after a hand-off the socket file is the new daemon's
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path)
            await self._drain()
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
            log.info("stopped %s leases_ended=%d", self._tag, len(self.store.leases))

    def _resume_accepting(self) -> None:
        if self._accept_task is None and self._listener is not None and not self._stop.is_set():
            self._accept_task = asyncio.ensure_future(accept_loop(self._listener, self._accepted, self._tag))

    def _pause_accepting(self) -> None:
        """New connections queue on the listening socket (shared with a new daemon during a hand-off)."""
        if self._accept_task is not None:
            self._accept_task.cancel()
            self._accept_task = None

    def _fd_limits(self) -> None:
        """Descriptors queued in sockets that peers have not read count against this uid's RLIMIT_NOFILE
        (unless root): raise the soft limit to the hard one, and give each peer a share of it. Connections and
        slabs (models, deposits in progress) get their shares of it too (``split_descriptors``), so that no
        peer can make the daemon run out of descriptors to accept and answer with."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 1 << 20
        if soft != resource.RLIM_INFINITY and soft < want:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
                soft = want
        nofile = soft if soft != resource.RLIM_INFINITY else 1 << 20
        connections, slabs = split_descriptors(nofile, self.max_connections)
        self.store.fit_descriptors(slabs)
        if connections < self.max_connections:
            self.max_connections = self._peers.limit = connections
        log.info(
            "descriptor shares %s nofile=%d connections=%d models=%d deposits=%d",
            self._tag,
            nofile,
            self.max_connections,
            self.store.max_models,
            self.store.max_deposits,
        )
        if self.max_unread_fds is None:
            self.max_unread_fds = max(1, min(64, soft // 16))
        worst = self.max_connections * self.max_unread_fds
        if os.geteuid() != 0 and worst > soft:
            log.warning(
                "fd limits %s nofile=%d: %d connections x %d unread descriptors each could exhaust it; "
                "raise the hard limit (ulimit -Hn, LimitNOFILE=) for full isolation of engines that do not read",
                self._tag,
                soft,
                self.max_connections,
                self.max_unread_fds,
            )

    async def _watch_keeper(self) -> None:
        """Every ``keeper_check`` seconds: a keeper that restarted holds nothing; deposit the models again."""
        assert self.keeper is not None
        while True:
            await asyncio.sleep(self.keeper_check)
            await self.keeper.check(lambda: list(self.store.models.values()))

    async def _drain(self) -> None:
        """Let requests being answered finish (up to shutdown_grace), then close every connection."""
        deadline = time.monotonic() + self.shutdown_grace
        while self._busy and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _accepted(self, sock: socket.socket) -> None:
        conn_id = self._next_conn
        self._next_conn += 1
        self.metrics.connections_total += 1
        room = self._peers.make_room(lambda cid: self.store.held_by(cid) > 0)
        if isinstance(room, Peer):
            log.info(
                "closing %s conn=%d reason=%s to admit a new connection (limit %d)",
                self._tag,
                room.id,
                "no-hello" if not room.open else "idle-no-lease",
                self.max_connections,
            )
        peer = Peer(conn_id)
        task = asyncio.ensure_future(self._serve_connection(sock, peer, refuse=room is None))
        peer.task = task
        self._peers.add(peer)
        self._tasks[conn_id] = task
        task.add_done_callback(self._forget(conn_id))

    def _forget(self, conn_id: int) -> Callable[[asyncio.Task[None]], None]:
        def done(_task: asyncio.Task[None]) -> None:
            self._tasks.pop(conn_id, None)
            self._peers.remove(conn_id)

        return done

    # ------------------------------------------------------------------ one connection
    async def _serve_connection(self, sock: socket.socket, peer: Peer, *, refuse: bool = False) -> None:
        conn_id = peer.id
        conn = Connection(Role.SERVER, service=Service.DAEMON, max_frame_size=self.max_request_size)
        ch = Channel(
            sock,
            conn,
            budget=self.read_budget,
            send_timeout=self.send_timeout,
            max_unread_fds=self.max_unread_fds,
        )
        pid = -1
        try:
            creds = peer_credentials(sock)
            pid = creds.pid
            if creds.uid != self._uid:
                log.warning("refused %s pid=%d uid=%d reason=uid-mismatch", self._tag, creds.pid, creds.uid)
                self.metrics.errors["PERMISSION_DENIED"] += 1
                await ch.send_bytes(
                    conn.fatal_error(
                        PermissionDeniedError(
                            f"peer uid {creds.uid} is not the daemon's uid {self._uid}",
                            details={"peer_uid": creds.uid},
                        )
                    )
                )
                return
            if refuse:  # every connection holds leases or is busy: none can give way
                log.warning("refused %s pid=%d reason=connection-limit limit=%d", self._tag, pid, self.max_connections)
                self.metrics.errors["LIMIT_EXCEEDED"] += 1
                limit = LimitExceededError(f"too many connections (limit {self.max_connections}); try again later")
                await ch.send_bytes(conn.fatal_error(limit))
                return
            await self._handshake(ch, conn)
            peer.open = True
            peer.touch()
            while True:
                idle = None if self.store.held_by(conn_id) else self.idle_timeout
                try:
                    frame, _ = await asyncio.wait_for(ch.receive(frame_timeout=self.frame_timeout), idle)
                except TimeoutError as exc:
                    raise TimeoutError(str(exc) or f"idle for {idle} s holding no lease") from None
                peer.touch()
                self._busy.add(conn_id)
                peer.busy = True
                try:
                    # the connection lets through only requests (the transition table) of this service, or marks them
                    await self._dispatch(ch, cast("DaemonRequest | Misdirected", frame), conn_id, pid)
                finally:
                    self._busy.discard(conn_id)
                    peer.busy = False
                    peer.touch()
        except LocalProtocolError as exc:  # our own bug, not the peer's: never answered with PROTOCOL_ERROR
            log.exception("internal protocol error %s pid=%d error=%s", self._tag, pid, exc.message)
            self.metrics.errors["INTERNAL"] += 1
            with contextlib.suppress(Exception):
                bug = InternalError(f"the daemon broke the protocol (a bug; report it): {exc.message}")
                await asyncio.wait_for(ch.send_bytes(conn.fatal_error(bug)), 1.0)
        except ProtocolError as exc:
            log.warning("protocol error %s pid=%d code=%s error=%s", self._tag, pid, exc.code.name, exc.message)
            self.metrics.errors[exc.code.name] += 1
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ch.send_bytes(conn.fatal_error(exc)), 1.0)
        except TimeoutError as exc:
            reason = str(exc) or (f"no HELLO within {self.handshake_timeout} s" if not peer.open else "timeout")
            log.info("connection timed out %s pid=%d reason=%s", self._tag, pid, reason)
        except (EOFError, ConnectionError):
            pass
        except asyncio.CancelledError:
            if peer.evicted:  # closed to admit a newer connection: say so if the socket takes it at once
                with contextlib.suppress(Exception):
                    why = "no HELLO yet" if not peer.open else "idle, holding no lease"
                    err = LimitExceededError(
                        f"closed to admit a new connection ({why}; limit {self.max_connections}): reconnect"
                    )
                    sock.send(conn.fatal_error(err))
        except Exception:  # never let one connection take the daemon down
            log.exception("connection handler failed %s pid=%d", self._tag, pid)
        finally:
            ended = self.store.drop_connection(conn_id)
            if ended:
                log.info(
                    "connection closed %s pid=%d leases_ended=%d leases_left=%d",
                    self._tag,
                    pid,
                    len(ended),
                    len(self.store.leases),
                )
            ch.close()

    async def _handshake(self, ch: Channel, conn: Connection) -> None:
        frame, _ = await asyncio.wait_for(ch.receive(), self.handshake_timeout)
        assert isinstance(frame, Hello)  # the transition table admits nothing else here
        backend = self.store.backend
        reply = conn.hello_reply(
            frame, software=self.software, backend=backend.name, device=backend.device, server_pid=os.getpid()
        )
        await ch.send(reply)

    async def _dispatch(self, ch: Channel, frame: DaemonRequest | Misdirected, conn_id: int, pid: int) -> None:
        rid = frame.id
        try:
            match frame:
                case GetState():
                    t0 = time.perf_counter()
                    try:
                        state, fds, model = self.store.acquire(conn_id, pid, frame)
                    except (KeyMismatchError, NotFoundError):
                        if not await self._load_on_demand(frame, pid):
                            raise
                        state, fds, model = self.store.acquire(conn_id, pid, frame)
                    try:
                        await ch.send(state, fds)
                    except OSError as exc:
                        if exc.errno != errno.ETOOMANYREFS:
                            raise
                        # nothing went out (the kernel refuses at the first byte): the lease was never granted
                        self.store.revoke(state.lease)
                        ch.conn.retract_state(state)
                        raise LimitExceededError(
                            "too many descriptors are in flight to engines that have not read them (this uid's "
                            f"RLIMIT_NOFILE, {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}); retry shortly"
                        ) from exc
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
                case Release():
                    released = self.store.release(conn_id, frame)
                    await ch.send(released)
                    self.metrics.releases += 1
                    log.info(
                        "lease released %s pid=%d lease=%d leases_left=%d",
                        self._tag,
                        pid,
                        frame.lease,
                        released.leases_left,
                    )
                case Status():
                    await ch.send(self.status_reply(frame.id))
                case Preload():
                    spec = RankSpec.from_preload(frame, verify_content=self.verify_content)
                    await ch.send(await self._preload(spec, frame.id, pid))
                case Takeover():
                    await self._hand_over(ch, frame, pid)
                case TakeoverAdopted():  # answered inside _hand_over; anywhere else there is no hand-off
                    raise UnknownLeaseError("TAKEOVER_ADOPTED with no hand-off open on this connection")
                case Evict():
                    gone = self.store.evict(frame.key)
                    if self.keeper is not None:
                        await self.keeper.unkeep(gone)
                    await ch.send(Evicted(id=frame.id, key=gone.key.to_wire(), bytes=gone.slab_bytes))
                    log.info(
                        "evicted %s pid=%d key=%s bytes=%d resident=%d",
                        self._tag,
                        pid,
                        gone.key.short(),
                        gone.slab_bytes,
                        self.store.resident_bytes,
                    )
                case Deposit():
                    await self._deposit(ch, frame, conn_id, pid)
                case Commit():
                    await self._commit(ch, frame, conn_id, pid)
                case Misdirected():  # a keeper's request: the connection says NOT_FOUND, not fatal
                    raise frame.error
                case _:
                    assert_never(frame)
        except ProtocolError:
            raise  # the peer's: a fatal ERROR and close; ours (LocalProtocolError): logged as a bug
        except WCacheError as exc:
            log.info("request refused %s pid=%d code=%s error=%s", self._tag, pid, exc.code.name, exc.message)
            self.metrics.errors[exc.code.name] += 1
            await ch.send(ErrorFrame.from_exception(exc, rid))
        except (ConnectionError, OSError):
            raise
        except Exception as exc:
            log.exception("request failed %s pid=%d", self._tag, pid)
            self.metrics.errors["INTERNAL"] += 1
            await ch.send(ErrorFrame.from_exception(InternalError(f"{type(exc).__name__}: {exc}"), rid))

    async def _deposit(self, ch: Channel, req: Deposit, conn_id: int, pid: int) -> None:
        """DEPOSIT (docs/protocol.md §4.13): room, a writable slab, DEPOSIT_SLAB with its descriptor. The
        deposit is the connection's until COMMIT: if it closes first, drop_connection frees the slab."""
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
        await ch.send(reply, fds)

    async def _commit(self, ch: Channel, req: Commit, conn_id: int, pid: int) -> None:
        """COMMIT: seal the slab read-only, make room, serve it under the recipe key, tell the keeper."""
        reply, model, old, evicted = self.store.commit_deposit(conn_id, req)
        await self._evicted(evicted, "deposit")
        if self.keeper is not None:
            if old is not None:
                await self.keeper.unkeep(old)
            await self.keeper.keep(model)
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
        await ch.send(reply)
        self._save_to_tier(model)

    async def _hand_over(self, ch: Channel, req: Takeover, pid: int) -> None:
        """TAKEOVER (docs/protocol.md §4.10): give a new daemon (same uid, same device) every model's slabs and
        the listening socket, and stop only once it confirms (TAKEOVER_ADOPTED) that it adopted them all.
        Until then this daemon keeps its lock and its connections; new ones queue on the shared socket. A
        hand-off that fails at any point (refused here, a TAKEOVER_STATE over the new daemon's frame limit,
        the new daemon refusing it, dying or silent past ``handoff_timeout``, the models changing meanwhile)
        leaves this daemon serving and accepting as before. Engines' mappings stay valid either way: they
        reference the memory, not this process."""
        backend = self.store.backend
        if self._handing_over or self._handed_over:
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
        reply = TakeoverState(id=req.id, models=tuple(models), listener_fd=len(fds), pid=os.getpid())
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
        self._handing_over = True
        self._pause_accepting()  # no new connection lands here meanwhile: they queue for whoever serves next
        try:
            await ch.send(reply, [*fds, self._listener.fileno()])
            frame, _ = await asyncio.wait_for(ch.receive(frame_timeout=self.frame_timeout), self.handoff_timeout)
        except (EOFError, OSError) as exc:  # the new daemon refused or died (EOF), or is silent (TimeoutError)
            self._hand_over_failed(pid, f"no TAKEOVER_ADOPTED: {type(exc).__name__} {exc}")
            raise ConnectionAbortedError("hand-off given up") from None
        except BaseException as exc:
            self._hand_over_failed(pid, f"{type(exc).__name__} {exc}")
            raise
        if not isinstance(frame, TakeoverAdopted):
            self._hand_over_failed(pid, f"{frame.TYPE} instead of TAKEOVER_ADOPTED")
            raise UnexpectedFrameError(
                f"{frame.TYPE} after TAKEOVER_STATE: only TAKEOVER_ADOPTED may follow it (the hand-off is off)",
                details={"type": frame.TYPE},
            )
        if frame.models != len(models) or not self._holds(held):
            self._hand_over_failed(pid, f"adopted {frame.models} of {len(models)} models, or they changed")
            refused = InUseError(
                f"the new daemon adopted {frame.models} of the {len(models)} models handed over, or they changed "
                "meanwhile: this daemon serves on; retry the takeover",
                details={"adopted": frame.models, "handed": len(models)},
            )
            await ch.send(ErrorFrame.from_exception(refused, frame.id))
            return
        try:
            await ch.send(TakeoverDone(id=frame.id, pid=os.getpid()))
        except OSError as exc:
            self._hand_over_failed(pid, f"TAKEOVER_DONE not sent: {exc}")
            raise ConnectionAbortedError("hand-off given up") from None
        self._handed_over = True
        log.info(
            "handed over %s to pid=%d models=%d bytes=%d leases_dropped=%d",
            self._tag,
            pid,
            len(models),
            self.store.resident_bytes,
            len(self.store.leases),
        )
        if self._on_handover is not None:
            self._on_handover()  # releases the one-daemon lock for the new daemon
        self.stop()

    def _holds(self, models: list[ServedModel]) -> bool:
        """Whether the store serves exactly ``models`` (the same objects, in any LRU order), as when a hand-off
        began: a fetch meanwhile only reorders them."""
        now = {id(m) for m in self.store.models.values()}
        return len(now) == len(models) and now == {id(m) for m in models}

    def _hand_over_failed(self, pid: int, why: str) -> None:
        self._handing_over = False
        self._resume_accepting()
        log.warning("hand-off failed %s to pid=%d reason=%s: serving on", self._tag, pid, why)

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
        await self._preload(spec, req.id, pid)
        return self.store.lookup(req.key) is not None

    async def _evicted(self, models: Sequence[ServedModel], reason: str) -> None:
        """Models the store evicted to make room: one log line each, and the keeper lets them go too."""
        for m in models:
            log.info("evicted %s key=%s bytes=%d reason=%s", self._tag, m.key.short(), m.slab_bytes, reason)
            if self.keeper is not None:
                await self.keeper.unkeep(m)

    async def _restore_deposit(self, req: GetState, pid: int) -> bool:
        """A deposit evicted (or lost with a restart) whose host-tier entry has the requested recipe key:
        fill a slab from the entry and serve it again (origin "tier"). True if it is served now."""
        if self.tier is None or self.tier_restore is None:
            return False
        tier, restore = self.tier, self.tier_restore
        try:
            key = key_from_wire(dict(req.key))
        except (TypeError, ValueError):
            return False
        async with self._preload_lock:
            if key in self.store.models:
                return True
            entry = await asyncio.to_thread(tier.lookup, key)
            if entry is None:
                return False
            await self._evicted(self.store.make_room(entry.size), "tier-restore")
            model = await asyncio.to_thread(restore, entry, key)
            if model is None:
                return False
            self.store.add(model)
            if self.keeper is not None:
                await self.keeper.keep(model)
        log.info(
            "deposit restored from host tier %s pid=%d key=%s tensors=%d bytes=%d seconds=%.2f",
            self._tag,
            pid,
            key.short(),
            len(model.table),
            model.slab_bytes,
            model.stats.seconds,
        )
        return True

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
                )
            except Exception as exc:  # the tier is an optimisation: serving goes on without it
                log.warning("host tier save failed key=%s: %s: %s", model.key.short(), type(exc).__name__, exc)
            finally:
                model.release_hold()  # an eviction meanwhile frees the slab now, not under the save

        task = asyncio.get_running_loop().create_task(save())
        self._tier_saves.add(task)
        task.add_done_callback(self._tier_saves.discard)

    async def _preload(self, spec: RankSpec, rid: int, pid: int) -> Preloaded:
        """Load a model in a worker thread (the daemon keeps serving), after making room for it. The rank
        is planned once: that plan's key answers "already held", its layout the budget, and it is loaded."""
        if self.loader is None:
            raise NotFoundError("this daemon was started without a loader for PRELOAD")
        loader = self.loader
        async with self._preload_lock:
            rp = await asyncio.to_thread(self.planner, spec)
            with rp:
                key = rp.key
                held = self.store.models.get(key)
                if held is not None:
                    self.store.remember_source(held, spec.checkpoint)
                    return Preloaded(id=rid, key=key.to_wire(), bytes=held.slab_bytes, tensors=len(held.table))
                evicted = self.store.make_room(rp.layout.total_bytes)
                await self._evicted(evicted, "preload")
                model = await asyncio.to_thread(loader, rp)
            self.store.add(model)
            if self.keeper is not None:
                await self.keeper.keep(model)
        log.info(
            "preloaded %s pid=%d key=%s tensors=%d bytes=%d load_s=%.2f resident=%d models=%d",
            self._tag,
            pid,
            model.key.short(),
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
        return self.metrics.render(
            resident=[(tier, m.key.short(), m.slab_bytes) for m in models]
            + [("host_tier", meta.stem, n) for _, meta, n in (self.tier.entries() if self.tier is not None else [])],
            leases=len(self.store.leases),
            connections=len(self._tasks),
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
            connections=len(self._tasks),
            models=self.store.model_infos(),
            leases=self.store.lease_infos(),
            device_free_bytes=free,
            device_total_bytes=total,
            tier_bytes=sum(n for _, _, n in entries),
            tier_budget=self.tier.budget if self.tier is not None else 0,
            tier_entries=len(entries),
        )
