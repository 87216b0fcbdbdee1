"""What bounds a restarted daemon's reload of 16 GB from host memory, and what could outlive it (docs/performance.md).

Four measurements, each in fresh processes (the parent never touches CUDA):

- ``facts``: kernel, transparent huge page settings, /dev/shm's mount, IOMMU on the command line.
- ``copy``: the CPU side of the staged reload alone: N threads ``pread`` a 16 GiB tmpfs file into
  per-thread buffers (no GPU). A staged reload cannot beat this.
- ``keep``: does a VMM allocation outlive the process that made it when only its exported POSIX fd
  is still open, held by a process with no CUDA context (a keeper, or systemd's FD store)? A child
  allocates (device memory, or pinned host memory on NUMA node 0), fills it, sends the fd to the
  parent and SIGKILLs itself; a second child imports the fd and checks every sampled byte. For host
  memory it also times the 16 GiB copy to a device buffer (DMA from memory that is already pinned).
  nvidia-smi's used memory is recorded at each step.
- ``thp``: page-locking a tmpfs file in place (``cudaHostRegister``, read-only) on /dev/shm and on a
  tmpfs mounted with ``huge=always`` (2 MiB pages), and the copy to the device after it.

    python benchmarks/restart_probe.py --out $OUT/restart_probe.json [--parts facts copy keep thp] [--gib 16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_bench import gpu_used_mib  # noqa: E402  (no torch, no CUDA: the parent here must hold no context)

PRELUDE = r"""
import json, os, socket, sys, time
import torch
import cuda.bindings.driver as d
torch.empty(1, device="cuda:0"); torch.cuda.synchronize()
def ck(r, what):
    code = int(r[0] if isinstance(r, tuple) else r)
    if code:
        raise RuntimeError(f"{what}: error {code}")
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r
def prop(kind):
    p = d.CUmemAllocationProp()
    p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    if kind == "device":
        p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    else:
        p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    p.location.id = 0
    p.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return p
def gran(kind):
    return int(ck(d.cuMemGetAllocationGranularity(prop(kind), d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity"))
def mapped(handle, n):
    ptr = int(ck(d.cuMemAddressReserve(n, 0, 0, 0), "reserve"))
    ck(d.cuMemMap(ptr, n, 0, handle, 0), "map")
    a = d.CUmemAccessDesc()
    a.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    a.location.id = 0
    a.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    ck(d.cuMemSetAccess(ptr, n, [a], 1), "access")
    class B: pass
    b = B(); b.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}
    return torch.as_tensor(b, device="cuda:0")
def marker(n):
    g = torch.Generator(device="cuda:0"); g.manual_seed(1234)
    return torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda:0", generator=g)
"""

MAKER = (
    PRELUDE
    + r"""
kind, n, sock_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
n = -(-n // gran(kind)) * gran(kind)
t0 = time.perf_counter()
h = ck(d.cuMemCreate(n, prop(kind), 0), "cuMemCreate")
t_create = time.perf_counter() - t0
t = mapped(h, n)
t.fill_(0x5A); t[n // 2 : n // 2 + (1 << 20)].copy_(marker(n)); torch.cuda.synchronize()
fd = int(ck(d.cuMemExportToShareableHandle(h, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "export"))
s = socket.socket(fileno=sock_fd)
socket.send_fds(s, [json.dumps({"bytes": n, "create_s": t_create}).encode()], [fd])
s.recv(1)  # the parent has the fd and has read used memory: die without releasing anything
os.kill(os.getpid(), 9)
"""
)

CHECKER = (
    PRELUDE
    + r"""
kind, n, fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
h = ck(d.cuMemImportFromShareableHandle(fd, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "import")
t = mapped(h, n)
torch.cuda.synchronize()
out = {"import_map_s": time.perf_counter() - t0}
ok = bool((t[: 1 << 20] == 0x5A).all()) and bool((t[-(1 << 20):] == 0x5A).all())
ok = ok and bool(torch.equal(t[n // 2 : n // 2 + (1 << 20)], marker(n)))
out["data_ok"] = ok
if kind != "device":
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    for rep in range(3):
        torch.cuda.synchronize(); t1 = time.perf_counter()
        ck(d.cuMemcpy(dst.data_ptr(), t.data_ptr(), n), "cuMemcpy")
        torch.cuda.synchronize(); out.setdefault("copy_to_device_s", []).append(time.perf_counter() - t1)
    torch.cuda.synchronize(); t1 = time.perf_counter()
    dst.copy_(t); torch.cuda.synchronize(); out["torch_copy_s"] = time.perf_counter() - t1
    out["copy_ok"] = bool(torch.equal(dst[n // 2 : n // 2 + (1 << 20)], marker(n)))
print(json.dumps(out))
"""
)

REGISTER = r"""
import json, mmap, os, sys, time, warnings
import torch
path, n = sys.argv[1], int(sys.argv[2])
torch.empty(1, device="cuda:0"); torch.cuda.synchronize()
fd = os.open(path, os.O_RDONLY)
mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ); os.close(fd)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    host = torch.frombuffer(mm, dtype=torch.uint8)
dst = torch.empty(n, dtype=torch.uint8, device="cuda:0")
cudart = torch.cuda.cudart()
t0 = time.perf_counter()
err = cudart.cudaHostRegister(host.data_ptr(), n, 0x08)
reg = time.perf_counter() - t0
out = {"register_s": reg, "register_err": int(err)}
if int(err) == 0:
    for rep in range(2):
        torch.cuda.synchronize(); t1 = time.perf_counter()
        dst.copy_(host, non_blocking=True); torch.cuda.synchronize()
        out.setdefault("copy_s", []).append(time.perf_counter() - t1)
    out["copy_ok"] = bool(torch.equal(dst[-4096:].cpu(), host[-4096:]))
    cudart.cudaHostUnregister(host.data_ptr())
print(json.dumps(out))
"""


def sh(cmd: str) -> str:
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30, check=False)
    return (p.stdout + p.stderr).strip()


def facts() -> dict[str, Any]:
    return {
        "kernel": sh("uname -r"),
        "thp_enabled": sh("cat /sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem_enabled": sh("cat /sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "dev_shm_mount": sh("grep ' /dev/shm ' /proc/mounts"),
        "cmdline": sh("cat /proc/cmdline"),
        "hugepages": sh("grep -i huge /proc/meminfo"),
        "numa": sh("ls /sys/devices/system/node | grep node"),
        "cpu": sh("grep -m1 'model name' /proc/cpuinfo"),
    }


def write_file(path: Path, n: int) -> float:
    """``n`` bytes of non-zero data (a fallocated tmpfs page reads as the shared zero page: too fast)."""
    t = time.perf_counter()
    block = os.urandom(1 << 20) * 64
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        off = 0
        while off < n:
            off += os.pwrite(fd, block[: min(len(block), n - off)], off)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def copy_ceiling(path: Path, n: int, threads: int, chunk: int) -> dict[str, Any]:
    fd = os.open(path, os.O_RDONLY)
    bufs: dict[int, bytearray] = {}

    def one(off: int) -> None:
        import threading

        b = bufs.get(threading.get_ident())
        if b is None:
            b = bufs[threading.get_ident()] = bytearray(chunk)
        m = memoryview(b)[: min(chunk, n - off)]
        done = 0
        while done < len(m):
            done += os.preadv(fd, [m[done:]], off + done)

    try:
        with ThreadPoolExecutor(threads) as pool:  # warm the buffers (first touch) outside the timing
            list(pool.map(one, range(0, threads * chunk, chunk)))
            t = time.perf_counter()
            list(pool.map(one, range(0, n, chunk)))
            s = time.perf_counter() - t
    finally:
        os.close(fd)
    return {"threads": threads, "chunk_mib": chunk >> 20, "seconds": s, "gb_s": n / s / 1e9}


def keep(kind: str, n: int) -> dict[str, Any]:
    r: dict[str, Any] = {"kind": kind, "used_mib_start": gpu_used_mib()}
    a, b = socket.socketpair()
    maker = subprocess.Popen(
        [sys.executable, "-c", MAKER, kind, str(n), str(b.fileno())], pass_fds=(b.fileno(),), stderr=subprocess.PIPE
    )
    b.close()
    fd = -1
    try:
        a.settimeout(120)
        msg, fds, _, _ = socket.recv_fds(a, 4096, 1)
        if not fds:
            raise RuntimeError("maker sent no fd")
        fd = fds[0]
        r.update(json.loads(msg))
        r["used_mib_maker_alive"] = gpu_used_mib()
        a.send(b"x")
        maker.wait(60)
        r["maker_rc"] = maker.returncode
        time.sleep(1.0)
        r["used_mib_after_maker_killed"] = gpu_used_mib()
        p = subprocess.run(
            [sys.executable, "-c", CHECKER, kind, str(r["bytes"]), str(fd)],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        if p.returncode == 0:
            r.update(json.loads(p.stdout.strip().splitlines()[-1]))
        else:
            r["checker_error"] = p.stderr.strip()[-600:]
    except Exception as exc:
        r["error"] = f"{type(exc).__name__}: {exc}"
        if maker.poll() is None:
            maker.kill()
        err = maker.stderr.read().decode()[-600:] if maker.stderr else ""
        if err:
            r["maker_stderr"] = err
    finally:
        if fd >= 0:
            os.close(fd)
        a.close()
    time.sleep(1.0)
    r["used_mib_after_fd_closed"] = gpu_used_mib()
    return r


def register(path: Path, n: int) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, "-c", REGISTER, str(path), str(n)], capture_output=True, text=True, timeout=180, check=False
    )
    if p.returncode != 0:
        return {"error": p.stderr.strip()[-600:]}
    r: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", nargs="*", default=["facts", "copy", "keep", "thp"])
    ap.add_argument("--gib", type=float, default=16.0)
    args = ap.parse_args()
    n = int(args.gib * (1 << 30))
    res: dict[str, Any] = {"benchmark": "restart_probe", "date": datetime.date.today().isoformat(), "bytes": n}

    def save() -> None:
        args.out.write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res)[-1500:], flush=True)

    if "facts" in args.parts:
        res["facts"] = facts()
        save()
    shm = Path("/dev/shm/wcache-restart-probe.slab")
    try:
        if "copy" in args.parts or "thp" in args.parts:
            res["write_shm_s"] = write_file(shm, n)
        if "copy" in args.parts:
            res["copy"] = []
            for threads, chunk in ((8, 16), (16, 4), (16, 8), (16, 16), (16, 64)):
                res["copy"].append(copy_ceiling(shm, n, threads, chunk << 20))
                save()
        if "thp" in args.parts:
            res["register_shm"] = register(shm, n)
            save()
    finally:
        shm.unlink(missing_ok=True)
    if "keep" in args.parts:
        res["keep"] = []
        for kind in ("device", "host_numa"):
            res["keep"].append(keep(kind, n))
            save()
    if "thp" in args.parts:
        mnt = Path("/mnt/wcache-thp")
        mnt.mkdir(parents=True, exist_ok=True)
        res["thp_mount"] = sh(f"mount -t tmpfs -o size={int(args.gib) + 2}g,huge=always,mode=0700 wcache-thp {mnt}")
        f = mnt / "slab"
        try:
            if "huge=always" in sh(f"grep ' {mnt} ' /proc/mounts"):
                res["write_thp_s"] = write_file(f, n)
                res["thp_meminfo"] = sh("grep -E 'ShmemHugePages|ShmemPmdMapped|FileHugePages' /proc/meminfo")
                res["register_thp"] = register(f, n)
                res["copy_thp"] = [copy_ceiling(f, n, 16, 16 << 20)]
                save()
        finally:
            f.unlink(missing_ok=True)
            sh(f"umount {mnt}")
    save()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
