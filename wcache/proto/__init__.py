"""The wcache wire protocol, pure: no asyncio, sockets or torch (docs/protocol.md).

``codec`` frames bytes, ``frames`` defines the typed frames, ``connection`` holds the
per-connection state machine. Bytes in, typed frames out.
"""

from wcache.proto.codec import DEFAULT_MAX_FRAME_SIZE, FrameBuffer, decode_body, pack_frame
from wcache.proto.connection import PROTOCOL_VERSION, SUPPORTED_VERSIONS, Connection, Phase, Role
from wcache.proto.frames import (
    DTYPE_SIZES,
    DeviceInfo,
    ErrorFrame,
    Evict,
    Evicted,
    Frame,
    GetState,
    Hello,
    HelloOk,
    LeaseInfo,
    ModelInfo,
    Preload,
    Preloaded,
    Release,
    Released,
    SlabDescriptor,
    State,
    Status,
    StatusReply,
    TensorEntry,
    TensorTable,
    decode_frame,
    tensor_extent,
)

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "DTYPE_SIZES",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "Connection",
    "DeviceInfo",
    "ErrorFrame",
    "Evict",
    "Evicted",
    "Frame",
    "FrameBuffer",
    "GetState",
    "Hello",
    "HelloOk",
    "LeaseInfo",
    "ModelInfo",
    "Phase",
    "Preload",
    "Preloaded",
    "Release",
    "Released",
    "Role",
    "SlabDescriptor",
    "State",
    "Status",
    "StatusReply",
    "TensorEntry",
    "TensorTable",
    "decode_body",
    "decode_frame",
    "pack_frame",
    "tensor_extent",
]
