"""Turning a STATE frame and its file descriptors into torch tensors (client side).

Each slab is mapped once; every tensor is a view of its slab, cut from its group's stacked
view when first looked up, so the cost is one mapping per slab plus ~1 µs per tensor used. Host slabs (memfd) are
mapped read-only: a write to a zero_copy tensor faults instead of corrupting the
weights other engines share. CUDA slabs are mapped by wcache.client.cuda.

Write-back goes the other way (docs/protocol.md §4.13): ``write_deposit`` copies an engine's tensors
into the one writable slab of a DEPOSIT_SLAB — a memfd here, a VMM allocation in wcache.client.cuda —
and drops the mapping before COMMIT.
"""

from __future__ import annotations

import mmap
import time
import warnings
from bisect import bisect_right
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from wcache.channel import close_fds, memfd_problem
from wcache.proto._record import named_tuple
from wcache.proto.codec import gc_paused
from wcache.proto.table import DTYPE_SIZES, TensorTable

if TYPE_CHECKING:  # write-back's frames and the error tree: not imported on the fetch path (it raises none)
    from wcache.errors import RemoteProtocolError
    from wcache.proto.daemon_frames import SlabDescriptor
    from wcache.proto.deposit_frames import DepositSlab
    from wcache.proto.engine import SlabDescriptor as MappedDescriptor
    from wcache.proto.engine import State

__all__ = ["GroupView", "MappedSlab", "TensorViews", "build_views", "map_slabs", "write_deposit"]

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in DTYPE_SIZES if isinstance(getattr(torch, name, None), torch.dtype)
}


def _protocol_error(message: str) -> RemoteProtocolError:
    from wcache.errors import RemoteProtocolError

    return RemoteProtocolError(message)


def _unmappable(i: int, desc: MappedDescriptor, exc: Exception) -> Exception:
    """What an engine gets for ``exc``, raised mapping slab ``i``: a WCacheError as it is (the daemon's slab broke
    the protocol, a GPU the engine cannot use ...); any other failure — ``mmap`` (ENOMEM: the address space is
    full or under RLIMIT_AS; ENODEV, EACCES), the CUDA driver's import or mapping (``CudaDriverError``), torch
    making the tensor — as CacheUnavailableError naming the slab, the cause chained. An engine's fallback catches
    WCacheError only (``wcache.nn.load_weights``): a bare OSError crashed its load instead of loading from disk.

    CacheUnavailableError and not RemoteProtocolError, because what the protocol lets a client check of a slab —
    a memfd's seals and size (``memfd_problem``), a CUDA slab's GPU and handle — has been checked before mapping,
    each break there the daemon's RemoteProtocolError; a mapping that fails after those checks fails on this
    process's resources (its address space, its limits, its GPU's driver), which the daemon cannot see or fix. The
    daemon's memory is then as unusable to this engine as if no daemon ran: the engine loads from disk, and the
    message says why, so that no one looks for a fault in the daemon."""
    from wcache.errors import CacheUnavailableError, WCacheError

    if isinstance(exc, WCacheError):
        return exc
    return CacheUnavailableError(
        f"slab {i} of the STATE ({desc.kind}, {desc.size} bytes) cannot be mapped in this process: "
        f"{type(exc).__name__}: {exc}",
        details={"slab": i, "kind": desc.kind, "size": desc.size},
    )


class MappedSlab:
    """A slab mapped into this process as a flat uint8 tensor; ``keepalive`` owns the mapping, which goes when the
    last tensor viewing it does (``torch.frombuffer`` holds the mmap, ``torch.as_tensor`` the DeviceBuffer)."""

    def __init__(self, base: torch.Tensor, keepalive: Any) -> None:
        self.base = base
        self.keepalive = keepalive
        self._closed = False

    def close(self) -> None:
        """Let the slab go now, not when the collector gets to this object: a fetch that failed (its traceback holds
        the slabs mapped so far, in a cycle in an asyncio task, which ``gc_paused(keep=True)`` moves to the oldest
        generation: each failed fetch kept its mapping and a descriptor until a full collection) and copy mode
        once copied. A lease's slabs are not closed: they live as long as their views.

        It drops this object's references (``base``, the mapping's owner) and unmaps nothing itself: a tensor
        that still views the slab (a view built from it, a frame of a traceback holding one) keeps the mapping,
        which goes with the last of them. It used to unmap at once (``mmap.close``, ``cuMemUnmap``): neither
        knows of torch's views, so such a tensor was left on unmapped memory — reading it (printing a failed
        fetch's traceback with its arguments) was a segmentation fault on the host and an illegal address on the
        GPU. Without such a tensor, dropping the references unmaps at once, as before."""
        if self._closed:
            return
        self._closed = True
        del self.base
        self.keepalive = None


def _map_memfd(i: int, desc: MappedDescriptor, fd: int) -> MappedSlab:
    """Slab ``i``'s memfd mapped read-only. Only a memfd sealed against writes and resizing, of at least ``offset +
    size`` bytes, is mapped (docs/protocol.md §4.5; RemoteProtocolError otherwise): the seals are what make a
    zero_copy tensor immutable and valid for as long as it lives — a sender's unsealed memfd could change the
    engine's weights under it, or be shrunk to kill it with SIGBUS on its next read."""
    problem = memfd_problem(fd, desc.offset + desc.size)
    if problem is not None:
        raise _protocol_error(f"memfd slab {i} (offset {desc.offset}, {desc.size} bytes) refused: {problem}")
    if desc.size == 0:
        return MappedSlab(torch.empty(0, dtype=torch.uint8), None)
    # no MAP_POPULATE, even for copy mode: setting up every page table entry first made a copy slower
    # (1 GB, fresh process: 362 ms populated vs 273 ms faulting while copying)
    mm = mmap.mmap(fd, desc.size + desc.offset, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        with warnings.catch_warnings():
            # the mapping is read-only on purpose (zero_copy tensors must not be written): torch's "The given buffer
            # is not writable" UserWarning, the one this call gives, is silenced by category (a filter by message
            # compiles a regular expression: ~0.1 ms of a fresh engine's first fetch)
            warnings.simplefilter("ignore", UserWarning)
            base = torch.frombuffer(mm, dtype=torch.uint8, count=desc.size, offset=desc.offset)
    except BaseException:
        mm.close()
        raise
    return MappedSlab(base, mm)


def map_slabs(
    state: State, fds: list[int], device: torch.device | None = None, timings: dict[str, float] | None = None
) -> list[MappedSlab]:
    """Map every slab of ``state``; closes ``fds`` (mappings keep the memory alive). ``timings`` (ms, added to):
    the CUDA driver's calls (``driver.vmm_import_map``) and ``as_tensor`` (each mapped range made a tensor).

    Every failure is a WCacheError, so that an engine falls back to disk (``_unmappable``): RemoteProtocolError
    for a slab that breaks docs/protocol.md §4.5, CacheUnavailableError naming the slab for one this process
    cannot map."""
    slabs: list[MappedSlab] = []
    try:
        for i, desc in enumerate(state.slabs):
            fd = fds[desc.fd] if desc.fd >= 0 else -1
            try:
                if desc.kind == "memfd":
                    if fd < 0:
                        raise _protocol_error("memfd slab without a file descriptor")
                    slabs.append(_map_memfd(i, desc, fd))
                elif desc.kind in ("cuda_ipc", "cuda_vmm"):
                    from wcache.client import cuda  # imported ahead when CUDA is up here (client._ahead)

                    buf = cuda.map_slab(desc, fd, device, timings)
                    t0 = time.perf_counter()
                    try:
                        base = buf.tensor()
                    except BaseException:
                        buf.close()
                        raise
                    slabs.append(MappedSlab(base, buf))
                    del base, buf  # the slabs hold them: a later slab's failure must not keep this one mapped
                    if timings is not None:
                        timings["as_tensor"] = timings.get("as_tensor", 0.0) + (time.perf_counter() - t0) * 1e3
                else:  # pragma: no cover - the decoder admits only known kinds
                    raise _protocol_error(f"unknown slab kind {desc.kind!r}")
            except Exception as exc:
                failure = _unmappable(i, desc, exc)
                if failure is exc:
                    raise
                raise failure from exc
    except BaseException:
        for s in slabs:
            s.close()
        raise
    finally:
        close_fds(fds)
    return slabs


if TYPE_CHECKING:  # a typing.NamedTuple for type checkers, ``named_tuple``'s at run time (as TensorEntry's)

    class GroupView(NamedTuple):
        names: tuple[str, ...]
        tensor: torch.Tensor

else:
    GroupView = named_tuple(
        "GroupView",
        ("names", "tensor"),
        """One STATE group as a stacked view: ``tensor[j]`` is the tensor named ``names[j]`` (``tensor``: shape
``(len(names), *shape)``, the group's tensors stacked in place).""",
        __name__,
    )


class TensorViews:
    """Name -> view of the mapped slabs (aliases included), cut one group at a time on first use: what
    ``CachedWeights`` (the engine's ``Mapping``) reads, a plain class (an ABC's class creation costs the fetch's
    window ~60 us).

    A STATE group (MoE experts, layer stacks) is one stacked ``as_strided`` view; its per-name
    tensors come from one ``unbind`` when a name of the group is first looked up. Building 50,000
    tensor objects costs torch ~1 µs each (56 ms of CUDA views on the H200's host), so a fetch
    builds none: engines that want stacked weights use :meth:`groups` and never pay for names,
    the others pay per group as they go; :meth:`materialize` builds everything at once. The
    decoder has validated every extent, so no view can reach outside its slab.
    """

    def __init__(self, table: TensorTable, aliases: dict[str, str], bases: list[torch.Tensor]) -> None:
        self._names = table.names
        self._groups = table.groups
        self._aliases = aliases
        self._bases = bases
        starts, at = [], 0
        for g in self._groups:
            starts.append(at)
            at += g.length
        self._starts = starts
        self._typed: dict[tuple[int, str], torch.Tensor] = {}
        self._stacked: list[torch.Tensor | None] = [None] * len(self._groups)
        self._views: list[tuple[torch.Tensor, ...] | None] = [None] * len(self._groups)
        self._index: dict[str, int] | None = None

    def _typed_base(self, slab: int, dtype: str) -> torch.Tensor:
        base = self._typed.get((slab, dtype))
        if base is None:
            size = DTYPE_SIZES[dtype]
            raw = self._bases[slab]
            if raw.numel() % size:  # sliced only when it must be (a fresh engine's first slice costs torch ~60 us)
                raw = raw[: raw.numel() - raw.numel() % size]
            base = self._typed[(slab, dtype)] = raw.view(_DTYPES[dtype])
        return base

    def stacked(self, i: int) -> torch.Tensor:
        """Group ``i`` as one view of shape ``(length, *shape)``."""
        t = self._stacked[i]
        if t is None:
            dtype, shape, stride, slab, offset, step, count = self._groups[i]
            size = DTYPE_SIZES[dtype]
            t = self._typed_base(slab, dtype).as_strided((count, *shape), (step // size, *stride), offset // size)
            self._stacked[i] = t
        return t

    def _group_views(self, i: int) -> tuple[torch.Tensor, ...]:
        views = self._views[i]
        if views is None:
            with gc_paused(self._groups[i].length * 64, keep=True):  # 10^4+ tensor objects: no GC passes meanwhile
                views = self._cut(i)
        return views

    def _cut(self, i: int) -> tuple[torch.Tensor, ...]:
        """Group ``i``'s per-name views: one ``unbind`` of its stacked view, or for a group of one tensor (most of
        a dense checkpoint's groups) that tensor's own view, without a stacked tensor object made for it."""
        g = self._groups[i]
        if g.length == 1 and self._stacked[i] is None:
            size = DTYPE_SIZES[g.dtype]
            views: tuple[torch.Tensor, ...] = (
                self._typed_base(g.slab, g.dtype).as_strided(g.shape, g.stride, g.offset // size),
            )
        else:
            views = self.stacked(i).unbind(0)
        self._views[i] = views
        return views

    def groups(self) -> list[GroupView]:
        """Every group as a stacked view, in table order (one view per group, no per-name tensors)."""
        with gc_paused(keep=True):  # a tensor object per group, no cycle: no collection passes over torch's heap
            return [
                GroupView(self._names[start : start + g.length], self.stacked(i))
                for i, (start, g) in enumerate(zip(self._starts, self._groups, strict=True))
            ]

    def materialize(self) -> None:
        """Build every per-name tensor now (what the first look-up of each group would do)."""
        with gc_paused(keep=True):
            views = self._views
            for i in range(len(self._groups)):
                if views[i] is None:
                    self._cut(i)

    def _position(self, name: str) -> int:
        index = self._index
        if index is None:
            index = dict(zip(self._names, range(len(self._names)), strict=True))
            for alias, target in self._aliases.items():
                index[alias] = index[target]
            self._index = index
        return index[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        pos = self._position(name)
        i = bisect_right(self._starts, pos) - 1
        return self._group_views(i)[pos - self._starts[i]]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self._position(name)
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        yield from self._names
        yield from self._aliases

    def __len__(self) -> int:
        return len(self._names) + len(self._aliases)


def build_views(state: State, bases: list[torch.Tensor]) -> TensorViews:
    """The name -> tensor mapping of ``state`` over the mapped ``bases`` (one per slab)."""
    return TensorViews(state.tensors, state.aliases, bases)


def deposit_sources(slab: DepositSlab, tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """(slab offset, the tensor's bytes as a flat uint8 tensor, on its own device) for every non-empty
    tensor of the DEPOSIT_SLAB's table; ProtocolError for a name this deposit did not list, or a dtype or
    shape other than what the daemon laid out."""
    for e in slab.tensors:
        t = tensors.get(e.name)
        if t is None:
            raise _protocol_error(f"DEPOSIT_SLAB names {e.name!r}, which this deposit did not list")
        have = (str(t.dtype).removeprefix("torch."), tuple(t.shape))
        if have != (e.dtype, e.shape):
            raise _protocol_error(
                f"DEPOSIT_SLAB lays out {e.name!r} as {e.dtype}{list(e.shape)}, the tensor is {have[0]}{list(have[1])}"
            )
        if t.numel():
            yield e.offset, t.detach().contiguous().reshape(-1).view(torch.uint8)


def _write_memfd(slab: DepositSlab, desc: SlabDescriptor, fd: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """The memfd deposit slab mapped writable, each tensor copied in, the mapping gone when this returns (COMMIT
    requires it: the daemon's seal fails while a writable mapping exists).

    ``torch.frombuffer`` holds a reference to the mmap object, not a buffer export, so ``mmap.close`` does not know
    of its tensors and unmaps under them: a tensor of the slab left alive (``base`` in this frame, which the
    traceback of a failure keeps, or a view of it taken meanwhile) then read unmapped memory, a segmentation
    fault. So the tensors go before the mapping: on success ``base`` (no other tensor of the slab is made) and
    then ``close``; on failure this frame's references go (``base`` and the mmap) and the mapping goes with the
    last of its tensors — at once, unless one is still held elsewhere, which then keeps it."""
    mm = mmap.mmap(fd, desc.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    base: torch.Tensor | None = None
    src: torch.Tensor | None = None
    try:
        base = torch.frombuffer(mm, dtype=torch.uint8)
        for offset, src in deposit_sources(slab, tensors):
            base[offset : offset + src.numel()].copy_(src)  # from any device: a GPU tensor comes down here
    except BaseException:
        del base, mm  # the mmap's own deallocation unmaps it when no tensor holds it any more
        raise
    del base, src
    mm.close()


def write_deposit(slab: DepositSlab, fd: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy each tensor to its offset in the deposit's one writable slab (``fd``: its descriptor, which
    the caller closes), then drop every mapping of it, as COMMIT requires (docs/protocol.md §4.13):
    ``memfd`` (host daemon) through a shared mapping, ``cuda_vmm`` (CUDA daemon) device to device
    through wcache.client.cuda. ProtocolError for any other kind."""
    (desc,) = slab.slabs
    if desc.kind == "memfd":
        _write_memfd(slab, desc, fd, tensors)
    elif desc.kind == "cuda_vmm":
        from wcache.client import cuda

        cuda.write_vmm_deposit(desc, fd, deposit_sources(slab, tensors))
    else:
        raise _protocol_error(
            f"a deposit slab of kind {desc.kind!r} cannot be written (docs/protocol.md §4.13: memfd or cuda_vmm)"
        )
