"""The server shell (wcache/server/service.py) around a fake handler, in this process over a real Unix socket:
how failures map to ERROR frames, what happens to descriptors a request brings, the peer check seam, the
connection cap and deadlines, draining. The daemon's and the keeper's own behaviour: test_daemon.py,
test_keeper.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from wcache.channel import Channel, close_fds, connect, expect
from wcache.errors import (
    InternalError,
    LimitExceededError,
    LocalProtocolError,
    NotFoundError,
    OutOfMemoryError,
    PermissionDeniedError,
    ProtocolError,
    RemoteProtocolError,
)
from wcache.proto import (
    Connection,
    DeviceInfo,
    ErrorFrame,
    Frame,
    Hello,
    HelloOk,
    Keep,
    Kept,
    Phase,
    Service,
    Status,
    StatusReply,
)
from wcache.proto.examples import EXAMPLES
from wcache.server.listen import bind_private_socket
from wcache.server.service import ConnectionLimits, Context, PeerIdentity, Refusal, Reply, SameUid, Shell

log = logging.getLogger("wcache.test")


class FakeService:
    """A keeper-like handler (it takes KEEP and its descriptors): STATUS answers, or raises what ``fail`` names
    for its request id (once); KEEP keeps its descriptors only if the owner is "keep". A peer whose HELLO names it
    "holder" holds something (``holds``) from its handshake on."""

    holding = "thing"
    auth = False

    def __init__(self, service: Service = Service.KEEPER) -> None:
        self.service = service
        self.fail: dict[int, BaseException] = {}
        #: request ids whose ``fail`` error is returned as a fatal ERROR instead of raised
        self.fatal: set[int] = set()
        self.kept: list[int] = []
        self.seen: list[Context] = []
        self.closed_ids: list[int] = []
        self.pinned: set[int] = set()
        self.slow = asyncio.Event()
        self.slow_ids: set[int] = set()

    def hello(self, conn: Connection, hello: Hello, ctx: Context) -> HelloOk:
        if hello.name == "holder":
            self.pinned.add(ctx.id)
        return conn.hello_reply(hello, software="fake", backend="host", device=DeviceInfo("cpu"), server_pid=0)

    async def handle(self, request: Frame, fds: list[int], ctx: Context) -> Reply | Frame:
        self.seen.append(ctx)
        assert isinstance(request, (Status, Keep))
        if request.id in self.slow_ids:
            await self.slow.wait()
        failure = self.fail.pop(request.id, None)  # once: a later connection's request of that id succeeds
        if failure is not None:
            if request.id in self.fatal:
                return ErrorFrame.from_exception(failure, request.id, fatal=True)  # type: ignore[arg-type]
            raise failure
        if isinstance(request, Keep):
            if request.owner == "keep":
                self.kept.extend(fds)
                fds.clear()
            return Kept(id=request.id, models=len(self.kept), bytes=0)
        return StatusReply(
            id=request.id, software="fake", backend="host", device=DeviceInfo("cpu"), uptime_seconds=0.0, connections=0
        )

    def holds(self, ctx: Context) -> bool:
        return ctx.id in self.pinned

    def protects(self) -> Callable[[Context], bool]:
        return lambda ctx: False

    def closed(self, ctx: Context) -> None:
        self.closed_ids.append(ctx.id)


@contextlib.asynccontextmanager
async def serving(
    handler: FakeService, path: Path, limits: ConnectionLimits | None = None, **kw: object
) -> AsyncIterator[Shell]:
    shell = Shell(
        handler,
        limits=limits or ConnectionLimits(),
        tag=f"socket={path}",
        log=log,
        peer_check=kw.pop("peer_check", SameUid("fake")),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )
    shell.start(bind_private_socket(path))
    try:
        yield shell
    finally:
        await shell.close()
        await shell.drain()
        os.unlink(path)
        close_fds(handler.kept)


async def _open(path: Path, name: str = "test") -> Channel[Any]:
    ch, _ = await connect(path, software="test", name=name)
    return ch


async def _status(ch: Channel[Any]) -> StatusReply:
    await ch.send(Status(id=ch.conn.next_request_id()))
    frame, _ = await expect(ch)
    assert isinstance(frame, StatusReply)
    return frame


async def _until(what: Callable[[], object], deadline_s: float = 20.0) -> None:
    t_end = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < t_end, "not reached before the deadline"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("raised", "code", "fatal"),
    [
        (OutOfMemoryError("no room"), OutOfMemoryError, False),  # a refusal: answered, the connection serves on
        (RuntimeError("a bug"), InternalError, False),  # anything else: INTERNAL, logged, serves on
        (PermissionError(1, "Operation not permitted"), InternalError, False),  # an OSError of the handler's own
        (RemoteProtocolError("the peer's bytes"), ProtocolError, True),  # the peer's: fatal
        (LocalProtocolError("ours"), InternalError, True),  # our bug: INTERNAL, never PROTOCOL_ERROR, fatal
        # another party's verdict on what the handler sent it (a keeper's PROTOCOL_ERROR): ours, not this peer's
        (ProtocolError("the keeper refused what this daemon sent it"), InternalError, False),
    ],
)
async def test_a_failure_maps_to_its_error_frame(
    socket_dir: Path, raised: BaseException, code: type[Exception], fatal: bool
) -> None:
    handler = FakeService()
    handler.fail[1] = raised
    async with serving(handler, socket_dir / "s.sock") as shell:
        ch = await _open(socket_dir / "s.sock")
        try:
            with pytest.raises(code) as info:
                await _status(ch)
            assert type(info.value) is code
            if fatal:
                assert ch.conn.phase is Phase.CLOSED
                with pytest.raises((EOFError, ConnectionError)):
                    await asyncio.wait_for(ch.receive(), 20)
            else:
                assert isinstance(await _status(ch), StatusReply)  # the same connection serves on
        finally:
            ch.close()
        await _until(lambda: len(shell) == 0)
        assert shell.metrics.errors[code.code.name] == 1  # type: ignore[attr-defined]


async def test_a_fatal_error_the_handler_returns_ends_the_connection(socket_dir: Path) -> None:
    """A handler refusing a peer for good (a failed proof) returns a fatal ERROR: it is sent, then the
    connection closes, and the service serves others on."""
    handler = FakeService()
    handler.fail[1], handler.fatal = PermissionDeniedError("wrong proof"), {1}
    async with serving(handler, socket_dir / "s.sock") as shell:
        ch = await _open(socket_dir / "s.sock")
        try:
            with pytest.raises(PermissionDeniedError, match="wrong proof"):
                await _status(ch)
            with pytest.raises((EOFError, ConnectionError)):
                await asyncio.wait_for(ch.receive(), 20)
        finally:
            ch.close()
        await _until(lambda: len(shell) == 0)
        other = await _open(socket_dir / "s.sock")
        try:
            assert isinstance(await _status(other), StatusReply)
        finally:
            other.close()


async def test_a_request_for_another_service_is_not_found_and_not_fatal(socket_dir: Path) -> None:
    async with serving(FakeService(Service.KEEPER), socket_dir / "s.sock"):
        ch = await _open(socket_dir / "s.sock")
        try:
            await ch.send(EXAMPLES["GET_STATE"])
            with pytest.raises(NotFoundError, match="is a wcache keeper"):
                await expect(ch)
            assert isinstance(await _status(ch), StatusReply)
        finally:
            ch.close()


def _memfd() -> int:
    fd = os.memfd_create("wcache-test-keep")
    os.ftruncate(fd, 4096)
    return fd


def _same_file_open(fd: int) -> bool:
    """Whether this process holds another descriptor of the file ``fd`` names (the shell's received copy)."""
    want = os.fstat(fd)
    for name in os.listdir("/proc/self/fd"):
        other = int(name)
        if other == fd:
            continue
        with contextlib.suppress(OSError):
            st = os.fstat(other)
            if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
                return True
    return False


@pytest.mark.parametrize("owner", ["keep", "drop"])
async def test_descriptors_a_request_brought_are_closed_unless_the_handler_kept_them(
    socket_dir: Path, owner: str
) -> None:
    handler = FakeService()
    example = EXAMPLES["KEEP"]
    assert isinstance(example, Keep)
    async with serving(handler, socket_dir / "s.sock"):
        ch = await _open(socket_dir / "s.sock")
        fd = _memfd()
        try:
            await ch.send(dataclasses.replace(example, id=1, owner=owner), [fd])
            reply, _ = await expect(ch)
            assert isinstance(reply, Kept)
            assert _same_file_open(fd) is (owner == "keep")
            assert len(handler.kept) == (owner == "keep")
        finally:
            ch.close()
            os.close(fd)


class _Principal:
    """A peer check as a TCP peer service would plug in: it proves who the peer is (here it only names it) and
    refuses whom it does not know."""

    def __init__(self, name: str, allowed: bool) -> None:
        self.name, self.allowed = name, allowed

    async def identify(self, ch: Channel[Any]) -> PeerIdentity:
        return PeerIdentity(principal=self.name)

    def refusal(self, peer: PeerIdentity) -> Refusal | None:
        if self.allowed:
            return None
        return Refusal("unknown-principal", PermissionDeniedError(f"{peer.principal} is not known here"))


@pytest.mark.parametrize("allowed", [True, False])
async def test_the_peer_check_decides_who_speaks_and_names_the_peer(socket_dir: Path, allowed: bool) -> None:
    handler = FakeService()
    async with serving(handler, socket_dir / "s.sock", peer_check=_Principal("node-7", allowed)) as shell:
        if allowed:
            ch = await _open(socket_dir / "s.sock")
            try:
                await _status(ch)
            finally:
                ch.close()
            assert [c.peer for c in handler.seen] == [PeerIdentity(principal="node-7")]
        else:
            with pytest.raises(PermissionDeniedError, match="node-7 is not known here"):
                await _open(socket_dir / "s.sock")
            assert handler.seen == [] and shell.metrics.errors["PERMISSION_DENIED"] == 1


async def test_at_the_cap_a_connection_that_holds_nothing_gives_way(socket_dir: Path) -> None:
    """Cap 2: a holder and an idle connection; a new one takes the idle one's place (told so), and with two
    holders the next is refused."""
    handler = FakeService()
    path = socket_dir / "s.sock"
    async with serving(handler, path, ConnectionLimits(connections=2)):
        holder, idle = await _open(path, "holder"), await _open(path)
        try:
            newcomer = await _open(path, "holder")
            await _status(newcomer)
            with pytest.raises(LimitExceededError, match="closed to admit a new connection"):
                await expect(idle)
            with pytest.raises(LimitExceededError, match="too many connections"):
                await _open(path)
            await _status(holder)  # the holder served on throughout
            newcomer.close()
        finally:
            holder.close()
            idle.close()


async def test_deadlines_close_a_silent_peer_but_not_one_that_holds_something(socket_dir: Path) -> None:
    handler = FakeService()
    path = socket_dir / "s.sock"
    limits = ConnectionLimits(handshake_timeout=0.3, idle_timeout=0.3)
    async with serving(handler, path, limits) as shell:
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.settimeout(20)
        silent.connect(str(path))
        assert await asyncio.to_thread(silent.recv, 1) == b""  # no HELLO within 0.3 s: closed
        silent.close()
        holder, idle = await _open(path, "holder"), await _open(path)
        try:
            with pytest.raises((EOFError, ConnectionError)):
                await asyncio.wait_for(idle.receive(), 20)  # idle holding nothing: closed
            await asyncio.sleep(0.6)  # twice the idle deadline
            assert isinstance(await _status(holder), StatusReply) and len(shell) == 1
        finally:
            holder.close()
            idle.close()


async def test_drain_lets_a_request_in_flight_finish(socket_dir: Path) -> None:
    handler = FakeService()
    handler.slow_ids.add(1)
    path = socket_dir / "s.sock"
    shell = Shell(handler, limits=ConnectionLimits(shutdown_grace=20), tag="t", log=log, peer_check=SameUid("fake"))
    shell.start(bind_private_socket(path))
    ch = await _open(path)
    try:
        await ch.send(Status(id=ch.conn.next_request_id()))
        await _until(lambda: handler.seen)
        await shell.close()
        drain = asyncio.ensure_future(shell.drain())
        await asyncio.sleep(0.1)
        assert not drain.done()  # waits for the request being answered
        handler.slow.set()
        reply, _ = await expect(ch)
        assert isinstance(reply, StatusReply)
        await asyncio.wait_for(drain, 20)
        assert len(shell) == 0 and handler.closed_ids == [handler.seen[0].id]
    finally:
        ch.close()
        os.unlink(path)


async def test_a_frame_received_as_its_connection_is_cancelled_has_its_descriptors_closed() -> None:
    """A connection's task cancelled (a stop, an eviction) in the loop turn in which its next request arrived: the
    request is answered by nobody, and the descriptors it carried are closed, not leaked."""
    import os

    from wcache.server.service import ConnectionLimits, Shell

    class Holder:
        holding = "lease"

        def holds(self, ctx: object) -> bool:
            return False

    class Quiet:
        limits = ConnectionLimits(idle_timeout=None)
        handler = Holder()

    class Arriving:
        def __init__(self) -> None:
            self.go = asyncio.Event()
            self.fd = os.open("/dev/null", os.O_RDONLY)

        async def receive(self, frame_timeout: float | None = None) -> tuple[str, list[int]]:
            await self.go.wait()
            return "FRAME", [self.fd]

    ch = Arriving()
    shell: Any = Quiet()
    task = asyncio.ensure_future(Shell._next_request(shell, ch, None))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    (recv,) = [t for t in asyncio.all_tasks() if t is not task and t is not asyncio.current_task()]
    ch.go.set()
    while not recv.done():
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.01)
    with pytest.raises(OSError):
        os.fstat(ch.fd)  # closed
