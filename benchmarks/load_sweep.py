"""Where a daemon load's time goes on the GPU, and which loader settings are fastest (docs/performance.md).

In one process (torch and the CUDA context started once), for the 16 GB Llama-3-8B-shaped
checkpoint on ``--device cuda:K``:

- ``alloc``: allocating the 16 GB slab (VMM and cudaMalloc);
- ``warm``: ``load_into`` from the page cache, for several reader-thread counts and
  staging sizes (each config run ``--repeats`` times, slab allocation included);
- ``cold``: the same after dropping the page cache, for a few thread counts;
- ``host_copy``: the host-memory-tier path — the loaded slab copied to a memfd in shared
  memory, then back to a fresh GPU slab: (a) through the loader's pinned staging (a memfd
  read like a page-cache file), (b) by registering the shared memory with the driver
  (``cudaHostRegister``) in chunks and copying straight from it.

    python benchmarks/load_sweep.py --device cuda:0 --out $OUT/load_sweep.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from gpu_bench import drop_caches  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", type=Path, default=Path("/tmp/wcache-bench/llama3-8b"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warm-threads", type=int, nargs="*", default=[8, 16, 24])
    ap.add_argument("--staging-gib", type=float, nargs="*", default=[2.0, 4.0])
    ap.add_argument("--cold-threads", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument("--skip-host-copy", action="store_true")
    args = ap.parse_args()

    import torch

    from wcache.plan.key import RankSpec
    from wcache.plan.rank import plan_rank
    from wcache.server.backends.cuda import CudaBackend
    from wcache.server.loader import load_into
    from wcache.synthetic import LLAMA3_8B, make_llama_checkpoint

    if not (args.model / "config.json").exists():
        make_llama_checkpoint(args.model, LLAMA3_8B, shards=4, seed=0, device=args.device)
    dev = torch.device(args.device)
    index = dev.index or 0
    torch.empty(1, device=dev)
    rp = plan_rank(RankSpec(args.model, dtype="bfloat16"))
    layout = rp.layout
    res: dict[str, Any] = {
        "benchmark": "load_sweep",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(dev),
        "cpus": os.cpu_count(),
        "slab_bytes": layout.total_bytes,
        "payload_bytes": layout.payload_bytes,
    }

    def save() -> None:
        args.out.write_text(json.dumps(res, indent=2) + "\n")

    backend = CudaBackend(index, export="vmm")
    ipc = CudaBackend(index, export="ipc")

    # -- allocation alone
    alloc: dict[str, list[float]] = {"vmm": [], "ipc": []}
    for _ in range(3):
        for name, b in (("vmm", backend), ("ipc", ipc)):
            t0 = time.perf_counter()
            s = b.allocate(layout.total_bytes)
            torch.cuda.synchronize(dev)
            alloc[name].append(time.perf_counter() - t0)
            s.close()
    res["alloc_s"] = alloc
    save()

    def timed_load(threads: int, staging: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        slab = CudaBackend(index, export="vmm", staging_bytes=staging).allocate(layout.total_bytes)
        try:
            st = load_into(layout, slab, threads=threads, progress=False, started=t0)
        finally:
            slab.close()
        return {"seconds": st.seconds, "gb_s": st.bytes_read / st.seconds / 1e9}

    # -- warm page cache
    for f in args.model.glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(256 << 20):
                pass
    warm: list[dict[str, Any]] = []
    for th in args.warm_threads:
        for gib in args.staging_gib:
            runs = [timed_load(th, int(gib * (1 << 30))) for _ in range(args.repeats)]
            row = {"threads": th, "staging_gib": gib, "seconds": [r["seconds"] for r in runs]}
            row["median_s"] = statistics.median(row["seconds"])
            warm.append(row)
            print("warm", json.dumps(row), flush=True)
            res["warm"] = warm
            save()
    best_warm = min(warm, key=lambda r: r["median_s"])
    res["best_warm"] = best_warm

    # -- cold
    cold: list[dict[str, Any]] = []
    for th in args.cold_threads:
        dropped = drop_caches()
        r = timed_load(th, int(best_warm["staging_gib"] * (1 << 30)))
        row = {"threads": th, "seconds": r["seconds"], "gb_s": r["gb_s"], "page_cache_dropped": dropped}
        cold.append(row)
        print("cold", json.dumps(row), flush=True)
        res["cold"] = cold
        save()

    if not args.skip_host_copy:
        res["host_copy"] = host_copy(layout, backend, index, int(best_warm["threads"]))
        save()
    print(json.dumps({k: res[k] for k in ("alloc_s", "best_warm", "cold")}, indent=1))


def host_copy(layout: Any, backend: Any, index: int, threads: int) -> dict[str, Any]:
    """Slab -> memfd (shared memory) -> a new slab, two ways."""
    import torch

    from wcache import _cuda  # noqa: F401  (driver loaded)
    from wcache.server.loader import load_into

    out: dict[str, Any] = {}
    nbytes = layout.total_bytes
    slab = backend.allocate(nbytes)
    load_into(layout, slab, threads=threads, progress=False)
    src = slab.tensor()
    fd = os.memfd_create("wcache-tier", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    import mmap

    mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    host = torch.frombuffer(mm, dtype=torch.uint8)
    # D2H into the memfd through pinned staging (what writing the tier costs)
    t0 = time.perf_counter()
    chunk = 256 << 20
    pinned = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    stream = torch.cuda.Stream(index)  # type: ignore[no-untyped-call]
    evs: list[Any] = [None, None]
    pending: list[tuple[int, int, int]] = []
    for i, off in enumerate(range(0, nbytes, chunk)):
        n = min(chunk, nbytes - off)
        k = i % 2
        if evs[k] is not None:
            evs[k].synchronize()
            o2, n2, k2 = pending.pop(0)
            host[o2 : o2 + n2].copy_(pinned[k2][:n2])
        with torch.cuda.stream(stream):
            pinned[k][:n].copy_(src[off : off + n], non_blocking=True)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(stream)
        evs[k] = ev
        pending.append((off, n, k))
    for o2, n2, k2 in pending:
        evs[k2].synchronize()
        host[o2 : o2 + n2].copy_(pinned[k2][:n2])
    out["gpu_to_shm_s"] = time.perf_counter() - t0
    ref = src[: 64 << 20].clone()
    slab.close()
    del pinned

    # (a) shm -> GPU through the loader-style staging: a single-extent "file" read
    tier = Path(f"/proc/self/fd/{fd}")

    def via_staging(th: int) -> float:
        from wcache.server.backends.cuda import _DeviceWorker, _Staging

        t0 = time.perf_counter()
        dst = backend.allocate(nbytes)
        t = dst.tensor()
        local = threading.local()
        workers: list[Any] = []
        ck = 64 << 20
        stg = _Staging(2 * th, ck)
        rfd = os.open(tier, os.O_RDONLY)

        def job(off: int) -> None:
            w = getattr(local, "w", None)
            if w is None:
                w = local.w = _DeviceWorker(t.device, stg)
                workers.append(w)
            n = min(ck, nbytes - off)
            i = w.slot()
            got = 0
            while got < n:
                got += os.preadv(rfd, [w.views[i][got:n]], off + got)
            with torch.cuda.stream(w.stream):
                t[off : off + n].copy_(w.bufs[i][:n], non_blocking=True)
                ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
                ev.record(w.stream)
            w.events[i] = ev

        with ThreadPoolExecutor(th) as pool:
            list(pool.map(job, range(0, nbytes, ck)))
        for w in workers:
            w.finish()
        torch.cuda.synchronize(t.device)
        secs = time.perf_counter() - t0
        os.close(rfd)
        workers.clear()
        stg.close()
        assert torch.equal(t[: 64 << 20], ref)
        dst.close()
        return secs

    out["shm_to_gpu_staging_s"] = {str(th): via_staging(th) for th in (8, 16)}

    # (b) register the shared memory with the driver, chunk by chunk, and copy from it directly
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]

    def via_register(ck: int, streams: int) -> dict[str, float]:
        t0 = time.perf_counter()
        dst = backend.allocate(nbytes)
        t = dst.tensor()
        base = host.data_ptr()
        reg = 0.0
        ss = [torch.cuda.Stream(index) for _ in range(streams)]  # type: ignore[no-untyped-call]
        for i, off in enumerate(range(0, nbytes, ck)):
            n = min(ck, nbytes - off)
            r0 = time.perf_counter()
            err = cudart.cudaHostRegister(base + off, n, 0)
            reg += time.perf_counter() - r0
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")
            with torch.cuda.stream(ss[i % streams]):
                t[off : off + n].copy_(host[off : off + n], non_blocking=True)
        torch.cuda.synchronize(t.device)
        secs = time.perf_counter() - t0
        for off in range(0, nbytes, ck):
            cudart.cudaHostUnregister(base + off)
        assert torch.equal(t[: 64 << 20], ref)
        dst.close()
        return {"seconds": secs, "register_s": reg}

    out["shm_to_gpu_register"] = {f"{ck >> 20}MiB": via_register(ck, 2) for ck in (256 << 20, 1 << 30)}

    # (c) already registered (a daemon that keeps its tier pinned): pure host-to-device
    r0 = time.perf_counter()
    err = cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)
    out["register_whole_s"] = time.perf_counter() - r0
    if int(err) == 0:
        t0 = time.perf_counter()
        dst = backend.allocate(nbytes)
        dst.tensor().copy_(host, non_blocking=True)
        torch.cuda.synchronize(dst.tensor().device)
        out["shm_registered_to_gpu_s"] = time.perf_counter() - t0
        dst.close()
        cudart.cudaHostUnregister(host.data_ptr())
    host.data_ptr()  # keep the view alive up to here; the mapping goes with the process
    os.close(fd)
    print("host_copy", json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
