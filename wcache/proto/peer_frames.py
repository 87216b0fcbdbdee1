"""Frames between wcache processes (docs/protocol.md §4.10, §4.11): a daemon taking over from a running
one (TAKEOVER, TAKEOVER_ADOPTED), and a daemon depositing its models with a keeper (KEEP, UNKEEP, RECLAIM).

All of them move models as :class:`HandedModel` with their slabs' file descriptors.
"""

from __future__ import annotations

from collections.abc import Sequence

from wcache.proto.codec import DEFAULT_MAX_FRAME_SIZE, MAX_REPRESENTABLE
from wcache.proto.daemon_frames import BACKENDS, MAX_FRAME_FDS, SlabDescriptor, fd_positions
from wcache.proto.fields import (
    MAX_PATH,
    Aliases,
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
    Table,
    message,
    wire,
)
from wcache.proto.table import TensorTable

__all__ = [
    "MAX_HANDOFF_FDS",
    "MAX_KEPT_FDS",
    "HandedModel",
    "Keep",
    "Kept",
    "Reclaim",
    "Reclaimed",
    "Takeover",
    "TakeoverAdopted",
    "TakeoverDone",
    "TakeoverState",
    "Unkeep",
]

#: File descriptors one TAKEOVER_STATE may carry (slabs + the listening socket): one frame's (MAX_FRAME_FDS).
MAX_HANDOFF_FDS = MAX_FRAME_FDS
#: Slabs one KEEP or RECLAIMED may carry: one frame's descriptors (MAX_FRAME_FDS).
MAX_KEPT_FDS = MAX_FRAME_FDS
_ID = Int(lo=1)


@message()
class HandedModel(Message):
    """One model in a TAKEOVER_STATE, KEEP or RECLAIMED: everything a daemon needs to serve it."""

    key: KeyMap = wire(Key())
    slabs: tuple[SlabDescriptor, ...] = wire(Array(Nested(SlabDescriptor), min_items=1, max_items=MAX_HANDOFF_FDS))
    tensors: TensorTable = wire(Table("slabs"))
    aliases: dict[str, str] = wire(Aliases("tensors"), default_factory=dict)
    payload: int = wire(Int(), default=0)
    load_seconds: float = wire(Float(), default=0.0)
    source: str = wire(Str(max_len=MAX_PATH), default="")  # the checkpoint directory it was loaded from ("" unknown)
    #: where the bytes first came from ("disk", "tier", "deposit"; "" unknown), as STATUS shows it
    origin: str = wire(Str(max_len=64), default="", omit_default=True)
    #: names deposited as module buffers (STATE's ``buffers``, docs/protocol.md §4.13)
    buffers: tuple[str, ...] = wire(Array(Str()), default=(), omit_default=True)
    #: a deposit's generation (given at its COMMIT; "" a checkpoint's model, or unknown): a daemon reclaiming a
    #: kept deposit serves it only if its host tier records no other generation of the key (docs/protocol.md §4.11)
    generation: str = wire(Str(max_len=64), default="", omit_default=True)


def _kept_fds(frame: str, models: Sequence[HandedModel]) -> int:
    """Every kept slab travels as an fd (a CUDA IPC handle cannot outlive its process): positions 0..n-1."""
    fds = [s.fd for x in models for s in x.slabs]
    fd_positions(frame, "models", fds, MAX_KEPT_FDS)
    return len(fds)


@message("TAKEOVER", reply="TAKEOVER_STATE", service=Service.DAEMON)
class Takeover(Frame):
    """New daemon -> running daemon: hand over your models and your listening socket, then exit."""

    id: int = wire(_ID)
    backend: str = wire(Choice(BACKENDS))  # the new daemon's: must be the running one's
    device_uuid: str = wire(Str(), default="")  # the new daemon's GPU: must be the running one's
    pid: int = wire(Int(), default=0)
    #: the largest TAKEOVER_STATE body the new daemon accepts: a larger hand-off is refused before anything changes
    max_frame_size: int = wire(Int(lo=1, hi=MAX_REPRESENTABLE), default=DEFAULT_MAX_FRAME_SIZE, omit_default=True)


@message("TAKEOVER_STATE")
class TakeoverState(Frame):
    """Running daemon -> new daemon: its models (slabs travel as fds) and its listening socket (an fd)."""

    id: int = wire(_ID)
    models: tuple[HandedModel, ...] = wire(Array(Nested(HandedModel)))
    listener_fd: int = wire(Int(hi=MAX_HANDOFF_FDS - 1))
    pid: int = wire(Int(), default=0)
    #: the socket path of the keeper the running daemon keeps these models with ("" none): the new daemon must
    #: keep them with the same one (a daemon that took them over without it could not free them there)
    keeper: str = wire(Str(max_len=MAX_PATH), default="", omit_default=True)

    def _validate(self) -> None:
        slabs = [s.fd for x in self.models for s in x.slabs if s.fd >= 0]
        # the field named is the one past the bound: the models' slabs alone, else the socket beside them
        where = "models" if len(slabs) >= MAX_HANDOFF_FDS else "listener_fd"
        fd_positions("TAKEOVER_STATE", where, [*slabs, self.listener_fd], MAX_HANDOFF_FDS)

    @property
    def fd_count(self) -> int:
        """The slabs with ``fd >= 0`` and the listening socket."""
        return 1 + sum(1 for x in self.models for s in x.slabs if s.fd >= 0)


@message("TAKEOVER_ADOPTED", reply="TAKEOVER_DONE", service=Service.DAEMON)
class TakeoverAdopted(Frame):
    """New daemon -> running daemon, after TAKEOVER_STATE: every model is adopted; release your lock and stop.
    Until it arrives the running daemon serves on (a new daemon that fails closes the connection instead)."""

    id: int = wire(_ID)
    models: int = wire(Int())  # how many models the new daemon adopted: all of TAKEOVER_STATE's
    pid: int = wire(Int(), default=0)


@message("TAKEOVER_DONE")
class TakeoverDone(Frame):
    """Running daemon -> new daemon: its lock is released and it stops; the socket and models are yours."""

    id: int = wire(_ID)
    pid: int = wire(Int(), default=0)


@message("KEEP", reply="KEPT", service=Service.KEEPER)
class Keep(Frame):
    """Daemon -> keeper: hold this model's slabs (they travel as fds) for the daemon serving ``owner``."""

    id: int = wire(_ID)
    owner: str = wire(Str(max_len=MAX_PATH))  # the depositing daemon's socket path: who may RECLAIM it
    backend: str = wire(Choice(BACKENDS))
    device_uuid: str = wire(Str(), missing="")
    model: HandedModel = wire(Nested(HandedModel))
    pid: int = wire(Int(), default=0)

    def _validate(self) -> None:
        _kept_fds("KEEP", [self.model])

    @property
    def fd_count(self) -> int:
        """One descriptor per slab."""
        return len(self.model.slabs)


@message("UNKEEP", reply="KEPT", service=Service.KEEPER)
class Unkeep(Frame):
    """Daemon -> keeper: stop holding the model ``key`` of ``owner`` (evicted: its memory is freed)."""

    id: int = wire(_ID)
    owner: str = wire(Str(max_len=MAX_PATH))
    key: KeyMap = wire(Key())


@message("KEPT")
class Kept(Frame):
    """Keeper -> daemon: the answer to KEEP and UNKEEP: what it now holds for ``owner``."""

    id: int = wire(_ID)
    models: int = wire(Int())
    bytes: int = wire(Int())


@message("RECLAIM", reply="RECLAIMED", service=Service.KEEPER)
class Reclaim(Frame):
    """Daemon -> keeper, at start: the models kept for ``owner`` on this backend and device."""

    id: int = wire(_ID)
    owner: str = wire(Str(max_len=MAX_PATH))
    backend: str = wire(Choice(BACKENDS))
    device_uuid: str = wire(Str(), default="")
    pid: int = wire(Int(), default=0)


@message("RECLAIMED")
class Reclaimed(Frame):
    """Keeper -> daemon: the kept models (their slabs travel as fds; the keeper keeps holding them)
    and how many entries of ``owner`` it dropped because they were on another backend or device."""

    id: int = wire(_ID)
    models: tuple[HandedModel, ...] = wire(Array(Nested(HandedModel)), default=())
    dropped: int = wire(Int(), default=0)

    def _validate(self) -> None:
        _kept_fds("RECLAIMED", self.models)

    @property
    def fd_count(self) -> int:
        """One descriptor per slab."""
        return sum(len(x.slabs) for x in self.models)
