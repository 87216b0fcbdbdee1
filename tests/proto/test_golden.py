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
    "HELLO_OK": "4f2dc2676c797bd56f68c3daa01af9d95a58c5c4d0995ec80d5c1a964ec18516",
    "GET_STATE": "1b92d8cc0cfb481298ad908c0699b17a98f83e5ff7fcca005c74c0a94419ebf9",
    "STATE": "af05d0a3ce39ceccc138f2aff19186d530780bee512b20bbd909a5f1eef82c27",
    "RELEASE": "4ea87e2d6977136feca27491ddbfa70d3b558d43d8899566d110df85e439fdb8",
    "RELEASED": "74090ef68c2f761c9be1e44eb771c01cc2ab6621e2c10b4923557f28d28d19de",
    "STATUS": "5b8b33533ee8d6b02521a3f8df27b4b83c21c0da4d9988e35af6ce976e92f2f0",
    "STATUS_REPLY": "73143fd1fb871425bc212c7ecc807d7f63862d6dc718774be2b944b43d335039",
    "PRELOAD": "01208cff98ee8e644b89556625253edb737cb2a1538a7e45c0344438a860084c",
    "PRELOADED": "761dca17e0c2920958d7ee8ea7c00ec5be95c5b50b959d8c8a2c50b3d49a74d8",
    "EVICT": "60f441b622be048d4ed2fd569a5155c0292aa154d0efd8e3361a3c69c888d6a3",
    "EVICTED": "de025c111592d508e6b7bfd34ff6be624b57ae8052f28f86dc352df209e1a9b6",
    "TAKEOVER": "bb2aba7c57fcc59016fc87ecc45d27c7169a5749b457734bc7d07bc3e9d4c140",
    "TAKEOVER_STATE": "961e4fff2f807d1786959adbc39ab88ec8e962db7af71c122be8de9e9f1b91c4",
    "TAKEOVER_ADOPTED": "607d96e5a2257b60ed528a3b9073a6d727e983ac0f6f61a1c25157d11db37d25",
    "TAKEOVER_DONE": "ea08d628ee6a2442fd87c8d811c40eb7886e4dc53a76c48856afe0900d2333cf",
    "KEEP": "08c325865a35e1ed7f410b4c247b97c2f43d855152c9d51a8f1fcd0a6f0732c9",
    "KEPT": "61a8afc94775e8ddd904c189cb59d54593c9e9528d2097223d9378f4c201c0c6",
    "UNKEEP": "8f2b2bec8728854bc081814bf5e5db345f6dab4c529bb98f467f737a98a1dafd",
    "RECLAIM": "ee07cffa27351ffc299670153bf11724ee5335ca208765a46c53f10780677092",
    "RECLAIMED": "0e6887d5e0a3c679f874b9043732c2c7fd2b7382757039306e94d8373e4654c2",
    "DEPOSIT": "0431ae2cf060e8727256e442fbc9ff1500799493bdfac87dde3d64e2115e4696",
    "DEPOSIT_SLAB": "a36754d94c14d860d18dc9c8285a91f10cbf4e011a5cc4f3b3279749a52777e6",
    "COMMIT": "4be6ba6dddd36d150d86836695cc2f2502f8fd8ecfa1c47a9bf9dbd52ffd1b67",
    "DEPOSITED": "54dc28eba1e877b9aff1fa2971789565cd709aca9ed1babb5223b2ce6361fc78",
    "ERROR": "5ac24b710d35fb2379588c463d9876c7d9ea64f48b79a0b0a3dd7bad7c3bef92",
    "PEER_AUTH": "0162f4ac0145fe195c57239d66cec40a565b575538dbc5d041c687f1d6b9bdae",
    "PEER_CHALLENGE": "9eabcda1381a19c15627c9b1f847b773c49f617193ab3d6be11fbd1647089401",
    "PEER_PROOF": "cf3c82de810078efc1fd6f392e121961d0330b8aa886cf34af93789ed257978b",
    "PEER_AUTH_OK": "525efa74287ff17ddb2963d4075d0cc5003a846feb741637124123baef5f8755",
    "PEER_QUERY": "808328c3e74beb27e615bcb50d3f8e9b0569676e272be00072fc163cd5287468",
    "PEER_OFFER": "3ee2799ec3558c8f6a01f88ed18eee3672b72e0d74359d80e32c1ac798b34399",
    "PEER_READ": "b135e177b7789c52ebecd2292c50f5d047e6a44477624abe9ec1a92400b11964",
    "PEER_READ_OK": "1f12a97732b9d442ae2823c63f672315178b79eda7cf57afc64fbeeef9c649df",
    "PEER_FILES": "f1fdfda1913dcc8303bd84194859b9bafab46e905e9600dd32cf8afc69f75bac",
    "PEER_FILES_REPLY": "4eb707ff3eab9aa05390d268f35bc9ed579895c76d133e4f6652e03230f1da3b",
    # variants: optional fields that change a frame's shape (§4.3.1's proof)
    "GET_STATE with a proof": "c03abb1dcc02f3833af92abe96c5b3c462851652951b7a8b26e8bed726e3af7d",
    # §4.8: a model filled from the host tier, the tier's page-locked entries
    "STATUS_REPLY after a host-tier refill": "04da9ca6b9d7beb981a3692a25020010428f0a5cf495d6d218ca7e64fa554f38",
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


def test_examples_are_what_a_daemon_sends() -> None:
    """§8 shows live frames, not stale ones: keys as a daemon serves them (every field of today's layout, in its
    order; a recipe's fields after them by name), the max_frame_size a daemon announces, and the KEY_MISMATCH a
    daemon serving the example key answers to a GET_STATE asking float16 of it (message and details whole)."""
    from wcache.plan.facts import key_mismatch
    from wcache.plan.key import LAYOUT_VERSION, WeightCacheKey
    from wcache.plan.recipe import RecipeKey
    from wcache.proto import Deposited, ErrorFrame, GetState, HelloOk, State
    from wcache.proto.codec import MAX_REQUEST_SIZE

    get, state, deposited = EXAMPLES["GET_STATE"], EXAMPLES["STATE"], EXAMPLES["DEPOSITED"]
    assert isinstance(get, GetState) and isinstance(state, State) and isinstance(deposited, Deposited)
    served = WeightCacheKey.from_wire(dict(state.key))
    assert list(served.to_wire().items()) == list(state.key.items()) == list(get.key.items())
    assert served.layout == LAYOUT_VERSION
    recipe = RecipeKey.from_wire(dict(deposited.key))
    assert list(recipe.to_wire().items()) == list(deposited.key.items())
    hello_ok = EXAMPLES["HELLO_OK"]
    assert isinstance(hello_ok, HelloOk) and hello_ok.max_frame_size == MAX_REQUEST_SIZE
    asked = {**get.key, "dtype": "float16"}
    assert EXAMPLES["ERROR"] == ErrorFrame.from_exception(key_mismatch(asked, [served]), get.id)
