"""Reading a safetensors checkpoint directory without reading its data.

Parses every file's header (8-byte little-endian length + JSON), honours
``model.safetensors.index.json`` and ``config.json``, and validates everything a loader
relies on: known dtypes, sizes that match shapes, offsets inside the file and not
overlapping, and the limits of the protocol that will serve the tensors (docs/protocol.md §7:
names of 1..1024 characters, rank <= 16, dimensions and strides below 2**48; architecture of at
most 1024 characters). Every problem is a :class:`~wcache.errors.CheckpointError` naming the
file, the tensor and the limit. Pure Python (no torch) so that engines can compute keys cheaply.

Every file is opened once, through :func:`wcache.files.open_regular` (regular files only,
metadata size-capped), and its descriptor kept: the fingerprint, the headers and the loader's
reads all use it, so a file replaced after validation cannot be served under the validated key
(docs/security.md, "Checkpoint files"). ``close()`` (or ``with``) releases the descriptors; an
unreferenced Checkpoint releases them when collected.

A key needs only the raw headers and the bytes per dtype (:class:`DtypeBytes`), not a validated
entry per tensor: ``Checkpoint.open(path, tensors=False)`` reads headers written the way the
safetensors library writes them with one regular-expression scan (``_scan_header``; 50,000 tensors
in ~15 ms where parsing and validating them took ~300 ms: docs/performance.md, "The restart weight
path in a fresh engine") and parses any other header in full, so the key is the same either way.
Validating every tensor is the loader's job.
"""

from __future__ import annotations

import hashlib
import operator
import os
import re
import struct
import weakref
from dataclasses import field
from pathlib import Path
from stat import S_ISDIR
from types import TracebackType
from typing import Any

from wcache.errors import CheckpointError
from wcache.files import MAX_CONFIG_BYTES, MAX_INDEX_BYTES, open_regular, parse_json, read_metadata
from wcache.proto._record import record
from wcache.proto.codec import gc_paused
from wcache.proto.fields import MAX_NAME
from wcache.proto.table import DTYPE_SIZES, MAX_DIMS

__all__ = [
    "FLOATING",
    "FP8_DTYPES",
    "SAFETENSORS_DTYPES",
    "Checkpoint",
    "DtypeBytes",
    "TensorInfo",
    "check_directory",
]

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
#: Dtypes a checkpoint's tensors can be cast between (the key's ``dtype`` when not "auto").
FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})
#: FP8 dtypes (served as stored, never cast: wcache.plan.quant)
FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})
#: a weight's FP8 block-scale tensor ends so (wcache.plan.quant.SCALE_SUFFIX)
_SCALE_END = ".weight_scale_inv"
MAX_HEADER = 100 * 1024 * 1024  # the limit safetensors itself applies
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
#: Dimensions and strides a STATE table can carry (docs/protocol.md §4.6: entries below 2**48).
MAX_EXTENT = 1 << 48
#: a tensor's elements (its non-zero dimensions multiplied) are below this: 8-byte elements stay below 2**63 bytes
MAX_ELEMENTS = 1 << 60


@record
class TensorInfo:
    """Where one tensor's bytes lie: ``file`` at absolute byte ``start``, ``nbytes`` long, C order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    nbytes: int


@record
class DtypeBytes:
    """Bytes per dtype over a checkpoint's tensors, in file then header order: all the key's ``dtype`` is
    resolved from (``wcache.plan.key.resolve_dtype``). Each dict lists dtypes in first-seen order (ties go to the
    first, as ``Counter.most_common``)."""

    #: floating dtype -> bytes of every floating tensor
    floating: dict[str, int]
    #: floating dtype -> bytes of floating tensors other than FP8 block scales (``*.weight_scale_inv``)
    weights: dict[str, int]
    #: floating dtype -> bytes of block scales
    scales: dict[str, int]
    #: FP8 dtypes present
    fp8: list[str]

    @classmethod
    def empty(cls) -> DtypeBytes:
        return cls({}, {}, {}, [])

    def add(self, dtype: str, nbytes: int, *, scale: bool) -> None:
        """Count one tensor."""
        if dtype in FLOATING:
            self.floating[dtype] = self.floating.get(dtype, 0) + nbytes
            part = self.scales if scale else self.weights
            part[dtype] = part.get(dtype, 0) + nbytes
        elif dtype in FP8_DTYPES and dtype not in self.fp8:
            self.fp8.append(dtype)

    @classmethod
    def of(cls, tensors: dict[str, TensorInfo]) -> DtypeBytes:
        out = cls.empty()
        for t in tensors.values():
            out.add(t.dtype, t.nbytes, scale=t.name.endswith(_SCALE_END))
        return out


def _close_fds(fds: dict[Path, int]) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def check_directory(root: str | os.PathLike[str]) -> None:
    """CheckpointError unless ``root`` is a directory: one ``stat``, nothing in it read (``wcache-server`` asks
    before it takes its lock, so that a mistyped --model is named as such)."""
    try:
        is_dir = S_ISDIR(os.stat(root).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        is_dir = False
    except (OSError, ValueError) as exc:  # a name too long, a directory not searchable, a NUL byte
        raise CheckpointError(f"checkpoint directory {os.fspath(root)} cannot be read: {exc}") from exc
    if not is_dir:
        raise CheckpointError(f"checkpoint directory {os.fspath(root)} does not exist or is not a directory")


@record(weakref_slot=True)
class Checkpoint:
    """A validated view of a checkpoint directory's metadata (no tensor data read), holding one
    open descriptor per safetensors file (:meth:`fd`)."""

    path: Path
    files: tuple[Path, ...]
    tensors: dict[str, TensorInfo]
    headers: dict[str, bytes]  # file name -> raw JSON header
    config: dict[str, Any]
    fds: dict[Path, int] = field(default_factory=dict, compare=False, repr=False)
    #: bytes per dtype, when opened with ``tensors=False`` (``tensors`` is then empty); else from ``tensors``
    scanned: DtypeBytes | None = field(default=None, compare=False, repr=False)
    #: ``config.json``'s bytes as read (None: the checkpoint has none): a part of the fingerprint
    config_raw: bytes | None = field(default=None, compare=False, repr=False)
    #: the metadata files read (``config.json`` and the index, by name): the ``fstat`` of the descriptor each was
    #: read through, None where it did not exist (what a proof of the files is held to: wcache.plan.facts)
    meta: dict[str, os.stat_result | None] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        weakref.finalize(self, _close_fds, self.fds)

    def dtype_bytes(self) -> DtypeBytes:
        """Bytes per dtype of the checkpoint's tensors (what the key's dtype is resolved from)."""
        return self.scanned if self.scanned is not None else DtypeBytes.of(self.tensors)

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures")
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            return archs[0]
        return ""

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def fd(self, file: Path) -> int:
        """The descriptor ``file`` was validated through; every read of its data goes through it."""
        fd = self.fds.get(file)
        if fd is None:
            raise CheckpointError(f"{file}: not a file of checkpoint {self.path}, or the checkpoint was closed")
        return fd

    def close(self) -> None:
        _close_fds(self.fds)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, tensors: bool = True) -> Checkpoint:
        """Open and validate ``path``. ``tensors=False``: only what a key needs (config, raw headers, bytes
        per dtype; the module docstring) — ``tensors`` is left empty and the tensors are not validated."""
        root = Path(path)
        check_directory(root)
        cfg_path = root / CONFIG_NAME
        cfg = read_metadata(cfg_path, MAX_CONFIG_BYTES, what="config.json")
        meta: dict[str, os.stat_result | None] = {CONFIG_NAME: None if cfg is None else cfg[1]}
        loaded = {} if cfg is None else parse_json(cfg[0], str(cfg_path))
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{cfg_path}: expected a JSON object")
        config: dict[str, Any] = loaded
        _check_architecture(cfg_path, config)
        fds: dict[Path, int] = {}
        try:
            files, expected, meta[INDEX_NAME] = _files(root)
            found: dict[str, TensorInfo] = {}
            headers: dict[str, bytes] = {}
            scanned = None if tensors else _scan_files(files, fds, headers)
            for f in files if scanned is None else ():
                fd, st = open_regular(f, what="safetensors file")
                fds[f] = fd
                raw, infos = _read_header(f, fd, st.st_size)
                headers[f.name] = raw
                for info in infos:
                    if info.name in found:
                        raise CheckpointError(
                            f"tensor {info.name!r} appears in both {found[info.name].file.name} and {f.name}"
                        )
                    found[info.name] = info
            for name, fname in expected.items() if scanned is None else ():
                got = found.get(name)
                if got is None:
                    raise CheckpointError(f"{INDEX_NAME} lists tensor {name!r} in {fname}, but no file holds it")
                if got.file.name != fname:
                    raise CheckpointError(f"{INDEX_NAME} puts {name!r} in {fname}, but it is in {got.file.name}")
            if scanned is None and not found:
                raise CheckpointError(f"{root}: the safetensors files hold no tensors")
        except BaseException:
            _close_fds(fds)
            raise
        if scanned is None and not tensors:  # some header was not the library's format: parsed in full
            scanned = DtypeBytes.of(found)
            found = {}
        return cls(root, tuple(files), found, headers, config, fds, scanned, None if cfg is None else cfg[0], meta)

    def fingerprint(self, *, content: bool = False) -> str:
        """First 32 hex digits of SHA-256 over ``config.json`` (its name and bytes, where the checkpoint has one:
        it decides how tensors are served, e.g. a ``quantization_config``'s dtypes kept as stored or tied
        embeddings), then per file in name order: its name, its raw header and a sample of its data (16 blocks of
        4 KiB at evenly spread offsets) — or, with ``content``, all of its bytes. The sample tells same-shaped
        checkpoints (fine-tunes of one base) apart for ~64 KiB of reads per file; docs/protocol.md §4.3 gives the
        exact bytes. Read through the descriptors the headers were validated from."""
        h = hashlib.sha256()
        if self.config_raw is not None:
            h.update(CONFIG_NAME.encode() + b"\0" + self.config_raw + b"\0")
        for f in self.files:
            header = self.headers[f.name]
            h.update(os.fsencode(f.name) + b"\0" + header + b"\0")
            fd = self.fd(f)
            try:
                if content:
                    pos = 0
                    while chunk := os.pread(fd, 16 << 20, pos):
                        h.update(chunk)
                        pos += len(chunk)
                    continue
                start = 8 + len(header)
                size = os.fstat(fd).st_size - start
                for off in _sample_offsets(size):
                    h.update(os.pread(fd, SAMPLE_BLOCK, start + off))
            except OSError as exc:
                raise CheckpointError(f"{f}: cannot read ({exc})") from exc
        return h.hexdigest()[:32]


def _check_architecture(cfg_path: Path, config: dict[str, Any]) -> None:
    """The architecture becomes a key string on the wire: at most MAX_NAME characters, valid UTF-8."""
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        arch = archs[0]
        if len(arch) > MAX_NAME:
            raise CheckpointError(
                f"{cfg_path}: architecture {arch[:64]!r}... is {len(arch)} characters; key strings are limited "
                f"to {MAX_NAME} (docs/protocol.md §7): shorten architectures[0]"
            )
        if not _utf8(arch):
            raise CheckpointError(f"{cfg_path}: architecture {arch[:64]!r} is not valid Unicode (a lone surrogate)")


def _utf8(s: str) -> bool:
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


SAMPLES = 16
SAMPLE_BLOCK = 4096


def _sample_offsets(data_size: int) -> list[int]:
    """Offsets (from the start of the data section) of the sampled blocks: all of it when small."""
    if data_size <= SAMPLES * SAMPLE_BLOCK:
        return list(range(0, data_size, SAMPLE_BLOCK))
    last = data_size - SAMPLE_BLOCK
    return [i * last // (SAMPLES - 1) for i in range(SAMPLES)]


def _files(root: Path) -> tuple[list[Path], dict[str, str], os.stat_result | None]:
    """The checkpoint's safetensors files, the index's tensor->file map if there is one, and the ``fstat`` of the
    index as read (None: no index)."""
    index = root / INDEX_NAME
    read = read_metadata(index, MAX_INDEX_BYTES, what="index")
    if read is not None:
        data = parse_json(read[0], str(index))
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{index}: unusable index (weight_map must map tensor names to file names)")
        names = sorted(set(weight_map.values()))
        files = []
        for n in names:
            if "/" in n or "\0" in n or n in ("", ".", ".."):
                raise CheckpointError(f"{index} names shard {n[:256]!r}, which is not a file name in {root}")
            p = root / n
            if not (p.exists() or p.is_symlink()):
                raise CheckpointError(f"{index} names shard {n!r}, which is missing from {root}")
            files.append(p)  # opened (and its type checked) by Checkpoint.open
        return files, dict(weight_map), read[1]
    # every *.safetensors entry counts, whatever its type: a FIFO or a directory is refused when opened,
    # not skipped (skipping would serve a checkpoint with missing tensors)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files (and no {INDEX_NAME})")
    return files, {}, None


def _pread_exact(fd: int, n: int, off: int) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < n:
        chunk = os.pread(fd, min(n - got, 16 << 20), off + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _read_raw_header(path: Path, fd: int, size: int) -> bytes:
    """The raw JSON header of the file open as ``fd`` (``size`` bytes by its fstat), its length checked."""
    try:
        head = _pread_exact(fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated (shorter than the 8-byte header length)")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > MAX_HEADER or 8 + hlen > size:
            raise CheckpointError(f"{path}: header length {hlen} runs past the end of the file ({size} bytes)")
        raw = _pread_exact(fd, hlen, 8)
        if len(raw) < hlen:
            raise CheckpointError(f"{path}: truncated inside its header")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from exc
    return raw


#: The header as the safetensors library writes it (serde_json: no whitespace but the trailing padding, no
#: escapes, the metadata map first, then each tensor's keys in this order). ``_scan_header`` reads only headers made of exactly these.
_META = rb'\{"__metadata__":\{(?:"[^"\\]*":"[^"\\]*"(?:,"[^"\\]*":"[^"\\]*")*)?\}'
_NUM = rb"(?:0|[1-9][0-9]*)"
_ENTRY = (
    rb',"([^"\\]*)":\{"dtype":"([A-Z0-9_]+)","shape":\[((?:' + _NUM + rb"(?:," + _NUM + rb")*)?)\],"
    rb'"data_offsets":\[(' + _NUM + rb"),(" + _NUM + rb")\]\}"
)
_compiled: dict[bytes, re.Pattern[bytes]] = {}


def _pattern(source: bytes) -> re.Pattern[bytes]:
    """A scan pattern, compiled on first use (not at import: an engine's restart imports this module)."""
    p = _compiled.get(source)
    if p is None:
        p = _compiled[source] = re.compile(source)
    return p


#: bytes of an entry besides its five groups
_ENTRY_FIXED = len(b',"":{"dtype":"","shape":[],"data_offsets":[,]}')


def _scan_header(raw: bytes, data_size: int, names: set[bytes], out: DtypeBytes) -> bool:
    """Count one header's tensors into ``out`` without parsing it, when the header is exactly the safetensors
    library's format: every byte belongs to the metadata map or a canonical entry (the entries tile it), no
    escapes, valid UTF-8, names new (``names``: those of the files before) and at most MAX_NAME long, known
    dtypes, offsets within the data. None for anything else: the caller parses that header in full, which
    raises whatever is wrong with it or counts it the same way. True when counted."""
    raw = raw.rstrip(b" ")  # the library pads the header with spaces to a multiple of 8 bytes
    if b"\\" in raw or raw[-1:] != b"}":
        return False
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    meta = _pattern(_META).match(raw) if raw.startswith(b'{"__metadata__":') else None
    body = raw[meta.end() : -1] if meta else b"," + raw[1:-1]
    if (meta is None and raw[:1] != b"{") or body[:1] not in (b",", b""):
        return False
    entries = _pattern(_ENTRY).findall(body)
    if not entries:
        return False
    cols: list[tuple[bytes, ...]] = list(zip(*entries, strict=True))
    tensor_names, tags, _, begins, ends = cols
    if sum(sum(map(len, c)) for c in cols) + _ENTRY_FIXED * len(entries) != len(body):
        return False  # something between or around the entries: not the library's format
    known = len(names)
    names.update(tensor_names)
    if len(names) != known + len(entries) or b"__metadata__" in tensor_names:
        return False  # a name repeated (json.loads would keep the last), or a tensor called __metadata__
    if max(map(len, tensor_names)) > MAX_NAME or min(map(len, tensor_names)) == 0:
        return False
    first = list(map(int, begins))
    last = list(map(int, ends))
    if max(last) > data_size or not all(map(operator.le, first, last)):
        return False
    dtypes = [SAFETENSORS_DTYPES.get(t.decode()) for t in dict.fromkeys(tags)]
    if None in dtypes:
        return False
    if len(dtypes) == 1 and b'_scale_inv"' not in raw:
        dtype = dtypes[0]
        assert dtype is not None
        out.add(dtype, sum(last) - sum(first), scale=False)
        return True
    for name, tag, b, e in zip(tensor_names, tags, first, last, strict=True):
        out.add(SAFETENSORS_DTYPES[tag.decode()], e - b, scale=name.endswith(b".weight_scale_inv"))
    return True


def _scan_files(files: list[Path], fds: dict[Path, int], headers: dict[str, bytes]) -> DtypeBytes | None:
    """Open every file and read its raw header into ``headers`` (descriptors into ``fds``); the bytes per
    dtype of all of them when every header scans (``_scan_header``), else None (the caller parses them)."""
    out = DtypeBytes.empty()
    names: set[bytes] = set()
    scans = True
    for f in files:
        fd, st = open_regular(f, what="safetensors file")
        fds[f] = fd
        raw = _read_raw_header(f, fd, st.st_size)
        headers[f.name] = raw
        if scans:
            with gc_paused(len(raw)):  # ~5 objects per tensor, none in a cycle
                scans = _scan_header(raw, st.st_size - 8 - len(raw), names, out)
    if not scans:
        _close_fds(fds)
        headers.clear()
        return None
    return out


def _read_header(path: Path, fd: int, size: int) -> tuple[bytes, list[TensorInfo]]:
    """Parse and validate the header of the file open as ``fd`` (``size`` bytes by its fstat)."""
    raw = _read_raw_header(path, fd, size)
    hlen = len(raw)
    header = parse_json(raw, f"{path}: header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start = 8 + hlen
    data_size = size - data_start
    infos: list[TensorInfo] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name[:128]!r}"
        _check_name(where, name)
        if not isinstance(meta, dict):
            raise CheckpointError(f"{where}: entry is not an object")
        tag = meta.get("dtype")
        dtype = SAFETENSORS_DTYPES.get(tag) if isinstance(tag, str) else None
        if dtype is None:
            raise CheckpointError(f"{where}: unknown dtype {tag!r}")
        shape = meta.get("shape")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise CheckpointError(f"{where}: shape {str(shape)[:128]} is not a list of non-negative integers")
        _check_shape(where, shape)
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


def _check_name(where: str, name: str) -> None:
    """A tensor name travels in STATE tables: 1..MAX_NAME characters of valid Unicode (§4.6)."""
    if not 1 <= len(name) <= MAX_NAME:
        raise CheckpointError(
            f"{where}: the name is {len(name)} characters; tensor names must be 1..{MAX_NAME} characters "
            "(docs/protocol.md §7), so this checkpoint cannot be served: rename the tensor"
        )
    if not _utf8(name):
        raise CheckpointError(f"{where}: the name is not valid Unicode (a lone surrogate); rename the tensor")


def _check_shape(where: str, shape: list[int]) -> None:
    """Rank <= MAX_DIMS; every dimension and C-order stride below 2**48 (§4.6); the product of the non-zero
    dimensions below 2**60, so that its bytes, in any dtype, are below the 2**63 a view's size takes (an empty
    tensor's other dimensions too: torch multiplies them all, docs/protocol.md §4.6)."""
    if len(shape) > MAX_DIMS:
        raise CheckpointError(
            f"{where}: rank {len(shape)} is over the protocol's limit of {MAX_DIMS} dimensions (docs/protocol.md §7)"
        )
    stride = 1
    for s in reversed(shape):
        if s >= MAX_EXTENT or stride >= MAX_EXTENT:
            raise CheckpointError(
                f"{where}: shape {shape} has a dimension or stride of 2**48 or more, over the protocol's limit "
                "(docs/protocol.md §4.6)"
            )
        stride *= max(s, 1)
    if stride >= MAX_ELEMENTS:
        raise CheckpointError(
            f"{where}: shape {shape} has 2**60 elements or more (its non-zero dimensions multiplied), over what a "
            "view's size in bytes may take (docs/protocol.md §4.6)"
        )
