"""docs/deploy/*.yaml: valid Kubernetes objects (offline schemas), and a deployment the standard NVIDIA device
plugin can schedule: the node daemon requests no GPU, probes name one daemon's socket, flags exist in the CLI.

No cluster is run: kubernetes-validate ships the API's JSON schemas and validates against them locally.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parent.parent / "docs" / "deploy"
# the oldest Kubernetes minor still in wide use, and the newest the validator ships schemas for
VERSIONS = ("1.28.0", kubernetes_validate.utils.latest_version())
GPU = "nvidia.com/gpu"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for f in sorted(DEPLOY.glob("*.yaml")):
        docs += [(f"{f.name}:{d['kind']}/{d['metadata']['name']}", d) for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def _one(kind: str, *, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in _documents() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''} in {DEPLOY}"
    return found[0]


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def _gpus(container: dict[str, Any]) -> list[str]:
    res = container.get("resources", {})
    return [k for part in ("limits", "requests") for k in res.get(part, {}) if k.startswith("nvidia.com/")]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("where", "doc"), _documents(), ids=[w for w, _ in _documents()])
def test_manifest_is_a_valid_kubernetes_object(where: str, doc: dict[str, Any], version: str) -> None:
    """Strict: an unknown or misspelt field fails, as does a wrong type or a missing required field."""
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_is_strict() -> None:
    ds = _one("DaemonSet", name="wcache")
    bad = yaml.safe_load(yaml.safe_dump(ds))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"periodSeconds": 10}  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def test_node_daemon_requests_no_gpu_and_sees_every_gpu() -> None:
    """The device plugin gives a requested GPU to one container exclusively: a daemon that asked for one
    would leave no engine schedulable on it. The daemons see the node's GPUs through the runtime instead."""
    ds = _one("DaemonSet", name="wcache")
    containers = {c["name"]: c for c in _containers(ds)}
    assert {n: _gpus(c) for n, c in containers.items() if _gpus(c)} == {}
    assert _env(containers["daemons"])["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert _env(containers["keeper"])["NVIDIA_VISIBLE_DEVICES"] in ("void", "none")  # no CUDA context needed


def test_engine_requests_its_gpu_and_shares_socket_dir_and_uid_with_the_daemons() -> None:
    ds, engine = _one("DaemonSet", name="wcache"), _one("Deployment")
    (container,) = engine["spec"]["template"]["spec"]["containers"]
    assert _gpus(container) == [GPU]
    for spec_of in (ds, engine):
        spec = spec_of["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsUser"] == 1000
        assert {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}[
            "sockets"
        ] == "/run/wcache"
    script = container["args"][0]
    assert "--query-gpu=uuid" in script and "/run/wcache/${uuid}.sock" in script


def _probes(workload: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for c in _containers(workload):
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            if kind in c:
                out.append((f"{c['name']}.{kind}", " ".join(c[kind]["exec"]["command"])))
    return out


def test_probes_ask_one_socket_each_and_their_flags_exist(tmp_path: Path) -> None:
    """``wcache status --socket-dir`` answers 0 while the keeper alone is up; a probe names each socket."""
    probes = _probes(_one("DaemonSet", name="wcache"))
    assert probes
    for where, cmd in probes:
        assert "wcache status --socket-path" in cmd, where
        assert "--socket-dir" not in cmd, where
    # the flags parse (argparse's usage error is exit 2) and an unreachable daemon fails the probe (exit 1)
    out = subprocess.run(
        [sys.executable, "-m", "wcache.cli", "status", "--socket-path", str(tmp_path / "none.sock"), "--timeout", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1, out.stderr


def test_daemon_and_keeper_command_lines_parse_with_the_real_cli(tmp_path: Path) -> None:
    from wcache.server.cli import parse_args

    ds, config = _one("DaemonSet", name="wcache"), _one("ConfigMap", name="wcache")["data"]
    containers = {c["name"]: c for c in _containers(ds)}
    keeper = containers["keeper"]["args"]
    assert keeper[:1] == ["wcache-keeper"]
    from wcache.server import keeper_cli as keeper_mod

    assert keeper_mod.parse_args(keeper[1:]).socket_dir == Path("/run/wcache")
    script = containers["daemons"]["args"][0]
    # each GPU's daemon sees only that GPU, named by UUID, as its cuda:0
    (line,) = re.findall(r'CUDA_VISIBLE_DEVICES="\$uuid" wcache-server ((?:.*\\\n)*.*)', script)
    line = line.replace("\\\n", " ")
    line = line.replace('"$WCACHE_MODEL"', config["WCACHE_MODEL"]).replace("$WCACHE_ARGS", config["WCACHE_ARGS"])
    line = line.replace("$uuid", "GPU-0").replace('"$port"', "19100").replace(" &", "")
    line = line.replace("$WCACHE_PEERS", config["WCACHE_PEERS"]).replace("$peer", "7070")
    tls = config["WCACHE_PEER_TLS"]
    for path in re.findall(r"/etc/wcache-peer/\S+", tls):  # the Secret's files, here for the CLI's checks
        (tmp_path / Path(path).name).write_text("x")
        tls = tls.replace(path, str(tmp_path / Path(path).name))
    args = parse_args(shlex.split(line.replace("$WCACHE_PEER_TLS", tls)))
    assert args.device == "cuda:0" and args.socket_path == Path("/run/wcache/GPU-0.sock") and args.keeper == ""
    assert args.model == Path(config["WCACHE_MODEL"])
    # fleet fill: rail to rail through the headless Service, over mutual TLS
    assert args.peer_listen == ("0.0.0.0", 7070) and args.fill_from == "dns:wcache-peers:7070"
    assert args.peer_security.mode == "mtls"


def test_peers_are_found_through_a_headless_service_of_ready_pods() -> None:
    svc, ds = _one("Service", name="wcache-peers"), _one("DaemonSet", name="wcache")
    spec = svc["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is False
    assert spec["selector"] == ds["spec"]["template"]["metadata"]["labels"]
    (daemons,) = [c for c in _containers(ds) if c["name"] == "daemons"]
    assert {p["port"] for p in spec["ports"]} == {p["containerPort"] for p in daemons["ports"]}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_scripts_are_valid_bash() -> None:
    scripts = [
        *(
            " ".join(c["args"])
            for _, d in _documents()
            if "template" in d.get("spec", {})
            for c in _containers(d)
            if c.get("command") == ["bash", "-c"]
        ),
        *(
            cmd.removeprefix("bash -c ")
            for _, d in _documents()
            if "template" in d.get("spec", {})
            for _, cmd in _probes(d)
            if cmd.startswith("bash -c ")
        ),
    ]
    assert len(scripts) >= 3
    for s in scripts:
        out = subprocess.run(["bash", "-n", "-c", s], capture_output=True, text=True, timeout=30, check=False)
        assert out.returncode == 0, f"{out.stderr}\n{s}"
