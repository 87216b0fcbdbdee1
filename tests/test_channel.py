"""wcache/channel.py against real sockets: what one read takes with its descriptors (docs/protocol.md §2.2)."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from wcache.channel import Channel, close_fds, connect_engine_blocking
from wcache.errors import RemoteProtocolError
from wcache.proto import Connection, Role, Service, State
from wcache.proto.daemon_frames import MAX_FRAME_FDS, SlabDescriptor
from wcache.proto.examples import EXAMPLES


@contextmanager
def _state_sent_with(n: int) -> Iterator[tuple[Channel[Connection], list[int]]]:
    """A client's Channel whose next frame is a STATE over ``n`` memfd slabs, sent as a daemon sends it (the ``n``
    descriptors on its first byte), with the sender's descriptors; all closed afterwards."""
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER, service=Service.DAEMON)
    for frame, src, dst in (("HELLO", client, server), ("HELLO_OK", server, client), ("GET_STATE", client, server)):
        dst.receive_data(src.send(EXAMPLES[frame]))
        assert list(dst.events()) == [EXAMPLES[frame]]
    base = EXAMPLES["STATE"]
    assert isinstance(base, State)
    state = dataclasses.replace(base, slabs=tuple(SlabDescriptor(size=1280, kind="memfd", fd=i) for i in range(n)))
    fds = [os.memfd_create(f"wcache-test-{i}") for i in range(n)]
    a, b = socket.socketpair()
    ch = Channel(b, client)
    try:
        socket.send_fds(a, [server.send(state)], fds)
        yield ch, fds
    finally:
        ch.close()
        a.close()
        close_fds(fds)


def test_a_frame_with_the_most_descriptors_a_frame_may_carry_arrives_whole() -> None:
    """A STATE over MAX_FRAME_FDS memfd slabs reaches a client's Channel with every descriptor, in order (more
    would be refused by the decoder: the read's room is one frame's)."""
    with _state_sent_with(MAX_FRAME_FDS) as (ch, sent):
        frame, got = ch.receive_blocking(5.0)
        try:
            assert isinstance(frame, State) and frame.fd_count == MAX_FRAME_FDS
            assert [os.fstat(fd).st_ino for fd in got] == [os.fstat(fd).st_ino for fd in sent]
        finally:
            close_fds(got)


def test_received_descriptors_are_not_inherited_by_a_program_this_process_runs() -> None:
    """Descriptors received with a frame are close-on-exec from the moment they arrive, as every descriptor
    Python makes is (PEP 446): a program the engine (or a daemon) runs meanwhile — ``os.system``, another thread's
    fork and exec — does not inherit a slab's memfd and hold its memory for its own life. SCM_RIGHTS
    descriptors are so only when received with MSG_CMSG_CLOEXEC; before, they were inheritable."""
    with _state_sent_with(2) as (ch, _):
        frame, got = ch.receive_blocking(5.0)
        try:
            assert len(got) == 2 and not any(os.get_inheritable(fd) for fd in got)
        finally:
            close_fds(got)


def test_descriptors_past_a_reads_room_are_refused_and_none_leak() -> None:
    """17 descriptors on one frame (one more than a frame may carry): the read finds them truncated, the channel
    raises RemoteProtocolError and closes the 16 that did arrive (none stays open in this process)."""
    with _state_sent_with(MAX_FRAME_FDS + 1) as (ch, _):
        open_before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(RemoteProtocolError, match="truncated"):
            ch.receive_blocking(5.0)
        assert len(os.listdir("/proc/self/fd")) == open_before


def test_a_blocking_read_counts_only_the_wait_for_bytes_not_in_yet() -> None:
    """``waited`` is the time the socket was waited on: none for a frame already in it, the whole timeout for a
    peer that sends nothing (then TimeoutError); the socket stays non-blocking for the asyncio methods."""
    with _state_sent_with(1) as (ch, _):
        frame, got = ch.receive_blocking(5.0)
        close_fds(got)
        assert isinstance(frame, State) and ch.waited == 0.0
        with pytest.raises(TimeoutError):
            ch.receive_blocking(0.05)
        assert 0.05 <= ch.waited < 5.0
        assert ch.sock.getblocking() is False


#: a peer that sends a byte every DRIP seconds: each wait for bytes is well within the reader's timeout
DRIP = 0.02


def _drip(sock: socket.socket, data: bytes, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        for i in range(len(data)):
            if stop.wait(DRIP):
                return
            sock.send(data[i : i + 1])

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_blocking_read_is_bounded_by_its_timeout_however_the_peer_trickles() -> None:
    """``receive_blocking(timeout)`` bounds the call, not each wait: HELLO_OK a byte every 20 ms (151 bytes, 3 s)
    is TimeoutError after 0.2 s. Bounding each wait only, a peer that sends now and then held the reader for as
    long as it liked."""
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER, service=Service.DAEMON)
    server.receive_data(client.send(EXAMPLES["HELLO"]))
    assert list(server.events()) == [EXAMPLES["HELLO"]]
    a, b = socket.socketpair()
    ch = Channel(b, client)
    stop = threading.Event()
    t = _drip(a, server.send(EXAMPLES["HELLO_OK"]), stop)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"no whole frame within 0\.2 s"):
            ch.receive_blocking(0.2)
        assert 0.2 <= time.monotonic() - t0 < 1.5
    finally:
        stop.set()
        t.join()
        ch.close()
        a.close()


def test_a_blocking_connect_is_bounded_by_its_timeout(tmp_path: Path) -> None:
    """``connect_engine_blocking(timeout)`` bounds the whole connect — the socket, the opening, ``meanwhile`` and
    HELLO_OK — not each step: a daemon trickling HELLO_OK is TimeoutError after the timeout."""
    from wcache.plan.key import WeightCacheKey
    from wcache.proto.engine import get_state

    key = WeightCacheKey("0" * 32, "LlamaForCausalLM", 1, 0, "float32").to_wire()
    path = tmp_path / "slow.sock"
    stop = threading.Event()
    drips: list[threading.Thread] = []
    accepted: list[socket.socket] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(str(path))
        srv.listen(1)

        def accept() -> None:
            conn, _ = srv.accept()
            accepted.append(conn)
            server = Connection(Role.SERVER, service=Service.DAEMON)
            server.receive_data(conn.recv(1 << 16))
            assert [f.TYPE for f in server.events()] == ["HELLO", "GET_STATE"]
            drips.append(_drip(conn, server.send(EXAMPLES["HELLO_OK"]), stop))

        def connect() -> None:
            ch, _ = connect_engine_blocking(
                path,
                software="test",
                name="engine",
                timeout=0.3,
                pipeline=lambda conn: get_state(conn.next_request_id(), key, "zero_copy"),
                meanwhile=lambda: time.sleep(0.1),
            )
            ch.close()

        acceptor = threading.Thread(target=accept)
        acceptor.start()
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                connect()
            assert 0.3 <= time.monotonic() - t0 < 1.5
        finally:
            stop.set()
            acceptor.join()
            for t in drips:
                t.join()
            for conn in accepted:
                conn.close()
