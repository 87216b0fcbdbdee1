"""The server shell: the one place where a wcache service does its connections' I/O.

As websockets' server does around its sans-I/O protocol, the shell owns everything between a listening
socket and a request handler: the accept loop (errors backed off, listen.py), admitting the peer (a
``PeerCheck``), the connection cap with its give-way policy (``ConnectionTable``, listen.py), the handshake
deadline, the receive loop with its frame and idle deadlines, the descriptors that come and go, the
mapping of failures to ERROR frames, and draining on stop. A service — the daemon, the keeper — is a
``Handler``: ``handle(request, fds, context) -> reply`` plus the few facts the shell asks of it (its HELLO_OK,
which connections hold something, what to do when one closes). A handler neither parses bytes (wcache.proto
does) nor touches a socket; the shell interprets nothing a frame says.

Errors (docs/protocol.md §6), by whose fault they are (h11's model, wcache/errors.py):

- a ``RemoteProtocolError`` (the peer broke the protocol): a fatal ERROR of its code, close;
- a ``LocalProtocolError`` (we did: a bug): logged with its traceback, a fatal ``INTERNAL``, close;
- any other ``WCacheError`` from a handler: an ERROR answering that request; the connection serves on;
- anything else from a handler — a bare ``ProtocolError`` included, another party's verdict on what this service
  sent it (a received PROTOCOL_ERROR), which is not this peer's doing: logged with its traceback, ``INTERNAL``
  answering that request; serves on.

Nothing a peer sends ends more than its own connection.

**Transports.** Two seams make the shell serve more than this uid's Unix socket: ``PeerCheck`` says who the
peer is and whether it may speak (``SameUid``: SO_PEERCRED today), and ``channel`` (a ``ChannelFactory``)
builds what moves the bytes (``Channel``: recvmsg/sendmsg with descriptors). A TCP peer service gives the shell
its TCP listener, a check that proves the peer (a TLS handshake, a shared-secret exchange) within the
handshake deadline and returns a ``PeerIdentity`` naming it, and a channel over that transport (one that
carries no descriptors); handler, limits, deadlines and error mapping stay as they are.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from wcache.channel import SERVER_READ_BUDGET, Channel, ReadBudget, close_fds, peer_credentials
from wcache.errors import (
    InternalError,
    LimitExceededError,
    LocalProtocolError,
    PermissionDeniedError,
    ProtocolError,
    RemoteProtocolError,
    WCacheError,
)
from wcache.proto import Connection, ErrorFrame, Frame, Hello, HelloOk, Misdirected, Phase, Role, Service
from wcache.proto.codec import MAX_REQUEST_SIZE
from wcache.proto.connection import Event
from wcache.server.listen import ConnectionTable, Peer, accept_loop
from wcache.server.metrics import Metrics

if TYPE_CHECKING:
    import argparse

__all__ = [
    "ChannelFactory",
    "ConnectionLimits",
    "Context",
    "Handler",
    "PeerCheck",
    "PeerIdentity",
    "Refusal",
    "Reply",
    "SameUid",
    "Shell",
    "add_log_level",
    "stop_on_signals",
]

#: ``--log-level``'s choices, the same for wcache-server and wcache-keeper (logging's own level names)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A receive whose caller went away (a timeout, a stop, an eviction): its exception is not news, and the
    descriptors of a frame it did receive are closed, not leaked."""
    if task.cancelled() or task.exception() is not None:
        return
    close_fds(task.result()[1])


@dataclass(frozen=True)
class ConnectionLimits:
    """What one service's connections may hold and how long they may stall (docs/security.md, "Who can
    connect" and "idle peers")."""

    #: connections at once; at the cap a new one takes the place of one that holds nothing (listen.py)
    connections: int = 1024
    #: the peer check and HELLO must be done this soon after connecting (an unproven peer holds a slot)
    handshake_timeout: float = 3.0
    #: an open connection that holds nothing (``Handler.holds``) and is silent this long is closed (None: never)
    idle_timeout: float | None = None
    #: while a silent connection holds something, ``Handler.holds`` is asked again this often (a fill held past
    #: its time holds nothing: the idle timeout then counts)
    hold_recheck: float = 5.0
    #: once part of a frame has arrived, the rest must arrive within this many seconds
    frame_timeout: float = 10.0
    #: a reply must be taken by the peer within this many seconds, else the peer is closed (None: no deadline)
    send_timeout: float | None = 10.0
    #: the largest frame body a peer may send after the handshake (before it: 64 KiB, docs/protocol.md §7)
    max_frame_size: int = MAX_REQUEST_SIZE
    #: descriptors sent to one peer and not yet read by it (None: a share of RLIMIT_NOFILE, set at start())
    max_unread_fds: int | None = None
    #: on stop, requests being answered get this long to finish before every connection is closed
    shutdown_grace: float = 5.0


@dataclass(frozen=True)
class PeerIdentity:
    """Who is on a connection, as its transport proved it. ``pid`` and ``uid``: the kernel's word for a Unix
    peer (SO_PEERCRED); -1 where the transport cannot tell (TCP). ``principal``: whom a TLS certificate or a
    shared secret names (empty for a Unix peer)."""

    pid: int = -1
    uid: int = -1
    principal: str = ""


class Refusal(NamedTuple):
    """A peer check's verdict against a peer: ``reason`` for the log line, ``error`` (fatal) for the peer."""

    reason: str
    error: PermissionDeniedError


class PeerCheck(Protocol):
    """Admits a connection's peer before the shell reads a frame of it, within the handshake deadline."""

    async def identify(self, ch: Channel[Connection]) -> PeerIdentity:
        """Who the peer is (a TLS or shared-secret check runs its exchange here, on the channel)."""
        ...

    def refusal(self, peer: PeerIdentity) -> Refusal | None:
        """Why ``peer`` may not speak to this service (None: it may)."""
        ...


class SameUid:
    """The Unix socket's check: only processes of this uid (the kernel's SO_PEERCRED) may speak; ``owner``
    names the service in the refusal ("the daemon's uid")."""

    def __init__(self, owner: str, uid: int | None = None) -> None:
        self.owner = owner
        self.uid = os.geteuid() if uid is None else uid

    async def identify(self, ch: Channel[Connection]) -> PeerIdentity:
        creds = peer_credentials(ch.sock)
        return PeerIdentity(pid=creds.pid, uid=creds.uid)

    def refusal(self, peer: PeerIdentity) -> Refusal | None:
        if peer.uid == self.uid:
            return None
        return Refusal(
            "uid-mismatch",
            PermissionDeniedError(
                f"peer uid {peer.uid} is not the {self.owner}'s uid {self.uid}", details={"peer_uid": peer.uid}
            ),
        )


class ChannelFactory(Protocol):
    """What moves one connection's bytes: ``Channel`` for a Unix socket (descriptors ride along)."""

    def __call__(
        self,
        sock: socket.socket,
        conn: Connection,
        *,
        budget: ReadBudget | None,
        send_timeout: float | None,
        max_unread_fds: int | None,
    ) -> Channel[Connection]: ...


@dataclass(eq=False)
class Context:
    """What a handler is told of the connection a request came on: its id (the key of what the connection
    holds, e.g. a daemon's leases) and its peer."""

    id: int
    peer: PeerIdentity = field(default_factory=PeerIdentity)
    _end: Callable[[], object] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.peer.pid

    def end(self) -> None:
        """Close this connection now, telling its peer nothing (a deadline of the handler's own ran out: the
        hand-off's); ``Handler.closed`` follows as for any end."""
        if self._end is not None:
            self._end()


@dataclass(frozen=True)
class Reply:
    """A handler's answer to one request. ``fds`` are the handler's (a slab's own descriptors): sent with the
    frame, never closed here. ``undo``: when the kernel refuses the descriptors (ETOOMANYREFS: nothing went
    out), take back what granting the reply did (a lease, a deposit); the request is then answered with a
    non-fatal LIMIT_EXCEEDED. ``after``: once the reply is out (a hand-off stops the daemon then)."""

    frame: Frame
    fds: list[int] | tuple[int, ...] = ()
    undo: Callable[[], None] | None = None
    after: Callable[[], None] | None = None


class Handler(Protocol):
    """A service as the shell sees it: the daemon (wcache/server/daemon.py), the keeper (keeper.py)."""

    #: the requests it answers: the connection marks the others' as Misdirected, which the shell answers itself
    service: Service
    #: what a connection of this service can hold, for log lines and the give-way message ("lease")
    holding: str
    #: whether its connections pass through the AUTH phase after HELLO_OK (the peer channel's shared-secret
    #: proofs, docs/protocol.md §10.2): only proofs travel until the handler answers one with PEER_AUTH_OK
    auth: bool

    def hello(self, conn: Connection, hello: Hello, ctx: Context) -> HelloOk:
        """The HELLO_OK for ``hello`` (``conn.hello_reply`` with this service's fields)."""
        ...

    async def handle(self, request: Frame, fds: list[int], ctx: Context) -> Reply | Frame:
        """Answer one request of this service. ``fds``: the descriptors it brought (KEEP); those the handler
        keeps it removes from the list, the shell closes the rest. Raise a WCacheError to refuse it (the
        connection serves on); return a fatal ERROR frame to refuse it and end the connection (a failed proof)."""
        ...

    def holds(self, ctx: Context) -> bool:
        """Whether the connection holds something its closing would break (a daemon's leases): it is then never
        closed for silence, nor to make room (cheap: asked before every receive)."""
        ...

    def protects(self) -> Callable[[Context], bool]:
        """Connections never closed to make room although they hold nothing (a keeper's daemons). Asked only at
        the connection cap, once per admission: the predicate may cost a system call to build."""
        ...

    def closed(self, ctx: Context) -> None:
        """The connection ended, for any reason: drop what it held."""
        ...


def raise_nofile() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (descriptors queued in sockets that peers have not read
    count against this uid's, unless root); returns the soft limit now (2**20 standing for unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def unread_fd_share(connections: int, tag: str, log: logging.Logger) -> int:
    """Each peer's share of this uid's RLIMIT_NOFILE (raised first) for descriptors sent and not yet read;
    a warning when ``connections`` such peers could exhaust it."""
    soft = raise_nofile()
    share = max(1, min(64, soft // 16))
    worst = connections * share
    if os.geteuid() != 0 and worst > soft:
        log.warning(
            "fd limits %s nofile=%d: %d connections x %d unread descriptors each could exhaust it; "
            "raise the hard limit (ulimit -Hn, LimitNOFILE=) for full isolation of engines that do not read",
            tag,
            soft,
            connections,
            share,
        )
    return share


def add_log_level(p: argparse.ArgumentParser) -> None:
    """``--log-level``, as wcache-server and wcache-keeper both take it: one of LOG_LEVELS in any case, listed
    in ``--help``; anything else is a usage error (exit 2), not a traceback from ``logging`` at start."""
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=LOG_LEVELS,
        help="log lines on stderr at or above this level (default INFO: one line per event that matters)",
    )


def ignore_hangup() -> None:
    """SIGHUP ignored from now on (a daemon or keeper started from a terminal with ``&`` gets it when the terminal
    closes; its default action would end the process with no drain, leaving leases dropped, a keeper's slabs freed,
    the socket and its lock behind). ``stop_on_signals`` logs each one it gets while serving."""
    with contextlib.suppress(ValueError, OSError):  # not the main thread: the caller's own signals stand
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


@contextlib.contextmanager
def stop_on_signals(
    stop: Callable[[], None], *, signals: bool = True, log: logging.Logger | None = None, tag: str = ""
) -> Iterator[None]:
    """SIGTERM and SIGINT call ``stop`` while inside (with ``signals``; off for a service run inside a test); SIGHUP
    is ignored, with a line in ``log`` (``ignore_hangup``)."""
    loop = asyncio.get_running_loop()
    sigs = (signal.SIGTERM, signal.SIGINT) if signals else ()
    for sig in sigs:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop)
    hup = signals and log is not None

    def hangup() -> None:
        assert log is not None
        log.warning("SIGHUP ignored %s: still serving (stop it with SIGTERM)", tag)

    if hup:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, hangup)
    try:
        yield
    finally:
        for sig in (*sigs, signal.SIGHUP) if hup else sigs:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
        if hup:
            ignore_hangup()  # remove_signal_handler restored the default action


class Shell:
    """Serves ``handler`` on a listening socket: ``start(listener)``, later ``close()`` (no new connections)
    and ``drain()`` (answer what is in flight, then end every connection). ``tag`` starts every log line
    (``socket=PATH``); ``log`` is the service's logger, so its lines keep their names."""

    def __init__(
        self,
        handler: Handler,
        *,
        limits: ConnectionLimits,
        tag: str,
        log: logging.Logger,
        peer_check: PeerCheck,
        channel: ChannelFactory = Channel,
        budget: ReadBudget | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.tag = tag
        self.log = log
        self.peer_check = peer_check
        self.channel = channel
        self.budget = budget
        #: connections accepted and ERROR codes sent (by name): the daemon renders them at /metrics
        self.metrics = metrics if metrics is not None else Metrics()
        self.listener: socket.socket | None = None
        self.max_unread_fds = limits.max_unread_fds
        self._table = ConnectionTable(limits.connections)
        self._contexts: dict[int, Context] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._accept: asyncio.Future[None] | None = None
        self._closed = False
        self._next_id = 1

    def __len__(self) -> int:
        """Connections open now."""
        return len(self._tasks)

    # ------------------------------------------------------------------ lifecycle
    def start(self, listener: socket.socket) -> None:
        """Accept connections on ``listener`` (a bound, listening socket) from now on."""
        if self.max_unread_fds is None:
            self.max_unread_fds = unread_fd_share(self.limits.connections, self.tag, self.log)
        listener.setblocking(False)
        self.listener = listener
        self.resume_accepting()

    def limit_connections(self, connections: int) -> None:
        """Lower the connection cap before ``start`` (the daemon's share of its descriptors)."""
        self.limits = replace(self.limits, connections=connections)
        self._table.limit = connections

    def stop_accepting(self) -> None:
        """Accept nothing more for now (connections wait in the listener's queue: a hand-off leaves them to the
        new daemon); the listener stays open."""
        if self._accept is not None:
            self._accept.cancel()
            self._accept = None

    def resume_accepting(self) -> None:
        assert self.listener is not None
        if self._accept is None and not self._closed:
            self._accept = asyncio.ensure_future(accept_loop(self.listener, self._accepted, self.tag))

    async def close(self) -> None:
        """Stop accepting and close the listener (connections already open stay: ``drain``)."""
        self._closed = True
        accept, self._accept = self._accept, None
        if accept is not None:
            accept.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await accept
        if self.listener is not None:
            self.listener.close()

    async def drain(self) -> None:
        """Let requests being answered finish (up to ``shutdown_grace``), then close every connection."""
        deadline = time.monotonic() + self.limits.shutdown_grace
        while any(p.busy for p in self._table.peers.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ admission
    def _accepted(self, sock: socket.socket) -> None:
        conn_id = self._next_id
        self._next_id += 1
        self.metrics.connections_total += 1
        room = self._table.make_room(self._pinned())
        if isinstance(room, Peer):
            self.log.info(
                "closing %s conn=%d reason=%s to admit a new connection (limit %d)",
                self.tag,
                room.id,
                "no-hello" if not room.open else f"idle-no-{self.handler.holding}",
                self.limits.connections,
            )
        slot = Peer(conn_id)
        ctx = self._contexts[conn_id] = Context(conn_id)
        task = asyncio.ensure_future(self._serve(sock, slot, ctx, refuse=room is None))
        ctx._end = task.cancel
        slot.task = task
        self._table.add(slot)
        self._tasks[conn_id] = task
        task.add_done_callback(self._forget(conn_id))

    def _forget(self, conn_id: int) -> Callable[[asyncio.Task[None]], None]:
        def done(_task: asyncio.Task[None]) -> None:
            self._tasks.pop(conn_id, None)
            self._contexts.pop(conn_id, None)
            self._table.remove(conn_id)

        return done

    def _pinned(self) -> Callable[[int], bool]:
        """Which connections the table may not close for room: those holding something, and those the handler
        protects (its predicate built once, and only if the table asks: at the cap)."""
        protected: Callable[[Context], bool] | None = None

        def pinned(conn_id: int) -> bool:
            nonlocal protected
            ctx = self._contexts.get(conn_id)
            if ctx is None:
                return False
            if self.handler.holds(ctx):
                return True
            if protected is None:
                protected = self.handler.protects()
            return protected(ctx)

        return pinned

    # ------------------------------------------------------------------ one connection
    async def _next_request(self, ch: Channel[Connection], ctx: Context) -> tuple[Frame, list[int]]:
        """The connection's next request. A connection that holds what the service serves (``handler.holds``: a
        lease, a fill) may be silent as long as it holds it; once it holds nothing, ``idle_timeout`` counts and
        ends it (TimeoutError). ``holds`` is asked again every ``hold_recheck`` seconds while it says yes: it was asked
        once before the wait, so a peer that took a fill and went silent was never asked again and held its
        fill, its ``--peer-max-fills`` slot and the slab for ever, past ``max_fill_seconds``."""
        idle = self.limits.idle_timeout
        loop = asyncio.get_running_loop()
        recv = asyncio.ensure_future(ch.receive(frame_timeout=self.limits.frame_timeout))
        quiet_from: float | None = None  # since when it holds nothing
        step: float | None
        try:
            while not recv.done():
                if self.handler.holds(ctx):
                    quiet_from, step = None, self.limits.hold_recheck
                else:
                    now = loop.time()
                    quiet_from = now if quiet_from is None else quiet_from
                    step = None if idle is None else quiet_from + idle - now
                    if step is not None and step <= 0:
                        raise TimeoutError(f"idle for {idle} s holding no {self.handler.holding}")
                await asyncio.wait({recv}, timeout=step)
        except BaseException:
            recv.add_done_callback(_retrieved)  # nobody takes what it got
            if not recv.done():
                recv.cancel()
                # its cleanup (the channel's reader removed) runs before the caller closes the socket: after,
                # it could remove the reader of a new connection given the same descriptor number
                await asyncio.wait({recv})
            raise
        return recv.result()

    async def _serve(self, sock: socket.socket, slot: Peer, ctx: Context, *, refuse: bool) -> None:
        lim, log, tag = self.limits, self.log, self.tag
        conn = Connection(
            Role.SERVER, service=self.handler.service, max_frame_size=lim.max_frame_size, auth=self.handler.auth
        )
        budget = self.budget if self.budget is not None else SERVER_READ_BUDGET
        ch = self.channel(sock, conn, budget=budget, send_timeout=lim.send_timeout, max_unread_fds=self.max_unread_fds)
        try:
            async with asyncio.timeout(lim.handshake_timeout):
                if not await self._admit(ch, ctx, refuse=refuse):
                    return
                hello, _ = await ch.receive()
            assert isinstance(hello, Hello)  # the transition table admits nothing else here
            await ch.send(self.handler.hello(conn, hello, ctx))
            slot.open = True
            slot.touch()
            while True:
                frame, fds = await self._next_request(ch, ctx)
                slot.touch()
                slot.busy = True
                try:
                    await self._answer(ch, frame, fds, ctx)
                finally:
                    close_fds(fds)  # what the request brought and the handler did not keep
                    slot.busy = False
                    slot.touch()
                if conn.phase is Phase.CLOSED:  # the handler answered with a fatal ERROR: the connection ends
                    return
        except LocalProtocolError as exc:  # our own bug, not the peer's: never answered with PROTOCOL_ERROR
            log.exception("internal protocol error %s pid=%d error=%s", tag, ctx.pid, exc.message)
            self.metrics.errors["INTERNAL"] += 1
            with contextlib.suppress(Exception):
                bug = InternalError(
                    f"the {self.handler.service.value} broke the protocol (a bug; report it): {exc.message}"
                )
                await asyncio.wait_for(ch.send_bytes(conn.fatal_error(bug)), 1.0)
        except RemoteProtocolError as exc:
            log.warning("protocol error %s pid=%d code=%s error=%s", tag, ctx.pid, exc.code.name, exc.message)
            self.metrics.errors[exc.code.name] += 1
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ch.send_bytes(conn.fatal_error(exc)), 1.0)
        except TimeoutError as exc:
            reason = str(exc) or (f"no HELLO within {lim.handshake_timeout} s" if not slot.open else "timeout")
            log.info("connection timed out %s pid=%d reason=%s", tag, ctx.pid, reason)
        except (EOFError, ConnectionError):
            pass
        except asyncio.CancelledError:
            if slot.evicted:  # closed to admit a newer connection: say so if the socket takes it at once
                with contextlib.suppress(Exception):
                    why = "no HELLO yet" if not slot.open else f"idle, holding no {self.handler.holding}"
                    err = LimitExceededError(
                        f"closed to admit a new connection ({why}; limit {lim.connections}): reconnect"
                    )
                    sock.send(conn.fatal_error(err))
        except Exception:  # never let one connection take the service down
            log.exception("connection handler failed %s pid=%d", tag, ctx.pid)
        finally:
            try:
                self.handler.closed(ctx)
            finally:
                ch.close()

    async def _admit(self, ch: Channel[Connection], ctx: Context, *, refuse: bool) -> bool:
        """Who the peer is, and whether it may speak: else a fatal ERROR (False). ``refuse``: at the cap, no
        connection could give way to this one."""
        lim, conn = self.limits, ch.conn
        ctx.peer = await self.peer_check.identify(ch)
        refusal = self.peer_check.refusal(ctx.peer)
        if refusal is not None:
            self.log.warning("refused %s pid=%d uid=%d reason=%s", self.tag, ctx.pid, ctx.peer.uid, refusal.reason)
            self.metrics.errors[refusal.error.code.name] += 1
            await ch.send_bytes(conn.fatal_error(refusal.error))
            return False
        if refuse:  # every connection holds something or is busy: none can give way
            self.log.warning("refused %s pid=%d reason=connection-limit limit=%d", self.tag, ctx.pid, lim.connections)
            self.metrics.errors["LIMIT_EXCEEDED"] += 1
            limit = LimitExceededError(
                f"too many connections (limit {lim.connections}); try again later", details={"limit": lim.connections}
            )
            await ch.send_bytes(conn.fatal_error(limit))
            return False
        return True

    async def _answer(self, ch: Channel[Connection], frame: Event, fds: list[int], ctx: Context) -> None:
        """One request: the handler's reply, or the ERROR its failure maps to."""
        rid = getattr(frame, "id", 0)
        try:
            if isinstance(frame, Misdirected):  # another service's request: NOT_FOUND, not fatal
                raise frame.error
            await self._send(ch, frame, await self._handle(frame, rid, fds, ctx))
        except (RemoteProtocolError, LocalProtocolError):
            raise  # the peer's: a fatal ERROR and close; ours: logged as a bug, a fatal INTERNAL
        except WCacheError as exc:
            self.log.info("request refused %s pid=%d code=%s error=%s", self.tag, ctx.pid, exc.code.name, exc.message)
            self.metrics.errors[exc.code.name] += 1
            await ch.send(ErrorFrame.from_exception(exc, rid))

    async def _handle(self, frame: Frame, rid: int, fds: list[int], ctx: Context) -> Reply:
        try:
            out = await self.handler.handle(frame, fds, ctx)
        except (RemoteProtocolError, LocalProtocolError):
            raise  # this peer's break, or ours: fatal (``_serve``)
        except WCacheError as exc:
            if not isinstance(exc, ProtocolError):
                raise  # a refusal: this request's ERROR (``_answer``)
            failure: Exception = exc  # another party's verdict on what the handler sent it: not this peer's doing
        except Exception as exc:  # a bug or an unexpected failure inside the handler
            failure = exc
        else:
            return out if isinstance(out, Reply) else Reply(out)
        self.log.exception("request failed %s pid=%d", self.tag, ctx.pid)
        self.metrics.errors["INTERNAL"] += 1
        return Reply(ErrorFrame.from_exception(InternalError(f"{type(failure).__name__}: {failure}"), rid))

    async def _send(self, ch: Channel[Connection], request: Frame, reply: Reply) -> None:
        try:
            await ch.send(reply.frame, reply.fds)
        except OSError as exc:
            if exc.errno != errno.ETOOMANYREFS:
                raise
            # nothing went out (the kernel refuses at the first byte): the reply was never given
            ch.conn.retract(request)
            if reply.undo is not None:
                reply.undo()
            raise LimitExceededError(
                "too many descriptors are in flight to peers that have not read them (this uid's "
                f"RLIMIT_NOFILE, {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}); retry shortly"
            ) from exc
        if reply.after is not None:
            reply.after()
