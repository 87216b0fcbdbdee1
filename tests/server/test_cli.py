"""The command lines: every option explained, sizes with units, values refused before the daemon would serve
nobody, clean errors (no traceback) for bad checkpoints and paths, interruption while loading, status exit."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import DaemonProc, run_cli, server_cmd
from wcache import WCacheClient, WeightCacheKey, __version__
from wcache.cli import build_parser as wcache_parser
from wcache.cli import parse_args as wcache_args
from wcache.demo import build_parser as demo_parser
from wcache.errors import ErrorCode, InsecurePathError, OutOfMemoryError
from wcache.plan.recipe import RecipeKey
from wcache.server import cli as server_cli
from wcache.server import keeper_cli
from wcache.server.backends import host
from wcache.server.security import DaemonLock
from wcache.synthetic import LlamaShape, make_llama_checkpoint
from wcache.units import format_size, parse_size

ROOT = os.geteuid() == 0


def run_server(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(server_cmd(*args), capture_output=True, text=True, timeout=120, check=False, env=env)


def clean_failure(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


# ---------------------------------------------------------------- options


def _options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    acts = []
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sp in a.choices.values():
                acts += _options(sp)
        elif a.dest != "help":
            acts.append(a)
    return acts


PARSERS = pytest.mark.parametrize(
    "parser",
    [server_cli.build_parser, keeper_cli.build_parser, wcache_parser, demo_parser],
    ids=["wcache-server", "wcache-keeper", "wcache", "wcache-demo"],
)


@PARSERS
def test_every_option_has_help(parser: Callable[[], argparse.ArgumentParser]) -> None:
    missing = [a.option_strings or a.dest for a in _options(parser()) if not a.help]
    assert missing == []


@PARSERS
def test_every_option_with_a_default_says_it(parser: Callable[[], argparse.ArgumentParser]) -> None:
    """An operator reads ``--help``, not the docs: an option that defaults to a value (not off, not derived) says
    which (docs/deploy named --keeper-check's 5 s, --help did not)."""
    silent = []
    for a in _options(parser()):
        if a.default in (None, False, "", argparse.SUPPRESS) or a.nargs == 0 or not a.help:
            continue  # a flag, or nothing to say
        shown = a.help % {"default": a.default, "prog": "", "metavar": a.metavar} if "%(" in a.help else a.help
        if str(a.default) not in shown and "default" not in shown:
            silent.append(a.option_strings)
    assert silent == []


@PARSERS
def test_help_is_plain_text(parser: Callable[[], argparse.ArgumentParser]) -> None:
    """``wcache --help`` and ``wcache-demo --help`` showed their module docstring's reStructuredText markup
    (````wcache````, ````status````)."""
    p = parser()
    subs = [a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    for text in [p.format_help(), *(sp.format_help() for choices in subs for sp in choices.values())]:
        assert "``" not in text


def test_the_daemon_and_the_keeper_take_the_same_log_levels_and_list_them() -> None:
    """wcache-keeper's --log-level took any word (its --help listed no choices, and an unknown level was a
    traceback from logging at start, exit 0); it is now wcache-server's option: the same choices, in any case."""

    def option(p: argparse.ArgumentParser) -> argparse.Action:
        (a,) = [a for a in p._actions if "--log-level" in a.option_strings]
        return a

    server, keeper = option(server_cli.build_parser()), option(keeper_cli.build_parser())
    assert server.choices and list(keeper.choices or ()) == list(server.choices)
    assert (keeper.default, keeper.help) == (server.default, server.help)
    assert keeper_cli.parse_args(["--log-level", "debug"]).log_level == "DEBUG"
    with pytest.raises(SystemExit) as e:
        keeper_cli.parse_args(["--log-level", "LOUD"])
    assert e.value.code == 2


def test_subcommands_have_help() -> None:
    sub = next(a for a in wcache_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {c.dest for c in sub._choices_actions if c.help} == {"status", "preload", "evict", "make-checkpoint"}


@pytest.mark.parametrize(
    "cmd",
    [
        server_cmd("--version"),
        [sys.executable, "-m", "wcache", "--version"],
        [sys.executable, "-m", "wcache.cli", "--version"],
        [sys.executable, "-m", "wcache.server.keeper_cli", "--version"],
        [sys.executable, "-m", "wcache.demo", "--version"],
    ],
)
def test_version(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.split()[-1] == __version__


def test_help_names_default_socket_dir() -> None:
    sub = next(a for a in wcache_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = server_cli.build_parser().format_help() + sub.choices["status"].format_help()
    assert text.count("XDG_RUNTIME_DIR") >= 2 and "/tmp/wcache-UID" in text


@pytest.mark.parametrize(
    ("text", "n"),
    [("4096", 4096), ("16G", 16 << 30), ("512MiB", 512 << 20), ("1.5GiB", 3 << 29), ("2GB", 2 * 10**9), ("8k", 8192)],
)
def test_sizes(text: str, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 bytes"), (999, "999 bytes"), (4096, "4.1 KB"), (96893952, "96.9 MB"), (16060522496, "16.06 GB")],
)
def test_sizes_for_people(n: int, text: str) -> None:
    assert format_size(n) == text


@pytest.mark.parametrize("opt", ["--memory-budget", "--host-tier", "--staging-bytes", "--max-frame-size"])
def test_every_size_option_takes_units(opt: str) -> None:
    args = server_cli.parse_args([opt, "1GiB"])
    assert getattr(args, opt[2:].replace("-", "_")) == 1 << 30
    with pytest.raises(SystemExit) as e:
        server_cli.parse_args([opt, "12parsecs"])
    assert e.value.code == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-frame-size", "0"],
        ["--max-frame-size", str(1 << 33)],
        ["--idle-timeout", "-1"],
        ["--idle-timeout", "nan"],
        ["--frame-timeout", "0"],
        ["--threads", "0"],
        ["--metrics-port", "70000"],
        ["--log-level", "chatty"],
    ],
)
def test_values_that_would_serve_nobody_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        server_cli.parse_args(argv)
    assert e.value.code == 2


@pytest.mark.parametrize("device", ["cuda:x", "cuda:-1", "gpu0", "cuda:GPU-1234"])
def test_device_that_is_not_a_device_name_is_refused(device: str) -> None:
    with pytest.raises(SystemExit) as e:
        server_cli.parse_args(["--device", device])
    assert e.value.code == 2


def test_tp_ranges_are_checked_by_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    """One range check (wcache.plan.key.tp_problem) for wcache-server, wcache preload and wcache evict."""
    for parse, argv in (
        (server_cli.parse_args, []),
        (wcache_args, ["preload", "/m"]),
        (wcache_args, ["evict", "/m"]),
    ):
        for bad, says in (
            (["--tp-rank", "5", "--tp-size", "2"], "--tp-rank 5 must be in [0, 2) for --tp-size 2"),
            (["--tp-size", "0"], "--tp-size 0 must be at least 1"),
            (["--tp-rank", "-1", "--tp-size", "2"], "--tp-rank -1 must be in [0, 2)"),
        ):
            with pytest.raises(SystemExit) as e:
                parse([*argv, *bad])
            assert e.value.code == 2
            assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        wcache_args(["evict", "/m", "--tp-rank", "-1"])


@pytest.mark.parametrize(
    ("parse", "argv", "prog", "says"),
    [
        (server_cli.parse_args, ["--tp-rank", "2"], "wcache-server", "--tp-rank 2 must be in [0, 1)"),
        (server_cli.parse_args, ["--memory-budget", "10XB"], "wcache-server", "'10XB' is not a size"),
        (server_cli.parse_args, ["--tp-rank", "abc"], "wcache-server", "invalid int value: 'abc'"),
        (wcache_args, [], "wcache", "the following arguments are required"),
        (wcache_args, ["status", "--timeout", "soon"], "wcache status", "invalid float value: 'soon'"),
        (wcache_args, ["evict", "/m", "--recipe", "a=b", "--no-deposit"], "wcache evict", "--recipe picks deposits"),
        (keeper_cli.parse_args, ["--max-fds", "0"], "wcache-keeper", "--max-fds must be at least 1"),
        (demo_parser().parse_args, ["--restarts", "x"], "wcache-demo", "invalid int value: 'x'"),
    ],
)
def test_a_usage_error_is_one_line_naming_help(
    capsys: pytest.CaptureFixture[str], parse: Callable[[list[str]], object], argv: list[str], prog: str, says: str
) -> None:
    """A bad argument is one line, as every other start-up error is (argparse printed its whole usage first, ~22
    lines for wcache-server), with argparse's exit status 2: ``PROG: error: MESSAGE (PROG --help for usage)``."""
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{prog}: error: ") and line.endswith(f" ({prog} --help for usage)") and says in line


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a torch built without CUDA (the README's CPU build)")
def test_cuda_device_without_cuda_is_one_line_before_the_lock(ckpt: Path, socket_dir: Path) -> None:
    """The README's --device cuda:0 on the CPU torch it installs: one line saying what to do, exit 1, and
    nothing created in the socket directory (the device is checked before the lock)."""
    out = run_server("--model", str(ckpt), "--socket-dir", str(socket_dir), "--device", "cuda:0")
    clean_failure(out)
    (line,) = out.stderr.strip().splitlines()
    assert "--device cuda:0 cannot be used here" in line and "built without CUDA" in line and "--device cpu" in line
    assert list(socket_dir.iterdir()) == []


# ---------------------------------------------------------------- paths


def test_socket_path_naming_a_regular_file_is_refused_and_kept(ckpt: Path, socket_dir: Path) -> None:
    f = socket_dir / "notes.txt"
    f.write_text("precious")
    out = run_server("--model", str(ckpt), "--socket-path", str(f))
    clean_failure(out)
    assert f.read_text() == "precious"


@pytest.mark.parametrize("shared", ["/tmp", "/dev/shm", "sticky"])
def test_shared_directory_gets_a_private_subdirectory_advice(tmp_path: Path, ckpt: Path, shared: str) -> None:
    d = Path(shared)
    if shared == "sticky":
        d = tmp_path / "shared"
        d.mkdir()
        os.chmod(d, 0o1777)
    if not d.is_dir():
        pytest.skip(f"no {d} here")
    out = run_server("--model", str(ckpt), "--socket-path", str(d / "x.sock"))
    clean_failure(out)
    assert f"chmod 700 {d}" not in out.stderr and "chown" not in out.stderr
    assert f"mkdir -m 700 {d}/wcache-" in out.stderr
    assert not (d / "x.sock").exists() and not (d / "x.sock.lock").exists()  # refused before touching it


@pytest.mark.skipif(not ROOT, reason="needs root to chown a directory to another user")
@pytest.mark.parametrize("which", ["socket", "tier"])
def test_directory_precreated_by_another_user_is_refused_naming_the_way_out(
    tmp_path: Path, ckpt: Path, which: str
) -> None:
    runtime = tmp_path / "run"
    theirs = runtime / "wcache" if which == "socket" else tmp_path / "tier"
    runtime.mkdir(mode=0o700)
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    extra = (
        []
        if which == "socket"
        else ["--socket-dir", str(runtime / "own"), "--host-tier", "1G", "--host-tier-dir", str(theirs)]
    )
    if which == "tier":
        (runtime / "own").mkdir(mode=0o700)
    out = run_server("--model", str(ckpt), *extra, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    clean_failure(out)
    assert "owned by uid 65534" in out.stderr
    assert ("XDG_RUNTIME_DIR" if which == "socket" else "--host-tier-dir") in out.stderr


@pytest.mark.parametrize("what", ["missing", "a-file"])
def test_a_model_that_is_no_directory_is_named_where_a_daemon_serves_the_rank(
    daemon: DaemonProc, socket_dir: Path, tmp_path: Path, what: str
) -> None:
    """A mistyped --model beside a daemon already serving the rank was reported as the lock ("another wcache-server
    ... already serves"): the directory is checked (one stat) before the lock is taken, and the error names it."""
    model = tmp_path / "no-such-model"
    if what == "a-file":
        model.write_text("weights?")
    out = run_server("--model", str(model), "--socket-dir", str(socket_dir))
    clean_failure(out)
    (line,) = out.stderr.strip().splitlines()
    assert line == f"wcache-server: error: checkpoint directory {model} does not exist or is not a directory"
    assert run_cli("status", "--socket-path", str(daemon.socket)).returncode == 0  # the running daemon serves on


def test_unusable_lock_file_is_a_clean_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sock = tmp_path / "x.sock"
    Path(str(sock) + ".lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InsecurePathError, match="symlink"):
        DaemonLock(sock).acquire()

    def denied(*a: object, **k: object) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("wcache.server.security.os.open", denied)  # a non-root daemon facing root's .lock
    with pytest.raises(InsecurePathError, match="rm "):
        DaemonLock(tmp_path / "y.sock").acquire()


# ---------------------------------------------------------------- checkpoints


def _safetensors(d: Path, name: str) -> None:
    hdr = json.dumps({name: {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, ensure_ascii=True).encode()
    hdr += b" " * (-len(hdr) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr + bytes(8))


@pytest.mark.parametrize("defect", ["surrogate-name", "deep-config", "deep-index", "bin-only"])
def test_bad_checkpoint_is_a_clean_error(tmp_path: Path, socket_dir: Path, defect: str) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    if defect == "surrogate-name":
        _safetensors(d, "a\ud800b")
    elif defect == "deep-config":
        _safetensors(d, "a")
        (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    elif defect == "deep-index":
        _safetensors(d, "a")
        (d / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    else:
        (d / "pytorch_model.bin").write_bytes(b"PK")
    out = run_server("--model", str(d), "--socket-dir", str(socket_dir))
    clean_failure(out)
    if defect == "bin-only":
        assert "safe_serialization=True" in out.stderr


def test_deep_shard_plan_is_a_sharding_error(tmp_path: Path, ckpt: Path) -> None:
    from wcache.errors import ShardingError
    from wcache.plan.sharding import load_plan_file

    plan = tmp_path / "plan.json"
    plan.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ShardingError, match="plan"):
        load_plan_file(plan)


def test_a_sharded_start_without_config_json_says_the_directory_has_none(tmp_path: Path, socket_dir: Path) -> None:
    """--tp-size 2 picks a built-in plan by config.json's architecture: a directory without one is told so (it
    read "architecture '(none in config.json)'", as if config.json existed and named none)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    _safetensors(d, "a")
    out = run_server("--model", str(d), "--tp-size", "2", "--socket-dir", str(socket_dir))
    clean_failure(out)
    assert "has no config.json" in out.stderr and "none in config.json" not in out.stderr, out.stderr


def test_missing_plan_names_the_client_argument(tmp_path: Path) -> None:
    from wcache.errors import ShardingError
    from wcache.plan.sharding import resolve_plan

    with pytest.raises(ShardingError, match="plan_file=") as e:
        resolve_plan("GPTNeoXForCausalLM", 2)
    assert "--shard-plan" in e.value.message and "docs/shard-plans.md" in e.value.message


# ---------------------------------------------------------------- memory


def test_memory_room_reads_cgroup_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "a" / "b").mkdir(parents=True)
    (v2 / "a" / "memory.max").write_text(f"{1 << 30}\n")
    (v2 / "a" / "memory.current").write_text(f"{300 << 20}\n")
    (v2 / "a" / "memory.stat").write_text(f"anon 1\nactive_file {50 << 20}\ninactive_file {50 << 20}\n")
    (v2 / "a" / "b" / "memory.max").write_text("max\n")
    (v2 / "a" / "b" / "memory.current").write_text("5\n")
    (tmp_path / "cg2").write_text("0::/a/b\n")
    room = host.memory_room(tmp_path / "cg2", v2, tmp_path / "no-meminfo")
    assert room is not None and (room.limit, room.in_use) == (1 << 30, 200 << 20)
    assert str(v2 / "a") in room.where

    v1 = tmp_path / "v1" / "memory" / "pod"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    (tmp_path / "cg1").write_text("9:name=systemd:/\n4:memory:/pod\n0::/\n")
    room = host.memory_room(tmp_path / "cg1", tmp_path / "v1", tmp_path / "no-meminfo")
    assert room is not None and room.free == 1 << 30


def test_slab_past_the_memory_limit_is_refused_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "memory_room", lambda: host.MemoryRoom("memory cgroup /sys/fs/cgroup/x", 1 << 30, 0))
    with pytest.raises(OutOfMemoryError, match="memory cgroup /sys/fs/cgroup/x") as e:
        host.HostBackend().allocate(2 << 30)
    assert e.value.code is ErrorCode.OUT_OF_MEMORY and e.value.details["limit"] == 1 << 30
    host.HostBackend().allocate(1 << 20).close()


def test_a_model_over_the_memory_budget_at_start_names_the_option_and_the_sizes(ckpt: Path, socket_dir: Path) -> None:
    """A --memory-budget too small for --model was refused in raw bytes ("96893952 bytes do not fit the
    10000000-byte budget"), naming no option: the line names --memory-budget and gives the sizes for people too,
    beside the exact bytes. The error's details (wire protocol) are as they were."""
    from wcache.plan.key import RankSpec
    from wcache.server.load import planned_bytes
    from wcache.server.store import Store

    needed = planned_bytes(RankSpec(ckpt))[1]
    out = run_server("--model", str(ckpt), "--socket-dir", str(socket_dir), "--memory-budget", "1MB")
    clean_failure(out)
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(
        f"wcache-server: error: {needed} bytes ({format_size(needed)}) do not fit the --memory-budget of 1000000 "
        "bytes (1.0 MB): "
    ), line
    with pytest.raises(OutOfMemoryError) as e, Store(host.HostBackend(), [], budget=10**6).loading(needed):
        pass
    assert e.value.details == {
        "needed": needed,
        "budget": 10**6,
        "resident": 0,
        "pending": 0,
        "loading": 0,
        "lingering": 0,
        "pinned": [],
    }


# ---------------------------------------------------------------- lifecycle


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_load_exits_without_traceback(ckpt: Path, socket_dir: Path, tmp_path: Path, sig: int) -> None:
    marker = tmp_path / "loading"
    env = {**os.environ, "WCACHE_TEST_LOADING": str(marker)}
    cmd = server_cmd(
        "--model", str(ckpt), "--socket-dir", str(socket_dir), "--transform", "tests.server.blocking_transform:block"
    )
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.02)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert not (socket_dir / "wcache-rank0.sock").exists()


def test_status_exits_nonzero_when_a_listed_daemon_is_unreachable(daemon: DaemonProc, socket_dir: Path) -> None:
    assert run_cli("status", "--socket-dir", str(socket_dir)).returncode == 0
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(socket_dir / "wcache-rank1.sock"))  # a crashed daemon's socket file: nobody listens
    stale.close()
    out = run_cli("status", "--socket-dir", str(socket_dir))
    assert out.returncode == 1
    assert str(daemon.socket) in out.stdout  # the live one is still listed


def test_status_prints_a_memory_line_where_its_help_says(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, tmp_path: Path
) -> None:
    """``wcache status --help`` promised a line of device memory and host-tier use for every daemon; a daemon on the
    CPU without --host-tier has neither and gets none. The help says which daemons get it (on a GPU, or with
    --host-tier), and those do."""
    sub = next(a for a in wcache_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for text in (sub.choices["status"].format_help(), wcache_parser().format_help()):
        said = " ".join(text.split())  # as wrapped for the terminal
        assert "on a GPU or with --host-tier, a line of its free device memory and host-tier use" in said
    plain = daemon_factory(ckpt)
    out = run_cli("status", "--socket-path", str(plain.socket))
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 2  # the header and the model's row
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    tiered = daemon_factory(ckpt, "--host-tier", "64MB", "--host-tier-dir", str(tmp_path / "tier"), sdir=other)
    out = run_cli("status", "--socket-path", str(tiered.socket))
    assert out.returncode == 0, out.stderr
    *_, line = out.stdout.splitlines()
    assert line.startswith(f"{tiered.socket}: host tier ") and "of 0.06 GB" in line, out.stdout


@pytest.mark.parametrize("json_out", [True, False])
def test_status_into_a_closed_pipe_ends_without_a_traceback(
    daemon: DaemonProc, socket_dir: Path, json_out: bool
) -> None:
    """``wcache status --json | head``: the reader is gone before the output is written (here: before it starts,
    so every write fails). Exit 1 and stderr without a BrokenPipeError traceback."""
    r, w = os.pipe()
    os.close(r)
    try:
        argv = [sys.executable, "-m", "wcache.cli", "status", "--socket-dir", str(socket_dir)]
        out = subprocess.run(
            argv + (["--json"] if json_out else []),
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(w)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


def test_status_reports_a_stale_socket_at_once_saying_whether_a_daemon_is_coming(
    daemon: DaemonProc, socket_dir: Path
) -> None:
    """Nothing is waited for (it used to wait the client's 5 s for a socket whose lock was held): each row says
    whether a daemon is coming back to it."""
    starting = socket_dir / "wcache-rank1.sock"  # a daemon still starting: its lock held, nobody listening yet
    stale = socket_dir / "wcache-rank2.sock"  # a crashed daemon's socket, nothing coming
    for path in (starting, stale):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    lock = DaemonLock(starting)
    lock.acquire()
    try:
        out = run_cli("status", "--socket-dir", str(socket_dir))
    finally:
        lock.release()
    assert out.returncode == 1
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert f"a daemon is coming back (its lock {starting}.lock is held by pid {os.getpid()})" in rows[str(starting)]
    assert "waited" not in rows[str(starting)]
    assert "nothing is coming back to it (a stale socket" in rows[str(stale)]
    assert str(daemon.socket) in rows


@pytest.mark.parametrize("what", ["nothing", "no-directory", "a-file"])
def test_status_of_a_path_with_no_socket_says_so(tmp_path: Path, what: str) -> None:
    """``wcache status --socket-path P`` where P is no socket: the row says there is none there (or that P is not a
    socket), not that it is a stale socket to remove (the advice for a crashed daemon's socket: removing a file the
    operator named is no fix)."""
    p = tmp_path / ("none" if what == "no-directory" else "") / "x.sock"
    if what == "a-file":
        p.write_text("precious")
    out = run_cli("status", "--socket-path", str(p))
    assert out.returncode == 1
    (row,) = [line for line in out.stdout.splitlines() if line.startswith(str(p))]
    assert "stale socket" not in row and "remove the file" not in row, row
    says = "that path is not a socket" if what == "a-file" else "there is no socket at that path"
    assert says in row, row
    assert what != "a-file" or p.read_text() == "precious"


@pytest.mark.parametrize("what", ["nothing", "a-file", "empty"])
def test_status_of_a_socket_directory_that_is_not_there_says_so(tmp_path: Path, what: str) -> None:
    """``wcache status --socket-dir D`` (and ``wcache evict``) with no D said "no daemon sockets in D", as for an
    empty directory: a mistyped directory is named as one that does not exist (or is no directory)."""
    d = tmp_path / "sock"
    if what == "a-file":
        d.write_text("precious")
    elif what == "empty":
        d.mkdir(mode=0o700)
    out = run_cli("status", "--socket-dir", str(d))
    assert out.returncode == 1 and out.stdout == ""
    says = {"nothing": "does not exist", "a-file": "is not a directory", "empty": ""}[what]
    why = f"socket directory {d} {says}" if says else f"no daemon sockets in {d}"
    assert out.stderr.strip() == f"wcache: {why}"
    out = run_cli("evict", str(tmp_path / "model"), "--socket-dir", str(d))  # as evict finds the daemons
    assert out.returncode == 1 and out.stderr.strip() == f"wcache evict: NotFoundError: {why}: nothing to evict from"


# ---------------------------------------------------------------- wcache evict


SMALL = LlamaShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512)


def _served(sock: Path) -> list[dict[str, Any]]:
    """What the daemon at ``sock`` serves: its models' wire maps, as ``wcache status --json`` gives them."""
    out = run_cli("status", "--socket-path", str(sock), "--json")
    assert out.returncode == 0, out.stderr
    models: list[dict[str, Any]] = json.loads(out.stdout)[str(sock)]["models"]
    return models


def _fingerprint(model: Path) -> str:
    return WeightCacheKey.from_checkpoint(model).resolve().fingerprint


def test_a_changed_checkpoints_models_are_told_apart_and_the_stale_one_evicted(
    daemon_factory: Callable[..., DaemonProc], tmp_path: Path, socket_dir: Path
) -> None:
    """A checkpoint rewritten on disk and PRELOADed again: the daemon serves its old and its new model. Status
    tells them apart (a fingerprint column, the old one marked stale; ``stale`` in the JSON), evict lists the
    options that pick each — and those options evict that one (they used to name the new key twice, which evicted
    the new model) — and ``--stale`` evicts what the directory no longer gives, even once it is gone."""
    model = tmp_path / "m"
    make_llama_checkpoint(model, SMALL, seed=1)
    old = _fingerprint(model)
    d = daemon_factory(model)
    make_llama_checkpoint(model, SMALL, seed=2)
    new = _fingerprint(model)
    assert run_cli("preload", str(model), "--socket-dir", str(socket_dir)).returncode == 0
    assert {m["key"]["fingerprint"]: m["stale"] for m in _served(d.socket)} == {old: True, new: False}

    table = run_cli("status", "--socket-dir", str(socket_dir)).stdout.splitlines()
    assert table[0].split()[:4] == ["SOCKET", "CHECKPOINT", "FINGERPRINT", "RANK"]
    (old_row,) = [r for r in table if old[:12] in r]
    (new_row,) = [r for r in table if new[:12] in r]
    assert f"{old[:12]} (stale)" in old_row and "stale" not in new_row

    where = ("--socket-dir", str(socket_dir))
    both = run_cli("evict", str(model), *where)
    assert both.returncode == 1, both.stdout
    picks = [line.strip().split("    (")[0] for line in both.stderr.splitlines()[1:]]
    assert len(picks) == 2 and len(set(picks)) == 2, both.stderr
    (pick_old,) = [p for p in picks if old[:12] in p]
    one = run_cli("evict", str(model), *pick_old.split(), *where)
    assert one.returncode == 0, one.stderr
    assert [m["key"]["fingerprint"] for m in _served(d.socket)] == [new]

    make_llama_checkpoint(model, SMALL, seed=3)  # changed again: the model served is now the stale one
    newer = _fingerprint(model)
    assert run_cli("preload", str(model), *where).returncode == 0
    assert run_cli("evict", str(model), "--stale", *where).returncode == 0
    assert [m["key"]["fingerprint"] for m in _served(d.socket)] == [newer]
    nothing = run_cli("evict", str(model), "--stale", *where)
    assert nothing.returncode == 1 and "NotFoundError" in nothing.stderr
    assert len(_served(d.socket)) == 1

    shutil.rmtree(model)  # gone: the directory gives no key
    assert [m["stale"] for m in _served(d.socket)] == [True]
    gone = run_cli("evict", str(model), "--stale", *where)
    assert gone.returncode == 0, gone.stderr
    assert _served(d.socket) == []


def _deposit(sock: Path, model: Path, engine: str, quantization: str) -> None:
    key = RecipeKey.of(WeightCacheKey.from_checkpoint(model).resolve(), engine=engine, quantization=quantization)
    asyncio.run(WCacheClient(sock).deposit(key, {"layers.0.weight": torch.randn(8, 8)}))


def _recipes(sock: Path) -> set[tuple[str, str]]:
    """(engine, quantization) of each model served; ("", "") for the checkpoint's own."""
    return {(m["key"].get("engine", ""), m["key"].get("quantization", "")) for m in _served(sock)}


def test_deposits_are_models_of_their_checkpoint_to_wcache_evict(
    daemon_factory: Callable[..., DaemonProc], ckpt: Path, socket_dir: Path
) -> None:
    """A directory's deposits are among what ``wcache evict DIR`` finds (a bare evict used to evict the checkpoint's
    own model silently beside them, and --all failed with a NotFoundError listing the very deposit): with several
    served, nothing is evicted and the options listed pick each one — --no-deposit the checkpoint's own model,
    --deposit ENGINE (and --recipe FIELD=VALUE between two of one engine) a deposit; --all evicts them all."""
    d = daemon_factory(ckpt)
    for engine, quantization in (("mine", "fp8"), ("mine", "int4"), ("theirs", "fp8")):
        _deposit(d.socket, ckpt, engine, quantization)
    every = {("", ""), ("mine", "fp8"), ("mine", "int4"), ("theirs", "fp8")}
    assert _recipes(d.socket) == every
    where = ("--socket-dir", str(socket_dir))

    listed = run_cli("evict", str(ckpt), *where)
    assert listed.returncode == 1, listed.stdout
    assert _recipes(d.socket) == every
    picks = [line.strip().split("    (")[0] for line in listed.stderr.splitlines()[1:]]
    assert len(picks) == 4 and len(set(picks)) == 4, listed.stderr
    for gone, says in ((("mine", "int4"), "quantization=int4"), (("", ""), "--no-deposit")):
        (pick,) = [p for p in picks if says in p]
        out = run_cli("evict", str(ckpt), *pick.split(), *where)
        assert out.returncode == 0, out.stderr
        every -= {gone}
        assert _recipes(d.socket) == every

    out = run_cli("evict", str(ckpt), "--deposit", "theirs", *where)
    assert out.returncode == 0, out.stderr
    assert _recipes(d.socket) == {("mine", "fp8")}

    _deposit(d.socket, ckpt, "theirs", "fp8")
    assert run_cli("preload", str(ckpt), *where).returncode == 0
    out = run_cli("evict", str(ckpt), "--all", *where)
    assert out.returncode == 0, out.stderr
    assert _served(d.socket) == []


# ---------------------------------------------------------------- wcache make-checkpoint


@pytest.mark.parametrize("under", [False, True], ids=["the-file", "a-directory-in-it"])
def test_make_checkpoint_at_a_file_is_a_one_line_usage_error(tmp_path: Path, under: bool) -> None:
    """``wcache make-checkpoint PATH`` with PATH (or a directory above it) an existing file: exit 2, as for any bad
    argument, with one line naming the file (it was a FileExistsError traceback), and the file left as it was."""
    f = tmp_path / "notes.txt"
    f.write_text("precious")
    out = run_cli("make-checkpoint", str(f / "ckpt" if under else f), "--size", "1MB")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert f"{f} is a file, not a directory" in line
    assert f.read_text() == "precious"


@pytest.mark.parametrize("shards", [1, 2])
def test_make_checkpoint_writes_the_files_its_help_names_with_the_umasks_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shards: int
) -> None:
    """Its help named an index for every checkpoint (one file gets none), and the safetensors files were 0600 (the
    library's writer) beside 0644 for the others: every file has the mode ``open()`` gives under the umask."""
    from wcache.cli import main

    sub = next(a for a in wcache_parser()._actions if isinstance(a, argparse._SubParsersAction))
    said = " ".join(sub.choices["make-checkpoint"].format_help().split())
    assert "in one file (model.safetensors) or in several (--shards; by default one per 2 GB) with their index" in said
    d = tmp_path / "ckpt"
    old = os.umask(0o027)
    try:
        assert main(["make-checkpoint", str(d), "--size", "1MB", "--shards", str(shards)]) == 0
    finally:
        os.umask(old)
    assert capsys.readouterr().out.startswith(f"wrote {d}: ")
    weights = ["model.safetensors"] if shards == 1 else [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    index = ["model.safetensors.index.json"] if shards > 1 else []
    modes = {f.name: f.stat().st_mode & 0o7777 for f in d.iterdir()}
    assert sorted(modes) == sorted(["config.json", "wcache-synthetic.json", *weights, *index])
    assert set(modes.values()) == {0o640}


def test_python_m_wcache_synthetic_names_itself_as_it_was_run(tmp_path: Path) -> None:
    """``python -m wcache.synthetic`` is ``wcache make-checkpoint`` under another name: its help and its errors name
    the command that was run (they named ``wcache make-checkpoint``)."""
    prog = f"{os.path.basename(sys.executable)} -m wcache.synthetic"

    def synthetic(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "wcache.synthetic", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)

    shown = synthetic("--help")
    assert shown.returncode == 0 and shown.stdout.startswith(f"usage: {prog} [-h]"), shown.stdout
    d = tmp_path / "ckpt"
    bad = synthetic(str(d), "--size", "1XB")
    assert bad.returncode == 2 and bad.stderr.startswith(f"{prog}: error: argument --size: "), bad.stderr
    made = synthetic(str(d), "--size", "1MB")
    assert made.returncode == 0 and (d / "model.safetensors").is_file(), made.stderr


# ---------------------------------------------------------------- wcache preload


def test_preload_names_the_models_its_budget_evicted_as_status_does(
    daemon_factory: Callable[..., DaemonProc], tmp_path: Path, socket_dir: Path
) -> None:
    """A PRELOAD past --memory-budget evicts the least recently used model; ``wcache preload`` names it by its
    directory, rank and dtype (and fingerprint), as status and evict do — it printed ``LlamaForCausalLM@<hex>``."""
    from wcache.plan.key import RankSpec
    from wcache.server.load import planned_bytes

    a, b, c = (make_llama_checkpoint(tmp_path / n, SMALL, seed=i) for i, n in enumerate("abc"))
    budget = sum(planned_bytes(RankSpec(m))[1] for m in (a, b)) + planned_bytes(RankSpec(c))[1] // 2
    d = daemon_factory(a, "--memory-budget", str(budget))
    where = ("--socket-dir", str(socket_dir))
    assert run_cli("preload", str(b), *where).returncode == 0
    out = run_cli("preload", str(c), *where)  # room for two: a, the least recently used, goes
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(f"; evicted {a} tp0/1 bfloat16, fingerprint {_fingerprint(a)[:12]}"), out.stdout
    assert {m["source"] for m in _served(d.socket)} == {str(b), str(c)}
