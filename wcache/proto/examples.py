"""One example of each frame, as printed in docs/protocol.md §8 and pinned by golden-bytes
tests. ``python -m wcache.proto.examples`` prints their hex dumps."""

from __future__ import annotations

from dataclasses import replace

from wcache.proto.codec import pack_frame
from wcache.proto.frames import (
    CheckpointProof,
    Commit,
    Deposit,
    Deposited,
    DepositSlab,
    DepositTensor,
    DeviceInfo,
    ErrorFrame,
    Evict,
    Evicted,
    FileStat,
    Frame,
    GetState,
    HandedModel,
    Hello,
    HelloOk,
    Keep,
    Kept,
    LeaseInfo,
    ModelInfo,
    PeerAuth,
    PeerAuthOk,
    PeerBlock,
    PeerChallenge,
    PeerFile,
    PeerFiles,
    PeerFilesReply,
    PeerModel,
    PeerOffer,
    PeerProof,
    PeerQuery,
    PeerRead,
    PeerReadOk,
    Preload,
    Preloaded,
    Reclaim,
    Reclaimed,
    Release,
    Released,
    SlabDescriptor,
    State,
    Status,
    StatusReply,
    Takeover,
    TakeoverAdopted,
    TakeoverDone,
    TakeoverState,
    TensorEntry,
    TensorTable,
    Unkeep,
)

__all__ = ["EXAMPLES", "VARIANTS", "hexdump"]

#: a checkpoint key as a daemon serves it (§4.3): its nine fields in table order, today's layout, no transform
_KEY: dict[str, str | int] = {
    "fingerprint": "8f3a9c1d2b4e6f708192a3b4c5d6e7f8",
    "architecture": "LlamaForCausalLM",
    "tp_size": 2,
    "tp_rank": 0,
    "dtype": "bfloat16",
    "plan": "builtin:llama/1",
    "layout": 2,
    "fingerprint_kind": "sampled",
    "transform": "",
}

#: _KEY shortened as ERROR details and messages name a key (§4.3)
_SHORT = "LlamaForCausalLM@8f3a9c1d2b4e/tp0of2/bfloat16"

_HANDED = HandedModel(
    key=_KEY,
    slabs=(SlabDescriptor(size=768, kind="memfd", fd=0),),
    tensors=TensorTable.from_entries(
        [
            TensorEntry("model.embed_tokens.weight", "bfloat16", (4, 64), (64, 1), 0, 0),
            TensorEntry("model.norm.weight", "bfloat16", (64,), (1,), 0, 512),
        ]
    ),
    aliases={"lm_head.weight": "model.embed_tokens.weight"},
    payload=640,
    load_seconds=0.25,
    source="/models/llama3-8b",
)
_OWNER = "/run/user/1000/wcache/wcache-rank0.sock"
#: a recipe key (§4.13): the rank's key plus what the engine did to the weights, in the order a daemon serves it
#: (the checkpoint fields, then the recipe's by name)
_RECIPE: dict[str, str | int] = {
    **_KEY,
    "device_capability": "",
    "device_type": "cpu",
    "engine": "vllm",
    "engine_version": "0.11.0",
    "postprocess": 1,
    "quant_config": "3f2a9c1d",
    "quantization": "fp8",
}

_STATUS = StatusReply(
    id=3,
    software="wcache/0.1.0",
    backend="host",
    device=DeviceInfo(kind="cpu", index=0, uuid="", name="host shared memory"),
    uptime_seconds=12.5,
    connections=1,
    models=(
        ModelInfo(
            key=_KEY,
            backend="host",
            bytes=768,
            tensors=2,
            leases=1,
            load_seconds=0.25,
            last_use=1700000000.0,
            origin="disk",
            source="/models/llama3-8b",
        ),
    ),
    leases=(LeaseInfo(lease=1001, mode="zero_copy", pid=777, age_seconds=3.0),),
    tier_bytes=768,
    tier_budget=1073741824,
    tier_entries=1,
)

EXAMPLES: dict[str, Frame] = {
    "HELLO": Hello(versions=(2,), software="wcache/0.1.0", name="engine-0"),
    "HELLO_OK": HelloOk(
        version=2,
        software="wcache/0.1.0",
        backend="host",
        device=DeviceInfo(kind="cpu", index=0, uuid="", name="host shared memory"),
        max_frame_size=1048576,  # what a daemon takes from a client (§4.2, §7)
        server_pid=4242,
    ),
    "GET_STATE": GetState(id=1, key=_KEY, mode="zero_copy", device_uuid=""),
    "STATE": State(
        id=1,
        lease=1001,
        key=_KEY,
        mode="zero_copy",
        slabs=(SlabDescriptor(size=1280, kind="memfd", fd=0, handle=b"", offset=0, device_uuid=""),),
        tensors=TensorTable.from_entries(
            [
                TensorEntry("model.embed_tokens.weight", "bfloat16", (4, 64), (64, 1), 0, 0),
                TensorEntry("model.norm.weight", "bfloat16", (64,), (1,), 0, 512),
                TensorEntry("experts.0.w1", "bfloat16", (2, 32), (32, 1), 0, 768),
                TensorEntry("experts.1.w1", "bfloat16", (2, 32), (32, 1), 0, 1024),
            ]
        ),
        aliases={"lm_head.weight": "model.embed_tokens.weight"},
    ),
    "RELEASE": Release(id=2, lease=1001),
    "RELEASED": Released(id=2, lease=1001, leases_left=0),
    "STATUS": Status(id=3),
    "STATUS_REPLY": _STATUS,
    "PRELOAD": Preload(id=4, model="/models/llama3-8b", tp_rank=0, tp_size=2, dtype="auto", plan_file="", transform=""),
    "PRELOADED": Preloaded(id=4, key=_KEY, bytes=8032837632, tensors=291, load_seconds=4.5, evicted=()),
    "EVICT": Evict(id=5, key=_KEY),
    "EVICTED": Evicted(id=5, key=_KEY, bytes=8032837632),
    "TAKEOVER": Takeover(id=1, backend="host", device_uuid="", pid=4343),
    "TAKEOVER_STATE": TakeoverState(id=1, models=(_HANDED,), listener_fd=1, pid=4242),
    "TAKEOVER_ADOPTED": TakeoverAdopted(id=2, models=1, pid=4343),
    "TAKEOVER_DONE": TakeoverDone(id=2, pid=4242),
    "KEEP": Keep(id=2, owner=_OWNER, backend="host", device_uuid="", model=_HANDED, pid=4242),
    "KEPT": Kept(id=2, models=1, bytes=768),
    "UNKEEP": Unkeep(id=3, owner=_OWNER, key=_KEY),
    "RECLAIM": Reclaim(id=1, owner=_OWNER, backend="host", device_uuid="", pid=4343),
    "RECLAIMED": Reclaimed(id=1, models=(_HANDED,), dropped=0),
    "DEPOSIT": Deposit(
        id=6,
        key=_RECIPE,
        tensors=(
            DepositTensor("model.embed_tokens.weight", "bfloat16", (4, 64), "parameter"),
            DepositTensor("model.layers.0.mlp.weight_scale_inv", "float32", (1, 1), "parameter"),
            DepositTensor("model.rotary_emb.inv_freq", "float32", (32,), "buffer"),
        ),
        aliases={"lm_head.weight": "model.embed_tokens.weight"},
    ),
    "DEPOSIT_SLAB": DepositSlab(
        id=6,
        deposit=7001,
        slabs=(SlabDescriptor(size=1152, kind="memfd", fd=0),),
        tensors=TensorTable.from_entries(
            [
                TensorEntry("model.embed_tokens.weight", "bfloat16", (4, 64), (64, 1), 0, 0),
                TensorEntry("model.layers.0.mlp.weight_scale_inv", "float32", (1, 1), (1, 1), 0, 512),
                TensorEntry("model.rotary_emb.inv_freq", "float32", (32,), (1,), 0, 1024),
            ]
        ),
        aliases={"lm_head.weight": "model.embed_tokens.weight"},
    ),
    "COMMIT": Commit(id=7, deposit=7001),
    "DEPOSITED": Deposited(id=7, deposit=7001, key=_RECIPE, bytes=1152, tensors=3, replaced=False, evicted=()),
    "PEER_AUTH": PeerAuth(id=1, nonce=bytes(range(32))),
    "PEER_CHALLENGE": PeerChallenge(id=1, nonce=bytes(range(32, 64)), proof=bytes(range(64, 96))),
    "PEER_PROOF": PeerProof(id=2, proof=bytes(range(96, 128))),
    "PEER_AUTH_OK": PeerAuthOk(id=2),
    "PEER_QUERY": PeerQuery(id=3, key={**_KEY, "tp_size": 1, "tp_rank": 0, "plan": "none"}),
    "PEER_OFFER": PeerOffer(
        id=3,
        agent=b"nixl-agent-metadata",
        models=(
            PeerModel(
                lease=77,
                key=_KEY,
                size=768,
                memory="host",
                address=0x7F3A40000000,
                device=0,
                tensors=_HANDED.tensors,
                aliases={"lm_head.weight": "model.embed_tokens.weight"},
                payload=640,
                register_seconds=0.0006,
            ),
        ),
        max_rate=2_000_000_000,
        max_fills=4,
    ),
    "PEER_READ": PeerRead(id=4, lease=77, bytes=67108864),
    "PEER_READ_OK": PeerReadOk(id=4, lease=77, bytes=67108864),
    "PEER_FILES": PeerFiles(id=5, key=_KEY),
    "PEER_FILES_REPLY": PeerFilesReply(
        id=5,
        files=(
            PeerFile(name="config.json", size=2, data=b"{}"),
            PeerFile(
                name="model.safetensors",
                size=1048584,
                data=b'\x0c\x00\x00\x00\x00\x00\x00\x00{"t":{} }   ',
                blocks=(PeerBlock(offset=20, data=b"\x01\x02"),),
            ),
        ),
    ),
    # KEY_MISMATCH (§4.3) for a GET_STATE of _KEY asking float16, from a daemon serving _KEY alone
    "ERROR": ErrorFrame(
        id=1,
        code=21,
        message=f"requested key differs from the served {_SHORT}: dtype: requested float16, served bfloat16",
        details={"fields": {"dtype": ["bfloat16", "float16"]}, "served": [_SHORT], "closest": _SHORT},
        fatal=False,
    ),
}


#: More examples of frames whose optional fields change their shape, pinned the same way (docs/protocol.md §8).
VARIANTS: dict[str, Frame] = {
    # §4.3.1: the key without its file-derived fields, and the identity of the checkpoint's files
    "GET_STATE with a proof": GetState(
        id=1,
        key={"tp_size": 2, "tp_rank": 0, "layout": 2, "fingerprint_kind": "sampled", "transform": ""},
        mode="zero_copy",
        device_uuid="",
        proof=CheckpointProof(
            files=(
                FileStat("config.json", 2049, 1311001, 702, 1764600000123456789, 1764600000123456789),
                FileStat("model.safetensors", 2049, 1311002, 10486184, 1764600001987654321, 1764600001987654321),
            ),
            dtype="auto",
        ),
    ),
    # §4.8: a model filled from the host tier (how it was copied) and the tier's page-locked entries
    "STATUS_REPLY after a host-tier refill": replace(
        _STATUS,
        backend="cuda",
        device=DeviceInfo(kind="cuda", index=0, uuid="GPU-8f3a9c1d", name="NVIDIA H200"),
        connections=0,
        models=(replace(_STATUS.models[0], backend="cuda", leases=0, last_use=0.0, origin="tier", tier_copy="pinned"),),
        leases=(),
        device_free_bytes=142270300160,
        device_total_bytes=150754820096,
        tier_pinned=1,
    ),
}


def hexdump(data: bytes, width: int = 16) -> str:
    """``xxd``-style lines: offset, hex bytes, printable ASCII."""
    lines = []
    for i in range(0, len(data), width):
        chunk = data[i : i + width]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{i:08x}  {hexes:<{width * 3 - 1}}  {text}")
    return "\n".join(lines)


if __name__ == "__main__":
    for name, frame in {**EXAMPLES, **VARIANTS}.items():
        data = pack_frame(frame.to_wire())
        print(f"### {name} ({len(data)} bytes)\n```\n{hexdump(data)}\n```\n")
