"""An engine's restart imports only what its weight path uses (issue 20): ``import wcache`` loads nothing,
the client and the key load the protocol, the key and the client, never the loader's modules (layout,
sharding, recipes, the daemon)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from wcache.synthetic import TINY, make_llama_checkpoint

#: modules of other paths: the daemon's loader and planning, write-back recipes, integrations
NOT_ON_THE_RESTART_PATH = (
    "wcache.layout",
    "wcache.sharding",
    "wcache.recipe",
    "wcache.transforms",
    "wcache.nn",
    "wcache.server",
    "wcache.integrations",
    "wcache.client.wait",
    "wcache.proto.fleet_frames",  # the peer channel's frames: ~2.4 ms of class building an engine never uses
    "wcache.peer_files",
)


def _loaded(code: str, *args: str) -> list[str]:
    """The wcache modules (and dataclasses) loaded by ``code`` run in a fresh interpreter."""
    probe = (
        code
        + "\nimport sys, json\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith(('wcache', 'dataclasses')))))"
    )
    out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, check=True, timeout=120)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_wcache_loads_no_submodule() -> None:
    assert _loaded("import wcache") == ["wcache"]


def test_the_client_and_key_import_only_the_restart_path() -> None:
    loaded = _loaded("from wcache import WCacheClient, WeightCacheKey")
    assert {"wcache.client.client", "wcache.key", "wcache.proto.connection"} <= set(loaded)
    extra = [m for m in loaded if m.startswith(NOT_ON_THE_RESTART_PATH)]
    assert extra == [], f"the restart path imports {extra}"


def test_errors_stay_importable_by_name() -> None:
    loaded = _loaded("from wcache import CheckpointError, WCacheError; assert issubclass(CheckpointError, WCacheError)")
    assert "wcache.client.client" not in loaded


def test_computing_a_key_imports_no_loader_module(tmp_path: Path) -> None:
    model = tmp_path / "m"
    make_llama_checkpoint(model, TINY, seed=0)
    loaded = _loaded(
        "import sys\nfrom wcache import WCacheClient, WeightCacheKey\nWeightCacheKey.from_checkpoint(sys.argv[1])",
        str(model),
    )
    extra = [m for m in loaded if m.startswith(NOT_ON_THE_RESTART_PATH)]
    assert extra == [], f"computing a key imports {extra}"
