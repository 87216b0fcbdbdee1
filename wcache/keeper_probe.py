"""How many models a wcache-keeper holds for a rank: one STATUS, bounded. Imports no torch, so the daemon's
start-up (which decides with it whether it will load) and the client's wait for a restarting daemon
(wcache/client/wait.py) share it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from wcache import __version__
from wcache.channel import connect
from wcache.proto import ModelInfo, Status, StatusReply

__all__ = ["KEEPER_PROBE_TIMEOUT", "keeper_kept"]

#: a keeper that does not answer within this holds nothing, as far as a caller waiting on it knows
KEEPER_PROBE_TIMEOUT = 0.5
#: owner names resolved at most per probe (a keeper holds models for 64 owners at most, docs/protocol.md §4.11)
MAX_RESOLVED = 64


async def keeper_kept(
    keeper_path: Path, rank: int | None, timeout: float = KEEPER_PROBE_TIMEOUT, owner: Path | None = None
) -> int:
    """How many models of ``rank`` (any rank if None) the keeper at ``keeper_path`` holds for the daemon of
    socket ``owner`` (entries kept for other sockets do not count; a keeper that names no owner, docs/protocol.md
    §4.11, is matched by rank alone); 0 when it is absent, refuses, or does not answer within ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            ch, _ = await connect(
                keeper_path, software=f"wcache/{__version__}", name="wcache keeper probe", peer="wcache-keeper"
            )
            try:
                await ch.send(Status(id=ch.conn.next_request_id()))
                frame, _ = await ch.receive()
            finally:
                ch.close()
    except Exception:  # absent, refused, silent, or breaking the protocol: not a keeper to count on
        return 0
    if not isinstance(frame, StatusReply):
        return 0
    mine = os.path.realpath(owner) if owner is not None else None  # the keeper's owners are real paths
    resolved: dict[str, bool] = {}

    def same_owner(name: str) -> bool:
        """Whether the keeper's ``name`` is ``mine``: the same string (a keeper records real paths), or another
        spelling of it (an older keeper's) — resolved only for a name of the same socket file, at most
        ``MAX_RESOLVED`` distinct ones, and anything that cannot be resolved (a NUL byte: ValueError) is not
        mine. What a keeper says costs the caller bounded work: a fetch waits on this within its timeout."""
        if name == mine:
            return True
        if name not in resolved:
            if mine is None or len(resolved) >= MAX_RESOLVED or os.path.basename(name) != os.path.basename(mine):
                return False
            try:
                resolved[name] = os.path.realpath(name) == mine
            except (OSError, ValueError):
                resolved[name] = False
        return resolved[name]

    def counts(m: ModelInfo) -> bool:
        if m.owner and mine is not None and not same_owner(m.owner):
            return False  # kept for another daemon
        return rank is None or m.key.get("tp_rank") == rank

    return sum(1 for m in frame.models if counts(m))
