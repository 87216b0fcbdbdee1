"""The wcache wire protocol, pure: no asyncio, sockets or torch (docs/protocol.md).

Layers, each importing only those above it (docs/architecture.md): ``limits`` (the version, vocabularies and
limits), ``codec`` (length prefix + msgpack), ``table`` (the columnar tensor table), ``fields`` (field kinds, the
one generic encoder/decoder, and each frame's declaration), ``daemon_frames`` (an engine's frames), ``admin_frames``,
``deposit_frames``, ``peer_frames`` and ``fleet_frames`` (the others, by use), ``frames`` (the registry and
``decode_frame``), ``connection`` (the per-connection state machine, derived from the frames' declarations:
which service, which phase, which descriptors). Bytes in, typed frames out.

Its names are those of ``codec``, ``connection``, ``frames`` and every frame module (their ``__all__``), each
imported on first access (PEP 562) from the module that defines it: ``import wcache.proto`` loads nothing, and
an engine's restart loads only the modules its frames need.
"""

# ruff: noqa: F403  (the star imports give the type checker the names __getattr__ gives at run time)
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wcache.proto.admin_frames import *
    from wcache.proto.codec import *
    from wcache.proto.connection import *
    from wcache.proto.daemon_frames import *
    from wcache.proto.deposit_frames import *
    from wcache.proto.fleet_frames import *
    from wcache.proto.frames import *
    from wcache.proto.peer_frames import *

#: the modules whose names are this package's, searched in this order (then the frame modules)
_MODULES = ("wcache.proto.codec", "wcache.proto.connection", "wcache.proto.frames")


def _modules() -> tuple[str, ...]:
    from wcache.proto.frames import FRAME_MODULES

    return _MODULES + FRAME_MODULES


def __getattr__(name: str) -> Any:
    """A name of ``_MODULES`` or of a frame module, imported when first read; ``__all__``: all of them (every
    module imported)."""
    import importlib
    import importlib.util

    if name == "__all__":
        return sorted({n for m in _modules() for n in importlib.import_module(m).__all__})
    if (
        name.startswith("__")
        or os.path.isfile(os.path.join(os.path.dirname(__file__), f"{name}.py"))  # a stat: find_spec costs ~0.1 ms
        or importlib.util.find_spec(f"{__name__}.{name}") is not None
    ):
        # __path__, or a submodule a from-import looks for before it imports it: nothing to import for them
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from wcache.proto._lazy import export  # not at import: an engine's path reads no name here

    return export(globals(), name, _modules())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__getattr__("__all__")))
