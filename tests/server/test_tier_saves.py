"""The host tier's writes (wcache/server/tier.py): two saves of one key at once, and what a daemon
killed in the middle of a save leaves behind."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, cast

from wcache.key import WeightCacheKey
from wcache.proto.table import TensorEntry, TensorTable
from wcache.server.tier import HostTier

SIZE = 1 << 20


class _Slab:
    """A slab whose bytes are ``fill``; ``save_to`` can stop half way until ``resume`` is set."""

    def __init__(self, fill: int, *, halfway: threading.Event | None = None) -> None:
        self.size = SIZE
        self.data = bytes([fill]) * SIZE
        self.halfway = halfway
        self.resume = threading.Event()

    def save_to(self, fd: int) -> None:
        half = SIZE // 2
        os.pwrite(fd, self.data[:half], 0)
        if self.halfway is not None:
            self.halfway.set()
            assert self.resume.wait(30)
        os.pwrite(fd, self.data[half:], half)


def _table() -> TensorTable:
    return TensorTable.from_entries([TensorEntry("w", "uint8", (SIZE,), (1,), 0, 0)])


def test_two_saves_of_one_key_at_once_do_not_mix_their_bytes(ckpt: Path, tmp_path: Path) -> None:
    """A deposit replaced by another of the same recipe key is saved again while the first save runs: both
    wrote one temporary file (its name was the entry's and the pid), so the late save's bytes went into the
    entry the other had just completed. The entry must be one slab's bytes, whole."""
    tier = HostTier(tmp_path / "tier", 1 << 30)
    key = WeightCacheKey.from_checkpoint(ckpt)
    halfway = threading.Event()
    first, second = _Slab(1, halfway=halfway), _Slab(2)
    errors: list[BaseException] = []

    def save_first() -> None:
        try:
            tier.save(key, first, _table(), {}, SIZE)  # type: ignore[arg-type]
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    t = threading.Thread(target=save_first)
    t.start()
    assert halfway.wait(30)
    done = threading.Thread(target=tier.save, args=(key, second, _table(), {}, SIZE))
    done.start()
    done.join(0.5)  # the second save may wait for the first (it must not interleave with it)
    first.resume.set()
    t.join(30)
    done.join(30)
    assert not t.is_alive() and not done.is_alive() and not errors
    entry = tier.lookup(key)
    assert entry is not None
    data = entry.slab_path.read_bytes()
    assert data in (first.data, second.data)
    assert not [p.name for p in tier.dir.iterdir() if p.suffix not in (".slab", ".meta")]  # no temporary left


def test_temporary_files_of_a_dead_daemon_are_removed(tmp_path: Path) -> None:
    """A daemon killed during a save left its temporary slab in the tier directory (tmpfs: memory) for
    good, outside every budget. The next HostTier on the directory removes those of dead processes only."""
    tier_dir = tmp_path / "tier"
    HostTier(tier_dir, 1 << 30)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    dead_pid = int(dead.stdout)
    stem = "0" * 32
    left = [tier_dir / f".{stem}.{dead_pid}.tmp", tier_dir / f".{stem}.{dead_pid}.metatmp"]
    alive = [tier_dir / f".{stem}.{os.getpid()}.tmp"]  # another live daemon's save in progress
    for p in left + alive:
        p.write_bytes(b"x" * 4096)
    HostTier(tier_dir, 1 << 30)
    assert [p.exists() for p in left] == [False, False]
    assert alive[0].exists()


def test_an_eviction_during_a_save_frees_the_slab_after_the_save() -> None:
    """A deposit is saved to the tier in a thread while the daemon serves on; an EVICT meanwhile closes the model.
    The slab must stay open until the save has read it (a host slab's fd could otherwise be reused under the save,
    a CUDA slab unmapped), and be freed right after; a model closed already is not saved."""
    from wcache.server.loader import LoadStats
    from wcache.server.store import ServedModel

    class Slab:
        size = SIZE
        closed = 0

        def close(self) -> None:
            self.closed += 1

    slab = Slab()
    key = WeightCacheKey("f", "A", 1, 0, "bfloat16")
    stats = LoadStats(SIZE, SIZE, 0.1)
    model = ServedModel(key, _table(), {}, [cast("Any", slab)], cast("Any", object()), SIZE, stats)
    assert model.hold()
    model.close()  # the eviction, while the save holds it
    assert slab.closed == 0 and not model.hold()  # still open for the save; nothing new may hold it
    model.release_hold()
    assert slab.closed == 1 and model.slabs == []
    model.close()
    assert slab.closed == 1


def test_an_entry_whose_aliases_or_buffers_name_no_tensor_is_rejected(tmp_path: Path) -> None:
    """A meta file (same user, private directory) whose aliases or buffers point outside its table would make every
    fetch of it fail in the client: the entry is rejected and removed instead, and the model loaded as usual."""
    import msgpack

    tier = HostTier(tmp_path / "tier", 1 << 30)
    key = WeightCacheKey("f", "A", 1, 0, "bfloat16")
    for bad in ({"aliases": {"x": "missing"}}, {"buffers": ["missing"]}, {"aliases": {"w": "w"}}):
        assert tier.save(key, cast("Any", _Slab(3)), _table(), {}, SIZE)
        slab, meta = tier._paths(key)
        m = msgpack.unpackb(meta.read_bytes(), raw=False)
        m.update(bad)
        meta.write_bytes(msgpack.packb(m, use_bin_type=True))
        assert tier.lookup(key) is None, bad
        assert not meta.exists() and not slab.exists()
    assert tier.save(key, cast("Any", _Slab(3)), _table(), {}, SIZE)
    assert tier.lookup(key) is not None
