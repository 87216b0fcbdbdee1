"""``--io stream[:BLOCK]`` (docs/performance.md, cold loads): files mostly not in the page cache are read in
block-aligned O_DIRECT blocks that every thread takes in file order (one front), into one staging buffer
per job on slabs whose writer stages; cached files, and slabs that do not stage, read whole jobs as with
buffered. The slab must hold the same bytes as a buffered load, shards and TP slices alike."""

from __future__ import annotations

import glob
import mmap
import os
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wcache.errors import CheckpointError
from wcache.plan.checkpoint import Checkpoint
from wcache.plan.layout import Layout, plan_layout
from wcache.plan.sharding import resolve_plan
from wcache.server import loader
from wcache.server.backends.base import LoadAborted
from wcache.server.backends.host import HostBackend
from wcache.server.loader import load_into, parse_io
from wcache.server.reads import ALIGN_IO, Files, Job, read_job
from wcache.synthetic import TINY, make_llama_checkpoint


@pytest.fixture(scope="module")
def shards4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama_checkpoint(tmp_path_factory.mktemp("stream") / "tiny", TINY, shards=4, seed=3)


def _layout(ckpt: Path, rank: int = 0, tp: int = 1) -> Layout:
    c = Checkpoint.open(ckpt)
    plan = resolve_plan(c.architecture, tp) if tp > 1 else None
    return plan_layout(c, tp_rank=rank, tp_size=tp, dtype="bfloat16", plan=plan)


def _host_load(lay: Layout, io: str) -> bytes:
    slab = HostBackend(staging_bytes=8 << 20).allocate(lay.total_bytes)
    try:
        load_into(lay, slab, threads=4, progress=False, io=io)
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


class _StagedSlab:
    """A bytearray slab with a staging writer like the CUDA one (``StagedWriter``): whole jobs through
    per-call buffers, staged jobs through a pool of ``pool`` job-sized page-aligned buffers."""

    direct_io = True
    staging_bytes = 8 << 20  # the loader cuts its jobs to it, as to a backend's budget

    def __init__(self, size: int, pool: int = 2) -> None:
        self.size = size
        self.buf = bytearray(size)
        self.pool = pool
        self.stages = 0
        self.commits = 0
        self.whole = 0
        self.direct: set[Path] = set()
        self.staged: list[Job] = []
        self.lock = threading.Lock()
        self.aborted = False

    def writer(self, jobs: Sequence[Job], threads: int, direct: set[Path], staged: Sequence[Job] = ()) -> _StagedSlab:
        self.direct, self.staged = set(direct), list(staged)
        room = -(-max(j.nbytes for j in jobs) // ALIGN_IO) * ALIGN_IO + 2 * ALIGN_IO
        self.bufs = [mmap.mmap(-1, room) for _ in range(self.pool)]
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(self.pool):
            self.free.put(i)
        return self

    def write(self, job: Job, files: Files) -> None:
        tmp = bytearray(job.nbytes)
        read_job(files, job, memoryview(tmp))
        self.buf[job.dest : job.dest + job.nbytes] = tmp
        with self.lock:
            self.whole += 1

    def stage(self, job: Job) -> tuple[int, memoryview]:
        while True:
            if self.aborted:
                raise LoadAborted("another job failed")
            try:
                slot = self.free.get(timeout=0.05)
                break
            except queue.Empty:
                continue
        with self.lock:
            self.stages += 1
        return slot, memoryview(self.bufs[slot])

    def commit(self, job: Job, slot: int, start: int) -> None:
        n = job.nbytes
        self.buf[job.dest : job.dest + n] = self.bufs[slot][start : start + n]
        with self.lock:
            self.commits += 1
        self.free.put(slot)

    def abort(self) -> None:
        self.aborted = True

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def _o_direct_or_skip(ckpt: Path) -> None:
    try:
        os.close(os.open(next(iter(ckpt.glob("*.safetensors"))), os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
    except OSError as exc:
        pytest.skip(f"this filesystem refuses O_DIRECT ({exc})")


@pytest.mark.parametrize(("rank", "tp"), [(0, 1), (1, 2)], ids=["tp1", "tp2-rank1"])
def test_stream_load_is_bit_identical(shards4: Path, monkeypatch: pytest.MonkeyPatch, rank: int, tp: int) -> None:
    """4 shards, 64 KiB blocks (many blocks per job, TP row pieces included): the same slab as a buffered
    load, and every tensor equal to safetensors' own. Every one-extent job is staged and committed once;
    the row-piece jobs of a TP=2 rank are read whole."""
    lay = _layout(shards4, rank, tp)
    want = _host_load(lay, "buffered")
    _o_direct_or_skip(shards4)
    _uncached(monkeypatch)
    slab = _StagedSlab(lay.total_bytes)
    load_into(lay, slab, threads=4, progress=False, io="stream:64KiB")  # type: ignore[arg-type]
    got = bytes(slab.buf)
    assert got == want
    assert slab.direct == {p.source.file for p in lay.placements}
    assert slab.staged and slab.stages == slab.commits == len(slab.staged)
    jobs = loader._jobs(lay, loader._chunk(4, 8 << 20))
    assert slab.whole == len(jobs) - len(slab.staged)
    assert sum(len(loader._pieces(j, 64 << 10)) for j in slab.staged) > len(slab.staged)  # read in blocks
    ref: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(shards4 / "*.safetensors"))):
        ref.update(load_file(f))
    t_slab = torch.frombuffer(bytearray(got), dtype=torch.uint8)
    for p in lay.placements:
        t = t_slab[p.offset : p.offset + p.nbytes].view(torch.bfloat16).reshape(p.shape)
        w = ref[p.source.name]
        if p.shard is not None:
            w = w.narrow(p.shard.dim, p.shard.start, p.shard.length)
        assert torch.equal(t, w), p.source.name


def test_pieces_cover_the_aligned_job() -> None:
    """A staged job's reads cover its 4 KiB-aligned superset exactly, back to back, each inside one
    block-aligned range of the file (the front's blocks), none longer than the block."""
    block = 64 << 10
    for off, n in [(0, 1), (8, 200_000), (4096, 65536), (65535, 2), (123_457, 1 << 20), (block * 3, block)]:
        job = Job(None, 0, [(Path("f"), off, n)])
        pieces = loader._pieces(job, block)
        start, end = off - off % ALIGN_IO, -(-(off + n) // ALIGN_IO) * ALIGN_IO
        assert pieces[0][0] == start
        assert sum(k for _, k in pieces) == end - start
        for (p, k), (q, _) in zip(pieces, pieces[1:], strict=False):
            assert p + k == q
        assert all(0 < k <= block and p // block == (p + k - 1) // block for p, k in pieces)


def test_host_slab_reads_stream_jobs_whole(shards4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host slab does not stage: ``--io stream`` reads its jobs whole, the same bytes."""
    lay = _layout(shards4)
    want = _host_load(lay, "buffered")
    _uncached(monkeypatch)
    seen = _spy_jobs(monkeypatch)
    assert _host_load(lay, "stream:64KiB") == want
    assert len(seen[0]) == len(loader._jobs(lay, loader._chunk(4, 8 << 20)))


def test_failed_block_ends_the_load(shards4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file truncated after planning: the block that finds it short raises CheckpointError naming the
    file, and the threads waiting for the staging buffer the failed job holds are woken (no hang)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(shards4, ckpt)
    _o_direct_or_skip(ckpt)
    lay = _layout(ckpt)
    last = max(lay.placements, key=lambda p: p.source.start + p.source.nbytes).source.file
    os.truncate(last, os.path.getsize(last) // 2)
    _uncached(monkeypatch)
    slab = _StagedSlab(lay.total_bytes, pool=1)
    errors: list[BaseException] = []

    def load() -> None:
        try:
            load_into(lay, slab, threads=4, progress=False, io="stream:64KiB")  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=load)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the load hung after a failed block"
    assert len(errors) == 1 and isinstance(errors[0], CheckpointError), errors
    assert str(last) in str(errors[0])


def test_cached_files_keep_whole_jobs(shards4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm start (files in the page cache, as just written) reads the whole jobs buffered would."""
    monkeypatch.setattr(loader, "page_cache_fraction", lambda path: 1.0)
    seen = _spy_jobs(monkeypatch)
    lay = _layout(shards4)
    _host_load(lay, "stream:64KiB")
    _host_load(lay, "buffered")
    assert [j.extents for j in seen[0]] == [j.extents for j in seen[1]]


def test_parse_io_refuses_bad_blocks() -> None:
    assert parse_io("stream") == ("stream", loader.STREAM_BLOCK) == ("stream", 512 << 10)
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


class _LateFirstSlab(_StagedSlab):
    """The first staged job waits until a job of ``failing`` has taken the only buffer (a pool hands freed buffers
    out in no fixed order), so that job's failure leaves the first one waiting for a buffer."""

    def __init__(self, size: int, failing: Path) -> None:
        super().__init__(size, pool=1)
        self.failing = failing
        self.taken = threading.Event()

    def stage(self, job: Job) -> tuple[int, memoryview]:
        if job is self.staged[0]:
            assert self.taken.wait(20), "no job of the failing file took the buffer"
        got = super().stage(job)
        if job.extents[0][0] == self.failing:
            self.taken.set()
        return got


def test_a_failed_job_wakes_earlier_jobs_waiting_for_its_buffer(
    shards4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job that fails holding a staging buffer aborts the load at once: an earlier job waiting for that buffer
    is woken and the load raises CheckpointError, instead of waiting for the main thread to reach the failed item
    (it never does: it waits on the earlier one)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(shards4, ckpt)
    _o_direct_or_skip(ckpt)
    lay = _layout(ckpt)
    _uncached(monkeypatch)
    files = sorted({p.source.file for p in lay.placements})
    slab = _LateFirstSlab(lay.total_bytes, files[-1])
    errors: list[BaseException] = []
    jobs = loader._jobs(lay, loader._chunk(64, 8 << 20))

    def load() -> None:
        try:  # one block per job (64 MiB blocks) and a thread for every job: all jobs start at once
            load_into(lay, slab, threads=len(jobs) + 1, progress=False, io="stream:64MiB")  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)

    os.truncate(files[-1], 8)  # the last file's jobs (the last staged job among them) find it short
    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the load hung: the earlier job still waits for the failed job's buffer"
    assert len(errors) == 1 and isinstance(errors[0], CheckpointError), errors
