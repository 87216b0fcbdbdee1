"""The README's "Use it" section runs as pasted: its commands make a checkpoint and serve it, and its Python
snippet fetches from that daemon (and, without one, falls back to the disk). Only the checkpoint path and
``$XDG_RUNTIME_DIR`` (where the default socket directory goes) are the test's own."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from wcache import WCacheClient
from wcache.server.process import spawn_daemon

README = Path(__file__).resolve().parents[1] / "README.md"
PLACEHOLDER = "/tmp/llama-small"


def _section() -> str:
    text = README.read_text()
    return text[text.index("## Use it\n") :].split("\n## ", 1)[0]


def _snippet() -> str:
    (code,) = re.findall(r"```python\n(.*?)```", _section(), re.S)
    return str(code)


def _commands() -> dict[str, list[str]]:
    (block,) = re.findall(r"```bash\n(.*?)```", _section(), re.S)[:1]
    cmds = {}
    for line in block.splitlines():
        words = shlex.split(line.split("#", 1)[0].replace(" &", ""))
        if words:
            cmds[words[0] if words[0] != "wcache" else f"wcache {words[1]}"] = words
    return cmds


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, env=env)


def test_the_use_it_section_runs_as_pasted(tmp_path: Path) -> None:
    model = tmp_path / "llama-small"
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(run)}
    cmds = _commands()
    assert set(cmds) >= {"wcache make-checkpoint", "wcache-server", "wcache status"}
    mk = [a.replace(PLACEHOLDER, str(model)) for a in cmds["wcache make-checkpoint"]]
    made = _run([sys.executable, "-m", "wcache", *mk[1:]], env)
    assert made.returncode == 0, made.stderr
    server = cmds["wcache-server"]
    assert server[1:3] == ["--model", PLACEHOLDER]
    script = tmp_path / "engine.py"
    script.write_text(_snippet().replace(f'"{PLACEHOLDER}"', repr(str(model))))

    # the README's wcache-server line, in the default socket directory ($XDG_RUNTIME_DIR/wcache); --keeper
    # finds no keeper here (optional), which costs a log line
    sock_dir = run / "wcache"
    sock_dir.mkdir(mode=0o700)
    d = spawn_daemon(model, sock_dir, *server[3:], env=env, timeout=120)
    try:
        out = _run([sys.executable, str(script)], env)
        assert out.returncode == 0, out.stderr
        assert "loading from disk" not in out.stdout and re.search(r"^\d+ tensors, \d+ MB$", out.stdout, re.M)
        (m,) = asyncio.run(WCacheClient(d.socket).status()).models
        assert m.last_use > 0 and m.leases == 0  # fetched from this daemon, and released
        status = _run([sys.executable, "-m", "wcache", *cmds["wcache status"][1:]], env)
        assert status.returncode == 0 and str(model) in status.stdout, status.stdout + status.stderr
    finally:
        assert d.stop() == 0
    out = _run([sys.executable, str(script)], env)  # no daemon: the fallback path of the same snippet
    assert out.returncode == 0, out.stderr
    assert "not from the cache (CacheUnavailableError); loading from disk" in out.stdout
