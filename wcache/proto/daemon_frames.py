"""The frames a restarting engine speaks (docs/protocol.md §4.1-4.7, §4.12): the handshake, GET_STATE and
STATE with their parts, RELEASE and ERROR — every service's handshake and errors too. The daemon's other
requests are in ``admin_frames`` (STATUS, PRELOAD, EVICT) and ``deposit_frames`` (write-back), the frames
between wcache processes in ``peer_frames``: an engine's restart imports this module only (``frames`` loads the
others when a frame of theirs is first decoded or named).

Each class declares its fields once (``fields.py``): the declaration order is the wire order, the
kind holds type and limits, ``missing=`` is the decode default where it differs from the
constructor's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wcache.errors import WCacheError
from wcache.proto.fields import (
    Aliases,
    Array,
    Bin,
    Bool,
    Choice,
    Frame,
    Int,
    Key,
    KeyMap,
    Message,
    Nested,
    Phase,
    Plain,
    Role,
    Service,
    Str,
    Table,
    fail,
    message,
    wire,
)
from wcache.proto.limits import (
    BACKENDS,
    INT32_MAX,
    MAX_DEPOSIT_TENSORS,
    MAX_DEVICE_INDEX,
    MAX_FD_POSITION,
    MAX_FILE_NAME,
    MAX_FRAME_FDS,
    MAX_PROOF_FILES,
    MAX_STATE_SLABS,
    MAX_VERSIONS,
    MAX_WIRE_FRAME_SIZE,
    MODES,
    SLAB_KINDS,
)
from wcache.proto.table import TensorTable

if TYPE_CHECKING:
    from wcache.error_codes import ErrorCode

__all__ = [
    "BACKENDS",
    "MAX_DEPOSIT_TENSORS",
    "MAX_FRAME_FDS",
    "MAX_PROOF_FILES",
    "MAX_STATE_SLABS",
    "MAX_VERSIONS",
    "MODES",
    "SLAB_KINDS",
    "CheckpointProof",
    "DeviceInfo",
    "ErrorFrame",
    "FileStat",
    "GetState",
    "Hello",
    "HelloOk",
    "Release",
    "Released",
    "SlabDescriptor",
    "State",
    "fd_positions",
]

UINT64_MAX = 2**64 - 1
INT64_MIN = -(2**63)
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
    index: int = wire(Int(hi=MAX_DEVICE_INDEX), default=0)
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
    fd: int = wire(Int(lo=-1, hi=MAX_FD_POSITION), default=-1)
    handle: bytes = wire(Bin(), default=b"")
    offset: int = wire(Int(), default=0)
    device_uuid: str = wire(Str(), default="")


# --------------------------------------------------------------------------- handshake, STATUS, ERROR


@message("HELLO", sender=Role.CLIENT, moves={Phase.START: Phase.HELLO_SENT})
class Hello(Frame):
    """Client -> daemon, first frame: the protocol versions the client speaks."""

    versions: tuple[int, ...] = wire(Array(Int(lo=1, hi=INT32_MAX), min_items=1, max_items=MAX_VERSIONS))
    software: str = wire(Str(), default="")
    name: str = wire(Str(), default="")


@message("HELLO_OK", moves={Phase.HELLO_SENT: Phase.OPEN})
class HelloOk(Frame):
    """Daemon -> client: the chosen version and what the daemon serves from where."""

    version: int = wire(Int(lo=1, hi=INT32_MAX))
    software: str = wire(Str(), missing="")
    backend: str = wire(Choice(BACKENDS))
    device: DeviceInfo = wire(Nested(DeviceInfo))
    max_frame_size: int = wire(Int(lo=1, hi=MAX_WIRE_FRAME_SIZE))
    server_pid: int = wire(Int(), default=0)


@message("ERROR", phase=(Phase.OPEN, Phase.AUTH))
class ErrorFrame(Frame):
    """Either direction: a request failed (``id`` > 0) or the connection did (``id`` 0).

    ``fatal`` means the sender closes the connection right after this frame.
    """

    id: int = wire(Int(), missing=0)
    code: int = wire(Int(hi=INT32_MAX))
    message: str = wire(Str(max_len=65536), missing="")
    details: dict[str, Any] = wire(Plain(max_depth=8), default_factory=dict)
    fatal: bool = wire(Bool(), default=False)

    @classmethod
    def from_exception(cls, exc: WCacheError, id: int = 0, *, fatal: bool = False) -> ErrorFrame:
        return cls(id=id, code=int(exc.code), message=exc.message[:65536], details=exc.details, fatal=fatal)

    @property
    def error_code(self) -> ErrorCode | int:
        from wcache.error_codes import ErrorCode

        try:
            return ErrorCode(self.code)
        except ValueError:
            return self.code


# --------------------------------------------------------------------------- leases


@message()
class FileStat(Message):
    """One checkpoint file as ``stat`` (symlinks followed) saw it: the proof's unit (docs/protocol.md §4.3.1)."""

    name: str = wire(Str(max_len=MAX_FILE_NAME))
    dev: int = wire(Int(hi=UINT64_MAX))
    ino: int = wire(Int(hi=UINT64_MAX))
    size: int = wire(Int())
    mtime_ns: int = wire(Int(lo=INT64_MIN))
    ctime_ns: int = wire(Int(lo=INT64_MIN))


@message()
class CheckpointProof(Message):
    """Instead of the file-derived key fields: the identity of the checkpoint's files, and the dtype asked for
    (``"auto"`` or a dtype name, as PRELOAD's). The daemon completes the key from what it recorded when it
    read those very files (docs/protocol.md §4.3.1)."""

    files: tuple[FileStat, ...] = wire(Array(Nested(FileStat), min_items=1, max_items=MAX_PROOF_FILES))
    dtype: str = wire(Str(), default="auto")

    def _validate(self) -> None:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names) or "" in names:
            raise fail("CheckpointProof", "files", "file names must be non-empty and unique")


@message("GET_STATE", reply="STATE", service=Service.DAEMON, pipelined=True)
class GetState(Frame):
    """Client -> daemon: lease the weights served under ``key``; with ``proof``, ``key`` holds only the fields
    the checkpoint's files do not determine, and the daemon completes it (docs/protocol.md §4.3.1)."""

    id: int = wire(_ID)
    key: KeyMap = wire(Key())
    mode: str = wire(Choice(MODES), default="zero_copy")
    device_uuid: str = wire(Str(), default="")  # the client's GPU; "" = no check (host backend)
    proof: CheckpointProof | None = wire(Nested(CheckpointProof), default=None, omit_default=True)


@message("STATE")
class State(Frame):
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
        fd_positions("STATE", "slabs", [s.fd for s in self.slabs if s.fd >= 0], MAX_FRAME_FDS)

    @property
    def fd_count(self) -> int:
        """One descriptor per slab with ``fd >= 0``."""
        return sum(1 for s in self.slabs if s.fd >= 0)


@message("RELEASE", reply="RELEASED", service=(Service.DAEMON, Service.PEER))
class Release(Frame):
    """Client -> daemon: end a lease held by this connection."""

    id: int = wire(_ID)
    lease: int = wire(Int(lo=1))


@message("RELEASED")
class Released(Frame):
    """Daemon -> client: the lease is over; ``leases_left`` on that model, all clients."""

    id: int = wire(_ID)
    lease: int = wire(Int(lo=1))
    leases_left: int = wire(Int(), default=0)
