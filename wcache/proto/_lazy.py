"""Names a module re-exports from modules it imports on first access (PEP 562), for ``wcache.proto`` and its
frame registry: an engine's restart imports only the modules whose names it reads."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

__all__ = ["export"]


def export(namespace: dict[str, Any], name: str, modules: Iterable[str]) -> Any:
    """``name`` from the first of ``modules`` whose ``__all__`` names it (each imported when reached), kept in
    ``namespace`` (a module's globals) so that later look-ups skip the module's ``__getattr__``; AttributeError
    when none exports it."""
    for module in modules:
        m = importlib.import_module(module)
        if name in m.__all__:
            value = getattr(m, name)
            namespace[name] = value
            return value
    raise AttributeError(f"module {namespace.get('__name__')!r} has no attribute {name!r}")
