"""Atheris (libFuzzer) harness for the sans-I/O decoder.

Invariant: for any input bytes, fed whole and then in small pieces (one byte at a time for
inputs up to 256 bytes, 7-byte pieces beyond) into a server-side and a client-side
``Connection``, decoding yields only typed frames or raises ``wcache.errors.RemoteProtocolError``
(or a subclass: the peer broke the protocol); whole and piecewise feeding yield the same frames and the same outcome;
buffered bytes stay bounded by the frame limit.
Anything else — another exception, a hang, unbounded buffering — is a bug.

Run (one command, N inputs; seeds are the golden examples of docs/protocol.md §8):

    python tests/fuzz/fuzz_decoder.py -runs=1000000 -max_len=4096
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from wcache.errors import RemoteProtocolError
    from wcache.proto import Connection, Event, Role, pack_frame
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


def test_one_input(data: bytes) -> None:
    for role in (Role.SERVER, Role.CLIENT):
        whole = _drive(data, role, max(1, len(data)))
        assert _drive(data, role, 1 if len(data) <= 256 else 7) == whole, "chunking changed the result"


def seeds() -> list[bytes]:
    return [pack_frame(f.to_wire()) for f in EXAMPLES.values()]


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
