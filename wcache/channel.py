"""Moving bytes and file descriptors between a Unix socket and a sans-I/O connection.

Used by the daemon, the keeper and the client. No parsing happens here: bytes and the
descriptors that came with them go into :class:`~wcache.proto.Connection` (or an engine's
``wcache.proto.engine.EngineConnection``), typed frames with their descriptors come out (which frame takes how
many, and who may send any, is the connection's business: docs/protocol.md §2.2). Every recv uses ``recvmsg``
with room for descriptors, since they ride on the first byte of the frame that announces them.

An engine's restart imports this module (``connect_engine``): it imports the reference connection, the frame
declarations and the error tree where they are used, not at import.
"""

from __future__ import annotations

import array
import asyncio
import collections
import errno
import fcntl
import os
import select
import socket
import struct
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcache.proto.codec import DEFAULT_MAX_FRAME_SIZE, MAX_HANDSHAKE_FRAME
from wcache.proto.engine import EngineConnection, HelloOk, Released, State
from wcache.proto.limits import MAX_FRAME_FDS, PROTOCOL_VERSION

if TYPE_CHECKING:  # the reference connection, the frames and the errors: imported where used (module docstring)
    from collections.abc import Callable, Iterable, Iterator
    from typing import Generic, Protocol, TypeAlias, TypeVar

    from wcache.errors import CacheUnavailableError
    from wcache.proto import daemon_frames
    from wcache.proto.connection import Connection, Service
    from wcache.proto.engine import Received
    from wcache.proto.frames import Frame

    class SansIO(Protocol):
        """What a Channel moves bytes for: ``wcache.proto.Connection``, or an engine's ``EngineConnection``."""

        def receive_data(self, data: bytes | bytearray | memoryview, fds: Iterable[int] = ...) -> None: ...
        def receive_space(self) -> memoryview | None: ...
        def received_into(self, n: int, fds: Iterable[int] = ...) -> None: ...
        def received(self) -> Iterator[tuple[Any, list[int]]]: ...
        def release_fds(self) -> list[int]: ...
        @property
        def buffered(self) -> int: ...
        @property
        def demand(self) -> int: ...
        @property
        def frame_limit(self) -> int: ...
        @property
        def eof(self) -> bool: ...

    C = TypeVar("C", bound=SansIO)

    #: builds the request sent right behind HELLO (pipelining, docs/protocol.md §5.1) from the new connection
    Pipeline: TypeAlias = Callable[[Connection], Frame]
    #: builds an engine's GET_STATE map, sent right behind HELLO, from its new connection (``wcache.proto.engine``)
    EnginePipeline: TypeAlias = Callable[[EngineConnection], dict[str, Any]]
    #: work that needs no reply, done once the opening is written and before HELLO_OK is read: it overlaps the
    #: daemon's answer instead of adding to it (an engine's fetch loads its mapping's modules there)
    Meanwhile: TypeAlias = Callable[[], None]
    #: a received frame and its descriptors, as its caller takes them (an ERROR raised as its class)
    Expected: TypeAlias = Callable[[Any, list[int]], tuple[Any, list[int]]]
else:  # generic to the type checker only (``_record.Subscriptable``: typing's classes cost an engine's import)
    from wcache.proto._record import Subscriptable as Generic

    C = None

__all__ = [
    "Channel",
    "PeerCredentials",
    "ReadBudget",
    "connect",
    "connect_blocking",
    "connect_engine",
    "connect_engine_blocking",
    "dial",
    "dial_blocking",
    "expect",
    "expect_engine",
    "expect_engine_blocking",
    "expect_blocking",
    "memfd_problem",
    "peer_credentials",
    "time_left",
]

RECV_SIZE = 1 << 18
#: room for descriptors in every read: what one frame may carry (docs/protocol.md §2.2)
MAX_FDS_PER_RECV = MAX_FRAME_FDS
#: Default bound on the bytes all server-side channels of a process may hold in unfinished frames
#: (docs/protocol.md §7); a daemon passes its own.
DEFAULT_READ_BUDGET = 256 * 1024 * 1024


class ReadBudget:
    """The bytes that the channels sharing it may buffer in unfinished frames, all together.

    Each channel claims what its frame in progress will need as soon as the length prefix is in
    (``Connection.demand``), before the body is buffered; a claim that does not fit is a
    FrameTooLargeError for that connection only (the others keep their claims). Without a bound, a few
    dozen peers each sending most of a 64 MiB frame took a daemon to an OOM kill. Frames of at most
    MAX_HANDSHAKE_FRAME (64 KiB: every HELLO and every request an engine sends) are counted but never
    refused, so peers filling the budget cannot lock engines out; memory stays below ``limit`` plus 64 KiB
    (and one read) per connection.
    """

    __slots__ = ("held", "limit", "peers")

    def __init__(self, limit: int = DEFAULT_READ_BUDGET) -> None:
        if limit < 1:
            raise ValueError("a read budget must be at least 1 byte")
        self.limit = limit
        self.held = 0
        self.peers = 0  # channels holding a claim, for the error message

    def claim(self, old: int, new: int) -> int:
        """Move one channel's claim from ``old`` to ``new`` bytes; returns the claim now held.
        Raises FrameTooLargeError (leaving ``old`` claimed) when a larger claim does not fit."""
        if new > old and new > MAX_HANDSHAKE_FRAME and self.held - old + new > self.limit:
            from wcache.errors import FrameTooLargeError

            raise FrameTooLargeError(
                f"a frame needing {new} bytes does not fit: {self.held} of the {self.limit} bytes this process "
                f"buffers for unfinished frames are held by {self.peers} connection(s); retry later",
                details={"size": new, "max_size": max(0, self.limit - self.held + old)},
            )
        self.held += new - old
        self.peers += (new > 0) - (old > 0)
        return new


#: The budget server-side channels share unless given one (a keeper's: the server shell passes it; a daemon passes
#: its own).
SERVER_READ_BUDGET = ReadBudget()


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


#: the seals a host slab's memfd carries wherever it travels (docs/protocol.md §4.5: STATE, TAKEOVER_STATE, KEEP,
#: RECLAIMED): nobody, its creator included, can change its bytes (F_SEAL_WRITE: no write, no writable mapping) or
#: its size, nor remove a seal
HOST_SEALS = (
    fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if sys.platform == "linux" else 0
)


def memfd_problem(fd: int, size: int, *, exact: bool = False) -> str | None:
    """Why the received descriptor ``fd`` cannot stand for a host slab of ``size`` bytes (None: it can): it must be a
    memfd sealed with HOST_SEALS (docs/protocol.md §4.5) of at least ``size`` bytes (``exact``: of exactly ``size``).
    One check wherever such a descriptor arrives — an engine's STATE (``wcache.client.mapping``), a keeper's KEEP and
    RECLAIM, a daemon's adoption — at one F_GET_SEALS and one fstat each: an unsealed memfd's sender could change an
    engine's read-only weights under it, or shrink it and kill it with SIGBUS on its next read."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        have = os.fstat(fd).st_size
    except OSError:
        return "the descriptor is not a memfd"
    if seals & HOST_SEALS != HOST_SEALS:
        return (
            "the memfd is not sealed against writes and resizing (F_SEAL_WRITE|F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL)"
        )
    if have < size or (exact and have != size):
        return f"the memfd has {have} bytes, its slab {size}"
    return None


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class Channel(Generic[C]):
    """A non-blocking Unix stream socket bound to one sans-I/O connection (``conn``).

    ``receive()`` returns the next frame with the file descriptors that came with it;
    ``send()`` writes a frame, optionally with file descriptors. Cancelling either
    leaves the socket unusable: the owner must ``close()`` it (the client does).
    """

    def __init__(
        self,
        sock: socket.socket,
        conn: C,
        *,
        budget: ReadBudget | None = None,
        send_timeout: float | None = None,
        max_unread_fds: int | None = None,
    ) -> None:
        """``budget``: shared bound on unfinished-frame bytes (None: none; server-side channels share one:
        SERVER_READ_BUDGET unless the server gives its own). ``send_timeout``: a frame must be taken by the peer within
        this many seconds (TimeoutError otherwise: the peer does not read). ``max_unread_fds``: at most this
        many descriptors sent and not yet read by the peer; a send that would pass it waits (within
        ``send_timeout``) for the peer to read (descriptors queued in an unread socket count against the
        sending uid's in-flight limit, RLIMIT_NOFILE: a peer that never reads would exhaust it for all)."""
        sock.setblocking(False)
        self.sock = sock
        self.conn = conn
        self.budget = budget
        self.send_timeout = send_timeout
        self.max_unread_fds = max_unread_fds
        self._claimed = 0
        self._frames: collections.deque[tuple[Any, list[int]]] = collections.deque()
        self._closed = False
        #: bytes handed to the kernel so far, and (stream offset of a frame's first byte, its descriptors)
        #: for frames whose descriptors the peer may not have read yet
        self._sent = 0
        self._unread: collections.deque[tuple[int, int]] = collections.deque()
        #: seconds spent waiting for the socket to be readable (a client's figure: its wait for the daemon's answer;
        #: in a task on a busy event loop, until the task resumed)
        self.waited = 0.0
        #: seconds spent decoding the frames received (``conn.received()``: a client's figure, beside ``waited``)
        self.decoded = 0.0

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        close_fds(self.conn.release_fds())
        for _, fds in self._frames:
            close_fds(fds)
        self._frames.clear()
        if self.budget is not None:
            self._claimed = self.budget.claim(self._claimed, 0)
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
            from wcache.errors import CacheUnavailableError

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
    async def send(self: Channel[Connection], frame: Frame, fds: list[int] | tuple[int, ...] = ()) -> None:
        await self.send_bytes(self.conn.send(frame), fds)

    async def send_bytes(self, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
        """Write one frame's bytes (with ``fds`` on its first byte). TimeoutError when the peer does not
        take it within ``send_timeout``; the channel is then unusable (half a frame may be out)."""
        if self.send_timeout is None:
            await self._send_bytes(data, fds)
            return
        try:
            async with asyncio.timeout(self.send_timeout):
                await self._send_bytes(data, fds)
        except TimeoutError:
            raise TimeoutError(
                f"peer did not read a {len(data)}-byte frame ({len(fds)} descriptor(s); "
                f"{self.unread_fds()} sent before are unread) within {self.send_timeout} s"
            ) from None

    async def _send_bytes(self, data: bytes, fds: list[int] | tuple[int, ...]) -> None:
        if fds and self.max_unread_fds is not None:
            await self._room_for_fds(len(fds))
        start = self._sent
        view = memoryview(data)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while view:
            try:
                n = self.sock.sendmsg([view], anc) if anc else self.sock.send(view)
            except (BlockingIOError, InterruptedError):
                await self._wait(writable=True)
                continue
            if anc:
                self._unread.append((start, len(fds)))
            anc = []  # the descriptors went with the first byte sent
            view = view[n:]
            self._sent += n

    def unread_fds(self) -> int:
        """Descriptors sent that the peer may not have read yet (an upper bound).

        SIOCOUTQ on a Unix socket is the memory of what the peer has not consumed (at least its bytes),
        so every byte before ``sent - outq`` has been read, and with a frame's first byte its descriptors."""
        if not self._unread:
            return 0
        try:
            import termios  # only channels bounding unread descriptors (a daemon's) get here: not a client's import

            raw = fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            (outq,) = struct.unpack("i", raw)
        except OSError:
            return sum(n for _, n in self._unread)
        read = self._sent - outq
        while self._unread and self._unread[0][0] < read:
            self._unread.popleft()
        return sum(n for _, n in self._unread)

    async def _room_for_fds(self, n: int) -> None:
        """Wait until ``n`` more descriptors keep this peer within ``max_unread_fds`` (a frame carrying more
        than the bound waits until the peer has read everything). The kernel tells no one when a peer reads,
        so this polls, backing off to 50 ms; only a peer that lets replies pile up ever waits."""
        assert self.max_unread_fds is not None
        pause = 0.001
        while (unread := self.unread_fds()) and unread + n > self.max_unread_fds:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)

    # ---------------------------------------------------------------- receive
    def _recv_once(self) -> None:
        """One recvmsg into the connection (b'' marks EOF); BlockingIOError when a non-blocking socket has
        nothing to read. Descriptors arrive close-on-exec (MSG_CMSG_CLOEXEC): no program this process runs
        inherits a slab's. The rest of a big frame goes straight where the connection assembles it
        (``Connection.receive_space``: a client's STATE), other reads through a buffer of their own."""
        space = socket.CMSG_SPACE(MAX_FDS_PER_RECV * 4)
        target = self.conn.receive_space()
        if target is not None:
            with target:
                n, anc, flags, _ = self.sock.recvmsg_into([target], space, socket.MSG_CMSG_CLOEXEC)
        else:
            # never more than the frame limit now allows (small before the handshake): what one read
            # brings in is held before the length prefix in it can be checked
            data, anc, flags, _ = self.sock.recvmsg(
                min(RECV_SIZE, self.conn.frame_limit + 4), space, socket.MSG_CMSG_CLOEXEC
            )
        fds: list[int] = []
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
                fds.extend(arr)
        if flags & socket.MSG_CTRUNC:
            close_fds(fds)
            from wcache.errors import RemoteProtocolError

            raise RemoteProtocolError("file descriptors were truncated in transit")
        if target is None:
            self.conn.receive_data(data, fds)
        elif n:
            self.conn.received_into(n, fds)
        else:
            self.conn.receive_data(b"", fds)  # the stream ended inside the frame

    async def _recv_some(self) -> None:
        """One recvmsg into the connection, waiting for the socket to be readable."""
        while True:
            try:
                self._recv_once()
                return
            except (BlockingIOError, InterruptedError):
                t0 = time.perf_counter()
                await self._wait(writable=False)
                self.waited += time.perf_counter() - t0

    # ---------------------------------------------------------------- blocking (no event loop)
    def receive_blocking(self, timeout: float) -> tuple[Any, list[int]]:
        """``receive()`` for callers without an event loop: the next frame within ``timeout`` seconds of this call,
        TimeoutError otherwise — one deadline for the call, however the peer's bytes trickle in (a bound on each
        wait let a peer sending a byte now and then hold the caller for ever). The socket stays non-blocking, as
        the asyncio methods expect it; ``waited`` gets the time spent waiting for it to be readable (a read that
        finds bytes waits for none)."""
        deadline = time.monotonic() + timeout
        self.sock.setblocking(False)
        while not self._frames:
            if self.conn.eof:
                raise EOFError("peer closed the connection")
            try:
                self._recv_once()
            except (BlockingIOError, InterruptedError):
                self._poll(deadline, timeout)
                continue
            self._take_frames()
        return self._frames.popleft()

    def _take_frames(self) -> None:
        """After a read: the frames it completed decoded and queued (``decoded`` timed), the budget claimed anew."""
        t0 = time.perf_counter()
        self._frames.extend(self.conn.received())
        self.decoded += time.perf_counter() - t0
        if self.budget is not None:
            self._claimed = self.budget.claim(self._claimed, self.conn.demand)

    def _poll(self, deadline: float, timeout: float) -> None:
        """Wait until the socket is readable (poll: no descriptor-number limit), at most until ``deadline``
        (``time.monotonic``); TimeoutError, naming the call's ``timeout``, once it has passed."""
        ms = (deadline - time.monotonic()) * 1000
        if ms <= 0:
            raise TimeoutError(f"no whole frame within {timeout} s")
        t0 = time.perf_counter()
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        ready = poller.poll(_POLL_MAX_MS if ms >= _POLL_MAX_MS else int(ms) + 1)  # rounded up: never shorter
        self.waited += time.perf_counter() - t0
        if not ready:
            raise TimeoutError(f"no whole frame within {timeout} s")

    def send_blocking(self: Channel[Connection], frame: Frame, timeout: float) -> None:
        """``send()`` without descriptors for callers without an event loop (TimeoutError after ``timeout``)."""
        self.send_bytes_blocking(self.conn.send(frame), timeout)

    def send_bytes_blocking(self, data: bytes, timeout: float) -> None:
        """Write frames' bytes (no descriptors) for callers without an event loop, all of them within ``timeout``
        seconds (``sendall``'s timeout bounds the whole call)."""
        try:
            self.sock.settimeout(_socket_timeout(timeout))
            self.sock.sendall(data)
            self._sent += len(data)
        finally:
            if not self._closed:
                self.sock.setblocking(False)

    async def receive(self, *, frame_timeout: float | None = None) -> tuple[Any, list[int]]:
        """The next frame (or, on a server, a request for another service: ``Misdirected``) and its file
        descriptors (the caller owns and must close them).

        ``frame_timeout``: once part of a frame has arrived, the rest must arrive within
        this many seconds (TimeoutError otherwise) — a peer cannot hold a half-sent frame.
        Raises RemoteProtocolError on bad input and EOFError when the peer closed cleanly
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
            self._take_frames()
        return self._frames.popleft()


#: the longest wait poll(2) takes in one call (ms; an int): longer timeouts wait this long
_POLL_MAX_MS = 2**31 - 1


def time_left(deadline: float) -> float:
    """Seconds from now until ``deadline`` (``time.monotonic``): what the next blocking step of a call bounded by
    one deadline may take. TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    return left


#: a blocking step's timeout (seconds) above which it has no limit: a socket's timeout is nanoseconds in an int64
#: (OverflowError from ~9.2e9 s, math.inf included), and 30 years is for ever to a request
_NO_LIMIT_S = 1e9


def _socket_timeout(timeout: float) -> float | None:
    """``timeout`` for ``socket.settimeout``: None (no limit) for one past ``_NO_LIMIT_S``, ``math.inf`` among
    them — what the asynchronous calls' ``asyncio.timeout`` makes of it."""
    return None if timeout > _NO_LIMIT_S else timeout


def _socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)


def _dialling_socket(path: Path, peer: str) -> socket.socket:
    """A fresh socket to dial ``path`` with. A process that cannot open one — at its descriptor limit (EMFILE),
    the system's (ENFILE), out of memory (ENOMEM, ENOBUFS) — gets CacheUnavailableError naming the socket and the
    errno: the cache is then as unusable to it as a slab it cannot map, and an engine's fallback catches
    WCacheError only (``socket()``'s bare OSError crashed its load instead of loading from disk). The error tree
    is imported here, as everywhere on the fetch path: an engine that catches WCacheError has it loaded already
    (``wcache.nn`` imports it); one that has not gets the import's own OSError, a process without descriptors
    being unable to read a module."""
    try:
        return _socket()
    except OSError as exc:
        raise out_of_resources(f"cannot open a socket to the {peer} at {path} in this process", path, exc) from exc


#: errnos of a process out of descriptors (its own limit, the system's) or memory
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def out_of_resources(what: str, path: Path, exc: OSError) -> CacheUnavailableError:
    """CacheUnavailableError for ``what`` (a sentence naming what failed) that this process could not do for want
    of descriptors or memory (``exc``), naming the socket ``path`` and the errno (``details``: socket, errno)."""
    from wcache.errors import CacheUnavailableError

    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return CacheUnavailableError(
        f"{what}: {code} ({exc.strerror or exc})", details={"socket": str(path), "errno": code}
    )


def _unavailable(path: Path, exc: OSError, peer: str) -> CacheUnavailableError:
    from wcache.errors import CacheUnavailableError

    return CacheUnavailableError(f"no {peer} at {path}: {exc.strerror or exc}")


def _check_peer(sock: socket.socket, path: Path) -> None:
    creds = peer_credentials(sock)
    if creds.uid not in (os.geteuid(), 0):
        sock.close()
        from wcache.errors import CacheUnavailableError

        raise CacheUnavailableError(f"the process at {path} runs as uid {creds.uid}, neither you nor root; refusing it")


async def dial(path: Path, peer: str = "wcache daemon") -> socket.socket:
    """A non-blocking socket connected to the wcache socket at ``path`` whose process runs as this user (or root).
    CacheUnavailableError when nothing answers there ("no ``peer`` at PATH"), or another user's process does, or
    this process cannot open a socket (``_dialling_socket``)."""
    loop = asyncio.get_running_loop()
    sock = _dialling_socket(path, peer)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, str(path))
        _check_peer(sock, path)
    except OSError as exc:  # FileNotFoundError, ConnectionRefusedError, PermissionError among them
        sock.close()
        raise _unavailable(path, exc, peer) from exc
    except BaseException:  # cancelled, or the peer refused: the socket is not the caller's
        sock.close()
        raise
    return sock


def dial_blocking(path: Path, timeout: float, peer: str = "wcache daemon") -> socket.socket:
    """``dial()`` for callers without an event loop (TimeoutError after ``timeout`` seconds)."""
    sock = _dialling_socket(path, peer)
    try:
        sock.settimeout(_socket_timeout(timeout))
        sock.connect(str(path))
        _check_peer(sock, path)
    except TimeoutError:
        sock.close()
        raise
    except OSError as exc:  # FileNotFoundError, ConnectionRefusedError, PermissionError among them
        sock.close()
        raise _unavailable(path, exc, peer) from exc
    except BaseException:
        sock.close()
        raise
    return sock


def _opening(conn: Connection, software: str, name: str, pipeline: Pipeline | None) -> bytes:
    """HELLO's bytes, and those of the pipelined request behind it (one write, one round trip)."""
    from wcache.proto.daemon_frames import Hello

    data = conn.send(Hello(versions=(PROTOCOL_VERSION,), software=software, name=name))
    return data + conn.send(pipeline(conn)) if pipeline is not None else data


def _timed(timings: dict[str, float] | None, t0: float, t1: float) -> None:
    """A connect's ``socket`` (``t0`` to ``t1``: connected, peer checked) and ``hello`` (to now) phases, in ms."""
    if timings is not None:
        timings.update(socket=(t1 - t0) * 1e3, hello=(time.perf_counter() - t1) * 1e3)


async def _handshake(ch: Channel[C], opening: bytes, meanwhile: Meanwhile | None, expected: Expected) -> Any:
    """Send the opening, run ``meanwhile`` while the peer answers, and return its first frame (``expected``: the
    ERROR, if that is what it is, raised as its class); the channel is closed on any failure."""
    try:
        await ch.send_bytes(opening)
        if meanwhile is not None:
            meanwhile()
        frame, _ = expected(*await ch.receive())
    except BaseException:
        ch.close()
        raise
    return frame


def _handshake_blocking(
    ch: Channel[C], opening: bytes, meanwhile: Meanwhile | None, expected: Expected, deadline: float
) -> Any:
    """``_handshake()`` without an event loop, every step before ``deadline`` (``time.monotonic``; TimeoutError)."""
    try:
        ch.send_bytes_blocking(opening, time_left(deadline))
        if meanwhile is not None:
            meanwhile()
        frame, _ = expected(*ch.receive_blocking(time_left(deadline)))
    except BaseException:
        ch.close()
        raise
    return frame


async def connect(
    path: Path,
    *,
    software: str,
    name: str,
    service: Service | None = None,
    pipeline: Pipeline | None = None,
    meanwhile: Meanwhile | None = None,
    timings: dict[str, float] | None = None,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    keep_decoded: bool = False,
    peer: str = "wcache daemon",
) -> tuple[Channel[Connection], daemon_frames.HelloOk]:
    """Connect to the wcache socket at ``path`` (a daemon or a keeper: ``service``, None for either),
    check that it runs as this user (or root), and shake hands. CacheUnavailableError when nothing
    answers there ("no ``peer`` at PATH": a caller that dials a keeper names it). ``pipeline``: a GET_STATE
    to send in the same write as HELLO, before HELLO_OK is back (its reply is the next frame after HELLO_OK);
    ``meanwhile``: called once that is written, before HELLO_OK is read (``Meanwhile``). ``max_frame_size``:
    the largest frame body taken from the peer. ``timings``: gets ``socket`` (connected, peer checked) and
    ``hello`` (HELLO out, HELLO_OK in, ``meanwhile`` included), in ms. ``keep_decoded``: the connection's (an
    engine's fetch keeps what it decodes)."""
    from wcache.proto.connection import Connection, Role
    from wcache.proto.daemon_frames import HelloOk

    t0 = time.perf_counter()
    sock = await dial(path, peer)
    t1 = time.perf_counter()
    conn = Connection(Role.CLIENT, service=service, max_frame_size=max_frame_size, keep_decoded=keep_decoded)
    ch = Channel(sock, conn)
    frame = await _handshake(ch, _opening(conn, software, name, pipeline), meanwhile, _expected)
    assert isinstance(frame, HelloOk)
    _timed(timings, t0, t1)
    return ch, frame


def connect_blocking(
    path: Path,
    *,
    software: str,
    name: str,
    timeout: float,
    service: Service | None = None,
    pipeline: Pipeline | None = None,
    meanwhile: Meanwhile | None = None,
    timings: dict[str, float] | None = None,
    keep_decoded: bool = False,
) -> tuple[Channel[Connection], daemon_frames.HelloOk]:
    """``connect()`` for callers without an event loop: connected and HELLO_OK in within ``timeout`` seconds of the
    call (TimeoutError otherwise); the channel's socket is left non-blocking, for either kind of caller."""
    from wcache.proto.connection import Connection, Role
    from wcache.proto.daemon_frames import HelloOk

    deadline = time.monotonic() + timeout
    t0 = time.perf_counter()
    sock = dial_blocking(path, timeout)
    t1 = time.perf_counter()
    conn = Connection(Role.CLIENT, service=service, keep_decoded=keep_decoded)
    ch = Channel(sock, conn)
    frame = _handshake_blocking(ch, _opening(conn, software, name, pipeline), meanwhile, _expected, deadline)
    assert isinstance(frame, HelloOk)
    _timed(timings, t0, t1)
    return ch, frame


async def connect_engine(
    path: Path,
    *,
    software: str,
    name: str,
    pipeline: EnginePipeline,
    meanwhile: Meanwhile | None = None,
    timings: dict[str, float] | None = None,
) -> tuple[Channel[EngineConnection], HelloOk]:
    """``connect()`` for an engine's fetch, through its own connection (``wcache.proto.engine``: the frames an
    engine speaks, without the declarations' import): HELLO and the GET_STATE ``pipeline`` builds in one write,
    ``meanwhile`` while the daemon answers, then HELLO_OK (``timings``: as connect's)."""
    t0 = time.perf_counter()
    sock = await dial(path)
    t1 = time.perf_counter()
    conn = EngineConnection()
    ch = Channel(sock, conn)
    frame = await _handshake(ch, conn.opening(software, name, pipeline(conn)), meanwhile, _expected_engine)
    assert isinstance(frame, HelloOk)
    _timed(timings, t0, t1)
    return ch, frame


def connect_engine_blocking(
    path: Path,
    *,
    software: str,
    name: str,
    timeout: float,
    pipeline: EnginePipeline,
    meanwhile: Meanwhile | None = None,
    timings: dict[str, float] | None = None,
) -> tuple[Channel[EngineConnection], HelloOk]:
    """``connect_engine()`` for callers without an event loop: connected, the opening out, ``meanwhile`` done and
    HELLO_OK in within ``timeout`` seconds of the call (TimeoutError otherwise)."""
    deadline = time.monotonic() + timeout
    t0 = time.perf_counter()
    sock = dial_blocking(path, timeout)
    t1 = time.perf_counter()
    conn = EngineConnection()
    ch = Channel(sock, conn)
    opening = conn.opening(software, name, pipeline(conn))
    frame = _handshake_blocking(ch, opening, meanwhile, _expected_engine, deadline)
    assert isinstance(frame, HelloOk)
    _timed(timings, t0, t1)
    return ch, frame


def expect_blocking(ch: Channel[Connection], timeout: float) -> tuple[Frame, list[int]]:
    """``expect()`` for callers without an event loop."""
    return _expected(*ch.receive_blocking(timeout))


async def expect(ch: Channel[Connection]) -> tuple[Frame, list[int]]:
    """The next frame (of a client's channel); an ERROR frame becomes its exception class."""
    return _expected(*await ch.receive())


def _expected(frame: Any, fds: list[int]) -> tuple[Frame, list[int]]:
    from wcache.proto.connection import Misdirected
    from wcache.proto.daemon_frames import ErrorFrame

    assert not isinstance(frame, Misdirected)  # only a server's connection yields those
    if isinstance(frame, ErrorFrame):
        close_fds(fds)
        from wcache.errors import error_from_frame

        raise error_from_frame(frame.code, frame.message, frame.details)
    out: Frame = frame
    return out, fds


def expect_engine_blocking(
    ch: Channel[EngineConnection], timeout: float
) -> tuple[HelloOk | State | Released, list[int]]:
    """``expect_engine()`` for callers without an event loop."""
    return _expected_engine(*ch.receive_blocking(timeout))


async def expect_engine(ch: Channel[EngineConnection]) -> tuple[HelloOk | State | Released, list[int]]:
    """The next frame of an engine's channel (HELLO_OK, STATE or RELEASED: its connection yields nothing else
    but an ERROR, which becomes its exception class)."""
    return _expected_engine(*await ch.receive())


def _expected_engine(frame: Received, fds: list[int]) -> tuple[HelloOk | State | Released, list[int]]:
    if isinstance(frame, (HelloOk, State, Released)):
        return frame, fds
    close_fds(fds)
    from wcache.errors import error_from_frame

    raise error_from_frame(frame.code, frame.message, frame.details)  # type: ignore[attr-defined]  # an ERROR
