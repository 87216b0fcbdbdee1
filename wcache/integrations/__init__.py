"""Integrations with inference frameworks (each imports its framework lazily).

``wcache.integrations.transformers`` and ``wcache.integrations.vllm`` are imported on first access (PEP 562), so
``wcache.integrations.transformers.from_pretrained(...)`` works after a plain ``import wcache``; importing this
package loads neither."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wcache.integrations import transformers as transformers
    from wcache.integrations import vllm as vllm

#: the integration modules, imported when first read as attributes of this package
_SUBMODULES = frozenset({"transformers", "vllm"})


def __getattr__(name: str) -> Any:
    if name not in _SUBMODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    home = f"{__name__}.{name}"
    __import__(home)  # the import system sets the attribute on this package
    return sys.modules[home]


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SUBMODULES)
