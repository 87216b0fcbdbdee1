"""A restart is a first fetch in a fresh engine, imports included (docs/performance.md, "The restart weight path").

Against one running daemon, each sample is a fresh Python process that imports torch and
starts its CUDA context (not timed: an engine has both before it asks for weights), then times:

- ``restart_weight_path_ms``: ``import wcache`` -> key computed -> fetch -> every tensor mapped
  and touched (``materialize()``: every per-name view; one element of the first and last tensor
  read back, so the mapping is real);
- ``first_fetch_fresh_engine_ms``: the first zero_copy fetch alone in that process (connect, HELLO,
  GET_STATE, map, views, touch), wcache already imported and the key computed;
- with ``--moe`` the engine is a fused-MoE one: ``first_fetch_fresh_engine_ms`` and
  ``restart_weight_path_ms`` take one stacked view per STATE group (``CachedWeights.groups()``, the
  shape fused-MoE kernels take) instead of 50,000 per-name tensors, and
  ``first_fetch_materialized_ms`` (other fresh processes) is the same fetch with every per-name view
  built (``materialize()``, torch-bound: ~1 us a tensor object); the JSON's ``definition`` says which;
- ``first_copy_fresh_engine_ms``: the first copy-mode fetch in another fresh process (synchronized);
- ``per_tensor_ipc_fresh_engine_ms``: the anchors' way (vLLM's and SGLang's weight-cache daemons):
  a holder process shares one legacy CUDA IPC handle per tensor through torch's ``reduce_tensor``,
  pickled; the fresh engine unpickles, rebuilds every tensor and touches it the same way
  (CUDA only). ``first_fetch_over_per_tensor_ipc`` is the ratio of the medians, same run.

``phases_ms`` breaks the median restart sample down, ``phases_ms_median`` gives each phase's median over
the samples and ``phases_ms_samples`` each phase per sample (in the samples' order: where a slow sample's time
went), from the fetch's own ``CachedWeights.timings`` (perf_counter_ns in the client): ``import``, ``key``
(the directory listed and its files stated: docs/protocol.md §4.3.1), ``socket`` (connect, peer check),
``hello`` (HELLO and the pipelined GET_STATE out, HELLO_OK back; ``ahead`` within it: the
mapping's modules loaded while the daemon answers), ``prepare`` (CUDA only, while the STATE is
in flight: ``prepare_check``, the engine's device checked against the daemon's GPU; ``prepare_device``, the GPU found by UUID through the driver, the libcuda handle loaded on first use;
``prepare_context``, its context current; ``prepare_driver``, granularity and the entry points), ``state``
(the rest of the wait for STATE, and its decode), ``wait`` (the time the fetch's reads waited for the socket to
be readable, within ``hello`` and ``state``: the daemon's answer not in yet), ``decode`` (the time spent decoding
HELLO_OK and the STATE, within ``hello`` and ``state``), ``import_handle`` (cuMemImportFromShareableHandle),
``reserve_map_access`` (cuMemAddressReserve + cuMemMap + cuMemSetAccess: ``reserve``, ``map_range``,
``set_access``, ``set_access_refused`` for a read-only attempt the driver refused), ``map`` (every slab, the two
above included; mmap on the host), ``views`` (the slab as a tensor, the name -> view mapping),
``materialize`` (or ``groups``), ``touch`` (two elements read back, synchronised). ``key_proven_samples``:
how many samples the daemon answered on the files' proof (the engine read no header). ``collections_on_path``: the
cyclic GC's collections in each sample, from ``import wcache`` to the touch (how many; their ms). ``cpu_ms_median``: the
engine process's CPU time (``time.process_time``) over the restart path, the import, the key and the first fetch:
on a machine shared with other work, the figure it disturbs least (the daemon's answer is not in it). Children run from
compiled bytecode (a warm-up child writes wcache's first), as an installed wcache would; the checkpoint's
files are left to settle for 2 s first, as the daemon records no file changed just before it reads it.

CUDA, dense (``--probes N``, default 5 fresh engines per variant): ``touch_probe`` times the first touch by
variant (TOUCH_PROBE: the ENGINE's touch and a second one; the two elements read first through cuMemcpyDtoH; a
device-to-host read of other memory first; a pinned host tensor first; the window's modules imported before
the fetch, so that its ``wait`` is the daemon's answer as the engine sees it, less what the context's preparation
overlaps) and ``map_probe`` the first mapping's driver calls by reservation alignment and access (MAP_PROBE, with
the same range mapped again in the process): where the first fetch's first-time costs go, the variants taken
round-robin (one of each per round, the order rotating: a VM's drift falls on every variant alike). Neither
changes the measured figures above (other processes).

    python benchmarks/fresh_engine_bench.py --device cuda:0 --model /tmp/wcache-bench/llama3-8b --out r.json
    python benchmarks/fresh_engine_bench.py --device cuda:0 --moe --out r.json      # 50,000 tensors
    python benchmarks/fresh_engine_bench.py --device cpu --out r.json               # host backend
    python benchmarks/fresh_engine_bench.py --device cpu --moe --out r.json         # 50,000 tensors, host

AGAINST: ``--against TREE`` (a directory holding another wcache/, e.g. ``git archive main wcache benchmarks``
unpacked) starts a second daemon from that tree on the same checkpoint and runs its zero_copy fresh engines (the
restart and first-fetch figures; copy mode, the probes and the anchors stay this tree's alone) one for one with
this tree's, the order alternating: ``against`` in the JSON has its figures and, per figure, the median of
the pairs' differences (``*_paired_diff_median``, this tree less that one; below zero, this tree is faster). Run
for run on one VM the same code moved by 30 % within one call (docs/performance.md, "runs 3 to 5"); interleaved
sample by sample, the drift falls on both trees alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_bench as gb  # noqa: E402  (Daemon, make_moe)

# A fresh engine. argv: socket model device mode(zero_copy|copy) views(names|groups)
# views "names": every per-name view built (materialize()), the first and last tensor read back;
# views "groups": the fused-MoE engine's way, one stacked view per STATE group (groups()), the first element of
# the first group and the last element of the last group read back.
ENGINE = r"""
import json, sys, time
sock, model, device, mode, views = sys.argv[1:6]
import torch
if device.startswith("cuda"):
    torch.empty(1, device=device); torch.cuda.synchronize()   # the engine's CUDA context: not timed
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
cpu = time.process_time
import gc
collections = []   # the cyclic GC's collections on the path: [generation, ms]
def on_gc(phase, info, started=[0.0]):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        collections.append([info["generation"], round((time.perf_counter() - started[0]) * 1e3, 3)])
gc.callbacks.append(on_gc)
t0 = time.perf_counter(); c0 = cpu()
import wcache
from wcache import WCacheClient, WeightCacheKey
t1 = time.perf_counter(); c1 = cpu()
key = WeightCacheKey.from_checkpoint(model)
t2 = time.perf_counter(); c2 = cpu()
w = WCacheClient(sock, timeout=120).fetch_sync(key, mode=mode)
t3 = time.perf_counter()
if views == "groups":
    stacked = [g.tensor for g in w.groups() if g.tensor.numel()]
    t4 = time.perf_counter()
    first, last = stacked[0], stacked[-1]
    touched = float(first[(0,) * first.dim()]) + float(last[tuple(n - 1 for n in last.shape)])
else:
    w.materialize()
    t4 = time.perf_counter()
    names = list(w)
    touched = float(w[names[0]].view(-1)[0]) + float(w[names[-1]].view(-1)[-1])   # device reads: the mapping is real
sync()
t5 = time.perf_counter(); c5 = cpu()
gc.callbacks.remove(on_gc)
ms = lambda a, b: (b - a) * 1e3
print(json.dumps({
    "restart_weight_path_ms": ms(t0, t5), "fetch_ms": ms(t2, t5),
    "cpu_ms": {"restart_weight_path": ms(c0, c5), "import": ms(c0, c1), "key": ms(c1, c2), "fetch": ms(c2, c5)},
    "phases_ms": {"import": ms(t0, t1), "key": ms(t1, t2), **w.timings, "fetch_total": ms(t2, t3),
                  ("groups" if views == "groups" else "materialize"): ms(t3, t4), "touch": ms(t4, t5)},
    "tensors": len(w), "cuda_bindings_imported": "cuda.bindings" in sys.modules, "touched": touched,
    "key_proven": w.key_proven, "key_scanned": key.scanned, "collections": collections,
}))
w.release_sync()
"""

# Where a fresh engine's touch goes (CUDA only; the ENGINE's touch is not changed: the anchors' is the same). argv:
# socket model device variant. The fetch and materialize() as the ENGINE's, then by variant:
#   item         the ENGINE's touch (two float() reads, synchronised), then the same touch again
#   driver       the same two elements read first with cuMemcpyDtoH on the mapped addresses (libcuda, no torch),
#                then the ENGINE's touch
#   other        a device-to-host read of memory that is not wcache's (a fresh one-element torch allocation) first,
#                then the ENGINE's touch
#   pinned       a one-element pinned host tensor allocated first (torch's caching host allocator: the buffer a
#                CUDA tensor's item() copies into), then the ENGINE's touch
#   window       the fetch's window modules (the views' and the CUDA mapping's, which a fetch imports while the
#                daemon answers) imported before the fetch, then the ENGINE's touch: with nothing to do meanwhile the
#                fetch waits for the daemon, so its timings' ``wait`` is the daemon's answer as the engine sees it
#                (and ``fetch`` against the item variant's is what the window's imports add)
# so the JSON shows whether the first touch pays for the mapping (driver and item alike, and other no help) or for
# the process's first device-to-host copy (other takes it, the touch after is short) or for torch's path (driver
# short, item long), and whether torch's path is its first pinned host allocation (pinned takes it).
TOUCH_PROBE = r"""
import ctypes, json, sys, time
sock, model, device, variant = sys.argv[1:5]
import torch
torch.empty(1, device=device); torch.cuda.synchronize()
from wcache import WCacheClient, WeightCacheKey
key = WeightCacheKey.from_checkpoint(model)
if variant == "window":  # as the fetch's window imports them (client._ahead), before the fetch
    from wcache.proto.codec import gc_paused
    with gc_paused(keep=True):
        import wcache.client.mapping, wcache.client.cuda, wcache.client.driver
t0 = time.perf_counter()
w = WCacheClient(sock, timeout=120).fetch_sync(key)
fetched = (time.perf_counter() - t0) * 1e3
w.materialize()
names = list(w)
first, last = w[names[0]], w[names[-1]]
def touch():
    t0 = time.perf_counter()
    float(first.view(-1)[0]) + float(last.view(-1)[-1])
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3
out = {"variant": variant, "fetch": fetched}
if variant == "window":
    out["touch"] = touch()
elif variant == "item":
    out["touch"] = touch()
    out["touch_again"] = touch()
elif variant == "driver":
    lib = ctypes.CDLL("libcuda.so.1")
    copy = lib.cuMemcpyDtoH_v2
    copy.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t]
    buf = ctypes.create_string_buffer(2)
    t0 = time.perf_counter()
    assert copy(buf, first.data_ptr(), 2) == 0
    t1 = time.perf_counter()
    assert copy(buf, last.data_ptr() + (last.numel() - 1) * last.element_size(), 2) == 0
    t2 = time.perf_counter()
    out.update(driver_first=(t1 - t0) * 1e3, driver_second=(t2 - t1) * 1e3, touch=touch())
elif variant == "other":
    x = torch.empty(1, device=device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    float(x[0])
    t1 = time.perf_counter()
    out.update(other_first=(t1 - t0) * 1e3, touch=touch())
elif variant == "pinned":
    t0 = time.perf_counter()
    torch.empty(1, pin_memory=True)
    t1 = time.perf_counter()
    out.update(pinned_first=(t1 - t0) * 1e3, touch=touch())
out["timings"] = w.timings
print(json.dumps(out))
w.release_sync()
"""

# The first mapping's driver calls by variant, in a fresh engine (CUDA VMM only). argv: socket model device
# alignment access. The GET_STATE as a fetch sends it, then the slab's fd imported and mapped by hand:
# cuMemAddressReserve with ``alignment`` (0: the driver's choice; "gran": the VMM granularity; else bytes), cuMemSetAccess read-only first
# (``ro``, as the client) or read-write only (``rw``); each call timed, then the first and last byte read back
# (cuMemcpyDtoH), then the same range unmapped and mapped again in the same process (the warm figures).
MAP_PROBE = r"""
import ctypes, json, os, sys, time
from pathlib import Path
sock, model, device, alignment, access = sys.argv[1:6]
import torch
torch.empty(1, device=device); torch.cuda.synchronize()
from wcache import WeightCacheKey
from wcache.channel import connect_engine_blocking, expect_engine_blocking
from wcache.client import cuda, driver
from wcache.client.client import _Request
key = WeightCacheKey.from_checkpoint(model)
req = _Request(key, "zero_copy")
ch, hello = connect_engine_blocking(Path(sock), software="map-probe", name="map-probe", timeout=60, pipeline=req.build)
try:
    frame, fds = expect_engine_blocking(ch, 60)
except Exception as exc:  # the proof refused (as WCacheClient.fetch_sync: the full key, same connection)
    if not req.refused(exc):
        raise
    ch.send_bytes_blocking(ch.conn.send(req.scanned(ch.conn)), 60)
    frame, fds = expect_engine_blocking(ch, 60)
state = req.state(frame, fds)
desc = state.slabs[0]
assert desc.kind == "cuda_vmm", desc.kind
fd = fds[desc.fd]
index = cuda.visible_uuids().index(desc.device_uuid)
cuda._make_current(index)
gran = driver.granularity(index)
total = max(gran, -(-(desc.offset + desc.size) // gran) * gran)
align = gran if alignment == "gran" else int(alignment)
d = driver.driver()
lib = ctypes.CDLL("libcuda.so.1")
copy = lib.cuMemcpyDtoH_v2
copy.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t]
ms = lambda a, b: round((b - a) * 1e3, 4)
def mapped(handle):
    r = {}
    ptr = driver.CUdeviceptr()
    t0 = time.perf_counter()
    driver.check(d.cuMemAddressReserve(ctypes.byref(ptr), total, align, 0, 0), "cuMemAddressReserve")
    t1 = time.perf_counter()
    addr = int(ptr.value)
    driver.check(d.cuMemMap(addr, total, 0, handle, 0), "cuMemMap")
    t2 = time.perf_counter()
    ro = False
    if access == "ro":
        acc = driver.access_desc(index, driver.CU_MEM_ACCESS_FLAGS_PROT_READ)
        ro = d.cuMemSetAccess(addr, total, acc, 1) == 0
    t3 = time.perf_counter()
    if not ro:
        acc = driver.access_desc(index, driver.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        driver.check(d.cuMemSetAccess(addr, total, acc, 1), "cuMemSetAccess")
    t4 = time.perf_counter()
    buf = ctypes.create_string_buffer(2)
    assert copy(buf, addr + desc.offset, 2) == 0
    t5 = time.perf_counter()
    assert copy(buf, addr + desc.offset + desc.size - 2, 2) == 0
    t6 = time.perf_counter()
    r.update(reserve=ms(t0, t1), map_range=ms(t1, t2), set_access_ro=ms(t2, t3), set_access_rw=ms(t3, t4),
             read_only=ro, first_read=ms(t4, t5), second_read=ms(t5, t6), address_aligned_1g=addr % (1 << 30) == 0)
    t7 = time.perf_counter()
    d.cuMemUnmap(addr, total); d.cuMemAddressFree(addr, total)
    r["unmap_free"] = ms(t7, time.perf_counter())
    return r
handle = driver.CUmemGenericAllocationHandle()
t0 = time.perf_counter()
driver.check(d.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
             driver.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "cuMemImportFromShareableHandle")
out = {"alignment": align, "access": access, "granularity": gran, "bytes": total,
       "import_handle": ms(t0, time.perf_counter())}
out["first"] = mapped(handle)
out["again"] = mapped(handle)
d.cuMemRelease(handle)
for f in fds:
    os.close(f)
ch.close()
print(json.dumps(out))
"""

# The anchors' holder: load every tensor to the GPU, share each through reduce_tensor (one legacy
# CUDA IPC handle per tensor), write the pickle, then hold the tensors until stdin closes.
IPC_HOLDER = r"""
import glob, pickle, sys, torch
from safetensors.torch import load_file
from torch.multiprocessing.reductions import reduce_tensor
model, device, out = sys.argv[1:4]
tensors = {}
for f in sorted(glob.glob(model + "/*.safetensors")):
    tensors.update(load_file(f, device=device))
torch.cuda.synchronize()
with open(out, "wb") as fh:
    pickle.dump({n: reduce_tensor(t) for n, t in tensors.items()}, fh)
print("ready", flush=True)
sys.stdin.read()
"""

# A fresh engine rebuilding the anchors' handles. argv: pickle device
IPC_ENGINE = r"""
import json, pickle, sys, time
path, device = sys.argv[1:3]
import torch
import torch.multiprocessing.reductions  # what unpickling the handles imports
torch.empty(1, device=device); torch.cuda.synchronize()
data = open(path, "rb").read()
t0 = time.perf_counter()
shared = pickle.loads(data)
w = {n: fn(*args) for n, (fn, args) in shared.items()}
t1 = time.perf_counter()
names = list(w)
touched = float(w[names[0]].view(-1)[0]) + float(w[names[-1]].view(-1)[-1])
torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"ms": (t2 - t0) * 1e3, "rebuild_ms": (t1 - t0) * 1e3, "touch_ms": (t2 - t1) * 1e3,
                  "tensors": len(w), "distinct_blocks": len({t.untyped_storage().data_ptr() for t in w.values()})}))
"""


def child_env(tree: Path = REPO) -> dict[str, str]:
    """Children import ``tree``'s wcache (this repo's unless ``--against``) from compiled bytecode, as from an
    installed package: the warm-up child writes it (the tree's ``__pycache__``, git-ignored) even where
    PYTHONDONTWRITEBYTECODE is set."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    env["PYTHONPATH"] = f"{tree}:{os.environ.get('PYTHONPATH', '')}"
    env["PYTHONSAFEPATH"] = "1"  # a daemon's `python -m` would put the working directory's wcache first
    return env


def run_child(code: str, *args: str, env: dict[str, str], timeout: float = 300) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    try:
        out = subprocess.run(
            [sys.executable, f.name, *args], capture_output=True, text=True, timeout=timeout, check=False, env=env
        )
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}): {out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def phase_medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each phase's median over the samples that have it (a sample that fell back to the scan has other phases)."""
    keys = list(dict.fromkeys(k for r in runs for k in r["phases_ms"]))
    return {k: round(statistics.median(r["phases_ms"][k] for r in runs if k in r["phases_ms"]), 3) for k in keys}


def phase_samples(runs: list[dict[str, Any]]) -> dict[str, list[float | None]]:
    """Each phase's figure per sample, in the samples' order (that of ``restart_weight_path_ms``'s samples): which
    phase a slow sample's time went to."""
    keys = list(dict.fromkeys(k for r in runs for k in r["phases_ms"]))
    return {k: [round(r["phases_ms"][k], 3) if k in r["phases_ms"] else None for r in runs] for k in keys}


TOUCH_VARIANTS = ("item", "driver", "other", "pinned", "window")
#: (cuMemAddressReserve alignment, access): the client's way first (0, read-only tried first)
MAP_VARIANTS = (("0", "ro"), ("0", "rw"), ("gran", "ro"), (str(1 << 30), "ro"))


def round_robin(variants: dict[str, Callable[[], dict[str, Any]]], rounds: int) -> dict[str, list[dict[str, Any]]]:
    """``rounds`` runs of every variant, one of each per round, the order rotating by one each round."""
    names = list(variants)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            runs[n].append(variants[n]())
    return runs


def probe_medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per variant: the median of every number its children printed (nested maps flattened to a.b), and the
    children's values of booleans (read_only, aligned) as they came."""
    out: dict[str, Any] = {}
    for variant, children in runs.items():
        flat: list[dict[str, Any]] = []
        for c in children:
            row: dict[str, Any] = {}
            for k, v in c.items():
                for kk, vv in v.items() if isinstance(v, dict) else [(None, v)]:
                    row[f"{k}.{kk}" if kk else k] = vv
            flat.append(row)
        summary: dict[str, Any] = {"samples": len(flat)}
        for k in dict.fromkeys(k for r in flat for k in r):
            vals = [r[k] for r in flat if k in r]
            if all(isinstance(v, bool) for v in vals):
                summary[k] = sorted(set(vals))
            elif all(isinstance(v, int | float) for v in vals):
                summary[k] = round(statistics.median(vals), 4)
        out[variant] = summary
    return out


def interleaved(
    ours: Callable[[], dict[str, Any]], theirs: Callable[[], dict[str, Any]], samples: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``samples`` fresh engines of each tree, one for one, the pair's order alternating (ours first, then theirs
    first): a machine that speeds up or slows down over the run moves both trees' figures alike."""
    mine: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    for i in range(samples):
        if i % 2 == 0:
            mine.append(ours())
            other.append(theirs())
        else:
            other.append(theirs())
            mine.append(ours())
    return mine, other


def against_results(tree: Path, ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """The other tree's figures from its interleaved engines, and the median of the pairs' differences (this tree's
    sample less the other's, ms: below zero, this tree is faster)."""
    out: dict[str, Any] = {"tree": str(tree)}
    for key, field in (
        ("restart_weight_path_ms", "restart_weight_path_ms"),
        ("first_fetch_fresh_engine_ms", "fetch_ms"),
    ):
        out[key] = stats([r[field] for r in theirs])
        out[f"{key}_paired_diff_median"] = round(
            statistics.median(a[field] - b[field] for a, b in zip(ours, theirs, strict=True)), 3
        )
    out["cpu_ms_median"] = {k: round(statistics.median(r["cpu_ms"][k] for r in theirs), 3) for k in theirs[0]["cpu_ms"]}
    out["collections_on_path"] = collections_on_path(theirs)
    out["phases_ms_median"] = phase_medians(theirs)
    out["phases_ms_samples"] = phase_samples(theirs)
    return out


def collections_on_path(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The cyclic GC's collections from ``import wcache`` to the touch, per sample (a tree that predates the
    record has none to give: ``None``): how many, and their ms together."""
    seen = [r.get("collections") for r in runs]
    return {
        "count_samples": [None if c is None else len(c) for c in seen],
        "ms_samples": [None if c is None else round(sum(ms for _, ms in c), 3) for c in seen],
    }


def stats(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "max": max(xs), "samples": [round(x, 3) for x in xs]}


def per_tensor_ipc(model: Path, device: str, work: Path, samples: int, env: dict[str, str]) -> list[dict[str, Any]]:
    pkl = work / "per_tensor_ipc.pkl"
    holder = subprocess.Popen(
        [sys.executable, "-c", IPC_HOLDER, str(model), device, str(pkl)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "ready":
            raise RuntimeError(f"per-tensor IPC holder failed (exit {holder.wait(60)})")
        return [run_child(IPC_ENGINE, str(pkl), device, env=env) for _ in range(samples)]
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(60)
        pkl.unlink(missing_ok=True)


def settle(model: Path) -> None:
    """Wait until the checkpoint's files are old enough for the daemon to record their proof (wcache.plan.key.RACY_NS:
    a daemon that read files changed just before cannot prove them, and every engine would scan)."""
    from wcache.plan.key import RACY_NS

    newest = max(f.stat().st_ctime_ns for f in model.iterdir())
    time.sleep(max(0.0, (newest + RACY_NS - time.time_ns()) / 1e9 + 0.05))


def small_checkpoint(path: Path) -> Path:
    """Llama-3-8B's 291 tensors at a small size (the default when no --model is given)."""
    from wcache.synthetic import LlamaShape, make_llama_checkpoint

    if not (path / "config.json").exists():
        shape = LlamaShape(hidden=256, intermediate=688, layers=32, heads=8, kv_heads=4, vocab=4096)
        make_llama_checkpoint(path, shape, shards=4, seed=0)
    return path


def moe_checkpoint(path: Path, device: str) -> Path:
    """gpu_bench's 50,000-tensor layout (built on the GPU there; on the CPU here without one)."""
    if not (path / "config.json").exists():
        if device.startswith("cuda"):
            gb.make_moe(path)
        else:
            import torch
            from safetensors.torch import save_file

            path.mkdir(parents=True, exist_ok=True)
            n = 50_000
            data = torch.randn(n * 8192, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            tensors = {
                f"model.layers.{i // 1000}.mlp.experts.{(i % 1000) // 3}.w{i % 3}.weight": data[
                    i * 8192 : (i + 1) * 8192
                ]
                .view(64, 128)
                .clone()
                for i in range(n)
            }
            save_file(tensors, str(path / "model.safetensors"))
            (path / "config.json").write_text(json.dumps({"architectures": ["MoeLikeForCausalLM"]}))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda:0", help="cuda:N (CUDA backend) or cpu (host backend)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/wcache-bench"))
    ap.add_argument("--model", type=Path, help="a checkpoint (the suite's 16 GB one: $W/llama3-8b)")
    ap.add_argument("--moe", action="store_true", help="the 50,000-tensor layout of gpu_bench.py")
    ap.add_argument("--samples", type=int, default=10, help="fresh engines per zero_copy figure (and the anchors')")
    ap.add_argument("--copy-samples", type=int, help="fresh engines for the copy-mode figure (default: --samples)")
    ap.add_argument("--named-samples", type=int, help="--moe: fresh engines building every name (default: --samples)")
    ap.add_argument("--cuda-export", choices=["vmm", "ipc"], default="vmm")
    ap.add_argument(
        "--probes",
        type=int,
        default=5,
        help="CUDA, dense: fresh engines per touch variant and per mapping variant (TOUCH_PROBE, MAP_PROBE; 0: none)",
    )
    ap.add_argument(
        "--against",
        type=Path,
        help="another tree (a directory holding wcache/, e.g. main's `git archive`): its own daemon, and its fresh "
        "engines interleaved one for one with this tree's, so that a VM's drift falls on both (AGAINST)",
    )
    args = ap.parse_args()
    if args.against is not None and not (args.against / "wcache" / "__init__.py").is_file():
        ap.error(f"--against {args.against}: no wcache/ package there")
    if args.samples < 1:
        ap.error("--samples must be >= 1")
    copy_samples = args.samples if args.copy_samples is None else args.copy_samples
    named_samples = args.samples if args.named_samples is None else args.named_samples
    if copy_samples < 1 or named_samples < 1:
        ap.error("--copy-samples and --named-samples must be >= 1")
    cuda = args.device.startswith("cuda")
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    gb.LOGS = work / "logs"
    gb.LOGS.mkdir(exist_ok=True)
    if args.moe:
        model = moe_checkpoint(work / "moe-50k" if cuda else work / "moe-50k-cpu", args.device)
    else:
        model = args.model or small_checkpoint(work / "llama-291-small")
    env = child_env()
    results: dict[str, Any] = {
        "benchmark": "fresh_engine_bench",
        "date": datetime.date.today().isoformat(),
        "device": args.device,
        "model": str(model),
        "cuda_export": args.cuda_export if cuda else None,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    extra = ["--device", args.device] + (["--cuda-export", args.cuda_export] if cuda else [])
    settle(model)
    d = gb.Daemon(model, work / "sock" / "fresh", *extra, name="fresh", env=env)
    other = None
    if args.against is not None:
        other_env = child_env(args.against.resolve())
        other = gb.Daemon(model, work / "sock" / "against", *extra, name="against", env=other_env)
    try:
        sock = d.wait(900)
        results["daemon_load_s"] = d.load_seconds()
        views = "groups" if args.moe else "names"
        engine = [str(sock), str(model), args.device]
        run_child(ENGINE, *engine, "zero_copy", views, env=env, timeout=900)  # writes bytecode
        if other is not None:
            against = [str(other.wait(900)), str(model), args.device]
            run_child(ENGINE, *against, "zero_copy", views, env=other_env, timeout=900)
            runs, theirs = interleaved(
                lambda: run_child(ENGINE, *engine, "zero_copy", views, env=env),
                lambda: run_child(ENGINE, *against, "zero_copy", views, env=other_env),
                args.samples,
            )
            results["against"] = against_results(args.against, runs, theirs)
        else:
            runs = [run_child(ENGINE, *engine, "zero_copy", views, env=env) for _ in range(args.samples)]
        copies = [run_child(ENGINE, *engine, "copy", views, env=env) for _ in range(copy_samples)]
        named = (
            [run_child(ENGINE, *engine, "zero_copy", "names", env=env) for _ in range(named_samples)]
            if args.moe
            else []
        )
        if cuda and not args.moe and args.probes > 0:
            results["touch_probe"] = probe_medians(
                round_robin(
                    {v: partial(run_child, TOUCH_PROBE, *engine, v, env=env) for v in TOUCH_VARIANTS}, args.probes
                )
            )
            if args.cuda_export == "vmm":
                results["map_probe"] = probe_medians(
                    round_robin(
                        {
                            f"align={a},{acc}": partial(run_child, MAP_PROBE, *engine, a, acc, env=env)
                            for a, acc in MAP_VARIANTS
                        },
                        args.probes,
                    )
                )
    finally:
        d.stop()
        if other is not None:
            other.stop()
    first = stats([r["fetch_ms"] for r in runs])
    results["definition"] = {
        "first_fetch_fresh_engine_ms": (
            "first zero_copy fetch_sync in a fresh process (connect, HELLO, GET_STATE, map) + "
            + (
                "CachedWeights.groups() (one stacked view per STATE group: the fused-MoE engine path) + touch of "
                "the first and last group's end elements"
                if args.moe
                else "materialize() (every per-name view) + touch of the first and last tensor"
            )
        ),
        "restart_weight_path_ms": "import wcache -> WeightCacheKey.from_checkpoint -> the fetch above, torch "
        "imported and the CUDA context up beforehand (not timed)",
        "first_copy_fresh_engine_ms": "as first_fetch_fresh_engine_ms with mode='copy' (synchronized, released)",
    }
    if args.moe:
        results["definition"]["first_fetch_materialized_ms"] = (
            "the same first zero_copy fetch with materialize() (50,000 per-name tensor objects) + touch of the "
            "first and last tensor, in other fresh processes"
        )
        results["first_fetch_materialized_ms"] = stats([r["fetch_ms"] for r in named])
        results["materialized_phases_ms_median"] = phase_medians(named)
    results["first_fetch_fresh_engine_ms"] = first
    results["restart_weight_path_ms"] = stats([r["restart_weight_path_ms"] for r in runs])
    results["definition"]["cpu_ms_median"] = (
        "the engine process's CPU time (time.process_time) over the same spans, medians: what other processes "
        "on a shared machine disturb least (the daemon's answer is not in it)"
    )
    results["cpu_ms_median"] = {k: round(statistics.median(r["cpu_ms"][k] for r in runs), 3) for k in runs[0]["cpu_ms"]}
    results["first_copy_fresh_engine_ms"] = stats([r["fetch_ms"] for r in copies])
    if cuda and not args.moe:
        ipc = per_tensor_ipc(model, args.device, work, args.samples, env)
        results["per_tensor_ipc_fresh_engine_ms"] = stats([r["ms"] for r in ipc])
        results["per_tensor_ipc_phases_ms"] = {k: ipc[0][k] for k in ("rebuild_ms", "touch_ms")}
        results["per_tensor_ipc_distinct_blocks"] = ipc[0]["distinct_blocks"]
        results["first_fetch_over_per_tensor_ipc"] = (
            first["median"] / results["per_tensor_ipc_fresh_engine_ms"]["median"]
        )
    else:
        why = "host backend: no CUDA IPC" if not cuda else "50,000 tensors: not measured the anchors' way"
        results["per_tensor_ipc_fresh_engine_ms"] = {"median": None, "max": None, "samples": [], "skipped": why}
        results["first_fetch_over_per_tensor_ipc"] = None
    by_path = sorted(runs, key=lambda r: r["restart_weight_path_ms"])
    median_run = by_path[len(by_path) // 2]
    results["phases_ms"] = {k: round(v, 3) for k, v in median_run["phases_ms"].items()}
    results["phases_ms_median"] = phase_medians(runs)
    results["phases_ms_samples"] = phase_samples(runs)
    results["copy_phases_ms_median"] = phase_medians(copies)
    results["collections_on_path"] = collections_on_path(runs)
    results["key_proven_samples"] = sum(bool(r.get("key_proven")) for r in runs)
    results["key_scanned_samples"] = sum(bool(r.get("key_scanned")) for r in runs)
    results["tensors"] = runs[0]["tensors"]
    results["cuda_bindings_imported_by_engine"] = any(r["cuda_bindings_imported"] for r in runs)
    results["wall_s"] = round(time.perf_counter() - STARTED, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict) or "median" in v}, default=str))


STARTED = time.perf_counter()

if __name__ == "__main__":
    main()
    print(f"fresh_engine_bench: {time.perf_counter() - STARTED:.1f} s", file=sys.stderr)
