"""Golden bytes: the wire format of one example of each frame is pinned here and in docs/protocol.md §8."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from wcache.errors import RemoteProtocolError
from wcache.proto import Connection, Keep, Kept, Reclaimed, Role, TakeoverState, decode_body, decode_frame, pack_frame
from wcache.proto.examples import EXAMPLES, VARIANTS, hexdump

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"

# sha256 of each example's bytes (length prefix included). Changing one is a wire-format change:
# it needs a protocol version bump or a compatible, defaulted new field (docs/protocol.md §2.1).
GOLDEN_SHA256 = {
    "HELLO": "c52f8fef8d24494c8be667d1aaf619302a3e0c1512f484c17f6f736e755b710c",
    "HELLO_OK": "2f6dda78aed93b4b1f7cf64529935ab8733e6222dc50533310b1532d38337627",
    "GET_STATE": "5a781b608da3a648bbfacaeeaef89ba3bdd654f16233aec5f48ee954f917186c",
    "STATE": "f1f00be002c8cd41c9ce9db964ddd8f31e0e1f454cc59dc634684a3e35790f76",
    "RELEASE": "4ea87e2d6977136feca27491ddbfa70d3b558d43d8899566d110df85e439fdb8",
    "RELEASED": "74090ef68c2f761c9be1e44eb771c01cc2ab6621e2c10b4923557f28d28d19de",
    "STATUS": "5b8b33533ee8d6b02521a3f8df27b4b83c21c0da4d9988e35af6ce976e92f2f0",
    "STATUS_REPLY": "0060f56815e0900ec2a3e3f420804003050eb0930b6de85a9c0e6bac93cca23a",
    "PRELOAD": "01208cff98ee8e644b89556625253edb737cb2a1538a7e45c0344438a860084c",
    "PRELOADED": "2534a9365060bda74ed543abd672f828eb2fbf73df1e65930fb791989895db4c",
    "EVICT": "f50f0d1a780a636b37f5d117252effacfe5d0a425f054f47b87b401f5bfb0bd4",
    "EVICTED": "8c0a3aa840e16c3b5b70562fd811ffe1e9597d944bfc5e2559c1510acfd2f8e3",
    "TAKEOVER": "bb2aba7c57fcc59016fc87ecc45d27c7169a5749b457734bc7d07bc3e9d4c140",
    "TAKEOVER_STATE": "0bf1cd24d7f4a4fbfbf92b4807aa8e959c921ede40ae98638a0480ca3083d856",
    "TAKEOVER_ADOPTED": "607d96e5a2257b60ed528a3b9073a6d727e983ac0f6f61a1c25157d11db37d25",
    "TAKEOVER_DONE": "ea08d628ee6a2442fd87c8d811c40eb7886e4dc53a76c48856afe0900d2333cf",
    "KEEP": "ccd9cd6a8dbe01b3766b09b955418a520232234152b04e05851417122317e5ca",
    "KEPT": "61a8afc94775e8ddd904c189cb59d54593c9e9528d2097223d9378f4c201c0c6",
    "UNKEEP": "325922262b5d0d833f2b8d874d638a3acffaee59cac4c20bd17d233f26943ffb",
    "RECLAIM": "ee07cffa27351ffc299670153bf11724ee5335ca208765a46c53f10780677092",
    "RECLAIMED": "4c06b3d736862cdce93846ce1cd281ff3d0fb58a8faa80ea54cbf2e78a6e867b",
    "DEPOSIT": "235bc68e438747b45b73bbe1b42bd6c22234ea4490b7b383efe2ab063d89f8fe",
    "DEPOSIT_SLAB": "a36754d94c14d860d18dc9c8285a91f10cbf4e011a5cc4f3b3279749a52777e6",
    "COMMIT": "4be6ba6dddd36d150d86836695cc2f2502f8fd8ecfa1c47a9bf9dbd52ffd1b67",
    "DEPOSITED": "acb11bd50acf2106303fc34c2240b39caa97a76e37bce12c469b73a651ec4b53",
    "ERROR": "5d423e9a76b338e72a46284d2176781959dbd8a023962e2f696f096f5643578c",
    "PEER_AUTH": "0162f4ac0145fe195c57239d66cec40a565b575538dbc5d041c687f1d6b9bdae",
    "PEER_CHALLENGE": "9eabcda1381a19c15627c9b1f847b773c49f617193ab3d6be11fbd1647089401",
    "PEER_PROOF": "cf3c82de810078efc1fd6f392e121961d0330b8aa886cf34af93789ed257978b",
    "PEER_AUTH_OK": "525efa74287ff17ddb2963d4075d0cc5003a846feb741637124123baef5f8755",
    "PEER_QUERY": "e10e2ba4e242e52c06117e1ceddd13e05a290729391150fcf4f820269476eac1",
    "PEER_OFFER": "716973a822354932e67010ca58970e3b95416e33a5dfe7c71c338c840f74a185",
    "PEER_READ": "b135e177b7789c52ebecd2292c50f5d047e6a44477624abe9ec1a92400b11964",
    "PEER_READ_OK": "1f12a97732b9d442ae2823c63f672315178b79eda7cf57afc64fbeeef9c649df",
    "PEER_FILES": "f98509fb0fc14afdc08ba8e426b1358c741b3e843fd67f73a9c6eb0b566a8776",
    "PEER_FILES_REPLY": "4eb707ff3eab9aa05390d268f35bc9ed579895c76d133e4f6652e03230f1da3b",
    # variants: optional fields that change a frame's shape (§4.3.1's proof)
    "GET_STATE with a proof": "c03abb1dcc02f3833af92abe96c5b3c462851652951b7a8b26e8bed726e3af7d",
    # §4.8: a model filled from the host tier, the tier's page-locked entries
    "STATUS_REPLY after a host-tier refill": "c4903bf4edd5a6ac43779bd4e9628f62f213e5642a0700bfa3b75a5dcd03fc62",
}
ALL = {**EXAMPLES, **VARIANTS}

HELLO_BYTES = bytes.fromhex(
    "0000003b84a474797065a548454c4c4fa876657273696f6e739102a8736f6674"
    "77617265ac7763616368652f302e312e30a46e616d65a8656e67696e652d30"
)


def test_hello_bytes_literal() -> None:
    assert pack_frame(EXAMPLES["HELLO"].to_wire()) == HELLO_BYTES


@pytest.mark.parametrize("name", list(ALL))
def test_golden_digest(name: str) -> None:
    data = pack_frame(ALL[name].to_wire())
    assert hashlib.sha256(data).hexdigest() == GOLDEN_SHA256[name]


@pytest.mark.parametrize("name", list(ALL))
def test_golden_decodes_to_example(name: str) -> None:
    data = pack_frame(ALL[name].to_wire())
    assert int.from_bytes(data[:4], "big") == len(data) - 4
    assert decode_frame(decode_body(data[4:])) == ALL[name]


@pytest.mark.parametrize("name", list(ALL))
def test_protocol_doc_shows_the_bytes(name: str) -> None:
    """docs/protocol.md §8 must show exactly what the encoder produces."""
    data = pack_frame(ALL[name].to_wire())
    doc = DOC.read_text()
    m = re.search(rf"### {name} \((\d+) bytes\)\n```\n(.*?)\n```", doc, re.S)
    assert m, f"docs/protocol.md has no example for {name}"
    assert int(m.group(1)) == len(data)
    assert m.group(2) == hexdump(data)


def test_examples_cover_every_frame_type() -> None:
    from wcache.proto.frames import FRAME_TYPES

    assert set(EXAMPLES) == set(FRAME_TYPES)


def _open() -> tuple[Connection, Connection]:
    """A client and a server connection after the example HELLO / HELLO_OK."""
    client, server = Connection(Role.CLIENT), Connection(Role.SERVER)
    server.receive_data(client.send(EXAMPLES["HELLO"]))
    assert list(server.events()) == [EXAMPLES["HELLO"]]
    client.receive_data(server.send(EXAMPLES["HELLO_OK"]))
    assert list(client.events()) == [EXAMPLES["HELLO_OK"]]
    return client, server


def test_example_state_maps_through_a_connection() -> None:
    """The STATE example is a legal reply: run it through client and server connections."""
    client, server = _open()
    server.receive_data(client.send(EXAMPLES["GET_STATE"]))
    list(server.events())
    client.receive_data(server.send(EXAMPLES["STATE"]))
    assert list(client.events()) == [EXAMPLES["STATE"]]
    assert client.leases == {1001}


def test_example_takeover_pairs_through_a_connection() -> None:
    """TAKEOVER is a request like the others: TAKEOVER_STATE answers it, and carries fd_count descriptors."""
    client, server = _open()
    server.receive_data(client.send(EXAMPLES["TAKEOVER"]))
    assert list(server.events()) == [EXAMPLES["TAKEOVER"]]
    client.receive_data(server.send(EXAMPLES["TAKEOVER_STATE"]))
    (reply,) = client.events()
    assert isinstance(reply, TakeoverState) and reply == EXAMPLES["TAKEOVER_STATE"]
    assert reply.fd_count == 2  # one memfd slab + the listener
    assert not client.pending


def test_example_keeper_frames_pair_through_a_connection() -> None:
    """KEEP and UNKEEP are answered by KEPT, RECLAIM by RECLAIMED; KEEP and RECLAIMED carry one fd per slab."""
    client, server = _open()
    unkept = Kept(id=3, models=0, bytes=0)  # UNKEEP is answered by KEPT too
    for request, reply in (
        (EXAMPLES["KEEP"], EXAMPLES["KEPT"]),
        (EXAMPLES["UNKEEP"], unkept),
        (EXAMPLES["RECLAIM"], EXAMPLES["RECLAIMED"]),
    ):
        server.receive_data(client.send(request))
        assert list(server.events()) == [request]
        client.receive_data(server.send(reply))
        assert list(client.events()) == [reply]
    assert not client.pending and not server.pending
    keep, reclaimed = EXAMPLES["KEEP"], EXAMPLES["RECLAIMED"]
    assert isinstance(keep, Keep) and isinstance(reclaimed, Reclaimed)
    assert keep.fd_count == 1 and reclaimed.fd_count == 1


def test_keep_refuses_a_slab_without_an_fd() -> None:
    """A kept slab must travel as an fd (a legacy CUDA IPC handle cannot outlive its process)."""
    keep = EXAMPLES["KEEP"]
    assert isinstance(keep, Keep)
    wire = keep.to_wire()
    wire["model"]["slabs"][0]["fd"] = -1
    with pytest.raises(RemoteProtocolError, match=r"KEEP\.models"):
        decode_frame(wire)
