"""A node without the checkpoint (docs/fleet.md): the checkpoint's small files travel from a source daemon, and
each safetensors file is written as a sparse **stub** — its real size, its header, and the key's sampled
fingerprint blocks at their offsets, holes elsewhere — so the key computed from the directory is the
checkpoint's, while no weights are ever downloaded.

A stub reads as zeros outside its header and samples, so it must never be loaded: the marker file
``wcache-peer-fill.json`` names every stub with its size and a few probe windows of the bytes the stub leaves
unwritten (zeros there), and :func:`refuse_stubs` (the daemon's loader, wcache's integrations' disk fallback)
refuses a checkpoint any of whose safetensors files the marker names and that still reads as zeros in those
windows: the stub itself, and any copy of it. A file the real weights were written into (downloaded over the
stub, in place or not) holds them there: the marker no longer applies to it. No torch, no NIXL: the standard
library and wcache's file rules (wcache/files.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

from wcache.errors import CheckpointError
from wcache.files import open_regular
from wcache.plan.checkpoint import INDEX_NAME, MAX_HEADER, SAMPLE_BLOCK, _sample_offsets
from wcache.proto.fleet_frames import MAX_FILE_BYTES, STUB_MARKER, PeerBlock, PeerFile

__all__ = [
    "MARKER",
    "checkpoint_files",
    "fill_incomplete",
    "probes",
    "refuse_stub_dir",
    "refuse_stubs",
    "staging_dir",
    "stub_names",
    "write_files",
]

MARKER = STUB_MARKER

log = logging.getLogger("wcache.fleet")


def checkpoint_files(root: Path, *, budget: int = MAX_FILE_BYTES) -> list[PeerFile]:
    """What a source sends for PEER_FILES: every regular file of ``root`` (not hidden, not the marker) whole up
    to ``budget`` bytes in all, and every ``.safetensors`` file as its length prefix, header and sampled blocks.
    Other files that do not fit are left out (logged by the caller from what is missing).

    Whoever may write into the checkpoint directory (a shared model store) must not make the daemon send what is
    not the checkpoint's, nor make it read more than the budget (docs/security.md, "Checkpoint files"). So a file
    is **skipped** — never the whole answer — when what was opened (the link followed) lies outside ``root``
    (:func:`_sendable_roots`: a Hugging Face snapshot's ``blobs`` too), when others may not read it and it is not
    one of the files the key reads (:func:`_keyed`: the daemon's secret and TLS key are not world-readable), when
    it cannot be read (gone, unreadable), or when a ``.safetensors`` length prefix claims a header over safetensors' own cap or past the
    file's end — checked before anything past the prefix is read; a header over the budget left is left out
    unread. One log line names what was skipped."""
    out: list[PeerFile] = []
    left = budget
    inside = _sendable_roots(root)
    skipped: dict[str, list[str]] = {}
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        name = entry.name
        if name.startswith(".") or name == MARKER or not entry.is_file():
            continue
        try:
            fd, st = open_regular(entry, what="checkpoint file")
        except CheckpointError:  # gone since it was listed, unreadable, swapped for something else
            skipped.setdefault("unreadable", []).append(name)
            continue
        why: str | None = None
        try:
            why = _why_not_sent(entry, fd, st, inside)
            if why is None and name.endswith(".safetensors"):
                head = os.pread(fd, 8, 0)
                if len(head) < 8:
                    continue
                (hlen,) = struct.unpack("<Q", head)
                if hlen > MAX_HEADER or 8 + hlen > st.st_size:
                    why = "bad safetensors header length"
                elif 8 + hlen > left:
                    continue  # does not fit what is left: left out, as any file that does not fit
                else:
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
            elif why is None and st.st_size <= left:
                data = os.pread(fd, st.st_size, 0)
                out.append(PeerFile(name=name, size=len(data), data=data))
                left -= len(data)
        except OSError:  # a read that fails (an I/O error, a file on a mount gone away)
            why = "unreadable"
        finally:
            os.close(fd)
        if why is not None:
            skipped.setdefault(why, []).append(name)
    if skipped:
        log.warning(
            "peer files skipped dir=%s %s",
            root,
            " ".join(f"{why.replace(' ', '_')}={_few(names)}" for why, names in sorted(skipped.items())),
        )
    return out


def _sendable_roots(root: Path) -> tuple[Path, ...]:
    """The directories a file sent from checkpoint directory ``root`` may really lie in: ``root`` itself (links
    followed) and, when ``root`` is a Hugging Face cache snapshot (``<repo>/snapshots/<revision>``, a directory of
    links to ``../../blobs/<hash>``), its repository's ``blobs``."""
    real = root.resolve()
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append((real.parent.parent / "blobs").resolve())
    return tuple(roots)


def _why_not_sent(entry: Path, fd: int, st: os.stat_result, inside: Sequence[Path]) -> str | None:
    """Why the file ``entry`` open at ``fd`` (``st`` its fstat) is not sent: it lies outside every directory of
    ``inside`` (the path of what was opened, not of the link, so a link swapped after the check changes nothing),
    or others may not read it and it is not one of the files the key reads (:func:`_keyed`). None to send it."""
    try:
        real = Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:  # no /proc: where the link leads now, if that is still the file that was opened
        real = entry.resolve()
        try:
            now = real.stat()
        except OSError:
            return "unreadable"
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return "unreadable"
    if not any(real.is_relative_to(d) for d in inside):
        return "outside the checkpoint directory"
    if not st.st_mode & stat.S_IROTH and not _keyed(entry.name):
        return "not world-readable"
    return None


def _keyed(name: str) -> bool:
    """Whether ``name`` is one of the files a checkpoint's key reads (``config.json``, the index, a
    ``.safetensors`` file): the checkpoint itself, sent however private (a checkpoint downloaded under umask 077),
    and checked against the key on the target; only the other files must be world-readable to be sent."""
    return name in ("config.json", INDEX_NAME) or name.endswith(".safetensors")


def _few(names: Sequence[str], shown: int = 5) -> str:
    """``names`` for a log line: the first ``shown``, and how many more."""
    text = ",".join(names[:shown])
    return text + (f",+{len(names) - shown}_more" if len(names) > shown else "")


#: a stub's probes: windows of its data region that only the real weights fill (a stub holds zeros there)
PROBES, PROBE_BYTES = 4, 4096


def probes(f: PeerFile) -> list[tuple[int, int]]:
    """(offset, length) of up to ``PROBES`` windows of ``f``'s stub that it leaves unwritten — outside its header
    and its sampled blocks —, spread evenly over them. Empty when the stub writes the whole file (no stub then)."""
    gaps: list[tuple[int, int]] = []
    at = len(f.data)
    for b in sorted(f.blocks, key=lambda b: b.offset):
        if b.offset > at:
            gaps.append((at, b.offset))
        at = max(at, b.offset + len(b.data))
    if f.size > at:
        gaps.append((at, f.size))
    total = sum(e - s for s, e in gaps)
    out: list[tuple[int, int]] = []
    for i in range(PROBES if total else 0):
        want = total * (2 * i + 1) // (2 * PROBES)  # the middle of the i-th of PROBES equal parts of the gaps
        for s, e in gaps:
            if want < e - s:
                out.append((s + want, min(PROBE_BYTES, e - s - want)))
                break
            want -= e - s
    return sorted(set(out))


def staging_dir(root: Path) -> Path:
    """Where ``write_files`` stages a peer's files: a hidden directory beside ``root`` (the same filesystem, so the
    files are renamed into ``root``, never copied), named by a hash of ``root``'s name (which may be 255 bytes)."""
    return root.parent / f".wcache-fill-{hashlib.sha256(os.fsencode(root.name)).hexdigest()[:16]}"


def write_files(root: Path, files: Sequence[PeerFile], check: Callable[[Path], None] | None = None) -> list[str]:
    """Write a source's files into ``root`` (created 0755 if missing) as one set. They are written into a staging
    directory beside ``root`` (``staging_dir``) first, and ``check(staging)`` — the caller's test that they give
    the key it asked for — runs there: whatever it raises (or a write failing: a full disk, a name too long, a size
    past the filesystem's limit) leaves ``root`` as it was and the staging directory removed. Only then are they
    renamed into ``root``: the marker first, naming every stub and every file of the set and saying the set is not
    complete; then the files; then the marker again, saying it is — written last, so a fill cut short by a crash
    leaves no stub the marker does not name, and a directory ``fill_incomplete`` tells a later start to fetch
    again. A file ``root`` holds already is kept when it is the one the peer sends (its size, and its bytes where
    the peer sends them: a stub, or the real weights downloaded over one), and replaced otherwise; a stub the marker
    names that the set no longer has (a cut-short fill of another checkpoint) is removed. Returns the names written.
    Whatever is at a name written (a link planted there) is replaced, never followed (``_create``). ValueError,
    before anything is written, for a file named as the marker (a PeerFile refuses that name; this is the last line
    of that rule: written over the marker, it would unname the stubs, and their zeros would be loaded as
    weights)."""
    if any(f.name == MARKER for f in files):
        raise ValueError(f"a peer's file is named {MARKER!r}, the stub marker's name")
    root.mkdir(parents=True, exist_ok=True)
    stage = staging_dir(root)
    _discard(stage)  # what a crashed fill left
    os.mkdir(stage, 0o700)
    try:
        for f in files:
            fd = _create(stage / f.name)
            try:
                os.pwrite(fd, f.data, 0)
                for b in f.blocks:
                    os.pwrite(fd, b.data, b.offset)
                os.ftruncate(fd, f.size)  # the rest is a hole: a stub's apparent size is the real file's
            finally:
                os.close(fd)
        if check is not None:
            check(stage)
        old = _read_marker(root)
        names = sorted(f.name for f in files)
        stubs = {n: rec for n, rec in old.items() if n in names or not _gone_stub(root / n, rec)}
        for f in files:
            windows = probes(f)
            if windows:
                stubs[f.name] = {"size": f.size, "probes": [list(w) for w in windows]}
        for n in set(old) - set(stubs):  # a stub of an earlier, cut-short fill that this set does not have
            (root / n).unlink(missing_ok=True)  # (while the marker still names it)
        _write_marker(root, stubs, names, complete=False)  # before any stub is in root
        written: list[str] = []
        for f in files:
            if not _same(root / f.name, f):
                os.replace(stage / f.name, root / f.name)
                written.append(f.name)
        _write_marker(root, stubs, names, complete=True)  # last: the whole set is in root
        return written
    finally:
        _discard(stage)


def fill_incomplete(root: Path) -> bool:
    """Whether ``root`` holds a fill of a peer's files that was cut short (a crash, a full disk): its marker does
    not say the set is complete, or a file it names is missing. A marker an older wcache wrote (no set recorded)
    counts as complete once none of its stubs is missing. Such a directory is fetched again (``write_files``)."""
    try:
        data = json.loads((root / MARKER).read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True
    if not isinstance(data, dict):
        return True
    names = data.get("files")
    if names is None and "complete" not in data:  # an older marker: its stubs, all of them there
        return any(not (root / n).exists() for n in _stubs_of(data))
    if data.get("complete") is not True or not isinstance(names, list):
        return True
    return any(not (isinstance(n, str) and (root / n).exists()) for n in names)


def _write_marker(root: Path, stubs: dict[str, dict[str, object]], names: list[str], *, complete: bool) -> None:
    tmp = root / f".wcache-{os.getpid()}.tmp"
    text = json.dumps({"complete": complete, "files": names, "stubs": stubs}, indent=1, sort_keys=True) + "\n"
    fd = _create(tmp)
    try:
        with open(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, root / MARKER)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _same(path: Path, f: PeerFile) -> bool:
    """Whether ``path`` is the file ``f`` stands for: its size, and the bytes ``f`` carries at their offsets."""
    try:
        fd, st = open_regular(path, what="checkpoint file")
    except (OSError, CheckpointError):
        return False
    try:
        return (
            st.st_size == f.size
            and os.pread(fd, len(f.data), 0) == f.data
            and all(os.pread(fd, len(b.data), b.offset) == b.data for b in f.blocks)
        )
    except OSError:
        return False
    finally:
        os.close(fd)


def _gone_stub(path: Path, rec: dict[str, object]) -> bool:
    """A stub the marker names that is missing or still reads as a stub: an earlier fill's, to be removed."""
    return not path.exists() or _still_stub(path, rec)


def _discard(path: Path) -> None:
    """Remove a staging directory (a link planted at its name: the link, never what it points to)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _create(path: Path) -> int:
    """A new file at ``path``, open for writing (0644). Whatever is at the name — a temporary file a crash left
    (a container's daemon has the same pid at every start), or a symbolic link planted there — is removed, never
    followed, and the file is created anew (O_EXCL, O_NOFOLLOW): the marker's temporary file was written with
    ``write_text``, which wrote through a link planted at its name into the file it named."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)


def _read_marker(root: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return _stubs_of(data)


def _stubs_of(data: object) -> dict[str, dict[str, object]]:
    """The stub records of a parsed marker (none where it is not one)."""
    stubs = data.get("stubs") if isinstance(data, dict) else None
    return {k: v for k, v in stubs.items() if isinstance(v, dict)} if isinstance(stubs, dict) else {}


def _still_stub(path: Path, rec: dict[str, object]) -> bool:
    """Whether ``path`` still holds a stub's zeros in every probe window the marker recorded: a file the real
    weights were written into (in place, or as another file) has them there; a stub — the one written, or a copy
    of it (``cp -r``, rsync, a restore: another inode, holes or not) — has zeros. A record without probes (an
    older marker) or a file it cannot read counts as a stub: refused, never served as zeros."""
    windows = rec.get("probes")
    try:
        fd, st = open_regular(path, what="checkpoint file")
    except (OSError, CheckpointError):
        return path.exists()
    try:
        if st.st_size != rec.get("size"):
            return False  # another file under the name: not the stub's size
        if not isinstance(windows, list) or not windows:
            return True
        for w in windows:
            if not (isinstance(w, list) and len(w) == 2 and all(type(x) is int and x >= 0 for x in w)):
                return True
            if os.pread(fd, w[1], w[0]).count(0) != w[1]:
                return False
        return True
    finally:
        os.close(fd)


def stub_names(root: Path) -> set[str]:
    """Files of ``root`` that the marker names and that still read as its stubs (``_still_stub``)."""
    return {name for name, rec in _read_marker(root).items() if _still_stub(root / name, rec)}


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
