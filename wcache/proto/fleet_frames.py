"""Frames of the peer channel (docs/protocol.md §10): a target daemon filling a slab from a source daemon's over
NIXL asks, on an authenticated TCP connection, what the source holds for its key and where (PEER_QUERY ->
PEER_OFFER), paces its one-sided READs by the source's rate cap (PEER_READ -> PEER_READ_OK), ends the fill
(RELEASE -> RELEASED, the frames of §4.7) and, on a node without the checkpoint, fetches the checkpoint's small
files (PEER_FILES -> PEER_FILES_REPLY). In the shared-secret mode the connection first proves both ends hold
the secret (PEER_AUTH, PEER_CHALLENGE, PEER_PROOF, PEER_AUTH_OK). No tensor byte travels in these frames.
"""

from __future__ import annotations

from typing import Any

from wcache.errors import ProtocolError
from wcache.proto.fields import (
    Aliases,
    Array,
    Bin,
    Choice,
    Float,
    Frame,
    Int,
    Key,
    KeyMap,
    Message,
    Nested,
    Phase,
    Service,
    Str,
    Table,
    fail,
    message,
    wire,
)
from wcache.proto.limits import MAX_DEPOSIT_TENSORS
from wcache.proto.table import TensorTable

__all__ = [
    "MAX_AGENT_METADATA",
    "MAX_FILE_BYTES",
    "MAX_OFFERED",
    "MEMORY_KINDS",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "PeerAuth",
    "PeerAuthOk",
    "PeerBlock",
    "PeerChallenge",
    "PeerFile",
    "PeerFiles",
    "PeerFilesReply",
    "PeerModel",
    "PeerOffer",
    "PeerProof",
    "PeerQuery",
    "PeerRead",
    "PeerReadOk",
    "STUB_MARKER",
]

#: bytes of each side's random nonce and of an HMAC-SHA256 proof (docs/protocol.md §10.2)
NONCE_BYTES = 32
PROOF_BYTES = 32
#: NIXL's metadata for the offered regions and the connection (UCX over TCP: ~0.5 KB; RDMA devices add more)
MAX_AGENT_METADATA = 1 << 20
#: slabs one PEER_OFFER may offer (a TP=1 target filled from TP=8 peers' ranks takes 8 of one peer's)
MAX_OFFERED = 64
#: one small file of a checkpoint (tokenizer.json is ~9-17 MB); the reply frame's limit bounds them all
MAX_FILE_BYTES = 48 << 20
#: where an offered slab lives on the source (NIXL's DRAM and VRAM segments)
MEMORY_KINDS = ("host", "cuda")
_ID = Int(lo=1)


class _SlabTable(Table):
    """The tensor table of one offered slab whose size is the field ``size`` decoded before it."""

    __slots__ = ()

    def decode(self, frame: str, fld: str, v: Any, ctx: dict[str, Any]) -> TensorTable:
        if type(v) is not dict:
            raise fail(frame, fld, "expected a map")
        try:
            return TensorTable.from_wire(v, [ctx["size"]])
        except ProtocolError as exc:
            raise fail(frame, fld, exc.message) from None


def _exact(frame: str, fld: str, v: bytes, n: int) -> None:
    if len(v) != n:
        raise fail(frame, fld, f"expected exactly {n} bytes, got {len(v)}")


# --------------------------------------------------------------------------- shared-secret authentication (§10.2)


@message("PEER_AUTH", reply="PEER_CHALLENGE", service=Service.PEER, phase=Phase.AUTH)
class PeerAuth(Frame):
    """Target -> source, first request in the shared-secret mode: the target's nonce."""

    id: int = wire(_ID)
    nonce: bytes = wire(Bin(NONCE_BYTES))

    def _validate(self) -> None:
        _exact("PEER_AUTH", "nonce", self.nonce, NONCE_BYTES)


@message("PEER_CHALLENGE", phase=Phase.AUTH)
class PeerChallenge(Frame):
    """Source -> target: the source's nonce and its proof of the secret, bound to both nonces and the TLS
    certificate it presented."""

    id: int = wire(_ID)
    nonce: bytes = wire(Bin(NONCE_BYTES))
    proof: bytes = wire(Bin(PROOF_BYTES))

    def _validate(self) -> None:
        _exact("PEER_CHALLENGE", "nonce", self.nonce, NONCE_BYTES)
        _exact("PEER_CHALLENGE", "proof", self.proof, PROOF_BYTES)


@message("PEER_PROOF", reply="PEER_AUTH_OK", service=Service.PEER, phase=Phase.AUTH)
class PeerProof(Frame):
    """Target -> source: the target's proof of the secret (the source answers PEER_AUTH_OK or a fatal ERROR)."""

    id: int = wire(_ID)
    proof: bytes = wire(Bin(PROOF_BYTES))

    def _validate(self) -> None:
        _exact("PEER_PROOF", "proof", self.proof, PROOF_BYTES)


@message("PEER_AUTH_OK", moves={Phase.AUTH: Phase.OPEN})
class PeerAuthOk(Frame):
    """Source -> target: both ends hold the secret; requests may follow."""

    id: int = wire(_ID)


# --------------------------------------------------------------------------- fill (§10.3)


@message("PEER_QUERY", reply="PEER_OFFER", service=Service.PEER)
class PeerQuery(Frame):
    """Target -> source: what do you hold that fills ``key`` (the target's own key: its rank, or a recipe key)?"""

    id: int = wire(_ID)
    key: KeyMap = wire(Key())


@message()
class PeerModel(Message):
    """One slab a source offers, held for the target until RELEASE of ``lease`` or the connection's end."""

    lease: int = wire(Int(lo=1))
    key: KeyMap = wire(Key())  # the key the source serves it under (its own tp_rank / tp_size)
    size: int = wire(Int(lo=1))  # slab bytes
    memory: str = wire(Choice(MEMORY_KINDS))
    address: int = wire(Int(hi=2**64 - 1))  # where the slab starts in the source's NIXL registration
    tensors: TensorTable = wire(_SlabTable())
    aliases: dict[str, str] = wire(Aliases("tensors"), default_factory=dict)
    #: as STATE's (a filled model's are served in its STATE: more would make every engine's decoder refuse it)
    buffers: tuple[str, ...] = wire(Array(Str(), max_items=MAX_DEPOSIT_TENSORS), default=())
    payload: int = wire(Int(), default=0)
    device: int = wire(Int(hi=1 << 16), default=0)  # CUDA ordinal on the source (0 for host memory)
    register_seconds: float = wire(Float(), default=0.0)  # what registering it with NIXL cost the source

    def _validate(self) -> None:
        if self.address + self.size > 2**64:
            raise fail("PeerModel", "address", "the slab runs past the end of the address space")


@message("PEER_OFFER")
class PeerOffer(Frame):
    """Source -> target: the slabs that fill the query (the target plans which bytes to READ from which) and
    the NIXL metadata to READ them with — a capability, sent only after authentication (§10.1)."""

    id: int = wire(_ID)
    agent: bytes = wire(Bin(MAX_AGENT_METADATA))
    models: tuple[PeerModel, ...] = wire(Array(Nested(PeerModel), min_items=1, max_items=MAX_OFFERED))
    max_rate: int = wire(Int(), default=0)  # the source's --peer-max-rate, bytes/s (0: none)
    #: the source's --peer-max-fills: the most fills ``max_rate`` is shared by at once (0: not said); what a target
    #: needs to give its fill the time the cap may take (docs/fleet.md, "Bandwidth policy")
    max_fills: int = wire(Int(), default=0, omit_default=True)

    def _validate(self) -> None:
        leases = [m.lease for m in self.models]
        if len(set(leases)) != len(leases):
            raise fail("PEER_OFFER", "models", "a lease is offered twice")


@message("PEER_READ", reply="PEER_READ_OK", service=Service.PEER)
class PeerRead(Frame):
    """Target -> source: the target will READ ``bytes`` more of ``lease``'s slab (the source's rate cap answers)."""

    id: int = wire(_ID)
    lease: int = wire(Int(lo=1))
    bytes: int = wire(Int(lo=1))


@message("PEER_READ_OK")
class PeerReadOk(Frame):
    """Source -> target: go ahead with ``bytes`` (sent when the source's rate cap allows them)."""

    id: int = wire(_ID)
    lease: int = wire(Int(lo=1))
    bytes: int = wire(Int(lo=1))


# --------------------------------------------------------------------------- a node without the checkpoint (§10.4)


@message()
class PeerBlock(Message):
    """Bytes of a file at ``offset`` (the key's sampled fingerprint blocks of a safetensors file)."""

    offset: int = wire(Int())
    data: bytes = wire(Bin(4096))


#: the stub marker a target writes beside the files it received (wcache/peer_files.py): never a peer's file
STUB_MARKER = "wcache-peer-fill.json"


@message()
class PeerFile(Message):
    """One file of the checkpoint directory: ``data`` is its first bytes (all of a small file; a safetensors
    file's length prefix and header), ``size`` its length, ``blocks`` further bytes at offsets."""

    name: str = wire(Str(max_len=255))
    size: int = wire(Int())
    data: bytes = wire(Bin(MAX_FILE_BYTES))
    blocks: tuple[PeerBlock, ...] = wire(Array(Nested(PeerBlock), max_items=64), default=())

    def _validate(self) -> None:
        n = self.name
        if "/" in n or "\0" in n or n in ("", ".", "..") or n.startswith("."):
            raise fail("PeerFile", "name", f"{n[:64]!r} is not a plain file name")
        if n == STUB_MARKER:  # written over the target's own, it would unname the stubs: their zeros loaded
            raise fail("PeerFile", "name", f"{n!r} is the stub marker's name, which the target writes itself")
        if len(self.data) > self.size:
            raise fail("PeerFile", "data", "more bytes than the file's size")
        end = len(self.data)
        for b in sorted(self.blocks, key=lambda b: b.offset):
            if b.offset < end or b.offset + len(b.data) > self.size:
                raise fail("PeerFile", "blocks", "blocks must lie after data and each other, inside the file")
            end = b.offset + len(b.data)


@message("PEER_FILES", reply="PEER_FILES_REPLY", service=Service.PEER)
class PeerFiles(Frame):
    """Target -> source: the small files of the checkpoint ``key`` names (the target has no weights)."""

    id: int = wire(_ID)
    key: KeyMap = wire(Key())


@message("PEER_FILES_REPLY")
class PeerFilesReply(Frame):
    """Source -> target: the files of the checkpoint directory it loaded the key from."""

    id: int = wire(_ID)
    files: tuple[PeerFile, ...] = wire(Array(Nested(PeerFile), max_items=256))

    def _validate(self) -> None:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise fail("PEER_FILES_REPLY", "files", "a file is listed twice")
        if sum(len(f.data) for f in self.files) > MAX_FILE_BYTES:
            raise fail("PEER_FILES_REPLY", "files", f"more than {MAX_FILE_BYTES} bytes of files")
