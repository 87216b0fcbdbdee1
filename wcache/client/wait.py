"""Waiting for a daemon that is coming back (client policy, docs/protocol.md §9; no wire change).

When a daemon's socket is missing or refuses connections, the client asks whether a daemon is
evidently on its way before it gives up:

- the daemon's one-daemon lock ``<socket>.lock`` (``flock``, taken early in ``wcache-server``'s start)
  is held by a live process: read from ``/proc/locks``, matched by device and inode. This is a
  read-only check: trying the lock ourselves, even with ``LOCK_NB`` and for a moment, could make a
  daemon that starts in that moment fail its own ``LOCK_EX | LOCK_NB`` ("another wcache-server already
  serves"); and the pid written in the file outlives a SIGKILLed daemon (only a clean stop removes it)
  and may be reused, so it is not trusted either. A lock is held only while an open file description
  holds it, so a holder listed there is alive (locks go when the last descriptor closes, before a
  process becomes a zombie).
- a keeper (``wcache-keeper.sock`` beside the socket, or the one the caller names) reports a kept model
  for that socket in its STATUS_REPLY: a daemon started with ``--keeper`` that crashed left it
  there and gets it back when it restarts. The keeper's STATUS names each entry's owner, the daemon's
  socket (§4.11): kept models count for the socket they were kept for. A keeper that names no owners
  (older versions) is matched by the ``tp_rank`` of the key asked for (one daemon per rank in a socket
  directory; without a key, any kept model counts). A keeper that is absent, refuses, or does
  not answer within ``wcache.keeper_probe.KEEPER_PROBE_TIMEOUT`` means "nothing kept".

When neither holds, the first error is raised at once. Otherwise the client retries the connection
with a backoff (10 ms doubling to 100 ms) until the caller's deadline, checking every
``RECHECK_SECONDS`` that something is still coming (a starting daemon that exits stops the wait).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from wcache.errors import CacheUnavailableError
from wcache.keeper_probe import keeper_kept
from wcache.locks import lock_holder

__all__ = ["daemon_coming", "is_absent", "keeper_kept", "wait_for_daemon"]

log = logging.getLogger("wcache.client")

T = TypeVar("T")

#: Backoff between connection attempts while waiting: first, factor, most.
BACKOFF = (0.01, 2.0, 0.1)
#: How often a wait checks again that a daemon is still coming.
RECHECK_SECONDS = 0.5


def is_absent(exc: CacheUnavailableError) -> bool:
    """True when ``exc`` is a connect that found no socket file or a socket nobody listens on."""
    return isinstance(exc.__cause__, (FileNotFoundError, ConnectionRefusedError))


async def daemon_coming(socket_path: Path, keeper_path: Path, rank: int | None) -> str | None:
    """Why a daemon is evidently coming to ``socket_path``, in words, or None when nothing is."""
    holder = lock_holder(socket_path)
    if holder is not None:
        who = f"pid {holder}" if holder else "a process not visible here"
        return f"its lock {socket_path}.lock is held by {who}"
    kept = await keeper_kept(keeper_path, rank, owner=socket_path)
    if kept:
        return f"the keeper at {keeper_path} holds {kept} model{'s' if kept > 1 else ''} for it"
    return None


async def wait_for_daemon(
    attempt: Callable[[], Awaitable[T]],
    socket_path: Path,
    first: CacheUnavailableError,
    *,
    wait: float,
    keeper_path: Path,
    rank: int | None,
    on_wait: Callable[[str], None] | None = None,
) -> T:
    """``attempt()`` (a connect) again until it succeeds, while a daemon is coming and for at most ``wait``
    seconds; ``first``: the failure that brought us here, raised at once when nothing is coming.
    ``on_wait(reason)`` is told when the wait starts (so an outer deadline can name it)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    reason = await daemon_coming(socket_path, keeper_path, rank)
    if reason is None:
        raise first
    if on_wait is not None:
        on_wait(reason)
    log.info("waiting up to %.1f s for the wcache daemon at %s: %s", wait, socket_path, reason)
    deadline = started + wait
    delay, factor, most = BACKOFF
    last = first
    attempts = 1
    next_check = started + RECHECK_SECONDS
    while True:
        now = loop.time()
        if now >= deadline:
            raise CacheUnavailableError(
                f"no wcache daemon at {socket_path}: waited {now - started:.1f} s (wait_for_daemon={wait:g} s) "
                f"for it to come back because {reason}, {attempts} connection attempts; last: {last.message}. "
                "Start it (or check its log), or pass wait_for_daemon=0 to fail at once",
                details={"socket": str(socket_path), "waited_s": round(now - started, 3), "reason": reason},
            ) from last
        await asyncio.sleep(min(delay, deadline - now))
        delay = min(delay * factor, most)
        attempts += 1
        try:
            result = await attempt()
        except CacheUnavailableError as exc:
            if not is_absent(exc):
                raise
            last = exc
        else:
            log.info(
                "wcache daemon at %s is back after %.3f s (%d attempts)", socket_path, loop.time() - started, attempts
            )
            return result
        if loop.time() >= next_check:
            next_check = loop.time() + RECHECK_SECONDS
            now_reason = await daemon_coming(socket_path, keeper_path, rank)
            if now_reason is None:
                raise CacheUnavailableError(
                    f"no wcache daemon at {socket_path}: stopped waiting after {loop.time() - started:.1f} s "
                    f"(wait_for_daemon={wait:g} s), nothing is coming any more (at first {reason}); "
                    f"last: {last.message}. Start it, or check its log",
                    details={"socket": str(socket_path), "waited_s": round(loop.time() - started, 3), "reason": reason},
                ) from last
            reason = now_reason
