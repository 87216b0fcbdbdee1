"""PRELOAD and the engine's key: the rank a request names is the rank the daemon plans, keys and loads.

Regression tests for the two bugs that came from describing one rank in six places, and for the codes a
PRELOAD's user errors reach the client with (docs/protocol.md §6)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import DaemonProc
from tests.server.test_checkpoint_files import _fifo_config
from wcache import WCacheClient, WeightCacheKey
from wcache.errors import CheckpointError, ErrorCode, ShardingError, TransformError, WCacheError
from wcache.nn import load_weights
from wcache.plan.key import RankSpec

FUSE = "wcache.transforms:fuse_llama_qkv_gate_up"


async def test_preload_under_verify_content_finds_the_model_already_held(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path
) -> None:
    """Bug: the PRELOAD's "already held" check keyed the model without ``verify_content``, so a daemon
    started with --verify-content loaded it again (and a full budget refused or evicted it)."""
    d = daemon_factory(ckpt, "--verify-content")
    client = WCacheClient(d.socket)
    key = WeightCacheKey.from_checkpoint(ckpt, verify_content=True)
    async with await client.fetch(key) as w:
        assert len(w) > 0
        again = await client.preload(RankSpec(ckpt))
    assert again.key == key.to_wire()
    assert again.load_seconds == 0 and again.evicted == ()  # "0 if it already was" (PRELOADED, §4)
    st = await client.status()
    assert [m.key for m in st.models] == [key.to_wire()]


async def test_load_weights_with_a_transform_is_served_by_a_daemon_of_that_transform(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path
) -> None:
    """Bug: ``nn.load_weights`` built its key without ``transform``: a daemon serving that transform
    answered KEY_MISMATCH and the engine always loaded from disk."""
    d = daemon_factory(ckpt, "--transform", FUSE)
    got = await load_weights(ckpt, transform=FUSE, client=WCacheClient(d.socket), fallback=False)
    try:
        assert got.source == "cache"
        assert "model.layers.0.self_attn.qkv_proj.weight" in got.tensors
    finally:
        await got.release()


async def test_preload_user_errors_reach_the_client_as_their_own_classes(
    daemon: DaemonProc, ckpt: Path, tmp_path: Path
) -> None:
    """A bad directory, plan or transform is the requester's error: its own code and class (docs/protocol.md
    §6, codes 40-42), never INTERNAL; and the daemon keeps serving (the PRELOAD lock was released)."""
    client = WCacheClient(daemon.socket)
    not_a_checkpoint = tmp_path / "photos"
    not_a_checkpoint.mkdir()
    (not_a_checkpoint / "cat.jpg").write_bytes(b"\xff\xd8")
    bad_plan = tmp_path / "plan.json"
    bad_plan.write_text('{"rules": "all of them"}')
    cases: list[tuple[RankSpec, type[WCacheError], ErrorCode]] = [
        (RankSpec(not_a_checkpoint), CheckpointError, ErrorCode.INVALID_CHECKPOINT),
        (RankSpec(tmp_path / "missing"), CheckpointError, ErrorCode.INVALID_CHECKPOINT),
        (RankSpec(_fifo_config(tmp_path / "fifo")), CheckpointError, ErrorCode.INVALID_CHECKPOINT),
        (RankSpec(ckpt, plan_file=bad_plan), ShardingError, ErrorCode.INVALID_PLAN),
        (RankSpec(ckpt, plan_file=tmp_path / "no-plan.json"), ShardingError, ErrorCode.INVALID_PLAN),
        (RankSpec(ckpt, transform="nope"), TransformError, ErrorCode.INVALID_TRANSFORM),
        (RankSpec(ckpt, transform="wcache.transforms:missing"), TransformError, ErrorCode.INVALID_TRANSFORM),
        # imported, but raises when called (here: divmod of the tensors and the config)
        (RankSpec(ckpt, transform="builtins:divmod"), TransformError, ErrorCode.INVALID_TRANSFORM),
    ]
    for spec, cls, code in cases:
        with pytest.raises(cls) as info:
            await client.preload(spec, timeout=60)
        assert type(info.value) is cls and info.value.code is code, spec
    again = await client.preload(RankSpec(ckpt))
    assert again.load_seconds == 0  # still serving the model it started with
