"""The host-memory tier (--host-tier): reload on restart and after eviction, verification, budget."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import DaemonProc, run_cli
from wcache import WCacheClient, WeightCacheKey
from wcache.client import CachedWeights
from wcache.nn import load_from_disk
from wcache.plan.key import RankSpec


def _tier_args(tier: Path, budget: int = 1 << 30) -> tuple[str, ...]:
    return ("--host-tier", str(budget), "--host-tier-dir", str(tier))


async def _origins(d: DaemonProc) -> list[str]:
    """Where each served model's bytes came from (STATUS ``origin``: disk / tier / ...)."""
    return [m.origin for m in (await WCacheClient(d.socket).status()).models]


async def _identical(d: DaemonProc, ckpt: Path) -> bool:
    ref = load_from_disk(ckpt)
    async with await WCacheClient(d.socket).fetch(WeightCacheKey.from_checkpoint(ckpt)) as w:
        return all(torch.equal(w[k], v) for k, v in ref.items())


def _restart(d: DaemonProc, factory: Callable[..., DaemonProc], ckpt: Path, *extra: str) -> DaemonProc:
    d.stop()
    return factory(ckpt, *extra)


async def test_restart_reloads_from_the_tier(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    d = daemon_factory(ckpt, *_tier_args(tier))
    assert await _origins(d) == ["disk"]
    assert await _identical(d, ckpt)
    await _wait_entries(tier, 1)  # saved to the tier, in the background
    (meta,) = tier.glob("*.meta")
    assert len(list(tier.glob("*.slab"))) == 1
    assert os.stat(tier).st_mode & 0o777 == 0o700 and meta.stat().st_mode & 0o777 == 0o600
    d2 = _restart(d, daemon_factory, ckpt, *_tier_args(tier))
    st = await WCacheClient(d2.socket).status()
    # a host daemon pins no entry: the refill ran through the loader's threads, every block checked
    assert [(m.origin, m.tier_copy) for m in st.models] == [("tier", "staged")] and st.tier_pinned == 0
    assert await _identical(d2, ckpt)


async def test_corrupted_entry_is_rejected_and_the_checkpoint_loaded(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    d = daemon_factory(ckpt, *_tier_args(tier))
    await _wait_entries(tier, 1)  # the load's save runs in the background
    (slab,) = tier.glob("*.slab")
    good = slab.read_bytes()
    data = bytearray(good)  # the first 4 KiB block is always among the sampled ones
    data[0] ^= 0xFF
    slab.write_bytes(bytes(data))
    d2 = _restart(d, daemon_factory, ckpt, *_tier_args(tier))
    assert await _origins(d2) == ["disk"]  # the entry was rejected: loaded from the checkpoint
    assert await _identical(d2, ckpt)
    await _wait_entries(tier, 1)  # the bad entry was removed at start; the fresh one is saved in the background
    (fresh,) = tier.glob("*.slab")
    assert fresh.read_bytes() == good  # a fresh entry replaces the bad one


async def test_entry_for_another_checkpoint_is_not_used(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tied_ckpt: Path, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    daemon_factory(ckpt, *_tier_args(tier)).stop()
    d = daemon_factory(tied_ckpt, *_tier_args(tier))
    assert await _origins(d) == ["disk"]
    assert await _identical(d, tied_ckpt)
    assert len(list(tier.glob("*.meta"))) == 2


async def test_evicted_model_comes_back_from_the_tier(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    d = daemon_factory(ckpt, *_tier_args(tmp_path / "tier"))
    client = WCacheClient(d.socket)
    assert await _origins(d) == ["disk"]
    await client.evict(WeightCacheKey.from_checkpoint(ckpt))
    r = await client.preload(RankSpec(ckpt))
    assert r.load_seconds > 0
    assert await _origins(d) == ["tier"]
    assert await _identical(d, ckpt)


async def test_budget_smaller_than_the_model_skips_the_tier(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    d = daemon_factory(ckpt, *_tier_args(tier, budget=4096))
    assert not list(tier.glob("*.slab")) and not list(tier.glob("*.meta"))
    assert await _identical(d, ckpt)


def test_tier_dir_must_be_private(daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    tier.mkdir(mode=0o755)
    os.chmod(tier, 0o755)
    with pytest.raises(RuntimeError, match=r"host tier directory .* open to other users"):
        daemon_factory(ckpt, *_tier_args(tier))


def test_status_shows_tier_and_last_use(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path, socket_dir: Path
) -> None:
    daemon_factory(ckpt, *_tier_args(tmp_path / "tier"))
    out = run_cli("status", "--socket-dir", str(socket_dir))
    assert out.returncode == 0, out.stderr
    head, row = out.stdout.splitlines()[:2]
    assert head.split()[:7] == ["SOCKET", "CHECKPOINT", "FINGERPRINT", "RANK", "ORIGIN", "SIZE", "TIER"]
    assert " host " in row and "never" in row
    assert "host tier 0.01 of 1.07 GB in 1 entry" in out.stdout


def _complete_entries(tier: Path) -> int:
    """Entries whose save is done: a meta that is not a deposit's tombstone (tier.py; its slab is renamed first)."""
    from wcache.errors import WCacheError
    from wcache.server.tier import _unpack_meta

    n = 0
    for meta in tier.glob("*.meta"):
        try:
            n += not _unpack_meta(meta.read_bytes()).get("tombstone")
        except (OSError, WCacheError):
            continue
    return n


async def _wait_entries(tier: Path, n: int) -> None:
    """Wait (a state, with a deadline) until ``n`` complete entries exist: a deposit is saved in the background."""
    import asyncio
    import time

    deadline = time.monotonic() + 20
    while _complete_entries(tier) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"{n} tier entries not written within 20 s: {sorted(tier.iterdir())}")
        await asyncio.sleep(0.02)


async def test_a_deposit_comes_back_from_the_tier_after_eviction_and_restart(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """Write-back and the host tier (docs/protocol.md §4.13): a committed deposit is saved to the tier; asked for again after
    an EVICT, or after a restart without a keeper, it is served from the tier (origin "tier") under its recipe
    key, with its buffers and the engine's bytes; a recipe the tier lacks is still KEY_MISMATCH."""
    from tests.server.deposit_engine import recipe_key, tensors
    from wcache.errors import KeyMismatchError

    tier = tmp_path / "tier"
    d = daemon_factory(ckpt, *_tier_args(tier))
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    ts = tensors()
    client = WCacheClient(d.socket)
    await client.deposit(key, ts, kinds={"rotary.inv_freq": "buffer"})
    await _wait_entries(tier, 2)  # the checkpoint's entry and the deposit's

    def same(w: CachedWeights) -> bool:
        return all(
            torch.equal(w[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)) for n, t in ts.items()
        )

    await client.evict(key)
    async with await client.fetch(key) as w:
        assert same(w) and w.buffers == {"rotary.inv_freq"}
    st = {("engine" in m.key): m.origin for m in (await client.status()).models}
    assert st == {False: "disk", True: "tier"}

    d2 = _restart(d, daemon_factory, ckpt, *_tier_args(tier))
    async with await WCacheClient(d2.socket).fetch(key) as w:
        assert same(w) and w.buffers == {"rotary.inv_freq"}
    with pytest.raises(KeyMismatchError):
        await WCacheClient(d2.socket).fetch(recipe_key(WeightCacheKey.from_checkpoint(ckpt), postprocess="other"))


# ---------------------------------------------------------------- what the tier serves after a restart: only what was
# last committed or loaded, whatever the directory holds (docs/reliability.md, "Host tier"; docs/security.md)


def _entry_files(tier: Path, key: WeightCacheKey) -> tuple[Path, Path]:
    from wcache.server.tier import HostTier

    i = HostTier.entry_id(key)
    return tier / f"{i}.slab", tier / f"{i}.meta"


def _flip_unsampled_byte(slab: Path) -> None:
    """Flip one byte in the middle of the gap between sampled 4 KiB blocks 7 and 8 of the 16."""
    from wcache.plan.checkpoint import SAMPLE_BLOCK, _sample_offsets

    data = bytearray(slab.read_bytes())
    sampled = _sample_offsets(len(data))
    assert len(sampled) == 16 and sampled[8] - sampled[7] > 2 * SAMPLE_BLOCK
    data[(sampled[7] + SAMPLE_BLOCK + sampled[8]) // 2] ^= 0x01
    slab.write_bytes(bytes(data))


def _rewrite_table(meta: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``edit`` to the map holding the entry's tensor table, wherever the meta file nests it (a msgpack map,
    or one packed inside another as bytes), and keep every other field, its digests included."""
    import msgpack

    def visit(m: Any) -> bool:
        if not isinstance(m, dict):
            return False
        if "tensors" in m:
            edit(m)
            return True
        for k, v in m.items():
            if isinstance(v, bytes):
                try:
                    inner = msgpack.unpackb(v, raw=False)
                except Exception:
                    continue
                if visit(inner):
                    m[k] = msgpack.packb(inner, use_bin_type=True)
                    return True
        return False

    outer = msgpack.unpackb(meta.read_bytes(), raw=False)
    assert visit(outer)
    meta.write_bytes(msgpack.packb(outer, use_bin_type=True))


async def _absent(d: DaemonProc, key: WeightCacheKey) -> bool:
    from wcache.errors import KeyMismatchError, NotFoundError

    try:
        async with await WCacheClient(d.socket).fetch(key, timeout=15):
            return False
    except (KeyMismatchError, NotFoundError):
        return True


async def test_a_replaced_deposit_is_not_served_after_a_crash_before_the_replacements_save(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """v1 is deposited and saved to the tier; v2 replaces it (DEPOSITED) and is not saved (it exceeds --host-tier:
    the same state as a SIGKILL before its background save); the daemon is SIGKILLed. After the restart the key
    must not serve v1 (it did): the tier lost v1 when v2 was committed."""
    import signal

    from tests.server.deposit_engine import recipe_key

    tier = tmp_path / "tier"
    args = _tier_args(tier, budget=16 << 20)  # the checkpoint (10 MB) and v1 fit, v2 (32 MiB) does not
    d = daemon_factory(ckpt, *args)
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    client = WCacheClient(d.socket)
    v1 = {"w": torch.full((256, 1024), 1.0)}
    await client.deposit(key, v1)
    await _wait_entries(tier, 2)
    assert (await client.deposit(key, {"w": torch.full((8192, 1024), 2.0)})).replaced
    d.stop(signal.SIGKILL)
    d2 = daemon_factory(ckpt, *args)
    assert await _absent(d2, key)  # the engine post-processes again; never the replaced v1


async def test_a_stop_right_after_a_commit_waits_for_the_deposits_save(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """A deposit committed, the daemon stopped (SIGTERM) as soon as DEPOSITED is in: the restarted daemon restores
    it from the tier. The stop did not wait for the save, which runs after DEPOSITED (a 64 MB deposit: the process
    ended mid-copy), so the tier held nothing of it and the key was absent after the restart."""
    from tests.server.deposit_engine import recipe_key

    tier = tmp_path / "tier"
    d = daemon_factory(ckpt, *_tier_args(tier))
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    await WCacheClient(d.socket).deposit(key, {"w": torch.full((4096, 4096), 3.0)})
    assert d.stop() == 0
    d2 = daemon_factory(ckpt, *_tier_args(tier))
    async with await WCacheClient(d2.socket).fetch(key, mode="copy") as w:
        assert torch.equal(w["w"], torch.full((4096, 4096), 3.0))
    assert "tier" in await _origins(d2)


@pytest.mark.parametrize("entry", ["checkpoint", "deposit"])
async def test_a_byte_flipped_outside_the_sampled_blocks_is_never_served(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path, entry: str
) -> None:
    """One byte of an entry's slab file altered between runs, in none of the 16 sampled blocks: the checkpoint's
    entry must not be served (the checkpoint is loaded from disk instead), nor the deposit's (the key is absent
    until deposited again). Both were served as altered."""
    from tests.server.deposit_engine import recipe_key

    tier = tmp_path / "tier"
    d = daemon_factory(ckpt, *_tier_args(tier))
    key = WeightCacheKey.from_checkpoint(ckpt)
    if entry == "deposit":
        rkey = key = recipe_key(key)
        g = torch.Generator().manual_seed(3)
        await WCacheClient(d.socket).deposit(rkey, {"w": torch.randn(1024, 1024, generator=g)})
        await _wait_entries(tier, 2)
    d.stop()
    slab, _ = _entry_files(tier, key)
    _flip_unsampled_byte(slab)
    d2 = daemon_factory(ckpt, *_tier_args(tier))
    if entry == "deposit":
        assert await _absent(d2, key)
    else:
        assert await _origins(d2) == ["disk"]
        assert await _identical(d2, ckpt)


async def test_a_rewritten_tensor_table_is_not_served(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """A deposit entry's meta rewritten between runs, its digest kept: ``a.weight`` pointed at ``big.weight``'s
    offset. The entry must be refused (it was served: the digest did not cover the table)."""
    from tests.server.deposit_engine import recipe_key
    from wcache.proto import TensorTable
    from wcache.proto.table import TensorEntry

    tier = tmp_path / "tier"
    d = daemon_factory(ckpt, *_tier_args(tier))
    key = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    await WCacheClient(d.socket).deposit(key, {"a.weight": torch.zeros(16), "big.weight": torch.ones(4096)})
    await _wait_entries(tier, 2)
    d.stop()

    def point_a_at_big(m: dict[str, Any]) -> None:
        table = TensorTable.from_wire(m["tensors"], [int(m["size"])])
        big = next(e for e in table if e.name == "big.weight")
        m["tensors"] = TensorTable.from_entries(
            TensorEntry(e.name, e.dtype, e.shape, e.stride, e.slab, big.offset if e.name == "a.weight" else e.offset)
            for e in table
        ).to_wire()

    _rewrite_table(_entry_files(tier, key)[1], point_a_at_big)
    d2 = daemon_factory(ckpt, *_tier_args(tier))
    assert await _absent(d2, key)


async def test_a_slab_file_replaced_by_a_symlink_is_not_followed(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """The checkpoint entry's ``.slab`` replaced between runs by a symlink to a world-writable file outside the
    tier directory (the same bytes, so only the link itself is wrong): refused, the checkpoint loaded from disk,
    and the file it pointed at left as it was (it was followed and served)."""
    tier = tmp_path / "tier"
    d = daemon_factory(ckpt, *_tier_args(tier))
    d.stop()
    slab, _ = _entry_files(tier, WeightCacheKey.from_checkpoint(ckpt))
    outside = tmp_path / "outside.slab"
    outside.write_bytes(slab.read_bytes())
    os.chmod(outside, 0o666)
    slab.unlink()
    slab.symlink_to(outside)
    d2 = daemon_factory(ckpt, *_tier_args(tier))
    assert await _origins(d2) == ["disk"]
    assert await _identical(d2, ckpt)
    assert outside.exists() and outside.stat().st_mode & 0o777 == 0o666
    assert not slab.is_symlink()  # replaced by the daemon's fresh entry


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_meta_that_is_not_a_regular_file_never_stops_the_daemon(
    socket_dir: Path, ckpt: Path, tmp_path: Path, kind: str
) -> None:
    """The checkpoint entry's ``.meta`` replaced between runs by a directory (the daemon died at start with
    IsADirectoryError) or a FIFO (it never became ready): the daemon starts, loads from disk and serves."""
    import asyncio

    from wcache.server.process import spawn_daemon

    tier = tmp_path / "tier"
    spawn_daemon(ckpt, socket_dir, *_tier_args(tier), timeout=60).stop()
    _, meta = _entry_files(tier, WeightCacheKey.from_checkpoint(ckpt))
    meta.unlink()
    if kind == "directory":
        meta.mkdir()
    else:
        os.mkfifo(meta, 0o600)
    try:
        d = spawn_daemon(ckpt, socket_dir, *_tier_args(tier), timeout=30)
        try:
            assert asyncio.run(_origins(d)) == ["disk"]
            assert asyncio.run(_identical(d, ckpt))
        finally:
            d.stop()
    finally:
        if kind == "fifo" and meta.exists():
            os.close(os.open(meta, os.O_RDWR | os.O_NONBLOCK))  # lets a reader stuck in open() on it go


async def test_a_deposit_entry_whose_meta_is_a_fifo_is_absent_and_blocks_nothing(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """A deposit entry's ``.meta`` replaced between runs by a FIFO: GET_STATE of the recipe key answers (absent)
    and a PRELOAD afterwards works (both timed out: the restore blocked in open() holding the load lock)."""
    from tests.server.deposit_engine import recipe_key, tensors

    tier = tmp_path / "tier"
    d = daemon_factory(ckpt, *_tier_args(tier))
    base = WeightCacheKey.from_checkpoint(ckpt)
    key = recipe_key(base)
    await WCacheClient(d.socket).deposit(key, tensors())
    await _wait_entries(tier, 2)
    d.stop()
    _, meta = _entry_files(tier, key)
    meta.unlink()
    os.mkfifo(meta, 0o600)
    d2 = daemon_factory(ckpt, *_tier_args(tier))
    try:
        assert await _absent(d2, key)
        client = WCacheClient(d2.socket)
        await client.evict(base)
        await client.preload(RankSpec(ckpt), timeout=30)
        assert await _origins(d2) == ["tier"]
    finally:
        if meta.exists():
            os.close(os.open(meta, os.O_RDWR | os.O_NONBLOCK))
