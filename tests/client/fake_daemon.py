"""A daemon that misbehaves, for the client's tests: a Unix socket whose connections a thread answers as a test's
``scenario`` says — any frames (``wcache.proto.engine.pack``), any descriptors, at any pace. What a buggy daemon,
or a process of the engine's uid that took its socket, can send an engine."""

from __future__ import annotations

import array
import fcntl
import os
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from wcache.channel import HOST_SEALS
from wcache.proto.codec import decode_body
from wcache.proto.engine import pack
from wcache.proto.table import TensorEntry, TensorTable

__all__ = ["HELLO_OK", "FakeDaemon", "Peer", "memfd", "memfd_slab", "state"]

HELLO_OK: dict[str, Any] = {
    "type": "HELLO_OK",
    "version": 2,
    "software": "fake",
    "backend": "host",
    "device": {"kind": "cpu", "index": 0, "uuid": "", "name": ""},
    "max_frame_size": 1 << 20,
    "server_pid": os.getpid(),
}

#: the file-derived fields (``plan.key.FROM_FILES``) a daemon fills in for a GET_STATE that carries a proof
PROVEN = {"fingerprint": "0" * 32, "architecture": "LlamaForCausalLM", "dtype": "bfloat16", "plan": "none"}


def memfd(size: int, *, seals: int = HOST_SEALS, data: bytes = b"") -> int:
    """A memfd of ``size`` bytes starting with ``data``, sealed with ``seals`` (a daemon's slab: HOST_SEALS)."""
    fd = os.memfd_create("wcache-fake-slab", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if data:
            os.pwrite(fd, data, 0)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def memfd_slab(fd: int, size: int, offset: int = 0) -> dict[str, Any]:
    """A STATE's memfd slab descriptor whose descriptor is the frame's ``fd``-th (docs/protocol.md §4.5)."""
    return {"size": size, "kind": "memfd", "fd": fd, "handle": b"", "offset": offset, "device_uuid": ""}


def state(
    request: dict[str, Any], slabs: list[dict[str, Any]], entries: list[TensorEntry], key: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The STATE answering the GET_STATE ``request``: ``key`` (default: the key asked for, completed as a daemon
    completes a proof's: PROVEN), ``slabs``, the table of ``entries``."""
    served = key if key is not None else {**PROVEN, **request["key"]}
    return {
        "type": "STATE",
        "id": request["id"],
        "lease": 7,
        "key": served,
        "mode": request["mode"],
        "slabs": slabs,
        "tensors": TensorTable.from_entries(entries).to_wire(),
        "aliases": {},
    }


class Peer:
    """One connection to the fake daemon, as its scenario drives it."""

    def __init__(self, sock: socket.socket, stop: threading.Event) -> None:
        self.sock = sock
        self.stop = stop
        self._buf = b""

    def read(self, timeout: float = 10.0) -> dict[str, Any]:
        """The client's next frame (EOFError when it closed)."""
        self.sock.settimeout(timeout)
        while len(self._buf) < 4 or len(self._buf) < 4 + int.from_bytes(self._buf[:4], "big"):
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError("the client closed the connection")
            self._buf += data
        n = int.from_bytes(self._buf[:4], "big")
        body, self._buf = self._buf[4 : 4 + n], self._buf[4 + n :]
        frame: dict[str, Any] = decode_body(body)
        return frame

    def opening(self, *, hello_ok: bool = True) -> dict[str, Any]:
        """Read the client's HELLO and the GET_STATE pipelined behind it, answer HELLO_OK (unless ``hello_ok`` is
        False: the scenario does); returns the GET_STATE."""
        assert self.read()["type"] == "HELLO"
        request = self.read()
        assert request["type"] == "GET_STATE", request
        if hello_ok:
            self.send(HELLO_OK)
        return request

    def send(self, frame: dict[str, Any], fds: Sequence[int] = ()) -> None:
        """One frame, ``fds`` on its first byte (as a daemon sends them, docs/protocol.md §2.2)."""
        self.send_frames([frame], fds)

    def send_frames(self, frames: Sequence[dict[str, Any]], fds: Sequence[int] = ()) -> None:
        """Frames in one write (the client reads them together), ``fds`` on the first byte."""
        data = b"".join(pack(f) for f in frames)
        if fds:
            self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            self.sock.sendall(data)

    def drip(self, frame: dict[str, Any], pause: float) -> None:
        """One frame a byte at a time, ``pause`` seconds before each (until the fake daemon closes)."""
        for b in pack(frame):
            if self.stop.wait(pause):
                return
            self.sock.sendall(bytes([b]))

    def released(self) -> None:
        """Answer the client's RELEASE with RELEASED, then hold the connection (nothing if the client closes it
        first)."""
        try:
            request = self.read()
        except (EOFError, OSError):
            return
        assert request["type"] == "RELEASE", request
        self.send({"type": "RELEASED", "id": request["id"], "lease": request["lease"], "leases_left": 0})
        self.hold()

    def hold(self, timeout: float = 30.0) -> None:
        """Keep the connection open, taking whatever the client sends, until the client closes it, the fake daemon
        closes or ``timeout`` passes."""
        self.sock.settimeout(0.05)
        for _ in range(int(timeout / 0.05)):
            if self.stop.is_set():
                return
            try:
                if not self.sock.recv(1 << 16):
                    return
            except TimeoutError:
                continue
            except OSError:
                return


class FakeDaemon:
    """``scenario(peer)`` runs, on a thread of its own, for each connection to ``path``; the connection closes when
    it returns. Use as a context manager: on exit the socket is removed and every scenario told to stop (``Peer``'s
    waits return) and joined. ``errors``: what scenarios raised (a client that closed first, mostly)."""

    def __init__(self, path: Path, scenario: Callable[[Peer], None]) -> None:
        self.path = path
        self.scenario = scenario
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(str(path))
        self._srv.listen(16)
        self._srv.settimeout(0.05)
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except TimeoutError:
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self.scenario(Peer(conn, self._stop))
        except BaseException as exc:  # kept for the test to look at
            self.errors.append(exc)
        finally:
            conn.close()

    def __enter__(self) -> FakeDaemon:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._accepting.join(10)
        self._srv.close()
        self.path.unlink(missing_ok=True)
        for t in self._threads:
            t.join(10)
