"""Names a module re-exports from modules it imports on first access (PEP 562), for ``wcache.proto`` and its
frame registry: an engine's restart imports only the modules whose names it reads."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

__all__ = ["export"]

_ABSENT = object()


def export(namespace: dict[str, Any], name: str, modules: Iterable[str]) -> Any:
    """``name`` from the first of ``modules`` (imported here) that has it, kept in ``namespace`` (a module's
    globals) so that later look-ups skip the module's ``__getattr__``; AttributeError when none has it."""
    for module in modules:
        value = getattr(importlib.import_module(module), name, _ABSENT)
        if value is not _ABSENT:
            namespace[name] = value
            return value
    raise AttributeError(f"module {namespace.get('__name__')!r} has no attribute {name!r}")
