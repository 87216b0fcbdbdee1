"""The stat proof of a key (docs/protocol.md §4.3.1), without a daemon: what ``checkpoint_files`` lists, when
the daemon's planning records facts (``KeyFacts.recorded``), that facts complete exactly the key a header scan
gives, and how a deferred key behaves before and after its fields are known."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from wcache.errors import CheckpointError, RemoteProtocolError, ShardingError
from wcache.plan.checkpoint import Checkpoint
from wcache.plan.facts import KeyFacts, checkpoint_files
from wcache.plan.key import RACY_NS, RankSpec, WeightCacheKey
from wcache.plan.rank import plan_rank
from wcache.proto.daemon_frames import FileStat
from wcache.synthetic import TINY, make_llama_checkpoint


def _settle(path: Path) -> None:
    """Wait until every file of ``path`` changed at least RACY_NS ago (the daemon records no younger file)."""
    newest = max(os.stat(p).st_ctime_ns for p in path.iterdir())
    time.sleep(max(0.0, (newest + RACY_NS - time.time_ns()) / 1e9 + 0.05))


@pytest.fixture(scope="module")
def settled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-shard checkpoint with an index, old enough to be recorded."""
    path = make_llama_checkpoint(tmp_path_factory.mktemp("proof") / "m", TINY, shards=2, seed=3)
    _settle(path)
    return path


def _scanned(path: Path, **fields: Any) -> WeightCacheKey:
    return WeightCacheKey.from_checkpoint(path, **fields).resolve()


def test_files_are_the_ones_a_key_reads(settled: Path) -> None:
    files = checkpoint_files(settled)
    assert files is not None
    names = [f.name for f in files]
    assert names == sorted(
        ["config.json", "model.safetensors.index.json", *(p.name for p in settled.glob("*.safetensors"))]
    )
    st = os.stat(settled / names[-1])
    assert (files[-1].ino, files[-1].size, files[-1].ctime_ns) == (st.st_ino, st.st_size, st.st_ctime_ns)


def test_files_leave_out_what_no_key_reads_and_prove_nothing_unprovable(tmp_path: Path, settled: Path) -> None:
    m = tmp_path / "m"
    shutil.copytree(settled, m)
    before = checkpoint_files(m)
    (m / "README.md").write_text("not read by a key")
    (m / "generation_config.json").write_text("{}")
    assert checkpoint_files(m) == before
    (m / "extra.safetensors").mkdir()  # the scan refuses it: so does the proof (None: the client scans, and raises)
    assert checkpoint_files(m) is None
    (m / "extra.safetensors").rmdir()
    os.symlink(m / "gone", m / "dangling.safetensors")
    assert checkpoint_files(m) is None
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_files(tmp_path / "nowhere")
    assert checkpoint_files(tmp_path) is None  # nothing a key reads: the scan says what is wrong


def test_a_symlinked_file_is_stated_as_its_target(tmp_path: Path, settled: Path) -> None:
    """A Hugging Face snapshot is a directory of links into blobs/: the proof is the blobs' identity."""
    snap = tmp_path / "snap"
    snap.mkdir()
    for p in settled.iterdir():
        os.symlink(p, snap / p.name)
    assert [(f.ino, f.size) for f in checkpoint_files(snap) or ()] == [
        (f.ino, f.size) for f in checkpoint_files(settled) or ()
    ]


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16"])
def test_recorded_facts_complete_the_scanned_key(settled: Path, tp_size: int, dtype: str) -> None:
    with plan_rank(RankSpec(settled, tp_rank=tp_size - 1, tp_size=tp_size)) as rp:
        assert rp.facts is not None and rp.facts.files == checkpoint_files(settled)
        deferred = WeightCacheKey.from_checkpoint(settled, tp_rank=tp_size - 1, tp_size=tp_size, dtype=dtype)
        proof = deferred.proof()
        assert proof is not None
        partial, files, sent_dtype = proof
        assert tuple(FileStat(*f) for f in files) == rp.facts.files and sent_dtype == dtype
        assert (
            rp.facts.complete(partial, sent_dtype)
            == _scanned(settled, tp_rank=tp_size - 1, tp_size=tp_size, dtype=dtype).to_wire()
        )


def test_facts_refuse_what_a_scan_would_refuse(settled: Path, tmp_path: Path) -> None:
    with plan_rank(RankSpec(settled)) as rp:
        facts = rp.facts
    assert facts is not None
    partial = {"tp_size": 1, "tp_rank": 0, "layout": 2, "fingerprint_kind": "sampled", "transform": ""}
    with pytest.raises(CheckpointError):
        facts.complete(partial, "int8")
    with pytest.raises(ValueError, match="fingerprint_kind"):
        facts.complete({**partial, "fingerprint_kind": "content"}, "auto")
    with pytest.raises(ValueError, match="tp_size"):
        facts.complete({**partial, "tp_size": 0}, "auto")
    cfg = json.loads((settled / "config.json").read_text())
    other = tmp_path / "other"
    shutil.copytree(settled, other)
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["NoSuchForCausalLM"]}))
    with Checkpoint.open(other) as ckpt:
        unplanned = KeyFacts(facts.files, facts.fingerprint, "sampled", ckpt.architecture, facts.counted, ckpt.config)
    with pytest.raises(ShardingError):
        unplanned.complete({**partial, "tp_size": 2}, "auto")


def test_a_file_changed_just_before_the_read_is_not_recorded(tmp_path: Path, settled: Path) -> None:
    """Racy: a later write in the same timestamp tick would leave the stat as recorded."""
    m = tmp_path / "m"
    shutil.copytree(settled, m)
    with plan_rank(RankSpec(m)) as rp:
        assert rp.facts is None  # every file is seconds old at most
    _settle(m)
    os.utime(m / "config.json")  # one file changed now: still racy
    with plan_rank(RankSpec(m)) as rp:
        assert rp.facts is None
    _settle(m)
    with plan_rank(RankSpec(m)) as rp:
        assert rp.facts is not None


def test_a_file_the_listing_does_not_cover_records_nothing(tmp_path: Path, settled: Path) -> None:
    """An index may name a shard without the .safetensors suffix: a change to it would not show in the proof."""
    m = tmp_path / "m"
    shutil.copytree(settled, m)
    index = json.loads((m / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    os.rename(m / first, m / "shard-1.bin")
    index["weight_map"] = {t: ("shard-1.bin" if f == first else f) for t, f in index["weight_map"].items()}
    (m / "model.safetensors.index.json").write_text(json.dumps(index))
    _settle(m)
    with plan_rank(RankSpec(m)) as rp:
        assert rp.facts is None and rp.key == _scanned(m)


def test_a_file_replaced_between_listing_and_open_records_nothing(
    tmp_path: Path, settled: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The facts describe the files the daemon opened: if one was replaced after the listing, it is not recorded."""
    m = tmp_path / "m"
    shutil.copytree(settled, m)
    _settle(m)
    listed = checkpoint_files(m)
    shard = sorted(m.glob("*.safetensors"))[0]
    copy = m / "copy.tmp"
    shutil.copy2(shard, copy)
    os.replace(copy, shard)  # same bytes, another inode
    with Checkpoint.open(m) as ckpt:
        key = WeightCacheKey.from_spec(RankSpec(m), checkpoint=ckpt)
        assert KeyFacts.recorded(listed, time.time_ns(), ckpt, key) is None
        assert KeyFacts.recorded(checkpoint_files(m), time.time_ns(), ckpt, key) is None  # racy now


@pytest.mark.parametrize("meta", ["config.json", "model.safetensors.index.json"])
def test_a_metadata_file_re_pointed_while_it_was_read_records_nothing(tmp_path: Path, settled: Path, meta: str) -> None:
    """A snapshot's ``config.json`` or index is a symlink into blobs/: re-pointed between the listing and the
    read, and back, the listing's identity is the old blob's and the bytes read are the other's. The facts
    hold the metadata files to the descriptors they were read through, as the shards are (a proof matching
    the old blob was served the other blob's architecture and tensors before)."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snap"
    blobs.mkdir()
    snap.mkdir()
    for p in settled.iterdir():
        shutil.copy2(p, blobs / p.name)
        os.symlink(blobs / p.name, snap / p.name)
    other = blobs / f"other-{meta}"
    data = json.loads((blobs / meta).read_text())
    data["other"] = True
    other.write_text(json.dumps(data))
    _settle(blobs)
    listed = checkpoint_files(snap)
    os.remove(snap / meta)
    os.symlink(other, snap / meta)  # re-pointed after the listing ...
    with Checkpoint.open(snap) as ckpt:
        os.remove(snap / meta)
        os.symlink(blobs / meta, snap / meta)  # ... and back once read
        assert checkpoint_files(snap) == listed
        key = WeightCacheKey.from_spec(RankSpec(snap), checkpoint=ckpt)
        assert KeyFacts.recorded(listed, time.time_ns(), ckpt, key) is None
    with Checkpoint.open(snap) as ckpt:  # nothing moved: recorded
        key = WeightCacheKey.from_spec(RankSpec(snap), checkpoint=ckpt)
        assert KeyFacts.recorded(listed, time.time_ns(), ckpt, key) is not None


def test_a_config_that_appeared_after_the_listing_records_nothing(tmp_path: Path, settled: Path) -> None:
    m = tmp_path / "m"
    shutil.copytree(settled, m)
    config = (m / "config.json").read_text()
    (m / "config.json").unlink()
    _settle(m)
    listed = checkpoint_files(m)
    assert listed is not None and "config.json" not in [f.name for f in listed]
    (m / "config.json").write_text(config)
    with Checkpoint.open(m) as ckpt:
        key = WeightCacheKey.from_spec(RankSpec(m), checkpoint=ckpt)
        assert KeyFacts.recorded(listed, time.time_ns() + 10 * RACY_NS, ckpt, key) is None


def test_the_fingerprint_covers_config_json(tmp_path: Path, settled: Path) -> None:
    """config.json decides how the tensors are served (a quantization_config keeps their stored dtypes, tied
    embeddings are aliased, the FP8 scales' blocks): two checkpoints with the same shards and another
    config.json have other keys, as has one whose config.json was edited after a load."""
    m = tmp_path / "m"
    shutil.copytree(settled, m)
    before = _scanned(m)
    assert before == _scanned(settled)
    config = json.loads((m / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (m / "config.json").write_text(json.dumps(config))
    assert _scanned(m).fingerprint != before.fingerprint
    (m / "config.json").unlink()
    without = _scanned(m)
    assert without.fingerprint not in (before.fingerprint, _scanned(settled).fingerprint)
    (m / "config.json").write_text("")  # an empty config.json is not an absent one
    with pytest.raises(CheckpointError):
        _scanned(m)


def test_a_deferred_key_scans_only_when_a_file_field_is_read(settled: Path) -> None:
    key = WeightCacheKey.from_checkpoint(settled)
    assert not key.scanned and key.proof() is not None
    assert "fingerprint=" not in repr(key) and (key.tp_size, key.tp_rank, key.transform) == (1, 0, "")
    full = _scanned(settled)
    assert not key.scanned  # nothing above read a file-derived field
    assert key == full and full == key and hash(key) == hash(full) and {full: 1}[key] == 1
    assert key.scanned and key.proof() is None and repr(key) == repr(full)


def test_verify_content_and_plan_files_are_scanned_at_once(settled: Path, tmp_path: Path) -> None:
    """A content fingerprint asks for every byte to be read; a plan file is an input the proof does not cover."""
    assert WeightCacheKey.from_checkpoint(settled, verify_content=True).proof() is None
    plan = tmp_path / "plan.json"
    plan.write_text("not a plan")
    with pytest.raises(ShardingError):  # the plan is read now, as before
        WeightCacheKey.from_checkpoint(settled, tp_size=2, plan_file=plan)


def test_adopt_takes_the_served_file_fields_and_refuses_another_rank(settled: Path) -> None:
    full = _scanned(settled).to_wire()
    key = WeightCacheKey.from_checkpoint(settled)
    with pytest.raises(RemoteProtocolError):
        key.adopt({**full, "tp_rank": 1})
    with pytest.raises(RemoteProtocolError):
        key.adopt({k: v for k, v in full.items() if k != "fingerprint"})
    key.adopt(full)
    assert key.to_wire() == full and not key.scanned
    with pytest.raises(RemoteProtocolError):  # known fields: a served key must equal them
        key.adopt({**full, "fingerprint": "0" * 32})


def _shards_named_in_cjk(root: Path, shards: int = 254) -> Path:
    """``shards`` one-tensor files whose names are 81 characters, 237 bytes of UTF-8 (CJK: 3 bytes a character)."""
    import struct

    root.mkdir()
    stem = "\u6a21" * 78
    for i in range(shards):
        header = json.dumps({f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, separators=(",", ":"))
        raw = header.encode() + b" " * (-len(header) % 8)
        (root / f"{i:03d}{stem}.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + struct.pack("<f", i))
    return root


def test_a_proof_of_names_beyond_ascii_keeps_the_pipelined_get_state_inside_its_frame(tmp_path: Path) -> None:
    """The proof's budget counted a name's characters, the frame carries its UTF-8 bytes: 254 shards named in CJK
    passed it with an 80 KB GET_STATE, past the 64 KiB a frame pipelined behind HELLO may take (docs/protocol.md
    §4.3.1, §7), which a daemon ends the connection for. Counted in bytes, such a checkpoint is scanned instead."""
    from wcache.proto.codec import MAX_HANDSHAKE_FRAME
    from wcache.proto.engine import get_state, pack

    key = WeightCacheKey.from_checkpoint(_shards_named_in_cjk(tmp_path / "model"))
    proof = key.proof()
    if proof is not None:
        partial, files, dtype = proof
        assert len(pack(get_state(1, partial, "zero_copy", proof=(files, dtype)))) - 4 <= MAX_HANDSHAKE_FRAME
    assert key.fingerprint  # the scan (or the daemon) gives the key


def test_a_proof_of_a_transform_the_protocol_cannot_carry_is_not_deferred(settled: Path) -> None:
    """A transform over 1024 characters is refused where the key is computed, with the scan's error (TransformError,
    as for any key), not sent in a proof for the daemon to end the connection over."""
    from wcache.errors import TransformError

    with pytest.raises(TransformError, match="1024"):
        WeightCacheKey.from_spec(RankSpec(settled, transform="m:" + "f" * 1100))
