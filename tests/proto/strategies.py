"""Hypothesis strategies producing valid frames of every type."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from wcache.proto import (
    BACKENDS,
    DTYPE_SIZES,
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
    TakeoverState,
    TensorEntry,
    TensorTable,
    Unkeep,
    tensor_extent,
)
from wcache.proto.fleet_frames import STUB_MARKER

text = st.text(max_size=40)
backends = st.sampled_from(BACKENDS)
ids = st.integers(1, 2**63 - 1)
uints = st.integers(0, 2**63 - 1)
floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
keys = st.dictionaries(
    st.text(max_size=20), st.one_of(st.text(max_size=40), st.integers(-(2**63), 2**63 - 1)), max_size=8
)
devices = st.builds(DeviceInfo, kind=st.sampled_from(["cpu", "cuda"]), index=st.integers(0, 16), uuid=text, name=text)
plain = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), floats, text, st.binary(max_size=16)),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


file_stats = st.builds(
    FileStat,
    name=st.text(min_size=1, max_size=40),
    dev=st.integers(0, 2**64 - 1),
    ino=st.integers(0, 2**64 - 1),
    size=uints,
    mtime_ns=st.integers(-(2**63), 2**63 - 1),
    ctime_ns=st.integers(-(2**63), 2**63 - 1),
)


def proofs() -> st.SearchStrategy[CheckpointProof]:
    """A GET_STATE proof: files with unique names (docs/protocol.md §4.3.1), a dtype request."""
    return st.builds(
        CheckpointProof,
        files=st.lists(file_stats, min_size=1, max_size=6, unique_by=lambda f: f.name).map(tuple),
        dtype=st.sampled_from(["auto", "bfloat16", "float16"]) | text,
    )


@st.composite
def tables(draw: st.DrawFn, slab_sizes: list[int]) -> TensorTable:
    """Random tensors, some in runs of equal shape at a constant spacing (groups on the wire)."""
    n = draw(st.integers(0, 12))
    names = draw(st.lists(st.text(min_size=1, max_size=30), min_size=n, max_size=n, unique=True))
    entries = []
    i = 0
    while i < len(names):
        dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
        size = DTYPE_SIZES[dtype]
        rank = draw(st.integers(0, 4))
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=rank, max_size=rank)))
        stride = tuple(draw(st.lists(st.integers(0, 40), min_size=rank, max_size=rank)))
        slab = draw(st.integers(0, len(slab_sizes) - 1))
        run = draw(st.integers(1, len(names) - i))
        step = size * draw(st.integers(1, 64))
        ext = tensor_extent(dtype, shape, stride)
        room = slab_sizes[slab] - ext - step * (run - 1)
        if room < 0:
            shape, stride, ext, run = (), (), size, 1
            room = slab_sizes[slab] - size
        offset = size * draw(st.integers(0, max(room, 0) // size))
        for j in range(run):
            entries.append(TensorEntry(names[i + j], dtype, shape, stride, slab, offset + j * step))
        i += run
    return TensorTable.from_entries(entries)


@st.composite
def states(draw: st.DrawFn) -> State:
    nslabs = draw(st.integers(1, 3))
    with_fd = draw(st.lists(st.booleans(), min_size=nslabs, max_size=nslabs))
    slabs, pos = [], 0
    for i in range(nslabs):
        fd = -1
        if with_fd[i]:
            fd, pos = pos, pos + 1
        slabs.append(
            SlabDescriptor(
                size=draw(st.integers(64, 4096)),
                kind=draw(st.sampled_from(["memfd", "cuda_ipc", "cuda_vmm"])),
                fd=fd,
                handle=draw(st.binary(max_size=64)),
                offset=draw(st.integers(0, 1 << 20)),
                device_uuid=draw(text),
            )
        )
    table = draw(tables([s.size for s in slabs]))
    aliases = {}
    if len(table):
        for a in draw(st.lists(st.text(min_size=1, max_size=10), max_size=3, unique=True)):
            if a not in table.names:
                aliases[a] = draw(st.sampled_from(table.names))
    return State(
        id=draw(ids),
        lease=draw(ids),
        key=draw(keys),
        mode=draw(st.sampled_from(["zero_copy", "copy"])),
        slabs=tuple(slabs),
        tensors=table,
        aliases=aliases,
        buffers=tuple(draw(st.lists(st.sampled_from(table.names), max_size=3))) if len(table) else (),
    )


recipe_keys = st.builds(
    lambda extra, **base: {**extra, **base},
    keys,
    fingerprint=st.text(min_size=1, max_size=40),
    architecture=st.text(min_size=1, max_size=20),
    tp_size=st.integers(1, 8),
    tp_rank=st.integers(0, 7),
    dtype=st.sampled_from(sorted(DTYPE_SIZES)),
    engine=st.text(min_size=1, max_size=20),
)


@st.composite
def deposits(draw: st.DrawFn) -> Deposit:
    names = draw(st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=6, unique=True))
    tensors = tuple(
        DepositTensor(
            n,
            draw(st.sampled_from(sorted(DTYPE_SIZES))),
            tuple(draw(st.lists(st.integers(0, 64), max_size=3))),
            draw(st.sampled_from(["parameter", "buffer"])),
        )
        for n in names
    )
    aliases = {a: draw(st.sampled_from(names)) for a in draw(st.lists(st.text(min_size=1, max_size=10), max_size=3))}
    aliases = {a: t for a, t in aliases.items() if a not in names}
    return Deposit(id=draw(ids), key=draw(recipe_keys), tensors=tensors, aliases=aliases)


@st.composite
def deposit_slabs(draw: st.DrawFn) -> DepositSlab:
    size = draw(st.integers(64, 4096))
    slab = SlabDescriptor(size=size, kind="memfd", fd=draw(st.sampled_from([0, -1])))
    table = draw(tables([size]))
    aliases = {}
    if len(table):
        for a in draw(st.lists(st.text(min_size=1, max_size=10), max_size=3, unique=True)):
            if a not in table.names:
                aliases[a] = draw(st.sampled_from(table.names))
    return DepositSlab(id=draw(ids), deposit=draw(ids), slabs=(slab,), tensors=table, aliases=aliases)


def _handed(draw: st.DrawFn, nfd: int, every_slab: bool) -> tuple[HandedModel, int]:
    """A model whose fd-carrying slabs take positions from ``nfd`` on (all of them if ``every_slab``)."""
    st_ = draw(states())
    slabs = []
    for s in st_.slabs:
        by_fd = every_slab or s.fd >= 0
        slabs.append(dataclasses.replace(s, fd=nfd if by_fd else -1))
        nfd += by_fd
    model = HandedModel(
        key=st_.key,
        slabs=tuple(slabs),
        tensors=st_.tensors,
        aliases=st_.aliases,
        payload=draw(uints),
        load_seconds=draw(floats),
        source=draw(text),
    )
    return model, nfd


def _handed_models(draw: st.DrawFn, *, every_slab: bool) -> tuple[tuple[HandedModel, ...], int]:
    """0..3 models whose fd-carrying slabs take positions 0..n-1; returns them and n."""
    models = []
    nfd = 0
    for _ in range(draw(st.integers(0, 3))):
        model, nfd = _handed(draw, nfd, every_slab)
        models.append(model)
    return tuple(models), nfd


@st.composite
def takeover_states(draw: st.DrawFn) -> TakeoverState:
    """Models whose slabs may travel as fds; the listener takes the last fd position."""
    models, nfd = _handed_models(draw, every_slab=False)
    return TakeoverState(id=draw(ids), models=models, listener_fd=nfd, pid=draw(st.integers(0, 2**31)))


@st.composite
def keeps(draw: st.DrawFn) -> Keep:
    model, _ = _handed(draw, 0, every_slab=True)
    return Keep(
        id=draw(ids), owner=draw(text), backend=draw(backends), device_uuid=draw(text), model=model, pid=draw(uints)
    )


@st.composite
def reclaimeds(draw: st.DrawFn) -> Reclaimed:
    models, _ = _handed_models(draw, every_slab=True)
    return Reclaimed(id=draw(ids), models=models, dropped=draw(uints))


@st.composite
def peer_offers(draw: st.DrawFn) -> PeerOffer:
    """1..3 offered slabs with distinct leases, each a table inside its size."""
    leases = draw(st.lists(st.integers(1, 2**63 - 1), min_size=1, max_size=3, unique=True))
    models = []
    for lease in leases:
        size = draw(st.integers(64, 4096))
        table = draw(tables([size]))
        aliases = {}
        if len(table):
            for a in draw(st.lists(st.text(min_size=1, max_size=10), max_size=2, unique=True)):
                if a not in table.names:
                    aliases[a] = draw(st.sampled_from(table.names))
        models.append(
            PeerModel(
                lease=lease,
                key=draw(keys),
                size=size,
                memory=draw(st.sampled_from(["host", "cuda"])),
                address=draw(st.integers(0, 2**64 - 1 - size)),
                tensors=table,
                aliases=aliases,
                buffers=tuple(draw(st.lists(text, max_size=2))),
                payload=draw(uints),
                device=draw(st.integers(0, 16)),
                register_seconds=draw(floats),
            )
        )
    return PeerOffer(
        id=draw(ids),
        agent=draw(st.binary(max_size=64)),
        models=tuple(models),
        max_rate=draw(uints),
        max_fills=draw(uints),
    )


@st.composite
def peer_files(draw: st.DrawFn) -> PeerFilesReply:
    names = draw(
        st.lists(
            st.text(min_size=1, max_size=20).filter(
                lambda n: "/" not in n and "\0" not in n and n[0] != "." and n != STUB_MARKER
            ),
            max_size=3,
            unique=True,
        )
    )
    files = []
    for n in names:
        data = draw(st.binary(max_size=64))
        size = len(data) + draw(st.integers(0, 1 << 20))
        blocks, at = [], len(data)
        for _ in range(draw(st.integers(0, 3))):
            off = at + draw(st.integers(0, 64))
            b = draw(st.binary(max_size=16))
            if off + len(b) > size:
                break
            blocks.append(PeerBlock(offset=off, data=b))
            at = off + len(b)
        files.append(PeerFile(name=n, size=size, data=data, blocks=tuple(blocks)))
    return PeerFilesReply(id=draw(ids), files=tuple(files))


nonce = st.binary(min_size=32, max_size=32)
peer_frames = st.one_of(
    st.builds(PeerAuth, id=ids, nonce=nonce),
    st.builds(PeerChallenge, id=ids, nonce=nonce, proof=nonce),
    st.builds(PeerProof, id=ids, proof=nonce),
    st.builds(PeerAuthOk, id=ids),
    st.builds(PeerQuery, id=ids, key=keys),
    peer_offers(),
    st.builds(PeerRead, id=ids, lease=ids, bytes=ids),
    st.builds(PeerReadOk, id=ids, lease=ids, bytes=ids),
    st.builds(PeerFiles, id=ids, key=keys),
    peer_files(),
)

frames = st.one_of(
    peer_frames,
    st.builds(
        Hello,
        versions=st.lists(st.integers(1, 2**31 - 1), min_size=1, max_size=16).map(tuple),
        software=text,
        name=text,
    ),
    st.builds(
        HelloOk,
        version=st.integers(1, 2**31 - 1),
        software=text,
        backend=backends,
        device=devices,
        max_frame_size=st.integers(1, 2**32 - 1),
        server_pid=st.integers(0, 2**31),
    ),
    st.builds(
        GetState,
        id=ids,
        key=keys,
        mode=st.sampled_from(["zero_copy", "copy"]),
        device_uuid=text,
        proof=st.none() | proofs(),
    ),
    states(),
    st.builds(Release, id=ids, lease=st.integers(1, 2**63 - 1)),
    st.builds(Released, id=ids, lease=st.integers(1, 2**63 - 1), leases_left=uints),
    st.builds(Status, id=ids),
    st.builds(
        StatusReply,
        id=ids,
        software=text,
        backend=backends,
        device=devices,
        uptime_seconds=floats,
        connections=uints,
        models=st.lists(
            st.builds(
                ModelInfo,
                key=keys,
                backend=backends,
                bytes=uints,
                tensors=uints,
                leases=uints,
                load_seconds=floats,
                last_use=floats,
                origin=st.sampled_from(["", "disk", "tier", "deposit"]),
            ),
            max_size=3,
        ).map(tuple),
        leases=st.lists(
            st.builds(
                LeaseInfo, lease=uints, mode=st.sampled_from(["zero_copy", "copy"]), pid=uints, age_seconds=floats
            ),
            max_size=3,
        ).map(tuple),
        device_free_bytes=uints,
        device_total_bytes=uints,
        tier_bytes=uints,
        tier_budget=uints,
        tier_entries=uints,
    ),
    st.builds(
        Preload,
        id=ids,
        model=text,
        tp_rank=st.just(0),
        tp_size=st.integers(1, 8),
        dtype=text,
        plan_file=text,
        transform=text,
    ),
    st.builds(
        Preloaded,
        id=ids,
        key=keys,
        bytes=uints,
        tensors=uints,
        load_seconds=floats,
        evicted=st.lists(keys, max_size=3).map(tuple),
    ),
    st.builds(Evict, id=ids, key=keys),
    st.builds(Evicted, id=ids, key=keys, bytes=uints),
    st.builds(Takeover, id=ids, backend=backends, device_uuid=text, pid=st.integers(0, 2**31)),
    takeover_states(),
    keeps(),
    st.builds(Kept, id=ids, models=uints, bytes=uints),
    st.builds(Unkeep, id=ids, owner=text, key=keys),
    st.builds(Reclaim, id=ids, owner=text, backend=backends, device_uuid=text, pid=uints),
    reclaimeds(),
    deposits(),
    deposit_slabs(),
    st.builds(Commit, id=ids, deposit=ids),
    st.builds(
        Deposited,
        id=ids,
        deposit=ids,
        key=keys,
        bytes=uints,
        tensors=uints,
        replaced=st.booleans(),
        evicted=st.lists(keys, max_size=2).map(tuple),
    ),
    st.builds(
        ErrorFrame,
        id=uints,
        code=st.integers(0, 2**31 - 1),
        message=text,
        details=st.dictionaries(st.text(max_size=8), plain, max_size=4),
        fatal=st.booleans(),
    ),
)
