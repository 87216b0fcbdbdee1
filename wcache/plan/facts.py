"""The daemon's side of a key: what it recorded of the checkpoint files it read, which completes a key an engine
proves with the files' identity (docs/protocol.md §4.3.1), and the errors that name the served key closest to a
request (KEY_MISMATCH, NOT_FOUND).

``wcache.plan.key`` holds what both sides compute (the request, the key, the files' ``stat`` identity); this module
only daemons use, so an engine's restart, which imports the key, does not load it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from wcache.plan.key import RACY_NS, WeightCacheKey, stated_files
from wcache.proto._record import field_defaults

if TYPE_CHECKING:
    from wcache.errors import NotFoundError, WCacheError
    from wcache.plan.checkpoint import Checkpoint, DtypeBytes
    from wcache.proto.daemon_frames import FileStat

__all__ = ["KeyFacts", "checkpoint_files", "closest", "key_mismatch", "not_served", "same_file"]


def closest(
    requested: dict[str, Any], keys: Iterable[WeightCacheKey]
) -> tuple[WeightCacheKey, dict[str, list[Any]]] | None:
    """The served key nearest ``requested`` and its ``diff_wire``: the same checkpoint (fingerprint) first, then
    the fewest differing fields, then the last in ``keys`` (a store lists the most recently used last)."""
    best: tuple[tuple[bool, int], WeightCacheKey, dict[str, list[Any]]] | None = None
    for k in keys:
        d = k.diff_wire(requested)
        score = ("fingerprint" in d, len(d))
        if best is None or score <= best[0]:
            best = (score, k, d)
    return None if best is None else (best[1], best[2])


def _served(keys: list[WeightCacheKey]) -> str:
    shown = ", ".join(k.short() for k in keys[:8])
    return shown + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def key_mismatch(requested: dict[str, Any], keys: Iterable[WeightCacheKey]) -> WCacheError:
    """The error a GET_STATE of a key none of ``keys`` equals gets: KEY_MISMATCH naming, per field, the
    requested and the served value of the closest model (NOT_FOUND when nothing is served)."""
    from wcache.errors import KeyMismatchError, NotFoundError, describe_fields

    held = list(keys)
    near = closest(requested, held)
    if near is None:
        return NotFoundError("the daemon holds no weights; PRELOAD a model first")
    key, diff = near
    many = f" (closest of {len(held)} served: {_served(held)})" if len(held) > 1 else ""
    return KeyMismatchError(
        f"requested key differs from the served {key.short()}: {describe_fields(diff)}{many}",
        details={"fields": diff, "served": [k.short() for k in held], "closest": key.short()},
    )


def not_served(requested: dict[str, Any], keys: Iterable[WeightCacheKey]) -> NotFoundError:
    """The NOT_FOUND of an EVICT of a key not held: what was asked for, and how it differs from the closest
    served model, per field (``describe_fields``)."""
    from wcache.errors import NotFoundError, describe_fields

    held = list(keys)
    near = closest(requested, held)
    asked = f"{requested.get('architecture', '?')}@{str(requested.get('fingerprint', '?'))[:12]}"
    asked += f"/tp{requested.get('tp_rank', '?')}of{requested.get('tp_size', '?')}/{requested.get('dtype', '?')}"
    if near is None:
        return NotFoundError(f"no model is served under the requested key {asked}: this daemon serves none")
    key, diff = near
    return NotFoundError(
        f"no model is served under the requested key {asked}; the closest served, {key.short()}, differs in "
        f"{describe_fields(diff)}" + (f" (served: {_served(held)})" if len(held) > 1 else ""),
        details={"fields": diff, "served": [k.short() for k in held], "closest": key.short()},
    )


def checkpoint_files(path: str | os.PathLike[str]) -> tuple[FileStat, ...] | None:
    """:func:`stated_files` as the frames carry them (``FileStat``, the proof's unit as a GET_STATE's decoder makes
    it): what the daemon records and compares a request's proof with."""
    from wcache.proto.daemon_frames import FileStat

    files = stated_files(path)
    return None if files is None else tuple(FileStat(*f) for f in files)


def same_file(a: FileStat, st: os.stat_result) -> bool:
    """``st`` (an fstat) is the file ``a`` stated, unchanged."""
    return (a.dev, a.ino, a.size, a.mtime_ns, a.ctime_ns) == (
        st.st_dev,
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
        st.st_ctime_ns,
    )


class KeyFacts:
    """What a key takes from a checkpoint's files, as the daemon found them when it read them, and the files'
    identity before that read (docs/protocol.md §4.3.1): with a request's rank and dtype it completes a key
    (:meth:`complete`) exactly as a header scan of those files would. (A plain class: an engine imports this
    module, and only daemons make these.)"""

    __slots__ = ("architecture", "config", "counted", "files", "fingerprint", "fingerprint_kind")

    def __init__(
        self,
        files: tuple[FileStat, ...],
        fingerprint: str,
        fingerprint_kind: str,
        architecture: str,
        counted: DtypeBytes,
        config: dict[str, Any],
    ) -> None:
        self.files, self.fingerprint, self.fingerprint_kind = files, fingerprint, fingerprint_kind
        self.architecture, self.counted, self.config = architecture, counted, config

    def __repr__(self) -> str:
        return f"KeyFacts({len(self.files)} files, {self.architecture or 'model'}@{self.fingerprint[:12]})"

    @classmethod
    def recorded(
        cls, files: tuple[FileStat, ...] | None, read_ns: int, ckpt: Checkpoint, key: WeightCacheKey
    ) -> KeyFacts | None:
        """The facts of ``key``, planned from ``ckpt``, if ``files`` (:func:`checkpoint_files`, taken before
        ``ckpt`` read anything; ``read_ns``: ``time.time_ns()`` after it) prove them. None when they do not:
        no files; a file changed less than RACY_NS before ``read_ns`` (or dated after it); a file the key read
        — a safetensors file, ``config.json``, the index — that the files do not name, or whose descriptor is
        not the file stated (replaced, or a symlink re-pointed, in between); a metadata file the files name that
        was not there when read."""
        if files is None or cls.racy(files, read_ns):
            return None
        by_name = {f.name: f for f in files}
        for name, st in ckpt.meta.items():
            stated = by_name.get(name)
            if stated is None and st is None:
                continue  # absent when listed and when read
            if stated is None or st is None or not same_file(stated, st):
                return None
        for path in ckpt.files:
            stated = by_name.get(path.name)
            if stated is None or path.parent != ckpt.path:
                return None
            try:
                if not same_file(stated, os.fstat(ckpt.fd(path))):
                    return None
            except OSError:
                return None
            except Exception as exc:
                from wcache.errors import CheckpointError

                if isinstance(exc, CheckpointError):
                    return None
                raise
        return cls(files, key.fingerprint, key.fingerprint_kind, key.architecture, ckpt.dtype_bytes(), ckpt.config)

    @staticmethod
    def racy(files: tuple[FileStat, ...], read_ns: int) -> bool:
        """Whether a file changed less than RACY_NS before ``read_ns`` (or is dated after it): a change later
        within the same timestamp tick would leave its identity unchanged, so a read then proves nothing."""
        return any(f.ctime_ns > read_ns - RACY_NS for f in files)

    def complete(self, partial: dict[str, Any], dtype: str) -> dict[str, Any]:
        """The key map a header scan of these files would give for the request ``partial`` (a GET_STATE key
        without the file-derived fields) and ``dtype`` ("auto" or a dtype name): ``partial`` with
        ``fingerprint``, ``architecture``, ``dtype`` and ``plan`` set as :meth:`WeightCacheKey.from_spec` sets
        them. Raises CheckpointError (a dtype this checkpoint is not served in), ShardingError (a
        ``tp_size`` without a built-in plan for the architecture), or KeyMismatchError-worthy ValueError for
        a ``tp_size`` that is not a positive integer or a ``fingerprint_kind`` other than the recorded one."""
        tp_size = partial.get("tp_size")
        if type(tp_size) is not int or tp_size < 1:
            raise ValueError(f"tp_size {tp_size!r} is not a positive integer")
        kind = partial.get("fingerprint_kind", field_defaults(WeightCacheKey)["fingerprint_kind"])
        if kind != self.fingerprint_kind:
            raise ValueError(f"fingerprint_kind {kind!r}: the daemon read these files for {self.fingerprint_kind!r}")
        plan = "none"
        # a daemon's call (it has both loaded already): imported here so that an engine's key does not load them
        from wcache.plan.quant import resolve_dtype

        if tp_size != 1:
            from wcache.plan.sharding import resolve_plan

            has_config = any(f.name == "config.json" for f in self.files)  # the files name it where it was read
            resolved = resolve_plan(self.architecture, tp_size, None, has_config=has_config)
            plan = resolved.id if resolved is not None else "none"
        out = dict(partial)
        out["fingerprint"] = self.fingerprint
        out["architecture"] = self.architecture
        out["dtype"] = resolve_dtype(self.counted, self.config, None if dtype == "auto" else dtype)
        out["plan"] = plan
        return out
