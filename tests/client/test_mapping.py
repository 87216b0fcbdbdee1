"""wcache/client/mapping.py: what an engine maps of a STATE's slabs, and what it refuses to map
(docs/protocol.md §4.5)."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import gc
import os
from pathlib import Path

import pytest

from tests.client.fake_daemon import FakeDaemon, Peer, memfd, memfd_slab, state
from wcache import CacheUnavailableError, DeviceMismatchError, WCacheClient, WeightCacheKey
from wcache.channel import HOST_SEALS
from wcache.client.mapping import map_slabs
from wcache.errors import RemoteProtocolError
from wcache.proto.engine import SlabDescriptor, State
from wcache.proto.table import TensorEntry, TensorTable

KEY = WeightCacheKey("0" * 32, "LlamaForCausalLM", 1, 0, "float32")
ONE = [TensorEntry("w", "float32", (4,), (1,), 0, 0)]


def _state(*slabs: SlabDescriptor) -> State:
    return State(1, 7, KEY.to_wire(), "zero_copy", slabs, TensorTable.from_entries(ONE), {}, ())


def _memfd_desc(size: int, fd: int = 0, offset: int = 0) -> SlabDescriptor:
    return SlabDescriptor(size, "memfd", fd, b"", offset, "")


SEALS = {
    "F_SEAL_WRITE": fcntl.F_SEAL_WRITE,
    "F_SEAL_SHRINK": fcntl.F_SEAL_SHRINK,
    "F_SEAL_GROW": fcntl.F_SEAL_GROW,
    "F_SEAL_SEAL": fcntl.F_SEAL_SEAL,
}


@pytest.mark.parametrize("missing", ["every seal", *SEALS])
def test_a_memfd_without_every_seal_is_refused(missing: str) -> None:
    """A slab's memfd must carry F_SEAL_WRITE|SHRINK|GROW|SEAL (§4.5): without F_SEAL_WRITE its sender could change
    the engine's read-only weights, without SHRINK kill it with SIGBUS, without SEAL remove either later."""
    seals = 0 if missing == "every seal" else HOST_SEALS & ~SEALS[missing]
    given = [memfd(4096, seals=seals)]
    with pytest.raises(RemoteProtocolError, match=r"slab 0 .* not sealed"):
        map_slabs(_state(_memfd_desc(16)), given)
    assert given == []  # closed: map_slabs owns the descriptors it is given


@pytest.mark.parametrize("kind", ["directory", "regular file", "pipe"])
def test_a_descriptor_that_is_no_memfd_is_refused(kind: str, tmp_path: Path) -> None:
    if kind == "directory":
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    elif kind == "regular file":
        (tmp_path / "f").write_bytes(b"\0" * 4096)
        fd = os.open(tmp_path / "f", os.O_RDONLY)
    else:
        fd, w = os.pipe()
        os.close(w)
    with pytest.raises(RemoteProtocolError, match=r"slab 0 .* not a memfd"):
        map_slabs(_state(_memfd_desc(16)), [fd])


def test_a_sealed_memfd_smaller_than_its_slab_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="4096 bytes, its slab 4112"):
        map_slabs(_state(_memfd_desc(4096, offset=16)), [memfd(4096)])


def test_a_sealed_memfd_is_mapped_read_only() -> None:
    (slab,) = map_slabs(_state(_memfd_desc(16, offset=4)), [memfd(4096, data=bytes(range(32)))])
    assert slab.base.tolist() == list(range(4, 20))


def test_an_unsealed_slab_from_a_daemon_never_reaches_the_engine(tmp_path: Path) -> None:
    """A STATE whose memfd is unsealed (a buggy daemon, or another process of the uid on its socket, which keeps
    the descriptor to write or shrink it later): either fetch raises RemoteProtocolError, which the engine's
    fallback catches, and keeps nothing of it."""
    kept: list[int] = []

    def scenario(peer: Peer) -> None:
        request = peer.opening()
        fd = memfd(4096, seals=0)
        kept.append(fd)
        peer.send(state(request, [memfd_slab(0, 16)], ONE), [fd])
        peer.hold()

    sock = tmp_path / "fake.sock"
    mapped = _held()[0]
    with FakeDaemon(sock, scenario):
        client = WCacheClient(sock, wait_for_daemon=0, timeout=10)
        with pytest.raises(RemoteProtocolError, match="not sealed"):
            client.fetch_sync(KEY)
        with pytest.raises(RemoteProtocolError, match="not sealed"):
            asyncio.run(client.fetch(KEY))
    assert len(kept) == 2
    assert _held()[0] == mapped
    for fd in kept:
        os.close(fd)


def _held() -> tuple[int, int]:
    """This process's mappings and descriptors of the fake daemon's memfds (an mmap holds a descriptor of its own).
    Tests compare it with what it was when they began: the weights of earlier tests' fetches that succeeded are
    freed when the collector gets to their test's frame."""
    with open("/proc/self/maps") as f:
        mappings = sum("memfd:wcache-fake-slab" in line for line in f)
    fds = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:wcache-fake-slab")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return mappings, fds


#: a slab larger than any process's address space (x86-64 and aarch64 map at most 2^48 bytes without a hint)
HUGE = 1 << 50


@pytest.mark.parametrize("at", [0, 1])
def test_a_slab_this_process_cannot_map_is_cache_unavailable_naming_it(at: int) -> None:
    """A sealed memfd bigger than the address space (as a slab is under RLIMIT_AS or a full address space): mmap's
    ENOMEM is CacheUnavailableError naming the slab — a WCacheError, which the engine's fallback catches — not a
    bare OSError."""
    sizes = [16, 16]
    sizes[at] = HUGE
    descs = [_memfd_desc(size, fd=i) for i, size in enumerate(sizes)]
    before = _held()
    with pytest.raises(CacheUnavailableError, match=f"slab {at} of the STATE \\(memfd, {HUGE} bytes\\)") as info:
        map_slabs(_state(*descs), [memfd(size) for size in sizes])
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOMEM
    assert info.value.details == {"slab": at, "kind": "memfd", "size": HUGE}
    assert _held() == before  # slab 0 unmapped too, when slab 1 failed; the descriptors closed


def test_a_cuda_slab_the_driver_refuses_is_cache_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA mapping's failures are the driver's ``CudaDriverError`` (a RuntimeError) or torch's: each is
    CacheUnavailableError naming the slab; the WCacheErrors it raises itself (a GPU this process cannot see) pass as
    they are."""
    from wcache.client import cuda, driver

    def refused(desc: SlabDescriptor, fd: int, device: object, timings: object) -> driver.DeviceBuffer:
        raise driver.CudaDriverError(
            "cuMemImportFromShareableHandle", 1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"
        )

    monkeypatch.setattr(cuda, "map_slab", refused)
    vmm = SlabDescriptor(1 << 21, "cuda_vmm", 0, b"", 0, "GPU-x")
    fd = memfd(16)
    with pytest.raises(CacheUnavailableError, match=r"slab 0 .*cuda_vmm.*CUDA_ERROR_INVALID_VALUE") as info:
        map_slabs(_state(vmm), [fd])
    assert isinstance(info.value.__cause__, driver.CudaDriverError)

    def invisible(desc: SlabDescriptor, fd: int, device: object, timings: object) -> driver.DeviceBuffer:
        raise DeviceMismatchError("slab lives on GPU GPU-x, which this process cannot see")

    monkeypatch.setattr(cuda, "map_slab", invisible)
    with pytest.raises(DeviceMismatchError, match="cannot see"):
        map_slabs(_state(vmm), [memfd(16)])


async def test_load_weights_falls_back_to_disk_when_a_slab_cannot_be_mapped(ckpt: Path, tmp_path: Path) -> None:
    """The engine's view: ``wcache.nn.load_weights`` catches WCacheError and loads from disk, the reason naming the
    slab (before, mmap's OSError escaped it and the engine's load crashed)."""
    from wcache.nn import load_weights

    def scenario(peer: Peer) -> None:
        request = peer.opening()
        fd = memfd(HUGE)
        try:
            peer.send(state(request, [memfd_slab(0, HUGE)], [TensorEntry("w", "bfloat16", (8,), (1,), 0, 0)]), [fd])
        finally:
            os.close(fd)
        peer.hold()

    sock = tmp_path / "fake.sock"
    with FakeDaemon(sock, scenario):
        loaded = await load_weights(ckpt, client=WCacheClient(sock, wait_for_daemon=0, timeout=10))
    assert loaded.source == "disk"
    assert loaded.reason.startswith("CacheUnavailableError: slab 0 of the STATE")


def test_a_slab_mapped_before_a_later_one_fails_is_unmapped_at_once(tmp_path: Path) -> None:
    """Slab 0 maps, slab 1 is refused: slab 0's mapping and the descriptor its mmap holds are gone when map_slabs
    raises, while its exception — whose traceback holds the slabs mapped so far — is still alive (MappedSlab.close
    closes a memfd slab's mmap; it used to do nothing, leaving it to the collector)."""
    before = _held()
    fds = [memfd(4096), os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)]
    with pytest.raises(RemoteProtocolError, match="slab 1") as info:
        map_slabs(_state(_memfd_desc(16, fd=0), _memfd_desc(16, fd=1)), fds)
    assert _held() == before
    assert info.value.__traceback__ is not None


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
def test_fetches_that_fail_on_a_later_slab_leave_no_mapping_or_descriptor_behind(
    blocking: bool, tmp_path: Path
) -> None:
    """20 fetches from a daemon whose STATE's second slab is refused, the collector off: no mapping of the first
    slab, and no descriptor, stays behind. The async fetch's failure is a reference cycle (its task, the exception,
    the traceback's frames holding the mapped slabs) that only a full collection freed: 50 such fetches held 50
    mappings and 50 descriptors, found only after gc.collect()."""
    good = memfd(1 << 20)
    bad = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    two = [TensorEntry("a", "float32", (4,), (1,), 0, 0), TensorEntry("b", "float32", (4,), (1,), 1, 0)]

    def scenario(peer: Peer) -> None:
        request = peer.opening()
        peer.send(state(request, [memfd_slab(0, 1 << 20), memfd_slab(1, 16)], two), [good, bad])
        peer.hold()

    sock = tmp_path / "fake.sock"
    client = WCacheClient(sock, wait_for_daemon=0, timeout=10)
    gc.disable()
    try:
        with FakeDaemon(sock, scenario):
            before = _held()
            for _ in range(20):
                with pytest.raises(RemoteProtocolError, match="slab 1"):
                    client.fetch_sync(KEY) if blocking else asyncio.run(client.fetch(KEY))
            assert _held() == before
    finally:
        gc.enable()
        os.close(good)
        os.close(bad)


#: run in a child: reading memory that was unmapped under a tensor kills the process (SIGSEGV), not just a test
_VIEW_PAST_CLOSE = """
import gc
gc.disable()
from tests.client.fake_daemon import memfd
from tests.client.test_mapping import _held, _memfd_desc, _state
from wcache.client.mapping import map_slabs

(slab,) = map_slabs(_state(_memfd_desc(16, offset=4)), [memfd(4096, data=bytes(range(32)))])
view = slab.base[2:6]
slab.close()  # a failed fetch closes the slabs it mapped while a view of one is still referenced somewhere
assert view.tolist() == [6, 7, 8, 9], view.tolist()
assert _held()[0] == 1, _held()  # the view keeps the mapping
del view
assert _held()[0] == 0, _held()  # the last view gone: unmapped at once, the collector off
print("ok")
"""


def test_a_view_of_a_closed_slab_keeps_its_mapping_until_it_goes() -> None:
    """MappedSlab.close lets a slab go without unmapping it under a tensor that still views it: the view reads the
    slab's bytes, and the mapping goes with the last view. Before, close unmapped at once (mmap.close does not know
    of torch.frombuffer's tensors): reading the view was a segmentation fault — what printing a failed fetch's
    traceback with its arguments did."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-c", _VIEW_PAST_CLOSE], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )
    assert (r.returncode, r.stdout.strip()) == (0, "ok"), r.stderr[-2000:]


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
def test_a_copy_that_does_not_fit_the_engine_is_cache_unavailable_and_unmaps(
    blocking: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copy mode copies each mapped slab into the engine's own memory; a copy that does not fit (torch's
    OutOfMemoryError, here raised by the copy itself) is CacheUnavailableError naming the slab — a WCacheError, which
    the engine's fallback catches — and the slab's mapping is gone when it is raised. Before, torch's error escaped
    the fetch as it was and ``wcache.nn.load_weights`` did not fall back."""
    import torch

    slab = memfd(4096, data=bytes(range(16)))

    def scenario(peer: Peer) -> None:
        request = peer.opening()
        peer.send(state(request, [memfd_slab(0, 16)], [TensorEntry("w", "float32", (4,), (1,), 0, 0)]), [slab])
        peer.hold()

    def no_room(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16 bytes")

    sock = tmp_path / "fake.sock"
    client = WCacheClient(sock, wait_for_daemon=0, timeout=10)
    try:
        with FakeDaemon(sock, scenario):
            before = _held()
            monkeypatch.setattr(torch.Tensor, "clone", no_room)
            with pytest.raises(CacheUnavailableError, match=r"copy mode: slab 0 \(16 bytes\)") as info:
                client.fetch_sync(KEY, "copy") if blocking else asyncio.run(client.fetch(KEY, "copy"))
            monkeypatch.undo()
            assert "OutOfMemoryError: CUDA out of memory" in str(info.value)
            assert info.value.__cause__ is None and info.value.__suppress_context__  # torch's frames not kept
            assert info.value.details == {"slab": 0, "size": 16}
            del info
            assert _held() == before
    finally:
        os.close(slab)


#: run in a child: RLIMIT_AS leaves this process room to map a 128 MiB slab, not to copy it too
_COPY_PAST_RLIMIT_AS = """
import asyncio, gc, os, resource, sys
from pathlib import Path
from tests.client.fake_daemon import FakeDaemon, memfd, memfd_slab, state
from tests.client.test_mapping import KEY, _held
from wcache import CacheUnavailableError, WCacheClient
from wcache.proto.table import TensorEntry

SIZE = 128 << 20
slab = memfd(SIZE, data=bytes(range(16)))

def scenario(peer):
    request = peer.opening()
    peer.send(state(request, [memfd_slab(0, SIZE)], [TensorEntry("w", "uint8", (SIZE,), (1,), 0, 0)]), [slab])
    peer.released()

with FakeDaemon(Path(sys.argv[1]), scenario):
    client = WCacheClient(Path(sys.argv[1]), wait_for_daemon=0, timeout=30)
    assert client.fetch_sync(KEY, "copy")["w"][:16].tolist() == list(range(16))  # it fits without the limit
    asyncio.run(client.fetch(KEY, "copy"))  # the event loop's first use, before the limit
    gc.collect()
    before = _held()
    with open("/proc/self/status") as f:
        vm = int(next(line for line in f if line.startswith("VmSize")).split()[1]) << 10
    resource.setrlimit(resource.RLIMIT_AS, (vm + SIZE + (32 << 20), resource.RLIM_INFINITY))
    for blocking in (True, False):
        try:
            client.fetch_sync(KEY, "copy") if blocking else asyncio.run(client.fetch(KEY, "copy"))
            print("fetched")
        except CacheUnavailableError as e:
            print(e.details, _held() == before)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
"""


def test_a_copy_past_the_engines_address_space_is_cache_unavailable(tmp_path: Path) -> None:
    """A copy-mode fetch in an engine whose RLIMIT_AS has room for the slab's mapping but not for its copy: torch's
    CPU allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory"), neither
    OutOfMemoryError nor MemoryError. Both fetches are CacheUnavailableError naming the slab, the mapping gone; before,
    the RuntimeError escaped them and ``wcache.nn.load_weights`` did not fall back to disk."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-c", _COPY_PAST_RLIMIT_AS, str(tmp_path / "fake.sock")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    expected = "{'slab': 0, 'size': 134217728} True"
    assert (r.returncode, r.stdout.split("\n")) == (0, [expected, expected, ""]), r.stderr[-2000:]


#: run in a child: a tensor left on a deposit slab unmapped under it kills the process (SIGSEGV) when read
_DEPOSIT_FAILS = """
import gc, sys
gc.disable()
import torch
from tests.client.fake_daemon import memfd
from tests.client.test_mapping import _held
from wcache.client.mapping import write_deposit
from wcache.errors import RemoteProtocolError
from wcache.proto.daemon_frames import SlabDescriptor
from wcache.proto.deposit_frames import DepositSlab
from wcache.proto.table import TensorEntry, TensorTable

# the daemon lays out "a" and "b"; the engine deposits "a" only: the write fails after "a" is copied
table = TensorTable.from_entries(
    [TensorEntry("a", "float32", (4,), (1,), 0, 0), TensorEntry("b", "float32", (4,), (1,), 0, 256)]
)
slab = DepositSlab(id=1, deposit=5, slabs=(SlabDescriptor(size=4096, kind="memfd", fd=0),), tensors=table)
fd = memfd(4096, seals=0)
held = []

class Held(dict):  # a view of the slab taken while the write runs (a debugger's, a profiler's) and kept
    def get(self, name, default=None):
        if name == "b":
            frame = sys._getframe()
            while frame.f_code.co_name != "_write_memfd":
                frame = frame.f_back
            held.append(frame.f_locals["base"][:16])
        return super().get(name, default)

for tensors in ({"a": torch.ones(4)}, Held(a=torch.ones(4))):
    try:
        write_deposit(slab, fd, tensors)
        raise AssertionError("the write succeeded")
    except RemoteProtocolError as exc:
        err = exc
    # every tensor the failure's traceback keeps reads what it views
    tb = err.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            if isinstance(value, torch.Tensor):
                value.float().sum().item()
        tb = tb.tb_next
    if held:
        assert held[0].view(torch.float32).tolist() == [1.0] * 4, held[0]
        assert _held()[0] == 1, _held()  # the view keeps the mapping
        held.clear()
    assert _held()[0] == 0, _held()  # no tensor of the slab left: unmapped at once, the failure still alive
    del err
print("ok")
"""


def test_a_deposit_that_fails_unmaps_its_slab_under_no_tensor() -> None:
    """A write-back whose DEPOSIT_SLAB names a tensor the deposit did not list fails after the first copy. Every
    tensor its traceback keeps reads what it views, a view of the slab kept elsewhere reads the bytes written and
    keeps the mapping until it goes, and with no such view the slab is unmapped at once. Before, the writer's
    ``mmap.close`` unmapped the slab under its own ``base`` tensor, which the traceback keeps (and under any view
    of it): reading it was a segmentation fault (``torch.frombuffer`` holds the mmap, not a buffer export, so
    ``close`` did not refuse)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-c", _DEPOSIT_FAILS], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )
    assert (r.returncode, r.stdout.strip()) == (0, "ok"), r.stderr[-2000:]


@pytest.mark.parametrize("fails", [True, False], ids=["failed", "written"])
def test_a_cuda_deposit_slab_is_unmapped_under_no_tensor(fails: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA writer (wcache.client.cuda.write_vmm_deposit), its driver stood in for: the slab's mapping is
    released exactly once, when no tensor of it is left — after a write (before COMMIT) and, while the failure is
    still alive, after a write that fails. Before, a failed write released it (``cuMemUnmap``) while its ``base``
    tensor was still alive in the frame the traceback keeps: reading that tensor was an illegal address."""
    import weakref

    import torch

    from wcache.client import cuda, driver
    from wcache.client.mapping import write_deposit
    from wcache.proto.daemon_frames import SlabDescriptor
    from wcache.proto.deposit_frames import DepositSlab

    made: list[weakref.ref[torch.Tensor]] = []  # the slab's tensor
    released: list[bool] = []  # per release: whether it was still alive

    class Buffer(driver.DeviceBuffer):
        """A host tensor as the mapped range; as ``torch.as_tensor``'s would, the tensor holds its buffer."""

        def tensor(self) -> torch.Tensor:
            t = torch.zeros(self.size, dtype=torch.uint8)
            t._buffer = self  # type: ignore[attr-defined]
            made.append(weakref.ref(t))
            return t

    def vmm_import(fd: int, offset: int, size: int, index: int, *, read_only: bool) -> tuple[Buffer, bool]:
        return Buffer(0, size, index, lambda: released.append(made[0]() is not None)), read_only

    monkeypatch.setattr(cuda, "_slab_device", lambda desc: 0)
    monkeypatch.setattr(cuda, "vmm_import", vmm_import)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: None)
    entries = [TensorEntry("a", "float32", (4,), (1,), 0, 0)]
    if fails:  # laid out, not deposited: the write fails after "a" is copied
        entries.append(TensorEntry("b", "float32", (4,), (1,), 0, 256))
    desc = SlabDescriptor(size=4096, kind="cuda_vmm", fd=0, device_uuid="GPU-x")
    slab = DepositSlab(id=1, deposit=5, slabs=(desc,), tensors=TensorTable.from_entries(entries))
    gc.disable()
    try:
        if fails:
            with pytest.raises(RemoteProtocolError, match="'b'") as info:
                write_deposit(slab, 3, {"a": torch.ones(4)})
            assert info.value.__traceback__ is not None and released == [False]
        else:
            write_deposit(slab, 3, {"a": torch.ones(4)})
            assert released == [False]
    finally:
        gc.enable()


def test_an_empty_tensor_the_table_accepts_has_its_view_made() -> None:
    """The table decoder bounds an empty tensor's non-zero dimensions (docs/protocol.md §4.6), so that torch, which
    multiplies every dimension, makes its view: one at the bound's edge is looked up, grouped and materialized."""
    import torch

    from wcache.client.mapping import TensorViews
    from wcache.proto.table import TensorGroup

    wire = TensorTable(("e",), (TensorGroup("uint8", (1 << 30, 1 << 29, 0), (0, 0, 1), 0, 0, 0, 1),)).to_wire()
    views = TensorViews(TensorTable.from_wire(wire, [4096]), {}, [torch.zeros(4096, dtype=torch.uint8)])
    assert views["e"].shape == (1 << 30, 1 << 29, 0)
    assert views.groups()[0].tensor.numel() == 0
    views.materialize()
