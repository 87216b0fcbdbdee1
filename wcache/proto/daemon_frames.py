"""Frames of the daemon service (docs/protocol.md §4.1-4.9), and the handshake, STATUS and ERROR
frames every wcache service speaks.

Each class declares its fields once (``fields.py``): the declaration order is the wire order, the
kind holds type and limits, ``missing=`` is the decode default where it differs from the
constructor's.
"""

from __future__ import annotations

from typing import Any

from wcache.errors import ErrorCode, WCacheError
from wcache.proto.fields import (
    MAX_PATH,
    Array,
    Bin,
    Bool,
    Choice,
    Float,
    Int,
    Key,
    KeyMap,
    Message,
    Nested,
    Plain,
    Str,
    fail,
    message,
    wire,
)
from wcache.proto.table import Aliases, Table, TensorTable

__all__ = [
    "BACKENDS",
    "MAX_STATE_SLABS",
    "MAX_VERSIONS",
    "MODES",
    "SLAB_KINDS",
    "DeviceInfo",
    "ErrorFrame",
    "Evict",
    "Evicted",
    "GetState",
    "Hello",
    "HelloOk",
    "LeaseInfo",
    "ModelInfo",
    "Preload",
    "Preloaded",
    "Release",
    "Released",
    "SlabDescriptor",
    "State",
    "Status",
    "StatusReply",
    "fd_positions",
]

#: Where a daemon keeps slabs: host shared memory or GPU memory.
BACKENDS = ("host", "cuda")
MODES = ("zero_copy", "copy")
#: How a slab is exported: a shared-memory fd, a legacy CUDA IPC handle, or a CUDA VMM fd.
SLAB_KINDS = ("memfd", "cuda_ipc", "cuda_vmm")
MAX_VERSIONS = 16
MAX_STATE_SLABS = 1024
_ID = Int(lo=1)  # a request id


def fd_positions(frame: str, fld: str, fds: list[int], limit: int) -> None:
    """Descriptor positions must be 0..n-1, each once, n <= ``limit`` (docs/protocol.md §2.2)."""
    if len(fds) > limit or sorted(fds) != list(range(len(fds))):
        raise fail(frame, fld, f"fd positions must be 0..n-1, each once, n <= {limit}")


# --------------------------------------------------------------------------- parts of frames


@message()
class DeviceInfo(Message):
    """Where the daemon's slabs live. ``uuid`` identifies a GPU across CUDA_VISIBLE_DEVICES."""

    kind: str = wire(Choice(("cpu", "cuda")))
    index: int = wire(Int(hi=1 << 16), default=0)
    uuid: str = wire(Str(), default="")
    name: str = wire(Str(), default="")


@message()
class SlabDescriptor(Message):
    """One exported slab (docs/protocol.md §4.4).

    ``fd`` is the position of this slab's file descriptor among those passed with the
    frame via SCM_RIGHTS, or -1 when the slab travels as ``handle`` bytes.
    ``offset`` is where the slab starts inside the exported allocation.
    """

    size: int = wire(Int())
    kind: str = wire(Choice(SLAB_KINDS))
    fd: int = wire(Int(lo=-1, hi=253), default=-1)
    handle: bytes = wire(Bin(), default=b"")
    offset: int = wire(Int(), default=0)
    device_uuid: str = wire(Str(), default="")


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


@message()
class LeaseInfo(Message):
    """One live lease in a STATUS_REPLY."""

    lease: int = wire(Int())
    mode: str = wire(Choice(MODES))
    pid: int = wire(Int(), missing=0)
    age_seconds: float = wire(Float(), missing=0.0)


# --------------------------------------------------------------------------- handshake, STATUS, ERROR


@message("HELLO")
class Hello(Message):
    """Client -> daemon, first frame: the protocol versions the client speaks."""

    versions: tuple[int, ...] = wire(Array(Int(lo=1, hi=2**31 - 1), min_items=1, max_items=MAX_VERSIONS))
    software: str = wire(Str(), default="")
    name: str = wire(Str(), default="")


@message("HELLO_OK")
class HelloOk(Message):
    """Daemon -> client: the chosen version and what the daemon serves from where."""

    version: int = wire(Int(lo=1, hi=2**31 - 1))
    software: str = wire(Str(), missing="")
    backend: str = wire(Choice(BACKENDS))
    device: DeviceInfo = wire(Nested(DeviceInfo))
    max_frame_size: int = wire(Int(lo=1, hi=2**32 - 1))
    server_pid: int = wire(Int(), default=0)


@message("STATUS")
class Status(Message):
    """Client -> daemon (or keeper): report what is served (operators)."""

    id: int = wire(_ID)


@message("STATUS_REPLY")
class StatusReply(Message):
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


@message("ERROR")
class ErrorFrame(Message):
    """Either direction: a request failed (``id`` > 0) or the connection did (``id`` 0).

    ``fatal`` means the sender closes the connection right after this frame.
    """

    id: int = wire(Int(), missing=0)
    code: int = wire(Int(hi=2**31 - 1))
    message: str = wire(Str(max_len=65536), missing="")
    details: dict[str, Any] = wire(Plain(max_depth=8), default_factory=dict)
    fatal: bool = wire(Bool(), default=False)

    @classmethod
    def from_exception(cls, exc: WCacheError, id: int = 0, *, fatal: bool = False) -> ErrorFrame:
        return cls(id=id, code=int(exc.code), message=exc.message[:65536], details=exc.details, fatal=fatal)

    @property
    def error_code(self) -> ErrorCode | int:
        try:
            return ErrorCode(self.code)
        except ValueError:
            return self.code


# --------------------------------------------------------------------------- leases


@message("GET_STATE")
class GetState(Message):
    """Client -> daemon: lease the weights served under ``key``."""

    id: int = wire(_ID)
    key: KeyMap = wire(Key())
    mode: str = wire(Choice(MODES), default="zero_copy")
    device_uuid: str = wire(Str(), default="")  # the client's GPU; "" = no check (host backend)


@message("STATE")
class State(Message):
    """Daemon -> client: a lease and everything needed to map the weights."""

    id: int = wire(_ID)
    lease: int = wire(Int(lo=1))
    key: KeyMap = wire(Key())
    mode: str = wire(Choice(MODES))
    slabs: tuple[SlabDescriptor, ...] = wire(Array(Nested(SlabDescriptor), max_items=MAX_STATE_SLABS))
    tensors: TensorTable = wire(Table("slabs", preencoded=True))
    aliases: dict[str, str] = wire(Aliases("tensors"), default_factory=dict)

    def _validate(self) -> None:
        fd_positions("STATE", "slabs", [s.fd for s in self.slabs if s.fd >= 0], MAX_STATE_SLABS)

    @property
    def fd_count(self) -> int:
        """One descriptor per slab with ``fd >= 0``."""
        return sum(1 for s in self.slabs if s.fd >= 0)


@message("RELEASE")
class Release(Message):
    """Client -> daemon: end a lease held by this connection."""

    id: int = wire(_ID)
    lease: int = wire(Int(lo=1))


@message("RELEASED")
class Released(Message):
    """Daemon -> client: the lease is over; ``leases_left`` on that model, all clients."""

    id: int = wire(_ID)
    lease: int = wire(Int(lo=1))
    leases_left: int = wire(Int(), default=0)


# --------------------------------------------------------------------------- models


@message("PRELOAD")
class Preload(Message):
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
class Preloaded(Message):
    """Daemon -> client: the model is resident (``load_seconds`` 0 if it already was)."""

    id: int = wire(_ID)
    key: KeyMap = wire(Key())
    bytes: int = wire(Int())
    tensors: int = wire(Int())
    load_seconds: float = wire(Float(), default=0.0)
    evicted: tuple[KeyMap, ...] = wire(Array(Key()), default=())


@message("EVICT")
class Evict(Message):
    """Client -> daemon: drop the model served under ``key`` (refused while leases hold it)."""

    id: int = wire(_ID)
    key: KeyMap = wire(Key())


@message("EVICTED")
class Evicted(Message):
    """Daemon -> client: the model is gone; ``bytes`` were freed."""

    id: int = wire(_ID)
    key: KeyMap = wire(Key())
    bytes: int = wire(Int())
