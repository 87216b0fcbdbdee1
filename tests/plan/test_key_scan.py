"""The key's header scan (docs/performance.md, "The restart weight path in a fresh engine"):
``WeightCacheKey.from_checkpoint`` reads headers the safetensors library wrote without building an object per
tensor, and gets the key the full parse gets, for every header: those the scan reads, and those it hands to the
full parse (other writers, escapes, duplicates, bad input)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from wcache import CheckpointError, WeightCacheKey
from wcache.plan import checkpoint as ckpt_mod
from wcache.plan.checkpoint import Checkpoint, DtypeBytes
from wcache.plan.key import RankSpec


def _full_key(path: Path, **fields: Any) -> WeightCacheKey:
    """The key through the validated, parsed checkpoint (the daemon's way)."""
    with Checkpoint.open(path) as c:
        return WeightCacheKey.from_spec(RankSpec(path, **fields), checkpoint=c)


def _scanned(path: Path) -> DtypeBytes | None:
    """The bytes per dtype the scan alone finds (None: some header was handed to the full parse)."""
    fds: dict[Path, int] = {}
    try:
        files = sorted(path.glob("*.safetensors"))
        return ckpt_mod._scan_files(files, fds, {})
    finally:
        ckpt_mod._close_fds(fds)


def _library_checkpoint(root: Path, shards: list[dict[str, torch.Tensor]], **kw: Any) -> Path:
    root.mkdir()
    for i, tensors in enumerate(shards):
        save_file(tensors, str(root / f"model-{i:05d}.safetensors"), **kw)
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return root


CASES: dict[str, tuple[list[dict[str, torch.Tensor]], dict[str, Any]]] = {
    "one dtype": ([{f"l.{i}.weight": torch.ones(3, 5, dtype=torch.bfloat16) for i in range(7)}], {}),
    "mixed dtypes, two shards, a tie": (
        [
            {"a.weight": torch.ones(4, dtype=torch.float16), "b.weight": torch.ones(2, dtype=torch.float32)},
            {"c.bias": torch.ones(8, dtype=torch.int8), "d": torch.ones((), dtype=torch.float64)},
        ],
        {},
    ),
    "metadata and an empty tensor": (
        [{"x": torch.ones(0, 4, dtype=torch.float16), "y.weight": torch.ones(16, dtype=torch.float16)}],
        {"metadata": {"format": "pt", "note": "fine-tune 3"}},
    ),
    "fp8 with block scales": (
        [
            {
                "l.weight": torch.ones(8, 8).to(torch.float8_e4m3fn),
                "l.weight_scale_inv": torch.ones(1, 1, dtype=torch.float32),
                "norm.weight": torch.ones(8, dtype=torch.bfloat16),
            }
        ],
        {},
    ),
    "non-ASCII names": ([{"größe.weight": torch.ones(2, dtype=torch.float16)}], {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_library_headers_are_scanned_and_give_the_full_key(tmp_path: Path, case: str) -> None:
    shards, kw = CASES[case]
    model = _library_checkpoint(tmp_path / "m", shards, **kw)
    assert _scanned(model) is not None, "a header the safetensors library wrote must not need a full parse"
    with Checkpoint.open(model) as c, Checkpoint.open(model, tensors=False) as light:
        assert light.tensors == {}
        assert light.dtype_bytes() == c.dtype_bytes()
    assert WeightCacheKey.from_checkpoint(model) == _full_key(model)


def test_the_key_builds_no_tensor_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old key parsed and validated every entry (590 ms for 50,000 tensors on the H200)."""
    model = _library_checkpoint(tmp_path / "m", [{f"e.{i}.w": torch.ones(2, dtype=torch.bfloat16) for i in range(300)}])
    want = _full_key(model)

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("the key parsed a header the scan reads")

    monkeypatch.setattr(ckpt_mod, "_read_header", refuse)
    monkeypatch.setattr(ckpt_mod, "TensorInfo", refuse)
    assert WeightCacheKey.from_checkpoint(model) == want


def _raw_checkpoint(root: Path, header: bytes, data: bytes, pad: bool = True) -> Path:
    root.mkdir()
    blob = header + (b" " * (-len(header) % 8) if pad else b"")
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return root


#: headers the scan must hand to the full parse; each still gets the full parse's key
FALLBACKS = {
    "whitespace (json.dumps)": b'{"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}',
    "other key order": b'{"a":{"shape":[2],"dtype":"F16","data_offsets":[0,4]}}',
    "escaped name": b'{"a\\u0062":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}',
    "duplicate name: the last wins": (
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}'
    ),
    "metadata not first": (b'{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"__metadata__":{"k":"v"}}'),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_other_headers_take_the_full_parse_and_give_its_key(tmp_path: Path, case: str) -> None:
    model = _raw_checkpoint(tmp_path / "m", FALLBACKS[case], bytes(4))
    assert _scanned(model) is None
    assert WeightCacheKey.from_checkpoint(model) == _full_key(model)


@pytest.mark.parametrize(
    "header",
    [
        b'{"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,4]}}',  # unknown dtype
        b'{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,64]}}',  # past the data
        b'{"a":{"dtype":"F16","shape":[2],"data_offsets":[00,4]}}',  # not JSON
        b'{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},}',  # not JSON
        b'{"__metadata__":{"k":"v"}}',  # no tensors
    ],
)
def test_bad_headers_are_still_a_checkpoint_error(tmp_path: Path, header: bytes) -> None:
    model = _raw_checkpoint(tmp_path / "m", header, bytes(4))
    with pytest.raises(CheckpointError):  # the scan runs when the key is resolved (a deferred key: §4.3.1)
        WeightCacheKey.from_checkpoint(model).resolve()


def test_fp8_dtype_rules_hold_on_the_scanned_path(tmp_path: Path) -> None:
    shards, _ = CASES["fp8 with block scales"]
    model = _library_checkpoint(tmp_path / "m", shards)
    assert WeightCacheKey.from_checkpoint(model).dtype == "bfloat16"
    with pytest.raises(CheckpointError, match="FP8 checkpoint"):
        WeightCacheKey.from_checkpoint(model, dtype="float16").resolve()


@pytest.mark.parametrize(
    "name", ["a" * 300, "a/" * 3000, "absent", "bad\0name"], ids=["name too long", "path too long", "absent", "NUL"]
)
def test_a_directory_the_os_refuses_is_a_checkpoint_error(tmp_path: Path, name: str) -> None:
    """A key's directory the system refuses to look up (ENAMETOOLONG; a NUL byte) is a CheckpointError, which an
    engine's fallback catches, as an absent one is; it was a bare OSError (pathlib's ``is_dir`` passes on only
    some errnos as False)."""
    with pytest.raises(CheckpointError, match="checkpoint directory"):
        WeightCacheKey.from_checkpoint(tmp_path / name)
