"""Client side of the CUDA backend: pick the GPU by UUID, map the daemon's slab."""

from __future__ import annotations

import torch

from wcache import _cuda
from wcache.client.mapping import MappedSlab
from wcache.errors import DeviceMismatchError, ProtocolError, UnsupportedPlatformError
from wcache.proto import SlabDescriptor

__all__ = ["local_uuid", "map_slab"]


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise UnsupportedPlatformError(
            "the daemon serves GPU memory but this process sees no CUDA device; "
            "run the engine on that GPU, use a --device cpu daemon, or load from disk"
        )


def local_uuid(device: torch.device | None, daemon_uuid: str) -> str:
    """The UUID this client sends in GET_STATE: its chosen device's, or the daemon's GPU if visible."""
    _require_cuda()
    if device is not None and device.type == "cuda":
        return _cuda.device_uuid(device.index if device.index is not None else torch.cuda.current_device())
    if _cuda.device_index_for_uuid(daemon_uuid) is None:
        visible = [_cuda.device_uuid(i) for i in range(torch.cuda.device_count())]
        raise DeviceMismatchError(
            f"the daemon's GPU {daemon_uuid} is not visible to this process (visible: {visible}); "
            "check CUDA_VISIBLE_DEVICES",
            details={"daemon": daemon_uuid, "visible": visible},
        )
    return daemon_uuid


def map_slab(desc: SlabDescriptor, fd: int, device: torch.device | None) -> MappedSlab:
    _require_cuda()
    index = _cuda.device_index_for_uuid(desc.device_uuid)
    if index is None:
        raise DeviceMismatchError(f"slab lives on GPU {desc.device_uuid}, which this process cannot see")
    if device is not None and device.type == "cuda" and device.index not in (None, index):
        raise DeviceMismatchError(f"asked for cuda:{device.index}, but the slab lives on cuda:{index}")
    if desc.kind == "cuda_ipc":
        if len(desc.handle) != 64:
            raise ProtocolError(f"cuda_ipc handle must be 64 bytes, got {len(desc.handle)}")
        buf = _cuda.ipc_open(desc.handle, desc.offset, desc.size, index)
    else:
        if fd < 0:
            raise ProtocolError("cuda_vmm slab without a file descriptor")
        buf, _read_only = _cuda.vmm_import(fd, desc.offset, desc.size, index, read_only=True)
    return MappedSlab(buf.tensor(), buf, buf.close)
