"""Rules of the daemon's frames that span fields (wcache/proto/daemon_frames.py): the work they cost."""

from __future__ import annotations

import dataclasses

import pytest

from wcache.errors import RemoteProtocolError
from wcache.proto import Deposit, DepositTensor, SlabDescriptor, State, TakeoverState
from wcache.proto.daemon_frames import MAX_FRAME_FDS
from wcache.proto.examples import EXAMPLES
from wcache.proto.frames import as_received

KEY: dict[str, str | int] = {
    "fingerprint": "f",
    "architecture": "A",
    "tp_size": 1,
    "tp_rank": 0,
    "dtype": "bfloat16",
    "engine": "e",
}


class _Counted(str):
    """A tensor name that counts the comparisons made with it."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        _Counted.comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_a_deposit_is_checked_in_linear_time() -> None:
    """A DEPOSIT is decoded on the daemon's event loop: its rules are checked in time linear in its tensors.
    The duplicate-name check once compared every name with every other (37,000 tensors whose only duplicate
    is last: 18.5 s, while other engines' STATUS waited); counted here, not timed."""
    n = 1000
    names = [_Counted(f"t{i}") for i in range(n)] + [_Counted(f"t{n - 1}")]  # the one duplicate: last
    deposit = Deposit(id=1, key=KEY, tensors=tuple(DepositTensor(name, "int8", (1,)) for name in names))
    _Counted.comparisons = 0
    with pytest.raises(RemoteProtocolError, match="listed twice"):
        deposit._validate()
    assert _Counted.comparisons <= 4 * n, _Counted.comparisons


def _state(slabs: int, with_fds: int) -> State:
    """The example STATE over ``slabs`` memfd slabs, the first ``with_fds`` of them with descriptors."""
    base = EXAMPLES["STATE"]
    assert isinstance(base, State)
    descs = tuple(
        SlabDescriptor(size=1280, kind="memfd", fd=i)
        if i < with_fds
        else SlabDescriptor(size=1280, kind="cuda_ipc", fd=-1, handle=b"h" * 64)
        for i in range(slabs)
    )
    return dataclasses.replace(base, slabs=descs)


def test_a_state_carries_at_most_one_frames_descriptors() -> None:
    """Descriptors ride one SCM_RIGHTS message and every receiver reads with room for MAX_FRAME_FDS (§2.2): a STATE
    announcing more would reach it truncated, so the decoder refuses it by name; slabs without descriptors (up to
    MAX_STATE_SLABS) do not count."""
    assert as_received(_state(MAX_FRAME_FDS, MAX_FRAME_FDS)).fd_count == MAX_FRAME_FDS
    assert as_received(_state(MAX_FRAME_FDS + 4, MAX_FRAME_FDS)).fd_count == MAX_FRAME_FDS
    with pytest.raises(RemoteProtocolError, match=r"slabs.*n <= 16"):
        as_received(_state(MAX_FRAME_FDS + 1, MAX_FRAME_FDS + 1))


def test_a_hand_off_over_one_frames_descriptors_names_the_models() -> None:
    """TAKEOVER_STATE's descriptors are its slabs' and the listening socket's: 16 slabs leave no room for the socket,
    and the refusal names the models, where the excess is."""
    base = EXAMPLES["TAKEOVER_STATE"]
    assert isinstance(base, TakeoverState)
    model = base.models[0]
    many = tuple(
        dataclasses.replace(model, slabs=(dataclasses.replace(model.slabs[0], fd=i),)) for i in range(MAX_FRAME_FDS)
    )
    with pytest.raises(RemoteProtocolError, match=r"TAKEOVER_STATE\.models"):
        as_received(dataclasses.replace(base, models=many, listener_fd=MAX_FRAME_FDS - 1))
    with pytest.raises(RemoteProtocolError, match=r"TAKEOVER_STATE\.listener_fd"):
        as_received(dataclasses.replace(base, models=many[:1], listener_fd=0))  # the socket on a slab's position
