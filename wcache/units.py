"""Sizes on the command line: ``16G``, ``512MiB``, ``1.5GB``, ``4096`` — one parser for every size option, and
one way sizes are written for people (``format_size``: ``16.06 GB``, ``96.9 MB``).

Suffixes are case-insensitive. ``K``/``M``/``G``/``T`` and their ``i`` forms (``KiB``, ``MiB`` ...)
are powers of 1024, the way memory is sized; ``KB``/``MB``/``GB``/``TB`` are powers of 1000, the way
disks and the README's GB figures are. A bare number is bytes.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["format_size", "parse_size", "size_arg"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "ti": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes for ``text``; raises ValueError naming the accepted forms."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size: use bytes or a number with K/M/G/T (x1024: also KiB/MiB/GiB/TiB) or KB/MB/GB/TB (x1000), e.g. 16G or 512MiB"
        )
    return int(float(m.group(1)) * _UNITS[unit]) if "." in m.group(1) else int(m.group(1)) * _UNITS[unit]


def size_arg(text: str) -> int:
    """argparse ``type=`` for a size option."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_size(n: int) -> str:
    """``n`` bytes for people: ``16.06 GB``, ``96.9 MB``, ``12.3 KB``, ``512 bytes`` (powers of 1000, as KB/MB/GB
    parse): ``wcache status``'s sizes and the daemon's size errors, which give the exact bytes beside it."""
    if n >= 10**9:
        return f"{n / 1e9:.2f} GB"
    if n >= 10**6:
        return f"{n / 1e6:.1f} MB"
    if n >= 10**3:
        return f"{n / 1e3:.1f} KB"
    return f"{n} bytes"
