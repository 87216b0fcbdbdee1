"""Listening on a private Unix socket and accepting connections: shared by the daemon and the keeper."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

__all__ = ["accept_loop", "bind_private_socket"]

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
