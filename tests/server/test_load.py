"""The load pipeline's record of how a slab was filled (server/load.py): a host-tier refill says which of its two
copy paths ran, in its load stats and in STATUS (``tier_copy``), and the tier says which entries are page-locked
(``tier_pinned``) — the state an operator and a test read, where once only a log line said it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from wcache.plan.key import RankSpec
from wcache.server.backends.base import PinnedFile
from wcache.server.backends.host import HostBackend, HostSlab
from wcache.server.load import load_from_tier, load_model
from wcache.server.store import Store
from wcache.server.tier import HostTier


class _PinnedBytes:
    """A stand-in for a page-locked tier file (``CudaBackend.pinner``): the file's bytes, read when pinned."""

    def __init__(self, path: Path, size: int) -> None:
        self.inode = os.stat(path).st_ino
        with open(path, "rb") as f:
            self.data = f.read(size)

    def close(self) -> None:
        self.data = b""


class _OneCopySlab(HostSlab):
    """A host slab that can be filled from a pinned file in one copy, as a CUDA slab is."""

    def copy_pinned(self, pinned: PinnedFile) -> bool:
        if not isinstance(pinned, _PinnedBytes):
            return False
        os.pwrite(self.fd, pinned.data[: self.size], 0)
        return True


class _OneCopyBackend(HostBackend):
    def allocate(self, nbytes: int) -> HostSlab:
        return _OneCopySlab(nbytes, staging_bytes=self.staging_bytes)


def _pinned_within(tier: HostTier, n: int, deadline_s: float = 30.0) -> int:
    deadline = time.monotonic() + deadline_s
    while tier.pinned() < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return tier.pinned()


def test_a_refill_says_which_copy_path_ran(ckpt: Path, tmp_path: Path) -> None:
    """Saved by a daemon whose backend pins (the entry is page-locked in the background, ``tier_pinned`` 1), the
    entry refills a slab in one copy (``pinned``); a backend that cannot copy from it, or a tier that pins nothing,
    refills through the loader's threads (``staged``). A model loaded from disk has no tier copy."""
    backend = _OneCopyBackend()
    tier = HostTier(tmp_path / "tier", 1 << 30, pin=_PinnedBytes)
    try:
        disk = load_model(RankSpec(ckpt), backend=backend, threads=2, tier=tier)  # saved to the tier, then pinned
        key = disk.key
        want = disk.slabs[0].read(0, disk.slab_bytes)
        assert disk.stats.tier_copy == ""
        assert _pinned_within(tier, 1) == 1
        for slab_backend, path in ((backend, "pinned"), (HostBackend(), "staged")):
            entry = tier.lookup(key)
            assert entry is not None and entry.pinned is not None
            model = load_from_tier(tier, entry, key, slab_backend, 2, None)
            assert model is not None
            try:
                assert model.stats.tier_copy == path and model.origin == "tier"
                assert model.slabs[0].read(0, model.slab_bytes) == want
                (info,) = Store(slab_backend, [model]).model_infos()
                assert (info.origin, info.tier_copy) == ("tier", path)
            finally:
                model.close()
        disk.close()
    finally:
        tier.close()
    assert tier.pinned() == 0  # closing the tier unpins every entry


def test_a_tier_without_a_pinner_refills_staged(ckpt: Path, tmp_path: Path) -> None:
    """A tier that pins nothing (a host daemon, or --verify-content) has no page-locked entry: even a slab that
    could copy from one is refilled through the loader's threads, every block checked."""
    tier = HostTier(tmp_path / "tier", 1 << 30)
    try:
        disk = load_model(RankSpec(ckpt), backend=HostBackend(), threads=2, tier=tier)
        key = disk.key
        disk.close()
        entry = tier.lookup(key)
        assert entry is not None and entry.pinned is None and tier.pinned() == 0
        model = load_from_tier(tier, entry, key, _OneCopyBackend(), 2, None)
        assert model is not None
        try:
            assert model.stats.tier_copy == "staged"
        finally:
            model.close()
    finally:
        tier.close()
