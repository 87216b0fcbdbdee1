"""The peer channel's byte mover: a TCP socket, TLS optional, and a sans-I/O Connection (docs/protocol.md §10.1).

:class:`StreamChannel` is a :class:`~wcache.channel.Channel` (the same ``receive`` loop, frame deadline and read
budget) whose bytes go through TLS done sans-I/O — an ``ssl.SSLObject`` over two memory BIOs, driven by the
non-blocking socket — so that the server shell serves it exactly like a Unix socket's channel, and no
descriptor ever travels (a peer channel carries none: a frame announcing one is a protocol error). Plain TCP
(loopback only, docs/security.md) skips the TLS layer.

:func:`connect_peer` is the target's side: TCP connect, TLS handshake, HELLO, and in the shared-secret mode the
proofs of §10.2, each within the deadline.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

from wcache.channel import Channel, ReadBudget, expect
from wcache.errors import CacheUnavailableError, PermissionDeniedError
from wcache.proto import PROTOCOL_VERSION, Connection, Hello, HelloOk, Role, Service
from wcache.proto.fleet_frames import PeerAuthOk, PeerChallenge
from wcache.server.peer_auth import PeerSecurity, SecretClient

__all__ = ["GRANT_SECONDS", "MIN_GRANT", "StreamChannel", "connect_peer", "parse_address"]

RECV_SIZE = 1 << 18

#: the grain of a source's rate cap (docs/fleet.md, "Bandwidth policy"): a target asks a capped source for at
#: most this many seconds of its ``max_rate`` per PEER_READ, and the source's cap lends at most as much to a
#: grant answered or asked for late, so the cap is reached and never exceeded by more than that over any window
GRANT_SECONDS = 0.01
#: a capped source (PEER_OFFER's ``max_rate``) is asked for GRANT_SECONDS of its rate per PEER_READ, never less
#: than this many bytes: what the target READs then follows the cap at that grain, not in bursts of a whole
#: batch; the source refuses more (docs/protocol.md §10.3)
MIN_GRANT = 64 << 10
#: how long a side that refused the TLS handshake waits for the other to close after telling it why (its alert, or
#: a peer without TLS a plaintext ERROR): a socket closed with unread bytes sends a reset, which may overtake them
REFUSAL_SECONDS = 1.0
#: the first byte of a TLS handshake record (a ClientHello): a peer whose first byte is another spoke no TLS
TLS_HANDSHAKE_RECORD = 0x16


class StreamChannel(Channel[Connection]):
    """A Channel over a TCP socket, through TLS when ``context`` is given (``handshake()`` first)."""

    def __init__(
        self,
        sock: socket.socket,
        conn: Connection,
        *,
        context: ssl.SSLContext | None = None,
        server_side: bool = False,
        budget: ReadBudget | None = None,
        send_timeout: float | None = None,
        max_unread_fds: int | None = None,
    ) -> None:
        super().__init__(sock, conn, budget=budget, send_timeout=send_timeout, max_unread_fds=None)
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self.tls = context.wrap_bio(self._in, self._out, server_side=server_side) if context is not None else None
        self.server_side = server_side
        self._eof = False
        self._first: int | None = None  # the first byte the peer sent during the handshake

    # ---------------------------------------------------------------- TLS
    async def handshake(self) -> None:
        """Run the TLS handshake (ssl.SSLError when the peer's certificate or ours is refused). A refusal is told
        to the other side before the error is raised (``_refuse``): it was not — the alert TLS queued stayed in
        the outgoing buffer — and a target whose certificate the source refused saw a bare close (its fill's
        reason ``transfer``, not ``auth``)."""
        if self.tls is None:
            return
        try:
            while True:
                try:
                    self.tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await self._flush()
                    await self._fill()
        except ssl.SSLError:
            await self._refuse()
            raise
        await self._flush()

    async def _refuse(self) -> None:
        """After a failed handshake, best effort within REFUSAL_SECONDS: send the alert TLS queued (naming why:
        an unknown CA, an expired certificate, none presented), or — the source, to a peer that spoke no TLS at
        all, for which OpenSSL queues none — a plaintext fatal ERROR PERMISSION_DENIED saying that this channel
        is TLS; then end our side and read until the peer closes, so that no reset overtakes what was sent."""
        try:
            async with asyncio.timeout(REFUSAL_SECONDS):
                if self._out.pending:
                    await self._flush()
                elif self.server_side and self._first is not None and self._first != TLS_HANDSHAKE_RECORD:
                    why = PermissionDeniedError(
                        "this daemon's peer channel is TLS (mutual TLS or a shared secret): a peer started without "
                        "--peer-cert/--peer-key/--peer-ca or --peer-secret-file is refused",
                        details={"reason": "tls"},
                    )
                    await self._send_all(self.conn.fatal_error(why))
                self.sock.shutdown(socket.SHUT_WR)
                while True:
                    try:
                        if not self.sock.recv(RECV_SIZE):
                            return
                    except (BlockingIOError, InterruptedError):
                        await self._wait(writable=False)
        except (OSError, TimeoutError, CacheUnavailableError):
            pass  # the peer is gone, or holds its end open: it was told what could be told

    def peer_certificate(self) -> bytes:
        """The DER bytes of the certificate the other end presented (b"" without TLS or certificate)."""
        if self.tls is None:
            return b""
        return self.tls.getpeercert(binary_form=True) or b""

    async def _fill(self) -> None:
        """Read what the socket has into the TLS input (waiting until it has something); EOF is an error here."""
        while True:
            try:
                data = self.sock.recv(RECV_SIZE)
                break
            except (BlockingIOError, InterruptedError):
                await self._wait(writable=False)
        if not data:
            raise ConnectionError("the peer closed the connection during the TLS handshake")
        if self._first is None:
            self._first = data[0]
        self._in.write(data)

    async def _flush(self) -> None:
        """Send everything TLS has queued."""
        while self._out.pending:
            await self._send_all(self._out.read())

    async def _send_all(self, data: bytes) -> None:
        """Write ``data`` to the socket, waiting whenever it is full."""
        view = memoryview(data)
        while view:
            try:
                n = self.sock.send(view)
            except (BlockingIOError, InterruptedError):
                await self._wait(writable=True)
                continue
            view = view[n:]

    # ---------------------------------------------------------------- Channel's two byte movers
    def _recv_once(self) -> None:
        """One read into the connection (b'' marks EOF); BlockingIOError when there is nothing yet."""
        limit = min(RECV_SIZE, self.conn.frame_limit + 4)
        if self.tls is None:
            self.conn.receive_data(self.sock.recv(limit))
            return
        while True:
            try:
                data = self.tls.read(limit)
            except ssl.SSLWantReadError:
                if self._eof:
                    raise ConnectionError("the peer closed the connection inside a TLS record") from None
                raw = self.sock.recv(RECV_SIZE)  # BlockingIOError: wait, as Channel does
                if not raw:
                    self._eof = True
                    self._in.write_eof()
                else:
                    self._in.write(raw)
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                data = b""
            self.conn.receive_data(data)
            return

    async def _send_bytes(self, data: bytes, fds: list[int] | tuple[int, ...]) -> None:
        if fds:
            raise ValueError("a peer channel carries no file descriptors")
        if self.tls is None:
            await self._send_all(data)
        else:
            self.tls.write(data)
            await self._flush()
        self._sent += len(data)


def parse_address(text: str, *, listen: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` (ValueError otherwise); port 0 (any free one) only to ``listen``."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if listen else 1) <= int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


async def connect_peer(
    host: str, port: int, security: PeerSecurity, *, timeout: float, software: str, name: str = ""
) -> tuple[StreamChannel, HelloOk]:
    """The target's connection to a source: TCP, TLS, HELLO, and the shared-secret proofs (§10.2), all within
    ``timeout``. CacheUnavailableError when nothing answers, or the peer stops answering within ``timeout``
    (``details``: ``peer``, ``phase``: where it stopped); PermissionDeniedError when the authentication
    fails: TLS refused either way (``details.reason`` ``"tls"``, the message naming why: the alert the source
    sent, or what was wrong with its certificate), a peer that speaks no TLS or refuses ours for speaking none,
    or a proof that failed (the source's, checked here, or ours, refused there)."""
    security.check_peer(host)
    loop = asyncio.get_running_loop()
    phase = "connecting"
    try:
        async with asyncio.timeout(timeout):
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise CacheUnavailableError(f"peer {host}:{port}: {exc}") from exc
            family, kind, proto, _, addr = infos[0]
            sock = socket.socket(family, kind | socket.SOCK_CLOEXEC, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, addr)
            except OSError as exc:
                sock.close()
                raise CacheUnavailableError(f"no wcache peer at {host}:{port}: {exc.strerror or exc}") from exc
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth = security.mode == "secret"
            conn = Connection(Role.CLIENT, service=Service.PEER, auth=auth)
            context = security.client_context()
            ch = StreamChannel(sock, conn, context=context, server_side=False)
            try:
                phase = "the TLS handshake" if context is not None else "HELLO"
                await ch.handshake()
                phase = "HELLO"
                await ch.send(Hello(versions=(PROTOCOL_VERSION,), software=software, name=name))
                hello, _ = await expect(ch)
                assert isinstance(hello, HelloOk)
                if auth:
                    phase = "the shared-secret proofs"
                    client = SecretClient(security.secret, ch.peer_certificate())
                    await ch.send(client.start(conn.next_request_id()))
                    ch_frame, _ = await expect(ch)
                    assert isinstance(ch_frame, PeerChallenge)
                    await ch.send(client.challenged(ch_frame, conn.next_request_id()))
                    ok, _ = await expect(ch)
                    assert isinstance(ok, PeerAuthOk)
            except ssl.SSLError as exc:  # in TLS 1.3 the source's refusal of our certificate comes after the handshake
                ch.close()
                raise tls_refused(f"{host}:{port}", exc) from exc
            except BaseException:
                ch.close()
                raise
    except TimeoutError:  # asyncio.timeout's, bare: the peer named, and where it stopped answering
        raise CacheUnavailableError(
            f"peer {host}:{port} did not answer within {timeout:g} s ({phase})",
            details={"peer": f"{host}:{port}", "phase": phase},
        ) from None
    return ch, hello


def tls_refused(addr: str, exc: ssl.SSLError) -> PermissionDeniedError:
    """The TLS failure ``exc`` with the peer at ``addr``, as the authentication failure it is (reason ``tls``)."""
    reason = exc.reason or ""
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = f"its certificate is not one this daemon accepts: {exc.verify_message}"
    elif "ALERT" in reason:  # what the peer's alert says: tlsv1 alert unknown ca, sslv3 alert certificate expired
        why = f"it refused this daemon's TLS handshake ({reason.lower().replace('_', ' ')})"
    elif reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"):
        why = f"it does not speak TLS ({reason}): a peer channel without authentication, on loopback only"
    else:
        why = f"TLS failed: {exc}"
    return PermissionDeniedError(f"peer {addr}: {why}", details={"reason": "tls"})
