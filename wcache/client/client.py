"""``WCacheClient``: connect, HELLO, GET_STATE, map, build views — typically a few ms.

One connection per fetch. In zero_copy mode the connection *is* the lease's lifeline:
it stays open until ``release()``; if the engine dies the kernel closes it and the
daemon ends the lease. In copy mode the client copies the slab into its own memory and
releases at once.

Errors: ``CacheUnavailableError`` (no socket, refused, timeout, daemon died or closed, a slab this process
cannot map — out of address space, the CUDA driver refusing it; a socket
missing or refused while a daemon is evidently coming back — its lock held, or a keeper holding a
model for its rank — is first waited on for up to ``wait_for_daemon`` seconds, wcache/client/wait.py),
the daemon's errors as their ``ServerError`` subclasses (``KeyMismatchError`` ...),
``RemoteProtocolError`` for bytes that break docs/protocol.md. A fetch cancelled at any point
closes its connection, so the daemon frees its lease, and the client stays usable.

A fetch speaks through an engine's own connection (``wcache.proto.engine``: its frames without the declarations,
msgpack or the error tree imported, ~3 ms of an engine's restart: docs/performance.md); STATUS, PRELOAD, EVICT
and DEPOSIT through the reference ``Connection``, whose modules they import when first called.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from wcache import __version__
from wcache.channel import (
    EXHAUSTED,
    Channel,
    close_fds,
    connect,
    connect_engine,
    connect_engine_blocking,
    expect,
    expect_engine,
    expect_engine_blocking,
    out_of_resources,
    time_left,
)
from wcache.proto.codec import gc_paused
from wcache.proto.engine import CLOSED, EngineConnection, HelloOk, Released, State, get_state, release

if TYPE_CHECKING:  # imported where used (tests/client/test_imports.py): the mapping by a fetch while the daemon
    # answers (_ahead), the errors where raised, the others by the methods that need them
    from wcache.channel import Meanwhile
    from wcache.client.mapping import GroupView, TensorViews
    from wcache.plan.key import RankSpec, WeightCacheKey
    from wcache.plan.recipe import RecipeKey
    from wcache.proto import (
        Connection,
        Deposited,
        Evicted,
        Preloaded,
        StatusReply,
        daemon_frames,
    )

__all__ = ["CachedWeights", "WCacheClient"]

if TYPE_CHECKING:
    T = TypeVar("T")
MODES = ("zero_copy", "copy")


class CachedWeights(Mapping[str, torch.Tensor]):
    """A read-only name -> tensor mapping backed by a daemon lease (aliases included).

    Tensors are cut from their group's stacked view on first look-up (``groups()`` gives the
    stacked views themselves, ``materialize()`` builds every name at once).

    ``await weights.release()`` (or ``async with``) ends the lease. In zero_copy mode the
    tensors are views of the daemon's memory, read-only and shared with every engine: a write
    into one is not a Python error but a crash — SIGSEGV on the host backend, an illegal
    memory access on CUDA (with ``--cuda-export ipc`` the mapping is writable and a write
    corrupts what every engine sees); ``wcache.nn.guard_writes`` turns such writes into an
    error while debugging. On CUDA do not use them after release(). Copy-mode tensors are the
    engine's own and writable: fetch with ``mode="copy"`` to modify weights.
    """

    def __init__(
        self,
        tensors: TensorViews,
        *,
        key: WeightCacheKey,
        lease: int,
        mode: str,
        aliases: dict[str, str],
        channel: Channel[EngineConnection] | None,
        hello: HelloOk,
        socket_path: Path,
        keepalive: list[Any],
        buffers: tuple[str, ...] = (),
    ) -> None:
        self._tensors = tensors
        #: names deposited as module buffers (docs/protocol.md §4.13); every other name is a parameter
        self.buffers = frozenset(buffers)
        self.key = key
        self.lease = lease
        self.mode = mode
        self.aliases = dict(aliases)
        self._hello = hello
        self.socket_path = socket_path
        self._channel = channel
        self._keepalive = keepalive
        #: the daemon completed the key from the checkpoint files' proof (docs/protocol.md §4.3.1): this process
        #: did not scan the headers
        self.key_proven = False
        #: where the fetch spent its time, in ms: connect (socket: connected and the peer checked; hello: HELLO
        #: and the pipelined GET_STATE out, HELLO_OK back), prepare (CUDA: the GPU checked, its context current,
        #: the driver's entry points, overlapping the daemon's answer; cuda.prepare's parts too), state (the rest
        #: of the wait for STATE and its decode), wait (of connect and state, the time its reads waited for the
        #: daemon's bytes; with other tasks on the event loop, until this one resumed), decode (of connect and
        #: state, the time spent decoding the frames received: HELLO_OK and the STATE), map (slab mappings; CUDA:
        #: import_handle and reserve_map_access, the driver's calls, and as_tensor), views (the name -> view
        #: mapping set up; per-name views are cut from their group's stacked view on first look-up), copy (copy
        #: mode only)
        self.timings: dict[str, float] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def groups(self) -> list[GroupView]:
        """Every STATE group as one stacked view ``(names, tensor)``, ``tensor[j]`` being ``self[names[j]]``:
        MoE experts and layer stacks in the shape fused kernels take, without a tensor object per name."""
        return self._tensors.groups()

    def materialize(self) -> CachedWeights:
        """Build every per-name tensor now (look-ups otherwise build them one group at a time)."""
        self._tensors.materialize()
        return self

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<CachedWeights {self.key.short()} tensors={len(self)} mode={self.mode} lease={self.lease} {state}>"

    @property
    def server(self) -> daemon_frames.HelloOk:
        """The daemon's HELLO_OK (docs/protocol.md §4.2): version, software, backend, device, max_frame_size and
        server_pid, as the frame declarations make it (``wcache.proto.HelloOk``; they are imported on first read)."""
        from wcache.proto.engine import as_reference

        return cast("daemon_frames.HelloOk", as_reference(self._hello))

    @property
    def released(self) -> bool:
        return self._channel is None or self._channel.closed

    async def release(self, timeout: float | None = 5.0) -> None:
        """End the lease (RELEASE, await RELEASED) and close the connection. Idempotent.

        If the daemon is gone the lease is gone with it; that is not an error. ``timeout``: seconds,
        ``math.inf`` or None for no limit (ValueError for NaN).
        """
        timeout = _checked_timeout(timeout)
        ch = self._take_channel()
        if ch is None:
            return
        try:
            async with asyncio.timeout(timeout):
                await ch.send_bytes(ch.conn.send(release(ch.conn.next_request_id(), self.lease)))
                _, fds = await expect_engine(ch)  # RELEASED; an ERROR raises as its class
                close_fds(fds)
        except (EOFError, ConnectionError, TimeoutError):
            pass
        finally:
            ch.close()

    def _take_channel(self) -> Channel[EngineConnection] | None:
        """The lease's connection, taken (a second release finds none), if a RELEASE is still to be sent on it:
        None once it closed, or once the daemon ended it with a fatal ERROR (``_ended``: closed here too)."""
        ch, self._channel = self._channel, None
        if ch is None or ch.closed:
            return None
        if _ended(ch):
            ch.close()
            return None
        return ch

    def release_sync(self, timeout: float | None = 5.0) -> None:
        """Blocking release() for code without an event loop; as release(), it returns within ``timeout`` (one
        deadline for sending RELEASE and reading RELEASED), leaving the lease to the connection's close."""
        timeout = _checked_timeout(timeout)
        ch = self._take_channel()
        if ch is None:
            return
        deadline = time.monotonic() + timeout
        try:
            ch.send_bytes_blocking(ch.conn.send(release(ch.conn.next_request_id(), self.lease)), timeout)
            _, fds = expect_engine_blocking(ch, time_left(deadline))  # RELEASED; an ERROR raises as its class
            close_fds(fds)
        except (OSError, EOFError):  # TimeoutError among them
            pass
        finally:
            ch.close()

    async def __aenter__(self) -> CachedWeights:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.release()

    def __del__(self) -> None:
        ch = getattr(self, "_channel", None)
        if ch is not None:
            ch.close()  # the daemon sees EOF and ends the lease


class WCacheClient:
    """Fetches weights from wcache daemons.

    ``socket_path`` names one daemon; ``socket_dir`` (default: the private default
    directory) picks ``wcache-rank<N>.sock`` by the key's tp_rank, so one client can
    ``asyncio.gather`` several ranks, each from its own daemon.

    ``wait_for_daemon``: when the socket is missing or refuses but a daemon is evidently coming back
    (its ``<socket>.lock`` is held, or the keeper — ``keeper_socket``, default ``wcache-keeper.sock``
    beside the socket — holds a model for the rank), retry for up to this many seconds (within the
    request's ``timeout``) instead of raising CacheUnavailableError at once; 0 disables the wait.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        socket_dir: str | os.PathLike[str] | None = None,
        timeout: float = 30.0,
        name: str = "",
        device: torch.device | str | None = None,
        wait_for_daemon: float = 5.0,
        keeper_socket: str | os.PathLike[str] | None = None,
    ) -> None:
        if socket_path is not None and socket_dir is not None:
            raise ValueError("give socket_path or socket_dir, not both")
        self.socket_path = Path(socket_path) if socket_path is not None else None
        self.socket_dir = Path(socket_dir) if socket_dir is not None else None
        self.timeout = _checked_timeout(timeout)
        self.name = name or f"pid{os.getpid()}"
        self.device = torch.device(device) if device is not None else None
        if not wait_for_daemon >= 0:
            raise ValueError(f"wait_for_daemon must be >= 0 seconds (0: do not wait), got {wait_for_daemon!r}")
        self.wait_for_daemon = float(wait_for_daemon)
        self.keeper_socket = Path(keeper_socket) if keeper_socket is not None else None

    def socket_for(self, key: WeightCacheKey | None = None) -> Path:
        return self._socket(key.tp_rank if key else 0)

    def _socket(self, rank: int) -> Path:
        """``socket_path``, else rank ``rank``'s socket in ``socket_dir`` (default: the private default directory)."""
        if self.socket_path is not None:
            return self.socket_path
        from wcache.paths import default_socket_dir, socket_name

        return (self.socket_dir or default_socket_dir()) / socket_name(rank)

    # ------------------------------------------------------------------ connection
    async def _connect(
        self, path: Path, attempt: Callable[[], Awaitable[T]], session: _Session | None = None, rank: int | None = None
    ) -> T:
        """``attempt()`` (a connect and its handshake); a socket missing or refused while a daemon is coming back is
        waited on (``wait_for_daemon``; ``rank``: the tp_rank whose kept models count, None for any)."""
        try:
            return await attempt()
        except Exception as exc:
            if self.wait_for_daemon <= 0 or not _absent(exc):
                raise
            from wcache.client import wait  # the failure path only: nothing more to import for a fetch
            from wcache.paths import KEEPER_SOCKET

            return await wait.wait_for_daemon(
                attempt,
                path,
                exc,  # type: ignore[arg-type]  # a CacheUnavailableError (_absent)
                wait=self.wait_for_daemon,
                keeper_path=self.keeper_socket or path.parent / KEEPER_SOCKET,
                rank=rank,
                on_wait=session.waiting_for if session is not None else None,
            )

    async def _admin(self, path: Path, session: _Session, rank: int | None) -> Channel[Connection]:
        """A reference connection for STATUS, PRELOAD, EVICT or DEPOSIT (``session.ch``, whose handshake it is)."""

        async def attempt() -> tuple[Channel[Connection], daemon_frames.HelloOk]:
            return await connect(path, software=f"wcache/{__version__}", name=self.name)

        ch, _ = await self._connect(path, attempt, session, rank)
        session.ch = ch
        return ch

    def _check_device(self, hello: HelloOk) -> None:
        """The GET_STATE went out behind HELLO, before the daemon's GPU was known, so the engine checks what
        the daemon would have: its chosen device is the daemon's GPU, which this process can see (DEVICE_MISMATCH
        otherwise; the connection then closes, and the lease with it)."""
        from wcache.client import cuda

        mine = cuda.local_uuid(self.device, hello.device.uuid)
        if mine != hello.device.uuid:
            from wcache.errors import DeviceMismatchError

            raise DeviceMismatchError(
                f"engine is on GPU {mine}, the daemon serves GPU {hello.device.uuid}",
                details={"client": mine, "daemon": hello.device.uuid},
            )

    def _on_hello(self, hello: HelloOk, timings: dict[str, float]) -> None:
        """Between HELLO_OK and the STATE, while the daemon answers the pipelined GET_STATE: a CUDA daemon's GPU
        checked (``_check_device``) and the first mapping's preparation done (``cuda.prepare``: context,
        granularity, driver entry points), so that it overlaps the daemon's work (``prepare`` ms, of it
        ``prepare_check`` the GPU's check)."""
        if hello.backend != "cuda":
            return
        t0 = time.perf_counter()
        from wcache.client import cuda

        self._check_device(hello)
        timings["prepare_check"] = (time.perf_counter() - t0) * 1e3
        cuda.prepare(hello.device.uuid, timings)
        timings["prepare"] = (time.perf_counter() - t0) * 1e3

    def _rank(self, key: WeightCacheKey | None) -> int | None:
        """The rank whose kept models mean its daemon is coming back: the key's, else rank 0's socket."""
        if key is not None:
            return key.tp_rank
        return None if self.socket_path is not None else 0

    async def fetch(
        self, key: WeightCacheKey, mode: str = "zero_copy", *, timeout: float | None = None
    ) -> CachedWeights:
        """Lease and map the weights for ``key``. See the module docstring for errors.

        ``mode="zero_copy"``: read-only views of the daemon's memory (a write crashes the engine,
        see CachedWeights); ``mode="copy"``: the engine's own, writable copy. ``timeout``: seconds for the whole
        call (None: the client's), ``math.inf`` for no limit, as for every call of the client; NaN is ValueError.
        """
        return await self._fetch(key, mode, timeout)

    async def _fetch(
        self, key: WeightCacheKey, mode: str, timeout: float | None, deadline: float | None = None
    ) -> CachedWeights:
        """``fetch()``; ``deadline`` (``time.monotonic``): when the request's ``timeout`` runs out, for a request that
        began before this call (``fetch_sync``'s, handing a daemon that is coming back to this fetch's wait)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        path = self.socket_for(key)
        async with self._session(path, timeout, keep_open=True, deadline=deadline) as session:
            t0 = time.perf_counter()
            timings: dict[str, float] = {}
            request = _Request(key, mode)

            async def attempt() -> tuple[Channel[EngineConnection], HelloOk]:
                return await connect_engine(
                    path,
                    software=f"wcache/{__version__}",
                    name=self.name,
                    pipeline=request.build,
                    meanwhile=_ahead(timings),
                    timings=timings,
                )

            ch, hello = await self._connect(path, attempt, session, key.tp_rank)
            session.ch = ch
            t1 = time.perf_counter()
            self._on_hello(hello, timings)
            t_state = time.perf_counter()
            try:
                frame, fds = await expect_engine(ch)
            except Exception as exc:
                if not request.refused(exc):
                    raise
                # the daemon does not know these files: the full key, on the same connection
                await ch.send_bytes(ch.conn.send(request.scanned(ch.conn)))
                frame, fds = await expect_engine(ch)
            state = request.state(frame, fds)
            _handshake_timings(timings, ch, t0, t1, t_state)
            weights = self._materialise(ch, hello, state, fds, key, mode, path, timings)
            weights.key_proven = request.proven
            if mode == "copy":
                await weights.release()  # the engine owns its copy: no lease needed
            return weights

    @contextlib.asynccontextmanager
    async def _session(
        self, path: Path, timeout: float | None, *, keep_open: bool, deadline: float | None = None
    ) -> AsyncIterator[_Session]:
        """One connection's request under a deadline — ``timeout`` from now, or ``deadline`` (``time.monotonic``)
        where the request began earlier: timeouts, EOF and resets become CacheUnavailableError; the connection is
        closed on any failure (and on success unless ``keep_open``: a zero_copy lease lives as long as its
        connection)."""
        from wcache.errors import CacheUnavailableError  # what every failure below becomes

        limit = _checked_timeout(self.timeout if timeout is None else timeout)
        session = _Session()
        try:
            async with asyncio.timeout(limit if deadline is None else deadline - time.monotonic()):
                yield session
        except TimeoutError as exc:
            session.close()
            if session.waited is not None and session.ch is None:
                raise CacheUnavailableError(
                    f"no wcache daemon at {path}: waited for it to come back ({session.waited}) until the "
                    f"request's timeout of {limit} s ran out. Start it (or check its log), or pass a longer timeout",
                    details={"socket": str(path), "reason": session.waited, "timeout_s": limit},
                ) from exc
            raise CacheUnavailableError(f"wcache daemon at {path} did not answer within {limit} s") from exc
        except (EOFError, ConnectionError) as exc:
            session.close()
            raise CacheUnavailableError(f"wcache daemon at {path} closed the connection: {exc}") from exc
        except OSError as exc:
            session.close()
            if exc.errno not in EXHAUSTED:
                raise
            raise _exhausted(path, exc) from exc
        except BaseException:
            session.close()
            raise
        if not keep_open:
            session.close()

    def _materialise(
        self,
        ch: Channel[EngineConnection],
        hello: HelloOk,
        state: State,
        fds: list[int],
        key: WeightCacheKey,
        mode: str,
        path: Path,
        timings: dict[str, float],
    ) -> CachedWeights:
        """The STATE's slabs mapped and its views built; ``timings`` (the fetch's, so far) gets ``map``, ``views``
        (and ``copy``) and becomes the weights' ``timings``."""
        from wcache.client.mapping import build_views, map_slabs

        with gc_paused(keep=True):  # slabs and views: tensor objects, none in a cycle, kept (see ``_ahead``)
            t0 = time.perf_counter()
            slabs = map_slabs(state, fds, self.device, timings)
            bases = [s.base for s in slabs]
            try:
                timings["map"] = (time.perf_counter() - t0) * 1e3
                keepalive: list[Any] = list(slabs)
                if mode == "copy":
                    t1 = time.perf_counter()
                    bases = _copies(bases)
                    if any(b.is_cuda for b in bases):
                        torch.cuda.synchronize()  # the copies must land before the mappings go away
                    for s in slabs:
                        s.close()
                    keepalive = []
                    timings["copy"] = (time.perf_counter() - t1) * 1e3
                t2 = time.perf_counter()
                tensors = build_views(state, bases)
                timings["views"] = (time.perf_counter() - t2) * 1e3
                weights = CachedWeights(
                    tensors,
                    key=key,
                    lease=state.lease,
                    mode=mode,
                    aliases=state.aliases,
                    channel=ch,
                    hello=hello,
                    socket_path=path,
                    keepalive=keepalive,
                    buffers=state.buffers,
                )
                weights.timings = timings
                return weights
            except BaseException:  # nothing mapped outlives a fetch that failed: the tensors go, then the mappings
                bases.clear()
                for s in slabs:
                    s.close()
                raise

    async def status(self, key: WeightCacheKey | None = None, *, timeout: float | None = None) -> StatusReply:
        """The daemon's STATUS_REPLY: models, leases, connections, uptime."""
        from wcache.proto.admin_frames import Status, StatusReply

        path = self.socket_for(key)
        async with self._session(path, timeout, keep_open=False) as session:
            ch = await self._admin(path, session, self._rank(key))
            await ch.send(Status(id=ch.conn.next_request_id()))
            frame, _ = await expect(ch)
            assert isinstance(frame, StatusReply)
            return frame

    async def preload(self, spec: RankSpec, *, timeout: float | None = 600.0) -> Preloaded:
        """Ask the daemon to load the rank ``spec`` names (its checkpoint a path on the daemon's machine) and keep
        it resident; the fingerprint kind is the daemon's (``--verify-content``), not ``spec.verify_content``.

        Raises OutOfMemoryError (details name what leases pin) when it does not fit the budget, CheckpointError /
        ShardingError / TransformError for a directory, plan or transform the daemon cannot use.
        """
        from wcache.proto.admin_frames import Preloaded

        path = self._socket(spec.tp_rank)
        async with self._session(path, timeout, keep_open=False) as session:
            ch = await self._admin(path, session, spec.tp_rank)
            await ch.send(spec.to_preload(ch.conn.next_request_id()))
            frame, _ = await expect(ch)
            assert isinstance(frame, Preloaded)
            return frame

    async def evict(self, key: WeightCacheKey, *, timeout: float | None = None) -> Evicted:
        """Drop the model served under ``key``; InUseError while leases hold it, NotFoundError if absent."""
        from wcache.proto.admin_frames import Evict, Evicted

        path = self.socket_for(key)
        async with self._session(path, timeout, keep_open=False) as session:
            ch = await self._admin(path, session, key.tp_rank)
            await ch.send(Evict(id=ch.conn.next_request_id(), key=key.to_wire()))
            frame, _ = await expect(ch)
            assert isinstance(frame, Evicted)
            return frame

    async def deposit(
        self,
        key: RecipeKey,
        tensors: Mapping[str, torch.Tensor],
        *,
        kinds: Mapping[str, str] | None = None,
        aliases: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Deposited:
        """Write-back (docs/protocol.md §4.13): hand the daemon this engine's final tensors to serve under
        the recipe ``key`` (``RecipeKey.of(checkpoint_key, engine=..., ...)``); a later ``fetch(key)`` maps
        them zero-copy. The daemon lays out a writable slab (a memfd on a host daemon, a VMM allocation on
        its GPU on a CUDA daemon); each tensor is copied into it (from any device), the mapping is dropped,
        and COMMIT makes the daemon seal and publish it.

        ``kinds``: name -> "parameter" | "buffer" (default parameter). ``aliases``: alias -> name for tied
        tensors; a name mapping to the very tensor object of an earlier name becomes an alias of it too.
        Raises ValueError for a tensor the protocol cannot carry (before anything is sent), InUseError (the
        key is leased, or being deposited by another engine), OutOfMemoryError, UnsupportedPlatformError
        (the daemon's backend takes no deposits), LocalProtocolError (the DEPOSIT is over the request size the
        daemon announced, 1 MiB: about 11,000 tensors with MoE-style names, 22,000 with short ones; nothing sent),
        CacheUnavailableError. Any failure leaves nothing behind
        on the daemon: the connection closes and the daemon frees the slab."""
        from wcache.proto.deposit_frames import Commit, Deposit, Deposited, DepositSlab, DepositTensor
        from wcache.proto.table import DTYPE_SIZES

        kinds = dict(kinds or {})
        links = dict(aliases or {})
        entries: list[DepositTensor] = []
        by_id: dict[int, str] = {}
        payload: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
            first = by_id.get(id(t))
            if first is not None and name not in links:
                links[name] = first
                continue
            if name in links:
                continue
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in DTYPE_SIZES:
                raise ValueError(
                    f"{name!r} has dtype {dtype}; a deposit carries {', '.join(sorted(DTYPE_SIZES))} "
                    "(leave the tensor out, or convert it)"
                )
            kind = kinds.get(name, "parameter")
            if kind not in ("parameter", "buffer"):
                raise ValueError(f"kind of {name!r} must be 'parameter' or 'buffer', got {kind!r}")
            by_id[id(t)] = name
            payload[name] = t
            entries.append(DepositTensor(name, dtype, tuple(t.shape), kind))
        for a, target in links.items():
            if a in payload or target not in payload:
                raise ValueError(f"alias {a!r} -> {target!r} must name a deposited tensor under a new name")
        path = self.socket_for(key)
        async with self._session(path, timeout, keep_open=False) as session:
            ch = await self._admin(path, session, key.tp_rank)
            await ch.send(
                Deposit(id=ch.conn.next_request_id(), key=key.to_wire(), tensors=tuple(entries), aliases=links)
            )
            frame, fds = await expect(ch)
            if not isinstance(frame, DepositSlab) or len(fds) != 1:
                close_fds(fds)
                from wcache.errors import RemoteProtocolError

                raise RemoteProtocolError(f"expected DEPOSIT_SLAB with one descriptor, got {frame.TYPE}")
            from wcache.client.mapping import write_deposit

            try:
                await asyncio.to_thread(write_deposit, frame, fds[0], payload)
            finally:
                close_fds(fds)
            await ch.send(Commit(id=ch.conn.next_request_id(), deposit=frame.deposit))
            done, _ = await expect(ch)
            assert isinstance(done, Deposited)
            return done

    def fetch_sync(
        self, key: WeightCacheKey, mode: str = "zero_copy", *, timeout: float | None = None
    ) -> CachedWeights:
        """Blocking fetch() for engines without an event loop (not from inside a running loop).

        The same requests through the same sans-I/O connection on a blocking socket: no event loop is
        started (a restart's first fetch, docs/performance.md). A daemon that is coming back (``wait_for_daemon``)
        is waited for as by fetch(). As fetch()'s, the whole call is bounded by ``timeout``: one deadline through
        the connect, the handshake and every read, however the daemon's bytes trickle in."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("fetch_sync() called from a running event loop; use 'await client.fetch(...)'")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        path = self.socket_for(key)
        limit = _checked_timeout(self.timeout if timeout is None else timeout)
        deadline = time.monotonic() + limit
        ch: Channel[EngineConnection] | None = None
        try:
            t0 = time.perf_counter()
            timings: dict[str, float] = {}
            request = _Request(key, mode)
            try:
                ch, hello = connect_engine_blocking(
                    path,
                    software=f"wcache/{__version__}",
                    name=self.name,
                    timeout=time_left(deadline),
                    pipeline=request.build,
                    meanwhile=_ahead(timings),
                    timings=timings,
                )
            except Exception as exc:
                if self.wait_for_daemon <= 0 or not _absent(exc):
                    raise
                # wait.py's wait is asyncio's, within what is left of this call's timeout
                return asyncio.run(self._fetch(key, mode, timeout, deadline))
            t1 = time.perf_counter()
            self._on_hello(hello, timings)
            t_state = time.perf_counter()
            try:
                frame, fds = expect_engine_blocking(ch, time_left(deadline))
            except Exception as exc:
                if not request.refused(exc):
                    raise
                # the full key, same connection
                ch.send_bytes_blocking(ch.conn.send(request.scanned(ch.conn)), time_left(deadline))
                frame, fds = expect_engine_blocking(ch, time_left(deadline))
            state = request.state(frame, fds)
            _handshake_timings(timings, ch, t0, t1, t_state)
            weights = self._materialise(ch, hello, state, fds, key, mode, path, timings)
            weights.key_proven = request.proven
        except TimeoutError as exc:
            if ch is not None:
                ch.close()
            from wcache.errors import CacheUnavailableError

            raise CacheUnavailableError(f"wcache daemon at {path} did not answer within {limit} s") from exc
        except (EOFError, ConnectionError) as exc:
            if ch is not None:
                ch.close()
            from wcache.errors import CacheUnavailableError

            raise CacheUnavailableError(f"wcache daemon at {path} closed the connection: {exc}") from exc
        except OSError as exc:
            if ch is not None:
                ch.close()
            if exc.errno not in EXHAUSTED:
                raise
            raise _exhausted(path, exc) from exc
        except BaseException:
            if ch is not None:
                ch.close()
            raise
        if mode == "copy":
            weights.release_sync(max(deadline - time.monotonic(), 0.001))  # the engine owns its copy: no lease needed
        return weights


class _Request:
    """One fetch's GET_STATE: pipelined behind HELLO (docs/protocol.md §5.1), so ``device_uuid`` is left empty —
    the daemon's GPU is not known yet — and the client checks it on HELLO_OK (``_check_device``). A deferred key
    sends its files' proof instead of the file-derived fields (§4.3.1); if the daemon does not recognise the files
    (KEY_MISMATCH, or NOT_FOUND from a daemon holding nothing), :meth:`scanned` is the GET_STATE of the full key,
    after the header scan, on the same connection."""

    def __init__(self, key: WeightCacheKey, mode: str) -> None:
        self.key, self.mode = key, mode
        self._proof = key.proof()
        #: the GET_STATE in flight carries a proof (the daemon completes the key)
        self.proven = self._proof is not None

    def build(self, conn: EngineConnection) -> dict[str, Any]:
        rid = conn.next_request_id()
        if self._proof is not None:
            partial, files, dtype = self._proof
            return get_state(rid, partial, self.mode, proof=(files, dtype))
        return get_state(rid, self.key.to_wire(), self.mode)

    def refused(self, exc: Exception) -> bool:
        """Whether ``exc``, raised for the GET_STATE, refused its proof itself — KEY_UNPROVEN, or from a daemon older
        than proofs KEY_MISMATCH / NOT_FOUND without ``details.key`` — so that the caller sends :meth:`scanned`;
        False for any other error, to raise. A daemon that completed the key from the proof names it
        (``details.key``): the refusal is that key's, final, and the key takes its fields without a scan."""
        from wcache.errors import KeyMismatchError, KeyUnprovenError, NotFoundError  # raised: loaded already

        if not self.proven or not isinstance(exc, (KeyUnprovenError, KeyMismatchError, NotFoundError)):
            return False
        completed = exc.details.get("key")
        if isinstance(completed, dict) and not isinstance(exc, KeyUnprovenError):
            self.key.adopt(completed)
            return False
        return True

    def scanned(self, conn: EngineConnection) -> dict[str, Any]:
        """The retry after a refused proof: the header scan runs here (raising what it raises)."""
        self._proof, self.proven = None, False
        return self.build(conn)

    def state(self, frame: HelloOk | State | Released, fds: list[int]) -> State:
        """``frame`` as the STATE answering this request. Its ``key`` is the served key (docs/protocol.md §4.4), and a
        daemon serves only the model of the key asked for: a proven key takes its file-derived fields from it, a full
        key must equal it (``WeightCacheKey.adopt``: RemoteProtocolError otherwise, the descriptors closed) — the
        weights of another model, fingerprint, dtype or rank are never handed to the engine as the ones it asked
        for."""
        if not isinstance(frame, State):
            close_fds(fds)
            from wcache.errors import RemoteProtocolError

            raise RemoteProtocolError(f"expected STATE, got {type(frame).__name__}")
        try:
            self.key.adopt(frame.key)
        except BaseException:
            close_fds(fds)
            raise
        return frame


def _absent(exc: BaseException) -> bool:
    """A connect that found no socket file, or a socket nobody listens on (a daemon may be coming back). Any other
    failure is told without importing anything: a process out of descriptors (a socket it could not open) cannot
    import the waiting's module, and its fetch must still be the CacheUnavailableError that it raised."""
    if not isinstance(exc.__cause__, (FileNotFoundError, ConnectionRefusedError)):  # wait.is_absent's causes
        return False
    from wcache.client import wait
    from wcache.errors import CacheUnavailableError

    return isinstance(exc, CacheUnavailableError) and wait.is_absent(exc)


def _exhausted(path: Path, exc: OSError) -> Exception:
    """A fetch that ran out of descriptors or memory after its socket was open — a module it imports (the mapping's
    in its window, the declarations for an ERROR), a descriptor it receives — as CacheUnavailableError: the cache
    is then as unusable to this process as a socket it cannot open (``channel._dialling_socket``), and an engine's
    fallback catches WCacheError only. Called with the fetch's connection closed, so the error tree's import, where
    the engine has not loaded it, has a descriptor to read it with."""
    return out_of_resources(f"this process ran out of resources fetching from the wcache daemon at {path}", path, exc)


def _ahead(timings: dict[str, float] | None) -> Meanwhile:
    """What a fetch does while the daemon answers its HELLO and GET_STATE (``channel.Meanwhile``): the first-time work
    of mapping a STATE that needs neither the STATE nor the daemon's GPU, instead of at ``import wcache`` or after
    the STATE is in: the views' module loaded, and where CUDA is up in this process (a CUDA daemon is then likely)
    the CUDA mapping's modules loaded and the driver's entry points looked up (``cuda.look_up``). Not torch's parsers
    for the views' ops: built here on a tensor of nothing they made the window longer and the views no shorter
    (docs/performance.md, "Measured on an H100, 2026-12-07, run 2"). ``timings`` gets ``ahead`` (ms; within
    ``hello``)."""

    def ahead() -> None:
        t0 = time.perf_counter()
        # as wcache's own import (wcache/__init__.py): no collection sweeps torch's heap meanwhile, the modules kept
        with gc_paused(keep=True):
            from wcache.client import mapping  # noqa: F401  (imported for its first-time cost, here)

            if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
                from wcache.client import cuda

                cuda.look_up()
        if timings is not None:
            timings["ahead"] = (time.perf_counter() - t0) * 1e3

    return ahead


def _checked_timeout(timeout: float | None) -> float:
    """A request's ``timeout`` in seconds, as every call takes it, blocking or not: ``math.inf`` (or any value
    past what a clock holds; None, as ``asyncio.timeout`` takes it) for no limit, 0 or less for one that has run
    out at once. NaN is no timeout — the asynchronous calls' ``asyncio.timeout`` ran out at once and a blocking
    socket refused it —: ValueError."""
    if timeout is None:
        return math.inf
    if math.isnan(timeout):
        raise ValueError(f"timeout must be a number of seconds (math.inf: no limit), got {timeout!r}")
    return timeout


def _ended(ch: Channel[EngineConnection]) -> bool:
    """Whether the daemon ended the connection with a fatal ERROR (read with the STATE, or after it): its leases
    ended with it, so a RELEASE is neither needed nor allowed — release() returns, as for a daemon that is gone
    (it raised LocalProtocolError, and a copy-mode fetch failed after its copy was made)."""
    return ch.conn.phase == CLOSED


def _copies(bases: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy mode's copies of the mapped slabs; a copy that does not fit this process's memory is
    CacheUnavailableError naming the slab. torch says so with OutOfMemoryError on the GPU but, on the host, with its
    CPU allocator's plain RuntimeError ("DefaultCPUAllocator: can't allocate memory") or MemoryError, so any
    RuntimeError of the copy counts. Like a slab that cannot be mapped (wcache.client.mapping), the cache is then of
    no use to this engine, which loads from disk (``wcache.nn.load_weights`` falls back on WCacheError only). It is
    raised from a frame that holds no tensor of the slabs (``from None``: torch's error and its frames are not
    kept), so that nothing of a failed fetch keeps a mapping alive."""
    out = []
    failed: tuple[int, int, str] | None = None
    for i in range(len(bases)):
        try:
            out.append(bases[i].clone())
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            failed = (i, bases[i].numel(), f"{type(exc).__name__}: {exc}")
            break
    if failed is None:
        return out
    from wcache.errors import CacheUnavailableError

    i, size, why = failed
    raise CacheUnavailableError(
        f"copy mode: slab {i} ({size} bytes) cannot be copied into this process: {why}",
        details={"slab": i, "size": size},
    ) from None


def _handshake_timings(timings: dict[str, float], ch: Channel[Any], t0: float, t1: float, t_state: float) -> None:
    """A fetch's ``connect`` (``t0`` to ``t1``), ``state`` (``t_state`` to now), and its channel's ``wait`` and
    ``decode``, in ms (``CachedWeights.timings``)."""
    timings.update(
        connect=(t1 - t0) * 1e3,
        state=(time.perf_counter() - t_state) * 1e3,
        wait=ch.waited * 1e3,
        decode=ch.decoded * 1e3,
    )


class _Session:
    """The connection of one in-flight request (set once connected)."""

    ch: Channel[Any] | None = None
    #: what a wait for the daemon to come back is waiting on (set when one starts)
    waited: str | None = None

    def waiting_for(self, reason: str) -> None:
        self.waited = reason

    def close(self) -> None:
        if self.ch is not None:
            self.ch.close()
