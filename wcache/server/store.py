"""What the daemon serves, and who holds it: the loaded model and its leases.

A lease belongs to the connection that asked for it. RELEASE ends only leases of the
same connection (the seed design's RELEASE freed the cache for every engine); a closed
connection ends all of its leases. No I/O here: the daemon calls in with decoded frames.
How a model is loaded into a slab (checkpoint, host tier, transform) is wcache/server/load.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from wcache.errors import (
    DeviceMismatchError,
    InternalError,
    InUseError,
    KeyUnprovenError,
    LimitExceededError,
    OutOfMemoryError,
    ProtocolError,
    UnknownLeaseError,
    UnsupportedPlatformError,
    WCacheError,
)
from wcache.plan.facts import KeyFacts, key_mismatch, not_served
from wcache.plan.key import RACY_NS, RankSpec, WeightCacheKey
from wcache.plan.layout import ALIGN, align_up, contiguous_strides
from wcache.plan.recipe import RecipeKey, key_from_wire
from wcache.proto import (
    Commit,
    Deposit,
    Deposited,
    DepositSlab,
    FileStat,
    GetState,
    HandedModel,
    LeaseInfo,
    ModelInfo,
    Release,
    Released,
    SlabDescriptor,
    State,
    TensorEntry,
    TensorTable,
    as_received,
)
from wcache.proto.fields import fail
from wcache.server.backends.base import Backend, Slab
from wcache.server.loader import LoadStats
from wcache.units import format_size

__all__ = [
    "MAX_DEPOSITS",
    "MAX_MODELS",
    "Lease",
    "PendingDeposit",
    "ServedModel",
    "Store",
    "deposit_layout",
    "split_descriptors",
]

log = logging.getLogger("wcache.server")
#: checkpoints whose files' facts a daemon keeps for GET_STATE proofs (a few hundred bytes each, plus config.json)
MAX_FACTS = 256


@dataclass
class ServedModel:
    key: WeightCacheKey
    table: TensorTable
    aliases: dict[str, str]
    slabs: list[Slab]
    backend: Backend
    payload_bytes: int
    stats: LoadStats
    last_use: float = 0.0
    source: Path | None = None  # the checkpoint directory it was loaded from
    origin: str = ""  # how this daemon got it (STATUS): "disk", "tier", "keeper", "takeover", "deposit"
    buffers: tuple[str, ...] = ()  # tensors deposited as module buffers (STATE's ``buffers``)
    #: what the key took from its checkpoint's files, read by this daemon (a GET_STATE proof's match, §4.3.1)
    facts: KeyFacts | None = None
    #: a deposit's generation (random, given at COMMIT; a tier restore keeps the entry's): "" for a checkpoint
    generation: str = ""

    def __post_init__(self) -> None:
        self._slab_bytes = sum(s.size for s in self.slabs)
        #: threads reading the slabs outside the event loop (a host-tier save), and whether close() came meanwhile
        self._hold_lock = threading.Lock()
        self._readers = 0
        self._closing = False
        #: called once, just before the slabs are freed (a NIXL registration of them is dropped first)
        self.finalizers: list[Callable[[], None]] = []

    def hold(self) -> bool:
        """Keep the slabs open while another thread reads them (``release_hold`` after); False once closed."""
        with self._hold_lock:
            if self._closing:
                return False
            self._readers += 1
            return True

    @property
    def closed(self) -> bool:
        """Whether the model was closed (evicted, replaced): never served again."""
        return self._closing

    @property
    def held(self) -> bool:
        """Whether a reader holds the slabs now (a peer's fill, a host-tier save): closing them frees nothing yet."""
        return self._readers > 0

    def release_hold(self) -> None:
        with self._hold_lock:
            self._readers -= 1
            last = self._closing and self._readers == 0
        if last:
            self._close_slabs()

    @property
    def slab_bytes(self) -> int:
        """Bytes of the model's slabs (still reported after close(), for logs and EVICTED)."""
        return self._slab_bytes

    def export(self, fds: list[int]) -> tuple[SlabDescriptor, ...]:
        """The slab descriptors for a frame; descriptors that travel are appended to ``fds`` and
        each descriptor's ``fd`` is its position there (-1 for slabs shared by handle)."""
        descs: list[SlabDescriptor] = []
        for slab in self.slabs:
            desc, slab_fds = slab.export()
            if slab_fds:
                desc = dataclasses.replace(desc, fd=len(fds))
                fds.extend(slab_fds)
            descs.append(desc)
        return tuple(descs)

    def handed(self, descs: tuple[SlabDescriptor, ...]) -> HandedModel:
        """This model as another process adopts it (TAKEOVER_STATE, KEEP), its slabs as ``descs``."""
        return HandedModel(
            self.key.to_wire(),
            descs,
            self.table,
            self.aliases,
            self.payload_bytes,
            self.stats.seconds,
            str(self.source) if self.source is not None else "",
            self.origin,
            self.buffers,
            self.generation,
        )

    def close(self) -> None:
        """Free the slabs; while a reader holds them (``hold``), the last reader frees them when it is done."""
        with self._hold_lock:
            self._closing = True
            if self._readers:
                return
        self._close_slabs()

    def _close_slabs(self) -> None:
        fins, self.finalizers = self.finalizers, []
        for fin in fins:
            try:
                fin()
            except Exception as exc:  # freeing the memory must not depend on it
                log.warning("slab finalizer failed key=%s: %s: %s", self.key.short(), type(exc).__name__, exc)
        for s in self.slabs:
            s.close()
        self.slabs.clear()


@runtime_checkable
class _Depositable(Protocol):
    """A backend that can hand an engine a writable slab and seal it afterwards (docs/protocol.md §4.13)."""

    def check_deposits(self) -> None:
        """Raise UnsupportedPlatformError when this backend, as configured, takes no deposits."""
        ...

    def allocate_deposit(self, nbytes: int) -> Slab: ...


@runtime_checkable
class _RoomChecked(Protocol):
    """A backend that can tell, before anything is evicted, whether a slab can fit its memory at all."""

    def check_room(self, nbytes: int, freeing: int = 0) -> None:
        """OutOfMemoryError when ``nbytes`` more do not fit even once ``freeing`` bytes are given back."""
        ...


#: Models one daemon serves at most (lowered to fit its descriptor limit: docs/protocol.md §7). A daemon
#: serves one rank: its checkpoint and a few variants and recipes.
MAX_MODELS = 64
#: Deposits in progress on all connections at most (each holds a slab, a descriptor and promised memory).
MAX_DEPOSITS = 16


def split_descriptors(nofile: int, connections: int, extra: int = 0) -> tuple[int, int]:
    """How a daemon whose RLIMIT_NOFILE is ``nofile`` shares its descriptors, so that it always has one to
    accept and answer with (docs/protocol.md §7): an eighth (16 to 1024) is kept for its own work (the
    listener, logs, a load's checkpoint files and reader threads, host-tier files, keeper sockets), and
    ``extra`` more besides (the metrics endpoint's listener and its capped connections); of the rest,
    ``connections`` go to connections (one each) and the remainder to slabs (the models' and the deposits' in
    progress) — unless that leaves the slabs less than a quarter: then they get
    the quarter and connections the rest. Returns (connections, slabs), each at least 1."""
    reserve = min(1024, max(16, nofile // 8)) + extra
    room = max(2, nofile - reserve)
    slabs = max(1, room - connections if room - connections >= room // 4 else room // 4)
    return max(1, min(connections, room - slabs)), slabs


@dataclass
class PendingDeposit:
    """A deposit between DEPOSIT_SLAB and COMMIT: its slab is the engine's to write, not served yet."""

    id: int
    conn_id: int
    pid: int
    key: RecipeKey
    slab: Slab
    table: TensorTable
    aliases: dict[str, str]
    buffers: tuple[str, ...]
    payload: int
    started: float = field(default_factory=time.perf_counter)


def deposit_layout(req: Deposit) -> tuple[TensorTable, int, int]:
    """Where each tensor of a DEPOSIT goes: contiguous, ALIGN-aligned, in the order listed. Returns the
    table, the slab size (at least ALIGN) and the payload bytes.

    Raises ProtocolError (``DEPOSIT.tensors``) for a layout the daemon's own clients would refuse: the STATE
    that would serve it is built and run through the one decoder every client runs (``as_received``), so a
    deposit is never accepted that no engine could fetch (an empty tensor whose strides reach 2**48, a
    stride too large for the table's columns, a table over the 64 MiB frame a client reads)."""
    entries: list[TensorEntry] = []
    offset = payload = 0
    for t in req.tensors:
        entries.append(TensorEntry(t.name, t.dtype, t.shape, contiguous_strides(t.shape), 0, offset))
        n = t.nbytes
        payload += n
        offset = align_up(offset + n)
    table, size = TensorTable.from_entries(entries), max(offset, ALIGN)
    probe = State(
        id=1,
        lease=1,
        key=req.key,
        mode="zero_copy",
        slabs=(SlabDescriptor(size=size, kind="memfd", fd=0),),
        tensors=table,
        aliases=dict(req.aliases),
        buffers=tuple(t.name for t in req.tensors if t.kind == "buffer"),
    )
    try:
        as_received(probe)
    except ProtocolError as exc:
        raise fail(
            "DEPOSIT", "tensors", f"no client could fetch this deposit, its STATE is refused: {exc.message}"
        ) from None
    return table, size, payload


@dataclass
class Lease:
    id: int
    conn_id: int
    pid: int
    mode: str
    key: WeightCacheKey
    created: float = field(default_factory=time.monotonic)


class Store:
    """The models a daemon holds (least recently used first) and their leases.

    ``budget``: the most slab bytes held at once; a new model evicts unleased models, least
    recently used first, and is refused (OUT_OF_MEMORY, naming what is pinned) if that is not enough.
    ``max_models`` bounds the models the same way (LIMIT_EXCEEDED when every one is leased), and
    ``max_deposits`` the deposits in progress; the daemon lowers both to fit its descriptor limit
    (``fit_descriptors``). A deposit in progress is a promise, not a model: it counts in every room
    check from DEPOSIT on, but evicts nothing before its COMMIT (docs/protocol.md §4.13).
    """

    def __init__(
        self,
        backend: Backend,
        models: list[ServedModel] | None = None,
        *,
        budget: int | None = None,
        max_leases_per_connection: int = 64,
        max_deposits_per_connection: int = 4,
        max_models: int = MAX_MODELS,
        max_deposits: int = MAX_DEPOSITS,
    ) -> None:
        self.backend = backend
        self.budget = budget
        self.max_models = max_models
        self.max_deposits = max_deposits
        self.models: OrderedDict[WeightCacheKey, ServedModel] = OrderedDict()
        for m in models or []:
            self.models[m.key] = m
        #: lease id -> lease; with the two indexes below, every lease operation is O(1) in the number of
        #: live leases (a GET_STATE once scanned them all: 3.7 ms a round trip at 25,600 leases)
        self.leases: dict[int, Lease] = {}
        self._by_conn: dict[int, dict[int, Lease]] = {}
        self._per_key: Counter[WeightCacheKey] = Counter()
        self.max_leases_per_connection = max_leases_per_connection
        #: deposits in progress one connection may hold (each holds a slab the budget counts)
        self.max_deposits_per_connection = max_deposits_per_connection
        #: (fingerprint, fingerprint_kind) -> checkpoint directory, for every model ever loaded (load-on-demand)
        self.sources: dict[tuple[str, str], Path] = {}
        #: called with every model that becomes resident through ``add`` (after the ones given here)
        self.on_add: list[Callable[[ServedModel], None]] = []
        #: the identity of a checkpoint's files, as read for a model -> what its key took from them: completes
        #: the key of a GET_STATE that proves those files (docs/protocol.md §4.3.1); least recently used first
        self.facts: OrderedDict[tuple[FileStat, ...], KeyFacts] = OrderedDict()
        #: checkpoints planned while a file was too fresh for the files' identity to prove the key (a file changed
        #: less than RACY_NS before the read): (spec, the time after which a planning records them), for the
        #: daemon to plan again then (``Daemon._prove_when_settled``)
        self.unproven: list[tuple[RankSpec, int]] = []

        for m in models or []:
            self._remember(m)
        self._next_lease = secrets.randbits(31) + 1  # not reused across daemon restarts
        #: deposit id -> deposit between DEPOSIT_SLAB and COMMIT (its bytes count against the budget)
        self.deposits: dict[int, PendingDeposit] = {}
        self._next_deposit = secrets.randbits(31) + 1
        #: recipe key -> generation of the deposit last committed under it, while it matters: until the host tier
        #: holds nothing older (``settled``, after ``HostTier.supersede``) the tier restores no other generation of
        #: the key, and while a restore of the key is under way (``restore``) one that a commit overtook is dropped
        #: (``add_restored``). Then it is forgotten: a map of every key ever committed grew ~18 KB a key, for ever
        self.generations: dict[WeightCacheKey, str] = {}
        self.restoring: set[WeightCacheKey] = set()
        self._superseding: Counter[WeightCacheKey] = Counter()
        #: bytes promised to loads in progress (``loading``, ``hold``): room made for them, not yet served
        self.loading_bytes = 0
        #: model slots held by loads in progress: each counts as a model in every room check until it is added
        self.loading_models = 0
        #: models evicted while a reader held them (``ServedModel.hold``: a peer's fill, a host-tier save): their
        #: slabs stay allocated until the last reader is done, so their bytes still count against the budget
        self._lingering: dict[int, int] = {}

    @property
    def resident_bytes(self) -> int:
        return sum(m.slab_bytes for m in self.models.values())

    @property
    def pending_bytes(self) -> int:
        """Bytes of deposits in progress: allocated, not yet served."""
        return sum(d.slab.size for d in self.deposits.values())

    def leased(self, key: WeightCacheKey) -> int:
        """Live leases on the model served under ``key`` (O(1))."""
        return self._per_key.get(key, 0)

    def held_by(self, conn_id: int) -> int:
        """Live leases of one connection (O(1))."""
        return len(self._by_conn.get(conn_id, ()))

    def _grant(self, lease: Lease) -> None:
        self.leases[lease.id] = lease
        self._by_conn.setdefault(lease.conn_id, {})[lease.id] = lease
        self._per_key[lease.key] += 1

    def _end(self, lease: Lease) -> None:
        del self.leases[lease.id]
        mine = self._by_conn[lease.conn_id]
        del mine[lease.id]
        if not mine:
            del self._by_conn[lease.conn_id]
        left = self._per_key[lease.key] - 1
        if left:
            self._per_key[lease.key] = left
        else:
            del self._per_key[lease.key]

    def fit_descriptors(self, slabs: int) -> None:
        """Hold at most ``slabs`` slab descriptors (the daemon's share of RLIMIT_NOFILE): a fifth of them, up
        to MAX_DEPOSITS, for deposits in progress, the rest, up to MAX_MODELS, for models."""
        self.max_deposits = max(1, min(self.max_deposits, slabs // 5))
        self.max_models = max(1, min(self.max_models, slabs - self.max_deposits))

    def lookup(self, requested: dict[str, str | int]) -> ServedModel | None:
        """The model served under exactly ``requested`` (None if none): one hash lookup of the key it names and
        one comparison, whatever the number of models (a scan compared the request with every model's key)."""
        try:
            key = key_from_wire(dict(requested))
        except (TypeError, ValueError):  # a map that names no key (required fields missing)
            return None
        m = self.models.get(key)
        if m is None or m.key.diff_wire(requested):  # equal keys but another type (True for 1): not the same
            return None
        return m

    def find(self, requested: dict[str, str | int]) -> ServedModel:
        """The model served under exactly ``requested``; KEY_MISMATCH against the closest served one else."""
        m = self.lookup(requested)
        if m is not None:
            return m
        raise key_mismatch(requested, self.models)  # per field: requested vs the closest served model

    def _victims(self, nbytes: int, models: int, going: ServedModel | None = None) -> list[ServedModel]:
        """The unleased models, least recently used first, whose eviction makes ``nbytes`` more bytes fit the
        budget and ``models`` more models fit ``max_models`` — deposits and loads in progress counting as held in both.
        ``going``: a model that leaves anyway (the one a deposit replaces). Chooses; evicts nothing. Raises
        where evicting every unleased model would not do: OUT_OF_MEMORY (bytes), LIMIT_EXCEEDED (models)."""
        free = (
            None
            if self.budget is None
            else self.budget - self.resident_bytes - self.pending_bytes - self.loading_bytes - self.lingering_bytes
        )
        count = len(self.models) + len(self.deposits) + self.loading_models
        if going is not None:
            count -= 1
            if free is not None and not going.held:  # a held model's bytes stay until its reader is done
                free += going.slab_bytes
        victims: list[ServedModel] = []
        for m in self.models.values():
            if (free is None or free >= nbytes) and count + models <= self.max_models:
                break
            if m is not going and not self.leased(m.key) and not m.held:  # a held model's eviction frees nothing now
                victims.append(m)
                count -= 1
                free = None if free is None else free + m.slab_bytes
        pinned = [m.key.short() for m in self.models.values() if self.leased(m.key) or m.held]
        if free is not None and free < nbytes:
            budget = self.budget or 0  # not None: there is a free
            raise OutOfMemoryError(
                f"{nbytes} bytes ({format_size(nbytes)}) do not fit the --memory-budget of {budget} bytes "
                f"({format_size(budget)}): {self.resident_bytes} bytes resident, "
                f"{self.pending_bytes} promised to deposits and {self.loading_bytes} to loads in progress, "
                f"{self.lingering_bytes} evicted but still read, pinned by leases or readers: "
                f"{', '.join(pinned) or 'none'}",
                details={
                    "needed": nbytes,
                    "budget": self.budget,
                    "resident": self.resident_bytes,
                    "pending": self.pending_bytes,
                    "loading": self.loading_bytes,
                    "lingering": self.lingering_bytes,
                    "pinned": pinned,
                },
            )
        if count + models > self.max_models:
            raise LimitExceededError(
                f"the daemon holds {len(self.models)} models, {len(self.deposits)} deposits and {self.loading_models} "
                f"loads in progress (its limit is {self.max_models} models, docs/protocol.md §7), pinned by leases: "
                f"{', '.join(pinned) or 'none'}; release or EVICT one",
                details={
                    "models": len(self.models),
                    "deposits": len(self.deposits),
                    "loading": self.loading_models,
                    "limit": self.max_models,
                },
            )
        return victims

    def make_room(self, nbytes: int, models: int = 1) -> list[ServedModel]:
        """Evict unleased models, least recently used first, until ``nbytes`` more bytes and ``models`` more
        models fit (the budget, ``max_models``). Returns them (closed). Every refusal comes first, evicting
        nothing: OutOfMemoryError (the budget; or the backend's memory, which cannot hold ``nbytes`` even with
        the victims' bytes back), LimitExceededError (the model count)."""
        victims = self._victims(nbytes, models)
        if victims and isinstance(self.backend, _RoomChecked):
            self.backend.check_room(nbytes, freeing=sum(m.slab_bytes for m in victims))
        self._evict(victims)
        return victims

    @contextlib.contextmanager
    def loading(self, nbytes: int, models: int = 1) -> Iterator[list[ServedModel]]:
        """``make_room`` for a load that runs while the daemon serves (a PRELOAD's, a load on demand's, a host-tier
        restore's), its ``nbytes`` and its model slot held against the budget and ``max_models`` until the block
        ends — the model added, or the load failed — so that a deposit or another load meanwhile cannot take the
        room or the slot made for it. Yields the evicted models."""
        victims = self.hold(nbytes, models)
        try:
            yield victims
        finally:
            self.unhold(nbytes, models)

    def hold(self, nbytes: int, models: int = 1) -> list[ServedModel]:
        """``make_room``, then hold ``nbytes`` and ``models`` slots for a load in progress until ``unhold``: what
        ``loading`` does, for a load that learns a size only as it runs (a transform's output, a fill's offer)."""
        victims = self.make_room(nbytes, models)
        self.loading_bytes += nbytes
        self.loading_models += models
        return victims

    def unhold(self, nbytes: int, models: int = 1) -> None:
        """Give back what ``hold`` held: the load ended (its model added, or it failed)."""
        self.loading_bytes -= nbytes
        self.loading_models -= models

    def _evict(self, victims: list[ServedModel]) -> None:
        for m in victims:
            del self.models[m.key]
            self._close(m)

    @property
    def lingering_bytes(self) -> int:
        """Bytes of models evicted while held, not freed yet (``_lingering``)."""
        return sum(self._lingering.values())

    def _close(self, m: ServedModel) -> None:
        """Close a model taken out of ``models``; while a reader holds it, its bytes linger in the budget until the
        reader is done (``ServedModel.finalizers`` run then, on whichever thread ends the hold)."""
        if m.held:
            key = id(m)
            self._lingering[key] = m.slab_bytes

            def freed() -> None:
                self._lingering.pop(key, None)

            m.finalizers.append(freed)
        m.close()

    def add(self, model: ServedModel) -> None:
        self.models[model.key] = model
        self._remember(model)
        for hook in self.on_add:  # e.g. the peer channel registers the slab with NIXL (docs/fleet.md)
            try:
                hook(model)
            except Exception as exc:  # serving the model must not depend on it
                log.warning("model hook failed key=%s: %s: %s", model.key.short(), type(exc).__name__, exc)

    @contextlib.contextmanager
    def restore(self, key: WeightCacheKey) -> Iterator[str | None]:
        """While a restore of ``key`` runs (one at a time per key): a commit of the key meanwhile stays recorded in
        ``generations`` for ``add_restored`` to drop the restore; yields the generation recorded now (``since``:
        the only one the host tier may restore)."""
        self.restoring.add(key)
        try:
            yield self.generations.get(key)
        finally:
            self.restoring.discard(key)
            self._forget_generation(key)

    def settled(self, key: WeightCacheKey) -> None:
        """A commit of ``key`` is settled: the host tier holds nothing older (``HostTier.supersede`` returned, or
        there is no tier)."""
        self._superseding[key] -= 1
        if self._superseding[key] <= 0:
            del self._superseding[key]
        self._forget_generation(key)

    def superseding(self, key: WeightCacheKey) -> bool:
        """Whether a commit of ``key`` is not settled yet: the host tier may still hold an older generation."""
        return bool(self._superseding.get(key))

    def _forget_generation(self, key: WeightCacheKey) -> None:
        if key not in self.restoring and not self._superseding.get(key):
            self.generations.pop(key, None)

    def add_restored(self, model: ServedModel, since: str | None) -> bool:
        """Serve a deposit restored from the host tier, unless a deposit was committed under its key since the
        restore began (``since``: ``generations.get(key)`` then) or one is served under it now: then the restore
        is stale, its slab is freed and False returned (the newer deposit stays served)."""
        if model.key in self.models or self.generations.get(model.key) != since:
            model.close()
            return False
        self.add(model)
        return True

    def remember_source(self, model: ServedModel, source: Path, facts: KeyFacts | None = None) -> None:
        """``model`` (adopted from a keeper or a previous daemon, or planned again) was loaded from ``source``:
        load-on-demand may load other variants of that checkpoint; ``facts``: what a planning of ``source`` just
        recorded of its files (engines that prove them get ``model``'s key, docs/protocol.md §4.3.1)."""
        if model.source is None:
            model.source = source
            self._remember(model)
        if facts is not None:
            self.remember_facts(facts)

    def _remember(self, model: ServedModel) -> None:
        if model.source is not None:
            self.sources[(model.key.fingerprint, model.key.fingerprint_kind)] = model.source
        if model.facts is not None:
            self.remember_facts(model.facts)

    def remember_facts(self, facts: KeyFacts) -> None:
        """Keep what a planning read of a checkpoint's files (the newest ``MAX_FACTS``)."""
        self.facts[facts.files] = facts
        self.facts.move_to_end(facts.files)
        while len(self.facts) > MAX_FACTS:
            self.facts.popitem(last=False)

    def prove_later(self, spec: RankSpec, facts: KeyFacts | None, after_ns: int | None) -> None:
        """A planning of ``spec`` recorded no ``facts`` only because its files were too fresh (``after_ns``:
        ``RankPlan.proof_after_ns``): the daemon plans it again after ``after_ns`` and records them then — for a
        spec an engine proves (no plan file, no ``verify_content``: ``WeightCacheKey.from_checkpoint`` defers no
        other key), not a whole content fingerprint read again for a proof no engine sends. The daemon plans a
        spec once however often it is named here (``Daemon._prove_pending``)."""
        if facts is None and after_ns is not None and spec.plan_file is None and not spec.verify_content:
            self.unproven.append((spec, after_ns))

    def completed(self, req: GetState) -> GetState:
        """``req`` with its key whole: a GET_STATE with a ``proof`` gets the file-derived fields from the recorded
        facts of exactly those files (docs/protocol.md §4.3.1; the proof stays, marking the key as completed).
        KeyUnprovenError with ``details.proof`` (why) when no model of this daemon was read from exactly those
        files, or the facts cannot complete the request. Idempotent."""
        if req.proof is None:
            return req
        files = tuple(sorted(req.proof.files, key=lambda f: f.name))
        facts = self.facts.get(files)
        try:
            if facts is None:
                raise ValueError(
                    "this daemon read no checkpoint whose files have exactly this identity (a file changed, was "
                    f"replaced, added or removed, or was modified less than {RACY_NS // 10**9} s before the "
                    "daemon read it)"
                )
            key = facts.complete(req.key, req.proof.dtype)
        except (ValueError, WCacheError) as exc:
            raise KeyUnprovenError(
                f"the checkpoint's files do not prove the key: {exc}; send the full key",
                details={"proof": str(exc)},
            ) from None
        self.facts.move_to_end(files)
        return dataclasses.replace(req, key=key)

    def source_for(self, requested: dict[str, str | int]) -> Path | None:
        """The directory of a checkpoint loaded before with this fingerprint, if the requested key's plan is
        one the daemon can rebuild (none or built-in); None otherwise."""
        plan = requested.get("plan", "none")
        if not isinstance(plan, str) or not (plan == "none" or plan.startswith("builtin:")):
            return None
        fp, kind = requested.get("fingerprint"), requested.get("fingerprint_kind", "sampled")
        if not isinstance(fp, str) or not isinstance(kind, str):
            return None
        return self.sources.get((fp, kind))

    def evict(self, requested: dict[str, str | int]) -> ServedModel:
        m = self.lookup(requested)
        if m is None:
            raise not_served(requested, self.models)
        n = self.leased(m.key)
        if n:
            raise InUseError(f"{m.key.short()} is held by {n} lease(s)", details={"leases": n})
        del self.models[m.key]
        self._close(m)
        return m

    def acquire(
        self, conn_id: int, pid: int, req: GetState, *, completed: bool = False
    ) -> tuple[State, list[int], ServedModel]:
        """Grant a lease for ``req`` (a proof's key completed first: ``completed``, unless the caller says it did);
        raises KeyMismatchError / NotFoundError / DeviceMismatchError / LimitExceededError — for a completed proof
        with ``details.key``, the completed key, so that the engine need not scan its checkpoint to learn it
        (docs/protocol.md §4.3.1)."""
        if not completed:
            req = self.completed(req)
        try:
            m = self.find(req.key)
            dev = self.backend.device
            if req.device_uuid and dev.uuid and req.device_uuid != dev.uuid:
                raise DeviceMismatchError(
                    f"engine is on GPU {req.device_uuid}, the daemon serves GPU {dev.uuid}",
                    details={"client": req.device_uuid, "daemon": dev.uuid},
                )
            held = self.held_by(conn_id)
            if held >= self.max_leases_per_connection:
                raise LimitExceededError(
                    f"connection already holds {held} leases (limit {self.max_leases_per_connection})"
                )
        except WCacheError as exc:
            if req.proof is not None:
                exc.details["key"] = req.key
            raise
        lease = Lease(self._next_lease, conn_id, pid, req.mode, m.key)
        self._next_lease += 1
        self._grant(lease)
        m.last_use = time.time()
        self.models.move_to_end(m.key)
        fds: list[int] = []
        state = State(
            id=req.id,
            lease=lease.id,
            key=m.key.to_wire(),
            mode=req.mode,
            slabs=m.export(fds),
            tensors=m.table,
            aliases=m.aliases,
            buffers=m.buffers,
        )
        return state, fds, m

    def release(self, conn_id: int, req: Release) -> Released:
        lease = self.leases.get(req.lease)
        if lease is None or lease.conn_id != conn_id:
            # Same answer for "no such lease" and "someone else's": nothing to learn by probing.
            raise UnknownLeaseError(f"lease {req.lease} is not held by this connection")
        self._end(lease)
        return Released(id=req.id, lease=req.lease, leases_left=self.leased(lease.key))

    def revoke(self, lease_id: int) -> None:
        """End a lease whose STATE never reached its peer (the send failed)."""
        lease = self.leases.get(lease_id)
        if lease is not None:
            self._end(lease)

    def abandon(self, deposit_id: int, why: str) -> None:
        """End a deposit in progress whose DEPOSIT_SLAB never reached its engine (the send failed): its slab is
        freed, and the key may be deposited again."""
        dep = self.deposits.get(deposit_id)
        if dep is not None:
            self._abandon(dep, why)

    def drop_connection(self, conn_id: int) -> list[Lease]:
        """End every lease of a closed connection: O(its own leases); abandon its deposits in progress."""
        ended = list(self._by_conn.get(conn_id, {}).values())
        for lease in ended:
            self._end(lease)
        for d in [d for d in self.deposits.values() if d.conn_id == conn_id]:
            self._abandon(d, "connection closed before COMMIT")
        return ended

    # ------------------------------------------------------------------ write-back (docs/protocol.md §4.13)
    def begin_deposit(self, conn_id: int, pid: int, req: Deposit) -> tuple[DepositSlab, list[int], PendingDeposit]:
        """Lay out and allocate a writable slab for ``req``. Evicts nothing (a deposit is a promise until its
        COMMIT) and refuses, allocating nothing: PROTOCOL_ERROR (a layout no client could fetch), IN_USE (a
        leased model under the key, or a deposit of it in progress), LIMIT_EXCEEDED (deposits in progress,
        the model count even after evicting every unleased model), OUT_OF_MEMORY (the budget even after
        evicting every unleased model; the memory free now, other deposits' promises deducted),
        UNSUPPORTED_PLATFORM (a backend without writable slabs)."""
        backend = self.backend
        if not isinstance(backend, _Depositable):
            raise UnsupportedPlatformError(
                f"the {backend.name} backend cannot take deposits (write-back needs a writable slab the engine "
                "maps: host memfd or CUDA VMM); serve this engine's recipe from a --device cpu or --device cuda:K "
                "daemon, or let the engine post-process on every start",
                details={"backend": backend.name},
            )
        backend.check_deposits()  # before anything is laid out: a configuration that can never take one
        key = RecipeKey.from_wire(dict(req.key))
        mine = sum(1 for d in self.deposits.values() if d.conn_id == conn_id)
        if mine >= self.max_deposits_per_connection:
            raise LimitExceededError(
                f"connection already has {mine} deposits in progress (limit {self.max_deposits_per_connection}): "
                "COMMIT them, or deposit from another connection"
            )
        if len(self.deposits) >= self.max_deposits:
            raise LimitExceededError(
                f"{len(self.deposits)} deposits are in progress on this daemon (its limit, docs/protocol.md §7): "
                "retry once they are committed, or load normally",
                details={"deposits": len(self.deposits), "limit": self.max_deposits},
            )
        for d in self.deposits.values():
            if d.key == key:
                raise InUseError(
                    f"a deposit of {key.short()} is in progress (pid {d.pid}): wait for it and fetch the key, or "
                    "load normally",
                    details={"in_progress": True, "pid": d.pid},
                )
        held = self.models.get(key)
        if held is not None and self.leased(key):
            n = self.leased(key)
            raise InUseError(
                f"{key.short()} is served and held by {n} lease(s): a deposit never replaces it; fetch it instead",
                details={"leases": n},
            )
        table, size, payload = deposit_layout(req)
        self._victims(size, 1)  # room that is free, or that evicting unleased models at COMMIT would free
        slab = backend.allocate_deposit(size)  # OUT_OF_MEMORY before any byte when memory cannot hold it now
        dep = PendingDeposit(
            self._next_deposit,
            conn_id,
            pid,
            key,
            slab,
            table,
            dict(req.aliases),
            tuple(t.name for t in req.tensors if t.kind == "buffer"),
            payload,
        )
        self._next_deposit += 1
        self.deposits[dep.id] = dep
        desc, fds = slab.export()
        reply = DepositSlab(id=req.id, deposit=dep.id, slabs=(desc,), tensors=table, aliases=dep.aliases)
        return reply, fds, dep

    def commit_deposit(
        self, conn_id: int, req: Commit
    ) -> tuple[Deposited, ServedModel, ServedModel | None, list[ServedModel]]:
        """Seal the deposit's slab, make room for it and serve it under its key. Any outcome ends the deposit:
        on an error (UNKNOWN_LEASE: not this connection's; IN_USE: still mapped writable, or leases appeared
        on the model under the key; PROTOCOL_ERROR: the engine changed the slab's seals; OUT_OF_MEMORY /
        LIMIT_EXCEEDED: leases taken meanwhile pin the room it was admitted against) its slab is freed and
        nothing is published or evicted. Returns the reply, the model, the unleased model it replaced
        (closed) and the models evicted for it (closed). The model has a new ``generation``, recorded in
        ``generations``; the caller supersedes the key's host-tier entry with it before sending DEPOSITED."""
        dep = self.deposits.get(req.deposit)
        if dep is None or dep.conn_id != conn_id:
            raise UnknownLeaseError(f"deposit {req.deposit} is not open on this connection")
        try:
            n = self.leased(dep.key)
            if n:
                raise InUseError(
                    f"{dep.key.short()} got {n} lease(s) during the deposit: it is not replaced; the deposit is "
                    "dropped, fetch the key instead",
                    details={"leases": n},
                )
            try:
                dep.slab.seal()
            except ProtocolError as exc:
                raise fail(
                    "COMMIT", "deposit", f"{exc.message}; an engine adds no seals (§4.13): the deposit is dropped"
                ) from None
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise InternalError(f"sealing deposit {dep.id} failed: {exc}; the deposit is dropped") from exc
                raise InUseError(
                    "the deposit slab is still mapped shared by the engine, so it cannot be sealed read-only: "
                    "unmap every mapping of it before COMMIT (the deposit is dropped; deposit again)",
                    details={"deposit": dep.id},
                ) from None
            old = self.models.get(dep.key)  # unleased (checked above): the deposit replaces it
            victims = self._victims(0, 0, going=old)  # the deposit still counts as in progress: room for it
        except BaseException:
            del self.deposits[dep.id]
            dep.slab.close()
            raise
        del self.deposits[dep.id]
        self._evict(victims)
        dep.table.encoded()
        stats = LoadStats(dep.payload, dep.payload, time.perf_counter() - dep.started)
        generation = secrets.token_hex(16)
        model = ServedModel(
            dep.key,
            dep.table,
            dep.aliases,
            [dep.slab],
            self.backend,
            dep.payload,
            stats,
            origin="deposit",
            buffers=dep.buffers,
            # the checkpoint its recipe names, where this daemon loaded it: a restart re-checks that against it
            source=self.source_for(dep.key.to_wire()),
            generation=generation,
        )
        if old is not None:
            del self.models[dep.key]
            self._close(old)
        self.add(model)
        self.generations[dep.key] = generation  # what the host tier may hold of the key from now on
        self._superseding[dep.key] += 1  # until ``settled``: the tier may still hold an older deposit
        reply = Deposited(
            id=req.id,
            deposit=dep.id,
            key=dep.key.to_wire(),
            bytes=model.slab_bytes,
            tensors=len(dep.table),
            replaced=old is not None,
            evicted=tuple(m.key.to_wire() for m in victims),
        )
        return reply, model, old, victims

    def _abandon(self, dep: PendingDeposit, why: str) -> None:
        del self.deposits[dep.id]
        dep.slab.close()
        log.info(
            "deposit abandoned deposit=%d pid=%d key=%s bytes=%d reason=%s",
            dep.id,
            dep.pid,
            dep.key.short(),
            dep.slab.size,
            why,
        )

    def model_infos(self) -> tuple[ModelInfo, ...]:
        return tuple(
            ModelInfo(
                key=m.key.to_wire(),
                backend=self.backend.name,
                bytes=m.slab_bytes,
                tensors=len(m.table),
                leases=self.leased(m.key),
                load_seconds=m.stats.seconds,
                last_use=m.last_use,
                origin=m.origin,
                source=str(m.source or ""),
                tier_copy=m.stats.tier_copy,
            )
            for m in self.models.values()
        )

    def lease_infos(self) -> tuple[LeaseInfo, ...]:
        now = time.monotonic()
        return tuple(LeaseInfo(x.id, x.mode, x.pid, now - x.created) for x in self.leases.values())

    def close(self) -> None:
        for m in self.models.values():
            m.close()
        self.models.clear()
        for d in list(self.deposits.values()):
            self._abandon(d, "daemon stopping")
