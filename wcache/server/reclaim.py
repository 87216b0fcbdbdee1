"""What a daemon reclaims from its keeper is checked against the checkpoint before it is served.

The keeper (wcache/server/keeper.py) returns what was deposited for this daemon's socket. Nothing the
RECLAIMED frame says is taken on trust: a process of the daemon's uid that once held its socket lock
(while no daemon ran) could have deposited a slab of forged bytes under the real key, and a slab the
host backend cannot import (unsealed, too small) must not cost the daemon the other models. So, model
by model (docs/security.md, "The keeper"):

1. **adopt** it alone: a slab that cannot be imported drops that model only;
2. **key**: the checkpoint named by its ``source`` is opened again and the model's key recomputed
   from disk (fingerprint of names, headers and sampled data; all data for a ``content`` key) with the
   key's rank, size, dtype and plan — it must equal the reclaimed key (a changed checkpoint: *stale*);
3. **layout**: the tensor table, aliases, payload and slab size must be those that loading this key
   gives (``plan_rank``): nothing to point an engine's views elsewhere;
4. **content**: ``SAMPLES`` byte ranges of up to ``SAMPLE_BYTES`` at offsets drawn from the OS's random
   source (unpredictable to whoever deposited the slab) across the payload, each compared with the
   same tensor bytes read from the checkpoint files (cast as the loader casts). A model whose bytes
   differ in a fraction f of those ranges passes with probability ~(1-f)^SAMPLES: wholesale forgery,
   garbage, another model or a corrupted slab are caught; a targeted edit of a few bytes is not —
   that is what the keeper's owner check is for.

A **deposit** (write-back, docs/protocol.md §4.13: a recipe key naming an ``engine``) holds the engine's
post-processed bytes, which nothing on disk gives, so it gets steps 1 and, where its checkpoint directory is
known (the daemon served that checkpoint when it took the deposit), 2 on the recipe's checkpoint fields: a
checkpoint changed since makes it *stale*. Its table must lie inside its slab. Its bytes rest on the keeper's
owner check, as a fresh DEPOSIT rests on the same-uid rule (docs/security.md, "Write-back"). Without a known
directory nothing can make it stale, and nothing needs to: an engine's recipe key names its checkpoint's
fingerprint, so a deposit of an older checkpoint is never mapped by an engine of the new one.

A model with a load-time transform (vLLM's layout: ``--transform wcache.transforms:vllm_layout``) gets
steps 1-2 only: its layout and bytes are the transform's output, which only running the transform (reading
everything) would give. It rests on the keeper's owner check: only the process holding this daemon's socket
lock could have kept it (docs/security.md). Every dropped model gets an UNKEEP; the daemon then loads what it
needs from disk as without a keeper.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import random
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from wcache.errors import WCacheError
from wcache.plan.key import RankSpec, WeightCacheKey
from wcache.plan.layout import Layout, Placement
from wcache.plan.rank import RankPlan, plan_rank
from wcache.plan.recipe import RecipeKey, key_from_wire
from wcache.proto import DTYPE_SIZES, HandedModel, Reclaimed
from wcache.proto.table import tensor_extent
from wcache.server.backends.base import Backend, Slab
from wcache.server.keeper_link import KeeperLink, unkeep
from wcache.server.loader import torch_dtype
from wcache.server.reads import placement_extents
from wcache.server.store import ServedModel

if TYPE_CHECKING:
    from wcache.server.tier import HostTier

__all__ = ["SAMPLES", "SAMPLE_BYTES", "Check", "admit", "check_model", "compare_samples", "expected_bytes"]

log = logging.getLogger("wcache.server")

#: byte ranges compared per reclaimed model, and their length
SAMPLES = 64
SAMPLE_BYTES = 4096

Adopt = Callable[[tuple[HandedModel, ...], list[int], Backend], list[ServedModel]]


@dataclass(frozen=True)
class Check:
    """The outcome for one model: ``reason`` None if it may be served, else ``kind`` (stale, unverifiable,
    mismatch) and why."""

    reason: str | None
    kind: str = ""
    samples: int = 0
    bytes_compared: int = 0
    seconds: float = 0.0


def admit(
    link: KeeperLink,
    state: Reclaimed,
    fds: list[int],
    backend: Backend,
    adopt: Adopt,
    *,
    plan_file: str | os.PathLike[str] | None = None,
    tier: HostTier | None = None,
) -> tuple[list[ServedModel], int]:
    """The reclaimed models that pass every check, adopted; and how many were dropped (each told to the
    keeper with an UNKEEP). Every fd in ``fds`` is consumed. A deposit is dropped too where a later COMMIT
    under its key is recorded that the keeper never heard of: in this socket's record (``link.record``: a
    keeper that did not answer the COMMIT's KEEP; or a record settled against another keeper, which does not
    name the key) or by ``tier`` (the host tier, shared by every daemon of the directory: a daemon without
    ``--keeper`` committed it, whose bytes the tier restores, or whose tombstone says nothing older may be
    served)."""
    served: list[ServedModel] = []
    rejected: list[tuple[WeightCacheKey, str]] = []
    undecodable: list[dict[str, str | int]] = []
    used: set[int] = set()
    try:
        for hm in state.models:
            mine = [s.fd for s in hm.slabs]
            used.update(mine)
            key = _decoded(hm.key)  # a deposit keeps its recipe key (docs/protocol.md §4.13)
            if key is None:  # no key this daemon would have kept: dropped by its map, the others served
                undecodable.append(dict(hm.key))
                continue
            sub = replace(hm, slabs=tuple(replace(s, fd=i) for i, s in enumerate(hm.slabs)))
            try:
                (model,) = adopt((sub,), [os.dup(fds[i]) for i in mine], backend)
            except Exception as exc:  # this slab only: the others are served
                log.warning("reclaimed key=%s not adopted (%s); it will be loaded", key.short(), exc)
                rejected.append((key, "unadoptable"))
                continue
            check = check_model(model, plan_file=plan_file)
            if check.reason is None and isinstance(key, RecipeKey):
                stale = link.record.stale(key, model.generation)
                check = Check(stale, "stale") if stale is not None else check
            if check.reason is None and isinstance(key, RecipeKey) and tier is not None:
                check = _check_generation(model, tier)
            if check.reason is not None:
                model.close()
                log.warning(
                    "dropping kept key=%s bytes=%d: %s (%s)", key.short(), model.slab_bytes, check.reason, check.kind
                )
                rejected.append((key, check.kind))
                continue
            log.info(
                "verified kept key=%s bytes=%d samples=%d bytes_compared=%d seconds=%.4f",
                key.short(),
                model.slab_bytes,
                check.samples,
                check.bytes_compared,
                check.seconds,
            )
            model.origin = "keeper"  # STATUS says where this daemon got it (the handed origin says where it began)
            served.append(model)
    finally:
        for fd in fds:
            os.close(fd)
    unconfirmed = asyncio.run(_unkeep_all(link, [k for k, _ in rejected], tier)) if rejected else 0
    if undecodable:
        asyncio.run(_unkeep_maps(link, undecodable))
    # what the keeper holds is known now: the entries of the deposits served from it may go (it holds their
    # recorded generation, and the tier records that one or none); every other entry stays — a key the keeper
    # holds nothing of may still have an older generation in the host tier, which its entry keeps from being
    # restored — and while a drop is unconfirmed a damaged record stays damaged and the record names no other
    # keeper than it did (it names no generation that would make that deposit stale)
    held = {link.record.key_id(m.key) for m in served if isinstance(m.key, RecipeKey)}
    link.record.reclaimed(held, confirmed=not unconfirmed)
    return served, len(rejected) + len(undecodable)


def _decoded(wire: dict[str, str | int]) -> WeightCacheKey | None:
    """The key a kept entry's map names, or None (one WARNING) for a map no daemon of this version keeps: one that
    is no key (a field missing or of another type: an older daemon's, or a forged entry) or not the form this
    daemon writes (a field it would drop on decoding, whose UNKEEP by the decoded key would then not find it)."""
    try:
        key = key_from_wire(dict(wire))
        if key.to_wire() == dict(wire):
            return key
        why = "not in the form this daemon keeps keys"
    except Exception as exc:  # its map is the keeper's word: any failure to decode it drops this entry only
        why = f"{type(exc).__name__}: {exc}"
    log.warning("dropping kept entry key=%s: its key does not decode (%s)", str(dict(wire))[:200], why)
    return None


async def _unkeep_maps(link: KeeperLink, maps: Sequence[dict[str, str | int]]) -> None:
    """UNKEEP each of ``maps`` by the keeper's own key map (entries whose key does not decode)."""
    for m in maps:
        try:
            await unkeep(link.path, owner=link.owner, key=m)
        except (WCacheError, OSError) as exc:
            log.warning("keeper %s did not confirm dropping an entry that does not decode (%s)", link.path, exc)


async def _unkeep_all(link: KeeperLink, keys: Sequence[WeightCacheKey], tier: HostTier | None = None) -> int:
    """UNKEEP each of ``keys``: how many the keeper did not confirm. The record's entry of a key goes with it,
    unless ``tier`` records another generation of the key than the entry's: the previous daemon's COMMIT of the
    entry's generation may never have written its tombstone (the tier's lock held by another daemon until it
    stopped or crashed), and the entry is then what keeps the tier's older generation from being restored."""

    def settle(key: WeightCacheKey) -> bool:
        if tier is None:
            return True
        recorded = link.record.keys.get(link.record.key_id(key))
        return recorded is None or tier.generation_of(key) in (None, recorded)

    return sum([not await link.drop(key, settle=settle(key)) for key in keys])


def _check_generation(model: ServedModel, tier: HostTier) -> Check:
    """A kept deposit against the generation the host tier records for its key (its entry's or tombstone's)."""
    recorded = tier.generation_of(model.key)
    if recorded is not None and recorded != model.generation:
        return Check(
            f"the host tier records a later deposit of its key (generation {recorded}, this one "
            f"{model.generation or 'unknown'}): it is not the deposit last committed",
            "stale",
        )
    return Check(None, "")


def check_model(model: ServedModel, *, plan_file: str | os.PathLike[str] | None = None) -> Check:
    """Whether ``model`` is what loading its key from its ``source`` checkpoint would give (see module doc)."""
    t0 = time.perf_counter()
    key = model.key
    if isinstance(key, RecipeKey):
        return _check_deposit(model, key, t0, plan_file)
    if model.source is None:
        return Check("no checkpoint directory is recorded for it: it cannot be checked", "unverifiable")
    rp = _plan_source(model, key, plan_file)
    if isinstance(rp, Check):
        return rp
    with rp:
        if rp.key != key:
            return _changed(model, key, key.diff_wire(rp.key.to_wire()), rp.key, "its key differs")
        model.facts = rp.facts  # these files give its key: engines may prove them (docs/protocol.md §4.3.1)
        if key.transform:  # layout and bytes are the transform's: the key is what can be checked (module doc)
            return Check(None, "", 0, 0, time.perf_counter() - t0)
        layout = rp.layout
        problem = _layout_problem(model, layout)
        if problem is not None:
            return Check(problem, "mismatch")
        try:
            samples, compared, bad = compare_samples(model.slabs[0], layout, SAMPLES, SAMPLE_BYTES)
        except (OSError, WCacheError, RuntimeError) as exc:
            return Check(f"its bytes could not be compared with {model.source} ({exc})", "unverifiable")
    if bad is not None:
        return Check(f"its bytes differ from the checkpoint's: {bad}", "mismatch", samples, compared)
    return Check(None, "", samples, compared, time.perf_counter() - t0)


def _check_deposit(model: ServedModel, key: RecipeKey, t0: float, plan_file: str | os.PathLike[str] | None) -> Check:
    """A kept deposit (module doc): its table inside its one slab; its checkpoint fields, where the
    checkpoint directory is known, equal to what that checkpoint gives now."""
    if len(model.slabs) != 1:
        return Check(f"a deposit is one slab, this has {len(model.slabs)}", "mismatch")
    size = model.slabs[0].size
    for e in model.table:
        if e.slab != 0 or e.offset < 0 or e.offset + tensor_extent(e.dtype, e.shape, e.stride) > size:
            return Check(f"tensor {e.name!r} lies outside its {size}-byte slab", "mismatch")
    if model.source is None:
        return Check(None, "", 0, 0, time.perf_counter() - t0)
    rp = _plan_source(model, key, plan_file)
    if isinstance(rp, Check):
        return rp
    with rp:
        base = rp.key
    wire = key.to_wire()
    diff = base.diff_wire({k: wire[k] for k in base.to_wire()})
    if diff:
        return _changed(model, key, diff, base, "its checkpoint fields differ")
    return Check(None, "", 0, 0, time.perf_counter() - t0)


def _plan_source(model: ServedModel, key: WeightCacheKey, plan_file: str | os.PathLike[str] | None) -> RankPlan | Check:
    """The rank ``key`` names, planned from the model's ``source`` checkpoint now (the caller closes it), or why not."""
    assert model.source is not None
    try:
        spec = RankSpec(
            model.source,
            tp_rank=key.tp_rank,
            tp_size=key.tp_size,
            dtype=key.dtype,
            plan_file=Path(plan_file) if plan_file and key.plan != "none" else None,
            transform=key.transform,
            verify_content=key.fingerprint_kind == "content",
        )
        return plan_rank(spec)
    except (WCacheError, OSError, ValueError) as exc:
        return Check(f"its checkpoint {model.source} cannot be read ({exc})", "unverifiable")


def _changed(
    model: ServedModel, key: WeightCacheKey, diff: dict[str, list[object]], now: WeightCacheKey, what: str
) -> Check:
    """A kept key that differs from what its checkpoint gives now: *stale* when only the fingerprint moved."""
    if set(diff) == {"fingerprint"}:
        why = f"its checkpoint {model.source} changed since (fingerprint {key.fingerprint[:12]}, now "
        return Check(why + f"{now.fingerprint[:12]})", "stale")
    return Check(f"{what} from the ones {model.source} gives now in {sorted(diff)}", "mismatch")


def _layout_problem(model: ServedModel, layout: Layout) -> str | None:
    if len(model.slabs) != 1 or model.slabs[0].size != layout.total_bytes:
        sizes = [s.size for s in model.slabs]
        return f"its slabs {sizes} are not the one slab of {layout.total_bytes} bytes its key loads into"
    if list(model.table) != list(layout.table()):
        return "its tensor table is not the one its key loads"
    if dict(model.aliases) != dict(layout.aliases) or model.payload_bytes != layout.payload_bytes:
        return "its aliases or payload are not those its key loads"
    return None


def compare_samples(slab: Slab, layout: Layout, n: int, size: int) -> tuple[int, int, str | None]:
    """Compare ``n`` random ranges of up to ``size`` bytes of the slab with the checkpoint; (samples, bytes
    compared, the first difference or None)."""
    placements = [p for p in layout.placements if p.nbytes > 0]
    if not placements:
        return 0, 0, None
    rng = random.SystemRandom()
    ends: list[int] = []
    total = 0
    for p in placements:
        total += p.nbytes
        ends.append(total)
    files: dict[Path, int] = {}
    compared = 0
    try:
        for i in range(n):
            p = placements[bisect.bisect_right(ends, rng.randrange(total))]
            src_item, dst_item = DTYPE_SIZES[p.source.dtype], DTYPE_SIZES[p.dtype]
            count = p.nbytes // dst_item
            m = max(1, min(count, size // max(src_item, dst_item)))
            first = rng.randrange(count - m + 1)
            want = _expected(files, p, first, m, src_item)
            got = _read_slab(slab, p.offset + first * dst_item, m * dst_item)
            if got != want:
                return i + 1, compared + len(got), f"tensor {p.source.name!r} elements {first}..{first + m - 1}"
            compared += len(got)
    finally:
        for fd in files.values():
            os.close(fd)
    return n, compared, None


def expected_bytes(files: dict[Path, int], p: Placement, first: int, m: int) -> bytes:
    """Elements ``first .. first+m-1`` of ``p`` as a load stores them (``files``: descriptors opened so far, the
    caller closes them): what a fill's ``--verify-content`` compares every byte with."""
    return _expected(files, p, first, m, DTYPE_SIZES[p.source.dtype])


def _expected(files: dict[Path, int], p: Placement, first: int, m: int, src_item: int) -> bytes:
    """Elements ``first .. first+m-1`` of placement ``p`` as the loader stores them: read from the
    placement's extents (its shard's bytes, in slab order) and cast to its dtype."""
    start, want = first * src_item, m * src_item
    raw = bytearray()
    pos = 0
    for f, off, length in placement_extents(p):
        if pos + length > start and len(raw) < want:
            lo = max(start - pos, 0)
            take = min(length - lo, want - len(raw))
            raw += _pread(files, f, off + lo, take)
        pos += length
        if len(raw) >= want:
            break
    if p.source.dtype == p.dtype:
        return bytes(raw)
    import torch  # only a cast needs it: a daemon reclaiming same-dtype models starts without torch

    t = torch.frombuffer(raw, dtype=torch.uint8).view(torch_dtype(p.source.dtype)).to(torch_dtype(p.dtype))
    return bytes(t.view(torch.uint8).numpy().tobytes())


def _pread(files: dict[Path, int], path: Path, off: int, n: int) -> bytes:
    fd = files.get(path)
    if fd is None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"{path} is not a regular file")
        files[path] = fd
    out = os.pread(fd, n, off)
    if len(out) != n:
        raise OSError(f"{path} ends before byte {off + n}")
    return out


def _read_slab(slab: Slab, off: int, n: int) -> bytes:
    return slab.read(off, n)  # host: pread on the sealed memfd; CUDA: cuMemcpyDtoH from the mapping
