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
    StrMap,
    fail,
    message,
    wire,
)
from wcache.proto.table import DTYPE_SIZES, MAX_DIMS, Aliases, Table, TensorTable

__all__ = [
    "BACKENDS",
    "MAX_DEPOSIT_BYTES",
    "MAX_DEPOSIT_TENSORS",
    "MAX_STATE_SLABS",
    "MAX_VERSIONS",
    "MODES",
    "RECIPE_FIELDS",
    "SLAB_KINDS",
    "TENSOR_KINDS",
    "Commit",
    "Deposit",
    "DepositSlab",
    "DepositTensor",
    "Deposited",
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
#: What a deposited tensor is to the module that holds it (docs/protocol.md §4.13).
TENSOR_KINDS = ("parameter", "buffer")
#: Tensors in one DEPOSIT (its frame is also capped at the 1 MiB request size, docs/protocol.md §7).
MAX_DEPOSIT_TENSORS = 1 << 16
#: Bytes one deposit may lay out (a sanity bound; the daemon's budget and memory are the real ones).
MAX_DEPOSIT_BYTES = 1 << 48
#: Key fields a DEPOSIT must name (a recipe key: the checkpoint's rank plus the engine's recipe), with types.
RECIPE_FIELDS: dict[str, type] = {
    "fingerprint": str,
    "architecture": str,
    "tp_size": int,
    "tp_rank": int,
    "dtype": str,
    "engine": str,
}
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
    #: where the bytes came from: "disk", "tier", "deposit" ... ("" unknown, left off the wire)
    origin: str = wire(Str(max_len=64), default="", omit_default=True)
    #: the checkpoint directory it was loaded from ("" unknown or a deposit without one; left off the wire)
    source: str = wire(Str(max_len=MAX_PATH), default="", omit_default=True)
    #: a keeper's entries only: the socket of the daemon it holds the model for ("" from a daemon)
    owner: str = wire(Str(max_len=MAX_PATH), default="", omit_default=True)


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
    #: names of tensors deposited as module buffers (the rest are parameters); left off the wire when none
    buffers: tuple[str, ...] = wire(Array(Str(), max_items=MAX_DEPOSIT_TENSORS), default=(), omit_default=True)

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


# --------------------------------------------------------------------------- write-back (§4.13)


@message()
class DepositTensor(Message):
    """One tensor an engine will write into a deposit slab: the daemon lays it out contiguously."""

    name: str = wire(Str())
    dtype: str = wire(Choice(tuple(DTYPE_SIZES)))
    shape: tuple[int, ...] = wire(Array(Int(hi=(1 << 48) - 1), max_items=MAX_DIMS))
    kind: str = wire(Choice(TENSOR_KINDS), default="parameter")

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@message("DEPOSIT")
class Deposit(Message):
    """Engine -> daemon: "I will write these tensors; publish them under the recipe ``key``"."""

    id: int = wire(_ID)
    key: KeyMap = wire(Key())
    tensors: tuple[DepositTensor, ...] = wire(Array(Nested(DepositTensor), min_items=1, max_items=MAX_DEPOSIT_TENSORS))
    aliases: dict[str, str] = wire(StrMap(), default_factory=dict)

    def _validate(self) -> None:
        for name, want in RECIPE_FIELDS.items():
            v = self.key.get(name)
            if type(v) is not want or v == "":
                raise fail("DEPOSIT", "key", f"a recipe key needs {name!r} ({want.__name__}, not empty)")
        # every check here is linear in the tensors: a DEPOSIT is decoded on the daemon's event loop (§7)
        known: set[str] = set()
        for tensor in self.tensors:
            if tensor.name in known:
                raise fail("DEPOSIT", "tensors", f"tensor {tensor.name[:64]!r} is listed twice")
            known.add(tensor.name)
        if "" in known:
            raise fail("DEPOSIT", "tensors", "a tensor name is empty")
        for a, t in self.aliases.items():
            if a in known or t not in known:
                raise fail("DEPOSIT", "aliases", f"alias {a[:64]!r} -> {t[:64]!r} is not a new name for a tensor")
        total = sum(t.nbytes for t in self.tensors)
        if total > MAX_DEPOSIT_BYTES:
            raise fail("DEPOSIT", "tensors", f"{total} bytes: a deposit lays out at most {MAX_DEPOSIT_BYTES}")


@message("DEPOSIT_SLAB")
class DepositSlab(Message):
    """Daemon -> engine: the deposit's writable slab (one descriptor) and where each tensor goes in it."""

    id: int = wire(_ID)
    deposit: int = wire(Int(lo=1))
    slabs: tuple[SlabDescriptor, ...] = wire(Array(Nested(SlabDescriptor), min_items=1, max_items=1))
    tensors: TensorTable = wire(Table("slabs"))
    aliases: dict[str, str] = wire(Aliases("tensors"), default_factory=dict)

    def _validate(self) -> None:
        fd_positions("DEPOSIT_SLAB", "slabs", [s.fd for s in self.slabs if s.fd >= 0], 1)

    @property
    def fd_count(self) -> int:
        return sum(1 for s in self.slabs if s.fd >= 0)


@message("COMMIT")
class Commit(Message):
    """Engine -> daemon: every tensor of ``deposit`` is written and the engine's mappings are gone."""

    id: int = wire(_ID)
    deposit: int = wire(Int(lo=1))


@message("DEPOSITED")
class Deposited(Message):
    """Daemon -> engine: the slab is sealed and served under ``key`` (``replaced``: an unleased model was)."""

    id: int = wire(_ID)
    deposit: int = wire(Int(lo=1))
    key: KeyMap = wire(Key())
    bytes: int = wire(Int())
    tensors: int = wire(Int())
    replaced: bool = wire(Bool(), default=False)
    evicted: tuple[KeyMap, ...] = wire(Array(Key()), default=())
