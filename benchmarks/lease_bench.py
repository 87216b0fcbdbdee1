"""GET_STATE + RELEASE round trip against a live daemon while N other leases are held (docs/reliability.md, lease bookkeeping).

    python benchmarks/lease_bench.py [--leases 0,6400,12800,25600] [--rounds 300]

Leases are held by connections of 64 (the per-connection limit) from this process; the descriptors that
come with each STATE are closed at once (the lease lives with the connection, not the descriptor). Prints
one line per lease count: the median and p90 round trip of a GET_STATE + RELEASE on another connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wcache.channel import Channel, close_fds, connect, expect
from wcache.plan.key import WeightCacheKey
from wcache.proto import GetState, Release, State
from wcache.server.process import DaemonProcess, spawn_daemon
from wcache.synthetic import TINY, make_llama_checkpoint


async def _lease(ch: Channel[Any], key: dict[str, str | int]) -> int:
    rid = ch.conn.next_request_id()
    await ch.send(GetState(id=rid, key=key))
    frame, fds = await expect(ch)
    close_fds(fds)
    assert isinstance(frame, State)
    return frame.lease


async def measure(sock: Path, key: dict[str, str | int], counts: list[int], rounds: int) -> None:
    holders: list[Channel[Any]] = []
    held = 0
    probe, _ = await connect(sock, software="lease_bench", name="probe")
    try:
        for target in counts:
            while held < target:
                ch, _ = await connect(sock, software="lease_bench", name="holder")
                holders.append(ch)
                for _ in range(min(64, target - held)):
                    await _lease(ch, key)
                    held += 1
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                lease = await _lease(probe, key)
                await probe.send(Release(id=probe.conn.next_request_id(), lease=lease))
                await expect(probe)
                times.append(time.perf_counter() - t0)
            times.sort()
            print(
                f"leases={held:>6}  GET_STATE+RELEASE median {statistics.median(times) * 1e3:.2f} ms"
                f"  p90 {times[int(len(times) * 0.9)] * 1e3:.2f} ms",
                flush=True,
            )
    finally:
        probe.close()
        for ch in holders:
            ch.close()


@contextlib.contextmanager
def tiny_daemon(prefix: str) -> Iterator[tuple[DaemonProcess, Path]]:
    """A daemon serving a fresh 10 MB checkpoint (``TINY``) from a temporary directory, and that checkpoint."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        root = Path(tmp)
        ckpt = make_llama_checkpoint(root / "ckpt", TINY, seed=1)
        sdir = root / "sock"
        sdir.mkdir(mode=0o700)
        d = spawn_daemon(ckpt, sdir, "--log-level", "WARNING", log=root / "daemon.log")
        try:
            yield d, ckpt
        finally:
            d.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leases", default="0,6400,12800,25600", help="comma-separated lease counts")
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    with tiny_daemon("wcache-lease-bench-") as (d, ckpt):
        key = WeightCacheKey.from_checkpoint(ckpt).to_wire()
        asyncio.run(measure(d.socket, key, [int(n) for n in args.leases.split(",")], args.rounds))


if __name__ == "__main__":
    main()
