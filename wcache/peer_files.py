"""A node without the checkpoint (docs/fleet.md): the checkpoint's small files travel from a source daemon, and
each safetensors file is written as a sparse **stub** — its real size, its header, and the key's sampled
fingerprint blocks at their offsets, holes elsewhere — so the key computed from the directory is the
checkpoint's, while no weights are ever downloaded.

A stub reads as zeros outside its header and samples, so it must never be loaded: the marker file
``wcache-peer-fill.json`` names every stub with its size and inode, and :func:`refuse_stubs` (the daemon's
loader, wcache's integrations' disk fallback) refuses a checkpoint any of whose safetensors files the marker
still describes. A file written over a stub (the real weights downloaded) is another inode: the marker no
longer applies to it. No torch, no NIXL: the standard library and wcache's file rules (wcache/files.py).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

from wcache.errors import CheckpointError
from wcache.files import open_regular
from wcache.plan.checkpoint import SAMPLE_BLOCK, _sample_offsets
from wcache.proto.fleet_frames import MAX_FILE_BYTES, PeerBlock, PeerFile

__all__ = ["MARKER", "checkpoint_files", "refuse_stub_dir", "refuse_stubs", "stub_names", "write_files"]

MARKER = "wcache-peer-fill.json"


def checkpoint_files(root: Path, *, budget: int = MAX_FILE_BYTES) -> list[PeerFile]:
    """What a source sends for PEER_FILES: every regular file of ``root`` (not hidden, not the marker) whole up
    to ``budget`` bytes in all, and every ``.safetensors`` file as its length prefix, header and sampled blocks.
    Other files that do not fit are left out (logged by the caller from what is missing)."""
    out: list[PeerFile] = []
    left = budget
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        name = entry.name
        if name.startswith(".") or name == MARKER or not entry.is_file():
            continue
        fd, st = open_regular(entry, what="checkpoint file")
        try:
            if name.endswith(".safetensors"):
                head = os.pread(fd, 8, 0)
                if len(head) < 8:
                    continue
                (hlen,) = struct.unpack("<Q", head)
                data = head + os.pread(fd, hlen, 8)
                start = len(data)
                blocks = tuple(
                    PeerBlock(offset=start + off, data=os.pread(fd, SAMPLE_BLOCK, start + off))
                    for off in _sample_offsets(st.st_size - start)
                )
                need = len(data) + sum(len(b.data) for b in blocks)
                if len(data) != 8 + hlen or need > left:
                    continue
                out.append(PeerFile(name=name, size=st.st_size, data=data, blocks=blocks))
                left -= need
            elif st.st_size <= left:
                data = os.pread(fd, st.st_size, 0)
                out.append(PeerFile(name=name, size=len(data), data=data))
                left -= len(data)
        finally:
            os.close(fd)
    return out


def write_files(root: Path, files: Sequence[PeerFile]) -> list[str]:
    """Write a source's files into ``root`` (created 0755 if missing; a file already there is left alone) and
    record the stubs in the marker. Returns the names written. Each file is written to a temporary name and
    renamed, so an interrupted write leaves no half file under a checkpoint name."""
    root.mkdir(parents=True, exist_ok=True)
    marker = _read_marker(root)
    written: list[str] = []
    for f in files:
        dest = root / f.name
        if dest.exists() or dest.is_symlink():
            continue
        tmp = root / f".{f.name}.wcache-tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            os.pwrite(fd, f.data, 0)
            for b in f.blocks:
                os.pwrite(fd, b.data, b.offset)
            os.ftruncate(fd, f.size)  # the rest is a hole: a stub's apparent size is the real file's
            st = os.fstat(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
        if f.size > len(f.data) + sum(len(b.data) for b in f.blocks):
            marker[f.name] = {"size": f.size, "inode": st.st_ino, "device": st.st_dev}
        written.append(f.name)
    if marker:
        tmp = root / f".{MARKER}.wcache-tmp"
        tmp.write_text(json.dumps({"stubs": marker}, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, root / MARKER)
    return written


def _read_marker(root: Path) -> dict[str, dict[str, int]]:
    try:
        data = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    stubs = data.get("stubs") if isinstance(data, dict) else None
    return {k: v for k, v in stubs.items() if isinstance(v, dict)} if isinstance(stubs, dict) else {}


def stub_names(root: Path) -> set[str]:
    """Files of ``root`` that are still the stubs the marker recorded (same inode, device and size)."""
    out = set()
    for name, rec in _read_marker(root).items():
        try:
            st = os.stat(root / name)
        except OSError:
            continue
        if (st.st_ino, st.st_dev, st.st_size) == (rec.get("inode"), rec.get("device"), rec.get("size")):
            out.add(name)
    return out


def refuse_stubs(root: Path, files: Sequence[Path]) -> None:
    """CheckpointError when any of ``files`` is a peer-fill stub: its weights were never downloaded."""
    stubs = stub_names(root)
    hit = [f.name for f in files if f.name in stubs]
    if hit:
        raise CheckpointError(
            f"{root}: {', '.join(hit[:3])}{' ...' if len(hit) > 3 else ''} hold no weights: this directory was filled "
            f"from a peer daemon ({MARKER}; docs/fleet.md, 'A node without the checkpoint'). Fill from a peer again "
            "(--fill-from), or download the weights into it",
            details={"stubs": hit},
        )


def refuse_stub_dir(root: str | os.PathLike[str]) -> None:
    """``refuse_stubs`` for every safetensors file of a directory (an engine's own disk fallback)."""
    d = Path(root)
    if (d / MARKER).exists():
        refuse_stubs(d, sorted(d.glob("*.safetensors")))
