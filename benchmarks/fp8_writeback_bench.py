"""FP8 write-back on the GPU (docs/protocol.md §4.13): the restart a user of an on-the-fly
quantized model saves.

A wcache daemon serves a bf16 Llama (wcache.synthetic) on the GPU. Two fresh engine processes:

- start 1 loads the bf16 checkpoint with transformers' FP8 quantize-on-load (``FineGrainedFP8Config``:
  every Linear but ``lm_head`` becomes ``weight`` float8_e4m3fn + ``weight_scale_inv`` float32 block
  scales), then deposits every parameter and buffer under a RecipeKey (engine ``transformers`` and its
  version, quantization ``fp8``, ``quant_config`` = hash of the config, device type and capability);
- start 2 builds the same model on meta (the FP8 Linear modules included, no quantization), fetches the
  recipe zero_copy and attaches the daemon's tensors as its parameters and buffers.

Every parameter and buffer of start 2 must be bit-identical to start 1's (SHA-256 of each tensor's
bytes), and start 2 must have allocated nothing for them (one mapped slab). Both starts are timed
inside the process, transformers imported before the clock starts (``start1_s``: load + quantize +
deposit; ``start2_s``: build + fetch + attach) and as whole processes, imports and CUDA context
included (``*_process_s``). No forward runs: transformers' FP8 matmul
kernel comes from the Hub (``kernels``), unreachable offline. ``copy_on_commit`` measures what a
daemon-side copy at COMMIT would cost for the deposit's size (a second VMM allocation + one
device-to-device copy: the alternative docs/security.md weighs).

On a machine without CUDA this fails (exit 1, the reason printed): transformers refuses FP8
quantize-on-load without a GPU ("A GPU or XPU is needed for FP8 quantization").

    python benchmarks/fp8_writeback_bench.py --device cuda:0 --work /tmp/wcache-fp8wb --out F.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

if TYPE_CHECKING:
    import torch
    from torch import nn

    from wcache.plan.key import WeightCacheKey
    from wcache.plan.recipe import RecipeKey

#: about 0.5 B parameters, 1 GB in bf16: large enough for the starts' times to mean something
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {  # hidden, intermediate, layers, heads, kv_heads, vocab
    "small": (2048, 5632, 8, 16, 4, 32000),
    "tiny": (256, 512, 2, 4, 4, 1024),
}
BLOCK = (128, 128)


def quant_config() -> Any:
    """The FP8 config both starts use (block-wise 128x128, dynamic activations)."""
    from transformers import FineGrainedFP8Config

    return FineGrainedFP8Config(weight_block_size=BLOCK, activation_scheme="dynamic")


def config_hash(config: Mapping[str, Any]) -> str:
    """16 hex digits naming a quantization config (its JSON, keys sorted): the recipe's ``quant_config``."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def recipe_key(
    base: WeightCacheKey, config: Mapping[str, Any], *, engine_version: str, capability: tuple[int, int]
) -> RecipeKey:
    from wcache.plan.recipe import RecipeKey

    return RecipeKey.of(
        base,
        engine="transformers",
        engine_version=engine_version,
        quantization="fp8",
        quant_config=config_hash(config),
        device_type="cuda",
        device_capability=f"{capability[0]}.{capability[1]}",
    )


def state_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by module path (tied names included), as deposit_module deposits them."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    out.update((n, b) for n, b in module.named_buffers(remove_duplicate=False) if b is not None)
    return out


def digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> "dtype shape sha256-of-bytes"."""
    import torch

    out = {}
    for name, t in tensors.items():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        out[name] = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} {hashlib.sha256(raw).hexdigest()}"
    return out


def differences(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    """Names missing on either side or whose digests differ (sorted)."""
    return sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))


def fp8_skeleton(model_dir: Path) -> nn.Module:
    """The model start 1's quantize-on-load produces, built on meta without loading or quantizing: the
    config's LlamaForCausalLM with transformers' own FP8 Linear modules in place (every Linear but
    ``lm_head``, what the quantizer converts). Everything is on meta, buffers too (the rotary
    ``inv_freq`` / ``original_inv_freq``): start 1 deposited them, ``attach`` brings them back. Built
    with ``wcache.nn.empty_parameters`` instead (real buffers, parameters moved to meta as they are
    registered), the 0.5 B model took 2.6 s on the 2-core CPU machine against 0.04 s on meta (0.026 s on
    the H200's host): nn.Linear allocates and FP8Linear reallocates every weight on the CPU first."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
        out: nn.Module = replace_with_fp8_linear(
            model, modules_to_not_convert=["lm_head"], quantization_config=quant_config()
        )
    return out


def _import_transformers() -> float:
    """What both starts import before their clocks start (their ``*_process_s`` include it): transformers'
    auto classes, its FP8 integration and the Llama modeling module, which ``from_pretrained`` and
    ``from_config`` would otherwise import lazily inside the timed region. Returns the seconds taken."""
    import importlib

    t = time.perf_counter()
    for name in (
        "transformers",
        "transformers.integrations.finegrained_fp8",
        "transformers.models.llama.modeling_llama",
    ):
        importlib.import_module(name)
    return round(time.perf_counter() - t, 4)


def _require_gpu(device: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            f"no CUDA device for {device}: transformers' FP8 quantize-on-load needs a GPU (compute capability "
            ">= 8.9); run this on the H200 (benchmarks/gpu_suite.sh PARTS=fp8)"
        )


def start1(socket: Path, model_dir: Path, device: str, digest_file: Path) -> dict[str, Any]:
    """Load + quantize + deposit; the state's digests go to ``digest_file``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from wcache import WCacheClient, WeightCacheKey
    from wcache.nn import deposit_module

    _require_gpu(device)
    imports = _import_transformers()
    qc = quant_config()
    config = qc.to_dict()  # before loading: the quantizer fills in fields (modules_to_not_convert...)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=qc, dtype=torch.bfloat16, device_map=device
    )
    torch.cuda.synchronize()
    t_load = time.perf_counter()
    state = state_tensors(model)
    fp8 = [n for n, t in state.items() if t.dtype == torch.float8_e4m3fn]
    if not fp8:
        raise RuntimeError("transformers loaded no float8_e4m3fn tensor: FP8 quantize-on-load did not run")
    base = WeightCacheKey.from_checkpoint(model_dir)
    key = recipe_key(
        base,
        config,
        engine_version=transformers.__version__,
        capability=torch.cuda.get_device_capability(device),
    )
    done = asyncio.run(deposit_module(model, key, WCacheClient(socket)))
    t_dep = time.perf_counter()
    digest_file.write_text(json.dumps(digests(state)))
    return {
        "start1_s": round(t_dep - t0, 4),
        "start1_imports_s": imports,
        "load_quantize_s": round(t_load - t0, 4),
        "deposit_s": round(t_dep - t_load, 4),
        "tensors": done.tensors,
        "names": len(state),
        "fp8_tensors": len(fp8),
        "scales": sum(1 for n in state if n.endswith("weight_scale_inv")),
        "bytes": done.bytes,
        "key": key.to_wire(),
    }


def start2(socket: Path, model_dir: Path, device: str, digest_file: Path) -> dict[str, Any]:
    """Build on meta + fetch the recipe zero_copy + attach; the state's digests go to ``digest_file``."""
    import torch
    import transformers

    from wcache import WCacheClient, WeightCacheKey
    from wcache.nn import attach

    _require_gpu(device)
    imports = _import_transformers()
    torch.empty(1, device=device)
    allocated = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    model = fp8_skeleton(model_dir)
    t_build = time.perf_counter()
    key = recipe_key(
        WeightCacheKey.from_checkpoint(model_dir),
        quant_config().to_dict(),
        engine_version=transformers.__version__,
        capability=torch.cuda.get_device_capability(device),
    )
    w = asyncio.run(WCacheClient(socket).fetch(key, "zero_copy"))
    t_fetch = time.perf_counter()
    report = attach(model, w)
    t_attach = time.perf_counter()
    state = state_tensors(model)
    storages = {t.untyped_storage().data_ptr() for t in state.values()}
    grown = torch.cuda.memory_allocated(device) - allocated
    result = {
        "start2_s": round(t_attach - t0, 4),
        "start2_imports_s": imports,
        "build_s": round(t_build - t0, 4),
        "fetch_s": round(t_fetch - t_build, 4),
        "attach_s": round(t_attach - t_fetch, 4),
        "parameters": report.parameters,
        "buffers": report.buffers,
        "kept_buffers": report.kept_buffers,
        "storages": len(storages),
        "allocated_bytes": grown,
        "zero_copy": len(storages) == 1 and grown < (1 << 20) and all(t.is_cuda for t in state.values()),
    }
    digest_file.write_text(json.dumps(digests(state)))
    return result


def copy_on_commit_cost(nbytes: int, index: int, repeats: int = 3) -> dict[str, Any]:
    """What the daemon would pay to copy a committed deposit into an allocation the engine never saw:
    cuMemCreate + map + export of a second slab, and one device-to-device copy (best of ``repeats``)."""
    import torch

    from wcache import _cuda

    torch.empty(1, device=f"cuda:{index}")
    src = _cuda.vmm_allocate(nbytes, index)
    try:
        s = src.buffer.tensor()
        s.fill_(1)
        allocs, copies = [], []
        for _ in range(repeats):
            torch.cuda.synchronize(index)
            t = time.perf_counter()
            dst = _cuda.vmm_allocate(nbytes, index)
            allocs.append(time.perf_counter() - t)
            try:
                d = dst.buffer.tensor()
                torch.cuda.synchronize(index)
                t = time.perf_counter()
                d.copy_(s)
                torch.cuda.synchronize(index)
                copies.append(time.perf_counter() - t)
                del d
            finally:
                dst.close()
        del s
    finally:
        src.close()
    copy = min(copies)
    return {
        "bytes": nbytes,
        "alloc_s": round(min(allocs), 5),
        "copy_s": round(copy, 5),
        "copy_gb_s": round(nbytes / copy / 1e9, 1),
        "extra_device_bytes_at_commit": nbytes,
    }


def _child(role: str, args: argparse.Namespace) -> int:
    fn = start1 if role == "start1" else start2
    print(json.dumps(fn(args.socket, args.model, args.device, args.digests)), flush=True)
    return 0


def _run_child(role: str, socket: Path, model: Path, device: str, digests_file: Path) -> dict[str, Any]:
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, __file__, "--role", role, "--socket", str(socket), "--model", str(model)]
        + ["--device", device, "--digests", str(digests_file)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    wall = time.perf_counter() - t
    if p.returncode != 0:
        sys.stderr.write(p.stdout + p.stderr)
        raise RuntimeError(f"{role} failed (rc {p.returncode}): {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    out[f"{role}_process_s"] = round(wall, 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--work", type=Path, default=Path("/tmp/wcache-fp8wb"))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--role", choices=["start1", "start2"], help=argparse.SUPPRESS)
    ap.add_argument("--socket", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--digests", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        return _child(args.role, args)

    import torch

    from wcache.server.process import spawn_daemon
    from wcache.synthetic import LlamaShape, make_llama_checkpoint

    _require_gpu(args.device)
    model = args.work / f"llama-{args.shape}"
    if not (model / "config.json").exists():
        make_llama_checkpoint(model, LlamaShape(*SHAPES[args.shape]), seed=0)
    sdir = args.work / "sock"
    sdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    res: dict[str, Any] = {
        "benchmark": "fp8_writeback_bench",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(args.device),
        "shape": args.shape,
        "checkpoint_bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")),
    }
    daemon = spawn_daemon(model, sdir, "--device", args.device, log=args.work / "daemon.log", timeout=300)
    try:
        d1, d2 = args.work / "start1.json", args.work / "start2.json"
        res.update(_run_child("start1", daemon.socket, model, args.device, d1))
        res.update(_run_child("start2", daemon.socket, model, args.device, d2))
        diff = differences(json.loads(d1.read_text()), json.loads(d2.read_text()))
        res["bit_identical"] = not diff
        res["different"] = diff[:20]
    finally:
        daemon.stop()
    index = torch.device(args.device).index or 0
    res["copy_on_commit"] = [copy_on_commit_cost(n, index) for n in (int(res["bytes"]), 16 << 30)]
    text = json.dumps(res, indent=2)
    print(text, flush=True)
    if args.out:
        args.out.write_text(text + "\n")
    ok = res["bit_identical"] and res["zero_copy"] and res["fp8_tensors"] > 0
    if not ok:
        print("FAILED: start 2 is not start 1's FP8 state, mapped zero_copy", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
