"""An engine at its descriptor limit: whatever in a fetch runs out of descriptors once its socket is open — the
mapping's module imported while the daemon answers, the declarations an ERROR is decoded through — fails the fetch
with CacheUnavailableError (a WCacheError: ``wcache.nn.load_weights`` loads from disk), not a bare OSError that
crashes the engine's load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.client.fake_daemon import FakeDaemon, Peer

#: the engine, in a child, every descriptor but one taken, so that the fetch's socket gets the last one. argv: socket,
#: blocking (1/0), what it imported: "nn" (wcache.nn: the error tree, not the mapping's module or the frames),
#: "mapped" (that and the mapping's module: a second fetch), "bare" (wcache alone, no error tree)
_ENGINE = """
import asyncio, os, sys
if sys.argv[3] in ("nn", "mapped"):
    import wcache.nn
if sys.argv[3] == "mapped":
    import wcache.client.mapping
from wcache import WCacheClient, WeightCacheKey

assert "wcache.proto.daemon_frames" not in sys.modules
assert (sys.argv[3] == "mapped") == ("wcache.client.mapping" in sys.modules)
assert (sys.argv[3] != "bare") == ("wcache.errors" in sys.modules)
client = WCacheClient(sys.argv[1], timeout=3, wait_for_daemon=0)
key = WeightCacheKey("0" * 32, "LlamaForCausalLM", 1, 0, "float32")
blocking = sys.argv[2] == "1"
loop = asyncio.new_event_loop()  # its descriptors taken before the limit
taken = []
try:
    while True:
        taken.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
os.close(taken.pop())  # exactly one descriptor left: the fetch's socket takes it
try:
    client.fetch_sync(key) if blocking else loop.run_until_complete(client.fetch(key))
    result = "fetched"
except BaseException as exc:
    from wcache.errors import WCacheError
    kind = "WCacheError" if isinstance(exc, WCacheError) else "escaped"
    result = f"{kind} {type(exc).__name__} {getattr(exc, 'details', {}).get('errno')}: {exc}"
finally:
    for fd in taken:
        os.close(fd)
    loop.close()
print(result)
"""


def _answer_key_mismatch(peer: Peer) -> None:
    request = peer.opening()
    peer.send({"type": "ERROR", "id": request["id"], "code": 21, "message": "not served", "details": {}})
    peer.hold(10)


@pytest.mark.parametrize("blocking", ["1", "0"], ids=["fetch_sync", "fetch"])
@pytest.mark.parametrize("imported", ["nn", "mapped", "bare"])
def test_a_fetch_with_its_last_descriptor_fails_as_a_wcache_error(blocking: str, imported: str, tmp_path: Path) -> None:
    """The socket gets the last descriptor, the connect succeeds and the opening is written. ``nn``: the window then
    imports the mapping's module, which cannot be read (EMFILE); ``mapped``: that module is loaded, and the daemon's
    KEY_MISMATCH is decoded through the declarations, which cannot be read; ``bare``: as ``nn`` in an engine that
    has not loaded the error tree either, which the fetch imports once its own socket is closed. Each escaped as
    OSError."""
    path = tmp_path / "s.sock"
    root = Path(__file__).resolve().parents[2]
    with FakeDaemon(path, _answer_key_mismatch):
        r = subprocess.run(
            [sys.executable, "-c", _ENGINE, str(path), blocking, imported],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("WCacheError CacheUnavailableError EMFILE:"), r.stdout
