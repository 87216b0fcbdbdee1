"""The fleet frames' own rules (wcache/proto/fleet_frames.py, docs/protocol.md §10): what a peer may send."""

from __future__ import annotations

import pytest


def test_an_offer_naming_more_buffers_than_a_state_carries_is_refused() -> None:
    """A filled model's ``buffers`` are served in its STATE, whose decoder takes at most MAX_DEPOSIT_TENSORS: an
    offer naming more does not decode (before, it was filled and then no engine could decode its STATE)."""
    from wcache.errors import RemoteProtocolError
    from wcache.proto.fleet_frames import PeerModel
    from wcache.proto.limits import MAX_DEPOSIT_TENSORS
    from wcache.proto.table import TensorEntry, TensorTable

    table = TensorTable.from_entries([TensorEntry("w", "float32", (4,), (1,), 0, 0)])
    m = PeerModel(lease=1, key={}, size=16, memory="host", address=0, tensors=table)
    wire = m.to_wire()
    assert PeerModel.from_wire({**wire, "buffers": ["w"] * 3}).buffers == ("w",) * 3
    with pytest.raises(RemoteProtocolError, match="buffers"):
        PeerModel.from_wire({**wire, "buffers": ["w"] * (MAX_DEPOSIT_TENSORS + 1)})
