"""The NIXL wrapper (wcache/server/nixl.py) on host slabs: registration of a slab's region, one-sided READs of
contiguous and strided blocks between two agents, and its errors (docs/fleet.md, "Data path")."""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from wcache.errors import FillError
from wcache.plan.reshard import Copy
from wcache.server import nixl as nixl_mod
from wcache.server.backends.host import HostBackend, HostSlab
from wcache.server.nixl import Agent, Registration

pytest.importorskip("nixl_cu12", reason="the fleet extra (pip install -e '.[fleet]') is not installed")

SIZE = 1 << 20
Pair = tuple[HostSlab, Registration, Agent, str]


def _source_slab() -> HostSlab:
    slab = HostBackend().allocate(SIZE)
    view = slab._mapping()
    view[:] = bytes(range(256)) * (SIZE // 256)
    slab.seal()
    return slab


@pytest.fixture
def pair() -> Iterator[Pair]:
    src_slab = _source_slab()
    src, dst = Agent(f"t-src-{os.getpid()}"), Agent(f"t-dst-{os.getpid()}")
    reg = src.register(src_slab.region())
    peer = dst.add_peer(src.metadata([reg]))
    yield src_slab, reg, dst, peer
    dst.close()
    src.deregister(reg)
    src.close()
    src_slab.close()


def test_a_sealed_host_slab_is_registered_read_only_and_unmapped_at_close() -> None:
    slab = _source_slab()
    region = slab.region()
    assert region.kind == "host" and region.length == SIZE
    assert slab.region() == region  # one mapping for the slab's life
    maps = Path("/proc/self/maps").read_text()
    line = next(x for x in maps.splitlines() if x.startswith(f"{region.address:x}-"))
    assert line.split()[1].startswith("r--s")  # read-only, shared
    slab.close()
    assert f"{region.address:x}-" not in Path("/proc/self/maps").read_text()


def test_read_contiguous_and_strided_blocks_into_a_fresh_slab(pair: Pair) -> None:
    src_slab, reg, dst, peer = pair
    remote = reg.region
    out = HostBackend().allocate(SIZE)
    try:
        local = out.region()
        lreg = dst.register(local)
        half = 2048  # a dim-1 shard: the right half of each 4 KiB row
        rows = 64
        dst.start_read(peer, [Copy(0, 0, 0, 4096)], local, remote, deadline=time.monotonic() + 30).wait()
        assert bytes(out._mapping()[:4096]) == src_slab.read(0, 4096)
        for strided in (False, True):
            base = 8192 if strided else 8192 + rows * half
            c = Copy(0, half, base, half, rows, 4096, half)
            st = dst.start_read(peer, [c], local, remote, deadline=time.monotonic() + 30, strided=strided).wait()
            assert st.bytes == rows * half and st.descriptors == rows
            got = bytes(out._mapping()[base : base + rows * half])
            want = b"".join(src_slab.read(r * 4096 + half, half) for r in range(rows))
            assert got == want
        dst.deregister(lreg)
    finally:
        out.close()


def test_blocks_outside_a_region_are_refused_before_nixl(pair: Pair) -> None:
    _, reg, dst, peer = pair
    remote = reg.region
    out = HostBackend().allocate(4096)
    try:
        local = out.region()
        with pytest.raises(ValueError, match="outside"):
            dst.start_read(peer, [Copy(0, SIZE - 10, 0, 64)], local, remote, deadline=1e18)
        with pytest.raises(ValueError, match="outside"):
            dst.start_read(peer, [Copy(0, 0, 0, 1024, 8, 1024, 1024)], local, remote, deadline=1e18)
    finally:
        out.close()


def test_a_read_past_its_deadline_is_a_fill_error(pair: Pair) -> None:
    _, reg, dst, peer = pair
    remote = reg.region
    out = HostBackend().allocate(SIZE)
    try:
        local = out.region()
        lreg = dst.register(local)
        with pytest.raises(FillError) as err:
            dst.start_read(peer, [Copy(0, 0, 0, SIZE)], local, remote, deadline=time.monotonic() - 1)
        assert err.value.details["reason"] in ("deadline",)
        dst.deregister(lreg)
    finally:
        out.close()


def test_close_destroys_the_agent_whatever_still_refers_to_it(pair: Pair) -> None:
    """``close`` destroys the NIXL agent (its UCX worker's threads, sockets, pipes) though this object lives on — in
    a failed fill's traceback, until a garbage collection — and with it every transfer it made; a registration
    dropped after it (a source's slab freed after the source stopped) is a no-op, any other use a FillError."""
    _, reg, dst, peer = pair
    out = HostBackend().allocate(SIZE)
    try:
        local = out.region()
        lreg = dst.register(local)
        done = dst.start_read(peer, [Copy(0, 0, 0, 4096)], local, reg.region, deadline=time.monotonic() + 30)
        done.wait()
        native = weakref.ref(dst._agent)
        dst.close()
        assert native() is None and dst.closed  # ``dst`` and ``done`` still refer to the wrapper
        dst.deregister(lreg)
        dst.close()
        with pytest.raises(FillError) as err:
            dst.register(local)
        assert err.value.details["reason"] == "nixl"
        with pytest.raises(FillError):
            dst.start_read(peer, [Copy(0, 0, 0, 4096)], local, reg.region, deadline=time.monotonic() + 30)
    finally:
        out.close()


def test_without_nixl_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_mod, "_loaded", None)
    monkeypatch.setattr(nixl_mod, "MODULES", ("wcache_no_such_nixl",))
    with pytest.raises(FillError, match=r"pip install -e \"\.\[fleet\]\"") as err:
        nixl_mod.nixl_module()
    assert err.value.details["reason"] == "nixl-missing"
