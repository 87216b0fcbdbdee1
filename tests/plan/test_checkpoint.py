"""What the daemon opens from a checkpoint directory, and what it agrees to serve (the rows of docs/reliability.md's
table that name this file):

- file types and sizes: every file is a regular file (symlinks followed), metadata size-capped, opened without
  blocking;
- one descriptor per file: fingerprint, headers and data come from the descriptor that was validated, not from
  the path again;
- the protocol's limits: tensors the protocol cannot carry (docs/protocol.md §7) are refused at load, naming
  tensor and limit.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from wcache import CheckpointError, WeightCacheKey
from wcache.plan.checkpoint import Checkpoint
from wcache.plan.key import RankSpec
from wcache.plan.layout import plan_layout
from wcache.plan.rank import plan_rank
from wcache.synthetic import LlamaShape, make_llama_checkpoint

SMALL = LlamaShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file with exactly this header (no validation: for hostile inputs)."""
    header: dict[str, object] = {}
    data = b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def one_tensor_dir(root: Path, name: str = "w", shape: list[int] | None = None, config: object = None) -> Path:
    root.mkdir()
    shape = [4, 4] if shape is None else shape
    n = 1
    for s in shape:
        n *= s
    write_safetensors(root / "model.safetensors", {name: ("F32", shape, bytes(4 * n))})
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    return root


# --------------------------------------------------------------------------- file types and sizes


def _refused_in_child(model: Path) -> subprocess.CompletedProcess[str]:
    """Checkpoint.open in a child process with 1 GiB of address space and a deadline: on code that reads
    /dev/zero without limit or blocks opening a FIFO, the child dies or times out instead of the suite."""
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from wcache.plan.checkpoint import Checkpoint\n"
        "from wcache.errors import CheckpointError\n"
        "try:\n"
        "    Checkpoint.open(sys.argv[1])\n"
        "except CheckpointError as exc:\n"
        "    print('refused:', exc)\n"
        "    sys.exit(3)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(model)], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    ("victim", "kind"),
    [
        ("config.json", "/dev/zero"),
        ("config.json", "fifo"),
        ("model.safetensors.index.json", "fifo"),
        ("model.safetensors.index.json", "/dev/zero"),
        ("model.safetensors", "fifo"),
        ("model.safetensors", "/dev/zero"),
        ("extra.safetensors", "fifo"),  # no index: a FIFO among the globbed shards
    ],
)
def test_side_files_that_are_not_regular_files_are_refused_without_blocking(
    tmp_path: Path, victim: str, kind: str
) -> None:
    model = one_tensor_dir(tmp_path / "m", config={"architectures": ["LlamaForCausalLM"]})
    if victim == "model.safetensors.index.json":
        (model / victim).write_text("{}")
    target = model / victim
    target.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to(kind)
    out = _refused_in_child(model)
    assert out.returncode == 3, (out.returncode, out.stdout, out.stderr[-2000:])
    assert f"/m/{victim}: " in out.stdout  # the refusal names the file


def test_directory_and_dangling_symlink_shards_are_refused_not_skipped(tmp_path: Path) -> None:
    model = one_tensor_dir(tmp_path / "m")
    (model / "b.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"b\.safetensors: safetensors file is a directory"):
        Checkpoint.open(model)
    (model / "b.safetensors").rmdir()
    (model / "b.safetensors").symlink_to(tmp_path / "gone")
    with pytest.raises(CheckpointError, match=r"b\.safetensors: safetensors file does not exist"):
        Checkpoint.open(model)
    (model / "b.safetensors").unlink()
    (model / "config.json").symlink_to(tmp_path / "gone")  # a dangling config is an error, not "no config"
    with pytest.raises(CheckpointError, match=r"config\.json"):
        Checkpoint.open(model)


def test_metadata_over_its_cap_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = one_tensor_dir(tmp_path / "m", config={"architectures": ["LlamaForCausalLM"], "pad": "x" * 5000})
    monkeypatch.setattr("wcache.plan.checkpoint.MAX_CONFIG_BYTES", 4096)
    with pytest.raises(CheckpointError, match="4096-byte limit"):
        Checkpoint.open(model)
    monkeypatch.setattr("wcache.plan.checkpoint.MAX_CONFIG_BYTES", 1 << 20)
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    monkeypatch.setattr("wcache.plan.checkpoint.MAX_INDEX_BYTES", 16)
    with pytest.raises(CheckpointError, match=r"index is .* over the 16-byte limit"):
        Checkpoint.open(model)


def test_deeply_nested_config_is_a_checkpoint_error(tmp_path: Path) -> None:
    model = one_tensor_dir(tmp_path / "m")
    (model / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        Checkpoint.open(model)


def test_hf_cache_symlinks_into_blobs_are_followed(tmp_path: Path) -> None:
    """The policy follows symlinks to regular files: a Hugging Face cache snapshot opens and keys as its files."""
    real = make_llama_checkpoint(tmp_path / "real", SMALL, shards=2, seed=3)
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(real.iterdir())):
        blob = blobs / f"blob{i}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    assert WeightCacheKey.from_checkpoint(snap) == WeightCacheKey.from_checkpoint(real)


def test_checkpoint_descriptors_are_released(tmp_path: Path) -> None:
    model = make_llama_checkpoint(tmp_path / "m", SMALL, shards=2, seed=4)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        WeightCacheKey.from_checkpoint(model)
    with Checkpoint.open(model) as c:
        assert len(c.fds) == 2
    assert c.fds == {}
    with pytest.raises(CheckpointError, match="closed"):
        c.fingerprint()
    with pytest.raises(CheckpointError):
        Checkpoint.open(tmp_path)  # fails after opening nothing
    assert len(os.listdir("/proc/self/fd")) == before


# --------------------------------------------------------------------------- one descriptor per file


def _swap(victim: Path, replacement: Path, how: str) -> None:
    """Replace ``victim`` by ``replacement``'s bytes: a rename over it, or retargeting a symlink."""
    if how == "rename":
        tmp = victim.with_name(victim.name + ".new")
        shutil.copyfile(replacement, tmp)
        os.replace(tmp, victim)
    else:
        assert victim.is_symlink()
        tmp = victim.with_name(victim.name + ".lnk")
        tmp.symlink_to(replacement)
        os.replace(tmp, victim)


@pytest.mark.parametrize("how", ["rename", "symlink"])
def test_a_shard_swapped_after_validation_is_not_served(tmp_path: Path, how: str) -> None:
    """Two same-shaped checkpoints (a fine-tune of a base): after the key is computed, the validated shard is
    replaced by the other's. The fingerprint and every loaded byte still come from the validated file."""
    import torch

    from wcache.server.backends.host import HostBackend
    from wcache.server.loader import load_into

    a = make_llama_checkpoint(tmp_path / "a", SMALL, seed=1)
    b = make_llama_checkpoint(tmp_path / "b", SMALL, seed=2)
    shard = a / "model.safetensors"
    original = shard.read_bytes()
    if how == "symlink":  # the checkpoint's shard is a symlink (HF cache style) that gets retargeted
        kept = tmp_path / "blob-a"
        shutil.copyfile(shard, kept)
        shard.unlink()
        shard.symlink_to(kept)
    rp = plan_rank(RankSpec(a))
    _swap(shard, b / "model.safetensors", how)
    assert shard.read_bytes() != original  # the path now names the other file
    assert rp.checkpoint.fingerprint() == rp.key.fingerprint  # still the validated file's
    slab = HostBackend().allocate(rp.layout.total_bytes)
    try:
        load_into(rp.layout, slab, threads=2, progress=False)
        got = slab.tensor()
        for p in rp.layout.placements:
            src = p.source
            want = torch.frombuffer(bytearray(original[src.start : src.start + src.nbytes]), dtype=torch.uint8)
            assert torch.equal(got[p.offset : p.offset + p.nbytes], want), src.name
    finally:
        slab.close()
        rp.close()


def test_fingerprint_reads_the_validated_descriptor(tmp_path: Path) -> None:
    a = make_llama_checkpoint(tmp_path / "a", SMALL, seed=1)
    b = make_llama_checkpoint(tmp_path / "b", SMALL, seed=2)
    # resolved now: a deferred key (docs/protocol.md §4.3.1) would scan the files as they are when first read
    want = {content: WeightCacheKey.from_checkpoint(a, verify_content=content).resolve() for content in (False, True)}
    key_b = WeightCacheKey.from_checkpoint(b).resolve()
    with Checkpoint.open(a) as c:
        _swap(a / "model.safetensors", b / "model.safetensors", "rename")
        for content in (False, True):
            assert WeightCacheKey.from_spec(RankSpec(a, verify_content=content), checkpoint=c) == want[content]
    assert WeightCacheKey.from_checkpoint(a) == key_b  # reopened: now it is the other checkpoint


# --------------------------------------------------------------------------- the protocol's limits


@pytest.mark.parametrize(
    ("name", "shape", "config", "match"),
    [
        ("w" * 2000, [4, 4], None, r"2000 characters; tensor names must be 1\.\.1024"),
        ("", [4, 4], None, r"0 characters; tensor names must be 1\.\.1024"),
        ("w\ud800", [4, 4], None, "lone surrogate"),
        ("w", [1] * 17, None, "rank 17 is over the protocol's limit of 16"),
        ("w", [2**60, 0], None, "2\\*\\*48"),
        ("w", [0, 2**25, 2**25], None, "2\\*\\*48"),  # every dimension fits, the first stride does not
        ("w", [4, 4], {"architectures": ["A" * 5000]}, "5000 characters; key strings are limited to 1024"),
        ("w", [4, 4], {"architectures": ["A\udc00"]}, "lone surrogate"),
    ],
)
def test_tensors_the_protocol_cannot_carry_are_refused_at_load(
    tmp_path: Path, name: str, shape: list[int], config: object, match: str
) -> None:
    model = one_tensor_dir(tmp_path / "m", name=name, shape=shape)
    if config is not None:
        (model / "config.json").write_text(json.dumps(config))  # json escapes the lone surrogates
    with pytest.raises(CheckpointError, match=match):
        plan_rank(RankSpec(model))


def test_limits_themselves_are_served(tmp_path: Path) -> None:
    """The edge of each limit is accepted: 1024-character names and architecture, rank 16, 2**48 - 1."""
    model = one_tensor_dir(tmp_path / "m", name="n" * 1024, shape=[1] * 16, config={"architectures": ["A" * 1024]})
    write_safetensors(
        model / "model.safetensors",
        {"n" * 1024: ("F32", [1] * 16, bytes(4)), "z": ("F32", [2**48 - 1, 0], b"")},
    )
    rp = plan_rank(RankSpec(model))
    assert rp.key.architecture == "A" * 1024
    assert len(rp.layout.table()) == 2
    rp.close()


def test_a_table_too_large_for_one_state_frame_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m"
    model.mkdir()
    write_safetensors(model / "model.safetensors", {f"{i:04d}" + "n" * 1000: ("F32", [1], bytes(4)) for i in range(80)})
    monkeypatch.setattr("wcache.plan.layout.DEFAULT_MAX_FRAME_SIZE", 128 << 10)
    with Checkpoint.open(model) as c:
        with pytest.raises(CheckpointError, match="frame limit"):
            plan_layout(c, tp_rank=0, tp_size=1, dtype="float32", plan=None)
        monkeypatch.setattr("wcache.plan.layout.DEFAULT_MAX_FRAME_SIZE", 64 << 20)
        assert len(plan_layout(c, tp_rank=0, tp_size=1, dtype="float32", plan=None).placements) == 80


def test_direct_reads_reopen_the_validated_inode_not_the_path(tmp_path: Path) -> None:
    """The O_DIRECT descriptor of a device load is reopened from the validated one (/proc/self/fd/N)."""
    import mmap

    from wcache.server.reads import ALIGN_IO, Files, read_direct

    a = make_llama_checkpoint(tmp_path / "a", SMALL, seed=1)
    b = make_llama_checkpoint(tmp_path / "b", SMALL, seed=2)
    shard = a / "model.safetensors"
    original = shard.read_bytes()
    with Checkpoint.open(a) as c:
        _swap(shard, b / "model.safetensors", "rename")
        files = Files(c)
        try:
            fd = files.direct_fd(shard)
            if fd < 0:
                pytest.skip("this filesystem refuses O_DIRECT")
            assert os.fstat(fd).st_ino == os.fstat(c.fd(shard)).st_ino != shard.stat().st_ino
            buf = mmap.mmap(-1, len(original) + 2 * ALIGN_IO)
            view = memoryview(buf)
            try:
                start = read_direct(fd, view, 100, len(original) - 100, str(shard))
                assert view[start : start + len(original) - 100] == original[100:]
            finally:
                view.release()
                buf.close()
        finally:
            files.close()
        with pytest.raises(CheckpointError, match="not a file of checkpoint"):
            Files(c).fd(tmp_path / "elsewhere.safetensors")  # never opened by path


def test_an_empty_tensor_whose_other_dimensions_overflow_a_view_is_refused(tmp_path: Path) -> None:
    """Shape ``[2**47, 2**47, 0]`` is empty, but torch multiplies every dimension and refuses to make its view: the
    daemon refuses to load it (CheckpointError) rather than serve a table every engine refuses (docs/protocol.md
    §4.6)."""
    root = tmp_path / "m"
    root.mkdir()
    header = {
        "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "e": {"dtype": "F32", "shape": [1 << 47, 1 << 47, 0], "data_offsets": [16, 16]},
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + struct.pack("<4f", 1, 2, 3, 4))
    with pytest.raises(CheckpointError, match="2\\*\\*60 elements"):
        Checkpoint.open(root)
