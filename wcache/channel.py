"""Moving bytes and file descriptors between a Unix socket and a sans-I/O Connection.

Used by both the daemon and the client. No parsing happens here: bytes go into
:class:`~wcache.proto.Connection`, typed frames come out. File descriptors travel as
SCM_RIGHTS ancillary data attached to the first byte of the frame that announces them
(docs/protocol.md §2.2), so every recv uses ``recvmsg`` with room for them.
"""

from __future__ import annotations

import array
import asyncio
import collections
import os
import socket
import struct
from pathlib import Path

from wcache.errors import CacheUnavailableError, ProtocolError, error_from_frame
from wcache.proto import (
    PROTOCOL_VERSION,
    Connection,
    ErrorFrame,
    Frame,
    Hello,
    HelloOk,
    Keep,
    Reclaimed,
    Role,
    State,
    TakeoverState,
)

__all__ = ["Channel", "PeerCredentials", "connect", "expect", "peer_credentials"]

RECV_SIZE = 1 << 18
MAX_FDS_PER_RECV = 16


class PeerCredentials:
    """The connecting process as the kernel reports it (SO_PEERCRED)."""

    __slots__ = ("gid", "pid", "uid")

    def __init__(self, pid: int, uid: int, gid: int) -> None:
        self.pid, self.uid, self.gid = pid, uid, gid

    def __repr__(self) -> str:
        return f"pid={self.pid} uid={self.uid}"


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCredentials(pid, uid, gid)


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class Channel:
    """A non-blocking Unix stream socket bound to one Connection.

    ``receive()`` returns the next frame with the file descriptors that came with it;
    ``send()`` writes a frame, optionally with file descriptors. Cancelling either
    leaves the socket unusable: the owner must ``close()`` it (the client does).
    """

    def __init__(self, sock: socket.socket, conn: Connection, *, accept_fds: bool) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.conn = conn
        self.accept_fds = accept_fds
        self._frames: collections.deque[Frame] = collections.deque()
        self._fds: list[int] = []
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        close_fds(self._fds)
        try:
            self.sock.close()
        except OSError:
            pass

    # ---------------------------------------------------------------- readiness
    async def _wait(self, writable: bool) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        fd = self.sock.fileno()
        if fd < 0:
            raise CacheUnavailableError("socket is closed")

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        if writable:
            loop.add_writer(fd, ready)
        else:
            loop.add_reader(fd, ready)
        try:
            await fut
        finally:
            if writable:
                loop.remove_writer(fd)
            else:
                loop.remove_reader(fd)

    # ---------------------------------------------------------------- send
    async def send(self, frame: Frame, fds: list[int] | tuple[int, ...] = ()) -> None:
        await self.send_bytes(self.conn.send(frame), fds)

    async def send_bytes(self, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
        view = memoryview(data)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while view:
            try:
                n = self.sock.sendmsg([view], anc) if anc else self.sock.send(view)
            except (BlockingIOError, InterruptedError):
                await self._wait(writable=True)
                continue
            anc = []  # the descriptors went with the first byte sent
            view = view[n:]

    # ---------------------------------------------------------------- receive
    async def _recv_some(self) -> None:
        """One recvmsg into the connection; b'' marks EOF."""
        space = socket.CMSG_SPACE(MAX_FDS_PER_RECV * 4)
        while True:
            try:
                data, anc, flags, _ = self.sock.recvmsg(RECV_SIZE, space)
                break
            except (BlockingIOError, InterruptedError):
                await self._wait(writable=False)
        fds: list[int] = []
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                fds.extend(arr)
        if flags & socket.MSG_CTRUNC:
            close_fds(fds)
            raise ProtocolError("file descriptors were truncated in transit")
        if fds and not self.accept_fds:
            close_fds(fds)
            raise ProtocolError("this peer may not send file descriptors")
        self._fds.extend(fds)
        self.conn.receive_data(data)

    async def receive(self, *, frame_timeout: float | None = None) -> tuple[Frame, list[int]]:
        """The next frame and its file descriptors (the caller owns and must close them).

        ``frame_timeout``: once part of a frame has arrived, the rest must arrive within
        this many seconds (TimeoutError otherwise) — a peer cannot hold a half-sent frame.
        Raises ProtocolError on bad input and EOFError when the peer closed cleanly
        between frames.
        """
        partial_since: float | None = None
        while not self._frames:
            if self.conn.eof:
                raise EOFError("peer closed the connection")
            if frame_timeout is not None and self.conn.buffered:
                loop = asyncio.get_running_loop()
                if partial_since is None:
                    partial_since = loop.time()
                left = partial_since + frame_timeout - loop.time()
                try:
                    if left <= 0:
                        raise TimeoutError
                    await asyncio.wait_for(self._recv_some(), left)
                except TimeoutError:
                    raise TimeoutError(
                        f"half a frame ({self.conn.buffered} bytes) not completed within {frame_timeout} s"
                    ) from None
            else:
                await self._recv_some()
            for frame in self.conn.events():
                self._frames.append(frame)
        frame = self._frames.popleft()
        want = frame.fd_count if isinstance(frame, (State, TakeoverState, Keep, Reclaimed)) else 0
        if want > len(self._fds):
            raise ProtocolError(f"{frame.TYPE} announces {want} file descriptor(s), {len(self._fds)} arrived")
        fds, self._fds = self._fds[:want], self._fds[want:]
        if self._fds and not self._frames and not self.conn.buffered:
            # descriptors travel with the first byte of the frame that announces them: these came with none
            n = len(self._fds)
            close_fds(fds)
            close_fds(self._fds)
            raise ProtocolError(f"{n} file descriptor(s) arrived that no frame announced")
        return frame, fds


async def connect(path: Path, *, software: str, name: str) -> tuple[Channel, HelloOk]:
    """Connect to the wcache socket at ``path`` (a daemon or a keeper), check that it runs as this
    user (or root), and shake hands. CacheUnavailableError when nothing answers there."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, str(path))
    except (FileNotFoundError, ConnectionRefusedError, PermissionError, OSError) as exc:
        sock.close()
        raise CacheUnavailableError(f"no wcache daemon at {path}: {exc.strerror or exc}") from exc
    creds = peer_credentials(sock)
    if creds.uid not in (os.geteuid(), 0):
        sock.close()
        raise CacheUnavailableError(f"the process at {path} runs as uid {creds.uid}, neither you nor root; refusing it")
    ch = Channel(sock, Connection(Role.CLIENT), accept_fds=True)
    try:
        await ch.send(Hello(versions=(PROTOCOL_VERSION,), software=software, name=name))
        frame, _ = await expect(ch)
        assert isinstance(frame, HelloOk)
    except BaseException:
        ch.close()
        raise
    return ch, frame


async def expect(ch: Channel) -> tuple[Frame, list[int]]:
    """The next frame; an ERROR frame becomes its exception class."""
    frame, fds = await ch.receive()
    if isinstance(frame, ErrorFrame):
        close_fds(fds)
        raise error_from_frame(frame.code, frame.message, frame.details)
    return frame, fds
