"""What a slab backend provides. Backends differ only in how a slab is allocated,
exported and (client side, wcache/client/mapping.py) mapped; protocol, store, leases,
layout and loader are shared.
"""

from __future__ import annotations

from typing import Protocol

import torch

from wcache.proto import DeviceInfo, SlabDescriptor

__all__ = ["Backend", "Slab"]


class Slab(Protocol):
    """One contiguous allocation holding a rank's tensors at their layout offsets."""

    size: int

    def tensor(self) -> torch.Tensor:
        """A writable uint8 tensor over the whole slab, for loading (only before seal())."""
        ...

    def host_fd(self) -> int | None:
        """A file descriptor of the slab's shared memory that file bytes can be copied into
        in the kernel (``sendfile`` at slab offsets), or None (device memory)."""
        ...

    def seal(self) -> None:
        """Loading is done: drop writable access the daemon no longer needs."""
        ...

    def save_to(self, fd: int) -> None:
        """Write the slab's ``size`` bytes to the file ``fd`` from offset 0 (the host tier)."""
        ...

    def export(self) -> tuple[SlabDescriptor, list[int]]:
        """The descriptor for STATE (its ``fd`` is 0 when a descriptor travels) and the fds to
        send. The daemon keeps owning those fds; the kernel duplicates them into the peer."""
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str  # "host" | "cuda"
    device: DeviceInfo

    def check_platform(self) -> None:
        """Raise UnsupportedPlatformError if this machine cannot share this kind of memory."""
        ...

    def allocate(self, nbytes: int) -> Slab: ...

    def adopt(self, desc: SlabDescriptor, fd: int) -> Slab:
        """Serve a slab another daemon handed over (TAKEOVER): ``fd`` is its exported descriptor."""
        ...
