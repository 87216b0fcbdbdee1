"""docs/deploy/*.service: the systemd units' command lines parse with the real CLI, each GPU's metrics port is one
nothing common on a GPU host listens on, and what the comments promise about /run/wcache is what the unit says."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parent.parent / "docs" / "deploy"
#: ports commonly taken on GPU hosts (exporters, engines, launchers, cluster agents): none may be a daemon's
COMMON = {
    22,
    2379,
    2380,
    3000,
    5000,
    6006,
    6379,
    8000,
    8001,
    8002,
    8080,
    8265,
    8888,
    9090,
    9091,
    9093,
    9100,
    9400,
    10001,
    10250,
    29400,
    29500,
    30000,
}
EPHEMERAL = range(32768, 61000)  # Linux's default ip_local_port_range


def _unit(name: str) -> dict[str, list[str]]:
    text = (DEPLOY / name).read_text().replace("\\\n", " ")
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


@pytest.mark.parametrize("gpu", range(16))
def test_each_gpus_daemon_parses_and_gets_a_port_nothing_common_uses(gpu: int) -> None:
    from wcache.server.cli import parse_args

    (start,) = _unit("wcache@.service")["ExecStart"]
    sh, flag, script = shlex.split(start)
    assert (sh, flag) == ("/bin/sh", "-c")
    script = script.replace("%i", str(gpu)).replace("$$", "$")
    script = script.replace("${WCACHE_MODEL}", "/models/m").replace("${WCACHE_TP_SIZE}", "16")
    script = re.sub(r"\$\(\((\d+) \+ (\d+)\)\)", lambda m: str(int(m.group(1)) + int(m.group(2))), script)
    words = shlex.split(script)
    assert words[:2] == ["exec", "/usr/local/bin/wcache-server"]
    args = parse_args(words[2:])
    assert args.device == f"cuda:{gpu}" and args.tp_rank == gpu and args.socket_dir == Path("/run/wcache")
    assert args.metrics_port not in COMMON and args.metrics_port not in EPHEMERAL and args.metrics_port > 1024


def test_what_the_units_say_about_the_runtime_directory_is_what_they_do() -> None:
    for name in ("wcache@.service", "wcache-keeper.service"):
        unit = _unit(name)
        assert unit["RuntimeDirectory"] == ["wcache"] and unit["RuntimeDirectoryPreserve"] == ["yes"], name
    comments = (DEPLOY / "wcache@.service").read_text()
    assert "removed when the last unit stops" not in comments and "kept when\n# units stop" in comments


@pytest.mark.parametrize("name", ["wcache@.service", "wcache-keeper.service"])
def test_the_units_wait_for_readiness_from_the_process_they_start(name: str) -> None:
    """Type=notify: the daemon and the keeper send READY=1 once they serve (wcache/server/notify.py), so
    TimeoutStartSec bounds the load and units ordered after them start then. Only the main process may notify:
    the command it runs is wcache's own, a shell ``exec``-ing it at most (tests/server/test_notify.py checks that
    the sender is the process started)."""
    unit = _unit(name)
    assert unit["Type"] == ["notify"] and unit.get("NotifyAccess", ["main"]) == ["main"], name
    (start,) = unit["ExecStart"]
    words = shlex.split(start)
    if words[:2] == ["/bin/sh", "-c"]:
        words = shlex.split(words[2].replace("$$", "$"))
        assert words[0] == "exec", f"{name}: the shell must exec the program, or the shell is the main process"
        words = words[1:]
    assert Path(words[0]).name in ("wcache-server", "wcache-keeper"), name


@pytest.mark.parametrize("name", ["wcache@.service", "wcache-keeper.service"])
def test_the_units_documentation_is_somewhere_a_pip_install_puts_it(name: str) -> None:
    """pip installs no /usr/share/doc/wcache: a Documentation= line may only name a web address."""
    for where in _unit(name).get("Documentation", []):
        assert all(w.startswith(("https://", "http://")) for w in where.split()), f"{name}: {where}"
