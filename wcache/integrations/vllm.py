"""A vLLM model loader: ``vllm serve DIR --load-format wcache`` maps the weights from a daemon.

Registered through vLLM's public loader registry (``register_model_loader``) by the
``vllm.general_plugins`` entry point ``wcache`` (pyproject.toml), which vLLM runs in every
process it starts. Written against vLLM 0.33's loader API, after its own IPC weight-cache
loader:

1. unsupported quantization is refused before anything is loaded (the daemon serves
   unquantized checkpoint tensors);
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
   default loader with one warning naming the reason (``fallback: false`` raises instead).

Extra config (``--model-loader-extra-config '{...}'``): ``socket`` (daemon socket path;
default: wcache's default path for the rank), ``mode`` (``zero_copy`` | ``copy``),
``fallback`` (bool), ``timeout`` (seconds), ``transform`` (the daemon's ``--transform``),
``plan_file``.

Logs go to the ``vllm.wcache`` logger, a child of vLLM's own, so one INFO line per load (key,
mode, tensors, bytes, ms) appears in vLLM's log output next to its lines.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from copy import copy
from typing import Any

import torch
from torch import nn

from wcache.errors import IncompatibleModelError, WCacheError

__all__ = [
    "EXTRA_CONFIG_KEYS",
    "LOAD_FORMAT",
    "cached_weights",
    "check_parallel",
    "check_quantization",
    "model_info",
    "register",
]

# a child of vLLM's "vllm" logger: vLLM's handler prints it (its loggers do not propagate to the root)
log = logging.getLogger("vllm.wcache")

LOAD_FORMAT = "wcache"
EXTRA_CONFIG_KEYS = ("socket", "mode", "fallback", "timeout", "transform", "plan_file")
DEFAULT_TRANSFORM = "wcache.transforms:vllm_layout"
#: the attribute of the loaded module that holds its zero_copy weights (and so the daemon's lease)
WEIGHTS_ATTR = "_wcache_weights"
#: the attribute of the loaded module that says where its weights came from: {"origin": "cache" | "disk",
#: "mode", "key", "tensors", "zero_copy_after_processing"} or {"origin": "disk", "reason"} after a fallback
INFO_ATTR = "_wcache"


def check_quantization(quantization: str | None) -> None:
    """The daemon serves checkpoint tensors as stored: only unquantized models load from it."""
    if quantization:
        raise IncompatibleModelError(
            f"--load-format {LOAD_FORMAT} serves unquantized checkpoints; quantization {quantization!r} is not "
            "supported (use --load-format auto)",
            details={"quantization": quantization},
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
    }


def _loader_class() -> type:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    from wcache.client import WCacheClient
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
            client = WCacheClient(self.options["socket"], timeout=self.options["timeout"], device=device)
            return client.fetch_sync(self._key(model_config), mode=mode)

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
            check_quantization(getattr(model_config, "quantization", None))
            check_parallel(getattr(vllm_config, "parallel_config", None))
            try:
                return self._load_from_cache(vllm_config, model_config, prefix)
            except WCacheError as exc:
                if not self.options["fallback"]:
                    raise
                reason = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "wcache: %s loaded with vLLM's default loader instead of the cache (%s)", model_config.model, reason
                )
            model: nn.Module = DefaultModelLoader(self._fallback_config()).load_model(
                vllm_config=vllm_config, model_config=model_config, prefix=prefix
            )
            model.__dict__[INFO_ATTR] = {"origin": "disk", "reason": reason}
            return model

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
                # vLLM's loaders and post-processing read attributes it set on each Parameter
                attrs = {n: dict(vars(p)) for n, p in model.named_parameters(remove_duplicate=False)}
                report = attach(model, by_module_name(model, weights), strict=False)
                for n, p in model.named_parameters(remove_duplicate=False):
                    for a, v in attrs.get(n, {}).items():
                        setattr(p, a, v)
                # the daemon serves the checkpoint's tensors in vLLM's load layout, not vLLM's runtime format:
                # post-processing runs as after vLLM's own load_weights (repacking reads the views; a method
                # that wrote into them in place would fault on the read-only mapping: use mode "copy" there)
                process_weights_after_loading(model, model_config, device)
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
