"""The fill's NIXL agent in a child process (wcache/server/agent_process.py): how it ends, whatever happens to it.
The fills through it are tests/server/test_fill.py's (its ``agent`` fixture) and test_fill_daemon.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from wcache.errors import FillError
from wcache.server.agent_process import AgentProcess
from wcache.server.backends.host import HostBackend

pytest.importorskip("nixl_cu12", reason="the fleet extra (pip install -e '.[fleet]') is not installed")


def _name() -> str:
    return f"t-agent-{os.getpid()}-{time.monotonic_ns()}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_agent_the_child_cannot_make_fails_the_first_call_and_closes_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """UCX refusing to make the agent (here: a transport list it does not know) is the first call's FillError
    (reason ``nixl``), and ``close`` then ends the child at once. Before, the start's error reply was taken as
    no reply at all: every later call, ``close`` among them, waited its whole limit (10 s) for a start reply
    that had come, then SIGKILLed the child."""
    monkeypatch.setenv("UCX_TLS", "nosuchtransport")
    agent = AgentProcess(_name())
    slab = HostBackend().allocate(1 << 16)
    try:
        with pytest.raises(FillError) as err:
            agent.register_slab(slab)
        assert err.value.details["reason"] == "nixl"
        t0 = time.monotonic()
        agent.close()
        assert time.monotonic() - t0 < 5.0
        assert agent._proc is not None and agent._proc.returncode == 0  # it exited when asked, not killed
    finally:
        agent.close()
        slab.close()


def test_a_child_never_used_is_ended_without_waiting_for_its_agent() -> None:
    """A fill that found nothing to READ (no peer holds the key) closes its agent before the child has made its
    NIXL agent: ``close`` does not wait for it (~0.5 s per fill that ended early)."""
    agent = AgentProcess(_name())
    pid = agent.pid
    t0 = time.monotonic()
    agent.close()
    assert time.monotonic() - t0 < 0.4
    assert pid is not None and not _alive(pid)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGRTMIN + 6], ids=["SIGKILL", "realtime"])
def test_a_death_seen_first_in_a_cleanup_is_what_every_later_call_says(sig: int) -> None:
    """A child that died is named by the signal that ended it (a real-time signal by its number: naming it raised
    ValueError, which escaped the fill's cleanups), in the first call that sees it and in every one after: a
    death first seen by ``deregister`` (which never raises) used to leave the next call saying only "closed"."""
    agent = AgentProcess(_name())
    slab = HostBackend().allocate(1 << 16)
    try:
        reg = agent.register_slab(slab)
        assert agent.pid is not None
        os.kill(agent.pid, sig)
        time.sleep(0.2)
        agent.deregister(reg)  # sees the death; never raises
        assert agent.closed
        with pytest.raises(FillError) as err:
            agent.add_peer(b"metadata")
        name = signal.Signals(sig).name if sig == signal.SIGKILL else f"signal {sig}"
        assert err.value.details["reason"] == "nixl" and name in err.value.message, err.value.message
        assert err.value.details["status"] == -sig
    finally:
        agent.close()
        slab.close()


def test_the_child_imports_nothing_from_the_daemons_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon started in a directory holding a ``json.py`` (or any module name the child imports): the child
    imports the daemon's own modules (``-P``, then the daemon's sys.path). Before, ``python -c`` put the working
    directory first and the child exited (status 3 here) at its first import."""
    (tmp_path / "json.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "msgpack.py").write_text("raise SystemExit(3)\n")
    monkeypatch.chdir(tmp_path)
    agent = AgentProcess(_name())
    slab = HostBackend().allocate(1 << 16)
    try:
        reg = agent.register_slab(slab)
        assert reg.region.length == 1 << 16 and reg.region.kind == "host"
        agent.deregister(reg)
        assert not agent.closed
    finally:
        agent.close()
        slab.close()


def test_a_child_outlives_no_daemon(tmp_path: Path) -> None:
    """A daemon that exits (``os._exit``, as its stop does; or killed) with a slab registered in its fill's agent:
    the child exits at once and maps nothing of it."""
    script = tmp_path / "daemon.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            from wcache.server.agent_process import AgentProcess
            from wcache.server.backends.host import HostBackend
            agent = AgentProcess("t-orphan")
            slab = HostBackend().allocate(1 << 16)
            agent.register_slab(slab)
            print(agent.pid, flush=True)
            os._exit(0)
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, "the agent process outlived its daemon"
        time.sleep(0.05)
