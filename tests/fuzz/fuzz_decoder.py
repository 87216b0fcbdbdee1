"""Atheris (libFuzzer) harness for the sans-I/O decoders.

Invariant: for any input bytes, fed whole and then in small pieces (one byte at a time for
inputs up to 256 bytes, 7-byte pieces beyond) into a server-side and a client-side
``Connection``, decoding yields only typed frames or raises ``wcache.errors.RemoteProtocolError``
(or a subclass: the peer broke the protocol); whole and piecewise feeding yield the same frames and the same outcome;
buffered bytes stay bounded by the frame limit. An engine's own connection (``wcache.proto.engine``), with its
opening out, makes of the same bytes what a reference client connection with the same opening makes: the same
frames, the same error.
Anything else — another exception, a hang, unbounded buffering — is a bug.

Run (one command, N inputs; seeds are the golden examples of docs/protocol.md §8):

    python tests/fuzz/fuzz_decoder.py -runs=1000000 -max_len=4096
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from wcache.errors import RemoteProtocolError
    from wcache.proto import PROTOCOL_VERSION, Connection, Event, GetState, Hello, Role, engine, pack_frame
    from wcache.proto.examples import EXAMPLES

MAX = 1 << 16


def _drive(data: bytes, role: Role, chunk: int) -> tuple[list[Event], str]:
    conn = Connection(role, max_frame_size=MAX)
    frames: list[Event] = []
    outcome = "ok"
    try:
        for i in range(0, len(data), chunk):
            conn.receive_data(data[i : i + chunk])
            frames.extend(conn.events())
            if conn.buffered > MAX + 4 + chunk:
                raise AssertionError(f"unbounded buffering: {conn.buffered} bytes")
        conn.receive_data(b"")
        frames.extend(conn.events())
    except RemoteProtocolError as exc:
        outcome = type(exc).__name__
    return frames, outcome


KEY: dict[str, str | int] = {"fingerprint": "f", "architecture": "", "tp_size": 1, "tp_rank": 0, "dtype": "bfloat16"}


def _client(ours: bool) -> Connection | engine.EngineConnection:
    """A reference client connection or an engine's, each with HELLO and GET_STATE 1 out."""
    if ours:
        conn = engine.EngineConnection(MAX)
        conn.opening("fuzz", "fuzz", engine.get_state(conn.next_request_id(), KEY, "zero_copy"))
        return conn
    ref = Connection(Role.CLIENT, max_frame_size=MAX)
    ref.send(Hello(versions=(PROTOCOL_VERSION,), software="fuzz", name="fuzz"))
    ref.send(GetState(id=ref.next_request_id(), key=KEY))
    return ref


def _declared(frame: object) -> object:
    """A frame a client connection yields, as the declarations' record (a server's Misdirected never comes here)."""
    return engine.as_reference(frame)  # type: ignore[arg-type]


def _drive_client(data: bytes, ours: bool, chunk: int) -> tuple[list[object], str]:
    """What a client connection with its opening out makes of ``data``: each frame as the declarations' record."""
    conn = _client(ours)
    frames: list[object] = []
    outcome = "ok"
    try:
        for i in range(0, len(data), chunk):
            conn.receive_data(data[i : i + chunk])
            frames.extend(_declared(f) for f, _ in conn.received())
        conn.receive_data(b"")
        frames.extend(_declared(f) for f, _ in conn.received())
    except RemoteProtocolError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return frames, outcome


def test_one_input(data: bytes) -> None:
    piece = 1 if len(data) <= 256 else 7
    for role in (Role.SERVER, Role.CLIENT):
        whole = _drive(data, role, max(1, len(data)))
        assert _drive(data, role, piece) == whole, "chunking changed the result"
    reference = _drive_client(data, False, max(1, len(data)))
    assert _drive_client(data, True, max(1, len(data))) == reference, "the engine's connection differs"
    assert _drive_client(data, True, piece) == reference, "chunking changed the engine's result"


def seeds() -> list[bytes]:
    """The golden examples, and an engine's exchange: HELLO_OK, then STATE (its request's id) and RELEASED."""
    hello_ok, state, released = EXAMPLES["HELLO_OK"], EXAMPLES["STATE"], EXAMPLES["RELEASED"]
    exchange = pack_frame(hello_ok.to_wire()) + pack_frame(state.to_wire()) + pack_frame(released.to_wire())
    return [pack_frame(f.to_wire()) for f in EXAMPLES.values()] + [exchange]


def main() -> None:
    """With no corpus directory on the command line, seed a temporary one and fuzz in a child process with it:
    libFuzzer leaves through C exit(), past Python's cleanup, so only a parent can remove the directory."""
    args = list(sys.argv)
    if any(not a.startswith("-") for a in args[1:]):
        atheris.Setup(args, test_one_input)
        atheris.Fuzz()
        return
    import subprocess
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="wcache-fuzz-corpus-") as corpus:
        for i, s in enumerate(seeds()):
            (Path(corpus) / f"seed{i}").write_bytes(s)
        rc = subprocess.call([sys.executable, *args, corpus])
    sys.exit(rc)


if __name__ == "__main__":
    main()
