"""The protocol's version, vocabularies and limits (docs/protocol.md §3, §4, §7): the numbers every layer of the
protocol shares, in a module that imports nothing.

The frame declarations (``fields``, ``daemon_frames``), the connection, the tensor table and an engine's own frames
(``engine``) read them here, so that an engine's restart has them without the declarations.
"""

from __future__ import annotations

__all__ = [
    "BACKENDS",
    "INT32_MAX",
    "INT64_MAX",
    "MAX_BIN",
    "MAX_DEPOSIT_TENSORS",
    "MAX_DEVICE_INDEX",
    "MAX_DIMS",
    "MAX_FD_POSITION",
    "MAX_FILE_NAME",
    "MAX_FRAME_FDS",
    "MAX_KEY_CHARS",
    "MAX_KEY_FIELDS",
    "MAX_NAME",
    "MAX_PATH",
    "MAX_PENDING",
    "MAX_PROOF_FILES",
    "MAX_STATE_SLABS",
    "MAX_VERSIONS",
    "MAX_WIRE_FRAME_SIZE",
    "MODES",
    "PROTOCOL_VERSION",
    "SLAB_KINDS",
    "SUPPORTED_VERSIONS",
]

#: The protocol version this implementation speaks (docs/protocol.md §3).
PROTOCOL_VERSION = 2
SUPPORTED_VERSIONS: tuple[int, ...] = (PROTOCOL_VERSION,)
#: Where a daemon keeps slabs: host shared memory or GPU memory.
BACKENDS = ("host", "cuda")
MODES = ("zero_copy", "copy")
#: How a slab is exported: a shared-memory fd, a legacy CUDA IPC handle, or a CUDA VMM fd.
SLAB_KINDS = ("memfd", "cuda_ipc", "cuda_vmm")
MAX_VERSIONS = 16
MAX_STATE_SLABS = 1024
#: Descriptors one frame may carry: they ride one SCM_RIGHTS message on its first byte, and every receiver reads
#: with room for this many (docs/protocol.md §2.2) — more would arrive truncated. STATE, TAKEOVER_STATE, KEEP and
#: RECLAIMED are bounded by it; DEPOSIT_SLAB carries one.
MAX_FRAME_FDS = 16
#: Files one GET_STATE proof may list (docs/protocol.md §4.3.1), and the length of one file name (a directory
#: entry: 255 bytes on Linux filesystems, so 255 characters at most).
MAX_PROOF_FILES = 1024
MAX_FILE_NAME = 255
#: Tensors in one DEPOSIT (its frame is also capped at the 1 MiB request size, docs/protocol.md §7); STATE's
#: ``buffers`` name deposited tensors.
MAX_DEPOSIT_TENSORS = 1 << 16
MAX_NAME = 1024  # characters of a tensor name or key string
MAX_PATH = 4096  # characters of a file system path
#: fields of one key (a checkpoint key has 9; a recipe adds its engine's, vLLM's about 8: docs/protocol.md §7)
MAX_KEY_FIELDS = 64
#: characters of one key's field names and string values together (each is also at most MAX_NAME)
MAX_KEY_CHARS = 16384
#: dimensions of one tensor (docs/protocol.md §4.6)
MAX_DIMS = 16
INT32_MAX = 2**31 - 1  # a protocol version's, an ERROR code's bound
INT64_MAX = 2**63 - 1  # an integer field's bound unless its declaration says otherwise
#: bytes of a bin field unless its declaration says otherwise (a slab's legacy IPC handle)
MAX_BIN = 4096
#: a CUDA device ordinal (HELLO_OK's DeviceInfo.index)
MAX_DEVICE_INDEX = 1 << 16
#: the last position a slab's descriptor may have among a frame's (SCM_RIGHTS carries at most 253)
MAX_FD_POSITION = 253
#: HELLO_OK's max_frame_size: what the 4-byte length prefix can announce
MAX_WIRE_FRAME_SIZE = 2**32 - 1
#: How many requests may wait for a reply on one connection.
MAX_PENDING = 64
