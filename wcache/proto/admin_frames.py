"""The daemon's frames for operators and tools (docs/protocol.md §4.8, §4.9): STATUS (every service answers
it) and its reply's parts, PRELOAD and EVICT. Not on an engine's restart path (``daemon_frames``)."""

from __future__ import annotations

from wcache.proto.daemon_frames import BACKENDS, MODES, DeviceInfo
from wcache.proto.fields import (
    MAX_PATH,
    Array,
    Choice,
    Float,
    Frame,
    Int,
    Key,
    KeyMap,
    Message,
    Nested,
    Service,
    Str,
    fail,
    message,
    wire,
)

__all__ = ["LeaseInfo", "ModelInfo", "Preload", "Preloaded", "Evict", "Evicted", "Status", "StatusReply"]

_ID = Int(lo=1)  # a request id


@message()
class ModelInfo(Message):
    """One served model in a STATUS_REPLY."""

    key: KeyMap = wire(Key())
    backend: str = wire(Choice(BACKENDS))
    bytes: int = wire(Int())
    tensors: int = wire(Int())
    leases: int = wire(Int())
    load_seconds: float = wire(Float(), default=0.0)
    last_use: float = wire(Float(), default=0.0)  # unix time of the last GET_STATE, 0 if never
    #: where the bytes came from: "disk", "tier", "deposit" ... ("" unknown, left off the wire)
    origin: str = wire(Str(max_len=64), default="", omit_default=True)
    #: the checkpoint directory it was loaded from ("" unknown or a deposit without one; left off the wire)
    source: str = wire(Str(max_len=MAX_PATH), default="", omit_default=True)
    #: a keeper's entries only: the socket of the daemon it holds the model for ("" from a daemon)
    owner: str = wire(Str(max_len=MAX_PATH), default="", omit_default=True)
    #: a model this daemon filled from its host tier (origin "tier"): "pinned" (one DMA copy from the page-locked
    #: entry) or "staged" (the loader's reader threads, every block checked); "" otherwise, left off the wire
    tier_copy: str = wire(Str(max_len=64), default="", omit_default=True)


@message()
class LeaseInfo(Message):
    """One live lease in a STATUS_REPLY."""

    lease: int = wire(Int())
    mode: str = wire(Choice(MODES))
    pid: int = wire(Int(), missing=0)
    age_seconds: float = wire(Float(), missing=0.0)


@message("STATUS", reply="STATUS_REPLY", service=(Service.DAEMON, Service.KEEPER))
class Status(Frame):
    """Client -> daemon (or keeper): report what is served (operators)."""

    id: int = wire(_ID)


@message("STATUS_REPLY")
class StatusReply(Frame):
    """Daemon -> client: models, leases, connections, uptime."""

    id: int = wire(_ID)
    software: str = wire(Str(), missing="")
    backend: str = wire(Choice(BACKENDS))
    device: DeviceInfo = wire(Nested(DeviceInfo))
    uptime_seconds: float = wire(Float())
    connections: int = wire(Int())
    models: tuple[ModelInfo, ...] = wire(Array(Nested(ModelInfo)), default=())
    leases: tuple[LeaseInfo, ...] = wire(Array(Nested(LeaseInfo)), default=())
    device_free_bytes: int = wire(Int(), default=0)  # free memory of the daemon's GPU (0 for the host backend)
    device_total_bytes: int = wire(Int(), default=0)
    tier_bytes: int = wire(Int(), default=0)  # bytes in the host-memory tier (--host-tier), 0 when off
    tier_budget: int = wire(Int(), default=0)
    tier_entries: int = wire(Int(), default=0)
    #: host-tier entries page-locked in this daemon, which a refill copies in one DMA copy (left off while 0)
    tier_pinned: int = wire(Int(), default=0, omit_default=True)


@message("PRELOAD", reply="PRELOADED", service=Service.DAEMON)
class Preload(Frame):
    """Client -> daemon: load a checkpoint directory (on the daemon's machine) for one rank and keep it."""

    id: int = wire(_ID)
    model: str = wire(Str(max_len=MAX_PATH))
    tp_rank: int = wire(Int(hi=(1 << 16) - 1), default=0)
    tp_size: int = wire(Int(lo=1, hi=1 << 16), default=1)
    dtype: str = wire(Str(), default="auto")
    plan_file: str = wire(Str(max_len=MAX_PATH), default="")
    transform: str = wire(Str(), default="")

    def _validate(self) -> None:
        if self.tp_rank >= self.tp_size:
            raise fail("PRELOAD", "tp_rank", f"expected an integer in [0, {self.tp_size - 1}]")


@message("PRELOADED")
class Preloaded(Frame):
    """Daemon -> client: the model is resident (``load_seconds`` 0 if it already was)."""

    id: int = wire(_ID)
    key: KeyMap = wire(Key())
    bytes: int = wire(Int())
    tensors: int = wire(Int())
    load_seconds: float = wire(Float(), default=0.0)
    evicted: tuple[KeyMap, ...] = wire(Array(Key()), default=())


@message("EVICT", reply="EVICTED", service=Service.DAEMON)
class Evict(Frame):
    """Client -> daemon: drop the model served under ``key`` (refused while leases hold it)."""

    id: int = wire(_ID)
    key: KeyMap = wire(Key())


@message("EVICTED")
class Evicted(Frame):
    """Daemon -> client: the model is gone; ``bytes`` were freed."""

    id: int = wire(_ID)
    key: KeyMap = wire(Key())
    bytes: int = wire(Int())
