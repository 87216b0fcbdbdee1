"""An engine's own connection (wcache/proto/engine.py) against the reference, the frame declarations and
``Connection``: the same bytes out; for any bytes in, the same frame or the same error; for any sequence of frames
a daemon sends, the same frames yielded and the same error raised where the reference raises one."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.proto import strategies as S
from wcache.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from wcache.proto import engine
from wcache.proto._record import declared
from wcache.proto.codec import decode_body, encode_body, pack_frame
from wcache.proto.connection import Connection, Role, Service
from wcache.proto.daemon_frames import (
    CheckpointProof,
    DeviceInfo,
    ErrorFrame,
    FileStat,
    GetState,
    Hello,
    HelloOk,
    Release,
    Released,
    SlabDescriptor,
    State,
)
from wcache.proto.examples import EXAMPLES, VARIANTS
from wcache.proto.frames import decode_frame
from wcache.proto.limits import PROTOCOL_VERSION
from wcache.proto.table import TensorEntry, TensorTable

# --------------------------------------------------------------------------- what is sent


@given(S.text, S.text)
def test_hello_is_the_declarations(software: str, name: str) -> None:
    assert engine.pack(engine.hello(software, name)) == pack_frame(
        Hello(versions=(PROTOCOL_VERSION,), software=software, name=name).to_wire()
    )


def _files(proof: CheckpointProof) -> tuple[engine.FileId, ...]:
    return tuple(engine.FileId(f.name, f.dev, f.ino, f.size, f.mtime_ns, f.ctime_ns) for f in proof.files)


@given(S.ids, S.keys, st.sampled_from(["zero_copy", "copy"]), st.none() | S.proofs(), S.text)
def test_get_state_is_the_declarations(
    rid: int, key: dict[str, Any], mode: str, proof: CheckpointProof | None, uuid: str
) -> None:
    ours = engine.get_state(rid, key, mode, None if proof is None else (_files(proof), proof.dtype), uuid)
    theirs = GetState(id=rid, key=key, mode=mode, device_uuid=uuid, proof=proof)
    assert engine.pack(ours) == pack_frame(theirs.to_wire())


@given(S.ids, S.ids)
def test_release_is_the_declarations(rid: int, lease: int) -> None:
    assert engine.pack(engine.release(rid, lease)) == pack_frame(Release(id=rid, lease=lease).to_wire())


def test_the_golden_requests() -> None:
    """docs/protocol.md §8's HELLO, GET_STATE (both forms) and RELEASE, byte for byte."""
    hello = EXAMPLES["HELLO"]
    assert isinstance(hello, Hello)
    assert engine.pack(engine.hello(hello.software, hello.name)) == pack_frame(hello.to_wire())
    for example in (EXAMPLES["GET_STATE"], VARIANTS["GET_STATE with a proof"]):
        assert isinstance(example, GetState)
        proof = None if example.proof is None else (_files(example.proof), example.proof.dtype)
        m = engine.get_state(example.id, example.key, example.mode, proof, example.device_uuid)
        assert engine.pack(m) == pack_frame(example.to_wire())
    release = EXAMPLES["RELEASE"]
    assert isinstance(release, Release)
    assert engine.pack(engine.release(release.id, release.lease)) == pack_frame(release.to_wire())


# --------------------------------------------------------------------------- what is received


def _plain(v: Any) -> Any:
    """A record (this module's or the declarations') as nested plain values, for comparison."""
    if isinstance(v, tuple) and hasattr(v, "_asdict"):
        return {k: _plain(x) for k, x in v._asdict().items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type) and type(v).__name__ != "TensorTable":
        return {d.name: _plain(getattr(v, d.name)) for d in declared(type(v))}
    if isinstance(v, tuple):
        return tuple(_plain(x) for x in v)
    return v


def _outcome(decode: Callable[[bytes], Any], body: bytes) -> Any:
    try:
        return ("frame", _plain(decode(body)))
    except ProtocolError as exc:
        return ("refused", type(exc), str(exc), exc.details)


def _reference(body: bytes) -> Any:
    return decode_frame(decode_body(body))


def _same(body: bytes) -> None:
    assert _outcome(engine.decode, body) == _outcome(_reference, body)


ENGINE_FRAMES = st.one_of(
    st.builds(
        HelloOk,
        version=st.integers(1, 2**31 - 1),
        software=S.text,
        backend=S.backends,
        device=S.devices,
        max_frame_size=st.integers(1, 2**32 - 1),
        server_pid=st.integers(0, 2**31),
    ),
    S.states(),
    st.builds(Released, id=S.ids, lease=st.integers(1, 2**63 - 1), leases_left=S.uints),
    st.builds(
        ErrorFrame,
        id=S.uints,
        code=st.integers(0, 2**31 - 1),
        message=S.text,
        details=st.dictionaries(st.text(max_size=8), S.plain, max_size=4),
        fatal=st.booleans(),
    ),
)


@given(ENGINE_FRAMES)
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_every_frame_an_engine_receives_decodes_as_the_declarations(frame: Any) -> None:
    """A valid HELLO_OK, STATE or RELEASED is decoded by the engine's own checks (the reference is never asked:
    a fast path that refused everything would still pass the comparisons below); an ERROR by the reference."""
    body = encode_body(frame.to_wire())
    fast = not isinstance(frame, ErrorFrame)

    def no_reference(m: Any) -> Any:
        raise AssertionError(f"the reference decoded a valid {m.get('type')}")

    with mock.patch.object(engine, "_reference", no_reference) if fast else contextlib.nullcontext():
        ours = engine.decode(body)
    assert _plain(ours) == _plain(frame)


@pytest.mark.parametrize("name", ["HELLO_OK", "STATE", "RELEASED", "ERROR"])
def test_the_golden_frames_received(name: str) -> None:
    _same(pack_frame(EXAMPLES[name].to_wire())[4:])


#: values a damaged field may take: every wire type, at and past the limits the declarations set
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, -1, 1, 253, 254, 2**16, 2**16 + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1]),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.sampled_from(["x" * 1024, "x" * 1025, "x" * 4097, "zero_copy", "copy", "host", "cuda", "cpu", "memfd"]),
    st.binary(max_size=8),
    st.binary(min_size=4096, max_size=4097),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)


def _damaged(draw: Callable[[st.SearchStrategy[Any]], Any], m: Any, depth: int = 0) -> Any:
    """``m`` with one field (at any depth) replaced, removed or added; the frame's own map stays a map."""
    if isinstance(m, dict):
        how = draw(st.sampled_from(["deeper", "remove", "add"] if depth == 0 else ["deeper", "remove", "add", "junk"]))
        if how == "deeper" and m:
            k = draw(st.sampled_from(sorted(m)))
            return {**m, k: _damaged(draw, m[k], depth + 1)}
        if how == "remove" and m:
            k = draw(st.sampled_from(sorted(m)))
            return {x: y for x, y in m.items() if x != k}
        if how != "junk":
            return {**m, draw(st.sampled_from([*m, "extra"])): draw(JUNK)}
    if isinstance(m, (tuple, list)) and m and depth < 4 and draw(st.booleans()):
        i = draw(st.integers(0, len(m) - 1))
        return (*m[:i], _damaged(draw, m[i], depth + 1), *m[i + 1 :])
    return draw(JUNK)


@given(ENGINE_FRAMES, st.data())
@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow])
def test_a_damaged_frame_is_refused_or_decoded_as_the_declarations_do(frame: Any, data: st.DataObject) -> None:
    """A field replaced by any value, removed, or added, at any depth: the engine's decoder refuses it with the
    declarations' error, or decodes it to what they decode."""
    m = decode_body(pack_frame(frame.to_wire())[4:])
    damaged = _damaged(data.draw, m)
    try:
        body = encode_body(damaged)
    except LocalProtocolError:  # not encodable (an integer past 64 bits in a map key, say)
        return
    _same(body)


@given(st.binary(max_size=300))
@settings(max_examples=500)
def test_arbitrary_bytes(body: bytes) -> None:
    try:
        want = _outcome(_reference, body)
    except RemoteProtocolError as exc:  # refused by the body's decoder
        want = ("refused", type(exc), str(exc), exc.details)
    try:
        got = _outcome(engine.decode, body)
    except RemoteProtocolError as exc:
        got = ("refused", type(exc), str(exc), exc.details)
    assert got == want


def test_a_big_state_goes_to_msgpack_and_decodes_alike() -> None:
    """A STATE over pymsgpack's 64 KiB (a MoE checkpoint's): the same frame through msgpack's C decoder."""
    base = EXAMPLES["STATE"]
    assert isinstance(base, State)
    n = 3000
    entries = [
        TensorEntry(f"model.layers.{i}.mlp.experts.{i}.weight", "bfloat16", (4,), (1,), 0, 8 * i) for i in range(n)
    ]
    state = dataclasses.replace(
        base,
        slabs=(SlabDescriptor(size=8 * n, kind="memfd", fd=0),),
        tensors=TensorTable.from_entries(entries),
        aliases={},
        buffers=(),
    )
    body = encode_body(state.to_wire())
    assert len(body) > 64 * 1024
    assert _plain(engine.decode(body)) == _plain(state)


def test_a_big_state_is_decoded_without_the_declarations_or_the_error_tree(tmp_path: Path) -> None:
    """A STATE over 64 KiB imports msgpack (its C decoder) and nothing else an engine's import left out: not the
    frame declarations, not the error tree (a fetch that raises nothing needs neither; the error tree's import was
    ~0.6 ms of a MoE engine's first fetch on the H200)."""
    base = EXAMPLES["STATE"]
    assert isinstance(base, State)
    n = 3000
    entries = [
        TensorEntry(f"model.layers.{i}.mlp.experts.{i}.weight", "bfloat16", (4,), (1,), 0, 8 * i) for i in range(n)
    ]
    slabs = (SlabDescriptor(size=8 * n, kind="memfd", fd=0),)
    state = dataclasses.replace(base, slabs=slabs, tensors=TensorTable.from_entries(entries), aliases={}, buffers=())
    body = tmp_path / "state.bin"
    body.write_bytes(encode_body(state.to_wire()))
    code = (
        "import sys\nfrom pathlib import Path\nfrom wcache.proto import engine\n"
        "frame = engine.decode(Path(sys.argv[1]).read_bytes())\nassert isinstance(frame, engine.State), frame\n"
        "print(sorted(m for m in sys.modules if m.startswith(('wcache', 'msgpack'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(body)], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))
    assert "msgpack" in loaded
    assert not loaded & {"wcache.errors", "wcache.proto.fields", "wcache.proto.daemon_frames", "wcache.proto.frames"}


# --------------------------------------------------------------------------- a connection, frame after frame


def _opened() -> tuple[Connection, engine.EngineConnection, Connection]:
    """A reference client and an engine's connection, each with HELLO and a pipelined GET_STATE (id 1) out, and the
    daemon's end that checks what they send."""
    ref, ours = Connection(Role.CLIENT), engine.EngineConnection()
    daemon = Connection(Role.SERVER, service=Service.DAEMON)
    key: dict[str, str | int] = {"fingerprint": "f", "architecture": "", "tp_size": 1, "tp_rank": 0, "dtype": "bf16"}
    sent_ref = ref.send(Hello(versions=(PROTOCOL_VERSION,), software="e", name="e")) + ref.send(
        GetState(id=ref.next_request_id(), key=key)
    )
    sent_ours = ours.opening("e", "e", engine.get_state(ours.next_request_id(), key, "zero_copy"))
    assert sent_ours == sent_ref
    daemon.receive_data(sent_ours)
    assert [f.TYPE for f in daemon.events()] == ["HELLO", "GET_STATE"]
    return ref, ours, daemon


def _hello_ok(version: int = PROTOCOL_VERSION) -> HelloOk:
    return HelloOk(version=version, software="d", backend="host", device=DeviceInfo(kind="cpu"), max_frame_size=1 << 20)


def _state(rid: int, lease: int, fds: int) -> State:
    base = EXAMPLES["STATE"]
    assert isinstance(base, State)
    slabs = tuple(SlabDescriptor(size=4096, kind="memfd", fd=i) for i in range(fds)) or (
        SlabDescriptor(size=4096, kind="cuda_ipc", handle=b"x" * 64),
    )
    return dataclasses.replace(base, id=rid, lease=lease, slabs=slabs, tensors=TensorTable((), ()), aliases={})


#: frames a daemon (or a broken one) may send an engine: each built with the choices the sequence draws
DAEMON_FRAMES = st.one_of(
    st.builds(_hello_ok, st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION + 1])),
    st.builds(_state, st.integers(1, 3), st.integers(1, 3), st.integers(0, 2)),
    st.builds(Released, id=st.integers(1, 3), lease=st.integers(1, 3)),
    st.builds(
        ErrorFrame, id=st.integers(0, 3), code=st.sampled_from([4, 7, 29]), message=st.just("m"), fatal=st.booleans()
    ),
    st.builds(lambda: EXAMPLES["STATUS_REPLY"]),
    st.builds(lambda: EXAMPLES["HELLO"]),
    st.builds(lambda: EXAMPLES["PEER_OFFER"]),
)


def _events(conn: Any, data: bytes, fds: list[int], chunk: int | None = None) -> Any:
    """What ``conn`` makes of ``data`` (with ``fds`` on its first byte), fed ``chunk`` bytes at a time (all at once
    for None; ``b""``: the end of the stream): each frame with its descriptors, then the error, if any."""
    out: list[Any] = []
    step = chunk or max(1, len(data))
    try:
        for at in range(0, max(1, len(data)), step):
            conn.receive_data(data[at : at + step], fds if at == 0 else [])
            out.extend((_plain(frame), got) for frame, got in conn.received())
    except ProtocolError as exc:
        out.append(("refused", type(exc), str(exc)))
    return out


def _sent(send: Callable[[Any], bytes], request: Any) -> Any:
    """A request's bytes, or the LocalProtocolError refusing it."""
    try:
        return send(request)
    except LocalProtocolError as exc:
        return ("refused", str(exc))


#: what happens next on the connection: a frame from the daemon (with one descriptor fewer, as many as it
#: announces, or one more, fed in pieces of some size), a request from the engine, or the end of the stream
STEPS = st.one_of(
    st.tuples(st.just("frame"), DAEMON_FRAMES, st.sampled_from([-1, 0, 0, 1]), st.sampled_from([None, 1, 3, 50])),
    st.tuples(st.just("get_state")),
    st.tuples(st.just("release")),
    st.tuples(st.just("eof")),
)


@given(st.lists(STEPS, min_size=1, max_size=8))
@settings(max_examples=800, suppress_health_check=[HealthCheck.too_slow])
def test_any_sequence_of_frames_as_the_reference_connection(steps: list[tuple[Any, ...]]) -> None:
    """A daemon's frames in any order and any pieces (a second HELLO_OK, a STATE for a request never sent or a lease
    granted twice, an ERROR before the handshake, a fatal one, frames of other services, descriptors no frame
    announces or fewer than announced, the stream ending inside a frame), with the engine's GET_STATEs and RELEASEs
    between them: the same frames and descriptors yielded, the same error where the reference refuses, the same
    requests refused, and the same state after."""
    ref, ours, _ = _opened()
    fd = 100
    for step in steps:
        if step[0] == "frame":
            _, frame, delta, chunk = step
            data = pack_frame(frame.to_wire())
            n = max(0, frame.fd_count + delta)  # the descriptors announced, one fewer or one more
            fds = list(range(fd, fd + n))
            fd += n
            got_ref, got_ours = _events(ref, data, fds, chunk), _events(ours, data, fds, chunk)
        elif step[0] == "eof":
            got_ref, got_ours = _events(ref, b"", []), _events(ours, b"", [])
        elif step[0] == "get_state":
            key: dict[str, str | int] = {"tp_size": 1}
            got_ref = _sent(ref.send, GetState(id=ref.next_request_id(), key=key))
            got_ours = _sent(ours.send, engine.get_state(ours.next_request_id(), key, "zero_copy"))
        else:
            lease = min(ref.leases, default=1)
            got_ref = _sent(ref.send, Release(id=ref.next_request_id(), lease=lease))
            got_ours = _sent(ours.send, engine.release(ours.next_request_id(), lease))
        assert got_ours == got_ref
        assert (ours.phase, ours.leases, ours.pending) == (ref.phase.value, ref.leases, ref.pending)
        assert ours.release_fds() == ref.release_fds()
        if isinstance(got_ref, list) and got_ref and got_ref[-1][0] == "refused":
            return


def test_what_an_engine_may_not_send_is_refused_before_it_is_sent() -> None:
    """A RELEASE of a lease not held, a request under an id still waiting for its reply: refused by both, nothing
    changed."""
    ref, ours, _ = _opened()
    for conn in (ref, ours):
        conn.receive_data(pack_frame(_hello_ok().to_wire()))
        assert len(list(conn.received())) == 1
    with pytest.raises(LocalProtocolError, match="not held"):
        ref.send(Release(id=ref.next_request_id(), lease=7))
    with pytest.raises(LocalProtocolError, match="not held"):
        ours.send(engine.release(ours.next_request_id(), 7))
    with pytest.raises(LocalProtocolError, match="already waiting"):
        ref.send(GetState(id=1, key={}))
    with pytest.raises(LocalProtocolError, match="already waiting"):
        ours.send(engine.get_state(1, {}, "zero_copy"))
    assert ours.pending == ref.pending == {1: "GET_STATE"}


def test_a_request_over_the_daemons_frame_size_is_refused() -> None:
    """HELLO_OK's max_frame_size: a GET_STATE past it is never sent (the daemon would end the connection)."""
    _, ours, _ = _opened()
    small = dataclasses.replace(_hello_ok(), max_frame_size=64)
    ours.receive_data(pack_frame(small.to_wire()))
    assert [type(f).__name__ for f, _ in ours.received()] == ["HelloOk"]
    with pytest.raises(LocalProtocolError, match="over the 64 bytes"):
        ours.send(engine.get_state(ours.next_request_id(), {"k": "x" * 100}, "zero_copy"))
    assert list(ours.pending) == [1]


def test_a_release_before_the_handshake_is_refused() -> None:
    ours = engine.EngineConnection()
    ours.opening("e", "e", engine.get_state(ours.next_request_id(), {}, "zero_copy"))
    ours.leases.add(5)
    with pytest.raises(LocalProtocolError, match="not allowed in phase hello_sent"):
        ours.send(engine.release(ours.next_request_id(), 5))


def test_a_big_frame_before_the_handshake_is_refused() -> None:
    """Before HELLO_OK a frame is at most 64 KiB (docs/protocol.md §7), as the reference connection holds it."""
    ref, ours, _ = _opened()
    prefix = (1 << 20).to_bytes(4, "big")
    refused = _events(ours, prefix, [])
    assert refused == _events(ref, prefix, []) and refused[0][1].__name__ == "FrameTooLargeError"


def test_an_error_answering_the_request_is_raised_as_its_class() -> None:
    from wcache.channel import _expected_engine
    from wcache.errors import KeyUnprovenError

    _, ours, _ = _opened()
    ours.receive_data(pack_frame(_hello_ok().to_wire()) + pack_frame(ErrorFrame(id=1, code=29, message="m").to_wire()))
    hello, error = list(ours.received())
    assert _expected_engine(*hello)[0] == engine.HelloOk(
        PROTOCOL_VERSION, "d", "host", engine.DeviceInfo("cpu", 0, "", ""), 1 << 20, 0
    )
    with pytest.raises(KeyUnprovenError, match="m"):
        _expected_engine(*error)
    assert ours.pending == {}


def test_file_ids_are_file_stats() -> None:
    """The proof's unit has the declarations' fields, in their order."""
    assert engine.FileId._fields == tuple(d.name for d in declared(FileStat))
