"""A daemon's side of its wcache-keeper (wcache/server/keeper.py; docs/protocol.md §4.11): one request per
connection (``call``), KEEP / UNKEEP / RECLAIM (``keep``, ``unkeep``, ``reclaim``), and ``KeeperLink``, what
the daemon holds to deposit what it loads, withdraw what it evicts, take back what it deposited when it
starts, and deposit everything again when the keeper has restarted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from wcache import __version__
from wcache.channel import close_fds, connect, expect
from wcache.errors import CacheUnavailableError, NotFoundError, RemoteProtocolError, WCacheError
from wcache.files import write_new
from wcache.locks import exited
from wcache.paths import KEEPER_SOCKET
from wcache.plan.key import KeyValue, WeightCacheKey
from wcache.proto import Frame, HandedModel, Keep, Kept, Reclaim, Reclaimed, Unkeep

if TYPE_CHECKING:
    from wcache.server.store import ServedModel

__all__ = ["CommitRecord", "KeeperLink", "call", "keep", "reclaim", "unkeep"]

log = logging.getLogger("wcache.keeper")

_F = TypeVar("_F", Kept, Reclaimed)


async def call(
    path: Path, frame: Frame, fds: Sequence[int] = (), timeout: float = 10.0
) -> tuple[Frame, list[int], int]:
    """One request to the keeper at ``path`` on a connection of its own: (reply, its fds, the keeper's pid).
    ``fds`` stay the caller's. An ERROR reply raises its exception class."""
    async with asyncio.timeout(timeout):
        ch, hello = await connect(path, software=f"wcache/{__version__}", name="wcache-server", peer="wcache-keeper")
        try:
            await ch.send(frame, list(fds))
            reply, got = await expect(ch)
        finally:
            ch.close()
    return reply, got, hello.server_pid


async def keep(
    path: Path, *, owner: str, backend: str, device_uuid: str, model: HandedModel, fds: list[int], timeout: float = 10.0
) -> tuple[Kept, int]:
    """KEEP ``model`` (its slabs' fd fields index ``fds``, which stay the caller's) in the keeper at ``path``;
    returns the reply and the keeper's pid."""
    req = Keep(id=1, owner=owner, backend=backend, device_uuid=device_uuid, model=model, pid=os.getpid())
    reply, _, pid = await call(path, req, fds, timeout)
    return _reply(reply, Kept), pid


async def unkeep(path: Path, *, owner: str, key: dict[str, str | int], timeout: float = 10.0) -> Kept:
    reply, _, _ = await call(path, Unkeep(id=1, owner=owner, key=key), [], timeout)
    return _reply(reply, Kept)


async def reclaim(
    path: Path, *, owner: str, backend: str, device_uuid: str, timeout: float = 10.0
) -> tuple[Reclaimed, list[int], int]:
    """RECLAIM: the models kept for ``owner``, their fds (the caller owns and must close them), the keeper's pid."""
    req = Reclaim(id=1, owner=owner, backend=backend, device_uuid=device_uuid, pid=os.getpid())
    reply, fds, pid = await call(path, req, [], timeout)
    return _reply(reply, Reclaimed, fds), fds, pid


def _reply(frame: Frame, cls: type[_F], fds: list[int] | None = None) -> _F:
    if not isinstance(frame, cls):
        close_fds(fds or [])
        raise RemoteProtocolError(f"expected {cls.__name__}, got {frame.TYPE}")
    return frame


class CommitRecord:
    """``<socket>.deposits``: the generation of each deposit committed on this socket whose older generations a
    keeper or the host tier may still hold (docs/reliability.md, "The commit record"). A daemon with a keeper
    writes a deposit's generation here before it offers it to the keeper (KEEP) and removes it once the keeper
    holds it or holds nothing of its key (KEEP, UNKEEP, or a RECLAIM that shows it) and the host tier holds nothing
    older (``pending``: the COMMIT's tombstone not yet written): while the keeper does not answer — stopped, hung —
    a COMMIT's generation stays here, across a crash of the daemon. A daemon without a keeper writes every COMMIT's
    generation here (no keeper settles it): a keeper the socket's daemons used before may still hold an older
    deposit of the key. The next daemon with ``--keeper`` drops a kept deposit of another generation instead of
    serving bytes older than the last COMMIT, and a host-tier restore of a key the record names takes that
    generation only. An entry whose COMMIT's host-tier tombstone is not written yet (the tier's lock held by another
    daemon) is flagged (``tombstones``: its key's wire form, to retry it with): no KEEP or RECLAIM removes it until
    the tombstone is written, by this daemon or the next one of the socket (after a TAKEOVER, a crash or a
    restart). JSON ``{"format", "keys": {key id: generation}, "tombstones"?: {key id: key}, "keeper"?, "damaged"?,
    "partial"?}`` (no ``tombstones``: none pending), written to a temporary file of the writer's own
    (``<name>.<pid>.tmp``, created exclusively) and renamed over it. It holds at most ``MAX_KEYS`` keys: a COMMIT of
    one more (a daemon without a keeper writing back under ever new recipe keys settles none) gives up the other
    entries and marks the record damaged instead, the conservative side.

    An entry settled says "this keeper holds the last generation of the key, or nothing of it" — of one keeper
    only: ``settled_in`` (``"keeper"`` in the file, the real path of that keeper's socket) names it. A kept
    deposit whose key the record does not name is served only from that keeper; from any other (the daemon
    restarted with another ``--keeper``, which may hold a generation older than what the named one took) it is
    stale. No file stands for the socket directory's own keeper (``wcache-keeper.sock`` beside the socket: the
    file goes when it records nothing else, and the directory with the last process in it); a file without the
    field (an older daemon's) vouches for no keeper. Entries settle only against the named keeper, and a daemon
    whose keeper is another one keeps its COMMITs' entries (as without a keeper) until a RECLAIM from its keeper
    has dropped every kept deposit the record cannot vouch for (``reclaimed``): the record names that keeper from
    then on. One keeper process at a time serves a socket path (its lock), and what it holds dies with it, so the
    path is the keeper's identity.

    A file that cannot be read or parsed says nothing of which generation is last: every kept deposit is stale
    (``known`` False), and stays so — the flag ``damaged`` is written with the entries — until a RECLAIM has
    acted on it (``reclaimed``): a COMMIT meanwhile must not turn it into a record that vouches for the others.
    Such a record is also ``partial`` for good: it may have lost the entry of a COMMIT whose host-tier tombstone
    a crash prevented, so a key it does not name is not restored from the tier; the entries it records from then
    on vouch for their keys and are kept (not settled).

    After a TAKEOVER the socket's record is the new daemon's: ``hand_over`` makes this process write nothing
    more (its entries in memory know nothing of the new daemon's COMMITs)."""

    FORMAT = "wcache-deposits/1"
    #: keys recorded at most (~100 bytes each in the file)
    MAX_KEYS = 4096

    def __init__(self, path: Path, *, keeper: str | None = None) -> None:
        self.path = path
        #: the keeper this daemon keeps its models in (the real path of its socket; None: a daemon without one)
        self.keeper = keeper
        self.keys: dict[str, str] = {}
        #: the keeper the entries were settled against (the real path of its socket): for a key the record does not
        #: name it holds the last generation committed or nothing. No file: the socket directory's own keeper;
        #: None: no keeper (a record of an older daemon, which did not say)
        self.default_keeper = os.path.realpath(path.parent / KEEPER_SOCKET)
        self.settled_in: str | None = self.default_keeper
        #: whether the record names the last generation of every key (False: unreadable, damaged or full),
        #: else every kept deposit is stale at RECLAIM
        self.known = True
        #: whether the record lost entries once (unreadable, damaged or full): a key it does not name may have a
        #: COMMIT it forgot, so the host tier restores only the keys it names (their generation)
        self.partial = False
        #: whether a COMMIT of the key is not settled in the host tier yet (its tombstone not written): its entry
        #: stays though the keeper holds it (the daemon sets this: ``Store.superseding``)
        self.pending: Callable[[WeightCacheKey], bool] = lambda key: False
        #: entries whose COMMIT's host-tier tombstone is not written yet: key id -> the key's wire form
        self.tombstones: dict[str, dict[str, KeyValue]] = {}
        self._handed_over = False
        self._remove_dead_temporaries()
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("%s unreadable (%s): every kept deposit will be dropped", path, exc)
            self.known, self.partial, self.settled_in = False, True, None
            return
        try:
            doc = json.loads(raw)
            keys = doc["keys"] if doc.get("format") == self.FORMAT else None
            if not isinstance(keys, dict) or not all(isinstance(v, str) for v in keys.values()):
                raise ValueError(f"not a {self.FORMAT} record")
        except (ValueError, AttributeError, KeyError) as exc:
            log.warning("%s is damaged (%s): every kept deposit will be dropped", path, exc)
            self.known, self.partial, self.settled_in = False, True, None
            return
        self.keys = {str(k): v for k, v in keys.items()}
        stones = doc.get("tombstones") or {}
        if isinstance(stones, dict):
            self.tombstones = {str(k): v for k, v in stones.items() if str(k) in self.keys and isinstance(v, dict)}
        keeper = doc.get("keeper")  # absent from an older daemon's record: it vouches for no keeper
        self.settled_in = keeper if isinstance(keeper, str) and keeper else None
        if doc.get("damaged"):
            self.known = False  # an earlier daemon found it damaged; no RECLAIM has acted on it since
        if doc.get("damaged") or doc.get("partial"):
            self.partial = True

    @staticmethod
    def key_id(key: WeightCacheKey) -> str:
        from wcache.server.tier import HostTier

        return HostTier.entry_id(key)

    @property
    def vouches(self) -> bool:
        """Whether the entries were settled against this daemon's keeper: a key the record does not name has its
        last generation, or nothing, there."""
        return self.keeper is not None and self.settled_in == self.keeper

    def stale(self, key: WeightCacheKey, generation: str) -> str | None:
        """Why a deposit of ``key`` and ``generation`` kept in this daemon's keeper must not be served (None: it
        may)."""
        if not self.known:
            return (
                f"{self.path.name} could not be read or was full: the deposit last committed under its key is not known"
            )
        recorded = self.keys.get(self.key_id(key))
        if recorded is not None and recorded != generation:
            return (
                f"generation {recorded} was committed under its key after it (this one "
                f"{generation or 'unknown'}) and the keeper never took it: it is not the deposit last committed"
            )
        if recorded is None and not self.vouches:
            where = (
                f"was settled against the keeper at {self.settled_in}, not this one (a later deposit of its key "
                "may have been committed and kept there)"
                if self.settled_in
                else "names no keeper it was settled against (an older daemon's record)"
            )
            return f"{self.path.name} {where}: it is not known to be the deposit last committed"
        return None

    def restorable(self, key: WeightCacheKey) -> tuple[bool, str | None]:
        """Whether the host tier may restore ``key``, and the generation it must be (None: whichever it holds —
        a key this intact record does not name was not committed on this socket since its tier tombstone, or
        another socket's deposit in a shared tier). A partial record vouches only for the keys it names."""
        recorded = self.keys.get(self.key_id(key))
        if recorded is not None:
            return True, recorded
        return not self.partial and self.known, None

    def committed(self, key: WeightCacheKey, generation: str) -> None:
        """Before ``generation`` of ``key`` is offered to the keeper: from now on no other one may be served."""
        kid = self.key_id(key)
        if self.keys.get(kid) == generation or self._handed_over:
            return
        if kid not in self.keys and len(self.keys) >= self.MAX_KEYS:
            log.warning(
                "%s holds %d keys, its most: every deposit a keeper holds for this socket will be dropped at its "
                "next reclaim, and the host tier restores only deposits committed from now on, instead of "
                "recording more",
                self.path,
                len(self.keys),
            )
            # a flagged entry stays (its COMMIT's tombstone is not written: the next daemon must still retry it)
            self.keys = {i: self.keys[i] for i in self.tombstones}
            self.known, self.partial = False, True
        self.keys[kid] = generation
        self._write()

    def settled(self, key: WeightCacheKey) -> None:
        """This daemon's keeper holds ``key``'s recorded generation, or nothing of the key: its entry goes, unless
        the host tier may still hold an older generation (``pending``, or its tombstone flagged as not written), the
        record is partial (the entry vouches for the key's tier restore), or its entries were settled against another
        keeper (``vouches``: that one may hold an older generation of the key, which only the entry makes stale)."""
        kid = self.key_id(key)
        if self.partial or self.pending(key) or kid in self.tombstones or not self.vouches:
            return
        if self.keys.pop(kid, None) is not None:
            self._write()

    def tombstone_pending(self, key: WeightCacheKey, generation: str) -> None:
        """The COMMIT of ``generation`` (recorded) could not write its host-tier tombstone: its entry is flagged,
        and stays until ``tombstone_written``, across a crash or a TAKEOVER."""
        kid = self.key_id(key)
        if self.keys.get(kid) == generation and kid not in self.tombstones:
            self.tombstones[kid] = key.to_wire()
            self._write()

    def tombstone_written(self, key: WeightCacheKey, generation: str) -> None:
        """The tombstone of ``generation`` is written (or the tier records that generation): the entry, if it is
        still that generation's, is settled by the usual rule from now on."""
        kid = self.key_id(key)
        if self.keys.get(kid) == generation and self.tombstones.pop(kid, None) is not None:
            self._write()

    def reclaimed(self, held: set[str], *, confirmed: bool) -> None:
        """After a RECLAIM from this daemon's keeper, which served the deposits of the keys ``held`` (key ids) and
        dropped every other deposit it held for the socket — each drop confirmed by the keeper or not
        (``confirmed``: all were). All confirmed, the keeper holds nothing the record does not vouch for: a damaged
        record becomes known, and the record names this keeper (``settled_in``). Not all, a damaged record stays
        damaged and the record names the keeper it named: a kept deposit it made stale may still be held there.
        Where the record then names this keeper, the entries of ``held`` go (the keeper holds their recorded
        generation; the host tier, where there is one, records that generation or none) unless the record is
        partial or their tombstone is flagged as not written; every other entry stays (it still guards the host
        tier's restore of its key)."""
        known = self.known or confirmed
        settled_in = self.keeper if confirmed and self.keeper is not None else self.settled_in
        keys = self.keys
        if not self.partial and settled_in is not None and settled_in == self.keeper:
            keys = {i: g for i, g in self.keys.items() if i not in held or i in self.tombstones}
        if keys != self.keys or known != self.known or settled_in != self.settled_in:
            self.keys, self.known, self.settled_in = keys, known, settled_in
            self._write()

    def hand_over(self) -> None:
        """A TAKEOVER is done: the new daemon writes the record from now on; this process writes nothing more."""
        self._handed_over = True

    def _temporary(self, pid: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{pid}.tmp")

    def _remove_dead_temporaries(self) -> None:
        """Remove the temporary files that writers which died mid-write left (``<name>.<pid>.tmp``); a live
        process's are left."""
        prefix = self.path.name + "."
        try:
            names = os.listdir(self.path.parent)
        except OSError:
            return
        for name in names:
            pid_text = name[len(prefix) : -len(".tmp")]
            if not (name.startswith(prefix) and name.endswith(".tmp") and pid_text.isdigit()):
                continue
            if not exited(int(pid_text)):  # alive (or not ours to signal): its write may be in progress
                continue
            with contextlib.suppress(OSError):
                os.unlink(self.path.parent / name)

    def _write(self) -> None:
        """Replace the file atomically (removed when it records nothing), through this process's own temporary
        file, created exclusively: two processes writing at once (the old daemon and the new one around a
        TAKEOVER) never write into one file. A failure is logged, not raised: the entries stay in memory and the
        next change writes them again."""
        if self._handed_over:
            return
        tmp = self._temporary(os.getpid())
        try:
            if not self.keys and self.known and not self.partial and self.settled_in == self.default_keeper:
                self.path.unlink(missing_ok=True)  # what no file says
                return
            doc: dict[str, object] = {"format": self.FORMAT, "keys": self.keys}
            if self.tombstones:
                doc["tombstones"] = self.tombstones
            if self.settled_in is not None:
                doc["keeper"] = self.settled_in
            if not self.known:
                doc["damaged"] = True
            if self.partial:
                doc["partial"] = True
            data = (json.dumps(doc, sort_keys=True) + "\n").encode()
            tmp.unlink(missing_ok=True)  # this process's own, from a write that failed before its rename
            write_new(tmp, data)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            log.warning(
                "%s not written (%s): a crash before the keeper holds the last deposits (%d) could bring back older ones",
                self.path,
                exc,
                len(self.keys),
            )


class KeeperLink:
    """A daemon's side of its keeper: RECLAIM at start, KEEP what it loads, UNKEEP what it evicts, and
    KEEP everything again when the keeper has restarted (``check``, run periodically: a restarted
    keeper holds nothing). The keeper is an optimisation: when it is down or refuses, the daemon logs
    one line and serves on."""

    def __init__(self, path: Path, *, owner: Path, backend: str, device_uuid: str) -> None:
        # the owner is the socket's real path: one socket reached through a symlinked directory (/var/run and /run)
        # is one owner, as its lock and its record are one file each
        self.path, self.owner, self.backend, self.device_uuid = path, os.path.realpath(owner), backend, device_uuid
        #: model key -> the keeper process that holds it (a restarted keeper holds nothing)
        self.kept_in: dict[WeightCacheKey, int] = {}
        self._unreachable = False
        self._reclaimed_from = 0
        self._keeper_now = 0  # the keeper process last reached (0: unreachable or never)
        #: models not to offer again: key -> the keeper pid that refused it (0: no keeper can hold it, an IPC slab)
        self._skip: dict[WeightCacheKey, int] = {}
        # one request at a time, in order: an UNKEEP must not overtake the KEEP of the same model
        self._lock = asyncio.Lock()
        #: the deposits committed that the keeper may not hold yet (a file beside the socket, read at start); it
        #: vouches for what one keeper holds, named by its socket's real path (one keeper reached through two
        #: spellings of its directory is one keeper)
        self.record = CommitRecord(Path(f"{owner}.deposits"), keeper=os.path.realpath(path))
        #: a TAKEOVER is done: the keeper's entries for this socket are the new daemon's (``hand_over``)
        self._handed_over = False

    async def reclaim(self) -> tuple[Reclaimed, list[int]]:
        """What the keeper holds for this daemon (the caller adopts the models and then calls ``reclaimed``)."""
        state, fds, self._reclaimed_from = await reclaim(
            self.path, owner=self.owner, backend=self.backend, device_uuid=self.device_uuid
        )
        self._keeper_now = self._reclaimed_from
        return state, fds

    def hand_over(self) -> None:
        """A TAKEOVER is done: the socket, its keeper entries and its record are the new daemon's. This process
        asks the keeper nothing more (a KEEP or UNKEEP from it would change what the new daemon's keeper holds,
        or is refused once its lock is gone) and writes no record; work queued on the lock finds this and ends."""
        self._handed_over = True
        self.record.hand_over()

    def reclaimed(self, models: Sequence[ServedModel]) -> None:
        for m in models:
            self.kept_in[m.key] = self._reclaimed_from

    async def keep(self, model: ServedModel) -> None:
        async with self._lock:
            await self._keep(model)

    async def _keep(self, model: ServedModel) -> str:
        """KEEP ``model``: "kept", "closed" (evicted before this KEEP's turn: nothing to keep), "unkeepable" (a
        slab without an fd), "refused" (an ERROR from the keeper) or "unreachable".

        The KEEP carries duplicates of the slabs' descriptors, taken before the first await: the slabs' own
        numbers, sent after the keeper's handshake, named whatever file had the number by then — an evict closes
        a slab meanwhile and the next deposit's memfd gets its number, and the keeper held that deposit's bytes
        (or its writable slab) under this model's key and generation, which a daemon restarted after a crash
        served (docs/reliability.md, "a KEEP racing an evict")."""
        # closed while this KEEP waited for its turn (its UNKEEP, queued after, settles it), or handed over with the
        # socket: it records nothing (a later COMMIT of the key may have recorded, and settled, its own)
        if self._handed_over or not model.hold():
            return "closed"
        if model.generation:  # a deposit: its generation on disk before the keeper may hold it or an older one
            self.record.committed(model.key, model.generation)
        own: list[int] = []
        fds: list[int] = []
        try:
            descs = model.export(own)
            for fd in own:
                fds.append(os.dup(fd))
        except BaseException:
            close_fds(fds)
            raise
        finally:
            model.release_hold()
        try:
            if any(d.fd < 0 for d in descs):
                log.info(
                    "not kept key=%s: a %s slab cannot be kept (use --cuda-export vmm)",
                    model.key.short(),
                    descs[0].kind,
                )
                self._skip[model.key] = 0
                return "unkeepable"
            try:
                kept, pid = await keep(
                    self.path,
                    owner=self.owner,
                    backend=self.backend,
                    device_uuid=self.device_uuid,
                    model=model.handed(descs),
                    fds=fds,
                )
            except (WCacheError, OSError, TimeoutError) as exc:
                log.warning("keeper %s did not keep key=%s: %s", self.path, model.key.short(), exc)
                if not isinstance(exc, (CacheUnavailableError, OSError, TimeoutError)):
                    return "refused"
                self._gone()
                return "unreachable"
        finally:
            close_fds(fds)
        self.kept_in[model.key] = self._keeper_now = pid
        self.record.settled(model.key)
        log.info(
            "kept in keeper=%s key=%s bytes=%d keeper_models=%d keeper_bytes=%d",
            self.path,
            model.key.short(),
            model.slab_bytes,
            kept.models,
            kept.bytes,
        )
        return "kept"

    async def unkeep(self, model: ServedModel) -> None:
        async with self._lock:
            await self._unkeep_key(model.key)

    async def commit(self, model: ServedModel, old: ServedModel | None) -> None:
        """A COMMIT's deposit ``model``, replacing ``old`` (the generation served under the key before it): its
        generation recorded (``record``), ``old`` withdrawn, ``model`` kept. A keeper that did not answer the
        UNKEEP is not asked to KEEP — a stopped keeper's timeout would be paid twice before DEPOSITED —, nor one
        the last ``check`` found unreachable: ``check`` keeps the deposit once the keeper answers, and until then
        the record stops the older generation the keeper holds from being served after a crash."""
        async with self._lock:
            if model.closed or self._handed_over:  # replaced or evicted while this waited for the lock: the newer
                return  # one's COMMIT records; or handed over: the new daemon keeps it (its ``check``)
            if self._unreachable:
                self.record.committed(model.key, model.generation)
                self.kept_in.pop(model.key, None)  # the keeper holds an older one, if any: ``check`` keeps this one
                log.warning(
                    "keeper %s unreachable: deposit key=%s not kept until it answers", self.path, model.key.short()
                )
                return
            if old is not None:
                self.record.committed(model.key, model.generation)
                if await self._unkeep_key(old.key) == "unreachable":
                    return
            await self._keep(model)

    async def settle(self, model: ServedModel) -> None:
        """The host tier holds nothing older than ``model`` now (its COMMIT's tombstone written late): the record's
        entry of its key goes if the keeper process reached last holds ``model`` (its KEEP, while the tombstone was
        not written, kept the entry)."""
        async with self._lock:
            if self._handed_over or model.closed:
                return
            if self._keeper_now and self.kept_in.get(model.key) == self._keeper_now:
                self.record.settled(model.key)

    async def drop(self, key: WeightCacheKey, *, settle: bool = True) -> bool:
        """UNKEEP ``key`` (a reclaimed model this daemon will not serve: it failed its checks); whether the keeper
        confirmed it holds nothing of it now. ``settle`` False: the record's entry of the key stays whatever the
        keeper answers (the host tier may hold an older generation than the entry's)."""
        async with self._lock:
            return await self._unkeep_key(key, settle=settle) == "gone"

    async def _unkeep_key(self, key: WeightCacheKey, *, settle: bool = True) -> str:
        """UNKEEP ``key``: "gone" (the keeper holds nothing of it now; ``settle``: the record's entry goes unless
        the host tier may still hold an older generation), "refused" or "unreachable" (also after a hand-off: the
        key is the new daemon's to withdraw)."""
        if self._handed_over:
            return "unreachable"
        self.kept_in.pop(key, None)
        self._skip.pop(key, None)
        try:
            await unkeep(self.path, owner=self.owner, key=key.to_wire())
        except NotFoundError:
            pass  # never kept (an IPC slab, or the keeper restarted meanwhile)
        except (WCacheError, OSError, TimeoutError) as exc:
            log.warning(
                "keeper %s did not drop key=%s (its memory stays held until the keeper stops): %s",
                self.path,
                key.short(),
                exc,
            )
            if not isinstance(exc, (CacheUnavailableError, OSError, TimeoutError)):
                return "refused"
            self._gone()
            return "unreachable"
        if settle:
            self.record.settled(key)
        return "gone"

    def _gone(self) -> None:
        """The keeper did not answer: what it holds is unknown until ``check`` reaches it again."""
        self._unreachable = True
        self._keeper_now = 0

    def kept(self, models: Sequence[ServedModel]) -> int:
        """How many of ``models`` the keeper process last reached holds (as far as this daemon knows)."""
        return sum(1 for m in models if self._keeper_now and self.kept_in.get(m.key) == self._keeper_now)

    async def check(self, served: Callable[[], Sequence[ServedModel]]) -> None:
        """KEEP again every model (``served()``: the daemon's models now) that the keeper process now
        running does not hold (it restarted, or was not running when the model was loaded). One
        handshake when nothing is missing."""
        async with self._lock:
            if self._handed_over:
                return
            try:
                async with asyncio.timeout(10.0):
                    ch, hello = await connect(
                        self.path, software=f"wcache/{__version__}", name="wcache-server", peer="wcache-keeper"
                    )
                    ch.close()
            except (WCacheError, OSError, TimeoutError) as exc:
                if not self._unreachable:
                    log.warning("keeper %s unreachable (%s): a daemon crash now would mean reloading", self.path, exc)
                self._unreachable = True
                self._keeper_now = 0
                return
            self._unreachable = False
            self._keeper_now = hello.server_pid
            pid = hello.server_pid
            missing = [
                m.key for m in served() if self.kept_in.get(m.key) != pid and self._skip.get(m.key) not in (0, pid)
            ]
            if missing:
                log.info(
                    "keeper %s (pid %d) does not hold %d model(s) of this daemon: keeping them",
                    self.path,
                    pid,
                    len(missing),
                )
            for key in missing:
                m = next((m for m in served() if m.key == key), None)  # evicted meanwhile: not kept
                if m is not None and await self._keep(m) == "refused":
                    self._skip[key] = pid  # not offered to this keeper again (one warning, not one per check)
