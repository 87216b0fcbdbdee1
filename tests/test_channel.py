"""wcache/channel.py against real sockets: what one read takes with its descriptors (docs/protocol.md §2.2)."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

from wcache.channel import Channel, close_fds
from wcache.errors import RemoteProtocolError
from wcache.proto import PROTOCOL_VERSION, Connection, DeviceInfo, GetState, Hello, HelloOk, Role, Service, State
from wcache.proto.daemon_frames import MAX_FRAME_FDS, SlabDescriptor
from wcache.proto.examples import EXAMPLES


def _open(server: Connection, client: Connection) -> None:
    """Both ends past the handshake, a GET_STATE (id 1) pending, so a STATE is the client's next frame."""
    server.receive_data(client.send(Hello(versions=(PROTOCOL_VERSION,))))
    list(server.events())
    client.receive_data(
        server.send(
            HelloOk(
                version=PROTOCOL_VERSION, software="t", backend="host", device=DeviceInfo("cpu"), max_frame_size=1 << 20
            )
        )
    )
    list(client.events())
    server.receive_data(client.send(GetState(id=1, key=dict(EXAMPLES["GET_STATE"].key))))  # type: ignore[attr-defined]
    list(server.events())


def test_a_frame_with_the_most_descriptors_a_frame_may_carry_arrives_whole() -> None:
    """A STATE over MAX_FRAME_FDS memfd slabs, its descriptors on its first byte as a daemon sends them, reaches a
    client's Channel with every descriptor, in order (more would be refused by the decoder: the read's room is one
    frame's)."""
    server, client = Connection(Role.SERVER, service=Service.DAEMON), Connection(Role.CLIENT)
    _open(server, client)
    base = EXAMPLES["STATE"]
    assert isinstance(base, State)
    state = dataclasses.replace(
        base, slabs=tuple(SlabDescriptor(size=1280, kind="memfd", fd=i) for i in range(MAX_FRAME_FDS))
    )
    fds = [os.memfd_create(f"wcache-test-{i}") for i in range(MAX_FRAME_FDS)]
    inodes = [os.fstat(fd).st_ino for fd in fds]
    a, b = socket.socketpair()
    ch = Channel(b, client)
    try:
        socket.send_fds(a, [server.send(state)], fds)
        frame, got = ch.receive_blocking(5.0)
        try:
            assert isinstance(frame, State) and frame.fd_count == MAX_FRAME_FDS
            assert [os.fstat(fd).st_ino for fd in got] == inodes
        finally:
            close_fds(got)
    finally:
        ch.close()
        a.close()
        close_fds(fds)


def test_descriptors_past_a_reads_room_are_refused_and_none_leak() -> None:
    """17 descriptors on one frame (one more than a frame may carry): the read finds them truncated, the channel
    raises RemoteProtocolError and closes the 16 that did arrive (none stays open in this process)."""
    server, client = Connection(Role.SERVER, service=Service.DAEMON), Connection(Role.CLIENT)
    _open(server, client)
    base = EXAMPLES["STATE"]
    assert isinstance(base, State)
    n = MAX_FRAME_FDS + 1
    state = dataclasses.replace(base, slabs=tuple(SlabDescriptor(size=1280, kind="memfd", fd=i) for i in range(n)))
    fds = [os.memfd_create(f"wcache-test-{i}") for i in range(n)]
    a, b = socket.socketpair()
    ch = Channel(b, client)
    try:
        open_before = len(os.listdir("/proc/self/fd"))
        socket.send_fds(a, [server.send(state)], fds)
        with pytest.raises(RemoteProtocolError, match="truncated"):
            ch.receive_blocking(5.0)
        assert len(os.listdir("/proc/self/fd")) == open_before
    finally:
        ch.close()
        a.close()
        close_fds(fds)
