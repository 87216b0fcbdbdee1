"""The /metrics text under the reference parser (tests/server/exposition.py): exact values, escaped labels, the
names and labels dashboards use, one series per resident model, and the parser check's own teeth on broken
renders. Then the endpoint itself, which anyone on the machine may connect to (docs/security.md, "Metrics"):
its connection cap, request deadline and size limits, and a port another process holds."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import resource
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import server_cmd, serving_here
from tests.server import exposition
from wcache import WCacheClient, WeightCacheKey
from wcache.plan.key import RankSpec
from wcache.server import metrics
from wcache.server.backends.host import HostBackend
from wcache.server.daemon import Daemon
from wcache.server.load import load_model
from wcache.server.metrics import (
    BUCKETS,
    MAX_CONNECTIONS,
    MAX_HEADER_LINES,
    Metrics,
    listen_metrics,
    serve_metrics,
)
from wcache.server.process import DaemonProcess
from wcache.server.store import Store
from wcache.server.tier import HostTier

#: a key label with each character the format escapes
ODD_KEY = 'Llama@ab12 "q"\\tp0\nx'
#: past six significant digits (an 8B model's bf16 slab), which ``{:g}`` would round
SLAB_BYTES = 16_060_522_496


def _metrics() -> Metrics:
    m = Metrics()
    for s in (0.0003, 0.0007, 0.004, 3.0):  # the last one above every finite bucket
        m.observe_fetch("zero_copy", s)
    m.observe_fetch("copy", 0.03)
    m.releases = 1_234_567
    m.connections_total = 7
    m.errors["KEY_MISMATCH"] += 2
    return m


def _render(m: Metrics, **kw: object) -> str:
    args: dict[str, object] = {
        "resident": [("host", ODD_KEY, "id1", SLAB_BYTES), ("host_tier", "plain", "plain", 4096)],
        "leases": 3,
        "connections": 2,
        "uptime": 123456.789,
        "load_seconds": 0.25,
        "kept": 1,
    }
    return m.render(**(args | kw))  # type: ignore[arg-type]


def test_render_parses_with_exact_values_and_escaped_labels() -> None:
    fam = exposition.parse(_render(_metrics()))
    v = exposition.value
    assert v(fam, "wcache_resident_bytes", tier="host", key=ODD_KEY, key_id="id1") == SLAB_BYTES
    assert v(fam, "wcache_resident_bytes", tier="host_tier", key="plain", key_id="plain") == 4096
    assert v(fam, "wcache_releases_total") == 1_234_567
    assert v(fam, "wcache_uptime_seconds") == 123456.789
    assert v(fam, "wcache_fetches_total", mode="zero_copy") == 4 and v(fam, "wcache_fetches_total", mode="copy") == 1
    assert v(fam, "wcache_errors_total", code="KEY_MISMATCH") == 2
    assert (v(fam, "wcache_leases"), v(fam, "wcache_connections"), v(fam, "wcache_kept_models")) == (3, 2, 1)
    assert v(fam, "wcache_connections_total") == 7
    buckets = {s.labels["le"]: s.value for s in fam["wcache_fetch_seconds"].samples if s.name.endswith("_bucket")}
    assert (buckets["0.0005"], buckets["0.001"], buckets["0.005"], buckets["0.05"], buckets["1"]) == (1, 2, 3, 4, 4)
    assert buckets["+Inf"] == v(fam, "wcache_fetch_seconds_count") == 5
    assert v(fam, "wcache_fetch_seconds_sum") == pytest.approx(3.035)


def test_the_names_and_labels_dashboards_use_stay() -> None:
    """Every name, kind and label set a dashboard may query (adding metrics is free; renaming is not)."""
    fam = exposition.parse(_render(_metrics()))
    used = {
        "wcache_resident_bytes": ("gauge", {"tier", "key", "key_id"}),
        "wcache_leases": ("gauge", set()),
        "wcache_kept_models": ("gauge", set()),
        "wcache_connections": ("gauge", set()),
        "wcache_connections_total": ("counter", set()),
        "wcache_fetches_total": ("counter", {"mode"}),
        "wcache_releases_total": ("counter", set()),
        "wcache_errors_total": ("counter", {"code"}),
        "wcache_fetch_seconds": ("histogram", {"le"}),
        "wcache_uptime_seconds": ("gauge", set()),
        "wcache_load_seconds": ("gauge", set()),
    }
    for name, (kind, labels) in used.items():
        assert fam[name].type == kind, name
        assert {k for s in fam[name].samples for k in s.labels} == labels, name
    les = [s.labels["le"] for s in fam["wcache_fetch_seconds"].samples if s.name.endswith("_bucket")]
    assert les == [f"{b:g}" for b in BUCKETS] + ["+Inf"]  # le="1", not "1.0": label values are matched as text
    assert "wcache_kept_models" not in exposition.parse(_render(Metrics(), kept=None))  # only with --keeper


def _drop_line(prefix: str) -> Callable[[str], str]:
    return lambda text: "".join(line for line in text.splitlines(keepends=True) if not line.startswith(prefix))


def _twice_line(prefix: str) -> Callable[[str], str]:
    return lambda text: "".join(line * (1 + line.startswith(prefix)) for line in text.splitlines(keepends=True))


@pytest.mark.parametrize(
    "breaks",
    [
        pytest.param(_drop_line('wcache_fetch_seconds_bucket{le="+Inf"}'), id="no-inf-bucket"),
        pytest.param(_drop_line("# TYPE wcache_leases"), id="no-type-line"),
        pytest.param(_drop_line("# HELP wcache_leases"), id="no-help-line"),
        pytest.param(lambda t: t.replace("wcache_releases_total", "wcache_releases"), id="counter-without-total"),
        pytest.param(lambda t: t.replace('{le="0.01"} 3', '{le="0.01"} 1'), id="buckets-not-cumulative"),
        pytest.param(lambda t: t.replace("wcache_fetch_seconds_count 5", "wcache_fetch_seconds_count 6"), id="count"),
        pytest.param(lambda t: t.replace("# TYPE wcache_leases gauge", "# TYPE wcache_leases summary"), id="kind"),
        pytest.param(lambda t: t + "wcache_leases 1\n", id="sample-outside-its-block"),
        pytest.param(lambda t: t.rstrip("\n"), id="no-final-newline"),
        pytest.param(_twice_line('wcache_resident_bytes{tier="host",'), id="one-series-twice"),
    ],
)
def test_the_parser_check_refuses_a_broken_render(breaks: Callable[[str], str]) -> None:
    good = _render(_metrics())
    exposition.parse(good)
    broken = breaks(good)
    assert broken != good
    with pytest.raises(ValueError):
        exposition.parse(broken)


def test_the_parser_check_refuses_unescaped_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "_label", lambda v: v)
    with pytest.raises(ValueError):
        exposition.parse(_render(_metrics()))


def test_every_resident_model_is_one_series_of_its_own(ckpt: Path, tmp_path: Path) -> None:
    """A checkpoint and its transformed variant have one ``key`` label (``key.short()`` leaves the transform out):
    each sample names its whole key too (``key_id``, the key's host-tier entry name), so the two are two series.
    Before, they were one series twice, and Prometheus kept one model's bytes."""
    backend = HostBackend()
    plain = load_model(RankSpec(ckpt), backend=backend, threads=2)
    fused = load_model(RankSpec(ckpt, transform="wcache.transforms:fuse_llama_qkv_gate_up"), backend=backend)
    store = Store(backend, [plain, fused])
    try:
        assert plain.key.short() == fused.key.short()
        fam = exposition.parse(Daemon(store, tmp_path / "wcache.sock", software="wcache/test").render_metrics())
        for m in (plain, fused):
            labels = {"tier": "host", "key": m.key.short(), "key_id": HostTier.entry_id(m.key)}
            assert exposition.value(fam, "wcache_resident_bytes", **labels) == m.slab_bytes
    finally:
        store.close()


# ---------------------------------------------------------------- the endpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _answer(r: asyncio.StreamReader, timeout: float = 10) -> bytes:
    """What the endpoint sent before it closed (a reset after the answer counts as the close)."""
    got = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await asyncio.wait_for(r.read(65536), timeout):
            got += chunk
    return got


async def test_a_request_sent_slowly_is_closed_at_the_whole_requests_deadline() -> None:
    """A header line every 0.4 s, each well inside the deadline: the request as a whole gets ``request_timeout``
    (1 s here, 5 by default), then the connection closes unanswered. Before, each line had its own 5 s, and a
    line every 3 s held the connection (and a daemon descriptor) for ever."""
    port = _free_port()
    srv = await serve_metrics(listen_metrics(port), lambda: "x 1\n", request_timeout=1.0)
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /metrics HTTP/1.1\r\n")
        t0 = time.monotonic()
        with contextlib.suppress(ConnectionError):
            for _ in range(10):
                await asyncio.sleep(0.4)
                w.write(b"X-a: b\r\n")
                await w.drain()
            w.write(b"\r\n")
            await w.drain()
        got = await _answer(r)
        closed = time.monotonic() - t0
        w.close()
        assert got == b"" and closed < 3.5, f"answered {got[:40]!r} after {closed:.1f} s of headers"
    finally:
        srv.close()


async def test_a_request_with_too_many_headers_is_answered_431() -> None:
    port = _free_port()
    srv = await serve_metrics(listen_metrics(port), lambda: "x 1\n")
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /metrics HTTP/1.1\r\n" + b"X-a: b\r\n" * (MAX_HEADER_LINES + 1) + b"\r\n")
        await w.drain()
        got = await _answer(r)
        w.close()
        assert got.startswith(b"HTTP/1.1 431 "), got[:60]
    finally:
        srv.close()


@pytest.mark.parametrize("where", ["request line", "header line"])
async def test_a_line_over_the_read_limit_is_answered_431_without_a_traceback(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A line past the stream reader's limit (asyncio raises ValueError from readline): before, the handler did
    not catch it — a traceback in the daemon's log per request, which anyone on the machine could repeat, and no
    answer. Now 431, then the connection closes, and nothing is logged."""
    caplog.set_level(logging.DEBUG)
    port = _free_port()
    srv = await serve_metrics(listen_metrics(port), lambda: "x 1\n")
    long = b"a" * 100_000
    request = (
        b"GET /" + long + b" HTTP/1.1\r\n\r\n"
        if where == "request line"
        else b"GET /metrics HTTP/1.1\r\nX-a: " + long + b"\r\n\r\n"
    )
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        with contextlib.suppress(ConnectionError):
            w.write(request)
            await w.drain()
        got = await _answer(r)
        w.close()
        await asyncio.sleep(0.2)
    finally:
        srv.close()
    tracebacks = [rec for rec in caplog.records if rec.exc_info]
    assert not tracebacks, f"{len(tracebacks)} traceback(s) logged: {tracebacks[0].getMessage()!r}"
    assert got.startswith(b"HTTP/1.1 431 "), got[:60]


async def test_metrics_connections_past_the_cap_are_closed_at_once() -> None:
    """MAX_CONNECTIONS connections each holding a request half-sent: the next ones are closed as soon as they
    are accepted (each would hold a descriptor of the daemon's), and those under the cap are still served."""
    port = _free_port()
    srv = await serve_metrics(listen_metrics(port), lambda: "x 1\n")
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(MAX_CONNECTIONS):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /metrics HTTP/1.1\r\n")
            held.append((r, w))
        await asyncio.sleep(0.2)  # all of them accepted
        for _ in range(4):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.monotonic()
            got = await _answer(r, 3)
            w.close()
            assert got == b"" and time.monotonic() - t0 < 1, "a connection past the cap was kept"
        r, w = held[0]
        w.write(b"\r\n")
        assert (await _answer(r)).startswith(b"HTTP/1.1 200 ")
    finally:
        for _, w in held:
            w.close()
        srv.close()


NOFILE = 256


def test_metrics_connections_leave_engines_their_descriptors(
    daemon_factory: Callable[..., DaemonProcess], ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon with RLIMIT_NOFILE 256 (the same holds at any limit): another local user opens 300 connections to
    its metrics port and keeps each one alive with a header line every 2 s. An engine's fetch still succeeds,
    and the daemon never runs out of descriptors to accept with (no "accept failed" line). Before, every
    connection held a descriptor: the engine's fetch failed, and the accept loop logged EMFILE 10 times a second
    (split_descriptors keeps engines their share only against the descriptors it knows of)."""

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))

    monkeypatch.setattr(
        "wcache.server.process.subprocess.Popen", functools.partial(subprocess.Popen, preexec_fn=limited)
    )
    port = _free_port()
    d = daemon_factory(ckpt, "--metrics-port", str(port))
    key = WeightCacheKey.from_checkpoint(ckpt)

    async def fetch() -> None:
        async with await WCacheClient(d.socket).fetch(key):
            pass

    held: list[socket.socket] = []
    stop = threading.Event()

    def keep_alive() -> None:
        while not stop.wait(2.0):
            for s in held:
                with contextlib.suppress(OSError):
                    s.sendall(b"X-a: b\r\n")

    keeper = threading.Thread(target=keep_alive, daemon=True)
    try:
        for _ in range(NOFILE + 44):
            s = socket.create_connection(("127.0.0.1", port))
            with contextlib.suppress(OSError):
                s.sendall(b"GET /metrics HTTP/1.1\r\n")
            held.append(s)
        keeper.start()
        time.sleep(1.0)  # the daemon accepts them
        asyncio.run(asyncio.wait_for(fetch(), 10))
    finally:
        stop.set()
        if keeper.is_alive():
            keeper.join()
        for s in held:
            s.close()
    failed = [line for line in d.log_text().splitlines() if "accept failed" in line or "Too many open" in line]
    assert not failed, f"{len(failed)} lines like {failed[-1]}"


def test_a_metrics_port_in_use_fails_the_start_before_the_load(ckpt: Path, socket_dir: Path) -> None:
    """Any local user may bind 127.0.0.1:PORT first. The daemon binds --metrics-port right after its lock, before
    it reads a checkpoint byte: one line naming the option, exit 1, nothing loaded. Before, it bound the port
    after the load, and died of an uncaught OSError without ever serving its socket."""
    with socket.socket() as squat:
        squat.bind(("127.0.0.1", 0))
        squat.listen()
        port = squat.getsockname()[1]
        out = subprocess.run(
            server_cmd("--model", str(ckpt), "--socket-dir", str(socket_dir), "--metrics-port", str(port)),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if "error" in x.lower()]
    assert line.startswith("wcache-server: error: --metrics-port ") and "in use" in line, line
    assert "loaded" not in out.stderr and " ready " not in out.stderr, out.stderr


async def test_a_daemon_that_cannot_bind_its_metrics_port_serves_without_it(
    ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon binds --metrics-port once serving where it could not before the load (after a --takeover the
    old daemon holds it until it stops): it tries while the port is in use, then logs one line and serves on."""
    caplog.set_level(logging.INFO, logger="wcache.server")
    store = Store(HostBackend(), [load_model(RankSpec(ckpt), backend=HostBackend())])
    with socket.socket() as squat:
        squat.bind(("127.0.0.1", 0))
        squat.listen()
        port = squat.getsockname()[1]
        d = Daemon(store, tmp_path / "wcache.sock", software="wcache/test", metrics_port=port, metrics_wait=0.3)
        try:
            async with serving_here(d):
                await asyncio.sleep(0.8)
                assert (await WCacheClient(d.socket_path).status()).models
        finally:
            store.close()
    (line,) = [rec.getMessage() for rec in caplog.records if "metrics" in rec.getMessage()]
    assert f"--metrics-port {port}" in line and "serving without metrics" in line, line
    assert not [rec for rec in caplog.records if rec.exc_info]
