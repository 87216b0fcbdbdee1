"""Authentication of the peer channel (wcache/server/peer_auth.py, docs/protocol.md §10.1-10.2): mutual TLS
admits only certificates of the fleet's CA; the shared-secret mode proves the secret both ways over TLS,
bound to the source's certificate, so a wrong secret and a man in the middle are refused before any request;
an unauthenticated channel listens on loopback only."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from wcache.error_codes import ErrorCode
from wcache.errors import PermissionDeniedError
from wcache.proto import Connection, DeviceInfo, ErrorFrame, Hello, PeerAuthOk, PeerChallenge, Phase, Role, Service
from wcache.proto.fleet_frames import PeerAuth, PeerProof
from wcache.server.peer_auth import PeerSecurity, SecretClient, SecretServer, proof, read_secret

pytest.importorskip("cryptography", reason="the fleet extra (pip install -e '.[fleet]') is not installed")


def make_ca(d: Path, name: str) -> Path:
    """A CA (``name``-ca.pem) and one certificate + key it signed (``name``-cert.pem, ``name``-key.pem), and one
    that expired yesterday (``name``-expired-cert.pem, ``name``-expired-key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(
        subject: str,
        key: ec.EllipticCurvePrivateKey,
        issuer: str,
        signer: ec.EllipticCurvePrivateKey,
        ca: bool,
        until: datetime.datetime = now + datetime.timedelta(days=1),
    ) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(min(now, until) - datetime.timedelta(days=2))
            .not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if ca:
            b = b.add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = cert(f"{name} CA", ca_key, f"{name} CA", ca_key, True)
    pem = serialization.Encoding.PEM
    (d / f"{name}-ca.pem").write_bytes(ca_cert.public_bytes(pem))
    for stem, until in (
        (name, now + datetime.timedelta(days=1)),
        (f"{name}-expired", now - datetime.timedelta(days=1)),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = cert(f"{stem} daemon", key, f"{name} CA", ca_key, False, until)
        (d / f"{stem}-cert.pem").write_bytes(leaf.public_bytes(pem))
        (d / f"{stem}-key.pem").write_bytes(
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
    return d


def mtls(d: Path, cert_of: str, ca_of: str) -> PeerSecurity:
    return PeerSecurity.configure(
        cert=d / f"{cert_of}-cert.pem", key=d / f"{cert_of}-key.pem", ca=d / f"{ca_of}-ca.pem", secret_file=None
    )


def secret(d: Path, value: bytes, name: str = "secret") -> PeerSecurity:
    p = d / name
    p.write_bytes(value + b"\n")
    p.chmod(0o600)
    return PeerSecurity.configure(cert=None, key=None, ca=None, secret_file=p)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(ctx: ssl.SSLContext | None, handler: Handler) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=ctx)
    return server, server.sockets[0].getsockname()[1]


@asynccontextmanager
async def peer_listener(sec: PeerSecurity) -> AsyncIterator[int]:
    """The source's peer channel (the server shell, ``StreamChannel``, ``PeerTls``) holding nothing: its port."""
    from wcache.server.backends.host import HostBackend
    from wcache.server.peer import PeerListener, PeerService
    from wcache.server.store import Store

    svc = PeerService(Store(HostBackend()), sec, software="wcache/test")
    listener = PeerListener(svc, "127.0.0.1", 0)
    _, port = listener.start()
    try:
        yield port
    finally:
        await listener.stop()
        svc.store.close()


async def _connect(port: int, sec: PeerSecurity) -> str:
    """'admitted', or the PermissionDeniedError's ``details.reason`` and message (any other error propagates)."""
    from wcache.server.peer_channel import connect_peer

    try:
        ch, _ = await connect_peer("127.0.0.1", port, sec, timeout=10, software="wcache/test")
    except PermissionDeniedError as exc:
        return f"{exc.details.get('reason')}: {exc.message}"
    ch.close()
    return "admitted"


async def test_mutual_tls_admits_only_the_fleets_certificates(tmp_path: Path) -> None:
    """Over the peer channel itself: only certificates of the fleet's CA, both ways. A refusal reaches the target as
    PermissionDeniedError (a fill's reason ``auth``) naming why: the source flushes the TLS alert it queued (it
    did not: the target saw a bare close, which it took for a transfer failure), and tells a peer that spoke no
    TLS so in a plaintext ERROR."""
    make_ca(tmp_path, "fleet")
    make_ca(tmp_path, "other")
    fleet = mtls(tmp_path, "fleet", "fleet")
    async with peer_listener(fleet) as port:
        assert await _connect(port, fleet) == "admitted"
        # a target whose certificate another CA signed, an expired one, none (the shared-secret mode), no TLS
        got = await _connect(port, mtls(tmp_path, "other", "fleet"))
        assert got.startswith("tls: ") and "unknown ca" in got
        got = await _connect(port, mtls(tmp_path, "fleet-expired", "fleet"))
        assert got.startswith("tls: ") and "certificate expired" in got
        got = await _connect(port, secret(tmp_path, b"correct horse battery staple 42"))
        assert got.startswith("tls: ") and "certificate required" in got
        got = await _connect(port, PeerSecurity.configure(cert=None, key=None, ca=None, secret_file=None))
        assert got.startswith("tls: ") and "peer channel is TLS" in got
        assert await _connect(port, fleet) == "admitted"  # the source serves on
    # a source the target's CA did not sign, and one that speaks no TLS
    async with peer_listener(mtls(tmp_path, "other", "other")) as port:
        got = await _connect(port, fleet)
        assert got.startswith("tls: ") and "not one this daemon accepts" in got
    async with peer_listener(PeerSecurity.configure(cert=None, key=None, ca=None, secret_file=None)) as port:
        got = await _connect(port, fleet)
        assert got.startswith("tls: ") and "does not speak TLS" in got


# --------------------------------------------------------------------------- shared secret, over the frames


async def _send(w: asyncio.StreamWriter, data: bytes) -> None:
    w.write(data)
    await w.drain()


async def _next(r: asyncio.StreamReader, conn: Connection) -> object:
    while True:
        for frame in conn.events():
            return frame
        data = await asyncio.wait_for(r.read(65536), 10)
        conn.receive_data(data)
        if not data:
            raise EOFError


def _source(sec: PeerSecurity, outcome: list[str]) -> Handler:
    """A source's side of the handshake and the proofs (what the peer service does before any request)."""

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conn = Connection(Role.SERVER, service=Service.PEER, auth=True)
        server = SecretServer(sec.secret, sec.own_certificate)
        try:
            hello = await _next(r, conn)
            assert isinstance(hello, Hello)
            await _send(w, conn.send(conn.hello_reply(hello, software="t", backend="host", device=DeviceInfo("cpu"))))
            req = await _next(r, conn)
            assert isinstance(req, PeerAuth)
            await _send(w, conn.send(server.challenge(req)))
            pr = await _next(r, conn)
            assert isinstance(pr, PeerProof)
            try:
                ok = server.check(pr)
            except PermissionDeniedError as exc:
                await _send(w, conn.fatal_error(exc, pr.id))
                outcome.append("denied")
                return
            await _send(w, conn.send(ok))
            outcome.append(conn.phase.value)
        except (EOFError, ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            outcome.append("closed")
        finally:
            w.close()

    return handle


async def _target(port: int, sec: PeerSecurity) -> str:
    """The target's side: 'open' when both proofs passed, else what refused it."""
    r, w = await asyncio.open_connection("127.0.0.1", port, ssl=sec.client_context())
    try:
        conn = Connection(Role.CLIENT, service=Service.PEER, auth=True)
        sslobj = w.get_extra_info("ssl_object")
        client = SecretClient(sec.secret, sslobj.getpeercert(binary_form=True))
        await _send(w, conn.send(Hello(versions=(2,))))
        await _next(r, conn)
        await _send(w, conn.send(client.start(1)))
        ch = await _next(r, conn)
        assert isinstance(ch, PeerChallenge)
        try:
            pr = client.challenged(ch, 2)
        except PermissionDeniedError:
            return "source-refused"
        await _send(w, conn.send(pr))
        reply = await _next(r, conn)
        if isinstance(reply, ErrorFrame):
            return f"denied:{reply.details.get('reason')}"
        assert isinstance(reply, PeerAuthOk) and conn.phase is Phase.OPEN
        return "open"
    finally:
        w.close()


async def _secret_run(server_sec: PeerSecurity, client_sec: PeerSecurity) -> tuple[str, list[str]]:
    outcome: list[str] = []
    src = server_sec.with_own_certificate()
    server, port = await _serve(src.server_context(), _source(src, outcome))
    try:
        return await asyncio.wait_for(_target(port, client_sec), 20), outcome
    finally:
        server.close()
        await server.wait_closed()


async def test_the_shared_secret_is_proved_both_ways(tmp_path: Path) -> None:
    good = secret(tmp_path, b"correct horse battery staple 42")
    assert await _secret_run(good, good) == ("open", ["open"])
    wrong = secret(tmp_path, b"another fleet's secret, 32 bytes", "wrong")
    got, _ = await _secret_run(good, wrong)
    assert got == "source-refused"  # the target checks the source first: it sends no proof to an impostor


async def test_a_target_without_the_secret_is_refused_with_permission_denied(tmp_path: Path) -> None:
    good = secret(tmp_path, b"correct horse battery staple 42")
    src = good.with_own_certificate()
    outcome: list[str] = []
    server, port = await _serve(src.server_context(), _source(src, outcome))
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port, ssl=good.client_context())
        conn = Connection(Role.CLIENT, service=Service.PEER, auth=True)
        await _send(w, conn.send(Hello(versions=(2,))))
        await _next(r, conn)
        await _send(w, conn.send(PeerAuth(id=1, nonce=bytes(32))))
        await _next(r, conn)  # a liar ignores the challenge and sends any proof
        await _send(w, conn.send(PeerProof(id=2, proof=bytes(32))))
        err = await _next(r, conn)
        assert isinstance(err, ErrorFrame) and err.fatal and err.details == {"reason": "secret"}
        w.close()
    finally:
        server.close()
        await server.wait_closed()
    assert outcome == ["denied"]


async def test_a_man_in_the_middle_fails_both_proofs(tmp_path: Path) -> None:
    """A relay that knows no secret terminates TLS with its own certificate and forwards every byte: the target
    binds the proofs to the relay's certificate, the source to its own, so the source's proof fails at the
    target (which then sends none)."""
    good = secret(tmp_path, b"correct horse battery staple 42")
    src = good.with_own_certificate()
    outcome: list[str] = []
    real, real_port = await _serve(src.server_context(), _source(src, outcome))
    relay_sec = secret(tmp_path, b"the relay does not know it, 32b!", "relay").with_own_certificate()

    async def relay(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", real_port, ssl=good.client_context())

        async def pipe(a: asyncio.StreamReader, b: asyncio.StreamWriter) -> None:
            try:
                while data := await a.read(65536):
                    b.write(data)
                    await b.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                b.close()

        await asyncio.gather(pipe(r, uw), pipe(ur, w))

    mitm, mitm_port = await _serve(relay_sec.server_context(), relay)
    try:
        assert await asyncio.wait_for(_target(mitm_port, good), 20) == "source-refused"
    finally:
        for s in (mitm, real):
            s.close()
            await s.wait_closed()


def test_one_proof_per_connection() -> None:
    """After a wrong proof, nothing on that connection can prove the secret any more (no online guessing)."""
    server = SecretServer(b"s" * 32, b"cert")
    ch = server.challenge(PeerAuth(id=1, nonce=bytes(32)))
    with pytest.raises(PermissionDeniedError):
        server.check(PeerProof(id=2, proof=bytes(32)))
    right = proof(b"s" * 32, "client", hashlib.sha256(b"cert").digest(), bytes(32), ch.nonce)
    with pytest.raises(PermissionDeniedError):
        server.check(PeerProof(id=3, proof=right))  # even the right proof, now
    with pytest.raises(PermissionDeniedError):
        server.challenge(PeerAuth(id=4, nonce=bytes(32)))


def test_proofs_are_bound_to_side_certificate_and_nonces() -> None:
    base = proof(b"k" * 16, "server", b"c" * 32, b"n" * 32, b"m" * 32)
    assert len(base) == 32
    for other in (
        proof(b"k" * 16, "client", b"c" * 32, b"n" * 32, b"m" * 32),
        proof(b"k" * 16, "server", b"d" * 32, b"n" * 32, b"m" * 32),
        proof(b"k" * 16, "server", b"c" * 32, b"o" * 32, b"m" * 32),
        proof(b"j" * 16, "server", b"c" * 32, b"n" * 32, b"m" * 32),
    ):
        assert other != base


# --------------------------------------------------------------------------- configuration


def test_unauthenticated_listening_only_on_loopback(tmp_path: Path) -> None:
    none = PeerSecurity.configure(cert=None, key=None, ca=None, secret_file=None)
    none.check_listen("127.0.0.1")
    none.check_listen("::1")
    none.check_listen("localhost")
    for host in ("0.0.0.0", "10.1.2.3", "::"):
        with pytest.raises(ValueError, match="without authentication"):
            none.check_listen(host)
    secret(tmp_path, b"x" * 32).check_listen("0.0.0.0")
    none.check_peer("127.0.0.1")
    with pytest.raises(PermissionDeniedError, match="without authentication"):
        none.check_peer("10.1.2.3")  # a target trusts what it reads: not from an unproven peer
    secret(tmp_path, b"x" * 32).check_peer("10.1.2.3")


def test_secret_files_must_be_private_and_long_enough(tmp_path: Path) -> None:
    p = tmp_path / "s"
    p.write_bytes(b"y" * 32)
    p.chmod(0o640)
    with pytest.raises(ValueError, match="chmod 600"):
        read_secret(p)
    p.chmod(0o600)
    assert read_secret(p) == b"y" * 32
    p.write_bytes(b"short\n")
    with pytest.raises(ValueError, match="at least 16"):
        read_secret(p)
    with pytest.raises(ValueError, match="two modes"):
        PeerSecurity.configure(cert=p, key=None, ca=None, secret_file=p)
    with pytest.raises(ValueError, match="all of"):
        PeerSecurity.configure(cert=p, key=None, ca=None, secret_file=None)


async def test_a_second_peer_auth_ends_the_connection(tmp_path: Path) -> None:
    """One challenge per connection; the source's refusal of a second PEER_AUTH is fatal, as a wrong proof's is
    (docs/protocol.md §10.2): it was not, and a peer without the secret that sent PEER_AUTH every 20 s held its
    connection past the idle deadline of one that says nothing."""
    from wcache.server.backends.host import HostBackend
    from wcache.server.peer import PeerService
    from wcache.server.service import Context
    from wcache.server.store import Store

    secret = tmp_path / "secret"
    secret.write_bytes(b"the fleet's secret, 32 bytes ok!")
    secret.chmod(0o600)
    sec = PeerSecurity.configure(cert=None, key=None, ca=None, secret_file=secret)
    store = Store(HostBackend())
    svc = PeerService(store, sec, software="wcache/test")
    try:
        ctx = Context(1)
        assert isinstance(await svc.handle(PeerAuth(id=1, nonce=bytes(32)), [], ctx), PeerChallenge)
        again = await svc.handle(PeerAuth(id=2, nonce=bytes(32)), [], ctx)
        assert isinstance(again, ErrorFrame) and again.fatal and again.code == ErrorCode.PERMISSION_DENIED
    finally:
        svc.close()
        store.close()
