"""Turning a STATE frame and its file descriptors into torch tensors (client side).

Each slab is mapped once; every tensor is an ``as_strided`` view of its slab, so the
cost is one mapping per slab plus a few microseconds per tensor. Host slabs (memfd) are
mapped read-only: a write to a zero_copy tensor faults instead of corrupting the
weights other engines share. CUDA slabs are mapped by wcache.client.cuda.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from wcache.channel import close_fds
from wcache.errors import ProtocolError, UnsupportedPlatformError
from wcache.proto import DTYPE_SIZES, SlabDescriptor, State

__all__ = ["MappedSlab", "build_views", "map_slabs"]

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in DTYPE_SIZES if isinstance(getattr(torch, name, None), torch.dtype)
}


class MappedSlab:
    """A slab mapped into this process as a flat uint8 tensor; ``keepalive`` owns the mapping."""

    def __init__(self, base: torch.Tensor, keepalive: Any, close: Callable[[], None] | None = None) -> None:
        self.base = base
        self.keepalive = keepalive
        self._close = close

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


def _map_memfd(desc: SlabDescriptor, fd: int, populate: bool) -> MappedSlab:
    st = os.fstat(fd)
    if st.st_size < desc.size + desc.offset:
        raise ProtocolError(f"shared memory of {st.st_size} bytes is smaller than the slab ({desc.size})")
    if desc.size == 0:
        return MappedSlab(torch.empty(0, dtype=torch.uint8), None)
    # copy mode reads every page at once: pre-fault them in one call (MAP_POPULATE)
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    mm = mmap.mmap(fd, desc.size + desc.offset, flags, mmap.PROT_READ)
    with warnings.catch_warnings():
        # the mapping is read-only on purpose (zero_copy tensors must not be written)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        base = torch.frombuffer(mm, dtype=torch.uint8, count=desc.size, offset=desc.offset)
    return MappedSlab(base, mm)


def map_slabs(
    state: State, fds: list[int], device: torch.device | None = None, *, populate: bool = False
) -> list[MappedSlab]:
    """Map every slab of ``state``; closes ``fds`` (mappings keep the memory alive)."""
    slabs: list[MappedSlab] = []
    try:
        for desc in state.slabs:
            fd = fds[desc.fd] if desc.fd >= 0 else -1
            if desc.kind == "memfd":
                if fd < 0:
                    raise ProtocolError("memfd slab without a file descriptor")
                slabs.append(_map_memfd(desc, fd, populate))
            elif desc.kind in ("cuda_ipc", "cuda_vmm"):
                try:
                    from wcache.client import cuda
                except ImportError as exc:  # pragma: no cover - depends on the install
                    raise UnsupportedPlatformError(f"cannot map {desc.kind} slabs here: {exc}") from exc
                slabs.append(cuda.map_slab(desc, fd, device))
            else:  # pragma: no cover - the decoder admits only known kinds
                raise ProtocolError(f"unknown slab kind {desc.kind!r}")
    except BaseException:
        for s in slabs:
            s.close()
        raise
    finally:
        close_fds(fds)
    return slabs


def build_views(state: State, bases: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One strided view per tensor (extents and alignment validated by the decoder), plus aliases.

    A group of several equally shaped tensors (MoE experts, layer stacks) is cut from one
    stacked view with ``unbind``: one C++ call instead of one ``as_strided`` per tensor,
    which matters at 10^4-10^5 tensors.
    """
    typed: dict[tuple[int, str], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    names = state.tensors.names
    pos = 0
    for dtype, shape, stride, slab, offset, step, count in state.tensors.groups:
        size = DTYPE_SIZES[dtype]
        base = typed.get((slab, dtype))
        if base is None:
            raw = bases[slab]
            raw = raw[: raw.numel() - raw.numel() % size]
            base = typed[(slab, dtype)] = raw.view(_DTYPES[dtype])
        if count == 1:
            out[names[pos]] = base.as_strided(shape, stride, offset // size)
        else:
            stacked = base.as_strided((count, *shape), (step // size, *stride), offset // size)
            out.update(zip(names[pos : pos + count], stacked.unbind(0)))
        pos += count
    for alias, target in state.aliases.items():
        out[alias] = out[target]
    return out
