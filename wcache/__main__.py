"""``python -m wcache``: the operator CLI (``wcache status|preload|evict``), for when the script is not on PATH."""

from __future__ import annotations

import sys

from wcache.cli import main

if __name__ == "__main__":
    sys.exit(main())
