"""Reading a safetensors checkpoint directory without reading its data.

Parses every file's header (8-byte little-endian length + JSON), honours
``model.safetensors.index.json`` and ``config.json``, and validates everything a loader
relies on: known dtypes, sizes that match shapes, offsets inside the file and not
overlapping. Every problem is a :class:`~wcache.errors.CheckpointError` naming the file
and the tensor. Pure Python (no torch) so that engines can compute keys cheaply.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wcache.errors import CheckpointError
from wcache.proto.frames import DTYPE_SIZES

__all__ = ["Checkpoint", "SAFETENSORS_DTYPES", "TensorInfo"]

#: safetensors dtype tag -> wcache/torch dtype name
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
MAX_HEADER = 100 * 1024 * 1024  # the limit safetensors itself applies
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor's bytes lie: ``file`` at absolute byte ``start``, ``nbytes`` long, C order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    nbytes: int


@dataclass(frozen=True)
class Checkpoint:
    """A validated view of a checkpoint directory's metadata (no tensor data read)."""

    path: Path
    files: tuple[Path, ...]
    tensors: dict[str, TensorInfo]
    headers: dict[str, bytes]  # file name -> raw JSON header
    config: dict[str, Any]

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures")
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            return archs[0]
        return ""

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Checkpoint:
        root = Path(path)
        if not root.is_dir():
            raise CheckpointError(f"checkpoint directory {root} does not exist or is not a directory")
        config: dict[str, Any] = {}
        cfg_path = root / "config.json"
        if cfg_path.exists():
            try:
                loaded = json.loads(cfg_path.read_text())
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{cfg_path}: not valid JSON ({exc})") from exc
            if not isinstance(loaded, dict):
                raise CheckpointError(f"{cfg_path}: expected a JSON object")
            config = loaded
        files, expected = _files(root)
        tensors: dict[str, TensorInfo] = {}
        headers: dict[str, bytes] = {}
        for f in files:
            raw, infos = _read_header(f)
            headers[f.name] = raw
            for info in infos:
                if info.name in tensors:
                    raise CheckpointError(
                        f"tensor {info.name!r} appears in both {tensors[info.name].file.name} and {f.name}"
                    )
                tensors[info.name] = info
        for name, fname in expected.items():
            got = tensors.get(name)
            if got is None:
                raise CheckpointError(f"{INDEX_NAME} lists tensor {name!r} in {fname}, but no file holds it")
            if got.file.name != fname:
                raise CheckpointError(f"{INDEX_NAME} puts {name!r} in {fname}, but it is in {got.file.name}")
        if not tensors:
            raise CheckpointError(f"{root}: the safetensors files hold no tensors")
        return cls(root, tuple(files), tensors, headers, config)

    def fingerprint(self, *, content: bool = False) -> str:
        """First 32 hex digits of SHA-256 over, per file in name order: its name, its raw header and a
        sample of its data (16 blocks of 4 KiB at evenly spread offsets) — or, with ``content``, all of
        its bytes. The sample tells same-shaped checkpoints (fine-tunes of one base) apart for ~64 KiB
        of reads per file; docs/protocol.md §4.3 gives the exact offsets."""
        h = hashlib.sha256()
        for f in self.files:
            header = self.headers[f.name]
            h.update(f.name.encode() + b"\0" + header + b"\0")
            with open(f, "rb") as fh:
                if content:
                    while chunk := fh.read(16 << 20):
                        h.update(chunk)
                    continue
                start = 8 + len(header)
                size = os.fstat(fh.fileno()).st_size - start
                for off in _sample_offsets(size):
                    h.update(os.pread(fh.fileno(), SAMPLE_BLOCK, start + off))
        return h.hexdigest()[:32]


SAMPLES = 16
SAMPLE_BLOCK = 4096


def _sample_offsets(data_size: int) -> list[int]:
    """Offsets (from the start of the data section) of the sampled blocks: all of it when small."""
    if data_size <= SAMPLES * SAMPLE_BLOCK:
        return list(range(0, data_size, SAMPLE_BLOCK))
    last = data_size - SAMPLE_BLOCK
    return [i * last // (SAMPLES - 1) for i in range(SAMPLES)]


def _files(root: Path) -> tuple[list[Path], dict[str, str]]:
    """The checkpoint's safetensors files, and the index's tensor->file map if there is one."""
    index = root / INDEX_NAME
    if index.exists():
        try:
            data = json.loads(index.read_text())
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise TypeError("weight_map must map strings to strings")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unusable index ({exc})") from exc
        names = sorted(set(weight_map.values()))
        files = []
        for n in names:
            p = root / n
            if "/" in n or not p.is_file():
                raise CheckpointError(f"{index} names shard {n!r}, which is missing from {root}")
            files.append(p)
        return files, dict(weight_map)
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files (and no {INDEX_NAME})")
    return files, {}


def _read_header(path: Path) -> tuple[bytes, list[TensorInfo]]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated (shorter than the 8-byte header length)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER or 8 + hlen > size:
                raise CheckpointError(f"{path}: header length {hlen} runs past the end of the file ({size} bytes)")
            raw = fh.read(hlen)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from exc
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start = 8 + hlen
    data_size = size - data_start
    infos: list[TensorInfo] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(meta, dict):
            raise CheckpointError(f"{where}: entry is not an object")
        tag = meta.get("dtype")
        dtype = SAFETENSORS_DTYPES.get(tag) if isinstance(tag, str) else None
        if dtype is None:
            raise CheckpointError(f"{where}: unknown dtype {tag!r}")
        shape = meta.get("shape")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        offs = meta.get("data_offsets")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(type(o) is int and o >= 0 for o in offs)
            or offs[0] > offs[1]
        ):
            raise CheckpointError(f"{where}: data_offsets {offs!r} are not [begin, end]")
        n = 1
        for s in shape:
            n *= s
        nbytes = n * DTYPE_SIZES[dtype]
        if offs[1] - offs[0] != nbytes:
            raise CheckpointError(
                f"{where}: shape {shape} of {dtype} needs {nbytes} bytes, data_offsets span {offs[1] - offs[0]}"
            )
        if offs[1] > data_size:
            raise CheckpointError(
                f"{where}: data_offsets end at {offs[1]}, past the {data_size} data bytes (truncated file?)"
            )
        infos.append(TensorInfo(name, dtype, tuple(shape), path, data_start + offs[0], nbytes))
    ordered = sorted(infos, key=lambda t: t.start)
    for a, b in zip(ordered, ordered[1:]):
        if a.nbytes and b.nbytes and b.start < a.start + a.nbytes:
            raise CheckpointError(f"{path}: tensors {a.name!r} and {b.name!r} overlap")
    return raw, infos
