"""A node without the checkpoint (wcache/peer_files.py): what makes a file a stub that is never loaded. A stub holds
zeros outside its header and sampled blocks; the marker names it with probe windows of those zeros, so the stub
and every copy of it are refused, and a file the real weights were written into is not."""

from __future__ import annotations

import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from wcache.errors import CheckpointError
from wcache.peer_files import (
    MARKER,
    checkpoint_files,
    fill_incomplete,
    probes,
    refuse_stubs,
    staging_dir,
    stub_names,
    write_files,
)
from wcache.proto.fleet_frames import PeerBlock, PeerFile

SIZE = 1 << 20


def _real() -> bytes:
    """The real file: a header, then weights (no zeros)."""
    return b"HEADER" + bytes((i * 7 + 1) % 255 + 1 for i in range(SIZE - 6))


def _stub_of(real: bytes, name: str = "model.safetensors") -> PeerFile:
    """What a source sends of ``real``: its first bytes and two sampled blocks."""
    blocks = tuple(PeerBlock(offset=o, data=real[o : o + 4096]) for o in (100_000, 700_000))
    return PeerFile(name=name, size=len(real), data=real[:6], blocks=blocks)


# What a source sends (checkpoint_files): a checkpoint directory may be written by others (a shared model store),
# so what is sent is the checkpoint's own files, read within the budget, and a stray file is skipped, not fatal.


def _source_dir(tmp_path: Path) -> Path:
    """A small checkpoint directory as a source serves it: config.json and one safetensors file."""
    src = tmp_path / "store" / "model"
    src.mkdir(parents=True)
    (src / "config.json").write_text('{"model_type": "llama"}')
    header = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(range(16)))
    return src


def test_a_link_out_of_the_checkpoint_directory_and_a_private_file_are_not_sent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file planted as ``notes.txt -> <the daemon's --peer-secret-file>`` (or its TLS key) by whoever may write
    the model store was read through the link and sent, and the target wrote it 0644. What the link leads out of
    the directory to is not sent, world-readable or not, and neither is a file others may not read; the
    checkpoint's own files still are, and one log line names what was skipped."""
    src = _source_dir(tmp_path)
    secret = tmp_path / "peer.secret"
    secret.write_bytes(b"fleet-shared-secret\n")
    os.chmod(secret, 0o600)
    public = tmp_path / "elsewhere.json"
    public.write_text("{}")
    (src / "notes.txt").symlink_to(secret)
    (src / "other.json").symlink_to(public)
    (src / "private.txt").write_text("mine")
    os.chmod(src / "private.txt", 0o600)
    (src / "sub").mkdir()
    (src / "inner.json").symlink_to(Path("sub") / "x.json")  # a link that stays inside is followed
    (src / "sub" / "x.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="wcache.fleet"):
        files = checkpoint_files(src)
    assert sorted(f.name for f in files) == ["config.json", "inner.json", "model.safetensors"]
    (line,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert "notes.txt" in line and "other.json" in line and "private.txt" in line


def test_a_private_checkpoints_own_files_are_sent(tmp_path: Path) -> None:
    """A checkpoint downloaded under umask 077: the files its key reads (config.json, the safetensors files) are
    the checkpoint and are sent however private (the target checks them against the key); another private file
    beside them is not."""
    src = _source_dir(tmp_path)
    (src / "tokenizer.json").write_text("{}")
    for p in src.iterdir():
        os.chmod(p, 0o600)
    assert sorted(f.name for f in checkpoint_files(src)) == ["config.json", "model.safetensors"]


def test_a_hugging_face_snapshots_links_into_its_blobs_are_sent(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot (``<repo>/snapshots/<revision>``) is a directory of links to
    ``../../blobs/<hash>``: those are the checkpoint's files and are sent; a link out of the repository is not."""
    repo = tmp_path / "hub" / "models--org--tiny"
    real = _source_dir(tmp_path)
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for i, p in enumerate(sorted(real.iterdir())):
        shutil.copy(p, repo / "blobs" / f"hash{i}")
        (snap / p.name).symlink_to(Path("..") / ".." / "blobs" / f"hash{i}")
    (tmp_path / "hub" / "secret").write_text("x")
    (snap / "notes.txt").symlink_to(tmp_path / "hub" / "secret")
    files = checkpoint_files(snap)
    assert sorted(f.name for f in files) == ["config.json", "model.safetensors"]
    assert {f.name: f.data for f in files}["config.json"] == (real / "config.json").read_bytes()


def _counting_preads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of every ``os.pread`` from here on, in order."""
    reads: list[int] = []
    pread = os.pread

    def counting(fd: int, n: int, off: int) -> bytes:
        reads.append(n)
        return pread(fd, n, off)

    monkeypatch.setattr(os, "pread", counting)
    return reads


@pytest.mark.parametrize("hlen", [256 << 20, 2**62, 2**64 - 1])
def test_a_safetensors_length_prefix_past_its_file_is_skipped_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hlen: int
) -> None:
    """A planted ``.safetensors`` whose 8-byte length prefix claims a header as long as the (sparse) file, or
    longer than any file (2**62: MemoryError; 2**64-1: OverflowError, and every PEER_FILES answer failed): the
    header was read whole, before any budget check. It is skipped unread, and the other files are sent."""
    src = _source_dir(tmp_path)
    with open(src / "zz-planted.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", hlen))
        if hlen == 256 << 20:
            fh.truncate(8 + hlen)  # sparse: no disk used
    reads = _counting_preads(monkeypatch)
    files = checkpoint_files(src)
    assert sorted(f.name for f in files) == ["config.json", "model.safetensors"]
    assert max(reads) <= 1 << 20, f"a pread of {max(reads)} bytes for a file that is not sent"


def test_a_header_over_the_budget_left_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A header that fits its file but not the budget left is left out before it is read, as a file too large."""
    src = _source_dir(tmp_path)
    reads = _counting_preads(monkeypatch)
    files = checkpoint_files(src, budget=40)  # config.json (23 bytes) fits; the 8 + 57 byte header does not
    assert [f.name for f in files] == ["config.json"]
    assert all(n <= 23 for n in reads)


def test_a_file_that_cannot_be_read_is_skipped_not_the_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file gone (or unreadable) between the listing and the open, or whose read fails, is skipped: the others
    are sent."""
    import wcache.peer_files as pf
    from wcache.files import open_regular as opened

    src = _source_dir(tmp_path)
    (src / "gone.json").write_text("{}")
    (src / "eio.json").write_text("{}")

    def flaky(path: Path, **kw: Any) -> tuple[int, os.stat_result]:
        if path.name == "gone.json":
            raise CheckpointError(f"{path}: no such file")
        return opened(path, **kw)

    pread = os.pread
    eio = os.open(src / "eio.json", os.O_RDONLY)
    eio_ino = os.fstat(eio).st_ino
    os.close(eio)

    def failing(fd: int, n: int, off: int) -> bytes:
        if os.fstat(fd).st_ino == eio_ino:
            raise OSError(5, "Input/output error")
        return pread(fd, n, off)

    monkeypatch.setattr(pf, "open_regular", flaky)
    monkeypatch.setattr(os, "pread", failing)
    assert sorted(f.name for f in checkpoint_files(src)) == ["config.json", "model.safetensors"]


def test_the_probes_lie_where_the_stub_writes_nothing() -> None:
    f = _stub_of(_real())
    windows = probes(f)
    assert len(windows) == 4
    written = [(0, 6), *((b.offset, len(b.data)) for b in f.blocks)]
    for off, n in windows:
        assert off >= 6 and off + n <= SIZE and n > 0
        assert all(off + n <= s or e <= off for s, e in ((s, s + m) for s, m in written))
    whole = PeerFile(name="small", size=6, data=b"HEADER")
    assert probes(whole) == []  # a file the source sends whole is no stub


def test_a_stub_and_its_copies_are_refused_and_the_real_weights_are_not(tmp_path: Path) -> None:
    real = _real()
    node = tmp_path / "node"
    assert write_files(node, [_stub_of(real), PeerFile(name="config.json", size=2, data=b"{}")]) == [
        "model.safetensors",
        "config.json",
    ]
    stub = node / "model.safetensors"
    assert stub.stat().st_size == SIZE and stub_names(node) == {"model.safetensors"}
    with pytest.raises(CheckpointError, match="hold no weights"):
        refuse_stubs(node, [stub])
    # a copy of the directory (another inode; sparse or not): still the stub's zeros, still refused
    for sparse in (True, False):
        copy = tmp_path / f"copy-{sparse}"
        if sparse:
            shutil.copytree(node, copy)
        else:
            copy.mkdir()
            for f in node.iterdir():
                (copy / f.name).write_bytes(f.read_bytes())  # every byte written: no holes
        assert stub_names(copy) == {"model.safetensors"}
    # the real weights written over the stub in place (same inode, as cp, curl -o and wget -O do): served
    ino = stub.stat().st_ino
    with open(stub, "r+b") as fh:
        fh.write(real)
    assert stub.stat().st_ino == ino and stub_names(node) == set()
    refuse_stubs(node, [stub])
    # or downloaded as another file renamed over it
    other = tmp_path / "other"
    write_files(other, [_stub_of(real)])
    (other / "dl.tmp").write_bytes(real)
    os.replace(other / "dl.tmp", other / "model.safetensors")
    assert stub_names(other) == set()


def test_a_write_cut_short_leaves_nothing_in_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files are written into a staging directory beside the node's first: a write that fails half way (a full
    disk, a size past the filesystem's limit, a name too long) leaves the node's directory as it was and the
    staging directory removed — no stub, named or not, and no temporary file."""
    real = _real()
    node = tmp_path / "node"
    ftruncate = os.ftruncate
    calls = []

    def failing(fd: int, size: int) -> None:
        calls.append(size)
        if len(calls) == 2:
            raise OSError(27, "File too large")
        ftruncate(fd, size)

    monkeypatch.setattr(os, "ftruncate", failing)
    files = [_stub_of(real, "model-00001-of-00002.safetensors"), _stub_of(real, "model-00002-of-00002.safetensors")]
    with pytest.raises(OSError, match="too large"):
        write_files(node, files)
    assert list(node.iterdir()) == [] and not staging_dir(node).exists()
    assert not fill_incomplete(node)


def _cut_short(node: Path, files: list[PeerFile], monkeypatch: pytest.MonkeyPatch, nth: int) -> None:
    """``write_files`` stopped (a crash, a full disk) at its ``nth`` rename into ``node``."""
    replace = os.replace
    calls: list[object] = []

    def failing(src: object, dst: object) -> None:
        if Path(str(dst)).parent == node and Path(str(dst)).name != MARKER:
            calls.append(dst)
            if len(calls) == nth:
                raise OSError(28, "No space left on device")
        replace(src, dst)  # type: ignore[arg-type]

    with monkeypatch.context() as m:
        m.setattr(os, "replace", failing)
        with pytest.raises(OSError, match="No space"):
            write_files(node, files)


def test_a_fill_cut_short_is_incomplete_until_written_again_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fill cut short after its first stub (config.json and that stub in the node's directory, the second
    missing) is marked incomplete — the marker naming every file of the set and saying so, the first stub named —
    so a later start fetches it again (``fill_incomplete``); before, its one ``*.safetensors`` passed for weights
    and the node never asked again. Written again, the files already there that are the peer's are kept, and the
    marker then says the set is complete."""
    real = _real()
    one, two = _stub_of(real, "model-00001-of-00002.safetensors"), _stub_of(real, "model-00002-of-00002.safetensors")
    files = [PeerFile(name="config.json", size=2, data=b"{}"), one, two]
    node = tmp_path / "node"
    _cut_short(node, files, monkeypatch, nth=3)
    assert sorted(p.name for p in node.iterdir()) == ["config.json", one.name, MARKER]
    assert stub_names(node) == {one.name} and fill_incomplete(node)
    ino = (node / one.name).stat().st_ino
    assert write_files(node, files) == [two.name]  # config.json and the first stub are the peer's: kept
    assert (node / one.name).stat().st_ino == ino
    assert not fill_incomplete(node) and stub_names(node) == {one.name, two.name}
    assert not staging_dir(node).exists()


def test_files_already_there_that_are_not_the_peers_are_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cut-short fill of another checkpoint (another config.json, a stub of another size, a stub the new set
    does not have): the new set's files replace them, and the stub it does not have is removed — the directory
    then holds the new set and the marker only."""
    real = _real()
    node = tmp_path / "node"
    old = [
        PeerFile(name="config.json", size=3, data=b"{1}"),
        _stub_of(real[:-4096]),
        _stub_of(real, "extra.safetensors"),
    ]
    _cut_short(node, old, monkeypatch, nth=3)
    new = [PeerFile(name="config.json", size=2, data=b"{}"), _stub_of(real)]
    assert write_files(node, new) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in node.iterdir()) == ["config.json", "model.safetensors", MARKER]
    assert (node / "config.json").read_bytes() == b"{}" and (node / "model.safetensors").stat().st_size == SIZE
    assert not fill_incomplete(node) and stub_names(node) == {"model.safetensors"}


def test_files_the_check_refuses_never_reach_the_directory(tmp_path: Path) -> None:
    """The caller's check (the key of the files, ``fetch_files``) runs on the staging directory: files it refuses
    are discarded with it, and the node's directory is left as it was."""
    node = tmp_path / "node"
    seen: list[list[str]] = []

    def refuse(staged: Path) -> None:
        seen.append(sorted(p.name for p in staged.iterdir()))
        raise CheckpointError("not the key asked for")

    with pytest.raises(CheckpointError, match="not the key"):
        write_files(node, [PeerFile(name="config.json", size=2, data=b"{}"), _stub_of(_real())], refuse)
    assert seen == [["config.json", "model.safetensors"]]
    assert list(node.iterdir()) == [] and not staging_dir(node).exists()


def test_a_checkpoint_name_of_255_bytes_is_written(tmp_path: Path) -> None:
    """The temporary name is short: a file name the filesystem takes is written (a temporary name of the file's
    own name and a suffix was too long for names over 243 bytes, and the fill failed)."""
    name = "n" * 250 + ".txt"
    assert write_files(tmp_path / "node", [PeerFile(name=name, size=3, data=b"abc")]) == [name]
    assert (tmp_path / "node" / name).read_bytes() == b"abc"


def test_a_peer_file_named_as_the_marker_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    """A peer's file named ``wcache-peer-fill.json`` was written over the marker that ``write_files`` had written
    first: the stubs were no longer named, and a daemon there loaded their zeros as weights. The frame refuses the
    name (a PEER_FILES_REPLY holding it does not decode), and ``write_files`` refuses it before writing anything."""
    from wcache.errors import RemoteProtocolError
    from wcache.proto.fleet_frames import PeerFilesReply

    hostile = PeerFile(name=MARKER, size=13, data=b'{"stubs": {}}')
    reply = PeerFilesReply(id=1, files=(_stub_of(_real()), hostile))
    with pytest.raises(RemoteProtocolError, match="stub marker"):
        PeerFilesReply.from_wire(reply.to_wire())
    node = tmp_path / "node"
    with pytest.raises(ValueError, match="stub marker"):
        write_files(node, [_stub_of(_real()), hostile])
    assert not node.exists() or not any(node.iterdir())


def test_links_planted_at_the_temporary_names_are_not_followed(tmp_path: Path) -> None:
    """Symbolic links planted at the temporary names ``write_files`` uses (the marker's ``.wcache-<pid>.tmp``, the
    staging directory beside the node's) are replaced, never written through: what they name is unchanged, and
    the marker and the stub are written as regular files. The marker's temporary file was written with
    ``write_text``, which followed the link."""
    node = tmp_path / "node"
    node.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    (node / f".wcache-{os.getpid()}.tmp").symlink_to(victim)
    victim_dir = tmp_path / "victim-dir"
    victim_dir.mkdir()
    (victim_dir / "model.safetensors").write_bytes(b"untouched")
    staging_dir(node).symlink_to(victim_dir)
    assert write_files(node, [_stub_of(_real())]) == ["model.safetensors"]
    assert victim.read_bytes() == b"untouched" and (victim_dir / "model.safetensors").read_bytes() == b"untouched"
    assert not staging_dir(node).exists() and not staging_dir(node).is_symlink()
    assert sorted(p.name for p in node.iterdir()) == ["model.safetensors", MARKER]
    assert not (node / MARKER).is_symlink() and not (node / "model.safetensors").is_symlink()
    assert stub_names(node) == {"model.safetensors"}
