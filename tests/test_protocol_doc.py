"""docs/protocol.md reads in order: its sections are numbered in the order they appear, and every "§N.M" that
the docs, the README and the code cite names a section that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "protocol.md"


def _numbers() -> list[tuple[int, ...]]:
    return [
        tuple(int(p) for p in m.split(".")) for m in re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", DOC.read_text(), re.M)
    ]


def test_sections_are_numbered_in_the_order_they_appear() -> None:
    numbers = _numbers()
    assert len(numbers) > 20
    assert numbers == sorted(numbers), [n for n, m in zip(numbers, numbers[1:]) if n > m]


def test_every_cited_section_exists() -> None:
    known = {".".join(map(str, n)) for n in _numbers()}
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "wcache").rglob("*.py")]
    cited = {(f.relative_to(ROOT).as_posix(), s) for f in files for s in re.findall(r"§(\d+(?:\.\d+)?)", f.read_text())}
    assert sorted((f, s) for f, s in cited if s not in known) == []
