"""Host backend: the slab is a sealed memfd in shared memory; clients map it read-only.

After loading, the daemon drops its writable mapping and adds F_SEAL_WRITE/SHRINK/GROW:
from then on no process, the daemon included, can change or resize the bytes, so a
client that receives the fd cannot corrupt the weights other engines map.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sys

import torch

from wcache.errors import UnsupportedPlatformError, WCacheError
from wcache.proto import DeviceInfo, SlabDescriptor

__all__ = ["HostBackend", "HostSlab"]

_SEALS = (
    fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if sys.platform == "linux" else 0
)


class HostSlab:
    def __init__(self, nbytes: int, name: str = "wcache-slab", adopt_fd: int = -1) -> None:
        self.size = nbytes
        if adopt_fd >= 0:  # handed over by another daemon: already loaded and sealed
            self.fd = adopt_fd
            self._mm: mmap.mmap | None = None
            self._tensor: torch.Tensor | None = None
            self.sealed = True
            return
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            # No fallocate and no mapping up front: the loader copies file bytes in with sendfile, which
            # allocates each shared-memory page as it writes it (no zeroing pass, no page faults) -
            # measured 2x faster than fallocate + preadv into a mapping (2 GB warm: 0.72 s vs 1.5 s).
            os.ftruncate(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self._mm = None
        self._tensor = None
        self.sealed = False

    def tensor(self) -> torch.Tensor:
        if self.sealed:
            raise RuntimeError("slab is sealed")
        if self._tensor is None:
            if self.size == 0:
                self._tensor = torch.empty(0, dtype=torch.uint8)
            else:
                self._mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                self._tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._tensor

    def host_fd(self) -> int | None:
        if self.sealed:
            raise RuntimeError("slab is sealed")
        return self.fd

    def seal(self) -> None:
        self._tensor = None  # releases torch's export of the mmap buffer
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        self.sealed = True

    def export(self) -> tuple[SlabDescriptor, list[int]]:
        return SlabDescriptor(size=self.size, kind="memfd", fd=0), [self.fd]

    def save_to(self, fd: int) -> None:
        done = 0
        while done < self.size:  # in-kernel copy, memfd -> file
            got = os.sendfile(fd, self.fd, done, min(self.size - done, 1 << 30))
            if got == 0:
                raise OSError(f"slab copy stopped at {done} of {self.size} bytes")
            done += got

    def close(self) -> None:
        self._tensor = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass
            self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class HostBackend:
    name = "host"

    def __init__(self) -> None:
        self.device = DeviceInfo(kind="cpu", index=0, uuid="", name="host shared memory")

    def check_platform(self) -> None:
        if sys.platform != "linux" or not hasattr(os, "memfd_create") or not hasattr(fcntl, "F_ADD_SEALS"):
            raise UnsupportedPlatformError(
                f"the host backend needs Linux memfd with sealing and SCM_RIGHTS; this is {sys.platform}. "
                "Alternatives: load weights from disk normally (the client falls back to it)",
                details={"platform": sys.platform, "backend": self.name},
            )

    def allocate(self, nbytes: int) -> HostSlab:
        return HostSlab(nbytes)

    def adopt(self, desc: SlabDescriptor, fd: int) -> HostSlab:
        """A sealed memfd handed over by another daemon."""
        if desc.kind != "memfd":
            raise WCacheError(f"a {desc.kind} slab cannot be served by the host backend")
        if os.fstat(fd).st_size < desc.size or fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
            raise WCacheError("the handed-over memfd is smaller than its slab or not sealed")
        return HostSlab(desc.size, adopt_fd=fd)
