"""Idle peers: a process of the service's uid that opens connections, says HELLO on each and nothing else.

``python -m tests.server.idle_peers SOCKET``: reads commands from stdin, one a line, and answers each on stdout:
``open N`` opens N more connections, one after another, each sending HELLO and reading the one frame that
answers it (HELLO_OK, or the fatal ERROR of a service at its cap), and prints ``opened N ok=K`` (K: HELLO_OK
replies); ``live`` prints ``live M``, the connections the service has not closed. It keeps every socket open
and holds still until stdin ends (test_keeper.py: idle peers must not lock a daemon out of its keeper).
"""

from __future__ import annotations

import socket
import struct
import sys

from wcache.proto import PROTOCOL_VERSION, Hello, pack_frame

HELLO = pack_frame(Hello(versions=(PROTOCOL_VERSION,)).to_wire())


def _reply(s: socket.socket) -> bytes:
    """The type byte-string of the first frame the service sends (b"" if it closed first)."""
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
        chunk = s.recv(65536)
        if not chunk:
            return b""
        data += chunk
    return data[4:]


def _closed(s: socket.socket) -> bool:
    """Whether the service closed ``s`` (a non-blocking socket; a fatal ERROR before the close is dropped)."""
    while True:
        try:
            if not s.recv(65536):
                return True
        except BlockingIOError:
            return False
        except OSError:
            return True


def main(path: str) -> None:
    peers: list[socket.socket] = []
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "open":
            ok = 0
            for _ in range(int(cmd[1])):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(30)
                s.connect(path)
                peers.append(s)
                try:
                    s.sendall(HELLO)
                    ok += b"HELLO_OK" in _reply(s)
                except OSError:  # refused and closed before its HELLO was taken
                    pass
                s.setblocking(False)
            print(f"opened {cmd[1]} ok={ok}", flush=True)
        elif cmd[0] == "live":
            print(f"live {sum(not _closed(s) for s in peers)}", flush=True)
    for s in peers:
        s.close()


if __name__ == "__main__":
    main(sys.argv[1])
