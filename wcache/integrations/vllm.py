"""A vLLM model loader: ``vllm serve DIR --load-format wcache`` maps the weights from a daemon.

Registered through vLLM's public loader registry (``register_model_loader``) by the
``vllm.general_plugins`` entry point ``wcache`` (pyproject.toml), which vLLM runs in every
process it starts. Written against vLLM 0.33's loader API, after its own IPC weight-cache
loader:

1. unsupported quantization is refused before anything is loaded (the daemon serves
   unquantized checkpoint tensors);
2. the rank's key is the checkpoint fingerprint + tensor-parallel rank/size + dtype (+ the
   transform the daemon applied); the daemon must serve vLLM's parameter layout, i.e. be
   started with ``--tp-rank R --tp-size N --transform wcache.transforms:fuse_llama_qkv_gate_up``
   for Llama-family models (qkv_proj / gate_up_proj, sharded as vLLM shards them);
3. the model is built with its parameters on the meta device (buffers computed at init,
   like rotary caches, are real), and every parameter becomes a view of the daemon's memory
   (zero_copy) or an owned copy (copy mode); names the cache lacks are an error listing them;
4. vLLM's post-loading step runs under ``weights_already_processed()``: quant methods must
   not transform the already-final tensors again;
5. when the daemon is absent, refuses, or serves another key, loading falls back to vLLM's
   default loader with one warning naming the reason (``fallback: false`` raises instead).

Extra config (``--model-loader-extra-config '{...}'``): ``socket`` (daemon socket path;
default: wcache's default path for the rank), ``mode`` (``zero_copy`` | ``copy``),
``fallback`` (bool), ``timeout`` (seconds), ``transform`` (the daemon's ``--transform``),
``plan_file``.
"""

from __future__ import annotations

import dataclasses
import logging
from copy import copy
from typing import Any

import torch
from torch import nn

from wcache.errors import WCacheError

__all__ = ["EXTRA_CONFIG_KEYS", "LOAD_FORMAT", "check_quantization", "register"]

log = logging.getLogger("wcache.vllm")

LOAD_FORMAT = "wcache"
EXTRA_CONFIG_KEYS = ("socket", "mode", "fallback", "timeout", "transform", "plan_file")
DEFAULT_TRANSFORM = "wcache.transforms:fuse_llama_qkv_gate_up"


def check_quantization(quantization: str | None) -> None:
    """The daemon serves checkpoint tensors as stored: only unquantized models load from it."""
    if quantization:
        raise WCacheError(
            f"--load-format {LOAD_FORMAT} serves unquantized checkpoints; quantization {quantization!r} is not "
            "supported (use --load-format auto)",
            details={"quantization": quantization},
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
    from vllm.model_executor.utils import weights_already_processed
    from vllm.utils.torch_utils import set_default_torch_dtype

    from wcache.client import WCacheClient
    from wcache.key import WeightCacheKey
    from wcache.nn import attach, empty_parameters

    class WCacheModelLoader(BaseModelLoader):  # type: ignore[misc]
        """``--load-format wcache``: weights from a wcache daemon (see the module docstring)."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.options = parse_extra_config(load_config.model_loader_extra_config)
            self.weights: Any = None  # the CachedWeights behind a zero_copy model: keeps the lease

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
                raise WCacheError(f"the cache lacks {len(missing)} parameter(s): {missing[:8]}")
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(weights[name])

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            check_quantization(getattr(model_config, "quantization", None))
            try:
                return self._load_from_cache(vllm_config, model_config, prefix)
            except WCacheError as exc:
                if not self.options["fallback"]:
                    raise
                log.warning(
                    "wcache: %s loaded with vLLM's default loader instead of the cache (%s: %s)",
                    model_config.model,
                    type(exc).__name__,
                    exc,
                )
            model: nn.Module = DefaultModelLoader(self._fallback_config()).load_model(
                vllm_config=vllm_config, model_config=model_config, prefix=prefix
            )
            return model

        def _load_from_cache(self, vllm_config: Any, model_config: Any, prefix: str) -> nn.Module:
            device = torch.device(self.load_config.device or vllm_config.device_config.device)
            mode = self.options["mode"]
            weights = self._fetch(model_config, mode, device)
            try:
                with set_default_torch_dtype(model_config.dtype), device, empty_parameters():
                    model: nn.Module = initialize_model(
                        vllm_config=vllm_config, model_config=model_config, prefix=prefix
                    )
                report = attach(model, weights, strict=False)
                with weights_already_processed():
                    process_weights_after_loading(model, model_config, device)
            except BaseException:
                weights.release_sync()
                raise
            if mode == "zero_copy":
                self.weights = weights
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the meta-init's transient parameter allocations
            log.info(
                "wcache: %s: %d parameters and %d buffers from the daemon (%s), %d unused cached tensors",
                model_config.model,
                report.parameters,
                report.buffers,
                mode,
                len(report.unused),
            )
            return model.eval()

    return WCacheModelLoader


def register() -> None:
    """The ``vllm.general_plugins`` entry point: add ``--load-format wcache`` to vLLM."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(_loader_class())
