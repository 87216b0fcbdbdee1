"""The exception tree says whose fault an error is, and the wire codes map 1:1 to classes (wcache/errors.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import wcache
from wcache.errors import (
    ERROR_CLASSES,
    CheckpointError,
    DaemonRunningError,
    ErrorCode,
    FrameTooLargeError,
    InsecurePathError,
    InternalError,
    LocalProtocolError,
    NotFoundError,
    ProtocolError,
    RemoteProtocolError,
    ShardingError,
    TransformError,
    UnexpectedFrameError,
    UnsupportedVersionError,
    WCacheError,
    error_from_frame,
)
from wcache.proto import ErrorFrame


def test_local_and_remote_protocol_errors_are_siblings() -> None:
    """h11's model: a catch of the peer's violations never catches our own bug, and the reverse."""
    assert issubclass(LocalProtocolError, ProtocolError) and issubclass(RemoteProtocolError, ProtocolError)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)
    assert not issubclass(RemoteProtocolError, LocalProtocolError)
    for cls in (FrameTooLargeError, UnsupportedVersionError, UnexpectedFrameError):
        assert issubclass(cls, RemoteProtocolError)


def test_every_protocol_break_wcache_detects_says_whose_fault_it_is() -> None:
    """No module raises (or builds) the bare ProtocolError: what the peer sent is a RemoteProtocolError, what we
    tried to send a LocalProtocolError; the base class is only what a received PROTOCOL_ERROR verdict becomes
    (``error_from_frame``, through ERROR_CLASSES), so that the server shell knows whose fault each one is."""
    root = Path(wcache.__file__).parent
    bare = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "ProtocolError"
    ]
    assert bare == []


def test_a_local_protocol_error_is_never_sent_as_protocol_error() -> None:
    """Even a handler that converts it blindly tells the peer INTERNAL (our bug), not PROTOCOL_ERROR."""
    frame = ErrorFrame.from_exception(LocalProtocolError("STATE frame not allowed in phase HANDSHAKE"), 7, fatal=True)
    assert frame.code == ErrorCode.INTERNAL
    assert isinstance(error_from_frame(frame.code, frame.message, frame.details), InternalError)


def test_every_sent_code_maps_to_its_class_and_back() -> None:
    assert set(ERROR_CLASSES) == set(ErrorCode)
    for code, cls in ERROR_CLASSES.items():
        assert cls.code is code
        err = error_from_frame(int(code), "m", {"k": 1})
        assert type(err) is cls and err.details == {"k": 1}


def test_each_code_is_declared_by_one_class() -> None:
    """ERROR_CLASSES is what the classes declare in their class statements (``code=``): a second class claiming a
    code is refused when it is defined; one that borrows a code (``sent_as=``) or inherits one does not displace
    the class a received ERROR of that code is raised as."""
    with pytest.raises(TypeError, match="code NOT_FOUND is NotFoundError's"):

        class Again(WCacheError, code="NOT_FOUND"):
            pass

    class Borrowed(WCacheError, sent_as="NOT_FOUND"):
        pass

    class Inherited(NotFoundError):
        pass

    assert Borrowed.code is Inherited.code is ErrorCode.NOT_FOUND
    assert ERROR_CLASSES[ErrorCode.NOT_FOUND] is NotFoundError
    assert type(error_from_frame(int(ErrorCode.NOT_FOUND), "m", {})) is NotFoundError
    assert LocalProtocolError.code is ErrorCode.INTERNAL and ERROR_CLASSES[ErrorCode.INTERNAL] is InternalError


@pytest.mark.parametrize(
    ("cls", "code", "value"),
    [
        (CheckpointError, ErrorCode.INVALID_CHECKPOINT, 40),
        (ShardingError, ErrorCode.INVALID_PLAN, 41),
        (TransformError, ErrorCode.INVALID_TRANSFORM, 42),
    ],
)
def test_requester_errors_have_their_own_codes(cls: type[WCacheError], code: ErrorCode, value: int) -> None:
    assert cls.code is code and int(code) == value
    assert type(error_from_frame(value, "bad", {})) is cls


def test_codes_are_unique_and_keep_their_values() -> None:
    """Values are wire format: the ones that shipped never move (the golden ERROR example carries one)."""
    assert len({int(c) for c in ErrorCode}) == len(ErrorCode)
    shipped = {"PROTOCOL_ERROR": 1, "FRAME_TOO_LARGE": 2, "UNSUPPORTED_VERSION": 3, "UNEXPECTED_FRAME": 4}
    shipped |= {"PERMISSION_DENIED": 10, "NOT_READY": 20, "KEY_MISMATCH": 21, "NOT_FOUND": 28}
    shipped |= {"UNAVAILABLE": 30, "INTERNAL": 99}
    assert {name: int(ErrorCode[name]) for name in shipped} == shipped


def test_an_unknown_code_is_a_generic_server_error() -> None:
    err = error_from_frame(77, "from a newer daemon", {})
    assert type(err).__name__ == "ServerError" and "77" in err.message


def test_a_held_daemon_lock_is_not_a_security_failure(tmp_path: Path) -> None:
    from wcache.server.security import DaemonLock

    first = DaemonLock(tmp_path / "wcache.sock")
    first.acquire()
    try:
        with pytest.raises(DaemonRunningError) as info:
            DaemonLock(tmp_path / "wcache.sock").acquire()
        assert not isinstance(info.value, InsecurePathError)
        assert info.value.details["holder_pid"].isdigit()
    finally:
        first.release()
    second = DaemonLock(tmp_path / "wcache.sock")
    second.acquire()  # released: the next daemon takes it
    second.release()


def test_a_field_that_differs_only_in_type_says_so() -> None:
    """KEY_MISMATCH's words for ``"0"`` against ``0`` read ``tp_rank: requested 0, served 0``: the two values look
    the same unless quoted and named by type."""
    from wcache.errors import describe_fields

    assert describe_fields({"tp_rank": [0, "0"]}) == "tp_rank: requested '0' (str), served 0 (int)"
    assert describe_fields({"layout": [1, True]}) == "layout: requested True (bool), served 1 (int)"
    # alike in type: as before
    assert describe_fields({"tp_size": [2, 1], "dtype": ["bfloat16", "float16"]}) == (
        "tp_size: requested 1, served 2; dtype: requested float16, served bfloat16"
    )
    assert describe_fields({"zzz": [None, "x"]}) == "zzz: requested x, served nothing"
