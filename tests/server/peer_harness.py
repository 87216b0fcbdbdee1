"""A minimal stand-in for the server shell around ``PeerService``, for tests of the peer handler and the target's
fill in one process: accept on loopback TCP, TLS handshake (``StreamChannel``), HELLO, then request -> handler
-> reply, WCacheErrors as ERROR frames, ``closed`` at the end. The daemon serves the handler on the real shell
(wcache/server/service.py); this has none of its limits or deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

from wcache.errors import PermissionDeniedError, ProtocolError, WCacheError
from wcache.proto import Connection, ErrorFrame, Hello, Role, Service
from wcache.server.peer import PeerService
from wcache.server.peer_channel import StreamChannel


class _Ctx:
    def __init__(self, id: int) -> None:
        self.id = id


async def _serve(service: PeerService, sock: socket.socket, cid: int, kill: set[int]) -> None:
    sec = service.security
    conn = Connection(Role.SERVER, service=Service.PEER, auth=sec.mode == "secret", max_frame_size=1 << 20)
    ch = StreamChannel(sock, conn, context=sec.server_context(), server_side=True)
    ctx = _Ctx(cid)
    try:
        await asyncio.wait_for(ch.handshake(), 5)
        hello, _ = await ch.receive()
        assert isinstance(hello, Hello)
        await ch.send(service.hello(conn, hello, ctx))
        while True:
            frame, _ = await ch.receive()
            if cid in kill:
                return  # the source "dies": the connection drops mid-fill
            rid = getattr(frame, "id", 0)
            try:
                await ch.send(await service.handle(frame, [], ctx))  # type: ignore[arg-type]
            except PermissionDeniedError as exc:
                await ch.send_bytes(conn.fatal_error(exc, rid))
                return
            except ProtocolError:
                raise
            except WCacheError as exc:
                await ch.send(ErrorFrame.from_exception(exc, rid))
    except (EOFError, ConnectionError, ProtocolError, OSError, TimeoutError):
        pass
    finally:
        service.closed(ctx)
        ch.close()


class Harness:
    """``async with Harness(service) as port``; ``kill_next()`` makes the next request's connection drop."""

    def __init__(self, service: PeerService) -> None:
        self.service = service
        self.kill: set[int] = set()
        self._next = 1
        self._tasks: set[asyncio.Task[None]] = set()
        self.kill_after_reads = 0

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[int]:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.setblocking(False)
        loop = asyncio.get_running_loop()

        async def accept() -> None:
            while True:
                sock, _ = await loop.sock_accept(listener)
                cid, self._next = self._next, self._next + 1
                t = asyncio.ensure_future(_serve(self.service, sock, cid, self.kill))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

        acc = asyncio.ensure_future(accept())
        try:
            yield listener.getsockname()[1]
        finally:
            acc.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acc
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            listener.close()
