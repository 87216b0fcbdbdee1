"""Prometheus text metrics, served on an optional loopback port (``--metrics-port``).

Counters and a fetch-latency histogram kept by the daemon; rendered in the Prometheus text
exposition format (version 0.0.4) at ``GET /metrics`` on 127.0.0.1 only. Rendered here rather than
by prometheus_client (docs/architecture.md, "Libraries"); tests/server/test_metrics.py checks the
text under that library's parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import Callable

__all__ = ["BUCKETS", "MAX_CONNECTIONS", "Metrics", "listen_metrics", "serve_metrics"]

#: fetch latency buckets (seconds), served side: GET_STATE decoded -> STATE sent
BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(v: float) -> str:
    """A sample value, exact: integral values as integers (byte counts, counters past six digits), others
    as the shortest repr that reads back to the same float — never ``{:g}``, which keeps six digits."""
    if isinstance(v, int):
        return str(v)
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


class Metrics:
    def __init__(self) -> None:
        self.fetches: Counter[str] = Counter()  # by mode
        self.releases = 0
        self.errors: Counter[str] = Counter()  # by ERROR code name
        self.connections_total = 0
        self.bucket_counts = [0] * len(BUCKETS)
        self.fetch_count = 0
        self.fetch_sum = 0.0
        #: fills from peers (docs/fleet.md): by outcome ("filled" / "failed") and reason, bytes and seconds filled
        self.fills: Counter[tuple[str, str]] = Counter()
        self.fill_bytes = 0
        self.fill_seconds = 0.0
        #: bytes granted to peer daemons' fills from this daemon's slabs (--peer-listen)
        self.peer_served_bytes = 0

    def observe_fill(self, reason: str, nbytes: int = 0, seconds: float = 0.0) -> None:
        """One fill: ``reason`` "" when it filled (``nbytes`` in ``seconds``), else the FillError's reason."""
        self.fills[("failed", reason) if reason else ("filled", "")] += 1
        self.fill_bytes += nbytes
        self.fill_seconds += seconds

    def observe_fetch(self, mode: str, seconds: float) -> None:
        self.fetches[mode] += 1
        self.fetch_count += 1
        self.fetch_sum += seconds
        for i, b in enumerate(BUCKETS):
            if seconds <= b:
                self.bucket_counts[i] += 1

    def render(
        self,
        *,
        resident: list[tuple[str, str, str, int]],  # (tier, key, key_id, bytes)
        leases: int,
        connections: int,
        uptime: float,
        load_seconds: float,
        kept: int | None = None,
    ) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{labels} {_value(value)}" for labels, value in samples)

        metric(
            "wcache_resident_bytes",
            "gauge",
            "Bytes of weights held, by tier (device, host or host_tier) and model key (key: readable, not unique; "
            "key_id: the whole key's digest, its host-tier entry name).",
            [(f'{{tier="{t}",key="{_label(k)}",key_id="{_label(i)}"}}', float(b)) for t, k, i, b in resident],
        )
        metric("wcache_leases", "gauge", "Live leases.", [("", float(leases))])
        if kept is not None:
            metric(
                "wcache_kept_models",
                "gauge",
                "Models of this daemon held by its wcache-keeper (--keeper): they survive a daemon crash.",
                [("", float(kept))],
            )
        metric("wcache_connections", "gauge", "Open client connections.", [("", float(connections))])
        metric("wcache_connections_total", "counter", "Connections accepted.", [("", float(self.connections_total))])
        metric(
            "wcache_fetches_total",
            "counter",
            "Leases granted (GET_STATE answered with STATE), by mode.",
            [(f'{{mode="{m}"}}', float(self.fetches[m])) for m in ("zero_copy", "copy")],
        )
        metric("wcache_releases_total", "counter", "Leases released by RELEASE.", [("", float(self.releases))])
        metric(
            "wcache_errors_total",
            "counter",
            "ERROR frames sent, by code.",
            [(f'{{code="{c}"}}', float(n)) for c, n in sorted(self.errors.items())],
        )
        cum = [(f'{{le="{b:g}"}}', float(n)) for b, n in zip(BUCKETS, self.bucket_counts)]
        cum.append(('{le="+Inf"}', float(self.fetch_count)))
        out.append("# HELP wcache_fetch_seconds Time from GET_STATE received to STATE sent.")
        out.append("# TYPE wcache_fetch_seconds histogram")
        out.extend(f"wcache_fetch_seconds_bucket{labels} {_value(value)}" for labels, value in cum)
        out.append(f"wcache_fetch_seconds_sum {_value(self.fetch_sum)}")
        out.append(f"wcache_fetch_seconds_count {self.fetch_count}")
        metric(
            "wcache_fills_total",
            "counter",
            "Fills from peer daemons (--fill-from), by outcome and the failure's reason (then loaded from disk).",
            [(f'{{outcome="{o}",reason="{_label(r)}"}}', float(n)) for (o, r), n in sorted(self.fills.items())],
        )
        metric("wcache_fill_bytes_total", "counter", "Bytes filled from peer daemons.", [("", float(self.fill_bytes))])
        metric(
            "wcache_fill_seconds_total",
            "counter",
            "Seconds spent filling from peer daemons.",
            [("", self.fill_seconds)],
        )
        metric(
            "wcache_peer_served_bytes_total",
            "counter",
            "Bytes this daemon's slabs served to peer daemons' fills (--peer-listen).",
            [("", float(self.peer_served_bytes))],
        )
        metric("wcache_uptime_seconds", "gauge", "Seconds since the daemon started serving.", [("", uptime)])
        metric("wcache_load_seconds", "gauge", "Seconds the weights took to load.", [("", load_seconds)])
        return "\n".join(out) + "\n"


#: metrics connections served at once; one beyond is closed as soon as it is accepted. They are few (a scraper
#: takes one), and each holds a descriptor of the daemon's reserve (``split_descriptors``' ``extra``)
MAX_CONNECTIONS = 16
#: seconds to read a whole request (request line and headers), and again to send the answer
REQUEST_TIMEOUT = 5.0
#: header lines (after the request line) and bytes (request line included) a request may have: a GET from a
#: scraper has a handful of short ones
MAX_HEADER_LINES = 64
MAX_HEADER_BYTES = 16 << 10


class _Refused(Exception):
    """A request the endpoint answers with ``status`` and then closes."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


def listen_metrics(port: int) -> socket.socket:
    """The endpoint's listening socket, 127.0.0.1:``port`` (OSError if that cannot be had: a port in use)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(MAX_CONNECTIONS)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """The request line, once the headers after it are read (and dropped); _Refused for a request too large or
    cut short. Lines are bounded by the reader's limit (ValueError past it: a line too long)."""
    try:
        line = await reader.readline()
        size, count = len(line), 0
        while True:
            header = await reader.readline()
            if not header.endswith(b"\n"):  # the peer closed mid-request
                raise _Refused("400 Bad Request")
            if header in (b"\r\n", b"\n"):
                return line
            size, count = size + len(header), count + 1
            if size > MAX_HEADER_BYTES or count > MAX_HEADER_LINES:
                raise _Refused("431 Request Header Fields Too Large")
    except (ValueError, asyncio.LimitOverrunError):  # a line past the reader's limit
        raise _Refused("431 Request Header Fields Too Large") from None
    except asyncio.IncompleteReadError:
        raise _Refused("400 Bad Request") from None


async def serve_metrics(
    sock: socket.socket,
    render: Callable[[], str],
    *,
    max_connections: int = MAX_CONNECTIONS,
    request_timeout: float = REQUEST_TIMEOUT,
) -> asyncio.AbstractServer:
    """HTTP on ``sock`` (``listen_metrics``: 127.0.0.1, the --metrics-port): ``GET /metrics`` -> the text
    format; anything else -> 404. Anyone on the machine may connect (docs/security.md, "Metrics"), so each
    connection is bounded: ``max_connections`` at once (one beyond is closed at once), ``request_timeout`` to
    send the whole request (then it is closed unanswered) and as long again to take the answer, and a request
    of at most MAX_HEADER_LINES headers and MAX_HEADER_BYTES (else 431), each line within that too."""
    active = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal active
        if active >= max_connections:
            writer.transport.abort()
            return
        active += 1
        try:
            try:
                async with asyncio.timeout(request_timeout):
                    line = await _read_request(reader)
            except _Refused as refused:
                body, head = (
                    f"{refused.status}\n".encode(),
                    f"HTTP/1.1 {refused.status}\r\nContent-Type: text/plain\r\n",
                )
            else:
                parts = line.decode("latin-1").split()
                if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                    body = render().encode()
                    head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                else:
                    body = b"not found\n"
                    head = "HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\n"
            writer.write(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await asyncio.wait_for(writer.drain(), request_timeout)
        except (TimeoutError, ConnectionError):
            writer.transport.abort()  # a peer that does not send or does not read: no lingering close
        finally:
            active -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), request_timeout)

    return await asyncio.start_server(handle, sock=sock, limit=MAX_HEADER_BYTES)
