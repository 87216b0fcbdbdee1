"""What a depositing peer costs everyone else on the daemon's event loop (docs/protocol.md §4.13, §7).

    python benchmarks/deposit_limits_bench.py [--tensors 37000] [--deposits 40] [--rounds 200] [--out FILE]

1. A DEPOSIT of ``--tensors`` + 1 tensors whose only duplicate name is the last one: the seconds until its
   PROTOCOL_ERROR, and the slowest STATUS another connection got meanwhile (the duplicate check once
   compared every name with every other: 18.5 s for 37,000, STATUS waiting as long); then the same DEPOSIT
   with every name new, to its DEPOSIT_SLAB: what a valid one of that size costs the event loop.
2. The checkpoint's GET_STATE + RELEASE round trip with no deposit and with ``--deposits`` committed deposits
   under recipe keys of 64 fields (the key limit; a lookup once compared the request with every model's key:
   13 ms -> ~400 ms with 40 keys of 25,000 fields, which the key limit now refuses).

Prints one line per figure and writes them as JSON to ``--out`` (default: stdout only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import string
import sys
import time
from pathlib import Path
from typing import Any

import torch

from wcache import WCacheClient
from wcache.channel import Channel, close_fds, connect, expect
from wcache.errors import ProtocolError
from wcache.plan.key import WeightCacheKey
from wcache.plan.recipe import RecipeKey
from wcache.proto import Deposit, DepositSlab, DepositTensor, GetState, Release, State, Status, pack_frame
from wcache.proto.codec import MAX_REQUEST_SIZE
from wcache.proto.fields import MAX_KEY_FIELDS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lease_bench import tiny_daemon  # the benchmarks' one tiny-daemon set-up


async def _status_latencies(sock: Path, stop: asyncio.Event) -> list[float]:
    ch, _ = await connect(sock, software="deposit_limits_bench", name="status")
    out: list[float] = []
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            await ch.send(Status(id=ch.conn.next_request_id()))
            await expect(ch)
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)
    finally:
        ch.close()
    return out


async def one_deposit(sock: Path, base: WeightCacheKey, n: int, duplicate: bool) -> dict[str, Any]:
    """A DEPOSIT of ``n`` + 1 tensors (the last a duplicate of the one before, or a new name) sent raw: the
    seconds until its answer (the PROTOCOL_ERROR, or the DEPOSIT_SLAB of the valid one, whose connection then
    closes: nothing committed), and the slowest STATUS another connection got meanwhile."""
    digits = string.ascii_letters + string.digits
    names = ["".join(digits[i // 62**k % 62] for k in range(3)) for i in range(n + 1)]  # 3 characters: 1 MiB fits
    if duplicate:
        names[-1] = names[-2]
    key = RecipeKey.of(base, engine="bench", duplicate=int(duplicate)).to_wire()
    wire = Deposit(id=1, key=key, tensors=tuple(DepositTensor(name, "int8", ()) for name in names)).to_wire()
    for t in wire["tensors"]:
        del t["kind"]  # its default: left off, as a compact engine would
    data = pack_frame(wire, MAX_REQUEST_SIZE)
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(_status_latencies(sock, stop))
    await asyncio.sleep(0.2)
    ch, _ = await connect(sock, software="deposit_limits_bench", name="duplicate" if duplicate else "valid")
    t0 = time.perf_counter()
    try:
        await ch.send_bytes(data)  # raw: this side's connection would not let a rule-breaking frame out
        ch.conn.pending[1] = "DEPOSIT"  # (nor one without "kind"): the request it answers, recorded by hand
        try:
            reply, fds = await expect(ch)
            close_fds(fds)
            assert not duplicate and isinstance(reply, DepositSlab), reply
        except ProtocolError as exc:
            assert duplicate and "listed twice" in exc.message, exc.message
        answered = time.perf_counter() - t0
    finally:
        ch.close()
        await asyncio.sleep(0.2)
        stop.set()
    status = await watcher
    return {"tensors": n + 1, "answered_s": answered, "status_max_ms": max(status) * 1e3, "status_count": len(status)}


async def _round_trips(ch: Channel[Any], key: dict[str, str | int], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await ch.send(GetState(id=ch.conn.next_request_id(), key=key))
        state, fds = await expect(ch)
        close_fds(fds)
        assert isinstance(state, State)
        await ch.send(Release(id=ch.conn.next_request_id(), lease=state.lease))
        await expect(ch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


async def fetch_with_deposits(sock: Path, base: WeightCacheKey, deposits: int, rounds: int) -> dict[str, Any]:
    ch, _ = await connect(sock, software="deposit_limits_bench", name="fetch")
    try:
        await _round_trips(ch, base.to_wire(), rounds)  # warm-up
        before = await _round_trips(ch, base.to_wire(), rounds)
        fields = MAX_KEY_FIELDS - len(RecipeKey.of(base, engine="bench").to_wire())
        for i in range(deposits):
            extra: dict[str, str | int] = {f"field_{j}": j for j in range(fields - 1)}
            key = RecipeKey.of(base, engine="bench", postprocess=i, **extra)
            await WCacheClient(sock).deposit(key, {"b": torch.ones(1)})
        after = await _round_trips(ch, base.to_wire(), rounds)
    finally:
        ch.close()
    return {"deposits": deposits, "key_fields": MAX_KEY_FIELDS, "fetch_ms_before": before, "fetch_ms_after": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=37_000)
    ap.add_argument("--deposits", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tiny_daemon("wcache-deposit-limits-") as (d, ckpt):
        base = WeightCacheKey.from_checkpoint(ckpt)
        dup = asyncio.run(one_deposit(d.socket, base, args.tensors, duplicate=True))
        valid = asyncio.run(one_deposit(d.socket, base, args.tensors, duplicate=False))
        for what, r in (("duplicate last: refused", dup), ("all names new: DEPOSIT_SLAB", valid)):
            print(
                f"DEPOSIT of {r['tensors']} tensors, {what} in {r['answered_s']:.2f} s; "
                f"slowest STATUS meanwhile {r['status_max_ms']:.0f} ms ({r['status_count']} answered)",
                flush=True,
            )
        fetch = asyncio.run(fetch_with_deposits(d.socket, base, args.deposits, args.rounds))
        print(
            f"checkpoint GET_STATE+RELEASE median {fetch['fetch_ms_before']:.2f} ms with no deposit, "
            f"{fetch['fetch_ms_after']:.2f} ms with {args.deposits} deposits under {MAX_KEY_FIELDS}-field keys",
            flush=True,
        )
    if args.out is not None:
        out = {"load_avg": os.getloadavg(), "duplicate_last": dup, "valid": valid, "fetch_with_deposits": fetch}
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
