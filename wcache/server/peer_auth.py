"""Who may talk on the peer channel (docs/protocol.md §10.1-10.2, docs/security.md "Fleet fill").

Three modes, chosen by ``wcache-server``'s options:

- ``mtls`` (``--peer-cert``, ``--peer-key``, ``--peer-ca``): TLS 1.3, both sides present a certificate of the
  fleet's CA and verify the other's chain against it (host names are not checked: peers are addressed by IP,
  so the CA is the trust boundary).
- ``secret`` (``--peer-secret-file``): TLS 1.3 with a certificate the source makes at start (self-signed, in
  memory only) and a mutual HMAC-SHA256 proof of the secret bound to that certificate's hash
  (:class:`SecretClient`, :class:`SecretServer`): the channel is encrypted from its first byte, and a man in
  the middle, presenting a certificate of its own, makes both proofs fail. Python 3.11's ``ssl`` has no
  TLS-PSK, and cannot make a certificate: ``cryptography`` (the ``fleet`` extra) makes it.
- ``none``: plain TCP, for one host only — :meth:`PeerSecurity.check_listen` refuses any address but loopback.

Nothing here moves bytes: the contexts go to asyncio's TLS, the proof objects turn frames into frames.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import socket
import ssl
import stat
from dataclasses import dataclass, field
from pathlib import Path

from wcache.errors import PermissionDeniedError
from wcache.proto.fleet_frames import NONCE_BYTES, PeerAuth, PeerAuthOk, PeerChallenge, PeerProof

__all__ = ["MIN_SECRET", "PeerSecurity", "SecretClient", "SecretServer", "proof"]

#: bytes a shared secret must have at least (32 random bytes recommended: ``head -c 32 /dev/urandom | base64``)
MIN_SECRET = 16
_LABEL = b"wcache-peer-v1 "


def proof(secret: bytes, side: str, cert_sha256: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HMAC-SHA256 of the secret over the side's label, the source certificate's hash and both nonces (§10.2)."""
    if side not in ("server", "client"):
        raise ValueError(side)
    msg = _LABEL + side.encode() + b"\0" + cert_sha256 + client_nonce + server_nonce
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _denied(why: str) -> PermissionDeniedError:
    return PermissionDeniedError(why, details={"reason": "secret"})


class SecretClient:
    """The target's side of the shared-secret proofs: ``start()`` -> PEER_AUTH; ``challenged(frame)`` checks the
    source's proof (PermissionDeniedError when it is wrong: the source does not hold the secret, or a man in
    the middle terminates TLS) and returns PEER_PROOF."""

    def __init__(self, secret: bytes, peer_cert_der: bytes) -> None:
        self._secret = secret
        self._cert = hashlib.sha256(peer_cert_der).digest()
        self._nonce = os.urandom(NONCE_BYTES)

    def start(self, rid: int) -> PeerAuth:
        return PeerAuth(id=rid, nonce=self._nonce)

    def challenged(self, ch: PeerChallenge, rid: int) -> PeerProof:
        want = proof(self._secret, "server", self._cert, self._nonce, ch.nonce)
        if not hmac.compare_digest(want, ch.proof):
            raise _denied("the peer does not prove this fleet's secret for the TLS certificate it presented")
        return PeerProof(id=rid, proof=proof(self._secret, "client", self._cert, self._nonce, ch.nonce))


class SecretServer:
    """The source's side: ``challenge(frame)`` answers PEER_AUTH; ``check(frame)`` answers PEER_PROOF with
    PEER_AUTH_OK, or raises PermissionDeniedError (sent as a fatal ERROR)."""

    def __init__(self, secret: bytes, own_cert_der: bytes) -> None:
        self._secret = secret
        self._cert = hashlib.sha256(own_cert_der).digest()
        self._nonces: tuple[bytes, bytes] | None = None
        #: one attempt per connection: after a wrong proof, every further PEER_AUTH / PEER_PROOF is refused
        self.failed = False

    def challenge(self, req: PeerAuth) -> PeerChallenge:
        if self.failed or self._nonces is not None:
            self.failed = True
            raise _denied("PEER_AUTH was sent twice: one attempt per connection")
        mine = os.urandom(NONCE_BYTES)
        self._nonces = (req.nonce, mine)
        return PeerChallenge(id=req.id, nonce=mine, proof=proof(self._secret, "server", self._cert, req.nonce, mine))

    def check(self, req: PeerProof) -> PeerAuthOk:
        if self.failed or self._nonces is None:
            self.failed = True
            raise _denied("PEER_PROOF before PEER_AUTH, or after a refused one")
        want = proof(self._secret, "client", self._cert, *self._nonces)
        if not hmac.compare_digest(want, req.proof):
            self.failed = True
            raise _denied("the peer does not prove this fleet's secret")
        return PeerAuthOk(id=req.id)


@dataclass(frozen=True)
class PeerSecurity:
    """The peer channel's authentication, as configured (one per daemon)."""

    mode: str  # "mtls" | "secret" | "none"
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    secret: bytes = field(default=b"", repr=False)
    #: secret mode, source side: the certificate made at start (DER) and its context
    _own: tuple[bytes, ssl.SSLContext] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def configure(
        cls, *, cert: Path | None, key: Path | None, ca: Path | None, secret_file: Path | None
    ) -> PeerSecurity:
        """From the options; ValueError naming what is missing or unsafe."""
        tls = [cert, key, ca]
        if secret_file is not None and any(x is not None for x in tls):
            raise ValueError("--peer-secret-file and --peer-cert/--peer-key/--peer-ca are two modes: choose one")
        if any(x is not None for x in tls):
            if not all(x is not None for x in tls):
                raise ValueError("mutual TLS needs all of --peer-cert, --peer-key and --peer-ca")
            for p in tls:
                assert p is not None
                if not p.is_file():
                    raise ValueError(f"{p}: no such file")
            return cls("mtls", cert, key, ca)
        if secret_file is not None:
            return cls("secret", secret=read_secret(secret_file))
        return cls("none")

    @property
    def authenticates(self) -> bool:
        return self.mode != "none"

    def check_listen(self, host: str) -> None:
        """Refuse to listen unauthenticated anywhere but on loopback (ValueError saying what to pass)."""
        if self.authenticates or _loopback(host):
            return
        raise ValueError(
            f"refusing to serve the peer channel on {host} without authentication: NIXL metadata lets a peer read "
            "this daemon's memory. Pass --peer-cert/--peer-key/--peer-ca (mutual TLS) or --peer-secret-file, or "
            "listen on 127.0.0.1"
        )

    def check_peer(self, host: str) -> None:
        """A target without authentication talks to loopback peers only (it would trust whatever answered);
        PermissionDeniedError (reason ``auth``) otherwise."""
        if self.authenticates or _loopback(host):
            return
        raise PermissionDeniedError(
            f"refusing to fill from {host} without authentication: pass --peer-cert/--peer-key/--peer-ca or "
            "--peer-secret-file",
            details={"reason": "auth"},
        )

    def with_own_certificate(self) -> PeerSecurity:
        """Secret mode, source side: this daemon's certificate, made once at start (a no-op otherwise)."""
        if self.mode != "secret" or self._own is not None:
            return self
        return PeerSecurity(self.mode, secret=self.secret, _own=_ephemeral_context())

    def server_context(self) -> ssl.SSLContext | None:
        """The source's TLS context (None: plain TCP)."""
        if self.mode == "none":
            return None
        if self.mode == "secret":
            if self._own is None:
                raise RuntimeError("call with_own_certificate() first")
            return self._own[1]
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(str(self.cert), str(self.key))
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    @property
    def own_certificate(self) -> bytes:
        """Secret mode, source side: the DER bytes its proofs are bound to."""
        if self._own is None:
            raise RuntimeError("no certificate of our own in this mode")
        return self._own[0]

    def client_context(self) -> ssl.SSLContext | None:
        """The target's TLS context (None: plain TCP). Secret mode: the source's certificate is not verified by
        its chain — the proofs bind it (§10.2)."""
        if self.mode == "none":
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False
        if self.mode == "secret":
            ctx.verify_mode = ssl.CERT_NONE
            return ctx
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx


def read_secret(path: Path) -> bytes:
    """The shared secret: the file's bytes without a trailing newline, at least MIN_SECRET of them, in a file
    only its owner can read (ValueError otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(f"--peer-secret-file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise ValueError(
                f"--peer-secret-file {path} must be a regular file readable by its owner only (chmod 600), "
                f"not mode {stat.S_IMODE(st.st_mode):o}"
            )
        data = os.read(fd, 1 << 16).rstrip(b"\r\n")
    finally:
        os.close(fd)
    if len(data) < MIN_SECRET:
        raise ValueError(
            f"--peer-secret-file {path} holds {len(data)} bytes: at least {MIN_SECRET} are needed "
            "(head -c 32 /dev/urandom | base64 > FILE)"
        )
    return data


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _ephemeral_context() -> tuple[bytes, ssl.SSLContext]:
    """A self-signed ECDSA P-256 certificate made now, and a TLS 1.3 server context presenting it. The key never
    touches a file system: it is loaded through a memfd."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as exc:
        raise ValueError(
            f"--peer-secret-file needs the 'cryptography' package (pip install -e \".[fleet]\"): {exc}"
        ) from None
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "wcache-peer")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_NONE
    fd = os.memfd_create("wcache-peer-cert", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem)
        ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    return cert.public_bytes(serialization.Encoding.DER), ctx
