"""Rules of the daemon's frames that span fields (wcache/proto/daemon_frames.py): the work they cost."""

from __future__ import annotations

import pytest

from wcache.errors import RemoteProtocolError
from wcache.proto import Deposit, DepositTensor

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
