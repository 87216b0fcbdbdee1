"""The request and the cache key: which rank is asked for, and which bytes a daemon serves for it, computed
the same way by daemon and engine.

A ``RankSpec`` is the one description of a rank — checkpoint directory, tensor parallel rank and size, dtype,
shard plan file, load-time transform, fingerprint kind — that the key, the planner (``wcache.plan.rank``), the
daemon's loader, the client's PRELOAD, ``wcache.nn`` and the ``wcache-server`` CLI all take, so that they agree
(spelt out field by field, a PRELOAD's "already held" check once lost ``verify_content``, and
``nn.load_weights``'s key ``transform``). Every API that acts on a rank takes one; ``from_checkpoint`` is the
engines' keyword form of ``from_spec``.

A key names a checkpoint (fingerprint of its file names, headers and a data sample), the rank's
sharding and dtype, and the slab layout version. The daemon refuses a GET_STATE whose
key differs in any field and names those fields (``KEY_MISMATCH``).

Four fields come from the checkpoint's files (``fingerprint``, ``architecture``, ``dtype``, ``plan``), and
computing them means reading every header (4 ms for a dense 16 GB checkpoint, 120 ms for a 50,000-tensor
MoE). A daemon has computed them already, from the very files, when it read them. So an engine proves the
files instead (docs/protocol.md §4.3.1): ``from_checkpoint`` lists the directory and ``stat``s the files a key
covers (:func:`stated_files`), and ``fetch`` sends that identity with GET_STATE; the daemon completes the
key from what it recorded (``wcache.plan.facts``, the daemon's side) when those files, unchanged since, were
read. The header scan
runs only when a file-derived field is read first (:meth:`WeightCacheKey.resolve`), or when the daemon does
not recognise the files — then fetch retries with the full key on the same connection. So this module imports
the domain modules below it (checkpoint, quant, sharding) inside the functions that scan headers: an engine whose
key the daemon proves never loads them (tests/client/test_imports.py). Likewise the error tree and the frame
declarations (every error, and the proof as the frames carry it) load where they are used: an engine's restart
imports neither for its key.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcache.proto._record import field_defaults, record
from wcache.proto.engine import FileId
from wcache.proto.limits import MAX_NAME, MAX_PROOF_FILES

if TYPE_CHECKING:  # imported where the header scan runs, and where the daemon's side and the errors are used
    from wcache.errors import WCacheError
    from wcache.plan.checkpoint import Checkpoint
    from wcache.plan.sharding import ShardPlan
    from wcache.proto.admin_frames import Preload

#: Bump when placement rules change (wcache.plan.layout): a cached slab of another layout is another key. Defined
#: here, with the key that carries it, and nowhere else: the layout sits below the key and an engine's restart
#: imports the key without it (tests/plan/test_layout.py).
LAYOUT_VERSION = 2  # 2: quantized checkpoints keep their stored dtypes (docs/protocol.md §4.4)

__all__ = [
    "RankSpec",
    "WeightCacheKey",
    "check_tp",
    "stated_files",
    "tp_problem",
]

#: a key field's value (``str | int``: a types.UnionType, ~1 µs, where typing.Union's first subscription in an engine
#: costs ~65 µs of its import)
KeyValue = str | int

PathLike = str | os.PathLike[str]


def tp_problem(tp_rank: object, tp_size: object, *, flags: bool = False) -> str | None:
    """What is wrong with a tensor-parallel rank and world size, in words (None: nothing). The one range
    check of every place that takes ranks: RankSpec (keys, PRELOAD, ``wcache.nn``), ``wcache-server`` and
    ``wcache preload`` / ``evict``; ``flags`` names them as the command lines do (``--tp-rank``)."""
    rank, size = ("--tp-rank", "--tp-size") if flags else ("tp_rank", "tp_size")
    for name, value in ((size, tp_size), (rank, tp_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name} must be an integer, got {value!r}"
    assert isinstance(tp_rank, int) and isinstance(tp_size, int)
    if tp_size < 1:
        return f"{size} {tp_size} must be at least 1 (1: one rank serves whole tensors)"
    if not 0 <= tp_rank < tp_size:
        last = f"0..{tp_size - 1}" if tp_size > 1 else "0"
        return f"{rank} {tp_rank} must be in [0, {tp_size}) for {size} {tp_size} (ranks {last})"
    return None


def check_tp(tp_rank: object, tp_size: object) -> None:
    """Raise ShardingError (INVALID_PLAN on the wire) for a rank outside ``[0, tp_size)`` or a size below 1."""
    problem = tp_problem(tp_rank, tp_size)
    if problem is not None:
        from wcache.errors import ShardingError

        raise ShardingError(problem, details={"tp_rank": repr(tp_rank), "tp_size": repr(tp_size)})


@record
class RankSpec:
    """One rank of a checkpoint as a request names it. Immutable and hashable; build variants with
    ``dataclasses.replace``.

    ``checkpoint`` and ``plan_file`` are made absolute (a PRELOAD names paths on the daemon's machine);
    ``dtype`` ``None`` (or ``"auto"``) means as stored. ``verify_content`` fingerprints all data instead
    of a sample (the key's ``fingerprint_kind``); it is the daemon's policy (``--verify-content``), not a
    PRELOAD field."""

    checkpoint: Path
    tp_rank: int = 0
    tp_size: int = 1
    dtype: str | None = None
    plan_file: Path | None = None
    transform: str = ""
    verify_content: bool = False

    def __post_init__(self) -> None:
        check_tp(self.tp_rank, self.tp_size)
        object.__setattr__(self, "checkpoint", Path(os.path.abspath(self.checkpoint)))
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", None)
        if self.plan_file is not None and str(self.plan_file) == "":
            object.__setattr__(self, "plan_file", None)
        elif self.plan_file is not None:
            object.__setattr__(self, "plan_file", Path(os.path.abspath(self.plan_file)))

    @classmethod
    def from_preload(cls, req: Preload, *, verify_content: bool = False) -> RankSpec:
        """The rank a PRELOAD frame names, under the daemon's fingerprint policy."""
        return cls(
            Path(req.model),
            tp_rank=req.tp_rank,
            tp_size=req.tp_size,
            dtype=req.dtype,
            plan_file=Path(req.plan_file) if req.plan_file else None,
            transform=req.transform,
            verify_content=verify_content,
        )

    def to_preload(self, id: int) -> Preload:
        """The PRELOAD frame asking a daemon for this rank (``verify_content`` is the daemon's choice)."""
        from wcache.proto.admin_frames import Preload  # not an engine's frame: its restart never builds it

        return Preload(
            id=id,
            model=str(self.checkpoint),
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            dtype=self.dtype or "auto",
            plan_file=str(self.plan_file) if self.plan_file is not None else "",
            transform=self.transform,
        )


class _Unset:
    """``plan`` not given to ``from_spec`` (None is a resolved plan: none)."""


_UNSET = _Unset()


#: a key field over the protocol's string limit -> the error class (of ``wcache.errors``) of the input it came from,
#: and what to do
_TOO_LONG: dict[str, tuple[str, str]] = {
    "architecture": ("CheckpointError", "shorten config.json's architectures[0]"),
    "plan": ("ShardingError", "use a shorter plan id"),
    "transform": ("TransformError", "use a shorter module:function path for the transform"),
}


@record
class WeightCacheKey:
    """Identity of one rank's weights. Field names and types are part of the wire format (§4.3)."""

    fingerprint: str
    architecture: str
    tp_size: int
    tp_rank: int
    dtype: str
    plan: str = "none"
    layout: int = LAYOUT_VERSION
    fingerprint_kind: str = "sampled"  # "sampled" (names, headers, 16 data blocks per file) | "content"
    transform: str = ""  # load-time transform spec (wcache.transforms), "" for none

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: PathLike,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: str | None = None,
        plan_file: PathLike | None = None,
        transform: str = "",
        verify_content: bool = False,
    ) -> WeightCacheKey:
        """The key a daemon started with the same arguments serves: the engine's call. The keywords are
        RankSpec's fields (``plan_file`` ``None`` or ``""``: no plan file); ``from_spec`` is the same for a
        RankSpec, and says what is read when."""
        plan = Path(plan_file) if plan_file else None
        spec = RankSpec(Path(model_dir), tp_rank, tp_size, dtype, plan, transform, verify_content)
        return cls.from_spec(spec)

    @classmethod
    def from_spec(
        cls, spec: RankSpec, *, checkpoint: Checkpoint | None = None, plan: ShardPlan | _Unset | None = _UNSET
    ) -> WeightCacheKey:
        """The key of one rank.

        Given neither ``checkpoint`` nor ``plan``, and where the files can prove it (no ``plan_file``, no
        ``verify_content``, a directory whose files :func:`checkpoint_files` can state), the key is *deferred*:
        only the directory is listed and its files ``stat``ed here, ``fetch`` proves them to the daemon
        (docs/protocol.md §4.3.1), and the header scan runs only if a file-derived field is read first,
        :meth:`resolve` is called, or the daemon does not recognise the files. Its errors are raised there.

        Otherwise (and by :meth:`resolve`) it reads headers and 64 KiB of data per file (all data with
        ``spec.verify_content``), through the descriptors ``checkpoint`` validated them from (a checkpoint
        opened here is closed before returning); ``plan``: the rank's shard plan when the caller resolved it
        already (``wcache.plan.rank.plan_rank``).

        Raises CheckpointError / ShardingError, and for a key string the protocol cannot carry (over
        1024 characters, docs/protocol.md §7) the class of whatever it came from (``_TOO_LONG``)."""
        if (
            checkpoint is None
            and isinstance(plan, _Unset)
            and spec.plan_file is None
            and not spec.verify_content
            and len(spec.transform) <= MAX_NAME  # else the scan's error names it (_TOO_LONG), as for any key
        ):
            files = stated_files(spec.checkpoint)
            if files is not None:
                return _DeferredKey.of(spec, files)
        return cls._scanned(spec, checkpoint, plan)

    @classmethod
    def _scanned(
        cls, spec: RankSpec, checkpoint: Checkpoint | None, plan: ShardPlan | _Unset | None = _UNSET
    ) -> WeightCacheKey:
        """The key from the files' headers (and data sample)."""
        if checkpoint is None:  # the key's own: headers and bytes per dtype, not a validated entry per tensor
            from wcache.plan.checkpoint import Checkpoint  # the header scan's: a proven key never loads it

            with Checkpoint.open(spec.checkpoint, tensors=False) as ckpt:
                return cls._scanned(spec, ckpt, plan)
        ckpt = checkpoint
        if isinstance(plan, _Unset):
            plan = None
            if spec.tp_size != 1 or spec.plan_file is not None:  # else no plan: sharding not imported
                from wcache.plan.sharding import resolve_plan  # the header scan's (a proven key never loads it)

                plan = resolve_plan(
                    ckpt.architecture, spec.tp_size, spec.plan_file, has_config=ckpt.config_raw is not None
                )

        from wcache.plan.quant import resolve_dtype  # the header scan's, like the checkpoint

        key = WeightCacheKey(
            fingerprint=ckpt.fingerprint(content=spec.verify_content),
            architecture=ckpt.architecture,
            tp_size=spec.tp_size,
            tp_rank=spec.tp_rank,
            dtype=resolve_dtype(ckpt.dtype_bytes(), ckpt.config, spec.dtype),
            plan=plan.id if plan is not None else "none",
            layout=LAYOUT_VERSION,
            fingerprint_kind="content" if spec.verify_content else "sampled",
            transform=spec.transform,
        )
        for name, value in key.to_wire().items():
            if isinstance(value, str) and len(value) > MAX_NAME:
                import wcache.errors

                err_name, fix = _TOO_LONG.get(name, ("CheckpointError", "check the checkpoint's config.json"))
                err: type[WCacheError] = getattr(wcache.errors, err_name)
                raise err(
                    f"key field {name!r} is {len(value)} characters; the protocol carries at most {MAX_NAME} "
                    f"(docs/protocol.md §7): {fix}"
                )
        return key

    def resolve(self) -> WeightCacheKey:
        """Every field computed now (a deferred key scans its checkpoint's headers here, raising what the scan
        raises); returns ``self``."""
        return self

    @property
    def scanned(self) -> bool:
        """Whether this process read the checkpoint's headers for this key (False for a key whose file-derived
        fields the daemon supplied: docs/protocol.md §4.3.1)."""
        return True

    def proof(self) -> tuple[dict[str, KeyValue], tuple[FileId, ...], str] | None:
        """For a deferred key: (the key map less the file-derived fields, the files, the dtype asked for): a
        GET_STATE's key and its CheckpointProof (docs/protocol.md §4.3.1); None for a key whose fields are all known
        (send ``to_wire()``)."""
        return None

    def adopt(self, served: dict[str, Any]) -> None:
        """Take the file-derived fields from the key a daemon served for :meth:`proof` (the rest must be this
        key's: ProtocolError otherwise). A known key only checks that ``served`` equals it."""
        if self.diff_wire(served):
            from wcache.errors import RemoteProtocolError

            raise RemoteProtocolError(
                f"the daemon served key {served} for the request {self.to_wire()}", details={"served": served}
            )

    def to_wire(self) -> dict[str, KeyValue]:
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> WeightCacheKey:
        """Build from a validated wire map; missing fields take their defaults, extra ones are
        ignored here (``diff_wire`` reports them)."""
        known = {name: m[name] for name in _FIELDS if name in m}
        return cls(**known)

    def diff_wire(self, requested: dict[str, Any]) -> dict[str, list[Any]]:
        """Fields where ``requested`` differs from this key: name -> [served, requested].

        A field absent from ``requested`` counts as its default; a field this daemon does
        not know is always a difference (the client expects something we cannot promise).
        """
        served = self.to_wire()
        out: dict[str, list[Any]] = {}
        defaults = _DEFAULTS
        for name, value in served.items():
            want = requested.get(name, defaults[name])
            if want != value or type(want) is not type(value):
                out[name] = [value, requested.get(name)]
        for name in requested:
            if name not in served:
                out[name] = [None, requested[name]]
        return out

    def short(self) -> str:
        """A log-friendly one-liner."""
        return f"{self.architecture or 'model'}@{self.fingerprint[:12]}/tp{self.tp_rank}of{self.tp_size}/{self.dtype}"


#: the key's fields and their defaults (``field_defaults``: without the ``dataclasses.Field`` objects
#: ``dataclasses.fields`` makes on first use, ~25 us of an engine's import)
_DEFAULTS = field_defaults(WeightCacheKey)
_FIELDS = tuple(_DEFAULTS)


_TYPES: dict[str, type] = {"tp_size": int, "tp_rank": int, "layout": int}
_TYPES.update((n, str) for n in _FIELDS if n not in _TYPES)


#: Key fields the checkpoint's files determine: the daemon completes them from a proof (docs/protocol.md §4.3.1).
FROM_FILES = ("fingerprint", "architecture", "dtype", "plan")
#: Names whose files the proof covers, besides every ``*.safetensors`` entry: all a key reads.
PROOF_NAMES = frozenset({"config.json", "model.safetensors.index.json"})
#: The key dtypes of "auto" (docs/protocol.md §4.3, the dtype rule): the floating ones (wcache.plan.checkpoint's
#: FLOATING, which a proven key does not import).
_FLOATING = ("float64", "float32", "float16", "bfloat16")
#: The reference client sends a proof only while its GET_STATE stays well inside the 64 KiB that a pipelined
#: frame may take (docs/protocol.md §7): the names' UTF-8 bytes plus ~100 bytes of fields and msgpack per file.
PROOF_BUDGET = 48 << 10
#: A file changed less than this long before the daemon read it (its ctime) is not recorded: a later change
#: within the same timestamp tick would leave its stat unchanged. 2 s covers the coarsest timestamps of
#: filesystems in use (1 s: ext4 with 128-byte inodes, ext3, HFS+; 2 s: FAT's mtime).
RACY_NS = 2_000_000_000


def stated_files(path: str | os.PathLike[str]) -> tuple[FileId, ...] | None:
    """The identity of every file a key of ``path`` reads, without reading any: the directory's entries named
    ``config.json``, ``model.safetensors.index.json`` or ``*.safetensors``, each ``os.stat``ed (symlinks
    followed), sorted by name. None when that cannot prove a key: no such file, one that is not a regular file
    (or vanished meanwhile), a name that is not UTF-8, more files than a proof carries. The same function on
    both sides: the daemon records it before it reads (:func:`checkpoint_files`, :meth:`KeyFacts.recorded`), an
    engine sends it.

    Raises CheckpointError when ``path`` is not a directory (as the scan would)."""
    root = os.fspath(path)
    try:
        with os.scandir(root) as it:
            names = sorted(e.name for e in it if e.name.endswith(".safetensors") or e.name in PROOF_NAMES)
    except (NotADirectoryError, FileNotFoundError) as exc:
        from wcache.errors import CheckpointError

        raise CheckpointError(f"checkpoint directory {root} does not exist or is not a directory") from exc
    except (OSError, ValueError):  # not searchable, a name too long, a NUL byte: the scan says which
        return None
    if not names or len(names) > MAX_PROOF_FILES:
        return None
    try:  # the budget in the bytes the frame carries (a name's UTF-8), not its characters
        if sum(len(n.encode()) + 100 for n in names) > PROOF_BUDGET:
            return None
    except UnicodeEncodeError:
        return None
    out = []
    for name in names:
        try:
            st = os.stat(os.path.join(root, name))
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        out.append(FileId(name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


class _DeferredKey(WeightCacheKey):
    """A key whose file-derived fields (FROM_FILES) are not computed yet: its files were only ``stat``ed
    (``from_spec``). Reading one of those fields runs the header scan; a daemon's STATE for its proof
    supplies them instead (:meth:`adopt`). Equal to, and hashing as, the WeightCacheKey of the same fields."""

    __slots__ = ("_files", "_scanned_here", "_spec")

    _files: tuple[FileId, ...]
    _spec: RankSpec
    _scanned_here: bool

    @classmethod
    def of(cls, spec: RankSpec, files: tuple[FileId, ...]) -> _DeferredKey:
        key = object.__new__(cls)
        put = object.__setattr__
        for name, value in (
            ("tp_size", spec.tp_size),
            ("tp_rank", spec.tp_rank),
            ("layout", LAYOUT_VERSION),
            ("fingerprint_kind", "sampled"),
            ("transform", spec.transform),
            ("_spec", spec),
            ("_files", files),
            ("_scanned_here", False),
        ):
            put(key, name, value)
        return key

    def _pending(self) -> bool:
        try:
            object.__getattribute__(self, "fingerprint")
        except AttributeError:
            return True
        return False

    def __getattr__(self, name: str) -> Any:
        if name not in FROM_FILES:
            raise AttributeError(name)
        self.resolve()
        return object.__getattribute__(self, name)

    def resolve(self) -> WeightCacheKey:
        if self._pending():
            full = WeightCacheKey._scanned(self._spec, None)
            for name in FROM_FILES:
                object.__setattr__(self, name, getattr(full, name))
            object.__setattr__(self, "_scanned_here", True)
        return self

    @property
    def scanned(self) -> bool:
        return getattr(self, "_scanned_here", True)

    def proof(self) -> tuple[dict[str, KeyValue], tuple[FileId, ...], str] | None:
        if not self._pending():
            return None
        partial: dict[str, KeyValue] = {n: getattr(self, n) for n in _FIELDS if n not in FROM_FILES}
        return partial, self._files, self._spec.dtype or "auto"

    def adopt(self, served: dict[str, Any]) -> None:
        if not self._pending():
            super().adopt(served)
            return
        for name in _FIELDS:
            want = _TYPES[name]
            v = served.get(name, _DEFAULTS[name])
            if type(v) is not want or (name not in FROM_FILES and v != getattr(self, name)):
                from wcache.errors import RemoteProtocolError

                raise RemoteProtocolError(
                    f"the daemon served key {served} for a proof of {self._spec.checkpoint} "
                    f"({', '.join(f'{n}={getattr(self, n)!r}' for n in _FIELDS if n not in FROM_FILES)})",
                    details={"served": served, "field": name},
                )
        ruled_out = self._ruled_out(served)
        if ruled_out is not None:
            from wcache.errors import RemoteProtocolError

            raise RemoteProtocolError(
                f"the daemon served key {served} for a proof of {self._spec.checkpoint}: {ruled_out[1]}",
                details={"served": served, "field": ruled_out[0]},
            )
        extra = sorted(n for n in served if n not in _DEFAULTS)
        if extra:  # a recipe's or a newer key's field: another key than this checkpoint's, as diff_wire says
            from wcache.errors import RemoteProtocolError

            raise RemoteProtocolError(
                f"the daemon served key {served} for a proof of {self._spec.checkpoint}: it names {', '.join(extra)}, "
                "which this key does not have",
                details={"served": served, "field": extra[0]},
            )
        for name in FROM_FILES:
            object.__setattr__(self, name, served[name])

    def _ruled_out(self, served: dict[str, Any]) -> tuple[str, str] | None:
        """(field, why) for a file-derived field whose served value this request rules out without reading a
        header (docs/protocol.md §4.3: the fingerprint's form; the dtype rule — an explicit dtype comes back as
        itself, ``"auto"`` as a floating dtype; the plan rule — ``"none"`` at tp_size 1 without a plan file, a
        built-in plan's id above it); None when none is."""
        fp = served["fingerprint"]
        if len(fp) != 32 or fp.strip("0123456789abcdef"):
            return "fingerprint", f"fingerprint {fp!r} is not 32 lowercase hex digits"
        dtype, asked = served["dtype"], self._spec.dtype
        if asked is not None and dtype != asked:
            return "dtype", f"dtype {dtype!r} for a request of {asked!r} (an explicit dtype is served as itself)"
        if asked is None and dtype not in _FLOATING:
            return "dtype", f'dtype {dtype!r} for "auto", which is a floating dtype ({", ".join(_FLOATING)})'
        plan = served["plan"]
        if self.tp_size == 1 and plan != "none":
            return "plan", f'plan {plan!r} at tp_size 1 without a plan file ("none")'
        if self.tp_size > 1 and not plan.startswith("builtin:"):
            return "plan", f"plan {plan!r} at tp_size {self.tp_size} without a plan file (a built-in plan's id)"
        return None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WeightCacheKey):
            return NotImplemented
        return self.to_wire() == other.to_wire()

    def __hash__(self) -> int:
        return hash(tuple([getattr(self, n) for n in _FIELDS]))

    def __repr__(self) -> str:
        pending = self._pending()
        shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in _FIELDS if not (pending and n in FROM_FILES))
        if pending:
            return f"WeightCacheKey(<{', '.join(FROM_FILES)} of {str(self._spec.checkpoint)!r}>, {shown})"
        return f"WeightCacheKey({shown})"
