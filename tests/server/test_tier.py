"""The host-memory tier (--host-tier): reload on restart and after eviction, verification, budget."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import DaemonProc, run_cli
from wcache import WCacheClient, WeightCacheKey
from wcache.client import CachedWeights
from wcache.nn import load_from_disk


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
    (meta,) = tier.glob("*.meta")  # saved to the tier
    assert len(list(tier.glob("*.slab"))) == 1
    assert os.stat(tier).st_mode & 0o777 == 0o700 and meta.stat().st_mode & 0o777 == 0o600
    d2 = _restart(d, daemon_factory, ckpt, *_tier_args(tier))
    assert await _origins(d2) == ["tier"]
    assert await _identical(d2, ckpt)


async def test_corrupted_entry_is_rejected_and_the_checkpoint_loaded(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    d = daemon_factory(ckpt, *_tier_args(tier))
    (slab,) = tier.glob("*.slab")
    good = slab.read_bytes()
    data = bytearray(good)  # the first 4 KiB block is always among the sampled ones
    data[0] ^= 0xFF
    slab.write_bytes(bytes(data))
    d2 = _restart(d, daemon_factory, ckpt, *_tier_args(tier))
    assert await _origins(d2) == ["disk"]  # the entry was rejected: loaded from the checkpoint
    assert await _identical(d2, ckpt)
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
    r = await client.preload(ckpt)
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
    assert head.split()[:6] == ["SOCKET", "CHECKPOINT", "RANK", "ORIGIN", "SIZE", "TIER"]
    assert " host " in row and "never" in row
    assert "host tier 0.01 of 1.07 GB in 1 entries" in out.stdout


async def _wait_entries(tier: Path, n: int) -> None:
    """Wait (a state, with a deadline) until ``n`` complete entries exist: a deposit is saved in the background."""
    import asyncio
    import time

    deadline = time.monotonic() + 20
    while len(list(tier.glob("*.meta"))) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"{n} tier entries not written within 20 s: {sorted(tier.iterdir())}")
        await asyncio.sleep(0.02)


async def test_a_deposit_comes_back_from_the_tier_after_eviction_and_restart(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """Write-back and the host tier (issue 17): a committed deposit is saved to the tier; asked for again after
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
