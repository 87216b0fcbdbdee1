"""An engine's restart imports only what its weight path uses (docs/performance.md, "The restart weight path"):
``import wcache`` loads nothing; the client and the key load exactly the modules of the fetch — the engine's own
frames and connection (``wcache.proto.engine``), never the frame declarations, the reference connection, msgpack or
the error tree (a fetch that raises nothing needs none of them), never the other services' frames
(STATUS/PRELOAD/EVICT, write-back, takeover and keeper), never the header scan (checkpoint, files) when the daemon
proves the key from the files' identity (docs/protocol.md §4.3.1), never the loader's modules (layout, sharding,
recipes, the daemon)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import DaemonProc
from wcache.plan.key import RACY_NS
from wcache.synthetic import TINY, make_llama_checkpoint

#: modules of other paths: the daemon's loader and planning, write-back recipes, integrations
NOT_ON_THE_RESTART_PATH = (
    "wcache.plan.rank",  # the planner: a daemon's
    "wcache.plan.layout",
    "wcache.plan.sharding",
    "wcache.plan.recipe",
    "wcache.transforms",
    "wcache.nn",
    "wcache.server",
    "wcache.integrations",
    "wcache.client.wait",
    "wcache.peer_files",
    "wcache.plan.reshard",
    "wcache.plan.checkpoint",
    "wcache.files",
    "wcache.plan.quant",
    "wcache.proto.admin_frames",
    "wcache.proto.deposit_frames",
    "wcache.proto.peer_frames",
    "wcache.proto.fleet_frames",  # the peer channel's frames: ~2.4 ms of class building an engine never uses
    "wcache.proto.frames",  # the registry module
    # the declarations, the reference connection and the error tree: an engine's fetch speaks through its own
    # (wcache.proto.engine), and imports these only when something is refused or raised
    "wcache.proto.fields",
    "wcache.proto.daemon_frames",
    "wcache.proto.connection",
    "wcache.errors",
    "wcache.error_codes",
    "msgpack",  # pymsgpack decodes the engine's small frames; msgpack's C decoder is loaded for a big STATE only
)
#: every wcache module ``from wcache import WCacheClient, WeightCacheKey`` loads: what a fetch needs before its
#: HELLO and GET_STATE are out, and no other
RESTART_PATH = {
    "wcache",
    "wcache.channel",
    "wcache.client",
    "wcache.client.client",
    "wcache.plan",  # the domain package's __init__: a docstring
    "wcache.plan.key",  # the key and its request, RankSpec
    "wcache.proto",
    "wcache.proto._record",
    "wcache.proto.codec",
    "wcache.proto.engine",  # the engine's frames and its connection
    "wcache.proto.limits",
    "wcache.proto.pymsgpack",  # msgpack in Python, for the engine's small frames
    "wcache.proto.table",
}
#: what a host fetch adds (computing the key adds nothing): the mapping's module, loaded while the daemon answers
#: (the CUDA mapping's modules too where CUDA is up)
FETCH_ADDS = {"wcache.client.mapping"}


def _loaded(code: str, *args: str) -> list[str]:
    """The wcache modules (and dataclasses, msgpack) loaded by ``code`` run in a fresh interpreter."""
    probe = (
        code
        + "\nimport sys, json\n"
        + "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('wcache', 'dataclasses', 'msgpack')))))"
    )
    out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, check=True, timeout=120)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_wcache_loads_no_submodule() -> None:
    assert _loaded("import wcache") == ["wcache"]


def test_the_client_and_key_import_only_the_restart_path() -> None:
    loaded = _loaded("from wcache import WCacheClient, WeightCacheKey")
    assert {m for m in loaded if m.startswith("wcache")} == RESTART_PATH
    extra = [m for m in loaded if m.startswith(NOT_ON_THE_RESTART_PATH)]
    assert extra == [], f"the restart path imports {extra}"


def test_python_importtime_reports_every_module_of_the_restart_path() -> None:
    """benchmarks/import_bench.py prices the engine's import from ``python -X importtime``, which reports only
    what the import statement's path loads (``importlib.import_module``'s module is left out, its own time
    falling to nobody): every wcache module the engine's import loads must be in the report."""
    code = "from wcache import WCacheClient, WeightCacheKey"
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    reported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert {m for m in _loaded(code) if m.startswith("wcache")} - reported == set()


def test_the_wire_modules_import_nothing_until_a_name_is_read() -> None:
    """``import wcache.proto`` loads nothing; one frame name loads its own module, the registry every one."""
    assert _loaded("import wcache.proto") == ["wcache", "wcache.proto"]
    one = _loaded("from wcache.proto import State")
    assert "wcache.proto.daemon_frames" in one and not [
        m for m in one if m.endswith(("admin_frames", "peer_frames", "fleet_frames"))
    ]
    every = _loaded("from wcache.proto import FRAME_TYPES")
    assert {
        "wcache.proto.admin_frames",
        "wcache.proto.deposit_frames",
        "wcache.proto.peer_frames",
        "wcache.proto.fleet_frames",
    } <= set(every)
    # a submodule a from-import asks the package for is imported alone, not searched for among the frames
    # and the framing module imports neither msgpack nor the error tree until it encodes, decodes or fails
    assert _loaded("from wcache.proto import codec") == ["wcache", "wcache.proto", "wcache.proto.codec"]


def test_the_wire_package_exports_every_frame_module_name() -> None:
    """``wcache.proto``'s names are its modules' ``__all__``, no list of its own: every frame class and part is
    one, and each name it lists is there."""
    import wcache.proto
    from wcache.proto.frames import FRAME_MODULES

    names = set(wcache.proto.__all__)
    for module in map(importlib.import_module, FRAME_MODULES):
        assert set(module.__all__) <= names, module.__name__
    assert {"Connection", "Frame", "FRAME_TYPES", "pack_frame", "decode_frame", "TRANSITIONS"} <= names
    assert all(getattr(wcache.proto, n) is not None for n in names)


def test_errors_stay_importable_by_name() -> None:
    loaded = _loaded("from wcache import CheckpointError, WCacheError; assert issubclass(CheckpointError, WCacheError)")
    assert "wcache.client.client" not in loaded


def test_every_error_class_and_the_recipe_key_are_names_of_the_package_loaded_when_read() -> None:
    """``from wcache import InUseError`` works for every error class ``wcache.errors`` defines (the README and the
    ``wcache`` command name them), ``RecipeKey`` (a deposit's key) too: each loads its own module when read,
    nothing before."""
    import wcache
    import wcache.errors

    classes = {n for n in wcache.errors.__all__ if isinstance(getattr(wcache.errors, n), type)}
    assert classes - {"ErrorCode"} <= set(wcache.__all__)
    assert _loaded("import wcache\nwcache.RemoteProtocolError, wcache.InUseError, wcache.OutOfMemoryError") == [
        "wcache",
        "wcache.errors",
    ]
    recipe = _loaded("from wcache import RecipeKey")
    assert "wcache.plan.recipe" in recipe and "wcache.client.client" not in recipe


def test_wcache_nn_and_the_integrations_are_reached_from_a_plain_import_when_read() -> None:
    """``import wcache`` then ``wcache.nn.guard_writes`` (the README's words): the submodule loads when read."""
    assert "wcache.nn" in _loaded("import wcache\nwcache.nn.guard_writes")
    hf = _loaded("import wcache\nwcache.integrations.transformers.from_pretrained")
    assert "wcache.integrations.transformers" in hf and "wcache.integrations.vllm" not in hf
    assert _loaded("import wcache.integrations") == ["wcache", "wcache.integrations"]


def test_computing_a_key_imports_no_loader_module(tmp_path: Path) -> None:
    model = tmp_path / "m"
    make_llama_checkpoint(model, TINY, seed=0)
    loaded = _loaded(
        "import sys\nfrom wcache import WCacheClient, WeightCacheKey\nWeightCacheKey.from_checkpoint(sys.argv[1])",
        str(model),
    )
    extra = [m for m in loaded if m.startswith(NOT_ON_THE_RESTART_PATH)]
    assert extra == [], f"computing a key imports {extra}"
    assert {m for m in loaded if m.startswith("wcache")} == RESTART_PATH  # the key's request is the key's module


def test_the_cuda_mapping_loads_neither_the_daemons_cuda_module_nor_the_client() -> None:
    """What a CUDA fetch adds while the daemon answers is the client's ctypes driver and its CUDA mapping: not
    ``wcache._cuda`` (the daemon's export, cuda-bindings) — the mapped range's owner is the driver's — and the
    driver module alone imports neither torch nor the client, as the daemon's ``wcache._cuda`` takes it."""
    cuda = _loaded("import wcache.client.cuda")
    assert {"wcache.client.cuda", "wcache.client.driver"} <= set(cuda)
    assert "wcache._cuda" not in cuda
    bare = _loaded("import sys, wcache.client.driver; assert 'torch' not in sys.modules")
    assert "wcache.client.client" not in bare
    daemon_side = _loaded("import sys, wcache._cuda; assert 'torch' not in sys.modules")
    assert "wcache.client.client" not in daemon_side


@pytest.fixture(scope="module")
def settled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose files the daemon can prove (none changed within RACY_NS of its read)."""
    model = make_llama_checkpoint(tmp_path_factory.mktemp("imports") / "m", TINY, seed=0)
    newest = max(os.stat(p).st_ctime_ns for p in model.iterdir())
    time.sleep(max(0.0, (newest + RACY_NS - time.time_ns()) / 1e9 + 0.05))
    return model


def test_a_proven_fetch_imports_no_header_scan(
    daemon_factory: Callable[..., DaemonProc], settled: Path, tmp_path: Path
) -> None:
    """A restart whose files the daemon recognises never loads the scan's modules (checkpoint, files): the key
    costs a listing and a stat per file; a changed file loads them (the fallback), and is served the same."""
    daemon = daemon_factory(settled)
    fetch = (
        "import sys\nfrom wcache import WCacheClient, WeightCacheKey\n"
        "key = WeightCacheKey.from_checkpoint(sys.argv[1])\n"
        "w = WCacheClient(sys.argv[2]).fetch_sync(key)\nassert len(w) > 0 and w.key_proven != key.scanned\n"
        "w.release_sync()\n"
    )
    loaded = _loaded(fetch, str(settled), str(daemon.socket))
    extra = [m for m in loaded if m.startswith(NOT_ON_THE_RESTART_PATH)]
    assert extra == [], f"a proven fetch imports {extra}"
    assert {m for m in loaded if m.startswith("wcache")} == RESTART_PATH | FETCH_ADDS
    touched = tmp_path / "touched"
    shutil.copytree(settled, touched)  # other inodes: the daemon did not read these files
    scanned = _loaded(fetch, str(touched), str(daemon.socket))
    assert {"wcache.plan.checkpoint", "wcache.files"} <= set(scanned)


def test_an_engines_restart_path_runs_no_collection(daemon_factory: Callable[..., DaemonProc], settled: Path) -> None:
    """From ``import wcache`` to every view built, the cyclic GC collects nothing: the paused import and fetch
    move what they made (modules, the STATE's table, the views) to the oldest generation as each pause ends
    (``codec.keep_young``), so no young collection traverses it afterwards (one such pass cost ~0.6 ms, the
    objects of the import left young; docs/performance.md, "The restart weight path"). The collector starts
    from an empty young generation, as the path's own allocations are what is measured."""
    daemon = daemon_factory(settled)
    code = (
        "import gc, json, sys\nimport torch\nruns = []\n"
        "gc.collect()\n"
        "gc.callbacks.append(lambda phase, info: runs.append(info['generation']) if phase == 'start' else None)\n"
        "import wcache\nfrom wcache import WCacheClient, WeightCacheKey\n"
        "key = WeightCacheKey.from_checkpoint(sys.argv[1])\n"
        "w = WCacheClient(sys.argv[2]).fetch_sync(key)\nw.materialize()\n"
        "print(json.dumps({'runs': runs, 'tensors': len(w), 'enabled': gc.isenabled()}))\nw.release_sync()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(settled), str(daemon.socket)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["tensors"] > 0 and seen["enabled"] is True
    assert seen["runs"] == [], f"collections of generations {seen['runs']} ran on the restart path"
