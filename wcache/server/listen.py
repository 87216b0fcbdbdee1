"""Listening on a private Unix socket, accepting connections, and who gives way at the connection cap: the
server shell's (wcache/server/service.py) parts that know nothing of a handler.

``ConnectionTable`` is the admission policy at the connection cap (docs/security.md, "idle peers"): a new
connection is refused only when no live one may be closed to make room for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ConnectionTable", "Peer", "accept_loop", "bind_private_socket"]

log = logging.getLogger("wcache.server")


def bind_private_socket(path: Path) -> socket.socket:
    """Listen on ``path`` (a non-blocking socket, mode 0600 from birth). Only the holder of the
    path's DaemonLock may call this: a leftover socket file is then stale and is replaced."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)  # the socket is born 0600: no window where others may connect
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(512)
    sock.setblocking(False)
    return sock


async def accept_loop(listener: socket.socket, accepted: Callable[[socket.socket], None], tag: str) -> None:
    """Accept connections on ``listener`` forever (until cancelled), handing each to ``accepted``."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            sock, _ = await loop.sock_accept(listener)
        except OSError as exc:  # EMFILE and friends: back off instead of spinning
            log.warning("accept failed %s error=%s", tag, exc)
            await asyncio.sleep(0.1)
            continue
        accepted(sock)
        # let the new connection's handler take its first step (its peer check, a HELLO already sent) before the
        # next accept: a backlog of waiting connections is otherwise admitted in one go, before any of them is
        # known, and the give-way policy would choose among strangers
        await asyncio.sleep(0)


@dataclass(eq=False)
class Peer:
    """One live connection, as the admission policy sees it."""

    id: int
    task: asyncio.Task[None] | None = None
    accepted: float = field(default_factory=time.monotonic)
    #: when the peer last sent a frame or was last answered (time.monotonic)
    active: float = field(default_factory=time.monotonic)
    #: False until the handshake is done (the peer said nothing yet that shows it is an engine)
    open: bool = False
    #: a request of it is being answered
    busy: bool = False
    #: set when the table closed it to make room (its handler then says so, if it can)
    evicted: bool = False

    def touch(self) -> None:
        self.active = time.monotonic()


class ConnectionTable:
    """Live connections and who gives way at the cap.

    At ``limit`` live connections, a new one makes room by closing, in this order: the oldest connection
    that has not finished its handshake (it has shown nothing; a real engine says HELLO at once), else the
    connection idle longest that is open, answering nothing and holding nothing. ``pinned`` names the
    connections never closed for room, whatever their phase: a daemon's lease holders (the leases live with
    the connection), a keeper's daemons (wcache/server/service.py, ``Handler.protects``). Only when every
    connection is pinned, busy or newer is the new one refused. Choosing is a scan, made only at the cap.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the connection limit must be at least 1")
        self.limit = limit
        self.peers: dict[int, Peer] = {}

    def __len__(self) -> int:
        return len(self.peers)

    def add(self, peer: Peer) -> None:
        self.peers[peer.id] = peer

    def remove(self, conn_id: int) -> None:
        self.peers.pop(conn_id, None)

    def victim(self, pinned: Callable[[int], bool]) -> Peer | None:
        """The connection to close for a new one (None: refuse the new one)."""
        live = [p for p in self.peers.values() if not p.evicted]
        fresh = [p for p in live if not p.open and not pinned(p.id)]
        if fresh:
            return min(fresh, key=lambda p: p.accepted)
        idle = [p for p in live if p.open and not p.busy and not pinned(p.id)]
        return min(idle, key=lambda p: p.active) if idle else None

    def make_room(self, pinned: Callable[[int], bool]) -> Peer | bool | None:
        """Below the cap: True. At it: the peer evicted (its task cancelled), or None (refuse)."""
        if sum(not p.evicted for p in self.peers.values()) < self.limit:
            return True
        peer = self.victim(pinned)
        if peer is not None:
            peer.evicted = True
            if peer.task is not None:
                peer.task.cancel()
        return peer
