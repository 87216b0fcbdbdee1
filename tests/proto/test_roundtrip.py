"""Property tests: every valid frame survives encode -> bytes -> decode unchanged, in any chunking."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from wcache.proto import Frame, FrameBuffer, decode_body, decode_frame, pack_frame

from .strategies import frames


def _normal(frame: Frame) -> Frame:
    """Frames compare after one round trip (ERROR details arrays become lists)."""
    return decode_frame(decode_body(pack_frame(frame.to_wire())[4:]))


@settings(max_examples=300, deadline=None)
@given(frames)
def test_round_trip(frame: Frame) -> None:
    once = _normal(frame)
    assert _normal(once) == once
    if frame.TYPE != "ERROR":
        assert once == frame


@settings(max_examples=100, deadline=None)
@given(st.lists(frames, min_size=1, max_size=4), st.data(), st.booleans())
def test_any_chunking(batch: list[Frame], data: st.DataObject, direct: bool) -> None:
    stream = b"".join(pack_frame(f.to_wire()) for f in batch)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    buf, out = FrameBuffer(direct=direct), []
    prev = 0
    for cut in [*cuts, len(stream)]:
        buf.feed(stream[prev:cut])
        prev = cut
        while (body := buf.next_body()) is not None:
            out.append(decode_frame(decode_body(body)))
    assert out == [_normal(f) for f in batch]
    assert buf.buffered == 0


@settings(max_examples=30, deadline=None)
@given(frames)
def test_byte_at_a_time(frame: Frame) -> None:
    stream = pack_frame(frame.to_wire())
    buf, out = FrameBuffer(), []
    for i in range(len(stream)):
        buf.feed(stream[i : i + 1])
        while (body := buf.next_body()) is not None:
            out.append(decode_frame(decode_body(body)))
    assert out == [_normal(frame)]
