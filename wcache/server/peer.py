"""The source side of a fleet fill (docs/fleet.md): the peer channel's request handler.

``PeerService`` answers the peer frames of docs/protocol.md §10 for the server shell (which owns the TCP
listener, the TLS handshake through ``StreamChannel``, limits, deadlines and the ERROR mapping): the
shared-secret proofs, PEER_QUERY with an offer of the resident slabs that fill the target's key (registered
with NIXL once per slab, their registration dropped just before the slab is freed), PEER_READ paced by
``--peer-max-rate``, RELEASE of a fill's lease, and PEER_FILES. A slab offered to a fill is held
(``ServedModel.hold``) until the fill releases it or its connection ends, so an eviction meanwhile frees it
only afterwards: a READ never meets freed memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from wcache.channel import Channel, ReadBudget
from wcache.errors import LimitExceededError, NotFoundError, PermissionDeniedError, UnknownLeaseError, WCacheError
from wcache.peer_files import checkpoint_files
from wcache.proto import Connection, ErrorFrame, Hello, HelloOk, Release, Released, Service
from wcache.proto.codec import MAX_REQUEST_SIZE
from wcache.proto.fleet_frames import (
    PeerAuth,
    PeerFile,
    PeerFiles,
    PeerFilesReply,
    PeerModel,
    PeerOffer,
    PeerProof,
    PeerQuery,
    PeerRead,
    PeerReadOk,
)
from wcache.proto.frames import Frame
from wcache.server.metrics import Metrics
from wcache.server.nixl import Agent, Registration
from wcache.server.peer_auth import PeerSecurity, SecretServer
from wcache.server.peer_channel import GRANT_SECONDS, MIN_GRANT, StreamChannel
from wcache.server.service import ConnectionLimits, PeerIdentity, Refusal, Reply, Shell
from wcache.server.store import ServedModel, Store

__all__ = ["RESHARD_FIELDS", "PeerListener", "PeerService", "PeerTls", "RateCap", "fills_key"]

log = logging.getLogger("wcache.fleet")

#: key fields a slab of another tensor-parallel layout must share with the target's key to fill it by resharding
RESHARD_FIELDS = ("fingerprint", "fingerprint_kind", "architecture", "dtype", "layout", "transform")
#: a fill's PEER_READs may ask for at most this many times its slab's size in all (each at most the size)
READS_PER_FILL = 2
#: PEER_FILES answers read at once (each up to 48 MiB of files in memory while it is read)
FILES_AT_ONCE = 2


class _Ctx(Protocol):
    """What the shell tells a handler of a connection (its ``Context``): an id, and the peer it proved."""

    id: int


class _Key(Protocol):
    def to_wire(self) -> dict[str, str | int]: ...

    def diff_wire(self, requested: dict[str, Any]) -> dict[str, list[Any]]: ...


def fills_key(served: _Key, wanted: dict[str, str | int]) -> bool:
    """Whether a slab served under ``served`` can fill a target whose key is ``wanted``: exactly that key (as
    GET_STATE matches it), or — both plain checkpoint keys without a load-time transform — the same checkpoint
    in another tensor-parallel layout (§10.3)."""
    if not served.diff_wire(dict(wanted)):
        return True
    mine = served.to_wire()
    if "engine" in mine or "engine" in wanted:  # a recipe key (deposit): its layout is the engine's
        return False
    defaults: dict[str, object] = {"transform": "", "fingerprint_kind": "sampled"}
    if mine.get("transform", "") or wanted.get("transform", ""):
        return False  # a transform's layout only a load of that layout gives
    return all(mine.get(f, defaults.get(f)) == wanted.get(f, defaults.get(f)) for f in RESHARD_FIELDS)


class RateCap:
    """``rate`` bytes per second over every grant (0: none). A virtual clock: a grant of ``n`` bytes is answered
    once the bytes granted before it and these ``n`` are paid for at ``rate``, so what the targets READ after
    their grants never runs ahead of the cap. An idle cap lends at most ``burst`` seconds of its rate (a late
    wake-up, or a target's turnaround between two grants, is made up rather than lost): over any window, what
    is answered is at most the rate times (the window + ``burst``) plus one grant (docs/fleet.md, "Bandwidth
    policy", for what the targets then READ)."""

    def __init__(self, rate: int, burst: float = GRANT_SECONDS) -> None:
        self.rate = rate
        self.burst = burst
        self._free = 0.0  # time.monotonic() at which the bytes granted so far are paid for

    @property
    def grain(self) -> int:
        """The most one grant may book (0: uncapped, any): a hundredth of a second of the rate, at least
        ``MIN_GRANT`` — what a target asks for per PEER_READ from a capped source (docs/protocol.md §10.3)."""
        return max(MIN_GRANT, int(self.rate * GRANT_SECONDS)) if self.rate > 0 else 0

    def delay(self, n: int) -> float:
        """Seconds to wait before ``n`` more bytes may go (and books them)."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        self._free = max(now - self.burst, self._free) + n / self.rate
        return max(0.0, self._free - now)


@dataclass
class _Fill:
    lease: int
    conn: int
    model: ServedModel
    started: float = field(default_factory=time.monotonic)
    granted: int = 0


class PeerService:
    """The peer channel's handler (the server shell's ``Handler``: ``hello``, ``handle``, ``holds``,
    ``protects``, ``closed``). ``max_fills``: connections holding fills at once; ``max_rate``: bytes/s granted
    over all of them (0: none).

    A fill that makes no progress ends here: once ``max_fill_seconds`` have passed since its offer and since the
    last PEER_READ granted on its connection, its lease ends, the slab's hold is released and its
    ``--peer-max-fills`` slot is free (``_expire``, run before every request this source handles, any
    connection's, and whenever the shell asks ``holds``). The shell's idle timeout counts only silence, so a
    target that kept sending cheap requests (a PEER_QUERY answered NOT_FOUND) and never a PEER_READ held all of
    it for as long as it kept talking. The clock is the connection's, not the lease's: a target's fill pulls
    every lease it uses on a connection at once, but a lease whose share is small (or nothing: the plan used
    another slab) is done long before the others, and stays held until the whole fill releases its leases;
    a grant on any lease of the connection shows that the target is reading. A later PEER_READ or RELEASE of an
    ended lease is a non-fatal UNKNOWN_LEASE saying why (docs/fleet.md, "Bandwidth policy")."""

    service = Service.PEER
    holding = "fill"
    #: a fill whose connection had no PEER_READ granted for this long (nor since its offer) ends (``_expire``)
    max_fill_seconds = 600.0

    def __init__(
        self,
        store: Store,
        security: PeerSecurity,
        *,
        software: str,
        max_fills: int = 4,
        max_rate: int = 0,
        agent: Callable[[], Agent] | None = None,
        files: Callable[[Path], list[PeerFile]] = checkpoint_files,
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        self.security = security.with_own_certificate()
        #: the shared-secret mode's AUTH phase (docs/protocol.md §10.2)
        self.auth = self.security.mode == "secret"
        self.software = software
        self.max_fills = max_fills
        self.cap = RateCap(max_rate)
        self._make_agent = agent or (
            lambda: Agent(f"wcache-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}")
        )
        self._agent: Agent | None = None
        self._files = files
        self._files_at_once = asyncio.Semaphore(FILES_AT_ONCE)
        self._files_slots: dict[int, int] = {}  # connection -> PEER_FILES answers it holds a slot for
        #: id(slab) -> its registration (one per resident slab)
        self.registered: dict[int, Registration] = {}
        self.fills: dict[int, _Fill] = {}
        #: connection -> time.monotonic() of the last PEER_READ granted on it (booked or answered)
        self._progress: dict[int, float] = {}
        #: lease -> connection of the fills ``_expire`` ended, until that connection RELEASEs them or ends
        self._expired: dict[int, int] = {}
        self._secret: dict[int, SecretServer] = {}
        self._next_lease = int.from_bytes(os.urandom(4), "big") % (1 << 30) + 1
        #: bytes granted to fills (metrics) and fills served to the end
        self.bytes_served = 0
        self.fills_done = 0
        self.metrics = metrics

    # ------------------------------------------------------------------ the shell's questions
    def hello(self, conn: Connection, hello: Hello, ctx: _Ctx) -> HelloOk:
        backend = self.store.backend
        return conn.hello_reply(
            hello, software=self.software, backend=backend.name, device=backend.device, server_pid=os.getpid()
        )

    def holds(self, ctx: _Ctx) -> bool:
        """A connection with a fill in progress is not closed for silence (its target READs meanwhile); a fill
        without progress for ``max_fill_seconds`` ends first (``_expire``), and the shell's idle timeout then
        applies (a hung target's connection ends with it)."""
        self._expire()
        return any(f.conn == ctx.id for f in self.fills.values())

    def protects(self) -> Callable[[_Ctx], bool]:
        return lambda ctx: False

    def closed(self, ctx: _Ctx) -> None:
        """The connection ended (a target done, dead or SIGKILLed): its fills end, their holds are released."""
        self._secret.pop(ctx.id, None)
        self._files_sent(ctx.id, every=True)  # an answer its peer never read: the slot is free again
        for f in [f for f in self.fills.values() if f.conn == ctx.id]:
            self._end(f, "connection closed")
        self._progress.pop(ctx.id, None)
        for lease in [lease for lease, conn in self._expired.items() if conn == ctx.id]:
            del self._expired[lease]

    def _expire(self) -> None:
        """End every fill that made no progress for ``max_fill_seconds``: none since its offer, and no PEER_READ
        granted on its connection meanwhile (the class docstring says why the clock is the connection's)."""
        now = time.monotonic()
        limit = self.max_fill_seconds
        for f in [f for f in self.fills.values() if now - max(f.started, self._progress.get(f.conn, 0.0)) >= limit]:
            self._expired[f.lease] = f.conn
            self._end(f, f"no PEER_READ granted on its connection for {limit:g} s")

    # ------------------------------------------------------------------ registration
    @property
    def agent(self) -> Agent:
        if self._agent is None:
            self._agent = self._make_agent()
        return self._agent

    def resident(self, model: ServedModel) -> None:
        """``Store.on_add``: a slab that becomes resident is registered now, not at its first offer (a failure
        is one log line: a query then registers it, or refuses)."""
        if len(model.slabs) != 1:
            return
        try:
            self.register(model)
        except WCacheError as exc:
            log.warning("peer registration failed key=%s: %s", model.key.short(), exc.message)

    def register(self, model: ServedModel) -> Registration:
        """Register the model's slab with NIXL once (when it becomes resident; else at its first offer); the
        registration is dropped just before the slab is freed."""
        slab = model.slabs[0]
        reg = self.registered.get(id(slab))
        if reg is not None:
            return reg
        reg = self.agent.register(slab.region())
        self.registered[id(slab)] = reg
        agent = self.agent

        def drop() -> None:
            self.registered.pop(id(slab), None)
            agent.deregister(reg)

        model.finalizers.append(drop)
        log.info(
            "registered for peers key=%s bytes=%d memory=%s seconds=%.4f",
            model.key.short(),
            reg.region.length,
            reg.region.kind,
            reg.seconds,
        )
        return reg

    # ------------------------------------------------------------------ requests
    async def handle(self, request: Frame, fds: list[int], ctx: _Ctx) -> Frame | Reply:
        self._expire()  # before anything is counted: a stalled fill's slot is free for this request
        match request:
            case PeerAuth():
                try:
                    return self._auth(ctx).challenge(request)
                except PermissionDeniedError as exc:  # fatal, as PEER_PROOF's refusal (docs/protocol.md §10.2)
                    log.warning("peer refused conn=%d reason=secret", ctx.id)
                    return ErrorFrame.from_exception(exc, request.id, fatal=True)
            case PeerProof():
                server = self._secret.get(ctx.id)
                try:
                    if server is None:
                        raise PermissionDeniedError("PEER_PROOF before PEER_AUTH", details={"reason": "secret"})
                    return server.check(request)
                except PermissionDeniedError as exc:  # fatal: the source closes (docs/protocol.md §10.2)
                    log.warning("peer refused conn=%d reason=secret", ctx.id)
                    return ErrorFrame.from_exception(exc, request.id, fatal=True)
            case PeerQuery():
                return self._offer(request, ctx)
            case PeerRead():
                return await self._grant(request, ctx)
            case Release():
                return self._release(request, ctx)
            case PeerFiles():
                return await self._files_for(request, ctx)
        raise NotFoundError(f"a peer channel does not answer {request.TYPE}")

    def _auth(self, ctx: _Ctx) -> SecretServer:
        if self.security.mode != "secret":
            raise PermissionDeniedError("this source authenticates by TLS certificates, not a shared secret")
        return self._secret.setdefault(ctx.id, SecretServer(self.security.secret, self.security.own_certificate))

    def _offer(self, req: PeerQuery, ctx: _Ctx) -> PeerOffer:
        wanted = dict(req.key)
        held = [m for m in self.store.models.values() if len(m.slabs) == 1 and fills_key(m.key, wanted)]
        if not held:
            raise NotFoundError(
                "this daemon holds nothing that fills that key",
                details={"served": [k.short() for k in self.store.models]},
            )
        busy = {f.conn for f in self.fills.values()}
        mine = sum(1 for f in self.fills.values() if f.conn == ctx.id)
        limit = self.store.max_leases_per_connection
        if mine + len(held) > limit:
            raise LimitExceededError(
                f"this connection holds {mine} fill leases (at most {limit}, as a local connection's leases, "
                "docs/protocol.md §7): RELEASE some first",
                details={"leases": mine, "limit": limit},
            )
        if ctx.id not in busy and len(busy) >= self.max_fills:
            raise LimitExceededError(
                f"this daemon serves {len(busy)} fills already (--peer-max-fills {self.max_fills}): ask another peer",
                details={"fills": len(busy), "limit": self.max_fills},
            )
        models: list[PeerModel] = []
        regs: list[Registration] = []
        offered: list[_Fill] = []
        try:
            for m in held:
                if not m.hold():  # closed meanwhile
                    continue
                try:
                    reg = self.register(m)
                except BaseException:  # NIXL missing or refusing: no fill records this hold, so nothing would end it
                    m.release_hold()
                    raise
                lease = self._next_lease
                self._next_lease += 1
                f = self.fills[lease] = _Fill(lease, ctx.id, m)
                offered.append(f)
                regs.append(reg)
                r = reg.region
                models.append(
                    PeerModel(
                        lease=lease,
                        key=m.key.to_wire(),
                        size=r.length,
                        memory=r.kind,
                        address=r.address,
                        tensors=m.table,
                        aliases=m.aliases,
                        buffers=m.buffers,
                        payload=m.payload_bytes,
                        device=r.device,
                        register_seconds=reg.seconds,
                    )
                )
            agent = self.agent.metadata(regs) if models else b""
        except BaseException:  # the peer gets an ERROR, not these leases: they end now, not with the connection
            for f in offered:
                self._end(f, "offer failed")
            raise
        if not models:
            raise NotFoundError("the slabs that fill that key were evicted meanwhile")
        log.info(
            "peer fill offered conn=%d keys=%s bytes=%d fills=%d",
            ctx.id,
            ",".join(m.key.short() for m in held),
            sum(m.size for m in models),
            len({f.conn for f in self.fills.values()}),
        )
        return PeerOffer(
            id=req.id,
            agent=agent,
            models=tuple(models),
            max_rate=self.cap.rate,
            max_fills=self.max_fills,
        )

    def _mine(self, lease: int, ctx: _Ctx) -> _Fill:
        f = self.fills.get(lease)
        if f is None or f.conn != ctx.id:
            if self._expired.get(lease) == ctx.id:
                raise UnknownLeaseError(
                    f"lease {lease} ended: no PEER_READ was granted on this connection for {self.max_fill_seconds:g} "
                    "s; query again",
                    details={"lease": lease, "reason": "no-progress"},
                )
            raise UnknownLeaseError(f"lease {lease} is not a fill of this connection")
        return f

    async def _grant(self, req: PeerRead, ctx: _Ctx) -> PeerReadOk:
        f = self._mine(req.lease, ctx)
        size = f.model.slab_bytes
        grain = self.cap.grain
        if grain and req.bytes > grain:
            # a capped source's grants are books on one clock: a grant of the whole slab held every other fill's
            # next grant behind it for size/rate seconds (past their stall deadlines: they failed), and a target
            # cycling PEER_QUERY and RELEASE did so for ever. At a grain, the fills' grants interleave.
            raise LimitExceededError(
                f"PEER_READ of {req.bytes} bytes: this daemon's cap ({self.cap.rate} bytes/s) grants at most "
                f"{grain} bytes per PEER_READ (a hundredth of a second of it, at least {MIN_GRANT})",
                details={"bytes": req.bytes, "grain": grain},
            )
        if req.bytes > size or f.granted + req.bytes > READS_PER_FILL * size:
            # a fill reads its slab once (a stripe read again after a failure at most): more would book the rate
            # cap's clock for everyone — one PEER_READ of 2**50 bytes held every other peer's grants for years
            raise LimitExceededError(
                f"PEER_READ of {req.bytes} bytes: lease {req.lease}'s slab is {size} bytes, {f.granted} granted "
                f"already (at most the slab's size per read, {READS_PER_FILL}x it in all)",
                details={"bytes": req.bytes, "size": size, "granted": f.granted},
            )
        wait = self.cap.delay(req.bytes)
        self._progress[ctx.id] = time.monotonic()  # booked: the fill is reading (``_expire``)
        if wait > 0:
            await asyncio.sleep(wait)
            if self.fills.get(f.lease) is not f:  # ended meanwhile (the daemon stopping)
                raise UnknownLeaseError(f"lease {req.lease} ended while its grant waited for the cap")
            self._progress[ctx.id] = time.monotonic()
        f.granted += req.bytes
        self.bytes_served += req.bytes
        if self.metrics is not None:
            self.metrics.peer_served_bytes += req.bytes
        return PeerReadOk(id=req.id, lease=req.lease, bytes=req.bytes)

    def _release(self, req: Release, ctx: _Ctx) -> Released:
        try:
            f = self._mine(req.lease, ctx)
        except UnknownLeaseError:
            if self._expired.get(req.lease) == ctx.id:
                del self._expired[req.lease]  # said once: the target knows now
            raise
        self._end(f, "released")
        self.fills_done += 1
        left = sum(1 for g in self.fills.values() if g.model is f.model)
        return Released(id=req.id, lease=req.lease, leases_left=left)

    def _end(self, f: _Fill, why: str) -> None:
        del self.fills[f.lease]
        f.model.release_hold()
        if not any(g.conn == f.conn for g in self.fills.values()):
            self._progress.pop(f.conn, None)  # a later offer on the connection starts its own clock
        secs = time.monotonic() - f.started
        log.info(
            "peer fill ended conn=%d lease=%d key=%s granted=%d seconds=%.2f reason=%s",
            f.conn,
            f.lease,
            f.model.key.short(),
            f.granted,
            secs,
            why,
        )

    async def _files_for(self, req: PeerFiles, ctx: _Ctx) -> Reply:
        """The files of the most recently used model whose key has every field ``req.key`` names (a target
        without the checkpoint knows at most the fingerprint it expects: ``{}`` asks for any). They are read in a
        worker thread (up to 48 MiB: on the event loop, a peer asking again and again held local engines' requests
        for ~0.35 s each time), and ``FILES_AT_ONCE`` answers are read or being sent at a time: an answer a peer
        does not read stays in memory (~160 MB with its TLS copies) until the send deadline ends its connection,
        so peers that ask and never read held ~160 MB each, up to the connection cap. The slot is the answer's
        until it is sent or its connection ends (``closed``)."""
        wanted = dict(req.key)
        for m in reversed(self.store.models.values()):
            mine = m.key.to_wire()
            if m.source is not None and all(mine.get(k) == v for k, v in wanted.items()):
                await self._files_at_once.acquire()
                self._files_slots[ctx.id] = self._files_slots.get(ctx.id, 0) + 1
                try:
                    files = await asyncio.to_thread(self._files, m.source)
                except BaseException:
                    self._files_sent(ctx.id)
                    raise
                log.info(
                    "peer files sent key=%s files=%d bytes=%d",
                    m.key.short(),
                    len(files),
                    sum(len(f.data) for f in files),
                )
                return Reply(PeerFilesReply(id=req.id, files=tuple(files)), after=lambda: self._files_sent(ctx.id))
        raise NotFoundError("this daemon knows no checkpoint directory for that key")

    def _files_sent(self, conn: int, every: bool = False) -> None:
        """A PEER_FILES answer of connection ``conn`` was sent (or failed): its slot is free (``every``: all the
        connection's, when it ends)."""
        held = self._files_slots.pop(conn, 0)
        freed = held if every else min(held, 1)
        if held > freed:
            self._files_slots[conn] = held - freed
        for _ in range(freed):
            self._files_at_once.release()

    def close(self) -> None:
        for f in list(self.fills.values()):
            self._end(f, "daemon stopping")
        if self._agent is not None:
            self._agent.close()


class PeerTls:
    """The peer channel's ``PeerCheck``: the TLS handshake (mutual TLS: the fleet CA's certificate; the
    shared-secret mode: encryption, the proofs following in AUTH), within the shell's handshake deadline. A
    failed handshake is one log line and the connection's end: no frame is exchanged with such a peer."""

    def __init__(self, security: PeerSecurity) -> None:
        self.security = security

    async def identify(self, ch: Channel[Connection]) -> PeerIdentity:
        addr = _address(ch.sock)
        assert isinstance(ch, StreamChannel)
        try:
            await ch.handshake()
        except (ssl.SSLError, OSError) as exc:
            log.warning("peer refused addr=%s reason=tls error=%s", addr, exc)
            raise ConnectionError(f"TLS handshake with {addr} failed: {exc}") from exc
        return PeerIdentity(principal=_subject(ch) or addr)

    def refusal(self, peer: PeerIdentity) -> Refusal | None:
        return None  # the handshake decided (and the shared secret's proofs decide in AUTH)


def _address(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


def _subject(ch: StreamChannel) -> str:
    """The common name of the certificate the peer presented (mutual TLS), else ""."""
    if ch.tls is None:
        return ""
    cert: dict[str, Any] = dict(ch.tls.getpeercert() or {})
    for rdn in cert.get("subject", ()):
        for pair in rdn:
            if pair[0] == "commonName":
                return str(pair[1])
    return ""


class PeerListener:
    """``--peer-listen HOST:PORT``: the peer channel served by the daemon's server shell — a TCP listener,
    ``StreamChannel`` (TLS) as its channel, ``PeerTls`` as its check, ``PeerService`` as its handler — and every
    resident slab registered with NIXL (now, and as each becomes resident)."""

    def __init__(
        self,
        service: PeerService,
        host: str,
        port: int,
        *,
        limits: ConnectionLimits | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.service = service
        self.host, self.port = host, port
        sec = service.security
        sec.check_listen(host)
        self.limits = limits or ConnectionLimits(
            connections=64, handshake_timeout=5.0, idle_timeout=60.0, max_frame_size=MAX_REQUEST_SIZE
        )
        self.shell = Shell(
            service,
            limits=self.limits,
            tag=self.tag,
            log=log,
            peer_check=PeerTls(sec),
            channel=functools.partial(StreamChannel, context=sec.server_context(), server_side=True),
            budget=ReadBudget(64 << 20),
            metrics=metrics,
        )

    @property
    def tag(self) -> str:
        """What starts the shell's log lines: ``peer=HOST:PORT``, the port bound once started."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"peer={host}:{self.port}"

    def start(self) -> tuple[str, int]:
        """Listen (SO_REUSEADDR), register the resident slabs, accept; returns the address bound."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        self.host, self.port = sock.getsockname()[:2]
        self.shell.tag = self.tag  # HOST:0 asked for any port: the lines name the one bound
        store = self.service.store
        for m in list(store.models.values()):
            self.service.resident(m)
        store.on_add.append(self.service.resident)
        self.shell.start(sock)
        log.info("peer channel listening addr=%s:%d auth=%s", self.host, self.port, self.service.security.mode)
        return self.host, self.port

    async def stop(self) -> None:
        await self.shell.close()
        await self.shell.drain()
        with contextlib.suppress(ValueError):
            self.service.store.on_add.remove(self.service.resident)
        self.service.close()
