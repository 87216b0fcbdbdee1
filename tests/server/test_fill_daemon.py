"""Fleet fill between daemons on loopback, host backend (docs/fleet.md): ``wcache-server --peer-listen`` serves its
slabs, ``wcache-server --fill-from`` fills its rank from them before reading the checkpoint and serves it as if
loaded — the tensors an engine fetches are the safetensors slices. TP=1 -> TP=2, two TP=2 daemons -> TP=1, a
node without the checkpoint serving an engine; a source SIGKILLed mid-fill, a wrong secret and no peer are the
disk path with nothing half-filled left; the rate cap is observed; STATUS, `wcache status` and the metrics
show where the bytes came from."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.server.deposit_engine import recipe_key, tensors
from tests.server.fleet_daemons import agent_processes, assert_slices, daemon_starter, origin, source
from wcache import WCacheClient, WeightCacheKey
from wcache.plan.key import RACY_NS, RankSpec
from wcache.plan.recipe import key_from_wire
from wcache.server.peer_channel import GRANT_SECONDS
from wcache.server.process import DaemonProcess
from wcache.synthetic import TINY, make_llama_checkpoint

pytest.importorskip("nixl_cu12", reason="the fleet extra (pip install -e '.[fleet]') is not installed")
pytest.importorskip("cryptography", reason="the fleet extra (pip install -e '.[fleet]') is not installed")

FUSE = "wcache.transforms:fuse_llama_qkv_gate_up"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in metrics")


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    with daemon_starter(tmp_path) as start:
        yield start


def _slabs_of(pid: int) -> int:
    """Shared-memory slabs the process holds (memfds of slabs)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += "memfd:wcache-slab" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return n


def _slabs_with_bytes(pid: int) -> int:
    """Slabs of the process holding a byte other than zero: a slab a fill allocated counts once one of its READs
    landed, past UCX's connection setup (a source dying inside it aborts the fill's agent process: docs/fleet.md,
    "A fill, step by step")."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "memfd:wcache-slab" not in os.readlink(f"/proc/{pid}/fd/{fd}"):
                continue
            with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
                while chunk := f.read(1 << 20):
                    if chunk.count(0) != len(chunk):
                        n += 1
                        break
        except OSError:
            pass
    return n


def test_tp1_daemon_fills_a_tp2_rank_and_operators_see_it(ckpt: Path, daemons: Callable[..., DaemonProcess]) -> None:
    sport, tport = _free_port(), _free_port()
    src, peer = source(daemons, ckpt, "--metrics-port", str(sport))
    target = daemons(ckpt, "--tp-rank", "1", "--tp-size", "2", "--fill-from", peer, "--metrics-port", str(tport))
    assert origin(target) == f"peer {peer}"
    assert_slices(target, ckpt, ckpt, 1, 2)
    assert 'wcache_fills_total{outcome="filled",reason=""} 1' in _metrics(tport)
    assert _metric(_metrics(sport), "wcache_peer_served_bytes_total") > 0
    table = run_cli("status", "--socket-dir", str(target.socket.parent))
    head, row = table.stdout.splitlines()[:2]
    assert "ORIGIN" in head and f"peer {peer}" in row and "GB/s" in row
    assert _slabs_of(target.pid) == 1 and _slabs_of(src.pid) == 1


def test_two_tp2_daemons_fill_a_tp1_daemon(ckpt: Path, daemons: Callable[..., DaemonProcess]) -> None:
    peers = [source(daemons, ckpt, "--tp-rank", str(r), "--tp-size", "2")[1] for r in range(2)]
    target = daemons(ckpt, "--fill-from", ",".join(peers))
    assert origin(target) == f"peer {min(peers)} +1"  # each source served its own half
    assert_slices(target, ckpt, ckpt)


def test_a_node_without_the_checkpoint_serves_an_engine(
    ckpt: Path, daemons: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    _, peer = source(daemons, ckpt)
    empty = tmp_path / "model"
    target = daemons(empty, "--fill-from", peer)
    assert WeightCacheKey.from_checkpoint(empty) == WeightCacheKey.from_checkpoint(ckpt)
    assert_slices(target, empty, ckpt)  # the engine computed its key on the directory without weights


def test_an_engine_proves_the_files_of_a_filled_rank(
    ckpt: Path, daemons: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """A rank filled from a peer records the facts of its local files as a disk load does (docs/protocol.md
    §4.3.1): an engine whose files are unchanged gets the key from their identity, reading no header."""
    settled = shutil.copytree(ckpt, tmp_path / "settled")
    time.sleep(RACY_NS / 1e9 + 0.1)  # no file changed within RACY_NS of the target's read
    _, peer = source(daemons, ckpt)
    target = daemons(settled, "--fill-from", peer)
    assert origin(target) == f"peer {peer}"
    key = WeightCacheKey.from_checkpoint(settled)
    w = WCacheClient(target.socket).fetch_sync(key)
    try:
        assert w.key_proven and not key.scanned
    finally:
        w.release_sync()


def test_a_source_sigkilled_mid_fill_leaves_the_target_on_the_disk_path(
    ckpt: Path, daemons: Callable[..., DaemonProcess]
) -> None:
    # bytes/s: the source grants the fill 64 KiB every ~30 ms, so the 10 MB take ~5 s and the kill lands in
    # them, once the first of them landed in the slab it fills
    rate = 2_000_000
    src, peer = source(daemons, ckpt, "--peer-max-rate", str(rate))
    target = daemons(ckpt, "--fill-from", peer, "--fill-timeout", "60", wait=False)
    deadline = time.monotonic() + 60
    while _slabs_with_bytes(target.pid) == 0:  # the fill's READs are landing
        assert time.monotonic() < deadline, target.log_text()[-2000:]
        time.sleep(0.02)
    os.kill(src.pid, signal.SIGKILL)
    src.proc.wait(30)
    target.wait_ready(120)
    assert origin(target) == "disk"
    assert_slices(target, ckpt, ckpt)
    assert _slabs_of(target.pid) == 1  # the half-filled slab was freed, only the loaded one remains


def test_the_fill_agent_aborted_mid_fill_leaves_the_target_daemon_serving_from_disk(
    ckpt: Path, daemons: Callable[..., DaemonProcess]
) -> None:
    """UCX aborts the process it runs in when a source dies during its connection setup (docs/fleet.md, "A
    fill, step by step"). The fill's agent runs in a child process, so the abort, here sent to that child once
    the fill's READs are landing, ends the fill and not the daemon: it loads from disk, serves, and has freed the
    half-filled slab; the source serves on. Before, the agent ran in the daemon, and the abort ended the daemon
    with every model it served."""
    rate = 2_000_000  # 10 MB in ~5 s: the abort lands in them
    src, peer = source(daemons, ckpt, "--peer-max-rate", str(rate))
    target = daemons(ckpt, "--fill-from", peer, "--fill-timeout", "60", wait=False)
    deadline = time.monotonic() + 60
    while _slabs_with_bytes(target.pid) == 0:
        assert time.monotonic() < deadline, target.log_text()[-2000:]
        time.sleep(0.02)
    (child,) = agent_processes(target.pid)
    os.kill(child, signal.SIGABRT)
    target.wait_ready(120)
    assert target.proc.poll() is None
    assert origin(target) == "disk"
    assert_slices(target, ckpt, ckpt)
    assert _slabs_of(target.pid) == 1  # the half-filled slab was freed, only the loaded one remains
    assert not agent_processes(target.pid)  # reaped
    assert origin(src) == "disk" and src.proc.poll() is None


def _origins(d: DaemonProcess) -> dict[str, str]:
    """Each served model's origin, by its key's short form."""
    return {key_from_wire(dict(m.key)).short(): m.origin for m in asyncio.run(WCacheClient(d.socket).status()).models}


def test_a_preload_and_a_recipe_key_are_filled_from_a_peer_daemon(
    ckpt: Path, daemons: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """A daemon started with --fill-from on another checkpoint (nothing of it on the peer: loaded from disk)
    fills a PRELOAD of rank 1 of 2 from the peer's TP=1 slab, and a GET_STATE of a recipe key it never held
    from the peer's deposit; STATUS, `wcache status` and its metrics say so. On main's code the PRELOAD loaded
    from disk and the recipe key was NOT_FOUND."""
    src, peer = source(daemons, ckpt)
    recipe = recipe_key(WeightCacheKey.from_checkpoint(ckpt))
    deposited = tensors()
    asyncio.run(WCacheClient(src.socket).deposit(recipe, deposited, timeout=60))
    other = make_llama_checkpoint(tmp_path / "other", TINY, shards=2, seed=7)
    tport = _free_port()
    target = daemons(other, "--fill-from", peer, "--metrics-port", str(tport))
    assert list(_origins(target).values()) == ["disk"]  # the peer holds nothing of `other`
    rank = WeightCacheKey.from_checkpoint(ckpt, tp_rank=1, tp_size=2)
    done = asyncio.run(WCacheClient(target.socket).preload(RankSpec(ckpt, tp_rank=1, tp_size=2), timeout=60))
    assert done.key == rank.to_wire() and done.load_seconds > 0

    async def fetch_recipe() -> None:
        async with await WCacheClient(target.socket).fetch(recipe, timeout=60) as w:
            assert set(w) == set(deposited)
            for name, t in deposited.items():
                assert torch.equal(w[name].view(torch.uint8), t.view(torch.uint8)), name

    asyncio.run(fetch_recipe())
    assert _origins(target) == {
        WeightCacheKey.from_checkpoint(other).short(): "disk",
        rank.short(): f"peer {peer}",
        recipe.short(): f"peer {peer}",
    }
    assert_slices(target, ckpt, ckpt, 1, 2)
    table = run_cli("status", "--socket-dir", str(target.socket.parent)).stdout
    assert sum(f"peer {peer}" in row for row in table.splitlines()) == 2
    text = _metrics(tport)
    assert 'wcache_fills_total{outcome="filled",reason=""} 2' in text
    assert 'wcache_fills_total{outcome="failed",reason="not-found"} 1' in text  # at start
    assert _slabs_of(target.pid) == 3


def test_a_peer_sigkilled_mid_preload_fill_leaves_the_target_on_the_disk_path(
    ckpt: Path, daemons: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """The source dies while a PRELOAD fills from it (its cap keeps the fill going for seconds): the PRELOAD
    loads from disk instead, serves the safetensors slices, and the half-filled slab is freed."""
    rate = 2_000_000  # bytes/s: 10 MB take five seconds, in grants of 64 KiB
    src, peer = source(daemons, ckpt, "--peer-max-rate", str(rate))
    other = make_llama_checkpoint(tmp_path / "other", TINY, shards=2, seed=7)
    tport = _free_port()
    target = daemons(other, "--fill-from", peer, "--metrics-port", str(tport))

    async def preload_while_the_peer_dies() -> str:
        client = WCacheClient(target.socket)
        task = asyncio.ensure_future(client.preload(RankSpec(ckpt), timeout=120))
        deadline = time.monotonic() + 60
        while _slabs_with_bytes(target.pid) < 2:  # the fill's READs are landing in the second slab
            assert time.monotonic() < deadline and not task.done(), target.log_text()[-2000:]
            await asyncio.sleep(0.02)
        os.kill(src.pid, signal.SIGKILL)
        await asyncio.to_thread(src.proc.wait, 30)
        await asyncio.wait_for(task, 120)
        (m,) = [m for m in (await client.status()).models if m.key == WeightCacheKey.from_checkpoint(ckpt).to_wire()]
        return m.origin

    assert asyncio.run(preload_while_the_peer_dies()) == "disk"
    assert_slices(target, ckpt, ckpt)
    assert _slabs_of(target.pid) == 2  # the two models served; the half-filled slab was freed
    text = _metrics(tport)
    failed = [ln for ln in text.splitlines() if ln.startswith('wcache_fills_total{outcome="failed"')]
    # the source's death is seen by the transfer (reason transfer or deadline), or aborts the fill's agent
    # process inside UCX's connection setup (nixl: docs/fleet.md, "A fill, step by step")
    reasons = ('reason="transfer"', 'reason="deadline"', 'reason="nixl"')
    assert any(any(r in ln for r in reasons) and ln.endswith(" 1") for ln in failed), failed


def test_a_wrong_secret_is_refused_and_the_target_loads_from_disk(
    ckpt: Path, daemons: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    secrets = []
    for name, value in (("fleet", b"the fleet's secret, 32 bytes ok!"), ("other", b"a stranger's secret, also long..")):
        p = tmp_path / name
        p.write_bytes(value)
        p.chmod(0o600)
        secrets.append(str(p))
    _, peer = source(daemons, ckpt, "--peer-secret-file", secrets[0])
    tport = _free_port()
    target = daemons(ckpt, "--fill-from", peer, "--peer-secret-file", secrets[1], "--metrics-port", str(tport))
    assert origin(target) == "disk"
    assert 'wcache_fills_total{outcome="failed",reason="auth"} 1' in _metrics(tport)
    good = daemons(ckpt, "--fill-from", peer, "--peer-secret-file", secrets[0])
    assert origin(good) == f"peer {peer}"


def test_the_rate_cap_is_observed(ckpt: Path, daemons: Callable[..., DaemonProcess]) -> None:
    rate = 4_000_000
    _, peer = source(daemons, ckpt, "--peer-max-rate", str(rate))
    target = daemons(ckpt, "--fill-from", peer)
    (m,) = asyncio.run(WCacheClient(target.socket).status()).models
    assert m.origin == f"peer {peer}"
    assert m.load_seconds >= m.bytes / rate - GRANT_SECONDS  # every grant waited for its bytes (an idle cap lends)


@contextlib.asynccontextmanager
async def _offering(key: WeightCacheKey, tmp_path: Path, layers: int) -> AsyncIterator[tuple[int, int]]:
    """One peer offering, under exactly ``key``, the slab of another Llama of ``layers`` layers (the peer's word
    for the key's bytes: a transformed key's layout only a source knows): its port and the slab's size."""
    from wcache.server.backends.host import HostBackend
    from wcache.server.load import load_model
    from wcache.server.peer import PeerListener, PeerService
    from wcache.server.peer_auth import PeerSecurity
    from wcache.server.store import Store

    shape = dataclasses.replace(TINY, layers=layers)
    big = load_model(RankSpec(make_llama_checkpoint(tmp_path / "big", shape, seed=3)), backend=HostBackend())
    offered = dataclasses.replace(big, key=key)  # the source's store closes it
    none = PeerSecurity.configure(cert=None, key=None, ca=None, secret_file=None)
    svc = PeerService(Store(HostBackend(), [offered]), none, software="wcache/test")
    listener = PeerListener(svc, "127.0.0.1", 0)
    _, port = listener.start()
    try:
        yield port, offered.slab_bytes
    finally:
        await listener.stop()
        svc.store.close()


@pytest.mark.parametrize("fits", [False, True], ids=["past-the-budget", "within-the-budget"])
async def test_a_transformed_rank_offered_larger_than_planned_is_filled_only_within_the_budget_at_start(
    ckpt: Path, tmp_path: Path, daemons: Callable[..., DaemonProcess], fits: bool
) -> None:
    """``--transform``; the one peer offers a slab under exactly that key more than twice the rank's planned layout
    (a transform's output can be larger than its input: vLLM's padded vocabulary, a dequantisation). With
    ``--memory-budget`` twice the plan (the loaded slab and the transform's output, the plan's size here, exist at
    once) the slab does not fit: the fill is refused (reason ``room``) and the rank is loaded from disk, served
    within the plan — before, the offer sized the filled slab, and the daemon served four times its budget. With a
    budget that holds the offer, the daemon makes room beyond the plan, as the disk path does for a transform's
    output, and serves the peer's slab — refusing every offer larger than the plan sent honest fleets to disk."""
    from wcache.plan.rank import plan_rank

    transform = "wcache.transforms:vllm_layout"
    with plan_rank(RankSpec(ckpt, transform=transform)) as rp:
        key, planned = rp.key, rp.layout.total_bytes
    async with _offering(key, tmp_path, TINY.layers * 4) as (port, size):
        assert size > 2 * planned
        tport = _free_port()
        d = await asyncio.to_thread(
            daemons,
            ckpt,
            "--transform",
            transform,
            "--memory-budget",
            str(size if fits else 2 * planned),
            "--fill-from",
            f"127.0.0.1:{port}",
            "--metrics-port",
            str(tport),
        )
        (m,) = (await WCacheClient(d.socket).status()).models
        metrics = await asyncio.to_thread(_metrics, tport)
        if fits:
            assert m.origin == f"peer 127.0.0.1:{port}" and m.bytes == size
            assert 'wcache_fills_total{outcome="filled",reason=""} 1' in metrics
        else:
            assert m.origin == "disk" and m.bytes <= planned
            assert 'wcache_fills_total{outcome="failed",reason="room"} 1' in metrics


async def test_room_beyond_the_plan_at_start_evicts_a_kept_model_from_the_keeper_too(
    ckpt: Path,
    tmp_path: Path,
    keeper: DaemonProcess,
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    """The keeper holds the rank's untransformed key U (its daemon was killed); the next daemon starts with
    ``--keeper --transform`` and fills from a peer offering a slab larger than the transformed rank's plan, under a
    ``--memory-budget`` that holds U and the plan but not the bytes beyond it as well: room beyond the plan evicts U,
    the daemon and its keeper both let it go, and the peer's slab is served. Before, the room was made inside the
    fill's own event loop, where telling the keeper (``asyncio.run``) raised: the fill failed with room made (reason
    ``transfer``, the rank loaded from disk) and the keeper kept U, which no daemon accounted for."""
    from wcache.plan.rank import plan_rank

    with plan_rank(RankSpec(ckpt, transform=FUSE)) as rp:
        key, planned = rp.key, rp.layout.total_bytes
    first = await asyncio.to_thread(daemon_factory, ckpt, "--keeper")
    (u,) = (await WCacheClient(first.socket).status()).models
    first.stop(signal.SIGKILL)
    async with _offering(key, tmp_path, TINY.layers + 3) as (port, size):
        assert size > planned
        tport = _free_port()
        d = await asyncio.to_thread(
            daemon_factory,
            ckpt,
            "--keeper",
            "--transform",
            FUSE,
            "--memory-budget",
            str(u.bytes + planned + (size - planned) // 2),
            "--fill-from",
            f"127.0.0.1:{port}",
            "--metrics-port",
            str(tport),
        )
        models = (await WCacheClient(d.socket).status()).models
        kept = [m.key for m in (await WCacheClient(keeper.socket).status()).models]
        assert [m.origin for m in models] == [f"peer 127.0.0.1:{port}"] and u.key not in kept
        assert 'wcache_fills_total{outcome="filled",reason=""} 1' in await asyncio.to_thread(_metrics, tport)


def test_without_a_peer_the_daemon_loads_from_disk(ckpt: Path, daemons: Callable[..., DaemonProcess]) -> None:
    tport = _free_port()
    target = daemons(ckpt, "--fill-from", "127.0.0.1:1", "--fill-timeout", "5", "--metrics-port", str(tport))
    assert origin(target) == "disk"
    assert 'wcache_fills_total{outcome="failed",reason="no-peer"} 1' in _metrics(tport)


def test_fleet_options_are_checked(ckpt: Path) -> None:
    from wcache.server.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--fill-fingerprint", "ab"])  # belongs to --fill-from
    with pytest.raises(SystemExit):
        parse_args(["--fill-from", "127.0.0.1:7070"])  # no --model to fill
    with pytest.raises(SystemExit):
        parse_args(["--model", str(ckpt), "--fill-from", "127.0.0.1:7070", "--peer-cert", "x"])  # half of mTLS
    with pytest.raises(SystemExit):
        parse_args(["--model", str(ckpt), "--peer-listen", "0.0.0.0:7070"])  # unauthenticated off loopback
    args = parse_args(["--model", str(ckpt), "--fill-from", "dns:wcache-peers:7070", "--peer-listen", "127.0.0.1:0"])
    assert args.peer_security.mode == "none" and args.peer_listen == ("127.0.0.1", 0)
