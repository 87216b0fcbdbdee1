"""wcache-keeper: holds daemons' slabs across their restarts, so a restarted daemon loads nothing.

A daemon started with ``--keeper`` deposits every model it serves (KEEP: the slab file
descriptors and the tensor table), withdraws a model when it evicts it (UNKEEP) and, when it
starts, takes back what was deposited for its socket (RECLAIM) before loading anything
(docs/protocol.md §4.11). The keeper holds only file descriptors — memfds of the host
backend, CUDA VMM allocations of the CUDA backend — and never creates a CUDA context (it
imports no torch): on the lent H200 a 16 GiB VMM allocation outlived the SIGKILLed process that
created it while only its exported fd stayed open here, its bytes intact, and the driver freed it
when that fd closed (``benchmarks/results/restart_probe-*.json``). So a daemon that crashes,
or is restarted for an upgrade, is back with its models in milliseconds instead of reloading
them from disk or the host tier.

Everything kept stays allocated until the daemon withdraws it or the keeper stops: stopping
the keeper (SIGTERM) frees it all. One keeper serves every daemon of its user on the node
(entries belong to the depositing daemon's socket path, the ``owner``); the same private
socket directory, SO_PEERCRED uid check and one-process lock protect it as they do the daemon.

What the keeper does not take on trust (docs/security.md, "The keeper"):

- the owner: KEEP, UNKEEP and RECLAIM for an owner come only from the process that holds that
  socket's lock (``<owner>.lock``, the daemon's ``flock``; the peer's pid from SO_PEERCRED, the
  lock's holder from /proc/locks) — else ``PERMISSION_DENIED``;
- the descriptors: a host slab must be a memfd of its declared size sealed against writes and
  resizing, a slab's kind must be its backend's (else a fatal ``PROTOCOL_ERROR`` /
  ``DEVICE_MISMATCH``); a RECLAIM checks them again and drops (and counts) a bad entry alone;
- the peers' appetite: connections, owners, descriptors and bytes are capped (``LIMIT_EXCEEDED``,
  which leaves every other owner's entries as they were); the connections are the server shell's
  (wcache/server/service.py), with the daemon's admission policy: a connection that has not said HELLO,
  or is idle, gives way to a new one, and a connection of a daemon holding the lock of a socket the keeper
  holds slabs for is never closed to make room — idle peers cannot lock a restarting daemon out of its
  RECLAIM (docs/security.md, "idle peers").

The daemon in turn checks what it reclaims against the checkpoint on disk before serving it
(wcache/server/reclaim.py).

This module is the keeper server (``Keeper``, its limits, its dispatch); a daemon's side of it is
wcache/server/keeper_link.py, the ``wcache-keeper`` command wcache/server/keeper_cli.py:

    wcache-keeper [--socket-dir DIR | --socket-path PATH]
    wcache-server --model DIR --keeper [PATH] ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import assert_never, cast

import msgpack

from wcache import __version__
from wcache.channel import HOST_SEALS, close_fds, memfd_problem
from wcache.errors import (
    DeviceMismatchError,
    LimitExceededError,
    NotFoundError,
    PermissionDeniedError,
    RemoteProtocolError,
)
from wcache.locks import lock_holder, lock_holders
from wcache.plan.recipe import key_from_wire
from wcache.proto import (
    DEFAULT_MAX_FRAME_SIZE,
    Connection,
    DeviceInfo,
    Frame,
    HandedModel,
    Hello,
    HelloOk,
    Keep,
    KeeperRequest,
    Kept,
    ModelInfo,
    Reclaim,
    Reclaimed,
    Service,
    SlabDescriptor,
    Status,
    StatusReply,
    Unkeep,
)
from wcache.proto.frames import MAX_KEPT_FDS
from wcache.server.listen import bind_private_socket
from wcache.server.service import ConnectionLimits, Context, Reply, SameUid, Shell, stop_on_signals

__all__ = ["HOST_SEALS", "SLAB_KINDS", "Keeper", "KeeperLimits", "slab_problem"]

log = logging.getLogger("wcache.keeper")

SOFTWARE = f"wcache-keeper/{__version__}"

#: the slab kinds a backend serves
SLAB_KINDS = {"host": ("memfd",), "cuda": ("cuda_vmm",)}


@dataclass(frozen=True)
class KeeperLimits:
    """What one keeper holds at most (docs/protocol.md §4.11). Per owner, MAX_KEPT_FDS slabs (one RECLAIMED
    carries them all); in all, ``owners`` owners, ``fds`` slabs and ``bytes`` bytes (0: no byte cap). A
    refused KEEP changes nothing, for its owner or any other."""

    #: connections at once; at the cap a new one takes the place of one that has not said HELLO or is idle
    connections: int = 64
    owners: int = 64
    fds: int = 1024
    bytes: int = 0
    #: a connection silent this long after its handshake is closed (a daemon sends one request per connection)
    idle_seconds: float = 30.0


def _key_id(key: dict[str, str | int]) -> bytes:
    return bytes(msgpack.packb(sorted(key.items())))


def _short(key: dict[str, str | int]) -> str:
    """A key map for a log line: its short form, or the map itself where it names no key (an UNKEEP of an entry
    an older daemon kept)."""
    try:
        return key_from_wire(dict(key)).short()
    except Exception:  # a log line never fails the request it reports
        return str(dict(key))[:200]


def _key_problem(key: dict[str, str | int]) -> str | None:
    """Why a KEEP's key map is no key a daemon keeps (a field missing or of another type, or one the key's form
    would drop), or None: an entry under it would be reclaimed by no daemon, and released by no UNKEEP of its
    decoded key."""
    try:
        if key_from_wire(dict(key)).to_wire() == dict(key):
            return None
        return "it is not in the form a daemon writes keys (a field the key drops)"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


@dataclass
class _Entry:
    owner: str
    backend: str
    device_uuid: str
    model: HandedModel  # its slabs' fd fields index ``fds``
    fds: list[int]
    pid: int
    kept_at: float

    @property
    def bytes(self) -> int:
        return sum(s.size for s in self.model.slabs)

    def close(self) -> None:
        close_fds(self.fds)


def slab_problem(backend: str, desc: SlabDescriptor, fd: int) -> str | None:
    """Why the descriptor ``fd`` cannot stand for the slab ``desc`` of a ``backend`` model (None: it can).
    A host slab must be a memfd of exactly its size, sealed (HOST_SEALS: ``channel.memfd_problem``, the check an
    engine runs on a STATE's slabs); a CUDA slab's descriptor is the driver's and cannot be inspected here beyond
    its kind."""
    kinds = SLAB_KINDS.get(backend)
    if kinds is None:
        return f"backend {backend!r} is neither host nor cuda"
    if desc.kind not in kinds:
        return f"a {desc.kind} slab cannot be served by the {backend} backend"
    if backend != "host":
        return None
    return memfd_problem(fd, desc.size, exact=True)


class Keeper:
    """The keeper service, a request handler of the server shell (wcache/server/service.py). ``entries``:
    (owner, packed key) -> what is held.

    ``check_owner``: only the holder of ``<owner>.lock`` may KEEP, UNKEEP or RECLAIM for ``owner``
    (``wcache-keeper --no-owner-check`` turns it off, for daemons in a pid namespace the keeper cannot see)."""

    service = Service.KEEPER
    holding = "lock"
    auth = False  # same-uid peers of a Unix socket: SO_PEERCRED is the proof

    def __init__(
        self,
        socket_path: Path,
        *,
        handshake_timeout: float = 10.0,
        frame_timeout: float = 10.0,
        limits: KeeperLimits | None = None,
        check_owner: bool = True,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.handshake_timeout = handshake_timeout
        self.frame_timeout = frame_timeout
        self.limits = limits or KeeperLimits()
        self.check_owner = check_owner
        self.entries: dict[tuple[str, bytes], _Entry] = {}
        #: entries dropped because they could not be served: reason -> count (logged; kept for tests)
        self.dropped: dict[str, int] = {}
        self.started = time.monotonic()
        self._stop = asyncio.Event()
        self._tag = f"socket={self.socket_path}"
        self.shell = Shell(
            self,
            limits=ConnectionLimits(
                connections=self.limits.connections,
                handshake_timeout=handshake_timeout,
                idle_timeout=self.limits.idle_seconds,
                frame_timeout=frame_timeout,
                max_frame_size=DEFAULT_MAX_FRAME_SIZE,  # a KEEP carries a model's whole tensor table
                shutdown_grace=0.0,
            ),
            tag=self._tag,
            log=log,
            peer_check=SameUid("keeper"),
        )

    def stop(self) -> None:
        self._stop.set()

    @property
    def held_bytes(self) -> int:
        return sum(e.bytes for e in self.entries.values())

    @property
    def held_fds(self) -> int:
        return sum(len(e.fds) for e in self.entries.values())

    def _owned(self, owner: str) -> list[_Entry]:
        return [e for (o, _), e in self.entries.items() if o == owner]

    def _authorise(self, owner: str, pid: int, what: str) -> None:
        """``pid`` (SO_PEERCRED) must hold ``owner``'s daemon lock: a process of the uid that merely names a
        socket path may not deposit slabs a daemon would serve, nor take a daemon's slabs, nor drop them."""
        if not owner:
            raise RemoteProtocolError(f"{what}.owner: the depositing daemon's socket path is required")
        if not self.check_owner:
            return
        holder = lock_holder(owner) or 0  # 0: nobody (or not visible to us)
        if holder != pid or pid <= 0:
            raise PermissionDeniedError(
                f"{what} for {owner}: only the daemon serving that socket (the holder of {owner}.lock"
                + (f", pid {holder}" if holder else ": nobody holds it")
                + f") may {what} its slabs; this peer is pid {pid}",
                details={"owner": owner, "peer_pid": pid, "holder_pid": holder},
            )

    def _kept(self, rid: int, owner: str) -> Kept:
        mine = self._owned(owner)
        return Kept(id=rid, models=len(mine), bytes=sum(e.bytes for e in mine))

    async def serve(
        self,
        on_ready: Callable[[], None] | None = None,
        *,
        signals: bool = True,
        on_stopping: Callable[[], None] | None = None,
    ) -> None:
        """Serve until stop() (or SIGTERM/SIGINT, with ``signals``); then close every held descriptor (freeing
        the memory). ``on_ready`` is called once the socket serves, ``on_stopping`` once the stop begins."""
        with stop_on_signals(self.stop, signals=signals, log=log, tag=self._tag):
            self.shell.start(bind_private_socket(self.socket_path))
            if on_ready is not None:
                on_ready()
            try:
                await self._stop.wait()
            finally:
                if on_stopping is not None:
                    on_stopping()
                await self.shell.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path)
                await self.shell.drain()
                n, held = len(self.entries), self.held_bytes
                for e in self.entries.values():
                    e.close()
                self.entries.clear()
                log.info("stopped %s models_freed=%d bytes_freed=%d", self._tag, n, held)

    # ------------------------------------------------------------------ the shell's handler (service.Handler)
    def hello(self, conn: Connection, hello: Hello, ctx: Context) -> HelloOk:
        device = DeviceInfo(kind="cpu", index=0, uuid="", name="wcache keeper")
        return conn.hello_reply(hello, software=SOFTWARE, backend="host", device=device, server_pid=os.getpid())

    def holds(self, ctx: Context) -> bool:
        return False  # a daemon sends one request per connection: nothing lives with a connection

    def protects(self) -> Callable[[Context], bool]:
        """A daemon holding the lock of a socket the keeper holds slabs for (one read of /proc/locks): its RECLAIM
        at restart, or KEEP, is never closed to make room for idle peers."""
        owners = {o for o, _ in self.entries}
        daemons = {pid for pid in lock_holders(owners).values() if pid > 0} if owners else set()
        return lambda ctx: ctx.pid in daemons

    def closed(self, ctx: Context) -> None:
        pass

    async def handle(self, request: Frame, fds: list[int], ctx: Context) -> Reply | Frame:
        # the connection lets through only requests (the transition table) of this service
        frame = cast("KeeperRequest", request)
        pid = ctx.pid
        match frame:
            case Keep():
                return self._keep(frame, fds, pid)
            case Unkeep():
                self._authorise(frame.owner, pid, "UNKEEP")
                gone = self.entries.pop((frame.owner, _key_id(frame.key)), None)
                if gone is None:
                    raise NotFoundError(
                        f"the keeper holds no model {_short(frame.key)} for {frame.owner}",
                        details={"owner": frame.owner, "held": len(self._owned(frame.owner))},
                    )
                gone.close()
                kept = self._kept(frame.id, frame.owner)
                log.info(
                    "unkept %s owner=%s pid=%d key=%s bytes=%d models=%d held_bytes=%d",
                    self._tag,
                    frame.owner,
                    pid,
                    _short(frame.key),
                    gone.bytes,
                    kept.models,
                    self.held_bytes,
                )
                return kept
            case Reclaim():
                reply, out = self._reclaim(frame, pid)
                return Reply(reply, out)  # the entries' own descriptors: the keeper keeps holding them
            case Status():
                return self._status(frame.id)
            case _:
                assert_never(frame)

    def _keep(self, req: Keep, fds: list[int], pid: int) -> Kept:
        self._authorise(req.owner, pid, "KEEP")
        problem = _key_problem(req.model.key)
        if problem is not None:
            raise RemoteProtocolError(f"KEEP: its key is no model's key ({problem}); nothing kept")
        for desc in req.model.slabs:
            problem = slab_problem(req.backend, desc, fds[desc.fd])
            if problem is not None:
                if req.backend in SLAB_KINDS and desc.kind not in SLAB_KINDS[req.backend]:
                    raise DeviceMismatchError(f"KEEP: {problem}; nothing kept", details={"backend": req.backend})
                raise RemoteProtocolError(f"KEEP: {problem}; nothing kept (a kept host slab must be a sealed memfd)")
        k = (req.owner, _key_id(req.model.key))
        old = self.entries.get(k)
        mine = [e for e in self._owned(req.owner) if e is not old]
        self._check_limits(req, mine, old, len(fds))
        entry = _Entry(req.owner, req.backend, req.device_uuid, req.model, list(fds), pid, time.time())
        fds.clear()  # the entry owns them now
        if old is not None:
            del self.entries[k]
            old.close()
        self.entries[k] = entry
        kept = self._kept(req.id, req.owner)
        log.info(
            "kept %s owner=%s pid=%d key=%s backend=%s slabs=%d bytes=%d models=%d held_bytes=%d%s",
            self._tag,
            req.owner,
            entry.pid,
            _short(req.model.key),
            req.backend,
            len(entry.fds),
            entry.bytes,
            kept.models,
            self.held_bytes,
            " replaced=1" if old is not None else "",
        )
        return kept

    def _check_limits(self, req: Keep, mine: list[_Entry], old: _Entry | None, nfds: int) -> None:
        """LIMIT_EXCEEDED if keeping ``req`` (replacing ``old``) would pass a cap; ``mine``: the owner's other
        entries. Nothing is changed either way."""
        lim = self.limits
        owner_fds = sum(len(e.fds) for e in mine) + nfds
        if owner_fds > MAX_KEPT_FDS:
            raise LimitExceededError(
                f"{req.owner} would have {owner_fds} slabs kept; one RECLAIM carries at most {MAX_KEPT_FDS}",
                details={"limit": MAX_KEPT_FDS},
            )
        if not mine and old is None and len({o for o, _ in self.entries}) >= lim.owners:
            raise LimitExceededError(
                f"the keeper holds slabs for {lim.owners} daemons (its --max-owners); {req.owner} is not kept",
                details={"limit": lim.owners},
            )
        total_fds = self.held_fds - (len(old.fds) if old is not None else 0) + nfds
        if total_fds > lim.fds:
            raise LimitExceededError(
                f"the keeper would hold {total_fds} slabs (its --max-fds is {lim.fds}); {req.owner} is not kept",
                details={"limit": lim.fds},
            )
        nbytes = sum(s.size for s in req.model.slabs)
        total_bytes = self.held_bytes - (old.bytes if old is not None else 0) + nbytes
        if lim.bytes and total_bytes > lim.bytes:
            raise LimitExceededError(
                f"the keeper would hold {total_bytes} bytes (its --max-bytes is {lim.bytes}); "
                f"a model of {nbytes} bytes for {req.owner} is not kept",
                details={"limit": lim.bytes, "bytes": nbytes},
            )

    def _drop(self, k: tuple[str, bytes], e: _Entry, reason: str, why: str) -> None:
        del self.entries[k]
        e.close()
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        log.info(
            "dropped %s owner=%s key=%s bytes=%d reason=%s (%s)",
            self._tag,
            e.owner,
            _short(e.model.key),
            e.bytes,
            reason,
            why,
        )

    def _reclaim(self, req: Reclaim, pid: int) -> tuple[Reclaimed, list[int]]:
        """Entries of ``req.owner`` on its backend and device (the keeper keeps holding them). Those of the
        owner on another backend or device cannot be served by it any more, nor can an entry whose slabs
        no longer pass ``slab_problem``: each is dropped (closed) and counted, and the others are returned."""
        self._authorise(req.owner, pid, "RECLAIM")
        models: list[HandedModel] = []
        out: list[int] = []
        dropped = 0
        for k, e in list(self.entries.items()):
            if e.owner != req.owner:
                continue
            if e.backend != req.backend or e.device_uuid != req.device_uuid:
                where = f"now {req.backend} {req.device_uuid or '-'}, kept for {e.backend} {e.device_uuid or '-'}"
                self._drop(k, e, "moved", where)
                dropped += 1
                continue
            problem = next(
                (p for s in e.model.slabs if (p := slab_problem(e.backend, s, e.fds[s.fd])) is not None), None
            )
            if problem is not None:
                self._drop(k, e, "bad-slab", problem)
                dropped += 1
                continue
            slabs = tuple(replace(s, fd=len(out) + s.fd) for s in e.model.slabs)
            out.extend(e.fds)
            models.append(replace(e.model, slabs=slabs))
        log.info(
            "reclaimed %s owner=%s pid=%d models=%d bytes=%d dropped=%d",
            self._tag,
            req.owner,
            pid,
            len(models),
            sum(s.size for m in models for s in m.slabs),
            dropped,
        )
        return Reclaimed(id=req.id, models=tuple(models), dropped=dropped), out

    def _status(self, rid: int) -> StatusReply:
        return StatusReply(
            id=rid,
            software=SOFTWARE,
            backend="host",
            device=DeviceInfo(kind="cpu", index=0, uuid="", name="wcache keeper"),
            uptime_seconds=time.monotonic() - self.started,
            connections=len(self.shell),
            models=tuple(
                ModelInfo(
                    key=e.model.key,
                    backend=e.backend,
                    bytes=e.bytes,
                    tensors=len(e.model.tensors),
                    leases=0,
                    load_seconds=e.model.load_seconds,
                    last_use=e.kept_at,
                    origin=e.model.origin,
                    source=e.model.source,
                    owner=e.owner,
                )
                for e in self.entries.values()
            ),
        )
