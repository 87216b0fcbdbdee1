"""wcache/client/client.py against daemons that misbehave (tests/client/fake_daemon.py): what either fetch accepts
of a daemon's answers."""

from __future__ import annotations

import asyncio
import errno
import math
import os
import time
from array import array
from pathlib import Path
from typing import Any

import pytest

from tests.client.fake_daemon import HELLO_OK, PROVEN, FakeDaemon, Peer, memfd, memfd_slab, state
from wcache import CacheUnavailableError, WCacheClient, WeightCacheKey
from wcache.errors import RemoteProtocolError
from wcache.proto.table import TensorEntry

KEY = WeightCacheKey("0" * 32, "LlamaForCausalLM", 1, 0, "float32")
ONE = [TensorEntry("w", "float32", (4,), (1,), 0, 0)]


def _fetch(client: WCacheClient, key: WeightCacheKey, blocking: bool) -> Any:
    return client.fetch_sync(key) if blocking else asyncio.run(client.fetch(key))


def _open_memfds() -> int:
    """This process's descriptors of the fake daemon's memfds."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:wcache-fake-slab")
        except OSError:
            pass
    return n


OTHER_MODELS: dict[str, dict[str, Any]] = {
    "another fingerprint": {"fingerprint": "f" * 32},
    "another dtype": {"dtype": "bfloat16"},
    "another rank": {"tp_rank": 1, "tp_size": 2},
    "another plan": {"plan": "builtin:llama/1"},
    "a recipe": {"engine": "vllm"},
    "a field of another type": {"tp_size": "1"},
}


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
@pytest.mark.parametrize("served", list(OTHER_MODELS.values()), ids=list(OTHER_MODELS))
def test_a_state_for_another_key_than_the_one_asked_for_is_refused(
    served: dict[str, Any], blocking: bool, tmp_path: Path
) -> None:
    """A full key (scanned, resolved, built by the engine): a STATE serving another model's key is a break of
    docs/protocol.md §4.4 (the daemon serves only the key asked for) — RemoteProtocolError, the slab's descriptor
    closed. Only a proven key's STATE was compared (``adopt``); a full key's was mapped and handed to the engine
    as the weights of the key it asked for."""

    def scenario(peer: Peer) -> None:
        request = peer.opening()
        fd = memfd(16)
        try:
            peer.send(state(request, [memfd_slab(0, 16)], ONE, key={**request["key"], **served}), [fd])
        finally:
            os.close(fd)
        peer.hold()

    sock = tmp_path / "fake.sock"
    before = _open_memfds()  # other tests' weights, until the collector frees them
    with FakeDaemon(sock, scenario), pytest.raises(RemoteProtocolError, match="the daemon served key"):
        _fetch(WCacheClient(sock, wait_for_daemon=0, timeout=10), KEY, blocking)
    assert _open_memfds() == before  # the STATE's descriptor closed (the fake daemon's own closed before it returns)


#: keys other than the one proven: fields the daemon does not supply for a proof (FROM_FILES it does)
OTHER_THAN_PROVEN = {k: v for k, v in OTHER_MODELS.items() if not set(v) & set(PROVEN)}


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
@pytest.mark.parametrize("served", list(OTHER_THAN_PROVEN.values()), ids=list(OTHER_THAN_PROVEN))
def test_a_state_for_another_key_than_the_one_proven_is_refused(
    served: dict[str, Any], blocking: bool, ckpt: Path, tmp_path: Path
) -> None:
    """A proven key (its files only stated): the STATE supplies the fields read from the files, and every other
    field must be the key's. A STATE whose key carries a field the proven key has not (a recipe's ``engine``: a
    deposit's weights) was accepted as the checkpoint's: ``adopt`` looked only at the fields it knew. It is
    RemoteProtocolError, as for a full key, the slab's descriptor closed."""
    _proven_key_refuses(WeightCacheKey.from_checkpoint(ckpt), served, blocking, tmp_path)


def _proven_key_refuses(
    key: WeightCacheKey, served: dict[str, Any], blocking: bool, tmp_path: Path, proof_dtype: str | None = None
) -> None:
    """A fake daemon answers ``key``'s proof (its ``dtype`` ``proof_dtype``, where given) with a STATE keyed as the
    proof's completion with ``served`` over it: the fetch raises RemoteProtocolError and keeps no descriptor."""

    def scenario(peer: Peer) -> None:
        request = peer.opening()
        assert "proof" in request
        if proof_dtype is not None:
            assert request["proof"]["dtype"] == proof_dtype
        fd = memfd(16)
        try:
            peer.send(state(request, [memfd_slab(0, 16)], ONE, key={**PROVEN, **request["key"], **served}), [fd])
        finally:
            os.close(fd)
        peer.hold()

    sock = tmp_path / "fake.sock"
    assert key.proof() is not None
    before = _open_memfds()
    with FakeDaemon(sock, scenario), pytest.raises(RemoteProtocolError, match="the daemon served key"):
        _fetch(WCacheClient(sock, wait_for_daemon=0, timeout=10), key, blocking)
    assert _open_memfds() == before


#: (the request's dtype, tp_size, the file-derived fields served): values the request rules out (§4.3's rules)
RULED_OUT: dict[str, tuple[str | None, int, dict[str, Any]]] = {
    "another dtype than the one asked for": ("float16", 1, {"dtype": "bfloat16"}),
    "a dtype auto cannot give": (None, 1, {"dtype": "float8_e4m3fn"}),
    "a plan at tp_size 1": ("float16", 1, {"dtype": "float16", "plan": "builtin:llama/1"}),
    "no plan at tp_size 2": (None, 2, {"plan": "none"}),
    "a plan file's plan without one": (None, 2, {"plan": "file:0123456789abcdef"}),
    "a fingerprint of another form": (None, 1, {"fingerprint": "F" * 32}),
}


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
@pytest.mark.parametrize("case", list(RULED_OUT.values()), ids=list(RULED_OUT))
def test_a_proven_key_refuses_file_derived_fields_its_request_rules_out(
    case: tuple[str | None, int, dict[str, Any]], blocking: bool, ckpt: Path, tmp_path: Path
) -> None:
    """The STATE supplies a proven key's file-derived fields, but the request already fixes some of them: an
    explicit dtype is served as itself and ``"auto"`` as a floating dtype, the plan is ``"none"`` at tp_size 1 and a
    built-in plan's id above it (no plan file: a proof is never sent with one), the fingerprint is 32 lowercase hex
    digits. ``adopt`` checked only their types, so a daemon serving float16 weights under a bfloat16 key was taken
    at its word; the same STATE for the scanned full key was refused. RemoteProtocolError now, the slab closed."""
    asked, tp_size, served = case
    key = WeightCacheKey.from_checkpoint(ckpt, dtype=asked, tp_size=tp_size)
    _proven_key_refuses(key, served, blocking, tmp_path, proof_dtype=asked or "auto")


def test_the_floating_dtypes_a_proven_key_takes_for_auto_are_the_checkpoints() -> None:
    from wcache.plan import key
    from wcache.plan.checkpoint import FLOATING

    assert set(key._FLOATING) == FLOATING


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
def test_the_full_key_sent_after_a_refused_proof_is_checked_too(blocking: bool, ckpt: Path, tmp_path: Path) -> None:
    """A daemon refuses the proof (KEY_UNPROVEN), the client scans the headers and asks for the full key on the same
    connection (docs/protocol.md §4.3.1); a STATE serving another fingerprint is refused, and the one of the key
    asked for accepted."""
    from wcache.error_codes import ErrorCode

    fingerprint: list[str] = []

    def scenario(peer: Peer) -> None:
        request = peer.opening()
        assert "fingerprint" not in request["key"]  # a proof
        peer.send(
            {
                "type": "ERROR",
                "id": request["id"],
                "code": int(ErrorCode.KEY_UNPROVEN),
                "message": "these files were not read here",
                "fatal": False,
                "details": {},
            }
        )
        request = peer.read()
        served = {**request["key"], "fingerprint": fingerprint[0] if fingerprint else "f" * 32}
        fd = memfd(16)
        try:
            peer.send(state(request, [memfd_slab(0, 16)], ONE, key=served), [fd])
        finally:
            os.close(fd)
        peer.released()

    sock = tmp_path / "fake.sock"
    client = WCacheClient(sock, wait_for_daemon=0, timeout=10)
    with FakeDaemon(sock, scenario):
        with pytest.raises(RemoteProtocolError, match="the daemon served key"):
            _fetch(client, WeightCacheKey.from_checkpoint(ckpt), blocking)
        fingerprint.append(WeightCacheKey.from_checkpoint(ckpt).resolve().fingerprint)
        w = _fetch(client, WeightCacheKey.from_checkpoint(ckpt), blocking)
        assert not w.key_proven and w.key.fingerprint == fingerprint[0]
        w.release_sync()


#: a daemon that sends its answer a byte at a time, each byte well within the client's timeout (HELLO_OK: 2.5 s whole)
DRIP = 0.02
TIMEOUT = 0.3
#: what a call bounded by TIMEOUT may take on a busy 2-core machine: well below the whole answer's time
BOUND = 1.5


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
@pytest.mark.parametrize("slow", ["HELLO_OK", "STATE"])
def test_a_daemon_that_trickles_its_answer_is_cache_unavailable_at_the_timeout(
    slow: str, blocking: bool, tmp_path: Path
) -> None:
    """The whole fetch is bounded by its timeout — one deadline through the connect, the handshake and every read
    — however the daemon's bytes trickle in. fetch_sync's reads were bounded per wait (``receive_blocking``), and
    its handshake got the whole timeout again: a daemon sending a byte every 0.1 s held a fetch_sync(timeout=0.5)
    for 12.5 s, which then said it "did not answer within 0.5 s"."""

    def scenario(peer: Peer) -> None:
        request = peer.opening(hello_ok=slow != "HELLO_OK")
        if slow == "HELLO_OK":
            peer.drip(HELLO_OK, DRIP)
            return
        peer.drip(state(request, [], []), DRIP)  # a STATE of nothing: ~300 bytes, ~6 s

    sock = tmp_path / "fake.sock"
    client = WCacheClient(sock, wait_for_daemon=0)
    with FakeDaemon(sock, scenario):
        t0 = time.monotonic()
        with pytest.raises(CacheUnavailableError, match=f"did not answer within {TIMEOUT} s"):
            client.fetch_sync(KEY, timeout=TIMEOUT) if blocking else asyncio.run(client.fetch(KEY, timeout=TIMEOUT))
        took = time.monotonic() - t0
    assert TIMEOUT <= took < BOUND


@pytest.mark.parametrize("blocking", [True, False], ids=["release_sync", "release"])
def test_a_release_whose_answer_trickles_in_returns_at_the_timeout(blocking: bool, tmp_path: Path) -> None:
    """release_sync(timeout), as release(timeout), returns quietly once its timeout has passed, closing the
    connection (which ends the lease), whatever the daemon does: it waited as long as RELEASED took to trickle in."""

    def scenario(peer: Peer) -> None:
        request = peer.opening()
        fd = memfd(16)
        try:
            peer.send(state(request, [memfd_slab(0, 16)], ONE), [fd])
        finally:
            os.close(fd)
        release = peer.read()
        released = {"type": "RELEASED", "id": release["id"], "lease": release["lease"], "leases_left": 0}
        peer.drip(released, 0.1)  # 45 bytes: 4.5 s

    sock = tmp_path / "fake.sock"
    with FakeDaemon(sock, scenario):
        w = WCacheClient(sock, wait_for_daemon=0, timeout=10).fetch_sync(KEY)
        t0 = time.monotonic()
        w.release_sync(timeout=TIMEOUT) if blocking else asyncio.run(w.release(timeout=TIMEOUT))
        took = time.monotonic() - t0
    assert w.released and TIMEOUT <= took < BOUND


def _leases(peer: Peer) -> None:
    """A daemon serving a 16-byte slab (``w``: 0, 1, 2, 3 as float32) and answering RELEASE."""
    request = peer.opening()
    fd = memfd(16, data=bytes(memoryview(array("f", [0, 1, 2, 3]))))
    try:
        peer.send(state(request, [memfd_slab(0, 16)], ONE), [fd])
    finally:
        os.close(fd)
    peer.released()


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
@pytest.mark.parametrize("timeout", [math.inf, 1e12], ids=["inf", "1e12"])
def test_a_timeout_of_no_limit_is_taken_by_the_blocking_calls_too(
    timeout: float, blocking: bool, tmp_path: Path
) -> None:
    """``math.inf``, or any timeout past what a socket's clock holds (~9.2e9 s), is no limit: the client's, a
    fetch's, a release's, copy mode's. fetch_sync and release_sync raised OverflowError from
    ``socket.settimeout`` — not a WCacheError, so the engine's fallback did not catch it — where fetch and release
    took the same value."""
    sock = tmp_path / "fake.sock"
    with FakeDaemon(sock, _leases):
        for client, per_call in (
            (WCacheClient(sock, wait_for_daemon=0, timeout=timeout), None),
            (WCacheClient(sock, wait_for_daemon=0), timeout),
        ):
            for mode in ("zero_copy", "copy"):
                if blocking:
                    w = client.fetch_sync(KEY, mode, timeout=per_call)
                else:
                    w = asyncio.run(client.fetch(KEY, mode, timeout=per_call))
                assert w["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
                assert w.released == (mode == "copy")
                release = timeout if per_call is None else per_call
                w.release_sync(timeout=release) if blocking else asyncio.run(w.release(timeout=release))
                assert w.released


@pytest.mark.parametrize("blocking", [True, False], ids=["fetch_sync", "fetch"])
def test_a_timeout_that_is_not_a_number_is_a_value_error(blocking: bool, tmp_path: Path) -> None:
    """A NaN timeout is ValueError before anything is sent, for the blocking and the asynchronous calls alike; a
    release refused so keeps its lease. Before, the client took it, fetch() timed out at once
    (CacheUnavailableError "did not answer within nan s") and release() dropped the lease as timed out, where
    fetch_sync raised ``socket.settimeout``'s ValueError and release_sync did too, having dropped the lease. None is
    no limit, as ``asyncio.timeout`` takes it."""
    connections: list[int] = []

    def scenario(peer: Peer) -> None:
        connections.append(1)
        _leases(peer)

    sock = tmp_path / "fake.sock"
    with pytest.raises(ValueError, match="timeout must be a number of seconds"):
        WCacheClient(sock, wait_for_daemon=0, timeout=math.nan)
    client = WCacheClient(sock, wait_for_daemon=0, timeout=10)
    with FakeDaemon(sock, scenario):
        with pytest.raises(ValueError, match="timeout must be a number of seconds"):
            client.fetch_sync(KEY, timeout=math.nan) if blocking else asyncio.run(client.fetch(KEY, timeout=math.nan))
        assert connections == []
        w = _fetch(client, KEY, blocking)
        with pytest.raises(ValueError, match="timeout must be a number of seconds"):
            w.release_sync(timeout=math.nan) if blocking else asyncio.run(w.release(timeout=math.nan))
        assert not w.released
        w.release_sync(timeout=None) if blocking else asyncio.run(w.release(timeout=None))  # None: no limit
        assert w.released


#: run in a child, an engine as it starts: wcache's client and its error tree imported (``wcache.nn`` imports it, as
#: does an engine catching WCacheError), nothing else of wcache, the default wait_for_daemon
_OUT_OF_DESCRIPTORS = """
import asyncio, os, resource, sys
from wcache import WCacheClient, WeightCacheKey
from wcache.errors import WCacheError

client = WCacheClient(sys.argv[1], timeout=3)
key = WeightCacheKey("0" * 32, "LlamaForCausalLM", 1, 0, "float32")
for blocking in (True, False):
    loop = asyncio.new_event_loop()  # its own descriptors taken before the limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
    taken = []
    try:
        while True:
            taken.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    try:
        client.fetch_sync(key) if blocking else loop.run_until_complete(client.fetch(key))
        result = "fetched"
    except WCacheError as exc:
        result = f"{type(exc).__name__}: {exc} {exc.details} {type(exc.__cause__).__name__} {exc.__cause__.errno}"
    except Exception as exc:
        result = f"escaped: {type(exc).__name__}: {exc}"
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        loop.close()
    print(result)
"""


def test_an_engine_out_of_descriptors_is_cache_unavailable_naming_the_socket(tmp_path: Path) -> None:
    """An engine at its descriptor limit (RLIMIT_NOFILE, every descriptor taken) fetches: ``socket()`` fails with
    EMFILE, and both fetches are CacheUnavailableError naming the socket and the errno, which the engine's fallback
    catches — with nothing more to import, as a process without descriptors cannot. Before, the socket was made
    outside the dial's ``try`` and the bare OSError escaped both fetches; the check for a daemon coming back
    (``wait_for_daemon``) imported its module first, which failed with EMFILE too."""
    import subprocess
    import sys

    sock = tmp_path / "wcache-rank0.sock"
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-c", _OUT_OF_DESCRIPTORS, str(sock)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    expected = (
        f"CacheUnavailableError: cannot open a socket to the wcache daemon at {sock} in this process: EMFILE "
        f"(Too many open files) {{'socket': '{sock}', 'errno': 'EMFILE'}} OSError {errno.EMFILE}"
    )
    assert (r.returncode, r.stdout.splitlines()) == (0, [expected, expected]), r.stderr[-2000:]


@pytest.mark.parametrize("how", ["release", "release_sync", "copy"])
def test_a_fatal_error_read_with_the_state_ends_the_lease_without_a_release(how: str, tmp_path: Path) -> None:
    """The daemon sends STATE and, in the same read, a fatal ERROR (it closes the connection: a stop, a limit):
    the lease ended with the connection. release() and release_sync() return, as for a daemon that is gone, and a
    copy-mode fetch keeps its copy. Before, the RELEASE they sent raised LocalProtocolError ("RELEASE frame not
    allowed in phase closed", blaming this end), and the copy-mode fetch failed after its copy was made."""
    import torch

    from wcache.error_codes import ErrorCode

    def scenario(peer: Peer) -> None:
        request = peer.opening()
        fd = memfd(4096, data=bytes(range(16)))
        gone = {
            "type": "ERROR",
            "id": 0,
            "code": int(ErrorCode.UNAVAILABLE),
            "message": "the daemon is stopping",
            "fatal": True,
            "details": {},
        }
        peer.send_frames([state(request, [memfd_slab(0, 16)], ONE), gone], [fd])
        os.close(fd)
        peer.hold()

    with FakeDaemon(tmp_path / "fake.sock", scenario):
        w = WCacheClient(tmp_path / "fake.sock", wait_for_daemon=0, timeout=10).fetch_sync(
            KEY, "copy" if how == "copy" else "zero_copy"
        )
        assert w["w"].view(torch.uint8).tolist() == list(range(16))
        if how == "release":
            asyncio.run(w.release())
        else:
            w.release_sync()
