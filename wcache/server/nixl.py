"""NIXL, the data path of a fleet fill (docs/fleet.md): the only module that imports it.

NIXL (its UCX backend) moves bytes between registered memory of two processes with one-sided READs: RDMA and
GPUDirect where the hardware has them, shared memory (CMA) between processes of one host, TCP otherwise. A
source daemon registers each resident slab once (:meth:`Agent.register`) and hands a target its agent's
metadata and the slab's address over the authenticated control channel; the target registers its new slab
and READs straight into it (:meth:`Agent.read`). Nothing else of NIXL is used: no listener thread, no
metadata server, no notifications (the control channel says when a fill is done), no pickled descriptor
lists (``nixl_agent.get_serialized_descs`` pickles; the frames carry plain integers instead).

The package is ``nixl-cu12`` or ``nixl-cu13`` (``pip install -e ".[fleet]"``; module ``nixl_cu12`` /
``nixl_cu13``): :func:`nixl_module` imports whichever is present, lazily, and raises a
:class:`~wcache.errors.FillError` naming the install command when neither is. Slab addresses come from the
backends (``Slab.region()``), so this module names no device API.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from wcache.errors import FillError
from wcache.plan.reshard import Copy
from wcache.server.backends.base import MemoryRegion, Slab

__all__ = ["MODULES", "Agent", "ReadStats", "Registration", "Transfer", "nixl_module"]

log = logging.getLogger("wcache.fleet")

#: The NIXL packages' module names, CUDA 13 build first (the H200's), then CUDA 12 (installs and runs on a
#: machine without a GPU: CI's).
MODULES = ("nixl_cu13", "nixl_cu12")
_MEM = {"host": "DRAM", "cuda": "VRAM"}
_loaded: ModuleType | None = None


def nixl_module() -> ModuleType:
    """The NIXL Python package, imported once. FillError (reason ``nixl-missing``) when it is not installed."""
    global _loaded
    if _loaded is not None:
        return _loaded
    # NIXL logs every agent and backend it creates at INFO on stdout; an operator's log gets wcache's lines
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    errors = []
    for name in MODULES:
        try:
            _loaded = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        logging.getLogger("nixl").setLevel(logging.WARNING)
        return _loaded
    raise FillError(
        'fleet fill needs NIXL, which is not installed: pip install -e ".[fleet]" (nixl-cu12; on a CUDA 13 '
        "machine install nixl-cu13) — " + "; ".join(errors),
        details={"reason": "nixl-missing"},
    )


@dataclass(frozen=True)
class Registration:
    """One registered region: what a peer READs from (or into), valid until :meth:`Agent.deregister`."""

    region: MemoryRegion
    seconds: float  # what registering it cost
    handle: Any = field(repr=False, compare=False)


@dataclass(frozen=True)
class ReadStats:
    bytes: int
    descriptors: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Agent:
    """One NIXL agent with the UCX backend. ``name`` must be unique among the agents that meet (a daemon uses
    its host, pid and a random part). ``threads``: UCX worker threads (0: NIXL's default). Not thread-safe:
    one thread (the daemon's fill or the source's registration) uses it at a time. :meth:`close` destroys it
    (its UCX worker's threads, sockets and pipes) at once: its owner calls it, whatever else still refers to it."""

    def __init__(self, name: str, *, threads: int = 0) -> None:
        nixl = nixl_module()
        self.name = name
        try:
            cfg = nixl.nixl_agent_config(backends=["UCX"], num_threads=threads)
            native = nixl.nixl_agent(name, cfg)
        except Exception as exc:  # the bindings raise their own classes (nixlBackendError, RuntimeError)
            raise FillError(f"NIXL agent {name}: {type(exc).__name__}: {exc}", details={"reason": "nixl"}) from exc
        if "UCX" not in native.backends:
            del native  # not kept alive by this error's traceback
            raise FillError(f"NIXL agent {name}: no UCX backend in this NIXL build", details={"reason": "nixl"})
        #: the NIXL agent; None once closed (the only reference wcache keeps: dropping it destroys the agent)
        self._agent: Any = native
        self._peers: set[str] = set()
        #: called with each READ's bytes just before it is prepared and posted (what a test or a benchmark
        #: observes of the READ timeline: docs/fleet.md, "Bandwidth policy")
        self.on_post: Callable[[int], None] | None = None

    @property
    def _nixl(self) -> Any:
        """The NIXL agent (FillError, reason ``nixl``, once closed)."""
        if self._agent is None:
            raise FillError(f"NIXL agent {self.name} is closed", details={"reason": "nixl"})
        return self._agent

    @property
    def closed(self) -> bool:
        return self._agent is None

    # ------------------------------------------------------------------ memory
    def register(self, region: MemoryRegion) -> Registration:
        """Register ``region`` with UCX (on a host region: nothing pinned over TCP/CMA; RDMA pins it)."""
        nixl = self._nixl
        t0 = time.perf_counter()
        try:
            reg = nixl.register_memory(
                [(region.address, region.length, region.device, "")], _MEM[region.kind], backends=["UCX"]
            )
        except Exception as exc:
            raise FillError(
                f"NIXL could not register {region.length} bytes of {region.kind} memory: {type(exc).__name__}: {exc}",
                details={"reason": "register"},
            ) from exc
        return Registration(region, time.perf_counter() - t0, reg)

    def register_slab(self, slab: Slab) -> Registration:
        """Register ``slab`` where this process maps it (``Slab.region()``: writable until sealed)."""
        return self.register(slab.region())

    def deregister(self, reg: Registration) -> None:
        """Drop ``reg`` (a no-op once closed: the agent's end dropped every registration)."""
        if self._agent is not None:
            self._agent.deregister_memory(reg.handle, backends=["UCX"])

    def metadata(self, regs: Sequence[Registration] = ()) -> bytes:
        """What a peer needs to READ ``regs`` (and connect): partial metadata, so the peer learns no other
        registered region. A capability: send it only over an authenticated channel (docs/security.md)."""
        nixl = self._nixl
        if not regs:
            return bytes(nixl.get_agent_metadata())
        descs = [(r.region.address, r.region.length, r.region.device, "") for r in regs]
        kinds = {r.region.kind for r in regs}
        if len(kinds) != 1:
            raise ValueError("regions of one metadata blob are of one memory kind")
        dlist = nixl.get_reg_descs(descs, _MEM[kinds.pop()])
        return bytes(nixl.get_partial_agent_metadata(dlist, True, ["UCX"]))

    # ------------------------------------------------------------------ peers
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata (from its OFFER); returns its agent name."""
        nixl = self._nixl
        try:
            name = nixl.add_remote_agent(metadata)
        except Exception as exc:
            raise FillError(
                f"NIXL refused a peer's metadata: {type(exc).__name__}: {exc}", details={"reason": "nixl"}
            ) from exc
        peer = name.decode() if isinstance(name, bytes) else str(name)
        self._peers.add(peer)
        return peer

    def remove_peer(self, peer: str) -> None:
        if peer in self._peers and self._agent is not None:
            self._peers.discard(peer)
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as exc:  # a peer that died: nothing left to disconnect
                log.debug("NIXL remove_remote_agent %s: %s", peer, exc)

    # ------------------------------------------------------------------ transfers
    def start_read(
        self,
        peer: str,
        copies: Sequence[Copy],
        local: MemoryRegion,
        remote: MemoryRegion,
        *,
        deadline: float,
        strided: bool = False,
    ) -> Transfer:
        """Post one READ request of every copy (a resharding plan's, wcache/plan/reshard.py: ``src`` offsets into
        ``peer``'s ``remote`` region, ``dst`` offsets into ``local``) and return at once: poll
        :meth:`Transfer.done` (an event loop polls several, one per source) or block in :meth:`Transfer.wait`.
        ``deadline``: time.monotonic() by which it must be done, else FillError (reason ``deadline``); a
        transfer NIXL reports failed is FillError (reason ``transfer``). ``strided``: copies of several runs go
        as NIXL's strided lists instead of one descriptor per run (docs/fleet.md, "Strided shards"). Copies
        outside their regions are a ValueError before NIXL sees them."""
        for c in copies:
            _inside(c.src, c.src_stride, c, remote, "remote")
            _inside(c.dst, c.dst_stride, c, local, "local")
        nbytes = admit(peer, copies, deadline, self.on_post)
        blocks = copies
        t0 = time.perf_counter()
        handle, prepped, n = self._request(peer, blocks, local, remote, strided)
        t = Transfer(self, peer, handle, prepped, nbytes, n, deadline, t0)
        try:
            t.post()
        except BaseException:
            t.release()
            raise
        return t

    def _request(
        self, peer: str, blocks: Sequence[Copy], local: MemoryRegion, remote: MemoryRegion, strided: bool
    ) -> tuple[Any, list[Any], int]:
        """The NIXL transfer request for ``blocks``, the prepared lists it holds, and its descriptor count."""
        import numpy as np

        nixl = self._nixl
        try:
            if strided:
                src = np.array(
                    [
                        (remote.address + b.src, b.length, remote.device, b.src_stride or b.length, b.count)
                        for b in blocks
                    ],
                    np.uint64,
                )
                dst = np.array(
                    [
                        (local.address + b.dst, b.length, local.device, b.dst_stride or b.length, b.count)
                        for b in blocks
                    ],
                    np.uint64,
                )
                lp = nixl.prep_xfer_dlist("NIXL_INIT_AGENT", dst, _MEM[local.kind], backends=["UCX"])
                rp = nixl.prep_xfer_dlist(peer, src, _MEM[remote.kind], backends=["UCX"])
                # a strided row expands to ``count`` entries of the prepared list: the request names them all
                n = sum(b.count for b in blocks)
                idx = np.arange(n, dtype=np.int32)
                return nixl.make_prepped_xfer("READ", lp, idx, rp, idx, backends=["UCX"]), [lp, rp], n
            lo = nixl.get_xfer_descs(_runs(blocks, "dst", local), _MEM[local.kind])
            ro = nixl.get_xfer_descs(_runs(blocks, "src", remote), _MEM[remote.kind])
            return nixl.initialize_xfer("READ", lo, ro, peer, backends=["UCX"]), [], sum(b.count for b in blocks)
        except FillError:
            raise
        except Exception as exc:
            raise FillError(
                f"NIXL could not prepare a READ from {peer}: {type(exc).__name__}: {exc}",
                details={"reason": "transfer", "peer": peer},
            ) from exc

    def close(self) -> None:
        """Disconnect every peer and destroy the agent now: its UCX worker's threads, sockets and pipes go with it.
        Before, only the peers were removed and the agent lived as long as anything referred to this object — for
        a failed fill, its FillError's traceback (the fill's frames, held in a cycle with the event loop's task)
        until the next full garbage collection: ~10 descriptors, a thread and 0.4 MB per failed fill. Idempotent;
        after it, ``deregister`` and ``remove_peer`` do nothing and everything else is a FillError."""
        if self._agent is None:
            return
        for peer in list(self._peers):
            self.remove_peer(peer)
        self._peers.clear()
        self._agent = None  # the last reference wcache holds (a Transfer holds this object, not NIXL's)


def admit(peer: str, copies: Sequence[Copy], deadline: float, on_post: Callable[[int], None] | None) -> int:
    """The bytes of a READ about to be posted (``Agent.start_read``, or its agent process's): a deadline already
    passed is ``late``; else ``on_post`` is told the bytes."""
    nbytes = sum(c.nbytes for c in copies)
    if time.monotonic() > deadline:
        raise late(peer, nbytes)
    if on_post is not None:
        on_post(nbytes)
    return nbytes


def late(peer: str, nbytes: int) -> FillError:
    """A READ past its deadline (reason ``deadline``), in-process or in a fill's agent process."""
    return FillError(
        f"READ of {nbytes} bytes from {peer} passed its deadline", details={"reason": "deadline", "peer": peer}
    )


class Transfer:
    """One posted READ request (:meth:`Agent.start_read`)."""

    def __init__(
        self, agent: Agent, peer: str, handle: Any, prepped: list[Any], nbytes: int, n: int, deadline: float, t0: float
    ) -> None:
        self._agent, self.peer, self._handle, self._prepped = agent, peer, handle, prepped
        self.nbytes, self.descriptors, self.deadline, self._t0 = nbytes, n, deadline, t0
        self._state = ""
        self._seconds = 0.0

    def post(self) -> None:
        self._state = self._agent._nixl.transfer(self._handle)
        self._check()

    def done(self) -> bool:
        """True once every byte landed; FillError when NIXL reports a failure or the deadline passed."""
        if self._state == "PROC":
            if time.monotonic() > self.deadline:
                raise late(self.peer, self.nbytes)
            self._state = self._agent._nixl.check_xfer_state(self._handle)
            self._check()
        return self._state == "DONE"

    def _check(self) -> None:
        if self._state == "DONE" and not self._seconds:
            self._seconds = time.perf_counter() - self._t0
        elif self._state not in ("DONE", "PROC"):
            raise FillError(
                f"NIXL READ from {self.peer} failed ({self._state})", details={"reason": "transfer", "peer": self.peer}
            )

    def stats(self) -> ReadStats:
        return ReadStats(self.nbytes, self.descriptors, self._seconds)

    def wait(self) -> ReadStats:
        """Block until done (sleeping between polls, for callers without an event loop), then release."""
        pause = 1e-5
        try:
            while not self.done():
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        finally:
            self.release()
        return self.stats()

    def release(self) -> None:
        """Free the request (an unfinished one is cancelled where UCX can; NIXL keeps what it cannot)."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        prepped, self._prepped = self._prepped, []  # each holds the NIXL agent: none kept once released
        try:
            handle.release()  # NIXL's release_xfer_handle: the handle's own, so it works after the agent's close
        except Exception as exc:
            log.warning("NIXL could not release a transfer from %s: %s", self.peer, exc)
        for p in prepped:
            p.release()


def _inside(start: int, stride: int, c: Copy, region: MemoryRegion, side: str) -> None:
    """Every run of ``c`` lies inside ``region`` (a plan that says otherwise is a bug: refused before NIXL)."""
    last = start + (c.count - 1) * stride + c.length
    if c.length <= 0 or c.count <= 0 or start < 0 or last > region.length:
        raise ValueError(f"{side} side of {c} is outside its region {region}")


def _runs(blocks: Sequence[Copy], side: str, region: MemoryRegion) -> Any:
    """Every run of ``blocks`` on one side (``src`` or ``dst``) as an Nx3 (address, length, device) array:
    NIXL builds its descriptor list from it without a Python object per run."""
    import numpy as np

    device = region.device
    parts = []
    for b in blocks:
        start, stride = (b.src, b.src_stride) if side == "src" else (b.dst, b.dst_stride)
        start += region.address
        rows = np.empty((b.count, 3), dtype=np.uint64)
        rows[:, 0] = start + np.arange(b.count, dtype=np.uint64) * np.uint64(stride)
        rows[:, 1] = b.length
        rows[:, 2] = device
        parts.append(rows)
    return np.concatenate(parts)
