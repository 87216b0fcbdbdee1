"""A fetch proves the checkpoint's files instead of scanning them (docs/protocol.md §4.3.1), against a real daemon:
unchanged files are served without a header scan in the engine; a file changed in any way (content rewritten in
place, size, renamed, replaced by another file, touched) makes the daemon refuse the proof, the client scans and
retries with the full key on the same connection, and a changed checkpoint is never served under its old key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import DaemonProc
from tests.server.test_fetch import reference
from wcache import KeyMismatchError, WCacheClient, WeightCacheKey
from wcache.errors import KeyUnprovenError
from wcache.plan.key import RACY_NS, RankSpec
from wcache.proto.daemon_frames import CheckpointProof, FileStat
from wcache.proto.engine import FileId
from wcache.server.process import DaemonProcess
from wcache.synthetic import TINY, make_llama_checkpoint

COPIES = 14  # what the module's tests take (a parametrized test once per case); more are made when they run out


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], Path]:
    """Fresh copies of one two-shard checkpoint, made at once and then left alone for RACY_NS (a daemon records
    no file changed just before it reads it): one wait for each batch of COPIES, one copy per use."""
    root = tmp_path_factory.mktemp("proof")
    base = make_llama_checkpoint(root / "base", TINY, shards=2, seed=4)
    pool: list[Path] = []
    made = 0

    def batch() -> None:
        nonlocal made
        for _ in range(COPIES):
            shutil.copytree(base, root / f"c{made}")
            pool.append(root / f"c{made}")
            made += 1
        time.sleep(RACY_NS / 1e9 + 0.1)

    def take() -> Path:
        if not pool:
            batch()
        return pool.pop(0)

    batch()
    return take


def _shard(model: Path) -> Path:
    return sorted(model.glob("*.safetensors"))[0]


def _data_start(path: Path) -> int:
    raw = path.read_bytes()[:8]
    return 8 + int.from_bytes(raw, "little")


def _rewrite_in_place(model: Path) -> None:
    """New bytes in the first data block (sampled by every fingerprint), same size, mtime put back."""
    shard = _shard(model)
    st = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(_data_start(shard))
        old = f.read(64)
        f.seek(_data_start(shard))
        f.write(bytes(b ^ 0xFF for b in old))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def _grow(model: Path) -> None:
    with open(_shard(model), "ab") as f:
        f.write(bytes(4096))


def _rename(model: Path) -> None:
    """A shard under another name (the index follows): same bytes, another file set."""
    shard = _shard(model)
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    os.rename(shard, model / "renamed.safetensors")
    index["weight_map"] = {t: ("renamed.safetensors" if f == shard.name else f) for t, f in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))


def _replace(model: Path) -> None:
    """Another file of the same name, size and mtime (its first data block differs): os.replace over the shard."""
    shard = _shard(model)
    st = os.stat(shard)
    data = bytearray(shard.read_bytes())
    start = _data_start(shard)
    data[start : start + 64] = bytes(b ^ 0x55 for b in data[start : start + 64])
    tmp = model / "swap.tmp"
    tmp.write_bytes(bytes(data))
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, shard)


def _touch(model: Path) -> None:
    os.utime(_shard(model))


def _fetch(daemon: DaemonProc, key: WeightCacheKey) -> tuple[bool, dict[str, torch.Tensor]]:
    w = WCacheClient(daemon.socket).fetch_sync(key)
    try:
        return w.key_proven, {n: w[n].clone() for n in w}
    finally:
        w.release_sync()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) >= set(b) and all(torch.equal(a[n].view(torch.int16), t.view(torch.int16)) for n, t in b.items())


def test_unchanged_files_are_served_on_the_proof(
    daemon_factory: Callable[..., DaemonProc], copies: Callable[[], Path]
) -> None:
    model = copies()
    daemon = daemon_factory(model)
    key = WeightCacheKey.from_checkpoint(model)
    proven, tensors = _fetch(daemon, key)
    assert proven and not key.scanned  # the engine read no header
    assert key == WeightCacheKey.from_checkpoint(model).resolve()  # the daemon's fields are the scan's
    assert _same(tensors, reference(model))

    async def fetch() -> tuple[bool, bool]:
        k = WeightCacheKey.from_checkpoint(model)
        async with await WCacheClient(daemon.socket).fetch(k) as w:
            return w.key_proven, k.scanned

    assert asyncio.run(fetch()) == (True, False)


@pytest.mark.parametrize(
    "change", [_rewrite_in_place, _grow, _rename, _replace], ids=["rewritten", "size", "renamed", "replaced"]
)
def test_a_changed_shard_falls_back_to_the_scan_and_is_never_served_under_the_old_key(
    daemon_factory: Callable[..., DaemonProc], copies: Callable[[], Path], change: Callable[[Path], None]
) -> None:
    model = copies()
    daemon = daemon_factory(model)
    old = WeightCacheKey.from_checkpoint(model)
    assert _fetch(daemon, old)[0]  # recorded and proven before the change
    change(model)
    key = WeightCacheKey.from_checkpoint(model)
    with pytest.raises(KeyMismatchError):  # the daemon serves the old bytes only under the old key
        WCacheClient(daemon.socket).fetch_sync(key)
    assert key.scanned and key.fingerprint != old.fingerprint  # the scan ran, and found other files
    assert key == WeightCacheKey.from_checkpoint(model).resolve()


def test_a_touched_shard_is_scanned_and_served_under_the_same_key(
    daemon_factory: Callable[..., DaemonProc], copies: Callable[[], Path]
) -> None:
    """Same bytes, new ctime: the proof no longer matches, the scan finds the same key, and the retry on the same
    connection is served."""
    model = copies()
    daemon = daemon_factory(model)
    old = WeightCacheKey.from_checkpoint(model)
    assert _fetch(daemon, old)[0]
    _touch(model)
    key = WeightCacheKey.from_checkpoint(model)
    proven, tensors = _fetch(daemon, key)
    assert not proven and key.scanned and key == old
    assert _same(tensors, reference(model))


def _proven_by(daemon: DaemonProc, model: Path) -> bool:
    key = WeightCacheKey.from_checkpoint(model)
    proven, tensors = _fetch(daemon, key)
    assert key.scanned is not proven and _same(tensors, reference(model))
    return proven


def _settled(model: Path) -> None:
    """Wait until the daemon's second planning of ``model`` (RACY_NS after its newest change) has recorded it."""
    newest = max(os.stat(f).st_ctime_ns for f in model.iterdir())
    time.sleep(max(0.0, (newest + RACY_NS - time.time_ns()) / 1e9) + 0.05)


@contextlib.contextmanager
def _kept_fresh(model: Path) -> Iterator[None]:
    """``model``'s config.json touched every 0.2 s until the block ends: whatever the daemon plans meanwhile, and
    whenever (a loaded machine may take seconds to start one), reads a file changed less than RACY_NS before."""
    stop = threading.Event()

    def touch() -> None:
        while not stop.is_set():
            os.utime(model / "config.json")
            stop.wait(0.2)

    t = threading.Thread(target=touch)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def test_files_changed_just_before_a_preload_are_recorded_once_they_settle(
    daemon_factory: Callable[..., DaemonProc], copies: Callable[[], Path]
) -> None:
    """A PRELOAD records the files it reads, unless one changed within RACY_NS before (a later change within its
    timestamp tick would not show): then engines scan, until the daemon, planning the checkpoint again once the
    file has settled, records what a daemon started then would have."""
    daemon = daemon_factory(copies())
    settled, fresh = copies(), copies()
    client = WCacheClient(daemon.socket)
    asyncio.run(client.preload(RankSpec(settled)))
    with _kept_fresh(fresh):
        asyncio.run(client.preload(RankSpec(fresh)))
        assert {m: _proven_by(daemon, m) for m in (settled, fresh)} == {settled: True, fresh: False}
    _settled(fresh)
    assert _until_proven(daemon, fresh)


def _until_proven(daemon: DaemonProc, model: Path, wait: float = 30.0) -> bool:
    """Whether a fetch of ``model`` is proven within ``wait`` s (the daemon's planning runs in a worker thread)."""
    deadline = time.monotonic() + wait
    while not _proven_by(daemon, model):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_daemon_started_on_files_just_written_records_them_once_they_settle(
    daemon_factory: Callable[..., DaemonProc], copies: Callable[[], Path]
) -> None:
    """A node that writes a checkpoint (a download) and starts its daemon at once: the start-up's planning is
    within RACY_NS of the files' change, so engines scan at first; once the files have settled the daemon plans
    them again and engines prove them from then on. Before, they scanned for the daemon's whole life."""
    model = copies()
    with _kept_fresh(model):
        daemon = daemon_factory(model)
        assert not _proven_by(daemon, model)
    _settled(model)
    assert _until_proven(daemon, model)


def test_a_second_rank_of_one_checkpoint_is_completed_from_the_same_files(
    daemon_factory: Callable[..., DaemonProc], copies: Callable[[], Path]
) -> None:
    """tp_rank 1 of 2 (built-in Llama plan): the daemon completes ``plan`` and serves the rank's own model."""
    model = copies()
    daemon = daemon_factory(model, "--tp-rank", "1", "--tp-size", "2")
    key = WeightCacheKey.from_checkpoint(model, tp_rank=1, tp_size=2)
    proven, _ = _fetch(daemon, key)
    assert proven and not key.scanned and key.plan.startswith("builtin:")
    assert key == WeightCacheKey.from_checkpoint(model, tp_rank=1, tp_size=2).resolve()
    other = WeightCacheKey.from_checkpoint(model, tp_rank=0, tp_size=2)
    with pytest.raises(KeyMismatchError) as info:  # rank 0 is not served: the proof completes it, no model has it
        WCacheClient(daemon.socket).fetch_sync(other)
    assert info.value.details["key"] == other.to_wire()  # the completed key, named by the daemon
    assert not other.scanned and other.tp_rank == 0 and other.fingerprint == key.fingerprint


def test_the_store_completes_only_a_proof_of_files_it_read(copies: Callable[[], Path]) -> None:
    """In process: ``Store.completed`` fills the file-derived fields from the facts of exactly those files, and
    refuses (KEY_MISMATCH naming why) a proof of files it did not read; a plain GET_STATE passes as it is."""
    from wcache.plan.rank import plan_rank
    from wcache.proto import GetState
    from wcache.server.backends.host import HostBackend
    from wcache.server.store import Store

    model = copies()
    store = Store(HostBackend())
    with plan_rank(RankSpec(model)) as rp:
        assert rp.facts is not None
        store.remember_facts(rp.facts)
    key = WeightCacheKey.from_checkpoint(model)
    proof = key.proof()
    assert proof is not None
    req = GetState(id=1, key=proof[0], proof=_as_frame(proof))
    done = store.completed(req)
    assert done.key == WeightCacheKey.from_checkpoint(model).resolve().to_wire() and store.completed(done) == done
    plain = GetState(id=2, key=done.key)
    assert store.completed(plain) is plain
    _touch(model)
    moved = WeightCacheKey.from_checkpoint(model).proof()
    assert moved is not None
    with pytest.raises(KeyUnprovenError) as info:  # not a mismatch of the key: its own code (KEY_UNPROVEN)
        store.completed(GetState(id=3, key=moved[0], proof=_as_frame(moved)))
    assert "no checkpoint whose files" in info.value.details["proof"] and "key" not in info.value.details


def test_a_daemon_restarted_on_its_keeper_proves_the_files_it_checked(
    keeper: DaemonProcess, daemon_factory: Callable[..., DaemonProc], copies: Callable[[], Path]
) -> None:
    """A crashed daemon's successor reclaims the model from the keeper and checks it against the checkpoint (it
    plans it from the files): that planning's facts let engines prove the files at once, as before the crash."""
    model = copies()
    first = daemon_factory(model, "--keeper")
    assert _fetch(first, WeightCacheKey.from_checkpoint(model))[0]
    first.stop(signal.SIGKILL)
    second = daemon_factory(model, "--keeper")
    (served,) = asyncio.run(WCacheClient(second.socket).status()).models
    assert served.origin == "keeper"
    key = WeightCacheKey.from_checkpoint(model)
    proven, tensors = _fetch(second, key)
    assert proven and not key.scanned and _same(tensors, reference(model))


def _as_frame(proof: tuple[dict[str, str | int], tuple[FileId, ...], str]) -> CheckpointProof:
    """A key's proof (``WeightCacheKey.proof``) as GET_STATE's field declares it."""
    _, files, dtype = proof
    return CheckpointProof(files=tuple(FileStat(*f) for f in files), dtype=dtype)
