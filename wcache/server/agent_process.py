"""A fill's NIXL agent in a child process (docs/fleet.md, "A fill, step by step": the fill's agent).

UCX, under NIXL, aborts the process it runs in on some failures that it meets on its own threads. The one seen
(docs/fleet.md): a source that dies while the target's agent connects to it trips an assertion in UCX's TCP
transport, and the process gets SIGABRT. In the daemon, that abort ended every model the daemon served. A
target's agent therefore runs in a child process (this module's ``main``, on the daemon's sys.path); the daemon
keeps only a socket to it. If the child dies, the fill fails with reason ``nixl``, naming the signal, and takes
the disk path like any other failed fill. The daemon and its slabs are not touched.

The child maps the slab from the same descriptor that the daemon hands an engine (``Slab.export()``: a memfd,
a VMM fd or a legacy IPC handle), read-write. It registers the mapping and posts the READs that the fill asks
for, through the same :class:`wcache.server.nixl.Agent` that a source uses in its own process. The daemon sends
requests and polls. Plans are offsets into the slab (wcache/plan/reshard.py), so they mean the same in both
processes. A source's agent stays in its daemon: it registers resident slabs for the whole of their lives.

Messages go over a stream socketpair. Each is a 4-byte big-endian length, then one msgpack map (no pickle). A
request's descriptors travel with its first byte (SCM_RIGHTS). A reply is ``{"ok": value}``, or ``{"error":
text, "type": class name, "details": {...}}``, which the daemon raises again as FillError (ValueError for a
copy outside its region, a bug of the plan, as in-process). Every call waits at most ``timeout`` seconds. A
child that does not answer in time is killed, and the fill fails (reason ``nixl``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from wcache.errors import FillError
from wcache.plan.reshard import Copy
from wcache.proto import SlabDescriptor
from wcache.server.backends.base import MemoryRegion, Slab
from wcache.server.nixl import Agent, ReadStats, Registration, Transfer, admit, late

__all__ = ["AgentProcess", "RemoteTransfer", "main"]

#: the child's command (``python -c``): the daemon's sys.path, then this module's main
_BOOT = (
    "import json, os, sys; sys.path[:] = json.loads(os.environ.pop('WCACHE_AGENT_SYS_PATH')); "
    "from wcache.server.agent_process import main; main()"
)

log = logging.getLogger("wcache.fleet")

_LEN = struct.Struct(">I")
#: the largest message either side accepts: a READ batch's copies (64 MiB of 4 KiB runs: ~16k copies, ~0.5 MB)
MAX_MESSAGE = 64 << 20
MAX_FDS = 4
#: how long a killed child is waited for before it counts as stuck in the kernel (``AgentProcess.deregister``)
KILL_WAIT_S = 10.0


# ---------------------------------------------------------------------------------------------------- framing
def send_message(sock: socket.socket, obj: Any, fds: Sequence[int] = ()) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    buf = _LEN.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [buf[:1]], list(fds))  # the descriptors ride on the first byte
        buf = buf[sent:]
    sock.sendall(buf)


def recv_message(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message and the descriptors that came with it; EOFError when the other side closed."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _LEN.size, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    try:
        if not head:
            raise EOFError("closed")
        head += _recv_exactly(sock, _LEN.size - len(head))
        (n,) = _LEN.unpack(head)
        if n > MAX_MESSAGE:
            raise EOFError(f"a message of {n} bytes (at most {MAX_MESSAGE})")
        return msgpack.unpackb(_recv_exactly(sock, n), raw=False), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts = []
    while n > 0:
        b = sock.recv(min(n, 1 << 20))
        if not b:
            raise EOFError("closed mid-message")
        parts.append(b)
        n -= len(b)
    return b"".join(parts)


# ---------------------------------------------------------------------------------------------------- daemon side
class AgentProcess:
    """The fill's agent, in a child process: the interface of :class:`wcache.server.nixl.Agent` that a fill
    uses (``register_slab``, ``deregister``, ``add_peer``, ``start_read``, ``close``, ``on_post``). The child
    starts at once and makes its NIXL agent while the fill connects to its peers; the first call waits for it.
    Not thread-safe, like the Agent: one fill uses it."""

    def __init__(self, name: str, *, threads: int = 0, timeout: float = 60.0) -> None:
        self.name = name
        self.timeout = timeout
        self.on_post: Callable[[int], None] | None = None
        self._regs: dict[MemoryRegion, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = False
        #: the child's end, once seen (it died, or was killed for not answering): every later call raises it again
        self._gone: FillError | None = None
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock: socket.socket | None = parent
        try:
            # the child imports the modules the daemon imported: its sys.path, in its order (an install, a user
            # site's editable install, a checkout on PYTHONPATH); -P: nothing from the daemon's working directory
            env = dict(os.environ, WCACHE_AGENT_SYS_PATH=json.dumps([str(p) for p in sys.path]))
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-c", _BOOT, str(child.fileno())],
                pass_fds=[child.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # NIXL's own prints; UCX's errors go to stderr, the daemon's log
                env=env,
            )
            send_message(parent, {"op": "start", "name": name, "threads": threads})
        except BaseException as exc:
            self._kill()
            raise FillError(
                f"the fill's NIXL agent process could not start: {type(exc).__name__}: {exc}",
                details={"reason": "nixl"},
            ) from exc
        finally:
            child.close()

    @property
    def closed(self) -> bool:
        return self._sock is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _call(self, request: dict[str, Any], fds: Sequence[int] = (), *, timeout: float | None = None) -> Any:
        sock = self._sock
        if sock is None:
            raise self._gone or FillError(f"NIXL agent {self.name} is closed", details={"reason": "nixl"})
        limit = timeout if timeout is not None else self.timeout
        sock.settimeout(limit)
        try:
            if not self._started:
                try:
                    self._reply(sock)  # the start's: an agent the child could not make fails this call
                finally:
                    self._started = True
            send_message(sock, request, fds)
            return self._reply(sock)
        except (OSError, EOFError) as exc:  # TimeoutError is an OSError
            raise self._died(request["op"], exc, limit) from None

    def _reply(self, sock: socket.socket) -> Any:
        reply, fds = recv_message(sock)
        for fd in fds:
            os.close(fd)
        if "ok" in reply:
            return reply["ok"]
        text, kind, details = str(reply.get("error")), reply.get("type"), dict(reply.get("details") or {})
        if kind == "ValueError":
            raise ValueError(text)
        details.setdefault("reason", "nixl")
        raise FillError(text, details=details)

    def _died(self, op: str, exc: BaseException, limit: float) -> FillError:
        """What a fill raises when the child broke off: it died (the signal or status named) or did not answer in
        ``limit`` seconds (then it is killed). Either way it is gone afterwards, and so is this object's socket;
        every later call raises the same error."""
        proc = self._proc
        status = None
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                status = proc.wait(0.0 if isinstance(exc, TimeoutError) else 0.5)
        self._kill()
        if status is None:
            what = f"did not answer {op} within {limit:.1f} s and was killed"
        elif status < 0:
            what = f"died of {_signal_name(-status)} during {op}"
        else:
            what = f"exited with status {status} during {op}"
        self._gone = FillError(f"the fill's NIXL agent process {what}", details={"reason": "nixl", "status": status})
        return self._gone

    def _kill(self) -> None:
        """Close the socket; kill and reap the child. Once this returns the child maps nothing of any slab (a
        process's mappings go when it exits), unless it is stuck in the kernel ``KILL_WAIT_S`` after SIGKILL,
        which is logged, and which ``deregister`` then raises."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.kill()
            try:
                proc.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                log.error("the fill's NIXL agent process %d did not exit %.0f s after SIGKILL", proc.pid, KILL_WAIT_S)

    # ------------------------------------------------------------------ memory
    def register_slab(self, slab: Slab) -> Registration:
        """Map ``slab`` (unsealed) in the child and register it; the Registration's region is the child's mapping."""
        t0 = time.perf_counter()
        desc, fds = slab.export()
        got = self._call({"op": "register", "slab": _descriptor(desc)}, fds)
        region = MemoryRegion(int(got["address"]), int(got["length"]), str(got["kind"]), int(got["device"]))
        self._regs[region] = int(got["id"])
        return Registration(region, time.perf_counter() - t0, int(got["id"]))

    def deregister(self, reg: Registration) -> None:
        """Drop ``reg`` and the child's mapping of it. A child that does not confirm (it died, did not answer, or
        failed to deregister, a READ still holding the region) is killed, so that once this returns no process
        writes into the slab, which its owner may free next. FillError only where the child, killed, has not
        exited (stuck in the kernel): it may still map the slab, so its owner must keep it — a CUDA IPC slab,
        freed, goes back to torch's allocator, and a later model's bytes could be written through the child's
        mapping."""
        self._regs.pop(reg.region, None)
        if self._sock is not None:
            try:
                self._call({"op": "deregister", "id": reg.handle})
                return
            except (FillError, ValueError) as exc:
                log.warning("fill agent process pid=%s did not confirm deregistering (%s): killed", self.pid, exc)
                self._kill()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            raise FillError(
                f"the fill's NIXL agent process {proc.pid} did not exit after SIGKILL: it may still map the slab",
                details={"reason": "nixl"},
            )

    # ------------------------------------------------------------------ peers
    def add_peer(self, metadata: bytes) -> str:
        return str(self._call({"op": "add_peer", "metadata": bytes(metadata)}))

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
    ) -> RemoteTransfer:
        """:meth:`wcache.server.nixl.Agent.start_read` in the child: ``local`` is a region ``register_slab`` gave."""
        reg = self._regs.get(local)
        if reg is None:
            raise ValueError(f"{local} is not a region registered with {self.name}")
        nbytes = admit(peer, copies, deadline, self.on_post)
        rows = [[c.source, c.src, c.dst, c.length, c.count, c.src_stride, c.dst_stride] for c in copies]
        got = self._call(
            {
                "op": "read",
                "peer": peer,
                "reg": reg,
                "remote": list(remote),
                "copies": rows,
                "deadline": deadline,  # CLOCK_MONOTONIC: one clock for every process of the machine
                "strided": strided,
            },
            timeout=self._within(deadline),
        )
        return RemoteTransfer(self, peer, int(got["id"]), nbytes, int(got["descriptors"]), deadline)

    def _within(self, deadline: float) -> float:
        """A READ's call limit: what is left of its deadline and a grace of 5 s, at most ``timeout``."""
        return max(1.0, min(self.timeout, deadline - time.monotonic() + 5.0))

    def close(self) -> None:
        """Ask the child to destroy its agent and exit (killed if it does not within 10 s); a child never used
        (its fill found nothing to READ) is killed at once rather than waited for. Idempotent."""
        if self._sock is None:
            return
        if self._started:
            with contextlib.suppress(FillError, ValueError):
                self._call({"op": "close"}, timeout=min(self.timeout, 10.0))
            proc = self._proc
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(min(self.timeout, 10.0))
        self._kill()
        self._regs.clear()


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:  # a real-time signal has no name
        return f"signal {n}"


class RemoteTransfer:
    """One posted READ request of the child (:meth:`AgentProcess.start_read`): :class:`wcache.server.nixl.Transfer`'s
    ``done``, ``stats`` and ``release`` (a fill polls it: ``fill._landed``)."""

    def __init__(
        self, agent: AgentProcess, peer: str, tid: int, nbytes: int, descriptors: int, deadline: float
    ) -> None:
        self._agent, self.peer, self._id = agent, peer, tid
        self.nbytes, self.descriptors, self.deadline = nbytes, descriptors, deadline
        self._done = False
        self._seconds = 0.0
        self._released = False

    def done(self) -> bool:
        """True once every byte landed; FillError when NIXL reports a failure, the deadline passed or the child
        died."""
        if self._done:
            return True
        if time.monotonic() > self.deadline:
            raise late(self.peer, self.nbytes)
        got = self._agent._call({"op": "poll", "id": self._id}, timeout=self._agent._within(self.deadline))
        if got is not None:
            self._done, self._seconds = True, float(got)
        return self._done

    def stats(self) -> ReadStats:
        return ReadStats(self.nbytes, self.descriptors, self._seconds)

    def release(self) -> None:
        """Free the request in the child (nothing to free once the child is gone: its requests went with it)."""
        if self._released:
            return
        self._released = True
        if self._agent.closed:
            return
        try:
            self._agent._call({"op": "release", "id": self._id})
        except FillError as exc:  # the child died meanwhile: the fill fails on its next call, not in a cleanup
            log.debug("releasing a READ in the fill's agent process: %s", exc.message)


def _descriptor(desc: SlabDescriptor) -> dict[str, Any]:
    """What the child maps a slab from (its descriptors travel beside it)."""
    return {
        "kind": desc.kind,
        "size": desc.size,
        "device_uuid": desc.device_uuid,
        "handle": desc.handle,
        "offset": desc.offset,
    }


# ---------------------------------------------------------------------------------------------------- child side
class _Mapping:
    """The child's read-write mapping of one slab, and how to drop it."""

    def __init__(self, region: MemoryRegion, close: Callable[[], None]) -> None:
        self.region = region
        self.close = close


def _map(desc: dict[str, Any], fds: list[int]) -> _Mapping:
    kind, size = desc["kind"], int(desc["size"])
    if kind == "memfd":
        (fd,) = fds
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        import ctypes

        address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        return _Mapping(MemoryRegion(address, size, "host", 0), mm.close)
    from wcache import _cuda
    from wcache.client import driver

    index = _cuda.device_index_for_uuid(desc["device_uuid"])
    if index is None:
        for fd in fds:
            os.close(fd)
        raise FillError(
            f"GPU {desc['device_uuid']} is not visible to the fill's agent process", details={"reason": "nixl"}
        )
    _cuda._make_current(index)  # the primary context, through the driver: the child imports no torch
    if kind == "cuda_vmm":
        (fd,) = fds
        try:
            gran = driver.granularity(index)
            total = max(gran, -(-size // gran) * gran)
            ptr, _ = driver.vmm_import_map(fd, total, index, read_only=False)
        finally:
            os.close(fd)
        return _Mapping(MemoryRegion(ptr, size, "cuda", index), lambda: driver.vmm_unmap(ptr, total))
    if kind == "cuda_ipc":
        base = driver.ipc_open(desc["handle"])
        return _Mapping(MemoryRegion(base + int(desc["offset"]), size, "cuda", index), lambda: driver.ipc_close(base))
    for fd in fds:
        os.close(fd)
    raise FillError(f"a slab of kind {kind!r} cannot be filled", details={"reason": "register"})


class _Child:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.agent: Agent | None = None
        self.maps: dict[int, tuple[_Mapping, Registration]] = {}
        self.transfers: dict[int, Transfer] = {}
        self.next_id = 1

    def serve(self) -> None:
        while True:
            try:
                req, fds = recv_message(self.sock)
            except (EOFError, OSError):
                return  # the daemon went (or closed its end): nothing left to fill
            try:
                reply = {"ok": self.handle(req, fds)}
            except Exception as exc:
                details = dict(exc.details) if isinstance(exc, FillError) else {"reason": "nixl"}
                text = exc.message if isinstance(exc, FillError) else f"{type(exc).__name__}: {exc}"
                reply = {"error": text, "type": type(exc).__name__, "details": details}
            try:
                send_message(self.sock, reply)
            except OSError:
                return  # the daemon went
            if req.get("op") == "close":
                return

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def handle(self, req: dict[str, Any], fds: list[int]) -> Any:
        op = req.get("op")
        if op != "register":
            for fd in fds:
                os.close(fd)
        if op == "start":
            self.agent = Agent(str(req["name"]), threads=int(req["threads"]))
            return True
        agent = self.agent
        if agent is None:
            raise FillError("the fill's agent process has no agent", details={"reason": "nixl"})
        if op == "register":
            m = _map(req["slab"], fds)
            try:
                reg = agent.register(m.region)
            except BaseException:
                m.close()
                raise
            rid = self._id()
            self.maps[rid] = (m, reg)
            r = m.region
            return {"id": rid, "address": r.address, "length": r.length, "kind": r.kind, "device": r.device}
        if op == "deregister":
            m, reg = self.maps.pop(int(req["id"]))
            try:
                agent.deregister(reg)
            finally:
                m.close()  # the mapping goes whatever NIXL said: the daemon frees the slab next
            return True
        if op == "add_peer":
            return agent.add_peer(bytes(req["metadata"]))
        if op == "read":
            local = self.maps[int(req["reg"])][1].region
            a, n, kind, dev = req["remote"]
            copies = [Copy(*row) for row in req["copies"]]
            t = agent.start_read(
                str(req["peer"]),
                copies,
                local,
                MemoryRegion(int(a), int(n), str(kind), int(dev)),
                deadline=float(req["deadline"]),
                strided=bool(req["strided"]),
            )
            tid = self._id()
            self.transfers[tid] = t
            return {"id": tid, "descriptors": t.descriptors}
        if op == "poll":
            t = self.transfers[int(req["id"])]
            return t.stats().seconds if t.done() else None
        if op == "release":
            gone = self.transfers.pop(int(req["id"]), None)
            if gone is not None:
                gone.release()
            return True
        if op == "close":
            self.close()
            return True
        raise FillError(f"unknown request {op!r}", details={"reason": "nixl"})

    def close(self) -> None:
        for t in self.transfers.values():
            t.release()
        self.transfers.clear()
        agent = self.agent
        for m, reg in self.maps.values():
            try:
                if agent is not None:
                    agent.deregister(reg)
            finally:
                m.close()
        self.maps.clear()
        if agent is not None:
            agent.close()
        self.agent = None


def _watch(fd: int) -> None:
    """Exit the moment the daemon's end of the socket closes (the daemon exited or killed us), even while the main
    thread is inside a NIXL call that does not return: a child must not outlive its daemon holding a slab's
    mapping (on a GPU, its memory and a context)."""
    p = select.poll()
    p.register(fd, select.POLLRDHUP)  # POLLHUP and POLLERR come unasked
    while True:
        for _, events in p.poll():
            if events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL):
                os._exit(0)


def main(argv: Sequence[str] | None = None) -> None:
    """The child: serve the daemon's requests on the socket whose descriptor is the first argument."""
    args = list(sys.argv[1:] if argv is None else argv)
    sock = socket.socket(fileno=int(args[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the daemon's terminal is the daemon's to handle
    threading.Thread(target=_watch, args=(sock.fileno(),), name="wcache-agent-watch", daemon=True).start()
    child = _Child(sock)
    try:
        child.serve()
    finally:
        child.close()
        sock.close()


if __name__ == "__main__":
    main()
