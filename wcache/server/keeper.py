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

    wcache-keeper [--socket-dir DIR | --socket-path PATH]
    wcache-server --model DIR --keeper [PATH] ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, assert_never, cast

import msgpack

from wcache import __version__
from wcache.channel import Channel, close_fds, connect, expect, peer_credentials
from wcache.errors import (
    CacheUnavailableError,
    LimitExceededError,
    NotFoundError,
    PermissionDeniedError,
    ProtocolError,
    WCacheError,
)
from wcache.key import WeightCacheKey
from wcache.proto import (
    Connection,
    DeviceInfo,
    ErrorFrame,
    Frame,
    HandedModel,
    Hello,
    Keep,
    KeeperRequest,
    Kept,
    Misdirected,
    ModelInfo,
    Reclaim,
    Reclaimed,
    Role,
    Service,
    Status,
    StatusReply,
    Unkeep,
)
from wcache.proto.frames import MAX_KEPT_FDS
from wcache.server.listen import accept_loop, bind_private_socket
from wcache.server.security import DaemonLock, check_private_dir, ensure_socket_dir

if TYPE_CHECKING:
    from wcache.server.store import ServedModel

__all__ = ["Keeper", "KeeperLink", "keep", "keeper_socket", "main", "reclaim", "unkeep"]

log = logging.getLogger("wcache.keeper")

_F = TypeVar("_F", Kept, Reclaimed)

SOFTWARE = f"wcache-keeper/{__version__}"


def _key_id(key: dict[str, str | int]) -> bytes:
    return bytes(msgpack.packb(sorted(key.items())))


def _short(key: dict[str, str | int]) -> str:
    return WeightCacheKey.from_wire(key).short()


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


class Keeper:
    """The asyncio server. ``entries``: (owner, packed key) -> what is held."""

    def __init__(self, socket_path: Path, *, handshake_timeout: float = 10.0, frame_timeout: float = 10.0) -> None:
        self.socket_path = Path(socket_path)
        self.handshake_timeout = handshake_timeout
        self.frame_timeout = frame_timeout
        self.entries: dict[tuple[str, bytes], _Entry] = {}
        self.started = time.monotonic()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._uid = os.geteuid()
        self._tag = f"socket={self.socket_path}"

    def stop(self) -> None:
        self._stop.set()

    @property
    def held_bytes(self) -> int:
        return sum(e.bytes for e in self.entries.values())

    def _owned(self, owner: str) -> list[_Entry]:
        return [e for (o, _), e in self.entries.items() if o == owner]

    def _kept(self, rid: int, owner: str) -> Kept:
        mine = self._owned(owner)
        return Kept(id=rid, models=len(mine), bytes=sum(e.bytes for e in mine))

    async def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve until stop() or SIGTERM/SIGINT; then close every held descriptor (freeing the memory)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop)
        listener = bind_private_socket(self.socket_path)
        if on_ready is not None:
            on_ready()
        accept = asyncio.ensure_future(accept_loop(listener, self._accepted, self._tag))
        try:
            await self._stop.wait()
        finally:
            accept.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await accept
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            for t in list(self._tasks):
                t.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            n, held = len(self.entries), self.held_bytes
            for e in self.entries.values():
                e.close()
            self.entries.clear()
            log.info("stopped %s models_freed=%d bytes_freed=%d", self._tag, n, held)

    def _accepted(self, sock: socket.socket) -> None:
        task = asyncio.ensure_future(self._serve_connection(sock))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_connection(self, sock: socket.socket) -> None:
        conn = Connection(Role.SERVER, service=Service.KEEPER)
        ch = Channel(sock, conn)
        pid = -1
        try:
            creds = peer_credentials(sock)
            pid = creds.pid
            if creds.uid != self._uid:
                log.warning("refused %s pid=%d uid=%d reason=uid-mismatch", self._tag, pid, creds.uid)
                err = PermissionDeniedError(
                    f"peer uid {creds.uid} is not the keeper's uid {self._uid}", details={"peer_uid": creds.uid}
                )
                await ch.send_bytes(conn.fatal_error(err))
                return
            hello, _ = await asyncio.wait_for(ch.receive(), self.handshake_timeout)
            assert isinstance(hello, Hello)  # the transition table admits nothing else here
            device = DeviceInfo(kind="cpu", index=0, uuid="", name="wcache keeper")
            await ch.send(
                conn.hello_reply(hello, software=SOFTWARE, backend="host", device=device, server_pid=os.getpid())
            )
            while True:
                frame, fds = await ch.receive(frame_timeout=self.frame_timeout)
                try:
                    await self._dispatch(ch, cast("KeeperRequest | Misdirected", frame), fds, pid)
                except WCacheError as exc:
                    if isinstance(exc, ProtocolError):
                        raise
                    log.info("request refused %s pid=%d code=%s error=%s", self._tag, pid, exc.code.name, exc.message)
                    await ch.send(ErrorFrame.from_exception(exc, getattr(frame, "id", 0)))
                finally:
                    close_fds(fds)  # what a KEEP brought and did not keep (a kept entry took them: empty)
        except ProtocolError as exc:
            log.warning("protocol error %s pid=%d code=%s error=%s", self._tag, pid, exc.code.name, exc.message)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ch.send_bytes(conn.fatal_error(exc)), 1.0)
        except TimeoutError:
            log.info("connection timed out %s pid=%d", self._tag, pid)
        except (EOFError, ConnectionError, asyncio.CancelledError):
            pass
        except Exception:  # never let one connection take the keeper (and what it holds) down
            log.exception("connection handler failed %s pid=%d", self._tag, pid)
        finally:
            ch.close()

    async def _dispatch(self, ch: Channel, frame: KeeperRequest | Misdirected, fds: list[int], pid: int) -> None:
        match frame:
            case Keep():
                await ch.send(self._keep(frame, fds, pid))
            case Unkeep():
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
                await ch.send(kept)
            case Reclaim():
                reply, out = self._reclaim(frame, pid)
                await ch.send(reply, out)
            case Status():
                await ch.send(self._status(frame.id))
            case Misdirected():  # a daemon's request: the connection says NOT_FOUND, not fatal
                raise frame.error
            case _:
                assert_never(frame)

    def _keep(self, req: Keep, fds: list[int], pid: int) -> Kept:
        if not req.owner:
            raise ProtocolError("KEEP.owner: the depositing daemon's socket path is required")
        k = (req.owner, _key_id(req.model.key))
        others = sum(len(e.fds) for e in self._owned(req.owner) if e is not self.entries.get(k))
        if others + len(fds) > MAX_KEPT_FDS:
            raise LimitExceededError(
                f"{req.owner} would have {others + len(fds)} slabs kept; one RECLAIM carries at most {MAX_KEPT_FDS}",
                details={"limit": MAX_KEPT_FDS},
            )
        entry = _Entry(req.owner, req.backend, req.device_uuid, req.model, list(fds), req.pid or pid, time.time())
        fds.clear()  # the entry owns them now
        old = self.entries.pop(k, None)
        if old is not None:
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

    def _reclaim(self, req: Reclaim, pid: int) -> tuple[Reclaimed, list[int]]:
        """Entries of ``req.owner`` on its backend and device (the keeper keeps holding them); those of
        the owner on another backend or device cannot be served by it any more: they are dropped."""
        models: list[HandedModel] = []
        out: list[int] = []
        dropped = 0
        for k, e in list(self.entries.items()):
            if e.owner != req.owner:
                continue
            if e.backend != req.backend or e.device_uuid != req.device_uuid:
                del self.entries[k]
                e.close()
                dropped += 1
                log.info(
                    "dropped %s owner=%s key=%s bytes=%d reason=now-%s-%s (kept for %s %s)",
                    self._tag,
                    e.owner,
                    _short(e.model.key),
                    e.bytes,
                    req.backend,
                    req.device_uuid or "-",
                    e.backend,
                    e.device_uuid or "-",
                )
                continue
            slabs = tuple(replace(s, fd=len(out) + s.fd) for s in e.model.slabs)
            out.extend(e.fds)
            models.append(replace(e.model, slabs=slabs))
        log.info(
            "reclaimed %s owner=%s pid=%d models=%d bytes=%d dropped=%d",
            self._tag,
            req.owner,
            req.pid or pid,
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
            connections=len(self._tasks),
            models=tuple(
                ModelInfo(
                    key=e.model.key,
                    backend=e.backend,
                    bytes=e.bytes,
                    tensors=len(e.model.tensors),
                    leases=0,
                    load_seconds=e.model.load_seconds,
                    last_use=e.kept_at,
                )
                for e in self.entries.values()
            ),
        )


# ---------------------------------------------------------------------- the daemon's side


async def call(
    path: Path, frame: Frame, fds: Sequence[int] = (), timeout: float = 10.0
) -> tuple[Frame, list[int], int]:
    """One request to the keeper at ``path`` on a connection of its own: (reply, its fds, the keeper's pid).
    ``fds`` stay the caller's. An ERROR reply raises its exception class."""
    async with asyncio.timeout(timeout):
        ch, hello = await connect(path, software=f"wcache/{__version__}", name="wcache-server")
        try:
            await ch.send(frame, list(fds))
            reply, got = await expect(ch)
        finally:
            ch.close()
    return reply, got, hello.server_pid


async def keep(
    path: Path, *, owner: str, backend: str, device_uuid: str, model: HandedModel, fds: list[int], timeout: float = 10.0
) -> tuple[Kept, int]:
    """KEEP ``model`` (its slabs' fd fields index ``fds``, which stay the caller's) in the keeper at ``path``;
    returns the reply and the keeper's pid."""
    req = Keep(id=1, owner=owner, backend=backend, device_uuid=device_uuid, model=model, pid=os.getpid())
    reply, _, pid = await call(path, req, fds, timeout)
    return _reply(reply, Kept), pid


async def unkeep(path: Path, *, owner: str, key: dict[str, str | int], timeout: float = 10.0) -> Kept:
    reply, _, _ = await call(path, Unkeep(id=1, owner=owner, key=key), [], timeout)
    return _reply(reply, Kept)


async def reclaim(
    path: Path, *, owner: str, backend: str, device_uuid: str, timeout: float = 10.0
) -> tuple[Reclaimed, list[int], int]:
    """RECLAIM: the models kept for ``owner``, their fds (the caller owns and must close them), the keeper's pid."""
    req = Reclaim(id=1, owner=owner, backend=backend, device_uuid=device_uuid, pid=os.getpid())
    reply, fds, pid = await call(path, req, [], timeout)
    return _reply(reply, Reclaimed, fds), fds, pid


def _reply(frame: Frame, cls: type[_F], fds: list[int] | None = None) -> _F:
    if not isinstance(frame, cls):
        close_fds(fds or [])
        raise ProtocolError(f"expected {cls.__name__}, got {frame.TYPE}")
    return frame


class KeeperLink:
    """A daemon's side of its keeper: RECLAIM at start, KEEP what it loads, UNKEEP what it evicts, and
    KEEP everything again when the keeper has restarted (``check``, run periodically: a restarted
    keeper holds nothing). The keeper is an optimisation: when it is down or refuses, the daemon logs
    one line and serves on."""

    def __init__(self, path: Path, *, owner: Path, backend: str, device_uuid: str) -> None:
        self.path, self.owner, self.backend, self.device_uuid = path, str(owner), backend, device_uuid
        #: model key -> the keeper process that holds it (a restarted keeper holds nothing)
        self.kept_in: dict[WeightCacheKey, int] = {}
        self._unreachable = False
        self._reclaimed_from = 0
        self._keeper_now = 0  # the keeper process last reached (0: unreachable or never)
        #: models not to offer again: key -> the keeper pid that refused it (0: no keeper can hold it, an IPC slab)
        self._skip: dict[WeightCacheKey, int] = {}
        # one request at a time, in order: an UNKEEP must not overtake the KEEP of the same model
        self._lock = asyncio.Lock()

    async def reclaim(self) -> tuple[Reclaimed, list[int]]:
        """What the keeper holds for this daemon (the caller adopts the models and then calls ``reclaimed``)."""
        state, fds, self._reclaimed_from = await reclaim(
            self.path, owner=self.owner, backend=self.backend, device_uuid=self.device_uuid
        )
        self._keeper_now = self._reclaimed_from
        return state, fds

    def reclaimed(self, models: Sequence[ServedModel]) -> None:
        for m in models:
            self.kept_in[m.key] = self._reclaimed_from

    async def keep(self, model: ServedModel) -> None:
        async with self._lock:
            await self._keep(model)

    async def _keep(self, model: ServedModel) -> str:
        """KEEP ``model``: "kept", "unkeepable" (a slab without an fd), "refused" (an ERROR from the keeper)
        or "unreachable"."""
        fds: list[int] = []
        descs = model.export(fds)  # the slabs' own descriptors: nothing to close here
        if any(d.fd < 0 for d in descs):
            log.info(
                "not kept key=%s: a %s slab cannot be kept (use --cuda-export vmm)", model.key.short(), descs[0].kind
            )
            self._skip[model.key] = 0
            return "unkeepable"
        try:
            kept, pid = await keep(
                self.path,
                owner=self.owner,
                backend=self.backend,
                device_uuid=self.device_uuid,
                model=model.handed(descs),
                fds=fds,
            )
        except (WCacheError, OSError, TimeoutError) as exc:
            log.warning("keeper %s did not keep key=%s: %s", self.path, model.key.short(), exc)
            unreachable = isinstance(exc, (CacheUnavailableError, OSError, TimeoutError))
            return "unreachable" if unreachable else "refused"
        self.kept_in[model.key] = self._keeper_now = pid
        log.info(
            "kept in keeper=%s key=%s bytes=%d keeper_models=%d keeper_bytes=%d",
            self.path,
            model.key.short(),
            model.slab_bytes,
            kept.models,
            kept.bytes,
        )
        return "kept"

    async def unkeep(self, model: ServedModel) -> None:
        async with self._lock:
            await self._unkeep(model)

    async def _unkeep(self, model: ServedModel) -> None:
        self.kept_in.pop(model.key, None)
        self._skip.pop(model.key, None)
        try:
            await unkeep(self.path, owner=self.owner, key=model.key.to_wire())
        except NotFoundError:
            pass  # never kept (an IPC slab, or the keeper restarted meanwhile)
        except (WCacheError, OSError, TimeoutError) as exc:
            log.warning(
                "keeper %s did not drop key=%s (its memory stays held until the keeper stops): %s",
                self.path,
                model.key.short(),
                exc,
            )

    def kept(self, models: Sequence[ServedModel]) -> int:
        """How many of ``models`` the keeper process last reached holds (as far as this daemon knows)."""
        return sum(1 for m in models if self._keeper_now and self.kept_in.get(m.key) == self._keeper_now)

    async def check(self, served: Callable[[], Sequence[ServedModel]]) -> None:
        """KEEP again every model (``served()``: the daemon's models now) that the keeper process now
        running does not hold (it restarted, or was not running when the model was loaded). One
        handshake when nothing is missing."""
        async with self._lock:
            try:
                async with asyncio.timeout(10.0):
                    ch, hello = await connect(self.path, software=f"wcache/{__version__}", name="wcache-server")
                    ch.close()
            except (WCacheError, OSError, TimeoutError) as exc:
                if not self._unreachable:
                    log.warning("keeper %s unreachable (%s): a daemon crash now would mean reloading", self.path, exc)
                self._unreachable = True
                self._keeper_now = 0
                return
            self._unreachable = False
            self._keeper_now = hello.server_pid
            pid = hello.server_pid
            missing = [
                m.key for m in served() if self.kept_in.get(m.key) != pid and self._skip.get(m.key) not in (0, pid)
            ]
            if missing:
                log.info(
                    "keeper %s (pid %d) does not hold %d model(s) of this daemon: keeping them",
                    self.path,
                    pid,
                    len(missing),
                )
            for key in missing:
                m = next((m for m in served() if m.key == key), None)  # evicted meanwhile: not kept
                if m is not None and await self._keep(m) == "refused":
                    self._skip[key] = pid  # not offered to this keeper again (one warning, not one per check)


# ---------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from wcache.paths import KEEPER_SOCKET, default_socket_dir

    p = argparse.ArgumentParser(
        prog="wcache-keeper",
        description="Hold wcache daemons' slabs (GPU or shared memory) across daemon restarts. "
        "Stopping the keeper frees everything it holds.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket-path", type=Path, help="the keeper's socket file (its directory must be private)")
    where.add_argument(
        "--socket-dir", type=Path, help=f"directory for {KEEPER_SOCKET} (default: {default_socket_dir()})"
    )
    p.add_argument("--ready-file", type=Path, help="write a JSON line here once serving")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


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
        level=args.log_level.upper(),
        format="%(asctime)s wcache-keeper[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        path = keeper_socket(args.socket_path, args.socket_dir)
        lock = DaemonLock(path)
        lock.acquire()
    except WCacheError as exc:
        print(f"wcache-keeper: error: {exc.message}", file=sys.stderr)
        return 1
    try:
        keeper = Keeper(path)

        def ready() -> None:
            log.info("ready socket=%s", path)
            if args.ready_file is not None:
                tmp = args.ready_file.with_name(args.ready_file.name + ".tmp")
                tmp.write_text(json.dumps({"socket": str(path), "pid": os.getpid()}) + "\n")
                os.replace(tmp, args.ready_file)

        import uvloop

        uvloop.run(keeper.serve(ready))
    finally:
        lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
