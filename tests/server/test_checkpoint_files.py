"""The daemon and hostile checkpoint directories (docs/security.md, checkpoint directories), end to end.

A checkpoint it cannot open safely, or cannot serve within the protocol's limits, is refused — at
start-up with exit status 1 and no socket, by PRELOAD with an ERROR — and the daemon keeps serving;
bytes it serves are those of the files it validated. Engines fall back to disk on any WCacheError.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProc
from tests.plan.test_checkpoint import one_tensor_dir
from wcache import WCacheClient, WeightCacheKey
from wcache.errors import CheckpointError, ErrorCode, ProtocolError
from wcache.plan.key import RankSpec
from wcache.synthetic import LlamaShape, make_llama_checkpoint

SMALL = LlamaShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512)


def _fifo_config(root: Path) -> Path:
    model = make_llama_checkpoint(root, SMALL, shards=2, seed=5)
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    return model


def _fifo_index(root: Path) -> Path:
    model = make_llama_checkpoint(root, SMALL, shards=2, seed=6)
    (model / "model.safetensors.index.json").unlink()
    os.mkfifo(model / "model.safetensors.index.json")
    return model


def _long_name(root: Path) -> Path:
    return one_tensor_dir(root, name="w" * 2000)


def _huge_dim(root: Path) -> Path:
    return one_tensor_dir(root, shape=[2**60, 0])


def _not_utf8(root: Path) -> Path:
    """A good checkpoint in a directory whose name is not UTF-8 (legal on Linux): the daemon reports and hands over
    its path as a string, so it refuses it at start (it served it, and then STATUS answered INTERNAL, and KEEP and
    a takeover failed, on every call)."""
    return make_llama_checkpoint(root.parent / os.fsdecode(b"ck-\xff"), SMALL, seed=7)


def _start(model: Path, socket_dir: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run wcache-server on ``model`` to its end (a deadline, not a hang): (result, ready file)."""
    ready = socket_dir.parent / "ready.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "wcache.server.cli",
            "--model",
            str(model),
            "--socket-dir",
            str(socket_dir),
            "--ready-file",
            str(ready),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    return out, ready


@pytest.mark.parametrize("make", [_fifo_config, _fifo_index, _long_name, _huge_dim, _not_utf8])
def test_daemon_refuses_to_start_on_a_checkpoint_it_cannot_open_or_serve(
    tmp_path: Path, socket_dir: Path, make: Callable[[Path], Path]
) -> None:
    out, ready = _start(make(tmp_path / "bad"), socket_dir)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]  # one clear line
    assert not ready.exists()
    assert not [p for p in socket_dir.iterdir() if p.is_socket()]  # nothing left that would accept engines


@pytest.mark.parametrize("make", [_fifo_config, _fifo_index, _long_name, _huge_dim])
async def test_preload_of_a_bad_checkpoint_is_refused_and_the_daemon_keeps_serving(
    tmp_path: Path, daemon: DaemonProc, ckpt: Path, make: Callable[[Path], Path]
) -> None:
    client = WCacheClient(daemon.socket)
    with pytest.raises(CheckpointError) as info:  # INVALID_CHECKPOINT: the requester's error, not INTERNAL
        await client.preload(RankSpec(make(tmp_path / "bad")), timeout=60)
    assert info.value.code is ErrorCode.INVALID_CHECKPOINT
    good = make_llama_checkpoint(tmp_path / "good", SMALL, seed=7)
    r = await client.preload(RankSpec(good), timeout=60)  # the PRELOAD lock was not left held
    assert r.tensors == 21
    for model in (ckpt, good):
        async with await client.fetch(WeightCacheKey.from_checkpoint(model), timeout=60) as w:
            assert len(w) > 0


def test_the_loaded_slab_holds_the_validated_files_bytes_when_a_shard_is_swapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's own load path (load.load_model): the shard is replaced between planning (key,
    headers) and the data reads. The slab is the validated file's bytes, served under its key."""
    from wcache.server import load
    from wcache.server.backends.host import HostBackend
    from wcache.server.loader import load_into

    a = make_llama_checkpoint(tmp_path / "a", SMALL, seed=1)
    b = make_llama_checkpoint(tmp_path / "b", SMALL, seed=2)
    shard = a / "model.safetensors"
    original = shard.read_bytes()
    key_a = WeightCacheKey.from_checkpoint(a).resolve()  # before the swap (a deferred key scans when read)

    def swap_then_load(*args: Any, **kwargs: Any) -> Any:
        tmp = shard.with_name("swap.tmp")
        shutil.copyfile(b / "model.safetensors", tmp)
        os.replace(tmp, shard)
        return load_into(*args, **kwargs)

    monkeypatch.setattr(load, "load_into", swap_then_load)
    model = load.load_model(RankSpec(a), backend=HostBackend(), threads=2)
    try:
        assert shard.read_bytes() != original
        assert model.key == key_a
        _, (fd,) = model.slabs[0].export()  # the sealed memfd engines receive
        slab = os.pread(fd, model.slabs[0].size, 0)
        header = json.loads(original[8 : 8 + int.from_bytes(original[:8], "little")])
        start = 8 + int.from_bytes(original[:8], "little")
        for entry in model.table:
            lo, hi = header[entry.name]["data_offsets"]
            assert slab[entry.offset : entry.offset + hi - lo] == original[start + lo : start + hi], entry.name
    finally:
        model.close()


async def test_engine_fallback_catches_a_daemon_that_breaks_the_protocol(tmp_path: Path) -> None:
    """The documented fallback is ``except WCacheError``: a daemon whose frames the client rejects
    (ProtocolError) leads to the disk path like a missing daemon does."""
    from wcache.nn import load_weights

    model = make_llama_checkpoint(tmp_path / "m", SMALL, seed=8)

    class GarbageDaemon:
        async def fetch(self, key: WeightCacheKey, mode: str = "zero_copy") -> Any:
            raise ProtocolError("TensorTable.names: tensor names must be strings of 1..1024 characters")

    w = await load_weights(model, client=GarbageDaemon())
    assert w.source == "disk" and "ProtocolError" in w.reason
    assert len(w.tensors) == 21
