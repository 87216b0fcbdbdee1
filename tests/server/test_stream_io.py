"""``--io stream[:BLOCK]`` (issue 20, docs/performance.md): files mostly not in the page cache are read in
block-aligned blocks that every thread takes in file order (O_DIRECT on slabs that read with it), cached
files as with buffered. The slab must hold the same bytes as a buffered load, shards and TP slices alike."""

from __future__ import annotations

import glob
import mmap
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wcache.checkpoint import Checkpoint
from wcache.layout import Layout, plan_layout
from wcache.server import loader
from wcache.server.backends.host import HostBackend
from wcache.server.loader import ALIGN_IO, Files, Job, load_into, parse_io, read_direct, read_job
from wcache.sharding import resolve_plan
from wcache.synthetic import TINY, make_llama_checkpoint


@pytest.fixture(scope="module")
def shards4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama_checkpoint(tmp_path_factory.mktemp("stream") / "tiny", TINY, shards=4, seed=3)


def _layout(ckpt: Path, rank: int = 0, tp: int = 1) -> Layout:
    c = Checkpoint.open(ckpt)
    plan = resolve_plan(c.architecture, tp) if tp > 1 else None
    return plan_layout(c, tp_rank=rank, tp_size=tp, dtype="bfloat16", plan=plan)


def _host_load(lay: Layout, io: str) -> bytes:
    slab = HostBackend().allocate(lay.total_bytes)
    try:
        load_into(lay, slab, threads=4, staging_bytes=8 << 20, progress=False, io=io)
        return slab.read(0, lay.total_bytes)
    finally:
        slab.close()


def _spy_jobs(monkeypatch: pytest.MonkeyPatch) -> list[list[Job]]:
    """Record the jobs each load runs, and the direct set it hands the writer."""
    seen: list[list[Job]] = []
    real = loader._execute

    def spy(jobs: list[Job], *args: object, **kwargs: object) -> int:
        seen.append(list(jobs))
        return real(jobs, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loader, "_execute", spy)
    return seen


def _uncached(monkeypatch: pytest.MonkeyPatch) -> None:
    """The files count as not in the page cache (a cold start; drop_caches is not ours to run)."""
    monkeypatch.setattr(loader, "page_cache_fraction", lambda path: 0.0)


@pytest.mark.parametrize(("rank", "tp"), [(0, 1), (1, 2)], ids=["tp1", "tp2-rank1"])
def test_stream_load_is_bit_identical(shards4: Path, monkeypatch: pytest.MonkeyPatch, rank: int, tp: int) -> None:
    """4 shards, 64 KiB blocks (many cuts, TP row pieces included): the same slab as a buffered load, and
    every tensor equal to safetensors' own."""
    lay = _layout(shards4, rank, tp)
    want = _host_load(lay, "buffered")
    _uncached(monkeypatch)
    seen = _spy_jobs(monkeypatch)
    got = _host_load(lay, "stream:64KiB")
    assert got == want
    assert len(seen[0]) > len(lay.placements)  # split into blocks, not read as whole jobs
    ref: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(shards4 / "*.safetensors"))):
        ref.update(load_file(f))
    slab = torch.frombuffer(bytearray(got), dtype=torch.uint8)
    for p in lay.placements:
        t = slab[p.offset : p.offset + p.nbytes].view(torch.bfloat16).reshape(p.shape)
        w = ref[p.source.name]
        if p.shard is not None:
            w = w.narrow(p.shard.dim, p.shard.start, p.shard.length)
        assert torch.equal(t, w), p.source.name


def test_split_blocks_cover_the_same_bytes(shards4: Path) -> None:
    """Each block job holds at most BLOCK bytes and lands contiguously; a one-extent job's blocks stay
    inside block-aligned ranges of its file (O_DIRECT reads no extra pages); together they read exactly the bytes of the whole jobs, in order."""
    lay = _layout(shards4, 1, 2)
    jobs = loader._jobs(lay, 1 << 20)
    block = 64 << 10
    files = {p.source.file for p in lay.placements}
    split = loader._split(jobs, block, files)

    def spans(js: Sequence[Job]) -> list[tuple[Path, int, int, int]]:  # (file, offset, length, dest), merged
        out: list[tuple[Path, int, int, int]] = []
        for j in js:
            dest = j.dest
            for f, off, n in j.extents:
                last = out[-1] if out else None
                if last and last[0] == f and last[1] + last[2] == off and last[3] + last[2] == dest:
                    out[-1] = (f, last[1], last[2] + n, last[3])
                else:
                    out.append((f, off, n, dest))
                dest += n
        return out

    assert spans(split) == spans(jobs)
    assert len(split) > len(jobs)
    assert all(0 < j.nbytes <= block for j in split)
    for whole in (j for j in jobs if len(j.extents) == 1):  # a file range: cut at block-aligned offsets
        for j in loader._split([whole], block, files):
            _, off, n = j.extents[0]
            assert off // block == (off + n - 1) // block
    assert loader._split(jobs, block, set()) == jobs  # other files' jobs are kept whole


def test_cached_files_keep_whole_jobs(shards4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm start (files in the page cache, as just written) reads the whole jobs buffered would."""
    monkeypatch.setattr(loader, "page_cache_fraction", lambda path: 1.0)
    seen = _spy_jobs(monkeypatch)
    lay = _layout(shards4)
    _host_load(lay, "stream:64KiB")
    _host_load(lay, "buffered")
    assert [j.extents for j in seen[0]] == [j.extents for j in seen[1]]


class _DirectSlab:
    """A bytearray slab that reads with O_DIRECT like the CUDA writer: aligned per-thread buffers,
    ``read_direct`` for one-extent jobs of the files in ``direct``."""

    direct_io = True

    def __init__(self, size: int) -> None:
        self.size = size
        self.buf = bytearray(size)
        self.direct_reads = 0
        self.direct: set[Path] = set()
        self.lock = threading.Lock()

    def writer(self, jobs: Sequence[Job], threads: int, direct: set[Path]) -> _DirectSlab:
        self.direct = set(direct)
        self.local = threading.local()
        self.room = -(-max(j.nbytes for j in jobs) // ALIGN_IO) * ALIGN_IO + 2 * ALIGN_IO
        return self

    def write(self, job: Job, files: Files) -> None:
        mm = getattr(self.local, "mm", None)
        if mm is None:
            mm = self.local.mm = mmap.mmap(-1, self.room)
        view = memoryview(mm)
        try:
            f, off, _ = job.extents[0]
            n = job.nbytes
            dfd = files.direct_fd(f) if f in self.direct and len(job.extents) == 1 else -1
            start = 0
            if dfd >= 0:
                start = read_direct(dfd, view, off, n, str(f))
                with self.lock:
                    self.direct_reads += 1
            else:
                read_job(files, job, view[:n])
            self.buf[job.dest : job.dest + n] = view[start : start + n]
        finally:
            view.release()

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_stream_reads_direct_blocks(shards4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a slab that reads with O_DIRECT, every uncached file is read direct in blocks; same bytes."""
    lay = _layout(shards4)
    want = _host_load(lay, "buffered")
    probe = os.open(next(iter(shards4.glob("*.safetensors"))), os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    os.close(probe)  # (raises where this filesystem refuses O_DIRECT: then the test cannot run here)
    _uncached(monkeypatch)
    slab = _DirectSlab(lay.total_bytes)
    load_into(lay, slab, threads=4, staging_bytes=8 << 20, progress=False, io="stream:128KiB")  # type: ignore[arg-type]
    assert bytes(slab.buf) == want
    assert slab.direct == {p.source.file for p in lay.placements}
    assert slab.direct_reads > len(lay.placements)


def test_parse_io_refuses_bad_blocks() -> None:
    assert parse_io("stream") == ("stream", loader.STREAM_BLOCK)
    assert parse_io("stream:512KiB") == ("stream", 512 << 10)
    assert parse_io("auto") == ("auto", 0)
    for bad in ("stream:1000", "stream:32K", "stream:128M", "direct:1M", "fast"):
        with pytest.raises(ValueError, match="stream"):
            parse_io(bad)


def test_cli_refuses_a_bad_io_mode(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "wcache.server.cli", "--model", str(tmp_path), "--io", "stream:1000"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stderr  # argparse's usage error, before anything is opened
    assert "Traceback" not in out.stderr
