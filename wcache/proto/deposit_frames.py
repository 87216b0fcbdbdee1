"""Write-back (docs/protocol.md §4.13): an engine deposits the tensors it runs, the daemon lays out a writable
slab (DEPOSIT_SLAB), the engine writes and COMMITs, the daemon publishes (DEPOSITED). Not on an engine's
restart path (``daemon_frames``)."""

from __future__ import annotations

from wcache.proto.daemon_frames import MAX_DEPOSIT_TENSORS, SlabDescriptor, fd_positions
from wcache.proto.fields import (
    Aliases,
    Array,
    Bool,
    Choice,
    Frame,
    Int,
    Key,
    KeyMap,
    Message,
    Nested,
    Service,
    Str,
    StrMap,
    Table,
    fail,
    message,
    wire,
)
from wcache.proto.table import DTYPE_SIZES, MAX_DIMS, TensorTable

__all__ = [
    "MAX_DEPOSIT_BYTES",
    "RECIPE_FIELDS",
    "TENSOR_KINDS",
    "Commit",
    "Deposit",
    "DepositSlab",
    "DepositTensor",
    "Deposited",
]

#: What a deposited tensor is to the module that holds it (docs/protocol.md §4.13).
TENSOR_KINDS = ("parameter", "buffer")
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


@message("DEPOSIT", reply="DEPOSIT_SLAB", service=Service.DAEMON)
class Deposit(Frame):
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
class DepositSlab(Frame):
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


@message("COMMIT", reply="DEPOSITED", service=Service.DAEMON)
class Commit(Frame):
    """Engine -> daemon: every tensor of ``deposit`` is written and the engine's mappings are gone."""

    id: int = wire(_ID)
    deposit: int = wire(Int(lo=1))


@message("DEPOSITED")
class Deposited(Frame):
    """Daemon -> engine: the slab is sealed and served under ``key`` (``replaced``: an unleased model was)."""

    id: int = wire(_ID)
    deposit: int = wire(Int(lo=1))
    key: KeyMap = wire(Key())
    bytes: int = wire(Int())
    tensors: int = wire(Int())
    replaced: bool = wire(Bool(), default=False)
    evicted: tuple[KeyMap, ...] = wire(Array(Key()), default=())
