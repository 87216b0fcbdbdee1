"""Checkpoint metadata, keys, sharding plans and slab layout (pure Python, no daemon)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from wcache import CheckpointError, ShardingError, WeightCacheKey
from wcache.plan.checkpoint import Checkpoint
from wcache.plan.layout import ALIGN, plan_layout, resolve_dtype
from wcache.plan.sharding import LLAMA_PLAN, load_plan_file, resolve_plan, shard_tensors


def test_checkpoint_reads_index_and_config(ckpt: Path) -> None:
    c = Checkpoint.open(ckpt)
    assert c.architecture == "LlamaForCausalLM"
    assert len(c.files) == 2
    assert len(c.tensors) == 39
    assert c.total_bytes == sum(t.nbytes for t in c.tensors.values())


def test_key_is_stable_and_sensitive(ckpt: Path, tied_ckpt: Path) -> None:
    a = WeightCacheKey.from_checkpoint(ckpt)
    assert a == WeightCacheKey.from_checkpoint(ckpt)
    assert a.fingerprint != WeightCacheKey.from_checkpoint(tied_ckpt).fingerprint
    b = WeightCacheKey.from_checkpoint(ckpt, tp_rank=1, tp_size=2)
    assert set(a.diff_wire(b.to_wire())) == {"tp_rank", "tp_size", "plan"}
    assert b.plan == LLAMA_PLAN.id
    content = WeightCacheKey.from_checkpoint(ckpt, verify_content=True)
    assert content.fingerprint != a.fingerprint and content.fingerprint_kind == "content"
    assert WeightCacheKey.from_wire(a.to_wire()) == a


def test_key_diff_defaults_and_unknown_fields(ckpt: Path) -> None:
    a = WeightCacheKey.from_checkpoint(ckpt)
    wire = a.to_wire()
    del wire["layout"]  # an older client omitting a defaulted field still matches
    assert a.diff_wire(wire) == {}
    wire["quantization"] = "fp8"  # a field this daemon does not know: a difference
    assert a.diff_wire(wire) == {"quantization": [None, "fp8"]}
    wire = a.to_wire()
    wire["tp_size"] = "1"  # same text, other type
    assert "tp_size" in a.diff_wire(wire)


def test_layout_alignment_and_order(ckpt: Path) -> None:
    c = Checkpoint.open(ckpt)
    lay = plan_layout(c, tp_rank=0, tp_size=1, dtype=resolve_dtype(c, None), plan=None)
    offs = [p.offset for p in lay.placements]
    assert all(o % ALIGN == 0 for o in offs)
    assert offs == sorted(offs)
    assert lay.total_bytes % ALIGN == 0
    assert lay.total_bytes >= lay.payload_bytes
    assert [p.source.name for p in lay.placements] == [
        t.name for t in sorted(c.tensors.values(), key=lambda t: (str(t.file), t.start))
    ]


def test_tp_layout_halves_sharded_dims(ckpt: Path) -> None:
    c = Checkpoint.open(ckpt)
    plan = resolve_plan(c.architecture, 2)
    lay = plan_layout(c, tp_rank=1, tp_size=2, dtype="bfloat16", plan=plan)
    by = {p.source.name: p for p in lay.placements}
    q = by["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape[0] * 2 == q.source.shape[0] and q.shard is not None and q.shard.start == q.shape[0]
    o = by["model.layers.0.self_attn.o_proj.weight"]
    assert o.shape[1] * 2 == o.source.shape[1] and o.shard is not None and o.shard.dim == 1
    assert by["model.norm.weight"].shard is None


def test_dtype_resolution(ckpt: Path) -> None:
    c = Checkpoint.open(ckpt)
    assert resolve_dtype(c, None) == "bfloat16"
    assert resolve_dtype(c, "float32") == "float32"
    with pytest.raises(CheckpointError, match="int8"):
        resolve_dtype(c, "int8")


def test_plan_file(tmp_path: Path, ckpt: Path) -> None:
    p = tmp_path / "plan.json"
    rules = [{"pattern": r".*(q|k|v|gate|up)_proj\.weight", "dim": 0}, {"pattern": r".*", "dim": None}]
    p.write_text(json.dumps({"name": "mine", "rules": rules}))
    plan = load_plan_file(p)
    assert plan.id.startswith("file:") and plan.name == "mine"
    shards = shard_tensors(Checkpoint.open(ckpt).tensors.values(), plan, 0, 2)
    assert shards["model.layers.0.mlp.up_proj.weight"] is not None
    assert shards["model.layers.0.mlp.down_proj.weight"] is None
    key = WeightCacheKey.from_checkpoint(ckpt, tp_rank=0, tp_size=2, plan_file=p)
    assert key.plan == plan.id


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("not json", "cannot read"),
        ('{"rules": 3}', "'rules' array"),
        ('{"rules": [{"dim": 0}]}', "pattern"),
        ('{"rules": [{"pattern": "(", "dim": 0}]}', "regex"),
        ('{"rules": [{"pattern": ".*", "dim": -1}]}', "non-negative"),
    ],
)
def test_bad_plan_files(tmp_path: Path, content: str, match: str) -> None:
    p = tmp_path / "plan.json"
    p.write_text(content)
    with pytest.raises(ShardingError, match=match):
        load_plan_file(p)


@pytest.mark.parametrize("config", [None, "{}"], ids=["no-config.json", "no-architectures"])
def test_a_sharded_key_without_an_architecture_says_why_there_is_none(
    tmp_path: Path, ckpt: Path, config: str | None
) -> None:
    """A built-in plan is picked by config.json's architectures[0]: a key (and the planner) at tp_size 2 says
    whether the directory has no config.json or a config.json that names no architecture."""
    from wcache.plan.key import RankSpec
    from wcache.plan.rank import plan_rank

    d = tmp_path / "m"
    shutil.copytree(ckpt, d)
    if config is None:
        (d / "config.json").unlink()
    else:
        (d / "config.json").write_text(config)
    for make in (
        lambda: WeightCacheKey.from_checkpoint(d, tp_rank=0, tp_size=2).plan,  # the scan runs when a field is read
        lambda: plan_rank(RankSpec(d, tp_rank=0, tp_size=2)),
    ):
        with pytest.raises(ShardingError) as e:
            make()
        assert e.value.details["config_json"] is (config is not None) and e.value.details["architecture"] == ""
        said = "has no config.json" if config is None else "names no architecture"
        assert said in e.value.message and "none in config.json" not in e.value.message


def test_plan_without_rule_for_a_tensor(tmp_path: Path, ckpt: Path) -> None:
    p = tmp_path / "plan.json"
    p.write_text(json.dumps({"rules": [{"pattern": r".*norm.*", "dim": None}]}))
    with pytest.raises(ShardingError, match="no rule for"):
        shard_tensors(Checkpoint.open(ckpt).tensors.values(), load_plan_file(p), 0, 2)


def test_missing_directory_and_no_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint.open(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        Checkpoint.open(tmp_path)


def test_tp2_rank_reads_about_half(tmp_path: Path, ckpt: Path) -> None:
    """With TP=2 each rank reads <= 55% of the checkpoint's bytes (a rank reads its shards, not the whole
    checkpoint), and gets the right slices."""
    import glob

    import torch
    from safetensors.torch import load_file

    from wcache.server.backends.host import HostBackend
    from wcache.server.loader import load_into

    c = Checkpoint.open(ckpt)
    ref: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(ckpt / "*.safetensors"))):
        ref.update(load_file(f))
    for rank in (0, 1):
        lay = plan_layout(c, tp_rank=rank, tp_size=2, dtype="bfloat16", plan=resolve_plan(c.architecture, 2))
        slab = HostBackend(staging_bytes=1 << 20).allocate(lay.total_bytes)
        try:
            stats = load_into(lay, slab, threads=3, progress=False)
            assert stats.read_fraction <= 0.55
            assert stats.bytes_read == lay.payload_bytes
            base = slab.tensor()
            for p in lay.placements:
                got = base[p.offset : p.offset + p.nbytes].view(torch.bfloat16).reshape(p.shape)
                want = ref[p.source.name]
                if p.shard is not None:
                    want = want.narrow(p.shard.dim, p.shard.start, p.shard.length)
                assert torch.equal(got, want), p.source.name
        finally:
            slab.close()


def test_progress_bar_draws(ckpt: Path) -> None:
    import io

    from wcache.server.backends.host import HostBackend
    from wcache.server.loader import load_into

    c = Checkpoint.open(ckpt)
    lay = plan_layout(c, tp_rank=0, tp_size=1, dtype="bfloat16", plan=None)
    slab = HostBackend().allocate(lay.total_bytes)
    out = io.StringIO()
    try:
        load_into(lay, slab, threads=2, progress=out)
    finally:
        slab.close()
    last = out.getvalue().rstrip("\n").split("\r")[-1]
    assert "GB/s" in last and f"/{lay.payload_bytes / 1e9:.2f} GB" in last


def test_direct_read_of_unaligned_ranges(ckpt: Path) -> None:
    """O_DIRECT path: an aligned superset read returns exactly the wanted bytes."""
    import mmap
    import os
    import random

    from wcache.server.reads import ALIGN_IO, page_cache_fraction, read_direct

    f = sorted(ckpt.glob("*.safetensors"))[0]
    data = f.read_bytes()
    assert page_cache_fraction(f) > 0.5  # just read
    try:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")
    buf = mmap.mmap(-1, (1 << 20) + 2 * ALIGN_IO)  # page-aligned, like pinned staging
    view = memoryview(buf)
    rnd = random.Random(0)
    try:
        for _ in range(50):
            n = rnd.randint(1, 1 << 20)
            off = rnd.randint(0, len(data) - n)
            start = read_direct(fd, view, off, n, str(f))
            assert view[start : start + n] == data[off : off + n]
        start = read_direct(fd, view, len(data) - 10, 10, str(f))  # the file's last bytes
        assert view[start : start + 10] == data[-10:]
        with pytest.raises(CheckpointError, match="ended early"):
            read_direct(fd, view, len(data) - 10, 20, str(f))
    finally:
        view.release()
        buf.close()
        os.close(fd)


@pytest.mark.parametrize(
    ("arch", "names"),
    [
        (
            "MixtralForCausalLM",
            {
                "model.layers.0.block_sparse_moe.experts.3.w1.weight": 0,
                "model.layers.0.block_sparse_moe.experts.3.w3.weight": 0,
                "model.layers.0.block_sparse_moe.experts.3.w2.weight": 1,
                "model.layers.0.block_sparse_moe.gate.weight": None,
                "model.layers.0.self_attn.q_proj.weight": 0,
                "model.layers.0.self_attn.o_proj.weight": 1,
                "model.embed_tokens.weight": 0,
                "model.norm.weight": None,
            },
        ),
        (
            "Qwen3MoeForCausalLM",
            {
                "model.layers.1.mlp.experts.127.gate_proj.weight": 0,
                "model.layers.1.mlp.experts.127.up_proj.weight": 0,
                "model.layers.1.mlp.experts.127.down_proj.weight": 1,
                "model.layers.1.mlp.gate.weight": None,
                "model.layers.1.self_attn.q_norm.weight": None,
                "model.layers.1.self_attn.k_proj.weight": 0,
                "lm_head.weight": 0,
            },
        ),
    ],
)
def test_moe_plans(arch: str, names: dict[str, int | None]) -> None:
    plan = resolve_plan(arch, 2)
    assert plan is not None
    for name, dim in names.items():
        assert plan.dim_for(name) == dim, name


def test_sampled_fingerprint_tells_same_shaped_checkpoints_apart(tmp_path: Path) -> None:
    """Fine-tunes of one base have identical headers; the data sample tells them apart (protocol.md §4.3)."""
    import shutil

    from wcache.synthetic import LlamaShape, make_llama_checkpoint

    shape = LlamaShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512)
    a = make_llama_checkpoint(tmp_path / "a", shape, seed=1)
    b = make_llama_checkpoint(tmp_path / "b", shape, seed=2)
    assert Checkpoint.open(a).headers == Checkpoint.open(b).headers
    ka, kb = WeightCacheKey.from_checkpoint(a), WeightCacheKey.from_checkpoint(b)
    assert ka.fingerprint_kind == "sampled"
    assert ka.fingerprint != kb.fingerprint
    shutil.copytree(a, tmp_path / "copy")  # the same bytes elsewhere: the same key
    assert WeightCacheKey.from_checkpoint(tmp_path / "copy") == ka


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("chunk", [4096, 64 << 10, 1 << 20])
def test_jobs_merge_neighbouring_tensors_and_place_every_byte(tmp_path: Path, ckpt: Path, tp: int, chunk: int) -> None:
    """Small tensors that follow each other in the slab share a job; replaying the jobs' reads gives the
    same slab as reading every placement on its own (with TP row pieces and chunk splits)."""
    import torch
    from safetensors.torch import save_file

    from wcache.server.loader import _jobs
    from wcache.server.reads import placement_extents

    moe = tmp_path / "moe"
    moe.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            f"model.layers.0.mlp.experts.{i}.w1.weight": torch.randn(16, 32, generator=g).to(torch.bfloat16)
            for i in range(300)
        }
        | {"model.norm.weight": torch.randn(33, generator=g).to(torch.bfloat16)},
        str(moe / "model.safetensors"),
    )
    (moe / "config.json").write_text('{"architectures": ["MoeLikeForCausalLM"]}')
    for model in (moe, ckpt):
        c = Checkpoint.open(model)
        if tp > 1 and model is moe:
            continue  # no plan for the made-up architecture
        plan = resolve_plan(c.architecture, tp)
        lay = plan_layout(c, tp_rank=tp - 1, tp_size=tp, dtype=resolve_dtype(c, None), plan=plan)
        data = {f: f.read_bytes() for f in c.files}
        want = bytearray(lay.total_bytes)
        for p in lay.placements:
            pos = p.offset
            for f, off, n in placement_extents(p):
                want[pos : pos + n] = data[f][off : off + n]
                pos += n
        got = bytearray(lay.total_bytes)
        jobs = _jobs(lay, chunk)
        for j in jobs:
            assert j.nbytes <= chunk or j.cast
            pos = j.dest
            for f, off, n in j.extents:
                got[pos : pos + n] = data[f][off : off + n]
                pos += n
        assert got == want
        if model is moe and tp == 1:
            assert len(jobs) <= lay.payload_bytes // chunk + 3  # 301 tensors, a handful of jobs


def test_populate_reports_pages_it_cannot_allocate() -> None:
    """A host-slab range that cannot be backed is a CheckpointError (here: no mapping at all), not a SIGBUS."""
    import ctypes
    import mmap

    from wcache.server.reads import MADV_POPULATE_WRITE, populate

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    buf = mmap.mmap(-1, 1 << 20)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    try:
        if libc.madvise(base, 1 << 20, MADV_POPULATE_WRITE) != 0:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE")
        populate(base, 100, 300_000, "ok")  # a mapped range: allocated, no error
    finally:
        del base
        buf.close()
    with pytest.raises(CheckpointError, match="shared memory is full"):
        populate(0, 0, 1 << 20, "x.safetensors: tensor 'w'")  # page 0 is never mapped: ENOMEM


def test_one_layout_version() -> None:
    """LAYOUT_VERSION is defined once, in wcache.plan.key, the key that carries it (the layout sits below the key
    and an engine imports the key alone). A second definition in layout.py would let keys and layouts disagree on
    the version silently."""
    import wcache.plan.key
    import wcache.plan.layout

    assert not hasattr(wcache.plan.layout, "LAYOUT_VERSION")
    assert WeightCacheKey("f", "A", 1, 0, "bfloat16").layout == wcache.plan.key.LAYOUT_VERSION
    assert "LAYOUT_VERSION =" not in Path(wcache.plan.layout.__file__).read_text()
