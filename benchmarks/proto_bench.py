"""STATE frame encode+decode cost for 291 (Llama-3-8B) and 50,000 (MoE-like) tensors.

Targets (docs/performance.md, protocol decode): <= 1 ms for 291 entries, <= 50 ms for 50,000, on the 2-core CI machine.
Measures the full path a daemon and a client run: frame -> bytes (``Connection.send``)
and bytes -> validated typed frame (``Connection.events``). Writes JSON to
benchmarks/results/proto_bench-<date>.json (or --out).

    python benchmarks/proto_bench.py [--repeat 50] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wcache.proto import (
    PROTOCOL_VERSION,
    Connection,
    DeviceInfo,
    GetState,
    Hello,
    HelloOk,
    Role,
    SlabDescriptor,
    State,
    TensorEntry,
    TensorTable,
)


def llama_entries(layers: int = 32) -> list[TensorEntry]:
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (128256, 4096))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (4096, 4096)),
            (p + "self_attn.k_proj.weight", (1024, 4096)),
            (p + "self_attn.v_proj.weight", (1024, 4096)),
            (p + "self_attn.o_proj.weight", (4096, 4096)),
            (p + "mlp.gate_proj.weight", (14336, 4096)),
            (p + "mlp.up_proj.weight", (14336, 4096)),
            (p + "mlp.down_proj.weight", (4096, 14336)),
            (p + "input_layernorm.weight", (4096,)),
            (p + "post_attention_layernorm.weight", (4096,)),
        ]
    shapes += [("model.norm.weight", (4096,)), ("lm_head.weight", (128256, 4096))]
    return _place(shapes)


def moe_entries(n: int = 50_000) -> list[TensorEntry]:
    shapes = [(f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w{i % 3}.weight", (256, 512)) for i in range(n)]
    return _place(shapes)


def _place(shapes: Sequence[tuple[str, tuple[int, ...]]]) -> list[TensorEntry]:
    out, off = [], 0
    for name, shape in shapes:
        stride = tuple(shape[1:]) + (1,) if len(shape) == 2 else (1,)
        out.append(TensorEntry(name, "bfloat16", shape, stride, 0, off))
        n = 2
        for s in shape:
            n *= s
        off += (n + 255) // 256 * 256
    return out


def bench(entries: list[TensorEntry], repeat: int) -> dict[str, float]:
    table = TensorTable.from_entries(entries)
    last = entries[-1]
    total = last.offset + 2 * last.shape[0] * (last.shape[1] if len(last.shape) > 1 else 1)
    frame = State(
        id=1,
        lease=7,
        key={"fingerprint": "0" * 32, "tp_rank": 0},
        mode="zero_copy",
        slabs=(SlabDescriptor(size=total, kind="memfd", fd=0),),
        tensors=table,
    )
    t0 = time.perf_counter()
    table.encoded()  # what the daemon does once per loaded model
    first_encode = time.perf_counter() - t0
    enc, dec, size = [], [], 0
    for _ in range(repeat):
        server, client = Connection(Role.SERVER), Connection(Role.CLIENT)
        handshake(server, client)
        gc.collect()  # each round starts like a fresh engine process: no garbage pending
        t0 = time.perf_counter()
        data = server.send(frame)
        t1 = time.perf_counter()
        client.receive_data(data)
        (got,) = list(client.events())
        t2 = time.perf_counter()
        assert isinstance(got, State) and len(got.tensors) == len(entries)
        enc.append(t1 - t0)
        dec.append(t2 - t1)
        size = len(data)
    both = [a + b for a, b in zip(enc, dec)]
    return {
        "tensors": len(entries),
        "frame_bytes": size,
        "table_encode_once_ms": first_encode * 1e3,
        "encode_ms_median": statistics.median(enc) * 1e3,
        "decode_ms_median": statistics.median(dec) * 1e3,
        "encode_decode_ms_median": statistics.median(both) * 1e3,
        "encode_decode_ms_p90": sorted(both)[int(0.9 * (len(both) - 1))] * 1e3,
    }


def handshake(server: Connection, client: Connection) -> None:
    """Handshake both connection objects and leave a GET_STATE pending so STATE is legal."""
    server.receive_data(client.send(Hello(versions=(PROTOCOL_VERSION,))))
    list(server.events())
    out = server.send(
        HelloOk(
            version=PROTOCOL_VERSION, software="bench", backend="host", device=DeviceInfo("cpu"), max_frame_size=1 << 30
        )
    )
    client.receive_data(out)
    list(client.events())
    server.receive_data(client.send(GetState(id=1, key={"tp_rank": 0})))
    list(server.events())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results: dict[str, Any] = {
        "benchmark": "proto_bench",
        "date": datetime.date.today().isoformat(),
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
        "llama_291": bench(llama_entries(), args.repeat),
        "moe_50000": bench(moe_entries(), max(10, args.repeat // 2)),
        "targets_ms": {"llama_291": 1.0, "moe_50000": 50.0},
    }
    results["meets_targets"] = (
        results["llama_291"]["encode_decode_ms_median"] <= 1.0
        and results["moe_50000"]["encode_decode_ms_median"] <= 50.0
    )
    out = args.out or Path(__file__).parent / "results" / f"proto_bench-{results['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
