"""The README's "Use it" section runs as pasted: its commands make a checkpoint and serve it, and its Python
snippet fetches from that daemon (and, without one, falls back to the disk). Only the checkpoint path and
``$XDG_RUNTIME_DIR`` (where the default socket directory goes) are the test's own. What its prose writes as code
holds too: every ``wcache.…`` function and error class it names is reachable after a plain ``import wcache``,
every error class it names imports from ``wcache``, ``load_weights`` returns what it says, and its write-back
recipe key deposits and fetches back."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch

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


def _inline() -> list[str]:
    """The README's inline code spans (in backquotes, outside fenced blocks), in order, each on one line."""
    text = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    return [" ".join(c.split()) for c in re.findall(r"`([^`]+)`", text)]


def _span(start: str) -> str:
    """The one inline span of the README that starts with ``start``."""
    (span,) = [c for c in _inline() if c.startswith(start)]
    return span


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
        cached = asyncio.run(_load_weights_as_described(model, d.socket))
        assert (cached["source"], cached["reason"]) == ("cache", "")
        assert asyncio.run(_write_back_as_described(model, d.socket)) == [1.0, 2.0, 3.0]
    finally:
        assert d.stop() == 0
    out = _run([sys.executable, str(script)], env)  # no daemon: the fallback path of the same snippet
    assert out.returncode == 0, out.stderr
    assert "not from the cache (CacheUnavailableError); loading from disk" in out.stdout
    disk = asyncio.run(_load_weights_as_described(model, d.socket))
    assert disk["source"] == "disk" and "CacheUnavailableError" in str(disk["reason"])
    assert disk["tensors"] == cached["tensors"] and cached["tensors"]


async def _load_weights_as_described(model: Path, socket: Path) -> dict[str, object]:
    """``load_weights`` and every ``loaded.NAME`` the README says its result has (``release`` awaited)."""
    import wcache.nn

    said = {m for c in _inline() for m in re.findall(r"\bloaded\.(\w+)", c)}
    assert said >= {"tensors", "source", "reason", "release"}, said
    loaded = await wcache.nn.load_weights(model, client=WCacheClient(socket, wait_for_daemon=0))
    seen: dict[str, object] = {name: getattr(loaded, name) for name in said if name != "release"}
    await loaded.release()
    seen["tensors"] = len(loaded.tensors)
    return seen


async def _write_back_as_described(model: Path, socket: Path) -> list[float]:
    """The README's write-back: its imports, its recipe key for MODEL and its deposit, then a fetch of that key."""
    code = "\n".join(
        [
            _span("from wcache import RecipeKey"),
            f"MODEL = {str(model)!r}",
            _span("recipe_key = RecipeKey.of("),
            "async def deposit(client, tensors):",
            "    " + _span("await client.deposit(recipe_key, tensors)"),
        ]
    )
    scope: dict[str, object] = {}
    exec(code, scope)
    client = WCacheClient(socket)
    await scope["deposit"](client, {"w": torch.tensor([1.0, 2.0, 3.0])})  # type: ignore[operator]
    async with await client.fetch(scope["recipe_key"]) as w:  # type: ignore[arg-type]
        return [float(x) for x in w["w"]]


def test_every_wcache_name_the_readme_writes_is_reachable_after_a_plain_import() -> None:
    """The README writes ``wcache.nn.guard_writes(…)``, ``wcache.integrations.transformers.from_pretrained(…)``
    and names error classes: each works in a fresh interpreter after ``import wcache`` alone (its names are
    imported on first access), and each error class imports from ``wcache`` (where ``wcache errors`` names it)."""
    spans = _inline()
    dotted = sorted(
        {
            m.group(1)
            for c in spans
            for m in re.finditer(r"\b(wcache(?:\.\w+)+)(?=\(|$|\W)", c)
            if c[m.end() :].startswith("(") or m.group(1).endswith("Error")
        }
    )
    errors = sorted({c for c in spans if re.fullmatch(r"[A-Z]\w*Error", c)})
    imports = [c for c in spans if c.startswith("from wcache import ")]
    assert "wcache.nn.guard_writes" in dotted and "RemoteProtocolError" in errors and imports
    probe = (
        "import functools, json, sys\nimport wcache\n"
        "names, errors, imports = json.loads(sys.argv[1])\n"
        "for name in names:\n    functools.reduce(getattr, name.split('.')[1:], wcache)\n"
        "for name in errors:\n    exec(f'from wcache import {name}')\n"
        "for line in imports:\n    exec(line)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, json.dumps([dotted, errors, imports])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
