"""Where daemons listen by default; shared by the daemon and the client."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DEFAULT_SOCKET_DIR_HELP", "KEEPER_SOCKET", "default_socket_dir", "socket_name"]

#: The keeper's socket file inside a socket directory (wcache-keeper, docs/protocol.md §4.11).
KEEPER_SOCKET = "wcache-keeper.sock"

#: The default socket directory in words, for --help texts and errors.
DEFAULT_SOCKET_DIR_HELP = "$XDG_RUNTIME_DIR/wcache when XDG_RUNTIME_DIR is set, else /tmp/wcache-UID"


def default_socket_dir() -> Path:
    """``$XDG_RUNTIME_DIR/wcache`` when set, else ``/tmp/wcache-<uid>``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "wcache"
    return Path(f"/tmp/wcache-{os.geteuid()}")


def socket_name(tp_rank: int) -> str:
    """The socket file of the daemon serving ``tp_rank`` inside a socket directory."""
    return f"wcache-rank{tp_rank}.sock"
