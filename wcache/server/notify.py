"""systemd's readiness protocol (sd_notify(3)), without libsystemd: ``Type=notify`` units (docs/deploy/) learn
that wcache-server or wcache-keeper serves from a ``READY=1`` datagram, sent when the ready line is written, and
that it is stopping from ``STOPPING=1``.

systemd passes the address in ``NOTIFY_SOCKET``: a path, or a Linux abstract-namespace name written with a
leading ``@``. Each message is one datagram of ``KEY=VALUE`` lines on an AF_UNIX SOCK_DGRAM socket. With
``NotifyAccess=main`` (the default for ``Type=notify``) systemd accepts only what the unit's main process sends:
the daemon sends from its own process (``/bin/sh -c 'exec ...'`` in the unit keeps that process the main one).
``NOTIFY_SOCKET`` is left set (libsystemd's ``unset_environment=0``): nothing the process starts loses it.
Without ``NOTIFY_SOCKET`` (not started by systemd, or ``Type=simple``) every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket

__all__ = ["notify", "notify_address"]

log = logging.getLogger("wcache.server")


def notify_address(value: str | None = None) -> str | bytes | None:
    """The address ``NOTIFY_SOCKET`` (or ``value``) names, as ``socket.sendto`` takes it: a path, or for
    ``@NAME`` the abstract name ``b"\\0NAME"``; None when it is unset, empty, or a kind this module does not
    speak (``vsock:``, which systemd offers to virtual machines)."""
    if value is None:
        value = os.environ.get("NOTIFY_SOCKET")
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + os.fsencode(value[1:])
    if value.startswith("/"):
        return value
    return None


def notify(**fields: str | int) -> bool:
    """Send ``fields`` (``READY=1``, ``STOPPING=1``, ``STATUS=...``, ``MAINPID=...``: pass them as keywords,
    ``READY=1``) to the service manager as one datagram; True if it was sent. A manager that is gone or refuses
    is one warning line, never an error: the daemon serves whether or not systemd hears of it."""
    address = notify_address()
    if address is None:
        return False
    message = "\n".join(f"{k}={_one_line(str(v))}" for k, v in fields.items()).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(message, address)
    except OSError as exc:
        log.warning(
            "NOTIFY_SOCKET=%s: could not tell the service manager %s (%s)",
            os.environ.get("NOTIFY_SOCKET"),
            " ".join(fields),
            exc,
        )
        return False
    return True


def _one_line(value: str) -> str:
    """A value as sd_notify takes it: one line (a newline would start another field)."""
    return value.replace("\n", " ")
